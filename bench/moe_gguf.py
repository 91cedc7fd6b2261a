"""A mixture-of-experts GGUF file in llama.cpp's most used format, for bench/quantized.py's
`--model qwen3-30b-a3b-scaled` (issue 54: batch-1 decode against llama.cpp on one file).

The random-weight Qwen3-30B-A3B shape of bench/shaped_models.py is written as a float32
GGUF with the `gguf` package, tensor for tensor as llama.cpp's converter lays out a
Qwen3-MoE (each layer's experts stacked in `ffn_gate_exps`/`ffn_up_exps`/`ffn_down_exps`;
the writer is the one the loader's tests use, tests/engine/test_gguf_moe.py), then
quantized to Q4_K_M by llama.cpp's own quantizer (`llama_model_quantize` in the
llama-cpp-python venv), as a user would make the file: Q4_K for most tensors, Q6_K for
`attn_v` and `ffn_down_exps` on the layers llama.cpp gives more bits. The float file is
removed once quantized; the Q4_K_M one is kept in the cache.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from common import progress
from peers import llama_quantize
from shaped_models import shaped_model_dir

ROOT = Path(__file__).resolve().parent.parent


def _add_word_tokenizer(writer: Any, model_dir: Path) -> None:
    """The shaped model's word vocabulary ("<t17>", shaped_models._word_tokenizer) as
    llama.cpp's "gpt2" tokenizer. llama.cpp refuses a gpt2 tokenizer without merges and a
    word vocabulary has none, so the last three ids are named "a", "b" and "ab" to carry
    one; the benchmark feeds and compares token ids, which are unchanged."""
    import gguf

    config = json.loads((model_dir / "config.json").read_text())
    size = config["vocab_size"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<t{i}>" for i in range(size - 3)] + ["a", "b", "ab"])
    writer.add_token_types([gguf.TokenType.CONTROL] * 4 + [gguf.TokenType.NORMAL] * (size - 4))
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(2)  # the word tokenizer's "<t2>" and "<t1>"
    writer.add_eos_token_id(1)


def moe_q4_k_m_file(name: str) -> Path:
    """The shaped model `name` (a Qwen3-MoE of shaped_models.SHAPES) as a Q4_K_M GGUF,
    made once into the cache."""
    model_dir = shaped_model_dir(name)
    target = model_dir.parent / f"{name}-Q4_K_M.gguf"
    if target.exists():
        return target
    sys.path.insert(0, str(ROOT))
    from tests.engine.test_gguf_moe import write_moe_gguf

    float_file = target.with_name(f"{name}-F32.gguf")
    progress(f"writing {name} as a float32 GGUF (once)")
    experts_float32 = {kind: "F32" for kind in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}
    write_moe_gguf(model_dir, float_file, types=experts_float32, add_tokenizer=_add_word_tokenizer)
    progress(f"quantizing {float_file.name} to Q4_K_M with llama.cpp (once)")
    llama_quantize(float_file, target)
    float_file.unlink()
    return target
