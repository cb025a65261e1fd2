"""``fedlora compare`` (issue 15 item 7): each method's step size is the argmax of the clients' validation score
over its grid (mean over seeds), the test numbers reported are those of the chosen runs only and are read after
every choice is made, the table is what the runs' summaries say, bad input is one line."""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from fedlora.cli import main
from fedlora.errors import ConfigError
from fedlora.llm import compare as C

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_lr_grids_common_and_per_method():
    assert C.parse_lr_grid(["5e-3,1e-3"], ["fedavg", "rolora"]) == {"fedavg": (1e-3, 5e-3), "rolora": (1e-3, 5e-3)}
    assert C.parse_lr_grid(["1e-3", "rolora=0.1,0.2"], ["fedavg", "rolora"]) == {"fedavg": (1e-3,), "rolora": (0.1, 0.2)}
    for bad, match in ((["x"], "'x' is not a number"), (["0,1e-3"], "positive numbers"), (["1e-3,1e-3"], "twice"),
                       (["fedavgg=1e-3"], "not one of --methods"), (["rolora=1e-3"], "no step sizes for fedavg"),
                       (["1e-3", "2e-3"], "one grid for every method"), ([","], "no step size given")):
        with pytest.raises(ConfigError, match=match):
            C.parse_lr_grid(bad, ["fedavg", "rolora"])


def test_the_choice_is_the_best_mean_validation_score_ties_to_the_smaller_step():
    assert C.choose_step_size({1e-3: [0.5, 0.7], 1e-2: [0.9, 0.2], 1e-1: [0.6, 0.55]}) == 1e-3  # means .6, .55, .575
    assert C.choose_step_size({1e-3: [0.5], 1e-2: [0.5]}) == 1e-3  # tie
    assert C.choose_step_size({1e-3: [0.1, 0.1], 1e-2: [0.9, math.nan]}) == 1e-3  # a diverged seed: the worst
    assert C.choose_step_size({1e-3: [math.nan], 1e-2: [math.nan]}) == 1e-3


def test_compare_chooses_on_validation_and_reports_the_chosen_runs(tmp_path, monkeypatch, capsys):
    """A real comparison (tiny random RoBERTa, 3 clients, 2 step sizes, 2 seeds): every choice is the
    validation argmax recomputed from the runs' own summary.json; test numbers are read only for the chosen
    runs and only after all choices are made; the table's numbers are those runs' reported numbers."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    events = []
    real_choose, real_read = C.choose_step_size, C.read_test

    def choose(val):
        events.append(("choose", dict(val)))
        return real_choose(val)

    def read(run_dir, metric):
        events.append(("read_test", str(run_dir)))
        return real_read(run_dir, metric)

    monkeypatch.setattr(C, "choose_step_size", choose)
    monkeypatch.setattr(C, "read_test", read)
    out = tmp_path / "cmp"
    assert main(["compare", "tiny-smoke", "--methods", "fedavg,pf2lora", "--lr-grid", "1e-3,5e-2", "--seeds", "2",
                 "--set", "train.rounds=2", "--out", str(out)]) == 0
    res = json.loads((out / "compare.json").read_text())
    assert res["metric"] == "accuracy" and res["seeds"] == [0, 1]
    # the model the runs trained (tiny-smoke's from_config), not model.name (the tokenizer's, MiniLM)
    assert res["model"] == "a random roberta (2 layers, width 32)"
    assert (out / "compare.md").read_text().startswith("# `fedlora compare`: a random roberta (2 layers, width 32) on ")
    assert any(row["lr"] != 1e-3 for row in res["methods"])  # a choice other than the grid's first (PF2LoRA's)
    kinds = [e[0] for e in events]
    assert kinds == ["choose", "choose"] + ["read_test"] * 4  # every choice before any test number
    for row in res["methods"]:
        m = row["method"]
        val = {}
        for lr in (1e-3, 5e-2):
            scores = []
            for s in (0, 1):
                summ = json.loads((out / "runs" / m / f"lr_{lr:g}" / f"seed_{s}" / "summary.json").read_text())
                per = [c["val"]["accuracy"] for c in summ["final_clients"].values() if c["val"]]
                scores.append(sum(per) / len(per))
            val[lr] = statistics.fmean(scores)
            assert row["val"][f"{lr:g}"] == pytest.approx(scores, abs=1e-12)
        best = max(val.values())
        assert row["lr"] == min(lr for lr, v in val.items() if v == best)  # the validation argmax
        chosen = [out / "runs" / m / f"lr_{row['lr']:g}" / f"seed_{s}" for s in (0, 1)]
        assert [e[1] for e in events if e[0] == "read_test" and f"/{m}/" in e[1]] == [str(c) for c in chosen]
        tests = [json.loads((c / "summary.json").read_text())["final_test"]["mean"]["accuracy"] for c in chosen]
        assert row["test_per_seed"] == tests
        assert row["test_mean"] == pytest.approx(statistics.fmean(tests), abs=1e-12)
        assert row["test_std"] == pytest.approx(statistics.stdev(tests), abs=1e-12)
        glob = [json.loads((c / "summary.json").read_text()).get("final_global", {}).get("accuracy") for c in chosen]
        if m == "fedavg":  # a global model: its mean ± std over the seeds too
            assert row["global_mean"] == pytest.approx(statistics.fmean(glob), abs=1e-12)
            assert row["global_std"] == pytest.approx(statistics.stdev(glob), abs=1e-12)
        # the seed replicates are different runs: each folder's config has its own seed, and what the seed
        # decides (split, initialisation, batches) gives each replicate its own numbers
        for lr in (1e-3, 5e-2):
            reps = [out / "runs" / m / f"lr_{lr:g}" / f"seed_{s}" for s in (0, 1)]
            assert [json.loads((r / "config.json").read_text())["config"]["seed"] for r in reps] == [0, 1]
            losses = [[json.loads(line)["train_loss"] for line in (r / "rounds.jsonl").read_text().splitlines()
                       if "train_loss" in json.loads(line)] for r in reps]
            assert losses[0] and losses[0] != losses[1], (m, lr)
    table = (out / "compare.md").read_text()
    assert "| fedavg | **" in table and "| pf2lora | **" in table
    assert (out / "compare.png").stat().st_size > 10_000
    assert "wrote" in capsys.readouterr().out


def test_bad_compare_input_is_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "cmp"
    cases = [
        (["--methods", "fedavgg", "--lr-grid", "1e-3"], "unknown method 'fedavgg'"),
        (["--methods", "fedavg,fedavg", "--lr-grid", "1e-3"], "listed twice"),
        (["--methods", "fedavg", "--lr-grid", "fast"], "'fast' is not a number"),
        (["--methods", "fedavg", "--lr-grid", "1e-3", "--seeds", "0"], "--seeds: at least 1"),
        (["--methods", "fedavg", "--lr-grid", "1e-3", "--set", "federation.val_fraction=0"], "val_fraction is 0"),
        (["--methods", "fedavg", "--lr-grid", "1e-3", "--set", "train.rounds=0"], "train.rounds"),
        (["--methods", "fedavg", "--lr-grid", "1e-3", "--jobs", "0"], "--jobs: the runs at once, an integer ≥ 1, got 0"),
        (["--methods", "fedavg", "--lr-grid", "1e-3", "--jobs", "2", "--progress"], "needs --jobs 1"),
        (["--methods", "fedavg", "--lr-grid", "1e-3", "--resume", "--overwrite"], "--resume keeps the finished runs"),
    ]
    for args, match in cases:
        assert main(["compare", "tiny-smoke", *args, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert match in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists()
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["compare", "tiny-smoke", "--methods", "fedavg", "--lr-grid", "1e-3", "--out", str(out)]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert main(["compare", "tiny-smoke", "--methods", "fedavg", "--lr-grid", "1e-3", "--resume", "--out", str(out)]) == 2
    err = capsys.readouterr().err  # --resume never touches a folder of other files, and says so as itself
    assert "--resume goes on only in a folder of this command's results" in err and "notes.txt" in err
    assert (out / "notes.txt").read_text() == "mine"


def test_a_config_of_one_method_compares_others_with_their_own_defaults(tmp_path, monkeypatch):
    """squad-pf2lora carries PF2LoRA's options (client_rank, lower_lr): FedAvg-LoRA beside it runs with its own
    defaults, PF2LoRA with the config's — every run's config.json says so."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "cmp"
    assert main(["compare", "squad-pf2lora", "--methods", "fedavg,pf2lora", "--lr-grid", "1e-3", "--seeds", "1",
                 "--set", "tiny=true", "--set", "train.rounds=1", "--set", "federation.clients=2",
                 "--set", "data.max_train_samples=40", "--set", "data.max_test_samples=12", "--out", str(out)]) == 0
    cfg = {m: json.loads((out / "runs" / m / "lr_0.001" / "seed_0" / "config.json").read_text())["config"]["method"]
           for m in ("fedavg", "pf2lora")}
    assert cfg["fedavg"]["options"] == {} and cfg["pf2lora"]["options"]["client_rank"] == 4
    assert cfg["fedavg"]["lr"] == cfg["pf2lora"]["lr"] == 1e-3


# --- --grid: any config key's values crossed with the step sizes (issue 29 item 5) ---------------------------
def test_value_grid_parsing_sorts_numbers_and_keeps_brackets():
    g = C.parse_value_grid(["privacy.clip_norm=10,2,5", "model.target_modules=[query, value],[query]"])
    assert list(g) == ["privacy.clip_norm", "model.target_modules"]
    assert g["privacy.clip_norm"] == [("2", 2), ("5", 5), ("10", 10)]  # numbers sorted: ties go to the smaller
    assert g["model.target_modules"] == [("[query, value]", ["query", "value"]), ("[query]", ["query"])]
    assert C._folder_part("model.target_modules", ["query", "value"]) == "model.target_modules___query___value__"


def test_the_choice_over_pairs_is_the_joint_argmax_not_the_marginals():
    """(lr, C index) candidates: lr 1e-3 has the best mean over its C values and C index 0 the best over the step
    sizes, yet the best pair is (1e-2, 1); ties go to the smaller step, then the earlier value."""
    val = {(1e-3, 0): [0.6], (1e-3, 1): [0.6], (1e-2, 0): [0.6], (1e-2, 1): [0.7], (1e-1, 0): [0.9, 0.3],
           (1e-1, 1): [0.1]}
    assert C.choose_step_size(val) == (1e-2, 1)
    assert C.choose_step_size({(1e-2, 1): [0.5], (1e-2, 0): [0.5], (1e-3, 1): [0.5]}) == (1e-3, 1)
    assert C.choose_step_size({(1e-3, 0): [math.nan], (1e-3, 1): [0.0]}) == (1e-3, 1)


def test_compare_grid_chooses_the_best_pair_on_validation(tmp_path, monkeypatch):
    """tiny-smoke with sample-level DP (σ fixed): the step size crossed with privacy.clip_norm. Every run's
    folder names its pair and its config.json holds it; the choice is the argmax of the validation means
    recomputed from the four pairs' summary.json (two seeds each); the test numbers are the chosen pair's runs'."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "cmp"
    sets = ["train.rounds=2", "privacy.level=sample", "privacy.noise_multiplier=0.3", "privacy.delta=1e-5"]
    assert main(["compare", "tiny-smoke", "--methods", "fedavg", "--lr-grid", "1e-3,5e-2", "--grid",
                 "privacy.clip_norm=5,0.05", "--seeds", "2", *[x for s in sets for x in ("--set", s)],
                 "--out", str(out)]) == 0
    res = json.loads((out / "compare.json").read_text())
    assert res["grid"] == {"privacy.clip_norm": [0.05, 5]} and "--grid privacy.clip_norm=5,0.05" in res["command"]
    row, = res["methods"]
    val, tests = {}, {}
    for lr in (1e-3, 5e-2):
        for c in (0.05, 5):
            scores = []
            for s in (0, 1):
                run = out / "runs" / "fedavg" / f"lr_{lr:g}" / f"privacy.clip_norm_{c:g}" / f"seed_{s}"
                cfg = json.loads((run / "config.json").read_text())["config"]
                assert (cfg["method"]["lr"], cfg["privacy"]["clip_norm"], cfg["seed"]) == (lr, c, s)  # what it ran
                summ = json.loads((run / "summary.json").read_text())
                assert summ["privacy"]["clip_norm"] == c
                per = [v["val"]["accuracy"] for v in summ["final_clients"].values() if v["val"]]
                scores.append(sum(per) / len(per))
                tests.setdefault((lr, c), []).append(summ["final_test"]["mean"]["accuracy"])
            assert row["val"][f"{lr:g} privacy.clip_norm={c:g}"] == pytest.approx(scores, abs=1e-12)
            val[lr, c] = statistics.fmean(scores)
    best = max(val.values())
    assert len(set(val.values())) > 1  # the grid matters: not every pair scores the same
    assert (row["lr"], row["values"]["privacy.clip_norm"]) == min(k for k, v in val.items() if v == best)
    assert row["test_per_seed"] == tests[row["lr"], row["values"]["privacy.clip_norm"]]
    assert row["runs"] == [str(out / "runs" / "fedavg" / f"lr_{row['lr']:g}" /
                               f"privacy.clip_norm_{row['values']['privacy.clip_norm']:g}" / f"seed_{s}") for s in (0, 1)]
    table = (out / "compare.md").read_text()
    assert "| privacy.clip_norm (grid) |" in table
    assert f"**{row['values']['privacy.clip_norm']:g}** (0.05, 5)" in table
    assert (out / "compare.png").stat().st_size > 10_000


def test_without_grid_compare_json_has_no_grid_fields(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "cmp"
    assert main(["compare", "tiny-smoke", "--methods", "fedavg", "--lr-grid", "1e-3", "--seeds", "1", "--set",
                 "train.rounds=1", "--out", str(out)]) == 0
    res = json.loads((out / "compare.json").read_text())
    assert "grid" not in res and "values" not in res["methods"][0] and list(res["methods"][0]["val"]) == ["0.001"]
    assert [p.relative_to(out).as_posix() for p in (out / "runs").glob("*/*/*")] == ["runs/fedavg/lr_0.001/seed_0"]


def test_bad_grid_input_is_one_line_before_any_run(tmp_path, capsys):
    out = tmp_path / "cmp"
    dp = ["--set", "privacy.level=sample", "--set", "privacy.noise_multiplier=0.5"]
    cases = [
        (["--grid", "privacy.clip_norm"], "expected KEY=V1,V2"),
        (["--grid", "privacy.clip_norm="], "no value given"),
        (["--grid", "privacy.clip_norm=1,1.0"], "a value is listed twice"),
        (["--grid", "train.rounds=1", "--grid", "train.rounds=2"], "the key is given twice"),
        (["--grid", "method.lr=1e-3,1e-2"], "give its values with --lr-grid"),
        (["--grid", "seed=1,2"], "give its values with --seeds"),
        (["--grid", "train.rounds=1,2", "--set", "train.rounds=3"], "--set train.rounds sets it too"),
        (["--grid", "privacy.clip_nrm=1,2"], "unknown key 'privacy.clip_nrm'"),
        (["--grid", "privacy.clip_norm=1,-2", *dp], "--grid privacy.clip_norm=-2: privacy.clip_norm"),
        (["--grid", "train.rounds=2,zero"], "--grid train.rounds=zero: "),
    ]
    for args, match in cases:
        assert main(["compare", "tiny-smoke", "--methods", "fedavg", "--lr-grid", "1e-3", *args,
                     "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert match in err and len(err.strip().splitlines()) == 1, (args, err)
        assert not out.exists()


def test_resume_keeps_the_finished_runs_of_the_same_settings_and_runs_only_the_rest(tmp_path, monkeypatch, capsys):
    """``--resume`` over a smaller compare: its finished run is read, not run (its files untouched), a stopped run is
    made afresh, only the new runs run — and compare.json is what one compare of the whole grid gives."""
    from fedlora.llm.config import load_config
    from fedlora.llm.runtime import FederatedRun

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ran, real_run = [], FederatedRun.run

    def run(self, *a, **k):
        ran.append(Path(self.cfg.output_dir).relative_to(tmp_path).as_posix())
        return real_run(self, *a, **k)

    monkeypatch.setattr(FederatedRun, "run", run)
    base = ["compare", "tiny-smoke", "--methods", "fedavg", "--set", "train.rounds=1"]
    small, grown = ["--lr-grid", "1e-3,5e-2", "--seeds", "1"], ["--lr-grid", "1e-3,5e-2", "--seeds", "2"]
    assert main([*base, *small, "--out", str(tmp_path / "cmp")]) == 0
    kept = tmp_path / "cmp" / "runs" / "fedavg" / "lr_0.001" / "seed_0"
    stopped = tmp_path / "cmp" / "runs" / "fedavg" / "lr_0.05" / "seed_0"
    before = (kept / "summary.json").stat().st_mtime_ns, (kept / "rounds.jsonl").read_bytes()
    table = (tmp_path / "cmp" / "compare.md").read_text().split("\n| fedavg ")[1].split("\n")[0]
    capsys.readouterr()
    assert main([*base, *small, "--report", "--out", str(tmp_path / "cmp")]) == 0  # all finished: compare's own row
    assert "\n| fedavg " + table + "\n" in capsys.readouterr().out
    state = json.loads((stopped / "run.json").read_text())
    (stopped / "run.json").write_text(json.dumps({**state, "status": "interrupted"}))  # as a Ctrl-C leaves it
    ran.clear()
    assert main([*base, *small, "--report", "--out", str(tmp_path / "cmp")]) == 2  # a report runs nor removes any
    assert "no method of --methods has all its runs finished" in capsys.readouterr().err and ran == []
    assert (stopped / "run.json").is_file()
    assert main([*base, *grown, "--out", str(tmp_path / "cmp")]) == 2  # without --resume: refused, nothing run
    assert main([*base, *grown, "--resume", "--out", str(tmp_path / "cmp")]) == 0
    assert sorted(ran) == ["cmp/runs/fedavg/lr_0.001/seed_1", "cmp/runs/fedavg/lr_0.05/seed_0",
                           "cmp/runs/fedavg/lr_0.05/seed_1"]
    assert ((kept / "summary.json").stat().st_mtime_ns, (kept / "rounds.jsonl").read_bytes()) == before
    assert main([*base, *grown, "--out", str(tmp_path / "whole")]) == 0

    def read(d):
        text = (tmp_path / d / "compare.json").read_text().replace(str(tmp_path / d), "OUT")
        return _without_wall({k: v for k, v in json.loads(text).items() if k != "command"})

    assert read("cmp") == read("whole")
    # a finished run is kept only for exactly its own settings
    same = load_config("tiny-smoke", ["train.rounds=1", "method.lr=0.001", "seed=0", f"output_dir={kept}"])
    assert C.finished_run(same) is not None
    assert C.finished_run(load_config("tiny-smoke", ["train.rounds=2", "method.lr=0.001", "seed=0",
                                                     f"output_dir={kept}"])) is None
    # a run written before a field existed (its config.json lacks it) is read with the field at its default: kept
    info = json.loads((kept / "config.json").read_text())
    del info["config"]["privacy"]["secagg"]["num_shares"]
    (kept / "config.json").write_text(json.dumps(info))
    assert C.finished_run(same) is not None
    assert C.finished_run(load_config("tiny-smoke", ["train.rounds=2", "method.lr=0.001", "seed=0",
                                                     f"output_dir={kept}"])) is None


def _without_wall(x):
    """``x`` without its wall-clock fields (``wall_s``, ``wall_s_*``): what must not depend on how runs were spread."""
    if isinstance(x, dict):
        return {k: _without_wall(v) for k, v in x.items() if not k.startswith("wall_s")}
    if isinstance(x, list):
        return [_without_wall(v) for v in x]
    return x


@pytest.mark.long  # two worker processes start (spawn: ≈ 5 s of imports each) besides the one-process compare
def test_jobs_spread_the_runs_over_processes_and_change_no_number(tmp_path, monkeypatch):
    """``--jobs 2``: the same compare.json (every validation score, choice and test number) and the same round
    records of every run, to the bit, as ``--jobs 1`` — and with ``--jobs 2`` no run ran in this process."""
    from fedlora.llm.runtime import FederatedRun

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    here, real_run = [], FederatedRun.run

    def run(self, *a, **k):
        here.append(self.cfg.output_dir)
        return real_run(self, *a, **k)

    monkeypatch.setattr(FederatedRun, "run", run)
    args = ["compare", "tiny-smoke", "--methods", "fedavg,ffa", "--lr-grid", "1e-3,5e-2", "--seeds", "1",
            "--set", "train.rounds=1"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    assert len(here) == 4
    assert main([*args, "--jobs", "2", "--out", str(tmp_path / "two")]) == 0
    assert len(here) == 4  # the four runs of --jobs 2 ran in the workers

    def read(d):
        text = (tmp_path / d / "compare.json").read_text().replace(str(tmp_path / d), "OUT")
        return _without_wall({k: v for k, v in json.loads(text).items() if k != "command"})

    assert read("one") == read("two")
    runs = sorted((tmp_path / "one" / "runs").glob("*/*/seed_0"))
    assert len(runs) == 4
    for run_dir in runs:
        twin = tmp_path / "two" / run_dir.relative_to(tmp_path / "one")
        recs = [[_without_wall(json.loads(line)) for line in (r / "rounds.jsonl").read_text().splitlines()]
                for r in (run_dir, twin)]
        assert len(recs[0]) == 2 and recs[0] == recs[1], run_dir
