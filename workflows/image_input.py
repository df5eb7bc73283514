"""Images as people have them: JPEG or PNG bytes, beside the base64 `.npy` arrays of the examples.

Request bodies (the gateway):

- ``application/json`` (or no type): the event itself, as before; an image inside it is base64 text
  of JPEG, PNG or `.npy` bytes;
- ``image/jpeg`` or ``image/png``: the bytes are the image; the event is ``{"image": <base64>}``;
- ``multipart/form-data``: a file part becomes base64 text under its field name, a text field a
  string, and a field named ``event`` holding a JSON object is the event the others are added to.

The gateway never decodes pixels (it needs no torch for that): the handler does, with
``decode_image_field``, through ``torchvision.io`` for JPEG and PNG.
"""

from __future__ import annotations

import base64
import binascii
import email.parser
import email.policy
import io
import json
import math
import re
from typing import Any

from streambox.api_proxy.wire import MAX_JSON_CONTAINERS, MAX_JSON_DEPTH, carries_int, json_depth

IMAGE_CONTENT_TYPES = ("image/jpeg", "image/png")
_MAGIC = {b"\xff\xd8\xff": "jpeg", b"\x89PNG\r\n\x1a\n": "png", b"\x93NUMPY": "npy"}
_FORMATS = "base64 text of JPEG, PNG or .npy (uint8 [H, W, 3]) bytes"


class BodyError(ValueError):
    """A request body that is not an event; the message says what is accepted."""


def image_format(data: bytes) -> str | None:
    """``"jpeg"``, ``"png"`` or ``"npy"`` from the first bytes, or None."""
    return next((fmt for magic, fmt in _MAGIC.items() if data.startswith(magic)), None)


def image_field(data: bytes) -> str:
    """Image file bytes as the base64 text an event carries; refuses what is not JPEG, PNG or .npy."""
    if image_format(data) is None:
        raise ValueError(f"not an image: expected JPEG, PNG or .npy bytes, got {data[:8]!r}...")
    return base64.b64encode(data).decode("ascii")


def decode_image_bytes(data: bytes):  # -> torch.Tensor (torch imported here, not by the gateway)
    """JPEG, PNG or `.npy` bytes as a float tensor ``[3, H, W]`` in [0, 1] (RGB)."""
    import numpy as np
    import torch
    from torchvision.io import ImageReadMode, decode_image

    fmt = image_format(data)
    if fmt in ("jpeg", "png"):
        _check_pixels(data, fmt)
        try:
            pixels = decode_image(
                torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB
            )
        except RuntimeError as error:
            raise ValueError(f"a corrupt {fmt.upper()} image: {error}") from None
        return pixels.float().div_(255.0)
    if fmt != "npy":
        raise ValueError(f"an image must be {_FORMATS}; these bytes start {data[:8]!r}")
    try:
        array = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError) as error:
        raise ValueError(f"a corrupt .npy array: {error}") from None
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[2] != 3 or min(array.shape[:2]) < 1:
        raise ValueError(
            f"a .npy image must be a uint8 array [H, W, 3], got {array.dtype} {list(array.shape)}"
        )
    return torch.from_numpy(array.copy()).permute(2, 0, 1).float().div_(255.0)


#: The most pixels an image may have: a few MB of JPEG or PNG can declare gigapixels, which decode to
#: 3 bytes and then 12 (float) per pixel; 50 MP (e.g. 8660 x 5773) is 600 MB as floats.
MAX_IMAGE_PIXELS = 50_000_000


def _check_pixels(data: bytes, fmt: str) -> None:
    """Refuse an image whose header declares more than `MAX_IMAGE_PIXELS`, before decoding it."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:  # reads the header only
            width, height = image.size
    except UnidentifiedImageError:
        raise ValueError(f"a corrupt {fmt.upper()} image: its header cannot be read") from None
    except (OSError, SyntaxError) as error:
        raise ValueError(f"a corrupt {fmt.upper()} image: {error}") from None
    except Image.DecompressionBombError:  # Pillow's own bound, far above ours
        raise ValueError(f"a {fmt.upper()} image of more than {MAX_IMAGE_PIXELS} pixels") from None
    if width * height > MAX_IMAGE_PIXELS:
        raise ValueError(
            f"a {fmt.upper()} image of {width} x {height} pixels, more than {MAX_IMAGE_PIXELS}: scale it down"
        )


def decode_image_field(value: object, field: str = "image"):  # -> torch.Tensor
    """The event's ``field`` (base64 text of image bytes) as a float tensor ``[3, H, W]`` in [0, 1]."""
    if not isinstance(value, str):
        raise ValueError(f"{field!r} must be {_FORMATS}, got {type(value).__name__}")
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as error:  # ValueError: text beyond ASCII
        raise ValueError(f"{field!r} is not base64 text: {error}") from None
    try:
        return decode_image_bytes(data)
    except ValueError as error:
        raise ValueError(f"{field!r}: {error}") from None


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:40]} is beyond a float's range")
    return value


def _int64(text: str) -> int:
    """An integer the runtimes can carry: events cross to the functions as msgpack, 64-bit integers."""
    value = int(text)
    if not carries_int(value):
        raise ValueError(f"the integer {text[:40]}{'...' if len(text) > 40 else ''} does not fit 64 bits")
    return value


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def load_event_json(data: bytes, what: str) -> dict[str, Any]:
    """A JSON object nested at most `MAX_JSON_DEPTH` deep (deeper is refused before it can exhaust
    the parser's recursion); `BodyError` naming `what` otherwise."""
    too_deep = f"{what} nests objects or lists more than {MAX_JSON_DEPTH} levels deep"
    containers = data.count(b"[") + data.count(b"{")
    if containers > MAX_JSON_CONTAINERS:
        raise BodyError(
            f"{what} holds about {containers} objects or lists, more than {MAX_JSON_CONTAINERS}: send large "
            "arrays as an image or a base64 .npy"
        )
    try:
        text = data.decode("utf-8-sig")  # JSON travels as UTF-8 (RFC 8259), which holds no lone surrogate
    except UnicodeDecodeError as error:
        raise BodyError(f"{what} is not UTF-8 text: {error}") from None
    try:
        event = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float, parse_int=_int64)
    except ValueError as error:  # JSONDecodeError, and the number limits below
        raise BodyError(
            f"{what} is not JSON: {error} (send a JSON event, an image/jpeg or image/png body, "
            "or multipart/form-data)"
        ) from None
    except RecursionError:
        raise BodyError(too_deep) from None
    if json_depth(event) > MAX_JSON_DEPTH:
        raise BodyError(too_deep)
    if not isinstance(event, dict):
        raise BodyError(f"{what} must be a JSON object (the event), got {type(event).__name__}")
    if _SURROGATE_ESCAPE.search(data):  # a lone one is no text: events cross to functions as UTF-8
        try:
            json.dumps(event, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise BodyError(
                f"{what} holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without its pair): not "
                "text"
            ) from None
    return event


def event_from_body(content_type: str, body: bytes) -> dict[str, Any]:
    """The event a request body carries (see the module docstring); ``BodyError`` if none."""
    kind = content_type.split(";")[0].strip().lower()
    if kind in IMAGE_CONTENT_TYPES:
        if image_format(body) not in ("jpeg", "png"):
            raise BodyError(f"the body is declared {kind} but is not a JPEG or PNG image")
        return {"image": base64.b64encode(body).decode("ascii")}
    if kind == "multipart/form-data":
        return _multipart_event(content_type, body)
    return load_event_json(body, "the body")


#: Parts a multipart body may have: an upload is an image or a few, and an `event` part. The parser
#: costs about 3 CPU-seconds per MiB of tiny parts (measured), so their number is bounded first.
MAX_MULTIPART_PARTS = 64


def _multipart_event(content_type: str, body: bytes) -> dict[str, Any]:
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode()
    # Every delimiter line, of the parts nested in parts too (the parser reads those alike); the last
    # of each multipart closes it.
    delimiters = body.count(b"\n--") + body.startswith(b"--")
    if delimiters - 1 > MAX_MULTIPART_PARTS:
        raise BodyError(f"the multipart body has {delimiters - 1} parts, more than {MAX_MULTIPART_PARTS}")
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + body)
    if not message.is_multipart():
        raise BodyError("the multipart/form-data body has no parts (is the boundary right?)")
    event: dict[str, Any] = {}
    fields: dict[str, Any] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not name:
            raise BodyError("a multipart part has no name (Content-Disposition: form-data; name=...)")
        data = part.get_payload(decode=True) or b""
        if part.get_filename() or part.get_content_type() in IMAGE_CONTENT_TYPES:
            if image_format(data) is None:
                raise BodyError(f"the file in part {name!r} is not a JPEG, PNG or .npy image")
            fields[name] = base64.b64encode(data).decode("ascii")
        elif name == "event":
            event = load_event_json(data, "the 'event' part")
        else:
            fields[name] = data.decode("utf-8", errors="replace")
    return {**event, **fields}
