"""Chat messages with image parts, for a model with a vision tower.

routes/schemas.py parses every message; on a vision model it hands a message whose content is
an array of parts here (`vision_message`), and the count of image parts in the whole request
(`request_image_refusal`) before any part is read. Text parts are read by schemas' own rule
(passed in as `read_text`), so the text rules (the <image> placeholder refusal) stay in one
place.

As the model's chat template expects it: a string content is one text part, parts keep the
order they were sent in, and `template_content` gives the template's shape,
{"type": "text", "text": ...} and {"type": "image"} (the template writes its <image>
placeholder there, which caldrix/vision/preprocess.py's `layout_prompt` expands). Text parts
next to each other are joined with a newline first, as http-api.md joins a message's text parts
on every model (SmolVLM's own template would run them together); an image between two text parts
keeps them apart.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs

from caldrix.vision.images import ImagePart, ImageRefusal, check_image_count, count_image_parts, read_image_part


@attrs.frozen
class TextPart:
    text: str


@attrs.frozen
class VisionMessage:
    """A message of a vision request: `parts` in the order sent. `content` is its text parts
    joined with a newline, for whatever reads a message as text only (logs, counts)."""

    role: str
    parts: tuple[TextPart | ImagePart, ...]

    @property
    def content(self) -> str:
        return "\n".join(p.text for p in self.parts if isinstance(p, TextPart))

    @property
    def images(self) -> tuple[ImagePart, ...]:
        return tuple(p for p in self.parts if isinstance(p, ImagePart))

    def template_content(self) -> list[dict[str, str]]:
        return [{"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"}
                for p in self.parts]


def request_image_refusal(messages: Any) -> ImageRefusal | None:
    """The 8-images-a-request rule over the raw messages array, before any part is read."""
    return check_image_count(count_image_parts(messages))


def vision_message(role: str, content: list[Any], path: str,
                   read_text: Callable[[Any, str], str]) -> VisionMessage | ImageRefusal:
    """A message whose content is an array of parts. `path` is "messages[i].content";
    `read_text(part, where)` reads a part that is not an image part (and refuses a bad one)."""
    parts: list[TextPart | ImagePart] = []
    for j, part in enumerate(content):
        where = f"{path}[{j}]"
        if isinstance(part, dict) and part.get("type") == "image_url":
            got = read_image_part(part, where)
            if isinstance(got, ImageRefusal):
                return got
            parts.append(got)
        else:
            text = read_text(part, where)
            if parts and isinstance(parts[-1], TextPart):
                text = parts.pop().text + "\n" + text
            parts.append(TextPart(text))
    return VisionMessage(role=role, parts=tuple(parts))
