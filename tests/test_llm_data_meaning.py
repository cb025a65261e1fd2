"""Data that cannot mean what a run reports (issue 25 §3): a deliberate unseen-label test set, and own data run
through a bundled config named as the user's file, not as the bundled set, in the summary line, summary.json and
the figure's title. (The refusals themselves, dry run and real run alike: tests/test_dry_run_parity.py.)"""
import json

import numpy as np
import pytest

from fedlora.cli import main
from fedlora.llm.config import load_config
from fedlora.llm.runtime import FederatedRun


@pytest.fixture(scope="module")
def unseen(tmp_path_factory):
    """train: labels a, b (20 each); test: a, b, c (10 each) — 'c' no training row has."""
    d = tmp_path_factory.mktemp("unseen")
    (d / "train.csv").write_text("text,label\n" + "".join(f"t {i},{'ab'[i % 2]}\n" for i in range(40)))
    (d / "test.csv").write_text("text,label\n" + "".join(f"t {i},{'abc'[i % 3]}\n" for i in range(30)))
    return d


def test_unseen_test_labels_refused_by_default_name_the_root_cause(unseen):
    from fedlora.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        FederatedRun(load_config("tiny-smoke", [f"data.path={unseen}"]), write=False).prepare_model()
    msg = str(e.value)
    assert "10 of the 30 test rows have a label no training row has ('c'" in msg
    assert "data.allow_unseen_test_labels: true" in msg and "dirichlet" not in msg.lower()


def test_allow_unseen_test_labels_leaves_exactly_those_rows_out(unseen):
    run = FederatedRun(load_config("tiny-smoke", [f"data.path={unseen}", "data.allow_unseen_test_labels=true"]),
                       write=False).prepare_model()
    names = run.test_data.label_names
    assert names == ["a", "b", "c"]
    held = np.concatenate([c.test for c in run.clients])
    labels = run.test_data.labels
    # every a/b test row goes to some client, no 'c' row to any (independently: the rows whose label is trained on)
    assert sorted(held.tolist()) == np.flatnonzero(labels != names.index("c")).tolist()
    assert run.split_report["test_unassigned"] == 10


def test_a_bad_allow_unseen_value_is_refused():
    from fedlora.errors import ConfigError

    with pytest.raises(ConfigError, match="^data.allow_unseen_test_labels:"):
        load_config("tiny-smoke", ["data.allow_unseen_test_labels=maybe"])


def test_own_data_through_a_bundled_config_is_named_by_its_file(tmp_path, capsys, monkeypatch):
    """tiny-smoke naming the bundled debian-sections task (its columns, metrics) but reading the user's file: the
    summary line, summary.json and rounds.png's title name mine.csv and keep the task's kind."""
    from fedlora.llm import plots

    f = tmp_path / "mine.csv"
    f.write_text("text,label\n" + "".join(f"a game to play {i},games\nan audio mixer {i},sound\n" for i in range(30)))
    titles = []
    real = plots.plot_run

    def spy(*args, **kwargs):
        titles.append(plots.run_title(kwargs["method"], kwargs["task"], kwargs["clients"], len(args[0])))
        return real(*args, **kwargs)

    monkeypatch.setattr(plots, "plot_run", spy)
    out = tmp_path / "run"
    assert main(["run", "tiny-smoke", "--set", "data.task=debian-sections", "--set", f"data.path={f}",
                 "--set", "train.rounds=1", "--out", str(out), "--no-progress"]) == 0
    name = "mine.csv (classification, columns of debian-sections)"
    text = capsys.readouterr().out
    assert f"fedavg on {name}: 3 clients" in text, text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == name and summary["task_kind"] == "classification"
    assert titles == [f"fedavg on {name} — 3 clients, 1 round"]
    # config.json keeps the registered task (export rebuilds the task from it)
    assert json.loads((out / "config.json").read_text())["resolved"]["task"] == "debian-sections"
    # fedlora plot's figure and fedlora compare's table name the file too
    from fedlora.llm.runfolder import read_run

    run = read_run(out)
    assert run.data_name == name and run.task == "debian-sections"
    figs = []
    real_curves = plots.curves_figure
    monkeypatch.setattr(plots, "curves_figure", lambda rows, legend, metric, title: figs.append(title) or
                        real_curves(rows, legend, metric, title))
    assert main(["plot", str(out), "--out", str(tmp_path / "plot")]) == 0
    assert figs == [f"{name} — test accuracy, 1 run"]
    assert main(["compare", "tiny-smoke", "--methods", "fedavg", "--lr-grid", "1e-3", "--seeds", "1",
                 "--set", "data.task=debian-sections", "--set", f"data.path={f}", "--set", "train.rounds=1",
                 "--out", str(tmp_path / "cmp")]) == 0
    cmp = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert cmp["task"] == name
    assert f"on {name}," in (tmp_path / "cmp" / "compare.md").read_text().splitlines()[0]


@pytest.mark.parametrize("config,sets,name", [
    ("debian-describe", [], "debian-describe"),  # the bundled set: its own name
    ("debian-describe", ["data.path={f}"], "own.jsonl (generation, columns of debian-describe)"),
    ("tiny-smoke", ["data.path={f}", "data.task=null", "data.text_column=record", "data.label_column=section"],
     "file:{f}"),  # no task named: the file is the task
])
def test_the_dry_run_names_the_data_as_the_run_does(tmp_path, capsys, config, sets, name):
    f = tmp_path / "own.jsonl"
    rows = [{"record": f"package : p{i} | section : {s}", "description": f"tool number {i}", "section": s}
            for i in range(40) for s in (("games", "sound", "mail", "graphics")[i % 4],)]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sets = [s.replace("{f}", str(f)) for s in sets]
    assert main(["run", config, "--dry-run", *[x for s in sets for x in ("--set", s)]]) == 0
    assert json.loads(capsys.readouterr().out)["resolved"]["data"]["task"] == name.replace("{f}", str(f))
