"""The data loader role: how ``PersiaBatch``es enter a job.

- :mod:`~stream_persia.loader.data_ctx`: ``DataCtx`` (PERSIA's), to Kafka or broker-less.
- :mod:`~stream_persia.loader.direct_sender`: the broker-less path (``ingest`` RPCs).
- :mod:`~stream_persia.loader.produce`: ``stream-persia produce`` (a file through a mapping).
- :mod:`~stream_persia.loader.readers`: chunked CSV/TSV/npz readers.
"""
