"""fedlora.privacy.clipping: per-sample LoRA gradients equal a per-example loop, clipped norms stay ≤ C, the
noise has the std of its formula and is reproducible from its generator, and a private step trains BOTH LoRA
factors from PEFT's B = 0 init (the failure of opacus issue 820) (issue 29)."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _shapes import ShapeRecorder
from fedlora.adapter import LoRALinear
from fedlora.errors import ConfigError
from fedlora.privacy.clipping import (clip_per_sample, clip_update, gaussian_noise_like, per_sample_lora_grads,
                                      per_sample_norms, private_mean)

F64 = torch.float64


def _layer(d_in, d_out, r, seed, b_zero=False):
    """Our adapter layer (its forward is the fused lora_linear op), float64, W0 random; B random unless
    ``b_zero`` (PEFT's init)."""
    g = torch.Generator().manual_seed(seed)
    layer = LoRALinear(d_in, d_out, r, alpha=2 * r, base_weight=torch.randn(d_out, d_in, generator=g, dtype=F64),
                       dtype=F64)
    with torch.no_grad():
        layer.lora_A.copy_(torch.randn(r, d_in, generator=g, dtype=F64) / math.sqrt(d_in))
        if not b_zero:
            layer.lora_B.copy_(torch.randn(d_out, r, generator=g, dtype=F64))
    return layer


def _two_layer_losses(l1, l2, x, target):
    """Per-example losses of l2(tanh(l1(x))) against target, and the layers' outputs."""
    y1 = l1(x)
    y2 = l2(torch.tanh(y1))
    return ((y2 - target) ** 2).reshape(x.shape[0], -1).sum(1), y1, y2


@pytest.mark.parametrize("tokens", [3, None])   # (n, T, d) sequences and (n, d) rows
def test_per_sample_grads_equal_a_loop_over_single_examples(tokens):
    n, d_in, hidden, d_out, r = 5, 6, 7, 4, 3
    l1, l2 = _layer(d_in, hidden, r, 1), _layer(hidden, d_out, 2, 2)
    g = torch.Generator().manual_seed(3)
    shape = (n, tokens) if tokens else (n,)
    x = torch.randn(*shape, d_in, generator=g, dtype=F64)
    target = torch.randn(*shape, d_out, generator=g, dtype=F64)

    losses, y1, y2 = _two_layer_losses(l1, l2, x, target)
    g1, g2 = torch.autograd.grad(losses.sum(), [y1, y2])        # ∂(Σ_i ℓ_i)/∂y of each layer
    with ShapeRecorder() as rec:
        dA1, dB1 = per_sample_lora_grads(x, g1, l1.lora_A, l1.lora_B, l1.scale)
        dA2, dB2 = per_sample_lora_grads(torch.tanh(y1), g2, l2.lora_A, l2.lora_B, l2.scale)
    assert (d_in, hidden) not in {s[-2:] for s in rec.shapes} and (hidden, d_in) not in {s[-2:] for s in rec.shapes}
    assert (hidden, d_out) not in {s[-2:] for s in rec.shapes} and (d_out, hidden) not in {s[-2:] for s in rec.shapes}
    assert dA1.shape == (n, r, d_in) and dB1.shape == (n, hidden, r)
    assert dA2.shape == (n, 2, hidden) and dB2.shape == (n, d_out, 2)

    params = [l1.lora_A, l1.lora_B, l2.lora_A, l2.lora_B]
    for i in range(n):   # the reference: plain autograd on example i alone
        loss_i, _, _ = _two_layer_losses(l1, l2, x[i:i + 1], target[i:i + 1])
        ref = torch.autograd.grad(loss_i.sum(), params)
        for got, want in zip((dA1[i], dB1[i], dA2[i], dB2[i]), ref):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
            assert want.abs().max() > 1e-3   # a real gradient, not two zeros agreeing


def test_per_sample_grads_bad_shapes_are_one_line():
    A, B = torch.zeros(2, 5), torch.zeros(4, 2)
    with pytest.raises(ConfigError, match=r"x must be \(n, T, d_in=5\)"):
        per_sample_lora_grads(torch.zeros(3, 2, 6), torch.zeros(3, 2, 4), A, B, 1.0)
    with pytest.raises(ConfigError, match=r"A must be \(r, d_in\) and B \(d_out, r\)"):
        per_sample_lora_grads(torch.zeros(3, 2, 5), torch.zeros(3, 2, 4), A, torch.zeros(4, 3), 1.0)


tensor_sets = st.lists(st.tuples(st.integers(1, 4), st.integers(1, 5)), min_size=1, max_size=3)


@settings(max_examples=40, deadline=None)
@given(shapes=tensor_sets, log_scale=st.floats(-3, 3), clip=st.floats(1e-2, 1e2), seed=st.integers(0, 2**31 - 1))
def test_clip_update_norm_at_most_c_and_inside_unchanged(shapes, log_scale, clip, seed):
    g = torch.Generator().manual_seed(seed)
    download = {f"t{i}": torch.randn(s, generator=g, dtype=F64) for i, s in enumerate(shapes)}
    upload = {k: v + 10 ** log_scale * torch.randn(v.shape, generator=g, dtype=F64) for k, v in download.items()}
    delta, norm = clip_update(upload, download, clip)
    raw = {k: upload[k] - download[k] for k in upload}
    raw_norm = math.sqrt(sum(float((v ** 2).sum()) for v in raw.values()))
    assert norm == pytest.approx(raw_norm, rel=1e-12)                 # the norm over the WHOLE payload
    clipped_norm = math.sqrt(sum(float((v ** 2).sum()) for v in delta.values()))
    assert clipped_norm <= clip
    if raw_norm + 1e-6 <= clip:
        assert all(torch.equal(delta[k], raw[k]) for k in raw)        # inside C: unchanged, bit for bit
    else:
        # outside: scaled to C·‖Δ‖/(‖Δ‖ + 1e-6) (less 2 ulps), just inside the sphere of radius C
        assert clipped_norm == pytest.approx(clip * raw_norm / (raw_norm + 1e-6), rel=1e-12)
        for k in raw:                                                  # one common factor (direction kept)
            torch.testing.assert_close(delta[k], raw[k] * (clip / (raw_norm + 1e-6)), rtol=1e-12, atol=0)


def test_clip_update_float32_and_a_payload_inside_c():
    down = {"a": torch.ones(3, 4), "b": torch.zeros(5)}
    up = {"a": torch.ones(3, 4) + 0.01, "b": torch.full((5,), 0.02)}
    delta, norm = clip_update(up, down, 1.0)
    assert norm == pytest.approx(math.sqrt(12 * 1e-4 + 5 * 4e-4), rel=1e-6)
    assert torch.equal(delta["a"], up["a"] - down["a"]) and torch.equal(delta["b"], up["b"])
    assert delta["a"].dtype == torch.float32
    g = torch.Generator().manual_seed(4)
    for trial in range(200):   # float32 updates of norm ~10⁴, where the 1e-6 margin is below float32 rounding
        big = {"a": 3e3 * torch.randn(3, 4, generator=g), "b": 3e3 * torch.randn(5, generator=g)}
        delta, norm = clip_update(big, down, 0.5)
        assert delta["a"].dtype == torch.float32 and norm > 1e3
        assert math.sqrt(sum(float((v.double() ** 2).sum()) for v in delta.values())) <= 0.5


def test_clip_update_bad_input():
    x = {"a": torch.zeros(2)}
    with pytest.raises(ConfigError, match="clip_norm must be a finite number > 0"):
        clip_update(x, x, 0.0)
    with pytest.raises(ConfigError, match="clip_norm must be"):
        clip_update(x, x, -1.0)
    with pytest.raises(ConfigError, match="has no downloaded value"):
        clip_update({"b": torch.zeros(2)}, x, 1.0)
    with pytest.raises(ConfigError, match=r"uploaded as \(3,\) but was downloaded as \(2,\)"):
        clip_update({"a": torch.zeros(3)}, x, 1.0)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 6), shapes=tensor_sets, log_scale=st.floats(-3, 3), clip=st.floats(1e-2, 1e2),
       seed=st.integers(0, 2**31 - 1))
def test_clip_per_sample_every_example_jointly_at_most_c(n, shapes, log_scale, clip, seed):
    g = torch.Generator().manual_seed(seed)
    grads = {f"t{i}": 10 ** log_scale * torch.randn(n, *s, generator=g, dtype=F64) for i, s in enumerate(shapes)}
    total = clip_per_sample(grads, clip)
    assert set(total) == set(grads) and all(total[k].shape == grads[k].shape[1:] for k in grads)
    norms = per_sample_norms(grads)
    parts = []
    for i in range(n):   # example i alone: its clipped gradient, over ALL its tensors jointly, has norm ≤ C
        one = clip_per_sample({k: v[i:i + 1] for k, v in grads.items()}, clip)
        joint = math.sqrt(sum(float((v ** 2).sum()) for v in one.values()))
        assert joint <= clip
        if norms[i] + 1e-6 <= clip:
            assert all(torch.equal(one[k], grads[k][i]) for k in grads)
        else:
            assert joint == pytest.approx(clip * float(norms[i]) / (float(norms[i]) + 1e-6), rel=1e-12)
        parts.append(one)
    for k in grads:      # the result is the sum of the examples' clipped gradients
        torch.testing.assert_close(total[k], sum(p[k] for p in parts), rtol=1e-12, atol=1e-12)


def test_clip_per_sample_is_joint_not_per_tensor():
    """Two tensors of norm 3 and 4 each (joint 5), C = 1: joint clipping scales both by 1/5; clipping each
    tensor on its own would give two tensors of norm 1 (joint √2)."""
    grads = {"a": torch.tensor([[3.0, 0.0]], dtype=F64), "b": torch.tensor([[0.0, 4.0]], dtype=F64)}
    out = clip_per_sample(grads, 1.0)
    f = 1.0 / (5.0 + 1e-6)
    torch.testing.assert_close(out["a"], torch.tensor([3.0 * f, 0.0], dtype=F64), rtol=1e-15, atol=0)
    torch.testing.assert_close(out["b"], torch.tensor([0.0, 4.0 * f], dtype=F64), rtol=1e-15, atol=0)
    with pytest.raises(ConfigError, match="share their leading"):
        clip_per_sample({"a": torch.zeros(2, 3), "b": torch.zeros(3, 3)}, 1.0)


def test_noise_std_equals_sigma_c_within_three_standard_errors():
    """private_mean of all-zero updates is the noise over the expected participants: N(0, σ²C²)/m. Over
    N = 200,000 draws the sample std of m·mean has standard error σC/√(2(N−1)); its mean σC/√N."""
    sigma, clip, m = 1.3, 0.7, 4.0
    zeros = [{"w": torch.zeros(400, 250, dtype=F64), "v": torch.zeros(100, dtype=F64)} for _ in range(3)]
    out = private_mean(zeros, sigma, clip, m, torch.Generator().manual_seed(0))
    noise = torch.cat([(out[k] * m).reshape(-1) for k in ("w", "v")])
    N, want = noise.numel(), sigma * clip
    assert abs(float(noise.std()) - want) < 3 * want / math.sqrt(2 * (N - 1))
    assert abs(float(noise.mean())) < 3 * want / math.sqrt(N)


def test_private_mean_is_sum_plus_noise_over_expected_participants():
    g = torch.Generator().manual_seed(5)
    deltas = [{"a": torch.randn(3, 2, generator=g, dtype=F64), "b": torch.randn(4, generator=g, dtype=F64)}
              for _ in range(3)]
    out = private_mean(deltas, 0.8, 2.0, 5.0, torch.Generator().manual_seed(9))
    noise = gaussian_noise_like({"a": deltas[0]["a"], "b": deltas[0]["b"]}, 0.8 * 2.0,
                                torch.Generator().manual_seed(9))
    for k in ("a", "b"):   # fixed denominator: 5 expected participants although 3 took part
        torch.testing.assert_close(out[k], (deltas[0][k] + deltas[1][k] + deltas[2][k] + noise[k]) / 5.0,
                                   rtol=1e-14, atol=1e-14)
    no_noise = private_mean(deltas, 0.0, 2.0, 5.0, torch.Generator().manual_seed(9))
    torch.testing.assert_close(no_noise["a"], sum(d["a"] for d in deltas) / 5.0, rtol=1e-14, atol=0)


def test_noise_same_seed_bit_identical_two_seeds_differ():
    like = {"b": torch.zeros(6, 3), "a": torch.zeros(2, 5, dtype=F64)}
    n1 = gaussian_noise_like(like, 0.5, torch.Generator().manual_seed(11))
    n2 = gaussian_noise_like(like, 0.5, torch.Generator().manual_seed(11))
    n3 = gaussian_noise_like(like, 0.5, torch.Generator().manual_seed(12))
    assert all(torch.equal(n1[k], n2[k]) for k in like)
    assert not any(torch.equal(n1[k], n3[k]) for k in like)
    assert n1["b"].dtype == torch.float32 and n1["a"].dtype == F64
    # the mapping's order does not change a name's noise (a transport may reorder names)
    n4 = gaussian_noise_like({"a": like["a"], "b": like["b"]}, 0.5, torch.Generator().manual_seed(11))
    assert all(torch.equal(n1[k], n4[k]) for k in like)
    m1 = private_mean([like], 1.0, 1.0, 2.0, torch.Generator().manual_seed(1))
    m2 = private_mean([like], 1.0, 1.0, 2.0, torch.Generator().manual_seed(1))
    assert all(torch.equal(m1[k], m2[k]) for k in like)


def test_noise_and_mean_bad_input():
    like = {"a": torch.zeros(2)}
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ConfigError, match="noise std must be a finite number ≥ 0"):
        gaussian_noise_like(like, -0.1, gen)
    with pytest.raises(ConfigError, match="needs a torch.Generator"):
        gaussian_noise_like(like, 1.0, 0)
    with pytest.raises(ConfigError, match="noise_multiplier must be a finite number ≥ 0"):
        private_mean([like], -1.0, 1.0, 1.0, gen)
    with pytest.raises(ConfigError, match="expected_participants must be a finite number > 0"):
        private_mean([like], 1.0, 1.0, 0, gen)
    with pytest.raises(ConfigError, match="at least one participant"):
        private_mean([], 1.0, 1.0, 1.0, gen)
    with pytest.raises(ConfigError, match="update 1 has names"):
        private_mean([like, {"b": torch.zeros(2)}], 1.0, 1.0, 1.0, gen)


def _private_sgd_step(layer, x, target, clip, sigma, lr, gen):
    """One DP-SGD step on the layer's LoRA factors with our functions: per-example gradients from the layer's
    input and output gradient, joint clipping, N(0, σ²C²) on the sum, divided by the batch size, SGD."""
    y = layer(x)
    losses = ((y - target) ** 2).reshape(x.shape[0], -1).sum(1)
    (g,) = torch.autograd.grad(losses.sum(), [y])
    dA, dB = per_sample_lora_grads(x, g, layer.lora_A, layer.lora_B, layer.scale)
    total = clip_per_sample({"lora_A": dA, "lora_B": dB}, clip)
    noise = gaussian_noise_like(total, sigma * clip, gen)
    with torch.no_grad():
        for k in ("lora_A", "lora_B"):
            getattr(layer, k).sub_(lr * (total[k] + noise[k]) / x.shape[0])
    return dA, dB, noise


@pytest.mark.parametrize("sigma", [0.0, 0.5])
def test_private_steps_train_both_factors_from_peft_init(sigma):
    """From PEFT's init (B = 0) ∂ℓ/∂A = s·(gB)ᵀx = 0 for every example at the first step, so step 1 moves A by
    the noise alone — exactly −lr·noise_A/n (not at all when σ = 0) — while B takes a real step; at step 2
    B ≠ 0 and A gets a gradient of its own. After two private steps BOTH factors have changed (the failure
    reported in opacus issue 820 is adapters that silently do not train)."""
    layer = _layer(6, 4, 2, seed=7, b_zero=True)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(5, 3, 6, generator=g, dtype=F64)
    target = torch.randn(5, 3, 4, generator=g, dtype=F64)
    A0, B0 = layer.lora_A.detach().clone(), layer.lora_B.detach().clone()
    assert torch.equal(B0, torch.zeros_like(B0))
    gen = torch.Generator().manual_seed(0)

    dA, dB, noise = _private_sgd_step(layer, x, target, clip=1.0, sigma=sigma, lr=0.5, gen=gen)
    assert torch.equal(dA, torch.zeros_like(dA))                    # B = 0: no example has a gradient for A
    assert per_sample_norms({"lora_B": dB}).min() > 0
    torch.testing.assert_close(layer.lora_A.detach(), A0 - 0.5 * noise["lora_A"] / 5, rtol=0, atol=0)
    assert torch.equal(layer.lora_A.detach(), A0) == (sigma == 0.0)
    assert not torch.equal(layer.lora_B.detach(), B0)
    A1, B1 = layer.lora_A.detach().clone(), layer.lora_B.detach().clone()

    dA, _, _ = _private_sgd_step(layer, x, target, clip=1.0, sigma=sigma, lr=0.5, gen=gen)
    assert per_sample_norms({"lora_A": dA}).min() > 0               # now A's own gradient is there
    assert not torch.equal(layer.lora_A.detach(), A1) and not torch.equal(layer.lora_A.detach(), A0)
    assert not torch.equal(layer.lora_B.detach(), B1)
