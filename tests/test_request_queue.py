"""The request queue's depth counts the requests still waiting: not the ones the scheduler took,
nor the ones whose clients left (caldrix/request_queue.py). The HTTP side of the same is
tests/test_http_api.py's test_a_client_that_leaves_the_queue_gives_its_place_back."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from caldrix.protocol import SamplingParams, Submission
from caldrix.request_queue import EngineStopped, QueueFull, RequestQueue, abandoned_room


def submission(n: int) -> tuple[Submission, trio.MemoryReceiveChannel]:
    tx, rx = trio.open_memory_channel(2)
    return Submission(request_id=f"r{n}", prompt_ids=(1, 2), max_tokens=1, sampling=SamplingParams(),
                      stop_token_ids=frozenset(), events=tx), rx


def test_the_depth_counts_only_requests_still_waiting():
    async def main():
        queue, rx = RequestQueue.open(2)
        (a, a_rx), (b, b_rx), (c, _) = submission(1), submission(2), submission(3)
        queue.put(a)
        queue.put(b)
        assert queue.waiting() == 2
        with pytest.raises(QueueFull):
            queue.put(c)
        b_rx.close()  # b's client left while it waited
        assert queue.waiting() == 1
        queue.put(c)
        assert rx.receive_nowait() is a
        a.taken.set()  # as the scheduler does when it takes one
        assert queue.waiting() == 1  # c; b is a ghost still in the channel
        assert rx.statistics().current_buffer_used == 2
        assert [rx.receive_nowait().request_id for _ in range(2)] == ["r2", "r3"]

    trio.run(main)


def test_abandoned_requests_are_bounded_by_the_channels_room():
    async def main():
        depth = 3
        queue, rx = RequestQueue.open(depth)
        for n in range(depth + abandoned_room(depth)):
            sub, sub_rx = submission(n)
            queue.put(sub)
            sub_rx.close()  # every client leaves at once
        assert queue.waiting() == 0
        with pytest.raises(QueueFull):  # nobody waits, but the channel is full of ghosts
            queue.put(submission(99)[0])
        rx.receive_nowait()  # the scheduler takes one (and would drop it as an abort)
        queue.put(submission(100)[0])

    trio.run(main)


@pytest.mark.parametrize("full", [False, True])
def test_a_stopped_scheduler_is_engine_stopped_even_with_the_queue_full(full):
    async def main():
        queue, rx = RequestQueue.open(1)
        if full:
            queue.put(submission(1)[0])
        rx.close()
        sub, sub_rx = submission(2)
        with pytest.raises(EngineStopped):
            queue.put(sub)

    trio.run(main)


def test_depth_0_takes_a_request_only_while_the_scheduler_waits_for_one():
    """--queue-depth 0: nothing may wait beyond the running requests, so the channel is a
    rendezvous and a submission goes through only into a free slot's receive."""

    async def main():
        queue, rx = RequestQueue.open(0)
        with pytest.raises(QueueFull):
            queue.put(submission(1)[0])
        got = []
        async with trio.open_nursery() as nursery:
            async def take():
                got.append(await rx.receive())
            nursery.start_soon(take)
            await trio.testing.wait_all_tasks_blocked()
            queue.put(submission(2)[0])
        assert [s.request_id for s in got] == ["r2"]

    trio.run(main)


def test_a_submission_taken_off_the_channel_stops_counting_before_it_is_marked():
    """The scheduler's receive() takes a submission off the channel and yields once before it
    sets `taken`; a route submitting in that moment must find the place free."""

    async def main():
        queue, rx = RequestQueue.open(1)
        first, _ = submission(1)
        queue.put(first)
        got = []
        async with trio.open_nursery() as nursery:
            async def scheduler():
                got.append(await rx.receive())  # `taken` would be set after this returns

            nursery.start_soon(scheduler)
            await trio.testing.wait_all_tasks_blocked()
        assert got == [first] and not first.taken.is_set()
        assert queue.waiting() == 0
        queue.put(submission(2)[0])  # the one place is free

    trio.run(main)


def test_requests_that_free_slots_will_take_do_not_count_as_waiting():
    """Four requests arriving together at --max-batch 4 --queue-depth 1 sit in the channel until
    the scheduler task next runs; they were counted as waiting, and the third was refused with
    every slot free."""

    async def main():
        free = [4]
        queue, rx = RequestQueue.open(1, lambda: free[0])
        subs = [submission(n)[0] for n in range(6)]
        for sub in subs[:5]:  # four for the free slots, and one may wait
            queue.put(sub)
        assert queue.waiting() == 1
        with pytest.raises(QueueFull):
            queue.put(subs[5])
        # the scheduler receives one and, before it marks it taken, the slots still read 4 free:
        # that one is about to take a slot, so three remain for the four in the channel
        first = rx.receive_nowait()
        assert queue.waiting() == 1
        first.taken.set()
        free[0] = 3
        assert queue.waiting() == 1
        for _ in range(3):
            rx.receive_nowait().taken.set()
            free[0] -= 1
        assert free[0] == 0 and queue.waiting() == 1  # the fifth waits, and counts
        with pytest.raises(QueueFull):
            queue.put(subs[5])

    trio.run(main)
