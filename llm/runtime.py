"""The LLM runtime (docs/design.md §8): many simulated clients, one frozen base model, slots and passes.

One frozen base model is in memory. Its target layers carry adapters with a leading dimension of S
slots (``fedlora.llm.inject``). A round draws its participants (``fedlora.simulator.Federation``); they are
trained ``clients_per_pass`` at a time. For a pass of S clients the runtime

1. gives every slot module S slots and binds the method to them (``Method.bind``: names,
   optimizers, the per-client configuration of the clients in the slots);
2. loads each client's state record (``fedlora.state``: factors, optimizer moments and step
   counts, ranks/masks, its data sampler) into its slot, then downloads into it whatever of the
   server's state changed since the client last synchronised (``DownloadLedger``) — a client
   selected after sitting out receives the current global state;
3. runs the round's local steps through the method's unchanged API: every objective call is ONE
   forward of the base model on the S clients' batches concatenated slot-major, where slot p's rows
   go through slot p's adapters (the stacked kernel op);
4. takes the uploads and stores the records back. Clients that sit out do no work at all.

The server then aggregates (the method's pure ``aggregate``), updates its state
(``server_update``) and the round is recorded. A client's numbers do not depend on its slot (bit for
bit); who shares its pass changes them only by the floating-point rounding of batched GEMMs (the
pass's padded length and row count), as any change of batch size does in PyTorch.

Evaluation loads every client (read-only: nothing is stored back), downloads the current global
state into it, and scores its personalised model on its own test and validation split; the global
model (methods that have one) is scored on the whole test split.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
import dataclasses
import zlib
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from torch.func import functional_call

from fedlora.errors import ConfigError
from fedlora.methods.base import Method
from fedlora.payload import Payload
from fedlora.io import OutputDir, claim_output_dir, write_bytes_atomic, write_json_atomic
from fedlora.server import ClientFailure, ClientUpdate, Download, Federation, Server, UploadSpec
from fedlora.state import ClientStore, record_nbytes

from .config import RunConfig
from .tasks import EvalContext, task_for
from .dropout import install_client_dropout
from .manifest import data_files, environment, file_hashes, split_indices
from .inject import SlotLoRALinear, head_linear_names, inject_adapters, make_head_trainable, match_targets, set_slots

__all__ = ["FederatedRun", "ClientSampler", "run", "run_class", "RUN_WRITES"]

_RNG = "sampler:"  # record entries of the runtime's own (the data sampler of the client)

#: every entry a run writes into its output folder: ``--overwrite`` clears a folder only when it holds
#: nothing else (``fedlora.io.claim_output_dir``). A new output file or folder must be added here.
RUNTIMES = ("embedded", "flower")  # fedlora run --runtime: this process, or Flower (fedlora.llm.flower)
RUN_WRITES = ("config.json", "run.json", "rounds.jsonl", "summary.json", "rounds.png", "adapters", "clients",
              "checkpoints")
CHECKPOINTS = "checkpoints"  # output_dir/checkpoints/round_<r>/ (fedlora.checkpoint), the last two kept


def _seed_of(*parts: Any) -> int:
    """A 63-bit seed from a tuple (crc32 of its repr: stable across processes and Python versions)."""
    return zlib.crc32(repr(parts).encode()) * 2_654_435_761 % (2**63 - 1)


class ClientSampler:
    """Minibatches of one client: epochs of a random permutation of its ``n`` training rows drawn
    from its own generator (part of its state record, so it resumes where it stopped)."""

    def __init__(self, n: int, seed: int) -> None:
        if n < 1:
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


def _chunks(seq: Sequence[int], size: int) -> list[list[int]]:
    return [list(seq[i:i + size]) for i in range(0, len(seq), size)]


#: where a config with heterogeneous client models cannot go (Flower's nodes build one model per run)
HETERO_EMBEDDED_ONLY = ("federation.client_models: heterogeneous client models run on the embedded runtime only "
                        "(`fedlora run CONFIG`; fedlora.llm.hetero.HeteroRun), not on Flower")


class FederatedRun:
    """One federated fine-tuning run of a HF classifier (``fedlora run CONFIG``).

    ``prepare()`` loads the model, data and method and creates every client's initial state record;
    ``run()`` does the rounds, evaluates and writes the outputs. Tests may pass a ready ``model``
    and ``tokenizer`` (the model is modified in place: adapters are injected).

    ``write``: the run's output folder (``cfg.output_dir``) is claimed before any work
    (``fedlora.io.claim_output_dir``: a folder that is not empty is refused unless ``overwrite``,
    which clears it) — or ``output``, a folder the caller has claimed (the command line)."""

    #: a run over one base model; ``fedlora.llm.hetero.HeteroRun`` (one base per group) sets it True
    groups_of_models = False

    def __init__(self, cfg: RunConfig, *, progress: bool = False, model=None, tokenizer=None,
                 write: bool = True, overwrite: bool = False, output: OutputDir | None = None,
                 runtime: str = "embedded", log: Callable[[str], None] | None = None) -> None:
        if runtime not in RUNTIMES:
            raise ConfigError(f"--runtime: one of {', '.join(RUNTIMES)}, got {runtime!r}")
        if cfg.federation.client_models is not None and not self.groups_of_models:
            raise ConfigError(HETERO_EMBEDDED_ONLY)
        self.cfg, self.runtime = cfg, runtime
        self.progress, self.write = progress, write
        #: called with one line per finished round (``_round_line``) — ``fedlora run`` passes ``print`` when
        #: there is no progress bar or stdout is not a terminal; None: silent
        self.log = log
        self.overwrite, self.output = overwrite, output
        self._given_model, self._given_tokenizer = model, tokenizer
        self.prepared = False
        self.client_hook: Callable[[int, int], None] | None = None
        self._resume_from = None  # a verified checkpoint (``FederatedRun.resume``)
        #: who executes the clients' rounds (fedlora.server.ClientExecutor): this run itself (the slot
        #: executor), or e.g. the Flower runtime's executor, which sends each client's round to its node;
        #: ``executor_factory(run)`` builds it once the run is prepared
        self.executor = self
        self.executor_factory: Callable[["FederatedRun"], Any] | None = None
        self._lines: list[str] = []  # rounds.jsonl as written
        self._done = 0  # the round records (round ≥ 1) in _lines: run.json's rounds_done
        #: wall seconds of the earlier parts of a resumed run (from the checkpoint; None: not recorded)
        self._wall_before: list[float | None] = []
        self._t0: float | None = None  # when this part's rounds started (time.perf_counter)

    @classmethod
    def resume(cls, run_dir: str | os.PathLike, config: RunConfig | str | os.PathLike | None = None,
               overrides: Sequence[str] = (), progress: bool = False,
               log: Callable[[str], None] | None = None) -> "FederatedRun":
        """A run that continues the interrupted run in ``run_dir`` from its newest intact checkpoint
        (``fedlora run --resume RUN_DIR``); ``.run()`` finishes it, bit for bit as if it had never
        stopped (CPU). ``config`` / ``overrides``: optional, and must then equal the run's own config
        (every field but ``output_dir``): a one-line ``ConfigError`` names the fields that differ. Also
        refused in one line: a folder that is not a run, a complete run, a run without an intact checkpoint."""
        from fedlora.checkpoint import load_checkpoint

        from .config import apply_overrides, load_config
        from .export import config_digest

        from .runfolder import read_run_config, read_status

        folder = Path(run_dir)
        info = read_run_config(folder, "--resume")  # the one reader of run folders (docs/design.md §9)
        saved = info["config"]
        if read_status(folder) == "complete":
            raise ConfigError(f"--resume: the run in {str(folder)!r} is complete (run.json); nothing to resume")
        if config is None:
            given = RunConfig.from_dict(apply_overrides(saved, overrides))
        elif isinstance(config, RunConfig):
            given = config
        else:
            given = load_config(config, overrides)
        diff = config_differences(_comparable(saved), _comparable(given.to_dict()))
        if diff:
            raise ConfigError(f"--resume: the config differs from the run's in {', '.join(diff[:8])}"
                              f"{' …' if len(diff) > 8 else ''}; a resumed run continues the same run — start a "
                              f"new one (another --out) to change them")
        ckpt = load_checkpoint(folder / CHECKPOINTS)
        if ckpt.meta.get("config_sha256") != config_digest(_comparable(saved)):
            raise ConfigError(f"--resume: the checkpoint {str(ckpt.path)!r} belongs to another config than "
                              f"{str(folder / 'config.json')!r}")
        cfg = RunConfig.from_dict({**given.to_dict(), "output_dir": str(folder)})
        runtime = info["resolved"].get("runtime", "embedded")
        run = run_class(cfg)(cfg, progress=progress, output=OutputDir(folder, None, RUN_WRITES), runtime=runtime,
                             log=log)
        run._resume_from = ckpt
        return run

    def flower_config(self) -> dict[str, Any]:
        """What a Flower node rebuilds this run from (``fedlora.llm.flower``): the config."""
        return self.cfg.to_dict()

    def _claim(self) -> None:
        """Claim the output folder (once, before any work; ``prepare`` may write ``clients/`` there)."""
        if self.write and self.output is None:
            self.output = claim_output_dir(self.cfg.output_dir, "output_dir", writes=RUN_WRITES,
                                           overwrite=self.overwrite, overwrite_flag="overwrite=True")

    # ------------------------------------------------------------------------------------------
    # preparation
    def prepare(self) -> "FederatedRun":
        """Load data, model and method, inject the adapters (``prepare_model``), then create every
        client's initial state record and the server (``prepare_clients``)."""
        return self.prepare_model().prepare_clients()

    def prepare_model(self) -> "FederatedRun":
        """The method (its options checked first), the data and the clients' split, the frozen base
        model with the method's adapters injected and the head set up — nothing bound yet, so a caller
        may still set the method's options that depend on the model (heterogeneous client models:
        H²Tune's common ``global_layers``, ``fedlora.llm.hetero``)."""
        from .model import torch_dtype

        cfg = self.cfg
        self._claim()
        if cfg.train.threads is not None:
            torch.set_num_threads(cfg.train.threads)
        self._settings()  # cheap checks first: bad options fail before any loading

        # data ------------------------------------------------------------------------------
        self._load_data()
        fc = cfg.federation

        # model -----------------------------------------------------------------------------
        mc = cfg.model
        self._base_model()
        if self.method.needs_second_order:  # fused SDPA kernels have no double backward (CPU flash)
            _eager_attention(self.model)
        self.dtype = torch_dtype(mc.dtype)
        self.enc_train = self.task.encode(self.train_data, self.tokenizer, mc.max_length)
        self.enc_test = self.task.encode(self.test_data, self.tokenizer, mc.max_length)

        # adapters ----------------------------------------------------------------------------
        K = fc.clients
        self.centralized = self.method.pooled_data
        self.K_train = 1 if self.centralized else K  # Centralized: one model on the pooled data
        self.P = min(self._clients_per_pass(), self.K_train)
        self._adapt(self.P)
        if hasattr(self.method, "shared_base"):
            self.method.shared_base = True  # FLoRA: one base for all clients, merged server-side
        self.model.to(device=self.device)
        self.dropout = install_client_dropout(self.model, mc.dropout, mc.max_length, self.device)  # eval mode
        self._lora_layers = [m for m in self.model.modules() if isinstance(m, SlotLoRALinear)]
        if hasattr(self.method, "output_fn"):
            self.method.output_fn = self._logits_fn  # H²Tune's eq. 7 needs the logits
        return self

    # the checks of the preparation, each ONE function that the run (prepare_model) and its dry run (check) call
    def _settings(self, machine: bool = True) -> None:
        """The device (``model.device``) and the method, its options checked (``self.device``, ``self.method``).
        ``machine``: refuse a device this machine lacks (a dry run, which may check a GPU run's config on a
        laptop, says so in its output instead)."""
        cfg = self.cfg
        self.device = torch.device("cuda" if cfg.model.device == "auto" and torch.cuda.is_available()
                                   else ("cpu" if cfg.model.device == "auto" else cfg.model.device))
        if machine and self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"model.device: {cfg.model.device!r} but CUDA is not available")
        self.method = self._build_method()

    def _base_model(self) -> None:
        """The task's frozen base model and tokenizer (``self.model``, ``self.tokenizer``; the task checks they fit
        it), and ``model.max_length`` against the model's positions. Inside ``fedlora.llm.model.skeleton_models()``
        (a dry run) the model is built from its config on the meta device."""
        mc = self.cfg.model
        self.model, self.tokenizer = self.task.build_model(dataclasses.asdict(mc), self.cfg.seed,
                                                           model=self._given_model, tokenizer=self._given_tokenizer)
        check_max_length(self.model, mc.max_length)

    def _adapt(self, slots: int) -> None:
        """Inject the method's adapters with ``slots`` slots into the base model and set up the head: the target
        modules matched (``match_targets``), every layer's rank against its min(d_in, d_out) (``SlotLoRALinear``),
        the head policy resolved (``model.head`` → ``self.head_mode``) and the head it needs present."""
        mc = self.cfg.model
        kwargs = dict(self.method.adapter_kwargs())
        if mc.lora_alpha is not None:
            kwargs["alpha"] = float(mc.lora_alpha)
            if kwargs.get("client_rank"):
                kwargs["client_alpha"] = float(mc.lora_alpha)
        self.targets = match_targets(self.model, mc.target_modules, mc.layers)
        inject_adapters(self.model, self.targets, slots=slots, **kwargs)
        self.head_mode = self._head_mode()
        self.head_linear = head_linear_names(self.model)
        self.head = make_head_trainable(self.model, slots) if self.head_mode != "frozen" else []
        if self.head_mode != "frozen" and not self.head:
            raise ConfigError(f"model.head: {self.head_mode!r} but the model has no nn.Linear classifier head "
                              f"(modules named 'classifier', 'score' or 'qa_outputs')")
        self.method.head_mode = self.head_mode

    def check(self) -> dict[str, Any]:
        """``fedlora run --dry-run``: every check of the run's preparation (``prepare_model``), by the same functions,
        with no weights loaded and nothing trained or written — the method and device (``_settings``), the data
        and its split (``check_data``), the model built from its config on the meta device (``_base_model`` in
        ``skeleton_models``: the task's fit, ``model.max_length`` against its positions), the windows of
        extractive QA (``check_fits``), the target modules, ranks and head (``_adapt``), per-client dropout
        (``install_client_dropout``). What a dry run does not fetch (hub data; a hub model not in the HF cache) is
        said in the result, not refused.
        A device this machine lacks (``model.device: cuda`` on a laptop) is said, not refused: the config may be
        for another machine. Returns ``{"data": …, "head": …, "model": …}``: what was checked and the facts
        resolved (the head policy, the targets)."""
        from .model import ModelUnavailable, skeleton_models
        from .qa import QATask

        if self.runtime == "flower":  # as run() does first
            from .flower import check_flower_config

            check_flower_config(self.cfg)
        self._settings(machine=False)
        data = self.check_data()
        if not data["checked"]:
            self._task_without_rows()
        try:
            with skeleton_models():
                self._base_model()
        except ModelUnavailable as e:
            return {"data": data, "head": self._head_mode(),
                    "model": {"checked": False,
                              "why": f"{e.key} {e.name!r} is not in the Hugging Face cache and a dry run downloads "
                                     f"nothing: model.target_modules, the ranks, model.max_length and the model's "
                                     f"head are checked when the run has the model"}}
        fits = getattr(self.task, "check_fits", None)  # extractive QA: every question's windows
        if fits is not None and data["checked"]:
            fits(self.train_data, self.tokenizer, self.cfg.model.max_length)
            fits(self.test_data, self.tokenizer, self.cfg.model.max_length)
        self._adapt(1)
        install_client_dropout(self.model, self.cfg.model.dropout, self.cfg.model.max_length, "cpu")  # as the run
        mod = {"checked": True, "model_type": getattr(self.model.config, "model_type", None), **self._machine(),
               "targets": len(self.targets), "target_modules": sorted({t.rsplit(".", 1)[-1] for t in self.targets}),
               "head_linear": self.head_linear}
        if not data["checked"] and isinstance(self.task, QATask):
            mod["not_checked"] = "the questions' windows in model.max_length (data.doc_stride): the data is not fetched"
        return {"data": data, "head": self.head_mode, "model": mod}

    def _machine(self) -> dict[str, str]:
        """A dry run's word on a device this machine lacks (the run refuses it here: ``_settings``)."""
        if self.device.type == "cuda" and not torch.cuda.is_available():
            return {"device": f"model.device {self.cfg.model.device!r}: CUDA is not available on this machine; "
                              f"the run needs a machine that has it"}
        return {}

    def _task_without_rows(self) -> None:
        """The task's setup where a dry run does not fetch the data (hub): a registered task's class names give
        the classifier's size (a Hub dataset without a task: 2, the head's size not checked); a generation task's
        decoding settings (``eval.decoding`` over the task's) bound its positions."""
        from .classification import ClassificationTask
        from .generation import GenerationTask, check_decoding

        dc = self.cfg.data
        self.task = task_for(dc.task, dc.target_column)
        spec = self.task.spec
        if isinstance(self.task, ClassificationTask):
            names = spec.label_names if spec is not None else None
            self.task.label_names = list(names) if names else ["0", "1"]
            self.task.num_labels = len(self.task.label_names)
        elif isinstance(self.task, GenerationTask):
            self.task.decoding = check_decoding({**dict(spec.decoding if spec else ()), **self.cfg.eval.decoding})

    def prepare_clients(self) -> "FederatedRun":
        """Every client's initial state record (``ClientStore``) and the round protocol's ``Server``."""
        cfg, fc = self.cfg, self.cfg.federation
        self.store = ClientStore(fc.store, Path(cfg.output_dir) / "clients" if fc.store == "disk" else None)
        train_sets = [np.concatenate([c.train for c in self.clients])] if self.centralized else \
            [c.train for c in self.clients]
        self.train_sets = [self.task.train_rows(self.enc_train, np.sort(t)) for t in train_sets]  # QA: features
        self.sizes = [len(t) for t in self.train_sets]
        self.steps = self._local_steps()
        self.federation = Federation(n_groups=1, n_clients=self.K_train, client_weights=self.sizes,
                                     sample_fraction=1.0 if self.centralized else fc.sample_fraction,
                                     sample_seed=cfg.seed)
        initial: dict[str, torch.Tensor] | None = None
        for chunk in _chunks(list(range(self.K_train)), self.P):
            self._bind(chunk)
            self._init_slots(chunk)
            self.method.init_state()
            if initial is None:
                initial = {k: v.detach().cpu().clone() for k, v in self.method.initial_server_state(0).items()}
            for i, k in enumerate(chunk):
                sampler = ClientSampler(self.sizes[k], _seed_of(cfg.seed, "sampler", k))
                self.store.put(k, {**self.method.replica_state(i), **sampler.state(),
                                   **self.dropout.initial_state(_seed_of(cfg.seed, "dropout", k))}, copy=False)
        self.initial_record = self.store.get(0)
        # the round protocol (fedlora.server): this run is its client executor (train / deliver / merge_into_base)
        self.server = Server(self.method, self.federation, [initial], cfg.train.rounds,
                             min_clients=1 if self.centralized else fc.min_clients,
                             spec=UploadSpec.of(self.method))
        self.history: list[dict[str, Any]] = []
        self.prepared = True
        return self

    def _check_test_rows(self) -> None:
        """Clients whose split gave them no test rows are left out of the clients' mean (``n_skipped``
        in every evaluation; the summary says how many). Refused before training when that is most of
        the clients (more than half) unless ``eval.allow_clients_without_test``, and always when none
        has a test row."""
        K = len(self.clients)
        self.clients_without_test = [k for k, c in enumerate(self.clients) if len(c.test) == 0]
        n = len(self.clients_without_test)
        how = (f"the {len(self.test_data)} test rows go to the clients that hold their labels "
               f"(partition {self.cfg.federation.partition!r})")
        if n == K:
            raise ConfigError(f"federation.clients: none of the {K} clients gets a test row ({how}); use fewer "
                              f"clients or more test data (data.max_test_samples, data.test_fraction)")
        if 2 * n > K and not self.cfg.eval.allow_clients_without_test:
            raise ConfigError(f"federation.clients: {n} of {K} clients get no test rows ({how}), so the clients' "
                              f"mean would score only {K - n}; use fewer clients or more test data "
                              f"(data.max_test_samples, data.test_fraction), or set "
                              f"eval.allow_clients_without_test: true to leave them out of the mean")

    def _load_data(self) -> None:
        """The labelled text, the clients' split and its report (``train_data``, ``test_data``,
        ``task``, ``num_labels``, ``clients``, ``split_report``): every check of the data and the
        partition, with no model loaded (``check_data`` runs it for a dry run)."""
        from . import data as D

        cfg, dc, fc = self.cfg, self.cfg.data, self.cfg.federation
        columns = {field: getattr(dc, key.split(".")[1]) for field, key in D.CONFIG_FIELD.items()
                   if getattr(dc, key.split(".")[1]) is not None} or None  # the task's columns, overridden field by field
        from fedlora.partition import validate_partition_spec

        scheme, params = validate_partition_spec(fc.partition)
        if scheme == "by_key" and params.get("column") is not None:  # by_key(topic): the key column
            if dc.client_column is not None and dc.client_column != params["column"]:
                raise ConfigError(f"federation.partition: {fc.partition!r} names the key column "
                                  f"{params['column']!r} but data.client_column is {dc.client_column!r}; give one")
            columns = {**(columns or {}), "client_key": params["column"]}
        if cfg.tiny and dc.path is None and dc.hf_name is not None:
            raise ConfigError("tiny: data.hf_name has no offline stand-in; give data.task (a registered task) "
                              "or data.path (local files)")
        self.task = task_for(dc.task, dc.target_column)
        self.train_data, self.test_data = self.task.load_data(cfg, columns)
        splits = D.split_clients(self.train_data, self.test_data, partition=fc.partition, n_clients=fc.clients,
                                 seed=cfg.seed, val_fraction=fc.val_fraction)
        self.clients = [dataclasses.replace(s, test=s.test[:cfg.eval.max_samples]) for s in splits]  # None: all
        self.split_report = D.describe_split(splits, self.train_data, self.test_data)
        from .runfolder import data_label

        self.task_label = data_label(self.task.name, self.task.kind, dc.task, dc.path)
        self._check_test_rows()

    def check_data(self) -> dict[str, Any]:
        """A dry run's data check: read the local or bundled data (columns, labels), split it among the
        clients (the partition against this data) — no model, no training. Hub data is not fetched
        (returns ``{"checked": False, …}``): a dry run must work offline."""
        dc = self.cfg.data
        if not self.cfg.tiny and (dc.hf_name is not None or (dc.path is None and dc.task is not None
                                                             and not _is_bundled_task(dc.task))):
            return {"checked": False, "why": "data from the hub is not fetched by a dry run"}  # tiny: stand-in rows
        self._load_data()
        return {"checked": True, "task": self.task_label, "labels": list(self.train_data.label_names),
                "train_rows": len(self.train_data.labels), "test_rows": len(self.test_data.labels),
                "client_train_sizes": [len(c.train) for c in self.clients],
                "client_test_sizes": [len(c.test) for c in self.clients]}

    def _build_method(self) -> Method:
        from .config import build_method, effective_options

        self.method_options = effective_options(self.cfg)  # every option with its value (config.json)
        return build_method(self.cfg)

    def _head_mode(self) -> str:
        mode = self.cfg.model.head
        m = self.method
        if not self.task.has_head:  # e.g. generation: the LM head is the base model's own, frozen
            if mode not in ("auto", "frozen"):
                raise ConfigError(f"model.head: the {self.task.kind} task {self.task.name!r} has no classifier head "
                                  f"to train; leave model.head at auto or frozen (got {mode!r})")
            return "frozen"
        if mode == "auto":
            return m.default_head
        if mode not in m.head_modes:
            raise ConfigError(f"model.head: {m.name} supports {', '.join(m.head_modes)} (the paper's setting), "
                              f"got {mode!r}")
        return mode

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
                    g = torch.Generator().manual_seed(_seed_of(seed, "adapter", owner, j, down))
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
        if params:
            out = functional_call(self.model, dict(params), args=(), kwargs=inputs, strict=False)
        else:
            out = self.model(**inputs)
        return self.task.model_output(out)

    def _objective(self, params: Mapping[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Each slot's mean loss, (S,) (the task's ``loss``): the Objective contract of ``fedlora.methods``."""
        ce = self.task.loss(self._forward(params, batch), batch, self._slots)
        # on the model's device (no host sync per step); a slot that has finished its steps counts no more
        self._loss_sum += ce.detach().double() * self._active
        self._loss_n += self._active
        return ce

    def _logits_fn(self, params: Mapping[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self.task.outputs(self._forward(params, batch), batch, self._slots)

    def _sampler_fn(self, samplers: Sequence[ClientSampler], clients: Sequence[int]) -> Callable[[], dict]:
        b = self.cfg.train.batch_size

        def sample() -> dict[str, torch.Tensor]:
            idx = torch.cat([torch.as_tensor(self.train_sets[k])[s.next(b)] for s, k in zip(samplers, clients)])
            return self._rows(self.enc_train, idx)

        return sample

    def _lr_factor(self, t: float) -> float:
        """The schedule's f at ``t`` ∈ [0, 1), the share of the run done."""
        kind = self.cfg.train.lr_schedule
        if kind == "linear":
            return 1.0 - t
        if kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * t))
        return 1.0

    def _clients_per_pass(self) -> int:
        """``federation.clients_per_pass``, with ``auto`` resolved (see ``auto_clients_per_pass``)."""
        fc = self.cfg.federation
        if fc.clients_per_pass != "auto":
            return fc.clients_per_pass
        return auto_clients_per_pass(self.device, max(1, math.ceil(fc.sample_fraction * fc.clients - 1e-9)),
                                     self.model if hasattr(self, "model") else None, self.cfg.train.batch_size,
                                     self.cfg.model.max_length)

    def _local_steps(self) -> list[int]:
        """Each training client's local steps per round: ``train.local_epochs`` E → ⌈E·n_k/b⌉, else
        ``train.local_steps`` (default 10). Pooled data (Centralized) takes the federation's total of
        a round — the participants' steps added up — so both references see as many batches per round."""
        t, b = self.cfg.train, self.cfg.train.batch_size
        if t.local_epochs is not None:
            return [max(1, math.ceil(t.local_epochs * n / b - 1e-9)) for n in self.sizes]
        per_client = t.local_steps if t.local_steps is not None else 10
        if self.centralized:
            fc = self.cfg.federation
            return [per_client * max(1, math.ceil(fc.sample_fraction * fc.clients - 1e-9))]
        return [per_client] * len(self.sizes)

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

    @property
    def ledger(self):
        """The server's ledger of what each client lacks (``fedlora.server.DownloadLedger``)."""
        return self.server.ledgers[0]

    @property
    def server_state(self) -> dict[str, torch.Tensor]:
        """The server's current state (``Method.server_update`` after the last round)."""
        return self.server.states[0]

    def _apply(self, slot: int, download: Download) -> int:
        """Write ``download`` into ``slot`` (``Method.download``); returns the bytes it counts."""
        if not download.state:
            return download.nbytes or 0
        sent = self.method.download(slot, download.state)
        return sent.nbytes if download.nbytes is None else download.nbytes

    def _sync(self, slot: int, client: int, rnd: int, count: bool) -> int:
        """Download into ``slot`` what ``client`` lacks of the server's state (``Server.download_for``;
        the base already holds every merge of FLoRA); ``count``: mark it synchronised up to ``rnd``.
        Returns the bytes."""
        sent = self._apply(slot, self.server.download_for(client, shared_base=True))
        if count:
            self.ledger.sync(client, rnd)
        return sent

    # the client executor of fedlora.server ---------------------------------------------------------
    live = False        # clients receive what they lack with their next round's instructions
    shared_base = True  # one base model: FLoRA's increments are merged into it once per round

    def deliver(self, rnd: int, downloads: Mapping[int, Download]) -> dict[int, int]:
        """Apply ``downloads`` outside training (the final broadcast) and store the records,
        ``clients_per_pass`` at a time; returns the bytes each received."""
        sent = {}
        for chunk in _chunks(list(downloads), self.P):
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
                    failed[chunk[0]] = ClientFailure(_first_line(e), "error", bytes_down.get(chunk[0], 0))
                    continue
                for k in alone:  # isolate the failing client from its pass-mates
                    try:
                        self.train_pass([k], rnd, payloads, bytes_down, train_loss, ranks, downloads=downloads)
                    except Exception as e1:
                        failed[k] = ClientFailure(_first_line(e1), "error", bytes_down.get(k, 0))
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
        (its dropout generator included). ``downloads``: what each client receives (the server's);
        default what it lacks now, marked synchronised. A client whose mean training loss is not
        finite is not stored back (``train`` reports it as failed).

        ``client_hook(client, rnd)``, when set on the run, is called for each client before the pass
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
            bytes_down[k] = (self._apply(i, downloads[k]) if downloads is not None
                             else self._sync(i, k, rnd - 1, count=True))
        sample = self._sampler_fn(samplers, clients)
        self.method.begin_round(rnd)
        finished: dict[int, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}
        for j in range(I):
            self.method.set_lr_factor(self._lr_factor((rnd + j / I) / self.cfg.train.rounds))
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
            return _chunks(participants, self.P)
        by_steps: dict[int, list[int]] = {}
        for k in participants:
            by_steps.setdefault(self.steps[k], []).append(k)
        return [c for group in by_steps.values() for c in _chunks(group, self.P)]

    def run_round(self, rnd: int) -> dict[str, Any]:
        """Round ``rnd`` of the server's protocol (``fedlora.server.Server.run_round``) with this run as
        its client executor; returns the round's record."""
        return self.server.run_round(self.executor, rnd)

    # ------------------------------------------------------------------------------------------
    # evaluation (read-only: records are not stored back)
    def _predict(self, enc: Mapping[str, torch.Tensor], row_sets: Sequence[np.ndarray],
                 params: Mapping[str, torch.Tensor] | None) -> list:
        """Every slot's predictions on its own rows (slot p: ``row_sets[p]``): the task's ``predict``."""
        ctx = EvalContext(forward=self._forward, rows=self._rows, slots=self._slots, batch_size=self.cfg.eval.batch_size,
                          model=self.model, tokenizer=self.tokenizer, decoding=self.cfg.eval.decoding)
        return self.task.predict(ctx, enc, row_sets, params)

    def evaluate_clients(self, clients: Sequence[int], rnd: int, downloads: Mapping[int, Download] | None = None
                         ) -> dict[int, dict[str, dict[str, float]]]:
        """Each of ``clients`` scored on its own test and validation rows: its record with what it lacks
        of the current global state (read-only: nothing is stored back) — ``downloads``, where the
        server sent it (Flower), else this run's server's — its personalised model where the method
        has one. Client k → {"test": metrics, "val": metrics}."""
        m = self.method
        self.model.eval()  # no dropout
        per_client: dict[int, dict[str, dict[str, float]]] = {}
        for chunk in _chunks(list(clients), self.P):
            owners = [0] * len(chunk) if self.centralized else chunk  # Centralized: the one model
            self._bind(owners)
            samplers = self._load(owners)
            for i, k in enumerate(owners):
                if downloads is not None:
                    self._apply(i, downloads[k])
                else:
                    self._sync(i, k, rnd, count=False)
            params = m.personalised_params(self._objective, self._sampler_fn(samplers, owners))
            tests = self._predict(self.enc_test, [self.clients[k].test for k in chunk], params)
            vals = self._predict(self.enc_train, [self.clients[k].val for k in chunk], params)
            for i, k in enumerate(chunk):
                per_client[k] = {"test": self.task.score(tests[i], self.test_data, self.clients[k].test),
                                 "val": self.task.score(vals[i], self.train_data, self.clients[k].val)}
        return per_client

    def evaluate(self, rnd: int) -> dict[str, Any]:
        """The evaluation after round ``rnd`` (−1: before training): every client's scores
        (``evaluate_clients``, run by the executor — here, or on the clients' machines), their
        unweighted and size-weighted means, and the global model's where the method has one."""
        from .metrics import aggregate_client_metrics

        K, m = self.cfg.federation.clients, self.method
        runner = getattr(self.executor, "evaluate_clients", None) if self.executor is not self else None
        per_client = (runner or self.evaluate_clients)(list(range(K)), rnd)
        out: dict[str, Any] = {"round": rnd + 1, "clients": {str(k): per_client[k] for k in range(K)}}
        sizes = [len(self.clients[k].test) for k in range(K)]
        out["test"] = aggregate_client_metrics([per_client[k]["test"] for k in range(K)], sizes)  # size 0: skipped
        if self.cfg.eval.global_model and m.has_global_model:
            self.model.eval()
            self._bind([0])
            if self.centralized:  # the one model on the pooled data is the global model
                self._load_record(0, self.store.get(0))
            else:  # the server's state in a fresh replica
                self._load_record(0, self.initial_record)
                m.global_replica(0)
                m.download(0, dict(self.server_state))
            everything = np.arange(len(self.test_data))
            out["global"] = self.task.score(self._predict(self.enc_test, [everything], None)[0], self.test_data,
                                            everything)
        return out

    # ------------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """All rounds with evaluation; writes ``output_dir`` (see docs/reference/run-folder.md), claimed before
        any work (``_claim``). ``run.json`` says whether the run is running, complete, interrupted or
        failed; a run that stops early (an error, SIGINT/SIGTERM) marks or removes it (``_abandon``)."""
        self._claim()  # an unusable or occupied output folder is found before any work
        try:
            if self.runtime == "flower":
                from .flower import check_flower_config, run_simulation

                check_flower_config(self.cfg)
                if self.executor_factory is None:  # no Flower deployment given: Flower's simulation engine
                    return run_simulation(self)
            return self._run()
        except BaseException as e:
            if self.write:
                self._abandon(e)
            raise

    def _run(self) -> dict[str, Any]:
        cfg = self.cfg
        out = Path(cfg.output_dir)
        if not self.prepared:
            self.prepare()
        if self.executor_factory is not None:
            self.executor = self.executor_factory(self)
        if self._resume_from is not None:  # rounds.jsonl, the server, every client: as the checkpoint left them
            start, evals = self._restore(self._resume_from)
        else:
            start, self._lines = 0, []
            if self.write:
                write_json_atomic(out / "config.json", {"config": cfg.to_dict(), "resolved": self.describe()})
                (out / "rounds.jsonl").write_text("")
            evals = [self.evaluate(-1)]
            self._append(out, {"round": 0, "eval": evals[0]})
        if self.write:
            self._write_status("running")
        bar = self._bar = _progress(cfg.train.rounds, self.progress, initial=start)  # a resumed run's bar: at start
        self._t0 = time.perf_counter()
        with _deferred_signals() as pending:
            for rnd in range(start, cfg.train.rounds):
                rec = self.run_round(rnd)  # after the last round: the final global state to every client (counted)
                last = rnd == cfg.train.rounds - 1
                if last or (rnd + 1) % cfg.eval.every == 0:
                    ev = self.evaluate(rnd)
                    rec["eval"] = ev
                    evals.append(ev)
                self.history.append(rec)
                self._append(out, rec)
                every = cfg.train.checkpoint_every
                if self.write and ((every and (rnd + 1) % every == 0) or (pending and not last)):
                    self.save_checkpoint(rnd + 1)
                bar.update(1)
                ev = rec.get("eval")
                if ev is not None and rec["train_loss"]:
                    bar.set_postfix(self._postfix(ev, rec))
                if self.log is not None:
                    self.log(self._round_line(rec, self._wall_total(self._wall_parts())))
                if pending and not last:  # SIGINT/SIGTERM during the round: it finished and is checkpointed
                    from fedlora.errors import Interrupted

                    raise Interrupted(pending[0])
        bar.close()
        remote = getattr(self.executor, "client_records", None) if self.executor is not self else None
        if remote is not None:  # on Flower the final records live on the clients' nodes: the adapters come from them
            for k, rec in remote().items():
                self.store.put(k, rec, copy=False)
        parts = self._wall_parts()  # a resumed run: each part's rounds, the total in wall_s
        summary = self._summary(evals, self._wall_total(parts))
        summary["wall_s_parts"] = parts
        if self.write:
            self.save_adapters(out / "adapters")
            write_json_atomic(out / "summary.json", summary)
            try:
                self._plot(evals, out / "rounds.png")
            except Exception as e:  # a figure must never lose a run's results
                summary["plot_error"] = str(e)
            self._write_status("complete")
        return summary

    # ------------------------------------------------------------------------------------------
    # checkpoints and resume (fedlora.checkpoint)
    def checkpoint_files(self) -> dict[str, bytes]:
        """Everything a resumed run needs that ``prepare`` does not rebuild: the server's
        ``state_dict`` (``server.safetensors``), every client's state record (``client_<k>.safetensors``),
        the method's runtime state and the torch RNG (``runtime.safetensors``) and the records so far
        (``rounds.jsonl``, exactly the lines written)."""
        from safetensors.torch import save

        from fedlora.state import record_to_bytes

        st = self.server.state_dict()
        files = {"server.safetensors": save({k: v.contiguous() for k, v in st["tensors"].items()},
                                            metadata={"server": json.dumps(st["meta"])})}
        remote = getattr(self.executor, "client_records", None) if self.executor is not self else None
        records = remote() if remote is not None else {k: self.store.get(k) for k in range(self.K_train)}
        for k in range(self.K_train):  # (on Flower the records live on the clients' nodes: asked for)
            files[f"client_{k}.safetensors"] = record_to_bytes(records[k])
        runtime = {f"method:{n}": v.contiguous() for n, v in self.method.runtime_state().items()}
        runtime["rng:torch"] = torch.get_rng_state()
        files["runtime.safetensors"] = save(runtime)
        files["rounds.jsonl"] = "".join(line + "\n" for line in self._lines).encode()
        return files

    def save_checkpoint(self, rounds_done: int) -> Path:
        """``output_dir/checkpoints/round_<r>/`` (atomic, hashed, the last two kept)."""
        from fedlora.checkpoint import write_checkpoint

        from .export import config_digest

        return write_checkpoint(Path(self.cfg.output_dir) / CHECKPOINTS, rounds_done, self.checkpoint_files(),
                                meta={"config_sha256": config_digest(_comparable(self.cfg.to_dict())),
                                      "rounds": self.cfg.train.rounds, "method": self.method.name,
                                      # the rounds' wall time so far, per part (a resumed run adds one)
                                      "wall_s_parts": self._wall_parts()})

    def _restore(self, ckpt) -> tuple[int, list[dict[str, Any]]]:
        """Put the run in the state of ``ckpt`` (a verified ``fedlora.checkpoint.Checkpoint``): server,
        client records, method runtime state, torch RNG, the records (rounds.jsonl rewritten to the
        checkpoint's lines). Returns (the next round, the evaluations so far)."""
        from safetensors.torch import load

        from fedlora.state import record_from_bytes

        server = Payload.from_bytes(ckpt.files["server.safetensors"])
        self.server.load_state_dict({"tensors": dict(server.tensors), "meta": json.loads(server.meta["server"])})
        records = {k: record_from_bytes(ckpt.files[f"client_{k}.safetensors"]) for k in range(self.K_train)}
        for k, rec in records.items():
            self.store.put(k, rec, copy=True)
        if self.executor is not self and hasattr(self.executor, "restore_records"):
            self.executor.restore_records(records)  # on Flower: every node takes its record back
        runtime = load(ckpt.files["runtime.safetensors"])
        self.method.load_runtime_state({n[len("method:"):]: v for n, v in runtime.items() if n.startswith("method:")})
        torch.set_rng_state(runtime["rng:torch"])
        self._lines = [ln for ln in ckpt.files["rounds.jsonl"].decode().splitlines() if ln]
        recs = [json.loads(ln) for ln in self._lines]
        self._done = sum(r.get("round", 0) >= 1 for r in recs)
        parts = ckpt.meta.get("wall_s_parts")  # a checkpoint of an older fedlora has none: that part is unknown
        self._wall_before = list(parts) if isinstance(parts, list) else [None]
        self.history = [r for r in recs if r.get("round", 0) >= 1]
        evals = [r["eval"] for r in recs if "eval" in r]
        if self.write:
            write_bytes_atomic(Path(self.cfg.output_dir) / "rounds.jsonl", ckpt.files["rounds.jsonl"])
        return self.server.round, evals

    def _write_status(self, status: str, done: int | None = None, **extra: Any) -> None:
        """``run.json`` (atomic): ``status`` — running, complete, interrupted or failed — the rounds
        planned and the rounds finished (``done``, else counted in rounds.jsonl), and what stopped it
        (``signal`` or ``error``)."""
        out = Path(self.cfg.output_dir)
        done = _rounds_done(out / "rounds.jsonl") if done is None else done
        write_json_atomic(out / "run.json", {"status": status, "rounds": self.cfg.train.rounds,
                                             "rounds_done": done, **extra})

    def _abandon(self, e: BaseException) -> None:
        """The run stopped early with ``e``. With a finished round in rounds.jsonl the folder stays,
        marked incomplete: run.json says ``interrupted`` (SIGINT/SIGTERM, ``signal``) or ``failed``
        (``error``) and how many rounds finished (no adapters or summary are written). With none,
        nothing of value was written: what the run wrote is removed, and the folder too if the run
        created it. Adds a note saying which to ``e`` (the command line prints it)."""
        out = Path(self.cfg.output_dir)
        try:
            if getattr(self, "_bar", None) is not None:
                self._bar.close()  # the progress bar's line ends before the command's last line
            done = _rounds_done(out / "rounds.jsonl")
            if done == 0:
                self.output.discard()
                note = f"{'removed' if not out.exists() else 'emptied'} {out} (no round had finished)"
            else:
                stopped = isinstance(e, KeyboardInterrupt)
                status = "interrupted" if stopped else "failed"
                self._write_status(status, **({"signal": getattr(e, "signal_name", "SIGINT")} if stopped
                                              else {"error": _first_line(e)}))
                note = f"{out} is incomplete: run.json says {status} after round {done} of {self.cfg.train.rounds}"
                from fedlora.checkpoint import list_checkpoints

                ckpts = list_checkpoints(out / CHECKPOINTS)
                if ckpts:
                    note += f"; `fedlora run --resume {out}` continues from its checkpoint ({ckpts[0].name})"
        except Exception as err:  # never hide why the run stopped
            note = f"could not mark {out} incomplete: {_first_line(err)}"
        _add_note(e, note)

    def _append(self, out: Path, rec: Mapping[str, Any]) -> None:
        """One record to rounds.jsonl, then run.json (atomic) with ``rounds_done`` counting it: a reader —
        or a run killed with SIGKILL — finds run.json saying as many rounds as rounds.jsonl holds."""
        line = json.dumps(rec, allow_nan=True)
        self._lines.append(line)
        self._done += rec.get("round", 0) >= 1
        if self.write:
            with open(out / "rounds.jsonl", "a") as f:
                f.write(line + "\n")
            self._write_status("running", self._done)

    def _wall_parts(self) -> list[float | None]:
        """Wall seconds of the rounds, per part of the run: the parts before a resume (each up to the
        checkpoint the next part started from; None where an older checkpoint did not record it), then
        this part's so far — one part for a run that never stopped."""
        now = [] if self._t0 is None else [time.perf_counter() - self._t0]
        return [*self._wall_before, *now]

    @staticmethod
    def _wall_total(parts: Sequence[float | None]) -> float:
        return float(sum(p for p in parts if p is not None))

    def _round_line(self, rec: Mapping[str, Any], wall: float) -> str:
        """The line printed per round without a progress bar: mean training loss, the evaluation's
        figures where the round was evaluated (``_eval_text``), bytes up and down, failed clients, time."""
        losses = [v for v in rec["train_loss"].values() if math.isfinite(v)]
        parts = [f"training loss {np.mean(losses):.4f}" if losses else "no finite training loss"]
        if "eval" in rec:
            parts.append(self._eval_text(rec["eval"]))
        parts.append(f"bytes up {sum(rec['bytes_up'].values()):,}, down {sum(rec['bytes_down'].values()):,}")
        failed = rec.get("failures") or {}
        if failed:
            which = ", ".join(f"{k} ({v['kind']})" for k, v in failed.items())
            parts.append(f"failed: client{'s' if len(failed) > 1 else ''} {which}")
        return f"round {rec['round']}/{self.cfg.train.rounds}: {', '.join(parts)} ({wall:.1f} s)"

    def _eval_text(self, ev: Mapping[str, Any]) -> str:
        """An evaluation in a round's line: the clients' mean test main metric."""
        main = self.task.main_metric
        return f"test {main} {ev['test']['mean'][main]:.4f} (clients' mean)"

    def _postfix(self, ev: Mapping[str, Any], rec: Mapping[str, Any]) -> dict[str, str]:
        """The progress bar's figures after an evaluated round: the clients' mean test main metric, the loss."""
        main = self.task.main_metric
        return {f"test_{main}": f"{ev['test']['mean'][main]:.3f}",
                "loss": f"{np.mean(list(rec['train_loss'].values())):.3f}"}

    def _plot(self, evals: list[dict[str, Any]], path: Path) -> None:
        """``rounds.png`` (``fedlora.llm.plots.plot_run``)."""
        from .plots import plot_run

        plot_run(self.history, evals, self.task.main_metric, path, method=self.method.name, task=self.task_label,
                 clients=self.cfg.federation.clients)

    def _summary(self, evals: list[dict[str, Any]], wall: float) -> dict[str, Any]:
        main = self.task.main_metric
        first, last = evals[0], evals[-1]
        up = sum(sum(r["bytes_up"].values()) for r in self.history)
        down = sum(sum(r["bytes_down"].values()) for r in self.history)
        s = {"method": self.method.name, "task": self.task_label, "task_kind": self.task.kind, "main_metric": main,
             "rounds": self.cfg.train.rounds, "clients": self.cfg.federation.clients,
             "round0_test": first["test"], "final_test": last["test"],
             "final_clients": last["clients"], "bytes_up_total": up, "bytes_down_total": down,
             "wall_s": wall, "record_bytes_per_client": record_nbytes(self.store.get(0)),
             "n_clients_without_test": len(self.clients_without_test),  # left out of every clients' mean
             "clients_without_test": list(self.clients_without_test)}
        if "global" in last:
            s["round0_global"], s["final_global"] = first.get("global"), last["global"]
        if self.task.not_computed:  # e.g. METEOR without WordNet: named, with the reason, never silently absent
            s["metrics_not_computed"] = self.task.not_computed
        # The round with the best clients' mean of the main metric — chosen ON THE TEST SPLIT, as
        # RoLoRA's tables report it: for comparison with papers only, never a model selection.
        best = max(evals[1:] or evals, key=lambda e: e["test"]["mean"].get(main, float("-inf")))
        s["best_round"] = {"round": best["round"], "test": best["test"], "selected_on": "test",
                           "note": "best clients' mean over the evaluated rounds, selected on the test split: "
                                   "for comparison with papers that report it, not a model selection"}
        if "global" in best:
            s["best_round"]["global"] = best["global"]
        return s

    def describe(self) -> dict[str, Any]:
        """What was built (for config.json): targets, head, ranks, data sizes, split."""
        layers = {n: {"scale": float(self.model.get_submodule(n).scale),
                      "client_scale": float(self.model.get_submodule(n).client_scale),
                      "conv1d": bool(self.model.get_submodule(n).conv1d),
                      "middle": bool(self.model.get_submodule(n).middle)} for n in self.targets}
        return {"targets": self.targets, "layers": layers, "head": self.head_mode, "head_linear": self.head_linear,
                "adapter": self.method.adapter_kwargs(), **self.task.describe(), "train_sizes": self.sizes,
                "test_sizes": [len(c.test) for c in self.clients], "clients_per_pass": self.P,
                "local_steps": self.steps, "method_options": self.method_options,
                "step_sizes": self.method.step_sizes(), "lr_schedule": self.cfg.train.lr_schedule,
                "device": str(self.device), "runtime": self.runtime, "split": self.split_report, "manifest": self.manifest(),
                "split_indices": split_indices(self.clients, self.train_data.keys)}

    def manifest(self) -> dict[str, Any]:
        """Provenance (``fedlora.llm.manifest``): versions, git commit, command line, the data files' hashes."""
        from .tasks import get_task

        dc = self.cfg.data
        local_dir = get_task(dc.task).local_dir if dc.task is not None and dc.path is None else None
        return {**environment(), "data_files": file_hashes(data_files(dc.path, local_dir))}

    def client_adapter(self, client: int) -> dict[str, torch.Tensor]:
        """Client ``client``'s final model as one adapter per layer (no slot dimension) — the model
        ``evaluate`` scores: its record with the current global state downloaded (read-only), and
        where the method evaluates a personalised model (Per-FedAvg's one SGD step on a batch of the
        client's own data, ``Method.personalised_params``) that model, from the same record, so the
        same batch. Keys are the model's parameter names. A method that merges into the shared base
        (FLoRA) keeps the rest of the model there: ``merged_update``."""
        owner = 0 if self.centralized else client
        self._bind([owner])
        self.model.eval()  # as evaluate: no dropout in the personalisation step
        samplers = self._load([owner])
        self._sync(0, owner, -1, count=False)
        params = self.method.personalised_params(self._objective, self._sampler_fn(samplers, [owner]))
        src = self.method.params if params is None else {n: params[n] for n in self.method.params}
        out = {n: p.detach()[0].cpu().clone() for n, p in src.items()}
        out.update({n: b[0].cpu().clone() for n, b in self.method._stacked_buffers().items()})
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

    def save_adapters(self, folder: Path) -> list[Path]:
        """Every client's final model (``client_adapter``) as ``client_<k>.safetensors``, and FLoRA's
        merged update (``merged_update``) once as ``merged_update.safetensors``; each file's metadata
        names the method, the client, the number of clients and the SHA-256 of the run's config
        (``fedlora.llm.export.config_digest``), so export refuses files another run left in the folder."""
        from safetensors.torch import save

        from .export import MERGED_UPDATE, config_digest

        meta = {"method": self.method.name, "clients": str(self.cfg.federation.clients),
                "config_sha256": config_digest(self.cfg.to_dict())}
        merged = self.merged_update()
        if merged is not None:
            tensors, form = merged
            write_bytes_atomic(folder / MERGED_UPDATE, save(tensors, metadata={
                **meta, "form": form, "merges": str(len(self.server.increments[0]))}))
            meta["merged_update"] = MERGED_UPDATE
        paths = []
        for k in range(self.cfg.federation.clients):
            path = folder / f"client_{k}.safetensors"
            write_bytes_atomic(path, save({n: v.contiguous() for n, v in self.client_adapter(k).items()},
                                          metadata={**meta, "client": str(k)}))
            paths.append(path)
        return paths


def load_base(mc: Mapping[str, Any], seed: int, num_labels: int, *, model=None, tokenizer=None):
    """The run's frozen base classifier and its tokenizer, as ``fedlora run`` builds them: the model
    section ``mc`` (a ``ModelConfig`` as a dict, as config.json holds it), the new head's init drawn
    from the run's ``seed``. ``model`` / ``tokenizer``: ready ones to use instead (tests)."""
    from .model import load_classifier, load_tokenizer

    tok = tokenizer or load_tokenizer(mc.get("tokenizer") or mc["name"],
                                      "model.tokenizer" if mc.get("tokenizer") else "model.name")
    torch.manual_seed(_seed_of(seed, "model") % 2**31)  # the new head's init: part of the run's seed
    model = model or load_classifier(mc["name"], num_labels, from_config=mc.get("from_config"), dtype=mc["dtype"],
                                     pad_token_id=tok.pad_token_id)
    return model, tok


def check_max_length(model, max_length: int) -> None:
    """``model.max_length`` must fit the model's learned positions: ``max_position_embeddings`` less
    the ids before the first position (RoBERTa-style embeddings number positions from padding_idx + 1).
    Beyond them the embedding lookup fails in the middle of a run; here it is one line before any work."""
    n = getattr(model.config, "max_position_embeddings", None)
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        return  # no table of positions (relative or rotary models without the field)
    emb = getattr(getattr(model, "base_model", model), "embeddings", None)
    table = getattr(emb, "position_embeddings", None)
    pad = getattr(emb, "padding_idx", getattr(table, "padding_idx", None)) if table is not None else None
    offset = pad + 1 if isinstance(pad, int) and pad >= 0 else 0
    limit = n - offset
    if max_length > limit:
        why = f" minus {offset}: positions are numbered from padding_idx + 1 = {offset}" if offset else ""
        raise ConfigError(f"model.max_length: {max_length} is more than the model's {limit} positions "
                          f"(max_position_embeddings {n}{why}); use model.max_length ≤ {limit}")


def _comparable(config: Mapping[str, Any]) -> dict[str, Any]:
    """A run's config without ``output_dir`` (a run folder may move; the run stays the same)."""
    return {k: v for k, v in json.loads(json.dumps(config)).items() if k != "output_dir"}


def config_differences(a: Mapping[str, Any], b: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted names of the fields where two configs (``RunConfig.to_dict()``) differ."""
    out = []
    for k in sorted(set(a) | set(b)):
        name = f"{prefix}{k}"
        va, vb = a.get(k), b.get(k)
        if isinstance(va, Mapping) and isinstance(vb, Mapping) and prefix.count(".") < 1:
            out += config_differences(va, vb, name + ".")
        elif va != vb:
            out.append(f"{name} ({json.dumps(va)} → {json.dumps(vb)})")
    return out


@contextlib.contextmanager
def _deferred_signals():
    """During the rounds, the first SIGINT/SIGTERM lets the round finish and be checkpointed (the list
    yielded holds the signal; the loop raises ``Interrupted`` after it); a second stops at once."""
    import signal
    import sys
    import threading

    from fedlora.errors import Interrupted

    pending: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield pending
        return
    sigs = (signal.SIGINT, signal.SIGTERM)

    def handler(signum: int, frame) -> None:
        if pending:
            for s_ in sigs:
                signal.signal(s_, signal.SIG_IGN)
            raise Interrupted(signum)
        pending.append(signum)
        from tqdm.auto import tqdm

        # on its own line: tqdm.write clears a progress bar's line first and draws the bar again below
        tqdm.write(f"fedlora: {signal.Signals(signum).name}: finishing this round to checkpoint it "
                   f"(send it again to stop now)", file=sys.stderr)
        sys.stderr.flush()

    old = {s_: signal.getsignal(s_) for s_ in sigs}
    for s_, h in old.items():
        if h is not signal.SIG_IGN:
            signal.signal(s_, handler)
    try:
        yield pending
    finally:
        for s_, h in old.items():
            if signal.getsignal(s_) is not signal.SIG_IGN or h is signal.SIG_IGN:
                signal.signal(s_, h if h is not None else signal.SIG_DFL)


def _rounds_done(path: Path) -> int:
    """Rounds finished: the round records (round ≥ 1) in ``rounds.jsonl`` (line 0 is the evaluation before training)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    done = 0
    for line in lines:
        try:
            done += int(json.loads(line).get("round", 0) >= 1)
        except (ValueError, AttributeError):  # a line cut short by the interruption
            pass
    return done


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _add_note(e: BaseException, note: str) -> None:
    """``e.add_note(note)`` (Python ≥ 3.11 shows it under the traceback; the command line prints it)."""
    if hasattr(e, "add_note"):
        e.add_note(note)
    else:
        e.__notes__ = [*getattr(e, "__notes__", []), note]


def _eager_attention(model) -> None:
    """Switch a HF model to the plain softmax(QKᵀ)V attention, which has second derivatives."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")
    else:  # older transformers: the config decides at call time
        model.config._attn_implementation = "eager"


def _progress(total: int, enabled: bool, initial: int = 0):
    """The rounds' progress bar (stderr); ``initial``: the rounds already done (a resumed run)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="rounds", unit="round", disable=not enabled)


def run(config: RunConfig | Mapping[str, Any] | str | os.PathLike, overrides: Sequence[str] = (),
        progress: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """``fedlora run`` from Python: a RunConfig, a dict of sections, a YAML/TOML/JSON path or a
    bundled config's name. ``overwrite``: clear an output folder that holds an earlier run (else a
    folder that is not empty is refused, as ``fedlora run`` without ``--overwrite``)."""
    from .config import apply_overrides, load_config

    if isinstance(config, (RunConfig, Mapping)):
        data = config.to_dict() if isinstance(config, RunConfig) else dict(config)
        cfg = RunConfig.from_dict(apply_overrides(data, overrides))
    else:
        cfg = load_config(config, overrides)
    return run_class(cfg)(cfg, progress=progress, overwrite=overwrite).run()


def run_class(cfg: RunConfig) -> type[FederatedRun]:
    """The run a config describes: ``FederatedRun`` over one base model, or — with
    ``federation.client_models`` — ``fedlora.llm.hetero.HeteroRun`` over one base per group."""
    if cfg.federation.client_models is not None:
        from .hetero import HeteroRun

        return HeteroRun
    return FederatedRun


def auto_clients_per_pass(device: torch.device, participants: int, model=None, batch_size: int = 16,
                          max_length: int = 128) -> int:
    """``federation.clients_per_pass: auto``. On a CPU: 1 — batched passes were slower there
    (docs/results/memory-speed.md: 1.03× the sequential loop at 2 slots, 1.65× at 8, on 2 cores;
    element-wise ops fall out of cache). On CUDA: all of a round's participants, as many as fit in
    half of the free GPU memory by an activation estimate per client of
    ``batch_size · max_length · hidden · layers · 64`` bytes (about 16 saved fp32 activations of
    width ``hidden`` per token and layer in training; the base model is already resident)."""
    if device.type != "cuda":
        return 1
    cfg = getattr(model, "config", None)
    hidden = int(getattr(cfg, "hidden_size", 0) or getattr(cfg, "n_embd", 0) or 1024)
    layers = int(getattr(cfg, "num_hidden_layers", 0) or getattr(cfg, "n_layer", 0) or 24)
    per_client = batch_size * max_length * hidden * layers * 64
    free, _ = torch.cuda.mem_get_info(device)
    return max(1, min(participants, int(0.5 * free // per_client)))


def _is_bundled_task(name: str) -> bool:
    """A registered task whose data ships with fedlora (read offline by a dry run)."""
    from .tasks import get_task

    return get_task(name).local_dir is not None
