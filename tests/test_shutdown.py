"""Stopping `caldrix serve` with SIGTERM while clients hold keep-alive connections.

A real server on a loopback port (tests/server_harness.py) with the embedded SmolLM2-135M; each
test starts its own (about 8 s on two cores), since SIGTERM ends it. What is checked:

- idle keep-alive connections (an `openai.OpenAI` client left open after its request, and a raw
  connection that never sent one) do not hold the stop: the process exits in seconds, not the
  30 s --graceful-timeout;
- an idle keep-alive connection is closed by the server after 10 s (server.KEEP_ALIVE_S);
- requests in flight at SIGTERM, one streaming and one queued behind it, still finish whole, and
  the process exits right after them although their clients keep their connections open.

Before the fix in caldrix/connections.py (finish_shielded) the first and last took 30 s to stop and
the second never saw its connection closed.
"""

from __future__ import annotations

import re
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import openai

from server_harness import ServerProcess

STOP_WITHIN = 5.0  # seconds from SIGTERM (or the last response) to exit: well short of 30
NO_RETRIES = dict(api_key="unused", max_retries=0, timeout=120.0)


def start(model_dir: Path, name: str) -> ServerProcess:
    # The default --graceful-timeout (30 s): the point is that idle connections do not wait for it.
    return ServerProcess.start(model_dir, "--dtype", "float32", "--served-name", name)


def raw_request(port: int) -> tuple[socket.socket, bytes]:
    """A keep-alive HTTP/1.1 GET /healthz on a socket of its own, left open; its response head."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    got = b""
    while not got.endswith(b"ok"):
        chunk = s.recv(4096)
        assert chunk, f"connection closed before the response ended: {got!r}"
        got += chunk
    return s, got


def time_to_eof(s: socket.socket, limit: float) -> float:
    """Seconds until the peer closes `s` (reads nothing but EOF), at most `limit`."""
    t0 = time.monotonic()
    s.settimeout(limit)
    try:
        got = s.recv(1)
    except TimeoutError:
        raise AssertionError(f"the server left an idle connection open for {limit:.0f} s") from None
    assert got == b"", "the server sent bytes on an idle connection"
    return time.monotonic() - t0


def wait_exit(srv: ServerProcess, since: float) -> float:
    status = srv.wait(60)
    took = time.monotonic() - since
    assert status == 0, f"exit status {status}:\n{srv.stderr}"
    return took


def test_sigterm_with_idle_keepalive_connections_exits_at_once(smollm2_dir: Path):
    srv = start(smollm2_dir, "idle")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", **NO_RETRIES)
        done = client.completions.create(model="idle", prompt="Hello", max_tokens=2)
        assert done.usage.completion_tokens == 2
        used, head = raw_request(srv.port)
        assert head.startswith(b"HTTP/1.1 200") and b"connection: close" not in head.lower()
        never_used = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
        # The openai client's pooled connection, `used` and `never_used` are all open and idle.
        t0 = time.monotonic()
        srv.terminate()
        assert time_to_eof(used, STOP_WITHIN) < STOP_WITHIN
        assert time_to_eof(never_used, STOP_WITHIN) < STOP_WITHIN
        took = wait_exit(srv, t0)
        assert took < STOP_WITHIN, f"the stop took {took:.1f} s with idle connections open"
        assert "SIGTERM received" in srv.stderr and "caldrix: stopped" in srv.stderr
        client.close()
        used.close()
        never_used.close()
    finally:
        srv.stop()


def test_idle_keepalive_connection_is_closed_after_10_s(smollm2_dir: Path):
    """server.KEEP_ALIVE_S: past httpx's own 5 s, so the client always lets go first."""
    srv = start(smollm2_dir, "keepalive")
    try:
        s, head = raw_request(srv.port)
        assert head.startswith(b"HTTP/1.1 200")
        idle = time_to_eof(s, 30.0)
        s.close()
        assert 9.0 < idle < 14.0, f"closed after {idle:.1f} s idle"
        # A client that closes its side of an idle connection has it closed at once, not when
        # the timer runs out (connections.mend_tcp_server); shown here by a half-close.
        s, head = raw_request(srv.port)
        assert head.startswith(b"HTTP/1.1 200")
        s.shutdown(socket.SHUT_WR)
        closed = time_to_eof(s, 30.0)
        s.close()
        assert closed < 3.0, f"closed {closed:.1f} s after the client closed its side"
        assert srv.alive
    finally:
        assert srv.stop() == 0


def running_and_waiting(url: str) -> int:
    text = httpx.get(url + "/metrics", timeout=30).text
    found = re.findall(r"^caldrix:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$", text, re.M)
    assert len(found) == 2, text
    return sum(int(float(v)) for v in found)


def test_requests_in_flight_at_sigterm_finish_then_it_exits_at_once(smollm2_dir: Path):
    srv = start(smollm2_dir, "flight")
    try:
        streamer = openai.OpenAI(base_url=srv.url + "/v1", **NO_RETRIES)
        other = openai.OpenAI(base_url=srv.url + "/v1", **NO_RETRIES)
        stream = streamer.completions.create(model="flight", prompt="Once upon a time", max_tokens=24,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
        chunks = [next(iter(stream))]
        queued: list = []
        behind = threading.Thread(target=lambda: queued.append(other.completions.create(
            model="flight", prompt="The sea", max_tokens=8, extra_body={"ignore_eos": True})))
        behind.start()
        deadline = time.monotonic() + 30
        while running_and_waiting(srv.url) < 2:  # the second request has reached the scheduler
            assert time.monotonic() < deadline and behind.is_alive(), "the second request never arrived"
            time.sleep(0.05)
        srv.terminate()
        chunks += list(stream)
        behind.join(120)
        finished = time.monotonic()
        # Both clients still hold their connections open here.
        took = wait_exit(srv, finished)
        assert "SIGTERM received" in srv.stderr
        # The stream ran whole: all 24 tokens, then its usage chunk (no error event instead).
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert "".join(c.choices[0].text for c in chunks if c.choices)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 24
        assert len(queued) == 1 and queued[0].usage.completion_tokens == 8
        assert queued[0].choices[0].finish_reason == "length"
        assert took < STOP_WITHIN, f"exit came {took:.1f} s after the last response"
        streamer.close()
        other.close()
    finally:
        srv.stop()


def test_a_second_signal_ends_running_requests_now_cleanly(smollm2_dir: Path):
    """The first SIGTERM waits for running requests (30 s of grace here); a second one ends them
    at once with the "shutting down" error event and [DONE], and the process exits 0. Before,
    the second SIGTERM killed the process mid-reply (and a second SIGINT raised a traceback)."""
    srv = start(smollm2_dir, "twice")
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            body = {"model": "twice", "prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(line for line in lines if line.startswith("data:"))
                srv.terminate()
                time.sleep(1.0)
                assert srv.alive  # still finishing the stream
                since = time.monotonic()
                srv.terminate()
                rest = [line for line in lines if line.startswith("data:")]
        took = wait_exit(srv, since)
    finally:
        srv.stop()
    assert rest[-1] == "data: [DONE]" and "the server is shutting down" in rest[-2], rest[-3:]
    assert took < STOP_WITHIN and srv.wait(5) == 0
    assert "SIGTERM received again, ending every running request now" in srv.stderr


def test_a_client_that_stopped_reading_does_not_hold_the_stop(tmp_path_factory, smollm2_dir: Path):
    """A stream whose client never reads fills the socket, and the write of its next event
    blocks, shielded (hypercorn's own and finish_shielded's): no cancellation ends it. The stop
    used to wait for it forever, and later signals did nothing (the soak audit: alive 610 s
    after SIGTERM with --graceful-timeout 6). Now connections still open a few seconds after the
    running requests were ended are closed, and the process exits 0."""
    from reliability_util import tiny_smol

    model = tiny_smol(tmp_path_factory.getbasetemp(), smollm2_dir)
    srv = ServerProcess.start(model, "--graceful-timeout", "3", "--served-name", "stuck")
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", srv.port))
        body = (b'{"model": "stuck", "prompt": "Once upon a time", "max_tokens": 1800, "ignore_eos": true, '
                b'"stream": true}')
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 60
        while not running_and_waiting(srv.url) and time.monotonic() < deadline:  # admitted
            time.sleep(0.05)
        while running_and_waiting(srv.url) and time.monotonic() < deadline:  # all 1800 tokens made
            time.sleep(0.2)
        time.sleep(1.0)  # the unread events fill the socket's buffers: the next write blocks
        since = time.monotonic()
        srv.terminate()
        took = wait_exit(srv, since)
    finally:
        s.close()
        srv.stop()
    assert took < 3 + 2 * 5.0, (took, srv.stderr)
    assert "caldrix: closed 1 connection still open 3 s after the running requests were ended" in srv.stderr, srv.stderr
    assert "caldrix: stopped" in srv.stderr


# A load that says when it starts and takes 4 s longer, so a signal lands inside it.
SLOW_LOAD = (
    "import sys, time, caldrix.runtime as r\n"
    "real = r.load_runtime\n"
    "def slow(cfg):\n"
    "    print('LOADING', file=sys.stderr, flush=True); time.sleep(4); return real(cfg)\n"
    "r.load_runtime = slow\n"
    "import runpy\nsys.argv[0] = 'caldrix'\n"
    "runpy.run_module('caldrix', run_name='__main__', alter_sys=True)\n"
)


@pytest.mark.parametrize("signals, status", [
    ([signal.SIGINT], 130),  # as `caldrix run` ends on Ctrl-C
    ([signal.SIGTERM], 0),  # a graceful stop, with nothing to finish
    ([signal.SIGINT, signal.SIGINT], 130),  # a second Ctrl-C does not wait for the load
])
def test_a_signal_during_the_load_stops_the_server_quietly(smollm2_dir: Path, signals, status):
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", SLOW_LOAD, "serve", str(smollm2_dir), "--port", "0",
                             "--dtype", "float32"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent)
    try:
        assert proc.stderr.readline().strip() == "LOADING"
        for sig in signals:
            proc.send_signal(sig)
            time.sleep(0.5)
        t0 = time.monotonic()
        err = proc.stderr.read()
        assert proc.wait(60) == status, err
        if len(signals) > 1:
            assert time.monotonic() - t0 < 3.0 and "stopped during the load" in err
    finally:
        proc.kill()
        proc.wait()
    assert f"{signals[0].name} received; stopping once the model has loaded" in err
    assert "Traceback" not in err and "listening" not in err and "caldrix: lane" not in err, err
