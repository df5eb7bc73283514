"""Workflow YAML validation: every mistake named by file, line, column and field, all at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from streambox.workflows.examples import EXAMPLES, SMALL_PARAMS, example_path, load_example
from streambox.workflows.spec import WorkflowSpec
from streambox.workflows.validation import WorkflowValidationError, parse_spec, validate_file

HERE = Path(__file__).parent
ZOO_NAMES = (
    "alexnet, espcn, mobilenet_v3_small, resnet18, resnet50, ssdlite320_mobilenet_v3, text_encoder, vgg16"
)


@pytest.fixture(autouse=True)
def empty_model_pool(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Known models are the zoo's plus those registered in the pool: start from an empty pool."""
    monkeypatch.setenv("STREAMBOX_MODEL_POOL", str(tmp_path_factory.mktemp("model_pool")))


def errors(text: str) -> list[str]:
    with pytest.raises(WorkflowValidationError) as info:
        parse_spec(text, "demo.yaml", HERE)
    lines = str(info.value).splitlines()
    assert len(lines) == len(info.value.issues)
    return lines


def test_a_minimal_workflow_gets_the_defaults():
    spec = parse_spec(
        "name: demo\nslo_ms: 50\nfunctions:\n  a: {handler: wf_test_handlers:echo}\n", "d.yaml", HERE
    )
    fn = spec.functions["a"]
    assert (spec.timeout_ms, spec.edges, spec.output, spec.base_dir) == (30_000.0, [], None, HERE)
    assert (fn.models, fn.batch_size, fn.max_instances, fn.timeout_ms, fn.params) == ([], 1, 4, None, {})


def test_unknown_key_suggests_the_right_one():
    text = "name: demo\nslo_ms: 100\nfunctions:\n  a:\n    handler: wf_test_handlers:echo\n    batchsize: 2\n"
    assert errors(text) == [
        "demo.yaml:6:5: functions.a.batchsize: unknown key; did you mean 'batch_size'? "
        "(allowed keys: handler, models, batch_size, max_instances, max_batch_size, max_queue_delay_ms, "
        "timeout_ms, gpu_percent, host_memory_mb, params)"
    ]


def test_bad_types_are_all_reported_in_file_order():
    text = (
        "name: demo\n"
        "slo_ms: fast\n"
        "functions:\n"
        '  a: {handler: wf_test_handlers:echo, max_instances: "4", models: resnet18}\n'
    )
    assert errors(text) == [
        "demo.yaml:2:1: slo_ms: Input should be a valid number (got 'fast')",
        "demo.yaml:4:39: functions.a.max_instances: Input should be a valid integer (got '4')",
        "demo.yaml:4:59: functions.a.models: Input should be a valid list (got 'resnet18')",
    ]


def test_gpu_percent_is_a_whole_share_of_the_gpu():
    head = "name: demo\nslo_ms: 50\nfunctions:\n"
    spec = parse_spec(head + "  a: {handler: wf_test_handlers:echo, gpu_percent: 50}\n", "d.yaml", HERE)
    assert spec.functions["a"].gpu_percent == 50
    text = (
        head
        + "  a: {handler: wf_test_handlers:echo, gpu_percent: 0}\n"
        + "  b: {handler: wf_test_handlers:echo, gpu_percent: 150}\n"
        + '  c: {handler: wf_test_handlers:echo, gpu_percent: "50"}\n'
    )
    assert errors(text) == [
        "demo.yaml:4:39: functions.a.gpu_percent: Input should be greater than or equal to 1 (got 0)",
        "demo.yaml:5:39: functions.b.gpu_percent: Input should be less than or equal to 100 (got 150)",
        "demo.yaml:6:39: functions.c.gpu_percent: Input should be a valid integer (got '50')",
    ]


def test_batching_fields_default_to_no_batching_and_bad_values_are_named():
    head = "name: demo\nslo_ms: 50\nfunctions:\n"
    plain = parse_spec(head + "  a: {handler: wf_test_handlers:echo}\n", "d.yaml", HERE).functions["a"]
    assert (plain.max_batch_size, plain.max_queue_delay_ms) == (1, 0.0)
    good = head + "  a: {handler: wf_test_handlers:echo, max_batch_size: 8, max_queue_delay_ms: 2}\n"
    fn = parse_spec(good, "d.yaml", HERE).functions["a"]
    assert (fn.max_batch_size, fn.max_queue_delay_ms) == (8, 2.0)
    text = (
        head
        + "  a: {handler: wf_test_handlers:echo, max_batch_size: 0}\n"
        + "  b: {handler: wf_test_handlers:echo, max_batch_size: 65}\n"
        + '  c: {handler: wf_test_handlers:echo, max_queue_delay_ms: -1}\n'
        + '  d: {handler: wf_test_handlers:echo, max_queue_delay_ms: "5"}\n'
    )
    assert errors(text) == [
        "demo.yaml:4:39: functions.a.max_batch_size: Input should be greater than or equal to 1 (got 0)",
        "demo.yaml:5:39: functions.b.max_batch_size: Input should be less than or equal to 64 (got 65)",
        "demo.yaml:6:39: functions.c.max_queue_delay_ms: Input should be greater than or equal to 0 "
        "(got -1)",
        "demo.yaml:7:39: functions.d.max_queue_delay_ms: Input should be a valid number (got '5')",
    ]
    assert errors(head + "  e: {handler: wf_test_handlers:echo, batch_size: 4, max_batch_size: 2}\n") == [
        "demo.yaml:4:54: functions.e.max_batch_size: 2 is smaller than batch_size (4): a batch holds "
        "whole invocations' inputs, so it must be 1 (no batching) or at least 4"
    ]
    # Settings under which batching cannot work: named, not accepted.
    echo = "handler: wf_test_handlers:echo"
    uneven = head + f"  f: {{{echo}, batch_size: 3, max_batch_size: 4, max_queue_delay_ms: 2}}\n"
    assert errors(uneven) == [
        "demo.yaml:4:54: functions.f.max_batch_size: 4 is less than two invocations' samples (6, "
        "batch_size 3 each): no batch would ever hold more than one; set 1 (no batching) or at least 6"
    ]
    two_in_five = uneven.replace("batch_size: 3", "batch_size: 2")
    two_in_five = two_in_five.replace("max_batch_size: 4", "max_batch_size: 5")
    assert parse_spec(two_in_five, "d.yaml", HERE).functions["f"].max_batch_size == 5  # 2 + 2 fit in 5
    late = head + f"  g: {{{echo}, max_batch_size: 4, max_queue_delay_ms: 600, timeout_ms: 500}}\n"
    assert errors(late) == [
        "demo.yaml:4:58: functions.g.max_queue_delay_ms: 600 ms is not shorter than the invocation's time "
        "limit (500 ms, its timeout_ms): a call no other joins would time out waiting for its batch"
    ]
    # A function's own limit longer than the request's: the request's timeout ends the call first.
    longer = f"name: demo\nslo_ms: 50\ntimeout_ms: 1000\nfunctions:\n  g: {{{echo}, max_batch_size: 4, "
    longer += "max_queue_delay_ms: 5000, timeout_ms: 20000}\n"
    assert errors(longer) == [
        "demo.yaml:5:58: functions.g.max_queue_delay_ms: 5000 ms is not shorter than the invocation's time "
        "limit (1000 ms, the workflow's timeout_ms): a call no other joins would time out waiting for its "
        "batch"
    ]


def test_batching_settings_that_would_leave_it_off_are_named():
    head = "name: demo\nslo_ms: 50\nfunctions:\n"
    echo = "handler: wf_test_handlers:echo"
    assert errors(head + f"  a: {{{echo}, max_batch_size: 4}}\n") == [
        "demo.yaml:4:39: functions.a.max_batch_size: 4 needs max_queue_delay_ms > 0 too (how long a batch "
        "waits for more calls): with 0 every call runs alone; set both, or max_batch_size: 1"
    ]
    assert errors(head + f"  a: {{{echo}, max_queue_delay_ms: 5}}\n") == [
        "demo.yaml:4:39: functions.a.max_queue_delay_ms: 5 ms has no effect without max_batch_size > 1 "
        "(batching is off); set max_batch_size, or leave max_queue_delay_ms out"
    ]


def test_handler_mistakes_found_before_any_call(tmp_path):
    """An async handler, a file name for a module, a model the decorator declares that nothing knows."""
    (tmp_path / "hh.py").write_text(
        "import streambox\n\n"
        "async def arun(ctx, event):\n    return event\n\n"
        "@streambox.function(models=['nosuch'])\ndef ghost(ctx, event):\n    return event\n"
    )
    text = (
        "name: demo\nslo_ms: 100\nfunctions:\n"
        "  a: {handler: hh:arun}\n"
        "  b: {handler: hh.py:arun}\n"
        "  c: {handler: hh:ghost}\n"
    )
    with pytest.raises(WorkflowValidationError) as info:
        parse_spec(text, "demo.yaml", tmp_path)
    lines = str(info.value).splitlines()
    assert lines[0].startswith("demo.yaml:4:7: functions.a.handler: handler 'hh:arun' is an async function")
    assert lines[1] == (
        "demo.yaml:5:7: functions.b.handler: handler 'hh.py:arun': a handler names a module, not a file: "
        "did you mean 'hh:arun'?"
    )
    assert lines[2].startswith(
        "demo.yaml:6:7: functions.c.handler: the handler declares unknown model 'nosuch'; known models: "
    )
    assert len(lines) == 3


def test_missing_keys_point_at_the_enclosing_mapping():
    assert errors("name: demo\nfunctions:\n  a: {models: []}\n") == [
        "demo.yaml:1:1: slo_ms: required key is missing",
        "demo.yaml:3:3: functions.a.handler: required key is missing",
    ]


def test_names_must_be_url_and_label_safe():
    text = "name: Demo App\nslo_ms: -1\nfunctions:\n  Detect: {handler: wf_test_handlers:echo}\n"
    rule = "is not a valid name: lowercase letters, digits, '-' and '_', starting with a letter or digit"
    assert errors(text) == [
        f"demo.yaml:1:1: name: 'Demo App' {rule}",
        "demo.yaml:2:1: slo_ms: Input should be greater than 0 (got -1)",
        f"demo.yaml:4:3: functions.Detect: 'Detect' {rule}",
    ]


def test_cycle_is_named_at_the_edge_that_closes_it():
    text = (
        "name: demo\nslo_ms: 100\nfunctions:\n"
        "  a: {handler: wf_test_handlers:echo}\n"
        "  b: {handler: wf_test_handlers:echo}\n"
        "  c: {handler: wf_test_handlers:echo}\n"
        "edges:\n"
        "  - {from: a, to: b}\n"
        "  - {from: b, to: c}\n"
        "  - {from: c, to: b}\n"
    )
    assert errors(text) == ["demo.yaml:10:5: edges[2]: edges form a cycle: b -> c -> b"]


def test_edges_must_name_functions_and_joins_must_fan_in():
    head = (
        "name: demo\nslo_ms: 100\nfunctions:\n"
        "  a: {handler: wf_test_handlers:echo}\n"
        "  b: {handler: wf_test_handlers:echo}\n"
        "  c: {handler: wf_test_handlers:echo}\n"
        "edges:\n"
    )
    assert errors(head + "  - {from: a, to: x}\n  - {from: a, to: a}\n") == [
        "demo.yaml:8:15: edges[0].to: unknown function 'x'; functions: a, b, c",
        "demo.yaml:9:15: edges[1].to: edge from 'a' to itself",
    ]
    assert errors(head + "  - {from: a, to: c}\n  - {from: b, to: c}\n") == [
        "demo.yaml:8:15: edges[0].to: function 'c' has 2 upstream functions (a, b): "
        "a join must wait for all of them, set fan_in: true on its incoming edges"
    ]
    assert errors(head + "  - {from: a, to: c, fan_in: true}\n  - {from: b, to: c}\n") == [
        "demo.yaml:9:5: edges[1].fan_in: function 'c' is fan-in on some incoming edges but not on this "
        "one: set fan_in on all of them"
    ]
    assert errors(head + "  - {from: a, to: b}\n  - {from: a, to: b, fan_out: true}\n") == [
        "demo.yaml:9:5: edges[1]: duplicate edge a -> b (first at edges[0])"
    ]
    assert errors(head.replace("slo_ms: 100", "slo_ms: 100\noutput: z") + "  - {from: a, to: b}\n") == [
        "demo.yaml:3:1: output: unknown function 'z'; functions: a, b, c"
    ]


def test_handlers_must_import_and_take_ctx_and_event():
    text = (
        "name: demo\nslo_ms: 100\nfunctions:\n"
        "  a: {handler: no_such_module:fn}\n"
        "  b: {handler: wf_test_handlers:nope}\n"
        "  c: {handler: wf_test_handlers:peaks}\n"
        "  d: {handler: wf_test_handlers}\n"
    )
    assert errors(text) == [
        "demo.yaml:7:7: functions.d.handler: 'wf_test_handlers' is not a handler reference of the form "
        "module:function (e.g. my_handlers:detect)"
    ]
    lines = errors(text.replace("  d: {handler: wf_test_handlers}\n", ""))
    assert lines[0].startswith(
        "demo.yaml:4:7: functions.a.handler: cannot import module 'no_such_module': "
        "it is not in the workflow's code (handlers must be modules of the workflow's own code"
    )
    assert lines[1].startswith(
        "demo.yaml:5:7: functions.b.handler: module 'wf_test_handlers' has no attribute 'nope'; "
        "its functions: classify, consume, echo,"
    )
    assert (
        lines[2] == "demo.yaml:6:7: functions.c.handler: 'wf_test_handlers:peaks' is not a function but "
        "a value of type dict"
    )


def test_unknown_models_list_the_zoo():
    text = "name: demo\nslo_ms: 100\nfunctions:\n  a:\n    handler: wf_test_handlers:echo\n"
    assert errors(text + "    models: [resnet18, resnet19, resnet18]\n") == [
        f"demo.yaml:6:24: functions.a.models[1]: unknown model 'resnet19'; known models: {ZOO_NAMES}",
        "demo.yaml:6:34: functions.a.models[2]: model 'resnet18' is listed twice",
    ]


def test_yaml_mistakes_duplicate_keys_and_non_mappings():
    assert errors("name: demo\nslo_ms: [100\nfunctions: {}\n") == [
        "demo.yaml:3:10: invalid YAML: while parsing a flow sequence; expected ',' or ']', but got ':'"
    ]
    assert errors(
        "name: demo\nslo_ms: 100\nslo_ms: 200\nfunctions: {a: {handler: wf_test_handlers:echo}}\n"
    ) == ["demo.yaml:3:1: slo_ms: duplicate key"]
    assert errors("- a\n- b\n") == [
        "demo.yaml:1:1: a workflow is a YAML mapping with the keys name, description, slo_ms, timeout_ms, "
        "output, functions, edges, max_invocations; found a list"
    ]
    assert errors("") == [
        "demo.yaml: a workflow is a YAML mapping with the keys name, description, slo_ms, timeout_ms, "
        "output, functions, edges, max_invocations; found an empty file"
    ]


def test_a_value_its_tag_refuses_is_named_and_a_merged_key_may_be_overridden():
    """`!!timestamp abc` was a traceback and `!!int abc` an error without file or line; a key of the
    mapping's own overriding one merged in with `<<` was called a duplicate (YAML lets it win)."""
    head = "name: demo\nslo_ms: 100\nfunctions:\n"
    tagged = "  a: {handler: wf_test_handlers:echo, params: {t: !!timestamp abc, n: !!int x}}\n"
    assert errors(head + tagged) == [
        "demo.yaml:4:51: functions.a.params.t: 'abc' is not a valid !!timestamp",
        "demo.yaml:4:71: functions.a.params.n: 'x' is not a valid !!int",
    ]
    merged = head + (
        "  a: &base {handler: wf_test_handlers:echo, max_instances: 2}\n"
        "  b: {<<: *base, max_instances: 3}\n"
    )
    spec = parse_spec(merged, "demo.yaml", HERE)
    assert spec.functions["a"].max_instances == 2 and spec.functions["b"].max_instances == 3
    again = merged.replace("  b: {<<", "  b: &b {<<") + "  c: *b\n"  # reached again through an alias
    assert parse_spec(again, "demo.yaml", HERE).functions["c"].max_instances == 3
    assert errors(merged.replace("max_instances: 3}", "max_instances: 3, max_instances: 4}")) == [
        "demo.yaml:5:36: functions.b.max_instances: duplicate key"
    ]


def test_plain_values_are_read_as_yaml_1_2_and_what_1_1_read_otherwise_is_named():
    """PyYAML's YAML 1.1 read max_instances: 010 as 8, 1:30 as 90 and fan_out: yes as true, past a
    schema that calls yes for a flag a mistake; 2e2 was text. Read as YAML 1.2 they are text, which in
    free-form params would silently turn `debug: no` true: each is named, with how to write it."""
    head = "name: demo\nslo_ms: 2e2\nfunctions:\n"
    spec = parse_spec(head + "  a: {handler: wf_test_handlers:echo, params: {d: 2024-01-01, q: 'no'}}\n",
                      "demo.yaml", HERE)
    assert spec.slo_ms == 200 and spec.functions["a"].params == {"d": "2024-01-01", "q": "no"}
    typed = "  a: {handler: wf_test_handlers:echo, max_instances: 010, params: {t: 1:30}}\n"
    assert errors(head + typed) == [
        "demo.yaml:4:54: functions.a.max_instances: '010' is text in YAML 1.2 (YAML 1.1 read it as an int): "
        "write it in decimal (1000, 8.5), or quote it ('010') for text",
        "demo.yaml:4:71: functions.a.params.t: '1:30' is text in YAML 1.2 (YAML 1.1 read it as an int): "
        "write it in decimal (1000, 8.5), or quote it ('1:30') for text",
    ]
    fan = head + (
        "  a: {handler: wf_test_handlers:split}\n  b: {handler: wf_test_handlers:echo}\n"
        "edges:\n  - {from: a, to: b, fan_out: yes}\n"
    )
    assert errors(fan) == [
        "demo.yaml:7:31: edges[0].fan_out: 'yes' is text in YAML 1.2 (YAML 1.1 read it as a bool): write "
        "true or false, or quote it ('yes') for text"
    ]
    bound = fan.replace("fan_out: yes", "max_items: 5")  # bounds nothing: the edge does not fan out
    assert errors(bound) == [
        "demo.yaml:7:22: edges[0].max_items: bounds the items of a fan_out edge; this edge does not fan out "
        "(fan_out: true), so it would do nothing"
    ]


def test_validate_file_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: demo\nslo_ms: 100\nfunctions:\n  a: {handler: my_handlers:run, models: [gpt5]}\n")
    (tmp_path / "my_handlers.py").write_text("def run(ctx, event):\n    return event\n")
    with pytest.raises(WorkflowValidationError) as info:
        validate_file(path)
    assert str(info.value) == (
        f"{path}:4:42: functions.a.models[0]: unknown model 'gpt5'; known models: {ZOO_NAMES}"
    )
    # Handlers beside the YAML file are importable: fix the model and the file validates.
    path.write_text(path.read_text().replace("gpt5", "alexnet"))
    assert validate_file(path).functions["a"].models == ["alexnet"]
    with pytest.raises(WorkflowValidationError, match=r"nothing\.yaml: No such file or directory"):
        validate_file(tmp_path / "nothing.yaml")


def test_a_long_chain_validates_and_a_long_cycle_is_found(tmp_path):
    """The cycle search used to recurse once per function: a chain of 1,000 hit Python's limit."""
    n = 1100  # past the recursion limit (1,000), within the YAML value bound (10,000)
    functions = "".join(f"  f{i}: {{handler: wf_test_handlers:echo}}\n" for i in range(n))
    edges = "".join(f"  - {{from: f{i}, to: f{i + 1}}}\n" for i in range(n - 1))
    text = f"name: chain\nslo_ms: 100\nfunctions:\n{functions}edges:\n{edges}"
    assert len(parse_spec(text, "chain.yaml", HERE).functions) == n
    cyclic = text + f"  - {{from: f{n - 1}, to: f0}}\n"
    (message,) = errors(cyclic)
    assert message.endswith("edges form a cycle: " + " -> ".join(f"f{i}" for i in [*range(n), 0]))


def test_params_are_json_values_that_fit_the_wire():
    head = "name: demo\nslo_ms: 100\nfunctions:\n  a: {handler: wf_test_handlers:echo, params: "
    assert errors(head + "{raw: !!binary aGk=, ratio: .nan}}\n") == [
        "demo.yaml:4:48: functions.a.params.raw: input was not a valid JSON value (got b'hi')",
        "demo.yaml:4:68: functions.a.params.ratio.float: Input should be a finite number (got nan)",
    ]
    (big,) = errors(head + "{n: [1, 18446744073709551616]}}\n")
    assert "the integer 18446744073709551616 does not fit 64 bits" in big
    ok = parse_spec(head + "{n: [1, {m: -3.5, s: x, b: true, z: null}]}}\n", "demo.yaml", HERE)
    assert ok.functions["a"].params == {"n": [1, {"m": -3.5, "s": "x", "b": True, "z": None}]}


def test_a_workflow_file_is_read_to_its_limit_only(tmp_path):
    with pytest.raises(WorkflowValidationError, match=r"/dev/zero: more than 1048576 bytes; a workflow file"):
        validate_file("/dev/zero")


def test_handler_signature_is_checked(tmp_path):
    (tmp_path / "one_arg.py").write_text("def run(event):\n    return event\n")
    text = "name: demo\nslo_ms: 100\nfunctions:\n  a: {handler: one_arg:run}\n"
    with pytest.raises(WorkflowValidationError) as info:
        parse_spec(text, "demo.yaml", tmp_path)
    assert (
        str(info.value)
        == "demo.yaml:4:7: functions.a.handler: handler 'one_arg:run' must accept (ctx, event)"
    )


def test_models_declared_by_the_decorator_fill_or_must_match(tmp_path):
    (tmp_path / "declared.py").write_text(
        "import streambox\n\n"
        "@streambox.function(models=['resnet18'])\ndef run(ctx, event):\n    return event\n"
    )
    text = "name: demo\nslo_ms: 100\nfunctions:\n  a: {handler: declared:run}\n"
    assert parse_spec(text, "demo.yaml", tmp_path).functions["a"].models == ["resnet18"]
    with pytest.raises(WorkflowValidationError) as info:
        parse_spec(text.replace("}", ", models: [vgg16]}"), "demo.yaml", tmp_path)
    assert str(info.value) == (
        "demo.yaml:4:30: functions.a.models: the handler declares models ['resnet18'] "
        "but the workflow lists ['vgg16']"
    )


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_the_bundled_workflows_validate(name):
    spec = validate_file(example_path(name))
    assert isinstance(spec, WorkflowSpec) and spec.name == name
    assert spec.slo_ms == 200
    small = load_example(name, small=True)
    for function, params in SMALL_PARAMS[name].items():
        assert small.functions[function].params == {**spec.functions[function].params, **params}
    assert small.base_dir == spec.base_dir


def test_traffic_b16_is_traffic_at_the_papers_batch_size():
    traffic, b16 = load_example("traffic"), load_example("traffic-b16")
    assert b16.edges == traffic.edges
    more = {"max_people": 16, "max_vehicles": 16}
    assert b16.functions["detect"].params == {**traffic.functions["detect"].params, **more}
    for name in ("face", "car"):
        ours, theirs = b16.functions[name], traffic.functions[name]
        assert ours.handler == theirs.handler and ours.models == theirs.models
        assert (ours.max_batch_size, ours.max_instances, ours.max_queue_delay_ms) == (16, 16, 5)


def test_the_bundled_graphs():
    traffic = load_example("traffic").graph()
    assert traffic.entries == ["detect"] and traffic.sinks == ["face", "car"]
    assert traffic.runs_many() == {"detect": False, "face": True, "car": True}
    social = load_example("social-media").graph()
    assert social.entries == ["text", "vision"] and social.is_fan_in("aggregate")
    assert social.runs_many() == {"text": False, "vision": False, "aggregate": False}
    image = load_example("image-processing").graph()
    assert image.topological_order() == ["recognize", "enhance"]


def test_keys_yaml_reads_as_numbers_or_flags_are_refused_where_they_are():
    text = (
        "name: demo\nslo_ms: 100\nfunctions:\n"
        "  1: {handler: wf_test_handlers:echo}\n  true: {handler: wf_test_handlers:echo}\n"
    )
    found = errors(text)
    assert "demo.yaml:4:3: functions.1: a key must be text, not int 1: quote it ('1')" in found
    assert "demo.yaml:5:3: functions.true: a key must be text, not bool True: quote it ('true')" in found
    assert not any("duplicate" in e for e in found)  # 1 == True in Python: not a duplicate here


def test_ctrl_c_while_a_handler_is_checked_is_an_interrupt_not_a_bad_handler(tmp_path):
    """The child that imports handlers shares the terminal's Ctrl-C: a module it was importing when
    the user pressed it was reported as broken ("exited with code -2")."""
    (tmp_path / "interrupted.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGINT)\n")
    text = "name: demo\nslo_ms: 100\nfunctions:\n  a: {handler: interrupted:run}\n"
    with pytest.raises(KeyboardInterrupt):
        parse_spec(text, "demo.yaml", tmp_path)


def test_a_yaml_tag_that_would_build_an_object_is_named_never_built():
    assert errors('!!python/object/apply:os.system ["echo hi"]\n') == [
        "demo.yaml:1:1: unsupported YAML tag !!python/object/apply:os.system: a workflow holds plain "
        "values (text, numbers, lists, mappings)"
    ]
    text = "name: demo\nslo_ms: !custom 100\nfunctions: {a: {handler: wf_test_handlers:echo}}\n"
    assert errors(text) == [
        "demo.yaml:2:9: slo_ms: unsupported YAML tag !custom: a workflow holds plain values (text, "
        "numbers, lists, mappings)"
    ]
    plain = "name: !!str demo\nslo_ms: !!int 100\nfunctions: {a: {handler: wf_test_handlers:echo}}\n"
    assert parse_spec(plain, "d.yaml", HERE).slo_ms == 100


def test_a_character_yaml_refuses_is_placed_by_line_and_column():
    assert errors("name: demo\nslo_ms: 1\x0000\n") == [
        "demo.yaml:2:10: invalid YAML: character U+0000 is not allowed (special characters are not allowed)"
    ]
