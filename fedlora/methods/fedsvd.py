"""FedSVD (Lee et al., "FedSVD: Adaptive Orthogonalization for Private Federated Learning with LoRA",
NeurIPS 2025, arXiv 2505.12805): clients train B over the server's A; the server averages B and
re-factorises B̄A by its SVD after every round, so A becomes orthonormal rows adapted to the aggregate.

The round (the paper's method; docs/methods/fedsvd.md):

1. every client holds the server's (A, B); it trains B only, A frozen (FFA-LoRA's local step), and
   uploads B_k;
2. the server forms B̄ = Σ_k w_k B_k — data-weighted, w_k = n_k/Σn (equal for balanced clients; the
   authors' ``--balanced``) — and re-factorises with the A of the round: B̄A = UΣVᵀ, A ← V_rᵀ,
   B ← U_rΣ_r (``fedlora.aggmath.fedsvd_refactor``: QR + an SVD of the r × r core, float64, exact:
   B_new A_new = B̄A, so the global model is the FFA-style average and only its factorisation changes);
3. clients download both A and B (both change every round; the bytes are the two factors).

The server half: ``aggregate`` (pure, from the uploads) is the weighted mean B̄ in float64; ``server_update``
re-factorises it with the state's A — the server's state holds A and B from the start (the broadcast
adapter, ``initial_server_state``), so no model is needed.

Decisions, each stated on the docs page:
- Head: the authors freeze the classifier head (``freeze_target_layers``), as FFA-LoRA does, so the
  default is ``frozen``; ``shared`` (averaged like B, untouched by the re-factorisation) and ``personal``
  are allowed — the head is no part of the factorisation.
- Optimizer state: the authors build a fresh optimizer every round. Here ``reset_optimizer`` (default
  True) zeroes a client's moments (and StackedAdamW step count) when it downloads a re-factorised adapter,
  before it trains — the same as a fresh optimizer. Why it matters: the re-factorisation rotates the basis
  (B's column i pairs with a new row i of A), so moments of B kept from the previous round would push
  along directions that no longer exist. ``reset_optimizer=False`` keeps them (an ablation, not the paper).
- One rank r for every client (one global A); per-client ranks are refused by ``build`` in one line. A
  layer with d_in < r is refused in ``bind``: A (r, d_in) cannot have orthonormal rows.
- The re-factorisation runs after every round; the authors' code can skip rounds
  (``--recalculate-svd-period``, ``--svd-warmup-steps``, both default to every round), which is not offered.

Where the authors' code (seanie12/fed-svd) differs, the paper's rule is kept and every difference is listed
on the docs page: their SVD runs on the dense d_out × d_in product in the model's float32 and takes LAPACK's
arbitrary basis when the product is rank-deficient (a zero product replaces A by whatever basis LAPACK
returns); here QR + a small core SVD in float64, a fixed sign rule, and a zero product keeps A
(``fedlora.aggmath.fedsvd``). The paper's private setting (DP-SGD in the clients) is not available: fedlora
has no differential privacy yet.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from ..aggmath import fedsvd_refactor
from ..aggregation import weighted_average
from ..errors import ConfigError
from ..payload import Payload
from .base import Method, Objective, Sampler, register
from .fedavg import FactorLoRA
from .ffa import FFALoRA, check_shared

__all__ = ["FedSVD"]


@register
class FedSVD(FactorLoRA):
    """FedSVD. Args: rank r (all clients), lr, optimizer ("adamw" | "sgd"), weight_decay,
    reset_optimizer (a fresh optimizer state after every re-factorised download, as the authors' code)."""

    name = "fedsvd"
    #: the authors freeze the classifier head (``freeze_target_layers`` in seanie12/fed-svd), as FFA-LoRA does
    default_head = "frozen"
    #: B trained over a fixed-norm frozen A, as FFA-LoRA: its measured LLM step (not tuned for FedSVD apart)
    llm_lr = FFALoRA.llm_lr
    #: its server runs on the clients' B over their one shared A: PEFT adapters trained elsewhere aggregate with it
    #: (``fedlora.peft_adapters``; the A every client holds is the server's state, ``lora_server_state``)
    lora_upload = ("lora_B",)

    def __init__(self, rank: int = 8, lr: float = 5e-4, optimizer: str = "adamw", weight_decay: float = 0.0,
                 reset_optimizer: bool = True) -> None:
        super().__init__(rank, lr, optimizer, weight_decay)
        if not isinstance(reset_optimizer, bool):
            raise ConfigError(f"fedsvd: reset_optimizer must be true or false, got {reset_optimizer!r}")
        self.reset_optimizer = reset_optimizer

    def bind(self, model, replica_clients, n_clients=None) -> None:
        super().bind(model, replica_clients, n_clients)
        for a in self.a_names:
            d_in = self.params[a].shape[-1]
            if d_in < self.rank:
                raise ConfigError(f"fedsvd: rank={self.rank} exceeds d_in={d_in} of {a}; A (r, d_in) cannot have "
                                  f"orthonormal rows — use a rank ≤ {d_in}")
        self._refactored: set[int] = set()  # replicas that downloaded a re-factorised adapter this pass

    def init_state(self) -> None:
        super().init_state()  # the server's broadcast of the initial adapter
        check_shared(self.name, self.params, self.a_names, self.groups)

    def initial_server_state(self, replica: int) -> dict[str, torch.Tensor]:
        """The broadcast adapter: every A (the first round's frozen factor) and B (zero at PEFT init)."""
        return {n: self.params[n][replica].detach().clone() for pair in self.pairs for n in pair}

    def begin_round(self, round_idx: int) -> None:
        """With ``reset_optimizer``: the replicas that took a re-factorised adapter start from a fresh
        optimizer state (zero moments, step 0), as after the authors' per-round ``get_optimizer``."""
        if self.reset_optimizer and self._refactored:
            G = len(self.replica_clients)
            idx = torch.tensor(sorted(self._refactored))
            with torch.no_grad():
                for st in self.opt.state.values():
                    for v in st.values():
                        if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == G:
                            v[idx] = 0
        self._refactored = set()

    def local_step(self, objective: Objective, sample: Sampler) -> None:
        self.train_step(objective, sample, self.b_names + self.heads)  # A keeps grad None: frozen

    def upload(self, replica: int) -> Payload:
        return self.upload_params(replica, self.b_names + self.shared_head_names())

    @staticmethod
    def aggregate(payloads: Sequence[Payload], weights: torch.Tensor) -> dict[str, torch.Tensor]:
        """B̄ = Σ_k w_k B_k per layer in float64 (``server_update`` re-factorises it with the state's A), and
        a shared head's weighted mean. An upload that carries an A is refused: FedSVD's A is the server's."""
        if not payloads:
            raise ConfigError("fedsvd.aggregate: no client payloads")
        trained_a = sorted({n for p in payloads for n in p.tensors if n.endswith("lora_A")})
        if trained_a:
            raise ConfigError(f"fedsvd.aggregate: uploads carry {trained_a[0]}; FedSVD clients train and upload B "
                              "only (A is the server's, re-factorised every round)")
        names = set(payloads[0].tensors)
        for k, p in enumerate(payloads):
            if set(p.tensors) != names:
                raise ConfigError(f"fedsvd.aggregate: client {k} sends {sorted(p.tensors)}, expected {sorted(names)}")
        out = {b: weighted_average([p.tensors[b].to(torch.float64) for p in payloads], weights)  # float64, Σw = 1
               for b in payloads[0].tensors if b.endswith("lora_B")}
        out.update(Method.aggregate_head(payloads, weights))
        return out

    def server_update(self, state: Mapping[str, torch.Tensor], aggregated: Mapping[str, torch.Tensor]
                      ) -> dict[str, torch.Tensor]:
        """Per layer (B, A) ← fedsvd_refactor(B̄, A): A ← V_rᵀ, B ← U_rΣ_r of B̄A (in the state's dtypes);
        a shared head replaces the old one. Pure: built from ``state`` and ``aggregated`` alone."""
        new = dict(state)
        for a in [n for n in state if n.endswith("lora_A")]:
            b = a[: -len("lora_A")] + "lora_B"
            if b not in aggregated:
                raise ConfigError(f"fedsvd server: this round's aggregate lacks {b}")
            res = fedsvd_refactor(aggregated[b], state[a])
            new[a] = res.A.to(state[a].dtype)
            new[b] = res.B.to(state[b].dtype if b in state else state[a].dtype)
        new.update({n: v for n, v in aggregated.items() if not n.endswith("lora_B")})
        return new

    def lora_server_state(self, clients) -> dict[str, torch.Tensor]:
        """PEFT adapters trained elsewhere: the server's state before the round is the A every client trained
        against — frozen and the same on every client (``uploads_from_lora`` checks it); B̄ replaces B."""
        return {f"{m}.lora_A": a for m, (a, _, _) in clients[0].items()}

    def download(self, replica: int, state: Mapping[str, torch.Tensor]) -> Payload:
        """Write the server's A, B (and a shared head) into the replica; what is sent is exactly ``state``."""
        unknown = [n for n in state if n not in self.params]
        if unknown:
            raise ConfigError(f"fedsvd download: unexpected state entry {unknown[0]!r}")
        if any(n.endswith(("lora_A", "lora_B")) for n in state):
            self._refactored.add(replica)
        return self._write(replica, state)
