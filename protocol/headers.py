"""The HTTP headers the parts send each other (beyond OpenAI's)."""

from __future__ import annotations

# From the gateway to a replica: the URL of another replica that caches the prompt's prefix
# (the gateway routed away from it), to pull the prefix from rather than compute it. Only
# the gateway sets it: it never forwards a client's.
KV_PEER_HEADER = "x-pagefleet-kv-peer"
