"""Export a client's model: a standard PEFT LoRA adapter, or its adapters merged into the base weights.

A client's adapter in any method is one LoRA per layer (SPEC §8): the two-level adapter of PF2LoRA is
one LoRA of rank r + r̃ by concatenation, A_cat = [A; C], B_cat = [s₁B, s₂D]; H²Tune's TriLoRA folds its
middle I + (Φ⊙Ω)⊙R into B (or A); the scales are folded into B, so the PEFT config's lora_alpha equals
its rank (PEFT scaling 1). The classifier head — trained, or the run's frozen random head, which no hub
checkpoint holds — travels as PEFT ``modules_to_save``.

The run folder holds what this needs (``fedlora run`` writes it): ``config.json`` ("resolved": the
adapted layers with their scales and orientation, the head's modules) and
``adapters/client_<k>.safetensors`` (the client's final tensors, no slot dimension).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from fedlora.errors import ConfigError
from fedlora.kernels import fold_adapters

__all__ = ["lora_factors", "export_peft", "export_merged", "load_run_adapter", "load_run_base_model",
           "merge_adapters", "unmerge_adapters"]


def lora_factors(tensors: Mapping[str, torch.Tensor], layers: Mapping[str, Mapping[str, Any]]
                 ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per adapted layer name → (A_cat (R, d_in), B_cat (d_out, R)) with ΔW = B_cat A_cat, every scale,
    the client adapter and the TriLoRA middle folded in. ``tensors``: a client's adapter state
    (``<layer>.lora_A`` …, ``<layer>.middle_mask``); ``layers``: name → {scale, client_scale}."""
    out = {}
    for name, info in layers.items():
        g = lambda leaf: tensors.get(f"{name}.{leaf}")  # noqa: E731
        a, b = g("lora_A"), g("lora_B")
        if a is None or b is None:
            raise ConfigError(f"export: the adapter has no lora_A/lora_B for layer {name!r}")
        a_e, b_e, c, d_e = fold_adapters(a.double(), b.double(), float(info["scale"]),
                                         None if g("lora_C") is None else g("lora_C").double(),
                                         None if g("lora_D") is None else g("lora_D").double(),
                                         float(info.get("client_scale", 1.0)),
                                         middle=None if g("lora_R") is None else g("lora_R").double(),
                                         middle_phi=None if g("lora_Phi") is None else g("lora_Phi").double(),
                                         middle_mask=None if g("middle_mask") is None else g("middle_mask").double())
        if c is not None:
            a_e, b_e = torch.cat([a_e, c], 0), torch.cat([b_e, d_e], 1)
        out[name] = (a_e, b_e)
    return out


def load_run_adapter(run_dir: str | Path, client: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json's content, client ``client``'s adapter tensors) of a finished run."""
    from safetensors.torch import load_file

    run_dir = Path(run_dir)
    cfg_path, ad = run_dir / "config.json", run_dir / "adapters" / f"client_{client}.safetensors"
    if not cfg_path.is_file():
        raise ConfigError(f"export: {str(run_dir)!r} is not a finished run folder (no config.json)")
    if not ad.is_file():
        have = sorted(p.stem for p in (run_dir / "adapters").glob("client_*.safetensors")) if (run_dir / "adapters").is_dir() else []
        raise ConfigError(f"export: no adapter of client {client} in {str(run_dir)!r}; found: {', '.join(have) or 'none'}")
    return json.loads(cfg_path.read_text()), load_file(str(ad))


def export_peft(run_dir: str | Path, client: int, out: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write client ``client``'s model of the run in ``run_dir`` as a PEFT LoRA adapter folder
    (``adapter_config.json`` + ``adapter_model.safetensors``) that ``PeftModel.from_pretrained`` loads
    on top of the run's base model. Returns ``out``."""
    import peft
    from safetensors.torch import save_file

    info, tensors = load_run_adapter(run_dir, client)
    res = info["resolved"]
    layers = res["layers"]
    factors = lora_factors(tensors, layers)
    ranks = {a.shape[0] for a, _ in factors.values()}
    if len(ranks) != 1:
        raise ConfigError(f"export: layers have different ranks {sorted(ranks)}; PEFT needs one")
    R = ranks.pop()
    dt = dtype or tensors[next(iter(tensors))].dtype
    state = {}
    for name, (a, b) in factors.items():
        state[f"base_model.model.{name}.lora_A.weight"] = a.to(dt).contiguous()
        state[f"base_model.model.{name}.lora_B.weight"] = b.to(dt).contiguous()
    head_top = sorted({h.split(".")[0] for h in res["head_linear"]})
    for h in res["head_linear"]:
        w, bias = tensors.get(f"{h}.head_weight", tensors.get(f"{h}.weight")), tensors.get(f"{h}.head_bias",
                                                                                          tensors.get(f"{h}.bias"))
        if w is None:
            raise ConfigError(f"export: the adapter has no weights for the head layer {h!r}")
        state[f"base_model.model.{h}.weight"] = w.to(dt).contiguous()
        if bias is not None:
            state[f"base_model.model.{h}.bias"] = bias.to(dt).contiguous()
    conv = {bool(v.get("conv1d")) for v in layers.values()}
    if len(conv) != 1:
        raise ConfigError("export: a mix of Conv1D and Linear layers cannot share one PEFT fan_in_fan_out setting")
    cfg = peft.LoraConfig(r=R, lora_alpha=R, target_modules=sorted(layers), lora_dropout=0.0,
                          fan_in_fan_out=conv.pop(), modules_to_save=head_top or None, task_type="SEQ_CLS",
                          base_model_name_or_path=info["config"]["model"]["name"])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(str(out))
    save_file(state, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out


@torch.no_grad()
def merge_adapters(model: torch.nn.Module, adapter: Mapping[str, torch.Tensor],
                   layers: Mapping[str, Mapping[str, Any]], head_linear: Sequence[str] = ()) -> dict[str, torch.Tensor]:
    """W0 ← W0 + ΔW in every adapted layer of ``model`` (a model whose layers are plain
    ``nn.Linear``/``Conv1D``, e.g. the base model loaded afresh, or one with ``SlotLoRALinear`` whose W0
    buffer is changed in place) and copy the client's head (``head_linear`` layers) in. Returns what
    ``unmerge_adapters`` needs: each changed tensor's previous value (restored exactly)."""
    from .inject import SlotLoRALinear, _conv1d_type

    conv = _conv1d_type()
    backup: dict[str, torch.Tensor] = {}
    for h in head_linear:
        lin = model.get_submodule(h)
        for leaf in ("weight", "bias"):
            new = adapter.get(f"{h}.head_{leaf}", adapter.get(f"{h}.{leaf}"))
            old = getattr(lin, leaf)
            if new is not None and old is not None:
                backup[f"{h}.{leaf}"] = old.detach().clone()
                old.copy_(new.to(old.dtype))
    for name, (a, b) in lora_factors(adapter, layers).items():
        mod = model.get_submodule(name)
        w = mod.weight
        if isinstance(mod, SlotLoRALinear):
            target = w  # (d_out, d_in), a view of the model's tensor
        elif conv is not None and isinstance(mod, conv):
            target = w.t()
        elif isinstance(mod, torch.nn.Linear):
            target = w
        else:
            raise ConfigError(f"merge: {name!r} is a {type(mod).__name__}, not a linear layer")
        backup[name] = target.detach().clone()
        target.copy_((target.double() + b @ a).to(target.dtype))
    return backup


@torch.no_grad()
def unmerge_adapters(model: torch.nn.Module, backup: Mapping[str, torch.Tensor]) -> None:
    """Undo ``merge_adapters``: every merged weight back to its value before the merge (bit for bit)."""
    from .inject import _conv1d_type

    conv = _conv1d_type()
    modules = dict(model.named_modules())
    for name, old in backup.items():
        if name in modules:  # an adapted layer's weight
            mod = modules[name]
            target = mod.weight.t() if conv is not None and isinstance(mod, conv) else mod.weight
        else:  # a head tensor, "<layer>.weight" / "<layer>.bias"
            layer, _, leaf = name.rpartition(".")
            target = getattr(modules[layer], leaf)
        target.copy_(old)


def load_run_base_model(info: Mapping[str, Any]):
    """The run's base model as ``fedlora run`` built it (same seed for a new head, same dtype), without
    adapters, and its tokenizer."""
    from .runtime import load_base

    model, tok = load_base(info["config"]["model"], info["config"]["seed"], info["resolved"]["num_labels"])
    names = info["resolved"].get("label_names")
    if names:  # the run's class names, so a saved model predicts "mail", not "LABEL_2"
        model.config.id2label = {i: str(n) for i, n in enumerate(names)}
        model.config.label2id = {str(n): i for i, n in enumerate(names)}
    return model.eval(), tok


def export_merged(run_dir: str | Path, client: int, out: str | Path) -> Path:
    """Client ``client``'s model with its adapter merged into the base weights (and its head), saved
    with ``save_pretrained`` together with the tokenizer: a plain HF model, no PEFT needed."""
    info, tensors = load_run_adapter(run_dir, client)
    model, tok = load_run_base_model(info)
    merge_adapters(model, tensors, info["resolved"]["layers"], info["resolved"]["head_linear"])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out
