"""The slot executor (docs/design.md §8): many simulated clients over one frozen base model.

One frozen base model is in memory. Its target layers carry adapters with a leading dimension of S
slots (``fedlora.llm.inject``). A round's participants are trained ``clients_per_pass`` at a time.
For a pass of S clients the executor

1. gives every slot module S slots and binds the method to them (``Method.bind``: names,
   optimizers, the per-client configuration of the clients in the slots);
2. loads each client's state record (``fedlora.state``: factors, optimizer moments and step
   counts, ranks/masks, its data sampler) into its slot, then applies the download the server sent
   it (``fedlora.server.Download``: what it lacks of the server's state) — a client selected after
   sitting out receives the current global state;
3. runs the round's local steps through the method's unchanged API: every objective call is ONE
   forward of the base model on the S clients' batches concatenated slot-major, where slot p's rows
   go through slot p's adapters (the stacked kernel op);
4. takes the uploads and stores the records back. Clients that sit out do no work at all.

A client's numbers do not depend on its slot (bit for bit); who shares its pass changes them only by
the floating-point rounding of batched GEMMs (the pass's padded length and row count), as any change
of batch size does in PyTorch.

With sample-level DP-SGD (``set_sample_dp``, ``fedlora.privacy.dpsgd``) each client's batch of a step is Poisson-drawn
from its own stream, the pass's slots padded to the largest draw with masked rows, and the method takes per-sample
clipped, noised gradients: a client's numbers still do not depend on its pass-mates beyond rounding.

Evaluation loads every client (read-only: nothing is stored back), applies what the server sent it
(``Server.evaluation_downloads``) and scores its personalised model on its own test and validation
split; ``evaluate_global`` scores the server's state (methods with a global model) on the whole test
split. ``SlotExecutor`` is a ``fedlora.server.ClientExecutor``; it holds no server.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from torch.func import functional_call

from fedlora.adapter import set_row_gates
from fedlora.errors import ConfigError
from fedlora.methods.base import Method
from fedlora.payload import Payload
from fedlora.privacy.dpsgd import DP_MASK, SampleDP
from fedlora.seeds import ADAPTER, DROPOUT, SAMPLER, seed_of
from fedlora.server import ClientFailure, ClientUpdate, Download
from fedlora.state import ClientStore

from .config import RunConfig
from .inject import SlotLoRALinear, set_slots
from .tasks import EvalContext, slot_batches

__all__ = ["SlotExecutor", "ClientSampler", "RunData", "chunks", "first_line"]

_RNG = "sampler:"  # record entries of the runtime's own (the data sampler of the client)


class ClientSampler:
    """Minibatches of one client: epochs of a random permutation of its ``n`` training rows drawn
    from its own generator (part of its state record, so it resumes where it stopped)."""

    def __init__(self, n: int, seed: int) -> None:
        if n < 1:
            from fedlora.errors import ConfigError

            raise ConfigError("a client needs at least one training example")
        self.n = n
        self.gen = torch.Generator().manual_seed(seed)
        self.perm = torch.randperm(n, generator=self.gen)
        self.pos = 0

    def next(self, b: int) -> torch.Tensor:
        out = []
        while b > 0:
            if self.pos == self.n:
                self.perm, self.pos = torch.randperm(self.n, generator=self.gen), 0
            take = min(b, self.n - self.pos)
            out.append(self.perm[self.pos:self.pos + take])
            self.pos += take
            b -= take
        return torch.cat(out)

    def state(self) -> dict[str, torch.Tensor]:
        return {_RNG + "rng": self.gen.get_state(), _RNG + "perm": self.perm.clone(),
                _RNG + "pos": torch.tensor([self.pos])}

    @classmethod
    def from_state(cls, n: int, state: Mapping[str, torch.Tensor]) -> "ClientSampler":
        s = cls.__new__(cls)
        s.n, s.gen = n, torch.Generator()
        s.gen.set_state(state[_RNG + "rng"])
        s.perm, s.pos = state[_RNG + "perm"].clone(), int(state[_RNG + "pos"][0])
        return s


def chunks(seq: Sequence[int], size: int) -> list[list[int]]:
    return [list(seq[i:i + size]) for i in range(0, len(seq), size)]


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


class RunData:
    """What a slot executor trains and scores on (built by ``fedlora.llm.runtime``): the task, the
    train and test rows and their encodings, each client's split (``clients``), the trained clients'
    row sets (``train_sets``), sizes and local steps per round."""

    def __init__(self, task, train_data, test_data, enc_train, enc_test, clients, train_sets, sizes, steps) -> None:
        self.task, self.train_data, self.test_data = task, train_data, test_data
        self.enc_train, self.enc_test, self.clients = enc_train, enc_test, clients
        self.train_sets, self.sizes, self.steps = train_sets, sizes, steps


class SlotExecutor:
    """The client executor of one base model (``fedlora.server.ClientExecutor``): clients in passes of
    ``P`` slots, their state records in ``store``. ``centralized``: one trained model on pooled data,
    which every client is scored with. ``client_hook(client, rnd)``, when set, is called for each client
    before its pass trains (fault injection: a hook that raises is a client that fails)."""

    live = False        # clients receive what they lack with their next round's instructions
    shared_base = True  # one base model: FLoRA's increments are merged into it once per round

    def __init__(self, cfg: RunConfig, method: Method, model, tokenizer, device: torch.device, data: RunData,
                 store: ClientStore, dropout, *, P: int, centralized: bool, head_mode: str,
                 head_linear: Sequence[str], targets: Sequence[str], sample_dp: SampleDP | None = None) -> None:
        self.cfg, self.method, self.model, self.tokenizer, self.device = cfg, method, model, tokenizer, device
        self.task, self.train_data, self.test_data = data.task, data.train_data, data.test_data
        self.enc_train, self.enc_test, self.clients = data.enc_train, data.enc_test, data.clients
        self.train_sets, self.sizes, self.steps = data.train_sets, data.sizes, data.steps
        self.store, self.dropout, self.P, self.centralized = store, dropout, P, centralized
        self.K_train = len(self.sizes)
        self.head_mode, self.head_linear, self.targets = head_mode, list(head_linear), list(targets)
        self._lora_layers = [m for m in model.modules() if isinstance(m, SlotLoRALinear)]
        self.client_hook: Callable[[int, int], None] | None = None
        self.initial_record: dict[str, torch.Tensor] | None = None  # a fresh replica (init_records)
        self._gating, self._refs = None, []  # while evaluating with per-input weights (Method.instance_gating)
        self.sample_dp: SampleDP | None = None
        self.set_sample_dp(sample_dp)

    def set_sample_dp(self, sample_dp: SampleDP | None) -> None:
        """Train with sample-level DP-SGD (``fedlora.privacy.dpsgd``), or without it again (None): each local step
        draws every client's batch by Poisson sampling (each of its rows in with probability q, from its own
        stream), pads the pass's slots to the largest draw with rows masked out, and the method's step takes
        per-sample clipped, noised gradients (``Method.set_sample_dp``: a method that cannot is refused in one line).
        The clients' data samplers are not used then (their records keep them unchanged)."""
        if sample_dp is not None:
            if not isinstance(sample_dp, SampleDP):
                raise ConfigError(f"sample_dp must be a fedlora.privacy.dpsgd.SampleDP, got {type(sample_dp).__name__}")
            if not callable(getattr(self.task, "example_losses", None)):
                raise ConfigError(f"sample-level DP needs each example's loss; the {self.task.kind!r} task does not "
                                  "give them (classification, generation and extractive QA do)")
            if self.task.kind == "qa" and self.cfg.data.doc_stride is not None:
                raise ConfigError("sample-level DP with data.doc_stride: a question read in several windows would be "
                                  "several records (features), so one question would not be protected; leave "
                                  "data.doc_stride unset")
            if self.dropout.enabled and self.P > 1:
                raise ConfigError("sample-level DP with model.dropout: a client's dropout masks would depend on its "
                                  "pass-mates' batch sizes (Poisson batches are padded per pass); set "
                                  "train.clients_per_pass: 1 or model.dropout: false")
            sample_dp.set_client_sizes(self.sizes)
        self.method.set_sample_dp(sample_dp)
        self.sample_dp = sample_dp

    def init_records(self) -> dict[str, torch.Tensor]:
        """Every client's initial state record into the store (PEFT init per slot, its data sampler and
        dropout generators seeded by client); returns the server's initial state."""
        seed = self.cfg.seed
        initial: dict[str, torch.Tensor] | None = None
        for chunk in chunks(list(range(self.K_train)), self.P):
            self._bind(chunk)
            self._init_slots(chunk)
            self.method.init_state()
            if initial is None:
                initial = {k: v.detach().cpu().clone() for k, v in self.method.initial_server_state(0).items()}
            for i, k in enumerate(chunk):
                sampler = ClientSampler(self.sizes[k], seed_of(seed, SAMPLER, k))
                self.store.put(k, {**self.method.replica_state(i), **sampler.state(),
                                   **self.dropout.initial_state(seed_of(seed, DROPOUT, k))}, copy=False)
        self.initial_record = self.store.get(0)
        return initial

    def _bind(self, clients: Sequence[int]) -> None:
        """Give every adapted layer one slot per client and bind the method to them; fresh per-slot
        training-loss sums for the objective."""
        set_slots(self.model, len(clients))
        self.method.bind(self.model, list(clients), n_clients=self.K_train)
        self._slots = len(clients)
        self._loss_sum = torch.zeros(len(clients), dtype=torch.float64, device=self.device)
        self._loss_n = torch.zeros(len(clients), dtype=torch.float64, device=self.device)
        self._active = torch.ones(len(clients), dtype=torch.float64, device=self.device)

    @torch.no_grad()
    def _init_slots(self, clients: Sequence[int]) -> None:
        """PEFT init per slot (down factors Kaiming-uniform(a=√5), up factors 0; TriLoRA R = 0, Φ = 1):
        the method's global factors from one draw (the server's adapter, equal on every client),
        personal factors from the client's own generator — independent of slot and chunk."""
        seed, glob = self.cfg.seed, set(self.method.global_factors)
        for j, layer in enumerate(self._lora_layers):
            bound = 1.0 / math.sqrt(layer.in_features)
            for down, up in (("lora_A", "lora_B"), ("lora_C", "lora_D")):
                D_, U_ = getattr(layer, down), getattr(layer, up)
                if D_ is None:
                    continue
                for i, k in enumerate(clients):
                    owner = "global" if down in glob else k
                    g = torch.Generator().manual_seed(seed_of(seed, ADAPTER, owner, j, down))
                    D_[i] = (torch.rand(D_.shape[1:], generator=g, dtype=torch.float64) * 2 * bound - bound).to(D_.dtype)
                U_.zero_()
            if layer.middle:
                layer.lora_R.zero_()
                layer.lora_Phi.fill_(1.0)
                layer.middle_mask.fill_(1.0)


    # ------------------------------------------------------------------------------------------
    # batches, objective
    def _rows(self, enc: Mapping[str, torch.Tensor], idx: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.task.collate(enc, idx, self.device)

    def _forward(self, params: Mapping[str, torch.Tensor] | None, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        inputs = {k: v for k, v in batch.items() if k not in self.task.label_keys}
        if self._gating is not None:  # this batch's per-input adapter weights first (they stay for its generate)
            set_row_gates(self.model, None)
            q = self._represent(self._gating, batch)
            set_row_gates(self.model, self._gating.gates(q.view(self._slots, -1, q.shape[-1]), self._refs))
        if params:
            out = functional_call(self.model, dict(params), args=(), kwargs=inputs, strict=False)
        else:
            out = self.model(**inputs)
        return self.task.model_output(out)

    @torch.no_grad()
    def _represent(self, gating, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """e(x) of every row of ``batch``, (S·b, H) float32 (``InstanceWeighting.represent``): the last hidden
        states of the model with ``gating.represent_params``, over the row's input tokens — its attention
        mask, and where labels are per token (generation) only the prompt's (label −100): the target never
        enters its own weight."""
        inputs = {k: v for k, v in batch.items() if k not in self.task.label_keys}
        out = functional_call(self.model, dict(gating.represent_params), args=(),
                              kwargs={**inputs, "output_hidden_states": True}, strict=False)
        hidden = getattr(out, "hidden_states", None)
        if not hidden:
            raise ConfigError(f"{self.method.name}: the per-input weighting needs the model's hidden states, "
                              f"which {type(out).__name__} does not give")
        mask = batch["attention_mask"].bool()
        labels = batch.get("labels")
        if labels is not None and labels.shape == mask.shape:
            mask = mask & (labels == -100)
        return gating.represent(hidden[-1], mask)

    def _objective(self, params: Mapping[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Each slot's mean loss, (S,) (the task's ``loss``): the Objective contract of ``fedlora.methods``.
        A Poisson batch of sample-level DP (it carries ``DP_MASK``): each slot's SUM of its real rows' losses
        (``_private_objective``)."""
        if DP_MASK in batch:
            return self._private_objective(params, batch)
        ce = self.task.loss(self._forward(params, batch), batch, self._slots)
        # on the model's device (no host sync per step); a slot that has finished its steps counts no more
        self._loss_sum += ce.detach().double() * self._active
        self._loss_n += self._active
        return ce

    def _private_objective(self, params: Mapping[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """(S,): Σ over slot p's real rows of the task's per-example loss (``example_losses``), padded rows exactly 0
        (``torch.where``: their gradient is 0 too) — the summed loss whose per-example gradients DP-SGD clips. The
        training loss recorded is the mean over the round's real rows (0.0 for a client that drew none all round)."""
        mask = batch[DP_MASK].view(self._slots, -1) > 0
        batch = {k: v for k, v in batch.items() if k != DP_MASK}
        per = self.task.example_losses(self._forward(params, batch), batch).view(self._slots, -1)
        per = torch.where(mask, per, torch.zeros((), dtype=per.dtype, device=per.device))
        total = per.sum(1)
        self._loss_sum += total.detach().double() * self._active
        self._loss_n += mask.sum(1).double() * self._active
        return total

    def _logits_fn(self, params: Mapping[str, torch.Tensor], batch: Mapping[str, torch.Tensor]):
        """H²Tune's ``output_fn``: the task's outputs. On a Poisson batch of sample-level DP: (logits (S, b, k, C),
        mask (S, b, k)) — each example's k outputs (contiguous in the task's (S, b·k, C)) grouped, the padded rows'
        masked — so that eq. 7's KL is a per-example term (``output_kl(reduction="examples")``)."""
        if DP_MASK not in batch:
            return self.task.outputs(self._forward(params, batch), batch, self._slots)
        rows = batch[DP_MASK].view(self._slots, -1)
        batch = {k: v for k, v in batch.items() if k != DP_MASK}
        out = self.task.outputs(self._forward(params, batch), batch, self._slots)
        logits, mask = out if isinstance(out, tuple) else (out, None)
        S, b = rows.shape
        logits = logits.reshape(S, b, -1, logits.shape[-1])
        keep = rows.to(logits.dtype)[:, :, None].expand(S, b, logits.shape[2])
        return logits, keep if mask is None else mask.reshape(S, b, -1).to(logits.dtype) * keep

    def _sampler_fn(self, samplers: Sequence[ClientSampler], clients: Sequence[int]) -> Callable[[], dict]:
        b = self.cfg.train.batch_size

        def sample() -> dict[str, torch.Tensor]:
            idx = torch.cat([torch.as_tensor(self.train_sets[k])[s.next(b)] for s, k in zip(samplers, clients)])
            return self._rows(self.enc_train, idx)

        return sample

    def _private_sampler_fn(self, clients: Sequence[int]) -> Callable[[], dict]:
        """Sample-level DP's batches: client k's rows each in with probability q, drawn from its own stream at the
        current (round, step) (``SampleDP.poisson_rows``); the slots padded to the pass's largest draw (at least one
        row) with the client's first row, ``DP_MASK`` 1 for real rows and 0 for padding."""
        sdp = self.sample_dp

        def sample() -> dict[str, torch.Tensor]:
            draws = [sdp.poisson_rows(k, len(self.train_sets[k])) for k in clients]
            b = max(1, max(len(d) for d in draws))
            idx, mask = [], []
            for d, k in zip(draws, clients):
                rows = torch.as_tensor(self.train_sets[k])
                idx.append(torch.cat([rows[d], rows[:1].expand(b - len(d))]))
                mask.append(torch.cat([torch.ones(len(d)), torch.zeros(b - len(d))]))
            batch = self._rows(self.enc_train, torch.cat(idx))
            batch[DP_MASK] = torch.cat(mask).to(self.device)
            return batch

        return sample

    def _lr_factor(self, t: float) -> float:
        """The schedule's f at ``t`` ∈ [0, 1), the share of the run done."""
        kind = self.cfg.train.lr_schedule
        if kind == "linear":
            return 1.0 - t
        if kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * t))
        return 1.0


    # ------------------------------------------------------------------------------------------
    # loading / storing clients
    def _load_record(self, slot: int, rec: Mapping[str, torch.Tensor]) -> None:
        """The method's part of a client state record into ``slot`` (the sampler's entries stay out)."""
        self.method.load_replica_state(slot, {n: v for n, v in rec.items() if not n.startswith(_RNG)})

    def _load(self, clients: Sequence[int]) -> list[ClientSampler]:
        """Each client's record into its slot; returns their data samplers."""
        samplers = []
        for i, k in enumerate(clients):
            rec = self.store.get(k)
            samplers.append(ClientSampler.from_state(self.sizes[k], rec))
            self._load_record(i, rec)
            self.dropout.load(i, rec)
        return samplers

    def _store(self, slot: int, client: int, sampler: ClientSampler) -> None:
        self.store.put(client, {**self.method.replica_state(slot), **sampler.state(), **self.dropout.state(slot)},
                       copy=False)


    def _apply(self, slot: int, download: Download) -> int:
        """Write ``download`` into ``slot`` (``Method.download``); returns the bytes it counts."""
        if not download.state:
            return download.nbytes or 0
        sent = self.method.download(slot, download.state)
        return sent.nbytes if download.nbytes is None else download.nbytes

    # the client executor of fedlora.server ---------------------------------------------------------
    def deliver(self, rnd: int, downloads: Mapping[int, Download]) -> dict[int, int]:
        """Apply ``downloads`` outside training (the final broadcast) and store the records,
        ``clients_per_pass`` at a time; returns the bytes each received."""
        sent = {}
        for chunk in chunks(list(downloads), self.P):
            self._bind(chunk)
            samplers = self._load(chunk)
            for i, k in enumerate(chunk):
                sent[k] = self._apply(i, downloads[k]) if downloads[k].counted else (self._apply(i, downloads[k]), 0)[1]
                self._store(i, k, samplers[i])
        return sent

    def merge_into_base(self, state: Mapping[str, torch.Tensor]) -> None:
        """FLoRA: the server merges the round's stack into the one shared base."""
        self._bind([0])
        self.method.apply_to_base(state)

    def train(self, rnd: int, clients: Sequence[int], downloads: Mapping[int, Download]
              ) -> dict[int, ClientUpdate | ClientFailure]:
        """Round ``rnd`` for ``clients``, in passes (``_passes``); each client's download applied
        after its record is loaded. A pass that raises is run again one client at a time, so a
        failing client is isolated from its pass-mates; a client whose pass fails on its own is a
        ``ClientFailure`` (its record is not stored: it stays as before the round)."""
        payloads: dict[int, Payload] = {}
        bytes_down: dict[int, int] = {}
        train_loss: dict[int, float] = {}
        ranks: dict[int, Any] = {}
        failed: dict[int, ClientFailure] = {}
        for chunk in self._passes(clients):
            try:
                self.train_pass(chunk, rnd, payloads, bytes_down, train_loss, ranks, downloads=downloads)
            except Exception as e:
                alone = [k for k in chunk if k not in payloads]  # (a client already stored keeps its result)
                if len(chunk) == 1:  # charged what it received before it failed (bytes count when received)
                    failed[chunk[0]] = ClientFailure(first_line(e), "error", bytes_down.get(chunk[0], 0))
                    continue
                for k in alone:  # isolate the failing client from its pass-mates
                    try:
                        self.train_pass([k], rnd, payloads, bytes_down, train_loss, ranks, downloads=downloads)
                    except Exception as e1:
                        failed[k] = ClientFailure(first_line(e1), "error", bytes_down.get(k, 0))
        out: dict[int, ClientUpdate | ClientFailure] = {}
        for k in clients:
            if k in failed:
                out[k] = failed[k]
            elif not math.isfinite(train_loss[k]):  # its record was not stored: it stays as before the round
                out[k] = ClientFailure(f"non-finite training loss {train_loss[k]}", "nonfinite_loss", bytes_down[k])
            else:
                out[k] = ClientUpdate(payloads[k], train_loss[k], ranks.get(k), bytes_down[k])
        return out

    # ------------------------------------------------------------------------------------------
    # a round
    def train_pass(self, clients: Sequence[int], rnd: int, payloads: dict[int, Payload],
                   bytes_down: dict[int, int], train_loss: dict[int, float],
                   ranks: dict[int, Any] | None = None, downloads: Mapping[int, Download] | None = None) -> None:
        """One pass of round ``rnd``: ``clients[p]`` in slot p — load, synchronise, the round's local
        steps, upload, store. Fills ``payloads``, ``bytes_down``, ``train_loss`` (and ``ranks``) per client.

        Clients with fewer local steps than their pass-mates (``train.local_epochs``) finish early:
        from then on their slot's loss is no longer counted, and once the pass's steps are done the
        slot is put back to the state it had after its own last step (parameters, optimizer moments and
        step counts, data sampler) before the round ends, the upload is taken and the record stored —
        so each client's record is the one of training its own steps, whatever its pass-mates do
        (its dropout generator included). ``downloads``: what each client receives (the server's;
        default none). A client whose mean training loss is not finite is not stored back (``train``
        reports it as failed).

        ``client_hook(client, rnd)``, when set, is called for each client before the pass
        trains (fault injection: a hook that raises is a client that fails)."""
        steps = [self.steps[k] for k in clients]
        I = max(steps)
        self.model.train(self.cfg.model.dropout)  # each client's own masks (fedlora.llm.dropout)
        self._bind(clients)
        if self.client_hook is not None:
            for k in clients:
                self.client_hook(k, rnd)
        samplers = self._load(clients)
        for i, k in enumerate(clients):
            bytes_down[k] = self._apply(i, downloads[k]) if downloads is not None else 0
        sdp = self.sample_dp
        sample = self._sampler_fn(samplers, clients) if sdp is None else self._private_sampler_fn(clients)
        self.method.begin_round(rnd)
        finished: dict[int, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}
        for j in range(I):
            self.method.set_lr_factor(self._lr_factor((rnd + j / I) / self.cfg.train.rounds))
            if sdp is not None:  # the draws of this step are keyed by (client, round, step): no state to keep
                sdp.at(rnd, j)
            self.method.local_step(self._objective, sample)
            for i, n in enumerate(steps):
                if n == j + 1 and n < I:  # slot i's client is done: keep its state as it is now
                    finished[i] = (self.method.replica_state(i),
                                   {**samplers[i].state(), **self.dropout.state(i)})
                    self._active[i] = 0.0
        for i, (state, sampler_state) in finished.items():
            self.method.load_replica_state(i, state)
            samplers[i] = ClientSampler.from_state(self.sizes[clients[i]], sampler_state)
            self.dropout.restore(i, sampler_state)
        self.method.end_round(rnd)
        mean_loss = (self._loss_sum / self._loss_n.clamp(min=1)).cpu().tolist()
        for i, k in enumerate(clients):
            up = self.method.upload(i)
            payloads[k] = Payload({n: v.detach().cpu() for n, v in up.tensors.items()}, dict(up.meta))
            train_loss[k] = mean_loss[i]
            if ranks is not None:
                ranks[k] = self.method.describe_replica(i)
            if math.isfinite(mean_loss[i]):
                self._store(i, k, samplers[i])

    def _passes(self, participants: Sequence[int]) -> list[list[int]]:
        """The round's passes: ``clients_per_pass`` participants at a time, in order; for a method
        whose replicas must take equal steps (``equal_steps_per_pass``) only clients with the same
        number of local steps share a pass."""
        if not self.method.equal_steps_per_pass:
            return chunks(participants, self.P)
        by_steps: dict[int, list[int]] = {}
        for k in participants:
            by_steps.setdefault(self.steps[k], []).append(k)
        return [c for group in by_steps.values() for c in chunks(group, self.P)]

    # ------------------------------------------------------------------------------------------
    # evaluation (read-only: records are not stored back)
    def _predict(self, enc: Mapping[str, torch.Tensor], row_sets: Sequence[np.ndarray],
                 params: Mapping[str, torch.Tensor] | None) -> list:
        """Every slot's predictions on its own rows (slot p: ``row_sets[p]``): the task's ``predict``."""
        ctx = EvalContext(forward=self._forward, rows=self._rows, slots=self._slots, batch_size=self.cfg.eval.batch_size,
                          model=self.model, tokenizer=self.tokenizer, decoding=self.cfg.eval.decoding)
        return self.task.predict(ctx, enc, row_sets, params)

    def evaluate(self, rnd: int, clients: Sequence[int], downloads: Mapping[int, Download]
                 ) -> dict[int, dict[str, dict[str, float]]]:
        """Each of ``clients`` scored on its own test and validation rows: its record with what it lacks
        of the current global state applied (``downloads``: the server's ``evaluation_downloads``, by
        trained client — Centralized's one model is client 0; read-only: nothing is stored back), its
        personalised model where the method has one. Client k → {"test": metrics, "val": metrics}."""
        m = self.method
        self.model.eval()  # no dropout
        per_client: dict[int, dict[str, dict[str, float]]] = {}
        for chunk in chunks(list(clients), self.P):
            owners = [0] * len(chunk) if self.centralized else chunk  # Centralized: the one model
            self._bind(owners)
            samplers = self._load(owners)
            for i, k in enumerate(owners):
                if k in downloads:
                    self._apply(i, downloads[k])
            params = m.personalised_params(self._objective, self._sampler_fn(samplers, owners))
            gating = m.instance_gating()
            if gating is not None:  # per-input adapter weights: each client's reference inputs first
                rows = [gating.reference_rows(self.train_sets[k], k, self.cfg.seed) for k in owners]
                idx, real = next(slot_batches(rows, max(len(r) for r in rows)))
                refs = self._represent(gating, self._rows(self.enc_train, idx)).view(len(owners), max(real), -1)
                self._refs = [refs[p, :n] for p, n in enumerate(real)]
                params, self._gating = gating.params, gating
            try:
                tests = self._predict(self.enc_test, [self.clients[k].test for k in chunk], params)
                vals = self._predict(self.enc_train, [self.clients[k].val for k in chunk], params)
            finally:
                self._gating = None
                set_row_gates(self.model, None)
            for i, k in enumerate(chunk):
                per_client[k] = {"test": self.task.score(tests[i], self.test_data, self.clients[k].test),
                                 "val": self.task.score(vals[i], self.train_data, self.clients[k].val)}
        return per_client

    def evaluate_global(self, state: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """The global model's scores on the whole test split: the server's ``state`` in a fresh replica
        (Centralized: the one model on the pooled data, its record)."""
        m = self.method
        self.model.eval()
        self._bind([0])
        if self.centralized:  # the one model on the pooled data is the global model
            self._load_record(0, self.store.get(0))
        else:  # the server's state in a fresh replica
            self._load_record(0, self.initial_record)
            m.global_replica(0)
            m.download(0, dict(state))
        everything = np.arange(len(self.test_data))
        return self.task.score(self._predict(self.enc_test, [everything], None)[0], self.test_data, everything)

    @torch.no_grad()
    def uploads(self, clients: Sequence[int]) -> dict[int, Payload]:
        """What each of ``clients`` would upload from its record as it is (no training; read-only), in passes."""
        out = {}
        for chunk in chunks(list(clients), self.P):
            self._bind(chunk)
            self._load(chunk)
            for i, k in enumerate(chunk):
                out[k] = self.method.upload(i)
        return out

    # records (checkpoints) -------------------------------------------------------------------------
    def records(self) -> dict[int, dict[str, torch.Tensor]]:
        """Every trained client's state record, as the store keeps it."""
        return {k: self.store.get(k) for k in range(self.K_train)}

    def restore(self, records: Mapping[int, Mapping[str, torch.Tensor]]) -> None:
        """Every client's record into the store (a resumed run; records another executor kept)."""
        for k, rec in records.items():
            self.store.put(k, rec, copy=True)

    # ------------------------------------------------------------------------------------------
    # client adapters (saving, export)
    def client_adapter(self, client: int, download: Download) -> dict[str, torch.Tensor]:
        """Client ``client``'s final model as one adapter per layer (no slot dimension) — the model
        ``evaluate`` scores: its record with ``download`` (what it lacks of the current global state;
        for Centralized, the one model's) applied (read-only), and
        where the method evaluates a personalised model (Per-FedAvg's one SGD step on a batch of the
        client's own data, ``Method.personalised_params``) that model, from the same record, so the
        same batch. Keys are the model's parameter names. A method that merges into the shared base
        (FLoRA) keeps the rest of the model there: ``merged_update``."""
        owner = 0 if self.centralized else client
        self._bind([owner])
        self.model.eval()  # as evaluate: no dropout in the personalisation step
        samplers = self._load([owner])
        self._apply(0, download)
        params = self.method.personalised_params(self._objective, self._sampler_fn(samplers, [owner]))
        return self._slot0_adapter(self.method.params if params is None else {n: params[n] for n in self.method.params})

    @torch.no_grad()
    def global_adapter(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The global model as one adapter per layer (``client_adapter``'s keys): the server's ``state`` in a fresh
        replica, the model ``evaluate_global`` scores — what a SecAgg+ run's server holds, so its adapters/."""
        self._bind([0])
        self.model.eval()
        self._load_record(0, self.initial_record)
        self.method.global_replica(0)
        self.method.download(0, dict(state))
        return self._slot0_adapter(self.method.params)

    def _slot0_adapter(self, src: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Slot 0's model from its parameters ``src`` (name → (P, …)): no slot dimension, with the method's
        buffers and the run's frozen head."""
        out = {n: p.detach()[0].cpu().clone() for n, p in src.items()}
        out.update({n: b[0].cpu().clone() for n, b in self.method.stacked_buffers().items()})
        if self.head_mode == "frozen":  # the run's own (seeded) head: no checkpoint holds it
            for h in self.head_linear:
                lin = self.model.get_submodule(h)
                out[f"{h}.weight"] = lin.weight.detach().cpu().clone()
                if lin.bias is not None:
                    out[f"{h}.bias"] = lin.bias.detach().cpu().clone()
        return out

    def merged_update(self) -> tuple[dict[str, torch.Tensor], str] | None:
        """What a method that merges into the shared base (FLoRA, ``incremental_download``) merged
        over the run — part of every client's model, the same for all — as ``(tensors, form)``;
        ``None`` for other methods. Form ``"lora"``: per adapted layer ``<layer>.lora_A`` (M, d_in)
        and ``<layer>.lora_B`` (d_out, M), ΔW = B A at scale 1, every round's stack concatenated
        (``FLoRA.merged_update``). Form ``"dense"`` (a half-precision base, whose per-round rounding
        no LoRA reproduces): ``<layer>.weight``, the merged base weight itself (d_out, d_in)."""
        if not self.method.incremental_download:
            return None
        factors = self.method.merged_update()
        if factors is not None:
            return {n: v.contiguous() for n, v in factors.items()}, "lora"
        return {f"{n}.weight": self.model.get_submodule(n).weight.detach().cpu().contiguous()
                for n in self.targets}, "dense"
