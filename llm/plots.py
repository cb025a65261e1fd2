"""The figures of ``fedlora run`` folders: a run's own (``plot_run``: metric, loss and communication per
round, its rounds.png) and ``fedlora plot``'s across runs (``plot_runs``: the runs' metric, loss, bytes
and rank curves in one figure with the numbers as CSV, and each run's per-client label histograms).

The numbers behind every cross-run curve come from ``curve_rows`` (one row per run, round and quantity,
each named after the rounds.jsonl field it is computed from) and the figure is drawn from those rows:
what ``curves.csv`` says is what ``curves.png`` shows.

matplotlib is imported by the functions that draw, on first use: reading and checking runs (``fedlora plot``'s
refusals, a run's summary) never waits for it (start-up time)."""
from __future__ import annotations

import csv
import io
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from fedlora.errors import ConfigError, did_you_mean
from fedlora.io import claim_output_dir, write_bytes_atomic, write_json_atomic
from fedlora.partition import draw_label_histograms

from .runfolder import read_run

__all__ = ["plot_run", "run_title", "participants_mean_loss", "curve_rows", "split_rows", "plot_runs", "PLOT_WRITES"]


def run_title(method: str | None, task: str | None, clients: int | None, rounds: int | None) -> str:
    """"fedavg on sst2 — 4 clients, 10 rounds" from what is known (parts that are None are left out)."""
    head = " on ".join(str(p) for p in (method, task) if p)
    tail = ", ".join(t for t in (f"{clients} client{'s' * (clients != 1)}" if clients is not None else "",
                                 f"{rounds} round{'s' * (rounds != 1)}" if rounds is not None else "") if t)
    return " — ".join(t for t in (head, tail) if t)


def participants_mean_loss(record: Mapping[str, Any]) -> float:
    """A round's training loss: the mean of its participants' ``train_loss`` (NaN when none reported one)."""
    losses = list(record.get("train_loss", {}).values())
    return sum(losses) / len(losses) if losses else float("nan")


def plot_run(history: Sequence[Mapping[str, Any]], evals: Sequence[Mapping[str, Any]], metric: str,
             path: str | Path, title: str | None = None, *, method: str | None = None,
             task: str | None = None, clients: int | None = None) -> Path:
    """Three panels: the clients' mean test ``metric`` (and the global model's, if any) per round,
    the participants' mean training loss, and the bytes sent up / down per round (all clients).

    Title: ``title`` if given, else method, task, clients and rounds (the last round of ``history``);
    rounds are whole numbers, and so are the x ticks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(13, 3.6))
    rounds = [e["round"] for e in evals]
    _clients_panel(ax[0], rounds, [e["test"] for e in evals], metric)
    if all("global" in e for e in evals):
        ax[0].plot(rounds, [e["global"][metric] for e in evals], "s--", label="global model")
    ax[0].legend(fontsize=8)
    if title is None:
        last = max((h["round"] for h in history), default=None)
        title = run_title(method, task, clients, last)
    return _finish(fig, ax, history, title, path)


# ============================================================================ across runs: fedlora plot
#: what ``fedlora plot`` writes into its --out folder (``--overwrite`` clears a folder holding only these)
PLOT_WRITES = ("curves.png", "curves.csv", "split.csv", "split", "plot.json")
CURVE_COLUMNS = ("run", "round", "quantity", "value")
SPLIT_COLUMNS = ("run", "part", "client", "label", "count")
_PARTS = ("train", "val", "test")


def _clients_panel(ax, rounds: Sequence[int], tests: Sequence[Mapping[str, Any]], metric: str) -> None:
    """The clients' mean test ``metric`` per round with their min–max band (``tests``: each evaluation's
    summary of the clients, ``aggregate_client_metrics``)."""
    ax.plot(rounds, [t["mean"][metric] for t in tests], "o-", label="clients (mean)")
    ax.fill_between(rounds, [t["min"][metric] for t in tests], [t["max"][metric] for t in tests], alpha=0.2,
                    label="clients (min–max)")
    ax.set(xlabel="round", ylabel=f"test {metric}")


def _finish(fig, ax, history: Sequence[Mapping[str, Any]], title: str | None, path: str | Path) -> Path:
    """The last two panels (the participants' mean training loss, the bytes up / down per round, all
    clients), whole-number round ticks, the title; saved to ``path``."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    r = [h["round"] for h in history]
    ax[-2].plot(r, [participants_mean_loss(h) for h in history], "o-")
    ax[-2].set(xlabel="round", ylabel="training loss (participants' mean)")
    ax[-1].plot(r, [sum(h["bytes_up"].values()) for h in history], "o-", label="up")
    ax[-1].plot(r, [sum(h["bytes_down"].values()) for h in history], "s--", label="down")
    ax[-1].set(xlabel="round", ylabel="bytes (all clients)")
    ax[-1].legend(fontsize=8)
    for a in ax:
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
    if title:
        fig.suptitle(title, fontsize=11)
    # fixed margins, not tight_layout: it measures every tick label (≈ 0.3 s a figure, and every run draws one);
    # these fit the panels' labels at this size (widths per panel: 4.4 in, the tick labels ≤ 6 characters)
    n = len(ax)
    fig.subplots_adjust(left=0.55 / fig.get_figwidth(), right=1 - 0.12 / fig.get_figwidth(), bottom=0.15,
                        top=0.86 if title else 0.95, wspace=0.95 * n / fig.get_figwidth())
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_tasks_run(history: Sequence[Mapping[str, Any]], evals: Sequence[Mapping[str, Any]], path: str | Path, *,
                   method: str | None = None, clients: int | None = None) -> Path:
    """``rounds.png`` of a run whose clients work on different tasks (``fedlora.llm.hetero``): one panel per
    task — its clients' mean test main metric with their min–max — then the training loss and the bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(evals[0]["tasks"])
    fig, ax = plt.subplots(1, len(names) + 2, figsize=(4.4 * (len(names) + 2), 3.6))
    rounds = [e["round"] for e in evals]
    for a, name in zip(ax, names):
        _clients_panel(a, rounds, [e["tasks"][name]["test"] for e in evals], evals[0]["tasks"][name]["main_metric"])
        a.set(title=f"{name} (clients {evals[0]['tasks'][name]['clients']})")
        a.legend(fontsize=8)
    last = history[-1]["round"] if history else 0
    return _finish(fig, ax, history, f"{method or ''} — heterogeneous clients: {', '.join(names)} — "
                                     f"{run_title(None, None, clients, last)}", path)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def curve_rows(label: str, run, metric: str) -> list[dict[str, Any]]:
    """The curves of one run (a ``fedlora.llm.runfolder.RunFolder``) as rows ``{run: label, round,
    quantity, value}``. Each quantity is named after the rounds.jsonl field it comes from:

    * at every evaluated round (round 0 included): ``eval.test.mean.<metric>`` (the clients' mean),
      ``eval.test.min.<metric>``, ``eval.test.max.<metric>``, and ``eval.global.<metric>`` where the
      method has a global model — as recorded;
    * at every training round r ≥ 1: ``train_loss.mean`` (over the clients that report one: the
      participants), ``bytes_up.sum`` and ``bytes_down.sum`` (over all clients), ``bytes.cumulative``
      (up + down of rounds 1…r), ``wall_s``, and for every numeric entry K of ``ranks``
      ``ranks.K.mean`` (over the clients that report it; HetLoRA's rank and server_rank, LoRA-A²'s
      budget and selected; nested tables such as LoRA-A²'s selected_per_module are left out — their
      total is ``selected``)."""
    rows: list[dict[str, Any]] = []

    def add(r: int, q: str, v: Any) -> None:
        rows.append({"run": label, "round": int(r), "quantity": q, "value": v if isinstance(v, int) else float(v)})

    for r, ev in run.evaluations():
        for stat in ("mean", "min", "max"):
            add(r, f"eval.test.{stat}.{metric}", ev["test"][stat][metric])
        if "global" in ev and metric in ev["global"]:
            add(r, f"eval.global.{metric}", ev["global"][metric])
    total = 0
    for rec in run.trained_rounds():
        r = rec["round"]
        if rec.get("train_loss"):
            add(r, "train_loss.mean", participants_mean_loss(rec))
        up, down = sum(rec.get("bytes_up", {}).values()), sum(rec.get("bytes_down", {}).values())
        total += up + down
        add(r, "bytes_up.sum", up)
        add(r, "bytes_down.sum", down)
        add(r, "bytes.cumulative", total)
        if _number(rec.get("wall_s")):
            add(r, "wall_s", rec["wall_s"])
        keys: dict[str, list[float]] = {}
        for ranks in rec.get("ranks", {}).values():
            for k, v in ranks.items():
                if _number(v):
                    keys.setdefault(k, []).append(v)
        for k, vs in keys.items():
            add(r, f"ranks.{k}.mean", sum(vs) / len(vs))
    return rows


def split_rows(label: str, split: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A run's split (config.json's ``resolved.split``, ``fedlora.llm.data.describe_split``) as rows
    ``{run: label, part: train|val|test, client, label: class name, count}``, one per client and class."""
    names = list(split["label_names"])
    rows = []
    for part in _PARTS:
        for k, hist in enumerate(split.get(f"{part}_hist", [])):
            for c, n in enumerate(hist):
                rows.append({"run": label, "part": part, "client": k,
                             "label": names[c] if c < len(names) else str(c), "count": int(n)})
    return rows


def _csv(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> bytes:
    """Rows as CSV; floats as Python writes them (``repr``: read back, the same number)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(columns), lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue().encode()


def _png(fig) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def curves_figure(rows: Sequence[Mapping[str, Any]], legend: Mapping[str, str], metric: str, title: str) -> bytes:
    """The four panels of ``fedlora plot`` as PNG bytes, drawn from ``curve_rows`` rows (one colour per
    run; ``legend``: run label → its legend entry): the clients' mean test ``metric`` per evaluated round
    (solid; the global model's dashed), the participants' mean training loss, the cumulative bytes
    (up + down solid, up alone dotted) and the mean rank of every ``ranks`` entry (a line style each)."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    series: dict[tuple[str, str], tuple[list[int], list[float]]] = {}
    for row in rows:
        xs, ys = series.setdefault((row["run"], row["quantity"]), ([], []))
        xs.append(row["round"])
        ys.append(row["value"])
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.6))
    (a_metric, a_loss), (a_bytes, a_rank) = axes
    colours = plt.get_cmap("tab10").colors
    styles = ["-", "--", "-.", ":"]
    rank_keys = sorted({q[len("ranks."):-len(".mean")] for _, q in series if q.startswith("ranks.")})
    has_global = False
    for i, label in enumerate(legend):
        c = colours[i % len(colours)]
        get = lambda q: series.get((label, q), ([], []))  # noqa: E731
        a_metric.plot(*get(f"eval.test.mean.{metric}"), "o-", color=c, ms=4, label=legend[label])
        if get(f"eval.global.{metric}")[0]:
            has_global = True
            a_metric.plot(*get(f"eval.global.{metric}"), "s--", color=c, ms=3, alpha=0.8)
        a_loss.plot(*get("train_loss.mean"), "o-", color=c, ms=4)
        xs, ys = get("bytes.cumulative")
        a_bytes.plot(xs, [y / 1e6 for y in ys], "o-", color=c, ms=4)
        up = get("bytes_up.sum")
        cum, acc = [], 0.0
        for y in up[1]:
            acc += y
            cum.append(acc / 1e6)
        a_bytes.plot(up[0], cum, ":", color=c)
        for j, key in enumerate(rank_keys):
            xs, ys = get(f"ranks.{key}.mean")
            if xs:
                a_rank.plot(xs, ys, styles[j % len(styles)], color=c, marker="o", ms=3)
    a_metric.set(xlabel="round", ylabel=f"test {metric} (clients' mean)")
    if has_global:
        a_metric.legend(handles=[Line2D([], [], color="k", ls="-", marker="o", ms=4, label="clients' mean"),
                                 Line2D([], [], color="k", ls="--", marker="s", ms=3, label="global model")], fontsize=8)
    a_loss.set(xlabel="round", ylabel="training loss (participants' mean)")
    a_bytes.set(xlabel="round", ylabel="MB sent, cumulative (all clients)")
    a_bytes.legend(handles=[Line2D([], [], color="k", ls="-", label="up + down"),
                            Line2D([], [], color="k", ls=":", label="up")], fontsize=8)
    a_rank.set(xlabel="round", ylabel="rank (participants' mean)")
    ranks = [y for (_, q), (_, ys) in series.items() if q.startswith("ranks.") for y in ys]
    if ranks and min(ranks) > 0 and max(ranks) > 4 * min(ranks):  # e.g. LoRA-A²'s total selected beside r_k
        from matplotlib.ticker import ScalarFormatter

        a_rank.set_yscale("log", base=2)
        a_rank.yaxis.set_major_formatter(ScalarFormatter())
        a_rank.set_ylabel("rank (participants' mean; log scale)")
    if rank_keys:
        a_rank.legend(handles=[Line2D([], [], color="k", ls=styles[j % len(styles)], label=k)
                               for j, k in enumerate(rank_keys)], fontsize=8, title="ranks entry", title_fontsize=8)
    else:
        a_rank.text(0.5, 0.5, "no ranks recorded", ha="center", va="center", transform=a_rank.transAxes)
    for a in axes.flat:
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
    run_handles = [Line2D([], [], color=colours[i % len(colours)], marker="o", ms=4, label=text)
                   for i, text in enumerate(legend.values())]
    fig.legend(handles=run_handles, loc="lower center", ncol=min(len(run_handles), 4), fontsize=9, frameon=False)
    fig.suptitle(title, fontsize=11)
    rows_of_legend = -(-len(run_handles) // 4)
    fig.tight_layout(rect=(0, 0.035 * rows_of_legend + 0.01, 1, 1))
    return _png(fig)


def split_figure(rows: Sequence[Mapping[str, Any]], title: str) -> bytes:
    """One run's per-client label histograms (``split_rows`` rows) as PNG bytes: a panel per part
    (train, val, test; an empty part is left out), each drawn by ``fedlora.partition.draw_label_histograms``
    (a stacked bar per client, a colour per class), one legend of the classes."""
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    parts = [p for p in _PARTS if any(r["part"] == p and r["count"] for r in rows)]
    labels = list(dict.fromkeys(r["label"] for r in rows))
    clients = sorted({r["client"] for r in rows})
    side = 1.3 if len(labels) <= 20 else 2.6  # inches for the legend of the classes
    width = max(4.2, 0.12 * len(clients) + 1.2) * max(len(parts), 1) + side
    fig, axes = plt.subplots(1, max(len(parts), 1), figsize=(width, 3.8), squeeze=False)
    for ax, part in zip(axes[0], parts):
        count = {(r["client"], r["label"]): r["count"] for r in rows if r["part"] == part}
        draw_label_histograms(ax, [[count.get((k, name), 0) for name in labels] for k in clients],
                              class_names=labels, legend=False)
        ax.set(ylabel=f"{part} rows", title=part)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    if parts:
        handles, names = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, names, loc="center right", fontsize=8, frameon=False, title="class", title_fontsize=8,
                   ncol=1 if len(names) <= 20 else 2)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0, 1 - side / width, 1))
    return _png(fig)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "run"


def _check_runs(run_dirs, labels, metric):
    """``plot_runs``'s checks of its input (no file written): the runs, their labels, the metric, the
    legend entries, the notes on incomplete runs and the file names of the split figures."""
    runs = [read_run(d) for d in run_dirs]
    seen: dict[Path, str] = {}
    for d, run in zip(run_dirs, runs):
        key = run.path.resolve()
        if key in seen:
            raise ConfigError(f"RUN_DIR: {str(d)!r} is given twice (as {seen[key]!r} too)")
        seen[key] = str(d)
        if run.resolved.get("heterogeneous"):
            raise ConfigError(f"RUN_DIR: {str(d)!r} federates clients on different tasks (federation.client_models): "
                              f"its metrics are per task, not one curve to compare; its own rounds.png plots each task")
    if labels is not None:
        labels = [str(x).strip() for x in labels]
        if len(labels) != len(runs):
            raise ConfigError(f"--labels: {len(labels)} label(s) for {len(runs)} run(s); give one per RUN_DIR, "
                              f"comma-separated, in their order")
        if any(not x for x in labels):
            raise ConfigError("--labels: a label is empty")
    else:
        labels = [run.path.name if run.path.name == run.method else f"{run.path.name} ({run.method})"
                  for run in runs]
        if len(set(labels)) < len(labels):  # folders of the same name: the paths as given tell them apart
            labels = [str(d) if run.path.name == run.method else f"{d} ({run.method})" for d, run in zip(run_dirs, runs)]
    dup = next((x for i, x in enumerate(labels) if x in labels[:i]), None)
    if dup is not None:
        raise ConfigError(f"--labels: {dup!r} labels two runs; give each run its own")
    shared = [m for m in runs[0].metrics if all(m in r.metrics for r in runs[1:])]
    allowed = ", ".join(shared) if shared else "none: they share no metric"
    if metric is None:
        tasks = list(dict.fromkeys(r.task for r in runs))
        mains = list(dict.fromkeys(r.main_metric for r in runs))
        if len(tasks) > 1 or len(mains) > 1:
            which = "; ".join(f"{lab}: {r.task}, {r.main_metric}" for lab, r in zip(labels, runs))
            raise ConfigError(f"RUN_DIR: the runs are of different tasks or main metrics ({which}): their curves do not "
                              f"compare; give --metric with one they all report to plot them anyway ({allowed})")
        metric = mains[0]
    if metric not in shared:
        missing = [lab for lab, r in zip(labels, runs) if metric not in r.metrics]
        raise ConfigError(f"--metric: {metric!r} is not reported by {'every run' if len(runs) > 1 else 'the run'}"
                          f" ({', '.join(missing)}){did_you_mean(metric, shared)}; allowed: {allowed}")
    notes, legend = [], {}
    for lab, d, run in zip(labels, run_dirs, runs):
        legend[lab] = lab
        if not run.complete:
            notes.append(f"{str(d)!r} is incomplete ({run.incomplete_note}): plotted rounds 0–{run.rounds_done}")
            legend[lab] = f"{lab} ({run.status if run.status != 'unknown' else 'incomplete'}, "\
                          f"{run.rounds_done} of {run.rounds_planned} rounds)"
    slugs: list[str] = []
    for lab in labels:
        s = _slug(lab)
        slugs.append(s if s not in slugs else f"{s}_{len(slugs)}")

    return runs, labels, metric, legend, notes, slugs


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path, *, labels: Sequence[str] | None = None,
              metric: str | None = None, overwrite: bool = False) -> dict[str, Any]:
    """``fedlora plot``: read the runs (``fedlora.llm.runfolder.read_run``), check them, then write into
    ``out`` (claimed with ``fedlora.io.claim_output_dir``: new or empty unless ``overwrite``):

    * ``curves.png`` (``curves_figure``) and ``curves.csv`` (``curve_rows`` of every run: run, round,
      quantity, value);
    * ``split/<label>.png`` (``split_figure``) per run and ``split.csv`` (``split_rows``: run, part,
      client, label, count) — the per-client label histograms config.json records;
    * ``plot.json``: the runs (folder, label, method, task, status, rounds done of planned) and the metric.

    ``labels``: one per run (default: the folder's name, and the method when it differs); ``metric``:
    one every run reports (default: the runs' main metric — runs of different tasks need it).
    Refused in one ``ConfigError`` line before anything is written: a folder that is not a run, the same
    run twice, labels that are not one per run or repeat, runs of different tasks without ``metric``, a
    ``metric`` some run does not report. Incomplete runs are plotted as far as they got: the returned
    ``notes`` say so (and their legend entries). Returns ``{"out", "files", "metric", "runs", "notes"}``;
    on any failure while writing, what was written is removed."""
    if not run_dirs:
        raise ConfigError("RUN_DIR: give at least one run folder")
    # --out first (as every command): refused before any work, cleared only once the runs have passed
    folder = claim_output_dir(out, "--out", writes=PLOT_WRITES, overwrite=overwrite, clear=False)
    try:
        runs, labels, metric, legend, notes, slugs = _check_runs(run_dirs, labels, metric)
    except BaseException:
        folder.remove_if_empty()
        raise
    if overwrite:
        folder.clear()
    try:
        rows = [row for lab, run in zip(labels, runs) for row in curve_rows(lab, run, metric)]
        tasks = ", ".join(dict.fromkeys(r.data_name for r in runs))
        title = f"{tasks} — test {metric}, {len(runs)} run{'s' * (len(runs) != 1)}"
        files = {"curves.csv": _csv(rows, CURVE_COLUMNS), "curves.png": curves_figure(rows, legend, metric, title)}
        split_all = []
        for lab, s, run in zip(labels, slugs, runs):
            if not run.split or "label_names" not in run.split:
                notes.append(f"{str(run.path)!r}: config.json holds no split (resolved.split): no label histograms")
                continue
            srows = split_rows(lab, run.split)
            split_all += srows
            fed = run.config.get("federation", {})
            files[f"split/{s}.png"] = split_figure(
                srows, f"{legend[lab]}: {fed.get('partition', '?')} over {run.clients} clients ({run.task})")
        files["split.csv"] = _csv(split_all, SPLIT_COLUMNS)
        for name, data in files.items():
            write_bytes_atomic(folder.path / name, data)
        info = {"metric": metric,
                "runs": [{"label": lab, "path": str(d), "method": r.method, "task": r.task, "status": r.status,
                          "rounds_done": r.rounds_done, "rounds_planned": r.rounds_planned,
                          **({"split_png": f"split/{s}.png"} if f"split/{s}.png" in files else {})}
                         for lab, d, s, r in zip(labels, run_dirs, slugs, runs)]}
        write_json_atomic(folder.path / "plot.json", info)
    except BaseException:
        folder.discard()
        raise
    return {"out": folder.path, "files": [*files, "plot.json"], "metric": metric, "runs": info["runs"], "notes": notes}
