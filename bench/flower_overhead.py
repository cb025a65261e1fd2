"""What Flower costs (issue 14): per-round wall time of the same federated run embedded, on Flower's
simulation engine and on a real loopback deployment (SuperLink + one SuperNode per client, TLS), and
the bytes Flower puts in its messages against the payload bytes the run records (``Payload.nbytes``,
the safetensors size of what each side sends). Numbers, not assertions: results go to bench/results/.

    python bench/flower_overhead.py [--method fedavg] [--rounds 3] [--deploy] [--out bench/results]

The task is ``tiny-smoke`` (a 2-layer random RoBERTa, 3 clients) with every client in every round, so
the overhead is not hidden behind compute: it is Flower's fixed cost per round. ``wall_s`` per round is
the server's ``run_round`` (train messages out, replies in, aggregation) and the evaluation after it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path


def _config(out: Path, method: str, rounds: int):
    from fedlora.llm.config import load_config

    return load_config("tiny-smoke", [f"method.name={method}", f"train.rounds={rounds}", "federation.sample_fraction=1.0",
                                      f"output_dir={json.dumps(str(out))}"])


def _rounds(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()[1:]]


def _payload_bytes(out: Path) -> dict[str, int]:
    recs = _rounds(out)
    return {"up": sum(sum(r["bytes_up"].values()) for r in recs), "down": sum(sum(r["bytes_down"].values()) for r in recs)}


def run_embedded(tmp: Path, method: str, rounds: int) -> dict:
    from fedlora.llm.runtime import FederatedRun

    out = tmp / "embedded"
    t0 = time.perf_counter()
    FederatedRun(_config(out, method, rounds)).run()
    return {"total_s": time.perf_counter() - t0, "round_s": [r["wall_s"] for r in _rounds(out)],
            "payload_bytes": _payload_bytes(out)}


def run_simulation(tmp: Path, method: str, rounds: int) -> dict:
    from fedlora.llm import flower
    from fedlora.llm.runtime import FederatedRun

    out = tmp / "simulation"
    run = FederatedRun(_config(out, method, rounds), runtime="flower")
    t0 = time.perf_counter()
    flower.run_simulation(run)  # as `fedlora run --runtime flower`
    return {"total_s": time.perf_counter() - t0, "round_s": [r["wall_s"] for r in _rounds(out)],
            "payload_bytes": _payload_bytes(out),
            "flower_array_bytes_train": dict(run.driver.executor.wire_bytes)}  # train + deliver


def run_deployment(tmp: Path, method: str, rounds: int, warm: bool = True) -> dict:
    """A SuperLink and one SuperNode per client on 127.0.0.1 with TLS (``fedlora flower local``'s deployment):
    ``warm``, each message forked from a warm SuperExec (fedlora.flower_warm, the default), else flwr's own
    SuperExec (a new ``flwr-clientapp`` interpreter per message, ``fedlora flower local --cold``)."""
    from fedlora.llm.flower_deploy import LocalDeployment

    name = "deployment" if warm else "deployment-cold"
    out = tmp / name
    cfg = _config(out, method, rounds)
    t0 = time.perf_counter()
    with LocalDeployment(tmp / f"flower-{name}", cfg.federation.clients, tls=True, warm=warm) as dep:
        up = time.perf_counter() - t0
        run_id = dep.submit(cfg.to_dict(), out=out)
        dep.wait(run_id, out, timeout=1800)
    return {"total_s": time.perf_counter() - t0, "startup_s": up, "round_s": [r["wall_s"] for r in _rounds(out)],
            "payload_bytes": _payload_bytes(out)}


def main(argv=None) -> int:
    import tempfile

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", default="fedavg")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--deploy", action="store_true", help="also a loopback deployment with TLS, its SuperNodes' "
                   "messages forked from warm SuperExecs and, one after the other, flwr's own (minutes)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    res: dict = {"method": a.method, "rounds": a.rounds, "clients": 3, "task": "tiny-smoke",
                 "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
                 "load_average_1min": [round(os.getloadavg()[0], 2)]}  # at the start and the end: other jobs show
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        res["embedded"] = run_embedded(tmp, a.method, a.rounds)
        res["simulation"] = run_simulation(tmp, a.method, a.rounds)
        if a.deploy:
            res["deployment"] = run_deployment(tmp, a.method, a.rounds)
            res["deployment-cold"] = run_deployment(tmp, a.method, a.rounds, warm=False)
    res["load_average_1min"].append(round(os.getloadavg()[0], 2))
    lines = ["| runtime | median s / round | total s (incl. start-up) | payload bytes up / down (rounds.jsonl, `Payload.nbytes`) | Flower array bytes up / down | Flower config bytes down | messages |",
             "|---|---|---|---|---|---|---|"]
    for name in ("embedded", "simulation", "deployment", "deployment-cold"):
        if name not in res:
            continue
        r = res[name]
        pb = r["payload_bytes"]
        wire = r.get("flower_array_bytes_train")
        lines.append(f"| {name} | {statistics.median(r['round_s']):.3f} | {r['total_s']:.1f} | {pb['up']:,} / {pb['down']:,} | "
                     + (f"{wire['arrays_up']:,} / {wire['arrays_down']:,} | {wire['config_down']:,} | {wire['messages']}"
                        if wire else " | | ") + " |")
    table = "\n".join(lines)
    print(table)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "flower_overhead.json").write_text(json.dumps(res, indent=1))
    (out / "flower_overhead.md").write_text(
        f"# Flower overhead ({res['machine']})\n\n`python bench/flower_overhead.py{' --deploy' if a.deploy else ''}` "
        f"— {a.method}, tiny-smoke, 3 clients, every client every round, {a.rounds} rounds; 1-minute load average "
        f"{res['load_average_1min'][0]} at the start, {res['load_average_1min'][1]} at the end.\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
