"""Dropout with each client's own masks (``model.dropout: true``; docs/design.md §8 "slots and passes").

A pass trains S clients in ONE forward on their batches concatenated slot-major: rows
[p·b, (p+1)·b) belong to slot p. ``torch.nn.Dropout`` would draw the whole pass's masks from one RNG,
so a client's masks would depend on its slot and on who shares its pass. Here every client has its
own dropout generator, seeded from (run seed, client) and kept in its state record (entry
``sampler:dropout``, next to its data sampler's: it resumes where it stopped), and slot p's mask is
drawn from slot p's generator with the shape of slot p's rows only:

* the positional dimensions (the sequence of hidden states (b, L, d); query and key of attention
  probabilities (b, H, L, L)) are drawn at the full ``model.max_length`` and cut to the pass's padded
  length L, so a client's mask on its own tokens does not depend on how long its pass-mates' rows are;
* the number of values drawn per call depends only on the client's own shapes, so the slot's stream
  is the same whatever slot it sits in and whoever shares the pass.

Dropout sites (transformers 5: BERT, RoBERTa, MiniLM (a BERT), GPT-2 and any model built on
``AttentionInterface``):

* every ``nn.Dropout`` module (embeddings, attention output, feed-forward output, pooler/classifier
  head; GPT-2's ``resid_dropout``, MLP and embedding dropout) is replaced by ``SlotDropout``;
* attention-probability dropout is not a module call in transformers 5 — the attention function
  receives ``dropout=p`` and calls ``F.dropout`` itself (eager) or passes ``dropout_p`` to SDPA — so
  the model is switched to the attention implementation ``fedlora_slot_eager`` registered here: the
  eager softmax(QKᵀ·s + mask)·V with the probabilities' dropout drawn per slot, the same formula as
  transformers' eager attention (which has second derivatives: PF2LoRA's hypergradient works).
  A HF model that cannot switch its attention implementation is refused (``ConfigError``): its
  attention dropout could not be made per-client. (A plain ``nn.Module`` gets the module swap only.)

Evaluation runs the model in eval mode: no site draws anything (``training`` is False).
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import nn

from fedlora.errors import ConfigError

__all__ = ["ClientDropout", "SlotDropout", "install_client_dropout", "ATTENTION", "KEY"]

#: the record entry of a client's dropout generator (``sampler:``: the runtime's own entries)
KEY = "sampler:dropout"
#: the registered attention implementation (eager attention with per-slot probability dropout)
ATTENTION = "fedlora_slot_eager"


class ClientDropout:
    """The dropout generators of the current pass's slots (one per client), and the masks they draw.

    ``enabled=False``: nothing is installed, records hold no generator, ``state``/``initial_state`` are
    empty. ``seq_len``: the canonical length positional dimensions are drawn at (``model.max_length``)."""

    def __init__(self, enabled: bool, seq_len: int, device: torch.device | str = "cpu") -> None:
        self.enabled, self.seq_len, self.device = bool(enabled), int(seq_len), torch.device(device)
        self.gens: list[torch.Generator] = []

    # records ---------------------------------------------------------------------------------
    def initial_state(self, seed: int) -> dict[str, torch.Tensor]:
        """A fresh client's entry: its generator seeded with ``seed`` (from the run seed and client)."""
        if not self.enabled:
            return {}
        return {KEY: torch.Generator(device=self.device).manual_seed(seed).get_state()}

    def load(self, slot: int, record: Mapping[str, torch.Tensor]) -> None:
        """The generator of ``record`` into ``slot``. A pass loads its slots in order 0, 1, …, S-1
        (loading slot 0 starts a new pass: the slots bound are those loaded since)."""
        if not self.enabled:
            return
        if slot > len(self.gens):
            raise ValueError(f"client dropout: slot {slot} loaded before slot {len(self.gens)}")
        g = torch.Generator(device=self.device)
        g.set_state(record[KEY])
        del self.gens[slot:]
        self.gens.append(g)

    def restore(self, slot: int, record: Mapping[str, torch.Tensor]) -> None:
        """Put ``slot``'s generator back to where ``record`` says (a client that finished its local
        steps before its pass-mates: the masks drawn for it since are not its own)."""
        if self.enabled:
            self.gens[slot].set_state(record[KEY])

    def state(self, slot: int) -> dict[str, torch.Tensor]:
        """``slot``'s entry for its client's record (where its generator stopped)."""
        return {KEY: self.gens[slot].get_state()} if self.enabled else {}

    # masks ------------------------------------------------------------------------------------
    def apply(self, x: torch.Tensor, p: float, seq_dims: Sequence[int] = ()) -> torch.Tensor:
        """Dropout of rate ``p`` on ``x`` (slot-major rows, leading dim S·b): slot p's rows times a
        mask from slot p's generator, kept values scaled by 1/(1-p) as ``nn.Dropout``. ``seq_dims``:
        positional dimensions, drawn at ``max(seq_len, size)`` and cut to the size."""
        S = len(self.gens)
        if S == 0 or x.shape[0] % S:
            raise ValueError(f"client dropout: {x.shape[0]} rows for {S} bound slots (load the pass's records)")
        if p >= 1.0:
            return x * 0.0
        b, rest = x.shape[0] // S, tuple(x.shape[1:])
        full = list((b, *rest))
        for d in seq_dims:
            full[d] = max(self.seq_len, full[d])
        cut = tuple(slice(0, n) for n in (b, *rest))
        keep = torch.empty((S, b, *rest), dtype=torch.bool, device=x.device)
        for s, g in enumerate(self.gens):
            keep[s] = torch.rand(full, generator=g, device=g.device)[cut].to(x.device) >= p
        mask = keep.view(x.shape).to(x.dtype).div_(1.0 - p)
        return x * mask


class SlotDropout(nn.Dropout):
    """``nn.Dropout`` whose masks come from the slots' own generators (``ClientDropout``). Inputs
    with three or more dimensions are (rows, sequence, …): dimension 1 is positional."""

    def __init__(self, p: float, rng: ClientDropout) -> None:
        super().__init__(p)
        self.rng = rng

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        return self.rng.apply(x, self.p, (1,) if x.dim() >= 3 else ())


def _rng_of(module: nn.Module) -> ClientDropout:
    for child in module.children():
        if isinstance(child, SlotDropout):
            return child.rng
    raise ConfigError(f"{ATTENTION}: {type(module).__name__} has no SlotDropout (install_client_dropout first)")


def slot_eager_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, scaling: float | None = None,
                         dropout: float = 0.0, **kwargs):
    """transformers' eager attention (BERT/RoBERTa/GPT-2 ``eager_attention_forward``) with the
    attention probabilities' dropout drawn per slot. (rows, heads, L_q, L_k): L_q and L_k positional."""
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    weights = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            weights = weights.masked_fill(~attention_mask, torch.finfo(weights.dtype).min)
        else:
            weights = weights + attention_mask
    weights = nn.functional.softmax(weights, dim=-1).type(value.dtype)
    if module.training and dropout > 0.0:
        weights = _rng_of(module).apply(weights, dropout, (2, 3))
    out = torch.matmul(weights, value).transpose(1, 2).contiguous()
    return out, weights


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTENTION, slot_eager_attention)
    AttentionMaskInterface.register(ATTENTION, eager_mask)  # additive float masks, causal ones materialised


def install_client_dropout(model: nn.Module, enabled: bool, seq_len: int,
                           device: torch.device | str = "cpu") -> ClientDropout:
    """Make ``model``'s dropout per client (when ``enabled``): every ``nn.Dropout`` becomes a
    ``SlotDropout`` and a HF model's attention runs ``fedlora_slot_eager``. Leaves the model in eval
    mode (the runtime switches it to train mode for training passes only). Returns the generators'
    holder the runtime loads and stores with the clients' records."""
    rng = ClientDropout(enabled, seq_len, device)
    if enabled:
        if hasattr(model, "set_attn_implementation"):
            can = getattr(model, "_can_set_attn_implementation", lambda: True)()
            if not can:
                raise ConfigError(f"model.dropout: {type(model).__name__} does not dispatch its attention through "
                                  f"transformers' AttentionInterface; its attention dropout cannot be drawn per client "
                                  f"(set model.dropout: false)")
            _register()
            model.set_attn_implementation(ATTENTION)
        for name, mod in list(model.named_modules()):
            if type(mod) is nn.Dropout:
                parent_name, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent_name) if parent_name else model, child,
                        SlotDropout(mod.p, rng))
    model.eval()
    return rng
