"""Federated LoRA methods, one module each, registered by name."""
from .base import Method, available_methods, get_method, register
from .hetlora import HetLoRA
from .pf2lora import PF2LoRA

__all__ = ["Method", "available_methods", "get_method", "register", "HetLoRA", "PF2LoRA"]
