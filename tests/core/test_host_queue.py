"""`BlockQueue` against a plain list: random appends, pops from the front and removals from the middle,
with buffers small enough that compaction and stale entries happen often."""

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv.core.host_queue import BlockQueue

NUM_BLOCKS = 12


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_queue_matches_list(data):
    start = data.draw(st.lists(st.integers(0, NUM_BLOCKS - 1), unique=True), label="start")
    queue, model = BlockQueue(NUM_BLOCKS, start), list(start)
    for _ in range(data.draw(st.integers(1, 40), label="num_ops")):
        op = data.draw(st.sampled_from(["extend", "pop", "remove"]), label="op")
        if op == "extend":  # distinct blocks that are not queued
            out = [b for b in range(NUM_BLOCKS) if b not in model]
            new = data.draw(st.lists(st.sampled_from(out), unique=True), label="new") if out else []
            queue.extend(new)
            model += new
        elif op == "pop":
            num = data.draw(st.integers(0, len(model)), label="num")
            assert queue.pop_front(num) == model[:num]
            del model[:num]
        elif model:
            block = data.draw(st.sampled_from(model), label="block")
            queue.remove(block)
            model.remove(block)
        assert list(queue) == model and len(queue) == len(model)
        assert all((b in queue) == (b in model) for b in range(NUM_BLOCKS))
