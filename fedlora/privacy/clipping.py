"""Clipping and Gaussian noise for the two levels of differential privacy (pure tensor functions).

Client level — DP-FedAvg (McMahan, Ramage, Talwar, Zhang, "Learning Differentially Private Recurrent Language
Models", ICLR 2018, Algorithm 1): each participant's update Δ_k = upload − download is clipped to L2 norm C over
the WHOLE payload (``clip_update``, their flat clipping π(Δ, S) = Δ · min(1, S/‖Δ‖)), the server adds
N(0, σ²C² I) to the sum and divides by the EXPECTED number of participants qK (``private_mean``: their fixed-
denominator estimator f̃_f, eq. in §2 "Bounded-sensitivity estimators", with equal weights w_k = 1 — data-size
weights are dropped, so one client's sensitivity is C/(qK)).

Sample level — DP-SGD (Abadi et al., "Deep Learning with Differential Privacy", CCS 2016, Algorithm 1): every
example's gradient is clipped to norm C over all trained tensors jointly (``clip_per_sample``), the clipped
gradients are summed, N(0, σ²C² I) is added (``gaussian_noise_like``) and the sum is divided by the expected
batch size. The per-example gradients of a LoRA layer come from its input and its output gradient
(``per_sample_lora_grads``): rank-r einsums, the d_out × d_in product never formed.

Clipping factor: min(1, C / (‖g‖ + 1e-6)), Opacus's (``opacus.optimizers.optimizer``, per_sample_clip_factor),
and where it is below 1 also (1 − 2·eps of the tensors' dtype), so that a clipped norm is never above C after
rounding, float32 included; norms are computed in float64. A gradient with ‖g‖ + 1e-6 ≤ C is left unchanged.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch

from fedlora.errors import ConfigError

__all__ = ["clip_update", "gaussian_noise_like", "private_mean", "per_sample_lora_grads", "per_sample_norms",
           "clip_per_sample", "check_clip_norm"]

#: added to a norm before dividing C by it (Opacus's constant): keeps clipped norms ≤ C under rounding
CLIP_EPS = 1e-6


def check_clip_norm(clip, name: str = "clip_norm") -> float:
    """C as a float: a finite number > 0, else one-line ConfigError."""
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not math.isfinite(clip) or clip <= 0:
        raise ConfigError(f"{name} must be a finite number > 0, got {clip!r}")
    return float(clip)


def _check_std(std, name: str) -> float:
    if isinstance(std, bool) or not isinstance(std, (int, float)) or not math.isfinite(std) or std < 0:
        raise ConfigError(f"{name} must be a finite number ≥ 0, got {std!r}")
    return float(std)


def _clip_factor(norm: torch.Tensor, clip: float, dtype: torch.dtype) -> torch.Tensor:
    """min(1, C / (norm + 1e-6)), float64, elementwise; where it is below 1 it is also shrunk by 2 ulps of
    ``dtype`` (1 − 2·eps), so that rounding the factor and the products in ``dtype`` cannot carry a clipped
    norm above C (float32 norms above ~17 would otherwise exceed C by up to ~1e-7, the 1e-6 margin being
    smaller than float32's rounding there)."""
    factor = clip / (norm + CLIP_EPS)
    return torch.where(factor < 1.0, factor * (1.0 - 2.0 * torch.finfo(dtype).eps), torch.ones_like(factor))


def clip_update(upload: Mapping[str, torch.Tensor], download: Mapping[str, torch.Tensor], clip
                ) -> tuple[dict[str, torch.Tensor], float]:
    """A participant's update Δ = upload − download, clipped to L2 norm ``clip`` over the whole payload.

    Args:
        upload: name → tensor the client sends.
        download: name → the value the client started the round from, for every uploaded name (same shape).
        clip: C > 0.
    Returns:
        (clipped Δ (name → tensor, upload's dtype), ‖Δ‖ before clipping as a float). Δ · min(1, C/(‖Δ‖ + 1e-6))
        (McMahan et al., ICLR 2018, Algorithm 1, flat clipping; the factor shrunk by 2 ulps when below 1, see
        the module's note): a Δ with ‖Δ‖ + 1e-6 ≤ C comes back unchanged, bit for bit.
    """
    c = check_clip_norm(clip)
    missing = [k for k in upload if k not in download]
    if missing:
        raise ConfigError(f"clip_update: the uploaded {missing[0]!r} has no downloaded value to take the update "
                          f"from (downloaded: {sorted(download)[:8]})")
    delta = {}
    for k, u in upload.items():
        d = download[k]
        if tuple(u.shape) != tuple(d.shape):
            raise ConfigError(f"clip_update: {k!r} is uploaded as {tuple(u.shape)} but was downloaded as "
                              f"{tuple(d.shape)}")
        delta[k] = u - d.to(device=u.device, dtype=u.dtype)
    norm = _global_norm(delta.values())
    factor = _clip_factor(norm, c, _coarsest(delta.values()))
    if factor < 1.0:
        delta = {k: v * factor.to(v.dtype) for k, v in delta.items()}
    return delta, float(norm)


def _coarsest(tensors) -> torch.dtype:
    """The floating dtype with the largest epsilon among ``tensors`` (float32 if none is floating)."""
    dtypes = [t.dtype for t in tensors if t.is_floating_point()]
    return max(dtypes, key=lambda d: torch.finfo(d).eps) if dtypes else torch.float32


def _global_norm(tensors) -> torch.Tensor:
    """‖concatenation of ``tensors``‖₂ in float64 (a 0-d CPU tensor)."""
    total = torch.zeros((), dtype=torch.float64)
    for t in tensors:
        total = total + t.detach().to(torch.float64).pow(2).sum().cpu()
    return total.sqrt()


def gaussian_noise_like(tensors: Mapping[str, torch.Tensor], std, generator: torch.Generator
                        ) -> dict[str, torch.Tensor]:
    """Independent N(0, std²) noise shaped like each of ``tensors``, drawn from ``generator`` only.

    Names are drawn in sorted order (the noise of a name does not depend on the mapping's order, which a
    transport may change); each draw is made in the tensor's dtype on the generator's device, then moved to
    the tensor's device. Same generator state → bit-identical noise. ``std = 0`` gives zeros and draws nothing.
    """
    s = _check_std(std, "noise std")
    if not isinstance(generator, torch.Generator):
        raise ConfigError(f"noise needs a torch.Generator (its own seeded stream), got {type(generator).__name__}")
    out = {}
    for k in sorted(tensors):
        t = tensors[k]
        if not t.is_floating_point():
            raise ConfigError(f"noise for {k!r}: a floating-point tensor is needed, got {t.dtype}")
        if s == 0.0:
            out[k] = torch.zeros_like(t)
            continue
        z = torch.randn(tuple(t.shape), generator=generator, dtype=t.dtype, device=generator.device)
        out[k] = (z * s).to(t.device)
    return {k: out[k] for k in tensors}


def private_mean(clipped_deltas: Sequence[Mapping[str, torch.Tensor]], sigma, clip, expected_participants,
                 generator: torch.Generator) -> dict[str, torch.Tensor]:
    """DP-FedAvg's server step: (Σ_k Δ_k + N(0, σ²C² I)) / (expected number of participants).

    The fixed-denominator estimator of McMahan et al. (ICLR 2018, §2 "Bounded-sensitivity estimators", f̃_f
    with w_k = 1 and W = qK): the denominator is the EXPECTED participant count qK, not the realised one, so
    one client changes the mean by at most C/(qK) and the released value is the Gaussian mechanism with noise
    multiplier σ on that sensitivity. Unbiased for the mean update under Poisson sampling of clients.

    Args:
        clipped_deltas: each participant's ``clip_update`` output, same names and shapes (at least one).
        sigma: noise multiplier σ ≥ 0; the noise std on the sum is σ·C.
        clip: the C the deltas were clipped to.
        expected_participants: qK > 0.
        generator: the server's noise stream.
    Returns:
        name → tensor, the private mean update.
    """
    s = _check_std(sigma, "noise_multiplier")
    c = check_clip_norm(clip)
    if isinstance(expected_participants, bool) or not isinstance(expected_participants, (int, float)) \
            or not math.isfinite(expected_participants) or expected_participants <= 0:
        raise ConfigError(f"expected_participants must be a finite number > 0, got {expected_participants!r}")
    if not clipped_deltas:
        raise ConfigError("private_mean needs at least one participant's update")
    names = list(clipped_deltas[0])
    total = {k: clipped_deltas[0][k].clone() for k in names}
    for i, delta in enumerate(clipped_deltas[1:], start=1):
        if list(delta) != names and sorted(delta) != sorted(names):
            raise ConfigError(f"private_mean: update {i} has names {sorted(delta)[:8]}, update 0 has "
                              f"{sorted(names)[:8]}")
        for k in names:
            if tuple(delta[k].shape) != tuple(total[k].shape):
                raise ConfigError(f"private_mean: {k!r} of update {i} is {tuple(delta[k].shape)}, update 0's is "
                                  f"{tuple(total[k].shape)}")
            total[k] = total[k] + delta[k].to(total[k].dtype)
    noise = gaussian_noise_like(total, s * c, generator)
    return {k: (total[k] + noise[k]) / expected_participants for k in names}


def per_sample_lora_grads(x: torch.Tensor, g: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example gradients of one LoRA layer's factors, y = x W0ᵀ + s (x Aᵀ) Bᵀ (PEFT orientation).

    Args:
        x: (n, T, d_in) or (n, d_in) — the input the LoRA path saw (after any LoRA dropout).
        g: (n, T, d_out) or (n, d_out) — ∂L/∂y for L = Σ_i ℓ_i, the SUM of the per-example losses (a mean
            loss gives gradients scaled by 1/n).
        A: (r, d_in); B: (d_out, r); scale: s.
    Returns:
        dA (n, r, d_in) = s Σ_t (g_t B)ᵀ x_t and dB (n, d_out, r) = s Σ_t g_tᵀ (x_t Aᵀ), per example i — the
        chain rule through h = x Aᵀ (n, T, r); every intermediate is rank r (O(n·T·r·(d_in + d_out))), the
        d_out × d_in product is never formed.
    """
    if x.dim() == 2:
        x = x.unsqueeze(1)
    if g.dim() == 2:
        g = g.unsqueeze(1)
    if A.dim() != 2 or B.dim() != 2 or B.shape[1] != A.shape[0]:
        raise ConfigError(f"per_sample_lora_grads: A must be (r, d_in) and B (d_out, r), got {tuple(A.shape)} and "
                          f"{tuple(B.shape)}")
    if x.dim() != 3 or g.dim() != 3 or x.shape[:2] != g.shape[:2] or x.shape[2] != A.shape[1] \
            or g.shape[2] != B.shape[0]:
        raise ConfigError(f"per_sample_lora_grads: x must be (n, T, d_in={A.shape[1]}) and g (n, T, "
                          f"d_out={B.shape[0]}) with the same n, T; got {tuple(x.shape)} and {tuple(g.shape)}")
    h = torch.einsum("ntd,rd->ntr", x, A)                 # x Aᵀ
    gb = torch.einsum("nto,or->ntr", g, B)                # g B
    d_a = scale * torch.einsum("ntr,ntd->nrd", gb, x)
    d_b = scale * torch.einsum("nto,ntr->nor", g, h)
    return d_a, d_b


def per_sample_norms(grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """(n,) float64: each example's gradient norm over ALL the tensors jointly (leading dimension n)."""
    if not grads:
        raise ConfigError("per-sample gradients: no tensors given")
    ns = {k: v.shape[0] if v.dim() else None for k, v in grads.items()}
    if len(set(ns.values())) != 1 or None in ns.values():
        raise ConfigError(f"per-sample gradients must share their leading (example) dimension n, got {ns}")
    sq = None
    for v in grads.values():
        s = v.detach().to(torch.float64).reshape(v.shape[0], -1).pow(2).sum(1).cpu()
        sq = s if sq is None else sq + s
    return sq.sqrt()


def clip_per_sample(grads: Mapping[str, torch.Tensor], clip) -> dict[str, torch.Tensor]:
    """Σ_i g_i · min(1, C/(‖g_i‖ + 1e-6)) (2 ulps less where below 1), ‖g_i‖ the norm of example i's gradient over ALL tensors jointly.

    Args:
        grads: name → (n, …) per-example gradients (e.g. ``per_sample_lora_grads`` of every adapted layer).
        clip: C > 0.
    Returns:
        name → (…) the sum over examples of the clipped gradients (DP-SGD's clipped sum, before noise).
    """
    c = check_clip_norm(clip)
    factor = _clip_factor(per_sample_norms(grads), c, _coarsest(grads.values()))
    out = {}
    for k, v in grads.items():
        f = factor.to(device=v.device, dtype=v.dtype).reshape(-1, *([1] * (v.dim() - 1)))
        out[k] = (v * f).sum(0)
    return out
