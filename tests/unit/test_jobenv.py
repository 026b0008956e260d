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
