"""Adapter injection into HF models (fedlora.llm.inject): equivalence with PEFT's LoRA layer, slots, targets."""

import pytest
import torch

from fedlora.errors import ConfigError
from fedlora.llm.inject import (SlotHead, SlotLoRALinear, inject_adapters, layer_index, make_head_trainable, match_targets,
                        set_slots)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

F64 = torch.float64


def tiny_bert(num_labels=3, seed=0):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=60, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
                     max_position_embeddings=32, num_labels=num_labels, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(cfg).to(F64).eval()


def tiny_gpt2(num_labels=3, seed=0):
    from transformers import GPT2Config, GPT2ForSequenceClassification

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=60, n_embd=16, n_layer=2, n_head=2, n_positions=32, num_labels=num_labels,
                     pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2ForSequenceClassification(cfg).to(F64).eval()


def _inputs(seed=1, n=4, L=7):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 60, (n, L), generator=g)
    mask = torch.ones(n, L, dtype=torch.long)
    mask[0, 5:] = 0
    ids[0, 5:] = 0
    return {"input_ids": ids, "attention_mask": mask}


CASES = [("bert", tiny_bert, ["query", "value"], False), ("gpt2", tiny_gpt2, ["c_attn", "c_proj"], True)]


@pytest.mark.parametrize("arch,make,targets,fan_in_fan_out", CASES, ids=[c[0] for c in CASES])
def test_injected_layer_equals_peft_lora_with_client_adapter_at_zero(arch, make, targets, fan_in_fan_out):
    """Acceptance: with D = 0 (client adapter at zero) our layers give PEFT's logits and gradients."""
    r, alpha = 4, 8.0
    ours, base = make(), make()
    names = match_targets(ours, targets)
    inject_adapters(ours, names, rank=r, client_rank=2, alpha=alpha, client_alpha=3.0, slots=None)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                          fan_in_fan_out=fan_in_fan_out)
    theirs = peft.get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(2)
    pairs = []
    for n in names:
        layer = ours.get_submodule(n)
        assert isinstance(layer, SlotLoRALinear) and layer.conv1d == fan_in_fan_out
        A = torch.randn(layer.lora_A.shape, generator=g, dtype=F64)
        B = torch.randn(layer.lora_B.shape, generator=g, dtype=F64)  # B ≠ 0: a real test
        with torch.no_grad():
            layer.lora_A.copy_(A)
            layer.lora_B.copy_(B)
            layer.lora_C.normal_()
            layer.lora_D.zero_()
        pl = theirs.base_model.model.get_submodule(n)
        with torch.no_grad():
            pl.lora_A["default"].weight.copy_(A)
            pl.lora_B["default"].weight.copy_(B)
        pairs.append((layer, pl))
    x = _inputs()
    y_ours, y_theirs = ours(**x).logits, theirs(**x).logits
    torch.testing.assert_close(y_ours, y_theirs, rtol=0, atol=1e-6)
    with torch.no_grad(), theirs.disable_adapter():
        y_base = theirs(**x).logits
    assert float((y_ours.detach() - y_base).abs().max()) > 1e-3  # the adapters do change the output
    (y_ours ** 2).sum().backward()
    (y_theirs ** 2).sum().backward()
    for layer, pl in pairs:
        torch.testing.assert_close(layer.lora_A.grad, pl.lora_A["default"].weight.grad, rtol=0, atol=1e-6)
        torch.testing.assert_close(layer.lora_B.grad, pl.lora_B["default"].weight.grad, rtol=0, atol=1e-6)
        assert layer.lora_D.grad.abs().sum() > 0 and torch.all(layer.lora_C.grad == 0)  # D = 0: no signal to C


def test_frozen_base_is_the_models_own_tensor_and_only_adapters_train():
    m = tiny_gpt2()
    w = m.transformer.h[0].attn.c_attn.weight
    inject_adapters(m, match_targets(m, ["c_attn"]), rank=2, slots=3)
    layer = m.transformer.h[0].attn.c_attn
    assert layer.weight.data_ptr() == w.data_ptr() and layer.weight.shape == (w.shape[1], w.shape[0])  # the view
    trainable = sorted(n for n, p in m.named_parameters() if p.requires_grad)
    assert trainable and all(n.rsplit(".", 1)[-1] in ("lora_A", "lora_B") for n in trainable)


@pytest.mark.parametrize("make,targets", [(tiny_bert, ["query", "value", "dense"]), (tiny_gpt2, ["c_attn", "c_fc"])])
def test_slots_equal_separate_single_adapter_models(make, targets):
    """Slot p's rows go through slot p's adapter: one slotted forward = S single-adapter forwards."""
    S, r = 3, 2
    slotted, single = make(), make()
    names = match_targets(slotted, targets)
    inject_adapters(slotted, names, rank=r, slots=S)
    inject_adapters(single, names, rank=r, slots=None)
    g = torch.Generator().manual_seed(3)
    for n in names:
        lay = slotted.get_submodule(n)
        with torch.no_grad():
            lay.lora_A.copy_(torch.randn(lay.lora_A.shape, generator=g, dtype=F64))
            lay.lora_B.copy_(torch.randn(lay.lora_B.shape, generator=g, dtype=F64))
    heads = make_head_trainable(slotted, S)
    assert heads and all(isinstance(slotted.get_submodule(h), SlotHead) for h in heads)
    with torch.no_grad():
        for h in heads:
            slotted.get_submodule(h).head_weight.normal_()
    xs = [_inputs(seed=10 + p, n=2, L=6) for p in range(S)]
    cat = {k: torch.cat([x[k] for x in xs]) for k in xs[0]}
    y = slotted(**cat).logits
    for p in range(S):
        with torch.no_grad():
            for n in names:
                src, dst = slotted.get_submodule(n), single.get_submodule(n)
                dst.lora_A.copy_(src.lora_A[p])
                dst.lora_B.copy_(src.lora_B[p])
            for h in heads:
                src, dst = slotted.get_submodule(h), single.get_submodule(h)
                dst.weight.copy_(src.head_weight[p])
                if dst.bias is not None:
                    dst.bias.copy_(src.head_bias[p])
        torch.testing.assert_close(y[2 * p:2 * p + 2], single(**xs[p]).logits, rtol=0, atol=1e-12)


def test_set_slots_resizes_every_slot_module_without_touching_the_base():
    m = tiny_bert()
    inject_adapters(m, match_targets(m, ["query"]), rank=2, client_rank=1, middle=True, slots=4)
    make_head_trainable(m, 4)
    rng = torch.get_rng_state()
    set_slots(m, 2)
    assert torch.equal(rng, torch.get_rng_state())  # placeholders draw nothing
    q = m.bert.encoder.layer[0].attention.self.query
    assert q.lora_A.shape[0] == q.lora_C.shape[0] == q.lora_R.shape[0] == q.middle_mask.shape[0] == 2
    assert q.weight.shape == (16, 16) and m.classifier.head_weight.shape[0] == 2
    assert torch.all(q.lora_Phi == 1) and torch.all(q.middle_mask == 1)
    with pytest.raises(ConfigError, match="multiple"):
        m(**_inputs(n=3))  # 3 rows for 2 slots


def test_target_matching_rules_and_errors():
    m = tiny_bert()
    assert match_targets(m, ["query"]) == ["bert.encoder.layer.0.attention.self.query",
                                           "bert.encoder.layer.1.attention.self.query"]
    assert match_targets(m, None) == match_targets(m, ["query", "value"])  # PEFT's default for bert
    assert match_targets(m, r".*layer\.1\..*\.(query|key)") == ["bert.encoder.layer.1.attention.self.query",
                                                                "bert.encoder.layer.1.attention.self.key"]
    every = match_targets(m, "all-linear")
    assert "classifier" not in every and "bert.pooler.dense" in every and len(every) == 2 * 6 + 1
    assert match_targets(m, ["value"], layers=[1]) == ["bert.encoder.layer.1.attention.self.value"]
    assert layer_index("transformer.h.11.attn.c_attn") == 11 and layer_index("classifier") is None
    with pytest.raises(ConfigError, match="q_proj.*matches no module.*query, key, value"):
        match_targets(m, ["q_proj"])
    with pytest.raises(ConfigError, match="not a linear layer"):
        match_targets(m, ["attention"])
    with pytest.raises(ConfigError, match="model.layers.*layers \\[0, 1\\]"):
        match_targets(m, ["query"], layers=[5])
    with pytest.raises(ConfigError, match="regex"):
        match_targets(m, "zzz.*")
    with pytest.raises(ConfigError, match="rank 32 exceeds.*min\\(d_in, d_out\\) = 16"):
        inject_adapters(m, match_targets(m, ["query"]), rank=32, slots=2)
