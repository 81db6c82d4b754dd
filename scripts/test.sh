#!/usr/bin/env bash
# The whole test suite: C++ unit tests through CTest (plain, then under
# ASan + UBSan), then the multi-process Python tests through pytest.
# Run scripts/setup.sh first.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"  # cmake/ninja from pip, if setup installed them there

cmake -S . -B build/cpp-tests -G Ninja -DSHARC_BUILD_EXTENSION=OFF -DSHARC_BUILD_TESTS=ON >/dev/null
cmake --build build/cpp-tests -j "$(nproc)"
ctest --test-dir build/cpp-tests --output-on-failure
# The same C++ tests under ASan + UBSan (about a minute from clean on two
# cores, seconds when build/cpp-asan exists); SHARC_SANITIZE=0 skips them.
if [[ "${SHARC_SANITIZE:-1}" != 0 ]]; then
  bash scripts/sanitize.sh
fi

.venv/bin/python -m pytest tests/python --durations=25 "$@"
