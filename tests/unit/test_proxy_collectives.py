"""Every collective an unmodified script may call, through real proxies and real workers.

All-to-all (async, uneven splits), gather, scatter, reduce, the object collectives (which torch runs
as all-gathers, broadcasts, gathers and scatters of bytes), monitored_barrier, bfloat16 and float16,
with 2 and 4 ranks on every kind of placement. Reductions are in rank order, so their bits are the
same on every placement; a checkpoint's cut in the middle of them stays consistent; a call the
backend cannot serve fails at once, on every rank, and the job goes on.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from proxyjob import HOOK, Job, make_user_venv

WORKER = r'''
import datetime, json, sys, time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

mode, out = sys.argv[1], Path(sys.argv[2])
dist.init_process_group("gloo", init_method="env://")
rank, world = dist.get_rank(), dist.get_world_size()
result = {}


def rows(g, j):
    """Rows of 2 columns rank g sends rank j in all_to_all_single: uneven, some none."""
    return (g + 2 * j) % 3


def ragged(seed, n=257):
    """float32 over six orders of magnitude: another order of additions shows in the bits."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen) * 10.0 ** (torch.rand(n, generator=gen) * 6 - 3)


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).tolist()


def all_to_all_single_async(step=0):
    send = [rows(rank, j) for j in range(world)]
    recv = [rows(g, rank) for g in range(world)]
    inp = torch.tensor([[1000.0 * rank + 100 * j + k + step, -k] for j, n in enumerate(send)
                        for k in range(n)]).reshape(-1, 2)
    got = torch.full((sum(recv), 2), -1.0)
    work = dist.all_to_all_single(got, inp, recv, send, async_op=True)
    busy = torch.ones(64, 64) @ torch.ones(64, 64)  # the script computes while the exchange runs
    work.wait()
    return got.tolist()


def all_to_all_single_even():
    got = torch.empty(2 * world, dtype=torch.int64)
    dist.all_to_all_single(got, torch.arange(2 * world) + 100 * rank)
    return got.tolist()


def all_to_all_lists():
    got = [torch.empty(rank + 1, dtype=torch.int32) for _ in range(world)]
    dist.all_to_all(got, [torch.full((j + 1,), 10 * rank + j, dtype=torch.int32) for j in range(world)])
    return [t.tolist() for t in got]


def gather(step=0):
    got = [torch.empty(2, dtype=torch.float64) for _ in range(world)] if rank == world - 1 else None
    dist.gather(torch.tensor([rank + step, rank * rank], dtype=torch.float64), got, dst=world - 1)
    return None if got is None else [t.tolist() for t in got]


def scatter(step=0):
    src = 1 % world
    parts = [torch.tensor([10.0 * j + step, 10.0 * j + 1]) for j in range(world)] if rank == src else None
    got = torch.empty(2)
    dist.scatter(got, parts, src=src)
    return got.tolist()


def reduce_sum():
    t = ragged(rank)
    dist.reduce(t, dst=0)
    return bits(t) if rank == 0 else None


def reduce_max_async():
    t = torch.tensor([float(rank), -float(rank)])
    work = dist.reduce(t, dst=world - 1, op=ReduceOp.MAX, async_op=True)
    work.wait()
    return t.tolist() if rank == world - 1 else None


def all_reduce_async():
    tensors = [torch.full((3,), float(rank + i)) for i in range(3)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    for work in works:
        work.wait()
    return [t.tolist() for t in tensors]


def all_gather_object():
    got = [None] * world
    dist.all_gather_object(got, {"rank": rank, "pad": "x" * (5 * rank)})
    return got


def gather_object():
    got = [None] * world if rank == 0 else None
    dist.gather_object(("from", rank, [rank] * rank), got, dst=0)
    return got


def broadcast_object_list():
    objects = [world - 1, "root says hi", {"k": [1, 2]}] if rank == world - 1 else [None] * 3
    dist.broadcast_object_list(objects, src=world - 1)
    return objects


def scatter_object_list():
    got = [None]
    dist.scatter_object_list(got, [{"to": j, "data": list(range(j))} for j in range(world)]
                             if rank == 0 else None, src=0)
    return got[0]


def monitored_barrier():
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
    dist.monitored_barrier(wait_all_ranks=True)
    return True


def bfloat16_sum():
    t = ragged(100 + rank, 1001).to(torch.bfloat16)
    dist.all_reduce(t)
    return bits(t)


def bfloat16_avg_and_max():
    a, m = ragged(200 + rank, 65).to(torch.bfloat16), ragged(300 + rank, 65).to(torch.bfloat16)
    dist.all_reduce(a, op=ReduceOp.AVG)
    dist.all_reduce(m, op=ReduceOp.MAX)
    return [bits(a), bits(m)]


def float16_sum():
    t = (ragged(400 + rank, 1001) / 100).to(torch.float16)
    dist.all_reduce(t)
    return bits(t)


def bfloat16_moves():
    t = torch.arange(4, dtype=torch.bfloat16) + rank / 8
    dist.broadcast(t, src=world - 1)
    flat = torch.empty(3 * world, dtype=torch.bfloat16)
    dist.all_gather_into_tensor(flat, torch.tensor([rank, 0.5, -rank], dtype=torch.bfloat16))
    return [t.float().tolist(), flat.float().tolist()]


def in_a_subgroup():
    pair = dist.new_group([0, world - 1])
    if rank not in (0, world - 1):
        return None
    got = [torch.empty(1) for _ in range(2)] if rank == world - 1 else None
    dist.gather(torch.tensor([float(rank)]), got, dst=world - 1, group=pair)
    swapped = torch.empty(2)
    dist.all_to_all_single(swapped, torch.tensor([rank + 0.5, rank + 0.75]), group=pair)
    return [None if got is None else [t.item() for t in got], swapped.tolist()]


def refused(call):
    started = time.monotonic()
    try:
        call()
    except Exception as exc:
        return [f"{type(exc).__name__}: {exc}", time.monotonic() - started]
    return ["no error", time.monotonic() - started]


if mode == "all":
    for operation in (all_to_all_single_async, all_to_all_single_even, all_to_all_lists, gather, scatter,
                      reduce_sum, reduce_max_async, all_reduce_async, all_gather_object, gather_object,
                      broadcast_object_list, scatter_object_list, monitored_barrier, bfloat16_sum,
                      bfloat16_avg_and_max, float16_sum, bfloat16_moves, in_a_subgroup):
        result[operation.__name__] = operation()
    # The project's own packages stay out of a worker (torch's object collectives import numpy).
    result["modules"] = sorted(m for m in sys.modules if m.split(".")[0] in (
        "singularity_slurm", "redis", "click", "xxhash"))
    result["prefix"] = sys.prefix
elif mode == "refused":
    result["recv_any"] = refused(lambda: dist.recv(torch.empty(1)))
    result["dtype"] = refused(lambda: dist.all_to_all_single(torch.empty(world, dtype=torch.uint32),
                                                             torch.zeros(world, dtype=torch.uint32)))
    result["reduce_op"] = refused(lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32), op=ReduceOp.BAND))
    result["splits"] = refused(lambda: dist.all_to_all_single(torch.empty(3), torch.zeros(3)))
    t = torch.ones(1)
    dist.all_reduce(t)
    result["after"] = t.item()
elif mode == "mismatch":
    # Rank 0 sends rank 1 two elements, rank 1 expects one: found by the proxy, after the call returned.
    got = torch.full((2,), -1.0)
    work = dist.all_to_all_single(got, torch.tensor([0.5, 1.5, 2.5][:3 - rank]), [1, 1],
                                  [1, 2] if rank == 0 else [1, 1], async_op=True)
    result["async"] = refused(work.wait)[0]
    result["disagree"] = refused(lambda: dist.all_reduce(torch.ones(2 + rank)))[0]
    t = torch.ones(1)
    dist.all_reduce(t)
    result["after"] = t.item()
elif mode == "loop":
    step, bad = 0, []
    while True:
        want = [[1000.0 * g + 100 * rank + k + step, -k] for g in range(world) for k in range(rows(g, rank))]
        if all_to_all_single_async(step) != want:
            bad.append([step, "all_to_all_single"])
        if gather(step) not in (None, [[g + step, g * g] for g in range(world)]):
            bad.append([step, "gather"])
        if scatter(step) != [10.0 * rank + step, 10.0 * rank + 1]:
            bad.append([step, "scatter"])
        if all_gather_object() != [{"rank": g, "pad": "x" * (5 * g)} for g in range(world)]:
            bad.append([step, "all_gather_object"])
        stop = torch.tensor([1.0 if (out / "stop").exists() else 0.0])
        dist.all_reduce(stop, op=ReduceOp.MAX)
        step += 1
        if step == 1:
            (out / f"looping-{rank}").touch()
        if stop.item():
            break
    result.update(steps=step, bad=bad)

import _singularity_worker.torch_backend as backend

result["parks"] = backend.client().parks
(out / f"result-{rank}.json").write_text(json.dumps(result))
'''

PLACEMENTS = {
    "2 ranks, 1 proxy": ("p0", "p0"),
    "2 ranks, 2 proxies": ("p0", "p1"),
    "4 ranks, 1 x 4": ("p0",) * 4,
    "4 ranks, 2 x 2": ("p0", "p0", "p1", "p1"),
    "4 ranks, 4 x 1": ("p0", "p1", "p2", "p3"),
}


def run_job(folder: Path, placement: tuple[str, ...], mode: str,
            python: str | None = None) -> dict[int, dict]:
    run = Job(folder, dict(enumerate(placement)))
    try:
        run.start(WORKER, mode, **({"python": python} if python else {}))
        return run.results(timeout=120)
    finally:
        run.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[int, dict]]:
    """The `all` mode's results on a placement, run once per module."""
    done: dict[str, dict[int, dict]] = {}

    def results(name: str) -> dict[int, dict]:
        if name not in done:
            done[name] = run_job(tmp_path_factory.mktemp("all"), PLACEMENTS[name], "all")
        return done[name]

    return results


@pytest.fixture(params=PLACEMENTS.keys())
def every_op(request: pytest.FixtureRequest, runs: Callable[[str], dict[int, dict]]) -> dict[int, dict]:
    return runs(request.param)


# --- what a script gets ----------------------------------------------------------------------------


def rows(g: int, j: int) -> int:
    return (g + 2 * j) % 3


def ragged(seed: int, n: int = 257) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen) * 10.0 ** (torch.rand(n, generator=gen) * 6 - 3)


def in_rank_order(tensors: list[torch.Tensor], op=torch.add) -> torch.Tensor:
    acc = tensors[0].clone()
    for t in tensors[1:]:
        acc = op(acc, t)
    return acc


def bits(t: torch.Tensor) -> list[int]:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).tolist()


def expected(rank: int, world: int) -> dict:
    """What every operation of the `all` mode gives `rank` of `world`, computed here in rank order."""
    last = world - 1
    bf16 = [ragged(100 + g, 1001).to(torch.bfloat16).float() for g in range(world)]
    avg = [ragged(200 + g, 65).to(torch.bfloat16).float() for g in range(world)]
    top = [ragged(300 + g, 65).to(torch.bfloat16).float() for g in range(world)]
    return {
        "all_to_all_single_async": [[1000.0 * g + 100 * rank + k, -k] for g in range(world)
                                    for k in range(rows(g, rank))],
        "all_to_all_single_even": [100 * g + 2 * rank + i for g in range(world) for i in range(2)],
        "all_to_all_lists": [[10 * g + rank] * (rank + 1) for g in range(world)],
        "gather": [[g, g * g] for g in range(world)] if rank == last else None,
        "scatter": [10.0 * rank, 10.0 * rank + 1],
        "reduce_sum": bits(in_rank_order([ragged(g) for g in range(world)])) if rank == 0 else None,
        "reduce_max_async": [float(last), 0.0] if rank == last else None,
        "all_reduce_async": [[float(sum(g + i for g in range(world)))] * 3 for i in range(3)],
        "all_gather_object": [{"rank": g, "pad": "x" * (5 * g)} for g in range(world)],
        "gather_object": [["from", g, [g] * g] for g in range(world)] if rank == 0 else None,
        "broadcast_object_list": [last, "root says hi", {"k": [1, 2]}],
        "scatter_object_list": {"to": rank, "data": list(range(rank))},
        "monitored_barrier": True,
        "bfloat16_sum": bits(in_rank_order(bf16).to(torch.bfloat16)),
        "bfloat16_avg_and_max": [bits((in_rank_order(avg) / world).to(torch.bfloat16)),
                                 bits(in_rank_order(top, torch.maximum).to(torch.bfloat16))],
        "float16_sum": bits(in_rank_order([(ragged(400 + g, 1001) / 100).to(torch.float16)
                                           for g in range(world)])),
        "bfloat16_moves": [[float(i) + last / 8 for i in range(4)],
                           [v for g in range(world) for v in (float(g), 0.5, -float(g))]],
        "in_a_subgroup": None if rank not in (0, last) else [
            [0.0, float(last)] if rank == last else None,
            [0.5, last + 0.5] if rank == 0 else [0.75, last + 0.75]],
        "modules": [],
        "parks": 0,
    }


def test_every_collective_gives_each_rank_its_exact_result(every_op: dict[int, dict]) -> None:
    world = len(every_op)
    for rank, result in every_op.items():
        want = expected(rank, world)
        assert set(result) - {"prefix"} == set(want), f"rank {rank}"
        for name in want:
            assert result[name] == want[name], f"rank {rank}: {name}"


def test_reductions_are_bit_identical_on_every_placement_of_four_ranks(
        runs: Callable[[str], dict[int, dict]]) -> None:
    seen = {name: [(res["bfloat16_sum"], res["bfloat16_avg_and_max"], res["float16_sum"]) for res in
                   runs(name).values()] + [runs(name)[0]["reduce_sum"]]
            for name in ("4 ranks, 1 x 4", "4 ranks, 2 x 2", "4 ranks, 4 x 1")}

    assert len({repr(bits) for bits in seen.values()}) == 1


def test_the_data_is_such_that_another_order_or_rounding_changes_the_bits() -> None:
    f32 = [ragged(g) for g in range(4)]
    f16 = [(ragged(400 + g, 1001) / 100).to(torch.float16) for g in range(4)]
    bf16 = [ragged(100 + g, 1001).to(torch.bfloat16) for g in range(4)]

    assert bits(in_rank_order(f32)) != bits(in_rank_order(f32[::-1]))
    assert bits(in_rank_order(f16)) != bits(in_rank_order(f16[::-1]))
    # bfloat16 is rounded once, after a float32 sum: rounding after each addition gives other bits.
    assert bits(in_rank_order([t.float() for t in bf16]).to(torch.bfloat16)) != bits(in_rank_order(bf16))


# --- what cannot be served, and the cut ------------------------------------------------------------

SUPPORTED = ("allreduce, reduce, broadcast, allgather, gather, scatter, reduce_scatter, alltoall, barrier, "
             "monitored_barrier, send, recv")


@pytest.mark.parametrize("placement", [("p0", "p1"), ("p0", "p0", "p1", "p1")], ids=["2 ranks", "4 ranks"])
def test_a_call_the_backend_cannot_serve_fails_at_once_on_every_rank_and_the_job_goes_on(
        tmp_path: Path, placement: tuple[str, ...]) -> None:
    results = run_job(tmp_path, placement, "refused")

    world = len(placement)
    for rank, result in results.items():
        calls = {name: outcome for name, outcome in result.items() if name not in ("after", "parks")}
        assert {name: message for name, (message, _) in calls.items()} == {
            "recv_any": "ProxyError: recv from any source is not supported by the singularity backend: "
                        f"receive from a named source rank instead (supported: {SUPPORTED})",
            "dtype": "ProxyError: dtype torch.uint32 is not supported by the singularity backend; supported: "
                     "bfloat16, bool, float16, float32, float64, int16, int32, int64, int8, uint8",
            "reduce_op": "ProxyError: reduce op BAND is not supported by the singularity backend; supported: "
                         "SUM, AVG, PRODUCT, MIN, MAX",
            "splits": "ProxyError: all_to_all_single: the input tensor's 3 rows do not split evenly among "
                      f"{world} ranks; pass input_split_sizes",
        }, f"rank {rank}"
        assert max(seconds for _, seconds in calls.values()) < 1.0
        assert (result["after"], result["parks"]) == (float(world), 0)


def test_an_operation_the_proxy_refuses_after_the_call_raises_when_the_script_waits(tmp_path: Path) -> None:
    results = run_job(tmp_path, ("p0", "p0"), "mismatch")

    refusal = "ProxyError: device proxy: alltoall: rank 0 sends 2 elements to rank 1, which expects 1"
    disagree = re.compile(r"ProxyError: device proxy: allreduce: ranks disagree on collective \S+: .*")
    for rank, result in results.items():  # one proxy runs the whole exchange: both ranks learn it
        assert result["async"] == refusal, f"rank {rank}"
        assert disagree.fullmatch(result["disagree"]), result["disagree"]
        assert (result["after"], result["parks"]) == (2.0, 0)


def test_across_proxies_a_piece_of_another_size_fails_the_rank_that_receives_it(tmp_path: Path) -> None:
    results = run_job(tmp_path, ("p0", "p1"), "mismatch")

    assert results[0]["async"] == "no error"
    assert results[1]["async"] == (
        "ProxyError: device proxy: alltoall: rank 0 sends 2 elements to rank 1, which expects 1")
    # An allreduce whose ranks disagree on the count fails on both proxies (here, of one host, before
    # they reduce from each other's memory), and the job goes on.
    assert {r: res["disagree"] for r, res in results.items()} == {
        0: "ProxyError: device proxy: allreduce: ranks disagree on the element count or type (2 of float32 "
           "here): proxy p1's ranks have 3 of float32",
        1: "ProxyError: device proxy: allreduce: ranks disagree on the element count or type (3 of float32 "
           "here): proxy p0's ranks have 2 of float32"}
    assert {r: res["after"] for r, res in results.items()} == {0: 2.0, 1: 2.0}


def test_a_cut_among_the_new_collectives_is_consistent_and_the_job_goes_on(job) -> None:
    run = job({0: "p0", 1: "p0", 2: "p1", 3: "p1"})
    run.start(WORKER, "loop")
    run.wait_for_files("looping")

    answers = run.on_every_proxy(lambda p: p.quiesce(timeout=60))

    assert all(isinstance(a, dict) and a["idle"] is False for a in answers.values()), answers
    for proxy in run.proxies.values():  # every rank did exactly the cut's number of operations
        assert proxy.status()["phase"] == "parked"
        for rank in proxy.local_ranks:
            assert proxy.issued[rank] == proxy.targets, f"rank {rank}"
    assert run.on_every_proxy(lambda p: p.resume()) == {"p0": {"resumed": [0, 1]}, "p1": {"resumed": [2, 3]}}
    run.touch("stop")
    results = run.results()

    assert {r: (res["bad"], res["parks"]) for r, res in results.items()} == {r: ([], 1) for r in range(4)}
    assert len({res["steps"] for res in results.values()}) == 1


# --- in the job's own Python -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def foreign_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's venv: torch, numpy and torch's run-time requirements, nothing of the project's."""
    return make_user_venv(tmp_path_factory.mktemp("user") / "venv")


def test_the_users_python_has_torch_but_nothing_of_the_project(foreign_python: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": HOOK, "SINGULARITY_PROXY": "1"}
    probe = ("import importlib.util, sys, torch\n"
             "print(sys.prefix, torch.__version__, [m for m in ('singularity_slurm', 'redis', 'click') "
             "if importlib.util.find_spec(m)])\n"
             "import singularity_slurm\n")

    run = subprocess.run([str(foreign_python), "-c", probe], env=env, capture_output=True, text=True,
                         timeout=120)

    assert run.returncode == 1
    assert run.stdout == f"{foreign_python.parent.parent} {torch.__version__} []\n"
    assert run.stderr.endswith("ModuleNotFoundError: No module named 'singularity_slurm'\n")


def test_a_job_in_the_users_own_python_runs_every_collective_through_the_proxies(
        tmp_path: Path, foreign_python: Path) -> None:
    results = run_job(tmp_path, ("p0", "p1"), "all", python=str(foreign_python))

    for rank, result in results.items():
        assert result.pop("prefix") == str(foreign_python.parent.parent)
        assert result == expected(rank, 2), f"rank {rank}"


# --- the example ----------------------------------------------------------------------------------

EXAMPLE = Path(__file__).parents[2] / "examples" / "train_ddp_collectives.py"


def test_the_collectives_example_logs_the_same_bytes_on_every_placement(tmp_path: Path) -> None:
    logs: dict[str, list[bytes]] = {}
    for name, placement in (("1 x 4", ("p0",) * 4), ("4 x 1", ("p0", "p1", "p2", "p3"))):
        folder = tmp_path / name.replace(" ", "")
        folder.mkdir()
        run = Job(folder, dict(enumerate(placement)))
        try:
            run.start(EXAMPLE.read_text(), args=["--steps", "4", "--log-dir", str(folder / "logs")])
            for rank, proc in run.workers.items():
                assert proc.wait(timeout=120) == 0, run.log(rank)
        finally:
            run.close()
        logs[name] = [(folder / "logs" / f"{r}.log").read_bytes() for r in range(4)]

    assert logs["1 x 4"] == logs["4 x 1"]
    assert [len(log.splitlines()) for log in logs["1 x 4"]] == [4] * 4
    assert len(set(logs["1 x 4"])) == 4  # each rank logs its own loss
