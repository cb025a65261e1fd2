"""fedlora — federated LoRA fine-tuning: methods, pure aggregation, the server's round protocol, simulator, CLI."""
from .errors import ConfigError

__version__ = "0.1.0"
__all__ = ["ConfigError", "__version__"]
