"""``fedlora compare``: several methods on one ``fedlora run`` config, each with its step size chosen on the
clients' validation splits, over several seeds — one table and one figure, as the papers' tables are written.
The testbed's counterpart is ``fedlora synthetic compare``.

Protocol, in three phases whose order is the point:

1. **grid**: every method runs every step size of its grid (``method.lr``: the main step size — PF2LoRA's upper
   level, Per-FedAvg's outer step; ``method.options`` of the config are its own method's, the other methods
   take their defaults unless ``--set method.options=…`` gives options for all) for every seed
   (``seed`` = the config's + 0 … n−1: the split, the initialisation and the sampling change together); each run
   is a complete ``fedlora run`` folder under ``runs/<method>/lr_<lr>/seed_<s>``. ``--grid KEY=V1,V2,…``
   (``parse_value_grid``, repeatable) crosses any other config key's values with every step size: the runs are
   then ``runs/<method>/lr_<lr>/<KEY>_<V>/…/seed_<s>`` (one folder level per key, in the order given);
2. **choice** (``choose_step_size``): per method, the step size (with ``--grid``: the (step size, values) pair)
   with the best **validation** score — the task's
   main metric on each client's validation rows (carved from its training share, never trained on;
   ``federation.val_fraction``) after the last round, the unweighted mean over the clients that have validation
   rows, then the mean over seeds; ties go to the smaller step; a run whose score is not finite (diverged) counts
   as the worst; with ``--grid`` ties go to the smaller step, then to the earlier value (numbers: the smaller).
   Only validation numbers reach this function;
3. **report**: the test numbers of the chosen step size's runs only — the clients' mean test metric (mean ± std
   over seeds), the global model's where the method has one, bytes per round (up + down, all clients), wall time
   per run — into ``compare.json``, ``compare.md`` (the table) and ``compare.png`` (the table's bars and every
   method's validation curve over its grid, the chosen step marked).
"""
from __future__ import annotations

import itertools
import json
import math
import shutil
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from fedlora.errors import ConfigError, did_you_mean, plural

__all__ = ["COMPARE_WRITES", "parse_lr_grid", "parse_value_grid", "check_value_grid", "validation_score",
           "choose_step_size", "read_test", "run_compare", "to_markdown", "plot_compare"]

#: what ``fedlora compare`` writes into its ``--out``
COMPARE_WRITES = ("compare.json", "compare.md", "compare.png", "runs")


def _number(text: str, where: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise ConfigError(f"{where}: {text!r} is not a number (step sizes are positive numbers, e.g. 1e-3)") from None
    if not math.isfinite(v) or v <= 0:
        raise ConfigError(f"{where}: step sizes are positive numbers, got {text!r}")
    return v


def parse_lr_grid(entries: Sequence[str], methods: Sequence[str]) -> dict[str, tuple[float, ...]]:
    """``--lr-grid`` values → each method's grid: ``"1e-3,5e-3"`` for every method without its own,
    ``"pf2lora=1e-3,2e-3"`` for one. Every method must end with a grid of distinct positive numbers."""
    common: tuple[float, ...] | None = None
    own: dict[str, tuple[float, ...]] = {}
    for e in entries:
        name, sep, values = e.partition("=")
        target = name.strip() if sep else None
        values = values if sep else e
        if target is not None and target not in methods:
            raise ConfigError(f"--lr-grid {e!r}: {target!r} is not one of --methods ({', '.join(methods)})"
                              f"{did_you_mean(target, methods)}")
        grid = tuple(_number(v.strip(), f"--lr-grid {e!r}") for v in values.split(",") if v.strip())
        if not grid:
            raise ConfigError(f"--lr-grid {e!r}: no step size given (e.g. --lr-grid 1e-3,5e-3)")
        if len(set(grid)) != len(grid):
            raise ConfigError(f"--lr-grid {e!r}: a step size is listed twice")
        if target is None:
            if common is not None:
                raise ConfigError("--lr-grid: one grid for every method (the others name their method: m=a,b)")
            common = grid
        elif target in own:
            raise ConfigError(f"--lr-grid: two grids for {target!r}")
        else:
            own[target] = grid
    missing = [m for m in methods if m not in own and common is None]
    if missing:
        raise ConfigError(f"--lr-grid: no step sizes for {', '.join(missing)}; give a grid for every method "
                          f"(--lr-grid 1e-3,5e-3) or one per method (--lr-grid {missing[0]}=1e-3,5e-3)")
    return {m: tuple(sorted(own.get(m, common))) for m in methods}  # type: ignore[arg-type]


#: keys ``--grid`` cannot vary: compare sets them itself, each from its own flag
_OWN_KEYS = {"method.name": "--methods", "method.lr": "--lr-grid", "seed": "--seeds", "output_dir": "--out"}


def _split_values(text: str) -> list[str]:
    """``"2,5,10"`` → its values; a comma inside brackets or braces belongs to its value (``[query, value],[query]``)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch in "[{(") - (ch in "]})")
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return [v.strip() for v in out + [cur]]


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _value_text(v: Any) -> str:
    """A grid value as compare's labels and folders write it: numbers as ``%g``, text bare, anything else as JSON."""
    if _is_number(v):
        return f"{v:g}"
    return v if isinstance(v, str) else json.dumps(v, separators=(",", ":"))


def _folder_part(key: str, v: Any) -> str:
    """One folder level of a grid value: ``privacy.clip_norm_5`` (characters a path should not hold become _)."""
    return "".join(c if c.isalnum() or c in "._-+=" else "_" for c in f"{key}_{_value_text(v)}")


def parse_value_grid(entries: Sequence[str], overrides: Sequence[str] = ()) -> dict[str, list[tuple[str, Any]]]:
    """``--grid`` values → ``{key: [(text, value), …]}`` in the order the keys were given: each ``KEY=V1,V2,…``
    a config key and the values (read as ``--set`` reads one, YAML) to cross with every step size; numbers are
    sorted (ties in the choice go to the smaller), other values keep their order. One line for: no ``=``, no
    value, a value listed twice, a key given twice, a key compare sets itself (``method.name``, ``method.lr``,
    ``seed``, ``output_dir``: their own flags), a key that ``--set`` also gives (or a section holding it). Whether
    the key exists and each value validates is checked against the config (``run_compare``), before any run."""
    from fedlora.io import yaml_load

    def norm(k: str) -> str:
        return k.strip().replace("-", "_")

    set_keys = [norm(o.partition("=")[0]) for o in overrides]
    grid: dict[str, list[tuple[str, Any]]] = {}
    for e in entries:
        key, sep, values = e.partition("=")
        key = norm(key)
        if not sep or not key:
            raise ConfigError(f"--grid {e!r}: expected KEY=V1,V2,… (e.g. --grid privacy.clip_norm=2,5,10)")
        if key in _OWN_KEYS:
            raise ConfigError(f"--grid {key}: compare sets {key} itself; give its values with {_OWN_KEYS[key]}")
        if key in grid:
            raise ConfigError(f"--grid {key}: the key is given twice; list all its values in one --grid {key}=V1,V2,…")
        clash = [s for s in set_keys if s == key or key.startswith(s + ".") or s.startswith(key + ".")]
        if clash:
            raise ConfigError(f"--grid {key}: --set {clash[0]} sets it too; give it in one place (a fixed value: --set, "
                              f"values to choose from: --grid)")
        texts = [v for v in _split_values(values) if v]
        if not texts:
            raise ConfigError(f"--grid {e!r}: no value given (e.g. --grid {key}=V1,V2)")
        vals = []
        for t in texts:
            try:
                v = yaml_load(t)
            except Exception:  # what --set does with text YAML cannot read: the text itself
                v = t
            vals.append((t, json.loads(json.dumps(v, default=str))))
        if len({float(v) if _is_number(v) else json.dumps(v, sort_keys=True) for _, v in vals}) != len(vals):
            raise ConfigError(f"--grid {e!r}: a value is listed twice")
        if len({_folder_part(key, v) for _, v in vals}) != len(vals):
            raise ConfigError(f"--grid {e!r}: two values would share a run folder ({key}_…); write them apart")
        if all(_is_number(v) for _, v in vals):
            vals.sort(key=lambda tv: tv[1])
        grid[key] = vals
    return grid


def check_value_grid(config: str, overrides: Sequence[str], grid: Mapping[str, Sequence[tuple[str, Any]]]) -> None:
    """Each grid value against the config with ``overrides`` (the config's own key and value checks), one line
    naming the --grid entry; before any run."""
    from .config import load_config

    for key, vals in grid.items():
        for text, _ in vals:
            try:
                load_config(config, list(overrides) + [f"{key}={text}"])
            except ConfigError as e:
                raise ConfigError(f"--grid {key}={text}: {e}") from None


def _combos(grid: Mapping[str, Sequence[tuple[str, Any]]]) -> list[tuple[int, ...]]:
    """Every crossing of the grid's values, as indices, in order (the first key slowest)."""
    import itertools

    return list(itertools.product(*(range(len(v)) for v in grid.values())))


def _cand_label(lr: float, grid: Mapping[str, Sequence[tuple[str, Any]]], combo: Sequence[int]) -> str:
    """compare.json's name of a candidate: ``"0.001"`` (no --grid, as before) or ``"0.001 privacy.clip_norm=5"``."""
    return " ".join([f"{lr:g}"] + [f"{k}={_value_text(vals[i][1])}" for (k, vals), i in zip(grid.items(), combo)])


def validation_score(summary: Mapping[str, Any], metric: str) -> float:
    """The clients' unweighted mean of ``metric`` on their validation rows after the last round (from a run's
    summary.json ``final_clients``; clients without validation rows left out). NaN when no client has one."""
    vals = [c["val"][metric] for c in summary["final_clients"].values() if c.get("val") and metric in c["val"]]
    return float(sum(vals) / len(vals)) if vals else float("nan")


def choose_step_size(val: Mapping[Any, Sequence[float]]) -> Any:
    """The candidate with the best mean validation score over seeds (higher is better); a non-finite score (a
    diverged run) is the worst; ties go to the smallest candidate. ``val``: candidate → its runs' validation
    scores; a candidate is a step size, or with ``--grid`` a tuple (step size, index of each key's value) — ties
    then go to the smaller step, then to the earlier value. Nothing else is read: the test split cannot take part
    in the choice."""
    if not val:
        raise ConfigError("choose_step_size: no step size to choose from")

    def key(c):
        scores = list(val[c])
        mean = sum(scores) / len(scores) if scores else float("nan")
        return mean if math.isfinite(mean) else -math.inf

    return max(sorted(val), key=key)  # max keeps the first of equal scores: the smallest candidate


def read_test(run_dir: Path, metric: str) -> dict[str, Any]:
    """A chosen run's reported numbers (its summary.json): the clients' mean test ``metric``, the global model's
    (None where the method has none), bytes per round (up + down over all clients) and wall seconds."""
    s = json.loads((Path(run_dir) / "summary.json").read_text())
    return {"test": float(s["final_test"]["mean"][metric]),
            "global": float(s["final_global"][metric]) if "final_global" in s else None,
            "bytes_per_round": (s["bytes_up_total"] + s["bytes_down_total"]) / s["rounds"],
            "wall_s": float(s["wall_s"])}


def _lr_name(lr: float) -> str:
    return f"lr_{lr:g}"


def _val_mean(scores: Sequence[float | None]) -> float:
    """compare.json's validation scores of one step size (None: not finite) → their mean (NaN if any is None)."""
    return float("nan") if any(v is None for v in scores) else float(statistics.fmean(scores))


def _mean_std(xs: Sequence[float]) -> tuple[float, float]:
    return float(statistics.fmean(xs)), float(statistics.stdev(xs)) if len(xs) > 1 else 0.0


def _run_one(cfg) -> dict[str, Any]:
    """One grid run in a worker process of ``run_compare(jobs > 1)``: its summary.json content."""
    from .runtime import FederatedRun

    return FederatedRun(cfg).run()


def finished_run(cfg) -> dict[str, Any] | None:
    """The summary of the finished run in ``cfg.output_dir`` when it ran exactly ``cfg`` (run.json ``complete``,
    config.json's config, read through today's schema — a field added since takes its default — equal to ``cfg``'s),
    else None. The code is not compared: a run kept is the numbers the code of its day gave."""
    from .config import saved_config_today
    from .runfolder import read_status

    folder = Path(cfg.output_dir)
    try:
        if read_status(folder) != "complete":
            return None
        saved = saved_config_today(json.loads((folder / "config.json").read_text())["config"])
        if json.loads(json.dumps(saved, allow_nan=True)) != json.loads(json.dumps(cfg.to_dict(), allow_nan=True)):
            return None
        return json.loads((folder / "summary.json").read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _grid_runs(cfgs: Mapping[Any, Any], jobs: int, progress: bool) -> Iterator[tuple[Any, dict[str, Any]]]:
    """(key, summary) of every config of ``cfgs``: in order, in this process (``jobs`` = 1), or as they finish, in
    ``jobs`` worker processes (spawned: a fresh interpreter each, nothing inherited but the environment). A run
    is the same in either: it seeds everything itself, with ``train.threads`` threads. A run's error stops the
    others not yet started and is raised here."""
    if jobs == 1:
        from .runtime import FederatedRun

        for key, cfg in cfgs.items():
            yield key, FederatedRun(cfg, progress=progress).run()
        return
    import concurrent.futures as cf
    import multiprocessing

    with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_run_one, cfg): key for key, cfg in cfgs.items()}
        try:
            for fut in cf.as_completed(futures):
                yield futures[fut], fut.result()
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise


def run_compare(config: str, overrides: Sequence[str], methods: Sequence[str], grids: Mapping[str, Sequence[float]],
                seeds: int, out: Path, *, grid: Sequence[str] = (), progress: bool = False, jobs: int = 1,
                reuse: bool = False, report: bool = False, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The three phases (module docstring) into ``out`` (claimed by the caller). ``grid``: ``--grid`` entries
    (``parse_value_grid``), crossed with every step size. ``jobs``: runs at once (``_grid_runs``; the results do
    not depend on it). ``reuse`` (``--resume``): a run whose folder already holds it finished (``finished_run``) is
    read, not run again; any other folder of a run is removed and the run made afresh. ``report``: nothing is run
    or removed — the finished runs are read as ``reuse`` reads them, and only the methods whose every run has
    finished get a row (chosen and tested as always); the others are listed under ``unfinished`` (method →
    finished runs, runs). Returns compare.json's content (a report's is for its caller: compare.json, whose
    presence means the grid is done, is not written from it)."""
    from .config import describe_method, load_config

    if seeds < 1:
        raise ConfigError(f"--seeds: at least 1, got {seeds}")
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ConfigError(f"--jobs: the runs at once, an integer ≥ 1, got {jobs!r}")
    values = parse_value_grid(grid, overrides)
    base = load_config(config, list(overrides))
    if base.federation.client_models is not None:
        raise ConfigError("compare: federation.client_models (heterogeneous client models) runs H²Tune only, so "
                          "there are no methods to compare; run it with `fedlora run`")
    if base.federation.val_fraction <= 0:
        raise ConfigError("compare: federation.val_fraction is 0, so no client has validation rows to choose a "
                          "step size on (and the test split is never used to choose); set it > 0 (default 0.1)")
    check_value_grid(config, overrides, values)
    combos = _combos(values)

    def cand(lr: float, combo: tuple[int, ...]):  # choose_step_size's key: the step size alone without --grid
        return (lr, *combo) if values else lr

    cfgs = {}
    own_options = any(o.split("=", 1)[0].strip().startswith("method.options") for o in overrides) or \
        any(k.startswith("method.options") for k in values)
    for m in methods:  # every config is built and validated before the first run: a bad one costs nothing
        # the config's method.options are its own method's (PF2LoRA's client_rank …): another method starts
        # from its defaults, unless --set (or --grid) gave method.options for all
        reset = [] if (m == base.method.name or own_options) else ["method.options={}"]
        for lr in grids[m]:
            for combo in combos:
                sets = [f"{k}={vals[i][0]}" for (k, vals), i in zip(values.items(), combo)]
                sub = Path(*[_folder_part(k, vals[i][1]) for (k, vals), i in zip(values.items(), combo)])
                for i in range(seeds):
                    folder = out / "runs" / m / _lr_name(lr) / sub / f"seed_{base.seed + i}"
                    cfgs[m, cand(lr, combo), i] = load_config(config, list(overrides) + reset + sets + [
                        f"method.name={m}", f"method.lr={lr!r}", f"seed={base.seed + i}",
                        f"output_dir={json.dumps(str(folder))}"])
                    describe_method(cfgs[m, cand(lr, combo), i])  # its options resolve (one line otherwise)
    metric = data_name = None  # read from the first run's summary (a report with no finished run has neither)
    scores: dict[tuple[str, Any, int], float] = {}
    folders = {key: Path(cfg.output_dir) for key, cfg in cfgs.items()}
    kept = {}
    if reuse or report:
        for key, cfg in cfgs.items():
            summary = finished_run(cfg)
            if summary is not None:
                kept[key] = summary
            elif folders[key].exists() and not report:  # a stopped run, or one of other settings: made afresh
                shutil.rmtree(folders[key])
    todo = {} if report else {key: cfg for key, cfg in cfgs.items() if key not in kept}
    unfinished = {}  # a report's gaps: method → [finished runs, runs]
    for m in methods if report else ():
        keys = [key for key in cfgs if key[0] == m]
        if sum(key in kept for key in keys) < len(keys):
            unfinished[m] = [sum(key in kept for key in keys), len(keys)]
    done_methods = [m for m in methods if m not in unfinished]
    n, t0 = len(cfgs), time.perf_counter()
    if report:
        log(f"read {len(kept)} finished run(s) of {len(cfgs)}; nothing run (a report)")
    elif kept:
        log(f"kept {len(kept)} finished run(s) of the same settings (--resume); {len(todo)} to run")
    runs = itertools.chain(kept.items(), _grid_runs(todo, jobs, progress))
    for j, ((m, c, i), summary) in enumerate(runs):  # phase 1: the grid
        metric = metric or summary["main_metric"]
        data_name = summary["task"]  # the task, or the user's file where data.path replaced its data
        scores[m, c, i] = validation_score(summary, metric)
        what = f"lr={c:g}" if not values else "lr=" + _cand_label(c[0], values, c[1:])
        log(f"[{j + 1}/{n}] {m} {what} seed={cfgs[m, c, i].seed}: validation {metric} {scores[m, c, i]:.4f} "
            f"({'kept' if (m, c, i) in kept else f'{time.perf_counter() - t0:.0f} s so far'})")
    val = {m: {cand(lr, c): [scores[m, cand(lr, c), i] for i in range(seeds)] for lr in grids[m] for c in combos}
           for m in done_methods}  # per candidate the seeds in order, whichever run finished first
    chosen = {m: choose_step_size(val[m]) for m in done_methods}  # phase 2: validation only
    rows = []
    for m in done_methods:  # phase 3: the chosen runs' test numbers
        tests = [read_test(folders[m, chosen[m], i], metric) for i in range(seeds)]
        t_mean, t_std = _mean_std([t["test"] for t in tests])
        glob = [t["global"] for t in tests if t["global"] is not None]
        g = _mean_std(glob) if len(glob) == len(tests) else None
        lr, combo = (chosen[m][0], chosen[m][1:]) if values else (chosen[m], ())
        row = {"method": m, "lr": lr, "grid": list(grids[m])}
        if values:  # the chosen value of every --grid key
            row["values"] = {k: vals[i][1] for (k, vals), i in zip(values.items(), combo)}
        row.update({
            "val": {_cand_label(c if not values else c[0], values, () if not values else c[1:]):
                    [v if math.isfinite(v) else None for v in scores] for c, scores in val[m].items()},
            "test_mean": t_mean, "test_std": t_std, "test_per_seed": [t["test"] for t in tests],
            "global_mean": g[0] if g else None, "global_std": g[1] if g else None,
            "bytes_per_round": statistics.fmean(t["bytes_per_round"] for t in tests),
            "wall_s": statistics.fmean(t["wall_s"] for t in tests),
            "runs": [str(folders[m, chosen[m], i]) for i in range(seeds)]})
        rows.append(row)
    res = {"schema_version": 1, "config": config, "overrides": list(overrides), "metric": metric,
           "task": data_name, "model": model_label(base), "clients": base.federation.clients,
           "rounds": base.train.rounds, "seeds": [base.seed + i for i in range(seeds)],
           "selection": "the clients' mean validation metric after the last round, mean over seeds; ties → smaller",
           "methods": rows}
    if report:
        res["unfinished"] = {m: {"finished": a, "runs": b} for m, (a, b) in unfinished.items()}
    if values:  # absent without --grid: compare.json as before
        res["grid"] = {k: [v for _, v in vals] for k, vals in values.items()}
        res["selection"] = ("the (step size, --grid values) pair with the best clients' mean validation metric after "
                            "the last round, mean over seeds; ties → the smaller step, then the earlier value")
    return res


def _chosen_label(r: Mapping[str, Any]) -> str:
    """The key of the chosen candidate in a compare.json row's ``val``."""
    return " ".join([f"{r['lr']:g}"] + [f"{k}={_value_text(v)}" for k, v in r.get("values", {}).items()])


def model_label(cfg) -> str:
    """The model a run of ``cfg`` trains, as a title names it: ``model.name`` for a pretrained model, the
    architecture and size of a random one (``model.from_config``, which ``tiny: true`` sets; ``model.name``
    then gives only the tokenizer, or the model the tiny variant stands in for)."""
    m = cfg.model
    if m.from_config is not None:
        fc = m.from_config
        size = ", ".join(what.format(fc[key]) for key, what in (("num_hidden_layers", "{} layers"),
                                                                  ("hidden_size", "width {}")) if key in fc)
        tiny = f"; tiny=true: a stand-in for {m.name}" if getattr(cfg, "tiny", False) else ""
        return f"a random {fc['model_type']}" + (f" ({size}{tiny})" if size or tiny else "")
    return m.name


def _spread(mean: float, std: float, n: int) -> str:
    """``mean ± std`` over ``n`` seeds; with one seed there is no spread to show, the mean alone."""
    return f"{mean:.4f} ± {std:.4f}" if n > 1 else f"{mean:.4f}"


def to_markdown(res: Mapping[str, Any], command: str) -> str:
    """compare.md: the table (clients' mean ± std over seeds at each method's chosen step size)."""
    m, n = res["metric"], len(res["seeds"])
    keys = res.get("grid", {})  # --grid: one column per key, its chosen value (and its values)
    what = "Step size" + (" and " + ", ".join(keys) if keys else "")
    lines = [f"# `fedlora compare`: {res['model']} on {res['task']}, {plural(res['clients'], 'client')}, "
             f"{plural(res['rounds'], 'round')}, seed{'s' * (n != 1)} {', '.join(map(str, res['seeds']))}", "", f"`{command}`", "",
             f"{what} per method chosen on the clients' validation {m} (never the test split); test numbers "
             f"are the clients' mean" + (" (mean ± std over seeds)." if n > 1 else " (one seed: no spread)."), "",
             f"| method | step size (grid) | " + "".join(f"{k} (grid) | " for k in keys) +
             f"test {m}, clients' mean | global model | validation {m} at the chosen step "
             f"| MB / round | wall s / run |", "|---|---|---|---|---|---|---|" + "---|" * len(keys)]
    for r in res["methods"]:
        grid = ", ".join(f"{x:g}" for x in r["grid"])
        g = _spread(r["global_mean"], r["global_std"], n) if r["global_mean"] is not None else "—"
        v = _val_mean(r["val"][_chosen_label(r)])
        cols = "".join(f"**{_value_text(r['values'][k])}** ({', '.join(_value_text(x) for x in keys[k])}) | "
                       for k in keys)
        lines.append(f"| {r['method']} | **{r['lr']:g}** ({grid}) | {cols}{_spread(r['test_mean'], r['test_std'], n)} | "
                     f"{g} | {v:.4f} | {r['bytes_per_round'] / 1e6:.3f} | {r['wall_s']:.1f} |")
    if res.get("unfinished"):  # a report (--report): the methods whose runs have not all finished
        lines += ["", "Not finished yet (--report; finished runs of all): " +
                  ", ".join(f"{k} {v['finished']} of {v['runs']}" for k, v in res["unfinished"].items()) + "."]
    return "\n".join(lines) + "\n"


def plot_compare(res: Mapping[str, Any], path: Path) -> None:
    """compare.png: left, each method's test metric at its chosen step (clients' mean, error bar = std over
    seeds; the global model's as a hollow marker); right, each method's validation score over its grid, the
    chosen step filled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["methods"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = range(len(rows))
    ax.bar(xs, [r["test_mean"] for r in rows], yerr=[r["test_std"] for r in rows], capsize=4, color="#4C72B0",
           label="clients' mean (± std over seeds)")
    gx = [i for i, r in enumerate(rows) if r["global_mean"] is not None]
    if gx:
        ax.scatter(gx, [rows[i]["global_mean"] for i in gx], marker="D", facecolors="none", edgecolors="k",
                   zorder=3, label="global model")
    ax.set_xticks(list(xs), [r["method"] for r in rows], rotation=30, ha="right")
    ax.set_ylabel(f"test {res['metric']}")
    ax.set_title("at each method's chosen step size")
    ax.legend(fontsize=8)
    for r in rows:
        grid, chosen = r["grid"], r.get("values", {})
        tail = "".join(f" {k}={_value_text(v)}" for k, v in chosen.items())  # the chosen --grid values
        means = [_val_mean(r["val"][f"{lr:g}{tail}"]) for lr in grid]
        line, = bx.plot(grid, means, marker="o", label=r["method"] + (f" ({tail.strip()})" if tail else ""))
        bx.scatter([r["lr"]], [_val_mean(r["val"][_chosen_label(r)])], s=90, color=line.get_color(), zorder=3)
        others = {}  # with --grid: the other values' curves, faint
        for label, scores in r["val"].items():
            lr, _, rest = label.partition(" ")
            if rest != tail.strip():
                others.setdefault(rest, []).append((float(lr), _val_mean(scores)))
        for pts in others.values():
            bx.plot([x for x, _ in pts], [y for _, y in pts], ls=":", lw=1, alpha=0.5, color=line.get_color())
    bx.set_xscale("log")
    from matplotlib.ticker import NullFormatter

    bx.xaxis.set_minor_formatter(NullFormatter())  # log-scale minor labels overlap on a short grid
    bx.set_xticks(sorted({lr for r in rows for lr in r["grid"]}), [f"{lr:g}" for lr in sorted({lr for r in rows
                                                                                               for lr in r["grid"]})])
    bx.set_xlabel("step size (method.lr)")
    bx.set_ylabel(f"validation {res['metric']} (clients' mean, mean over seeds)")
    bx.set_title("choice on the validation split (large dot: chosen" +
                 ("; dotted: the other --grid values)" if res.get("grid") else ")"))
    bx.legend(fontsize=7, ncol=2)
    fig.suptitle(f"{res['model']} on {res['task']}: {plural(res['clients'], 'client')}, {plural(res['rounds'], 'round')}, "
                 f"{len(res['seeds'])} seed{'s' * (len(res['seeds']) != 1)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
