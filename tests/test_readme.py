"""Every code example of the README and of the documentation site runs (issue 8 item 2, issue 16 item 3).

The pages are README.md and every ``docs/**/*.md`` (the site's sources; docs/design.md included).

* Python blocks (```python) are executed as they stand (in a temporary working directory).
* Shell lines (```bash) starting with ``fedlora`` are parsed by the real argument parser; a ``fedlora run`` of a
  bundled config is validated end to end with ``--dry-run`` (the config loads, every field checks),
  and the GLUE walkthrough is run offline up to the download, which must fail in one line naming the
  dataset and how to point at a local copy. Long experiments (rank recovery, compare) are not re-run
  here: their own tests and the measured tables cover them.
* Other shell lines name files that must exist: ``python PATH`` runs a script of this repository, and
  ``make TARGET`` a target of the Makefile.
* TOML and YAML blocks parse.

A page's failing example fails here, and therefore in CI: ``test_a_planted_failing_example_is_caught`` plants
one of each kind in a page of its own and checks that the same checks refuse it.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from fedlora.cli import _build_parser, main
from fedlora.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def blocks(text: str, lang: str) -> list[str]:
    """The fenced code blocks of ``text`` in language ``lang``."""
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def shell_lines(text: str) -> list[str]:
    """The command lines of the ```bash blocks, comments cut off."""
    out = []
    for b in blocks(text, "bash"):
        for ln in b.splitlines():
            ln = ln.split(" #")[0].strip()
            if ln and not ln.startswith("#"):
                out.append(ln)
    return out


def _rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def _collect():
    python, fedlora, other, toml, yml = [], [], [], [], []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        python += [pytest.param(page, i, code, id=f"{_rel(page)}#{i}") for i, code in enumerate(blocks(text, "python"))]
        for ln in shell_lines(text):
            (fedlora if ln.startswith("fedlora ") else other).append(pytest.param(ln, id=f"{_rel(page)}: {ln[:90]}"))
        toml += [pytest.param(b, id=f"{_rel(page)}#toml{i}") for i, b in enumerate(blocks(text, "toml"))]
        yml += [pytest.param(b, id=f"{_rel(page)}#yaml{i}") for i, b in enumerate(blocks(text, "yaml"))]
    return python, fedlora, other, toml, yml


PYTHON, FEDLORA, OTHER, TOML, YAML = _collect()


def run_python_example(code: str, name: str) -> None:
    """Execute one Python example; a method it registers does not stay registered."""
    from fedlora.methods import base

    saved = dict(base._REGISTRY)
    try:
        exec(compile(code, name, "exec"), {"__name__": "__docs_example__"})
    finally:
        base._REGISTRY.clear()
        base._REGISTRY.update(saved)


def check_fedlora_line(line: str, workdir: Path, capsys=None) -> None:
    """Parse a ``fedlora …`` line with the real parser; dry-run a ``fedlora run`` of a bundled config."""
    from fedlora.llm.config import bundled_configs

    argv = shlex.split(line)[1:]
    _build_parser().parse_args(argv)  # SystemExit/ConfigError on a flag the CLI does not have
    if argv[0] == "run" and len(argv) > 1 and argv[1] in bundled_configs() and "--dry-run" not in argv:
        cwd = os.getcwd()
        os.chdir(workdir)
        try:
            # the shipped example csv (examples/packages.csv), where the pages' commands, run in a clone, find it
            if not (workdir / "examples").exists():
                (workdir / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
            rc = main([*argv, "--dry-run"])
        finally:
            os.chdir(cwd)
        assert rc == 0, capsys.readouterr().err if capsys else rc


def check_other_line(line: str) -> None:
    """``python PATH …`` and ``make TARGET`` name what exists; other lines (loops, flwr, pip) are prose."""
    words = shlex.split(line)
    if words[0] == "python" and len(words) > 1 and words[1] != "-m" and not words[1].startswith("-"):
        assert (ROOT / words[1]).is_file(), f"{line}: no file {words[1]}"
    if words[0] == "python" and words[1:2] == ["-m"]:
        mod = words[2]
        assert mod.startswith("fedlora"), f"{line}: not a module of fedlora"
    if words[0] == "make":
        targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
        assert all(w in targets for w in words[1:] if "=" not in w), f"{line}: not a Makefile target"
    if words[0] == ".venv/bin/pytest":
        assert all((ROOT / w).exists() for w in words[1:] if not w.startswith("-")), line


def test_the_pages_have_examples():
    assert len(PAGES) >= 30
    assert len(PYTHON) >= 3 and len(FEDLORA) >= 45
    readme_fedlora = [ln for ln in shell_lines(README) if ln.startswith("fedlora ")]
    assert len(blocks(README, "python")) >= 1 and len(readme_fedlora) >= 5


def test_the_readme_quick_start_names_only_files_that_ship():
    """A file a README command reads (data.path) is in the repository: a newcomer's first try of the line
    as written works in a fresh clone."""
    paths = [m for ln in shell_lines(README) for m in re.findall(r"data\.path=(\S+)", ln)]
    assert paths, "the quick start shows a run on your own file"
    for p in paths:
        assert (ROOT / p).is_file(), f"README names data.path={p}, which does not ship"


def test_every_pages_commands_read_only_files_that_ship():
    """The same for every docs page's commands (the tutorials are followed line by line): a data.path in a
    command is a file of the repository, not a made-up name such as reviews.csv."""
    bad = [f"{_rel(page)}: data.path={m}" for page in PAGES for ln in shell_lines(page.read_text(encoding="utf-8"))
           for m in re.findall(r"data\.path=(\S+)", ln) if not (ROOT / m).is_file()]
    assert not bad, "commands that read a file that does not ship:\n" + "\n".join(bad)


@pytest.mark.parametrize("page,i,code", PYTHON)
def test_python_example_runs(page, i, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_python_example(code, f"{_rel(page)} python block {i}")


@pytest.mark.parametrize("line", FEDLORA)
def test_shell_example_parses_and_bundled_runs_validate(line, tmp_path, capsys):
    check_fedlora_line(line, tmp_path, capsys)


@pytest.mark.parametrize("line", OTHER)
def test_other_shell_lines_name_what_exists(line):
    check_other_line(line)


@pytest.mark.parametrize("block", TOML)
def test_toml_blocks_parse(block):
    tomllib.loads(block)


@pytest.mark.parametrize("block", YAML)
def test_yaml_blocks_parse(block):
    yaml.safe_load(block)


def test_a_planted_failing_example_is_caught(tmp_path):
    page = (
        "# planted\n\n```python\nraise RuntimeError('a failing example')\n```\n\n"
        "```bash\nfedlora run tiny-smoke --no-such-flag\n"
        "fedlora run tiny-smoke --set train.rounds=0\n"
        "python bench/no_such_script.py\n"
        "make no-such-target\n```\n")
    code, = blocks(page, "python")
    with pytest.raises(RuntimeError, match="a failing example"):
        run_python_example(code, "planted")
    bad_flag, bad_value, bad_script, bad_target = shell_lines(page)
    with pytest.raises((SystemExit, ConfigError)):
        check_fedlora_line(bad_flag, tmp_path)
    with pytest.raises(AssertionError):
        check_fedlora_line(bad_value, tmp_path)
    for line in (bad_script, bad_target):
        with pytest.raises(AssertionError):
            check_other_line(line)


def test_glue_walkthrough_offline_stops_in_one_line_naming_the_local_copy(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    res = subprocess.run([sys.executable, "-m", "fedlora.cli", "run", "glue-sst2-pf2lora", "--out", str(tmp_path / "o")],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert res.returncode == 2, res.stderr[-2000:]
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedlora: error: ") and "Traceback" not in res.stderr
    assert "glue" in err[0] and "data.path" in err[0]
