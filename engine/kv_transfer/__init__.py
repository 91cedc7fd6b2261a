"""Prefill/decode disaggregation: a prompt's KV blocks computed on one replica and pulled by
another (see docs/disaggregation.md).

- `params`: vLLM's `kv_transfer_params`, read and written in vLLM's shape, and the KV
  layout both sides must agree on.
- `wire`: the byte format of a transfer (a header naming dtype, shape, layer; raw bytes).
- `transport`: the `KVTransport` seam and its one implementation today, a pull over HTTP.

The engine's side (pins, loads) is its prefill-decode connector, engine/kv_connector.
"""

from pagefleet.engine.kv_transfer.params import (
    ROLES,
    KVLayout,
    KVTransferError,
    RemoteKV,
)

__all__ = ["ROLES", "KVLayout", "KVTransferError", "RemoteKV"]
