"""caldrix/vision/limiter.py: 2 requests decode at once, --queue-depth wait, one more is refused,
a waiter that goes away frees its place, one request's images run one at a time."""

from __future__ import annotations

import threading
import time

import pytest
import trio

from caldrix.vision.limiter import QUEUE_FULL, DecodeLimiter, DecodeQueueFull


class Work:
    """A decode stand-in that records how many run at once; each call blocks until released."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = 0
        self.most = 0
        self.done: list[tuple[str, int]] = []
        self.gate = threading.Event()

    def __call__(self, item: tuple[str, int]) -> tuple[str, int]:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        self.gate.wait(10)
        with self.lock:
            self.now -= 1
            self.done.append(item)
        return item


async def wait_until(cond) -> None:
    with trio.fail_after(10):
        while not cond():
            await trio.sleep(0.005)


def test_two_decode_depth_wait_one_more_is_refused():
    async def main():
        lim, work = DecodeLimiter(queue_depth=3), Work()
        results = {}

        async def request(name: str, n: int):
            try:
                results[name] = await lim.run([(name, i) for i in range(n)], work)
            except DecodeQueueFull as e:
                results[name] = str(e)

        async with trio.open_nursery() as nursery:
            for i in range(5):  # 2 take the slots, 3 wait
                nursery.start_soon(request, f"r{i}", 2)
            # both calls inside work, not only their slots borrowed: the slots' threads run at
            # SCHED_IDLE and on a busy machine may not have started when the gate opens
            await wait_until(lambda: lim.decoding == 2 and lim.waiting == 3 and work.now == 2)
            await request("late", 1)  # the sixth: refused at once, while the others still hold
            assert results["late"] == QUEUE_FULL == "the image decode queue is full"
            work.gate.set()
        assert work.most == 2
        assert all(results[f"r{i}"] == [(f"r{i}", 0), (f"r{i}", 1)] for i in range(5))
        assert lim.decoding == 0 and lim.waiting == 0

    trio.run(main)


def test_a_waiter_that_goes_away_frees_its_place():
    async def main():
        lim, work = DecodeLimiter(queue_depth=1), Work()
        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(lim.run, [i], work)
            await wait_until(lambda: lim.decoding == 2 and work.now == 2)  # (as above)
            waiter_scope = trio.CancelScope()

            async def waiter():  # a client that disconnects while waiting
                with waiter_scope:
                    await lim.run(["w"], work)

            nursery.start_soon(waiter)
            await wait_until(lambda: lim.waiting == 1)
            with pytest.raises(DecodeQueueFull):
                await lim.run(["x"], work)
            waiter_scope.cancel()
            await wait_until(lambda: lim.waiting == 0)
            # Its place is free again: the next request waits instead of being refused.
            nursery.start_soon(lim.run, ["y"], work)
            await wait_until(lambda: lim.waiting == 1)
            work.gate.set()
        assert "w" not in work.done and "y" in work.done and work.most == 2

    trio.run(main)


def test_a_refusal_carries_what_retry_after_is_estimated_from():
    """The 429's Retry-After (routes/backoff.py) comes from how long recent requests held a slot,
    how many wait and how many slots serve them: the refusal carries all three."""
    from caldrix.routes import backoff

    async def refusal(lim: DecodeLimiter, work: Work, hold_s: float) -> DecodeQueueFull:
        """One request decoding (held `hold_s` at least), one waiting: the next one's refusal."""
        work.gate.clear()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lim.run, ["decoding"], work)
            await wait_until(lambda: work.now == 1)
            nursery.start_soon(lim.run, ["waiting"], work)
            await wait_until(lambda: lim.waiting == 1)
            with pytest.raises(DecodeQueueFull) as refused:
                await lim.run(["refused"], work)
            await trio.sleep(hold_s)
            work.gate.set()
        return refused.value

    async def main():
        lim, work = DecodeLimiter(queue_depth=1, slots=1), Work()
        first = await refusal(lim, work, 0.3)
        assert first.held == () and first.waiting == 1 and first.slots == 1
        assert backoff.estimate(first.held, 1, 1) == 1.0  # nothing has held a slot yet
        held = (await refusal(lim, work, 0)).held
        assert len(held) == 2 and held[0] >= 0.3, held  # the first round's two (the second's at once)
        want = (held[0] + held[1]) / 2 * 2  # the mean hold, times the one waiting plus one
        assert backoff.estimate(held, 1, 1) == pytest.approx(max(want, backoff.FLOOR_S))

    trio.run(main)


def test_the_estimate_is_the_mean_hold_per_place_clamped():
    from caldrix.routes import backoff

    assert backoff.estimate([], 5, 2) == 1.0
    assert backoff.estimate([2.0, 4.0], 1, 2) == pytest.approx(3.0)  # mean 3 s, 2 places ahead, 2 served at once
    assert backoff.estimate([0.01], 0, 8) == backoff.FLOOR_S
    assert backoff.estimate([100.0], 3, 1) == backoff.CEILING_S
    assert backoff.estimate([1000.0] * 10 + [1.0] * backoff.RECENT, 0, 1) == pytest.approx(1.0)  # recent only


def test_one_requests_images_run_one_at_a_time():
    async def main():
        lim = DecodeLimiter(queue_depth=0)
        seen = []
        lock = threading.Lock()
        running = [0]

        def decode(i):
            with lock:
                running[0] += 1
                seen.append(running[0])
            time.sleep(0.01)
            with lock:
                running[0] -= 1
            return i * 10

        assert await lim.run(range(6), decode) == [0, 10, 20, 30, 40, 50]
        assert max(seen) == 1

    trio.run(main)


def test_many_requests_never_more_than_two():
    async def main():
        lim = DecodeLimiter(queue_depth=64)
        lock, running, most = threading.Lock(), [0], [0]

        def decode(_):
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            time.sleep(0.002)
            with lock:
                running[0] -= 1

        async with trio.open_nursery() as nursery:
            for _ in range(20):
                nursery.start_soon(lim.run, range(3), decode)
        assert most[0] == 2

    trio.run(main)


def test_a_slot_thread_ends_with_its_request():
    """A request's images share its slot's thread, which ends when they are done; the next
    request starts a fresh one. (The tower's kernels give a slot's thread an OpenMP team, and a
    team left behind slowed every later decode step: limiter.py's docstring.)"""
    async def main():
        lim = DecodeLimiter(queue_depth=0)
        first = await lim.run([0, 1], lambda i: threading.current_thread())
        assert first[0] is first[1] and first[0].name.startswith("caldrix image")
        assert not first[0].is_alive()
        again = await lim.run([0], lambda i: threading.current_thread())
        assert again[0] is not first[0] and not again[0].is_alive()
        lim.close()

    trio.run(main)


def tile_rows(tiles):
    """An `embed` stand-in: each tile [1, 1] -> 4 feature rows of 2 values, the tile's value
    times 10 plus the row."""
    import torch

    assert tiles.shape[0] == 1, "embed_request hands the tower one tile a call"
    return (tiles[0, 0] * 10 + torch.arange(4.0)).repeat_interleave(2).view(4, 2)


def test_embed_request_hands_the_engine_views_of_each_images_rows(monkeypatch):
    """serving.embed_request: the tiles one a call, one span per run of <image> rows, each put
    as a view of its image's joined features (no copy on the server's main thread), in prompt
    order."""
    import torch

    from caldrix.vision import serving
    from caldrix.vision.preprocess import Grid, ImagePrompt, Prepared
    from caldrix.vision.prompt import VisionPlan

    pixels = {"a": torch.tensor([[1.0], [2.0]]), "b": torch.tensor([[3.0]])}  # a: two tiles, b: one
    monkeypatch.setattr(serving, "prepare_image", lambda part, s, dtype: Prepared(Grid(0, 0), pixels[part]))
    prompt = ImagePrompt(ids=tuple(range(20)), image_rows=(1, 2, 3, 4, 7, 8, 9, 10, 13, 14, 15, 16))
    put: list[tuple[int, torch.Tensor]] = []

    async def main():
        vs = serving.VisionServing(tokens=None, settings=None, limiter=serving.DecodeLimiter(0))
        spans = await serving.embed_request(vs, VisionPlan(prompt, ("a", "b")), tile_rows,
                                            lambda key, rows: put.append((key, rows)), lambda: 1)
        vs.limiter.close()
        return spans

    spans = trio.run(main)
    assert [(s.start, s.count) for s in spans] == [(1, 4), (7, 4), (13, 4)]
    assert [k for k, _ in put] == [s.key for s in spans] and len({s.key for s in spans}) == 3
    for (_, rows), tile in zip(put, [1.0, 2.0, 3.0]):
        assert torch.equal(rows, tile_rows(torch.tensor([[tile]])))
    a1, a2 = put[0][1], put[1][1]
    assert a1.untyped_storage().data_ptr() == a2.untyped_storage().data_ptr()  # views of image a's rows


def test_embed_request_refuses_rows_that_do_not_match(monkeypatch):
    import torch

    from caldrix.vision import serving
    from caldrix.vision.preprocess import Grid, ImagePrompt, Prepared
    from caldrix.vision.prompt import VisionPlan

    monkeypatch.setattr(serving, "prepare_image", lambda part, s, dtype: Prepared(Grid(0, 0), torch.ones(1, 1)))
    for rows in ((1, 2, 3), (1, 2, 3, 4, 5)):  # one row short, one too many
        async def main():
            vs = serving.VisionServing(tokens=None, settings=None, limiter=serving.DecodeLimiter(0))
            try:
                await serving.embed_request(vs, VisionPlan(ImagePrompt(tuple(range(8)), rows), ("a",)),
                                            tile_rows, lambda key, r: None, lambda: 1)
            finally:
                vs.limiter.close()

        with pytest.raises(AssertionError, match="feature rows for"):
            trio.run(main)


def test_embed_request_runs_each_call_on_the_threads_asked_for_then(monkeypatch):
    """threads() is asked before every call on the slot: the calls run with that many torch
    threads, and when the answer changes the slot's thread is a fresh one (an OpenMP team
    started on every core ends once streams run: serving.slot_threads). The slot's threads
    run under SCHED_IDLE where Linux grants it."""
    import os
    import sys

    import torch

    from caldrix.vision import serving
    from caldrix.vision.preprocess import Grid, ImagePrompt, Prepared
    from caldrix.vision.prompt import VisionPlan

    seen = []

    def prepare(part, s, dtype):
        seen.append(("prepare", threading.current_thread(), torch.get_num_threads(), os.sched_getscheduler(0)
                     if sys.platform == "linux" else None))
        return Prepared(Grid(0, 0), torch.tensor([[1.0], [2.0], [3.0]]))

    def embed(tiles):
        seen.append(("embed", threading.current_thread(), torch.get_num_threads(), None))
        return tile_rows(tiles)

    monkeypatch.setattr(serving, "prepare_image", prepare)
    answers = iter([2, 2, 1, 1])  # prepare and tile 1 on two threads; tiles 2 and 3 on one
    prompt = ImagePrompt(ids=tuple(range(16)), image_rows=tuple(range(1, 13)))

    async def main():
        vs = serving.VisionServing(tokens=None, settings=None, limiter=serving.DecodeLimiter(0))
        try:
            return await serving.embed_request(vs, VisionPlan(prompt, ("a",)), embed, lambda key, r: None,
                                               lambda: next(answers, 1))
        finally:
            vs.limiter.close()

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # what a fresh thread would otherwise start with (_on_threads says why)
        spans = trio.run(main)
    finally:
        torch.set_num_threads(threads)
    assert [(s.start, s.count) for s in spans] == [(1, 12)]
    assert [(kind, n) for kind, _, n, _ in seen] == [("prepare", 2), ("embed", 2), ("embed", 1), ("embed", 1)]
    assert seen[0][1] is seen[1][1] and seen[2][1] is seen[3][1] and seen[1][1] is not seen[2][1]
    if sys.platform == "linux" and idle_granted():
        assert seen[0][3] == os.SCHED_IDLE


def idle_granted() -> bool:
    """Whether this process may put a thread under SCHED_IDLE (a container may refuse it)."""
    import os

    got = []

    def probe():
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            got.append(os.sched_getscheduler(0) == os.SCHED_IDLE)
        except OSError:
            got.append(False)

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    return got[0]


def test_slot_threads_takes_one_beside_running_streams():
    from caldrix.vision.serving import slot_threads

    assert slot_threads(0, 8) == 8 and slot_threads(1, 8) == 1 and slot_threads(5, 2) == 1
