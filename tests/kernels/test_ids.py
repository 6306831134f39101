"""The slot prefix has one spelling (stream_persia.kernels.ids); the schema uses it."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from stream_persia.config import EmbeddingSchema
from stream_persia.kernels.ids import index_prefix, prefix_ids

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("group, bits, expected", [
    (0, 8, 1 << 56), (99, 12, 100 << 52), (2, 2, 3 << 62), (5, 0, 0)])
def test_index_prefix_is_persias_formula(group, bits, expected):
    assert index_prefix(group, bits) == expected


def test_the_schema_prefixes_with_the_one_function():
    schema = EmbeddingSchema.from_dict({"feature_index_prefix_bit": 12, "slots_config": {
        "a": {"dim": 2}, "b": {"dim": 2}}, "feature_groups": {"g": ["b"]}})
    ids = np.array([0, 12, 2**52 - 1, 2**64 - 1], np.uint64)
    for name in ("a", "b"):
        assert schema.slot(name).index_prefix == index_prefix(schema.group_index(name), 12)
        assert schema.prefix_ids(name, ids).tolist() == prefix_ids(
            ids, index_prefix=schema.slot(name).index_prefix, prefix_bits=12).tolist()


def test_prefix_and_bits_cannot_be_swapped_by_position():
    with pytest.raises(TypeError):
        prefix_ids(np.array([1], np.uint64), 1 << 56, 8)  # type: ignore[misc]


def _shifts_by_64_minus(path: Path) -> bool:
    """Whether the code (not the docs) of ``path`` computes ``x << (64 - y)``."""
    return any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.LShift)
               and isinstance(n.right, ast.BinOp) and isinstance(n.right.op, ast.Sub)
               and isinstance(n.right.left, ast.Constant) and n.right.left.value == 64
               for n in ast.walk(ast.parse(path.read_text())))


def test_no_other_module_computes_the_prefix_shift():
    spelled = sorted(str(p.relative_to(ROOT)) for d in ("stream_persia", "api")
                     for p in (ROOT / d).rglob("*.py")
                     if p.resolve().is_relative_to(ROOT / d) and _shifts_by_64_minus(p))
    assert spelled == ["stream_persia/kernels/ids.py"]
