"""Heterogeneous client models (``federation.client_models``, ``fedlora.llm.hetero``): H²Tune over clients
that fine-tune different base models on different tasks behind one server.

The federation of every test here: clients 0 and 1 classify Debian packages (debian-sections) with a
tiny LLaMA (width 32, 2 blocks); client 2 writes package descriptions (debian-describe, generation) with
a tiny Gemma (width 48, 3 blocks). H²Tune's upload is one aligned (L_g, r_g, r_g) R per shared module type
(q_proj, v_proj), L_g = 3 (the deeper model), whatever the width."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import yaml

from fedlora.errors import ConfigError
from fedlora.cli import main
from fedlora.llm.config import RunConfig, group_configs
from fedlora.llm.hetero import HeteroRun, module_types
from fedlora.llm.runs import run_class
from fedlora.llm.runtime import FederatedRun
from fedlora.llm.slots import SlotExecutor
from fedlora.payload import Payload

RANK = 4
LLAMA = {"name": "meta-llama/Llama-3.2-1B", "target_modules": ["q_proj", "v_proj"],
         "from_config": {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                         "num_key_value_heads": 2, "intermediate_size": 48, "max_position_embeddings": 40,
                         "vocab_size": 30522}}
GEMMA = {"name": "google/gemma-2b", "target_modules": ["q_proj", "v_proj"],
         "from_config": {"model_type": "gemma", "hidden_size": 48, "num_hidden_layers": 3, "num_attention_heads": 2,
                         "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 64,
                         "max_position_embeddings": 48, "vocab_size": 30522}}
TYPES = {"model.layers.*.self_attn.q_proj.lora_R", "model.layers.*.self_attn.v_proj.lora_R"}
CONFIG = {
    "seed": 0,
    "method": {"name": "h2tune", "rank": RANK, "lr": 5e-3},
    "federation": {"clients": 3, "partition": "iid", "client_models": [
        {"clients": [0, 1], "model": LLAMA, "data": {"task": "debian-sections", "max_train_samples": 60,
                                                     "max_test_samples": 30}},
        {"clients": [2], "model": GEMMA, "data": {"task": "debian-describe", "max_train_samples": 40,
                                                  "max_test_samples": 6}}]},
    "train": {"rounds": 2, "local_steps": 2, "batch_size": 4},
    "eval": {"batch_size": 8},
    "tiny": True,
}


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _cfg(tmp: Path, **changes) -> RunConfig:
    data = copy.deepcopy(CONFIG)
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            data.setdefault(section, {})[field] = value
        else:
            data[section] = value
    data["output_dir"] = str(tmp)
    return RunConfig.from_dict(data)


class _Capture:
    """Records what crosses to the server: every ``ClientUpdate`` the run's executor returns."""

    def __init__(self, run: HeteroRun) -> None:
        self.rounds: list[dict] = []
        real = run.local.train

        def train(rnd, clients, downloads):
            res = real(rnd, clients, downloads)
            self.rounds.append(res)
            return res

        run.local.train = train


@pytest.fixture(scope="module")
def hetero(tmp_path_factory):
    out = tmp_path_factory.mktemp("hetero") / "run"
    cfg = _cfg(out)
    run = run_class(cfg)(cfg).prepare()
    cap = _Capture(run)
    summary = run.run()
    return run, cap, summary, out


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]


def test_a_config_with_client_models_is_a_hetero_run_with_one_group_per_model():
    cfg = RunConfig.from_dict(CONFIG)
    assert run_class(cfg) is HeteroRun and run_class(RunConfig.from_dict({"tiny": True})) is FederatedRun
    groups = group_configs(cfg)
    assert [ids for ids, _ in groups] == [[0, 1], [2]]
    (_, a), (_, b) = groups
    assert a.federation.clients == 2 and b.federation.clients == 1 and a.federation.client_models is None
    assert a.model.from_config["model_type"] == "llama" and b.model.from_config["model_type"] == "gemma"
    assert a.data.task == "debian-sections" and b.data.task == "debian-describe"


def test_one_frozen_base_per_distinct_model_not_per_client(hetero):
    """Memory: three clients, two models — the run holds exactly two frozen bases, measured as the
    distinct storages of their frozen weights and their bytes."""
    run, _, _, _ = hetero
    assert len(run.groups) == 2 and run.K_train == 3
    frozen = [{p.data_ptr(): p.numel() * p.element_size() for p in g.model.parameters() if not p.requires_grad}
              for g in run.groups]
    every = {}
    for f in frozen:
        every.update(f)
    assert len(every) == sum(len(f) for f in frozen)  # no storage shared or duplicated between the groups
    assert len({id(g.model) for g in run.groups}) == 2  # two model objects for three clients
    widths = [g.model.config.hidden_size for g in run.groups]
    assert widths == [32, 48] and [g.model.config.num_hidden_layers for g in run.groups] == [2, 3]


def test_every_upload_is_one_aligned_r_g_by_r_g_matrix_per_layer_and_shared_module_type(hetero):
    """The bytes that crossed: per client and round, exactly the shared module types' (L_g, r_g, r_g) R —
    3·4·4 floats per type for the 32-wide 2-block LLaMA clients and the 48-wide 3-block Gemma client alike
    — and the round record's bytes_up are those payloads' bytes."""
    run, cap, _, out = hetero
    recs = [r for r in _records(out) if r["round"] >= 1]
    assert len(cap.rounds) == len(recs) == 2
    for res, rec in zip(cap.rounds, recs):
        assert sorted(res) == rec["participants"] == [0, 1, 2]
        for k, upd in res.items():
            t = upd.upload.tensors
            assert set(t) == TYPES, k
            assert all(tuple(v.shape) == (3, RANK, RANK) and v.dtype == torch.float32 for v in t.values()), k
            assert sum(v.numel() for v in t.values()) == len(TYPES) * 3 * RANK * RANK
            assert rec["bytes_up"][str(k)] == Payload(dict(t)).nbytes
        assert {k: v["layers"] for k, v in rec["ranks"].items()} == {"0": 2, "1": 2, "2": 3}
    # down: nothing before round 1's aggregate exists; in the last round every client takes round 1's R_g with
    # its instructions and the final R_g after it — two (L_g, r_g, r_g) per type, LLaMA and Gemma client alike
    r_g = Payload(dict(run.server.states[0])).nbytes
    assert recs[0]["bytes_down"] == {"0": 0, "1": 0, "2": 0}
    assert recs[1]["bytes_down"] == {"0": 2 * r_g, "1": 2 * r_g, "2": 2 * r_g}


def test_the_server_state_is_the_unweighted_mean_of_the_clients_aligned_uploads(hetero):
    run, cap, _, _ = hetero
    last = cap.rounds[-1]
    state = run.server.states[0]
    assert set(state) == TYPES
    for name in TYPES:
        mean = torch.stack([last[k].upload.tensors[name] for k in (0, 1, 2)]).mean(0)
        torch.testing.assert_close(state[name], mean, rtol=1e-6, atol=1e-7)
    # every client ends holding that state as its KL target (the final broadcast), whatever its model
    for k in range(3):
        rec = run.local.records()[k]
        for name in TYPES:
            t = name[: -len(".lora_R")]
            assert torch.equal(rec[f"extra:global_R:{t}"], state[name]), (k, name)


def test_layer_alignment_maps_each_clients_depth_onto_the_global_layers(hetero):
    """Ω_k ∈ R^{L_k×L_g}: (2, 3) for the LLaMA clients, (3, 3) for the Gemma client (L_g = 3)."""
    run, _, _, out = hetero
    assert run.global_layers == 3 and run.depths == [2, 3]
    for k, (L_k, group) in {0: (2, 0), 1: (2, 0), 2: (3, 1)}.items():
        omega = run.local.records()[k]["extra:omega"]
        assert tuple(omega.shape) == (L_k, 3), k
    resolved = json.loads((out / "config.json").read_text())["resolved"]
    assert resolved["heterogeneous"] and resolved["global_layers"] == 3
    assert resolved["upload"] == {n: [3, RANK, RANK] for n in sorted(TYPES)}
    assert [g["client_layers"] for g in resolved["groups"]] == [[2, 2], [3]]


def test_each_client_is_scored_on_its_own_task_and_means_are_per_task(hetero):
    run, _, summary, out = hetero
    for rec in [r for r in _records(out) if "eval" in r]:
        ev = rec["eval"]
        assert "test" not in ev  # no mean across tasks whose metrics differ
        sections, describe = ev["tasks"]["debian-sections"], ev["tasks"]["debian-describe"]
        assert sections["clients"] == [0, 1] and describe["clients"] == [2]
        assert sections["main_metric"] == "accuracy" and describe["main_metric"] == "bleu"
        for k in (0, 1):
            assert "accuracy" in ev["clients"][str(k)]["test"] and "bleu" not in ev["clients"][str(k)]["test"]
        assert "bleu" in ev["clients"]["2"]["test"]
        acc = [ev["clients"][str(k)]["test"]["accuracy"] for k in (0, 1)]
        assert sections["test"]["mean"]["accuracy"] == pytest.approx(sum(acc) / 2, rel=1e-12)
        assert describe["test"]["mean"]["bleu"] == ev["clients"]["2"]["test"]["bleu"]
    assert set(summary["tasks"]) == {"debian-sections", "debian-describe"}
    assert summary["groups"][1] == {"clients": [2], "model": "google/gemma-2b", "task": "debian-describe"}
    assert sorted(p.name for p in (out / "adapters").iterdir()) == [f"client_{k}.safetensors" for k in range(3)]
    assert (out / "rounds.png").stat().st_size > 0 and json.loads((out / "run.json").read_text())["status"] == "complete"


def _weighted(values, sizes):
    return sum(v * n for v, n in zip(values, sizes)) / sum(sizes)


def test_per_task_weighted_means_weight_each_client_by_its_own_rows(hetero):
    """eval["tasks"][task]: "weighted_mean" = Σ n_k m_k / Σ n_k over the task's clients, n_k the client's
    own test rows for the test summary and its own validation rows for the validation one — recomputed
    from the per-client values of the same record. The two classifying clients hold 14 and 16 test rows
    (unequal, so a wrong weight shows), and score differently in some round."""
    run, _, _, out = hetero
    g0 = run.groups[0]
    n_test, n_val = [len(c.test) for c in g0.clients], [len(c.val) for c in g0.clients]
    assert n_test[0] != n_test[1] and min(n_val) > 0
    differ = False
    for rec in [r for r in _records(out) if "eval" in r]:
        ev = rec["eval"]
        sections = ev["tasks"]["debian-sections"]
        for split, sizes in (("test", n_test), ("val", n_val)):
            acc = [ev["clients"][str(k)][split]["accuracy"] for k in (0, 1)]
            differ |= acc[0] != acc[1]
            assert sections[split]["weighted_mean"]["accuracy"] == pytest.approx(_weighted(acc, sizes), rel=1e-12)
            assert sections[split]["mean"]["accuracy"] == pytest.approx(sum(acc) / 2, rel=1e-12)
        bleu = ev["clients"]["2"]["test"]["bleu"]
        assert ev["tasks"]["debian-describe"]["test"]["weighted_mean"]["bleu"] == pytest.approx(bleu, rel=1e-12)
    assert differ  # else the weights could not show


def test_each_adapter_file_is_its_own_clients_record(hetero):
    """adapters/client_<k>.safetensors: client k's own tensors — equal to its record in its group's client
    store (A_k, B_k, R … never leave the client, so no two clients share them) and not another client's of
    the same model — with its own id, group and model in the metadata."""
    from safetensors import safe_open

    run, _, _, out = hetero
    files = {}
    for k in range(3):
        with safe_open(str(out / "adapters" / f"client_{k}.safetensors"), framework="pt") as f:
            files[k] = (f.metadata(), {n: f.get_tensor(n) for n in f.keys()})
    for k, (meta, tensors) in files.items():
        g = run.where[k][0]
        assert (meta["client"], meta["group"], meta["model"]) == (str(k), str(g), (LLAMA, GEMMA)[g]["name"])
        rec = {n.split(":", 1)[1]: v for n, v in run.local.records()[k].items() if n.startswith(("param:", "buffer:"))}
        assert tensors and all(torch.equal(v, rec[n]) for n, v in tensors.items()), k
    t0, t1 = files[0][1], files[1][1]  # the two LLaMA clients: same names, different tensors
    assert t0.keys() == t1.keys() and any(not torch.equal(t0[n], t1[n]) for n in t0)


def _draw(seed: int, rnd: int, n: int, m: int) -> list[int]:
    """The documented client draw (fedlora.server.Federation), written out: a seeded permutation per round."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + rnd) * 7_919 + 0)
    return sorted(torch.randperm(n, generator=g)[:m].tolist())


def test_the_participant_draw_follows_the_runs_seed_across_groups(tmp_path):
    """One draw among all clients, from the run's seed: at seed 3 (not the default 0) the server's
    participants of every round are the documented draw with seed 3 — and differ from seed 0's, so the seed
    reaches it; the Federation draw itself matches the written-out draw for several seeds."""
    from fedlora.server import Federation

    for seed in (0, 1, 3, 7, 12):
        fed = Federation(n_groups=1, n_clients=3, sample_fraction=0.5, sample_seed=seed)
        assert [fed.participants(r, 0) for r in range(10)] == [_draw(seed, r, 3, 2) for r in range(10)], seed
    run = HeteroRun(_cfg(tmp_path / "s", seed=3, federation__sample_fraction=0.5), write=False).prepare()
    drawn = [run.server.participants(r) for r in range(10)]
    assert drawn == [_draw(3, r, 3, 2) for r in range(10)]
    assert drawn != [_draw(0, r, 3, 2) for r in range(10)]


def test_the_first_kl_target_is_the_mean_of_every_clients_initial_upload(tmp_path):
    """Before round 1 every client — LLaMA or Gemma — holds the same R_g: the mean over all three clients,
    not its own group's (the Gemma client's third layer makes the two groups' own means differ)."""
    cfg = _cfg(tmp_path / "r")
    run = HeteroRun(cfg, write=False).prepare()
    # the initial R is seeded identically on every client: layer l of a type alike in both models
    recs = [run.local.records()[k] for k in range(3)]
    for proj in ("q_proj", "v_proj"):
        for layer in (0, 1):
            name = f"param:model.layers.{layer}.self_attn.{proj}.lora_R"
            assert float(recs[0][name].abs().sum()) > 0
            assert torch.equal(recs[0][name], recs[2][name]) and torch.equal(recs[1][name], recs[2][name]), name
    targets = [{n: run.local.records()[k][f"extra:global_R:{n[:-len('.lora_R')]}"] for n in TYPES} for k in range(3)]
    for k in (1, 2):
        for n in TYPES:
            assert torch.equal(targets[k][n], targets[0][n]), (k, n)
    # and it is not group 0's own mean: its uploads have nothing in global layer 2, the Gemma client's do
    g0 = run.groups[0]
    g0.slots._bind([0, 1])
    g0.slots._load([0, 1])
    own = {n: torch.stack([g0.method.upload(i).tensors[n] for i in (0, 1)]).mean(0) for n in TYPES}
    assert all(float(own[n][2].abs().sum()) == 0.0 for n in TYPES)
    assert any(float(targets[0][n][2].abs().sum()) > 0.0 for n in TYPES)


def test_a_group_may_split_its_data_its_own_way(tmp_path):
    data = copy.deepcopy(CONFIG)
    data["federation"]["client_models"][1]["partition"] = "by_key(section)"
    (_, a), (_, b) = group_configs(RunConfig.from_dict(data))
    assert a.federation.partition == "iid" and b.federation.partition == "by_key(section)"
    data["federation"]["client_models"][0]["partition"] = "bogus(1)"
    _refused(data, r"federation.client_models\[0\]: federation.partition")


def test_per_client_options_go_to_each_clients_group(tmp_path):
    cfg = _cfg(tmp_path / "d", method={"name": "h2tune", "rank": RANK, "lr": 5e-3,
                                       "options": {"densities": [1.0, 0.5, 0.25]}})
    (_, a), (_, b) = group_configs(cfg)
    assert a.method.options["densities"] == [1.0, 0.5] and b.method.options["densities"] == [0.25]
    with pytest.raises(ConfigError, match=r"method.options.densities: one entry per client \(3\), got 2"):
        _cfg(tmp_path / "d2", method={"name": "h2tune", "rank": RANK, "options": {"densities": [1.0, 0.5]}})


def test_with_client_sampling_only_the_drawn_clients_train_and_a_seed_gives_the_same_run(tmp_path):
    runs = []
    for name in ("a", "b"):
        cfg = _cfg(tmp_path / name, federation__sample_fraction=0.5)
        summary = HeteroRun(cfg).run()
        runs.append((_records(tmp_path / name), summary))
    recs = runs[0][0]
    for rec in recs[1:]:
        assert len(rec["participants"]) == 2
        assert sorted(rec["train_loss"]) == sorted(map(str, rec["participants"])) == sorted(rec["bytes_up"])
    from fedlora.server import Federation

    drawn = Federation(n_groups=1, n_clients=3, sample_fraction=0.5, sample_seed=0)  # one draw across groups
    assert [r["participants"] for r in recs[1:]] == [drawn.participants(r, 0) for r in range(2)]
    strip = [[{k: v for k, v in r.items() if k != "wall_s"} for r in recs] for recs, _ in runs]
    assert json.dumps(strip[0]) == json.dumps(strip[1])


def test_an_interrupted_hetero_run_resumes_to_the_uninterrupted_result(tmp_path, monkeypatch, capsys):
    whole = tmp_path / "whole"
    cfg = _cfg(whole, train={"rounds": 3, "local_steps": 2, "batch_size": 4})
    HeteroRun(cfg).run()
    stopped = tmp_path / "stopped"
    real = SlotExecutor.train_pass

    def train_pass(self, clients, rnd, *a, **k):  # Ctrl-C while the Gemma group trains round 3
        if rnd == 2 and self.task.name == "debian-describe":
            raise KeyboardInterrupt
        return real(self, clients, rnd, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(SlotExecutor, "train_pass", train_pass)
        with pytest.raises(KeyboardInterrupt):
            HeteroRun(_cfg(stopped, train={"rounds": 3, "local_steps": 2, "batch_size": 4})).run()
    assert json.loads((stopped / "run.json").read_text())["status"] == "interrupted"
    assert main(["run", "--resume", str(stopped), "--no-progress"]) == 0
    a, b = _records(whole), _records(stopped)
    drop = lambda r: json.dumps({k: v for k, v in r.items() if k != "wall_s"})  # noqa: E731
    assert [drop(r) for r in a] == [drop(r) for r in b]
    from safetensors.torch import load_file

    for k in range(3):
        ta, tb = load_file(whole / "adapters" / f"client_{k}.safetensors"), load_file(stopped / "adapters" / f"client_{k}.safetensors")
        assert ta.keys() == tb.keys() and all(torch.equal(ta[n], tb[n]) for n in ta)


def test_the_command_line_runs_a_hetero_config_and_reports_each_task(tmp_path, capsys):
    path = tmp_path / "het.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    assert main(["run", str(path), "--out", str(tmp_path / "o"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "clients [2]: google/gemma-2b on debian-describe" in out
    assert "debian-sections test accuracy (mean of clients [0, 1]): round 0" in out
    # without a progress bar one line per round, with each task's clients' mean test main metric
    lines = [ln for ln in out.splitlines() if ln.startswith("round ")]
    recs = _records(tmp_path / "o")[1:]
    assert len(lines) == len(recs) == 2
    for line, rec in zip(lines, recs):
        tasks = rec["eval"]["tasks"]
        want = ", ".join(f"{name} test {t['main_metric']} {t['test']['mean'][t['main_metric']]:.4f}"
                         for name, t in tasks.items())
        assert f"round {rec['round']}/2: training loss " in line and want in line and len(tasks) == 2, line
    assert main(["run", str(path), "--dry-run"]) == 0
    dry = json.loads(capsys.readouterr().out)
    groups = dry["resolved"]["data"]["groups"]
    assert [g["clients"] for g in groups] == [[0, 1], [2]] and groups[1]["task"] == "debian-describe"


# --------------------------------------------------------------------------------------------------
# bad input: one line, before any training
def _refused(data: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as e:
        RunConfig.from_dict(data)
    assert "\n" not in str(e.value)


def test_other_methods_are_refused_naming_h2tune():
    for method in ("fedavg", "pf2lora", "lora-a2"):
        _refused({**CONFIG, "method": {"name": method}}, r"federation.client_models: .*H²Tune \(method.name: h2tune\)")


@pytest.mark.parametrize("groups, match", [
    ([{"clients": [0, 1], "model": LLAMA}, {"clients": [1, 2], "model": GEMMA}], r"client 1 is already in group 0"),
    ([{"clients": [0, 1], "model": LLAMA}], r"client\(s\) \[2\] are in no group"),
    ([{"clients": [0, 1, 5], "model": LLAMA}, {"clients": [2]}], r"client 5 is not one of the federation's clients 0..2"),
    ([{"clients": [0, 1], "modle": LLAMA}, {"clients": [2]}], r"\[0\]: unknown key 'modle' \(did you mean 'model'"),
    ([{"clients": [], "model": LLAMA}], r"\[0\].clients: expected a non-empty list"),
    ([{"clients": [0, 1, 2], "model": {**LLAMA, "dtype": "float8"}}], r"\[0\]: model.dtype"),
    ("llama", r"expected a non-empty list of groups"),
])
def test_bad_groups_are_refused_in_one_line(groups, match):
    data = copy.deepcopy(CONFIG)
    data["federation"]["client_models"] = groups
    _refused(data, match)


def test_groups_that_adapt_different_module_types_are_refused(tmp_path):
    data = copy.deepcopy(CONFIG)
    data["federation"]["client_models"][1]["model"] = {"name": "gpt2", "target_modules": ["c_attn"]}
    data["output_dir"] = str(tmp_path / "x")
    with pytest.raises(ConfigError, match=r"group 0 adapts \['model.layers.\*.self_attn.q_proj', .*group 1 adapts "
                                          r"\['transformer.h.\*.attn.c_attn'\]"):
        HeteroRun(RunConfig.from_dict(data), write=False).prepare()


def test_flower_and_compare_refuse_hetero_runs(tmp_path, capsys):
    cfg = _cfg(tmp_path / "f")
    with pytest.raises(ConfigError, match="--runtime flower: federation.client_models: heterogeneous client models "
                                          "run on the embedded runtime only"):
        HeteroRun(cfg, runtime="flower")
    with pytest.raises(ConfigError, match="^federation.client_models: heterogeneous client models run on the embedded"):
        FederatedRun(cfg)  # e.g. a Flower node or ServerApp building one model from such a config
    path = tmp_path / "het.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    for argv in (["run", str(path), "--runtime", "flower", "--out", str(tmp_path / "o1")],
                 ["flower", "app", str(path), "--out", str(tmp_path / "app")],
                 ["flower", "local", str(path), "--out", str(tmp_path / "o2")]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "heterogeneous client models run on the embedded runtime only" in err and err.count("\n") == 1, argv
        assert not (tmp_path / "app").exists()
    from fedlora.llm.compare import run_compare

    with pytest.raises(ConfigError, match="compare: federation.client_models"):
        run_compare(str(path), [], ["h2tune"], {"h2tune": [1e-3]}, 1, tmp_path / "c")


def test_module_types_replace_layer_indices():
    assert module_types(["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj", "score"]) == \
        {"model.layers.*.self_attn.q_proj": 2, "score": 1}


def test_each_group_is_sent_what_its_clients_lack_by_their_global_ids(tmp_path):
    """The server sends evaluation downloads by run-wide client id, and the heterogeneous executor hands each
    to its group's local client: once client 2 (the Gemma group's local client 0) is synchronised it is sent
    nothing, while client 0 (the LLaMA group's local client 0) still lacks the round's R_g."""
    cfg = _cfg(tmp_path / "s", train={"rounds": 3, "local_steps": 1, "batch_size": 4})
    run = HeteroRun(cfg, write=False).prepare()
    run.driver.run_round(0)
    sent = run.server.evaluation_downloads(range(3), run.local)
    for k in range(3):
        assert sorted(sent[k].state) == sorted(TYPES) and not sent[k].counted, k
        for n, v in sent[k].state.items():
            assert torch.equal(v, run.server.states[0][n])
    run.server.ledgers[0].sync(2, 0)  # client 2 (the Gemma group's local client 0) synchronised
    assert run.server.synced(2) == 0 and run.server.synced(0) == -1
    sent = run.server.evaluation_downloads(range(3), run.local)
    assert sent[2].state == {} and sorted(sent[0].state) == sorted(TYPES)
    seen = {}  # what each group's slot executor is handed, under its local ids
    for g, (_, ex) in enumerate(run.local.groups):
        def spy(rnd, clients, downloads, g=g, real=ex.evaluate):
            seen[g] = (list(clients), {i: sorted(d.state) for i, d in downloads.items()})
            return real(rnd, clients, downloads)

        ex.evaluate = spy
    run.local.evaluate(0, [0, 1, 2], sent)
    assert seen == {0: ([0, 1], {0: sorted(TYPES), 1: sorted(TYPES)}), 1: ([0], {0: []})}


def test_exports_give_each_client_its_own_base_model_as_the_run_evaluated_it(hetero, tmp_path):
    """`fedlora export` of a client: its group's base model (LLaMA classifier for clients 0, 1; Gemma causal
    LM for client 2) with its adapter — PEFT and merged give the logits the run computed on its test rows,
    and the classifiers the accuracy the run reported."""
    import transformers
    from peft import PeftModel

    from fedlora.llm.export import export_merged, export_peft, load_run_base_model
    from fedlora.llm.runfolder import client_view

    run, _, summary, out = hetero
    info = json.loads((out / "config.json").read_text())
    for k, auto in ((0, transformers.AutoModelForSequenceClassification), (1, None),
                    (2, transformers.AutoModelForCausalLM)):
        g, local = run.where[k]
        grp = run.groups[g]
        rows = torch.as_tensor(grp.clients[local].test)
        batch = grp.slots._rows(grp.enc_test, rows)
        inputs = {n: v for n, v in batch.items() if n not in grp.task.label_keys}
        grp.slots._bind([local])
        grp.model.eval()
        grp.slots._load([local])
        grp.slots._apply(0, run.server.download_for(k, shared_base=True))  # what client k lacks, by its run-wide id
        with torch.no_grad():
            ours = grp.slots._forward(None, batch).float()
        view = client_view(info, k)
        assert view["config"]["model"]["name"] == (LLAMA if g == 0 else GEMMA)["name"]
        base, _ = load_run_base_model(view)
        peft_model = PeftModel.from_pretrained(base, str(export_peft(out, k, tmp_path / f"peft{k}"))).eval()
        exported = [("peft", peft_model)]
        if auto is not None:
            exported.append(("merged", auto.from_pretrained(str(export_merged(out, k, tmp_path / f"merged{k}"))).eval()))
        for name, model in exported:
            with torch.no_grad():
                theirs = model(**inputs).logits.float()
            torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5, msg=f"client {k} {name}")
            if g == 0:
                acc = float((theirs.argmax(-1).cpu() == batch["labels"].cpu()).double().mean())
                assert acc == summary["final_clients"][str(k)]["test"]["accuracy"], (k, name)


def test_the_table_3_config_gives_each_client_its_model_task_and_density():
    from fedlora.llm.config import load_config

    cfg = load_config("h2tune-hetero")
    assert cfg.method.rank == 128 and cfg.method.options["omega_init"] == "random"
    groups = group_configs(cfg)
    assert [(ids, c.model.name, c.data.task, c.method.options["densities"]) for ids, c in groups] == [
        ([0], "meta-llama/Llama-3.2-3B", "glue/sst2", [(16 / 128) ** 2]),
        ([1], "google/gemma-2b", "glue/qqp", [(64 / 128) ** 2]),
        ([2], "HuggingFaceTB/SmolLM-1.7B", "glue/qnli", [1.0])]
    assert all(c.model.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
               for _, c in groups)
    tiny = load_config("h2tune-hetero", ["tiny=true"])  # r_g = 128 does not fit a 16-wide tiny projection
    assert tiny.method.rank == 16 and all(c.method.rank == 16 for _, c in group_configs(tiny))
    assert [c.model.from_config["model_type"] for _, c in group_configs(tiny)] == ["llama", "gemma", "llama"]


def test_fedlora_plot_refuses_a_hetero_run_in_one_line(hetero, tmp_path, capsys):
    _, _, _, out = hetero
    assert main(["plot", str(out), "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert "federates clients on different tasks" in err and err.count("\n") == 1


def test_a_failing_client_is_named_by_its_run_id_and_left_out_of_the_mean(tmp_path):
    """A client of the Gemma group that raises (client 2 = its group's local client 0) is recorded as client 2's
    failure; the server averages the two LLaMA clients' uploads alone."""
    cfg = _cfg(tmp_path / "x", train={"rounds": 1, "local_steps": 1, "batch_size": 4})
    run = HeteroRun(cfg).prepare()
    cap = _Capture(run)

    def hook(client, rnd):
        if client == 2:
            raise RuntimeError("CUDA out of memory")

    run.local.client_hook = hook
    run.run()
    rec = _records(tmp_path / "x")[1]
    assert rec["failures"] == {"2": {"kind": "error", "why": "RuntimeError: CUDA out of memory"}}
    assert sorted(rec["bytes_up"]) == ["0", "1"]
    for name in TYPES:
        mean = torch.stack([cap.rounds[0][k].upload.tensors[name] for k in (0, 1)]).mean(0)
        torch.testing.assert_close(run.server.states[0][name], mean, rtol=1e-6, atol=1e-7)


def test_groups_sharing_a_task_are_one_task_and_its_metrics_not_computed_are_named(tmp_path):
    """Two models on debian-sections and one on debian-describe: two tasks, the classifiers' mean over both
    models' clients, and what the generation task could not compute (METEOR without WordNet) named under it."""
    data = copy.deepcopy(CONFIG)
    data["federation"]["client_models"] = [
        {"clients": [0], "model": LLAMA, "data": CONFIG["federation"]["client_models"][0]["data"]},
        {"clients": [1], "model": {**GEMMA, "from_config": {**GEMMA["from_config"], "num_hidden_layers": 2}},
         "data": {**CONFIG["federation"]["client_models"][0]["data"], "max_test_samples": 12}},
        CONFIG["federation"]["client_models"][1]]
    data["train"] = {"rounds": 1, "local_steps": 1, "batch_size": 4}
    data["output_dir"] = str(tmp_path / "t")
    run = HeteroRun(RunConfig.from_dict(data))
    summary = run.run()
    assert summary["tasks"]["debian-sections"]["clients"] == [0, 1]
    assert summary["tasks"]["debian-describe"]["clients"] == [2]
    # the shared task's mean weights each client by its own group's test rows (30 and 12: each group
    # splits its own data), from the per-client values
    sizes = [len(run.groups[g].clients[0].test) for g in (0, 1)]
    acc = [summary["final_clients"][str(k)]["test"]["accuracy"] for k in (0, 1)]
    assert sizes[0] != sizes[1] and acc[0] != acc[1], (sizes, acc)
    assert summary["tasks"]["debian-sections"]["final_test"]["weighted_mean"]["accuracy"] == \
        pytest.approx(_weighted(acc, sizes), rel=1e-12)
    describe = run.groups[2].task.not_computed
    assert summary.get("metrics_not_computed", {}) == ({"debian-describe": describe} if describe else {})
