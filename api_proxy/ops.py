"""The forwarded ops, one function each: `op(res, call, *args)` where `args` are the call's arguments as
`protocol.decode` checked them (their count; their values are checked here, and a bad one fails the
call only).

An op returns its reply value, or is a generator that yields what it waits for (`waits`) and returns
the value when it is done; `calls.Calls` resumes it where it stopped.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import torch

from streambox.comm.store_protocol import adopted
from streambox.kernel_compiler.ops import invoke_kernel
from streambox.kernel_compiler.plan import KernelPlan

from .batched_infer import infer_batched, joinable, limits_of
from .device_tensor import DeviceTensor
from .errors import KeyNotFound, ProxyError, QuotaExceeded
from .executor import ELEMENTS_PER_BLOCK, RunResult
from .handles import Handle, check_key
from .resources import Resources, torch_dtype
from .state import Instance, Invocation
from .waits import Completion, KeyPut, Offload, Wait

DEFAULT_GET_TIMEOUT_S = 10.0
Op = Generator[Wait, Any, Any]


@dataclass(frozen=True, slots=True)
class CallContext:
    """Who makes a call: the instance, its invocation, and what the proxy knows of the request."""

    inst: Instance
    inv: Invocation
    device: int
    ended: Callable[[str], bool]  # whether a key's request has ended (its keys were dropped)


def op_noop(res: Resources, call: CallContext) -> None:
    return None


def op_upload(res: Resources, call: CallContext, payload: Any) -> Handle:
    return res.handle(res.upload(call.inst, call.inv, payload))


def op_download(res: Resources, call: CallContext, handle: Any) -> Op:
    t = res.tensor(call.inv, handle)
    host = torch.empty(t.nbytes, dtype=torch.uint8)
    if t.nbytes:
        res.runtime.copy_dtoh_async(host, t.address, t.nbytes, call.inst.stream)
    yield Completion(res.record(call.inst.stream))
    return host.numpy().data


def _input_shape(item: Any) -> tuple[int, ...]:
    return tuple(
        int(d) for d in (item["tensor"][1] if isinstance(item, dict) else Handle.from_wire(item).shape)
    )


def op_infer(res: Resources, call: CallContext, model: str, inputs: list[Any]) -> Op:
    plan = res.function_plan(call.inst.spec, model)
    if not isinstance(inputs, list) or len(inputs) != len(plan.inputs):
        given = len(inputs) if isinstance(inputs, list) else type(inputs).__name__
        raise ValueError(f"model {model!r} takes {len(plan.inputs)} input(s) {plan.inputs}, got {given}")
    # Nothing is issued before the plan and the weights are at hand.
    shape = _input_shape(inputs[0])
    usual = tuple(plan.variables[plan.inputs[0]].shape)
    if len(shape) >= 1 and shape != usual:
        if len(shape) != len(usual) or min(shape) < 1:
            raise ValueError(
                f"model {model!r} takes inputs of {len(usual)} dimensions, each >= 1 (its usual shape "
                f"{list(usual)}), got shape {list(shape)}"
            )
        # Another batch size or input shape: that plan (read or lowered once), sharing the weights.
        plan = yield from res.plan_for(model, shape[0], shape[1:])
    with (yield from res.weights(plan)):
        given = [
            res.upload(call.inst, call.inv, x["tensor"]) if isinstance(x, dict) else res.tensor(call.inv, x)
            for x in inputs
        ]
        yield from res.uploads_issued(call.inst)
        with (yield from res.weights(plan)):  # the weights may have gone while the uploads waited
            tensors = _checked_inputs(model, plan, given)
            limits = limits_of(call.inst.spec, one_call_per_instance=True)
            if limits is not None and joinable(limits, given):  # gathered with other invocations' infers
                handles = yield from infer_batched(res, call, model, given, limits, _run_plan)
                if handles is not None:
                    return handles
            result = yield from _run_plan(res, call, model, plan, tensors)
            return _output_handles(res, call, model, plan, result)


def _run_plan(
    res: Resources, call: CallContext, model: str, plan: KernelPlan, tensors: dict[str, DeviceTensor]
) -> Generator[Wait, Any, RunResult]:
    """The plan run on the caller's stream: issued here, on the dispatcher, or by an issuer thread."""
    if res.issuer is None:
        cu_cap = res.cu_cap(call.inst.spec)  # the function's GPU share (PTB semantics)
        return res.memory.infer(call.inst.key, plan, tensors, call.inst.stream, cu_cap=cu_cap)
    return (yield from _issue_off_dispatcher(res, call, model, plan, tensors))


def _issue_off_dispatcher(
    res: Resources, call: CallContext, model: str, plan: KernelPlan, tensors: dict[str, DeviceTensor]
) -> Generator[Wait, Any, RunResult]:
    """The plan issued by an issuer thread (`issuer.py`) while the dispatcher serves other instances;
    this instance is held meanwhile (its later calls keep their order). Errors are raised as they were."""
    inst = call.inst
    ticket = res.issuer.submit(  # type: ignore[union-attr]
        lambda on_kernel: res.memory.infer(
            inst.key, plan, tensors, inst.stream, cu_cap=res.cu_cap(inst.spec), on_kernel=on_kernel
        ),
        res.memory.allocator.free_many,
        inst.stream,
    )
    inst.issue = ticket
    try:
        ok, value = yield Offload(ticket.future, f"issuing {model!r}")
    finally:
        if inst.issue is ticket:
            inst.issue = None
    if not ok:
        raise value
    return value


def _checked_inputs(model: str, plan: KernelPlan, given: list[DeviceTensor]) -> dict[str, DeviceTensor]:
    tensors: dict[str, DeviceTensor] = {}
    for name, t in zip(plan.inputs, given, strict=True):
        var = plan.variables[name]
        if tuple(t.shape) != tuple(var.shape) or t.dtype != var.torch_dtype:
            raise ValueError(
                f"model {model!r} (batch {plan.batch}) expects input {name} of "
                f"{var.dtype}{list(var.shape)}, got {str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
            )
        tensors[name] = t
    return tensors


def _output_handles(
    res: Resources, call: CallContext, model: str, plan: KernelPlan, result: RunResult
) -> list[Handle]:
    own = [n for n in plan.outputs if plan.variables[plan.root(n)].kind in ("output", "intermediate")]
    fresh = [result.outputs[n] for n in own if result.outputs[n].address not in res.buffers]
    try:  # the run's outputs count against the invocation's quota, as its allocations do
        res.check_quota(call.inst.spec.name, call.inv, sum(t.nbytes for t in fresh))
    except QuotaExceeded:
        res.memory.pool.free_many([t.address for t in fresh], call.inst.stream)
        raise
    handles = []
    for name in plan.outputs:
        out = result.outputs[name]
        if out.address in res.buffers:
            res.buffers.hold(out.address, call.inv.holder)
            handles.append(res.handle(out))
        elif name in own:
            handles.append(res.register(out, call.inv))
        else:
            raise ProxyError(f"model {model!r}: output {name} aliases a weight; not supported")
    return handles


def op_put(res: Resources, call: CallContext, key: Any, handle: Any, consumers: Any, ttl: Any) -> None:
    key = check_key(res.workflow, key, call.inv.request_id)
    if call.ended(key):
        raise ProxyError(f"PUT {key!r}: its request has ended and its keys were dropped")
    t = res.tensor(call.inv, handle)
    if res.buffers.get(t.address).external:  # type: ignore[union-attr]
        raise ProxyError(
            f"PUT {key!r}: this buffer already belongs to the communication store (it came from a GET "
            f"or an earlier PUT); PUT a copy instead (ctx.alloc + ctx.memcpy)"
        )
    where = res.store.put(
        key, t, device=call.device, consumers=consumers, ttl=ttl, stream=call.inst.stream,
        writer=call.inst.spec.name,  # held to one function's share of the workflow's store
    )
    if adopted(where, t, call.device):  # the managed store took the bytes over; the handle stays usable
        res.buffers.disown(t.address)
    # else the store copied them (CUDA-IPC style): the buffer stays the request's, freed with it


def op_get(res: Resources, call: CallContext, key: Any, timeout: Any) -> Op:
    key = check_key(res.workflow, key, call.inv.request_id)
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)):
        raise TypeError(f"a GET timeout is a number of seconds, got {timeout!r}")
    timeout = float(timeout if timeout is not None else DEFAULT_GET_TIMEOUT_S)
    if not 0 <= timeout < math.inf:  # a NaN deadline would never compare due: it held every later one
        raise ValueError(f"a GET timeout is a finite number of seconds >= 0, got {timeout}")
    deadline = time.perf_counter() + timeout
    while True:  # a PUT wakes every GET of its key; one may have consumed it before this one
        value = res.take(call.inst, call.inv, key, call.device)
        if value is not None:
            return value
        why = KeyNotFound(f"GET {key!r}: no data under this key after waiting {timeout:g} s")
        yield KeyPut(key, deadline, why)


def op_delete(res: Resources, call: CallContext, key: Any) -> bool:
    return res.store.delete(check_key(res.workflow, key, call.inv.request_id))


def op_alloc(res: Resources, call: CallContext, dtype: Any, shape: Any) -> Handle:
    t = res.alloc(call.inst, torch_dtype(dtype), tuple(int(d) for d in shape))
    return res.register(t, call.inv)


def op_free(res: Resources, call: CallContext, handle: Any) -> None:
    t = res.tensor(call.inv, handle)
    res.release(t.address, call.inv.holder, res.record(call.inst.stream))


def op_memcpy(res: Resources, call: CallContext, dst: Any, src: Any, nbytes: Any) -> None:
    d, s = res.tensor(call.inv, dst), res.tensor(call.inv, src)
    n = min(d.nbytes, s.nbytes) if nbytes is None else int(nbytes)
    if n < 0 or n > d.nbytes or n > s.nbytes:
        raise ValueError(f"memcpy of {n} bytes: destination has {d.nbytes}, source {s.nbytes}")
    res.runtime.copy_dtod_async(d.address, s.address, n, call.inst.stream)


def op_launch(res: Resources, call: CallContext, model: Any, index: Any, buffers: Any) -> Op:
    plan = res.function_plan(call.inst.spec, model)
    if not isinstance(index, int) or not 0 <= index < len(plan.kernels):
        raise ValueError(f"model {model!r} has kernels 0..{len(plan.kernels) - 1}, not {index}")
    kernel = plan.kernels[index]
    if kernel.kind == "view":
        raise ValueError(
            f"kernel {index} ({kernel.name}) of {model!r} is a view: metadata only, nothing to launch"
        )
    if not isinstance(buffers, dict):
        raise TypeError(f"launch binds variables to handles in a map, got {type(buffers).__name__}")
    with (yield from res.weights(plan)):
        bound = {name: res.tensor(call.inv, h) for name, h in buffers.items()}
        for name, tensor in bound.items():
            _check_binding(plan, index, name, tensor)
        missing = [n for n in kernel.accesses if plan.variables[n].kind != "weight" and n not in bound]
        if missing:
            raise ValueError(f"kernel {index} ({kernel.name}) of {model!r} needs buffers for {missing}")
        _launch(res, call, plan, index, bound)


def _check_binding(plan: KernelPlan, index: int, name: Any, tensor: DeviceTensor) -> None:
    """A bound buffer must be one of the plan's non-weight variables, with its exact dtype, shape and
    strides: a kernel writes its outputs through them (a smaller buffer would be written past its end,
    into other requests' memory)."""
    spec = plan.variables.get(name) if isinstance(name, str) else None
    where = f"kernel {index} ({plan.kernels[index].name}) of {plan.model!r}"
    if spec is None or spec.kind == "weight":
        raise ValueError(f"{where}: {name!r} is not one of the plan's non-weight variables, which it binds")
    have = (str(tensor.dtype).removeprefix("torch."), list(tensor.shape), list(tensor.strides))
    want = (spec.dtype, list(spec.shape), list(spec.strides))
    if have != want:
        raise ValueError(
            f"{where}: the buffer bound to {name!r} is {have[0]} shape {have[1]} strides {have[2]}; "
            f"the plan's variable is {want[0]} shape {want[1]} strides {want[2]}"
        )


def _launch(
    res: Resources, call: CallContext, plan: KernelPlan, index: int, bound: dict[str, DeviceTensor]
) -> None:
    kernel = plan.kernels[index]
    resident = res.memory.models.acquire(plan, call.inst.stream)  # issued: does not block
    try:
        env: dict[str, torch.Tensor] = dict(resident.weight_views)
        runtime = res.runtime
        views = [k for k in plan.kernels[:index] if k.kind == "view"]

        def run() -> object:
            for name, t in bound.items():
                env[name] = t.view(runtime)
            for k in views:  # the aliases this kernel may read, rebuilt over the bound buffers
                with contextlib.suppress(KeyError):
                    env.update(invoke_kernel(k, env))
            return invoke_kernel(kernel, env)

        out = plan.variables[kernel.outputs[0]]
        blocks = max(1, math.ceil(math.prod(out.shape) / ELEMENTS_PER_BLOCK))
        runtime.launch(call.inst.stream, run, blocks=blocks, name=kernel.name)
    finally:
        res.memory.models.release(plan.model, after=res.record(call.inst.stream))


def op_synchronize(res: Resources, call: CallContext) -> Op:
    yield Completion(res.record(call.inst.stream))


def op_plan(res: Resources, call: CallContext, model: Any) -> dict[str, Any]:
    plan = res.function_plan(call.inst.spec, model)
    return {
        "model": plan.model,
        "batch": plan.batch,
        "inputs": plan.inputs,
        "outputs": plan.outputs,
        "variables": {
            v.name: {
                "kind": v.kind,
                "dtype": v.dtype,
                "shape": v.shape,
                "strides": v.strides,
                "nbytes": v.nbytes,
                "base": v.base,
            }
            for v in plan.variables.values()
        },
        "kernels": [
            {"name": k.name, "kind": k.kind, "accesses": k.accesses, "outputs": k.outputs}
            for k in plan.kernels
        ],
    }


OPS: dict[str, Callable[..., Any]] = {
    "noop": op_noop,
    "upload": op_upload,
    "download": op_download,
    "infer": op_infer,
    "put": op_put,
    "get": op_get,
    "delete": op_delete,
    "alloc": op_alloc,
    "free": op_free,
    "memcpy": op_memcpy,
    "launch": op_launch,
    "synchronize": op_synchronize,
    "plan": op_plan,
}
