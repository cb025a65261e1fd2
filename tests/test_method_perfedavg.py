"""Per-FedAvg-LoRA as a Method: FO and HF steps against hand / autograd MAML on quadratics,
personalised evaluation, FedAvg server, bad options."""
import itertools

import pytest
import torch
from torch.func import functional_call

from fedlora.adapter import LoRALinear
from fedlora.errors import ConfigError
from fedlora.methods import PerFedAvgLoRA, get_method
from fedlora.simulator import Federation, run_rounds

D64 = torch.float64
G, R, D_IN, D_OUT = 3, 2, 4, 3
N = R * D_IN + D_OUT * R


def _layer(seed=0):
    layer = LoRALinear(D_IN, D_OUT, R, stack=G, dtype=D64)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=D64))
    return layer


def _z(A, B):
    """Per replica vector [vec A; vec B], shape (..., N)."""
    return torch.cat([A.flatten(-2), B.flatten(-2)], dim=-1)


def _quad_objective(params, batch):
    """f(A, B; Q, c) = ½ (z − c)ᵀ Q (z − c) per replica: quadratic, so central differences are exact."""
    Q, c = batch
    e = _z(params["lora_A"], params["lora_B"]) - c
    return 0.5 * torch.einsum("gi,gij,gj->g", e, Q, e)


def _quad_batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        M = torch.randn(G, N, N, generator=g, dtype=D64) / N ** 0.5
        out.append((M @ M.transpose(-1, -2) + 0.1 * torch.eye(N, dtype=D64), torch.randn(G, N, generator=g, dtype=D64)))
    return out


def _sampler(batches):
    it = itertools.cycle(batches)
    return lambda: next(it)


def _method(variant, layer, alpha=0.3, beta=0.05, **kw):
    m = PerFedAvgLoRA(rank=R, lr=beta, inner_lr=alpha, variant=variant, optimizer="sgd", **kw)
    m.bind(layer, list(range(G)))  # generic x per replica: no initial broadcast
    return m


def test_first_order_step_by_hand():
    layer = _layer()
    z0 = _z(layer.lora_A, layer.lora_B).detach()
    (Q1, c1), (Q2, c2) = batches = _quad_batches(2)
    m = _method("first-order", layer)
    m.local_step(_quad_objective, _sampler(batches))
    grad = lambda Q, c, z: torch.einsum("gij,gj->gi", Q, z - c)  # ∇f = Q (z − c), Q symmetric
    z_tilde = z0 - 0.3 * grad(Q1, c1, z0)
    z1 = z0 - 0.05 * grad(Q2, c2, z_tilde)
    torch.testing.assert_close(_z(layer.lora_A, layer.lora_B).detach(), z1, rtol=1e-12, atol=1e-12)


def _exact_maml_direction(layer, batches, alpha):
    """(I − α∇²f(x; D″)) ∇f(x − α∇f(x; D); D′) by autograd double backward (no finite differences)."""
    D, D1, D2 = batches
    x = [layer.lora_A.detach().clone().requires_grad_(), layer.lora_B.detach().clone().requires_grad_()]
    f = lambda ws, b: _quad_objective({"lora_A": ws[0], "lora_B": ws[1]}, b).sum()
    g_in = torch.autograd.grad(f(x, D), x)
    xt = [(xi - alpha * gi).detach().requires_grad_() for xi, gi in zip(x, g_in)]
    v = torch.autograd.grad(f(xt, D1), xt)
    g_h = torch.autograd.grad(f(x, D2), x, create_graph=True)
    hvp = torch.autograd.grad(sum((gi * vi).sum() for gi, vi in zip(g_h, v)), x)
    return [vi - alpha * hi for vi, hi in zip(v, hvp)]


def test_hessian_free_step_equals_exact_second_order_maml_on_a_quadratic():
    layer = _layer()
    x0 = [layer.lora_A.detach().clone(), layer.lora_B.detach().clone()]
    batches = _quad_batches(3)
    h = _exact_maml_direction(layer, batches, 0.3)
    m = _method("hessian-free", layer, delta=1e-3)
    m.local_step(_quad_objective, _sampler(batches))
    torch.testing.assert_close(layer.lora_A.detach(), x0[0] - 0.05 * h[0], rtol=0, atol=1e-8)
    torch.testing.assert_close(layer.lora_B.detach(), x0[1] - 0.05 * h[1], rtol=0, atol=1e-8)
    # first-order differs (the Hessian term matters here), so the comparison above has teeth
    fo = _method("first-order", _layer()).meta_direction(_quad_objective, _sampler(batches))
    assert (fo[0] - h[0]).abs().max() > 1e-2


def test_hessian_free_with_one_batch_is_the_gradient_of_the_unrolled_maml_loss():
    """D = D′ = D″: the HF direction equals ∇_x f(x − α∇f(x)) computed by autograd through the step."""
    layer = _layer(seed=3)
    batch = _quad_batches(1, seed=4)
    x = [layer.lora_A.detach().clone().requires_grad_(), layer.lora_B.detach().clone().requires_grad_()]
    f = lambda ws: _quad_objective({"lora_A": ws[0], "lora_B": ws[1]}, batch[0]).sum()
    g = torch.autograd.grad(f(x), x, create_graph=True)
    want = torch.autograd.grad(f([xi - 0.3 * gi for xi, gi in zip(x, g)]), x)
    got = _method("hessian-free", layer).meta_direction(_quad_objective, _sampler(batch))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-8)


def _lora_objective(layer):
    def objective(params, batch):
        X, Y = batch
        return ((functional_call(layer, params, (X,)) - Y) ** 2).mean(dim=(-2, -1))
    return objective


def _lora_batches(n, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(G, 20, D_IN, generator=g, dtype=D64), torch.randn(G, 20, D_OUT, generator=g, dtype=D64))
            for _ in range(n)]


def test_hessian_free_on_a_lora_layer_is_second_order_close():
    """On the (quartic) LoRA loss the finite difference is no longer exact: error O(δ²)."""
    layer = _layer(seed=2)
    batches = _lora_batches(3)
    obj = _lora_objective(layer)
    D, D1, D2 = batches
    x = [layer.lora_A.detach().clone().requires_grad_(), layer.lora_B.detach().clone().requires_grad_()]
    f = lambda ws, b: obj({"lora_A": ws[0], "lora_B": ws[1]}, b).sum()
    g_in = torch.autograd.grad(f(x, D), x)
    xt = [(xi - 0.1 * gi).detach().requires_grad_() for xi, gi in zip(x, g_in)]
    v = torch.autograd.grad(f(xt, D1), xt)
    g_h = torch.autograd.grad(f(x, D2), x, create_graph=True)
    hvp = torch.autograd.grad(sum((gi * vi).sum() for gi, vi in zip(g_h, v)), x)
    want = [vi - 0.1 * hi for vi, hi in zip(v, hvp)]
    errs = []
    for delta in (1e-2, 1e-3):
        got = _method("hessian-free", layer, alpha=0.1, delta=delta).meta_direction(obj, _sampler(batches))
        errs.append(max(float((a - b).abs().max()) for a, b in zip(got, want)))
    assert errs[1] < 1e-5 and errs[1] < errs[0] / 50  # ≈ 100× smaller for 10× smaller δ


def test_personalised_params_is_one_sgd_step_and_leaves_the_model_alone():
    layer = _layer()
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    batches = _quad_batches(1, seed=7)
    m = _method("hessian-free", layer, alpha=0.2)
    with torch.no_grad():  # as an evaluator would call it
        out = m.personalised_params(_quad_objective, _sampler(batches))
    Q, c = batches[0]
    z0 = _z(before["lora_A"], before["lora_B"])
    want = z0 - 0.2 * torch.einsum("gij,gj->gi", Q, z0 - c)
    torch.testing.assert_close(_z(out["lora_A"], out["lora_B"]), want, rtol=1e-12, atol=1e-12)
    for n, p in layer.named_parameters():
        assert torch.equal(p, before[n]) and p.grad is None
    assert set(out) == set(before) and not any(t.requires_grad for t in out.values())


def test_round_fedavg_of_factors_and_payload_bytes():
    layer = _layer()
    batches = _lora_batches(4)
    m = PerFedAvgLoRA(rank=R, lr=1e-2, inner_lr=1e-2, variant="hessian-free")  # AdamW outer (default)
    m.bind(layer, list(range(G)))  # generic x per replica: no initial broadcast
    fed = Federation(1, G, client_weights=[1.0, 2.0, 5.0])
    hist = run_rounds(m, fed, _lora_objective(layer), _sampler(batches), rounds=2, local_steps=3)
    for i in range(1, G):  # after the download every client holds the same averaged factors
        assert torch.equal(layer.lora_A[i], layer.lora_A[0]) and torch.equal(layer.lora_B[i], layer.lora_B[0])
    raw = 8 * (R * D_IN + D_OUT * R)
    for key in ("bytes_up", "bytes_down"):
        assert all(0 < b - raw < 300 for b in hist[-1][key])
    ups = [m.upload(i) for i in range(G)]
    state = PerFedAvgLoRA.aggregate(ups, torch.tensor([0.2, 0.3, 0.5], dtype=D64))
    torch.testing.assert_close(state["lora_A"], sum(w * p.tensors["lora_A"] for w, p in zip([0.2, 0.3, 0.5], ups)))


def test_registry_and_bad_inputs():
    assert get_method("perfedavg") is PerFedAvgLoRA
    assert PerFedAvgLoRA(rank=4).adapter_kwargs() == {"rank": 4}
    with pytest.raises(ConfigError, match="variant"):
        PerFedAvgLoRA(variant="second-order")
    with pytest.raises(ConfigError, match="inner_lr"):
        PerFedAvgLoRA(inner_lr=0.0)
    with pytest.raises(ConfigError, match="inner_lr"):
        PerFedAvgLoRA(inner_lr=-0.1)
    with pytest.raises(ConfigError, match="delta"):
        PerFedAvgLoRA(delta=0.0)
    with pytest.raises(ConfigError, match="lr"):
        PerFedAvgLoRA(lr=-1.0)
    with pytest.raises(ConfigError, match="optimizer"):
        PerFedAvgLoRA(optimizer="adam")
    with pytest.raises(ConfigError, match="rank"):
        PerFedAvgLoRA(rank=0)
    with pytest.raises(ConfigError, match="stacked"):
        PerFedAvgLoRA(rank=2).setup(LoRALinear(4, 3, 2), [0])
