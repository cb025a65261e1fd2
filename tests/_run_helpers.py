"""Small runs and spies that several test modules share: a finished tiny-smoke run, one stopped by a real
Ctrl-C in its round loop, a record of what a run predicts on its test rows, and a script of the repository loaded
as a module."""
import importlib.util
import json
from pathlib import Path
from typing import Sequence

import numpy as np
import pytest

FAST = ["train.local_steps=1", "eval.batch_size=64"]
ROOT = Path(__file__).resolve().parents[1]


def load_script(path: str, name: str | None = None):
    """The repository's script ``path`` (e.g. ``"bench/dp_grad_norms.py"``: not a package module) loaded as a fresh
    module named ``name`` (default: the file's stem)."""
    spec = importlib.util.spec_from_file_location(name or Path(path).stem, ROOT / path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tiny_run(out: Path, *overrides: str) -> Path:
    """tiny-smoke into ``out`` (one local step per round), ``overrides`` added; returns ``out``."""
    from fedlora.llm import run

    run("tiny-smoke", [f"output_dir={json.dumps(str(out))}", *FAST, *overrides], progress=False)
    return out


def interrupted_run(out: Path, rounds: int = 4, stop_before: int = 2, overrides: Sequence[str] = ()) -> Path:
    """tiny-smoke for ``rounds`` rounds stopped by a KeyboardInterrupt raised as round ``stop_before``
    (0-based) starts — rounds 1..stop_before finish, as after Ctrl-C; returns ``out``."""
    from fedlora.llm.driver import Driver

    real = Driver.run_round

    def run_round(self, rnd):
        if rnd == stop_before:
            raise KeyboardInterrupt
        return real(self, rnd)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Driver, "run_round", run_round)
        with pytest.raises(KeyboardInterrupt):
            tiny_run(out, f"train.rounds={rounds}", *overrides)
    return out


def watch_test_predictions(run, predicted: list) -> None:
    """Append (row sets, predictions) of every prediction ``run`` makes on its test set to ``predicted``."""
    predict = run.slots._predict

    def spy(enc, row_sets, params):
        out = predict(enc, row_sets, params)
        if enc is run.enc_test:
            predicted.append(([np.asarray(r).tolist() for r in row_sets], out))
        return out

    run.slots._predict = spy
