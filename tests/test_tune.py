"""`fedlora synthetic tune` (synthetic/tune.py): the step-size grid on the testbed the options describe."""
import json

import pytest

import fedlora.synthetic.tune as tune
from fedlora.cli import main

TINY_GRID = {"steps": (20, 40), "pf2lora": {"upper_lr": (0.05,), "lower_lr": (0.1,), "upper_schedule": ("constant",)},
             "hetlora": {"het_lr": (0.05,)}}


@pytest.fixture
def tiny_grid(monkeypatch):
    monkeypatch.setattr(tune, "GRID", TINY_GRID)
    seen = []
    real = tune.run_rank_recovery

    def spy(cfg, **kw):
        seen.append(cfg)
        return real(cfg, **kw)

    monkeypatch.setattr(tune, "run_rank_recovery", spy)
    return seen


def test_tune_takes_the_testbed_options_of_rank_recovery(tmp_path, tiny_grid):
    """Issue 18 §4: tune had no dimension, rank, client or noise options, and tune.json no schema_version."""
    out = tmp_path / "t"
    argv = ["synthetic", "tune", "--seeds", "2", "--dim", "6", "--true-ranks", "2,2,2", "--shared-rank", "1",
            "--noise-std", "0.3", "--rank", "2", "--client-rank", "1", "--het-initial-ranks", "2",
            "--n-samples", "200", "--n-train", "150", "--interval", "5", "--out", str(out)]
    assert main(argv) == 0
    res = json.loads((out / "tune.json").read_text())
    assert res["schema_version"] == 1 and res["experiment"] == "tune"
    c = res["config"]
    assert (c["dim"], c["true_ranks"], c["noise_std"], c["rank"], c["client_rank"], c["n_train"], c["interval"]) == \
        (6, [2, 2, 2], [0.3] * 3, 2, 1, 150, 5)
    assert c["ground_truth"] == "shared-private" and "upper_lr" not in c and "steps" not in c
    # every trial ran on that testbed, with the grid's own step sizes
    assert tiny_grid and all((cfg.dim, cfg.true_ranks, cfg.noise_std, cfg.rank, cfg.client_rank, cfg.seed_offset)
                             == (6, (2, 2, 2), (0.3,) * 3, 2, 1, 100) for cfg in tiny_grid)
    assert {cfg.methods for cfg in tiny_grid} == {("pf2lora",), ("hetlora",)}
    # and so did the reference: the best fit's train MSE sits just under the noise variance 0.09
    assert all(0.06 < r < 0.09 for r in res["reference_train_mse"]), res["reference_train_mse"]
    assert set(res["choice"]) == {"pf2lora", "hetlora"}


@pytest.mark.parametrize("argv, match", [
    (["--dim", "0"], "--dim: must be ≥ 1"),
    (["--true-ranks", "3,4", "--noise-std", "0.1,0.2,0.3"], "--noise-std: must be one value per client (2)"),
    (["--client-rank", "4"], "--client-rank"),
    (["--interval", "7"], "--interval: must divide every step count of tune's grid (2000, 3000, 4000), got 7"),
    (["--seeds", "0"], "--seeds"),
])
def test_bad_testbed_options_fail_before_any_work(argv, match, tmp_path, capsys, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("started")

    monkeypatch.setattr(tune, "run_rank_recovery", boom)
    assert main(["synthetic", "tune", *argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1
    assert "--steps" not in err and "--upper-lr" not in err   # flags tune does not have
    assert not (tmp_path / "o").exists()


def test_tune_and_rank_recovery_share_the_testbed_flags():
    """The option definitions are one table: every testbed flag of rank-recovery is a flag of tune."""
    import argparse

    from fedlora import cli
    from fedlora.synthetic.cli import _TESTBED_FLAGS

    top = cli._build_parser("synthetic")
    syn = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices["synthetic"]
    subs = next(a for a in syn._actions if isinstance(a, argparse._SubParsersAction)).choices

    def flags(name):
        return {o for a in subs[name]._actions for o in a.option_strings}

    testbed = {f"--{f}" for f in _TESTBED_FLAGS}
    assert {"--dim", "--true-ranks", "--noise-std", "--rank", "--client-rank", "--shared-rank"} <= testbed
    assert testbed <= flags("tune") and testbed <= flags("rank-recovery")
    assert not {"--upper-lr", "--lower-lr", "--het-lr", "--steps", "--upper-schedule"} & flags("tune")
