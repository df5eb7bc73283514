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

    @streambox.function(models=["vgg16"])
    def tuned(ctx, event):
        return None

    assert meta_of(bare) == FunctionMeta()
    assert meta_of(tuned) == FunctionMeta(models=["vgg16"])
    assert meta_of(lambda ctx, event: None) is None


def test_models_must_be_a_list_of_names():
    with pytest.raises(TypeError, match="list of model names"):
        streambox.function(models="resnet18")
    with pytest.raises(TypeError, match=r"model names \(strings\), got 1 in \[1, 2\]"):
        streambox.function(models=[1, 2])  # validate's model lookup crashed on it


def test_options_a_workflow_sets_are_refused_where_they_would_be_ignored():
    """max_instances, timeout_s, batch and name were recorded and never applied."""
    with pytest.raises(TypeError, match=r"timeout_s=\.\.\.: set it in the workflow's YAML \(timeout_ms\)"):
        streambox.function(models=["vgg16"], timeout_s=5.0)
    with pytest.raises(TypeError, match="max_instances=...: set it in the workflow's YAML"):
        streambox.function(max_instances=2)
    with pytest.raises(TypeError, match="retries=...: it takes only models"):
        streambox.function(retries=2)


def test_import_streambox_loads_neither_torch_nor_the_device_layer(tmp_path):
    code = (
        "import sys, streambox; "
        "print(sorted(m for m in ('torch', 'streambox.device', 'zmq') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_every_runtime_context_offers_the_sdk_protocol_with_one_get_timeout():
    import inspect

    from streambox.api_proxy.client import ProxyContext
    from streambox.sdk import GET_TIMEOUT_S, Context
    from streambox.workflows.local import LocalContext

    calls = ("key", "upload", "download", "infer", "put", "get", "delete", "synchronize")
    for cls in (ProxyContext, LocalContext):  # LocalContext serves the monolithic instances too
        missing = [name for name in calls if not callable(getattr(cls, name, None))]
        assert missing == [], f"{cls.__name__} lacks {missing}"
        assert inspect.signature(cls.get).parameters["timeout"].default == GET_TIMEOUT_S == 10.0
        put = list(inspect.signature(cls.put).parameters)
        assert put[:5] == ["self", "key", "handle", "consumers", "ttl"]
    assert streambox.Context is Context


def test_a_get_timeout_is_a_timeout_error_in_every_runtime():
    from streambox.api_proxy.errors import KeyNotFound, decode_error
    from streambox.comm.errors import GetTimeout

    assert issubclass(GetTimeout, TimeoutError) and issubclass(KeyNotFound, TimeoutError)
    assert isinstance(decode_error(["KeyNotFound", "GET 'k': no data"]), TimeoutError)


def test_errors_cross_the_wire_structured():
    from streambox.api_proxy.errors import FunctionFailed, decode_error, encode_error, with_fields

    failed = FunctionFailed("ValueError: bad (function 'f')")
    sent = with_fields(failed, error_type="ValueError", message="bad")
    got = decode_error(encode_error(sent))
    assert isinstance(got, FunctionFailed)
    assert got.fields == {"error_type": "ValueError", "message": "bad"}
    assert decode_error(["KeyNotFound", "GET 'k'"]).fields == {}  # the two-field form still decodes


def test_a_handlers_failure_is_bounded_on_the_wire():
    """A 30 MB message used to cross three times (error, message, traceback) into a 90 MB body."""
    from streambox.api_proxy.client import MAX_ERROR_CHARS, _failure
    from streambox.sdk import InvalidInput

    try:
        raise InvalidInput("x" * (3 * MAX_ERROR_CHARS))
    except InvalidInput as exc:
        kind, message, text = _failure(exc)
    assert kind == "InvalidInput"
    assert message.startswith("x" * 100) and message.endswith(f"... ({2 * MAX_ERROR_CHARS} more characters)")
    assert len(text) < MAX_ERROR_CHARS + 100 and text.startswith("(") and "characters cut" in text
