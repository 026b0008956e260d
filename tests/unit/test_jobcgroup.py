"""Finding a job's extern step cgroups from a process of the job's, and moving a tree into them."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from singularity_slurm.node import jobcgroup, jobtree

HYBRID_MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
36 31 0:33 / /sys/fs/cgroup/devices rw,relatime - cgroup cgroup rw,devices
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""

# the launcher, a step of job 57 of uid 1000 on node n1 (a host with several slurmd: slurm_<node>)
LAUNCHER_V1 = """\
9:name=systemd:/
6:freezer:/slurm_n1/uid_1000/job_57/step_3
5:devices:/slurm_n1/uid_1000/job_57/step_3
4:memory:/process_api/abc
3:cpuset:/slurm_n1/uid_1000/job_57/step_3
1:cpu:/
0::/
"""

V2_MOUNTINFO = "25 1 0:23 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
LAUNCHER_V2 = "0::/system.slice/slurmstepd.scope/job_57/step_3/user/task_0\n"


def existing(*paths: str):
    known = {Path(p) for p in paths}
    return lambda path: path in known


def test_cgroup_v1_gives_the_extern_step_of_every_hierarchy_slurm_made_one_in() -> None:
    targets = jobcgroup.extern_targets(
        LAUNCHER_V1, HYBRID_MOUNTINFO, 57,
        is_dir=existing("/sys/fs/cgroup/freezer/slurm_n1/uid_1000/job_57/step_extern",
                        "/sys/fs/cgroup/devices/slurm_n1/uid_1000/job_57/step_extern"))

    assert targets == [Path("/sys/fs/cgroup/freezer/slurm_n1/uid_1000/job_57/step_extern"),
                       Path("/sys/fs/cgroup/devices/slurm_n1/uid_1000/job_57/step_extern")]


def test_cgroup_v2_gives_the_extern_steps_task_leaf() -> None:
    extern = "/sys/fs/cgroup/system.slice/slurmstepd.scope/job_57/step_extern"
    targets = jobcgroup.extern_targets(LAUNCHER_V2, V2_MOUNTINFO, 57, is_dir=existing(extern),
                                       listdir=lambda path: ["task_special"] if str(path).endswith("user")
                                       else [])

    assert targets == [Path(extern) / "user" / "task_special"]


def test_a_process_of_another_job_or_outside_any_job_shows_nothing() -> None:
    every = lambda path: True  # noqa: E731
    assert jobcgroup.extern_targets(LAUNCHER_V1, HYBRID_MOUNTINFO, 58, is_dir=every) == []
    assert jobcgroup.extern_targets(LAUNCHER_V1.replace("job_57", "job_570"), HYBRID_MOUNTINFO, 57,
                                    is_dir=every) == []
    login_shell = "6:freezer:/\n0::/user.slice/user-1000.slice/session-3.scope\n"
    assert jobcgroup.extern_targets(login_shell, HYBRID_MOUNTINFO, 57, is_dir=every) == []


def test_without_an_extern_step_there_is_no_target() -> None:
    assert jobcgroup.extern_targets(LAUNCHER_V1, HYBRID_MOUNTINFO, 57, is_dir=lambda path: False) == []


def test_a_process_is_in_a_step_of_its_job_only() -> None:
    assert jobcgroup.in_a_step(LAUNCHER_V1, 57)
    assert jobcgroup.in_a_step(LAUNCHER_V2, 57)
    assert not jobcgroup.in_a_step(LAUNCHER_V1, 5)
    assert not jobcgroup.in_a_step("6:freezer:/\n0::/user.slice/user-1000.slice/session-3.scope\n", 57)


def test_cgroups_a_user_names_like_another_jobs_steps_below_their_own_are_no_step_of_that_job() -> None:
    # the job's user owns its extern step's folder, and may make job_58/step_0 inside it
    nested = "6:freezer:/slurm_n1/uid_1000/job_57/step_extern/job_58/step_0\n"
    assert jobcgroup.in_a_step(nested, 57)
    assert not jobcgroup.in_a_step(nested, 58)
    assert jobcgroup.extern_targets(nested, HYBRID_MOUNTINFO, 58, is_dir=lambda path: True) == []


def test_the_jobs_extern_steps_are_found_in_every_hierarchy_and_no_other_jobs(tmp_path: Path) -> None:
    v1 = tmp_path / "freezer" / "slurm_n1" / "uid_1000" / "job_57" / "step_extern"
    v2 = tmp_path / "v2" / "system.slice" / "slurmstepd.scope" / "job_57" / "step_extern"
    for folder in (v1, v2, tmp_path / "freezer" / "slurm_n1" / "uid_1000" / "job_570" / "step_extern",
                   tmp_path / "freezer" / "slurm_n1" / "uid_1000" / "job_57" / "step_batch"):
        folder.mkdir(parents=True)
    mounts = [jobcgroup.Mount(tmp_path / "freezer", "/", frozenset({"freezer"}), False),
              jobcgroup.Mount(tmp_path / "v2", "/", frozenset(), True)]
    assert jobcgroup.extern_steps(57, mounts) == [v1, v2]
    assert jobcgroup.extern_steps(58, mounts) == []


def test_mount_points_and_controllers_are_read_from_mountinfo() -> None:
    mounts = {m.point: (m.controllers, m.v2) for m in jobcgroup.cgroup_mounts(HYBRID_MOUNTINFO)}
    assert mounts[Path("/sys/fs/cgroup/freezer")] == (frozenset({"freezer"}), False)
    assert mounts[Path("/sys/fs/cgroup/systemd")] == (frozenset({"name=systemd"}), False)
    assert mounts[Path("/sys/fs/cgroup/unified")] == (frozenset(), True)
    assert Path("/sys/fs/cgroup") not in mounts  # the tmpfs holding them


def test_the_tree_lists_every_descendant_parents_first() -> None:
    proc = subprocess.Popen(["sh", "-c", "sleep 30 & sh -c 'sleep 30 & wait' & wait"])
    try:
        found = []
        for _ in range(200):
            found = jobcgroup.tree(proc.pid)
            if len(found) == 4:
                break
            time.sleep(0.01)  # the shells are still forking
        assert found[0] == proc.pid and len(found) == 4
    finally:
        for pid in reversed(jobcgroup.tree(proc.pid)):
            os.kill(pid, 9)
        proc.wait()


def test_the_start_joins_every_cgroup_as_the_process_that_becomes_unshare(tmp_path: Path) -> None:
    procs = [tmp_path / "a.procs", tmp_path / "b.procs"]
    for path in procs:
        path.write_text("")
    argv = jobtree.spawn_argv(jobtree.TreeSpec(["true"], 1000, 1000, "/", "/dev/null", {}),
                              jobtree.Programs("/usr/bin/unshare", "/usr/bin/setsid", "/bin/mount",
                                               "/usr/bin/setpriv", "/bin/sh", "/usr/bin/python3"),
                              9, [str(p) for p in procs])
    join = argv[:argv.index("/usr/bin/unshare")]
    assert join[:4] == ["/bin/sh", "-c", jobtree._JOIN_CGROUPS, "singularity-join-cgroups"]
    assert join[4:] == ["2", *map(str, procs)]

    # the join step, with a stand-in for unshare that prints its own pid
    out = subprocess.run([*join, "/bin/sh", "-c", "echo $$"], capture_output=True, text=True, check=True)
    assert [p.read_text() for p in procs] == [out.stdout, out.stdout]


def test_a_cgroup_that_cannot_be_joined_stops_the_start(tmp_path: Path) -> None:
    join = ["/bin/sh", "-c", jobtree._JOIN_CGROUPS, "x", "1", str(tmp_path / "missing" / "cgroup.procs"),
            "/bin/echo", "ran"]
    proc = subprocess.run(join, capture_output=True, text=True)
    assert (proc.returncode, proc.stdout) == (124, "")


def test_join_reports_what_it_could_not_move(tmp_path: Path) -> None:
    target = tmp_path / "cg"
    target.mkdir()
    (target / "cgroup.procs").write_text("")
    assert jobcgroup.join([os.getpid()], [target]) == []
    assert (target / "cgroup.procs").read_text() == f"{os.getpid()}\n"
    problems = jobcgroup.join([os.getpid()], [tmp_path / "gone"])
    assert len(problems) == 1 and problems[0].startswith(f"pid {os.getpid()} into {tmp_path / 'gone'}: ")


# --- the trees' shelter below the extern step, and the Epilog's sweep of it ------------------------


def test_in_the_tracking_hierarchy_the_tree_goes_below_the_extern_step_and_elsewhere_into_it() -> None:
    base = "/sys/fs/cgroup/{}/slurm_n1/uid_1000/job_57/step_extern"
    targets = jobcgroup.extern_targets(
        LAUNCHER_V1, HYBRID_MOUNTINFO, 57, shelter=True,
        is_dir=existing(base.format("freezer"), base.format("devices")))

    assert targets == [Path(base.format("freezer")) / jobcgroup.SHELTER, Path(base.format("devices"))]


def test_on_cgroup_v2_the_shelter_is_a_leaf_of_its_own_beside_slurms() -> None:
    extern = "/sys/fs/cgroup/system.slice/slurmstepd.scope/job_57/step_extern"
    targets = jobcgroup.extern_targets(LAUNCHER_V2, V2_MOUNTINFO, 57, is_dir=existing(extern), shelter=True,
                                       listdir=lambda path: ["task_special"] if str(path).endswith("user")
                                       else [])

    assert targets == [Path(extern) / jobcgroup.SHELTER]


def test_the_proxies_cgroup_is_beside_the_trees_shelter_and_elsewhere_the_extern_step() -> None:
    base = "/sys/fs/cgroup/{}/slurm_n1/uid_1000/job_57/step_extern"
    targets = jobcgroup.extern_targets(
        LAUNCHER_V1, HYBRID_MOUNTINFO, 57, shelter=True, name=jobcgroup.PROXIES,
        is_dir=existing(base.format("freezer"), base.format("devices")))

    assert targets == [Path(base.format("freezer")) / jobcgroup.PROXIES, Path(base.format("devices"))]
    assert jobcgroup.freezable(targets) == []  # a tree's freeze for a dump slot leaves them running


def test_a_service_is_moved_only_while_its_pid_is_the_process_its_pid_file_named(tmp_path: Path) -> None:
    import subprocess

    from singularity_slurm.node import services

    target = tmp_path / "proxies"
    target.mkdir()
    proc = subprocess.Popen(["sleep", "60"])
    try:
        started = services.proc_start_time(proc.pid)
        assert jobcgroup.join_service(proc.pid, started + 1, [target], services.proc_start_time) == [
            f"pid {proc.pid} is no longer the process its pid file names"]
        assert not (target / "cgroup.procs").exists()  # a recycled pid: not moved
        assert jobcgroup.join_service(proc.pid, started, [target], services.proc_start_time) == []
        assert (target / "cgroup.procs").read_text() == f"{proc.pid}\n"
    finally:
        proc.kill()
        proc.wait()
    assert jobcgroup.join_service(proc.pid, started, [target], services.proc_start_time) == [
        f"pid {proc.pid} has ended"]


def test_a_shelter_someone_else_made_first_is_not_used(tmp_path: Path) -> None:
    ours = tmp_path / "ours"
    assert jobcgroup.make_shelter(ours) is None and ours.is_dir()
    assert jobcgroup.make_shelter(ours) is None  # there already, and root's

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    assert "is not root's (uid 65534)" in jobcgroup.make_shelter(theirs)
    assert "cannot make" in jobcgroup.make_shelter(tmp_path / "missing" / "deeper")


def test_the_extern_step_of_each_target_is_noted_and_only_this_jobs_cgroupfs_folders_are_read(
        tmp_path: Path) -> None:
    extern = Path("/sys/fs/cgroup/freezer/slurm_n1/uid_1000/job_57/step_extern")
    v2 = Path("/sys/fs/cgroup/unified/x/job_57/step_extern")
    jobcgroup.note_externs(tmp_path, [extern / jobcgroup.SHELTER, extern], 57)
    jobcgroup.note_externs(tmp_path, [v2 / "user" / "task_special"], 57)  # a later tree's: added
    note = tmp_path / jobcgroup.NOTE
    assert note.stat().st_mode & 0o777 == 0o600
    assert jobcgroup.noted_externs(tmp_path, 57) == [extern, v2]
    assert jobcgroup.noted_externs(tmp_path, 58) == []

    note.write_text('["/home/jobuser/job_57/step_extern", "/sys/fs/cgroup/../../etc/job_57/step_extern", 7, '
                    '"/sys/fs/cgroup/freezer/slurm_n1/uid_1000/job_56/step_extern/job_57/step_extern"]')
    assert jobcgroup.noted_externs(tmp_path, 57) == []
    note.write_text("not json")
    assert jobcgroup.noted_externs(tmp_path, 57) == []


FREEZER = Path("/sys/fs/cgroup/freezer")


@pytest.mark.skipif(not (FREEZER / "cgroup.procs").exists() or os.geteuid() != 0,
                    reason="needs root and a cgroup v1 freezer hierarchy")
def test_the_sweep_ends_frozen_and_running_processes_below_the_extern_step_and_removes_the_folders() -> None:
    """As the Epilog finds it: the tree in its shelter, and a process the job's user froze in a
    cgroup of their own; both end, and the job's folders go, as Slurm would have removed them."""
    job = FREEZER / f"singularity-unit-{os.getpid()}" / "job_99999"
    extern = job / "step_extern"
    user_made = extern / "mine"
    deeper = user_made / "job_99998" / "step_0"  # named like another job's step, and frozen itself
    shelter = extern / jobcgroup.SHELTER
    procs = []
    try:
        for folder in (shelter, user_made, deeper):
            folder.mkdir(parents=True, exist_ok=True)
        for folder in (shelter, user_made, deeper):
            proc = subprocess.Popen(["sleep", "60"])
            procs.append(proc)
            (folder / "cgroup.procs").write_text(f"{proc.pid}\n")
        (deeper / "freezer.state").write_text("FROZEN")
        (user_made / "freezer.state").write_text("FROZEN")
        bystander = subprocess.Popen(["sleep", "60"])
        procs.append(bystander)

        swept = jobcgroup.end_below_extern([extern], timeout=10)

        assert sorted(swept.ended) == sorted(p.pid for p in procs[:3]) and swept.left == []
        assert swept.kept == []
        assert [p.wait(timeout=10) for p in procs[:3]] == [-9, -9, -9]
        assert bystander.poll() is None
        assert not job.exists()  # the extern step and job folders too, now that they are empty
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        for folder in (deeper, deeper.parent, user_made, shelter, extern, job, job.parent):
            try:
                folder.rmdir()
            except OSError:
                pass


def _freezer_root() -> Path | None:
    """A cgroup hierarchy this test may make a cgroup in (as root): v1's freezer, or v2's."""
    if os.geteuid() != 0:
        return None
    if Path("/sys/fs/cgroup/freezer/tasks").exists():
        return Path("/sys/fs/cgroup/freezer")
    if Path("/sys/fs/cgroup/cgroup.controllers").exists():
        return Path("/sys/fs/cgroup")
    return None


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


@pytest.mark.skipif(_freezer_root() is None, reason="needs root and a cgroup freezer")
def test_a_frozen_shelter_stops_its_tree_until_it_is_thawed() -> None:
    root = _freezer_root()
    assert root is not None
    cgroup = root / f"singularity-test-{os.getpid()}" / jobcgroup.SHELTER
    cgroup.mkdir(parents=True)
    busy = subprocess.Popen(["python3", "-c", "while True: pass"])
    try:
        (cgroup / "cgroup.procs").write_text(f"{busy.pid}\n")
        assert jobcgroup.freezable([cgroup.parent, cgroup]) == [cgroup]
        with jobcgroup.frozen([cgroup]) as froze:
            assert froze == [cgroup]
            time.sleep(0.3)  # the freezer's work is asynchronous: let it finish
            ticks = _cpu_ticks(busy.pid)
            time.sleep(0.5)
            assert _cpu_ticks(busy.pid) == ticks, "the frozen tree ran"
        ticks = _cpu_ticks(busy.pid)
        deadline = time.monotonic() + 10
        while _cpu_ticks(busy.pid) == ticks:
            assert time.monotonic() < deadline, "the thawed tree does not run"
            time.sleep(0.05)
    finally:
        busy.kill()
        busy.wait()
        cgroup.rmdir()
        cgroup.parent.rmdir()


def test_a_cgroup_without_a_freezer_is_left_running_and_one_that_stays_frozen_fails(tmp_path: Path) -> None:
    plain = tmp_path / "plain" / jobcgroup.SHELTER
    plain.mkdir(parents=True)
    with jobcgroup.frozen([plain]) as froze:
        assert froze == []
    stuck = tmp_path / "stuck" / jobcgroup.SHELTER
    stuck.mkdir(parents=True)
    (stuck / "freezer.state").write_text("THAWED\n")
    with pytest.raises(jobcgroup.ThawFailed, match="cannot be thawed"):
        with jobcgroup.frozen([stuck]) as froze:
            assert froze == [stuck]
            assert (stuck / "freezer.state").read_text().strip() == "FROZEN"
            (stuck / "freezer.state").unlink()
            (stuck / "freezer.state").mkdir()  # a thaw that cannot be written


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the shelter must be root's")
def test_a_shelter_is_frozen_only_if_roots_and_thawed_through_the_folder_it_froze(tmp_path: Path) -> None:
    # the job's user owns the extern step (cgroup v1): it may make a `singularity` of its own there,
    # or rename root's and make one in its place while the tree waits
    theirs = tmp_path / "theirs" / jobcgroup.SHELTER
    theirs.mkdir(parents=True)
    (theirs / "freezer.state").write_text("THAWED")
    os.chown(theirs, 1001, 1001)
    with jobcgroup.frozen([theirs]) as froze:
        assert froze == []
    assert (theirs / "freezer.state").read_text() == "THAWED"

    shelter = tmp_path / "extern" / jobcgroup.SHELTER
    shelter.mkdir(parents=True)
    (shelter / "freezer.state").write_text("THAWED")
    with jobcgroup.frozen([shelter]) as froze:
        assert froze == [shelter]
        shelter.rename(shelter.with_name("moved"))
        shelter.mkdir()
        (shelter / "freezer.state").write_text("THAWED")  # what a read-back by path would find
    assert (shelter.with_name("moved") / "freezer.state").read_text() == "THAWED"
