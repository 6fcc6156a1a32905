"""What a server holds to serve images, and a chat request's images turned into embedding spans.

Built once at start-up for a vision model (`VisionServing.load`): the image token ids looked up
in the model's tokenizer, the processor settings read from the model directory, and the one
server-wide DecodeLimiter. Per request, `embed_request` runs each image's decode, preprocessing
and vision-tower pass inside one limiter slot (one image at a time, in a worker thread) and
hands the features to the engine under one key per run of consecutive <image> rows.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any, Callable, TypeVar

import attrs
import torch

from caldrix.protocol import EmbedSpan
from caldrix.vision.images import DecodeFailure
from caldrix.vision.limiter import DecodeLimiter
from caldrix.vision.preprocess import ImageTokens, ProcessorSettings
from caldrix.vision.prompt import VisionPlan, image_runs, prepare_image

R = TypeVar("R")

_keys = itertools.count(1)  # embedding keys, unique in the process (the engine's table is shared)


def settings_from_dir(path: Path) -> ProcessorSettings:
    """The processor's settings as the model directory publishes them: preprocessor_config.json
    (size.longest_edge, max_image_size.longest_edge, rescale_factor, image_mean, image_std) and
    processor_config.json (image_seq_len); the tile size and tokens a tile from config.json
    where those files are absent."""
    path = Path(path)

    def read(name: str) -> dict[str, Any]:
        f = path / name
        return json.loads(f.read_text()) if f.is_file() else {}

    cfg, pre, proc = read("config.json"), read("preprocessor_config.json"), read("processor_config.json")
    vision = cfg.get("vision_config") or {}
    tile = int((pre.get("max_image_size") or {}).get("longest_edge") or vision.get("image_size", 512))
    per_side = tile // int(vision.get("patch_size", 16))
    seq = int(proc.get("image_seq_len") or per_side ** 2 // int(cfg.get("scale_factor", 4)) ** 2)
    base = ProcessorSettings()
    return ProcessorSettings(
        longest_edge=int((pre.get("size") or {}).get("longest_edge", 4 * tile)),
        tile=tile,
        image_seq_len=seq,
        rescale_factor=float(pre.get("rescale_factor", base.rescale_factor)),
        mean=tuple(pre.get("image_mean", base.mean)),
        std=tuple(pre.get("image_std", base.std)),
    )


@attrs.define(eq=False)
class VisionServing:
    tokens: ImageTokens
    settings: ProcessorSettings
    limiter: DecodeLimiter
    pixel_dtype: torch.dtype = torch.float32  # what the engine's tower takes (Engine.pixel_dtype)

    @classmethod
    def load(cls, path: Path, token_to_id: Callable[[str], int | None], queue_depth: int,
             pixel_dtype: torch.dtype | None = None) -> "VisionServing":
        """`pixel_dtype`: the engine's (Engine.pixel_dtype); None for float32."""
        return cls(ImageTokens.lookup(token_to_id), settings_from_dir(path), DecodeLimiter(queue_depth),
                   pixel_dtype or torch.float32)


class ImageFailed(Exception):
    """An image passed its header checks but could not be decoded: a 400 at `param`."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def slot_threads(running: int, cores: int) -> int:
    """The torch threads an image request's slot uses for its next call, given how many
    sequences the scheduler runs now: with none, every core (`cores`), for the shortest time to
    first token; beside running streams, one. One thread starts no OpenMP team, and a team
    anywhere in the process, once there are more team threads than cores, makes libgomp put
    every team's idle helpers to sleep at once (sched/threads.py), the decode steps' included:
    on 2 cores, 8 image requests beside a text stream took its inter-token latency from 25 to
    54 ms with two-thread slots, to 32 ms with one (both under SCHED_IDLE)."""
    return 1 if running else cores


def _on_threads(threads: int, fn: Callable[..., R], *args) -> R:
    # Always set: a thread's first parallel call takes torch's last set_num_threads from
    # whichever thread made it (an engine step's one-thread chunk, the slot before), not all cores.
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return fn(*args)


async def embed_request(vs: VisionServing, plan: VisionPlan, embed: Callable[[torch.Tensor], torch.Tensor],
                        put: Callable[[int, torch.Tensor], None], threads: Callable[[], int]) -> tuple[EmbedSpan, ...]:
    """The plan's images decoded, preprocessed and through the vision tower (`embed`: tiles ->
    feature rows, called one tile at a time), one image after another in a limiter slot; the
    features handed to the engine (`put(key, rows)`) and the spans that name them. `threads()`,
    asked before each call on the slot (slot_threads says why), gives the torch threads it
    runs on; when the answer changes the slot's thread is renewed, so a team started while the
    server was otherwise idle ends once text streams run (within a tile, about 0.15 s). One
    tile a call whatever the load, so an image's features never depend on it. Raises
    DecodeQueueFull (429) without waiting when the queue is full, ImageFailed (400) for an
    image that cannot be decoded."""
    feats: list[torch.Tensor] = []
    async with vs.limiter.slot() as slot:
        now: list[int] = [0]  # the thread count the slot's thread runs on (0: not started)

        async def call(fn: Callable[..., R], *args) -> R:
            want = threads()
            if want != now[0]:
                if now[0]:
                    slot.renew()
                now[0] = want
            return await slot.run(_on_threads, want, fn, *args)

        for part in plan.images:
            got = await call(prepare_image, part, vs.settings, vs.pixel_dtype)
            if isinstance(got, DecodeFailure):
                raise ImageFailed(got.message, got.param)
            tiles = [await call(embed, got.pixels[i:i + 1]) for i in range(got.pixels.shape[0])]
            feats.append(tiles[0] if len(tiles) == 1 else await call(torch.cat, tiles))
    # Views of each image's rows, no torch.cat: tensor work on the server's main thread would
    # start an OpenMP team there, which slows every later step (sched/threads.py says why).
    # A run of <image> rows never spans two images (the layout closes each with a marker).
    spans, image, used = [], 0, 0
    for start, count in image_runs(plan.prompt.image_rows):
        if image < len(feats) and used == feats[image].shape[0]:
            image, used = image + 1, 0
        if image == len(feats) or used + count > feats[image].shape[0]:
            raise AssertionError(f"{sum(f.shape[0] for f in feats)} feature rows for more <image> tokens")
        key = next(_keys)
        put(key, feats[image][used : used + count])
        spans.append(EmbedSpan(key, start, count))
        used += count
    if feats and (image != len(feats) - 1 or used != feats[-1].shape[0]):
        raise AssertionError(f"{sum(f.shape[0] for f in feats)} feature rows for fewer <image> tokens")
    return tuple(spans)
