"""Communication bytes measured from REAL runs (synthetic runner → fedlora.simulator.run_rounds).

Square layer d_in = d_out = 8, two clients, a few rounds. ``bytes_up`` is what ``run_rounds``
records per round and client (``Payload.nbytes``: the safetensors blob, i.e. tensor data plus a
small JSON header naming the tensors); ``float_bytes`` is the tensor data alone, which is where the
papers' "half the upload" claims are exact.
"""
import pytest

from fedlora.synthetic.compare import method_spec
from fedlora.synthetic.data import make_heterogeneous_clients
from fedlora.synthetic.runner import run_method, stack_federations

D, R, ROUNDS = 8, 4, 4


@pytest.fixture(scope="module")
def data():
    feds = [make_heterogeneous_clients("regression", 0, 0.5, n_clients=2, d_in=D, d_out=D, n_train=(20, 30),
                                       n_test=10, shared_rank=2, private_rank=2)]
    return stack_federations("regression", feds, [0], D)


def _run(name, data, overrides=None):
    spec = method_spec(name, R, 2, overrides)  # the compare harness's per-method config table
    res = run_method(name, data, lr=0.01, rounds=ROUNDS, local_steps=2, options=spec.options,
                     adapter=spec.adapter, lr_arg=spec.lr_arg, record_payloads=True)
    assert res.error is None, res.error
    ups = [p for _, p in res.payloads["up"]]
    assert len(ups) == ROUNDS * 2  # every client uploads once per round
    # the simulator's count is the payload's serialised size, round by round, client by client
    assert [b for rec in res.history for b in rec["bytes_up"]] == [p.nbytes for p in ups]
    return res, ups


def _float_bytes(p):
    return sum(t.numel() * t.element_size() for t in p.tensors.values() if t.is_floating_point())


def _per_round(ups):
    return sorted({p.nbytes for p in ups}), sorted({_float_bytes(p) for p in ups})


@pytest.fixture(scope="module")
def fedavg(data):
    _, ups = _run("fedavg", data, {"rank": R})
    (nb,), (fb,) = _per_round(ups)  # the same every round and client
    assert fb == 2 * R * D * 8  # A (r, d) and B (d, r), float64
    return nb, fb


@pytest.mark.parametrize("name,options", [
    ("rolora", {"rank": R}),
    ("ffa", {"rank": R}),
    ("lora-a2", {"rank": R, "client_ranks": [R, R]}),  # r_i = r_G: every rank selected
])
def test_half_of_fedavg_upload(data, fedavg, name, options):
    nb_fedavg, fb_fedavg = fedavg
    _, ups = _run(name, data, options)
    for p in ups:
        assert 2 * _float_bytes(p) == fb_fedavg  # exactly one factor of a square layer
        # on the wire: half plus the header (names, shapes; LoRA-A²: int64 rank indices, metadata)
        bound = 0.6 if name != "lora-a2" else 0.75
        assert 0.5 * nb_fedavg < p.nbytes < bound * nb_fedavg, (name, p.nbytes, nb_fedavg)


def test_rolora_alternates_b_then_a(data):
    _, ups = _run("rolora", data, {"rank": R})
    shapes = [tuple(next(iter(p.tensors.values())).shape) for p in ups[::2]]  # client 0, rounds 0..3
    assert shapes == [(D, R), (R, D), (D, R), (R, D)]  # B first (B = 0 at init), then A


def test_pf2lora_uploads_exactly_what_fedavg_does(data, fedavg):
    _, ups = _run("pf2lora", data, {"rank": R, "client_rank": 2})
    _, ups_avg = _run("fedavg", data, {"rank": R})
    for p, q in zip(ups, ups_avg):
        assert p.nbytes == q.nbytes == fedavg[0]
        assert {n: tuple(t.shape) for n, t in p.tensors.items()} == {n: tuple(t.shape) for n, t in q.tensors.items()}


def test_h2tune_uploads_only_the_middle_matrix(data):
    _, ups = _run("h2tune", data, {"rank": R})
    L_g = 1  # one adapted layer
    for p in ups:
        (t,) = p.tensors.values()  # one tensor, nothing else leaves the client
        assert t.numel() == L_g * R * R and t.shape[-2:] == (R, R)
        assert _float_bytes(p) == L_g * R * R * 8  # exactly L_g·r_g² float64 entries …
        assert p.nbytes == len(p.to_bytes()) < 0.5 * 648  # … far less than FedAvg-LoRA's A and B


def test_lora_a2_upload_scales_with_client_rank_not_global_rank(data):
    def float_up(r_g, r_i):
        _, ups = _run("lora-a2", data, {"rank": r_g, "client_ranks": [r_i, r_i]})
        (nb,), (fb,) = _per_round(ups)
        return nb, fb

    sizes = {(r_g, r_i): float_up(r_g, r_i) for r_g, r_i in ((4, 1), (4, 2), (4, 4), (8, 2))}
    for (r_g, r_i), (nb, fb) in sizes.items():
        assert fb == D * r_i * 8  # r_i columns of ΔB (rows of ΔA) of a square layer
    assert sizes[(4, 1)][0] < sizes[(4, 2)][0] < sizes[(4, 4)][0]
    assert sizes[(8, 2)] == sizes[(4, 2)]  # doubling r_G at the same budget r_i sends the same bytes


def test_local_and_centralized_send_no_tensors(data):
    for name in ("local", "centralized"):
        _, ups = _run(name, data, {"rank": R})
        assert all(_float_bytes(p) == 0 and not p.tensors for p in ups)
