"""Start-up of every ``fedlora`` command against ``python -c "import torch"`` on the same machine (issue 26 §2–3):
the wall time of the installed ``fedlora`` script, from starting the process to its exit, median of ``--runs``
rounds; in each round every command runs once, in turn, so that a change in the machine's load reaches them all.
Also the synthetic main job (``make demo``'s first command, with its figure) and ``StackedAdamW.step`` against
torch's AdamW on the job's shapes. Numbers, not assertions: results go to bench/results/startup.md (and .json).

    python bench/startup.py [--runs 5] [--only SUBSTRING] [--fedlora PATH] [--out bench/results]

``--fedlora`` times another install's script (a clean checkout's ``.venv/bin/fedlora``, to compare); the
reference ``import torch`` then runs on that install's Python. The load average is printed with the
results: on a shared machine, compare only numbers measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: the synthetic main job (README, ``make demo``)
MAIN_JOB = ["synthetic", "rank-recovery", "--preset", "tuned", "--ground-truth", "shared-private", "--seeds", "5"]

#: what ``fedlora run tiny-smoke --dry-run`` loads to validate its config: torch, transformers' tokenizers and the
#: RoBERTa model code it builds the model from (on the meta device; the code imports torch._dynamo)
DRY_RUN_LOADS = "import torch, transformers; from transformers import AutoTokenizer, RobertaForSequenceClassification"


def commands(python: str, fedlora: str, tmp: Path) -> list[tuple[str, list[str], int, str]]:
    """(name, argv, expected exit status, target) of every command timed; ``{i}`` in an argument is the round."""
    rows = [("`python -c \"import torch\"` (reference)", [python, "-c", "import torch"], 0, ""),
            ("`python -c \"import torch, transformers …\"` (what the dry run loads)", [python, "-c", DRY_RUN_LOADS], 0, ""),
            ("`fedlora --help`", [fedlora, "--help"], 0, "≤ 0.2 s"),
            ("`fedlora run --help`", [fedlora, "run", "--help"], 0, "≤ 0.2 s"),
            ("`fedlora run --list-configs`", [fedlora, "run", "--list-configs"], 0, "≤ 0.2 s"),
            ("a config error: `fedlora run no-such-config`", [fedlora, "run", "no-such-config"], 2, "≤ 0.2 s"),
            ("`fedlora run tiny-smoke --dry-run`", [fedlora, "run", "tiny-smoke", "--dry-run"], 0,
             "≤ 1.5× the dry run's loads"),
            ("`fedlora export` of a missing run folder",
             [fedlora, "export", str(tmp / "no-such-run"), "--client", "0", "--out", str(tmp / "export")], 2, ""),
            ("`fedlora plot` of a missing run folder", [fedlora, "plot", str(tmp / "no-such-run"), "--out",
                                                        str(tmp / "plot")], 2, "")]
    for sub in ("rank-recovery", "bilevel-convergence", "tune", "compare", "flower"):
        rows.append((f"`fedlora synthetic {sub} --help`", [fedlora, "synthetic", sub, "--help"], 0, ""))
    rows.append(("the synthetic main job: `fedlora " + " ".join(MAIN_JOB) + "` (with its figure)",
                 [fedlora, *MAIN_JOB, "--out", str(tmp / "job{i}")], 0, "≤ 5.5 s quiet; ≤ 4.0× import torch"))
    return rows


def time_once(argv: list[str], expect: int) -> float:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    t0 = time.perf_counter()
    res = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    wall = time.perf_counter() - t0
    if res.returncode != expect:
        raise SystemExit(f"{' '.join(argv)}: exit status {res.returncode}, expected {expect}: "
                         f"{res.stderr.decode(errors='replace').strip()[-500:]}")
    return wall


def optimizer_step_us(python: str) -> dict[str, float]:
    """µs per step, best of 5 × 2000 steps, one thread, in a child of ``python``: ``StackedAdamW`` against torch's
    AdamW (single-tensor and foreach) on the main job's PF2LoRA upper level (float64 A (10, 4, 10), B (10, 10, 4):
    5 seeds × 2 clients, rank 4, d = 10)."""
    code = r"""
import json, time, torch
from fedlora.optim import StackedAdamW
torch.set_num_threads(1)
def params():
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64)) for s in ((10, 4, 10), (10, 10, 4))]
def per_step(make):
    ps = params(); opt = make(ps)
    g = torch.Generator().manual_seed(1)
    grads = [[torch.randn(p.shape, generator=g, dtype=torch.float64) for p in ps] for _ in range(10)]
    best = float("inf")
    for rep in range(6):
        t0 = time.perf_counter()
        for i in range(2000):
            for p, gr in zip(ps, grads[i % 10]):
                p.grad = gr
            opt.step()
        if rep:
            best = min(best, (time.perf_counter() - t0) / 2000)
    return best * 1e6
print(json.dumps({"StackedAdamW": per_step(lambda ps: StackedAdamW(ps, lr=0.05, weight_decay=0.0)),
                  "torch AdamW (foreach=False)": per_step(lambda ps: torch.optim.AdamW(ps, lr=0.05, foreach=False)),
                  "torch AdamW (foreach=True)": per_step(lambda ps: torch.optim.AdamW(ps, lr=0.05, foreach=True))}))
"""
    res = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(res.stdout.splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5, help="rounds (every command once per round; default 5)")
    p.add_argument("--only", default=None, help="time only the commands whose name contains this")
    p.add_argument("--fedlora", default=str(Path(sys.executable).with_name("fedlora")),
                   help="the fedlora script to time (default: the one next to this Python)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    a = p.parse_args(argv)
    fedlora = str(Path(a.fedlora).absolute())
    python = str(Path(fedlora).with_name("python"))
    load_before = os.getloadavg()
    torch_version = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                                   text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="fedlora-startup-") as d:
        rows = [r for r in commands(python, fedlora, Path(d)) if a.only is None or a.only in r[0] or r[0].startswith("`python")]
        times: dict[str, list[float]] = {name: [] for name, *_ in rows}
        for i in range(a.runs):
            for name, cmd, expect, _ in rows:
                times[name].append(time_once([c.replace("{i}", str(i)) for c in cmd], expect))
            print(f"round {i + 1}/{a.runs} done", file=sys.stderr)
    optim = optimizer_step_us(python) if a.only is None else None
    load_after = os.getloadavg()
    ref, loads_ref = rows[0][0], rows[1][0]
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, torch {torch_version}"
    loads = f"load average (1, 5, 15 min) {', '.join(f'{x:.2f}' for x in load_before)} before, " \
            f"{', '.join(f'{x:.2f}' for x in load_after)} after"
    lines = ["| command | median s | min s | median ÷ `import torch` | target |", "|---|---|---|---|---|"]
    for name, _, _, target in rows:
        ts = times[name]
        ratio = statistics.median(t / r for t, r in zip(ts, times[ref]))  # each round's own reference
        if "--dry-run" in name:  # and against what it loads
            target += f"; here {statistics.median(t / r for t, r in zip(ts, times[loads_ref])):.2f}×"
        lines.append(f"| {name} | {statistics.median(ts):.2f} | {min(ts):.2f} | {ratio:.2f}× | {target} |")
    table = "\n".join(lines)
    opt_table = ""
    if optim:
        opt_table = ("| optimizer step (float64 A (10, 4, 10), B (10, 10, 4), one thread) | µs / step (best of 5 × 2000) |\n"
                     "|---|---|\n" + "\n".join(f"| {k} | {v:.1f} |" for k, v in optim.items()))
    print(f"{machine}; {loads}\n\n{table}\n\n{opt_table}")
    if a.only is not None:  # a partial table: printed, not written
        return 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "startup.json").write_text(json.dumps({"machine": machine, "load_before": load_before, "load_after": load_after,
                                                  "runs": a.runs, "wall_s": times, "optimizer_step_us": optim}, indent=1))
    cmd = "python bench/startup.py" + (f" --runs {a.runs}" if a.runs != 5 else "")
    (out / "startup.md").write_text(
        f"# Start-up of every command ({machine})\n\n`{cmd}` — the wall time of the `fedlora` script from the "
        f"process's start to its exit, median of {a.runs} rounds (every command once per round, in turn); the "
        f"ratio is each round's time over that round's `import torch`, median over the rounds. {loads}.\n\n"
        f"{table}\n" + (f"\n`StackedAdamW.step` against torch's AdamW on the job's PF2LoRA upper level:\n\n{opt_table}\n"
                        if opt_table else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
