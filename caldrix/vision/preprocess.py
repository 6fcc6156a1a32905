"""SmolVLM-256M's image preprocessing and prompt layout, as its Hugging Face processor does them.

The model was trained on what transformers' Idefics3 processor (the PIL one,
Idefics3ImageProcessorPil; transformers 5 falls back to it without torchvision) makes of an
image, so this reproduces it step for step, to the bit (tests/test_vision_preprocess.py):

1. RGB: an image with an alpha band or a transparency key is laid over white; every other mode
   (palette, greyscale, CMYK, 16-bit) goes through Pillow's convert("RGB").
2. Resize so the longest edge is `longest_edge` (2048), up or down, the other edge rounded to
   even, with Lanczos; never past 4096 on a side.
3. detail absent, "auto" or "high": resize again so both sides are multiples of the tile (512),
   then cut row-major tiles of 512 x 512 and add the whole image squeezed to 512 x 512 (the
   global image) last. An image that fits one tile is that tile alone, with no grid.
   detail "low": the image of step 2 squeezed to one 512 x 512 tile, no grid.
4. Rescale by 1/255 and normalise with mean 0.5, std 0.5, in the processor's float order
   (float64 multiply, float32 result, float32 normalise), done here as a 256-entry table.

The prompt: each <image> placeholder of the rendered chat template becomes, for a grid of R x C
tiles, for each row: C times <fake_token_around_image> <row_r_col_c> and image_seq_len <image>
tokens, then "\\n"; then "\\n", <fake_token_around_image> <global-img>, image_seq_len <image>,
<fake_token_around_image>. Without a grid, only the global part (without the newline).

Where the settings come from (`SMOLVLM_256M`): HuggingFaceTB/SmolVLM-256M-Instruct's
preprocessor_config.json (Idefics3ImageProcessor: size.longest_edge 2048, max_image_size.
longest_edge 512, resample 1 = Lanczos, rescale_factor 1/255, image_mean and image_std 0.5,
do_image_splitting and do_pad true), as quoted in John Snow Labs' spark-nlp
(src/main/scala/com/johnsnowlabs/ml/ai/SmolVLM.scala, the comment at its top), and its
processor_config.json (image_seq_len 64). The model card agrees ("64 visual tokens to encode
image patches of size 512x512"), and so does the model's config.json: SigLIP image_size 512,
patch_size 16, scale_factor 4, so (512 / 16)^2 / 4^2 = 64 tokens a tile.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import attrs
import numpy as np
import torch
from PIL import Image

from caldrix.vision.resize import lanczos, resize_array, kernel_resizes

UPPER_BOUND = 4096  # the processor's MAX_IMAGE_SIZE: no side past it after the first resize
IMAGE_PLACEHOLDER = "<image>"


@attrs.frozen
class ProcessorSettings:
    """The processor's settings that change its output (see the module docstring)."""

    longest_edge: int = 2048  # preprocessor_config size.longest_edge
    tile: int = 512  # preprocessor_config max_image_size.longest_edge = the vision tower's image_size
    image_seq_len: int = 64  # processor_config: <image> tokens per tile
    rescale_factor: float = 0.00392156862745098  # 1/255
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)


SMOLVLM_256M = ProcessorSettings()


@attrs.frozen
class ImageTokens:
    """The token ids of the image layout, looked up in the model's tokenizer once.

    `row_col[r][c]` is <row_{r+1}_col_{c+1}> (the tokenizer has 6 x 6 of them)."""

    fake: int  # <fake_token_around_image>
    image: int  # <image>
    global_img: int  # <global-img>
    row_col: tuple[tuple[int, ...], ...]

    @classmethod
    def lookup(cls, token_to_id: Callable[[str], int | None]) -> "ImageTokens":
        def need(name: str) -> int:
            tid = token_to_id(name)
            if tid is None:
                raise ValueError(f"the tokenizer has no {name} token; this is not an Idefics3 tokenizer")
            return tid

        return cls(fake=need("<fake_token_around_image>"), image=need("<image>"), global_img=need("<global-img>"),
                   row_col=tuple(tuple(need(f"<row_{r + 1}_col_{c + 1}>") for c in range(6)) for r in range(6)))


@attrs.frozen
class Grid:
    """How an image is cut: `rows` x `cols` tiles plus the global image, or (0, 0) for the
    global image alone. `tiles` counts every tile the vision tower sees."""

    rows: int
    cols: int

    @property
    def tiles(self) -> int:
        return self.rows * self.cols + 1


@attrs.frozen(eq=False)
class Prepared:
    """One image ready for the vision tower: `pixels` [tiles, 3, tile, tile], the grid tiles
    in row-major order then the global image; float32 (the processor's values) or bfloat16
    (those rounded once, what a bfloat16 tower casts them to), as preprocess() was asked."""

    grid: Grid
    pixels: torch.Tensor


# ---------------------------------------------------------------------------------------------
# Sizes: the processor's arithmetic, the same float expressions so the same integers come out.


def _to_longest_edge(height: int, width: int, longest: int) -> tuple[int, int]:
    ratio = width / height
    if width >= height:
        width = longest
        height = int(width / ratio)
        height += height % 2  # the processor rounds the short side up to even
    else:
        height = longest
        width = int(height * ratio)
        width += width % 2
    return max(height, 1), max(width, 1)


def _below_upper_bound(height: int, width: int, bound: int = UPPER_BOUND) -> tuple[int, int]:
    ratio = width / height
    if width >= height and width > bound:
        width = bound
        height = int(width / ratio)
    elif height > width and height > bound:
        height = bound
        width = int(height * ratio)
    return max(height, 1), max(width, 1)


def _tile_multiples(height: int, width: int, tile: int) -> tuple[int, int]:
    ratio = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / ratio) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * ratio) / tile) * tile
    return height, width


def resized_size(width: int, height: int, s: ProcessorSettings = SMOLVLM_256M) -> tuple[int, int]:
    """(height, width) after step 2."""
    return _below_upper_bound(*_to_longest_edge(height, width, s.longest_edge))


def grid_for(width: int, height: int, detail: str, s: ProcessorSettings = SMOLVLM_256M) -> Grid:
    """The tiling of an image of this size: from the header alone, before any decoding, so a
    prompt's length is known before its images are paid for."""
    if detail == "low":
        return Grid(0, 0)
    h, w = _tile_multiples(*resized_size(width, height, s), s.tile)
    if h > s.tile or w > s.tile:
        return Grid(h // s.tile, w // s.tile)
    return Grid(0, 0)


# ---------------------------------------------------------------------------------------------
# Pixels


def to_rgb(im: Image.Image) -> Image.Image:
    """Step 1: an RGB image; transparency is laid over white, as the processor does."""
    if "A" in im.getbands() or im.info.get("transparency") is not None:
        rgba = im.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return im.convert("RGB")


def _normalise_table(s: ProcessorSettings) -> np.ndarray:
    """[3, 256] float32: channel c's value for each byte, computed in the processor's order
    (byte * factor in float64, cast to float32, then (x - mean) / std in float32)."""
    scaled = (np.arange(256, dtype=np.float64) * s.rescale_factor).astype(np.float32)
    mean, std = np.array(s.mean, dtype=np.float32), np.array(s.std, dtype=np.float32)
    return np.stack([(scaled - mean[c]) / std[c] for c in range(3)])


_TABLES: dict[tuple[ProcessorSettings, torch.dtype], np.ndarray] = {}


def _table(s: ProcessorSettings, dtype: torch.dtype) -> np.ndarray:
    """The normalise table in `dtype`'s bits: float32, or bfloat16's as int16 (numpy has no
    bfloat16; the lookup only moves bits)."""
    table = _TABLES.get((s, dtype))
    if table is None:
        table = _normalise_table(s)
        if dtype == torch.bfloat16:
            table = torch.from_numpy(table).to(torch.bfloat16).view(torch.int16).numpy()
        elif dtype != torch.float32:
            raise ValueError(f"pixels come as float32 or bfloat16, not {dtype}")
        _TABLES[(s, dtype)] = table
    return table


def preprocess(im: Image.Image, detail: str, s: ProcessorSettings = SMOLVLM_256M,
               dtype: torch.dtype = torch.float32, kernel: bool | None = None) -> Prepared:
    """An image as the vision tower's input, its pixels in `dtype` (float32 or bfloat16).
    `detail` is "auto", "high" or "low". The resizes and the normalisation run on the compiled
    kernels where they were built (kernel None: whether resize.kernel_resizes(); False: Pillow's
    resize and numpy's lookups), the same values either way."""
    rgb = to_rgb(im)
    if kernel is None:
        kernel = kernel_resizes()
    # Each resizer keeps its own kind from step to step: the kernel arrays (writable, as torch
    # wants them), Pillow images.
    img: Image.Image | np.ndarray = np.array(rgb) if kernel else rgb
    resize: Callable = resize_array if kernel else lanczos
    height, width = resized_size(rgb.width, rgb.height, s)
    img = resize(img, (width, height))
    if detail == "low":
        frames, grid = [resize(img, (s.tile, s.tile))], Grid(0, 0)
    else:
        height, width = _tile_multiples(height, width, s.tile)
        img = resize(img, (width, height))
        if height > s.tile or width > s.tile:
            grid = Grid(height // s.tile, width // s.tile)
            whole = np.asarray(img)
            frames = [whole[r * s.tile:(r + 1) * s.tile, c * s.tile:(c + 1) * s.tile]
                      for r in range(grid.rows) for c in range(grid.cols)]
            frames.append(resize(img, (s.tile, s.tile)))
        else:
            frames, grid = [img], Grid(0, 0)
    table = _table(s, dtype)
    raw = np.stack([np.asarray(f) for f in frames])  # [N, T, T, 3] uint8
    if kernel:  # the same lookups on two threads (kernels/resample.cpp): 24 -> 4 ms for 13 tiles
        pixels = torch.ops.caldrix.normalise_pixels(torch.from_numpy(raw), torch.from_numpy(table)).view(dtype)
        return Prepared(grid=grid, pixels=pixels)
    # torch's memory, not numpy's: numpy asks Linux for huge pages on arrays this big, and the
    # compaction behind that stalled the 40 MB of a high-detail image's pixels 0.15-0.3 s in
    # two of three requests on this project's machine (0.1 s without it). Fresh pages from
    # torch's allocator have stalled there too at other times (docs/vision.md, "Speed").
    pixels = torch.empty((raw.shape[0], 3, *raw.shape[1:3]), dtype=dtype)
    out = pixels.numpy() if dtype == torch.float32 else pixels.view(torch.int16).numpy()
    for c in range(3):  # numpy indexes by the bytes themselves: a third faster than torch's int64 indices
        np.take(table[c], raw[..., c], out=out[:, c])
    return Prepared(grid=grid, pixels=pixels)


# ---------------------------------------------------------------------------------------------
# The prompt


def expansion_ids(grid: Grid, tokens: ImageTokens, encode: Callable[[str], list[int]],
                  s: ProcessorSettings = SMOLVLM_256M) -> list[int]:
    """The ids one <image> placeholder becomes. `encode` tokenizes plain text (no special
    tokens added): the newlines between tiles are text. The layout begins and ends with a
    special token, so the text around it tokenizes on its own, as the tokenizer splits there."""
    tile = [tokens.image] * s.image_seq_len
    out: list[int] = []
    for r in range(grid.rows):
        for c in range(grid.cols):
            out += [tokens.fake, tokens.row_col[r][c], *tile]
        # The last row's newline and the one before the global image are one text run.
        out += encode("\n\n" if r == grid.rows - 1 else "\n")
    out += [tokens.fake, tokens.global_img, *tile, tokens.fake]
    return out


@attrs.frozen
class ImagePrompt:
    """A prompt with its images laid out: `ids`, and for each image the position of its first
    <image> token row-major, in `image_rows` (every position whose id is the <image> token,
    in order: where the connector's output goes)."""

    ids: tuple[int, ...]
    image_rows: tuple[int, ...]


def layout_prompt(text: str, grids: Sequence[Grid], tokens: ImageTokens, encode: Callable[[str], list[int]],
                  s: ProcessorSettings = SMOLVLM_256M) -> ImagePrompt:
    """The rendered chat template `text`, holding one <image> per grid, as token ids.

    `encode` tokenizes text with the tokenizer's special tokens recognised and none added.
    The count of placeholders must equal the count of grids (the caller built the text)."""
    pieces = text.split(IMAGE_PLACEHOLDER)
    if len(pieces) - 1 != len(grids):
        raise ValueError(f"the prompt holds {len(pieces) - 1} image placeholders for {len(grids)} images")
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if piece:
            ids += encode(piece)
        if i < len(grids):
            ids += expansion_ids(grids[i], tokens, encode, s)
    rows = tuple(i for i, t in enumerate(ids) if t == tokens.image)
    return ImagePrompt(ids=tuple(ids), image_rows=rows)


def image_token_count(grid: Grid, s: ProcessorSettings = SMOLVLM_256M) -> int:
    """The <image> tokens (the rows the connector fills) for one image."""
    return grid.tiles * s.image_seq_len
