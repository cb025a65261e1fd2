"""FRLoRA: Yan, Feng, Zuo, Zhu, Goh, Liu, "Federated Residual Low-Rank Adaption of Large Language Models",
ICLR 2025 (OpenReview e0rQRMUhs7).

The paper's full text could not be read here, only its abstract: the rule is the abstract's, made exact
from the authors' code (github.com/IAMJackYan/FRLoRA) and a third-party reading of the paper's
Algorithm 1 (its Ŵ0 = W0 − B0A0); no equation number is cited for that reason. The math is
``fedlora.aggmath.frlora`` (its docstring has the equations); docs/methods/frlora.md lists where the
authors' code differs and what here is a decision.

* Once, for every adapted layer: (B0, A0) from the top-r singular triplets of the pretrained W0
  (s·B0A0 = U_rΣ_rV_rᵀ, ``frlora_principal``) and the base compensated, Ŵ0 = W0 − s·B0A0
  (``frlora_compensate``), so the model starts as the pretrained one.
* Each round: clients start from (B0, A0) on the current base and train A and B (and a shared head);
  they upload (A_k, B_k); the server averages each factor separately (B̄, Ā; the head likewise); every
  client merges the global update s·(B̄Ā − B0A0) into its base and restarts from (B0, A0)
  (``frlora_merge``) — the model is unchanged by the restart.

What crosses the network: the upload is FedAvg-LoRA's (A_k, B_k). The download is the round's (B̄, Ā):
with the constant (B0, A0), which every client derived from the W0 it holds, they determine the dense
update exactly, so the dense s·(B̄Ā − B0A0) (d_out·d_in numbers per layer) is never sent. The download
is an increment (``incremental_download``): every client must merge every round's, sampled or not — the
paper "synchronizes this update for all local models" — so the testbed sends it to every client every
round, and on the LLM runtime's one shared base the server merges it once (``apply_to_base``) and a
client that sat rounds out is charged each round's download it missed when it next synchronises.

``init="principal"`` (the paper's) needs a pretrained W0 of rank ≥ r. The synthetic testbed's layers
have no W0 (W0 = 0, whose SVD has no principal directions: B0 = A0 = 0, a point LoRA cannot leave), so
there (B0, A0) is the PEFT initialisation the testbed draws (A Kaiming-uniform, B = 0) and the
compensation is zero; ``init="peft"`` asks for that everywhere. Optimizer moments are kept across
rounds, as the authors' per-client trainers keep theirs.

With a shared base (the LLM runtime) the merged base is the clients' model: ``merged_update`` gives
Ŵ_T − W0 as ONE LoRA (``frlora_merged_lora``: every round's (s·B̄_t, Ā_t) and −(T+1)s·B0, A0), so an
export of a client's (B0, A0) plus that LoRA is the run's model; a half-precision base rounds every
merge, which no LoRA reproduces, so there it is ``None`` and the runtime saves the merged weights.
"""
from __future__ import annotations

from typing import Mapping

import torch

from ..adapter import LoRALinear
from ..aggregation import weighted_average
from ..aggmath import frlora_average, frlora_compensate, frlora_merge, frlora_merged_lora, frlora_principal
from ..errors import ConfigError
from ..payload import Payload
from .base import Method, Objective, Sampler, register
from .fedavg import BaseMergingLoRA

__all__ = ["FRLoRA"]

INITS = ("principal", "peft")


@register
class FRLoRA(BaseMergingLoRA):
    """FRLoRA. Args: rank r, lr, optimizer ("adamw" | "sgd"), weight_decay, init ("principal": (B0, A0)
    from W0's top-r singular triplets, the paper's; "peft": A Kaiming-uniform, B = 0), train_a (False: A
    stays A0 and only B is trained and uploaded, as the authors' code runs it; the averaging is then exact,
    B̄A0 = Σ p_k B_k A0)."""

    name = "frlora"
    client_dp_refusal = None
    incremental_download = True  # every client merges every round's update

    def __init__(self, rank: int = 8, lr: float = 5e-4, optimizer: str = "adamw", weight_decay: float = 0.0,
                 init: str = "principal", train_a: bool = True) -> None:
        super().__init__(rank, lr, optimizer, weight_decay)
        if init not in INITS:
            raise ConfigError(f"frlora: init must be one of {', '.join(INITS)}, got {init!r}")
        if not isinstance(train_a, bool):
            raise ConfigError(f"frlora: train_a must be true or false, got {train_a!r}")
        self.init, self.train_a = init, train_a
        #: per adapted layer (B0, A0): (d_out, r), (r, d_in) with a shared base, else with the replica dim first
        self.principal: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        #: shared base: every merged round's (B̄, Ā) per layer (CPU), in order; emptied for good once a
        #: merge is not exactly a LoRA (a half-precision base)
        self.merged_averages: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        self.merged_exact = True

    @torch.no_grad()
    def init_state(self) -> None:
        """(B0, A0) and the compensated base, then (B0, A0) into every replica. With a shared base the
        principal factors and the compensation are made once (the first call); later calls (the runtime's
        next passes of clients) only write (B0, A0) into their slots."""
        super().init_state()  # the server's adapter to every client (the PEFT init where that is used)
        if self.shared_base:
            if self.principal is None:
                self.principal = []
                for (a, b), layer in zip(self.pairs, self.layers):
                    B0, A0 = self._initial_pair(layer, self.params[a][0], self.params[b][0])
                    if layer.weight is not None:  # the one base: Ŵ0 = W0 − s·B0A0, in place (a view of the model's)
                        layer.weight.copy_(frlora_compensate(layer.weight, B0, A0, layer.scale))
                    self.principal.append((B0, A0))
        else:
            G = len(self.replica_clients)
            self.principal = []
            for (a, b), layer in zip(self.pairs, self.layers):
                A = self.params[a]
                w0 = layer.weight
                if w0 is None or w0.dim() == 2:
                    pairs = [self._initial_pair(layer, A[i], self.params[b][i]) for i in range(G)]
                    base = w0 if w0 is not None else A.new_zeros(layer.out_features, layer.in_features)
                    # per-replica frozen base: each replica compensates and merges its own
                    layer.weight = torch.stack([frlora_compensate(base.to(A.dtype), B0, A0, layer.scale)
                                                for B0, A0 in pairs])
                    self.principal.append((torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])))
                else:
                    raise ConfigError("frlora: the layer's W0 already has a replica dimension; set the method up once")
        for (a, b), (B0, A0) in zip(self.pairs, self.principal):
            self.params[a].copy_(A0.to(self.params[a].dtype).expand_as(self.params[a]))
            self.params[b].copy_(B0.to(self.params[b].dtype).expand_as(self.params[b]))

    def _initial_pair(self, layer: LoRALinear, A_init: torch.Tensor, B_init: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B0, A0) of one layer: W0's principal factors (``init="principal"`` and a W0 to take them from),
        else the PEFT initialisation the replica holds (B = 0)."""
        if self.init == "principal" and layer.weight is not None:
            try:
                return frlora_principal(layer.weight.detach(), self.rank, layer.scale)
            except ConfigError as e:
                raise ConfigError(f"frlora: {e}") from None
        return torch.zeros_like(B_init), A_init.detach().clone()

    def _principal_of(self, j: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
        B0, A0 = self.principal[j]
        return (B0, A0) if self.shared_base else (B0[replica], A0[replica])

    def _trained(self) -> list[str]:
        return (self.a_names if self.train_a else []) + self.b_names

    def local_step(self, objective: Objective, sample: Sampler) -> None:
        self.train_step(objective, sample, self._trained() + self.heads)

    def upload(self, replica: int) -> Payload:
        return self.upload_params(replica, self._trained() + self.shared_head_names())

    @staticmethod
    def aggregate(payloads, weights: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per layer (B̄, Ā) = ``frlora_average`` (each factor's weighted mean; B̄ alone where A is not
        trained, ``train_a=False``); a shared head's mean too."""
        if not payloads:
            raise ConfigError("frlora.aggregate: no client payloads")
        out = {}
        for b in [n for n in payloads[0].tensors if n.endswith("lora_B")]:
            a = b[: -len("lora_B")] + "lora_A"
            if a in payloads[0].tensors:
                out[b], out[a] = frlora_average([p.tensors[b] for p in payloads], [p.tensors[a] for p in payloads],
                                                weights)
            else:
                out[b] = weighted_average([p.tensors[b] for p in payloads], weights)
        out.update(Method.aggregate_head(payloads, weights))
        return out

    def client_dp_reference(self, state: Mapping[str, torch.Tensor], initial: Mapping[str, torch.Tensor],
                            upload: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every round a client restarts its factors from (B0, A0), the initial adapter (its update is the round's
        training alone); a shared head it takes from the server's state."""
        restart = {n: v for n, v in initial.items() if n.endswith(("lora_A", "lora_B"))}
        return {**initial, **state, **restart}

    @torch.no_grad()
    def apply_to_base(self, state: Mapping[str, torch.Tensor]) -> None:
        """Ŵ ← Ŵ + s·(B̄Ā − B0A0) in every adapted layer of the shared base, once per round (server side)."""
        if not self.shared_base:
            raise ConfigError("frlora.apply_to_base: only with a shared base (shared_base=True)")
        for j, ((a, b), layer) in enumerate(zip(self.pairs, self.layers)):
            B0, A0 = self.principal[j]
            dev = layer.weight.device
            layer.weight.copy_(frlora_merge(layer.weight, state[b].to(dev), state.get(a, A0).to(dev), B0.to(dev),
                                            A0.to(dev), layer.scale))
        self.merged_exact = self.merged_exact and all(layer.weight.dtype in (torch.float32, torch.float64)
                                                      for layer in self.layers)
        if self.merged_exact:
            self.merged_averages.append([(state[b].detach().cpu().clone(), state.get(a, A0).detach().cpu().clone())
                                         for (a, b), (_, A0) in zip(self.pairs, self.principal)])
        else:
            self.merged_averages.clear()

    def download(self, replica: int, state: Mapping[str, torch.Tensor]) -> Payload:
        """Merge the round's update into the replica's base (with a shared base: merged already by
        ``apply_to_base``), restart from (B0, A0), take the averaged head if one is trained."""
        if not any(b in state for _, b in self.pairs):
            self.download_head(replica, state)
            return Payload(dict(state))  # nothing averaged yet: the initial adapters stand
        with torch.no_grad():
            for j, ((a, b), layer) in enumerate(zip(self.pairs, self.layers)):
                B0, A0 = self._principal_of(j, replica)
                if not self.shared_base:
                    W = layer.weight[replica]
                    layer.weight[replica] = frlora_merge(W, state[b].to(W.device), state.get(a, A0).to(W.device),
                                                         B0, A0, layer.scale)
                self.params[a][replica] = A0.to(self.params[a])  # its dtype and device
                self.params[b][replica] = B0.to(self.params[b])
            self.download_head(replica, state)
        return Payload(dict(state))

    # shared base: what a checkpoint and an export need -------------------------------------------------
    def runtime_state(self) -> dict[str, torch.Tensor]:
        """Shared base: the adapted layers' base weights, (B0, A0) and the averages merged so far, by
        round — what a checkpoint must hold to resume bit for bit."""
        if not self.shared_base:
            return {}
        out = self.base_state()
        for j, (B0, A0) in enumerate(self.principal or []):
            out[f"B0:{j}"], out[f"A0:{j}"] = B0.detach().cpu().clone(), A0.detach().cpu().clone()
        out["merged_exact"] = torch.tensor([int(self.merged_exact)])
        for t, avgs in enumerate(self.merged_averages):
            for j, (B, A) in enumerate(avgs):
                out[f"avg:{t}:{j}:B"], out[f"avg:{t}:{j}:A"] = B, A
        return out

    def load_runtime_state(self, state: Mapping[str, torch.Tensor]) -> None:
        if not self.shared_base:
            return super().load_runtime_state(state)
        self.load_base_state(state)
        self.principal = [(state[f"B0:{j}"].clone(), state[f"A0:{j}"].clone()) for j in range(len(self.layers))]
        self.merged_exact = bool(int(state["merged_exact"][0]))
        T = len({k.split(":")[1] for k in state if k.startswith("avg:")})
        self.merged_averages = [[(state[f"avg:{t}:{j}:B"].clone(), state[f"avg:{t}:{j}:A"].clone())
                                 for j in range(len(self.layers))] for t in range(T)]

    def merged_update(self) -> dict[str, torch.Tensor] | None:
        """Shared base: Ŵ_T − W0 (the compensation and every merge) as ONE LoRA per adapted layer, scale 1:
        {A name: A_cat ((T+1)r, d_in), B name: B_cat (d_out, (T+1)r)} (``frlora_merged_lora``). ``None``
        when the base is half precision (its per-round rounding is no LoRA; module docstring)."""
        if not self.shared_base:
            raise ConfigError("frlora.merged_update: only with a shared base (shared_base=True)")
        if not self.merged_exact:
            return None
        out = {}
        for j, ((a, b), layer) in enumerate(zip(self.pairs, self.layers)):
            B0, A0 = self.principal[j]
            B_cat, A_cat = frlora_merged_lora([avgs[j] for avgs in self.merged_averages], B0.cpu(), A0.cpu(),
                                              layer.scale)
            out[a], out[b] = A_cat.contiguous(), B_cat.contiguous()
        return out
