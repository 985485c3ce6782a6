"""The example's serving loop stops a request at its EOS ids, in the host step and in device loops, and
speculates (prompt lookup or a draft model) inside device loops with the greedy tokens."""

from __future__ import annotations

import sys

import pytest
from decode_runs import EXAMPLES

sys.path.insert(0, str(EXAMPLES))


def test_requests_stop_at_their_first_eos_token():
    from flax import nnx
    from model import Decoder, ModelConfig
    from serving import ServingLoop

    import jaxkv

    model_cfg = ModelConfig.tiny()
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    cfg = jaxkv.plan(model_cfg.kv_cache_specs(4), 1 << 20, max_model_len=32, max_num_batched_tokens=16)

    loop = ServingLoop(Decoder(model_cfg, rngs=nnx.Rngs(0)), cfg, decode_steps=4, record_logits=True)
    free_running = loop.generate(prompts, 12)
    output = free_running[0].output
    assert len(output) == 12
    # EOS ids that prompt 0 first produces at output index 0 (the host step that ends its prefill)
    # and at an index k >= 2 (inside a device loop).
    k_device = next(i for i, t in enumerate(output) if i >= 2 and t not in output[:i])
    for k in (0, k_device):
        stopped = loop.generate(prompts, 12, eos_token_ids=(output[k],))
        assert stopped[0].output == output[: k + 1]  # the EOS itself is kept, nothing after it
        assert max(stopped[0].logits) == len(prompts[0]) + k - 1  # no logits recorded past it
        other = free_running[1].output
        expected = other[: other.index(output[k]) + 1] if output[k] in other else other
        assert stopped[1].output == expected
        assert loop.mgr.num_free_blocks == cfg.num_blocks - 1  # every request was freed


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_speculative_device_loops_give_the_greedy_tokens(proposer):
    # Repetitive prompts: prompt lookup (or the first 3 of the 6 layers) proposes drafts that the tiny model
    # often accepts. Both prompts decode inside device loops, whose allocations take drafts, verify them and
    # roll rejected ones back; an EOS inside the accepted drafts stops a request there.
    from check import compare_with_dense
    from flax import nnx
    from model import Decoder, ModelConfig
    from serving import DraftModel, ServingLoop, ngram_proposer

    import jaxkv

    model_cfg = ModelConfig.tiny()
    cfg = jaxkv.plan(model_cfg.kv_cache_specs(4), 1 << 20, max_model_len=64, max_num_batched_tokens=16)
    prompts = [[3, 4, 5, 6] * 4, [7, 8, 9] * 5]
    model = Decoder(model_cfg, rngs=nnx.Rngs(0))
    plain = ServingLoop(model, cfg, max_num_seqs=2, max_num_batched_tokens=16, decode_steps=8)
    expected = [r.output for r in plain.generate(prompts, 30)]
    loop = ServingLoop(
        model,
        cfg,
        max_num_seqs=2,
        max_num_batched_tokens=16,
        decode_steps=8,
        record_logits=True,
        proposer=ngram_proposer(4) if proposer == "ngram" else DraftModel(num_drafts=4, num_layers=3),
    )
    served = loop.generate(prompts, 30)
    assert [r.output for r in served] == expected
    assert compare_with_dense(model, served)[1] == 0  # every verified logit equals the dense pass
    assert loop.stats.device_loops >= 1 and 0 < loop.stats.drafts_accepted < loop.stats.drafts_proposed
    assert loop.stats.steps < plain.stats.steps  # fewer target passes than plain decoding
    assert loop.mgr.num_free_blocks == cfg.num_blocks - 1
    eos = expected[0][20]  # inside a device loop
    stopped = loop.generate(prompts, 30, eos_token_ids=(eos,))
    assert stopped[0].output == expected[0][: expected[0].index(eos) + 1]
