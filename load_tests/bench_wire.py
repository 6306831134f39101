"""Encode/decode throughput of a PersiaBatch frame against plain msgpack baselines.

A 1024-sample batch with 26 ID slots (1..20 ids per sample), 13 dense float32 features and
one label. Baselines run in the same invocation:

- ``msgpack lists``: the same content as nested Python lists (what a naive loader sends);
- ``msgpack bin``: arrays as inline ``bin`` (tobytes on encode, a copying frombuffer on
  decode), i.e. the best one can do without out-of-band array data.

Run: ``python load_tests/bench_wire.py [--batch 1024] [--slots 26] [--repeat 20]``.
Figures are machine-dependent; read the ratios.
"""

from __future__ import annotations

import argparse
import time

import msgpack
import numpy as np

from stream_persia.core import wire
from stream_persia.embedding.data import IDTypeFeature, Label, NonIDTypeFeature, PersiaBatch


def make_batch(batch: int, slots: int, seed: int = 0) -> PersiaBatch:
    rng = np.random.default_rng(seed)
    id_features = []
    for s in range(slots):
        lengths = rng.integers(1, 21, size=batch)
        values = rng.integers(0, 2 ** 63, size=int(lengths.sum()), dtype=np.uint64)
        offsets = np.zeros(batch + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        id_features.append(IDTypeFeature.from_csr(f"slot_{s}", values, offsets))
    dense = [NonIDTypeFeature(rng.random((batch, 13), dtype=np.float32), "dense")]
    labels = [Label(rng.integers(0, 2, (batch, 1)).astype(np.float32), "ctr")]
    return PersiaBatch(id_features, dense, labels, batch_id=1)


def as_lists(b: PersiaBatch) -> dict:
    return {"id_type_features": [{"name": f.name, "data": [s.tolist() for s in f.data]}
                                 for f in b.id_type_features],
            "non_id_type_features": [f.data.tolist() for f in b.non_id_type_features],
            "labels": [f.data.tolist() for f in b.labels]}


def as_bins(b: PersiaBatch) -> dict:
    return {"id_type_features": [{"name": f.name, "values": f.values.tobytes(),
                                  "offsets": f.offsets.tobytes()} for f in b.id_type_features],
            "non_id_type_features": [f.data.tobytes() for f in b.non_id_type_features],
            "labels": [f.data.tobytes() for f in b.labels]}


def from_bins(d: dict) -> list:
    out = [(np.frombuffer(f["values"], np.uint64).copy(),
            np.frombuffer(f["offsets"], np.int64).copy()) for f in d["id_type_features"]]
    out += [np.frombuffer(x, np.float32).copy() for x in d["non_id_type_features"]]
    return out


def timeit(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--slots", type=int, default=26)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    b = make_batch(args.batch, args.slots)
    frame = b.to_bytes()
    lists, bins = as_lists(b), as_bins(b)
    lists_buf, bins_buf = msgpack.packb(lists), msgpack.packb(bins)
    rows = [
        ("stream-persia frame", len(frame), timeit(b.to_bytes, args.repeat),
         timeit(lambda: PersiaBatch.from_bytes(frame), args.repeat)),
        ("msgpack lists", len(lists_buf), timeit(lambda: msgpack.packb(lists), args.repeat),
         timeit(lambda: msgpack.unpackb(lists_buf), args.repeat)),
        ("msgpack bin", len(bins_buf), timeit(lambda: msgpack.packb(bins), args.repeat),
         timeit(lambda: from_bins(msgpack.unpackb(bins_buf)), args.repeat)),
    ]
    payload = len(frame) / 1e6
    print(f"batch={args.batch} slots={args.slots} ids={sum(len(f.values) for f in b.id_type_features)}"
          f" frame={len(frame) / 1e6:.2f} MB (decode includes full PersiaBatch validation)")
    print(f"{'format':22}{'bytes':>12}{'enc MB/s':>11}{'dec MB/s':>11}{'enc x':>8}{'dec x':>8}")
    base_enc, base_dec = rows[1][2], rows[1][3]
    for name, size, enc, dec in rows:
        print(f"{name:22}{size:>12}{payload / enc:>11.0f}{payload / dec:>11.0f}"
              f"{base_enc / enc:>8.1f}{base_dec / dec:>8.1f}")
    print("MB/s are of the stream-persia frame's payload, so rows compare like for like; "
          "x = speed-up over 'msgpack lists'.")
    print("unpack only (no batch validation): "
          f"{payload / timeit(lambda: wire.unpack(frame), args.repeat):.0f} MB/s")
    lil = [f.data for f in b.id_type_features]
    build = timeit(lambda: [IDTypeFeature(f"s{i}", x) for i, x in enumerate(lil)], args.repeat)
    print(f"IDTypeFeature from per-sample arrays (LIL -> CSR), all slots: {build * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
