"""Figures of the synthetic experiments (matplotlib, Agg canvas: no display, no global state)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

__all__ = ["plot_rank_recovery"]

_COLORS = {"pf2lora": ("#1f77b4", "#6baed6"), "hetlora": ("#d62728", "#fc9272")}
_LABELS = {"pf2lora": "PF2LoRA", "hetlora": "HetLoRA"}


def plot_rank_recovery(result: dict[str, Any], path: str | Path) -> Path:
    """Fig. 2 of [PF2LoRA]: train loss, test loss, ‖Ŵ_k − W_k*‖_F, rank per round.

    Lines are the mean over seeds (band: min–max), one per method × client; dashed horizontal
    lines are each client's RRR oracle test MSE (test panel) and its true rank (rank panel).
    """
    fig = Figure(figsize=(16, 4))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 4)
    panels = [("train_mse", "train MSE", True), ("test_mse", "test MSE", True),
              ("distance", r"$\|\hat W_k - W_k^*\|_F$", True), ("rank90", "rank (90 % energy)", False)]
    methods = sorted({r["method"] for r in result["runs"]}, key=lambda m: list(_COLORS).index(m))
    for method in methods:
        runs = [r for r in result["runs"] if r["method"] == method]
        steps = np.asarray(runs[0]["history"]["step"])
        n_clients = len(runs[0]["clients"])
        for k in range(n_clients):
            color = _COLORS[method][k % 2]
            label = f"{_LABELS[method]} client {k + 1}"
            for ax, (key, title, log) in zip(axes, panels):
                vals = np.asarray([[row[k] for row in r["history"][key]] for r in runs], dtype=float)
                ax.plot(steps, vals.mean(0), color=color, label=label, lw=1.5)
                if len(runs) > 1:
                    ax.fill_between(steps, vals.min(0), vals.max(0), color=color, alpha=0.15, lw=0)
                ax.set_title(title)
                ax.set_xlabel("step")
                if log:
                    ax.set_yscale("log")
    runs0 = [r for r in result["runs"] if r["method"] == methods[0]]
    for k in range(len(runs0[0]["clients"])):
        oracle = float(np.mean([r["clients"][k]["oracle_mse"] for r in runs0]))
        true_rank = runs0[0]["clients"][k]["true_rank"]
        style = dict(color="k", ls="--" if k == 0 else ":", lw=1)
        axes[1].axhline(oracle, label=f"RRR oracle client {k + 1}", **style)
        axes[0].axhline(oracle, **style)
        axes[3].axhline(true_rank, label=f"true rank client {k + 1}", **style)
    axes[1].legend(fontsize=7)
    axes[3].legend(fontsize=7)
    cfg = result["config"]
    fig.suptitle(f"rank recovery — ground truth {cfg['ground_truth']}, preset {cfg['preset']}, "
                 f"{cfg['seeds']} seed(s), {cfg['steps']} steps, I = {cfg['interval']}", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path
