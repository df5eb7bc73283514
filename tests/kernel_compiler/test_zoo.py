from __future__ import annotations

import pytest
import torch

from streambox.kernel_compiler.zoo import ZOO, UnknownModelError, build_model, example_input


def test_unknown_model_lists_known_names() -> None:
    with pytest.raises(KeyError) as info:
        build_model("resnet9000")
    err = info.value
    assert isinstance(err, UnknownModelError)
    message = str(err)
    assert "resnet9000" in message
    for name in ZOO:
        assert name in message
    with pytest.raises(UnknownModelError):
        example_input("nope", 1)


def test_entries_are_well_formed() -> None:
    assert {
        "ssdlite320_mobilenet_v3",
        "resnet18",
        "resnet50",
        "vgg16",
        "espcn",
        "text_encoder",
        "alexnet",
        "mobilenet_v3_small",
    } <= set(ZOO)
    for name, entry in ZOO.items():
        assert entry.name == name
        assert entry.source in ("torchvision", "streambox")
        assert entry.description


def test_build_is_seeded_and_in_eval_mode() -> None:
    a, b = build_model("espcn"), build_model("espcn")
    assert not a.training
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb and torch.equal(pa, pb)


def test_build_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model("espcn")
    assert torch.equal(torch.rand(3), expected)


def test_example_input_shapes_and_dtypes() -> None:
    x = example_input("resnet18", 2)
    assert x.shape == (2, 3, 224, 224) and x.dtype == torch.float32
    assert torch.equal(x, example_input("resnet18", 2))
    ids = example_input("text_encoder", 3, (10,))
    assert ids.shape == (3, 10) and ids.dtype == torch.int64
    assert int(ids.min()) >= 0 and int(ids.max()) < ZOO["text_encoder"].vocab_size
