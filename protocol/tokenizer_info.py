"""What a router needs to tokenize prompts exactly as a replica does, served by every replica
at `GET /tokenizer_info` (vLLM's path) and read by the gateway once per model, so no
shared volume and no torch are needed to predict a request's prefix-cache blocks."""

from __future__ import annotations

from pydantic import BaseModel, Field


class TokenizerInfo(BaseModel):
    model: str = Field(description="the served model name")
    tokenizer_class: str = Field(description="the engine's tokenizer class, as vLLM reports it")
    tokenizer_json: str = Field(description="the fast tokenizer as Hugging Face `tokenizers` serializes it")
    chat_template: str | None = Field(None, description="the Jinja chat template (runtime/chat_prompt.py renders it)")
    special_tokens: dict[str, str] = Field(default_factory=dict, description="bos_token, eos_token, ... by role")
    block_size: int = Field(gt=0, description="token slots per KV block: the unit of prefix-cache hashes")
    hash_version: str = Field(
        description="protocol/block_hash.py's VERSION; a router that differs must not route on hashes"
    )
    long_rope_after: int | None = Field(
        None,
        description="LongRoPE's pretraining length (Phi-3-128k, Phi-4-mini): a longer prompt's blocks hash from "
        "the long-rope root (`chain_root(..., long_rope=True)`); absent without LongRoPE",
    )
