"""The dev cluster's configuration files, rendered from a Layout and the Slurm version."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from singularity_slurm.config import parse
from singularity_slurm.devcluster.render import (
    GPUS_PER_NODE,
    Layout,
    preempt_signal_setting,
    render_cgroup_conf,
    render_gres_conf,
    render_redis_conf,
    render_singularity_config,
    render_slurm_conf,
)
from singularity_slurm.slurmcli import SlurmVersion, parse_record

LAYOUT = Layout(hostname="devhost")
CONFIG = parse({})
V2205 = SlurmVersion(22, 5, 8)
V2411 = SlurmVersion(24, 11, 5)


def conf_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def settings(text: str) -> dict[str, str]:
    """Single-key lines of slurm.conf (the node and partition lines hold several)."""
    return dict(line.split("=", 1) for line in conf_lines(text) if " " not in line)


def records(text: str, key: str) -> list[dict[str, str]]:
    return [parse_record(line) for line in conf_lines(text) if line.startswith(f"{key}=")]


# --- the preemption signal setting moved in 23.02 -------------------------------------------------


@pytest.mark.parametrize(("version", "setting"), [
    (SlurmVersion(22, 5, 0), ("SlurmctldParameters", "preempt_send_user_signal")),
    (SlurmVersion(22, 5, 11), ("SlurmctldParameters", "preempt_send_user_signal")),
    (SlurmVersion(23, 2, 0), ("PreemptParameters", "send_user_signal")),
    (SlurmVersion(23, 11, 4), ("PreemptParameters", "send_user_signal")),
    (V2411, ("PreemptParameters", "send_user_signal")),
])
def test_preempt_signal_setting_per_version(version: SlurmVersion,
                                            setting: tuple[str, str]) -> None:
    assert preempt_signal_setting(version) == setting


def test_slurm_22_05_conf_uses_slurmctld_parameters_only() -> None:
    conf = settings(render_slurm_conf(LAYOUT, CONFIG, V2205))

    assert conf["SlurmctldParameters"] == "preempt_send_user_signal"
    assert "PreemptParameters" not in conf


def test_slurm_24_11_conf_uses_preempt_parameters_only() -> None:
    conf = settings(render_slurm_conf(LAYOUT, CONFIG, V2411))

    assert conf["PreemptParameters"] == "send_user_signal"
    assert "SlurmctldParameters" not in conf


def test_every_key_is_set_once() -> None:
    lines = conf_lines(render_slurm_conf(LAYOUT, CONFIG, V2411))
    keys = [line.split("=", 1)[0] for line in lines if " " not in line]

    assert len(keys) == len(set(keys))


def test_preemption_and_policy_settings() -> None:
    conf = settings(render_slurm_conf(LAYOUT, CONFIG, V2205))

    assert {k: conf[k] for k in ("PreemptType", "PreemptMode", "JobRequeue", "PrologFlags",
                                 "JobSubmitPlugins", "CliFilterPlugins", "GresTypes")} == {
        "PreemptType": "preempt/partition_prio", "PreemptMode": "REQUEUE", "JobRequeue": "1",
        "PrologFlags": "Alloc,Contain", "JobSubmitPlugins": "lua", "CliFilterPlugins": "lua",
        "GresTypes": "gpu",
    }
    assert conf["SlurmctldHost"] == "devhost(127.0.0.1)"
    assert conf["PlugStackConfig"] == "/etc/slurm/plugstack.conf"


# --- partitions -----------------------------------------------------------------------------------


def test_one_requeue_partition_per_tier_with_grace_time() -> None:
    partitions = records(render_slurm_conf(LAYOUT, CONFIG, V2205), "PartitionName")

    assert [(p["PartitionName"], p["PriorityTier"], p["PreemptMode"], p["GraceTime"], p["Default"])
            for p in partitions] == [
        ("premium", "30", "REQUEUE", "30", "NO"),
        ("standard", "20", "REQUEUE", "30", "NO"),
        ("basic", "10", "REQUEUE", "30", "YES"),
    ]
    assert {p["Nodes"] for p in partitions} == {"n1,n2,n3"}


def test_partitions_follow_the_configuration() -> None:
    config = parse({"tiers": {"default": "premium", "premium": {"partition": "gpu-hi"},
                              "basic": {"partition": "scav"}}})
    layout = Layout(hostname="devhost", grace_time=120)

    partitions = records(render_slurm_conf(layout, config, V2411), "PartitionName")

    assert [(p["PartitionName"], p["GraceTime"], p["Default"]) for p in partitions] == [
        ("gpu-hi", "120", "YES"), ("standard", "120", "NO"), ("scav", "120", "NO"),
    ]


# --- prolog, epilog and nodes ---------------------------------------------------------------------


def test_prolog_and_epilog_are_the_venv_entry_points_under_the_prefix() -> None:
    layout = Layout(hostname="devhost", prefix=Path("/srv/sing"))

    conf = settings(render_slurm_conf(layout, CONFIG, V2205))

    assert conf["Prolog"] == "/srv/sing/venv/bin/singularity-prolog"
    assert conf["Epilog"] == "/srv/sing/venv/bin/singularity-epilog"


def test_three_nodes_on_one_host_with_distinct_ports_and_gpus() -> None:
    nodes = records(render_slurm_conf(LAYOUT, CONFIG, V2205), "NodeName")

    assert [(n["NodeName"], n["NodeHostname"], n["NodeAddr"], n["Port"], n["Gres"])
            for n in nodes] == [
        ("n1", "devhost", "127.0.0.1", "6819", "gpu:4"),
        ("n2", "devhost", "127.0.0.1", "6820", "gpu:4"),
        ("n3", "devhost", "127.0.0.1", "6821", "gpu:4"),
    ]
    assert LAYOUT.spare_nodes == ("n3",)  # drained at `up`: only tests that resume it use it


def test_node_ports_count_up_from_the_base_port() -> None:
    layout = Layout(hostname="h", nodes=("a", "b", "c"), slurmd_base_port=7000)

    ports = [n["Port"] for n in records(render_slurm_conf(layout, CONFIG, V2205), "NodeName")]

    assert ports == ["7001", "7002", "7003"]


def test_default_layout_keeps_slurmd_ports_clear_of_slurmctld() -> None:
    text = render_slurm_conf(LAYOUT, CONFIG, V2205)

    assert settings(text)["SlurmctldPort"] == "6817"
    assert "6817" not in [n["Port"] for n in records(text, "NodeName")]


def test_per_node_files_use_the_node_name_placeholder() -> None:
    conf = settings(render_slurm_conf(LAYOUT, CONFIG, V2205))

    assert conf["SlurmdSpoolDir"] == "/var/lib/singularity-devcluster/slurmd-%n"
    assert conf["SlurmdPidFile"] == "/run/singularity-devcluster/slurm/slurmd-%n.pid"
    assert conf["SlurmdLogFile"] == "/var/log/singularity-devcluster/slurmd-%n.log"


def test_slurm_tracks_the_jobs_processes_in_cgroups_with_an_extern_step() -> None:
    conf = settings(render_slurm_conf(LAYOUT, CONFIG, V2205))

    assert (conf["ProctrackType"], conf["TaskPlugin"]) == ("proctrack/cgroup", "task/cgroup")
    assert "Contain" in conf["PrologFlags"].split(",")
    assert conf_lines(render_cgroup_conf()) == ["CgroupPlugin=autodetect", "ConstrainDevices=yes",
                                                "ConstrainCores=no", "ConstrainRAMSpace=no"]


# --- gres.conf and fake GPUs ----------------------------------------------------------------------


def test_gres_conf_turns_autodetect_off_and_lists_each_nodes_devices() -> None:
    assert conf_lines(render_gres_conf(LAYOUT)) == [
        "AutoDetect=off",
        "NodeName=n1 Name=gpu File=/dev/singularity-fakegpu/n1/nvidia[0-3]",
        "NodeName=n2 Name=gpu File=/dev/singularity-fakegpu/n2/nvidia[0-3]",
        "NodeName=n3 Name=gpu File=/dev/singularity-fakegpu/n3/nvidia[0-3]",
    ]


def test_gpu_devices_have_minors_distinct_across_nodes() -> None:
    first, second = LAYOUT.gpu_devices(0), LAYOUT.gpu_devices(1)

    assert first == [(Path(f"/dev/singularity-fakegpu/n1/nvidia{i}"), i) for i in range(4)]
    assert [minor for _, minor in second] == [4, 5, 6, 7]
    assert {p.parent.name for p, _ in second} == {"n2"}
    assert len(first) == len(second) == GPUS_PER_NODE


def test_gpu_minors_stay_distinct_with_more_nodes() -> None:
    layout = Layout(hostname="h", nodes=("a", "b", "c"))
    minors = [minor for i in range(3) for _, minor in layout.gpu_devices(i)]

    assert len(set(minors)) == len(minors) == 3 * GPUS_PER_NODE


# --- Redis and the Singularity configuration ------------------------------------------------------


def test_redis_conf_requires_the_password_and_listens_only_on_a_socket_of_its_own() -> None:
    lines = conf_lines(render_redis_conf(LAYOUT, "s3cret"))

    assert "requirepass s3cret" in lines
    assert "port 0" in lines  # no TCP port any local user could fill with connections
    assert f"unixsocket {LAYOUT.run_dir}/redis/redis.sock" in lines
    assert "unixsocketperm 770" in lines  # the redis user and group; root reaches it too
    assert "protected-mode yes" in lines


def test_singularity_config_is_valid_and_warns_within_the_grace_time() -> None:
    layout = Layout(hostname="h", grace_time=45, prefix=Path("/srv/sing"), singularity_etc=Path("/srv/etc"),
                    run_dir=Path("/srv/run"))

    config = parse(tomllib.loads(render_singularity_config(layout)))

    assert config.default_tier == "basic"
    assert config.preemption.sbatch_signal == "URG@45"
    assert config.redis.socket == Path("/srv/run/redis/redis.sock")
    assert config.redis.address == "unix:/srv/run/redis/redis.sock"
    assert config.redis.password_file == Path("/srv/etc/redis.password")
    assert config.paths.prefix == Path("/srv/sing")


def test_no_rendered_file_leaves_a_python_repr() -> None:
    texts = [render_slurm_conf(LAYOUT, CONFIG, V2205), render_gres_conf(LAYOUT), render_cgroup_conf(),
             render_redis_conf(LAYOUT, "pw"), render_singularity_config(LAYOUT)]

    assert [t for t in texts if re.search(r"PosixPath|None|\{|\}", t)] == []


def test_the_dev_cluster_has_two_distinct_unprivileged_job_users() -> None:
    assert LAYOUT.job_users == ("jobuser", "jobuser2")
    assert Layout(hostname="h", job_user="a", other_user="b").job_users == ("a", "b")


def test_the_dev_clusters_own_config_is_rewritten_and_a_hand_written_one_kept(tmp_path: Path) -> None:
    from singularity_slurm.devcluster.render import is_generated_config

    path = tmp_path / "config.toml"
    assert is_generated_config(path)  # none yet
    path.write_text("# Singularity configuration of the dev cluster (see contrib/config/config.toml "
                    "for every key).\n[tiers]\n")  # an earlier version's
    assert is_generated_config(path)
    path.write_text(render_singularity_config(LAYOUT))
    assert is_generated_config(path)
    path.write_text("# mine\n" + render_singularity_config(LAYOUT))
    assert not is_generated_config(path)


def test_the_dev_cluster_keeps_no_ended_jobs_checkpoints_and_arms_fault_points() -> None:
    config = parse(tomllib.loads(render_singularity_config(LAYOUT)))
    assert (config.store.retention_min, config.testing.faults) == (0, True)
