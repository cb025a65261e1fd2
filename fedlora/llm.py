"""``fedlora.llm.run(config)``: the LLM layer's entry point under the fedlora name (the layer itself
lives in the top-level package ``llm``, which depends on fedlora; imported on first use)."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

__all__ = ["run"]


def run(config: Any, overrides: Sequence[str] = (), progress: bool = False) -> Mapping[str, Any]:
    """Run ``fedlora run`` from Python: ``config`` is an ``llm.RunConfig``, a dict of sections, or the
    path / bundled name of a YAML, TOML or JSON config; ``overrides`` are ``section.field=value``
    strings. Returns the run's summary (also written to ``output_dir/summary.json``)."""
    from llm.runtime import run as _run

    return _run(config, overrides, progress)
