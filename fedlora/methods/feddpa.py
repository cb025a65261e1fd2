"""FedDPA-T and FedDPA-F — a global and a local adapter per client (Yang, Long, Shen, Jiang, Blumenstein,
"Dual-Personalizing Adapter for Federated Foundation Models", NeurIPS 2024, arXiv 2403.19211; code
github.com/Lydia-yang/FedDPA).

Every adapted module carries two LoRA adapters of the same rank r: the GLOBAL adapter (A, B), uploaded and
averaged by the server, and the LOCAL adapter (C, D), which never leaves the client (``LoRALinear``'s client
adapter, scale s₂ = s₁: the authors build both from one LoRA config). A round of FedDPA-T (the iterative
variant, ``variant="T"``, the default):

1. the local adapter is trained with the global one mixed in, detached (no gradient reaches it):
   y = W0x + (1 − a)·s·B A x (detached) + a·s·D C x, with a = ``local_weight`` (the authors' ``local_weight``,
   default 0.5; their PEFT fork's ``set_local(['default'], [a, 1 − a])``);
2. then the global adapter is trained on its own: y = W0x + s·B A x (the local adapter is out of the model
   in this phase, as in the authors' code, which deletes it before the global phase);
3. the client uploads the global adapter (A, B) (+ a shared head); the server sets
   (A, B) ← Σ_k p_k (A_k, B_k) with the data weights p_k = n_k/Σn (the paper's FedAvg server; the authors'
   code averages uniformly — ``fedlora.aggmath.feddpa.feddpa_average(uniform=True)`` is that mean).

Phase 1 runs in ``local_step`` (one optimizer step on C, D per call), phase 2 in ``end_round``: as many
steps on A, B as the round had local steps, on fresh batches of the same sampler (so a round costs twice
its local steps, as the authors' two training passes do). Both phases draw their own batches.

FedDPA-F (the sequential variant, ``variant="F"``): the rounds train the global adapter alone (phase 2's
rule, one step per ``local_step``; the local adapter is out of the model and never changes); the local
adapter is learnt after federated training — initialised from the global adapter (C, D ← A, B, as a summary
of the paper's FedDPA-F figure describes it; docs/methods/feddpa.md) and trained ``finetune_steps`` steps by phase 1's rule (the global
adapter mixed in with weight 1 − a, detached) with a fresh optimizer, on the client's own batches. That
fine-tuning runs where the client's model is evaluated or saved (``personalised_params``, from the
client's record, which it does not change): at the end of the run it is FedDPA-F's model after the last
round for every client, sampled in that round or not; at an evaluation before, the model FedDPA-F would
have had if training had stopped there.

Evaluation, ``eval_weighting="fixed"`` (the default; ``personalised_params``): every client is scored on
y = W0x + (1 − m)·s·B A x + m·s·D C x with m = ``eval_mix`` (default 0.5: the authors' inference
without the dynamic weighting, ``set_local(['local'], [0.5, 0.5])``).

``eval_weighting="instance"``: the paper's instance-wise dynamic weighting (§"instance-wise dynamic
weighting mechanism"; the authors' ``get_weight``), through ``instance_gating`` (an ``InstanceWeighting``)
in the LLM runtime's evaluation: each test input x is scored on
y = W0x + (1 − w(x))·s·B A x + w(x)·s·D C x (``instance_weight_on="local"``, the default) or with w(x) and
1 − w(x) swapped (``"global"``: the authors' code), w(x) = scale · (1/N) Σ_j cos(e(x), e(x_j)) over N =
``instance_refs`` of the client's training inputs x_j, e(·) the model's last hidden state (last real input
token, or the mean over them: ``instance_repr``) with the local adapter alone (``fedlora.aggmath.feddpa``:
``instance_weight``, ``pool_representation``, and ``instance_mixed_output``, the one-layer reference). The
paper's equation could not be read here: docs/methods/feddpa.md says why "local" is the default. The saved
client adapters and exports stay the fixed mix at ``eval_mix`` (a PEFT adapter has no per-input weight).
The global model (``has_global_model``) is the global adapter alone.

Optimizer: one optimizer over both adapters (and a head), each client's moments kept across rounds
(the house's convention, ``fedavg``); the authors' code builds a fresh AdamW for each phase of each round.

Sample-level DP (our variant; the paper has no private runs): every optimizer step is a DP-SGD release (Abadi et
al., CCS 2016, Alg. 1) on its own Poisson batch and noise — FedDPA-T's phase 1 at local step j on the step's
"batch"/"noise" streams, its phase 2 step j on "batch.1"/"noise.1" of the same (round, j) (``SampleDP.release``),
so a local step composes two releases (``sample_dp_releases`` = 2; FedDPA-F's rounds train the global adapter
alone: 1). Phase 1's per-example gradients are those of the client adapter (C, D) the layers used, D entering as
a·D, so dDᵢ = a·d(aD)ᵢ by the chain rule (``_step``'s ``d_weight``); the detached global adapter is a released
value. Both phases private keeps the upload private even with a personal head, which phase 1 trains and phase 2's
forward uses. FedDPA-F's local fine-tuning at evaluation (``_finetune_local``) trains on the client's data for its
own model and releases nothing; it is not counted.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from ..adapter import LoRALinear
from ..aggmath.feddpa import feddpa_average, instance_weight, pool_representation
from ..errors import ConfigError
from ..optim import make_optimizer
from ..payload import Payload
from ..seeds import SAMPLER, seed_of
from .base import Objective, Sampler, register
from .fedavg import FactorLoRA

__all__ = ["FedDPA", "InstanceWeighting"]

_CHOICES = {"eval_weighting": ("fixed", "instance"), "instance_weight_on": ("local", "global"),
            "instance_repr": ("last", "mean"), "variant": ("T", "F")}


def _check_choice(name: str, v: Any) -> str:
    if v not in _CHOICES[name]:
        raise ConfigError(f"feddpa: {name} must be one of {', '.join(map(repr, _CHOICES[name]))}, got {v!r}")
    return v


class InstanceWeighting:
    """FedDPA's instance-wise dynamic weighting as an evaluator applies it (``FedDPA.instance_gating``), for
    the S clients bound to the method's replicas:

    * ``reference_rows``: the N training rows of a client whose representations are its references x_j;
    * ``represent_params``: the parameters e(·) is computed with — the local adapter alone (B = 0), as the
      authors' ``get_weight`` (``set_adapter('local')``);
    * ``represent(hidden (n, T, H), mask (n, T))``: e(x) (``pool_representation``);
    * ``gates(query (S, b, H), refs [S × (N_p, H)])``: the per-input weights (g_global, g_local), (S·b,)
      each, that the layers apply (``fedlora.adapter.set_row_gates``) on ``params`` — the raw adapters."""

    def __init__(self, params: Mapping[str, torch.Tensor], represent_params: Mapping[str, torch.Tensor],
                 n_refs: int, scale: float, weight_on: str, how: str) -> None:
        self.params, self.represent_params = params, represent_params
        self.n_refs, self.scale, self.weight_on, self.how = n_refs, scale, weight_on, how

    def reference_rows(self, rows: Sequence[int], client: int, seed: int) -> np.ndarray:
        """min(N, n) of the client's training ``rows``, drawn without replacement by a generator seeded
        from the run's seed and the client (``seed_of(seed, SAMPLER, "feddpa-refs", client)``): the same
        rows at every evaluation, in every process — nothing to keep in a checkpoint."""
        rows = np.asarray(rows, dtype=np.int64)
        g = torch.Generator().manual_seed(seed_of(seed, SAMPLER, "feddpa-refs", client))
        return rows[torch.randperm(len(rows), generator=g)[:self.n_refs].numpy()]

    def represent(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return pool_representation(hidden.float(), mask, self.how)

    def gates(self, query: torch.Tensor, refs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if query.dim() != 3 or len(refs) != query.shape[0]:
            raise ConfigError(f"feddpa: one reference set per slot needed: query {tuple(query.shape)}, "
                              f"{len(refs)} reference sets")
        w = torch.cat([instance_weight(query[p], refs[p], self.scale) for p in range(query.shape[0])])
        return (1.0 - w, w) if self.weight_on == "local" else (w, 1.0 - w)


def _check_fraction(name: str, v: Any) -> float:
    if not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(v) or not 0 < v < 1:
        raise ConfigError(f"feddpa: {name} must be a number strictly between 0 and 1, got {v!r}")
    return float(v)


@register
class FedDPA(FactorLoRA):
    """FedDPA-T (``variant="T"``) or FedDPA-F (``"F"``). Args: rank r (both adapters), lr, optimizer
    ("adamw" | "sgd"), weight_decay,
    local_weight a (the local adapter's weight while it trains; the detached global one gets 1 − a),
    eval_mix m (the local adapter's weight in the evaluated model; the global one gets 1 − m),
    eval_weighting ("fixed": m for every input | "instance": the instance-wise dynamic weighting),
    instance_refs N (the client's training inputs w(x) compares with), instance_scale (w's scale, in (0, 1]),
    instance_weight_on ("local" | "global": the adapter w(x) weighs, the other gets 1 − w(x)),
    instance_repr ("last" | "mean": e(x) from the last real input token's last hidden state or their mean),
    variant ("T": both adapters every round | "F": the global adapter in the rounds, the local one after),
    finetune_steps (FedDPA-F: the local adapter's steps after federated training)."""

    name = "feddpa"
    sample_dp_refusal = None  # both phases take DP-SGD releases (``_step``; module doc, "Sample-level DP")
    sample_dp_note = ("FedDPA-T: its local and its global phase are each a DP-SGD release, 2 per local step, both "
                      "counted; FedDPA-F: 1")
    sample_dp_releases = 2  # FedDPA-T (the default); FedDPA-F's rounds train the global adapter alone: 1
    personalised = True  # the local adapter (C, D) stays on the client
    #: the server is the weighted mean of the uploaded global adapters: PEFT adapters aggregate with it
    lora_upload = ("lora_A", "lora_B")
    needs_client_adapter = True
    #: phase 2 (the global adapter) runs in ``end_round`` for every replica of a pass alike
    equal_steps_per_pass = True

    def __init__(self, rank: int = 8, lr: float = 5e-4, optimizer: str = "adamw", weight_decay: float = 0.0,
                 local_weight: float = 0.5, eval_mix: float = 0.5, eval_weighting: str = "fixed",
                 instance_refs: int = 5, instance_scale: float = 0.5, instance_weight_on: str = "local",
                 instance_repr: str = "last", variant: str = "T", finetune_steps: int = 10) -> None:
        super().__init__(rank, lr, optimizer, weight_decay)
        self.local_weight = _check_fraction("local_weight", local_weight)
        self.eval_mix = _check_fraction("eval_mix", eval_mix)
        self.eval_weighting = _check_choice("eval_weighting", eval_weighting)
        self.instance_weight_on = _check_choice("instance_weight_on", instance_weight_on)
        self.instance_repr = _check_choice("instance_repr", instance_repr)
        if not isinstance(instance_refs, int) or isinstance(instance_refs, bool) or instance_refs < 1:
            raise ConfigError(f"feddpa: instance_refs must be an integer ≥ 1, got {instance_refs!r}")
        if not (isinstance(instance_scale, numbers.Real) and not isinstance(instance_scale, bool)
                and math.isfinite(instance_scale) and 0 < instance_scale <= 1):
            raise ConfigError(f"feddpa: instance_scale must be a number in (0, 1], got {instance_scale!r}")
        self.instance_refs, self.instance_scale = instance_refs, float(instance_scale)
        self.variant = _check_choice("variant", variant)
        if not isinstance(finetune_steps, int) or isinstance(finetune_steps, bool) or finetune_steps < 1:
            raise ConfigError(f"feddpa: finetune_steps must be an integer ≥ 1, got {finetune_steps!r}")
        self.finetune_steps = finetune_steps
        self.sample_dp_releases = type(self).sample_dp_releases_for({"variant": variant})
        self._finetuned: dict[str, torch.Tensor] | None = None  # FedDPA-F: the evaluated local adapter
        self._n_local, self._objective, self._sample = 0, None, None

    @classmethod
    def sample_dp_releases_for(cls, options: Mapping[str, Any]) -> int:
        return 2 if options.get("variant", "T") == "T" else 1

    def adapter_kwargs(self) -> dict:
        """Both adapters of rank r (the authors' one LoRA config for both)."""
        return {"rank": self.rank, "client_rank": self.rank}

    def bind(self, model, replica_clients, n_clients=None) -> None:
        if self.eval_weighting == "instance" and isinstance(model, LoRALinear):
            raise ConfigError("feddpa: eval_weighting='instance' needs a model with hidden states (fedlora run); "
                              "the synthetic testbed's one layer has none: use eval_weighting='fixed'")
        super().bind(model, replica_clients, n_clients)
        self.c_names, self.d_names = [], []
        for a, _ in self.pairs:
            c, d = a[: -len("lora_A")] + "lora_C", a[: -len("lora_A")] + "lora_D"
            if c not in self.params or d not in self.params:
                raise ConfigError(f"feddpa needs a local adapter beside {a}: build the model with "
                                  f"client_rank = rank ({self.rank}), the method's adapter_kwargs()")
            if self.params[c].shape[-2] != self.rank:
                raise ConfigError(f"feddpa: {c} has rank {self.params[c].shape[-2]}, the local adapter needs "
                                  f"rank {self.rank} (the global adapter's)")
            self.c_names.append(c)
            self.d_names.append(d)
        self.global_names = self.a_names + self.b_names + self.shared_head_names()
        self.local_names = self.c_names + self.d_names + (self.heads if self.head_mode == "personal" else [])
        self.opt = self._make_optimizer([self.params[n] for n in self.a_names + self.b_names + self.c_names
                                         + self.d_names + self.heads])

    # the round -----------------------------------------------------------------------------------
    def begin_round(self, round_idx: int) -> None:
        self._n_local, self._objective, self._sample = 0, None, None

    def _step(self, objective: Objective, sample: Sampler, trained: Sequence[str],
              fixed: Mapping[str, torch.Tensor], d_weight: float = 1.0) -> None:
        """One optimizer step on ``trained``; ``fixed`` replaces other parameters in the forward. ``d_weight``: the
        weight a with which ``fixed`` puts the local up factor D into the forward (phase 1's a·D), which the
        chain rule takes back to D under sample-level DP (the layers record the a·D they used)."""
        params = {**self.params, **fixed}
        self.opt.zero_grad(set_to_none=True)
        if self.sample_dp is not None:  # DP-SGD: per-example gradients clipped jointly, noised, / q·n_k
            batch, d_names = sample(), set(self.d_names)
            private = self.private_grads(lambda: objective(params, batch), trained,
                                         lambda per: {n: t * d_weight if n in d_names else t for n, t in per.items()})
            grads = [private[n] for n in trained]
        else:
            loss = objective(params, sample()).sum()  # replicas are independent: Σ keeps gradients apart
            grads = torch.autograd.grad(loss, [self.params[n] for n in trained])
        for n, g in zip(trained, grads):
            self.params[n].grad = g
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def _phase1_fixed(self, local: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Phase 1's forward: the global adapter detached with B weighted 1 − a, D of ``local`` weighted a
        (the gradient reaches D through a·D), the rest of ``local`` as it is, a shared head detached."""
        a = self.local_weight
        fixed = {n: self.params[n].detach() for n in self.a_names}
        fixed.update({n: (1.0 - a) * self.params[n].detach() for n in self.b_names})
        fixed.update({n: local[n] for n in local if n not in self.d_names})
        fixed.update({n: a * local[n] for n in self.d_names})
        if self.head_mode == "shared":
            fixed.update({n: self.params[n].detach() for n in self.shared_head_names()})
        return fixed

    def _phase2_fixed(self) -> dict[str, torch.Tensor]:
        """Phase 2's forward: the local adapter out of the model (D = 0), a personal head detached."""
        fixed = {n: torch.zeros_like(self.params[n]) for n in self.d_names}  # D = 0: no local path
        fixed.update({n: self.params[n].detach() for n in self.c_names})
        if self.head_mode == "personal":
            fixed.update({n: self.params[n].detach() for n in self.heads})
        return fixed

    def local_step(self, objective: Objective, sample: Sampler) -> None:
        """FedDPA-T, phase 1: one step on the local adapter, the global one mixed in with weight 1 − a,
        detached. FedDPA-F: one step on the global adapter alone (phase 2's rule)."""
        if self.variant == "F":
            self._step(objective, sample, self.global_names, self._phase2_fixed())
        else:
            self._step(objective, sample, self.local_names,
                       self._phase1_fixed({n: self.params[n] for n in self.local_names}), d_weight=self.local_weight)
        self._n_local += 1
        self._objective, self._sample = objective, sample

    def end_round(self, round_idx: int) -> None:
        """FedDPA-T, phase 2: as many steps on the global adapter alone (the local adapter out of the model).
        FedDPA-F: nothing more (its round is the local steps)."""
        if self._n_local == 0:
            raise ConfigError("feddpa: a round needs at least one local_step")
        if self.variant == "T":
            fixed = self._phase2_fixed()
            for j in range(self._n_local):
                if self.sample_dp is not None:  # its own Poisson batch and noise: release 1 of local step j
                    self.sample_dp.at(round_idx, j, release=1)
                self._step(self._objective, self._sample, self.global_names, fixed)
        self._objective = self._sample = None  # do not keep the caller's data alive

    def _finetune_local(self, objective: Objective, sample: Sampler) -> dict[str, torch.Tensor]:
        """FedDPA-F's local adapter of every replica, the method's parameters unchanged: C, D ← A, B (a
        personal head as it is), then ``finetune_steps`` steps of phase 1's rule with a fresh optimizer
        (the configured step size) on the replicas' own batches ``sample()``."""
        init = dict(zip(self.c_names, self.a_names)) | dict(zip(self.d_names, self.b_names))
        names = self.c_names + self.d_names + (self.heads if self.head_mode == "personal" else [])
        with torch.enable_grad():  # evaluators call this under no_grad
            leaves = {n: self.params[init.get(n, n)].detach().clone().requires_grad_(True) for n in names}
            opt = make_optimizer(self.optimizer, list(leaves.values()), self.lr, self.weight_decay)
            for _ in range(self.finetune_steps):
                params = {**{n: p.detach() for n, p in self.params.items()}, **self._phase1_fixed(leaves)}
                loss = objective(params, sample()).sum()  # replicas are independent: Σ keeps gradients apart
                for t, g in zip(leaves.values(), torch.autograd.grad(loss, list(leaves.values()))):
                    t.grad = g
                opt.step()
                opt.zero_grad(set_to_none=True)
        return {n: t.detach() for n, t in leaves.items()}

    def upload(self, replica: int) -> Payload:
        # Only the global adapter (and a shared head) leaves the client; (C, D) stays local.
        return self.upload_params(replica, self.a_names + self.b_names + self.shared_head_names())

    @staticmethod
    def aggregate(payloads: Sequence[Payload], weights: torch.Tensor) -> dict[str, torch.Tensor]:
        """(A, B) ← Σ_k p_k (A_k, B_k), p_k the clients' data weights (``feddpa_average``)."""
        if payloads and any(n.endswith(("lora_C", "lora_D")) for n in payloads[0].tensors):
            raise ConfigError("feddpa.aggregate: the local adapter (lora_C, lora_D) is never uploaded")
        return feddpa_average([p.tensors for p in payloads], weights)

    def instance_gating(self) -> InstanceWeighting | None:
        """With ``eval_weighting="instance"``: the instance-wise weighting of the bound replicas' current
        adapters (``InstanceWeighting``); else ``None`` (every input on ``personalised_params``)."""
        if self.eval_weighting != "instance":
            return None
        raw = {n: p.detach() for n, p in self.params.items()}
        if self.variant == "F":  # the local adapter personalised_params fine-tuned for these replicas
            if self._finetuned is None:
                raise ConfigError("feddpa: FedDPA-F's instance_gating needs personalised_params first (the "
                                  "local adapter is fine-tuned there)")
            raw.update(self._finetuned)
            self._finetuned = None
        alone = {**raw, **{n: torch.zeros_like(raw[n]) for n in self.b_names}}  # the local adapter alone
        return InstanceWeighting(raw, alone, self.instance_refs, self.instance_scale, self.instance_weight_on,
                                 self.instance_repr)

    def personalised_params(self, objective: Objective, sample: Sampler) -> Mapping[str, torch.Tensor]:
        """The model at a fixed mixing: the global adapter weighted 1 − m, the local one m (m = ``eval_mix``) —
        the evaluated model with ``eval_weighting="fixed"``, and the saved adapters and exports in both modes.
        FedDPA-F: with its local adapter fine-tuned from the global one first (``_finetune_local``)."""
        m = self.eval_mix
        out = {n: p.detach() for n, p in self.params.items()}
        if self.variant == "F":
            tuned = self._finetune_local(objective, sample)
            out.update(tuned)
            self._finetuned = tuned if self.eval_weighting == "instance" else None  # for instance_gating
        out.update({n: (1.0 - m) * out[n] for n in self.b_names})
        out.update({n: m * out[n] for n in self.d_names})
        return out
