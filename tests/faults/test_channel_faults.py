"""Fault containment at the forwarding channel: removing one instance's peer in the middle of a poll
(the proxy's "kill only the sender" path) never raises and leaves the other instances served."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from streambox.api_proxy.channel import connect, make_server
from streambox.api_proxy.shm_ring import private_dir


@pytest.mark.parametrize("kind", ["shm", "zmq"])
def test_removing_the_sender_inside_poll_keeps_the_others_served(kind):
    directory = private_dir("sbx-faults-")
    server = make_server(kind, directory)
    clients = {}
    try:
        for iid in (1, 2, 3):
            clients[iid] = connect(server.add(iid))
        for client in clients.values():
            client.send(b"x" * 100)
        clients[2].send(b"bad" * 2000)  # several records' worth after its first message
        got: list[tuple[int, bytes]] = []

        def deliver(instance_id: int, data: bytes) -> None:
            got.append((instance_id, data))
            if instance_id == 2:
                server.remove(instance_id)  # the offender alone goes, mid-round

        _poll_until(server, deliver, lambda: len({i for i, _ in got}) == 3)
        assert {i for i, _ in got} == {1, 2, 3}
        assert [d for i, d in got if i == 2] == [b"x" * 100]  # nothing read after its removal
        server.send(1, b"ok")
        server.send(2, b"to nobody")  # a removed instance's reply is dropped, not an error
        server.poll(deliver)
        assert clients[1].recv(timeout=2.0) == b"ok"
        clients[3].send(b"still here")
        _poll_until(server, deliver, lambda: got[-1] == (3, b"still here"))
        assert got[-1] == (3, b"still here")
    finally:
        for client in clients.values():
            client.close()
        server.close()
    assert not list(directory.iterdir()) if directory.exists() else True
    if directory.exists():  # the server leaves its folder (the proxy's own, removed by its launcher)
        directory.rmdir()


def _poll_until(server, deliver: Callable[[int, bytes], None], done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 5.0
    while not done() and time.monotonic() < deadline:
        if not server.poll(deliver):
            time.sleep(0.001)
