"""FedAvg-LoRA (HOMLoRA / FL+LoRA): every client trains A and B, the server averages them separately.

docs/design.md §4.1: all clients rank r, local AdamW (or SGD) for I steps,
upload (A_k, B_k), server A = Σ_k w_k A_k, B = Σ_k w_k B_k with w_k = n_k / Σ_j n_j ([RoLoRA] §2.2
eq. 2; [LoRA-A²] "FL + LoRA"). Not exact: avg(B)·avg(A) ≠ Σ_k w_k B_k A_k (the "discordance",
[RoLoRA] eq. 2; ``fedlora.aggmath.discordance``).

This module also holds what the factor-averaging family (FFA-LoRA, RoLoRA, FedSA-LoRA, FLoRA and
the Centralized/Local references) shares: option checks, the per-client optimizer and the local
step that trains a chosen subset of the factors.

Optimizer state: one optimizer over the stacked factors, so every replica (client) has its own
AdamW moments; they are kept across rounds (the download overwrites the parameters, not the
moments), as PF2LoRA does; AdamW is ``fedlora.optim.StackedAdamW`` (a step count per client). A factor frozen in
a step keeps ``.grad = None``, so the optimizer skips it (no moment update, no weight decay).
"""
from __future__ import annotations

import math
import numbers
from typing import Mapping, Sequence

import torch

from ..adapter import LoRALinear
from ..errors import ConfigError
from ..optim import make_optimizer
from ..payload import Payload
from .base import AveragedFactors, Objective, RuntimeFacts, Sampler, broadcast_initial_factors, register

__all__ = ["FactorLoRA", "BaseMergingLoRA", "FedAvgLoRA", "broadcast_initial_factors"]

OPTIMIZERS = ("adamw", "sgd")


def check_lora_options(method: str, rank, lr, optimizer, weight_decay) -> None:
    """The options every method of this family takes; ``ConfigError`` names the bad one."""
    if not isinstance(rank, numbers.Integral) or isinstance(rank, bool) or rank < 1:
        raise ConfigError(f"{method}: rank must be an integer ≥ 1, got {rank!r}")
    if not isinstance(lr, numbers.Real) or not math.isfinite(lr) or lr <= 0:
        raise ConfigError(f"{method}: lr must be a finite number > 0, got {lr!r}")
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"{method}: optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if not isinstance(weight_decay, numbers.Real) or not math.isfinite(weight_decay) or weight_decay < 0:
        raise ConfigError(f"{method}: weight_decay must be a finite number ≥ 0, got {weight_decay!r}")


class FactorLoRA(AveragedFactors):
    """Base of the plain-LoRA methods — and the public base for a method of your own (docs/tutorials/own-method.md,
    "Writing your own method"): factors ``lora_A`` (G, r, d_in), ``lora_B`` (G, d_out, r) of G
    replicas (clients), the weighted-mean server of ``AveragedFactors``, one optimizer per client.

    Subclasses say which factors a step trains (``train_step``) and which a client uploads
    (``upload_params``). After ``bind``: ``pairs`` lists the (A name, B name) of every adapted layer
    (one for the synthetic model, many for an LLM), ``a_names`` / ``b_names`` the A and B names,
    ``heads`` a trained classifier head's parameters (LLM runtime; empty otherwise) and
    ``shared_head_names()`` those of them that are uploaded; ``params`` maps names to the stacked tensors.
    """

    sample_dp_refusal = None  # train_step has the private path (fedlora.privacy.dpsgd); subclasses with their own step refuse

    def __init__(self, rank: int = 8, lr: float = 5e-4, optimizer: str = "adamw",
                 weight_decay: float = 0.0) -> None:
        check_lora_options(self.name, rank, lr, optimizer, weight_decay)
        self.rank, self.lr, self.optimizer, self.weight_decay = int(rank), float(lr), optimizer, float(weight_decay)

    def bind(self, model, replica_clients, n_clients=None) -> None:
        super().bind(model, replica_clients, n_clients)
        a_names = self._names("lora_A")
        if not a_names:
            raise ConfigError(f"{self.name}: the model has no LoRA factors (no parameter named *lora_A)")
        G = len(self.replica_clients)
        self.pairs: list[tuple[str, str]] = []
        for a in a_names:
            b = a[: -len("lora_A")] + "lora_B"
            A, B = self.params[a], self.params.get(b)
            if B is None or A.dim() != 3 or B.dim() != 3 or A.shape[0] != G or B.shape[0] != G:
                raise ConfigError(f"{self.name}: {a} must be stacked (G={G}, r, d_in) with a matching "
                                  f"(G, d_out, r) lora_B; got {tuple(A.shape)}")
            if A.shape[1] != self.rank or B.shape[2] != self.rank:
                raise ConfigError(f"{self.name}: rank={self.rank} but the model's {a} has rank {A.shape[1]}; "
                                  "build the model with the method's adapter_kwargs()")
            self.pairs.append((a, b))
        self.a_names = [a for a, _ in self.pairs]
        self.b_names = [b for _, b in self.pairs]
        self.heads = self.head_names()  # a trained classifier head (LLM runtime), [] otherwise
        self.opt = self._make_optimizer([self.params[n] for n in self.a_names + self.b_names + self.heads])

    def _make_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return make_optimizer(self.optimizer, params, self.lr, self.weight_decay)

    def train_step(self, objective: Objective, sample: Sampler, names: Sequence[str]) -> None:
        """One optimizer step on the parameters ``names`` of every replica; the others stay frozen
        (their ``.grad`` stays None, so the optimizer leaves them and their moments untouched).

        With a ``SampleDP`` attached (``set_sample_dp``) the gradient is DP-SGD's (Abadi et al., CCS 2016, Alg. 1):
        per-sample gradients of ``names`` clipped jointly to C, summed, plus N(0, σ²C²) from each client's own
        stream, divided by the expected batch size q·n_k (``fedlora.privacy.dpsgd.private_gradients``); the
        objective must then give each slot the SUM of its real examples' losses (the slot executor's Poisson
        batches do). The optimizer step is the same."""
        self.opt.zero_grad(set_to_none=True)
        if self.sample_dp is not None:
            batch = sample()
            private = self.private_grads(lambda: objective(self.params, batch), names)
            for n in names:
                self.params[n].grad = private[n]
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            return
        loss = objective(self.params, sample()).sum()  # replicas are independent: Σ keeps grads apart
        grads = torch.autograd.grad(loss, [self.params[n] for n in names])
        for n, g in zip(names, grads):
            self.params[n].grad = g
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class BaseMergingLoRA(FactorLoRA):
    """Base of the LoRA-factor methods that change the frozen base weight W0 every round (FLoRA,
    FedEx-LoRA, FRLoRA): what they share about where W0 lives and how a checkpoint keeps it.

    ``shared_base`` (a runtime's ``RuntimeFacts.shared_base``): one base shared by every client (the LLM slot
    runtime), into which the server merges each round once (``apply_to_base``); otherwise (the synthetic
    testbed) each replica merges into its own W0. After ``bind``, ``layers`` holds the ``LoRALinear`` of
    every adapted pair, in ``pairs`` order; ``base_state`` / ``load_base_state`` are the merged shared base's
    part of ``runtime_state`` (``base:<j>``, CPU copies)."""

    #: one frozen base shared by every client of one federation (the LLM runtime); False (the synthetic
    #: testbed): each replica holds and merges its own W0
    shared_base: bool = False

    def use_runtime(self, facts: RuntimeFacts) -> None:
        """The base model is shared by every client where the runtime says so (``facts.shared_base``)."""
        super().use_runtime(facts)
        self.shared_base = bool(facts.shared_base)

    def bind(self, model, replica_clients, n_clients=None) -> None:
        super().bind(model, replica_clients, n_clients)
        self.layers: list[LoRALinear] = []
        for a, _ in self.pairs:
            prefix = a[: -len("lora_A")].rstrip(".")
            layer = model.get_submodule(prefix) if prefix else model
            if not isinstance(layer, LoRALinear):
                raise ConfigError(f"{self.name}: {a} must belong to a LoRALinear (the method changes its W0 every round)")
            self.layers.append(layer)

    def base_state(self) -> dict[str, torch.Tensor]:
        """The shared base's adapted weights as merged so far: ``base:<j>`` → (d_out, d_in), CPU copies."""
        return {f"base:{j}": layer.weight.detach().cpu().clone() for j, layer in enumerate(self.layers)}

    @torch.no_grad()
    def load_base_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Put ``base_state``'s weights back into the shared base (a resumed run)."""
        for j, layer in enumerate(self.layers):
            layer.weight.copy_(state[f"base:{j}"].to(layer.weight.device))


@register
class FedAvgLoRA(FactorLoRA):
    """HOMLoRA / FL+LoRA: train A and B locally, upload both, average each separately.

    Args: rank r (all clients), lr, optimizer ("adamw" | "sgd"), weight_decay.
    """

    name = "fedavg"
    lora_upload = ("lora_A", "lora_B")  # its server averages the uploads: PEFT adapters aggregate with it

    def local_step(self, objective: Objective, sample: Sampler) -> None:
        self.train_step(objective, sample, self.a_names + self.b_names + self.heads)

    def upload(self, replica: int) -> Payload:
        return self.upload_params(replica, self.a_names + self.b_names + self.shared_head_names())

