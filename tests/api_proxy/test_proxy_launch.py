"""The proxy process starts its template before its own heavy imports, so the two overlap
(`api_proxy/proxy_launch.py`): what each entry point imports, in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys


def _imported(statement: str, modules: tuple[str, ...]) -> list[str]:
    probe = f"{statement}\nimport json, sys\nprint(json.dumps([m for m in {modules!r} if m in sys.modules]))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_launcher_spawns_the_template_before_anything_imports_torch() -> None:
    assert _imported("import streambox.api_proxy.proxy_launch", ("torch", "numpy")) == []


def test_the_proxy_loads_plans_without_torchvision() -> None:
    # torchvision imports torch._dynamo: seconds of CPU, spent only where a zoo model is built (lowering)
    statement = "import streambox.api_proxy.proxy\nimport sys\nassert 'torchvision' not in sys.modules\n"
    # a plan's fallback kernel may be one of torchvision's ops: resolving it imports torchvision
    statement += "from streambox.kernel_compiler.ops import resolve_op\n"
    statement += "resolve_op('torchvision.nms.default')\n"
    statement += "from streambox.kernel_compiler.zoo import build_model\nbuild_model('alexnet')"
    assert _imported(statement, ("torchvision",)) == ["torchvision"]
