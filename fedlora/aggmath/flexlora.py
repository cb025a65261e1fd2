"""FlexLoRA server aggregation (Bai et al. 2024; docs/design.md §4.6).

Clients k hold B_k (d_out, r_k), A_k (r_k, d_in) with possibly different ranks r_k and scales
s_k = α/r_k. The server

1. forms ΔW = Σ_k w_k s_k B_k A_k exactly — as the product B_cat A_cat of the stacked factors
   B_cat = [w_1 s_1 B_1, …, w_K s_K B_K] (d_out × R) and A_cat = [A_1; …; A_K] (R × d_in),
   R = Σ_k r_k, never as a dense d_out × d_in matrix;
2. takes its SVD through thin QRs B_cat = Q_B R_B, A_catᵀ = Q_A R_A and an SVD of the small core
   C = R_B R_Aᵀ (min(d_out, R) × min(d_in, R)) = U_c Σ V_cᵀ, so ΔW = (Q_B U_c) Σ (Q_A V_c)ᵀ;
   all in float64 (Householder QR is backward stable also for rank-deficient input);
3. gives client k the best rank-r'_k approximation (Eckart–Young) with all of Σ on B, as the
   official code does: B'_k = U_{r'} Σ_{r'} / s'_k, A'_k = V_{r'}ᵀ, so s'_k B'_k A'_k = U_{r'} Σ_{r'} V_{r'}ᵀ.

Robustness (docs/design.md §4.6: LoRA-A² could not report FlexLoRA because its SVD failed): the core is scaled
to max-abs 1 before the SVD; if LAPACK's divide-and-conquer SVD still raises, a symmetric
eigendecomposition of the Jordan–Wielandt matrix [[0, C], [Cᵀ, 0]] (eigenvalues ±σ_i, no squaring
of the condition number) is used instead. When a client asks for more components than ΔW has
(r'_k > min(d_out, d_in, R)), the extra A rows are completed to an orthonormal set (deterministic)
and the matching B columns are zero — exact, and like a fresh LoRA init on those ranks.
"""
from __future__ import annotations

import numbers
from typing import NamedTuple, Sequence

import torch

from ..errors import ConfigError
from ._checks import check_factor_pairs, check_scales, check_weights, is_int

__all__ = ["FlexLoRAResult", "flexlora_aggregate", "flexlora_svd"]


class FlexLoRAResult(NamedTuple):
    """``factors[k] = (B'_k (d_out, r'_k), A'_k (r'_k, d_in))`` in the input dtype;
    ``singular_values`` (p,) float64, descending, p = min(d_out, d_in, Σ r_k)."""

    factors: list[tuple[torch.Tensor, torch.Tensor]]
    singular_values: torch.Tensor


def _core_svd(core: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD of a small float64 matrix (m, n): U (m, p), S (p,), Vh (p, n), p = min(m, n)."""
    scale = core.abs().max()
    if not torch.isfinite(scale):
        # inputs are checked finite, so this is float64 overflow of their product: never return a
        # silently wrong (zero) ΔW
        raise ConfigError("flexlora: the aggregated ΔW overflows float64 (factor entries too large); "
                          "rescale the adapters")
    if scale == 0:
        m, n = core.shape
        p = min(m, n)
        eye = torch.eye(max(m, n), dtype=core.dtype, device=core.device)
        return eye[:m, :p].clone(), core.new_zeros(p), eye[:p, :n].clone()
    c = core / scale
    try:
        u, s, vh = torch.linalg.svd(c, full_matrices=False)
        if not (torch.isfinite(u).all() and torch.isfinite(s).all() and torch.isfinite(vh).all()):
            raise RuntimeError("non-finite SVD output")
    except RuntimeError:  # torch raises torch.linalg.LinAlgError (a RuntimeError) on non-convergence
        u, s, vh = _jordan_wielandt_svd(c)
    return u, s * scale, vh


def _jordan_wielandt_svd(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fallback SVD from eigh([[0, C], [Cᵀ, 0]]): eigenpairs (σ_i, [u_i; v_i]/√2) for σ_i > 0.

    Components with σ_i below the numerical noise floor get σ = 0 and orthonormal completions.
    """
    m, n = c.shape
    p = min(m, n)
    jw = c.new_zeros(m + n, m + n)
    jw[:m, m:] = c
    jw[m:, :m] = c.T
    evals, evecs = torch.linalg.eigh(jw)
    order = torch.argsort(evals, descending=True, stable=True)[:p]
    sig = evals[order]
    tol = max(m, n) * torch.finfo(c.dtype).eps * float(sig[0].clamp_min(0))
    keep = int((sig > tol).sum())
    u = evecs[:m, order[:keep]]
    v = evecs[m:, order[:keep]]
    # σ > 0 eigenvectors have ‖u‖ = ‖v‖ = 1/√2; re-orthonormalise to remove rounding drift
    u = _orthonormal_columns(u)
    v = _orthonormal_columns(v)
    s = sig[:keep].clone()
    if keep < p:
        u = torch.cat([u, _complete_columns(u, p - keep)], dim=1)
        v = torch.cat([v, _complete_columns(v, p - keep)], dim=1)
        s = torch.cat([s, c.new_zeros(p - keep)])
    return u, s, v.T


def _orthonormal_columns(x: torch.Tensor) -> torch.Tensor:
    if x.shape[1] == 0:
        return x
    q, r = torch.linalg.qr(x)
    return q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(()).to(x))


def _complete_columns(basis: torch.Tensor, m: int) -> torch.Tensor:
    """m orthonormal columns (d, m) orthogonal to the orthonormal columns of ``basis`` (d, p).

    Deterministic: a fixed-seed Gaussian block, projected off ``basis`` twice, then QR.
    """
    d = basis.shape[0]
    if m <= 0:
        return basis.new_zeros(d, 0)
    if basis.shape[1] + m > d:
        raise ConfigError(f"cannot complete {basis.shape[1]} vectors by {m} more in dimension {d}")
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(d, m, generator=gen, dtype=torch.float64).to(basis.dtype).to(basis.device)
    for _ in range(2):
        g = g - basis @ (basis.T @ g)
    q, _ = torch.linalg.qr(g)
    if basis.shape[1]:
        q = q - basis @ (basis.T @ q)
        q, _ = torch.linalg.qr(q)
    return q


def flexlora_svd(Bs: Sequence[torch.Tensor], As: Sequence[torch.Tensor], weights,
                 scales: float | Sequence[float] = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD of ΔW = Σ_k w_k s_k B_k A_k without forming ΔW (float64).

    Returns U (d_out, p), S (p,) descending, V (d_in, p) with ΔW = U diag(S) Vᵀ,
    p = min(d_out, d_in, Σ r_k). Only the stacked factors (d × Σr), their thin QR and the
    (≤ Σr × Σr) core are materialised.
    """
    fn = "flexlora_svd"
    d_out, d_in, ranks = check_factor_pairs(fn, Bs, As)
    w = check_weights(fn, weights, len(Bs))
    s = check_scales(fn, scales, len(Bs))
    b_cat = torch.cat([(w[k] * s[k]) * b.to(torch.float64) for k, b in enumerate(Bs)], dim=1)  # (d_out, R)
    a_cat_t = torch.cat([a.to(torch.float64).T for a in As], dim=1)                             # (d_in, R)
    q_b, r_b = torch.linalg.qr(b_cat)        # (d_out, pb), (pb, R)  pb = min(d_out, R)
    q_a, r_a = torch.linalg.qr(a_cat_t)      # (d_in, pa), (pa, R)   pa = min(d_in, R)
    core = r_b @ r_a.T                       # (pb, pa)
    u_c, sig, vh_c = _core_svd(core)         # p = min(pb, pa) = min(d_out, d_in, R)
    return q_b @ u_c, sig, q_a @ vh_c.T


def flexlora_aggregate(Bs: Sequence[torch.Tensor], As: Sequence[torch.Tensor], weights,
                       scales: float | Sequence[float] = 1.0,
                       ranks_out: Sequence[int] | None = None,
                       out_scales: float | Sequence[float] | None = None) -> FlexLoRAResult:
    """FlexLoRA server step: exact ΔW = Σ_k w_k s_k B_k A_k, then each client's best rank-r'_k factors.

    Args:
        Bs: client factors B_k (d_out, r_k); d_out shared, r_k free.
        As: client factors A_k (r_k, d_in), d_in shared; A_k pairs with B_k.
        weights: K non-negative numbers with positive sum (normalised here; w_k = n_k/Σn usually).
        scales: s_k of each client's upload (one number or K).
        ranks_out: rank r'_k to hand back to each of the ``len(ranks_out)`` receiving clients,
            1 ≤ r'_k ≤ min(d_out, d_in); default: the upload ranks r_k.
        out_scales: s'_k used by the receiving clients (default: ``scales``, broadcast to len(ranks_out)).

    Returns:
        :class:`FlexLoRAResult`: per receiving client (B'_k = U_{r'} Σ_{r'} / s'_k, A'_k = V_{r'}ᵀ)
        and the singular values of ΔW. ‖ΔW − s'_k B'_k A'_k‖_F = sqrt(Σ_{i>r'} σ_i²) (Eckart–Young).
    """
    fn = "flexlora_aggregate"
    d_out, d_in, ranks = check_factor_pairs(fn, Bs, As)
    if ranks_out is None:
        ranks_out = ranks
    ranks_out = list(ranks_out)
    if not ranks_out:
        raise ConfigError(f"{fn}: ranks_out must name at least one client rank")
    for k, r in enumerate(ranks_out):
        if not is_int(r) or not 1 <= r <= min(d_out, d_in):
            raise ConfigError(f"{fn}: ranks_out[{k}] must be an integer in [1, min(d_out, d_in)] = "
                              f"[1, {min(d_out, d_in)}], got {r!r}")
    if out_scales is None:
        if isinstance(scales, numbers.Real) or len(ranks_out) == len(Bs):
            out_scales = scales
        else:
            raise ConfigError(f"{fn}: out_scales is needed when len(ranks_out)={len(ranks_out)} differs "
                              f"from the number of uploads {len(Bs)} and scales is per client")
    ranks_out = [int(r) for r in ranks_out]
    s_out = check_scales(fn, out_scales, len(ranks_out), name="out_scales")
    u, sig, v = flexlora_svd(Bs, As, weights, scales)
    p = sig.numel()
    need = max(ranks_out)
    v_ext = v
    if need > p:  # more components requested than ΔW has: complete A's rows orthonormally
        v_ext = torch.cat([v, _complete_columns(v, need - p)], dim=1)
    dtype = Bs[0].dtype
    factors = []
    for r, s_k in zip(ranks_out, s_out):
        q = min(r, p)
        b = u.new_zeros(d_out, r)
        b[:, :q] = u[:, :q] * (sig[:q] / s_k)
        a = v_ext[:, :r].T.contiguous()
        factors.append((b.to(dtype), a.to(dtype)))
    return FlexLoRAResult(factors, sig.clone())
