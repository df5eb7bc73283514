"""The warm template: a process that has imported everything a workflow's handlers need, and forks.

The proxy starts one template per workflow (`python -c` of `main`, before the proxy creates its
device runtime). The template imports torch, the SDK and every handler module, resolves the
handlers, runs each handler module's `warm_up()` where it has one (`warm_up_modules`), then
freezes its heap (`gc.freeze`) and backs it with huge pages (`MADV_COLLAPSE` where the kernel has
it: fork copies page tables, and torch's few hundred MB of heap in 4 KiB pages make a fork cost
~15 ms on a VM, ~3 ms in 2 MiB pages). It never creates a device context nor a zmq context.

Instances are forks of the template, made two ways:

- pre-forked spares (`prefork` > 0, the default): the template forks that many children ahead,
  each past its copy-on-write warm-up and blocked on the proxy's assignment socket (a
  SOCK_SEQPACKET pair: every datagram `[instance id, function, endpoint]` reaches exactly one
  spare). Starting an instance then costs an assignment, a stream and a registration; the fork is
  paid in the background (the zygote pattern: Android's USAP pool, gunicorn's preload + prefork).
  The proxy counts the spares (`[SPARE, pid]` reports) and asks for a new one (`[SPARE]` on the
  command pipe) once the instance that took one has answered its first request, so the fork does
  not compete with that cold start for the CPU;
- on demand (`prefork` = 0, or no spare ready): `[instance id, function, endpoint]` on the command
  pipe.

Either way the child closes the template's descriptors, asks to be killed with its parent
(`PR_SET_PDEATHSIG`), connects the channel and registers with the proxy itself (HELLO). The
template reports `[FORKED, instance id, pid]` / `[SPARE, pid]`, reaps its children and reports
`[EXITED, pid, status]` on its event pipe.

A handler may start processes of its own (`subprocess`, `os.fork`, a daemon that detaches with
`setsid`). They end with their instance: the template is a child subreaper (`PR_SET_CHILD_SUBREAPER`),
so what an instance leaves behind when it exits becomes the template's child, and the template kills
every child that is not one of its instances or spares (`_Template.kill_adopted`) after each exit it
reaps; when it ends it kills its instances first, then what they leave. Only a process that is still
its instance's child runs on while the instance lives (as a thread the handler left running would).

Frames on the pipes: a 4-byte little-endian length, then msgpack.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import os
import signal
import socket
import struct
import sys
import time
import traceback
from collections.abc import Iterable
from typing import Any

import msgpack

from .instance_output import OutputForwarder, adopt_pipes, label_line

FORKED = "forked"
EXITED = "exited"
READY = "ready"
FAILED = "failed"
SPARE = "spare"

_LEN = struct.Struct("<I")
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
END_KILL_ROUNDS = 50  # at the template's end: kill, reap, look again (what they leave is adopted too)
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
HUGE = 2 << 20


def write_frame(fd: int, obj: Any) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    frame = _LEN.pack(len(data)) + data
    view = memoryview(frame)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def read_frame(fd: int) -> Any | None:
    """One frame, or None at end of file."""
    head = _read_exact(fd, _LEN.size)
    if head is None:
        return None
    body = _read_exact(fd, _LEN.unpack(head)[0])
    if body is None:
        return None
    return msgpack.unpackb(body, raw=False)


def _read_exact(fd: int, n: int) -> bytes | None:
    parts, left = [], n
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            return None
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


_LIBC: list[Any] = []


def _libc() -> Any:
    if not _LIBC:
        _LIBC.append(ctypes.CDLL(None, use_errno=True))
    return _LIBC[0]


def die_with_parent(signum: int = signal.SIGKILL) -> None:
    """Ask the kernel to send `signum` to this process when its parent exits (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        _libc().prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)


def become_subreaper() -> bool:
    """Adopt the orphans of this process's descendants (Linux >= 3.4), so they can be ended here."""
    try:
        return _libc().prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def child_pids(parent: int) -> list[int]:
    """The pids whose parent is `parent`, read from /proc (orphans adopted by a subreaper included)."""
    # Imported here: the supervisor imports this module in the proxy's launcher, which must not wait
    # for torch (`streambox.device`) before it spawns the template (`proxy_launch`).
    from streambox.device.procfs import stat_fields

    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            fields = stat_fields(int(entry.name))  # None: gone meanwhile
            if fields is not None and int(fields[1]) == parent:
                pids.append(int(entry.name))
    return pids


def collapse_heap() -> int:
    """Back this process's anonymous writable memory with huge pages; returns the bytes collapsed."""
    try:
        madvise = _libc().madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        with open("/proc/self/maps") as f:
            lines = f.readlines()
    except (OSError, AttributeError):
        return 0
    done = 0
    for line in lines:
        fields = line.split()
        perms, name = fields[1], fields[5] if len(fields) > 5 else ""
        if not perms.startswith("rw") or (name and name != "[heap]"):
            continue
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        lo, hi = (lo + HUGE - 1) // HUGE * HUGE, hi // HUGE * HUGE
        if hi <= lo:
            continue
        madvise(lo, hi - lo, MADV_HUGEPAGE)
        if madvise(lo, hi - lo, MADV_COLLAPSE) == 0:
            done += hi - lo
    return done


def resolve_handler(spec: str) -> Any:
    """`module:function` -> the function (imported now, in the template)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"handler {spec!r} is not of the form 'module:function'")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"handler {spec!r} is not callable")
    return obj


#: What an instance imports before its handlers (the template for all its instances). torchvision: the
#: SDK's image decoding imports it, 2.6 s of CPU an instance otherwise paid at its first image.
INSTANCE_PRELOAD = ("torch", "torchvision")


def preload_modules(modules: Iterable[str]) -> None:
    """Import `modules` (`INSTANCE_PRELOAD`, or a proxy's `preload`)."""
    for module in modules:
        importlib.import_module(module)


class WarmUpFailed(RuntimeError):
    """A handlers' module's `warm_up()` raised (its error is the cause): the workflow cannot start."""


def warm_up_modules(handlers: Iterable[Any]) -> int:
    """Call, once each, the `warm_up()` of the handlers' modules that define one: lazy work (built
    objects, tables) done where the handlers are imported, so that instances forked afterwards
    inherit it instead of paying it at their first request. How many ran."""
    modules = sorted(filter(None, {getattr(h, "__module__", None) for h in handlers}))
    hooks = [(m, getattr(sys.modules.get(m), "warm_up", None)) for m in modules]
    for module, hook in hooks:
        if callable(hook):
            try:
                hook()
            except Exception as exc:  # the workflow cannot start: say whose hook, where it came from
                where = getattr(sys.modules[module], "__file__", None) or module
                raise WarmUpFailed(f"warm_up() of module {module!r} ({where}) raised:") from exc
    return sum(callable(hook) for _, hook in hooks)


def _setup_child(template_pid: int, close: list[int]) -> None:
    for fd in close:
        with contextlib.suppress(OSError):
            os.close(fd)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
    die_with_parent()
    if os.getppid() != template_pid:  # the template died meanwhile
        os._exit(1)


def _serve(
    instance_id: int,
    workflow: str,
    function: str,
    handler: Any,
    endpoint: dict[str, Any],
    memory_mb: int | None,
) -> None:
    from .channel import connect
    from .client import serve

    serve(
        connect(endpoint), instance_id=instance_id, workflow=workflow, function=function, handler=handler,
        host_memory_mb=memory_mb,
    )


def _exit_child(body: Any) -> None:
    code = 0
    try:
        body()
    except BaseException:  # noqa: BLE001 - an instance reports and exits; it never returns to the loop
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(AttributeError, OSError, ValueError):  # None, or closed
                stream.flush()
        os._exit(code)


def _spare_wait(assign: socket.socket) -> tuple[int, str, dict[str, Any]]:
    """A pre-forked spare: wait for an assignment (one datagram)."""
    data = assign.recv(1 << 16)
    if not data:
        os._exit(0)  # the proxy is gone
    instance_id, function, endpoint = msgpack.unpackb(data, raw=False)
    assign.close()
    return instance_id, function, endpoint


def _warm_up() -> None:
    """Touch, in a new spare, what an instance touches on its first request (copy-on-write faults
    paid ahead): the wire codec and the client's classes."""
    from . import client, wire

    wire.unpack(wire.pack([wire.CALL, 1, "noop", [[b"x", 1.0, None]]]))
    client.Client.__init__  # noqa: B018


def _import_handlers(config: dict[str, Any]) -> dict[str, Any]:
    """Import what the handlers need (the SDK, the channel and client once here, not in each
    instance) and resolve the handlers."""
    for path in config.get("sys_path", []):
        if path not in sys.path:
            sys.path.insert(0, path)
    preload_modules(config.get("preload", []))
    threads = int(config.get("instance_threads") or 0)
    if threads and "torch" in sys.modules:  # set once here: every instance forked from it has it
        sys.modules["torch"].set_num_threads(threads)
    import streambox.sdk  # noqa: F401 - the SDK the handlers use

    from . import channel, client  # noqa: F401 - imported once here, not in each instance

    handlers = {name: resolve_handler(spec) for name, spec in config["functions"].items()}
    warm_up_modules(handlers.values())
    return handlers


class _Template:
    """The template's loop: fork spares and instances on the proxy's commands, report them and
    their exits on the event pipe."""

    def __init__(
        self,
        cmd_fd: int,
        evt_fd: int,
        assign: socket.socket | None,
        config: dict[str, Any],
        handlers: dict[str, Any],
    ):
        self.cmd_fd, self.evt_fd, self.assign = cmd_fd, evt_fd, assign
        self.workflow, self.handlers = config["workflow"], handlers
        self.memory_mb: dict[str, int] = config.get("host_memory_mb", {})  # per function
        self.me = os.getpid()
        self.forked: set[int] = set()  # its instances and spares; any other child was adopted
        self.output = OutputForwarder()  # what the children print, labelled and bounded
        # While a child is being forked (`_forking`), `reap` (a signal handler: it may run between
        # the fork and the pid's `forked.add`) kills nothing and keeps the exits of unknown pids.
        self._forking = False
        self._early: dict[int, int] = {}  # pid -> status, reaped while forking
        self._kill_due = False

    def reap(self, signum: int, frame: Any) -> None:
        ended = False
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid in self.forked:
                self.forked.discard(pid)
                ended = True
                write_frame(self.evt_fd, [EXITED, pid, status])
            elif self._forking:  # perhaps the child being forked, not added yet
                self._early[pid] = status
        if ended:  # what an instance left behind is the template's child now
            if self._forking:
                self._kill_due = True
            else:
                self.kill_adopted()

    @contextlib.contextmanager
    def _fork_guard(self) -> Any:
        """Around a fork and the pid's `forked.add`: then the exits and kills `reap` held back."""
        self._forking = True
        try:
            yield
        finally:
            self._forking = False
            early, self._early = self._early, {}
            for pid, status in early.items():
                if pid in self.forked:
                    self.forked.discard(pid)
                    write_frame(self.evt_fd, [EXITED, pid, status])
            if self._kill_due or early:
                self._kill_due = False
                self.kill_adopted()

    def _fork(self, label: str | None) -> int:
        """Fork a child with its own output pipes (`instance_output`); `label` names its output (a
        spare names itself once assigned)."""
        pipes = self.output.pipes()
        pid = os.fork()
        if pid == 0:
            close = [self.cmd_fd, self.evt_fd, *self.output.fds()]
            if self.assign is not None and label is not None:  # an instance: no spare's socket
                close.append(self.assign.fileno())
            _setup_child(self.me, close)
            adopt_pipes(pipes)
            return 0
        self.forked.add(pid)
        self.output.add(pipes, label or f"{self.workflow}/spare-{pid}")
        return pid

    def kill_adopted(self, *, everyone: bool = False) -> int:
        """SIGKILL every child that is no instance or spare of this template (see the module doc), or
        every child (`everyone`); returns how many."""
        children = [pid for pid in child_pids(self.me) if everyone or pid not in self.forked]
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(children)

    def end_children(self) -> None:
        """At the template's end: kill its children, instances too (what they started would otherwise
        outlive them), and reap them, until none is left (each may leave orphans of its own, adopted
        in turn); bounded, as the template must exit."""
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for _ in range(END_KILL_ROUNDS):
            if not self.kill_adopted(everyone=True) or not _reap_for(0.1):
                break
        self.output.drain()  # their last lines

    def fork_spare(self) -> None:
        assign = self.assign
        assert assign is not None
        with self._fork_guard():
            pid = self._fork(None)
            if pid == 0:
                _warm_up()

                def body() -> None:
                    instance_id, function, endpoint = _spare_wait(assign)
                    with contextlib.suppress(OSError):  # names its output (`instance_output`)
                        os.write(1, label_line(f"{self.workflow}/{function}#{instance_id}").encode())
                    handler, memory = self.handlers[function], self.memory_mb.get(function)
                    _serve(instance_id, self.workflow, function, handler, endpoint, memory)

                _exit_child(body)
            write_frame(self.evt_fd, [SPARE, pid])

    def fork_instance(self, instance_id: int, function: str, endpoint: dict[str, Any]) -> None:
        with self._fork_guard():
            pid = self._fork(f"{self.workflow}/{function}#{instance_id}")
            if pid == 0:
                handler, memory = self.handlers[function], self.memory_mb.get(function)
                _exit_child(lambda: _serve(instance_id, self.workflow, function, handler, endpoint, memory))
            write_frame(self.evt_fd, [FORKED, instance_id, pid])

    def run(self, spares: int, collapsed: int) -> None:
        signal.signal(signal.SIGCHLD, self.reap)
        with _sigchld_blocked():
            for _ in range(spares):
                self.fork_spare()
        write_frame(self.evt_fd, [READY, self.me, collapsed])
        while True:
            request = read_frame(self.cmd_fd)
            if request is None:  # the proxy closed the pipe: done
                self.end_children()
                return
            with _sigchld_blocked():
                if request != [SPARE]:
                    self.fork_instance(*request)
                elif self.assign is not None:
                    self.fork_spare()


def main(cmd_fd: int, evt_fd: int, assign_fd: int = -1) -> None:
    # The proxy decides when the template ends (a Ctrl-C at the terminal reaches both: the proxy
    # stops and kills it); its forked instances take Ctrl-C back (`_setup_child`).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    become_subreaper()
    _open_std_fds()
    config = read_frame(cmd_fd)
    if config is None:
        return
    try:
        handlers = _import_handlers(config)
    except BaseException as exc:  # noqa: BLE001 - reported to the proxy, which fails its start
        hook = exc.__cause__ if isinstance(exc, WarmUpFailed) else None  # its own frames are noise
        why = "".join(traceback.format_exception(hook or exc))
        write_frame(evt_fd, [FAILED, f"{exc}\n{why}" if hook else why])
        return
    assign = socket.socket(fileno=assign_fd) if assign_fd >= 0 else None
    gc.collect()
    gc.freeze()
    collapsed = collapse_heap() if config.get("huge_pages", True) else 0
    spares = int(config.get("prefork", 0)) if assign is not None else 0
    _Template(cmd_fd, evt_fd, assign, config, handlers).run(spares, collapsed)


def _open_std_fds() -> None:
    """/dev/null on a closed descriptor 0, 1 or 2 (a gateway started with stdout closed): otherwise a
    child's output pipe could be made as descriptor 1 and forwarded into itself."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)  # the lowest free descriptor: this one


def _reap_for(seconds: float) -> bool:
    """Reap exited children for `seconds`; False once there is no child left."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            time.sleep(0.005)
    return True


@contextlib.contextmanager
def _sigchld_blocked() -> Any:
    """Fork and report the child before any exit report of it can be written."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})


#: The command the proxy runs (from a neutral working directory, so nothing shadows the package).
LAUNCH = (  # a Ctrl-C while importing ends it quietly, as a proxy's (`control.LAUNCH_PROXY`)
    "import sys\n"
    "try:\n"
    "    from streambox.api_proxy.template import main\n"
    "except KeyboardInterrupt:\n"
    "    sys.exit(130)\n"
    "main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))\n"
)
