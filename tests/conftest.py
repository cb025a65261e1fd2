"""Shared test set-up: deterministic, single-threaded torch (tiny problems; no spin-wait overhead).

TRITON_INTERPRET=1 is set before anything can import triton: the kernel tests run the Triton path on
CPU under the interpreter, and triton fixes its mode when first imported — which ``import peft`` (an
LLM test) does, whatever test file happens to run first. Tests that need the compiler (the AOT check)
clear it in their subprocess's environment.

The tests import fedlora as installed (``make env``: an editable install of this checkout), never from
the repo root on ``sys.path`` (issue 18 §2): there the folder ``kernels/`` — installed as
``fedlora.kernels`` — would be a top-level ``kernels`` that hides HuggingFace's, and ``llm/`` PyPI's
``llm``. ``make test`` runs ``.venv/bin/pytest``, which puts only ``tests/`` on ``sys.path`` (for helpers
such as ``_kernel_helpers``); ``python -m pytest`` or ``PYTHONPATH=.`` would add the root, so it is taken
off here. If ``fedlora`` is not this checkout's (not installed, or another copy), the run stops.

``FEDLORA_TEST_DEVICE=cuda`` runs the kernel tests (``tests/test_kernels_*.py``) on a GPU with the compiled
kernels instead of the interpreter: see ``_on_test_device`` (how a GPU session runs them: docs/how-to/gpu.md, "Check the kernels on your GPU").
"""
import os
import sys
from pathlib import Path

# One intra-op thread in every process the suite runs: this one (module and session fixtures run before the
# per-test ``_single_thread``), and, through the environment, every subprocess it starts (commands, Flower's
# SuperNodes and ClientApps, Ray's actors, the rank-recovery worker). ``make test`` already runs one pytest worker
# per core; a second thread per process only oversubscribes the cores, and OpenMP's spin-waiting then costs far more
# than the thread gains on these tiny tensors (measured: the 5-seed rank-recovery fixture beside a busy worker took
# 147 s with torch's default threads, 14–35 s with one).
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

TEST_DEVICE = os.environ.get("FEDLORA_TEST_DEVICE", "cpu")
if TEST_DEVICE.startswith("cuda"):
    os.environ["TRITON_INTERPRET"] = "0"  # compiled kernels; triton fixes its mode when first imported
else:
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]


def _is_root(entry: str) -> bool:
    try:
        return Path(entry or os.curdir).resolve() == ROOT
    except OSError:
        return False


sys.path[:] = [p for p in sys.path if not _is_root(p)]

import pytest  # noqa: E402
import torch  # noqa: E402
from _xdist_order import pytest_collection_modifyitems, xdist_group  # noqa: E402,F401  (the suite's xdist hooks)

torch.set_num_threads(1)  # the environment above sets it at start-up; this holds if torch was imported before


def _checkout_problem() -> str | None:
    try:
        import fedlora.kernels
        import fedlora.llm
        import fedlora.synthetic
    except ImportError as e:
        return (f"cannot import the layers ({e}): fedlora is not installed in {sys.prefix}, or installed before they "
                f"moved under fedlora.* (issue 18): run `make env` (or `pip install -e .`)")
    for mod, folder in ((fedlora, "fedlora"), (fedlora.kernels, "kernels"), (fedlora.llm, "llm"),
                        (fedlora.synthetic, "synthetic")):
        where = Path(mod.__file__).resolve().parent
        if where != ROOT / folder:
            return (f"{mod.__name__} comes from {where}, not from this checkout's {folder}/: the tests would test "
                    f"another copy; reinstall this one with `make env` (or `pip install -e .`)")
    return None


_PROBLEM = _checkout_problem()


def pytest_configure(config):
    if _PROBLEM:
        raise pytest.UsageError(_PROBLEM)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """Every test module imported (torch, transformers, the library, ≈ 500,000 objects that live as long as the
    process): move them out of the garbage collector's generations (``gc.freeze``), so that a full collection,
    which an allocation-heavy test (a model, a figure) triggers, no longer walks them all. Measured on six tiny-smoke
    runs in one process: 0.49 s of collections → 0.09 s. Collection only frees unreachable cycles; no test's numbers
    depend on when it runs."""
    import gc

    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _single_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


# Factories whose tensors a kernel test creates as its data; on a test device each is created as on CPU (same
# generator, same numbers) and moved there. *_like and the library's own allocations follow their inputs.
_FACTORY_NAMES = ("randn", "rand", "randint", "randperm", "zeros", "ones", "empty", "full", "eye", "arange",
                  "linspace", "tensor", "as_tensor")
_LIBRARY_DIRS = tuple(str(ROOT / d) + os.sep for d in ("fedlora", "kernels", "llm", "synthetic"))
_TESTS_DIR = str(ROOT / "tests") + os.sep


class _TestDeviceMode(torch.overrides.TorchFunctionMode):
    """Moves the tensors a test itself creates to ``device``; what the library creates is left alone.

    A factory call counts as the test's when the stack from it holds a frame in tests/ and none in the library
    (fedlora/, kernels/, llm/, synthetic/): the kernels' own host tables (offsets on the CPU, say) and a test's
    spy wrapped around ``torch.tensor`` but called by kernel code keep the device they ask for. A test that names
    a device explicitly keeps it, except that a CPU generator draws on the CPU first (its numbers unchanged)."""

    def __init__(self, device):
        super().__init__()
        self.device = torch.device(device)
        self.factories = {getattr(torch, n) for n in _FACTORY_NAMES}

    def _tests_call(self) -> bool:
        f, in_tests = sys._getframe(2), False
        while f is not None:
            file = f.f_code.co_filename
            if file.startswith(_LIBRARY_DIRS):
                return False
            in_tests = in_tests or file.startswith(_TESTS_DIR)
            f = f.f_back
        return in_tests

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func not in self.factories or not self._tests_call():
            return func(*args, **kwargs)
        device = kwargs.pop("device", None)
        if device is not None and torch.device(device).type == "cpu":
            return func(*args, device=device, **kwargs)
        requires_grad = kwargs.pop("requires_grad", False)
        out = func(*args, **kwargs)  # on the CPU (the mode is off inside its own handler)
        return out.to(self.device if device is None else device).requires_grad_(requires_grad)


@pytest.fixture(autouse=True)
def _on_test_device(request):
    """``FEDLORA_TEST_DEVICE=cuda``: a kernel test's own tensors go to the GPU (compiled kernels, no interpreter).

    Only the kernel test files (``test_kernels_*.py``) are moved; everything else runs as on a CPU machine. Any
    other value than ``cpu`` (``cpu-mode``) turns the mode on with the CPU as its device: a check of the mode's
    plumbing on a machine without a GPU (every kernel test must pass under it unchanged)."""
    if (TEST_DEVICE == "cpu" or not request.node.path.name.startswith("test_kernels_")
            or request.node.get_closest_marker("cpu_tensors")):
        yield
        return
    with _TestDeviceMode("cpu" if TEST_DEVICE == "cpu-mode" else TEST_DEVICE):
        yield


@pytest.fixture(scope="session")
def tiny_smoke_run(tmp_path_factory):
    """``fedlora run tiny-smoke --set method.name=<method>`` (3 clients, client sampling on), run once per
    method and worker: a function method → the finished run's folder, which tests only read. The protocol
    goldens (tests/test_server_protocol.py) and Flower-equals-embedded (tests/test_flower.py) read the same runs;
    both are in the ``flower`` xdist group, so one worker makes each run once."""
    from fedlora.cli import main

    root = tmp_path_factory.mktemp("tiny_smoke")
    done: dict[str, Path] = {}

    def run(method: str) -> Path:
        if method not in done:
            before = os.environ.get("HF_HUB_OFFLINE")
            os.environ["HF_HUB_OFFLINE"] = "1"
            try:
                rc = main(["run", "tiny-smoke", "--set", f"method.name={method}", "--out", str(root / method),
                           "--no-progress"])
            finally:
                if before is None:
                    os.environ.pop("HF_HUB_OFFLINE", None)
                else:
                    os.environ["HF_HUB_OFFLINE"] = before
            assert rc == 0, method
            done[method] = root / method
        return done[method]

    return run


@pytest.fixture(scope="session")
def tiny_finished_run(tmp_path_factory):
    """``FederatedRun(tiny_config(method, lr 0.05, lora_alpha 6)).run()`` (tests/test_llm_runtime.py's tiny
    RoBERTa: 3 clients, half sampled, 2 rounds; α = 6 so that scales ≠ 1, except where the method's paper fixes
    the scale: Fed-SB), run once per method and worker: a function method → (the FederatedRun as the run left it,
    its summary, its folder). Read by the every-method runtime test (the records and files) and the export fidelity
    test (exports scored against the run's own logits; it rebinds slots, never writes the folder): both in the
    ``tiny_runs`` xdist group."""
    from fedlora.llm.runtime import FederatedRun
    from fedlora.methods import get_method
    from test_llm_runtime import tiny_config

    root = tmp_path_factory.mktemp("tiny_runs")
    done: dict[str, tuple] = {}

    def run(method: str):
        if method not in done:
            alpha = {} if getattr(get_method(method), "fixed_lora_scale", None) else {"model__lora_alpha": 6}
            cfg = tiny_config(root / method, method, method__lr=0.05, **alpha)
            fr = FederatedRun(cfg)
            done[method] = (fr, fr.run(), root / method / "run")
        return done[method]

    return run
