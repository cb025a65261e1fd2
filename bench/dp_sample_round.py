"""Time and peak memory of a training round with sample-level DP-SGD against without (issue 29's benchmark), with 1
and with 4 clients per pass. Numbers, not assertions.

    python bench/dp_sample_round.py [--config tiny-smoke] [--steps 4] [--rounds 3] [--q 0.25] [--threads 1]
                                    [--set KEY=VALUE ...]

Each setting runs in a fresh process: the run's slot executor (``FederatedRun.prepare``) with 4 clients, every client
in every round, ``--steps`` local steps; the first round is a warm-up, the others are timed (``SlotExecutor.train``:
the clients' passes, no evaluation; the fastest and the median timed round are reported — on a shared machine
the fastest is the one least disturbed). Without DP the batches are ``train.batch_size`` rows; with DP each client's
rows are Poisson-drawn with rate ``--q`` (expected q·n_k rows), C = 1, σ = 1 — the per-round time is reported with the
mean number of rows per step so that the two can be compared per row. Peak memory: the process's peak resident set
(ru_maxrss, MiB), and on CUDA ``torch.cuda.max_memory_allocated``.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys


def _one(config: str, P: int, dp: bool, steps: int, rounds: int, q: float, sets: list[str]) -> dict:
    import resource
    import time

    import torch

    from fedlora.llm.config import load_config
    from fedlora.llm.runtime import FederatedRun
    from fedlora.privacy.dpsgd import SampleDP
    from fedlora.server import Download

    cfg = load_config(config, ["federation.clients=4", "federation.sample_fraction=1.0",
                               f"federation.clients_per_pass={P}", f"train.local_steps={steps}", *sets])
    ex = FederatedRun(cfg, write=False).prepare().slots
    rows = []
    if dp:
        sdp = SampleDP(1.0, 1.0, q, seed=0)
        ex.set_sample_dp(sdp)
        real = ex._private_sampler_fn

        def counting(clients):  # rows per step, real ones only
            sample = real(clients)

            def draw():
                batch = sample()
                rows.append(float(batch["dp_mask"].sum()) / len(clients))
                return batch
            return draw
        ex._private_sampler_fn = counting
    clients = list(range(4))
    if ex.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for rnd in range(rounds):
        t0 = time.perf_counter()
        ex.train(rnd, clients, {k: Download() for k in clients})
        if ex.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    out = {"config": config, "clients_per_pass": P, "sample_dp": dp, "local_steps": steps,
           "s_per_round_min": round(min(times[1:]), 3),  # the least disturbed round (shared machines)
           "s_per_round_median": round(sorted(times[1:])[(len(times) - 1) // 2], 3),
           "rows_per_client_step": round(sum(rows) / len(rows), 2) if rows else cfg.train.batch_size,
           "peak_rss_MiB": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
           "device": ex.device.type, "threads": torch.get_num_threads()}
    if ex.device.type == "cuda":
        out["cuda_peak_MiB"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny-smoke")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--q", type=float, default=0.25)
    ap.add_argument("--threads", type=int, default=1, help="train.threads (1: no oversubscription on a shared CPU)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(_one(a.config, int(a.one[0]), a.one[1] == "1", a.steps, a.rounds, a.q, a.set)))
        return
    for P in (1, 4):
        for dp in (False, True):
            cmd = [sys.executable, __file__, "--one", str(P), str(int(dp)), "--config", a.config, "--steps",
                   str(a.steps), "--rounds", str(a.rounds), "--q", str(a.q),
                   f"--set=train.threads={a.threads}"] + [f"--set={s}" for s in a.set]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(out.stderr[-2000:])
            print(out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
