"""The instance supervisor: the warm template process, its pre-forked spares, and the function
instances forked from it (their pids, pidfds, registration and deaths).

It starts instances (a spare takes the assignment, else the template forks one), kills them, and
turns the template's event pipe into what happened: `poll()` returns the instances that exited
(`Exit`); when the template itself dies every instance died with it and a new template is started.
What an exit means for the instance's requests is the dispatcher's business, not the supervisor's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack

from .errors import ProxyError
from .proxy_config import ProxyConfig
from .shm_ring import wait_readable
from .template import EXITED, FAILED, FORKED, LAUNCH, READY, SPARE, write_frame

if TYPE_CHECKING:  # `state` imports torch; the proxy's launcher spawns the template before that
    from .state import Instance


def describe_status(status: int) -> str:
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


@dataclass(frozen=True)
class Exit:
    """`instance` exited; `reason` says how (for its request's error)."""

    instance: Instance
    reason: str


class Supervisor:
    """The template and the instances of one proxy (see the module doc)."""

    def __init__(self, config: ProxyConfig, directory: Path) -> None:
        self.config = config
        self.dir = directory
        self.instances: dict[int, Instance] = {}
        self.timings: dict[str, Any] = {}
        self._pids: dict[int, int] = {}  # pid -> instance id
        self._spares = 0  # pre-forked spares the template reported and no assignment took yet
        self._evt_buf = bytearray()
        self.evt_fd = -1

    # -- the template ------------------------------------------------------------------------
    def spawn_template(self) -> None:
        """Start the template (call before this process has any thread: it is a clean spawn)."""
        cfg = self.config
        cmd_r, self._cmd_w = os.pipe()
        self.evt_fd, evt_w = os.pipe()
        self._assign, assign_r = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.template = subprocess.Popen(
            [sys.executable, "-c", LAUNCH, str(cmd_r), str(evt_w), str(assign_r.fileno())],
            pass_fds=(cmd_r, evt_w, assign_r.fileno()),
            cwd=self.dir,
            close_fds=True,
        )
        os.close(cmd_r)
        os.close(evt_w)
        assign_r.close()
        write_frame(
            self._cmd_w,
            {
                "workflow": cfg.workflow,
                "functions": {f.name: f.handler for f in cfg.functions},
                "host_memory_mb": {f.name: f.host_memory_mb for f in cfg.functions},
                "sys_path": list(cfg.sys_path),
                "preload": list(cfg.preload),
                "instance_threads": cfg.instance_threads,
                "huge_pages": cfg.huge_pages,
                "prefork": cfg.prefork,
            },
        )

    def await_template(self, timeout: float = 300.0) -> None:
        deadline = time.perf_counter() + timeout
        while True:
            for event in self._read_events(block_until=deadline):
                if event[0] == SPARE:
                    self._spares += 1
                elif event[0] == READY:
                    self.timings["template_collapsed_bytes"] = event[2]
                    os.set_blocking(self.evt_fd, False)
                    return
                if event[0] == FAILED:
                    raise ProxyError(
                        f"the template of workflow {self.config.workflow!r} could not start:\n{event[1]}"
                    )
            if time.perf_counter() >= deadline:
                raise ProxyError(
                    f"the template of workflow {self.config.workflow!r} was not ready in {timeout} s"
                )

    def _read_events(self, block_until: float | None = None) -> list[list[Any]]:
        if block_until is not None:
            wait_readable(self.evt_fd, block_until - time.perf_counter())
        try:
            chunk = os.read(self.evt_fd, 1 << 16)
        except BlockingIOError:
            chunk = None
        if chunk == b"":
            raise ProxyError(f"the template of workflow {self.config.workflow!r} exited")
        if chunk:
            self._evt_buf += chunk
        events = []
        buf = self._evt_buf
        while len(buf) >= 4:
            size = int.from_bytes(buf[:4], "little")
            if len(buf) < 4 + size:
                break
            events.append(msgpack.unpackb(bytes(buf[4 : 4 + size]), raw=False))
            del buf[: 4 + size]
        return events

    def poll(self) -> tuple[int, list[Exit], bool]:
        """Read the template's events: (how many, the instances that exited, whether the template
        died -- then every instance is in the exits and the caller restarts it with `restart`)."""
        try:
            events = self._read_events()
        except ProxyError as exc:
            reason = f"died with its template ({exc})"
            return 1, [Exit(inst, reason) for inst in list(self.instances.values())], True
        exits = []
        for event in events:
            if event[0] == SPARE:
                self._spares += 1
            elif event[0] == FORKED:
                _, iid, pid = event
                inst = self.instances.get(iid)
                if inst is not None and inst.pid is None:
                    inst.pid = pid
                    self._pids[pid] = iid
            elif event[0] == EXITED:
                _, pid, status = event
                iid = self._pids.pop(pid, None)
                inst = self.instances.get(iid) if iid is not None else None
                if inst is not None:
                    exits.append(Exit(inst, describe_status(status)))
        return len(events), exits, False

    def restart(self) -> None:
        """Replace a dead template (its instances were dropped already)."""
        with contextlib.suppress(OSError):
            os.close(self._cmd_w)
        self._assign.close()
        os.close(self.evt_fd)
        self._evt_buf.clear()
        self._spares = 0
        with contextlib.suppress(Exception):
            self.template.wait(timeout=1.0)
        self.spawn_template()
        self.await_template()

    def close(self, grace_s: float) -> None:
        with contextlib.suppress(OSError):
            os.close(self._cmd_w)  # the template exits; its children die with it
        self._assign.close()  # spares waiting for an assignment see the end and exit
        try:
            self.template.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.template.kill()
            self.template.wait()

    def close_events(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.evt_fd)

    # -- instances ---------------------------------------------------------------------------
    def start(self, inst: Instance, endpoint: Any) -> str | None:
        """Have the instance forked (a spare takes it, else the template forks); None, or why not."""
        self.instances[inst.id] = inst
        try:
            if self._spares > 0:
                self._spares -= 1
                inst.refill = True
                self._assign.send(msgpack.packb([inst.id, inst.spec.name, endpoint], use_bin_type=True))
            else:  # no spare ready (or prefork 0): fork now
                write_frame(self._cmd_w, [inst.id, inst.spec.name, endpoint])
        except OSError as exc:
            return f"could not be forked: the template is gone ({exc})"
        return None

    def registered(self, inst: Instance, pid: int) -> None:
        inst.pid = pid
        self._pids[pid] = inst.id
        with contextlib.suppress(OSError):
            inst.pidfd = os.pidfd_open(pid)

    def refill_spare(self, inst: Instance) -> None:
        """The instance that took a spare answered its first request: ask the template for another."""
        if inst.refill:
            inst.refill = False
            with contextlib.suppress(OSError):
                write_frame(self._cmd_w, [SPARE])

    def kill(self, inst: Instance) -> None:
        try:
            if inst.pidfd is not None:
                signal.pidfd_send_signal(inst.pidfd, signal.SIGKILL)
            elif inst.pid is not None:
                os.kill(inst.pid, signal.SIGKILL)
        except (ProcessLookupError, OSError):
            pass

    def forget(self, inst: Instance) -> None:
        self.instances.pop(inst.id, None)
        if inst.pid is not None:
            self._pids.pop(inst.pid, None)
        if inst.pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(inst.pidfd)
            inst.pidfd = None
