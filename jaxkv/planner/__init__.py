"""Plan, on the host, once: layer specs (hand-written or from a Hugging Face config.json) to a frozen
`KVCacheConfig` (groups, pool size, buffer views).

specs.py      the spec dataclasses (`FullAttentionSpec`, ..., `NULL_BLOCK`)
hf_config.py  a Hugging Face config.json to layer specs
planning.py   `plan`: grouping, page-size unification, pool sizing, buffer views
config.py     `KVCacheConfig`, `KVCacheGroup`, `KVCacheTensor` and the figures a person reads

Internal: use the names `jaxkv` exports.
"""
