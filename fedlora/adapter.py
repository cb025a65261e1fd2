"""The adapter layer: frozen W0 (+ bias) and the method's trainable factors (docs/design.md §2).

One code path: the synthetic testbed is a single ``LoRALinear`` with W0 = 0, and the LLM layer
injects the same class into HF models. Its forward is one ``fedlora.kernels.lora_linear`` call.

Factors (PEFT orientation, docs/design.md §3), with an optional leading stack dimension ``G`` holding
independent replicas (clients × seeds) that share W0::

    lora_A  ([G,] r, d_in)    lora_B  ([G,] d_out, r)     common adapter x = (A, B)
    lora_C  ([G,] r̃, d_in)    lora_D  ([G,] d_out, r̃)     client adapter y = (C, D), r̃ may be 0
    lora_R, lora_Phi ([G,] r, r)  and buffer middle_mask    H²Tune TriLoRA middle (``middle=True``)

With ``middle=True`` the common adapter is TriLoRA's ΔW = s₁·B (I + (Φ⊙Ω)⊙R) A ([H²Tune] eq. 3 in PEFT
orientation, see ``fedlora.aggmath.h2tune``): R starts at 0 (so ΔW starts at PEFT's 0), Φ at 1 and
the support Ω (``middle_mask``, a buffer the method re-chooses) dense.
"""
from __future__ import annotations

import math
from typing import Mapping

import torch
from torch import nn

from fedlora import kernels
from fedlora.kernels import fold_adapters  # noqa: F401  (the layers fold adapters through the core: fedlora.llm.export)

from .errors import ConfigError

__all__ = ["LoRALinear", "Capture", "lora_scale", "unit_alpha", "refuse_rslora", "set_row_gates"]


def lora_scale(alpha: float | None, rank: int, rslora: bool = False) -> float:
    """The scale s of a LoRA of rank r: α/r (Hu et al., "LoRA", ICLR 2022, §4.1), or with ``rslora``
    α/√r — rsLoRA (Kalajdzievski, "A Rank Stabilization Scaling Factor for Fine-Tuning with LoRA",
    arXiv 2312.03732, 2023; Definition 3.1 and Theorem 3.2: the adapters are rank-stabilised — their
    outputs and gradients stay Θ(1) as r grows — iff γ_r ∈ Θ(1/√r); PEFT's ``use_rslora``).
    ``alpha`` ``None`` means α = r (s = 1, or √r with rsLoRA).

    The one owner of "the scale of rank r under these options": the adapter layer, hence every
    method's ``layer.scale`` and the run's recorded scales the export folds in, come from here."""
    a = rank if alpha is None else alpha
    return a / math.sqrt(rank) if rslora else a / rank


def unit_alpha(rank: int, rslora: bool = False) -> float:
    """The α whose scale at rank r is exactly 1 (PEFT computes α/r, or α/math.sqrt(r) with
    ``use_rslora``): r, or √r. The PEFT export folds every scale into B and writes this α."""
    return math.sqrt(rank) if rslora else rank


def refuse_rslora(method: str, reason: str | None, where: str = "rslora") -> None:
    """``ConfigError`` (one line, naming the method and why) when rsLoRA is asked of a method whose paper
    fixes the LoRA scale (``Method.fixed_lora_scale`` = ``reason``); nothing when ``reason`` is None."""
    if reason is not None:
        raise ConfigError(f"{where}: rsLoRA (s = α/√r) cannot be used with method {method!r}: its paper fixes the "
                          f"LoRA scale ({reason}); leave rsLoRA off for it")


class Capture:
    """One forward of one layer inside ``fedlora.privacy.dpsgd.capture`` (sample-level DP-SGD's per-example
    gradients; it lives here, with the layers that record it, so the privacy package depends on the layers): the module, its input ``x`` and output ``y`` (the tensor the
    model uses downstream: its gradient is g) as the module saw them, the factors it used (``A``, ``B``: the
    tensors a functional call substituted, for a LoRA layer) and ``layout``: "slot" — x (S·b, …, d), slot-major —
    or "stack" — x (G, N, [T,] d) of a layer with G replicas (the testbed's: one example per row), (N, [T,] d) of an
    ordinary layer. ``C``, ``D``: the client adapter's factors it used (FedDPA's local adapter), None without one;
    ``R``, ``Phi``: TriLoRA's middle and sparsification matrices it used (H²Tune), None without a middle."""

    __slots__ = ("module", "x", "y", "A", "B", "C", "D", "R", "Phi", "layout")

    def __init__(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor, layout: str,
                 A: torch.Tensor | None = None, B: torch.Tensor | None = None,
                 C: torch.Tensor | None = None, D: torch.Tensor | None = None,
                 R: torch.Tensor | None = None, Phi: torch.Tensor | None = None) -> None:
        self.module, self.x, self.y, self.layout, self.A, self.B = module, x, y, layout, A, B
        self.C, self.D = C, D  # the client adapter's factors as used (None: a layer without one)
        self.R, self.Phi = R, Phi  # TriLoRA's middle matrix and sparsification matrix as used (None: no middle)

    def per_example(self, t: torch.Tensor, slots: int) -> torch.Tensor:
        """``t`` (x or g) as (S, n, T, d): S slots of n examples of T positions."""
        if self.layout == "slot":
            return t.reshape(slots, t.shape[0] // slots, -1, t.shape[-1])
        if getattr(self.module, "stack", None) is None:  # an ordinary layer: one replica, (N, [T,] d)
            return t.reshape(1, t.shape[0], -1, t.shape[-1])
        return t.reshape(t.shape[0], t.shape[1], -1, t.shape[-1])  # (G, N, [T,] d)


class LoRALinear(nn.Module):
    """y = x W0ᵀ + b + s₁ (x Aᵀ) Bᵀ + s₂ (x Cᵀ) Dᵀ with W0, b frozen.

    Args:
        in_features: d_in.
        out_features: d_out.
        rank: r of the common adapter (≥ 1).
        client_rank: r̃ of the client adapter (0 = plain LoRA).
        alpha: LoRA scaling numerator of the common adapter, s₁ = alpha / r; ``None`` means alpha = r (s₁ = 1).
        client_alpha: the client adapter's, s₂ = client_alpha / r̃; ``None`` means client_alpha = r̃ (s₂ = 1).
        rslora: rank-stabilised scales s₁ = alpha / √r, s₂ = client_alpha / √r̃ (``lora_scale``).
        base_weight: frozen W0 (d_out, d_in); ``None`` means W0 = 0 (no base GEMM at all).
        base_bias: frozen bias (d_out,) or ``None``.
        stack: number of independent replicas G (``None`` = an ordinary layer).

    Initialisation is PEFT's (A Kaiming-uniform(a=√5), B = 0; C likewise, D = 0); methods that
    need another init (e.g. the synthetic experiment) overwrite the parameters in place.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        *,
        client_rank: int = 0,
        alpha: float | None = None,
        client_alpha: float | None = None,
        base_weight: torch.Tensor | None = None,
        base_bias: torch.Tensor | None = None,
        stack: int | None = None,
        middle: bool = False,
        rslora: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        for name, val, low in (("in_features", in_features, 1), ("out_features", out_features, 1),
                               ("rank", rank, 1), ("client_rank", client_rank, 0)):
            if not isinstance(val, int) or val < low:
                raise ConfigError(f"{name} must be an integer ≥ {low}, got {val!r}")
        for name, val in (("alpha", alpha), ("client_alpha", client_alpha)):  # s = α/r: α = 0 trains nothing
            if val is not None and not (isinstance(val, (int, float)) and not isinstance(val, bool)
                                        and math.isfinite(val) and val > 0):
                raise ConfigError(f"{name} must be a finite number > 0 (or None: the rank, scale 1), got {val!r}")
        if stack is not None and (not isinstance(stack, int) or stack < 1):
            raise ConfigError(f"stack must be None or an integer ≥ 1, got {stack!r}")
        if base_weight is not None and tuple(base_weight.shape) != (out_features, in_features):
            raise ConfigError(
                f"base_weight must be (out_features, in_features) = {(out_features, in_features)}, "
                f"got {tuple(base_weight.shape)}"
            )
        self.in_features, self.out_features = in_features, out_features
        self.rank, self.client_rank, self.stack = rank, client_rank, stack
        if not isinstance(rslora, bool):
            raise ConfigError(f"rslora must be true or false, got {rslora!r}")
        self.rslora = rslora
        self.scale = lora_scale(alpha, rank, rslora)
        self.client_scale = lora_scale(client_alpha, client_rank, rslora) if client_rank else 0.0
        kw = {"dtype": dtype, "device": device}
        lead = () if stack is None else (stack,)
        # Frozen base: buffers, so no optimizer can ever see them.
        self.register_buffer("weight", None if base_weight is None else base_weight.detach().to(**kw))
        self.register_buffer("bias", None if base_bias is None else base_bias.detach().to(**kw))
        self.lora_A = nn.Parameter(torch.empty(*lead, rank, in_features, **kw))
        self.lora_B = nn.Parameter(torch.zeros(*lead, out_features, rank, **kw))
        if client_rank:
            self.lora_C = nn.Parameter(torch.empty(*lead, client_rank, in_features, **kw))
            self.lora_D = nn.Parameter(torch.zeros(*lead, out_features, client_rank, **kw))
        else:
            self.register_parameter("lora_C", None)
            self.register_parameter("lora_D", None)
        self.middle = bool(middle)
        if self.middle:
            self.lora_R = nn.Parameter(torch.zeros(*lead, rank, rank, **kw))
            self.lora_Phi = nn.Parameter(torch.ones(*lead, rank, rank, **kw))
            self.register_buffer("middle_mask", torch.ones(*lead, rank, rank, **kw))
        else:
            self.register_parameter("lora_R", None)
            self.register_parameter("lora_Phi", None)
            self.register_buffer("middle_mask", None)
        self.reset_parameters()

    @classmethod
    def from_linear(cls, linear: nn.Linear, rank: int, **kw) -> "LoRALinear":
        """Wrap an existing ``nn.Linear``: its weight and bias become the frozen base."""
        return cls(linear.in_features, linear.out_features, rank, base_weight=linear.weight,
                   base_bias=linear.bias, dtype=linear.weight.dtype, device=linear.weight.device, **kw)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """PEFT init: down factors Kaiming-uniform(a=√5) (bound 1/√d_in), up factors zero."""
        bound = 1.0 / math.sqrt(self.in_features)  # kaiming_uniform_(a=√5) on (r, d_in)
        for down, up in ((self.lora_A, self.lora_B), (self.lora_C, self.lora_D)):
            if down is None:
                continue
            down.copy_(torch.rand(down.shape, generator=generator, dtype=down.dtype).mul_(2 * bound)
                       .sub_(bound).to(down.device))
            up.zero_()

    @torch.no_grad()
    def merge_(self, delta: torch.Tensor | None = None) -> None:
        """W0 ← W0 + ΔW and restart the adapters (PEFT init). ``delta``: ([G,] d_out, d_in), default
        this layer's own ``delta_weight()``. A stacked layer's W0 becomes per replica (G, d_out, d_in),
        which the reference op handles (FLoRA merges every round, docs/design.md §4.11)."""
        delta = self.delta_weight() if delta is None else delta
        lead = () if self.stack is None else (self.stack,)
        want = (*lead, self.out_features, self.in_features)
        if tuple(delta.shape) not in (want, want[-2:]):
            raise ConfigError(f"merge_: delta must be {want}, got {tuple(delta.shape)}")
        base = self.weight if self.weight is not None else torch.zeros(want[-2:], dtype=delta.dtype,
                                                                         device=delta.device)
        self.weight = (base + delta.to(base.dtype)).expand(*want).clone() if lead else base + delta.to(base.dtype)
        self.reset_parameters()

    def replica_buffers(self) -> tuple[str, ...]:
        """Names of the buffers that carry the replica (stack) dimension: the TriLoRA support, and W0 /
        bias once they are per replica (after FLoRA's merge). The frozen shared base is not listed."""
        if self.stack is None:
            return ()
        names = ["middle_mask"] if self.middle else []
        if self.weight is not None and self.weight.dim() == 3:
            names.append("weight")
        if self.bias is not None and self.bias.dim() == 2:
            names.append("bias")
        return tuple(names)

    def middle_matrix(self) -> torch.Tensor | None:
        """I + (Φ⊙Ω)⊙R, shape ([G,] r, r), or ``None`` without a middle matrix."""
        if not self.middle:
            return None
        eff = self.lora_R * self.lora_Phi * self.middle_mask
        return torch.eye(self.rank, dtype=eff.dtype, device=eff.device) + eff

    def delta_weight(self) -> torch.Tensor:
        """ΔW = s₁B[M]A + s₂DC, shape ([G,] d_out, d_in). For reporting only (forms d_out×d_in)."""
        mid = self.middle_matrix()
        b = self.lora_B if mid is None else self.lora_B @ mid
        dw = self.scale * (b @ self.lora_A)
        if self.lora_C is not None:
            dw = dw + self.client_scale * (self.lora_D @ self.lora_C)
        return dw

    #: per-input weights (g₁, g₂) of the common and the client adapter, or ``None`` (the default, the
    #: fused op): set by an evaluator through ``set_row_gates`` (FedDPA's instance-wise weighting)
    row_gates: "tuple[torch.Tensor, torch.Tensor] | None" = None

    #: sample-level DP-SGD (``fedlora.privacy.dpsgd.capture``): a list every forward appends its input, output and
    #: factors to, for per-sample gradients; None (the class default): nothing is recorded, no extra work
    dp_capture: "list | None" = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.forward_with({}, x)
        return y if self.dp_capture is None else self._captured(x, y, "stack")

    def _captured(self, x: torch.Tensor, y: torch.Tensor, layout: str) -> torch.Tensor:
        """Record this forward in ``dp_capture`` (x, y and the factors it used: a functional call's substitutes);
        returns ``y``."""
        self.dp_capture.append(Capture(self, x, y, layout, self.lora_A, self.lora_B, self.lora_C, self.lora_D,
                                       self.lora_R, self.lora_Phi))
        return y

    def forward_with(self, params: "Mapping[str, torch.Tensor]", x: torch.Tensor) -> torch.Tensor:
        """``forward`` with some factors replaced by ``params`` (keys ``lora_A`` … ``lora_Phi``).

        The functional form methods differentiate through (a lighter ``torch.func.functional_call``
        for this one layer: same op, no module state swapped in and out).
        """
        g = params.get
        a, b = g("lora_A", self.lora_A), g("lora_B", self.lora_B)
        c, d = g("lora_C", self.lora_C), g("lora_D", self.lora_D)
        if self.row_gates is not None:
            return self._row_gated(x, a, b, c, d)
        if self.middle:
            return kernels.lora_linear(x, self.weight, self.bias, a, b, self.scale, c, d, self.client_scale,
                                       middle=g("lora_R", self.lora_R), middle_phi=g("lora_Phi", self.lora_Phi),
                                       middle_mask=self.middle_mask)
        return kernels.lora_linear(x, self.weight, self.bias, a, b, self.scale, c, d, self.client_scale)

    def _row_gated(self, x, a, b, c, d) -> torch.Tensor:
        """y = x W0ᵀ + b + g₁·s₁(x Aᵀ)Bᵀ + g₂·s₂(x Cᵀ)Dᵀ with one weight pair per input (``row_gates``: E
        values each). x's rows (every dimension but the last, flattened) are E equal contiguous blocks, one
        per input — its tokens, its beams: (G, N, d_in) with E = G·N, or a slot layer's (S, b·T, d_in) with
        E = S·b. Plain matmuls (the reference op; the fused kernels carry no per-row weight)."""
        g1, g2 = self.row_gates
        rows, n = math.prod(x.shape[:-1]), g1.numel()
        if c is None or self.middle or g2.numel() != n or n == 0 or rows % n:
            raise ConfigError(f"row gates: {n} and {g2.numel()} weights for {rows} rows of a layer with "
                              f"client_rank={self.client_rank}, middle={self.middle}: one pair per input, a "
                              f"client adapter and no middle matrix needed")

        def per_row(gate: torch.Tensor) -> torch.Tensor:
            return gate.reshape(-1).to(x.dtype).repeat_interleave(rows // n).reshape(*x.shape[:-1], 1)

        y = (per_row(g1) * (self.scale * ((x @ a.transpose(-1, -2)) @ b.transpose(-1, -2)))
             + per_row(g2) * (self.client_scale * ((x @ c.transpose(-1, -2)) @ d.transpose(-1, -2))))
        if self.weight is not None:
            y = y + (nn.functional.linear(x, self.weight) if self.weight.dim() == 2
                     else x @ self.weight.transpose(-1, -2))
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, r={self.rank}, "
                f"r_client={self.client_rank}, middle={self.middle}, stack={self.stack}, frozen_base={self.weight is not None}")


def set_row_gates(model: nn.Module, gates: "tuple[torch.Tensor, torch.Tensor] | None") -> None:
    """Give every ``LoRALinear`` of ``model`` the per-input adapter weights ``gates`` = (g₁, g₂), E values
    each (``LoRALinear._row_gated``), or take them away (``None``: the fused op again). They stay until the
    next call: an evaluator sets them per batch and clears them when it is done."""
    for m in model.modules():
        if isinstance(m, LoRALinear):
            m.row_gates = gates
