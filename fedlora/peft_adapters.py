"""PEFT LoRA adapters trained anywhere (your own loop, a Flower app), aggregated with a method's server.

A method whose server half is a function of the clients' uploads alone declares it on its class:
``Method.lora_upload`` names the factors its clients upload, ``Method.uploads_from_lora`` builds each
client's upload from its LoRA factors (with the ranks, scales and options the method's payloads carry),
``Method.lora_server_state`` what the server holds before the round (FedSVD's shared A, Fed-SB's frozen A and
a basis of its frozen B),
``Method.lora_download`` what a client's factors become once it took the server's state, and
``Method.lora_base_delta`` what the state adds to the frozen base weights (FLoRA's merged stack, FedEx-LoRA's
residual); they are called on the method built with the user's options, never bound to a model. This
module does what a ``fedlora run``'s server does with those uploads — the method's pure ``aggregate``, then
``server_update`` — on adapters saved by PEFT (``save_pretrained``: ``adapter_config.json`` +
``adapter_model.safetensors``) or on PEFT state dicts, and gives the result back as PEFT adapters.

Names: a PEFT key ``base_model.model.<module>.lora_A.weight`` is the factor ``<module>.lora_A`` of a run
(``peft_key``; the PEFT export of a run, ``fedlora.llm.export``, writes the same keys), and a
``modules_to_save`` tensor ``base_model.model.<module>.weight`` / ``.bias`` is the run's trained head
``<module>.head_weight`` / ``head_bias``: averaged with the data weights where the method shares its head
(``Method.default_head == "shared"``), each client's own otherwise.

Scales: a module's scale is ``lora_alpha / r`` (``lora_alpha / √r`` with ``use_rslora``; ``alpha_pattern``
honoured, the rank read off the tensors); what a method gives a client keeps the client's rank and scale,
except where the method changes them (FLoRA: the stack, rank Σ r_k, scale 1), written as ``r`` /
``lora_alpha`` or per-module ``rank_pattern`` / ``alpha_pattern``.

Bad input is a one-line ``ConfigError``: a method whose server needs more than the uploads, clients that
adapt different modules or shapes, ranks or scales a method cannot take (rsLoRA with a method whose paper fixes
the scale, ``Method.fixed_lora_scale``: Fed-SB), missing or bad weights, an adapter
that is not plain LoRA (DoRA, LoRA on embeddings, LoRA biases).
"""
from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .adapter import lora_scale, refuse_rslora
from .aggregation import normalise_weights
from .errors import ConfigError
from .methods import available_methods, build, get_method

__all__ = ["PeftAdapter", "AggregateResult", "aggregate_adapters", "lora_methods", "peft_key", "PEFT_PREFIX",
           "ADAPTER_CONFIG", "ADAPTER_WEIGHTS"]

#: what PEFT puts before a module's name in an adapter's state dict (``PeftModel`` → its ``LoraModel`` → the model)
PEFT_PREFIX = "base_model.model."
#: the two files of a PEFT adapter folder (``save_pretrained``)
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

_FACTORS = ("lora_A", "lora_B")
_HEAD = {"weight": "head_weight", "bias": "head_bias"}

#: (A (r, d_in), B (d_out, r), scale s) of one module: ΔW = s·B A
Factors = tuple[torch.Tensor, torch.Tensor, float]


def peft_key(module: str, leaf: str) -> str:
    """The PEFT state-dict key of ``module``'s LoRA factor ``leaf`` (``lora_A`` / ``lora_B``), or, for ``weight`` /
    ``bias``, of its ``modules_to_save`` tensor."""
    return f"{PEFT_PREFIX}{module}.{leaf}.weight" if leaf in _FACTORS else f"{PEFT_PREFIX}{module}.{leaf}"


def lora_methods() -> list[str]:
    """The registered methods whose server runs on the clients' LoRA factors alone (``Method.lora_upload``)."""
    return [n for n in available_methods() if get_method(n).lora_upload]


def _plain(config: Any) -> dict[str, Any]:
    """A LoRA config as a JSON-ready dict: a ``peft.LoraConfig`` (its ``to_dict``) or a mapping; sets as lists,
    enumerations (``PeftType.LORA``) as their values — as ``save_pretrained`` writes them."""
    cfg = config.to_dict() if hasattr(config, "to_dict") else config
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"a PEFT adapter's config must be a mapping or a peft.LoraConfig, got {type(config).__name__}")
    return {k: (sorted(v) if isinstance(v, (set, frozenset)) else v.value if isinstance(v, enum.Enum) else v)
            for k, v in cfg.items()}


@dataclass
class PeftAdapter:
    """One PEFT LoRA adapter: its state dict (keys as ``get_peft_model_state_dict`` / ``save_pretrained``
    give them) and its config (``adapter_config.json``'s content, or a ``peft.LoraConfig``). ``label`` names
    it in messages (its folder)."""

    state_dict: dict[str, torch.Tensor]
    config: dict[str, Any]
    label: str = ""

    def __post_init__(self) -> None:
        self.config = _plain(self.config)

    @classmethod
    def load(cls, folder: str | Path) -> "PeftAdapter":
        """The adapter ``save_pretrained`` wrote into ``folder``; a one-line ``ConfigError`` if it is not one."""
        p = Path(folder)
        cfg_path, w_path = p / ADAPTER_CONFIG, p / ADAPTER_WEIGHTS
        missing = [f.name for f in (cfg_path, w_path) if not f.is_file()]
        if missing:
            raise ConfigError(f"{str(p)!r} is not a PEFT adapter folder: it lacks {' and '.join(missing)} "
                              f"(what PeftModel.save_pretrained writes)")
        try:
            config = json.loads(cfg_path.read_text())
            with safe_open(str(w_path), framework="pt") as f:
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise ConfigError(f"{str(p)!r}: cannot read the adapter: {type(e).__name__}: {e}") from None
        return cls(tensors, config, str(p))

    def save(self, folder: str | Path) -> Path:
        """Write ``adapter_config.json`` and ``adapter_model.safetensors`` into ``folder`` (created): what
        ``PeftModel.from_pretrained(base, folder)`` loads."""
        p = Path(folder)
        p.mkdir(parents=True, exist_ok=True)
        (p / ADAPTER_CONFIG).write_text(json.dumps(self.config, indent=2, sort_keys=True))
        save_file({k: v.contiguous() for k, v in self.state_dict.items()}, str(p / ADAPTER_WEIGHTS),
                  metadata={"format": "pt"})
        return p

    def scale(self, module: str, rank: int) -> float:
        """The scale of ``module`` at rank ``rank``: lora_alpha (or its ``alpha_pattern`` entry) over r, or
        over √r with ``use_rslora`` — as PEFT computes it."""
        alpha = self.config.get("lora_alpha", 8)
        for key, value in (self.config.get("alpha_pattern") or {}).items():
            if re.match(rf"(.*\.)?({key})$", module):  # PEFT's own rule (peft.utils.other.get_pattern_key)
                alpha = value
                break
        return lora_scale(alpha, rank, bool(self.config.get("use_rslora")))  # the one rule, PEFT's too

    def lora(self) -> tuple[dict[str, Factors], dict[str, torch.Tensor]]:
        """(module → (A, B, s), head name → tensor in the run's names ``<module>.head_weight``); a one-line
        ``ConfigError`` for what is not a plain LoRA adapter."""
        who = self.label or "the adapter"
        kind = self.config.get("peft_type", "LORA")
        if str(kind).upper() != "LORA" or self.config.get("use_dora"):
            raise ConfigError(f"{who}: a {'DoRA' if self.config.get('use_dora') else kind} adapter; only plain "
                              f"LoRA adapters (lora_A/lora_B per module) can be aggregated")
        A: dict[str, torch.Tensor] = {}
        B: dict[str, torch.Tensor] = {}
        heads: dict[str, torch.Tensor] = {}
        for key, t in self.state_dict.items():
            if not key.startswith(PEFT_PREFIX):
                raise ConfigError(f"{who}: key {key!r} does not start with {PEFT_PREFIX!r}: not a PEFT adapter's "
                                  f"state dict (save_pretrained / get_peft_model_state_dict give such keys)")
            rest = key[len(PEFT_PREFIX):]
            m = re.fullmatch(r"(.+)\.(lora_A|lora_B)\.weight", rest)
            if m:
                (A if m.group(2) == "lora_A" else B)[m.group(1)] = t
            elif "lora_" in rest or not re.fullmatch(r".+\.(weight|bias)", rest):
                raise ConfigError(f"{who}: key {key!r} is no plain LoRA factor (lora_A/lora_B weight) or "
                                  f"modules_to_save tensor; DoRA, LoRA on embeddings and LoRA biases cannot be aggregated")
            else:
                module, _, leaf = rest.rpartition(".")
                heads[f"{module}.{_HEAD[leaf]}"] = t
        lonely = sorted(set(A) ^ set(B))
        if lonely:
            raise ConfigError(f"{who}: module {lonely[0]!r} has only one of lora_A / lora_B")
        if not A:
            raise ConfigError(f"{who}: no LoRA factors (no key ending in .lora_A.weight)")
        factors = {}
        for module in sorted(A):
            a, b = A[module], B[module]
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
                raise ConfigError(f"{who}: module {module!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                                  f"they must be (r, d_in) and (d_out, r)")
            factors[module] = (a, b, self.scale(module, a.shape[0]))
        return factors, heads


@dataclass
class AggregateResult:
    """What a method's server makes of the clients' adapters in one round.

    ``state``: the server's state after the round, in the run's names (``<module>.lora_A`` …), what a
    ``fedlora run``'s server holds; ``adapters``: what the method gives each client, as PEFT adapters, in the
    order of the inputs; ``base_delta``: ``<module>.weight`` → the increment of the frozen base weight, in the
    layer's own layout (transposed for ``fan_in_fan_out``, GPT-2's Conv1D) so that it adds to the base model's
    state dict as it is — empty unless the method changes the base (FLoRA, FedEx-LoRA); ``weights``: the
    normalised p_k."""

    method: str
    weights: list[float]
    state: dict[str, torch.Tensor]
    adapters: list[PeftAdapter]
    base_delta: dict[str, torch.Tensor] = field(default_factory=dict)


def _as_adapter(x: Any, k: int) -> PeftAdapter:
    if isinstance(x, PeftAdapter):
        return x
    if isinstance(x, (str, Path)):
        return PeftAdapter.load(x)
    if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], Mapping):
        return PeftAdapter(dict(x[0]), x[1], f"adapter {k}")
    if isinstance(x, Mapping):
        raise ConfigError(f"adapter {k}: a bare state dict has no LoRA config (lora_alpha, use_rslora), which its "
                          f"scales need: pass (state_dict, config) or a PeftAdapter")
    raise ConfigError(f"adapter {k}: expected a PEFT adapter folder, (state_dict, config) or a PeftAdapter, "
                      f"got {type(x).__name__}")


def _check_same_modules(adapters: Sequence[PeftAdapter], clients: Sequence[Mapping[str, Factors]],
                        heads: Sequence[Mapping[str, torch.Tensor]]) -> None:
    ref, ref_heads = clients[0], heads[0]
    for k in range(1, len(clients)):
        who = adapters[k].label or f"adapter {k}"
        for what, mine, theirs in (("modules", clients[k], ref), ("modules_to_save tensors", heads[k], ref_heads)):
            extra, lack = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
            if extra or lack:
                diff = (f"adapts {extra[:3]} that the first does not" if extra else f"lacks {lack[:3]} that the first has")
                raise ConfigError(f"{who}: its {what} differ from the first adapter's ({adapters[0].label or 'adapter 0'}): "
                                  f"it {diff}; every client must adapt the same modules")
        for m, (a, b, _) in clients[k].items():
            a0, b0, _ = ref[m]
            if a.shape[1] != a0.shape[1] or b.shape[0] != b0.shape[0]:
                raise ConfigError(f"{who}: module {m!r} is {b.shape[0]}×{a.shape[1]} (d_out×d_in) but "
                                  f"{b0.shape[0]}×{a0.shape[1]} in the first adapter: not the same base model")
        for h, t in heads[k].items():
            if t.shape != ref_heads[h].shape:
                raise ConfigError(f"{who}: modules_to_save tensor {h!r} has shape {tuple(t.shape)}, "
                                  f"{tuple(ref_heads[h].shape)} in the first adapter")
    fifo = {bool(a.config.get("fan_in_fan_out")) for a in adapters}
    if len(fifo) != 1:
        raise ConfigError("the adapters disagree on fan_in_fan_out (Conv1D vs Linear layers): not the same base model")


def _alpha(scale: float, rank: int) -> int | float:
    a = scale * rank
    return int(round(a)) if a == round(a) else a


def _config_for(adapter: PeftAdapter, factors: Mapping[str, Factors]) -> dict[str, Any]:
    """``adapter``'s config, changed where the method gave a module another rank or scale than it had."""
    cfg = dict(adapter.config)
    want = {m: (a.shape[0], s) for m, (a, _, s) in factors.items()}
    if all(adapter.scale(m, r) == s and r == _config_rank(cfg, m) for m, (r, s) in want.items()):
        return cfg
    pairs = set(want.values())
    cfg["use_rslora"] = False  # scales written as lora_alpha / r
    if len(pairs) == 1:
        (r, s), = pairs
        cfg.update(r=r, lora_alpha=_alpha(s, r), rank_pattern={}, alpha_pattern={})
    else:
        r0, s0 = next(iter(want.values()))
        cfg.update(r=r0, lora_alpha=_alpha(s0, r0),
                   rank_pattern={re.escape(m): r for m, (r, _) in want.items()},
                   alpha_pattern={re.escape(m): _alpha(s, r) for m, (r, s) in want.items()})
    return cfg


def _config_rank(cfg: Mapping[str, Any], module: str) -> int:
    for key, value in (cfg.get("rank_pattern") or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return int(value)
    return int(cfg.get("r", 8))


def aggregate_adapters(method: str, adapters: Sequence[Any], weights: Sequence[float] | torch.Tensor | None,
                       options: Mapping[str, Any] | None = None) -> AggregateResult:
    """One round of ``method``'s server on K clients' PEFT adapters.

    ``adapters``: PEFT adapter folders (``save_pretrained``), ``(state_dict, config)`` pairs or
    ``PeftAdapter``s, one per client; ``weights``: the clients' weights p_k (e.g. their numbers of
    examples; normalised here as a run normalises them); ``options``: the method's constructor options
    (``fedlora.methods.build``). The uploads are what the method's clients would send
    (``Method.uploads_from_lora``), aggregated by its pure ``aggregate`` and ``server_update`` (from the state
    ``Method.lora_server_state`` reads off the clients) — what its server does in a ``fedlora run``. Returns an
    ``AggregateResult``."""
    cls = get_method(method)
    if not adapters:
        raise ConfigError("aggregate: no adapters given; one per client is needed")
    if weights is None:
        raise ConfigError(f"aggregate: weights are missing: one per adapter ({len(adapters)}), e.g. the clients' "
                          f"numbers of training examples")
    w = normalise_weights(weights, len(adapters))
    if not cls.lora_upload:  # refused before any adapter is read
        cls.check_lora_clients([])
    server = build(cls.name, options)  # the user's options (a server's solver settings); never bound to a model
    peft = [_as_adapter(x, k) for k, x in enumerate(adapters)]
    for k, p in enumerate(peft):  # a method whose paper fixes the scale (Fed-SB) refuses rsLoRA, as its runs do
        if p.config.get("use_rslora"):
            refuse_rslora(cls.name, cls.fixed_lora_scale, where=p.label or f"adapter {k}")
    read = [p.lora() for p in peft]
    clients, heads = [f for f, _ in read], [h for _, h in read]
    _check_same_modules(peft, clients, heads)
    payloads = server.uploads_from_lora(clients)
    if cls.default_head == "shared" and heads[0]:
        payloads = [type(p)({**p.tensors, **h}, dict(p.meta)) for p, h in zip(payloads, heads)]
    aggregated = server.aggregate(payloads, w)
    state = server.server_update(server.lora_server_state(clients), aggregated)
    out = []
    for adapter, client, head in zip(peft, clients, heads):
        got = server.lora_download(state, client)
        sd = {}
        for m, (a, b, _) in got.items():
            a0, b0, _ = client[m]
            sd[peft_key(m, "lora_A")] = a.to(a0.dtype)
            sd[peft_key(m, "lora_B")] = b.to(b0.dtype)
        for h, t in head.items():
            module, _, leaf = h.rpartition(".")
            sd[peft_key(module, leaf[len("head_"):])] = state.get(h, t).to(t.dtype)
        out.append(PeftAdapter(sd, _config_for(adapter, got), adapter.label))
    fifo = bool(peft[0].config.get("fan_in_fan_out"))
    dtype = next(iter(clients[0].values()))[0].dtype
    base_delta = {f"{m}.weight": (d.t() if fifo else d).to(dtype).contiguous()
                  for m, d in server.lora_base_delta(state).items()}
    return AggregateResult(cls.name, w.tolist(), dict(state), out, base_delta)
