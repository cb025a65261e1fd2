"""The LLM layer (SPEC §8): federated LoRA fine-tuning of HuggingFace models with every method.

* ``llm.inject`` — PEFT-style targets, slot adapters (``fedlora.adapter.LoRALinear``) and slot heads;
* ``llm.runtime`` — many simulated clients on one frozen base model: client state records, slots and
  passes (``FederatedRun``, ``run``);
* ``llm.config`` — the one validated run configuration (``RunConfig``, ``load_config``);
* ``llm.data``, ``llm.tasks``, ``llm.metrics`` — text data, client splits, metrics;
* ``llm.export`` — a client's model as a PEFT adapter or merged into the base weights.

``fedlora run CONFIG`` is the command line of ``run``.
"""
from .config import RunConfig, load_config
from .runtime import FederatedRun, run

__all__ = ["RunConfig", "load_config", "FederatedRun", "run"]
