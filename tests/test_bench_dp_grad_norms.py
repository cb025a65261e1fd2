"""bench/dp_grad_norms.py: the norms it reports are the ones DP-SGD's clipping sees — a run clipped at a C just
above the largest reported norm is the unclipped run to the bit, one clipped at half of it is not."""
import json
import math

import pytest



def _script():
    from _run_helpers import load_script

    return load_script("bench/dp_grad_norms.py")


def _records(out):
    return [{k: v for k, v in json.loads(line).items() if k != "wall_s"}
            for line in (out / "rounds.jsonl").read_text().splitlines()]


@pytest.mark.long  # a bench script's smoke, as the others: four tiny-smoke runs of 2 rounds (≈ 15 s)
def test_the_reported_norms_are_what_the_clipping_sees(tmp_path, monkeypatch, capsys):
    from fedlora.llm import run

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    mod = _script()
    assert mod.main(["tiny-smoke", "--rounds", "2", "--clip-norms", "0.5,1e9", "--out", str(tmp_path / "n.json")]) == 0
    res = json.loads((tmp_path / "n.json").read_text())
    assert "| all |" in capsys.readouterr().out
    top = res["all"]["max"]
    assert res["all"]["examples"] == sum(r["examples"] for r in res["per_round"].values()) > 0
    assert res["all"]["clipped_fraction"]["1e+09"] == 0.0 and 0 < res["all"]["quantiles"]["0.5"] <= top
    runs = {}
    for name, c in (("none", 1e12), ("above", top * (1 + 1e-6)), ("half", top / 2)):
        run("tiny-smoke", mod.overrides(tmp_path / name, rounds=2, clip_norm=c), progress=False)
        runs[name] = _records(tmp_path / name)
    assert runs["above"] == runs["none"]  # C above every reported norm: nothing was clipped
    assert runs["half"] != runs["none"]  # half the largest: that example at least was clipped
    assert not math.isnan(res["all"]["mean"])
    # two clients per pass: each slot's Poisson batch is padded to the pass's largest — the padding is no example
    paired = mod.measure("tiny-smoke", rounds=2, sets=["federation.clients_per_pass=2"], clip_norms=[0.5])
    assert paired["all"]["examples"] == res["all"]["examples"]
    assert paired["all"]["quantiles"] == pytest.approx(res["all"]["quantiles"], rel=1e-4)
    # tiny-smoke's FedAvg-LoRA trains A, B and the head: the parts' squared norms add up to the whole
    assert set(res["by_part"]) == {"lora_A", "lora_B", "head"}
    assert sum(v["share_of_squared_norm"] for v in res["by_part"].values()) == pytest.approx(1.0, abs=1e-9)
    # RoLoRA trains A in one round and B in the next: each example's step has one of them, the shares still add up
    alt = mod.measure("tiny-smoke", method="rolora", rounds=2, clip_norms=[0.5])
    a, b = alt["by_part"]["lora_A"], alt["by_part"]["lora_B"]
    assert a["examples"] + b["examples"] == alt["all"]["examples"] and a["examples"] and b["examples"]
    assert sum(v["share_of_squared_norm"] for v in alt["by_part"].values()) == pytest.approx(1.0, abs=1e-9)


def test_an_unwritable_out_is_one_line_before_the_run(monkeypatch, capsys):
    mod = _script()
    monkeypatch.setattr(mod, "measure", lambda *a, **k: pytest.fail("the run started"))
    assert mod.main(["tiny-smoke", "--out", "/proc/fedlora-no-such-folder/n.json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --out: cannot create the output folder") and len(err.strip().splitlines()) == 1
