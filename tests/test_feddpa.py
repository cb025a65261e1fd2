"""FedDPA-T (Yang et al., "Dual-Personalizing Adapter for Federated Foundation Models", NeurIPS 2024).

What the method MEANS, recomputed here by hand (numpy in float64, or the uploads the clients sent):

* the server's state is the data-weighted mean of the round's uploaded GLOBAL adapters (A_k, B_k);
* a client uploads the global adapter only: the local adapter (C, D) never leaves it, the download never
  overwrites it, and it persists across rounds — unchanged in the rounds the client sits out;
* each round trains the local adapter first (the global one mixed in with weight 1 − a, detached: no
  gradient), then the global adapter alone (the local path out of the model), as many steps each;
* the evaluated model is W0 + (1 − m)·s·B A + m·s·D C;
* the instance-wise weight is scale · mean cosine similarity (numpy by hand).
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import functional_call

from fedlora.adapter import LoRALinear
from fedlora.aggmath.feddpa import feddpa_average, instance_mixed_output, instance_weight, mix_delta
from fedlora.errors import ConfigError
from fedlora.methods import build
from fedlora.payload import Payload
from fedlora.simulator import Federation, run_rounds

FAST = settings(max_examples=40, deadline=None)
F64 = torch.float64
K, D, R = 4, 6, 2


def _np(t):
    return t.detach().to(F64).numpy()


# ------------------------------------------------------------------------------------------------
# the pure functions (fedlora.aggmath.feddpa), float64

@FAST
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(1, 6), r=st.integers(1, 5), d_in=st.integers(1, 9),
       d_out=st.integers(1, 9), sizes=st.lists(st.floats(0.5, 100.0), min_size=6, max_size=6))
def test_the_server_is_the_data_weighted_mean_of_the_global_adapters(seed, k, r, d_in, d_out, sizes):
    g = torch.Generator().manual_seed(seed)
    ups = [{"m.lora_A": torch.randn(r, d_in, generator=g, dtype=F64),
            "m.lora_B": torch.randn(d_out, r, generator=g, dtype=F64)} for _ in range(k)]
    before = [{n: t.clone() for n, t in u.items()} for u in ups]
    w = np.array(sizes[:k])
    got = feddpa_average(ups, torch.tensor(w))
    p = w / w.sum()
    for n in ("m.lora_A", "m.lora_B"):
        np.testing.assert_allclose(_np(got[n]), sum(p[j] * _np(ups[j][n]) for j in range(k)), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(_np(feddpa_average(ups, torch.tensor(w), uniform=True)[n]),
                                   np.mean([_np(u[n]) for u in ups], axis=0), rtol=1e-12, atol=1e-12)
    assert all(torch.equal(u[n], b[n]) for u, b in zip(ups, before) for n in u)  # inputs untouched


@FAST
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 5), N=st.integers(1, 6), d=st.integers(1, 12),
       scale=st.floats(0.05, 1.0), c=st.floats(0.1, 10.0))
def test_the_instance_weight_is_the_scaled_mean_cosine_similarity(seed, n, N, d, scale, c):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, d, generator=g, dtype=F64)
    refs = torch.randn(N, d, generator=g, dtype=F64)
    qn, rn = _np(q), _np(refs)
    cos = (qn @ rn.T) / np.linalg.norm(qn, axis=1)[:, None] / np.linalg.norm(rn, axis=1)[None, :]
    want = scale * cos.mean(axis=1)
    np.testing.assert_allclose(_np(instance_weight(q, refs, scale)), want, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(_np(instance_weight(c * q, refs, scale)), want, rtol=1e-10, atol=1e-12)  # cosine
    assert float(instance_weight(q[0], q[:1], scale)) == pytest.approx(scale, rel=1e-12)  # itself: cos 1
    assert abs(float(instance_weight(q[0], refs, scale))) <= scale + 1e-12


def test_instance_weight_and_average_refuse_bad_input_in_one_line():
    with pytest.raises(ConfigError, match="scale must be a number in"):
        instance_weight(torch.ones(3), torch.ones(2, 3), 1.5)
    with pytest.raises(ConfigError, match=r"refs \(N ≥ 1, d\)"):
        instance_weight(torch.ones(3), torch.ones(2, 4))
    with pytest.raises(ConfigError, match="2 uploads but weights"):
        feddpa_average([{"a": torch.ones(1)}] * 2, torch.ones(3))


@FAST
@given(seed=st.integers(0, 2**31 - 1), wg=st.floats(0.0, 1.0), wl=st.floats(0.0, 1.0), sg=st.floats(0.1, 4.0))
def test_mix_delta_is_the_two_weighted_products(seed, wg, wl, sg):
    g = torch.Generator().manual_seed(seed)
    A, B, C, Dm = (torch.randn(*s, generator=g, dtype=F64) for s in ((3, 5), (4, 3), (3, 5), (4, 3)))
    np.testing.assert_allclose(_np(mix_delta(A, B, C, Dm, sg, 2.0, wg, wl)),
                               wg * sg * _np(B) @ _np(A) + wl * 2.0 * _np(Dm) @ _np(C), rtol=1e-12, atol=1e-12)


@FAST
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 6), N=st.integers(1, 5), scale=st.floats(0.05, 1.0),
       on=st.sampled_from(["local", "global"]))
def test_the_instance_wise_output_weighs_each_row_by_its_own_similarity(seed, n, N, scale, on):
    """Row i of the reference output is W0 x_i + the two adapters weighted by that row's w_i (numpy by hand):
    the local adapter gets w_i with ``weight_on="local"`` (the paper's stated intent), the global one with
    ``"global"`` (the authors' code)."""
    g = torch.Generator().manual_seed(seed)
    d_in, d_out, r, d = 5, 4, 2, 7
    x, W0 = torch.randn(n, d_in, generator=g, dtype=F64), torch.randn(d_out, d_in, generator=g, dtype=F64)
    A, C = torch.randn(r, d_in, generator=g, dtype=F64), torch.randn(r, d_in, generator=g, dtype=F64)
    B, Dm = torch.randn(d_out, r, generator=g, dtype=F64), torch.randn(d_out, r, generator=g, dtype=F64)
    e, refs = torch.randn(n, d, generator=g, dtype=F64), torch.randn(N, d, generator=g, dtype=F64)
    got = _np(instance_mixed_output(x, W0, A, B, C, Dm, 1.5, 0.5, e, refs, scale, on))
    en, rn = _np(e), _np(refs)
    for i in range(n):
        cos = [en[i] @ rn[j] / np.linalg.norm(en[i]) / np.linalg.norm(rn[j]) for j in range(N)]
        w = scale * np.mean(cos)
        wl, wg = (w, 1 - w) if on == "local" else (1 - w, w)
        xi = _np(x[i])
        want = _np(W0) @ xi + wg * 1.5 * _np(B) @ (_np(A) @ xi) + wl * 0.5 * _np(Dm) @ (_np(C) @ xi)
        np.testing.assert_allclose(got[i], want, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------------------------
# the method on the testbed: four clients, half drawn each round

def _objective(layer, log=None):
    def objective(params, batch):
        if log is not None:
            log.append({n: (p.detach().clone(), p.requires_grad) for n, p in params.items()})
        X, Y = batch
        return ((functional_call(layer, params, (X,)) - Y) ** 2).mean(dim=(-2, -1))
    return objective


def _setup(local_weight=0.5, eval_mix=0.5, lr=0.05):
    g = torch.Generator().manual_seed(0)
    m = build("feddpa", {"rank": R, "lr": lr, "local_weight": local_weight, "eval_mix": eval_mix})
    layer = LoRALinear(D, D, **m.adapter_kwargs(), stack=K, alpha=4.0, client_alpha=4.0, dtype=F64)  # s = 2
    m.setup(layer, list(range(K)))
    X = torch.randn(K, 30, D, generator=g, dtype=F64)
    Y = torch.randn(K, 30, D, generator=g, dtype=F64)
    return m, layer, X, Y


def test_only_the_global_adapter_travels_and_the_server_holds_the_weighted_mean_of_what_was_uploaded():
    """Uploads hold (A, B) only; the state every client downloads after a round is the n_k-weighted mean of
    exactly what the round's participants uploaded; the local adapter (C, D) of a client is never sent,
    never overwritten by a download, changes only in rounds the client trains, and persists across rounds."""
    m, layer, X, Y = _setup()
    sizes = [30.0, 10.0, 25.0, 5.0]
    fed = Federation(n_groups=1, n_clients=K, client_weights=sizes, sample_fraction=0.5)
    ups, downs, cur = {}, {}, [0]
    names = ("lora_A", "lora_B", "lora_C", "lora_D")
    local = {-1: {n: layer.get_parameter(n).detach().clone() for n in names}}

    def seen(direction, i, p):
        (ups if direction == "up" else downs).setdefault(cur[0], {})[i] = p

    def after(rnd):
        local[rnd] = {n: layer.get_parameter(n).detach().clone() for n in names}
        cur[0] = rnd + 1
        return {}

    hist = run_rounds(m, fed, _objective(layer), lambda: (X, Y), rounds=3, local_steps=2, evaluate=after,
                      on_payload=seen)
    sat_out = 0
    for t, rec in enumerate(hist):
        parts = rec["participants"]
        assert len(parts) == 2 and sorted(ups[t]) == parts
        for p in [*ups[t].values(), *downs.get(t, {}).values()]:
            assert set(p.tensors) == {"lora_A", "lora_B"}  # the local adapter never leaves, never arrives
        w = np.array([sizes[k] for k in parts]) / sum(sizes[k] for k in parts)
        for n in ("lora_A", "lora_B"):
            mean = sum(w[j] * _np(ups[t][k].tensors[n]) for j, k in enumerate(parts))
            for i in range(K):  # after the round, a client that synchronised holds the server's state
                if i in downs.get(t, {}) or t == len(hist) - 1:
                    np.testing.assert_allclose(_np(local[t][n][i]), mean, rtol=0, atol=1e-12)
            for i, p in downs.get(t, {}).items():
                np.testing.assert_allclose(_np(p.tensors[n]), mean, rtol=0, atol=1e-12)
        for i in range(K):
            for n in ("lora_C", "lora_D"):
                before, now = local[t - 1][n][i], local[t][n][i]
                if i in parts:
                    assert not torch.equal(before, now)  # trained this round
                else:
                    assert torch.equal(before, now)  # sat out: exactly as it was
                    sat_out += 1
    assert sat_out > 0
    # the clients' local adapters differ (each its own data, each its own record)
    assert not torch.allclose(layer.lora_D[0], layer.lora_D[1])


def test_a_round_trains_the_local_adapter_with_the_global_one_detached_then_the_global_one_alone():
    """Per round, I steps whose forward has (1 − a)·B detached and a·D trainable, then I steps whose forward
    has the trained B and the local path at zero (D = 0): the order and the mixing the method promises."""
    a = 0.3
    m, layer, X, Y = _setup(local_weight=a)
    fed = Federation(n_groups=1, n_clients=K, client_weights=[1.0] * K)
    log: list = []
    for p in (layer.lora_B, layer.lora_D):  # non-zero factors make every check below bite
        with torch.no_grad():
            p.normal_(generator=torch.Generator().manual_seed(1))
    B0, D0 = layer.lora_B.detach().clone(), layer.lora_D.detach().clone()
    run_rounds(m, fed, _objective(layer, log), lambda: (X, Y), rounds=1, local_steps=3)
    assert len(log) == 6
    for j, params in enumerate(log[:3]):  # phase 1: local adapter
        (B, b_grad), (Dm, d_grad) = params["lora_B"], params["lora_D"]
        assert not b_grad and not params["lora_A"][1] and d_grad  # global detached, local trained
        torch.testing.assert_close(B, (1 - a) * B0, rtol=0, atol=1e-12)  # global constant through phase 1
        if j == 0:
            torch.testing.assert_close(Dm, a * D0, rtol=0, atol=1e-12)
    D_end = log[2]["lora_D"][0] / a
    assert not torch.allclose(D_end, D0)  # the local adapter trained
    for j, params in enumerate(log[3:]):  # phase 2: global adapter alone
        assert params["lora_B"][1] and params["lora_A"][1]
        assert not params["lora_D"][1] and torch.all(params["lora_D"][0] == 0) and not params["lora_C"][1]
        if j == 0:
            torch.testing.assert_close(params["lora_B"][0], B0, rtol=0, atol=1e-12)  # untouched by phase 1
    assert not torch.equal(log[3]["lora_B"][0], log[5]["lora_B"][0])  # the global adapter trained


def test_the_evaluated_model_mixes_the_two_adapters_with_eval_mix():
    """personalised_params gives W0 + (1 − m)·s·B A + m·s·D C (``mix_delta``), the global model B A alone."""
    mix = 0.25
    m, layer, X, Y = _setup(eval_mix=mix)
    with torch.no_grad():
        for p in (layer.lora_B, layer.lora_D):
            p.normal_(generator=torch.Generator().manual_seed(2))
    params = {**dict(layer.named_parameters()), **m.personalised_params(None, None)}
    eye = torch.eye(D, dtype=F64).expand(K, -1, -1)
    got = functional_call(layer, params, (eye,))  # x ↦ x ΔWᵀ at x = I: ΔWᵀ
    for i in range(K):
        want = mix_delta(layer.lora_A[i], layer.lora_B[i], layer.lora_C[i], layer.lora_D[i], layer.scale,
                         layer.client_scale, 1 - mix, mix)
        np.testing.assert_allclose(_np(got[i]), _np(want).T, rtol=0, atol=1e-12)
        np.testing.assert_allclose(_np(want), 0.75 * 2 * _np(layer.lora_B[i] @ layer.lora_A[i])
                                   + 0.25 * 2 * _np(layer.lora_D[i] @ layer.lora_C[i]), rtol=0, atol=1e-12)


def test_bad_options_and_a_model_without_a_local_adapter_are_refused_in_one_line():
    for opt in ("local_weight", "eval_mix"):
        with pytest.raises(ConfigError, match=f"feddpa: {opt} must be a number strictly between 0 and 1"):
            build("feddpa", {opt: 1.0})
    m = build("feddpa", {"rank": R})
    with pytest.raises(ConfigError, match="feddpa needs a local adapter"):
        m.setup(LoRALinear(D, D, R, stack=K, dtype=F64), list(range(K)))
    with pytest.raises(ConfigError, match="never uploaded"):
        m.aggregate([Payload({"lora_C": torch.ones(1)})], torch.ones(1))


def test_synthetic_compare_uploads_what_fedavg_uploads(tmp_path, capsys):
    """``fedlora synthetic compare`` with sampling: FedDPA's upload is the global adapter, FedAvg-LoRA's bytes."""
    from fedlora.cli import main

    out = tmp_path / "cmp"
    assert main(["synthetic", "compare", "--methods", "fedavg,feddpa", "--seeds", "1", "--rounds", "3",
                 "--local-steps", "1", "--lr-grid", "0.03", "--sample-fraction", "0.5", "--no-plot",
                 "--out", str(out)]) == 0
    res = json.loads((out / "compare.json").read_text())
    md = (out / "compare.md").read_text()
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")] for line in md.splitlines()
            if line.startswith("| fedavg") or line.startswith("| feddpa")}
    header = [c.strip() for c in [ln for ln in md.splitlines() if "up B/round/client" in ln][-1].split("|")]
    col = header.index("up B/round/client")
    assert rows["feddpa"][col] == rows["fedavg"][col] and int(rows["feddpa"][col].replace(",", "")) > 0
    assert res  # the run wrote its record
