"""The `singularity` torch.distributed backend: every collective goes through the device proxy.

`install()` (run from sitecustomize once the script has imported torch, if `compat` accepts that
torch) registers the backend and makes `init_process_group` and `new_group` use it whatever the script
asked for ("gloo", "nccl", env:// or tcp:// init), with a process-local store: the proxies find each
other through the coordinator, so workers open no TCP connection at all.

All of a rank's operations go through one FIFO thread per process, in the order the script issued
them, so every rank sends the same sequence to its proxy. Allreduce returns at once with a future (DDP
keeps computing its backward pass while a bucket is reduced); every other operation waits for its
turn and its result. At a checkpoint a rank is computing, or parked in a request, never holding a
half-done collective.

Runs in the job's own Python (3.9 or newer) with the job's torch: standard library and torch only.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

from . import BACKEND
from .proxy_client import ProxyClient, ProxyError

_DTYPES = {
    torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
    torch.int8: "int8", torch.int16: "int16", torch.int32: "int32", torch.int64: "int64",
    torch.uint8: "uint8", torch.bool: "bool",
}
_CLIENT: ProxyClient | None = None


def client() -> ProxyClient:
    global _CLIENT
    if _CLIENT is None:
        env = os.environ
        try:
            _CLIENT = ProxyClient(env["SINGULARITY_JOB_ID"], int(env["RANK"]), int(env["WORLD_SIZE"]))
        except (KeyError, ValueError) as exc:
            raise ProxyError("the singularity backend runs under `singularityctl run --world-size N` "
                             f"(SINGULARITY_JOB_ID, RANK and WORLD_SIZE must be set): {exc}") from exc
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

    def start(self, action: Callable[[], object]) -> dist.Work:
        """Run `action` after everything issued before it; a work object completes with its result."""
        future: Future = Future()

        def step():
            try:
                result = action()
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the work
                future.set_exception(exc)
            else:
                future.set_result(result)

        if threading.current_thread() is self.thread:
            step()
        else:
            self._ensure().submit(step)
        return _create_work_from_future(future)


_QUEUE = _Queue()


def _done(result) -> dist.Work:
    future: Future = Future()
    future.set_result(result)
    return _create_work_from_future(future)


def _reduce_name(opts) -> str:
    op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
    op = getattr(op, "op", op)
    return str(getattr(op, "name", op)).rsplit(".", 1)[-1].lower()


def _dtype(tensor: torch.Tensor) -> str:
    if tensor.device.type != "cpu":
        raise ProxyError(f"the singularity backend's host proxy takes CPU tensors, got {tensor.device}")
    try:
        return _DTYPES[tensor.dtype]
    except KeyError:
        raise ProxyError(f"dtype {tensor.dtype} is not supported by the singularity backend; supported: "
                         f"{', '.join(sorted(_DTYPES.values()))}") from None


def _pairs(left: Sequence, right: Sequence, what: str) -> list[tuple]:
    if len(left) != len(right):
        raise ProxyError(f"{what}: {len(left)} outputs for {len(right)} inputs")
    return list(zip(left, right))  # lengths checked above: zip(strict=) is Python 3.10


class _Contiguous:
    """A contiguous stand-in for a tensor, copied back on exit when it had to be made."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.work = tensor if tensor.is_contiguous() else tensor.contiguous()

    def __enter__(self) -> torch.Tensor:
        return self.work

    def __exit__(self, *exc) -> None:
        if self.work is not self.tensor and exc[0] is None:
            self.tensor.copy_(self.work)


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    return tensor.data_ptr(), tensor.numel() * tensor.element_size()


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
        nbytes = tensor.numel() * tensor.element_size()
        out = tensor if out is None else out
        out_bytes = out.numel() * out.element_size()
        message = {"op": op, "comm": self.comm, "dtype": _dtype(tensor), "count": tensor.numel(), **meta}
        _QUEUE.run(lambda: self.client.call(message, [_span(tensor)] if nbytes else [],
                                            [_span(out)] if out_bytes else [], max(nbytes, out_bytes)))

    # --- collectives ------------------------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        reduce = _reduce_name(opts)
        for tensor in tensors:
            _dtype(tensor)  # refuse what the proxy cannot take here, not in the queue's thread

        def reduce_all():
            for tensor in tensors:
                with _Contiguous(tensor) as work:
                    self._run("allreduce", work, reduce=reduce)
            return tensors

        return _QUEUE.start(reduce_all)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts=None):
        root = getattr(opts, "rootRank", 0) if opts is not None else 0
        for tensor in tensors:
            with _Contiguous(tensor) as work:
                self._run("broadcast", work, root=root)
        return _done(tensors)

    def _gather_into(self, out: torch.Tensor, tensor: torch.Tensor) -> None:
        with _Contiguous(tensor) as src, _Contiguous(out) as dst:
            self._run("allgather", src, out=dst)

    def allgather(self, output_lists, inputs, opts=None):
        for outputs, tensor in _pairs(output_lists, inputs, "allgather"):
            flat = torch.empty((self.size(), *tensor.shape), dtype=tensor.dtype)
            self._gather_into(flat, tensor)
            for i, out in enumerate(outputs):
                out.copy_(flat[i])
        return _done(output_lists)

    def _allgather_base(self, output, tensor, opts=None):
        self._gather_into(output, tensor)
        return _done([output])

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        for output, tensor in _pairs(outputs, inputs, "allgather_into_tensor_coalesced"):
            self._gather_into(output, tensor)
        return _done(outputs)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        for out, inputs in _pairs(outputs, input_lists, "reduce_scatter"):
            flat = torch.cat([t.reshape(-1) for t in inputs])
            with _Contiguous(out) as dst:
                self._run("reduce_scatter", flat, out=dst, reduce=_reduce_name(opts))
        return _done(outputs)

    def _reduce_scatter_base(self, output, tensor, opts=None):
        with _Contiguous(tensor) as src, _Contiguous(output) as dst:
            self._run("reduce_scatter", src, out=dst, reduce=_reduce_name(opts))
        return _done([output])

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        for output, tensor in _pairs(outputs, inputs, "reduce_scatter_tensor_coalesced"):
            self._reduce_scatter_base(output, tensor, opts)
        return _done(outputs)

    # torch 2.13 reaches the single-tensor forms through these names.
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single = _reduce_scatter_base
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def barrier(self, opts=None):
        _QUEUE.run(lambda: self.client.call({"op": "barrier", "comm": self.comm}, [], [], 0))
        return _done([])

    # --- point to point ---------------------------------------------------------------------------

    def send(self, tensors, dstRank, tag=0):
        for tensor in tensors:
            with _Contiguous(tensor) as work:
                self._run("send", work, peer=dstRank)
        return _done(tensors)

    def recv(self, tensors, srcRank, tag=0):
        for tensor in tensors:
            with _Contiguous(tensor) as work:
                message = {"op": "recv", "comm": self.comm, "dtype": _dtype(work), "count": work.numel(),
                           "peer": srcRank}
                span, nbytes = _span(work), work.numel() * work.element_size()
                _QUEUE.run(lambda m=message, sp=span, n=nbytes: self.client.call(m, [], [sp], n))
        return _done(tensors)

    def _unsupported(self, name):
        raise ProxyError(f"{name} is not supported by the singularity backend (supported: allreduce, "
                         "broadcast, allgather, reduce_scatter, barrier, send, recv)")

    def gather(self, *args, **kwargs):
        self._unsupported("gather")

    def scatter(self, *args, **kwargs):
        self._unsupported("scatter")

    def alltoall(self, *args, **kwargs):
        self._unsupported("alltoall")

    def alltoall_base(self, *args, **kwargs):
        self._unsupported("alltoall_base")

    def recv_anysource(self, *args, **kwargs):
        self._unsupported("recv_anysource")


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


def install() -> None:
    """Register the backend and route process-group creation through it (idempotent)."""
    import torch.distributed.distributed_c10d as c10d

    if getattr(c10d.init_process_group, "__singularity__", False):
        return
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
    env = os.environ
    world = {"backend": BACKEND, "init_method": None, "store": dist.HashStore,
             "rank": int(env.get("RANK", "0")), "world_size": int(env.get("WORLD_SIZE", "1")),
             "timeout": datetime.timedelta(days=7)}
    init = _replace_backend(c10d.init_process_group, world)
    new_group = _replace_backend(c10d.new_group, {"backend": BACKEND})
    for module in (c10d, dist):
        module.init_process_group = init
        module.new_group = new_group
