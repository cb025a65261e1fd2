"""No host↔device traffic on the hot path (review issue 8, item 6), checked on CPU under the interpreter.

On CUDA, ``torch.tensor(..., device=cuda)`` is a blocking host→device copy and ``.tolist()`` / ``.item()``
/ ``bool(t)`` / ``int(t)`` a device→host sync; both break CUDA-graph capture. ``host_traffic`` records every
such call whose caller is a file of the ``fedlora.kernels`` package, the folder ``kernels/`` (host code; the
interpreter's own reads of kernel arguments come from triton's files and are not counted). After a first call (which may upload
a host-known offsets table once), repeated forward + backward calls must record nothing; offsets
given as a tensor on X's device are never read on the host at all.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
from _kernel_helpers import _compare, _oracle

from fedlora.kernels import lora_linear, lora_linear_multi

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

KERNELS_DIR = str(pathlib.Path(__file__).resolve().parents[1] / "kernels")
_FACTORIES = ("tensor", "as_tensor", "from_numpy")
_METHODS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__index__", "__float__")


@contextlib.contextmanager
def host_traffic():
    """Record (what, file:line) of tensor creation from host data and host reads made by kernels/ code."""
    calls = []

    def caller():
        f = sys._getframe(2)
        return f.f_code.co_filename, f.f_lineno

    def wrap(name, fn):
        def spy(*args, **kwargs):
            file, line = caller()
            if file.startswith(KERNELS_DIR) and not file.endswith("_triton_kernels.py"):
                calls.append((name, f"{pathlib.Path(file).name}:{line}"))
            return fn(*args, **kwargs)
        return spy

    saved = {}
    try:
        for name in _FACTORIES:
            saved[("torch", name)] = getattr(torch, name)
            setattr(torch, name, wrap(f"torch.{name}", getattr(torch, name)))
        for name in _METHODS:
            orig = getattr(torch.Tensor, name)
            saved[("Tensor", name)] = orig
            setattr(torch.Tensor, name, wrap(f"Tensor.{name}", orig))
        yield calls
    finally:
        for (owner, name), fn in saved.items():
            setattr(torch if owner == "torch" else torch.Tensor, name, fn)


def _ops(M, K_clients=None, gen_seed=0):
    gen = torch.Generator().manual_seed(gen_seed)
    d_in, d_out, r, rc = 24, 20, 4, 2
    x = torch.randn(M, d_in, generator=gen).requires_grad_()
    w = torch.randn(d_out, d_in, generator=gen) / d_in ** 0.5
    bb = torch.randn(d_out, generator=gen)
    a = torch.randn(r, d_in, generator=gen).requires_grad_()
    b = torch.randn(d_out, r, generator=gen).requires_grad_()
    lead = () if K_clients is None else (K_clients,)
    c = torch.randn(*lead, rc, d_in, generator=gen).requires_grad_()
    d = torch.randn(*lead, d_out, rc, generator=gen).requires_grad_()
    return x, w, bb, a, b, c, d


def _step(fn, leaves):
    y = fn()
    torch.autograd.grad(y, leaves, torch.ones_like(y))


def test_spy_sees_a_host_upload_from_kernels_code():
    """The spy is real: a torch.tensor(...) made in kernels/ code is recorded (the offsets cache's upload)."""
    ll = importlib.import_module("fedlora.kernels.lora_linear")  # the package attribute `lora_linear` is the op
    ll._OFFSETS_CACHE.clear()
    with host_traffic() as calls:
        ll._offsets_tensor((0, 3, 5), torch.device("cpu"))
        ll._offsets_tensor((0, 3, 5), torch.device("cpu"))  # cached: no second upload
    assert [c[0] for c in calls] == ["torch.tensor"], calls


@pytest.mark.parametrize("base_gemm", ["triton", "cublas"])
@pytest.mark.parametrize("fuse", [True, False])
def test_single_client_and_stacked_calls_touch_no_host_data(fuse, base_gemm):
    x, w, bb, a, b, c, d = _ops(21)
    xs = torch.randn(3, 7, 24).requires_grad_()
    a3, b3 = torch.randn(3, 4, 24).requires_grad_(), torch.randn(3, 20, 4).requires_grad_()
    kw = dict(backend="triton", fuse=fuse, base_gemm=base_gemm)
    with host_traffic() as calls:
        for _ in range(2):
            _step(lambda: lora_linear(x, w, bb, a, b, 0.5, c, d, 2.0, **kw), [x, a, b, c, d])
            _step(lambda: lora_linear(xs, w, bb, a3, b3, 0.5, **kw), [xs, a3, b3])
    assert calls == [], calls


@pytest.mark.parametrize("base_gemm", ["triton", "cublas"])
def test_multi_host_offsets_uploaded_once_then_cached(base_gemm):
    ll = importlib.import_module("fedlora.kernels.lora_linear")  # the package attribute `lora_linear` is the op
    ll._OFFSETS_CACHE.clear()
    x, w, bb, a, b, c, d = _ops(30, K_clients=3)
    offs = [0, 4, 4, 30]  # unequal: the kernels need the table
    fn = lambda: lora_linear_multi(x, w, bb, a, b, c, d, offs, 0.5, 2.0, backend="triton",  # noqa: E731
                                   base_gemm=base_gemm)
    with host_traffic() as first:
        _step(fn, [x, a, b, c, d])
    with host_traffic() as later:
        for _ in range(2):
            _step(fn, [x, a, b, c, d])
    assert [c_[0] for c_ in first] == ["torch.tensor"], first
    assert later == [], later
    # equal segments never need a table
    with host_traffic() as equal:
        _step(lambda: lora_linear_multi(x, w, bb, a, b, c, d, [0, 10, 20, 30], 0.5, 2.0, backend="triton",
                                        base_gemm=base_gemm), [x, a, b, c, d])
    assert equal == [], equal


@pytest.mark.parametrize("base_gemm", ["triton", "cublas"])
@pytest.mark.parametrize("lens", [[5, 0, 40, 17], [0, 0, 9], [64, 1]])
def test_multi_device_offsets_never_read_on_host(lens, base_gemm):
    """Offsets as a tensor on X's device: no host read on any call; upper-bound grid still exact."""
    K = len(lens)
    M = sum(lens)
    x, w, bb, a, b, c, d = _ops(M, K_clients=K, gen_seed=1)
    offs_list = [0] + torch.tensor(lens).cumsum(0).tolist()
    offs = torch.tensor(offs_list, dtype=torch.int64)  # cast on the device by the op, still no host read
    with host_traffic() as calls:
        for _ in range(2):
            _step(lambda: lora_linear_multi(x, w, bb, a, b, c, d, offs, 0.5, 2.0, backend="triton",
                                            base_gemm=base_gemm), [x, a, b, c, d])
    assert calls == [], calls

    def separate(x_, w_, b_, a_, bb_, c_, d_):
        return torch.cat([_oracle(x_[offs_list[k]:offs_list[k + 1]], w_, b_, a_, bb_, 0.5, c_[k], d_[k], 2.0)
                          for k in range(K)])

    _compare(lambda *t: lora_linear_multi(*t, offs, 0.5, 2.0, backend="triton", base_gemm=base_gemm),
             separate, (x, w, bb, a, b, c, d))


@pytest.mark.parametrize("bad", [[0, 5, 3, 9], [1, 5, 7, 9], [0, 2, 4, 8]])
def test_multi_device_offsets_checked_without_host_read(bad, tmp_path):
    """Bad device offsets (falling, not from 0, not ending at M = 9) fail the async assert.

    On a GPU (FEDLORA_TEST_DEVICE=cuda) the assert is a device-side one: it ends the process's CUDA context (every
    later CUDA call fails), so it is checked in a child process, which must fail with CUDA's device-side assert."""
    x, w, bb, a, b, c, d = _ops(9, K_clients=3)
    if x.is_cuda:
        code = textwrap.dedent(f"""
            import torch
            from fedlora.kernels import lora_linear_multi
            g = torch.Generator().manual_seed(0)
            x = torch.randn(9, 24, generator=g).cuda()
            w, bb = torch.randn(20, 24, generator=g).cuda(), torch.randn(20, generator=g).cuda()
            a, b = torch.randn(4, 24, generator=g).cuda(), torch.randn(20, 4, generator=g).cuda()
            c, d = torch.randn(3, 2, 24, generator=g).cuda(), torch.randn(3, 20, 2, generator=g).cuda()
            try:
                lora_linear_multi(x, w, bb, a, b, c, d, torch.tensor({bad!r}, device="cuda"), backend="triton")
                torch.cuda.synchronize()
            except RuntimeError as e:
                print("RAISED", e)
                raise SystemExit(3)
            print("NO ERROR")
        """)
        env = {**os.environ, "TRITON_INTERPRET": "0"}
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                              cwd=tmp_path, env=env)
        assert proc.returncode == 3 and "device-side assert" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
        return
    with pytest.raises(RuntimeError, match="seg_offsets must rise from 0 to M = 9"):
        lora_linear_multi(x, w, bb, a, b, c, d, torch.tensor(bad), backend="triton")
