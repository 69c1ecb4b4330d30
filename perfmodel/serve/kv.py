"""Paged KV-cache capacity: the device memory left after the weights, in blocks of tokens.

Every device of an attention replica holds its replica's sequences' caches (`ModelSpec.
cache_bytes`: KV / latents per token, windows capped, recurrent and conv state per sequence).
A sequence of n tokens holds ceil(n / block_tokens) blocks: the cache of that many tokens
(`deployment.cache_bytes_per_seq`). The pool's capacity is, per device, `memory_utilization` x
the device's HBM minus its weights (`deployment.resident_bytes_per_device` without caches), one
such pool per attention replica; activations and the engine's workspace are not reserved.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from perfmodel.spec.arch import ModelSpec
from perfmodel.spec.deployment import Deployment, cache_bytes_per_seq, resident_bytes_per_device
from perfmodel.spec.hardware import Hardware
from perfmodel.util.errors import SpecError, require

BLOCK_TOKENS = 16          # vLLM's default KV block size (CacheConfig.block_size)
MEMORY_UTILIZATION = 0.9   # vLLM's default gpu_memory_utilization


def weight_bytes_per_device(model: ModelSpec, d: Deployment) -> float:
    """A device's weight shards (resident bytes without any sequence)."""
    one = dataclasses.replace(d, batch=1, context=0, spec=None)
    return resident_bytes_per_device(model, one) - cache_bytes_per_seq(model, 1, d.tp)


@dataclass
class KVCache:
    """Block accounting of one pool (all its attention replicas): bytes per device, summed over
    the sequences, against `capacity_bytes` (per device, times the replicas)."""
    model: ModelSpec
    tp: int
    capacity_bytes: float
    block_tokens: int = BLOCK_TOKENS
    used_bytes: float = 0.0
    _blocks: dict[int, float] = field(default_factory=dict, repr=False)

    def bytes_for(self, tokens: int) -> float:
        """Cache bytes per device of one sequence holding `tokens` tokens, in whole blocks."""
        blocks = -(-tokens // self.block_tokens)
        if blocks not in self._blocks:
            self._blocks[blocks] = cache_bytes_per_seq(self.model, blocks * self.block_tokens, self.tp) if blocks else 0.0
        return self._blocks[blocks]

    @property
    def free_bytes(self) -> float:
        return self.capacity_bytes - self.used_bytes

    @property
    def occupancy(self) -> float:
        return self.used_bytes / self.capacity_bytes


def kv_cache(model: ModelSpec, hw: Hardware, d: Deployment, block_tokens: int = BLOCK_TOKENS,
             memory_utilization: float = MEMORY_UTILIZATION) -> KVCache:
    """The pool's KV cache (module doc); a SpecError when the weights leave no room."""
    require(isinstance(block_tokens, int) and block_tokens > 0, "block_tokens", block_tokens, "must be a positive integer")
    require(0 < memory_utilization <= 1, "memory_utilization", memory_utilization, "must be in (0, 1]")
    weights = weight_bytes_per_device(model, d)
    free = memory_utilization * hw.core_hbm_bytes - weights
    if free <= 0:
        raise SpecError("devices", d.devices, f"no room for a KV cache: the weights take {weights / 1e9:.1f} GB per "
                        f"device, {memory_utilization:g} x {hw.name}'s {hw.core_hbm_bytes / 1e9:.1f} GB leaves none")
    return KVCache(model, d.tp, free * d.dp, block_tokens)
