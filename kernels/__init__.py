"""Fused LoRA ops (docs/design.md §7). No federated-learning knowledge lives here.

``lora_linear`` is the entry point the adapter layer calls. It dispatches to the fused Triton
kernels on CUDA tensors (when they are available) and to the pure-PyTorch reference elsewhere.

Dispatch (``FEDLORA_KERNELS`` environment variable, read at every call):

* ``auto`` (default): Triton when X is a CUDA tensor, triton imports, and the call is supported
  (float32/float16/bfloat16 with one dtype for all operands, no autocast, r + r̃ ≤ ``MAX_RANK``);
  otherwise the reference. CPU always takes the reference.
* ``triton``: always the Triton path; unsupported input raises ``ValueError``. On CPU this needs
  ``TRITON_INTERPRET=1`` set before triton is imported (tests) and float32.
* ``reference``: always the pure-PyTorch reference.

The policy (``backend_for``) lives in ``fedlora.kernels.lora_linear`` beside the Triton path it guards, which
``lora_linear_multi`` dispatches by too; this package imports its modules and none imports it back.

Triton-path knobs (arguments of ``lora_linear``/``lora_linear_multi``, or environment):

* ``base_gemm`` / ``FEDLORA_KERNELS_BASE_GEMM``: ``auto`` (default: on CUDA, time the Triton-GEMM and
  the cuBLAS-GEMM variants on first use per shape bucket and keep the faster), ``triton``, ``cublas``
  (``fedlora.kernels.base_gemm``).
* ``precision``: float32 dots, ``ieee`` or ``tf32``; default follows torch's CUDA matmul setting
  (``select_precision``).
* Under ``torch.use_deterministic_algorithms(True)`` the backward's split reductions (dA, dB) use
  per-split partial sums summed in a fixed order instead of fp32 atomics.

``FEDLORA_KERNELS_POISON=1`` fills kernel outputs with NaN before each launch (tests).
``python -m fedlora.kernels.aot`` compiles the kernels for sm_90 without a GPU (``fedlora.kernels.aot``).
"""
from __future__ import annotations

from .lora_linear import (FUSE_MAX_M, HAS_TRITON, MAX_RANK, _check_extras, _use_triton, backend_for, fold_adapters,
                          interpreter_active, lora_linear_multi, lora_linear_triton, select_precision)
from .reference import check_lora_shapes, lora_linear_reference

__all__ = ["lora_linear", "lora_linear_reference", "check_lora_shapes", "lora_linear_triton",
           "lora_linear_multi", "fold_adapters", "backend_for", "interpreter_active", "MAX_RANK", "FUSE_MAX_M",
           "HAS_TRITON", "select_precision"]

def lora_linear(x, weight, bias, a, b, scale=1.0, c=None, d=None, client_scale=1.0, *,
                rank_mask=None, client_rank_mask=None, middle=None, middle_phi=None, middle_mask=None,
                backend=None, precision=None, fuse=None, base_gemm=None):
    """Two-level LoRA linear: Y = X W0ᵀ + b + s₁(XAᵀ)Bᵀ + s₂(XCᵀ)Dᵀ (shapes: ``fedlora.kernels.reference``).

    Keyword-only extras (both backends):
      rank_mask ([G,] r): LoRA-A² rank mask; ΔW = s₁·B·diag(m)·A (masked ranks contribute nothing
        and get zero A-row gradients).
      client_rank_mask ([G,] r̃): the same for the client adapter.
      middle, middle_phi, middle_mask ([G,] r, r): H²Tune TriLoRA, ΔW = s₁·B·(I + Φ⊙Ω⊙R)·diag(m)·A;
        gradients of R and Φ vanish off the support Ω.
      backend: 'auto' | 'triton' | 'reference' (default: env FEDLORA_KERNELS, else 'auto').
      precision ('ieee' | 'tf32'), fuse (bool), base_gemm ('auto' | 'triton' | 'cublas'): Triton-path
        knobs, see ``lora_linear_triton``.
    """
    extras = (rank_mask, client_rank_mask, middle, middle_phi, middle_mask)
    if _use_triton(x, backend, (weight, bias, a, b, c, d, middle, middle_phi)):
        return lora_linear_triton(x, weight, bias, a, b, scale, c, d, client_scale, rank_mask=rank_mask,
                                  client_rank_mask=client_rank_mask, middle=middle, middle_phi=middle_phi,
                                  middle_mask=middle_mask, precision=precision, fuse=fuse, base_gemm=base_gemm)
    if all(e is None for e in extras):
        return lora_linear_reference(x, weight, bias, a, b, scale, c, d, client_scale)
    check_lora_shapes(x, weight, bias, a, b, c, d)
    _check_extras(a, rank_mask, middle, middle_phi, middle_mask, c, client_rank_mask,
                  a.shape[:1] if a.dim() == 3 else ())
    a_e, b_e, c_e, d_e = fold_adapters(a, b, scale, c, d, client_scale, rank_mask=rank_mask,
                                       client_rank_mask=client_rank_mask, middle=middle,
                                       middle_phi=middle_phi, middle_mask=middle_mask)
    return lora_linear_reference(x, weight, bias, a_e, b_e, 1.0, c_e, d_e, 1.0)
