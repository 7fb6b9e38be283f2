"""Scheduler.pin (PD prefill streaming its chunks to D): a pinned request holds every page of its prompt from
the pin on, keeps them through its chunks' commits, and is never preempted, even when it is the newest."""
from specpd.config import SchedulerConfig
from specpd.core import Request, RequestStatus, SamplingParams
from specpd.engine.scheduler import Scheduler
from specpd.kv.allocator import PageAllocator

PS = 4


def run_step(sched: Scheduler) -> list:
    """One step with no model: every item commits its slots; an item reaching its end samples token 7."""
    batch = sched.schedule()
    for it in batch.items:
        sched.commit(it, it.num_tokens)
        if it.start + it.num_tokens == it.request.num_tokens and not it.request.prefill_only:
            it.request.output_token_ids.append(7)
    return batch


def test_a_pinned_prefill_is_never_preempted_and_keeps_its_pages():
    alloc = PageAllocator(6)
    sched = Scheduler(SchedulerConfig(chunked_prefill_size=PS), alloc, PS)
    older = Request("older", list(range(8)), SamplingParams())  # 2 pages, then decodes into a 3rd
    pinned = Request("pinned", list(range(100, 116)), SamplingParams(), prefill_only=True)  # 4 pages
    sched.add(older)
    sched.add(pinned)
    run_step(sched)  # a chunk of 4 each
    assert sched.pin(pinned) and len(pinned.pages) == 4 and alloc.num_free == 1
    run_step(sched)  # older takes the last free page
    batch = run_step(sched)  # older's decode needs a 3rd page: the newest request is pinned, so older goes back
    assert older in batch.preempted and older.num_computed_tokens < 8  # (and recomputes from its start)
    assert pinned.status is RequestStatus.RUNNING and pinned not in batch.preempted
    assert len(pinned.pages) == 4 and pinned.num_computed_tokens == 12  # commits kept the pinned pages
    assert not sched.pin(Request("x", list(range(40)), SamplingParams()))  # more than the pool: refused
