"""The model-facing API: a step's metadata packs the rows' tokens as the kernels take them, and `attend`
writes and attends with each layer's group, layer slot and window found by name in the plan."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.manager import KVCacheManager

HEADS, QUERY_HEADS, HEAD = 2, 4, 8
SPEC = dict(block_size=4, num_kv_heads=HEADS, head_size=HEAD, dtype="float32")
WINDOW, CHUNK = 5, 8


def make_plan():
    layers = {
        "full": jaxkv.FullAttentionSpec(**SPEC),
        "sw": jaxkv.SlidingWindowSpec(**SPEC, sliding_window=WINDOW),
        "ch": jaxkv.ChunkedLocalAttentionSpec(**SPEC, attention_chunk_size=CHUNK),
        "reuses_full": "full",
    }
    return jaxkv.plan(layers, 1 << 20, max_model_len=64, max_num_batched_tokens=32)


def visible(kind, q_pos, k_pos):
    """The dense rule: causal, and within the window or the chunk."""
    ok = k_pos <= q_pos
    if kind == "sw":
        ok &= q_pos - WINDOW < k_pos
    if kind == "ch":
        ok &= k_pos // CHUNK == q_pos // CHUNK
    return ok


def dense_attention(kind, q, k, v, sinks=None):
    """q [S, QH, D], k/v [S, H, D] of one request, every position computed: [S, QH, D].

    sinks [QH]: gpt-oss's sink logits, one more (never masked) column of each head's softmax, then dropped.
    """
    pos = np.arange(q.shape[0])
    k, v = np.repeat(k, QUERY_HEADS // HEADS, axis=1), np.repeat(v, QUERY_HEADS // HEADS, axis=1)
    logits = np.einsum("sqd,tqd->qst", q, k) * HEAD**-0.5
    logits = np.where(visible(kind, pos[:, None], pos[None, :]), logits, -np.inf)
    if sinks is not None:
        logits = np.concatenate([logits, np.broadcast_to(sinks[:, None, None], logits.shape[:2] + (1,))], -1)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("qst,tqd->sqd", probs[..., : q.shape[0]], v)


def test_the_metadata_packs_the_rows_tokens():
    cfg = make_plan()
    mgr = KVCacheManager(cfg, max_num_seqs=4, enable_prefix_caching=False)
    mgr.add_request("a", list(range(13)))
    mgr.add_request("b", list(range(6)))
    assert mgr.allocate_slots_batch(["a", "b"], [13, 6]).all()
    meta = mgr.step_metadata(["a", "b"], [13, 6], num_tokens=24)
    assert np.asarray(meta.query_start_loc).tolist() == [0, 13, 19, 19, 19]
    assert np.asarray(meta.seq_lens).tolist() == [13, 6, 0, 0]
    assert np.asarray(meta.positions).tolist() == list(range(13)) + list(range(6)) + [0] * 5
    np.testing.assert_array_equal(meta.slot_mapping, mgr.slot_mappings(["a", "b"], [13, 6], num_tokens=24))
    np.testing.assert_array_equal(np.asarray(meta.block_tables)[:, :2], mgr.block_tables(["a", "b"]))
    assert (np.asarray(meta.block_tables)[:, 2:] == jaxkv.NULL_BLOCK).all()
    # The pure function gives the same eagerly, and names a shared layer's owner.
    slots = np.array([*mgr.slots_of(["a", "b"]), 4, 4], np.int32)
    with jax.disable_jit():
        eager = jaxkv.step_metadata(mgr.state, slots, np.array([13, 6, 0, 0], np.int32), cfg=cfg, num_tokens=24)
    chex.assert_trees_all_equal(jax.device_get(eager), jax.device_get(meta))
    assert meta.layer("reuses_full") == meta.layer("full")
    with pytest.raises(ValueError, match="cannot hold the 19 scheduled tokens"):
        mgr.step_metadata(["a", "b"], [13, 6], num_tokens=16)


@pytest.mark.parametrize(
    "kind,with_sinks", [("full", False), ("sw", False), ("ch", False), ("full", True), ("sw", True)]
)
def test_attend_uses_the_layers_group_and_window(kind, with_sinks):
    # A prefill of 13 and 6 tokens, then one decode token each: the decode reads the prefill's K/V
    # from the cache. Unused blocks and the null block hold NaN: a stray read poisons the output.
    # With sinks (gpt-oss): one logit per query head in every row's softmax, outside any window.
    cfg = make_plan()
    mgr = KVCacheManager(cfg, max_num_seqs=4, enable_prefix_caching=False)
    spec = jaxkv.buffer_spec(cfg)
    cache = jnp.full(spec.shape, jnp.nan, spec.dtype)
    rng = np.random.default_rng(0)
    lens = {"a": 14, "b": 7}
    q, k, v = (
        {r: rng.standard_normal((n, h, HEAD)).astype(np.float32) for r, n in lens.items()}
        for h in (QUERY_HEADS, HEADS, HEADS)
    )
    sinks = (2.0 * rng.standard_normal(QUERY_HEADS)).astype(np.float32) if with_sinks else None
    step = jax.jit(lambda q, k, v, cache, meta: jaxkv.attend(q, k, v, cache, meta, layer=kind, sinks=sinks))
    for r, n in lens.items():
        mgr.add_request(r, list(range(n - 1)))
    for first, num_new in ((0, {"a": 13, "b": 6}), (None, {"a": 1, "b": 1})):
        if first is None:
            mgr.append_token_ids_batch(["a", "b"], [[0], [0]])
        assert mgr.allocate_slots_batch(list(num_new), list(num_new.values())).all()
        meta = mgr.step_metadata(list(num_new), list(num_new.values()), num_tokens=24)
        begin = {r: mgr.num_computed_tokens(r) - n for r, n in num_new.items()}
        pad = lambda x: np.concatenate([x, np.zeros((24 - len(x),) + x.shape[1:], np.float32)])  # noqa: E731
        args = [pad(np.concatenate([x[r][begin[r] : begin[r] + n] for r, n in num_new.items()])) for x in (q, k, v)]
        out, cache = step(*args, cache, meta)
        out = np.asarray(out)
        t = 0
        for r, n in num_new.items():
            want = dense_attention(kind, q[r], k[r], v[r], sinks)[begin[r] : begin[r] + n]
            np.testing.assert_allclose(out[t : t + n], want, rtol=1e-5, atol=1e-5)
            t += n
        np.testing.assert_array_equal(out[t:], 0)


def test_attend_refuses_a_state_layer():
    layers = {
        "attn": jaxkv.FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="float32"),
        "ssm": jaxkv.MambaSpec(block_size=16, shapes=((4, 8),), dtypes=("float32",)),
    }
    cfg = jaxkv.plan(layers, 1 << 20, max_model_len=64, max_num_batched_tokens=32)
    mgr = KVCacheManager(cfg, max_num_seqs=2, enable_prefix_caching=False)
    mgr.add_request("a", [1, 2, 3])
    assert mgr.allocate_slots("a", 3)
    meta = mgr.step_metadata(["a"], [3], num_tokens=4)
    x = jnp.zeros((4, 1, 8))
    with pytest.raises(ValueError, match="layer 'ssm' has a MambaSpec"):
        jaxkv.attend(x, x, x, jnp.zeros(8), meta, layer="ssm")
