"""Building a run's parts from its ``RunConfig`` (docs/design.md §8): the method (its options checked),
the task and its data, the clients' split, the frozen base model with the method's adapters injected,
the clients' state records (``fedlora.state.ClientStore``), the round protocol's ``fedlora.server.Server``
and the slot executor over the model (``fedlora.llm.slots.SlotExecutor``). ``FederatedRun`` builds them
(``prepare``; a dry run, ``check``, does every check of it without weights) and hands them to the run's
driver (``fedlora.llm.driver.Driver``: rounds, evaluation, records, checkpoints), over the executor its
caller picks — its own slot executor, or Flower's (``fedlora.llm.flower``).
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from fedlora.errors import ConfigError
from fedlora.methods.base import Method, RuntimeFacts
from fedlora.partition import validate_partition_spec
from fedlora.io import OutputDir
from fedlora.seeds import clients_drawn
from fedlora.server import ClientExecutor, Federation, Server, UploadSpec
from fedlora.state import ClientStore

from . import data as D
from .classification import ClassificationTask
from .config import RunConfig, build_method, effective_options
from .driver import Driver, Report, claim_run_folder, run_to_end
from .slots import RunData, SlotExecutor
from .task_kinds import task_for
from .generation import GenerationTask, check_decoding
from .model import ModelUnavailable, check_max_length, skeleton_models, torch_dtype
from .qa import QATask
from .runfolder import data_label
from .tasks import get_task
from .dropout import install_client_dropout
from .manifest import data_files, environment, file_hashes, split_indices
from .privacy import client_references, describe_plan, dry_run_plan, privacy_plan, sample_dp_of
from .inject import head_linear_names, inject_adapters, make_head_trainable, match_targets

__all__ = ["FederatedRun", "slot_executor"]

RUNTIMES = ("embedded", "flower")  # fedlora run --runtime: this process, or Flower (fedlora.llm.flower)


#: where a config with heterogeneous client models cannot go (Flower's nodes build one model per run)
HETERO_EMBEDDED_ONLY = ("federation.client_models: heterogeneous client models run on the embedded runtime only "
                        "(`fedlora run CONFIG`; fedlora.llm.hetero.HeteroRun), not on Flower")


class FederatedRun:
    """One run of ``fedlora run CONFIG`` over one base model (any task kind), built from its config.

    ``prepare()`` builds its parts — the method, the task's data and the clients' split, the model with
    the adapters injected, every client's initial state record, the ``Server``, the slot executor
    (``slots``, also ``local``: the executor in this process) and the ``driver``; ``run(executor)`` has
    the driver do the rounds over ``executor`` (default: the slots), evaluate and write the outputs. Tests
    may pass a ready ``model`` and ``tokenizer`` (the model is modified in place: adapters are injected).

    ``write``: the run's output folder (``cfg.output_dir``) is claimed before any work
    (``fedlora.io.claim_output_dir``: a folder that is not empty is refused unless ``overwrite``,
    which clears it) — or ``output``, a folder the caller has claimed (the command line)."""

    #: a run over one base model; ``fedlora.llm.hetero.HeteroRun`` (one base per group) sets it True
    groups_of_models = False

    def __init__(self, cfg: RunConfig, *, progress: bool = False, model=None, tokenizer=None,
                 write: bool = True, overwrite: bool = False, output: OutputDir | None = None,
                 runtime: str = "embedded", log: Callable[[str], None] | None = None, resume_from=None) -> None:
        if runtime not in RUNTIMES:
            raise ConfigError(f"--runtime: one of {', '.join(RUNTIMES)}, got {runtime!r}")
        if cfg.federation.client_models is not None and not self.groups_of_models:
            raise ConfigError(HETERO_EMBEDDED_ONLY)
        #: ``runtime``: what config.json records of where the clients ran (the caller picks the executor: ``run``)
        self.cfg, self.runtime = cfg, runtime
        #: ``log``: called with one line per finished round (``Driver._round_line``) — ``fedlora run`` passes
        #: ``print`` when there is no progress bar or stdout is not a terminal; None: silent
        self.progress, self.write, self.log = progress, write, log
        self.overwrite, self.output = overwrite, output
        self._given_model, self._given_tokenizer = model, tokenizer
        self.prepared = False
        self.privacy_plan = None  # fedlora.privacy.plan.PrivacyPlan once prepared, when privacy is on
        #: a verified checkpoint to continue from (``fedlora.llm.runs.resume``), or None
        self.resume_from = resume_from

    def flower_config(self) -> dict[str, Any]:
        """What a Flower node rebuilds this run from (``fedlora.llm.flower``): the config."""
        return self.cfg.to_dict()

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
        cfg = self.cfg
        claim_run_folder(self)
        if cfg.train.threads is not None:
            torch.set_num_threads(cfg.train.threads)
        self._settings()  # cheap checks first: bad options fail before any loading

        # data ------------------------------------------------------------------------------
        self._load_data()
        fc = cfg.federation

        # model -----------------------------------------------------------------------------
        mc = cfg.model
        self._base_model()
        if self.method.needs_second_order:  # fused SDPA (CPU flash) has no double backward nor forward-mode AD
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
        self.global_layers: int | None = None  # H²Tune's L_g over client models of different depth (hetero sets it)
        self.model.to(device=self.device)
        self.dropout = install_client_dropout(self.model, mc.dropout, mc.max_length, self.device)  # eval mode
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
        if mc.use_rslora:  # s = α/√r in every adapter (fedlora.adapter.lora_scale); off: the kwargs as before
            kwargs["rslora"] = True
        self.targets = match_targets(self.model, mc.target_modules, mc.layers)
        inject_adapters(self.model, self.targets, slots=slots, **kwargs)
        self.head_mode = self._head_mode()
        self.head_linear = head_linear_names(self.model)
        self.head = make_head_trainable(self.model, slots) if self.head_mode != "frozen" else []
        if self.head_mode != "frozen" and not self.head:
            raise ConfigError(f"model.head: {self.head_mode!r} but the model has no nn.Linear classifier head "
                              f"(modules named 'classifier', 'score' or 'qa_outputs')")

    def check(self) -> dict[str, Any]:
        """``fedlora run --dry-run``: every check of the preparation, nothing loaded or written (``dry_run``)."""
        return dry_run(self)

    def prepare_clients(self) -> "FederatedRun":
        """Every client's initial state record (``ClientStore``) and the round protocol's ``Server``."""
        cfg, fc = self.cfg, self.cfg.federation
        self.store = ClientStore(fc.store, Path(cfg.output_dir) / "clients" if fc.store == "disk" else None)
        train_sets = [np.concatenate([c.train for c in self.clients])] if self.centralized else \
            [c.train for c in self.clients]
        self.train_sets = [self.task.train_rows(self.enc_train, np.sort(t)) for t in train_sets]  # QA: features
        self.sizes = [len(t) for t in self.train_sets]
        self.steps = self._local_steps()
        self.privacy_plan = privacy_plan(cfg, self.K_train, self.sizes, self.steps)  # None: privacy off
        self.federation = Federation(n_groups=1, n_clients=self.K_train, client_weights=self.sizes,
                                     sample_fraction=1.0 if self.centralized else fc.sample_fraction,
                                     sample_seed=cfg.seed)
        data = RunData(self.task, self.train_data, self.test_data, self.enc_train, self.enc_test, self.clients,
                       self.train_sets, self.sizes, self.steps)
        #: the executor in this process: it holds the clients' records (``SlotExecutor``)
        self.slots = self.local = SlotExecutor(cfg, self.method, self.model, self.tokenizer, self.device, data,
                                               self.store, self.dropout, P=self.P, centralized=self.centralized,
                                               head_mode=self.head_mode, head_linear=self.head_linear,
                                               targets=self.targets, sample_dp=sample_dp_of(cfg, self.privacy_plan))
        # what the method is told of where it runs, in one call before it is bound: one base model shared by every
        # client (FLoRA merges into it server-side), the head policy, the logits (H²Tune's eq. 7), L_g (hetero)
        self.method.use_runtime(RuntimeFacts(shared_base=True, head_mode=self.head_mode,
                                             output_fn=self.slots._logits_fn, global_layers=self.global_layers))
        initial = self.slots.init_records()
        self.initial_record = self.slots.initial_record
        spec = UploadSpec.of(self.method)
        refs = [client_references(self.initial_record, list(spec.tensors))] \
            if self.privacy_plan is not None and self.privacy_plan.client is not None else None
        self.server = Server(self.method, self.federation, [initial], cfg.train.rounds,
                             min_clients=1 if self.centralized else fc.min_clients,
                             spec=spec, privacy=self.privacy_plan, dp_references=refs)
        self.report = Report(self)
        self.prepared = True
        self.driver = Driver.of(self, self.slots)
        return self

    def run(self, executor: ClientExecutor | None = None) -> dict[str, Any]:
        """All rounds with evaluation (``fedlora.llm.driver.Driver``) over ``executor`` — the caller's choice
        (the command line: Flower's) — or this run's own slot executor; writes ``output_dir`` (see
        docs/reference/run-folder.md), claimed before any work (``fedlora.llm.driver.run_to_end``)."""
        return run_to_end(self, executor)

    def _load_data(self) -> None:
        """The labelled text, the clients' split and its report (``train_data``, ``test_data``,
        ``task``, ``num_labels``, ``clients``, ``split_report``): every check of the data and the
        partition, with no model loaded (``check_data`` runs it for a dry run)."""
        cfg, dc, fc = self.cfg, self.cfg.data, self.cfg.federation
        columns = data_columns(cfg)
        if cfg.tiny and dc.path is None and dc.hf_name is not None:
            raise ConfigError("tiny: data.hf_name has no offline stand-in; give data.task (a registered task) "
                              "or data.path (local files)")
        self.task = task_for(dc.task, dc.target_column)
        self.train_data, self.test_data = self.task.load_data(cfg, columns)
        splits = D.split_clients(self.train_data, self.test_data, partition=fc.partition, n_clients=fc.clients,
                                 seed=cfg.seed, val_fraction=fc.val_fraction)
        self.clients = [dataclasses.replace(s, test=s.test[:cfg.eval.max_samples]) for s in splits]  # None: all
        self.split_report = D.describe_split(splits, self.train_data, self.test_data)
        self.task_label = data_label(self.task.name, self.task.kind, dc.task, dc.path)
        self.clients_without_test = clients_without_test(cfg, self.clients, self.test_data)

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

    def _clients_per_pass(self) -> int:
        """``federation.clients_per_pass``, with ``auto`` resolved (see ``auto_clients_per_pass``)."""
        fc = self.cfg.federation
        if fc.clients_per_pass != "auto":
            return fc.clients_per_pass
        return auto_clients_per_pass(self.device, clients_drawn(fc.sample_fraction, fc.clients),
                                     self.model if hasattr(self, "model") else None, self.cfg.train.batch_size,
                                     self.cfg.model.max_length)

    def _local_steps(self) -> list[int]:
        return local_steps(self.cfg, self.sizes, self.centralized)

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
                "split_indices": split_indices(self.clients, self.train_data.keys),
                **({"privacy": describe_plan(self.privacy_plan)} if self.privacy_plan is not None else {})}

    def manifest(self) -> dict[str, Any]:
        """Provenance (``fedlora.llm.manifest``): versions, git commit, command line, the data files' hashes."""
        dc = self.cfg.data
        local_dir = get_task(dc.task).local_dir if dc.task is not None and dc.path is None else None
        return {**environment(), "data_files": file_hashes(data_files(dc.path, local_dir))}


def dry_run(run: "FederatedRun") -> dict[str, Any]:
    """``fedlora run --dry-run`` (``FederatedRun.check``): every check of the run's preparation (``prepare_model``), by the same functions,
    with no weights loaded and nothing trained or written — the method and device (``_settings``), the data
    and its split (``check_data``), the model built from its config on the meta device (``_base_model`` in
    ``skeleton_models``: the task's fit, ``model.max_length`` against its positions), the windows of
    extractive QA (``check_fits``), the target modules, ranks and head (``_adapt``), per-client dropout
    (``install_client_dropout``). What a dry run does not fetch (hub data; a hub model not in the HF cache) is
    said in the result, not refused.
    A device this machine lacks (``model.device: cuda`` on a laptop) is said, not refused: the config may be
    for another machine. Returns ``{"data": …, "head": …, "model": …}``: what was checked and the facts
    resolved (the head policy, the targets)."""

    run._settings(machine=False)
    # σ derived, δ resolved, the budget checked; sample level: from each client's data size (after the data check)
    plan = dry_run_plan(run.cfg)
    data = run.check_data()
    if run.cfg.privacy.level == "sample":
        plan = _sample_plan_of_dry_run(run, data)
    private = {"privacy": plan} if plan is not None else {}
    if not data["checked"]:
        run.task = _task_without_rows(run.cfg)
    try:
        with skeleton_models():
            run._base_model()
    except ModelUnavailable as e:
        return {"data": data, "head": run._head_mode(), **private,
                "model": {"checked": False,
                          "why": f"{e.key} {e.name!r} is not in the Hugging Face cache and a dry run downloads "
                                 f"nothing: model.target_modules, the ranks, model.max_length and the model's "
                                 f"head are checked when the run has the model"}}
    fits = getattr(run.task, "check_fits", None)  # extractive QA: every question's windows
    if fits is not None and data["checked"]:
        fits(run.train_data, run.tokenizer, run.cfg.model.max_length)
        fits(run.test_data, run.tokenizer, run.cfg.model.max_length)
    run._adapt(1)
    install_client_dropout(run.model, run.cfg.model.dropout, run.cfg.model.max_length, "cpu")  # as the run
    mod = {"checked": True, "model_type": getattr(run.model.config, "model_type", None), **_machine(run),
           "targets": len(run.targets), "target_modules": sorted({t.rsplit(".", 1)[-1] for t in run.targets}),
           "head_linear": run.head_linear}
    if not data["checked"] and isinstance(run.task, QATask):
        mod["not_checked"] = "the questions' windows in model.max_length (data.doc_stride): the data is not fetched"
    return {"data": data, "head": run.head_mode, "model": mod, **private}


def local_steps(cfg: RunConfig, sizes, centralized: bool = False) -> list[int]:
    """Each training client's local steps per round (``sizes``: their training rows n_k): ``train.local_epochs`` E
    → ⌈E·n_k/b⌉, else ``train.local_steps`` (default 10). Pooled data (Centralized) takes the federation's total of
    a round — the participants' steps added up — so both references see as many batches per round."""
    t, b = cfg.train, cfg.train.batch_size
    if t.local_epochs is not None:
        return [max(1, math.ceil(t.local_epochs * n / b - 1e-9)) for n in sizes]
    per_client = t.local_steps if t.local_steps is not None else 10
    if centralized:
        fc = cfg.federation
        return [per_client * clients_drawn(fc.sample_fraction, fc.clients)]
    return [per_client] * len(sizes)


def _sample_plan_of_dry_run(run: "FederatedRun", data: dict[str, Any]) -> dict[str, Any]:
    """A dry run's sample-level plan where it has each client's data size: the batch rates b/n_k, the local steps
    and σ derived exactly as the run derives them (``privacy_plan``; a budget the first round already exceeds is
    refused here, before any training); else what is missing."""
    got = dry_run_sizes_and_steps(run, data)
    if isinstance(got, dict):
        return got
    sizes, steps = got
    return describe_plan(privacy_plan(run.cfg, len(sizes), sizes, steps))


def dry_run_sizes_and_steps(run: "FederatedRun", data: dict[str, Any]) -> tuple[list[int], list[int]] | dict[str, Any]:
    """What a dry run's sample-level plan needs of ``run`` after its data check ``data``: each client's training rows
    n_k and local steps, as the run will count them; else the plan's "not derived" entry saying what is missing."""
    if not data["checked"]:
        return {"level": "sample", "derived": False,
                "why": f"σ and the batch rates need each client's data size, and {data['why']}"}
    if isinstance(run.task, QATask):
        return {"level": "sample", "derived": False,
                "why": "extractive QA trains on its questions' windows, counted when the run tokenizes the data"}
    from fedlora.methods import get_method

    sizes, pooled = data["client_train_sizes"], bool(get_method(run.cfg.method.name).pooled_data)
    if pooled:  # Centralized: one data set of every client's rows, as the run pools them
        sizes = [sum(sizes)]
    return sizes, local_steps(run.cfg, sizes, pooled)


def _machine(run: "FederatedRun") -> dict[str, str]:
    """A dry run's word on a device this machine lacks (the run refuses it here: ``_settings``)."""
    if run.device.type == "cuda" and not torch.cuda.is_available():
        return {"device": f"model.device {run.cfg.model.device!r}: CUDA is not available on this machine; "
                          f"the run needs a machine that has it"}
    return {}


def _task_without_rows(cfg: RunConfig):
    """The task's setup where a dry run does not fetch the data (hub): a registered task's class names give
    the classifier's size (a Hub dataset without a task: 2, the head's size not checked); a generation task's
    decoding settings (``eval.decoding`` over the task's) bound its positions."""

    dc = cfg.data
    task = task_for(dc.task, dc.target_column)
    spec = task.spec
    if isinstance(task, ClassificationTask):
        names = spec.label_names if spec is not None else None
        task.label_names = list(names) if names else ["0", "1"]
        task.num_labels = len(task.label_names)
    elif isinstance(task, GenerationTask):
        task.decoding = check_decoding({**dict(spec.decoding if spec else ()), **cfg.eval.decoding})
    return task


def clients_without_test(cfg: RunConfig, clients, test_data) -> list[int]:
    """Clients whose split gave them no test rows are left out of the clients' mean (``n_skipped``
    in every evaluation; the summary says how many). Refused before training when that is most of
    the clients (more than half) unless ``eval.allow_clients_without_test``, and always when none
    has a test row."""
    K = len(clients)
    without = [k for k, c in enumerate(clients) if len(c.test) == 0]
    n = len(without)
    how = (f"the {len(test_data)} test rows go to the clients that hold their labels "
           f"(partition {cfg.federation.partition!r})")
    if n == K:
        raise ConfigError(f"federation.clients: none of the {K} clients gets a test row ({how}); use fewer "
                          f"clients or more test data (data.max_test_samples, data.test_fraction)")
    if 2 * n > K and not cfg.eval.allow_clients_without_test:
        raise ConfigError(f"federation.clients: {n} of {K} clients get no test rows ({how}), so the clients' "
                          f"mean would score only {K - n}; use fewer clients or more test data "
                          f"(data.max_test_samples, data.test_fraction), or set "
                          f"eval.allow_clients_without_test: true to leave them out of the mean")
    return without


def data_columns(cfg: RunConfig) -> dict[str, str] | None:
    """The data section's columns (the task's, overridden field by field; ``by_key(column)``'s key column)."""
    dc, fc = cfg.data, cfg.federation
    columns = {field: getattr(dc, key.split(".")[1]) for field, key in D.CONFIG_FIELD.items()
               if getattr(dc, key.split(".")[1]) is not None} or None  # the task's columns, overridden field by field
    scheme, params = validate_partition_spec(fc.partition)
    if scheme == "by_key" and params.get("column") is not None:  # by_key(topic): the key column
        if dc.client_column is not None and dc.client_column != params["column"]:
            raise ConfigError(f"federation.partition: {fc.partition!r} names the key column "
                              f"{params['column']!r} but data.client_column is {dc.client_column!r}; give one")
        columns = {**(columns or {}), "client_key": params["column"]}
    return columns


def _eager_attention(model) -> None:
    """Switch a HF model to the plain softmax(QKᵀ)V attention, which has second derivatives."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")
    else:  # older transformers: the config decides at call time
        model.config._attn_implementation = "eager"


def slot_executor(cfg: RunConfig) -> SlotExecutor:
    """The slot executor of the run ``cfg`` describes, its parts built as ``FederatedRun.prepare`` builds them
    and nothing written: what a Flower node runs (``fedlora.llm.flower``)."""
    return FederatedRun(cfg, write=False).prepare().slots


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
    return get_task(name).local_dir is not None
