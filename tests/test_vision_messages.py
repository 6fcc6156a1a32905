"""Chat bodies with image parts through routes/schemas.py's parser (the vision hook,
caldrix/vision/messages.py): order kept, each rule a 400 at its param, text models refuse."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from caldrix.protocol import SamplingParams
from caldrix.routes.errors import ApiError
from caldrix.routes.schemas import ModelLimits, parse_chat
from caldrix.vision.images import ImagePart
from caldrix.vision.messages import TextPart, VisionMessage

VISION = ModelLimits(served_name="smolvlm", vocab_size=49280, context=8192, has_chat_template=True, has_vision=True)
TEXT = ModelLimits(served_name="smolvlm", vocab_size=49280, context=8192, has_chat_template=True)


def url(fmt: str = "PNG", mime: str = "image/png", size=(20, 10)) -> str:
    buf = io.BytesIO()
    Image.new("RGB", size, (1, 2, 3)).save(buf, format=fmt)
    return f"data:{mime};base64,{base64.b64encode(buf.getvalue()).decode()}"


def img(u: str | None = None, **kw) -> dict:
    return {"type": "image_url", "image_url": {"url": u or url(), **kw}}


def chat(content, ctx=VISION, messages=None):
    body = {"model": "smolvlm", "messages": messages or [{"role": "user", "content": content}]}
    return parse_chat(body, ctx, SamplingParams())


def refused(content=None, ctx=VISION, messages=None) -> ApiError:
    with pytest.raises(ApiError) as e:
        chat(content, ctx, messages)
    assert e.value.status == 400
    return e.value


def test_parts_keep_their_order():
    req = chat([{"type": "text", "text": "a"}, img(detail="low"), {"type": "text", "text": "b"},
                img(url("WEBP", "image/webp"))])
    (m,) = req.messages
    assert isinstance(m, VisionMessage) and m.role == "user"
    assert [type(p) for p in m.parts] == [TextPart, ImagePart, TextPart, ImagePart]
    assert m.parts[1].detail == "low" and m.parts[3].mime == "image/webp"
    assert m.parts[1].where == "messages[0].content[1]"
    assert m.template_content() == [{"type": "text", "text": "a"}, {"type": "image"},
                                    {"type": "text", "text": "b"}, {"type": "image"}]
    assert m.content == "a\nb"


def test_text_parts_side_by_side_are_joined_with_a_newline():
    """http-api.md: a message's text parts are joined with a newline before the template, on a
    vision model too; an image between two text parts keeps them apart. Joined, the halves of a
    placeholder spell none."""
    req = chat([{"type": "text", "text": "Hello"}, {"type": "text", "text": "World"}, img(),
                {"type": "text", "text": "<ima"}, {"type": "text", "text": "ge>"}])
    (m,) = req.messages
    assert m.template_content() == [{"type": "text", "text": "Hello\nWorld"}, {"type": "image"},
                                    {"type": "text", "text": "<ima\nge>"}]


def test_text_model_refuses_image_parts():
    e = refused([{"type": "text", "text": "hi"}, img()], ctx=TEXT)
    assert (e.message, e.param) == ("this model takes text only", "messages[0].content[1]")


def test_placeholder_typed_into_text_is_refused_on_a_vision_model():
    e = refused([img(), {"type": "text", "text": "look <image> here"}])
    assert e.param == "messages[0].content[1]" and e.message.startswith("image placeholder count")


@pytest.mark.parametrize("part,needle", [
    (img("https://example.com/a.png"), "remote image URLs are refused"),
    (img(url("GIF", "image/gif")), "image/gif is not accepted"),
    (img(url("PNG", "image/jpeg")), "JPEG signature"),
    (img(detail="ultra"), "detail must be auto, high or low"),
    (img(url(size=(4097, 1))), "each side may be at most 4096 pixels"),
])
def test_each_rule_is_a_400_at_the_part(part, needle):
    e = refused([{"type": "text", "text": "x"}, part])
    assert e.param == "messages[0].content[1]" and needle in e.message


def test_nine_images_are_refused_before_any_is_read(monkeypatch):
    import caldrix.vision.messages as vm
    monkeypatch.setattr(vm, "read_image_part", lambda *a: pytest.fail("a part was read"))
    msgs = [{"role": "user", "content": [img("not even a url")] * 5},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": [img("x")] * 4}]
    e = refused(messages=msgs)
    assert (e.message, e.param) == ("a request may hold at most 8 images, got 9", "messages")


def test_eight_images_across_messages_are_accepted():
    msgs = [{"role": "user", "content": [img()] * 5}, {"role": "assistant", "content": "ok"},
            {"role": "user", "content": [img()] * 3 + [{"type": "text", "text": "and?"}]}]
    req = chat(None, messages=msgs)
    assert sum(len(m.images) for m in req.messages if isinstance(m, VisionMessage)) == 8


def test_other_part_types_are_still_refused():
    e = refused([{"type": "input_audio", "input_audio": {}}])
    assert e.param == "messages[0].content[0]"
