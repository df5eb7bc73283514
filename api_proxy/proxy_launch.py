"""The proxy process's entry point: it spawns the template before it imports the proxy.

The template imports torch and the workflow's handlers; the proxy imports torch, the compiler and
the stores. Each takes seconds. This module imports neither, so the template's imports run beside
the proxy's on another core. The proxy then serves after the longer of the two, not after both
(docs/api_proxy.md, "Start-up").
"""

from __future__ import annotations

import sys
from pathlib import Path

from .proxy_config import ProxyConfig
from .shm_ring import private_dir
from .supervisor import Supervisor


def main(argv: list[str] | None = None) -> int:
    """`proxy.main` for `argv[0]`, a `ProxyConfig` as JSON, with its template spawned first."""
    args = sys.argv[1:] if argv is None else argv
    config = ProxyConfig.from_json(args[0])
    directory = Path(config.directory) if config.directory else private_dir(f"sbx-{config.workflow[:16]}-")
    supervisor = Supervisor(config, directory)
    supervisor.spawn_template()  # before this process has any thread: a clean spawn
    try:
        from .proxy import main as serve  # the heavy imports, while the template does its own
    except BaseException:  # Ctrl-C or a broken install: the template must not outlive the proxy
        supervisor.template.kill()
        raise
    return serve(args, supervisor)
