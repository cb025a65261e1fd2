"""LoRA-FAIR (Bian, Wang, Zhang, Xu, "LoRA-FAIR: Federated LoRA Fine-Tuning with Aggregation and
Initialization Refinement", ICCV 2025; arXiv 2411.14961): FedAvg-LoRA's clients, a corrected B on the server.

Per round:

1. every client starts from the server's (Ā, B̄') ("Avg-Initial": the W0 is never changed), trains A
   and B locally and uploads (A_k, B_k), as FedAvg-LoRA;
2. the server averages, Ā = Σ_k p_k A_k and B̄ = Σ_k p_k B_k with p_k the data weights, and per adapted
   layer solves the paper's eq. 8 for the residual
   ΔB = argmin S(ΔW, (B̄ + ΔB)Ā) + λ‖ΔB‖ with ΔW = Σ_k p_k B_k A_k (eq. 6), by gradient steps on the
   server (``fedlora.aggmath.lora_fair``: S = 1 − cos, ‖·‖ Frobenius, float64, never the dense ΔW in the
   solver);
3. every client downloads (Ā, B̄' = B̄ + ΔB): the same bytes as FedAvg-LoRA (A and B per layer), no dense
   update. A trained classifier head is averaged with the data weights, as FedAvg-LoRA does.

Options of the server's solver (``lam``, ``server_steps``, ``server_lr``, ``solver``, ``backtrack``) are
constructor options; they reach the pure static ``aggregate`` in every upload's metadata (as FlexLoRA's
``max_rank``), so the server half is a function of the uploads alone, and uploads that disagree are refused.
λ = 0.01 is the paper's; the paper gives neither the server's step count nor its step size (ours:
``fedlora.aggmath.lora_fair.DEFAULTS``). ``solver="ridge"`` is the documented closed-form variant, not the
paper's method.

Differences from the paper, each stated where it is made: S is the cosine dissimilarity 1 − cos (the paper
writes "similarity" and argmin; its ablation maximises the cosine); the non-differentiable ‖ΔB‖ at ΔB = 0
takes its minimum-norm subgradient; a step that would raise the objective is halved (``backtrack``, default
on) so the correction never scores worse than none; the clients' optimizer defaults to the house's AdamW
(the paper's clients run SGD, lr 0.01, on ViT: ``optimizer="sgd"``). No authors' code was available to
compare with (the repository the paper's page names could not be fetched); a third-party re-implementation
(minhdn2k2/FL_LoRA, ``servers/serverlorafair.py``) minimises 1 − cos + λ‖ΔB‖_F², the squared norm — ours
follows the paper's unsquared ‖ΔB‖.

All clients share one rank r (the paper's setting; the stacked model has one rank). Optimizer state per
client is kept across rounds, as FedAvg-LoRA's (``fedavg``).
"""
from __future__ import annotations

import math
import numbers
from typing import Sequence

import torch

from ..aggmath.lora_fair import DEFAULTS, SOLVERS, lora_fair_correction
from ..aggregation import fedavg_factors
from ..errors import ConfigError
from ..payload import Payload
from .base import Objective, Sampler, register
from .fedavg import FactorLoRA

__all__ = ["LoRAFAIR"]

#: the payload metadata key under which every upload carries the server solver's options
_META = "lora-fair"
_KEYS = ("lam", "steps", "lr", "solver", "backtrack")


@register
class LoRAFAIR(FactorLoRA):
    """LoRA-FAIR.

    Args:
        rank: r, all clients. lr, optimizer ("adamw" | "sgd"), weight_decay: the clients' local steps.
        lam: λ of eq. 8 (≥ 0; the paper's 0.01).
        server_steps: gradient steps of the server's solver per layer and round (≥ 0).
        server_lr: the server solver's step size (> 0).
        solver: "sgd" (the paper's objective and solver) or "ridge" (closed-form variant, not the paper's).
        backtrack: halve a server step that would not lower the objective (default; see
            ``fedlora.aggmath.lora_fair``); False takes every step at ``server_lr``.
    """

    name = "lora-fair"
    client_dp_refusal = ("its server refines the averaged factors against Σ p_k B_k A_k, which needs each client's own product")

    def __init__(self, rank: int = 8, lr: float = 5e-4, optimizer: str = "adamw", weight_decay: float = 0.0,
                 lam: float = DEFAULTS["lam"], server_steps: int = DEFAULTS["steps"],
                 server_lr: float = DEFAULTS["lr"], solver: str = "sgd", backtrack: bool = DEFAULTS["backtrack"]) -> None:
        super().__init__(rank, lr, optimizer, weight_decay)
        if not isinstance(lam, numbers.Real) or isinstance(lam, bool) or not math.isfinite(lam) or lam < 0:
            raise ConfigError(f"lora-fair: lam (λ of eq. 8) must be a finite number ≥ 0, got {lam!r}")
        if not isinstance(server_steps, numbers.Integral) or isinstance(server_steps, bool) or server_steps < 0:
            raise ConfigError(f"lora-fair: server_steps must be an integer ≥ 0, got {server_steps!r}")
        if (not isinstance(server_lr, numbers.Real) or isinstance(server_lr, bool) or not math.isfinite(server_lr)
                or server_lr <= 0):
            raise ConfigError(f"lora-fair: server_lr must be a finite number > 0, got {server_lr!r}")
        if solver not in SOLVERS:
            raise ConfigError(f"lora-fair: solver must be one of {', '.join(SOLVERS)}, got {solver!r}")
        if not isinstance(backtrack, bool):
            raise ConfigError(f"lora-fair: backtrack must be true or false, got {backtrack!r}")
        self.lam, self.server_steps, self.server_lr = float(lam), int(server_steps), float(server_lr)
        self.solver, self.backtrack = solver, backtrack

    def step_sizes(self) -> dict:
        """The clients' step and the server solver's (plain gradient steps on ΔB)."""
        return {**super().step_sizes(), "server_lr": {"optimizer": "sgd", "lr": self.server_lr}}

    def local_step(self, objective: Objective, sample: Sampler) -> None:
        self.train_step(objective, sample, self.a_names + self.b_names + self.heads)

    def server_meta(self) -> dict[str, str]:
        """The server solver's options as every upload carries them (``server_options`` reads them back)."""
        return {_META: f"lam={self.lam!r};steps={self.server_steps};lr={self.server_lr!r};solver={self.solver};"
                       f"backtrack={int(self.backtrack)}"}

    def upload(self, replica: int) -> Payload:
        """A_k and B_k of every layer (and a shared head); meta: the server solver's options."""
        meta = self.server_meta()
        return Payload(self.upload_params(replica, self.a_names + self.b_names + self.shared_head_names()).tensors,
                       meta)

    # PEFT adapters trained elsewhere (fedlora.peft_adapters): one rank and one scale for every client
    lora_upload = ("lora_A", "lora_B")

    def uploads_from_lora(self, clients) -> list[Payload]:
        """A_k, B_k as they are; meta: this method's server options (``server_meta``), as ``upload``'s."""
        return [Payload(p.tensors, self.server_meta()) for p in super().uploads_from_lora(clients)]

    @staticmethod
    def server_options(payloads: Sequence[Payload]) -> dict:
        """The solver options the uploads carry, checked to be present and the same in every upload."""
        missing = [k for k, p in enumerate(payloads) if _META not in p.meta]
        if missing:
            raise ConfigError(f"lora-fair: payloads {missing} lack the server options (metadata {_META!r}); "
                              "every LoRA-FAIR upload carries them")
        seen = sorted({p.meta[_META] for p in payloads})
        if len(seen) > 1:
            raise ConfigError(f"lora-fair: uploads disagree on the server options: {seen}")
        try:
            opts = dict(item.split("=", 1) for item in seen[0].split(";"))
            if sorted(opts) != sorted(_KEYS):
                raise ValueError
            return {"lam": float(opts["lam"]), "steps": int(opts["steps"]), "lr": float(opts["lr"]),
                    "solver": opts["solver"], "backtrack": {"1": True, "0": False}[opts["backtrack"]]}
        except (ValueError, KeyError):
            raise ConfigError(f"lora-fair: unreadable server options {seen[0]!r}; expected "
                              f"{';'.join(k + '=…' for k in _KEYS)}") from None

    @staticmethod
    def aggregate(payloads: Sequence[Payload], weights: torch.Tensor) -> dict[str, torch.Tensor]:
        """Ā, B̄ and a head: the data-weighted means; then per layer B̄ ← B̄ + ΔB (eq. 8, ``lora_fair_correction``)."""
        if not payloads:
            raise ConfigError("lora-fair: aggregate needs at least one payload")
        options = LoRAFAIR.server_options(payloads)
        state = fedavg_factors([p.tensors for p in payloads], weights)  # Ā, B̄, head (checks the names agree)
        for a in [n for n in payloads[0].tensors if n.rsplit(".", 1)[-1] == "lora_A"]:
            b = a[: -len("lora_A")] + "lora_B"
            if b not in state:
                raise ConfigError(f"lora-fair: the uploads carry {a} but not its {b}")
            res = lora_fair_correction([p.tensors[b] for p in payloads], [p.tensors[a] for p in payloads], weights,
                                       **options)
            state[b] = res.B
        return state
