"""Image parts of a chat message: the rules of http-api.md, checked before anything is decoded.

Pure and synchronous. `read_image_part` takes one OpenAI content part of type "image_url" and
returns an `ImagePart` (the encoded bytes, their type, the pixel size read from the header, the
detail) or an `ImageRefusal` naming what is wrong and where; `decode_image` then turns a part
into pixels, under a decompression-bomb guard. No server code, no exceptions across the line:
the caller (routes/) turns a refusal into its 400.

The rules, in the order they are checked:
- the part holds {"image_url": {"url": ..., "detail": ...}}; detail is absent, auto, high or low;
- the URL is a base64 data URL of image/png, image/jpeg (image/jpg is the same) or image/webp;
  a remote URL (http, https, ftp, file, ...) is refused and never fetched; image/gif and every
  other type are refused;
- 8 MiB at most for the encoded image, checked from the base64 length before it is decoded;
- the bytes start with the named type's signature;
- the header gives at most 4096 pixels on each side: a PNG's IHDR chunk read directly (Pillow's
  open would inflate every compressed text chunk before it, a megabyte each, on the event loop),
  a JPEG's or WebP's by Pillow's lazy open, which reads no pixel data;
- a JPEG holds at most MAX_JPEG_SCANS scans: a progressive JPEG can repeat a tiny scan
  thousands of times, each a pass over the whole image, and held a decode slot for minutes.
An image's EXIF orientation (JPEG and WebP) is applied, as transformers' `load_image` applies it
to an image given by URL: width and height are the image as displayed, and the pixels are turned
to match when decoded.
The count (8 images a request) is `check_image_count`, for the caller to run over the whole
request before reading any part.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import warnings
from typing import Any

import attrs
from PIL import Image

MAX_IMAGES = 8  # a request
MAX_SIDE = 4096  # pixels, on each side
MAX_ENCODED_BYTES = 8 * 1024 * 1024  # the image file, after base64
MAX_JPEG_SCANS = 100  # progressive encoders write about 10; each scan decodes the whole image
EXIF_ORIENTATION = 0x0112
# EXIF orientation -> the transpose that shows the image upright (Pillow's ImageOps.exif_transpose)
_UPRIGHT = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
            5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
            8: Image.Transpose.ROTATE_90}
_QUARTER_TURNS = (5, 6, 7, 8)  # orientations displayed with the stored sides swapped
DETAILS = ("auto", "high", "low")

# Pillow checks every image it opens against MAX_IMAGE_PIXELS (a warning past it, an error past
# twice it). The header check below already refuses a side over 4096; this bound makes Pillow's
# own guard agree with it, so no image Pillow would allocate for can be larger than 4096 x 4096,
# whoever opens it in this process.
Image.MAX_IMAGE_PIXELS = MAX_SIDE * MAX_SIDE
# Between one and two times the bound Pillow only warns; such a header is refused by its side
# anyway, so the warning would only be noise in the server's log.
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)

# mime type as sent (lower-cased) -> (canonical mime, Pillow format, its name in messages)
_TYPES = {
    "image/png": ("image/png", "PNG", "PNG"),
    "image/jpeg": ("image/jpeg", "JPEG", "JPEG"),
    "image/jpg": ("image/jpeg", "JPEG", "JPEG"),
    "image/webp": ("image/webp", "WEBP", "WebP"),
}


@attrs.frozen
class ImageRefusal:
    """Why an image part is refused: `message` for the client, `param` the path at fault
    ("messages[0].content[1]", or "messages" for the count)."""

    message: str
    param: str


@attrs.frozen
class ImagePart:
    """An image part that passed every rule that can be checked without decoding it.

    `data` is the encoded file (PNG, JPEG or WebP bytes); `mime` its canonical type;
    `width` and `height` come from its header, as displayed (after its EXIF `orientation`, 1
    for none); `detail` is "auto", "high" or "low" (absent reads as "auto"). `where` is the
    part's path, for a refusal at decode time."""

    where: str
    mime: str
    data: bytes = attrs.field(repr=lambda d: f"<{len(d)} bytes>")
    width: int
    height: int
    detail: str
    orientation: int = 1


def check_image_count(count: int) -> ImageRefusal | None:
    """A refusal at "messages" when a request holds more images than a request may."""
    if count > MAX_IMAGES:
        return ImageRefusal(f"a request may hold at most {MAX_IMAGES} images, got {count}", "messages")
    return None


def count_image_parts(messages: Any) -> int:
    """How many content parts of type "image_url" a raw messages array holds (0 for anything
    malformed: the parser refuses that on its own, by its own rule)."""
    if not isinstance(messages, list):
        return 0
    n = 0
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            n += sum(1 for p in content if isinstance(p, dict) and p.get("type") == "image_url")
    return n


_DATA_URL = re.compile(r"data:([^,;]*)((?:;[^,;]*)*),", re.IGNORECASE)
_SCHEME = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*):")


def read_image_part(part: dict[str, Any], where: str) -> ImagePart | ImageRefusal:
    """One {"type": "image_url", ...} part as an `ImagePart`, or the first rule it breaks.

    Costs one base64 decode of at most 8 MiB and a header read; no pixel is decoded."""
    image_url = part.get("image_url")
    if not isinstance(image_url, dict):
        return ImageRefusal('an image part needs "image_url" as an object {"url": ...}', where)
    detail = image_url.get("detail")
    if detail is None:
        detail = "auto"
    elif detail not in DETAILS:
        shown = f'"{_clip(detail)}"' if isinstance(detail, str) else "a " + type(detail).__name__
        return ImageRefusal(f"detail must be auto, high or low, got {shown}", where)
    url = image_url.get("url")
    if not isinstance(url, str) or not url:
        return ImageRefusal('an image part needs "image_url.url" as a non-empty string', where)

    found = _DATA_URL.match(url)
    if found is None:
        scheme = _SCHEME.match(url)
        if scheme and scheme.group(1).lower() in ("http", "https", "ftp", "ftps", "file", "s3", "gs"):
            return ImageRefusal(
                f"remote image URLs are refused ({scheme.group(1).lower()}:); this server never fetches a "
                "URL: send the image as a data URL, data:image/png;base64,...", where)
        return ImageRefusal("an image URL must be a data URL: data:image/png;base64,..., "
                            "data:image/jpeg;base64,... or data:image/webp;base64,...", where)
    mime = found.group(1).strip().lower()
    params = [p.strip().lower() for p in found.group(2).split(";")[1:]]
    if mime not in _TYPES:
        shown = mime or "no media type"
        return ImageRefusal(f"image type {_clip(shown)} is not accepted; send image/png, image/jpeg "
                            "or image/webp", where)
    if not params or params[-1] != "base64":
        return ImageRefusal("an image data URL must be base64: data:" + mime + ";base64,...", where)
    canonical, pil_format, name = _TYPES[mime]

    payload = url[found.end():]
    if any(c in payload for c in " \t\r\n"):  # some clients wrap base64 at 76 columns
        payload = re.sub(r"[ \t\r\n]+", "", payload)
    # Refuse before decoding: n base64 characters hold at least 3 * n / 4 - 2 bytes.
    if len(payload) * 3 // 4 - 2 > MAX_ENCODED_BYTES:
        return ImageRefusal(_too_big(len(payload) * 3 // 4 - 2, at_least=True), where)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        return ImageRefusal("the image data is not valid base64", where)
    if len(data) > MAX_ENCODED_BYTES:
        return ImageRefusal(_too_big(len(data)), where)
    if not data:
        return ImageRefusal("the image data is empty", where)

    actual = sniff(data)
    if actual != canonical:
        what = f"{_NAMES[actual]} data" if actual else "not an image this server reads"
        return ImageRefusal(f"the image is named {mime} but its bytes do not start with the {name} "
                            f"signature ({what})", where)
    header = read_header(data, pil_format)
    if header is None:
        return ImageRefusal(f"the {name} header cannot be read; the image is damaged or cut short", where)
    width, height, orientation = header
    if width > MAX_SIDE or height > MAX_SIDE:
        return ImageRefusal(f"the image is {width}x{height} pixels; each side may be at most "
                            f"{MAX_SIDE} pixels", where)
    if width < 1 or height < 1:
        return ImageRefusal(f"the image is {width}x{height} pixels; it holds no pixels", where)
    if pil_format == "JPEG":
        scans = data.count(b"\xff\xda")  # SOS markers: 0xFF in entropy-coded data is stuffed, never FF DA
        if scans > MAX_JPEG_SCANS:
            return ImageRefusal(f"the JPEG holds {scans} scans; this server decodes at most {MAX_JPEG_SCANS}", where)
    if orientation in _QUARTER_TURNS:
        width, height = height, width
    return ImagePart(where=where, mime=canonical, data=data, width=width, height=height, detail=detail,
                     orientation=orientation)


_NAMES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WebP", "image/gif": "GIF",
          "image/bmp": "BMP", "image/tiff": "TIFF", None: ""}


def sniff(data: bytes) -> str | None:
    """The media type a file's first bytes announce, or None for one of none of these."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    if data.startswith(b"BM"):
        return "image/bmp"
    if data[:4] in (b"II*\x00", b"MM\x00*"):
        return "image/tiff"
    return None


def read_header(data: bytes, pil_format: str) -> tuple[int, int, int] | None:
    """(width, height, EXIF orientation) as stored, from the header alone; None when it cannot
    be read. Only the named format's reader is tried, and no pixel is decoded."""
    if pil_format == "PNG":  # the signature, then IHDR first: length, type, width, height (big-endian)
        if len(data) < 24 or data[12:16] != b"IHDR":
            return None
        return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big"), 1
    if pil_format not in Image.OPEN:
        Image.init()  # Pillow registers its format readers on first use (Image.open does this)
    try:
        # The format's own reader, not Image.open: Image.open's decompression-bomb guard raises
        # for a header past twice 4096 x 4096 pixels, and the refusal names the real size.
        with Image.OPEN[pil_format][0](io.BytesIO(data), "") as im:
            orientation = im.getexif().get(EXIF_ORIENTATION, 1)
            return im.size[0], im.size[1], orientation if orientation in _UPRIGHT else 1
    except Exception:  # noqa: BLE001 - any reader failure means the header is unreadable
        return None


@attrs.frozen
class DecodeFailure:
    """A part whose header passed but whose pixels could not be read (a cut-short file)."""

    message: str
    param: str


def decode_image(part: ImagePart) -> Image.Image | DecodeFailure:
    """The part's first frame, fully loaded, in the file's own mode (preprocess converts it).

    The header was checked already, and Pillow's guard (MAX_IMAGE_PIXELS, set above) stands
    behind it: a file whose header promises more than 4096 x 4096 pixels never allocates them."""
    _, pil_format, name = _TYPES[part.mime]
    try:
        im = Image.open(io.BytesIO(part.data), formats=[pil_format])
        turned = part.orientation in _QUARTER_TURNS
        if im.size != ((part.height, part.width) if turned else (part.width, part.height)):
            return DecodeFailure(f"the {name} image changed size between reads", part.where)
        im.load()
        return im.transpose(_UPRIGHT[part.orientation]) if part.orientation in _UPRIGHT else im
    except Image.DecompressionBombError:
        return DecodeFailure(f"the image is larger than {MAX_SIDE}x{MAX_SIDE} pixels", part.where)
    except Exception as e:  # noqa: BLE001 - the client is told; the server goes on
        return DecodeFailure(f"the {name} image cannot be decoded: {_clip(str(e) or type(e).__name__)}",
                             part.where)


def _too_big(n: int, at_least: bool = False) -> str:
    return (f"the image is {'at least ' if at_least else ''}{n} bytes encoded; an image may be at most "
            f"8 MiB ({MAX_ENCODED_BYTES} bytes)")


def _clip(s: str, limit: int = 64) -> str:
    return s if len(s) <= limit else s[: limit - 1] + "…"
