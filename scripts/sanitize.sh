#!/usr/bin/env bash
# The C++ unit tests of the torch-free core under AddressSanitizer and
# UndefinedBehaviorSanitizer (any report fails the run). Builds build/cpp-asan.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"  # cmake/ninja from pip, if setup installed them there

# -O1 with line tables (-g1): what the sanitizers need for exact reports with
# file:line stacks. Measured on the 2-core host, clean build: 150 s at
# RelWithDebInfo's -O2 -g, 77 s at -O1 -g1; the 230 tests run 6 s either way.
cmake -S . -B build/cpp-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" -DSHARC_BUILD_EXTENSION=OFF -DSHARC_BUILD_TESTS=ON -DSHARC_SANITIZE=ON >/dev/null
cmake --build build/cpp-asan -j "$(nproc)"
export ASAN_OPTIONS="detect_leaks=1:strict_string_checks=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
ctest --test-dir build/cpp-asan --output-on-failure "$@"
