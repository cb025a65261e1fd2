"""Builds the MiniLM table and figure (docs/results/minilm-every-method.md) from finished runs (`fedlora run minilm-debian …`).

    python llm/results/make_minilm_table.py RUN_DIR [RUN_DIR …] --out llm/results/minilm_debian
"""
from __future__ import annotations

import argparse
from pathlib import Path

from fedlora.llm.runfolder import read_run


def _load(run: Path) -> dict:
    folder = read_run(run)  # the one reader of a run folder
    if folder.summary is None:
        raise SystemExit(f"{run}: the run is incomplete ({folder.incomplete_note}); the table needs finished runs")
    return {"summary": folder.summary, "rounds": list(folder.records),
            "config": {"config": folder.config, "resolved": folder.resolved}}


def _steps(r: dict) -> str:
    """The method's step sizes as config.json records them, e.g. 'AdamW 2e-3 + SGD 1e-3'."""
    sizes = r["config"]["resolved"].get("step_sizes", {})
    return " + ".join(f"{'AdamW' if v['optimizer'] == 'adamw' else 'SGD'} {v['lr']:g}" for v in sizes.values()) or "—"


def _mean_loss(record: dict) -> float:
    return sum(record["train_loss"].values()) / len(record["train_loss"])


def table(runs: list[dict]) -> str:
    last = max(r["summary"]["rounds"] for r in runs)
    lines = [f"| method | head | optimizer, step size | test acc. round 0 → {last} (clients' mean) | min–max over clients | "
             f"training loss round 1 → {last} | global model acc. | bytes up / down per round (all clients) | wall |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        s, rs = r["summary"], r["rounds"]
        t0, t = s["round0_test"], s["final_test"]
        g = f"{s['round0_global']['accuracy']:.3f} → {s['final_global']['accuracy']:.3f}" if "final_global" in s else "—"
        trained = [x for x in rs if x["round"] > 0]
        up = sum(sum(x["bytes_up"].values()) for x in trained) / len(trained)
        down = sum(sum(x["bytes_down"].values()) for x in trained) / len(trained)
        lines.append(f"| {s['method']} | {r['config']['resolved']['head']} | {_steps(r)} | {t0['mean']['accuracy']:.3f} → "
                     f"**{t['mean']['accuracy']:.3f}** | {t['min']['accuracy']:.3f}–{t['max']['accuracy']:.3f} | "
                     f"{_mean_loss(trained[0]):.3f} → {_mean_loss(trained[-1]):.3f} | {g} | "
                     f"{up / 1e6:.2f} MB / {down / 1e6:.2f} MB | {s['wall_s'] / 60:.1f} min |")
    return "\n".join(lines)


def _title(r: dict) -> str:
    c = r["config"]["config"]
    model = c["model"]["name"]
    return (f"{model}, {c['federation']['clients']} clients, {c['federation']['partition']}, "
            f"{r['summary']['task']}")


def figure(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(12, 4.4))
    colours = plt.get_cmap("tab20").colors
    styles = ["-", "--", "-.", ":"]
    for i, r in enumerate(runs):
        look = dict(color=colours[i % len(colours)], ls=styles[(i // 10) % len(styles)], marker="o", ms=3)
        ev = [x for x in r["rounds"] if "eval" in x]
        ax[0].plot([x["round"] for x in ev], [x["eval"]["test"]["mean"]["accuracy"] for x in ev],
                   label=r["summary"]["method"], **look)
        trained = [x for x in r["rounds"] if x["round"] > 0]
        ax[1].plot([x["round"] for x in trained], [_mean_loss(x) for x in trained], **look)
    labels = runs[0]["config"]["resolved"].get("label_names", [])
    if labels:
        ax[0].axhline(1 / len(labels), ls=":", c="gray", label=f"chance ({len(labels)} classes)")
    ax[0].set(xlabel="round", ylabel="test accuracy (clients' mean)", ylim=(0, 1))
    ax[1].set(xlabel="round", ylabel="training loss (participants' mean)")
    for a in ax:
        a.xaxis.get_major_locator().set_params(integer=True)
    fig.legend(*ax[0].get_legend_handles_labels(), loc="center right", fontsize=8, frameon=False)
    fig.suptitle(_title(runs[0]))
    fig.tight_layout(rect=(0, 0, 0.86, 1))
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("runs", nargs="+")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    runs = [_load(Path(r)) for r in a.runs]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    md = table(runs)
    out.with_suffix(".md").write_text(md + "\n")
    figure(runs, out.with_suffix(".png"))
    print(md)


if __name__ == "__main__":
    main()
