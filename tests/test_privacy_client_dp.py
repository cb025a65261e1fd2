"""Client-level DP (DP-FedAvg) in the one server protocol (issue 29 item 1): what the server releases, who it
draws, what ε it reports, how a run stops at its budget and resumes with the same ε, and what is refused."""
import json
import math

import pytest
import torch

from fedlora.errors import ConfigError
from fedlora.methods import available_methods, get_method
from fedlora.methods.fedavg import FedAvgLoRA
from fedlora.payload import Payload
from fedlora.privacy.accounting import PrivacyAccountant
from fedlora.privacy.client_dp import CLIENT_UNIT, ClientDP, poisson_participants
from fedlora.privacy.plan import BudgetExhausted, PrivacyPlan
from fedlora.seeds import DP_CLIENT_NOISE, seed_of
from fedlora.server import ClientFailure, ClientUpdate, Federation, Server

NAMES = ("layer.lora_A", "layer.lora_B")
SUPPORTED = [m for m in available_methods() if get_method(m).client_dp_refusal is None]
REFUSED = [m for m in available_methods() if get_method(m).client_dp_refusal is not None]


def _reference():
    g = torch.Generator().manual_seed(7)
    return {"layer.lora_A": torch.randn(2, 5, generator=g), "layer.lora_B": torch.zeros(3, 2)}


class GivenUploads:
    """A client executor whose clients send given uploads (what crossed the network), R + scale_k·noise_k;
    ``fail``: clients that deliver nothing. Records which clients it was asked to train."""

    live, shared_base = False, False

    def __init__(self, reference, scales, fail=()):
        self.reference, self.scales, self.fail, self.asked = reference, scales, set(fail), []

    def upload(self, k, rnd):
        g = torch.Generator().manual_seed(100 * rnd + k)
        return {n: v + self.scales[k] * torch.randn(v.shape, generator=g) for n, v in self.reference.items()}

    def train(self, rnd, clients, downloads):
        self.asked.append(list(clients))
        return {k: ClientFailure("gone", "disconnected") if k in self.fail else ClientUpdate(Payload(self.upload(k, rnd)))
                for k in clients}

    def deliver(self, rnd, downloads):
        return {}


def _server(dp, rounds=3, K=4, q=0.5, delta=1e-3, budget=None):
    plan = PrivacyPlan(level="client", delta=delta, max_epsilon=budget, noise_multiplier=dp.noise_multiplier, client=dp)
    fed = Federation(n_groups=1, n_clients=K, sample_fraction=q, sample_seed=0)
    return Server(FedAvgLoRA(rank=2), fed, [{}], rounds, privacy=plan, dp_references=[_reference()])


def _by_hand(reference, uploads, C, sigma, qk, seed, rnd):
    """DP-FedAvg written out: R + (Σ_k Δ_k·min(1, C/(‖Δ_k‖+1e-6)) + σC·z)/(qK), z from the round's stream."""
    total = {n: torch.zeros_like(v, dtype=torch.float64) for n, v in reference.items()}
    for up in uploads:
        d = {n: (up[n] - reference[n]).double() for n in reference}
        norm = math.sqrt(sum(float((v ** 2).sum()) for v in d.values()))
        f = min(1.0, C / (norm + 1e-6))
        for n in d:
            total[n] += f * d[n]
    g = torch.Generator().manual_seed(seed_of(seed, DP_CLIENT_NOISE, rnd, 0))
    z = {n: torch.randn(reference[n].shape, generator=g) for n in sorted(reference)}
    return {n: reference[n].double() + (total[n] + sigma * C * z[n].double()) / qk for n in reference}


def test_the_server_releases_the_noised_fixed_denominator_mean_of_clipped_updates():
    dp = ClientDP(clip_norm=0.8, noise_multiplier=0.7, sampling_rate=0.5, seed=3)
    ref = _reference()
    ex = GivenUploads(ref, scales=[0.05, 2.0, 0.1, 3.0])  # clients 1 and 3's updates are clipped
    server = _server(dp)
    for rnd in range(2):
        start = {**ref, **server.states[0]}
        drawn = server.participants(rnd)
        rec = server.run_round(ex, rnd)
        assert ex.asked[-1] == drawn == poisson_participants(3, rnd, 0, 4, 0.5)
        want = _by_hand(start, [ex.upload(k, rnd) for k in drawn], 0.8, 0.7, 0.5 * 4, 3, rnd)
        for n in NAMES:
            assert torch.allclose(server.states[0][n].double(), want[n], atol=1e-6), n
        norms = rec["privacy"]["update_norm"]
        assert set(norms) == {str(k) for k in drawn}
        assert rec["privacy"]["clipped"] == sum(1 for k in drawn if norms[str(k)] > 0.8)


def test_a_failed_client_leaves_the_denominator_at_the_expected_count():
    dp = ClientDP(clip_norm=10.0, noise_multiplier=0.0, sampling_rate=1.0, seed=0)
    ref = _reference()
    ex = GivenUploads(ref, scales=[0.1, 0.1, 0.1, 0.1], fail={1, 2, 3})
    server = _server(dp, q=1.0)
    rec = server.run_round(ex, 0)
    assert rec["participants"] == [0, 1, 2, 3] and set(rec["failures"]) == {"1", "2", "3"}
    up = ex.upload(0, 0)
    for n in NAMES:  # Δ_0 / (q·K = 4), not Δ_0 / 1
        assert torch.allclose(server.states[0][n], ref[n] + (up[n] - ref[n]) / 4, atol=1e-7)


def test_every_clipped_update_has_norm_at_most_c():
    dp = ClientDP(clip_norm=0.3, noise_multiplier=0.0, sampling_rate=1.0, seed=0)
    ref = _reference()
    for scale in (0.01, 1.0, 1e3):
        ex = GivenUploads(ref, scales=[scale] * 4)
        server = _server(dp, q=1.0)
        server.run_round(ex, 0)
        step = {n: (server.states[0][n] - ref[n]).double() * 4 for n in NAMES}  # Σ_k clipped Δ_k
        mean_norm = math.sqrt(sum(float((v ** 2).sum()) for v in step.values()))
        assert mean_norm <= 4 * 0.3 + 1e-6


def test_clients_are_drawn_by_poisson_sampling_from_seed_round_and_federation():
    K, q, R = 5, 0.3, 2000
    counts = torch.zeros(K)
    sizes = []
    for r in range(R):
        drawn = poisson_participants(11, r, 0, K, q)
        assert drawn == poisson_participants(11, r, 0, K, q) and drawn == sorted(set(drawn))
        counts[drawn] += 1
        sizes.append(len(drawn))
    se = math.sqrt(q * (1 - q) / R)
    assert torch.all((counts / R - q).abs() < 3 * se + 1e-12), counts / R
    assert 0 in sizes and K in sizes  # the size is random: empty draws and full ones both happen
    assert poisson_participants(11, 0, 1, K, q) != poisson_participants(11, 0, 0, K, q) or \
        poisson_participants(11, 1, 1, K, q) != poisson_participants(11, 1, 0, K, q)
    assert poisson_participants(11, 3, 0, K, 1.0) == list(range(K))


def test_an_empty_draw_releases_noise_on_the_last_released_tensors():
    dp = ClientDP(clip_norm=1.0, noise_multiplier=1.0, sampling_rate=0.5, seed=1)
    empty = [r for r in range(1, 40) if not poisson_participants(1, r, 0, 4, 0.5)
             and poisson_participants(1, r - 1, 0, 4, 0.5)][0]
    server, ex = _server(dp, rounds=empty + 1), GivenUploads(_reference(), [0.1] * 4)
    for r in range(empty):
        server.run_round(ex, r)
    before = {n: server.states[0][n].clone() for n in NAMES}
    rec = server.run_round(ex, empty)
    assert rec["participants"] == [] and rec["privacy"]["noise_only"] == [0]
    g = torch.Generator().manual_seed(seed_of(1, DP_CLIENT_NOISE, empty, 0))
    z = {n: torch.randn(before[n].shape, generator=g) for n in sorted(before)}
    for n in NAMES:
        assert torch.allclose(server.states[0][n], before[n] + z[n] / 2.0, atol=1e-6)


def test_epsilon_in_the_round_records_is_the_librarys_for_the_rounds_run():
    import dp_accounting

    dp = ClientDP(clip_norm=1.0, noise_multiplier=1.3, sampling_rate=0.5, seed=0)
    server, ex = _server(dp, rounds=3, delta=1e-4), GivenUploads(_reference(), [0.1] * 4)
    for r in range(3):
        rec = server.run_round(ex, r)
        acc = dp_accounting.rdp.RdpAccountant()
        acc.compose(dp_accounting.PoissonSampledDpEvent(0.5, dp_accounting.GaussianDpEvent(1.3)), r + 1)
        assert rec["privacy"]["epsilon"] == pytest.approx(acc.get_epsilon(1e-4), rel=1e-9)


def test_a_round_that_would_exceed_the_budget_is_not_started():
    dp = ClientDP(clip_norm=1.0, noise_multiplier=1.3, sampling_rate=0.5, seed=0)
    two = PrivacyAccountant()
    two.record(CLIENT_UNIT, 0.5, 1.3, 2)
    budget = (two.epsilon(1e-4) + PrivacyAccountant.from_state_dict(
        {"version": 1, "units": {CLIENT_UNIT: [[0.5, 1.3, 3]]}}).epsilon(1e-4)) / 2
    server, ex = _server(dp, rounds=4, delta=1e-4, budget=budget), GivenUploads(_reference(), [0.1] * 4)
    server.run_round(ex, 0)
    server.run_round(ex, 1)
    asked = len(ex.asked)
    with pytest.raises(BudgetExhausted, match="privacy.max_epsilon"):
        server.run_round(ex, 2)
    assert len(ex.asked) == asked  # no client was asked to train


def test_the_accountant_is_part_of_the_servers_checkpoint():
    dp = ClientDP(clip_norm=1.0, noise_multiplier=1.0, sampling_rate=0.5, seed=0)
    server, ex = _server(dp), GivenUploads(_reference(), [0.1] * 4)
    server.run_round(ex, 0)
    server.run_round(ex, 1)
    state = json.loads(json.dumps(server.state_dict()["meta"]))
    again = _server(dp)
    again.load_state_dict({"meta": state, "tensors": server.state_dict()["tensors"]})
    assert again.accountant.epsilon(1e-3) == server.accountant.epsilon(1e-3) > 0
    plain = Server(FedAvgLoRA(rank=2), Federation(1, 4), [{}], 3)
    with pytest.raises(ConfigError, match="written with differential privacy"):
        plain.load_state_dict({"meta": state, "tensors": server.state_dict()["tensors"]})
    with pytest.raises(ConfigError, match="without differential privacy"):
        again.load_state_dict(plain.state_dict())


@pytest.mark.parametrize("method", [m for m in SUPPORTED if m != "lora-a2"])  # its release: test_privacy_client_dp_a2_h2
def test_a_supported_methods_aggregate_of_one_upload_of_weight_one_is_that_upload(method, tiny_dp_run):
    """What makes the substitution exact: for these methods ``aggregate([P], [1])`` returns P itself, so the
    private mean reaches ``server_update`` unchanged (checked on the upload the run's client really sent)."""
    fr, _, _ = tiny_dp_run(method)
    up = fr.method.upload(0)
    out = fr.method.aggregate([up], torch.ones(1, dtype=torch.float64))
    assert set(out) >= set(up.tensors)
    for n, v in up.tensors.items():
        assert torch.equal(out[n], v), n


@pytest.mark.parametrize("method", SUPPORTED)
def test_after_a_private_round_the_global_adapter_has_trained(method, tiny_dp_run):
    """opacus issue 820's failure at client level: every factor the clients upload has moved away from the
    broadcast initial adapter (B from zero too), and ε was spent."""
    fr, summary, out = tiny_dp_run(method)
    refs, spec = fr.server._dp_refs[0], fr.method.upload_spec()
    released = [n for n in fr.server.states[0] if n in spec]  # every uploaded tensor some round released
    factors = {n.rsplit(".", 1)[-1] for n in released} - {"head_weight", "head_bias"}  # a shared head: checked too
    assert factors == ({"lora_A"} if method == "fedsa" else {"lora_B"} if method == "ffa" else {"lora_R"}
                       if method in ("fedsb", "h2tune") else {"lora_A", "lora_B"}), factors
    for n in released:
        if n in refs:
            assert not torch.equal(fr.server.states[0][n], refs[n]), n
        else:  # Fed-SB's R is born on the server, from the private initialisation round's gradients
            assert bool(torch.isfinite(fr.server.states[0][n]).all()) and bool(fr.server.states[0][n].abs().sum() > 0), n
    rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()][1:]
    assert all(r["privacy"]["level"] == "client" and r["privacy"]["epsilon"] > 0 for r in rounds)
    assert summary["privacy"]["epsilon"] == rounds[-1]["privacy"]["epsilon"]


@pytest.fixture(scope="module")
def tiny_dp_run(tmp_path_factory):
    """One tiny client-DP run per method (3 clients, all drawn, 2 rounds, σ = 0.5, C = 1)."""
    from fedlora.llm.runtime import FederatedRun
    from test_llm_runtime import tiny_config

    root = tmp_path_factory.mktemp("dp_runs")
    done = {}

    def run(method):
        if method not in done:
            cfg = tiny_config(root / method, method, method__lr=0.05, federation__sample_fraction=1.0,
                              privacy={"level": "client", "noise_multiplier": 0.5, "clip_norm": 1.0, "delta": 1e-3})
            fr = FederatedRun(cfg)
            done[method] = (fr, fr.run(), root / method / "run")
        return done[method]

    return run


def _lines(out):
    return [{k: v for k, v in json.loads(line).items() if k != "wall_s"}
            for line in (out / "rounds.jsonl").read_text().splitlines()]


def test_a_private_run_is_bit_identical_for_a_seed_differs_for_another_and_resumes_with_the_same_epsilon(tmp_path):
    from _run_helpers import interrupted_run, tiny_run
    from fedlora.llm.runs import resume

    dp = ["privacy.level=client", "privacy.noise_multiplier=0.8", "privacy.clip_norm=0.5", "privacy.delta=1e-3",
          "federation.sample_fraction=0.5"]
    a = tiny_run(tmp_path / "a", *dp, "train.rounds=3")
    assert _lines(a) != _lines(tiny_run(tmp_path / "c", *dp, "train.rounds=3", "seed=1"))
    stopped = interrupted_run(tmp_path / "d", rounds=3, stop_before=2, overrides=dp)  # Ctrl-C as round 3 starts
    resume(stopped, progress=False).run()
    # rounds 1–2 rerun with the same seed, round 3 resumed: the noise, the draws and ε as if never stopped
    assert _lines(stopped) == _lines(a)
    assert json.loads((stopped / "summary.json").read_text())["privacy"] == \
        json.loads((a / "summary.json").read_text())["privacy"]


def test_a_run_stops_cleanly_before_the_round_that_would_exceed_its_budget(tmp_path):
    from _run_helpers import tiny_run

    two = PrivacyAccountant()
    two.record(CLIENT_UNIT, 1.0, 2.0, 2)
    budget = two.epsilon(1e-3) * 1.01  # two rounds fit, the third does not
    out = tiny_run(tmp_path / "run", "privacy.level=client", "privacy.noise_multiplier=2.0", "privacy.delta=1e-3",
                   f"privacy.max_epsilon={budget}", "train.rounds=4", "federation.sample_fraction=1.0")
    lines = _lines(out)
    assert [r["round"] for r in lines] == [0, 1, 2]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"]["reason"] == "privacy budget" and summary["stopped"]["rounds_done"] == 2
    assert summary["privacy"]["epsilon"] == lines[-1]["privacy"]["epsilon"] <= budget
    assert json.loads((out / "run.json").read_text())["stopped"] == "privacy budget"
    assert (out / "checkpoints").is_dir() and any((out / "checkpoints").iterdir())
    assert summary["final_test"] == lines[-1]["eval"]["test"]  # the model the run ended with, scored


def _config(**privacy):
    from fedlora.llm.config import RunConfig

    method = privacy.pop("method", "fedavg")
    extra = privacy.pop("extra", {})
    return RunConfig.from_dict({"method": {"name": method}, "privacy": privacy, **extra})


@pytest.mark.parametrize("method", REFUSED)
def test_a_method_without_a_private_aggregate_is_refused_in_one_line(method):
    with pytest.raises(ConfigError) as e:
        _config(method=method, level="client", noise_multiplier=1.0)
    assert "\n" not in str(e.value) and method in str(e.value) and get_method(method).client_dp_refusal in str(e.value)


@pytest.mark.parametrize("privacy, match", [
    ({"level": "client", "noise_multiplier": 1.0, "clip_norm": 0}, "privacy.clip_norm"),
    ({"level": "client", "noise_multiplier": 1.0, "clip_norm": -1}, "privacy.clip_norm"),
    ({"level": "client", "noise_multiplier": -0.1}, "privacy.noise_multiplier"),
    ({"level": "client", "target_epsilon": 0}, "privacy.target_epsilon"),
    ({"level": "client", "target_epsilon": -2}, "privacy.target_epsilon"),
    ({"level": "client", "noise_multiplier": 1.0, "delta": 0}, "privacy.delta"),
    ({"level": "client", "noise_multiplier": 1.0, "delta": 1}, "privacy.delta"),
    ({"level": "client", "noise_multiplier": 1.0, "delta": "often"}, "privacy.delta"),
    ({"level": "client", "noise_multiplier": 1.0, "max_epsilon": 0}, "privacy.max_epsilon"),
    ({"level": "client"}, "exactly one of privacy.noise_multiplier"),
    ({"level": "client", "noise_multiplier": 1.0, "target_epsilon": 3}, "exactly one"),
    ({"level": "everyone"}, "privacy.level"),
    ({"noise_multiplier": 1.0}, "privacy.level is none"),
    ({"level": "client", "noise_multiplier": 1.0, "extra": {"federation": {"min_clients": 2}}},
     "federation.min_clients"),
])
def test_bad_privacy_settings_are_one_line_errors(privacy, match):
    with pytest.raises(ConfigError, match=match) as e:
        _config(**privacy)
    assert "\n" not in str(e.value)


def test_a_budget_the_first_round_already_exceeds_is_refused_before_training(tmp_path):
    from fedlora.llm.config import RunConfig
    from fedlora.llm.privacy import privacy_plan

    cfg = RunConfig.from_dict({"privacy": {"level": "client", "noise_multiplier": 0.3, "max_epsilon": 0.5,
                                           "delta": 1e-5}})
    with pytest.raises(ConfigError, match="the first round alone spends") as e:
        privacy_plan(cfg, 4)
    assert "\n" not in str(e.value)


def test_a_target_epsilon_derives_sigma_that_ends_the_planned_rounds_at_it():
    from fedlora.llm.config import RunConfig
    from fedlora.llm.privacy import privacy_plan

    cfg = RunConfig.from_dict({"federation": {"clients": 10, "sample_fraction": 0.3}, "train": {"rounds": 20},
                               "privacy": {"level": "client", "target_epsilon": 4.0, "delta": 1e-3}})
    plan = privacy_plan(cfg, 10)
    acc = PrivacyAccountant()
    acc.record(CLIENT_UNIT, 0.3, plan.noise_multiplier, 20)
    assert acc.epsilon(1e-3) <= 4.0 and acc.epsilon(1e-3) == pytest.approx(4.0, rel=1e-3)
    assert plan.max_epsilon == 4.0 and plan.client.sampling_rate == 0.3


@pytest.mark.xdist_group("flower")
@pytest.mark.parametrize("method", ["fedavg", "ffa"])
def test_client_level_dp_over_flower_gives_the_embedded_runs_records(method, tmp_path, monkeypatch, capsys):
    """The mechanism lives in the one server protocol, so a Flower deployment (every message to a fresh ClientApp,
    tests/_flower_inprocess.py) draws the same clients, releases the same noised means and reports the same ε."""
    pytest.importorskip("flwr")
    from _flower_inprocess import OneProcessGrid
    from _flower_inprocess import run_as_serverapp
    from _run_compare import adapters, assert_close, assert_same_adapters, records
    from fedlora import flower
    from fedlora.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(flower, "simulate", lambda main_, n: run_as_serverapp(main_, OneProcessGrid(n)))
    argv = ["run", "tiny-smoke", "--set", f"method.name={method}", "--no-progress", "--set", "privacy.level=client",
            "--set", "privacy.noise_multiplier=0.6", "--set", "privacy.clip_norm=0.5", "--set", "privacy.delta=1e-3",
            "--set", "federation.sample_fraction=0.67"]
    assert main([*argv, "--out", str(tmp_path / "embedded")]) == 0, capsys.readouterr().err
    assert main([*argv, "--out", str(tmp_path / "flower"), "--runtime", "flower"]) == 0, capsys.readouterr().err
    emb, flw = records(tmp_path / "embedded"), records(tmp_path / "flower")
    assert all(r["privacy"]["epsilon"] > 0 for r in emb[1:])
    assert_close(emb, flw)
    assert_same_adapters(adapters(tmp_path / "embedded"), adapters(tmp_path / "flower"))


def test_a_dry_run_shows_the_derived_sigma_and_refuses_a_budget_the_first_round_exceeds(tmp_path):
    from fedlora.llm.config import load_config
    from fedlora.llm.runtime import FederatedRun
    from fedlora.privacy.accounting import noise_multiplier_for

    cfg = load_config("tiny-smoke", ["privacy.level=client", "privacy.target_epsilon=3", "privacy.delta=1e-5",
                                     f"output_dir={tmp_path / 'run'}"])
    plan = FederatedRun(cfg).check()["privacy"]
    q = cfg.federation.sample_fraction
    assert plan["noise_multiplier"] == noise_multiplier_for(3.0, 1e-5, q, cfg.train.rounds)
    assert plan["max_epsilon"] == 3.0 and plan["client_sampling_rate"] == q
    bad = load_config("tiny-smoke", ["privacy.level=client", "privacy.noise_multiplier=0.1", "privacy.max_epsilon=5",
                                     f"output_dir={tmp_path / 'bad'}"])
    with pytest.raises(ConfigError, match="the first round alone spends"):
        FederatedRun(bad).check()
    assert not (tmp_path / "bad").exists()


# -- adaptive clipping (Andrew et al., NeurIPS 2021) ---------------------------------------------------------------
def _adaptive(**kw):
    base = dict(clip_norm=0.5, noise_multiplier=0.8, sampling_rate=1.0, seed=5, target_quantile=0.5, clip_lr=0.2,
                count_stddev=1.0)
    return ClientDP(**{**base, **kw})


def test_adaptive_clipping_releases_the_noised_unclipped_fraction_and_moves_c_geometrically():
    dp = _adaptive()
    ref = _reference()
    ex = GivenUploads(ref, scales=[0.01, 0.05, 2.0, 3.0])  # two updates under C = 0.5, two over it
    server = _server(dp, q=1.0)
    rec = server.run_round(ex, 0)
    z_delta = (0.8 ** -2 - 2.0 ** -2) ** -0.5
    assert dp.update_noise_multiplier == pytest.approx(z_delta, rel=1e-12)
    want = _by_hand(ref, [ex.upload(k, 0) for k in range(4)], 0.5, z_delta, 4.0, 5, 0)
    for n in NAMES:
        assert torch.allclose(server.states[0][n].double(), want[n], atol=1e-6), n
    g = torch.Generator().manual_seed(seed_of(5, DP_CLIENT_NOISE, 0, 0))
    for n in sorted(ref):  # the update's noise comes first from the round's stream, then the count's
        torch.randn(ref[n].shape, generator=g)
    norms = rec["privacy"]["update_norm"]
    unclipped = sum(1 for v in norms.values() if v + 1e-6 <= 0.5)
    assert unclipped == 2
    b = (unclipped + float(torch.randn((), generator=g, dtype=torch.float64)) * 1.0) / 4.0
    assert rec["privacy"]["unclipped_fraction"] == [pytest.approx(b, rel=1e-12)]
    assert rec["privacy"]["clip_norm"] == [0.5]
    nxt = 0.5 * math.exp(-0.2 * (b - 0.5))
    assert server._dp_clip == [pytest.approx(nxt, rel=1e-12)]
    assert server.run_round(ex, 1)["privacy"]["clip_norm"] == [pytest.approx(nxt, rel=1e-12)]  # the next round's C


def test_adaptive_clipping_tracks_the_target_quantile_of_the_update_norms():
    K = 100
    scales = [0.02 + 0.02 * k for k in range(K)]  # norms spread over ~10×
    for gamma in (0.3, 0.7):
        dp = _adaptive(clip_norm=0.3, noise_multiplier=0.0, target_quantile=gamma, clip_lr=0.5, count_stddev=K / 20)
        server, ex = _server(dp, rounds=100, K=K, q=1.0), GivenUploads(_reference(), scales)
        for r in range(100):
            rec = server.run_round(ex, r)
        norms = sorted(rec["privacy"]["update_norm"].values())
        quantile = norms[int(gamma * K)]
        assert abs(server._dp_clip[0] - quantile) / quantile < 0.2, (gamma, server._dp_clip[0], quantile)


def test_the_adaptive_clip_norm_is_part_of_the_servers_checkpoint():
    dp = _adaptive()
    server, ex = _server(dp, q=1.0), GivenUploads(_reference(), [0.01, 0.05, 2.0, 3.0])
    server.run_round(ex, 0)
    again = _server(dp, q=1.0)
    again.load_state_dict(json.loads(json.dumps({"meta": server.state_dict()["meta"]})) |
                          {"tensors": server.state_dict()["tensors"]})
    assert again._dp_clip == server._dp_clip != [0.5]
    assert again.run_round(ex, 1) | {"wall_s": 0} == server.run_round(ex, 1) | {"wall_s": 0}


@pytest.mark.parametrize("privacy, match", [
    ({"level": "client", "noise_multiplier": 1.0, "clip_quantile": 1.0}, "privacy.clip_quantile"),
    ({"level": "client", "noise_multiplier": 1.0, "clip_quantile": 0}, "privacy.clip_quantile"),
    ({"level": "client", "noise_multiplier": 1.0, "clip_quantile": 0.5, "clip_lr": 0}, "privacy.clip_lr"),
    ({"level": "client", "noise_multiplier": 1.0, "clip_quantile": 0.5, "clip_count_stddev": -1},
     "privacy.clip_count_stddev"),
    ({"level": "sample", "method": "ffa", "noise_multiplier": 1.0, "clip_quantile": 0.5}, "client-level DP's"),
])
def test_bad_adaptive_clipping_settings_are_one_line_errors(privacy, match):
    with pytest.raises(ConfigError, match=match) as e:
        _config(**privacy)
    assert "\n" not in str(e.value)


def test_adaptive_clipping_needs_a_count_noise_above_half_sigma():
    with pytest.raises(ConfigError, match="2·σ_b > σ"):
        _adaptive(noise_multiplier=2.0, count_stddev=1.0)
    from fedlora.llm.config import RunConfig
    from fedlora.llm.privacy import privacy_plan

    cfg = RunConfig.from_dict({"privacy": {"level": "client", "noise_multiplier": 1.5, "clip_quantile": 0.5,
                                           "delta": 1e-3}})
    plan = privacy_plan(cfg, 4)  # the default σ_b = max(qK/20, σ): never below σ, so z_Δ ≤ 2/√3·σ
    assert plan.client.count_stddev == 1.5
    assert plan.client.update_noise_multiplier == pytest.approx(1.5 * 2 / math.sqrt(3), rel=1e-12)


def test_frlora_updates_are_taken_from_the_initial_adapter_its_clients_restart_from_every_round():
    """FRLoRA's clients restart each round from (B0, A0): the clipped update is U_k − (B0, A0), not U_k − the
    previous round's average (which would clip the wrong vector)."""
    from fedlora.methods.frlora import FRLoRA

    dp = ClientDP(clip_norm=0.3, noise_multiplier=0.0, sampling_rate=1.0, seed=0)
    ref = _reference()
    plan = PrivacyPlan(level="client", delta=1e-3, client=dp)
    server = Server(FRLoRA(rank=2), Federation(1, 4), [{}], 3, privacy=plan, dp_references=[ref])
    ex = GivenUploads(ref, scales=[0.5, 0.7, 0.9, 1.1])
    for rnd in range(2):
        server.run_round(ex, rnd)
        want = _by_hand(ref, [ex.upload(k, rnd) for k in range(4)], 0.3, 0.0, 4.0, 0, rnd)
        for n in NAMES:
            assert torch.allclose(server.states[0][n].double(), want[n], atol=1e-6), (rnd, n)


def test_fedsb_initialisation_gradients_are_their_own_update_and_carry_their_metadata():
    """Fed-SB's first round uploads full-weight gradients (with the rank and η the server's LoRA-SB SVD needs): the
    private release clips each gradient itself (taken against zero) and hands the method's aggregate the noised
    mean with that metadata, so LoRA-SB's initialisation is computed from the private release only."""
    from fedlora.methods.fedsb import GRAD, FedSB, _META_LR, _META_RANK

    K, name = 4, "layer." + GRAD
    meta = {_META_RANK: "2", _META_LR: "0.1"}
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(6, 5, generator=g) * s for s in (0.05, 0.1, 5.0, 9.0)]
    dp = ClientDP(clip_norm=1.0, noise_multiplier=0.0, sampling_rate=1.0, seed=0)
    fedsb = FedSB(rank=2)
    out, info = dp.aggregate(fedsb, [Payload({name: t}, meta) for t in grads], fedsb.client_dp_reference(
        {}, {}, {name: grads[0]}), K, 0, 0)
    clipped = [t * min(1.0, 1.0 / (float(t.norm()) + 1e-6)) for t in grads]
    want = FedSB.aggregate([Payload({name: sum(clipped) / K}, meta)], torch.ones(1, dtype=torch.float64))
    assert info["clipped"] == 2 and set(out) == set(want)
    for n in want:
        assert torch.allclose(out[n], want[n], atol=1e-5), n
    with pytest.raises(ConfigError, match="different metadata"):
        dp.aggregate(fedsb, [Payload({name: grads[0]}, meta), Payload({name: grads[1]}, {**meta, _META_LR: "0.2"})],
                     {name: torch.zeros(6, 5)}, K, 0, 0)
