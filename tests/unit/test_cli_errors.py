"""Whatever goes wrong between the CLI and a node agent, the user reads one line that names it."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from singularity_slurm.errors import SingularityError
from singularity_slurm.slurm_plugin.cli import _Commands, main

JOB, NODE = 4242, "n7"


@pytest.fixture
def in_a_step(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[Path, Path]:
    """A launcher step's environment; the configuration's state folder is under tmp_path.
    Returns (config file, where the job's agent socket would be)."""
    state = tmp_path / "state"
    config = tmp_path / "config.toml"
    config.write_text(f'[paths]\nstate_dir = "{state}"\n')
    for var in ("SINGULARITY_LAUNCHER_FRONT", "SINGULARITY_LAUNCHER_OUTPUT", "SLURM_JOB_NODELIST",
                "SINGULARITY_WORLD_SIZE", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES", "PYTHON_EXEC"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", str(JOB))
    monkeypatch.setenv("SLURMD_NODENAME", NODE)
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setattr("singularity_slurm.slurm_plugin.launcher.SlurmClient.job", lambda self, job: None)
    run_dir = state / NODE / str(JOB)
    run_dir.mkdir(parents=True)
    return config, run_dir / "agent.sock"


def fake_agent(path: Path, answer: Callable[[socket.socket], None]) -> Iterator[None]:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(4)

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(1 << 16)
                answer(conn)

    threading.Thread(target=serve, daemon=True).start()
    yield
    listener.shutdown(socket.SHUT_RDWR)
    listener.close()


def run(config: Path, *args: str) -> tuple[int, list[str], str]:
    result = CliRunner().invoke(main, ["--config", str(config), *args])
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), \
        result.exception
    return result.exit_code, result.stderr.splitlines(), result.stdout


def test_run_without_an_agent_prints_one_line_naming_the_socket_and_exits_1(in_a_step) -> None:
    config, sock = in_a_step

    code, err, _ = run(config, "run", "--", "true")

    assert code == 1
    assert err == [f"singularityctl: error: the node agent did not answer run_begin: cannot reach the node "
                   f"agent at {sock}: No such file or directory; is it running?; is the Prolog configured "
                   "(`singularityctl admin check`)?"]


@pytest.mark.parametrize(("answer", "what"), [  # the first: an agent of the old line protocol
    (lambda c: c.sendall(b'{"ok": true, "key": "0-0000000000000000"}\n'), "frame length 2065854315 exceeds"),
    (lambda c: c.sendall(b"\x00\x00\x00\x05hello"), "is not a reply: frame is not JSON"),
    (lambda c: None, "closed the connection without answering run_begin"),
])
def test_run_with_a_malformed_reply_prints_one_line_and_exits_1(in_a_step, answer, what) -> None:
    config, sock = in_a_step
    for _ in fake_agent(sock, answer):
        code, err, _ = run(config, "run", "--", "true")

    assert code == 1
    assert len(err) == 1
    assert err[0].startswith("singularityctl: error: the node agent did not answer run_begin:")
    assert what in err[0]


def test_run_with_an_agent_that_refuses_prints_its_reason(in_a_step) -> None:
    from singularity_slurm.interpose.pyhook._singularity_worker import wire

    config, sock = in_a_step
    refusal = {"ok": False, "error": "uid 1 may not act on job 4242", "kind": "forbidden"}
    for _ in fake_agent(sock, lambda c: wire.send(c, refusal)):
        code, err, _ = run(config, "run", "--", "true")

    assert (code, err) == (1, ["singularityctl: error: run_begin: uid 1 may not act on job 4242"])


def test_agent_call_prints_a_typed_error_reply_for_its_caller(in_a_step) -> None:
    config, sock = in_a_step

    code, err, out = run(config, "agent-call", "status")

    assert code == 0 and err == []
    reply = json.loads(out)
    assert reply["ok"] is False and reply["kind"] == "unreachable"
    assert str(sock) in reply["error"]


def test_agent_call_with_arguments_that_are_not_an_object_is_a_bad_request(in_a_step) -> None:
    config, _ = in_a_step

    code, _, out = run(config, "agent-call", "status", "[1]")

    assert code == 0 and json.loads(out)["kind"] == "bad_request"


def test_a_project_error_no_command_caught_is_one_line_and_exit_1() -> None:
    @click.group(cls=_Commands)
    def group() -> None:
        pass

    @group.command()
    def boom() -> None:
        raise SingularityError("first line\n\n  second line  ")

    result = CliRunner().invoke(group, ["boom"])

    assert result.exit_code == 1
    assert result.stderr == "singularityctl: error: first line; second line\n"


@pytest.mark.parametrize(("args", "error"), [
    ([], "give --nodes, --gpus-per-node or both"),
    (["--nodes", "two"], "Invalid value for --nodes: 'two': give a node count (2) or a range (1-2)"),
    (["--nodes", "3-1"], "Invalid value for --nodes: '3-1': counts start at 1, and MIN <= MAX"),
    (["--nodes", "0"], "Invalid value for --nodes: '0': counts start at 1, and MIN <= MAX"),
    (["--gpus-per-node", "0"], "Invalid value for '--gpus-per-node': 0 is not in the range x>=1."),
])
def test_a_resize_without_a_valid_size_is_a_usage_error_that_asks_slurm_nothing(
        args: list[str], error: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("singularity_slurm.slurm_plugin.cli.SlurmClient",
                        lambda *a, **k: pytest.fail("Slurm must not be asked"))
    result = CliRunner().invoke(main, ["resize", "7", *args])

    assert result.exit_code == 2
    assert error in result.output
