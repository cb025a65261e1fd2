"""``fedlora run --dry-run`` refuses what the real run would refuse, as far as no model is needed: the
data's file and columns, the partition (its syntax, its parameters, and against the data), every
method option (the method is built); and every numeric config field has its bounds checked, at and
just past each bound."""
import json

import pytest

from fedlora.cli import main
from fedlora.errors import ConfigError
from fedlora.llm.config import RunConfig, load_config


def _dry(capsys, *argv):
    code = main(["run", *argv, "--dry-run"])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def own_csv(tmp_path):
    f = tmp_path / "reviews.csv"
    rows = ["sentence,sentiment"] + [f"text number {i} is {'good' if i % 2 else 'bad'},{'pos' if i % 2 else 'neg'}"
                                     for i in range(40)]
    f.write_text("\n".join(rows) + "\n")
    return f


def test_a_dry_run_reads_the_local_data_and_splits_it(capsys, own_csv):
    code, out, err = _dry(capsys, "tiny-smoke", "--set", f"data.path={own_csv}", "--set", "data.text_column=sentence",
                          "--set", "data.label_column=sentiment")
    assert code == 0, err
    data = json.loads(out)["resolved"]["data"]
    assert data["checked"] and data["labels"] == ["neg", "pos"] and data["train_rows"] + data["test_rows"] == 40
    assert len(data["client_train_sizes"]) == 3


@pytest.mark.parametrize("sets,msg", [
    (["data.path=/nonexistent/reviews.csv"], "/nonexistent/reviews.csv"),
    (["data.text_column=review"], "review"),
    (["federation.partition=dirichlet 0.5"], "federation.partition: partition spec 'dirichlet 0.5' is not of the form"),
    (["federation.partition=iid(3)"], "federation.partition: partition spec 'iid(3)': iid takes no positional argument"),
    (["federation.partition=dirichlet(a=0.5)"], "federation.partition: partition 'dirichlet': unknown parameter(s) 'a';"),
    (["method.options={client_rank: 2}"], "unknown option(s) 'client_rank';"),
    (["method.name=pf2lora", "method.options={clientrank: 2}"], "unknown option(s) 'clientrank';"),
    (["method.name=pf2lora", "method.options={client_rank: 4}"], "need integers 1 ≤ client_rank < rank"),
    (["federation.clients=400"], "into 400 clients"),
])
def test_a_dry_run_refuses_what_the_run_refuses(capsys, own_csv, sets, msg):
    base = ["--set", f"data.path={own_csv}", "--set", "data.text_column=sentence", "--set", "data.label_column=sentiment"]
    if "data.path" in sets[0]:
        base = base[2:]
    code, out, err = _dry(capsys, "tiny-smoke", *base, *[x for s in sets for x in ("--set", s)])
    assert code == 2 and out == "" and msg in err and err.count("\n") == 1, err


def test_a_dry_run_of_hub_data_says_it_did_not_fetch_it(capsys):
    code, out, err = _dry(capsys, "glue-sst2-pf2lora")
    assert code == 0, err
    assert json.loads(out)["resolved"]["data"] == {"checked": False,
                                                   "why": "data from the hub is not fetched by a dry run"}


def test_toml_can_name_its_own_labelled_file(tmp_path, own_csv):
    """TOML has no null: ``data.task`` defaults to ``auto`` — debian-sections without a path, no task with one."""
    f = tmp_path / "run.toml"
    f.write_text(f'[data]\npath = "{own_csv}"\ntext_column = "sentence"\nlabel_column = "sentiment"\n')
    assert load_config(f).data.task is None
    assert load_config(None).data.task == "debian-sections"
    assert load_config("tiny-smoke", [f"data.path={own_csv}"]).data.task is None
    assert load_config("glue-sst2-pf2lora", [f"data.path={own_csv}"]).data.task == "glue/sst2"  # named: kept


# -- the bounds of every numeric field -----------------------------------------------------------------
#: field → (a value at its bound, accepted; a value just past it, refused)
BOUNDS = {
    "seed": (0, -1),
    "model.lora_alpha": (1e-9, 0.0),
    "model.max_length": (2, 1),
    "data.test_fraction": (0.999, 1.0),
    "data.max_train_samples": (1, 0),
    "data.max_test_samples": (1, 0),
    "data.doc_stride": (0, -1),
    "method.rank": (1, 0),
    "method.lr": (1e-12, 0.0),
    "federation.clients": (1, 0),
    "federation.sample_fraction": (1.0, 1.0000001),
    "federation.clients_per_pass": (1, 0),
    "federation.val_fraction": (0.0, -0.01),
    "federation.min_clients": (1, 0),
    "federation.timeout_s": (1e-9, 0.0),
    "train.rounds": (1, 0),
    "train.local_steps": (1, 0),
    "train.batch_size": (1, 0),
    "train.threads": (1, 0),
    "train.checkpoint_every": (0, -1),
    "eval.every": (1, 0),
    "eval.batch_size": (1, 0),
    "eval.max_samples": (1, 0),
}
LOWER_OPEN = {"data.test_fraction": (1e-9, 0.0), "federation.sample_fraction": (1e-9, 0.0),
              "federation.val_fraction": (0.999, 1.0), "train.local_epochs": (1e-9, 0.0)}


def _numeric_fields():
    import dataclasses
    import typing

    out = []
    for f in dataclasses.fields(RunConfig):
        if f.name in ("seed",):
            out.append("seed")
        sub = {"model", "data", "method", "federation", "train", "eval"}
        if f.name in sub:
            cls = typing.get_type_hints(RunConfig)[f.name]
            for g in dataclasses.fields(cls):
                if any(t in str(g.type) for t in ("int", "float")):
                    out.append(f"{f.name}.{g.name}")
    return out


def test_the_table_covers_every_numeric_field():
    assert sorted(_numeric_fields()) == sorted(set(BOUNDS) | set(LOWER_OPEN))


@pytest.mark.parametrize("field,values", list(BOUNDS.items()) + [(k + " ", v) for k, v in LOWER_OPEN.items()])
def test_every_numeric_field_accepts_its_bound_and_refuses_past_it(field, values):
    field = field.strip()
    ok, bad = values
    extra = ["train.local_steps=null"] if field == "train.local_epochs" else []
    cfg = load_config("tiny-smoke", [*extra, f"{field}={ok}"])
    section, _, name = field.rpartition(".")
    assert getattr(getattr(cfg, section) if section else cfg, name) == ok
    with pytest.raises(ConfigError) as e:
        load_config("tiny-smoke", [*extra, f"{field}={bad}"])
    assert str(e.value).startswith(field + ":"), str(e.value)


@pytest.mark.parametrize("value", ["0", "0.0", "-4"])
def test_lora_alpha_zero_is_refused_in_one_line_saying_what_is_allowed(capsys, value):
    """s = α/r: α = 0 would train an adapter that changes nothing; the run and its dry run refuse it."""
    assert main(["run", "tiny-smoke", "--dry-run", "--set", f"model.lora_alpha={value}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedlora: error: model.lora_alpha: must be a finite number > 0, got ") and \
        err.count("\n") == 1, err
