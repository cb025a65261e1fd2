"""FLoRA (Wang et al. 2024): stack the client adapters, merge into the frozen base, restart fresh.

docs/design.md §4.11: clients train (A_k, B_k) of rank r_k and upload them; the server stacks

    B_stack = [p_1 s_1 B_1, …, p_K s_K B_K] (d_out, Σ r_k),   A_stack = [A_1; …; A_K] (Σ r_k, d_in)

so B_stack A_stack = Σ_k p_k s_k B_k A_k exactly (``fedlora.aggmath.flora_stack``), and sends them
to every client, which merges W0 ← W0 + B_stack A_stack (``flora_merge``) and restarts fresh adapters
(A Kaiming-uniform, B = 0). Download bytes are the stacked factors.

Heterogeneous ranks: the stacked model has one rank r; ``ranks`` (one per client, 1 ≤ r_k ≤ r)
keeps client k's slots r_k..r−1 at exactly zero (as HetLoRA does), and a client uploads only its
first r_k rows of A / columns of B. The scale s is the layer's α/r for every client (the paper uses
α/r_k; with r_k < r this only rescales client k's effective step size) — a decision, stated here. With
rsLoRA it is α/√r for every client (``fedlora.adapter.lora_scale``); each upload carries its s, so the stack
B_stack A_stack = Σ_k p_k s_k B_k A_k stays exact whatever the scales.

Fresh adapters after a merge are drawn from a generator seeded by (seed, round, federation, layer),
so all clients of a federation restart from the same numbers and the same seed gives the same run.
The merged W0 differs per replica (one per federation after the first merge), so ``setup`` turns
each adapted layer's W0 into a per-replica buffer (G, d_out, d_in) — the reference kernel path.

With a shared base (the LLM runtime) the merged base is the clients' model, so it must outlive the
run: ``apply_to_base`` keeps every round's stack (CPU, the base's dtype) and ``merged_update`` returns
them concatenated per layer — one LoRA of rank M = Σ over merges of the round's Σ r_k, with
B_cat A_cat = Σ_t B_stack,t A_stack,t (a block product: the sum over rounds of stacked factors is
itself a LoRA, scale 1, the p_k s_k already in B). That reproduces the run's base up to the rounding
of each round's merge to the base's dtype: negligible in float32/float64; a bfloat16/float16 base
rounds every merge to 8/11 significant bits, which no LoRA reproduces, so there ``merged_update`` is
``None`` (nothing is kept) and the runtime saves the merged weights instead (``fedlora.llm.driver`` writes them, ``fedlora.llm.export`` reads them).

Optimizer: the official code builds a new trainer every round, so by default (``reset_optimizer``)
the moments of replicas that merged are dropped at the next ``begin_round`` (the whole state, step
counter included, when every replica merged — as in the simulator). ``reset_optimizer=False``
keeps the per-client state across rounds like the other methods.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch

from ..aggmath import flora_merge, flora_stack
from ..errors import ConfigError
from ..payload import Payload
from ..seeds import FLORA_FRESH, seed_of
from .base import Method, Objective, RankSlots, Sampler, register
from .fedavg import BaseMergingLoRA

__all__ = ["FLoRA"]

_SCALE = "scale:"  # payload metadata key prefix: the client's LoRA scale s for each A factor


@register
class FLoRA(BaseMergingLoRA):
    """FLoRA. Args: rank r (of the stacked model), lr, optimizer ("adamw" | "sgd"), weight_decay,
    ranks (per-client r_k ≤ r, default all r), seed (fresh-adapter generator), reset_optimizer."""

    name = "flora"
    client_dp_refusal = ("its server stacks the clients' factors side by side (a concatenation, not a sum of updates)")
    incremental_download = True  # a stack to merge: every client needs every round's

    def __init__(self, rank: int = 8, lr: float = 5e-4, optimizer: str = "adamw", weight_decay: float = 0.0,
                 ranks: Sequence[int] | None = None, seed: int | Sequence[int] = 0,
                 reset_optimizer: bool = True) -> None:
        super().__init__(rank, lr, optimizer, weight_decay)
        if ranks is not None:
            ranks = list(ranks)
            bad = [r for r in ranks if not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= self.rank]
            if not ranks or bad:
                raise ConfigError(f"flora: ranks must be a non-empty list of integers in [1, rank={self.rank}], got {ranks}")
        seed = self.check_seed("flora", seed)
        self.ranks, self.seed, self.reset_optimizer = ranks, seed, bool(reset_optimizer)
        #: shared base: every merged round's stack {A name: A_stack, B name: B_stack} (CPU), in order;
        #: emptied for good once a merge is not exactly a LoRA (a half-precision base)
        self.merged_stacks: list[dict[str, torch.Tensor]] = []
        self.merged_exact = True

    def bind(self, model, replica_clients, n_clients=None) -> None:
        super().bind(model, replica_clients, n_clients)
        if self.ranks is not None and len(self.ranks) != self.n_clients:
            raise ConfigError(f"flora: {len(self.ranks)} ranks for {self.n_clients} clients")
        per_client = self.ranks or [self.rank] * self.n_clients
        self.client_ranks = torch.tensor([per_client[k] for k in self.replica_clients])  # (G,)
        self.rank_slots = RankSlots(self.client_ranks, self.rank)  # (G, r)
        self._round = -1
        self._merged: set[int] = set()

    def init_state(self) -> None:
        super().init_state()  # the server's adapter to every client
        G = len(self.replica_clients)
        for layer in ([] if self.shared_base else self.layers):
            with torch.no_grad():  # per-replica frozen base: each federation merges its own ΔW
                A = layer.lora_A
                base = layer.weight if layer.weight is not None else A.new_zeros(layer.out_features, layer.in_features)
                if base.dim() == 2:
                    layer.weight = base.to(A.dtype).expand(G, *base.shape).clone()
        self.rank_slots.apply(self.params, self.pairs)

    def describe_replica(self, replica: int) -> dict:
        return {"rank": int(self.client_ranks[replica])}

    def begin_round(self, round_idx: int) -> None:
        self._round = round_idx
        if self.reset_optimizer and self._merged:
            if len(self._merged) == len(self.replica_clients):
                self.opt.state.clear()  # every replica restarted: a brand-new optimizer
            else:  # some replicas restarted: zero their moments and (StackedAdamW) step counts
                idx = torch.tensor(sorted(self._merged))
                for st in self.opt.state.values():
                    for v in st.values():
                        if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == len(self.replica_clients):
                            v[idx] = 0
        self._merged = set()

    def local_step(self, objective: Objective, sample: Sampler) -> None:
        self.train_step(objective, sample, self.a_names + self.b_names + self.heads)
        self.rank_slots.apply(self.params, self.pairs)  # slots ≥ r_k stay exactly 0 (AdamW's weight decay/moments could move them)

    def upload(self, replica: int) -> Payload:
        meta = {_SCALE + a: repr(float(layer.scale)) for (a, _), layer in zip(self.pairs, self.layers)}
        tensors = {**self.rank_slots.truncate(self.params, self.pairs, replica), **self.upload_head(replica)}
        return Payload(tensors, meta)

    @staticmethod
    def aggregate(payloads: Sequence[Payload], weights: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per layer (B_stack, A_stack) = flora_stack(B_k, A_k, p_k, s_k): B_stack A_stack = Σ p_k s_k B_k A_k."""
        if not payloads:
            raise ConfigError("flora.aggregate: no client payloads")
        out = {}
        for a in [n for n in payloads[0].tensors if n.endswith("lora_A")]:
            b = a[: -len("lora_A")] + "lora_B"
            As = [p.tensors[a] for p in payloads]
            Bs = [p.tensors[b] for p in payloads]
            missing = [k for k, p in enumerate(payloads) if _SCALE + a not in p.meta]
            if missing:  # a wrong scale would merge a wrong ΔW without a trace
                raise ConfigError(f"flora: payloads {missing} lack the scale of {a} (meta {_SCALE + a!r})")
            scales = [float(p.meta[_SCALE + a]) for p in payloads]
            out[b], out[a] = flora_stack(Bs, As, weights, scales)
        out.update(Method.aggregate_head(payloads, weights))  # a trained classifier head: the data-weighted mean
        return out

    # PEFT adapters trained elsewhere (fedlora.peft_adapters): ranks and scales may differ between clients
    lora_upload = ("lora_A", "lora_B")

    def uploads_from_lora(self, clients) -> list[Payload]:
        """Each client's r_k rows of A and columns of B as they are; meta: each module's scale s_k."""
        self.check_lora_clients(clients, one_rank=False, one_scale=False)
        return [Payload({**{f"{m}.lora_A": a for m, (a, _, _) in client.items()},
                         **{f"{m}.lora_B": b for m, (_, b, _) in client.items()}},
                        {_SCALE + f"{m}.lora_A": repr(float(s)) for m, (_, _, s) in client.items()})
                for client in clients]

    def lora_download(self, state, client) -> dict:
        """The stack every client receives, as one LoRA of rank Σ r_k and scale 1 (B_stack carries p_k s_k):
        on the old base it is the merged model; merged in (``lora_base_delta``), the client restarts fresh."""
        return {m: (state[f"{m}.lora_A"], state[f"{m}.lora_B"], 1.0) for m in client}

    def lora_base_delta(self, state) -> dict[str, torch.Tensor]:
        """B_stack A_stack per module (``flora_merge`` of a zero base: the float64 product)."""
        out = {}
        for a in [n for n in state if n.endswith(".lora_A")]:
            A, B = state[a], state[a[: -len("lora_A")] + "lora_B"]
            out[a[: -len(".lora_A")]] = flora_merge(B.new_zeros(B.shape[0], A.shape[1]), B, A)
        return out

    def server_update(self, state: Mapping[str, torch.Tensor], aggregated: Mapping[str, torch.Tensor]
                      ) -> dict[str, torch.Tensor]:
        """The round's stack (and head); with a shared base also the number of merges so far, which
        seeds the fresh adapters every client restarts from."""
        new = {**state, **aggregated}
        if self.shared_base:
            done = int(state["merges"]) if "merges" in state else 0
            new["merges"] = torch.tensor(done + 1, dtype=torch.int64)
        return new

    @torch.no_grad()
    def apply_to_base(self, state: Mapping[str, torch.Tensor]) -> None:
        """W0 ← W0 + B_stack A_stack in every adapted layer of the shared base (float64 product), once
        per round on the server side (the LLM runtime's one base for all clients)."""
        if not self.shared_base:
            raise ConfigError("flora.apply_to_base: only with a shared base (shared_base=True)")
        for (a, b), layer in zip(self.pairs, self.layers):
            layer.weight.copy_(flora_merge(layer.weight, state[b].to(layer.weight.device),
                                           state[a].to(layer.weight.device)))
        # kept for ``merged_update`` while the merges are exactly a LoRA (float32/float64 base)
        self.merged_exact = self.merged_exact and all(layer.weight.dtype in (torch.float32, torch.float64)
                                                      for layer in self.layers)
        if self.merged_exact:
            self.merged_stacks.append({n: state[n].detach().cpu().clone() for pair in self.pairs for n in pair})
        else:
            self.merged_stacks.clear()

    def runtime_state(self) -> dict[str, torch.Tensor]:
        """Shared base: the merged base weights of the adapted layers and the stacks merged so far
        (``merged_update``), by round — what a checkpoint must hold to resume bit for bit."""
        if not self.shared_base:
            return {}
        out = self.base_state()
        out["merged_exact"] = torch.tensor([int(self.merged_exact)])
        for t, stack in enumerate(self.merged_stacks):
            out.update({f"stack:{t}:{n}": v for n, v in stack.items()})
        return out

    def load_runtime_state(self, state: Mapping[str, torch.Tensor]) -> None:
        if not self.shared_base:
            return super().load_runtime_state(state)
        self.load_base_state(state)
        self.merged_exact = bool(int(state["merged_exact"][0]))
        stacks: dict[int, dict[str, torch.Tensor]] = {}
        for key, v in state.items():
            if key.startswith("stack:"):
                _, t, n = key.split(":", 2)
                stacks.setdefault(int(t), {})[n] = v.clone()
        self.merged_stacks = [stacks[t] for t in sorted(stacks)]

    def merged_update(self) -> dict[str, torch.Tensor] | None:
        """Shared base: everything ``apply_to_base`` merged so far as ONE LoRA per adapted layer —
        {A name: A_cat (M, d_in), B name: B_cat (d_out, M)}, every round's stack concatenated in
        order (M = 0 before the first merge), B_cat A_cat = Σ_t B_stack,t A_stack,t, scale 1.
        ``None`` when the base is half precision (its per-round rounding is no LoRA; module docstring)."""
        if not self.shared_base:
            raise ConfigError("flora.merged_update: only with a shared base (shared_base=True)")
        if not self.merged_exact:
            return None
        out = {}
        for a, b in self.pairs:
            A, B = self.params[a], self.params[b]  # (G, r, d_in), (G, d_out, r): shapes and dtype
            out[a] = torch.cat([s[a] for s in self.merged_stacks], 0) if self.merged_stacks else \
                A.new_zeros(0, A.shape[-1], device="cpu")
            out[b] = torch.cat([s[b] for s in self.merged_stacks], 1) if self.merged_stacks else \
                B.new_zeros(B.shape[-2], 0, device="cpu")
        return out

    def _fresh_generator(self, replica: int, layer_idx: int, round_idx: int) -> torch.Generator:
        """Same (seed, round, federation, layer) → same numbers on every client of the federation."""
        fs = self.federation_seed(replica // self.n_clients)
        return torch.Generator().manual_seed(seed_of(fs, FLORA_FRESH, round_idx, layer_idx))

    def download(self, replica: int, state: Mapping[str, torch.Tensor]) -> Payload:
        """Merge the stack into the replica's W0 (with a shared base: already merged by
        ``apply_to_base``), restart fresh adapters, take the averaged head if one is trained."""
        r = int(self.client_ranks[replica])
        if self.shared_base and "merges" not in state:
            return Payload(dict(state))  # nothing merged yet: the initial adapters stand
        round_key = int(state["merges"]) - 1 if self.shared_base else self._round
        with torch.no_grad():
            for j, ((a, b), layer) in enumerate(zip(self.pairs, self.layers)):
                if not self.shared_base:  # W0_i ← W0_i + B_stack A_stack (float64 product)
                    layer.weight[replica] = flora_merge(layer.weight[replica], state[b], state[a])
                A = self.params[a]  # then fresh PEFT adapters
                bound = 1.0 / math.sqrt(A.shape[-1])  # kaiming_uniform_(a=√5) on (r, d_in), as LoRALinear
                fresh = torch.rand(A.shape[1:], generator=self._fresh_generator(replica, j, round_key),
                                   dtype=A.dtype)
                fresh = fresh.mul_(2 * bound).sub_(bound)
                fresh[r:] = 0
                A[replica] = fresh.to(A.device)
                self.params[b][replica].zero_()
            self.download_head(replica, state)
        self._merged.add(replica)
        return Payload(dict(state))
