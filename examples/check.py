"""The correctness check: every logit the serving loop computed equals a dense, cache-free forward pass."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

ATOL = 2e-4  # float32: online softmax over pages vs one softmax over the sequence


def compare_with_dense(model, requests) -> tuple[float, int]:
    """(max abs error, number of requests with a mismatch) over every recorded logit row.

    Request r's final tokens are run through `model.forward_dense` once; the row at
    position p must match every logit row the loop computed for p (a preempted
    request computes some positions twice; a prefix-cache hit computes none).
    Its generated tokens must be the dense model's greedy choices too. The tokens are padded to a power of
    two, so that one compiled pass serves requests of many lengths (the pass is causal: padding after a
    position does not change its row).
    """
    graphdef, params = nnx.split(model)
    dense = jax.jit(lambda params, tokens: nnx.merge(graphdef, params).forward_dense(tokens))
    worst, mismatches = 0.0, 0
    for req in requests:
        tokens = req.tokens[:-1]  # the last output token was never fed back
        padded = np.zeros(1 << max(len(tokens) - 1, 1).bit_length(), np.int32)
        padded[: len(tokens)] = tokens
        expected = np.asarray(dense(params, padded))[: len(tokens)]
        positions = sorted(req.logits)
        if not positions:
            mismatches += 1
            continue
        got = np.stack([req.logits[p] for p in positions])
        err = float(np.max(np.abs(got - expected[positions])))
        greedy = expected[len(req.prompt) - 1 :].argmax(-1).tolist()
        worst = max(worst, err)
        if err > ATOL or greedy != req.output:
            mismatches += 1
    return worst, mismatches
