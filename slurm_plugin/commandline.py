"""What `singularityctl run -- CMD` should start, read from CMD: a pure function of the command line.

Users bring the command they ran before: `torchrun ...`, `python -m torch.distributed.run ...` (or the
deprecated `torch.distributed.launch`), `srun ...`, `mpirun ...`. The launcher places and starts the
ranks itself, so a torchrun command becomes its world size and the program each rank runs, with a note
for every torchrun option the launcher owns; `srun` and `mpirun` would start processes Singularity
neither checkpoints nor restores, so they are refused with the command to write instead. Anything else
runs as written. The only I/O is reading torchrun's first lines to learn its interpreter, injectable.
"""

from __future__ import annotations

import re
import shlex
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from singularity_slurm.errors import SingularityError
from singularity_slurm.jobenv import parse_gpu_list


class CommandRefused(SingularityError):
    """The command cannot run under the launcher as written: write what the message shows instead."""


@dataclass(frozen=True)
class RunCommand:
    argv: tuple[str, ...]  # what runs: once per rank with a world size, else once per node
    world_size: int | None
    notes: tuple[str, ...] = ()


# --- torchrun's options ---------------------------------------------------------------------------

RENDEZVOUS, RESTARTS, AGENT, OUTPUT = "rendezvous", "restarts", "agent", "output"
IGNORED_BECAUSE = {
    RENDEZVOUS: "Singularity places the ranks on the job's devices and sets MASTER_ADDR/MASTER_PORT itself",
    RESTARTS: "after a failure or preemption Singularity restores the last checkpoint instead of "
              "restarting the ranks",
    AGENT: "Singularity's rank spawner starts and watches the ranks",
    OUTPUT: "every rank writes to the job's output file",
}

# name -> (takes a value, what it does); torch 2.13's `torch.distributed.run` parser.
TORCHRUN_OPTIONS: dict[str, tuple[bool, str]] = {
    "--nproc-per-node": (True, "nproc"), "--nnodes": (True, "nnodes"),
    "--module": (False, "module"), "--no-python": (False, "no-python"), "--run-path": (False, "run-path"),
    "--standalone": (False, RENDEZVOUS), "--rdzv-backend": (True, RENDEZVOUS),
    "--rdzv-endpoint": (True, RENDEZVOUS), "--rdzv-id": (True, RENDEZVOUS), "--rdzv-conf": (True, RENDEZVOUS),
    "--master-addr": (True, RENDEZVOUS), "--master-port": (True, RENDEZVOUS),
    "--node-rank": (True, RENDEZVOUS), "--local-addr": (True, RENDEZVOUS),
    "--max-restarts": (True, RESTARTS),
    "--monitor-interval": (True, AGENT), "--start-method": (True, AGENT), "--role": (True, AGENT),
    "--event-log-handler": (True, AGENT), "--signals-to-handle": (True, AGENT),
    "--shutdown-timeout": (True, AGENT), "--numa-binding": (True, AGENT),
    "--virtual-local-rank": (False, AGENT),
    "--log-dir": (True, OUTPUT), "--redirects": (True, OUTPUT), "--tee": (True, OUTPUT),
    "--local-ranks-filter": (True, OUTPUT), "--logs-specs": (True, OUTPUT),
    "--duplicate-stdout-filters": (True, OUTPUT), "--duplicate-stderr-filters": (True, OUTPUT),
}
LAUNCH_OPTIONS = {**TORCHRUN_OPTIONS, "--use-env": (False, "use-env")}
SHORT_OPTIONS = {"m": "--module", "r": "--redirects", "t": "--tee"}
DEVICE_WORDS = ("gpu", "auto", "xpu", "cpu")
TORCH_LAUNCHERS = ("torch.distributed.run", "torch.distributed.launch")
PYTHON = re.compile(r"python(\d+(\.\d+)?)?")
DEFAULT_PYTHON = "python3"


def read_head(program: str) -> str | None:
    """The first bytes of `program` (a path, or a name looked up on PATH), or None."""
    path = program if "/" in program else shutil.which(program)
    if path is None:
        return None
    try:
        with open(path, "rb") as file:
            return file.read(1024).decode("utf-8", "replace")
    except OSError:
        return None


def interpreter_from_head(head: str | None) -> str | None:
    """The Python a script's shebang runs: `#!/venv/bin/python3`, `#!/usr/bin/env python3`, or pip's
    `#!/bin/sh` + `'''exec' /long/path/python "$0" "$@"` form for paths too long for a shebang."""
    lines = (head or "").splitlines()
    if not lines or not lines[0].startswith("#!"):
        return None
    words = lines[0][2:].split()
    if words and Path(words[0]).name == "env":
        words = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
    elif words and Path(words[0]).name == "sh" and len(lines) > 1 and lines[1].startswith("'''exec'"):
        try:
            words = shlex.split(lines[1])[1:]
        except ValueError:
            return None
    if words and PYTHON.fullmatch(Path(words[0]).name):
        return words[0]
    return None


def devices_per_node(env: Mapping[str, str]) -> int | None:
    """The devices Slurm gave the job on this node (the device proxies the Prolog starts), or None."""
    return len(parse_gpu_list(env.get("SLURM_JOB_GPUS") or env.get("CUDA_VISIBLE_DEVICES"))) or None


def suggestion(world_size: int | str | None, argv: Sequence[str]) -> str:
    size = f" --world-size {world_size}" if world_size is not None else ""
    return f"singularityctl run{size} -- {shlex.join(argv)}"


# --- the entry point ------------------------------------------------------------------------------


def interpret(argv: Sequence[str], world_size: int | None = None, *, devices_per_node: int | None = None,
              python_exec: str | None = None,
              read_head: Callable[[str], str | None] = read_head) -> RunCommand:
    """What `singularityctl run [--world-size N] -- ARGV` starts; raises CommandRefused with the fix.

    `devices_per_node` resolves `--nproc-per-node=gpu|auto|cpu|xpu`; `python_exec` is torchrun's
    `$PYTHON_EXEC`, which overrides the interpreter of the ranks as it does for torchrun.
    """
    argv = list(argv)
    name = Path(argv[0]).name if argv else ""
    if name == "torchrun":
        python = python_exec or interpreter_from_head(read_head(argv[0])) or DEFAULT_PYTHON
        return _torchrun(argv[1:], "torchrun", world_size, devices_per_node, python, legacy=False)
    if PYTHON.fullmatch(name) and (found := _python_module(argv[1:])) is not None:
        module, rest = found
        if module in TORCH_LAUNCHERS:
            launcher = f"{argv[0]} -m {module}"
            return _torchrun(rest, launcher, world_size, devices_per_node, python_exec or argv[0],
                             legacy=module.endswith(".launch"))
    if name == "srun":
        raise CommandRefused(_srun_advice(argv, world_size))
    if name in ("mpirun", "mpiexec", "mpiexec.hydra", "orterun"):
        raise CommandRefused(_mpirun_advice(argv, world_size))
    return RunCommand(tuple(argv), world_size)


def _python_module(args: list[str]) -> tuple[str, list[str]] | None:
    """`python [options] -m MOD ARGS...` -> (MOD, ARGS); None for a script, `-c` or an unknown option."""
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] != "-":
        token = args[i]
        if token == "--check-hash-based-pycs":
            i += 2
            continue
        for j, char in enumerate(token[1:], start=1):
            if char in "WXm":
                value = token[j + 1:] or (args[i + 1] if i + 1 < len(args) else "")
                i += 1 if token[j + 1:] else 2
                if char == "m":
                    return (value, args[i:]) if value else None
                break
            if char not in "bBdEiIOPqRsSuvx":
                return None
        else:
            i += 1
    return None


# --- torchrun -------------------------------------------------------------------------------------


def _torchrun(args: list[str], launcher: str, world_size: int | None, devices: int | None, python: str,
              legacy: bool) -> RunCommand:
    options = LAUNCH_OPTIONS if legacy else TORCHRUN_OPTIONS
    given, script, script_args = _parse_options(args, options, launcher)
    values = {options[option][1]: value for option, _, value in given}  # the last one wins, as in torch
    flags = set(values)
    if script is None:
        raise CommandRefused(f"{launcher} without a training script: write the script after the options, "
                             f"or run it directly: {suggestion('N', [python, 'SCRIPT'])}")
    if "run-path" in flags:
        program = [python, script]
    elif "no-python" in flags:
        if "module" in flags or (legacy and "use-env" not in flags):
            problem = "--module" if "module" in flags else "without --use-env"
            raise CommandRefused(f"{launcher}: --no-python {problem} is refused by torch too; "
                                 f"write, e.g.: {suggestion('N', [script, *script_args])}")
        program = [script]
    else:
        program = [python, "-m", script] if "module" in flags else [python, script]
    program += script_args
    local_rank_arg = legacy and "use-env" not in flags

    def refuse(problem: str, size: int | str = "N") -> CommandRefused:
        hint = (" (and read the local rank from $LOCAL_RANK: torch.distributed.launch without --use-env "
                "passed it as --local-rank)") if local_rank_arg else ""
        return CommandRefused(f"{launcher} {problem}; write instead: {suggestion(size, program)}{hint}")

    notes = []
    nproc_raw = values.get("nproc", "1")
    if nproc_raw in DEVICE_WORDS:
        if devices is None:
            raise refuse(f"--nproc-per-node={nproc_raw} needs the number of devices per node, and this job "
                         "has none that Slurm reports ($SLURM_JOB_GPUS, $CUDA_VISIBLE_DEVICES); give the "
                         "number of ranks")
        nproc = devices
        notes.append(f"--nproc-per-node={nproc_raw}: one rank per device of the node ({devices})"
                     + (" where torchrun would start one per CPU core" if nproc_raw == "cpu" else ""))
    else:
        nproc = _positive(nproc_raw, "--nproc-per-node", refuse, "a number of ranks per node, or "
                          + ", ".join(DEVICE_WORDS) + " for one per device")
    nnodes_raw = values.get("nnodes", "1")
    low, sep, high = nnodes_raw.partition(":")
    if sep and low != high:
        if re.fullmatch(r"[0-9]+", high) and int(high) > 0:
            raise refuse(f"--nnodes={nnodes_raw} asks for an elastic range of nodes, which a Singularity "
                         "job does not have: its world size stays the same for its whole life (it is "
                         "restored, not re-rendezvoused); give one node count or the world size",
                         nproc * int(high))
        raise refuse(f"--nnodes={nnodes_raw} is not a node count (N or MIN:MAX)")
    nnodes = _positive(low, "--nnodes", refuse, "a number of nodes")
    size = nproc * nnodes
    if world_size is not None and world_size != size:
        raise refuse(f"starts {nproc} x {nnodes} = {size} (--nproc-per-node x --nnodes) ranks but "
                     f"--world-size (or $SINGULARITY_WORLD_SIZE) is {world_size}; they must agree", size)

    if local_rank_arg:
        # Every rank runs the same argv; the shell puts each one's own --local-rank where torch did.
        head = program[:len(program) - len(script_args)]
        program = ["/bin/sh", "-c", f'exec {shlex.join(head)} --local-rank="$LOCAL_RANK" "$@"', "sh",
                   *script_args]
        notes.append("torch.distributed.launch without --use-env: each rank also gets --local-rank=<its "
                     "local rank> after the script, as torch.distributed.launch passed it")
    if nnodes > 1:
        notes.append(f"--nnodes={nnodes}: the {size} ranks are spread evenly over the job's own nodes")
    if "run-path" in flags:
        notes.append(f"--run-path: each rank runs the script with {python}")
    last = {option: shown for option, shown, _ in given}  # torch uses the last of a repeated option
    for kind, because in IGNORED_BECAUSE.items():
        written = [shown for option, shown in last.items() if options[option][1] == kind]
        if written:
            notes.append(f"{' '.join(written)} ignored: {because}")
    notes.insert(0, f"{launcher} runs as: {suggestion(size, program)}")
    return RunCommand(tuple(program), size, tuple(notes))


def _positive(raw: str, option: str, refuse: Callable[..., CommandRefused], wanted: str) -> int:
    if not re.fullmatch(r"-?[0-9]+", raw):
        raise refuse(f"{option}={raw}: not {wanted}")
    if int(raw) < 1:
        raise refuse(f"{option}={raw}: must be at least 1")
    return int(raw)


def _parse_options(args: list[str], options: dict[str, tuple[bool, str]], launcher: str
                   ) -> tuple[list[tuple[str, str, str]], str | None, list[str]]:
    """torchrun's argparse rules -> ([(option, as shown, value)], script, script args).

    Options come before the script; everything after the script is the script's, untouched. A `--`
    before the script ends the options. Long options take `=value` or the next argument, in dash or
    underscore spelling, and may be abbreviated as argparse allows; -m, -r and -t may be clustered.
    """
    given: list[tuple[str, str, str]] = []  # (canonical option, as shown in a note, value)
    unknown: list[str] = []
    i = 0

    def value_of(option: str, attached: str | None) -> str:
        nonlocal i
        if attached is not None:
            return attached
        if i + 1 < len(args) and (not args[i + 1].startswith("-") or re.fullmatch(r"-[0-9]+", args[i + 1])):
            i += 1
            return args[i]
        raise CommandRefused(f"{launcher} {option} needs a value: {option}=VALUE or {option} VALUE")

    while i < len(args):
        token = args[i]
        if token == "--":
            i += 1
            break
        if token.startswith("--"):
            name, eq, attached = token.partition("=")
            option = _long_option(name.replace("_", "-"), options, launcher)
            if option is None:
                unknown.append(name)
            elif options[option][0]:
                value = value_of(option, attached if eq else None)
                given.append((option, f"{option}={value}", value))
            elif eq:
                raise CommandRefused(f"{launcher} {option} takes no value (got {token!r})")
            else:
                given.append((option, option, ""))
        elif token.startswith("-") and token != "-":
            for j, char in enumerate(token[1:], start=1):
                option = SHORT_OPTIONS.get(char)
                if option is None:
                    unknown.append(f"-{char}")
                    break
                if options[option][0]:
                    value = value_of(f"-{char}", token[j + 1:].removeprefix("=") or None)
                    given.append((option, f"{option}={value}", value))
                    break
                given.append((option, option, ""))
        else:
            break
        i += 1
    if unknown:
        raise CommandRefused(f"{launcher}: options not recognised: {', '.join(unknown)}; the options "
                             f"understood are {', '.join(options)} (also in underscore spelling), -m, -r, -t")
    return given, (args[i] if i < len(args) else None), args[i + 1:]


def _long_option(name: str, options: dict[str, tuple[bool, str]], launcher: str) -> str | None:
    if name in options:
        return name
    matches = [option for option in options if option.startswith(name)] if len(name) > 2 else []
    if len(matches) > 1:
        raise CommandRefused(f"{launcher} {name} is ambiguous: it could be {', '.join(matches)}")
    return matches[0] if matches else None


# --- srun and mpirun ------------------------------------------------------------------------------

SRUN_SHORT_VALUE = set("AbBcCdDeGiJLmMnNopqrStTwWx")
SRUN_SHORT_FLAG = set("EhHIkKlOQsuvVXZ")
SRUN_LONG_FLAG = {
    "label", "overlap", "quiet", "unbuffered", "verbose", "pty", "multi-prog", "no-kill", "kill-on-bad-exit",
    "overcommit", "oversubscribe", "disable-status", "preserve-env", "exact", "contiguous", "hold",
    "test-only", "spread-job", "use-min-nodes", "whole", "exclusive", "immediate", "no-allocate", "help",
    "usage", "version", "x11", "nice", "propagate", "resv-ports", "bcast", "send-libs",
}
SRUN_LONG_VALUE = {
    "account", "acctg-freq", "bb", "bbf", "begin", "cpu-bind", "cpus-per-gpu", "cpus-per-task", "comment",
    "constraint", "container", "core-spec", "cores-per-socket", "cpu-freq", "chdir", "dependency",
    "distribution", "error", "export", "extra-node-info", "gres", "gres-flags", "gpus", "gpus-per-node",
    "gpus-per-socket", "gpus-per-task", "gpu-bind", "gpu-freq", "hint", "input", "job-name", "jobid",
    "licenses", "mail-type", "mail-user", "mem", "mem-per-cpu", "mem-per-gpu", "mem-bind", "mincpus", "mpi",
    "network", "nodes", "nodefile", "nodelist", "ntasks", "ntasks-per-core", "ntasks-per-gpu",
    "ntasks-per-node", "ntasks-per-socket", "output", "open-mode", "partition", "prolog", "epilog",
    "priority", "profile", "qos", "reservation", "signal", "slurmd-debug", "sockets-per-node", "switches",
    "task-epilog", "task-prolog", "thread-spec", "threads-per-core", "threads", "time", "time-min", "tmp",
    "wait", "wckey", "exclude", "clusters", "cluster", "relative",
}
SRUN_KEYS = {"n": "ntasks", "ntasks": "ntasks", "N": "nodes", "nodes": "nodes", "ntasks-per-node": "per-node"}

MPI_FLAG = {
    "oversubscribe", "allow-run-as-root", "report-bindings", "tag-output", "timestamp-output", "q", "quiet",
    "v", "verbose", "display-map", "use-hwthread-cpus", "l", "genvall", "genvnone", "bind-to-core",
    "bind-to-socket", "noprefix",
}
MPI_VALUE = {
    "n", "np", "c", "N", "npernode", "ppn", "H", "host", "hosts", "hostfile", "machinefile", "f", "x",
    "wdir", "wd", "map-by", "bind-to", "rank-by", "prefix", "output-filename", "launcher", "bootstrap",
    "iface", "genvlist", "envlist", "preload-files", "path", "personality",
}
MPI_TWO_VALUES = {"mca", "gmca", "genv", "env"}
MPI_KEYS = {"n": "ntasks", "np": "ntasks", "c": "ntasks", "N": "per-node", "npernode": "per-node",
            "ppn": "per-node"}


def _scan_srun(args: list[str]) -> tuple[dict[str, str], list[str]] | None:
    """srun's options (getopt: it stops at the command) -> (the counts given, command); None if unsure."""
    found: dict[str, str] = {}
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] != "-":
        token = args[i]
        if token.startswith("--"):
            name, eq, value = token[2:].partition("=")
            if name in SRUN_LONG_VALUE and not eq:
                if i + 1 >= len(args):
                    return None
                i, value = i + 1, args[i + 1]
            elif name not in SRUN_LONG_VALUE and name not in SRUN_LONG_FLAG:
                return None
            if name in SRUN_KEYS:
                found[SRUN_KEYS[name]] = value
        else:
            for j, char in enumerate(token[1:], start=1):
                if char in SRUN_SHORT_VALUE:
                    value = token[j + 1:]
                    if not value:
                        if i + 1 >= len(args):
                            return None
                        i, value = i + 1, args[i + 1]
                    if char in SRUN_KEYS:
                        found[SRUN_KEYS[char]] = value.removeprefix("=")
                    break
                if char not in SRUN_SHORT_FLAG:
                    return None
        i += 1
    return found, args[i:]


def _scan_mpirun(args: list[str]) -> tuple[dict[str, str], list[str]] | None:
    """mpirun/mpiexec options (Open MPI, MPICH; one or two dashes) -> (counts, command); None if unsure."""
    found: dict[str, str] = {}
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] != "-":
        name, eq, value = args[i].lstrip("-").partition("=")
        if name in MPI_TWO_VALUES:
            i += 2
        elif name in MPI_VALUE:
            if not eq:
                if i + 1 >= len(args):
                    return None
                i, value = i + 1, args[i + 1]
            if name in MPI_KEYS:
                found[MPI_KEYS[name]] = value
        elif name not in MPI_FLAG:
            return None
        i += 1
    if ":" in args[i:]:
        return None  # several programs (MPMD): there is no one equivalent
    return found, args[i:]


def _starts_ranks(command: list[str]) -> bool:
    name = Path(command[0]).name
    if name == "torchrun":
        return True
    found = _python_module(command[1:]) if PYTHON.fullmatch(name) else None
    return found is not None and found[0] in TORCH_LAUNCHERS


def _ranks_advice(tool: str, found: dict[str, str], command: list[str], world_size: int | None) -> str:
    """What to write instead of `tool [counts] command`."""
    if _starts_ranks(command):
        return f"{suggestion(None, command)} (without {tool}: one launcher starts every rank)"
    ntasks, nodes, per_node = found.get("ntasks"), found.get("nodes"), found.get("per-node")
    if ntasks and ntasks.isdigit():
        return suggestion(int(ntasks), command)
    if per_node and per_node.isdigit():
        if nodes and nodes.isdigit():
            return suggestion(int(per_node) * int(nodes), command)
        return f"{suggestion('N', command)} with N = {per_node} x the job's number of nodes"
    if world_size is not None:
        return suggestion(world_size, command)
    return (f"{suggestion(None, command)}, or with --world-size N to run N ranks ({tool} without a task "
            "count starts one per task of the job's allocation)")


def _srun_advice(argv: list[str], world_size: int | None) -> str:
    why = (f"{argv[0]} inside `singularityctl run` would start processes that Singularity neither "
           "checkpoints nor restores: the launcher places the job's ranks itself")
    scanned = _scan_srun(argv[1:])
    if scanned is None or not scanned[1]:
        return f"{why}; drop srun and its options: singularityctl run [--world-size N] -- CMD..."
    return f"{why}; write instead: {_ranks_advice('srun', *scanned, world_size)}"


def _mpirun_advice(argv: list[str], world_size: int | None) -> str:
    why = (f"{argv[0]} inside `singularityctl run` would start MPI ranks that Singularity neither "
           "checkpoints nor restores: the launcher starts the ranks itself, with torch.distributed's "
           "environment (RANK, WORLD_SIZE, MASTER_ADDR), not MPI's; a program that calls MPI itself "
           "cannot run under Singularity")
    scanned = _scan_mpirun(argv[1:])
    if scanned is None or not scanned[1]:
        return f"{why}; drop {argv[0]} and its options: singularityctl run [--world-size N] -- CMD..."
    return f"{why}; write instead: {_ranks_advice(Path(argv[0]).name, *scanned, world_size)}"
