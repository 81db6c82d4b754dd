#!/usr/bin/env bash
# The CUDA check (issue 12), for a machine with a GPU and a CUDA build of
# torch already installed (no network needed): builds sharc's extension
# against that torch into build/gpu, then runs tests/python/test_cuda.py,
# writing everything to a log.
#
#   bash scripts/gpu_check.sh [log directory]     # default: build/gpu
#   PYTHON=/path/to/python bash scripts/gpu_check.sh
#
# The CPU set-up (scripts/setup.sh) and CI are not involved.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
LOG_DIR=${1:-build/gpu}
mkdir -p "$LOG_DIR"
LOG="$LOG_DIR/gpu_check.log"
exec > >(tee "$LOG") 2>&1

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: $PYTHON has no CUDA torch, or no GPU is visible; this check needs both" >&2
  exit 1
fi
"$PYTHON" -c "import torch; print('gpu:', torch.cuda.get_device_name(0)); \
print('torch:', torch.__version__, 'cuda:', torch.version.cuda)"

command -v cmake >/dev/null || { echo "gpu_check: cmake is needed" >&2; exit 1; }
GENERATOR=()
command -v ninja >/dev/null && GENERATOR=(-G Ninja)
# A CUDA build of torch makes find_package(Torch) look for the CUDA toolkit;
# point it at the usual install when there is one.
CUDA_ARGS=()
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
if [ -d "$CUDA_HOME" ]; then
  CUDA_ARGS=(-DCUDA_TOOLKIT_ROOT_DIR="$CUDA_HOME" -DCUDAToolkit_ROOT="$CUDA_HOME")
  [ -x "$CUDA_HOME/bin/nvcc" ] && CUDA_ARGS+=(-DCMAKE_CUDA_COMPILER="$CUDA_HOME/bin/nvcc")
  export PATH="$CUDA_HOME/bin:$PATH"
fi
# The system's C++ compiler, whose libstdc++ headers match the libstdc++ the
# process loads. On the GPU machines CXX names a newer GCC (/opt/gcc): a
# library built with its headers defines its own copies of the locale facets'
# ids and crashed in the first integer it formatted (seen on an H200,
# 2026-11-26). SHARC_CXX picks another.
CXX_ARGS=()
SHARC_CXX=${SHARC_CXX:-$( [ -x /usr/bin/g++ ] && echo /usr/bin/g++ )}
[ -n "$SHARC_CXX" ] && CXX_ARGS=(-DCMAKE_CXX_COMPILER="$SHARC_CXX")
# Release, as scripts/dev_build.sh builds: bench/gpu.py times this build.
cmake -S . -B build/gpu "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DPython_EXECUTABLE="$(command -v "$PYTHON")" "${CXX_ARGS[@]}" \
  -DSHARC_BUILD_EXTENSION=ON -DSHARC_BUILD_TESTS=OFF "${CUDA_ARGS[@]}"
cmake --build build/gpu -j "$(nproc)"
if nm -D --defined-only build/gpu/libsharc_torch.so | grep -q '_ZGVNSt7num_put'; then
  rm -f build/gpu/libsharc_torch.so
  echo "gpu_check: the library defines libstdc++'s locale facet ids itself: the compiler's" \
       "libstdc++ headers are newer than the libstdc++ loaded at run time, and formatting" \
       "a number would crash; set SHARC_CXX to the system's g++ and rerun" >&2
  exit 1
fi
mkdir -p python/sharc/lib
cp build/gpu/libsharc_torch.so python/sharc/lib/

export PYTHONPATH="$PWD/python:$PWD/tests/python${PYTHONPATH:+:$PYTHONPATH}"
if "$PYTHON" -c "import pytest" 2>/dev/null; then
  # Each test runs its ranks in processes of their own; with pytest-xdist
  # four tests share the GPU at once (none of them needs much of it).
  PARALLEL=()
  "$PYTHON" -c "import xdist" 2>/dev/null && PARALLEL=(-n 4)
  "$PYTHON" -m pytest tests/python/test_cuda.py -v -rs --durations=0 "${PARALLEL[@]}"
else
  echo "gpu_check: pytest is not installed; running the tests without it"
  "$PYTHON" tests/python/test_cuda.py
fi
echo "gpu_check: passed; log in $LOG"
