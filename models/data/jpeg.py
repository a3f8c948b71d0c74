"""JPEG decoding: one JPEG on the CPU as PIL would decode it, only faster (the server's tensor path and
models.predict), and batched on a device (nvJPEG on CUDA, libjpeg-turbo on the CPU: the server's device decode
path and training's GPU data path)."""
from __future__ import annotations

import contextlib
import io
import logging
import struct
from typing import NamedTuple, Sequence

import numpy as np
import simplejpeg
import torch
from PIL import Image

log = logging.getLogger(__name__)

_ORIENTATION = 0x0112  # the EXIF tag
# PIL's exif_transpose per EXIF orientation: (transpose first, then mirror the rows, mirror the columns); a value
# that is none of these keys (absent, 1, a string, a fraction) leaves the pixels as stored, as in PIL.
_TURNS = {2: (False, False, True), 3: (False, True, True), 4: (False, True, False), 5: (True, False, False),
          6: (True, False, True), 7: (True, True, True), 8: (True, True, False)}
# What PIL reads a JPEG as when libjpeg-turbo (here) or nvJPEG (``decode_jpegs``) gives PIL's pixels; CMYK and YCCK
# are left to PIL, which converts them its own way
LIBJPEG_MODES = ("RGB", "L")


def draft_scale(size: tuple[int, int], min_side: int) -> int:
    """The reduced scale (1, 2, 4 or 8: decoded at 1/scale) PIL's JPEG draft mode picks for an image of ``size``
    asked to keep both sides at least ``min_side`` pixels (0: full size)."""
    fits = min(size) // min_side if min_side else 0
    return next((scale for scale in (8, 4, 2) if fits >= scale), 1)


class JpegHeader(NamedTuple):
    """What decoding a JPEG needs of its header, as PIL reads it: its size, PIL's mode for it, its EXIF orientation,
    and whether it is progressive (its scans each decode the whole image again: the decode rules count them)."""

    width: int
    height: int
    mode: str
    orientation: int  # 1: none, or one PIL would not turn by
    progressive: bool = False

    @classmethod
    def of(cls, image: Image.Image) -> "JpegHeader":
        """The header of a JPEG PIL has opened."""
        return cls(*image.size, image.mode, orientation(image), bool(image.info.get("progressive")))


_SOS, _APP0, _APP1 = 0xDA, 0xE0, 0xE1
_PROGRESSIVE_FRAMES = frozenset({0xC2, 0xC6, 0xCA, 0xCE})  # SOF2, 6, 10, 14: progressive frames
_JFIF = b"JFIF"
_JFIF_READ = 7  # what PIL reads of a JFIF APP0 segment's data (its version at 5): a shorter one PIL refuses
_WITHOUT_LENGTH = frozenset({0x01, *range(0xD0, 0xD8)})  # TEM and RSTn: a marker and nothing else
_EXIF, _XMP = b"Exif\0\0", b"http://ns.adobe.com/xap/1.0/\0"
_PIL_MODES = {"YCbCr": "RGB", "RGB": "RGB", "Gray": "L"}  # libjpeg's colour spaces PIL opens as RGB or L


def read_jpeg_header(data: bytes | bytearray | memoryview) -> JpegHeader | None:
    """A plain JPEG's header without PIL, about 5 us where PIL's reading took about 50 on a photo: its size and
    colour from libjpeg-turbo (which reads every segment up to the scan), its EXIF orientation from a walk over the
    segments before the scan. None for anything else, which PIL then reads, refusing what it refuses as before:
    another format, CMYK or YCCK (PIL converts them its own way), an XMP block (PIL reads an orientation there when the
    EXIF has none), several EXIF blocks (PIL joins them), an orientation that is not one plain number, any segment
    that does not fit, or a header libjpeg-turbo refuses."""
    if data[:3] != b"\xff\xd8\xff":  # (compared by slice: the link hands a view of its arena, no startswith)
        return None
    exif, progressive, at, size = None, False, 2, len(data)
    while True:  # the segments up to the scan, as PIL walks them (fill bytes between them skipped)
        if at + 2 > size or data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker == 0xFF:
            at += 1
            continue
        if marker == _SOS:
            break
        if marker in _WITHOUT_LENGTH:
            at += 2
            continue
        if at + 4 > size:
            return None
        length = (data[at + 2] << 8) | data[at + 3]
        if length < 2 or at + 2 + length > size:
            return None
        progressive = progressive or marker in _PROGRESSIVE_FRAMES
        if marker == _APP0 and data[at + 4:at + 4 + len(_JFIF)] == _JFIF and length - 2 < _JFIF_READ:
            return None  # PIL refuses it (libjpeg-turbo only warns): PIL says why
        if marker == _APP1:
            if data[at + 4:at + 4 + len(_XMP)] == _XMP:
                return None
            if data[at + 4:at + 4 + len(_EXIF)] == _EXIF:
                if exif is not None:
                    return None
                exif = bytes(data[at + 4 + len(_EXIF):at + 2 + length])  # the link hands a view
        at += 2 + length
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    mode = _PIL_MODES.get(colorspace)
    turn = _exif_orientation(exif) if exif is not None else 1
    if mode is None or turn is None:
        return None
    return JpegHeader(width, height, mode, turn, progressive)


def _exif_orientation(exif: bytes) -> int | None:
    """The orientation in an EXIF block's first directory (a TIFF layout), as PIL reads it when it is one plain
    number: 1 when there is none, or one PIL would not turn by; None for anything else (PIL then reads it)."""
    order = {b"II*\0": "<", b"MM\0*": ">"}.get(exif[:4])
    if order is None:
        return None
    try:
        (directory,) = struct.unpack_from(order + "I", exif, 4)
        (count,) = struct.unpack_from(order + "H", exif, directory)
        if directory + 2 + 12 * count > len(exif):
            return None
        for entry in range(directory + 2, directory + 2 + 12 * count, 12):
            tag, kind, values = struct.unpack_from(order + "HHI", exif, entry)
            if _past_the_block(exif, order, entry, kind, values):
                return None  # PIL stops reading the directory there (a truncated block), and turns by nothing
            if tag == _ORIENTATION:
                if kind != 3 or values != 1:  # a SHORT, as written; anything else is PIL's to read
                    return None
                (value,) = struct.unpack_from(order + "H", exif, entry + 8)
                return value if value in _TURNS else 1
    except struct.error:
        return None
    return 1


_TIFF_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 1, 7: 1, 8: 2, 9: 4, 10: 8, 11: 4, 12: 8, 13: 4, 16: 8, 17: 8, 18: 8}


def _past_the_block(exif: bytes, order: str, entry: int, kind: int, values: int) -> bool:
    """Whether a directory entry's values lie out of line (over 4 bytes) past the end of the EXIF block, where PIL
    stops reading the directory (a kind it does not know it skips, as PIL does)."""
    size = _TIFF_SIZES.get(kind, 0) * values
    if size <= 4:
        return False
    (offset,) = struct.unpack_from(order + "I", exif, entry + 8)
    return offset + size > len(exif)


def decode_jpeg_cpu(data: bytes, header: JpegHeader, min_side: int) -> torch.Tensor:
    """A JPEG whose header was read (``read_jpeg_header``, or ``JpegHeader.of`` PIL's image), as an upright RGB uint8
    (3, H, W) tensor: PIL's pixels bit for bit (its draft scale for ``min_side``, its EXIF turn), decoded by libjpeg-turbo
    straight into the array the tensor wraps. ValueError for what PIL must decode itself: CMYK and YCCK (PIL converts
    them its own way), and data libjpeg-turbo refuses (truncated: PIL then says why)."""
    if header.mode not in LIBJPEG_MODES:
        raise ValueError(f"a {header.mode} JPEG")
    width, height = header.width, header.height
    scale = draft_scale((width, height), min_side)
    # The smallest of libjpeg-turbo's scales that keeps these sizes is exactly 1/scale (PIL rounds up too).
    size = (-(-height // scale), -(-width // scale))
    found = simplejpeg.decode_jpeg_header(data, min_height=size[0], min_width=size[1])[:2]
    if found != size:  # checked before the pixels' memory is taken
        raise ValueError(f"libjpeg-turbo would decode {found[1]}x{found[0]}, not {size[1]}x{size[0]}")
    pixels = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=size[0], min_width=size[1])
    return torch.from_numpy(_upright(pixels, _TURNS.get(header.orientation))).permute(2, 0, 1)


def orientation(header: Image.Image) -> int:
    """The EXIF orientation PIL would apply to an image whose header it read (1: none, or one it cannot read)."""
    try:
        value = header.getexif().get(_ORIENTATION, 1)
    except Exception:  # noqa: BLE001 - a broken EXIF block should not lose an otherwise good photo (as with PIL)
        log.debug("ignoring unreadable EXIF orientation", exc_info=True)
        return 1
    return value if value in _TURNS else 1


def turned(pixels: torch.Tensor, exif_orientation: int) -> torch.Tensor:
    """(C, H, W) pixels on any device turned upright for ``exif_orientation``, as PIL's exif_transpose does (a view
    where it can be)."""
    turn = _TURNS.get(exif_orientation)
    if turn is None:
        return pixels
    transpose, flip_rows, flip_columns = turn
    if transpose:
        pixels = pixels.transpose(1, 2)
    if flip_rows:
        pixels = pixels.flip(1)
    if flip_columns:
        pixels = pixels.flip(2)
    return pixels


def _orientation_of(encoded: torch.Tensor) -> int:
    data = encoded.numpy().tobytes()
    header = read_jpeg_header(data)
    if header is not None:
        return header.orientation
    try:
        with Image.open(io.BytesIO(data)) as opened:
            return orientation(opened)
    except Exception:  # noqa: BLE001 - not even a header: the decoder says why
        return 1


def _upright(pixels: np.ndarray, turn: tuple[bool, bool, bool] | None) -> np.ndarray:
    """(H, W, 3) pixels turned by ``turn`` (``_TURNS``). A transpose is a view; a mirror costs a copy (torch takes
    no negative steps)."""
    if turn is None:
        return pixels
    transpose, flip_rows, flip_columns = turn
    if transpose:
        pixels = pixels.transpose(1, 0, 2)
    if flip_rows:
        pixels = pixels[::-1]
    if flip_columns:
        pixels = pixels[:, ::-1]
    return np.ascontiguousarray(pixels) if flip_rows or flip_columns else pixels


_DECODE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def stream_drawn_once(streams: dict[torch.device, torch.cuda.Stream], device: torch.device,
                      priority: int = 0) -> torch.cuda.Stream:
    """``device``'s stream in ``streams``, drawn from PyTorch's pool of ``priority`` the first time. A pool hands its
    32 streams out in turn, so a stream drawn per use would soon be one another user of the pool runs work on (the
    JPEG decoding's, a graph capture's, training's prefetch: each keeps one, drawn here)."""
    stream = streams.get(device)
    if stream is None:
        stream = streams.setdefault(device, torch.cuda.Stream(device, priority=priority))  # two threads: one stream
    return stream


def decode_stream(device: torch.device) -> torch.cuda.Stream:
    """The one stream ``_decode`` decodes on for ``device``, from PyTorch's default-priority pool."""
    return stream_drawn_once(_DECODE_STREAMS, device)


def _decode(encoded: torch.Tensor | list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``decode_jpeg`` on ``device``; on CUDA ordered safely against the caller's stream.

    torchvision allocates nvJPEG's outputs on the caller's current stream but decodes on a private stream that does
    not wait for it (pytorch/vision#9606), so a block just freed on the caller's stream, still read by its queued
    kernels, could be overwritten. Decoding under a stream of our own, whose freed blocks only ever held decoder
    output that the caller's stream is recorded on, keeps the allocator from handing out such a block; the caller's
    stream then waits for the decode. No host synchronisation.
    """
    from torchvision.io import ImageReadMode, decode_jpeg  # the device path only: the CPU one needs no torchvision

    cuda = device.type == "cuda"
    caller = torch.cuda.current_stream(device) if cuda else None
    stream = decode_stream(device) if cuda else None
    with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
        # EXIF is applied by ``turned`` after: torchvision's CUDA decode ignores apply_exif_orientation (a 500x300
        # photo with orientation 6 came back 500 wide on CUDA, 300 on the CPU), so no device is trusted with it.
        out = decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device, apply_exif_orientation=False)
    images = out if isinstance(out, list) else [out]
    if caller is not None and stream is not None:
        caller.wait_stream(stream)
        for image in images:
            image.record_stream(caller)
    return images


def decode_jpegs(encoded: Sequence[torch.Tensor], device: torch.device,
                 orientations: Sequence[int] | None = None) -> list[torch.Tensor | None]:
    """Each encoded JPEG (a 1-D uint8 CPU tensor) as upright RGB uint8 (C, H, W) on ``device``, in one batched call,
    turned by its EXIF orientation (``orientations``, as ``orientation`` read them from the headers; None: read
    here); None for those the decoder refuses (the caller decodes them on the CPU and says why if it cannot
    either)."""
    if not encoded:
        return []
    if device.type == "cuda" and device.index is None:  # one spelling of the device: torchvision's one decoder is
        device = torch.device("cuda", torch.cuda.current_device())  # made again for another, and so is our stream
    turns = list(orientations) if orientations is not None else [_orientation_of(e) for e in encoded]
    try:
        return [turned(pixels, turn) for pixels, turn in zip(_decode(list(encoded), device), turns)]
    except RuntimeError as exc:  # one bad image fails the batched call: decode them one by one instead
        _raise_out_of_memory(exc)
        log.debug("batched JPEG decoding failed, decoding one at a time: %s", exc)
    out: list[torch.Tensor | None] = []
    for data, turn in zip(encoded, turns):
        try:
            out.append(turned(_decode(data, device)[0], turn))
        except RuntimeError as exc:
            _raise_out_of_memory(exc)
            out.append(None)
    return out


def _raise_out_of_memory(exc: RuntimeError) -> None:
    """Raise ``exc`` as the device's out-of-memory error when it is one: torchvision reports a failed allocation in
    its decoder as a plain RuntimeError, and an image it refuses must not be told from a device that is full (a
    batcher splits a batch on the latter; decoding each image on the CPU instead would hide it)."""
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        raise exc
    if "out of memory" in str(exc).lower():
        raise torch.cuda.OutOfMemoryError(str(exc)) from exc
