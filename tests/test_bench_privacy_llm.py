"""bench/privacy_utility_llm.py (issue 29 item 5, on real text): its whole path on tiny-smoke in seconds — one
compare per ε (ε = ∞ without DP, a finite ε with sample-level DP at that target and δ = 1e-5, C chosen from the
grid), FFA-LoRA's step-size grid 10× the others', the table's numbers those of the chosen runs, the verdict per
ε, --resume keeping finished ε folders; and the verdict's arithmetic on hand-made rows."""
import json
import math
from pathlib import Path

import pytest

from fedlora.errors import ConfigError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _script():
    from _run_helpers import load_script

    return load_script("bench/privacy_utility_llm.py")


# every client's whole share in each step (q = 1): σ's calibration then takes milliseconds, not seconds per run
ARGS = ["--config", "tiny-smoke", "--methods", "fedavg,ffa", "--epsilons", "inf,3", "--seeds", "1", "--lr-grid",
        "1e-3", "--clip-norms", "0.05,5", "--rounds", "2", "--local-steps", "2", "--set", "train.batch_size=64"]


@pytest.mark.long  # a bench script's smoke run, as the other bench smokes (eight tiny-smoke runs: 6–14 s)
def test_smoke_sweep_reports_the_chosen_runs_and_the_verdict(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from fedlora.llm.runtime import FederatedRun

    mod = _script()
    out = tmp_path / "sweep"
    here = []
    monkeypatch.setattr(FederatedRun, "run", lambda self, *a, **k: here.append(self) or None)
    assert mod.main(ARGS + ["--jobs", "2", "--out", str(out)]) == 0
    assert here == []  # --jobs 2: every run in compare's worker processes, none in this one
    res = json.loads((out / "privacy_utility_llm.json").read_text())
    assert res["settings"]["epsilons"] == ["inf", 3.0] and res["runs"] == 2 + 2 * 2
    rows = {(r["method"], r["epsilon"]): r for r in res["rows"]}
    assert set(rows) == {("fedavg", "inf"), ("ffa", "inf"), ("fedavg", 3.0), ("ffa", 3.0)}
    for (m, e), r in rows.items():
        folder = out / f"eps_{e if e == 'inf' else '3'}"
        cmp = json.loads((folder / "compare.json").read_text())
        crow = next(x for x in cmp["methods"] if x["method"] == m)
        assert (r["test_mean"], r["lr"], r["runs"]) == (crow["test_mean"], crow["lr"], crow["runs"])
        # FFA-LoRA's grid is the others' × 10
        assert crow["grid"] == ([1e-2] if m == "ffa" else [1e-3])
        run, = crow["runs"]
        cfg = json.loads((Path(run) / "config.json").read_text())["config"]
        summ = json.loads((Path(run) / "summary.json").read_text())
        assert cfg["method"]["name"] == m and cfg["method"]["lr"] == r["lr"] and cfg["train"]["rounds"] == 2
        assert r["test_mean"] == summ["final_test"]["mean"]["accuracy"]
        if e == "inf":  # no DP, no clipping grid
            assert cfg["privacy"]["level"] == "none" and summ.get("privacy") is None
            assert r["clip_norm"] is None and r["epsilon_reached"] is None and "grid" not in cmp
        else:  # the run that was reported ran at the chosen C, ε and δ, and reached ε = 3
            p = cfg["privacy"]
            assert (p["level"], p["target_epsilon"], p["delta"]) == ("sample", 3.0, 1e-5)
            assert p["clip_norm"] == r["clip_norm"] == crow["values"]["privacy.clip_norm"]
            assert cmp["grid"] == {"privacy.clip_norm": [0.05, 5]}
            assert r["epsilon_reached"] == summ["privacy"]["epsilon"] and 3.0 - 1e-4 < r["epsilon_reached"] <= 3.0
            assert r["sigma"] == summ["privacy"]["noise_multiplier"] > 0
            assert r["drop"] == pytest.approx(rows[m, "inf"]["test_mean"] - r["test_mean"], abs=1e-12)
    md = (out / "privacy_utility_llm.md").read_text()
    v, = res["verdicts"]
    assert v.startswith("ε = 3: does FFA-LoRA lose less accuracy than FedAvg-LoRA? ") and f"- {v}" in md
    assert ("? yes" in v) == (rows["ffa", 3.0]["drop"] < rows["fedavg", 3.0]["drop"])
    assert "| fedavg | " in md and "| ε = ∞ | ε = 3 |" in md
    assert (out / "privacy_utility_llm.png").stat().st_size > 10_000
    capsys.readouterr()

    # --resume: both ε folders are kept (no run), the same table
    before = {p: p.stat().st_mtime_ns for p in out.rglob("summary.json")}
    logs = []
    res2 = mod.sweep(config="tiny-smoke", methods=["fedavg", "ffa"], epsilons=[math.inf, 3.0], seeds=1,
                     lr_grid=[1e-3], clip_norms=[0.05, 5.0], rounds=2, local_steps=2, sets=["train.batch_size=64"],
                     out=out, resume=True, log=logs.append)
    assert all("kept" in line for line in logs) and len(logs) == 2
    assert {p: p.stat().st_mtime_ns for p in out.rglob("summary.json")} == before
    assert [r["test_mean"] for r in res2["rows"]] == [r["test_mean"] for r in res["rows"]]


def test_verdict_compares_the_drops_from_each_methods_own_no_dp_accuracy():
    mod = _script()

    def rows(ffa_eps, avg_eps, seeds=2):
        out = []
        for m, (inf, at3) in {"fedavg": (0.90, avg_eps), "ffa": (0.60, ffa_eps)}.items():
            for e, acc in ((math.inf, inf), (3.0, at3)):
                out.append({"method": m, "epsilon": e, "test_mean": acc, "test_std": 0.01 if seeds > 1 else 0.0,
                            "test_per_seed": [acc] * seeds, "drop": None if math.isinf(e) else inf - acc})
        return out

    yes, = mod.verdicts(rows(ffa_eps=0.58, avg_eps=0.80))  # FFA drops 0.02, FedAvg 0.10 (still ahead in accuracy)
    assert "? yes" in yes and "FFA-LoRA +0.0200" in yes and "FedAvg-LoRA +0.1000" in yes and "larger than" in yes
    no, = mod.verdicts(rows(ffa_eps=0.50, avg_eps=0.895))
    assert "? no" in no and "within" not in no
    close, = mod.verdicts(rows(ffa_eps=0.595, avg_eps=0.89))
    assert "? yes" in close and "within the seeds' spread" in close
    assert mod.verdicts([r for r in rows(0.5, 0.5) if r["method"] == "fedavg"])[0].startswith("No verdict")
    one, = mod.verdicts(rows(ffa_eps=0.58, avg_eps=0.80, seeds=1))  # one seed: no spread, so no claim about it
    assert "? yes" in one and "comes from one seed: there is no spread" in one and "std" not in one
    for gone in (("ffa", 3.0), ("fedavg", math.inf)):  # a report's rows: a cell whose runs have not all finished
        part = [r for r in rows(ffa_eps=0.58, avg_eps=0.80) if (r["method"], r["epsilon"]) != gone]
        assert mod.verdicts(part, ["fedavg", "ffa"], [math.inf, 3.0]) == [
            "ε = 3: not yet — FedAvg-LoRA's and FFA-LoRA's runs at ε = 3 and at ε = ∞ have not all finished"]


def test_bad_sweep_settings_are_one_line_before_any_run(tmp_path, capsys, monkeypatch):
    from fedlora.methods.pf2lora import PF2LoRA

    monkeypatch.setattr(PF2LoRA, "sample_dp_refusal", "no private path (this test's)")  # every method has one
    mod = _script()
    out = tmp_path / "sweep"
    for extra, match in ((["--epsilons", "inf,0"], "ε must be > 0"), (["--epsilons", "3,3"], "--epsilons: a value is listed twice"),
                         (["--clip-norms", "0,5"], "--clip-norms: values are positive"),
                         (["--methods", "fedavg,pf2lora"], "sample-level DP does not apply to pf2lora"),
                         (["--delta", "1"], "--delta: must be in (0, 1)"), (["--jobs", "0"], "and --jobs: at least 1 each"),
                         (["--set", "privacy.clip_norm=3"], "--set privacy.clip_norm sets it too")):
        assert mod.main(ARGS + extra + ["--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert match in err and len(err.strip().splitlines()) == 1, (extra, err)
        assert not out.exists()
    with pytest.raises(ConfigError, match="not empty"):
        out.mkdir()
        (out / "mine.txt").write_text("x")
        mod.sweep(config="tiny-smoke", methods=["fedavg"], epsilons=[math.inf], seeds=1, lr_grid=[1e-3], out=out)


def test_resume_redoes_a_stopped_run_and_a_grown_sweep_runs_only_what_is_new(tmp_path, monkeypatch):
    """--resume: a run folder a stopped compare left (no run.json) is made afresh; a sweep grown by a seed keeps the
    finished runs of its ε folder and runs only the new seed's; a folder holding anything else is refused, never
    cleared."""
    from fedlora.llm.runtime import FederatedRun

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    mod = _script()
    out = tmp_path / "sweep"
    half = out / "eps_inf" / "runs" / "fedavg" / "lr_0.001" / "seed_0"
    half.mkdir(parents=True)
    (half / "left.txt").write_text("a stopped run")
    kw = dict(config="tiny-smoke", methods=["fedavg"], epsilons=[math.inf], seeds=1, lr_grid=[1e-3], rounds=1,
              local_steps=1, out=out, resume=True, log=lambda line: None)
    res = mod.sweep(**kw)
    assert not (half / "left.txt").exists() and (out / "eps_inf" / "compare.json").is_file()
    assert res["rows"][0]["runs"] == [str(half)]
    ran, real_run = [], FederatedRun.run
    monkeypatch.setattr(FederatedRun, "run", lambda self, *a, **k: ran.append(self.cfg.seed) or real_run(self, *a, **k))
    res = mod.sweep(**{**kw, "seeds": 2})
    assert ran == [1] and len(res["rows"][0]["test_per_seed"]) == 2
    (out / "eps_inf" / "compare.json").unlink()
    (out / "eps_inf" / "mine.txt").write_text("x")
    with pytest.raises(ConfigError, match="mine.txt"):
        mod.sweep(**kw)
    assert (out / "eps_inf" / "mine.txt").exists()


def test_report_runs_nothing_and_tables_the_cells_whose_runs_all_finished(tmp_path, monkeypatch):
    """--report over a sweep grown by a method: the finished method's cell is the sweep's own (same choice, same
    numbers), the new method's is "—", no verdict is drawn without its four cells, nothing runs and no ε folder is
    written; --report with --resume, or on a folder that does not exist, is one line."""
    from fedlora.llm.runtime import FederatedRun

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    mod = _script()
    out = tmp_path / "sweep"
    kw = dict(config="tiny-smoke", epsilons=[math.inf], seeds=1, lr_grid=[1e-3], rounds=1, local_steps=1, out=out,
              log=lambda line: None)
    full = mod.sweep(methods=["fedavg"], **kw)
    before = {p: p.stat().st_mtime_ns for p in (out / "eps_inf").rglob("*")}
    monkeypatch.setattr(FederatedRun, "run", lambda self, *a, **k: pytest.fail("a report ran a run"))
    rep = mod.sweep(methods=["fedavg", "ffa"], report=True, **kw)
    assert {p: p.stat().st_mtime_ns for p in (out / "eps_inf").rglob("*")} == before  # nothing written there
    assert rep["partial"] is True and [r["method"] for r in rep["rows"]] == ["fedavg"]
    strip = ("runs",)
    assert {k: v for k, v in rep["rows"][0].items() if k not in strip} == \
        {k: v for k, v in full["rows"][0].items() if k not in strip}
    assert rep["verdicts"] == []  # ε = ∞ alone: no finite ε to judge
    md = (out / "privacy_utility_llm.md").read_text()
    assert "Partial (--report): 1 of 2 (method, ε) cells" in md and "| ffa | — |" in md
    assert json.loads((out / "privacy_utility_llm.json").read_text())["partial"] is True
    with pytest.raises(ConfigError, match="--report and --resume"):
        mod.sweep(methods=["fedavg"], report=True, **{**kw, "resume": True})
    with pytest.raises(ConfigError, match="--report: .* is not a folder of this sweep's results"):
        mod.sweep(methods=["fedavg"], report=True, **{**kw, "out": tmp_path / "none"})
