"""The GPU side of a checkpoint that needs no GPU: which processes hold GPU state, the driver calls
that bring them to a state (pure plans), how a restore maps GPUs, and the mounts criu records by path.
The calls themselves run on a GPU machine (tests/gpu/run.sh)."""

from __future__ import annotations

import sys

import pytest

from singularity_slurm.checkpoint import cuda
from singularity_slurm.checkpoint.criu import dump_externals, external_mounts, restore_externals
from singularity_slurm.errors import CheckpointError
from singularity_slurm.node import gpus
from singularity_slurm.node.agent import gpu_indices
from singularity_slurm.node.gpus import Gpu, GpuMismatch, restore_pairs

# /proc/PID/maps of a CUDA process (abridged): device mappings, and libraries that only look alike
CUDA_MAPS = """\
200000000-200200000 ---p 00000000 00:00 0
200600000-200800000 rw-s 00000000 00:06 1046                       /dev/nvidia0
7f1c00000000-7f1c00200000 rw-s 00000000 00:06 1045                 /dev/nvidiactl
7f1c10000000-7f1c10400000 r-xp 00000000 fe:10 311        /usr/local/nvidia/lib64/libnvidia-ptxjit.so.580
7f1c20000000-7f1c20001000 rw-s 00000000 00:06 1047                 /dev/nvidia-uvm
"""
CHECKPOINTED_MAPS = """\
7f1c10000000-7f1c10400000 r-xp 00000000 fe:10 311        /usr/local/nvidia/lib64/libnvidia-ptxjit.so.580
7f1c30000000-7f1c30021000 rw-p 00000000 00:00 0                    [heap]
7f1c40000000-7f1c40001000 rw-p 00000000 00:00 0                    /tmp/a file named /dev/nvidia0
"""


def test_a_process_holds_gpu_state_while_it_maps_a_device_file() -> None:
    assert cuda.holds_device(CUDA_MAPS)
    # after the driver's checkpoint only libraries remain; a path that merely contains the name
    # (spaces are part of the path field) does not count
    assert not cuda.holds_device(CHECKPOINTED_MAPS)
    assert not cuda.holds_device("")


def test_a_process_may_hold_cuda_state_while_it_maps_the_driver_library() -> None:
    libcuda = "7f1c50000000-7f1c50100000 r-xp 00000000 fe:10 312  /usr/lib/x86_64-linux-gnu/libcuda.so.580\n"
    assert cuda.loads_cuda(CHECKPOINTED_MAPS + libcuda)
    assert not cuda.loads_cuda(CHECKPOINTED_MAPS)  # libnvidia-ptxjit is not the driver
    assert not cuda.loads_cuda("7f1c50000000-7f1c50100000 r-xp 00000000 fe:10 312  /tmp/not-libcuda.so\n")


def test_namespace_pid_is_the_innermost_one() -> None:
    assert cuda.namespace_pid("Name:\tpython\nNSpid:\t975\t1\n") == 1
    assert cuda.namespace_pid("NSpid:\t4242\n") == 4242
    assert cuda.namespace_pid("Name:\tx\n") is None


def test_device_indices_name_gpus_only() -> None:
    targets = ["/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia0", "/dev/nvidia1",
               "/dev/null", "socket:[123]", "/dev/nvidia-caps/nvidia-cap1"]
    assert cuda.device_indices(targets) == [0, 1]


def test_to_checkpointed_locks_every_process_before_saving_any() -> None:
    plan = cuda.to_checkpointed({10: cuda.RUNNING, 11: cuda.RUNNING, 12: cuda.LOCKED, 13: cuda.CHECKPOINTED})
    assert [(c.action, c.pid) for c in plan] == [
        ("lock", 10), ("lock", 11), ("checkpoint", 10), ("checkpoint", 11), ("checkpoint", 12)]


def test_to_running_restores_then_unlocks() -> None:
    plan = cuda.to_running({10: cuda.CHECKPOINTED, 11: cuda.LOCKED, 12: cuda.RUNNING})
    assert [(c.action, c.pid) for c in plan] == [("restore", 10), ("unlock", 10), ("unlock", 11)]


def test_a_failed_state_is_refused_with_its_pids() -> None:
    with pytest.raises(cuda.CudaCheckpointFailed, match="process\\(es\\) 7, 9 as failed"):
        cuda.to_running({9: cuda.FAILED, 8: cuda.RUNNING, 7: cuda.FAILED})
    with pytest.raises(cuda.CudaCheckpointFailed):
        cuda.to_checkpointed({7: cuda.FAILED})


class ScriptedDriver:
    """Plays the driver's state machine for the sequencing tests (pure logic: no GPU, no process)."""

    def __init__(self, states: dict[int, str], refuse: tuple[str, int] | None = None):
        self.now = dict(states)
        self.refuse = refuse
        self.calls: list[tuple[str, int, tuple]] = []

    def states(self, pids):
        return {pid: self.now[pid] for pid in pids}

    def state(self, pid):
        if pid not in self.now:  # as the driver answers for a process without a CUDA context
            raise cuda.CudaCheckpointFailed(f"cuCheckpointProcessGetState({pid}) failed: "
                                            "CUDA_ERROR_NOT_FOUND")
        return self.now[pid]

    def call(self, call, pairs=()):
        self.calls.append((call.action, call.pid, tuple(pairs)))
        if (call.action, call.pid) == self.refuse:
            name = call.action.capitalize()
            raise cuda.CudaCheckpointFailed(f"cuCheckpointProcess{name}({call.pid}) failed")
        after = {"lock": cuda.LOCKED, "checkpoint": cuda.CHECKPOINTED, "restore": cuda.LOCKED,
                 "unlock": cuda.RUNNING}
        self.now[call.pid] = after[call.action]


def test_suspend_then_resume_round_trip() -> None:
    driver = ScriptedDriver({1: cuda.RUNNING, 2: cuda.RUNNING})
    cuda.suspend(driver, [1, 2])
    assert driver.now == {1: cuda.CHECKPOINTED, 2: cuda.CHECKPOINTED}
    pair = cuda.GpuPair("GPU-00000000-0000-0000-0000-000000000001",
                        "GPU-00000000-0000-0000-0000-000000000002")
    assert cuda.resume(driver, [1, 2], [pair]) == 2
    assert driver.now == {1: cuda.RUNNING, 2: cuda.RUNNING}
    assert ("restore", 1, (pair,)) in driver.calls


def test_a_refused_checkpoint_puts_every_process_back_to_running() -> None:
    driver = ScriptedDriver({1: cuda.RUNNING, 2: cuda.RUNNING}, refuse=("checkpoint", 2))
    with pytest.raises(cuda.CudaCheckpointFailed, match="Checkpoint\\(2\\)"):
        cuda.suspend(driver, [1, 2])
    assert driver.now == {1: cuda.RUNNING, 2: cuda.RUNNING}


def test_driver_without_bindings_names_the_fix(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "cuda", None)  # `from cuda.bindings import driver` fails
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    with pytest.raises(cuda.CudaUnavailable, match="singularity-slurm\\[gpu\\]"):
        cuda.Driver()


def test_uuid_bytes() -> None:
    assert cuda.uuid_bytes("GPU-a5c3924d-63ed-c3f1-7577-7955e543ac4d") == bytes.fromhex(
        "a5c3924d63edc3f175777955e543ac4d")
    with pytest.raises(ValueError, match="not a GPU UUID"):
        cuda.uuid_bytes("GPU-1234")


H200 = "NVIDIA H200"


def gpu(index: int, uuid_tail: int, name: str = H200, problems: tuple[str, ...] = ()) -> Gpu:
    return Gpu(index, f"GPU-00000000-0000-0000-0000-{uuid_tail:012d}", name, 143771, problems)


def test_restore_on_the_same_gpus_needs_no_pairs() -> None:
    assert restore_pairs([gpu(0, 1), gpu(1, 2)], [gpu(1, 2), gpu(0, 1)]) == []


def test_restore_on_other_gpus_maps_them_in_index_order() -> None:
    pairs = restore_pairs([gpu(1, 2), gpu(0, 1)], [gpu(2, 7), gpu(3, 8)])
    assert [(p.old_uuid[-1], p.new_uuid[-1]) for p in pairs] == [("1", "7"), ("2", "8")]


def test_restore_refuses_another_type_fewer_gpus_and_sick_ones() -> None:
    with pytest.raises(GpuMismatch, match="ran on NVIDIA H200 and this job's GPU 0 is NVIDIA A100") as info:
        restore_pairs([gpu(0, 1)], [gpu(0, 5, "NVIDIA A100")])
    assert info.value.elsewhere  # another node's GPUs may fit
    fewer = "state of 2 GPU\\(s\\) but the job has 1.*--gpus-per-node=2"
    with pytest.raises(GpuMismatch, match=fewer) as info:
        restore_pairs([gpu(0, 1), gpu(1, 2)], [gpu(0, 1)])
    assert not info.value.elsewhere  # every node of the allocation has as few
    with pytest.raises(GpuMismatch, match="GPU 3 .* unhealthy: a row remapping failed") as info:
        restore_pairs([gpu(0, 1)], [gpu(3, 4, problems=gpus.health_problems(0, False, True))])
    assert info.value.elsewhere


def engine_restoring(tmp_path, monkeypatch, on_mismatch: str, here: list[Gpu]):
    """An engine of node n1 whose GPUs NVML reports as `here`, with a driver that needs no GPU."""
    from singularity_slurm.checkpoint.store import CheckpointStore
    from singularity_slurm.config import parse
    from singularity_slurm.node.engine import CheckpointEngine

    config = parse({"gpu": {"on_mismatch": on_mismatch}})
    engine = CheckpointEngine(config, "n1", tmp_path, CheckpointStore(tmp_path / "store"), None, None)
    engine.gpus = [g.index for g in here]
    monkeypatch.setattr(cuda, "Driver", lambda lock_timeout_ms: "driver")
    monkeypatch.setattr(gpus, "inventory", lambda indices: [g for g in here if g.index in indices])
    return engine


def gpu_manifest(ran_on: list[Gpu]):
    from types import SimpleNamespace

    return SimpleNamespace(seq=7, meta={"cuda": {"gpus": [g.record() for g in ran_on]}})


@pytest.mark.parametrize(("here", "waits"), [
    ([gpu(0, 5, "NVIDIA A100")], True),  # another type: nodes with H200s can take it
    ([gpu(0, 1, problems=("a row remapping failed (the GPU needs service)",))], True),  # a sick GPU
    ([], False),  # too few GPUs: the same on every node of the allocation
])
def test_a_checkpoint_the_nodes_gpus_cannot_take_waits_for_other_nodes_or_is_refused(
        tmp_path, monkeypatch, here: list[Gpu], waits: bool) -> None:
    from singularity_slurm import rpc
    from singularity_slurm.checkpoint.criu import RestoreFailed

    engine = engine_restoring(tmp_path, monkeypatch, "wait", here)
    with pytest.raises(rpc.WrongDevices if waits else RestoreFailed) as info:
        engine._gpu_plan(gpu_manifest([gpu(0, 1)]))
    if waits:
        assert info.value.kind == "wrong_devices"
        assert str(info.value).startswith("checkpoint 7 holds GPU state that the GPUs of n1 cannot take: ")


def test_with_restart_a_mismatch_refuses_the_checkpoint_and_the_job_starts_over(
        tmp_path, monkeypatch) -> None:
    from singularity_slurm.checkpoint.criu import RestoreFailed

    engine = engine_restoring(tmp_path, monkeypatch, "restart", [gpu(0, 5, "NVIDIA A100")])
    refused = "^checkpoint 7 holds GPU state: the checkpoint ran on NVIDIA H200"
    with pytest.raises(RestoreFailed, match=refused):
        engine._gpu_plan(gpu_manifest([gpu(0, 1)]))


def test_matching_gpus_of_another_node_restore_with_their_uuids_mapped(tmp_path, monkeypatch) -> None:
    engine = engine_restoring(tmp_path, monkeypatch, "wait", [gpu(0, 9)])

    driver, pairs = engine._gpu_plan(gpu_manifest([gpu(0, 1)]))

    assert driver == "driver" and [(p.old_uuid[-1], p.new_uuid[-1]) for p in pairs] == [("1", "9")]


def test_health_problems_from_nvml_counters() -> None:
    assert gpus.health_problems(None, None, None) == ()
    assert gpus.health_problems(0, False, False) == ()
    assert gpus.health_problems(3, True, False) == (
        "3 uncorrected ECC errors since the driver loaded", "a row remapping is pending (reset the GPU)")


def test_gpu_record_round_trip_and_malformed_records() -> None:
    one = gpu(2, 9, problems=("x",))
    assert Gpu.of_record(one.record()) == one
    with pytest.raises(CheckpointError, match="malformed GPU record"):
        Gpu.of_record({"index": 0, "uuid": "not-a-uuid", "name": H200, "memory_mib": 1})
    with pytest.raises(CheckpointError, match="malformed GPU record"):
        Gpu.of_record({"index": 0})


MOUNTINFO = """\
22 1 254:0 / / rw,relatime - ext4 /dev/vda rw
29 22 254:16 / /usr/local/nvidia ro,nosuid,nodev,relatime - squashfs /dev/vdb ro
30 22 0:27 / /scratch\\040space rw - nfs4 srv:/scratch rw
31 22 0:5 / /proc rw - proc proc rw
"""


def test_external_mounts_are_the_configured_ones_present() -> None:
    assert external_mounts(MOUNTINFO, ["/usr/local/nvidia"]) == {"ext0": "/usr/local/nvidia"}
    assert external_mounts(MOUNTINFO, ["/opt/absent", "/scratch space", "/usr/local/nvidia"]) == {
        "ext0": "/scratch space", "ext1": "/usr/local/nvidia"}
    assert external_mounts(MOUNTINFO, []) == {}
    mounts = {"ext0": "/usr/local/nvidia"}
    assert dump_externals(mounts) == ["mnt[/usr/local/nvidia]:ext0"]
    assert restore_externals(mounts) == ["mnt[ext0]:/usr/local/nvidia"]


def test_mounts_in_folders_someone_but_root_could_change_are_left_out_of_a_checkpoint() -> None:
    import os
    import stat as stat_mod

    from singularity_slurm.checkpoint.criu import in_user_folder, mount_points, user_folder_mounts

    def entry(mode: int, uid: int = 0) -> os.stat_result:
        return os.stat_result((mode, 0, 0, 1, uid, 0, 0, 0, 0, 0))

    folder, link = stat_mod.S_IFDIR, stat_mod.S_IFLNK
    tree = {"/": entry(folder | 0o755), "/dev": entry(folder | 0o755), "/dev/shm": entry(folder | 0o1777),
            "/tmp": entry(folder | 0o1777), "/run": entry(folder | 0o755), "/run/user": entry(folder | 0o755),
            "/home": entry(folder | 0o755), "/home/alice": entry(folder | 0o700, uid=1001),
            "/srv": entry(folder | 0o775), "/opt": entry(link | 0o777), "/usr": entry(folder | 0o755),
            "/usr/local": entry(folder | 0o755)}

    def lstat(path: str) -> os.stat_result:
        if path not in tree:
            raise FileNotFoundError(path)
        return tree[path]

    info = "".join(f"{n} 1 0:{n} / {point} rw - tmpfs tmpfs rw\n" for n, point in enumerate([
        "/", "/dev/shm", "/dev/shm", "/run/user/1001", "/tmp/scratch", "/tmp/scratch/inner",
        "/home/alice/fuse", "/srv/data", "/opt/x", "/usr/local/nvidia", "/gone/mnt", "/dev/shm/sub"], 20))
    assert mount_points(info)[:3] == ["/", "/dev/shm", "/run/user/1001"]  # each once
    # root's folders no one else may write: kept (bound from the host, or the job's own /dev/shm)
    assert not in_user_folder("/", lstat) and not in_user_folder("/dev/shm", lstat)
    assert not in_user_folder("/run/user/1001", lstat) and not in_user_folder("/usr/local/nvidia", lstat)
    # the sticky /tmp and /dev/shm, a user's home, a group-writable folder, a symlink, what is gone
    assert user_folder_mounts(info, lstat) == ["/tmp/scratch", "/tmp/scratch/inner", "/home/alice/fuse",
                                               "/srv/data", "/opt/x", "/gone/mnt", "/dev/shm/sub"]


def test_a_mount_criu_would_bind_from_a_folder_someone_but_root_could_change_is_left_out() -> None:
    """criu binds an auto-detected external mount from the host's mount of the same file system
    whose root holds it, plus the rest of its root: a bind of /scratch/alice/data at /data is bound
    from /scratch/alice/data, in alice's folder, however root's /data looks."""
    import os
    import stat as stat_mod

    from singularity_slurm.checkpoint.criu import MountEntry, bind_sources, user_folder_mounts

    def entry(mode: int, uid: int = 0) -> os.stat_result:
        return os.stat_result((mode, 0, 0, 1, uid, 0, 0, 0, 0, 0))

    folder = stat_mod.S_IFDIR
    host_tree = {"/": entry(folder | 0o755), "/scratch": entry(folder | 0o755),
                 "/scratch/alice": entry(folder | 0o755, uid=1001), "/dev": entry(folder | 0o755)}
    tree = {"/": entry(folder | 0o755), "/dev": entry(folder | 0o755)}

    def lstat_in(files: dict):
        def lstat(path: str) -> os.stat_result:
            if path not in files:
                raise FileNotFoundError(path)
            return files[path]
        return lstat

    host = ("20 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
            "21 20 8:2 / /scratch rw - xfs /dev/sdb1 rw\n"
            "22 20 8:2 /alice/data /data rw - xfs /dev/sdb1 rw\n"
            "23 20 0:24 / /dev/shm rw - tmpfs tmpfs rw\n")
    ns = ("30 29 8:1 / / rw - ext4 /dev/sda1 rw\n"
          "31 30 8:2 /alice/data /data rw - xfs /dev/sdb1 rw\n"
          "32 30 8:2 / /scratch rw - xfs /dev/sdb1 rw\n"
          "33 30 0:24 / /dev/shm rw - tmpfs tmpfs rw\n"
          "34 30 0:99 / /dev/shm rw - tmpfs tmpfs rw\n")
    data = MountEntry("/data", "/alice/data", "8:2")
    others = [MountEntry("/scratch", "/", "8:2"), MountEntry("/data", "/alice/data", "8:2"),
              MountEntry("/mnt/a", "/alice", "8:2"), MountEntry("/x", "/al", "8:2"),
              MountEntry("/y", "/", "8:3")]
    assert sorted(bind_sources(data, others)) == ["/data", "/mnt/a/data", "/scratch/alice/data"]
    assert user_folder_mounts(ns, lstat_in(tree), host, lstat_in(host_tree)) == ["/data"]
    assert user_folder_mounts(ns, lstat_in(tree)) == []  # looked at in the tree's namespace alone: missed


def test_agent_gpu_indices() -> None:
    assert gpu_indices("") == []
    assert gpu_indices("0,2") == [0, 2]
    with pytest.raises(SystemExit, match="--gpus must list GPU numbers"):
        gpu_indices("0,gpu1")


def test_prolog_hands_the_agent_slurms_gpu_numbers(tmp_path) -> None:
    from singularity_slurm.jobenv import JobContext
    from singularity_slurm.prolog.main import agent_spec

    job = JobContext(job_id=7, user="alice", uid=1000, node="n1", partition="basic", tier="basic",
                     gpus=["0", "2"], restart_count=0)
    argv = agent_spec(job, tmp_path).argv
    assert argv[argv.index("--gpus") + 1] == "0,2"
    assert "--gpus" not in agent_spec(JobContext(**{**job.__dict__, "gpus": []}), tmp_path).argv


def test_the_agent_inventories_only_the_gpus_slurm_gave_the_job(tmp_path, monkeypatch) -> None:
    """What the job's processes hold open (fds, maps) is theirs to fake in a namespace of their own:
    without Slurm's GPU list the engine refuses the GPU checkpoint before any driver call, and with it
    never looks at the fds."""
    from singularity_slurm.checkpoint.store import CheckpointStore
    from singularity_slurm.config import parse
    from singularity_slurm.node import engine as engine_mod
    from singularity_slurm.node.engine import CheckpointEngine

    config = parse({"paths": {"store_root": str(tmp_path / "store")}})
    engine = CheckpointEngine(config, "n1", tmp_path, CheckpointStore(tmp_path / "store"), None,  # type: ignore[arg-type]
                              None)  # type: ignore[arg-type]
    monkeypatch.setattr(engine_mod.jobcgroup, "tree", lambda pid: [pid])
    monkeypatch.setattr(cuda, "gpu_tasks", lambda pids: list(pids))
    monkeypatch.setattr(cuda, "opened_gpus", lambda pids: pytest.fail("the job's fds were read"))
    monkeypatch.setattr(cuda, "Driver", lambda **_: pytest.fail("the driver was called"))
    with pytest.raises(CheckpointError, match="not told the job's GPUs"):
        with engine._gpu_state_out(1234, stop=True):
            pass
    asked = []
    engine.gpus = [2]
    monkeypatch.setattr(cuda, "Driver", lambda **_: type("D", (), {"version": 12080})())
    monkeypatch.setattr(gpus, "inventory", lambda indices: asked.append(list(indices)) or [])
    monkeypatch.setattr(cuda, "inner_pids", lambda tasks: {t: 1 for t in tasks})
    monkeypatch.setattr(cuda, "suspend", lambda driver, tasks: None)
    with engine._gpu_state_out(1234, stop=True) as meta:
        assert meta["cuda"]["tasks"] == [1]
    assert asked == [[2]]


def test_checkpointed_tasks_are_those_the_driver_says_are_out_and_not_processes_without_a_context() -> None:
    driver = ScriptedDriver({1: cuda.RUNNING, 2: cuda.CHECKPOINTED, 3: cuda.LOCKED})
    assert cuda.checkpointed_tasks(driver, [1, 2, 3, 4]) == [2]


def test_a_checkpoint_leaves_a_rank_whose_proxy_moved_its_memory_out_as_it_is_and_records_it(
        tmp_path, monkeypatch) -> None:
    """Rank processes of one tree: 10 on the GPU, 11 with its memory out (its proxy moved it while it
    waits), 12 a forked DataLoader worker that maps the driver's library but has no context."""
    from singularity_slurm.checkpoint.store import CheckpointStore
    from singularity_slurm.config import parse
    from singularity_slurm.node import engine as engine_mod
    from singularity_slurm.node.engine import CheckpointEngine

    config = parse({"paths": {"store_root": str(tmp_path / "store")}})
    engine = CheckpointEngine(config, "n1", tmp_path, CheckpointStore(tmp_path / "store"), None,  # type: ignore[arg-type]
                              None)  # type: ignore[arg-type]
    engine.gpus = [0]
    driver = ScriptedDriver({10: cuda.RUNNING, 11: cuda.CHECKPOINTED})
    monkeypatch.setattr(engine_mod.jobcgroup, "tree", lambda pid: [10, 11, 12])
    monkeypatch.setattr(cuda, "gpu_tasks", lambda pids: [p for p in pids if p == 10])
    monkeypatch.setattr(cuda, "cuda_tasks", lambda pids: [p for p in pids if p in (11, 12)])
    monkeypatch.setattr(cuda, "inner_pids", lambda tasks: {t: t - 9 for t in tasks})
    monkeypatch.setattr(cuda, "Driver", lambda **_: driver)
    driver.version = 13000
    monkeypatch.setattr(gpus, "inventory", lambda indices: [gpu(0, 1)])

    with engine._gpu_state_out(1, stop=False) as meta:  # a periodic checkpoint: the job runs on
        assert driver.now == {10: cuda.CHECKPOINTED, 11: cuda.CHECKPOINTED}
        assert (meta["cuda"]["tasks"], meta["cuda"]["swapped"]) == ([1], [2])
    assert driver.now == {10: cuda.RUNNING, 11: cuda.CHECKPOINTED}  # its proxy brings 11 in at its turn
    assert {pid for _, pid, _ in driver.calls} == {10}

    driver.now = {11: cuda.CHECKPOINTED}  # every rank's memory out: the GPUs are recorded all the same
    monkeypatch.setattr(engine_mod.jobcgroup, "tree", lambda pid: [11, 12])
    monkeypatch.setattr(cuda, "gpu_tasks", lambda pids: [])
    with engine._gpu_state_out(1, stop=True) as meta:
        assert (meta["cuda"]["tasks"], meta["cuda"]["swapped"]) == ([], [2])
        assert meta["cuda"]["gpus"] == [gpu(0, 1).record()]


@pytest.mark.parametrize("proxies_bring_in", [True, False])
def test_a_restore_leaves_a_rank_restored_with_its_memory_out_to_its_proxy_where_the_proxy_can(
        tmp_path, monkeypatch, proxies_bring_in: bool) -> None:
    """Inner pid 1 was on the GPU at the dump, 2 had its memory out (its proxy had moved it): the
    engine brings 1 back, and 2 too where the node's proxies cannot (no NVML or driver bindings)."""
    from types import SimpleNamespace

    from singularity_slurm.node import engine as engine_mod

    engine = engine_restoring(tmp_path, monkeypatch, "wait", [gpu(0, 1)])
    driver = ScriptedDriver({10: cuda.CHECKPOINTED, 11: cuda.CHECKPOINTED})
    monkeypatch.setattr(engine_mod.jobcgroup, "tree", lambda pid: [10, 11, 12])
    monkeypatch.setattr(cuda, "inner_pids", lambda pids: {p: p - 9 for p in pids})
    manifest = SimpleNamespace(seq=7, meta={"cuda": {"tasks": [1], "swapped": [2]}})

    engine._gpu_state_in(99, manifest, driver, [], with_swapped=not proxies_bring_in)

    assert driver.now == {10: cuda.RUNNING, 11: cuda.CHECKPOINTED if proxies_bring_in else cuda.RUNNING}


def test_a_rank_restores_from_the_gpu_its_proxy_served_onto_its_proxys_gpu_now(tmp_path, monkeypatch) -> None:
    """Ranks 0 and 1 ran on GPUs 0 and 1 of a node (UUID tails 1, 2); the job comes back on one GPU
    (tail 9) that both share: each rank's state moves from its own old GPU onto that one."""
    from types import SimpleNamespace

    engine = engine_restoring(tmp_path, monkeypatch, "wait", [gpu(0, 9), gpu(1, 8)])
    ran_on = [gpu(0, 1).record(), gpu(1, 2).record()]
    for rank, old_tail in ((0, "1"), (1, "2")):
        tree = engine.for_tree(rank, rank=True, gpu=0)
        manifest = SimpleNamespace(seq=7, meta={"cuda": {"gpus": ran_on, "gpu": rank}})
        _, pairs = tree._gpu_plan(manifest)
        assert [(p.old_uuid[-1], p.new_uuid[-1]) for p in pairs] == [(old_tail, "9")]
    # the same GPU as at the dump: nothing to map
    manifest = SimpleNamespace(seq=7, meta={"cuda": {"gpus": [gpu(0, 9).record()], "gpu": 0}})
    assert engine.for_tree(0, rank=True, gpu=0)._gpu_plan(manifest)[1] == []


def test_a_ranks_checkpoint_naming_a_gpu_it_does_not_record_is_refused(tmp_path, monkeypatch) -> None:
    from types import SimpleNamespace

    from singularity_slurm.checkpoint.criu import RestoreFailed

    engine = engine_restoring(tmp_path, monkeypatch, "wait", [gpu(0, 9)])
    manifest = SimpleNamespace(seq=7, meta={"cuda": {"gpus": [gpu(0, 1).record()], "gpu": 3}})
    with pytest.raises(RestoreFailed, match="names GPU 3 for its rank but records no such GPU"):
        engine.for_tree(0, rank=True, gpu=0)._gpu_plan(manifest)


def test_the_gpu_a_proxy_serves_is_its_slurm_number() -> None:
    from singularity_slurm.node.agent import gpu_of_proxy

    assert [gpu_of_proxy(p) for p in ("n1/gpu0", "n1/gpu12", "n1/cpu0", "n1/gpu", "n1/gpux")] == [
        0, 12, None, None, None]
