"""Pure numeric kernels on id arrays, shared by the worker, the server and the API.

- :mod:`~stream_persia.kernels.sharding`: which server owns an id (the id hash), which
  worker reads a partition, the slot prefix of an id.
- :mod:`~stream_persia.kernels.segments`: de-duplication, pooling and gradient scatter over
  segments (Cython ``_segments`` without the GIL, with a numpy twin).

No I/O, no asyncio, no roles: numpy arrays in, numpy arrays out.
"""
