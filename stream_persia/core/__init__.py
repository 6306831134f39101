"""What every role shares: the batch data model, the wire format, and the runtime habits.

- :mod:`~stream_persia.core.data`: ``PersiaBatch`` and its features (PERSIA's
  ``persia.embedding.data``); :mod:`~stream_persia.core.optim`: the embedding optimizers;
  :mod:`~stream_persia.core.embedding_config`: ``EmbeddingConfig``.
- :mod:`~stream_persia.core.wire`: the one msgpack wire format of Kafka values and RPC frames.
- :mod:`~stream_persia.core.watermarks`: how far the servers applied each Kafka partition.
- :mod:`~stream_persia.core.aio`, :mod:`~stream_persia.core.backoff`,
  :mod:`~stream_persia.core.lifecycle`, :mod:`~stream_persia.core.supervisor`,
  :mod:`~stream_persia.core.metrics`, :mod:`~stream_persia.core.logger`: event loops,
  start-up retries, signals and drains, supervised tasks, Prometheus metrics, logging.

Nothing here imports a role package (``server``, ``worker``, ``nn``, ``loader``, ``launch``).
"""
