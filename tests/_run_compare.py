"""Comparing two `fedlora run` folders (embedded against Flower): their records and their adapters."""
import json

import pytest
import torch


def strip_timings(d):
    if isinstance(d, dict):
        return {k: strip_timings(v) for k, v in d.items() if "wall" not in k}
    if isinstance(d, list):
        return [strip_timings(x) for x in d]
    return d


def records(out):
    """rounds.jsonl of a run folder, timings left out."""
    return [strip_timings(json.loads(line)) for line in (out / "rounds.jsonl").read_text().splitlines()]


def assert_close(a, b, path=""):
    """Equal structure and integers; floats to 1e-6 relative (the Flower clients run in other processes)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_close(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_close(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-9), f"{path}: {a} != {b}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def adapters(out):
    from safetensors.torch import load_file

    return {p.name: load_file(str(p)) for p in sorted((out / "adapters").glob("*.safetensors"))}


def assert_same_adapters(a, b):
    assert list(a) == list(b) and a
    for f in a:
        assert list(a[f]) == list(b[f]), f
        for n in a[f]:
            torch.testing.assert_close(a[f][n], b[f][n], rtol=1e-6, atol=1e-8, msg=f"{f}: {n}")
