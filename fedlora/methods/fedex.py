"""FedEx-LoRA: average A and B, and put the averaging's error into the frozen base, so the global model is exact.

Singhal, Ponkshe, Vepakomma, "FedEx-LoRA: Exact Aggregation for Federated and Efficient Fine-Tuning of
Foundation Models", ACL 2025 (arXiv 2410.09432), its method: the residual ΔW_res added to the frozen
weight (the paper's figure 1 and update rule; equation numbers were not available to us). Clients train
A and B (all clients rank r, as FedAvg-LoRA) and upload both; the server sets (``fedlora.aggmath.fedex_aggregate``)

    Ā = Σ_k p_k A_k,   B̄ = Σ_k p_k B_k,   ΔW_res = s·(Σ_k p_k B_k A_k − B̄ Ā)

and every client adds ΔW_res to its frozen base W0 and continues from (Ā, B̄): the global model
W0 + ΔW_res + s·B̄Ā is exactly W0 + s·Σ_k p_k B_k A_k. The residual is computed from the stacked factors
[p_1B_1 … p_KB_K, −B̄]·[A_1; …; A_K; Ā] in one float64 product, in the layer's own weight layout (here
``LoRALinear``'s (d_out, d_in); GPT-2's Conv1D weights enter the runtime as their transposed view, so
the residual is written into them correctly). p_k are the data weights of the round's accepted clients
(the paper writes the uniform 1/k of its equal-sized clients; the authors' code averages uniformly).

The residual is a dense (d_out, d_in) tensor per adapted layer in the server's state, so it is part of
the download and of its measured bytes (``fedlora.payload.Payload``). It is an increment every client
must apply (``incremental_download``): a client that sat rounds out must still add every round's residual
to hold the global model —

- the synthetic testbed (each replica holds its own W0, a per-replica buffer as FLoRA's): every client
  receives every round's residual, counted, whether it was drawn or not;
- a shared base (``RuntimeFacts.shared_base``, the LLM slot runtime): the server adds the residual to the
  ONE base once per round (``apply_to_base``); a client's download writes (Ā, B̄), and the server counts
  for it every round's state it missed (the residuals a real client would have to add).

Since the base changes, a client's adapter alone is not its model: the runtime saves what was added to
the base beside the adapters (``merged_update``: the sum of the residuals D = W0_now − W0, a full-rank
update written exactly as a LoRA of rank min(d_out, d_in) — an identity factor and D, zero-padded to the
largest such rank over the layers; a half-precision base saves the merged weights instead), and both exports
add it: ``--format merged`` to the base weights, the PEFT export as a LoRA of rank r + min(d_out, d_in),
as large as a dense weight per layer (no PEFT adapter of rank r can carry the residuals).

Differences from the authors' code (CERT-Lab/fedex-lora, ``fed_agg.aggregate_models_ours``), where the
paper is followed (docs/methods/fedex.md lists them with reasons): the residual is added in the weight's
own layout (their code always adds its transpose — right for GPT-2's Conv1D, wrong for an nn.Linear that
is not square; RoBERTa's square query/value hide it); the means are data-weighted (theirs uniform); the
classifier head is the data-weighted mean (theirs uniform); the residual is one product of stacked
factors (theirs K dense products); their GLUE script hands the client modules to an aggregation that
indexes state dicts. Optimizer state: each client keeps its AdamW moments across rounds as in
FedAvg-LoRA here (the authors build a new optimizer every round), so the comparison isolates the
aggregation.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from ..aggmath import fedex_aggregate, fedex_merge
from ..errors import ConfigError
from ..payload import Payload
from .base import Method, Objective, Sampler, register
from .fedavg import BaseMergingLoRA

__all__ = ["FedExLoRA", "RESIDUAL"]

_SCALE = "scale:"  # payload metadata key prefix: the client's LoRA scale s for each A factor
#: the server-state entry of a layer's residual: ``<layer prefix>`` + RESIDUAL (the lora_A name's prefix)
RESIDUAL = "fedex_residual"


def residual_name(a: str) -> str:
    """The server-state name of the residual of the layer whose A factor is ``a``."""
    return a[: -len("lora_A")] + RESIDUAL


@register
class FedExLoRA(BaseMergingLoRA):
    """FedEx-LoRA. Args: rank r (all clients), lr, optimizer ("adamw" | "sgd"), weight_decay."""

    name = "fedex"
    client_dp_refusal = ("its server adds the residual Σ p_k B_k A_k − B̄Ā, which needs each client's own product B_k A_k")
    incremental_download = True  # a residual to add to the base: every client needs every round's

    def __init__(self, rank: int = 8, lr: float = 5e-4, optimizer: str = "adamw", weight_decay: float = 0.0) -> None:
        super().__init__(rank, lr, optimizer, weight_decay)
        #: shared base: the adapted layers' W0 before the first residual was added (CPU), for ``merged_update``
        self.base0: list[torch.Tensor] | None = None

    def init_state(self) -> None:
        super().init_state()  # the server's adapter to every client
        G = len(self.replica_clients)
        for layer in ([] if self.shared_base else self.layers):
            with torch.no_grad():  # per-replica frozen base: each client adds the residuals to its own W0
                A = layer.lora_A
                base = layer.weight if layer.weight is not None else A.new_zeros(layer.out_features, layer.in_features)
                if base.dim() == 2:
                    layer.weight = base.to(A.dtype).expand(G, *base.shape).clone()

    def local_step(self, objective: Objective, sample: Sampler) -> None:
        self.train_step(objective, sample, self.a_names + self.b_names + self.heads)

    def upload(self, replica: int) -> Payload:
        """(A_k, B_k) of every layer, the shared head, and each layer's scale s (metadata: the server
        needs it for the residual)."""
        meta = {_SCALE + a: repr(float(layer.scale)) for (a, _), layer in zip(self.pairs, self.layers)}
        return Payload({n: self.params[n][replica].detach().clone()
                        for n in self.a_names + self.b_names + self.shared_head_names()}, meta)

    @staticmethod
    def aggregate(payloads: Sequence[Payload], weights: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per layer Ā, B̄ and the dense residual s·(Σ p_k B_k A_k − B̄Ā) (``fedex_aggregate``, layout
        (d_out, d_in)); the shared head's data-weighted mean."""
        if not payloads:
            raise ConfigError("fedex.aggregate: no client payloads")
        out = {}
        for a in [n for n in payloads[0].tensors if n.endswith("lora_A")]:
            b = a[: -len("lora_A")] + "lora_B"
            missing = [k for k, p in enumerate(payloads) if _SCALE + a not in p.meta]
            if missing:  # a wrong scale would add a wrong residual without a trace
                raise ConfigError(f"fedex: payloads {missing} lack the scale of {a} (meta {_SCALE + a!r})")
            scales = {float(p.meta[_SCALE + a]) for p in payloads}
            if len(scales) != 1:
                raise ConfigError(f"fedex: the payloads give different scales of {a} ({sorted(scales)}); "
                                  "every client must have the same rank and lora_alpha")
            res = fedex_aggregate([p.tensors[b] for p in payloads], [p.tensors[a] for p in payloads], weights,
                                  scales.pop(), "linear")
            out[a], out[b], out[residual_name(a)] = res.A, res.B, res.residual
        out.update(Method.aggregate_head(payloads, weights))  # a trained classifier head: the data-weighted mean
        return out

    # PEFT adapters trained elsewhere (fedlora.peft_adapters, `fedlora aggregate`): one rank and one scale
    lora_upload = ("lora_A", "lora_B")

    @classmethod
    def uploads_from_lora(cls, clients) -> list[Payload]:
        """Each client's A and B as they are; meta: each module's scale s (the server's residual needs it)."""
        cls.check_lora_clients(clients)
        return [Payload({**{f"{m}.lora_A": a for m, (a, _, _) in client.items()},
                         **{f"{m}.lora_B": b for m, (_, b, _) in client.items()}},
                        {_SCALE + f"{m}.lora_A": repr(float(s)) for m, (_, _, s) in client.items()})
                for client in clients]

    @classmethod
    def lora_base_delta(cls, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The residual ΔW_res (d_out, d_in) of every module: what the clients add to their frozen base."""
        tail = "." + RESIDUAL
        return {n[: -len(tail)]: v for n, v in state.items() if n.endswith(tail)}

    @torch.no_grad()
    def apply_to_base(self, state: Mapping[str, torch.Tensor]) -> None:
        """W0 ← W0 + ΔW_res in every adapted layer of the shared base (float64 sum), once per round on
        the server side (the LLM runtime's one base for all clients). The pristine W0 is kept (CPU) at
        the first merge, for ``merged_update``."""
        if not self.shared_base:
            raise ConfigError("fedex.apply_to_base: only with a shared base (shared_base=True)")
        if self.base0 is None:
            self.base0 = [layer.weight.detach().cpu().clone() for layer in self.layers]
        for (a, _), layer in zip(self.pairs, self.layers):
            layer.weight.copy_(fedex_merge(layer.weight, state[residual_name(a)].to(layer.weight.device)))

    def runtime_state(self) -> dict[str, torch.Tensor]:
        """Shared base: the base weights of the adapted layers with every residual added, and the pristine
        W0 once a residual was added — what a checkpoint must hold to resume bit for bit."""
        if not self.shared_base:
            return {}
        out = self.base_state()
        out.update({f"base0:{j}": w.clone() for j, w in enumerate(self.base0 or [])})
        return out

    def load_runtime_state(self, state: Mapping[str, torch.Tensor]) -> None:
        if not self.shared_base:
            return super().load_runtime_state(state)
        self.load_base_state(state)
        self.base0 = [state[f"base0:{j}"].clone() for j in range(len(self.layers))] if "base0:0" in state else None

    def merged_update(self) -> dict[str, torch.Tensor] | None:
        """Shared base: everything added to the base so far, D = W0_now − W0 (exact in float64), as ONE
        LoRA per adapted layer of rank M = the largest min(d_out, d_in) over the layers, scale 1, float64:
        an identity on the smaller side and D on the other ({A name: I | D (M, d_in), B name: D | I
        (d_out, M)}, zero-padded to M), so B A = D exactly — a full-rank update written as a LoRA (the sum
        of residuals has no lower rank in general). M = 0 before the first merge. ``None`` on a
        half-precision base (a PEFT adapter in that precision cannot reproduce it): the runtime saves
        the merged weights then."""
        if not self.shared_base:
            raise ConfigError("fedex.merged_update: only with a shared base (shared_base=True)")
        if any(layer.weight.dtype not in (torch.float32, torch.float64) for layer in self.layers):
            return None
        F64 = torch.float64
        shapes = [tuple(layer.weight.shape) for layer in self.layers]
        M = max(min(s) for s in shapes) if self.base0 is not None else 0
        out = {}
        for j, ((a, b), layer) in enumerate(zip(self.pairs, self.layers)):
            d_out, d_in = shapes[j]
            A, B = torch.zeros(M, d_in, dtype=F64), torch.zeros(d_out, M, dtype=F64)
            if M:
                D = layer.weight.detach().cpu().to(F64) - self.base0[j].to(F64)
                q = min(d_out, d_in)
                eye = torch.eye(q, dtype=F64)
                if d_in <= d_out:
                    A[:q], B[:, :q] = eye, D
                else:
                    A[:q], B[:q, :q] = D, eye
            out[a], out[b] = A, B
        return out

    def download(self, replica: int, state: Mapping[str, torch.Tensor]) -> Payload:
        """Add the residual to the replica's W0 (with a shared base: added already by ``apply_to_base``),
        then write Ā, B̄ and the averaged head."""
        with torch.no_grad():
            for (a, b), layer in zip(self.pairs, self.layers):
                r = residual_name(a)
                if r in state and not self.shared_base:
                    layer.weight[replica] = fedex_merge(layer.weight[replica], state[r].to(layer.weight.device))
                for n in (a, b):
                    if n in state:
                        self.params[n][replica].copy_(state[n])
            self.download_head(replica, state)
        return Payload(dict(state))
