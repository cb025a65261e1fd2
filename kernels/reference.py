"""Pure-PyTorch reference of the two-level LoRA linear op (docs/design.md §7, op 1).

This is the oracle every fused kernel is tested against, and the path taken on CPU.

Orientation (PEFT, docs/design.md §3)::

    Y = X W0ᵀ + b + s₁ (X Aᵀ) Bᵀ + s₂ (X Cᵀ) Dᵀ

Shapes (a leading *stack* dimension ``G`` on the factors is optional: it holds ``G`` independent
adapters — clients × seeds in the synthetic testbed — that share the frozen ``W0``; X then carries
the same leading dimension)::

    X  (..., d_in)          or (G, N, d_in) when the factors are stacked
    W0 (d_out, d_in)        frozen, never differentiated by the fused op; or (G, d_out, d_in)
                            per replica (after a merge, e.g. FLoRA) — reference path only
    b  (d_out,)             optional
    A  ([G,] r, d_in)       B  ([G,] d_out, r)
    C  ([G,] r̃, d_in)       D  ([G,] d_out, r̃)   optional second (client) adapter
    Y  (..., d_out)
"""
from __future__ import annotations

import torch

__all__ = ["lora_linear_reference", "check_lora_shapes"]


def _shape(t: torch.Tensor | None) -> str:
    return "None" if t is None else str(tuple(t.shape))


def check_lora_shapes(x, weight, bias, a, b, c=None, d=None) -> None:
    """Raise ``ValueError`` naming the offending tensor when the operands do not fit together."""
    if x.dim() < 1:
        raise ValueError("lora_linear: X must have at least one dimension (…, d_in)")
    d_in = x.shape[-1]
    if weight is not None:
        if weight.dim() not in (2, 3) or weight.shape[-1] != d_in:
            raise ValueError(f"lora_linear: W0 must be (d_out, d_in={d_in}) or per replica (G, d_out, d_in), "
                             f"got {_shape(weight)}")
        if weight.dim() == 3 and (a.dim() != 3 or a.shape[0] != weight.shape[0]):
            raise ValueError(f"lora_linear: a per-replica W0 {_shape(weight)} needs stacked factors with the "
                             f"same G, got A {_shape(a)}")
        d_out = weight.shape[-2]
    else:
        d_out = b.shape[-2]
    if bias is not None and tuple(bias.shape) != (d_out,):
        raise ValueError(f"lora_linear: bias must be (d_out={d_out},), got {_shape(bias)}")
    for up_name, down_name, up, down in (("B", "A", b, a), ("D", "C", d, c)):
        if (up is None) != (down is None):
            raise ValueError(f"lora_linear: {down_name} and {up_name} must be given together")
        if up is None:
            continue
        if down.shape[-1] != d_in:
            raise ValueError(f"lora_linear: {down_name} must be (r, d_in={d_in}), got {_shape(down)}")
        if up.shape[-2] != d_out or up.shape[-1] != down.shape[-2]:
            raise ValueError(
                f"lora_linear: {up_name} must be (d_out={d_out}, r={down.shape[-2]}), got {_shape(up)}"
            )
        if down.dim() != up.dim() or down.shape[:-2] != up.shape[:-2]:
            raise ValueError(
                f"lora_linear: {down_name} {_shape(down)} and {up_name} {_shape(up)} have different stacks"
            )
        if down.dim() == 3 and (x.dim() != 3 or x.shape[0] != down.shape[0]):
            raise ValueError(
                f"lora_linear: stacked factors {_shape(down)} need X of shape (G={down.shape[0]}, N, d_in), "
                f"got {_shape(x)}"
            )
        if down.dim() not in (2, 3):
            raise ValueError(f"lora_linear: {down_name} must be 2-D or stacked 3-D, got {_shape(down)}")


def lora_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float = 1.0,
    c: torch.Tensor | None = None,
    d: torch.Tensor | None = None,
    client_scale: float = 1.0,
) -> torch.Tensor:
    """Y = X W0ᵀ + b + s₁(XAᵀ)Bᵀ [+ s₂(XCᵀ)Dᵀ] with plain matmuls (differentiable to any order).

    ``weight=None`` stands for W0 = 0 (the synthetic testbed) and skips the base GEMM.
    """
    check_lora_shapes(x, weight, bias, a, b, c, d)
    # X Aᵀ first: (N, r) is tiny, so the adapter costs O(N·r·(d_in + d_out)), never d_out×d_in.
    lora = (x @ a.transpose(-1, -2)) @ b.transpose(-1, -2)
    if weight is not None and weight.dim() == 2:
        # a shared frozen base: one GEMM with the bias fused (as nn.Linear), the low-rank terms added
        # with their scale folded into the add — no separate full-size multiply or bias pass
        y = torch.nn.functional.linear(x, weight, bias).add(lora, alpha=scale)
        if c is not None:
            y = y.add((x @ c.transpose(-1, -2)) @ d.transpose(-1, -2), alpha=client_scale)
        return y
    y = lora * scale if scale != 1.0 else lora
    if c is not None:
        z = (x @ c.transpose(-1, -2)) @ d.transpose(-1, -2)
        y = y + (z * client_scale if client_scale != 1.0 else z)
    if weight is not None:  # a per-replica W0 (G, d_out, d_in), after FLoRA's merge
        y = y + x @ weight.transpose(-1, -2)
    if bias is not None:
        y = y + bias
    return y
