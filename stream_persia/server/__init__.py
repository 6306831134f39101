"""The embedding server role: one shard of every embedding table (PERSIA's embedding PS).

- :mod:`~stream_persia.server.service`: the RPC service (lookup, update, dump, load,
  watermarks) and ``serve``.
- :mod:`~stream_persia.server.store`: the row store, Cython ``_cstore`` (LRU, optimizer
  state, no GIL) with its pure-Python twin :mod:`~stream_persia.server._pystore`;
  :mod:`~stream_persia.server.sharded`: a store split over threads.
- :mod:`~stream_persia.server.shard_files`: the shard file format and its all-or-nothing load.
"""
