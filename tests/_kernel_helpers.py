"""Shared pieces of the Triton-kernel tests (run on CPU under the Triton interpreter).

Importing this module sets TRITON_INTERPRET=1 (unless set) and FEDLORA_KERNELS_POISON=1 before triton
is first imported (``fedlora.kernels`` imports triton lazily), so kernel outputs are NaN-poisoned before every
launch and an element a kernel fails to write shows up as NaN.

Tolerance: every output and gradient within 1e-5 of a float64 oracle, relative to the oracle's largest
magnitude (elementwise relative error is meaningless for entries near zero).
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["FEDLORA_KERNELS_POISON"] = "1"

import contextlib  # noqa: E402
import importlib  # noqa: E402

import torch  # noqa: E402

TOL = 1e-5


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert torch.isfinite(got).all(), "non-finite entries (unwritten output?)"
    scale = ref.abs().max().item()
    return (got.double() - ref).abs().max().item() / max(scale, 1e-30)


def _oracle(x, w, bias, a, b, s1, c=None, d=None, s2=1.0, rank_mask=None, client_rank_mask=None,
            middle=None, phi=None, support=None):
    """Float64 ΔW formula, independent of the folding code."""
    r = a.shape[-2]
    mid = torch.eye(r, dtype=a.dtype)
    if middle is not None:
        e = middle
        if phi is not None:
            e = e * phi
        if support is not None:
            e = e * support.to(e.dtype)
        mid = mid + e
    m = torch.ones(r, dtype=a.dtype) if rank_mask is None else rank_mask.to(a.dtype)
    dw = s1 * (b @ mid @ torch.diag_embed(m) @ a)
    if c is not None:
        m2 = torch.ones(c.shape[-2], dtype=a.dtype) if client_rank_mask is None else client_rank_mask.to(a.dtype)
        dw = dw + s2 * (d @ torch.diag_embed(m2) @ c)
    y = x @ dw.transpose(-1, -2)
    if w is not None:
        y = y + x @ w.T
    if bias is not None:
        y = y + bias
    return y


def _leaves(*ts):
    f32 = [None if t is None else t.detach().clone().requires_grad_(t.requires_grad) for t in ts]
    f64 = [None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in ts]
    return f32, f64


def _compare(fn32, fn64, tensors, tol=TOL, grad_layout=None):
    """Run both, compare outputs and the gradient of every leaf that requires grad.

    ``grad_layout``: applied to the float32 upstream gradient dY (e.g. to make it non-contiguous).
    """
    (t32, t64) = _leaves(*tensors)
    y32, y64 = fn32(*t32), fn64(*t64)
    assert _rel(y32, y64) < tol, f"forward rel err {_rel(y32, y64)}"
    g = torch.randn(y32.shape, dtype=torch.float64)
    idx = [i for i, t in enumerate(tensors) if t is not None and t.requires_grad]
    g32 = g.float() if grad_layout is None else grad_layout(g.float())
    gr32 = torch.autograd.grad(y32, [t32[i] for i in idx], g32, allow_unused=True)
    gr64 = torch.autograd.grad(y64, [t64[i] for i in idx], g, allow_unused=True)
    for i, p, q in zip(idx, gr32, gr64):
        if q is None:
            continue
        if p is None:
            p = torch.zeros_like(q).float()
        assert _rel(p, q) < tol, f"grad of input #{i}: rel err {_rel(p, q)}"
    return y32


def _make(M, d_in, d_out, r, rc, *, bias=True, base=True, stack=None, three_d=False, gen=None):
    lead = () if stack is None else (stack,)
    xs = (stack, M, d_in) if stack is not None else ((2, M, d_in) if three_d else (M, d_in))
    x = torch.randn(xs, generator=gen).requires_grad_()
    w = torch.randn(d_out, d_in, generator=gen) / d_in ** 0.5 if base else None
    bb = torch.randn(d_out, generator=gen) if bias else None
    a = torch.randn(*lead, r, d_in, generator=gen).requires_grad_()
    b = torch.randn(*lead, d_out, r, generator=gen).requires_grad_()
    c = d = None
    if rc:
        c = torch.randn(*lead, rc, d_in, generator=gen).requires_grad_()
        d = torch.randn(*lead, d_out, rc, generator=gen).requires_grad_()
    return x, w, bb, a, b, c, d


@contextlib.contextmanager
def recorded_launches():
    """Record (kernel name, kwargs, args) of every Triton launch the op makes, launching each for real."""
    ll = importlib.import_module("fedlora.kernels.lora_linear")  # the package attribute `lora_linear` is the op
    seen = []

    def hook(kernel, grid, args, kwargs):
        seen.append((kernel.base_fn.__name__, dict(kwargs), args))
        kernel[grid](*args, **kwargs)

    with ll.launch_hook(hook):
        yield seen
