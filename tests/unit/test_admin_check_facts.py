"""`admin check`: facts in, PASS/FAIL lines out, each FAIL naming the key and the fix."""

from __future__ import annotations

import dataclasses

import pytest

from singularity_slurm.config import Config, parse
from singularity_slurm.slurm_plugin import policy
from singularity_slurm.slurm_plugin.admin_check import Facts, Result, evaluate, results_json
from singularity_slurm.slurmcli import SlurmVersion

CONFIG = parse({})
SLURM_CONF = "/etc/slurm/slurm.conf"
PROLOG = "/opt/singularity-slurm/venv/bin/singularity-prolog"
EPILOG = "/opt/singularity-slurm/venv/bin/singularity-epilog"
LIBRARY = "/opt/singularity-slurm/lib/singularity_sla.so"
CRIU = "/opt/singularity-slurm/criu/bin/criu"
RESTART = f"in {SLURM_CONF}, then restart slurmctld"


def partition(name: str, priority: int, mode: str = "REQUEUE", grace: str = "60") -> dict[str, str]:
    return {"PartitionName": name, "PriorityTier": str(priority), "PreemptMode": mode,
            "GraceTime": grace, "State": "UP"}


V2205 = SlurmVersion(22, 5, 8)
V2411 = SlurmVersion(24, 11, 5)


def good_facts(version: SlurmVersion = V2205, config: Config = CONFIG) -> Facts:
    """A cluster on which everything is in place."""
    signal_setting = (
        {"SlurmctldParameters": "enable_configless,preempt_send_user_signal"}
        if version < SlurmVersion(23, 2) else {"PreemptParameters": "send_user_signal"}
    )
    return Facts(
        slurm_version=version,
        slurm_config={
            "SLURM_CONF": SLURM_CONF,
            "SlurmUser": "slurm(64030)",
            "PreemptType": "preempt/partition_prio",
            "PreemptMode": "REQUEUE",
            "JobRequeue": "1",
            **signal_setting,
            "Prolog": PROLOG,
            "Epilog": EPILOG,
            "PrologFlags": "Alloc,Contain",
            "ProctrackType": "proctrack/cgroup",
            "JobSubmitPlugins": "lua",
            "CliFilterPlugins": "lua",
            "PlugStackConfig": "/etc/slurm/plugstack.conf",
        },
        partitions={
            "premium": partition("premium", 30, mode="OFF", grace="0"),
            "standard": partition("standard", 20),
            "basic": partition("basic", 10),
        },
        files={
            "/etc/slurm/job_submit.lua": policy.render_job_submit(config, 64030),
            "/etc/slurm/cli_filter.lua": policy.render_cli_filter(config),
            "/etc/slurm/plugstack.conf": "include /etc/slurm/plugstack.conf.d/*.conf\n",
            "/etc/slurm/plugstack.conf.d/singularity-sla.conf":
                policy.render_plugstack_line(config) + "\n",
        },
        executables={PROLOG: True, EPILOG: True, LIBRARY: True},
        sbatch_help="Usage: sbatch [OPTIONS...]\n  --singularity-sla=TIER  SLA tier of the job\n",
        criu_path=CRIU,
        criu_version=(4, 1),
        criu_check="Warn  (criu/kerndat.c:1): something optional\nLooks good.\n",
        criu_options={"share-cow": True, "track-writes": True, "track-incremental": True},
        kernel_tracks_writes=True,
        pycriu=True,
        redis_error=None,
        redis_requires_auth=True,
        redis_eviction="noeviction",
    )


def with_conf(facts: Facts, **changes: str | None) -> Facts:
    conf = dict(facts.slurm_config)
    for key, value in changes.items():
        if value is None:
            conf.pop(key, None)
        else:
            conf[key] = value
    return dataclasses.replace(facts, slurm_config=conf)


def failures(facts: Facts, config: Config = CONFIG) -> list[Result]:
    return [r for r in evaluate(facts, config) if not r.ok]


def only_failure(facts: Facts, config: Config = CONFIG) -> Result:
    failed = failures(facts, config)
    assert len(failed) == 1, [r.line() for r in failed]
    return failed[0]


ALL_NAMES_2205 = [
    "config", "slurm version", "slurm.conf PreemptType", "slurm.conf PreemptMode",
    "slurm.conf JobRequeue", "slurm.conf SlurmctldParameters", "slurm.conf Prolog",
    "slurm.conf Epilog", "slurm.conf PrologFlags", "slurm.conf ProctrackType", "slurm.conf JobSubmitPlugins",
    "slurm.conf CliFilterPlugins", "partition premium (tier premium)",
    "partition standard (tier standard) PreemptMode",
    "partition standard (tier standard) GraceTime",
    "partition basic (tier basic) PreemptMode", "partition basic (tier basic) GraceTime",
    "tier priorities", "job_submit.lua", "cli_filter.lua", "SPANK plugin", "criu version",
    "criu check", "criu patches", "dirty tracking", "pycriu", "redis", "redis auth", "redis eviction",
]


# --- a correct cluster ----------------------------------------------------------------------------


def test_correct_slurm_22_05_cluster_passes_every_check() -> None:
    results = evaluate(good_facts(V2205), CONFIG)

    assert [r.name for r in results] == ALL_NAMES_2205
    assert [r.line() for r in results if not r.ok] == []


def test_correct_slurm_24_11_cluster_checks_preempt_parameters_instead() -> None:
    results = evaluate(good_facts(V2411), CONFIG)

    names = [r.name for r in results]
    assert names == [
        "slurm.conf PreemptParameters" if n == "slurm.conf SlurmctldParameters" else n
        for n in ALL_NAMES_2205
    ]
    assert [r.line() for r in results if not r.ok] == []


def test_passing_lines_show_what_was_found() -> None:
    results = {r.name: r for r in evaluate(good_facts(), CONFIG)}

    assert results["config"].detail == "Singularity configuration valid (built-in defaults)"
    assert results["slurm version"].detail == "Slurm 22.05.8"
    assert results["tier priorities"].detail == "PriorityTier premium > standard > basic"
    assert results["job_submit.lua"].detail == "/etc/slurm/job_submit.lua matches the configuration"
    assert results["SPANK plugin"].detail == (
        f"{LIBRARY} loaded, `sbatch --help` lists --singularity-sla"
    )
    assert results["redis auth"].detail == "refuses unauthenticated clients"


def test_custom_config_is_checked_against_its_own_partitions() -> None:
    config = parse({"tiers": {"premium": {"partition": "gpu-hi"}, "basic": {"partition": "scav"}}})
    facts = good_facts(config=config)
    facts.partitions = {
        "gpu-hi": partition("gpu-hi", 30), "standard": partition("standard", 20),
        "scav": partition("scav", 10),
    }

    results = evaluate(facts, config)

    assert [r.line() for r in results if not r.ok] == []
    assert "partition scav (tier basic) PreemptMode" in [r.name for r in results]


# --- single faults --------------------------------------------------------------------------------


def test_slurm_unreachable_is_one_early_failure() -> None:
    facts = Facts(slurm_version=None, slurm_error="Unable to contact slurm controller")

    results = evaluate(facts, CONFIG)

    assert results == [
        Result("config", True, "Singularity configuration valid (built-in defaults)"),
        Result("slurm", False, "cannot talk to Slurm: Unable to contact slurm controller",
               "start slurmctld (dev cluster: `singularityctl devcluster up`)"),
    ]


def test_slurm_older_than_22_05_fails() -> None:
    failed = only_failure(dataclasses.replace(good_facts(), slurm_version=SlurmVersion(21, 8, 8)))

    assert (failed.name, failed.detail, failed.fix) == (
        "slurm version", "Slurm 21.08.8", "Singularity needs Slurm >= 22.05.0")


def test_basic_partition_that_is_not_preempted_by_requeue_fails() -> None:
    facts = good_facts()
    facts.partitions["basic"]["PreemptMode"] = "OFF"

    failed = only_failure(facts)

    assert failed == Result(
        "partition basic (tier basic) PreemptMode", False, "PreemptMode=OFF",
        f"set PreemptMode=REQUEUE on PartitionName=basic in {SLURM_CONF}, "
        "then `scontrol reconfigure`")


def test_missing_tier_partition_fails_and_skips_the_priority_order() -> None:
    facts = good_facts()
    del facts.partitions["standard"]

    failed = failures(facts)

    assert failed == [Result("partition standard (tier standard)", False, "missing",
                             f"add PartitionName=standard to {SLURM_CONF} (see the admin guide)")]
    assert "tier priorities" not in [r.name for r in evaluate(facts, CONFIG)]


def test_grace_time_shorter_than_the_warning_fails() -> None:
    facts = good_facts()
    facts.partitions["standard"]["GraceTime"] = "30"

    failed = only_failure(facts)

    assert failed.name == "partition standard (tier standard) GraceTime"
    assert failed.detail == "GraceTime=30s, warning signal 60s before the kill"
    assert failed.fix == (
        "set GraceTime>=60 on PartitionName=standard "
        "(time to checkpoint before Slurm kills the job)"
    )


def test_tiers_with_priorities_out_of_order_fail() -> None:
    facts = good_facts()
    facts.partitions["basic"]["PriorityTier"] = "25"

    failed = only_failure(facts)

    assert (failed.name, failed.detail) == (
        "tier priorities", "PriorityTier premium=30 standard=20 basic=25")


@pytest.mark.parametrize("value", [None, "", "enable_configless"])
def test_slurm_22_05_without_preempt_send_user_signal_fails_on_slurmctld_parameters(
        value: str | None) -> None:
    failed = only_failure(with_conf(good_facts(V2205), SlurmctldParameters=value))

    assert failed.name == "slurm.conf SlurmctldParameters"
    assert failed.detail == f"SlurmctldParameters={value or '(unset)'}"
    assert failed.fix == (
        "add preempt_send_user_signal to SlurmctldParameters (so preemption sends the job's "
        f"warning signal to the launcher, which checkpoints the job) {RESTART}"
    )


def test_slurm_24_11_without_send_user_signal_fails_on_preempt_parameters() -> None:
    facts = with_conf(good_facts(V2411), PreemptParameters=None,
                      SlurmctldParameters="preempt_send_user_signal")

    failed = only_failure(facts)

    assert failed.name == "slurm.conf PreemptParameters"
    assert failed.detail == "PreemptParameters=(unset)"
    assert failed.fix == (
        "add send_user_signal to PreemptParameters (so preemption sends the job's warning signal to "
        f"the launcher, which checkpoints the job) {RESTART}"
    )


def test_user_signal_flag_is_found_in_a_list_whatever_its_case_and_spacing() -> None:
    facts = with_conf(good_facts(SlurmVersion(23, 2, 0)),
                      PreemptParameters="strict_order, Send_User_Signal;reclaim_licenses")

    assert failures(facts) == []


def test_prolog_that_is_not_executable_fails_and_says_so() -> None:
    facts = good_facts()
    facts.executables[PROLOG] = False

    failed = only_failure(facts)

    assert failed == Result(
        "slurm.conf Prolog", False, f"Prolog={PROLOG} (not an executable file)",
        f"set Prolog={PROLOG} (install the project there: `make install`) {RESTART}")


def test_epilog_pointing_elsewhere_fails() -> None:
    failed = only_failure(with_conf(good_facts(), Epilog="/usr/local/bin/epilog.sh"))

    assert failed.name == "slurm.conf Epilog"
    assert failed.detail == "Epilog=/usr/local/bin/epilog.sh (not an executable file)"


def test_unset_prolog_fails() -> None:
    failed = only_failure(with_conf(good_facts(), Prolog=None))

    assert (failed.name, failed.detail) == ("slurm.conf Prolog", "Prolog=(unset)")


@pytest.mark.parametrize(("key", "value", "detail"), [
    ("PreemptType", "preempt/qos", "PreemptType=preempt/qos"),
    ("PreemptMode", "OFF", "PreemptMode=OFF"),
    ("JobRequeue", "0", "JobRequeue=0"),
    ("PrologFlags", "Contain", "PrologFlags=Contain"),
    ("PrologFlags", "Alloc", "PrologFlags=Alloc"),
    ("ProctrackType", "proctrack/linuxproc", "ProctrackType=proctrack/linuxproc"),
    ("JobSubmitPlugins", None, "JobSubmitPlugins=(unset)"),
    ("CliFilterPlugins", None, "CliFilterPlugins=(unset)"),
])
def test_wrong_cluster_wide_setting_fails_on_that_key(key: str, value: str | None,
                                                      detail: str) -> None:
    failed = only_failure(with_conf(good_facts(), **{key: value}))

    assert (failed.name, failed.detail) == (f"slurm.conf {key}", detail)
    assert failed.fix.endswith(RESTART)


def test_job_submit_lua_that_differs_fails() -> None:
    facts = good_facts()
    facts.files["/etc/slurm/job_submit.lua"] += "-- local edit\n"

    failed = only_failure(facts)

    assert failed == Result("job_submit.lua", False,
                            "/etc/slurm/job_submit.lua differs from the configuration",
                            "run `singularityctl admin install-policy`")


def test_job_submit_lua_of_another_configuration_differs() -> None:
    facts = good_facts(config=parse({"tiers": {"default": "premium"}}))

    failed = only_failure(facts)

    assert failed.name == "job_submit.lua"


def test_job_submit_lua_rendered_for_another_slurm_user_differs() -> None:
    # The policy lets SlurmUser update any job: a file made for another SlurmUser is stale.
    facts = with_conf(good_facts(), SlurmUser="slurm(64031)")

    failed = only_failure(facts)

    assert failed.name == "job_submit.lua"


def test_job_submit_lua_of_a_cluster_whose_slurm_user_is_root_matches() -> None:
    facts = with_conf(good_facts(), SlurmUser="root(0)")
    facts.files["/etc/slurm/job_submit.lua"] = policy.render_job_submit(CONFIG, 0)

    assert failures(facts) == []


def test_missing_cli_filter_lua_fails() -> None:
    facts = good_facts()
    facts.files["/etc/slurm/cli_filter.lua"] = None

    failed = only_failure(facts)

    assert (failed.name, failed.detail) == ("cli_filter.lua", "/etc/slurm/cli_filter.lua missing")


def test_policy_files_are_looked_for_next_to_slurm_conf() -> None:
    facts = with_conf(good_facts(), SLURM_CONF="/srv/slurm/etc/slurm.conf")

    names = {r.name: r.detail for r in failures(facts)}

    assert names == {"job_submit.lua": "/srv/slurm/etc/job_submit.lua missing",
                     "cli_filter.lua": "/srv/slurm/etc/cli_filter.lua missing"}


def test_spank_plugin_not_listed_by_sbatch_fails() -> None:
    failed = only_failure(dataclasses.replace(good_facts(), sbatch_help="Usage: sbatch\n"))

    assert failed.name == "SPANK plugin"
    assert failed.detail == f"{LIBRARY} wired but `sbatch --help` does not list --singularity-sla"


def test_spank_plugin_not_in_plugstack_fails() -> None:
    facts = good_facts()
    facts.files["/etc/slurm/plugstack.conf.d/singularity-sla.conf"] = None

    failed = only_failure(facts)

    assert failed.detail == f"{LIBRARY} not wired into /etc/slurm/plugstack.conf"


def test_spank_plugin_that_is_not_built_fails() -> None:
    facts = good_facts()
    facts.executables[LIBRARY] = False

    assert only_failure(facts).name == "SPANK plugin"


def test_criu_3_17_fails_with_the_version_needed() -> None:
    failed = only_failure(dataclasses.replace(good_facts(), criu_version=(3, 17)))

    assert failed == Result("criu version", False, f"{CRIU}: 3.17",
                            "CRIU >= 4.0 is needed (Debian 12's 3.17 fails on current kernels)")


def test_criu_of_unknown_version_fails() -> None:
    failed = only_failure(dataclasses.replace(good_facts(), criu_version=None))

    assert (failed.name, failed.detail) == ("criu version", f"{CRIU}: unknown")


def test_criu_check_without_looks_good_fails_showing_its_last_line() -> None:
    check = "Error (criu/cr-check.c:1234): Kernel doesn't support PTRACE_O_SUSPEND_SECCOMP\n" \
            "Error (criu/cr-check.c:1500): Some checks failed\n"

    failed = only_failure(dataclasses.replace(good_facts(), criu_check=check))

    assert failed == Result("criu check", False,
                            "Error (criu/cr-check.c:1500): Some checks failed",
                            f"run `{CRIU} check` as root and fix what it reports")


def test_criu_check_without_output_fails() -> None:
    failed = only_failure(dataclasses.replace(good_facts(), criu_check=""))

    assert (failed.name, failed.detail) == ("criu check", "no output")


def test_missing_criu_is_one_failure() -> None:
    failed = only_failure(dataclasses.replace(good_facts(), criu_path=None))

    assert failed == Result("criu", False, "criu not found",
                            "install CRIU >= 4.0 (dev cluster: `singularityctl devcluster up` "
                            "bundles it)")


def test_missing_pycriu_fails() -> None:
    failed = only_failure(dataclasses.replace(good_facts(), pycriu=False))

    assert failed == Result("pycriu", False, "not importable",
                            "install pycriu (Debian's python3-pycriu) into the project's venv")


def test_unreachable_redis_fails_once_and_skips_the_auth_check() -> None:
    error = "cannot reach Redis at 127.0.0.1:6379 (Connection refused); is redis-server running?"
    facts = dataclasses.replace(good_facts(), redis_error=error, redis_requires_auth=None)

    results = evaluate(facts, CONFIG)

    assert [r for r in results if not r.ok] == [
        Result("redis", False, error,
               "start Redis and check /etc/singularity-slurm/redis.password"),
    ]
    assert "redis auth" not in [r.name for r in results]


def test_redis_that_was_never_checked_fails() -> None:
    facts = dataclasses.replace(good_facts(), redis_error=Facts().redis_error)

    assert only_failure(facts).detail == "not checked"


def test_redis_without_auth_fails_on_auth() -> None:
    failed = only_failure(dataclasses.replace(good_facts(), redis_requires_auth=False))

    assert failed == Result(
        "redis auth", False, "accepts clients without a password",
        "set requirepass in redis.conf and put the password in "
        "/etc/singularity-slurm/redis.password")


def test_redis_that_may_evict_keys_fails_and_one_that_hides_its_config_passes_with_a_reminder() -> None:
    failed = only_failure(dataclasses.replace(good_facts(), redis_eviction="allkeys-lru"))

    assert failed == Result(
        "redis eviction", False,
        "maxmemory-policy allkeys-lru: Redis may drop registry and checkpoint index keys",
        "set maxmemory-policy noeviction in redis.conf")
    hidden = {r.name: r for r in evaluate(dataclasses.replace(good_facts(), redis_eviction=None), CONFIG)}
    assert hidden["redis eviction"].ok and "maxmemory-policy noeviction" in hidden["redis eviction"].detail


# --- output ---------------------------------------------------------------------------------------


def test_failing_line_carries_the_fix_on_its_own_line() -> None:
    result = Result("pycriu", False, "not importable", "install pycriu")

    assert result.line() == "FAIL  pycriu: not importable\n      fix: install pycriu"


def test_passing_line_has_no_fix() -> None:
    result = Result("pycriu", True, "importable", "install pycriu")

    assert result.line() == "PASS  pycriu: importable"


def test_results_json_keeps_every_field() -> None:
    assert results_json([Result("a", False, "b", "c"), Result("d", True, "e")]) == [
        {"name": "a", "ok": False, "detail": "b", "fix": "c"},
        {"name": "d", "ok": True, "detail": "e", "fix": ""},
    ]


def test_a_stock_criu_is_named_with_what_it_costs_and_how_to_get_the_patched_one() -> None:
    failed = only_failure(dataclasses.replace(good_facts(), criu_options={
        "share-cow": False, "track-writes": False, "track-incremental": False}))
    assert failed.name == "criu patches"
    assert "lacks --share-cow, --track-incremental, --track-writes" in failed.detail
    assert "criu_patches" in failed.fix


def test_a_kernel_without_asynchronous_write_protect_says_every_dump_reads_every_page() -> None:
    failed = only_failure(dataclasses.replace(good_facts(), kernel_tracks_writes=False))
    assert failed.name == "dirty tracking" and "every dump reads and stores every page" in failed.detail
    assert "6.7" in failed.fix
