"""The privacy–utility sweep of sample-level DP-SGD on the synthetic testbed (docs/concepts/privacy.md, "On the
synthetic testbed"). Run from the repository root:

    python synthetic/results/privacy_sweep.py [--out-dir runs/privacy-sweep] [--clip-norm 1] [--rounds 20]
    python synthetic/results/privacy_sweep.py --methods all --out-dir runs/privacy-sweep-all   # every private method
    python synthetic/results/privacy_sweep.py --methods perfedavg,perfedavg:variant=hessian-free   # with options

FedAvg-LoRA, FFA-LoRA, RoLoRA, FedSVD and Fed-SB (``--methods``: others, or ``all`` — every method with sample-level
DP on the testbed) at ε ∈ {∞, 6, 3, 1}, δ = 1e-5, 2 seeds stacked in each run, the
step size chosen per (method, ε) on validation loss (``fedlora.synthetic.privacy_sweep.sweep``). Writes
privacy_sweep.md (the table), privacy_sweep.json (every step size's validation loss) and privacy_sweep.png into
--out-dir (not synthetic/results: a .md there would become a docs page; the committed json and figure are copies).
"""
from __future__ import annotations

import argparse
import json
import math

from fedlora.errors import ConfigError
from fedlora.io import check_output_dir
from fedlora.methods import available_methods, get_method
from fedlora.synthetic.privacy_sweep import SWEEP_METHODS, method_entry, plot_sweep, sweep, sweep_markdown

#: the methods with sample-level DP on the testbed: every one without a refusal, but Centralized (fedlora run only)
TESTBED_PRIVATE = tuple(m for m in available_methods()
                        if get_method(m).sample_dp_refusal is None and not get_method(m).pooled_data)


def parse_methods(text: str) -> tuple[str, ...]:
    """``--methods``: comma-separated entries — a name, or a name with constructor options
    (``perfedavg:variant=hessian-free``, ``method_entry``) — or ``all`` (``TESTBED_PRIVATE``, default options); one
    line naming what is allowed else. An entry must train privately on the testbed with its options."""
    if text.strip() == "all":
        return TESTBED_PRIVATE
    entries = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = []
    for entry in entries:
        try:
            name, options = method_entry(entry)
        except ConfigError as e:
            raise ConfigError(f"--methods: {e}") from None
        cls = get_method(name)
        if cls.pooled_data or cls.sample_dp_refusal_for(options) is not None:
            bad.append(entry)
    if not entries or bad or len(set(entries)) != len(entries):
        raise ConfigError(f"--methods: {', '.join(bad) or text!r} — give distinct entries among "
                          f"{', '.join(TESTBED_PRIVATE)} (a name, or NAME:KEY=VALUE with its options, e.g. "
                          f"pf2lora:hypergradient=finite-difference), or all")
    return entries


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--out-dir", default="runs/privacy-sweep")
    ap.add_argument("--methods", default=",".join(SWEEP_METHODS),
                    help="comma-separated, or all: every method with sample-level DP on the testbed; an entry may "
                         "carry constructor options, NAME:KEY=VALUE (e.g. pf2lora:hypergradient=finite-difference)")
    ap.add_argument("--clip-norm", type=float, default=1.0)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--local-steps", type=int, default=5)
    ap.add_argument("--lr-grid", default="0.1,0.3,1,3", help="comma-separated; FFA-LoRA's is 10× this")
    ap.add_argument("--task", default="classification", choices=("classification", "regression"))
    args = ap.parse_args(argv)
    try:
        methods = parse_methods(args.methods)
        out = check_output_dir(args.out_dir, "--out-dir")  # before the sweep: a bad folder costs one line
    except ConfigError as e:
        ap.exit(2, f"error: {e}\n")
    result = sweep(methods=methods, clip_norm=args.clip_norm, batch_size=args.batch_size, rounds=args.rounds,
                   local_steps=args.local_steps, lr_grid=tuple(float(v) for v in args.lr_grid.split(",")),
                   task=args.task)
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
