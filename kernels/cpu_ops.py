"""The compiled CPU operators (`csrc/*.cpp`, registered as `torch.ops.pagefleet.*`):
building and loading them.

- `paged_attention_rows` and `paged_attention_decode` (csrc/cpu_attention.cpp, AVX2 pieces
  in cpu_attention_avx2.h; wrappers in cpu_attention.py, references
  `paged_attention_decode_torch` and `paged_attention_prefill_torch`): every query row,
  decode or prompt, over its context up to its own position, read in place through its
  sequence's block table once for all the query heads that share a kv head and all the
  rows of a prompt chunk, with one arithmetic for every row (path invariance); long
  contexts split over threads.
- `rms_norm`, `gemma_rms_norm`, `silu_and_mul`, `gelu_tanh_and_mul`, `rotary`
  (csrc/cpu_fused.cpp; wrappers and references in pagefleet/engine/layers/fused.py): one
  pass where plain torch makes several; `argmax_rows` there too, the sampler's greedy
  choice (torch.argmax's answer, NaNs and ties included) in one vectorised read.
- `lora_add` (csrc/cpu_lora.cpp; wrapper and reference in pagefleet/engine/lora/layer.py):
  every adapter's update to one projection of a multi-LoRA step in one call.
- `quantized_linear`, `quantized_linear_packed` (csrc/cpu_quant.cpp; wrapper and reference
  in pagefleet/engine/layers/quantized.py): a matmul over GGML's block formats as stored,
  int8 dot products, one kernel for every number of rows (AVX-512 VNNI on GGML's order
  where the CPU has it, else AVX2 on weights repacked with 8 columns interleaved); AVX2 and
  AVX-512 builds (`has_quantized_linear()`, `quantized_packed_layout()`).
- `fused_experts` (csrc/cpu_experts.cpp, its matmul in cpu_experts_gemm.h; wrapper
  `RoutedExperts.forward` in pagefleet/engine/layers/experts.py, reference
  `fused_experts_torch` in fused_experts.py): a mixture-of-experts layer's routed experts in
  one call, grouped by expert, a token's bits the same alone or in any batch;
  `fused_experts_packed` (csrc/cpu_experts_packed.h) the same on AMX CPUs over bfloat16
  weights packed for the tiles at load (kernels/amx_tiles.py), the same bits; `tiles_linear`
  (csrc/cpu_tiles.cpp; wrapper `LogitsHead.forward` in pagefleet/engine/layers/logits.py)
  an untied bfloat16 vocabulary head on those tiles, `amx_tiles_fit` where they take a shape;
  `quantized_experts` (csrc/cpu_quant_experts.h, in cpu_quant.cpp; wrapper
  `QuantizedRoutedExperts.forward` in pagefleet/engine/layers/quantized_experts.py, its loop
  of `quantized_linear` calls the reference): the same over a GGUF file's expert blocks.
- `LlamaLayers` (csrc/cpu_decoder.cpp; built by pagefleet/engine/models/compiled_layers.py):
  a Llama-family model's decoder layers as one call per step, through the operators above
  (the same bits as the Python loop, without the interpreter between them).
- `int8_linear` (csrc/cpu_int8.cpp; wrapper and reference in pagefleet/engine/layers/int8.py):
  an int8 W8A8 layer: activations quantized per token, oneDNN's int8 GEMM, one rescale.
- `causal_conv1d_state`, `gated_delta_rule_state`, `selective_scan_state` (csrc/cpu_state.cpp;
  wrappers in cpu_state.py, references `causal_conv1d_torch`, `gated_delta_rule_torch` and
  `selective_scan_torch`): the state layers' recurrences over a flat batch of sequences, each
  sequence's rows walked in order by one work item per head (channel block for the conv),
  so a row's bits do not depend on how its prompt was split or what shared its batch.

Building: `torch.utils.cpp_extension` (g++ and ninja) compiles it once per torch version,
instruction set and source into `$PAGEFLEET_CACHE_DIR/ops` (else `~/.cache/pagefleet/ops`),
under cpp_extension's file lock, so processes starting together build it once. The
instruction set comes from what this CPU supports, as torch itself dispatches (AVX-512,
AVX2, or none), never `-march=native`: a build made in an image runs on every node of the
same instruction set. `scripts/setup.sh` builds it ahead, so a first request never waits.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in (
        "cpu_attention.cpp",
        "cpu_fused.cpp",
        "cpu_lora.cpp",
        "cpu_quant.cpp",
        "cpu_int8.cpp",
        "cpu_decoder.cpp",
        "cpu_experts.cpp",
        "cpu_tiles.cpp",
        "cpu_state.cpp",
        "cpu_state_rows.h",
        "cpu_quant_columns.h",
        "cpu_attention_avx2.h",
        "cpu_quant_vnni.h",
        "cpu_paged.h",
        "cpu_vec.h",
        "cpu_experts_gemm.h",
        "cpu_experts_amx.h",
        "cpu_experts_packed.h",
        "cpu_experts_rows.h",
        "cpu_quant_experts.h",
    )
]
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}
DISABLE_ENV = "PAGEFLEET_DISABLE_CPU_OPS"  # set to 1 to force the plain-torch path
# Build for this instruction set instead of the CPU's (an image prebuilds every variant,
# one process each, so that whichever node it lands on finds its build).
ISA_ENV = "PAGEFLEET_CPU_ISA"


def instruction_set() -> str:
    """The widest instruction set this CPU has that there is a build for ("DEFAULT": none)."""
    capability = os.environ.get(ISA_ENV) or torch.backends.cpu.get_cpu_capability()
    return capability if capability in ISA_FLAGS else "DEFAULT"


def build_directory() -> Path:
    """$PAGEFLEET_OPS_DIR (an image's prebuilt operators), else $PAGEFLEET_CACHE_DIR/ops, else
    ~/.cache/pagefleet/ops; one folder per torch version, instruction set and source."""
    cache = Path(os.environ.get("PAGEFLEET_CACHE_DIR") or Path.home() / ".cache" / "pagefleet")
    root = Path(os.environ.get("PAGEFLEET_OPS_DIR") or cache / "ops")
    digest = hashlib.sha256(b"".join(source.read_bytes() for source in SOURCES)).hexdigest()[:12]
    return root / f"torch-{torch.__version__}-{instruction_set().lower()}-{digest}"


# A build takes under a minute; cpp_extension's lock file outlives a build that was killed
# (Ctrl-C, a pod evicted), and every later process would wait on it forever.
STALE_LOCK_SECONDS = 600


def _clear_stale_lock(lock: Path) -> None:
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_SECONDS:
        logger.warning("removing %s, left %.0f s ago by a build that did not finish", lock, age)
        lock.unlink(missing_ok=True)


@functools.cache
def has_quantized_linear() -> bool:
    """Whether the loaded operators include the quantized matmul (AVX2 and AVX-512 builds);
    asked by every quantized layer at every step, hence kept."""
    return load() and bool(torch.ops.pagefleet.has_quantized_linear())


@functools.cache
def quantized_packed_layout() -> bool:
    """Whether the quantized matmul this CPU runs reads weights repacked with 8 columns
    interleaved (AVX2) rather than in GGML's order (AVX-512 VNNI)."""
    return has_quantized_linear() and bool(torch.ops.pagefleet.quantized_packed_layout())


@functools.cache
def has_compiled_layers() -> bool:
    """Whether the loaded operators include the Llama family's decoder layers as one call
    (csrc/cpu_decoder.cpp: `torch.classes.pagefleet.LlamaLayers`) over the quantized
    kernel's weights (AVX2 or AVX-512 VNNI)."""
    if not has_quantized_linear():
        return False
    try:
        return torch.classes.pagefleet.LlamaLayers is not None
    except RuntimeError:  # torch.classes says so for a class it does not have
        return False


def is_loaded() -> bool:
    """Whether this process has the operators (`load()` succeeded); never builds."""
    return load.cache_info().currsize > 0 and load()


@functools.cache
def load() -> bool:
    """Build (once) and load the operators; False, with one warning, if they cannot be had."""
    if os.environ.get(DISABLE_ENV) == "1":
        logger.info("compiled CPU operators disabled by %s=1; using the torch path", DISABLE_ENV)
        return False
    isa = instruction_set()
    name = f"pagefleet_cpu_ops_{isa.lower()}"
    directory = build_directory()
    try:
        # Built before (perhaps into a read-only image), and no build in progress (its lock).
        if (directory / f"{name}.so").exists() and not (directory / "lock").exists():
            torch.ops.load_library(str(directory / f"{name}.so"))
            return True
        from torch.utils import cpp_extension

        directory.mkdir(parents=True, exist_ok=True)
        _clear_stale_lock(directory / "lock")
        logger.info("building the compiled CPU operators for %s in %s (once, about 20 s)", isa, directory)
        cpp_extension.load(
            name=name,
            sources=[str(source) for source in SOURCES if source.suffix == ".cpp"],
            extra_cflags=["-O3", "-fopenmp", "-ffp-contract=fast", *ISA_FLAGS.get(isa, [])],
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )
    except Exception as error:  # no compiler, no ninja, a failed build: the torch path serves
        logger.warning("the compiled CPU operators are unavailable (%s); using the slower torch path", error)
        return False
    return True
