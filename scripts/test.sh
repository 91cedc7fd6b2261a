#!/usr/bin/env bash
# Set up .venv if needed, then run the whole test suite. Extra arguments go to pytest
# (e.g. `bash scripts/test.sh -m "not slow"`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two shared cores: one OpenMP thread per process, and no spin-waiting.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OMP_WAIT_POLICY=PASSIVE TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest "$@"
