"""`fedlora synthetic compare`: a tiny run of every registered method, the documented JSON keys,
determinism, seed independence and one-line CLI errors."""
import json
import math

import pytest

from fedlora.cli import main
from fedlora.errors import ConfigError
from fedlora.methods import available_methods
from fedlora.synthetic.compare import CompareConfig, run_compare
from fedlora.synthetic.data import make_heterogeneous_clients

TINY = dict(heterogeneity=(0.0, 1.0), seeds=2, rounds=2, local_steps=2, clients=2, dim=6, classes=4, rank=2,
            n_train=(12, 16), n_test=20, lr_grid=(0.01, 0.03))
TINY_FLAGS = ["--heterogeneity", "0,1", "--seeds", "2", "--rounds", "2", "--local-steps", "2", "--clients", "2",
              "--dim", "6", "--classes", "4", "--rank", "2", "--n-train", "12,16", "--n-test", "20",
              "--lr-grid", "0.01,0.03"]

TOP_KEYS = {"experiment", "schema_version", "config", "selection", "results", "references", "runs", "timing"}
RESULT_KEYS = {"task", "heterogeneity", "method", "lr", "val_loss_by_lr", "options", "lr_arg", "adapter", "rounds",
               "local_steps", "wall_s", "wall_s_grid", "error", "summary", "seeds"}
SUMMARY_KEYS = {"test_loss_mean", "test_loss_weighted", "rank90_mean", "numerical_rank_mean",
                "bytes_up_per_round_per_client", "bytes_down_per_round_per_client"}
CLIENT_KEYS = {"client", "n_train", "weight", "true_rank", "train_loss", "val_loss", "test_loss", "rank90",
               "numerical_rank", "distance_to_truth", "bytes_up_per_round", "bytes_down_per_round",
               "bytes_up_total", "bytes_down_total"}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    assert main(["synthetic", "compare", "--task", "both", "--out", str(out), *TINY_FLAGS]) == 0
    return out, json.loads((out / "compare.json").read_text())


def test_every_method_writes_the_documented_keys(tiny_run):
    out, res = tiny_run
    assert TOP_KEYS <= set(res) and res["experiment"] == "compare" and res["schema_version"] == 1
    assert (out / "compare.md").read_text().count("| pf2lora |") == 2  # one row per task
    assert (out / "compare.png").stat().st_size > 10_000
    methods = available_methods()
    assert res["config"]["methods"] == methods  # default: every registered method
    seen = {(r["task"], r["heterogeneity"], r["method"]) for r in res["results"]}
    assert seen == {(t, h, m) for t in ("regression", "classification") for h in (0.0, 1.0) for m in methods}
    for r in res["results"]:
        assert RESULT_KEYS <= set(r), r["method"]
        assert r["error"] is None, (r["method"], r["error"])
        assert r["lr"] in (0.01, 0.03) and set(r["val_loss_by_lr"]) == {"0.01", "0.03"}
        keys = SUMMARY_KEYS | ({"test_accuracy_mean", "test_accuracy_weighted"} if r["task"] == "classification" else set())
        assert keys <= set(r["summary"])
        assert len(r["seeds"]) == 2 and [s["seed"] for s in r["seeds"]] == [0, 1]
        for s in r["seeds"]:
            assert len(s["train_loss_per_round"]) == 2
            assert len(s["clients"]) == 2
            for c in s["clients"]:
                assert CLIENT_KEYS <= set(c)
                assert math.isfinite(c["test_loss"]) and c["rank90"] >= 0
                assert len(c["bytes_up_per_round"]) == 2
                silent = r["method"] in ("local", "centralized")  # nothing crosses the network
                assert all((b == 0) if silent else (b > 0) for b in c["bytes_up_per_round"] + c["bytes_down_per_round"])
                if r["task"] == "classification":
                    assert 0 <= c["test_accuracy"] <= 1
            w = [c["weight"] for c in s["clients"]]
            assert w[0] < w[1] and abs(sum(w) - 1) < 1e-12  # w_k ∝ n_k
            manual = sum(c["test_loss"] * c["weight"] for c in s["clients"])
            assert abs(s["test_loss_weighted"] - manual) < 1e-9
    refs = {(r["task"], r["heterogeneity"]) for r in res["references"]}
    assert refs == {(t, h) for t in ("regression", "classification") for h in (0.0, 1.0)}


#: methods whose clients all hold one global model after the download, and those whose clients keep
#: a model of their own (personalised, or HetLoRA's per-client truncation) — every method is one of them
GLOBAL_MODEL = ("centralized", "fedavg", "ffa", "flexlora", "flora", "lora-a2", "rolora", "fedsvd", "fedsb", "fedex", "frlora", "lora-fair")
OWN_MODEL = ("fedsa", "h2tune", "hetlora", "local", "perfedavg", "pf2lora", "feddpa")


def _payload_bytes(**shapes) -> int:
    import torch

    from fedlora.payload import Payload

    return Payload({k: torch.zeros(*v, dtype=torch.float64) for k, v in shapes.items()}).nbytes


def test_every_methods_numbers_mean_what_they_say(tiny_run):
    """Beyond keys: one global model ⇒ identical clients; own models ⇒ clients differ; the bytes per
    round are the serialised sizes of exactly what each method sends (shapes by hand)."""
    _, res = tiny_run
    assert sorted(GLOBAL_MODEL + OWN_MODEL) == available_methods()
    r_ = 2
    for r in res["results"]:
        name, d_in = r["method"], 6
        d_out = 6 if r["task"] == "regression" else 4
        A, B, AB = (_payload_bytes(lora_A=(r_, d_in)), _payload_bytes(lora_B=(d_out, r_)),
                    _payload_bytes(lora_A=(r_, d_in), lora_B=(d_out, r_)))
        per_round = {"fedavg": [AB, AB], "perfedavg": [AB, AB], "pf2lora": [AB, AB], "ffa": [B, B],
                     "fedsa": [A, A], "rolora": [B, A], "frlora": [AB, AB], "feddpa": [AB, AB], "h2tune": [_payload_bytes(lora_R=(1, r_, r_))] * 2,
                     "local": [0, 0], "centralized": [0, 0]}.get(name)
        for s in r["seeds"]:
            cl = s["clients"]
            if per_round is not None:  # no sampling: every client sends and receives the full round
                for c in cl:
                    assert c["bytes_up_per_round"] == per_round and c["bytes_down_per_round"] == per_round, name
            if r["heterogeneity"] == 0.0:  # W_k* = S for every client: equal models ⇔ equal distances
                d = [c["distance_to_truth"] for c in cl]
                assert (d[0] == d[1]) == (name in GLOBAL_MODEL), (name, r["task"], d)
            if name in OWN_MODEL:
                assert cl[0]["test_loss"] != cl[1]["test_loss"]
    # the chosen run's test loss is the one whose validation loss was lowest
    for r in res["results"]:
        scores = {float(k): v for k, v in r["val_loss_by_lr"].items()}
        assert r["lr"] == min(scores, key=lambda k: (scores[k], k)), r["method"]


def test_seed_replicates_are_different_federations_and_the_spread_is_theirs(tiny_run):
    """Each seed is its own draw of the clients (its data, its truth W_k*): the reference of the truth's
    test MSE, recomputed here from each seed's own clients (make_heterogeneous_clients with that seed), has
    the mean ± std over seeds that compare.json reports; every method's clients score differently in the
    two seeds; and each summary's mean ± std is that of the seeds' own values (sample std)."""
    import statistics

    _, res = tiny_run
    c = res["config"]
    for ref in (r for r in res["references"] if r["task"] == "regression"):
        h = ref["heterogeneity"]
        per_seed = []
        for s in range(c["seeds"]):
            clients = make_heterogeneous_clients(
                "regression", c["seed_offset"] + s, h, n_clients=c["clients"], d_in=c["dim"], d_out=c["dim"],
                shared_rank=c["shared_rank"], private_rank=c["private_rank"], n_train=tuple(c["n_train"]),
                n_test=c["n_test"], noise_std=c["noise_std"], singular_value=c["signal"])
            per_seed.append(statistics.fmean(float(((k.X_test @ k.W_star - k.Y_test) ** 2).mean())
                                             for k in clients))
        assert per_seed[0] != per_seed[1]
        assert ref["bayes_test_loss"]["unweighted"]["mean"] == pytest.approx(statistics.fmean(per_seed), rel=1e-9)
        assert ref["bayes_test_loss"]["unweighted"]["std"] == pytest.approx(statistics.stdev(per_seed), rel=1e-9)
    for r in res["results"]:
        a, b = r["seeds"]
        assert all(x["test_loss"] != y["test_loss"] for x, y in zip(a["clients"], b["clients"])), r["method"]
        for metric in ("test_loss", "test_accuracy"):
            if f"{metric}_mean" not in r["summary"]:
                continue
            vals = [statistics.fmean(cl[metric] for cl in s["clients"]) for s in r["seeds"]]
            assert [s[f"{metric}_mean"] for s in r["seeds"]] == pytest.approx(vals, rel=1e-12)
            assert r["summary"][f"{metric}_mean"]["mean"] == pytest.approx(statistics.fmean(vals), rel=1e-12)
            assert r["summary"][f"{metric}_mean"]["std"] == pytest.approx(statistics.stdev(vals), rel=1e-9, abs=1e-15)


def _numbers(res):
    """Everything but wall-clock times."""
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in ("wall_s", "wall_s_grid", "timing", "runs")}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x
    return strip(res)


def test_same_seed_twice_gives_identical_numbers(tiny_run):
    cfg = CompareConfig.from_options(**{**TINY, "tasks": ("regression", "classification")})
    again = json.loads(json.dumps(run_compare(cfg, log=lambda *_: None)))
    assert _numbers(again) == _numbers(tiny_run[1])


def test_a_seed_does_not_depend_on_how_many_seeds_run():
    kw = {**TINY, "heterogeneity": (1.0,), "lr_grid": (0.01,), "tasks": ("regression",)}
    one = run_compare(CompareConfig.from_options(**{**kw, "seeds": 1}), log=lambda *_: None)
    two = run_compare(CompareConfig.from_options(**{**kw, "seeds": 2}), log=lambda *_: None)
    for a, b in zip(one["results"], two["results"]):
        assert a["method"] == b["method"]
        assert _numbers(a["seeds"][0]) == _numbers(b["seeds"][0]), a["method"]
    # seed 1 alone (federation 0 of its stack) equals seed 1 run as federation 1: the methods' own
    # draws (H²Tune's initial R, FLoRA's fresh adapters) follow the seed, not the stack position
    kw["heterogeneity"] = (0.0, 1.0)
    both = run_compare(CompareConfig.from_options(**{**kw, "seeds": 2}), log=lambda *_: None)
    last = run_compare(CompareConfig.from_options(**{**kw, "seeds": 1, "seed_offset": 1}), log=lambda *_: None)
    for a, b in zip(both["results"], last["results"]):
        assert a["method"] == b["method"] and a["heterogeneity"] == b["heterogeneity"]
        assert _numbers(a["seeds"][1]) == _numbers(b["seeds"][0]), (a["method"], a["heterogeneity"])


def test_heterogeneity_zero_means_identical_clients():
    c0 = make_heterogeneous_clients("regression", 3, 0.0, n_clients=3, d_in=6, d_out=6, n_train=(5, 6, 7))
    c1 = make_heterogeneous_clients("regression", 3, 1.0, n_clients=3, d_in=6, d_out=6, n_train=(5, 6, 7))
    assert all((c.W_star == c0[0].W_star).all() for c in c0)
    assert not (c1[0].W_star == c1[1].W_star).all()
    # the same draws for every h: only W_k* changes, X does not
    assert all((a.X_train == b.X_train).all() for a, b in zip(c0, c1))
    lab = make_heterogeneous_clients("classification", 3, 1.0, n_clients=2, d_in=6, d_out=4, n_train=(50, 50))
    assert lab[0].Y_train.dtype.is_floating_point is False and set(lab[0].Y_train.tolist()) <= {0, 1, 2, 3}


def _error(capsys, argv):
    rc = main(["synthetic", "compare", *argv])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("fedlora: error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("argv,match", [
    (["--methods", "fedavg,nope"], "--methods: must be a comma-separated list from "),
    (["--task", "ranking"], "--task: must be regression, classification or both"),
    (["--heterogeneity", "0,-1"], "--heterogeneity"),
    (["--heterogeneity", "0,x"], "comma-separated numbers"),
    (["--seeds", "0"], "--seeds: must be an integer ≥ 1"),
    (["--rounds", "0"], "--rounds"),
    (["--lr-grid", "0.01,-1"], "--lr-grid"),
    (["--clients", "3", "--n-train", "10,20"], "--n-train: must be one integer ≥ 2 per client (3)"),
    (["--rank", "11"], "--rank: must be in [1, dim = 10]"),
    (["--private-rank", "9"], "--private-rank"),
    (["--bogus", "1"], "unrecognized arguments"),
])
def test_bad_flags_exit_2_with_one_line(capsys, argv, match):
    assert match in _error(capsys, argv)


def test_unknown_method_lists_the_allowed_ones(capsys):
    err = _error(capsys, ["--methods", "fedprox"])
    assert all(m in err for m in available_methods())


@pytest.mark.parametrize("cfg,match", [
    ({"method_options": {"pf2lora": {"client_rank": 4}}}, "pf2lora: client_rank r̃ must be an integer with 1 ≤ r̃ < rank r = 4"),
    ({"method_options": {"pf2lora": {"client_rank": 6}}}, "r̃ < r"),
    ({"method_options": {"h2tune": {"densities": [0.5, 1.5, 1, 1]}}}, "densities (β_k) must each be a number in [0, 1]"),
    ({"method_options": {"h2tune": {"densities": [-0.1, 1, 1, 1]}}}, "[0, 1]"),
    ({"method_options": {"fedavg": {"momentum": 0.9}}}, "fedavg: unknown option(s) 'momentum'; allowed: rank, lr"),
    ({"method_options": {"nope": {}}}, "--config: method_options for unknown method(s) 'nope'; methods: "),
    ({"method_options": {"pf2lorra": {}}}, "unknown method(s) 'pf2lorra' (did you mean 'pf2lora'?)"),
    ({"method_options": {"lora-a2": {"client_ranks": [9, 9, 9, 9]}}}, "lora-a2: client_ranks"),
    ({"method_options": {"hetlora": {"r_min": 3, "r_max": 2}}}, "hetlora: need 1 ≤ r_min ≤ r_max"),
    ({"heterogeneity": [0, 0]}, "--heterogeneity: must be a list without repeats"),
    ({"stepsize": 1}, "unknown compare option(s) 'stepsize'; allowed: "),
    # a misspelt key gets the closest option (issue 18 §4), in the file's own spelling or with dashes
    ({"lr_grids": [0.1]}, "unknown compare option(s) 'lr_grids' (did you mean 'lr_grid'?); allowed: "),
    ({"hetrogeneity": [0], "local-step": 2}, "'hetrogeneity' (did you mean 'heterogeneity'?), "
                                             "'local_step' (did you mean 'local_steps'?)"),
    ({"method_options": {"ffa": {"client_ranks": [1, 2, 3, 4]}}}, "ffa: per-client rank budgets (client_ranks) are not supported"),
    ({"sample_fraction": 0}, "--sample-fraction: must be in (0, 1]"),
    ({"sample_fraction": 0.5}, "--sample-fraction: must be 1 when centralized is compared"),
])
def test_bad_config_file_exits_2_with_one_line(capsys, tmp_path, cfg, match):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg))
    assert match in _error(capsys, ["--config", str(path)])


def test_client_sampling_in_compare_counts_only_participants(tmp_path):
    cfg = CompareConfig.from_options(**{**TINY, "methods": ("fedavg", "rolora"), "clients": 4, "n_train": (8, 8, 8, 8),
                                        "sample_fraction": 0.5, "tasks": ("regression",), "lr_grid": (0.01,)})
    res = run_compare(cfg, log=lambda *_: None)
    for r in res["results"]:
        for s in r["seeds"]:
            per_round = [[c["bytes_up_per_round"][t] for c in s["clients"]] for t in range(cfg.rounds)]
            # ⌈0.5·4⌉ = 2 clients upload each round, the other two send nothing
            assert all(sum(b > 0 for b in row) == 2 for row in per_round), (r["method"], per_round)


def test_one_n_train_is_every_clients():
    """One value of a per-client option is every client's (issue 18 §4, as --noise-std in rank-recovery)."""
    cfg = CompareConfig.from_options(methods=("fedavg",), clients=3, n_train=(20,))
    assert cfg.n_train == (20, 20, 20)
    with pytest.raises(ConfigError, match="--n-train: must be one integer ≥ 2 per client"):
        CompareConfig.from_options(methods=("fedavg",), clients=3, n_train=(20, 30))
