"""Multi-LoRA serving: many PEFT adapters over one base model, mixed in one batch.

- `request`: `LoRARequest`, vLLM's handle naming an adapter.
- `adapter`: reading a PEFT adapter (adapter_config.json + adapter_model.safetensors) into
  the model's projections.
- `layer`: the per-projection slot stacks and the batched shrink/expand.
- `manager`: the bounded slots (`max_loras`), loading on demand, LRU eviction of slots no
  running request uses.
"""

from pagefleet.engine.lora.request import LoRARequest

__all__ = ["LoRARequest"]
