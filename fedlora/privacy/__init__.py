"""Differential privacy building blocks (issue 29): pure functions and a serialisable accountant.

- ``accounting``: (ε, δ) from Google's ``dp-accounting`` RDP accountant over each protected unit's realised
  participation, σ for a target ε, δ from the data size.
- ``clipping``: client-level clipping and noise of DP-FedAvg (McMahan et al., ICLR 2018) and sample-level
  per-sample LoRA gradients and clipping for DP-SGD (Abadi et al., CCS 2016).
- ``dpsgd``: sample-level DP-SGD on the clients — ``SampleDP`` (Poisson batches and noise from each client's own
  stream), the layers' captures and per-sample gradients, ``private_gradients`` (clip, sum, noise, / q·n_k), which
  ``FactorLoRA.train_step`` and the slot executor use.

How they reach a run (``privacy:`` in its config): docs/concepts/privacy.md.
"""
