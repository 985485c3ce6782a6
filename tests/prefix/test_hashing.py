"""Prefix-cache unit hashes: vLLM's digests, the fast path against the one-unit reference,
incremental hashing, salts, and keys that a naive encoding would let collide."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv.prefix.hashing import (
    UnitHasher,
    block_hash,
    digests_to_keys,
    encode_extra_keys,
    mm_extra_keys,
    prompt_unit_hashes,
)


def test_vllm_digest_vectors():
    # vLLM 0.33, sha256, default NONE_HASH seed: tokens 0..15, block 16.
    plain = UnitHasher(16, mode="vllm")
    plain.extend(list(range(16)))
    assert plain.digests[0].hex().startswith("fe8fa5dd") and plain.digests[0].hex().endswith("1d434798")
    # vLLM passes the salt as the extra keys (("cache_salt", "s1"),) of the first block.
    salted = UnitHasher(16, mode="vllm", cache_salt="s1")
    salted.extend(np.arange(16))
    assert salted.digests[0].hex().startswith("b74b8848") and salted.digests[0].hex().endswith("f659b6e4")
    assert salted.unit_keys(0) == (("cache_salt", "s1"),)
    # The index key is the digest's first 128 bits as little-endian uint32 words.
    key = prompt_unit_hashes(range(16), 16, mode="vllm")
    assert key.dtype == np.uint32 and key.shape == (1, 4)
    assert key[0, 0] == int.from_bytes(bytes.fromhex("fe8fa5dd"), "little")


@pytest.mark.parametrize("mode", ["jaxkv", "vllm"])
@settings(max_examples=30, deadline=None, derandomize=True)
@given(data=st.data())
def test_fast_path_matches_reference_and_splits(mode, data):
    unit = data.draw(st.sampled_from([1, 2, 3, 16]))
    tokens = data.draw(st.lists(st.integers(0, 2**32 - 1), max_size=80))
    cache_salt = data.draw(st.sampled_from([None, "s1", "tenant-é"]))
    lora = data.draw(st.sampled_from([(), (("lora", "adapter", "/path"),)]))
    unit_keys = mm_extra_keys([("img", 3, 9), ("aud", 30, 20)], unit)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(tokens)), max_size=4)))

    hasher = UnitHasher(unit, cache_salt=cache_salt, extra_keys=lora, unit_extra_keys=unit_keys, mode=mode)
    pieces = [hasher.extend(tokens[a:b]) for a, b in zip([0, *cuts], [*cuts, len(tokens)])]
    assert hasher.num_tokens == len(tokens) and hasher.num_units == len(tokens) // unit
    # Appending in pieces gives the keys of the whole prompt at once.
    whole = prompt_unit_hashes(
        tokens, unit, cache_salt=cache_salt, extra_keys=lora, unit_extra_keys=unit_keys, mode=mode
    )
    np.testing.assert_array_equal(np.concatenate(pieces), whole)
    # The fast path equals the one-unit-at-a-time reference chain.
    parent = None
    for unit_idx, digest in enumerate(hasher.digests):
        unit_tokens = tokens[unit_idx * unit : (unit_idx + 1) * unit]
        parent = block_hash(parent, unit_tokens, hasher.unit_keys(unit_idx), mode=mode)
        assert digest == parent
    np.testing.assert_array_equal(whole, digests_to_keys(hasher.digests))
    # The same pieces through extend_digests, the keys read between some of them (converted when read).
    lazy = UnitHasher(unit, cache_salt=cache_salt, extra_keys=lora, unit_extra_keys=unit_keys, mode=mode)
    for a, b in zip([0, *cuts], [*cuts, len(tokens)]):
        assert lazy.extend_digests(tokens[a:b]) == hasher.digests[a // unit : b // unit]
        if data.draw(st.booleans(), label="read_keys"):
            np.testing.assert_array_equal(lazy.keys, whole[: b // unit])
    np.testing.assert_array_equal(lazy.keys, whole)


def test_token_input_types_agree():
    tokens = [5, 70000, 2**31, 0, 9, 9, 1, 2]
    expected = prompt_unit_hashes(tokens, 4)
    for same in (tuple(tokens), np.asarray(tokens, np.int64), np.asarray(tokens, np.uint32)):
        np.testing.assert_array_equal(prompt_unit_hashes(same, 4), expected)


def test_salts_separate_tenants():
    tokens = list(range(64))
    unsalted = prompt_unit_hashes(tokens, 16)
    a1 = prompt_unit_hashes(tokens, 16, cache_salt="a")
    a2 = prompt_unit_hashes(tokens, 16, cache_salt="a")
    b = prompt_unit_hashes(tokens, 16, cache_salt="b")
    np.testing.assert_array_equal(a1, a2)  # the same salt hits
    # Different salts, or none, share no unit: the salt is in the first unit and the chain carries it.
    for x, y in ((a1, b), (a1, unsalted), (b, unsalted)):
        assert not (x == y).all(axis=1).any()
    assert UnitHasher(16, cache_salt="a").unit_keys(1) == ()  # mixed in once, at the first unit


def test_prefix_sharing_and_divergence():
    base = list(range(48))
    other = base[:20] + [999] + base[21:]
    keys, other_keys = prompt_unit_hashes(base, 8), prompt_unit_hashes(other, 8)
    # Units 0, 1 (tokens 0-15) are shared; unit 2 holds the changed token; the chain differs after.
    assert (keys == other_keys).all(axis=1).tolist() == [True, True, False, False, False, False]
    assert not (prompt_unit_hashes(base, 8, mode="vllm") == keys).all(axis=1).any()


def naive_encoding(keys):
    return "|".join(str(field) for key in keys for field in key)


# Pairs of distinct key sequences that a separator-joined str() encoding maps to the same bytes.
NAIVE_COLLISIONS = [
    ([("lora", "a|b")], [("lora", "a", "b")]),  # separator inside a field
    ([("lora", "a", "b")], [("lora", "a"), ("b",)]),  # key boundaries
    ([("mm", "x", 1)], [("mm", "x", "1")]),  # int vs str
    ([("k", b"a")], [("k", "b'a'")]),  # bytes vs its repr
    ([("lora", "s1")], [("lora",), ("s1",)]),
    ([("mm", "img", 0), ("mm", "img", 16)], [("mm", "img", "0|mm|img"), ("16",)]),
]


@pytest.mark.parametrize("keys_a, keys_b", NAIVE_COLLISIONS)
def test_typed_keys_never_collide(keys_a, keys_b):
    assert naive_encoding(keys_a) == naive_encoding(keys_b)  # the naive encoding collides
    assert encode_extra_keys(keys_a) != encode_extra_keys(keys_b)
    assert block_hash(None, [1, 2], keys_a) != block_hash(None, [1, 2], keys_b)


def test_salt_is_its_own_kind():
    # A salt "x" and a LoRA (or any other key) named "x" hash differently.
    salted = prompt_unit_hashes([1, 2], 2, cache_salt="x")
    for keys in ([("lora", "x")], [("x",)], [("cache", "salt", "x")]):
        assert not (prompt_unit_hashes([1, 2], 2, extra_keys=keys) == salted).all()


field = st.sampled_from(["", "a", "b", "ab", "a|b", b"", b"a", 0, 1, -1, 10])
kind = st.sampled_from(["lora", "mm", "l", "ora"])
key = st.builds(lambda kind, fields: (kind, *fields), kind, st.lists(field, max_size=3))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(key, max_size=3), st.lists(key, max_size=3))
def test_key_encoding_is_injective(keys_a, keys_b):
    # Tiny alphabets make near-collisions likely; the encoding must separate every distinct pair.
    same = [tuple((type(f), f) for f in k) for k in keys_a] == [tuple((type(f), f) for f in k) for k in keys_b]
    assert (encode_extra_keys(keys_a) == encode_extra_keys(keys_b)) == same


def test_mm_extra_keys_follow_vllm_offsets():
    # Units of 16: img0 spans 5-24 (units 0, 1), img1 40-42 (unit 2), img2 43-72 (units 2-4).
    keys = mm_extra_keys([("img0", 5, 20), ("img1", 40, 3), ("img2", 43, 30)], 16)
    assert keys == {
        0: (("mm", "img0", 5),),
        1: (("mm", "img0", -11),),  # offset relative to the unit's start
        2: (("mm", "img1", 8), ("mm", "img2", 11)),
        3: (("mm", "img2", -5),),
        4: (("mm", "img2", -21),),
    }


def test_bad_input_raises():
    with pytest.raises(ValueError, match=r"\[0, 4294967295\]"):
        prompt_unit_hashes([1, -2], 2)
    with pytest.raises(ValueError, match=r"\[0, 4294967295\]"):
        prompt_unit_hashes(np.asarray([1, 2**32]), 2)
    with pytest.raises(ValueError, match="integer array"):
        prompt_unit_hashes(np.asarray([1.0, 2.0]), 2)
    with pytest.raises(ValueError, match="or None for no salt"):
        UnitHasher(2, cache_salt="")
    with pytest.raises(ValueError, match="cache_salt="):
        UnitHasher(2, extra_keys=[("cache_salt", "x")])
    with pytest.raises(ValueError, match="first field names its kind"):
        UnitHasher(2, extra_keys=["lora"])
    with pytest.raises(ValueError, match="str, bytes or int"):
        UnitHasher(2, extra_keys=[("lora", 1.5)])
    with pytest.raises(ValueError, match="unit=0"):
        UnitHasher(0)
    with pytest.raises(ValueError, match="mode='sha'"):
        UnitHasher(2, mode="sha")
