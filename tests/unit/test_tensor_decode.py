"""The tensor decode path (the CPU twin of issue #18's GPU path): JPEGs by libjpeg-turbo with PIL's pixels (its
reduced scale, its EXIF turn), PIL for every other format and for JPEGs libjpeg-turbo refuses, the limits before any
pixel, and the tensor eval transform against PIL's."""
from __future__ import annotations

import io
import struct
from typing import Callable

import numpy as np
import pytest
import skimage.data
import torch
from PIL import Image, ImageOps

from app.config import Settings
from app.engine.decoding.device import check_header, stack_pixels
from app.engine.decoding.image import (DecodeLimits, decode_image, image_to_tensor, load_upright,
                                       open_checked)
from app.engine.decoding.tensor import decode_tensor, image_to_tensor_path
from app.errors import ImageTooLarge, InvalidImage, UnsupportedImageFormat
from harness.photos import jpeg as photo_jpeg
from harness.photos import photo
from models.data.jpeg import JpegHeader, decode_jpeg_cpu, draft_scale, read_jpeg_header
from models.presets import EvalPreset, TensorEvalTransform, eval_transform, lite0_preset, pil_to_tensor
from tests.support.imaging import BLUE, RED, encode, image_bytes

LIMITS = DecodeLimits(max_pixels=1_000_000, max_aspect_ratio=20, jpeg_draft_min_side=0)


def _mean_rgb(pixels: torch.Tensor) -> tuple[float, ...]:
    return tuple(pixels.float().mean(dim=(1, 2)).round().tolist())


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "BMP", "GIF"])
def test_each_format_decodes_to_an_rgb_uint8_tensor(fmt: str) -> None:
    pixels = decode_tensor(image_bytes(RED, fmt=fmt, size=(40, 30)), LIMITS)
    assert pixels.dtype == torch.uint8 and pixels.shape == (3, 30, 40)
    red, green, blue = _mean_rgb(pixels)
    assert red > 200 and green < 60 and blue < 60


@pytest.mark.parametrize("mode, color", [("L", 128), ("CMYK", (0, 255, 255, 0))])
def test_grey_and_cmyk_jpegs_become_pils_rgb(mode: str, color: object) -> None:
    data = image_bytes(color, mode=mode)  # type: ignore[arg-type]
    assert torch.equal(decode_tensor(data, LIMITS), pil_to_tensor(_pil_upright(data)))
    if mode == "CMYK":  # libjpeg's CMYK -> RGB is not PIL's: PIL decodes it
        with pytest.raises(ValueError):
            decode_jpeg_cpu(data, JpegHeader.of(Image.open(io.BytesIO(data))), 0)


def _pil_upright(data: bytes, min_side: int = 0) -> Image.Image:
    """What PIL's own route gives: the draft for ``min_side``, then exif_transpose and RGB."""
    image = Image.open(io.BytesIO(data))
    if min_side:
        image.draft("RGB", (min_side, min_side))
    return ImageOps.exif_transpose(image).convert("RGB")


def _decoded_fast(data: bytes, min_side: int = 0) -> torch.Tensor:
    """libjpeg-turbo's decode itself (a ValueError here would otherwise fall back to PIL and hide a difference)."""
    return decode_jpeg_cpu(data, JpegHeader.of(Image.open(io.BytesIO(data))), min_side)


def test_exif_orientation_is_applied_as_on_the_pil_path() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    data = encode(Image.new("RGB", (40, 20), RED), "JPEG", exif=exif.tobytes())
    assert decode_tensor(data, LIMITS).shape == (3, 40, 20)


@pytest.mark.parametrize("orientation", range(10))  # 0: no EXIF; 9: not an orientation, left as stored
def test_every_exif_orientation_gives_pils_pixels(orientation: int) -> None:
    exif = Image.Exif()
    if orientation:
        exif[0x0112] = orientation
    astronaut = Image.fromarray(np.asarray(skimage.data.astronaut())[:300, :200])  # not square: turns show
    data = encode(astronaut, "JPEG", quality=95, exif=exif.tobytes())
    assert torch.equal(_decoded_fast(data), pil_to_tensor(_pil_upright(data)))


@pytest.mark.parametrize("value", ["6", b"6", 6.5])
def test_an_orientation_that_is_not_an_exif_number_is_left_as_pil_leaves_it(value: object) -> None:
    data = encode(Image.new("RGB", (40, 20), RED), "JPEG")
    headers = [Image.open(io.BytesIO(data)) for _ in range(2)]
    for header in headers:
        header.getexif()[0x0112] = value  # as a broken or crafted EXIF block reads
    assert decode_jpeg_cpu(data, JpegHeader.of(headers[0]), 0).shape == (3, 20, 40)
    assert ImageOps.exif_transpose(headers[1]).size == (40, 20)


@pytest.mark.parametrize("size", [(4000, 3000), (1920, 1080), (2048, 2047), (512, 512), (9000, 300)])
@pytest.mark.parametrize("min_side", [1024, 512, 0])
def test_the_reduced_scale_is_pils_draft_scale(size: tuple[int, int], min_side: int) -> None:
    header = Image.open(io.BytesIO(encode(Image.new("RGB", size, RED), "JPEG")))
    scale = draft_scale(size, min_side)
    if min_side:
        header.draft("RGB", (min_side, min_side))
    assert header.size == (-(-size[0] // scale), -(-size[1] // scale))


@pytest.mark.parametrize("size, min_side, scale", [
    ((4000, 3000), 1024, 2), ((4000, 3000), 512, 4), ((4000, 3000), 256, 8), ((1920, 1080), 1024, 1),
    (None, 1024, 1)])
def test_photos_decode_to_pils_pixels_at_each_reduced_scale(size: tuple[int, int] | None, min_side: int,
                                                             scale: int) -> None:
    data = photo_jpeg(photo("coffee"), size)
    pixels = _decoded_fast(data, min_side)
    assert torch.equal(pixels, pil_to_tensor(_pil_upright(data, min_side)))
    width, height = Image.open(io.BytesIO(data)).size
    assert pixels.shape == (3, -(-height // scale), -(-width // scale))


def test_a_turned_photo_at_a_reduced_scale_gives_pils_pixels() -> None:
    exif = Image.Exif()
    exif[0x0112] = 8
    data = encode(photo("rocket").resize((2400, 1600)), "JPEG", quality=90, exif=exif.tobytes())
    pixels = _decoded_fast(data, 512)
    assert pixels.shape == (3, 1200, 800)  # half scale, turned
    assert torch.equal(pixels, pil_to_tensor(_pil_upright(data, 512)))


def test_the_default_setting_decodes_a_12_mp_photo_at_half_scale_on_the_served_path() -> None:
    limits = DecodeLimits(max_pixels=40_000_000, max_aspect_ratio=20,
                          jpeg_draft_min_side=Settings().jpeg_draft_min_side)
    data = photo_jpeg(photo("coffee"), (4000, 3000))
    pixels = decode_tensor(data, limits)
    assert pixels.shape == (3, 1500, 2000)
    assert torch.equal(pixels, pil_to_tensor(load_upright(open_checked(data, limits), limits)))


def test_progressive_jpeg_decodes() -> None:
    data = encode(Image.new("RGB", (64, 48), BLUE), "JPEG", progressive=True)
    red, _, blue = _mean_rgb(decode_tensor(data, LIMITS))
    assert blue > 200 and red < 60


def test_limits_hold_before_any_pixel_and_bad_bytes_are_400() -> None:
    with pytest.raises(ImageTooLarge):
        decode_tensor(image_bytes(RED, size=(2000, 1000)), LIMITS)
    with pytest.raises(InvalidImage, match="aspect ratio"):
        decode_tensor(image_bytes(RED, size=(420, 20)), LIMITS)
    with pytest.raises(UnsupportedImageFormat):
        decode_tensor(encode(Image.new("RGB", (20, 20), RED), "TIFF"), LIMITS)
    with pytest.raises(InvalidImage):
        decode_tensor(b"not an image", LIMITS)
    truncated = image_bytes(RED, size=(200, 150))
    with pytest.raises(InvalidImage):
        decode_tensor(truncated[: len(truncated) // 2], LIMITS)


@pytest.mark.parametrize("interpolation", ["nearest", "bilinear", "bicubic"])  # nearest: PIL's (NEAREST_EXACT)
def test_the_tensor_transform_matches_the_pil_transform_on_a_photo(interpolation: str) -> None:
    preset = EvalPreset(resize_size=256, crop_size=224, interpolation=interpolation)  # type: ignore[arg-type]
    buffer = io.BytesIO()
    Image.fromarray(np.asarray(skimage.data.astronaut())).save(buffer, "PNG")  # lossless: only the transforms differ
    data = buffer.getvalue()
    limits = DecodeLimits(max_pixels=40_000_000, max_aspect_ratio=20, jpeg_draft_min_side=0)
    pil = image_to_tensor(data, eval_transform(preset), limits)
    tensor = image_to_tensor_path(data, TensorEvalTransform(preset), limits)
    assert pil.shape == tensor.shape == (3, 224, 224)
    levels = (pil - tensor).abs() * torch.tensor(preset.std).view(3, 1, 1) * 255  # back to 0..255 pixel levels
    assert float(levels.mean()) < 0.05 and float(levels.max()) < 1.01  # PIL's pixels, within one level


def test_the_service_decodes_on_the_path_its_settings_choose(settings, predictor,  # noqa: ANN001
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import app.engine.decoding.decoders as decoders
    from app import EXTENSION_KEY
    from app.factory import create_app

    calls: list[str] = []
    for name in ("image_to_tensor", "image_to_tensor_path"):
        original = getattr(decoders, name)
        monkeypatch.setattr(decoders, name,
                            lambda *args, _f=original, _n=name: calls.append(_n) or _f(*args))  # type: ignore[misc]
    answers = {}
    for path in ("pil", "tensor"):
        app = create_app(settings.model_copy(update={"decode_path": path}), predictor)
        try:
            answer = app.test_client().post("/predict", data=image_bytes(BLUE), content_type="image/jpeg")
            answers[path] = answer.get_json()["predictions"][0]["label"]
            bad = app.test_client().post("/predict", data=b"not an image", content_type="image/jpeg")
            assert bad.status_code == 400 and bad.get_json()["error"]["code"] == "invalid_image"
        finally:
            app.extensions[EXTENSION_KEY].shutdown(timeout=5)
    assert answers == {"pil": "blue", "tensor": "blue"}
    assert calls == ["image_to_tensor"] * 3 + ["image_to_tensor_path"] * 3  # the canary, then the two requests


def test_the_device_path_decodes_in_the_batch_and_fails_only_the_bad_image(settings, predictor,  # noqa: ANN001
                                                                            monkeypatch) -> None:  # noqa: ANN001
    from concurrent.futures import ThreadPoolExecutor

    import app.engine.decoding.decoders as decoders
    from app import EXTENSION_KEY
    from app.factory import create_app
    from app.engine.decoding.device import Encoded

    seen: list[type] = []
    original = decoders.collate_on_device
    monkeypatch.setattr(decoders, "collate_on_device",
                        lambda items, *rest: seen.extend(map(type, items)) or original(items, *rest))
    app = create_app(settings.model_copy(update={"decode_path": "device", "max_wait_ms": 200}), predictor)
    try:
        client = app.test_client()
        seen.clear()
        good = client.post("/predict", data=image_bytes(BLUE), content_type="image/jpeg")
        assert good.get_json()["predictions"][0]["label"] == "blue" and seen == [Encoded]
        assert client.post("/predict", data=image_bytes(RED, fmt="PNG"), content_type="image/png").get_json()[
            "predictions"][0]["label"] == "red"  # not a JPEG: the CPU decoder, in the same batch stage
        truncated = image_bytes(RED, size=(200, 150))
        truncated = truncated[: len(truncated) // 2]  # the header is whole: it passes the request thread
        bodies = [truncated, image_bytes(BLUE), image_bytes(RED)]
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda body: app.test_client().post(
                "/predict", data={"image": [(io.BytesIO(body), "x.jpg")]}, content_type="multipart/form-data"),
                bodies))
        assert [a.status_code for a in answers] == [400, 200, 200]
        error = answers[0].get_json()["error"]
        assert error["code"] == "invalid_image" and error["message"].startswith("image 0 (x.jpg): ")
    finally:
        app.extensions[EXTENSION_KEY].shutdown(timeout=5)


def test_only_the_device_path_decodes_in_the_batch_on_the_cpu_and_only_what_is_not_a_jpeg(
        predictor) -> None:  # noqa: ANN001
    from app.engine.loaded.version import decoder_of

    device = decoder_of("device", predictor, LIMITS)
    pixels = predictor.tensor_transform(decode_tensor(image_bytes(RED), LIMITS)).numpy()
    assert not device.decodes_on_host_in_batch(device.prepare(image_bytes(BLUE)))  # nvJPEG's
    assert device.decodes_on_host_in_batch(device.prepare(image_bytes(RED, fmt="PNG")))  # the CPU decoder's
    assert not device.decodes_on_host_in_batch(pixels)  # a client's pixels: decoded already
    for path in ("tensor", "pil"):  # decoded before their batch
        decoder = decoder_of(path, predictor, LIMITS)
        assert not decoder.decodes_on_host_in_batch(decoder.prepare(image_bytes(RED, fmt="PNG")))


def test_a_batch_may_mix_encoded_images_and_preprocessed_pixels(predictor) -> None:  # noqa: ANN001
    from app.engine.loaded.version import decoder_of

    decoder = decoder_of("device", predictor, LIMITS)
    red_pixels = predictor.tensor_transform(decode_tensor(image_bytes(RED), LIMITS))
    probabilities = predictor.predict_batch(decoder.collate([decoder.prepare(image_bytes(BLUE)), red_pixels]))
    assert probabilities.argmax(dim=1).tolist() == [2, 0]  # blue, red: in their order


@pytest.mark.parametrize("pixels_first", [False, True])
def test_the_tensor_path_batches_photos_decoded_here_with_a_client_s_pixels(predictor, pixels_first: bool  # noqa: ANN001
                                                                             ) -> None:
    # the tensor path's batch stacks decoded tensors as they are, and a client's pixels (arrays) among them too
    from app.engine.loaded.version import decoder_of

    decoder = decoder_of("tensor", predictor, LIMITS)
    red_pixels = predictor.tensor_transform(decode_tensor(image_bytes(RED), LIMITS)).numpy()
    photos = [decoder.prepare(image_bytes(BLUE)), decoder.prepare(image_bytes(RED))]
    items = [red_pixels, *photos] if pixels_first else [*photos, red_pixels]
    batch = decoder.collate(items)
    assert batch.shape == (3, *red_pixels.shape) and batch.dtype == torch.float32
    for row, item in zip(batch, items):
        assert torch.equal(row, torch.as_tensor(item))
    assert torch.equal(decoder.collate(photos), torch.stack(photos))  # photos alone


def _turned_photos() -> list[bytes]:
    """A non-square photo with each EXIF orientation (0: none; 9: not an orientation, left as stored)."""
    astronaut = Image.fromarray(np.asarray(skimage.data.astronaut())[:300, :200])
    photos = []
    for orientation in range(10):
        exif = Image.Exif()
        if orientation:
            exif[0x0112] = orientation
        photos.append(encode(astronaut, "JPEG", quality=95, exif=exif.tobytes()))
    return photos


def _device_batch(photos: list[bytes], device: torch.device) -> list[torch.Tensor]:
    """The device path's decode of a batch: the orientation read with each header, the pixels turned after."""
    from app.engine.decoding.device import _jpegs_on, check_header

    decoded = _jpegs_on(device, [check_header(data, LIMITS) for data in photos])
    return [decoded[i].cpu() for i in range(len(photos))]


def test_the_device_path_turns_every_exif_orientation_as_pil_does() -> None:
    # The turn is applied after the decode on every device (torchvision's CUDA decode ignores EXIF), so this CPU
    # run checks the same code that turns the pixels on a GPU.
    photos = _turned_photos()
    for orientation, (data, pixels) in enumerate(zip(photos, _device_batch(photos, torch.device("cpu")))):
        assert torch.equal(pixels, decode_tensor(data, LIMITS)), orientation


def test_the_device_path_decodes_a_large_jpeg_at_full_size_as_the_cpu_paths_do_without_a_reduced_scale() -> None:
    # What JPEG_DRAFT_MIN_SIDE's description says (a new user's trial: a GPU server's answers differed from a CPU
    # one's for a 7000x4666 photo): the device path has no reduced scale, and 0 on a CPU path gives its pixels
    side = Settings().jpeg_draft_min_side
    data = photo_jpeg(photo("coffee"), (2 * side + 8, 2 * side))
    drafted = DecodeLimits(max_pixels=40_000_000, max_aspect_ratio=20, jpeg_draft_min_side=side)
    full = DecodeLimits(max_pixels=40_000_000, max_aspect_ratio=20, jpeg_draft_min_side=0)
    from app.engine.decoding.device import _jpegs_on

    (on_device,) = _jpegs_on(torch.device("cpu"), [check_header(data, drafted)]).values()
    assert on_device.shape == (3, 2 * side, 2 * side + 8)
    assert torch.equal(on_device, decode_tensor(data, full))
    assert decode_tensor(data, drafted).shape == (3, side, side + 4)


def _arena_views(photos: list[bytes]) -> list[memoryview]:
    """``photos`` as the engine's view of a loop link's arena lends them (app/link/arena.py): writable slices of
    one array."""
    whole = np.frombuffer(bytearray(b"".join(photos)), np.uint8)
    view, views, at = memoryview(whole), [], 0
    for data in photos:
        views.append(view[at:at + len(data)])
        at += len(data)
    return views


@pytest.mark.parametrize("handed", [lambda photos: [bytearray(data) for data in photos], _arena_views],
                         ids=["segments", "arena views"])
def test_images_as_the_link_hands_them_decode_alike_and_the_device_path_reads_them_where_they_lie(
        handed: Callable[[list[bytes]], list[bytearray | memoryview]], monkeypatch: pytest.MonkeyPatch) -> None:
    # The engine's images are its request's segments as read (a bytearray each) or views of its loop link's arena,
    # where the inline path's are bytes.
    import app.engine.decoding.device as device

    photos = _turned_photos()
    segments = handed(photos)
    wrapped: list[int] = []
    real = device.decode_jpegs

    def decode_jpegs(encoded: list[torch.Tensor], *args: object) -> list[torch.Tensor | None]:
        wrapped.extend(tensor.data_ptr() for tensor in encoded)
        return real(encoded, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(device, "decode_jpegs", decode_jpegs)
    cpu = torch.device("cpu")
    for pixels, expected in zip(_device_batch(segments, cpu), _device_batch(photos, cpu)):  # type: ignore[arg-type]
        assert torch.equal(pixels, expected)
    addresses = [np.frombuffer(segment, np.uint8).ctypes.data for segment in segments]
    assert wrapped[:len(segments)] == addresses  # the segments themselves, not copies
    assert all(copy != address for copy, address in zip(wrapped[len(segments):], addresses))  # bytes: copied
    for segment, data in zip(segments, photos):  # the host paths and the header reader take them alike
        assert torch.equal(decode_tensor(segment, LIMITS), decode_tensor(data, LIMITS))
        assert read_jpeg_header(segment) == read_jpeg_header(data)
    progressive = io.BytesIO()  # its scans counted (MAX_JPEG_SCANS) on what the link hands too
    Image.fromarray(skimage.data.astronaut()[:64, :64]).save(progressive, "JPEG", progressive=True)
    [handed_progressive] = handed([progressive.getvalue()])
    assert torch.equal(decode_tensor(handed_progressive, LIMITS), decode_tensor(progressive.getvalue(), LIMITS))
    with pytest.raises(InvalidImage, match="scans"):
        decode_tensor(handed_progressive, DecodeLimits(max_jpeg_scans=2))


@pytest.mark.gpu
def test_on_cuda_exif_rotated_photos_get_the_cpu_paths_pixels() -> None:
    photos = _turned_photos()
    for orientation, (data, pixels) in enumerate(zip(photos, _device_batch(photos, torch.device("cuda")))):
        expected = decode_tensor(data, LIMITS)
        assert pixels.shape == expected.shape, orientation  # before: (3, 300, 200) turned 90 degrees came back as is
        assert (pixels.float() - expected.float()).abs().mean() < 2.0, orientation  # nvJPEG's IDCT differs a little


@pytest.mark.gpu
@pytest.mark.parametrize("preset", [lite0_preset(), EvalPreset(resize_size=232, crop_size=224)], ids=["bicubic",
                                                                                                   "bilinear"])
def test_on_cuda_a_batch_rounded_together_equals_torchvision_image_by_image(
        preset: EvalPreset, monkeypatch: pytest.MonkeyPatch) -> None:
    # On CUDA torchvision resizes uint8 through float32 and back, image by image; the device path's batch keeps the
    # crops float32 and rounds them together (TensorEvalTransform.rounded_crops): the same values
    transform, cuda = TensorEvalTransform(preset), torch.device("cuda")
    images = _device_batch(_turned_photos(), cuda)
    images = [image.to(cuda) for image in images] + [decode_tensor(photo_jpeg(photo("coffee")), LIMITS).to(cuda)]
    expected = torch.stack([transform(image) for image in images])
    rounded: list[int] = []
    monkeypatch.setattr(transform, "rounded_crops", lambda batch: rounded.append(len(batch)) or
                        TensorEvalTransform.rounded_crops(transform, batch))
    got = transform.batch(images)
    assert rounded == [len(images)]  # the batch took the float path
    assert got.device.type == "cuda" and torch.equal(got, expected)


# -- a plain JPEG's header read without PIL -------------------------------------------------------------------------

def _with_exif(image: Image.Image, turn: int, **save: object) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = turn
    return encode(image, exif=exif, **save)


def _segment(marker: int, payload: bytes) -> bytes:
    return bytes([0xFF, marker]) + (len(payload) + 2).to_bytes(2, "big") + payload


def _long_orientation_exif() -> bytes:
    """An EXIF block whose orientation is a LONG, not the SHORT cameras write."""
    entry = (0x0112).to_bytes(2, "little") + (4).to_bytes(2, "little") + (1).to_bytes(4, "little") + \
        (6).to_bytes(4, "little")
    return b"Exif\0\0" + b"II*\0" + (8).to_bytes(4, "little") + (1).to_bytes(2, "little") + entry + bytes(4)


def test_a_plain_jpeg_s_header_reads_without_pil_as_pil_reads_it() -> None:
    astronaut, coffee = photo("astronaut"), photo("coffee")
    plain = [photo_jpeg(astronaut), encode(coffee, progressive=True), encode(coffee.convert("L")),
             encode(astronaut, subsampling=0, quality=95), encode(coffee, restart_marker_blocks=4),
             encode(astronaut.resize((97, 31)))]
    turned = [_with_exif(coffee, turn) for turn in range(1, 9)] + [_with_exif(coffee, 9), _with_exif(coffee, 0)]
    for data in plain + turned:
        header = read_jpeg_header(data)
        with Image.open(io.BytesIO(data)) as opened:
            assert header == JpegHeader.of(opened)
    assert [read_jpeg_header(data).orientation for data in turned] == [1, 2, 3, 4, 5, 6, 7, 8, 1, 1]
    # the same pixels and refusals as through PIL's reading (decode_jpeg_cpu given PIL's reading of the header)
    for data in turned:
        read_by_pil = JpegHeader.of(Image.open(io.BytesIO(data)))
        assert torch.equal(decode_tensor(data, LIMITS), decode_jpeg_cpu(data, read_by_pil, 0))
    with pytest.raises(ImageTooLarge, match=r"512x512 = 262144 pixels; the limit is 1000"):
        decode_tensor(photo_jpeg(astronaut), DecodeLimits(max_pixels=1000))
    with pytest.raises(InvalidImage, match="aspect ratio is over 3"):
        decode_tensor(encode(astronaut.resize((97, 31))), DecodeLimits(max_aspect_ratio=3))


def test_what_the_header_reader_leaves_to_pil_is_read_by_pil_as_before() -> None:
    coffee = photo("coffee")
    base = encode(coffee)
    exif = _with_exif(coffee, 6)
    exif_block = exif[2:exif.index(b"\xff\xdb")]  # SOI stripped; up to the tables: the JFIF and EXIF segments
    left = {
        "PNG": encode(coffee, fmt="PNG"),
        "CMYK": encode(coffee.convert("CMYK")),
        "XMP": encode(coffee, xmp=b"<x:xmpmeta><tiff:Orientation>6</tiff:Orientation></x:xmpmeta>"),
        "two EXIF blocks": base[:2] + exif_block + exif_block + base[2:],
        "a LONG orientation": base[:2] + _segment(0xE1, _long_orientation_exif()) + base[2:],
        "cut in its segments": base[:300],
        "not a marker": base[:2] + b"\xff\xe0\x00\x10JFIF\x00" + b"\x00" * 9 + b"junk" + base[20:],
    }
    for name, data in left.items():
        assert read_jpeg_header(data) is None, name
    # PIL turns the XMP and LONG orientations, so decoding still does
    xmp, long_turn = left["XMP"], left["a LONG orientation"]
    assert torch.equal(decode_tensor(xmp, LIMITS), pil_to_tensor(_pil_upright(xmp)))
    assert torch.equal(decode_tensor(long_turn, LIMITS), pil_to_tensor(_pil_upright(long_turn)))
    assert decode_tensor(long_turn, LIMITS).shape[1:] == (coffee.width, coffee.height)
    with pytest.raises(InvalidImage, match="header is broken"):
        decode_tensor(left["cut in its segments"], LIMITS)


def test_the_device_decode_draws_its_stream_once_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    # a draw per batch would walk PyTorch's pool of 32 streams and soon decode on a capture's or another's stream
    import models.data.jpeg as jpeg
    from tests.support.fakes import PooledStreams

    streams = PooledStreams(highest=-3)
    monkeypatch.setattr(torch.cuda, "Stream", streams.Stream)
    monkeypatch.setattr(jpeg, "_DECODE_STREAMS", {})
    device = torch.device("cuda", 0)
    stream = jpeg.decode_stream(device)
    assert [jpeg.decode_stream(device) for _ in range(3)] == [stream] * 3
    assert streams.made == [(device, 0)]


def test_a_cmyk_jpeg_is_left_to_the_cpu_on_the_device_path_and_gets_pils_pixels() -> None:
    # nvJPEG, like libjpeg-turbo, does not convert CMYK as PIL does: the batch decodes it on the CPU, and a batch
    # holding it stays off an engine's loop (decodes_on_host_in_batch)
    from app.engine.decoding.decoders import decoder_for
    from app.engine.decoding.device import check_header, decode_batch

    cmyk, plain = encode(photo("coffee").convert("CMYK")), encode(photo("coffee"))
    assert not check_header(cmyk, LIMITS).jpeg and check_header(plain, LIMITS).jpeg
    transform = TensorEvalTransform(EvalPreset(resize_size=64, crop_size=56))
    decoder = decoder_for("device", LIMITS, device=torch.device("cpu"), dtype=torch.float32,
                          transform=eval_transform(EvalPreset(resize_size=64, crop_size=56)),
                          tensor_transform=transform)
    assert decoder.decodes_on_host_in_batch(decoder.prepare(cmyk))
    assert not decoder.decodes_on_host_in_batch(decoder.prepare(plain))
    batch = decode_batch([check_header(cmyk, LIMITS)], torch.device("cpu"), transform, torch.float32)
    assert torch.equal(batch[0], transform(decode_tensor(cmyk, LIMITS)))


def test_a_device_out_of_memory_in_the_jpeg_decoder_is_raised_as_one_and_a_refused_image_is_left_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # torchvision reports a failed allocation as a plain RuntimeError: a batcher splits a batch on the device's
    # out-of-memory error, where decoding each image on the CPU instead would hide a full device
    import models.data.jpeg as jpeg

    encoded = [torch.frombuffer(bytearray(encode(photo("coffee"))), dtype=torch.uint8)] * 2
    failure = {"message": "Error while decoding JPEG images: CUDA out of memory. Tried to allocate 2.00 MiB"}
    calls: list[object] = []

    def failing(data: object, device: torch.device) -> list[torch.Tensor]:
        calls.append(data)
        raise RuntimeError(failure["message"])

    monkeypatch.setattr(jpeg, "_decode", failing)
    with pytest.raises(torch.cuda.OutOfMemoryError, match="out of memory"):
        jpeg.decode_jpegs(encoded, torch.device("cpu"))
    assert len(calls) == 1  # raised from the batch's call: no image tried alone on a full device
    failure["message"] = "Error while decoding JPEG images: nvjpegDecode failed: 6"  # an image it refuses
    assert jpeg.decode_jpegs(encoded, torch.device("cpu")) == [None, None]

    def full_one_at_a_time(data: object, device: torch.device) -> list[torch.Tensor]:  # the batch refused, then
        raise RuntimeError("nvjpegDecode failed: 6" if isinstance(data, list) else "CUDA out of memory")  # no room

    monkeypatch.setattr(jpeg, "_decode", full_one_at_a_time)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        jpeg.decode_jpegs(encoded, torch.device("cpu"))


def test_the_device_decode_names_a_gpu_by_its_index(monkeypatch: pytest.MonkeyPatch) -> None:
    # torchvision keeps one decoder, made again (and the old one's buffers kept) when the device it is asked for
    # changes, and "cuda" is not "cuda:0" to it
    import models.data.jpeg as jpeg

    asked: list[torch.device] = []

    def decode(data: object, device: torch.device) -> list[torch.Tensor]:
        asked.append(device)
        return [torch.zeros(3, 2, 2, dtype=torch.uint8)] * (len(data) if isinstance(data, list) else 1)

    monkeypatch.setattr(jpeg, "_decode", decode)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    encoded = [torch.frombuffer(bytearray(encode(photo("coffee"))), dtype=torch.uint8)]
    for device in (torch.device("cuda"), torch.device("cuda", 1)):
        jpeg.decode_jpegs(encoded, device)
    assert asked == [torch.device("cuda", 1)] * 2


def _segment(marker: int, payload: bytes) -> bytes:
    return bytes([0xFF, marker]) + struct.pack(">H", len(payload) + 2) + payload


def _many_scans(side: int, scans: int) -> bytes:
    """A legal progressive grey JPEG of ``side`` x ``side`` whose DC scan is followed by ``scans`` AC scans of a
    few bytes each (end-of-block runs): each walks every block of the image again, the file stays small."""
    blocks = (-(-side // 8)) ** 2

    def packed(bits: str) -> bytes:
        bits += "1" * (-len(bits) % 8)
        out = bytearray()
        for at in range(0, len(bits), 8):
            out.append(int(bits[at:at + 8], 2))
            if out[-1] == 0xFF:
                out.append(0)
        return bytes(out)

    table = bytes([1] + [0] * 15)  # one code of one bit
    head = (_segment(0xDB, bytes([0]) + bytes([1] * 64))
            + _segment(0xC2, struct.pack(">BHHB", 8, side, side, 1) + bytes([1, 0x11, 0]))
            + _segment(0xC4, bytes([0x00]) + table + bytes([0]))  # DC: one symbol, no difference
            + _segment(0xC4, bytes([0x10]) + table + bytes([0xE0])))  # AC: one symbol, a run of 16384 ends of block
    dc = _segment(0xDA, bytes([1, 1, 0x00, 0, 0, 0x00])) + packed("0" * blocks)
    ac = _segment(0xDA, bytes([1, 1, 0x00, 1, 63, 0x00])) + packed("0" * 15 * -(-blocks // 16384))
    return b"\xff\xd8" + head + dc + ac * scans + b"\xff\xd9"


def test_a_progressive_jpeg_of_thousands_of_scans_is_refused_before_any_pixel() -> None:
    # Before: 20,000 scans in 1.6 MB of a 6000x6000 image decoded for 39 s on every path and were answered 200, past
    # the request's deadline (which starts after the decode); on the device path it held the batch worker.
    bomb = _many_scans(512, 2000)
    for decode in (decode_tensor, decode_image, check_header):
        with pytest.raises(InvalidImage, match="the progressive JPEG has 2001 scans; the limit is 64"):
            decode(bomb, LIMITS)
    few = _many_scans(64, 30)  # under the limit: decoded
    assert decode_tensor(few, LIMITS).shape == (3, 64, 64) and decode_image(few, LIMITS).size == (64, 64)
    unlimited = DecodeLimits(max_pixels=1_000_000, max_aspect_ratio=20, jpeg_draft_min_side=0, max_jpeg_scans=0)
    assert decode_tensor(_many_scans(64, 100), unlimited).shape == (3, 64, 64)


def test_a_cut_exif_block_is_turned_as_pil_turns_it() -> None:
    # A camera's EXIF whose last bytes were lost: PIL stops reading its directory at the first value past the end and
    # turns by nothing; the header reader went on to the Orientation entry and turned the tensor and device paths.
    exif = Image.Exif()
    exif[0x010F], exif[0x0110], exif[0x0112] = "Canon", "Canon EOS 5D Mark IV", 6
    exif[0x011A], exif[0x011B], exif[0x0131] = 72.0, 72.0, "Firmware 1.2.0"
    astronaut = Image.fromarray(np.asarray(skimage.data.astronaut())[:450, :300])
    data = encode(astronaut, "JPEG", quality=95, exif=exif.tobytes()[:-40])
    assert torch.equal(decode_tensor(data, LIMITS), pil_to_tensor(decode_image(data, LIMITS)))
    assert check_header(data, LIMITS).orientation == 1


def test_a_jfif_segment_too_short_for_pil_is_refused_on_every_path() -> None:
    # libjpeg-turbo only warns of it: the tensor and device paths answered 200 where the pil path answered 400.
    data = encode(Image.fromarray(np.asarray(skimage.data.chelsea())), "JPEG")
    length = int.from_bytes(data[4:6], "big")
    short = data[:2] + b"\xff\xe0\x00\x08JFIF\x00\x01" + data[4 + length:]
    for decode in (decode_tensor, decode_image, check_header):
        with pytest.raises(InvalidImage):
            decode(short, LIMITS)


def test_a_client_s_pixel_rows_stack_as_they_are_whatever_their_buffers_types_and_layout() -> None:
    # Rows on buffers of their own (as read from the link) stack byte for byte; rows of several types as numpy casts
    # them; rows that are no C-contiguous buffer (a transpose) as their values
    rng = np.random.default_rng(0)
    rows = [np.ndarray((3, 4, 4), np.float32, bytearray(rng.standard_normal(48).astype(np.float32).tobytes()))
            for _ in range(5)]
    stacked = stack_pixels(rows)
    assert stacked.shape == (5, 3, 4, 4) and stacked.dtype == torch.float32
    assert np.array_equal(stacked.numpy(), np.stack(rows))
    stacked[0, 0, 0, 0] = 7.0  # its own memory, writable: none of the rows changes
    assert rows[0][0, 0, 0] != 7.0
    mixed = [rows[0], rows[1].astype(np.float64), rows[2].astype(np.uint8)]
    assert stack_pixels(mixed).dtype == torch.float64
    assert np.array_equal(stack_pixels(mixed).numpy(), np.array(mixed))
    turned = [row.transpose(0, 2, 1) for row in rows[:2]]
    assert np.array_equal(stack_pixels(turned).numpy(), np.stack(turned))
