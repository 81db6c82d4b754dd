#!/usr/bin/env bash
# For working on sharc: builds the extension of this checkout into
# build/dev against the torch in .venv and puts it beside the Python
# package, so that the working tree runs without reinstalling:
#
#   bash scripts/dev_build.sh && PYTHONPATH=python .venv/bin/python -m pytest tests/python/...
#
# VENV=/path/to/venv picks another environment (a git worktree can use the
# main checkout's). Incremental: only changed sources rebuild.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY="$VENV/bin/python"
export PATH="$(cd "$VENV/bin" && pwd):$PATH"
GENERATOR=()
command -v ninja >/dev/null && GENERATOR=(-G Ninja)
if [ ! -f build/dev/CMakeCache.txt ]; then
  cmake -S . -B build/dev "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DPython_EXECUTABLE="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" \
    -DSHARC_BUILD_EXTENSION=ON -DSHARC_BUILD_TESTS=OFF >/dev/null
fi
cmake --build build/dev -j "$(nproc)"
mkdir -p python/sharc/lib python/sharc/bin
cp build/dev/libsharc_torch.so python/sharc/lib/
[ -f build/dev/sharc-opt ] && cp build/dev/sharc-opt python/sharc/bin/ || true
echo "dev_build: python/sharc/lib/libsharc_torch.so from build/dev"
