#!/usr/bin/env bash
# Everything the GPU machine runs, in one go, from the repository root:
#
#   OUT=/some/dir bash scripts/gpu_run.sh
#
# 1. the machine: nvidia-smi, torch and CUDA versions;
# 2. scripts/gpu_check.sh: builds sharc against the installed CUDA torch
#    into build/gpu and runs tests/python/test_cuda.py (at most
#    CHECK_TIMEOUT seconds, default 270);
# 3. bench/gpu.py: sharc compiled, torch.compile and FSDP2 compiled on the
#    124M GPT (at most BENCH_TIMEOUT seconds, default 300; BENCH_ARGS adds
#    options, e.g. BENCH_ARGS="--compile blocks" for a cheaper compile).
# The two limits together stay under the device tool's 600 s per command.
# Every stage runs whatever the one before it did, and its exit status is
# printed; all output goes to $OUT/*.log (and to the terminal), and the logs
# and results are copied into build/gpu/ at the end. Exits nonzero when any
# stage failed.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-build/gpu/run}
mkdir -p "$OUT" build/gpu
OUT=$(cd "$OUT" && pwd)
PYTHON=${PYTHON:-python3}
CHECK_TIMEOUT=${CHECK_TIMEOUT:-270}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-300}
export PYTHON PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/python:$PWD/tests/python${PYTHONPATH:+:$PYTHONPATH}"
STATUS=()

stage() {  # stage NAME LOG COMMAND...: runs it, tees it, records its exit status
  local name=$1 log=$2
  shift 2
  echo "=== $name: $* ($(date -u +%H:%M:%S))"
  local start=$SECONDS
  "$@" 2>&1 | tee "$OUT/$log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 124 ] && echo "=== $name: TIMED OUT (timeout's exit status 124)"
  echo "=== $name: exit status $rc after $((SECONDS - start)) s"
  STATUS+=("$name=$rc")
}

machine() {
  nvidia-smi || echo "nvidia-smi failed"
  command -v nvcc >/dev/null && nvcc --version | tail -2
  [ -x /usr/local/cuda/bin/nvcc ] && /usr/local/cuda/bin/nvcc --version | tail -2
  cmake --version | head -1
  "$PYTHON" -c "import sys, torch; print('python', sys.version.split()[0]); \
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', \
torch.cuda.is_available(), 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None); \
print('gpu', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)"
  git log --oneline -1 2>/dev/null
  git status --short 2>/dev/null | head -30
}

stage machine machine.log machine
# gpu_check.sh writes its own $OUT/gpu_check.log too; this one adds the timeout.
stage gpu_check gpu_check_run.log timeout -k 10 "$CHECK_TIMEOUT" bash scripts/gpu_check.sh "$OUT"
# If the build failed, a library built elsewhere against the same torch
# (an ignored .gpu_prebuilt/ folder carried to the machine: see docs/gpu.md,
# "What ran", for one built with the system g++ against the same wheel) still lets the tests
# and the benchmark run; the build's failure stays in the stage statuses.
if [ ! -f build/gpu/libsharc_torch.so ] && [ -f .gpu_prebuilt/libsharc_torch.so ]; then
  echo "=== the build failed: using .gpu_prebuilt/libsharc_torch.so for what follows"
  mkdir -p python/sharc/lib && cp .gpu_prebuilt/libsharc_torch.so python/sharc/lib/
  stage prebuilt_tests prebuilt_tests.log timeout -k 10 "$CHECK_TIMEOUT" \
    "$PYTHON" -m pytest tests/python/test_cuda.py -v -rs --durations=0
fi
stage bench bench.log timeout -k 10 "$BENCH_TIMEOUT" "$PYTHON" bench/gpu.py --out "$OUT" \
  --time-limit $((BENCH_TIMEOUT - 20)) ${BENCH_ARGS:-}

echo "=== stages: ${STATUS[*]}"
printf '%s\n' "${STATUS[@]}" > "$OUT/status.txt"
if [ "$OUT" != "$(cd build/gpu && pwd)" ]; then
  cp "$OUT"/*.log "$OUT"/status.txt build/gpu/ 2>/dev/null
  cp "$OUT"/gpu.json "$OUT"/gpu.md build/gpu/ 2>/dev/null
fi
for s in "${STATUS[@]}"; do
  [ "${s#*=}" = 0 ] || exit 1
done
exit 0
