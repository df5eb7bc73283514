"""The paper's three workflows (Fig. 11) end to end in run-local mode at the zoo's small input sizes:
real plans on the emulated GPU, data handed over by keys, nothing left behind."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from streambox.workflows.engine import Engine
from streambox.workflows.examples import load_example, sample_event
from streambox.workflows.examples.imaging import (
    crop_resize,
    decode_image,
    encode_image,
    synthetic_image,
    tokenize,
)
from streambox.workflows.examples.traffic import DEFAULTS, anchors_for, feature_map_sizes


async def run_example(invoker, name: str, seeds: list[int]):
    spec = load_example(name, small=True)
    engine = Engine(invoker)
    await engine.deploy(spec)
    results, used = [], []
    for seed in seeds:
        result = await engine.run(name, sample_event(name, seed))
        assert result.ok, f"{result.error}\n{result.traceback}"
        assert invoker.stored_keys(name) == 0
        results.append(result)
        used.append(next(s.pool_used_bytes for s in invoker.runtime_stats() if s.workflow == name))
    await engine.close()
    return results, used


def test_image_processing(make_invoker, run):
    (first, again, other), used = run(run_example(make_invoker(), "image-processing", [0, 0, 1]))
    out = first.output
    assert out["input_shape"] == [32, 32] and out["enhanced_shape"] == [64, 64, 3]  # ESPCN: x2
    assert 0 <= out["identity"] < 1000 and 0 < out["confidence"] <= 1
    assert again.output == out  # deterministic
    assert other.output["enhanced_mean"] != out["enhanced_mean"]  # it does look at the picture
    assert [c.label for c in first.calls] == ["recognize", "enhance"]
    assert first.cold_starts == 2 and again.cold_starts == 0
    assert used[0] == used[1] == used[2]  # only the resident weights stay


def test_image_processing_can_return_the_enhanced_image(make_invoker, run):
    async def go():
        engine = Engine(make_invoker())
        await engine.deploy(load_example("image-processing", small=True))
        result = await engine.run(
            "image-processing", {**sample_event("image-processing", 2), "return_image": True}
        )
        await engine.close()
        return result

    result = run(go())
    image = np.load(io.BytesIO(base64.b64decode(result.output["image"])))
    assert image.dtype == np.uint8 and image.shape == (64, 64, 3)
    assert round(float(image.mean()), 4) == result.output["enhanced_mean"]


def test_traffic_fans_out_per_object(make_invoker, run):
    (first, again), used = run(run_example(make_invoker(), "traffic", [0, 0]))
    faces, cars = first.output["face"], first.output["car"]
    assert len(faces) == 2 and len(cars) == 2  # max_people, max_vehicles of the small variant
    assert {f["label"] for f in faces} == {"person"}
    assert {c["label"] for c in cars} <= {"bicycle", "car", "motorcycle", "bus", "truck"}
    for obj in faces + cars:
        x1, y1, x2, y2 = obj["box"]
        assert 0 <= x1 < x2 <= 320 and 0 <= y1 < y2 <= 240  # in the request image's pixels
    assert all(0 <= f["identity"] < 1000 for f in faces) and all(0 <= c["make_model"] < 1000 for c in cars)
    assert [c.label for c in first.calls] == ["detect", "face[0]", "face[1]", "car[0]", "car[1]"]
    assert again.output == first.output
    assert used[0] == used[1]


def test_social_media_fans_in(make_invoker, run):
    (first, second), used = run(run_example(make_invoker(), "social-media", [0, 2]))
    out = first.output
    assert out["post_id"] == "post-0" and out["tokens"] == 13
    assert isinstance(out["topic"], str) and isinstance(out["flagged"], bool)
    assert 0 <= out["image_class"] < 1000
    assert second.output["post_id"] == "post-2"
    assert [c.label for c in first.calls] == ["text", "vision", "aggregate"]
    assert used[0] == used[1]


def test_bad_events_fail_with_the_reason(make_invoker, run):
    async def go():
        engine = Engine(make_invoker())
        await engine.deploy(load_example("traffic", small=True))
        result = await engine.run("traffic", {"image": "not base64 at all!"})
        await engine.close()
        return result

    result = run(go())
    assert result.status == "error" and result.failed_call == "detect"
    assert result.error.startswith("detect failed: InvalidInput: 'image' is not base64 text")
    assert result.error_type == "InvalidInput"  # the gateway's 400: the caller's input is wrong


def test_images_round_trip_and_crops():
    image = synthetic_image(7, 48, 64)
    assert image.shape == (48, 64, 3) and image.dtype == np.uint8
    assert np.array_equal(synthetic_image(7, 48, 64), image) and not np.array_equal(
        synthetic_image(8, 48, 64), image
    )
    tensor = decode_image(encode_image(image))
    assert tensor.shape == (3, 48, 64) and torch.equal(
        tensor, torch.from_numpy(image).permute(2, 0, 1) / 255.0
    )
    assert crop_resize(tensor, [10.5, 4.0, 30.0, 20.0], 32).shape == (1, 3, 32, 32)
    assert crop_resize(tensor, [63.0, 47.0, 63.0, 47.0], 8).shape == (1, 3, 8, 8)  # a degenerate box
    with pytest.raises(ValueError, match=r"uint8 array \[H, W, 3\]"):
        decode_image(encode_image(image)[:0] or base64.b64encode(_npy(np.zeros((4, 4)))).decode())
    ids, count = tokenize("Hello world hello", 5, 8000)
    assert count == 3 and ids.shape == (1, 5) and ids[0, 0] == ids[0, 2] and ids[0, 3:].tolist() == [0, 0]


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def test_ssdlite_anchors_match_the_detector_outputs():
    assert feature_map_sizes(320) == [20, 10, 5, 3, 2, 1]
    assert anchors_for(320, 3234).shape == (3234, 4)  # torchvision's count for SSDlite320
    assert anchors_for(64, 144).shape == (144, 4)  # what the small plan's head gives
    with pytest.raises(ValueError, match="expected feature maps"):
        anchors_for(64, 100)
    assert DEFAULTS["image_size"] == load_example("traffic").functions["detect"].params["image_size"] == 320
