"""`make gpu-check` on a machine without a GPU: one line, exit 0 (the GPU path runs where one is lent)."""

from __future__ import annotations

import pytest

from streambox import gpu_check


def test_without_a_gpu_it_says_so_in_one_line_and_exits_0(capsys) -> None:
    backend, _ = gpu_check._open_gpu()
    if backend is not None:
        pytest.skip("a GPU is present: `make gpu-check` runs the whole check")
    assert gpu_check.main([]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: no GPU here (") and len(lines[0]) < 200


def test_unknown_models_are_refused_with_the_known_ones(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["--models", "resnet50,lenet"])
    assert exit_info.value.code == 2
    assert "unknown models ['lenet']; known: ssdlite320_mobilenet_v3, resnet18" in capsys.readouterr().err


def test_gpu_test_node_ids_are_grouped_by_file_in_order() -> None:
    nodes = ["tests/a.py::t1", "tests/b.py::t2[x]", "tests/a.py::t3", "tests/b.py::C::t4"]
    assert gpu_check.group_by_file(nodes) == {
        "tests/a.py": ["tests/a.py::t1", "tests/a.py::t3"],
        "tests/b.py": ["tests/b.py::t2[x]", "tests/b.py::C::t4"],
    }


def test_the_gpu_tests_run_one_process_per_file(capsys) -> None:
    """On a GPU a kernel fault poisons its process's context (the first H200 run: one test's fault made
    12 later ones error), so each file runs alone; without a GPU every file passes by skipping. Two
    files of gpu tests and one without any (collecting the whole suite costs half a minute here; `make
    gpu-check` does)."""
    files = ["tests/device/test_cuda_backend.py", "tests/api_proxy/test_executor.py"]
    files.append("tests/test_gpu_check.py")
    result = gpu_check.run_gpu_tests(timeout_s=240, paths=files)
    assert "tests/test_gpu_check.py" not in result["files"]  # no gpu test in it: not run
    assert "tests/device/test_cuda_backend.py" in result["files"]
    assert "tests/api_proxy/test_executor.py" in result["files"]
    backend, _ = gpu_check._open_gpu()
    if backend is None:
        assert result["rc"] == 0 and result["failed"] == [], result["tail"]
