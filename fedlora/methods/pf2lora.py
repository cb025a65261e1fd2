"""PF2LoRA — two-level LoRA, bilevel with hypergradients ([PF2LoRA], Algorithm 1).

W_k = W0 + s(BA + D_k C_k): common adapter x = (A, B) of rank r, averaged every I steps with uniform
weights 1/M over the participating clients (line 8), whatever client weights the runtime passes;
client adapter y_k = (C_k, D_k) of rank r̃ < r, never communicated. Each local step:
y ← y − α∇_y F (SGD, line 5), then x is updated along the hypergradient of eq. (4) by AdamW (the
paper's choice for language models, §4) or SGD (line 6 as written).

Not in the paper: ``upper_schedule="cosine"`` decays the upper-level step to 0 over
``total_steps`` (App. C uses constant steps; the synthetic tuned preset uses the decay, docs/tutorials/rank-recovery.md).
Optimizer moments and AdamW step counts are per client (``fedlora.optim.StackedAdamW``).

Sample-level DP (our variant; the paper has no private runs): with ``hypergradient="none"`` (first-order: the upper
direction is ∇_x F(x, y; ξ), no mixed term) a local step takes two gradients at (x, y), each a DP-SGD release (Abadi
et al., CCS 2016, Alg. 1) on its own Poisson batch and noise — the lower g̃_y on the step's "batch"/"noise" streams,
the upper g̃_x on "batch.1"/"noise.1" (``SampleDP.release``) — 2 releases per local step, both counted. With
``hypergradient="exact"`` or ``"finite-difference"`` eq. (4) becomes three releases, each on its own Poisson batch:

    g̃_y      = DP-SGD ∇_y F(x, y; π)                       release 0;  y⁺ = y − α g̃_y
    (g̃_x, ṽ) = DP-SGD ∇_{(x,y)} F(x, y⁺; ξ), clipped jointly  release 1 (ξ̃ = ξ)
    d̃        = DP-SGD of each example's mixed term, clipped as one vector   release 2 (ζ: its own batch, not π's)
               exact:              ∇²_{xy} ℓᵢ(x, y)·ṽ = d/dε ∇_x ℓᵢ(x, y + εṽ) at ε = 0 (forward mode over the
                                   per-example gradient: ``Method.private_directional``)
               finite-difference:  [∇_x ℓᵢ(x, y + δṽ) − ∇_x ℓᵢ(x, y − δṽ)]/(2δ),  δ = fd_eps/‖ṽ‖ per client
    h        = g̃_x − α d̃

ṽ (and δ) are post-processing of release 1, so release 2 is one per-example function with sensitivity C. Without DP
the exact mode differentiates through the unrolled step y⁺(x) (one double backward); the private exact mode cannot,
since y⁺ holds the released g̃_y, which x does not move — its mixed term is eq. (4)'s at (x, y), as the
finite-difference mode's.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.autograd.forward_ad as fwAD

from ..aggregation import fedavg_factors
from ..errors import ConfigError
from ..optim import make_optimizer
from ..payload import Payload
from .base import AveragedFactors, Objective, Sampler, register
from .hypergradient import HYPERGRADIENT_MODES, bilevel_direction

__all__ = ["PF2LoRA"]


@register
class PF2LoRA(AveragedFactors):
    name = "pf2lora"
    sample_dp_refusal = None  # every hypergradient mode has a private path (module doc)
    sample_dp_note = ("hypergradient: none — its lower and upper gradients are each a DP-SGD release, 2 per local "
                      "step; exact (forward mode over each example's gradient) and finite-difference — 3, the "
                      "mixed term a release of its own, each example's clipped as one vector; all counted")
    sample_dp_releases = 3
    personalised = True  # the client adapter C_k, D_k
    needs_client_adapter = True
    lr_option, optimizer_option = "upper_lr", "upper_optimizer"
    #: §6.1.1 / Table 5: SGD on the client adapter at the common adapter's step (1e-3 on GLUE)
    llm_options = {"lower_lr": 1e-3}

    def __init__(self, upper_lr: float = 5e-3, lower_lr: float = 2e-3, upper_optimizer: str = "adamw",
                 rank: int = 8, client_rank: int = 2,
                 weight_decay: float = 0.0, hypergradient: str = "exact", batches: int = 2,
                 fd_eps: float = 1e-3, upper_schedule: str = "constant", total_steps: int | None = None) -> None:
        for opt_name, v in (("upper_lr", upper_lr), ("lower_lr", lower_lr), ("fd_eps", fd_eps)):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ConfigError(f"pf2lora: {opt_name} must be a finite number > 0, got {v!r}")
        if not (isinstance(weight_decay, (int, float)) and math.isfinite(weight_decay) and weight_decay >= 0):
            raise ConfigError(f"pf2lora: weight_decay must be a finite number ≥ 0, got {weight_decay!r}")
        if not (isinstance(rank, int) and isinstance(client_rank, int) and 1 <= client_rank < rank):
            raise ConfigError(f"pf2lora: need integers 1 ≤ client_rank < rank (r̃ < r), got rank={rank!r}, "
                              f"client_rank={client_rank!r}")
        if upper_optimizer not in ("adamw", "sgd"):
            raise ConfigError(f"pf2lora: upper_optimizer must be 'adamw' or 'sgd', got {upper_optimizer!r}")
        if hypergradient not in HYPERGRADIENT_MODES:
            raise ConfigError(f"pf2lora: hypergradient must be one of {HYPERGRADIENT_MODES}, got {hypergradient!r}")
        if batches not in (2, 4):
            raise ConfigError(f"pf2lora: batches must be 2 (inner, outer) or 4 (Alg. 1 line 4), got {batches}")
        if upper_schedule not in ("constant", "cosine"):
            raise ConfigError(f"pf2lora: upper_schedule must be 'constant' or 'cosine', got {upper_schedule!r}")
        if upper_schedule == "cosine" and (not isinstance(total_steps, int) or total_steps < 1):
            raise ConfigError(f"pf2lora: upper_schedule 'cosine' needs total_steps ≥ 1 (local steps of the "
                              f"whole run), got {total_steps!r}")
        self.upper_schedule, self.total_steps = upper_schedule, total_steps
        self.rank, self.client_rank = rank, client_rank
        self.upper_lr, self.lower_lr = upper_lr, lower_lr
        self.upper_optimizer, self.weight_decay = upper_optimizer, weight_decay
        self.hypergradient, self.batches, self.fd_eps = hypergradient, batches, fd_eps
        self.sample_dp_releases = type(self).sample_dp_releases_for({"hypergradient": hypergradient})

    @classmethod
    def sample_dp_releases_for(cls, options) -> int:
        """2 DP-SGD releases per local step (``none``), 3 with a mixed term (``exact``, ``finite-difference``)."""
        return 2 if options.get("hypergradient", "exact") == "none" else 3

    def step_sizes(self) -> dict:
        """The upper level's (common adapter, AdamW/SGD) and the lower level's α (client adapter, SGD)."""
        return {**super().step_sizes(), "lower_lr": {"optimizer": "sgd", "lr": float(self.lower_lr)}}

    @property
    def needs_second_order(self) -> bool:
        return self.hypergradient == "exact"  # eq. (4)'s mixed term: double backward (forward mode under DP)

    def adapter_kwargs(self) -> dict:
        """Common adapter of rank r, client adapter of rank r̃ (defaults r = 8, r̃ = 2: docs/design.md §4.9)."""
        return {"rank": self.rank, "client_rank": self.client_rank}

    def bind(self, model, replica_clients, n_clients=None) -> None:
        super().bind(model, replica_clients, n_clients)
        # a trained head (LLM runtime) belongs to the common adapter x when shared (averaged), to
        # the client adapter y when personal (updated by the lower level's SGD, never sent)
        common, client = self._names("lora_A", "lora_B"), self._names("lora_C", "lora_D")
        if not client:  # checked before the head joins: a personal head alone is no client adapter
            raise ConfigError("pf2lora needs a client adapter: build the model with client_rank ≥ 1")
        self.x_names = common + self.shared_head_names()
        self.y_names = client + (self.head_names() if self.head_mode == "personal" else [])
        for n in common + client:
            want = self.rank if n.endswith(("lora_A", "lora_B")) else self.client_rank
            got = self.params[n].shape[-2 if n.endswith(("lora_A", "lora_C")) else -1]
            if got != want:
                raise ConfigError(f"pf2lora: {n} has rank {got} but the method was built for "
                                  f"rank={self.rank}, client_rank={self.client_rank}")
        xs = [self.params[n] for n in self.x_names]
        self.opt = make_optimizer(self.upper_optimizer, xs, self.upper_lr, self.weight_decay)
        # Optional cosine decay of the upper-level step to 0 over the run (not in the paper, whose
        # App. C steps are constant): AdamW at a constant step hovers at a floor set by that step,
        # and a decay lets the tuned preset use a larger step early without paying for it at the end.
        self.sched = (torch.optim.lr_scheduler.CosineAnnealingLR(self.opt, T_max=self.total_steps)
                      if self.upper_schedule == "cosine" else None)

    def local_step(self, objective: Objective, sample: Sampler) -> None:
        if self.sample_dp is not None:
            self._private_local_step(objective, sample)
            return

        def F(x, y, batch):
            params = dict(zip(self.x_names, x)) | dict(zip(self.y_names, y))
            return objective(params, batch).sum()  # replicas are independent: Σ keeps gradients apart

        h, y_plus = bilevel_direction(
            F, [self.params[n] for n in self.x_names], [self.params[n] for n in self.y_names],
            self.lower_lr * self.lr_factor, [sample() for _ in range(self.batches)], self.hypergradient, self.fd_eps,
            per_replica=self.params[self.x_names[0]].dim() == 3)
        with torch.no_grad():
            for n, v in zip(self.y_names, y_plus):
                self.params[n].copy_(v)
        for n, g in zip(self.x_names, h):
            self.params[n].grad = g
        self.opt.step()
        if self.sched is not None:
            self.sched.step()

    def _private_local_step(self, objective: Objective, sample: Sampler) -> None:
        """A local step under sample-level DP (module doc). ``none``: y ← y − α·g̃_y on release 0's batch, x along
        g̃_x on release 1's, both taken at the step's (x, y) as ``bilevel_direction``'s "none" mode takes them.
        ``exact``/``finite-difference``: g̃_x and ṽ at (x, y⁺) on release 1's batch, the mixed term on release 2's."""
        alpha = self.lower_lr * self.lr_factor
        inner = sample()  # the runtime positioned this step's draws: release 0
        g_y = self.private_grads(lambda: objective(self.params, inner), self.y_names)
        y = {n: self.params[n].detach().clone() for n in self.y_names}
        try:
            self.sample_dp.release(1)
            outer = sample()
            if self.hypergradient == "none":
                g_x = self.private_grads(lambda: objective(self.params, outer), self.x_names)
                h = [g_x[n] for n in self.x_names]
            else:
                y_plus = {n: y[n] - alpha * g_y[n] for n in self.y_names}
                with torch.enable_grad():
                    at = {n: self.params[n] for n in self.x_names} | {
                        n: t.requires_grad_(True) for n, t in y_plus.items()}
                    got = self.private_grads(lambda: objective(at, outer), [*self.x_names, *self.y_names])
                self.sample_dp.release(2)
                mixed = self._private_mixed_term(objective, y, {n: got[n] for n in self.y_names}, sample())
                h = [got[n] - alpha * m for n, m in zip(self.x_names, mixed)]
        finally:
            self.sample_dp.release(0)
        with torch.no_grad():
            for n in self.y_names:
                self.params[n].copy_(y[n] - alpha * g_y[n])
        for n, g in zip(self.x_names, h):
            self.params[n].grad = g
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.sched is not None:
            self.sched.step()

    def _private_mixed_term(self, objective: Objective, y: dict, v: dict, batch) -> list[torch.Tensor]:
        """Release 2 of a private step with a mixed term, aligned with ``x_names``. ``exact``: each example's
        ∇²_{xy}ℓᵢ(x, y)·ṽ, the tangent of its ∇_x ℓᵢ at y made dual along ṽ (``Method.private_directional``).
        ``finite-difference``: per slot δ = fd_eps/‖ṽ‖ (0 where ṽ = 0, as ``bilevel_direction``), each example's
        [∇_x ℓᵢ(x, y + δṽ) − ∇_x ℓᵢ(x, y − δṽ)]/(2δ) (``Method.private_difference``). Either as one release."""
        if self.hypergradient == "exact":
            with fwAD.dual_level(), torch.enable_grad():
                at = {n: self.params[n] for n in self.x_names} | {
                    n: fwAD.make_dual(y[n], v[n].detach().to(y[n].dtype)) for n in self.y_names}
                got = self.private_directional(lambda: objective(at, batch), self.x_names)
            return [got[n] for n in self.x_names]
        S = len(self.replica_clients)
        sq = sum((t.double() ** 2).reshape(S, -1).sum(1) for t in v.values())
        delta = torch.where(sq > 0, self.fd_eps / sq.sqrt().clamp_min(1e-300), torch.zeros_like(sq))
        inv = torch.where(delta > 0, 1 / (2 * delta).clamp_min(1e-300), torch.zeros_like(delta))  # ṽ = 0 ⇒ term 0

        def losses(sign: float):
            at = {n: self.params[n] for n in self.x_names} | {
                n: (y[n] + sign * delta.to(v[n].dtype).reshape(-1, *([1] * (v[n].dim() - 1))) * v[n]).detach()
                for n in self.y_names}
            return lambda: objective(at, batch)

        with torch.enable_grad():
            got = self.private_difference(losses(1.0), losses(-1.0), self.x_names, inv)
        return [got[n] for n in self.x_names]

    def upload(self, replica: int) -> Payload:
        # Only the common adapter leaves the client (Alg. 1 line 8); y_k stays local.
        return self.upload_params(replica, self.x_names)

    @staticmethod
    def aggregate(payloads: Sequence[Payload], weights: torch.Tensor) -> dict[str, torch.Tensor]:
        """x = (1/M) Σ_k x_k over the M clients whose uploads arrive (Alg. 1 line 8; eq. 3's
        upper level is the unweighted mean of the clients' losses). ``weights`` (the runtime's data
        sizes) are ignored: with client sampling the mean is uniform over the round's participants."""
        return fedavg_factors([p.tensors for p in payloads], torch.ones(len(payloads), dtype=torch.float64))

