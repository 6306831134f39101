"""Progressive validation's accumulator against exact references written here in numpy
(pairwise AUC, log loss, NE and calibration over the last N samples and over all)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from stream_persia.config import GlobalConfig, ProgressiveConfig
from stream_persia.errors import BadInput, ConfigError, Misuse
from stream_persia.nn.progressive import EPS, ProgressiveValidation, auc_exact


def ref_auc(p: np.ndarray, y: np.ndarray) -> float:
    """Every (positive, negative) pair: 1 if the positive scores higher, 1/2 on a tie."""
    pos, neg = p[y == 1][:, None], p[y == 0][None, :]
    return float(((pos > neg) + 0.5 * (pos == neg)).mean())


def ref_metrics(p: np.ndarray, y: np.ndarray) -> dict[str, float]:
    q = np.clip(p.astype(np.float64), EPS, 1 - EPS)
    ll = float(np.mean(-(y * np.log(q) + (1 - y) * np.log(1 - q))))
    r = y.mean()
    h = -(r * math.log(r) + (1 - r) * math.log(1 - r))
    return {"auc": ref_auc(p, y), "log_loss": ll, "ne": ll / h,
            "calibration": float(p.astype(np.float64).sum() / y.sum())}


def batches(seed: int, sizes: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for n in sizes:
        score = rng.random(n)
        y = (rng.random(n) < 0.2 + 0.6 * score).astype(np.float32)
        # rounded: many ties, which the AUC must count one half
        p = np.round(0.05 + 0.9 * score, 2).astype(np.float32)
        out.append((p.reshape(n, 1), y.reshape(n, 1)))
    return out


def test_auc_matches_the_pairwise_definition_with_ties():
    rng = np.random.default_rng(0)
    for n in (2, 7, 300):
        p = np.round(rng.random(n), 1)
        y = (rng.random(n) < 0.4).astype(np.uint8)
        y[0], y[1] = 0, 1
        assert auc_exact(p, y) == pytest.approx(ref_auc(p, y), abs=1e-12)
    assert auc_exact(np.array([0.1, 0.9]), np.array([1, 1])) is None


@pytest.mark.parametrize("window", [1000, 64])
def test_windowed_and_lifetime_metrics_are_exact(window):
    # sizes that wrap the ring mid-batch and one batch larger than the window
    data = batches(1, [100, 250, 333, 400, 1200, 17, 480, 90, 600, 30, 50, 7, 41])
    pv = ProgressiveValidation(window)
    for p, y in data:
        pv.add([p], [y])
    m = pv.read()["task0"]
    p_all = np.concatenate([p.ravel() for p, _ in data])
    y_all = np.concatenate([y.ravel() for _, y in data])
    last = ref_metrics(p_all[-window:], y_all[-window:])
    life = ref_metrics(p_all, y_all)
    assert m["samples"] == p_all.size and m["window_samples"] == window
    assert m["window"] == window and m["skipped"] == 0
    for k in ("auc", "log_loss", "ne", "calibration"):
        assert m[k] == pytest.approx(last[k], rel=1e-6), k
    assert m["lifetime_log_loss"] == pytest.approx(life["log_loss"], rel=1e-6)
    assert m["lifetime_ne"] == pytest.approx(life["ne"], rel=1e-6)
    assert m["lifetime_calibration"] == pytest.approx(life["calibration"], rel=1e-6)


def test_ranks_merge_to_the_metrics_of_all_their_samples():
    a, b = (ProgressiveValidation(1000, world_size=2, tasks=["click", "buy"])
            for _ in range(2))
    data_a, data_b = batches(2, [300, 400]), batches(3, [200, 350])
    for pv, data in ((a, data_a), (b, data_b)):
        for p, y in data:
            pv.add([p, 1 - p], [y, 1 - y])

    got = a.read(lambda own: [own, b.state()])    # what all_gather_object returns on rank 0
    assert list(got) == ["click", "buy"]
    # each rank keeps half the window: its last 500 samples
    p = np.concatenate([np.concatenate([q.ravel() for q, _ in d])[-500:]
                        for d in (data_a, data_b)])
    y = np.concatenate([np.concatenate([t.ravel() for _, t in d])[-500:]
                        for d in (data_a, data_b)])
    assert got["click"]["window_samples"] == 1000
    assert got["click"]["samples"] == 1250
    assert got["click"]["auc"] == pytest.approx(ref_auc(p, y), rel=1e-9)
    assert got["buy"]["auc"] == pytest.approx(ref_auc(1 - p, 1 - y), rel=1e-6)


def test_samples_without_a_probability_or_a_binary_label_are_counted_and_skipped():
    pv = ProgressiveValidation(100)
    p = np.array([0.2, np.nan, 0.7, 0.9, 0.4, np.inf], np.float32)
    y = np.array([0, 1, 1, 2, 0.5, 1], np.float32)
    pv.add([p], [y])
    m = pv.read()["task0"]
    assert m["skipped"] == 4 and m["samples"] == 2 and m["window_samples"] == 2
    assert m["not_probabilities"] == 0
    assert m["auc"] == 1.0
    assert math.isfinite(m["log_loss"])


def test_a_model_that_outputs_logits_has_no_figures():
    """Logits (a model trained with BCEWithLogitsLoss): the samples whose logit fell in
    [0, 1] were scored as if it were a probability and the rest skipped, so the task read
    an AUC, NE and calibration of that biased subset, and nothing said they were wrong
    but a 'skipped' count. From the first prediction outside [0, 1], every figure of the
    task is None, merged over ranks too."""
    rng = np.random.default_rng(0)
    y = (rng.random(1000) < 0.3).astype(np.float32)
    logits = rng.normal(size=1000).astype(np.float32) + 2 * y
    pv = ProgressiveValidation(10_000, world_size=2, tasks=["click"])
    pv.add([1 / (1 + np.exp(-logits[:500]))], [y[:500]])   # probabilities at first
    assert pv.read()["click"]["auc"] is not None
    pv.add([logits[500:]], [y[500:]])
    m = pv.read()["click"]
    assert all(m[k] is None for k in ("auc", "ne", "log_loss", "calibration", "lifetime_ne",
                                      "lifetime_log_loss", "lifetime_calibration"))
    assert m["not_probabilities"] > 0
    other = ProgressiveValidation(10_000, world_size=2, tasks=["click"])
    other.add([1 / (1 + np.exp(-logits))], [y])
    merged = pv.read(lambda state: [state, other.state()])["click"]
    assert merged["auc"] is None and merged["not_probabilities"] == m["not_probabilities"]


def test_inputs_that_do_not_pair_up_are_refused_naming_the_field():
    pv = ProgressiveValidation(100)
    with pytest.raises(BadInput) as e:
        pv.add([np.zeros(3)], [np.zeros(4)])
    assert e.value.field == "predictions"
    with pytest.raises(BadInput) as e:
        pv.add([np.zeros(3), np.zeros(3)], [np.zeros(3)])
    assert e.value.field == "labels"
    pv.add([np.zeros(3)], [np.zeros(3)])
    with pytest.raises(BadInput) as e:
        pv.add([np.zeros(3), np.zeros(3)], [np.zeros(3), np.zeros(3)])
    assert e.value.field == "labels"
    with pytest.raises(BadInput) as e:
        ProgressiveValidation(100, tasks=["a", "b"]).add([np.zeros(3)], [np.zeros(3)])
    assert e.value.field == "tasks"
    for bad in (0, -1, 2.5, True):
        with pytest.raises(Misuse) as m:
            ProgressiveValidation(bad)
        assert m.value.field == "window_samples"


def test_one_class_and_empty_windows_give_none_not_a_number():
    pv = ProgressiveValidation(10)
    assert pv.read() == {}
    pv.add([np.full(5, 0.3)], [np.zeros(5)])
    m = pv.read()["task0"]
    assert m["auc"] is None and m["ne"] is None and m["calibration"] is None
    assert m["log_loss"] == pytest.approx(-math.log(0.7), rel=1e-6)


def test_the_config_section_is_validated_and_named():
    assert GlobalConfig().progressive == ProgressiveConfig(enabled=True, window_samples=100_000)
    cfg = GlobalConfig.from_dict({"progressive": {"enabled": False, "window_samples": 10}})
    assert cfg.progressive == ProgressiveConfig(False, 10)
    for bad in (0, "many", 2.5):
        with pytest.raises(ConfigError) as e:
            GlobalConfig.from_dict({"progressive": {"window_samples": bad}})
        assert e.value.field == "progressive.window_samples"
