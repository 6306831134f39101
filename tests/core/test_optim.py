"""Embedding optimizers: PERSIA's signatures, validation, serialisation and the numerics of
``Optimizer.step`` against float64 references written out here."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from stream_persia.embedding.optim import SGD, Adagrad, Adam, as_optimizer, optimizer_from_dict
from stream_persia.errors import BadInput


def _params(cls):
    return [(p.name, p.default) for p in inspect.signature(cls).parameters.values()]


def test_signatures_match_persia():
    empty = inspect.Parameter.empty
    assert _params(SGD) == [("lr", empty), ("momentum", 0.0), ("weight_decay", 0.0)]
    assert _params(Adam) == [("lr", 1e-3), ("betas", (0.9, 0.999)), ("weight_decay", 0.0),
                             ("eps", 1e-8)]
    assert _params(Adagrad) == [
        ("lr", 1e-2), ("initial_accumulator_value", 1e-2), ("weight_decay", 0.0),
        ("g_square_momentum", 1.0), ("eps", 1e-10), ("vectorwise_shared", False)]
    # PERSIA's examples construct them positionally with the learning rate only.
    assert SGD(1e-3).lr == Adagrad(1e-3).lr == Adam(1e-3).lr == 1e-3


@pytest.mark.parametrize("make, field", [
    (lambda: SGD(-1.0), "lr"),
    (lambda: SGD(0.1, momentum=1.0), "momentum"),
    (lambda: SGD(0.1, weight_decay=-0.1), "weight_decay"),
    (lambda: SGD("0.1"), "lr"),
    (lambda: Adam(betas=(0.9, 1.0)), "betas"),
    (lambda: Adam(betas=(0.9,)), "betas"),
    (lambda: Adam(eps=0.0), "eps"),
    (lambda: Adam(lr=float("nan")), "lr"),
    (lambda: Adagrad(g_square_momentum=1.5), "g_square_momentum"),
    (lambda: Adagrad(initial_accumulator_value=0.0, eps=0.0), "eps"),
    (lambda: Adagrad(vectorwise_shared="yes"), "vectorwise_shared"),
    (lambda: Adagrad(initial_accumulator_value=-1.0), "initial_accumulator_value"),
])
def test_invalid_hyperparameters_name_the_field(make, field):
    with pytest.raises(BadInput) as info:
        make()
    assert info.value.field == field
    assert field in str(info.value)


@pytest.mark.parametrize("opt", [
    SGD(0.1), SGD(0.1, momentum=0.9, weight_decay=1e-4), Adam(2e-3, betas=(0.8, 0.99)),
    Adagrad(vectorwise_shared=True, g_square_momentum=0.9),
])
def test_dict_round_trip(opt):
    d = opt.to_dict()
    assert d["name"] == opt.name
    assert optimizer_from_dict(d) == opt
    assert as_optimizer(d) == opt
    assert as_optimizer(opt) is opt


def test_from_dict_rejects_unknown_names_and_fields():
    with pytest.raises(BadInput, match="unknown optimizer 'rmsprop'"):
        optimizer_from_dict({"name": "rmsprop"})
    with pytest.raises(BadInput) as info:
        optimizer_from_dict({"name": "sgd", "lr": 0.1, "nesterov": True})
    assert info.value.field == "nesterov"
    with pytest.raises(BadInput, match="optimizer must be"):
        as_optimizer("adagrad")


def test_state_layouts():
    assert SGD(0.1).state_width(16) == 0 and SGD(0.1).state_kind == "sgd"
    assert SGD(0.1, momentum=0.5).state_width(16) == 16
    assert SGD(0.1, momentum=0.5).state_kind == "sgd-momentum"
    assert Adagrad().state_width(16) == 16
    assert Adagrad(vectorwise_shared=True).state_width(16) == 1
    np.testing.assert_array_equal(Adagrad(initial_accumulator_value=0.5).initial_state(3),
                                  np.full(3, 0.5, np.float32))
    assert Adam().state_width(4) == 10
    np.testing.assert_array_equal(Adam().initial_state(2), [0, 0, 0, 0, 1, 1])


def _rand(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_sgd_momentum_and_weight_decay_match_reference():
    opt = SGD(0.05, momentum=0.9, weight_decay=0.01)
    w, s = _rand((3, 5), 0), np.zeros((3, 5), np.float32)
    w64, buf = w.astype(np.float64), np.zeros((3, 5))
    for k in range(4):
        g = _rand((3, 5), k + 1)
        opt.step(w, s, g.copy())
        g64 = g + 0.01 * w64
        buf = 0.9 * buf + g64
        w64 = w64 - 0.05 * buf
    np.testing.assert_allclose(w, w64, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s, buf, rtol=1e-5, atol=1e-6)


def test_plain_sgd_keeps_no_state():
    w, g = _rand((2, 3), 0), _rand((2, 3), 1)
    expected = w - np.float32(0.5) * g
    SGD(0.5).step(w, np.zeros((2, 0), np.float32), g)
    np.testing.assert_array_equal(w, expected)


def test_adam_matches_reference_with_bias_correction():
    opt = Adam(1e-2, betas=(0.8, 0.95), weight_decay=0.1, eps=1e-6)
    d = 4
    w = _rand((2, d), 0)
    s = np.tile(opt.initial_state(d), (2, 1))
    w64, m, v = w.astype(np.float64), np.zeros((2, d)), np.zeros((2, d))
    for t in range(1, 6):
        g = _rand((2, d), t)
        opt.step(w, s, g.copy())
        g64 = g + 0.1 * w64
        m = 0.8 * m + 0.2 * g64
        v = 0.95 * v + 0.05 * g64 * g64
        w64 = w64 - 1e-2 * (m / (1 - 0.8**t)) / (np.sqrt(v / (1 - 0.95**t)) + 1e-6)
    np.testing.assert_allclose(w, w64, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s[:, :d], m, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(s[:, 2 * d:], [[0.8**5, 0.95**5]] * 2, rtol=1e-5)


def test_adagrad_updates_with_the_accumulator_before_adding_g2():
    opt = Adagrad(lr=0.1, initial_accumulator_value=1.0, eps=0.0, g_square_momentum=0.5)
    w = np.ones((1, 2), np.float32)
    s = np.ones((1, 2), np.float32)
    opt.step(w, s, np.array([[2.0, -2.0]], np.float32))
    np.testing.assert_allclose(w, [[1 - 0.1 * 2 / 1.0, 1 + 0.1 * 2 / 1.0]], rtol=1e-6)
    np.testing.assert_allclose(s, [[0.5 + 4.0, 0.5 + 4.0]], rtol=1e-6)


def test_adagrad_vectorwise_shared_uses_the_mean_of_g2():
    opt = Adagrad(lr=0.1, initial_accumulator_value=4.0, eps=0.0, vectorwise_shared=True)
    w = np.zeros((1, 2), np.float32)
    s = np.full((1, 1), 4.0, np.float32)
    opt.step(w, s, np.array([[1.0, 3.0]], np.float32))
    np.testing.assert_allclose(w, [[-0.1 * 1 / 2, -0.1 * 3 / 2]], rtol=1e-6)
    np.testing.assert_allclose(s, [[4.0 + (1 + 9) / 2]], rtol=1e-6)


def test_weight_decay_is_not_ignored():
    w0 = _rand((1, 4), 0)
    for opt_cls in (Adagrad, Adam):
        plain, decayed = w0.copy(), w0.copy()
        a, b = opt_cls(lr=0.1), opt_cls(lr=0.1, weight_decay=0.5)
        sa, sb = a.initial_state(4)[None].copy(), b.initial_state(4)[None].copy()
        for k in range(3):  # Adam's first step is lr * sign(g) whatever the decay
            a.step(plain, sa, _rand((1, 4), k + 1))
            b.step(decayed, sb, _rand((1, 4), k + 1))
        assert not np.allclose(plain, decayed, rtol=1e-4), opt_cls
