"""RequestScheduler: first come first served admission into KV slots, release and abort."""
from dspark_serve.engine.params import SamplingParams
from dspark_serve.engine.request import Request
from dspark_serve.engine.request_scheduler import RequestScheduler
from dspark_serve.model.kv_cache import KVCache


def _scheduler(num_slots=2, prefill_chunk=4):
    admitted = []
    kv = KVCache(1, num_slots, 16, 1, 2)
    return (RequestScheduler(kv, prefill_chunk, max_model_len=16, on_admit=admitted.append),
            kv, admitted)


def _request(name, prompt_len=3):
    return Request(name, list(range(prompt_len)), SamplingParams(), None)


def test_admits_in_arrival_order_while_slots_are_free():
    sched, kv, admitted = _scheduler()
    reqs = [_request(n) for n in "abc"]
    for r in reqs:
        sched.add(r)
    plan = sched.schedule()
    assert sched.running == reqs[:2] and sched.waiting == reqs[2:]
    assert [r.slot for r in reqs] == [0, 1, -1] and admitted == [0, 1]
    assert kv.num_free_slots == 0
    # prefill chunk of 4 tokens: all of a's 3, one of b's
    assert plan.decode == [] and plan.prefill == [(reqs[0], 3), (reqs[1], 1)]


def test_release_frees_the_slot_for_the_next_request():
    sched, kv, admitted = _scheduler()
    a, b, c = (_request(n) for n in "abc")
    for r in (a, b, c):
        sched.add(r)
    sched.schedule()
    sched.release(a)
    assert a.slot == -1 and a not in sched.running and kv.num_free_slots == 1
    sched.release(a)  # releasing twice is a no-op
    assert kv.num_free_slots == 1
    sched.schedule()
    assert c.slot == 0 and sched.running == [b, c] and admitted == [0, 1, 0]


def test_abort_and_empty_schedule():
    sched, kv, _ = _scheduler(num_slots=1)
    a, b = _request("a"), _request("b")
    sched.add(a)
    sched.add(b)
    sched.schedule()
    assert sched.holds("a") and sched.holds("b") and not sched.holds("x")
    sched.abort("b")               # waiting: dropped
    sched.abort("a")               # running: slot freed
    sched.abort("x")               # unknown: ignored
    assert not sched.has_unfinished() and kv.num_free_slots == 1
    assert sched.schedule() is None
