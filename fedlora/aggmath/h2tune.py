"""H²Tune server-side and structural math ([H²Tune] §4.2–4.4, App. A; docs/design.md §4.10).

Orientation. The paper writes ΔW^l_k = (A + A(Φ·R))B with A (a × r_g) input side and B (r_g × b)
output side (eq. 3). In PEFT orientation (docs/design.md §3) that is ΔW = s·B (I + Φ ⊙ R) A with
B (d_out, r_g), A (r_g, d_in) and our R, Φ (r_g, r_g) the transposes of the paper's. Every operation
below on R (elementwise support, layer mixing, unweighted mean, softmax-KL of the flattened
matrices) commutes with transposing all R's, so nothing observable depends on that choice.

Layer alignment (§4.3, eq. 4–5): R_k is stored layer-first, (L_k, r_g, r_g), Ω_k is (L_k, L_g):
    R_{k→g}[j] = Σ_l Ω_k[l, j] R_k[l]          (eq. 4, "R_k Ω_k" over the layer axis) → (L_g, r_g, r_g)
    R_{g→k}[l] = Σ_j Ω_k[l, j] R_g[j]          (eq. 5, "R_g Ω_kᵀ")                   → (L_k, r_g, r_g)
Server (App. A): R_g = (1/K) Σ_k R_{k→g} — unweighted.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from ..errors import ConfigError
from ._checks import check_finite

__all__ = ["trilora_middle", "trilora_fold", "trilora_delta", "sparsify_support", "to_global",
           "to_client", "server_mean", "h2tune_aggregate", "kl_softmax"]


def _check_square_pair(fn: str, R: torch.Tensor, Phi: torch.Tensor) -> int:
    if R.dim() < 2 or R.shape[-1] != R.shape[-2]:
        raise ConfigError(f"{fn}: R must be (…, r_g, r_g) square, got {tuple(R.shape)}")
    if Phi.shape != R.shape:
        raise ConfigError(f"{fn}: Phi must have R's shape {tuple(R.shape)}, got {tuple(Phi.shape)}")
    return int(R.shape[-1])


def trilora_middle(R: torch.Tensor, Phi: torch.Tensor) -> torch.Tensor:
    """I + Φ ⊙ R, shape (…, r_g, r_g) (eq. 3's residual middle factor); a new tensor."""
    r = _check_square_pair("trilora_middle", R, Phi)
    return torch.eye(r, dtype=R.dtype, device=R.device) + Phi * R


def trilora_fold(B: torch.Tensor, R: torch.Tensor, Phi: torch.Tensor) -> torch.Tensor:
    """B' = B (I + Φ ⊙ R), shape (…, d_out, r_g): folds the middle into B so ΔW = s·B' A."""
    fn = "trilora_fold"
    r = _check_square_pair(fn, R, Phi)
    if B.dim() < 2 or B.shape[-1] != r:
        raise ConfigError(f"{fn}: B must be (…, d_out, r_g) with r_g = {r}, got {tuple(B.shape)}")
    return B @ trilora_middle(R, Phi)


def trilora_delta(B: torch.Tensor, R: torch.Tensor, Phi: torch.Tensor, A: torch.Tensor, s: float) -> torch.Tensor:
    """ΔW = s·B (I + Φ ⊙ R) A ([H²Tune] eq. 3 in PEFT orientation), shape (…, d_out, d_in).

    B (…, d_out, r_g), R and Φ (…, r_g, r_g), A (…, r_g, d_in); leading dims (e.g. layers) broadcast.
    """
    fn = "trilora_delta"
    r = _check_square_pair(fn, R, Phi)
    if A.dim() < 2 or A.shape[-2] != r:
        raise ConfigError(f"{fn}: A must be (…, r_g, d_in) with r_g = {r}, got {tuple(A.shape)}")
    if not math.isfinite(float(s)):
        raise ConfigError(f"{fn}: s must be a finite number, got {s}")
    return float(s) * (trilora_fold(B, R, Phi) @ A)


def sparsify_support(Phi: torch.Tensor, beta: float) -> torch.Tensor:
    """Support of Φ: boolean mask of the top-β fraction of entries by |Φ|, per (r_g × r_g) matrix.

    §4.2: Φ^l_k has client sparsity ratio β_k ∈ [0, 1] = the proportion of non-zero (trainable)
    entries. Keeps k = ⌈β·r_g²⌉ entries of each trailing matrix (so the density is at least β and
    β > 0 never yields an empty support; β = 0 → none, β = 1 → all); ties are broken by flat index
    (row-major), deterministic. Shape (…, r_g, r_g) like Φ.
    """
    fn = "sparsify_support"
    if Phi.dim() < 2:
        raise ConfigError(f"{fn}: Phi must be (…, r_g, r_g), got {tuple(Phi.shape)}")
    try:
        beta_f = float(beta)
    except (TypeError, ValueError):
        raise ConfigError(f"{fn}: beta must be a number in [0, 1], got {beta!r}") from None
    if not (0.0 <= beta_f <= 1.0):
        raise ConfigError(f"{fn}: beta must be a number in [0, 1], got {beta!r}")
    check_finite(fn, "Phi", Phi)
    n = Phi.shape[-1] * Phi.shape[-2]
    keep = min(n, max(0, math.ceil(beta_f * n - 1e-9)))
    flat = Phi.detach().abs().reshape(-1, n)
    order = torch.sort(flat, dim=1, descending=True, stable=True).indices[:, :keep]
    mask = torch.zeros_like(flat, dtype=torch.bool)
    mask.scatter_(1, order, True)
    return mask.reshape(Phi.shape)


def _check_omega(fn: str, R: torch.Tensor, Omega: torch.Tensor, layer_name: str) -> None:
    if R.dim() != 3 or R.shape[-1] != R.shape[-2]:
        raise ConfigError(f"{fn}: R must be ({layer_name}, r_g, r_g), got {tuple(R.shape)}")
    if Omega.dim() != 2:
        raise ConfigError(f"{fn}: Omega must be (L_k, L_g), got {tuple(Omega.shape)}")
    check_finite(fn, "R", R)
    check_finite(fn, "Omega", Omega)


def to_global(R_k: torch.Tensor, Omega_k: torch.Tensor) -> torch.Tensor:
    """R_{k→g} = R_k ×_layer Ω_k ([H²Tune] eq. 4): (L_k, r_g, r_g), (L_k, L_g) → (L_g, r_g, r_g)."""
    fn = "to_global"
    _check_omega(fn, R_k, Omega_k, "L_k")
    if Omega_k.shape[0] != R_k.shape[0]:
        raise ConfigError(f"{fn}: Omega_k has {Omega_k.shape[0]} rows but R_k has L_k = {R_k.shape[0]} layers; "
                          "Omega_k must be (L_k, L_g)")
    return torch.einsum("lij,lg->gij", R_k, Omega_k.to(R_k.dtype))


def to_client(R_g: torch.Tensor, Omega_k: torch.Tensor) -> torch.Tensor:
    """R_{g→k} = R_g ×_layer Ω_kᵀ ([H²Tune] eq. 5): (L_g, r_g, r_g), (L_k, L_g) → (L_k, r_g, r_g)."""
    fn = "to_client"
    _check_omega(fn, R_g, Omega_k, "L_g")
    if Omega_k.shape[1] != R_g.shape[0]:
        raise ConfigError(f"{fn}: Omega_k has {Omega_k.shape[1]} columns but R_g has L_g = {R_g.shape[0]} layers; "
                          "Omega_k must be (L_k, L_g)")
    return torch.einsum("gij,lg->lij", R_g, Omega_k.to(R_g.dtype))


def server_mean(R_kg: Sequence[torch.Tensor]) -> torch.Tensor:
    """R_g = (1/K) Σ_k R_{k→g} ([H²Tune] App. A, unweighted); all (L_g, r_g, r_g); float64 accumulation."""
    fn = "server_mean"
    if len(R_kg) == 0:
        raise ConfigError(f"{fn}: need at least one client matrix")
    shape = R_kg[0].shape
    for k, r in enumerate(R_kg):
        if r.shape != shape:
            raise ConfigError(f"{fn}: client {k} sends shape {tuple(r.shape)}, expected {tuple(shape)} "
                              "(L_g, r_g, r_g) like client 0; align layers with to_global first")
        check_finite(fn, f"R_kg[{k}]", r)
    total = torch.stack([r.to(torch.float64) for r in R_kg]).sum(0)
    return (total / len(R_kg)).to(R_kg[0].dtype)


def h2tune_aggregate(Rs: Sequence[torch.Tensor], Omegas: Sequence[torch.Tensor]) -> torch.Tensor:
    """Server step from clients' (R_k (L_k, r_g, r_g), Ω_k (L_k, L_g)): mean of R_{k→g} → R_g (L_g, r_g, r_g).

    In the protocol the client uploads R_{k→g} (docs/design.md §4.10) and the server calls
    :func:`server_mean`; this helper is the same composed for tests and the embedded simulator.
    """
    if len(Rs) != len(Omegas):
        raise ConfigError(f"h2tune_aggregate: need one Omega per R, got {len(Rs)} R and {len(Omegas)} Omega")
    return server_mean([to_global(r, o) for r, o in zip(Rs, Omegas)])


def kl_softmax(R_k: torch.Tensor, R_gk: torch.Tensor, per_layer: bool = True,
               reduction: str = "sum") -> torch.Tensor:
    """KL(softmax(flatten R_k) ‖ softmax(flatten R_{g→k})) — the regulariser of [H²Tune] eq. 6.

    ``per_layer=True``: each (r_g × r_g) matrix is flattened to r_g² logits and one KL per layer is
    formed, then reduced over layers with ``reduction`` ('sum', 'mean' or 'none'); ``per_layer=False``
    flattens the whole stack into one distribution. Differentiable (log-softmax, no clamping).
    """
    fn = "kl_softmax"
    if R_k.shape != R_gk.shape:
        raise ConfigError(f"{fn}: R_k {tuple(R_k.shape)} and R_gk {tuple(R_gk.shape)} must have the same shape")
    if R_k.dim() < 2:
        raise ConfigError(f"{fn}: R_k must be (…, r_g, r_g), got {tuple(R_k.shape)}")
    if reduction not in ("sum", "mean", "none"):
        raise ConfigError(f"{fn}: reduction must be 'sum', 'mean' or 'none', got {reduction!r}")
    if per_layer:
        p_logits = R_k.reshape(*R_k.shape[:-2], -1)
        q_logits = R_gk.reshape(*R_gk.shape[:-2], -1)
    else:
        p_logits, q_logits = R_k.reshape(-1), R_gk.reshape(-1)
    log_p = torch.log_softmax(p_logits, dim=-1)
    log_q = torch.log_softmax(q_logits, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    if reduction == "sum":
        return kl.sum()
    if reduction == "mean":
        return kl.mean()
    return kl
