"""NN worker of the benchmark job: trains one pass, times it, predicts the eval split.

PERSIA's training loop (``TrainCtx`` + ``DataLoader(StreamingDataset)``) over the model of
``model.py``; rowwise Adagrad on the rows (``vectorwise_shared``), Adam on the MLP, the
hyper-parameters from ``<data>/meta.json`` (the benchmark writes them, and the TorchRec
side reads the same file).

Timed window: from batch ``meta["warmup"]`` until the loop ends, which is once the last
batch's embedding gradients were applied on the server. CPU: the user + system seconds
over the window of every process of the job (the process tree of ``stream-persia run``: the
run itself, the embedding server and worker, the NN worker role, torchrun and this rank, the
data loader), read from ``/proc``; the run is found as the ancestor of this rank whose parent
is the benchmark (``STREAM_PERSIA_BENCH_PID``).

Writes ``<output>/bench.json`` (``samples_per_s``, ``cpu_us_per_sample``, ``cpu_s_by_role``,
``steps``, ``stats``) and ``<output>/eval_pred.npy`` (the eval split's predictions, in
order: the benchmark computes both sides' AUC with one function).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "topologies"))
sys.path.insert(0, str(HERE))

import common  # noqa: E402
from model import Net  # noqa: E402

from stream_persia.ctx import TrainCtx  # noqa: E402
from stream_persia.data import DataLoader, StreamingDataset  # noqa: E402
from stream_persia.embedding import EmbeddingConfig  # noqa: E402
from stream_persia.embedding.data import (  # noqa: E402
    IDTypeFeatureWithSingleID,
    Label,
    NonIDTypeFeature,
    PersiaBatch,
)
from stream_persia.embedding.optim import Adagrad  # noqa: E402

EVAL_BATCH = 4096
#: The benchmark's pid: the job's processes are the tree of its child, the run.
BENCH_PID_ENV = "STREAM_PERSIA_BENCH_PID"


def _stat(pid: int) -> tuple[int, str, float] | None:
    """(parent pid, name, CPU seconds) of a process, None once it is gone. The CPU includes
    that of its children it has reaped: a role that exits inside the window (the data
    loader, once it has sent everything) is still counted, in ``run``'s figure."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            head, tail = f.read().rsplit(")", 1)
    except OSError:
        return None
    fields = tail.split()
    cpu = sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    return int(fields[1]), head.split("(", 1)[1], cpu


def label(pid: int, name: str) -> str:
    """What a process of the job is, from its command line."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return name
    if "torch.distributed.run" in argv or "stream_persia.launch.torchrun" in argv:
        return "torchrun"   # (launch nn-worker runs torchrun through the latter)
    if "stream_persia.launch.rank" in argv:
        return "nn-rank"
    roles = ("embedding-server", "embedding-worker", "nn-worker", "data-loader", "run")
    return next((r for r in roles if r in argv), name)


def job_root() -> int:
    """The ``stream-persia run`` process of this job: the ancestor whose parent is the
    benchmark (``STREAM_PERSIA_BENCH_PID``, which the benchmark sets); this process when run
    otherwise."""
    bench = int(os.environ.get(BENCH_PID_ENV) or 0)
    pid = os.getpid()
    while bench and (st := _stat(pid)) is not None and st[0] > 1:
        if st[0] == bench:
            return pid
        pid = st[0]
    return os.getpid()


def job_cpu(root: int) -> dict[int, tuple[str, float, int]]:
    """(role, CPU seconds, parent pid) of every process in the tree of ``root``, it
    included."""
    procs = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            procs[int(entry)] = st
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in procs and pid not in out:
            out[pid] = (label(pid, procs[pid][1]), procs[pid][2], procs[pid][0])
            todo += [p for p, st in procs.items() if st[0] == pid]
    return out


def eval_batches(data: Path):
    ids = np.load(data / "eval_ids.npy", mmap_mode="r")
    dense = np.load(data / "eval_dense.npy", mmap_mode="r")
    slots = [f"C{k + 1}" for k in range(ids.shape[1])]
    for lo in range(0, len(ids), EVAL_BATCH):
        hi = min(len(ids), lo + EVAL_BATCH)
        yield PersiaBatch(
            [IDTypeFeatureWithSingleID(s, np.ascontiguousarray(ids[lo:hi, k]))
             for k, s in enumerate(slots)],
            non_id_type_features=[NonIDTypeFeature(np.ascontiguousarray(dense[lo:hi]),
                                                   "dense")],
            labels=[Label(np.zeros((hi - lo, 1), np.float32), "click")], requires_grad=False)


def main(argv: list[str] | None = None) -> None:
    settings = common.load_settings(HERE, argv, description=__doc__.split("\n\n")[0])
    if not settings.data or not settings.output_dir:
        raise SystemExit("run it with stream-persia run load_tests/vs_torchrec --data DIR "
                         "(load_tests/bench_vs_torchrec.py does)")
    data, out = Path(settings.data), Path(settings.output_dir)
    meta = json.loads((data / "meta.json").read_text())
    torch.manual_seed(meta["seed"])
    model = Net(meta["slots"], meta["dim"], meta["dense"], meta["mlp"])
    embedding_optimizer = Adagrad(lr=meta["emb_lr"],
                                  initial_accumulator_value=meta["adagrad_initial_accumulator"],
                                  eps=meta["adagrad_eps"], vectorwise_shared=True)
    steps = meta["train_samples"] // settings.batch_size
    warmup = meta["warmup"]
    with TrainCtx(model=model, embedding_optimizer=embedding_optimizer,
                  dense_optimizer=torch.optim.Adam(model.parameters(), lr=meta["dense_lr"]),
                  embedding_config=EmbeddingConfig(
                      emb_initialization=(-meta["emb_init"], meta["emb_init"]),
                      admit_probability=1.0),
                  mixed_precision=False) as ctx:
        loader = DataLoader(StreamingDataset(buffer_size=16), timeout_ms=120_000,
                            embedding_staleness=settings.embedding_staleness,
                            max_batches=steps)
        root = job_root()
        t0, cpu0, done = 0.0, {}, 0
        for i, batch in enumerate(loader):
            if i == warmup:
                t0, cpu0 = time.perf_counter(), job_cpu(root)
            output, labels = ctx.forward(batch)
            ctx.backward(torch.nn.functional.binary_cross_entropy(output, labels[0]))
            done += 1
        # the loop ended once the last batch's embedding update was applied
        elapsed, cpu1 = time.perf_counter() - t0, job_cpu(root)
        stats = ctx.stats()
    if done != steps:
        raise SystemExit(f"trained {done} of {steps} batches")
    # A process gone before the window's end (the data loader, once it has sent
    # everything) was reaped by its parent, whose figure (cutime) now holds all its CPU,
    # from before the window too: that part is taken off the parent's role.
    by_role: dict[str, float] = {}
    for pid, (name, c0, parent) in cpu0.items():
        if pid in cpu1:
            by_role[name] = by_role.get(name, 0.0) + cpu1[pid][1] - c0
        else:
            role = cpu0[parent][0] if parent in cpu0 else name
            by_role[role] = by_role.get(role, 0.0) - c0
    samples = (steps - warmup) * settings.batch_size
    preds, _ = common.predict(model, eval_batches(data))
    np.save(out / "eval_pred.npy", preds[0])
    result = {"samples_per_s": samples / elapsed,
              "cpu_us_per_sample": sum(by_role.values()) / samples * 1e6,
              "cpu_s_by_role": {k: round(v, 3) for k, v in by_role.items()},
              "processes": len(cpu0), "job_root_is_run": root != os.getpid(),
              "steps": steps, "samples": samples,
              "torch_threads": torch.get_num_threads(),
              "embedding_staleness": settings.embedding_staleness, "stats": stats}
    (out / "bench.json").write_text(json.dumps(result, indent=1, default=str))
    common.log("nn-worker", f"{result['samples_per_s']:.0f} samples/s, "
                            f"{result['cpu_us_per_sample']:.1f} CPU us/sample")


if __name__ == "__main__":
    main()
