"""A vision request's prompt: the chat template over text and image parts, then the image layout.

Two steps, so the expensive one can be refused before it is paid for:
- `plan_prompt` renders the messages through the model's chat template (image parts as the
  template's {"type": "image"}, a string content as one text part), and lays out every image's
  tokens from its header size alone (caldrix/vision/preprocess.py `grid_for`): the prompt's ids
  and length are known before any image is decoded, so a prompt too long for the context is
  refused first.
- `prepare_image` decodes and preprocesses one of the plan's images, for the decode
  limiter (caldrix/vision/limiter.py) to run one at a time in its worker thread.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import attrs
import torch

from caldrix.vision.images import DecodeFailure, ImagePart, decode_image
from caldrix.vision.messages import VisionMessage
from caldrix.vision.preprocess import SMOLVLM_256M, ImagePrompt, ImageTokens, Prepared, ProcessorSettings, grid_for, layout_prompt, preprocess


@attrs.frozen
class VisionPlan:
    """A prompt with its images laid out but not decoded: `prompt.ids` (every <image> token
    counted), `prompt.image_rows`, and the `images` in prompt order."""

    prompt: ImagePrompt
    images: tuple[ImagePart, ...]


def template_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """The conversation in the shape Idefics3's template reads: content always a list of parts."""
    out = []
    for m in messages:
        if isinstance(m, VisionMessage):
            out.append({"role": m.role, "content": m.template_content()})
        else:  # a ChatMessage, or any record with a string content: one text part
            out.append({"role": m.role, "content": [{"type": "text", "text": m.content}]})
    return out


def plan_prompt(render: Callable[[list[dict[str, Any]]], str], encode: Callable[[str], list[int]],
                messages: Sequence[Any], tokens: ImageTokens, s: ProcessorSettings = SMOLVLM_256M) -> VisionPlan:
    """`render(conversation)` is the chat template with the generation prompt, as text;
    `encode(text)` tokenizes with special tokens recognised and none added."""
    text = render(template_messages(messages))
    images = tuple(p for m in messages if isinstance(m, VisionMessage) for p in m.images)
    grids = [grid_for(p.width, p.height, p.detail, s) for p in images]
    return VisionPlan(prompt=layout_prompt(text, grids, tokens, encode, s), images=images)


def prepare_image(part: ImagePart, s: ProcessorSettings = SMOLVLM_256M,
                  dtype: torch.dtype = torch.float32) -> Prepared | DecodeFailure:
    """Decode and preprocess one image, its pixels in `dtype` (CPU work: run it in the
    limiter's thread)."""
    im = decode_image(part)
    if isinstance(im, DecodeFailure):
        return im
    return preprocess(im, part.detail, s, dtype)


def image_runs(image_rows: Sequence[int]) -> list[tuple[int, int]]:
    """The prompt's <image> rows as (start, count) runs of consecutive positions, in order (one a
    tile: markers stand between tiles). Run k takes the next `count` feature rows, so each is
    one embedding span (protocol.EmbedSpan) over its own slice of the features."""
    runs: list[tuple[int, int]] = []
    for r in image_rows:
        if runs and runs[-1][0] + runs[-1][1] == r:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((r, 1))
    return runs
