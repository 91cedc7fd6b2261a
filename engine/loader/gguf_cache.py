"""GGUF files, dequantized once by transformers and cached as a Hugging Face directory.

Dequantizing SmolLM2's GGUF takes ~30 s; the cached safetensors load in about a second.
The cache key covers the conversion's version and the file's path, size and modification
time, so a new file is converted again. The cache may be shared by the replicas of a model (a volume every pod
mounts: the operator's `spec.modelCache`; the processes of `pagefleet up`): a lock file
makes one of them convert while the others wait, then load what it wrote.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from pagefleet.engine.loader import gguf_deepseek, gguf_gemma4, gguf_gpt_oss, gguf_moe
from pagefleet.engine.loader.gguf_config import complete_config, read_gguf

logger = logging.getLogger(__name__)

_DONE_MARKER = ".pagefleet-complete"
# Of the conversion: a new one converts every file again (2: gguf_config.py's settings; 3:
# mixtures of experts, a Mixtral file having been read as a Llama without its experts).
_VERSION = 3


def cache_root() -> Path:
    """Where converted models live: $PAGEFLEET_CACHE_DIR, else ~/.cache/pagefleet."""
    configured = os.environ.get("PAGEFLEET_CACHE_DIR")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pagefleet"


def converted_dir(gguf_path: Path) -> Path:
    """The HF directory holding `gguf_path` dequantized, converting it on first use."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{_VERSION}:{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    target = cache_root() / "gguf" / f"{gguf_path.stem}-{key.hexdigest()[:12]}"
    if (target / _DONE_MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when the file closes or the process dies
        except BlockingIOError:
            logger.info("another process is converting %s; waiting for it", gguf_path.name)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / _DONE_MARKER).exists():  # another process may have converted it meanwhile
            _convert(gguf_path, target)
    return target


def _load_gemma4(gguf_path: Path, metadata: dict[str, Any], tensors: dict[str, Any]) -> Any:
    """A Gemma 4 file's model: transformers reads its tensors with the config built from
    its metadata (engine/loader/gguf_gemma4.py), then the tensors it leaves are set."""
    import torch
    from transformers import AutoModelForCausalLM, Gemma4TextConfig

    config = Gemma4TextConfig.from_dict(gguf_gemma4.gemma4_config(metadata, tensors))
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, config=config, dtype=torch.float32
    )
    state = model.state_dict()
    with torch.no_grad():
        for name, value in gguf_gemma4.gemma4_unmapped_tensors(tensors, config.num_hidden_layers).items():
            state[name].copy_(value.view(state[name].shape))
    return model


def _load_moe(gguf_path: Path, metadata: dict[str, Any], tensors: dict[str, Any]) -> Any:
    """A mixture of experts' model (engine/loader/gguf_moe.py): its expert tensors checked
    first; Qwen's read by transformers with the experts' widths from the metadata; Mixtral's,
    DeepSeek-V3's and gpt-oss's, which transformers does not read, built from the metadata
    and given the file's tensors."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    def shape(name: str) -> tuple[int, ...] | None:
        return tuple(int(d) for d in tensors[name].shape) if name in tensors else None

    dims = gguf_moe.ExpertDims.from_metadata(metadata, shape)
    gguf_moe.check_expert_tensors(gguf_path, dims, shape)
    architecture = metadata["general.architecture"]
    if architecture == gguf_moe.DEEPSEEK_ARCHITECTURE:
        raw = gguf_deepseek.deepseek_config(metadata, tensors)
        return _built(raw, gguf_deepseek.deepseek_state_dict(tensors, raw))
    if architecture == gguf_moe.GPT_OSS_ARCHITECTURE:
        raw = gguf_gpt_oss.gpt_oss_config(metadata, tensors)
        return _built(raw, gguf_gpt_oss.gpt_oss_state_dict(tensors, raw))
    if architecture in gguf_moe.QWEN_ARCHITECTURES:
        config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        config.update(gguf_moe.qwen_config_updates(dims))
        return AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, config=config, dtype=torch.float32
        )
    raw = gguf_moe.mixtral_config(metadata, tensors, dims)
    return _built(raw, gguf_moe.mixtral_state_dict(tensors, raw))


def _built(config: dict[str, Any], state: dict[str, Any]) -> Any:
    """The transformers model of a config built from a file's metadata, given its tensors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).float()
    model.load_state_dict(state, strict=True)
    return model


def _convert(gguf_path: Path, target: Path) -> None:
    # Imported here: transformers is heavy and only needed the first time.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    logger.info("converting %s to a cached Hugging Face directory (once; ~30 s)", gguf_path.name)
    started = time.monotonic()
    folder, name = str(gguf_path.parent), gguf_path.name
    metadata, tensors = read_gguf(gguf_path)
    architecture = metadata["general.architecture"]
    if architecture == gguf_gemma4.ARCHITECTURE:
        model = _load_gemma4(gguf_path, metadata, tensors)
    elif gguf_moe.is_moe_file(metadata):
        model = _load_moe(gguf_path, metadata, tensors)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    if architecture in (gguf_gemma4.ARCHITECTURE, gguf_moe.DEEPSEEK_ARCHITECTURE, gguf_moe.GPT_OSS_ARCHITECTURE):
        # AutoTokenizer would read the config from the file again, which transformers cannot
        # (deepseek2), or misreads (gpt-oss: its YaRN keys).
        tokenizer = PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)
    else:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # save_pretrained refuses a GGUF-loaded model while it still names its quantizer; the
    # weights are already dequantized to float32, so the quantization config is obsolete.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write to a sibling temp dir and rename, so a crash never leaves a half cache behind.
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        if gguf_moe.is_moe_file(metadata) and architecture != gguf_moe.GPT_OSS_ARCHITECTURE:
            gguf_moe.save_checkpoint(model, staging)  # gpt-oss's checkpoints keep its experts fused
        else:
            model.save_pretrained(staging)
        complete_config(metadata, tensors, staging / "config.json")
        tokenizer.save_pretrained(staging)
        (staging / _DONE_MARKER).write_text(str(gguf_path.resolve()))
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    logger.info("converted %s in %.1f s -> %s", gguf_path.name, time.monotonic() - started, target)
