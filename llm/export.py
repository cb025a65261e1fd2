"""Export a client's model: a standard PEFT LoRA adapter, or its adapters merged into the base weights.

A client's adapter in any method is one LoRA per layer (docs/design.md §8): the two-level adapter of PF2LoRA is
one LoRA of rank r + r̃ by concatenation, A_cat = [A; C], B_cat = [s₁B, s₂D]; H²Tune's TriLoRA folds its
middle I + (Φ⊙Ω)⊙R into B (or A); the scales are folded into B, so the PEFT config's lora_alpha equals
its rank (PEFT scaling 1) — or, for a run with ``model.use_rslora``, ``use_rslora: true`` and lora_alpha =
√R (PEFT's α/√R is then exactly 1; ``fedlora.adapter.unit_alpha``). The classifier head — trained, or the
run's frozen random head, which no hub checkpoint holds — travels as PEFT ``modules_to_save``.

The run folder holds what this needs (``fedlora run`` writes it): ``config.json`` ("resolved": the
adapted layers with their scales and orientation, the head's modules) and
``adapters/client_<k>.safetensors`` (the client's final tensors, no slot dimension: the model the run
evaluated last — Per-FedAvg's after its one personalisation step). FLoRA (FedEx-LoRA, FRLoRA likewise)
merges every round into the base, which its adapters alone do not hold: ``adapters/merged_update.safetensors`` (once per run, the
same for every client) holds what was merged, as ONE LoRA of rank M (every round's stack concatenated,
B_cat A_cat = Σ_t B_stack,t A_stack,t, scale 1), which the export appends to the client's own LoRA
(rank r + M, exact); with a half-precision base, whose per-round rounding no LoRA reproduces, it holds
the merged weights themselves, which the merged export copies in and the PEFT export refuses.

Export refuses what it cannot reproduce, in one line: a client the run did not have, an adapter file
that another run (or an older fedlora) left in the folder — every file names the SHA-256 of its run's
config (``config_digest``), checked against ``config.json`` — a FLoRA adapter without its merged
update, and a non-empty output folder unless ``overwrite`` (which clears the files an export writes,
``EXPORT_WRITES``, after every check; a folder holding anything else is refused, never cleared). A
failed export leaves no folder it created and no half-written files; an incomplete run is named as
``run.json`` says it (``interrupted after round 2 of 10``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fedlora.adapter import fold_adapters, unit_alpha
from fedlora.errors import ConfigError
from fedlora.peft_adapters import peft_key

from .inject import SlotLoRALinear, _conv1d_type
from .model import load_tokenizer, resolve_model_path
# EXPORT_WRITES, claim_export_dir, MERGED_UPDATE and config_digest are the run folder's; fedlora.llm.export's too
from .runfolder import EXPORT_WRITES, GLOBAL_ADAPTER, MERGED_UPDATE, claim_export_dir, client_view, config_digest, config_digests, read_run_config  # noqa: F401
from .task_kinds import task_from_resolved

__all__ = ["lora_factors", "export_peft", "export_merged", "load_run_adapter", "load_run_base_model",
           "merge_adapters", "unmerge_adapters", "config_digest", "MERGED_UPDATE", "EXPORT_WRITES", "claim_export_dir"]

def lora_factors(tensors: Mapping[str, torch.Tensor], layers: Mapping[str, Mapping[str, Any]]
                 ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per adapted layer name → (A_cat (R, d_in), B_cat (d_out, R)) with ΔW = B_cat A_cat, every scale,
    the client adapter and the TriLoRA middle folded in. ``tensors``: a client's adapter state
    (``<layer>.lora_A`` …, ``<layer>.middle_mask``) as ``load_run_adapter`` gives it — with FLoRA's
    merged update as ``<layer>.merged_A`` / ``<layer>.merged_B`` (scale 1), appended: A_cat =
    [A; merged_A], B_cat = [s·B, merged_B]; a dense ``<layer>.merged_weight`` is no LoRA (refused:
    ``merge_adapters`` takes it). ``layers``: name → {scale, client_scale}."""
    out = {}
    for name, info in layers.items():
        g = lambda leaf: tensors.get(f"{name}.{leaf}")  # noqa: E731
        a, b = g("lora_A"), g("lora_B")
        if a is None or b is None:
            raise ConfigError(f"export: the adapter has no lora_A/lora_B for layer {name!r}")
        if g("merged_weight") is not None:
            raise ConfigError(f"export: layer {name!r} holds the run's merged base weight (its method merges into the "
                              f"base every round — FLoRA, FedEx-LoRA, FRLoRA — and a half-precision base rounds "
                              f"every merge, which no LoRA reproduces): use --format merged")
        a_e, b_e, c, d_e = fold_adapters(a.double(), b.double(), float(info["scale"]),
                                         None if g("lora_C") is None else g("lora_C").double(),
                                         None if g("lora_D") is None else g("lora_D").double(),
                                         float(info.get("client_scale", 1.0)),
                                         middle=None if g("lora_R") is None else g("lora_R").double(),
                                         middle_phi=None if g("lora_Phi") is None else g("lora_Phi").double(),
                                         middle_mask=None if g("middle_mask") is None else g("middle_mask").double())
        if c is not None:
            a_e, b_e = torch.cat([a_e, c], 0), torch.cat([b_e, d_e], 1)
        ma, mb = g("merged_A"), g("merged_B")
        if (ma is None) != (mb is None):
            raise ConfigError(f"export: layer {name!r} has only one of merged_A / merged_B")
        if ma is not None:  # FLoRA: the update merged into the base, itself a LoRA (scale 1)
            a_e, b_e = torch.cat([a_e, ma.double()], 0), torch.cat([b_e, mb.double()], 1)
        out[name] = (a_e, b_e)
    return out


def _read_safetensors(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {}), {k: f.get_tensor(k) for k in f.keys()}


def load_run_adapter(run_dir: str | Path, client: int | None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json's content, client ``client``'s adapter tensors) of a finished run — with FLoRA's
    merged update (``MERGED_UPDATE``) joined in as ``<layer>.merged_A`` / ``merged_B`` (a LoRA) or
    ``<layer>.merged_weight`` (the merged base weight). ``client=None``: the global adapter a SecAgg+ run writes
    (``adapters/global.safetensors``; its clients' models never leave them, so ``--client`` of it is refused).
    ``ConfigError`` (one line) for a client the run did not have and for files that do not belong to this run's
    config.json."""
    run_dir = Path(run_dir)
    cfg_path, folder = run_dir / "config.json", run_dir / "adapters"
    info = read_run_config(run_dir, "export")  # the one reader of a run folder (fedlora.llm.runfolder)
    secagg = bool(((info["config"].get("privacy") or {}).get("secagg") or {}).get("enabled"))
    if client is None and not secagg:
        raise ConfigError(f"export: --global: the run in {str(run_dir)!r} has no global adapter (only a SecAgg+ run "
                          f"writes one, adapters/{GLOBAL_ADAPTER}); export a client's model with --client K")
    if client is not None and secagg:
        raise ConfigError(f"export: --client {client}: the run in {str(run_dir)!r} ran with SecAgg+ "
                          f"(privacy.secagg.enabled), whose clients' models never leave them; adapters/ holds the "
                          f"global adapter only: export it with --global")
    ad = folder / (GLOBAL_ADAPTER if client is None else f"client_{client}.safetensors")
    K = int(info["config"]["federation"]["clients"])
    if client is not None and not 0 <= client < K:
        raise ConfigError(f"export: --client {client}: the run in {str(run_dir)!r} has {K} clients, "
                          f"--client 0 to {K - 1}")
    if not ad.is_file():
        unfinished = _unfinished(run_dir, info)
        if unfinished is not None:
            from fedlora.checkpoint import list_checkpoints

            if secagg and not list_checkpoints(run_dir / "checkpoints"):  # (llm.driver.CHECKPOINTS)
                raise ConfigError(f"export: the run in {str(run_dir)!r} is not finished ({unfinished}): its global "
                                  f"adapter is written when it completes, and this SecAgg+ run kept no checkpoint "
                                  f"to resume from: run it again")
            raise ConfigError(f"export: the run in {str(run_dir)!r} is not finished ({unfinished}): its clients' "
                              f"models are written when it completes; `fedlora run --resume {run_dir}` finishes "
                              f"an interrupted or failed run, then export it")
        have = sorted(p.stem for p in folder.glob("client_*.safetensors")) if folder.is_dir() else []
        who = "no global adapter" if client is None else f"no adapter of client {client}"
        raise ConfigError(f"export: {who} in {str(run_dir)!r} (run.json says the run is "
                          f"complete, but adapters/ lacks the file); found: {', '.join(have) or 'none'}")
    digests = config_digests(info["config"])
    meta, tensors = _read_safetensors(ad)
    if meta.get("config_sha256") not in digests or meta.get("client") != ("global" if client is None else str(client)):
        raise ConfigError(f"export: {str(ad)!r} was not written by the run of {str(cfg_path)!r} (another run, or "
                          f"an older fedlora, left it in the folder): re-run into an empty folder")
    info = info if client is None else client_view(info, client)  # heterogeneous client models: the client's own base model, task and layers
    if "merged_update" in meta:  # FLoRA: the rest of the client's model is in the shared base
        mu = folder / meta["merged_update"]
        if not mu.is_file():
            raise ConfigError(f"export: {str(mu)!r} is missing: client {client}'s model is its adapter plus the "
                              f"update merged into the base, which that file holds")
        mmeta, merged = _read_safetensors(mu)
        if mmeta.get("config_sha256") not in digests or mmeta.get("form") not in ("lora", "dense"):
            raise ConfigError(f"export: {str(mu)!r} was not written by the run of {str(cfg_path)!r}: re-run into "
                              f"an empty folder")
        leaves = {"lora": {"lora_A": "merged_A", "lora_B": "merged_B"}, "dense": {"weight": "merged_weight"}}[mmeta["form"]]
        for name in info["resolved"]["layers"]:
            for leaf, as_ in leaves.items():
                if f"{name}.{leaf}" not in merged:
                    raise ConfigError(f"export: {str(mu)!r} has no {leaf} for layer {name!r}")
                tensors[f"{name}.{as_}"] = merged[f"{name}.{leaf}"]
    return info, tensors


def _unfinished(run_dir: str | Path, info: Mapping[str, Any]) -> str | None:
    """None for a complete run, else how far it got as ``run.json`` says it, e.g. ``run.json says interrupted
    after round 2 of 10`` (its ``rounds_done``; the round records of rounds.jsonl where that is 0 or missing)."""
    run_dir = Path(run_dir)
    try:
        state = json.loads((run_dir / "run.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        state = None
    if not isinstance(state, dict):
        if (run_dir / "summary.json").is_file():
            return None
        said, state = "no run.json and no summary.json", {}
    elif state.get("status") == "complete":
        return None
    else:
        said = f"run.json says {state.get('status', 'nothing of its status')}"
    done = state.get("rounds_done")
    if not isinstance(done, int) or isinstance(done, bool) or done <= 0:
        try:
            done = sum(1 for line in (run_dir / "rounds.jsonl").read_text().splitlines()
                       if line.strip() and json.loads(line).get("round", 0) >= 1)
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            done = 0
    planned = state.get("rounds", info["config"].get("train", {}).get("rounds", "?"))
    if state.get("status") == "running":  # still going, or killed (SIGKILL leaves "running")
        return f"{said}, round {done} of {planned} done"
    return f"{said} after round {done} of {planned}"


def _exporting(out: str | Path, overwrite: bool, run_dir: str | Path, check, write):
    """The one way an export writes: claim ``out``, run ``check()`` (everything that can refuse), then clear
    (``overwrite``) and ``write(folder, checked)``. On any failure nothing is left that the export made: before
    writing, only the folders it created (empty); while writing, also the files it wrote."""
    folder = claim_export_dir(out, overwrite, run_dir)
    try:
        checked = check()
    except BaseException:
        folder.remove_if_empty()
        raise
    try:
        if overwrite:
            folder.clear()
        write(folder.path, checked)
    except BaseException:
        folder.discard()
        raise
    return folder.path


def export_peft(run_dir: str | Path, client: int | None, out: str | Path, dtype: torch.dtype | None = None, *,
                overwrite: bool = False) -> Path:
    """Write client ``client``'s model of the run in ``run_dir`` as a PEFT LoRA adapter folder
    (``adapter_config.json`` + ``adapter_model.safetensors``) that ``PeftModel.from_pretrained`` loads
    on top of the run's base model (FLoRA: rank r + M, its merged update appended). ``client=None``: a SecAgg+
    run's global adapter (``load_run_adapter``). ``out`` must be
    empty unless ``overwrite``. Returns ``out``.

    Self-contained as far as a PEFT adapter can be: ``base_model_name_or_path`` is a name or folder
    ``from_pretrained`` resolves (the MiniLM package's folder, not its package name), the run's
    tokenizer is saved beside it, and ``fedlora_export.json`` carries the labels (``num_labels``,
    ``id2label``, ``label2id``) to pass when loading — the base model's own config does not have them —
    and the method's options (an inference rule the adapter cannot hold: FedDPA's instance-wise weighting):
    ``AutoPeftModelForSequenceClassification.from_pretrained(out, **labels)`` (docs/how-to/export-peft.md)."""
    import peft  # the optional LLM dependencies (pip install fedlora[llm]): imported by the PEFT export only

    def check():
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
            state[peft_key(name, "lora_A")] = a.to(dt).contiguous()
            state[peft_key(name, "lora_B")] = b.to(dt).contiguous()
        head_top = sorted({h.split(".")[0] for h in res["head_linear"]})
        for h in res["head_linear"]:
            w, bias = tensors.get(f"{h}.head_weight", tensors.get(f"{h}.weight")), tensors.get(f"{h}.head_bias",
                                                                                              tensors.get(f"{h}.bias"))
            if w is None:
                raise ConfigError(f"export: the adapter has no weights for the head layer {h!r}")
            state[peft_key(h, "weight")] = w.to(dt).contiguous()
            if bias is not None:
                state[peft_key(h, "bias")] = bias.to(dt).contiguous()
        conv = {bool(v.get("conv1d")) for v in layers.values()}
        if len(conv) != 1:
            raise ConfigError("export: a mix of Conv1D and Linear layers cannot share one PEFT fan_in_fan_out setting")
        mc = info["config"]["model"]
        rslora = bool(mc.get("use_rslora", False))  # the run's α/√r is folded into B: PEFT's scale must be 1
        cfg = peft.LoraConfig(r=R, lora_alpha=unit_alpha(R, rslora), use_rslora=rslora, target_modules=sorted(layers),
                              lora_dropout=0.0, fan_in_fan_out=conv.pop(), modules_to_save=head_top or None,
                              task_type=task_from_resolved(res).peft_task_type,
                              base_model_name_or_path=resolve_model_path(mc["name"]))
        tok = load_tokenizer(mc.get("tokenizer") or mc["name"], "model.tokenizer" if mc.get("tokenizer") else "model.name")
        return info, res, state, cfg, tok, mc

    def write(out: Path, checked) -> None:
        info, res, state, cfg, tok, mc = checked
        cfg.save_pretrained(str(out))
        save_file(state, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        tok.save_pretrained(str(out))
        labels = peft_load_kwargs(res) if res.get("label_names") else {}  # a generation run has none
        method = info["config"]["method"]
        (out / EXPORT_INFO).write_text(json.dumps(labels | {
            "method": method["name"], "client": "global" if client is None else client,
            # the run's method options: an inference rule a PEFT adapter cannot hold travels here (FedDPA's
            # instance-wise weighting: eval_weighting, eval_mix, instance_*; docs/methods/feddpa.md)
            "method_options": dict(method.get("options") or {}),
            "base_built_from_config": mc.get("from_config") is not None}, indent=1))

    return _exporting(out, overwrite, run_dir, check, write)


#: the file of a PEFT export that says how to load it (labels, method, client)
EXPORT_INFO = "fedlora_export.json"


def peft_load_kwargs(resolved: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments the base classifier needs to take a run's head: ``num_labels``,
    ``id2label``, ``label2id`` (from config.json's ``resolved`` section)."""
    names = list(resolved["label_names"])
    return {"num_labels": len(names), "id2label": {i: n for i, n in enumerate(names)},
            "label2id": {n: i for i, n in enumerate(names)}}


@torch.no_grad()
def merge_adapters(model: torch.nn.Module, adapter: Mapping[str, torch.Tensor],
                   layers: Mapping[str, Mapping[str, Any]], head_linear: Sequence[str] = ()) -> dict[str, torch.Tensor]:
    """W0 ← W0 + ΔW in every adapted layer of ``model`` (a model whose layers are plain
    ``nn.Linear``/``Conv1D``, e.g. the base model loaded afresh, or one with ``SlotLoRALinear`` whose W0
    buffer is changed in place) and copy the client's head (``head_linear`` layers) in. Returns what
    ``unmerge_adapters`` needs: each changed tensor's previous value (restored exactly). FLoRA's
    dense ``<layer>.merged_weight`` (a half-precision base) replaces W0 before ΔW is added."""
    conv = _conv1d_type()
    backup: dict[str, torch.Tensor] = {}
    dense = {n[: -len(".merged_weight")]: t for n, t in adapter.items() if n.endswith(".merged_weight")}
    adapter = {n: t for n, t in adapter.items() if not n.endswith(".merged_weight")}
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
        w0 = dense[name].to(target.device) if name in dense else target
        target.copy_((w0.double() + b @ a).to(target.dtype))
    return backup


@torch.no_grad()
def unmerge_adapters(model: torch.nn.Module, backup: Mapping[str, torch.Tensor]) -> None:
    """Undo ``merge_adapters``: every merged weight back to its value before the merge (bit for bit)."""
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
    model, tok = task_from_resolved(info["resolved"]).build_model(info["config"]["model"], info["config"]["seed"])
    names = info["resolved"].get("label_names")
    if names:  # the run's class names, so a saved model predicts "mail", not "LABEL_2"
        model.config.id2label = {i: str(n) for i, n in enumerate(names)}
        model.config.label2id = {str(n): i for i, n in enumerate(names)}
    return model.eval(), tok


def export_merged(run_dir: str | Path, client: int | None, out: str | Path, *, overwrite: bool = False) -> Path:
    """Client ``client``'s model with its adapter merged into the base weights (and its head; FLoRA:
    with its merged update), saved with ``save_pretrained`` together with the tokenizer: a plain HF
    model, no PEFT needed. ``out`` must be empty unless ``overwrite``."""
    def check():
        info, tensors = load_run_adapter(run_dir, client)
        model, tok = load_run_base_model(info)
        merge_adapters(model, tensors, info["resolved"]["layers"], info["resolved"]["head_linear"])
        return model, tok

    def write(out: Path, checked) -> None:
        model, tok = checked
        model.save_pretrained(str(out))
        tok.save_pretrained(str(out))

    return _exporting(out, overwrite, run_dir, check, write)
