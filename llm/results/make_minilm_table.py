"""Builds the README's MiniLM table and figure from finished runs (`fedlora run minilm-debian …`).

    python llm/results/make_minilm_table.py RUN_DIR [RUN_DIR …] --out llm/results/minilm_debian
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def _load(run: Path) -> dict:
    rounds = [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines()]
    return {"summary": json.loads((run / "summary.json").read_text()), "rounds": rounds,
            "config": json.loads((run / "config.json").read_text())}


def table(runs: list[dict]) -> str:
    lines = ["| method | head | test acc. round 0 → 10 (clients' mean) | min–max over clients | macro-F1 | global model acc. | "
             "bytes up / down per round (all clients) | wall |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        s, rs = r["summary"], r["rounds"]
        t0, t = s["round0_test"], s["final_test"]
        g = f"{s['round0_global']['accuracy']:.3f} → {s['final_global']['accuracy']:.3f}" if "final_global" in s else "—"
        trained = [x for x in rs if x["round"] > 0]
        up = sum(sum(x["bytes_up"].values()) for x in trained) / len(trained)
        down = sum(sum(x["bytes_down"].values()) for x in trained) / len(trained)
        lines.append(f"| {s['method']} | {r['config']['resolved']['head']} | {t0['mean']['accuracy']:.3f} → "
                     f"**{t['mean']['accuracy']:.3f}** | {t['min']['accuracy']:.3f}–{t['max']['accuracy']:.3f} | "
                     f"{t['mean']['macro_f1']:.3f} | {g} | {up / 1e6:.2f} MB / {down / 1e6:.2f} MB | {s['wall_s'] / 60:.1f} min |")
    return "\n".join(lines)


def figure(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    for r in runs:
        ev = [x if x["round"] == 0 else x for x in r["rounds"] if "eval" in x]
        rounds = [x["round"] for x in ev]
        ax[0].plot(rounds, [x["eval"]["test"]["mean"]["accuracy"] for x in ev], "o-", label=r["summary"]["method"])
        trained = [x for x in r["rounds"] if x["round"] > 0]
        ax[1].plot([x["round"] for x in trained], [sum(x["train_loss"].values()) / len(x["train_loss"]) for x in trained],
                   "o-", label=r["summary"]["method"])
    ax[0].axhline(0.25, ls=":", c="gray", label="chance (4 classes)")
    ax[0].set(xlabel="round", ylabel="test accuracy (clients' mean)", ylim=(0, 1))
    ax[1].set(xlabel="round", ylabel="training loss (participants' mean)")
    for a in ax:
        a.legend(fontsize=8)
    fig.suptitle("MiniLM-L6, 4 clients, Dirichlet(0.5), debian-sections")
    fig.tight_layout()
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
