"""FlexLoRA (Bai et al. 2024; docs/design.md §4.6): heterogeneous client ranks, exact ΔW, SVD redistribution.

Per round:
1. client k trains its rank-r_k factors A_k (r_k, d_in), B_k (d_out, r_k) locally (AdamW by default,
   as LoRA-A² runs FlexLoRA as a baseline: [LoRA-A²] App. C, η = 5e-4);
2. it uploads exactly those r_k rows of A and columns of B (and its LoRA scale, see below);
3. the server forms ΔW = Σ_k w_k s_k B_k A_k exactly and takes its SVD without forming the dense
   d_out × d_in matrix (``fedlora.aggmath.flexlora``: QR of the stacked factors + SVD of the
   (Σr_k)² core, float64, robust to rank-deficient/ill-conditioned input);
4. client k receives the best rank-r_k approximation (Eckart–Young) with all of Σ on B, as the
   official code does (docs/design.md §4.6): B_k = U_{r_k} Σ_{r_k} / s, A_k = V_{r_k}ᵀ, so s B_k A_k = U_r Σ_r V_rᵀ.

Server state. Each client needs a different truncation, but the best rank-r approximations are nested
(the leading r components of the SVD), so ``aggregate`` returns, per layer, the leading
r_cap = min(max_rank, d_out, d_in) components: ``lora_B`` = U Σ (d_out, r_cap) — scale *not* applied —
and ``lora_A`` = Vᵀ (r_cap, d_in). ``download`` slices the client's first r_k columns/rows and divides B
by that client's scale. What is counted as downloaded is exactly the client's B (d_out, r_k) and
A (r_k, d_in). ``max_rank`` (the largest client rank the federation may have = the model's slot count)
travels in the upload's metadata, because clients sampled out of a round still receive the new state
and may have a larger r_k than any participant; when a client asks for more components than ΔW has,
``flexlora_aggregate`` completes A's rows orthonormally with zero B columns (exact, like a fresh init).

Scale (a decision, docs/design.md §4.6): in the paper each client uses
s_k = α/r_k. On our stacked model every replica has ``rank`` = r_max slots and the layer has one scale
s = α/rank, so **every client trains with s_k = s** (equivalently, client k's lora_alpha is
α·r_k/r_max). Aggregation and redistribution stay exact for any scales: each upload carries its layer
scale in the payload metadata and the server forms Σ_k w_k s_k B_k A_k with it; ``download`` divides by
the receiving layer's scale. Only the local training dynamics differ from per-client α/r_k scaling.
With rsLoRA (``model.use_rslora``) the rule is the same with s = α/√rank for every client
(``fedlora.adapter.lora_scale``; client k's lora_alpha is then α·√(r_k/r_max)), and the server stays exact.

Stacked replicas: each replica keeps ``rank`` slots; client k's unused slots r_k..rank−1 are held at
exactly zero (as HetLoRA's zero-padding), so their gradients vanish and the batched step equals
training a rank-r_k LoRA per client. Client ranks are fixed (no per-round method state to restore).

Optimizer: the redistribution replaces A and B by a new basis every round, so moments from the last
round refer to other coordinates; by default the optimizer is restarted at every round start, as a
client that builds its optimizer per round does (``reset_optimizer=False`` keeps the moments).
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from ..adapter import LoRALinear
from ..aggmath.flexlora import flexlora_aggregate
from ..errors import ConfigError
from ..optim import make_optimizer
from ..payload import Payload
from .base import Method, Objective, RankSlots, Sampler, register

__all__ = ["FlexLoRA"]


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@register
class FlexLoRA(Method):
    """FlexLoRA on stacked replicas.

    Args:
        rank: slots per replica = r_max, the largest client rank (≥ 1).
        lr: local step size (> 0).
        client_ranks: r_k per client k (each an integer in [1, rank]); default: all equal to ``rank``.
            Its length must equal the federation's number of clients (checked in ``setup``).
        optimizer: "adamw" (default) or "sgd".
        weight_decay: AdamW/SGD weight decay (≥ 0).
        reset_optimizer: restart the optimizer at every round start (default; see module docstring).
    """

    name = "flexlora"
    client_dp_refusal = ("its server takes an SVD of Σ p_k B_k A_k, which needs each client's own product B_k A_k")
    sample_dp_refusal = None  # local_step's private path (DP-SGD at each client's rank r_k)
    head_modes = ("frozen", "shared")

    def __init__(self, rank: int = 8, lr: float = 5e-4, client_ranks: Sequence[int] | None = None,
                 optimizer: str = "adamw", weight_decay: float = 0.0, reset_optimizer: bool = True) -> None:
        if not _is_int(rank) or rank < 1:
            raise ConfigError(f"flexlora: rank must be an integer ≥ 1, got {rank!r}")
        if not isinstance(lr, (int, float)) or not lr > 0:
            raise ConfigError(f"flexlora: lr must be > 0, got {lr!r}")
        if optimizer not in ("adamw", "sgd"):
            raise ConfigError(f"flexlora: optimizer must be 'adamw' or 'sgd', got {optimizer!r}")
        if not isinstance(weight_decay, (int, float)) or weight_decay < 0:
            raise ConfigError(f"flexlora: weight_decay must be ≥ 0, got {weight_decay!r}")
        if client_ranks is not None:
            client_ranks = list(client_ranks)
            bad = [r for r in client_ranks if not _is_int(r) or not 1 <= r <= rank]
            if bad or not client_ranks:
                raise ConfigError(f"flexlora: client_ranks must be integers in [1, rank={rank}], got {client_ranks}")
        self.rank, self.lr, self.client_ranks = rank, float(lr), client_ranks
        self.optimizer, self.weight_decay, self.reset_optimizer = optimizer, float(weight_decay), reset_optimizer

    def bind(self, model, replica_clients, n_clients=None) -> None:
        super().bind(model, replica_clients, n_clients)
        G = len(self.replica_clients)
        # one entry per adapted layer: (name prefix, A name, B name, layer scale s)
        self.layers: list[tuple[str, str, str, float]] = []
        for mod_name, mod in model.named_modules():
            if not isinstance(mod, LoRALinear):
                continue
            if mod.lora_C is not None or mod.middle:
                raise ConfigError(f"flexlora: layer {mod_name or '<root>'} must be a plain LoRA layer "
                                  "(client_rank=0, middle=False)")
            if mod.lora_A.dim() != 3 or mod.lora_A.shape[0] != G or mod.lora_A.shape[1] != self.rank:
                raise ConfigError(f"flexlora: layer {mod_name or '<root>'} must hold stacked factors "
                                  f"(G={G}, rank={self.rank}, d_in), got lora_A of shape {tuple(mod.lora_A.shape)}")
            pre = f"{mod_name}." if mod_name else ""
            self.layers.append((pre, pre + "lora_A", pre + "lora_B", float(mod.scale)))
        if not self.layers:
            raise ConfigError("flexlora: the model has no LoRALinear layer")
        ranks = self.client_ranks or [self.rank] * self.n_clients
        if len(ranks) != self.n_clients:
            raise ConfigError(f"flexlora: client_ranks has {len(ranks)} entries for {self.n_clients} clients")
        self.ranks = torch.tensor([ranks[k] for k in self.replica_clients])  # (G,)
        self.rank_slots = RankSlots(self.ranks, self.rank)
        self._new_optimizer()

    def init_state(self) -> None:
        super().init_state()  # the server's adapter to every client…
        self.rank_slots.apply(self.params, self._pairs())  # …of which client k keeps its first r_k components

    def _new_optimizer(self) -> None:
        ps = [self.params[n] for _, a, b, _ in self.layers for n in (a, b)] + [self.params[n] for n in self.head_names()]
        self.opt = make_optimizer(self.optimizer, ps, self.lr, self.weight_decay)

    def _pairs(self) -> list[tuple[str, str]]:
        return [(a, b) for _, a, b, _ in self.layers]

    def begin_round(self, round_idx: int) -> None:
        if self.reset_optimizer:
            self._new_optimizer()

    def local_step(self, objective: Objective, sample: Sampler) -> None:
        """One optimizer step of each client's rank-r_k factors (and a trained head). Under sample-level DP the
        gradient is DP-SGD's (``private_grads``): the slots r_k.. of A and B hold zeros, so their per-example
        gradients are exactly 0 and the clipping sees a rank-r_k client's norms; the noise drawn there is dropped
        (masked) before the step, so the optimizer's moments of those slots stay 0 as without DP."""
        names = [n for _, a, b, _ in self.layers for n in (a, b)] + self.head_names()
        if self.sample_dp is not None:
            batch = sample()
            grads = self.private_grads(lambda: objective(self.params, batch), names)
            self.rank_slots.apply(grads, self._pairs())
            self.opt.zero_grad(set_to_none=True)
            for n in names:
                self.params[n].grad = grads[n]
        else:
            loss = objective({n: self.params[n] for n in names}, sample()).sum()  # Σ over replicas
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
        self.opt.step()
        # unused slots get zero gradients already; masking makes "exactly zero" hold after weight decay/rounding too
        self.rank_slots.apply(self.params, self._pairs())

    def upload(self, replica: int) -> Payload:
        """Client k's r_k rows of A and columns of B per layer; meta: each layer's scale and max_rank."""
        meta = {"max_rank": str(self.rank), **{pre + "scale": repr(s) for pre, _, _, s in self.layers}}
        # a trained head is averaged with the data weights
        tensors = {**self.rank_slots.truncate(self.params, self._pairs(), replica), **self.upload_head(replica)}
        return Payload(tensors, meta)

    @staticmethod
    def aggregate(payloads: Sequence[Payload], weights: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per layer: the leading r_cap SVD components of ΔW = Σ_k w_k s_k B_k A_k.

        Returns ``{pre+"lora_B": U Σ (d_out, r_cap), pre+"lora_A": Vᵀ (r_cap, d_in)}`` with
        r_cap = min(max_rank, d_out, d_in); ΔW itself is never formed (``flexlora_aggregate``).
        """
        if not payloads:
            raise ConfigError("flexlora: aggregate needs at least one payload")
        names = set(payloads[0].tensors)
        for k, p in enumerate(payloads):
            want_meta = {"max_rank"} | {n[: -len("lora_A")] + "scale" for n in names if n.endswith("lora_A")}
            missing = sorted(want_meta - set(p.meta)) + sorted(names - set(p.tensors))
            if missing:
                raise ConfigError(f"flexlora: payload {k} lacks {missing}; every FlexLoRA upload carries the same "
                                  f"layers' lora_A/lora_B, their scales and max_rank")
        max_rank = max(int(p.meta["max_rank"]) for p in payloads)
        state: dict[str, torch.Tensor] = {}
        for a_name in [n for n in payloads[0].tensors if n.rsplit(".", 1)[-1] == "lora_A"]:
            pre = a_name[: -len("lora_A")]
            As = [p.tensors[a_name] for p in payloads]
            Bs = [p.tensors[pre + "lora_B"] for p in payloads]
            scales = [float(p.meta[pre + "scale"]) for p in payloads]
            r_cap = min(max_rank, Bs[0].shape[0], As[0].shape[1])
            # out_scales = 1: B' = U Σ unscaled; each client divides by its own s in download
            res = flexlora_aggregate(Bs, As, weights, scales, ranks_out=[r_cap], out_scales=[1.0])
            (us, vt), = res.factors
            state[pre + "lora_B"], state[a_name] = us, vt
        state.update(Method.aggregate_head(payloads, weights))  # a trained classifier head: the data-weighted mean
        return state

    # PEFT adapters trained elsewhere (fedlora.peft_adapters): ranks and scales may differ between clients
    lora_upload = ("lora_A", "lora_B")

    def uploads_from_lora(self, clients) -> list[Payload]:
        """Each client's r_k rows of A and columns of B as they are; meta: each module's scale s_k and
        ``max_rank`` = the largest client rank (the run's ``rank``, the server's)."""
        self.check_lora_clients(clients, one_rank=False, one_scale=False)
        max_rank = max(a.shape[0] for client in clients for a, _, _ in client.values())
        return [Payload({**{f"{m}.lora_A": a for m, (a, _, _) in client.items()},
                         **{f"{m}.lora_B": b for m, (_, b, _) in client.items()}},
                        {"max_rank": str(max_rank), **{f"{m}.scale": repr(float(s)) for m, (_, _, s) in client.items()}})
                for client in clients]

    def lora_download(self, state, client) -> dict:
        """As ``download``: the best rank-r_k approximation B = U_q Σ_q / s_k, A = V_qᵀ (q = min(r_k, r_cap)),
        zero-padded to the client's rank r_k, its scale kept."""
        out = {}
        for m, (a, b, s) in client.items():
            us, vt = state[f"{m}.lora_B"], state[f"{m}.lora_A"]
            r, q = a.shape[0], min(a.shape[0], us.shape[1])
            new_a, new_b = a.new_zeros(a.shape), b.new_zeros(b.shape)
            new_a[:q], new_b[:, :q] = vt[:q], us[:, :q] / s
            out[m] = (new_a, new_b, s)
        return out

    def describe_replica(self, replica: int) -> dict:
        return {"rank": int(self.ranks[replica]), "server_rank": self.rank}

    def global_replica(self, replica: int) -> None:
        """The global model is the server's ΔW at the largest rank the federation may hold."""
        self.ranks[replica] = self.rank
        self.rank_slots.set(self.ranks)

    def download(self, replica: int, state: Mapping[str, torch.Tensor]) -> Payload:
        """Write the best rank-r_k approximation into the replica: B = U_r Σ_r / s, A = V_rᵀ.

        Sent (and counted): B (d_out, q), A (q, d_in) per layer, q = min(r_k, r_cap) (q < r_k only
        when r_k > min(d_out, d_in); the surplus slots are then zero)."""
        r = int(self.ranks[replica])
        sent = {}
        with torch.no_grad():
            sent.update(self.download_head(replica, state))
            for _, a, b, s in self.layers:
                if a not in state:
                    continue
                us, vt = state[b], state[a]
                q = min(r, us.shape[1])
                new_b, new_a = us[:, :q] / s, vt[:q]
                RankSlots.pad_into(self.params[a], self.params[b], replica, new_a, new_b)
                sent[a], sent[b] = new_a, new_b
        return Payload(sent)
