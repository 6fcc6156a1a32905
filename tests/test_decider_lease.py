"""The state read once, in the scheduler (Submission.lease): the policy cuts a keeping prompt so a
chunk ends exactly at the lease's length and snapshots there, starts a later prompt of the lease
from the kept state, reads it whole once another request has written the slot below that length,
and the scheduler task drops the engine's snapshot when the route releases the lease, however
the request ended (answered, client gone while a prompt runs, or between prompts)."""

from __future__ import annotations

import trio
import trio.testing

from caldrix.batch import Batch, RunOutput, StepOutput
from caldrix.protocol import SamplingParams, StateLease, Submission
from caldrix.sched.loop import Scheduler
from caldrix.sched.policy import Policy
from caldrix.sched.sequence import Sequence
from caldrix.sched.slots import SlotTable

STATE = tuple(range(10, 21))  # 11 ids: not a multiple of the chunk


def probe(question, lease=None, keep=False, prompt=None):
    tx, rx = trio.open_memory_channel(2)
    ids = prompt if prompt is not None else STATE + tuple(question)
    return Submission("p", ids, 1, SamplingParams(), frozenset(), tx, read_ids=(1, 2),
                      lease=lease, keep_state=keep), rx


def run_prefill(policy: Policy, seq: Sequence) -> list:
    runs = []
    while seq.in_prefill:
        work = policy.schedule_prefill()
        (run,) = work.batch.runs
        runs.append(run)
        policy.postprocess(work, StepOutput((RunOutput((), (0.5, 0.5) if run.pick_at else ()),)))
    return runs


def test_keep_then_restore():
    policy = Policy(SlotTable(1), chunk=4, prefill_budget=4)
    lease = StateLease(7, len(STATE))
    first = Sequence(probe((30, 31, 32), lease, keep=True)[0])
    policy.admit(first)
    runs = run_prefill(policy, first)
    # a read-only prompt's last chunk takes its last token: no pass of its own for it
    assert [(r.start, r.end) for r in runs] == [(0, 4), (4, 8), (8, 11), (11, 12), (12, 14)]
    assert [r.snapshot for r in runs] == [0, 0, 7, 0, 0] and not any(r.restore for r in runs)
    assert [r.pick_at for r in runs] == [(), (), (), (), (1,)]
    assert policy.kept == {7: (0, 11)}
    second = Sequence(probe((40, 41, 42, 43), lease)[0])
    policy.admit(second)
    assert second.prefix_rows == second.num_computed == 11
    runs = run_prefill(policy, second)
    assert [(r.start, r.end, r.restore) for r in runs] == [(11, 12, 7), (12, 15, 0)]
    assert policy.kept == {7: (0, 11)}  # still there for the next prompt
    policy.forget(7)
    assert policy.kept == {}


def test_a_write_below_the_kept_length_reads_the_next_prompt_whole():
    policy = Policy(SlotTable(1), chunk=4, prefill_budget=4)
    lease = StateLease(3, len(STATE))
    first = Sequence(probe((30, 31), lease, keep=True)[0])
    policy.admit(first)
    run_prefill(policy, first)
    other = Sequence(probe((), prompt=(10, 11, 99, 98, 97))[0])  # another request in the slot
    policy.admit(other)
    assert policy.kept == {}  # it writes the slot from row 2: the kept state is spoiled
    run_prefill(policy, other)
    later = Sequence(probe((50, 51), lease)[0])
    policy.admit(later)
    runs = run_prefill(policy, later)
    assert later.prefix_rows == 0 and runs[0].start == 0 and not any(r.restore for r in runs)


class SnapEngine:
    """Answers reads; records the snapshots taken and dropped."""

    def __init__(self):
        self.kept: set[int] = set()
        self.dropped: list[int] = []

    def step(self, batch: Batch) -> StepOutput:
        for r in batch.runs:
            if r.restore:
                assert r.restore in self.kept
            if r.snapshot:
                self.kept.add(r.snapshot)
        return StepOutput(tuple(RunOutput((0,) if r.pick_at else (), (0.1, 0.9) if r.read_ids and r.pick_at else ())
                                for r in batch.runs))

    def drop_snapshot(self, key: int) -> None:
        self.kept.discard(key)
        self.dropped.append(key)


async def _inline(fn, batch):
    await trio.lowlevel.checkpoint()
    return fn(batch)


def test_the_scheduler_drops_a_released_lease():
    async def main():
        engine = SnapEngine()
        sched = Scheduler(engine, Policy(SlotTable(1), chunk=4, prefill_budget=4), run_step=_inline, run_prefill=_inline)
        tx, rx = trio.open_memory_channel(4)
        async with trio.open_nursery() as n:
            n.start_soon(sched.run, rx)
            # answered: two prompts, the second from the kept state, then released
            lease = StateLease(11, len(STATE))
            for i, keep in enumerate((True, False)):
                sub, events = probe((30 + i, 31), lease, keep)
                tx.send_nowait(sub)
                async with events:
                    last = [e async for e in events][-1]
                assert last.prefix_rows == (0 if keep else len(STATE)) and last.read == (0.1, 0.9)
            assert engine.kept == {11}
            lease.released = True
            await trio.sleep(1)  # idle: the scheduler looks again within half a second
            assert engine.kept == set() and engine.dropped == [11] and sched.policy.kept == {}
            # the client gone while the keeping prompt runs: its events closed, lease released
            lease = StateLease(12, len(STATE))
            sub, events = probe((30, 31), lease, True)
            events.close()
            lease.released = True
            tx.send_nowait(sub)
            await trio.sleep(1)
            assert 12 not in engine.kept and sched.policy.kept == {}
            tx.close()
        assert engine.kept == set()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
