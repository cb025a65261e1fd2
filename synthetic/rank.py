"""Rank estimates of a learned matrix (docs/design.md §6)."""
from __future__ import annotations

import torch

__all__ = ["rank90", "numerical_rank"]


def rank90(W: torch.Tensor, energy: float = 0.9) -> torch.Tensor:
    """Smallest j with Σ_{i≤j} σ_i ≥ energy·Σ_i σ_i ([PF2LoRA] §5, "Evaluation").

    W: (..., m, n) → integer tensor (...,); 0 for an all-zero matrix.
    """
    if not 0 < energy <= 1:
        raise ValueError(f"energy must be in (0, 1], got {energy}")
    s = torch.linalg.svdvals(W.to(torch.float64))
    total = s.sum(-1, keepdim=True)
    reached = torch.cumsum(s, -1) >= energy * total * (1 - 1e-12)
    j = reached.to(torch.int64).argmax(-1) + 1
    return torch.where(total.squeeze(-1) > 0, j, torch.zeros_like(j))


def numerical_rank(W: torch.Tensor, tol: float = 0.02) -> torch.Tensor:
    """Number of singular values σ_i > tol·σ_1. W: (..., m, n) → integer tensor (...,)."""
    if not 0 < tol < 1:
        raise ValueError(f"tol must be in (0, 1), got {tol}")
    s = torch.linalg.svdvals(W.to(torch.float64))
    return (s > tol * s[..., :1]).sum(-1)
