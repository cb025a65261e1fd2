"""Exact aggregate ΔW and the exactness of frozen-factor methods (docs/design.md §3–4).

Shapes (PEFT orientation): B_k (d_out, r_k), A_k (r_k, d_in), ΔW_k = s_k B_k A_k (d_out, d_in).

* ``exact_delta`` — Σ_k w_k s_k B_k A_k, the aggregate every method is compared with. It forms the
  dense d_out × d_in matrix: meant for tests and reporting, not for the server path.
* ``fedavg_delta`` / ``discordance`` — FedAvg of the factors (HOMLoRA): s·avg(B)·avg(A), which differs
  from the exact aggregate for generic inputs (LoRA-A², [LoRA-A²] §3 "discordance"; docs/design.md §4.1).
* ``aggregate_trained_factor`` — FFA-LoRA (A frozen and shared) and RoLoRA / LoRA-A² alternating
  rounds (only one factor trained per round): averaging the trained factor and keeping the shared
  frozen one is exact, Σ_k w_k B_k A = (Σ_k w_k B_k) A ([LoRA-A²] eq. 3; [RoLoRA] eq. 3–4).
* ``trained_factor`` — which factor a round trains (docs/design.md §4.4: round 0, 2, … train B).
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..aggregation import fedavg_factors
from ..errors import ConfigError
from ._checks import check_factor_name, check_factor_pairs, check_scales, check_weights, is_int

__all__ = ["exact_delta", "fedavg_delta", "discordance", "trained_factor", "aggregate_trained_factor"]


def exact_delta(Bs: Sequence[torch.Tensor], As: Sequence[torch.Tensor], weights,
                scales: float | Sequence[float] = 1.0) -> torch.Tensor:
    """ΔW = Σ_k w_k s_k B_k A_k, shape (d_out, d_in), computed in float64, returned in B_0's dtype.

    ``weights`` are normalised (w / Σw); ranks r_k may differ between clients.
    Forms the dense matrix — for tests/reporting only (docs/design.md §4.6: the server never does).
    """
    _, _, ranks = check_factor_pairs("exact_delta", Bs, As)
    w = check_weights("exact_delta", weights, len(Bs))
    s = check_scales("exact_delta", scales, len(Bs))
    out = None
    for k, (b, a) in enumerate(zip(Bs, As)):
        term = (w[k] * s[k]) * (b.to(torch.float64) @ a.to(torch.float64))
        out = term if out is None else out + term
    return out.to(Bs[0].dtype)


def fedavg_delta(Bs: Sequence[torch.Tensor], As: Sequence[torch.Tensor], weights,
                 scale: float = 1.0) -> torch.Tensor:
    """HOMLoRA's aggregate s·(Σ_k w_k B_k)(Σ_k w_k A_k), shape (d_out, d_in); needs equal ranks.

    Uses :func:`fedlora.aggregation.fedavg_factors`. Not exact: differs from :func:`exact_delta`
    generically (the "discordance", [LoRA-A²] §3 eq. before (3)).
    """
    check_factor_pairs("fedavg_delta", Bs, As, same_rank=True)
    (s,) = check_scales("fedavg_delta", scale, 1, name="scale")
    w = check_weights("fedavg_delta", weights, len(Bs))
    avg = fedavg_factors([{"A": a.to(torch.float64), "B": b.to(torch.float64)} for a, b in zip(As, Bs)], w)
    return (s * (avg["B"] @ avg["A"])).to(Bs[0].dtype)


def discordance(Bs: Sequence[torch.Tensor], As: Sequence[torch.Tensor], weights, scale: float = 1.0) -> float:
    """‖s·avg(B)avg(A) − Σ_k w_k s B_k A_k‖_F (float64); 0 when a factor is shared, > 0 generically."""
    fa = fedavg_delta([b.to(torch.float64) for b in Bs], [a.to(torch.float64) for a in As], weights, scale)
    ex = exact_delta([b.to(torch.float64) for b in Bs], [a.to(torch.float64) for a in As], weights, scale)
    return float(torch.linalg.matrix_norm(fa - ex))


def trained_factor(round_idx: int) -> str:
    """'B' on rounds 0, 2, 4, …, 'A' on rounds 1, 3, … (0-based round index).

    RoLoRA (docs/design.md §4.4: B first because B = 0 at init) and LoRA-A² ([LoRA-A²] Algorithm 1: ``t % 2 = 1``
    trains B with 1-based t, i.e. t = round_idx + 1) agree.
    """
    if not is_int(round_idx) or round_idx < 0:
        raise ConfigError(f"trained_factor: round_idx must be an integer ≥ 0, got {round_idx!r}")
    return "B" if int(round_idx) % 2 == 0 else "A"


def aggregate_trained_factor(Bs: Sequence[torch.Tensor], As: Sequence[torch.Tensor], weights,
                             trained: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Average the trained factor, keep the frozen one; returns (B (d_out, r), A (r, d_in)).

    ``trained='B'``: FFA-LoRA (every round) and RoLoRA/LoRA-A² B-rounds — all A_k must be identical
    (the server broadcast them), and the result (Σ w_k B_k, A) gives s·B A = Σ_k w_k s B_k A_k exactly
    ([LoRA-A²] eq. 3; [RoLoRA] eq. 3). ``trained='A'``: the mirror image with B frozen and shared.
    Raises ``ConfigError`` if the frozen factor differs between clients (aggregation would not be exact).
    """
    fn = "aggregate_trained_factor"
    check_factor_name(fn, trained)
    check_factor_pairs(fn, Bs, As, same_rank=True)
    w = check_weights(fn, weights, len(Bs))
    frozen = As if trained == "B" else Bs
    name = "A" if trained == "B" else "B"
    for k, f in enumerate(frozen):
        if not torch.equal(f, frozen[0]):
            raise ConfigError(f"{fn}: frozen factor {name} of client {k} differs from client 0's; with "
                              f"trained={trained!r} every client must hold the same broadcast {name}")
    if trained == "B":
        b = fedavg_factors([{"B": b.to(torch.float64)} for b in Bs], w)["B"].to(Bs[0].dtype)
        return b, As[0].clone()
    a = fedavg_factors([{"A": a.to(torch.float64)} for a in As], w)["A"].to(As[0].dtype)
    return Bs[0].clone(), a
