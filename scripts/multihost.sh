#!/usr/bin/env bash
# Runs a torchrun job across simulated hosts on this machine: network
# namespaces joined by a bridge, optionally rate-limited, one torchrun agent
# per namespace (docs/multihost.md). Needs root and iproute2.
#
#   bash scripts/multihost.sh --hosts 2 --nproc-per-host 2 --rate 200mbit -- \
#       -m sharc.train --steps 20 --eager
#
# Exit status: the job's, 77 when namespaces cannot be made here, 124 on
# --timeout, 130/143 when interrupted. The namespaces are removed whatever
# happens (sharc/multihost.py, [Note: cleanup]).
#
# PYTHON=/path/to/python picks the interpreter (default .venv/bin/python).
# The checkout's python/ goes first on PYTHONPATH when it holds a built
# library (scripts/dev_build.sh), so a worktree runs its own sharc.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY=${PYTHON:-$ROOT/.venv/bin/python}
if [ -f "$ROOT/python/sharc/lib/libsharc_torch.so" ]; then
  export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$PY" -m sharc.multihost "$@"
