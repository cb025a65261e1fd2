"""Synthetic reduced-rank-regression testbed (SPEC §6; 000_c6c65d73352e5f2c.txt §5, App. B–C)."""
