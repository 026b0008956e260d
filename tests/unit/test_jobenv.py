"""What a job is, read from the environment Slurm gives Prolog, Epilog and the batch script."""

from __future__ import annotations

from pathlib import Path

import pytest

from singularity_slurm.config import parse
from singularity_slurm.errors import ConfigError
from singularity_slurm.jobenv import JobContext, job_run_dir, parse_gpu_list, resolve_tier

CONFIG = parse({})

PROLOG_ENV = {
    "SLURM_JOB_ID": "42",
    "SLURM_JOB_USER": "jobuser",
    "SLURM_JOB_UID": "1001",
    "SLURMD_NODENAME": "n1",
    "SLURM_JOB_PARTITION": "standard",
    "SLURM_JOB_GPUS": "0,1",
    "SPANK_SINGULARITY_SLA": "premium",
}


# --- the tier -------------------------------------------------------------------------------------


def test_option_wins_over_the_partition() -> None:
    env = {"SPANK_SINGULARITY_SLA": "premium", "SLURM_JOB_PARTITION": "basic"}

    assert resolve_tier(env, CONFIG) == "premium"


@pytest.mark.parametrize(("env", "tier"), [
    ({"SPANK_SINGULARITY_SLA": "premium", "SLURM_SPANK_SINGULARITY_SLA": "standard",
      "SINGULARITY_SLA": "basic"}, "premium"),
    ({"SLURM_SPANK_SINGULARITY_SLA": "standard", "SINGULARITY_SLA": "basic"}, "standard"),
    ({"SINGULARITY_SLA": "basic", "SLURM_JOB_PARTITION": "premium"}, "basic"),
])
def test_option_variables_are_read_prolog_first_then_batch_then_task(env: dict[str, str],
                                                                     tier: str) -> None:
    assert resolve_tier(env, CONFIG) == tier


def test_empty_option_variable_is_skipped() -> None:
    env = {"SPANK_SINGULARITY_SLA": "", "SINGULARITY_SLA": "standard"}

    assert resolve_tier(env, CONFIG) == "standard"


@pytest.mark.parametrize("partition", ["premium", "standard", "basic"])
def test_without_option_the_partition_gives_the_tier(partition: str) -> None:
    assert resolve_tier({"SLURM_JOB_PARTITION": partition}, CONFIG) == partition


def test_partition_tier_follows_the_configured_names() -> None:
    config = parse({"tiers": {"premium": {"partition": "gpu-hi"}}})

    assert resolve_tier({"SLURM_JOB_PARTITION": "gpu-hi"}, config) == "premium"


def test_without_option_or_partition_the_default_tier_applies() -> None:
    assert resolve_tier({}, CONFIG) == "basic"
    assert resolve_tier({}, parse({"tiers": {"default": "standard"}})) == "standard"


@pytest.mark.parametrize("var", ["SPANK_SINGULARITY_SLA", "SLURM_SPANK_SINGULARITY_SLA",
                                 "SINGULARITY_SLA"])
def test_unknown_tier_in_the_option_is_refused_with_the_valid_tiers(var: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_tier({var: "gold", "SLURM_JOB_PARTITION": "basic"}, CONFIG)

    assert str(info.value) == "unknown SLA tier 'gold'; valid tiers: premium, standard, basic"


# --- GPU lists ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "gpus"), [
    ("0,1,3", ["0", "1", "3"]),
    ("2", ["2"]),
    (" 0 , 1 ,", ["0", "1"]),
    ("GPU-3f1c2a,GPU-77aa", ["GPU-3f1c2a", "GPU-77aa"]),
])
def test_parse_gpu_list(value: str, gpus: list[str]) -> None:
    assert parse_gpu_list(value) == gpus


@pytest.mark.parametrize("value", [None, "", "(null)", "NoDevFiles", ","])
def test_parse_gpu_list_of_no_gpus_is_empty(value: str | None) -> None:
    assert parse_gpu_list(value) == []


# --- the job context ------------------------------------------------------------------------------


def test_job_context_from_a_prolog_environment() -> None:
    assert JobContext.from_env(PROLOG_ENV, CONFIG) == JobContext(
        job_id=42, user="jobuser", uid=1001, node="n1", partition="standard", tier="premium",
        gpus=["0", "1"], restart_count=0,
    )


def test_missing_slurm_variables_are_all_named() -> None:
    env = {k: v for k, v in PROLOG_ENV.items() if k not in {"SLURM_JOB_ID", "SLURMD_NODENAME"}}

    with pytest.raises(ConfigError) as info:
        JobContext.from_env(env, CONFIG)

    assert str(info.value) == (
        "not running under Slurm: SLURM_JOB_ID, SLURMD_NODENAME unset "
        "(Prolog/Epilog get them from slurmd)"
    )


def test_empty_slurm_variable_counts_as_missing() -> None:
    with pytest.raises(ConfigError, match=r"^not running under Slurm: SLURM_JOB_UID unset"):
        JobContext.from_env({**PROLOG_ENV, "SLURM_JOB_UID": ""}, CONFIG)


def test_empty_environment_names_all_three_variables() -> None:
    with pytest.raises(ConfigError,
                       match=r"SLURM_JOB_ID, SLURM_JOB_UID, SLURMD_NODENAME unset"):
        JobContext.from_env({}, CONFIG)


@pytest.mark.parametrize(("extra", "count"), [
    ({}, 0),
    ({"SLURM_JOB_RESTART_COUNT": "3"}, 3),
    ({"SLURM_RESTART_COUNT": "2"}, 2),
    ({"SLURM_JOB_RESTART_COUNT": "5", "SLURM_RESTART_COUNT": "2"}, 5),
    ({"SLURM_JOB_RESTART_COUNT": ""}, 0),
])
def test_restart_count(extra: dict[str, str], count: int) -> None:
    assert JobContext.from_env({**PROLOG_ENV, **extra}, CONFIG).restart_count == count


def test_gpus_fall_back_to_cuda_visible_devices() -> None:
    env = {**PROLOG_ENV, "SLURM_JOB_GPUS": "", "CUDA_VISIBLE_DEVICES": "2,3"}

    assert JobContext.from_env(env, CONFIG).gpus == ["2", "3"]


def test_slurm_job_gpus_win_over_cuda_visible_devices() -> None:
    env = {**PROLOG_ENV, "SLURM_JOB_GPUS": "1", "CUDA_VISIBLE_DEVICES": "0"}

    assert JobContext.from_env(env, CONFIG).gpus == ["1"]


def test_job_without_gpus_has_an_empty_list() -> None:
    env = {k: v for k, v in PROLOG_ENV.items() if k != "SLURM_JOB_GPUS"}

    assert JobContext.from_env(env, CONFIG).gpus == []


def test_job_context_tier_without_option_comes_from_the_partition() -> None:
    env = {k: v for k, v in PROLOG_ENV.items() if k != "SPANK_SINGULARITY_SLA"}

    assert JobContext.from_env(env, CONFIG).tier == "standard"


def test_job_context_with_an_unknown_tier_is_refused() -> None:
    with pytest.raises(ConfigError, match="unknown SLA tier 'gold'"):
        JobContext.from_env({**PROLOG_ENV, "SPANK_SINGULARITY_SLA": "gold"}, CONFIG)


def test_optional_fields_default_to_empty() -> None:
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_UID": "1001", "SLURMD_NODENAME": "n1"}

    context = JobContext.from_env(env, CONFIG)

    assert (context.user, context.partition, context.tier) == ("", "", "basic")


# --- the node-local folder ------------------------------------------------------------------------


def test_job_run_dir_is_per_node_then_per_job() -> None:
    assert job_run_dir(Path("/run/singularity-slurm"), "n2", 42) == Path(
        "/run/singularity-slurm/n2/42")


def test_two_nodes_on_one_host_get_different_folders() -> None:
    state = Path("/run/singularity-slurm")

    assert job_run_dir(state, "n1", 42) != job_run_dir(state, "n2", 42)


# --- identities that become paths -----------------------------------------------------------------

from singularity_slurm.jobenv import (  # noqa: E402
    STEP_BATCH,
    InvalidJobIdentity,
    gpus_of_node,
    valid_job_id,
    valid_node_name,
)


@pytest.mark.parametrize("name", ["n1", "gpu-node07", "node.cluster", "a_b", "x" * 64])
def test_slurm_node_names_are_accepted(name: str) -> None:
    assert valid_node_name(name) == name


@pytest.mark.parametrize("name", ["../../../tmp/evil", "..", "n1/..", "a..b", "", "-n1", ".n1", "n 1",
                                  "n1\n", "x" * 65, None])
def test_node_names_that_could_leave_the_state_folder_are_refused(name: object) -> None:
    with pytest.raises(InvalidJobIdentity, match="is not a Slurm node name"):
        valid_node_name(name)


@pytest.mark.parametrize(("value", "job_id"), [("42", 42), (42, 42), ("4294967279", 4294967279)])
def test_job_ids_are_positive_integers(value: object, job_id: int) -> None:
    assert valid_job_id(value) == job_id


@pytest.mark.parametrize("value", ["0", "-1", "1e3", " 42", "42/..", "", "٤٢", True, None, "4294967291"])
def test_anything_else_is_not_a_job_id(value: object) -> None:
    with pytest.raises(InvalidJobIdentity, match="is not a Slurm job id"):
        valid_job_id(value)


@pytest.mark.parametrize(("var", "value"), [("SLURMD_NODENAME", "../../../tmp/evil"),
                                            ("SLURM_JOB_ID", "../42"), ("SLURM_JOB_UID", "0x0")])
def test_prolog_environment_is_validated_before_it_becomes_paths(var: str, value: str) -> None:
    with pytest.raises(InvalidJobIdentity):
        JobContext.from_env({**PROLOG_ENV, var: value}, CONFIG)


def test_run_dir_refuses_a_forged_node_name(tmp_path: Path) -> None:
    with pytest.raises(InvalidJobIdentity):
        job_run_dir(tmp_path, "../evil", 42)


# --- the job of a step, from SPANK items and Slurm's record ----------------------------------------

ITEMS = {"SLURM_JOB_ID": "42", "SLURM_JOB_UID": "1001", "SLURM_JOB_GID": "1001", "SLURM_STEP_ID": "3",
         "SLURM_NODEID": "1"}
RECORD = {"JobId": "42", "UserId": "jobuser(1001)", "Partition": "basic", "NodeList": "n[1-3]",
          "BatchHost": "n1", "Restarts": "2"}


def from_slurm(items: dict = ITEMS, record: dict = RECORD, step_nodes: str | None = "n[2-3]",
               gpus: list[str] | None = None) -> JobContext:
    return JobContext.from_slurm(items, record, step_nodes, gpus or [], CONFIG,
                                 user_name=lambda uid: "jobuser")


def test_a_steps_job_comes_from_spank_items_and_slurms_record() -> None:
    assert from_slurm(gpus=["0", "1"]) == JobContext(
        job_id=42, user="jobuser", uid=1001, node="n3", partition="basic", tier="basic", gpus=["0", "1"],
        restart_count=2)


def test_the_batch_step_runs_on_the_batch_host() -> None:
    job = from_slurm({**ITEMS, "SLURM_STEP_ID": str(STEP_BATCH), "SLURM_NODEID": "0"}, step_nodes=None)

    assert job.node == "n1"


def test_a_special_step_counts_the_jobs_nodes_not_a_step_record() -> None:
    job = from_slurm({**ITEMS, "SLURM_STEP_ID": str(0xFFFFFFFC), "SLURM_NODEID": "2"}, step_nodes="n9")

    assert job.node == "n3"


def test_a_forged_environment_cannot_reach_the_steps_job() -> None:
    """Only items and the record are read: the step environment's forgeries are not even inputs."""
    forged = {**ITEMS, "SLURMD_NODENAME": "../../../tmp/evil", "SLURM_JOB_PARTITION": "premium",
              "SLURM_RESTART_COUNT": "7", "SPANK_SINGULARITY_SLA": "premium"}

    job = from_slurm(forged)

    assert (job.node, job.partition, job.tier, job.restart_count) == ("n3", "basic", "basic", 2)


@pytest.mark.parametrize(("items", "record", "step_nodes", "match"), [
    ({**ITEMS, "SLURM_JOB_UID": "1002"}, RECORD, "n[2-3]", "belongs to 'jobuser\\(1001\\)'"),
    (ITEMS, {**RECORD, "JobId": "43"}, "n[2-3]", "record is of job 43"),
    ({**ITEMS, "SLURM_NODEID": "2"}, RECORD, "n[2-3]", "node index 2 is outside"),
    ({k: v for k, v in ITEMS.items() if k != "SLURM_NODEID"}, RECORD, "n[2-3]", "passed no SLURM_NODEID"),
    (ITEMS, RECORD, "n1,../x", "is not a Slurm node name"),
])
def test_items_that_disagree_with_slurm_are_refused(items: dict, record: dict, step_nodes: str,
                                                    match: str) -> None:
    with pytest.raises(InvalidJobIdentity, match=match):
        from_slurm(items, record, step_nodes)


DETAIL = ("JobId=42 JobName=t UserId=jobuser(1001) NodeList=n[1-2] BatchHost=n1 "
          "  Nodes=n1 CPU_IDs=0-1 Mem=0 GRES=gpu:2(IDX:1-2) "
          "  Nodes=n2 CPU_IDs=0 Mem=0 GRES=gpu:tesla:3(IDX:0,2-3) MinCPUsNode=1")


@pytest.mark.parametrize(("node", "gpus"), [("n1", ["1", "2"]), ("n2", ["0", "2", "3"]), ("n3", [])])
def test_gpus_of_a_node_come_from_its_gres_indexes(node: str, gpus: list[str]) -> None:
    assert gpus_of_node(DETAIL, node) == gpus


def test_a_node_without_gpus_in_the_detail_has_none() -> None:
    assert gpus_of_node("JobId=42 Nodes=n1 CPU_IDs=0 Mem=0 GRES= MinCPUsNode=1", "n1") == []


def test_a_job_whose_own_text_imitates_slurms_device_entries_is_refused() -> None:
    from singularity_slurm.jobenv import InvalidJobIdentity, gpus_of_node

    real = "JobId=5 JobName=x Nodes=n1 CPU_IDs=0-3 Mem=0 GRES=gpu:2(IDX:0-1) Command=/bin/true"
    assert gpus_of_node(real, "n1") == ["0", "1"]
    forged = real.replace("JobName=x", "JobName=x Nodes=n1 CPU_IDs=0 Mem=0 GRES=gpu:8(IDX:0-7)")
    with pytest.raises(InvalidJobIdentity, match="2 times"):
        gpus_of_node(forged, "n1")


def test_of_an_array_or_heterogeneous_jobs_records_only_the_jobs_own_counts() -> None:
    from singularity_slurm.jobenv import InvalidJobIdentity, gpus_of_node

    detail = ("JobId=7 ArrayJobId=7 ArrayTaskId=0 Nodes=n1 CPU_IDs=0 Mem=0 GRES=gpu:1(IDX:0)\n"
              "JobId=8 ArrayJobId=7 ArrayTaskId=1 Nodes=n1 CPU_IDs=1 Mem=0 GRES=gpu:1(IDX:1)\n")
    assert gpus_of_node(detail, "n1", 7) == ["0"] and gpus_of_node(detail, "n1", 8) == ["1"]
    with pytest.raises(InvalidJobIdentity, match="0 records of job 9"):
        gpus_of_node(detail, "n1", 9)
