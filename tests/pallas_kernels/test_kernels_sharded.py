"""Both kernels under shard_map over KV heads, on two CPU devices.

The device count is fixed when JAX starts, so the check runs in a child
process with two host devices.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

_SCRIPT = textwrap.dedent(
    """
    import functools, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    sys.path.insert(0, sys.argv[1])
    import kernel_cases
    from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
    from pallas_kernels.paged_scatter import paged_scatter, paged_scatter_reference

    assert jax.device_count() == 2
    mesh = Mesh(np.array(jax.devices()), ("kv",))
    case = kernel_cases.AttentionCase(
        num_kv_heads=2, group_size=3, q_lens=(6, 1), seq_lens=(14, 9), sliding_window=5
    )
    rng = np.random.default_rng(0)
    q, cache, qsl, seq_lens, tables = map(
        jnp.asarray, kernel_cases.build_attention_inputs(case, rng)
    )
    # This step's tokens get fresh K/V rows at their slots (padding: -1),
    # written before attention reads them, as a model layer does.
    slots = []
    n = case.block_size
    for r, (q_len, seq_len) in enumerate(zip(case.q_lens, case.seq_lens)):
        for pos in range(seq_len - q_len, seq_len):
            slots.append(int(tables[r, pos // n]) * n + pos % n)
    slots = jnp.asarray(slots + [-1] * case.num_padding_tokens, jnp.int32)
    rows = jnp.asarray(rng.normal(size=(q.shape[0], 2, 32)), jnp.float32)

    heads = P(None, "kv")  # [T, heads, ...] split over heads
    cache_heads = P(None, None, "kv")  # [B, L, H, N, C] split over H

    @functools.partial(
        jax.shard_map, mesh=mesh, out_specs=(cache_heads, heads), check_vma=False,
        in_specs=(heads, cache_heads, P(), P(), P(), heads, P()),
    )
    def step(q, cache, qsl, seq_lens, tables, rows, slots):
        cache = paged_scatter(cache, rows, slots, 1)
        out = paged_attention(q, cache, qsl, seq_lens, tables, 1, sliding_window=5)
        return cache, out

    new_cache, out = jax.jit(step)(q, cache, qsl, seq_lens, tables, rows, slots)
    ref_cache = paged_scatter_reference(cache, rows, slots, 1)
    ref = paged_attention_reference(q, ref_cache, qsl, seq_lens, tables, 1, sliding_window=5)
    np.testing.assert_array_equal(np.asarray(new_cache), np.asarray(ref_cache))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)
    assert np.isfinite(np.asarray(out)).all()
    print("sharded ok")
    """
)


def test_shard_map_over_kv_heads():
    here = Path(__file__).parent
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(here)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "sharded ok" in result.stdout
