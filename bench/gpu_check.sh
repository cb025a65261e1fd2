#!/usr/bin/env bash
# The kernel checks a session runs when a GPU is lent (docs/how-to/gpu.md, "Check the kernels on your GPU"): one short script, each step
# bounded, everything logged under $1 (default bench/results/gpu), so a step that runs out of time still leaves
# the others' results.
#   1. the kernel test files on the GPU (FEDLORA_TEST_DEVICE=cuda: compiled kernels, fp32 IEEE, same tolerances
#      as the interpreter run; tests/conftest.py moves each test's own tensors to the GPU);
#   2. bench/kernels_gpu.py at d = 4096 (M = 16, 2048, 8192; every rank; torch.compile baseline; the
#      multi-client goal's shape) — its own float64 checks make it exit 1 on a wrong result;
#   3. the rest of the grid without the torch.compile baseline (d = 1024, 8192; M = 1 … 8192).
# Budgets in seconds: STEP1 STEP2 STEP3 (environment; 0 skips a step). Measured on an H100 (2026-11-27): step 1 needs
# more than 270 s with 16 workers on a fresh machine, step 2 about 190 s (docs/results/kernels-gpu.md).
set -u
OUT_DIR=${1:-bench/results/gpu}
mkdir -p "$OUT_DIR"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
{
  date -u
  nvidia-smi -L 2>&1
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
  $PY -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
} > "$OUT_DIR/device.txt" 2>&1
cat "$OUT_DIR/device.txt"
$PY -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 2)" || {
  echo "gpu_check.sh: $PY's torch sees no CUDA device; this script is for a GPU machine (on a CPU: make test)" >&2; exit 2; }

# fedlora as installed (the tests check it is this checkout); no dependencies: the image has them
$PY -m pip install -q --no-deps --no-build-isolation -e . >> "$OUT_DIR/device.txt" 2>&1 || { cat "$OUT_DIR/device.txt"; exit 2; }

step() { [ "${1:-0}" != 0 ]; }  # a budget of 0 skips the step

if step "${STEP1:-200}"; then
echo "== 1. kernel tests on the GPU"
FEDLORA_TEST_DEVICE=cuda timeout "${STEP1:-200}" $PY -m pytest -q -p no:cacheprovider -n "${TEST_WORKERS:-8}" \
  --durations=10 tests/test_kernels_triton.py tests/test_kernels_strides.py tests/test_kernels_hotpath.py \
  tests/test_kernels_dispatch.py > "$OUT_DIR/tests.txt" 2>&1
echo "rc=$?" >> "$OUT_DIR/tests.txt"
tail -25 "$OUT_DIR/tests.txt"
fi

if step "${STEP2:-200}"; then
echo "== 2. bench, d = 4096"
timeout "${STEP2:-200}" $PY bench/kernels_gpu.py --M 16 2048 8192 --d 4096 --out "$OUT_DIR/d4096" \
  > "$OUT_DIR/bench_d4096.txt" 2>&1
echo "rc=$?" >> "$OUT_DIR/bench_d4096.txt"
tail -40 "$OUT_DIR/bench_d4096.txt"
fi

if step "${STEP3:-130}"; then
echo "== 3. bench, the rest of the grid (no torch.compile)"
timeout "${STEP3:-130}" $PY bench/kernels_gpu.py --no-compile --M 1 16 128 2048 8192 --d 1024 8192 \
  --out "$OUT_DIR/grid" > "$OUT_DIR/bench_grid.txt" 2>&1
echo "rc=$?" >> "$OUT_DIR/bench_grid.txt"
tail -15 "$OUT_DIR/bench_grid.txt"
fi
