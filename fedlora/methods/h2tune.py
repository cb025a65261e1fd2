"""H²Tune — TriLoRA with a shared sparsified middle, layer alignment, alternating disentanglement
([H²Tune] §4.2–4.4, App. A Algorithm 1; docs/design.md §4.10).

Per adapted module of client k (PEFT orientation, see ``fedlora.aggmath.h2tune``):

    ΔW = s·B_k (I + (Φ_k ⊙ Ω^sup_k) ⊙ R_k) A_k                                  (eq. 3)

A_k (r_g, d_in), B_k (d_out, r_g): private, task-specific; R_k (r_g, r_g): task-shared, the only
thing uploaded; Φ_k (r_g, r_g): the real-valued sparsification matrix, trained on its support
Ω^sup_k (the module's ``middle_mask`` buffer) = the top-β_k fraction of entries by |Φ_k ⊙ R_k|
(``support_by="phi"``: by |Φ_k|), re-chosen at every round start (``sparsify_support``).

Layers. Adapted modules are grouped into *module types* by their name with every all-digit path
component replaced by ``*`` (``layers.3.q_proj`` → ``layers.*.q_proj``; a lone ``LoRALinear`` is
type ``""``, a ``ModuleList`` of them type ``*``); within a type, modules in model order are the
layers 0..L−1 and every type must have the same L. Client k uses its first L_k layers for R
(option ``client_layers``, default L); its modules l ≥ L_k get an empty support, so there ΔW = s·BA
and R, Φ never change (what the objective does with such a client's deeper layers is the caller's
business). One layer-relation matrix Ω_k ∈ R^{L_k×L_g} per client, shared by all module types
(§4.3 gives one Ω_k per client), trainable in step (1); L_g = ``global_layers``, default max_k L_k
(docs/design.md §4.10; the paper's Table 6 also tries L_g > max L_k). Initial Ω_k: ``omega_init="identity"``
Ω_k[l, j] = δ_lj, i.e. [I_{L_k} | 0] — layer l of the client ↔ global layer l (the identity when
L_k = L_g); ``"depth"`` maps layer l to global layer round(l·(L_g−1)/(L_k−1)) (relative depth);
``"random"`` draws Ω_k[l, j] ~ U(−1/√L_k, 1/√L_k) per client (seeded by the federation's seed and the
client) — the authors' code (AntarcticLu/H2Tune, finetune.py: ``kaiming_uniform_(a=√5)`` of their
L_g×L_k relation matrix, our Ω_kᵀ); the paper gives no initialisation.

Round (App. A, Algorithm 1; our reading where it is silent):
* round start: the support of every Φ is re-chosen;
* each local step draws ONE batch (Alg. 1 loops "for (x_i, y_i) ∈ D_k": both steps on the same
  sample) and runs, in this order,
  (1) ``shared_step``: R_k, Φ_k, Ω_k ← one optimizer step on
      L_share = task(y') + λ·Σ_l KL(softmax vec R_k[l] ‖ softmax vec R_{g→k}[l])      (eq. 6)
      with A_k, B_k frozen; R_{g→k} = R_g ×_layer Ω_kᵀ (eq. 5) with the received R_g a constant
      and Ω_k live — the only way Ω_k can receive a gradient from eq. 6, although §4.4 says
      "freezing R_{g→k}" (we read: the received R_g is frozen). R and Φ change on the support only
      (Alg. 1 updates the product "Φ_k R_k"): their gradients are masked and off-support entries
      are restored after the step, so AdamW momentum cannot move them either.
  (2) ``specific_step``: A_k, B_k ← one optimizer step on
      L_specific = task(y'') ∓ KL(softmax y'' ‖ softmax y') + ν/2 (‖A_k‖² + ‖B_k‖²)   (eq. 7)
      with R, Φ, Ω frozen (squared Frobenius norms over all modules, docs/design.md §4.10).
      **y'** = the model's output (logits, ``output_fn``) on this step's batch computed in step (1)
      *before* its update, i.e. with the current A_k, B_k and the pre-update R_k, Φ_k — eq. 6's
      prediction — detached (a constant of step 2). **y''** = the output on the same batch after
      step (1), "the prediction based on optimized R_k", differentiable in A_k, B_k. The KL is per
      sample over the C classes and averaged over the batch's real samples (see ``output_fn``). ``disentangle_sign="paper"`` uses
      eq. 7's −KL (pushes y'' away from y'; unbounded below, ν keeps A, B bounded); ``"plus"``
      uses +KL. This alternates every step as Alg. 1 does (not all (1) steps then all (2)).
  Task loss = the objective (CE for classification, as the paper; any scalar per replica works).
* upload: R_{k→g} = R_k[:L_k] ×_layer Ω_k (eq. 4), one (L_g, r_g, r_g) tensor per module type —
  nothing else leaves the client.
* server: R_g = (1/K) Σ_k R_{k→g} (App. A): **unweighted** — data-size weights are ignored.
* download: the client stores R_g; it enters the client only as the KL target R_{g→k} of step (1)
  (``receive="target"``, default). This is App. A: Algorithm 1 never overwrites R_k and Algorithm 2
  states R_t^0 = R_{t−1}^τ, the global matrix acting through the proximal term h(R) = λΣ KL(R_k, R_g)
  which "assigns a personalized parameter R_k for each client". ``receive="replace"`` also sets
  R_k[:L_k] ← R_{g→k} (FedAvg-like reading of §4.3's "further personalized").

Sample-level DP (our variant; the paper has no private runs): a local step's two optimizer steps are two DP-SGD
releases (Abadi et al., CCS 2016, Alg. 1), each on its OWN Poisson batch and noise — step (1) on the step's
"batch"/"noise" streams, step (2) on "batch.1"/"noise.1" (``SampleDP.release``) — not on Alg. 1's one shared
batch: two releases on one subsampled batch are not two independent subsampled Gaussians, which is what the
accountant composes (``sample_dp_releases`` = 2 per local step). y′ of eq. 7 (the output before step (1)) is
computed on step (2)'s batch, before step (1). Per-example gradients of the middle layer: dMᵢ = s·Σₜ (gₜB)ᵀ(xₜAᵀ),
dRᵢ = dMᵢ ⊙ Φ ⊙ Ω^sup, dΦᵢ = dMᵢ ⊙ R ⊙ Ω^sup, and A's, B's through B·M and M·A
(``fedlora.privacy.dpsgd``); eq. 6's KL and eq. 7's ν-term are functions of the parameters alone — their exact
gradients are added unclipped — while eq. 7's output KL is a per-example term, each example's mean over its
outputs, summed over the batch (``output_kl(reduction="examples")``).

Client-level DP (DP-FedAvg, McMahan et al., ICLR 2018, Algorithm 1, over App. A's mean): a client's update is
R_{k→g} − R_g (eq. 4's upload minus the server's last R_g, its KL target of eq. 6), clipped over all module types;
before the first round R_g⁰ (``initial_global_R``: the mean of the K clients' initial uploads, from the seed alone)
— ``client_dp_reference``; docs/concepts/privacy.md.

Initialisation. LoRALinear starts at R = 0, Φ = 1 (ΔW = s·BA). ``setup`` draws R_init ~
N(0, r_init_std²) per (module type, layer) from a generator seeded with ``federation_seed(f)``
(``seed[f]``, or ``seed + f`` for an integer seed) for federation f, identical on every replica of the federation (docs/design.md §4.10); layers
≥ L_k are zeroed. Each type takes max(L, L_g) draws in layer order, so layer l of a type gets the same
R_init in models of any depth (clients with different base models, ``fedlora.llm.hetero``). A small non-zero R breaks the ties of the first support choice and of softmax(R).
B keeps its PEFT init (B = 0, so ΔW = 0 for W0 = 0): the task gradient of R is ∝ B, so on a fresh
model the very first step (1) moves nothing (the KL is also 0 there, see below); step (2) then makes
B ≠ 0 and every later step (1) is live. The first KL target is R_g⁰ (``initial_global_R``), the server mean
of ALL K clients' initial uploads (what round −1 would send), whichever clients share a slot pass: with equal
L_k and identity Ω it is R_init itself.

Model outputs. The Objective contract returns one loss per replica; eq. 7 also needs logits. Pass
``output_fn(params, batch) -> (G, …, C)`` logits (constructor, or a runtime's ``RuntimeFacts.output_fn``),
evaluated with the same ``params`` mapping as the objective, or ``-> (logits, mask)`` with ``mask``
(G, …) = 1 for real samples and 0 for padding, so that the KL is averaged over each client's real
samples only (the synthetic runner pads clients of different sizes to one length; without the mask
a client's KL would be scaled by n_k/n_max). Without ``output_fn`` step (2) is task loss +
ν/2 regulariser only (no disentanglement KL; a warning says so once).

Optimizer: plain SGD by default, as App. A's Algorithm 1 writes the updates (η for A, B; η′ for
R, Φ); ``optimizer="adamw"`` is an option (weight decay 0: ν is explicit).

Stacked replicas share d_in/d_out; clients with different widths/depths (different models) only
need the (L_g, r_g, r_g) protocol, which upload/aggregate/download implement.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from ..aggmath.h2tune import (
    kl_softmax,
    server_mean,
    sparsify_support,
    to_client,
    to_global,
)
from ..errors import ConfigError
from ..optim import make_optimizer
from ..payload import Payload
from ..seeds import H2TUNE_OMEGA, seed_of
from .base import Method, Objective, RuntimeFacts, Sampler, register

__all__ = ["H2Tune", "output_kl"]

OutputFn = Callable[[Mapping[str, torch.Tensor], Any], torch.Tensor]

SIGNS = {"paper": -1.0, "plus": 1.0}
RECEIVE = ("target", "replace")
SUPPORT_BY = ("phi_r", "phi")
OMEGA_INIT = ("identity", "depth", "random")


def output_kl(y_new: torch.Tensor, y_old: torch.Tensor, mask: torch.Tensor | None = None,
              reduction: str = "mean") -> torch.Tensor:
    """KL(softmax y_new ‖ softmax y_old) over the last (class) dim, averaged over samples → (G,).

    y_new, y_old: (G, …, C) logits. ``mask`` (G, …): 1 for a real sample, 0 for padding (clients
    padded to a common length); the mean is then over each replica's real samples only.
    ``reduction="examples"`` (sample-level DP's summed objective): y (G, n, …, C) holds n examples; each example's
    term is the mean over its scored outputs (its ``…``, masked; 0 for an example with none, a padded row), and the
    result their SUM over the n examples — a sum of per-example terms, whose per-example gradients DP-SGD clips."""
    lp, lq = torch.log_softmax(y_new, dim=-1), torch.log_softmax(y_old, dim=-1)
    if reduction == "examples":
        kl = (lp.exp() * (lp - lq)).sum(-1)
        m = torch.ones_like(kl) if mask is None else mask.reshape(kl.shape).to(kl.dtype)
        kl, m = kl.reshape(kl.shape[0], kl.shape[1], -1), m.reshape(kl.shape[0], kl.shape[1], -1)
        return ((kl * m).sum(-1) / m.sum(-1).clamp(min=1.0)).sum(-1)
    if reduction != "mean":
        raise ConfigError(f"output_kl: reduction must be 'mean' or 'examples', got {reduction!r}")
    kl = (lp.exp() * (lp - lq)).sum(-1).reshape(y_new.shape[0], -1)
    if mask is None:
        return kl.mean(-1)
    m = mask.reshape(kl.shape).to(kl.dtype)
    return (kl * m).sum(-1) / m.sum(-1)


def _module_type(prefix: str) -> str:
    return ".".join("*" if part.isdigit() else part for part in prefix.split(".")) if prefix else ""


def _pname(prefix: str, leaf: str) -> str:
    return f"{prefix}.{leaf}" if prefix else leaf


def _check_number(opt: str, v: Any, low: float, strict: bool) -> None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (v > low if strict else v >= low)
    if not ok:
        raise ConfigError(f"h2tune: {opt} must be a finite number {'>' if strict else '≥'} {low}, got {v!r}")


@register
class H2Tune(Method):
    """H²Tune (see the module docstring for the round and every reading of the paper).

    Options: ``rank`` r_g; ``lr`` η (A, B) and ``shared_lr`` η' (R, Φ, Ω; default η) — Alg. 1's two
    step sizes; ``densities`` β_k per client (default 1.0); ``client_layers`` L_k per client (default
    L); ``global_layers`` L_g (default max L_k); ``nu`` ν of eq. 7 (not given in the paper; 1e-3);
    ``kl_weight`` λ on eq. 6's KL (1 as written); ``disentangle_sign`` 'paper' (−KL) | 'plus';
    ``output_fn`` (params, batch) → logits (G, …, C) for eq. 7's KL; ``receive`` 'target' | 'replace';
    ``support_by`` 'phi_r' (|Φ⊙R|) | 'phi'; ``omega_init`` 'identity' | 'depth' | 'random'; ``r_init_std`` and
    ``seed`` for the shared R init; ``optimizer`` 'sgd' (default: App. A's Algorithm 1 writes plain
    SGD steps with η, η′) | 'adamw' (weight decay 0: ν is explicit). With AdamW, moments of entries
    off the current support keep decaying while those entries are frozen.
    """

    name = "h2tune"
    sample_dp_refusal = None  # its two steps are two DP-SGD releases on their own batches (module doc)
    sample_dp_note = ("its steps (1) and (2) are each a DP-SGD release on its own Poisson batch (not Alg. 1's one "
                      "batch), 2 per local step, both counted")
    sample_dp_releases = 2
    client_dp_refusal = None  # R_{k→g}'s mean; the first round's updates are taken from R_g⁰ (client_dp_reference)
    personalised = True  # the private A_k, B_k
    default_head = "personal"  # task-specific knowledge (clients may even have different label sets)
    head_modes = ("frozen", "personal")
    has_global_model = False

    def __init__(self, rank: int = 8, lr: float = 2e-3, shared_lr: float | None = None,
                 densities: Sequence[float] | None = None, client_layers: Sequence[int] | None = None,
                 global_layers: int | None = None, nu: float = 1e-3, kl_weight: float = 1.0,
                 disentangle_sign: str = "paper", output_fn: OutputFn | None = None,
                 receive: str = "target", support_by: str = "phi_r", omega_init: str = "identity",
                 r_init_std: float = 1e-2, seed: int | Sequence[int] = 0, optimizer: str = "sgd") -> None:
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise ConfigError(f"h2tune: rank (the global rank r_g) must be an integer ≥ 1, got {rank!r}")
        _check_number("lr", lr, 0.0, strict=True)
        if shared_lr is not None:
            _check_number("shared_lr", shared_lr, 0.0, strict=True)
        _check_number("nu", nu, 0.0, strict=False)
        _check_number("kl_weight", kl_weight, 0.0, strict=False)
        _check_number("r_init_std", r_init_std, 0.0, strict=False)
        if densities is not None:
            for b in densities:
                if not (isinstance(b, (int, float)) and not isinstance(b, bool) and 0.0 <= b <= 1.0):
                    raise ConfigError(f"h2tune: densities (β_k) must each be a number in [0, 1], got {list(densities)}")
        if client_layers is not None:
            for l in client_layers:
                if not isinstance(l, int) or isinstance(l, bool) or l < 1:
                    raise ConfigError(f"h2tune: client_layers (L_k) must be integers ≥ 1, got {list(client_layers)}")
        if global_layers is not None and (not isinstance(global_layers, int) or global_layers < 1):
            raise ConfigError(f"h2tune: global_layers (L_g) must be None or an integer ≥ 1, got {global_layers!r}")
        for opt, v, allowed in (("disentangle_sign", disentangle_sign, tuple(SIGNS)), ("receive", receive, RECEIVE),
                                ("support_by", support_by, SUPPORT_BY), ("omega_init", omega_init, OMEGA_INIT),
                                ("optimizer", optimizer, ("adamw", "sgd"))):
            if v not in allowed:
                raise ConfigError(f"h2tune: {opt} must be one of {', '.join(map(repr, allowed))}, got {v!r}")
        if output_fn is not None and not callable(output_fn):
            raise ConfigError(f"h2tune: output_fn must be callable (params, batch) -> logits, got {output_fn!r}")
        self.rank, self.lr = rank, lr
        self.shared_lr = lr if shared_lr is None else shared_lr
        self.densities = None if densities is None else [float(b) for b in densities]
        self.client_layers = None if client_layers is None else list(client_layers)
        self.global_layers, self.nu, self.kl_weight = global_layers, nu, kl_weight
        self.disentangle_sign, self.output_fn, self.receive = disentangle_sign, output_fn, receive
        self._own_output_fn = output_fn is not None  # a constructor's output_fn is not replaced by a runtime's
        seed = self.check_seed("h2tune", seed)
        self.support_by, self.omega_init, self.r_init_std, self.seed = support_by, omega_init, r_init_std, seed
        self.optimizer = optimizer
        self._warned = False

    def use_runtime(self, facts: RuntimeFacts) -> None:
        """The model's outputs for eq. 7 (``facts.output_fn``, unless the constructor was given one) and
        the federation's deepest model L_g (``facts.global_layers``: client models of different depth)."""
        super().use_runtime(facts)
        if facts.output_fn is not None and not self._own_output_fn:
            if not callable(facts.output_fn):
                raise ConfigError(f"h2tune: output_fn must be callable (params, batch) -> logits, got {facts.output_fn!r}")
            self.output_fn = facts.output_fn
        if facts.global_layers is not None:
            if not isinstance(facts.global_layers, int) or facts.global_layers < 1:
                raise ConfigError(f"h2tune: global_layers (L_g) must be an integer ≥ 1, got {facts.global_layers!r}")
            self.global_layers = facts.global_layers

    def step_sizes(self) -> dict:
        """η on the task-specific A, B and η' on the task-shared R, Φ, Ω (App. A, Alg. 1)."""
        return {"lr": {"optimizer": self.optimizer, "lr": float(self.lr)},
                "shared_lr": {"optimizer": self.optimizer, "lr": float(self.shared_lr)}}

    def adapter_kwargs(self) -> dict[str, Any]:
        return {"rank": self.rank, "middle": True}

    # set-up --------------------------------------------------------------------------------
    global_factors = ()  # A_k, B_k are private (task-specific); the shared R is seeded in init_state

    def bind(self, model: nn.Module, replica_clients: Sequence[int], n_clients: int | None = None) -> None:
        super().bind(model, replica_clients, n_clients)
        G, K, r = len(self.replica_clients), self.n_clients, self.rank
        r_names = self._names("lora_R")
        if not r_names:
            raise ConfigError("h2tune needs the TriLoRA middle: build the model with adapter_kwargs() (middle=True)")
        # module types → layer prefixes, in model order
        self.types: dict[str, list[str]] = {}
        for n in r_names:
            R = self.params[n]
            if R.dim() != 3 or tuple(R.shape) != (G, r, r):
                raise ConfigError(f"h2tune: {n} must be stacked (G, r_g, r_g) = {(G, r, r)}, got {tuple(R.shape)}")
            prefix = n[: -len("lora_R")].rstrip(".")
            self.types.setdefault(_module_type(prefix), []).append(prefix)
        counts = {t: len(p) for t, p in self.types.items()}
        if len(set(counts.values())) != 1:
            raise ConfigError(f"h2tune: every module type must have the same number of layers (layer alignment "
                              f"maps layer l of every type through one Ω_k), got {counts}; adapt only modules that "
                              f"every block has (model.target_modules / model.layers)")
        L = next(iter(counts.values()))
        layers = self.client_layers if self.client_layers is not None else [L] * K
        if len(layers) != K:
            raise ConfigError(f"h2tune: client_layers has {len(layers)} entries for {K} clients")
        if max(layers) > L:
            raise ConfigError(f"h2tune: client_layers {layers} exceed the model's L = {L} adapted layers per module type")
        dens = self.densities if self.densities is not None else [1.0] * K
        if len(dens) != K:
            raise ConfigError(f"h2tune: densities has {len(dens)} entries for {K} clients")
        L_g = self.global_layers if self.global_layers is not None else max(layers)
        if L_g < max(layers):
            raise ConfigError(f"h2tune: global_layers must be ≥ max client_layers = {max(layers)}, got {L_g}")
        self.L, self.L_g = L, L_g
        self.layers = [layers[k] for k in self.replica_clients]  # L_k per replica
        self.betas = [dens[k] for k in self.replica_clients]  # β_k per replica
        R0 = self.params[r_names[0]]
        dtype, device = R0.dtype, R0.device
        self.layer_mask = (torch.arange(L)[None, :] < torch.tensor(self.layers)[:, None]).to(dtype=dtype, device=device)
        # Ω_k padded to (L, L_g); rows l ≥ L_k stay 0 and get no gradient
        om = torch.zeros(G, L, L_g, dtype=dtype)
        for i, Lk in enumerate(self.layers):
            om[i, :Lk] = self._initial_omega(i // self.n_clients, self.replica_clients[i], Lk).to(dtype)
        self.omega = nn.Parameter(om.to(device))
        # the KL target R_g each replica received last (filled by init_state / download / a record)
        self.global_R = {t: torch.zeros(G, L_g, r, r, dtype=dtype, device=device) for t in self.types}
        shared = self._leaf("lora_R") + self._leaf("lora_Phi") + [self.omega]
        # a trained classifier head (LLM runtime) is task-specific: personal, trained in step (2)
        specific = self._leaf("lora_A") + self._leaf("lora_B") + [self.params[n] for n in self.head_names()]
        def make(ps, lr):  # no weight decay: ν is explicit in eq. 7
            return make_optimizer(self.optimizer, ps, lr)
        self.opt_shared = make(shared, self.shared_lr)
        self.opt_specific = make(specific, self.lr)

    def _initial_omega(self, federation: int, client: int, Lk: int) -> torch.Tensor:
        """Client ``client``'s initial Ω_k (L_k, L_g) in federation ``federation`` (float64; ``omega_init``)."""
        L_g = self.L_g
        if self.omega_init == "random":  # per client, not per slot: the same Ω_k whichever slot it trains in
            gen = torch.Generator().manual_seed(seed_of(self.federation_seed(federation), H2TUNE_OMEGA, client))
            return (torch.rand(Lk, L_g, generator=gen, dtype=torch.float64) * 2 - 1) / math.sqrt(Lk)
        om = torch.zeros(Lk, L_g, dtype=torch.float64)
        for l in range(Lk):
            om[l, l if self.omega_init == "identity" else (round(l * (L_g - 1) / (Lk - 1)) if Lk > 1 else 0)] = 1.0
        return om

    def _initial_R(self, federation: int) -> dict[str, list[torch.Tensor]]:
        """R_init of federation ``federation`` per module type: the (r_g, r_g) float64 draw of each of its L layers."""
        gen = torch.Generator().manual_seed(self.federation_seed(federation))
        out: dict[str, list[torch.Tensor]] = {}
        for t in sorted(self.types):
            # max(L, L_g) draws per type, so R_init at (type, layer l) does not depend on this model's
            # depth: clients of models of different depth (fedlora.llm.hetero) start from the same R
            draws = [torch.randn(self.rank, self.rank, generator=gen, dtype=torch.float64) * self.r_init_std
                     for _ in range(max(len(self.types[t]), self.L_g))]
            out[t] = draws[: len(self.types[t])]
        return out

    def initial_global_R(self, federation: int = 0) -> dict[str, torch.Tensor]:
        """R_g⁰ of federation ``federation``: the server mean of ALL its K clients' initial uploads
        R_init[:L_k] ×_layer Ω_k⁰ (eq. 4, App. A's mean), per module type (L_g, r_g, r_g) — the KL target clients
        start from ("what round −1 would send", ``init_state``), computed from the options and seeds alone (public),
        so it is what client-level DP takes the first round's updates from."""
        ups = self.initial_uploads(federation)
        return {n: server_mean([u[n] for u in ups]) for n in ups[0]}

    def initial_uploads(self, federation: int = 0) -> list[dict[str, torch.Tensor]]:
        """Every client k's (0..K−1) initial upload R_{k→g}⁰ = R_init[:L_k] ×_layer Ω_k⁰ (eq. 4) in federation
        ``federation``, per module type (L_g, r_g, r_g), in the model's dtype — from the options and seeds alone,
        the same values ``upload`` gives on a fresh replica. ``initial_global_R`` is their mean; a run of clients
        with different base models (``fedlora.llm.hetero``) takes the mean over every group's."""
        dtype = self.omega.dtype
        layers = self.client_layers if self.client_layers is not None else [self.L] * self.n_clients
        init = self._initial_R(federation)
        stacked = {t: torch.stack(init[t]).to(dtype) for t in self.types}  # (L, r, r): layers ≥ L_k zero in client k
        out = []
        for k, Lk in enumerate(layers):
            om = self._initial_omega(federation, k, Lk).to(dtype)
            out.append({_pname(t, "lora_R"): to_global(stacked[t][:Lk], om) for t in self.types})
        return out

    def client_dp_reference(self, state: Mapping[str, torch.Tensor], initial: Mapping[str, torch.Tensor],
                            upload: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What a client's update R_{k→g} − R_g is taken against: the server's R_g, the KL target every client
        downloaded (eq. 6; under ``receive="target"`` the client's own R_k is never reset, so R_g is the one public
        point its aligned R is a deviation from). Before the first round, R_g⁰ (``initial_global_R``; ``initial``,
        the server's per-federation references, where it holds it). A federation's R_g⁰ depends on its seed, so a
        method bound to several federations needs ``initial``."""
        out = {**initial, **state}
        missing = [n for n in upload if n not in out]
        if missing:
            if len(self.groups) != 1:
                raise ConfigError(f"h2tune client-level DP: {missing[0]!r} has no value to take the first round's "
                                  f"update from; with {len(self.groups)} federations give the server each one's "
                                  f"initial_global_R(f) as its dp_references")
            out = {**self.initial_global_R(0), **out}
        return out

    def init_state(self) -> None:
        super().init_state()
        self._seed_R()
        # initial KL target: each federation's R_g⁰, the mean over ALL its K clients' initial uploads (what round −1
        # would send) — not over the replicas bound now, a slot pass's clients, so that a client's starting target
        # does not depend on its pass-mates (random Ω_k, different L_k)
        for f, reps in enumerate(self.groups):
            state = self.initial_global_R(f)
            for i in reps:
                for t in self.types:
                    self.global_R[t][i] = state[_pname(t, "lora_R")]
        self._choose_support()

    @torch.no_grad()
    def _seed_R(self) -> None:
        for f, reps in enumerate(self.groups):
            inits = self._initial_R(f)
            for t, prefixes in self.types.items():
                for l, init in enumerate(inits[t]):
                    R = self.params[_pname(prefixes[l], "lora_R")]
                    for i in reps:
                        R[i] = init.to(R.dtype) if l < self.layers[i] else 0.0

    # views -----------------------------------------------------------------------------------
    def _leaf(self, leaf: str) -> list[torch.Tensor]:
        return [self.params[_pname(p, leaf)] for t in self.types for p in self.types[t]]

    def _mask(self, prefix: str) -> torch.Tensor:
        return self.model.get_buffer(_pname(prefix, "middle_mask"))

    def _stack_R(self, t: str) -> torch.Tensor:
        """R of module type t stacked over layers, (G, L, r_g, r_g), differentiable."""
        return torch.stack([self.params[_pname(p, "lora_R")] for p in self.types[t]], dim=1)

    def param_view(self) -> dict[str, torch.Tensor]:
        """The mapping handed to the objective and ``output_fn``: A, B, R, Φ of every module."""
        view = {_pname(p, leaf): self.params[_pname(p, leaf)] for t in self.types for p in self.types[t]
                for leaf in ("lora_A", "lora_B", "lora_R", "lora_Phi")}
        view.update({n: self.params[n] for n in self.head_names()})
        return view

    def received(self, replica: int) -> dict[str, torch.Tensor]:
        """R_{g→k} = R_g ×_layer Ω_kᵀ (eq. 5) per module type, each (L_k, r_g, r_g)."""
        Lk = self.layers[replica]
        om = self.omega[replica, :Lk].detach()
        return {_pname(t, "lora_R"): to_client(self.global_R[t][replica], om) for t in self.types}

    def kl_shared(self) -> torch.Tensor:
        """Σ_types Σ_{l<L_k} KL(softmax vec R_k[l] ‖ softmax vec R_{g→k}[l]) per replica, (G,) (eq. 6)."""
        total = torch.zeros((), dtype=self.omega.dtype, device=self.omega.device)
        for t in self.types:
            R = self._stack_R(t)
            R_gk = torch.einsum("gjab,glj->glab", self.global_R[t], self.omega)  # to_client, stacked
            total = total + (kl_softmax(R, R_gk, per_layer=True, reduction="none") * self.layer_mask).sum(-1)
        return total

    # the round -------------------------------------------------------------------------------
    @torch.no_grad()
    def _choose_support(self) -> None:
        """Support of Φ per module and replica: top-β_k by magnitude (none for layers ≥ L_k)."""
        for t in self.types:
            for l, p in enumerate(self.types[t]):
                R, Phi, buf = self.params[_pname(p, "lora_R")], self.params[_pname(p, "lora_Phi")], self._mask(p)
                score = (Phi * R) if self.support_by == "phi_r" else Phi
                new = torch.zeros_like(buf)
                for i in range(len(self.replica_clients)):
                    if l < self.layers[i]:
                        new[i] = sparsify_support(score[i], self.betas[i]).to(buf.dtype)
                buf.copy_(new)

    def begin_round(self, round_idx: int) -> None:
        self._choose_support()

    def _leaf_names(self, leaf: str) -> list[str]:
        """The parameter names of ``_leaf(leaf)``, in its order."""
        return [_pname(p, leaf) for t in self.types for p in self.types[t]]

    def shared_step(self, objective: Objective, batch: Any, outputs: bool = True) -> torch.Tensor | None:
        """Step (1), eq. 6: update R, Φ (on the support) and Ω with A, B frozen. Returns y' (or None; not computed
        when ``outputs`` is False). Under sample-level DP the task loss's gradient of R and Φ is DP-SGD's; eq. 6's KL,
        a function of the parameters alone, adds its exact gradient (Ω's only one)."""
        P = self.param_view()
        y_prime = None
        if outputs and self.output_fn is not None:
            with torch.no_grad():
                y_prime = self._outputs(P, batch)[0].detach()
        Rs, Phis = self._leaf("lora_R"), self._leaf("lora_Phi")
        masks = [self._mask(p).bool() for t in self.types for p in self.types[t]]
        tensors = Rs + Phis + [self.omega]
        if self.sample_dp is None:
            loss = objective(P, batch).sum()  # replicas are independent: Σ keeps gradients apart
            if self.kl_weight:
                loss = loss + self.kl_weight * self.kl_shared().sum()
            grads = torch.autograd.grad(loss, tensors, allow_unused=True)
        else:
            names = self._leaf_names("lora_R") + self._leaf_names("lora_Phi")
            private = self.private_grads(lambda: objective(P, batch), names)
            grads = [private[n] for n in names] + [None]
            if self.kl_weight:
                exact = torch.autograd.grad(self.kl_weight * self.kl_shared().sum(), tensors, allow_unused=True)
                grads = [g if e is None else (e if g is None else g + e) for g, e in zip(grads, exact)]
        old = [x.detach().clone() for x in Rs + Phis]
        row = self.layer_mask[:, :, None]
        with torch.no_grad():
            for x, g, m in zip(tensors, grads, masks + masks + [row]):
                x.grad = None if g is None else g * m.to(g.dtype)
        self.opt_shared.step()
        with torch.no_grad():  # exact: off-support entries (and Ω's padding rows) never move
            for x, o, m in zip(Rs + Phis, old, masks + masks):
                x.copy_(torch.where(m, x, o))
            self.omega.mul_(row)
        for x in tensors:
            x.grad = None
        return y_prime

    def specific_step(self, objective: Objective, batch: Any, y_prime: torch.Tensor | None) -> None:
        """Step (2), eq. 7: update A, B with R, Φ, Ω frozen. ``y_prime``: step (1)'s output. Under sample-level DP the
        gradient of the task loss + the output KL (a per-example term: ``output_kl(reduction="examples")``) is
        DP-SGD's; the ν/2 term, a function of the parameters alone, adds its exact gradient."""
        P = self.param_view()
        private = self.sample_dp is not None
        kl = self.output_fn is not None and y_prime is not None
        if not kl and not self._warned:
            warnings.warn("h2tune: no output_fn, so step (2) uses the task loss + ν/2 regulariser only "
                          "(eq. 7's KL(y''‖y') needs the model's logits)", stacklevel=3)
            self._warned = True

        def task_and_kl() -> torch.Tensor:  # (G,)
            loss = objective(P, batch)
            if kl:
                y_2, mask = self._outputs(P, batch)
                loss = loss + SIGNS[self.disentangle_sign] * output_kl(y_2, y_prime, mask,
                                                                       "examples" if private else "mean")
            return loss

        AB = self._leaf("lora_A") + self._leaf("lora_B")
        trained = AB + [self.params[n] for n in self.head_names()]

        def ridge() -> torch.Tensor:  # ν/2 (‖A‖² + ‖B‖²) per replica, (G,)
            return 0.5 * self.nu * sum((x ** 2).reshape(x.shape[0], -1).sum(-1) for x in AB)

        if private:
            names = self._leaf_names("lora_A") + self._leaf_names("lora_B") + list(self.head_names())
            got = self.private_grads(task_and_kl, names)
            grads = [got[n] for n in names]
            if self.nu:
                grads = [g + e for g, e in zip(grads, torch.autograd.grad(ridge().sum(), AB))] + grads[len(AB):]
        else:
            loss = task_and_kl()
            if self.nu:
                loss = loss + ridge()
            grads = torch.autograd.grad(loss.sum(), trained)
        for x, g in zip(trained, grads):
            x.grad = g
        self.opt_specific.step()
        for x in trained:
            x.grad = None

    def _outputs(self, params: Mapping[str, torch.Tensor], batch: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``output_fn``'s logits and its padding mask (None when it returns logits alone)."""
        out = self.output_fn(params, batch)
        return (out[0], out[1]) if isinstance(out, tuple) else (out, None)

    def local_step(self, objective: Objective, sample: Sampler) -> None:
        if self.sample_dp is not None:
            self._private_local_step(objective, sample)
            return
        batch = sample()  # Alg. 1: both steps on the same (x_i, y_i)
        y_prime = self.shared_step(objective, batch)
        self.specific_step(objective, batch, y_prime)

    def _private_local_step(self, objective: Objective, sample: Sampler) -> None:
        """Sample-level DP (module doc): step (1) is release 0 of the local step, on its Poisson batch; step (2)
        release 1, on its own (``SampleDP.release``); eq. 7's y′ — the output before step (1) — is computed on step
        (2)'s batch, before step (1)."""
        sdp = self.sample_dp
        first = sample()  # the runtime positioned this step's draws: release 0
        sdp.release(1)
        second = sample()
        y_prime = None
        if self.output_fn is not None:
            with torch.no_grad():
                y_prime = self._outputs(self.param_view(), second)[0].detach()
        sdp.release(0)
        self.shared_step(objective, first, outputs=False)
        sdp.release(1)
        self.specific_step(objective, second, y_prime)

    def describe_replica(self, replica: int) -> dict:
        return {"rank": self.rank, "density": self.betas[replica], "layers": self.layers[replica]}

    # client sampling ------------------------------------------------------------------------
    def _extra_state(self) -> dict[str, torch.Tensor]:
        extra = {"omega": self.omega.detach().clone()}
        extra.update({f"global_R:{t}": v.clone() for t, v in self.global_R.items()})
        return extra

    def _restore_extra_state(self, extra: Mapping[str, torch.Tensor], idx: torch.Tensor) -> None:
        with torch.no_grad():
            self.omega[idx] = extra["omega"][idx]
            for t, v in self.global_R.items():
                v[idx] = extra[f"global_R:{t}"][idx]

    # communication ---------------------------------------------------------------------------
    def upload_spec(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The per-type aligned R_{k→g} (L_g, r_g, r_g) of eq. 4 — the only upload."""
        return {_pname(t, "lora_R"): (tuple(v.shape[1:]), v.dtype) for t, v in self.global_R.items()}

    def upload(self, replica: int) -> Payload:
        """R_{k→g} = R_k[:L_k] ×_layer Ω_k (eq. 4): one (L_g, r_g, r_g) tensor per module type."""
        Lk = self.layers[replica]
        om = self.omega[replica, :Lk].detach()
        return Payload({_pname(t, "lora_R"): to_global(self._stack_R(t)[replica, :Lk].detach(), om)
                        for t in self.types})

    @staticmethod
    def aggregate(payloads: Sequence[Payload], weights: torch.Tensor) -> dict[str, torch.Tensor]:
        """R_g = (1/K) Σ_k R_{k→g} per module type (App. A); ``weights`` are ignored (unweighted)."""
        if not payloads:
            raise ConfigError("h2tune: aggregate needs at least one payload")
        keys = set(payloads[0].tensors)
        for k, p in enumerate(payloads):
            if set(p.tensors) != keys:
                raise ConfigError(f"h2tune: payload {k} has keys {sorted(p.tensors)}, expected {sorted(keys)}")
        return {key: server_mean([p.tensors[key] for p in payloads]) for key in payloads[0].tensors}

    def download(self, replica: int, state: Mapping[str, torch.Tensor]) -> Payload:
        Lk = self.layers[replica]
        sent = {}
        with torch.no_grad():
            for t in self.types:
                key = _pname(t, "lora_R")
                Rg = state[key]
                if tuple(Rg.shape) != tuple(self.global_R[t].shape[1:]):
                    raise ConfigError(f"h2tune: {key} must be (L_g, r_g, r_g) = {tuple(self.global_R[t].shape[1:])}, "
                                      f"got {tuple(Rg.shape)}")
                self.global_R[t][replica] = Rg
                sent[key] = Rg
                if self.receive == "replace":
                    R_gk = to_client(self.global_R[t][replica], self.omega[replica, :Lk].detach())
                    for l, p in enumerate(self.types[t][:Lk]):
                        self.params[_pname(p, "lora_R")][replica] = R_gk[l]
        return Payload(sent)
