"""Data sets bundled with fedlora (read offline by ``fedlora.llm.data``).

``debian_sections/``: Debian package descriptions labelled with their archive Section (games,
sound, graphics, mail); built by :mod:`fedlora.llm.datasets.build_debian_sections`, see its README.md.
``debian_describe/``: Debian package records → their short descriptions (data-to-text); built by
:mod:`fedlora.llm.datasets.build_debian_describe`, see its README.md.
"""
from __future__ import annotations

from pathlib import Path

DATASETS_DIR = Path(__file__).resolve().parent
DEBIAN_SECTIONS_DIR = DATASETS_DIR / "debian_sections"
DEBIAN_DESCRIBE_DIR = DATASETS_DIR / "debian_describe"

__all__ = ["DATASETS_DIR", "DEBIAN_SECTIONS_DIR", "DEBIAN_DESCRIBE_DIR"]
