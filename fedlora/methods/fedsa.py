"""FedSA-LoRA (Guo et al. 2024, "selective aggregation"): share A, keep B per client.

docs/design.md §4.11: every client trains both factors; A (general knowledge) is uploaded and
averaged, A = Σ_k w_k A_k; B (client-specific knowledge) never leaves the client — each client
keeps its own B, not one shared object. The model a client evaluates is s·B_k A.

Optimizer state per client is kept across rounds (see ``fedavg``).
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..errors import ConfigError
from ..payload import Payload
from .base import AveragedFactors, Objective, Sampler, register
from .fedavg import FactorLoRA

__all__ = ["FedSALoRA"]


@register
class FedSALoRA(FactorLoRA):
    """FedSA-LoRA. Args: rank r, lr, optimizer ("adamw" | "sgd"), weight_decay."""

    name = "fedsa"
    lora_upload = ("lora_A",)  # A averaged, B_k stays: PEFT adapters aggregate with it
    personalised = True  # B_k stays on the client
    global_factors = ("lora_A",)  # B_k is each client's own from the start
    default_head = "personal"  # client-specific knowledge, like B_k
    has_global_model = False

    def local_step(self, objective: Objective, sample: Sampler) -> None:
        self.train_step(objective, sample, self.a_names + self.b_names + self.heads)

    def upload(self, replica: int) -> Payload:
        return self.upload_params(replica, self.a_names + self.shared_head_names())  # B_k is private: never uploaded

    @staticmethod
    def aggregate(payloads: Sequence[Payload], weights: torch.Tensor) -> dict[str, torch.Tensor]:
        """A = Σ_k w_k A_k (the only shared factor)."""
        if payloads and any(not n.endswith(("lora_A", "head_weight", "head_bias")) for n in payloads[0].tensors):
            raise ConfigError("fedsa.aggregate: clients upload only lora_A factors (and a shared head)")
        return AveragedFactors.aggregate(payloads, weights)

