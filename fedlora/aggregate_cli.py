"""``fedlora aggregate``: PEFT adapters trained anywhere, aggregated with a method's server (``fedlora.peft_adapters``).

    fedlora aggregate --method flexlora CLIENT_DIR… (--weights 0.2,0.8 | --weights-from FILE) --out DIR

The ``fedlora`` dispatcher finds ``register`` through the entry point ``aggregate`` of the group
``fedlora.commands`` (fedlora/cli.py says how). Nothing here imports torch until the command runs.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError
from .io import claim_output_dir, write_json_atomic

__all__ = ["register", "BASE_DELTA", "SUMMARY"]

#: the base-weight increments of a method that changes the base (FLoRA, FedEx-LoRA), ``<module>.weight`` → tensor
BASE_DELTA = "base_delta.safetensors"
#: what was aggregated: method, inputs, normalised weights, what each output folder holds
SUMMARY = "aggregate.json"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``aggregate`` to the ``fedlora`` command's subparsers."""
    p = subparsers.add_parser(
        "aggregate", help="aggregate PEFT LoRA adapters trained anywhere with a method's server (FedAvg, FlexLoRA, …)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="One round of a method's server on K clients' PEFT adapters (folders PeftModel.save_pretrained "
                    "wrote): the uploads the method's clients would send, its aggregate and server update — what its "
                    "server does in `fedlora run` — given back as PEFT adapters.",
        epilog="writes into --out:\n"
               "  client_<k>/             what the method gives client k (the k-th CLIENT_DIR), a PEFT adapter folder\n"
               "                          (adapter_config.json + adapter_model.safetensors)\n"
               f"  {BASE_DELTA}  only for a method that changes the base (FLoRA, FedEx-LoRA): <module>.weight → the\n"
               "                          increment of the frozen base weight, in the layer's own layout\n"
               f"  {SUMMARY}          the method, inputs, normalised weights and outputs\n"
               "methods: those whose server needs nothing but the clients' LoRA factors (`Method.lora_upload`);\n"
               "docs/how-to/aggregate-peft.md lists them and what each gives a client.\n"
               "example: fedlora aggregate --method flexlora a/ b/ --weights 120,480 --out agg")
    p.add_argument("clients", nargs="+", metavar="CLIENT_DIR", help="a client's PEFT adapter folder, one per client")
    p.add_argument("--method", required=True, help="the method whose server aggregates (e.g. fedavg, flexlora, flora)")
    p.add_argument("--weights", default=None, metavar="W1,W2,…",
                   help="one weight per CLIENT_DIR, in order (e.g. numbers of training examples; normalised), or "
                        "'uniform'")
    p.add_argument("--weights-from", default=None, metavar="FILE",
                   help="a JSON file of the weights: a list in CLIENT_DIR order, or an object from each CLIENT_DIR "
                        "(as given, or its folder's name) to its weight, e.g. {\"a\": 120, \"b\": 480}")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a constructor option of the method (YAML value), as in a run config's method section; "
                        "for a method whose server takes options (repeatable)")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (must be new or empty, unless --overwrite)")
    p.add_argument("--overwrite", action="store_true",
                   help="clear --out first (only a folder that holds nothing but fedlora aggregate's files)")
    p.set_defaults(handler=_cmd_aggregate)


def _number(text: Any, where: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = math.nan
    if isinstance(text, bool) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{where}: weights are finite numbers ≥ 0, got {text!r}")
    return value


def _weights(args: argparse.Namespace) -> list[float]:
    """The weight of each CLIENT_DIR from --weights or --weights-from (exactly one of them)."""
    K = len(args.clients)
    if (args.weights is None) == (args.weights_from is None):
        raise ConfigError(f"--weights: {'missing' if args.weights is None else 'given with --weights-from'}: give "
                          f"one of --weights W1,…,W{K} ('uniform' for equal weights) or --weights-from FILE")
    if args.weights is not None:
        if args.weights.strip() == "uniform":
            return [1.0] * K
        parts = [t.strip() for t in args.weights.split(",")]
        if len(parts) != K:
            raise ConfigError(f"--weights: {len(parts)} weights for {K} CLIENT_DIRs; give one per CLIENT_DIR, in order")
        return [_number(t, "--weights") for t in parts]
    try:
        data = json.loads(Path(args.weights_from).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"--weights-from: cannot read {args.weights_from!r} as JSON: {e}") from None
    if isinstance(data, list):
        if len(data) != K:
            raise ConfigError(f"--weights-from: {args.weights_from!r} lists {len(data)} weights for {K} CLIENT_DIRs")
        return [_number(v, "--weights-from") for v in data]
    if not isinstance(data, dict):
        raise ConfigError(f"--weights-from: {args.weights_from!r} must hold a JSON list or object, not "
                          f"{type(data).__name__}")
    out = []
    for d in args.clients:
        key = next((k for k in (d, d.rstrip("/"), Path(d).name) if k in data), None)
        if key is None:
            raise ConfigError(f"--weights-from: {args.weights_from!r} has no weight for CLIENT_DIR {d!r} "
                              f"(keys: the CLIENT_DIRs as given or their folder names)")
        out.append(_number(data[key], "--weights-from"))
    return out


def _options(sets: list[str]) -> dict[str, Any]:
    out = {}
    for s in sets:
        key, eq, value = s.partition("=")
        if not eq or not key.strip().isidentifier():
            raise ConfigError(f"--set: expected OPTION=VALUE with a method option's name, got {s!r}")
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {key}: not a YAML value: {str(e).splitlines()[0]}") from None
    return out


def _cmd_aggregate(args: argparse.Namespace) -> int:
    weights = _weights(args)
    options = _options(args.set)
    folder = claim_output_dir(args.out, writes=["client_*", BASE_DELTA, SUMMARY], overwrite=args.overwrite)
    try:
        from safetensors.torch import save_file

        from .peft_adapters import aggregate_adapters

        res = aggregate_adapters(args.method, args.clients, weights, options)
        outputs = {}
        for k, adapter in enumerate(res.adapters):
            adapter.save(folder.path / f"client_{k}")
            outputs[f"client_{k}"] = {"from": args.clients[k], "r": adapter.config.get("r"),
                                      "lora_alpha": adapter.config.get("lora_alpha")}
        if res.base_delta:
            save_file(res.base_delta, str(folder.path / BASE_DELTA), metadata={"format": "pt", "method": res.method})
        write_json_atomic(folder.path / SUMMARY, {
            "method": res.method, "options": options, "clients": list(args.clients), "weights": res.weights,
            "outputs": outputs, "base_delta": BASE_DELTA if res.base_delta else None})
    except BaseException:
        folder.discard()
        raise
    extra = f" and {BASE_DELTA}" if res.base_delta else ""
    print(f"wrote {folder.path}: {len(res.adapters)} client adapters ({res.method}){extra}")
    return 0
