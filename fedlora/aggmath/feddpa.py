"""FedDPA's pure math (Yang, Long, Shen, Jiang, Blumenstein, "Dual-Personalizing Adapter for Federated
Foundation Models", NeurIPS 2024, arXiv 2403.19211).

* ``feddpa_average``: the server's mean of the clients' GLOBAL adapters (the local ones never leave a client),
  Σ_k p_k (A_k, B_k) with p_k the clients' data weights n_k/Σn, or 1/M over the M uploads with
  ``uniform=True`` (what the authors' code does: its data-weighted line is commented out).
* ``instance_weight``: the instance-wise dynamic weight of one test input x (the paper's instance-wise
  dynamic weighting mechanism; the authors' ``get_weight``): w(x) = scale · (1/N) Σ_j cos(e(x), e(x_j))
  over N of the client's training inputs x_j, with e(·) a representation of an input (the code: the
  last layer's hidden state of the last token).
* ``mix_delta``: the adapted weight a client's model uses with weights (w_g, w_l) on its two adapters,
  w_g·s_g·B A + w_l·s_l·D C (PEFT orientation; the global adapter (A, B), the local one (C, D)).
* ``instance_mixed_output``: one adapted layer's output with a weight per input row from that row's
  representation — the reference the runtimes' instance-wise weighting is tested against.
* ``pool_representation``: e(x) from a model's last hidden states — the last real token's (the code's
  ``emb_type='last'``) or the mean over the real tokens (its ``'avg'``, the paper's ablation).

Every function is pure and raises ``ConfigError`` on bad input.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch

from ..aggregation import fedavg_factors
from ..errors import ConfigError

__all__ = ["feddpa_average", "instance_weight", "mix_delta", "instance_mixed_output", "pool_representation"]


def feddpa_average(uploads: Sequence[Mapping[str, torch.Tensor]], weights: torch.Tensor,
                   uniform: bool = False) -> dict[str, torch.Tensor]:
    """The global adapter's server state: Σ_k p_k T_k for every uploaded tensor T (each factor apart),
    with p_k = weights_k (normalised by ``fedavg_factors``), or p_k = 1/M when ``uniform``."""
    if not uploads:
        raise ConfigError("feddpa_average: no uploads")
    w = torch.as_tensor(weights, dtype=torch.float64)
    if w.dim() != 1 or w.numel() != len(uploads):
        raise ConfigError(f"feddpa_average: {len(uploads)} uploads but weights of shape {tuple(w.shape)}")
    if uniform:
        w = torch.ones(len(uploads), dtype=torch.float64)
    return fedavg_factors(list(uploads), w)


def instance_weight(query: torch.Tensor, refs: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
    """w = scale · mean_j cos(q, r_j) for every row q of ``query`` (n, d) (or one vector (d,)), over the
    rows r_j of ``refs`` (N, d): shape (n,) (or a scalar). A zero vector has cosine 0 with everything."""
    if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale)
            and 0 < scale <= 1):
        raise ConfigError(f"instance_weight: scale must be a number in (0, 1], got {scale!r}")
    single = query.dim() == 1
    q = query[None] if single else query
    if q.dim() != 2 or refs.dim() != 2 or refs.shape[0] < 1 or refs.shape[1] != q.shape[1]:
        raise ConfigError(f"instance_weight: query (n, d) and refs (N ≥ 1, d) needed, got {tuple(query.shape)} "
                          f"and {tuple(refs.shape)}")
    eps = torch.finfo(q.dtype).tiny if q.dtype.is_floating_point else 0.0
    qn = q / q.norm(dim=1, keepdim=True).clamp_min(eps)
    rn = refs.to(q.dtype) / refs.to(q.dtype).norm(dim=1, keepdim=True).clamp_min(eps)
    w = scale * (qn @ rn.T).mean(dim=1)
    return w[0] if single else w


def mix_delta(A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, s_global: float,
              s_local: float, w_global: float, w_local: float) -> torch.Tensor:
    """ΔW = w_g·s_g·B A + w_l·s_l·D C (d_out, d_in): the adapted update a client's model applies."""
    if A.shape[-1] != C.shape[-1] or B.shape[-2] != D.shape[-2]:
        raise ConfigError(f"mix_delta: the two adapters must adapt the same module: A {tuple(A.shape)}, "
                          f"B {tuple(B.shape)}, C {tuple(C.shape)}, D {tuple(D.shape)}")
    return w_global * s_global * (B @ A) + w_local * s_local * (D @ C)


def instance_mixed_output(x: torch.Tensor, W0: torch.Tensor | None, A: torch.Tensor, B: torch.Tensor,
                          C: torch.Tensor, D: torch.Tensor, s_global: float, s_local: float,
                          representations: torch.Tensor, refs: torch.Tensor, scale: float = 0.5,
                          weight_on: str = "local") -> torch.Tensor:
    """One adapted layer's output with the instance-wise dynamic weighting, row by row (the reference a
    runtime's implementation is to be checked against): w_i = ``instance_weight(representations[i], refs,
    scale)``; with ``weight_on="local"`` (the paper's stated intent: an input like the client's data leans on
    the local adapter) y_i = W0 x_i + (1 − w_i)·s_g·B A x_i + w_i·s_l·D C x_i; with ``weight_on="global"`` (the
    authors' code) w_i and 1 − w_i are swapped. ``x`` (n, d_in), ``representations`` (n, d), ``refs`` (N, d)."""
    if weight_on not in ("local", "global"):
        raise ConfigError(f"instance_mixed_output: weight_on must be 'local' or 'global', got {weight_on!r}")
    if x.dim() != 2 or representations.dim() != 2 or representations.shape[0] != x.shape[0]:
        raise ConfigError(f"instance_mixed_output: x (n, d_in) and one representation per row (n, d) needed, got "
                          f"{tuple(x.shape)} and {tuple(representations.shape)}")
    w = instance_weight(representations, refs, scale).to(x.dtype)[:, None]
    w_local, w_global = (w, 1 - w) if weight_on == "local" else (1 - w, w)
    y = x @ W0.T if W0 is not None else torch.zeros(x.shape[0], B.shape[0], dtype=x.dtype, device=x.device)
    return y + w_global * s_global * (x @ A.T) @ B.T + w_local * s_local * (x @ C.T) @ D.T


def pool_representation(hidden: torch.Tensor, mask: torch.Tensor, how: str = "last") -> torch.Tensor:
    """e(x) of every input from its last hidden states ``hidden`` (n, T, H) over the tokens ``mask`` (n, T)
    marks as the input's (1) — padding and any target tokens 0: ``how="last"`` the hidden state at the last
    marked position (the authors' ``emb_type='last'``), ``"mean"`` the mean over the marked positions
    (``'avg'``). Shape (n, H). An input with no marked token is refused."""
    if how not in ("last", "mean"):
        raise ConfigError(f"pool_representation: how must be 'last' or 'mean', got {how!r}")
    if hidden.dim() != 3 or tuple(mask.shape) != tuple(hidden.shape[:2]):
        raise ConfigError(f"pool_representation: hidden (n, T, H) and mask (n, T) needed, got "
                          f"{tuple(hidden.shape)} and {tuple(mask.shape)}")
    m = mask.to(torch.bool)
    if not bool(m.any(dim=1).all()):
        raise ConfigError("pool_representation: an input has no token to represent it (all masked)")
    if how == "mean":
        w = m.to(hidden.dtype)[..., None]
        return (hidden * w).sum(1) / w.sum(1)
    pos = torch.arange(m.shape[1], device=m.device).expand_as(m).masked_fill(~m, -1).amax(1)  # last marked
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), pos]
