"""The file-log shim, compiled for real and preloaded into real child processes, and its Python reader.

Each shim test runs a Python or C child with the variables `env_for` produces, node-local prefixes
pointing into the test's own folder (so nothing depends on the host's /tmp), then checks the exact
lines the shim appended to the log.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import pytest

from singularity_slurm.errors import ConfigError, ServiceError
from singularity_slurm.interpose.filelog import (
    DEFAULT_LOCAL_PATHS,
    SHIM_LIBRARY,
    SHIM_SOURCE,
    build_shim,
    env_for,
    existing_files,
    is_under,
    parse_log,
    read_log,
)

CC = shutil.which("cc")
SOURCE = Path(__file__).parents[2] / "interpose/csrc/singularity_filelog.c"
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler `cc` (Debian: apt-get install gcc): "
                                                  "the shim is not built nor run")


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_shim(tmp_path_factory.mktemp("shim") / SHIM_LIBRARY, source=SOURCE)


@dataclass
class Job:
    """A job's view of the disk: two node-local prefixes, a shared folder, and the log outside them all."""

    root: Path
    shim: Path

    @property
    def local(self) -> Path:
        return self.root / "local"

    @property
    def scratch(self) -> Path:
        return self.root / "scratch"

    @property
    def shared(self) -> Path:
        return self.root / "shared"

    @property
    def log(self) -> Path:
        return self.root / "logs" / "files.log"

    def env(self, **overrides: str | None) -> dict[str, str]:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONDONTWRITEBYTECODE": "1"}
        env.update(env_for(self.shim, self.log, [str(self.local), str(self.scratch)]))
        for name, value in overrides.items():
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value
        return env

    def run(self, argv: list[str], env: dict[str, str] | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(argv, env=self.env() if env is None else env, cwd=cwd or self.root,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc

    def python(self, code: str, *args: str, env: dict[str, str] | None = None,
               cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        return self.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], env, cwd)

    def lines(self) -> list[str]:
        """The log exactly as written, repeats included."""
        return self.log.read_text().splitlines()


@pytest.fixture
def job(shim: Path, tmp_path: Path) -> Job:
    # The shim names files lexically from getcwd(), which has no symlinks: compare with the same.
    job = Job(Path(os.path.realpath(tmp_path)), shim)
    for folder in (job.local, job.scratch, job.shared, job.log.parent):
        folder.mkdir()
    return job


# --- what a Python program writes -----------------------------------------------------------------


@needs_cc
def test_python_writes_under_local_prefixes_are_logged_with_absolute_paths(job: Job) -> None:
    job.python("""
        import os, sys
        local, scratch = sys.argv[1:]
        with open(os.path.join(local, "a.txt"), "w") as f:
            f.write("a")
        os.close(os.open(os.path.join(local, "b.bin"), os.O_CREAT | os.O_WRONLY, 0o644))
        with open(os.path.join(local, "a.txt"), "a") as f:
            f.write("more")
        os.mkdir(os.path.join(local, "sub"))
        os.chdir(os.path.join(local, "sub"))
        with open("../sub/./c.txt", "w") as f:
            f.write("c")
        dirfd = os.open(scratch, os.O_RDONLY | os.O_DIRECTORY)
        os.close(os.open("d.txt", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=dirfd))
        os.close(os.open("e.txt", os.O_CREAT | os.O_RDWR, 0o600, dir_fd=dirfd))
    """, job.local, job.scratch)

    assert job.lines() == [
        f"{job.local}/a.txt",
        f"{job.local}/b.bin",
        f"{job.local}/a.txt",
        f"{job.local}/sub/c.txt",
        f"{job.scratch}/d.txt",
        f"{job.scratch}/e.txt",
    ]


@needs_cc
def test_reads_and_writes_outside_the_local_prefixes_are_not_logged(job: Job) -> None:
    (job.local / "input.txt").write_text("data")

    job.python("""
        import os, sys
        local, shared = sys.argv[1:]
        with open(os.path.join(local, "input.txt")) as f:
            f.read()
        os.close(os.open(os.path.join(local, "input.txt"), os.O_RDONLY))
        os.close(os.open(local, os.O_RDONLY | os.O_DIRECTORY))
        with open(os.path.join(shared, "out.txt"), "w") as f:
            f.write("shared")
        os.chdir(shared)
        with open("rel.txt", "w") as f:
            f.write("shared")
    """, job.local, job.shared)

    assert not job.log.exists()


@needs_cc
def test_a_prefix_matches_on_a_path_component_boundary_only(job: Job) -> None:
    tmp = job.root / "tmp"
    for name in ("tmp", "tmpfoo", "tmp-old"):
        (job.root / name).mkdir()
    env = job.env(SINGULARITY_LOCAL_PATHS=f"{tmp}/:relative/dir::")

    job.python("""
        import sys
        root = sys.argv[1]
        for name in ("tmpfoo/x", "tmp-old/x", "tmp/x", "tmp"):
            try:
                open(f"{root}/{name}", "w").close()
            except IsADirectoryError:
                pass
    """, job.root, env=env)

    assert job.lines() == [f"{tmp}/x"]


@needs_cc
def test_writes_of_a_forked_child_and_of_threads_are_logged_whole(job: Job) -> None:
    job.python("""
        import os, sys, threading
        local = sys.argv[1]
        open(f"{local}/parent-before", "w").close()
        pid = os.fork()
        if pid == 0:
            open(f"{local}/child", "w").close()
            os._exit(0)
        os.waitpid(pid, 0)
        open(f"{local}/parent-after", "w").close()

        def write(t):
            for i in range(50):
                open(f"{local}/thread-{t}-{i}", "w").close()
        threads = [threading.Thread(target=write, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    """, job.local)

    lines = job.lines()
    assert lines[:3] == [f"{job.local}/parent-before", f"{job.local}/child", f"{job.local}/parent-after"]
    assert sorted(lines[3:]) == sorted(f"{job.local}/thread-{t}-{i}" for t in range(8) for i in range(50))


@needs_cc
def test_the_renamed_name_is_logged(job: Job) -> None:
    job.python("""
        import os, sys
        local, shared = sys.argv[1:]
        with open(f"{local}/model.pt.tmp", "w") as f:
            f.write("weights")
        os.replace(f"{local}/model.pt.tmp", f"{local}/model.pt")
        with open(f"{shared}/moved", "w") as f:
            f.write("x")
        os.rename(f"{shared}/moved", f"{local}/moved")
    """, job.local, job.shared)

    assert job.lines() == [f"{job.local}/model.pt.tmp", f"{job.local}/model.pt", f"{job.local}/moved"]


@needs_cc
def test_unnamed_files_and_names_with_newlines_are_not_logged(job: Job) -> None:
    job.python("""
        import os, sys
        local = sys.argv[1]
        try:
            os.close(os.open(local, os.O_TMPFILE | os.O_WRONLY, 0o600))
        except OSError:
            pass  # a filesystem without O_TMPFILE: nothing to check
        os.makedirs(f"{local}/x\\n/etc")
        open(f"{local}/x\\n/etc/shadow", "w").close()
        open(f"{local}/plain", "w").close()
    """, job.local)

    assert job.lines() == [f"{job.local}/plain"]


@needs_cc
def test_the_log_itself_is_never_logged(job: Job) -> None:
    log = job.local / "files.log"
    env = job.env(SINGULARITY_FILELOG=str(log))

    job.python("""
        import sys
        local = sys.argv[1]
        open(f"{local}/data", "w").close()
        open(f"{local}//./files.log", "a").close()
    """, job.local, env=env)

    assert log.read_text().splitlines() == [f"{job.local}/data"]


@needs_cc
def test_a_log_descriptor_reused_by_the_program_is_not_written_to(job: Job) -> None:
    # Daemons and close-everything-after-fork code close descriptors they do not own, then get the
    # same number back for a file of theirs; a log line there would corrupt it.
    job.python("""
        import os, sys
        local, shared, log = sys.argv[1:]
        open(f"{local}/first", "w").close()
        [held] = [fd for fd in map(int, os.listdir("/proc/self/fd"))
                  if os.path.realpath(f"/proc/self/fd/{fd}") == log]
        mine = os.open(f"{shared}/mine", os.O_CREAT | os.O_WRONLY, 0o600)
        os.dup2(mine, held)
        os.close(mine)
        open(f"{local}/second", "w").close()
        open(f"{local}/third", "w").close()
        os.write(held, b"mine")
    """, job.local, job.shared, job.log)

    assert (job.shared / "mine").read_bytes() == b"mine"
    assert job.lines() == [f"{job.local}/first", f"{job.local}/second", f"{job.local}/third"]


@needs_cc
def test_without_a_log_variable_the_shim_only_forwards_calls(job: Job) -> None:
    proc = job.python("""
        import os, sys
        path = os.path.join(sys.argv[1], "a.txt")
        with open(path, "w") as f:
            f.write("hello")
        with open(path) as f:
            print(f.read())
    """, job.local, env=job.env(SINGULARITY_FILELOG=None))

    assert proc.stdout == "hello\n"
    assert list(job.root.rglob("*.log")) == []


@needs_cc
def test_a_relative_log_variable_disables_the_shim(job: Job) -> None:
    job.python("""
        import sys
        open(sys.argv[1] + "/a.txt", "w").close()
    """, job.local, env=job.env(SINGULARITY_FILELOG="files.log"), cwd=job.local)

    assert sorted(p.name for p in job.local.iterdir()) == ["a.txt"]


@needs_cc
def test_a_failed_open_keeps_its_errno_and_is_not_logged(job: Job) -> None:
    proc = job.python("""
        import errno, os, sys
        try:
            os.open("/nonexistent-singularity-dir/x", os.O_CREAT | os.O_WRONLY, 0o600)
        except OSError as exc:
            print(errno.errorcode[exc.errno])
        try:
            open(os.path.join(sys.argv[1], "missing", "x"), "w")
        except OSError as exc:
            print(errno.errorcode[exc.errno])
    """, job.local)

    assert proc.stdout.split() == ["ENOENT", "ENOENT"]
    assert not job.log.exists()


# --- what a C program writes ----------------------------------------------------------------------

C_PROGRAM = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char *in(const char *dir, const char *name)
{
	static char bufs[4][4096];
	static int next;
	char *p = bufs[next++ % 4];
	snprintf(p, 4096, "%s/%s", dir, name);
	return p;
}

int main(int argc, char **argv)
{
	const char *dir = argv[2];
	volatile int wronly = O_WRONLY; /* not a constant: fortified builds call __open_2 and __openat_2 */
	char tmpl[4096];
	FILE *f;
	int fd;
	if (argc != 3)
		return 64;
	if (strcmp(argv[1], "calls") == 0) {
		f = fopen(in(dir, "appended.log"), "a");
		fputs("x", f);
		fclose(f);
		close(creat(in(dir, "created.bin"), 0600));
		fclose(fopen(in(dir, "appended.log"), "r"));
		fclose(fopen(in(dir, "created.bin"), "r+"));
		f = freopen(NULL, "a", fopen(in(dir, "reopened"), "w"));
		fclose(f);
		f = freopen(in(dir, "stdout.txt"), "w", stdout);
		fd = open(in(dir, "created.bin"), wronly);
		close(fd);
		fd = open(dir, O_RDONLY | O_DIRECTORY);
		close(openat(fd, "created.bin", wronly));
		close(openat(fd, "at.txt", O_WRONLY | O_CREAT | O_EXCL, 0600));
		close(fd);
		snprintf(tmpl, sizeof(tmpl), "%s/tmpXXXXXX", dir);
		close(mkstemp(tmpl));
		rename(in(dir, "at.txt"), in(dir, "renamed.txt"));
		fprintf(stderr, "%s\n", tmpl);
		return 0;
	}
	if (strcmp(argv[1], "errno") == 0) {
		fd = open("/nonexistent-singularity-dir/x", O_WRONLY | O_CREAT, 0600);
		if (fd != -1 || errno != ENOENT)
			return 2;
		if (fopen("/nonexistent-singularity-dir/x", "w") || errno != ENOENT)
			return 3;
		if (chdir(dir) != 0)
			return 4;
		errno = EXDEV; /* logging (getcwd, open, write) must not leave its own errno behind */
		fd = open("kept.txt", O_WRONLY | O_CREAT, 0600);
		if (fd < 0 || errno != EXDEV)
			return 5;
		puts("ok");
		return 0;
	}
	return 64;
}
"""

C_BUILDS = {
    "plain": [],
    "large-file": ["-D_FILE_OFFSET_BITS=64"],  # open64, fopen64, creat64, mkstemp64, ...
    "fortified": ["-O2", "-D_FORTIFY_SOURCE=2"],  # __open_2, __openat_2
    "fortified-large-file": ["-O2", "-D_FORTIFY_SOURCE=2", "-D_FILE_OFFSET_BITS=64"],  # __open64_2, ...
}


@pytest.fixture(params=list(C_BUILDS))
def c_program(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("cprog")
    (folder / "prog.c").write_text(C_PROGRAM)
    proc = subprocess.run([CC or "cc", *C_BUILDS[request.param], "-Wall", "-o", str(folder / "prog"),
                           str(folder / "prog.c")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return folder / "prog"


@needs_cc
def test_a_c_program_s_stdio_creat_openat_mkstemp_and_rename_are_logged(job: Job, c_program: Path) -> None:
    proc = job.run([str(c_program), "calls", str(job.local)])

    temp = proc.stderr.strip()
    assert temp.startswith(f"{job.local}/tmp")
    assert job.lines() == [
        f"{job.local}/appended.log",
        f"{job.local}/created.bin",
        f"{job.local}/created.bin",  # r+
        f"{job.local}/reopened",  # fopen "w"
        f"{job.local}/reopened",  # freopen(NULL, "a"): named by its descriptor
        f"{job.local}/stdout.txt",
        f"{job.local}/created.bin",  # open without a mode
        f"{job.local}/created.bin",  # openat without a mode
        f"{job.local}/at.txt",
        temp,
        f"{job.local}/renamed.txt",
    ]


@needs_cc
def test_a_c_program_sees_the_errno_of_the_real_call(job: Job, c_program: Path) -> None:
    proc = job.run([str(c_program), "errno", str(job.local)])

    assert proc.stdout == "ok\n"
    assert job.lines() == [f"{job.local}/kept.txt"]


@needs_cc
def test_a_log_that_cannot_be_written_is_invisible_to_the_program(job: Job, c_program: Path) -> None:
    env = job.env(SINGULARITY_FILELOG=str(job.root / "missing" / "files.log"))

    proc = job.run([str(c_program), "errno", str(job.local)], env=env)

    assert proc.stdout == "ok\n"  # errno still EXDEV although the shim's own open failed with ENOENT
    assert not (job.root / "missing").exists()


# --- building ---------------------------------------------------------------------------------------


@needs_cc
def test_the_shim_compiles_without_warnings(tmp_path: Path) -> None:
    proc = subprocess.run([CC or "cc", "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror",
                           "-o", str(tmp_path / "x.so"), str(SOURCE), "-ldl"], capture_output=True, text=True)

    assert (proc.returncode, proc.stderr) == (0, "")


@needs_cc
def test_build_shim_reports_the_compiler_s_complaint_and_leaves_nothing(tmp_path: Path) -> None:
    broken = tmp_path / "broken.c"
    broken.write_text("int f(void) { return }\n")
    output = tmp_path / "lib" / SHIM_LIBRARY

    with pytest.raises(ServiceError, match=r"(?s)building the file-log shim .* failed .*error"):
        build_shim(output, source=broken)
    assert list(output.parent.iterdir()) == []


def test_build_shim_with_a_missing_compiler_says_what_to_install(tmp_path: Path) -> None:
    with pytest.raises(ServiceError, match="no-such-cc.*apt-get install gcc"):
        build_shim(tmp_path / SHIM_LIBRARY, compiler="no-such-cc", source=SOURCE)


@needs_cc
@pytest.mark.skipif(not resources.files("singularity_slurm.interpose").joinpath("csrc", SHIM_SOURCE)
                    .is_file(), reason="the shim's source is not installed as package data yet")
def test_build_shim_compiles_the_packaged_source(tmp_path: Path) -> None:
    output = build_shim(tmp_path / SHIM_LIBRARY)

    assert output == tmp_path / SHIM_LIBRARY
    assert os.access(output, os.X_OK)


# --- reading the log --------------------------------------------------------------------------------


def test_parse_log_keeps_unique_paths_in_first_seen_order() -> None:
    data = b"/tmp/b\n/tmp/a\n/tmp/b\n/var/tmp/c\n/tmp/a\n"

    assert parse_log(data) == ["/tmp/b", "/tmp/a", "/var/tmp/c"]


def test_parse_log_drops_blank_relative_malformed_and_cut_short_lines() -> None:
    data = (b"\n"
            b"relative/x\n"
            b"/tmp/ok\n"
            b"/tmp/../etc/shadow\n"
            b"/tmp/./x\n"
            b"/tmp//x\n"
            b"/tmp/dir/\n"
            b"/tmp/nul\x00byte\n"
            b"   \n"
            b"/tmp/cut-sh")

    assert parse_log(data) == ["/tmp/ok"]


def test_parse_log_keeps_names_that_are_not_utf8_as_the_os_spells_them() -> None:
    [path] = parse_log(b"/tmp/caf\xe9\n")

    assert os.fsencode(path) == b"/tmp/caf\xe9"


def test_parse_log_with_local_paths_keeps_only_paths_under_them() -> None:
    data = b"/tmp/a\n/etc/shadow\n/tmpfoo/b\n/scratch/job/c\n/tmp\n"

    assert parse_log(data, ["/tmp", "/scratch/job/"]) == ["/tmp/a", "/scratch/job/c", "/tmp"]


def test_read_log_of_a_job_that_never_wrote_one_is_empty(tmp_path: Path) -> None:
    assert read_log(tmp_path / "missing.log") == []


def test_read_log_reads_the_file(tmp_path: Path) -> None:
    log = tmp_path / "files.log"
    log.write_bytes(b"/tmp/a\n/tmp/a\n/home/x\n")

    assert read_log(log) == ["/tmp/a", "/home/x"]
    assert read_log(log, DEFAULT_LOCAL_PATHS) == ["/tmp/a"]


@pytest.mark.parametrize(("path", "prefix", "under"), [
    ("/tmp", "/tmp", True),
    ("/tmp/x", "/tmp", True),
    ("/tmp/x", "/tmp/", True),
    ("/tmpfoo", "/tmp", False),
    ("/tmp-old/x", "/tmp", False),
    ("/anything", "/", True),
])
def test_is_under_decides_on_component_boundaries(path: str, prefix: str, under: bool) -> None:
    assert is_under(path, prefix) is under


def test_existing_files_keeps_only_regular_files_not_following_symlinks(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "file")
    (tmp_path / "fifo").parent.mkdir(exist_ok=True)
    os.mkfifo(tmp_path / "fifo")
    names = ["file", "dir", "link", "fifo", "missing", "file/under-a-file"]

    found = existing_files([f"{tmp_path}/{name}" for name in names] + ["/tmp/nul\x00byte"])

    assert found == [tmp_path / "file"]


def test_existing_files_with_an_owner_keeps_only_that_owner_s_files(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    mine = os.stat(tmp_path / "file").st_uid

    assert existing_files([tmp_path / "file"], owner=mine) == [tmp_path / "file"]
    assert existing_files([tmp_path / "file"], owner=mine + 1) == []


# --- the job's environment --------------------------------------------------------------------------


def test_env_for_sets_the_preload_the_log_and_the_default_prefixes() -> None:
    env = env_for(Path("/opt/s/lib/singularity_filelog.so"), Path("/var/lib/s/job-7/files.log"))

    assert env == {
        "LD_PRELOAD": "/opt/s/lib/singularity_filelog.so",
        "SINGULARITY_FILELOG": "/var/lib/s/job-7/files.log",
        "SINGULARITY_LOCAL_PATHS": "/tmp:/var/tmp:/dev/shm",
    }


def test_env_for_appends_to_the_job_s_own_preload_once() -> None:
    shim = Path("/opt/s/lib/singularity_filelog.so")

    appended = env_for(shim, Path("/l"), ld_preload="/usr/lib/libjemalloc.so /opt/x.so")
    again = env_for(shim, Path("/l"), ld_preload=appended["LD_PRELOAD"])

    assert appended["LD_PRELOAD"] == "/usr/lib/libjemalloc.so:/opt/x.so:/opt/s/lib/singularity_filelog.so"
    assert again["LD_PRELOAD"] == appended["LD_PRELOAD"]


def test_env_for_makes_paths_absolute_and_takes_custom_prefixes(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)

    env = env_for(Path("lib/shim.so"), Path("files.log"), ["/scratch/job-7", "/tmp"])

    assert env["LD_PRELOAD"] == f"{os.getcwd()}/lib/shim.so"
    assert env["SINGULARITY_FILELOG"] == f"{os.getcwd()}/files.log"
    assert env["SINGULARITY_LOCAL_PATHS"] == "/scratch/job-7:/tmp"


def test_env_for_with_no_prefixes_logs_nothing() -> None:
    assert env_for(Path("/s.so"), Path("/l"), [])["SINGULARITY_LOCAL_PATHS"] == ""


@pytest.mark.parametrize("prefix", ["relative", "/a:b", "/with space", "/new\nline"])
def test_env_for_rejects_prefixes_the_variable_cannot_carry(prefix: str) -> None:
    with pytest.raises(ConfigError, match="node-local path"):
        env_for(Path("/s.so"), Path("/l"), [prefix])


def test_env_for_rejects_a_shim_path_ld_preload_would_split() -> None:
    with pytest.raises(ConfigError, match="shim library '/opt/my lib/s.so'"):
        env_for(Path("/opt/my lib/s.so"), Path("/l"))
