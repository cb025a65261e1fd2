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

from ..errors import ConfigError
from ..payload import Payload

__all__ = ["Method", "Objective", "Sampler", "register", "get_method", "available_methods"]

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

    def setup(self, model: nn.Module, replica_clients: Sequence[int]) -> None:
        """Bind to ``model``; ``replica_clients[i]`` is the client index k of replica i."""
        self.model = model
        self.replica_clients = list(replica_clients)
        self.params = dict(model.named_parameters())

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
    def _names(self, *suffixes: str) -> list[str]:
        return [n for n in self.params if n.rsplit(".", 1)[-1] in suffixes]
