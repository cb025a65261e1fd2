"""FedEx-LoRA exact aggregation: weighted means of the factors plus a residual in the frozen weight.

Singhal, Ponkshe, Vepakomma, "FedEx-LoRA: Exact Aggregation for Federated and Efficient Fine-Tuning of
Foundation Models", ACL 2025 (arXiv 2410.09432): the server's update of A, B and of the frozen W0 by the
residual ΔW_res (the paper's update rule; equation numbers were not available to us). In PEFT orientation
(A_k (r, d_in), B_k (d_out, r), ΔW = s·B A) and with the client weights p_k (Σ p_k = 1; the paper writes the
uniform 1/k):

    Ā = Σ_k p_k A_k,   B̄ = Σ_k p_k B_k,
    ΔW_res = s·(Σ_k p_k B_k A_k − B̄ Ā),
    W0 ← W0 + ΔW_res,

so the global model W0 + ΔW_res + s·B̄Ā equals W0 + s·Σ_k p_k B_k A_k exactly: the weighted mean of the
clients' models (they share W0). The residual is computed from the stacked factors in ONE product,

    ΔW_res = s·[p_1 B_1, …, p_K B_K, −B̄] · [A_1; …; A_K; Ā]      (rank ≤ K·r + r),

never K dense products and their sum, in float64. ``layout`` names the frozen weight's layout the
residual is added to: ``"linear"`` — ``nn.Linear``'s (d_out, d_in), fedlora's ``LoRALinear`` — or
``"conv1d"`` — GPT-2's ``Conv1D``, (d_in, d_out), where the residual is the transpose. The factors are
in PEFT orientation for both (PEFT keeps lora_A (r, d_in) even with ``fan_in_fan_out``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..errors import ConfigError
from ._checks import check_factor_pairs, check_finite, check_scales, check_weights

__all__ = ["LAYOUTS", "FedExResult", "fedex_means", "fedex_residual_factors", "fedex_residual", "fedex_aggregate",
           "fedex_merge", "weight_delta"]

#: the frozen-weight layouts a residual can be written in
LAYOUTS = ("linear", "conv1d")


def _check_layout(fn: str, layout: str) -> str:
    if layout not in LAYOUTS:
        raise ConfigError(f"{fn}: layout must be one of {', '.join(LAYOUTS)} (nn.Linear (d_out, d_in) or "
                          f"GPT-2 Conv1D (d_in, d_out)), got {layout!r}")
    return layout


@dataclass(frozen=True)
class FedExResult:
    """One layer's FedEx-LoRA aggregate: ``B`` = B̄ (d_out, r), ``A`` = Ā (r, d_in) and ``residual``, the
    dense ΔW_res in the layer's layout (``linear``: (d_out, d_in); ``conv1d``: (d_in, d_out))."""

    B: torch.Tensor
    A: torch.Tensor
    residual: torch.Tensor


def fedex_means(Bs: Sequence[torch.Tensor], As: Sequence[torch.Tensor], weights
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(B̄, Ā) = (Σ p_k B_k, Σ p_k A_k) with the normalised weights p_k, summed in float64, returned in
    the input dtype. Every client must have the same rank (the mean of factors needs it)."""
    fn = "fedex_means"
    check_factor_pairs(fn, Bs, As, same_rank=True)
    p = check_weights(fn, weights, len(Bs))
    dtype = Bs[0].dtype
    B = sum(p[k] * b.to(torch.float64) for k, b in enumerate(Bs))
    A = sum(p[k] * a.to(torch.float64) for k, a in enumerate(As))
    return B.to(dtype), A.to(dtype)


def fedex_residual_factors(Bs: Sequence[torch.Tensor], As: Sequence[torch.Tensor], weights, scale: float = 1.0
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual as stacked factors (U (d_out, K·r + r), V (K·r + r, d_in)), float64, with
    U V = s·(Σ p_k B_k A_k − B̄ Ā): U = s·[p_1 B_1, …, p_K B_K, −B̄], V = [A_1; …; A_K; Ā]."""
    fn = "fedex_residual_factors"
    check_factor_pairs(fn, Bs, As, same_rank=True)
    p = check_weights(fn, weights, len(Bs))
    (s,) = check_scales(fn, scale, 1, "scale")
    B64 = [b.to(torch.float64) for b in Bs]
    A64 = [a.to(torch.float64) for a in As]
    Bbar = sum(p[k] * b for k, b in enumerate(B64))
    Abar = sum(p[k] * a for k, a in enumerate(A64))
    U = torch.cat([p[k] * b for k, b in enumerate(B64)] + [-Bbar], dim=1) * s
    V = torch.cat(A64 + [Abar], dim=0)
    return U, V


def fedex_residual(Bs: Sequence[torch.Tensor], As: Sequence[torch.Tensor], weights, scale: float = 1.0,
                   layout: str = "linear") -> torch.Tensor:
    """ΔW_res = s·(Σ p_k B_k A_k − B̄ Ā) in ``layout`` (``linear``: (d_out, d_in); ``conv1d``: its
    transpose (d_in, d_out)), one product of the stacked factors in float64, returned in the input dtype."""
    _check_layout("fedex_residual", layout)
    U, V = fedex_residual_factors(Bs, As, weights, scale)
    R = U @ V
    return (R if layout == "linear" else R.T).contiguous().to(Bs[0].dtype)


def fedex_aggregate(Bs: Sequence[torch.Tensor], As: Sequence[torch.Tensor], weights, scale: float = 1.0,
                    layout: str = "linear") -> FedExResult:
    """The server's round for one layer: B̄, Ā (``fedex_means``) and ΔW_res (``fedex_residual``)."""
    B, A = fedex_means(Bs, As, weights)
    return FedExResult(B, A, fedex_residual(Bs, As, weights, scale, layout))


def weight_delta(B: torch.Tensor, A: torch.Tensor, scale: float = 1.0, layout: str = "linear") -> torch.Tensor:
    """s·B A in the frozen weight's ``layout`` (float64): the LoRA's contribution to the dense weight."""
    fn = "weight_delta"
    _check_layout(fn, layout)
    check_factor_pairs(fn, [B], [A])
    (s,) = check_scales(fn, scale, 1, "scale")
    D = s * (B.to(torch.float64) @ A.to(torch.float64))
    return D if layout == "linear" else D.T


def fedex_merge(W0: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The new frozen weight W0 + ΔW_res (summed in float64, returned in W0's dtype; W0 is not modified).
    ``residual`` must be in W0's own layout, so a transposed residual of a non-square layer is refused."""
    fn = "fedex_merge"
    if W0.dim() != 2 or residual.dim() != 2:
        raise ConfigError(f"{fn}: W0 and the residual must be 2-D, got {tuple(W0.shape)} and {tuple(residual.shape)}")
    if W0.shape != residual.shape:
        raise ConfigError(f"{fn}: residual {tuple(residual.shape)} does not match W0 {tuple(W0.shape)}; "
                          "compute it in W0's layout (fedex_residual(..., layout='linear' or 'conv1d'))")
    check_finite(fn, "residual", residual)
    return (W0.to(torch.float64) + residual.to(torch.float64)).to(W0.dtype)
