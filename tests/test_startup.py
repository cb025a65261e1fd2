"""What a command imports, and when (issue 26 §2): the help, the config listing, a config error and an export
or plot of a missing run folder need no torch; the synthetic commands never import torch._dynamo (torch's
optimizers import it on their first call: ≈ 1 s of start-up, again in every worker process) nor transformers,
nor matplotlib with --no-plot or before their own computation is done; rank-recovery starts its worker process
before it imports torch (the two imports overlap) and, as the `fedlora` script, ends without the interpreter's
teardown; an embedded `fedlora run` (and its dry run) imports no flwr, and matplotlib only to draw rounds.png.
One fresh interpreter per test (the test process itself has imported everything already).
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent("""
    import atexit, contextlib, io, json, os, sys
    from fedlora.cli import main
    import fedlora.synthetic._worker as worker

    seen = {}  # module -> what held when it was first imported

    class Watch:
        def find_spec(self, name, path=None, target=None):
            if name in ("torch", "matplotlib") and name not in seen:
                seen[name] = {"prestarted_workers": len(worker._idle), "printed": printed.getvalue()}
            return None

    sys.meta_path.insert(0, Watch())
    printed = io.StringIO()  # what the command running now has printed so far

    def quiet(argv):
        printed.seek(0)
        printed.truncate()
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(io.StringIO()):
            try:
                return main(argv)
            except SystemExit as e:  # --help
                return e.code

    out = {"light": {}, "synthetic": {}}
    for argv in (["--help"], ["run", "--help"], ["synthetic", "rank-recovery", "--help"], ["run", "--list-configs"],
                 ["run", "no-such-config"], ["export", "no-such-run", "--client", "0", "--out", "exp"],
                 ["plot", "no-such-run", "--out", "plt"], ["aggregate", "--help"],
                 ["aggregate", "no-such-adapter", "--method", "fedavg", "--out", "agg"]):
        out["light"][" ".join(argv)] = [quiet(argv), "torch" in sys.modules]
    out["left_behind"] = sorted(os.listdir("."))
    for argv in (["synthetic", "rank-recovery", "--preset", "paper", "--seeds", "1", "--steps", "20", "--jobs", "2",
                  "--no-plot", "--out", "rr"],
                 ["synthetic", "bilevel-convergence", "--no-plot", "--out", "bc"],
                 ["synthetic", "compare", "--seeds", "1", "--rounds", "2", "--no-plot", "--out", "cmp"]):
        out["synthetic"][argv[1]] = [quiet(argv), "torch._dynamo" in sys.modules, "transformers" in sys.modules,
                                     "matplotlib" in sys.modules]
    out["rank-recovery with its figure"] = quiet(["synthetic", "rank-recovery", "--seeds", "1", "--steps", "20",
                                                  "--jobs", "2", "--out", "rr2"])
    out["seen"] = seen
    print(json.dumps(out), flush=True)
    # the `fedlora` script (main() on sys.argv): it ends without the interpreter's teardown, its output flushed
    atexit.register(lambda: print("TEARDOWN", flush=True))
    sys.argv = ["fedlora", "synthetic", "rank-recovery", "--seeds", "1", "--steps", "10", "--interval", "10", "--jobs",
                "1", "--no-plot", "--out", "rr3"]
    sys.exit(main())
""")


@pytest.mark.long
def test_commands_import_only_what_they_use(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout block-buffered, as in a pipe
    res = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    out = json.loads(next(line for line in lines if line.startswith("{")))
    # each ran (0) or refused its input in one line (2), and torch was not imported for it
    assert out["light"] == {"--help": [0, False], "run --help": [0, False], "synthetic rank-recovery --help": [0, False],
                            "run --list-configs": [0, False], "run no-such-config": [2, False],
                            "export no-such-run --client 0 --out exp": [2, False],
                            "plot no-such-run --out plt": [2, False], "aggregate --help": [0, False],
                            "aggregate no-such-adapter --method fedavg --out agg": [2, False]}
    assert out["left_behind"] == []  # the refused export and plot made no folder
    # no torch._dynamo, transformers, or matplotlib (--no-plot) for a synthetic command
    assert out["synthetic"] == {c: [0, False, False, False] for c in ("rank-recovery", "bilevel-convergence", "compare")}
    # rank-recovery's worker process was started before this process imported torch; matplotlib came only
    # for the figure: once this process's own method (HetLoRA) was done, while PF2LoRA's worker ran
    assert out["seen"]["torch"]["prestarted_workers"] == 1
    assert out["rank-recovery with its figure"] == 0 and (tmp_path / "rr2" / "rank_recovery.png").is_file()
    printed = out["seen"]["matplotlib"]["printed"].splitlines()
    assert [line.split(":")[0] for line in printed] == ["[rank-recovery] hetlora"] * 2 + ["[rank-recovery] pf2lora"]
    assert printed[1].endswith(" s") and printed[2].endswith("(worker process)")
    # the script's command finished (its last line flushed out) and the process ended without the teardown
    assert lines[-1] == f"wrote {'rr3/metrics.json'}" and "TEARDOWN" not in lines
    assert (tmp_path / "rr3" / "metrics.json").is_file()


RUN_PROBE = textwrap.dedent("""
    import contextlib, io, json, sys, traceback
    from fedlora.cli import main

    first = {}  # module -> the functions on the stack when it was first imported

    class Watch:
        def find_spec(self, name, path=None, target=None):
            if name in ("flwr", "matplotlib") and name not in first:
                first[name] = [f.name for f in traceback.extract_stack()]
            return None

    sys.meta_path.insert(0, Watch())
    out = {}
    for what, argv in (("dry run", ["run", "tiny-smoke", "--dry-run"]),
                       ("run", ["run", "tiny-smoke", "--set", "train.rounds=1", "--out", "run", "--no-progress"])):
        with contextlib.redirect_stdout(io.StringIO()):
            out[what] = [main(argv), sorted(first)]
    out["matplotlib imported by"] = first.get("matplotlib", [])
    print(json.dumps(out))
""")


@pytest.mark.long
def test_an_embedded_run_imports_no_flower_and_matplotlib_only_for_its_figure(tmp_path):
    res = subprocess.run([sys.executable, "-c", RUN_PROBE], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.splitlines()[-1])
    assert out["dry run"] == [0, []]  # neither flwr nor matplotlib
    assert out["run"] == [0, ["matplotlib"]]  # no flwr
    assert "plot" in out["matplotlib imported by"]  # Report.plot: matplotlib came to draw rounds.png, not before
