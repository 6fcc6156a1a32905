"""How caldrix adjusts hypercorn's (0.18) HTTP/1.1 connections: each function here mends one
way a hostile or unlucky client got through, and serve() installs them all before serving.

- finish_shielded: an idle keep-alive connection is closed on time, and at once on a stop.
- mend_tcp_server: a connection's failure stays in that connection, not the whole server; an
  idle connection closes when its client closes, not when its timer runs out.
- close_open: a stop does not wait forever on a client that stopped reading.
- http1_only: no HTTP/2, whose side let hostile clients through.
- mend_h11_reader: a refusal that closes its connection is written whole, even when the
  client has already sent more; a body in tiny chunks costs h11's parse, not one trip through
  the app per chunk.
- quiet_accept_loop: one log line a minute at the open-file limit, not ten a second.
"""

from __future__ import annotations

import logging
import time
import weakref

import h11
import trio

log = logging.getLogger("caldrix")


def finish_shielded(app):
    """The ASGI app, with the send that ends each response shielded from cancellation.

    Inside that send, hypercorn (0.18, HTTP/1.1) ends the request: it puts `http.disconnect` on
    the app's receive channel, then either readies the connection for the next request, which
    starts its idle watcher (the task that closes it after keep_alive_timeout, or at once when
    a stop begins), or, once a stop has begun, closes it. quart-trio (0.12) cancels the
    request's nursery as soon as its receive task sees that `http.disconnect`, and the
    cancellation landed on the next checkpoint, still inside this send: the watcher never
    started, or the close was skipped. An idle keep-alive connection then stayed open until
    the client closed it, and a stop waited the whole --graceful-timeout for it. Shielded, the
    send finishes that bookkeeping and the cancellation lands after it. The shield adds no wait
    of its own: the one step that can block, the socket write, hypercorn already shields.
    """

    async def asgi(scope, receive, send):
        gone = False  # the client hung up under this response: the rest of it has no reader

        async def send_or_drop(message) -> None:
            nonlocal gone
            if gone:
                return
            try:
                await send(message)
            except trio.BusyResourceError:
                # The client hung up while its refusal was written (a 413 or 415 with the body
                # unread), and hypercorn's own error response for the cut body holds the socket.
                gone = True
                log.debug("a response met a connection closing under it")

        async def send_last_shielded(message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                with trio.CancelScope(shield=True):
                    await send_or_drop(message)
            else:
                await send_or_drop(message)

        if scope["type"] == "http":
            await app(scope, receive, send_last_shielded)
        else:
            await app(scope, receive, send)

    return asgi


def mend_tcp_server() -> None:
    """Swap hypercorn's connection task (TCPServer, hypercorn 0.18) for `MendedTCPServer`, which
    mends two things. Installed once, before hypercorn's serve builds its connections (it looks
    the class up in hypercorn.trio.run at that time).

    A connection's failure stays in that connection. hypercorn runs each connection as a task of
    its listeners' nursery, and its TCPServer.run lets any error but OSError out, which ends
    that nursery: the whole server. A client that sends part of a body, then hangs up while the
    413 or 415 refusing it is being written, made one: hypercorn's error response for the cut
    body met the refusal still on the socket (trio.BusyResourceError), and the process exited,
    every stream cut without an error event. Now a connection's task closes its connection on
    any Exception and logs one line; cancellation and KeyboardInterrupt pass as before.

    An idle connection closes as soon as its client has closed its side, not when the keep-alive
    timer (server.KEEP_ALIVE_S) runs out. hypercorn ends a connection's read loop at the end of
    the stream, but the connection task waits for its children, the keep-alive timer among them:
    a client that closed an idle connection (or half-closed it after its answer) left the
    server's socket open until the timer fired. Now the timer is stopped once the read loop
    ends; a response still being written is not affected (its own task ends it)."""
    import hypercorn.trio.run as hypercorn_run

    base = hypercorn_run.TCPServer
    if getattr(base, "mended", False):
        return

    class MendedTCPServer(base):
        mended = True

        async def run(self) -> None:
            _OPEN.add(self)
            try:
                await super().run()
            except Exception as exc:
                log.warning("a connection ended in %s; closed it, the server goes on", _leaf_names(exc))
                with trio.CancelScope(shield=True):
                    try:
                        await self.stream.aclose()
                    except Exception:  # already gone
                        pass
            finally:
                _OPEN.discard(self)

        async def _read_data(self) -> None:
            await super()._read_data()
            await self.idle_task.stop()

    hypercorn_run.TCPServer = MendedTCPServer


# The connections mend_tcp_server's class is serving now (each leaves as its task
# ends; weak, so nothing here keeps one alive).
_OPEN: "weakref.WeakSet" = weakref.WeakSet()


def close_open() -> int:
    """Close the socket of every connection still open, and say how many there were. A write
    blocked on a client that stopped reading is shielded (hypercorn's, and finish_shielded's),
    so no cancellation ends it and a stop would wait for it forever; closing the socket wakes
    it with ClosedResourceError, which ends that connection's task."""
    n = 0
    for conn in list(_OPEN):
        try:
            conn.stream.socket.close()  # trio's close: wakes every task waiting on the socket
        except Exception:  # already closed
            continue
        n += 1
    return n


def http1_only() -> None:
    """Serve HTTP/1.1 alone, as llama-server, Ollama and vLLM (uvicorn) do.

    hypercorn (0.18) also switches a cleartext connection to HTTP/2 on its preface or an
    `Upgrade: h2c` request, and its HTTP/2 side is where hostile clients got through (the
    connection audit): a client that never opened its flow-control window and hung up left its
    connection, and a stop, waiting forever; a refusal sent before a stream's body was read
    ended every other stream of the connection without an error event; a connection that sent
    only the preface was never closed when idle. No OpenAI client needs HTTP/2. So the check
    that switches is replaced by none: an `Upgrade: h2c` request is answered in HTTP/1.1 (RFC
    9110 lets a server ignore Upgrade), and a preface is an HTTP/1.1 request for `*`, refused,
    after which its binary rest ends the connection. Installed once, before serving."""
    from hypercorn.protocol.h11 import H11Protocol

    if getattr(H11Protocol, "http1_only", False):
        return

    async def never_switch(self, event) -> None:
        return None

    H11Protocol._check_protocol = never_switch
    H11Protocol.http1_only = True


def quiet_accept_loop() -> None:
    """At the open-file limit trio's accept loop logs a traceback each 0.1 s while it waits (1.2 MB
    a minute under a client that holds the server there): one line a minute is enough."""
    log = logging.getLogger("trio.serve_listeners")
    if not any(isinstance(f, _OncePerMinute) for f in log.filters):
        log.addFilter(_OncePerMinute())


class _OncePerMinute(logging.Filter):
    """Let one record through per minute, without its traceback."""

    def __init__(self) -> None:
        super().__init__()
        self.last = -60.0

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        if now - self.last < 60.0:
            return False
        self.last = now
        record.exc_info = record.exc_text = None
        record.msg = f"{record.msg} (repeats are not logged for a minute)"
        return True


def _leaf_names(exc: BaseException) -> str:
    """The exception's type, or the types inside a (nested) exception group, sorted."""
    if isinstance(exc, BaseExceptionGroup):
        return ", ".join(sorted({name for e in exc.exceptions for name in _leaf_names(e).split(", ")}))
    return type(exc).__name__


DROP_LIMIT = 1 << 20  # bytes dropped unread behind a closing request before the reader pauses
COALESCE_EVENTS = 256  # body chunks joined into one event at most (a bound on one parse's time)


def mend_h11_reader() -> None:
    """Swap hypercorn's h11.Connection for `MendedConnection`, which mends two things. Installed
    once, before serving.

    A refusal that closes its connection is written whole, whatever the client sent after its
    request. A refusal sent before its body is read (a 415, a 413) says `Connection: close`, and
    h11 then expects nothing more from the client. When bytes beyond the request were already
    on the wire (a pipelined request, the rest of a stream), hypercorn's reader met them while
    the response was still being written, took them for a protocol error and closed the
    connection between the response's head and its body: the client got no answer at all (a
    415 with a pipelined request behind it was lost about half the time).

    A chunked body in tiny chunks costs h11's parse alone, not a trip through hypercorn and the
    app for each chunk. Each h11 Data event went to the app as its own ASGI message, about 25 us
    of the event loop's time a chunk against h11's 4: a client could write megabytes of 1-byte
    chunks in milliseconds, close, and leave the server parsing them for 17 s, every stream
    slowed meanwhile."""
    from hypercorn.protocol.h11 import H11Protocol

    if getattr(H11Protocol, "mended_reader", False):
        return
    base_init = H11Protocol.__init__

    def init(self, *args, **kwargs) -> None:
        base_init(self, *args, **kwargs)
        self.connection = MendedConnection(h11.SERVER, max_incomplete_event_size=self.config.h11_max_incomplete_size)

    H11Protocol.__init__ = init
    H11Protocol.mended_reader = True


class MendedConnection(h11.Connection):
    """h11's server connection (0.16), with `next_event` changed in two ways (mend_h11_reader):

    - While our response is under way and the client may send nothing more (it said, or we
      said, `Connection: close`), what it sends is dropped unread, and the connection closes once
      the response is written, as it would have without those bytes. Past DROP_LIMIT dropped,
      the reader pauses instead (hypercorn then reads no more until the response is done), so a
      client cannot keep a core busy by sending while it is answered.
    - Body chunks already received are joined into one Data event, COALESCE_EVENTS at most. The
      event after them (the body's end, the next request, a framing error) comes at the next
      call, as h11 would have given it; an end held when the cycle ends belongs to the body
      just finished, and is dropped with it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._dropped = 0
        self._held: object = None  # an event (or a framing error) read past the joined chunks

    def next_event(self):
        if self._held is not None:
            held, self._held = self._held, None
            if isinstance(held, h11.RemoteProtocolError):
                raise held
            return held
        if self.their_state is h11.MUST_CLOSE and self.our_state in (h11.SEND_RESPONSE, h11.SEND_BODY):
            if self._dropped >= DROP_LIMIT:
                return h11.PAUSED
            # h11 has no public way to drop received bytes
            self._dropped += len(self._receive_buffer)
            self._receive_buffer = type(self._receive_buffer)()
            return h11.NEED_DATA
        event = super().next_event()
        if type(event) is not h11.Data:
            return event
        parts = [event.data]
        while len(parts) < COALESCE_EVENTS:
            try:
                after = super().next_event()
            except h11.RemoteProtocolError as exc:
                self._held = exc
                break
            if type(after) is not h11.Data:
                if after is not h11.NEED_DATA:
                    self._held = after
                break
            parts.append(after.data)
        return event if len(parts) == 1 else h11.Data(data=b"".join(parts))

    def start_next_cycle(self) -> None:
        super().start_next_cycle()
        self._held = None
        self._dropped = 0
