"""Image input over HTTP: the official openai client against a real `caldrix serve` on a tiny
random Idefics3 (built at test time, served from a directory with SmolVLM's tokenizer: SmolLM2's
plus SmolVLM's added tokens and template, tests/vision_util.py), every rule of issue 28 that a
request can show, and the greedy reply against transformers' own greedy tokens."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image

import vision_util
from server_harness import ServerProcess

IMAGE_ID = 49190
CONTEXT = 200
# Settings scaled to the tiny tower (32 px tiles, 4 <image> tokens a tile), as the directory's
# preprocessor_config.json / processor_config.json publish them.
PRE = {"size": {"longest_edge": 64}, "max_image_size": {"longest_edge": 32}, "rescale_factor": 1 / 255,
       "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_image_splitting": True,
       "image_processor_type": "Idefics3ImageProcessor"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_dir):
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    cfg = Idefics3Config(
        vision_config=dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8, initializer_range=0.2),
        text_config=dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=49280, max_position_embeddings=1024,
                         rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=False, initializer_range=0.2),
        scale_factor=2, image_token_id=IMAGE_ID, tie_word_embeddings=False)
    torch.manual_seed(3)
    ref = Idefics3ForConditionalGeneration(cfg).eval()
    path = tmp_path_factory.mktemp("tiny_smolvlm")
    ref.save_pretrained(path)
    tok = vision_util.smolvlm_tokenizer(smollm2_dir)
    tok.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(PRE))
    (path / "processor_config.json").write_text(json.dumps({"image_seq_len": 4}))
    return ref, tok, path


@pytest.fixture(scope="module")
def server(tiny):
    _, _, path = tiny
    with ServerProcess.start(path, "--dtype", "float32", "--context", str(CONTEXT), "--max-batch", "1", "--served-name", "m") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def encoded(fmt: str, w: int, h: int, seed: int = 0, mode: str = "RGB") -> bytes:
    rng = np.random.default_rng(seed)
    im = Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8), "RGB").convert(mode)
    buf = io.BytesIO()
    im.save(buf, format=fmt)
    return buf.getvalue()


def url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_part(u: str, detail: str | None = None) -> dict:
    inner = {"url": u} if detail is None else {"url": u, "detail": detail}
    return {"type": "image_url", "image_url": inner}


def ask(parts: list[dict], text: str = "What is in the picture?") -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def chat(client, messages, max_tokens: int = 6, **extra):
    return client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens,
                                          extra_body={"ignore_eos": True, "return_token_ids": True, **extra})


def refused(client, messages) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as err:
        chat(client, messages)
    return err.value


def reference(tiny, messages, n: int) -> tuple[list[int], list[int]]:
    """(prompt ids, transformers' greedy tokens): the prompt as the processor lays it out
    (caldrix/vision/prompt.py, checked against transformers' processor elsewhere)."""
    from test_idefics3_engine import hf_greedy

    from caldrix.protocol import SamplingParams
    from caldrix.routes.schemas import ModelLimits, parse_chat
    from caldrix.vision.preprocess import ImageTokens
    from caldrix.vision.prompt import plan_prompt, prepare_image
    from caldrix.vision.serving import settings_from_dir

    ref, tok, path = tiny
    limits = ModelLimits(served_name="m", vocab_size=49280, context=CONTEXT, has_chat_template=True, has_vision=True)
    req = parse_chat({"model": "m", "messages": messages}, limits, SamplingParams())
    s = settings_from_dir(path)
    plan = plan_prompt(lambda c: tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                       lambda t: tok.encode(t, add_special_tokens=False), req.messages,
                       ImageTokens.lookup(tok.convert_tokens_to_ids), s)
    pixels = torch.cat([prepare_image(p, s).pixels for p in plan.images])
    return list(plan.prompt.ids), hf_greedy(ref, torch.tensor(plan.prompt.ids), pixels, n)


@pytest.mark.parametrize("fmt,mime", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("JPEG", "image/jpg"),
                                      ("WEBP", "image/webp")])
def test_each_type_gives_transformers_greedy_reply(client, tiny, fmt, mime):
    messages = ask([image_part(url(mime, encoded(fmt, 45, 30, seed=len(mime))))])
    got = chat(client, messages, max_tokens=8)
    ids, want = reference(tiny, messages, 8)
    assert got.choices[0].token_ids == want
    assert got.usage.prompt_tokens == len(ids) and ids.count(IMAGE_ID) == 5 * 4  # 2 x 2 tiles + global


def test_several_images_with_details(client, tiny):
    messages = ask([image_part(url("image/png", encoded("PNG", 20, 60, 1)), "low"),
                    image_part(url("image/webp", encoded("WEBP", 64, 64, 2)), "high"),
                    image_part(url("image/jpeg", encoded("JPEG", 33, 17, 3, "L")), "auto")], "Compare.")
    got = chat(client, messages, max_tokens=8)
    ids, want = reference(tiny, messages, 8)
    assert got.choices[0].token_ids == want
    assert got.usage.prompt_tokens == len(ids)


def test_text_parts_side_by_side_are_joined_with_a_newline(client, tiny):
    """http-api.md: text parts are joined with a newline before the template, on the vision
    server too (SmolVLM's own template runs them together). The prompt is the template's for
    the joined text, as transformers renders it."""
    _, tok, _ = tiny
    parts = [{"type": "text", "text": "cat"}, {"type": "text", "text": "dog"}]
    got = chat(client, [{"role": "user", "content": parts}], max_tokens=2)
    joined = [{"role": "user", "content": [{"type": "text", "text": "cat\ndog"}]}]
    want = tok.apply_chat_template(joined, tokenize=False, add_generation_prompt=True)
    assert got.usage.prompt_tokens == len(tok.encode(want, add_special_tokens=False))
    run_together = [{"role": "user", "content": parts}]
    apart = tok.apply_chat_template(run_together, tokenize=False, add_generation_prompt=True)
    assert len(tok.encode(apart, add_special_tokens=False)) != got.usage.prompt_tokens  # the test can tell


def test_streamed_reply_is_the_same(client, tiny):
    messages = ask([image_part(url("image/png", encoded("PNG", 40, 40, 7)))])
    stream = client.chat.completions.create(model="m", messages=messages, max_tokens=6, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True, "return_token_ids": True})
    tokens, usage = [], None
    for ev in stream:
        if ev.choices:
            tokens += getattr(ev.choices[0], "token_ids", None) or []
        usage = ev.usage or usage
    ids, want = reference(tiny, messages, 6)
    assert tokens == want and usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("u,says", [
    (url("image/gif", b"GIF89a" + bytes(40)), "image type image/gif is not accepted"),
    ("https://example.com/cat.png", "remote image URLs are refused"),
    ("file:///etc/passwd", "remote image URLs are refused"),
    (url("image/png", encoded("JPEG", 20, 20)), "do not start with the PNG signature"),
    (url("image/webp", encoded("PNG", 20, 20)), "signature"),
])
def test_refused_urls(client, u, says):
    err = refused(client, ask([{"type": "text", "text": "look"}, image_part(u)]))
    assert err.status_code == 400
    assert says in err.body["message"] and err.body["param"] == "messages[0].content[1]"


def test_detail_values(client):
    err = refused(client, ask([image_part(url("image/png", encoded("PNG", 20, 20)), "medium")]))
    assert err.status_code == 400 and err.body["message"] == 'detail must be auto, high or low, got "medium"'
    assert err.body["param"] == "messages[0].content[0]"


def test_nine_images_are_refused(client):
    part = image_part(url("image/png", encoded("PNG", 8, 8)), "low")
    err = refused(client, ask([part] * 9))
    assert err.status_code == 400 and err.body["param"] == "messages" and "8" in err.body["message"]


def test_side_over_4096_read_from_the_header(client):
    err = refused(client, ask([image_part(url("image/png", encoded("PNG", 4097, 2)))]))
    assert err.status_code == 400 and "4097x2" in err.body["message"] and "4096" in err.body["message"]


def test_over_8_mib_encoded(client):
    data = encoded("PNG", 16, 16) + bytes(8 * 2**20)
    err = refused(client, ask([image_part(url("image/png", data))]))
    assert err.status_code == 400 and "8 MiB" in err.body["message"]


def test_context_is_checked_before_any_image_is_decoded(client):
    # A cut-short PNG (its header reads; its pixels do not) would be a 400 "cannot be decoded"
    # if decoded; eight tiled images are past the context first.
    cut = encoded("PNG", 64, 64, 9)[:200]
    err = refused(client, ask([image_part(url("image/png", cut))] * 8))
    assert err.status_code == 400 and err.body["param"] == "messages"
    assert "cannot be decoded" not in err.body["message"] and str(CONTEXT) in err.body["message"]
    alone = refused(client, ask([image_part(url("image/png", cut))]))
    assert alone.status_code == 400 and "cannot be decoded" in alone.body["message"]


def test_typed_placeholder(client):
    err = refused(client, [{"role": "user", "content": "what is <image> here"}])
    assert err.status_code == 400 and "image placeholder count" in err.body["message"]


def test_32_mib_bodies_on_every_route(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        big = {"model": "m", "prompt": "x", "max_tokens": 1, "pad": "y" * (20 * 2**20)}
        r = http.post("/v1/completions", json=big)
        assert r.status_code != 413  # read whole, then judged on its fields
        over = {"model": "m", "prompt": "x" * (33 * 2**20)}
        r = http.post("/v1/completions", json=over)
        assert r.status_code == 413 and r.json()["error"]["message"] == "the request body is over 32 MiB"


def test_image_requests_leave_no_rows_and_are_not_captured(client, server):
    part = image_part(url("image/png", encoded("PNG", 30, 30, 11)), "low")
    with httpx.Client(base_url=server.url, timeout=60) as http:
        before = len(http.get("/debug/requests").json()["data"])
        chat(client, ask([part], "Say it."))
        chat(client, ask([part], "Say it."))  # the same prompt again: nothing held to reuse
        after = http.get("/debug/requests").json()["data"]
        assert len(after) == before  # neither image request was captured
        # A text request sharing the image prompt's opening tokens: the slot kept no rows.
        chat(client, [{"role": "user", "content": "Say it."}])
        last = http.get("/debug/requests").json()["data"][-1]
        assert last["prefix_rows"] == 0


def test_text_model_refuses_image_parts():
    # The schemas hook on a text model's limits (what every text server passes).
    from caldrix.protocol import SamplingParams
    from caldrix.routes.errors import ApiError
    from caldrix.routes.schemas import ModelLimits, parse_chat

    text = ModelLimits(served_name="m", vocab_size=49152, context=2048, has_chat_template=True)
    with pytest.raises(ApiError) as err:
        parse_chat({"model": "m", "messages": ask([image_part(url("image/png", encoded("PNG", 8, 8)))])},
                   text, SamplingParams())
    assert err.value.status == 400 and err.value.message == "this model takes text only"
    assert err.value.param == "messages[0].content[0]"


def test_host_backend_gives_the_same_reply(tiny):
    # --backend host: transformers' Idefics3ForConditionalGeneration itself behind the same route.
    _, _, path = tiny
    messages = ask([image_part(url("image/webp", encoded("WEBP", 50, 36, 21)))], "Name it.")
    ids, want = reference(tiny, messages, 6)
    with ServerProcess.start(path, "--backend", "host", "--dtype", "float32", "--context", str(CONTEXT),
                             "--served-name", "m") as srv:
        host = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        got = chat(host, messages)
    assert got.choices[0].token_ids == want and got.usage.prompt_tokens == len(ids)


def test_gpu_lanes_refuse_by_name(tiny):
    from caldrix.lanes import architecture_of, lane_refusal

    _, _, path = tiny
    for lane in ("cuda", "hip"):
        assert lane_refusal(architecture_of(path), lane) == (
            f"--backend {lane}: smolvlm-256m (idefics3) is a cpu-lane model: its vision tower runs on the cpu "
            "lane only; use --backend cpu")
    assert lane_refusal(architecture_of(path), "cpu") is None


def test_decode_queue_full_is_a_429(tiny):
    # Two decode slots and --queue-depth 1: of eight requests arriving at once with a large
    # image each (a 4000 x 3000 JPEG: decoding takes a while), two decode, one waits, and the
    # rest are refused with the decode queue's 429 (never a 500; the rest answer 200).
    import concurrent.futures

    _, _, path = tiny
    x = np.linspace(0, 255, 4000, dtype=np.float32)
    y = np.linspace(0, 255, 3000, dtype=np.float32)
    arr = np.stack([np.add.outer(y, x) / 2, np.add.outer(y, -x) % 256, np.outer(y, x) % 256], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr, "RGB").save(buf, format="JPEG", quality=90)
    body = {"model": "m", "max_tokens": 2, "messages": ask([image_part(url("image/jpeg", buf.getvalue()))])}
    with ServerProcess.start(path, "--dtype", "float32", "--context", str(CONTEXT), "--served-name", "m",
                             "--queue-depth", "1") as srv:

        def post(_):
            with httpx.Client(timeout=120) as http:
                return http.post(srv.url + "/v1/chat/completions", json=body)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(post, range(8)))
    codes = sorted(r.status_code for r in answers)
    assert set(codes) <= {200, 429} and codes.count(200) >= 2, codes
    image_full = [r for r in answers if r.status_code == 429
                  and r.json()["error"]["message"] == "the image decode queue is full"]
    assert image_full, [r.text for r in answers]
    for r in image_full:  # docs/http.md: the image queue's 429 says when to retry, as the request queue's does
        assert 1 <= int(r.headers["Retry-After"]) <= 60 and int(r.headers["retry-after-ms"]) >= 1, r.headers


def test_image_requests_leave_no_threads_behind(client, server):
    """The process's threads after image requests are the ones before them: a decode slot's
    thread ends with its request, and no tensor work runs on the main thread. A thread left
    holding an OpenMP team slowed every later decode step (caldrix/vision/limiter.py)."""
    import os
    import time

    def threads() -> dict[int, str]:
        # Trio's cached workers are left out: a large body is parsed on one (routes/prompt_ids.py,
        # JSON only, no tensor work), and trio keeps an idle worker 10 s, so whether one is there
        # depends on how long ago the last large body came (this test failed in CI on that).
        found = {}
        for t in os.listdir(f"/proc/{server.proc.pid}/task"):
            try:
                with open(f"/proc/{server.proc.pid}/task/{t}/comm") as f:
                    name = f.read().strip()
            except FileNotFoundError:
                continue  # it ended while listed
            if not name.startswith(("Trio thread", "trio.to_thread")):
                found[int(t)] = name
        return found

    if not os.path.isdir(f"/proc/{server.proc.pid}/task"):
        pytest.skip("no /proc here")
    chat(client, [{"role": "user", "content": "Say it."}])  # the step thread's team, if any, exists
    before = threads()
    big = image_part(url("image/png", encoded("PNG", 640, 480, 21)), "high")
    chat(client, ask([big, image_part(url("image/png", encoded("PNG", 48, 48, 22)), "low")], "Both."))
    deadline = time.monotonic() + 5
    while threads() != before and time.monotonic() < deadline:
        time.sleep(0.05)  # a slot's thread may still be on its way out
    assert threads() == before


def test_systemone_on_a_vision_model_reads_the_question(server, tiny):
    """/v1/systemone on a vision model: Idefics3's template writes content parts only, so the
    question goes to it as one text part, as chat's messages do. Handed a plain string, the
    template wrote an empty user turn, and every answer was the same whatever the state."""
    ref, tok, _ = tiny
    question = {"type": "noul", "instructions": "Is the customer angry?"}
    answers = []
    for state in ("I was charged twice.", "The parcel came early and the support team was lovely. " * 3):
        r = httpx.post(server.url + "/v1/systemone", timeout=120,
                       json={"model": "m", "state": state, "questions": {"angry": question}})
        assert r.status_code == 200, r.text
        message = f"State:\n{state}\n\nQuestion:\nIs the customer angry?\n\nReply with Yes or No and nothing else."
        ids = tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": message}]}],
                                      tokenize=True, add_generation_prompt=True, return_dict=False)
        labels = [tok("Yes", add_special_tokens=False)["input_ids"][0], tok("No", add_special_tokens=False)["input_ids"][0]]
        with torch.inference_mode():
            want = torch.softmax(ref(input_ids=torch.tensor([ids])).logits[0, -1, labels].float(), 0)[0].item()
        got = r.json()
        assert got["usage"]["input_tokens"] == len(ids)
        assert abs(got["answers"]["angry"]["noul"] - want) < 1e-5
        answers.append(got["answers"]["angry"]["noul"])
    assert answers[0] != answers[1]
