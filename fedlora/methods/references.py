"""The two reference points of docs/design.md §4.2: Centralized LoRA (upper) and Local training (lower).

**Centralized** — pooled data, one model per federation. Every step takes the gradient of the
data-size-weighted mean loss Σ_k w_k L_k(θ) (the mean over the pooled samples when L_k is client k's
mean loss and w_k = n_k / Σ n_j) and applies the same update to every replica of the federation, so
its replicas stay bit-identical copies of the one model; each client is evaluated on it. ``setup``
makes the copies equal by taking the federation's first replica (the one model's init).

**Local** — every client trains A and B on its own data and never communicates.

Bytes: neither sends a model. Both return the empty ``Payload({})``; what the simulator records is
its ``nbytes`` — the serialised empty safetensors blob, 16 bytes of header (8-byte length + ``{}``
padded) with no tensor data, not 0, unless ``Payload.nbytes`` counts an empty payload as nothing sent.

Client sampling does not apply to Centralized (it has no clients to sample): run it with
``sample_fraction = 1``; ``begin_round`` raises ``ConfigError`` if a rolled-back sampled-out replica
made the copies diverge. Optimizer state per client/replica is kept across rounds (see ``fedavg``).
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from ..aggregation import normalise_weights
from ..errors import ConfigError
from ..payload import Payload
from .base import Objective, Sampler, register
from .fedavg import FactorLoRA

__all__ = ["Centralized", "Local"]


@register
class Centralized(FactorLoRA):
    """Pooled-data reference. Args: rank r, lr, optimizer ("adamw" | "sgd"), weight_decay,
    client_weights (w_k ∝ n_k, one per client; default uniform — pass the federation's)."""

    name = "centralized"
    sample_dp_refusal = None  # DP-SGD on the pooled data as one data set (``local_step``; the LLM runtime's layout)
    sample_dp_note = ("DP-SGD on the pooled data as one data set (q = b/N, ε for an example of any client); "
                      "`fedlora run` only — the testbed's stacked clients are refused")
    client_dp_refusal = ("one model trained on pooled data: no client's update is released, so there is no client to protect at this level")
    pooled_data = True
    head_modes = ("frozen", "shared")  # one model: its head is the one head

    def __init__(self, rank: int = 8, lr: float = 5e-4, optimizer: str = "adamw", weight_decay: float = 0.0,
                 client_weights: Sequence[float] | None = None) -> None:
        super().__init__(rank, lr, optimizer, weight_decay)
        if client_weights is not None:
            try:
                normalise_weights(client_weights)
            except ConfigError as e:
                raise ConfigError(f"centralized: client_weights: {e}") from None
        self.client_weights = None if client_weights is None else list(client_weights)

    def bind(self, model, replica_clients, n_clients=None) -> None:
        super().bind(model, replica_clients, n_clients)
        w = normalise_weights(self.client_weights or [1.0] * self.n_clients, self.n_clients)
        self._replica_weights = w[self.replica_clients]  # (G,) float64: w_{k(i)}
        self._trained = self.a_names + self.b_names + self.heads
    # init_state (inherited): the broadcast makes one model per federation — its copies start equal

    def begin_round(self, round_idx: int) -> None:
        for n in self._trained:
            p = self.params[n]
            for gi, g in enumerate(self.groups):
                if not all(torch.equal(p[i], p[g[0]]) for i in g[1:]):
                    raise ConfigError(f"centralized: the copies of federation {gi}'s model differ ({n}); "
                                      "Centralized has no clients to sample — use sample_fraction=1")

    def local_step(self, objective: Objective, sample: Sampler) -> None:
        """One step of the one model on Σ_k w_k L_k(θ). Under sample-level DP: DP-SGD (Abadi et al., CCS 2016) on the
        pooled data as ONE data set — the LLM runtime's layout, one replica holding the pooled rows (a Poisson batch
        at q = b/N, the noise added once, / q·N): ``private_grads``. A federation of several stacked replicas (the
        testbed's clients) would add each one's noise and divide by its own q·n_k, which is not that mechanism:
        refused."""
        if self.sample_dp is not None:
            if any(len(g) > 1 for g in self.groups):
                raise ConfigError("centralized: sample-level DP runs on the pooled data as one data set (fedlora run); "
                                  "the synthetic testbed keeps each client's rows in its own replica")
            batch = sample()
            private = self.private_grads(lambda: objective(self.params, batch), self._trained)
            self.opt.zero_grad(set_to_none=True)
            for n in self._trained:
                self.params[n].grad = private[n]
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            return
        self.opt.zero_grad(set_to_none=True)
        losses = objective(self.params, sample())  # (G,): L_k(θ) of every client on its own batch
        loss = (self._replica_weights.to(losses.dtype) * losses).sum()
        grads = torch.autograd.grad(loss, [self.params[n] for n in self._trained])
        for n, gr in zip(self._trained, grads):
            # replica i got w_k ∇L_k(θ); the federation's sum is ∇ Σ_k w_k L_k(θ), given to all copies
            full = torch.empty_like(gr)
            for g in self.groups:
                full[g] = gr[g].sum(0, keepdim=True).expand(len(g), *gr.shape[1:])
            self.params[n].grad = full
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def upload(self, replica: int) -> Payload:
        return Payload({})  # the data is pooled: no model crosses the network

    @staticmethod
    def aggregate(payloads: Sequence[Payload], weights: torch.Tensor) -> dict[str, torch.Tensor]:
        return {}

    def download(self, replica: int, state: Mapping[str, torch.Tensor]) -> Payload:
        return Payload({})


@register
class Local(FactorLoRA):
    """No-communication reference. Args: rank r, lr, optimizer ("adamw" | "sgd"), weight_decay."""

    name = "local"
    client_dp_refusal = ('no server: nothing leaves a client, so there is no release to protect at client level')
    personalised = True  # no server: every client's model is its own
    global_factors = ()  # no server: every client starts from its own draw
    default_head = "personal"
    head_modes = ("frozen", "personal")
    has_global_model = False

    def local_step(self, objective: Objective, sample: Sampler) -> None:
        self.train_step(objective, sample, self.a_names + self.b_names + self.heads)

    def upload(self, replica: int) -> Payload:
        return Payload({})

    @staticmethod
    def aggregate(payloads: Sequence[Payload], weights: torch.Tensor) -> dict[str, torch.Tensor]:
        return {}

    def download(self, replica: int, state: Mapping[str, torch.Tensor]) -> Payload:
        return Payload({})  # nothing received, nothing changed
