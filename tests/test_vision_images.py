"""The image part rules of http-api.md (caldrix/vision/images.py), on real PNG, JPEG and WebP bytes."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from caldrix.vision import images
from caldrix.vision.images import ImagePart, ImageRefusal, check_image_count, count_image_parts, decode_image, read_image_part

WHERE = "messages[0].content[1]"


def encode(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format=fmt, **kw)
    return buf.getvalue()


def part(url: str, detail=None, **extra) -> dict:
    image_url = {"url": url, **extra}
    if detail is not None:
        image_url["detail"] = detail
    return {"type": "image_url", "image_url": image_url}


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def refusal(result) -> ImageRefusal:
    assert isinstance(result, ImageRefusal), result
    assert result.param == WHERE
    return result


SAMPLE = Image.new("RGB", (37, 21), (200, 30, 90))


@pytest.mark.parametrize("fmt,mime", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("JPEG", "image/jpg"),
                                      ("WEBP", "image/webp"), ("PNG", "IMAGE/PNG")])
def test_accepted_types_read_the_header(fmt, mime):
    data = encode(SAMPLE, fmt)
    got = read_image_part(part(data_url(data, mime)), WHERE)
    assert isinstance(got, ImagePart), got
    assert (got.width, got.height) == (37, 21)
    assert got.data == data
    assert got.mime == {"image/jpg": "image/jpeg", "IMAGE/PNG": "image/png"}.get(mime, mime)
    assert got.detail == "auto"
    im = decode_image(got)
    assert isinstance(im, Image.Image) and im.size == (37, 21)


@pytest.mark.parametrize("detail", ["auto", "high", "low"])
def test_detail_values(detail):
    got = read_image_part(part(data_url(encode(SAMPLE, "PNG"), "image/png"), detail), WHERE)
    assert isinstance(got, ImagePart) and got.detail == detail


@pytest.mark.parametrize("detail", ["medium", "HIGH", "", 1, True, ["low"]])
def test_other_detail_is_refused(detail):
    r = refusal(read_image_part(part(data_url(encode(SAMPLE, "PNG"), "image/png"), detail), WHERE))
    assert r.message.startswith("detail must be auto, high or low, got ")


def test_gif_is_refused_by_type_and_by_signature():
    gif = encode(SAMPLE, "GIF")
    r = refusal(read_image_part(part(data_url(gif, "image/gif")), WHERE))
    assert "image/gif is not accepted" in r.message
    r = refusal(read_image_part(part(data_url(gif, "image/png")), WHERE))
    assert r.message == ("the image is named image/png but its bytes do not start with the PNG signature "
                         "(GIF data)")


@pytest.mark.parametrize("named,actual", [("image/png", "JPEG"), ("image/jpeg", "PNG"), ("image/webp", "PNG"),
                                          ("image/png", "WEBP"), ("image/jpeg", "BMP")])
def test_bytes_must_carry_the_named_signature(named, actual):
    r = refusal(read_image_part(part(data_url(encode(SAMPLE, actual), named)), WHERE))
    assert "do not start with the" in r.message


@pytest.mark.parametrize("url", ["https://example.com/cat.png", "http://127.0.0.1/x.jpg", "file:///etc/passwd",
                                 "ftp://host/a.png", "HTTPS://EXAMPLE.COM/A.PNG"])
def test_remote_urls_are_refused_unfetched(url, monkeypatch):
    import socket
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: pytest.fail("a URL was fetched"))
    r = refusal(read_image_part(part(url), WHERE))
    assert r.message.startswith("remote image URLs are refused")


@pytest.mark.parametrize("url", ["data:image/png,abc", "data:image/png;charset=x,abc", "not a url",
                                 "data:;base64,AAAA", "data:text/plain;base64,aGk=", "data:image/svg+xml;base64,PHN2Zz4="])
def test_malformed_or_other_urls_are_refused(url):
    refusal(read_image_part(part(url), WHERE))


@pytest.mark.parametrize("bad", [None, "data:image/png;base64,AAAA", 3, []])
def test_image_url_must_be_an_object(bad):
    refusal(read_image_part({"type": "image_url", "image_url": bad}, WHERE))


@pytest.mark.parametrize("url", [None, "", 7])
def test_url_must_be_a_string(url):
    refusal(read_image_part({"type": "image_url", "image_url": {"url": url}}, WHERE))


def test_invalid_base64_is_refused():
    r = refusal(read_image_part(part("data:image/png;base64,iVBOR!!!"), WHERE))
    assert r.message == "the image data is not valid base64"


def test_wrapped_base64_is_read():
    b64 = base64.encodebytes(encode(SAMPLE, "PNG")).decode()  # 76-column lines
    assert "\n" in b64
    assert isinstance(read_image_part(part("data:image/png;base64," + b64), WHERE), ImagePart)


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims width x height, with one tiny IDAT: a bomb's header."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


@pytest.mark.parametrize("w,h", [(4097, 10), (10, 4097), (100000, 100000), (4097, 4097)])
def test_side_limit_read_from_the_header(w, h, monkeypatch):
    # Nothing may be decoded: load() of any image fails the test.
    monkeypatch.setattr(Image.Image, "load", lambda self: pytest.fail("pixels were decoded"))
    r = refusal(read_image_part(part(data_url(png_header_only(w, h), "image/png")), WHERE))
    assert r.message == f"the image is {w}x{h} pixels; each side may be at most 4096 pixels"


def jpeg_claiming(width: int, height: int) -> bytes:
    """A small JPEG whose frame header (SOF0) is rewritten to claim width x height."""
    data = bytearray(encode(Image.new("RGB", (16, 16)), "JPEG"))
    sof = data.index(b"\xff\xc0")
    data[sof + 5:sof + 7] = height.to_bytes(2, "big")
    data[sof + 7:sof + 9] = width.to_bytes(2, "big")
    return bytes(data)


def test_a_header_past_pillows_own_guard_is_refused_with_its_real_size(monkeypatch):
    # 7000 x 5000 is past twice 4096 x 4096 pixels, where Image.open raises before it gives a size.
    data = jpeg_claiming(7000, 5000)
    monkeypatch.setattr(Image.Image, "load", lambda self: pytest.fail("pixels were decoded"))
    r = refusal(read_image_part(part(data_url(data, "image/jpeg")), WHERE))
    assert r.message == "the image is 7000x5000 pixels; each side may be at most 4096 pixels"


def test_a_png_header_is_read_without_pillow(monkeypatch):
    """Pillow's PNG open inflates every text chunk before the pixels (a megabyte each, on the
    event loop); the size comes from IHDR alone."""
    monkeypatch.setattr(Image, "open", lambda *a, **k: pytest.fail("Pillow opened the PNG"))
    monkeypatch.setitem(Image.OPEN, "PNG", (lambda *a, **k: pytest.fail("Pillow read the PNG"), None))
    got = read_image_part(part(data_url(png_header_only(300, 20), "image/png")), WHERE)
    assert isinstance(got, ImagePart) and (got.width, got.height) == (300, 20)


def progressive_with_scans(extra: int) -> bytes:
    """A progressive JPEG whose last scan is repeated `extra` more times: valid, and each
    repeat costs a decoding pass over the whole image."""
    data = encode(Image.new("L", (64, 64), 128), "JPEG", progressive=True)
    sos = data.rindex(b"\xff\xda")
    eoi = data.rindex(b"\xff\xd9")
    return data[:eoi] + data[sos:eoi] * extra + data[eoi:]


def test_a_jpeg_with_too_many_scans_is_refused_before_decoding():
    ok = progressive_with_scans(0)
    scans = ok.count(b"\xff\xda")
    assert 1 < scans <= images.MAX_JPEG_SCANS
    got = read_image_part(part(data_url(ok, "image/jpeg")), WHERE)
    assert isinstance(got, ImagePart) and not isinstance(decode_image(got), images.DecodeFailure)
    bomb = progressive_with_scans(images.MAX_JPEG_SCANS + 1 - scans)
    Image.open(io.BytesIO(bomb)).load()  # still a valid JPEG: only the count refuses it
    r = refusal(read_image_part(part(data_url(bomb, "image/jpeg")), WHERE))
    assert r.message == f"the JPEG holds {images.MAX_JPEG_SCANS + 1} scans; this server decodes at most 100"


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("fmt, mime", [("JPEG", "image/jpeg"), ("WEBP", "image/webp")])
def test_exif_orientation_is_applied_as_transformers_load_image_applies_it(orientation, fmt, mime):
    from PIL import ImageOps
    from transformers.image_utils import load_image

    exif = Image.Exif()
    exif[images.EXIF_ORIENTATION] = orientation
    im = Image.effect_noise((48, 20), 60).convert("RGB")
    data = encode(im, fmt, exif=exif.tobytes(), quality=95)
    got = read_image_part(part(data_url(data, mime)), WHERE)
    want = load_image(data_url(data, mime))  # what the model's processor is given for this URL
    assert isinstance(got, ImagePart) and got.orientation == orientation
    assert (got.width, got.height) == want.size == ImageOps.exif_transpose(Image.open(io.BytesIO(data))).size
    decoded = decode_image(got)
    assert decoded.size == want.size and decoded.convert("RGB").tobytes() == want.convert("RGB").tobytes()


def test_side_limit_accepts_4096():
    got = read_image_part(part(data_url(png_header_only(4096, 3), "image/png")), WHERE)
    assert isinstance(got, ImagePart) and (got.width, got.height) == (4096, 3)


def test_a_bomb_never_reaches_memory():
    # A header within the limits whose pixels are fine is decoded; a header past the guard is
    # refused by Pillow itself even when something skips the side check.
    with pytest.raises(Image.DecompressionBombError):
        Image.open(io.BytesIO(png_header_only(9000, 9000)))
    assert Image.MAX_IMAGE_PIXELS == 4096 * 4096


def test_encoded_limit_checked_before_base64_decoding(monkeypatch):
    big = "A" * (((8 * 1024 * 1024) // 3 + 10) * 4)
    monkeypatch.setattr(base64, "b64decode", lambda *a, **k: pytest.fail("decoded base64 of an oversized image"))
    r = refusal(read_image_part(part("data:image/png;base64," + big), WHERE))
    assert "8 MiB (8388608 bytes)" in r.message


def test_encoded_limit_exactly():
    # 8 MiB of PNG: a valid header, then padding chunks that a reader skips.
    head = png_header_only(2, 2)
    pad_len = 8 * 1024 * 1024 - len(head)
    at_limit = head + b"\0" * pad_len
    over = at_limit + b"\0"
    ok = read_image_part(part(data_url(at_limit, "image/png")), WHERE)
    assert isinstance(ok, ImagePart), ok
    r = refusal(read_image_part(part(data_url(over, "image/png")), WHERE))
    assert r.message == "the image is 8388609 bytes encoded; an image may be at most 8 MiB (8388608 bytes)"


def test_truncated_image_fails_at_decode_not_at_header():
    data = encode(Image.effect_noise((300, 200), 40).convert("RGB"), "PNG")
    got = read_image_part(part(data_url(data[: len(data) // 2], "image/png")), WHERE)
    assert isinstance(got, ImagePart)
    failed = decode_image(got)
    assert isinstance(failed, images.DecodeFailure) and failed.param == WHERE


def test_count_limit():
    assert check_image_count(8) is None
    r = check_image_count(9)
    assert r == ImageRefusal("a request may hold at most 8 images, got 9", "messages")
    msgs = [{"role": "user", "content": [{"type": "image_url"}] * 5 + [{"type": "text", "text": "x"}]},
            {"role": "user", "content": "plain"}, {"role": "user", "content": [{"type": "image_url"}] * 4}]
    assert count_image_parts(msgs) == 9
    assert count_image_parts("nope") == 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.text(max_size=8), st.one_of(st.none(), st.text(max_size=40), st.integers()), max_size=4),
       st.one_of(st.none(), st.text(max_size=60), st.binary(max_size=64).map(lambda b: "data:image/png;base64," +
                                                                           base64.b64encode(b).decode())))
def test_any_part_gives_a_record_never_an_exception(extra, url):
    out = read_image_part({"type": "image_url", "image_url": {**extra, "url": url}}, WHERE)
    assert isinstance(out, (ImagePart, ImageRefusal))
    if isinstance(out, ImageRefusal):
        assert out.param == WHERE and out.message


def test_headers_are_read_in_a_process_that_has_opened_no_image(tmp_path):
    """Pillow registers its format readers on first use; the header read must not depend on an
    earlier Image.open in the process (a fresh server's first request is exactly that)."""
    import subprocess
    import sys

    for fmt in ("JPEG", "WEBP"):
        (tmp_path / fmt).write_bytes(encode(Image.new("RGB", (20, 10)), fmt))
    code = ("import sys; from caldrix.vision import images; "
            "print([images.read_header(open(sys.argv[1] + '/' + f, 'rb').read(), f) for f in ('JPEG', 'WEBP')])")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[(20, 10, 1), (20, 10, 1)]", out.stderr
