"""jaxkv: a paged KV cache for hybrid models, managed by jitted pure functions."""

from jaxkv.config import KVCacheConfig, KVCacheGroup, KVCacheTensor
from jaxkv.hashing import UnitHasher, block_hash, digests_to_keys, mm_extra_keys, prompt_unit_hashes
from jaxkv.prefix_rules import HitRule, group_hit_lens, prefix_hit_len
from jaxkv.specs import (
    NULL_BLOCK,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    cdiv,
)
