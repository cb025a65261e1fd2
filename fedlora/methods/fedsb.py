"""Fed-SB — Singhal, Ponkshe, Vartak, Varshney, Vepakomma, "Fed-SB: A Silver Bullet for Extreme
Communication Efficiency and Performance in (Private) Federated LoRA Fine-Tuning", ICML 2025 workshop
ES-FoMo III (arXiv 2502.15436; code CERT-Lab/fed-sb), over LoRA-SB (Ponkshe, Singhal et al.,
arXiv 2411.19557).

Per adapted module (PEFT orientation, ``fedlora.aggmath.fedsb``): ΔW = s·B R A with s = 1 (α = r),
B (d_out, r) and A (r, d_in) frozen and identical on every client, and only the r×r R trained,
uploaded and averaged — exact: Σ_k p_k s·B R_k A = s·B (Σ_k p_k R_k) A. A client uploads r² numbers per
module (plus a shared classifier head where the run trains one).

The round protocol (``fedlora.server``), with the initialisation as its first round:

* **round 1 (index 0) — the initialisation round.** Nothing is trained. Each participant accumulates
  the full-weight gradient G_k = ∂L/∂W of every adapted module at the current model (ΔW = 0: LoRA's
  B = 0) over its round's local steps, on ITS OWN batches, and uploads their mean (d_out × d_in per
  module, dense, counted in the round's bytes). The server takes the data-weighted mean
  Ḡ = Σ_k p_k G_k and LoRA-SB's initialisation (``fedlora.aggmath.lorasb_init``):
  SVD(−η·sign(Ḡ)) = UΣVᵀ, B ← U_r, A ← V_rᵀ, R₀ ← Σ_r (R₀ ≠ 0). Every client downloads A, B, R₀ when it
  next synchronises (counted).
* **rounds 2, 3, …** Each participant trains R for the round's local steps (its optimizer over R only,
  plus a shared head), with the model's up factor substituted by B·R in the objective (so the
  kernels, ``LoRALinear`` and the PEFT export need no change: after every step the model's ``lora_B``
  holds the fold B·R, ``fedlora.aggmath.fedsb_fold``); uploads R per module; the server sets
  R ← Σ_k p_k R_k of THIS round's uploads (``fedsb_average``); clients download R.

Which data the gradient comes from — the one deviation from the authors, stated because it is the
reason the round exists: the authors' scripts (``estimate_and_process_grads_torch`` before the
clients' loop) compute the gradient on the POOLED training data of all clients (``num_samples``
examples of the concatenated set), which a federation does not have. Here it comes from the data the
config names for training: each initialisation-round participant's own batches (``train.local_steps``
× ``train.batch_size`` examples, or what the testbed's step uses), averaged with the data weights; with
client sampling, only the round's participants contribute. sign(Σ p_k G_k) is then the sign of the
pooled gradient whenever each client's batches are its share of the pool.

Other differences from the authors' code (all listed on docs/methods/fedsb.md):

* their multi-round scripts build the list of client R's outside the round loop, so round t averages
  the R's of rounds 1..t; here the server averages only round t's uploads (Fed-SB §3's rule);
* their R mean is unweighted (equal client shares in their splits); here it is data-weighted
  (docs/design.md §3), which is the same for equal shares;
* η: their η = lr / (warmup_ratio·total_steps), the first step size of their linear warm-up; without
  a warm-up the first AdamW step of full fine-tuning at ``lr`` moves each weight by ≈ lr·sign(g), so the
  option ``init_lr`` defaults to the method's ``lr`` (times a run's schedule factor at the round's first
  step, as every step size of a method);
* they rebuild every client model and a fresh AdamW each round; here each client keeps its optimizer
  moments over R across rounds like every other method of this package (the server's R overwrites the
  parameter, not the moments);
* their SVD is ``torch.svd_lowrank`` in float32 rounded to bfloat16; here an exact float64 SVD with a
  fixed sign per singular pair (``lorasb_init``).

The full-weight gradient is taken by substitution, through the ``Objective`` contract every runtime
offers: A := I (d_in × d_in) and B := BA + Z with Z = 0 (d_out × d_in) give the same forward as the
model and ∂L/∂Z = s·∂L/∂W exactly (autograd; ``full_weight_gradients``). Hooks on the layers would need
each runtime's layer layout (slots, stacked replicas); the substitution needs none, at the cost of a
d_in×d_in product per adapted layer in one round.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from ..aggmath.fedsb import fedsb_average, fedsb_fold, lorasb_init, weighted_gradient
from ..errors import ConfigError
from ..payload import Payload
from .base import Method, Objective, Sampler, register
from .fedavg import FactorLoRA

__all__ = ["FedSB"]

GRAD = "weight_grad"  # upload name suffix of the initialisation round's gradient (d_out, d_in)
R_NAME = "lora_R"  # upload / server-state name suffix of R (r, r)
_META_RANK, _META_LR = "fedsb:rank", "fedsb:init_lr"


@register
class FedSB(FactorLoRA):
    """Fed-SB. Args: rank r (every client), lr (R's step size), optimizer ("adamw" | "sgd"),
    weight_decay, init_lr (η of LoRA-SB's approximated first step; default ``lr``).

    Refused in one line: a model whose LoRA scale is not 1 (α ≠ r, rsLoRA), per-client ranks, and any
    option asking to train A or B (they are not options: ``build`` names the allowed ones)."""

    name = "fedsb"
    #: sample-level DP: its own steps take private gradients (``_weight_gradients``, ``_r_gradients``)
    sample_dp_refusal = None
    client_dp_refusal = None  # R's weighted mean; the initialisation round's gradients are their own update
    fixed_lora_scale = ("Fed-SB fixes s = 1 (α = r): LoRA-SB's initialisation sets the update's scale and removes "
                        "the scale hyper-parameter (LoRA-SB §4; the authors' scripts set lora_alpha = lora_r)")
    #: the initialisation round's gradient accumulator is not part of a client's record, so a client may
    #: not finish its steps before its pass-mates (a runtime gives clients with unequal steps their own passes)
    equal_steps_per_pass = True

    def __init__(self, rank: int = 8, lr: float = 5e-4, optimizer: str = "adamw", weight_decay: float = 0.0,
                 init_lr: float | None = None) -> None:
        super().__init__(rank, lr, optimizer, weight_decay)
        if init_lr is not None and (not isinstance(init_lr, numbers.Real) or isinstance(init_lr, bool)
                                    or not math.isfinite(init_lr) or init_lr <= 0):
            raise ConfigError(f"fedsb: init_lr (η of LoRA-SB's initial step) must be a finite number > 0 or "
                              f"None (= lr), got {init_lr!r}")
        self.init_lr = float(self.lr if init_lr is None else init_lr)
        self._init_round = False

    def step_sizes(self) -> dict[str, dict[str, Any]]:
        """R's step size and η of the initialisation's sign step."""
        return {**super().step_sizes(), "init_lr": {"optimizer": "sign", "lr": self.init_lr}}

    # set-up ------------------------------------------------------------------------------------
    def bind(self, model: nn.Module, replica_clients: Sequence[int], n_clients: int | None = None) -> None:
        super().bind(model, replica_clients, n_clients)
        for a, _ in self.pairs:
            prefix = a[: -len("lora_A")].rstrip(".")
            layer = model.get_submodule(prefix) if prefix else model
            scale = float(getattr(layer, "scale", 1.0))
            if abs(scale - 1.0) > 1e-12:
                raise ConfigError(f"fedsb: the LoRA scale of {prefix or 'the layer'} is {scale:g}, Fed-SB needs s = 1 "
                                  f"(lora_alpha = rank = {self.rank}, no rsLoRA): leave model.lora_alpha unset")
        G, r, M = len(self.replica_clients), self.rank, len(self.pairs)
        A0 = self.params[self.a_names[0]]
        #: R of every module, stacked (G, M, r, r): the only trained factor (the method's own parameter)
        self.R = nn.Parameter(torch.zeros(G, M, r, r, dtype=A0.dtype, device=A0.device))
        #: the frozen B each replica received (the model's lora_B holds the fold B·R)
        self.frozen_B = {b: torch.zeros_like(self.params[b].detach()) for b in self.b_names}
        self.opt = self._make_optimizer([self.R] + [self.params[n] for n in self.heads])
        self._grads: dict[str, torch.Tensor] = {}
        self._grad_steps, self._init_eta = 0, self.init_lr

    def describe_replica(self, replica: int) -> dict:
        return {"rank": self.rank}

    # client state: R and the received B are the replica's, beside the model's A and B·R -------------
    def _extra_state(self) -> dict[str, torch.Tensor]:
        return {"R": self.R.detach().clone(), **{f"B:{b}": v.clone() for b, v in self.frozen_B.items()}}

    def _restore_extra_state(self, extra: Mapping[str, torch.Tensor], idx: torch.Tensor) -> None:
        with torch.no_grad():
            self.R[idx] = extra["R"][idx].to(self.R.device)
            for b, v in self.frozen_B.items():
                v[idx] = extra[f"B:{b}"][idx].to(v.device)

    @torch.no_grad()
    def _fold(self, replicas: Sequence[int] | None = None) -> None:
        """The model's lora_B ← B·R (every replica, or ``replicas``)."""
        for j, b in enumerate(self.b_names):
            if replicas is None:
                self.params[b].copy_(fedsb_fold(self.frozen_B[b], self.R[:, j]))
            else:
                for i in replicas:
                    self.params[b][i] = fedsb_fold(self.frozen_B[b][i], self.R[i, j])

    # the round ----------------------------------------------------------------------------------
    def begin_round(self, round_idx: int) -> None:
        """Round index 0 is the initialisation round (module docstring)."""
        self._init_round = round_idx == 0
        self._grads, self._grad_steps, self._init_eta = {}, 0, self.init_lr

    def full_weight_gradients(self, objective: Objective, batch: Any) -> dict[str, torch.Tensor]:
        """∂L/∂W (G, d_out, d_in) of every adapted module at the current model, per replica on its own
        batch, keyed by the module's B name: the objective with A := I and B := BA + Z (the same
        forward), ∂L/∂Z = s·∂L/∂W, divided by s."""
        P = dict(self.params)
        zs = []
        for a, b in self.pairs:
            A, B = self.params[a].detach(), self.params[b].detach()
            G, d_in = A.shape[0], A.shape[-1]
            P[a] = torch.eye(d_in, dtype=A.dtype, device=A.device).expand(G, d_in, d_in)
            z = torch.zeros(G, B.shape[-2], d_in, dtype=B.dtype, device=B.device, requires_grad=True)
            P[b] = B @ A + z
            zs.append(z)
        loss = objective(P, batch).sum()  # replicas are independent: Σ keeps their gradients apart
        grads = torch.autograd.grad(loss, zs)
        out = {}
        for (a, b), g in zip(self.pairs, grads):
            prefix = a[: -len("lora_A")].rstrip(".")
            layer = self.model.get_submodule(prefix) if prefix else self.model
            out[b] = g / float(getattr(layer, "scale", 1.0))
        return out

    def local_step(self, objective: Objective, sample: Sampler) -> None:
        if self._init_round:  # accumulate G_k; nothing is trained
            if not self._grad_steps:  # η of the approximated first step, under the run's schedule (f at that step)
                self._init_eta = self.init_lr * self.lr_factor
            for b, g in self._weight_gradients(objective, sample()).items():
                self._grads[b] = g if b not in self._grads else self._grads[b] + g
            self._grad_steps += 1
            return
        self.opt.zero_grad(set_to_none=True)
        P = dict(self.params)
        for j, b in enumerate(self.b_names):
            P[b] = fedsb_fold(self.frozen_B[b], self.R[:, j])  # differentiable in R; B frozen
        trained = [self.R] + [self.params[n] for n in self.heads]
        for t, g in zip(trained, self._r_gradients(objective, P, sample(), trained)):
            t.grad = g
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self._fold()

    def _weight_gradients(self, objective: Objective, batch: Any) -> dict[str, torch.Tensor]:
        """The initialisation round's ∂L/∂W per module (by B name): ``full_weight_gradients``, or with sample-level DP
        (``set_sample_dp``) DP-SGD's release of it — per-example Σ_t g_tᵀ x_t clipped jointly over the modules, summed,
        noised, / q·n_k (``fedlora.privacy.dpsgd.private_weight_gradients``): the client's data reach the server's
        SVD only through that release."""
        if self.sample_dp is None:
            return self.full_weight_gradients(objective, batch)
        from ..privacy.dpsgd import private_weight_gradients

        modules = [a[: -len("lora_A")].rstrip(".") for a in self.a_names]
        grads = private_weight_gradients(self.sample_dp, self.model, lambda: objective(self.params, batch), modules,
                                         self.replica_clients)
        return {b: grads[m] for m, b in zip(modules, self.b_names)}

    def _r_gradients(self, objective: Objective, P: Mapping[str, torch.Tensor], batch: Any,
                     trained: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """∂L/∂(R, head) of a training round; with sample-level DP, DP-SGD's: per-example gradients of the folded up
        factor B·R (``per_sample_lora_grads``) taken to R by the chain rule, dRᵢ = Bᵀ d(BR)ᵢ, then clipped jointly
        with a trained head's, summed, noised, / q·n_k (``fedlora.privacy.dpsgd.private_gradients``)."""
        if self.sample_dp is None:
            return torch.autograd.grad(objective(P, batch).sum(), trained)
        def to_r(per: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            d_r = torch.stack([torch.einsum("sor,snoq->snrq", self.frozen_B[b], per.pop(b)) for b in self.b_names], 2)
            return {"R": d_r, **per}

        grads = self.private_grads(lambda: objective(P, batch), self.b_names + self.heads, to_r)
        return [grads["R"]] + [grads[n] for n in self.heads]

    # communication ------------------------------------------------------------------------------
    def _prefix(self, a: str) -> str:
        return a[: -len("lora_A")]

    def upload_spec(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """R (r, r) per module, the initialisation round's gradient (d_out, d_in) per module, a shared head."""
        out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for a, b in self.pairs:
            pre = self._prefix(a)
            out[pre + R_NAME] = ((self.rank, self.rank), self.R.dtype)
            out[pre + GRAD] = ((self.params[b].shape[-2], self.params[a].shape[-1]), self.params[a].dtype)
        out.update({n: (tuple(self.params[n].shape[1:]), self.params[n].dtype) for n in self.shared_head_names()})
        return out

    def upload(self, replica: int) -> Payload:
        """Initialisation round: the mean full-weight gradient of every module (with the rank and η the
        server's SVD needs); afterwards: R of every module (+ a shared head)."""
        if self._init_round:
            if not self._grad_steps:
                raise ConfigError("fedsb: the initialisation round took no local step (no gradient to upload)")
            tensors = {self._prefix(a) + GRAD: (self._grads[b][replica] / self._grad_steps).detach().clone()
                       for a, b in self.pairs}
            return Payload(tensors, {_META_RANK: str(self.rank), _META_LR: repr(self._init_eta)})
        tensors = {self._prefix(a) + R_NAME: self.R[replica, j].detach().clone() for j, a in enumerate(self.a_names)}
        return Payload({**tensors, **self.upload_head(replica)})

    def client_dp_reference(self, state: Mapping[str, torch.Tensor], initial: Mapping[str, torch.Tensor],
                            upload: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The initialisation round's gradients are their own update (taken against zero); R against the server's
        R, which every client downloaded (and a shared head against the server's)."""
        zeros = {n: torch.zeros_like(v) for n, v in upload.items() if n.endswith(GRAD)}
        return {**initial, **state, **zeros}

    @staticmethod
    def aggregate(payloads: Sequence[Payload], weights: torch.Tensor) -> dict[str, torch.Tensor]:
        """Initialisation round (gradients uploaded): per module Ḡ = Σ p_k G_k and LoRA-SB's (A, B, R₀);
        afterwards R = Σ p_k R_k per module (this round's uploads only) and the weighted mean head."""
        if not payloads:
            raise ConfigError("fedsb.aggregate: no client payloads")
        names = sorted(payloads[0].tensors)
        for k, p in enumerate(payloads):
            if sorted(p.tensors) != names:
                raise ConfigError(f"fedsb.aggregate: payload {k} carries {sorted(p.tensors)[:4]}…, payload 0 "
                                  f"{names[:4]}…; every upload of a round must carry the same tensors")
        grads = [n for n in names if n.endswith(GRAD)]
        if grads:
            metas = {(p.meta.get(_META_RANK), p.meta.get(_META_LR)) for p in payloads}
            if len(metas) != 1 or None in next(iter(metas)):
                raise ConfigError(f"fedsb.aggregate: the initialisation uploads must all carry the same "
                                  f"{_META_RANK!r} and {_META_LR!r} metadata, got {sorted(map(str, metas))}")
            rank_s, lr_s = next(iter(metas))
            rank, lr = int(rank_s), float(lr_s)
            out = {}
            for n in grads:
                pre = n[: -len(GRAD)]
                B, R, A = lorasb_init(weighted_gradient([p.tensors[n] for p in payloads], weights), rank, lr)
                out[pre + "lora_A"], out[pre + "lora_B"], out[pre + R_NAME] = A, B, R
            return out
        out = {n: fedsb_average([p.tensors[n] for p in payloads], weights) for n in names if n.endswith(R_NAME)}
        if not out:
            raise ConfigError(f"fedsb.aggregate: the uploads carry neither R (*{R_NAME}) nor gradients (*{GRAD}): {names[:4]}")
        out.update(Method.aggregate_head(payloads, weights))
        return out

    # PEFT adapters trained elsewhere (fedlora.peft_adapters) ---------------------------------------------
    #: a Fed-SB client's PEFT adapter (this package's export, LoRA-SB's own) holds R folded into its up factor:
    #: lora_B = B·R_k (s = 1) over the B and lora_A = A every client shares, so lora_B carries the upload
    lora_upload = ("lora_B",)

    @staticmethod
    def _span_tolerance(dtype: torch.dtype) -> float:
        """How far (relative, Frobenius) a client's lora_B may lie off the clients' common rank-r column space:
        1000 ulps of its dtype (float32: 1.2e-4; float64: 2.2e-13), at most 0.05 (16-bit floats) — rounding of
        the fold B·R_k, never a trained B (whose residual is of order 1)."""
        return min(1e3 * torch.finfo(dtype).eps, 0.05)

    def _common_basis(self, clients) -> dict[str, torch.Tensor]:
        """Per module, Q (d_out, r), float64, orthonormal columns spanning every client's lora_B = B·R_k: the
        top-r left singular vectors of [B·R_1 … B·R_K] (one sign per column fixed, as ``lorasb_init``). The
        frozen B itself is not in a PEFT adapter, but every B·R_k lies in col(Q), so the coordinates
        R'_k = Qᵀ(B·R_k) average and fold back to Q·Σ p_k R'_k = QQᵀ·Σ p_k B·R_k = B·(Σ p_k R_k): Fed-SB's
        server, folded (when the R_k span r dimensions, Q = B·M with M invertible and R'_k = M⁻¹R_k — the same
        R in another basis of B's columns). A client whose lora_B lies off col(Q) (a trained B, another frozen
        B) is refused in one line."""
        out = {}
        for m, (a, b, _) in clients[0].items():
            r, d_out = a.shape[0], b.shape[0]
            if r > d_out:
                raise ConfigError(f"fedsb: module {m!r} has rank {r} > d_out = {d_out}; Fed-SB's frozen B (d_out, r) "
                                  f"has orthonormal columns (LoRA-SB), so r ≤ d_out")
            Bs = [c[m][1].to(torch.float64) for c in clients]
            Q = torch.linalg.svd(torch.cat(Bs, 1), full_matrices=False)[0][:, :r]
            flip = torch.sign(Q[Q.abs().argmax(dim=0), torch.arange(r)])
            Q = Q * torch.where(flip == 0, torch.ones_like(flip), flip)
            tol = self._span_tolerance(b.dtype)
            for k, B in enumerate(Bs):
                off, norm = float(torch.linalg.norm(B - Q @ (Q.T @ B))), float(torch.linalg.norm(B))
                if off > tol * norm:
                    raise ConfigError(f"fedsb: client {k}'s lora_B of module {m!r} is not B·R_k over the frozen B the "
                                      f"other clients share (it lies {off / norm:.2g} off their common rank-{r} column "
                                      f"space, tolerance {tol:.2g}): Fed-SB trains only R; adapters whose B was trained "
                                      f"aggregate with ffa or fedavg")
            out[m] = Q
        return out

    def uploads_from_lora(self, clients) -> list[Payload]:
        """Each client's R in the common basis Q (``_common_basis``): Qᵀ·lora_B_k (r, r), float64, uploaded as
        ``<module>.lora_R`` to this method's own ``aggregate``. One-line ``ConfigError``: a scale other than 1
        (Fed-SB fixes s = 1: lora_alpha = r, no rsLoRA), a lora_A that is not bitwise the same on every client
        (frozen and shared), different ranks, a lora_B off the common column space."""
        for m, (a, _, _) in clients[0].items():
            for k, client in enumerate(clients):
                a_k, _, s_k = client[m]
                if abs(s_k - 1.0) > 1e-12:
                    raise ConfigError(f"fedsb: module {m!r} of client {k} has LoRA scale {s_k:g}; Fed-SB fixes s = 1 "
                                      f"(lora_alpha = r = {a_k.shape[0]}, no rsLoRA), as its exports are written")
                if k and a_k.shape == a.shape and not torch.equal(a_k, a):
                    raise ConfigError(f"fedsb: client {k}'s lora_A of module {m!r} differs from client 0's; Fed-SB's A "
                                      f"is frozen and the same on every client (LoRA-SB's initialisation, bit for bit), "
                                      f"only R is trained (folded into lora_B = B·R)")
        self.check_lora_clients(clients)  # one rank per module
        Q = self._common_basis(clients)
        return [Payload({f"{m}.{R_NAME}": Q[m].T @ b.to(torch.float64) for m, (_, b, _) in client.items()})
                for client in clients]

    def lora_server_state(self, clients) -> dict[str, torch.Tensor]:
        """The frozen factors the clients share, as the server holds them: A (client 0's, the same on all) and
        B as the basis Q of ``uploads_from_lora`` (float64); the aggregate adds R (in that basis)."""
        Q = self._common_basis(clients)
        return {**{f"{m}.lora_A": a for m, (a, _, _) in clients[0].items()},
                **{f"{m}.lora_B": q for m, q in Q.items()}}

    def lora_download(self, state, client) -> dict:
        """What ``download`` leaves in a client's layer: lora_A = A, lora_B = the fold Q·R̄ = B·Σ p_k R_k, s = 1."""
        return {m: (state[f"{m}.lora_A"], fedsb_fold(state[f"{m}.lora_B"], state[f"{m}.{R_NAME}"]), s)
                for m, (_, _, s) in client.items()}

    def download(self, replica: int, state: Mapping[str, torch.Tensor]) -> Payload:
        """Write the server's A, B (frozen), R and head into ``replica``; the model's lora_B ← B·R."""
        with torch.no_grad():
            for j, (a, b) in enumerate(self.pairs):
                pre = self._prefix(a)
                if pre + "lora_A" in state:
                    A = self.params[a]
                    A[replica] = state[pre + "lora_A"].to(dtype=A.dtype, device=A.device)
                if pre + "lora_B" in state:
                    B = self.frozen_B[b]
                    B[replica] = state[pre + "lora_B"].to(dtype=B.dtype, device=B.device)
                if pre + R_NAME in state:
                    self.R[replica, j] = state[pre + R_NAME].to(dtype=self.R.dtype, device=self.R.device)
            self._fold([replica])
            self.download_head(replica, state)
        return Payload(dict(state))
