"""A second node in its own process, for the cross-node tests: `python remote_node.py STATE_DIR`.

It serves a store (node "B", one emulated GPU) over RPC, prints {"endpoint": ...} and then obeys one
JSON command per stdin line, answering one JSON line each:
  {"op": "put", "key", "n", "seed", "consumers", "delay"}  PUT float32 arange(n) + seed after `delay` s
  {"op": "stats"}                                          the store's usage, keys and held leases
  {"op": "quit"}
"""

from __future__ import annotations

import json
import sys
import threading
import time

import torch

from streambox.comm import CommStore, StoreConfig
from streambox.comm.rpc import RpcServer
from streambox.device.emulated import EmulatedBackend
from streambox.device.specs import V100_16GB, MiB


class PoolAllocator:
    """The device's stream-ordered pool behind the store's allocator interface (importing the
    executor's equivalent would load the kernel compiler: seconds of start-up for nothing)."""

    def __init__(self, pool) -> None:
        self.pool = pool

    def allocate(self, nbytes: int, stream) -> int:
        return self.pool.alloc_async(nbytes, stream)

    def free(self, address: int, stream) -> None:
        self.pool.free_async(address, stream)


def main() -> None:
    spec = V100_16GB.with_overrides(total_memory=64 * MiB, context_create_s=0.0, context_memory=0)
    backend = EmulatedBackend(spec=spec, count=1, state_dir=sys.argv[1])
    runtime = backend.open_runtime(0)
    allocator = PoolAllocator(runtime.create_pool())
    store = CommStore({0: runtime}, {0: allocator}, node="B", idle={0: 32 * MiB}, config=StoreConfig())
    store.start()
    server = RpcServer(store)
    out_lock = threading.Lock()

    def say(obj: dict) -> None:
        with out_lock:
            print(json.dumps(obj), flush=True)

    def put(cmd: dict) -> None:
        time.sleep(cmd.get("delay", 0))
        tensor = torch.arange(cmd["n"], dtype=torch.float32) + cmd.get("seed", 0)
        store.put(cmd["key"], tensor, device=0, consumers=cmd.get("consumers"))
        if not cmd.get("delay"):
            say({"ok": True})

    say({"endpoint": server.endpoint})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "put":
            if cmd.get("delay"):  # answer now, PUT later: the reader's GET waits meanwhile
                threading.Thread(target=put, args=(cmd,)).start()
                say({"ok": True})
            else:
                put(cmd)
        elif cmd["op"] == "stats":
            store.synchronize()
            usage = store.usage()
            say({"used": usage[0], "keys": store.keys(), "leases": store.held_leases(),
                 "pool_used": allocator.pool.used_bytes})
        elif cmd["op"] == "quit":
            break
    server.close()
    store.close()
    backend.close()


if __name__ == "__main__":
    main()
