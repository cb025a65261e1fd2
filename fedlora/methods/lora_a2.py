"""LoRA-A² — alternating freeze and adaptive rank selection ([LoRA-A²]; docs/design.md §4.5).

Every adapted module m holds B_m (d_out, r_G) and A_m (r_G, d_in) (stacked: leading replica dim G);
the model may hold any number N ≥ 1 of them (parameters ``<module>.lora_A`` / ``<module>.lora_B``).

Alternating freeze (Algorithm 1, 1-based t: ``t % 2 = 1`` trains B, else A). With our 0-based round
index that is :func:`fedlora.aggmath.exact.trained_factor`: **round 0, 2, … train B; round 1, 3, …
train A** (docs/design.md §4.5: we follow the algorithm, not the paper's §4.1 sentence). Round 0 must train B: B = 0 at init, so
∂L/∂A = s·Bᵀ(…) = 0 and an A-round first would not move anything. η_A = ``lr`` (App. B: AdamW,
η = 5e-4), η_B = ``lr_ratio``·η_A with ``lr_ratio`` = 5 (App. B, after LoRA+). Merge scale 16/r_G
(App. B "W_ft = W0 + 16/r ΔW"): :meth:`LoRAA2.adapter_kwargs` builds the layers with alpha = 16, and
``LoRALinear`` uses s = alpha / rank. The paper sets that α for every method it runs (a hyperparameter of its
experiments, not of the algorithm: eq. 4–6 and the aggregation never use s), so rsLoRA is allowed: s = 16/√r_G.
A client's budget r_k selects ranks of its rank-r_G adapter; its scale is the module's s = α/r_G (rsLoRA: α/√r_G)
whatever r_k, so budgets never change s.

One round of one client (Algorithm 2, eq. 4–6), the trained factor being B (A-rounds mirror it):
1. probe: ``probe_steps`` unmasked local steps from the round's start B⁰ give ΔB = B − B⁰;
2. score every rank i of every module m, S_{m,i} = ‖ΔB_m[:, i]‖·‖A_m[i, :]‖ (eq. 4; A-rounds
   ‖B_m[:, i]‖·‖ΔA_m[i, :]‖) and keep the top r_k·N scores over the whole model (§4.2; a module may
   get 0 ranks) — :func:`fedlora.aggmath.lora_a2.importance_scores` / ``select_ranks``;
3. restart from B⁰ (fresh optimizer state) and train with the delta masked to the selected ranks
   (eq. 6, "ΔB ← ΔB ⊙ M before each backpropagation"): gradients are masked and after each step
   B ← where(M, B, B⁰), which also keeps weight decay off the unselected coordinates;
4. upload only the selected columns of ΔB and their int indices (§4.2 "uploads B_k ⊙ M_k").
Server (Algorithm 1): B_new = B_saved + Σ_k w_k ΔB_k, w_k normalised over the round's participants
(Algorithm 1 normalises over all K clients' data, Σ_{k=1}^K |D_k|; we normalise over the
participants, as FedAvg does (docs/design.md §4.5), so a sampled round does not shrink the update); a
coordinate that only some clients selected gets Σ_{k selecting} w_k ΔB_k — diluted by the others'
zeros, not renormalised (docs/design.md §4.5); coordinates nobody selected stay bit-for-bit. The frozen factor is
the same broadcast tensor on every client, so the aggregate is exact: s·B_new·A = Σ_k w_k s·B_k·A.

Where the server's state lives. ``aggregate`` must be pure and gets only payloads and weights, so it
returns the dense weighted delta ``{"<module>.lora_B.delta": Σ_k w_k ΔB_k}`` (float64); the server
holds the global factors (B_saved of Algorithm 1, ``initial_server_state``) and adds the delta
(``server_update``); a client downloads the global factors that changed since it last synchronised
(the modules somebody selected), dense — no dense factor travels upwards.

Probe length (the paper's "probe epoch" is not sized; docs/design.md §4.5):
``probe_steps=None`` (default) makes the probe as long as the round's local training: the round's
``local_step`` calls run the probe, and ``end_round`` selects, restarts and runs the same number of
masked steps with the same objective and sampler (so a round costs 2× the local steps). An integer
``probe_steps=P`` instead runs P probe steps inside the round's first ``local_step`` call, after which
every ``local_step`` call is one masked step.

Client-level DP (DP-FedAvg, McMahan et al., ICLR 2018, Algorithm 1 with its fixed-denominator estimator;
``fedlora.privacy.client_dp.DenseUpdates``): the clipped update is the client's dense masked delta ΔB_k ⊙ M_k over
all modules, the Gaussian noise covers every coordinate of the round's factor at full rank r_G (noise only on the
selected ranks would reveal them), the denominator is qK for every coordinate (per-coordinate counts of selecting
clients depend on the data), and the release reaches ``aggregate`` as one upload that selected every rank
(docs/concepts/privacy.md).

Sample-level DP (our variant; the paper has no private runs): every step of the round is a DP-SGD release (Abadi
et al., CCS 2016, Alg. 1) of the round's factor — the probe step j on the step's "batch"/"noise" streams, the masked
step j on "batch.1"/"noise.1" (``SampleDP.release``): 2 releases per local step, both counted. The selection (eq. 4)
scores the probe's delta, which is then a function of released gradients only — post-processing, so the chosen
ranks (and the sparse upload's indices) are private too; the mask of eq. 6 applies to the released gradient. With
``probe_steps`` set the probe's releases are not 1 per local step, so that combination is refused.

Initial broadcast: Algorithm 1 initialises one ΔW = BA on the server; ``init_state`` (the
``Method`` default) copies each federation's first replica's A and B into its other replicas (not
counted as traffic), since exactness needs the frozen factor to be identical on all clients.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from ..aggmath.exact import trained_factor
from ..aggmath.lora_a2 import (
    SparseDelta,
    importance_scores,
    pack_upload,
    select_ranks,
    server_update,
    unpack_delta,
    upload_from_tensors,
    upload_tensors,
)
from ..errors import ConfigError
from ..optim import make_optimizer
from ..payload import Payload
from .base import Method, Objective, Sampler, register

__all__ = ["LoRAA2"]

_INDEX_DTYPES = {"int8": torch.int8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64}
_DELTA = ".delta"  # suffix of aggregate's keys: "<module>.lora_B.delta"


@register
class LoRAA2(Method):
    """LoRA-A² (see the module docstring).

    Args:
        rank: global rank r_G of every adapted module (§5.3 uses r_G = 16).
        lr: η_A, the step size of A (App. B: 5e-4); B uses η_B = ``lr_ratio``·η_A.
        lr_ratio: η_B / η_A (App. B: 5).
        client_ranks: rank budget r_k of each client k (length = number of clients), 1 ≤ r_k ≤ r_G;
            ``None`` = ``client_rank`` for everyone. A client selects r_k·N ranks over the N modules.
        client_rank: every client's budget r_k when ``client_ranks`` is not given (default r_G: no
            selection). The paper's tables give this budget as "rank r" with r_G = 16 (§5.3: "selects
            2·N ranks from a total of 16·N"), so a config's ``method.rank`` sets it.
        probe_steps: local steps of the probe that scores the ranks; ``None`` = as many as the
            round's local steps (see the module docstring).
        optimizer: 'adamw' (App. B) or 'sgd'; weight_decay: AdamW/SGD decoupled decay (0 by default;
            it never touches unselected coordinates, see step 3).
        index_dtype: integer dtype of the uploaded rank indices ('int8' … 'int64').
    """

    name = "lora-a2"
    sample_dp_refusal = None  # every probe and masked step a DP-SGD release; the selection post-processes them
    sample_dp_note = ("its probe steps and its masked steps are each a DP-SGD release on its own Poisson batch, 2 per "
                      "local step, both counted; the rank selection reads only their released deltas; "
                      "probe_steps must be left at the round's local steps")
    sample_dp_releases = 2
    client_dp_refusal = None  # its masked deltas, densified: fedlora.privacy.client_dp.DenseUpdates (below)
    rank_option = "client_rank"  # the tables' "rank r" is the client's budget; r_G stays 16
    equal_steps_per_pass = True  # end_round runs as many masked steps as the round's probe steps
    default_head = "frozen"  # App. B: "a frozen classifier is added upon the model" (Sun et al.)
    head_modes = ("frozen",)

    def __init__(self, rank: int = 16, lr: float = 5e-4, lr_ratio: float = 5.0,
                 client_ranks: Sequence[int] | None = None, probe_steps: int | None = None,
                 optimizer: str = "adamw", weight_decay: float = 0.0, index_dtype: str = "int64",
                 client_rank: int | None = None) -> None:
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise ConfigError(f"lora-a2: rank (r_G) must be an integer ≥ 1, got {rank!r}")
        if not lr > 0:
            raise ConfigError(f"lora-a2: lr (η_A) must be > 0, got {lr}")
        if not lr_ratio > 0:
            raise ConfigError(f"lora-a2: lr_ratio (η_B/η_A) must be > 0, got {lr_ratio}")
        if client_ranks is not None:
            client_ranks = list(client_ranks)
            bad = [r for r in client_ranks if not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= rank]
            if bad or not client_ranks:
                raise ConfigError(f"lora-a2: client_ranks must be integers r_k with 1 ≤ r_k ≤ rank (r_G = {rank}), "
                                  f"got {client_ranks}")
        if client_rank is not None and (not isinstance(client_rank, int) or isinstance(client_rank, bool)
                                        or not 1 <= client_rank <= rank):
            raise ConfigError(f"lora-a2: client_rank (every client's budget r_k) must be an integer with "
                              f"1 ≤ r_k ≤ rank (r_G = {rank}; set options.rank for a larger r_G), got {client_rank!r}")
        if client_rank is not None and client_ranks is not None:
            raise ConfigError("lora-a2: give client_rank (one budget for all) or client_ranks (one per client), "
                              "not both")
        if probe_steps is not None and (not isinstance(probe_steps, int) or isinstance(probe_steps, bool)
                                        or probe_steps < 1):
            raise ConfigError(f"lora-a2: probe_steps must be None (= the round's local steps) or an integer ≥ 1, "
                              f"got {probe_steps!r}")
        if optimizer not in ("adamw", "sgd"):
            raise ConfigError(f"lora-a2: optimizer must be 'adamw' or 'sgd', got {optimizer!r}")
        if not weight_decay >= 0:
            raise ConfigError(f"lora-a2: weight_decay must be ≥ 0, got {weight_decay}")
        if index_dtype not in _INDEX_DTYPES:
            raise ConfigError(f"lora-a2: index_dtype must be one of {sorted(_INDEX_DTYPES)}, got {index_dtype!r}")
        if rank - 1 > torch.iinfo(_INDEX_DTYPES[index_dtype]).max:
            raise ConfigError(f"lora-a2: index_dtype {index_dtype} cannot hold rank index {rank - 1}")
        self.rank, self.lr, self.lr_ratio = rank, lr, lr_ratio
        self.client_ranks, self.probe_steps, self.client_rank = client_ranks, probe_steps, client_rank
        self.sample_dp_refusal = type(self).sample_dp_refusal_for({"probe_steps": probe_steps})
        self.optimizer, self.weight_decay = optimizer, weight_decay
        self.index_dtype = _INDEX_DTYPES[index_dtype]
        self._factor: str | None = None  # factor the current / last round trains

    def step_sizes(self) -> dict[str, dict[str, Any]]:
        """η_A and η_B = lr_ratio·η_A (App. B)."""
        return {"lr": {"optimizer": self.optimizer, "lr": float(self.lr)},
                "lr·lr_ratio (B)": {"optimizer": self.optimizer, "lr": float(self.lr * self.lr_ratio)}}

    def adapter_kwargs(self) -> dict[str, Any]:
        """Rank r_G with alpha = 16, i.e. s = 16 / r_G (App. B merge scale)."""
        return {"rank": self.rank, "alpha": 16.0}

    # set-up ----------------------------------------------------------------------------------
    def bind(self, model, replica_clients, n_clients=None) -> None:
        super().bind(model, replica_clients, n_clients)
        G = len(self.replica_clients)
        a_names, b_names = self._names("lora_A"), self._names("lora_B")
        if not a_names:
            raise ConfigError("lora-a2: the model has no LoRA factors (no parameter named '*.lora_A')")
        # modules: prefix → (A name, B name); model order is select_ranks' tie-break order
        self.modules: dict[str, tuple[str, str]] = {}
        for a in a_names:
            prefix = a[: -len("lora_A")]
            b = prefix + "lora_B"
            if b not in b_names:
                raise ConfigError(f"lora-a2: {a!r} has no matching {b!r}")
            A, B = self.params[a], self.params[b]
            if A.dim() != 3 or B.dim() != 3 or A.shape[0] != G or B.shape[0] != G:
                raise ConfigError(f"lora-a2: {a!r}/{b!r} must be stacked over the {G} replicas, got "
                                  f"{tuple(A.shape)} and {tuple(B.shape)}")
            if A.shape[1] != self.rank or B.shape[2] != self.rank:
                raise ConfigError(f"lora-a2: module {prefix.rstrip('.') or '<root>'!r} has rank {A.shape[1]}, "
                                  f"the method was built for rank r_G = {self.rank}")
            self.modules[prefix] = (a, b)
        ranks = self.client_ranks or [self.client_rank or self.rank] * self.n_clients
        if len(ranks) != self.n_clients:
            raise ConfigError(f"lora-a2: client_ranks has {len(ranks)} entries for {self.n_clients} clients")
        self.budgets = [ranks[k] for k in self.replica_clients]  # r_k of each replica
        groups = [{"params": [self.params[a] for a, _ in self.modules.values()], "lr": self.lr},
                  {"params": [self.params[b] for _, b in self.modules.values()], "lr": self.lr * self.lr_ratio}]
        self.opt = make_optimizer(self.optimizer, groups, self.lr, self.weight_decay)
        # selected ranks of the last round: module prefix → (G, r_G) bool
        dev = self.params[next(iter(self.modules.values()))[0]].device
        self.masks = {m: torch.zeros(G, self.rank, dtype=torch.bool, device=dev) for m in self.modules}
        self._start: dict[str, torch.Tensor] = {}
        self._factor = None
        self._selected, self._n_probe = False, 0
        self._objective = self._sample = None

    # the round -------------------------------------------------------------------------------
    def _trained(self) -> list[str]:
        i = 1 if self._factor == "B" else 0
        return [ab[i] for ab in self.modules.values()]

    def _frozen(self) -> list[str]:
        i = 0 if self._factor == "B" else 1
        return [ab[i] for ab in self.modules.values()]

    def begin_round(self, round_idx: int) -> None:
        self._factor = trained_factor(round_idx)
        # local training starts afresh from the download each round (Alg. 2 "B_k ← B^(t)")
        self._start = {n: self.params[n].detach().clone() for n in self._trained()}
        self.opt.state.clear()
        self._selected = False
        self._n_probe = 0
        self._objective = self._sample = None

    def _mask(self, name: str, prefix: str) -> torch.Tensor:
        """The (G, r) rank mask of ``prefix`` broadcast to factor ``name``'s (G, ·, ·) shape."""
        m = self.masks[prefix].to(self.params[name].dtype)
        return m[:, None, :] if self._factor == "B" else m[:, :, None]

    @classmethod
    def sample_dp_refusal_for(cls, options: Mapping[str, Any]) -> str | None:
        if options.get("probe_steps") is not None:
            return ("probe_steps set: its probe takes a number of DP-SGD releases other than the round's local steps "
                    "(the accountant counts 2 per local step); leave probe_steps unset")
        return None

    def _step(self, objective: Objective, sample: Sampler, masked: bool) -> None:
        """One step on the round's factor, masked to the selected ranks after the probe (eq. 6). Under sample-level
        DP its gradient is DP-SGD's — per-example gradients of the whole factor clipped, noised, / q·n_k — and the
        mask applies to that release (post-processing), so the selection (eq. 4, from the probe's deltas) reads only
        released values: the probe steps are release 0 of each local step, the masked ones release 1 (``end_round``)."""
        if self._factor is None:
            raise ConfigError("lora-a2: begin_round must be called before local_step")
        trained, frozen = self._trained(), self._frozen()
        # the frozen factor enters detached: its .grad stays None, so the optimizer skips it
        params = {n: self.params[n] for n in trained} | {n: self.params[n].detach() for n in frozen}
        self.opt.zero_grad(set_to_none=True)
        if self.sample_dp is not None:
            batch = sample()
            private = self.private_grads(lambda: objective(params, batch), trained)
            for n in trained:
                self.params[n].grad = private[n]
        else:
            loss = objective(params, sample()).sum()  # replicas are independent: Σ keeps gradients apart
            loss.backward()
        if masked:
            for prefix, n in zip(self.modules, trained):
                if self.params[n].grad is not None:
                    self.params[n].grad.mul_(self._mask(n, prefix))
        self.opt.step()
        if masked:  # eq. 6: the delta lives on the selected ranks only (exact, even with weight decay)
            with torch.no_grad():
                for prefix, n in zip(self.modules, trained):
                    p = self.params[n]
                    p.copy_(torch.where(self._mask(n, prefix) > 0, p, self._start[n]))

    @torch.no_grad()
    def _select_and_restart(self) -> None:
        """Score (eq. 4), pick the top r_k·N ranks per replica (§4.2), go back to the round start."""
        trained, frozen = self._trained(), self._frozen()
        for i, budget in enumerate(self.budgets):
            deltas = {n: self.params[n][i] - self._start[n][i] for n in trained}
            fro = {t: self.params[f][i] for t, f in zip(trained, frozen)}
            sel = select_ranks(importance_scores(deltas, fro, self._factor), budget)
            for prefix, n in zip(self.modules, trained):
                self.masks[prefix][i] = False
                self.masks[prefix][i, sel[n]] = True
        for n in trained:
            self.params[n].copy_(self._start[n])
        self.opt.state.clear()
        self._selected = True

    def local_step(self, objective: Objective, sample: Sampler) -> None:
        if self.probe_steps is None:  # this call is a probe step; the masked ones run in end_round
            self._step(objective, sample, masked=False)
            self._n_probe += 1
            self._objective, self._sample = objective, sample
            return
        if not self._selected:
            for _ in range(self.probe_steps):
                self._step(objective, sample, masked=False)
            self._select_and_restart()
        self._step(objective, sample, masked=True)

    def end_round(self, round_idx: int) -> None:
        if self.probe_steps is None:
            if self._n_probe == 0:
                raise ConfigError("lora-a2: a round needs at least one local_step")
            self._select_and_restart()
            for j in range(self._n_probe):
                if self.sample_dp is not None:  # its own Poisson batch and noise: release 1 of local step j
                    self.sample_dp.at(round_idx, j, release=1)
                self._step(self._objective, self._sample, masked=True)
            self._objective = self._sample = None  # do not keep the caller's data alive
        # the round's moments die with it (begin_round starts afresh): a client's record carries none, so
        # it does not depend on which factor the client last trained or on what else its process trained
        self.opt.state.clear()

    def describe_replica(self, replica: int) -> dict:
        """r_G, the client's budget r_k, and the ranks it selected this round over all N modules
        (Σ = r_k·N; a module may get none)."""
        sel = {m.rstrip(".") or "<root>": int(v[replica].sum()) for m, v in self.masks.items()}
        return {"rank": self.rank, "budget": int(self.budgets[replica]), "selected": sum(sel.values()),
                "selected_per_module": sel}

    # client sampling ------------------------------------------------------------------------
    def _extra_state(self) -> dict[str, torch.Tensor]:
        return {f"mask:{m}": v.clone() for m, v in self.masks.items()}

    def _restore_extra_state(self, extra: Mapping[str, torch.Tensor], idx: torch.Tensor) -> None:
        for m in self.masks:
            self.masks[m][idx] = extra[f"mask:{m}"][idx]

    # communication ----------------------------------------------------------------------------
    def upload(self, replica: int) -> Payload:
        """Selected columns of ΔB (rows of ΔA) and their indices, per module that got ≥ 1 rank.

        Tensors ``<module>.lora_B.values`` (d_out, n_sel) / ``.indices`` (n_sel,); meta: the factor
        and r_G (the server needs r_G to rebuild the dense shape)."""
        if self._factor is None or not self._start:
            raise ConfigError("lora-a2: upload needs a finished round")
        trained = self._trained()
        deltas = {n: (self.params[n][replica] - self._start[n][replica]).detach() for n in trained}
        sel = {n: torch.nonzero(self.masks[p][replica]).flatten() for p, n in zip(self.modules, trained)}
        packed = pack_upload(deltas, sel, self._factor, index_dtype=self.index_dtype)
        packed = {n: sd for n, sd in packed.items() if sd.indices.numel()}
        return Payload(upload_tensors(packed), {"factor": self._factor, "rank": str(self.rank)})

    @staticmethod
    def aggregate(payloads: Sequence[Payload], weights: torch.Tensor) -> dict[str, torch.Tensor]:
        """Σ_k w_k ΔB_k per module (float64, dense (d_out, r_G) / (r_G, d_in)), keyed
        ``"<module>.lora_B.delta"``; ``server_update`` adds it to B_saved (Algorithm 1). Modules no client
        selected are absent (their delta is 0). Pure: built on ``aggmath.lora_a2.server_update``."""
        if not payloads:
            raise ConfigError("lora-a2 aggregate: need at least one payload")
        factors = {p.meta.get("factor") for p in payloads}
        ranks = {p.meta.get("rank") for p in payloads}
        if len(factors) != 1 or len(ranks) != 1 or None in factors or None in ranks:
            raise ConfigError(f"lora-a2 aggregate: payloads must share one factor and rank in their meta, "
                              f"got factors {factors} and ranks {ranks}")
        factor, r = factors.pop(), int(ranks.pop())
        shapes: dict[str, tuple[int, int]] = {}
        for p in payloads:
            for key, v in p.tensors.items():
                if key.endswith(".values"):
                    shape = (int(v.shape[0]), r) if factor == "B" else (r, int(v.shape[1]))
                    if shapes.setdefault(key[: -len(".values")], shape) != shape:
                        raise ConfigError(f"lora-a2 aggregate: {key!r} has inconsistent shapes across clients")
        uploads = [upload_from_tensors(p.tensors, shapes, factor) for p in payloads]
        zero = {m: torch.zeros(s, dtype=torch.float64) for m, s in shapes.items()}
        delta = server_update(zero, uploads, weights, factor)  # 0 + Σ_k w_k ΔB_k, diluted
        return {m + _DELTA: d for m, d in delta.items()}

    # client-level DP (fedlora.privacy.client_dp.DenseUpdates) --------------------------------
    # DP-FedAvg (McMahan et al., ICLR 2018, Algorithm 1, the fixed-denominator estimator f̃_f) over Algorithm 1 of
    # [LoRA-A²]'s server step B ← B_saved + Σ_k w_k ΔB_k: with w_k = 1/(qK) and ΔB_k clipped, the private release is
    # B_saved + (Σ_k clip(ΔB_k ⊙ M_k) + N(0, σ²C² I)) / (qK), the noise on every coordinate of B at full rank r_G
    # (docs/concepts/privacy.md, "LoRA-A²").
    @staticmethod
    def client_dp_space(reference: Mapping[str, torch.Tensor], round_idx: int) -> dict[str, torch.Tensor]:
        """Every coordinate of round ``round_idx``'s trained factor (``trained_factor``: B on even rounds), every
        module, full rank r_G: name → float64 zeros shaped like the server's factor ((d_out, r_G) / (r_G, d_in)).
        The whole factor, not the ranks the clients selected: a release noised only there would reveal them."""
        leaf = "lora_" + trained_factor(round_idx)
        space = {n: torch.zeros(tuple(v.shape), dtype=torch.float64) for n, v in reference.items() if n.endswith(leaf)}
        if not space:
            raise ConfigError(f"lora-a2 client-level DP: the server holds no {leaf} factor to release round "
                              f"{round_idx + 1}'s update over (its state has {sorted(reference)[:4]})")
        return space

    @staticmethod
    def client_dp_update(upload: Payload, space: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The client's dense masked delta ΔB_k ⊙ M_k (eq. 6) over every factor of ``space`` (float64, zero off its
        selected ranks and in the modules it selected none of)."""
        factor = upload.meta.get("factor")
        if factor is None or not all(n.endswith("lora_" + factor) for n in space):
            raise ConfigError(f"lora-a2 client-level DP: an upload of factor {factor!r} in a round that releases "
                              f"{sorted(space)[:2]}…; every upload of a round carries that round's factor")
        dense = {n: z.clone() for n, z in space.items()}
        for m, sd in upload_from_tensors(upload.tensors, {n: z.shape for n, z in space.items()}, factor).items():
            dense[m] = unpack_delta(sd, dtype=torch.float64)
        return dense

    def client_dp_release(self, mean: Mapping[str, torch.Tensor], round_idx: int) -> Payload:
        """The private mean update as one upload that selected every rank of every module (indices 0..r_G−1), so
        ``aggregate([it], [1])`` returns it as the round's Σ_k w_k ΔB_k, which ``server_update`` adds to B_saved."""
        factor = trained_factor(round_idx)
        packed = {}
        for n, v in mean.items():
            r = int(v.shape[1] if factor == "B" else v.shape[0])
            packed[n] = SparseDelta(v, torch.arange(r, dtype=torch.int64), factor, (int(v.shape[0]), int(v.shape[1])))
        return Payload(upload_tensors(packed), {"factor": factor, "rank": str(self.rank)})

    # the server ------------------------------------------------------------------------------
    def initial_server_state(self, replica: int) -> dict[str, torch.Tensor]:
        """Algorithm 1's initial global factors (the broadcast A and B of every module)."""
        return {n: self.params[n][replica].detach().clone() for ab in self.modules.values() for n in ab}

    def server_update(self, state: Mapping[str, torch.Tensor], aggregated: Mapping[str, torch.Tensor]
                      ) -> dict[str, torch.Tensor]:
        """Algorithm 1: B ← B_saved + Σ_k w_k ΔB_k (float64 sum, stored in the factor's dtype) for
        the modules in ``aggregated``; the others keep their tensors (nothing changed, nothing sent)."""
        new = dict(state)
        for key, d in aggregated.items():
            n = key[: -len(_DELTA)]
            if not key.endswith(_DELTA) or n not in state:
                raise ConfigError(f"lora-a2 server: unexpected aggregate entry {key!r}")
            old = state[n]
            new[n] = (old.to(torch.float64) + d.to(device=old.device, dtype=torch.float64)).to(old.dtype)
        return new

    def download(self, replica: int, state: Mapping[str, torch.Tensor]) -> Payload:
        """Write the server's global factors in ``state`` (those that changed since the client last
        synchronised) into the replica; what is sent is exactly those dense factors."""
        with torch.no_grad():
            for n, v in state.items():
                if n not in self.params or not n.endswith(("lora_A", "lora_B")):
                    raise ConfigError(f"lora-a2 download: unexpected state entry {n!r}")
                self.params[n][replica] = v
        return Payload(dict(state))
