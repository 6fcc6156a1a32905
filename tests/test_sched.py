"""The scheduler through its seams: the pure policy with hand-made step outputs, and the trio
loop with a fake engine run inline (no threads, no torch)."""

from __future__ import annotations

import threading

import pytest
import trio
import trio.testing

from caldrix.batch import Batch, RunOutput, StepOutput
from caldrix.protocol import FinishReason, SamplingParams, Submission, TokenEvent
from caldrix.sched.loop import Scheduler
from caldrix.sched.policy import Policy
from caldrix.sched.sequence import Sequence
from caldrix.sched.slots import SlotTable

EOS = 2


def make_sub(prompt, max_tokens=4, rid="r", stop=frozenset({EOS})):
    tx, rx = trio.open_memory_channel(max_tokens + 1)
    return Submission(rid, tuple(prompt), max_tokens, SamplingParams(), stop, tx), rx


class FakeEngine:
    """Answers each pick with (last token + 1) % 100 and records the batches it saw."""

    def __init__(self):
        self.batches: list[Batch] = []

    def step(self, batch: Batch) -> StepOutput:
        self.batches.append(batch)
        return StepOutput(tuple(
            RunOutput(tuple((r.token_ids[o] + 1) % 100 for o in r.pick_at)) for r in batch.runs
        ))


async def inline(fn, batch):
    await trio.lowlevel.checkpoint()
    return fn(batch)


def test_chunked_prefill_cuts_at_aligned_boundaries():
    policy = Policy(SlotTable(2), chunk=4, prefill_budget=4)
    sub, _ = make_sub(range(10, 20))
    seq = Sequence(sub)
    policy.admit(seq)
    starts = []
    while seq.in_prefill:
        assert policy.schedule_decode() is None
        work = policy.schedule_prefill()
        (run,) = work.batch.runs
        starts.append((run.start, len(run.token_ids), run.pick_at))
        policy.postprocess(work, StepOutput((RunOutput((5,) if run.pick_at else ()),)))
    # aligned chunks up to the last token, which runs alone (the decode form; see _chunk)
    assert starts == [(0, 4, ()), (4, 4, ()), (8, 1, ()), (9, 1, (0,))]
    assert seq.output == [5]


def test_an_image_request_reads_its_first_token_in_its_last_chunk():
    """An image request (reuse_prefix False) never reuses rows nor leaves any, so it has no
    repeat to keep identical: its last prompt row rides in its last chunk, which picks the first
    token, instead of a one-token pass of its own after it (a whole pass over the weights)."""
    import attrs

    policy = Policy(SlotTable(2), chunk=4, prefill_budget=4)
    sub, _ = make_sub(range(10, 20))
    seq = Sequence(attrs.evolve(sub, reuse_prefix=False))
    policy.admit(seq)
    starts = []
    while seq.in_prefill:
        work = policy.schedule_prefill()
        (run,) = work.batch.runs
        starts.append((run.start, len(run.token_ids), run.pick_at))
        policy.postprocess(work, StepOutput((RunOutput((5,) if run.pick_at else ()),)))
    assert starts == [(0, 4, ()), (4, 4, ()), (8, 2, (1,))]
    assert seq.output == [5]


def test_decode_and_prefill_are_separate_work():
    policy = Policy(SlotTable(3), chunk=4, prefill_budget=6)
    a, _ = make_sub([1, 3])
    b, _ = make_sub(range(10, 22))
    c, _ = make_sub(range(30, 34))
    sa, sb, sc = Sequence(a), Sequence(b), Sequence(c)
    policy.admit(sa)
    for picked in ((), (7,)):  # a's first token, then its last, alone
        work = policy.schedule_prefill()
        policy.postprocess(work, StepOutput((RunOutput(picked),)))
    assert policy.schedule_prefill() is None
    policy.admit(sb)
    policy.admit(sc)
    # a decodes one token; b gets one chunk, and c's first 3 tokens do not fit the budget's rest
    decode, prefill = policy.schedule_decode(), policy.schedule_prefill()
    assert [(r.slot, r.token_ids) for r in decode.batch.runs] == [(sa.slot, (7,))]
    assert [(r.slot, len(r.token_ids)) for r in prefill.batch.runs] == [(sb.slot, 4)]
    policy.postprocess(prefill, StepOutput((RunOutput(()),)))
    # the budget's first chunk always runs, then whatever else fits
    prefill = policy.schedule_prefill()
    assert [(r.slot, len(r.token_ids)) for r in prefill.batch.runs] == [(sb.slot, 4)]
    assert policy.has_decoding()


def test_finished_slot_keeps_its_rows_for_a_shared_prefix():
    slots = SlotTable(2)
    policy = Policy(slots, chunk=4, prefill_budget=64)
    sub, _ = make_sub([5, 6, 7, 8, 9, 10], max_tokens=2)
    seq = Sequence(sub)
    policy.admit(seq)
    # the first chunk (rows 0..3), the prompt's rest but its last token (row 4), that token, one
    # decode step
    for token in ((), (), (40,), (41,)):
        work = policy.schedule_prefill() or policy.schedule_decode()
        policy.postprocess(work, StepOutput((RunOutput(token),)))
    assert seq.finish is FinishReason.LENGTH
    assert slots.held[seq.slot] == (5, 6, 7, 8, 9, 10, 40)  # the last token has no KV row yet
    # the next turn of what the slot holds: all of it reused
    again, _ = make_sub([5, 6, 7, 8, 9, 10, 40, 2, 2])
    s2 = Sequence(again)
    policy.admit(s2)
    assert (s2.slot, s2.prefix_rows) == (seq.slot, 7)
    (run,) = policy.schedule_prefill().batch.runs
    assert run.start == 7 and run.token_ids == (2,)
    policy.running.clear()
    slots.release(s2.slot, (5, 6, 7, 8, 9, 10, 40, 2))
    # another request that shares 7 rows of them: reused down to the whole chunk a fresh run
    # computes too (rows 0..3), so the rest is cut as a fresh run cuts it
    other = Sequence(make_sub([5, 6, 7, 8, 9, 10, 40, 1, 2, 3])[0])
    policy.admit(other)
    assert (other.slot, other.prefix_rows) == (seq.slot, 4)
    (run,) = policy.schedule_prefill().batch.runs
    assert run.start == 4 and run.token_ids == (9, 10, 40, 1)
    fresh = Policy(SlotTable(1), chunk=4, prefill_budget=64)
    alone = Sequence(make_sub([5, 6, 7, 8, 9, 10, 40, 1, 2, 3])[0])
    fresh.admit(alone)
    fresh.postprocess(fresh.schedule_prefill(), StepOutput((RunOutput(()),)))  # the first chunk, 0..4
    (second,) = fresh.schedule_prefill().batch.runs
    assert (second.start, second.token_ids) == (run.start, run.token_ids)  # the same chunk as over held rows
    # an identical prompt still recomputes its last token, whose logits pick the reply
    same, _ = make_sub([5, 6, 7])
    s3 = Sequence(same)
    policy.admit(s3)
    assert s3.prefix_rows == 0  # the other slot holds nothing; slot 0 is busy


def test_held_rows_are_reused_whole_only_by_the_prompt_that_computed_them():
    """A prompt's last partial chunk is cut where that prompt ends: rows a longer prompt
    computed in a longer chunk have other bits than a fresh run of a shorter one would give
    them (the cross-feature audit: P[:1100] after P reused 1099 rows and its reply changed at
    its 3rd token). So a strict prefix of a held prompt, or one that differs from it only at
    its last token, reuses whole chunks only; the same prompt again reuses all but its last."""
    chunk = 4
    prompt = tuple(range(100, 111))  # 11 tokens: chunks 0..3, 4..7, 8..9, then row 10 alone
    # (a prompt of the same length that differs only at its last token cuts its rows as the held
    # prompt did; a fresh run of prompt + (7,) cuts rows 8..10 as one chunk, where the held rows
    # 8..9 were one and row 10 a run of its own)
    cases = [(prompt, 10), (prompt[:7], 4), (prompt[:9], 8), (prompt[:-1] + (7,), 10), (prompt + (7,), 8),
             (prompt[:-1], 8)]
    for other, expected in cases:
        slots = SlotTable(1)
        assert slots.try_acquire(prompt, reuse=True, align=chunk) == (0, 0)
        slots.release(0, prompt[:10] + (55,))  # its rows and its first reply token's
        assert slots.try_acquire(other, reuse=True, align=chunk) == (0, expected), other


def test_a_repeat_of_a_repeat_and_after_a_next_turn():
    slots = SlotTable(1)
    p = tuple(range(10))
    slots.try_acquire(p, reuse=True, align=4)
    slots.release(0, p)
    assert slots.try_acquire(p, reuse=True, align=4) == (0, 9)  # a repeat
    slots.release(0, p + (50,))
    assert slots.try_acquire(p, reuse=True, align=4) == (0, 9)  # a repeat of the repeat
    slots.release(0, p + (50,))
    turn = p + (50, 51, 52)
    assert slots.try_acquire(turn, reuse=True, align=4) == (0, 11)  # the next turn: all it holds
    slots.release(0, turn + (60,))
    # the same turn again (a regenerate, a client's retry) gets the rows that turn computed
    assert slots.try_acquire(turn, reuse=True, align=4) == (0, 12)
    slots.release(0, turn + (60,))
    # its rows past the first prompt's whole chunks came from an unaligned start: a prompt that
    # only shares them reuses the whole chunks of the first prompt's own run
    assert slots.try_acquire(turn[:12] + (9, 9), reuse=True, align=4) == (0, 8)
    slots.release(0, turn[:6])  # ended mid-prompt, after its rows 0..3 and part of 4..7
    assert (slots.fresh[0], slots.fresh_len[0]) == (4, 0)  # its whole chunk stays fresh
    assert slots.try_acquire(turn[:12] + (9, 9), reuse=True, align=4) == (0, 6)  # a retry: all held (next turn)

def test_loop_streams_tokens_and_stops_at_eos_and_length():
    async def main():
        engine = FakeEngine()
        sched = Scheduler(engine, Policy(SlotTable(2)), run_step=inline)
        tx, rx = trio.open_memory_channel(4)
        a, a_rx = make_sub([1, 2, 3], max_tokens=3, rid="a")  # 4, 5, 6: length
        b, b_rx = make_sub([97, 98, 0], max_tokens=9, rid="b")  # 1, 2=EOS: stop
        async with trio.open_nursery() as nursery:
            await nursery.start(sched.run, rx)
            await tx.send(a)
            await tx.send(b)
            got_a = [e async for e in a_rx]
            got_b = [e async for e in b_rx]
            await tx.aclose()
        assert [e.token_id for e in got_a] == [4, 5, 6]
        assert got_a[-1].finish is FinishReason.LENGTH
        assert [e.token_id for e in got_b] == [1, None]
        assert got_b[-1].finish is FinishReason.STOP
        # both were in flight together at some step
        assert max(len(b.runs) for b in engine.batches) == 2

    trio.run(main)


def test_an_empty_prompt_is_answered_with_an_error_not_held():
    """The routes refuse an empty prompt; one that reaches the scheduler anyway (caldrix run
    once sent one) gets an error event instead of a slot it would never leave."""

    async def main():
        sched = Scheduler(FakeEngine(), Policy(SlotTable(1)), run_step=inline)
        tx, rx = trio.open_memory_channel(4)
        empty, empty_rx = make_sub([], rid="empty")
        after, after_rx = make_sub([1, 2, 3], max_tokens=2, rid="after")
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                await nursery.start(sched.run, rx)
                await tx.send(empty)
                await tx.send(after)
                got = [e async for e in empty_rx]
                got_after = [e async for e in after_rx]
                await tx.aclose()
        assert [(e.finish, e.error) for e in got] == [(FinishReason.ERROR, "the prompt is empty")]
        assert [e.token_id for e in got_after] == [4, 5]

    trio.run(main)


def test_closing_the_receive_end_frees_the_slot_within_one_step():
    async def main():
        engine = FakeEngine()
        slots = SlotTable(1)
        sched = Scheduler(engine, Policy(slots), run_step=inline)
        tx, rx = trio.open_memory_channel(4)
        sub, events = make_sub([1], max_tokens=50, stop=frozenset())
        async with trio.open_nursery() as nursery:
            await nursery.start(sched.run, rx)
            await tx.send(sub)
            await events.receive()
            steps = len(engine.batches)
            events.close()  # the client went away
            with trio.fail_after(5):
                while slots.num_free == 0:
                    await trio.sleep(0)
            assert len(engine.batches) - steps <= 2
            # the next request gets the slot
            sub2, events2 = make_sub([7], max_tokens=1, rid="n")
            await tx.send(sub2)
            assert [e.token_id async for e in events2] == [8]
            await tx.aclose()

    trio.run(main)


def test_a_pass_of_several_tokens_ends_a_request_whose_client_left_once():
    """A verify pass gives one request several events. When its route has gone, the first
    failed send ends it; the rest must not end it again (each ending was counted in /metrics,
    once per guess of the pass)."""
    sub, events = make_sub([1], max_tokens=8, stop=frozenset())
    seq = Sequence(sub)

    class ThreeTokens(Policy):  # what a verify pass that kept two guesses hands back
        def postprocess(self, work, out):
            return [(seq, TokenEvent(t, None)) for t in (5, 6, 7)]

    sched = Scheduler(FakeEngine(), ThreeTokens(SlotTable(1)), run_step=inline)
    ended = []
    sched.on_finish = ended.append
    sched.policy.admit(seq)
    events.close()  # the client left while the pass ran
    sched._apply(None, None)
    assert ended == [seq]


def test_engine_failure_answers_every_request_with_an_error():
    class Broken(FakeEngine):
        def step(self, batch):
            raise RuntimeError("boom")

    async def main():
        sched = Scheduler(Broken(), Policy(SlotTable(1)), run_step=inline)
        tx, rx = trio.open_memory_channel(4)
        a, a_rx = make_sub([1], rid="a")
        b, b_rx = make_sub([1], rid="b")
        await tx.send(a)
        await tx.send(b)  # still queued when the engine fails
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sched.run, rx)
            ea = [e async for e in a_rx]
            eb = [e async for e in b_rx]
        assert ea[-1].finish is FinishReason.ERROR and "boom" in ea[-1].error
        assert eb[-1].finish is FinishReason.ERROR
        assert sched.failed and "boom" in sched.failed
        # the request channel is closed: new submissions see a broken channel (503)
        try:
            tx.send_nowait(make_sub([1])[0])
        except trio.BrokenResourceError:
            pass
        else:
            raise AssertionError("send after failure should fail")

    trio.run(main)


class LaneEngine(FakeEngine):
    """A fake engine that allows overlapping lanes; its prefill steps (any run of more than one
    token) wait in their worker thread until `release` is set, so a test can look at what
    the decode lane does meanwhile."""

    overlap_lanes = True

    def __init__(self, fail_prefill: bool = False):
        super().__init__()
        self.release = threading.Event()
        self.in_prefill = threading.Event()
        self.fail_prefill = fail_prefill
        self.ran_on: list[tuple[Batch, str]] = []  # each step and its OS thread, as it began

    def step(self, batch: Batch) -> StepOutput:
        self.ran_on.append((batch, threading.current_thread().name))
        if any(len(r.token_ids) > 1 for r in batch.runs) and len(self.batches) > 0:
            self.in_prefill.set()
            assert self.release.wait(10), "the test never released the prefill step"
            if self.fail_prefill:
                raise RuntimeError("prefill boom")
        return super().step(batch)


async def _chunk_held_beside_a_stream(engine: LaneEngine, tx, b_max_tokens: int = 2):
    """Stream a (a one-token prompt, endless tokens) until it decodes, then send b (10 prompt
    tokens) and wait until b's first chunk is held in the prefill lane. Returns both event
    channels; a runs until its receiver closes (with 60 tokens it could end, on a busy machine,
    before the test looked at it beside b), or until the scheduler ends it."""
    a, a_rx = make_sub([1], max_tokens=10**6, rid="a", stop=frozenset())
    await tx.send(a)
    await a_rx.receive()
    b, b_rx = make_sub(range(10, 20), max_tokens=b_max_tokens, rid="b")
    await tx.send(b)
    await trio.to_thread.run_sync(engine.in_prefill.wait, 10)
    return a_rx, b_rx


def test_a_prompt_chunk_runs_beside_decode_steps_on_one_core_each():
    async def main():
        engine = LaneEngine()
        sched = Scheduler(engine, Policy(SlotTable(2), chunk=4, prefill_budget=4))  # real worker threads
        tx, rx = trio.open_memory_channel(4)
        async with trio.open_nursery() as nursery:
            await nursery.start(sched.run, rx)
            a_rx, b_rx = await _chunk_held_beside_a_stream(engine, tx)
            # b's first chunk is held in its thread; a keeps getting tokens meanwhile
            with trio.fail_after(10):
                for _ in range(5):
                    await a_rx.receive()
            engine.release.set()
            assert [e.token_id for e in [e async for e in b_rx]] == [20, 21]
            a_rx.close()
            await tx.aclose()
        beside = [bt for bt in engine.batches if bt.threads == 1]
        # decode steps, and b's chunks: 4, 4, 1, then its last token alone
        assert sorted(len(r.token_ids) for bt in beside for r in bt.runs if r.slot == 1) == [1, 1, 4, 4]
        assert engine.batches[0].threads == 0  # a's prompt ran alone: every core
        # One OS thread for every step that may use every core and for decode steps, another
        # for chunks beside them (sched/threads.py: OpenMP keeps one team); both end with run.
        # (b's first chunk, held on an Event, used no CPU: the valve sends the rest to the fair
        # thread, sched/runners.py)
        for bt, name in engine.ran_on:
            b_prefill = bt.threads == 1 and any(r.slot == 1 for r in bt.runs)  # b's prompt, beside a
            assert name in (("caldrix prefill", "caldrix fair") if b_prefill else ("caldrix step",)), (bt, name)
        names = [name for _, name in engine.ran_on]
        assert "caldrix step" in names and "caldrix prefill" in names
        assert not {"caldrix step", "caldrix prefill", "caldrix fair"} & {t.name for t in threading.enumerate()}

    trio.run(main)


def test_a_client_gone_during_its_chunk_frees_the_slot_only_once_the_chunk_lands():
    async def main():
        engine = LaneEngine()
        slots = SlotTable(2)
        sched = Scheduler(engine, Policy(slots, chunk=4, prefill_budget=4))
        tx, rx = trio.open_memory_channel(4)
        async with trio.open_nursery() as nursery:
            await nursery.start(sched.run, rx)
            a_rx, b_rx = await _chunk_held_beside_a_stream(engine, tx)
            b_rx.close()
            for _ in range(5):  # several decode steps pass: b's slot stays taken
                await a_rx.receive()
            assert slots.num_free == 0
            engine.release.set()
            with trio.fail_after(10):
                while slots.num_free == 0:
                    await a_rx.receive()
            a_rx.close()
            await tx.aclose()

    trio.run(main)


def test_a_failing_prefill_lane_answers_the_running_streams_too():
    async def main():
        engine = LaneEngine(fail_prefill=True)
        sched = Scheduler(engine, Policy(SlotTable(2), chunk=4, prefill_budget=4))
        tx, rx = trio.open_memory_channel(4)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sched.run, rx)
            a_rx, b_rx = await _chunk_held_beside_a_stream(engine, tx, b_max_tokens=4)
            engine.release.set()
            with trio.fail_after(10):
                ea = [e async for e in a_rx]
                eb = [e async for e in b_rx]
        assert ea[-1].finish is FinishReason.ERROR and "prefill boom" in ea[-1].error
        assert eb[-1].finish is FinishReason.ERROR
        assert "prefill boom" in sched.failed

    trio.run(main)


def test_shutdown_cutoff_waits_for_a_chunk_in_flight():
    """The grace deadline ends the decoding stream at once and the prefilling one as soon as
    its chunk lands: never while its thread still writes its KV rows."""
    from caldrix.sched.loop import SHUTTING_DOWN

    async def main():
        engine = LaneEngine()
        slots = SlotTable(2)
        sched = Scheduler(engine, Policy(slots, chunk=4, prefill_budget=4))
        tx, rx = trio.open_memory_channel(4)
        async with trio.open_nursery() as nursery:
            await nursery.start(sched.run, rx)
            a_rx, b_rx = await _chunk_held_beside_a_stream(engine, tx)
            sched.cutoff.set()
            with trio.fail_after(10):
                ea = [e async for e in a_rx]
            assert ea[-1].error == SHUTTING_DOWN
            assert slots.num_free == 1  # a's slot; b's chunk is still held
            engine.release.set()
            with trio.fail_after(10):
                eb = [e async for e in b_rx]
            assert eb[-1].error == SHUTTING_DOWN and eb[-1].finish is FinishReason.ABORT
            assert slots.num_free == 2
            await tx.aclose()

    trio.run(main)


class HeldEngine(FakeEngine):
    """Every step that `held(batch)` picks waits in its thread until `release` is set."""

    def __init__(self, held, overlap_lanes: bool):
        super().__init__()
        self.held, self.overlap_lanes = held, overlap_lanes
        self.release = threading.Event()
        self.holding = threading.Event()

    def step(self, batch: Batch) -> StepOutput:
        if self.held(batch):
            self.holding.set()
            assert self.release.wait(10), "the test never released the step"
        return super().step(batch)


def _a_chunk(batch: Batch) -> bool:
    return any(len(r.token_ids) > 1 for r in batch.runs)


def _a_decode_step(batch: Batch) -> bool:  # past the test's 8-token prompts
    return all(len(r.token_ids) == 1 and r.start >= 8 for r in batch.runs)


@pytest.mark.parametrize("held, overlap", [(_a_chunk, True), (_a_chunk, False), (_a_decode_step, False),
                                           (_a_decode_step, True)],
                         ids=["chunk-lanes-overlap", "chunk-one-step-at-a-time", "decode-one-step-at-a-time",
                              "decode-lanes-overlap"])
def test_submissions_are_admitted_while_a_step_runs(held, overlap):
    """While any step is in flight (a prompt chunk with nothing decoding, or a decode step, on
    either loop path) the loop still takes submissions while slots are free: a request channel
    one deep, left undrained for the whole step, refused the next request (a 429) with slots
    free. Two requests sent during one held step both get slots (the second send finds room),
    and every stream completes."""

    async def main():
        engine = HeldEngine(held, overlap)
        sched = Scheduler(engine, Policy(SlotTable(4), chunk=4, prefill_budget=4))
        tx, rx = trio.open_memory_channel(1)
        subs = [make_sub(range(10 * i + 10, 10 * i + 18), max_tokens=3, rid=n, stop=frozenset()) for i, n in enumerate("abc")]
        async with trio.open_nursery() as nursery:
            await nursery.start(sched.run, rx)
            tx.send_nowait(subs[0][0])
            with trio.fail_after(10):
                while not engine.holding.is_set():
                    await trio.sleep(0.005)
                tx.send_nowait(subs[1][0])  # a's step is held
                while tx.statistics().current_buffer_used:
                    await trio.sleep(0.005)
                tx.send_nowait(subs[2][0])  # the channel has room again: b was admitted mid-step
                while tx.statistics().current_buffer_used:
                    await trio.sleep(0.005)
            assert sched.policy.slots.num_free == 1  # a, b and c hold slots; the step still runs
            engine.release.set()
            with trio.fail_after(10):
                for _, events in subs:
                    assert len([e async for e in events]) == 3
            await tx.aclose()

    trio.run(main)
