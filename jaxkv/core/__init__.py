"""Manage, every step: the `ManagerState` pytree (block pool and per-request block tables per group)
and the jitted pure transitions over it.

pool.py        the block pool: reference counts and the free order (uncached blocks, then cached ones LRU)
ranges.py      block-table ranges and the chunked loops the phases walk them with
state.py       `ManagerState`, `init_state`, `allocate`, `free`, `lookup`, `decode_steps` (public)
step.py        `allocate_step`: one engine step as a pipeline of phases over a `StepBatch` (public)
invariants.py  `check_invariants`: the checks tests run after every step

`jaxkv.core.state` and `jaxkv.core.step` are public; pool, ranges and invariants are internal.
"""
