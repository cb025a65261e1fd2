"""Shared argument checks for :mod:`fedlora.aggmath` (private).

Every check raises :class:`~fedlora.errors.ConfigError` whose message names the argument and what
is allowed. Nothing here mutates its inputs.
"""
from __future__ import annotations

import math
import numbers
from typing import Sequence

import torch

from ..aggregation import normalise_weights
from ..errors import ConfigError

__all__ = ["check_factor_pairs", "check_scales", "check_weights", "check_finite", "check_factor_name", "is_int"]


def check_factor_pairs(fn: str, Bs: Sequence[torch.Tensor], As: Sequence[torch.Tensor],
                       same_rank: bool = False) -> tuple[int, int, list[int]]:
    """Validate client factors B_k (d_out, r_k), A_k (r_k, d_in); return (d_out, d_in, [r_k])."""
    if len(Bs) == 0 or len(Bs) != len(As):
        raise ConfigError(f"{fn}: Bs and As must be non-empty lists of equal length, "
                          f"got {len(Bs)} B factors and {len(As)} A factors")
    d_out = d_in = None
    ranks = []
    for k, (b, a) in enumerate(zip(Bs, As)):
        if not isinstance(b, torch.Tensor) or not isinstance(a, torch.Tensor) or b.dim() != 2 or a.dim() != 2:
            raise ConfigError(f"{fn}: client {k}: B must be a 2-D tensor (d_out, r) and A a 2-D tensor (r, d_in)")
        if b.shape[1] != a.shape[0]:
            raise ConfigError(f"{fn}: client {k}: B has rank {b.shape[1]} but A has rank {a.shape[0]}; "
                              "B (d_out, r) and A (r, d_in) must share r")
        if b.shape[1] < 1:
            raise ConfigError(f"{fn}: client {k}: rank must be ≥ 1, got {b.shape[1]}")
        if d_out is None:
            d_out, d_in = b.shape[0], a.shape[1]
        elif b.shape[0] != d_out or a.shape[1] != d_in:
            raise ConfigError(f"{fn}: client {k} has ΔW shape ({b.shape[0]}, {a.shape[1]}), "
                              f"expected ({d_out}, {d_in}) like client 0; all clients must share d_out and d_in")
        if same_rank and b.shape[1] != Bs[0].shape[1]:
            raise ConfigError(f"{fn}: client {k} has rank {b.shape[1]}, expected {Bs[0].shape[1]}; "
                              "this method needs equal ranks on all clients")
        check_finite(fn, f"B[{k}]", b)
        check_finite(fn, f"A[{k}]", a)
        ranks.append(int(b.shape[1]))
    return int(d_out), int(d_in), ranks


def check_finite(fn: str, name: str, t: torch.Tensor) -> None:
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise ConfigError(f"{fn}: {name} contains NaN or inf; only finite values are allowed")


def check_scales(fn: str, scales, n: int, name: str = "scales") -> list[float]:
    """A positive finite scalar (broadcast to n clients) or a sequence of n of them."""
    if isinstance(scales, numbers.Real) or (isinstance(scales, torch.Tensor) and scales.dim() == 0):
        vals = [float(scales)] * n
    else:
        vals = [float(s) for s in scales]
    if len(vals) != n:
        raise ConfigError(f"{fn}: {name} must be one number or {n} numbers (one per client), got {len(vals)}")
    for k, s in enumerate(vals):
        if not math.isfinite(s) or s <= 0:
            raise ConfigError(f"{fn}: {name}[{k}] must be a finite number > 0, got {s}")
    return vals


def check_weights(fn: str, weights, n: int) -> torch.Tensor:
    """Normalised float64 weights (K,); re-raises with the function name in the message."""
    try:
        return normalise_weights(weights, n)
    except ConfigError as e:
        raise ConfigError(f"{fn}: {e}") from None


def check_factor_name(fn: str, factor: str) -> str:
    if factor not in ("A", "B"):
        raise ConfigError(f"{fn}: factor must be 'A' or 'B', got {factor!r}")
    return factor


def is_int(x) -> bool:
    """True for Python/numpy integers (not bool, not floats)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)
