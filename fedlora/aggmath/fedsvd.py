"""FedSVD's server step (Lee et al., "FedSVD: Adaptive Orthogonalization for Private Federated Learning
with LoRA", NeurIPS 2025, arXiv 2505.12805): average B, then re-factorise B̄A by its SVD.

Clients train only B over the server's A. The server forms B̄ = Σ_k w_k B_k (float64) and re-factorises
the product with the A the clients trained against (the paper's server step; the authors' code:
``reinit_lora`` in ``misc/utils.py`` of seanie12/fed-svd):

    B̄ A = U Σ Vᵀ,     A_new = V_rᵀ  (r, d_in; orthonormal rows),     B_new = U_r Σ_r  (d_out, r)

B̄A has rank ≤ r, so the rank-r factors are exact: s·B_new A_new = s·B̄A — a re-parametrisation of the
global model, not an approximation of it. The scale s cancels and is no argument.

How (never a d_out × d_in matrix, float64): thin QRs B̄ = Q_B R_B and Aᵀ = Q_A R_A (Householder, stable
on rank-deficient input), the small core C = R_B R_Aᵀ (≤ r × r) and its SVD C = U_c Σ V_cᵀ with V_c a
full r × r orthogonal matrix; then A_new = (Q_A V_c)ᵀ and B_new = Q_B (C V_c) = Q_B U_c Σ. Written this way
B_new A_new = Q_B C V_c V_cᵀ Q_Aᵀ = B̄A holds for ANY orthogonal V_c, so the product stays exact even where
the SVD itself is inaccurate (a fallback takes V_c from a symmetric eigendecomposition of CᵀC if LAPACK's
SVD fails to converge).

Rank-deficient input: components with σ_i = 0 (d_out < r, or B̄A of rank < r) get B columns of zero and
A rows that complete the others to an orthonormal basis of A's row space — the SVD's own choice, made
deterministic by the sign rule below. A product that is exactly zero (B̄ = 0, e.g. a round in which no
client moved B away from its zero initialisation) has nothing to factorise: (B̄, A) are returned as they
are, so A keeps its values (Kaiming-uniform before the first real update) rather than becoming an
arbitrary orthonormal basis — the model and the clients' frozen factor stay what they were.

Sign convention (deterministic result): every A_new row's entry of largest magnitude (the first such
entry on a tie) is positive; the matching B_new column flips with it, so the product is unchanged.

A consequence worth knowing: the rows of B̄A are combinations of the rows of A, so while B̄A has full
rank r, A_new spans exactly the row space of the A before it — FedSVD rotates and orthonormalises A
within the span of its initialisation (ordered by the aggregate's singular values); it never leaves it.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from ..errors import ConfigError
from ._checks import check_factor_pairs, check_weights

__all__ = ["FedSVDResult", "fedsvd_refactor", "fedsvd_aggregate"]


class FedSVDResult(NamedTuple):
    """``B`` (d_out, r) = U_r Σ_r in B̄'s dtype, ``A`` (r, d_in) = V_rᵀ (orthonormal rows) in A's dtype,
    ``singular_values`` (r,) float64, descending (zeros past the rank of B̄A)."""

    B: torch.Tensor
    A: torch.Tensor
    singular_values: torch.Tensor


def _orthogonal_right_factor(core: torch.Tensor) -> torch.Tensor:
    """V_c (n, n) orthogonal with core V_c = U_c Σ (columns by descending σ), core (m, n) float64."""
    n = core.shape[1]
    scale = core.abs().max()
    if not torch.isfinite(scale):
        raise ConfigError("fedsvd: B̄A overflows float64 (factor entries too large); rescale the adapters")
    c = core / scale
    try:
        _, _, vh = torch.linalg.svd(c, full_matrices=True)
        if vh.shape != (n, n) or not torch.isfinite(vh).all():
            raise RuntimeError("non-finite SVD output")
        return vh.T
    except RuntimeError:  # torch.linalg.LinAlgError is a RuntimeError: eigenvectors of CᵀC instead
        evals, evecs = torch.linalg.eigh(c.T @ c)
        order = torch.argsort(evals, descending=True, stable=True)
        return evecs[:, order]


def _positive_diagonal(q: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """QR with diag(R) ≥ 0 (the unique one for full-rank input): flip the signs Householder chose."""
    d = torch.diagonal(r)
    s = torch.where(d < 0, -torch.ones_like(d), torch.ones_like(d))
    return q * s, r * s[:, None]


def fedsvd_refactor(B: torch.Tensor, A: torch.Tensor) -> FedSVDResult:
    """Re-factorise B A (B (d_out, r), A (r, d_in), r ≤ d_in) as B_new A_new with A_new = V_rᵀ, B_new = U_r Σ_r.

    Exact: B_new A_new = B A (float64 rounding); A_new has orthonormal rows; deterministic (module
    docstring: sign rule, rank-deficient input; B A = 0 returns (B, A) unchanged). Inputs are not modified.
    """
    fn = "fedsvd_refactor"
    d_out, d_in, (r,) = check_factor_pairs(fn, [B], [A])
    if r > d_in:
        raise ConfigError(f"{fn}: rank r={r} exceeds d_in={d_in}; A (r, d_in) cannot have {r} orthonormal rows "
                          f"(use a rank ≤ {d_in} for this layer)")
    b, a = B.to(torch.float64), A.to(torch.float64)
    q_b, r_b = _positive_diagonal(*torch.linalg.qr(b))      # (d_out, p_b), (p_b, r), p_b = min(d_out, r)
    q_a, r_a = _positive_diagonal(*torch.linalg.qr(a.T))    # (d_in, r), (r, r)
    core = r_b @ r_a.T                                       # (p_b, r): B A = Q_B core Q_Aᵀ
    if not bool(core.any()):  # B A = 0: nothing to factorise, keep the factors (module docstring)
        return FedSVDResult(B.clone(), A.clone(), torch.zeros(r, dtype=torch.float64))
    v_c = _orthogonal_right_factor(core)                     # (r, r) orthogonal
    a_new = (q_a @ v_c).T                                    # (r, d_in): orthonormal rows
    b_new = q_b @ (core @ v_c)                               # (d_out, r) = U_r Σ_r
    lead = a_new.abs().argmax(dim=1)                         # first entry of largest magnitude per row
    sign = torch.where(a_new.gather(1, lead[:, None])[:, 0] < 0, -1.0, 1.0).to(torch.float64)
    a_new, b_new = a_new * sign[:, None], b_new * sign[None, :]
    sig = torch.linalg.vector_norm(b_new, dim=0)             # ‖U_i σ_i‖ = σ_i
    return FedSVDResult(b_new.to(B.dtype), a_new.to(A.dtype), sig)


def fedsvd_aggregate(Bs: Sequence[torch.Tensor], weights, A: torch.Tensor) -> FedSVDResult:
    """FedSVD's server step: B̄ = Σ_k w_k B_k (float64; ``weights`` normalised here, w_k = n_k/Σn usually,
    equal for balanced clients), then ``fedsvd_refactor(B̄, A)`` with the A every client trained against.

    Args:
        Bs: the clients' B_k (d_out, r), one rank r for all (FedSVD has one global A).
        weights: K non-negative numbers with a positive sum.
        A: the server's A (r, d_in) of the round.
    """
    fn = "fedsvd_aggregate"
    check_factor_pairs(fn, list(Bs), [A] * len(Bs), same_rank=True)
    w = check_weights(fn, weights, len(Bs))
    b_bar = sum(w[k] * b.to(torch.float64) for k, b in enumerate(Bs))
    res = fedsvd_refactor(b_bar, A)
    return FedSVDResult(res.B.to(Bs[0].dtype), res.A, res.singular_values)
