"""Synthetic reduced-rank-regression testbed (docs/design.md §6; [PF2LoRA] §5, App. B–C)."""
