"""Sharding the paged cache and the kernels over KV heads along a "model" mesh axis.

The cache [B, L, K, N, C] is split over K; each device's kernels see only its
heads (queries [T, N, H] split over N the same way, so query head j still reads
KV head j // (N / K)). Block tables, slot mappings and the manager state are
replicated: every device runs the same bookkeeping, and every output the host reads
(logits, sampled tokens, the state after an on-device loop) is replicated too. Parameters are replicated
(the model is small); XLA shards the projections around the kernels as needed.

On a multi-GPU host the same code runs with `jax.devices()` as they are; on a
multi-host TPU pod (or several GPU hosts) call `jax.distributed.initialize()`
in every process first (`initialize_processes`), then build the mesh from all
`jax.devices()`: each process holds its devices' shards of the cache and runs
the same program. examples/decode.py --coordinator does this on CPU.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.paged_scatter import paged_scatter

AXIS = "model"
HEADS = P(None, AXIS)  # [T, heads, ...] split over heads
CACHE_HEADS = P(None, None, AXIS)  # [B, L, K, N, C] split over K


def initialize_processes(coordinator: str, num_processes: int, process_id: int) -> None:
    """Joins this process to `num_processes` JAX processes; call before any other use of JAX.

    On CPU the processes' devices talk through gloo's TCP collectives.
    """
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)


def model_mesh(num_devices: int) -> jax.sharding.Mesh:
    if jax.device_count() < num_devices:
        raise ValueError(
            f"{num_devices=} devices asked for, {jax.device_count()} present; on CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={num_devices} before JAX starts"
        )
    return jax.sharding.Mesh(np.array(jax.devices()[:num_devices]), (AXIS,))


def cache_sharding(mesh: jax.sharding.Mesh | None):
    return None if mesh is None else NamedSharding(mesh, CACHE_HEADS)


def out_shardings(mesh: jax.sharding.Mesh | None, *outputs: str) -> dict:
    """jax.jit's `out_shardings=` for outputs that are each "cache" (split over KV heads) or
    "replicated"; no argument without a mesh.

    Stating them keeps every output the host reads replicated: with several processes a
    process can read only what its own devices hold.
    """
    if mesh is None:
        return {}
    kinds = {"cache": NamedSharding(mesh, CACHE_HEADS), "replicated": NamedSharding(mesh, P())}
    return dict(out_shardings=tuple(kinds[o] for o in outputs))


def kernels(mesh: jax.sharding.Mesh | None):
    """(scatter, attention) with the signatures of `paged_scatter` / `paged_attention`,
    run per shard of KV heads when `mesh` is given. The attention's `sinks` [QH] (one per query
    head) are split over query heads as q is."""
    if mesh is None:
        return paged_scatter, paged_attention

    def scatter(cache, rows, slot_mapping, layer_idx, **static):
        return jax.shard_map(
            lambda c, r, s: paged_scatter(c, r, s, layer_idx, **static),
            mesh=mesh,
            check_vma=False,
            in_specs=(CACHE_HEADS, HEADS, P()),
            out_specs=CACHE_HEADS,
        )(cache, rows, slot_mapping)

    def attention(q, cache, query_start_loc, seq_lens, block_tables, layer_idx, *, sinks=None, **static):
        args = (q, cache, query_start_loc, seq_lens, block_tables)
        specs = (HEADS, CACHE_HEADS, P(), P(), P())
        if sinks is not None:  # in_specs take no None: the sinks [QH] join only when given, split as q's heads
            args, specs = (*args, sinks), (*specs, P(AXIS))

        def local(q, cache, query_start_loc, seq_lens, block_tables, sinks=None):
            return paged_attention(q, cache, query_start_loc, seq_lens, block_tables, layer_idx, sinks=sinks, **static)

        return jax.shard_map(local, mesh=mesh, check_vma=False, in_specs=specs, out_specs=HEADS)(*args)

    return scatter, attention
