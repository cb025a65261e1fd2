"""The Method abstraction (SPEC §2) and the registry that maps names to classes.

A Method declares the adapter structure it needs, runs a client's local steps, says what a client
uploads (a :class:`~fedlora.payload.Payload`) and aggregates on the server with a **pure** static
function of payloads and weights. Runtimes (the embedded simulator, later Flower) drive it.

Replicas: the model's adapter factors may carry a leading stack dimension G (see
``fedlora.adapter.LoRALinear``); replica ``i`` is one client of one independent federation. A
method's local step updates every replica at once — the math is elementwise or batched per
replica, so this equals G separate clients — while upload/download act on one replica's slice.
"""
from __future__ import annotations

import abc
from typing import Any, Callable, ClassVar, Mapping, Sequence

import torch
from torch import nn

from ..aggregation import fedavg_factors
from ..errors import ConfigError
from ..payload import Payload

__all__ = ["Method", "AveragedFactors", "Objective", "Sampler", "register", "get_method", "create_method",
           "available_methods"]


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


def available_methods() -> list[str]:
    return sorted(_REGISTRY)


#: option names that mean "clients have different ranks", and the methods that support that
_RANK_BUDGET_OPTIONS = ("client_ranks", "ranks", "initial_ranks")


def create_method(name: str, **options: Any) -> "Method":
    """Instantiate the registered method ``name`` with constructor ``options``.

    Unknown options fail with a ``ConfigError`` that lists the allowed ones (and, for per-client rank
    budgets given to a method with one rank for everyone, the methods that do support them).
    """
    import inspect

    cls = get_method(name)
    allowed = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        budgets = [u for u in unknown if u in _RANK_BUDGET_OPTIONS]
        if budgets:
            het = sorted(n for n, c in _REGISTRY.items()
                         if any(o in inspect.signature(c.__init__).parameters for o in _RANK_BUDGET_OPTIONS))
            raise ConfigError(f"{name}: per-client rank budgets ({', '.join(budgets)}) are not supported — every "
                              f"client has rank r here; methods with heterogeneous ranks: {', '.join(het)}")
        raise ConfigError(f"{name}: unknown option(s) {unknown}; allowed: {', '.join(allowed)}")
    return cls(**options)


def get_method(name: str) -> type["Method"]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown method {name!r}; available: {', '.join(available_methods())}") from None


class Method(abc.ABC):
    """One federated algorithm. Subclasses set ``name`` and implement the abstract hooks."""

    name: ClassVar[str] = ""
    #: rank of the client (never communicated) adapter this method needs; 0 = none
    needs_client_adapter: ClassVar[bool] = False
    #: the download is an increment every client must apply (not the full state): the simulator
    #: then counts its bytes for every client each round, sampled or not
    incremental_download: ClassVar[bool] = False

    def adapter_kwargs(self) -> dict[str, Any]:
        """The adapter structure this method needs, as ``LoRALinear`` keyword arguments
        (``rank``, ``client_rank``, ``middle``). Runtimes build the model from it."""
        rank = getattr(self, "rank", None)
        if rank is None:
            raise NotImplementedError(f"{type(self).__name__} must define adapter_kwargs() or a `rank`")
        return {"rank": rank}

    def setup(self, model: nn.Module, replica_clients: Sequence[int]) -> None:
        """Bind to ``model``; ``replica_clients[i]`` is the client index k of replica i.

        Replicas are group-major (see ``fedlora.simulator.Federation``): replica i belongs to
        federation ``i // n_clients``; ``self.groups`` lists each federation's replicas.
        """
        self.model = model
        self.replica_clients = list(replica_clients)
        self.n_clients = max(self.replica_clients) + 1
        G = len(self.replica_clients)
        self.groups = [list(range(g, min(g + self.n_clients, G))) for g in range(0, G, self.n_clients)]
        self.params = dict(model.named_parameters())

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
        return seed + group

    def personalised_params(self, objective: "Objective", sample: "Sampler") -> Mapping[str, torch.Tensor] | None:
        """Parameters to evaluate each client with, or ``None`` for the current ones.

        Per-FedAvg evaluates after one local SGD step (000_… App. D); everyone else as is."""
        return None

    # client sampling: replicas sampled out of a round must end it as they began ----------------
    def snapshot(self) -> dict[str, Any]:
        """Everything a round may change on a replica: parameters, buffers with a stack dimension,
        optimizer moments, and method state from ``_extra_state``. Restored by ``restore``."""
        snap: dict[str, Any] = {"params": {n: p.detach().clone() for n, p in self.params.items()},
                                "buffers": {n: b.clone() for n, b in self.model.named_buffers()
                                            if b is not None and b.dim() >= 1},
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
            for n, b in self.model.named_buffers():
                old = snap["buffers"].get(n)
                if old is not None and b.dim() >= 1 and b.shape[0] == len(self.replica_clients):
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
        return [o for o in vars(self).values() if isinstance(o, torch.optim.Optimizer)]

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

    # helpers shared by subclasses -------------------------------------------------------------
    def _upload(self, replica: int, names: Sequence[str]) -> Payload:
        """Replica ``replica``'s slice of ``names``, detached copies: what is sent is a snapshot."""
        return Payload({n: self.params[n][replica].detach().clone() for n in names})

    def _write(self, replica: int, state: Mapping[str, torch.Tensor]) -> Payload:
        """Copy the server's tensors into ``replica``'s slice; what was sent is exactly ``state``."""
        with torch.no_grad():
            for n, v in state.items():
                self.params[n][replica].copy_(v)
        return Payload(dict(state))

    def _names(self, *suffixes: str) -> list[str]:
        return [n for n in self.params if n.rsplit(".", 1)[-1] in suffixes]


class AveragedFactors(Method):
    """A Method whose server takes the weighted mean of every uploaded tensor, Σ_k w_k T_k
    (``fedavg_factors``), and whose download writes that mean into the replica.

    FedAvg-LoRA (002_… eq. 2), FFA-LoRA, RoLoRA (eq. 3–4), FedSA-LoRA, Per-FedAvg and PF2LoRA
    (000_… Alg. 1 line 8) differ only in what they train and upload, so they share this server.
    """

    @staticmethod
    def aggregate(payloads: Sequence[Payload], weights: torch.Tensor) -> dict[str, torch.Tensor]:
        """Σ_k w_k T_k for every uploaded tensor name, separately (A and B are averaged apart)."""
        return fedavg_factors([p.tensors for p in payloads], weights)

    def download(self, replica: int, state: Mapping[str, torch.Tensor]) -> Payload:
        return self._write(replica, state)
