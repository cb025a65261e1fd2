"""FFA-LoRA (Sun et al. 2024): A frozen at its initialisation, only B trained, uploaded and averaged.

docs/design.md §4.3: A is identical on all clients (the server broadcasts it once) and never
changes, so averaging B alone is exact: Σ_k w_k s B_k A = s (Σ_k w_k B_k) A ([RoLoRA] §4 baseline
"LoRA-FFA"; [LoRA-A²] eq. 3; ``fedlora.aggmath.aggregate_trained_factor``). Uploads half of FedAvg-LoRA
for a square layer.

Decisions: the shared A is checked, not imposed — ``setup`` raises ``ConfigError`` if the clients of
a federation start with different A (use ``broadcast_initial_factors`` to do the server's one-time
broadcast). The frozen head of Sun et al.'s setup is the LLM layer's (docs/design.md §8), not this method's.
Optimizer state per client is kept across rounds (see ``fedavg``).
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from ..errors import ConfigError
from ..payload import Payload
from .base import Objective, Sampler, register
from .fedavg import FactorLoRA

__all__ = ["FFALoRA"]


def check_shared(method: str, params: Mapping[str, torch.Tensor], names: Sequence[str],
                 groups: Sequence[Sequence[int]]) -> None:
    """Raise ``ConfigError`` unless every federation's replicas hold bit-identical ``names``."""
    for g, reps in enumerate(groups):
        for n in names:
            p = params[n]
            for i in reps[1:]:
                if not torch.equal(p[i], p[reps[0]]):
                    raise ConfigError(
                        f"{method}: client {i - reps[0]} of federation {g} starts with a different {n} than "
                        f"client 0; the frozen factor must be identical on all clients (the server broadcasts "
                        f"it once — see fedlora.methods.fedavg.broadcast_initial_factors)")


@register
class FFALoRA(FactorLoRA):
    """FFA-LoRA. Args: rank r, lr, optimizer ("adamw" | "sgd"), weight_decay."""

    name = "ffa"
    lora_upload = ("lora_B",)  # B averaged over the one frozen A: PEFT adapters aggregate with it
    #: B alone over a frozen random A (and, in its paper's setup, a frozen random head) learns slowly at
    #: FedAvg's step; Sun et al. train FFA-LoRA with a larger one. MiniLM run: 2e-3 ends at 0.534 after
    #: 10 rounds (loss 1.38 → 1.30); 2-round probes 1e-2 / 3e-2 → 0.457 / 0.533 (docs/results/minilm-every-method.md).
    llm_lr = {"adamw": 3e-2, "sgd": 0.2}
    default_head = "frozen"  # Sun et al.'s setup (docs/design.md §8)

    def init_state(self) -> None:
        super().init_state()  # the server's broadcast of the initial adapter
        check_shared(self.name, self.params, self.a_names, self.groups)

    def local_step(self, objective: Objective, sample: Sampler) -> None:
        self.train_step(objective, sample, self.b_names + self.heads)  # A keeps grad None: frozen at its init

    def upload(self, replica: int) -> Payload:
        return self.upload_params(replica, self.b_names + self.shared_head_names())

