"""Registering models from outside the zoo: a factory, a .pt2 file, versions, and the all-or-nothing
failure of a model the lowering cannot express."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from streambox.kernel_compiler import registry
from streambox.kernel_compiler.model_pool import ModelPool, unknown_model
from streambox.kernel_compiler.reference import plan_outputs

FACTORY = textwrap.dedent(
    """
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.bn = nn.BatchNorm2d(8)
            self.head = nn.Linear(8, 5)

        def forward(self, x):
            y = torch.relu(self.bn(self.conv(x)))
            return self.head(y.mean(dim=(2, 3))).softmax(dim=-1)

    def build():
        torch.manual_seed(7)
        return Net(), (3, 12, 12)

    class Branchy(nn.Module):
        def forward(self, x):
            return torch.cond(x.sum() > 0, lambda x: x + 1, lambda x: x - 1, (x,))

    class Itemy(nn.Module):
        def forward(self, x):
            return x * x.max().item()

    class Loud(nn.Module):  # one output of millions beside one of ones
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            return x * 1e6, self.fc(x)

    def build_loud():
        torch.manual_seed(3)
        return Loud(), (4,)

    def bad_shape():
        return Net(), "abc"

    def bad_dims():
        return Net(), (3, "x")

    def broken():
        raise KeyError("boom")

    def quits():
        raise SystemExit(3)
    """
)


@pytest.fixture
def factory_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    name = f"user_models_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = __import__(name)
    yield module
    sys.modules.pop(name, None)


def _eager(module) -> torch.nn.Module:
    net, _ = module.build()
    return net.eval()


def test_factory_model_is_lowered_checked_and_stored_at_each_batch(tmp_path, factory_module):
    root = tmp_path / "pool"
    record = registry.register(root, "net", factory=f"{factory_module.__name__}:build", batches=[2, 1])
    assert record.ref == "net@1" and record.source_kind == "factory"
    assert record.input_shape == [3, 12, 12] and [b.batch for b in record.batches] == [1, 2]
    assert all(b.max_abs_diff <= 1e-5 and b.modelled_s > 0 and b.peak_live_bytes > 0 for b in record.batches)
    assert record.weight_bytes > 0 and len(record.source_sha256) == 64

    pool = ModelPool(root)
    entry = pool.entry("net")
    assert entry.name == "net@1" and entry.input_shape == (3, 12, 12)
    plan = pool.get("net", 2)
    assert plan is not None and plan.model == "net@1"
    x = torch.rand(2, 3, 12, 12)
    with torch.no_grad():
        want = _eager(factory_module)(x)
    torch.testing.assert_close(plan_outputs(plan, [x])[0], want)
    # A batch it was not registered with is lowered on first use, from the stored weights.
    three = pool.get_or_lower("net@1", 3)
    assert three.batch == 3 and (root / "net@1" / "b3_3x12x12" / "plan.json").exists()
    checked = registry.verify(root, "net")
    assert [b for b, _ in checked] == [1, 2, 3] and all(d <= 1e-5 for _, d in checked)
    weights = {(d / "weights.safetensors").stat().st_ino for d in (root / "net@1").glob("b*_3x12x12")}
    assert len(weights) == 1  # the declared batches and the later one share one weights file


def test_factory_weights_file_is_loaded_and_a_mismatch_names_the_file(tmp_path, factory_module):
    root = tmp_path / "pool"
    trained = _eager(factory_module)
    with torch.no_grad():
        trained.head.bias.fill_(3.0)
    weights = tmp_path / "net.safetensors"
    save_file({k: v.contiguous() for k, v in trained.state_dict().items()}, str(weights))
    registry.register(root, "net", factory=f"{factory_module.__name__}:build", weights=weights)
    loaded = registry.load_module(root, registry.find(root, "net"))
    assert torch.equal(loaded.head.bias, torch.full((5,), 3.0))

    bad = tmp_path / "bad.pt"
    torch.save({"head.weight": torch.zeros(2, 2)}, bad)
    with pytest.raises(registry.ModelRegistrationError, match=r"bad\.pt: does not fit"):
        registry.register(root, "net", factory=f"{factory_module.__name__}:build", weights=bad)
    assert [r.ref for r in registry.registered(root)] == ["net@1"]


def test_pt2_versions_latest_and_pinned(tmp_path, factory_module):
    root = tmp_path / "pool"
    net = _eager(factory_module)
    static = tmp_path / "net1.pt2"
    torch.export.save(torch.export.export(net, (torch.rand(1, 3, 12, 12),)), static)
    first = registry.register(root, "face", pt2=static)
    assert first.ref == "face@1" and first.input_shape == [3, 12, 12]

    with pytest.raises(registry.ModelRegistrationError, match=r"net1\.pt2: was exported for batch 1 only"):
        registry.register(root, "face", pt2=static, batches=[1, 4])

    dynamic = tmp_path / "net_dyn.pt2"
    batch = torch.export.Dim("batch")
    ep = torch.export.export(net, (torch.rand(2, 3, 12, 12),), dynamic_shapes={"x": {0: batch}})
    torch.export.save(ep, dynamic)
    second = registry.register(root, "face", pt2=dynamic, batches=[1, 4])
    assert second.ref == "face@2"

    pool = ModelPool(root)
    assert pool.entry("face").name == "face@2" and pool.entry("face@1").name == "face@1"
    x = torch.rand(4, 3, 12, 12)
    with torch.no_grad():
        want = net(x)
    torch.testing.assert_close(plan_outputs(pool.get_or_lower("face", 4), [x])[0], want)
    assert "face@1" in unknown_model("face@3", root) and unknown_model("face@1", root) is None

    assert registry.remove(root, "face@2") == ["face@2"]
    assert pool.entry("face").name == "face@1"
    assert registry.remove(root, "face") == ["face@1"] and registry.registered(root) == []


def test_unsupported_model_names_the_construct_and_leaves_nothing(tmp_path, factory_module):
    root = tmp_path / "pool"
    path = tmp_path / "branchy.pt2"
    torch.export.save(torch.export.export(factory_module.Branchy(), (torch.rand(1, 4),)), path)
    with pytest.raises(registry.UnsupportedModelError) as caught:
        registry.register(root, "branchy", pt2=path)
    message = str(caught.value)
    assert str(path) in message and "node cond: control-flow op torch.cond" in message
    assert "Supported: one tensor input" in message
    assert list(root.iterdir()) == []
    assert ModelPool(root).list() == [] and registry.registered(root) == []

    path = tmp_path / "itemy.pt2"
    torch.export.save(torch.export.export(factory_module.Itemy(), (torch.rand(1, 4),)), path)
    with pytest.raises(registry.UnsupportedModelError, match=r"itemy\.pt2: .*aten\._local_scalar_dense"):
        registry.register(root, "itemy", pt2=path)
    assert list(root.iterdir()) == []


def test_bad_names_and_sources_are_refused(tmp_path, factory_module):
    root = tmp_path / "pool"
    with pytest.raises(ValueError, match="zoo model"):
        registry.register(root, "resnet18", factory=f"{factory_module.__name__}:build")
    with pytest.raises(ValueError, match="without a version"):
        registry.register(root, "net@2", factory=f"{factory_module.__name__}:build")
    with pytest.raises(ValueError, match="must be lower-case"):
        registry.parse_ref("Net")
    with pytest.raises(registry.ModelRegistrationError, match="package.module:function"):
        registry.register(root, "net", factory="no_colon")
    with pytest.raises(registry.ModelRegistrationError, match="cannot import"):
        registry.register(root, "net", factory="no_such_module_here:build")
    with pytest.raises(registry.ModelRegistrationError, match="missing.pt2: no such file"):
        registry.register(root, "net", pt2=tmp_path / "missing.pt2")
    for shape in ((100_000, 100_000, 100_000), (3, 0, 8)):  # a torch allocation error, or nothing to lower
        with pytest.raises(registry.ModelRegistrationError, match=r"dimension >= 1 and at most 67,108,864"):
            registry.register(root, "net", factory=f"{factory_module.__name__}:build", input_shape=shape)
    assert not (root / "net").exists()


def test_a_registration_that_loses_the_race_for_its_version_says_so(tmp_path, factory_module, monkeypatch):
    """Two `models add` of one name at once: the second to finish gets a clear error, not an OSError,
    and leaves nothing behind."""
    root = tmp_path / "pool"
    lower = registry._lower_batches

    def lower_then_lose(tmp, ref, *args):  # another registration takes `ref` while this one lowers
        result = lower(tmp, ref, *args)
        (root / ref).mkdir(parents=True)
        (root / ref / "manifest.json").write_text("{}")
        return result

    monkeypatch.setattr(registry, "_lower_batches", lower_then_lose)
    with pytest.raises(ValueError, match="net@1 was registered by another command meanwhile"):
        registry.register(root, "net", factory=f"{factory_module.__name__}:build", batches=[1])
    assert sorted(p.name for p in root.iterdir()) == ["net@1"]  # no temporary folder left


def test_a_user_s_mistakes_in_registration_are_one_clear_error(tmp_path, factory_module):
    """A factory that raises or exits, weights that are not weights, an input dtype or batch size
    nobody can serve: a `ValueError` naming the source and what went wrong, nothing left behind."""
    root = tmp_path / "pool"
    name = factory_module.__name__
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not weights")
    cases = [
        (dict(factory=f"{name}:broken"), r"the factory failed: KeyError: 'boom'"),
        (dict(factory=f"{name}:quits"), r"the factory failed: SystemExit: 3"),
        (dict(factory=f"{name}:build", weights=junk), r"junk.safetensors.*cannot be read as weights"),
        (dict(factory=f"{name}:build", input_dtype="complex64"), r"input dtype 'complex64' is not one of"),
        (dict(factory=f"{name}:build", batches=[10**15]), r"batch sizes must be integers from 1 to 1024"),
        (  # an input shape the module cannot take: the input's mistake, not a lowering failure
            dict(factory=f"{name}:build", input_shape=(3, 12)),
            r"the model rejects an input of shape \[1, 3, 12\] \(torch.float32; batch first, then the input "
            r"shape given\): RuntimeError: ",
        ),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            registry.register(root, "net", **kwargs)
    assert not root.exists() or not any(root.iterdir())


def _serving(root: Path, ref: str) -> subprocess.Popen:
    """Another process that resolves `ref` in the pool at `root`, as a proxy does, and stays up until
    its stdin closes."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from streambox.kernel_compiler.model_pool import ModelPool; "
            f"ModelPool({str(root)!r}).entry({ref!r}); print('serving', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout.readline() == "serving\n"
    return process


def test_a_version_a_running_process_serves_is_not_removed_until_it_ends(tmp_path, factory_module, capsys):
    """Another process resolves `net` (as a proxy does before lowering or loading it): removing it is
    refused with a clear error and leaves every version in place; `--force` would remove it; once that
    process ends (its lease goes with it) the removal succeeds."""
    from streambox.cli import main
    from streambox.kernel_compiler.model_lease import ModelInUse

    root = tmp_path / "pool"
    registry.register(root, "net", factory=f"{factory_module.__name__}:build")
    registry.register(root, "net", factory=f"{factory_module.__name__}:build")
    server = _serving(root, "net@1")
    try:
        with pytest.raises(ModelInUse, match=r"net@1 is in use by a running process .* pass --force"):
            registry.remove(root, "net")
        assert [r.ref for r in registry.registered(root)] == ["net@1", "net@2"]  # all or nothing
        assert registry.remove(root, "net@2") == ["net@2"]  # not the one served
        assert main(["models", "remove", "net@1", "--pool", str(root)]) == 2
        assert "streambox models: error: net@1 is in use by a running process" in capsys.readouterr().err
        assert [r.ref for r in registry.registered(root)] == ["net@1"]
    finally:
        server.communicate("", timeout=60)
    assert main(["models", "remove", "net", "--pool", str(root)]) == 0
    assert registry.registered(root) == []


def test_a_refused_removal_gives_this_process_its_own_lease_back(tmp_path, factory_module):
    """This process serves `net` too: trying to remove it sets its own lease aside, and when another
    process's lease refuses the removal, takes it back (else it would be invisible to removers)."""
    from streambox.kernel_compiler import model_lease

    root = tmp_path / "pool"
    registry.register(root, "net", factory=f"{factory_module.__name__}:build")
    ModelPool(root).entry("net")
    key = (root / "net@1").absolute()
    assert model_lease._held[key] >= 0
    server = _serving(root, "net")
    try:
        with pytest.raises(model_lease.ModelInUse):
            registry.remove(root, "net")
        assert model_lease._held.get(key, -1) >= 0  # held again
    finally:
        server.communicate("", timeout=60)
    assert registry.remove(root, "net") == ["net@1"]  # our own lease does not stop our own removal
    assert key not in model_lease._held


def test_force_removes_a_version_in_use(tmp_path, factory_module):
    root = tmp_path / "pool"
    registry.register(root, "net", factory=f"{factory_module.__name__}:build")
    holder = _serving(root, "net")
    try:
        assert registry.remove(root, "net", force=True) == ["net@1"]
        assert registry.registered(root) == []
    finally:
        holder.communicate("", timeout=60)


def test_a_version_number_names_one_model_for_good(tmp_path, factory_module):
    """Removing net@2 and adding net again gave the new model the number 2: a process pinned to net@2
    (and the plans it cached under it) got another model under the same name."""
    root = tmp_path / "pool"
    for _ in range(2):
        registry.register(root, "net", factory=f"{factory_module.__name__}:build")
    assert registry.remove(root, "net@2") == ["net@2"]
    assert registry.register(root, "net", factory=f"{factory_module.__name__}:build").ref == "net@3"
    assert [r.ref for r in registry.registered(root)] == ["net@1", "net@3"]
    assert registry.find(root, "net@2") is None and registry.find(root, "net").ref == "net@3"


def test_a_name_with_a_trailing_newline_is_refused():
    """`^...$` matched "resnet18\n", which then passed the zoo-name check and made a folder of it."""
    with pytest.raises(ValueError, match="model name 'resnet18\\\\n' must be"):
        registry.parse_ref("resnet18\n")


def test_lowerings_of_one_model_on_several_threads_all_succeed(tmp_path, factory_module):
    """A proxy lowers new batch sizes on two helper threads: torch.export's global dispatch modes,
    pushed by two at once, corrupted each other ("Trying to pop empty mode stack")."""
    from concurrent.futures import ThreadPoolExecutor

    from streambox.kernel_compiler.model_pool import ModelPool

    root = tmp_path / "pool"
    registry.register(root, "net", factory=f"{factory_module.__name__}:build")
    pool = ModelPool(root)
    with ThreadPoolExecutor(4) as lower:
        plans = list(lower.map(lambda b: pool.get_or_lower("net", b), range(2, 10)))
    assert [p.batch for p in plans] == list(range(2, 10))


def test_verify_checks_each_output_against_its_own_size(tmp_path, factory_module):
    """The tolerance was the largest value over all outputs: a bias of 30 written into the small output's
    plan weights passed verify beside an output of millions."""
    from safetensors.torch import load_file, save_file

    root = tmp_path / "pool"
    record = registry.register(root, "loud", factory=f"{factory_module.__name__}:build_loud")
    (weights,) = (root / record.ref).glob("b1_*/weights.safetensors")
    tensors = load_file(weights)
    (bias,) = [k for k, t in tensors.items() if t.shape == (2,)]
    tensors[bias] = torch.full((2,), 30.0)
    save_file(tensors, weights)
    with pytest.raises(registry.ModelRegistrationError, match="differs from eager torch by .* in output 1"):
        registry.verify(root, "loud")


def test_what_a_killed_registration_left_is_swept_once_old(tmp_path):
    """kill -9 during `models add` left its .tmp- folder (4 plans and a state file) in the pool for good."""
    import os

    root = tmp_path / "pool"
    old, young = root / ".tmp-net@1-abc", root / ".tmp-net@2-def"
    for folder in (old, young):
        folder.mkdir(parents=True)
        (folder / "plan.json").write_text("{}")
    os.utime(old, (0, 0))
    assert registry.sweep_unfinished(root) == [old]
    assert not old.exists() and young.exists()  # a registration still at work keeps its folder


def test_a_pt2_input_is_checked_as_a_factory_s(tmp_path):
    """A .pt2 skipped the factory's checks: a zero dimension registered (then stopped serve), complex64
    failed inside torch, a one-value-per-sample input made a plan folder that broke `models show`."""
    class Double(torch.nn.Module):
        def forward(self, x):
            return x * 2

    cases = {
        "zero": (torch.rand(1, 0), None, r"input shape \[0\]: each dimension >= 1"),
        "cplx": (torch.zeros(1, 4, dtype=torch.complex64), None, "input dtype 'complex64' is not one of"),
        "vec": (torch.rand(3), {"x": {0: torch.export.Dim("b")}}, "a batch of samples of one or more"),
    }
    for name, (example, dynamic, says) in cases.items():
        path = tmp_path / f"{name}.pt2"
        torch.export.save(torch.export.export(Double(), (example,), dynamic_shapes=dynamic), path)
        with pytest.raises((registry.ModelRegistrationError, registry.UnsupportedModelError), match=says):
            registry.register(tmp_path / "pool", name, pt2=path)
    # A dtype given with a .pt2 was ignored silently (the program's own was registered).
    with pytest.raises(ValueError, match=r"an input dtype \(float16\) goes with a factory; a .pt2 file"):
        registry.register(tmp_path / "pool", "half", pt2=path, input_dtype="float16")
    assert registry.registered(tmp_path / "pool") == []


def test_a_factory_s_bad_shape_or_failing_import_is_named(tmp_path, factory_module):
    """`return Net(), "abc"` said "invalid literal for int()", naming neither the factory nor the field; a
    module that raised at import (or called sys.exit) escaped as a traceback (or a silent exit)."""
    name = factory_module.__name__
    for factory, says in ((f"{name}:bad_shape", "its input shape 'abc' is not a sequence of integers"),
                          (f"{name}:bad_dims", r"its input shape \[3, 'x'\] holds a value not an integer")):
        with pytest.raises(registry.ModelRegistrationError, match=says):
            registry.register(tmp_path / "pool", "net", factory=factory)
    (tmp_path / "fails_on_import.py").write_text("import sys\nsys.exit(4)\n")
    with pytest.raises(registry.ModelRegistrationError, match="its module failed on import: SystemExit: 4"):
        registry.register(tmp_path / "pool", "net", factory="fails_on_import:build")


def test_verify_names_a_factory_whose_code_changed(tmp_path, factory_module):
    """A factory that builds another shape of layer than was registered gave torch's state-dict traceback."""
    root = tmp_path / "pool"
    registry.register(root, "net", factory=f"{factory_module.__name__}:build")
    original = factory_module.build  # its author changes the factory's code
    factory_module.build = lambda: (torch.nn.Sequential(torch.nn.Linear(3, 2)), (3, 12, 12))
    try:
        with pytest.raises(registry.ModelRegistrationError, match="net@1's registered weights do not fit"):
            registry.verify(root, "net")
    finally:
        factory_module.build = original


def test_a_damaged_record_is_named_and_the_other_models_still_listed(tmp_path, factory_module, capsys):
    """A `model.json` edited or damaged by hand stopped `models list` with a bare JSON error ("batches"
    for a missing field), naming neither the file nor the model; every other model was unlisted."""
    from streambox.cli import main

    root = tmp_path / "pool"
    registry.register(root, "net", factory=f"{factory_module.__name__}:build")
    registry.register(root, "other", factory=f"{factory_module.__name__}:build")
    manifest = root / "net@1" / registry.MANIFEST
    damages = (("{bad", "Invalid JSON"), ('{"name": 5}', "name: Input should be a valid string"))
    for damage, problem in damages:
        manifest.write_text(damage)
        with pytest.raises(registry.CorruptRecord,
                           match=rf"net@1/model.json: not a model record \({problem}"):
            registry.find(root, "net")
        assert main(["models", "list", "--pool", str(root)]) == 1
        out, err = capsys.readouterr()
        assert "other@1" in out and "streambox models remove net@1" in err
    corrupt: list[registry.CorruptRecord] = []
    assert [r.ref for r in registry.registered(root, corrupt)] == ["other@1"] and len(corrupt) == 1
    assert main(["models", "remove", "net@1", "--pool", str(root)]) == 0  # what the message advises
    assert main(["models", "list", "--pool", str(root)]) == 0
