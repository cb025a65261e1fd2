"""The privacy–utility sweep of sample-level DP-SGD on the synthetic testbed (docs/concepts/privacy.md, "On the
synthetic testbed"). Run from the repository root:

    python synthetic/results/privacy_sweep.py [--out-dir runs/privacy-sweep] [--clip-norm 1] [--rounds 20]

FedAvg-LoRA, FFA-LoRA, RoLoRA, FedSVD and Fed-SB at ε ∈ {∞, 6, 3, 1}, δ = 1e-5, 2 seeds stacked in each run, the
step size chosen per (method, ε) on validation loss (``fedlora.synthetic.privacy_sweep.sweep``). Writes
privacy_sweep.md (the table), privacy_sweep.json (every step size's validation loss) and privacy_sweep.png into
--out-dir (not synthetic/results: a .md there would become a docs page; the committed json and figure are copies).
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from fedlora.synthetic.privacy_sweep import plot_sweep, sweep, sweep_markdown


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default="runs/privacy-sweep")
    ap.add_argument("--clip-norm", type=float, default=1.0)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--local-steps", type=int, default=5)
    ap.add_argument("--lr-grid", default="0.1,0.3,1,3", help="comma-separated; FFA-LoRA's is 10× this")
    ap.add_argument("--task", default="classification", choices=("classification", "regression"))
    args = ap.parse_args(argv)
    result = sweep(clip_norm=args.clip_norm, batch_size=args.batch_size, rounds=args.rounds,
                   local_steps=args.local_steps, lr_grid=tuple(float(v) for v in args.lr_grid.split(",")),
                   task=args.task)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = sweep_markdown(result)
    (out / "privacy_sweep.md").write_text(table + f"\n\nwall {result['wall_s']:.0f} s\n")
    (out / "privacy_sweep.json").write_text(json.dumps(
        result, indent=1, default=lambda v: None, allow_nan=True).replace("Infinity", '"inf"'))
    plot_sweep(result, out / "privacy_sweep.png")
    print(table)
    print(f"wall {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
