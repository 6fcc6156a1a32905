"""caldrix/connections.py's MendedConnection against h11's own Connection, driven the way
hypercorn drives it (next_event until NEED_DATA or PAUSED; a response once a request's body has
ended, then the next cycle): the same requests, bodies, ends and framing errors in the same
order, whatever the chunking and however the bytes arrive, with a body's chunks received
together joined into one event."""

from __future__ import annotations

import h11
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from caldrix import connections
from caldrix.connections import COALESCE_EVENTS, DROP_LIMIT, MendedConnection


def chunked_request(chunks: list[bytes], *, close: bool = False) -> bytes:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
    head += b"Connection: close\r\n" if close else b""
    return head + b"\r\n" + b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"


def drive(conn: h11.Connection, pieces: list[bytes]) -> tuple[list[tuple], int]:
    """Feed `pieces` one receive at a time, as hypercorn does; (what came out, with a body's
    Data joined per receive, the number of Data events)."""
    out: list[tuple] = []
    data_events = 0
    for piece in pieces:
        conn.receive_data(piece)
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                out.append(("error", str(exc)))
                return out, data_events
            if event is h11.NEED_DATA:
                break
            if event is h11.PAUSED:  # a pipelined request waits for our answer
                break
            if isinstance(event, h11.Request):
                out.append(("request", event.target))
            elif isinstance(event, h11.Data):
                data_events += 1
                if out and out[-1][0] == "data":
                    out[-1] = ("data", out[-1][1] + event.data)
                else:
                    out.append(("data", event.data))
            elif isinstance(event, h11.EndOfMessage):
                out.append(("end",))
                conn.send(h11.Response(status_code=200, headers=[("Content-Length", "0")]))
                conn.send(h11.EndOfMessage())
                if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
                    conn.start_next_cycle()  # and on with the bytes already buffered
    return out, data_events


def split(wire: bytes, cuts: list[int]) -> list[bytes]:
    at = sorted({c % (len(wire) + 1) for c in cuts} | {0, len(wire)})
    return [wire[a:b] for a, b in zip(at, at[1:])] or [wire]


@settings(max_examples=200, deadline=None)
@given(bodies=st.lists(st.lists(st.binary(min_size=1, max_size=5), max_size=40), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 10_000), max_size=8),
       tail=st.sampled_from([b"", b"zz\r\n", b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"]))
def test_the_same_events_as_h11_with_chunks_joined(bodies, cuts, tail):
    wire = b"".join(chunked_request(b) for b in bodies) + tail
    pieces = split(wire, cuts)
    plain, plain_data = drive(h11.Connection(h11.SERVER), pieces)
    mended, mended_data = drive(MendedConnection(h11.SERVER), pieces)
    assert mended == plain
    assert mended_data <= plain_data


@pytest.mark.parametrize("chunks", [1, 2, COALESCE_EVENTS, COALESCE_EVENTS + 1, 1000])
def test_a_bodys_chunks_received_together_come_as_one_event_up_to_the_bound(chunks):
    body = [bytes([65 + i % 26]) for i in range(chunks)]
    for conn, want in ((h11.Connection(h11.SERVER), chunks), (MendedConnection(h11.SERVER), -(-chunks // COALESCE_EVENTS))):
        events, data_events = drive(conn, [chunked_request(body)])
        assert events == [("request", b"/v1/completions"), ("data", b"".join(body)), ("end",)]
        assert data_events == want


def test_a_framing_error_comes_after_the_chunks_before_it():
    wire = chunked_request([b"a", b"b"])[:-5] + b"zz\r\n"  # the last-chunk line is not hex
    events, _ = drive(MendedConnection(h11.SERVER), [wire])
    assert events[:2] == [("request", b"/v1/completions"), ("data", b"ab")]
    assert events == drive(h11.Connection(h11.SERVER), [wire])[0]  # h11's own error, word for word
    assert events[2][0] == "error" and "chunk" in events[2][1]


def test_bytes_behind_a_closing_request_are_dropped_then_the_reader_pauses():
    conn = MendedConnection(h11.SERVER)
    conn.receive_data(chunked_request([b"{}"], close=True))
    assert isinstance(conn.next_event(), h11.Request)
    assert isinstance(conn.next_event(), h11.Data)
    assert isinstance(conn.next_event(), h11.EndOfMessage)
    conn.send(h11.Response(status_code=200, headers=[("Transfer-Encoding", "chunked")]))
    sent = 0
    while True:  # our answer is under way: what the client sends is dropped, up to the bound
        conn.receive_data(b"y" * 65536)
        event = conn.next_event()
        if event is h11.PAUSED:
            break
        assert event is h11.NEED_DATA
        sent += 65536
    assert DROP_LIMIT <= sent < DROP_LIMIT + 65536


def test_the_installer_swaps_hypercorns_connection_once():
    from hypercorn.protocol.h11 import H11Protocol

    connections.mend_h11_reader()
    init = H11Protocol.__init__
    connections.mend_h11_reader()
    assert H11Protocol.__init__ is init and H11Protocol.mended_reader


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])
