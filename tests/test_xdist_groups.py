"""How ``make test`` spreads the suite over the cores (tests/conftest.py, issue 26): the tests of one
``xdist_group`` — those sharing an expensive module fixture — run in one worker process (with pytest 9 that
needs conftest's fix: xdist 3.8 writes the group where pytest no longer reads it), and tests marked ``long``
are handed out first (with ``--no-loadscope-reorder``, as ``make test`` runs it). One pytest run with two workers over a small suite written here, whose conftest is
this suite's own (its hooks, from tests/_xdist_order.py)."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

CONFTEST = Path(__file__).with_name("conftest.py")
ORDER = Path(__file__).with_name("_xdist_order.py")

SUITE = textwrap.dedent("""
    import json, os, time
    import pytest

    def _log(name):
        with open(os.environ["XDIST_PROBE_LOG"], "a") as f:
            f.write(json.dumps([os.environ.get("PYTEST_XDIST_WORKER"), name, time.monotonic()]) + "\\n")

    @pytest.mark.parametrize("i", range(6))
    def test_free(i):
        _log(f"free{i}")
        time.sleep(0.2)

    @pytest.mark.xdist_group("shared")
    @pytest.mark.parametrize("i", range(4))
    def test_grouped(i):
        _log(f"grouped{i}")
        time.sleep(0.1)

    @pytest.mark.long
    @pytest.mark.parametrize("i", range(2))
    def test_long(i):
        _log(f"long{i}")
        time.sleep(0.5)
""")


def test_a_group_runs_in_one_worker_and_long_tests_go_first(tmp_path):
    # the suite's own hooks (tests/conftest.py imports them from tests/_xdist_order.py, which needs no torch)
    assert CONFTEST.read_text().count("from _xdist_order import pytest_collection_modifyitems") == 1
    (tmp_path / "conftest.py").write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('fedlora_suite_order', {str(ORDER)!r})\n"
        "suite = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(suite)\n"
        "pytest_collection_modifyitems = suite.pytest_collection_modifyitems\n")
    (tmp_path / "test_probe.py").write_text(SUITE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    long: started first\n")
    log = tmp_path / "log.jsonl"
    res = subprocess.run([str(Path(sys.executable).with_name("pytest")), "-q", "-p", "no:cacheprovider", "-n", "2",
                          "--dist", "loadgroup", "--no-loadscope-reorder", "test_probe.py"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env={**__import__("os").environ, "XDIST_PROBE_LOG": str(log)})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(runs) == 12
    workers = {name: w for w, name, _ in runs}
    assert set(workers.values()) == {"gw0", "gw1"}  # it really ran in two workers
    assert len({workers[f"grouped{i}"] for i in range(4)}) == 1, workers  # the group stayed together
    first = {}
    for w, name, t in sorted(runs, key=lambda r: r[2]):
        first.setdefault(w, name)
    # collected last, run first: one on each worker (xdist's default would hand out the group first, the
    # scope with the most tests, whence --no-loadscope-reorder in the Makefile)
    assert sorted(first.values()) == ["long0", "long1"], (first, runs)
    # then the group (one unit of work sharing a fixture), before the free tests: at most one free test (handed to
    # the other worker at the same time) starts before it; the group collected first of the free tests would come last
    start = {name: t for _, name, t in runs}
    free = sorted(start[f"free{i}"] for i in range(6))
    assert start["grouped0"] < free[1], runs
