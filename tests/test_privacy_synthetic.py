"""Sample-level DP-SGD in the synthetic testbed (fedlora.synthetic.privacy, fedlora.simulator) and its sweep
(fedlora.synthetic.privacy_sweep)."""
import math

import pytest
import torch

from fedlora.errors import ConfigError
from fedlora.privacy.accounting import PrivacyAccountant
from fedlora.synthetic.compare import method_spec
from fedlora.synthetic.data import make_heterogeneous_clients
from fedlora.synthetic.privacy import TestbedPrivacy
from fedlora.synthetic.privacy_sweep import SWEEP_METHODS, select_step_size, sweep
from fedlora.synthetic.runner import run_method, stack_federations

K = 3
#: one setting for every noisy test: σ's calibration (seconds) is then made once per client size
PRIV = TestbedPrivacy(4.0, 1e-5, clip_norm=0.5, batch_size=8)


def _data(task="classification", seeds=(0, 1), n=40):
    d_out = 4 if task == "classification" else 5
    feds = [make_heterogeneous_clients(task, s, 0.5, n_clients=K, d_in=5, d_out=d_out, shared_rank=1,
                                       private_rank=1, n_train=(n, n + 10, n + 20), n_test=50) for s in seeds]
    return stack_federations(task, feds, list(seeds), d_out, val_fraction=0.2)


def _run(name, data, privacy=None, rounds=2, local_steps=2, lr=0.05, **kw):
    spec = method_spec(name, 2, K, {"optimizer": "sgd"} if name != "fedsb" else None)
    res = run_method(name, data, lr=lr, rounds=rounds, local_steps=local_steps, options=spec.options,
                     adapter=spec.adapter, lr_arg=spec.lr_arg, privacy=privacy, keep_records=True, **kw)
    assert res.error is None, res.error
    return res


def _factors(res):
    """Every replica's trained tensors: the adapter's parameters and a method's own (Fed-SB's R)."""
    return [{k: v for k, v in r.items() if k.startswith(("param:", "extra:"))} for r in res.records]


@pytest.mark.parametrize("name", [*SWEEP_METHODS, "flexlora", "hetlora", "feddpa", "h2tune", "lora-a2"])  # own steps
@pytest.mark.parametrize("task", ["classification", "regression"])
def test_noiseless_unclipped_full_batch_dp_equals_ordinary_training(name, task):
    """q = 1 (b ≥ n_k), σ = 0 (ε = ∞), C far above every example's norm: DP-SGD's gradient is Σᵢ gᵢ / n_k, the
    testbed's own full-batch gradient — so the per-example machinery (Fed-SB's init round and its R included) must
    give the ordinary run's model. With C small, clipping changes it."""
    data = _data(task, seeds=(0,))
    plain = _run(name, data)
    dp = _run(name, data, TestbedPrivacy(math.inf, 1e-5, clip_norm=1e6, batch_size=10_000))
    for a, b in zip(_factors(plain), _factors(dp)):
        assert a.keys() == b.keys() and a
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=1e-9, atol=1e-11)
    assert dp.final["test_loss"] == pytest.approx(plain.final["test_loss"], rel=1e-9)
    clipped = _run(name, data, TestbedPrivacy(math.inf, 1e-5, clip_norm=1e-3, batch_size=10_000))
    assert any(not torch.allclose(c[k], a[k]) for c, a in zip(_factors(clipped), _factors(plain)) for k in a)


@pytest.mark.parametrize("mode", ["none", "finite-difference", "exact"])
def test_pf2lora_noiseless_unclipped_full_batch_dp_equals_ordinary_training(mode):
    """PF2LoRA in each hypergradient mode: q = 1, σ = 0 and an unclipping C give its ordinary run (every release then
    sees every row: the lower step's, the upper step's and the mixed term's gradients are the full-batch ones; the
    per-example finite differences, or forward-mode Hessian-vector products, sum to the batch's — the ordinary exact
    mode's derivative through the unrolled step is eq. (4) when its batches coincide, as here)."""
    data = _data(seeds=(0,))
    spec = method_spec("pf2lora", 2, K, {"hypergradient": mode, "upper_optimizer": "sgd"})
    kw = dict(lr=0.05, rounds=2, local_steps=2, options=spec.options, adapter=spec.adapter, lr_arg=spec.lr_arg,
              keep_records=True)
    plain = run_method("pf2lora", data, **kw)
    dp = run_method("pf2lora", data, privacy=TestbedPrivacy(math.inf, 1e-5, clip_norm=1e6, batch_size=10_000), **kw)
    for a, b in zip(_factors(plain), _factors(dp)):
        assert a.keys() == b.keys() and any(k.endswith("lora_C") for k in a)
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=1e-9, atol=1e-11)


def test_hessian_free_perfedavg_noiseless_unclipped_full_batch_dp_equals_ordinary_training():
    """Per-FedAvg's hessian-free variant: q = 1, σ = 0 and an unclipping C give its ordinary run — the third release's
    per-example differences [∇ℓᵢ(x + δh) − ∇ℓᵢ(x − δh)]/(2δ), summed, are the full batch's finite-difference HVP; a
    small C changes the run (the differences are clipped)."""
    data = _data(seeds=(0,))
    spec = method_spec("perfedavg", 2, K, {"variant": "hessian-free", "delta": 1e-2, "optimizer": "sgd"})
    kw = dict(lr=0.05, rounds=2, local_steps=2, options=spec.options, adapter=spec.adapter, lr_arg=spec.lr_arg,
              keep_records=True)
    plain = run_method("perfedavg", data, **kw)
    first = run_method("perfedavg", data, **{**kw, "options": {**spec.options, "variant": "first-order"}})
    dp = run_method("perfedavg", data, privacy=TestbedPrivacy(math.inf, 1e-5, clip_norm=1e6, batch_size=10_000), **kw)
    for a, b, f in zip(_factors(plain), _factors(dp), _factors(first)):
        assert a.keys() == b.keys() and a
        assert any(not torch.allclose(a[k], f[k], rtol=1e-9, atol=1e-11) for k in a)  # the HVP term matters here
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=1e-9, atol=1e-11)
    # with noise: three releases per local step — σ calibrated for, and ε counting, 3 × the steps
    noisy = run_method("perfedavg", data, privacy=PRIV, **kw)
    sizes, acc = data.client_sizes, PrivacyAccountant()
    for i in range(K):
        acc.record(str(i), min(1.0, 8 / sizes[i]), PRIV.noise_multiplier(sizes, 3 * 2 * 2), 3 * 2 * 2)
    assert noisy.history[-1]["privacy"]["epsilon_by_client"] == acc.epsilons(1e-5)
    assert noisy.history[-1]["privacy"]["epsilon"] == pytest.approx(4.0, abs=1e-4)


@pytest.mark.parametrize("name", SWEEP_METHODS)
def test_private_steps_train_the_methods_factors(name):
    """With noise and Poisson batches every supported method's trained factors move from the broadcast init; FFA-LoRA
    keeps A (it trains B alone; FedSVD's server re-factorises, so its A moves too), Fed-SB trains R."""
    data = _data(seeds=(0,))
    init = _run(name, data, rounds=1, local_steps=1, lr=1e-300)  # a step of ~0: the init, as each client holds it
    dp = _run(name, data, PRIV)
    moved = {k for a, b in zip(_factors(init), _factors(dp)) for k in a if not torch.allclose(a[k], b[k])}
    want = {"ffa": {"param:lora_B"}}.get(name)
    if want is not None:
        assert moved == want
    elif name == "fedsb":
        assert "extra:R" in moved
    else:
        assert {"param:lora_A", "param:lora_B"} <= moved


def test_epsilon_is_the_accountants_for_the_steps_taken():
    """Each replica's ε is dp-accounting's for (q_k, σ, local steps × rounds it was drawn in); sampled-out rounds
    compose nothing. With everyone drawn, the worst client ends at the target ε."""
    data = _data()
    priv = PRIV
    res = _run("fedavg", data, priv, rounds=2, local_steps=2, sample_fraction=0.5, sample_seed=1)
    sizes = data.client_sizes
    sigma = priv.noise_multiplier(sizes, 2 * 2)
    drawn = {i: 0 for i in range(2 * K)}
    for rec in res.history:
        for i in rec["participants"]:
            drawn[i] += 1
        acc = PrivacyAccountant()
        for i, n in drawn.items():
            if n:
                acc.record(str(i), min(1.0, 8 / sizes[i % K]), sigma, 2 * n)  # unit: the replica, g·K + k
        assert rec["privacy"]["epsilon_by_client"] == acc.epsilons(1e-5)
        assert rec["privacy"]["epsilon"] == acc.epsilon(1e-5)
    assert min(drawn.values()) < 2  # the check covers clients that sat rounds out
    full = _run("fedavg", data, priv, rounds=2, local_steps=2)
    assert full.history[-1]["privacy"]["epsilon"] == pytest.approx(4.0, abs=1e-4)
    assert full.history[-1]["privacy"]["epsilon"] <= 4.0
    # private Per-FedAvg releases two gradients per local step: σ is calibrated for, and ε counts, twice the steps
    pf = _run("perfedavg", data, priv, rounds=2, local_steps=2)
    acc = PrivacyAccountant()
    for i in range(2 * K):
        acc.record(str(i), min(1.0, 8 / sizes[i % K]), priv.noise_multiplier(sizes, 2 * 2 * 2), 2 * 2 * 2)
    assert pf.history[-1]["privacy"]["epsilon_by_client"] == acc.epsilons(1e-5)
    assert pf.history[-1]["privacy"]["epsilon"] == pytest.approx(4.0, abs=1e-4)


def test_same_seed_bit_identical_other_seed_differs_federations_independent():
    priv = PRIV
    both = _run("fedavg", _data(seeds=(0, 1)), priv)
    again = _run("fedavg", _data(seeds=(0, 1)), priv)
    for a, b in zip(_factors(both), _factors(again)):
        for k in a:
            assert torch.equal(a[k], b[k])
    # federation 0 alone draws what it draws stacked with federation 1: its streams are keyed by its own seed
    alone = _run("fedavg", _data(seeds=(0,)), priv)
    for a, b in zip(_factors(alone), _factors(both)[:K]):
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-12, atol=1e-14)
    # the same data under another federation seed's streams: other batches and noise
    other = stack_federations("classification", [make_heterogeneous_clients(
        "classification", 0, 0.5, n_clients=K, d_in=5, d_out=4, shared_rank=1, private_rank=1,
        n_train=(40, 50, 60), n_test=50)], [7], 4, val_fraction=0.2)
    moved = _run("fedavg", other, priv)
    assert not torch.allclose(_factors(moved)[0]["param:lora_B"], _factors(alone)[0]["param:lora_B"])


def test_refusals_in_one_line(monkeypatch):
    from fedlora.methods.pf2lora import PF2LoRA

    data = _data(seeds=(0,))
    spec = method_spec("pf2lora", 2, K, None)
    monkeypatch.setattr(PF2LoRA, "sample_dp_refusal", "no private path (this test's)")  # every method has one
    with pytest.raises(ConfigError, match=r"^pf2lora: sample-level DP is not supported: no private path"):
        run_method("pf2lora", data, lr=0.05, rounds=1, local_steps=1, options=spec.options, adapter=spec.adapter,
                   lr_arg=spec.lr_arg, privacy=TestbedPrivacy(3.0))
    monkeypatch.undo()
    with pytest.raises(ConfigError, match=r"^centralized: sample-level DP on the testbed: .*fedlora run pools the rows"):
        _run("centralized", data, TestbedPrivacy(3.0))
    for bad, what in ((dict(epsilon=0.0), "epsilon"), (dict(epsilon=1.0, delta=1.0), "delta"),
                      (dict(epsilon=1.0, clip_norm=-1.0), "clip_norm"), (dict(epsilon=1.0, batch_size=0), "batch_size")):
        with pytest.raises(ConfigError, match=what):
            TestbedPrivacy(**bad).validate()


def test_select_step_size_reads_validation():
    assert select_step_size({0.1: 0.5, 0.01: 0.3, 1.0: float("nan")}) == 0.01
    assert select_step_size({0.1: 0.3, 0.01: 0.3}) == 0.01  # ties: the smaller step


def test_sweep_selects_on_validation_never_test():
    """The sweep's step size is the argmin of the grid's mean validation loss; on this tiny sweep validation and test
    disagree for some (method, ε), so a sweep that selected on test would fail here."""
    res = sweep(methods=("fedavg", "ffa"), epsilons=(math.inf, 2.0), seeds=(0,), lr_grid=(0.01, 0.1, 0.5),
                clients=K, n_train=40, rounds=2, local_steps=2, rank=2, log=lambda *a: None)
    assert len(res["rows"]) == 4
    disagree = 0
    for row in res["rows"]:
        assert row["lr"] == min(row["grid"], key=lambda lr: (row["grid"][lr], lr))
        assert row["val_loss"] == row["grid"][row["lr"]]
        assert row["test_loss"] == row["grid_test"][row["lr"]]
        disagree += min(row["grid_test"], key=row["grid_test"].get) != row["lr"]
    assert disagree >= 1
    ffa = next(r for r in res["rows"] if r["method"] == "ffa")
    assert sorted(ffa["grid"]) == [0.1, 1.0, 5.0]  # FFA-LoRA's grid is 10× the others'
    assert res["rows"][1]["eps_spent"] <= 2.0 and res["rows"][0]["sigma"] == 0.0


def test_the_sweeps_sigma_is_the_runs_for_a_two_release_method():
    """Per-FedAvg's local step makes 2 DP-SGD releases: the σ a sweep row reports is calibrated for 2 × rounds ×
    local steps (dp-accounting itself gives ε = target for it), larger than FedAvg-LoRA's at the same ε."""
    import dp_accounting

    res = sweep(methods=("perfedavg", "fedavg"), epsilons=(3.0,), seeds=(0,), lr_grid=(0.1,), clients=K, n_train=40,
                rounds=2, local_steps=2, rank=2, log=lambda *a: None)
    rows = {r["method"]: r for r in res["rows"]}
    q = max(TestbedPrivacy(3.0, batch_size=32).rates(res["config"]["client_sizes"]))
    for name, releases in (("perfedavg", 2), ("fedavg", 1)):
        acc = dp_accounting.rdp.RdpAccountant()
        acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(rows[name]["sigma"])),
                    releases * 2 * 2)
        assert acc.get_epsilon(1e-5) == pytest.approx(3.0, rel=1e-3), name
    assert rows["perfedavg"]["sigma"] > rows["fedavg"]["sigma"]
    from fedlora.synthetic.privacy_sweep import sweep_markdown

    assert sweep_markdown(res).endswith(f"σ per ε: perfedavg: 3: {rows['perfedavg']['sigma']:.3f}; "
                                        f"fedavg: 3: {rows['fedavg']['sigma']:.3f}.")  # each method's σ, not one


def test_a_sweep_entry_with_options_runs_that_variant_and_counts_its_releases():
    """``perfedavg:variant=hessian-free`` in the sweep: the row is labelled with the entry, its σ is calibrated for 3
    releases per step (the first-order entry's for 2: smaller), and its numbers are the hessian-free run's."""
    res = sweep(methods=("perfedavg", "perfedavg:variant=hessian-free:delta=0.01"), epsilons=(3.0,), seeds=(0,),
                lr_grid=(0.1,), clients=K, n_train=40, rounds=2, local_steps=2, log=lambda *_: None)
    fo, hf = res["rows"]
    assert (fo["method"], hf["method"]) == ("perfedavg", "perfedavg:variant=hessian-free:delta=0.01")
    assert hf["sigma"] > fo["sigma"] and hf["eps_spent"] == pytest.approx(3.0, abs=1e-3)
    assert hf["test_loss"] != fo["test_loss"]


def test_the_sweep_scripts_methods_are_the_testbeds_private_ones(capsys):
    """synthetic/results/privacy_sweep.py --methods all: every method whose local step is private on the testbed
    (Centralized, private in fedlora run only, left out) — PF2LoRA in its default exact mode too; a bad name is one
    line."""
    from _run_helpers import load_script

    from fedlora.methods import available_methods, get_method

    mod = load_script("synthetic/results/privacy_sweep.py")
    every = mod.parse_methods("all")
    assert "centralized" not in every and {"h2tune", "feddpa", "hetlora", "flexlora", "perfedavg", "lora-a2"} <= set(every)
    assert set(every) | {"centralized"} == set(available_methods()) and "pf2lora" in every
    assert all(get_method(m).sample_dp_refusal is None for m in every)
    assert mod.parse_methods("fedavg, h2tune") == ("fedavg", "h2tune")
    # an entry with constructor options: private with them (PF2LoRA's finite-difference mode), labelled as given
    assert mod.parse_methods("pf2lora:hypergradient=finite-difference,perfedavg:variant=hessian-free:delta=0.01") == \
        ("pf2lora:hypergradient=finite-difference", "perfedavg:variant=hessian-free:delta=0.01")
    for bad in ("pf2lora:hypergradient=nope", "fedavg:no_such_option=1", "fedavg:rank",
                "centralized", "fedavg,fedavg", ""):
        with pytest.raises(SystemExit):
            mod.main(["--methods", bad, "--out-dir", "unused"])
        err = capsys.readouterr().err
        assert err.startswith("error: --methods:") and len(err.strip().splitlines()) == 1, (bad, err)
    with pytest.raises(SystemExit):  # an unwritable folder: one line before any run
        mod.main(["--methods", "fedavg", "--out-dir", "/proc/fedlora-no-such-folder"])
    err = capsys.readouterr().err
    assert err.startswith("error: --out-dir: cannot create the output folder '/proc/fedlora-no-such-folder'") and \
        len(err.strip().splitlines()) == 1, err


def test_noise_is_keyed_by_the_federation_of_each_slot():
    """Two slots holding the same client in two federations get independent noise; each slot's noise is what a
    SampleDP of its federation's seed alone would draw."""
    from fedlora.privacy.dpsgd import SampleDP, privatise

    def sdp(seed, slot_seeds=None):
        s = SampleDP(1.0, 1.0, 0.5, seed=seed)
        s.set_client_sizes([10])
        s.set_slot_seeds(slot_seeds)
        s.at(1, 2)
        return s

    per = {"lora_B": torch.zeros(2, 3, 4, 2, dtype=torch.float64)}  # 2 slots, 3 examples: the noise alone
    both = privatise(sdp(0, [5, 9]), per, [0, 0])["lora_B"]
    assert not torch.allclose(both[0], both[1])
    for p, seed in enumerate((5, 9)):
        torch.testing.assert_close(both[p], privatise(sdp(seed), {"lora_B": per["lora_B"][:1]}, [0])["lora_B"][0],
                                   rtol=0, atol=0)
    with pytest.raises(ConfigError, match="federation's seed"):
        sdp(0, [-1])


def test_dp_off_records_nothing_and_run_rounds_refuses_a_mismatched_plan():
    """Without ``privacy`` the run takes the testbed's own full-batch path: no SampleDP on the method, no privacy in
    the records (the goldens of the DP-off testbed are pinned by the synthetic and protocol tests). A SampleDP the
    method does not train with, or a bad δ, is refused in one line."""
    from fedlora.privacy.dpsgd import SampleDP
    from fedlora.simulator import run_rounds
    from fedlora.synthetic.runner import build_run

    data = _data(seeds=(0,))
    res = _run("fedavg", data)
    assert all("privacy" not in rec for rec in res.history)
    run = build_run("fedavg", data, lr=0.1, options={"rank": 2})
    assert run.method.sample_dp is None and run.layer.dp_capture is None
    with pytest.raises(ConfigError, match="the one the method trains with"):
        run_rounds(run.method, run.federation, run.objective, run.sample, 1, 1, sample_dp=SampleDP(1.0, 1.0, 0.5),
                   dp_delta=1e-5)
    sdp = SampleDP(1.0, 1.0, 0.5)
    run.method.set_sample_dp(sdp)
    with pytest.raises(ConfigError, match="delta"):
        run_rounds(run.method, run.federation, run.objective, run.sample, 1, 1, sample_dp=sdp, dp_delta=2.0)
