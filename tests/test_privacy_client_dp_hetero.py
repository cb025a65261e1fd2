"""Client-level DP (DP-FedAvg) in runs of heterogeneous client models (``federation.client_models``, H²Tune;
issue 29 item 1), and H²Tune's first KL target R_g⁰ taken over ALL clients, whoever shares a slot pass.

The federation is tests/test_llm_hetero.py's: clients 0 and 1 classify with a tiny LLaMA (2 blocks), client 2
generates with a tiny Gemma (3 blocks); each uploads one aligned (L_g = 3, r_g, r_g) R per module type. Every
expected value here is written out from what the clients really hold and send (their records after set-up, the
uploads captured on the way to the server) and from dp-accounting itself, not through ``fedlora.privacy``."""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from fedlora.adapter import LoRALinear
from fedlora.errors import ConfigError
from fedlora.llm.config import RunConfig
from fedlora.llm.hetero import HeteroRun
from fedlora.methods import H2Tune
from fedlora.seeds import DP_CLIENT_NOISE, DP_PARTICIPANTS, seed_of

from test_llm_hetero import CONFIG, TYPES

D64 = torch.float64
K, L_G, RANK = 3, 3, 4
SIGMA, CLIP, DELTA = 0.5, 0.02, 1e-3
DP = {"level": "client", "noise_multiplier": SIGMA, "clip_norm": CLIP, "delta": DELTA}


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _config(out: Path, *, seed: int = 0, q: float = 1.0, rounds: int = 2, **privacy) -> RunConfig:
    data = copy.deepcopy(CONFIG)
    data.update(seed=seed, output_dir=str(out), privacy={**DP, **privacy})
    data["federation"]["sample_fraction"] = q
    data["train"]["rounds"] = rounds
    return RunConfig.from_dict(data)


def _lines(out: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k != "wall_s"}
            for line in (out / "rounds.jsonl").read_text().splitlines()]


def _norm(tensors) -> float:
    return math.sqrt(sum(float((v.to(D64) ** 2).sum()) for v in tensors.values()))


def _library_epsilon(q: float, sigma: float, rounds: int, delta: float) -> float:
    import dp_accounting

    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), rounds)
    return acc.get_epsilon(delta)


class _Run:
    """A private hetero run with what crossed to the server captured: per round the uploads and the server's state
    when the round's clients trained (what they started from), and, after set-up, every client's own initial
    upload (its group's slot executor, from its record) and the KL target its record holds."""

    def __init__(self, cfg: RunConfig) -> None:
        self.run = run = HeteroRun(cfg).prepare()
        self.initial, self.targets = {}, {}
        for (ids, _), group in zip(run.specs, run.groups):
            for local, up in group.slots.uploads(range(len(ids))).items():
                self.initial[ids[local]] = {n: v.clone() for n, v in up.tensors.items()}
        for k, rec in run.local.records().items():
            self.targets[k] = {n: rec[f"extra:global_R:{n[:-len('.lora_R')]}"].clone() for n in TYPES}
        self.uploads, self.before = [], []
        real = run.local.train

        def train(rnd, clients, downloads):
            self.before.append({n: v.clone() for n, v in run.server.states[0].items()})
            res = real(rnd, clients, downloads)
            self.uploads.append({k: {n: v.clone() for n, v in u.upload.tensors.items()} for k, u in res.items()})
            return res

        run.local.train = train
        self.summary = run.run()
        self.out = Path(cfg.output_dir)

    def release(self, rnd: int) -> dict[str, torch.Tensor]:
        """The server's R_g after round ``rnd`` (0-based)."""
        return self.before[rnd + 1] if rnd + 1 < len(self.before) else self.run.server.states[0]


@pytest.fixture(scope="module")
def private(tmp_path_factory):
    return _Run(_config(tmp_path_factory.mktemp("dp_hetero") / "run"))


def _first_target(run: _Run) -> dict[str, torch.Tensor]:
    """R_g⁰ by hand: the unweighted mean of the three clients' initial uploads, as their records give them."""
    return {n: torch.stack([run.initial[k][n].to(D64) for k in range(K)]).mean(0) for n in TYPES}


def test_the_first_update_is_taken_from_the_kl_target_every_client_holds(private):
    """R_g⁰ — the mean over the LLaMA and the Gemma clients' initial uploads — is what every client holds as its
    KL target after set-up, and it is not group 0's own mean (the Gemma client alone fills global layer 2)."""
    first = _first_target(private)
    for k in range(K):
        for n in TYPES:
            torch.testing.assert_close(private.targets[k][n].to(D64), first[n], rtol=0, atol=1e-9)
    assert all(float(private.initial[k][n][2].abs().sum()) == 0 for k in (0, 1) for n in TYPES)
    assert all(float(first[n][2].abs().sum()) > 0 for n in TYPES)
    assert private.before[0] == {}  # the server holds no R before round 1: the reference is R_g⁰


def test_the_release_is_the_noised_fixed_denominator_mean_of_the_clipped_aligned_updates(private):
    """Each round: R_g + (Σ_k clip_C(R_{k→g} − R_g) + N(0, σ²C² I)) / (qK), R_g = R_g⁰ in round 1 then the last
    release; the noise drawn in float32 (the uploads' dtype), type by type in sorted order, from the round's own
    stream; clipped over both module types together. float32 arithmetic: |error| ≤ 1e-7 on values below 0.1."""
    run, clipped = private, []
    for rnd in range(2):
        ref = _first_target(run) if rnd == 0 else {n: v.to(D64) for n, v in run.before[rnd].items()}
        ups = run.uploads[rnd]
        assert sorted(ups) == [0, 1, 2]
        deltas = [{n: ups[k][n].to(D64) - ref[n] for n in TYPES} for k in range(K)]
        rec = _lines(run.out)[rnd + 1]["privacy"]
        assert [rec["update_norm"][str(k)] for k in range(K)] == pytest.approx([_norm(d) for d in deltas], rel=1e-5)
        factors = [min(1.0, CLIP / (_norm(d) + 1e-6)) for d in deltas]
        clipped += [f < 1 for f in factors]
        assert rec["clipped"] == sum(f < 1 for f in factors)
        gen = torch.Generator().manual_seed(seed_of(0, DP_CLIENT_NOISE, rnd, 0))
        noise = {n: torch.randn(L_G, RANK, RANK, generator=gen, dtype=torch.float32).to(D64) * SIGMA * CLIP
                 for n in sorted(TYPES)}
        released = run.release(rnd)
        assert set(released) == TYPES and all(tuple(v.shape) == (L_G, RANK, RANK) for v in released.values())
        for n in TYPES:
            expected = ref[n] + (sum(f * d[n] for f, d in zip(factors, deltas)) + noise[n]) / (1.0 * K)
            torch.testing.assert_close(released[n].to(D64), expected, rtol=0, atol=1e-7)
    assert any(clipped) and not all(clipped)  # C = 0.02 clips some updates, not all


def test_epsilon_in_every_record_and_the_summary_is_the_librarys(private):
    lines = _lines(private.out)[1:]
    for r, line in enumerate(lines, 1):
        assert line["privacy"]["epsilon"] == pytest.approx(_library_epsilon(1.0, SIGMA, r, DELTA), rel=1e-9)
        assert line["privacy"]["delta"] == DELTA
    summary = json.loads((private.out / "summary.json").read_text())
    assert summary["privacy"]["epsilon"] == lines[-1]["privacy"]["epsilon"] and summary["privacy"]["rounds_run"] == 2
    assert summary["privacy"]["noise_multiplier"] == SIGMA and summary["privacy"]["clip_norm"] == CLIP
    resolved = json.loads((private.out / "config.json").read_text())["resolved"]
    assert resolved["privacy"]["client_sampling_rate"] == 1.0 and resolved["privacy"]["delta"] == DELTA
    assert all("privacy" not in g for g in resolved["groups"])  # one plan, the run's: no group has its own


def test_the_private_rounds_trained_the_adapters(private):
    """The clipped updates are not zero, the release moved off R_g⁰ in every module type, and every client's own
    factors trained: B away from its zero init, R away from the seeded R_init."""
    first = _first_target(private)
    for rnd in range(2):
        assert all(not torch.allclose(private.release(rnd)[n].to(D64), first[n]) for n in TYPES)
    recs = private.run.local.records()
    for k in range(K):
        bs = [v for n, v in recs[k].items() if n.endswith("lora_B")]
        assert bs and all(float(b.abs().sum()) > 0 for b in bs), k
        r0 = "param:model.layers.0.self_attn.q_proj.lora_R"
        assert not torch.equal(recs[k][r0], private.initial[k]["model.layers.*.self_attn.q_proj.lora_R"][0]), k


def test_the_same_seed_resumes_bit_identically_another_seed_differs(private, tmp_path):
    """Stopped after round 1 (Ctrl-C) and resumed from its checkpoint: the draws, the noise and ε of round 2 are the
    uninterrupted run's, bit for bit (the accountant is in the server's checkpoint). Seed 1 gives other numbers."""
    from fedlora.llm.driver import Driver
    from fedlora.llm.runs import resume

    real = Driver.run_round

    def run_round(self, rnd):
        if rnd == 1:
            raise KeyboardInterrupt
        return real(self, rnd)

    stopped = tmp_path / "stopped"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Driver, "run_round", run_round)
        with pytest.raises(KeyboardInterrupt):
            HeteroRun(_config(stopped)).run()
    assert len(_lines(stopped)) == 2  # round 0's evaluation and round 1
    resume(stopped, progress=False).run()
    assert _lines(stopped) == _lines(private.out)
    assert json.loads((stopped / "summary.json").read_text())["privacy"] == \
        json.loads((private.out / "summary.json").read_text())["privacy"]
    other = tmp_path / "other"
    HeteroRun(_config(other, seed=1, rounds=1)).run()
    a, b = _lines(private.out)[1], _lines(other)[1]
    assert a["privacy"]["epsilon"] == b["privacy"]["epsilon"]  # the same mechanism …
    assert a["privacy"]["update_norm"] != b["privacy"]["update_norm"]  # … on other numbers


def test_poisson_draws_over_all_clients_and_the_run_stops_before_the_round_past_its_budget(tmp_path):
    """q = 0.5: each round's participants are the Poisson draw over all three clients (written out), every round —
    an empty draw too — spends one subsampled Gaussian step (the library's ε), and a budget between two and three
    rounds' ε stops the run cleanly before round 3, with its summary, adapters and run.json."""
    budget = (_library_epsilon(0.5, SIGMA, 2, DELTA) + _library_epsilon(0.5, SIGMA, 3, DELTA)) / 2
    out = tmp_path / "run"
    HeteroRun(_config(out, q=0.5, rounds=4, max_epsilon=budget)).run()
    lines = _lines(out)
    assert [r["round"] for r in lines] == [0, 1, 2]
    for r, line in enumerate(lines[1:]):
        g = torch.Generator().manual_seed(seed_of(0, DP_PARTICIPANTS, r, 0))
        u = torch.rand(K, generator=g, dtype=D64)
        assert line["participants"] == [k for k in range(K) if float(u[k]) < 0.5]
        assert line["privacy"]["epsilon"] == pytest.approx(_library_epsilon(0.5, SIGMA, r + 1, DELTA), rel=1e-9)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"]["reason"] == "privacy budget" and summary["stopped"]["rounds_done"] == 2
    assert summary["privacy"]["epsilon"] == lines[-1]["privacy"]["epsilon"] <= budget
    assert json.loads((out / "run.json").read_text())["stopped"] == "privacy budget"
    assert sorted(p.name for p in (out / "adapters").iterdir()) == [f"client_{k}.safetensors" for k in range(K)]


def test_a_dry_run_gives_the_runs_plan_over_all_clients(tmp_path):
    """σ derived from a target ε over the run's K = 3 clients (δ auto = 1/(2K)), not a group's."""
    from fedlora.llm.privacy import describe_plan, privacy_plan

    cfg = _config(tmp_path / "dry", q=1.0, noise_multiplier=None, target_epsilon=8.0, delta="auto")
    checked = HeteroRun(cfg, write=False).check()
    assert checked["privacy"] == describe_plan(privacy_plan(cfg, K))
    assert checked["privacy"]["delta"] == pytest.approx(1 / 6)
    assert _library_epsilon(1.0, checked["privacy"]["noise_multiplier"], 2, 1 / 6) == pytest.approx(8.0, rel=1e-3)


def test_sample_level_dp_runs_in_every_group_with_the_runs_one_plan(tmp_path):
    """privacy.level: sample with heterogeneous client models: each group's slot executor runs H²Tune's private
    steps with the run's σ and each client's own rate b/n_k (its run-wide id's), its streams keyed by that id (client
    0 of each group draws its own), and every client's ε in the records is dp-accounting's for 2 releases × its local
    steps per round it trained in; the private rounds train every client's R."""
    import dp_accounting

    out = tmp_path / "sample"
    cfg = _config(out, level="sample", noise_multiplier=1.2, clip_norm=1.0, delta=1e-3)
    run = HeteroRun(cfg).prepare()
    plan = run.privacy_plan
    assert plan.level == "sample" and plan.releases_per_step == 2
    firsts = []
    for (ids, _), group in zip(run.specs, run.groups):
        sdp = group.slots.sample_dp
        assert sdp is not None and sdp.noise_multiplier == 1.2 and group.method.sample_dp is sdp
        assert [sdp.rate(i) for i in range(len(ids))] == [plan.sample_rates[k] for k in ids]
        assert sdp.stream_ids == dict(enumerate(ids))
        sdp.at(0, 0)
        firsts.append(sdp.generator("noise", 0).initial_seed())
    assert len(set(firsts)) == len(firsts)  # each group's local client 0 is another client of the run
    before = {k: {n: v.clone() for n, v in rec.items() if n.endswith("lora_R")} for k, rec in run.local.records().items()}
    run.run()
    after = run.local.records()
    assert all(not torch.equal(before[k][n], after[k][n]) for k in before for n in before[k])
    lines = _lines(out)[1:]
    done = {str(k): 0 for k in range(K)}
    for rec in lines:
        for k in rec["participants"]:
            done[str(k)] += 1
        for k, eps in rec["privacy"]["epsilon_by_client"].items():
            acc = dp_accounting.rdp.RdpAccountant()
            acc.compose(dp_accounting.PoissonSampledDpEvent(plan.sample_rates[int(k)], dp_accounting.GaussianDpEvent(
                1.2)), 2 * plan.sample_steps[int(k)] * done[k])
            assert eps == pytest.approx(acc.get_epsilon(1e-3), rel=1e-9), k
    # the dry run derives the plan the run resolved (each group's sizes and steps, in the run's client order)
    dry = HeteroRun(_config(tmp_path / "dry", level="sample", noise_multiplier=1.2, clip_norm=1.0, delta=1e-3),
                    write=False).check()["privacy"]
    assert dry == json.loads((out / "config.json").read_text())["resolved"]["privacy"]


@pytest.mark.parametrize("privacy, match", [
    ({"level": "client", "noise_multiplier": 1.0, "clip_norm": 0.0}, r"privacy.clip_norm"),
])
def test_what_a_hetero_run_cannot_do_under_dp_is_refused_in_one_line(tmp_path, privacy, match):
    with pytest.raises(ConfigError, match=match) as e:
        data = copy.deepcopy(CONFIG)
        data.update(output_dir=str(tmp_path), privacy=privacy)
        RunConfig.from_dict(data)
    assert "\n" not in str(e.value)
    data = copy.deepcopy(CONFIG)
    data.update(privacy=DP)
    data["federation"]["min_clients"] = 2
    with pytest.raises(ConfigError, match=r"federation.min_clients: must be 1 under client-level DP"):
        RunConfig.from_dict(data)


# --- H²Tune's first KL target: over all clients, whoever shares a slot pass --------------------------------------
def _bound(clients, layers, omega_init="random"):
    model = nn.ModuleList([LoRALinear(4, 4, 2, middle=True, stack=len(clients), dtype=D64) for _ in range(3)])
    m = H2Tune(rank=2, r_init_std=0.3, omega_init=omega_init, client_layers=layers, seed=3)
    m.setup(model, clients, n_clients=3)
    return m


@pytest.mark.parametrize("omega_init, layers", [("random", [3, 3, 3]), ("identity", [3, 2, 1])])
def test_a_clients_first_kl_target_does_not_depend_on_its_pass_mates(omega_init, layers):
    """Bound alone (one client per pass) or with the two others, client k starts from the same target: R_g⁰ over
    ALL three clients — with random Ω_k or different depths, a pass's own mean would differ (checked)."""
    together = _bound([0, 1, 2], layers, omega_init)
    R0 = together.initial_global_R(0)["*.lora_R"]
    own = torch.stack([together.upload(i).tensors["*.lora_R"] for i in range(3)])
    assert torch.equal(together.global_R["*"][0], R0)
    torch.testing.assert_close(R0, own.mean(0), rtol=0, atol=1e-15)  # the mean of the real initial uploads
    for k in range(3):
        alone = _bound([k], layers, omega_init)
        assert not torch.allclose(alone.upload(0).tensors["*.lora_R"], R0)  # its own upload is not the mean
        assert torch.equal(alone.global_R["*"][0], together.global_R["*"][k]), k
    pair = _bound([0, 1], layers, omega_init)
    assert torch.equal(pair.global_R["*"][1], together.global_R["*"][1])


def test_clients_per_pass_one_or_all_gives_the_same_client_records(tmp_path):
    """A homogeneous tiny run of H²Tune with random Ω_k: every client's record after set-up (its KL target included)
    is the same bit for bit with one client per slot pass and with all four in one."""
    from fedlora.llm.runtime import FederatedRun

    records = []
    for p in (1, 4):
        cfg = RunConfig.from_dict({"tiny": True, "method": {"name": "h2tune", "options": {"omega_init": "random"}},
                                   "federation": {"clients_per_pass": p}, "output_dir": str(tmp_path / str(p))})
        run = FederatedRun(cfg, write=False).prepare()
        records.append({k: run.slots.store.get(k) for k in range(cfg.federation.clients)})
    a, b = records
    assert a.keys() == b.keys() and len(a) == 4
    for k in a:
        assert a[k].keys() == b[k].keys()
        assert any(n.startswith("extra:global_R") for n in a[k])
        for n in a[k]:
            assert torch.equal(a[k][n], b[k][n]), (k, n)
