"""SecAgg+ for fedlora (issue 29 item 4): which methods it serves (fedlora.secagg's table, checked against each
method's own aggregate), the quantisation bound (against Flower's own quantisation code), the refusal of a value
outside the clipping range, and one Flower simulation (Ray, 3 SuperNodes) in which FedAvg-LoRA's and FFA-LoRA's
uploads go through SecAgg+: an aggregate exists, equals the plain weighted mean within the bound, is the same
to the bit for the same seeds, and the server never receives a client's own arrays."""
import numpy as np
import pytest
import torch

from fedlora.errors import ConfigError
from fedlora.methods.base import available_methods, get_method
from fedlora.payload import Payload
from fedlora.secagg import (REFUSED, SUM_METHODS, SecAggQuantisation, choose_max_weight,
                            flatten_payload, secagg_refusal, secagg_weighting, share_settings, summed_payload)

F64 = torch.float64


# ---------------------------------------------------------------------------------------------------------
# which methods: the table, and the identity it claims
def test_every_registered_method_is_either_served_or_refused_in_one_line():
    names = available_methods()
    assert set(SUM_METHODS) | set(REFUSED) == set(names) and not set(SUM_METHODS) & set(REFUSED)
    for n in names:
        why = secagg_refusal(get_method(n))
        assert (why is None) == (n in SUM_METHODS)
        if why is not None:
            assert "\n" not in why and repr(n) in why and REFUSED[n] in why
    assert secagg_weighting("h2tune") == "uniform" and secagg_weighting("fedavg") == "data"
    with pytest.raises(ConfigError, match="'flexlora'.*own product") as e:
        secagg_weighting("flexlora")
    assert "\n" not in str(e.value)
    assert "not in fedlora.secagg's table" in secagg_refusal("my-plugin")


def _payloads(method: str, K=3, r=3, d_in=7, d_out=5, seed=0):
    """K uploads carrying what ``method``'s aggregate reads (random float64 values)."""
    g = torch.Generator().manual_seed(seed)
    A = lambda: torch.randn(r, d_in, generator=g, dtype=F64)  # noqa: E731
    B = lambda: torch.randn(d_out, r, generator=g, dtype=F64)  # noqa: E731
    if method in ("fedavg", "perfedavg", "frlora", "feddpa", "pf2lora"):
        return [Payload({"l0.lora_A": A(), "l0.lora_B": B(), "l1.lora_A": A(), "l1.lora_B": B()}) for _ in range(K)]
    if method in ("ffa", "rolora", "fedsvd"):
        return [Payload({"l0.lora_B": B()}) for _ in range(K)]
    if method == "fedsa":
        return [Payload({"l0.lora_A": A()}) for _ in range(K)]
    if method == "fedsb":
        return [Payload({"l0.lora_R": torch.randn(r, r, generator=g, dtype=F64)}) for _ in range(K)]
    if method == "fedsb-init":  # the initialisation round: gradients, the rank and lr in clear
        return [Payload({"l0.weight_grad": torch.randn(d_out, d_in, generator=g, dtype=F64)},
                        {"fedsb:rank": str(r), "fedsb:init_lr": "0.5"}) for _ in range(K)]
    if method == "h2tune":
        return [Payload({"q.lora_R": torch.randn(2, r, r, generator=g, dtype=F64)}) for _ in range(K)]
    if method in ("fedex", "flora"):
        return [Payload({"l0.lora_A": A(), "l0.lora_B": B()}, {"scale:l0.lora_A": "2.0"}) for _ in range(K)]
    if method == "flexlora":
        return [Payload({"l0.lora_A": A(), "l0.lora_B": B()}, {"max_rank": str(r), "l0.scale": "2.0"})
                for _ in range(K)]
    if method == "hetlora":
        return [Payload({"l0.lora_A": A(), "l0.lora_B": B()}, {"r_max": str(r)}) for _ in range(K)]
    raise AssertionError(method)


def _presummed(ups, p):
    """The one upload SecAgg+ hands the server: Σ_k p_k T_k (float64), metadata shared in clear."""
    spec = {n: (tuple(t.shape), t.dtype) for n, t in ups[0].tensors.items()}
    names, _ = flatten_payload(ups[0])
    arrays = [sum(float(p[k]) * flatten_payload(u)[1][i] for k, u in enumerate(ups)) for i in range(len(names))]
    s = summed_payload(spec, arrays)
    return Payload(s.tensors, dict(ups[0].meta))


@pytest.mark.parametrize("method", sorted(SUM_METHODS) + ["fedsb-init"])
def test_a_sum_methods_aggregate_of_the_presummed_upload_is_its_aggregate(method):
    """What lets the server consume SecAgg+'s one pre-summed upload: aggregate([Σ p_k T_k], [1]) = aggregate(T, w)."""
    cls = get_method(method.replace("-init", ""))
    ups = _payloads(method)
    w = torch.tensor([0.2, 0.5, 0.3], dtype=F64)
    p = w if secagg_weighting(cls) == "data" else torch.full((3,), 1 / 3, dtype=F64)
    want = cls.aggregate(ups, w)
    got = cls.aggregate([_presummed(ups, p)], torch.ones(1, dtype=F64))
    assert want and sorted(got) == sorted(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("method", ["flexlora", "flora", "hetlora", "fedex"])
def test_a_refused_methods_aggregate_of_the_presummed_upload_is_not_its_aggregate(method):
    """The refusals are not caution: for these the identity fails (each client's own product or factors matter)."""
    cls = get_method(method)
    ups = _payloads(method)
    w = torch.tensor([0.2, 0.5, 0.3], dtype=F64)
    want = cls.aggregate(ups, w)
    got = cls.aggregate([_presummed(ups, w)], torch.ones(1, dtype=F64))
    assert any(got[n].shape != want[n].shape or not torch.allclose(got[n], want[n], rtol=1e-6, atol=1e-6)
               for n in want)


# ---------------------------------------------------------------------------------------------------------
# the bound, against Flower's own quantisation (masks aside: they cancel exactly, the simulation below shows it)
def _flower_mean(xs, weights, quant: SecAggQuantisation, rng_seed=0):
    """Flower 1.42's arithmetic without the masks: secaggplus_mod._collect_masked_vectors's weighting and
    ``quantize``, the sum, and unmask_stage's ``dequantize`` and rescaling (flwr's functions, called here)."""
    from flwr.common.secure_aggregation.quantization import dequantize, quantize

    np.random.seed(rng_seed)
    Q, c = quant.quantization_range, quant.clipping_range
    total_z, total_q = 0, 0
    for x, n in zip(xs, weights):
        q = round(n / quant.max_weight * Q)
        (z,) = quantize([x * (q / Q)], c, Q)
        total_z, total_q = total_z + z.astype(np.int64), total_q + q
    (out,) = dequantize([total_z], c, Q)
    return (out - (len(xs) - 1) * c) * (Q / total_q)


@pytest.mark.parametrize("weights,max_weight,c,Q", [
    ([20, 20, 20], None, 8.0, 2 ** 22),    # Flower's defaults, max_weight chosen
    ([20, 20, 20], 1000.0, 8.0, 2 ** 22),  # Flower's default max_weight: a 50× looser bound
    ([30, 50, 20], None, 1.0, 2 ** 22),    # unequal data sizes, a LoRA-scale clipping range
    ([7, 3, 5, 9], None, 1.0, 2 ** 8),     # a coarse grid: the weights' own quantisation shows
])
def test_the_bound_holds_on_flowers_quantisation_and_is_reached_within_a_factor_of_3(weights, max_weight, c, Q):
    g = np.random.default_rng(1)
    quant = SecAggQuantisation(max_weight=max_weight or choose_max_weight(weights), clipping_range=c, quantization_range=Q)
    X = 0.9 * c  # values (and so weighted values) up to 0.9 c
    xs = [g.uniform(-X, X, size=20000) for _ in weights]
    p = np.array(weights, dtype=np.float64) / sum(weights)
    err = np.abs(_flower_mean(xs, weights, quant) - sum(pk * x for pk, x in zip(p, xs)))
    bound = quant.error_bound(weights, float(max(np.abs(x).max() for x in xs)))
    assert err.max() <= bound
    assert err.max() > bound / 3  # not vacuous: the worst of 20000 coordinates comes within 3× of it


def test_choosing_max_weight_tightens_the_bound_by_the_ratio_of_max_weights():
    w = [20, 20, 20]
    chosen = SecAggQuantisation(max_weight=choose_max_weight(w)).error_bound(w, 0.1)
    default = SecAggQuantisation(max_weight=1000.0).error_bound(w, 0.1)
    assert choose_max_weight(w) == 20.0
    assert default / chosen == pytest.approx(50.0, rel=1e-5)
    assert chosen == pytest.approx(3 * (16 + 0.1) / (3 * 2 ** 22), rel=1e-5)  # (2c + X)/Q with equal sizes


# ---------------------------------------------------------------------------------------------------------
# bad input: one line
def test_a_value_outside_the_clipping_range_is_a_one_line_error_on_the_client():
    from fedlora.flower_secagg import SecAggClient

    q = SecAggQuantisation(max_weight=50.0, clipping_range=1.0)
    q.check_values({"l.lora_B": np.array([0.99, -0.5])}, 50)  # inside: fine
    q.check_values({"l.lora_B": np.array([1.9, -0.5])}, 25)  # weighted by 25/50: 0.95, inside
    with pytest.raises(ConfigError, match=r"'l.lora_B' has a weighted value of magnitude 1.5.*±1") as e:
        q.check_values({"l.lora_B": np.array([0.2, -1.5])}, 50)
    assert "\n" not in str(e.value)
    # the client refuses before Flower's mod could clip it
    cfg = {"provider": "fedlora.flower_secagg:testbed_upload", "method": "fedavg", "n_clients": 3, "seed": 0,
           "weights": "30,50,20", "rounding_seed": 0, "secagg.max_weight": 50.0, "secagg.clipping_range": 0.05,
           "secagg.quantization_range": 2 ** 22, "secagg.modulus_range": 2 ** 32}
    with pytest.raises(ConfigError, match=r"client 1's upload '.*lora_A' has a weighted value of magnitude .*±0.05") as e:
        SecAggClient(1).fit([], cfg)
    assert "\n" not in str(e.value)
    arrays, n, _ = SecAggClient(1).fit([], {**cfg, "secagg.clipping_range": 1.0})
    assert n == 50 and all(a.dtype == np.float64 for a in arrays)


@pytest.mark.parametrize("make,says", [
    (lambda: SecAggQuantisation(max_weight=0), "max_weight: must be a finite number > 0"),
    (lambda: SecAggQuantisation(max_weight=1, clipping_range=-1.0), "clipping_range: must be a finite number > 0"),
    (lambda: SecAggQuantisation(max_weight=1, quantization_range=2 ** 22, modulus_range=3 * 2 ** 22), "power of 2"),
    (lambda: SecAggQuantisation(max_weight=1, quantization_range=2 ** 22).check_clients(1024), "wrap around"),
    (lambda: SecAggQuantisation(max_weight=10).weight_quanta([5, 11]), "max_weight ≥ 11"),
    (lambda: SecAggQuantisation(max_weight=10).weight_quanta([2.5]), "whole number"),
    (lambda: flatten_payload(Payload({"i.indices": torch.arange(3)})), "not a float tensor"),
    (lambda: summed_payload({"a": ((2,), F64)}, [np.zeros(3)]), "shape (3,), expected (2,)"),
    (lambda: share_settings("auto", "auto", 2), "at least 3 clients per round (with 2, each would learn the other's "
                                                "upload from the sum), got 2"),
    (lambda: share_settings(3, 2, 2), "at least 3 clients per round"),
    (lambda: share_settings(2, "auto", 5), "num_shares: 'auto' (every participant, 5) or an integer from 3 to"),
    (lambda: share_settings(6, "auto", 5), "from 3 to the 5 clients of a round, got 6"),
    (lambda: share_settings(True, "auto", 5), "got True"),
    (lambda: share_settings(4, "auto", 7), "below the round's 7 clients it must be odd"),
    (lambda: share_settings("all", "auto", 5), "got 'all'"),
    (lambda: share_settings(5, 5, 5), "reconstruction_threshold: 'auto' (a majority, 3) or an integer from 2 to "
                                      "num_shares − 1 (4), got 5"),
    (lambda: share_settings(3, 1, 5), "got 1"),
    (lambda: share_settings("auto", 2.0, 5), "got 2.0"),
])
def test_bad_settings_are_one_line(make, says):
    with pytest.raises(ConfigError) as e:
        make()
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("k, t, n, expect", [
    ("auto", "auto", 3, (3, 2)), ("auto", "auto", 4, (4, 3)), ("auto", "auto", 10, (10, 6)),
    (5, "auto", 10, (5, 3)), (3, "auto", 9, (3, 2)), (5, 4, 9, (5, 4)), (6, 2, 6, (6, 2)),  # k = N may be even
])
def test_share_settings_default_to_the_complete_graph_and_a_majority_and_keep_what_is_given(k, t, n, expect):
    """Bell et al.'s (k, t): k = N (every participant shares with every other) and t = a majority by default."""
    assert share_settings(k, t, n) == expect


def test_a_method_a_sum_serves_is_not_refused():
    assert secagg_refusal("fedavg") is None and secagg_refusal(get_method("h2tune")) is None
    assert "cannot serve method 'hetlora': its server weights each client" in secagg_refusal("hetlora")


def test_flatten_and_sum_keep_names_shapes_and_dtypes():
    p = Payload({"z.lora_B": torch.ones(2, 3), "a.lora_A": torch.arange(4.0, dtype=F64).reshape(2, 2)})
    names, arrays = flatten_payload(p)
    assert names == ["a.lora_A", "z.lora_B"] and [a.shape for a in arrays] == [(2, 2), (2, 3)]
    back = summed_payload({n: (tuple(t.shape), t.dtype) for n, t in p.tensors.items()}, arrays)
    assert all(torch.equal(back.tensors[n], p.tensors[n]) and back.tensors[n].dtype == p.tensors[n].dtype for n in names)


# ---------------------------------------------------------------------------------------------------------
# one Flower simulation: SecAgg+ with FedAvg-LoRA's and FFA-LoRA's uploads
WEIGHTS = [30, 50, 20]


@pytest.fixture(scope="module")
def secagg_run():
    pytest.importorskip("ray")
    from fedlora.flower_secagg import SecAggRound, SecAggRoundFailed, run_secagg_simulation, testbed_uploads

    quant = SecAggQuantisation(max_weight=choose_max_weight(WEIGHTS), clipping_range=1.0)
    rounds, uploads = [], []
    for method, rounding_seed in (("fedavg", 11), ("ffa", 12), ("fedavg", 11)):  # round 3 repeats round 1's seeds
        ups = testbed_uploads(method, 3, seed=5)
        uploads.append(ups)
        rounds.append(SecAggRound("fedlora.flower_secagg:testbed_upload",
                                  {"method": method, "n_clients": 3, "seed": 5, "weights": ",".join(map(str, WEIGHTS))},
                                  {n: (tuple(t.shape), t.dtype) for n, t in ups[0].tensors.items()}, rounding_seed))
    # round 4: client 2's update blew up beyond the clipping range — refused on the client, the round has no mean
    rounds.append(SecAggRound(rounds[0].provider, {**rounds[0].config, "inflate": 2}, rounds[0].spec, 13))
    with pytest.raises(SecAggRoundFailed) as failed:
        run_secagg_simulation(rounds, 3, quant, timeout=120)
    return quant, uploads, failed.value.done, failed.value.record, str(failed.value)


@pytest.mark.long  # one Ray start (≈ 20 s) for the three tests below
@pytest.mark.xdist_group("secagg")
def test_secagg_gives_an_aggregate_equal_to_the_weighted_mean_within_the_bound(secagg_run):
    quant, uploads, out, record, _ = secagg_run
    assert len(out) == 3 and record.n_results[:3] == [3, 3, 3]  # an aggregate EXISTS for every good round
    p = torch.tensor(WEIGHTS, dtype=F64) / sum(WEIGHTS)
    for ups, agg, method in zip(uploads, out, ("fedavg", "ffa", "fedavg")):
        assert sorted(agg) == sorted(ups[0].tensors) == (["lora_A", "lora_B"] if method == "fedavg" else ["lora_B"])
        for n, got in agg.items():
            xs = [u.tensors[n].to(F64) for u in ups]
            want = sum(p[k] * xs[k] for k in range(3))
            bound = quant.error_bound(WEIGHTS, max(float(x.abs().max()) for x in xs))
            err = float((got - want).abs().max())
            assert 0 < err <= bound, (method, n, err, bound)  # quantised (> 0), and within the bound
            assert not torch.allclose(xs[0], xs[1], atol=100 * bound)  # the clients' uploads do differ
        # the server's aggregate from the pre-summed upload is the embedded run's within the bound
        cls = get_method(method)
        spec = {n: (tuple(t.shape), t.dtype) for n, t in ups[0].tensors.items()}
        summed = summed_payload(spec, [agg[n].numpy() for n in sorted(agg)])
        emb, sec = cls.aggregate(ups, p), cls.aggregate([summed], torch.ones(1, dtype=F64))
        for n in emb:
            bound = quant.error_bound(WEIGHTS, max(float(u.tensors[n].abs().max()) for u in ups))
            ulp = float(torch.finfo(emb[n].dtype).eps * emb[n].abs().max())  # both cast to float32
            assert float((sec[n].to(F64) - emb[n].to(F64)).abs().max()) <= bound + ulp


@pytest.mark.long
@pytest.mark.xdist_group("secagg")
def test_the_same_seeds_give_the_same_aggregate_to_the_bit(secagg_run):
    """Round 3 repeats round 1 (same uploads, same rounding seeds, fresh masks from os.urandom)."""
    _, _, out, _, _ = secagg_run
    assert all(torch.equal(out[0][n], out[2][n]) for n in out[0])


@pytest.mark.long
@pytest.mark.xdist_group("secagg")
def test_the_server_never_receives_an_individual_upload(secagg_run):
    quant, uploads, out, record, _ = secagg_run
    singles = [flatten_payload(u)[1] for ups in uploads for u in ups]
    # every array the server's grid received came as SecAgg+'s masked vectors: no array record at all
    assert [s for s, _, _ in record.replies].count("masked") == 9 + 2 and all(not a for _, a, _ in record.replies)
    ratios = [q / quant.quantization_range for q in quant.weight_quanta(WEIGHTS)]  # y_k = (q_k/Q)·x_k
    for _, _, masked in record.replies:
        for vec in masked[1:]:  # [q_k, z_k per tensor]: read as if unmasked, nothing of any client's y_k
            as_if_plain = vec * quant.step - quant.clipping_range
            for a in [a for x in singles for a in x if a.shape == vec.shape]:
                assert not any(np.allclose(as_if_plain, a * r, atol=2 * quant.step) for r in ratios)
    # the strategy saw only the aggregate: 3 results a round, each carrying the same arrays, none a client's
    assert len(record.strategy_saw) == 9 + 2  # round 4: the 2 good clients' mean, refused by the strategy
    for i, seen in enumerate(record.strategy_saw[:9]):
        agg = [out[i // 3][n].numpy() for n in sorted(out[i // 3])]
        assert all(np.array_equal(a, b) for a, b in zip(seen, agg))
        for x in singles:
            assert not any(a.shape == b.shape and np.allclose(a, b, atol=1e-7) for a, b in zip(seen, x))


@pytest.mark.long
@pytest.mark.xdist_group("secagg")
def test_a_client_value_outside_the_clipping_range_fails_its_round_in_one_line(secagg_run):
    """Flower would clip it silently, or (the client refusing) drop the client and average the others: neither."""
    *_, record, message = secagg_run
    assert record.n_results[3] == 2 and len(record.failures[3]) == 1
    assert message.startswith("secagg: round 4 produced no aggregate (2 of 3 uploads): secagg: client 2's upload "
                              "'lora_A' has a weighted value of magnitude") and "\n" not in message, message


def test_a_clients_error_comes_back_as_its_own_one_line_message():
    """Flower relays a ClientApp's exception as text: a deployment's ``<class …>:<'msg'>``, Ray's remote traceback
    with escaped quotes and newlines (its shape as flwr 1.42 on Ray 2.55 relays it)."""
    from fedlora.flower_secagg import _one_line

    msg = "secagg: client 2's upload 'lora_A' has a weighted value of magnitude 285.4, outside the clipping range ±1"
    esc = msg.replace("'", "\\'")
    ray = (f"Error(code=2, reason='<class \\'ray.exceptions.RayTaskError(ClientAppException)\\'>:<\\'ray::ClientAppActor"
           f".run()\\n  File \"x.py\", line 1, in fit\\n    raise ConfigError(f\"secagg: {{who}}\"\\nfedlora.errors.ConfigError: "
           f"{esc}\\n\\nThe above exception was the direct cause\\nMessage: {esc}\\'>')")
    assert _one_line(ray) == msg
    assert _one_line(f"<class 'fedlora.errors.ConfigError'>:<'{msg}'>") == msg
    assert _one_line("Traceback (most recent call last):\n  File x\nKeyError: 'partition-id'\n") == "KeyError: 'partition-id'"
