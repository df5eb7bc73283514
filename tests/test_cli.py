"""The `streambox` command line: help, devices, and one-line errors for bad configuration."""

from __future__ import annotations

import socket

import pytest

from streambox.cli import main


@pytest.fixture(autouse=True)
def _private_state(tmp_path, monkeypatch):
    monkeypatch.setenv("STREAMBOX_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("COLUMNS", "200")  # one table row per line


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "devices" in out and "demo" in out


def test_devices_lists_every_emulated_gpu(capsys):
    assert main(["devices", "--gpus", "2", "--device-preset", "h100-80gb"]) == 0
    out = capsys.readouterr().out
    assert out.count("H100 80GB") == 2
    assert "81,920 MiB" in out


def test_devices_counts_another_runtime_of_this_machine(capsys, tmp_path):
    from streambox.config import Config

    backend = Config.from_env().open_backend()
    with backend.open_runtime(0) as runtime:
        runtime.mem_alloc(1 << 30)
        runtime.create_stream()
        assert main(["devices"]) == 0
    out = capsys.readouterr().out
    # 1 GiB allocated plus the V100 preset's 300 MiB context, one runtime, one stream.
    row = next(line for line in out.splitlines() if "V100" in line)
    assert "1,324 MiB / 16,384 MiB" in row
    cells = [cell.strip() for cell in row.strip("│ ").split("│")]
    assert cells == ["0", "Tesla V100-PCIE-16GB (emulated)", "1,324 MiB / 16,384 MiB", "8%", "1", "1"]


def test_unknown_preset_is_one_clear_line(capsys):
    assert main(["devices", "--device-preset", "a100"]) == 2
    err = capsys.readouterr().err
    assert "a100" in err and "v100-16gb" in err and "Traceback" not in err


def test_unavailable_cuda_backend_is_one_clear_line(capsys):
    pytest.importorskip("cuda.bindings.driver")
    from streambox.device import BackendUnavailable, get_backend

    try:
        get_backend("cuda")
    except BackendUnavailable:
        pass
    else:
        pytest.skip("a GPU is present")
    assert main(["devices", "--backend", "cuda"]) == 2
    assert "CUDA backend unavailable" in capsys.readouterr().err


def test_validate_accepts_the_bundled_workflows(capsys):
    assert main(["validate", "traffic", "image-processing", "social-media"]) == 0
    out = capsys.readouterr().out
    assert "workflow 'traffic' is valid: 3 functions, 2 edges" in out


def test_validate_names_file_line_and_field(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: demo\nslo_ms: fast\nfunctions: {}\n")
    assert main(["validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.yaml:2:" in err and "slo_ms" in err and "Traceback" not in err


def test_validate_missing_file_lists_bundled_workflows(capsys):
    assert main(["validate", "nope.yaml"]) == 2
    assert "traffic" in capsys.readouterr().err


def test_validate_reports_every_file_and_refuses_times_json_cannot_carry(tmp_path, capsys):
    inf = tmp_path / "inf.yaml"
    inf.write_text("name: demo\nslo_ms: .inf\nfunctions:\n  a: {handler: 'm:f', timeout_ms: 1.0e+300}\n")
    exp = tmp_path / "exp.yaml"
    exp.write_text("name: demo\nslo_ms: 2e2\nfunctions: {}\n")
    assert main(["validate", str(inf), str(exp), "traffic"]) == 2
    captured = capsys.readouterr()
    assert "inf.yaml:2:1: slo_ms: Input should be a finite number" in captured.err
    assert "timeout_ms: Input should be less than or equal to 86400000" in captured.err
    # YAML 1.2 reads 2e2 as the number 200 (1.1 read it as text): only the empty functions are wrong.
    assert "exp.yaml:2:1: slo_ms:" not in captured.err and "exp.yaml:3:1: functions:" in captured.err
    assert "workflow 'traffic' is valid" in captured.out  # the files after a bad one are checked too


def test_paper_refuses_an_empty_or_repeated_system_list_and_a_file_for_a_folder(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    for args in (["--systems", ","], ["--systems", "streambox,streambox"], ["--out", str(afile)]):
        assert main(["paper", "12", "--quick", *args]) == 2
        assert "Traceback" not in capsys.readouterr().err
    assert afile.read_text() == ""


def test_models_commands_use_the_configured_model_pool(tmp_path, monkeypatch, capsys):
    """`STREAMBOX_MODEL_POOL` is the pool of every command (`models` used to read ~/.cache instead)."""
    monkeypatch.setenv("STREAMBOX_MODEL_POOL", str(tmp_path / "pool"))
    assert main(["models", "list"]) == 0
    assert str(tmp_path / "pool") in capsys.readouterr().out


def test_serve_refuses_a_bad_port_or_token_file_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["serve", "shapes", "--port", "99999"])
    assert "port 99999 is not in 1-65535" in capsys.readouterr().err
    assert main(["serve", "shapes", "--token-file", str(tmp_path / "missing")]) == 2
    assert "--token-file" in capsys.readouterr().err


def test_a_path_the_system_refuses_is_one_clear_line(capsys, tmp_path, monkeypatch):
    """An OSError (a state dir under a file here; an --out that cannot be made, a port in use) used to
    be a traceback."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("STREAMBOX_STATE_DIR", str(tmp_path / "file" / "state"))
    assert main(["devices"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("streambox devices: error: ") and "Not a directory" in err[0]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["demo", "--models", "alexnet", "--batch", "0"], "--batch: 0 is not a positive integer"),
        (["compile", "resnet18", "--batch", "-4"], "--batch: -4 is not a positive integer"),
        (["compile", "resnet18", "--input-shape", "3,x"], "--input-shape: takes positive integers"),
        (["compile", "resnet18", "--input-shape", "0x0x0"], "--input-shape: takes positive integers"),
        (["invoke", "traffic", "--sample", "--url", "localhost:8080"], "is not an http(s) URL"),
        (
            ["invoke", "traffic", "--sample", "--url", "http://localhost:99999"],
            "--url: 'http://localhost:99999'",
        ),
        (["burst", "traffic", "-c", "0"], "--concurrency/-c: 0 is not a positive integer"),
        (["burst", "traffic", "--via", "bogus"], "--via: invalid choice: 'bogus'"),
    ],
)
def test_bad_numbers_shapes_and_urls_are_refused_before_any_work(argv, says, capsys, tmp_path, monkeypatch):
    """Checked while parsing: nothing is lowered or written (a batch of 0 used to lower a 233 MB plan
    into the shared model pool and then crash)."""
    monkeypatch.setenv("STREAMBOX_MODEL_POOL", str(tmp_path / "pool"))
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "pool").exists()


def test_an_unknown_model_is_named_with_the_known_ones(capsys, tmp_path, monkeypatch):
    """A KeyError subclass that words its own message is shown whole (it used to be the bare name)."""
    monkeypatch.setenv("STREAMBOX_MODEL_POOL", str(tmp_path / "pool"))
    assert main(["demo", "--models", "nosuch"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("streambox demo: error: unknown model 'nosuch'; known models: alexnet,")


def test_validate_names_an_empty_name_and_a_dangling_link(tmp_path, capsys):
    assert main(["validate", ""]) == 2
    assert "an empty name: give a workflow YAML file or a bundled workflow (" in capsys.readouterr().err
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    assert main(["validate", str(tmp_path / "a")]) == 2
    assert f"{tmp_path / 'a'}: a symbolic link to nothing (or a loop of links)" in capsys.readouterr().err


def test_serve_says_in_one_error_why_a_workflow_s_proxy_did_not_start(tmp_path, capsys, monkeypatch):
    """A warm_up() that raised passed validate, then ended serve with a 60-line traceback of its own."""
    monkeypatch.setenv("STREAMBOX_STATE_DIR", str(tmp_path / "state"))
    (tmp_path / "wu.py").write_text("def warm_up():\n    raise RuntimeError('warm_up failed')\n"
                                    "def run(ctx, event):\n    return 1\n")
    (tmp_path / "wu.yaml").write_text("name: wu\nslo_ms: 1000\nfunctions:\n  f: {handler: wu:run}\n")
    with socket.socket() as probe:  # a free port: the gateway is never reached, but is made first
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert main(["serve", str(tmp_path / "wu.yaml"), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert "streambox serve: error: the proxy of workflow 'wu' did not start" in err
    assert "warm_up() of module 'wu'" in err and "wu.py\", line 2, in warm_up" in err
    assert "cli.py" not in err  # no traceback of serve's own
