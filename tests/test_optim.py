"""StackedAdamW: torch's AdamW per replica, with a step count per replica (client sampling)."""
import torch

from fedlora.methods import create_method
from fedlora.adapter import LoRALinear
from fedlora.optim import StackedAdamW
from fedlora.simulator import Federation, run_rounds


def test_equals_torch_adamw_when_all_replicas_step_together():
    g = torch.Generator().manual_seed(0)
    a = torch.nn.Parameter(torch.randn(4, 3, 5, generator=g, dtype=torch.float64))
    b = torch.nn.Parameter(a.detach().clone())
    ref = torch.optim.AdamW([a], lr=0.01, weight_decay=0.1, foreach=False)
    ours = StackedAdamW([b], lr=0.01, weight_decay=0.1)
    for _ in range(30):
        grad = torch.randn(a.shape, generator=g, dtype=torch.float64)
        a.grad, b.grad = grad.clone(), grad.clone()
        ref.step()
        ours.step()
    torch.testing.assert_close(b, a, rtol=1e-13, atol=1e-15)
    assert ours.state[b]["step"].tolist() == [30.0] * 4


def test_a_replica_with_fresh_state_takes_a_first_adam_step():
    """After 20 shared steps, replica 1's state is reset (as Method.restore does for a client whose
    state was born in a round it sat out): its next step must be Adam's first step, ≈ lr·sign(g)."""
    p = torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.float64))
    opt = StackedAdamW([p], lr=0.1, weight_decay=0.0)
    for _ in range(20):
        p.grad = torch.ones_like(p)
        opt.step()
    st = opt.state[p]
    for k in ("step", "exp_avg", "exp_avg_sq"):
        st[k][1] = 0
    before = p.detach().clone()
    p.grad = torch.full_like(p, 0.5)
    opt.step()
    # Adam's first step moves each coordinate by lr·g/(|g| + eps) ≈ lr
    torch.testing.assert_close(before[1] - p[1].detach(), torch.full((3,), 0.1, dtype=torch.float64), rtol=1e-6, atol=0)


def test_sampled_client_first_round_equals_a_fresh_client():
    """FedAvg, 2 clients, one drawn per round: a client's first round is exactly I AdamW steps of a
    fresh optimizer from the global model it received — not skewed by the other client's step count."""
    X = torch.randn(2, 30, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    Y = torch.randn(2, 30, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    layer = LoRALinear(4, 4, 2, stack=2, dtype=torch.float64)
    with torch.no_grad():
        layer.lora_A[1] = layer.lora_A[0]
    method = create_method("fedavg", rank=2, lr=0.05)
    fed = Federation(1, 2, sample_fraction=0.5, sample_seed=3)
    method.setup(layer, fed.replica_clients)

    def objective(params, batch):
        return ((layer.forward_with(params, batch[0]) - batch[1]) ** 2).mean(dim=(-2, -1))

    rounds = next(t for t in range(1, 30) if set(fed.participants(t, 0)) != set(fed.participants(0, 0))) + 1
    first = fed.participants(0, 0)[0]
    other = 1 - first
    start = {}
    orig_begin = method.begin_round

    def begin(rnd):
        if rnd == rounds - 1:
            start.update(A=layer.lora_A[other].detach().clone(), B=layer.lora_B[other].detach().clone())
        orig_begin(rnd)

    method.begin_round = begin
    orig_end = method.end_round
    end = {}

    def end_round(rnd):
        orig_end(rnd)
        if rnd == rounds - 1:
            end.update(A=layer.lora_A[other].detach().clone(), B=layer.lora_B[other].detach().clone())

    method.end_round = end_round
    run_rounds(method, fed, objective, lambda: (X, Y), rounds=rounds, local_steps=3)
    # the same 3 steps by a fresh client with a fresh torch AdamW
    A = torch.nn.Parameter(start["A"].clone())
    B = torch.nn.Parameter(start["B"].clone())
    opt = torch.optim.AdamW([A, B], lr=0.05, weight_decay=0.0, foreach=False)
    for _ in range(3):
        loss = ((X[other] @ (B @ A).T - Y[other]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.testing.assert_close(end["A"], A.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(end["B"], B.detach(), rtol=1e-12, atol=1e-12)


def test_survives_deepcopy_and_state_dict_round_trip():
    """A deep copy (its own parameter copy, its own per-replica state) and a state_dict reload both
    continue exactly where the original stopped, and neither touches the original's state."""
    import copy

    p = torch.nn.Parameter(torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=torch.float64))
    opt = StackedAdamW([p], lr=0.1)
    p.grad = torch.tensor([[1.0, -2.0], [0.5, 0.0], [3.0, 1.0]], dtype=torch.float64)
    opt.step()
    saved = {k: v.clone() for k, v in opt.state[p].items()}
    after_one = p.detach().clone()
    twin = copy.deepcopy(opt)
    p_twin = twin.param_groups[0]["params"][0]
    assert p_twin is not p and torch.equal(p_twin, p)
    fresh = StackedAdamW([p], lr=0.1)
    fresh.load_state_dict(opt.state_dict())
    grad2 = torch.tensor([[0.3, 0.3], [-1.0, 2.0], [0.0, -0.5]], dtype=torch.float64)
    p_twin.grad = grad2.clone()
    twin.step()
    # the original is untouched by the twin's step
    assert torch.equal(p, after_one) and all(torch.equal(opt.state[p][k], v) for k, v in saved.items())
    p.grad = grad2.clone()
    fresh.step()
    # reference: torch's AdamW over the same two gradients
    q = torch.nn.Parameter(torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=torch.float64))
    ref = torch.optim.AdamW([q], lr=0.1, foreach=False)
    for g in (torch.tensor([[1.0, -2.0], [0.5, 0.0], [3.0, 1.0]], dtype=torch.float64), grad2):
        q.grad = g.clone()
        ref.step()
    torch.testing.assert_close(p_twin.detach(), q.detach(), rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-14, atol=1e-15)
    for o, par in ((twin, p_twin), (fresh, p)):
        assert o.state[par]["step"].tolist() == [2.0, 2.0, 2.0]
        torch.testing.assert_close(o.state[par]["exp_avg"], ref.state[q]["exp_avg"], rtol=1e-14, atol=1e-15)
        torch.testing.assert_close(o.state[par]["exp_avg_sq"], ref.state[q]["exp_avg_sq"], rtol=1e-14, atol=1e-15)


def test_plain_sgd_is_torchs_sgd_to_the_last_bit_and_shares_its_state_dict():
    """PlainSGD (what make_optimizer('sgd') builds) is torch.optim.SGD without the wrappers that import
    torch._dynamo: the same parameters after every step, with momentum, Nesterov, dampening and weight decay,
    and a state_dict either one loads."""
    from fedlora.optim import PlainSGD, make_optimizer

    assert type(make_optimizer("sgd", [torch.zeros(2, requires_grad=True)], 0.1)) is PlainSGD
    for kw in ({}, {"momentum": 0.9, "weight_decay": 1e-2}, {"momentum": 0.9, "nesterov": True},
               {"momentum": 0.5, "dampening": 0.3, "maximize": True}):
        g = torch.Generator().manual_seed(0)
        start = [torch.randn(3, 4, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64)]
        grads = [[torch.randn_like(p) for p in start] for _ in range(4)]
        runs = []
        for cls in (torch.optim.SGD, PlainSGD):
            ps = [p.clone().requires_grad_(True) for p in start]
            opt = cls(ps, lr=0.1, **kw)
            for step in grads:
                opt.zero_grad()
                for p, gr in zip(ps, step):
                    p.grad = gr.clone()
                opt.step()
            runs.append((ps, opt.state_dict()))
        for a, b in zip(runs[0][0], runs[1][0]):
            assert torch.equal(a, b), kw
        ps = [p.clone().requires_grad_(True) for p in start]
        twin = PlainSGD(ps, lr=0.1, **kw)
        twin.load_state_dict(runs[0][1])  # torch's state, loaded by ours
        assert twin.state_dict()["param_groups"] == runs[0][1]["param_groups"]


def _adamw_one_tensor(p, g, st, lr, beta1, beta2, eps, wd, stacked):
    """Reference: one tensor's AdamW step with a per-replica step count, written out one operation at a time in
    the order of torch's single-tensor AdamW (StackedAdamW's update before it batched the tensors)."""
    lead = (p.shape[0],) if stacked and p.dim() >= 1 else ()
    if not st:
        st.update(step=torch.zeros(lead, dtype=torch.float64), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
    step, m, v = st["step"], st["exp_avg"], st["exp_avg_sq"]
    step += 1
    shape = lead + (1,) * (p.dim() - len(lead))
    p.mul_(1 - lr * wd)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    step_size = (lr / (1 - beta1 ** step)).to(p.dtype).reshape(shape)
    bc2_sqrt = (1 - beta2 ** step).sqrt().to(p.dtype).reshape(shape)
    p.sub_((m * step_size) / ((v.sqrt() / bc2_sqrt) + eps))


def test_step_is_the_single_tensor_update_to_the_last_bit():
    """StackedAdamW.step (torch's _foreach ops over the group, one bias correction shared by tensors with equal
    step counts) gives the numbers of the one-tensor-at-a-time update bit for bit: stacked and unstacked
    groups, float64 and float32, weight decay 0 and 0.1, a changing lr (a schedule), a parameter without a
    gradient, and replicas whose state is reset between steps (client sampling: unequal step counts)."""
    for dtype, wd, stacked in ((torch.float64, 0.0, True), (torch.float64, 0.1, True), (torch.float32, 0.1, True),
                               (torch.float32, 0.0, False)):
        g = torch.Generator().manual_seed(0)
        shapes = [(6, 4, 5), (6, 5, 4), (6, 3), (6, 4, 5)]
        start = [torch.randn(s, generator=g, dtype=dtype) for s in shapes]
        ours = [torch.nn.Parameter(t.clone()) for t in start]
        ref = [t.clone() for t in start]
        opt = StackedAdamW(ours, lr=0.05, weight_decay=wd, stacked=stacked)
        ref_state = [{} for _ in ref]
        for i in range(60):
            lr = 0.05 * (1 - i / 60)
            opt.param_groups[0]["lr"] = lr
            grads = [torch.randn(s, generator=g, dtype=dtype) for s in shapes]
            for k, (p, gr) in enumerate(zip(ours, grads)):
                p.grad = None if (k == 2 and i % 7 == 3) else gr.clone()
            for k, (p, gr, st) in enumerate(zip(ref, grads, ref_state)):
                if not (k == 2 and i % 7 == 3):
                    _adamw_one_tensor(p, gr, st, lr, 0.9, 0.999, 1e-8, wd, stacked)
            opt.step()
            if stacked and i % 9 == 4:  # replica i % 6 of the first or second tensor starts afresh (Method.restore)
                for k in ((i // 9) % 2,):
                    for st in (opt.state[ours[k]], ref_state[k]):
                        for key in ("step", "exp_avg", "exp_avg_sq"):
                            st[key][i % 6] = 0
        for k, (p, r) in enumerate(zip(ours, ref)):
            assert torch.equal(p.detach(), r), (dtype, wd, stacked, k)
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(opt.state[p][key], ref_state[k][key]), (dtype, wd, stacked, k, key)
