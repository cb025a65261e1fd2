"""HetLoRA (Cho et al. 2024; as described in [PF2LoRA] §3 and docs/design.md §4.7).

Clients hold ranks r_k ∈ [r_min, r_max]; the server keeps rank r_max (sent in each upload's metadata,
so the server knows it whichever clients took part in a round).
1. distribution by truncation: client k takes the first r_k rows of A and columns of B;
2. local loss + λ‖B[:, ⌊γr_k⌋:r_k]‖_F·‖A[⌊γr_k⌋:r_k, :]‖_F — a real, differentiated penalty;
3. self-pruning: if that tail norm shrank over the round, r_k ← max(r_min, ⌊γ r_k⌋);
4. server: zero-pad to r_max and average A and B with weights ‖B_kA_k‖_F / Σ_j ‖B_jA_j‖_F.

Stacked replicas all have r_max slots; a client's unused slots are kept at exactly zero (which is
the zero-padding), so its gradients there vanish and the batched step equals per-client training.

Several adapted layers (an LLM): r_k is the client's rank in every layer; the penalty and the tail
norm of the pruning rule are summed over layers; the server aggregates each layer with its own
sparsity weights ‖B_kA_k‖_F (of that layer). A trained classifier head is averaged with the data
weights (it has no rank to weight by).

Scale (a decision, as FlexLoRA's and FLoRA's): one s per layer for every client, the layer's s = α/r_max
(``fedlora.adapter.lora_scale``; with rsLoRA, α/√r_max) — the stacked layer has r_max slots, so a client of
rank r_k trains as if its α were α·r_k/r_max (rsLoRA: α·√(r_k/r_max)), not with its own α/r_k (α/√r_k). The
sparsity weights ‖B_kA_k‖_F / Σ_j ‖B_jA_j‖_F do not depend on s (a common s cancels), so the server is the
same with or without rsLoRA.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from ..aggregation import hetlora_aggregate
from ..errors import ConfigError
from ..optim import make_optimizer
from ..payload import Payload
from .base import Method, Objective, RankSlots, Sampler, register

__all__ = ["HetLoRA", "hetlora_initial_ranks"]


def hetlora_initial_ranks(n_clients: int, r_min: int, r_max: int) -> list[int]:
    """PF2LoRA's recipe r_k = r_min + (r_max − r_min)(k − 1)/M for k = 1..M (rounded down)."""
    return [r_min + (r_max - r_min) * (k - 1) // n_clients for k in range(1, n_clients + 1)]


@register
class HetLoRA(Method):
    name = "hetlora"
    client_dp_refusal = ("its aggregation weights come from each client's own factor norms")
    sample_dp_refusal = None  # local_step's private path: DP-SGD on the task loss, the penalty's exact gradient
    #: The PF2LoRA paper's GLUE comparison (its §6.1.1 and Table 6): HetLoRA with AdamW and
    #: r_min = 8, r_max = 12 against a rank-8 common adapter, so a config's ``method.rank`` is r_min
    #: and r_max follows as ⌈1.5·r_min⌉ unless given (``derive_options``).
    rank_option = "r_min"
    llm_options = {"optimizer": "adamw", "r_min": 8}

    @classmethod
    def derive_options(cls, options: dict) -> dict:
        """r_max = ⌈1.5·r_min⌉ (Table 6's 8 → 12) when only r_min is given."""
        if "r_max" not in options and isinstance(options.get("r_min"), int):
            return {**options, "r_max": -(-3 * options["r_min"] // 2)}
        return options

    def __init__(self, lr: float = 2e-3, r_min: int = 1, r_max: int = 12, gamma: float = 0.99,
                 penalty: float = 5e-3, initial_ranks: Sequence[int] | None = None,
                 optimizer: str = "sgd", eps: float = 1e-12) -> None:
        if lr <= 0:
            raise ConfigError(f"hetlora: lr must be > 0, got {lr}")
        if not 1 <= r_min <= r_max:
            raise ConfigError(f"hetlora: need 1 ≤ r_min ≤ r_max, got r_min={r_min}, r_max={r_max}")
        if not 0 < gamma < 1:
            raise ConfigError(f"hetlora: gamma must be in (0, 1), got {gamma}")
        if penalty < 0:
            raise ConfigError(f"hetlora: penalty must be ≥ 0, got {penalty}")
        if optimizer not in ("sgd", "adamw"):
            raise ConfigError(f"hetlora: optimizer must be 'sgd' or 'adamw', got {optimizer!r}")
        if initial_ranks is not None:
            bad = [r for r in initial_ranks if not r_min <= r <= r_max]
            if bad:
                raise ConfigError(f"hetlora: initial ranks must lie in [r_min={r_min}, r_max={r_max}], got {list(initial_ranks)}")
        self.lr, self.r_min, self.r_max, self.gamma, self.penalty = lr, r_min, r_max, gamma, penalty
        self.initial_ranks = None if initial_ranks is None else list(initial_ranks)
        self.optimizer, self.eps = optimizer, eps

    def adapter_kwargs(self) -> dict:
        """The server's rank r_max; each client uses its first r_k slots."""
        return {"rank": self.r_max}

    def bind(self, model, replica_clients, n_clients=None) -> None:
        super().bind(model, replica_clients, n_clients)
        self.pairs = [(a, a[: -len("lora_A")] + "lora_B") for a in self._names("lora_A")]
        if not self.pairs:
            raise ConfigError("hetlora: the model has no LoRA factors (no parameter named *lora_A)")
        for a, b in self.pairs:
            A = self.params[a]
            if A.dim() != 3 or A.shape[-2] != self.r_max or b not in self.params:
                raise ConfigError(f"hetlora: the model must hold stacked factors of rank r_max={self.r_max}, "
                                  f"got {a} of shape {tuple(A.shape)}")
        self.a_name, self.b_name = self.pairs[0]  # dtype/device reference
        n_clients = self.n_clients
        init = self.initial_ranks or hetlora_initial_ranks(n_clients, self.r_min, self.r_max)
        if len(init) != n_clients:
            raise ConfigError(f"hetlora: {len(init)} initial ranks for {n_clients} clients")
        self._initial_ranks = torch.tensor([init[k] for k in self.replica_clients])  # (G,)
        self._set_ranks(self._initial_ranks.clone())  # placeholder until init_state / a loaded record
        self.heads = self.head_names()
        params = [self.params[n] for ab in self.pairs for n in ab] + [self.params[n] for n in self.heads]
        self.opt = make_optimizer(self.optimizer, params, self.lr)

    def init_state(self) -> None:
        super().init_state()  # the server's rank-r_max adapter to every client
        self._set_ranks(self._initial_ranks.clone())
        self.rank_slots.apply(self.params, self.pairs)  # distribution by truncation: client k keeps its first r_k slots

    # masks over the r_max slots, recomputed only when the ranks change ---------------------
    def _set_ranks(self, ranks: torch.Tensor) -> None:
        self.ranks = ranks
        dtype = self.params[self.a_name].dtype
        slots = torch.arange(self.r_max)[None, :]
        start = torch.floor(self.gamma * ranks.double()).long()[:, None]
        self.rank_slots = RankSlots(ranks, self.r_max)  # (G, r_max): slot i < r_k
        self._tail_mask = ((slots >= start) & (slots < ranks[:, None])).to(dtype)  # ⌊γ r_k⌋ ≤ i < r_k

    def tail_norm(self, A: torch.Tensor | None = None, B: torch.Tensor | None = None) -> torch.Tensor:
        """Σ_layers ‖B[:, tail]‖_F · ‖A[tail, :]‖_F per replica, shape (G,). ``A``, ``B``: one layer's
        factors instead (the single-layer form)."""
        t = self._tail_mask.to(self.params[self.a_name].device)
        layers = [(A, B)] if A is not None else [(self.params[a], self.params[b]) for a, b in self.pairs]
        total = 0
        for A_, B_ in layers:
            # sqrt(x + 0) has an infinite derivative at 0; the tail is exactly 0 at init (B = 0), so use
            # the norm's subgradient 0 there instead of NaN.
            na = torch.linalg.vector_norm(A_ * t[:, :, None], dim=(-2, -1))
            nb = torch.linalg.vector_norm(B_ * t[:, None, :], dim=(-2, -1))
            total = total + na * nb
        return total

    def begin_round(self, round_idx: int) -> None:
        with torch.no_grad():
            self._tail_at_start = self.tail_norm()

    def local_step(self, objective: Objective, sample: Sampler) -> None:
        """One optimizer step on the task loss + penalty · tail norm (rank self-pruning's regulariser). Under
        sample-level DP the task loss's gradient is DP-SGD's (``private_grads``; slots r_k.. hold zeros, so their
        per-example gradients are 0, and their noise is masked before the step); the penalty is a function of the
        factors alone, not of any example, so its exact gradient is added unclipped and un-noised — post-processing
        of what earlier private steps released. The self-pruning at the round's end compares tail norms of those
        factors: post-processing too."""
        factors = [n for ab in self.pairs for n in ab]
        names = factors + self.heads
        if self.sample_dp is not None:
            batch = sample()
            grads = self.private_grads(lambda: objective(self.params, batch), names)
            if self.penalty:
                pen = torch.autograd.grad(self.penalty * self.tail_norm().sum(), [self.params[n] for n in factors])
                for n, g in zip(factors, pen):
                    grads[n] = grads[n] + g
            self.rank_slots.apply(grads, self.pairs)
            self.opt.zero_grad(set_to_none=True)
            for n in names:
                self.params[n].grad = grads[n]
        else:
            loss = objective({n: self.params[n] for n in names}, sample()).sum()
            if self.penalty:
                loss = loss + self.penalty * self.tail_norm().sum()
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
        self.opt.step()
        self.rank_slots.apply(self.params, self.pairs)

    def end_round(self, round_idx: int) -> None:
        """Self-pruning: r_k ← max(r_min, ⌊γ r_k⌋) where the tail norm shrank during the round."""
        with torch.no_grad():
            shrank = self.tail_norm() < self._tail_at_start
            pruned = torch.clamp(torch.floor(self.gamma * self.ranks.double()).long(), min=self.r_min)
            self._set_ranks(torch.where(shrank, pruned, self.ranks))
            self.rank_slots.apply(self.params, self.pairs)

    def _extra_state(self):
        return {"ranks": self.ranks.clone()}

    def _restore_extra_state(self, extra, idx) -> None:
        ranks = self.ranks.clone()
        ranks[idx] = extra["ranks"][idx]
        self._set_ranks(ranks)

    def describe_replica(self, replica: int) -> dict:
        return {"rank": int(self.ranks[replica]), "server_rank": self.r_max}

    def global_replica(self, replica: int) -> None:
        """The global model is the server's rank-r_max adapter."""
        ranks = self.ranks.clone()
        ranks[replica] = self.r_max
        self._set_ranks(ranks)

    def upload(self, replica: int) -> Payload:
        """The client's r_k rows of A and columns of B per layer (and a shared head); meta ``r_max``,
        the server's rank (see ``aggregate``)."""
        tensors = {**self.rank_slots.truncate(self.params, self.pairs, replica), **self.upload_head(replica)}
        return Payload(tensors, {"r_max": str(self.r_max)})

    @staticmethod
    def aggregate(payloads: Sequence[Payload], weights: torch.Tensor, eps: float = 1e-12) -> dict[str, torch.Tensor]:
        """Zero-pad to r_max and take the sparsity-weighted mean (``weights`` are not used: HetLoRA
        weights clients by ‖ΔW_k‖_F, not by data size). Returns A (r_max, d_in), B (d_out, r_max).

        r_max is the server's rank, carried in every upload's metadata (as FlexLoRA's ``max_rank``),
        never inferred from the payloads: with client sampling the participants may all have smaller
        ranks than a client who sat out, and that client still takes its first r_k rows."""
        if not payloads:
            raise ConfigError("hetlora: aggregate needs at least one payload")
        a_names = [n for n in payloads[0].tensors if n.rsplit(".", 1)[-1] == "lora_A"]
        names = set(payloads[0].tensors)
        for k, p in enumerate(payloads):
            want = {a[: -len("lora_A")] + "lora_B" for a in a_names} | set(a_names) | names
            missing = sorted(want - set(p.tensors)) + (["meta r_max"] if "r_max" not in p.meta else [])
            if not a_names or missing:
                raise ConfigError(f"hetlora: payload {k} lacks {missing or ['lora_A']}; every HetLoRA upload carries "
                                  "the same layers' lora_A, lora_B and the server rank r_max")
        r_maxes = {int(p.meta["r_max"]) for p in payloads}
        if len(r_maxes) != 1:
            raise ConfigError(f"hetlora: payloads disagree on the server rank r_max: {sorted(r_maxes)}")
        r_max = r_maxes.pop()
        out = {}
        for a in a_names:  # each layer with its own sparsity weights ‖B_k A_k‖_F
            b = a[: -len("lora_A")] + "lora_B"
            out[a], out[b], _ = hetlora_aggregate([p.tensors[a] for p in payloads], [p.tensors[b] for p in payloads],
                                                  r_max, eps)
        out.update(Method.aggregate_head(payloads, weights))  # a trained classifier head: the data-weighted mean
        return out

    # PEFT adapters trained elsewhere (fedlora.peft_adapters): ranks may differ, the scale may not
    lora_upload = ("lora_A", "lora_B")

    def uploads_from_lora(self, clients) -> list[Payload]:
        """Each client's r_k rows of A and columns of B as they are; meta ``r_max`` = the largest client rank
        (the server's). One scale per module for every client: the factors are averaged as they are."""
        self.check_lora_clients(clients, one_rank=False)
        r_max = max(a.shape[0] for client in clients for a, _, _ in client.values())
        return [Payload({**{f"{m}.lora_A": a for m, (a, _, _) in client.items()},
                         **{f"{m}.lora_B": b for m, (_, b, _) in client.items()}}, {"r_max": str(r_max)})
                for client in clients]

    def lora_download(self, state, client) -> dict:
        """Distribution by truncation, as ``download``: the first r_k rows of A and columns of B."""
        return {m: (state[f"{m}.lora_A"][: a.shape[0]], state[f"{m}.lora_B"][:, : a.shape[0]], s)
                for m, (a, b, s) in client.items()}

    def download(self, replica: int, state: Mapping[str, torch.Tensor]) -> Payload:
        """Distribution by truncation: the first r_k rows of the global A and columns of B."""
        r = int(self.ranks[replica])
        sent = {}
        with torch.no_grad():
            for an, bn in self.pairs:
                if an not in state:
                    continue
                if state[an].shape[0] < r or state[bn].shape[1] < r:
                    raise ConfigError(f"hetlora: the server state has rank {state[an].shape[0]} < r_k = {r} of "
                                      f"replica {replica}; the server must keep rank r_max = {self.r_max}")
                a, b = state[an][:r], state[bn][:, :r]
                RankSlots.pad_into(self.params[an], self.params[bn], replica, a, b)
                sent[an], sent[bn] = a, b
            sent.update(self.download_head(replica, state))
        return Payload(sent)
