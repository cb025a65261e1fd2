"""LLM layer: adapter injection into HF models and federated GLUE/NLG runs (SPEC §8).

Not built yet: this package holds the place the user's layout gives it. The adapter it will inject
is ``fedlora.adapter.LoRALinear`` (``LoRALinear.from_linear`` wraps an ``nn.Linear``).
"""
