"""The figure of a ``fedlora run``: metric, loss and communication per round."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = ["plot_run", "run_title"]


def run_title(method: str | None, task: str | None, clients: int | None, rounds: int | None) -> str:
    """"fedavg on sst2 — 4 clients, 10 rounds" from what is known (parts that are None are left out)."""
    head = " on ".join(str(p) for p in (method, task) if p)
    tail = ", ".join(t for t in (f"{clients} client{'s' * (clients != 1)}" if clients is not None else "",
                                 f"{rounds} round{'s' * (rounds != 1)}" if rounds is not None else "") if t)
    return " — ".join(t for t in (head, tail) if t)


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
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(1, 3, figsize=(13, 3.6))
    rounds = [e["round"] for e in evals]
    ax[0].plot(rounds, [e["test"]["mean"][metric] for e in evals], "o-", label="clients (mean)")
    lo = [e["test"]["min"][metric] for e in evals]
    hi = [e["test"]["max"][metric] for e in evals]
    ax[0].fill_between(rounds, lo, hi, alpha=0.2, label="clients (min–max)")
    if all("global" in e for e in evals):
        ax[0].plot(rounds, [e["global"][metric] for e in evals], "s--", label="global model")
    ax[0].set(xlabel="round", ylabel=f"test {metric}")
    ax[0].legend(fontsize=8)
    r = [h["round"] for h in history]
    loss = [sum(h["train_loss"].values()) / max(len(h["train_loss"]), 1) for h in history]
    ax[1].plot(r, loss, "o-")
    ax[1].set(xlabel="round", ylabel="training loss (participants' mean)")
    ax[2].plot(r, [sum(h["bytes_up"].values()) for h in history], "o-", label="up")
    ax[2].plot(r, [sum(h["bytes_down"].values()) for h in history], "s--", label="down")
    ax[2].set(xlabel="round", ylabel="bytes (all clients)")
    ax[2].legend(fontsize=8)
    for a in ax:
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
    if title is None:
        last = max((h["round"] for h in history), default=None)
        title = run_title(method, task, clients, last)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
