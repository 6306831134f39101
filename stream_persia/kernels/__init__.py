"""Pure numeric kernels on id arrays, shared by the worker, the server and the API.

- :mod:`~stream_persia.kernels.sharding`: which server owns an id and which worker reads a
  partition; the id hashes (``stable_hash64``, SplitMix64's finaliser).
- :mod:`~stream_persia.kernels.ids`: a slot's id transforms (prefix, hash stack) and
  de-duplication by sort.
- :mod:`~stream_persia.kernels.segments`: de-duplication, pooling and gradient scatter over
  segments (Cython ``_segments`` without the GIL, with a numpy twin), and the worker's
  segment sums (torch's ``embedding_bag``, with a numpy twin).
- :mod:`~stream_persia.kernels.twins`: the one flag (``STREAM_PERSIA_PURE_PYTHON``) that
  picks every pure-Python twin.

No I/O, no asyncio, no roles: numpy arrays in, numpy arrays out.
"""
