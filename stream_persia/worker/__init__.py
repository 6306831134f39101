"""The embedding worker: buffers ID features, looks embeddings up on the embedding servers,
pools them per slot for the NN workers and sends gradients back (DESIGN.md §1).

:mod:`stream_persia.worker.batchplan` (a whole batch: what the servers pool, what the worker
pools, the gradients) and :mod:`stream_persia.worker.pooling` (one slot's plan, pooling and
gradient) hold its pure logic, with no I/O in them; the numeric kernels are in
:mod:`stream_persia.kernels`.
"""
