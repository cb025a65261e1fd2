"""Sample-level DP-SGD on the clients (issue 29 item 2): Poisson-sampled batches, per-sample LoRA gradients from
each adapted layer's input and output gradient, joint clipping, Gaussian noise from the client's own generator.

Abadi, Chu, Goodfellow, McMahan, Mironov, Talwar, Zhang, "Deep Learning with Differential Privacy" (CCS 2016),
Algorithm 1, per client k and local step t:

1. a batch L_t drawn by Poisson sampling: each of the client's n_k training rows is in it with probability q,
   independently (so |L_t| varies, and may be 0);
2. every example's gradient g_i over ALL the tensors the step trains (every adapted layer's trained factors and
   a trained classifier head) clipped jointly to L2 norm C (``fedlora.privacy.clipping.clip_per_sample``);
3. g̃ = (Σ_{i ∈ L_t} clip(g_i) + N(0, σ²C² I)) / (q·n_k) — the EXPECTED batch size in the denominator (the
   fixed-denominator estimator: unbiased, and the sensitivity C/(q·n_k) does not depend on the realised
   batch), then the method's optimizer step on g̃.

Per-sample gradients: a LoRA layer y = x W₀ᵀ + s (x Aᵀ) Bᵀ has dAᵢ = s Σ_t (g_t B)ᵀ x_t and dBᵢ = s Σ_t g_tᵀ (x_t Aᵀ)
(``per_sample_lora_grads``: rank-r einsums, never a d_out × d_in matrix per example), and a client adapter
s₂ (x Cᵀ) Dᵀ (FedDPA's local adapter) the same with (C, D, s₂); a trained linear head has
dWᵢ = Σ_t g_tᵀ x_t and dbᵢ = Σ_t g_t. The layers record their input x and output y during the forward only
inside ``capture`` (``LoRALinear.dp_capture``, None otherwise: no work when DP is off); one
``torch.autograd.grad`` of the per-slot SUMMED losses with respect to those outputs gives every g. With S clients
in one pass (slots), slot p's rows only reach slot p's adapters, so each slot is clipped, summed and noised on
its own: a client's update does not depend on its pass-mates.

Randomness: client k's batch draw and its noise at round t, local step j come from two generators seeded by
``seed_of(seed, DP_SAMPLE, kind, k, t, j)`` — a fresh stream per (client, round, step), so nothing needs saving
and a run resumed at a round boundary draws the same numbers, whichever clients share a pass.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.autograd.forward_ad as fwAD
from torch import nn

from fedlora.adapter import Capture, LoRALinear  # Capture: what a layer records of its forward (re-exported here)
from fedlora.errors import ConfigError
from fedlora.seeds import DP_SAMPLE, seed_of

from .clipping import check_clip_norm, clip_per_sample, gaussian_noise_like, per_sample_lora_grads

__all__ = ["SampleDP", "Capture", "capture", "per_sample_grads", "per_example_gradients", "per_example_directional",
           "privatise", "private_gradients", "private_difference", "private_directional", "private_weight_gradients",
           "DP_MASK"]

#: the batch entry (S·b,) of 1.0 for a real row and 0.0 for a padded one (the slot executor's Poisson batches)
DP_MASK = "dp_mask"


class SampleDP:
    """The settings and random streams of sample-level DP-SGD (one object per run).

    Args:
        clip_norm: C > 0, the per-example clipping norm over all trained tensors jointly.
        noise_multiplier: σ ≥ 0; the noise added to a step's clipped sum has std σ·C per coordinate.
        sampling_rate: Poisson rate q ∈ (0, 1] — one number for every client, or one per client (a sequence
            indexed by client, or a mapping client → q).
        seed: the run's seed (≥ 0); every stream is ``seed_of(seed, DP_SAMPLE, kind, client, round, step)``.

    Before each local step the runtime calls ``at(round, step)``; ``set_client_sizes`` gives n_k (the expected
    batch size is q·n_k).
    """

    def __init__(self, clip_norm, noise_multiplier, sampling_rate, seed: int = 0) -> None:
        self.clip_norm = check_clip_norm(clip_norm, "sample-level DP clip_norm")
        s = noise_multiplier
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s < 0:
            raise ConfigError(f"sample-level DP noise_multiplier must be a finite number ≥ 0, got {s!r}")
        self.noise_multiplier = float(s)
        if isinstance(sampling_rate, Mapping):
            rates = {k: _check_rate(v) for k, v in sampling_rate.items()}
        elif isinstance(sampling_rate, (list, tuple)):
            rates = {k: _check_rate(v) for k, v in enumerate(sampling_rate)}
        else:
            rates = _check_rate(sampling_rate)
        self.sampling_rate = rates
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ConfigError(f"sample-level DP seed must be an integer ≥ 0, got {seed!r}")
        self.seed = seed
        self.round: int | None = None
        self.step: int | None = None
        #: which of the step's DP-SGD releases the coming draws are for (``release``; 0: the first, and the only one
        #: of every method but private Per-FedAvg, whose step releases its inner and its meta gradient)
        self.part = 0
        self.client_sizes: dict[int, int] = {}
        #: the synthetic testbed's stacked federations: the seed of each slot's (replica's) federation, which then
        #: keys that slot's streams instead of ``seed`` (``set_slot_seeds``); None: every slot uses ``seed``
        self.slot_seeds: list[int] | None = None
        #: the id each client's streams are keyed by, where it differs from the client's own (``set_stream_ids``):
        #: a group of a run of heterogeneous client models numbers its clients 0..K_g−1, keyed by their run ids
        self.stream_ids: dict[int, int] | None = None
        #: a diagnostic's hook, None in every run: ``privatise`` calls ``observe(round, client, per)`` with each slot's
        #: per-example gradients (name → (n, *shape)) BEFORE clipping — what the clipping sees. Not private: a
        #: function of every example (``bench/dp_grad_norms.py`` uses it to choose C on public or proxy data)
        self.observe: Callable[[int, int, dict[str, torch.Tensor]], None] | None = None

    def __repr__(self) -> str:
        return (f"SampleDP(clip_norm={self.clip_norm!r}, noise_multiplier={self.noise_multiplier!r}, "
                f"sampling_rate={self.sampling_rate!r}, seed={self.seed!r})")

    # position and sizes -------------------------------------------------------------------------------
    def at(self, rnd: int, step: int, release: int = 0) -> None:
        """The coming draws are local step ``step`` (0-based) of round ``rnd``, its release ``release`` (``release``;
        a method's later phase positions its own step j's release 1 so): what the draws are keyed by."""
        for name, v in (("round", rnd), ("step", step)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"sample-level DP: the {name} must be an integer ≥ 0, got {v!r}")
        self.round, self.step = rnd, step
        self.release(release)

    def release(self, part: int) -> None:
        """The coming draws (batch and noise) are the current step's ``part``-th DP-SGD release (0-based; ``at``
        starts each step at 0): a step that releases several private gradients (Per-FedAvg's inner and meta
        gradients) keys each one's Poisson batch and noise apart — independent draws, as separate steps' are. The
        accountant then counts that many releases per step (``Method.sample_dp_releases``)."""
        if isinstance(part, bool) or not isinstance(part, int) or part < 0:
            raise ConfigError(f"sample-level DP: a release index is an integer ≥ 0, got {part!r}")
        if self.round is None:
            raise ConfigError("sample-level DP: no local step is positioned (the runtime calls at(round, step) "
                              "before each step)")
        self.part = part

    def set_client_sizes(self, sizes: Sequence[int] | Mapping[int, int]) -> None:
        """n_k of every client (its number of training rows; a sequence by client or a mapping)."""
        items = sizes.items() if isinstance(sizes, Mapping) else enumerate(sizes)
        out = {}
        for k, n in items:
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ConfigError(f"sample-level DP: client {k} has {n!r} training rows; at least 1 is needed")
            out[int(k)] = n
        self.client_sizes = out

    def set_slot_seeds(self, seeds: Sequence[int] | None) -> None:
        """Several federations stacked in one model (the synthetic testbed, ``fedlora.simulator``): slot p's streams
        are ``seed_of(seeds[p], DP_SAMPLE, kind, client, round, step)`` — keyed by its federation's seed, so replicas
        of the same client in different federations draw independent batches and noise, and a federation draws the
        same numbers whichever others share the stack. None: every slot uses ``seed``."""
        if seeds is not None:
            seeds = list(seeds)
            for v in seeds:
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise ConfigError(f"sample-level DP: a federation's seed must be an integer ≥ 0, got {v!r}")
        self.slot_seeds = seeds

    def set_stream_ids(self, ids: Mapping[int, int] | None) -> None:
        """Key client k's streams by ``ids[k]`` instead of k (None: by k): a run of heterogeneous client models gives
        each group's executor its clients' run-wide ids, so no two clients of the run share a batch or noise stream."""
        if ids is not None:
            ids = {int(k): int(v) for k, v in ids.items()}
            if len(set(ids.values())) != len(ids) or any(v < 0 for v in ids.values()):
                raise ConfigError(f"sample-level DP: stream ids must be distinct integers ≥ 0, got {ids}")
        self.stream_ids = ids

    def slot_seed(self, slot: int) -> int:
        """The seed that keys slot ``slot``'s streams (``set_slot_seeds``; ``seed`` by default)."""
        if self.slot_seeds is None:
            return self.seed
        if not 0 <= slot < len(self.slot_seeds):
            raise ConfigError(f"sample-level DP: slot {slot} has no federation seed ({len(self.slot_seeds)} given)")
        return self.slot_seeds[slot]

    def rate(self, client: int) -> float:
        """q of ``client``."""
        if isinstance(self.sampling_rate, dict):
            if client not in self.sampling_rate:
                raise ConfigError(f"sample-level DP: no sampling rate for client {client} (rates given for clients "
                                  f"{sorted(self.sampling_rate)[:8]})")
            return self.sampling_rate[client]
        return self.sampling_rate

    def expected_batch_size(self, client: int) -> float:
        """q·n_k: the denominator of the client's private gradient."""
        if client not in self.client_sizes:
            raise ConfigError(f"sample-level DP: the size of client {client} is unknown (set_client_sizes)")
        return self.rate(client) * self.client_sizes[client]

    # streams -------------------------------------------------------------------------------------------
    def generator(self, kind: str, client: int, device: torch.device | str = "cpu",
                  seed: int | None = None) -> torch.Generator:
        """Client ``client``'s generator of ``kind`` ("batch" or "noise") at the current (round, step); ``seed``:
        its federation's (``slot_seed``), default the run's."""
        if kind not in ("batch", "noise"):
            raise ConfigError(f"sample-level DP: a stream is 'batch' or 'noise', got {kind!r}")
        if self.round is None:
            raise ConfigError("sample-level DP: no local step is positioned (the runtime calls at(round, step) "
                              "before each step)")
        key = kind if self.part == 0 else f"{kind}.{self.part}"  # the first release keeps the streams it always had
        who = int(client) if self.stream_ids is None else self.stream_ids.get(int(client), int(client))
        return torch.Generator(device=device).manual_seed(
            seed_of(self.seed if seed is None else seed, DP_SAMPLE, key, who, self.round, self.step))

    def poisson_rows(self, client: int, n: int, seed: int | None = None) -> torch.Tensor:
        """The positions (sorted, int64) in 0..n−1 of the rows in client ``client``'s batch at the current step:
        each independently with probability q (one uniform per row from the client's "batch" stream; ``seed`` as
        ``generator``)."""
        u = torch.rand(n, generator=self.generator("batch", client, seed=seed), dtype=torch.float64)
        return torch.nonzero(u < self.rate(client)).reshape(-1)

    def noise_like(self, tensors: Mapping[str, torch.Tensor], client: int,
                   seed: int | None = None) -> dict[str, torch.Tensor]:
        """N(0, σ²C²) shaped like ``tensors`` from client ``client``'s "noise" stream at the current step (names in
        sorted order, ``gaussian_noise_like``); zeros when σ = 0."""
        some = next(iter(tensors.values()))
        return gaussian_noise_like(tensors, self.noise_multiplier * self.clip_norm,
                                   self.generator("noise", client, some.device, seed))


def _check_rate(q) -> float:
    if isinstance(q, bool) or not isinstance(q, (int, float)) or not math.isfinite(q) or not 0 < q <= 1:
        raise ConfigError(f"sample-level DP sampling_rate must be a number in (0, 1], got {q!r}")
    return float(q)


def _capturing(model: nn.Module) -> list[nn.Module]:
    out = [m for m in model.modules() if isinstance(m, LoRALinear) or hasattr(m, "head_weight")]
    return out


@contextmanager
def capture(model: nn.Module) -> Iterator[list[Capture]]:
    """Within the block every adapter layer (``LoRALinear``, ``SlotLoRALinear``) and trained head (``SlotHead``) of
    ``model`` appends a ``Capture`` of each forward to the yielded list; afterwards they record nothing again."""
    records: list[Capture] = []
    mods = _capturing(model)
    for m in mods:
        m.dp_capture = records
    try:
        yield records
    finally:
        for m in mods:
            m.__dict__.pop("dp_capture", None)  # back to the class's None


def _module_prefixes(model: nn.Module) -> dict[int, str]:
    return {id(m): (n + "." if n else "") for n, m in model.named_modules()}


def _keep_tangent(t: torch.Tensor) -> torch.Tensor:
    """``t`` without its autograd graph but with its forward-mode tangent, if it has one (``detach`` drops both)."""
    primal, tangent = fwAD.unpack_dual(t)
    return primal.detach() if tangent is None else fwAD.make_dual(primal.detach(), tangent.detach())


def per_sample_grads(records: Sequence[Capture], grads_out: Sequence[torch.Tensor | None], names: Sequence[str],
                     model: nn.Module, slots: int, keep_tangents: bool = False) -> dict[str, torch.Tensor]:
    """Per-example gradients of the parameters ``names``: name → (S, n, *shape) from the captured forwards and the
    gradients ``grads_out`` of the SUMMED loss with respect to each capture's output (None: the output was not
    used). A parameter reached by several forwards (a shared layer) gets the sum. A name no capture covers is a
    one-line ``ConfigError``. ``keep_tangents``: inside a forward-mode dual level the captured inputs and factors
    keep their tangents, so each result's tangent is the derivative of that example's gradient along them
    (``per_example_directional``)."""
    detach = _keep_tangent if keep_tangents else torch.Tensor.detach
    prefixes = _module_prefixes(model)
    wanted = set(names)
    out: dict[str, torch.Tensor] = {}

    def add(name: str, t: torch.Tensor) -> None:
        out[name] = t if name not in out else out[name] + t

    for rec, g in zip(records, grads_out):
        pre = prefixes.get(id(rec.module))
        if pre is None:
            raise ConfigError("sample-level DP: a captured layer is not part of the model being trained")
        if g is None:
            g = torch.zeros_like(rec.y)
        x, gy = rec.per_example(detach(rec.x), slots), rec.per_example(g, slots)
        if rec.A is not None and rec.R is not None:  # TriLoRA (H²Tune): ΔW = s·B·M·A, M = I + (Φ ⊙ Ω^sup) ⊙ R
            for name, t in _per_sample_middle(rec, x, gy, pre, wanted, slots, detach).items():
                add(name, t)
        elif rec.A is not None:  # a LoRA layer: its adapter (A, B) and, where it has one, its client adapter (C, D)
            for down, up, D_, U_, scale in (("lora_A", "lora_B", rec.A, rec.B, rec.module.scale),
                                            ("lora_C", "lora_D", rec.C, rec.D, getattr(rec.module, "client_scale", 0))):
                d_name, u_name = pre + down, pre + up
                if D_ is None or not (d_name in wanted or u_name in wanted):
                    continue
                D_, U_ = detach(D_), detach(U_)
                if D_.dim() == 2:
                    D_, U_ = D_.unsqueeze(0), U_.unsqueeze(0)
                dds, dus = zip(*(per_sample_lora_grads(x[p], gy[p], D_[p], U_[p], scale) for p in range(slots)))
                if d_name in wanted:
                    add(d_name, torch.stack(dds))
                if u_name in wanted:
                    add(u_name, torch.stack(dus))
        else:  # a trained linear head: dW_i = Σ_t g_tᵀ x_t, db_i = Σ_t g_t
            w_name, b_name = pre + "head_weight", pre + "head_bias"
            if w_name in wanted:
                add(w_name, torch.einsum("snto,sntd->snod", gy, x))
            if b_name in wanted:
                add(b_name, gy.sum(2))
    missing = [n for n in names if n not in out]
    if missing:
        raise ConfigError(f"sample-level DP: no per-sample gradient for {missing[0]!r} (only LoRA factors of "
                          "adapter layers and a trained linear head can be trained privately)")
    return out


def _per_sample_middle(rec: Capture, x: torch.Tensor, gy: torch.Tensor, pre: str, wanted: set, slots: int,
                       detach: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.detach) -> dict[str, torch.Tensor]:
    """Per-example gradients of a TriLoRA layer y = x W₀ᵀ + s·x Aᵀ Mᵀ Bᵀ, M = I + (Φ ⊙ Ω^sup) ⊙ R ([H²Tune] eq. 3;
    Ω^sup the layer's ``middle_mask``): A's and B's are LoRA's with B·M and M·A in place of B and A
    (``per_sample_lora_grads``), and dMᵢ = s·Σₜ (gₜB)ᵀ(xₜAᵀ) (r × r, from the same rank-r products) gives
    dRᵢ = dMᵢ ⊙ Φ ⊙ Ω^sup and dΦᵢ = dMᵢ ⊙ R ⊙ Ω^sup. ``x``, ``gy``: (S, n, T, d). Returns name → (S, n, *shape) for
    the wanted names among ``pre`` + lora_A, lora_B, lora_R, lora_Phi."""
    names = {leaf: pre + leaf for leaf in ("lora_A", "lora_B", "lora_R", "lora_Phi")}
    if not wanted & set(names.values()):
        return {}
    A, B, R, Phi = (detach(t) for t in (rec.A, rec.B, rec.R, rec.Phi))
    mask = rec.module.middle_mask.to(R.dtype)
    if A.dim() == 2:
        A, B, R, Phi = A.unsqueeze(0), B.unsqueeze(0), R.unsqueeze(0), Phi.unsqueeze(0)
    if mask.dim() == 2:
        mask = mask.unsqueeze(0)
    s = rec.module.scale
    eye = torch.eye(R.shape[-1], dtype=R.dtype, device=R.device)
    out: dict[str, list[torch.Tensor]] = {n: [] for n in names.values() if n in wanted}
    for p in range(slots):
        M = eye + Phi[p] * mask[p] * R[p]
        da, db = per_sample_lora_grads(x[p], gy[p], M @ A[p], B[p] @ M, s)
        if names["lora_A"] in out:
            out[names["lora_A"]].append(da)
        if names["lora_B"] in out:
            out[names["lora_B"]].append(db)
        if names["lora_R"] in out or names["lora_Phi"] in out:
            dm = s * torch.einsum("ntr,ntq->nrq", gy[p] @ B[p], x[p] @ A[p].transpose(0, 1))  # (n, r, r)
            if names["lora_R"] in out:
                out[names["lora_R"]].append(dm * (Phi[p] * mask[p]))
            if names["lora_Phi"] in out:
                out[names["lora_Phi"]].append(dm * (R[p] * mask[p]))
    return {n: torch.stack(v) for n, v in out.items()}


def _output_grads(model: nn.Module, losses_fn: Callable[[], torch.Tensor], slots: int
                  ) -> tuple[list[Capture], Sequence[torch.Tensor | None]]:
    """Run ``losses_fn`` with the layers recording (``capture``); the captures whose output is in the graph and the
    gradient of the summed losses with respect to each output."""
    with capture(model) as records:
        losses = losses_fn()
    if losses.shape != (slots,):
        raise ConfigError(f"sample-level DP: the objective must give one summed loss per slot ({slots}), got shape "
                          f"{tuple(losses.shape)}")
    live = [r for r in records if r.y.requires_grad]
    outs = torch.autograd.grad(losses.sum(), [r.y for r in live], allow_unused=True) if live else []
    return live, outs


def privatise(sdp: SampleDP, per: Mapping[str, torch.Tensor], clients: Sequence[int]) -> dict[str, torch.Tensor]:
    """DP-SGD's release from per-example gradients ``per`` (name → (S, n, *shape), slot p holding client
    ``clients[p]``): per slot, each example clipped to C over all names jointly, summed, N(0, σ²C²) from the client's
    "noise" stream added (its federation's, ``slot_seed(p)``, where slot seeds are set), divided by q·n_k. Returns
    name → (S, *shape)."""
    names = list(per)
    result: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    for p, k in enumerate(clients):
        if per[names[0]].shape[1]:
            if sdp.observe is not None:
                sdp.observe(int(sdp.round), k, {n: per[n][p] for n in names})
            clipped = clip_per_sample({n: per[n][p] for n in names}, sdp.clip_norm)
        else:  # no example at all: the noise alone
            clipped = {n: per[n].new_zeros(per[n].shape[2:]) for n in names}
        noise = sdp.noise_like(clipped, k, None if sdp.slot_seeds is None else sdp.slot_seed(p))
        denom = sdp.expected_batch_size(k)
        for n in names:
            result[n].append((clipped[n] + noise[n]) / denom)
    return {n: torch.stack(v) for n, v in result.items()}


def private_gradients(sdp: SampleDP, model: nn.Module, losses_fn: Callable[[], torch.Tensor],
                      names: Sequence[str], clients: Sequence[int],
                      transform: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
                      ) -> dict[str, torch.Tensor]:
    """One DP-SGD gradient of every slot: name → (S, *shape) = (Σᵢ clip_C(gᵢ) + N(0, σ²C²)) / (q·n_k).

    Args:
        sdp: the settings and streams (positioned with ``at``, sizes set).
        model: the model whose adapter layers ``losses_fn`` runs through.
        losses_fn: runs the forward and returns (S,) per slot the SUM of its real examples' losses (padded rows
            contribute exactly 0, e.g. through ``torch.where``: their per-sample gradients are then 0 and, clipped
            or not, add nothing).
        names: the parameters whose per-sample gradients are taken (stacked (S, …)).
        clients: the client in each slot (its noise stream and n_k).
        transform: per-example gradients of ``names`` → those of the tensors actually trained, by the chain rule
            (Fed-SB: R from its up factor B·R); clipping, noise and the result are then over its output's names.
    Returns:
        the private gradients, in the parameters' dtypes.
    """
    per = per_example_gradients(model, losses_fn, names, len(clients))
    return privatise(sdp, transform(per) if transform is not None else per, clients)


def per_example_gradients(model: nn.Module, losses_fn: Callable[[], torch.Tensor], names: Sequence[str],
                          slots: int) -> dict[str, torch.Tensor]:
    """The per-example gradients of ``names`` (name → (S, n, *shape)) of the losses ``losses_fn`` gives (as for
    ``private_gradients``), before any clipping."""
    live, outs = _output_grads(model, losses_fn, slots)
    return per_sample_grads(live, outs, names, model, slots)


def per_example_directional(model: nn.Module, losses_fn: Callable[[], torch.Tensor], names: Sequence[str],
                            slots: int) -> dict[str, torch.Tensor]:
    """Each example's gradient of ``names`` differentiated along the tangents its forward carries: name → (S, n,
    *shape) = d/dε ∇ℓᵢ(θ + εv) at ε = 0 — the per-example Hessian-vector product ∇²ℓᵢ·v, of which PF2LoRA's exact
    mixed term ∇²_{xy}ℓᵢ·ṽ is one block. Forward mode over the reverse pass: call it inside
    ``torch.autograd.forward_ad.dual_level()`` with ``losses_fn`` running at parameters made dual (primal θ, tangent
    v); the layers' captured inputs, the output gradients and hence the per-example formulas carry the derivative
    (the adapter layers run their reference torch ops under a tangent: ``fedlora.kernels``). An example's gradient
    that does not move along v gives zeros."""
    live, outs = _output_grads(model, losses_fn, slots)
    per = per_sample_grads(live, outs, names, model, slots, keep_tangents=True)
    out = {}
    for n, t in per.items():
        primal, tangent = fwAD.unpack_dual(t)
        out[n] = torch.zeros_like(primal) if tangent is None else tangent
    return out


def private_directional(sdp: SampleDP, model: nn.Module, losses_fn: Callable[[], torch.Tensor],
                        names: Sequence[str], clients: Sequence[int]) -> dict[str, torch.Tensor]:
    """One DP-SGD release of each example's Hessian-vector product (``per_example_directional``: inside a dual
    level, ``losses_fn`` at dual parameters), clipped to C as one vector, summed, noised, / q·n_k (``privatise``).
    PF2LoRA's exact mixed term. Returns name → (S, *shape)."""
    return privatise(sdp, per_example_directional(model, losses_fn, names, len(clients)), clients)


def private_difference(sdp: SampleDP, model: nn.Module, plus_fn: Callable[[], torch.Tensor],
                       minus_fn: Callable[[], torch.Tensor], names: Sequence[str], clients: Sequence[int],
                       scale: float | torch.Tensor) -> dict[str, torch.Tensor]:
    """One DP-SGD release of a finite difference: each example's (∇ℓᵢ⁺ − ∇ℓᵢ⁻)·scale — ``plus_fn`` / ``minus_fn`` the
    losses at the two points, on ONE batch — clipped to C as one vector, summed, noised, / q·n_k (``privatise``).
    ``scale``: a number, or one per slot (S,) (e.g. 1/(2δ) with a client's own δ). Clipping the difference, not each
    side, bounds the example's contribution by C (the sides' gradients largely cancel in it). Per-FedAvg's
    hessian-free term and PF2LoRA's finite-difference mixed term. Returns name → (S, *shape)."""
    slots = len(clients)
    plus = per_example_gradients(model, plus_fn, names, slots)
    minus = per_example_gradients(model, minus_fn, names, slots)
    scale = torch.as_tensor(scale, dtype=torch.float64).expand(slots)

    def per_slot(t: torch.Tensor) -> torch.Tensor:  # (S,) over (S, n, *shape)
        return scale.to(t.dtype).reshape(-1, *([1] * (t.dim() - 1)))

    return privatise(sdp, {n: (plus[n] - minus[n]) * per_slot(plus[n]) for n in names}, clients)


def private_weight_gradients(sdp: SampleDP, model: nn.Module, losses_fn: Callable[[], torch.Tensor],
                             modules: Sequence[str], clients: Sequence[int]) -> dict[str, torch.Tensor]:
    """DP-SGD's release of the full-weight gradient ∂ℓ/∂W (d_out, d_in) of the adapted layers named ``modules``: per
    example Σ_t g_tᵀ x_t (the weight's gradient is the layer's input times its output gradient, whatever adapter it
    carries), clipped jointly over the modules, summed, noised, / q·n_k (``privatise``). Returns module name →
    (S, d_out, d_in). Fed-SB's initialisation round under sample-level DP."""
    slots = len(clients)
    live, outs = _output_grads(model, losses_fn, slots)
    names = {id(m): n for n, m in model.named_modules()}
    wanted = set(modules)
    per: dict[str, torch.Tensor] = {}
    for rec, g in zip(live, outs):
        name = names.get(id(rec.module))
        if name not in wanted or rec.A is None:
            continue
        g = torch.zeros_like(rec.y) if g is None else g
        w = torch.einsum("snto,sntd->snod", rec.per_example(g, slots), rec.per_example(rec.x.detach(), slots))
        per[name] = w if name not in per else per[name] + w
    missing = [m for m in modules if m not in per]
    if missing:
        raise ConfigError(f"sample-level DP: no adapted layer {missing[0]!r} took part in the forward")
    return privatise(sdp, {m: per[m] for m in modules}, clients)
