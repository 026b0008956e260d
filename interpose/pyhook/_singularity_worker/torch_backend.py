"""The `singularity` torch.distributed backend: every collective goes through the device proxy.

`install()` (run from sitecustomize once the script has imported torch, if `compat` accepts that
torch) registers the backend and makes `init_process_group` and `new_group` use it whatever the script
asked for ("gloo", "nccl", env:// or tcp:// init), with a process-local store: the proxies find each
other through the coordinator, so workers open no TCP connection at all.

All of a rank's operations go through one FIFO thread per process, in the order the script issued
them, so every rank sends the same sequence to its proxy. Allreduce, reduce, gather, scatter and
all-to-all return at once with a future (DDP keeps computing its backward pass while a bucket is
reduced; `async_op=True` callers overlap them with their own work); the others wait for their turn and
their result. Where the rank's device is shared and its ranks take turns (the proxy says so), every
operation waits for its result and the rank's next turn: a rank computes only while it holds its
device. Arguments are checked when the script calls, so a call the proxy cannot serve fails
there with the reason, on every rank alike. At a checkpoint a rank is computing, or parked in a
request, never holding a half-done collective.

CUDA tensors: where the script calls, the end of the work its stream has queued is recorded, and the
queue's thread waits for that point. An allreduce then copies the tensor into the GPU buffer its proxy
gives it (where the proxy offers one on the tensor's GPU: `proxy_client.call_gpu`) and the result
back, on the GPU; every other case is staged through host memory (copied into the region shared with
the proxy, and the result back, before the operation completes). A rank parked at a cut has released
the GPU buffer, so it holds nothing of the proxy's on its GPU when its CUDA state is checkpointed.

Runs in the job's own Python (3.9 or newer) with the job's torch: standard library and torch only.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import math
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Work, _create_work_from_future
from torch.futures import Future

from . import BACKEND
from .proxy_client import ProxyClient, ProxyError

_DTYPES = {
    torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
    torch.bfloat16: "bfloat16", torch.int8: "int8", torch.int16: "int16", torch.int32: "int32",
    torch.int64: "int64", torch.uint8: "uint8", torch.bool: "bool",
}
REDUCTIONS = ("sum", "avg", "product", "min", "max")
SUPPORTED = ("allreduce", "reduce", "broadcast", "allgather", "gather", "scatter", "reduce_scatter",
             "alltoall", "barrier", "monitored_barrier", "send", "recv")
_CLIENT: ProxyClient | None = None


def client() -> ProxyClient:
    global _CLIENT
    if _CLIENT is None:
        env = os.environ
        try:
            _CLIENT = ProxyClient(env["SINGULARITY_JOB_ID"], int(env["RANK"]), int(env["WORLD_SIZE"]))
        except (KeyError, ValueError) as exc:
            raise ProxyError("the singularity backend runs under `singularityctl run --world-size N` "
                             f"(SINGULARITY_JOB_ID, RANK, WORLD_SIZE and SINGULARITY_RANK_DIR must be "
                             f"set): {exc}") from exc
    return _CLIENT


class _Queue:
    """The one thread that talks to the proxy for this process, in issue order."""

    def __init__(self):
        self.executor: ThreadPoolExecutor | None = None
        self.thread: threading.Thread | None = None
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self.executor = self.thread = None  # a forked child has no such thread

    def _ensure(self) -> ThreadPoolExecutor:
        if self.executor is None:
            self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="singularity-proxy",
                                               initializer=self._remember)
        return self.executor

    def _remember(self) -> None:
        self.thread = threading.current_thread()

    def run(self, action: Callable[[], object]):
        """Run `action` after everything issued before it, and wait for its result."""
        if threading.current_thread() is self.thread:
            return action()  # issued from a future's callback, already on the queue's thread
        return self._ensure().submit(action).result()

    def start(self, action: Callable[[], object], wait: bool = False,
              devices: Sequence[torch.device] = ()) -> dist.Work:
        """Run `action` after everything issued before it; a work object completes with its result
        (`wait`: has completed, on return). `devices`: the CUDA devices the result's tensors are on
        (a future holds tensors of those devices only)."""
        future: Future = Future(devices=list(devices)) if devices else Future()

        def step():
            try:
                result = action()
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the work
                future.set_exception(exc)
            else:
                future.set_result(result)

        if threading.current_thread() is self.thread:
            step()
        elif wait:
            self._ensure().submit(step).result()
        else:
            self._ensure().submit(step)
        return _Work(future)


class _Work(Work):
    """The work of an operation run on the queue: `wait()` raises what the operation raised.

    (torch's `_create_work_from_future` makes a work whose wait() returns True whatever its future
    holds, so a refused operation would leave the script's tensors unchanged without a word.) Until
    someone first waits on it or takes its future, the work keeps itself alive: a caller in C++ (DDP's
    reducer) may hold only the C++ half of it. A script must wait on its async works anyway; one it
    never waits on stays here.
    """

    _alive: set[_Work] = set()

    def __init__(self, future: Future):
        super().__init__()
        self.future = future
        _Work._alive.add(self)

    def _used(self) -> None:
        _Work._alive.discard(self)

    def wait(self, timeout=None) -> bool:
        self._used()
        self.future.wait()  # raises the operation's error
        return True

    def get_future(self) -> Future:
        self._used()
        return self.future

    def is_completed(self) -> bool:
        return self.future.done()

    def is_success(self) -> bool:
        if not self.future.done():
            return False
        try:
            self.future.value()
        except Exception:  # noqa: BLE001 - the operation's error means not a success
            return False
        return True

    def exception(self):
        try:
            self.future.value()
        except Exception as exc:  # noqa: BLE001 - returned, as torch's Work.exception does
            return exc
        return None

    def result(self):
        return self.future.value()


_QUEUE = _Queue()


def _done(result, devices: Sequence[torch.device] = ()) -> dist.Work:
    future: Future = Future(devices=list(devices)) if devices else Future()
    future.set_result(result)
    return _create_work_from_future(future)


def _cuda(tensors: Sequence[torch.Tensor]) -> list[torch.device]:
    """The CUDA devices these tensors are on, for the future that returns them."""
    return sorted({t.device for t in tensors if t.device.type == "cuda"}, key=lambda d: d.index or 0)


def _reduce_name(opts) -> str:
    op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
    op = getattr(op, "op", op)
    name = str(getattr(op, "name", op)).rsplit(".", 1)[-1].lower()
    if name not in REDUCTIONS:
        raise ProxyError(f"reduce op {name.upper()} is not supported by the singularity backend; "
                         f"supported: {', '.join(r.upper() for r in REDUCTIONS)}")
    return name


DEVICES = ("cpu", "cuda")


def _dtype(tensor: torch.Tensor) -> str:
    if tensor.device.type not in DEVICES:
        raise ProxyError(f"the singularity backend takes CPU and CUDA tensors, got one on {tensor.device}")
    try:
        return _DTYPES[tensor.dtype]
    except KeyError:
        raise ProxyError(f"dtype {tensor.dtype} is not supported by the singularity backend; supported: "
                         f"{', '.join(sorted(_DTYPES.values()))}") from None


def _pairs(left: Sequence, right: Sequence, what: str) -> list[tuple]:
    if len(left) != len(right):
        raise ProxyError(f"{what}: {len(left)} outputs for {len(right)} inputs")
    return list(zip(left, right))  # lengths checked above: zip(strict=) is Python 3.10


def _one(tensors: Sequence, what: str):
    if len(tensors) != 1:
        raise ProxyError(f"{what} takes one tensor (or list) per call, got {len(tensors)}")
    return tensors[0]


def _recorded(tensors: Sequence[torch.Tensor]) -> Callable[[], None]:
    """Mark, in the calling thread, where the work its CUDA streams have queued so far ends (the
    kernels that write `tensors`); the function returned waits for that point, from any thread.
    Nothing to wait for on CPU tensors."""
    devices = {t.device for t in tensors if t.device.type == "cuda"}
    if not devices:
        return _nothing
    events = []
    for device in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)

    def wait() -> None:
        for event in events:
            event.synchronize()

    return wait


def _nothing() -> None:
    return None


def _on_gpu(tensor: torch.Tensor) -> bool:
    """A tensor whose bytes can go through a GPU buffer as they are: on a CUDA device, contiguous,
    not empty."""
    return tensor.device.type == "cuda" and tensor.is_contiguous() and tensor.numel() > 0


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s values in contiguous host memory (the tensor itself where it already is)."""
    if tensor.device.type == "cpu":
        return tensor.contiguous()
    return tensor.to("cpu", memory_format=torch.contiguous_format)


class _Staged:
    """A contiguous host stand-in for a tensor (the tensor itself where it is one), copied back on
    exit when it had to be made and the operation succeeded. It starts with the tensor's values, or,
    for a pure output (`copy_in=False`), uninitialised: the proxy's result fills all of it."""

    def __init__(self, tensor: torch.Tensor, copy_in: bool = True):
        self.tensor = tensor
        if tensor.device.type == "cpu" and tensor.is_contiguous():
            self.work = tensor
        elif copy_in:
            self.work = _host(tensor)
        else:
            self.work = torch.empty(tensor.shape, dtype=tensor.dtype)

    def __enter__(self) -> torch.Tensor:
        return self.work

    def __exit__(self, *exc) -> None:
        if self.work is not self.tensor and exc[0] is None:
            self.tensor.copy_(self.work)  # not non_blocking: done on the device when it returns


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """Where a host tensor's bytes are (the proxy client copies them by address)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ProxyError(f"internal error: a {tensor.device} tensor reached the proxy unstaged")
    return tensor.data_ptr(), tensor.numel() * tensor.element_size()


def _split_counts(tensor: torch.Tensor, splits: Sequence[int], size: int, which: str) -> list[int]:
    """Elements per rank of an all_to_all_single side, from its split sizes (rows of dim 0)."""
    if tensor.dim() == 0:
        raise ProxyError(f"all_to_all_single: the {which} tensor needs a first dimension to split")
    rows, per_row = tensor.shape[0], math.prod(tensor.shape[1:])
    splits = [int(s) for s in splits]
    if not splits:
        if rows % size:
            raise ProxyError(f"all_to_all_single: the {which} tensor's {rows} rows do not split evenly "
                             f"among {size} ranks; pass {which}_split_sizes")
        splits = [rows // size] * size
    if len(splits) != size or sum(splits) != rows or min(splits) < 0:
        raise ProxyError(f"all_to_all_single: {which}_split_sizes {splits} must be {size} sizes that add "
                         f"up to the {which} tensor's {rows} rows")
    return [s * per_row for s in splits]


class SingularityProcessGroup(dist.ProcessGroup):
    def __init__(self, comm: str, rank: int, size: int, global_ranks: Sequence[int]):
        super().__init__(rank, size)
        self.comm = comm
        self.global_ranks = list(global_ranks)
        self.client = client()
        _QUEUE.run(lambda: self.client.register_comm(comm, self.global_ranks))
        self.p2p: dict[tuple[str, int], int] = {}

    def getBackendName(self) -> str:
        return BACKEND

    def _run(self, op: str, tensor: torch.Tensor, out: torch.Tensor | None = None, **meta) -> None:
        """`op` on the queue's thread, after everything issued before it: `tensor` in, the result
        into `out` (`tensor` itself by default), each staged there, where the earlier operations
        have written them."""
        message = {"op": op, "comm": self.comm, "dtype": _dtype(tensor), "count": tensor.numel(), **meta}
        ready = _recorded([tensor] if out is None else [tensor, out])

        def action() -> None:
            ready()
            with _Staged(tensor) as src:
                if out is None:
                    self._call(message, [src], [src])
                    return
                with _Staged(out, copy_in=False) as dst:
                    self._call(message, [src], [dst])

        _QUEUE.run(action)

    def _call(self, message: dict, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
        """One request from the queue's thread: `inputs` back to back in, `outputs` back to back out."""
        ins = [_span(t) for t in inputs if t.numel()]
        outs = [_span(t) for t in outputs if t.numel()]
        self.client.call(message, ins, outs, max(sum(n for _, n in ins), sum(n for _, n in outs)))

    def _root(self, opts, what: str) -> int:
        root = int(getattr(opts, "rootRank", 0)) if opts is not None else 0
        if not 0 <= root < self.size():
            raise ProxyError(f"{what}: root {root} is not a rank of this group of {self.size()}")
        return root

    def _same_shape(self, tensors: Sequence[torch.Tensor], like: torch.Tensor, what: str) -> None:
        if len(tensors) != self.size():
            raise ProxyError(f"{what}: the root's list holds {len(tensors)} tensors for {self.size()} ranks")
        for i, t in enumerate(tensors):
            if t.numel() != like.numel() or t.dtype != like.dtype:
                raise ProxyError(f"{what}: tensor {i} of the root's list is {t.dtype} of {t.numel()} "
                                 f"elements; this rank's is {like.dtype} of {like.numel()}")

    # --- collectives ------------------------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        reduce = _reduce_name(opts)
        for tensor in tensors:
            _dtype(tensor)  # refuse what the proxy cannot take here, not in the queue's thread
        ready = _recorded(tensors)

        def reduce_all():
            ready()
            for tensor in tensors:
                message = {"op": "allreduce", "comm": self.comm, "dtype": _dtype(tensor),
                           "count": tensor.numel(), "reduce": reduce}
                if _on_gpu(tensor) and self.client.call_gpu(message, tensor.data_ptr(),
                                                             tensor.numel() * tensor.element_size(),
                                                             tensor.device.index):
                    continue
                with _Staged(tensor) as work:
                    self._call(message, [work], [work])
            return tensors

        return _QUEUE.start(reduce_all, self.client.sliced, _cuda(tensors))

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def reduce(self, tensors, opts=None):
        tensor = _one(tensors, "reduce")
        message = {"op": "reduce", "comm": self.comm, "dtype": _dtype(tensor), "count": tensor.numel(),
                   "reduce": _reduce_name(opts), "root": self._root(opts, "reduce")}
        is_root = self.rank() == message["root"]
        ready = _recorded([tensor])

        def run():
            ready()
            with _Staged(tensor) as work:
                self._call(message, [work], [work] if is_root else [])
            return tensors

        return _QUEUE.start(run, self.client.sliced, _cuda(tensors))

    def broadcast(self, tensors, opts=None):
        root = getattr(opts, "rootRank", 0) if opts is not None else 0
        for tensor in tensors:
            self._run("broadcast", tensor, root=root)
        return _done(tensors, _cuda(tensors))

    def _gather_into(self, out: torch.Tensor, tensor: torch.Tensor) -> None:
        self._run("allgather", tensor, out=out)

    def allgather(self, output_lists, inputs, opts=None):
        for outputs, tensor in _pairs(output_lists, inputs, "allgather"):
            flat = torch.empty((self.size(), *tensor.shape), dtype=tensor.dtype)
            self._gather_into(flat, tensor)
            for i, out in enumerate(outputs):
                out.copy_(flat[i])
        return _done(output_lists, _cuda([t for outputs in output_lists for t in outputs]))

    def _allgather_base(self, output, tensor, opts=None):
        self._gather_into(output, tensor)
        return _done([output], _cuda([output]))

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        for output, tensor in _pairs(outputs, inputs, "allgather_into_tensor_coalesced"):
            self._gather_into(output, tensor)
        return _done(outputs, _cuda(outputs))

    def gather(self, output_tensors, input_tensors, opts=None):
        tensor = _one(input_tensors, "gather")
        message = {"op": "gather", "comm": self.comm, "dtype": _dtype(tensor), "count": tensor.numel(),
                   "root": self._root(opts, "gather")}
        outputs = _one(output_tensors, "gather") if self.rank() == message["root"] else None
        if outputs is not None:
            self._same_shape(outputs, tensor, "gather")
        ready = _recorded([tensor, *(outputs or ())])

        def run():
            ready()
            flat = torch.empty((self.size(), tensor.numel()), dtype=tensor.dtype) if outputs else None
            self._call(message, [_host(tensor)], [flat] if flat is not None else [])
            for i, out in enumerate(outputs or ()):
                out.copy_(flat[i].view(out.shape))
            return output_tensors

        return _QUEUE.start(run, self.client.sliced, _cuda(outputs or []))

    def scatter(self, output_tensors, input_tensors, opts=None):
        out = _one(output_tensors, "scatter")
        message = {"op": "scatter", "comm": self.comm, "dtype": _dtype(out), "count": out.numel(),
                   "root": self._root(opts, "scatter")}
        inputs = _one(input_tensors, "scatter") if self.rank() == message["root"] else None
        if inputs is not None:
            self._same_shape(inputs, out, "scatter")
        ready = _recorded([*(inputs or ()), out])

        def run():
            ready()
            flat = [_host(torch.cat([t.reshape(-1) for t in inputs]))] if inputs else []
            with _Staged(out, copy_in=False) as dst:
                self._call(message, flat, [dst])
            return output_tensors

        return _QUEUE.start(run, self.client.sliced, _cuda([out]))

    def reduce_scatter(self, outputs, input_lists, opts=None):
        reduce, pairs = _reduce_name(opts), _pairs(outputs, input_lists, "reduce_scatter")
        for out, _ in pairs:
            _dtype(out)
        ready = _recorded([*outputs, *(t for inputs in input_lists for t in inputs)])

        def run() -> None:
            ready()
            for out, inputs in pairs:  # concatenated here: after the operations issued before
                flat = _host(torch.cat([t.reshape(-1) for t in inputs]))
                message = {"op": "reduce_scatter", "comm": self.comm, "dtype": _dtype(flat),
                           "count": flat.numel(), "reduce": reduce}
                with _Staged(out, copy_in=False) as dst:
                    self._call(message, [flat], [dst])

        _QUEUE.run(run)
        return _done(outputs, _cuda(outputs))

    def _reduce_scatter_base(self, output, tensor, opts=None):
        self._run("reduce_scatter", tensor, out=output, reduce=_reduce_name(opts))
        return _done([output], _cuda([output]))

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        for output, tensor in _pairs(outputs, inputs, "reduce_scatter_tensor_coalesced"):
            self._reduce_scatter_base(output, tensor, opts)
        return _done(outputs, _cuda(outputs))

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        if output.dtype != input.dtype:
            raise ProxyError(f"all_to_all_single: output is {output.dtype}, input is {input.dtype}")
        message = {"op": "alltoall", "comm": self.comm, "dtype": _dtype(input),
                   "send": _split_counts(input, input_split_sizes, self.size(), "input"),
                   "recv": _split_counts(output, output_split_sizes, self.size(), "output")}
        ready = _recorded([input, output])

        def run():
            ready()
            with _Staged(output, copy_in=False) as dst:
                self._call(message, [_host(input)], [dst])
            return [output]

        return _QUEUE.start(run, self.client.sliced, _cuda([output]))

    def alltoall(self, output_tensors, input_tensors, opts=None):
        if len(output_tensors) != self.size() or len(input_tensors) != self.size():
            raise ProxyError(f"all_to_all: {len(output_tensors)} outputs and {len(input_tensors)} inputs "
                             f"for a group of {self.size()} ranks")
        dtype = _dtype(input_tensors[0])
        for t in (*output_tensors, *input_tensors):
            if t.dtype != input_tensors[0].dtype:
                raise ProxyError(f"all_to_all: mixed dtypes {t.dtype} and {input_tensors[0].dtype}")
        message = {"op": "alltoall", "comm": self.comm, "dtype": dtype,
                   "send": [t.numel() for t in input_tensors], "recv": [t.numel() for t in output_tensors]}
        ready = _recorded([*input_tensors, *output_tensors])

        def run():
            ready()
            flat_in = _host(torch.cat([t.reshape(-1) for t in input_tensors]))
            flat_out = torch.empty(sum(message["recv"]), dtype=flat_in.dtype)
            self._call(message, [flat_in], [flat_out])
            offset = 0
            for out in output_tensors:
                out.copy_(flat_out[offset:offset + out.numel()].view(out.shape))
                offset += out.numel()
            return output_tensors

        return _QUEUE.start(run, self.client.sliced, _cuda(output_tensors))

    # torch 2.13 reaches the single-tensor forms through these names.
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single = _reduce_scatter_base
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    all_to_all_single = alltoall_base

    def barrier(self, opts=None):
        _QUEUE.run(lambda: self.client.call({"op": "barrier", "comm": self.comm}, [], [], 0))
        return _done([])

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """A barrier: the proxy's has no timeout (a rank parked at a checkpoint is late, not lost; a
        rank that died ends the job through the node agent)."""
        self.barrier()

    # --- point to point ---------------------------------------------------------------------------

    def send(self, tensors, dstRank, tag=0):
        messages = [{"op": "send", "comm": self.comm, "dtype": _dtype(t), "count": t.numel(), "peer": dstRank}
                    for t in tensors]
        ready = _recorded(tensors)

        def run() -> None:
            ready()
            for message, tensor in zip(messages, tensors):
                self._call(message, [_host(tensor)], [])  # nothing comes back into a sent tensor

        _QUEUE.run(run)
        return _done(tensors, _cuda(tensors))

    def recv(self, tensors, srcRank, tag=0):
        messages = [{"op": "recv", "comm": self.comm, "dtype": _dtype(t), "count": t.numel(), "peer": srcRank}
                    for t in tensors]
        ready = _recorded(tensors)

        def run() -> None:
            ready()
            for message, tensor in zip(messages, tensors):
                with _Staged(tensor, copy_in=False) as work:
                    self._call(message, [], [work])

        _QUEUE.run(run)
        return _done(tensors, _cuda(tensors))

    def _unsupported(self, name, why=""):
        raise ProxyError(f"{name} is not supported by the singularity backend{why} (supported: "
                         f"{', '.join(SUPPORTED)})")

    def recv_anysource(self, *args, **kwargs):
        self._unsupported("recv from any source", ": receive from a named source rank instead")

    def allgather_coalesced(self, *args, **kwargs):
        self._unsupported("all_gather_coalesced", ": call all_gather for each tensor")


def _create(backend_opts, pg_opts=None) -> SingularityProcessGroup:
    ranks = list(getattr(backend_opts, "global_ranks_in_group", []) or [])
    rank, size = backend_opts.group_rank, backend_opts.group_size
    if not ranks:
        ranks = list(range(size))
    return SingularityProcessGroup(str(backend_opts.group_id), rank, size, ranks)


def _replace_backend(function, defaults: dict):
    signature = inspect.signature(function)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs)
        for name, value in defaults.items():
            if name in signature.parameters:
                bound.arguments[name] = value() if callable(value) else value
        return function(*bound.args, **bound.kwargs)

    wrapper.__singularity__ = True  # type: ignore[attr-defined]
    return wrapper


def _monitored(original):
    """torch lets only gloo run monitored_barrier; on this backend it is the proxy's barrier."""

    @functools.wraps(original)
    def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
        if dist.get_backend(group) != BACKEND:
            return original(group, timeout, wait_all_ranks)
        dist.barrier(group=group)
        return None

    monitored_barrier.__singularity__ = True  # type: ignore[attr-defined]
    return monitored_barrier


def install() -> None:
    """Register the backend and route process-group creation through it (idempotent)."""
    import torch.distributed.distributed_c10d as c10d

    if getattr(c10d.init_process_group, "__singularity__", False):
        return
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=list(DEVICES))
    env = os.environ
    world = {"backend": BACKEND, "init_method": None, "store": dist.HashStore,
             "rank": int(env.get("RANK", "0")), "world_size": int(env.get("WORLD_SIZE", "1")),
             "timeout": datetime.timedelta(days=7)}
    init = _replace_backend(c10d.init_process_group, world)
    new_group = _replace_backend(c10d.new_group, {"backend": BACKEND})
    monitored_barrier = _monitored(c10d.monitored_barrier)
    for module in (c10d, dist):
        module.init_process_group = init
        module.new_group = new_group
        module.monitored_barrier = monitored_barrier
