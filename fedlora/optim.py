"""AdamW for stacked replicas: one step count per replica (dim 0 of every parameter).

Methods train G independent clients as the leading dimension of one set of tensors. Adam's bias
correction 1 − βᵗ depends on how many steps *this* client has taken; ``torch.optim.AdamW`` keeps one
scalar count per tensor, i.e. one for the whole stack. Without client sampling every replica steps
together and the two agree; with sampling a client that sat out rounds (its parameters and moments
restored by ``Method.restore``) would be corrected with the others' count — e.g. fresh zero moments
divided by 1 − β₂ᵗ ≈ 1 instead of 1 − β₂ — and take steps several times too large. Here the count is
a per-replica tensor stored in the optimizer state, so ``Method.snapshot``/``restore`` rewind it
with the moments.

The update is torch's AdamW (Loshchilov & Hutter, decoupled weight decay), written out so the
bias correction can be a tensor; ``torch.optim.AdamW(foreach=False)`` gives the same numbers to
rounding when all replicas step together (tested).
"""
from __future__ import annotations

import torch

__all__ = ["PlainSGD", "StackedAdamW", "make_optimizer"]


class _NoDynamo:
    """torch wraps these optimizer methods in ``torch._disable_dynamo``, whose first call imports
    ``torch._dynamo`` (≈ 1 s of a command's start-up, again in every worker process). Nothing here is compiled,
    so the plain functions — the same code, unwrapped — serve."""

    add_param_group = torch.optim.Optimizer.add_param_group.__wrapped__
    zero_grad = torch.optim.Optimizer.zero_grad.__wrapped__
    state_dict = torch.optim.Optimizer.state_dict.__wrapped__
    load_state_dict = torch.optim.Optimizer.load_state_dict.__wrapped__


class PlainSGD(_NoDynamo, torch.optim.SGD):
    """``torch.optim.SGD``, the same numbers, without importing ``torch._dynamo`` (``_NoDynamo``)."""

    @torch.no_grad()  # what torch's step wrapper does outside compilation (differentiable=False)
    def step(self, closure=None):
        if self.defaults["differentiable"]:
            raise ValueError("PlainSGD: differentiable=True is not supported (use torch.optim.SGD)")
        return torch.optim.SGD.step.__wrapped__(self, closure)


class StackedAdamW(_NoDynamo, torch.optim.Optimizer):
    """AdamW whose step count is per replica: ``state["step"]`` has shape (G,) for a parameter of
    shape (G, …). ``stacked=False`` treats each parameter as one replica (an ordinary AdamW)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, stacked: bool = True) -> None:
        if not lr >= 0.0:
            raise ValueError(f"StackedAdamW: lr must be ≥ 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"StackedAdamW: betas must be in [0, 1), got {betas}")
        if not eps >= 0.0 or not weight_decay >= 0.0:
            raise ValueError(f"StackedAdamW: eps and weight_decay must be ≥ 0, got {eps}, {weight_decay}")
        # ``stacked`` lives in the param groups (not an attribute) so it survives deepcopy/pickle
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, stacked=stacked))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            ps, gs, ms, vs, steps, shapes = [], [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                lead = (p.shape[0],) if group["stacked"] and p.dim() >= 1 else ()
                if not st:
                    st["step"] = torch.zeros(lead, dtype=torch.float64, device=p.device)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                ps.append(p)
                gs.append(p.grad)
                ms.append(st["exp_avg"])
                vs.append(st["exp_avg_sq"])
                steps.append(st["step"])
                shapes.append(lead + (1,) * (p.dim() - len(lead)))
            if ps:
                self._update(ps, gs, ms, vs, steps, shapes, lr, beta1, beta2, eps, wd)
        return loss

    @staticmethod
    def _update(ps, gs, ms, vs, steps, shapes, lr, beta1, beta2, eps, wd) -> None:
        """One AdamW step of the tensors ``ps`` (gradients ``gs``, moments ``ms``, ``vs``, per-replica step
        counts ``steps``; ``shapes``: how a step count broadcasts over its parameter).

        Each tensor goes through exactly the operations, kernels and order of torch's single-tensor AdamW
        (with the bias correction a tensor): ``p ← p·(1 − lr·wd)``, ``m ← lerp(m, g, 1 − β₁)``,
        ``v ← β₂v + (1 − β₂)g²``, ``p ← p − (m·step_size) / (√v / √bc₂ + eps)``, so the numbers are the same to
        the last bit; only the dispatch is cheaper (2× faster on the rank-recovery shapes,
        bench/test_bench_optim.py): torch's ``_foreach_*`` ops, which on the CPU run the same per-tensor kernel
        for each tensor of the list; the multiplication by 1 skipped (``wd = 0``: the identity); one bias
        correction for tensors whose step counts are equal (the same values in, the same values out)."""
        torch._foreach_add_(steps, 1)
        if 1 - lr * wd != 1:
            torch._foreach_mul_(ps, 1 - lr * wd)
        torch._foreach_lerp_(ms, gs, 1 - beta1)
        torch._foreach_mul_(vs, beta2)
        torch._foreach_addcmul_(vs, gs, gs, value=1 - beta2)
        # the order of torch's single-tensor AdamW: step_size·m / (√v / √bc2 + eps)
        sizes, bc2s, last = [], [], None
        for p, step, shape in zip(ps, steps, shapes):
            if last is not None and last[1:] == (p.dtype, shape) and torch.equal(last[0], step):
                sizes.append(sizes[-1])
                bc2s.append(bc2s[-1])
                continue
            # lr / (1 − β₁ᵗ) and √(1 − β₂ᵗ), as the operators compute them (Tensor.__rpow__, __rsub__ and
            # __rdiv__: torch.pow, torch.rsub, reciprocal then ·lr), without their Python wrappers
            step_size = torch.reciprocal(torch.rsub(torch.pow(beta1, step), 1)).mul_(lr)
            bc2_sqrt = torch.rsub(torch.pow(beta2, step), 1).sqrt_()
            if step_size.dtype != p.dtype:
                step_size, bc2_sqrt = step_size.to(p.dtype), bc2_sqrt.to(p.dtype)
            sizes.append(step_size.view(shape))  # (fresh, contiguous tensors: a view is their reshape)
            bc2s.append(bc2_sqrt.view(shape))
            last = (step, p.dtype, shape)
        denom = torch._foreach_sqrt(vs)
        torch._foreach_div_(denom, bc2s)
        torch._foreach_add_(denom, eps)
        update = torch._foreach_mul(ms, sizes)
        torch._foreach_div_(update, denom)
        torch._foreach_sub_(ps, update)


def make_optimizer(name: str, params, lr: float, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """'adamw' → :class:`StackedAdamW` (per-replica step counts), 'sgd' → :class:`PlainSGD` (torch's SGD).

    ``params``: tensors or param-group dicts, as for any torch optimizer."""
    if name == "adamw":
        return StackedAdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "sgd":
        return PlainSGD(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {name!r}")
