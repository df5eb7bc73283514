"""`streambox models`: add, list, show, verify and remove through the command line."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from streambox.cli import main

FACTORY = textwrap.dedent(
    """
    import torch
    from torch import nn

    def build():
        torch.manual_seed(1)
        net = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))
        net.example_input_shape = (3, 4)
        return net
    """
)


def test_models_add_list_show_verify_remove(tmp_path, monkeypatch, capsys):
    (tmp_path / "cli_models.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    pool = str(tmp_path / "pool")

    assert (
        main(["models", "add", "lin", "--factory", "cli_models:build", "--batch", "1,2", "--pool", pool]) == 0
    )
    out = capsys.readouterr().out
    assert "registered lin@1" in out and "batch 2:" in out and "largest difference from eager torch 0" in out

    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 3))
    exported = tmp_path / "lin.pt2"
    torch.export.save(torch.export.export(net, (torch.rand(1, 3, 4),)), exported)
    assert main(["models", "add", "lin", "--pt2", str(exported), "--pool", pool]) == 0
    assert "registered lin@2" in capsys.readouterr().out

    assert main(["models", "list", "--pool", pool]) == 0
    listed = capsys.readouterr().out
    assert "lin@1" in listed and "lin@2" in listed

    assert main(["models", "show", "lin", "--pool", pool]) == 0
    shown = capsys.readouterr().out
    assert '"version": 2' in shown and "b1_3x4" in shown

    assert main(["models", "verify", "lin@1", "--pool", pool]) == 0
    assert capsys.readouterr().out.count("largest difference") == 2

    assert main(["models", "remove", "lin@1", "--pool", pool]) == 0
    assert main(["models", "verify", "lin@1", "--pool", pool]) == 2
    err = capsys.readouterr().err
    assert "no registered model 'lin@1'" in err and "(registered: lin@2)" in err


def test_models_add_errors_are_one_line_naming_the_file(tmp_path, capsys):
    missing = tmp_path / "nothing.pt2"
    assert main(["models", "add", "x", "--pt2", str(missing), "--pool", str(tmp_path / "pool")]) == 2
    assert capsys.readouterr().err.strip() == f"streambox models: error: {missing}: no such file"


def test_the_models_parser_imports_no_torch():
    code = (
        "import argparse, sys\n"
        "from streambox.models_cli import add_models_arguments\n"
        "add_models_arguments(argparse.ArgumentParser())\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_pool_that_is_no_directory_is_named(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    assert main(["models", "list", "--pool", str(tmp_path / "missing")]) == 2
    assert (
        capsys.readouterr().err.strip()
        == f"streambox models: error: --pool {tmp_path / 'missing'}: no such directory"
    )
    assert main(["models", "add", "x", "--pt2", str(afile), "--pool", str(afile)]) == 2
    assert capsys.readouterr().err.strip() == f"streambox models: error: --pool {afile}: not a directory"
    assert (
        main(["models", "add", "x", "--factory", "mod:f", "--input-shape", "3,x", "--pool", str(tmp_path)])
        == 2
    )
    assert "--input-shape takes positive integers separated by 'x' or ','" in capsys.readouterr().err


def test_a_factory_module_off_the_path_says_how_to_put_it_there(tmp_path, capsys):
    argv = ["models", "add", "x", "--factory", "no_such_module_here:build", "--input-shape", "3"]
    assert main([*argv, "--pool", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "No module named 'no_such_module_here'" in err and "set PYTHONPATH" in err


def test_a_corrupt_pt2_is_one_line_with_torch_s_cause(tmp_path, capfd):
    """torch.export.load logs a corrupt file's traceback (a dozen lines) before it raises: held, and
    its last line (the cause) goes into the one-line error."""
    bad = tmp_path / "bad.pt2"
    bad.write_bytes(b"garbage")
    assert main(["models", "add", "x", "--pt2", str(bad), "--pool", str(tmp_path / "pool")]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"streambox models: error: {bad}: not a torch.export.save file (BadZipFile: File is not a zip file; "
        "RuntimeError: PytorchStreamReader failed reading zip archive: not a ZIP archive."
    )
