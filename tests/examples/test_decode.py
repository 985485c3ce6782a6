"""The example serving loop equals a dense, cache-free forward pass (examples/decode.py --check)."""

from __future__ import annotations

import re

from decode_runs import DIGEST, run_decode


def test_paged_loop_matches_dense_forward(one_device):
    # Every logit row the loop computed (chunked prefill, windows, prefix hits, preemption and
    # resumption, device decode loops).
    assert re.search(r"check: \d+ logit rows of 8 requests .*; 0 mismatching requests", one_device)
    assert int(re.search(r"preemptions: (\d+)", one_device).group(1)) >= 1
    assert int(re.search(r"\((\d+) on-device loops", one_device).group(1)) >= 1
    assert int(re.search(r"prefix-hit rate: (\d+)/", one_device).group(1)) > 0  # the shared system prompt


def test_sharded_over_four_devices_gives_the_same_tokens(one_device):
    sharded = run_decode("--tp", "4")
    assert "sharded as P(None, None, 'model')" in sharded
    assert re.search(r"; 0 mismatching requests", sharded)
    assert DIGEST.search(sharded).group(1) == DIGEST.search(one_device).group(1)


def test_pool_running_dry_inside_a_device_decode_loop_preempts():
    # Two long decodes in a 54-block pool: a device loop stalls, the host step preempts one.
    out = run_decode(
        "--num-prompts",
        "2",
        "--max-prompt-len",
        "4",
        "--system-prompt-len",
        "2",
        "--max-new-tokens",
        "60",
        "--num-blocks",
        "54",
    )
    assert re.search(r"check: \d+ logit rows of 2 requests .*; 0 mismatching requests", out)
    assert int(re.search(r"preemptions: (\d+)", out).group(1)) >= 1


def test_speculative_decoding_gives_the_greedy_tokens(one_device):
    # Prompt lookup with 4 drafts (block 4: drafts cross block ends), a 62-block pool that preempts:
    # every verified logit equals the dense pass and the tokens are the plain run's.
    out = run_decode("--speculate", "ngram:4", "--num-blocks", "62")
    assert re.search(r"check: \d+ logit rows of 8 requests .*; 0 mismatching requests", out)
    assert DIGEST.search(out).group(1) == DIGEST.search(one_device).group(1)
    accepted, proposed = map(int, re.search(r"(\d+)/(\d+) drafts accepted", out).groups())
    assert 0 < accepted < proposed  # some drafts verified, some rejected and rolled back
    assert int(re.search(r"preemptions: (\d+)", out).group(1)) >= 1
    assert int(re.search(r"prefix-hit rate: (\d+)/", out).group(1)) > 0


def test_draft_model_speculation_gives_the_greedy_tokens(one_device):
    # The target's first 3 layers and its head propose 4 drafts, writing into the target's cache.
    out = run_decode("--speculate", "draft:4")
    assert re.search(r"check: \d+ logit rows of 8 requests .*; 0 mismatching requests", out)
    assert DIGEST.search(out).group(1) == DIGEST.search(one_device).group(1)
    accepted, proposed = map(int, re.search(r"(\d+)/(\d+) drafts accepted", out).groups())
    assert 0 < accepted < proposed
