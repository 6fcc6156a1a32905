"""Two image rules of http-api.md over a real `caldrix serve` on a loopback socket, which the
other vision tests show only below HTTP or with httpx alone:

- The image decode queue: with --queue-depth 1, two requests decoding and one waiting, the
  waiting client closes its connection; its place is free at once, so a new image request is
  admitted to wait (not a 429) while the two still decode. The state is read from /metrics'
  caldrix:num_images_decoding and caldrix:num_images_waiting gauges (the limiter's own counts,
  caldrix/vision/limiter.py), never guessed with sleeps; the two decoding requests carry eight
  large progressive JPEGs each (about 3 s of decoding on this machine, the steps between the
  scrapes take milliseconds).
- On a text server (the embedded SmolLM2): an image part is a 400 "this model takes text only"
  at messages[i].content[j], and "<image>" typed into a text part is a 400 naming the image
  placeholder count, both through the official openai client.

The tiny Idefics3 directory and the request builders come from tests/test_vision_http.py.
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import re
import socket
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from server_harness import ServerProcess, hold_slot
from test_vision_http import CONTEXT, ask, chat, encoded, image_part, tiny, url  # noqa: F401 (tiny: a fixture)

QUEUE_FULL = "the image decode queue is full"
TEXT_ONLY = "this model takes text only"


def slow_jpeg(side: int = 4096) -> bytes:
    """A side x side progressive JPEG without chroma subsampling: smooth, so it stays small
    (about 0.2 MiB), and slow to decode (about 0.35 s here; progressive scans and full-size
    chroma are the costly paths of libjpeg)."""
    x = np.linspace(0, 255, side, dtype=np.float32)
    arr = np.stack([np.add.outer(x, x) / 2, np.add.outer(x, -x) / 2 + 128, np.broadcast_to(x, (side, side))], -1)
    buf = io.BytesIO()
    Image.fromarray(arr.astype(np.uint8), "RGB").save(buf, format="JPEG", quality=75, progressive=True, subsampling=0)
    return buf.getvalue()


def gauges(http: httpx.Client) -> tuple[int, int]:
    """(requests decoding images, requests waiting to) as /metrics reports them now."""
    text = http.get("/metrics").text
    found = dict(re.findall(r'^caldrix:(num_images_\w+)\{model_name="[^"]*"\} (\d+)\.0$', text, re.M))
    return int(found["num_images_decoding"]), int(found["num_images_waiting"])


def wait_for(http: httpx.Client, want, what: str, timeout: float = 30.0) -> tuple[int, int]:
    """Scrape until `want(decoding, waiting)` holds; fail naming `what` and the last counts."""
    deadline = time.monotonic() + timeout
    while True:
        now = gauges(http)
        if want(*now):
            return now
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: (decoding, waiting) stayed at {now} for {timeout:.0f} s")
        time.sleep(0.01)


def raw_post(port: int, path: str, body: dict) -> socket.socket:
    """A POST written on a plain socket, nothing read back: the caller closes the socket to go
    away as a client does that gives up."""
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(head + data)
    return sock


@pytest.fixture(scope="module")
def depth_one(tiny):  # noqa: F811 (the imported fixture)
    _, _, path = tiny
    # --max-batch 4: once their images are ready, the three requests that decoded them run
    # together; at the default 1 the third would meet the *request* queue (also --queue-depth
    # deep) full, a 429 of its own that this test is not about.
    with ServerProcess.start(path, "--dtype", "float32", "--context", str(CONTEXT), "--served-name", "m",
                             "--queue-depth", "1", "--max-batch", "4") as srv:
        yield srv


def test_a_client_that_goes_away_while_waiting_frees_its_place(depth_one):
    srv = depth_one
    heavy = ask([image_part(url("image/jpeg", slow_jpeg()), "low")] * 8, "Describe them.")
    light = ask([image_part(url("image/png", encoded("PNG", 16, 16, 5)), "low")], "Describe it.")
    with (openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120) as client,
          httpx.Client(base_url=srv.url, timeout=30) as http, concurrent.futures.ThreadPoolExecutor(3) as pool):
        assert gauges(http) == (0, 0)
        decoders = [pool.submit(chat, client, heavy, 2) for _ in range(2)]
        wait_for(http, lambda d, w: d == 2, "two heavy requests decoding")

        leaver = raw_post(srv.port, "/v1/chat/completions", {"model": "m", "max_tokens": 2, "messages": light})
        try:
            wait_for(http, lambda d, w: w == 1, "the raw-socket request waiting")
            # The one place is taken: one more is refused now (the queue is really one deep).
            with pytest.raises(openai.RateLimitError) as full:
                chat(client, light, 2)
            assert full.value.body["message"] == QUEUE_FULL
        finally:
            leaver.close()  # the client goes away while it waits

        freed = wait_for(http, lambda d, w: w == 0, "the place of the client that went away", timeout=10)
        assert freed == (2, 0), f"the heavy requests ended before the test could go on: {freed}"

        newcomer = pool.submit(chat, client, light, 2)
        seen = wait_for(http, lambda d, w: w == 1 or newcomer.done(), "the new request waiting")
        if newcomer.done():  # refused (the place was not freed) or the heavy ones already ended
            newcomer.result()  # a 429 raises here, naming the queue
        assert seen == (2, 1), f"the new request must wait while two decode, saw {seen}"

        for f in decoders:
            assert f.result().usage.prompt_tokens > 8 * 4  # every <image> row counted
        assert newcomer.result().choices[0].finish_reason == "length"
        assert gauges(http) == (0, 0)


def test_an_image_request_refused_at_submission_is_not_captured(tiny):  # noqa: F811
    """http-api.md: an image request is never captured by the replay ring; that holds for one
    refused with a 429 after its images were embedded (the request queue full), not only for
    one that ran. The text request refused the same way is captured, so the ring is looked at."""
    _, _, path = tiny
    # A long context, so the text stream that holds the one slot runs for seconds on the tiny model.
    with ServerProcess.start(path, "--dtype", "float32", "--context", "32768", "--served-name", "m",
                             "--queue-depth", "0", "--max-batch", "1") as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as http:
        stop = threading.Event()
        holder = threading.Thread(target=hold_slot, args=(srv.url, "m", stop, 32000))
        holder.start()
        try:
            deadline = time.monotonic() + 30
            while not re.search(r"^caldrix:num_requests_running\{.*\} 1\.0$", http.get("/metrics").text, re.M):
                assert time.monotonic() < deadline, "the text stream never took the slot"
                time.sleep(0.05)
            image = http.post("/v1/chat/completions", json={
                "model": "m", "max_tokens": 2,
                "messages": ask([image_part(url("image/png", encoded("PNG", 16, 16, 5)), "low")])})
            text = http.post("/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 2})
            # the image is prepared on an idle-priority thread, which a busy machine starves
            assert holder.is_alive(), "the text stream ended before both requests were refused: make it longer"
        finally:
            stop.set()
            holder.join()
        assert image.status_code == 429 and text.status_code == 429, (image.text, text.text)
        statuses = [(r["route"], r["status"]) for r in http.get("/debug/requests").json()["data"]]
        assert ("/v1/completions", 429) in statuses
        assert ("/v1/chat/completions", 429) not in statuses, statuses


# --- a text server --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def text_client(smollm2_dir):
    with ServerProcess.start(smollm2_dir, "--dtype", "float32", "--served-name", "text") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        yield client
        client.close()


def text_refusal(client, messages) -> dict:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="text", messages=messages, max_tokens=1)
    assert err.value.status_code == 400
    return err.value.body


SOME_TEXT = st.text(st.characters(codec="utf-8", exclude_characters="<"), max_size=12)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(before=st.integers(0, 2), parts=st.lists(SOME_TEXT, max_size=3), at=st.integers(0, 3),
       detail=st.sampled_from([None, "auto", "high", "low"]))
def test_text_server_refuses_an_image_part(text_client, before, parts, at, detail):
    # Any valid image part, anywhere among text parts, after any plain messages: 400 at its place.
    at = min(at, len(parts))
    content = [{"type": "text", "text": t} for t in parts]
    content.insert(at, image_part(url("image/png", encoded("PNG", 8, 8)), detail))
    messages = [{"role": "user", "content": f"hello {i}"} for i in range(before)]
    messages.append({"role": "user", "content": content})
    body = text_refusal(text_client, messages)
    assert body["message"] == TEXT_ONLY and body["param"] == f"messages[{before}].content[{at}]"
    assert body["type"] == "invalid_request_error"


@pytest.mark.parametrize("content,param,count", [
    ("what is <image> here", "messages[1].content", 1),
    ([{"type": "text", "text": "fine"}, {"type": "text", "text": "<image><image> twice"}], "messages[1].content[1]", 2),
])
def test_text_server_refuses_a_typed_image_placeholder(text_client, content, param, count):
    # A text server has no image token, yet http-api.md makes the typed placeholder a 400 on
    # every server: the message names the placeholder count, the param the text that holds it.
    body = text_refusal(text_client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}])
    assert body["param"] == param and body["type"] == "invalid_request_error"
    assert body["message"].startswith("image placeholder count") and f'holds {count} "<image>"' in body["message"]


def test_text_server_still_answers_text_parts(text_client):
    # The same shapes without the image or the placeholder are served: the refusals are theirs.
    got = text_client.chat.completions.create(model="text", max_tokens=1, messages=[
        {"role": "user", "content": [{"type": "text", "text": "fine"}, {"type": "text", "text": "image here"}]}])
    assert got.choices[0].finish_reason == "length"
