"""Shared test set-up: deterministic, single-threaded torch (tiny problems; no spin-wait overhead).

TRITON_INTERPRET=1 is set before anything can import triton: the kernel tests run the Triton path on
CPU under the interpreter, and triton fixes its mode when first imported — which ``import peft`` (an
LLM test) does, whatever test file happens to run first. Tests that need the compiler (the AOT check)
clear it in their subprocess's environment.
"""
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _single_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
