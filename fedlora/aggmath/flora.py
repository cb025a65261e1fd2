"""FLoRA stacking aggregation (Wang et al. 2024; docs/design.md §4.11).

Clients k upload B_k (d_out, r_k), A_k (r_k, d_in) with scale s_k; ranks may differ. The server stacks

    B_stack = [p_1 s_1 B_1, …, p_K s_K B_K]   (d_out, Σ r_k)
    A_stack = [A_1; …; A_K]                   (Σ r_k, d_in)

so that B_stack A_stack = Σ_k p_k s_k B_k A_k exactly (block matrix product, no cross terms). Clients
merge the product into W0 (scale 1) and restart fresh adapters each round.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..errors import ConfigError
from ._checks import check_factor_pairs, check_finite, check_scales, check_weights

__all__ = ["flora_stack", "flora_merge"]


def flora_stack(Bs: Sequence[torch.Tensor], As: Sequence[torch.Tensor], weights,
                scales: float | Sequence[float] = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack client adapters: returns (B_stack (d_out, Σr_k), A_stack (Σr_k, d_in)), input dtype.

    ``weights`` p_k are normalised (p_k = n_k / Σ n); the weight and the scale s_k go on B's block.
    B_stack A_stack = Σ_k p_k s_k B_k A_k (up to one rounding of p_k s_k B_k in the input dtype;
    exact in float64 arithmetic of the products).
    """
    fn = "flora_stack"
    check_factor_pairs(fn, Bs, As)
    p = check_weights(fn, weights, len(Bs))
    s = check_scales(fn, scales, len(Bs))
    dtype = Bs[0].dtype
    b_stack = torch.cat([((p[k] * s[k]) * b.to(torch.float64)).to(dtype) for k, b in enumerate(Bs)], dim=1)
    a_stack = torch.cat([a.to(dtype) for a in As], dim=0)
    return b_stack, a_stack


def flora_merge(W0: torch.Tensor, B_stack: torch.Tensor, A_stack: torch.Tensor) -> torch.Tensor:
    """New frozen weight W0 + B_stack A_stack (d_out, d_in), a new tensor (W0 is not modified)."""
    fn = "flora_merge"
    if W0.dim() != 2 or B_stack.dim() != 2 or A_stack.dim() != 2:
        raise ConfigError(f"{fn}: W0 (d_out, d_in), B_stack (d_out, R) and A_stack (R, d_in) must be 2-D")
    if B_stack.shape[1] != A_stack.shape[0] or W0.shape != (B_stack.shape[0], A_stack.shape[1]):
        raise ConfigError(f"{fn}: shapes W0 {tuple(W0.shape)}, B_stack {tuple(B_stack.shape)}, "
                          f"A_stack {tuple(A_stack.shape)} do not fit W0 (d_out, d_in) = B (d_out, R) @ A (R, d_in)")
    check_finite(fn, "B_stack", B_stack)
    check_finite(fn, "A_stack", A_stack)
    return (W0.to(torch.float64) + B_stack.to(torch.float64) @ A_stack.to(torch.float64)).to(W0.dtype)
