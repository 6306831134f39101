"""The Taobao ad schema (DeepRec model zoo's PLE example) and its encoding into batches.

A row has 20 columns (``COLUMNS``): the labels ``clk`` and ``buy``, 17 string features
and the integer ``price``. The model uses 16 of the string features, each hashed into a
bucket of the reference's size, plus ``price`` as an identity feature with 50 buckets;
every embedding has dim 16. ``final_gender_code`` is read but, as in the reference, not
used. ``tag_category_list`` and ``tag_brand_list`` hold ``|``-separated lists: they are
multi-id slots whose embeddings are summed (scaled by 1/sqrt(n)).

stream-persia needs no hash buckets (ids are uint64 and the embedding servers hold any
of them); they are kept so that the feature set matches the reference. An id is
``stable_hash64(raw) % bucket_size``; a raw value is the integer in the CSV (the data set
uses integer codes) or, for any other text, a hash of the text.

Both sources produce a :class:`RawChunk` — :mod:`generator` (the default) and
:func:`read_csv` (``--data-file``) — and :func:`to_persia_batch` encodes either.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stream_persia.embedding.data import (
    IDTypeFeature,
    IDTypeFeatureWithSingleID,
    Label,
    PersiaBatch,
)
from stream_persia.kernels.sharding import stable_hash64

__all__ = ["COLUMNS", "LABELS", "BUCKETS", "MULTI_ID", "SINGLE_ID", "SLOTS", "PRICE_BUCKETS",
           "DIM", "RawChunk", "encode_ids", "to_persia_batch", "read_csv"]

COLUMNS = ("clk", "buy", "pid", "adgroup_id", "cate_id", "campaign_id", "customer", "brand",
           "user_id", "cms_segid", "cms_group_id", "final_gender_code", "age_level",
           "pvalue_level", "shopping_level", "occupation", "new_user_class_level",
           "tag_category_list", "tag_brand_list", "price")
LABELS = ("clk", "buy")
#: Hash bucket size per feature (reference 004's table).
BUCKETS = {
    "pid": 10, "adgroup_id": 100_000, "cate_id": 10_000, "campaign_id": 100_000,
    "customer": 100_000, "brand": 100_000, "user_id": 100_000, "cms_segid": 100,
    "cms_group_id": 100, "age_level": 10, "pvalue_level": 10, "shopping_level": 10,
    "occupation": 10, "new_user_class_level": 10, "tag_category_list": 100_000,
    "tag_brand_list": 100_000,
}
MULTI_ID = ("tag_category_list", "tag_brand_list")
#: Single-valued string columns, as read (``final_gender_code`` included, unused).
SINGLE_ID = tuple(c for c in COLUMNS[2:-1] if c not in MULTI_ID)
PRICE_BUCKETS = 50
#: The model's slots in ``embedding_config.yml`` order: 16 hashed features, then price.
SLOTS = tuple(BUCKETS) + ("price",)
DIM = 16


@dataclass(frozen=True)
class RawChunk:
    """Rows before encoding.

    Attributes:
        clk, buy: (n,) float32 labels.
        single: column -> (n,) int64 raw values (every column of :data:`SINGLE_ID`).
        multi: column -> (values int64, offsets int64 of length n + 1), CSR lists.
        price: (n,) int64.
        p_click, p_buy: the true probabilities of the labels (generated data only).
    """

    clk: np.ndarray
    buy: np.ndarray
    single: dict[str, np.ndarray]
    multi: dict[str, tuple[np.ndarray, np.ndarray]]
    price: np.ndarray
    p_click: np.ndarray | None = None
    p_buy: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.clk)


def encode_ids(column: str, raw: np.ndarray) -> np.ndarray:
    """Ids of raw values: ``stable_hash64(raw) % bucket`` (price: clipped identity)."""
    raw = np.asarray(raw, dtype=np.int64)
    if column == "price":
        return np.clip(raw, 0, PRICE_BUCKETS - 1).astype(np.uint64)
    return stable_hash64(raw.view(np.uint64)) % np.uint64(BUCKETS[column])


def to_persia_batch(chunk: RawChunk, *, requires_grad: bool = True,
                    with_labels: bool = True) -> PersiaBatch:
    """Encode rows into a ``PersiaBatch`` with the :data:`SLOTS` and labels click, buy."""
    feats: list[IDTypeFeature] = []
    for name in SLOTS:
        if name in MULTI_ID:
            values, offsets = chunk.multi[name]
            feats.append(IDTypeFeature.from_csr(name, encode_ids(name, values), offsets))
        else:
            raw = chunk.price if name == "price" else chunk.single[name]
            feats.append(IDTypeFeatureWithSingleID(name, encode_ids(name, raw)))
    labels = None
    if with_labels:
        labels = [Label(chunk.clk.reshape(-1, 1).astype(np.float32), "click"),
                  Label(chunk.buy.reshape(-1, 1).astype(np.float32), "buy")]
    return PersiaBatch(feats, labels=labels, requires_grad=requires_grad)


# ---------------------------------------------------------------------------- CSV
def _text_codes(texts: np.ndarray) -> np.ndarray:
    """int64 raw values of a text column: the integer itself, else a hash of the text.

    Works per distinct value (a column has few compared to its rows). Empty text (a
    missing value) becomes -1, its own id.
    """
    uniq, inverse = np.unique(texts, return_inverse=True)
    codes = np.empty(len(uniq), np.int64)
    for k, t in enumerate(uniq):
        t = t.strip()
        if not t:
            codes[k] = -1
            continue
        try:
            codes[k] = int(t)
        except ValueError:
            codes[k] = int.from_bytes(hashlib.blake2b(t.encode(), digest_size=8).digest(),
                                      "little", signed=True)
    return codes[inverse.reshape(-1)]


def _split_lists(texts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``|``-separated lists -> CSR (values, offsets); empty text is an empty list."""
    texts = np.char.strip(texts.astype(str))
    present = texts != ""
    lengths = np.where(present, np.char.count(texts, "|") + 1, 0)
    offsets = np.zeros(len(texts) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.array("|".join(texts[present]).split("|")) if present.any() else np.array([])
    values = _text_codes(tokens) if len(tokens) else np.zeros(0, np.int64)
    return values, offsets


def parse_rows(rows: np.ndarray, where: str = "<rows>") -> RawChunk:
    """(n, 20) text array -> :class:`RawChunk`."""
    if rows.ndim != 2 or rows.shape[1] != len(COLUMNS):
        raise ValueError(f"{where}: expected {len(COLUMNS)} comma-separated columns "
                         f"({', '.join(COLUMNS)}), got rows of shape {rows.shape}")
    col = {c: rows[:, k] for k, c in enumerate(COLUMNS)}
    try:
        clk = col["clk"].astype(np.int64)
        buy = col["buy"].astype(np.int64)
        price = np.char.strip(col["price"]).astype(np.float64).astype(np.int64)
    except ValueError as e:
        raise ValueError(f"{where}: clk, buy and price must be integers: {e}") from None
    return RawChunk(clk=clk.astype(np.float32), buy=buy.astype(np.float32),
                    single={c: _text_codes(col[c]) for c in SINGLE_ID},
                    multi={c: _split_lists(col[c]) for c in MULTI_ID}, price=price)


def read_csv(path: str | Path, chunk_rows: int = 65_536, skip: int = 0,
             limit: int | None = None) -> Iterator[RawChunk]:
    """Chunks of a Taobao CSV (20 columns, no header, the reference's format).

    Args:
        path: the file.
        chunk_rows: rows per chunk.
        skip: rows to skip first.
        limit: rows to read at most (after ``skip``); None = to the end.
    """
    path = Path(path)
    with open(path, encoding="utf-8") as f:
        for _ in range(skip):
            if not f.readline():
                return
        done = 0
        while limit is None or done < limit:
            n = chunk_rows if limit is None else min(chunk_rows, limit - done)
            lines = [line for line in (f.readline() for _ in range(n)) if line.strip()]
            if not lines:
                return
            rows = np.array([line.rstrip("\r\n").split(",") for line in lines], dtype=object)
            if rows.ndim != 2:
                bad = next(i for i, line in enumerate(lines) if line.count(",") != 19)
                raise ValueError(f"{path}: row {skip + done + bad + 1} does not have "
                                 f"{len(COLUMNS)} columns")
            yield parse_rows(rows.astype(str), f"{path} rows {skip + done + 1}..")
            done += len(lines)


def count_rows(path: str | Path) -> int:
    """Non-empty lines of a file."""
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())
