"""Where a replica's KV blocks come from besides its own forward passes, and where they go.

One interface, `KVConnector` (base.py), in the spirit of vLLM's `KVConnectorBase_V1`: a
scheduler side the scheduler and the step's update call at fixed points (how many prompt
tokens a request can have from outside; what to keep when a request finishes; what to save
of the blocks a step filled) and a worker side (worker.py: load a step's blocks before its
forward pass, copy blocks out for a save or a pull). Everything moves per KV cache group:
a block is one group's, and a prefix moves, per group, the blocks a sequence going on from
it needs (`needed_blocks` in engine/core/kv_groups.py: a sliding group's last window); the
KV cache manager allocates and loads an offer's blocks group by group. Its implementations:

- `prefill_decode.PrefillDecodeConnector`: prefill/decode disaggregation. A prefill
  replica's finished prompts stay pinned for a decode replica's pull; a decode replica's
  request starts on the KV its server pulled.
- `file_tier.FileTierConnector`: full blocks written to a shared directory, a prompt's
  longest stored prefix read back when that beats computing it.
- `peer.PeerConnector`: a prefix another replica caches, pulled when the gateway names
  it; and this replica's cached prefixes, held while a peer copies them.
- `multi.MultiConnector`: several in one, asked in order (P/D, then the file tier, then
  a peer).

The network stays outside the engine: the server pulls over HTTP (kv_transfer/) and hands the
KV to `LLMEngine.add_request`, which gives it to the connectors.
"""
