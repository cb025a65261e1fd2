"""What a command imports (issue 26 §2): the help, the config listing and a config error need no torch; the
synthetic commands never import torch._dynamo (torch's optimizers import it on their first call: ≈ 1 s of
start-up, again in every worker process) nor transformers. One fresh interpreter for all of it (the test
process itself has imported everything already)."""
import json
import subprocess
import sys
import textwrap

PROBE = textwrap.dedent("""
    import contextlib, io, json, sys
    from fedlora.cli import main

    def quiet(argv):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return main(argv)

    out = {"light": {}, "synthetic": {}}
    for argv in (["run", "--list-configs"], ["run", "no-such-config"]):
        out["light"][" ".join(argv)] = [quiet(argv), "torch" in sys.modules]
    for argv in (["synthetic", "rank-recovery", "--preset", "paper", "--seeds", "1", "--steps", "20", "--jobs", "1",
                  "--no-plot", "--out", "rr"],
                 ["synthetic", "bilevel-convergence", "--no-plot", "--out", "bc"],
                 ["synthetic", "compare", "--seeds", "1", "--rounds", "2", "--no-plot", "--out", "cmp"]):
        out["synthetic"][argv[1]] = [quiet(argv), "torch._dynamo" in sys.modules, "transformers" in sys.modules]
    print(json.dumps(out))
""")


def test_commands_import_only_what_they_use(tmp_path):
    res = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.splitlines()[-1])
    # each ran (0) or refused its input in one line (2), and torch was not imported for it
    assert out["light"] == {"run --list-configs": [0, False], "run no-such-config": [2, False]}
    assert out["synthetic"] == {c: [0, False, False] for c in ("rank-recovery", "bilevel-convergence", "compare")}


def test_help_imports_no_torch():
    for argv in (["--help"], ["run", "--help"], ["synthetic", "rank-recovery", "--help"]):
        code = f"import sys\nfrom fedlora.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass\n" \
               f"print('torch' in sys.modules, file=sys.stderr)"
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert res.stderr.strip().splitlines()[-1] == "False", (argv, res.stderr[-500:])
