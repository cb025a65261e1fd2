"""Client-level DP (DP-FedAvg) for LoRA-A² and H²Tune (issue 29 item 1): what each clips, what it releases, what
the first round's update is taken from, and that private rounds train, reproducibly.

Every expected value is written out here from the uploads the clients really sent (captured on the wire), not
from ``fedlora.privacy``'s code path: LoRA-A²'s dense masked delta from its (values, indices), H²Tune's update
from the KL target the clients really hold."""
import math

import pytest
import torch
from torch import nn
from torch.func import functional_call

from fedlora.adapter import LoRALinear
from fedlora.errors import ConfigError
from fedlora.methods import H2Tune, LoRAA2
from fedlora.payload import Payload
from fedlora.privacy.client_dp import ClientDP, DenseUpdates
from fedlora.privacy.plan import PrivacyPlan
from fedlora.seeds import DP_CLIENT_NOISE, seed_of
from fedlora.server import Federation, Server
from fedlora.simulator import StackedExecutor

D64 = torch.float64
K, R_G = 4, 4
pytestmark = pytest.mark.filterwarnings("ignore:h2tune. no output_fn")


class Net(nn.Module):
    """Two adapted layers 5 → 6 → 3 (modules "l0", "l1"), stacked over K replicas, frozen random bases."""

    def __init__(self, middle=False):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        kw = dict(stack=K, dtype=D64, middle=middle)
        self.l0 = LoRALinear(5, 6, R_G, base_weight=torch.randn(6, 5, generator=g, dtype=D64), **kw)
        self.l1 = LoRALinear(6, 3, R_G, base_weight=torch.randn(3, 6, generator=g, dtype=D64), **kw)
        with torch.no_grad():  # A from this seed (PEFT's init draws from the global stream), B = 0 as PEFT's
            for layer in (self.l0, self.l1):
                layer.lora_A.copy_(torch.randn(layer.lora_A.shape, generator=g, dtype=D64) * 0.5)

    def forward(self, x):
        return self.l1(torch.tanh(self.l0(x)))


def _data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(K, 16, 5, generator=g, dtype=D64), torch.randint(0, 3, (K, 16), generator=g)


def _objective(model):
    def objective(params, batch):
        return nn.functional.cross_entropy(functional_call(model, dict(params), (batch[0],)).transpose(1, 2),
                                           batch[1], reduction="none").mean(-1)
    return objective


def _method(name):
    model = Net(middle=name == "h2tune")
    if name == "lora-a2":  # budgets 1..3 of r_G = 4: every client selects a different set of ranks
        m = LoRAA2(rank=R_G, lr=0.05, client_ranks=[1, 2, 3, 2], probe_steps=1, optimizer="sgd")
    else:
        m = H2Tune(rank=R_G, lr=0.1, r_init_std=0.3, optimizer="sgd", densities=[1.0, 0.5, 0.8, 1.0])
    m.setup(model, list(range(K)))
    return m, model


class Run:
    """A server with client-level DP over a stacked federation of K clients; ``uploads[r]``: what each client sent
    in round r, ``before[r]``: the server's state when round r started."""

    def __init__(self, name, clip, sigma, q=1.0, seed=0, rounds=2):
        self.method, model = _method(name)
        self.dp = ClientDP(clip_norm=clip, noise_multiplier=sigma, sampling_rate=q, seed=seed)
        plan = PrivacyPlan(level="client", delta=1e-3, noise_multiplier=sigma, client=self.dp)
        fed = Federation(n_groups=1, n_clients=K, sample_fraction=q, sample_seed=0)
        self.server = Server(self.method, fed, [self.method.initial_server_state(0)], rounds, privacy=plan,
                             dp_references=[{}])
        self.uploads, self.before, self.records = [], [], []
        batch = _data()
        self.executor = StackedExecutor(self.method, fed, _objective(model), lambda: batch, 2,
                                        on_payload=lambda d, i, p: self.uploads[-1].__setitem__(i, p) if d == "up"
                                        else None)
        self.initial_R = {t: v.clone() for t, v in getattr(self.method, "global_R", {}).items()}

    def after(self, rnd):
        """The server's state when round ``rnd`` ended."""
        return self.before[rnd + 1] if rnd + 1 < len(self.before) else self.server.states[0]

    def round(self):
        self.uploads.append({})
        self.before.append({n: v.clone() for n, v in self.server.states[0].items()})
        self.records.append(self.server.run_round(self.executor))
        return self.records[-1]


def _noise(seed, rnd, shapes, std):
    """The round's N(0, std²) per name, drawn name by name in sorted order from the round's own stream."""
    g = torch.Generator().manual_seed(seed_of(seed, DP_CLIENT_NOISE, rnd, 0))
    return {n: torch.randn(shapes[n], generator=g, dtype=D64) * std for n in sorted(shapes)}


def _dense(upload, factor, shapes):
    """LoRA-A²'s upload densified by hand: the selected columns of ΔB (rows of ΔA) at their indices, zero elsewhere."""
    out = {n: torch.zeros(s, dtype=D64) for n, s in shapes.items()}
    for key, idx in upload.tensors.items():
        if key.endswith(".indices"):
            n = key[: -len(".indices")]
            vals = upload.tensors[n + ".values"].to(D64)
            for j, i in enumerate(idx.tolist()):
                if factor == "B":
                    out[n][:, i] = vals[:, j]
                else:
                    out[n][i, :] = vals[j, :]
    return out


def _norm(tensors):
    return math.sqrt(sum(float((v.to(D64) ** 2).sum()) for v in tensors.values()))


def _clipped_sum(deltas, C):
    total = {n: torch.zeros_like(v) for n, v in deltas[0].items()}
    for d in deltas:
        f = min(1.0, C / (_norm(d) + 1e-6))
        for n in d:
            total[n] += f * d[n]
    return total


# --- LoRA-A² ---------------------------------------------------------------------------------------------------
def _two_rounds(method: str, clip: float, seed: int) -> "Run":
    """Two private rounds of ``method`` (σ = 0.7), every upload, state and record kept."""
    run = Run(method, clip=clip, sigma=0.7, seed=seed)
    run.round(), run.round()
    return run


@pytest.fixture(scope="module")
def a2_noised():
    return _two_rounds("lora-a2", clip=0.1, seed=3)


def test_lora_a2_release_is_the_noised_fixed_denominator_mean_of_clipped_dense_masked_deltas(a2_noised):
    """B_saved + (Σ_k clip(ΔB_k ⊙ M_k) + N(0, σ²C² I)) / (qK) on EVERY coordinate of the round's factor (B in round
    1, A in round 2); the other factor untouched; the record's norms are ‖values_k‖, the clients' true norms."""
    run, clipped = a2_noised, []
    for rnd, factor in ((0, "B"), (1, "A")):
        before, ups, rec = run.before[rnd], run.uploads[rnd], run.records[rnd]
        shapes = {n: tuple(v.shape) for n, v in before.items() if n.endswith("lora_" + factor)}
        dense = [_dense(ups[k], factor, shapes) for k in range(K)]
        norms = [math.sqrt(sum(float((v ** 2).sum()) for n, v in ups[k].tensors.items() if n.endswith(".values")))
                 for k in range(K)]
        assert [rec["privacy"]["update_norm"][str(k)] for k in range(K)] == pytest.approx(norms, rel=1e-12)
        clipped += [v > 0.1 for v in norms]
        assert rec["privacy"]["clipped"] == sum(v > 0.1 for v in norms)
        total, noise = _clipped_sum(dense, 0.1), _noise(3, rnd, shapes, 0.7 * 0.1)
        after = run.after(rnd)
        for n in before:
            if n in shapes:
                torch.testing.assert_close(after[n], before[n] + (total[n] + noise[n]) / K, rtol=0, atol=1e-12)
                assert bool((after[n] != before[n]).all()), n  # noise on every coordinate, selected or not
            else:
                assert torch.equal(after[n], before[n]), n
        # the selection differs by client: some coordinate was selected by nobody, and it moved (noise alone)
        unselected = {n: (torch.stack([d[n] for d in dense]) == 0).all(0) for n in shapes}
        assert any(bool(u.any()) for u in unselected.values())
    assert any(clipped) and not all(clipped)  # clipped and unclipped updates alike


def test_lora_a2_sampled_round_divides_by_the_expected_count_not_the_drawn_one():
    """q = 0.5: each client drawn independently; the release divides by qK = 2 whoever was drawn."""
    q = 0.5
    seed = next(s for s in range(200) if len(ClientDP(1.0, 1.0, q, seed=s).participants(0, 0, K)) == 3)
    run = Run("lora-a2", clip=0.1, sigma=0.7, q=q, seed=seed, rounds=1)
    rec = run.round()
    drawn = rec["participants"]
    assert len(drawn) == 3 and sorted(run.uploads[0]) == drawn
    before = run.before[0]
    shapes = {n: tuple(v.shape) for n, v in before.items() if n.endswith("lora_B")}
    total = _clipped_sum([_dense(run.uploads[0][k], "B", shapes) for k in drawn], 0.1)
    noise = _noise(seed, 0, shapes, 0.07)
    for n in shapes:
        torch.testing.assert_close(run.server.states[0][n], before[n] + (total[n] + noise[n]) / (q * K), rtol=0,
                                   atol=1e-12)


def test_lora_a2_every_clipped_update_has_norm_at_most_c(a2_noised):
    """Each real upload alone through the mechanism with σ = 0: (release − B_saved)·qK is the clipped update,
    Δ·min(1, C/(‖Δ‖ + 1e-6)), of norm ≤ C, over all modules together (the whole payload)."""
    run = a2_noised
    m = run.method
    for C in (0.01, 0.05, 1e3):
        dp = ClientDP(clip_norm=C, noise_multiplier=0.0, sampling_rate=1.0)
        for rnd, factor in ((0, "B"), (1, "A")):
            shapes = {n: tuple(v.shape) for n, v in run.before[rnd].items() if n.endswith("lora_" + factor)}
            for k in range(K):
                out, info = dp.aggregate(m, [run.uploads[rnd][k]], run.before[rnd], K, rnd, 0)
                step = {n[: -len(".delta")]: v * K for n, v in out.items()}
                d = _dense(run.uploads[rnd][k], factor, shapes)
                assert set(step) == set(shapes) and _norm(step) <= C + 1e-9
                assert info["update_norms"] == [pytest.approx(_norm(d), rel=1e-12)]
                f = min(1.0, C / (_norm(d) + 1e-6))
                for n in shapes:
                    torch.testing.assert_close(step[n], f * d[n], rtol=0, atol=1e-12)


def test_lora_a2_without_noise_or_clipping_equals_its_own_aggregate_with_equal_weights():
    """σ = 0, C huge, q = 1: B_saved + Σ_k ΔB_k ⊙ M_k / K — Algorithm 1 of LoRA-A² with w_k = 1/K (diluted by the
    clients that did not select a coordinate, never renormalised per coordinate)."""
    run = Run("lora-a2", clip=1e6, sigma=0.0)
    for rnd, factor in ((0, "B"), (1, "A")):
        run.round()
        before, ups = run.before[rnd], run.uploads[rnd]
        shapes = {n: tuple(v.shape) for n, v in before.items() if n.endswith("lora_" + factor)}
        dense = [_dense(ups[k], factor, shapes) for k in range(K)]
        own = LoRAA2.aggregate([ups[k] for k in range(K)], torch.full((K,), 1 / K, dtype=D64))
        assert run.records[-1]["privacy"]["clipped"] == 0
        for n in shapes:
            want = before[n] + sum(d[n] for d in dense) / K
            torch.testing.assert_close(run.server.states[0][n], want, rtol=0, atol=1e-14)
            torch.testing.assert_close(run.server.states[0][n], before[n] + own[n + ".delta"], rtol=0, atol=1e-14)


def test_lora_a2_round_with_nobody_drawn_releases_noise_on_its_whole_factor_from_the_first_round():
    """Poisson sampling that draws nobody still releases N(0, σ²C²)/(qK) on every coordinate of the round's factor —
    the first round too (the server holds the factors from the start)."""
    q, seed = 0.05, 0
    first_empty = next(s for s in range(200) if not ClientDP(1.0, 1.0, q, seed=s).participants(0, 0, K))
    run = Run("lora-a2", clip=0.5, sigma=1.0, q=q, seed=first_empty, rounds=1)
    rec = run.round()
    assert rec["participants"] == [] and rec["privacy"]["noise_only"] == [0]
    before = run.before[0]
    shapes = {n: tuple(v.shape) for n, v in before.items() if n.endswith("lora_B")}
    noise = _noise(first_empty, 0, shapes, 0.5)
    for n in before:
        want = before[n] + noise[n] / (q * K) if n in shapes else before[n]
        torch.testing.assert_close(run.server.states[0][n], want, rtol=0, atol=1e-12)


def test_lora_a2_upload_of_the_wrong_factor_is_a_one_line_error(a2_noised):
    run = a2_noised
    dp = ClientDP(clip_norm=1.0, noise_multiplier=0.0, sampling_rate=1.0)
    assert isinstance(run.method, DenseUpdates) and not isinstance(H2Tune(), DenseUpdates)
    with pytest.raises(ConfigError, match="factor 'B' in a round that releases") as e:
        dp.aggregate(run.method, [run.uploads[0][0]], run.before[1], K, 1, 0)  # a B-round upload in an A-round
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="no lora_B factor"):
        LoRAA2.client_dp_space({}, 0)


# --- H²Tune ----------------------------------------------------------------------------------------------------
def first_types(run):
    return sorted(run.initial_R)


def _h2_deltas(run, rnd, ref):
    return [{n: run.uploads[rnd][k].tensors[n].to(D64) - ref[n].to(D64) for n in ref} for k in range(K)]


@pytest.fixture(scope="module")
def h2_noised():
    return _two_rounds("h2tune", clip=0.05, seed=5)


def test_h2tune_first_update_is_taken_from_the_kl_target_the_clients_hold_then_from_the_servers_r(h2_noised):
    """Round 1: R_g⁰ = the KL target every client received at set-up (the mean of the initial uploads; the server
    holds no R yet); later rounds: the server's R_g. Release R + (Σ_k clip(R_{k→g} − R) + N(0, σ²C² I)) / (qK)."""
    run, clipped = h2_noised, []
    first = {f"{t}.lora_R": run.initial_R[t][0] for t in run.initial_R}
    assert all(torch.equal(run.initial_R[t][0], run.initial_R[t][k]) for t in run.initial_R for k in range(K))
    assert run.before[0] == {} and set(first) == {"l0.lora_R", "l1.lora_R"}  # two module types: one payload
    for n, v in run.method.initial_global_R(0).items():
        torch.testing.assert_close(v, first[n], rtol=0, atol=1e-15)
    for rnd in range(2):
        ref = first if rnd == 0 else run.before[rnd]
        deltas = _h2_deltas(run, rnd, ref)
        rec = run.records[rnd]["privacy"]
        assert [rec["update_norm"][str(k)] for k in range(K)] == pytest.approx([_norm(d) for d in deltas], rel=1e-12)
        clipped += [_norm(d) > 0.05 for d in deltas]
        assert rec["clipped"] == sum(_norm(d) > 0.05 for d in deltas)
        total, noise = _clipped_sum(deltas, 0.05), _noise(5, rnd, {n: tuple(v.shape) for n, v in ref.items()}, 0.035)
        for n in ref:
            torch.testing.assert_close(run.after(rnd)[n], ref[n] + (total[n] + noise[n]) / K, rtol=0, atol=1e-12)
    assert any(clipped) and not all(clipped)
    # what the clients then hold as their KL target is the private release (delivered to every drawn client)
    for k in range(K):
        assert all(torch.equal(run.method.global_R[t][k], run.server.states[0][f"{t}.lora_R"]) for t in first_types(run))


def test_h2tune_without_noise_or_clipping_equals_its_own_unweighted_mean():
    """σ = 0, C huge, q = 1: R_g = R + Σ_k (R_{k→g} − R)/K = (1/K) Σ_k R_{k→g}, H²Tune's App. A mean."""
    run = Run("h2tune", clip=1e6, sigma=0.0)
    for rnd in range(2):
        run.round()
        own = H2Tune.aggregate([run.uploads[rnd][k] for k in range(K)], torch.ones(K, dtype=D64))
        assert set(own) == set(run.server.states[0]) == {"l0.lora_R", "l1.lora_R"}
        for n in own:
            ups = [run.uploads[rnd][k].tensors[n] for k in range(K)]
            torch.testing.assert_close(run.server.states[0][n], sum(ups) / K, rtol=0, atol=1e-14)
            torch.testing.assert_close(run.server.states[0][n], own[n], rtol=0, atol=1e-14)


def test_h2tune_every_clipped_update_has_norm_at_most_c(h2_noised):
    run = h2_noised
    first = {f"{t}.lora_R": run.initial_R[t][0] for t in first_types(run)}
    for C in (0.01, 0.05, 1e3):
        dp = ClientDP(clip_norm=C, noise_multiplier=0.0, sampling_rate=1.0)
        for rnd in range(2):
            ref = first if rnd == 0 else run.before[rnd]
            for k, d in enumerate(_h2_deltas(run, rnd, ref)):
                out, _ = dp.aggregate(run.method, [run.uploads[rnd][k]], ref, K, rnd, 0)
                step = {n: (out[n] - ref[n]) * K for n in ref}
                assert _norm(step) <= C + 1e-9
                for n in ref:
                    torch.testing.assert_close(step[n], min(1.0, C / (_norm(d) + 1e-6)) * d[n], rtol=0, atol=1e-12)


def test_h2tune_over_several_federations_needs_each_ones_initial_r():
    model = nn.ModuleList([LoRALinear(4, 4, 2, middle=True, stack=4, dtype=D64) for _ in range(2)])
    m = H2Tune(rank=2, r_init_std=0.3)
    m.setup(model, [0, 1, 0, 1])
    up = {"*.lora_R": torch.zeros(2, 2, 2, dtype=D64)}
    with pytest.raises(ConfigError, match="2 federations give the server each one's initial_global_R") as e:
        m.client_dp_reference({}, {}, up)
    assert "\n" not in str(e.value)
    refs = [m.initial_global_R(f) for f in range(2)]
    assert not torch.equal(refs[0]["*.lora_R"], refs[1]["*.lora_R"])  # each federation's own seed
    for f in range(2):  # each equals the target federation f's clients hold
        assert torch.equal(m.client_dp_reference({}, refs[f], up)["*.lora_R"], refs[f]["*.lora_R"])
        torch.testing.assert_close(refs[f]["*.lora_R"], m.global_R["*"][2 * f], rtol=0, atol=1e-15)


# --- both ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["lora-a2", "h2tune"])
def test_after_private_rounds_the_shared_adapter_has_trained_from_the_clipped_updates_alone(name):
    """opacus issue 820 at client level, with σ = 0 so that only the clipped training moves anything: LoRA-A²'s
    B (round 1) and A (round 2) on the server and on every client; H²Tune's R_g and every client's KL target."""
    run = Run(name, clip=0.5, sigma=0.0)
    run.round(), run.round()
    state = run.server.states[0]
    if name == "lora-a2":
        init = run.before[0]
        for n in init:
            assert not torch.equal(state[n], init[n]), n
            assert all(torch.equal(run.method.params[n][k], state[n]) for k in range(K)), n
    else:
        for t in first_types(run):
            assert float((state[f"{t}.lora_R"] - run.initial_R[t][0]).abs().max()) > 1e-4, t
            assert all(torch.equal(run.method.global_R[t][k], state[f"{t}.lora_R"]) for k in range(K)), t


@pytest.mark.parametrize("name", ["lora-a2", "h2tune"])
def test_a_private_run_is_bit_identical_for_a_seed_and_differs_for_another(name):
    def states(seed):
        run = Run(name, clip=0.1, sigma=0.8, q=0.75, seed=seed)
        recs = [{k: v for k, v in run.round().items() if k != "wall_s"} for _ in range(2)]
        return run.server.states[0], recs

    (a, ra), (b, rb), (c, rc) = states(1), states(1), states(2)
    assert ra == rb and set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)
    assert ra != rc and any(not torch.equal(a[n], c[n]) for n in a)
