"""Fed-SB's server math (Singhal, Ponkshe, Vartak, Varshney, Vepakomma, "Fed-SB: A Silver Bullet for
Extreme Communication Efficiency and Performance in (Private) Federated LoRA Fine-Tuning", ICML 2025
workshop ES-FoMo III, arXiv 2502.15436), over the LoRA-SB parameterisation and initialisation
(Ponkshe, Singhal et al., "Initialization using Update Approximation is a Silver Bullet for Extremely
Efficient Low-Rank Fine-Tuning", arXiv 2411.19557).

PEFT orientation (docs/design.md §3): A (r, d_in), B (d_out, r), R (r, r) and

    ΔW = s·B R A,      s = 1 (α = r; LoRA-SB removes the scale hyper-parameter)

with B, A frozen after the initialisation and identical on all clients; only R is trained. Hence the
server's mean of the R_k is exact (Fed-SB §3):

    Σ_k p_k s·B R_k A = s·B (Σ_k p_k R_k) A                                   (``fedsb_average``)

LoRA-SB initialisation (LoRA-SB §4, the authors' ``estimate_and_process_grads_torch`` and
``find_and_initialize_grad``): the first step of full fine-tuning with Adam moves each weight by
≈ −η·sign(∇_W L), so with the accumulated full-weight gradient G (d_out, d_in) of a module

    ΔW_init = −η·sign(G) = U Σ Vᵀ  (SVD),   B ← U_r,  A ← V_rᵀ,  R₀ ← Σ_r = diag(σ_1..σ_r)   (``lorasb_init``)

so B R₀ A is the best rank-r approximation of ΔW_init (Eckart–Young): B has orthonormal columns, A
orthonormal rows, R₀ ≠ 0. The authors' code takes the SVD of the transposed gradient (d_in, d_out) and
sets B ← V_r, A ← U_rᵀ of THAT decomposition — the same factors in our orientation. Singular vectors
are unique up to a sign per pair: ``lorasb_init`` fixes it (the entry of largest magnitude of each
column of U is positive, V's column flipped with it) so the same gradient gives the same factors on
every machine.

All functions are pure (inputs untouched), compute in float64 and return the inputs' dtype; bad input
is a one-line :class:`~fedlora.errors.ConfigError`.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from ..errors import ConfigError
from ._checks import check_finite, check_weights, is_int

__all__ = ["lorasb_init", "fedsb_average", "fedsb_fold", "fedsb_delta", "weighted_gradient"]


def _matrices(fn: str, name: str, ts: Sequence[torch.Tensor]) -> tuple[int, ...]:
    if len(ts) == 0:
        raise ConfigError(f"{fn}: {name} must be a non-empty list of tensors (one per client)")
    shape = None
    for k, t in enumerate(ts):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ConfigError(f"{fn}: {name}[{k}] must be a 2-D tensor, got "
                              f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if shape is None:
            shape = tuple(t.shape)
        elif tuple(t.shape) != shape:
            raise ConfigError(f"{fn}: {name}[{k}] has shape {tuple(t.shape)}, expected {shape} like {name}[0]")
        check_finite(fn, f"{name}[{k}]", t)
    return shape


def weighted_gradient(grads: Sequence[torch.Tensor], weights) -> torch.Tensor:
    """Σ_k p_k G_k (weights normalised, p_k = n_k / Σ n): the federation's full-weight gradient of one
    module from each client's own accumulated gradient G_k (d_out, d_in) — what the initialisation
    round's server computes instead of the authors' gradient over the pooled client data."""
    fn = "weighted_gradient"
    _matrices(fn, "grads", grads)
    p = check_weights(fn, weights, len(grads))
    out = sum(float(p[k]) * g.to(torch.float64) for k, g in enumerate(grads))
    return out.to(grads[0].dtype)


def lorasb_init(grad: torch.Tensor, rank: int, lr: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LoRA-SB's initialisation from a module's accumulated full-weight gradient ``grad`` (d_out, d_in):
    returns (B (d_out, r), R₀ (r, r), A (r, d_in)) with U Σ Vᵀ = SVD(−lr·sign(grad)), B = U_r,
    R₀ = diag(Σ_r), A = V_rᵀ (module docstring), in ``grad``'s dtype. ``lr`` η > 0: the size of the
    approximated first full fine-tuning step (R₀ scales with it; B and A do not)."""
    fn = "lorasb_init"
    if not isinstance(grad, torch.Tensor) or grad.dim() != 2:
        raise ConfigError(f"{fn}: grad must be a 2-D tensor (d_out, d_in)")
    check_finite(fn, "grad", grad)
    d_out, d_in = grad.shape
    if not is_int(rank) or not 1 <= rank <= min(d_out, d_in):
        raise ConfigError(f"{fn}: rank must be an integer in [1, min(d_out, d_in) = {min(d_out, d_in)}], got {rank!r}")
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not math.isfinite(lr) or lr <= 0:
        raise ConfigError(f"{fn}: lr (η of the approximated first step) must be a finite number > 0, got {lr!r}")
    M = -float(lr) * torch.sign(grad.to(torch.float64))
    U, S, Vh = torch.linalg.svd(M, full_matrices=False)
    U, S, Vh = U[:, :rank], S[:rank], Vh[:rank]
    # one sign per singular pair: the largest-magnitude entry of each column of U is positive
    idx = U.abs().argmax(dim=0)
    flip = torch.sign(U[idx, torch.arange(rank)])
    flip = torch.where(flip == 0, torch.ones_like(flip), flip)
    U, Vh = U * flip, Vh * flip[:, None]
    dt = grad.dtype
    return U.to(dt), torch.diag(S).to(dt), Vh.to(dt)


def fedsb_average(Rs: Sequence[torch.Tensor], weights) -> torch.Tensor:
    """The server's R = Σ_k p_k R_k (weights normalised) of one module: this round's uploads only (the
    authors' multi-round scripts average the R's of every round so far — not copied)."""
    fn = "fedsb_average"
    shape = _matrices(fn, "Rs", Rs)
    if shape[0] != shape[1]:
        raise ConfigError(f"{fn}: R must be square (r, r), got {shape}")
    p = check_weights(fn, weights, len(Rs))
    out = sum(float(p[k]) * R.to(torch.float64) for k, R in enumerate(Rs))
    return out.to(Rs[0].dtype)


def fedsb_fold(B: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """B·R (([G,] d_out, r) @ ([G,] r, r)): the up factor a plain LoRA layer (the kernels, the PEFT
    export) holds so that its s·(B R) A is Fed-SB's ΔW. Differentiable in both."""
    if B.shape[-1] != R.shape[-2] or R.shape[-1] != R.shape[-2]:
        raise ConfigError(f"fedsb_fold: B {tuple(B.shape)} and R {tuple(R.shape)} must be (…, d_out, r) and (…, r, r)")
    return B @ R


def fedsb_delta(B: torch.Tensor, R: torch.Tensor, A: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """ΔW = s·B R A (d_out, d_in), float64 products, ``B``'s dtype (for reporting and tests)."""
    return (scale * (B.to(torch.float64) @ R.to(torch.float64) @ A.to(torch.float64))).to(B.dtype)
