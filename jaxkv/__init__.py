"""jaxkv: a paged KV cache for hybrid models, managed by jitted pure functions."""

from jaxkv.config import KVCacheConfig, KVCacheGroup, KVCacheTensor
from jaxkv.specs import (
    NULL_BLOCK,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    cdiv,
)
