"""The Method abstraction (docs/design.md §2) and the registry that maps names to classes.

A Method declares the adapter structure it needs, runs a client's local steps, says what a client
uploads (a :class:`~fedlora.payload.Payload`) and aggregates on the server with a **pure** static
function of payloads and weights. Every client executor drives it, through the one round protocol of
``fedlora.server``.

Replicas: the model's adapter factors may carry a leading stack dimension G (see
``fedlora.adapter.LoRALinear``); replica ``i`` is one client of one independent federation. A
method's local step updates every replica at once — the math is elementwise or batched per
replica, so this equals G separate clients — while upload/download act on one replica's slice.
"""
from __future__ import annotations

import abc
import inspect
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping, Sequence

import torch
from torch import nn

from ..aggregation import fedavg_factors
from ..errors import ConfigError, quoted
from ..payload import Payload
from ..seeds import FEDERATION, seed_of

__all__ = ["Method", "AveragedFactors", "Objective", "Sampler", "register", "get_method", "build", "create_method",
           "method_parameters", "resolve_options", "available_methods", "broadcast_initial_factors", "RankSlots",
           "RuntimeFacts"]


#: params (name → tensor, the model's trainable parameters or substitutes) × batch → loss per replica (G,)
Objective = Callable[[Mapping[str, torch.Tensor], Any], torch.Tensor]
#: draws a fresh batch for every replica; successive calls are independent draws
Sampler = Callable[[], Any]

_REGISTRY: dict[str, type["Method"]] = {}


def register(cls: type["Method"]) -> type["Method"]:
    if not cls.name:
        raise TypeError(f"{cls.__name__} needs a non-empty `name`")
    _REGISTRY[cls.name] = cls
    return cls


#: the entry-point group through which an installed package adds methods: ``name = "pkg.mod:Class"``
ENTRY_POINT_GROUP = "fedlora.methods"
_PLUGIN_ERRORS: dict[str, str] = {}
_plugins_loaded = False


def _load_plugins() -> None:
    """Register the methods of installed packages (entry-point group ``fedlora.methods``), once. A
    built-in name is never replaced; a plugin that fails to load is remembered with why, and only
    asking for its name reports it."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _REGISTRY:
            continue
        try:
            cls = ep.load()
            if not (isinstance(cls, type) and issubclass(cls, Method)):
                raise TypeError(f"{ep.value} must be a Method subclass whose name is {ep.name!r}")
            if cls.name != ep.name:  # runs, records and configs name the class's name: they must agree
                raise TypeError(f"the entry point is named {ep.name!r} but {ep.value}.name is {cls.name!r}; "
                                f"the two must be the same")
        except Exception as e:  # a broken plugin must not break the other methods
            _PLUGIN_ERRORS[ep.name] = f"its plugin {ep.value!r} failed to load: {type(e).__name__}: {e}"
            continue
        _REGISTRY[ep.name] = cls


def available_methods() -> list[str]:
    """The registered names: the built-ins and those of installed plugins (``fedlora.methods``)."""
    _load_plugins()
    return sorted(_REGISTRY)


#: option names that mean "clients have different ranks", and the methods that support that
_RANK_BUDGET_OPTIONS = ("client_ranks", "ranks", "initial_ranks")


def method_parameters(method: "str | type[Method]") -> dict[str, inspect.Parameter]:
    """The constructor options of a method (a registered name or the class): option name →
    ``inspect.Parameter`` (its default and annotation), in the constructor's order. The one place a
    method's constructor signature is read."""
    cls = get_method(method) if isinstance(method, str) else method
    return {k: p for k, p in inspect.signature(cls.__init__).parameters.items() if k != "self"}


def resolve_options(name: str, options: Mapping[str, Any] | None = None, *, seed: Any = None,
                    client_weights: Sequence[float] | None = None) -> dict[str, Any]:
    """``options`` with the run's facts added where the method's constructor takes them and
    ``options`` do not set them: ``seed`` (its own random draws; an integer, or one per federation)
    and ``client_weights`` (w_k, e.g. for pooling); ``None`` adds nothing. Not checked (``build`` is)."""
    params = method_parameters(name)
    out = dict(options or {})
    for key, value in (("client_weights", client_weights), ("seed", seed)):
        if value is not None and key in params:
            out.setdefault(key, value)
    return out


def build(name: str, options: Mapping[str, Any] | None = None, *, seed: Any = None,
          client_weights: Sequence[float] | None = None) -> "Method":
    """The method ``name`` (registered, a plugin's, or ``"package.module:Class"``) built from its
    constructor ``options`` and the run's facts (``resolve_options``): the one factory of methods.

    An unknown name or option is a one-line ``ConfigError`` naming what is allowed (for per-client
    rank budgets given to a method with one rank for everyone, the methods that do support them).
    """
    cls = get_method(name)
    options = resolve_options(name, options, seed=seed, client_weights=client_weights)
    allowed = list(method_parameters(cls))
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        budgets = [u for u in unknown if u in _RANK_BUDGET_OPTIONS]
        if budgets:
            het = sorted(n for n, c in _REGISTRY.items() if any(o in method_parameters(c) for o in _RANK_BUDGET_OPTIONS))
            raise ConfigError(f"{name}: per-client rank budgets ({', '.join(budgets)}) are not supported — every "
                              f"client has rank r here; methods with heterogeneous ranks: {', '.join(het)}")
        raise ConfigError(f"{name}: unknown option(s) {quoted(unknown)}; allowed: {', '.join(allowed)}")
    return cls(**options)


def create_method(name: str, **options: Any) -> "Method":
    """``build(name, options)`` with the options as keywords."""
    return build(name, options)


def get_method(name: str) -> type["Method"]:
    """The class registered as ``name``; or ``"package.module:Class"``, a Method subclass imported
    from there (a method of your own, used without packaging it)."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" in name:
        import importlib

        mod, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"method {name!r}: cannot import {attr!r} from {mod!r} ({type(e).__name__}: {e})") from None
        if not (isinstance(cls, type) and issubclass(cls, Method)) or not cls.name:
            raise ConfigError(f"method {name!r}: {attr} is not a Method subclass with a name")
        return cls
    _load_plugins()
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name in _PLUGIN_ERRORS:
        raise ConfigError(f"method {name!r} is unavailable: {_PLUGIN_ERRORS[name]}")
    from ..errors import did_you_mean

    raise ConfigError(f"unknown method {name!r}{did_you_mean(name, available_methods())}; available: "
                      f"{', '.join(available_methods())} (or 'package.module:Class' for a method of your own)") from None


def broadcast_initial_factors(model: torch.nn.Module, groups: Sequence[Sequence[int]],
                              suffixes: Sequence[str] = ("lora_A", "lora_B")) -> None:
    """Copy the first replica's factors of every federation to its other replicas, in place.

    The server's one-time broadcast of the initial adapter (FFA-LoRA, RoLoRA need identical frozen
    factors on all clients; ``LoRALinear`` draws an independent A per replica). ``groups``: the
    replicas of each federation, e.g. ``method.groups`` or
    ``[list(fed.replicas_of(g)) for g in range(fed.n_groups)]``.
    """
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.rsplit(".", 1)[-1] in suffixes:
                for g in groups:
                    p[list(g)] = p[g[0]].clone().expand(len(g), *p.shape[1:])


@dataclass(frozen=True)
class RuntimeFacts:
    """What a runtime tells a method about where it runs, all at once (``Method.use_runtime``, before
    ``bind``); a method takes the facts it has a use for and ignores the others.

    ``shared_base``: the clients share one base model, into which the server merges a method's
    increments (the LLM slot executor; FLoRA merges server-side then). ``head_mode``: how a trainable
    classifier head is treated (``Method.head_modes``; ``None``: the method's ``default_head``).
    ``output_fn``: ``(params, batch) -> logits`` (or ``(logits, mask)``) of the model, for a method that
    needs the model's outputs as well as its loss (H²Tune's eq. 7; a constructor's own wins).
    ``global_layers``: the depth L_g of the deepest model of the federation (H²Tune over client models of
    different depth; ``None``: the method's own option)."""

    shared_base: bool = False
    head_mode: str | None = None
    output_fn: Callable[..., Any] | None = None
    global_layers: int | None = None


class Method(abc.ABC):
    """One federated algorithm. Subclasses set ``name`` and implement the abstract hooks."""

    name: ClassVar[str] = ""
    #: rank of the client (never communicated) adapter this method needs; 0 = none
    needs_client_adapter: ClassVar[bool] = False
    #: the download is an increment every client must apply (not the full state): the simulator
    #: then counts its bytes for every client each round, sampled or not
    incremental_download: ClassVar[bool] = False
    #: the reason this method's paper fixes the LoRA scale (e.g. Fed-SB's s = 1 of its LoRA-SB init), which
    #: refuses rsLoRA's α/√r for it (``fedlora.adapter.refuse_rslora``); None = rsLoRA allowed
    fixed_lora_scale: ClassVar[str | None] = None
    #: sample-level DP-SGD on the clients (``fedlora.privacy.dpsgd``): None where the method's local step can take
    #: private gradients (``FactorLoRA.train_step``'s private path); else one line saying why not, which
    #: ``set_sample_dp`` raises (and a run's config check, before any training)
    sample_dp_refusal: ClassVar[str | None] = ("its local step is its own, not FactorLoRA.train_step, the step that "
                                              "takes per-sample clipped, noised gradients")
    #: what the privacy table adds to a "yes" of sample-level DP (a restriction or a cost), None: nothing
    sample_dp_note: ClassVar[str | None] = None
    #: DP-SGD releases per local step under sample-level DP (each a Poisson batch, clipped and noised): the
    #: accountant counts local steps × this, and σ is calibrated for as many
    sample_dp_releases: ClassVar[int] = 1
    #: the ``fedlora.privacy.dpsgd.SampleDP`` the local steps use (``set_sample_dp``); None: ordinary steps
    sample_dp: Any = None
    #: client-level DP (``fedlora.privacy.client_dp``, DP-FedAvg): None where the server's aggregate is the weighted
    #: mean of the uploads, Σ_k p_k U_k, so the noised mean of clipped updates can stand in for it; else one line
    #: saying why not (``fedlora run`` refuses the combination with it, before any training)
    client_dp_refusal: ClassVar[str | None] = ("its server's aggregate is not the weighted mean of the uploads, "
                                               "which DP-FedAvg's clipped, noised mean stands in for")

    def adapter_kwargs(self) -> dict[str, Any]:
        """The adapter structure this method needs, as ``LoRALinear`` keyword arguments
        (``rank``, ``client_rank``, ``middle``). Runtimes build the model from it."""
        rank = getattr(self, "rank", None)
        if rank is None:
            raise NotImplementedError(f"{type(self).__name__} must define adapter_kwargs() or a `rank`")
        return {"rank": rank}

    #: names (last component) of the factors the server holds and broadcasts to every client once,
    #: before the first round (docs/design.md §3: every protocol starts from ONE server adapter — FFA-LoRA and
    #: RoLoRA need the frozen factor identical everywhere, FedAvg-style methods average from a common
    #: start). Factors not listed are personal and drawn per client (PF2LoRA's C, D; H²Tune's A, B).
    global_factors: ClassVar[tuple[str, ...]] = ("lora_A", "lora_B")
    #: a trainable classifier head (LLM runtime; parameters ``*.head_weight`` / ``*.head_bias`` with the
    #: replica dimension) is "shared" — trained, uploaded and averaged like the common adapter —,
    #: "personal" — trained, never sent — or "frozen" (docs/design.md §8; no head parameters at all then).
    #: ``default_head`` is the paper's setting, ``head_modes`` what the method supports.
    default_head: ClassVar[str] = "shared"
    head_modes: ClassVar[tuple[str, ...]] = ("frozen", "shared", "personal")
    #: the clients end with one common model (evaluated as "the global model"); False for
    #: personalised-only methods (FedSA's B_k, H²Tune's private A_k, B_k, Local)
    has_global_model: ClassVar[bool] = True
    #: one model trained on the clients' pooled data (Centralized): a runtime trains ONE client on
    #: the union of the clients' rows, and that model is both every client's and the global model
    pooled_data: ClassVar[bool] = False
    #: each client ends with a model of its own (personal factors, a personalisation step, or no
    #: server at all): PF2LoRA, FedSA-LoRA, H²Tune, Per-FedAvg, Local; plots and tables mark them
    personalised: ClassVar[bool] = False
    #: part of a round's training runs in ``end_round`` for every replica alike (LoRA-A²'s masked
    #: steps after the probe), so replicas trained together must take the same number of local steps
    #: (a runtime groups clients with unequal steps into separate passes)
    equal_steps_per_pass: ClassVar[bool] = False

    # -- what a runtime needs to know about the options (declared here so no runtime tests names) --
    #: the option that is the method's main step size (a config's ``method.lr`` sets it)
    lr_option: ClassVar[str] = "lr"
    #: the option that is the method's rank (a config's ``method.rank`` sets it); None: no such option
    rank_option: ClassVar[str | None] = "rank"
    #: the option that chooses the optimizer of the main step size ("adamw" | "sgd")
    optimizer_option: ClassVar[str | None] = "optimizer"
    #: the main step size per optimizer when a real-model run (``fedlora run``) names none: LoRA on a
    #: pretrained encoder, batch 16 — AdamW 2e-3 (the bundled MiniLM run's step), SGD 0.2 (H²Tune on
    #: that run: 0.5 learns fastest for 7 rounds and then two clients' losses blow up; 2.0 diverges in
    #: round 2; docs/methods/index.md, "Each method in the LLM runtime"). The constructor's ``lr`` default is the testbed's.
    llm_lr: ClassVar[dict[str, float]] = {"adamw": 2e-3, "sgd": 0.2}
    #: other options a real-model run uses unless its config sets them: the paper's own LLM setting
    llm_options: ClassVar[dict[str, Any]] = {}

    @classmethod
    def derive_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        """Options that follow from others where the config leaves them out (e.g. HetLoRA's r_max
        from r_min); the default adds nothing."""
        return options

    def step_sizes(self) -> dict[str, dict[str, Any]]:
        """Every step size the method uses: option name → ``{"optimizer", "lr"}`` (what the dry run
        and config.json report). Subclasses with more than the main one extend it."""
        opt = getattr(self, self.optimizer_option, None) if self.optimizer_option else None
        return {self.lr_option: {"optimizer": opt, "lr": float(getattr(self, self.lr_option))}}

    #: the schedule's factor f(t) on every step size (``set_lr_factor``); methods with a step that is
    #: not an optimizer's (PF2LoRA's lower level, Per-FedAvg's inner step) multiply it in themselves
    lr_factor: float = 1.0

    def set_lr_factor(self, factor: float) -> None:
        """Scale every step size of the method to ``factor`` × its configured value (a schedule's
        f(t)): every optimizer's param groups and the method's own steps (``lr_factor``)."""
        self.lr_factor = float(factor)
        for opt in self._optimizers():
            for g in opt.param_groups:
                g.setdefault("base_lr", g["lr"])
                g["lr"] = g["base_lr"] * self.lr_factor

    @classmethod
    def sample_dp_refusal_for(cls, options: Mapping[str, Any]) -> str | None:
        """``sample_dp_refusal`` of the method built with ``options`` (its constructor's keywords, as a config's
        ``method`` section gives them): a run's config check asks this, before the method is built; a method whose
        support depends on an option (Per-FedAvg's variant) overrides it."""
        return cls.sample_dp_refusal

    @classmethod
    def sample_dp_releases_for(cls, options: Mapping[str, Any]) -> int:
        """``sample_dp_releases`` of the method built with ``options`` (as ``sample_dp_refusal_for``): what a run's
        privacy plan counts per local step before the method is built; a method whose count depends on an option
        (FedDPA's variant) overrides it."""
        return int(cls.sample_dp_releases)

    def set_sample_dp(self, sample_dp: Any) -> None:
        """Train with sample-level DP-SGD (a ``fedlora.privacy.dpsgd.SampleDP``), or normally again (None). A method
        that cannot (``sample_dp_refusal``) is a one-line ``ConfigError`` saying why."""
        if sample_dp is not None and self.sample_dp_refusal is not None:
            raise ConfigError(f"{self.name}: sample-level DP is not supported: {self.sample_dp_refusal}")
        self.sample_dp = sample_dp

    def private_grads(self, losses: Callable[[], torch.Tensor], names: Sequence[str],
                      transform: Callable[[dict], dict] | None = None) -> dict[str, torch.Tensor]:
        """DP-SGD's gradient (Abadi et al., CCS 2016, Alg. 1) of the parameters ``names``: name → (G, *shape) =
        (Σᵢ clip_C(gᵢ) + N(0, σ²C²)) / (q·n_k) per replica, from the attached ``sample_dp`` at its current release
        (``fedlora.privacy.dpsgd.private_gradients``; ``transform`` as there). ``losses()`` runs the forward on one
        Poisson batch and gives each replica the SUM of its real examples' losses (the objective does on the slot
        executor's Poisson batches). A data-independent term of a method's loss (a regulariser of the parameters
        alone) is not part of it: its exact gradient is added by the caller."""
        from ..privacy.dpsgd import private_gradients

        return private_gradients(self.sample_dp, self.model, losses, names, self.replica_clients, transform=transform)

    def private_difference(self, plus: Callable[[], torch.Tensor], minus: Callable[[], torch.Tensor],
                           names: Sequence[str], scale: "float | torch.Tensor") -> dict[str, torch.Tensor]:
        """DP-SGD's release of a finite difference of the parameters ``names``' gradients (a Hessian-vector term):
        each example's (∇ℓᵢ at ``plus()``'s point − at ``minus()``'s)·``scale`` (a number or one per replica) clipped as
        one vector, summed, noised, / q·n_k (``fedlora.privacy.dpsgd.private_difference``); name → (G, *shape)."""
        from ..privacy.dpsgd import private_difference

        return private_difference(self.sample_dp, self.model, plus, minus, names, self.replica_clients, scale)

    def private_directional(self, losses: Callable[[], torch.Tensor], names: Sequence[str]) -> dict[str, torch.Tensor]:
        """DP-SGD's release of each example's Hessian-vector product: inside a forward-mode dual level, ``losses()``
        at parameters made dual (tangent v), each example's d/dε ∇ℓᵢ of ``names`` clipped as one vector, summed,
        noised, / q·n_k (``fedlora.privacy.dpsgd.private_directional``); name → (G, *shape)."""
        from ..privacy.dpsgd import private_directional

        return private_directional(self.sample_dp, self.model, losses, names, self.replica_clients)

    def setup(self, model: nn.Module, replica_clients: Sequence[int], n_clients: int | None = None) -> None:
        """Bind to ``model`` and put the protocol's initial state on every replica: ``bind`` then
        ``init_state``. ``replica_clients[i]`` is the client index k of replica i.

        Replicas are group-major (see ``fedlora.server.Federation``): replica i belongs to
        federation ``i // n_clients``; ``self.groups`` lists each federation's replicas.
        ``n_clients``: clients per federation (default ``max(replica_clients) + 1``).
        """
        self.bind(model, replica_clients, n_clients)
        self.init_state()

    def bind(self, model: nn.Module, replica_clients: Sequence[int], n_clients: int | None = None) -> None:
        """Attach to ``model`` WITHOUT changing any value: parameter names, optimizers, per-replica
        configuration (ranks, budgets, densities of the client each replica holds).

        The LLM runtime binds once per pass, with the pass's participants in the slots, then loads
        their client state records (``load_replica_state``); the synthetic simulator binds once
        (through ``setup``). Subclasses extend it and call ``super().bind`` first. Only trainable
        parameters (``requires_grad``) are the method's: a frozen base model is not.
        """
        self.model = model
        self.replica_clients = list(replica_clients)
        if not self.replica_clients or any(not isinstance(k, int) or k < 0 for k in self.replica_clients):
            raise ConfigError(f"{self.name}: replica_clients must be a non-empty list of client indices ≥ 0, "
                              f"got {replica_clients!r}")
        self.n_clients = max(self.replica_clients) + 1 if n_clients is None else int(n_clients)
        if self.n_clients <= max(self.replica_clients):
            raise ConfigError(f"{self.name}: n_clients={self.n_clients} but replica_clients names client "
                              f"{max(self.replica_clients)}")
        G = len(self.replica_clients)
        self.groups = [list(range(g, min(g + self.n_clients, G))) for g in range(0, G, self.n_clients)]
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}

    @property
    def needs_second_order(self) -> bool:
        """The local step differentiates through a gradient (double backward): PF2LoRA's exact
        hypergradient. A runtime then avoids ops without second derivatives (fused attention)."""
        return False

    @property
    def head_mode(self) -> str:
        """How this instance treats a trainable head (a runtime's ``RuntimeFacts.head_mode`` through
        ``use_runtime``; default ``default_head``)."""
        return self.__dict__.get("_head_mode", self.default_head)

    @head_mode.setter
    def head_mode(self, mode: str) -> None:
        if mode not in self.head_modes:
            raise ConfigError(f"{self.name}: head must be one of {', '.join(self.head_modes)}, got {mode!r}")
        self.__dict__["_head_mode"] = mode

    def use_runtime(self, facts: RuntimeFacts) -> None:
        """Take what the runtime says of itself (``RuntimeFacts``), in one call before ``bind``; the base
        takes the head mode (a bad one: a one-line ``ConfigError`` naming ``head_modes``). Methods that
        use other facts extend it and call ``super().use_runtime`` first."""
        if not isinstance(facts, RuntimeFacts):
            raise TypeError(f"{self.name}: use_runtime takes a RuntimeFacts, got {type(facts).__name__}")
        if facts.head_mode is not None:
            self.head_mode = facts.head_mode

    def head_names(self) -> list[str]:
        """The trainable head's parameters (empty when the model has none or the head is frozen)."""
        return [] if self.head_mode == "frozen" else self._names("head_weight", "head_bias")

    def shared_head_names(self) -> list[str]:
        """The head parameters a client uploads (the head is averaged like the common adapter)."""
        return self.head_names() if self.head_mode == "shared" else []

    def init_state(self) -> None:
        """The protocol's state before round 0 on the bound replicas (subclasses extend it): here,
        the server's one-time broadcast of the initial adapter — each federation's first replica's
        ``global_factors`` copied to its other replicas (not counted as traffic)."""
        if self.global_factors:
            broadcast_initial_factors(self.model, self.groups, self.global_factors)

    # the server's state (both runtimes) ------------------------------------------------------
    def initial_server_state(self, replica: int) -> dict[str, torch.Tensor]:
        """The server's state before round 0, read off ``replica`` (a replica that holds the
        broadcast initial adapter). Default: none — the first aggregate becomes the state."""
        return {}

    def server_update(self, state: Mapping[str, torch.Tensor], aggregated: Mapping[str, torch.Tensor]
                      ) -> dict[str, torch.Tensor]:
        """Pure: the server's new state after a round, from its old state and this round's
        ``aggregate``. Default: the aggregate's entries replace the old ones (the others stay), so
        e.g. RoLoRA's server holds the latest A and the latest B. Entries that changed are what a
        client that synchronised before this round must download (``fedlora.simulator.DownloadLedger``)."""
        return {**state, **aggregated}

    def client_dp_reference(self, state: Mapping[str, torch.Tensor], initial: Mapping[str, torch.Tensor],
                            upload: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Pure: what a client started the round from, for each tensor of ``upload`` (one of the round's uploads) —
        what its client-level DP update is taken against (``fedlora.privacy.client_dp``). Default: the server's
        ``state`` where it holds the tensor (the client downloaded it), else ``initial``, the broadcast initial
        adapter. A method whose clients start elsewhere overrides it (FRLoRA: (B0, A0) every round; Fed-SB: an
        uploaded gradient is its own update)."""
        return {**initial, **state}

    def describe_replica(self, replica: int) -> dict[str, Any]:
        """What a run records about replica ``replica`` each round: its ranks (per-client ranks of
        HetLoRA/FlexLoRA/FLoRA, LoRA-A²'s selected ranks, PF2LoRA's r and r̃)."""
        kw = self.adapter_kwargs()
        return {"rank": int(kw["rank"]), **({"client_rank": int(kw["client_rank"])} if kw.get("client_rank") else {})}

    def global_replica(self, replica: int) -> None:
        """Prepare ``replica`` to hold the global model before the server's full state is downloaded
        into it (evaluation of the global model): e.g. HetLoRA's and FlexLoRA's full server rank."""

    def apply_to_base(self, state: Mapping[str, torch.Tensor]) -> None:
        """Methods whose download is an increment of the frozen base (FLoRA): merge the round's
        ``state`` into the shared base model once, on the server side (LLM runtime)."""
        raise NotImplementedError(f"{self.name} does not merge into the base model")

    # PEFT adapters trained anywhere, aggregated with this method's server (fedlora.peft_adapters) --------
    #: the factors (``lora_A``, ``lora_B``) a client uploads when this method's server is a function of the
    #: clients' LoRA factors alone, so that adapters trained elsewhere (PEFT's own loop, a Flower app) can be
    #: aggregated with it (``fedlora.peft_adapters.aggregate_adapters``, ``fedlora aggregate``). The factors
    #: not listed stay the client's: private (a personalised method: FedSA's B_k) or frozen and shared by every
    #: client (FFA's A). Empty (the default): the server needs more than plain LoRA factors (PF2LoRA's
    #: hypergradient steps, H²Tune's middle matrices, LoRA-A²'s masked deltas with their indices): refused.
    lora_upload: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def check_lora_clients(cls, clients: Sequence[Mapping[str, tuple[torch.Tensor, torch.Tensor, float]]], *,
                           one_rank: bool = True, one_scale: bool = True) -> None:
        """What ``uploads_from_lora`` needs of the clients' factors, each a one-line ``ConfigError``: a method
        whose server uses them (``lora_upload`` not empty); ``one_rank``: one rank per module for every client;
        ``one_scale``: one scale per module for every client; and, for a method with a global model, the
        factors it does not upload identical on every client (frozen and shared)."""
        if not cls.lora_upload:
            able = sorted(n for n, c in _REGISTRY.items() if c.lora_upload)
            raise ConfigError(f"{cls.name}: its server needs more than the clients' LoRA factors, so adapters "
                              f"trained elsewhere cannot be aggregated with it; methods that can: {', '.join(able)}")
        het = sorted(n for n, c in _REGISTRY.items() if any(o in method_parameters(c) for o in _RANK_BUDGET_OPTIONS)
                     and c.lora_upload)
        for m, (a, b, s) in clients[0].items():
            for k, client in enumerate(clients[1:], 1):
                a_k, b_k, s_k = client[m]
                if one_rank and (a_k.shape != a.shape or b_k.shape != b.shape):
                    raise ConfigError(f"{cls.name}: module {m!r} has rank {a.shape[0]} in client 0 and {a_k.shape[0]} "
                                      f"in client {k}; {cls.name} needs one rank for every client (methods that take "
                                      f"different ranks: {', '.join(het)})")
                if one_scale and s_k != s:
                    raise ConfigError(f"{cls.name}: module {m!r} has LoRA scale {s:g} in client 0 and {s_k:g} in "
                                      f"client {k}; {cls.name} averages factors, which needs one scale (lora_alpha/r, "
                                      f"or lora_alpha/√r with use_rslora) for every client")
                frozen = [(leaf, x, x_k) for leaf, x, x_k in (("lora_A", a, a_k), ("lora_B", b, b_k))
                          if leaf not in cls.lora_upload and not cls.personalised]
                for leaf, x, x_k in frozen:
                    if not torch.equal(x, x_k):
                        raise ConfigError(f"{cls.name}: client {k}'s {leaf} of module {m!r} differs from client 0's; "
                                          f"{cls.name} trains only {', '.join(cls.lora_upload)} over a {leaf} that is "
                                          f"frozen and the same on every client")

    def uploads_from_lora(self, clients: Sequence[Mapping[str, tuple[torch.Tensor, torch.Tensor, float]]]
                          ) -> list[Payload]:
        """Each client's upload built from its LoRA factors alone: per client, module name → (A (r, d_in),
        B (d_out, r), scale s) with ΔW = s·B A, the same modules for every client. The default suits a server
        that averages factors: one rank and one scale per module for every client, the ``lora_upload`` factors
        as ``<module>.lora_A`` / ``<module>.lora_B``, and (a method with a global model) the factors not
        uploaded identical on every client. A method whose uploads carry more (ranks, scales) overrides it.
        What does not fit is a one-line ``ConfigError``. Called on the method built with the user's options
        (without ``bind``: no model)."""
        self.check_lora_clients(clients)
        return [Payload({f"{m}.{leaf}": (a if leaf == "lora_A" else b) for leaf in self.lora_upload
                         for m, (a, b, _) in client.items()}) for client in clients]

    def lora_server_state(self, clients: Sequence[Mapping[str, tuple[torch.Tensor, torch.Tensor, float]]]
                          ) -> dict[str, torch.Tensor]:
        """The server's state before this round as far as the clients' factors tell it (``server_update``'s
        ``state``): FedSVD's A, frozen and the same on every client. Default: none (``initial_server_state``'s)."""
        return {}

    def lora_download(self, state: Mapping[str, torch.Tensor],
                      client: Mapping[str, tuple[torch.Tensor, torch.Tensor, float]]
                      ) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
        """A client's LoRA factors after it took the server's ``state`` (what ``download`` writes into its
        replica), from its own ``client`` (module → (A, B, s)). Default: the state's ``<module>.lora_A`` /
        ``<module>.lora_B`` replace the client's; the rest stays, and so does the scale."""
        return {m: (state.get(f"{m}.lora_A", a), state.get(f"{m}.lora_B", b), s) for m, (a, b, s) in client.items()}

    def lora_base_delta(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What the server's ``state`` adds to each module's frozen base weight: module name → (d_out, d_in)
        (FLoRA's merged stack, FedEx-LoRA's residual). Default: nothing (the base stays)."""
        return {}

    def upload_spec(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every tensor a client of this method may upload: name → (full shape, dtype), what the server
        checks uploads against (``fedlora.server.UploadSpec``). Default: the trainable parameters
        (without the replica dimension) — truncated ranks and index sets are slices of them. A method
        that uploads something else (H²Tune's per-type R) extends it."""
        return {n: (tuple(p.shape[1:]), p.dtype) for n, p in self.params.items()}

    def runtime_state(self) -> dict[str, torch.Tensor]:
        """State the method keeps across rounds outside every client record and the server's state —
        what a checkpoint must hold besides them (FLoRA: the merged shared base and its merge history).
        Default: none."""
        return {}

    def load_runtime_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Put back ``runtime_state`` (a resumed run)."""
        if state:
            raise ConfigError(f"{self.name}: unexpected runtime state {sorted(state)[:3]}")

    # client state records (docs/design.md §8): everything replica i keeps between rounds -----------------
    def stacked_buffers(self) -> dict[str, torch.Tensor]:
        """Buffers with a replica dimension (TriLoRA supports, a per-replica merged W0), by name."""
        out = {}
        for mod_name, mod in self.model.named_modules():
            for b in getattr(mod, "replica_buffers", lambda: ())():
                out[f"{mod_name}.{b}" if mod_name else b] = getattr(mod, b)
        return out

    def _optimizer_attrs(self) -> dict[str, torch.optim.Optimizer]:
        return {a: o for a, o in sorted(vars(self).items()) if isinstance(o, torch.optim.Optimizer)}

    def _named_trainables(self) -> dict[str, torch.Tensor]:
        """Name → tensor of everything an optimizer of this method may hold: the model's trainable
        parameters and the method's own (e.g. H²Tune's Ω, as ``attr.omega``)."""
        out = dict(self.params)
        out.update({f"attr.{a}": v for a, v in sorted(vars(self).items()) if isinstance(v, nn.Parameter)})
        return out

    def replica_state(self, replica: int) -> dict[str, torch.Tensor]:
        """Replica ``replica``'s client state record: a flat name → tensor dict (safetensors-ready)
        with its trainable parameters (``param:``), stacked buffers (``buffer:``), optimizer state
        (``optim:<attr>:<param>:<key>``: moments and StackedAdamW step counts) and method state
        (``extra:``: ranks, masks, received global matrices…). Copies, detached.

        ``load_replica_state`` puts it back into any replica of a model bound with the same method
        and options: a client's numbers do not depend on the slot it trains in."""
        G = len(self.replica_clients)
        out: dict[str, torch.Tensor] = {}
        for n, p in self.params.items():
            out[f"param:{n}"] = p.detach()[replica].clone()
        for n, b in self.stacked_buffers().items():
            out[f"buffer:{n}"] = b[replica].clone()
        names = {id(t): n for n, t in self._named_trainables().items()}
        for attr, opt in self._optimizer_attrs().items():
            for p, st in opt.state.items():
                for k, v in st.items():
                    if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == G:
                        out[f"optim:{attr}:{names[id(p)]}:{k}"] = v[replica].clone()
        for k, v in self._extra_state().items():
            out[f"extra:{k}"] = v[replica].clone()
        return out

    def load_replica_state(self, replica: int, record: Mapping[str, torch.Tensor]) -> None:
        """Write a client state record (``replica_state``) into replica ``replica``. Optimizer state
        the record does not hold is reset to a fresh optimizer's (zero moments, step 0)."""
        G = len(self.replica_clients)
        stacked = self.stacked_buffers()
        named = self._named_trainables()
        opts = self._optimizer_attrs()
        extra: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for opt in opts.values():  # what the record does not hold is fresh
                for st in opt.state.values():
                    for v in st.values():
                        if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == G:
                            v[replica] = 0
            for key, v in record.items():
                kind, _, rest = key.partition(":")
                if kind == "param":
                    if rest not in self.params:
                        raise ConfigError(f"{self.name}: record entry {key!r} names no trainable parameter of the model")
                    self.params[rest][replica] = v
                elif kind == "buffer":
                    if rest not in stacked:
                        raise ConfigError(f"{self.name}: record entry {key!r} names no per-replica buffer")
                    stacked[rest][replica] = v
                elif kind == "optim":
                    attr, pname, k = rest.split(":")
                    if attr not in opts or pname not in named:
                        raise ConfigError(f"{self.name}: record entry {key!r} names no optimizer state of this method")
                    p = named[pname]
                    st = opts[attr].state[p]
                    if k not in st:  # a fresh optimizer: state is created on first use
                        st[k] = torch.zeros((G, *v.shape), dtype=v.dtype, device=p.device)
                    st[k][replica] = v
                elif kind == "extra":
                    extra[rest] = v
                else:
                    raise ConfigError(f"{self.name}: unknown record entry {key!r}")
            if extra:
                full = self._extra_state()
                missing = sorted(set(full) - set(extra))
                if missing or set(extra) - set(full):
                    raise ConfigError(f"{self.name}: record's method state {sorted(extra)} does not match "
                                      f"this method's {sorted(full)}")
                for k, v in extra.items():
                    full[k][replica] = v
                self._restore_extra_state(full, torch.tensor([replica]))

    @staticmethod
    def check_seed(method: str, seed: Any) -> Any:
        """``seed``: an integer ≥ 0, or one integer ≥ 0 per federation (a list); returned as given."""
        seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed]
        if not seeds or any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in seeds):
            raise ConfigError(f"{method}: seed must be an integer ≥ 0 or a non-empty list of them "
                              f"(one per federation), got {seed!r}")
        return list(seed) if isinstance(seed, (list, tuple)) else seed

    def federation_seed(self, group: int) -> int:
        """The seed of federation ``group`` for the method's own random draws: ``seed[group]`` when
        one seed per federation was given (so a federation's numbers do not depend on which others
        share the stack), else ``seed + group``."""
        seed = getattr(self, "seed", 0)
        if isinstance(seed, list):
            if len(seed) != len(self.groups):
                raise ConfigError(f"{self.name}: {len(seed)} seeds for {len(self.groups)} federations")
            return seed[group]
        return seed_of(seed, FEDERATION, group)

    def personalised_params(self, objective: "Objective", sample: "Sampler") -> Mapping[str, torch.Tensor] | None:
        """Parameters to evaluate each client with, or ``None`` for the current ones.

        Per-FedAvg evaluates after one local SGD step ([PF2LoRA] App. D); everyone else as is."""
        return None

    def instance_gating(self) -> Any:
        """Per-input weights of the two adapters at evaluation, or ``None`` (the default: every input is
        scored on one model, ``personalised_params``). FedDPA's instance-wise dynamic weighting returns a
        ``fedlora.methods.feddpa.InstanceWeighting``, which the LLM runtime's evaluation applies per batch
        (``SlotExecutor.evaluate``: one more forward for the inputs' representations, then
        ``fedlora.adapter.set_row_gates``); called after the clients' records are loaded."""
        return None

    # client sampling: replicas sampled out of a round must end it as they began ----------------
    def snapshot(self) -> dict[str, Any]:
        """Everything a round may change on a replica: parameters, buffers with a stack dimension,
        optimizer moments, and method state from ``_extra_state``. Restored by ``restore``."""
        snap: dict[str, Any] = {"params": {n: p.detach().clone() for n, p in self.params.items()},
                                "buffers": {n: b.clone() for n, b in self.stacked_buffers().items()},
                                "opt": {}, "extra": self._extra_state()}
        for opt in self._optimizers():
            for p, st in opt.state.items():
                snap["opt"][id(p)] = {k: v.clone() for k, v in st.items()
                                      if isinstance(v, torch.Tensor) and v.dim() >= 1}
        return snap

    def restore(self, snap: Mapping[str, Any], replicas: Sequence[int]) -> None:
        """Put ``replicas`` back to ``snap`` (stack dimension 0): parameters, stacked buffers,
        optimizer state with a replica dimension — ``fedlora.optim.StackedAdamW`` keeps its step
        count per replica, so Adam's bias correction rewinds with the moments — and extra state."""
        if not replicas:
            return
        idx = torch.as_tensor(list(replicas), dtype=torch.long)
        with torch.no_grad():
            for n, p in self.params.items():
                if p.dim() >= 1 and p.shape[0] == len(self.replica_clients):
                    p[idx] = snap["params"][n][idx]
            for n, b in self.stacked_buffers().items():
                old = snap["buffers"].get(n)
                if old is not None and old.shape == b.shape:
                    b[idx] = old[idx]
            G = len(self.replica_clients)
            for opt in self._optimizers():
                for p, st in opt.state.items():
                    saved = snap["opt"].get(id(p), {})
                    for k, v in st.items():
                        if not (isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == G):
                            continue
                        old = saved.get(k)
                        if old is None:  # state created during the round: the replica had none,
                            v[idx] = 0   # i.e. fresh AdamW moments / SGD momentum buffer
                        elif old.shape == v.shape:
                            v[idx] = old[idx]
        self._restore_extra_state(snap["extra"], idx)

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        return list(self._optimizer_attrs().values())

    def _extra_state(self) -> dict[str, torch.Tensor]:
        """Per-replica method state (tensors with the replica dimension first), e.g. ranks."""
        return {}

    def _restore_extra_state(self, extra: Mapping[str, torch.Tensor], idx: torch.Tensor) -> None:
        pass

    def begin_round(self, round_idx: int) -> None:
        """Called after the download, before the first local step of a round."""

    @abc.abstractmethod
    def local_step(self, objective: Objective, sample: Sampler) -> None:
        """One local step of every replica."""

    def end_round(self, round_idx: int) -> None:
        """Called after the last local step, before the upload."""

    @abc.abstractmethod
    def upload(self, replica: int) -> Payload:
        """What replica ``replica`` sends to its server this round."""

    @staticmethod
    @abc.abstractmethod
    def aggregate(payloads: Sequence[Payload], weights: torch.Tensor) -> dict[str, torch.Tensor]:
        """Pure: client payloads + weights → the server's new global state (inputs untouched)."""

    @abc.abstractmethod
    def download(self, replica: int, state: Mapping[str, torch.Tensor]) -> Payload:
        """Write the server's state into replica ``replica``; return what was sent to it."""

    # helpers shared by subclasses (public: a method of your own uses them) -------------------------
    def upload_params(self, replica: int, names: Sequence[str]) -> Payload:
        """Replica ``replica``'s slice of the parameters ``names``, detached copies (what is sent is a
        snapshot): the usual ``upload``."""
        return Payload({n: self.params[n][replica].detach().clone() for n in names})

    def _write(self, replica: int, state: Mapping[str, torch.Tensor]) -> Payload:
        """Copy the server's tensors into ``replica``'s slice; what was sent is exactly ``state``."""
        with torch.no_grad():
            for n, v in state.items():
                self.params[n][replica].copy_(v)
        return Payload(dict(state))

    def _names(self, *suffixes: str) -> list[str]:
        return [n for n in self.params if n.rsplit(".", 1)[-1] in suffixes]

    def upload_head(self, replica: int) -> dict[str, torch.Tensor]:
        """Replica ``replica``'s shared classifier head (``shared_head_names``; none otherwise), detached
        copies: what a method whose factors are uploaded its own way adds to its upload."""
        return {n: self.params[n][replica].detach().clone() for n in self.shared_head_names()}

    @staticmethod
    def aggregate_head(payloads: Sequence[Payload], weights: torch.Tensor) -> dict[str, torch.Tensor]:
        """The data-weighted mean (FedAvg) of the uploaded classifier head, if the uploads carry one."""
        heads = [n for n in payloads[0].tensors if n.endswith(("head_weight", "head_bias"))]
        return fedavg_factors([{n: p.tensors[n] for n in heads} for p in payloads], weights) if heads else {}

    @torch.no_grad()
    def download_head(self, replica: int, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Write the server's head (where ``state`` holds it) into replica ``replica``; returns what was sent."""
        sent = {}
        for n in self.shared_head_names():
            if n in state:
                self.params[n][replica] = state[n]
                sent[n] = state[n]
        return sent


class RankSlots:
    """Per-client ranks on a stacked adapter of ``slots`` rank slots (HetLoRA, FlexLoRA, FLoRA): replica i
    uses its first r_i slots and the others are held at exactly zero — the zero-padding of a rank-r_i
    LoRA — so their gradients vanish and the batched step equals training each client at its own rank.
    The one owner of the slot mask, the truncated upload (the first r_i rows of A, columns of B) and the
    zero-padded download. ``ranks``: (G,) integers; ``set`` replaces them (the mask follows)."""

    def __init__(self, ranks: torch.Tensor, slots: int) -> None:
        self.slots = int(slots)
        self.set(ranks)

    def set(self, ranks: torch.Tensor) -> None:
        self.ranks = ranks
        self.mask = torch.arange(self.slots)[None, :] < ranks.cpu()[:, None]  # (G, slots): slot j < r_i

    def rank(self, replica: int) -> int:
        return int(self.ranks[replica])

    @torch.no_grad()
    def apply(self, params: Mapping[str, torch.Tensor], pairs: Sequence[tuple[str, str]]) -> None:
        """Zero every replica's slots r_i..slots−1 of each (A, B) pair, in place (A (G, slots, d_in) rows,
        B (G, d_out, slots) columns)."""
        for a, b in pairs:
            m = self.mask.to(device=params[a].device, dtype=params[a].dtype)
            params[a].mul_(m[:, :, None])
            params[b].mul_(m[:, None, :])

    def truncate(self, params: Mapping[str, torch.Tensor], pairs: Sequence[tuple[str, str]],
                 replica: int) -> dict[str, torch.Tensor]:
        """Replica ``replica``'s first r_i rows of A and columns of B per pair, detached copies (its upload)."""
        r = self.rank(replica)
        out = {}
        for a, b in pairs:
            out[a] = params[a][replica, :r].detach().clone()
            out[b] = params[b][replica, :, :r].detach().clone()
        return out

    @staticmethod
    @torch.no_grad()
    def pad_into(A: torch.Tensor, B: torch.Tensor, replica: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Write a rank-q pair ``a`` (q, d_in), ``b`` (d_out, q) into replica ``replica``'s first q slots of
        the stacked ``A``, ``B``, zeroing its other slots (the zero-padding)."""
        q = a.shape[0]
        A[replica].zero_()
        B[replica].zero_()
        A[replica, :q] = a.to(dtype=A.dtype, device=A.device)
        B[replica, :, :q] = b.to(dtype=B.dtype, device=B.device)


class AveragedFactors(Method):
    """A Method whose server takes the weighted mean of every uploaded tensor, Σ_k w_k T_k
    (``fedavg_factors``), and whose download writes that mean into the replica.

    FedAvg-LoRA ([RoLoRA] eq. 2), FFA-LoRA, RoLoRA (eq. 3–4), FedSA-LoRA and Per-FedAvg differ only in
    what they train and upload, so they share this server (PF2LoRA's download too; its server is the
    uniform 1/M mean of [PF2LoRA] Alg. 1 line 8).
    """

    client_dp_refusal = None  # the weighted mean of the uploads: DP-FedAvg applies as it is

    @staticmethod
    def aggregate(payloads: Sequence[Payload], weights: torch.Tensor) -> dict[str, torch.Tensor]:
        """Σ_k w_k T_k for every uploaded tensor name, separately (A and B are averaged apart)."""
        return fedavg_factors([p.tensors for p in payloads], weights)

    def download(self, replica: int, state: Mapping[str, torch.Tensor]) -> Payload:
        return self._write(replica, state)
