"""Embedding optimizers (PERSIA's ``persia.embedding.optim``), applied on the embedding servers.

Each optimizer keeps a per-row state vector of :meth:`Optimizer.state_width` float32 values
stored beside the embedding vector, checkpointed with it and initialised from
:meth:`Optimizer.initial_state`. :meth:`Optimizer.step` is the numpy reference of the update;
the Cython store's kernel (``sp_step`` in ``cython_ext/store_kernels.h``) performs the same
float32 operations in the same order, so both stores produce bit-identical rows.

Unlike PERSIA, parameters it silently ignored work here: SGD ``momentum`` (PyTorch's form
without dampening) and ``weight_decay`` for every optimizer (L2: ``g += weight_decay * w``
before the step).

State layouts (per row, ``dim`` = embedding dimension):

- SGD: ``[]``, or ``[momentum_buffer(dim)]`` when ``momentum > 0``.
- Adagrad: ``[accumulator(dim)]``, or ``[accumulator]`` (one value) when ``vectorwise_shared``.
  The weights are updated with the accumulator *before* g² is added, as PERSIA does.
- Adam: ``[m(dim), v(dim), beta1**t, beta2**t]``; the powers are the per-row step count in
  the form the bias correction uses (kept as running products so that both stores agree to
  the bit).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

import numpy as np

from stream_persia.errors import BadInput

__all__ = ["SGD", "Adagrad", "Adam", "Optimizer", "optimizer_from_dict", "as_optimizer"]

_F32 = np.float32


def _check(name: str, value: Any, ok: bool, accepted: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise BadInput(f"{name} must be a number, got {value!r}", field=name, hint=accepted)
    v = float(value)
    if not (math.isfinite(v) and ok):
        raise BadInput(f"{name} must be {accepted}, got {value!r}", field=name, hint=accepted)
    return v


def _unit(name: str, value: Any) -> float:
    v = _check(name, value, True, "in [0, 1)")
    return _check(name, v, 0.0 <= v < 1.0, "in [0, 1)")


def _nonneg(name: str, value: Any) -> float:
    v = _check(name, value, True, "a finite number >= 0")
    return _check(name, v, v >= 0.0, "a finite number >= 0")


class Optimizer:
    """Base of the embedding optimizers. Instances are immutable and compare by value."""

    name: ClassVar[str] = ""

    @property
    def state_kind(self) -> str:
        """Names the per-row state layout; rows keep their state across a ``configure`` and
        a ``load`` accepts a dump only when this matches."""
        return self.name

    def state_width(self, dim: int) -> int:
        """Number of float32 state values stored per row of dimension ``dim``."""
        raise NotImplementedError

    def initial_state(self, dim: int) -> np.ndarray:
        """The state of a freshly admitted row: float32 array of ``state_width(dim)``."""
        raise NotImplementedError

    def step(self, weights: np.ndarray, state: np.ndarray, grads: np.ndarray) -> None:
        """Apply one update in place (numpy reference; the Cython store mirrors it).

        Args:
            weights: float32 (n, dim), updated in place.
            state: float32 (n, state_width(dim)), updated in place.
            grads: float32 (n, dim), one summed gradient per row; may be overwritten.
        """
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form (sent by ``configure`` over RPC); inverse of :func:`optimizer_from_dict`."""
        d = asdict(self)  # type: ignore[call-overload]
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        return {"name": self.name, **d}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Optimizer:
        d = dict(d)
        name = d.pop("name", cls.name)
        if name != cls.name:
            raise BadInput(f"optimizer name {name!r} does not match {cls.__name__}",
                           field="name", hint=f"expected {cls.name!r}")
        accepted = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(d) - accepted)
        if unknown:
            raise BadInput(f"unknown {cls.__name__} parameter(s) {unknown}", field=unknown[0],
                           hint=f"accepted: {', '.join(sorted(accepted))}")
        return cls(**d)

    def _decay(self, weights: np.ndarray, grads: np.ndarray) -> np.ndarray:
        wd = getattr(self, "weight_decay", 0.0)
        if wd != 0.0:  # skipped at 0 so that -0.0 gradients keep their sign bit, as in C
            grads = grads + _F32(wd) * weights
        return grads


@dataclass(frozen=True)
class SGD(Optimizer):
    """Stochastic gradient descent: ``w -= lr * g`` (with momentum: ``b = m*b + g; w -= lr*b``).

    Args:
        lr: learning rate (>= 0).
        momentum: momentum factor in [0, 1); 0 keeps no state.
        weight_decay: L2 penalty (>= 0) added to the gradient before the step.
    """

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    name: ClassVar[str] = "sgd"

    def __post_init__(self) -> None:
        object.__setattr__(self, "lr", _nonneg("lr", self.lr))
        object.__setattr__(self, "momentum", _unit("momentum", self.momentum))
        object.__setattr__(self, "weight_decay", _nonneg("weight_decay", self.weight_decay))

    @property
    def state_kind(self) -> str:
        return "sgd-momentum" if self.momentum > 0.0 else "sgd"

    def state_width(self, dim: int) -> int:
        return dim if self.momentum > 0.0 else 0

    def initial_state(self, dim: int) -> np.ndarray:
        return np.zeros(self.state_width(dim), np.float32)

    def step(self, weights: np.ndarray, state: np.ndarray, grads: np.ndarray) -> None:
        g = self._decay(weights, grads)
        lr = _F32(self.lr)
        if self.momentum > 0.0:
            state[:] = _F32(self.momentum) * state + g
            weights[:] = weights - lr * state
        else:
            weights[:] = weights - lr * g


@dataclass(frozen=True)
class Adagrad(Optimizer):
    """Adagrad as PERSIA applies it: ``w -= lr*g/sqrt(acc+eps)``, then ``acc = m*acc + g²``.

    Args:
        lr: learning rate (>= 0).
        initial_accumulator_value: starting accumulator of a new row (>= 0).
        weight_decay: L2 penalty (>= 0) added to the gradient before the step.
        g_square_momentum: decay ``m`` of the accumulator, in [0, 1].
        eps: added to the accumulator under the square root (>= 0; with the initial
            accumulator it must be > 0).
        vectorwise_shared: one accumulator per row, fed with the mean of g² over the row.
    """

    lr: float = 1e-2
    initial_accumulator_value: float = 1e-2
    weight_decay: float = 0.0
    g_square_momentum: float = 1.0
    eps: float = 1e-10
    vectorwise_shared: bool = False
    name: ClassVar[str] = "adagrad"

    def __post_init__(self) -> None:
        object.__setattr__(self, "lr", _nonneg("lr", self.lr))
        iav = _nonneg("initial_accumulator_value", self.initial_accumulator_value)
        object.__setattr__(self, "initial_accumulator_value", iav)
        object.__setattr__(self, "weight_decay", _nonneg("weight_decay", self.weight_decay))
        m = _check("g_square_momentum", self.g_square_momentum, True, "in [0, 1]")
        object.__setattr__(self, "g_square_momentum",
                           _check("g_square_momentum", m, 0.0 <= m <= 1.0, "in [0, 1]"))
        eps = _nonneg("eps", self.eps)
        if _F32(iav) + _F32(eps) <= 0.0:
            raise BadInput("Adagrad needs initial_accumulator_value + eps > 0 (else the first "
                           "step divides by zero)", field="eps", hint="for example eps=1e-10")
        object.__setattr__(self, "eps", eps)
        if not isinstance(self.vectorwise_shared, (bool, np.bool_)):
            raise BadInput(f"vectorwise_shared must be a bool, got {self.vectorwise_shared!r}",
                           field="vectorwise_shared", hint="True or False")
        object.__setattr__(self, "vectorwise_shared", bool(self.vectorwise_shared))

    @property
    def state_kind(self) -> str:
        return "adagrad-shared" if self.vectorwise_shared else "adagrad"

    def state_width(self, dim: int) -> int:
        return 1 if self.vectorwise_shared else dim

    def initial_state(self, dim: int) -> np.ndarray:
        return np.full(self.state_width(dim), self.initial_accumulator_value, np.float32)

    def step(self, weights: np.ndarray, state: np.ndarray, grads: np.ndarray) -> None:
        g = self._decay(weights, grads)
        lr, eps, mom = _F32(self.lr), _F32(self.eps), _F32(self.g_square_momentum)
        weights[:] = weights - lr * g / np.sqrt(state + eps)
        if self.vectorwise_shared:
            # Sequential sum over the row (not numpy's pairwise sum) to match the C loop.
            sq = np.zeros(len(g), np.float32)
            for j in range(g.shape[1]):
                sq += g[:, j] * g[:, j]
            state[:, 0] = mom * state[:, 0] + sq / _F32(g.shape[1])
        else:
            state[:] = mom * state + g * g


@dataclass(frozen=True)
class Adam(Optimizer):
    """Adam with bias correction from a per-row step count.

    Args:
        lr: learning rate (>= 0).
        betas: (beta1, beta2), each in [0, 1).
        weight_decay: L2 penalty (>= 0) added to the gradient before the step.
        eps: added to sqrt(v_hat) (> 0).
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    eps: float = 1e-8
    name: ClassVar[str] = "adam"

    def __post_init__(self) -> None:
        object.__setattr__(self, "lr", _nonneg("lr", self.lr))
        b = self.betas
        if not (isinstance(b, (tuple, list)) and len(b) == 2):
            raise BadInput(f"betas must be a (beta1, beta2) pair, got {b!r}", field="betas",
                           hint="for example (0.9, 0.999)")
        object.__setattr__(self, "betas", (_unit("betas", b[0]), _unit("betas", b[1])))
        object.__setattr__(self, "weight_decay", _nonneg("weight_decay", self.weight_decay))
        eps = _check("eps", self.eps, True, "a finite number > 0")
        object.__setattr__(self, "eps", _check("eps", eps, eps > 0.0, "a finite number > 0"))

    def state_width(self, dim: int) -> int:
        return 2 * dim + 2

    def initial_state(self, dim: int) -> np.ndarray:
        s = np.zeros(2 * dim + 2, np.float32)
        s[2 * dim:] = 1.0
        return s

    def step(self, weights: np.ndarray, state: np.ndarray, grads: np.ndarray) -> None:
        g = self._decay(weights, grads)
        d = g.shape[1]
        b1, b2 = _F32(self.betas[0]), _F32(self.betas[1])
        c1, c2 = _F32(1.0 - self.betas[0]), _F32(1.0 - self.betas[1])
        one, lr, eps = _F32(1.0), _F32(self.lr), _F32(self.eps)
        m, v = state[:, :d], state[:, d:2 * d]
        p1 = state[:, 2 * d] * b1
        p2 = state[:, 2 * d + 1] * b2
        state[:, 2 * d], state[:, 2 * d + 1] = p1, p2
        m[:] = b1 * m + c1 * g
        v[:] = b2 * v + c2 * (g * g)
        m_hat = m / (one - p1)[:, None]
        v_hat = v / (one - p2)[:, None]
        weights[:] = weights - lr * m_hat / (np.sqrt(v_hat) + eps)


_BY_NAME: dict[str, type[Optimizer]] = {"sgd": SGD, "adagrad": Adagrad, "adam": Adam}


def optimizer_from_dict(d: dict[str, Any]) -> Optimizer:
    """Rebuild an optimizer from :meth:`Optimizer.to_dict` output."""
    if not isinstance(d, dict) or d.get("name") not in _BY_NAME:
        name = d.get("name") if isinstance(d, dict) else d
        raise BadInput(f"unknown optimizer {name!r}", field="name",
                       hint=f"one of {sorted(_BY_NAME)}")
    return _BY_NAME[d["name"]].from_dict(d)


def as_optimizer(obj: Any) -> Optimizer:
    """Accept an optimizer instance or its dict form; anything else is a BadInput."""
    if isinstance(obj, Optimizer):
        return obj
    if isinstance(obj, dict):
        return optimizer_from_dict(obj)
    raise BadInput(f"optimizer must be SGD, Adagrad or Adam (or its to_dict()), got {obj!r}",
                   field="optimizer", hint="stream_persia.core.optim.Adagrad(lr=1e-2)")
