"""One optimizer step on the synthetic main job's PF2LoRA upper level (5 seeds × 2 clients stacked: float64
A (10, 4, 10), B (10, 10, 4), one thread): ``StackedAdamW`` against torch's AdamW, single-tensor and foreach.
Run: ``.venv/bin/pytest bench/test_bench_optim.py --benchmark-only`` (``python bench/startup.py`` measures the same
and writes it to bench/results/startup.md)."""
import pytest
import torch

from fedlora.optim import StackedAdamW

OPTIMIZERS = {
    "StackedAdamW": lambda ps: StackedAdamW(ps, lr=0.05, weight_decay=0.0),
    "torch-AdamW-single-tensor": lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.0, foreach=False),
    "torch-AdamW-foreach": lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.0, foreach=True),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_adamw_step(benchmark, name):
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64)) for s in ((10, 4, 10), (10, 10, 4))]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64) * 1e-3
    opt = OPTIMIZERS[name](ps)
    opt.step()
    benchmark(opt.step)
