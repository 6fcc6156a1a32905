"""Composition root: load the model, then one root nursery owns the scheduler, the request
channel and the HTTP server.

Task tree:
    serve()                      root nursery
      Scheduler.run(rx)          sole owner of sequences and KV slots; steps on its lane threads
      hypercorn.trio.serve(app)  HTTP handlers, each in hypercorn's own nursery under this one

Shutdown: SIGINT or SIGTERM stops the listeners and closes idle keep-alive connections at once;
hypercorn lets running requests finish (up to the graceful timeout; two seconds before it the
scheduler ends any still running with a clean "shutting down" error) and closes each connection
as its response ends; then the request channel is closed, the scheduler ends when its running
requests have, and serve() returns so the process exits 0.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import signal
import socket
import sys

import trio

from caldrix import connections
from caldrix.config import ServeConfig
from caldrix.request_queue import RequestQueue

log = logging.getLogger("caldrix")

# After the scheduler's cutoff has ended every request, how long their last events get to reach
# their clients before connections still open are closed under them.
CLOSE_AFTER_CUT_S = 3.0
# Idle keep-alive connections close after this. Longer than httpx's (so the openai client's) own
# 5 s expiry: at uvicorn's 5 s (vLLM's) both ends dropped the connection at once, and a request
# sent just under 5 s idle met a connection the server had just closed (1 in 12 at the edge).
KEEP_ALIVE_S = 10.0


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


async def serve(cfg: ServeConfig, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Load and serve until a signal (or cancellation). Model loading blocks a thread of its own."""
    check_bindable(cfg.host, cfg.port)  # before a load of half a minute, not after it
    rt = await _load(cfg)
    if rt is None:  # SIGTERM during the load
        say("caldrix: stopped")
        return
    rt.announce(say)
    warn_if_exposed(cfg.host)
    from caldrix import faults

    faults.install(rt.scheduler, say)  # nothing unless the test-only variable is set
    from hypercorn.config import Config as HyperConfig
    from hypercorn.trio import serve as hypercorn_serve

    from caldrix.app import create_app

    connections.mend_tcp_server()
    connections.http1_only()
    connections.mend_h11_reader()
    connections.quiet_accept_loop()

    # The bounded request channel: it holds the requests waiting beyond the running ones
    # (--queue-depth); a full queue is a 429 at the route (request_queue.py).
    queue, submit_rx = RequestQueue.open(cfg.queue_depth, lambda: rt.scheduler.statistics().free_slots)
    app = create_app(rt, queue)
    hc = HyperConfig()
    hc.bind = [f"{cfg.host}:{cfg.port}"]
    hc.graceful_timeout = cfg.graceful_timeout
    # An idle keep-alive connection is closed after KEEP_ALIVE_S, and at once when a stop begins;
    # both only work with connections.finish_shielded below.
    hc.keep_alive_timeout = KEEP_ALIVE_S
    hc.accesslog = None
    hc.alpn_protocols = ["http/1.1"]  # TLS clients too (connections.http1_only)
    hc.errorlog = logging.getLogger("hypercorn.error")
    stop = trio.Event()
    # What loading made (the model's modules, the tokenizer's tables, the imported libraries:
    # about 350,000 objects the collector tracks) lives as long as the server. A full
    # collection walks all of it, 200-260 ms with the GIL held and every stream waiting, and
    # one came about once a minute under load (docs/performance-history.md). So collect once here, and
    # freeze what is left: later full collections see only what serving made (about 7 ms).
    gc.collect()
    gc.freeze()

    async def http(signals: trio.CancelScope, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with queue.tx:  # closed once hypercorn is done: the scheduler then drains and ends
                async with trio.open_nursery() as watchdog:
                    watchdog.start_soon(_cut_before_deadline, stop, rt.scheduler, cfg.graceful_timeout)
                    await hypercorn_serve(connections.finish_shielded(app), hc, shutdown_trigger=stop.wait,
                                          task_status=task_status, mode="asgi")
                    watchdog.cancel_scope.cancel()
        finally:
            signals.cancel()  # the server is down: stop catching signals, so the nursery can end
        vision = app.extensions.get("caldrix.vision")
        if vision is not None:  # every handler has ended, so nothing runs on its threads
            still = vision.limiter.close()
            if still:
                log.warning("%d image thread(s) let go under load still run; the process may abort "
                            "as it exits (\"terminate called without an active exception\")", still)

    async with trio.open_nursery() as nursery:
        signals = await nursery.start(_wait_for_signal, stop, rt.scheduler)
        await nursery.start(rt.scheduler.run, submit_rx)
        binds = await nursery.start(http, signals)
        say(f"caldrix: listening on {base_url(cfg.host, cfg.port, binds)}/v1")
        task_status.started(binds)
    say("caldrix: stopped")


async def _load(cfg: ServeConfig):
    """The runtime (None: stopped meanwhile), loaded on a thread of its own: torch's parallel
    kernels run there, and on a thread that ends with the load the OpenMP team it grows ends
    too, so the steps' own team is then the only one (sched/threads.py).

    A load cannot be cut short inside torch. A SIGINT or SIGTERM meanwhile is answered at once,
    and the server then stops as soon as the load returns, before it announces anything: a
    SIGINT raises KeyboardInterrupt (cli.py exits 130, quietly), a SIGTERM returns from serve()
    (exit 0, as a graceful stop). A second signal exits at once, 130 or 143; a conversion or a
    kernel build it cuts leaves only temporary files, which the next start clears."""
    from caldrix.runtime import load_runtime
    from caldrix.sched.threads import StepThread

    got: list[int] = []
    with StepThread("caldrix load") as loader, trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async def watch() -> None:
            async for sig in signals:
                if got:
                    say("caldrix: stopped during the load")
                    os._exit(128 + sig)
                got.append(sig)
                say(f"caldrix: {signal.Signals(sig).name} received; stopping once the model has loaded "
                    "(a load cannot be cut short; again to stop at once)")

        failed: Exception | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            try:
                rt = await loader.run(load_runtime, cfg)
            except Exception as exc:  # raised below as itself: out of the nursery it would be a group
                failed = exc
            nursery.cancel_scope.cancel()
    if failed is not None:
        raise failed
    if got and got[0] == signal.SIGINT:
        raise KeyboardInterrupt
    return None if got else rt


def check_bindable(host: str, port: int) -> None:
    """Raise ValueError (one line, naming --host or --port) when the address cannot be bound:
    in use, or not this machine's. Binds a throwaway socket the way hypercorn will
    (SO_REUSEADDR), so a port in TIME_WAIT still passes."""
    if port == 0:
        return  # any free port
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"--host {host}: not an address this machine can bind ({exc.strerror})") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(addr)
        except OSError as exc:
            flag = "--port" if exc.errno in (errno.EADDRINUSE, errno.EACCES) else "--host"
            raise ValueError(f"{flag}: cannot listen on {host} port {port}: {exc.strerror}") from None


def base_url(host: str, port: int, binds=None) -> str:
    """The URL clients reach: hypercorn's own bind (it knows the port 0 took), else host and
    port, an IPv6 address in brackets."""
    if binds and isinstance(binds[0], str) and binds[0].startswith("http"):
        return binds[0].rstrip("/")
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def warn_if_exposed(host: str) -> None:
    """One line when the bind reaches beyond this machine: there is no API key to stop anyone."""
    import ipaddress

    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        loopback = False
    if not loopback:
        say(f"caldrix: warning: binding {host} exposes this server beyond this machine, and it has no API key")


async def _cut_before_deadline(stop: trio.Event, scheduler, grace: float) -> None:
    """Shortly before hypercorn's grace period ends (or at a second signal, whichever comes
    first), have the scheduler end every running request with a clean error (an SSE error
    event, or a 503), rather than let hypercorn cut the connections mid-stream. CLOSE_AFTER_CUT_S
    later, close whatever connections are still open: a client that stopped reading holds its
    last write, and with it the stop, for as long as it likes. Cancelled once hypercorn is done."""
    await stop.wait()
    with trio.move_on_after(max(grace - 2.0, 0.0)):
        await scheduler.cutoff.wait()
    scheduler.cutoff.set()
    await trio.sleep(CLOSE_AFTER_CUT_S)
    n = connections.close_open()
    if n:
        say(f"caldrix: closed {n} connection{'s' if n > 1 else ''} still open {CLOSE_AFTER_CUT_S:.0f} s after the "
            "running requests were ended (clients that stopped reading)")


async def _wait_for_signal(stop: trio.Event, scheduler, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """The first SIGINT or SIGTERM starts the graceful stop (`stop`); a second one ends every
    running and queued request now, cleanly (an SSE error event and [DONE], or a 503: the
    scheduler's cutoff), as llama-server and uvicorn stop at once on a second Ctrl-C. Signals
    stay caught until the caller cancels the scope handed to task_status, once the server is
    down: left to the default handlers, a second SIGTERM killed the process mid-reply and a
    second SIGINT raised KeyboardInterrupt through every task."""
    with trio.CancelScope() as scope, trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started(scope)
        async for sig in signals:
            name = signal.Signals(sig).name
            if not stop.is_set():
                say(f"caldrix: {name} received, finishing running requests")
                stop.set()
            elif not scheduler.cutoff.is_set():
                say(f"caldrix: {name} received again, ending every running request now")
                scheduler.cutoff.set()
