"""FlexLoRA as a Method: stacked = per-client, unused slots zero, Eckart–Young redistribution,
bytes ∝ r_k, degenerate input, bad options."""
import copy

import pytest
import torch
from torch.func import functional_call

from fedlora.adapter import LoRALinear
from fedlora.errors import ConfigError
from fedlora.methods import FlexLoRA, get_method
from fedlora.simulator import Federation, run_rounds

D64 = torch.float64
RANKS = [1, 2, 4]


def _objective(model):
    def objective(params, batch):
        X, Y = batch
        return ((functional_call(model, params, (X,)) - Y) ** 2).mean(dim=(-2, -1))
    return objective


def _data(G, n=30, d_in=6, d_out=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(G, n, d_in, generator=g, dtype=D64), torch.randn(G, n, d_out, generator=g, dtype=D64))


def _setup(G=3, ranks=RANKS, rank=4, alpha=8.0, seed=0, random_b=True, **kw):
    layer = LoRALinear(6, 5, rank, alpha=alpha, stack=G, dtype=D64)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.lora_A.copy_(torch.randn(layer.lora_A.shape, generator=g, dtype=D64))
        if random_b:
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g, dtype=D64))
    m = FlexLoRA(rank=rank, lr=kw.pop("lr", 0.01), client_ranks=ranks, **kw)
    m.setup(layer, [i % len(ranks) for i in range(G)])
    return layer, m


def _unused_zero(layer, m):
    for i, r in enumerate(m.ranks.tolist()):
        assert torch.all(layer.lora_A[i, r:] == 0) and torch.all(layer.lora_B[i, :, r:] == 0)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_stacked_step_equals_per_client_rank_rk_lora(optimizer):
    X, Y = _data(3)
    layer, m = _setup(optimizer=optimizer, weight_decay=0.1)
    ref = copy.deepcopy(layer)  # already masked by setup
    obj = _objective(layer)
    m.begin_round(0)
    for _ in range(3):
        m.local_step(obj, lambda: (X, Y))
    s = layer.scale
    for i, r in enumerate(RANKS):  # a separate rank-r_k LoRA with scale s, trained by hand
        A = ref.lora_A[i, :r].detach().clone().requires_grad_()
        B = ref.lora_B[i, :, :r].detach().clone().requires_grad_()
        opt = (torch.optim.AdamW([A, B], lr=0.01, weight_decay=0.1) if optimizer == "adamw"
               else torch.optim.SGD([A, B], lr=0.01, weight_decay=0.1))
        for _ in range(3):
            opt.zero_grad()
            (((X[i] @ (s * B @ A).T) - Y[i]) ** 2).mean().backward()
            opt.step()
        torch.testing.assert_close(layer.lora_A[i, :r], A.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(layer.lora_B[i, :, :r], B.detach(), rtol=1e-12, atol=1e-12)
    _unused_zero(layer, m)


def test_round_gives_each_client_the_eckart_young_truncation_of_exact_delta():
    G = 6  # two federations of three clients (ranks 1, 2, 4), weights 1:2:3
    X, Y = _data(G, seed=1)
    layer, m = _setup(G=G, seed=1)
    fed = Federation(n_groups=2, n_clients=3, client_weights=[1.0, 2.0, 3.0])
    hist = run_rounds(m, fed, _objective(layer), lambda: (X, Y), rounds=1, local_steps=3)
    # recompute each federation's exact ΔW from the uploads as they were (re-run the round on a copy)
    layer2, m2 = _setup(G=G, seed=1)
    m2.begin_round(0)
    for _ in range(3):
        m2.local_step(_objective(layer2), lambda: (X, Y))
    w = fed.weights
    s = layer.scale
    for g in range(2):
        reps = list(fed.replicas_of(g))
        dw = sum(w[k] * s * (layer2.lora_B[i, :, :RANKS[k]] @ layer2.lora_A[i, :RANKS[k]]).detach()
                 for k, i in enumerate(reps))
        U, S, Vh = torch.linalg.svd(dw)
        assert all(S[r] < S[r - 1] * (1 - 1e-3) for r in RANKS)  # gaps at r_k: unique truncations
        for k, i in enumerate(reps):
            r = RANKS[k]
            best = U[:, :r] @ torch.diag(S[:r]) @ Vh[:r]
            got = (s * layer.lora_B[i] @ layer.lora_A[i]).detach()
            assert float(torch.linalg.matrix_norm(got - best)) <= 1e-8 * float(torch.linalg.matrix_norm(dw))
            # all of Σ on B: A's r_k rows are orthonormal
            a = layer.lora_A[i, :r].detach()
            torch.testing.assert_close(a @ a.T, torch.eye(r, dtype=D64), atol=1e-10, rtol=0)
    _unused_zero(layer, m)
    # bytes: up = r_k rows of A (6) + r_k columns of B (5), float64, plus a small header; down likewise
    for i in range(G):
        r = RANKS[i % 3]
        for key in ("bytes_up", "bytes_down"):
            extra = hist[0][key][i] - 8 * r * (6 + 5)
            assert 0 < extra < 300, (key, i, extra)
    assert hist[0]["bytes_up"][0] < hist[0]["bytes_up"][1] < hist[0]["bytes_up"][2]


def test_upload_is_the_clients_r_k_factors_and_aggregate_is_pure():
    layer, m = _setup()
    ups = [m.upload(i) for i in range(3)]
    for p, r in zip(ups, RANKS):
        assert p.tensors["lora_A"].shape == (r, 6) and p.tensors["lora_B"].shape == (5, r)
        assert p.nbytes == len(p.to_bytes())
        assert float(p.meta["scale"]) == layer.scale and p.meta["max_rank"] == "4"
        raw = sum(t.numel() * t.element_size() for t in p.tensors.values())
        assert raw == 8 * r * 11
    before = [{k: v.clone() for k, v in p.tensors.items()} for p in ups]
    state = FlexLoRA.aggregate(ups, torch.tensor([0.2, 0.3, 0.5], dtype=D64))
    assert state["lora_B"].shape == (5, 4) and state["lora_A"].shape == (4, 6)
    for p, b in zip(ups, before):
        assert all(torch.equal(p.tensors[k], b[k]) for k in b)
    sent = m.download(1, state)
    assert sent.tensors["lora_B"].shape == (5, 2) and sent.tensors["lora_A"].shape == (2, 6)


def test_rank_deficient_clients_give_no_nan():
    """Round 0 with B = 0 everywhere (PEFT init, no training): ΔW = 0; clients get B = 0 and
    finite orthonormal A rows, and training continues without NaN."""
    layer, m = _setup(random_b=False)
    state = FlexLoRA.aggregate([m.upload(i) for i in range(3)], torch.full((3,), 1 / 3, dtype=D64))
    for i in range(3):
        m.download(i, state)
    assert torch.isfinite(layer.lora_A).all() and torch.all(layer.lora_B == 0)
    for i, r in enumerate(RANKS):
        a = layer.lora_A[i, :r].detach()
        torch.testing.assert_close(a @ a.T, torch.eye(r, dtype=D64), atol=1e-12, rtol=0)
    _unused_zero(layer, m)
    # one client with an all-zero B and others with real ones
    X, Y = _data(3)
    fed = Federation(1, 3)
    run_rounds(m, fed, _objective(layer), lambda: (X, Y), rounds=2, local_steps=2)
    assert torch.isfinite(layer.lora_A).all() and torch.isfinite(layer.lora_B).all()


def test_client_rank_above_min_dim_gets_zero_surplus():
    layer = LoRALinear(3, 2, 4, stack=2, dtype=D64)
    m = FlexLoRA(rank=4, client_ranks=[4, 1])
    m.setup(layer, [0, 1])
    with torch.no_grad():
        layer.lora_B[0].normal_()
    state = FlexLoRA.aggregate([m.upload(0), m.upload(1)], torch.tensor([0.5, 0.5]))
    assert state["lora_B"].shape == (2, 2)  # r_cap = min(4, d_out, d_in)
    sent = m.download(0, state)
    assert sent.tensors["lora_A"].shape == (2, 3)
    assert torch.all(layer.lora_A[0, 2:] == 0) and torch.all(layer.lora_B[0, :, 2:] == 0)


def test_registry_default_ranks_and_adapter_kwargs():
    assert get_method("flexlora") is FlexLoRA
    layer = LoRALinear(6, 5, 3, stack=2, dtype=D64)
    m = FlexLoRA(rank=3)
    m.setup(layer, [0, 1])
    assert m.ranks.tolist() == [3, 3] and m.adapter_kwargs() == {"rank": 3}


def test_bad_inputs():
    with pytest.raises(ConfigError, match="client_ranks"):
        FlexLoRA(rank=4, client_ranks=[0, 2])
    with pytest.raises(ConfigError, match="client_ranks"):
        FlexLoRA(rank=4, client_ranks=[2, 5])
    with pytest.raises(ConfigError, match="client_ranks"):
        FlexLoRA(rank=4, client_ranks=[2.5])
    with pytest.raises(ConfigError, match="lr"):
        FlexLoRA(lr=0.0)
    with pytest.raises(ConfigError, match="lr"):
        FlexLoRA(lr=-1e-3)
    with pytest.raises(ConfigError, match="optimizer"):
        FlexLoRA(optimizer="adam")
    with pytest.raises(ConfigError, match="rank"):
        FlexLoRA(rank=0)
    with pytest.raises(ConfigError, match="client_ranks has 2 entries for 3 clients"):
        FlexLoRA(rank=4, client_ranks=[1, 2]).setup(LoRALinear(6, 5, 4, stack=3), [0, 1, 2])
    with pytest.raises(ConfigError, match="rank=4"):
        FlexLoRA(rank=4).setup(LoRALinear(6, 5, 3, stack=2), [0, 1])
    with pytest.raises(ConfigError, match="plain LoRA"):
        FlexLoRA(rank=4).setup(LoRALinear(6, 5, 4, client_rank=2, stack=2), [0, 1])


def test_sampled_out_clients_with_a_larger_rank_still_get_r_k_components():
    """Only the rank-1 client takes part: ΔW has rank 1, yet the rank-4 client receives 4 slots
    (σ_1 component + orthonormally completed A rows with zero B columns), thanks to max_rank."""
    X, Y = _data(3, seed=2)
    layer, m = _setup(seed=2)
    fed = next(f for f in (Federation(1, 3, sample_fraction=0.3, sample_seed=t) for t in range(50))
               if f.participants(0, 0) == [0])
    k = 0
    hist = run_rounds(m, fed, _objective(layer), lambda: (X, Y), rounds=1, local_steps=2)
    assert hist[0]["bytes_up"][k] > 0 and sum(hist[0]["bytes_up"]) == hist[0]["bytes_up"][k]
    dw = (layer.scale * layer.lora_B[k] @ layer.lora_A[k]).detach()  # the participant now holds its own best approx
    for i, r in enumerate(RANKS):
        a = layer.lora_A[i, :r].detach()
        torch.testing.assert_close(a @ a.T, torch.eye(r, dtype=D64), atol=1e-10, rtol=0)
        q = min(r, RANKS[k])
        assert torch.all(layer.lora_B[i, :, q:] == 0)
        torch.testing.assert_close((layer.scale * layer.lora_B[i] @ layer.lora_A[i]).detach(), dw, atol=1e-10, rtol=0)


def test_aggregate_rejects_payloads_without_scales_or_layers():
    from fedlora.payload import Payload

    a, b = torch.zeros(2, 4, dtype=torch.float64), torch.zeros(3, 2, dtype=torch.float64)
    good = Payload({"lora_A": a, "lora_B": b}, {"max_rank": "2", "scale": "1.0"})
    with pytest.raises(ConfigError, match=r"payload 1 lacks \['scale'\]"):
        FlexLoRA.aggregate([good, Payload({"lora_A": a, "lora_B": b}, {"max_rank": "2"})], torch.tensor([0.5, 0.5]))
    with pytest.raises(ConfigError, match=r"payload 1 lacks \['lora_B'\]"):
        FlexLoRA.aggregate([good, Payload({"lora_A": a}, {"max_rank": "2", "scale": "1.0"})], torch.tensor([0.5, 0.5]))
