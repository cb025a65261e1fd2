"""The suite's two tiers (issue 26): ``make test`` runs every test but those marked ``long``, ``make test-long``
runs exactly those, and CI (.ci/run) runs both — the second even when the first fails — and fails if either
fails. Nothing a tier leaves out is lost in CI."""
from __future__ import annotations

import os
import shlex
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _pytest_line(target: str) -> list[str]:
    """The pytest command ``make TARGET`` runs (``make -n``: printed, not run; the env step is skipped)."""
    out = subprocess.run(["make", "-n", "-o", ".venv/.installed", target], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    lines = [shlex.split(line) for line in out.splitlines() if "/bin/pytest " in line]
    assert len(lines) == 1, out
    return lines[0]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_test_leaves_out_exactly_the_long_tier_and_make_test_long_runs_it():
    fast, long_ = _pytest_line("test"), _pytest_line("test-long")
    assert fast[fast.index("-m") + 1] == "not long" and long_[long_.index("-m") + 1] == "long"
    # the same pytest otherwise: the same workers, grouping and order
    strip = lambda argv: [a for i, a in enumerate(argv) if a != "-m" and (i == 0 or argv[i - 1] != "-m")]  # noqa: E731
    assert strip(fast) == strip(long_)
    assert "loadgroup" in fast and "--no-loadscope-reorder" in fast


@pytest.mark.parametrize("fails, code", [((), 0), (("test",), 1), (("test-long",), 1), (("test", "test-long"), 1)])
def test_ci_runs_both_tiers_and_fails_if_either_fails(fails, code, tmp_path):
    """.ci/run with a stand-in `make` that logs its targets and fails the ones named: the docs, then both tiers,
    always both; the exit status is non-zero when a tier failed."""
    log = tmp_path / "make.log"
    fake = tmp_path / "bin" / "make"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "$1" >> {shlex.quote(str(log))}\n'
                    f'case " $FAIL " in *" $1 "*) exit 2;; esac\nexit 0\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}", "FAIL": " ".join(fails)}
    res = subprocess.run(["bash", str(ROOT / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60)
    assert log.read_text().split() == ["docs", "test", "test-long"], res.stdout + res.stderr
    assert (res.returncode != 0) == bool(code), (res.returncode, res.stdout, res.stderr)
    assert "ci: fast tier (make test)" in res.stdout and "long tier (make test-long)" in res.stdout
