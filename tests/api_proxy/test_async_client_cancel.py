"""A call of the proxy's asyncio client that is cancelled as its reply arrives is cancelled: the
caller's loop must not go on. (`asyncio.wait_for` on Python 3.11 returned the reply instead; the
invoker's housekeeping, cancelled by `close` while a stats reply came in, then looped forever and
`close` waited for it: a replay that never ended.)"""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import zmq
import zmq.asyncio

from streambox.api_proxy.control import AsyncProxyClient


def test_a_call_cancelled_as_its_reply_arrives_raises_the_cancellation(tmp_path):
    async def scenario() -> None:
        address = f"ipc://{tmp_path / 'proxy.sock'}"
        context = zmq.asyncio.Context()
        router = context.socket(zmq.ROUTER)
        router.bind(address)
        client = AsyncProxyClient(address, key=b"k")
        try:
            caller = asyncio.create_task(client.call("stats", {}, timeout=30.0))
            _, body = await asyncio.wait_for(router.recv_multipart(), 10)
            call_id = msgpack.unpackb(body)[0]
            reply = client._pending[call_id]
            reply.set_result({"ok": True})  # the reply comes in ...
            caller.cancel()  # ... in the same turn of the loop as the cancellation
            with pytest.raises(asyncio.CancelledError):
                await caller
        finally:
            client.close()
            router.close(0)
            context.term()

    asyncio.run(scenario())
