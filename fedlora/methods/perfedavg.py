"""Per-FedAvg-LoRA (Fallah et al. 2020 on LoRA factors; [PF2LoRA] App. D; docs/design.md §4.8).

Objective ([PF2LoRA] eq. 21): min_x (1/M) Σ_k f_k(x − α∇f_k(x)) over the LoRA factors x = (A, B) of rank
r, equal on every client. Each local step on client k, with independent batches D, D′, D″ (Fallah et al.
§5, Per-FedAvg (FO) and (HF)):

    x̃ = x − α ∇f_k(x; D)                                   inner SGD step ("one-step update")
    g  = ∇f_k(x̃; D′)                                       gradient at the adapted point
    FO: h = g                                               (drop the Hessian term)
    HF: h = g − α d,  d = [∇f_k(x + δg; D″) − ∇f_k(x − δg; D″)] / (2δ)
                                                            (central finite-difference HVP ∇²f_k(x; D″)·g)
    x ← optimizer step along h with step β

The exact MAML gradient is (I − α∇²f_k(x; D″)) ∇f_k(x̃; D′); HF's d equals the Hessian-vector product
up to O(δ²) (exactly, up to rounding, when f_k is quadratic). δ multiplies g itself, as in Fallah et
al.'s HF update (it is not normalised by ‖g‖, unlike PF2LoRA's finite-difference option).

Optimizers: the inner step is plain SGD with α = ``inner_lr``; the outer step uses β = ``lr`` with
AdamW by default — [PF2LoRA] App. F.1: "Per-FedAvg-LoRA applies SGD for the one-step local update and
AdamW for the global adapter" — or ``optimizer="sgd"`` for Fallah et al.'s plain step. The server
averages A and B (FedAvg, w_k = n_k/Σn). Evaluation (``personalised_params``) uses the parameters
after one inner SGD step with α on a batch of the client's own data, as Per-FedAvg prescribes.
Defaults follow [PF2LoRA] Table 5 (β = α = 1e-3 on most GLUE tasks, r = 8); the paper does not say which
variant it ran, so the cheaper first-order one is the default.

Sample-level DP (``privacy.level: sample``; our variant — neither Fallah et al. nor [PF2LoRA] give one): the
first-order step's two gradients are each a DP-SGD release (Abadi et al., "Deep Learning with Differential
Privacy", CCS 2016, Alg. 1) on its own Poisson batch, with its own noise:

    g̃_in = (Σ_{i∈D} clip_C ∇ℓ_i(x) + N(0, σ²C²)) / (q·n_k)          release 0
    x̃    = x − α g̃_in                                              post-processing of release 0
    h    = (Σ_{i∈D′} clip_C ∇ℓ_i(x̃) + N(0, σ²C²)) / (q·n_k)         release 1, at the released x̃
    x ← optimizer step along h

Each release is the subsampled Gaussian mechanism of one DP-SGD step at x or at a point already released, so a
local step composes two of them (``sample_dp_releases`` = 2: the accountant counts 2 × local steps, and σ is
calibrated for as many). The hessian-free variant adds a third release, its Hessian-vector term on its own
Poisson batch D″, with the released h as the direction (post-processing):

    dᵢ = [∇ℓᵢ(x + δh) − ∇ℓᵢ(x − δh)] / (2δ)                        each example's finite-difference HVP
    d̃  = (Σ_{i∈D″} clip_C dᵢ + N(0, σ²C²)) / (q·n_k)                 release 2
    h ← h − α d̃

Clipping each example's DIFFERENCE dᵢ (not each side: the two sides' gradients cancel in dᵢ, and their clips would
not bound it as one release) makes dᵢ one per-example function with sensitivity C — a DP-SGD release like the
others (``sample_dp_releases_for`` = 3 for this variant). The personalisation step at evaluation uses the client's
data locally and is not a release.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch

from ..errors import ConfigError
from ..optim import make_optimizer
from ..payload import Payload
from .base import AveragedFactors, Objective, Sampler, register

__all__ = ["PerFedAvgLoRA"]

VARIANTS = ("first-order", "hessian-free")


def _grad(loss: torch.Tensor, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    gs = torch.autograd.grad(loss, list(inputs), allow_unused=True)
    return [torch.zeros_like(i) if g is None else g for i, g in zip(inputs, gs)]


@register
class PerFedAvgLoRA(AveragedFactors):
    """Per-FedAvg over the LoRA factors (A, B), stacked replicas.

    Args:
        rank: LoRA rank r, equal on all clients ([PF2LoRA] App. D: "homogeneous rank").
        lr: outer (meta) step size β (> 0).
        inner_lr: inner SGD step size α (> 0), also used for the personalisation step at evaluation.
        variant: "first-order" (FO) or "hessian-free" (HF).
        delta: finite-difference step δ of HF (> 0; Fallah et al. use a small δ, here 1e-3).
        optimizer: outer optimizer, "adamw" (default, [PF2LoRA] App. F.1) or "sgd" (Fallah et al.).
        weight_decay: outer optimizer's weight decay (≥ 0).
    """

    name = "perfedavg"
    sample_dp_refusal = None  # DP-SGD releases per step: 2 (first-order), 3 (hessian-free); module doc
    sample_dp_note = ("its inner and meta gradients are each a DP-SGD release, 2 per local step (first-order), and "
                      "the hessian-free variant's Hessian-vector term a third, each example's difference clipped; "
                      "all counted")
    sample_dp_releases = 2
    lora_upload = ("lora_A", "lora_B")  # its server averages the uploads: PEFT adapters aggregate with it
    personalised = True  # one SGD step on the client's own data (personalised_params)
    head_modes = ("frozen", "shared")  # a trained head is part of the meta-learned x

    def __init__(self, rank: int = 8, lr: float = 1e-3, inner_lr: float = 1e-3, variant: str = "first-order",
                 delta: float = 1e-3, optimizer: str = "adamw", weight_decay: float = 0.0) -> None:
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise ConfigError(f"perfedavg: rank must be an integer ≥ 1, got {rank!r}")
        for opt_name, val in (("lr", lr), ("inner_lr", inner_lr), ("delta", delta)):
            if not isinstance(val, (int, float)) or not (val > 0 and math.isfinite(val)):
                raise ConfigError(f"perfedavg: {opt_name} must be a finite number > 0, got {val!r}")
        if variant not in VARIANTS:
            raise ConfigError(f"perfedavg: variant must be one of {VARIANTS}, got {variant!r}")
        if optimizer not in ("adamw", "sgd"):
            raise ConfigError(f"perfedavg: optimizer must be 'adamw' or 'sgd', got {optimizer!r}")
        if not isinstance(weight_decay, (int, float)) or not (weight_decay >= 0 and math.isfinite(weight_decay)):
            raise ConfigError(f"perfedavg: weight_decay must be ≥ 0, got {weight_decay!r}")
        self.rank, self.lr, self.inner_lr = rank, float(lr), float(inner_lr)
        self.variant, self.delta = variant, float(delta)
        self.sample_dp_releases = type(self).sample_dp_releases_for({"variant": variant})
        self.optimizer, self.weight_decay = optimizer, float(weight_decay)

    @classmethod
    def sample_dp_releases_for(cls, options: Mapping[str, Any]) -> int:
        """2 DP-SGD releases per local step (inner and meta gradients), 3 for the hessian-free variant (module doc)."""
        return 3 if options.get("variant", "first-order") == "hessian-free" else 2

    def step_sizes(self) -> dict:
        """β of the meta step (the optimizer's) and α of the one-step personalisation (plain SGD)."""
        return {**super().step_sizes(), "inner_lr": {"optimizer": "sgd", "lr": float(self.inner_lr)}}

    def bind(self, model, replica_clients, n_clients=None) -> None:
        super().bind(model, replica_clients, n_clients)
        lora = self._names("lora_A", "lora_B")
        if not lora:  # checked before the head joins: a head alone is no adapter
            raise ConfigError("perfedavg: the model has no lora_A/lora_B parameters")
        self.x_names = lora + self.head_names()
        G = len(self.replica_clients)
        for n in lora:
            if self.params[n].dim() != 3 or self.params[n].shape[0] != G:
                raise ConfigError(f"perfedavg: {n} must be stacked with G={G} replicas first, "
                                  f"got shape {tuple(self.params[n].shape)}")
            got = self.params[n].shape[-2 if n.endswith("lora_A") else -1]
            if got != self.rank:
                raise ConfigError(f"perfedavg: {n} has rank {got} but the method was built for rank={self.rank}")
        xs = [self.params[n] for n in self.x_names]
        self.opt = make_optimizer(self.optimizer, xs, self.lr, self.weight_decay)

    # f(x; batch) summed over replicas: replicas are independent, so gradients stay per replica
    def _loss_grad(self, objective: Objective, x: Sequence[torch.Tensor], batch: Any) -> list[torch.Tensor]:
        with torch.enable_grad():  # evaluators may call personalised_params under no_grad
            xs = [t.detach().requires_grad_(True) for t in x]
            return _grad(objective(dict(zip(self.x_names, xs)), batch).sum(), xs)

    def meta_direction(self, objective: Objective, sample: Sampler) -> list[torch.Tensor]:
        """h for every replica (list aligned with ``x_names``); the parameters are not modified."""
        x = [self.params[n].detach() for n in self.x_names]
        a = self.inner_lr * self.lr_factor
        g_in = self._loss_grad(objective, x, sample())                       # ∇f(x; D)
        x_tilde = [xi - a * gi for xi, gi in zip(x, g_in)]                   # one SGD step
        g = self._loss_grad(objective, x_tilde, sample())                    # ∇f(x̃; D′)
        if self.variant == "first-order":
            return g
        batch = sample()                                                     # D″, one batch for both sides
        d = self.delta
        plus = self._loss_grad(objective, [xi + d * gi for xi, gi in zip(x, g)], batch)
        minus = self._loss_grad(objective, [xi - d * gi for xi, gi in zip(x, g)], batch)
        return [gi - a * (p - m) / (2 * d) for gi, p, m in zip(g, plus, minus)]

    def _private_grad(self, objective: Objective, x: Sequence[torch.Tensor], batch: Any) -> list[torch.Tensor]:
        """DP-SGD's gradient at ``x`` on ``batch`` (``fedlora.privacy.dpsgd.private_gradients``: per-example
        gradients clipped jointly to C, summed, noised from each client's stream, / q·n_k), aligned with
        ``x_names``."""
        with torch.enable_grad():
            xs = dict(zip(self.x_names, (t.detach().requires_grad_(True) for t in x)))
            got = self.private_grads(lambda: objective(xs, batch), self.x_names)
        return [got[n] for n in self.x_names]

    def _private_hvp(self, objective: Objective, x: Sequence[torch.Tensor], g: Sequence[torch.Tensor],
                     batch: Any) -> list[torch.Tensor]:
        """The hessian-free variant's private Hessian-vector term d̃ (module doc): each example's finite difference
        [∇ℓᵢ(x + δg) − ∇ℓᵢ(x − δg)]/(2δ) on ``batch`` as one release (``Method.private_difference``); aligned with
        ``x_names``."""
        d = self.delta

        def losses(sign: float):
            xs = dict(zip(self.x_names, ((xi + sign * d * gi).detach().requires_grad_(True) for xi, gi in zip(x, g))))
            return lambda: objective(xs, batch)

        with torch.enable_grad():
            got = self.private_difference(losses(1.0), losses(-1.0), self.x_names, 1 / (2 * d))
        return [got[n] for n in self.x_names]

    def private_meta_direction(self, objective: Objective, sample: Sampler) -> list[torch.Tensor]:
        """h under sample-level DP (module doc): release 0 the inner gradient on D, release 1 the gradient at x̃ on
        an independent D′, and for the hessian-free variant release 2 the Hessian-vector term on D″ along the
        released h (``SampleDP.release`` keys each one's batch and noise apart)."""
        sdp = self.sample_dp
        x = [self.params[n].detach() for n in self.x_names]
        a = self.inner_lr * self.lr_factor
        sdp.release(0)
        try:
            g_in = self._private_grad(objective, x, sample())                # g̃_in on D
            x_tilde = [xi - a * gi for xi, gi in zip(x, g_in)]
            sdp.release(1)
            h = self._private_grad(objective, x_tilde, sample())             # h on D′ at x̃
            if self.variant == "first-order":
                return h
            sdp.release(2)
            dv = self._private_hvp(objective, x, h, sample())                # d̃ on D″, along the released h
            return [hi - a * di for hi, di in zip(h, dv)]
        finally:
            sdp.release(0)

    def local_step(self, objective: Objective, sample: Sampler) -> None:
        private = self.sample_dp is not None
        h = self.private_meta_direction(objective, sample) if private else self.meta_direction(objective, sample)
        for n, hi in zip(self.x_names, h):
            self.params[n].grad = hi.detach()
        self.opt.step()

    def personalised_params(self, objective: Objective, sample: Sampler) -> Mapping[str, torch.Tensor]:
        """All parameters, with (A, B) after one SGD step x − α∇f_k(x; batch) on a fresh batch of
        each client's data (Per-FedAvg's evaluation); the model is not modified."""
        x = [self.params[n].detach() for n in self.x_names]
        g = self._loss_grad(objective, x, sample())
        out = {n: p.detach() for n, p in self.params.items()}
        out.update({n: (xi - self.inner_lr * gi).detach() for n, xi, gi in zip(self.x_names, x, g)})
        return out

    def upload(self, replica: int) -> Payload:
        return self.upload_params(replica, self.x_names)

