"""jaxkv: a paged KV cache for hybrid models, managed by jitted pure functions.

The folders follow the flow in DESIGN.md:

    planner/   plan, on the host, once: layer specs (by hand or from a Hugging Face config.json)
               -> plan(...) -> KVCacheConfig (frozen, hashable: jit's static config)
    memory/    allocate the physical cache: block-outer arrays and their per-layer views, where a
               token's K/V lives, block copies; the HTML drawing of a plan's layout
    core/      init the ManagerState and run each engine step: the block pool, the block tables per
               group, the step's pipeline of phases (free - ... - take blocks) -> block tables and
               slot mappings; the invariant checks; the same transitions on the host, in place
               (host.py, the manager's `backend="host"`), and conversions to and from ManagerState
    prefix/    the step's prefix-caching phases (store keys, lookup + claim hits, index filled
               blocks): unit hashes on the host, the on-device index, the hit rules, hits inside blocks
    manager.py    KVCacheManager: vLLM's vocabulary on the host over core's jitted transitions (or its
                  host state)
    metadata.py   the model step: one StepMetadata per step, and attend (paged scatter + paged
                  attention, from the separate pallas_kernels package)
    cli.py        python -m jaxkv plan / layout

Public: the names below (`__all__`), and the modules `jaxkv.core.state`, `jaxkv.core.step`,
`jaxkv.manager` and `jaxkv.metadata`. Every other module is internal: it may change or move without
a deprecation path. The flat paths of before (`jaxkv.state`, `jaxkv.prefix_cache`, ...) still import,
with a DeprecationWarning naming the new path (`jaxkv._moved`).
"""

from jaxkv import _moved
from jaxkv.core.invariants import InvariantError, check_invariants
from jaxkv.core.state import AllocateResult, ManagerState, init_state
from jaxkv.manager import KVCacheManager
from jaxkv.memory.layout import (
    DSA_INDEXER_FIELDS,
    DSA_LATENT_FIELDS,
    RowField,
    allocate_cache,
    buffer_spec,
    copy_blocks,
    find_layer,
    is_typed,
    locate_token,
    read_rows,
    state_fields,
    typed_view,
    with_layout,
    write_rows,
)
from jaxkv.memory.layout_html import render_layout_html
from jaxkv.metadata import StepMetadata, attend, step_metadata
from jaxkv.planner.config import LAYOUTS, KVCacheConfig, KVCacheGroup, KVCacheTensor
from jaxkv.planner.hf_config import SUPPORTED_MODEL_TYPES, specs_from_hf_config
from jaxkv.planner.planning import GROUPINGS, plan, resolve_kv_sharing
from jaxkv.planner.specs import (
    NULL_BLOCK,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    cdiv,
)
from jaxkv.prefix.hashing import UnitHasher, block_hash, digests_to_keys, mm_extra_keys, prompt_unit_hashes
from jaxkv.prefix.rules import HitRule, group_hit_lens, prefix_hit_len

__all__ = [
    "allocate_cache",
    "AllocateResult",
    "attend",
    "block_hash",
    "buffer_spec",
    "cdiv",
    "check_invariants",
    "ChunkedLocalAttentionSpec",
    "copy_blocks",
    "digests_to_keys",
    "DSA_INDEXER_FIELDS",
    "DSA_LATENT_FIELDS",
    "find_layer",
    "FullAttentionSpec",
    "group_hit_lens",
    "GROUPINGS",
    "HitRule",
    "init_state",
    "InvariantError",
    "is_typed",
    "KVCacheConfig",
    "KVCacheGroup",
    "KVCacheManager",
    "KVCacheTensor",
    "LAYOUTS",
    "locate_token",
    "MambaSpec",
    "ManagerState",
    "MLAAttentionSpec",
    "mm_extra_keys",
    "NULL_BLOCK",
    "plan",
    "prefix_hit_len",
    "prompt_unit_hashes",
    "read_rows",
    "render_layout_html",
    "resolve_kv_sharing",
    "RowField",
    "SlidingWindowSpec",
    "specs_from_hf_config",
    "state_fields",
    "step_metadata",
    "StepMetadata",
    "SUPPORTED_MODEL_TYPES",
    "typed_view",
    "UnitHasher",
    "with_layout",
    "write_rows",
]

_moved.install()  # the modules' former flat paths (jaxkv.state, ...) keep working, with a DeprecationWarning


def __getattr__(name: str):
    """`jaxkv.state` and the other former module names, as attributes: the modules at their new paths, with a
    DeprecationWarning (`jaxkv._moved`)."""
    if name in _moved.MOVED:
        return _moved.load(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
