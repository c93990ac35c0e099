import random

import pytest

from tokenyard.engine.kv_cache import KVCacheManager
from tokenyard.engine.request import Request, RequestStatus
from tokenyard.engine.scheduler import QueueFullError, Scheduler, SchedulerOutput
from tokenyard.wire.outputs import Completion
from tokenyard.wire.sampling_params import SamplingParams


def req(rid: str, n_prompt: int, max_tokens: int = 4, priority: int = 0) -> Request:
    return Request(
        rid,
        [ord(rid[0]) * 100 + i for i in range(n_prompt)],
        SamplingParams(max_tokens=max_tokens),
        priority=priority, arrival_time=float(len(rid)) + ord(rid[-1]) / 1000,
    )


def run_step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    s.update(out, {r.request_id: 7 for r, _ in out.scheduled})
    return out


def test_new_requests_join_the_running_batch_at_the_next_step() -> None:
    s = Scheduler(KVCacheManager(64, 4), max_num_batched_tokens=64)
    s.add_request(req("a", 5))
    first = run_step(s)
    assert [(r.request_id, n) for r, n in first.scheduled] == [("a", 5)]
    s.add_request(req("b", 6))
    second = run_step(s)
    assert [(r.request_id, n) for r, n in second.scheduled] == [("a", 1), ("b", 6)]


def test_long_prompt_is_chunked_and_decodes_keep_running() -> None:
    s = Scheduler(KVCacheManager(64, 4), max_num_batched_tokens=8)
    s.add_request(req("a", 3, max_tokens=10))
    run_step(s)
    s.add_request(req("b", 20))
    steps = [run_step(s) for _ in range(3)]
    # Every step serves a's decode first, and b's prompt goes in 7-token chunks.
    assert [[(r.request_id, n) for r, n in st.scheduled] for st in steps] == [
        [("a", 1), ("b", 7)], [("a", 1), ("b", 7)], [("a", 1), ("b", 6)],
    ]
    assert s.requests["b"].num_output_tokens == 1  # the last chunk produced a token


def test_prefill_chunk_caps_prompt_tokens_only_while_others_are_in_flight() -> None:
    s = Scheduler(KVCacheManager(64, 4), max_num_batched_tokens=64, prefill_chunk=8)
    s.add_request(req("a", 20, max_tokens=10))
    # Alone, a prompt gets the whole budget.
    assert [(r.request_id, n) for r, n in run_step(s).scheduled] == [("a", 20)]
    s.add_request(req("b", 10))
    s.add_request(req("cc", 10))
    steps = [run_step(s) for _ in range(3)]
    # Beside a's decode, at most 8 prompt tokens a step, b's first and then cc's.
    assert [[(r.request_id, n) for r, n in st.scheduled] for st in steps] == [
        [("a", 1), ("b", 8)], [("a", 1), ("b", 2), ("cc", 6)], [("a", 1), ("b", 1), ("cc", 4)],
    ]
    assert s.requests["cc"].num_output_tokens == 1


def test_preemption_under_kv_pressure_recomputes_and_frees_everything() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4)
    s = Scheduler(kv, max_num_batched_tokens=64)
    for rid in ("a", "b", "c"):
        s.add_request(req(rid, 7, max_tokens=8))
    finished: list[Request] = []
    for _ in range(100):
        out = s.schedule()
        finished += [r for r in s.update(out, {r.request_id: 7 for r, _ in out.scheduled})
                     if r.is_finished]
        if not s.has_work:
            break
    assert s.num_preemptions > 0
    assert sorted(r.request_id for r in finished) == ["a", "b", "c"]
    assert all(r.num_output_tokens == 8 and r.status is RequestStatus.FINISHED_LENGTH
               for r in finished)
    assert kv.pool.num_free_blocks == 6
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_lower_priority_value_is_admitted_first() -> None:
    s = Scheduler(KVCacheManager(64, 4), max_num_batched_tokens=6)
    s.add_request(req("late", 5, priority=1))
    s.add_request(req("urgent", 5, priority=0))
    out = s.schedule()
    assert out.scheduled[0][0].request_id == "urgent"


def test_abort_frees_blocks_of_running_and_waiting_requests() -> None:
    kv = KVCacheManager(32, 4)
    s = Scheduler(kv, max_num_batched_tokens=8)
    s.add_request(req("a", 6))
    s.add_request(req("b", 6))
    run_step(s)  # a runs, b waits (budget)
    assert s.abort("a") is not None
    assert s.abort("b") is not None
    assert s.abort("b") is None
    assert not s.has_work and s.num_waiting == 0
    assert kv.pool.num_free_blocks == 32
    assert s.schedule().is_empty


def test_waiting_queue_is_bounded_by_count_and_tokens() -> None:
    s = Scheduler(KVCacheManager(32, 4), max_waiting_requests=2, max_waiting_tokens=100)
    s.add_request(req("a", 10))
    s.add_request(req("b", 10))
    with pytest.raises(QueueFullError):
        s.add_request(req("c", 10))
    s2 = Scheduler(KVCacheManager(32, 4), max_waiting_tokens=15)
    s2.add_request(req("a", 10))
    with pytest.raises(QueueFullError):
        s2.add_request(req("b", 10))


def test_the_next_step_is_planned_before_the_token_in_flight_is_known() -> None:
    """Async scheduling: a step that samples leaves one token pending; the next step
    schedules that token (a placeholder for the runner) before `update` appends it."""
    s = Scheduler(KVCacheManager(64, 4), max_num_batched_tokens=64)
    a = req("a", 5, max_tokens=3)
    s.add_request(a)
    first = s.schedule()
    assert first.starts == {"a": 0} and first.sampling == {"a"}
    assert (a.num_computed_tokens, a.num_pending) == (5, 1)
    second = s.schedule()  # planned while the first computes
    assert [(r.request_id, n) for r, n in second.scheduled] == [("a", 1)]
    assert second.starts == {"a": 5} and a.num_pending == 2
    s.update(first, {"a": 7})
    s.update(second, {"a": 8})
    assert (a.output_token_ids, a.num_pending) == ([7, 8], 0)
    # The third token is its last by length: planned, and nothing is planned after it.
    third = s.schedule()
    assert third.sampling == {"a"} and s.schedule().is_empty
    s.update(third, {"a": 9})
    assert a.status is RequestStatus.FINISHED_LENGTH and a.output_token_ids == [7, 8, 9]
    assert s.kv.pool.num_free_blocks == 64


def test_a_token_in_flight_for_a_finished_or_preempted_request_is_dropped() -> None:
    s = Scheduler(KVCacheManager(64, 4), max_num_batched_tokens=64)
    a, b = req("a", 5, max_tokens=10), req("b", 5, max_tokens=10)
    s.add_request(a)
    s.add_request(b)
    first = s.schedule()
    second = s.schedule()
    s.abort("a")  # aborted while both steps are in flight
    s._preempt(b, SchedulerOutput())
    assert b.num_pending == 0
    assert s.update(first, {"a": 7, "b": 7}) == [] and s.update(second, {"a": 8, "b": 8}) == []
    assert a.output_token_ids == b.output_token_ids == []
    # b is recomputed (its full first block a prefix-cache hit) and goes on.
    again = s.schedule()
    assert again.starts == {"b": 4} and again.sampling == {"b"}
    s.update(again, {"b": 5})
    assert b.output_token_ids == [5] and s.kv.pool.num_free_blocks == 64 - 2


# -- classes: prompt order and priority preemption ---------------------------------------------

def ids(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in out.scheduled]


def run_all(s: Scheduler, limit: int = 200) -> list[SchedulerOutput]:
    steps = []
    while s.has_work and len(steps) < limit:
        steps.append(run_step(s))
    assert not s.has_work
    return steps


def test_a_waiting_higher_class_prompt_goes_ahead_of_running_lower_class_chunks() -> None:
    s = Scheduler(KVCacheManager(256, 4), max_num_batched_tokens=64, prefill_chunk=8)
    s.add_request(req("b1", 20, priority=2))
    s.add_request(req("b2", 20, priority=2))
    assert ids(run_step(s)) == [("b1", 8)]
    s.add_request(req("l", 6, priority=0))
    # The live prompt first, then what the chunk cap leaves goes on with b1's prompt.
    assert ids(run_step(s)) == [("l", 6), ("b1", 2)]
    assert ids(run_step(s)) == [("l", 1), ("b1", 8)]
    assert s.num_preemptions == 0


def test_with_the_seats_full_a_higher_class_arrival_preempts_the_latest_lower_one() -> None:
    s = Scheduler(KVCacheManager(64, 4), max_num_batched_tokens=64, max_num_seqs=2)
    b1, b2 = req("b1", 5, max_tokens=10, priority=2), req("b2", 5, max_tokens=10, priority=2)
    s.add_request(b1)
    s.add_request(b2)
    run_step(s)
    live = req("l", 6, max_tokens=3, priority=0)
    s.add_request(live)
    step = run_step(s)
    # b2 (the latest) gives back its decode and its seat; the live prompt runs at once.
    assert ids(step) == [("b1", 1), ("l", 6)] and step.preempted == [b2]
    assert b2.status is RequestStatus.PREEMPTED and b2.num_computed_tokens == 0
    assert (s.num_preemptions, b2.num_preemptions) == (1, 1)
    assert live.output_token_ids == [7]
    run_all(s)
    # b2 comes back once a seat is free, recomputes, and finishes; nobody preempts back.
    assert [r.num_output_tokens for r in (b1, b2, live)] == [10, 10, 3]
    assert s.num_preemptions == 1 and live.num_preemptions == 0
    assert s.kv.pool.num_free_blocks == 64


def test_equal_or_higher_classes_are_never_preempted_for_a_waiting_request() -> None:
    s = Scheduler(KVCacheManager(64, 4), max_num_batched_tokens=64, max_num_seqs=2)
    s.add_request(req("a", 5, max_tokens=6, priority=1))
    s.add_request(req("b", 5, max_tokens=6, priority=1))
    run_step(s)
    s.add_request(req("c", 5, priority=1))
    s.add_request(req("dd", 5, priority=2))
    assert ids(run_step(s)) == [("a", 1), ("b", 1)]
    run_all(s)
    assert s.num_preemptions == 0


def test_a_higher_class_preempts_lower_ones_for_the_pool_only_if_it_then_fits() -> None:
    # 8 blocks of 4 tokens: b1 and b2 (class 2) hold 3 blocks each, 2 are free.
    s = Scheduler(KVCacheManager(8, 4, enable_caching=False), max_num_batched_tokens=64)
    b1, b2 = req("b1", 10, max_tokens=4, priority=2), req("b2", 10, max_tokens=4, priority=2)
    s.add_request(b1)
    s.add_request(b2)
    run_step(s)
    live = req("l", 14, max_tokens=2, priority=0)  # 4 blocks: b2's 3 make room
    s.add_request(live)
    step = run_step(s)
    assert ids(step) == [("b1", 1), ("l", 14)] and step.preempted == [b2]
    run_all(s)
    assert [r.num_output_tokens for r in (b1, b2, live)] == [4, 4, 2]
    # A prompt that would not fit even with every lower class gone preempts nobody.
    s2 = Scheduler(KVCacheManager(8, 4, enable_caching=False), max_num_batched_tokens=64)
    a, b = req("a", 14, max_tokens=4, priority=0), req("b", 6, max_tokens=4, priority=2)
    s2.add_request(a)
    s2.add_request(b)
    run_step(s2)
    s2.add_request(req("l", 18, max_tokens=2, priority=0))  # 5 blocks: 2 free + b's 2
    assert ids(run_step(s2)) == [("a", 1), ("b", 1)]
    assert s2.num_preemptions == 0


def test_the_pool_running_out_never_preempts_a_higher_class() -> None:
    """A live prompt chunk short of blocks takes them from a batch line already given
    its decode this step (which gives the token back), not from itself."""
    s = Scheduler(KVCacheManager(6, 4, enable_caching=False), max_num_batched_tokens=64,
                  prefill_chunk=4)
    b = req("b", 7, max_tokens=12, priority=2)
    s.add_request(b)
    run_step(s)  # alone: the whole prompt, 2 blocks
    live = req("l", 16, max_tokens=2, priority=0)
    s.add_request(live)
    for _ in range(3):  # the live prompt in 4-token chunks beside b's decodes
        run_step(s)
    step = run_step(s)  # l's last chunk needs a 4th block and none is free
    assert b in step.preempted and live.num_preemptions == 0
    assert ids(step) == [("l", 4)]
    run_all(s)
    assert (b.num_output_tokens, live.num_output_tokens) == (12, 2)


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_preempted_for_a_higher_class_ends_with_its_greedy_tokens(
    async_scheduling: bool,
) -> None:
    from tokenyard.engine.llm import LLM

    llm = LLM(weights="float32", max_num_seqs=2, async_scheduling=async_scheduling)
    rng = random.Random(7)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(20, 60))]
               for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = [r.token_ids for r in llm.generate(prompts, params)]
    assert llm.core.stats().num_preemptions == 0
    got = {name: Completion(0) for name in ("b0", "b1", "live")}
    for name, prompt in zip(("b0", "b1"), prompts, strict=False):
        llm.frontend.add_request(name, prompt, params, priority=2)

    def step() -> None:
        for out in llm.frontend.step():
            for delta in out.deltas:
                got[out.request_id].add(delta)

    for _ in range(4):
        step()
    llm.frontend.add_request("live", prompts[2], params, priority=0)
    step()  # plans the step that seats the live request (async: after the one in flight)
    assert llm.core.stats().num_preemptions == 1
    if not async_scheduling:
        assert len(got["live"].token_ids) == 1  # its first token in the step it arrived at
    while llm.frontend.has_work:
        step()
    assert [got[name].token_ids for name in ("b0", "b1", "live")] == expected
    assert llm.core.stats().num_preemptions == 1
    llm.core.close()
