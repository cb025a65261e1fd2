"""``fedlora run``, ``fedlora export``, ``fedlora plot``, ``fedlora compare`` and ``fedlora flower``: the LLM
layer's commands. The ``fedlora`` dispatcher finds ``register_run``, ``register_export``, ``register_plot``,
``register_compare`` and ``register_flower`` through the entry points ``run``, ``export``, ``plot``, ``compare``
and ``flower`` of the group ``fedlora.commands`` (fedlora/cli.py says how)."""
from __future__ import annotations

import argparse
import json
import re

from fedlora.cli import claim_output_dir
from fedlora.errors import ConfigError


def register_run(subparsers: argparse._SubParsersAction) -> None:
    """Add ``run`` (federate a HF model from one config file) to the ``fedlora`` command's subparsers."""
    run = subparsers.add_parser(
        "run", help="federated LoRA fine-tuning of a HuggingFace model (one config file)",
        description="Federate a HF model — classifier, causal LM (generation) or extractive QA — with any method; "
                    "with H²Tune, clients may hold different models and tasks (federation.client_models): "
                    "`fedlora run CONFIG [--set key=value …]`. "
                    "CONFIG is a YAML/TOML/JSON file or the name of a bundled one "
                    "(--list-configs). Every field, with its type and default: docs/reference/config.md (the documentation "
                    "site's Reference → Config fields).")
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
                          "one SuperNode per client; needs flwr — docs/how-to/flower.md)")
    run.add_argument("--dry-run", action="store_true", help="validate and print the resolved config; train nothing")
    run.add_argument("--list-configs", action="store_true", help="list the bundled configs and exit")
    run.add_argument("--no-progress", action="store_true",
                     help="no progress bar: one line per round instead (as when stderr is not a terminal)")
    run.set_defaults(handler=_cmd_run)


def register_export(subparsers: argparse._SubParsersAction) -> None:
    """Add ``export`` (a client's model of a finished run as a PEFT adapter or merged model)."""
    ex = subparsers.add_parser("export", help="export a client's model of a finished run (PEFT adapter or merged model)")
    ex.add_argument("run_dir", help="the run's output folder (holds config.json and adapters/)")
    who = ex.add_mutually_exclusive_group()
    who.add_argument("--client", type=int, default=None, help="client index (default 0)")
    who.add_argument("--global", dest="global_", action="store_true",
                     help="the global adapter of a SecAgg+ run (its clients' models never leave them)")
    ex.add_argument("--out", required=True, help="output folder (must be new or empty, unless --overwrite)")
    ex.add_argument("--overwrite", action="store_true",
                    help="replace an earlier export in --out (after every other check passed; only a folder that "
                         "holds nothing but an export's files — anything else is refused, never removed)")
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


def register_compare(subparsers: argparse._SubParsersAction) -> None:
    """Add ``compare`` (methods on one config, each step size chosen on validation, several seeds)."""
    cp = subparsers.add_parser(
        "compare", help="compare methods on one config: each one's step size chosen on the clients' validation "
                        "splits, several seeds, one table and one figure",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run every method of --methods with every step size of its --lr-grid for --seeds seeds "
                    "(each a `fedlora run` of CONFIG), choose each method's step size on the clients' validation "
                    "metric (never the test split), and report the chosen runs' test numbers.",
        epilog="writes into --out:\n"
               "  compare.md    the table: test metric (clients' mean ± std over seeds), global model, MB/round, wall s\n"
               "  compare.png   the table's bars and each method's validation score over its grid\n"
               "  compare.json  every run's validation score, the choices, the chosen runs' numbers\n"
               "  runs/<method>/lr_<lr>/seed_<s>/   every run's folder (fedlora run's files; with --grid\n"
               "                                   runs/<method>/lr_<lr>/<KEY>_<V>/seed_<s>/)\n"
               "example: fedlora compare minilm-debian --methods fedavg,rolora,pf2lora --lr-grid 1e-3,5e-3 \\\n"
               "             --lr-grid pf2lora=2e-3,5e-3 --seeds 2 --set train.rounds=5 --out runs/cmp")
    cp.add_argument("config", help="config file, or a bundled config's name (fedlora run --list-configs)")
    cp.add_argument("--methods", required=True, metavar="A,B,…", help="the methods to compare (registered names)")
    cp.add_argument("--lr-grid", action="append", required=True, metavar="LRS",
                    help="step sizes (method.lr) to choose from: 1e-3,5e-3 for every method, or pf2lora=1e-3,2e-3 "
                         "for one (repeatable)")
    cp.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,…",
                    help="also choose a config key's value on validation: its values are crossed with every step "
                         "size, the best (step size, values) pair wins, e.g. --grid privacy.clip_norm=2,5,10 "
                         "(repeatable: the keys are crossed)")
    cp.add_argument("--seeds", type=int, default=2, help="seeds per step size: the config's seed + 0 … N−1 (default 2)")
    cp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a field of CONFIG for every run, e.g. --set train.rounds=5 (repeatable)")
    cp.add_argument("--out", default="runs/compare-llm", help="output folder (default runs/compare-llm); must be new "
                                                              "or empty, unless --overwrite")
    cp.add_argument("--overwrite", action="store_true", help="clear --out first (only a folder of compare's files)")
    cp.add_argument("--resume", action="store_true",
                    help="keep every finished run in --out of exactly the same settings and run the others: a stopped "
                         "compare goes on, a grown one (more seeds, methods, step sizes or --grid values) runs only "
                         "what is new")
    cp.add_argument("--report", action="store_true",
                    help="run nothing and write nothing: print the table of the runs --out holds so far (a method "
                         "whose runs have not all finished is listed, not chosen)")
    cp.add_argument("--jobs", type=int, default=1, metavar="N",
                    help="runs at once, each in its own process with train.threads threads (default 1); the numbers "
                         "do not depend on it, e.g. --jobs 4 --set train.threads=2 on 8 cores")
    cp.add_argument("--progress", action="store_true", help="a progress bar per run (--jobs 1 only)")
    cp.set_defaults(handler=_cmd_compare)


def _cmd_compare(args: argparse.Namespace) -> int:
    import shlex

    from fedlora.errors import did_you_mean
    from fedlora.io import write_bytes_atomic, write_json_atomic
    from fedlora.methods import available_methods

    from .compare import COMPARE_WRITES, parse_lr_grid, parse_value_grid, plot_compare, run_compare, to_markdown

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:
        raise ConfigError("--methods: name at least one method, e.g. --methods fedavg,rolora")
    for m in methods:
        if m not in available_methods():
            raise ConfigError(f"--methods: unknown method {m!r}{did_you_mean(m, available_methods())}; "
                              f"registered: {', '.join(available_methods())}")
    if len(set(methods)) != len(methods):
        raise ConfigError("--methods: a method is listed twice")
    grids = parse_lr_grid(args.lr_grid, methods)
    parse_value_grid(args.grid, args.set)  # its own mistakes refused before the folder is claimed
    if args.seeds < 1:
        raise ConfigError(f"--seeds: at least 1, got {args.seeds}")
    if args.jobs < 1:
        raise ConfigError(f"--jobs: the runs at once, an integer ≥ 1, got {args.jobs}")
    if args.resume and args.overwrite:
        raise ConfigError("--resume keeps the finished runs of --out and --overwrite clears them: give one")
    if args.report:
        return _compare_report(args, methods, grids)
    if args.progress and args.jobs > 1:
        raise ConfigError("--progress: one bar per run needs --jobs 1 (runs in worker processes would draw over "
                          "each other)")
    # --resume: the folder must hold only compare's files, as for --overwrite, but nothing is cleared
    folder = claim_output_dir(args.out, writes=COMPARE_WRITES, overwrite=args.overwrite or args.resume,
                              clear=not args.resume, keep=args.resume,
                              overwrite_flag="--resume" if args.resume else "--overwrite")
    out = folder.path
    try:
        res = run_compare(args.config, args.set, methods, grids, args.seeds, out, grid=args.grid, progress=args.progress,
                          jobs=args.jobs, reuse=args.resume)
    except BaseException:
        folder.remove_if_empty()
        raise
    command = "fedlora compare " + shlex.join([args.config, "--methods", args.methods] +
                                              [x for g in args.lr_grid for x in ("--lr-grid", g)] +
                                              [x for g in args.grid for x in ("--grid", g)] +
                                              ["--seeds", str(args.seeds)] + [x for s in args.set for x in ("--set", s)] +
                                              ["--out", args.out])
    res["command"] = command
    write_json_atomic(out / "compare.json", res)
    write_bytes_atomic(out / "compare.md", to_markdown(res, command).encode())
    plot_compare(res, out / "compare.png")
    print(to_markdown(res, command))
    print(f"wrote {out}/compare.md, compare.png, compare.json, runs/")
    return 0


def _compare_report(args: argparse.Namespace, methods, grids) -> int:
    """``fedlora compare … --report``: the table of the finished runs in --out (``run_compare(report=True)``);
    nothing is run, written or removed."""
    from .compare import run_compare, to_markdown

    for flag, given in (("--resume", args.resume), ("--overwrite", args.overwrite)):
        if given:
            raise ConfigError(f"--report runs and writes nothing; {flag} is not for it")
    from pathlib import Path

    out = Path(args.out)
    if not out.is_dir():
        raise ConfigError(f"--report: {str(out)!r} is not a folder of compare's results (give the --out of a compare)")
    res = run_compare(args.config, args.set, methods, grids, args.seeds, out, grid=args.grid, report=True)
    if not res["methods"]:
        raise ConfigError(f"--report: no method of --methods has all its runs finished in {str(out)!r} yet (finished "
                          "runs: " + ", ".join(f"{m} {v['finished']} of {v['runs']}" for m, v in
                                               res["unfinished"].items()) + ")")
    print(to_markdown(res, "fedlora compare … --report"))
    return 0


def register_flower(subparsers: argparse._SubParsersAction) -> None:
    """Add ``flower`` (a Flower deployment: its files, its processes, or all of it on this machine)."""
    fl = subparsers.add_parser(
        "flower", help="run on a Flower deployment: certificates, the app, SuperLink/SuperNode, or all on this machine",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="A Flower 1.42 deployment of `fedlora run` (docs/how-to/flower.md, 'Flower on one machine and on several').",
        epilog="on one machine (SuperLink, one SuperNode per client, TLS, all stopped at the end):\n"
               "  fedlora flower local tiny-smoke --out runs/flower\n"
               "on several: on the server  fedlora flower certs --out certs --host server.example.org\n"
               "                           fedlora flower superlink --certs certs\n"
               "            on client K    fedlora flower supernode --superlink server.example.org:9092 --ca ca.pem \\\n"
               "                               --partition K --partitions N\n"
               "            to start a run fedlora flower app my.yaml --out app\n"
               "                           flwr run app LINK --run-config app/run.toml")
    sub = fl.add_subparsers(dest="flower_command", required=True, parser_class=type(fl))

    lo = sub.add_parser("local", help="run CONFIG on a Flower deployment on this machine (TLS on loopback)")
    lo.add_argument("config", help="config file, or a bundled config's name (fedlora run --list-configs)")
    lo.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a field (repeatable)")
    lo.add_argument("--out", default=None, help="output folder (overrides output_dir); must be new or empty")
    lo.add_argument("--overwrite", action="store_true",
                    help="clear --out (and --work) first: only a folder that holds nothing but a run's files "
                         "(--work: a deployment's); anything else in it is refused, never removed")
    lo.add_argument("--insecure", action="store_true", help="no TLS (default: a CA and certificate made for the run)")
    lo.add_argument("--auth", action="store_true", help="SuperNode authentication: each node's key registered first")
    lo.add_argument("--cold", action="store_true", help="flwr's own SuperExec: a new Python process per message "
                    "(default: forked from a warm, pre-imported one, fedlora.flower_warm)")
    lo.add_argument("--timeout", type=float, default=3600.0, help="seconds the whole run may take (default 3600)")
    lo.add_argument("--work", default=None, metavar="DIR",
                    help="keep the deployment's certificates, state and process logs here (default: a temporary "
                         "folder, removed after a complete run and named in the error otherwise)")

    ce = sub.add_parser("certs", help="a CA and a SuperLink certificate (ca.pem, server.pem, server.key)")
    ce.add_argument("--out", required=True, metavar="DIR",
                    help="output folder (must be new or empty: existing certificates are never replaced unasked)")
    ce.add_argument("--overwrite", action="store_true",
                    help="replace the certificates and key already in --out (only a folder that holds nothing "
                         "else); every SuperNode then needs the new ca.pem")
    ce.add_argument("--host", action="append", default=None, metavar="NAME_OR_IP",
                    help="a name or address the SuperLink is reached at (repeatable; default localhost, 127.0.0.1)")
    ce.add_argument("--days", type=int, default=365, help="validity in days (default 365)")

    ap = sub.add_parser("app", help="write the Flower app `flwr run` submits (pyproject.toml; with CONFIG, run.toml too)",
                        description="Write the Flower app folder (its code is the installed fedlora) and, given CONFIG, "
                                    "run.toml, the run's resolved config for `flwr run DIR LINK --run-config DIR/run.toml`.")
    ap.add_argument("config", nargs="?", help="config file, or a bundled config's name (optional)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a field (repeatable)")
    ap.add_argument("--out", required=True, metavar="DIR",
                    help="output folder (must be new or empty; never a project's folder: a pyproject.toml this "
                         "command did not write is never replaced)")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace an app this command wrote before (its pyproject.toml and run.toml; a folder "
                         "holding anything else is refused)")
    ap.add_argument("--run-dir", default=None, help="the run folder, on the SuperLink's machine (default: output_dir)")
    ap.add_argument("--overwrite-run", action="store_true", help="the run may clear a non-empty run folder")

    sl = sub.add_parser("superlink", help="start flower-superlink with fedlora's settings (runs until stopped)")
    sl.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    sl.add_argument("--port", type=int, default=9092, help="its one port (Fleet, Control and Runtime APIs; default 9092)")
    sl.add_argument("--certs", default=None, metavar="DIR", help="folder of `fedlora flower certs` (TLS)")
    sl.add_argument("--insecure", action="store_true", help="no TLS (only on a trusted network)")
    sl.add_argument("--auth", action="store_true", help="only registered SuperNodes may connect (flwr supernode register)")
    sl.add_argument("--database", default="state.db", help="the SuperLink's state (default state.db)")

    sn = sub.add_parser("supernode", help="start flower-supernode holding one partition (runs until stopped)")
    sn.add_argument("--superlink", required=True, metavar="HOST:PORT", help="the SuperLink's address")
    sn.add_argument("--partition", type=int, required=True, help="the client this node holds (0..N-1)")
    sn.add_argument("--partitions", type=int, required=True, help="N, the run's federation.clients")
    sn.add_argument("--ca", default=None, metavar="FILE", help="the CA that signed the SuperLink's certificate (ca.pem)")
    sn.add_argument("--insecure", action="store_true", help="no TLS")
    sn.add_argument("--port", type=int, default=9094, help="local port for its ClientApps (one per SuperNode on a host)")
    sn.add_argument("--auth-key", default=None, metavar="FILE", help="its private key, when the SuperLink uses --auth")
    sn.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the SuperLink (default 60)")
    sn.add_argument("--warm", action="store_true", help="serve its messages from a warm SuperExec: each ClientApp "
                    "forked from a process that imported torch, transformers and fedlora once (fedlora.flower_warm)")
    fl.set_defaults(handler=_cmd_flower)


def _cmd_flower(args: argparse.Namespace) -> int:
    import os
    import shlex
    from pathlib import Path

    from . import flower_deploy as fd

    cmd = args.flower_command
    if cmd == "local":
        return _flower_local(args)
    if cmd == "certs":
        if args.days < 1:
            raise ConfigError(f"--days: must be ≥ 1, got {args.days}")
        folder = fd.claim_certs_dir(args.out, overwrite=args.overwrite)  # key material never replaced unasked
        try:
            paths = fd.make_certs(folder.path, args.host or ("localhost", "127.0.0.1"), args.days,
                                  overwrite=args.overwrite)
        except BaseException:
            folder.remove_if_empty()
            raise
        print(f"wrote {paths['ca']} (give it to every SuperNode and flwr), {paths['cert']} and {paths['key']} "
              f"(the SuperLink's; keep the key private)")
        return 0
    if cmd == "app":
        from .config import load_config
        from .flower import write_app_dir

        if args.config is None and (args.set or args.run_dir is not None or args.overwrite_run):
            raise ConfigError("app: --set, --run-dir and --overwrite-run go with a CONFIG (they write run.toml)")
        cfg = load_config(args.config, args.set) if args.config is not None else None
        if cfg is not None:
            from .flower import check_flower_config

            check_flower_config(cfg, deployment=True)
        folder = fd.claim_app_dir(args.out, overwrite=args.overwrite)  # a project's pyproject.toml never replaced
        out = folder.path
        try:
            app = write_app_dir(out)
            if cfg is not None:
                path = fd.write_run_config(out / "run.toml", cfg.to_dict(), out=args.run_dir,
                                           overwrite=args.overwrite_run)
        except BaseException:
            folder.discard()
            raise
        print(f"wrote {app}/pyproject.toml")
        if cfg is not None:
            print(f"wrote {path}: flwr run {out} LINK --run-config {path}")
        return 0
    if cmd == "superlink":
        if (args.certs is None) == (not args.insecure):
            raise ConfigError("superlink: give --certs DIR (TLS, from `fedlora flower certs`) or --insecure")
        certs = None
        if args.certs is not None:
            certs = {k: Path(args.certs) / f for k, f in (("ca", "ca.pem"), ("cert", "server.pem"), ("key", "server.key"))}
            missing = [str(p) for p in certs.values() if not p.is_file()]
            if missing:
                raise ConfigError(f"--certs {args.certs}: missing {', '.join(missing)} (make them: fedlora flower certs DIR)")
        argv = fd.superlink_command(host=args.host, port=args.port, certs=certs, database=args.database, auth=args.auth)
    else:
        if (args.ca is None) == (not args.insecure):
            raise ConfigError("supernode: give --ca FILE (the CA of the SuperLink's certificate) or --insecure")
        if args.ca is not None and not Path(args.ca).is_file():
            raise ConfigError(f"--ca: no such file {args.ca}")
        if args.partitions < 1:
            raise ConfigError(f"--partitions: must be ≥ 1, got {args.partitions}")
        argv = fd.supernode_command(args.superlink, args.partition, args.partitions, ca=args.ca, port=args.port,
                                    auth_key=args.auth_key, max_wait_s=args.wait)
        if args.warm:
            argv = fd.warm_command(argv, preload=(*fd.WARM_PRELOAD, fd.APP))
        fd.check_reachable(args.superlink, args.ca, args.wait)  # a wrong address fails here, in one line
    print(shlex.join(argv), flush=True)
    os.execve(argv[0], argv, fd.flower_env())  # the process becomes flwr's (signals, exit status)
    return 0  # pragma: no cover


def _flower_local(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .config import load_config
    from .flower_deploy import run_local

    if args.timeout <= 0:
        raise ConfigError(f"--timeout: must be > 0 seconds, got {args.timeout}")
    overrides = list(args.set) + ([f"output_dir={json.dumps(args.out)}"] if args.out is not None else [])
    cfg = load_config(args.config, overrides)
    from .flower import check_flower_config
    from .runfolder import RUN_WRITES

    check_flower_config(cfg, deployment=True)  # what a deployment cannot run: refused before anything is said or started
    # checked here (nothing cleared yet), claimed again by the ServerApp — the folder must be usable before
    # anything starts
    folder = claim_output_dir(cfg.output_dir, "--out" if args.out is not None else "output_dir", writes=RUN_WRITES,
                              overwrite=args.overwrite, clear=False)
    out = folder.path
    work = None
    if args.work is not None:  # the deployment's certificates, node keys, state and logs: never mixed with others
        from .flower_deploy import WORK_WRITES

        try:
            work = claim_output_dir(args.work, "--work", writes=WORK_WRITES, overwrite=args.overwrite, clear=False)
        except BaseException:
            folder.remove_if_empty()
            raise
        work.clear()  # with --overwrite: the earlier deployment's files (only those), now that both folders passed
    print(f"starting a SuperLink and {cfg.federation.clients} SuperNode{'s' * (cfg.federation.clients != 1)} on 127.0.0.1"
          f"{'' if args.insecure else ' (TLS)'}{', SuperNode authentication' if args.auth else ''}", flush=True)
    try:
        summary = run_local(cfg, Path(out).resolve(), overwrite=args.overwrite, tls=not args.insecure,
                            auth=args.auth, timeout=args.timeout, work=args.work, warm=not args.cold)
    except BaseException:
        folder.remove_if_empty()
        if work is not None:
            work.remove_if_empty()
        raise
    _report(summary, out)
    return 0


#: a full stop that ends no sentence: an abbreviation (et al., App., e.g., i.i.d.) or an initial
_ABBREVIATION = re.compile(r"(?:\b(?:al|App|Apps|Fig|Figs|Tab|Eq|Sec|cf|vs|etc|no|e\.g|i\.e|i\.i\.d)|\b[A-Z])\.$")


def leading_comment(text: str) -> str:
    """A config file's opening comment block (its ``#`` lines up to the first example command or setting),
    as one line."""
    lines = []
    for ln in text.splitlines():
        if not ln.startswith("#") or ln.startswith("#  "):  # a setting, or an indented example command
            break
        lines.append(ln[1:].strip())
    return " ".join(" ".join(lines).split())


def first_sentence(text: str) -> str:
    """The first sentence of ``text``, whole: up to the first full stop followed by a space (or the end)
    that does not close an abbreviation; all of ``text`` if none."""
    for m in re.finditer(r"\.(?=\s|$)", text):
        if not _ABBREVIATION.search(text[:m.end()]):
            return text[:m.end()]
    return text


def _cmd_run(args: argparse.Namespace) -> int:
    from fedlora.llm.config import bundled_configs, check_secagg_runtime, load_config

    if args.list_configs:
        import shutil
        import textwrap

        width = max(60, min(120, shutil.get_terminal_size().columns))
        for name, path in bundled_configs().items():
            print(textwrap.fill(first_sentence(leading_comment(path.read_text())), width=width,
                                initial_indent=f"{name:22} ", subsequent_indent=" " * 23, break_long_words=False,
                                break_on_hyphens=False))
        return 0
    if args.resume is not None:
        return _resume(args)
    if not args.config:
        raise ConfigError("run: give a config file or a bundled config's name (fedlora run --list-configs)")
    # --out is a path, never YAML: quoted, so "123", "yes" or "null" stay folder names
    overrides = list(args.set) + ([f"output_dir={json.dumps(args.out)}"] if args.out is not None else [])
    cfg = load_config(args.config, overrides)
    check_secagg_runtime(cfg, args.runtime)  # SecAgg+ needs Flower: refused before anything is claimed or built
    if args.runtime == "flower":  # what Flower cannot run is refused before anything is claimed or built
        from .flower import check_flower_config

        check_flower_config(cfg)
    if args.dry_run:  # every check of the run's preparation, no weights loaded, nothing trained (FederatedRun.check)
        from .config import describe_method
        from .runs import run_class

        method = describe_method(cfg)
        checked = run_class(cfg)(cfg, write=False, runtime=args.runtime).check()  # data, split, model, adapters, head
        print(json.dumps({**cfg.to_dict(), "resolved": {"method": method, **checked}}, indent=1))
        return 0
    from fedlora.llm.runfolder import RUN_WRITES
    from fedlora.llm.runs import run_class

    folder = claim_output_dir(cfg.output_dir, "--out" if args.out is not None else "output_dir", writes=RUN_WRITES,
                              overwrite=args.overwrite)
    bar, log = _progress_and_log(args)
    run = run_class(cfg)(cfg, progress=bar, output=folder, runtime=args.runtime, log=log)
    _report(_execute(run), folder.path)
    return 0


def _execute(run):
    """Run ``run`` over the executor its runtime names: its own (slots; one slot executor per model group), or
    Flower's simulation engine, one SuperNode per client (``fedlora.llm.flower.run_simulation``)."""
    if run.runtime == "flower":
        from .flower import run_simulation

        return run_simulation(run)
    return run.run()


def _resume(args: argparse.Namespace) -> int:
    """``fedlora run [CONFIG] --resume RUN_DIR``: finish an interrupted run from its newest intact checkpoint."""
    from fedlora.llm.runs import resume

    for flag, bad in (("--out", args.out is not None), ("--overwrite", args.overwrite), ("--dry-run", args.dry_run)):
        if bad:
            raise ConfigError(f"{flag}: not with --resume (a resumed run continues in its own folder)")
    bar, log = _progress_and_log(args)
    run = resume(args.resume, args.config, args.set, progress=bar, log=log)
    ck = run.resume_from
    for path, why in ck.skipped:
        print(f"fedlora: skipped checkpoint {path}: {why}")
    print(f"resuming {args.resume} after round {ck.round} of {run.cfg.train.rounds} ({ck.path.name})")
    _report(_execute(run), run.output.path)
    return 0


def _progress_and_log(args: argparse.Namespace):
    """``fedlora run``'s progress: a bar on stderr when it is a terminal (not with --no-progress), and one
    line per round on stdout (``FederatedRun._round_line``) where there is no bar or stdout is not a terminal
    (a log file). Returns (bar, the run's ``log``)."""
    import sys

    bar = not args.no_progress and sys.stderr.isatty()
    return bar, (_print_flushed if not bar or not sys.stdout.isatty() else None)


def _print_flushed(line: str) -> None:
    print(line, flush=True)  # a log file sees each round as it ends


def _wall_text(summary) -> str:
    """summary.json's wall time; a resumed run's with its parts (``wall_s_parts``: one per start)."""
    parts = summary.get("wall_s_parts") or [summary["wall_s"]]
    if len(parts) == 1:
        return f"{summary['wall_s']:.1f} s"
    each = " + ".join("?" if p is None else f"{p:.1f}" for p in parts)
    return f"{summary['wall_s']:.1f} s ({each} s: stopped and resumed {len(parts) - 1}×)"


def _wrote(out) -> str:
    """The run's closing line: what it wrote into ``out``, in a fixed order — only what is there (a run without
    checkpoints, ``train.checkpoint_every: 0`` or SecAgg+, has no checkpoints/)."""
    from pathlib import Path

    names = ("config.json", "run.json", "rounds.jsonl", "summary.json", "rounds.png", "adapters", "checkpoints")
    there = [n + "/" * (Path(out, n).is_dir()) for n in names if Path(out, n).exists()]
    return f"wrote {out}/{', '.join(there)}"


def _report(summary, out) -> None:
    from fedlora.errors import plural

    print(f"{summary['method']} on {summary['task']}: {plural(summary['clients'], 'client')}, "
          f"{plural(summary['rounds'], 'round')}, {_wall_text(summary)}")
    if "wall_s_engine" in summary:  # --runtime flower: the simulation engine's start and stop come on top
        print(f"Flower's simulation engine: {summary['wall_s_engine']:.1f} s in all — the time above counts the "
              f"rounds (and evaluations); the rest is Ray starting and stopping")
    if "tasks" in summary:  # heterogeneous client models: each task's clients' mean (fedlora.llm.hetero)
        for g in summary["groups"]:
            print(f"clients {g['clients']}: {g['model']} on {g['task']}")
        for name, t in summary["tasks"].items():
            m = t["main_metric"]
            print(f"{name} test {m} (mean of clients {t['clients']}): round 0 {t['round0_test']['mean'][m]:.4f} → "
                  f"final {t['final_test']['mean'][m]:.4f}")
        print(f"bytes up {summary['bytes_up_total']:,}, down {summary['bytes_down_total']:,}")
        print(_wrote(out))
        return
    m = summary["main_metric"]
    skipped = summary["n_clients_without_test"]
    mean = "clients' mean" if not skipped else (f"mean of the {summary['clients'] - skipped} clients with test rows; "
                                                f"{skipped} of {summary['clients']} have none and are left out")
    print(f"test {m} ({mean}): round 0 {summary['round0_test']['mean'][m]:.4f} → "
          f"final {summary['final_test']['mean'][m]:.4f}  (min {summary['final_test']['min'][m]:.4f}, "
          f"max {summary['final_test']['max'][m]:.4f}, size-weighted {summary['final_test']['weighted_mean'][m]:.4f})")
    if "final_global" in summary:
        print(f"global model test {m}: round 0 {summary['round0_global'][m]:.4f} → final {summary['final_global'][m]:.4f}")
    print(f"bytes up {summary['bytes_up_total']:,}, down {summary['bytes_down_total']:,}")
    print(_wrote(out))


def _cmd_export(args: argparse.Namespace) -> int:
    from fedlora.llm.runfolder import claim_export_dir, read_run_config

    client = None if args.global_ else 0 if args.client is None else args.client
    if client is not None and client < 0:
        raise ConfigError(f"--client: must be an integer ≥ 0, got {args.client}")
    # --out first (as every command: refused before any work, nothing cleared yet); a failed export leaves
    # no folder it created (and no file it wrote)
    folder = claim_export_dir(args.out, args.overwrite, args.run_dir)
    try:
        read_run_config(args.run_dir, "export")  # not a run folder: one line, before torch is imported
        from fedlora.llm.export import export_merged, export_peft

        path = (export_peft if args.format == "peft" else export_merged)(args.run_dir, client, folder.path,
                                                                         overwrite=args.overwrite)
    except BaseException:
        folder.remove_if_empty()
        raise
    print(f"wrote {path} ({args.format}, {'the global adapter' if client is None else f'client {client}'})")
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
