"""Where the Taobao job's rows come from: the generated stream, or CSV files.

The setting ``data`` (``--data-file``/``--data-dir``, env ``STREAM_PERSIA_DATA``) picks:

- unset: the generated stream (:mod:`generator`): training samples ``0 .. samples-1``,
  evaluation on ``eval_samples`` held-out samples, Bayes-optimal AUCs known.
- a directory holding ``taobao_train_data`` and ``taobao_test_data`` (the reference's
  layout): training rows from the first, evaluation rows from the second.
- one CSV file: its last ``eval_samples`` rows are held out for evaluation (a fifth of
  the file when it has fewer than twice that) and the rows before them train.

``samples`` caps the training rows of an epoch (0: all of them); ``eval_samples`` caps
the evaluation rows (0: all the test file; for one file, a fifth of it).
The data loaders and the NN workers both build the same :class:`Plan`, so they agree on
the number of batches. ``STREAM_PERSIA_CONCEPT_SHIFT_AT`` (``--concept-shift-at``) shifts
the generated stream's user and ad mix at that sample (``generator.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for _p in (str(_HERE.parent), str(_HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from common import RunSettings, num_batches  # noqa: E402
from generator import TaobaoStream, shift_at_from_env  # noqa: E402
from schema import RawChunk, count_rows, read_csv  # noqa: E402

__all__ = ["Plan", "plan"]

TRAIN_FILE, TEST_FILE = "taobao_train_data", "taobao_test_data"


@dataclass(frozen=True)
class Plan:
    """The rows of one run.

    Attributes:
        kind: ``"generated"`` or ``"csv"``.
        train_rows, eval_rows: rows per training epoch and for evaluation.
        train_file, eval_file: CSV files (csv only).
        train_skip, eval_skip: rows skipped at the start of each file.
        shift_at: the generated stream's distribution shift (-1: none).
    """

    kind: str
    train_rows: int
    eval_rows: int
    seed: int = 0
    train_file: Path | None = None
    eval_file: Path | None = None
    train_skip: int = 0
    eval_skip: int = 0
    shift_at: int = -1

    @property
    def generated(self) -> bool:
        return self.kind == "generated"

    def stream(self) -> TaobaoStream:
        return TaobaoStream(seed=self.seed, shift_at=self.shift_at)

    def train_batches(self, batch_size: int, replica_index: int = 0, replica_size: int = 1
                      ) -> Iterator[RawChunk]:
        """One epoch's batches ``b`` with ``b % replica_size == replica_index``."""
        count = num_batches(self.train_rows, batch_size)
        if self.generated:
            stream = self.stream()
            for b in range(replica_index, count, replica_size):
                start = b * batch_size
                yield stream.samples(start, min(batch_size, self.train_rows - start))
            return
        chunks = read_csv(self.train_file, batch_size, self.train_skip, self.train_rows)
        for b, chunk in enumerate(chunks):
            if b % replica_size == replica_index:
                yield chunk

    def eval_batches(self, batch_size: int) -> Iterator[RawChunk]:
        if self.generated:
            stream = self.stream()
            for start in range(0, self.eval_rows, batch_size):
                yield stream.eval_samples(min(batch_size, self.eval_rows - start), start)
            return
        yield from read_csv(self.eval_file, batch_size, self.eval_skip, self.eval_rows)


def plan(settings: RunSettings) -> Plan:
    """The :class:`Plan` of ``settings`` (see the module docstring).

    Raises:
        SystemExit: the data path does not exist or is not in the Taobao layout.
    """
    data = settings.data
    shift_at = shift_at_from_env()
    if not data:
        return Plan("generated", settings.samples, settings.eval_samples, seed=settings.seed,
                    shift_at=shift_at)
    if shift_at >= 0:
        raise SystemExit(f"a distribution shift (STREAM_PERSIA_CONCEPT_SHIFT_AT={shift_at}, "
                         "--concept-shift-at) needs the generated stream, not --data")
    path = Path(data)
    if path.is_dir():
        train, test = path / TRAIN_FILE, path / TEST_FILE
        if not (train.is_file() and test.is_file()):
            raise SystemExit(f"{path} holds neither both {TRAIN_FILE} and {TEST_FILE}: give "
                             "that directory (the reference's layout) or one CSV file")
        n_train, n_test = count_rows(train), count_rows(test)
        return Plan("csv", _cap(n_train, settings.samples), _cap(n_test, settings.eval_samples),
                    settings.seed, train, test)
    if not path.is_file():
        raise SystemExit(f"--data-file {path}: no such file or directory")
    total = count_rows(path)
    held = settings.eval_samples if 0 < 2 * settings.eval_samples <= total else total // 5
    if held < 1 or total - held < 1:
        raise SystemExit(f"{path} has {total} rows: too few to hold some out for evaluation")
    return Plan("csv", _cap(total - held, settings.samples), held, settings.seed, path, path,
                train_skip=0, eval_skip=total - held)


def _cap(available: int, wanted: int) -> int:
    return min(available, wanted) if wanted else available
