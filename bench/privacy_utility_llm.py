"""The privacy–utility sweep on real text (issue 29 item 5): FedAvg-LoRA, FFA-LoRA, RoLoRA, FedSVD and Fed-SB on the
bundled MiniLM config (``minilm-debian``) at ε ∈ {∞, 6, 3, 1}, δ = 1e-5, sample-level DP-SGD, the clipping norm
chosen from {2, 5, 10} and the step size from a grid (FFA-LoRA's 10× the others'), 2 seeds: the DP setting of Sun,
Li, Li, Ding, "Improving LoRA in Privacy-preserving Federated Learning", ICLR 2024 (client-local DP-SGD at
ε ∈ {6, 3, 1}, δ = 1e-5, C ∈ {2, 5, 10}, FFA-LoRA's step-size grid 10× LoRA's), on our 4-client real-text config.

    python bench/privacy_utility_llm.py --out runs/privacy-llm [--resume]                 # the full sweep
    python bench/privacy_utility_llm.py --config tiny-smoke --methods fedavg,ffa --epsilons inf,3 --seeds 1 \\
        --lr-grid 1e-3 --clip-norms 0.5,5 --out runs/privacy-llm-smoke                  # seconds

One ``fedlora compare`` (``fedlora.llm.compare.run_compare``) per ε, each in its own folder ``<out>/eps_<ε>``
with compare's own files (compare.json, compare.md, compare.png, runs/):

- ε = ∞: ``privacy.level: none`` (ordinary batches, no clipping): the step size alone is chosen;
- ε finite: ``privacy.level: sample``, ``privacy.target_epsilon: ε`` (σ derived so that every client ends the
  planned rounds within ε), ``privacy.delta: 1e-5`` and ``--grid privacy.clip_norm=2,5,10``: the (step size, C)
  pair is chosen on the clients' validation accuracy (mean over seeds; ties → the smaller step, then the
  smaller C), the test numbers read for that pair only.

δ = 1e-5 is below 1/n for every client of minilm-debian (1,271 training rows in all), so it is valid as the
paper's; ``privacy.delta: auto`` would give 1/(2·n_min), a weaker δ.

Then ``privacy_utility_llm.json`` (every (method, ε): test accuracy mean ± std over seeds and per seed, the chosen
step size and C, σ, the ε reached, the drop from ε = ∞), ``privacy_utility_llm.md`` (the table and one verdict line
per finite ε: does FFA-LoRA lose less accuracy than FedAvg-LoRA?) and ``privacy_utility_llm.png`` (accuracy against
ε per method; the drop from ε = ∞ per method). ``--resume`` keeps every ε folder that holds a compare.json of the
same settings, and runs the others' compares keeping each finished run of the same settings (``fedlora compare
--resume``): a long job can be stopped and restarted, or grown — more seeds, methods or clipping norms — running only
what is new. ``--report`` runs nothing: it writes the three files from what ``--out`` holds so far — a (method, ε)
cell whose runs have all finished is chosen and reported as always, the others show "—" (the table says how many
cells are done), and each verdict waits for its four cells — so a sweep of hours can be read while it runs or
after a stop. Every setting is checked (one line) before the first run.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from fedlora.errors import ConfigError, plural

#: the methods of issue 29 item 5, in table order
METHODS = ("fedavg", "ffa", "rolora", "fedsvd", "fedsb")
#: what this script writes into --out (besides the eps_* folders)
WRITES = ("privacy_utility_llm.json", "privacy_utility_llm.md", "privacy_utility_llm.png")
#: the step sizes: FFA-LoRA's are these × --ffa-factor (10), i.e. 3e-2, 1e-1
LR_GRID = (3e-3, 1e-2)


def eps_label(e: float) -> str:
    return "inf" if math.isinf(e) else f"{e:g}"


def _eps_text(e: float) -> str:
    return "∞" if math.isinf(e) else f"{e:g}"


def _numbers(text: str, flag: str, *, what: str = "values are positive numbers", infinite: bool = False) -> list[float]:
    """``"a,b,…"`` → the positive numbers, in order (``infinite``: ``inf`` allowed too); one line naming ``flag``
    for anything else, an empty list or a repeat."""
    vals = []
    for t in (x.strip() for x in text.split(",") if x.strip()):
        try:
            v = float(t)
        except ValueError:
            raise ConfigError(f"{flag}: {t!r} is not a number") from None
        if math.isnan(v) or v <= 0 or (math.isinf(v) and not infinite):
            raise ConfigError(f"{flag}: {what}, got {t!r}")
        vals.append(v)
    if not vals:
        raise ConfigError(f"{flag}: give at least one value")
    if len(set(vals)) != len(vals):
        raise ConfigError(f"{flag}: a value is listed twice")
    return vals


def parse_epsilons(text: str) -> list[float]:
    """``"inf,6,3,1"`` → [inf, 6, 3, 1] (the order kept: the table's columns)."""
    return _numbers(text, "--epsilons", what="ε must be > 0 (or inf for no DP)", infinite=True)


def jsonable(x: Any) -> Any:
    """``x`` with every infinite float (ε = ∞) written ``"inf"``: JSON has no infinity."""
    if isinstance(x, float) and math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def plan(*, config: str, methods: Sequence[str], epsilons: Sequence[float], delta: float,
         clip_norms: Sequence[float], lr_grid: Sequence[float], ffa_factor: float, seeds: int, rounds: int | None,
         local_steps: int | None, threads: int, sets: Sequence[str], out: Path) -> list[dict[str, Any]]:
    """One ``run_compare`` call per ε: its folder, its overrides, its --grid, its step-size grids."""
    if rounds is None:  # the config's own
        from fedlora.llm.config import load_config

        rounds = int(load_config(config, list(sets)).train.rounds)
    base = [f"train.rounds={rounds}"] + ([f"train.local_steps={local_steps}"] if local_steps is not None else []) + \
        [f"train.threads={threads}", f"eval.every={rounds}"]  # validation is read after the last round only
    grids = {m: tuple(sorted(lr * (ffa_factor if m == "ffa" else 1.0) for lr in lr_grid)) for m in methods}
    steps = []
    for e in epsilons:
        if math.isinf(e):
            priv, grid = ["privacy.level=none"], []
        else:
            priv = ["privacy.level=sample", f"privacy.target_epsilon={e!r}", f"privacy.delta={delta!r}"]
            grid = ["privacy.clip_norm=" + ",".join(f"{c!r}" for c in clip_norms)]
        steps.append({"epsilon": e, "folder": out / f"eps_{eps_label(e)}", "overrides": base + priv + list(sets),
                      "grid": grid, "grids": grids, "seeds": seeds, "config": config, "methods": list(methods)})
    return steps


def _command(step: Mapping[str, Any]) -> str:
    """The ``fedlora compare`` command line of one ε's step (compare.json's ``command``)."""
    import shlex

    args = [step["config"], "--methods", ",".join(step["methods"])]
    common = [m for m in step["methods"] if m != "ffa"]
    if common:
        args += ["--lr-grid", ",".join(f"{x:g}" for x in step["grids"][common[0]])]
    if "ffa" in step["methods"]:
        args += ["--lr-grid", ("ffa=" if common else "") + ",".join(f"{x:g}" for x in step["grids"]["ffa"])]
    args += [x for g in step["grid"] for x in ("--grid", g)] + ["--seeds", str(step["seeds"])]
    args += [x for s in step["overrides"] for x in ("--set", s)] + ["--out", str(step["folder"])]
    return "fedlora compare " + shlex.join(args)


def check(steps: Sequence[Mapping[str, Any]]) -> None:
    """Every ε's settings against the config (one line, before any run): the compare's own checks, and every run's
    config built — the method, the level, each C — as run_compare builds them."""
    from fedlora.llm.compare import check_value_grid, parse_value_grid
    from fedlora.llm.config import describe_method, load_config

    for st in steps:
        values = parse_value_grid(st["grid"], st["overrides"])
        check_value_grid(st["config"], st["overrides"], values)
        for m in st["methods"]:
            for c in values.get("privacy.clip_norm", [("1.0", 1.0)])[:1]:
                try:
                    describe_method(load_config(st["config"], list(st["overrides"]) +
                                                [f"method.name={m}", f"privacy.clip_norm={c[0]}",
                                                 f"method.lr={st['grids'][m][0]!r}"]))
                except ConfigError as e:
                    raise ConfigError(f"ε = {_eps_text(st['epsilon'])}, {m}: {e}") from None


def run_step(st: Mapping[str, Any], *, resume: bool, log: Callable[[str], None], jobs: int = 1,
             report: bool = False) -> dict[str, Any]:
    """One ε: its compare (or, with ``resume``, the compare.json a finished one left, when its settings match;
    otherwise its compare again, keeping every finished run of the same settings — ``run_compare(reuse=True)``);
    ``jobs`` runs at once (not part of the settings: the numbers do not depend on it). ``report``: the finished
    compare.json of the same settings, else ``run_compare(report=True)`` — nothing run, nothing written."""
    from fedlora.io import claim_output_dir, write_bytes_atomic, write_json_atomic
    from fedlora.llm.compare import COMPARE_WRITES, plot_compare, run_compare, to_markdown

    folder, command = Path(st["folder"]), _command(st)
    done = folder / "compare.json"
    if (resume or report) and done.is_file():
        res = json.loads(done.read_text())
        if res.get("command") == command:
            log(f"[privacy-llm] ε = {_eps_text(st['epsilon'])}: kept {done} ({'--report' if report else '--resume'})")
            return res
        if not report:
            log(f"[privacy-llm] ε = {_eps_text(st['epsilon'])}: other settings than {done}; its runs of the same "
                "settings are kept (--resume)")
    # a folder a stopped (or smaller) compare left holds only compare's files: its finished runs are kept
    claimed = None if report else claim_output_dir(folder, writes=COMPARE_WRITES, overwrite=resume, clear=False,
                                                   keep=True, overwrite_flag="--resume")
    try:
        t0 = time.perf_counter()
        res = run_compare(st["config"], st["overrides"], st["methods"], st["grids"], st["seeds"], folder,
                          grid=st["grid"], jobs=jobs, reuse=resume, report=report, log=log)
    except BaseException:
        if claimed is not None:
            claimed.remove_if_empty()
        raise
    res["command"] = command
    if report:  # nothing written
        return res
    res["wall_s_total"] = time.perf_counter() - t0
    write_bytes_atomic(folder / "compare.md", to_markdown(res, command).encode())
    plot_compare(res, folder / "compare.png")
    write_json_atomic(done, res)  # last: its presence means the ε is finished
    return res


def _summary(run_dir: str) -> dict[str, Any]:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def collect(steps: Sequence[Mapping[str, Any]], results: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The table's rows, one per (method, ε), from each ε's compare.json and its chosen runs' summary.json: the
    clients' mean test metric (mean ± std over seeds, per seed), the chosen step size and C, σ and the ε the
    chosen runs reached (the largest over seeds; None without DP), and the drop from the method's ε = ∞ mean."""
    rows = []
    for st, res in zip(steps, results):
        for r in res["methods"]:  # a report's compare has rows only for the methods whose runs all finished
            summ = [_summary(d) for d in r["runs"]]
            priv = [s.get("privacy") for s in summ]
            rows.append({"method": r["method"], "epsilon": st["epsilon"], "metric": res["metric"],
                         "test_mean": r["test_mean"], "test_std": r["test_std"], "test_per_seed": r["test_per_seed"],
                         "lr": r["lr"], "clip_norm": r.get("values", {}).get("privacy.clip_norm"),
                         "sigma": priv[0]["noise_multiplier"] if priv[0] else None,
                         "epsilon_reached": max(p["epsilon"] for p in priv) if priv[0] else None,
                         "delta": priv[0]["delta"] if priv[0] else None, "runs": r["runs"]})
    for row in rows:
        ref = [r for r in rows if r["method"] == row["method"] and math.isinf(r["epsilon"])]
        row["drop"] = ref[0]["test_mean"] - row["test_mean"] if ref and not math.isinf(row["epsilon"]) else None
    return rows


def verdicts(rows: Sequence[Mapping[str, Any]], methods: Sequence[str] | None = None,
             epsilons: Sequence[float] | None = None) -> list[str]:
    """One line per finite ε: does FFA-LoRA lose less accuracy than FedAvg-LoRA (its drop from its own ε = ∞ mean
    smaller)? With the two drops, and whether their difference is within the seeds' spread (the largest std
    over seeds of the four means involved). ``methods``/``epsilons``: the sweep's (default: those of ``rows``; a
    report's rows lack the unfinished cells)."""
    by = {(r["method"], r["epsilon"]): r for r in rows}
    methods = sorted({r["method"] for r in rows}) if methods is None else list(methods)
    epsilons = sorted({r["epsilon"] for r in rows}) if epsilons is None else list(epsilons)
    eps = sorted({e for e in epsilons if not math.isinf(e)}, reverse=True)
    if "fedavg" not in methods or "ffa" not in methods:
        return ["No verdict: it needs both fedavg and ffa among the methods."]
    if not any(math.isinf(e) for e in epsilons):
        return ["No verdict: it needs ε = ∞ (the drop is measured from each method's own ε = ∞ accuracy)."]
    out = []
    for e in eps:
        if any((m, x) not in by for m in ("fedavg", "ffa") for x in (e, math.inf)):  # --report: not all finished
            out.append(f"ε = {_eps_text(e)}: not yet — FedAvg-LoRA's and FFA-LoRA's runs at ε = {_eps_text(e)} and "
                       "at ε = ∞ have not all finished")
            continue
        a, f = by[("fedavg", e)], by[("ffa", e)]
        cells = [by[(m, x)] for m in ("fedavg", "ffa") for x in (e, math.inf)]
        spread = max(c["test_std"] for c in cells)
        yes = f["drop"] < a["drop"]
        diff = abs(f["drop"] - a["drop"])
        if min(len(c["test_per_seed"]) for c in cells) < 2:  # one seed: no spread to weigh the difference against
            against = "comes from one seed: there is no spread over seeds to weigh it against"
        else:
            against = f"is {'within' if diff <= spread else 'larger than'} the seeds' spread, std ≤ {spread:.4f}"
        out.append(f"ε = {_eps_text(e)}: does FFA-LoRA lose less accuracy than FedAvg-LoRA? {'yes' if yes else 'no'} "
                   f"(drop from ε = ∞: FFA-LoRA {f['drop']:+.4f}, FedAvg-LoRA "
                   f"{a['drop']:+.4f}; the difference {diff:.4f} {against})")
    return out


def to_markdown(res: Mapping[str, Any]) -> str:
    """The table (method × ε: test metric mean ± std, chosen lr and C, ε reached), the drops, the verdicts."""
    cfg, rows = res["settings"], res["rows"]
    eps, n = cfg["epsilons"], cfg["seeds"]
    metric = rows[0]["metric"] if rows else "accuracy"
    by = {(r["method"], r["epsilon"]): r for r in rows}
    lines = [f"# Privacy–utility sweep: {res['model']} on {res['task']}, {res['clients']} clients, "
             f"{cfg['rounds']} rounds" + (f" × {cfg['local_steps']} local steps" if cfg["local_steps"] else "") +
             f", {n} seed{'s' * (n != 1)}", "",
             f"Sample-level DP-SGD, δ = {cfg['delta']:g}; per (method, ε) the step size"
             " and C chosen on the clients' validation " + metric + " (mean over seeds), the test " + metric +
             " (clients' mean" + (", mean ± std over seeds" if n > 1 else ", one seed") + ") read for that choice "
             "only. Cells: test " + metric + " · lr · C · ε reached (σ).", "",
             "| method | " + " | ".join(f"ε = {_eps_text(e)}" for e in eps) + " |", "|---|" + "---|" * len(eps)]
    if res.get("partial"):
        lines[2:2] = [f"**Partial (--report): {len(rows)} of {len(cfg['methods']) * len(eps)} (method, ε) cells "
                      "have all their runs finished; — marks the others.**", ""]
    for m in cfg["methods"]:
        cells = []
        for e in eps:
            r = by.get((m, e))
            if r is None:
                cells.append("—")
                continue
            acc = f"{r['test_mean']:.4f} ± {r['test_std']:.4f}" if n > 1 else f"{r['test_mean']:.4f}"
            dp = "" if r["clip_norm"] is None else (f" · C {r['clip_norm']:g} · ε {r['epsilon_reached']:.3f} "
                                                   f"(σ {r['sigma']:.3f})")
            cells.append(f"{acc} · lr {r['lr']:g}{dp}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    finite = [e for e in eps if not math.isinf(e)]
    if any(math.isinf(e) for e in eps) and finite:
        lines += ["", f"Drop from each method's own ε = ∞ test {metric}:", "",
                  "| method | " + " | ".join(f"ε = {_eps_text(e)}" for e in finite) + " |", "|---|" + "---|" * len(finite)]
        lines += [f"| {m} | " + " | ".join("—" if by.get((m, e)) is None or by[(m, e)]["drop"] is None else
                                           f"{by[(m, e)]['drop']:+.4f}" for e in finite) + " |"
                  for m in cfg["methods"]]
    lines += ["", "**Does FFA-LoRA lose less accuracy under DP than FedAvg-LoRA here?**", ""]
    lines += [f"- {v}" for v in res["verdicts"]]
    lines += ["", f"Per ε: `{res['compares'][0]['command']}` (and the others in privacy_utility_llm.json); "
              f"the sweep: `{res['command']}`; {plural(res['runs'], 'run')}; the compares took "
              f"{sum(c['wall_s'] or 0.0 for c in res['compares']):.0f} s in all (this invocation {res['wall_s']:.0f} s: "
              "a folder kept by --resume counts its compare's own time)."]
    return "\n".join(lines) + "\n"


def plot(res: Mapping[str, Any], path: Path) -> None:
    """Left: test metric against ε per method (ε = ∞ at the right edge, error bars: std over seeds); right: the
    drop from each method's ε = ∞ metric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, rows = res["settings"], res["rows"]
    eps = sorted(cfg["epsilons"])
    finite = [e for e in eps if not math.isinf(e)]
    x_inf = 2 * max(finite) if finite else 1.0
    xs = {e: (x_inf if math.isinf(e) else e) for e in eps}
    by = {(r["method"], r["epsilon"]): r for r in rows}
    metric = rows[0]["metric"] if rows else "accuracy"
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.8))
    nan = float("nan")  # a cell not finished (--report): no point
    for m in cfg["methods"]:
        line = ax.errorbar([xs[e] for e in eps], [by[(m, e)]["test_mean"] if (m, e) in by else nan for e in eps],
                           yerr=[by[(m, e)]["test_std"] if (m, e) in by else nan for e in eps], marker="o", capsize=3,
                           label=m)
        if any(math.isinf(e) for e in eps) and finite:
            drops = [by[(m, e)]["drop"] if (m, e) in by and by[(m, e)]["drop"] is not None else nan for e in finite]
            bx.plot(finite, drops, marker="o", label=m, color=line.lines[0].get_color())
    for a in (ax, bx):
        a.set_xscale("log")
        a.set_xlabel(f"ε (δ = {cfg['delta']:g})")
        a.legend(fontsize=7)
    from matplotlib.ticker import NullFormatter

    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks([xs[e] for e in eps], [_eps_text(e) for e in eps])
    ax.set_ylabel(f"test {metric} (clients' mean)")
    ax.set_title("at each (method, ε)'s chosen step size and C")
    bx.xaxis.set_minor_formatter(NullFormatter())
    if finite:
        bx.set_xticks(finite, [_eps_text(e) for e in finite])
    bx.axhline(0, color="k", lw=0.6)
    bx.set_ylabel(f"drop from ε = ∞ ({metric})")
    bx.set_title("what DP costs each method")
    fig.suptitle(f"{res['model']} on {res['task']}: sample-level DP-SGD, {cfg['seeds']} seed(s)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sweep(*, config: str = "minilm-debian", methods: Sequence[str] = METHODS,
          epsilons: Sequence[float] = (math.inf, 6.0, 3.0, 1.0), delta: float = 1e-5,
          clip_norms: Sequence[float] = (2.0, 5.0, 10.0), lr_grid: Sequence[float] = LR_GRID,
          ffa_factor: float = 10.0, seeds: int = 2, rounds: int | None = None, local_steps: int | None = None,
          threads: int = 1, jobs: int = 1, sets: Sequence[str] = (), out: Path, resume: bool = False,
          report: bool = False, command: str = "", log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every ε's compare (``run_step``), then the table's rows, the verdicts and the files (module docstring);
    ``report``: nothing run, the table of what ``out`` holds so far. Returns privacy_utility_llm.json's content."""
    from fedlora.io import write_bytes_atomic, write_json_atomic
    from fedlora.methods import available_methods

    for m in methods:
        if m not in available_methods():
            raise ConfigError(f"--methods: unknown method {m!r}; registered: {', '.join(available_methods())}")
    if not methods or len(set(methods)) != len(methods):
        raise ConfigError("--methods: name each method once, at least one")
    if seeds < 1 or threads < 1 or jobs < 1 or any(v is not None and v < 1 for v in (rounds, local_steps)):
        raise ConfigError("--seeds, --rounds, --local-steps, --threads and --jobs: at least 1 each")
    if not 0 < delta < 1:
        raise ConfigError(f"--delta: must be in (0, 1), got {delta!r}")
    if not math.isfinite(ffa_factor) or ffa_factor <= 0:
        raise ConfigError(f"--ffa-factor: a positive number, got {ffa_factor!r}")
    steps = plan(config=config, methods=methods, epsilons=epsilons, delta=delta, clip_norms=clip_norms,
                 lr_grid=lr_grid, ffa_factor=ffa_factor, seeds=seeds, rounds=rounds, local_steps=local_steps,
                 threads=threads, sets=sets, out=Path(out))
    check(steps)  # a bad setting costs nothing
    from fedlora.llm.config import load_config

    train = load_config(config, steps[0]["overrides"]).train  # the rounds and local steps the runs take
    rounds, local_steps = int(train.rounds), train.local_steps
    out = Path(out)
    if report and resume:
        raise ConfigError("--report and --resume: a report runs nothing; give one of them")
    if report and not out.is_dir():
        raise ConfigError(f"--report: {str(out)!r} is not a folder of this sweep's results (give the --out of a sweep)")
    if out.is_dir() and any(out.iterdir()) and not (resume or report):
        raise ConfigError(f"--out: {str(out)!r} is not empty; give --resume to keep its finished ε folders, or "
                          f"choose another folder")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results = [run_step(st, resume=resume, log=log, jobs=jobs, report=report) for st in steps]
    rows = collect(steps, results)
    first = results[0]
    res = {"schema_version": 1, "command": command, "model": first["model"], "task": first["task"],
           "clients": first["clients"],
           "settings": {"config": config, "methods": list(methods), "epsilons": list(epsilons), "delta": delta,
                        "clip_norms": list(clip_norms), "lr_grid": list(lr_grid), "ffa_factor": ffa_factor,
                        "seeds": seeds, "rounds": rounds, "local_steps": local_steps, "threads": threads,
                        "sets": list(sets)},
           "compares": [{"epsilon": st["epsilon"], "folder": str(st["folder"]), "command": r["command"],
                         "wall_s": r.get("wall_s_total")} for st, r in zip(steps, results)],
           "runs": sum(len(m["val"]) * seeds for r in results for m in r["methods"]),
           "partial": len(rows) < len(methods) * len(steps),
           "wall_s": time.perf_counter() - t0, "rows": rows}
    res["verdicts"] = verdicts(rows, methods, [st["epsilon"] for st in steps])
    write_json_atomic(out / WRITES[0], jsonable(res))
    write_bytes_atomic(out / WRITES[1], to_markdown(res).encode())
    plot(res, out / WRITES[2])
    return res


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="minilm-debian", help="a fedlora run config (default minilm-debian)")
    ap.add_argument("--methods", default=",".join(METHODS), help="default: " + ",".join(METHODS))
    ap.add_argument("--epsilons", default="inf,6,3,1", help="ε values; inf: no DP (default inf,6,3,1)")
    ap.add_argument("--delta", type=float, default=1e-5, help="δ of every finite ε (default 1e-5)")
    ap.add_argument("--clip-norms", default="2,5,10", help="C values chosen from on validation (default 2,5,10)")
    ap.add_argument("--lr-grid", default=",".join(f"{x:g}" for x in LR_GRID),
                    help="step sizes (default %(default)s); FFA-LoRA's are these × --ffa-factor")
    ap.add_argument("--ffa-factor", type=float, default=10.0, help="FFA-LoRA's grid over the others' (default 10)")
    ap.add_argument("--seeds", type=int, default=2, help="seeds: the config's seed + 0 … N−1 (default 2)")
    ap.add_argument("--rounds", type=int, default=None, help="train.rounds (default: the config's, 10 for minilm-debian)")
    ap.add_argument("--local-steps", type=int, default=None,
                    help="train.local_steps (default: the config's, 10 for minilm-debian)")
    ap.add_argument("--threads", type=int, default=1,
                    help="train.threads (default 1: no oversubscription on a shared CPU)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="runs at once, each its own process (fedlora compare --jobs; default 1): --jobs 2 on 2 cores")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="any other config field for every run, e.g. --set data.max_train_samples=400")
    ap.add_argument("--out", required=True, help="output folder (new or empty, unless --resume)")
    ap.add_argument("--report", action="store_true",
                    help="run nothing: write the table of what --out holds so far (unfinished cells: —)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the finished ε folders of --out and every finished run of the same settings; run the rest")
    a = ap.parse_args(argv)
    import shlex

    command = "python bench/privacy_utility_llm.py " + shlex.join(list(sys.argv[1:] if argv is None else argv))
    try:
        res = sweep(config=a.config, methods=[m.strip() for m in a.methods.split(",") if m.strip()],
                    epsilons=parse_epsilons(a.epsilons), delta=a.delta,
                    clip_norms=_numbers(a.clip_norms, "--clip-norms"), lr_grid=_numbers(a.lr_grid, "--lr-grid"),
                    ffa_factor=a.ffa_factor, seeds=a.seeds, rounds=a.rounds, local_steps=a.local_steps,
                    threads=a.threads, jobs=a.jobs, sets=a.set, out=Path(a.out), resume=a.resume, report=a.report,
                    command=command)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(to_markdown(res))
    print(f"wrote {a.out}/{', '.join(WRITES)}" + (" (a report: nothing run)" if a.report else " and eps_*/"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
