"""Pillow's Lanczos resize of RGB images, as SmolVLM's processor makes it, faster and to the byte.

Two ways, the same bytes: the compiled kernel (kernels/resample.cpp, caldrix::lanczos_rgb,
where it was built and agrees with the installed Pillow: `kernel_resizes`), or Pillow's own
resize with the halves of the longer side on two threads where that computes the same pixels
(`lanczos`). vision/preprocess.py picks one per image.
"""

from __future__ import annotations

import functools
import logging
import threading
from fractions import Fraction

import numpy as np
import torch
from PIL import Image

from caldrix.kernels import native

log = logging.getLogger("caldrix.vision")

SPLIT_AREA = 1 << 18  # output pixels from which a resize is worth a second thread


def _horizontal_first(w_in: int, h_in: int, w_out: int, h_out: int) -> bool:
    """Pillow's choice of pass order (libImaging/Resample.c, ImagingResampleInner): the rows
    first unless the height shrinks by more than twice what the width does. The passes round
    to 8 bits between them, so the order changes the bytes."""
    return not (h_in - h_out > 0 and h_in - h_out > (w_in - w_out) * 2)


def lanczos(im: Image.Image, size: tuple[int, int]) -> Image.Image:
    """im.resize(size, LANCZOS), bit for bit, the halves of the longer output side computed on
    two threads (Pillow lets go of the GIL while it resamples) where that gives the same bits.

    A half is Pillow's resize of a box of the image. It computes the same pixels as the whole
    call when (1) its filters are the same: Pillow derives them from scale = (x1 - x0) / columns
    and centre = x0 + (i + 0.5) scale, in doubles from a float32 box, which are exact, and so
    equal, when scale = in / out is a dyadic rational (a power-of-two denominator); and (2) it
    runs its two passes in the same order (`_horizontal_first`). Every resize preprocess()
    makes meets both (its outputs are 2048 on the long edge, or multiples of 512); anything
    else, or a small image, is one plain call. Blocks until both halves are done."""
    w_out, h_out = size
    wide = w_out >= h_out
    n_in, n_out = (im.width, w_out) if wide else (im.height, h_out)
    scale = Fraction(n_in, n_out)
    mid = n_out // 2
    if wide:
        sizes = [(mid, h_out), (w_out - mid, h_out)]
    else:
        sizes = [(w_out, mid), (w_out, h_out - mid)]
    order = _horizontal_first(*im.size, *size)
    if (w_out * h_out < SPLIT_AREA or im.size == size or scale.denominator & (scale.denominator - 1)
            or any(_horizontal_first(*im.size, *part) != order for part in sizes)):
        return im.resize(size, Image.LANCZOS)
    cut = float(mid * scale)  # dyadic, a few bits: exact in the box's float32
    if wide:
        boxes = [(0, 0, cut, im.height), (cut, 0, im.width, im.height)]
    else:
        boxes = [(0, 0, im.width, cut), (0, cut, im.width, im.height)]
    parts = list(zip(boxes, sizes))
    halves: list[Image.Image | BaseException | None] = [None, None]

    def run(i: int) -> None:
        box, part = parts[i]
        try:
            halves[i] = im.resize(part, Image.LANCZOS, box=box)
        except BaseException as exc:  # noqa: BLE001 -- raised again on the calling thread
            halves[i] = exc

    other = threading.Thread(target=run, args=(1,), name="caldrix lanczos", daemon=True)
    other.start()
    run(0)
    other.join()
    for half in halves:
        if isinstance(half, BaseException):
            raise half
    out = Image.new(im.mode, size)
    out.paste(halves[0], (0, 0))
    out.paste(halves[1], (mid, 0) if wide else (0, mid))
    return out


def resize_array(a: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """A uint8 [H, W, 3] array Lanczos-resized to size (width, height) by the compiled kernel
    (kernels/resample.cpp: Pillow's bytes, 4-5x faster than `lanczos` on this project's
    2-core machine), or by Pillow where the kernel takes no such image (under 2 pixels wide)."""
    (h, w), (w_out, h_out) = a.shape[:2], size
    if (w, h) == size:
        return a
    if w < 2:
        return np.array(Image.fromarray(a).resize(size, Image.LANCZOS))  # writable, for the next resize
    return torch.ops.caldrix.lanczos_rgb(torch.from_numpy(a), w_out, h_out,
                                         _horizontal_first(w, h, w_out, h_out)).numpy()


@functools.cache
def kernel_resizes() -> bool:
    """Whether preprocess() resizes with the compiled kernel: it was built for this CPU, and
    on a few small images, both pass orders, up and down, it gave the installed Pillow's bytes
    (a Pillow whose resampler's arithmetic changed would keep its own). Checked once a process."""
    if not native.has_lanczos_rgb():
        return False
    rng = np.random.default_rng(0)
    for w, h, size in ((37, 23, (101, 61)), (37, 23, (13, 9)), (40, 90, (38, 20)), (90, 40, (91, 120))):
        a = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        if not np.array_equal(resize_array(a, size), np.asarray(Image.fromarray(a, "RGB").resize(size, Image.LANCZOS))):
            log.warning("image resizes: Pillow's (caldrix::lanczos_rgb did not give Pillow %s's bytes)",
                        Image.__version__)
            return False
    return True
