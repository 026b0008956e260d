"""What `singularityctl run -- CMD` starts: torchrun read as ranks, srun/mpirun refused with the fix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from singularity_slurm.errors import SingularityError
from singularity_slurm.slurm_plugin.cli import main
from singularity_slurm.slurm_plugin.commandline import (
    CommandRefused,
    RunCommand,
    devices_per_node,
    interpret,
    interpreter_from_head,
)

ENV_PYTHON = "#!/usr/bin/env python\n# -*- coding: utf-8 -*-\nimport re\n"
RDZV_NOTE = ("ignored: Singularity places the ranks on the job's devices and sets MASTER_ADDR/MASTER_PORT "
             "itself")


def run(command: str, world_size: int | None = None, head: str | None = ENV_PYTHON, **kw) -> RunCommand:
    """interpret() of a command line written as in a batch script; torchrun's first lines are `head`."""
    return interpret(command.split(), world_size, read_head=lambda program: head, **kw)


def refusal(command: str, world_size: int | None = None, **kw) -> str:
    with pytest.raises(CommandRefused) as info:
        run(command, world_size, **kw)
    return str(info.value)


# --- plain commands -------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [
    "python train.py --lr 0.1",
    "python -m mypkg.train --nproc-per-node 4",
    "python -c print(1)",
    "python3 -u train.py",
    "./train.sh --nnodes 2",
    "bash -c torchrun",
    "my-torchrun train.py",
])
def test_a_command_that_is_no_launcher_runs_as_written(command: str) -> None:
    assert run(command) == RunCommand(tuple(command.split()), None, ())


def test_a_plain_command_keeps_the_world_size_given() -> None:
    assert run("python train.py", 8) == RunCommand(("python", "train.py"), 8, ())


def test_a_plain_command_is_not_looked_at_on_disk() -> None:
    def no_io(program: str) -> str:
        raise AssertionError(f"read {program}")

    assert interpret(["python", "train.py"], read_head=no_io).argv == ("python", "train.py")


# --- torchrun: world size and program -------------------------------------------------------------


def test_torchrun_runs_its_script_as_nproc_per_node_ranks() -> None:
    assert run("torchrun --nproc-per-node=4 train.py --lr 0.1") == RunCommand(
        ("python", "train.py", "--lr", "0.1"), 4,
        ("torchrun runs as: singularityctl run --world-size 4 -- python train.py --lr 0.1",))


def test_the_world_size_is_nproc_per_node_times_nnodes() -> None:
    result = run("torchrun --nnodes 2 --nproc-per-node 4 train.py")

    assert result.world_size == 8
    assert result.notes[1] == "--nnodes=2: the 8 ranks are spread evenly over the job's own nodes"


def test_torchrun_without_sizes_is_one_rank() -> None:
    assert run("torchrun train.py").world_size == 1


@pytest.mark.parametrize("spelling", [
    "--nproc-per-node=4 --nnodes=2", "--nproc_per_node=4 --nnodes=2", "--nproc-per-node 4 --nnodes 2",
    "--nproc_per_node 4 --nnodes 2:2", "--nnodes 1 --nproc-per-node 1 --nproc-per-node 4 --nnodes=2",
    "--nproc-per 4 --nnode 2",
])
def test_options_are_read_in_every_spelling_torchrun_accepts(spelling: str) -> None:
    assert run(f"torchrun {spelling} train.py").world_size == 8


def test_a_bare_torchrun_runs_the_ranks_with_the_python_of_its_shebang() -> None:
    seen = []

    def head(program: str) -> str:
        seen.append(program)
        return "#!/opt/venv/bin/python3.11\n"

    result = interpret(["/opt/venv/bin/torchrun", "train.py"], read_head=head)

    assert result.argv == ("/opt/venv/bin/python3.11", "train.py")
    assert seen == ["/opt/venv/bin/torchrun"]


@pytest.mark.parametrize(("head", "python"), [
    ("#!/usr/bin/env python3\n", "python3"),
    ("#!/usr/bin/env -S python3 -u\n", "python3"),
    ("#! /opt/venv/bin/python\n", "/opt/venv/bin/python"),
    ("#!/bin/sh\n'''exec' \"/very long/venv/bin/python3\" \"$0\" \"$@\"\n' '''\n",
     "/very long/venv/bin/python3"),
])
def test_the_interpreter_is_read_from_every_shebang_form_pip_writes(head: str, python: str) -> None:
    assert interpreter_from_head(head) == python
    assert run("torchrun train.py", head=head).argv == (python, "train.py")


@pytest.mark.parametrize("head", [None, "", "\x7fELF\x02\x01", "#!/bin/bash\nexec foo\n", "#!\n",
                                  "#!/bin/sh\n'''exec' \"unclosed\n"])
def test_torchrun_without_a_python_shebang_runs_the_ranks_with_python3(head: str | None) -> None:
    assert run("torchrun train.py", head=head).argv == ("python3", "train.py")


def test_python_exec_chooses_the_ranks_interpreter_as_it_does_for_torchrun() -> None:
    assert run("torchrun train.py", python_exec="/opt/py/bin/python").argv == (
        "/opt/py/bin/python", "train.py")
    assert run("python -m torch.distributed.run train.py", python_exec="/opt/py/bin/python").argv == (
        "/opt/py/bin/python", "train.py")


@pytest.mark.parametrize("python", ["python", "python3", "python3.11", "/usr/bin/python3"])
def test_python_m_torch_distributed_run_runs_the_ranks_with_that_python(python: str) -> None:
    result = run(f"{python} -m torch.distributed.run --nproc_per_node 4 train.py --lr 0.1")

    assert result == RunCommand((python, "train.py", "--lr", "0.1"), 4, (
        f"{python} -m torch.distributed.run runs as: singularityctl run --world-size 4 -- "
        f"{python} train.py --lr 0.1",))


@pytest.mark.parametrize("prefix", ["python -u -m", "python -uB -m", "python -W ignore -X dev -m",
                                    "python -Wignore -OO -m", "python -mtorch.distributed.run"])
def test_python_options_before_the_module_are_allowed(prefix: str) -> None:
    module = "" if prefix.endswith("run") else " torch.distributed.run"
    assert run(f"{prefix}{module} --nproc-per-node 2 train.py").argv == ("python", "train.py")


def test_module_runs_each_rank_as_python_m() -> None:
    assert run("torchrun --nproc-per-node 2 -m mypkg.train --lr 0.1").argv == (
        "python", "-m", "mypkg.train", "--lr", "0.1")
    assert run("torchrun --module mypkg.train").argv == ("python", "-m", "mypkg.train")


@pytest.mark.parametrize("flag", ["--no-python", "--no_python"])
def test_no_python_runs_the_program_itself(flag: str) -> None:
    assert run(f"torchrun {flag} --nproc-per-node 2 ./train.sh --epochs 3").argv == (
        "./train.sh", "--epochs", "3")


def test_no_python_with_module_is_refused_as_torch_refuses_it() -> None:
    assert refusal("torchrun --no-python -m mypkg.train") == (
        "torchrun: --no-python --module is refused by torch too; write, e.g.: "
        "singularityctl run --world-size N -- mypkg.train")


def test_run_path_runs_the_script_with_python_and_wins_over_no_python_and_module() -> None:
    result = run("torchrun --run-path --no-python -m /abs/train.py --lr 1")

    assert result.argv == ("python", "/abs/train.py", "--lr", "1")
    assert "--run-path: each rank runs the script with python" in result.notes


# --- torchrun: what belongs to the script ---------------------------------------------------------


def test_arguments_after_the_script_stay_untouched_even_when_they_look_like_torchrun_options() -> None:
    result = run("torchrun --nproc-per-node 2 train.py --nproc-per-node 8 --nnodes=3 -m x --bogus -- --lr")

    assert result.world_size == 2
    assert result.argv == ("python", "train.py", "--nproc-per-node", "8", "--nnodes=3", "-m", "x",
                           "--bogus", "--", "--lr")


def test_a_double_dash_before_the_script_ends_torchruns_options() -> None:
    assert run("torchrun --nproc-per-node=2 -- train.py --lr 1").argv == ("python", "train.py", "--lr", "1")
    assert run("torchrun -- --weird-name.py").argv == ("python", "--weird-name.py")


def test_a_negative_number_is_a_value_not_an_option() -> None:
    assert refusal("torchrun --nproc-per-node -1 train.py") == (
        "torchrun --nproc-per-node=-1: must be at least 1; write instead: "
        "singularityctl run --world-size N -- python train.py")


# --- torchrun: refusals ---------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["torchrun", "torchrun --nproc-per-node 4", "torchrun --standalone --",
                                     "torchrun -m"])
def test_torchrun_without_a_script_is_refused(command: str) -> None:
    assert refusal(command) == (
        "torchrun without a training script: write the script after the options, or run it directly: "
        "singularityctl run --world-size N -- python SCRIPT")


@pytest.mark.parametrize(("command", "option"), [
    ("torchrun --nproc-per-node", "--nproc-per-node"),
    ("torchrun --nproc-per-node --nnodes 2 train.py", "--nproc-per-node"),
    ("torchrun --master-port", "--master-port"),
    ("torchrun -r", "-r"),
])
def test_an_option_missing_its_value_is_refused(command: str, option: str) -> None:
    assert refusal(command) == f"torchrun {option} needs a value: {option}=VALUE or {option} VALUE"


@pytest.mark.parametrize(("value", "problem"), [
    ("four", "not a number of ranks per node, or gpu, auto, xpu, cpu for one per device"),
    ("2.5", "not a number of ranks per node, or gpu, auto, xpu, cpu for one per device"),
    ("", "not a number of ranks per node, or gpu, auto, xpu, cpu for one per device"),
    ("0", "must be at least 1"),
    ("-3", "must be at least 1"),
])
def test_a_bad_nproc_per_node_is_refused(value: str, problem: str) -> None:
    assert refusal(f"torchrun --nproc-per-node={value} train.py --lr 0.1") == (
        f"torchrun --nproc-per-node={value}: {problem}; write instead: "
        "singularityctl run --world-size N -- python train.py --lr 0.1")


@pytest.mark.parametrize(("value", "problem"), [
    ("two", "--nnodes=two: not a number of nodes"),
    ("0", "--nnodes=0: must be at least 1"),
    ("1:2:3", "--nnodes=1:2:3 is not a node count (N or MIN:MAX)"),
    ("1:x", "--nnodes=1:x is not a node count (N or MIN:MAX)"),
])
def test_a_bad_nnodes_is_refused(value: str, problem: str) -> None:
    assert refusal(f"torchrun --nnodes={value} train.py") == (
        f"torchrun {problem}; write instead: singularityctl run --world-size N -- python train.py")


def test_an_elastic_node_range_is_refused_with_the_fixed_world_size_to_write() -> None:
    assert refusal("torchrun --nnodes=1:4 --nproc-per-node=2 train.py --lr 0.1") == (
        "torchrun --nnodes=1:4 asks for an elastic range of nodes, which a Singularity job does not have: "
        "its world size stays the same for its whole life (it is restored, not re-rendezvoused); give one "
        "node count or the world size; write instead: singularityctl run --world-size 8 -- python train.py "
        "--lr 0.1")


def test_unknown_options_are_refused_and_listed_with_the_known_ones() -> None:
    message = refusal("torchrun --nproc-per-node 2 --foo=1 -x --use-env train.py")

    assert message.startswith("torchrun: options not recognised: --foo, -x, --use-env; the options "
                              "understood are --nproc-per-node, --nnodes, --module, ")
    assert message.endswith("--duplicate-stderr-filters (also in underscore spelling), -m, -r, -t")


def test_an_ambiguous_abbreviation_is_refused() -> None:
    assert refusal("torchrun --no 2 train.py") == (
        "torchrun --no is ambiguous: it could be --no-python, --node-rank")


def test_a_flag_given_a_value_is_refused() -> None:
    assert refusal("torchrun --standalone=1 train.py") == (
        "torchrun --standalone takes no value (got '--standalone=1')")


# --- torchrun: device words -----------------------------------------------------------------------


@pytest.mark.parametrize("word", ["gpu", "auto", "xpu"])
def test_a_device_word_starts_one_rank_per_device_of_the_node(word: str) -> None:
    result = run(f"torchrun --nnodes 2 --nproc-per-node {word} train.py", devices_per_node=4)

    assert result.world_size == 8
    assert f"--nproc-per-node={word}: one rank per device of the node (4)" in result.notes


def test_cpu_also_means_one_rank_per_device_and_the_note_says_how_torchrun_differs() -> None:
    assert run("torchrun --nproc-per-node cpu train.py", devices_per_node=2).notes[1] == (
        "--nproc-per-node=cpu: one rank per device of the node (2) where torchrun would start one per CPU "
        "core")


@pytest.mark.parametrize("word", ["gpu", "auto", "cpu", "xpu"])
def test_a_device_word_without_a_device_count_is_refused(word: str) -> None:
    assert refusal(f"torchrun --nproc-per-node={word} train.py") == (
        f"torchrun --nproc-per-node={word} needs the number of devices per node, and this job has none that "
        "Slurm reports ($SLURM_JOB_GPUS, $CUDA_VISIBLE_DEVICES); give the number of ranks; write instead: "
        "singularityctl run --world-size N -- python train.py")


@pytest.mark.parametrize(("env", "count"), [
    ({"SLURM_JOB_GPUS": "0,1,3"}, 3),
    ({"SLURM_JOB_GPUS": "", "CUDA_VISIBLE_DEVICES": "2,3"}, 2),
    ({"SLURM_JOB_GPUS": "(null)"}, None),
    ({"CUDA_VISIBLE_DEVICES": ""}, None),
    ({}, None),
])
def test_the_device_count_comes_from_the_gpus_slurm_gave_the_job(env: dict, count: int | None) -> None:
    assert devices_per_node(env) == count


# --- torchrun and --world-size --------------------------------------------------------------------


def test_an_equal_world_size_is_accepted() -> None:
    assert run("torchrun --nnodes 2 --nproc-per-node 4 train.py", 8).world_size == 8


def test_a_different_world_size_is_refused() -> None:
    assert refusal("torchrun --nnodes 2 --nproc-per-node 4 train.py --lr 0.1", 4) == (
        "torchrun starts 4 x 2 = 8 (--nproc-per-node x --nnodes) ranks but --world-size (or "
        "$SINGULARITY_WORLD_SIZE) is 4; they must agree; write instead: singularityctl run --world-size 8 -- "
        "python train.py --lr 0.1")


# --- torchrun: notes for what the launcher owns ---------------------------------------------------


def test_options_the_launcher_owns_are_ignored_with_one_note_per_reason() -> None:
    result = run("torchrun --standalone --rdzv-backend=c10d --rdzv_endpoint host:29400 --rdzv-id 7 "
                 "--rdzv-conf timeout=900 --master-addr 10.0.0.1 --master_port 29500 --node-rank 1 "
                 "--local-addr n1 --max-restarts 3 --monitor-interval 5 --start-method fork --role trainer "
                 "--log-dir /tmp/logs -r 3 -t 0:1 --local-ranks-filter 0 --logs-specs mine "
                 "--nproc-per-node 2 train.py")

    assert result.argv == ("python", "train.py")
    assert result.notes == (
        "torchrun runs as: singularityctl run --world-size 2 -- python train.py",
        "--standalone --rdzv-backend=c10d --rdzv-endpoint=host:29400 --rdzv-id=7 --rdzv-conf=timeout=900 "
        "--master-addr=10.0.0.1 --master-port=29500 --node-rank=1 --local-addr=n1 " + RDZV_NOTE,
        "--max-restarts=3 ignored: after a failure or preemption Singularity restores the last checkpoint "
        "instead of restarting the ranks",
        "--monitor-interval=5 --start-method=fork --role=trainer ignored: Singularity's rank spawner starts "
        "and watches the ranks",
        "--log-dir=/tmp/logs --redirects=3 --tee=0:1 --local-ranks-filter=0 --logs-specs=mine ignored: every "
        "rank writes to the job's output file",
    )


def test_a_repeated_option_is_noted_once_with_the_value_torch_uses() -> None:
    assert run("torchrun --master-port 1 --master_port=2 train.py").notes[1] == "--master-port=2 " + RDZV_NOTE


@pytest.mark.parametrize("cluster", ["-mr 3", "-m -r3", "-m -r=3", "-m --redirects 3"])
def test_short_options_cluster_and_take_attached_values(cluster: str) -> None:
    result = run(f"torchrun {cluster} mypkg.train")

    assert result.argv == ("python", "-m", "mypkg.train")
    assert result.notes[1] == "--redirects=3 ignored: every rank writes to the job's output file"


# --- the deprecated torch.distributed.launch ------------------------------------------------------


@pytest.mark.parametrize("flag", ["--use-env", "--use_env"])
def test_launch_with_use_env_runs_like_torchrun(flag: str) -> None:
    assert run(f"python -m torch.distributed.launch {flag} --nproc_per_node 2 train.py --lr 1") == RunCommand(
        ("python", "train.py", "--lr", "1"), 2,
        ("python -m torch.distributed.launch runs as: singularityctl run --world-size 2 -- python train.py "
         "--lr 1",))


def test_launch_without_use_env_gives_each_rank_its_local_rank_argument() -> None:
    result = run("python -m torch.distributed.launch --nproc_per_node 2 train.py --lr 1")

    assert result.argv == ("/bin/sh", "-c", 'exec python train.py --local-rank="$LOCAL_RANK" "$@"', "sh",
                           "--lr", "1")
    assert result.notes[1] == ("torch.distributed.launch without --use-env: each rank also gets "
                               "--local-rank=<its local rank> after the script, as torch.distributed.launch "
                               "passed it")


def test_launch_without_use_env_puts_the_local_rank_after_a_module_too() -> None:
    assert run("python3 -m torch.distributed.launch -m mypkg.train --lr 1").argv == (
        "/bin/sh", "-c", 'exec python3 -m mypkg.train --local-rank="$LOCAL_RANK" "$@"', "sh", "--lr", "1")


def test_the_local_rank_wrapper_passes_the_argv_torch_distributed_launch_would(tmp_path: Path) -> None:
    script = tmp_path / "it's a script.py"
    script.write_text("import json, sys; print(json.dumps(sys.argv[1:]))")
    result = interpret([sys.executable, "-m", "torch.distributed.launch", str(script), "--lr", "0.1",
                        "two words", '"$HOME"'])

    out = subprocess.run(result.argv, env={"LOCAL_RANK": "3"}, capture_output=True, text=True, check=True)

    assert json.loads(out.stdout) == ["--local-rank=3", "--lr", "0.1", "two words", '"$HOME"']


def test_launch_refusals_tell_the_script_to_read_local_rank() -> None:
    assert refusal("python -m torch.distributed.launch --nproc_per_node 2 train.py", 4) == (
        "python -m torch.distributed.launch starts 2 x 1 = 2 (--nproc-per-node x --nnodes) ranks but "
        "--world-size (or $SINGULARITY_WORLD_SIZE) is 4; they must agree; write instead: singularityctl run "
        "--world-size 2 -- python train.py (and read the local rank from $LOCAL_RANK: "
        "torch.distributed.launch without --use-env passed it as --local-rank)")


def test_launch_with_no_python_needs_use_env_as_in_torch() -> None:
    assert refusal("python -m torch.distributed.launch --no-python ./run.sh") == (
        "python -m torch.distributed.launch: --no-python without --use-env is refused by torch too; "
        "write, e.g.: singularityctl run --world-size N -- ./run.sh")
    assert run("python -m torch.distributed.launch --no-python --use-env ./run.sh").argv == ("./run.sh",)


# --- srun -----------------------------------------------------------------------------------------

SRUN_WHY = ("srun inside `singularityctl run` would start processes that Singularity neither checkpoints "
            "nor restores: the launcher places the job's ranks itself")


@pytest.mark.parametrize("srun", ["srun -n 8", "srun -n8", "srun --ntasks=8", "srun --ntasks 8",
                                  "/usr/bin/srun -l -n 8", "srun -ln 8", "srun -p gpu --gres=gpu:4 -c 8 -n 8",
                                  "srun --ntasks-per-node 4 -N 2", "srun --nodes=2 --ntasks-per-node=4 -n 8"])
def test_srun_with_a_task_count_is_refused_with_the_world_size_to_write(srun: str) -> None:
    assert refusal(f"{srun} python train.py --lr 0.1") == (
        f"{srun.split()[0]}{SRUN_WHY[4:]}; write instead: singularityctl run --world-size 8 -- "
        "python train.py --lr 0.1")


def test_srun_command_arguments_that_look_like_srun_options_stay_in_the_command() -> None:
    assert refusal("srun -n 2 python train.py -n 5 --ntasks=9").endswith(
        "write instead: singularityctl run --world-size 2 -- python train.py -n 5 --ntasks=9")


def test_srun_without_a_task_count_is_refused_with_srun_dropped() -> None:
    assert refusal("srun --label python train.py") == (
        f"{SRUN_WHY}; write instead: singularityctl run -- python train.py, or with --world-size N to run N "
        "ranks (srun without a task count starts one per task of the job's allocation)")


def test_srun_without_a_task_count_keeps_the_world_size_given() -> None:
    assert refusal("srun python train.py", 4) == (
        f"{SRUN_WHY}; write instead: singularityctl run --world-size 4 -- python train.py")


def test_srun_with_tasks_per_node_only_names_the_product_to_write() -> None:
    assert refusal("srun --ntasks-per-node=4 python train.py") == (
        f"{SRUN_WHY}; write instead: singularityctl run --world-size N -- python train.py with N = 4 x the "
        "job's number of nodes")


def test_srun_around_torchrun_is_refused_with_torchrun_alone() -> None:
    assert refusal("srun -N 2 -n 2 torchrun --nnodes 2 --nproc-per-node 4 train.py") == (
        f"{SRUN_WHY}; write instead: singularityctl run -- torchrun --nnodes 2 --nproc-per-node 4 train.py "
        "(without srun: one launcher starts every rank)")
    assert refusal("srun python3 -m torch.distributed.run train.py").endswith(
        "singularityctl run -- python3 -m torch.distributed.run train.py (without srun: one launcher starts "
        "every rank)")


@pytest.mark.parametrize("command", ["srun", "srun -n 4", "srun --unknown-option python train.py",
                                     "srun -n", "srun -y python train.py"])
def test_srun_that_cannot_be_read_is_refused_with_the_general_advice(command: str) -> None:
    assert refusal(command) == (
        f"{SRUN_WHY}; drop srun and its options: singularityctl run [--world-size N] -- CMD...")


# --- mpirun ---------------------------------------------------------------------------------------

MPI_WHY = ("{} inside `singularityctl run` would start MPI ranks that Singularity neither checkpoints nor "
           "restores: the launcher starts the ranks itself, with torch.distributed's environment (RANK, "
           "WORLD_SIZE, MASTER_ADDR), not MPI's; a program that calls MPI itself cannot run under "
           "Singularity")


@pytest.mark.parametrize("mpirun", ["mpirun -np 4", "mpirun --np 4", "mpiexec -n 4", "mpirun -n=4",
                                    "mpirun --mca btl tcp,self -x NCCL_DEBUG -np 4 --bind-to none",
                                    "mpiexec.hydra -genv A 1 -n 4 -l"])
def test_mpirun_with_a_rank_count_is_refused_with_the_world_size_to_write(mpirun: str) -> None:
    assert refusal(f"{mpirun} python train.py -n 2") == (
        MPI_WHY.format(mpirun.split()[0]) + "; write instead: singularityctl run --world-size 4 -- python "
        "train.py -n 2")


def test_mpirun_per_node_count_names_the_product_to_write() -> None:
    assert refusal("mpirun -npernode 2 python train.py").endswith(
        "write instead: singularityctl run --world-size N -- python train.py with N = 2 x the job's number "
        "of nodes")


@pytest.mark.parametrize("command", ["mpirun", "mpirun -np 2 a.py : -np 2 b.py", "mpirun --frobnicate a.py"])
def test_mpirun_that_cannot_be_read_is_refused_with_the_general_advice(command: str) -> None:
    assert refusal(command) == (
        MPI_WHY.format("mpirun") + "; drop mpirun and its options: singularityctl run [--world-size N] -- "
        "CMD...")


def test_every_refusal_is_a_singularity_error() -> None:
    assert issubclass(CommandRefused, SingularityError)


# --- singularityctl run ---------------------------------------------------------------------------


@pytest.fixture
def outside_a_job(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for var in ("SLURM_JOB_ID", "SLURMD_NODENAME", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES", "PYTHON_EXEC",
                "SINGULARITY_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    config = tmp_path / "config.toml"
    config.write_text("")
    return config


def test_run_refuses_an_uninterpretable_command_before_anything_else(outside_a_job: Path) -> None:
    result = CliRunner().invoke(main, ["--config", "/nonexistent.toml", "run", "--", "srun", "-n", "8",
                                       "python", "train.py"])

    assert result.exit_code == 1
    assert result.stderr == (f"singularityctl: error: {SRUN_WHY}; write instead: singularityctl run "
                             "--world-size 8 -- python train.py\n")


def test_run_refuses_a_world_size_that_torchrun_contradicts(outside_a_job: Path) -> None:
    result = CliRunner().invoke(main, ["--config", str(outside_a_job), "run", "--world-size", "3", "--",
                                       "python", "-m", "torch.distributed.run", "--nproc-per-node=2", "t.py"])

    assert result.exit_code == 1
    assert result.stderr.startswith("singularityctl: error: python -m torch.distributed.run starts 2 x 1 = 2")


def test_run_outside_a_job_accepts_the_command_and_then_needs_a_slurm_job(outside_a_job: Path) -> None:
    # The notes are printed once, by the launcher's step; outside a job there is no step.
    result = CliRunner().invoke(main, ["--config", str(outside_a_job), "run", "--", "python", "-m",
                                       "torch.distributed.run", "--standalone", "--nproc-per-node=2", "t.py"])

    assert result.exit_code == 1
    assert result.stderr == (
        "singularityctl: error: `singularityctl run` runs inside a Slurm batch job (SLURM_JOB_ID, "
        "SLURMD_NODENAME unset)\n")
