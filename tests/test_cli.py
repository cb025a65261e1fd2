"""The command line as a whole: every command's --help, and every command's --out check.

Commands are discovered from the argparse parser itself, so a command added later is covered
without editing this file (if it needs arguments besides --out, add them to ``REQUIRED_ARGS``).
"""
import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedlora import cli
from fedlora.cli import check_output_dir, main
from fedlora.errors import ConfigError


#: extra argv a command needs to get past argument parsing (none so far)
REQUIRED_ARGS: dict[tuple[str, ...], list[str]] = {("run",): ["tiny-smoke"], ("export",): ["runs/none"],
                                                  ("plot",): ["runs/none"], ("flower", "local"): ["tiny-smoke"],
                                                  ("synthetic", "flower"): ["--method", "fedavg", "--lr", "0.1"],
                                                  ("compare",): ["tiny-smoke", "--methods", "fedavg", "--lr-grid", "1e-3"],
                                                  ("aggregate",): ["--method", "fedavg", "no-adapter", "--weights", "1"]}
#: commands that start a long-running server process and write no results (they take no --out)
LAUNCHERS = {("flower", "superlink"), ("flower", "supernode")}


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """Every (sub)command path of ``parser``, depth first, with its own parser: (), ('synthetic',), …"""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, path + (name,))


COMMANDS = list(_commands(cli._build_parser()))
LEAVES = [(path, p) for path, p in COMMANDS
          if not any(isinstance(a, argparse._SubParsersAction) for a in p._actions)]
WITH_OUT = [path for path, p in LEAVES if any("--out" in a.option_strings for a in p._actions)]


def test_the_walk_finds_every_known_command():
    paths = {path for path, _ in COMMANDS}
    assert {(), ("synthetic",), ("synthetic", "rank-recovery"), ("synthetic", "bilevel-convergence"),
            ("synthetic", "tune"), ("synthetic", "compare")} <= paths
    assert {("flower", "local"), ("flower", "certs"), ("flower", "app")} | LAUNCHERS <= paths
    # every command that runs writes under --out, but those that start a server
    assert set(WITH_OUT) == {path for path, _ in LEAVES} - LAUNCHERS


@pytest.mark.parametrize("path", [path for path, _ in COMMANDS], ids=lambda p: " ".join(p) or "fedlora")
def test_help_of_every_command_exits_0(path, capsys):
    with pytest.raises(SystemExit) as e:
        main([*path, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: fedlora") and "Traceback" not in out


def test_help_as_a_subprocess(tmp_path):
    r = subprocess.run([sys.executable, "-m", "fedlora.cli", "--help"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: fedlora") and "synthetic" in r.stdout and r.stderr == ""


# ---------------------------------------------------------------------------------------------
# --out: checked before any work, one line, exit 2, nothing written

def _bad_outs(tmp: Path) -> dict[str, tuple[str, str]]:
    """name → (path, what the message must say)."""
    f = tmp / "a-file"
    f.write_text("not a folder")
    cases = {"is-a-file": (str(f), "is a file, not a folder"),
             "parent-is-a-file": (str(f / "out"), "which is a file, not a folder"),
             "grandparent-is-a-file": (str(f / "x" / "out"), "which is a file, not a folder")}
    if Path("/proc/self").is_dir():  # Linux: nothing can be created at the top of /proc
        cases["under-proc"] = ("/proc/fedlora-cannot-exist/out", "cannot create the output folder")
    if os.geteuid() != 0:  # root writes into a read-only folder anyway
        ro = tmp / "read-only"
        ro.mkdir()
        ro.chmod(0o500)
        cases["read-only"] = (str(ro), "is not writable")
    return cases


@pytest.fixture
def no_work(monkeypatch):
    """Make every known experiment fail loudly if it starts: the --out check must come first."""
    import fedlora.synthetic.bilevel
    import fedlora.synthetic.compare
    import fedlora.synthetic.rank_recovery
    import fedlora.synthetic.tune

    def boom(*a, **k):
        raise AssertionError("the experiment started before --out was checked")

    import fedlora.llm.compare
    import fedlora.llm.export
    import fedlora.llm.plots  # imported before the patch: it binds read_run at its top, and must not keep `boom`
    import fedlora.llm.runfolder
    import fedlora.llm.runtime

    for mod, fn in ((fedlora.synthetic.rank_recovery, "run_rank_recovery"), (fedlora.synthetic.bilevel, "run_bilevel_convergence"),
                    (fedlora.synthetic.tune, "tune_rank_recovery"), (fedlora.synthetic.compare, "run_compare"),
                    (fedlora.llm.runtime.FederatedRun, "prepare"), (fedlora.llm.export, "export_peft"),
                    (fedlora.llm.runfolder, "read_run"), (fedlora.llm.plots, "read_run"),
                    (fedlora.llm.compare, "run_compare")):
        monkeypatch.setattr(mod, fn, boom)


@pytest.mark.parametrize("path", WITH_OUT, ids=" ".join)
def test_every_command_rejects_a_bad_out_before_any_work(path, tmp_path, capsys, no_work):
    for case, (out, says) in _bad_outs(tmp_path).items():
        before = sorted(p for p in tmp_path.rglob("*"))
        rc = main([*path, *REQUIRED_ARGS.get(path, []), "--out", out])
        err = capsys.readouterr().err
        assert rc == 2, (case, err)
        assert err.startswith("fedlora: error: --out: ") and err.count("\n") == 1, (case, err)
        assert says in err and out in err, (case, err)
        assert sorted(p for p in tmp_path.rglob("*")) == before, case  # nothing written anywhere


def test_check_output_dir_creates_the_folder_and_leaves_nothing_in_it(tmp_path):
    out = check_output_dir(tmp_path / "a" / "b")
    assert out == tmp_path / "a" / "b" and out.is_dir() and list(out.iterdir()) == []
    assert check_output_dir(str(out)) == out  # an existing folder is fine
    with pytest.raises(ConfigError, match=r"^--model-dir: .*is a file, not a folder"):
        (tmp_path / "f").write_text("")
        check_output_dir(tmp_path / "f", flag="--model-dir")
    with pytest.raises(ConfigError, match="^--out: must name an output folder"):
        check_output_dir("")


def test_a_writable_out_still_works(tmp_path, monkeypatch):
    """The check does not get in the way of a real (tiny) run, and leaves only the run's files."""
    out = tmp_path / "new" / "bc"
    assert main(["synthetic", "bilevel-convergence", "--steps", "200", "--out", str(out), "--no-plot"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["metrics.json"]
