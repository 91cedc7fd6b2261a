"""A model directory's tokenizer, as transformers' `AutoTokenizer` gives it, without paying
for its class lookup where the answer is known from the directory.

Most checkpoints saved by transformers 5 (and every GGUF this engine unpacks) name the
generic tokenizers-backed class in tokenizer_config.json (`TokenizersBackend`, which
transformers 4 called `PreTrainedTokenizerFast`). `AutoTokenizer` resolves that name to the
same class, but its first lookup in a process imports transformers' model mappings: about
2 s of CPU, paid again by every server process that starts. Named so, the class is loaded
directly; any other name (a model's own tokenizer class) goes through `AutoTokenizer`.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# Engines built at once in threads of one process (`pagefleet sim-fleet` hosts many) would
# race transformers' lazy imports, which are not thread-safe: one tokenizer loads at a time.
_LOADING = threading.Lock()


def load_tokenizer(directory: Path) -> Any:
    """The tokenizer of `directory` (local files only), the class `AutoTokenizer` would pick.

    Raises:
        OSError, ValueError: as `from_pretrained` does, where the directory has none.
    """
    with _LOADING:
        if (directory / "tokenizer.json").is_file() and _named_class(directory) in GENERIC_CLASSES:
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(directory), local_files_only=True)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def _named_class(directory: Path) -> str | None:
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("tokenizer_class") if isinstance(config, dict) else None
