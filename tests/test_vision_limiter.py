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
            await wait_until(lambda: lim.decoding == 2 and lim.waiting == 3)
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
            await wait_until(lambda: lim.decoding == 2)
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
