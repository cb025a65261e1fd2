"""Payloads: exactly what crosses the network (docs/design.md §2). Bytes are measured, never estimated."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

__all__ = ["Payload"]

_SIZE_CACHE: dict[tuple, int] = {}


@dataclass(frozen=True)
class Payload:
    """Tensors (and small string metadata, e.g. index sets) sent by one party in one round.

    ``nbytes`` is the length of the safetensors serialisation: raw tensor bytes plus the JSON header
    with names, dtypes, shapes and metadata — what a real deployment would put on the wire.
    """

    tensors: Mapping[str, torch.Tensor]
    meta: Mapping[str, str] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        return _st_save({k: v.detach().contiguous().cpu() for k, v in self.tensors.items()},
                        metadata=dict(self.meta) or None)

    @property
    def nbytes(self) -> int:
        """Length of ``to_bytes()`` (0 for an empty payload, which is never sent). A safetensors blob's length depends only on names, dtypes,
        shapes and metadata, so it is measured once per such signature and then looked up."""
        if not self.tensors and not self.meta:
            return 0  # nothing to send: no message at all
        key = (tuple((k, v.dtype, tuple(v.shape)) for k, v in self.tensors.items()),
               tuple(sorted(self.meta.items())))
        size = _SIZE_CACHE.get(key)
        if size is None:
            size = _SIZE_CACHE[key] = len(self.to_bytes())
        return size

    @classmethod
    def from_bytes(cls, blob: bytes) -> "Payload":
        import json
        import struct

        (header_len,) = struct.unpack("<Q", blob[:8])
        meta = json.loads(blob[8:8 + header_len]).get("__metadata__", {}) or {}
        return cls(tensors=_st_load(blob), meta=meta)
