"""Differential privacy building blocks (issue 29): pure functions and a serialisable accountant.

- ``accounting``: (ε, δ) from Google's ``dp-accounting`` RDP accountant over each protected unit's realised
  participation, σ for a target ε, δ from the data size.
- ``clipping``: client-level clipping and noise of DP-FedAvg (McMahan et al., ICLR 2018) and sample-level
  per-sample LoRA gradients and clipping for DP-SGD (Abadi et al., CCS 2016).

Not yet wired into the runtimes (``fedlora run``): see docs/concepts/privacy.md.
"""
