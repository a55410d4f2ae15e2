"""Scheduler: budgets, chunked prefill, admission order, preemption, and no leaked blocks."""

from cachesvc.kv.block_pool import BlockPool
from cachesvc.kv.types import RequestId
from workers.engine.kv_manager import KVCacheManager
from workers.engine.request import FinishReason, Request
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.sampling_params import SamplingParams


def _make(num_blocks: int, block_size: int = 4, **cfg: object) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks), block_size)
    return Scheduler(SchedulerConfig(**cfg), kv)  # type: ignore[arg-type]


def _req(name: str, prompt_len: int, max_tokens: int = 4, base: int | None = None) -> Request:
    # Distinct prompts by default, so prefix caching does not merge them.
    start = sum(map(ord, name)) * 1000 if base is None else base
    tokens = list(range(start, start + prompt_len))
    return Request(RequestId(name), tokens, SamplingParams(max_tokens=max_tokens))


def _run(s: Scheduler, reqs: list[Request], max_steps: int = 200) -> list[tuple[str, ...]]:
    """Drive the scheduler to completion with a fake model that always samples token 7."""
    for r in reqs:
        s.add(r)
    preemptions: list[tuple[str, ...]] = []
    for _ in range(max_steps):
        if not s.has_unfinished():
            return preemptions
        out = s.schedule()
        preemptions.append(out.preempted)
        s.update(out)
        by_id = {r.request_id: r for r in reqs}
        for chunk in out.chunks:
            req = by_id[chunk.request_id]
            # The chunk's tokens are exactly the request's next uncomputed tokens.
            end = chunk.start_pos + len(chunk.token_ids)
            assert list(chunk.token_ids) == req.all_token_ids[chunk.start_pos : end]
            assert len(chunk.block_ids) * 4 >= end
            if chunk.sample:
                req.append_token(7, 0.0)
                if len(req.output_token_ids) >= req.params.max_tokens:
                    s.finish(req)
                    req.finish(FinishReason.LENGTH, 0.0)
    raise AssertionError("did not finish")


def test_chunked_prefill_respects_the_token_budget() -> None:
    s = _make(64, max_num_batched_tokens=10)
    s.add(_req("a", 25))
    sizes = []
    for _ in range(3):
        out = s.schedule()
        sizes.append(out.num_tokens)
        assert not any(c.sample for c in out.chunks[:-1])
        s.update(out)
    assert sizes == [10, 10, 5]
    assert s.running[0].num_computed_tokens == 25


def test_decode_and_new_prefill_share_a_step() -> None:
    s = _make(64, max_num_batched_tokens=8)
    a = _req("a", 4)
    s.add(a)
    out = s.schedule()
    s.update(out)
    a.append_token(1, 0.0)
    s.add(_req("b", 20))
    out = s.schedule()
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("a", 1), ("b", 7)]


def test_without_chunking_a_prompt_waits_for_a_step_with_room() -> None:
    s = _make(64, max_num_batched_tokens=8, enable_chunked_prefill=False)
    s.add(_req("a", 6))
    s.add(_req("b", 6))
    out = s.schedule()
    assert [c.request_id for c in out.chunks] == ["a"]
    assert out.chunks[0].sample


def test_oversized_prompt_runs_alone_without_chunking() -> None:
    s = _make(64, max_num_batched_tokens=8, enable_chunked_prefill=False)
    s.add(_req("a", 20))
    out = s.schedule()
    assert out.num_tokens == 20


def test_everything_finishes_and_no_block_leaks() -> None:
    s = _make(32, max_num_batched_tokens=16)
    reqs = [_req(f"r{i}", 3 + 5 * i, max_tokens=6) for i in range(6)]
    _run(s, reqs)
    assert all(len(r.output_token_ids) == 6 for r in reqs)
    assert s.kv.pool.num_free == 32
    s.kv.pool.check_integrity()


def test_preemption_when_blocks_run_out() -> None:
    # 6 blocks of 4 tokens: two requests of 8 prompt + 8 output tokens cannot both fit.
    s = _make(6, max_num_batched_tokens=64)
    reqs = [_req("a", 8, max_tokens=8), _req("b", 8, max_tokens=8)]
    preempted = _run(s, reqs)
    assert any("b" in p for p in preempted)  # the later arrival is the victim
    assert all(len(r.output_token_ids) == 8 for r in reqs)
    assert reqs[1].num_preemptions >= 1
    assert s.kv.pool.num_free == 6


def test_max_num_seqs_limits_running_requests() -> None:
    s = _make(64, max_num_seqs=2)
    for i in range(3):
        s.add(_req(f"r{i}", 4))
    out = s.schedule()
    assert len(out.chunks) == 2 and len(s.waiting) == 1


def test_in_batch_dedup_shares_prefix_blocks_in_one_step() -> None:
    s = _make(64)
    a, b = _req("a", 10, base=0), _req("b", 10, base=0)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [len(c.token_ids) for c in out.chunks] == [10, 2]  # b reuses a's two full blocks
    assert b.block_ids[:2] == a.block_ids[:2] and b.num_cached_tokens == 8
    assert out.chunks[1].start_pos == 8


def test_prefix_cache_across_steps_and_salt_isolation() -> None:
    s = _make(64)
    first = _req("a", 13, max_tokens=1, base=0)
    _run(s, [first])
    again = _req("b", 13, max_tokens=1, base=0)
    other_tenant = _req("c", 13, max_tokens=1, base=0)
    other_tenant.cache_salt = "tenant-b"
    _run(s, [again])
    _run(s, [other_tenant])
    assert again.num_cached_tokens == 12
    assert other_tenant.num_cached_tokens == 0
    assert s.kv.pool.num_free == 64


def test_fully_cached_prompt_still_computes_its_last_block() -> None:
    s = _make(64)
    _run(s, [_req("a", 8, max_tokens=1, base=0)])
    again = _req("b", 8, max_tokens=1, base=0)
    s.add(again)
    out = s.schedule()
    assert again.num_cached_tokens == 4 and out.chunks[0].start_pos == 4


def _make_mode(in_batch: str) -> Scheduler:
    kv = KVCacheManager(BlockPool(64), 4, in_batch=in_batch)
    return Scheduler(SchedulerConfig(), kv)


def test_split_defers_sharers_to_the_next_step() -> None:
    s = _make_mode("defer")
    a, b = _req("a", 10, base=0), _req("b", 10, base=0)
    c = _req("c", 5)  # unrelated: admitted right away, past the deferred one
    for r in (a, b, c):
        s.add(r)
    out = s.schedule()
    assert [ch.request_id for ch in out.chunks] == ["a", "c"]
    s.update(out)
    a.append_token(1, 0.0)
    c.append_token(1, 0.0)
    out = s.schedule()
    assert [(ch.request_id, len(ch.token_ids)) for ch in out.chunks][-1] == ("b", 2)
    assert b.num_cached_tokens == 8


def test_ignore_mode_computes_a_private_copy() -> None:
    s = _make_mode("ignore")
    a, b = _req("a", 10, base=0), _req("b", 10, base=0)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [len(ch.token_ids) for ch in out.chunks] == [10, 10]
    assert not set(a.block_ids) & set(b.block_ids)
