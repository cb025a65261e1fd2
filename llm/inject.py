"""Adapter injection into HuggingFace models (docs/design.md §8): the same ``fedlora.adapter.LoRALinear`` the
synthetic testbed trains, wrapped around the model's own linear layers, with a slot dimension.

Targets are chosen PEFT-style (``peft.tuners.tuners_utils.check_target_module_exists``): a list of
names matches a module whose full name equals an entry or ends with ``"." + entry``; a single string
is a regular expression matched against the full name (``re.fullmatch``); ``"all-linear"`` takes
every linear layer but the classifier head. ``layers`` restricts to transformer blocks by index (the
first all-digit component of the name: ``encoder.layer.3.attention.self.query`` → 3,
``transformer.h.3.attn.c_attn`` → 3). ``nn.Linear`` and GPT-2's ``Conv1D`` (weight stored
transposed, (d_in, d_out)) are supported; the frozen base weight is the model's own tensor, shared,
never copied (a ``Conv1D`` weight enters as the transposed view).

Slots (docs/design.md §8 "slots and passes"): every injected layer holds its factors with a leading dimension of
S slots, one per client of the current pass. Its input is the pass's batch, slot-major: rows
[p·b, (p+1)·b) belong to slot p. The layer reshapes (S·b, L, d) → (S, b·L, d), runs the stacked
kernel op (slot p's rows through slot p's adapter) and reshapes back; the frozen base GEMM is one
GEMM over all S·b·L rows. ``set_slots(model, S)`` re-creates the factors for a pass of S clients
(their values come from the clients' state records). A trained classifier head becomes a
``SlotHead`` (one head per slot).
"""
from __future__ import annotations

import re
from typing import Iterable, Sequence

import torch
from torch import nn

from fedlora.adapter import Capture, LoRALinear
from fedlora.errors import ConfigError

__all__ = ["SlotLoRALinear", "SlotHead", "linear_module_names", "match_targets", "layer_index",
           "inject_adapters", "make_head_trainable", "head_linear_names", "set_slots", "slot_modules", "default_targets",
           "HEAD_MODULES"]

#: module names PEFT treats as the sequence-classification head (``peft.utils.constants.SEQ_CLS_HEAD_NAMES``)
HEAD_MODULES = ("classifier", "score", "qa_outputs")  # qa_outputs: *ForQuestionAnswering's span head


def _conv1d_type():
    try:
        from transformers.pytorch_utils import Conv1D
    except Exception:  # transformers missing or changed: only nn.Linear is supported then
        return None
    return Conv1D


def _is_linear(mod: nn.Module) -> bool:
    conv = _conv1d_type()
    return isinstance(mod, nn.Linear) or (conv is not None and isinstance(mod, conv))


def _in_head(name: str, head_modules: Sequence[str]) -> bool:
    return any(re.match(rf"(^|.*\.){re.escape(h)}($|\..*)", name) for h in head_modules)


def linear_module_names(model: nn.Module, head_modules: Sequence[str] = HEAD_MODULES) -> list[str]:
    """Full names of the model's adaptable linear layers (nn.Linear, Conv1D), the head excluded."""
    return [n for n, m in model.named_modules() if _is_linear(m) and not _in_head(n, head_modules)]


def layer_index(name: str) -> int | None:
    """The transformer block a module belongs to: the first all-digit component of its name."""
    for part in name.split("."):
        if part.isdigit():
            return int(part)
    return None


def default_targets(model: nn.Module) -> list[str] | None:
    """PEFT's default LoRA targets for the model's architecture (e.g. bert/roberta: query, value)."""
    try:
        from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as mapping
    except Exception:
        return None
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return list(mapping.get(model_type, [])) or None


def _short_names(names: Iterable[str]) -> list[str]:
    """Distinct last components (what one writes in target_modules), in model order."""
    out: list[str] = []
    for n in names:
        s = n.rsplit(".", 1)[-1]
        if s not in out:
            out.append(s)
    return out


def match_targets(model: nn.Module, target_modules: str | Sequence[str] | None,
                  layers: Sequence[int] | None = None, head_modules: Sequence[str] = HEAD_MODULES) -> list[str]:
    """Full names of the linear layers to adapt (see the module docstring for the rules).

    ``ConfigError`` (one line) when nothing matches, when an entry of a list matches nothing, when a
    matched module is not linear, or when a layer index does not exist — naming the model's linear
    modules so the user can pick."""
    linear = linear_module_names(model, head_modules)
    if not linear:
        raise ConfigError("model.target_modules: the model has no nn.Linear / Conv1D layer to adapt")
    available = ", ".join(_short_names(linear))
    if target_modules is None:
        target_modules = default_targets(model)
        if target_modules is None:
            raise ConfigError(f"model.target_modules: no default for model type "
                              f"{getattr(getattr(model, 'config', None), 'model_type', '?')!r}; name them, "
                              f"e.g. one of: {available}, or 'all-linear'")
    modules = dict(model.named_modules())
    if isinstance(target_modules, str):
        if target_modules == "all-linear":
            chosen = list(linear)
        else:
            try:
                pattern = re.compile(target_modules)
            except re.error as e:
                raise ConfigError(f"model.target_modules: {target_modules!r} is not a valid regular expression ({e})") from None
            chosen = [n for n in modules if n and pattern.fullmatch(n) and not _in_head(n, head_modules)]
            if not chosen:
                raise ConfigError(f"model.target_modules: regex {target_modules!r} matches no module; the model's "
                                  f"linear modules are: {available}")
    else:
        targets = list(target_modules)
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise ConfigError(f"model.target_modules: expected a non-empty list of module names, a regex string "
                              f"or 'all-linear', got {target_modules!r}")
        chosen = []
        for t in targets:
            hit = [n for n in modules if n and (n == t or n.endswith("." + t)) and not _in_head(n, head_modules)]
            if not hit:
                raise ConfigError(f"model.target_modules: {t!r} matches no module of the model; its linear modules "
                                  f"are: {available}")
            chosen += [n for n in hit if n not in chosen]
        chosen = [n for n in modules if n in chosen]  # model order
    not_linear = [n for n in chosen if not _is_linear(modules[n])]
    if not_linear:
        raise ConfigError(f"model.target_modules: {not_linear[0]!r} is a {type(modules[not_linear[0]]).__name__}, "
                          f"not a linear layer; the model's linear modules are: {available}")
    if layers is not None:
        layers = list(layers)
        present = sorted({i for i in (layer_index(n) for n in chosen) if i is not None})
        bad = [i for i in layers if i not in present]
        if bad or not layers:
            raise ConfigError(f"model.layers: {layers} — the targeted modules exist in layers {present}")
        chosen = [n for n in chosen if layer_index(n) in layers]
    return chosen


class SlotLoRALinear(LoRALinear):
    """A ``LoRALinear`` around a model's linear layer (``nn.Linear`` or ``Conv1D``) with S slots.

    W0 and the bias are the wrapped layer's own tensors (buffers here, frozen, shared by all slots;
    a Conv1D weight (d_in, d_out) enters as its transposed view). Input (S·b, …, d_in), slot-major;
    output (S·b, …, d_out). With ``slots=None`` it is an ordinary one-adapter layer (export, merge).
    """

    def __init__(self, base: nn.Module, rank: int, *, slots: int | None, client_rank: int = 0,
                 alpha: float | None = None, client_alpha: float | None = None, middle: bool = False,
                 rslora: bool = False) -> None:
        conv = _conv1d_type()
        self.conv1d = conv is not None and isinstance(base, conv)
        if not (self.conv1d or isinstance(base, nn.Linear)):
            raise ConfigError(f"cannot adapt a {type(base).__name__}: only nn.Linear and Conv1D")
        weight = base.weight.detach()
        weight = weight.t() if self.conv1d else weight  # (d_out, d_in), a view: never copied
        d_out, d_in = weight.shape
        if rank > min(d_in, d_out):
            raise ConfigError(f"rank {rank} exceeds the layer's min(d_in, d_out) = {min(d_in, d_out)} "
                              f"(d_in={d_in}, d_out={d_out})")
        if client_rank and rank + client_rank > min(d_in, d_out):
            raise ConfigError(f"rank {rank} + client_rank {client_rank} exceeds the layer's min(d_in, d_out) = "
                              f"{min(d_in, d_out)}")
        super().__init__(d_in, d_out, rank, client_rank=client_rank, alpha=alpha, client_alpha=client_alpha,
                         rslora=rslora, base_weight=weight, base_bias=None if base.bias is None else base.bias.detach(),
                         stack=slots, middle=middle, dtype=weight.dtype, device=weight.device)

    def resize_slots(self, slots: int) -> None:
        """Re-create the factors (and the TriLoRA support) with ``slots`` slots; values are
        placeholders (zeros, Φ = 1) until the clients' records are loaded — no RNG is drawn."""
        if self.stack is None:
            raise ConfigError("resize_slots: this layer has no slot dimension")
        if slots == self.stack:
            return
        kw = {"dtype": self.lora_A.dtype, "device": self.lora_A.device}
        for name in ("lora_A", "lora_B", "lora_C", "lora_D", "lora_R", "lora_Phi"):
            p = getattr(self, name)
            if p is not None:
                setattr(self, name, nn.Parameter(torch.zeros((slots, *p.shape[1:]), **kw),
                                                 requires_grad=p.requires_grad))
        if self.middle:
            self.lora_Phi.data.fill_(1.0)
            self.middle_mask = torch.ones(slots, self.rank, self.rank, **kw)
        self.stack = slots

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stack is None:
            return super().forward(x)
        S = self.stack
        if x.shape[0] % S:
            raise ConfigError(f"slot layer: the batch's first dimension {x.shape[0]} is not a multiple of the "
                              f"{S} slots (each slot's rows must be equal in number, slot-major)")
        # forward_with, not super().forward: a DP capture records the slot-major input, not the (S, b·L, d) view
        y = self.forward_with({}, x.reshape(S, -1, x.shape[-1])).reshape(*x.shape[:-1], self.out_features)
        return y if self.dp_capture is None else self._captured(x, y, "slot")


class SlotHead(nn.Module):
    """A trained classifier layer with one (weight, bias) per slot: ``head_weight`` (S, d_out, d_in),
    ``head_bias`` (S, d_out) or None (a layer without bias). Input (S·b, …, d_in), slot-major, as ``SlotLoRALinear``. Initialised
    from the wrapped ``nn.Linear`` (the same head on every slot: the server's initial head)."""

    def __init__(self, base: nn.Linear, slots: int) -> None:
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise ConfigError(f"a trained head must be made of nn.Linear layers, got {type(base).__name__}")
        self.in_features, self.out_features = base.in_features, base.out_features
        self.stack = slots
        w = base.weight.detach()
        self.head_weight = nn.Parameter(w.expand(slots, *w.shape).clone())
        self.register_buffer("init_weight", w.clone(), persistent=False)  # for resize_slots
        if base.bias is not None:
            self.head_bias = nn.Parameter(base.bias.detach().expand(slots, -1).clone())
            self.register_buffer("init_bias", base.bias.detach().clone(), persistent=False)
        else:  # GPT-2's score layer has none
            self.register_parameter("head_bias", None)
            self.register_buffer("init_bias", None, persistent=False)

    #: sample-level DP-SGD's record of the forwards (``fedlora.privacy.dpsgd.capture``); None: nothing recorded
    dp_capture: "list | None" = None

    def resize_slots(self, slots: int) -> None:
        if slots == self.stack:
            return
        self.head_weight = nn.Parameter(self.init_weight.expand(slots, -1, -1).clone())
        if self.head_bias is not None:
            self.head_bias = nn.Parameter(self.init_bias.expand(slots, -1).clone())
        self.stack = slots

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        S = self.stack
        if x.shape[0] % S:
            raise ConfigError(f"slot head: the batch's first dimension {x.shape[0]} is not a multiple of the {S} slots")
        xs = x.reshape(S, -1, self.in_features)
        y = xs @ self.head_weight.transpose(1, 2)
        if self.head_bias is not None:
            y = y + self.head_bias.unsqueeze(1)
        y = y.reshape(*x.shape[:-1], self.out_features)
        if self.dp_capture is not None:  # sample-level DP: per-sample gradients x⊗g (fedlora.privacy.dpsgd)
            self.dp_capture.append(Capture(self, x, y, "slot"))
        return y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, slots={self.stack}"


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def inject_adapters(model: nn.Module, targets: Sequence[str], *, rank: int, slots: int | None,
                    client_rank: int = 0, alpha: float | None = None, client_alpha: float | None = None,
                    middle: bool = False, rslora: bool = False) -> list[str]:
    """Replace each module named in ``targets`` by a ``SlotLoRALinear`` (``fedlora.adapter.LoRALinear``
    keyword arguments as ``Method.adapter_kwargs()`` gives them). Freezes every parameter of the
    model first; only the adapters are trainable afterwards. Returns the adapted names."""
    for p in model.parameters():
        p.requires_grad_(False)
    modules = dict(model.named_modules())
    for name in targets:
        try:
            new = SlotLoRALinear(modules[name], rank, slots=slots, client_rank=client_rank, alpha=alpha,
                                 client_alpha=client_alpha, middle=middle, rslora=rslora)
        except ConfigError as e:
            raise ConfigError(f"{name}: {e}") from None
        _replace(model, name, new)
    return list(targets)


def head_linear_names(model: nn.Module, head_modules: Sequence[str] = HEAD_MODULES) -> list[str]:
    """The ``nn.Linear`` layers of the classifier head (RoBERTa: classifier.dense, classifier.out_proj)."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and _in_head(n, head_modules)]


def make_head_trainable(model: nn.Module, slots: int, head_modules: Sequence[str] = HEAD_MODULES) -> list[str]:
    """Replace every ``nn.Linear`` inside the classifier head by a ``SlotHead``; returns their names
    (empty when the model has no such head)."""
    names = head_linear_names(model, head_modules)
    for n in names:
        _replace(model, n, SlotHead(model.get_submodule(n), slots))
    return names


def slot_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (SlotLoRALinear, SlotHead)) and m.stack is not None]


def set_slots(model: nn.Module, slots: int) -> None:
    """Give every slot module ``slots`` slots (the number of clients of the coming pass)."""
    if not isinstance(slots, int) or slots < 1:
        raise ConfigError(f"slots must be an integer ≥ 1, got {slots!r}")
    for m in slot_modules(model):
        m.resize_slots(slots)
