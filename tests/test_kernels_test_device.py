"""The GPU mode of the kernel tests (``FEDLORA_TEST_DEVICE``, tests/conftest.py): which tensors it moves.

A kernel test run with ``FEDLORA_TEST_DEVICE=cuda`` must put the test's own data on the GPU (or it silently
tests the CPU path again) and must leave what the library allocates where the library puts it (or it would
test a library the users never run). Checked here with the meta device, on any machine. The file's name
starts with ``test_kernels_`` like the files the mode applies to; its tests build the mode themselves.
"""
from __future__ import annotations

import torch
from conftest import _TestDeviceMode

from fedlora.aggmath.lora_a2 import rank_mask


def test_the_tests_own_tensors_move_with_their_numbers_and_leaves():
    gen = torch.Generator().manual_seed(3)
    on_cpu = torch.randn(4, 3, generator=torch.Generator().manual_seed(3))
    with _TestDeviceMode("meta"):
        x = torch.randn(4, 3, generator=gen)  # a CPU generator: drawn on the CPU, then moved
        leaf = torch.zeros(2, requires_grad=True)
        table = torch.tensor([0, 3, 5])
        kept = torch.ones(2, device="cpu")  # a test that names the CPU keeps it
    assert x.device.type == "meta" and table.device.type == "meta" and kept.device.type == "cpu"
    assert leaf.device.type == "meta" and leaf.is_leaf and leaf.requires_grad
    with _TestDeviceMode("cpu"):
        again = torch.randn(4, 3, generator=torch.Generator().manual_seed(3))
    assert torch.equal(again, on_cpu)  # same generator, same numbers


def test_what_the_library_allocates_stays_where_the_library_puts_it():
    index = torch.tensor([0, 2])  # made outside the mode: the library reads it on the host
    with _TestDeviceMode("meta"):
        mask = rank_mask((5, 4), index, "B")  # torch.zeros inside fedlora/aggmath
    assert mask.device.type == "cpu" and mask[:, 0].eq(1).all() and mask[:, 1].eq(0).all()
