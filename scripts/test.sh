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
# The same C++ tests under ASan + UBSan (77 s from clean on two cores,
# seconds when build/cpp-asan exists); SHARC_SANITIZE=0 skips them.
if [[ "${SHARC_SANITIZE:-1}" != 0 ]]; then
  bash scripts/sanitize.sh
fi

# Two test files at a time (pytest-xdist, a file's tests kept together, as
# some share one launch through functools.cache). One file alone kept 0.75
# (the launcher's tests) to 1.6 (compiled tests) of the two cores busy: its
# ranks wait on each other, on start-up and on grace periods. Measured on the
# 2-core host (warm Inductor cache): 1586 s one file at a time, 1230 s two
# at a time, 1.97 cores busy. More workers where there are more cores
# (half the cores: each test runs two or three rank processes);
# SHARC_TEST_WORKERS overrides, 0 runs in this process alone. With a fresh
# Inductor cache, as CI has: 2089 s, then 1926 s once ranks > 0 load the
# graphs rank 0 compiled ([Note: ranks compile in rank order] in
# tests/python/dist_harness.py). 2026-11-29, fresh cache, 494 tests: 1878 s,
# of which the 53 tests over 20 s took 70% (compiled runs). Inside one of
# them (a compiled bf16 test, 85 s) g++ ran 56 s: 66 kernels at about 0.85 s
# each (one kernel by hand: 0.4 s to parse it with Inductor's 150 MB
# precompiled header, 2.2 s without, 0.4 s to generate code, 0.1 s to link);
# -O1 instead of -O3 saved 3 s of the 56. The whole suite compiled 1009
# kernels (the cache shares them between tests), about 860 s of g++ in the
# 3692 s of test time; the rest of a compiled test is Dynamo, AOTAutograd
# and Inductor's Python on both ranks. A shorter suite means fewer graphs
# compiled; faster kernel compiles would save little.
half_the_cores=$(( $(nproc) / 2 ))
workers=${SHARC_TEST_WORKERS:-$(( half_the_cores < 2 ? 2 : half_the_cores ))}
if [[ -z "${SHARC_TEST_WORKERS:-}" && "$workers" -gt 8 ]]; then workers=8; fi
.venv/bin/python -m pytest tests/python -n "$workers" --dist loadfile --durations=25 "$@"
