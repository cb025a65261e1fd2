"""Triton kernel tests (docs/design.md §7) — run on CPU under the Triton interpreter.

TRITON_INTERPRET must be set before the kernels module is first loaded; ``fedlora.kernels`` imports
triton lazily (first Triton-path call), so setting it here at import time is enough even when other
test files imported ``fedlora.kernels``/``fedlora`` first. Outputs are NaN-poisoned before every launch
(FEDLORA_KERNELS_POISON=1), so an element a kernel fails to write shows up as NaN.

Tolerance: every output and gradient within 1e-5 of a float64 oracle, relative to the oracle's
largest magnitude (elementwise relative error is meaningless for entries near zero).
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["FEDLORA_KERNELS_POISON"] = "1"

import importlib.util  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fedlora import kernels  # noqa: E402
from _kernel_helpers import TOL, _compare, _make, _oracle, _rel  # noqa: E402
from fedlora.kernels import lora_linear, lora_linear_multi, lora_linear_reference  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

if os.environ.get("TRITON_INTERPRET") != "1" and not os.environ.get("FEDLORA_TEST_DEVICE", "").startswith("cuda"):
    pytest.skip("TRITON_INTERPRET was set to something other than 1 (and no GPU named by FEDLORA_TEST_DEVICE)",
                allow_module_level=True)  # pragma: no cover

SETTINGS = dict(max_examples=20, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


DIMS = st.sampled_from([1, 17, 40, 100])
RANKS = st.sampled_from([1, 3, 8, 16, 17, 64])


@settings(**SETTINGS)
@given(M=DIMS, d_in=DIMS, d_out=DIMS, r=RANKS, rc=st.sampled_from([0, 2, 5, 64]),
       bias=st.booleans(), base=st.booleans(), three_d=st.booleans(), fuse=st.booleans(),
       base_gemm=st.sampled_from(["triton", "cublas"]), seed=st.integers(0, 2**16))
def test_forward_backward_matches_float64(M, d_in, d_out, r, rc, bias, base, three_d, fuse, base_gemm, seed):
    gen = torch.Generator().manual_seed(seed)
    x, w, bb, a, b, c, d = _make(M, d_in, d_out, r, rc, bias=bias, base=base, three_d=three_d, gen=gen)
    _compare(lambda *t: lora_linear(*t[:5], 0.7, t[5], t[6], 1.3, backend="triton", fuse=fuse,
                                    base_gemm=base_gemm),
             lambda *t: _oracle(*t[:5], 0.7, t[5], t[6], 1.3), (x, w, bb, a, b, c, d))


@pytest.mark.parametrize("fuse,base_gemm", [(True, "triton"), (False, "triton"), (None, "cublas")])
@pytest.mark.parametrize("mask_kind", ["on", "off", "random"])
def test_rank_mask(mask_kind, fuse, base_gemm):
    gen = torch.Generator().manual_seed(1)
    x, w, bb, a, b, c, d = _make(33, 40, 24, 8, 4, gen=gen)
    m = {"on": torch.ones(8), "off": torch.zeros(8),
         "random": (torch.rand(8, generator=gen) > 0.5).float()}[mask_kind]
    m2 = (torch.rand(4, generator=gen) > 0.5).float()
    fn = lambda *t: lora_linear(*t[:5], 0.5, t[5], t[6], 2.0, rank_mask=m, client_rank_mask=m2,  # noqa: E731
                                backend="triton", fuse=fuse, base_gemm=base_gemm)
    _compare(fn, lambda *t: _oracle(*t[:5], 0.5, t[5], t[6], 2.0, m.double(), m2.double()),
             (x, w, bb, a, b, c, d))
    # masked ranks: no contribution and zero gradients on their A rows / B columns
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    y = lora_linear(x.detach(), w, bb, a2, b2, 0.5, rank_mask=m, backend="triton", fuse=fuse, base_gemm=base_gemm)
    y.sum().backward()
    off = m == 0
    assert torch.all(a2.grad[off] == 0) and torch.all(b2.grad[:, off] == 0)
    if mask_kind == "off":
        ref = x.detach() @ w.T + bb
        assert _rel(y, ref.double()) < TOL


@pytest.mark.parametrize("density", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("d_in,d_out", [(40, 24), (24, 40)])  # fold into B, fold into A
def test_middle_matrix(density, d_in, d_out):
    gen = torch.Generator().manual_seed(2)
    r = 8
    x, w, bb, a, b, _, _ = _make(21, d_in, d_out, r, 0, gen=gen)
    rr = torch.randn(r, r, generator=gen).requires_grad_()
    phi = torch.randn(r, r, generator=gen).requires_grad_()
    k = round(density * r * r)
    support = torch.zeros(r * r)
    support[torch.randperm(r * r, generator=gen)[:k]] = 1.0
    support = support.view(r, r)
    rmask = (torch.rand(r, generator=gen) > 0.3).float()
    fn = lambda x_, w_, b_, a_, bb_, rr_, phi_: lora_linear(  # noqa: E731
        x_, w_, b_, a_, bb_, 0.5, middle=rr_, middle_phi=phi_, middle_mask=support, rank_mask=rmask,
        backend="triton")
    ref = lambda x_, w_, b_, a_, bb_, rr_, phi_: _oracle(  # noqa: E731
        x_, w_, b_, a_, bb_, 0.5, rank_mask=rmask.double(), middle=rr_, phi=phi_, support=support.double())
    _compare(fn, ref, (x, w, bb, a, b, rr, phi))
    rr2, phi2 = rr.detach().clone().requires_grad_(), phi.detach().clone().requires_grad_()
    fn(x.detach(), w, bb, a.detach(), b.detach(), rr2, phi2).square().sum().backward()
    off = support == 0
    assert torch.all(rr2.grad[off] == 0) and torch.all(phi2.grad[off] == 0)
    if density > 0:
        assert rr2.grad[~off].abs().sum() > 0


@pytest.mark.parametrize("fuse,base_gemm", [(True, "triton"), (False, "triton"), (None, "cublas")])
def test_stacked_factors(fuse, base_gemm):
    gen = torch.Generator().manual_seed(3)
    x, w, bb, a, b, c, d = _make(19, 30, 20, 4, 2, stack=3, gen=gen)
    _compare(lambda *t: lora_linear(*t[:5], 0.5, t[5], t[6], 1.5, backend="triton", fuse=fuse,
                                    base_gemm=base_gemm),
             lambda *t: _oracle(*t[:5], 0.5, t[5], t[6], 1.5), (x, w, bb, a, b, c, d))


@pytest.mark.parametrize("offsets_as", ["list", "tensor"])
@pytest.mark.parametrize("lens", [[5, 0, 40, 17], [1], [33, 33]])
@pytest.mark.parametrize("backend,fuse,base_gemm", [("reference", None, None), ("triton", True, "triton"),
                                                    ("triton", False, "triton"), ("triton", None, "cublas")])
def test_multi_client_equals_separate_calls(lens, backend, fuse, base_gemm, offsets_as):
    """Forward and every gradient vs K separate float64 oracle calls, client_rank_mask included.

    Every client's C_k, D_k and mask row differ, so a multi op that used client 0's adapter (or mask)
    for every segment fails on any case with K > 1. On the Triton path a tensor of offsets on X's
    device stays there (no host read: grid sized by an upper bound), a list is validated on the host.
    """
    gen = torch.Generator().manual_seed(4)
    K, d_in, d_out, r, rc = len(lens), 36, 28, 6, 3
    M = sum(lens)
    x = torch.randn(M, d_in, generator=gen).requires_grad_()
    w = torch.randn(d_out, d_in, generator=gen)
    bb = torch.randn(d_out, generator=gen)
    a = torch.randn(r, d_in, generator=gen).requires_grad_()
    b = torch.randn(d_out, r, generator=gen).requires_grad_()
    c = torch.randn(K, rc, d_in, generator=gen).requires_grad_()
    d = torch.randn(K, d_out, rc, generator=gen).requires_grad_()
    offs_list = [0] + torch.tensor(lens).cumsum(0).tolist()
    offs = offs_list if offsets_as == "list" else torch.tensor(offs_list)
    cm = (torch.rand(K, rc, generator=gen) > 0.3).float()
    cm[:, 0] = 1.0  # every client keeps a rank …
    cm[1:, 1] = 1.0 - cm[0, 1]  # … and the masks differ between client 0 and the others
    if K > 1:
        assert not torch.equal(c[0], c[1]) and not torch.equal(cm[0], cm[1])

    def separate(x_, w_, b_, a_, bb_, c_, d_):
        ys = [_oracle(x_[offs_list[k]:offs_list[k + 1]], w_, b_, a_, bb_, 0.5, c_[k], d_[k], 2.0,
                      client_rank_mask=cm[k].to(x_.dtype)) for k in range(K)]
        return torch.cat(ys)

    kw = {} if backend == "reference" else dict(fuse=fuse, base_gemm=base_gemm)
    _compare(lambda *t: lora_linear_multi(*t[:5], t[5], t[6], offs, 0.5, 2.0, client_rank_mask=cm,
                                          backend=backend, **kw),
             separate, (x, w, bb, a, b, c, d))


def test_hvp_through_op_matches_reference():
    """PF2LoRA mixed term ∇²_{xy}F·v: double backward through the Triton op vs the reference."""
    gen = torch.Generator().manual_seed(5)
    x, w, bb, a, b, c, d = _make(23, 20, 18, 4, 2, gen=gen)
    x = x.detach()
    target = torch.randn(23, 18, generator=gen)
    v = [torch.randn_like(c), torch.randn_like(d)]

    def hvp(fn):
        a_, b_, c_, d_ = (t.detach().clone().requires_grad_() for t in (a, b, c, d))
        y = fn(x, w, bb, a_, b_, 0.5, c_, d_, 2.0)
        loss = torch.tanh(y - target).square().mean()
        gy = torch.autograd.grad(loss, (c_, d_), create_graph=True)
        dot = sum((g * vv).sum() for g, vv in zip(gy, v))
        return torch.autograd.grad(dot, (a_, b_, c_, d_))

    got = hvp(lambda *t: lora_linear(*t, backend="triton"))
    ref = hvp(lambda *t: lora_linear_reference(*[u.double() if isinstance(u, torch.Tensor) else u for u in t]))
    for p, q in zip(got, ref):
        assert _rel(p, q) < 1e-4  # second order through fp32 chains: looser than first order


@pytest.mark.parametrize("stack", [None, 3])
def test_second_order_through_dx_of_a_two_layer_chain_matches_reference(stack):
    """The differentiable (create_graph) backward for X: PF2LoRA's mixed term through TWO stacked LoRA
    layers, where the second layer's input depends on the first layer's adapters, so ∂²/∂(a₁,b₁)∂(c₂,d₂)
    flows through the second op's dX and its backward. Single and stacked (3 replicas, equal segments)."""
    gen = torch.Generator().manual_seed(11)
    x, w1, bb1, a1, b1, c1, d1 = _make(14, 12, 10, 4, 2, stack=stack, gen=gen)
    _, w2, bb2, a2, b2, c2, d2 = _make(14, 10, 8, 3, 2, stack=stack, gen=gen)
    target = torch.randn(*x.shape[:-1], 8, generator=gen)
    vs = [torch.randn_like(t) for t in (c1, d1, c2, d2)]

    def second_order(op, dtype):
        xs = x.detach().to(dtype).requires_grad_()
        ps = [t.detach().to(dtype).requires_grad_() for t in (a1, b1, c1, d1, a2, b2, c2, d2)]
        cast = [None if t is None else t.to(dtype) for t in (w1, bb1, w2, bb2)]
        h = torch.tanh(op(xs, cast[0], cast[1], ps[0], ps[1], 0.5, ps[2], ps[3], 2.0))
        y = op(h, cast[2], cast[3], ps[4], ps[5], 0.5, ps[6], ps[7], 2.0)
        loss = torch.tanh(y - target.to(dtype)).square().mean()
        gy = torch.autograd.grad(loss, [ps[2], ps[3], ps[6], ps[7]], create_graph=True)
        dot = sum((g * v.to(dtype)).sum() for g, v in zip(gy, vs))
        return torch.autograd.grad(dot, [xs, *ps])

    got = second_order(lambda *t: lora_linear(*t, backend="triton"), torch.float32)
    ref = second_order(lora_linear_reference, torch.float64)
    for p, q in zip(got, ref):
        assert _rel(p, q) < 1e-4


def test_second_order_through_dx_with_unequal_client_segments_matches_reference():
    """The same chain through the multi-client op with unequal segments (the per-segment branch of the
    differentiable backward): against K separate float64 reference calls per layer."""
    gen = torch.Generator().manual_seed(12)
    offs, K = [0, 5, 6, 14], 3
    x, w1, bb1, a1, b1, _, _ = _make(14, 12, 10, 4, 0, gen=gen)
    _, w2, bb2, a2, b2, _, _ = _make(14, 10, 8, 3, 0, gen=gen)
    c1, d1 = torch.randn(K, 2, 12, generator=gen), torch.randn(K, 10, 2, generator=gen)
    c2, d2 = torch.randn(K, 2, 10, generator=gen), torch.randn(K, 8, 2, generator=gen)
    target = torch.randn(14, 8, generator=gen)
    vs = [torch.randn_like(t) for t in (c1, d1, c2, d2)]

    def separate(x_, w, bb, a, b, c, d):
        return torch.cat([lora_linear_reference(x_[offs[k]:offs[k + 1]], w, bb, a, b, 0.5, c[k], d[k], 2.0)
                          for k in range(K)])

    def triton(x_, w, bb, a, b, c, d):
        return lora_linear_multi(x_, w, bb, a, b, c, d, offs, 0.5, 2.0, backend="triton")

    def second_order(op, dtype):
        xs = x.detach().to(dtype).requires_grad_()
        ps = [t.detach().to(dtype).requires_grad_() for t in (a1, b1, c1, d1, a2, b2, c2, d2)]
        cast = [t.to(dtype) for t in (w1, bb1, w2, bb2)]
        h = torch.tanh(op(xs, cast[0], cast[1], *ps[:4]))
        y = op(h, cast[2], cast[3], *ps[4:])
        loss = torch.tanh(y - target.to(dtype)).square().mean()
        gy = torch.autograd.grad(loss, [ps[2], ps[3], ps[6], ps[7]], create_graph=True)
        dot = sum((g * v.to(dtype)).sum() for g, v in zip(gy, vs))
        return torch.autograd.grad(dot, [xs, *ps])

    got = second_order(triton, torch.float32)
    ref = second_order(separate, torch.float64)
    for p, q in zip(got, ref):
        assert _rel(p, q) < 1e-4


def test_gradcheck_reference_float64():
    gen = torch.Generator().manual_seed(6)
    x, w, bb, a, b, c, d = _make(5, 6, 4, 2, 1, gen=gen)
    ts = [t.detach().double().requires_grad_(t.requires_grad) if t is not None else None
          for t in (x, w, bb, a, b, c, d)]
    f = lambda x_, a_, b_, c_, d_: lora_linear_reference(x_, ts[1], ts[2], a_, b_, 0.5, c_, d_, 2.0)  # noqa: E731
    inputs = (ts[0], ts[3], ts[4], ts[5], ts[6])
    assert torch.autograd.gradcheck(f, inputs)
    assert torch.autograd.gradgradcheck(f, inputs)


def test_folded_reference_path_matches_oracle():
    gen = torch.Generator().manual_seed(7)
    x, w, bb, a, b, c, d = _make(9, 12, 10, 4, 2, gen=gen)
    m = torch.tensor([1.0, 0.0, 1.0, 1.0])
    rr = torch.randn(4, 4, generator=gen)
    _compare(lambda *t: lora_linear(*t[:5], 0.5, t[5], t[6], 2.0, rank_mask=m, middle=rr, backend="reference"),
             lambda *t: _oracle(*t[:5], 0.5, t[5], t[6], 2.0, m.double(), middle=rr.double()),
             (x, w, bb, a, b, c, d))


@pytest.mark.cpu_tensors
def test_cpu_default_is_reference():
    x = torch.randn(3, 4)
    assert kernels.backend_for(x, backend="auto") == "reference"
    assert kernels.backend_for(x, backend="triton") == "triton"


def test_a_forward_mode_tangent_runs_on_the_reference_op():
    """PF2LoRA's private exact mixed term runs forward-mode AD through the layers (forward and backward): the
    kernels' autograd.Function has no jvp, so an operand carrying a tangent goes to the reference op, whose torch
    ops propagate it — even where 'triton' is forced. The tangent of the output and of the factors' gradients equal
    the reference's (and a directional finite difference)."""
    import torch.autograd.forward_ad as fwAD

    gen = torch.Generator().manual_seed(5)
    x, w, bb, a, b, c, d = (t.detach().double() for t in _make(8, 8, 5, 3, 2, gen=gen))  # float64: a tight check
    tc, td = (torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in (c, d))
    assert kernels.backend_for(x, w, bb, a, b, c, d, backend="triton") == "triton"  # no dual level open

    def run(c_, d_, backend):
        a_ = a.clone().requires_grad_(True)  # the gradient of a factor without a tangent, as PF2LoRA's x
        y = lora_linear(x, w, bb, a_, b, 0.5, c_, d_, 2.0, backend=backend)
        return y, torch.autograd.grad((y * y).sum(), a_)[0]

    with fwAD.dual_level():
        cd, dd = fwAD.make_dual(c, tc), fwAD.make_dual(d, td)
        assert kernels.backend_for(x, w, bb, a, b, cd, dd, backend="triton") == "reference"
        assert kernels.backend_for(x, w, bb, a, b, c, d, backend="triton") == "triton"  # no operand carries one
        y, ga = run(cd, dd, "triton")
        ty, tga = fwAD.unpack_dual(y).tangent, fwAD.unpack_dual(ga).tangent
    h = 1e-5
    (yp, gp), (ym, gm) = run(c + h * tc, d + h * td, "reference"), run(c - h * tc, d - h * td, "reference")
    assert ty is not None and tga is not None and tga.abs().max() > 1e-3
    torch.testing.assert_close(ty, (yp - ym) / (2 * h), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(tga, (gp - gm) / (2 * h), rtol=1e-6, atol=1e-7)
    # the multi-client op: client k's (C, D) on its rows, the tangent on client 1's only
    cs, ds = torch.stack([c, 2 * c]), torch.stack([d, -d])
    tcs, tds = torch.stack([torch.zeros_like(tc), tc]), torch.stack([torch.zeros_like(td), td])

    def multi(c_, d_, backend):
        return lora_linear_multi(x, w, bb, a, b, c_, d_, [0, 3, 8], 0.5, 2.0, backend=backend)

    with fwAD.dual_level():
        tm = fwAD.unpack_dual(multi(fwAD.make_dual(cs, tcs), fwAD.make_dual(ds, tds), "triton")).tangent
    fd = (multi(cs + h * tcs, ds + h * tds, "reference") - multi(cs - h * tcs, ds - h * tds, "reference")) / (2 * h)
    assert tm is not None and tm[3:].abs().max() > 1e-3 and not tm[:3].any()
    torch.testing.assert_close(tm, fd, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("case,match", [
    ("rank", "exceeds"), ("dtype", "dtype"), ("shape", "B must be"), ("mask", "rank_mask"),
    ("middle", "middle"), ("offsets", "seg_offsets"), ("fp64", "float32"), ("backend", "FEDLORA_KERNELS"),
])
def test_bad_input_raises_valueerror_before_launch(case, match):
    x = torch.randn(4, 8)
    w = torch.randn(6, 8)
    a, b = torch.randn(2, 8), torch.randn(6, 2)
    with pytest.raises(ValueError, match=match):
        if case == "rank":
            lora_linear(x, w, None, torch.randn(100, 8), torch.randn(6, 100), 1.0, torch.randn(40, 8),
                        torch.randn(6, 40), backend="triton")
        elif case == "dtype":
            lora_linear(x, w.double(), None, a, b, backend="triton")
        elif case == "shape":
            lora_linear(x, w, None, a, torch.randn(5, 2), backend="triton")
        elif case == "mask":
            lora_linear(x, w, None, a, b, rank_mask=torch.ones(3), backend="triton")
        elif case == "middle":
            lora_linear(x, w, None, a, b, middle=torch.ones(3, 3), backend="triton")
        elif case == "offsets":
            lora_linear_multi(x, w, None, a, b, torch.randn(2, 1, 8), torch.randn(2, 6, 1), [0, 3, 5],
                              backend="triton")
        elif case == "fp64":
            lora_linear(x.double(), w.double(), None, a.double(), b.double(), backend="triton")
        elif case == "backend":
            lora_linear(x, w, None, a, b, backend="cuda-please")


def test_poison_catches_unwritten_output():
    """The NaN poison is real: an output the kernels never touch stays NaN."""
    from fedlora.kernels.lora_linear import _alloc

    t = _alloc((2, 3), torch.float32, torch.device("cpu"))
    assert torch.isnan(t).all()
