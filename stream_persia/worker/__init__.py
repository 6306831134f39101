"""The embedding worker: buffers ID features, looks embeddings up on the embedding servers,
pools them per slot for the NN workers and sends gradients back (DESIGN.md §1).

:mod:`stream_persia.worker.pooling` holds its pure logic (planning, pooling, gradient
reduction), with no I/O in it.
"""
