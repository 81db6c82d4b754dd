#!/usr/bin/env bash
# Sets up everything on a fresh machine: the .venv virtual environment,
# torch 2.13.0 (CPU build), the build tools, GoogleTest, and sharc itself
# (its C++ library built with CMake against that torch). Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check)

# torch first and pinned, so nothing later can pull another build.
"${PIP[@]}" install -q "torch==2.13.0"
"${PIP[@]}" install -q "scikit-build-core>=0.10" "tqdm>=4.60" "pytest>=7" "pytest-xdist>=3" numpy "matplotlib>=3.7"
# Real models and their weight files for the tests (neither depends on torch,
# so the pin above holds): HF transformers, safetensors.
"${PIP[@]}" install -q "transformers>=4.40" "safetensors>=0.4"

if [ ! -f /usr/include/gtest/gtest.h ]; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get install -y -q libgtest-dev >/dev/null \
    || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q libgtest-dev >/dev/null; } \
    || { echo "setup: GoogleTest (Debian package libgtest-dev) is needed for the C++ tests" >&2; exit 1; }
fi
command -v cmake >/dev/null || "${PIP[@]}" install -q "cmake>=3.18"
command -v ninja >/dev/null || "${PIP[@]}" install -q ninja

# No build isolation: the extension must build against the torch above.
"${PIP[@]}" install -q --no-build-isolation --no-deps .
echo "setup: sharc installed in .venv"
