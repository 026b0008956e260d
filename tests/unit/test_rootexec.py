"""What root runs: absolute system programs, a clean environment, and the job's environment handed to
the user's side through a descriptor, never through argv."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from singularity_slurm import rootexec
from singularity_slurm.checkpoint.criu import wrapper_script
from singularity_slurm.node import jobtree
from singularity_slurm.rootexec import (
    BadEnvironment,
    UnsafeProgram,
    clean_env,
    decode_env,
    encode_env,
    service_env,
    system_program,
)

# --- clean environments ---------------------------------------------------------------------------


def test_clean_env_is_a_system_path_and_the_c_locale_only() -> None:
    assert clean_env() == {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}


def test_service_env_keeps_roots_settings_and_drops_everything_else() -> None:
    parent = {"PATH": "/home/mallory/bin", "LD_PRELOAD": "/tmp/evil.so", "PYTHONPATH": "/tmp",
              "SINGULARITY_CONFIG": "/etc/site.toml", "SINGULARITY_LOG_DIR": ""}

    assert service_env(parent) == {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C",
                                   "SINGULARITY_CONFIG": "/etc/site.toml"}


# --- finding programs -----------------------------------------------------------------------------


def test_a_program_is_taken_from_the_first_system_folder_holding_a_trusted_copy() -> None:
    trusted = {"/usr/bin/unshare", "/bin/unshare"}

    assert system_program("unshare", trusted=trusted.__contains__) == "/usr/bin/unshare"


def test_path_is_never_consulted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    trojan = tmp_path / "unshare"
    trojan.write_text("#!/bin/sh\n")
    trojan.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))

    assert system_program("unshare") == "/usr/bin/unshare"


@pytest.mark.parametrize("name", ["../unshare", "/tmp/unshare", "", ".", ".."])
def test_only_plain_names_are_looked_up(name: str) -> None:
    with pytest.raises(UnsafeProgram, match="is not a program name"):
        system_program(name, trusted=lambda path: True)


def test_a_missing_or_untrusted_program_is_refused_with_the_folders_named() -> None:
    with pytest.raises(UnsafeProgram, match=r"unshare not found .* /usr/sbin:/usr/bin:/sbin:/bin"):
        system_program("unshare", trusted=lambda path: False)


def test_a_program_others_may_change_is_not_trusted(tmp_path: Path) -> None:
    program = tmp_path / "tool"
    program.write_text("#!/bin/sh\n")
    program.chmod(0o777)

    assert rootexec._root_owned_file(str(program)) is False
    assert rootexec._root_owned_file("/usr/bin/env") is True
    assert rootexec._root_owned_file("/usr/bin") is False


# --- the job's environment ------------------------------------------------------------------------


def test_environment_round_trips_through_its_encoding() -> None:
    env = {"A": "1", "EMPTY": "", "EQ": "x=y=z", "NL": "two\nlines", "UTF": "é", "RAW": "\udcff"}

    assert encode_env({"A": "1", "B": "x=y"}) == b"A=1\0B=x=y\0"
    assert decode_env(encode_env(env)) == env


@pytest.mark.parametrize("env", [{"A=B": "1"}, {"": "1"}, {"A\0": "1"}, {"A": "1\0"}, {"A": 1}])
def test_what_execve_cannot_carry_is_refused(env: dict) -> None:
    with pytest.raises(BadEnvironment):
        encode_env(env)


def run_user_exec(env: dict[str, str], program: list[str]) -> subprocess.CompletedProcess[str]:
    fd = rootexec.env_memfd(env)
    try:
        return subprocess.run([sys.executable, "-I", "-S", "-c", rootexec.USER_EXEC, str(fd), *program],
                              pass_fds=(fd,), env={"PATH": "/usr/bin:/bin", "KEPT": "no"},
                              capture_output=True, text=True, timeout=30)
    finally:
        os.close(fd)


def test_user_exec_becomes_the_program_with_exactly_the_jobs_environment() -> None:
    env = {"PATH": "/opt/job/bin:/usr/bin", "LD_PRELOAD": "", "X": "a=b c", "NL": "1\n2"}

    proc = run_user_exec(env, ["/usr/bin/env", "-0"])

    assert proc.returncode == 0, proc.stderr
    assert decode_env(proc.stdout.encode()) == env


def test_user_exec_leaves_no_descriptor_open_in_the_program() -> None:
    proc = run_user_exec({"A": "1"}, ["/bin/sh", "-c", "ls /proc/self/fd"])

    assert proc.returncode == 0, proc.stderr
    assert sorted(int(fd) for fd in proc.stdout.split()) == [0, 1, 2, 3]  # 3: ls's own directory


# --- the job's tree -------------------------------------------------------------------------------

PROGRAMS = jobtree.Programs(unshare="/usr/bin/unshare", setsid="/usr/bin/setsid", mount="/usr/bin/mount",
                            setpriv="/usr/bin/setpriv", shell="/bin/sh", python="/opt/venv/bin/python")


def test_the_tree_is_started_by_absolute_paths_and_its_argv_holds_no_environment() -> None:
    spec = jobtree.TreeSpec(["python", "train.py"], 1001, 1001, "/home/u", "/home/u/out",
                            {"SECRET_TOKEN": "hunter2", "LD_PRELOAD": "/home/u/x.so"})

    argv = jobtree.spawn_argv(spec, PROGRAMS, 9)

    assert argv[0] == "/usr/bin/unshare"
    assert argv[argv.index("--") + 1:argv.index("--") + 3] == ["/usr/bin/setsid", "/bin/sh"]
    assert {"/usr/bin/mount", "/usr/bin/setpriv", "/opt/venv/bin/python", "9"} <= set(argv)
    assert not any("hunter2" in a or "x.so" in a for a in argv)
    assert argv[-2:] == ["python", "train.py"]


def test_programs_are_found_in_the_system_folders() -> None:
    programs = jobtree.Programs.find()

    assert all(os.path.isabs(p) for p in (programs.unshare, programs.setsid, programs.mount,
                                           programs.setpriv, programs.shell))


STATUS = "Name:\tsh\nUid:\t1001\t1001\t1001\t1001\nGid:\t1001\t1001\t1001\t1001\n"


def test_the_init_counts_as_started_only_once_it_is_the_users_shell() -> None:
    shell = os.path.realpath("/bin/sh")

    assert jobtree.is_user_shell(STATUS, shell, 1001, "/bin/sh") is True
    assert jobtree.is_user_shell(STATUS, "/usr/bin/python3.11", 1001, "/bin/sh") is False  # env step
    assert jobtree.is_user_shell(STATUS, "/usr/bin/setpriv", 1001, "/bin/sh") is False
    assert jobtree.is_user_shell(STATUS.replace("1001", "0"), shell, 1001, "/bin/sh") is False  # root's sh
    assert jobtree.is_user_shell("Name:\tsh\n", shell, 1001, "/bin/sh") is False


# --- criu ------------------------------------------------------------------------------------------


def test_criu_runs_with_exactly_the_shim_preloaded_whatever_its_callers_environment(tmp_path: Path) -> None:
    fake_criu = tmp_path / "criu"
    fake_criu.write_text("#!/bin/sh\nenv\necho \"args: $*\"\n")
    fake_criu.chmod(0o755)
    wrapper = tmp_path / "singularity-criu"
    wrapper.write_text(wrapper_script(Path("/opt/s/lib/criu_prlimit.so"), fake_criu))
    wrapper.chmod(0o755)

    proc = subprocess.run([str(wrapper), "swrk", "3"], capture_output=True, text=True, check=True,
                          env={"LD_PRELOAD": "/home/mallory/evil.so", "PATH": "/home/mallory/bin:/usr/bin"})

    assert sorted(proc.stdout.splitlines()) == sorted([
        "PATH=/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL=C", "LD_PRELOAD=/opt/s/lib/criu_prlimit.so",
        "PWD=" + os.getcwd(), "args: swrk 3"])


def _fake_criu(tmp_path: Path, knows: tuple[str, ...]) -> Path:
    """A criu that answers --version only after options it knows (as criu's getopt does)."""
    binary = tmp_path / "criu"
    cases = "".join(f"    --{option}) ;;\n" for option in knows)
    binary.write_text("#!/bin/sh\nfor a in \"$@\"; do\n  case \"$a\" in\n"
                      "    --version) echo 'Version: 4.1.1'; exit 0 ;;\n"
                      f"{cases}    *) echo \"criu: unrecognized option '$a'\" >&2; exit 1 ;;\n"
                      "  esac\ndone\n")
    binary.chmod(0o755)
    return binary


def test_the_patched_options_are_used_where_the_criu_knows_them(tmp_path: Path) -> None:
    from singularity_slurm.checkpoint.criu import Criu

    patched = Criu(_fake_criu(tmp_path, ("share-cow", "track-writes", "track-incremental")))
    assert patched.share_cow and patched.tracks_writes
    (tmp_path / "stock").mkdir()
    stock = Criu(_fake_criu(tmp_path / "stock", ()))
    assert not stock.share_cow and not stock.tracks_writes


def test_a_tracked_dump_with_a_criu_that_cannot_track_is_refused_before_criu_runs(tmp_path: Path) -> None:
    from singularity_slurm.checkpoint.criu import Criu
    from singularity_slurm.errors import CheckpointError

    stock = Criu(_fake_criu(tmp_path, ()))
    with pytest.raises(CheckpointError, match="without the track-writes patch"):
        stock.dump(1, tmp_path / "images", leave_running=True, arm=True)
    assert not (tmp_path / "images").exists()
