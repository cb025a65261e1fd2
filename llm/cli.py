"""``fedlora run``, ``fedlora export`` and ``fedlora plot``: the LLM layer's commands. The ``fedlora``
dispatcher finds ``register_run``, ``register_export`` and ``register_plot`` through the entry points
``run``, ``export`` and ``plot`` of the group ``fedlora.commands`` (fedlora/cli.py says how)."""
from __future__ import annotations

import argparse
import json

from fedlora.cli import check_output_dir, claim_output_dir
from fedlora.errors import ConfigError


def register_run(subparsers: argparse._SubParsersAction) -> None:
    """Add ``run`` (federate a HF model from one config file) to the ``fedlora`` command's subparsers."""
    run = subparsers.add_parser(
        "run", help="federated LoRA fine-tuning of a HuggingFace model (one config file)",
        description="Federate a HF classifier with any method: `fedlora run CONFIG [--set key=value …]`. "
                    "CONFIG is a YAML/TOML/JSON file or the name of a bundled one "
                    "(--list-configs); every field is described in llm/config.py and the README.")
    run.add_argument("config", nargs="?", help="config file, or a bundled config's name (e.g. minilm-debian)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a field, e.g. --set train.rounds=5 --set method.name=rolora (repeatable)")
    run.add_argument("--out", default=None, help="output folder (overrides output_dir); must be new or empty")
    run.add_argument("--overwrite", action="store_true",
                     help="clear the output folder first (only a folder that holds nothing but a run's files)")
    run.add_argument("--resume", metavar="RUN_DIR", default=None,
                     help="continue the interrupted run in RUN_DIR from its newest intact checkpoint (CONFIG and "
                          "--set may be left out; if given they must equal the run's config)")
    run.add_argument("--runtime", default="embedded", choices=("embedded", "flower"),
                     help="embedded (clients in this process, default) or flower (Flower's simulation engine: "
                          "one SuperNode per client; needs flwr — README 'Flower')")
    run.add_argument("--dry-run", action="store_true", help="validate and print the resolved config; train nothing")
    run.add_argument("--list-configs", action="store_true", help="list the bundled configs and exit")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.set_defaults(handler=_cmd_run)


def register_export(subparsers: argparse._SubParsersAction) -> None:
    """Add ``export`` (a client's model of a finished run as a PEFT adapter or merged model)."""
    ex = subparsers.add_parser("export", help="export a client's model of a finished run (PEFT adapter or merged model)")
    ex.add_argument("run_dir", help="the run's output folder (holds config.json and adapters/)")
    ex.add_argument("--client", type=int, default=0, help="client index (default 0)")
    ex.add_argument("--out", required=True, help="output folder (must be empty, unless --overwrite)")
    ex.add_argument("--overwrite", action="store_true",
                    help="clear a non-empty --out first (after every other check passed)")
    ex.add_argument("--format", default="peft", choices=("peft", "merged"),
                    help="peft (a LoRA adapter PEFT loads, default) or merged "
                         "(the base model with the adapter merged, save_pretrained)")
    ex.set_defaults(handler=_cmd_export)


def register_plot(subparsers: argparse._SubParsersAction) -> None:
    """Add ``plot`` (the curves of several runs in one figure, with the numbers as CSV)."""
    pl = subparsers.add_parser(
        "plot", help="compare runs: metric, loss, bytes and rank curves (PNG + CSV) and each split's label histograms",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Overlay the curves of `fedlora run` folders and draw each run's per-client label histograms.",
        epilog="writes into --out:\n"
               "  curves.png     4 panels: test metric (clients' mean; global model dashed), training loss,\n"
               "                 cumulative MB sent (up+down; up dotted), ranks (each `ranks` entry's mean)\n"
               "  curves.csv     the numbers: run, round, quantity, value (quantities named after the\n"
               "                 rounds.jsonl fields they come from, e.g. eval.test.mean.accuracy)\n"
               "  split/<run>.png, split.csv   per-client label histograms (train/val/test) of config.json\n"
               "  plot.json      the runs plotted (folder, label, method, task, status, rounds) and the metric\n"
               "An incomplete run (interrupted, failed, running) is plotted as far as it got, and said so.\n"
               "example: fedlora plot runs/fedavg runs/hetlora --labels FedAvg,HetLoRA --out plots/cmp")
    pl.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="output folders of `fedlora run` (config.json, rounds.jsonl)")
    pl.add_argument("--out", default="plots", metavar="DIR", help="output folder (default: plots); must be new or empty, unless --overwrite")
    pl.add_argument("--overwrite", action="store_true",
                    help="clear --out first (only a folder that holds nothing but fedlora plot's files)")
    pl.add_argument("--labels", default=None, metavar="A,B,…",
                    help="legend labels, comma-separated, one per RUN_DIR in order (default: folder name (method))")
    pl.add_argument("--metric", default=None, metavar="NAME",
                    help="the test metric to plot (default: the runs' main metric, e.g. accuracy; needed for runs "
                         "of different tasks; any metric every run reports, loss included)")
    pl.set_defaults(handler=_cmd_plot)


def _cmd_run(args: argparse.Namespace) -> int:
    from fedlora.llm.config import bundled_configs, load_config

    if args.list_configs:
        for name, path in bundled_configs().items():
            first = next((ln[1:].strip() for ln in path.read_text().splitlines() if ln.startswith("#")), "")
            print(f"{name:22} {first}")
        return 0
    if args.resume is not None:
        return _resume(args)
    if not args.config:
        raise ConfigError("run: give a config file or a bundled config's name (fedlora run --list-configs)")
    # --out is a path, never YAML: quoted, so "123", "yes" or "null" stay folder names
    overrides = list(args.set) + ([f"output_dir={json.dumps(args.out)}"] if args.out is not None else [])
    cfg = load_config(args.config, overrides)
    if args.dry_run:  # the config and the method as the run would build it (bad options fail here)
        from .config import describe_method
        from .runtime import FederatedRun

        method = describe_method(cfg)
        data = FederatedRun(cfg, write=False).check_data()  # columns, labels, the split: what needs no model
        print(json.dumps({**cfg.to_dict(), "resolved": {"method": method, "data": data}}, indent=1))
        return 0
    from fedlora.llm.runtime import RUN_WRITES, FederatedRun

    folder = claim_output_dir(cfg.output_dir, "--out" if args.out is not None else "output_dir", writes=RUN_WRITES,
                              overwrite=args.overwrite)
    _report(FederatedRun(cfg, progress=not args.no_progress, output=folder, runtime=args.runtime).run(), folder.path)
    return 0


def _resume(args: argparse.Namespace) -> int:
    """``fedlora run [CONFIG] --resume RUN_DIR``: finish an interrupted run from its newest intact checkpoint."""
    from fedlora.llm.runtime import FederatedRun

    for flag, bad in (("--out", args.out is not None), ("--overwrite", args.overwrite), ("--dry-run", args.dry_run)):
        if bad:
            raise ConfigError(f"{flag}: not with --resume (a resumed run continues in its own folder)")
    run = FederatedRun.resume(args.resume, args.config, args.set, progress=not args.no_progress)
    ck = run._resume_from
    for path, why in ck.skipped:
        print(f"fedlora: skipped checkpoint {path}: {why}")
    print(f"resuming {args.resume} after round {ck.round} of {run.cfg.train.rounds} ({ck.path.name})")
    _report(run.run(), run.output.path)
    return 0


def _report(summary, out) -> None:
    m = summary["main_metric"]
    print(f"{summary['method']} on {summary['task']}: {summary['clients']} clients, {summary['rounds']} rounds, "
          f"{summary['wall_s']:.1f} s")
    skipped = summary["n_clients_without_test"]
    mean = "clients' mean" if not skipped else (f"mean of the {summary['clients'] - skipped} clients with test rows; "
                                                f"{skipped} of {summary['clients']} have none and are left out")
    print(f"test {m} ({mean}): round 0 {summary['round0_test']['mean'][m]:.4f} → "
          f"final {summary['final_test']['mean'][m]:.4f}  (min {summary['final_test']['min'][m]:.4f}, "
          f"max {summary['final_test']['max'][m]:.4f}, size-weighted {summary['final_test']['weighted_mean'][m]:.4f})")
    if "final_global" in summary:
        print(f"global model test {m}: round 0 {summary['round0_global'][m]:.4f} → final {summary['final_global'][m]:.4f}")
    print(f"bytes up {summary['bytes_up_total']:,}, down {summary['bytes_down_total']:,}")
    print(f"wrote {out}/config.json, run.json, rounds.jsonl, summary.json, rounds.png, adapters/, checkpoints/")


def _cmd_export(args: argparse.Namespace) -> int:
    from fedlora.llm.export import export_merged, export_peft

    if args.client < 0:
        raise ConfigError(f"--client: must be an integer ≥ 0, got {args.client}")
    out = check_output_dir(args.out)
    path = (export_peft if args.format == "peft" else export_merged)(args.run_dir, args.client, out,
                                                                     overwrite=args.overwrite)
    print(f"wrote {path} ({args.format}, client {args.client})")
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    import sys

    from fedlora.llm.plots import plot_runs

    labels = args.labels.split(",") if args.labels is not None else None
    res = plot_runs(args.run_dirs, args.out, labels=labels, metric=args.metric, overwrite=args.overwrite)
    for note in res["notes"]:
        print(f"fedlora: warning: {note}", file=sys.stderr)
    print(f"plotted test {res['metric']} of {len(res['runs'])} run(s): {', '.join(r['label'] for r in res['runs'])}")
    print(f"wrote {res['out']}/{', '.join(sorted({f.split('/')[0] + ('/' if '/' in f else '') for f in res['files']}))}")
    return 0
