"""RoLoRA — alternating minimisation of LoRA ([RoLoRA] §3, eq. 3–4).

Rounds alternate which factor every client trains and the server averages (docs/design.md §4.4):

* round 0, 2, 4, … : A frozen (identical on all clients), train B; server B = Σ_k w_k B_k (eq. 3)
* round 1, 3, 5, … : B frozen (the global B just broadcast), train A; server A = Σ_k w_k A_k (eq. 4)

B comes first because B = 0 at init (an A-round would have zero gradient). The frozen factor is the
same on every client, so each round's aggregate is exact: Σ_k w_k B_k A = (Σ_k w_k B_k) A. Only the
trained factor is uploaded and downloaded: half of FedAvg-LoRA's traffic for a square layer.

Decisions: parity comes from ``round_idx`` of ``begin_round`` (never a call counter), so resumed
runs and sampled-out rounds keep the schedule (``fedlora.aggmath.trained_factor``). The paper writes
1/N; we use the data-size weights w_k (docs/design.md §3), 1/N for equal sizes. The initial A must be
identical on all clients of a federation (the server synchronises it, §3 "synchronized with A^t");
``setup`` checks it. Optimizer state per client is kept across rounds (see ``fedavg``); a factor's
AdamW moments only advance in its own rounds.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..aggmath import trained_factor
from ..errors import ConfigError
from ..payload import Payload
from .base import AveragedFactors, Objective, Sampler, register
from .fedavg import FactorLoRA
from .ffa import check_shared

__all__ = ["RoLoRA"]


@register
class RoLoRA(FactorLoRA):
    """RoLoRA. Args: rank r, lr, optimizer ("adamw" | "sgd"), weight_decay."""

    name = "rolora"
    default_head = "frozen"  # the paper's setup, as FFA-LoRA's (docs/design.md §8); a trained head trains every round
    # one factor per round; a client that sat out gets every factor averaged since (DownloadLedger)

    def bind(self, model, replica_clients, n_clients=None) -> None:
        super().bind(model, replica_clients, n_clients)
        self.factor = trained_factor(0)  # before any begin_round: round 0 (B)

    def init_state(self) -> None:
        super().init_state()  # the server's broadcast of the initial adapter
        check_shared(self.name, self.params, self.a_names, self.groups)  # round 0 freezes A

    def begin_round(self, round_idx: int) -> None:
        self.factor = trained_factor(round_idx)  # 'B' on even rounds, 'A' on odd ones

    def trained_names(self) -> list[str]:
        """Parameter names trained, uploaded and averaged in the current round."""
        return self.b_names if self.factor == "B" else self.a_names

    def local_step(self, objective: Objective, sample: Sampler) -> None:
        self.train_step(objective, sample, self.trained_names() + self.heads)

    def upload(self, replica: int) -> Payload:
        return self.upload_params(replica, self.trained_names() + self.shared_head_names())

    @staticmethod
    def aggregate(payloads: Sequence[Payload], weights: torch.Tensor) -> dict[str, torch.Tensor]:
        """Σ_k w_k of the round's trained factor (eq. 3 in B-rounds, eq. 4 in A-rounds)."""
        names = set(payloads[0].tensors) if payloads else set()
        if any(n.endswith("lora_A") for n in names) and any(n.endswith("lora_B") for n in names):
            raise ConfigError("rolora.aggregate: a round averages one factor, got both lora_A and lora_B")
        return AveragedFactors.aggregate(payloads, weights)

