"""Pure server-side math of the federated LoRA methods, as plain functions on tensors (docs/design.md §2, §4).

One module per method: :mod:`.exact` (exact aggregate, discordance, frozen-factor exactness for
FFA-LoRA / RoLoRA), :mod:`.flexlora`, :mod:`.flora`, :mod:`.lora_a2`, :mod:`.h2tune`. HetLoRA and
plain FedAvg of factors live in :mod:`fedlora.aggregation`. Every function is pure (inputs are never
modified, no I/O) and raises :class:`~fedlora.errors.ConfigError` on bad input.
Shapes follow PEFT orientation: A (r, d_in), B (d_out, r), ΔW = s·B A.
"""
from . import exact, flexlora, flora, h2tune, lora_a2
from .exact import aggregate_trained_factor, discordance, exact_delta, fedavg_delta, trained_factor
from .flexlora import FlexLoRAResult, flexlora_aggregate, flexlora_svd
from .flora import flora_merge, flora_stack
from . import frlora
from .frlora import (frlora_average, frlora_compensate, frlora_merge, frlora_merged_lora, frlora_principal,
                     frlora_update)
from . import lora_fair
from .lora_fair import LoRAFAIRResult, lora_fair_correction, lora_fair_objective, lora_fair_similarity
from . import fedsb
from .fedsb import fedsb_average, fedsb_delta, fedsb_fold, lorasb_init, weighted_gradient
from . import fedex
from .fedex import FedExResult, fedex_aggregate, fedex_means, fedex_merge, fedex_residual, fedex_residual_factors
from . import fedsvd
from .fedsvd import FedSVDResult, fedsvd_aggregate, fedsvd_refactor
from .h2tune import (h2tune_aggregate, kl_softmax, server_mean, sparsify_support, to_client, to_global,
                     trilora_delta, trilora_fold, trilora_middle)

__all__ = [
    "exact", "flexlora", "flora", "h2tune", "lora_a2",
    "exact_delta", "fedavg_delta", "discordance", "trained_factor", "aggregate_trained_factor",
    "FlexLoRAResult", "flexlora_aggregate", "flexlora_svd",
    "flora_stack", "flora_merge",
    "frlora", "frlora_principal", "frlora_compensate", "frlora_average", "frlora_update", "frlora_merge",
    "frlora_merged_lora",
    "lora_fair", "LoRAFAIRResult", "lora_fair_correction", "lora_fair_objective", "lora_fair_similarity",
    "fedsb", "lorasb_init", "fedsb_average", "fedsb_fold", "fedsb_delta", "weighted_gradient",
    "fedex", "FedExResult", "fedex_aggregate", "fedex_means", "fedex_merge", "fedex_residual", "fedex_residual_factors",
    "fedsvd", "FedSVDResult", "fedsvd_aggregate", "fedsvd_refactor",
    "trilora_middle", "trilora_fold", "trilora_delta", "sparsify_support", "to_global", "to_client",
    "server_mean", "h2tune_aggregate", "kl_softmax",
]
