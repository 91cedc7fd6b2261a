"""The request paths the fleet's front doors route (the gateway's proxied routes, the
picker's requests): which carry a chat prompt, and which may be served disaggregated."""

from __future__ import annotations

from pagefleet.protocol.responses import RESPONSES_PATH

COMPLETIONS, CHAT_COMPLETIONS = "/v1/completions", "/v1/chat/completions"
CHAT_BATCH = "/v1/chat/completions/batch"  # vLLM's: several conversations, answered whole
MESSAGES, COUNT_TOKENS = "/v1/messages", "/v1/messages/count_tokens"  # Anthropic's
PROXIED_PATHS = frozenset({COMPLETIONS, CHAT_COMPLETIONS, CHAT_BATCH, MESSAGES, COUNT_TOKENS, RESPONSES_PATH})
CHAT_PATHS = frozenset({CHAT_COMPLETIONS, CHAT_BATCH, MESSAGES, COUNT_TOKENS, RESPONSES_PATH})
# The routes whose requests carry vLLM's kv_transfer_params; Anthropic's go whole to a replica.
DISAGGREGATED_PATHS = frozenset({COMPLETIONS, CHAT_COMPLETIONS})
