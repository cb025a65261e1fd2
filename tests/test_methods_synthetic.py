"""PF2LoRA and HetLoRA as Methods: batched replicas equal separate clients; paper rules hold."""
import copy

import pytest
import torch
from torch.func import functional_call

from fedlora.adapter import LoRALinear
from fedlora.aggregation import hetlora_aggregate, truncate_rank, zero_pad_rank
from fedlora.errors import ConfigError
from fedlora.methods import HetLoRA, PF2LoRA, get_method
from fedlora.methods.hypergradient import bilevel_direction
from fedlora.payload import Payload


def _objective(layer):
    def objective(params, batch):
        X, Y = batch
        return ((functional_call(layer, params, (X,)) - Y) ** 2).mean(dim=(-2, -1))
    return objective


def _data(G, n=30, d=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(G, n, d, generator=g, dtype=torch.float64),
            torch.randn(G, n, d, generator=g, dtype=torch.float64))


def _pf2_layer(G, d=6, seed=0):
    layer = LoRALinear(d, d, 3, client_rank=2, stack=G, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    return layer


# finite-difference: F is quartic in y (the product D C), so the central difference of the HVP errs by
# O(δ²) with δ = fd_eps/‖v‖; fd_eps = 1e-6 puts that and the rounding (~1e-16/δ) near 1e-10 relative
@pytest.mark.parametrize("mode,fd_eps,tol", [("exact", 1e-3, 1e-12), ("finite-difference", 1e-6, 1e-8)])
def test_pf2lora_stacked_step_equals_per_client_eq4(mode, fd_eps, tol):
    """Each replica's step, eq. (4) by hand with autograd one client at a time: the exact branch and the
    per-replica finite-difference branch both give this VALUE (not only its direction)."""
    G = 3
    X, Y = _data(G)
    Y = Y * torch.tensor([1.0, 30.0, 0.1], dtype=Y.dtype).view(G, 1, 1)  # replicas of very different ‖v‖
    layer = _pf2_layer(G)
    ref = copy.deepcopy(layer)
    m = PF2LoRA(upper_lr=0.01, lower_lr=0.05, upper_optimizer="sgd", rank=3, client_rank=2, hypergradient=mode,
                fd_eps=fd_eps)
    m.bind(layer, [0, 1, 2])  # bind, not setup: generic, different x per replica (no initial broadcast)
    m.local_step(_objective(layer), lambda: (X, Y))
    alpha, eta = 0.05, 0.01
    for i in range(G):  # the same step computed one client at a time, from eq. (4) by hand
        A, B, C, D = (ref.lora_A[i].detach(), ref.lora_B[i].detach(), ref.lora_C[i].detach(), ref.lora_D[i].detach())

        def f(A, B, C, D):
            return (((X[i] @ (B @ A + D @ C).T) - Y[i]) ** 2).mean()

        x = [A.clone().requires_grad_(), B.clone().requires_grad_()]
        y = [C.clone().requires_grad_(), D.clone().requires_grad_()]
        gy = torch.autograd.grad(f(*x, *y), y, create_graph=True)
        yp = [(yi - alpha * gi).detach().requires_grad_() for yi, gi in zip(y, gy)]
        outer = f(*x, *yp)
        gx = torch.autograd.grad(outer, x, retain_graph=True)
        v = torch.autograd.grad(outer, yp)
        mixed = torch.autograd.grad(sum((a * b).sum() for a, b in zip(gy, v)), x)
        h = [a - alpha * b for a, b in zip(gx, mixed)]
        torch.testing.assert_close(layer.lora_C[i], yp[0].detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(layer.lora_A[i], A - eta * h[0], rtol=tol, atol=tol)
        torch.testing.assert_close(layer.lora_B[i], B - eta * h[1], rtol=tol, atol=tol)
        assert float(mixed[0].abs().max()) > 1e-3  # the mixed term is there to be got right


def test_pf2lora_mixed_term_has_the_minus_sign_of_eq4():
    # F = ½‖y‖² + x·y: ∇_y F = y + x, ∇²_{xy} F = I; y⁺ = y − α(y + x); h = ∇_x F(x,y⁺) − α·I·∇_y F(x,y⁺)
    def F(x, y, _):
        return 0.5 * (y[0] ** 2).sum() + (x[0] * y[0]).sum()

    x, y, a = torch.tensor([0.3], dtype=torch.float64), torch.tensor([2.0], dtype=torch.float64), 0.1
    h, yp = bilevel_direction(F, [x], [y], a, (None, None))
    y_plus = y - a * (y + x)
    torch.testing.assert_close(yp[0], y_plus)
    torch.testing.assert_close(h[0], y_plus - a * (y_plus + x))


def test_pf2lora_uploads_only_the_common_adapter_and_aggregates_purely():
    layer = _pf2_layer(4)
    m = PF2LoRA(rank=3, client_rank=2)
    m.setup(layer, [0, 1, 0, 1])
    ups = [m.upload(i) for i in range(2)]
    assert set(ups[0].tensors) == {"lora_A", "lora_B"}
    before = [{k: v.clone() for k, v in p.tensors.items()} for p in ups]
    state = PF2LoRA.aggregate(ups, torch.tensor([0.5, 0.5]))
    for p, b in zip(ups, before):
        for k in b:
            assert torch.equal(p.tensors[k], b[k])
    torch.testing.assert_close(state["lora_A"], (layer.lora_A[0] + layer.lora_A[1]).detach() / 2)
    # bytes: exactly the A and B of one client, plus the safetensors header
    assert ups[0].nbytes == len(ups[0].to_bytes()) > 8 * (3 * 6 + 6 * 3)


def test_pf2lora_server_mean_is_uniform_over_the_participants_whatever_the_weights():
    """Alg. 1 line 8: x = (1/M) Σ_k x_k — data-size weights from the runtime must not enter."""
    layer = _pf2_layer(3)
    m = PF2LoRA(rank=3, client_rank=2)
    m.setup(layer, [0, 1, 2])
    ups = [m.upload(i) for i in range(3)]
    state = PF2LoRA.aggregate(ups, torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64))
    A, B = layer.lora_A.detach(), layer.lora_B.detach()
    torch.testing.assert_close(state["lora_A"], (A[0] + A[1] + A[2]) / 3, rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(state["lora_B"], (B[0] + B[1] + B[2]) / 3, rtol=1e-14, atol=1e-15)
    # through the simulator: unequal client weights, 2 of 4 clients per round
    from fedlora.simulator import Federation, run_rounds

    G = 4
    X, Y = _data(G)
    layer = _pf2_layer(G, seed=1)
    m = PF2LoRA(upper_lr=0.01, lower_lr=0.05, rank=3, client_rank=2)
    fed = Federation(1, G, client_weights=[1.0, 2.0, 3.0, 10.0], sample_fraction=0.5, sample_seed=2)
    m.setup(layer, fed.replica_clients)
    seen = []
    aggregate = m.aggregate
    m.aggregate = lambda payloads, weights: seen.append(payloads) or aggregate(payloads, weights)
    run_rounds(m, fed, _objective(layer), lambda: (X, Y), rounds=2, local_steps=2)
    last = seen[-1]
    assert len(last) == 2
    for i in range(G):
        torch.testing.assert_close(layer.lora_A[i].detach(), (last[0].tensors["lora_A"] + last[1].tensors["lora_A"]) / 2,
                                   rtol=1e-14, atol=1e-15)


def test_pf2lora_requires_client_adapter_of_the_declared_ranks():
    with pytest.raises(ConfigError, match="client_rank"):
        PF2LoRA().setup(LoRALinear(4, 4, 2, stack=2), [0, 1])
    with pytest.raises(ConfigError, match="rank 3 but"):
        PF2LoRA(rank=4, client_rank=2).setup(LoRALinear(4, 4, 3, client_rank=2, stack=2), [0, 1])
    with pytest.raises(ConfigError, match="r̃ < r"):
        PF2LoRA(rank=2, client_rank=2)
    assert PF2LoRA(rank=4, client_rank=1).adapter_kwargs() == {"rank": 4, "client_rank": 1}


def _het(G=2, ranks=(2, 6), penalty=0.5, gamma=0.7, seed=0):
    layer = LoRALinear(6, 6, 8, stack=G, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.lora_A.copy_(torch.randn(layer.lora_A.shape, generator=g, dtype=torch.float64))
        layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g, dtype=torch.float64))
    m = HetLoRA(lr=0.01, r_min=1, r_max=8, gamma=gamma, penalty=penalty, initial_ranks=ranks)
    m.setup(layer, list(range(G)))
    return layer, m


def test_hetlora_keeps_unused_slots_zero_and_penalty_has_a_gradient():
    layer, m = _het()
    assert torch.all(layer.lora_A[0, 2:] == 0) and torch.all(layer.lora_B[0, :, 2:] == 0)
    tail = m.tail_norm(layer.lora_A, layer.lora_B).sum()
    gA, = torch.autograd.grad(tail, layer.lora_A)
    assert gA[1, 4:6].abs().sum() > 0  # client 2 (r = 6): tail slots ⌊0.7·6⌋ = 4, 5 get a real gradient
    assert torch.all(gA[1, :4] == 0) and torch.all(gA[1, 6:] == 0)


def test_hetlora_pruning_is_monotone_and_respects_r_min():
    X, Y = _data(2, d=6)
    layer, m = _het(penalty=5.0)
    seen = [m.ranks.clone()]
    for rnd in range(12):
        m.begin_round(rnd)
        for _ in range(5):
            m.local_step(_objective(layer), lambda: (X, Y))
        m.end_round(rnd)
        seen.append(m.ranks.clone())
    for a, b in zip(seen, seen[1:]):
        assert torch.all(b <= a) and torch.all(b >= 1)
    assert seen[-1].tolist() != seen[0].tolist()  # a strong penalty does prune


def test_hetlora_zero_padding_round_trip_and_aggregate():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(3, 5, generator=g), torch.randn(4, 3, generator=g)
    ap, bp = zero_pad_rank(a, b, 7)
    assert ap.shape == (7, 5) and bp.shape == (4, 7)
    at, bt = truncate_rank(ap, bp, 3)
    assert torch.equal(at, a) and torch.equal(bt, b)
    torch.testing.assert_close(bp @ ap, b @ a)
    A, B, w = hetlora_aggregate([a, torch.zeros(2, 5)], [b, torch.zeros(4, 2)], 7)
    assert abs(float(w.sum()) - 1) < 1e-12 and float(w[0]) > 0.999
    _, _, w0 = hetlora_aggregate([torch.zeros(2, 5)] * 3, [torch.zeros(4, 2)] * 3, 4)
    torch.testing.assert_close(w0, torch.full((3,), 1 / 3, dtype=torch.float64))


def test_hetlora_upload_download_carry_r_k():
    layer, m = _het()
    up0, up1 = m.upload(0), m.upload(1)
    assert up0.tensors["lora_A"].shape == (2, 6) and up1.tensors["lora_A"].shape == (6, 6)
    assert up0.meta == {"r_max": "8"}  # the server's rank travels with every upload
    state = HetLoRA.aggregate([up0, up1], torch.tensor([0.5, 0.5]))
    assert state["lora_A"].shape == (8, 6) and state["lora_B"].shape == (6, 8)
    sent = m.download(0, state)
    assert sent.tensors["lora_A"].shape == (2, 6) and torch.all(layer.lora_A[0, 2:] == 0)
    with pytest.raises(ConfigError, match="lacks"):
        HetLoRA.aggregate([Payload(dict(up0.tensors))], torch.ones(1))
    with pytest.raises(ConfigError, match="disagree on the server rank"):
        HetLoRA.aggregate([up0, Payload(dict(up1.tensors), {"r_max": "9"})], torch.tensor([0.5, 0.5]))
    with pytest.raises(ConfigError, match="the server must keep rank r_max = 8"):
        m.download(1, {"lora_A": state["lora_A"][:2], "lora_B": state["lora_B"][:, :2]})


def _by_hand_hetlora(payloads, r_max):
    """HetLoRA's server from its definition (PF2LoRA §3): weights ‖B_kA_k‖_F / Σ_j ‖B_jA_j‖_F with the
    dense product, zero-padding to r_max, weighted sums."""
    norms = [float(torch.linalg.matrix_norm(p.tensors["lora_B"] @ p.tensors["lora_A"])) for p in payloads]
    w = [n / sum(norms) for n in norms]
    d_out, d_in = payloads[0].tensors["lora_B"].shape[0], payloads[0].tensors["lora_A"].shape[1]
    A, B = torch.zeros(r_max, d_in, dtype=torch.float64), torch.zeros(d_out, r_max, dtype=torch.float64)
    for wk, p in zip(w, payloads):
        r = p.tensors["lora_A"].shape[0]
        A[:r] += wk * p.tensors["lora_A"]
        B[:, :r] += wk * p.tensors["lora_B"]
    return A, B, w


def test_hetlora_server_values_are_the_sparsity_weighted_mean_not_the_data_weighted_one():
    layer, m = _het(G=3, ranks=(2, 6, 4))
    with torch.no_grad():  # very different ‖B_k A_k‖: the sparsity weights are far from any data weights
        layer.lora_B[0].mul_(3.0)
        layer.lora_B[2].mul_(0.2)
    ups = [m.upload(i) for i in range(3)]
    data_w = torch.tensor([0.1, 0.2, 0.7], dtype=torch.float64)
    state = HetLoRA.aggregate(ups, data_w)
    A, B, w = _by_hand_hetlora(ups, 8)
    assert max(abs(a - b) for a, b in zip(w, data_w.tolist())) > 0.3
    torch.testing.assert_close(state["lora_A"], A, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(state["lora_B"], B, rtol=1e-12, atol=1e-14)
    assert torch.equal(HetLoRA.aggregate(ups, torch.tensor([0.9, 0.05, 0.05]))["lora_A"], state["lora_A"])


def test_hetlora_round_through_download_gives_each_client_the_truncated_sparsity_mean():
    from fedlora.simulator import Federation, run_rounds

    X, Y = _data(3, d=6)
    layer, m = _het(G=3, ranks=(2, 6, 4), penalty=0.0)
    seen = []
    aggregate = m.aggregate
    m.aggregate = lambda payloads, weights: seen.append((payloads, weights)) or aggregate(payloads, weights)
    fed = Federation(1, 3, client_weights=[1.0, 2.0, 7.0])
    run_rounds(m, fed, _objective(layer), lambda: (X, Y), rounds=1, local_steps=2)
    (payloads, weights), = seen
    torch.testing.assert_close(weights, torch.tensor([0.1, 0.2, 0.7], dtype=torch.float64))  # passed, not used
    A, B, _ = _by_hand_hetlora(payloads, 8)
    ranks = m.ranks.tolist()  # after the round's self-pruning, which happens before the upload
    assert ranks == [p.tensors["lora_A"].shape[0] for p in payloads] and len(set(ranks)) == 3
    for i, r in enumerate(ranks):
        torch.testing.assert_close(layer.lora_A[i, :r].detach(), A[:r], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(layer.lora_B[i, :, :r].detach(), B[:, :r], rtol=1e-12, atol=1e-14)
        assert torch.all(layer.lora_A[i, r:] == 0) and torch.all(layer.lora_B[i, :, r:] == 0)


def test_hetlora_prunes_exactly_where_the_tail_norm_shrank():
    """Self-pruning (docs/design.md §4.7): r_k ← max(r_min, ⌊γ r_k⌋) if ‖B_tail‖‖A_tail‖ shrank over the round,
    unchanged if it grew or stayed; pruned slots become exactly zero."""
    layer, m = _het(G=4, ranks=(6, 6, 6, 2), gamma=0.7)  # tail of r = 6: slots ⌊4.2⌋ = 4, 5; of r = 2: slot 1
    m.begin_round(0)
    with torch.no_grad():
        layer.lora_A[0, 4:6].mul_(0.9)  # shrank → ⌊0.7·6⌋ = 4
        layer.lora_A[1, 4:6].mul_(1.1)  # grew → 6
        layer.lora_A[1, :4].mul_(0.5)  # (the head does not count)
        layer.lora_B[3, :, 1].mul_(0.5)  # shrank, r = 2 → max(r_min = 1, ⌊1.4⌋) = 1
    m.end_round(0)  # replica 2: unchanged tail → no pruning
    assert m.ranks.tolist() == [4, 6, 6, 1]
    assert torch.all(layer.lora_A[0, 4:] == 0) and torch.all(layer.lora_B[0, :, 4:] == 0)
    assert torch.all(layer.lora_A[1, 4:6] != 0) and torch.all(layer.lora_A[2, 4:6] != 0)
    # r_min binds: r = 4, γ = 0.7 → ⌊2.8⌋ = 2 < r_min = 3
    layer2 = LoRALinear(6, 6, 8, stack=1, dtype=torch.float64)
    with torch.no_grad():
        layer2.lora_B.normal_()
    m2 = HetLoRA(lr=0.01, r_min=3, r_max=8, gamma=0.7, penalty=0.5, initial_ranks=[4])
    m2.setup(layer2, [0])
    m2.begin_round(0)
    with torch.no_grad():
        layer2.lora_A[0, 2:4].mul_(0.5)
    m2.end_round(0)
    assert m2.ranks.tolist() == [3]


def test_registry_and_payload_round_trip():
    assert get_method("pf2lora") is PF2LoRA and get_method("hetlora") is HetLoRA
    with pytest.raises(ConfigError, match="unknown method 'nope'"):
        get_method("nope")
    p = Payload({"x": torch.arange(6.0).reshape(2, 3)}, {"idx": "0,2"})
    q = Payload.from_bytes(p.to_bytes())
    assert torch.equal(q.tensors["x"], p.tensors["x"]) and q.meta == {"idx": "0,2"}
    assert p.nbytes == len(p.to_bytes())


def test_unrolled_fast_path_equals_explicit_hvp_of_eq4():
    """Two batches (π = ζ, ξ = ξ̃) take one double backward through y⁺(x); equal but distinct
    batch objects take the explicit eq. (4) route (∇_x F − α·HVP). They must agree."""
    layer = _pf2_layer(3)
    X, Y = _data(3)
    objective = _objective(layer)
    x = [layer.lora_A.detach(), layer.lora_B.detach()]
    y = [layer.lora_C.detach(), layer.lora_D.detach()]

    def F(xx, yy, batch):
        return objective({"lora_A": xx[0], "lora_B": xx[1], "lora_C": yy[0], "lora_D": yy[1]}, batch).sum()

    inner, outer = (X, Y), (X * 0.5, Y)
    h_fast, yp_fast = bilevel_direction(F, x, y, 0.07, [inner, outer])
    h_hvp, yp_hvp = bilevel_direction(F, x, y, 0.07, [inner, outer, (outer[0].clone(), Y), (X.clone(), Y)])
    for a, b in zip(h_fast + yp_fast, h_hvp + yp_hvp):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert max(float(t.abs().max()) for t in h_fast) > 1e-3  # a real, non-zero direction


def test_finite_difference_step_is_per_replica():
    """A replica's finite-difference hypergradient must not depend on the other replicas in the
    stack (δ = fd_eps/‖v‖ per replica): replica 0 alone == replica 0 next to a 1000× larger one."""
    # float32: the central difference is exact in exact arithmetic here (∇_x F is quadratic in y),
    # so only rounding shows a δ set by the other replica — and float32 rounding shows it clearly
    X, Y = (t.float() for t in _data(2))
    Y = torch.stack([Y[0], 1000 * Y[1]])
    layer = _pf2_layer(2).float()
    solo = _pf2_layer(1).float()
    with torch.no_grad():
        for n, p in solo.named_parameters():
            p.copy_(getattr(layer, n)[:1])
    h = {}
    for name, lay, data in (("stack", layer, (X, Y)), ("solo", solo, (X[:1], Y[:1]))):
        m = PF2LoRA(upper_lr=0.01, lower_lr=0.05, upper_optimizer="sgd", rank=3, client_rank=2,
                    hypergradient="finite-difference")
        m.setup(lay, list(range(lay.stack)))
        m.local_step(_objective(lay), lambda d=data: d)
        h[name] = lay.lora_A[0].detach().clone()
    torch.testing.assert_close(h["stack"], h["solo"], rtol=1e-5, atol=1e-6)
    with pytest.raises(ConfigError, match="fd_eps must be a finite number > 0"):
        PF2LoRA(fd_eps=0.0)
