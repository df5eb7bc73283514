"""Images as JPEG or PNG: decoding, request bodies (binary, multipart, base64 in JSON) and a bundled
workflow served through the gateway from a PNG body."""

from __future__ import annotations

import asyncio
import base64
import json

import aiohttp
import numpy as np
import pytest
import torch
from torchvision.io import encode_jpeg, encode_png

from streambox.cli import main
from streambox.workflows.engine import Engine
from streambox.workflows.examples import load_example
from streambox.workflows.examples.imaging import encode_image, synthetic_image
from streambox.workflows.gateway import Gateway, GatewayServer
from streambox.workflows.image_input import (
    MAX_MULTIPART_PARTS,
    BodyError,
    decode_image_field,
    event_from_body,
    image_field,
)
from streambox.workflows.validation import parse_spec


def _image() -> np.ndarray:
    return synthetic_image(3, 40, 56)


def _png(image: np.ndarray) -> bytes:
    return encode_png(torch.from_numpy(image).permute(2, 0, 1).contiguous()).numpy().tobytes()


def test_png_jpeg_and_npy_decode_to_the_same_pixels():
    image = _image()
    want = torch.from_numpy(image).permute(2, 0, 1).float() / 255.0
    assert torch.equal(decode_image_field(image_field(_png(image))), want)  # PNG is lossless
    assert torch.equal(decode_image_field(encode_image(image)), want)
    jpeg = encode_jpeg(torch.from_numpy(image).permute(2, 0, 1).contiguous(), quality=95).numpy().tobytes()
    got = decode_image_field(image_field(jpeg))
    assert got.shape == want.shape and float((got - want).abs().mean()) < 0.03  # lossy, but close


def test_bad_images_say_what_is_accepted():
    with pytest.raises(ValueError, match="not an image: expected JPEG, PNG or .npy"):
        image_field(b"GIF89a...")
    with pytest.raises(ValueError, match="'image' must be base64 text of JPEG, PNG or .npy"):
        decode_image_field(7)
    with pytest.raises(ValueError, match="'image' is not base64 text"):
        decode_image_field("not base64!")
    with pytest.raises(ValueError, match="'image': a corrupt PNG image"):
        decode_image_field(base64.b64encode(_png(_image())[:40]).decode())


def test_an_image_is_refused_by_its_header_before_it_is_decoded():
    """A few hundred KB of PNG can declare gigapixels: refused from the header, not decoded."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (10_000, 6_000)).save(buffer, format="PNG")
    with pytest.raises(ValueError, match="10000 x 6000 pixels, more than 50000000"):
        decode_image_field(base64.b64encode(buffer.getvalue()).decode())
    with pytest.raises(ValueError, match="'image': a corrupt PNG image: its header cannot be read"):
        decode_image_field(base64.b64encode(b"\x89PNG\r\n\x1a\n").decode())
    with pytest.raises(ValueError, match="'image' is not base64 text"):
        decode_image_field("\N{GRINNING FACE}")


def test_request_bodies_become_events():
    png = _png(_image())
    assert event_from_body("image/png", png) == {"image": base64.b64encode(png).decode()}
    assert event_from_body("application/json", b'{"a": 1}') == {"a": 1}
    with pytest.raises(BodyError, match="declared image/jpeg but is not a JPEG or PNG"):
        event_from_body("image/jpeg", b"hello")
    with pytest.raises(BodyError, match="the body is not JSON"):
        event_from_body("text/plain", b"hello")
    with pytest.raises(BodyError, match="must be a JSON object"):
        event_from_body("application/json", b"[1]")
    # numbers JSON has no place for, or Python's parser refuses: a 400, not a 500
    refused = (
        (b'{"a": NaN}', "NaN is not a JSON number"),
        (b'{"a": 1e999}', "beyond a float's range"),
        (b'{"a": ' + b"1" * 5000 + b"}", "4300 digits"),
        (b'{"a": {"b": [1180591620717411303424]}}', "1180591620717411303424 does not fit 64 bits"),  # 2**70
    )
    assert event_from_body("application/json", b'{"a": -9223372036854775808, "b": 18446744073709551615}')
    for body, why in refused:
        with pytest.raises(BodyError, match=why):
            event_from_body("application/json", body)
    with pytest.raises(BodyError, match="more than 1000000"):  # parsed, it would take ~25x its size
        event_from_body("application/json", b'{"a": [' + b"[]," * 1_000_001 + b"[]]}")

    form = aiohttp.FormData()
    form.add_field("event", json.dumps({"return_image": True, "note": "x"}))
    form.add_field("photo", png, filename="cat.png", content_type="image/png")
    form.add_field("caption", "a cat")
    payload = form()
    body = b"".join(_chunks(payload))
    event = event_from_body(payload.content_type, body)
    assert event == {
        "return_image": True,
        "note": "x",
        "photo": base64.b64encode(png).decode(),
        "caption": "a cat",
    }
    # Parsing costs seconds per MiB of tiny parts: their number is bounded before the parser runs.
    many = aiohttp.FormData(default_to_multipart=True)
    for i in range(MAX_MULTIPART_PARTS + 1):
        many.add_field(f"f{i}", "x")
    payload = many()
    too_many = f"has {MAX_MULTIPART_PARTS + 1} parts, more than {MAX_MULTIPART_PARTS}"
    with pytest.raises(BodyError, match=too_many):
        event_from_body(payload.content_type, b"".join(_chunks(payload)))
    # Parts nested in one part count too (the parser reads them alike).
    inner = b"".join(b"--i\r\nContent-Disposition: form-data; name=a\r\n\r\nx\r\n" for _ in range(100))
    nested = (
        b"--o\r\nContent-Disposition: form-data; name=n\r\nContent-Type: multipart/mixed; boundary=i\r\n\r\n"
        + inner + b"--i--\r\n--o--\r\n"
    )
    with pytest.raises(BodyError, match=f"more than {MAX_MULTIPART_PARTS}"):
        event_from_body("multipart/form-data; boundary=o", nested)


def test_a_lone_surrogate_is_a_400_and_a_pair_is_text():
    """JSON's \\u escapes can name half of a UTF-16 pair, which no UTF-8 text (the functions' events)
    holds: it used to fail the first function, as a 500."""
    assert event_from_body("application/json", b'{"a": "\\ud83d\\ude00"}') == {"a": "\U0001F600"}
    for body in (b'{"a": "\\ud800"}', b'{"\\udfff": 1}', b'{"a": ["x\\uDBFF"]}'):
        with pytest.raises(BodyError, match="lone UTF-16 surrogate"):
            event_from_body("application/json", body)
    # Nor as bytes: UTF-8 has no encoding of a surrogate, and JSON travels as UTF-8 (RFC 8259).
    for body in (b'{"a": "\xed\xa0\x80"}', '{"a": 1}'.encode("utf-16")):
        with pytest.raises(BodyError, match="is not UTF-8 text"):
            event_from_body("application/json", body)
    assert event_from_body("application/json", b'\xef\xbb\xbf{"a": 1}') == {"a": 1}  # a BOM is fine


def _chunks(payload) -> list[bytes]:
    class Sink:
        def __init__(self) -> None:
            self.parts: list[bytes] = []

        async def write(self, data: bytes) -> None:
            self.parts.append(bytes(data))

    import asyncio

    sink = Sink()
    asyncio.run(payload.write(sink))
    return sink.parts


def test_a_bundled_workflow_takes_a_png_body_and_a_multipart_upload(make_invoker, run):
    image = _image()
    png = _png(image)

    async def go():
        engine = Engine(make_invoker())
        await engine.deploy(load_example("image-processing", small=True))
        server = GatewayServer(Gateway(engine))
        await server.start()
        url = f"{server.url}/workflows/image-processing/invoke"
        try:
            async with aiohttp.ClientSession() as session:
                async with session.post(url, json={"image": encode_image(image)}) as r:
                    as_npy = (r.status, await r.json())
                async with session.post(url, data=png, headers={"Content-Type": "image/png"}) as r:
                    as_png = (r.status, await r.json())
                form = aiohttp.FormData()
                form.add_field("image", png, filename="street.png", content_type="image/png")
                async with session.post(url, data=form) as r:
                    as_form = (r.status, await r.json())
                async with session.post(url, data=b"GIF89a", headers={"Content-Type": "image/png"}) as r:
                    refused = (r.status, await r.json())
                bad = []  # JSON events whose image the entry function cannot decode: the caller's fault
                for value in (base64.b64encode(b"\x89PNG\r\n\x1a\n garbage").decode(), 5):
                    async with session.post(url, json={"image": value}) as r:
                        bad.append((r.status, await r.json()))
                async with session.post(url, json={"image": encode_image(image)}) as r:
                    after = (r.status, await r.json())
        finally:
            await server.stop()
            await engine.close()
        return as_npy, as_png, as_form, refused, bad, after

    as_npy, as_png, as_form, refused, bad, after = run(go())
    assert as_npy[0] == as_png[0] == as_form[0] == 200, (as_png, as_form)
    assert as_png[1]["output"] == as_npy[1]["output"] == as_form[1]["output"]
    assert refused[0] == 400 and "not a JPEG or PNG" in refused[1]["error"]
    (corrupt, corrupt_body), (wrong_type, wrong_type_body) = bad
    assert corrupt == wrong_type == 400  # was 500: the function's failure
    assert corrupt_body["error_type"] == "InvalidInput" and corrupt_body["failed_call"] == "recognize"
    assert "recognize failed: InvalidInput: 'image': a corrupt PNG image" in corrupt_body["error"]
    assert "'image' must be" in wrong_type_body["error"]
    assert after[0] == 200 and after[1]["output"] == as_npy[1]["output"]


def test_invoke_command_sends_an_image_file(tmp_path, make_invoker, run, capsys):
    (tmp_path / "image_handlers.py").write_text(
        "from streambox.workflows.image_input import decode_image_field\n"
        "def size(ctx, event):\n"
        "    return {'shape': list(decode_image_field(event['image']).shape), 'tag': event.get('tag')}\n"
    )
    text = "name: sizes\nslo_ms: 50\nfunctions:\n  size: {handler: image_handlers:size}\n"
    spec = parse_spec(text, str(tmp_path / "sizes.yaml"), base_dir=tmp_path)  # its code: the folder
    photo, event = tmp_path / "photo.png", tmp_path / "event.json"
    photo.write_bytes(_png(_image()))
    event.write_text(json.dumps({"tag": "mine"}))

    async def go():
        engine = Engine(make_invoker())
        await engine.deploy(spec)
        server = GatewayServer(Gateway(engine))
        await server.start()
        try:  # the command runs its own event loop: give it a thread
            sent = await asyncio.to_thread(
                main, ["invoke", "sizes", "--image", str(photo), "--input", str(event), "--url", server.url]
            )
            refused = await asyncio.to_thread(
                main, ["invoke", "sizes", "--image", str(event), "--url", server.url]
            )
        finally:
            await server.stop()
            await engine.close()
        return sent, refused

    sent, refused = run(go())
    out, err = capsys.readouterr()
    assert sent == 0 and json.loads(out)["output"] == {"shape": [3, 40, 56], "tag": "mine"}
    assert refused == 2 and "not an image: expected JPEG, PNG or .npy" in err
