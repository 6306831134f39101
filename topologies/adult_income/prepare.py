"""UCI Adult (Census Income) -> ids, standardised numerics and labels.

The vocabulary of each categorical column and the statistics of each numeric column are
fitted on the training split (``adult.data``) only, then applied unchanged to the test
split (``adult.test``): fitting a separate encoding per split would give one category
different ids in train and test. A test category never seen in training maps to the
reserved id :data:`UNSEEN` (0), which the model also meets for ids it never trained on.
``?`` (missing) is kept as a category of its own: whether a value is missing is itself
informative here (e.g. occupation ``?`` mostly means not employed).

    python prepare.py --data-dir ../../../shared/data/adult    # prints a summary
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["CATEGORICAL", "NUMERIC", "COLUMNS", "UNSEEN", "Encoder", "Split", "read_rows",
           "parse_lines",
           "load", "resolve_data_dir"]

COLUMNS = ("age", "workclass", "fnlwgt", "education", "education_num", "marital_status",
           "occupation", "relationship", "race", "sex", "capital_gain", "capital_loss",
           "hours_per_week", "native_country", "income")
CATEGORICAL = ("workclass", "education", "marital_status", "occupation", "relationship",
               "race", "sex", "native_country")
NUMERIC = ("age", "fnlwgt", "education_num", "capital_gain", "capital_loss", "hours_per_week")
#: Heavy-tailed columns, standardised after log1p.
LOG1P = ("fnlwgt", "capital_gain", "capital_loss")
UNSEEN = 0
TRAIN_FILE, TEST_FILE = "adult.data", "adult.test"
OBTAIN = ("download adult.data and adult.test from the UCI Machine Learning Repository "
          "(https://archive.ics.uci.edu/dataset/2/adult, 'Census Income') into one folder "
          "and pass it with --data-dir (or STREAM_PERSIA_DATA)")


def read_rows(path: str | Path) -> np.ndarray:
    """The file's rows as an (n, 15) array of stripped strings (see :func:`parse_lines`)."""
    with open(path, encoding="utf-8") as f:
        return parse_lines(f, str(path))


def parse_lines(lines: Iterable[str], where: str = "<lines>") -> np.ndarray:
    """Rows of Adult text lines as an (n, 15) array of stripped strings.

    Skips blank lines and ``adult.test``'s first line (``|1x3 Cross validator``) and
    drops the ``.`` that ends ``adult.test``'s labels.

    Raises:
        ValueError: a row without 15 fields (names the file and line), or no rows.
    """
    rows = []
    for lineno, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("|"):
            continue
        fields = [x.strip() for x in line.split(",")]
        if len(fields) != len(COLUMNS):
            raise ValueError(f"{where}:{lineno}: expected {len(COLUMNS)} comma-separated "
                             f"fields, got {len(fields)}: {line[:80]!r}")
        fields[-1] = fields[-1].rstrip(".")
        rows.append(fields)
    if not rows:
        raise ValueError(f"{where}: no rows")
    return np.array(rows, dtype=str)


@dataclass(frozen=True)
class Split:
    """One encoded split.

    Attributes:
        ids: (n, 8) uint64, one id per categorical column in :data:`CATEGORICAL` order
            (1.. for known categories, :data:`UNSEEN` otherwise).
        dense: (n, 6) float32, :data:`NUMERIC` standardised with training statistics.
        label: (n,) float32, 1 for income ``>50K``.
    """

    ids: np.ndarray
    dense: np.ndarray
    label: np.ndarray

    def __len__(self) -> int:
        return len(self.label)

    def take(self, index: np.ndarray) -> Split:
        return Split(self.ids[index], self.dense[index], self.label[index])


@dataclass(frozen=True)
class Encoder:
    """Vocabularies and numeric statistics, fitted on the training rows only.

    Attributes:
        vocab: column -> sorted array of the categories seen in training; category
            ``vocab[c][k]`` gets id ``k + 1``.
        mean, std: per :data:`NUMERIC` column, of the (log1p'd) training values.
    """

    vocab: dict[str, np.ndarray]
    mean: np.ndarray
    std: np.ndarray

    @classmethod
    def fit(cls, rows: np.ndarray) -> Encoder:
        vocab = {c: np.unique(rows[:, COLUMNS.index(c)]) for c in CATEGORICAL}
        x = _numeric(rows)
        std = x.std(axis=0)
        return cls(vocab, x.mean(axis=0), np.where(std > 0, std, 1.0))

    def encode(self, rows: np.ndarray) -> Split:
        ids = np.empty((len(rows), len(CATEGORICAL)), np.uint64)
        for k, c in enumerate(CATEGORICAL):
            ids[:, k] = self.ids_of(c, rows[:, COLUMNS.index(c)])
        dense = ((_numeric(rows) - self.mean) / self.std).astype(np.float32)
        label = (rows[:, COLUMNS.index("income")] == ">50K").astype(np.float32)
        return Split(ids, dense, label)

    def ids_of(self, column: str, values: np.ndarray) -> np.ndarray:
        """Vectorised lookup: ids of ``values`` in ``column``'s vocabulary (0 if unseen)."""
        vocab = self.vocab[column]
        values = np.asarray(values, dtype=vocab.dtype if len(vocab) else str)
        pos = np.searchsorted(vocab, values)
        pos_c = np.minimum(pos, len(vocab) - 1)
        known = (pos < len(vocab)) & (vocab[pos_c] == values)
        return np.where(known, pos_c + 1, UNSEEN).astype(np.uint64)

    def vocab_sizes(self) -> dict[str, int]:
        """Ids per column including the reserved one."""
        return {c: len(v) + 1 for c, v in self.vocab.items()}


def _numeric(rows: np.ndarray) -> np.ndarray:
    cols = []
    for c in NUMERIC:
        try:
            x = rows[:, COLUMNS.index(c)].astype(np.float64)
        except ValueError as e:
            raise ValueError(f"column {c!r} has a non-numeric value: {e}") from None
        cols.append(np.log1p(np.maximum(x, 0.0)) if c in LOG1P else x)
    return np.stack(cols, axis=1)


def resolve_data_dir(data: str | None) -> Path:
    """``data`` if given; else ``<project root>/../shared/data/adult`` when it exists.

    Raises:
        SystemExit: no usable folder; the message says where to get the data.
    """
    project_root = Path(__file__).resolve().parents[2]
    candidates = [Path(data)] if data else [project_root.parent / "shared" / "data" / "adult"]
    for d in candidates:
        if (d / TRAIN_FILE).is_file() and (d / TEST_FILE).is_file():
            return d
    where = candidates[0]
    raise SystemExit(f"the Adult data is not in {where} (need {TRAIN_FILE} and {TEST_FILE}): "
                     f"{OBTAIN}")


def load(data_dir: str | Path) -> tuple[Split, Split, Encoder]:
    """Read, fit on train, encode both splits: ``(train, test, encoder)``."""
    data_dir = Path(data_dir)
    train_rows = read_rows(data_dir / TRAIN_FILE)
    test_rows = read_rows(data_dir / TEST_FILE)
    encoder = Encoder.fit(train_rows)
    return encoder.encode(train_rows), encoder.encode(test_rows), encoder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", default=None)
    args = ap.parse_args()
    train, test, enc = load(resolve_data_dir(args.data_dir))
    print(f"train {len(train)} rows ({train.label.mean():.3f} positive), "
          f"test {len(test)} rows ({test.label.mean():.3f} positive)")
    for k, c in enumerate(CATEGORICAL):
        unseen = int((test.ids[:, k] == UNSEEN).sum())
        print(f"  {c:15s} {enc.vocab_sizes()[c]:3d} ids, {unseen} unseen in test")


if __name__ == "__main__":
    main()
