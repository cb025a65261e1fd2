"""Sample-level DP-SGD (fedlora.privacy.dpsgd, issue 29 item 2): per-sample gradients through our slot layers equal a
per-example loop (float64), the private gradient equals clip-sum-noise-divide computed by hand from the per-example
gradients and the client's own noise stream, clipped norms stay ≤ C, the noise has the std of its formula, a client's
update does not depend on its pass-mates, same seed → bit-identical and resumable without saved state, every supported
method's factors train (opacus issue 820), refused methods say why in one line, and DP off changes nothing."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedlora.errors import ConfigError
from fedlora.methods.base import Method, available_methods, get_method
from fedlora.privacy import dpsgd
from fedlora.methods.h2tune import output_kl
from fedlora.privacy.dpsgd import DP_MASK, SampleDP, capture, per_sample_grads, private_gradients
from fedlora.seeds import DP_SAMPLE, seed_of

F64 = torch.float64
#: the methods whose local step takes private gradients (docs/concepts/privacy.md, "Sample-level DP-SGD")
SUPPORTED = {"fedavg", "ffa", "rolora", "fedsvd", "fedsb", "fedsa", "fedex", "flora", "frlora", "lora-fair", "local",
             "perfedavg", "flexlora", "hetlora", "feddpa", "h2tune", "centralized", "lora-a2", "pf2lora"}


# ---------------------------------------------------------------------------------------------------------------
# a tiny slot model: two adapted layers and a trained head, float64
class _Tiny(nn.Module):
    def __init__(self, d=6, h=5, c=3):
        super().__init__()
        self.l1, self.l2, self.classifier = nn.Linear(d, h), nn.Linear(h, h), nn.Linear(h, c)

    def forward(self, x):  # x (S·b, T, d) → logits (S·b, c)
        return self.classifier(torch.tanh(self.l2(torch.tanh(self.l1(x)))).mean(1))


def _tiny(S, seed=0, r=2, alpha=3.0, client_rank=0, middle=False):
    from fedlora.llm.inject import inject_adapters, make_head_trainable

    torch.manual_seed(seed)
    model = _Tiny().double()
    inject_adapters(model, ["l1", "l2"], rank=r, slots=S, alpha=alpha, client_rank=client_rank,
                    client_alpha=5.0 if client_rank else None, middle=middle)
    make_head_trainable(model, S)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g, dtype=F64) * 0.7)  # B ≠ 0: both factors have gradients
    return model


def _params(model):
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _data(S, b, T=4, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(S * b, T, 6, generator=g, dtype=F64), torch.randint(0, 3, (S * b,), generator=g)


def _summed(model, x, y, mask, S, scale=1.0):
    """(S,): each slot's Σ of its real rows' cross-entropy (padded rows exactly 0, as the slot executor's)."""
    ce = F.cross_entropy(model(x), y, reduction="none") * scale
    return torch.where(mask.bool(), ce, torch.zeros((), dtype=ce.dtype)).view(S, -1).sum(1)


def _loop_grads(model, x, y, S, b):
    """name → (S, b, *shape): each example's gradient, one backward per example of its own loss."""
    params = _params(model)
    out = {n: torch.zeros(S, b, *p.shape[1:], dtype=F64) for n, p in params.items()}
    for p in range(S):
        for i in range(b):
            row = p * b + i
            loss = F.cross_entropy(model(x), y, reduction="none")[row]
            gs = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
            for n, gr in zip(params, gs):
                if gr is not None:
                    out[n][p, i] = gr[p]
    return out


def _per_sample_equal_a_loop(model, S, b):
    """``per_sample_grads`` of every trained tensor of ``model`` on a float64 batch, checked equal to a loop over single
    examples (``_loop_grads``); returns them."""
    x, y = _data(S, b)
    names = list(_params(model))
    with capture(model) as recs:
        losses = _summed(model, x, y, torch.ones(S * b), S)
    per = per_sample_grads(recs, torch.autograd.grad(losses.sum(), [r.y for r in recs]), names, model, S)
    ref = _loop_grads(model, x, y, S, b)
    assert sorted(per) == sorted(ref) == sorted(names)
    for n in names:
        assert ref[n].abs().max() > 1e-3, n  # a real gradient, not zeros on both sides
        torch.testing.assert_close(per[n], ref[n], rtol=1e-6, atol=1e-9, msg=n)
    return per


def test_per_sample_grads_equal_a_loop_float64():
    model = _tiny(3)
    per = _per_sample_equal_a_loop(model, 3, 4)
    assert len(per) == 6  # A, B of two layers, the head's weight and bias
    assert all(getattr(m, "dp_capture", None) is None for m in model.modules())  # capture is off afterwards


def test_per_sample_grads_of_a_stacked_testbed_layer_equal_a_loop():
    """The synthetic testbed's layout: a ``LoRALinear`` with G replicas, x (G, N, d_in), one example per row."""
    from fedlora.adapter import LoRALinear

    G, N, d_in, d_out, r = 2, 5, 4, 3, 2
    g = torch.Generator().manual_seed(4)
    layer = LoRALinear(d_in, d_out, r, alpha=5.0, stack=G, dtype=F64,
                       base_weight=torch.randn(d_out, d_in, generator=g, dtype=F64))
    with torch.no_grad():
        layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g, dtype=F64))
    x, target = torch.randn(G, N, d_in, generator=g, dtype=F64), torch.randn(G, N, d_out, generator=g, dtype=F64)
    with capture(layer) as recs:
        losses = ((torch.sin(layer(x)) - target) ** 2).sum((1, 2))
    assert len(recs) == 1 and recs[0].layout == "stack"
    per = per_sample_grads(recs, torch.autograd.grad(losses.sum(), [recs[0].y]), ["lora_A", "lora_B"], layer, G)
    for p in range(G):
        for i in range(N):
            loss = ((torch.sin(layer(x)) - target) ** 2)[p, i].sum()
            da, db = torch.autograd.grad(loss, [layer.lora_A, layer.lora_B])
            torch.testing.assert_close(per["lora_A"][p, i], da[p], rtol=1e-6, atol=1e-9)
            torch.testing.assert_close(per["lora_B"][p, i], db[p], rtol=1e-6, atol=1e-9)
    plain = LoRALinear(d_in, d_out, r, dtype=F64)  # an ordinary layer: (N, T, d_in) is N examples of T tokens
    with torch.no_grad():
        plain.lora_B.copy_(torch.randn(plain.lora_B.shape, generator=g, dtype=F64))
    xs = torch.randn(N, 3, d_in, generator=g, dtype=F64)
    with capture(plain) as recs:
        losses = torch.sin(plain(xs)).sum((1, 2)).reshape(1, N).sum(1)
    per = per_sample_grads(recs, torch.autograd.grad(losses.sum(), [recs[0].y]), ["lora_B"], plain, 1)
    for i in range(N):
        (db,) = torch.autograd.grad(torch.sin(plain(xs))[i].sum(), [plain.lora_B])
        torch.testing.assert_close(per["lora_B"][0, i], db, rtol=1e-6, atol=1e-9)


def _by_hand(ref, names, mask, S, b, sdp, clients, kind="noise"):
    """The DP-SGD gradient from per-example gradients: joint clip, Σ over real rows, + the client's noise (stream
    ``kind``: "noise", or "noise.p" for a step's release p), / q·n_k."""
    out = {n: [] for n in names}
    for p, k in enumerate(clients):
        total = {n: torch.zeros_like(ref[n][p, 0]) for n in names}
        for i in range(b):
            if not mask[p * b + i]:
                continue
            norm = math.sqrt(sum(float(ref[n][p, i].pow(2).sum()) for n in names))
            f = min(1.0, sdp.clip_norm / (norm + 1e-6))
            for n in names:
                total[n] += ref[n][p, i] * f
        gen = torch.Generator().manual_seed(seed_of(sdp.seed, DP_SAMPLE, kind, k, sdp.round, sdp.step))
        noise = {n: torch.randn(total[n].shape, generator=gen, dtype=F64) * sdp.noise_multiplier * sdp.clip_norm
                 for n in sorted(names)}
        for n in names:
            out[n].append((total[n] + noise[n]) / (sdp.rate(k) * sdp.client_sizes[k]))
    return {n: torch.stack(v) for n, v in out.items()}


def test_private_gradient_is_clip_sum_noise_over_expected_batch():
    S, b = 3, 5
    model = _tiny(S)
    x, y = _data(S, b)
    mask = torch.tensor([1, 1, 0, 1, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0], dtype=F64)  # Poisson batches padded to 5
    names = list(_params(model))
    sdp = SampleDP(clip_norm=0.8, noise_multiplier=0.6, sampling_rate={4: 0.1, 7: 0.2, 9: 0.25}, seed=5)
    sdp.set_client_sizes({4: 30, 7: 20, 9: 12})
    sdp.at(2, 1)
    got = private_gradients(sdp, model, lambda: _summed(model, x, y, mask, S), names, [4, 7, 9])
    want = _by_hand(_loop_grads(model, x, y, S, b), names, mask, S, b, sdp, [4, 7, 9])
    per = _loop_grads(model, x, y, S, b)
    norms = torch.stack([sum(per[n][p, i].pow(2).sum() for n in names).sqrt() for p in range(S) for i in range(b)])
    assert (norms > 0.8).any() and (norms[mask.bool()] < 0.8).any()  # some examples clipped, some not
    for n in names:
        torch.testing.assert_close(got[n], want[n], rtol=1e-9, atol=1e-12, msg=n)


def test_observe_sees_each_slots_examples_before_clipping_and_changes_nothing():
    """``SampleDP.observe`` (bench/dp_grad_norms.py's hook) gets, per slot, the round, the client and its per-example
    gradients as a loop over single examples gives them — before clipping — and the release is the same with it."""
    S, b = 3, 5
    model = _tiny(S)
    x, y = _data(S, b)
    mask = torch.ones(S * b, dtype=F64)
    names = list(_params(model))

    def sdp():
        s = SampleDP(clip_norm=0.05, noise_multiplier=0.6, sampling_rate=0.2, seed=5)
        s.set_client_sizes({4: 30, 7: 20, 9: 12})
        s.at(2, 1)
        return s

    seen = []
    watched = sdp()
    watched.observe = lambda rnd, k, per: seen.append((rnd, k, per))
    got = private_gradients(watched, model, lambda: _summed(model, x, y, mask, S), names, [4, 7, 9])
    plain = private_gradients(sdp(), model, lambda: _summed(model, x, y, mask, S), names, [4, 7, 9])
    loop = _loop_grads(model, x, y, S, b)
    assert [(r, k) for r, k, _ in seen] == [(2, 4), (2, 7), (2, 9)]
    for p, (_, _, per) in enumerate(seen):
        assert sorted(per) == sorted(names)
        for n in names:
            torch.testing.assert_close(per[n], loop[n][p], rtol=1e-9, atol=1e-12, msg=n)
    assert max(float(sum(per[n][i].pow(2).sum() for n in names).sqrt()) for _, _, per in seen for i in range(b)) > 0.05
    for n in names:
        torch.testing.assert_close(got[n], plain[n], rtol=0, atol=0, msg=n)


@pytest.mark.parametrize("variant", ["first-order", "hessian-free"])
def test_private_perfedavg_releases_its_inner_and_meta_gradients_each_on_its_own_batch_and_noise(variant):
    """Per-FedAvg under sample-level DP, by hand from a loop over single examples: release 0 is DP-SGD's gradient at
    x on the "batch" draw with "noise"; x̃ = x − α·that; release 1 is DP-SGD's gradient h AT x̃ on the independent
    "batch.1" draw with "noise.1"; the SGD step moves x by −β·h — for the hessian-free variant by −β·(h − α·d̃), d̃
    release 2: on the "batch.2" draw, each example's [∇ℓᵢ(x + δh) − ∇ℓᵢ(x − δh)]/(2δ) clipped to C as one vector,
    summed, "noise.2" added, / q·n_k."""
    from torch.func import functional_call

    S, n, q, alpha, beta, delta = 2, 12, 0.4, 0.3, 0.2, 0.05
    clients = [4, 7]
    model = _tiny(S, seed=2)
    gx = torch.Generator().manual_seed(8)
    data = {k: (torch.randn(n, 4, 6, generator=gx, dtype=F64), torch.randint(0, 3, (n,), generator=gx))
            for k in clients}
    sdp = SampleDP(clip_norm=0.4, noise_multiplier=0.7, sampling_rate=q, seed=5)
    sdp.set_client_sizes({k: n for k in clients})
    method = get_method("perfedavg")(rank=2, lr=beta, inner_lr=alpha, optimizer="sgd", variant=variant, delta=delta)
    assert method.sample_dp_releases == (2 if variant == "first-order" else 3)
    method.bind(model, clients)
    method.set_sample_dp(sdp)
    names = method.x_names
    assert sorted(names) == sorted(_params(model))  # A, B and the trained head

    def rows_of(kind):  # each client's Poisson draw of the current step from stream ``kind``
        out = []
        for k in clients:
            g = torch.Generator().manual_seed(seed_of(5, DP_SAMPLE, kind, k, sdp.round, sdp.step))
            out.append(torch.nonzero(torch.rand(n, generator=g, dtype=F64) < q).reshape(-1))
        return out

    def batch_of(rows):
        b = max(1, max(len(r) for r in rows))
        xs, ys, mask = [], [], []
        for r, k in zip(rows, clients):
            idx = torch.cat([r, torch.zeros(b - len(r), dtype=torch.long)])
            xs.append(data[k][0][idx]), ys.append(data[k][1][idx])
            mask.append(torch.cat([torch.ones(len(r)), torch.zeros(b - len(r))]))
        return torch.cat(xs), torch.cat(ys), torch.cat(mask).to(F64), b

    def sample():  # the slot executor's private sampler: the draw of the current release
        return batch_of([sdp.poisson_rows(k, n) for k in clients])

    def objective(params, batch):
        x, y, mask, _ = batch
        ce = F.cross_entropy(functional_call(model, dict(params), (x,)), y, reduction="none")
        return torch.where(mask.bool(), ce, torch.zeros((), dtype=ce.dtype)).view(S, -1).sum(1)

    sdp.at(3, 1)
    x0 = {n_: _params(model)[n_].detach().clone() for n_ in names}
    r0, r1 = rows_of("batch"), rows_of("batch.1")
    assert any(not torch.equal(a, b) for a, b in zip(r0, r1))  # independent draws
    xb, yb, mask, b = batch_of(r0)
    inner = _by_hand(_loop_grads(model, xb, yb, S, b), names, mask, S, b, sdp, clients)
    with torch.no_grad():
        for n_ in names:
            _params(model)[n_].copy_(x0[n_] - alpha * inner[n_])  # x̃
    xb, yb, mask, b = batch_of(r1)
    meta = _by_hand(_loop_grads(model, xb, yb, S, b), names, mask, S, b, sdp, clients, kind="noise.1")
    if variant == "hessian-free":
        r2 = rows_of("batch.2")
        assert any(not torch.equal(a, c) for a, c in zip(r1, r2))
        xb, yb, mask, b = batch_of(r2)
        sides = []
        for sign in (1.0, -1.0):
            with torch.no_grad():
                for n_ in names:
                    _params(model)[n_].copy_(x0[n_] + sign * delta * meta[n_])
            sides.append(_loop_grads(model, xb, yb, S, b))
        per = {n_: (sides[0][n_] - sides[1][n_]) / (2 * delta) for n_ in names}
        norms = torch.stack([sum(per[n_][p, i].pow(2).sum() for n_ in names).sqrt() for p in range(S) for i in range(b)])
        assert (norms[mask.bool()] > 0.4).any()  # the clip acts on the differences
        hvp = _by_hand(per, names, mask, S, b, sdp, clients, kind="noise.2")
        meta = {n_: meta[n_] - alpha * hvp[n_] for n_ in names}
    with torch.no_grad():
        for n_ in names:
            _params(model)[n_].copy_(x0[n_])
    method.local_step(objective, sample)
    assert sdp.part == 0  # the next step starts from its first release again
    for n_ in names:
        torch.testing.assert_close(_params(model)[n_].detach(), x0[n_] - beta * meta[n_], rtol=1e-9, atol=1e-12,
                                   msg=n_)


def test_a_clients_gradient_does_not_depend_on_its_pass_mates():
    """Client 7 in slot 1 of three (its batch padded to the pass's 5 rows) = client 7 alone (its own 3 rows)."""
    S, b = 3, 5
    model = _tiny(S)
    x, y = _data(S, b)
    mask = torch.tensor([1] * 5 + [1, 1, 1, 0, 0] + [1, 0, 0, 0, 0], dtype=F64)
    names = list(_params(model))
    sdp = SampleDP(0.5, 1.1, 0.2, seed=1)
    sdp.set_client_sizes({4: 25, 7: 25, 9: 25})
    sdp.at(0, 3)
    together = private_gradients(sdp, model, lambda: _summed(model, x, y, mask, S), names, [4, 7, 9])
    alone = _tiny(1)
    with torch.no_grad():
        for n, p in _params(alone).items():
            p.copy_(_params(model)[n][1:2])
    xa, ya = x[5:8], y[5:8]
    solo = private_gradients(sdp, alone, lambda: _summed(alone, xa, ya, torch.ones(3), 1), names, [7])
    for n in names:
        torch.testing.assert_close(solo[n][0], together[n][1], rtol=1e-12, atol=1e-14, msg=n)


def test_clipped_norms_are_at_most_C():
    """One example per slot, σ = 0, q·n = 1: the private gradient is that example's clipped gradient."""
    S, C = 4, 0.3
    model = _tiny(S)
    x, y = _data(S, 1, seed=11)
    names = list(_params(model))
    sdp = SampleDP(C, 0.0, 1.0, seed=0)
    sdp.set_client_sizes([1] * S)
    sdp.at(0, 0)
    for scale in (0.01, 50.0):  # norms below C come back unchanged, norms above are clipped to C
        got = private_gradients(sdp, model, lambda: _summed(model, x, y, torch.ones(S), S, scale), names, range(S))
        ref = _loop_grads(model, x, y, S, 1)
        for p in range(S):
            norm = float(sum(got[n][p].pow(2).sum() for n in names).sqrt())
            raw = float(sum((ref[n][p, 0] * scale).pow(2).sum() for n in names).sqrt())
            assert norm <= C
            if raw > C:
                assert norm == pytest.approx(C, rel=1e-5) and scale == 50.0
            else:
                assert norm == pytest.approx(raw, rel=1e-12) and scale == 0.01


def test_noise_std_is_sigma_C_over_expected_batch():
    """Zero gradients: what remains is the noise / (q·n_k); its std over many steps is σC/(q·n_k) within 3 s.e."""
    S = 2
    model = _tiny(S)
    x, y = _data(S, 2)
    names = list(_params(model))
    sdp = SampleDP(0.7, 1.3, 0.25, seed=9)
    sdp.set_client_sizes([40, 16])
    draws = {0: [], 1: []}
    for step in range(60):
        sdp.at(0, step)
        got = private_gradients(sdp, model, lambda: _summed(model, x, y, torch.ones(4), S, 0.0), names, [0, 1])
        for p in range(S):
            draws[p].append(torch.cat([got[n][p].reshape(-1) for n in names]))
    for p, n_k in ((0, 40), (1, 16)):
        z = torch.cat(draws[p])
        want = 1.3 * 0.7 / (0.25 * n_k)
        se = want / math.sqrt(2 * (len(z) - 1))  # s.e. of a normal sample's std
        assert len(z) > 3000
        assert abs(float(z.std()) - want) < 3 * se, (float(z.std()), want, se)
        assert abs(float(z.mean())) < 3 * want / math.sqrt(len(z))


def test_streams_are_keyed_by_client_round_and_step():
    a, b = SampleDP(1.0, 1.0, 0.3, seed=0), SampleDP(1.0, 1.0, 0.3, seed=0)
    a.at(3, 2)
    b.at(3, 2)
    b.poisson_rows(5, 100)  # another client's draw in between changes nothing
    assert torch.equal(a.poisson_rows(1, 100), b.poisson_rows(1, 100))
    assert not torch.equal(a.poisson_rows(1, 100), a.poisson_rows(2, 100))
    b.at(3, 3)
    assert not torch.equal(a.poisson_rows(1, 100), b.poisson_rows(1, 100))
    c = SampleDP(1.0, 1.0, 0.3, seed=1)
    c.at(3, 2)
    assert not torch.equal(a.poisson_rows(1, 100), c.poisson_rows(1, 100))
    counts = []  # each row in with probability q: the batch size is Binomial(n, q)
    for step in range(400):
        a.at(0, step)
        counts.append(len(a.poisson_rows(0, 50)))
    mean, want = sum(counts) / len(counts), 0.3 * 50
    assert abs(mean - want) < 3 * math.sqrt(50 * 0.3 * 0.7 / len(counts))


@pytest.mark.parametrize("kw,match", [
    (dict(clip_norm=0, noise_multiplier=1, sampling_rate=0.1), "clip_norm must be a finite number > 0"),
    (dict(clip_norm=1, noise_multiplier=-1, sampling_rate=0.1), "noise_multiplier must be a finite number ≥ 0"),
    (dict(clip_norm=1, noise_multiplier=1, sampling_rate=0), r"sampling_rate must be a number in \(0, 1\]"),
    (dict(clip_norm=1, noise_multiplier=1, sampling_rate=1.5), r"sampling_rate must be a number in \(0, 1\]"),
    (dict(clip_norm=1, noise_multiplier=1, sampling_rate=0.1, seed=-1), "seed must be an integer ≥ 0"),
])
def test_bad_settings_are_one_line(kw, match):
    with pytest.raises(ConfigError, match=match) as e:
        SampleDP(**kw)
    assert "\n" not in str(e.value)


def test_refusals_name_the_reason_and_the_supported_list_is_the_documented_one(monkeypatch):
    from fedlora.methods.pf2lora import PF2LoRA

    supported = {n for n in available_methods() if get_method(n).sample_dp_refusal is None}
    assert supported == SUPPORTED
    hf = get_method("perfedavg")(variant="hessian-free")  # Per-FedAvg: both variants, 2 or 3 releases a step
    hf.set_sample_dp(SampleDP(1.0, 1.0, 0.1))
    assert get_method("perfedavg").sample_dp_refusal_for({"variant": "hessian-free"}) is None
    assert [get_method("perfedavg").sample_dp_releases_for(o) for o in ({}, {"variant": "hessian-free"})] == [2, 3]
    modes = ({}, {"hypergradient": "exact"}, {"hypergradient": "finite-difference"}, {"hypergradient": "none"})
    assert [PF2LoRA.sample_dp_releases_for(o) for o in modes] == [3, 3, 3, 2]  # PF2LoRA: every mode, the default too
    assert all(PF2LoRA.sample_dp_refusal_for(o) is None for o in modes)
    # a method without a private path (the base's default refusal, or its own reason) is refused in one line
    assert "FactorLoRA.train_step" in Method.sample_dp_refusal
    monkeypatch.setattr(PF2LoRA, "sample_dp_refusal", Method.sample_dp_refusal)
    method = PF2LoRA()
    with pytest.raises(ConfigError, match=r"^pf2lora: sample-level DP is not supported: its local step is its own") as e:
        method.set_sample_dp(SampleDP(1.0, 1.0, 0.1))
    assert "\n" not in str(e.value)
    method.set_sample_dp(None)  # off is always allowed


def _fedsb_on_tiny(S, clients, sdp):
    """Fed-SB bound to the tiny slot model (scale 1), R and the received B random; its objective: per slot the sum of
    the real rows' cross-entropy of a functional call with the given parameters."""
    from torch.func import functional_call

    from fedlora.methods.fedsb import FedSB

    model = _tiny(S, alpha=None)
    m = FedSB(rank=2, lr=0.1, optimizer="sgd")
    m.bind(model, list(clients), n_clients=max(clients) + 1)
    g = torch.Generator().manual_seed(21)
    with torch.no_grad():
        m.R.copy_(torch.randn(m.R.shape, generator=g, dtype=F64))
        for b in m.b_names:
            m.frozen_B[b] = torch.randn(m.frozen_B[b].shape, generator=g, dtype=F64)
    m.set_sample_dp(sdp)

    def objective(params, batch):
        x, y, mask = batch
        ce = F.cross_entropy(functional_call(model, dict(params), (x,)), y, reduction="none")
        return torch.where(mask.bool(), ce, torch.zeros((), dtype=ce.dtype)).view(S, -1).sum(1)

    return m, objective


def test_fedsb_private_r_gradient_equals_a_loop():
    """Fed-SB trains R through the fold B·R: per-example dRᵢ = Bᵀ d(BR)ᵢ, clipped jointly with the head, equals a
    per-example autograd loop over R itself, clipped, noised and divided by hand."""
    from fedlora.aggmath.fedsb import fedsb_fold

    S, b = 2, 4
    sdp = SampleDP(0.4, 0.7, 0.3, seed=2)
    sdp.set_client_sizes({3: 10, 5: 20})
    sdp.at(1, 0)
    m, objective = _fedsb_on_tiny(S, [3, 5], sdp)
    x, y = _data(S, b)
    mask = torch.tensor([1, 1, 1, 0, 1, 0, 0, 0], dtype=F64)
    def folded():  # the step's parameters: the model's with every up factor B·R (differentiable in R)
        P = dict(m.params)
        for j, bn in enumerate(m.b_names):
            P[bn] = fedsb_fold(m.frozen_B[bn], m.R[:, j])
        return P

    trained = [m.R] + [m.params[n] for n in m.heads]
    assert m.heads  # a trained head: clipped jointly with R
    got = m._r_gradients(objective, folded(), (x, y, mask), trained)
    names = ["R", *m.heads]
    ref = {n: torch.zeros(S, b, *t.shape[1:], dtype=F64) for n, t in zip(names, trained)}
    for p in range(S):
        for i in range(b):
            one = torch.zeros(S * b, dtype=F64)
            one[p * b + i] = 1
            gs = torch.autograd.grad(objective(folded(), (x, y, one)).sum(), trained)
            for n, gr in zip(names, gs):
                ref[n][p, i] = gr[p]
    want = _by_hand(ref, names, mask, S, b, sdp, [3, 5])
    assert ref["R"].abs().max() > 1e-3
    for n, t in zip(names, got):
        torch.testing.assert_close(t, want[n], rtol=1e-9, atol=1e-12, msg=n)


def test_per_sample_grads_of_a_client_adapter_equal_a_loop_float64():
    """A layer with a client adapter s₂ (x Cᵀ) Dᵀ beside (A, B) (FedDPA's local adapter): the per-example gradients of
    all four factors and the head equal a loop over single examples."""
    model = _tiny(2, client_rank=2)
    assert model.l1.client_scale == 2.5 != model.l1.scale
    per = _per_sample_equal_a_loop(model, 2, 3)
    assert sum(n.endswith(("lora_C", "lora_D")) for n in per) == 4


def test_per_sample_grads_of_a_trilora_middle_equal_a_loop_float64():
    """H²Tune's layer ΔW = s·B·(I + (Φ ⊙ Ω^sup) ⊙ R)·A, a support Ω^sup that is neither empty nor full: the per-example
    gradients of A, B, R, Φ (and the head) equal a loop over single examples; off the support R's and Φ's are 0."""
    S, b, r = 2, 3, 3
    model = _tiny(S, r=r, middle=True)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in (model.l1, model.l2):
            layer.middle_mask.copy_((torch.rand(S, r, r, generator=g) < 0.6).to(F64))
            assert 0 < layer.middle_mask.sum() < S * r * r
    per = _per_sample_equal_a_loop(model, S, b)
    assert sum(n.endswith(("lora_R", "lora_Phi")) for n in per) == 4
    off = model.l1.middle_mask[:, None] == 0
    assert not per["l1.lora_R"][off.expand_as(per["l1.lora_R"])].any()


class _TwoReleases:
    """What a unit test of a multi-release private step needs (S = 2 slots of b = 4 rows, float64; releases 0–2): each release's
    Poisson batch (x, y, mask), some rows padding; ``sample`` returns the batch of the release ``sdp`` is positioned
    at and records (round, step, release) of each draw in ``drawn``; ``objective``: per slot the SUM of its real rows'
    cross-entropy of a functional call of ``model``; ``per_example``: each example's gradient by its own backward."""

    S, b = 2, 4
    MASKS = {0: [1, 1, 0, 1, 1, 1, 1, 0], 1: [1, 0, 1, 1, 1, 1, 1, 1], 2: [1, 1, 1, 0, 1, 0, 1, 1]}

    def __init__(self, model, sdp):
        self.model, self.sdp, self.drawn = model, sdp, []
        self.batches = {p: (*_data(self.S, self.b, seed=3 + p), torch.tensor(m, dtype=F64)) for p, m in self.MASKS.items()}

    def sample(self):
        self.drawn.append((self.sdp.round, self.sdp.step, self.sdp.part))
        return self.batches[self.sdp.part]

    def logits(self, params, x):
        from torch.func import functional_call

        return functional_call(self.model, dict(params), (x,))

    def objective(self, params, batch):
        x, y, mask = batch
        ce = F.cross_entropy(self.logits(params, x), y, reduction="none")
        return torch.where(mask.bool(), ce, torch.zeros((), dtype=ce.dtype)).view(self.S, -1).sum(1)

    def per_example(self, start, names, part, loss=None):
        """name → (S, b, …): the gradient of each example's own loss w.r.t. copies of ``start[n]`` (n in ``names``),
        on release ``part``'s batch; ``loss(leaves, one)`` → (S,) (default: ``objective`` at {**start, **leaves})."""
        S, b = self.S, self.b
        x, y, _ = self.batches[part]
        loss = loss or (lambda lv, one: self.objective({**start, **lv}, (x, y, one)))
        leaves = {n: start[n].clone().requires_grad_(True) for n in names}
        ref = {n: torch.zeros(S, b, *t.shape[1:], dtype=F64) for n, t in leaves.items()}
        for p in range(S):
            for i in range(b):
                one = torch.zeros(S * b, dtype=F64)
                one[p * b + i] = 1
                for n, g in zip(names, torch.autograd.grad(loss(leaves, one).sum(), list(leaves.values()))):
                    ref[n][p, i] = g[p]
        return ref

    def by_hand(self, ref, names, part):
        """DP-SGD's gradient of release ``part`` from per-example gradients (``_by_hand``, its noise stream)."""
        return _by_hand(ref, names, self.batches[part][2], self.S, self.b, self.sdp, [0, 1],
                        kind="noise" if part == 0 else f"noise.{part}")


def test_private_h2tune_releases_each_step_on_its_own_batch_and_noise():
    """H²Tune under DP, one local step (SGD): step (1) on release 0's batch and noise — R, Φ move by the clipped,
    noised task gradient on their support plus eq. 6's exact KL gradient, Ω by that KL alone — then step (2) on
    release 1's batch and noise — A, B and the head by the DP-SGD gradient of CE + sign·KL(y″‖y′) per example, y′
    the output BEFORE step (1) on step (2)'s batch, plus the exact ν·(A, B) — all equal to loops over single
    examples, clipped, noised and divided by hand."""
    from fedlora.methods.h2tune import H2Tune

    r, lr, lr2, nu = 2, 0.3, 0.2, 0.05
    model = _tiny(2, r=r, middle=True)
    sdp = SampleDP(0.7, 0.5, 0.4, seed=9)
    t = _TwoReleases(model, sdp)
    S, b = t.S, t.b

    def output_fn(params, batch):
        x, _, mask = batch
        return t.logits(params, x).view(S, b, -1), mask.view(S, b)

    m = H2Tune(rank=r, lr=lr, shared_lr=lr2, nu=nu, densities=[0.75, 0.5], output_fn=output_fn, optimizer="sgd")
    m.setup(model, [0, 1], n_clients=2)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for n in m._leaf_names("lora_R"):
            m.params[n].add_(torch.randn(m.params[n].shape, generator=g, dtype=F64) * 0.5)  # KL(R ‖ R_g) ≠ 0
    sdp.set_client_sizes({0: 10, 1: 10})
    m.set_sample_dp(sdp)
    assert m.sample_dp_releases == 2
    m.begin_round(0)  # the supports
    old = {n: t_.detach().clone() for n, t_ in m.params.items()}
    omega0 = m.omega.detach().clone()
    Rn, Pn = m._leaf_names("lora_R"), m._leaf_names("lora_Phi")
    support = {n: m._mask(n[: -len(".lora_R")]).bool() for n in Rn}
    support.update({p: support[r_] for r_, p in zip(Rn, Pn)})
    # step (1): release 0
    sdp.at(0, 0)
    want1 = t.by_hand(t.per_example(old, Rn + Pn, 0), Rn + Pn, 0)
    kl_grads = torch.autograd.grad(m.kl_shared().sum(), [m.params[n] for n in Rn] + [m.omega])
    after1 = {}
    for n in Rn + Pn:
        grad = want1[n] + (kl_grads[Rn.index(n)] if n in Rn else 0)
        after1[n] = torch.where(support[n], old[n] - lr2 * grad, old[n])
    omega1 = (omega0 - lr2 * kl_grads[-1] * m.layer_mask[:, :, None]) * m.layer_mask[:, :, None]
    # step (2): release 1, y′ before step (1) on its batch
    sdp.release(1)
    x2, y2, _ = t.batches[1]
    y_prime = t.logits(old, x2).view(S, b, -1).detach()
    AB = m._leaf_names("lora_A") + m._leaf_names("lora_B")
    names2 = AB + list(m.head_names())
    assert m.head_names()

    def loss2(lv, one):
        params = {**old, **after1, **lv}
        kl = output_kl(t.logits(params, x2).view(S, b, -1), y_prime, one.view(S, b), "examples")
        return t.objective(params, (x2, y2, one)) - kl  # disentangle_sign "paper": −KL

    want2 = t.by_hand(t.per_example(old, names2, 1, loss2), names2, 1)
    sdp.release(0)
    m.local_step(t.objective, t.sample)
    assert t.drawn == [(0, 0, 0), (0, 0, 1)]
    for n in Rn + Pn:
        assert not torch.equal(after1[n], old[n]), n
        torch.testing.assert_close(m.params[n].detach(), after1[n], rtol=1e-9, atol=1e-12, msg=n)
    torch.testing.assert_close(m.omega.detach(), omega1, rtol=1e-9, atol=1e-12)
    for n in names2:
        grad = want2[n] + (nu * old[n] if n in AB else 0)
        torch.testing.assert_close(m.params[n].detach(), old[n] - lr * grad, rtol=1e-9, atol=1e-12, msg=n)


def test_private_lora_a2_selects_ranks_from_its_released_probe_and_trains_masked_on_its_own_release():
    """LoRA-A² under DP, one local step of a B round (SGD): the probe step is release 0 — B moves by the clipped,
    noised gradient — the ranks are chosen (eq. 4) from that RELEASED delta, the restart goes back to B⁰, and the
    masked step is release 1 on its own batch and noise, masked to the chosen ranks (eq. 6) — all equal to loops over
    single examples, clipped, noised and divided by hand; probe_steps set is refused (its releases per step)."""
    from fedlora.aggmath.lora_a2 import importance_scores, select_ranks
    from fedlora.methods.lora_a2 import LoRAA2

    r, lr, ratio = 4, 0.1, 5.0
    model = _tiny(2, r=r)
    m = LoRAA2(rank=r, lr=lr, lr_ratio=ratio, client_rank=1, optimizer="sgd")
    m.setup(model, [0, 1], n_clients=2)
    sdp = SampleDP(0.6, 0.8, 0.4, seed=13)
    sdp.set_client_sizes({0: 10, 1: 10})
    m.set_sample_dp(sdp)
    assert m.sample_dp_releases == 2
    with pytest.raises(ConfigError, match="probe_steps set"):
        LoRAA2(rank=r, probe_steps=2).set_sample_dp(sdp)
    t = _TwoReleases(model, sdp)
    S, b = t.S, t.b
    Bn = [n for n in m.params if n.endswith("lora_B")]
    An = [n[: -len("lora_B")] + "lora_A" for n in Bn]
    start = {n: t_.detach().clone() for n, t_ in m.params.items()}
    m.begin_round(0)  # round 0 trains B
    sdp.at(0, 0)
    per0 = t.per_example(start, Bn, 0)
    probe = t.by_hand(per0, Bn, 0)
    plain = {n: (per0[n] * t.batches[0][2].view(S, b, 1, 1)).sum(1) for n in Bn}  # the data's own gradient, unreleased
    sdp.release(1)
    masked = t.by_hand(t.per_example(start, Bn, 1), Bn, 1)
    sdp.at(0, 0)
    m.local_step(t.objective, t.sample)
    m.end_round(0)
    assert t.drawn == [(0, 0, 0), (0, 0, 1)]
    differs = []
    for i in range(S):  # the ranks chosen from the released probe delta: budget r_k = 1 × N = 2 modules
        deltas = {n: -lr * ratio * probe[n][i] for n in Bn}
        sel = select_ranks(importance_scores(deltas, {n: start[a][i] for n, a in zip(Bn, An)}, "B"), 1)
        for n in Bn:
            keep = torch.zeros(r, dtype=torch.bool)
            keep[sel[n]] = True
            want = torch.where(keep[None, :], start[n][i] - lr * ratio * masked[n][i], start[n][i])
            torch.testing.assert_close(m.params[n][i].detach(), want, rtol=1e-9, atol=1e-12, msg=(i, n))
        assert sum(len(v) for v in sel.values()) == 2
        unreleased = select_ranks(importance_scores({n: -plain[n][i] for n in Bn},
                                                    {n: start[a][i] for n, a in zip(Bn, An)}, "B"), 1)
        differs.append(any(not torch.equal(unreleased[n], sel[n]) for n in Bn))
    assert any(differs)  # the premise: a selection from the data's own gradient would choose other ranks here
    for n in An:
        assert torch.equal(m.params[n].detach(), start[n])  # the frozen factor of a B round


def test_private_first_order_pf2lora_releases_its_lower_and_upper_gradients_on_their_own_batches():
    """PF2LoRA with hypergradient "none" under DP (SGD): the client adapter y = (C, D) steps by release 0's clipped,
    noised gradient, the common adapter x = (A, B) by release 1's, both taken at the step's (x, y) — equal to loops
    over single examples, clipped, noised and divided by hand."""
    from fedlora.methods.pf2lora import PF2LoRA

    lr_x, lr_y = 0.1, 0.2
    model = _tiny(2, r=2, client_rank=1)
    m = PF2LoRA(rank=2, client_rank=1, hypergradient="none", upper_optimizer="sgd", upper_lr=lr_x, lower_lr=lr_y)
    m.bind(model, [0, 1], n_clients=2)
    sdp = SampleDP(0.5, 0.7, 0.4, seed=17)
    sdp.set_client_sizes({0: 10, 1: 10})
    m.set_sample_dp(sdp)
    assert m.sample_dp_releases == 2
    t = _TwoReleases(model, sdp)
    start = {n: t_.detach().clone() for n, t_ in m.params.items()}
    assert any(n.endswith("lora_C") for n in m.y_names) and any(n.endswith("lora_A") for n in m.x_names)
    sdp.at(0, 0)  # both gradients at the step's (x, y): the lower on release 0's batch, the upper on release 1's
    want_y = t.by_hand(t.per_example(start, m.y_names, 0), m.y_names, 0)
    sdp.release(1)
    want_x = t.by_hand(t.per_example(start, m.x_names, 1), m.x_names, 1)
    sdp.at(0, 0)
    m.local_step(t.objective, t.sample)
    assert t.drawn == [(0, 0, 0), (0, 0, 1)]
    for names, want, lr in ((m.y_names, want_y, lr_y), (m.x_names, want_x, lr_x)):
        for n in names:
            assert want[n].abs().max() > 1e-4, n
            torch.testing.assert_close(m.params[n].detach(), start[n] - lr * want[n], rtol=1e-9, atol=1e-12, msg=n)


class _PrivatePF2LoRA:
    """A private PF2LoRA local step with a mixed term (SGD, the tiny model, S = 2) and its first two releases by hand:
    ``y_plus`` = y − α·g̃_y (release 0), ``joint`` = g̃_x and ṽ at (x, y⁺) (release 1); ``sdp`` is left at release 2.
    ``check(mixed)``: the step gives y⁺ and x − lr·(g̃_x − α·mixed), each release drawn once, in order."""

    lr_x, lr_y = 0.1, 0.2

    def __init__(self, **options):
        from fedlora.methods.pf2lora import PF2LoRA

        self.model = _tiny(2, r=2, client_rank=1)
        self.m = m = PF2LoRA(rank=2, client_rank=1, upper_optimizer="sgd", upper_lr=self.lr_x, lower_lr=self.lr_y,
                             **options)
        m.bind(self.model, [0, 1], n_clients=2)
        self.sdp = sdp = SampleDP(0.5, 0.7, 0.4, seed=17)
        sdp.set_client_sizes({0: 10, 1: 10})
        m.set_sample_dp(sdp)
        assert m.sample_dp_releases == 3 == PF2LoRA.sample_dp_releases_for(options)
        self.t = t = _TwoReleases(self.model, sdp)
        self.xs, self.ys = xs, ys = m.x_names, m.y_names
        self.start = start = {n: t_.detach().clone() for n, t_ in m.params.items()}
        sdp.at(0, 0)
        g_y = t.by_hand(t.per_example(start, ys, 0), ys, 0)
        self.y_plus = {n: start[n] - self.lr_y * g_y[n] for n in ys}
        sdp.release(1)
        self.joint = t.by_hand(t.per_example({**start, **self.y_plus}, [*xs, *ys], 1), [*xs, *ys], 1)
        sdp.release(2)

    def want_x(self, mixed):
        return {n: self.start[n] - self.lr_x * (self.joint[n] - self.lr_y * mixed[n]) for n in self.xs}

    def check(self, mixed):
        m, t = self.m, self.t
        self.sdp.at(0, 0)
        m.local_step(t.objective, t.sample)
        assert t.drawn == [(0, 0, 0), (0, 0, 1), (0, 0, 2)]
        for n in self.ys:
            torch.testing.assert_close(m.params[n].detach(), self.y_plus[n], rtol=1e-9, atol=1e-12, msg=n)
        want = self.want_x(mixed)
        for n in self.xs:
            assert (self.lr_y * mixed[n]).abs().max() > 1e-6, n  # the mixed term moves x here
            torch.testing.assert_close(m.params[n].detach(), want[n], rtol=1e-9, atol=1e-12, msg=n)


def test_private_exact_pf2lora_releases_each_examples_hessian_vector_product():
    """PF2LoRA's default hypergradient "exact" under DP (SGD), three releases on their own batches: y⁺ = y − α·g̃_y
    (release 0); g̃_x and ṽ one joint release at (x, y⁺) (release 1); the mixed term from each example's
    ∇²_{xy}ℓᵢ(x, y)·ṽ — here by a double backward of ⟨∇_y ℓᵢ, ṽ⟩ per example, not the forward mode the step uses —
    clipped as one, summed, noised (release 2); x steps along g̃_x − α·d̃. And the finite-difference mode's release 2
    tends to it as fd_eps → 0 (same streams)."""
    from fedlora.methods.pf2lora import PF2LoRA

    s = _PrivatePF2LoRA()
    assert s.m.hypergradient == "exact" and s.m.needs_second_order
    t, start, ys = s.t, s.start, s.ys

    def hvp_loss(leaves, one):  # ⟨∇_y ℓ(x, y), ṽ⟩ of the examples in ``one``, differentiable in x (the leaves)
        y_leaves = {n: start[n].clone().requires_grad_(True) for n in ys}
        loss = t.objective({**start, **leaves, **y_leaves}, (*t.batches[2][:2], one)).sum()
        grads = torch.autograd.grad(loss, list(y_leaves.values()), create_graph=True)
        return sum((g * s.joint[n]).sum() for n, g in zip(ys, grads))

    per = t.per_example(start, s.xs, 2, loss=hvp_loss)
    assert all((s.lr_y * per[n]).abs().max() > 1e-4 for n in s.xs)
    mixed = t.by_hand(per, s.xs, 2)
    s.check(mixed)
    # the finite-difference mode's step from the same start and streams approaches it: O(fd_eps²)
    gaps, want = [], s.want_x(mixed)
    for eps in (1e-2, 1e-3):
        with torch.no_grad():
            for n, v in start.items():
                s.m.params[n].copy_(v)
        fd = PF2LoRA(rank=2, client_rank=1, hypergradient="finite-difference", fd_eps=eps, upper_optimizer="sgd",
                     upper_lr=s.lr_x, lower_lr=s.lr_y)
        fd.bind(s.model, [0, 1], n_clients=2)
        fd.set_sample_dp(s.sdp)
        s.sdp.at(0, 0)
        fd.local_step(t.objective, t.sample)
        gaps.append(max((fd.params[n].detach() - want[n]).abs().max().item() for n in s.xs))
    assert 0 < gaps[1] < gaps[0] / 50, gaps


def test_private_finite_difference_pf2lora_releases_the_mixed_term_as_each_examples_clipped_difference():
    """PF2LoRA with hypergradient "finite-difference" under DP (SGD), three releases on their own batches: y⁺ = y −
    α·g̃_y (release 0); g̃_x and ṽ one joint release at (x, y⁺) (release 1); the mixed term from each example's
    [∇_x ℓᵢ(x, y + δṽ) − ∇_x ℓᵢ(x, y − δṽ)]/(2δ), δ = fd_eps/‖ṽ‖ per client, clipped as one, summed, noised
    (release 2); x steps along g̃_x − α·d̃ — equal to loops over single examples done by hand."""
    eps = 0.05
    s = _PrivatePF2LoRA(hypergradient="finite-difference", fd_eps=eps)
    t, start, ys, xs, joint = s.t, s.start, s.ys, s.xs, s.joint
    delta = eps / torch.stack([sum(joint[n][p].pow(2).sum() for n in ys) for p in range(2)]).sqrt()

    def slotwise(d, t_):  # a slot's scalar over its slice
        return d.view(-1, *[1] * (t_.dim() - 1))

    sides = [t.per_example({**start, **{n: start[n] + sign * slotwise(delta, start[n]) * joint[n] for n in ys}}, xs, 2)
             for sign in (1.0, -1.0)]
    per = {n: (sides[0][n] - sides[1][n]) / (2 * slotwise(delta, sides[0][n])) for n in xs}
    s.check(t.by_hand(per, xs, 2))


def test_private_feddpa_releases_each_phase_on_its_own_batch_and_noise():
    """FedDPA-T under DP: phase 1 (C, D and a personal head; the global adapter in the forward detached as (1 − a)·B,
    D as a·D) and phase 2 (A, B with D = 0) are each a DP-SGD release — phase 1 on the step's "batch"/"noise"
    streams, phase 2 on "batch.1"/"noise.1" of the same step — equal to the per-example loop over the real
    parameters, clipped, noised and divided by hand (SGD); the plan counts 2 releases per step, FedDPA-F 1."""
    from fedlora.methods.feddpa import FedDPA

    lr, a = 0.2, 0.3
    model = _tiny(2, client_rank=2)
    m = FedDPA(rank=2, lr=lr, optimizer="sgd", local_weight=a)
    m.bind(model, [0, 1], n_clients=2)
    sdp = SampleDP(0.5, 0.6, 0.4, seed=7)
    sdp.set_client_sizes({0: 10, 1: 10})
    m.set_sample_dp(sdp)
    assert (m.sample_dp_releases, FedDPA(variant="F").sample_dp_releases) == (2, 1)
    t = _TwoReleases(model, sdp)
    frozen = {n: t_.detach().clone() for n, t_ in m.params.items()}
    local, glob = m.local_names, m.global_names  # the head: shared (phase 2) or personal (phase 1)
    assert set(local) | set(glob) == set(m.params) and m.heads and not set(local) & set(glob)

    def forward(params, part):  # the loss of an example mask ``one`` with the forward's parameters ``params(leaves)``
        x, y, _ = t.batches[part]
        return lambda lv, one: t.objective(params(lv), (x, y, one))

    def phase1(leaves):
        return {**frozen, **{n: (1 - a) * frozen[n] for n in m.b_names}, **leaves,
                **{n: a * leaves[n] for n in m.d_names}}

    sdp.at(0, 0)
    want1 = t.by_hand(t.per_example(frozen, local, 0, forward(phase1, 0)), local, 0)
    m.begin_round(0)
    m.local_step(t.objective, t.sample)
    for n in local:
        torch.testing.assert_close(m.params[n].detach(), frozen[n] - lr * want1[n], rtol=1e-9, atol=1e-12, msg=n)
    frozen = {n: t_.detach().clone() for n, t_ in m.params.items()}
    sdp.release(1)

    def phase2(leaves):
        return {**frozen, **{n: torch.zeros_like(frozen[n]) for n in m.d_names}, **leaves}

    want2 = t.by_hand(t.per_example(frozen, glob, 1, forward(phase2, 1)), glob, 1)
    m.end_round(0)
    assert t.drawn == [(0, 0, 0), (0, 0, 1)]
    for n in glob:
        assert want2[n].abs().max() > 1e-4, n
        torch.testing.assert_close(m.params[n].detach(), frozen[n] - lr * want2[n], rtol=1e-9, atol=1e-12, msg=n)


@pytest.mark.parametrize("method", ["flexlora", "hetlora"])
def test_heterogeneous_rank_private_step_equals_a_loop_at_each_clients_rank(method):
    """FlexLoRA and HetLoRA train each client at its own rank r_k in slots of r_max: one private SGD step equals the
    per-example loop's clip-sum-noise-divide masked to the first r_k slots, plus (HetLoRA) the EXACT gradient of
    its penalty · Σ_layers ‖B[:, tail]‖·‖A[tail, :]‖ (a function of the factors, not of any example: neither clipped
    nor noised). The unused slots' per-example gradients are 0, so the clipping sees a rank-r_k client's norms; the
    noise drawn there never reaches the optimizer (AdamW's moments of those slots stay 0)."""
    from torch.func import functional_call

    from fedlora.methods.flexlora import FlexLoRA
    from fedlora.methods.hetlora import HetLoRA

    S, b, r_max, lr, pen = 2, 4, 3, 0.3, 0.5
    ranks = [1, 3]
    model = _tiny(S, r=r_max)
    m = (FlexLoRA(rank=r_max, lr=lr, client_ranks=ranks, optimizer="sgd") if method == "flexlora" else
         HetLoRA(lr=lr, r_min=1, r_max=r_max, initial_ranks=ranks, penalty=pen, optimizer="sgd"))
    m.bind(model, [0, 1], n_clients=2)
    pairs = [(f"{l}.lora_A", f"{l}.lora_B") for l in ("l1", "l2")]
    m.rank_slots.apply(m.params, pairs)  # client 0 uses slot 0 only, client 1 all three
    sdp = SampleDP(0.6, 0.7, 0.4, seed=4)
    sdp.set_client_sizes({0: 10, 1: 10})
    sdp.at(0, 0)
    m.set_sample_dp(sdp)
    x, y = _data(S, b)
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 1, 0], dtype=F64)

    def objective(params, batch):
        xx, yy, mm = batch
        ce = F.cross_entropy(functional_call(model, dict(params), (xx,)), yy, reduction="none")
        return torch.where(mm.bool(), ce, torch.zeros((), dtype=ce.dtype)).view(S, -1).sum(1)

    names = [n for ab in pairs for n in ab] + ["classifier.head_weight", "classifier.head_bias"]
    assert set(names) == set(m.params)
    before = {n: m.params[n].detach().clone() for n in names}
    ref = {n: torch.zeros(S, b, *m.params[n].shape[1:], dtype=F64) for n in names}
    for p in range(S):
        for i in range(b):
            one = torch.zeros(S * b, dtype=F64)
            one[p * b + i] = 1
            gs = torch.autograd.grad(objective(m.params, (x, y, one)).sum(), [m.params[n] for n in names])
            for n, gr in zip(names, gs):
                ref[n][p, i] = gr[p]
    for a, bn in pairs:  # client 0's unused slots: no per-example gradient at all
        assert not ref[a][0, :, 1:].any() and not ref[bn][0, :, :, 1:].any() and ref[a][1, :, 2:].abs().max() > 1e-4
    want = _by_hand(ref, names, mask, S, b, sdp, [0, 1])
    if method == "hetlora":  # the penalty's exact gradient, by hand: tail slots ⌊γ r_k⌋ ≤ i < r_k
        tail = torch.zeros(S, r_max, dtype=F64)
        for p, r in enumerate(ranks):
            tail[p, math.floor(0.99 * r):r] = 1
        leaves = {n: before[n].clone().requires_grad_(True) for a, bn in pairs for n in (a, bn)}
        total = sum((leaves[a] * tail[:, :, None]).flatten(1).norm(dim=1) *
                    (leaves[bn] * tail[:, None, :]).flatten(1).norm(dim=1) for a, bn in pairs).sum()
        for n, g in zip(leaves, torch.autograd.grad(pen * total, list(leaves.values()))):
            want[n] = want[n] + g
    slot = (torch.arange(r_max)[None, :] < torch.tensor(ranks)[:, None]).to(F64)
    for a, bn in pairs:
        want[a], want[bn] = want[a] * slot[:, :, None], want[bn] * slot[:, None, :]
    m.local_step(objective, lambda: (x, y, mask))
    for n in names:
        torch.testing.assert_close(m.params[n].detach(), before[n] - lr * want[n], rtol=1e-9, atol=1e-12, msg=n)
    # AdamW: the noise drawn in client 0's unused slots never enters its moments
    adam = (FlexLoRA(rank=r_max, lr=lr, client_ranks=ranks) if method == "flexlora" else
            HetLoRA(lr=lr, r_min=1, r_max=r_max, initial_ranks=ranks, penalty=pen, optimizer="adamw"))
    adam.bind(model, [0, 1], n_clients=2)
    adam.set_sample_dp(sdp)
    adam.local_step(objective, lambda: (x, y, mask))
    for a, bn in pairs:
        for n, unused in ((a, (0, slice(1, None))), (bn, (0, slice(None), slice(1, None)))):
            state = adam.opt.state[m.params[n]]
            moments = [v for v in state.values() if torch.is_tensor(v) and v.shape == m.params[n].shape]
            assert moments and all(not v[unused].any() for v in moments), n
            assert all(v[1].abs().max() > 0 for v in moments), n  # client 1's slots did move


def test_fedsb_private_initialisation_gradient_equals_a_loop():
    """Fed-SB's initialisation round under DP releases the full-weight gradients ∂ℓ/∂W through DP-SGD: equal to the
    method's own (non-private) substitution A := I, B := BA + Z on one example at a time, clipped, noised, divided."""
    S, b = 2, 3
    sdp = SampleDP(0.9, 0.5, 0.2, seed=8)
    sdp.set_client_sizes([15, 15])
    sdp.at(0, 1)
    m, objective = _fedsb_on_tiny(S, [0, 1], sdp)
    x, y = _data(S, b)
    mask = torch.tensor([1, 0, 1, 1, 1, 1], dtype=F64)
    got = m._weight_gradients(objective, (x, y, mask))
    m.set_sample_dp(None)
    ref = {}
    for p in range(S):
        for i in range(b):
            one = torch.zeros(S * b, dtype=F64)
            one[p * b + i] = 1
            for n, gr in m.full_weight_gradients(objective, (x, y, one)).items():
                ref.setdefault(n, torch.zeros(S, b, *gr.shape[1:], dtype=F64))[p, i] = gr[p]
    want = _by_hand(ref, m.b_names, mask, S, b, sdp, [0, 1])
    assert sorted(got) == sorted(m.b_names) and ref[m.b_names[0]].abs().max() > 1e-3
    for n in m.b_names:
        torch.testing.assert_close(got[n], want[n], rtol=1e-9, atol=1e-12, msg=n)


# ---------------------------------------------------------------------------------------------------------------
# the slot executor on tiny-smoke
def _prepared(method="fedavg", *sets):
    from fedlora.llm.config import load_config
    from fedlora.llm.runtime import FederatedRun

    cfg = load_config("tiny-smoke", [f"method.name={method}", "train.local_steps=2", "data.max_train_samples=60",
                                     *sets])
    return FederatedRun(cfg, write=False).prepare().slots


def _train(ex, rnd, clients=(0, 1, 2)):
    from fedlora.server import ClientUpdate, Download

    out = ex.train(rnd, list(clients), {k: Download() for k in clients})
    assert all(isinstance(v, ClientUpdate) for v in out.values()), out
    return out


def _records(ex):
    return {k: {n: v.clone() for n, v in rec.items()} for k, rec in ex.records().items()}


def _equal(r1, r2):
    return all(torch.equal(r1[k][n], r2[k][n]) for k in r1 for n in r1[k]) and r1.keys() == r2.keys()


@pytest.fixture(scope="module")
def smoke():
    ex = _prepared("fedavg")
    return ex, _records(ex)  # the run's initial records (``restore`` them to start again)


def test_same_seed_bit_identical_two_seeds_differ_resume_needs_no_state(smoke):
    ex, start = smoke
    ex.restore(start)
    ex.set_sample_dp(SampleDP(1.0, 0.8, 0.2, seed=0))
    _train(ex, 0)
    after0 = _records(ex)
    _train(ex, 1)
    after1 = _records(ex)
    ex.restore(start)  # again from the start, a fresh SampleDP of the same settings
    ex.set_sample_dp(SampleDP(1.0, 0.8, 0.2, seed=0))
    _train(ex, 0)
    assert _equal(_records(ex), after0)
    ex.restore(after0)  # resumed at the round boundary: a new SampleDP, nothing saved
    ex.set_sample_dp(SampleDP(1.0, 0.8, 0.2, seed=0))
    _train(ex, 1)
    assert _equal(_records(ex), after1)
    ex.restore(start)
    ex.set_sample_dp(SampleDP(1.0, 0.8, 0.2, seed=1))
    _train(ex, 0)
    other = _records(ex)
    assert not torch.equal(other[0]["param:roberta.encoder.layer.0.attention.self.query.lora_B"],
                           after0[0]["param:roberta.encoder.layer.0.attention.self.query.lora_B"])
    ex.set_sample_dp(None)


def test_dp_off_is_the_ordinary_step(smoke):
    """Switching DP on and off again leaves training as it was, bit for bit (no hook left, the same batches)."""
    ex, start = smoke
    ex.set_sample_dp(None)
    ex.restore(start)
    _train(ex, 0)
    plain = _records(ex)
    ex.restore(start)
    ex.set_sample_dp(SampleDP(1.0, 0.8, 0.2, seed=0))
    ex.set_sample_dp(None)
    _train(ex, 0)
    assert _equal(_records(ex), plain)
    assert all("dp_capture" not in vars(m) for m in ex.model.modules())


def test_executor_client_update_does_not_depend_on_pass_mates():
    """float64 tiny-smoke: three clients in one pass (Poisson batches padded per pass) = each client alone."""
    sdp = dict(clip_norm=1.0, noise_multiplier=0.5, sampling_rate=0.15, seed=3)
    recs = {}
    for P in (3, 1):
        ex = _prepared("fedavg", "model.dtype=float64", f"federation.clients_per_pass={P}")
        assert ex.P == P
        ex.set_sample_dp(SampleDP(**sdp))
        losses = _train(ex, 0)
        recs[P] = (_records(ex), {k: v.train_loss for k, v in losses.items()})
    for k in range(3):
        for n, v in recs[3][0][k].items():
            if n.startswith("param:"):
                torch.testing.assert_close(v, recs[1][0][k][n], rtol=1e-9, atol=1e-12, msg=f"{k} {n}")
        assert recs[3][1][k] == pytest.approx(recs[1][1][k], rel=1e-9)


@pytest.mark.parametrize("method", sorted(SUPPORTED - {"fedsb"}))
def test_every_supported_method_trains_its_factors(method, monkeypatch):
    """σ = 0, two private steps from PEFT's init (B = 0): every factor the step trains has moved for every client —
    by its clipped gradient alone, so the adapters do train (opacus issue 820); with σ > 0 too."""
    trained = set()
    real = dpsgd.private_gradients

    def spy(sdp, model, losses_fn, names, clients, **kw):
        trained.update(names)
        return real(sdp, model, losses_fn, names, clients, **kw)

    monkeypatch.setattr(dpsgd, "private_gradients", spy)
    # H²Tune's Φ starts at 1 and its first steps move it by ~lr·|R_init|·|B|, below even float64's resolution at 1
    # with its default lr (the same without DP): float64 and a large step make the move visible. LoRA-A² trains the
    # r_k·N ranks it selects over all N modules (a module may get none): a budget of every rank trains every module.
    # PF2LoRA's client adapter starts with D = 0, so C first moves in step 2, by ~α²·|g_D|·|g_C|: below float32's
    # resolution here even at α = 1 — float64 and a large α
    sets = {"h2tune": ["model.dtype=float64", "method.lr=1.0"],
            "pf2lora": ["model.dtype=float64", "method.options.lower_lr=1.0"],
            "lora-a2": ["method.rank=4", "method.options.rank=4"]}.get(method, [])
    ex = _prepared(method, *sets)
    before = _records(ex)
    zero_b = [n for n in before[0] if n.startswith("param:") and n.endswith("lora_B")]
    peft_init = all(not before[k][n].any() for k in before for n in zero_b)
    assert zero_b and (peft_init or method == "frlora")  # B = 0 at init but FRLoRA's (W0's principal triplets)
    sdp = SampleDP(0.5, 0.0, 0.5, seed=0)
    ex.set_sample_dp(sdp)
    for step in (0, 1):  # the premise: every client's Poisson batch has rows in both steps (an empty one trains nothing)
        sdp.at(0, step)
        assert all(len(sdp.poisson_rows(k, ex.sizes[k])) for k in before)
    _train(ex, 0, tuple(sorted(before)))  # Centralized: one client, the pooled rows
    after = _records(ex)
    assert any(n.endswith("lora_B") for n in trained), trained
    for k in before:
        for n in trained:
            assert not torch.equal(before[k][f"param:{n}"], after[k][f"param:{n}"]), (k, n)
    ex.restore(before)
    ex.set_sample_dp(SampleDP(0.5, 1.0, 0.5, seed=0))
    _train(ex, 0, tuple(sorted(before)))
    noisy = _records(ex)
    for k in before:
        for n in trained:
            assert not torch.equal(noisy[k][f"param:{n}"], after[k][f"param:{n}"]), (k, n)


def test_padded_rows_and_masks_in_the_executors_batches(smoke):
    ex, _ = smoke
    ex.set_sample_dp(SampleDP(1.0, 1.0, 0.1, seed=4))
    ex._bind([0, 1, 2])
    ex.sample_dp.at(0, 0)
    batch = ex._private_sampler_fn([0, 1, 2])()
    draws = [ex.sample_dp.poisson_rows(k, ex.sizes[k]) for k in range(3)]
    b = max(1, max(len(d) for d in draws))
    mask = batch[DP_MASK].view(3, b)
    assert [int(m.sum()) for m in mask] == [len(d) for d in draws]
    assert batch["labels"].shape == (3 * b,)
    want = torch.cat([torch.as_tensor(ex.train_sets[k])[d] for k, d in enumerate(draws)])
    got_labels = batch["labels"][batch[DP_MASK] > 0]
    assert torch.equal(got_labels, ex.enc_train["labels"][want])
    ex.set_sample_dp(None)


def test_sample_dp_with_a_refused_method_is_one_line(monkeypatch):
    from fedlora.llm.config import load_config
    from fedlora.methods.pf2lora import PF2LoRA

    ex = _prepared("pf2lora")
    monkeypatch.setattr(PF2LoRA, "sample_dp_refusal", "no private path (this test's)")
    with pytest.raises(ConfigError, match=r"^pf2lora: sample-level DP is not supported: no private path") as e:
        ex.set_sample_dp(SampleDP(1.0, 1.0, 0.1))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^privacy.level: sample-level DP does not apply to pf2lora: no private path") \
            as e:  # the run's config check, before anything loads
        load_config("tiny-smoke", ["method.name=pf2lora", "privacy.level=sample", "privacy.target_epsilon=3"])
    assert "\n" not in str(e.value)


def test_fedsb_trains_r_privately_after_its_private_initialisation():
    """Fed-SB on tiny-smoke with σ = 0: round 0 (the initialisation) uploads private gradients, the server's LoRA-SB
    init comes back, and round 1's private steps move R (so B·R) for every client."""
    from fedlora.server import Download

    ex = _prepared("fedsb")
    sdp = SampleDP(0.5, 0.0, 0.5, seed=0)
    ex.set_sample_dp(sdp)
    up = _train(ex, 0)
    grads = [n for n in up[0].upload.tensors if n.endswith("weight_grad")]
    assert grads and all(up[k].upload.tensors[n].abs().max() > 0 for k in up for n in grads)
    state = type(ex.method).aggregate([up[k].upload for k in sorted(up)], torch.full((3,), 1 / 3))
    before = _records(ex)
    ex.train(1, [0, 1, 2], {k: Download(dict(state)) for k in range(3)})
    after = _records(ex)
    for k in range(3):
        assert not torch.equal(after[k]["extra:R"], before[k]["extra:R"])
        downloaded = ex.method  # the R each client received is the server's R₀; its own R moved from it
        r0 = torch.stack([state[a[: -len("lora_A")] + "lora_R"] for a in downloaded.a_names])
        assert not torch.allclose(after[k]["extra:R"], r0)


def test_example_losses_are_each_rows_own_loss():
    """What DP-SGD sums per slot is each row's own loss: a row's value is the task's loss of that row alone
    (classification: cross-entropy; generation: the mean over the row's own target tokens; QA: a feature's
    (CE(start) + CE(end)) / 2) — so a row's gradient does not depend on the other rows of its batch."""
    from fedlora.llm.classification import ClassificationTask
    from fedlora.llm.generation import GenerationTask
    from fedlora.llm.qa import QATask

    g = torch.Generator().manual_seed(0)
    n, L, V = 4, 6, 7
    cases = [
        (ClassificationTask.__new__(ClassificationTask), torch.randn(n, 3, generator=g, dtype=F64),
         {"labels": torch.randint(0, 3, (n,), generator=g)}),
        (GenerationTask.__new__(GenerationTask), torch.randn(n, L, V, generator=g, dtype=F64),
         {"labels": torch.tensor([[-100, -100, 1, 2, 3, -100], [-100, 4, 5, -100, -100, -100],
                                  [-100, -100, -100, -100, 6, 0], [-100, 1, 1, 1, 1, 1]])}),
        (QATask.__new__(QATask), torch.randn(n, L, 2, generator=g, dtype=F64),
         {"start_positions": torch.tensor([0, 2, 5, 1]), "end_positions": torch.tensor([1, 3, 5, 4])}),
    ]
    for task, logits, batch in cases:
        per = task.example_losses(logits, batch)
        assert per.shape == (n,)
        for i in range(n):
            alone = task.loss(logits[i:i + 1], {k: v[i:i + 1] for k, v in batch.items()}, 1)
            torch.testing.assert_close(per[i], alone[0], rtol=1e-12, atol=0, msg=type(task).__name__)
    lens = (cases[1][2]["labels"][:, 1:] != -100).sum(1)
    assert len(set(lens.tolist())) > 1  # rows with different target lengths: a per-row mean, not the slot's token mean


def _tiny_task_run(config, *sets):
    from fedlora.llm.config import load_config
    from fedlora.llm.runtime import FederatedRun

    cfg = load_config(config, ["method.name=fedavg", "method.options={}", "method.lr=null", "tiny=true",
                               "federation.clients=2", "data.max_train_samples=40", "data.max_test_samples=8",
                               "train.local_steps=2", "federation.partition=iid", "data.client_column=null", *sets])
    return FederatedRun(cfg, write=False).prepare().slots


#: PF2LoRA in its default exact mode: forward-mode AD through GPT-2 (eager attention); float64 and a large α as in
#: test_every_supported_method_trains_its_factors, so that C's first move is visible
_PF2LORA_EXACT = ["method.name=pf2lora", "model.dtype=float64", "method.options.lower_lr=1.0"]


@pytest.mark.parametrize("config,sets", [("e2e-pf2lora", []), ("squad-pf2lora", ["data.task=squad"]),
                                         ("e2e-pf2lora", _PF2LORA_EXACT)])
def test_generation_and_qa_train_privately(config, sets):
    """σ = 0: two private steps move every LoRA factor of both clients (the clipped gradients alone)."""
    ex = _tiny_task_run(config, *sets)
    before = _records(ex)
    sdp = SampleDP(1.0, 0.0, 0.5, seed=0)
    ex.set_sample_dp(sdp)
    for step in (0, 1):
        sdp.at(0, step)
        assert all(len(sdp.poisson_rows(k, ex.sizes[k])) for k in (0, 1))
    _train(ex, 0, (0, 1))
    after = _records(ex)
    lora = [n for n in before[0] if n.startswith("param:") and "lora_" in n]
    assert lora
    for k in (0, 1):
        for n in lora:
            assert not torch.equal(before[k][n], after[k][n]), (k, n)


@pytest.mark.parametrize("config,sets", [("e2e-pf2lora", []), ("squad-pf2lora", ["data.task=squad"])])
def test_h2tune_private_outputs_group_each_examples_outputs(config, sets):
    """H²Tune's output_fn on a DP batch: the task's outputs (S, b·k, C) grouped per example (S, b, k, C) — the same
    numbers — with the task's mask times 0 on the padded rows, so eq. 7's per-example KL (``output_kl(reduction=
    "examples")``) counts each real example's outputs once; a private round then trains both clients' A and B."""
    ex = _tiny_task_run(config, "method.name=h2tune", *sets)
    before = _records(ex)
    sdp = SampleDP(1.0, 0.5, 0.5, seed=0)
    ex.set_sample_dp(sdp)
    ex._bind([0, 1])
    sdp.at(0, 0)
    batch = ex._private_sampler_fn([0, 1])()
    rows = batch[DP_MASK].view(2, -1)
    assert (rows == 0).any()  # the smaller client's draw is padded
    P = dict(ex.method.param_view())
    with torch.no_grad():
        logits, mask = ex._logits_fn(P, batch)
        plain = ex._logits_fn(P, {k: v for k, v in batch.items() if k != DP_MASK})
    plain_logits, plain_mask = plain if isinstance(plain, tuple) else (plain, None)
    S, b, k = mask.shape
    assert (S, b) == tuple(rows.shape) and logits.shape[:3] == (S, b, k) and k > 1
    assert torch.equal(logits.reshape(plain_logits.shape), plain_logits)
    task_mask = torch.ones(S, b, k) if plain_mask is None else plain_mask.reshape(S, b, k)
    assert torch.equal(mask, task_mask.to(mask.dtype) * rows[:, :, None])
    _train(ex, 0, (0, 1))
    after = _records(ex)
    moved = [n for n in before[0] if n.endswith(("lora_A", "lora_B"))]
    assert moved and all(not torch.equal(before[c][n], after[c][n]) for c in (0, 1) for n in moved)


def test_qa_read_in_windows_is_refused():
    ex = _tiny_task_run("squad-pf2lora", "data.task=squad", "data.doc_stride=16")
    with pytest.raises(ConfigError, match=r"^sample-level DP with data.doc_stride: a question read in several") as e:
        ex.set_sample_dp(SampleDP(1.0, 1.0, 0.1))
    assert "\n" not in str(e.value)


def test_dropout_with_pass_mates_is_refused_and_alone_allowed():
    """With model.dropout a client's masks are drawn for its slot's rows: under Poisson batches padded per pass they
    would depend on its pass-mates, so that is refused; one client per pass is allowed and trains."""
    ex = _prepared("fedavg", "model.dropout=true", "federation.clients_per_pass=3")
    with pytest.raises(ConfigError, match=r"^sample-level DP with model.dropout: a client's dropout masks") as e:
        ex.set_sample_dp(SampleDP(1.0, 1.0, 0.3))
    assert "\n" not in str(e.value) and ex.sample_dp is None and ex.method.sample_dp is None
    alone = _prepared("fedavg", "model.dropout=true", "federation.clients_per_pass=1")
    alone.set_sample_dp(SampleDP(1.0, 1.0, 0.3))
    _train(alone, 0)
