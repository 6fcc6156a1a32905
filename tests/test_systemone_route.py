"""The /v1/systemone route in process, against a scripted scheduler: what it submits, and how it
answers a full queue between questions, a stopped engine, a failed step and a reading that is
not finite. (The real scheduler and engine: tests/test_systemone_http.py.)"""

from __future__ import annotations

import math

import attrs
import pytest
import trio

from caldrix.app import create_app
from caldrix.request_queue import RequestQueue
from caldrix.protocol import FinishReason, TokenEvent
from caldrix.telemetry import Telemetry
from caldrix.tokenizer import Tokenizer

BODY = {"model": "m", "state": {"order": 17, "total": 1.50},
        "questions": {"team": {"type": "choice", "criteria": {"billing": None, "shipping": ["x", 1e-05]}},
                      "angry": {"type": "noul", "instructions": "Is the customer angry?"},
                      "urgency": {"type": "score", "criteria": ["low", {"level": 2.0}]}}}


@attrs.define
class FakeScheduler:
    failed: bool = False

    def statistics(self, queued):  # for /metrics; unused here
        raise NotImplementedError


@attrs.define
class FakeRuntime:
    tokenizer: Tokenizer
    telemetry: Telemetry = attrs.Factory(lambda: Telemetry.create("m", 16))
    served_name: str = "m"
    vocab_size: int = 49152
    context: int = 2048
    cfg: object = attrs.Factory(lambda: attrs.make_class("Cfg", {"max_batch": attrs.field(default=1)})())
    scheduler: FakeScheduler = attrs.Factory(FakeScheduler)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return Tokenizer.load(smollm2_dir)


def run(tokenizer, script: list[str], body=BODY):
    """POST body to an app whose scheduler answers each submission by the next word of
    `script`: "read" (logits 0, 1, 2, ...), "nan", "error", "full" (stops taking submissions,
    so the next one finds the queue full), "stopped" (closes the queue). Returns (status, json,
    the submissions seen)."""
    rt = FakeRuntime(tokenizer)
    seen = []

    async def main():
        queue, rx = RequestQueue.open(0)  # a rendezvous: full whenever the scheduler is not receiving
        app = create_app(rt, queue)

        async def scheduler():
            for step in script:
                if step == "full":
                    await trio.sleep_forever()
                if step == "stopped":
                    await rx.aclose()
                    return
                sub = await rx.receive()
                seen.append(sub)
                if step == "error":
                    sub.events.send_nowait(TokenEvent(None, FinishReason.ERROR, error="boom"))
                else:
                    logits = [math.nan if step == "nan" else float(i) for i in range(len(sub.read_ids))]
                    sub.events.send_nowait(TokenEvent(None, FinishReason.STOP, read=tuple(logits)))
                sub.events.close()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(scheduler)
            async with app.test_app() as test_app:
                resp = await test_app.test_client().post("/v1/systemone", json=body)
                out = resp.status_code, await resp.get_json()
            nursery.cancel_scope.cancel()
        return out

    status, js = trio.run(main)
    return status, js, seen


def test_every_question_is_one_read_only_submission(tokenizer):
    status, js, seen = run(tokenizer, ["read"] * 3)
    assert status == 200, js
    assert list(js["answers"]) == ["team", "angry", "urgency"]
    assert [len(s.read_ids) for s in seen] == [2, 2, 2]
    assert all(s.is_read_only and s.reuse_prefix and s.max_tokens == 1 for s in seen)
    yes, no = (tokenizer.hf(w, add_special_tokens=False)["input_ids"][0] for w in ("Yes", "No"))
    assert seen[1].read_ids == (yes, no)
    assert js["usage"] == {"input_tokens": sum(len(s.prompt_ids) for s in seen), "output_tokens": 0}
    # Logits 0 and 1: p = softmax([0, 1]) in float32.
    assert js["answers"]["team"]["probabilities"]["shipping"] == pytest.approx(1 / (1 + math.exp(-1)), abs=1e-7)
    assert js["answers"]["urgency"]["legend"] == {"0": "low", "1": {"level": 2.0}}
    # Every prompt starts with the same tokens through the end of the state, so held rows serve them.
    head = tokenizer.hf.apply_chat_template([{"role": "user", "content": 'State:\n{"order":17,"total":1.5}'}],
                                            tokenize=False, add_generation_prompt=False)
    shared = tokenizer.hf(head.rsplit("<|im_end|>", 1)[0], add_special_tokens=False)["input_ids"]
    assert len(shared) > 20 and all(s.prompt_ids[: len(shared) - 1] == tuple(shared[:-1]) for s in seen)


def test_a_full_queue_between_questions_is_a_429_for_the_whole_request(tokenizer):
    status, js, seen = run(tokenizer, ["read", "full"])
    assert status == 429 and len(seen) == 1
    assert js == {"error": {"code": None, "message": "the request queue is full", "param": None,
                            "type": "rate_limit_error"}}


def test_a_stopped_engine_is_a_503(tokenizer):
    status, js, _ = run(tokenizer, ["read", "stopped"])
    assert status == 503 and js["error"]["message"] == "the engine is unavailable"


def test_a_failed_step_is_a_500(tokenizer):
    status, js, _ = run(tokenizer, ["read", "error"])
    assert status == 500 and js["error"]["message"] == "the engine failed during the request: boom"


def test_a_reading_that_is_not_finite_is_a_500(tokenizer):
    status, js, _ = run(tokenizer, ["read", "read", "nan"])
    assert status == 500
    assert js["error"]["message"] == ('the engine gave no usable reading for question "urgency": '
                                      "a probability is not a finite number")
