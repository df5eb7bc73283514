"""The proxy process's entry point: it spawns the template before it imports the proxy.

The template imports torch and the workflow's handlers; the proxy imports torch, the compiler and
the stores. Each takes seconds. This module imports neither, so the template's imports run beside
the proxy's on another core. The proxy then serves after the longer of the two, not after both
(docs/api_proxy.md, "Start-up").
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from .control import START_ERROR_FILE
from .proxy_config import ProxyConfig
from .shm_ring import private_dir
from .supervisor import Supervisor


def start_failed(config: ProxyConfig, error: BaseException) -> int:
    """Say why the proxy could not start, on stderr and in its folder's start-error file (which
    `launch_proxy` reports); returns the exit status, 2."""
    message = f"{type(error).__name__}: {error}"
    print(f"streambox proxy {config.workflow!r}: could not start: {message}", file=sys.stderr, flush=True)
    if config.directory:
        with contextlib.suppress(OSError):
            (Path(config.directory) / START_ERROR_FILE).write_text(message)
    return 2


def proxy_directory(config: ProxyConfig) -> Path:
    """The proxy's private folder: the configured one, else a new one."""
    return Path(config.directory) if config.directory else private_dir(f"sbx-{config.workflow[:16]}-")


def main(argv: list[str] | None = None) -> int:
    """`proxy.main` for `argv[0]`, a `ProxyConfig` as JSON, with its template spawned first."""
    args = sys.argv[1:] if argv is None else argv
    config = ProxyConfig.from_json(args[0])
    supervisor = Supervisor(config, proxy_directory(config))
    try:
        supervisor.spawn_template()  # before this process has any thread: a clean spawn
        from .proxy import main as serve  # the heavy imports, while the template does its own
    except BaseException as error:  # the template must not outlive a proxy that never started
        with contextlib.suppress(Exception):
            supervisor.template.kill()
            supervisor.template.wait(5.0)
        if isinstance(error, KeyboardInterrupt):  # Ctrl-C at the terminal: its command reports it
            return 130
        if not isinstance(error, Exception):
            raise
        return start_failed(config, error)
    return serve(args, supervisor)
