"""The route side of the request channel: --queue-depth requests may wait, one more is a 429.

The channel's buffer holds the requests that wait beyond the running ones; the scheduler takes
one off only when a slot is free for it (sched/loop.py). A client can give up while its request
waits (a timeout, a closed stream). Its submission stays in the channel until the scheduler
takes it and drops it as an abort, but it stops counting toward the depth as soon as its route
closes the event channel: counted by the channel's fill alone, such requests refused newcomers
with 429 for as long as every slot stayed busy, with nobody waiting.

So the depth is checked against `waiting()`, the handed-over submissions that the scheduler has
not taken (`Submission.taken`) and whose route still listens, less those the free slots will
take: requests that arrive together on an idle server (four at --max-batch 4) sit in the channel
until the scheduler task next runs, and counted as waiting they were refused with slots free.
The channel itself has room for
`abandoned_room(depth)` more, for the abandoned ones; when those fill it too, the route answers
429 all the same, which bounds what abandoned requests can hold.

Ownership: the routes' side alone calls `put` and `waiting` (the list of handed-over submissions
is its own; the /metrics gauge reads `waiting` too); the scheduler alone sets `taken` and owns
the slots, whose free count `free_slots` only reads; the server closes `tx` when it stops.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import trio

from caldrix.protocol import Submission


def abandoned_room(depth: int) -> int:
    """Channel room beyond --queue-depth for submissions whose clients left while they waited.
    None at depth 0: the channel is then a rendezvous, so nothing ever waits in it."""
    return max(depth, 16) if depth else 0


class QueueFull(Exception):
    """--queue-depth requests already wait: answer 429."""


class EngineStopped(Exception):
    """The scheduler has stopped (engine failure or shutdown): answer 503."""


@attrs.define(eq=False)
class RequestQueue:
    depth: int
    tx: trio.MemorySendChannel[Submission]
    # The scheduler's free slots right now (read, never changed, from the routes' side): each
    # takes one of the submissions not yet taken as soon as the scheduler task runs.
    free_slots: Callable[[], int] = lambda: 0
    _handed: list[Submission] = attrs.Factory(list)  # put, and not yet seen taken or left

    @classmethod
    def open(cls, depth: int, free_slots: Callable[[], int] = lambda: 0
             ) -> tuple["RequestQueue", trio.MemoryReceiveChannel[Submission]]:
        """A queue of `depth` and the receive end the scheduler reads."""
        tx, rx = trio.open_memory_channel[Submission](depth + abandoned_room(depth))
        return cls(depth, tx, free_slots), rx

    def waiting(self) -> int:
        """Requests waiting for a slot whose clients have not left.

        The live submissions not yet marked taken, but never more than the channel holds: the
        scheduler's `await receive()` takes a submission off the channel and yields once before
        it can set `taken`, and a route that submits in that moment must not count it (a
        /v1/systemone request submitting its next prompt just as a waiting completion is taken
        was refused with 429 so). Exact except while such a moment meets an abandoned
        submission still in the channel: then one too many, for that moment.

        Less the scheduler's free slots, after the one a submission in that moment (received,
        not yet marked) is about to take: those submissions will not wait."""
        self._handed = [s for s in self._handed
                        if not s.taken.is_set() and s.events.statistics().open_receive_channels > 0]
        untaken = min(len(self._handed), self.tx.statistics().current_buffer_used)
        in_hand = len(self._handed) - untaken  # received by the scheduler, not yet marked taken
        return max(0, untaken - max(0, self.free_slots() - in_hand))

    def put(self, sub: Submission) -> None:
        """Hand `sub` to the scheduler without waiting. Raises QueueFull when `depth` requests
        already wait (or abandoned ones fill the channel's room), EngineStopped when the
        scheduler is gone."""
        if self.depth and self.waiting() >= self.depth:  # at depth 0 the rendezvous decides
            if self.tx.statistics().open_receive_channels == 0:
                raise EngineStopped("the engine is unavailable")  # as send_nowait would say
            raise QueueFull("the request queue is full")
        try:
            self.tx.send_nowait(sub)
        except trio.WouldBlock:
            raise QueueFull("the request queue is full") from None
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise EngineStopped("the engine is unavailable") from None
        self._handed.append(sub)
