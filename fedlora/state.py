"""Client state records and where they live between rounds (docs/design.md §8).

A client state record is everything one client keeps between rounds — its personal factors and the
global factors it last received, optimizer moments and step counts, ranks and masks, the state of its
data sampler's RNG — as a flat name → tensor dict (``Method.replica_state`` plus the runtime's own
entries). It is what the LLM runtime loads into a slot for a pass and stores back afterwards, what a
checkpoint holds per client, and what a Flower ClientApp keeps in its context state: one
abstraction, three uses. Records are safetensors-serialisable (``record_to_bytes``).

``ClientStore`` keeps them in CPU memory or on disk (one safetensors file per client, written
atomically: a crash never leaves half a record).
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, Mapping

import torch
from safetensors.torch import load as _st_load
from safetensors.torch import load_file as _st_load_file
from safetensors.torch import save as _st_save

from .errors import ConfigError
from .io import write_bytes_atomic

__all__ = ["ClientStore", "record_to_bytes", "record_from_bytes", "record_nbytes"]

Record = Mapping[str, torch.Tensor]


def _cpu(record: Record) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in record.items()}


def record_to_bytes(record: Record) -> bytes:
    """The record as one safetensors blob (what a checkpoint or a Flower context stores)."""
    return _st_save(_cpu(record))


def record_from_bytes(blob: bytes) -> dict[str, torch.Tensor]:
    return dict(_st_load(blob))


def record_nbytes(record: Record) -> int:
    """Tensor bytes of a record (what it costs to keep one client)."""
    return sum(v.numel() * v.element_size() for v in record.values())


class ClientStore:
    """Client state records by client index: ``kind="memory"`` (CPU tensors in a dict) or
    ``kind="disk"`` (``<path>/client_<k>.safetensors``). ``get`` returns a fresh dict of CPU tensors
    (never a view of what is stored), so loading a record into a slot cannot alter the store."""

    def __init__(self, kind: str = "memory", path: str | Path | None = None) -> None:
        if kind not in ("memory", "disk"):
            raise ConfigError(f"client store: kind must be 'memory' or 'disk', got {kind!r}")
        if kind == "disk":
            if path is None:
                raise ConfigError("client store: kind 'disk' needs a folder")
            self.path = Path(path)
            self.path.mkdir(parents=True, exist_ok=True)
        self.kind = kind
        self._mem: dict[int, dict[str, torch.Tensor]] = {}
        self._keys: set[int] = set()

    def _file(self, client: int) -> Path:
        return self.path / f"client_{client}.safetensors"

    def put(self, client: int, record: Record, copy: bool = True) -> None:
        """Store ``client``'s record. ``copy=False`` hands over tensors nobody else holds (e.g. fresh
        from ``Method.replica_state``): no second copy of every record in memory."""
        rec = _cpu(record)
        if self.kind == "memory":
            self._mem[client] = {k: v.clone() for k, v in rec.items()} if copy else dict(rec)
        else:
            write_bytes_atomic(self._file(client), _st_save(rec))
        self._keys.add(client)

    def get(self, client: int) -> dict[str, torch.Tensor]:
        if client not in self._keys:
            raise KeyError(f"client store: no record of client {client}")
        if self.kind == "memory":
            return {k: v.clone() for k, v in self._mem[client].items()}
        return dict(_st_load_file(str(self._file(client))))

    def __contains__(self, client: int) -> bool:
        return client in self._keys

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._keys))

    def __len__(self) -> int:
        return len(self._keys)

    def nbytes(self) -> int:
        """Tensor bytes of every stored record."""
        return sum(record_nbytes(self.get(k)) for k in self) if self.kind == "disk" else \
            sum(record_nbytes(r) for r in self._mem.values())
