"""The function SDK: the decorator, its metadata, and a light `import streambox`."""

from __future__ import annotations

import subprocess
import sys

import pytest

import streambox
from streambox.sdk import FunctionMeta, meta_of


def test_decorator_records_models_and_keeps_the_handler_callable():
    @streambox.function(models=["resnet18"])
    def handler(ctx, event):
        return {"echo": event}

    assert handler.__streambox__ == FunctionMeta(models=["resnet18"])
    assert meta_of(handler).models == ["resnet18"]
    assert handler(None, {"a": 1}) == {"echo": {"a": 1}}


def test_bare_decorator_and_options():
    @streambox.function
    def bare(ctx, event):
        return None

    @streambox.function(models=["vgg16"], max_instances=2, timeout_s=5.0)
    def tuned(ctx, event):
        return None

    assert meta_of(bare) == FunctionMeta()
    assert meta_of(tuned) == FunctionMeta(models=["vgg16"], max_instances=2, timeout_s=5.0)
    assert meta_of(lambda ctx, event: None) is None


def test_models_must_be_a_list_of_names():
    with pytest.raises(TypeError, match="list of model names"):
        streambox.function(models="resnet18")


def test_import_streambox_loads_neither_torch_nor_the_device_layer(tmp_path):
    code = (
        "import sys, streambox; "
        "print(sorted(m for m in ('torch', 'streambox.device', 'zmq') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
