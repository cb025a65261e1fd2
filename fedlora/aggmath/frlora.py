"""FRLoRA's server math: Yan, Feng, Zuo, Zhu, Goh, Liu, "Federated Residual Low-Rank Adaption of Large
Language Models", ICLR 2025 (OpenReview e0rQRMUhs7).

The paper's full text could not be read here (only its abstract); the rule below is the abstract's,
made exact from the authors' code (github.com/IAMJackYan/FRLoRA: ``fed_global.ours_init`` and the round
loop of ``label_skew_ours.py``) and from a third-party reading of the paper's Algorithm 1 (initial
W0 − B0A0). docs/methods/frlora.md lists what is the paper's, what the code's, and what is a decision.

In PEFT orientation (A (r, d_in), B (d_out, r), s = α/r), for every adapted layer with pretrained weight W0:

* **principal initialisation, once** (the abstract: "the principal singular values and vectors of the
  pre-trained weights"; ``ours_init``): W0 = U Σ Vᵀ, in float64,

      B0 = U_r diag(√(σ_r / s)),   A0 = diag(√(σ_r / s)) V_rᵀ,   so s·B0A0 = U_r Σ_r V_rᵀ;

* **base compensation, once** (Algorithm 1's Ŵ0 = W0 − B0A0, the scale written out): Ŵ0 = W0 − s·B0A0, so
  the model Ŵ0 + s·B0A0 is exactly the pretrained one;
* **each round**: clients start from (B0, A0) on the current base Ŵ_t and train both factors; the server
  averages them separately, B̄ = Σ p_k B_k, Ā = Σ p_k A_k; the global update ("the weight of the global
  model parameters summed with a residual low-rank matrix product, i.e. the weight change") is

      ΔW_t = s·(B̄Ā − B0A0),     Ŵ_{t+1} = Ŵ_t + ΔW_t,

  and every client restarts from (B0, A0) — "reinitializes the local low-rank matrices … in each
  round". The model is unchanged by the restart: Ŵ_{t+1} + s·B0A0 = Ŵ_t + s·B̄Ā (``frlora_merge``).
  Over T rounds the base moves by Σ_t ΔW_t, a matrix of rank up to T·r + r ("global updates in a
  higher-rank parameter space"); ``frlora_merged_lora`` writes Ŵ_T − W0 as one LoRA.

Every function is pure (inputs untouched) and raises ``ConfigError`` on bad input; products are formed
in float64 and the result cast to the dtype of the weight (or factor) given.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..errors import ConfigError
from ._checks import check_factor_pairs, check_finite, check_scales, check_weights

__all__ = ["frlora_principal", "frlora_compensate", "frlora_average", "frlora_update", "frlora_merge",
           "frlora_merged_lora"]


def _check_w(fn: str, W: torch.Tensor) -> None:
    if not isinstance(W, torch.Tensor) or W.dim() != 2:
        raise ConfigError(f"{fn}: W must be a 2-D tensor (d_out, d_in)")
    check_finite(fn, "W", W)


def _check_pair(fn: str, W: torch.Tensor, B: torch.Tensor, A: torch.Tensor, what: str) -> None:
    if B.dim() != 2 or A.dim() != 2 or B.shape[1] != A.shape[0] or W.shape != (B.shape[0], A.shape[1]):
        raise ConfigError(f"{fn}: shapes W {tuple(W.shape)}, {what} B {tuple(B.shape)}, A {tuple(A.shape)} do not "
                          f"fit W (d_out, d_in) = B (d_out, r) @ A (r, d_in)")
    check_finite(fn, f"{what} B", B)
    check_finite(fn, f"{what} A", A)


def frlora_principal(W: torch.Tensor, rank: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(B0 (d_out, r), A0 (r, d_in)) from the top-r singular triplets of ``W`` (float64 SVD), in W's dtype:
    B0 = U_r diag(√(σ_r/s)), A0 = diag(√(σ_r/s)) V_rᵀ, so s·B0A0 is the best rank-r approximation of W.

    A W with fewer than r positive singular values (rank-deficient, e.g. zero) would leave slots with
    B0's column and A0's row both zero, which no gradient can move: ``ConfigError``."""
    fn = "frlora_principal"
    _check_w(fn, W)
    s = check_scales(fn, scale, 1, "scale")[0]
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= min(W.shape):
        raise ConfigError(f"{fn}: rank must be an integer in [1, min(d_out, d_in) = {min(W.shape)}], got {rank!r}")
    U, sig, Vh = torch.linalg.svd(W.to(torch.float64), full_matrices=False)
    if not bool(sig[rank - 1] > sig[0] * torch.finfo(torch.float64).eps * max(W.shape)):
        q = int((sig > sig[0] * torch.finfo(torch.float64).eps * max(W.shape)).sum()) if bool(sig[0] > 0) else 0
        raise ConfigError(f"{fn}: W has numerical rank {q} < rank {rank}: its principal directions leave "
                          f"{rank - q} LoRA slot(s) at zero in both factors, which cannot train; use a rank ≤ {q} "
                          f"or the PEFT initialisation")
    root = torch.sqrt(sig[:rank] / s)
    B0 = U[:, :rank] * root[None, :]
    A0 = root[:, None] * Vh[:rank]
    return B0.to(W.dtype), A0.to(W.dtype)


def frlora_compensate(W0: torch.Tensor, B0: torch.Tensor, A0: torch.Tensor, scale: float) -> torch.Tensor:
    """The compensated base Ŵ0 = W0 − s·B0A0 (a new tensor, W0's dtype): with the adapter (B0, A0) at scale
    s the model Ŵ0 + s·B0A0 is W0 (up to one rounding to W0's dtype)."""
    fn = "frlora_compensate"
    _check_w(fn, W0)
    _check_pair(fn, W0, B0, A0, "principal")
    s = check_scales(fn, scale, 1, "scale")[0]
    return (W0.to(torch.float64) - s * (B0.to(torch.float64) @ A0.to(torch.float64))).to(W0.dtype)


def frlora_average(Bs: Sequence[torch.Tensor], As: Sequence[torch.Tensor], weights
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The server's average of the uploaded factors, each separately: (B̄ = Σ p_k B_k, Ā = Σ p_k A_k), with
    p_k the normalised ``weights``, in the factors' dtype (float64 sums). All clients share one rank."""
    fn = "frlora_average"
    check_factor_pairs(fn, Bs, As, same_rank=True)
    p = check_weights(fn, weights, len(Bs))
    B = sum(p[k] * b.to(torch.float64) for k, b in enumerate(Bs))
    A = sum(p[k] * a.to(torch.float64) for k, a in enumerate(As))
    return B.to(Bs[0].dtype), A.to(As[0].dtype)


def frlora_update(B_bar: torch.Tensor, A_bar: torch.Tensor, B0: torch.Tensor, A0: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """The round's global update ΔW = s·(B̄Ā − B0A0) (d_out, d_in), dense, in B̄'s dtype."""
    fn = "frlora_update"
    if B_bar.dim() != 2 or A_bar.dim() != 2:
        raise ConfigError(f"{fn}: B̄ (d_out, r) and Ā (r, d_in) must be 2-D")
    _check_pair(fn, torch.empty(B_bar.shape[0], A_bar.shape[1]), B_bar, A_bar, "averaged")
    _check_pair(fn, torch.empty(B_bar.shape[0], A_bar.shape[1]), B0, A0, "principal")
    s = check_scales(fn, scale, 1, "scale")[0]
    d = lambda t: t.to(torch.float64)  # noqa: E731
    return (s * (d(B_bar) @ d(A_bar) - d(B0) @ d(A0))).to(B_bar.dtype)


def frlora_merge(W: torch.Tensor, B_bar: torch.Tensor, A_bar: torch.Tensor, B0: torch.Tensor, A0: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """The new base Ŵ + s·(B̄Ā − B0A0) (a new tensor, W's dtype; one rounding of the float64 sum)."""
    fn = "frlora_merge"
    _check_w(fn, W)
    _check_pair(fn, W, B_bar, A_bar, "averaged")
    _check_pair(fn, W, B0, A0, "principal")
    s = check_scales(fn, scale, 1, "scale")[0]
    d = lambda t: t.to(torch.float64)  # noqa: E731
    return (d(W) + s * (d(B_bar) @ d(A_bar) - d(B0) @ d(A0))).to(W.dtype)


def frlora_merged_lora(averages: Sequence[tuple[torch.Tensor, torch.Tensor]], B0: torch.Tensor, A0: torch.Tensor,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """How far the base moved from W0 after the compensation and the merges of ``averages`` = [(B̄_t, Ā_t)],
    as ONE LoRA at scale 1: (B_cat (d_out, (T+1)r), A_cat ((T+1)r, d_in)) with

        B_cat A_cat = Σ_t s·B̄_tĀ_t − (T+1)·s·B0A0 = (Ŵ_T − W0),

    B_cat = [s·B̄_1, …, s·B̄_T, −(T+1)·s·B0], A_cat = [Ā_1; …; Ā_T; A0] (B0's dtype; s·B̄ rounded once)."""
    fn = "frlora_merged_lora"
    if B0.dim() != 2 or A0.dim() != 2 or B0.shape[1] != A0.shape[0]:
        raise ConfigError(f"{fn}: B0 (d_out, r) and A0 (r, d_in) must be 2-D and share r")
    s = check_scales(fn, scale, 1, "scale")[0]
    shape = torch.empty(B0.shape[0], A0.shape[1])
    for t, (B, A) in enumerate(averages):
        _check_pair(fn, shape, B, A, f"round {t}'s averaged")
    T, dt = len(averages), B0.dtype
    B_cat = torch.cat([(s * B.to(torch.float64)).to(dt) for B, _ in averages]
                      + [(-(T + 1) * s * B0.to(torch.float64)).to(dt)], dim=1)
    A_cat = torch.cat([A.to(dt) for _, A in averages] + [A0], dim=0)
    return B_cat, A_cat
