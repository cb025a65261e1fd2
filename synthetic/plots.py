"""Figures of the synthetic experiments (matplotlib, Agg canvas: no display, no global state)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

__all__ = ["plot_rank_recovery"]

_LABELS = {"pf2lora": "PF2LoRA", "hetlora": "HetLoRA"}
#: line style per method (colour is the client's)
_STYLES = {"pf2lora": "-", "hetlora": "--"}
_REF_STYLE = ":"  # reference levels: RRR oracle (loss panels), true rank (rank panel)


def _client_colors(n: int) -> list:
    """n distinct colours: tab10 up to 10 clients, then evenly spaced on a continuous map."""
    import matplotlib

    if n <= 10:
        return [matplotlib.colormaps["tab10"](k) for k in range(n)]
    return [matplotlib.colormaps["turbo"](x) for x in np.linspace(0.05, 0.95, n)]


def plot_rank_recovery(result: dict[str, Any], path: str | Path) -> Path:
    """Fig. 2 of [PF2LoRA]: train loss, test loss, ‖Ŵ_k − W_k*‖_F, rank per round.

    Lines are the mean over seeds (band: min–max): colour = client, line style = method; dotted lines in
    the client's colour are its RRR oracle MSE (loss panels) and its true rank (rank panel). One legend,
    outside the axes, so it never covers a curve, however many clients there are.
    """
    runs_all = result["runs"]
    methods = [m for m in _STYLES if any(r["method"] == m for r in runs_all)]
    n_clients = len(runs_all[0]["clients"])
    colors = _client_colors(n_clients)
    fig = Figure(figsize=(17.5, 4.2))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 4)
    panels = [("train_mse", "train MSE", True), ("test_mse", "test MSE", True),
              ("distance", r"$\|\hat W_k - W_k^*\|_F$", True), ("rank90", "rank (90 % energy)", False)]
    for method in methods:
        runs = [r for r in runs_all if r["method"] == method]
        steps = np.asarray(runs[0]["history"]["step"])
        for k in range(n_clients):
            for ax, (key, title, log) in zip(axes, panels):
                vals = np.asarray([[row[k] for row in r["history"][key]] for r in runs], dtype=float)
                ax.plot(steps, vals.mean(0), color=colors[k], ls=_STYLES[method], lw=1.5)
                if len(runs) > 1:
                    ax.fill_between(steps, vals.min(0), vals.max(0), color=colors[k], alpha=0.12, lw=0)
    for ax, (key, title, log) in zip(axes, panels):
        ax.set_title(title)
        ax.set_xlabel("step")
        if log:
            ax.set_yscale("log")
    axes[3].yaxis.get_major_locator().set_params(integer=True)
    runs0 = [r for r in runs_all if r["method"] == methods[0]]
    for k in range(n_clients):
        oracle = float(np.mean([r["clients"][k]["oracle_mse"] for r in runs0]))
        true_rank = runs0[0]["clients"][k]["true_rank"]
        style = dict(color=colors[k], ls=_REF_STYLE, lw=1.1)
        axes[0].axhline(oracle, **style)
        axes[1].axhline(oracle, **style)
        axes[3].axhline(true_rank, **style)
    handles = [Line2D([], [], color=colors[k], lw=2.5, label=f"client {k + 1} (true rank "
                      f"{runs0[0]['clients'][k]['true_rank']})") for k in range(n_clients)]
    handles += [Line2D([], [], color="k", ls=_STYLES[m], lw=1.5, label=_LABELS[m]) for m in methods]
    handles.append(Line2D([], [], color="gray", ls=_REF_STYLE, lw=1.1, label="RRR oracle MSE / true rank"))
    fig.legend(handles=handles, loc="center left", bbox_to_anchor=(0.885, 0.5), fontsize=8, frameon=False)
    cfg = result["config"]
    fig.suptitle(f"rank recovery — ground truth {cfg['ground_truth']}, preset {cfg['preset']}, "
                 f"{n_clients} clients, {cfg['seeds']} seed(s), {cfg['steps']} steps, I = {cfg['interval']}"
                 + (f", hypergradient {cfg['hypergradient']}" if cfg.get("hypergradient", "exact") != "exact" else ""),
                 fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.88, 1))
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path
