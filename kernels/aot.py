"""Ahead-of-time compile check of the Triton kernels for sm_90 (H100), without a GPU.

    python -m fedlora.kernels.aot --out DIR            # CI subset (a few shapes, minutes on 2 cores)
    python -m fedlora.kernels.aot --full --out DIR     # the whole sweep (or FEDLORA_AOT_FULL=1)
    python -m fedlora.kernels.aot --each-config-once   # the CI subset, each config compiled once (the test)

How. The real op (``lora_linear_triton`` / ``lora_linear_multi``, forward and backward through
autograd) runs on ``meta`` tensors inside ``fedlora.kernels.lora_linear.compile_only``: its host code is
unchanged (validation, adapter folding, segments, fuse / precision / base-GEMM variant choice,
launch arguments and constexprs) and each launch reaches a hook instead of the GPU. The hook asks
the kernel's own autotuner for the configs it would try (``Autotuner.prune_configs`` — the same
``early_config_prune`` a launch runs) and compiles each one with ``JITFunction.warmup`` for
``GPUTarget('cuda', ARCH, 32)``: a stand-in driver answers ``get_current_target()`` (no CUDA
driver is needed), and Triton's bundled ``ptxas`` produces the cubin. ``ptxas -v`` output
(registers, stack frame, spill stores/loads) is captured per compile; ``metadata.shared`` gives the
dynamic shared memory.

Failure (exit 1): any config fails to compile, or a launch has no pruned config whose shared
memory fits one block (``--smem-limit``, default 232448 bytes = H100's 227 KiB opt-in per block;
the autotuner skips configs that do not fit, so one fitting config per launch is what a run
needs). Spills are reported, not failures. Exit 2: this triton cannot do it (needs ≥ 3.9 with
the NVIDIA backend) — a message, not a traceback.

``--each-config-once`` (what ``tests/test_kernels_aot.py`` runs, ≈ 2/3 of the compiles): a kept config is
compiled for one launch of each (kernel, dtype, precision) — the first that keeps it — and every launch
compiles its configs not compiled before, then the others until one fits; so every (kernel, dtype,
precision, config) compiles for sm_90, every launch's flag set compiles with at least one config, and the
fit check is the same (a launch fails only when none of its kept configs fits). What it leaves out is a
config already compiled recompiled with other flags (e.g. with and without the bias); the default compiles
every (launch, config) pair.

Output: ``aot_sm{ARCH}.json`` (every compiled (launch, config) row, the summary, the failures) and
``aot_sm{ARCH}.md`` (summary, per-kernel register/spill/shared-memory table) in ``--out``.

Cases (d_in = d_out = d, bias on, W0 in nn.Linear layout and, in the full sweep, GPT-2 Conv1D's
transposed layout): single-client op for M ∈ {1, 16, 8192}, d ∈ {1000, 4096}, (r, r̃) ∈ {(1, 0),
(8, 2), (64, 64)}, both base-GEMM variants; multi-client op with K = 8 (equal and unequal
segments); dtypes bf16, fp16, fp32 (IEEE, and TF32 as chosen when torch allows TF32). The CI
subset (``CI_CASES``) keeps the largest shape per kernel flavour.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import dataclasses
import io
import json
import multiprocessing as mp
import os
import pathlib
import re
import sys
import tempfile
import time

import torch

from fedlora import kernels  # the package (torch, its modules) is imported before this module anyway

from .lora_linear import _load_triton, compile_only

# triton (an optional dependency) is imported by check_environment, which first unsets TRITON_INTERPRET

SMEM_LIMIT_H100 = 232448  # bytes per block (227 KiB, opt-in maximum on sm_90)
MIN_TRITON = (3, 9)


class AOTUnavailable(RuntimeError):
    """This environment cannot compile ahead of time (old triton, interpreter already on, no backend)."""


def _version_tuple(v: str) -> tuple:
    nums = []
    for part in re.split(r"[.+-]", v)[:3]:
        m = re.match(r"\d+", part)
        nums.append(int(m.group()) if m else 0)
    return tuple(nums)


def check_environment():
    """Import triton (interpreter off) and check the 3.9 APIs this tool uses; raise AOTUnavailable."""
    if "triton" not in sys.modules:
        os.environ.pop("TRITON_INTERPRET", None)  # compile for real, never interpret
    try:
        import triton
    except Exception as exc:
        raise AOTUnavailable(f"triton is not importable ({exc!r})") from exc
    ver = getattr(triton, "__version__", "0")
    if _version_tuple(ver) < MIN_TRITON:
        raise AOTUnavailable(f"needs triton >= {'.'.join(map(str, MIN_TRITON))} (GPU-less compile through a "
                             f"stand-in driver), found triton {ver}; the kernels themselves still run on it")
    try:
        from triton import knobs
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.runtime.driver import driver

        knobs.nvidia.dump_ptxas_log  # noqa: B018  (attribute presence)
        knobs.compilation.always_compile  # noqa: B018
        driver.set_active  # noqa: B018
        from triton.backends import backends

        if "nvidia" not in backends:
            raise AOTUnavailable("triton has no NVIDIA backend in this install")
    except AOTUnavailable:
        raise
    except Exception as exc:
        raise AOTUnavailable(f"triton {ver} lacks an API this tool needs ({exc!r})") from exc
    if knobs.runtime.interpret:
        raise AOTUnavailable("TRITON_INTERPRET=1 was set when triton was imported in this process; run "
                             "`python -m fedlora.kernels.aot` in a fresh process")
    tk = _load_triton()
    if tk.INTERPRET:
        raise AOTUnavailable("the kernels were loaded under the Triton interpreter in this process; run "
                             "`python -m fedlora.kernels.aot` in a fresh process")
    return triton


class _StandInDriver:
    """Just enough of a Triton driver to compile (never launch) for a fixed target."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("meta")

    @staticmethod
    def is_active():
        return True


_PTXAS = {
    "regs": re.compile(r"Used (\d+) registers"),
    "frame": re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"),
}


def parse_ptxas(log: str) -> dict | None:
    """Registers, stack frame and spill bytes from one kernel's ``ptxas -v`` log (None if absent)."""
    regs = _PTXAS["regs"].search(log)
    frame = _PTXAS["frame"].search(log)
    if not regs or not frame:
        return None
    return {"regs": int(regs.group(1)), "stack": int(frame.group(1)), "spill_stores": int(frame.group(2)),
            "spill_loads": int(frame.group(3))}


@dataclasses.dataclass
class Case:
    """One op call compiled forward + backward."""
    op: str  # 'single' | 'multi'
    dtype: str  # 'bf16' | 'fp16' | 'fp32'
    precision: str | None  # None: the op's own choice; 'tf32' for fp32 with TF32 allowed
    M: int
    d: int
    r: int
    rc: int
    base_gemm: str  # 'triton' | 'cublas'
    w_layout: str = "linear"  # 'linear' (d_out, d_in) contiguous | 'conv1d' (weight.T of a (d_in, d_out))
    K: int = 1
    segments: str = "equal"  # multi only: 'equal' | 'unequal'
    x_layout: str = "rows"  # 'rows' (M, d) | 'rows3d' (2, M/2, d) strided, not viewable as (M, d)
    deterministic: bool = False  # under torch.use_deterministic_algorithms(True)

    @property
    def name(self) -> str:
        prec = self.dtype + ("-tf32" if self.precision == "tf32" else "")
        op = "single" if self.op == "single" else f"multi K={self.K} {self.segments}"
        extra = (" X=rows3d" if self.x_layout == "rows3d" else "") + (" deterministic" if self.deterministic else "")
        return (f"{op} {prec} M={self.M} d={self.d} r={self.r}+{self.rc} base={self.base_gemm} "
                f"W0={self.w_layout}{extra}")


def full_cases() -> list[Case]:
    cases = []
    precs = [("bf16", None), ("fp16", None), ("fp32", None), ("fp32", "tf32")]
    for dt, prec in precs:
        for layout in ("linear", "conv1d"):
            for M in (1, 16, 8192):
                for d in (1000, 4096):
                    for r, rc in ((1, 0), (8, 2), (64, 64)):
                        for bg in ("triton", "cublas"):
                            cases.append(Case("single", dt, prec, M, d, r, rc, bg, layout))
            for M in (16, 8192):
                for r, rc in ((8, 2), (64, 64)):
                    for seg in ("equal", "unequal"):
                        for bg in ("triton", "cublas"):
                            cases.append(Case("multi", dt, prec, M, 4096, r, rc, bg, layout, K=8, segments=seg))
        for M in (16, 8192):  # strided 3-D hidden states; deterministic reductions
            for bg in ("triton", "cublas"):
                cases.append(Case("single", dt, prec, M, 4096, 8, 2, bg, x_layout="rows3d"))
                cases.append(Case("single", dt, prec, M, 4096, 8, 2, bg, deterministic=True))
    return cases


# the CI subset (every kernel flavour at least once, a few minutes on 2 cores): bf16 (the GPU
# benchmark's dtype) at the goal shape M = 8192, d = 4096, r = 8+2, where the autotuner keeps every
# tile size (the largest shared-memory users); the cuBLAS-base variant with the wide rank, GPT-2's
# Conv1D W0, strided 3-D X and deterministic reductions; the multi-client scan over unequal
# segments; fp32 IEEE (FMA dots) and fp16 at small shapes (their big tiles: --full)
CI_CASES = [
    Case("single", "bf16", None, 8192, 4096, 8, 2, "triton"),
    Case("single", "bf16", None, 16, 4096, 64, 64, "cublas", "conv1d", x_layout="rows3d", deterministic=True),
    Case("multi", "bf16", None, 16, 4096, 8, 2, "triton", K=8, segments="unequal"),
    Case("single", "fp32", None, 16, 1000, 64, 64, "triton"),
    Case("single", "fp16", None, 1, 1000, 1, 0, "triton", "conv1d"),
]


_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _flags(kwargs: dict) -> str:
    return ",".join(k for k, v in kwargs.items() if v is True) or "-"


def _config_str(cfg) -> str:
    kw = "×".join(f"{v}" for v in cfg.kwargs.values())
    return f"{'×'.join(cfg.kwargs)}={kw} w{cfg.num_warps} s{cfg.num_stages}"


class Compiler:
    """Collects, per launch the op makes, the pruned configs compiled for the target."""

    def __init__(self, arch: int, smem_limit: int, each_config_once: bool = False):
        self.arch, self.smem_limit, self.each_config_once = arch, smem_limit, each_config_once
        self.compiled_keys: set = set()  # (kernel, dtype, precision, config) compiled so far (each_config_once)
        self.rows: list[dict] = []
        self.launches: list[dict] = []
        self.failures: list[str] = []
        self.stats_by_hash: dict[str, dict] = {}
        self.case: Case | None = None

    def hook(self, kernel, grid, args, kwargs):
        """``compile_only`` hook: compile every config the autotuner would try for this launch (with
        ``each_config_once``: those not compiled before, then the others until one fits)."""
        at = kernel
        named = dict(zip(at.arg_names, args))
        at.nargs = named
        try:
            pruned = at.prune_configs(kwargs)  # the autotuner's own pruning (early_config_prune)
        finally:
            at.nargs = None
        kname = at.base_fn.__name__
        shape = {k: named[k] for k in ("M", "N", "K", "R", "P", "Q") if k in named}
        launch = {"case": self.case.name, "kernel": kname, "flags": _flags(kwargs),
                  "precision": kwargs.get("PRECISION"), "shape": shape, "configs": len(pruned), "fit": 0,
                  "compiled": 0}

        def key(cfg):
            return kname, self.case.dtype, launch["precision"], _config_str(cfg)

        if self.each_config_once:  # new configs first, then the others only until one fits
            fresh = [c for c in pruned if key(c) not in self.compiled_keys]
            order, new = fresh + [c for c in pruned if key(c) in self.compiled_keys], len(fresh)
        else:
            order, new = pruned, len(pruned)
        for i, cfg in enumerate(order):
            if i >= new and launch["fit"]:
                break
            launch["compiled"] += 1
            self.compiled_keys.add(key(cfg))
            row = {"case": self.case.name, "dtype": self.case.dtype, "kernel": kname, "flags": launch["flags"],
                   "precision": launch["precision"], "shape": shape, "config": _config_str(cfg),
                   "num_warps": cfg.num_warps, "num_stages": cfg.num_stages, **cfg.kwargs}
            buf = io.StringIO()
            try:
                with contextlib.redirect_stdout(buf):
                    ck = at.fn.warmup(*args, grid=grid, **kwargs, **cfg.all_kwargs())
            except Exception as exc:  # a compile error is a failure of this check
                msg = f"{self.case.name}: {kname} [{launch['flags']}] {row['config']}: compile error: " \
                      f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
                self.failures.append(msg)
                row.update(error=msg)
                self.rows.append(row)
                continue
            stats = parse_ptxas(buf.getvalue())
            if stats is None:
                stats = self.stats_by_hash.get(ck.hash)
            if stats is None:
                msg = f"{self.case.name}: {kname} {row['config']}: no ptxas -v output captured"
                self.failures.append(msg)
                row.update(error=msg)
                self.rows.append(row)
                continue
            self.stats_by_hash[ck.hash] = stats
            shared = int(ck.metadata.shared)
            fits = shared <= self.smem_limit
            launch["fit"] += fits
            row.update(stats, shared=shared, fits=fits, hash=ck.hash)
            self.rows.append(row)
        if launch["fit"] == 0:
            self.failures.append(f"{self.case.name}: {kname} [{launch['flags']}] {shape}: none of the "
                                 f"{len(pruned)} pruned configs fits {self.smem_limit} bytes of shared memory")
        self.launches.append(launch)

    def run_case(self, case: Case):
        self.case = case
        dt = getattr(torch, _DTYPES[case.dtype])

        def leaf(*shape):
            return torch.empty(shape, dtype=dt, device="meta", requires_grad=True)

        if case.x_layout == "rows3d":  # a (2, M/2, d) view of a (2, M/2 + 1, d) buffer: rows in place
            half = max(case.M // 2, 1)
            x = torch.empty(2, half + 1, case.d, dtype=dt, device="meta")[:, :half].requires_grad_()
        else:
            x = leaf(case.M, case.d)
        if case.w_layout == "conv1d":  # GPT-2 Conv1D keeps (d_in, d_out); the layer passes weight.T
            w = torch.empty(case.d, case.d, dtype=dt, device="meta").T
        else:
            w = torch.empty(case.d, case.d, dtype=dt, device="meta")
        bias = torch.empty(case.d, dtype=dt, device="meta")
        a, b = leaf(case.r, case.d), leaf(case.d, case.r)
        det = torch.are_deterministic_algorithms_enabled()
        try:
            torch.use_deterministic_algorithms(case.deterministic)
            with compile_only(self.hook):
                if case.op == "single":
                    c = dd = None
                    if case.rc:
                        c, dd = leaf(case.rc, case.d), leaf(case.d, case.rc)
                    y = kernels.lora_linear_triton(x, w, bias, a, b, 0.5, c, dd, 2.0, precision=case.precision,
                                                   base_gemm=case.base_gemm)
                    ins = [t for t in (x, a, b, c, dd) if t is not None]
                else:
                    c, dd = leaf(case.K, case.rc, case.d), leaf(case.K, case.d, case.rc)
                    if case.segments == "equal":
                        offs = [k * case.M // case.K for k in range(case.K + 1)]
                    else:  # client k gets a share ∝ k: the first client is empty, the rest uneven
                        tri = case.K * (case.K - 1) // 2
                        offs = [round(case.M * (k * (k - 1) // 2) / tri) for k in range(case.K + 1)]
                    y = kernels.lora_linear_multi(x, w, bias, a, b, c, dd, offs, 0.5, 2.0, backend="triton",
                                                  precision=case.precision, base_gemm=case.base_gemm)
                    ins = [x, a, b, c, dd]
                torch.autograd.grad(y, ins, torch.empty_like(y))
        except Exception as exc:  # host code failing on this case is a failure too
            self.failures.append(f"{case.name}: op failed before compiling: {type(exc).__name__}: {exc}")
        finally:
            torch.use_deterministic_algorithms(det)


def summarize(rows: list[dict], launches: list[dict], failures: list[str], smem_limit: int) -> dict:
    ok = [r for r in rows if "error" not in r]
    kernels_ = sorted({r["kernel"] for r in ok})
    per_kernel = {}
    for k in kernels_:
        kr = [r for r in ok if r["kernel"] == k]
        per_kernel[k] = {
            "configs": len(kr), "unique_binaries": len({r["hash"] for r in kr}),
            "max_regs": max(r["regs"] for r in kr), "with_spills": sum(r["spill_stores"] > 0 for r in kr),
            "max_spill_stores": max(r["spill_stores"] for r in kr),
            "max_shared": max(r["shared"] for r in kr), "over_smem": sum(not r["fits"] for r in kr),
        }
    return {
        "compiled_configs": len(ok), "unique_binaries": len({r["hash"] for r in ok}), "launches": len(launches),
        "failed": len(failures), "smem_limit": smem_limit,
        "max_regs": max((r["regs"] for r in ok), default=0),
        "configs_with_spills": sum(r["spill_stores"] > 0 or r["spill_loads"] > 0 for r in ok),
        "max_shared": max((r["shared"] for r in ok), default=0),
        "configs_over_smem": sum(not r["fits"] for r in ok),
        "per_kernel": per_kernel,
    }


def write_report(out: pathlib.Path, arch: int, meta: dict, rows, launches, failures, summary) -> tuple:
    out.mkdir(parents=True, exist_ok=True)
    js = out / f"aot_sm{arch}.json"
    md = out / f"aot_sm{arch}.md"
    js.write_text(json.dumps({**meta, "summary": summary, "failures": failures, "launches": launches,
                              "rows": rows}, indent=1))
    lines = [f"# Triton kernels compiled ahead of time for sm_{arch}", "",
             f"triton {meta['triton']}, torch {meta['torch']}, {meta['mode']} ({meta['cases']} op calls, "
             f"forward + backward), shared-memory limit {summary['smem_limit']} bytes per block, "
             f"{meta['seconds']:.0f} s wall ({meta.get('jobs', 1)} process(es)). Command: `{meta['command']}`.", "",
             f"**{summary['compiled_configs']} configs compiled** ({summary['unique_binaries']} distinct binaries, "
             f"{summary['launches']} launches); max registers {summary['max_regs']}; configs with spills "
             f"{summary['configs_with_spills']}; max shared memory {summary['max_shared']} bytes; configs over the "
             f"limit {summary['configs_over_smem']}; failures {summary['failed']}.", "",
             "| kernel | configs | binaries | max regs | configs with spills | max spill stores (B) | "
             "max shared (B) | over limit |", "|---|---|---|---|---|---|---|---|"]
    for k, s in summary["per_kernel"].items():
        lines.append(f"| {k} | {s['configs']} | {s['unique_binaries']} | {s['max_regs']} | {s['with_spills']} | "
                     f"{s['max_spill_stores']} | {s['max_shared']} | {s['over_smem']} |")
    if failures:
        lines += ["", "## failures", ""] + [f"- {f}" for f in failures]
    lines += ["", "## every compiled config", "",
              "| case | kernel | flags | prec | config | regs | spill st/ld (B) | shared (B) | fits |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['kernel']} | {r['flags']} | {r['precision']} | {r['config']} | "
                         f"ERROR | | | |")
        else:
            lines.append(f"| {r['case']} | {r['kernel']} | {r['flags']} | {r['precision']} | {r['config']} | "
                         f"{r['regs']} | {r['spill_stores']}/{r['spill_loads']} | {r['shared']} | "
                         f"{'yes' if r['fits'] else 'NO'} |")
    md.write_text("\n".join(lines) + "\n")
    return js, md


@contextlib.contextmanager
def _compile_session(arch: int, cache_dir: str | None):
    """Stand-in driver for ``arch`` + ptxas -v capture + a private, always-recompiled kernel cache."""
    from triton import knobs
    from triton.runtime.driver import driver

    prev_active = driver._active  # restored afterwards (reset_active would look for a real GPU)
    prev = (knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile, knobs.cache.dir)
    tmp = None
    if cache_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="fedlora_aot_")
        cache_dir = tmp.name
    try:
        driver.set_active(_StandInDriver(arch))
        knobs.nvidia.dump_ptxas_log = True  # ptxas -v output per compile (registers, spills)
        knobs.compilation.always_compile = True  # never a silent disk-cache hit without that output
        knobs.cache.dir = cache_dir
        yield
    finally:
        driver.set_active(prev_active)
        knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile, knobs.cache.dir = prev
        if tmp is not None:
            tmp.cleanup()


_WORKER: dict = {}


def _worker_init(arch: int, smem_limit: int, each_config_once: bool = False):
    check_environment()
    session = _compile_session(arch, None)
    session.__enter__()  # held for the worker's life (its cache directory goes with the process)
    _WORKER.update(compiler=Compiler(arch, smem_limit, each_config_once), session=session)


def _run_one(comp: "Compiler", case: "Case") -> tuple:
    """Compile one case; returns its (rows, launches, failures, seconds)."""
    n0, l0, f0 = len(comp.rows), len(comp.launches), len(comp.failures)
    t0 = time.perf_counter()
    comp.run_case(case)
    return comp.rows[n0:], comp.launches[l0:], comp.failures[f0:], time.perf_counter() - t0


def _worker_case(case_fields: dict):
    return _run_one(_WORKER["compiler"], Case(**case_fields))


def run(cases, arch: int = 90, smem_limit: int = SMEM_LIMIT_H100, jobs: int = 1, log=print,
        each_config_once: bool = False) -> tuple:
    """Compile every case; returns (rows, launches, failures, summary). Needs ``check_environment()``.

    ``jobs`` > 1: cases spread over that many fresh (spawned) processes, each with its own caches (and, with
    ``each_config_once``, its own record of what it compiled).
    """
    rows, launches, failures = [], [], []

    def done(i, case, r, la, f, sec):
        rows.extend(r)
        launches.extend(la)
        failures.extend(f)
        log(f"[{i + 1}/{len(cases)}] {case.name}: {len(r)} configs, {len(f)} failures, {sec:.1f} s")

    if jobs <= 1:
        comp = Compiler(arch, smem_limit, each_config_once)
        with _compile_session(arch, None):
            for i, case in enumerate(cases):
                done(i, case, *_run_one(comp, case))
    else:
        with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn"),
                                    initializer=_worker_init, initargs=(arch, smem_limit, each_config_once)) as pool:
            futs = [pool.submit(_worker_case, dataclasses.asdict(c)) for c in cases]
            for i, (case, fut) in enumerate(zip(cases, futs)):
                done(i, case, *fut.result())
    return rows, launches, failures, summarize(rows, launches, failures, smem_limit)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fedlora.kernels.aot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="the whole sweep (default: the CI subset; env "
                                                        "FEDLORA_AOT_FULL=1 does the same)")
    ap.add_argument("--out", default=None, help="output directory (default: a fresh temporary directory)")
    ap.add_argument("--arch", type=int, default=90, help="compute capability to compile for (default 90)")
    ap.add_argument("--smem-limit", type=int, default=SMEM_LIMIT_H100,
                    help=f"shared memory per block in bytes (default {SMEM_LIMIT_H100}, H100)")
    ap.add_argument("--only", default=None, help="regular expression: compile only cases whose name matches")
    ap.add_argument("--jobs", type=int, default=1, help="compile in this many processes (default 1)")
    ap.add_argument("--each-config-once", action="store_true",
                    help="compile each kept config for one launch only (per kernel, dtype and precision), and "
                         "every launch until one of its configs fits (the test's mode; default: every pair)")
    args = ap.parse_args(argv)
    full = args.full or os.environ.get("FEDLORA_AOT_FULL", "0") == "1"
    cases = full_cases() if full else list(CI_CASES)
    if args.only:
        cases = [c for c in cases if re.search(args.only, c.name)]
        if not cases:
            ap.error(f"--only {args.only!r} matches no case")
    try:
        triton = check_environment()
    except AOTUnavailable as exc:
        print(f"fedlora.kernels.aot: cannot compile ahead of time: {exc}", file=sys.stderr)
        return 2
    out = pathlib.Path(args.out) if args.out else pathlib.Path(tempfile.mkdtemp(prefix="kernels_aot_"))
    t0 = time.perf_counter()
    if args.jobs < 1:
        ap.error("--jobs must be >= 1")
    rows, launches, failures, summary = run(cases, args.arch, args.smem_limit, jobs=args.jobs,
                                            log=lambda s: print(s, flush=True), each_config_once=args.each_config_once)
    meta = {"arch": args.arch, "triton": triton.__version__, "torch": torch.__version__,
            "mode": "full sweep" if full else "CI subset", "cases": len(cases), "jobs": args.jobs,
            "seconds": time.perf_counter() - t0,
            "command": "python -m fedlora.kernels.aot" + (" --full" if full else "") + (
                f" --only '{args.only}'" if args.only else "") + (f" --jobs {args.jobs}" if args.jobs > 1 else "") + (
                " --each-config-once" if args.each_config_once else ""),
            "each_config_once": args.each_config_once}
    js, md = write_report(out, args.arch, meta, rows, launches, failures, summary)
    print(f"{summary['compiled_configs']} configs compiled ({summary['unique_binaries']} binaries), max regs "
          f"{summary['max_regs']}, configs with spills {summary['configs_with_spills']}, max shared "
          f"{summary['max_shared']} B, over the limit {summary['configs_over_smem']}, failures {len(failures)}")
    print(f"written: {js} {md}")
    if failures:
        print(f"fedlora.kernels.aot: {len(failures)} failure(s):", file=sys.stderr)
        for f in failures:
            print(f"  {f}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
