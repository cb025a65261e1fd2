"""PEFT adapters trained anywhere, aggregated with a method's server (``fedlora aggregate``, ``fedlora.peft_adapters``).

The adapters are saved by PEFT itself (``get_peft_model`` on a tiny BERT built from a config, random
factors — ``init_lora_weights=False`` — and different ranks and seeds). Each method that declares its server
runs on uploads alone (``Method.lora_upload``; new methods join by that attribute) is checked against the
same method in a run: one round of the round protocol every run uses (``Server.run_round``) whose clients
hold the same factors in a stacked model and take no local step — their own ``upload``, the server's
``aggregate`` and ``server_update``, the final broadcast through the method's ``download``.
Independent numbers pin what the results mean (FedAvg's weighted mean, FLoRA's Σ p_k s_k B_k A_k, FlexLoRA's
truncated SVD, HetLoRA's norm-weighted zero-padded mean).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from fedlora.adapter import LoRALinear
from fedlora.server import ClientUpdate, Federation, Server
from fedlora.cli import main
from fedlora.methods import RankSlots, build, get_method, method_parameters
from fedlora.peft_adapters import PeftAdapter, aggregate_adapters, lora_methods, peft_key

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
            num_labels=3)
TARGETS = ["query", "value"]
WEIGHTS = [1.0, 2.0, 3.0]
HET_RANKS = [2, 4, 3]


def base_model():
    torch.manual_seed(0)  # every client shares the base model
    return transformers.BertForSequenceClassification(transformers.BertConfig(**TINY)).eval()


def save_adapters(folder: Path, ranks, *, alpha=None, share_a=False, head=False, targets=TARGETS,
                  rslora=False) -> list[str]:
    """One PEFT adapter per rank, saved by PEFT (``save_pretrained``): random A and B (seed k + 1), lora_alpha
    ``alpha`` (default 2r: scale 2 at every rank); with ``share_a`` every client's A is client 0's (a frozen A
    shared by all, as FFA-LoRA's)."""
    dirs, first_a = [], {}
    for k, r in enumerate(ranks):
        model = base_model()
        torch.manual_seed(k + 1)
        cfg = peft.LoraConfig(r=r, lora_alpha=2 * r if alpha is None else alpha, target_modules=targets, init_lora_weights=False,
                              modules_to_save=["classifier"] if head else None, use_rslora=rslora)
        pm = peft.get_peft_model(model, cfg)
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "classifier" in n and "modules_to_save" in n:
                    p.normal_()  # a trained head differs per client
                if share_a and "lora_A" in n:
                    first_a.setdefault(n, p.detach().clone())
                    p.copy_(first_a[n])
        d = folder / f"client{k}"
        pm.save_pretrained(str(d))
        dirs.append(str(d))
    return dirs


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft-adapters")
    return {"het": save_adapters(root / "het", HET_RANKS),
            "same": save_adapters(root / "same", [4, 4, 4]),
            "shared_a": save_adapters(root / "shared_a", [4, 4, 4], share_a=True),
            "head": save_adapters(root / "head", [4, 4, 4], head=True),
            "het_scales": save_adapters(root / "het_scales", HET_RANKS, alpha=8, rslora=True),
            "query_only": save_adapters(root / "query_only", [4], targets=["query"])}


def takes_client_ranks(name: str) -> bool:
    return any(o in method_parameters(name) for o in ("client_ranks", "ranks", "initial_ranks"))


def input_set(name: str) -> str:
    """The adapters a method takes: different ranks where it takes them; else one rank, with the factor it
    does not upload shared by every client where that factor is frozen (a method with a global model)."""
    cls = get_method(name)
    if takes_client_ranks(name):
        return "het"
    if not cls.personalised and len(cls.lora_upload) < 2:
        return "shared_a" if "lora_A" not in cls.lora_upload else "same"
    return "same"


def factors_of(sd) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module → (A, B) of a PEFT state dict (saved keys, or a loaded PeftModel's with ``.default``)."""
    out: dict[str, list] = {}
    for k, v in sd.items():
        for i, leaf in enumerate(("lora_A", "lora_B")):
            for tail in (f".{leaf}.weight", f".{leaf}.default.weight"):
                if k.endswith(tail):
                    out.setdefault(k[len("base_model.model."): -len(tail)], [None, None])[i] = v
    return {m: tuple(ab) for m, ab in out.items()}


# -- the same method in a run: its clients' upload, its server, its download --------------------------------------
def run_options(name: str, ranks) -> dict:
    """The method's options in a run whose clients have these ranks (the server's rank = the largest)."""
    params, cls = method_parameters(name), get_method(name)
    opts = {}
    if "r_max" in params:  # HetLoRA: ranks in [r_min, r_max]
        opts.update(r_min=min(ranks), r_max=max(ranks))
    elif cls.rank_option and cls.rank_option in params:
        opts[cls.rank_option] = max(ranks)
    for o in ("client_ranks", "ranks", "initial_ranks"):
        if o in params:
            opts[o] = list(ranks)
    return opts


def stacked_model(shapes, K: int, adapter: dict, scale: float) -> nn.Module:
    """The adapted modules, named as in the HF model, as stacked LoRALinear layers of K replicas (W0 = 0) with the
    method's adapter structure (``adapter_kwargs``: its rank, a client adapter, a middle matrix) and scale."""
    root = nn.Module()
    for name, (d_out, d_in) in shapes.items():
        parent = root
        *path, leaf = name.split(".")
        for p in path:
            if p not in parent._modules:
                parent.add_module(p, nn.Module())
            parent = parent._modules[p]
        parent.add_module(leaf, LoRALinear(d_in, d_out, **adapter, alpha=scale * adapter["rank"], stack=K))
    return root


class Holding:
    """A client executor whose clients upload what they hold (no local step: the PEFT adapters are their trained
    state) with the method's own ``upload``, and take what the server sends with its own ``download``."""

    live, shared_base = True, False

    def __init__(self, method):
        self.method = method

    def train(self, round_idx, clients, downloads):
        assert not downloads  # live: every client holds the state already
        return {i: ClientUpdate(self.method.upload(i)) for i in clients}

    def deliver(self, round_idx, downloads):
        return {i: self.method.download(i, d.state).nbytes for i, d in downloads.items()}


def server_in_a_run(name: str, clients, weights):
    """(server state, each client's factors after the round, each replica's W0 after it) of one round of
    ``name`` run by the round protocol of every run (``Server.run_round``) on clients that hold ``clients``
    (module → (A, B)): their uploads (``Method.upload``), the server's aggregate and ``server_update``, and the
    final broadcast through ``Method.download``."""
    ranks = [next(iter(c.values()))[0].shape[0] for c in clients]
    method = build(name, run_options(name, ranks))
    shapes = {m: (b.shape[0], a.shape[1]) for m, (a, b) in clients[0].items()}
    model = stacked_model(shapes, len(clients), method.adapter_kwargs(), 2.0)
    method.setup(model, list(range(len(clients))))
    with torch.no_grad():
        for k, c in enumerate(clients):
            for m, (a, b) in c.items():
                layer = model.get_submodule(m)
                RankSlots.pad_into(layer.lora_A, layer.lora_B, k, a, b)
    federation = Federation(n_groups=1, n_clients=len(clients), client_weights=list(weights))
    server = Server(method, federation, [method.initial_server_state(0)], rounds=1)  # FedSVD's: the frozen A

    server.run_round(Holding(method))
    state = server.states[0]
    got, bases = [], []
    for k, r in enumerate(ranks):
        got.append({m: (model.get_submodule(m).lora_A[k, :r].detach().clone(),
                        model.get_submodule(m).lora_B[k, :, :r].detach().clone()) for m in shapes})
        bases.append({m: model.get_submodule(m).weight for m in shapes})
    return state, got, bases


@pytest.mark.parametrize("name", [n for n in lora_methods() if n != "fedsb"])  # fedsb: its own test below
def test_each_method_equals_its_server_in_a_run(name, adapters, tmp_path):
    """fedlora aggregate on PEFT's own adapters (random init; different ranks where the method takes them)
    gives each client what the same method's server and download give it in a run, bit for bit."""
    dirs = adapters[input_set(name)]
    out = tmp_path / "agg"
    assert main(["aggregate", "--method", name, *dirs, "--weights", ",".join(map(str, WEIGHTS)), "--out", str(out)]) == 0
    clients = [{m: (a, b) for m, (a, b, _) in PeftAdapter.load(d).lora()[0].items()} for d in dirs]
    state, got, bases = server_in_a_run(name, clients, WEIGHTS)

    res = aggregate_adapters(name, dirs, WEIGHTS)
    assert set(res.state) == set(state)
    for key, v in state.items():
        assert torch.equal(res.state[key], v), key
    summary = json.loads((out / "aggregate.json").read_text())
    assert summary["method"] == name and summary["weights"] == pytest.approx([w / 6 for w in WEIGHTS], abs=0)
    delta = res.base_delta
    for k in range(len(dirs)):
        written = PeftAdapter.load(out / f"client_{k}")
        mine = factors_of(written.state_dict)
        if delta:  # the base changed (FLoRA): the run's replica W0 holds it; the adapter written is what was merged
            for m, (a, b) in mine.items():
                assert torch.equal(bases[k][m][k], delta[f"{m}.weight"]), m
                assert torch.equal(a, state[f"{m}.lora_A"]) and torch.equal(b, state[f"{m}.lora_B"])
            continue
        assert set(mine) == set(got[k])
        own = PeftAdapter.load(dirs[k]).lora()[0]
        for m, (a, b) in got[k].items():
            assert torch.equal(mine[m][0], a) and torch.equal(mine[m][1], b), (k, m)
            assert written.lora()[0][m][2] == own[m][2]  # the client's own scale, as its config gives it


def test_fedavg_loaded_back_into_peft_gives_the_weighted_means_exactly(adapters, tmp_path):
    """FedAvg's adapter, loaded by PEFT on the base model, holds Σ p_k A_k and Σ p_k B_k (and the head's mean)."""
    dirs = adapters["head"]
    out = tmp_path / "agg"
    assert main(["aggregate", "--method", "fedavg", *dirs, "--weights", "1,2,3", "--out", str(out)]) == 0
    p = np.array(WEIGHTS) / sum(WEIGHTS)
    inputs = [PeftAdapter.load(d).state_dict for d in dirs]
    loaded = peft.PeftModel.from_pretrained(base_model(), str(out / "client_1"))
    params = dict(loaded.named_parameters())
    saved = PeftAdapter.load(out / "client_1").state_dict
    for key in inputs[0]:
        mean = sum(pk * sd[key].double().numpy() for pk, sd in zip(p, inputs))
        np.testing.assert_allclose(saved[key].double().numpy(), mean, rtol=1e-6, atol=1e-7)
        assert not np.allclose(inputs[0][key].numpy(), mean)  # a real average, not client 0's
        if ".lora_" in key:
            live = params[key.replace(".weight", ".default.weight")]
        else:  # the head: PEFT's modules_to_save copy
            live = params[key.replace("classifier.", "classifier.modules_to_save.default.")]
        assert torch.equal(live.detach(), saved[key]), key  # loaded back exactly as written
    x = torch.randint(0, TINY["vocab_size"], (2, 5))
    assert not torch.allclose(loaded(input_ids=x).logits, base_model()(input_ids=x).logits)


def test_flora_base_delta_is_the_exact_weighted_sum_with_each_clients_own_scale(adapters):
    """FLoRA with different ranks AND scales (rsLoRA, α = 8: s_k = 8/√r_k): base delta = Σ p_k s_k B_k A_k, and
    the stack as one LoRA of rank Σ r_k and scale 1."""
    dirs = adapters["het_scales"]
    res = aggregate_adapters("flora", dirs, WEIGHTS)
    p = np.array(WEIGHTS) / sum(WEIGHTS)
    loaded = [PeftAdapter.load(d).lora()[0] for d in dirs]
    for m in loaded[0]:
        want = sum(pk * s * (b.double() @ a.double()).numpy() for pk, c in zip(p, loaded) for a, b, s in [c[m]])
        np.testing.assert_allclose(res.base_delta[f"{m}.weight"].double().numpy(), want, rtol=1e-5, atol=1e-6)
    stack = factors_of(res.adapters[0].state_dict)
    assert {a.shape[0] for a, _ in stack.values()} == {sum(HET_RANKS)}
    assert res.adapters[0].config["r"] == res.adapters[0].config["lora_alpha"] == sum(HET_RANKS)


def test_flexlora_gives_each_client_its_best_rank_rk_approximation(adapters):
    """FlexLoRA: s_k B'_k A'_k is the rank-r_k truncated SVD of Σ p_k s_k B_k A_k (numpy, float64)."""
    dirs = adapters["het"]
    res = aggregate_adapters("flexlora", dirs, WEIGHTS)
    p = np.array(WEIGHTS) / sum(WEIGHTS)
    loaded = [PeftAdapter.load(d).lora()[0] for d in dirs]
    for m in loaded[0]:
        dw = sum(pk * s * (b.double() @ a.double()).numpy() for pk, c in zip(p, loaded) for a, b, s in [c[m]])
        U, S, Vt = np.linalg.svd(dw)
        for k, r in enumerate(HET_RANKS):
            a, b = factors_of(res.adapters[k].state_dict)[m]
            s = loaded[k][m][2]
            np.testing.assert_allclose(s * (b.double() @ a.double()).numpy(), (U[:, :r] * S[:r]) @ Vt[:r],
                                       rtol=1e-4, atol=1e-5)


def test_hetlora_is_the_norm_weighted_zero_padded_mean(adapters):
    """HetLoRA: A, B zero-padded to r_max and averaged with ‖B_k A_k‖_F / Σ_j ‖B_j A_j‖_F (not the data weights);
    client k receives the first r_k rows / columns."""
    dirs = adapters["het"]
    res = aggregate_adapters("hetlora", dirs, WEIGHTS)
    loaded = [PeftAdapter.load(d).lora()[0] for d in dirs]
    r_max = max(HET_RANKS)
    for m in loaded[0]:
        norms = np.array([np.linalg.norm((c[m][1].double() @ c[m][0].double()).numpy()) for c in loaded])
        q = norms / norms.sum()
        A = sum(qk * np.pad(c[m][0].double().numpy(), ((0, r_max - c[m][0].shape[0]), (0, 0))) for qk, c in zip(q, loaded))
        B = sum(qk * np.pad(c[m][1].double().numpy(), ((0, 0), (0, r_max - c[m][1].shape[1]))) for qk, c in zip(q, loaded))
        for k, r in enumerate(HET_RANKS):
            a, b = factors_of(res.adapters[k].state_dict)[m]
            np.testing.assert_allclose(a.double().numpy(), A[:r], rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(b.double().numpy(), B[:, :r], rtol=1e-6, atol=1e-7)


# -- one-line refusals -------------------------------------------------------------------------------------------
def _refused(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedlora: error:") and "\n" not in err and "Traceback" not in err
    return err


def test_bad_input_is_refused_in_one_line(adapters, tmp_path, capsys):
    het, same, q = adapters["het"], adapters["same"], adapters["query_only"]
    out = str(tmp_path / "o")
    err = _refused(capsys, ["aggregate", "--method", "fedavg", *het, "--weights", "1,1,1", "--out", out])
    assert "fedavg" in err and "rank 2 in client 0 and 4 in client 1" in err and "flexlora" in err
    err = _refused(capsys, ["aggregate", "--method", "fedavg", *same[:2], "--out", out])
    assert "--weights: missing" in err
    err = _refused(capsys, ["aggregate", "--method", "fedavg", *same[:2], "--weights", "1,2,3", "--out", out])
    assert "3 weights for 2 CLIENT_DIRs" in err
    err = _refused(capsys, ["aggregate", "--method", "fedavg", same[0], q[0], "--weights", "1,1", "--out", out])
    assert "lacks" in err and "value" in err and "same modules" in err
    for name in ("pf2lora", "h2tune", "lora-a2"):
        err = _refused(capsys, ["aggregate", "--method", name, *same, "--weights", "uniform", "--out", out])
        assert "needs more than the clients' LoRA factors" in err and "fedavg" in err
    err = _refused(capsys, ["aggregate", "--method", "ffa", *same, "--weights", "uniform", "--out", out])
    assert "lora_A" in err and "frozen and the same on every client" in err
    err = _refused(capsys, ["aggregate", "--method", "hetlora", *adapters["het_scales"], "--weights", "uniform",
                            "--out", out])
    assert "scale" in err
    err = _refused(capsys, ["aggregate", "--method", "fedavg", str(tmp_path), "--weights", "1", "--out", out])
    assert "not a PEFT adapter folder" in err
    (tmp_path / "w.json").write_text(json.dumps({"client0": 3}))
    err = _refused(capsys, ["aggregate", "--method", "fedavg", *same[:2], "--weights-from", str(tmp_path / "w.json"),
                            "--out", out])
    assert "no weight for CLIENT_DIR" in err and "client1" in err
    assert not Path(out).exists() or not any(Path(out).iterdir())  # nothing half-written
    with pytest.raises(Exception, match="weights are missing"):
        aggregate_adapters("fedavg", same, None)
    sd, cfg = PeftAdapter.load(same[0]).state_dict, PeftAdapter.load(same[0]).config
    with pytest.raises(Exception, match="DoRA adapter; only plain LoRA"):
        aggregate_adapters("fedavg", [(sd, {**cfg, "use_dora": True})] * 2, [1, 1])
    for key in ("bert.embeddings.word_embeddings.lora_embedding_A", "bert.encoder.layer.0.attention.self.query.lora_B.bias"):
        extra = {**sd, "base_model.model." + key: torch.zeros(4)}  # LoRA on embeddings, a LoRA bias (lora_bias)
        with pytest.raises(Exception, match="no plain LoRA factor"):
            aggregate_adapters("fedavg", [(extra, cfg)] * 2, [1, 1])


def test_weights_from_a_file_equal_the_same_weights_given_inline(adapters, tmp_path):
    dirs = adapters["same"]
    (tmp_path / "n.json").write_text(json.dumps({Path(d).name: w for d, w in zip(dirs, WEIGHTS)}))
    assert main(["aggregate", "--method", "fedavg", *dirs, "--weights-from", str(tmp_path / "n.json"),
                 "--out", str(tmp_path / "a")]) == 0
    assert main(["aggregate", "--method", "fedavg", *dirs, "--weights", "1,2,3", "--out", str(tmp_path / "b")]) == 0
    a = PeftAdapter.load(tmp_path / "a" / "client_0").state_dict
    b = PeftAdapter.load(tmp_path / "b" / "client_0").state_dict
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "a" / "aggregate.json").read_text())["weights"] == pytest.approx([1 / 6, 2 / 6, 3 / 6])


def test_set_passes_the_methods_options_to_its_server(adapters, tmp_path, capsys):
    """--set reaches the server (LoRA-FAIR without solver steps keeps B̄); a bad option is one line."""
    dirs = adapters["same"]
    out = tmp_path / "fair"
    assert main(["aggregate", "--method", "lora-fair", *dirs, "--weights", "1,2,3", "--set", "server_steps=0",
                 "--out", str(out)]) == 0
    want = aggregate_adapters("fedavg", dirs, WEIGHTS).adapters[0].state_dict
    got = PeftAdapter.load(out / "client_0").state_dict
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert json.loads((out / "aggregate.json").read_text())["options"] == {"server_steps": 0}
    err = _refused(capsys, ["aggregate", "--method", "lora-fair", *dirs, "--weights", "1,2,3", "--set", "nosuch=1",
                            "--out", str(tmp_path / "bad")])
    assert "nosuch" in err and "server_steps" in err


def test_peft_key_is_what_peft_saves(adapters):
    sd = PeftAdapter.load(adapters["same"][0]).state_dict
    assert peft_key("bert.encoder.layer.0.attention.self.query", "lora_A") in sd


def test_a_base_delta_adds_to_a_conv1d_weight_as_it_is_and_equals_peft_merging_the_stack(tmp_path):
    """GPT-2's Conv1D (fan_in_fan_out, weight (d_in, d_out), c_attn not square): FLoRA's base delta is in the
    layer's own layout, and equals what PEFT's merge_and_unload of the written stack adds to the weight."""
    cfg = transformers.GPT2Config(vocab_size=100, n_embd=16, n_layer=1, n_head=2, n_positions=32)

    def gpt2():
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(cfg).eval()

    dirs = []
    for k, r in enumerate([2, 3]):
        torch.manual_seed(k + 1)
        lora = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=["c_attn"], fan_in_fan_out=True,
                               init_lora_weights=False)
        peft.get_peft_model(gpt2(), lora).save_pretrained(str(tmp_path / f"c{k}"))
        dirs.append(str(tmp_path / f"c{k}"))
    out = tmp_path / "agg"
    assert main(["aggregate", "--method", "flora", *dirs, "--weights", "1,3", "--out", str(out)]) == 0
    from safetensors.torch import load_file

    delta = load_file(str(out / "base_delta.safetensors"))
    key = "transformer.h.0.attn.c_attn.weight"
    base = gpt2().state_dict()[key]
    assert set(delta) == {key} and delta[key].shape == base.shape == (16, 48)
    merged = peft.PeftModel.from_pretrained(gpt2(), str(out / "client_0")).merge_and_unload().state_dict()[key]
    torch.testing.assert_close(base + delta[key], merged, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(merged, base, atol=1e-3)


def test_fedex_global_model_is_exactly_the_weighted_sum_of_the_clients(adapters):
    """FedEx-LoRA on PEFT adapters: W0 + Δ_res + s·B̄Ā = W0 + s·Σ p_k B_k A_k (numpy, float64)."""
    if "fedex" not in lora_methods():
        pytest.skip("FedEx-LoRA does not declare Method.lora_upload")
    dirs = adapters["same"]
    res = aggregate_adapters("fedex", dirs, WEIGHTS)
    p = np.array(WEIGHTS) / sum(WEIGHTS)
    loaded = [PeftAdapter.load(d).lora()[0] for d in dirs]
    for m, (a, b) in factors_of(res.adapters[0].state_dict).items():
        s = loaded[0][m][2]
        want = sum(pk * s * (c[m][1].double() @ c[m][0].double()).numpy() for pk, c in zip(p, loaded))
        got = res.base_delta[f"{m}.weight"].double().numpy() + s * (b.double() @ a.double()).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert not np.allclose(s * (b.double() @ a.double()).numpy(), want, atol=1e-4)  # B̄Ā alone is not it


def test_fedsvd_refactorises_the_mean_b_over_the_shared_a(adapters):
    """FedSVD: B'A' = (Σ p_k B_k) A exactly (numpy) and A' has orthonormal rows."""
    if "fedsvd" not in lora_methods():
        pytest.skip("FedSVD does not declare Method.lora_upload")
    dirs = adapters["shared_a"]
    res = aggregate_adapters("fedsvd", dirs, WEIGHTS)
    p = np.array(WEIGHTS) / sum(WEIGHTS)
    loaded = [PeftAdapter.load(d).lora()[0] for d in dirs]
    for m, (a, b) in factors_of(res.adapters[2].state_dict).items():
        mean_b = sum(pk * c[m][1].double().numpy() for pk, c in zip(p, loaded))
        np.testing.assert_allclose((b.double() @ a.double()).numpy(), mean_b @ loaded[0][m][0].double().numpy(),
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose((a.double() @ a.double().T).numpy(), np.eye(a.shape[0]), atol=1e-6)
        assert not torch.equal(a, loaded[0][m][0])  # A was re-factorised, not kept


def test_lora_fair_corrects_b_towards_the_exact_update_with_the_given_options(adapters):
    """LoRA-FAIR: Ā is the mean; (B̄+ΔB)Ā is at least as close in cosine to ΔW = Σ p_k B_k A_k as B̄Ā; the
    server's options reach its solver (no steps: no correction)."""
    if "lora-fair" not in lora_methods():
        pytest.skip("LoRA-FAIR does not declare Method.lora_upload")
    dirs = adapters["same"]
    p = np.array(WEIGHTS) / sum(WEIGHTS)
    loaded = [PeftAdapter.load(d).lora()[0] for d in dirs]
    res = aggregate_adapters("lora-fair", dirs, WEIGHTS, {"server_steps": 20})
    none = aggregate_adapters("lora-fair", dirs, WEIGHTS, {"server_steps": 0})

    def cos(x, y):
        return float((x * y).sum() / np.linalg.norm(x) / np.linalg.norm(y))

    for m, (a, b) in factors_of(res.adapters[0].state_dict).items():
        mean_a = sum(pk * c[m][0].double().numpy() for pk, c in zip(p, loaded))
        mean_b = sum(pk * c[m][1].double().numpy() for pk, c in zip(p, loaded))
        dw = sum(pk * (c[m][1].double() @ c[m][0].double()).numpy() for pk, c in zip(p, loaded))
        np.testing.assert_allclose(a.double().numpy(), mean_a, rtol=1e-6, atol=1e-7)
        a0, b0 = factors_of(none.adapters[0].state_dict)[m]
        np.testing.assert_allclose(b0.double().numpy(), mean_b, rtol=1e-6, atol=1e-7)
        assert cos(dw, (b.double() @ a.double()).numpy()) > cos(dw, mean_b @ mean_a)


def test_state_dicts_with_their_configs_give_what_the_folders_give(adapters, tmp_path):
    """(state_dict, LoraConfig) pairs — what a Flower strategy holds — are aggregated as the saved folders are."""
    dirs = adapters["het"]
    pairs = []
    for d in dirs:
        a = PeftAdapter.load(d)
        pairs.append((a.state_dict, peft.LoraConfig(r=a.config["r"], lora_alpha=a.config["lora_alpha"],
                                                    target_modules=a.config["target_modules"])))
    x, y = aggregate_adapters("flexlora", dirs, WEIGHTS), aggregate_adapters("flexlora", pairs, WEIGHTS)
    for ax, ay in zip(x.adapters, y.adapters):
        assert ax.state_dict.keys() == ay.state_dict.keys()
        assert all(torch.equal(ax.state_dict[k], ay.state_dict[k]) for k in ax.state_dict)
    again = PeftAdapter.load(y.adapters[1].save(tmp_path / "from-pairs"))  # a LoraConfig's enums saved as PEFT does
    assert again.config["peft_type"] == "LORA" and again.lora()[0].keys() == x.adapters[1].lora()[0].keys()
    with pytest.raises(Exception, match="no LoRA config"):
        aggregate_adapters("flexlora", [pairs[0][0], pairs[1][0]], [1, 1])


def test_the_docs_table_names_every_method_that_aggregates_peft_adapters():
    page = (Path(__file__).resolve().parents[1] / "docs" / "how-to" / "aggregate-peft.md").read_text()
    table = page.split("<!-- aggregate-methods -->\n", 1)[1].split("\n\n", 1)[0]
    listed = {line.split("|")[1].strip().strip("`") for line in table.splitlines()[2:]}
    assert listed == set(lora_methods())


def test_per_module_ranks_and_alphas_are_read_and_written_as_peft_patterns(tmp_path):
    """rank_pattern / alpha_pattern give a module its own rank and scale, read as PEFT reads them; FLoRA's stack
    (rank Σ r_k per module, differing between modules) is written with patterns PEFT loads: merged on the base
    it adds the base delta to every module."""
    q, v = "bert.encoder.layer.0.attention.self.query", "bert.encoder.layer.0.attention.self.value"
    dirs = []
    for k, (cfg_kw) in enumerate([dict(r=2, lora_alpha=4, rank_pattern={"value": 3}, alpha_pattern={"value": 9}),
                                  dict(r=4, lora_alpha=8)]):
        torch.manual_seed(k + 1)
        lora = peft.LoraConfig(target_modules=TARGETS, init_lora_weights=False, **cfg_kw)
        peft.get_peft_model(base_model(), lora).save_pretrained(str(tmp_path / f"c{k}"))
        dirs.append(str(tmp_path / f"c{k}"))
    factors = PeftAdapter.load(dirs[0]).lora()[0]
    assert (factors[q][0].shape[0], factors[q][2]) == (2, 2.0) and (factors[v][0].shape[0], factors[v][2]) == (3, 3.0)
    res = aggregate_adapters("flora", dirs, [1, 3])
    out = res.adapters[0].save(tmp_path / "stack")
    stack = factors_of(res.adapters[0].state_dict)
    assert stack[q][0].shape[0] == 6 and stack[v][0].shape[0] == 7
    merged = peft.PeftModel.from_pretrained(base_model(), str(out)).merge_and_unload().state_dict()
    base = base_model().state_dict()
    for m in (q, v):
        torch.testing.assert_close(base[f"{m}.weight"] + res.base_delta[f"{m}.weight"], merged[f"{m}.weight"],
                                   rtol=1e-5, atol=1e-6)


# -- Fed-SB: R folded into lora_B over the frozen B and A every client shares ------------------------------------
FEDSB_R = 4


def fedsb_factors(K: int, seed: int = 7):
    """Per adapted module of the tiny BERT: the frozen A (r, d_in) and B0 (d_out, r, orthonormal columns, as
    LoRA-SB's U_r) every client shares, and each client's trained R_k (r, r) — float32, as a run holds them."""
    g = torch.Generator().manual_seed(seed)
    mods = [f"bert.encoder.layer.0.attention.self.{t}" for t in TARGETS]
    d, r = TINY["hidden_size"], FEDSB_R
    A = {m: torch.randn(r, d, generator=g) for m in mods}
    B0 = {m: torch.linalg.qr(torch.randn(d, r, generator=g, dtype=torch.float64))[0].float() for m in mods}
    Rs = [{m: torch.randn(r, r, generator=g) for m in mods} for _ in range(K)]
    return A, B0, Rs


def save_fedsb_adapters(folder: Path, A, B0, Rs, *, alpha=FEDSB_R, rslora=False, head=False) -> list[str]:
    """PEFT's own adapters (``save_pretrained``) as a Fed-SB client's export writes them: lora_A = A, lora_B =
    B0·R_k (float32), lora_alpha = r (s = 1)."""
    dirs = []
    for k, R in enumerate(Rs):
        cfg = peft.LoraConfig(r=FEDSB_R, lora_alpha=alpha, target_modules=TARGETS, init_lora_weights=False,
                              use_rslora=rslora, modules_to_save=["classifier"] if head else None)
        pm = peft.get_peft_model(base_model(), cfg)
        torch.manual_seed(100 + k)
        with torch.no_grad():
            for m in A:
                layer = pm.base_model.model.get_submodule(m)
                layer.lora_A["default"].weight.copy_(A[m])
                layer.lora_B["default"].weight.copy_(B0[m] @ R[m])
            for n, p in pm.named_parameters():
                if "classifier" in n and "modules_to_save" in n:
                    p.normal_()  # a trained head differs per client
        pm.save_pretrained(str(folder / f"client{k}"))
        dirs.append(str(folder / f"client{k}"))
    return dirs


def fedsb_server_in_a_run(A, B0, Rs, weights):
    """(server state, each replica's lora_A and lora_B) after one training round (index 1: not the
    initialisation round) of Fed-SB run by the round protocol (``Server.run_round``): replica k holds A, the
    frozen B0 and R_k (written by Fed-SB's own ``download``), uploads R_k (``upload``); the server's
    ``aggregate`` and ``server_update``; the broadcast of R̄ through ``download`` (which folds B0·R̄)."""
    K = len(Rs)
    method = build("fedsb", {"rank": FEDSB_R})
    shapes = {m: (B0[m].shape[0], A[m].shape[1]) for m in A}
    model = stacked_model(shapes, K, method.adapter_kwargs(), 1.0)
    method.setup(model, list(range(K)))
    for k, R in enumerate(Rs):
        method.download(k, {**{f"{m}.lora_A": A[m] for m in A}, **{f"{m}.lora_B": B0[m] for m in A},
                            **{f"{m}.lora_R": R[m] for m in A}})
    state0 = {**{f"{m}.lora_A": A[m] for m in A}, **{f"{m}.lora_B": B0[m] for m in A},
              **{f"{m}.lora_R": Rs[0][m] for m in A}}
    server = Server(method, Federation(n_groups=1, n_clients=K, client_weights=list(weights)), [state0], rounds=2)
    method.begin_round(1)
    server.run_round(Holding(method), round_idx=1)
    got = [{m: (model.get_submodule(m).lora_A[k].detach().clone(), model.get_submodule(m).lora_B[k].detach().clone())
            for m in A} for k in range(K)]
    return server.states[0], got


def test_fedsb_on_folded_adapters_equals_its_server_in_a_run(tmp_path):
    """Fed-SB on PEFT adapters holding lora_B = B0·R_k over one A: every client gets A (bit for bit) and
    B0·(Σ p_k R_k) — what Fed-SB's server (its own upload, aggregate, download) gives in a run, within float32
    rounding of the saved folds (rtol 1e-5, atol 1e-6) — and the state's B·R is that fold, its R the run's R̄
    in another basis of B0's columns (B0⁺·B·R = R̄)."""
    A, B0, Rs = fedsb_factors(len(WEIGHTS))
    dirs = save_fedsb_adapters(tmp_path, A, B0, Rs)
    state, got = fedsb_server_in_a_run(A, B0, Rs, WEIGHTS)
    res = aggregate_adapters("fedsb", dirs, WEIGHTS)
    p = np.array(WEIGHTS) / sum(WEIGHTS)
    for m in A:
        R_bar = sum(pk * R[m].double().numpy() for pk, R in zip(p, Rs))  # Fed-SB §3: Σ p_k R_k
        np.testing.assert_allclose(state[f"{m}.lora_R"].double().numpy(), R_bar, rtol=1e-6, atol=1e-7)
        fold = res.state[f"{m}.lora_B"] @ res.state[f"{m}.lora_R"]
        np.testing.assert_allclose(fold.numpy(), B0[m].double().numpy() @ R_bar, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose((torch.linalg.pinv(B0[m].double()) @ fold).numpy(), R_bar, rtol=1e-5, atol=1e-5)
        assert torch.equal(res.state[f"{m}.lora_A"], A[m])
        for k in range(len(dirs)):
            a, b = factors_of(res.adapters[k].state_dict)[m]
            assert torch.equal(a, got[k][m][0]) and torch.equal(a, A[m])
            torch.testing.assert_close(b, got[k][m][1], rtol=1e-5, atol=1e-6)
            assert not torch.allclose(b, B0[m] @ Rs[k][m], atol=1e-3)  # an average, not the client's own fold
        # ΔW = s·B R̄ A with s = 1: the weighted mean of the clients' updates, not B̄Ā of FedAvg's factor means
        dw = sum(pk * (B0[m].double() @ R[m].double() @ A[m].double()).numpy() for pk, R in zip(p, Rs))
        a, b = factors_of(res.adapters[0].state_dict)[m]
        np.testing.assert_allclose((b.double() @ a.double()).numpy(), dw, rtol=1e-5, atol=1e-5)
    assert all(ad.config["r"] == ad.config["lora_alpha"] == FEDSB_R for ad in res.adapters)


def test_fedsb_aggregate_on_the_command_line_writes_peft_adapters_peft_loads(tmp_path):
    """`fedlora aggregate --method fedsb` end to end on PEFT folders (with a trained head, which Fed-SB shares):
    each client_<k>/ holds A and B0·Σ p_k R_k (float32, rtol 1e-5), the head's weighted mean, and PEFT loads it."""
    A, B0, Rs = fedsb_factors(len(WEIGHTS), seed=11)
    dirs = save_fedsb_adapters(tmp_path / "in", A, B0, Rs, head=True)
    out = tmp_path / "agg"
    assert main(["aggregate", "--method", "fedsb", *dirs, "--weights", "1,2,3", "--out", str(out)]) == 0
    summary = json.loads((out / "aggregate.json").read_text())
    assert summary["method"] == "fedsb" and summary["base_delta"] is None
    assert not (out / "base_delta.safetensors").exists()  # Fed-SB leaves the base as it is
    p = np.array(WEIGHTS) / sum(WEIGHTS)
    heads = [PeftAdapter.load(d).state_dict for d in dirs]
    for k in range(len(dirs)):
        written = PeftAdapter.load(out / f"client_{k}")
        assert written.config["r"] == written.config["lora_alpha"] == FEDSB_R and not written.config.get("use_rslora")
        for m, (a, b) in factors_of(written.state_dict).items():
            assert torch.equal(a, A[m])
            want = B0[m].double().numpy() @ sum(pk * R[m].double().numpy() for pk, R in zip(p, Rs))
            np.testing.assert_allclose(b.double().numpy(), want, rtol=1e-5, atol=1e-6)
        for key in (k_ for k_ in written.state_dict if ".lora_" not in k_):
            mean = sum(pk * sd[key].double().numpy() for pk, sd in zip(p, heads))
            np.testing.assert_allclose(written.state_dict[key].double().numpy(), mean, rtol=1e-6, atol=1e-7)
    loaded = dict(peft.PeftModel.from_pretrained(base_model(), str(out / "client_2")).named_parameters())
    saved = PeftAdapter.load(out / "client_2").state_dict
    for key, v in saved.items():
        if ".lora_" in key:
            assert torch.equal(loaded[key.replace(".weight", ".default.weight")].detach(), v), key


def test_fedsb_refuses_adapters_that_are_not_folds_over_one_frozen_b_and_a(tmp_path, capsys):
    """One line each: a client whose lora_A differs (naming the module), a lora_B off the clients' common
    column space (a trained B), a scale other than 1, rsLoRA."""
    A, B0, Rs = fedsb_factors(3)
    out = str(tmp_path / "o")
    other_a = {m: a.clone() for m, a in A.items()}
    q = "bert.encoder.layer.0.attention.self.query"
    other_a[q][0, 0] += 1e-3
    dirs = save_fedsb_adapters(tmp_path / "a", A, B0, Rs[:2]) + save_fedsb_adapters(tmp_path / "a2", other_a, B0, Rs[2:])
    err = _refused(capsys, ["aggregate", "--method", "fedsb", *dirs, "--weights", "uniform", "--out", out])
    assert "fedsb" in err and f"client 2's lora_A of module {q!r} differs" in err and "Fed-SB" in err
    other_b = {m: torch.linalg.qr(torch.randn(b.shape[0], FEDSB_R, dtype=torch.float64))[0].float()
               for m, b in B0.items()}  # a client over another frozen B (or whose B was trained)
    dirs = save_fedsb_adapters(tmp_path / "b", A, B0, Rs[:2]) + save_fedsb_adapters(tmp_path / "b2", A, other_b, Rs[2:])
    err = _refused(capsys, ["aggregate", "--method", "fedsb", *dirs, "--weights", "uniform", "--out", out])
    assert "lora_B" in err and "column space" in err and "ffa" in err
    err = _refused(capsys, ["aggregate", "--method", "fedsb", *save_fedsb_adapters(tmp_path / "s", A, B0, Rs, alpha=8),
                            "--weights", "uniform", "--out", out])
    assert "LoRA scale 2" in err and "s = 1" in err
    err = _refused(capsys, ["aggregate", "--method", "fedsb", *save_fedsb_adapters(tmp_path / "rs", A, B0, Rs, alpha=2,
                                                                                rslora=True),
                            "--weights", "uniform", "--out", out])
    assert "rsLoRA" in err and "fedsb" in err
    assert not Path(out).exists() or not any(Path(out).iterdir())
