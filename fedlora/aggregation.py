"""Pure server-side aggregation functions (docs/design.md §2, §4).

Every function here takes tensors and weights and returns new tensors: no I/O, no model, no
mutation of its inputs. Both runtimes and the property tests call these directly.

Shapes follow PEFT orientation: A (r, d_in), B (d_out, r).
"""
from __future__ import annotations

from typing import Sequence

import torch

from .errors import ConfigError

__all__ = [
    "normalise_weights",
    "weighted_average",
    "fedavg_factors",
    "zero_pad_rank",
    "truncate_rank",
    "frobenius_norm_of_product",
    "hetlora_sparsity_weights",
    "hetlora_aggregate",
]


def normalise_weights(weights: Sequence[float] | torch.Tensor, n: int | None = None) -> torch.Tensor:
    """w / Σw in float64; raises ``ConfigError`` on negative, non-finite or non-positive-sum weights."""
    w = torch.as_tensor(weights, dtype=torch.float64).flatten()
    if n is not None and w.numel() != n:
        raise ConfigError(f"weights: expected {n} client weights, got {w.numel()}")
    if w.numel() == 0:
        raise ConfigError("weights: need at least one client")
    if not torch.isfinite(w).all() or (w < 0).any():
        raise ConfigError(f"weights must be finite and ≥ 0, got {w.tolist()}")
    total = w.sum()
    if total <= 0:
        raise ConfigError(f"weights must sum to a positive number, got sum {total.item()}")
    return w / total


def weighted_average(tensors: Sequence[torch.Tensor], weights: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Σ_k w_k T_k with w normalised; all tensors must share one shape."""
    if len(tensors) == 0:
        raise ConfigError("weighted_average: no tensors to average")
    shape = tensors[0].shape
    for i, t in enumerate(tensors):
        if t.shape != shape:
            raise ConfigError(f"weighted_average: client {i} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    w = normalise_weights(weights, len(tensors))
    stacked = torch.stack([t.to(torch.float64) for t in tensors])
    out = torch.tensordot(w, stacked, dims=1)
    return out.to(tensors[0].dtype)


def fedavg_factors(states: Sequence[dict[str, torch.Tensor]], weights) -> dict[str, torch.Tensor]:
    """FedAvg of each named tensor separately (HOMLoRA; PF2LoRA Alg. 1 line 8 on x = (A, B)).

    Note: avg(B)·avg(A) ≠ avg(B·A) in general — the "discordance" (docs/design.md §4.1).
    """
    if not states:
        raise ConfigError("fedavg_factors: no client states")
    keys = set(states[0])
    for i, s in enumerate(states):
        if set(s) != keys:
            raise ConfigError(f"fedavg_factors: client {i} sends {sorted(s)}, expected {sorted(keys)}")
    return {k: weighted_average([s[k] for s in states], weights) for k in states[0]}


def zero_pad_rank(a: torch.Tensor, b: torch.Tensor, r_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HetLoRA server side: pad A (r, d_in) with zero rows and B (d_out, r) with zero columns to r_max."""
    r = a.shape[-2]
    if b.shape[-1] != r:
        raise ConfigError(f"zero_pad_rank: A has rank {r} but B has rank {b.shape[-1]}")
    if r > r_max:
        raise ConfigError(f"zero_pad_rank: client rank {r} exceeds r_max={r_max}")
    a_pad = a.new_zeros(*a.shape[:-2], r_max, a.shape[-1])
    b_pad = b.new_zeros(*b.shape[:-1], r_max)
    a_pad[..., :r, :] = a
    b_pad[..., :r] = b
    return a_pad, b_pad


def truncate_rank(a: torch.Tensor, b: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HetLoRA distribution by truncation: first r rows of A and first r columns of B (copies)."""
    if not 1 <= r <= a.shape[-2]:
        raise ConfigError(f"truncate_rank: rank must be in [1, {a.shape[-2]}], got {r}")
    return a[..., :r, :].clone(), b[..., :r].clone()


def frobenius_norm_of_product(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """‖B A‖_F via the r×r trace identity ‖BA‖²_F = tr((BᵀB)(AAᵀ)) — never forms d_out×d_in."""
    gram = (b.transpose(-1, -2) @ b) * (a @ a.transpose(-1, -2)).transpose(-1, -2)
    return gram.sum(dim=(-1, -2)).clamp_min(0).sqrt()


def hetlora_sparsity_weights(As: Sequence[torch.Tensor], Bs: Sequence[torch.Tensor],
                             eps: float = 1e-12) -> torch.Tensor:
    """HetLoRA's sparsity-weighted aggregation weights ‖B_kA_k‖_F / Σ_j ‖B_jA_j‖_F (PF2LoRA §3).

    ``eps`` is added to every norm, so the weights are uniform (and sum to 1) when every ΔW_k = 0.
    """
    norms = torch.stack([frobenius_norm_of_product(b.to(torch.float64), a.to(torch.float64))
                         for a, b in zip(As, Bs)]) + eps
    return norms / norms.sum()


def hetlora_aggregate(As: Sequence[torch.Tensor], Bs: Sequence[torch.Tensor], r_max: int,
                      eps: float = 1e-12) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zero-pad every client's (A_k, B_k) to r_max and average with the sparsity weights.

    Returns (A_global (r_max, d_in), B_global (d_out, r_max), weights (K,)).
    """
    if len(As) != len(Bs) or not As:
        raise ConfigError(f"hetlora_aggregate: need as many A as B factors (≥ 1), got {len(As)} and {len(Bs)}")
    w = hetlora_sparsity_weights(As, Bs, eps)
    padded = [zero_pad_rank(a, b, r_max) for a, b in zip(As, Bs)]
    a_g = weighted_average([p[0] for p in padded], w)
    b_g = weighted_average([p[1] for p in padded], w)
    return a_g, b_g, w
