"""Per-job node services, with real processes: pid files that cannot point at a stranger."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from singularity_slurm.errors import ServiceError
from singularity_slurm.node import services
from singularity_slurm.node.services import (
    ServiceSpec,
    group_has_live_member,
    pidfile_path,
    proc_start_time,
    read_pidfile,
    running_pid,
    start,
    stop,
    stop_all,
)


def wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def alive(pid: int) -> bool:
    """A live process (zombies count as gone: they run nothing and wait only to be reaped)."""
    return proc_start_time(pid) is not None


@pytest.fixture
def run_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "run"
    yield path
    if path.is_dir():
        stop_all(path, timeout=1.0)


@pytest.fixture
def own_processes() -> Iterator[list[subprocess.Popen]]:
    """Processes a test starts itself; killed and reaped afterwards."""
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=5)


SLEEPER = ServiceSpec("sleeper", ["sleep", "60"])


# --- start ----------------------------------------------------------------------------------------


def test_start_writes_a_pid_file_with_the_process_start_time(run_dir: Path) -> None:
    pid = start(SLEEPER, run_dir)

    assert json.loads(pidfile_path(run_dir, "sleeper").read_text()) == {
        "pid": pid, "start_time": proc_start_time(pid), "argv": ["sleep", "60"],
    }
    assert read_pidfile(run_dir / "sleeper.pid") == (pid, proc_start_time(pid))


def test_running_pid_finds_the_started_service(run_dir: Path) -> None:
    pid = start(SLEEPER, run_dir)

    assert running_pid(run_dir, "sleeper") == pid
    assert alive(pid)


def test_service_runs_in_its_own_session(run_dir: Path) -> None:
    pid = start(SLEEPER, run_dir)

    assert os.getsid(pid) == pid
    assert os.getpgid(pid) == pid


def test_service_gets_the_given_environment_root_cwd_and_a_log(run_dir: Path) -> None:
    spec = ServiceSpec("talker", ["sh", "-c", 'echo "$GREETING in $(pwd)"; exec sleep 60'])

    start(spec, run_dir, env={"GREETING": "hello", "PATH": os.environ["PATH"]})

    log = run_dir / "talker.log"
    assert wait_for(lambda: log.read_text() == "hello in /\n"), log.read_text()


def test_service_without_an_environment_gets_a_clean_one_not_its_starters(
        run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LD_PRELOAD", "/home/mallory/evil.so")
    monkeypatch.setenv("PATH", "/home/mallory/bin:/usr/bin:/bin")
    monkeypatch.setenv("SINGULARITY_CONFIG", "/etc/singularity-slurm/site.toml")
    spec = ServiceSpec("env", ["/usr/bin/env"])

    start(spec, run_dir)

    log = run_dir / "env.log"
    assert wait_for(lambda: log.read_text().endswith("\n")), log.read_text()
    assert sorted(log.read_text().splitlines()) == [
        "LC_ALL=C", "PATH=/usr/sbin:/usr/bin:/sbin:/bin",
        "SINGULARITY_CONFIG=/etc/singularity-slurm/site.toml",
    ]


def test_second_start_returns_the_running_service(run_dir: Path) -> None:
    first = start(SLEEPER, run_dir)

    assert start(SLEEPER, run_dir) == first
    assert sorted(p.name for p in run_dir.glob("*.pid")) == ["sleeper.pid"]


def test_start_waits_until_the_ready_path_exists(run_dir: Path) -> None:
    ready = run_dir / "ready"
    spec = ServiceSpec("slow", ["sh", "-c", f"sleep 0.3; touch {ready}; exec sleep 60"],
                       ready_path=ready)

    start(spec, run_dir)

    assert ready.exists()


def test_service_that_exits_while_starting_is_an_error(run_dir: Path) -> None:
    spec = ServiceSpec("crasher", ["sh", "-c", "echo boom >&2; exit 3"],
                       ready_path=run_dir / "never")

    with pytest.raises(ServiceError) as info:
        start(spec, run_dir)

    assert str(info.value) == (
        f"crasher exited with status 3 while starting; see {run_dir / 'crasher.log'}"
    )
    assert (run_dir / "crasher.log").read_text() == "boom\n"
    assert running_pid(run_dir, "crasher") is None


def test_service_that_never_gets_ready_is_stopped_and_an_error(run_dir: Path) -> None:
    spec = ServiceSpec("stuck", ["sleep", "60"], ready_path=run_dir / "never")

    with pytest.raises(ServiceError) as info:
        start(spec, run_dir, ready_timeout=1.0)

    assert str(info.value) == "stuck did not become ready within 1s"
    assert not pidfile_path(run_dir, "stuck").exists()


def test_program_that_does_not_exist_is_an_error(run_dir: Path) -> None:
    spec = ServiceSpec("ghost", ["/nonexistent/ghost-agent"])

    with pytest.raises(ServiceError) as info:
        start(spec, run_dir)

    assert str(info.value) == (
        "cannot start ghost (/nonexistent/ghost-agent): No such file or directory"
    )
    assert not pidfile_path(run_dir, "ghost").exists()


def test_program_whose_name_holds_spaces_and_parentheses_is_tracked(
        run_dir: Path, tmp_path: Path) -> None:
    # /proc/PID/stat shows the name in parentheses; a name like this one must not shift the fields.
    odd = tmp_path / "x) (y z"
    odd.symlink_to("/bin/sleep")
    spec = ServiceSpec("odd", [str(odd), "60"])

    pid = start(spec, run_dir)

    assert running_pid(run_dir, "odd") == pid
    assert stop(run_dir, "odd") is True
    assert not alive(pid)


# --- stop -----------------------------------------------------------------------------------------


def test_stop_ends_the_service_and_removes_its_pid_file(run_dir: Path) -> None:
    pid = start(SLEEPER, run_dir)

    assert stop(run_dir, "sleeper") is True

    assert not alive(pid)
    assert not pidfile_path(run_dir, "sleeper").exists()
    assert running_pid(run_dir, "sleeper") is None


def test_stop_of_a_service_that_is_not_running_is_false(run_dir: Path) -> None:
    run_dir.mkdir()

    assert stop(run_dir, "sleeper") is False


def test_stop_kills_the_whole_process_group(run_dir: Path) -> None:
    child_file = run_dir / "child.pid"
    script = f"sleep 60 & echo $! > {child_file}.tmp; mv {child_file}.tmp {child_file}; wait"
    spec = ServiceSpec("family", ["sh", "-c", script], ready_path=child_file)
    leader = start(spec, run_dir)
    child = int(child_file.read_text())
    assert alive(leader) and alive(child)

    assert stop(run_dir, "family", timeout=2.0) is True

    assert not alive(leader)
    assert not alive(child)


def test_stop_ends_what_a_dead_leader_left_in_its_group(run_dir: Path) -> None:
    # The leader has exited, but a child it started still runs in the service's process group. The
    # group id cannot be handed to another process while the group has members, so signalling it is
    # safe; "nothing is left behind" (module docstring) requires it. Today stop() sees the dead
    # leader, answers "not running" and leaves the child running.
    child_file = run_dir / "child.pid"
    script = f"sleep 60 & echo $! > {child_file}.tmp; mv {child_file}.tmp {child_file}; exit 0"
    leader = start(ServiceSpec("orphaner", ["sh", "-c", script], ready_path=child_file), run_dir)
    child = int(child_file.read_text())
    try:
        assert wait_for(lambda: not alive(leader))
        assert os.getpgid(child) == leader

        stop(run_dir, "orphaner", timeout=1.0)

        assert not alive(child)
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)


def test_stop_kills_a_service_that_ignores_sigterm(run_dir: Path) -> None:
    ready = run_dir / "ready"
    script = f"trap '' TERM; touch {ready}; while :; do sleep 1; done"
    spec = ServiceSpec("stubborn", ["sh", "-c", script], ready_path=ready)
    pid = start(spec, run_dir)

    assert stop(run_dir, "stubborn", timeout=0.5) is True

    assert not alive(pid)


def test_pid_file_of_a_dead_process_is_not_trusted_and_is_removed(run_dir: Path) -> None:
    proc = subprocess.run(["sh", "-c", "echo $$"], capture_output=True, text=True, check=True)
    dead = int(proc.stdout)
    run_dir.mkdir()
    pidfile_path(run_dir, "gone").write_text(json.dumps({"pid": dead, "start_time": 1}))

    assert running_pid(run_dir, "gone") is None
    assert stop(run_dir, "gone") is False
    assert not pidfile_path(run_dir, "gone").exists()


def test_pid_file_naming_this_process_with_another_start_time_is_not_trusted(
        run_dir: Path) -> None:
    run_dir.mkdir()
    me = os.getpid()
    pidfile_path(run_dir, "impostor").write_text(
        json.dumps({"pid": me, "start_time": proc_start_time(me) - 1}))

    assert running_pid(run_dir, "impostor") is None


def test_stop_never_signals_a_stranger_that_got_a_recycled_pid(
        run_dir: Path, own_processes: list[subprocess.Popen]) -> None:
    # A live group leader, as the service was; only its start time tells it apart.
    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)
    own_processes.append(stranger)
    assert wait_for(lambda: alive(stranger.pid))
    run_dir.mkdir()
    pidfile_path(run_dir, "agent").write_text(json.dumps(
        {"pid": stranger.pid, "start_time": proc_start_time(stranger.pid) + 1}))

    assert stop(run_dir, "agent", timeout=0.5) is False

    assert stranger.poll() is None
    assert not pidfile_path(run_dir, "agent").exists()


@pytest.mark.parametrize("content", [
    "", "garbage", "{}", "[1, 2]", '"text"', '{"pid": 1}', '{"pid": "one", "start_time": 1}',
    '{"pid": 1, "start_time": null}',
])
def test_unreadable_pid_file_means_not_running(run_dir: Path, content: str) -> None:
    run_dir.mkdir()
    pidfile_path(run_dir, "broken").write_text(content)

    assert read_pidfile(pidfile_path(run_dir, "broken")) is None
    assert running_pid(run_dir, "broken") is None
    assert stop(run_dir, "broken") is False


# --- stop_all -------------------------------------------------------------------------------------


def test_stop_all_stops_every_running_service_and_clears_stale_pid_files(run_dir: Path) -> None:
    pids = [start(ServiceSpec(name, ["sleep", "60"]), run_dir) for name in ("b-agent", "a-proxy")]
    pidfile_path(run_dir, "stale").write_text(json.dumps({"pid": 1, "start_time": -1}))

    assert stop_all(run_dir) == ["a-proxy", "b-agent"]

    assert [p for p in pids if alive(p)] == []
    assert list(run_dir.glob("*.pid")) == []


def test_stop_all_stops_the_named_first_then_the_rest_together(run_dir: Path) -> None:
    for name in ("agent", "proxy-gpu0", "proxy-gpu1"):
        start(ServiceSpec(name, ["sleep", "60"]), run_dir)

    assert stop_all(run_dir, first=["agent", "absent"]) == ["agent", "proxy-gpu0", "proxy-gpu1"]
    assert list(run_dir.glob("*.pid")) == []


def test_a_group_whose_members_ended_but_are_not_reaped_has_ended() -> None:
    """A service's parent is init, which may take a second or two to reap it: its zombie must not
    make a stop wait."""
    zombie = "4242 (sleep) Z 1 4242 4242 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 777 0 0"
    live = "4243 (py thon (x)) S 1 4242 4242 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 778 0 0"
    stranger = "4244 (sleep) S 1 99 99 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 779 0 0"

    assert group_has_live_member(4242, [zombie, stranger]) is False
    assert group_has_live_member(4242, [zombie, live]) is True
    assert group_has_live_member(4242, ["garbage", zombie]) is False


def test_a_real_unreaped_zombie_leader_does_not_count_as_running(tmp_path: Path) -> None:
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                               "p = subprocess.Popen(['sleep', '60'], start_new_session=True)\n"
                               "print(p.pid, flush=True); sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert services._group_alive(child)
        os.kill(child, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child}/stat").read_text().split(") ")[1][0] != "Z":
            assert time.monotonic() < deadline, "the child never became a zombie"
            time.sleep(0.01)

        assert services._group_alive(child) is False
        assert proc_start_time(child) is None
    finally:
        parent.kill()
        parent.wait()


def test_stop_all_of_an_empty_folder_stops_nothing(run_dir: Path) -> None:
    run_dir.mkdir()

    assert stop_all(run_dir) == []


# --- /proc start times ----------------------------------------------------------------------------


def test_start_time_of_this_process_is_stable() -> None:
    first = proc_start_time(os.getpid())

    assert isinstance(first, int)
    assert proc_start_time(os.getpid()) == first


def test_start_time_of_a_zombie_is_none(own_processes: list[subprocess.Popen]) -> None:
    proc = subprocess.Popen(["sh", "-c", "exit 0"])
    own_processes.append(proc)

    def state() -> str:
        stat = Path(f"/proc/{proc.pid}/stat").read_text()
        return stat[stat.rindex(")") + 2]

    assert wait_for(lambda: state() == "Z")
    assert proc_start_time(proc.pid) is None


def test_start_time_of_no_process_is_none() -> None:
    with open("/proc/sys/kernel/pid_max") as handle:
        pid_max = int(handle.read())

    assert proc_start_time(pid_max + 1) is None



# --- the job's trees ------------------------------------------------------------------------------


@pytest.fixture
def noted_tree(run_dir: Path, own_processes: list[subprocess.Popen]) -> subprocess.Popen:
    """A process standing in for a tree's namespace init, noted in run_dir as the engine notes one."""
    tree = subprocess.Popen(["sleep", "60"], start_new_session=True)
    own_processes.append(tree)
    run_dir.mkdir()
    services.note_tree(run_dir, tree.pid)
    return tree


def test_end_trees_kills_a_noted_tree_and_drops_its_note(run_dir: Path, noted_tree) -> None:
    tree = noted_tree
    assert services.tree_note_path(run_dir, tree.pid).exists()

    assert services.end_trees(run_dir, timeout=5.0) == services.EndedTrees([tree.pid], [])

    assert tree.wait(timeout=5) == -signal.SIGKILL
    assert not list(run_dir.iterdir())


def test_a_forgotten_tree_is_left_alone(run_dir: Path, noted_tree) -> None:
    tree = noted_tree
    services.forget_tree(run_dir, tree.pid)

    assert services.end_trees(run_dir, timeout=0.5) == services.EndedTrees([], [])
    assert tree.poll() is None


@pytest.mark.parametrize("content", [
    lambda pid, start: {"pid": pid, "start_time": start + 1},  # a stranger got the recycled pid
    lambda pid, start: {"pid": -1, "start_time": start},  # kill(-1) would end every process
    lambda pid, start: {"pid": 0, "start_time": start},
    lambda pid, start: "garbage",
])
def test_end_trees_never_signals_what_its_note_does_not_name_exactly(
        run_dir: Path, own_processes: list[subprocess.Popen], content) -> None:
    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)
    own_processes.append(stranger)
    assert wait_for(lambda: alive(stranger.pid))
    run_dir.mkdir()
    note = services.tree_note_path(run_dir, stranger.pid)
    note.write_text(json.dumps(content(stranger.pid, proc_start_time(stranger.pid))))

    assert services.end_trees(run_dir, timeout=0.5) == services.EndedTrees([], [])

    assert stranger.poll() is None
    assert not note.exists()


def test_a_tree_that_ended_before_its_note_is_an_error_and_not_noted(run_dir: Path) -> None:
    done = subprocess.Popen(["true"])
    done.wait()
    run_dir.mkdir()
    with pytest.raises(ServiceError, match=rf"tree \(pid {done.pid}\) ended before it could be noted"):
        services.note_tree(run_dir, done.pid)

    assert not list(run_dir.iterdir())


def test_a_tree_whose_pid_is_no_longer_its_parents_child_is_not_noted(
        run_dir: Path, own_processes: list[subprocess.Popen]) -> None:
    # A live process that is not the named parent's child: the pid was recycled after the init ended.
    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)
    parent = subprocess.Popen(["sleep", "60"])
    own_processes.extend([stranger, parent])
    run_dir.mkdir()
    with pytest.raises(ServiceError, match="ended before it could be noted"):
        services.note_tree(run_dir, stranger.pid, parent=parent.pid)
    assert not list(run_dir.iterdir())


def test_a_noted_tree_names_its_parent_and_the_note_is_roots_alone(
        run_dir: Path, own_processes: list[subprocess.Popen]) -> None:
    parent = subprocess.Popen(["sh", "-c", "sleep 60 & wait"])
    own_processes.append(parent)
    run_dir.mkdir()
    assert wait_for(lambda: services._children(parent.pid) != [])
    child = int(services._children(parent.pid)[0])
    services.note_tree(run_dir, child, parent=parent.pid)

    note = services.tree_note_path(run_dir, child)
    assert json.loads(note.read_text()) == {"pid": child, "start_time": proc_start_time(child)}
    assert note.stat().st_mode & 0o777 == 0o600
    assert services.end_trees(run_dir, timeout=5.0).ended == [child]


def test_a_tree_that_outlives_the_wait_is_reported_and_keeps_its_note(
        run_dir: Path, noted_tree, monkeypatch: pytest.MonkeyPatch) -> None:
    # A process that does not end within the wait (one in uninterruptible sleep) cannot be made
    # here: the signal is left out instead, and the wait's end is what is checked.
    tree = noted_tree
    kills = []
    monkeypatch.setattr(services, "_kill_exactly", lambda pid, start: kills.append(pid) or True)
    result = services.end_trees(run_dir, timeout=0.2)

    assert result == services.EndedTrees([], [tree.pid]) and kills == [tree.pid]
    assert services.tree_note_path(run_dir, tree.pid).exists()


def test_a_started_tree_is_noted_for_the_epilog_at_once_and_ended_from_its_note(tmp_path: Path) -> None:
    """A real tree (own PID namespace, as nobody): the Epilog's `end_trees` finds it by its note alone."""
    from singularity_slurm.checkpoint.store import CheckpointStore
    from singularity_slurm.node import jobtree
    from singularity_slurm.node.engine import CheckpointEngine

    if os.geteuid() != 0:
        pytest.skip("starting a tree in its own namespaces needs root")
    store = CheckpointStore(tmp_path / "store", max_chunk=4096)
    engine = CheckpointEngine(None, "n1", tmp_path, store, None, None)  # type: ignore[arg-type]
    spec = jobtree.TreeSpec(["sleep", "60"], 65534, 65534, "/", "/dev/null", {"PATH": "/usr/bin:/bin"})
    init_pid, waiter = engine.start(spec)

    note = services.tree_note_path(tmp_path, init_pid)
    assert services.read_pidfile(note) == (init_pid, services.proc_start_time(init_pid))
    ended = services.end_trees(tmp_path, timeout=10)

    assert ended == services.EndedTrees([init_pid], [])
    assert waiter() != 0  # the tree was ended, not finished
    assert not note.exists()
