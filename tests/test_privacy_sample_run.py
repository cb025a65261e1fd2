"""Sample-level DP-SGD as a run's switch (`privacy.level: sample`, issue 29 items 2–3): the plan a run resolves
(Poisson batch rates b/n_k, δ from the data size, σ for a target ε), each client's ε from its REALISED
participation, resume with the same ε, the Flower runtime equal to the embedded one, the one-line refusals.
The mechanism itself (per-sample gradients, clipping, noise streams) is tested in tests/test_privacy_dpsgd.py."""
import json

import pytest

from fedlora.errors import ConfigError
from fedlora.llm.privacy import describe_plan
from fedlora.methods import available_methods, get_method

DP = ["method.name=ffa", "privacy.level=sample", "privacy.noise_multiplier=1.1", "privacy.clip_norm=0.5",
      "privacy.delta=1e-5", "train.rounds=3"]


def _lines(out):
    return [{k: v for k, v in json.loads(line).items() if k != "wall_s"}
            for line in (out / "rounds.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def sample_run(tmp_path_factory):
    from _run_helpers import tiny_run

    return tiny_run(tmp_path_factory.mktemp("sample_dp") / "run", *DP)


def test_a_dry_run_gives_the_sample_level_plan_the_run_resolves_and_refuses_a_budget_the_first_round_exceeds(
        sample_run, tmp_path):
    """``fedlora run --dry-run`` at sample level: after its data check, the batch rates, local steps and σ the run
    itself resolved (config.json), with a target ε its σ derived; a budget the first round already spends is refused
    by the dry run, before any training."""
    from _run_helpers import FAST

    from fedlora.llm.config import load_config
    from fedlora.llm.runtime import FederatedRun

    resolved = json.loads((sample_run / "config.json").read_text())["resolved"]["privacy"]
    sets = [*FAST, *DP, f"output_dir={tmp_path / 'dry'}"]
    assert FederatedRun(load_config("tiny-smoke", sets), write=False).check()["privacy"] == resolved
    target = FederatedRun(load_config("tiny-smoke", [*sets, "privacy.noise_multiplier=null",
                                                     "privacy.target_epsilon=4"]), write=False).check()["privacy"]
    assert target["batch_rates"] == resolved["batch_rates"] and target["local_steps"] == resolved["local_steps"]
    from fedlora.privacy.accounting import noise_multiplier_for

    # σ: the smallest the library calibrates for ε = 4 over the worst client's rate and its 3 rounds' local steps
    assert target["noise_multiplier"] == max(noise_multiplier_for(4.0, resolved["delta"], q, 3 * t) for q, t in
                                             zip(resolved["batch_rates"], resolved["local_steps"])) > 0
    assert target["max_epsilon"] == 4 and target["delta"] == resolved["delta"]
    with pytest.raises(ConfigError, match="the first round alone spends"):
        FederatedRun(load_config("tiny-smoke", [*sets, "privacy.noise_multiplier=0.3", "privacy.max_epsilon=0.5"]),
                     write=False).check()
    assert not (tmp_path / "dry").exists()


def test_private_perfedavg_and_feddpa_plan_their_releases_per_local_step():
    """A run's plan (no model): Per-FedAvg's rounds spend 2 × its local steps per client, σ is calibrated for as many,
    config.json says so; its hessian-free variant 3 × (the Hessian-vector term a third release); FedDPA-T 2, -F 1."""
    from fedlora.llm.config import load_config
    from fedlora.llm.privacy import describe_plan, privacy_plan
    from fedlora.privacy.accounting import noise_multiplier_for

    sets = ["privacy.level=sample", "privacy.target_epsilon=3", "privacy.delta=1e-5", "train.rounds=3"]
    sizes, steps = [40, 50, 60], [3, 2, 3]
    plans = {m: privacy_plan(load_config("tiny-smoke", [f"method.name={m}", *sets]), 3, sizes, steps)
             for m in ("fedavg", "perfedavg")}
    pf, fa = plans["perfedavg"], plans["fedavg"]
    assert (pf.releases_per_step, fa.releases_per_step) == (2, 1)
    assert pf.participation([0, 1, 2], 3) == {str(k): (pf.sample_rates[k], pf.noise_multiplier, 2 * steps[k])
                                              for k in range(3)}
    assert pf.noise_multiplier == max(noise_multiplier_for(3.0, 1e-5, q, 2 * t * 3)
                                      for q, t in zip(pf.sample_rates, steps)) > fa.noise_multiplier
    assert describe_plan(pf)["releases_per_step"] == 2 and "releases_per_step" not in describe_plan(fa)
    for variant, releases in (("T", 2), ("F", 1)):  # FedDPA-T's two phases per step; FedDPA-F's rounds: one
        dpa = privacy_plan(load_config("tiny-smoke", ["method.name=feddpa", f"method.options.variant={variant}", *sets,
                                                      "privacy.target_epsilon=null", "privacy.noise_multiplier=1.0"]),
                           3, sizes, steps)  # σ given: the calibration above is Per-FedAvg's, seconds per plan
        assert dpa.releases_per_step == releases
        assert dpa.participation([1], 3) == {"1": (dpa.sample_rates[1], 1.0, releases * steps[1])}
    hf = privacy_plan(load_config("tiny-smoke", ["method.name=perfedavg", "method.options.variant=hessian-free", *sets,
                                                 "privacy.target_epsilon=null", "privacy.noise_multiplier=1.0"]),
                      3, sizes, steps)
    assert hf.releases_per_step == 3 and hf.participation([2], 3) == {"2": (hf.sample_rates[2], 1.0, 3 * steps[2])}


def test_centralized_is_private_on_the_pooled_data_as_one_data_set(tmp_path):
    """Centralized under sample-level DP: ONE protected data set — the pooled rows of every client (n = Σ n_k), q =
    b/n, the round's pooled steps — derived alike by the dry run and the run, whose one unit spends ε."""
    from _run_helpers import FAST

    from fedlora.llm.config import load_config
    from fedlora.llm.runtime import FederatedRun

    sets = [*FAST, "method.name=centralized", "privacy.level=sample", "privacy.target_epsilon=8",
            "privacy.delta=1e-5", "train.rounds=2", f"output_dir={tmp_path / 'c'}"]
    dry = FederatedRun(load_config("tiny-smoke", sets), write=False).check()
    run = FederatedRun(load_config("tiny-smoke", sets), write=False).prepare()
    plan = run.privacy_plan
    pooled = sum(dry["data"]["client_train_sizes"])
    assert run.sizes == [pooled] and len(dry["data"]["client_train_sizes"]) > 1
    assert plan.sample_rates == (run.cfg.train.batch_size / pooled,) and plan.sample_steps == tuple(run.steps)
    assert dry["privacy"] == describe_plan(plan)
    summary = run.run()
    assert summary["privacy"]["epsilon"] == pytest.approx(8.0, rel=1e-3)


def test_each_clients_epsilon_is_the_librarys_for_the_rounds_it_trained_in(sample_run):
    import dp_accounting

    resolved = json.loads((sample_run / "config.json").read_text())
    plan, cfg = resolved["resolved"]["privacy"], resolved["config"]
    sizes = resolved["resolved"]["train_sizes"]
    b = cfg["train"]["batch_size"]
    assert plan["batch_rates"] == [min(1.0, b / n) for n in sizes]  # Poisson at the expected batch size b
    assert plan["local_steps"] == resolved["resolved"]["local_steps"]
    drawn = {str(k): 0 for k in range(len(sizes))}
    lines = _lines(sample_run)[1:]
    for rec in lines:
        for k in rec["participants"]:
            drawn[str(k)] += 1
        by_client = rec["privacy"]["epsilon_by_client"]
        assert set(by_client) == {k for k, n in drawn.items() if n}  # never drawn: nothing spent
        for k, eps in by_client.items():
            acc = dp_accounting.rdp.RdpAccountant()
            q, steps = plan["batch_rates"][int(k)], plan["local_steps"][int(k)]
            acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(1.1)), steps * drawn[k])
            assert eps == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9), (rec["round"], k)
        assert rec["privacy"]["epsilon"] == max(by_client.values())
    assert len(set(drawn.values())) > 1  # client sampling on: the clients' ε differ by their participation


def test_a_sample_level_run_resumed_equals_the_uninterrupted_one(sample_run, tmp_path):
    from _run_helpers import interrupted_run
    from fedlora.llm.runs import resume

    stopped = interrupted_run(tmp_path / "d", rounds=3, stop_before=2, overrides=DP[:-1])
    resume(stopped, progress=False).run()
    assert _lines(stopped) == _lines(sample_run)
    assert json.loads((stopped / "summary.json").read_text())["privacy"] == \
        json.loads((sample_run / "summary.json").read_text())["privacy"]


@pytest.mark.long  # 6 tiny-smoke runs (≈ 40 s): the methods whose private step is their own, with state across rounds
@pytest.mark.parametrize("method", ["h2tune", "hetlora", "feddpa"])
def test_a_private_run_of_a_stateful_method_under_client_sampling_resumes_bit_for_bit(method, tmp_path):
    """H²Tune (supports, Ω, the KL target), HetLoRA (ranks pruned at round ends), FedDPA (the local adapter): under
    sample-level DP and client sampling a run stopped after round 2 and resumed equals the uninterrupted run — the
    streams are keyed by (client, round, step, release), so nothing of DP's needs saving."""
    from _run_helpers import interrupted_run, tiny_run
    from fedlora.llm.runs import resume

    sets = [f"method.name={method}", "method.options={}", "method.lr=null", "privacy.level=sample",
            "privacy.noise_multiplier=0.9", "privacy.clip_norm=0.5", "privacy.delta=1e-5",
            "federation.sample_fraction=0.5", "train.local_steps=2"]
    whole = _lines(tiny_run(tmp_path / "whole", *sets, "train.rounds=3"))
    stopped = interrupted_run(tmp_path / "stopped", rounds=3, stop_before=2, overrides=sets)
    resume(stopped, progress=False).run()
    assert _lines(stopped) == whole
    assert all(len(r["participants"]) == 2 for r in whole[1:])  # 2 of the 3 clients drawn each round


def test_a_sample_level_run_trains_and_a_different_seed_gives_other_numbers(sample_run, tmp_path):
    from _run_helpers import tiny_run

    lines = _lines(sample_run)
    assert all(r["train_loss"] for r in lines[1:])
    other = _lines(tiny_run(tmp_path / "seed1", *DP, "seed=1"))
    assert [r["train_loss"] for r in other[1:]] != [r["train_loss"] for r in lines[1:]]


@pytest.mark.xdist_group("flower")
def test_sample_level_dp_over_flower_gives_the_embedded_runs_records(sample_run, tmp_path, monkeypatch, capsys):
    """Each node builds its clients' DP-SGD from the run's config (the same streams per client, round and step),
    so a Flower deployment trains the same private steps and the server records the same ε."""
    pytest.importorskip("flwr")
    from _flower_inprocess import OneProcessGrid, run_as_serverapp
    from _run_compare import adapters, assert_close, assert_same_adapters, records
    from _run_helpers import FAST
    from fedlora import flower
    from fedlora.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(flower, "simulate", lambda main_, n: run_as_serverapp(main_, OneProcessGrid(n)))
    sets = [a for kv in [*FAST, *DP] for a in ("--set", kv)]
    out = tmp_path / "flower"
    assert main(["run", "tiny-smoke", *sets, "--no-progress", "--runtime", "flower", "--out", str(out)]) == 0, \
        capsys.readouterr().err
    assert_close(records(sample_run), records(out))
    assert_same_adapters(adapters(sample_run), adapters(out))


def test_a_method_without_a_private_local_step_is_refused_in_one_line(monkeypatch):
    """Every registered method has a private local step now (PF2LoRA's exact mode was the last refused); a method
    without one — the base class's default refusal, a plugin's — is refused by the run's config in one line."""
    from fedlora.llm.config import RunConfig
    from fedlora.methods.base import Method
    from fedlora.methods.pf2lora import PF2LoRA

    assert [m for m in available_methods() if get_method(m).sample_dp_refusal is not None] == []
    monkeypatch.setattr(PF2LoRA, "sample_dp_refusal", Method.sample_dp_refusal)
    with pytest.raises(ConfigError) as e:
        RunConfig.from_dict({"method": {"name": "pf2lora"}, "privacy": {"level": "sample", "noise_multiplier": 1.0}})
    assert "\n" not in str(e.value) and "pf2lora" in str(e.value)
    assert Method.sample_dp_refusal in str(e.value)


def test_the_plan_derives_sigma_for_the_worst_client_and_refuses_a_budget_the_first_round_exceeds():
    from fedlora.llm.config import RunConfig
    from fedlora.llm.privacy import privacy_plan
    from fedlora.privacy.accounting import PrivacyAccountant

    cfg = RunConfig.from_dict({"train": {"rounds": 5, "batch_size": 8},
                               "privacy": {"level": "sample", "target_epsilon": 3.0, "delta": "auto"}})
    sizes, steps = [40, 200, 80], [10, 10, 4]
    plan = privacy_plan(cfg, 3, sizes, steps)
    assert plan.delta == 1 / (2 * 40) and list(plan.sample_rates) == [8 / 40, 8 / 200, 8 / 80]
    eps = []
    for q, t in zip(plan.sample_rates, steps):
        acc = PrivacyAccountant()
        acc.record("k", q, plan.noise_multiplier, t * 5)
        eps.append(acc.epsilon(plan.delta))
    assert max(eps) <= 3.0 and max(eps) == pytest.approx(3.0, rel=1e-3) and eps[0] == max(eps)  # client 0 binds
    bad = RunConfig.from_dict({"privacy": {"level": "sample", "noise_multiplier": 0.2, "max_epsilon": 1.0}})
    with pytest.raises(ConfigError, match="the first round alone spends") as e:
        privacy_plan(bad, 3, sizes, steps)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("level", ["sample", "client"])
def test_a_run_without_noise_ends_with_epsilon_infinity_in_its_summary(level, tmp_path):
    """σ = 0 (``noise_multiplier: 0``, clipping without noise — an ablation): no guarantee, ε = ∞ in every round
    record AND in summary.json, which the run used to fail to write at its very end (JSON has no infinity)."""
    import math

    from _run_helpers import tiny_run

    out = tiny_run(tmp_path / level, f"privacy.level={level}", "privacy.noise_multiplier=0", "train.rounds=2")
    summary = json.loads((out / "summary.json").read_text())
    assert json.loads((out / "run.json").read_text())["status"] == "complete"
    assert summary["privacy"]["noise_multiplier"] == 0 and math.isinf(summary["privacy"]["epsilon"])
    assert summary["privacy"]["rounds_run"] == 2
    assert [math.isinf(r["privacy"]["epsilon"]) for r in _lines(out)[1:]] == [True, True]
