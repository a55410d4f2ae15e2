"""The step's model inputs from persistent buffers, against the chunk-by-chunk lists they
replaced; and a request's token slices against its whole sequence."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cachesvc.kv.types import BlockId, RequestId
from workers.engine.request import Request
from workers.engine.scheduler import ScheduledChunk
from workers.engine.step_inputs import InputBuffers
from workers.sampling_params import SamplingParams


def chunk(start_pos: int, tokens: list[int], sample: bool = True) -> ScheduledChunk:
    return ScheduledChunk(
        RequestId(f"r{start_pos}"), tuple(tokens), start_pos, (BlockId(0),), sample
    )


def reference(chunks: list[ScheduledChunk]) -> tuple[list[int], list[int], list[int]]:
    """As the runner built them before, one chunk at a time."""
    token_ids: list[int] = []
    positions: list[int] = []
    rows: list[int] = []
    for c in chunks:
        token_ids.extend(c.token_ids)
        positions.extend(range(c.start_pos, c.start_pos + len(c.token_ids)))
        if c.sample:
            rows.append(len(token_ids) - 1)
    return token_ids, positions, rows


chunks_st = st.lists(
    st.builds(
        chunk,
        st.integers(0, 300),
        st.lists(st.integers(0, 1000), min_size=1, max_size=5),
        st.booleans(),
    ),
    max_size=10,
)


@settings(max_examples=200, deadline=None)
@given(st.lists(chunks_st, min_size=1, max_size=4))
def test_every_step_reads_what_the_chunks_say(steps: list[list[ScheduledChunk]]) -> None:
    buffers = InputBuffers(capacity=8)  # small: some steps grow it
    for chunks in steps:
        inputs = buffers.build(chunks)
        got = (inputs.token_ids.tolist(), inputs.positions.tolist(), inputs.logits_rows.tolist())
        assert got == reference(chunks)


def test_decode_steps_of_any_size_read_the_same_memory() -> None:
    buffers = InputBuffers(capacity=64)
    first = buffers.build([chunk(10 + i, [i]) for i in range(16)])
    addresses = (first.token_ids.data_ptr(), first.positions.data_ptr())
    for n in (1, 7, 64):
        inputs = buffers.build([chunk(5 * i, [i + 1]) for i in range(n)])
        assert (inputs.token_ids.data_ptr(), inputs.positions.data_ptr()) == addresses
        assert inputs.positions.tolist() == [5 * i for i in range(n)]
        assert inputs.logits_rows.tolist() == list(range(n))
    assert buffers.capacity == 64


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 99), min_size=1, max_size=20),
    st.lists(st.integers(0, 99), max_size=20),
    st.data(),
)
def test_token_slice_is_the_slice_of_the_whole_sequence(
    prompt: list[int], output: list[int], data: st.DataObject
) -> None:
    request = Request(RequestId("r"), prompt, SamplingParams(), output_token_ids=list(output))
    total = len(prompt) + len(output)
    start = data.draw(st.integers(0, total))
    end = data.draw(st.integers(start, total + 2))
    assert request.token_slice(start, end) == request.all_token_ids[start:end]
