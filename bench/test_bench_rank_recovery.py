"""End-to-end speed of the tuned rank-recovery run (issue goal: both methods × 5 seeds ≤ 15 s wall
on a 2-core CPU). Run: ``.venv/bin/pytest bench/test_bench_rank_recovery.py --benchmark-only``
(or time the CLI: ``time fedlora synthetic rank-recovery --preset tuned --ground-truth shared-private
--seeds 5 --no-plot``)."""
import torch

from fedlora.synthetic.rank_recovery import RankRecoveryConfig, run_rank_recovery


def test_bench_tuned_rank_recovery_5_seeds(benchmark):
    torch.set_num_threads(1)
    cfg = RankRecoveryConfig.from_preset("tuned", ground_truth="shared-private", seeds=5)
    result = benchmark.pedantic(run_rank_recovery, args=(cfg,), kwargs={"log": lambda *a: None},
                                rounds=1, iterations=1)
    assert len(result["runs"]) == 10
