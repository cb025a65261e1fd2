"""H²Tune as a Method: TriLoRA ΔW, support, alternating freezes, stacked == by hand, layer alignment,
unweighted server mean, upload bytes, β = 0, bad input."""
import copy
import math

import pytest
import torch
from torch import nn
from torch.func import functional_call

from fedlora.adapter import LoRALinear
from fedlora.aggmath.h2tune import (kl_softmax, server_mean, sparsify_support, to_client, to_global,
                                    trilora_delta)
from fedlora.errors import ConfigError
from fedlora.methods import H2Tune, get_method
from fedlora.optim import PlainSGD, StackedAdamW
from fedlora.methods.h2tune import output_kl
from fedlora.payload import Payload
from fedlora.simulator import Federation, run_rounds

D64 = torch.float64
pytestmark = pytest.mark.filterwarnings("ignore:h2tune. no output_fn")


class Chain(nn.Module):
    """L stacked TriLoRA layers d → d → … → C (ModuleList: one module type '*')."""

    def __init__(self, G, L=2, d=5, C=3, r=3):
        super().__init__()
        self.layers = nn.ModuleList(
            LoRALinear(d, C if l == L - 1 else d, r, middle=True, stack=G, dtype=D64) for l in range(L))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class QV(nn.Module):
    """Two module types per layer (layers.*.q and layers.*.v), summed."""

    def __init__(self, G, L=2, d=4, r=2):
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"q": LoRALinear(d, d, r, middle=True, stack=G, dtype=D64),
                                                   "v": LoRALinear(d, d, r, middle=True, stack=G, dtype=D64)})
                                    for _ in range(L))

    def forward(self, x):
        for blk in self.layers:
            x = blk["q"](x) + blk["v"](x)
        return x


def _randomise(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("lora_A", "lora_B")):
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)


def _fns(model):
    def output_fn(params, batch):
        return functional_call(model, dict(params), (batch[0],))

    def objective(params, batch):
        logits = output_fn(params, batch)
        return nn.functional.cross_entropy(logits.transpose(1, 2), batch[1], reduction="none").mean(-1)

    return objective, output_fn


def _batch(G, n=12, d=5, C=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(G, n, d, generator=g, dtype=D64), torch.randint(0, C, (G, n), generator=g)


def _setup(model, G, seed=0, **kw):
    _randomise(model, seed)
    m = H2Tune(**{"rank": 3, "lr": 0.1, "optimizer": "sgd", "r_init_std": 0.3, **kw})
    m.setup(model, list(range(G)))
    return m


# ---------------------------------------------------------------------------------------------
def test_delta_weight_is_trilora_delta_on_the_top_beta_support():
    G, d, r = 2, 5, 3
    layer = LoRALinear(d, d, r, middle=True, stack=G, alpha=6.0, dtype=D64)
    m = _setup(layer, G, densities=[0.5, 0.3])
    with torch.no_grad():
        layer.lora_Phi.copy_(torch.randn(G, r, r, generator=torch.Generator().manual_seed(3), dtype=D64))
    m.begin_round(0)  # support re-chosen: top-β by |Φ⊙R|
    for i, beta in enumerate([0.5, 0.3]):
        expect = sparsify_support(layer.lora_Phi[i] * layer.lora_R[i], beta)
        assert torch.equal(layer.middle_mask[i].bool(), expect) and int(expect.sum()) == math.ceil(beta * r * r)
    eye = torch.eye(d, dtype=D64).expand(G, d, d)
    dw = layer(eye).transpose(-1, -2)  # rows of x = e_j: y = ΔW e_j
    for i in range(G):
        ref = trilora_delta(layer.lora_B[i], layer.lora_R[i], layer.lora_Phi[i] * layer.middle_mask[i],
                            layer.lora_A[i], layer.scale)
        torch.testing.assert_close(dw[i], ref, rtol=1e-12, atol=1e-12)
    assert layer.scale == 2.0


def test_R_and_Phi_gradients_vanish_off_the_support_and_off_support_entries_never_move():
    G = 2
    model = Chain(G)
    m = _setup(model, G, densities=[0.4, 0.7], optimizer="adamw")
    X, y = _batch(G)
    objective, output_fn = _fns(model)
    loss = objective(m.param_view(), (X, y)).sum()
    loss.backward()
    for layer in model.layers:
        off = ~layer.middle_mask.bool()
        assert off.any() and torch.all(layer.lora_R.grad[off] == 0) and torch.all(layer.lora_Phi.grad[off] == 0)
        assert layer.lora_R.grad[~off].abs().sum() > 0 and layer.lora_Phi.grad[~off].abs().sum() > 0
    model.zero_grad(set_to_none=True)
    # the KL term of eq. 6 has a gradient everywhere on R; the step still keeps R off the support fixed
    with torch.no_grad():
        m.global_R["layers.*"].add_(torch.randn_like(m.global_R["layers.*"]))
    m.output_fn = output_fn
    g = torch.Generator().manual_seed(11)
    for rnd in range(2):  # AdamW moments built in round 0 must not move entries that leave the support
        if rnd:
            with torch.no_grad():  # reshuffle magnitudes so the re-chosen support differs
                for layer in model.layers:
                    layer.lora_Phi.mul_(torch.rand(layer.lora_Phi.shape, generator=g, dtype=D64) * 3)
        m.begin_round(rnd)
        before = [(l.lora_R.clone(), l.lora_Phi.clone(), ~l.middle_mask.bool()) for l in model.layers]
        for _ in range(3):
            m.local_step(objective, lambda: (X, y))
        for (R0, P0, off), layer in zip(before, model.layers):
            assert torch.equal(layer.lora_R[off], R0[off]) and torch.equal(layer.lora_Phi[off], P0[off])
            assert not torch.equal(layer.lora_R[~off], R0[~off])


def test_step1_freezes_A_B_and_step2_freezes_R_Phi_Omega():
    G = 2
    model = Chain(G)
    objective, output_fn = _fns(model)
    m = _setup(model, G, optimizer="adamw", output_fn=output_fn)
    with torch.no_grad():
        m.global_R["layers.*"].add_(torch.randn_like(m.global_R["layers.*"]))  # Ω gets a KL gradient
    batch = _batch(G)
    snap = {n: p.clone() for n, p in model.named_parameters()}
    om = m.omega.detach().clone()
    y_prime = m.shared_step(objective, batch)
    for n, p in model.named_parameters():
        same = torch.equal(p, snap[n])
        assert same if n.endswith(("lora_A", "lora_B")) else not same, n
    assert not torch.equal(m.omega, om)
    snap = {n: p.clone() for n, p in model.named_parameters()}
    om = m.omega.detach().clone()
    m.specific_step(objective, batch, y_prime)
    for n, p in model.named_parameters():
        same = torch.equal(p, snap[n])
        assert not same if n.endswith(("lora_A", "lora_B")) else same, n
    assert torch.equal(m.omega, om)
    assert all(p.grad is None for p in model.parameters()) and m.omega.grad is None


@pytest.mark.parametrize("sign", ["paper", "plus", None])
def test_stacked_step_equals_per_client_by_hand(sign):
    # two layers; client 1 uses only layer 0 (L_1 = 1), densities differ; SGD for exactness
    G, d, C, r = 2, 5, 3, 3
    eta, eta_s, nu, lam = 0.1, 0.05, 0.01, 0.7
    model = Chain(G, L=2, d=d, C=C, r=r)
    objective, output_fn = _fns(model)
    m = _setup(model, G, lr=eta, shared_lr=eta_s, nu=nu, kl_weight=lam, client_layers=[2, 1],
               densities=[1.0, 0.5], disentangle_sign=sign or "paper",
               output_fn=output_fn if sign else None)
    m.begin_round(0)
    g = torch.Generator().manual_seed(7)
    state = {"layers.*.lora_R": torch.randn(2, r, r, generator=g, dtype=D64)}  # a non-trivial R_g
    for i in range(G):
        m.download(i, state)
    with torch.no_grad():
        m.omega.add_(0.1 * torch.randn(m.omega.shape, generator=g, dtype=D64) * m.layer_mask[:, :, None])
    ref = copy.deepcopy(model)
    om_ref = m.omega.detach().clone()
    masks = [l.middle_mask.clone() for l in model.layers]
    X, y = _batch(G, d=d, C=C)
    m.local_step(objective, lambda: (X, y))

    for i, Lk in enumerate([2, 1]):
        A = [l.lora_A[i].detach().clone().requires_grad_() for l in ref.layers]
        B = [l.lora_B[i].detach().clone().requires_grad_() for l in ref.layers]
        R = [l.lora_R[i].detach().clone().requires_grad_() for l in ref.layers]
        P = [l.lora_Phi[i].detach().clone().requires_grad_() for l in ref.layers]
        om = om_ref[i, :Lk].clone().requires_grad_()
        M = [mk[i] for mk in masks]
        s = [l.scale for l in ref.layers]

        def logits(A, B, R, P):
            h = X[i]
            for l in range(2):
                h = h @ trilora_delta(B[l], R[l], P[l] * M[l], A[l], s[l]).T
            return h

        # step (1): eq. 6 with the KL over client layers only, R_{g→k} = R_g Ω_kᵀ
        z1 = logits(A, B, R, P)
        kl = kl_softmax(torch.stack(R[:Lk]), to_client(state["layers.*.lora_R"], om), per_layer=True)
        loss1 = nn.functional.cross_entropy(z1, y[i]) + lam * kl
        grads = torch.autograd.grad(loss1, R + P + [om])
        R1 = [(R[l] - eta_s * grads[l] * M[l]).detach() for l in range(2)]
        P1 = [(P[l] - eta_s * grads[2 + l] * M[l]).detach() for l in range(2)]
        om1 = (om - eta_s * grads[4]).detach()
        # step (2): eq. 7 on the same batch; y' = step (1)'s pre-update output
        z2 = logits(A, B, R1, P1)
        loss2 = nn.functional.cross_entropy(z2, y[i]) + 0.5 * nu * sum((t ** 2).sum() for t in A + B)
        if sign:
            lp, lq = torch.log_softmax(z2, -1), torch.log_softmax(z1.detach(), -1)
            loss2 = loss2 + (-1 if sign == "paper" else 1) * (lp.exp() * (lp - lq)).sum(-1).mean()
        gAB = torch.autograd.grad(loss2, A + B)
        for l, layer in enumerate(model.layers):
            torch.testing.assert_close(layer.lora_R[i], R1[l], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(layer.lora_Phi[i], P1[l], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(layer.lora_A[i], (A[l] - eta * gAB[l]).detach(), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(layer.lora_B[i], (B[l] - eta * gAB[2 + l]).detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(m.omega[i, :Lk], om1, rtol=1e-12, atol=1e-12)
        assert torch.all(m.omega[i, Lk:] == 0)
    # client 1 (L_1 = 1) has an empty support on layer 1: its R, Φ there never move
    assert torch.all(model.layers[1].middle_mask[1] == 0)
    assert torch.equal(model.layers[1].lora_R[1], ref.layers[1].lora_R[1])


def test_layer_alignment_shapes_for_L_k_1_2_3():
    G, r = 3, 3
    model = Chain(G, L=3, d=5, C=3, r=r)
    m = _setup(model, G, client_layers=[1, 2, 3])
    assert m.L_g == 3 and m.omega.shape == (3, 3, 3)
    for i, Lk in enumerate([1, 2, 3]):
        torch.testing.assert_close(m.omega[i, :Lk].detach(), torch.eye(3, dtype=D64)[:Lk])  # [I | 0]
    with torch.no_grad():
        m.omega.add_(torch.rand(m.omega.shape, dtype=D64) * m.layer_mask[:, :, None])
    ups = [m.upload(i) for i in range(G)]
    for i, Lk in enumerate([1, 2, 3]):
        R_kg = ups[i].tensors["layers.*.lora_R"]
        assert R_kg.shape == (3, r, r)
        R_k = torch.stack([l.lora_R[i] for l in model.layers[:Lk]]).detach()
        torch.testing.assert_close(R_kg, to_global(R_k, m.omega[i, :Lk].detach()))
    state = H2Tune.aggregate(ups, torch.full((3,), 1 / 3))
    for i in range(G):
        m.download(i, state)
    for i, Lk in enumerate([1, 2, 3]):
        R_gk = m.received(i)["layers.*.lora_R"]
        assert R_gk.shape == (Lk, r, r)
        torch.testing.assert_close(R_gk, to_client(state["layers.*.lora_R"], m.omega[i, :Lk].detach()))
    # relative-depth init: layer l → round(l·(L_g−1)/(L_k−1))
    m2 = _setup(Chain(G, L=3), G, client_layers=[1, 2, 3], omega_init="depth")
    assert m2.omega[1, 1].argmax().item() == 2 and m2.omega[0, 0].argmax().item() == 0


def test_random_omega_init_is_the_authors_kaiming_uniform_per_client_not_per_slot():
    """omega_init="random": Ω_k[l, j] ~ U(−1/√L_k, 1/√L_k) (the authors' kaiming_uniform_(a=√5) of their
    L_g×L_k matrix), rows l ≥ L_k zero, drawn per client: client 2 gets the same Ω in slot 0 as in slot 2."""
    G = 3
    m = _setup(Chain(G, L=3), G, client_layers=[1, 2, 3], omega_init="random")
    for i, Lk in enumerate([1, 2, 3]):
        om = m.omega[i].detach()
        assert torch.all(om[:Lk].abs() <= 1 / math.sqrt(Lk)) and torch.all(om[Lk:] == 0)
        assert int((om[:Lk] != 0).sum()) == Lk * 3  # dense, not a 0/1 alignment
    assert not torch.equal(m.omega[1, :2], m.omega[2, :2])
    alone = H2Tune(rank=3, omega_init="random", client_layers=[1, 2, 3])
    alone.bind(Chain(1, L=3), [2], n_clients=3)  # client 2 alone in slot 0 of a pass
    assert torch.equal(alone.omega[0], m.omega[2])
    other = H2Tune(rank=3, omega_init="random", client_layers=[1, 2, 3], seed=1)  # another run seed
    other.bind(Chain(1, L=3), [2], n_clients=3)
    assert not torch.equal(other.omega[0], m.omega[2])


def test_replicas_start_equal_and_first_target_is_R_init():
    G = 4  # two federations of two clients
    model = Chain(G)
    m = H2Tune(rank=3, r_init_std=0.1, seed=5)
    m.setup(model, [0, 1, 0, 1])
    for layer in model.layers:
        assert torch.equal(layer.lora_R[0], layer.lora_R[1]) and torch.equal(layer.lora_R[2], layer.lora_R[3])
        assert layer.lora_R[0].abs().sum() > 0 and not torch.equal(layer.lora_R[0], layer.lora_R[2])
    assert torch.all(m.kl_shared().abs() < 1e-12)
    R0 = torch.stack([l.lora_R[0] for l in model.layers]).detach()
    torch.testing.assert_close(m.received(0)["layers.*.lora_R"], R0)


def test_server_mean_is_unweighted_and_pure():
    g = torch.Generator().manual_seed(0)
    ups = [Payload({"lora_R": torch.randn(2, 3, 3, generator=g, dtype=D64)}) for _ in range(3)]
    before = [p.tensors["lora_R"].clone() for p in ups]
    a = H2Tune.aggregate(ups, torch.tensor([0.8, 0.1, 0.1], dtype=D64))
    b = H2Tune.aggregate(ups, torch.tensor([1 / 3, 1 / 3, 1 / 3], dtype=D64))
    assert torch.equal(a["lora_R"], b["lora_R"])
    torch.testing.assert_close(a["lora_R"], sum(before) / 3)
    torch.testing.assert_close(a["lora_R"], server_mean(before))
    assert all(torch.equal(p.tensors["lora_R"], x) for p, x in zip(ups, before))
    with pytest.raises(ConfigError, match="keys"):
        H2Tune.aggregate([ups[0], Payload({"x": before[0]})], torch.tensor([0.5, 0.5]))


def test_upload_is_R_only_with_L_g_r_g_squared_entries_per_module_type():
    G, r = 2, 2
    model = QV(G, L=3, r=r)
    m = _setup(model, G, rank=r, client_layers=[1, 2])  # L_g = 2 < L = 3
    for i in range(G):
        up = m.upload(i)
        assert set(up.tensors) == {"layers.*.q.lora_R", "layers.*.v.lora_R"}
        zero = Payload({k: torch.zeros(2, r, r, dtype=D64) for k in up.tensors})
        assert up.nbytes == zero.nbytes == len(up.to_bytes())
    m3 = _setup(QV(G, L=3, r=r), G, rank=r, client_layers=[1, 2], global_layers=4)
    assert m3.upload(0).tensors["layers.*.q.lora_R"].shape == (4, r, r)
    single = LoRALinear(4, 4, 3, middle=True, stack=2, dtype=D64)
    m1 = _setup(single, 2)
    assert m1.upload(0).nbytes == Payload({"lora_R": torch.zeros(1, 3, 3, dtype=D64)}).nbytes
    assert m1.download(0, H2Tune.aggregate([m1.upload(0), m1.upload(1)], torch.ones(2) / 2)).nbytes == \
        m1.upload(0).nbytes


def test_density_zero_is_plain_lora_and_R_untrainable():
    G, d, r = 2, 5, 3
    model = Chain(G, L=1, d=d, C=3, r=r)
    objective, output_fn = _fns(model)
    m = _setup(model, G, densities=[0.0, 0.0], output_fn=output_fn, optimizer="adamw")
    layer = model.layers[0]
    with torch.no_grad():
        m.global_R["layers.*"].add_(1.0)
    R0, P0, A0 = layer.lora_R.clone(), layer.lora_Phi.clone(), layer.lora_A.clone()
    X, y = _batch(G, d=d)
    for rnd in range(2):
        m.begin_round(rnd)
        for _ in range(3):
            m.local_step(objective, lambda: (X, y))
    assert torch.all(layer.middle_mask == 0)
    assert torch.equal(layer.lora_R, R0) and torch.equal(layer.lora_Phi, P0) and not torch.equal(layer.lora_A, A0)
    dw = layer(torch.eye(d, dtype=D64).expand(G, d, d)).transpose(-1, -2)
    torch.testing.assert_close(dw, layer.scale * layer.lora_B @ layer.lora_A, rtol=1e-12, atol=1e-12)


def test_run_rounds_with_client_sampling_restores_idle_replicas():
    G = 4
    model = Chain(G)
    objective, output_fn = _fns(model)
    m = _setup(model, G, optimizer="adamw", lr=0.01, output_fn=output_fn, densities=[0.5, 1.0, 0.3, 0.8])
    fed = Federation(n_groups=1, n_clients=4, sample_fraction=0.5, sample_seed=3,
                     client_weights=[1.0, 5.0, 2.0, 1.0])
    X, y = _batch(G)
    idle = [k for k in range(4) if k not in fed.participants(0, 0)]
    before = {n: p.clone() for n, p in model.named_parameters()}
    masks = [l.middle_mask.clone() for l in model.layers]
    om = m.omega.detach().clone()
    hist = run_rounds(m, fed, objective, lambda: (X, y), rounds=1, local_steps=3)
    for k in idle:
        assert torch.equal(m.omega[k], om[k]) and hist[0]["bytes_up"][k] == 0
        for n, p in model.named_parameters():
            assert torch.equal(p[k], before[n][k]), n
        assert all(torch.equal(l.middle_mask[k], mk[k]) for l, mk in zip(model.layers, masks))
    active = fed.participants(0, 0)
    assert all(hist[0]["bytes_up"][k] == Payload({"layers.*.lora_R": torch.zeros(2, 3, 3, dtype=D64)}).nbytes
               for k in active)
    # every replica now targets the participants' unweighted mean
    Rg = m.global_R["layers.*"]
    assert all(torch.equal(Rg[0], Rg[k]) for k in range(4))
    hist = run_rounds(m, fed, objective, lambda: (X, y), rounds=2, local_steps=2)
    assert all(math.isfinite(float(v)) for v in objective(m.param_view(), (X, y)).detach())


def test_receive_replace_overwrites_R_with_R_g_to_k():
    G = 2
    model = Chain(G)
    m = _setup(model, G, receive="replace", client_layers=[2, 1])
    state = {"layers.*.lora_R": torch.randn(2, 3, 3, dtype=D64)}
    m.download(1, state)
    torch.testing.assert_close(model.layers[0].lora_R[1], to_client(state["layers.*.lora_R"], m.omega[1, :1].detach())[0])
    assert torch.all(model.layers[1].lora_R[1] == 0)
    m0 = _setup(Chain(G), G)
    R_before = m0.model.layers[0].lora_R.clone()
    m0.download(1, state)
    assert torch.equal(m0.model.layers[0].lora_R, R_before)  # default: R_g is only the KL target


def test_registry_and_adapter_kwargs():
    assert get_method("h2tune") is H2Tune
    assert H2Tune(rank=4).adapter_kwargs() == {"rank": 4, "middle": True}


@pytest.mark.parametrize("kw, match", [
    ({"densities": [0.5, 1.5]}, "densities"), ({"densities": [-0.1]}, "densities"),
    ({"lr": 0.0}, "lr"), ({"lr": -1.0}, "lr"), ({"shared_lr": 0.0}, "shared_lr"),
    ({"disentangle_sign": "minus"}, "disentangle_sign"), ({"receive": "x"}, "receive"),
    ({"client_layers": [0, 1]}, "client_layers"), ({"optimizer": "adam"}, "optimizer"),
    ({"nu": -1.0}, "nu"), ({"rank": 0}, "rank"), ({"support_by": "r"}, "support_by")])
def test_bad_options_raise(kw, match):
    with pytest.raises(ConfigError, match=match):
        H2Tune(**kw)


@pytest.mark.parametrize("kw, match", [
    ({"densities": [1.0, 1.0, 1.0]}, "densities has 3 entries for 2 clients"),
    ({"client_layers": [1]}, "client_layers has 1 entries for 2 clients"),
    ({"client_layers": [2, 3]}, "exceed the model's L = 2"),
    ({"global_layers": 1}, "global_layers")])
def test_bad_setup_raises(kw, match):
    with pytest.raises(ConfigError, match=match):
        H2Tune(rank=3, **kw).setup(Chain(2), [0, 1])


def test_model_without_middle_is_rejected():
    with pytest.raises(ConfigError, match="middle=True"):
        H2Tune(rank=2).setup(LoRALinear(4, 4, 2, stack=2), [0, 1])
    with pytest.raises(ConfigError, match="stacked"):
        H2Tune(rank=3).setup(LoRALinear(4, 4, 2, stack=2, middle=True), [0, 1])


def test_default_optimizer_is_plain_sgd_as_in_app_a():
    """App. A Algorithm 1 updates A, B with η and Φ⊙R with η′ by plain gradient steps."""
    m = H2Tune(rank=3, lr=0.05, shared_lr=0.02)
    assert m.optimizer == "sgd"
    model = Chain(2)
    _randomise(model)
    m.setup(model, [0, 1])
    for opt, lr in ((m.opt_shared, 0.02), (m.opt_specific, 0.05)):
        assert type(opt) is PlainSGD  # torch's SGD, the same numbers (tests/test_optim.py)
        assert opt.defaults["lr"] == lr and opt.defaults["momentum"] == 0 and opt.defaults["weight_decay"] == 0
    adamw = H2Tune(rank=3, lr=0.05, shared_lr=0.02, optimizer="adamw")  # AdamW stays an option
    adamw.setup(model, [0, 1])
    assert type(adamw.opt_shared) is StackedAdamW and type(adamw.opt_specific) is StackedAdamW


# ---------------------------------------------------------------------------------------------
# eq. 7's output KL on clients of different sizes (the synthetic runner pads them to n_max)

def _two_sizes(sizes=(3, 5), C=4, d=5):
    from fedlora.synthetic.data import ClientTask
    from fedlora.synthetic.runner import stack_federations

    g = torch.Generator().manual_seed(4)
    clients = [ClientTask(torch.randn(n, d, generator=g, dtype=D64), torch.randint(0, C, (n,), generator=g),
                          torch.randn(2, d, generator=g, dtype=D64), torch.randint(0, C, (2,), generator=g),
                          torch.zeros(d, C, dtype=D64), 1, 0.0) for n in sizes]
    return stack_federations("classification", [clients], [0], C)


def test_output_kl_is_averaged_over_each_clients_real_rows_only():
    """One step (2) on two clients of 3 and 5 samples, through the runner's objective and output_fn,
    against a hand computation on each client's unpadded rows: −mean over its OWN n_k rows of
    KL(softmax y'' ‖ softmax y') — not a mean over n_max rows, which scales client 1's KL by 3/5."""
    from fedlora.synthetic.runner import _objectives

    data = _two_sizes()
    G, d, C, r, eta, nu = 2, 5, 4, 3, 0.1, 0.01
    layer = LoRALinear(d, C, r, middle=True, stack=G, dtype=D64)
    objective, batch, _, output_fn = _objectives(layer, data)
    m = _setup(layer, G, lr=eta, nu=nu, output_fn=output_fn)
    g = torch.Generator().manual_seed(9)
    y_prime = torch.randn(G, 5, C, generator=g, dtype=D64) * data.mask_train[..., None]  # zero on padding
    ref = copy.deepcopy(layer)
    m.specific_step(objective, batch, y_prime)
    for i, n in enumerate((3, 5)):
        A = ref.lora_A[i].detach().clone().requires_grad_()
        B = ref.lora_B[i].detach().clone().requires_grad_()
        X, y = data.X_train[i, :n], data.Y_train[i, :n]
        z = X @ trilora_delta(B, ref.lora_R[i].detach(), (ref.lora_Phi[i] * ref.middle_mask[i]).detach(), A,
                              ref.scale).T
        lp, lq = torch.log_softmax(z, -1), torch.log_softmax(y_prime[i, :n], -1)
        kl = (lp.exp() * (lp - lq)).sum(-1).mean()  # over the n real rows
        loss = nn.functional.cross_entropy(z, y) - kl + 0.5 * nu * ((A ** 2).sum() + (B ** 2).sum())
        gA, gB = torch.autograd.grad(loss, [A, B])
        torch.testing.assert_close(layer.lora_A[i].detach(), (A - eta * gA).detach(), rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(layer.lora_B[i].detach(), (B - eta * gB).detach(), rtol=1e-12, atol=1e-14)
    # output_kl itself: the masked mean, by hand
    y_new = torch.randn(G, 5, C, generator=g, dtype=D64)
    per_row = (torch.softmax(y_new, -1) * (torch.log_softmax(y_new, -1) - torch.log_softmax(y_prime, -1))).sum(-1)
    want = torch.stack([per_row[0, :3].mean(), per_row[1].mean()])
    torch.testing.assert_close(output_kl(y_new, y_prime, data.mask_train), want, rtol=1e-14, atol=1e-15)


def test_runner_h2tune_results_do_not_depend_on_how_far_clients_are_padded():
    """The same federation, padded to n_max = 5 or (with extra masked zero rows) to 12: every number
    of a classification run through ``run_method`` must be the same."""
    import dataclasses

    from fedlora.synthetic.runner import run_method

    data = _two_sizes()
    pad = 7
    more = dataclasses.replace(
        data, X_train=torch.cat([data.X_train, torch.zeros(2, pad, 5, dtype=D64)], 1),
        Y_train=torch.cat([data.Y_train, torch.zeros(2, pad, dtype=data.Y_train.dtype)], 1),
        mask_train=torch.cat([data.mask_train, torch.zeros(2, pad, dtype=D64)], 1))
    runs = [run_method("h2tune", dd, lr=0.3, rounds=2, local_steps=3, options={"rank": 3, "r_init_std": 0.3})
            for dd in (data, more)]
    assert runs[0].error is None and runs[1].error is None
    for key in ("train_loss", "test_loss", "distance"):
        torch.testing.assert_close(torch.tensor(runs[1].final[key]), torch.tensor(runs[0].final[key]),
                                   rtol=1e-12, atol=1e-14)
    assert runs[0].final["test_loss"] != run_method("h2tune", data, lr=0.3, rounds=2, local_steps=3,
                                                    options={"rank": 3, "r_init_std": 0.3,
                                                             "disentangle_sign": "plus"}).final["test_loss"]
