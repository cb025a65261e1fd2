"""Every code example of the README runs (issue 8 item 2).

* Python blocks are executed as they stand (in a temporary working directory).
* Shell lines starting with ``fedlora`` are parsed by the real argument parser; a ``fedlora run`` of a
  bundled config is validated end to end with ``--dry-run`` (the config loads, every field checks),
  and the GLUE walkthrough is run offline up to the download, which must fail in one line naming the
  dataset and how to point at a local copy. Long experiments (rank recovery, compare) are not re-run
  here: their own tests and the README's measured tables cover them.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from fedlora.cli import _build_parser, main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


PYTHON = _blocks("python")
SHELL = [ln.split(" #")[0].strip() for b in _blocks("bash") for ln in b.splitlines()]
FEDLORA = [ln for ln in SHELL if ln.startswith("fedlora ")]


def test_the_readme_has_examples():
    assert len(PYTHON) >= 1 and len(FEDLORA) >= 8


@pytest.mark.parametrize("i", range(len(PYTHON)))
def test_python_example_runs(i, tmp_path, monkeypatch):
    from fedlora.methods import base

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))  # a method an example registers stays there
    exec(compile(PYTHON[i], f"README.md python block {i}", "exec"), {"__name__": "__readme__"})


@pytest.mark.parametrize("line", FEDLORA)
def test_shell_example_parses_and_bundled_runs_validate(line, tmp_path, monkeypatch, capsys):
    from fedlora.llm.config import bundled_configs

    argv = shlex.split(line)[1:]
    _build_parser().parse_args(argv)  # SystemExit/ConfigError on a flag the CLI does not have
    if argv[0] == "run" and len(argv) > 1 and argv[1] in bundled_configs() and "--dry-run" not in argv:
        monkeypatch.chdir(tmp_path)
        # the own-csv example's file, as its columns say (a dry run reads local data)
        (tmp_path / "reviews.csv").write_text("sentence,sentiment\n" + "".join(
            f"lovely film {i},pos\nawful film {i},neg\n" for i in range(40)))
        assert main([*argv, "--dry-run"]) == 0, capsys.readouterr().err


def test_glue_walkthrough_offline_stops_in_one_line_naming_the_local_copy(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    res = subprocess.run([sys.executable, "-m", "fedlora.cli", "run", "glue-sst2-pf2lora", "--out", str(tmp_path / "o")],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert res.returncode == 2, res.stderr[-2000:]
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedlora: error: ") and "Traceback" not in res.stderr
    assert "glue" in err[0] and "data.path" in err[0]
