"""Prefill/decode disaggregation: a prompt's KV blocks computed on one replica and pulled by
another (see docs/disaggregation.md).

- `params`: vLLM's `kv_transfer_params`, read and written in vLLM's shape, and the KV
  layout both sides must agree on.
- `pins`: the prefill side's finished prompts whose blocks wait to be pulled.
- `wire`: the byte format of a transfer (a header naming dtype, shape, layer; raw bytes).
- `connector`: the `KVConnector` seam and its one transport today, a pull over HTTP.
"""

from pagefleet.engine.kv_transfer.params import (
    ROLES,
    KVLayout,
    KVTransferError,
    RemoteKV,
)

__all__ = ["ROLES", "KVLayout", "KVTransferError", "RemoteKV"]
