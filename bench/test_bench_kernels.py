"""CPU microbenchmarks of the reference LoRA linear (runs anywhere): ``pytest bench/ --benchmark-only``."""
from __future__ import annotations

import pytest
import torch

from fedlora.kernels import lora_linear_multi, lora_linear_reference

CASES = [(16, 256, 8, 2), (128, 256, 8, 2), (128, 512, 16, 4), (512, 512, 64, 0)]


def _ops(M, d, r, rc, grad):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, d, generator=g, requires_grad=grad)
    w = torch.randn(d, d, generator=g)
    a = torch.randn(r, d, generator=g, requires_grad=grad)
    b = torch.randn(d, r, generator=g, requires_grad=grad)
    c = torch.randn(rc, d, generator=g, requires_grad=grad) if rc else None
    dd = torch.randn(d, rc, generator=g, requires_grad=grad) if rc else None
    return x, w, a, b, c, dd


@pytest.mark.parametrize("M,d,r,rc", CASES, ids=[f"M{m}-d{d}-r{r}+{rc}" for m, d, r, rc in CASES])
def test_reference_forward(benchmark, M, d, r, rc):
    x, w, a, b, c, dd = _ops(M, d, r, rc, False)
    with torch.no_grad():
        benchmark(lora_linear_reference, x, w, None, a, b, 0.5, c, dd, 2.0)


@pytest.mark.parametrize("M,d,r,rc", CASES, ids=[f"M{m}-d{d}-r{r}+{rc}" for m, d, r, rc in CASES])
def test_reference_fwd_bwd(benchmark, M, d, r, rc):
    x, w, a, b, c, dd = _ops(M, d, r, rc, True)

    def step():
        y = lora_linear_reference(x, w, None, a, b, 0.5, c, dd, 2.0)
        y.sum().backward()

    benchmark(step)


def test_reference_multi_client_fwd_bwd(benchmark):
    g = torch.Generator().manual_seed(0)
    K, n, d, r, rc = 8, 32, 256, 8, 2
    x = torch.randn(K * n, d, generator=g, requires_grad=True)
    w = torch.randn(d, d, generator=g)
    a = torch.randn(r, d, generator=g, requires_grad=True)
    b = torch.randn(d, r, generator=g, requires_grad=True)
    c = torch.randn(K, rc, d, generator=g, requires_grad=True)
    dd = torch.randn(K, d, rc, generator=g, requires_grad=True)
    offs = [k * n for k in range(K + 1)]

    def step():
        lora_linear_multi(x, w, None, a, b, c, dd, offs, 0.5, 2.0, backend="reference").sum().backward()

    benchmark(step)
