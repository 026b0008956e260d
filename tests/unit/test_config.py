"""The admin configuration: defaults, validation with the valid choices named, and loading."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from singularity_slurm import config as config_module
from singularity_slurm.config import (
    CONFIG_ENV,
    KEYS,
    TIERS,
    AdminConfig,
    Config,
    PreemptionConfig,
    ProxyConfig,
    RedisConfig,
    load,
    parse,
)
from singularity_slurm.errors import ConfigError


@pytest.fixture(autouse=True)
def _no_config_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CONFIG_ENV, raising=False)


def config_error(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        parse(data)
    return str(info.value)


# --- defaults -------------------------------------------------------------------------------------


def test_empty_document_gives_three_tiers_highest_first() -> None:
    config = parse({})

    assert tuple(config.tiers) == ("premium", "standard", "basic")
    assert TIERS == ("premium", "standard", "basic")


def test_each_tier_runs_in_the_partition_named_after_it_by_default() -> None:
    config = parse({})

    assert {name: tier.partition for name, tier in config.tiers.items()} == {
        "premium": "premium", "standard": "standard", "basic": "basic",
    }


def test_default_tier_is_basic() -> None:
    assert parse({}).default_tier == "basic"


def test_default_checkpoint_intervals_per_tier() -> None:
    config = parse({})

    assert {name: tier.checkpoint_interval_min for name, tier in config.tiers.items()} == {
        "premium": 0, "standard": 60, "basic": 30,
    }


def test_default_preemption_warns_with_usr2_sixty_seconds_ahead() -> None:
    config = parse({})

    assert config.preemption == PreemptionConfig(signal="URG", warn_time=60)
    assert config.preemption.sbatch_signal == "URG@60"


def test_default_redis_and_paths() -> None:
    config = parse({})

    assert config.redis == RedisConfig(
        host="127.0.0.1", port=6379, db=0,
        password_file=Path("/etc/singularity-slurm/redis.password"),
    )
    assert config.redis.address == "127.0.0.1:6379"
    assert config.paths.state_dir == Path("/run/singularity-slurm")
    assert config.paths.store_root == Path("/var/lib/singularity-slurm/store")
    assert config.paths.prefix == Path("/opt/singularity-slurm")
    assert config.paths.spool_dir == Path("/var/spool/singularity-slurm")
    assert config.source is None


def test_a_redis_socket_is_used_instead_of_tcp_and_must_be_absolute() -> None:
    config = parse({"redis": {"socket": "/run/redis/redis.sock"}})
    assert (config.redis.socket, config.redis.address) == (Path("/run/redis/redis.sock"),
                                                           "unix:/run/redis/redis.sock")
    assert config_error({"redis": {"socket": "redis.sock"}}) == (
        "redis.socket must be an absolute path (or empty for TCP), got 'redis.sock'")


def test_sla_targets_per_tier() -> None:
    config = parse({})

    assert [config.tiers[t].sla_target for t in TIERS] == [0.95, 0.70, 0.0]


def test_config_is_frozen() -> None:
    config = parse({})

    with pytest.raises(dataclasses.FrozenInstanceError):
        config.default_tier = "premium"  # type: ignore[misc]


# --- values that are accepted ---------------------------------------------------------------------


def test_custom_partitions_and_default_tier_are_taken() -> None:
    config = parse({"tiers": {
        "default": "standard",
        "premium": {"partition": "gpu-hi", "checkpoint_interval_min": 15},
        "standard": {"partition": "gpu"},
        "basic": {"partition": "scavenge"},
    }})

    assert config.default_tier == "standard"
    assert config.tiers["premium"].partition == "gpu-hi"
    assert config.tiers["premium"].checkpoint_interval_min == 15
    assert config.tiers["standard"].partition == "gpu"
    assert config.tiers["basic"].partition == "scavenge"


@pytest.mark.parametrize(("given", "stored"), [
    ("USR1", "USR1"), ("usr1", "USR1"), ("SIGUSR2", "USR2"), ("sigterm", "TERM"),
])
def test_signal_is_stored_upper_case_without_sig_prefix(given: str, stored: str) -> None:
    config = parse({"preemption": {"signal": given, "warn_time": 30}})

    assert config.preemption.signal == stored
    assert config.preemption.sbatch_signal == f"{stored}@30"


@pytest.mark.parametrize("warn_time", [1, 65535])
def test_warn_time_bounds_are_inclusive(warn_time: int) -> None:
    assert parse({"preemption": {"warn_time": warn_time}}).preemption.warn_time == warn_time


# --- unknown keys are refused with the valid ones listed ------------------------------------------


def test_unknown_top_level_section_lists_valid_sections() -> None:
    assert config_error({"tier": {}}) == (
        "unknown key(s) in [top level]: tier; valid keys: admin, elastic, gpu, local_files, paths, "
        "preemption, proxy, redis, sla, store, testing, tiers"
    )


def test_gpu_section_defaults_and_refusals() -> None:
    assert parse({}).gpu.external_mounts == ("/usr/local/nvidia",)
    assert parse({"gpu": {"external_mounts": []}}).gpu.external_mounts == ()
    assert parse({"gpu": {"lock_timeout_s": 5}}).gpu.lock_timeout_s == 5
    assert config_error({"gpu": {"external_mounts": ["usr/local/nvidia"]}}) == (
        "gpu.external_mounts must list absolute mount points, got 'usr/local/nvidia'")
    assert config_error({"gpu": {"lock_timeout_s": 0}}) == (
        "gpu.lock_timeout_s must be 1..3600 seconds, got 0")


def test_unknown_redis_key_lists_valid_redis_keys() -> None:
    assert config_error({"redis": {"hots": "10.0.0.1"}}) == (
        "unknown key(s) in [redis]: hots; valid keys: db, host, password_file, port, socket"
    )


def test_unknown_preemption_key_lists_valid_keys() -> None:
    assert config_error({"preemption": {"warntime": 30}}) == (
        "unknown key(s) in [preemption]: warntime; valid keys: concurrent_dumps, freeze_waiting, signal, "
        "stream_pages, warn_time"
    )


@pytest.mark.parametrize("value", [-1, 1025])
def test_concurrent_dumps_out_of_range_is_refused(value: int) -> None:
    error = config_error({"preemption": {"concurrent_dumps": value}})
    assert "preemption.concurrent_dumps must be 0..1024" in error


def test_concurrent_dumps_default_to_two_and_zero_lifts_the_limit() -> None:
    assert parse({}).preemption.concurrent_dumps == 2
    assert parse({"preemption": {"concurrent_dumps": 0}}).preemption.concurrent_dumps == 0


def test_waiting_trees_are_frozen_unless_switched_off_and_the_switch_is_a_boolean() -> None:
    assert parse({}).preemption.freeze_waiting is True
    assert parse({"preemption": {"freeze_waiting": False}}).preemption.freeze_waiting is False
    assert "preemption.freeze_waiting must be bool, got 'no' (str)" in config_error(
        {"preemption": {"freeze_waiting": "no"}})


def test_unknown_paths_key_lists_valid_keys() -> None:
    assert config_error({"paths": {"store": "/x"}}) == (
        "unknown key(s) in [paths]: store; valid keys: filelog_dir, prefix, spool_dir, state_dir, store_root"
    )


def test_unknown_tier_is_refused_with_the_valid_tier_keys() -> None:
    assert config_error({"tiers": {"gold": {"partition": "gold"}}}) == (
        "unknown key(s) in [tiers]: gold; valid keys: basic, default, premium, standard"
    )


def test_unknown_key_inside_a_tier_lists_valid_tier_keys() -> None:
    assert config_error({"tiers": {"premium": {"partitions": "x"}}}) == (
        "unknown key(s) in [tiers.premium]: partitions; "
        "valid keys: checkpoint_interval_min, partition"
    )


def test_several_unknown_keys_are_all_named() -> None:
    message = config_error({"redis": {"hots": "h", "prot": 1}})

    assert message.startswith("unknown key(s) in [redis]: hots, prot; valid keys: ")


def test_section_that_is_not_a_table_is_refused() -> None:
    assert config_error({"redis": "127.0.0.1"}) == "[redis] must be a table"


def test_tier_that_is_not_a_table_is_refused() -> None:
    assert config_error({"tiers": {"premium": "gpu"}}) == "[tiers.premium] must be a table"


# --- bad values -----------------------------------------------------------------------------------


def test_default_tier_that_is_not_a_tier_lists_the_tiers() -> None:
    assert config_error({"tiers": {"default": "gold"}}) == (
        "tiers.default = 'gold' is not a tier; valid tiers: premium, standard, basic"
    )


@pytest.mark.parametrize(("given", "shown"), [
    ("KILL", "KILL"), ("SIGKILL", "KILL"), ("STOP", "STOP"), ("sigstop", "STOP"),
    ("NOPE", "NOPE"), ("", ""), ("USR3", "USR3"),
])
def test_signal_that_cannot_be_caught_or_does_not_exist_is_refused(given: str, shown: str) -> None:
    assert config_error({"preemption": {"signal": given}}) == (
        f"preemption.signal = {shown!r} is not a catchable signal name; use URG (the default), USR1, USR2 "
        "or TERM"
    )


def test_signal_module_constant_that_is_not_a_signal_is_refused() -> None:
    # `signal.SIG_DFL` (like SIG_IGN and SIG_BLOCK) is a handler constant, not a signal: accepted,
    # it would make every batch job carry `--signal=_DFL@60`, which sbatch refuses.
    assert config_error({"preemption": {"signal": "SIG_DFL"}}) == (
        "preemption.signal = '_DFL' is not a catchable signal name; use URG (the default), USR1, USR2 "
        "or TERM"
    )


def test_signal_given_as_number_is_refused_with_its_type() -> None:
    assert config_error({"preemption": {"signal": 12}}) == (
        "preemption.signal must be str, got 12 (int)"
    )


@pytest.mark.parametrize("warn_time", [0, -5, 65536])
def test_warn_time_out_of_range_is_refused(warn_time: int) -> None:
    assert config_error({"preemption": {"warn_time": warn_time}}) == (
        f"preemption.warn_time must be 1..65535 seconds, got {warn_time}"
    )


def test_two_tiers_in_one_partition_are_refused_with_the_mapping_shown() -> None:
    message = config_error({"tiers": {
        "premium": {"partition": "gpu"}, "standard": {"partition": "gpu"},
    }})

    assert message == (
        "each tier needs its own partition, got "
        "{'premium': 'gpu', 'standard': 'gpu', 'basic': 'basic'}"
    )


def test_tier_taking_another_tiers_default_partition_is_refused() -> None:
    message = config_error({"tiers": {"standard": {"partition": "premium"}}})

    assert message.startswith("each tier needs its own partition, got ")


@pytest.mark.parametrize("key", ["state_dir", "store_root", "prefix"])
def test_relative_path_is_refused(key: str) -> None:
    assert config_error({"paths": {key: "relative/dir"}}) == (
        f"paths.{key} must be an absolute path, got 'relative/dir'"
    )


@pytest.mark.parametrize(("data", "message"), [
    ({"redis": {"port": True}}, "redis.port must be int, got True (bool)"),
    ({"redis": {"db": False}}, "redis.db must be int, got False (bool)"),
    ({"preemption": {"warn_time": True}}, "preemption.warn_time must be int, got True (bool)"),
    ({"tiers": {"basic": {"checkpoint_interval_min": True}}},
     "tiers.basic.checkpoint_interval_min must be int, got True (bool)"),
])
def test_bool_where_an_int_is_expected_is_refused(data: dict, message: str) -> None:
    assert config_error(data) == message


@pytest.mark.parametrize(("data", "message"), [
    ({"redis": {"port": "6379"}}, "redis.port must be int, got '6379' (str)"),
    ({"redis": {"host": 127}}, "redis.host must be str, got 127 (int)"),
    ({"tiers": {"premium": {"partition": 1}}}, "tiers.premium.partition must be str, got 1 (int)"),
    ({"paths": {"prefix": ["/opt"]}}, "paths.prefix must be str, got ['/opt'] (list)"),
])
def test_value_of_the_wrong_type_is_refused_with_both_types(data: dict, message: str) -> None:
    assert config_error(data) == message


@pytest.mark.parametrize("port", [0, 65536])
def test_redis_port_out_of_range_is_refused(port: int) -> None:
    assert config_error({"redis": {"port": port}}) == f"redis.port must be 1..65535, got {port}"


def test_negative_checkpoint_interval_is_refused() -> None:
    assert config_error({"tiers": {"standard": {"checkpoint_interval_min": -1}}}) == (
        "tiers.standard.checkpoint_interval_min must be >= 0, got -1"
    )


# --- tier lookups ---------------------------------------------------------------------------------


def test_tier_of_partition_maps_each_tier_partition_back() -> None:
    config = parse({"tiers": {"premium": {"partition": "gpu-hi"}}})

    assert config.tier_of_partition("gpu-hi") == "premium"
    assert config.tier_of_partition("standard") == "standard"
    assert config.tier_of_partition("basic") == "basic"


@pytest.mark.parametrize("partition", ["debug", "premium", "", None])
def test_tier_of_unmanaged_or_missing_partition_is_none(partition: str | None) -> None:
    config = parse({"tiers": {"premium": {"partition": "gpu-hi"}}})

    assert config.tier_of_partition(partition) is None


def test_tier_lookup_returns_the_tier_config() -> None:
    tier = parse({}).tier("standard")

    assert (tier.name, tier.partition, tier.checkpoint_interval_min) == ("standard", "standard", 60)


def test_unknown_tier_lookup_lists_the_tiers() -> None:
    with pytest.raises(ConfigError) as info:
        parse({}).tier("gold")

    assert str(info.value) == "unknown SLA tier 'gold'; valid tiers: premium, standard, basic"


# --- the Redis password file ----------------------------------------------------------------------


def redis_with_password_file(path: Path) -> RedisConfig:
    return parse({"redis": {"password_file": str(path)}}).redis


def test_redis_password_is_read_stripped(tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("s3cret\n")

    assert redis_with_password_file(tmp_path / "pw").password() == "s3cret"


def test_missing_or_empty_password_file_means_no_password(tmp_path: Path) -> None:
    (tmp_path / "empty").write_text("\n")

    assert redis_with_password_file(tmp_path / "absent").password() is None
    assert redis_with_password_file(tmp_path / "empty").password() is None


# --- loading from a file --------------------------------------------------------------------------


def test_load_reads_the_given_file_and_records_its_source(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('[tiers]\ndefault = "premium"\n\n'
                    '[preemption]\nsignal = "USR1"\nwarn_time = 90\n')

    config = load(path)

    assert config.source == path
    assert config.default_tier == "premium"
    assert config.preemption.sbatch_signal == "USR1@90"


def test_source_does_not_take_part_in_equality(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text("")

    assert load(path) == parse({})


def test_load_of_invalid_toml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text("[tiers\ndefault = basic\n")

    with pytest.raises(ConfigError) as info:
        load(path)

    assert str(info.value).startswith(f"{path} is not valid TOML: ")
    assert isinstance(info.value.__cause__, Exception)


def test_load_of_a_file_that_is_not_utf8_says_it_is_not_toml(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_bytes(b'[redis]\nhost = "\xff"\n')

    with pytest.raises(ConfigError, match=r"is not valid TOML"):
        load(path)


def test_load_of_a_missing_explicit_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"

    with pytest.raises(ConfigError) as info:
        load(path)

    assert str(info.value) == f"configuration file {path} does not exist"


def test_load_of_a_missing_file_named_by_the_environment_is_an_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "absent.toml"
    monkeypatch.setenv(CONFIG_ENV, str(path))

    with pytest.raises(ConfigError) as info:
        load()

    assert str(info.value) == f"configuration file {path} does not exist"


def test_load_takes_the_file_named_by_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "config.toml"
    path.write_text('[tiers]\ndefault = "standard"\n')
    monkeypatch.setenv(CONFIG_ENV, str(path))

    config = load()

    assert config.source == path
    assert config.default_tier == "standard"


def test_missing_default_file_means_built_in_defaults(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_module, "DEFAULT_CONFIG_PATH", tmp_path / "absent.toml")

    config = load()

    assert config == parse({})
    assert config.source is None


def test_load_of_a_directory_says_it_cannot_read_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load(tmp_path)

    assert str(info.value) == f"cannot read configuration file {tmp_path}: Is a directory"


def test_validation_error_from_a_file_is_prefixed_with_its_path(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text("[redis]\nport = 0\n")

    with pytest.raises(ConfigError) as info:
        load(path)

    assert str(info.value) == f"{path}: redis.port must be 1..65535, got 0"


def test_loaded_config_is_a_config() -> None:
    assert isinstance(parse({}), Config)


# --- the [proxy] section --------------------------------------------------------------------------


def test_proxy_defaults_are_auto_backend_one_cpu_slot_and_a_minute_for_the_cut() -> None:
    assert parse({}).proxy == ProxyConfig(backend="auto", cpu_slots=1, cut_timeout=60)


def test_proxy_defaults_match_the_documented_keys() -> None:
    proxy = parse({}).proxy

    assert {key: default for key, (default, _, _) in KEYS.items() if key.startswith("proxy.")} == {
        "proxy.backend": proxy.backend, "proxy.cpu_slots": proxy.cpu_slots,
        "proxy.cut_timeout": proxy.cut_timeout, "proxy.max_region_mib": proxy.max_region_mib,
        "proxy.max_rank_connections": proxy.max_rank_connections, "proxy.time_slicing": proxy.time_slicing,
        "proxy.turn_lapse_s": proxy.turn_lapse_s, "proxy.shared_memory": proxy.shared_memory,
        "proxy.gpu_swap": proxy.gpu_swap, "proxy.gpu_swap_reserve_mib": proxy.gpu_swap_reserve_mib,
        "proxy.gpu_buffers": proxy.gpu_buffers,
    }


@pytest.mark.parametrize(("cpu_slots", "cut_timeout"), [(1, 1), (4, 20), (256, 3600)])
def test_proxy_overrides_are_taken_with_inclusive_bounds(cpu_slots: int, cut_timeout: int) -> None:
    config = parse({"proxy": {"backend": "host", "cpu_slots": cpu_slots, "cut_timeout": cut_timeout}})

    assert config.proxy == ProxyConfig(backend="host", cpu_slots=cpu_slots, cut_timeout=cut_timeout)


def test_the_documented_example_configures_the_proxies() -> None:
    example = Path(__file__).parents[2] / "contrib" / "config" / "config.toml"

    assert load(example).proxy == ProxyConfig(backend="auto", cpu_slots=1, cut_timeout=20)


def test_unknown_proxy_key_lists_valid_keys() -> None:
    assert config_error({"proxy": {"slots": 2}}) == (
        "unknown key(s) in [proxy]: slots; valid keys: backend, cpu_slots, cut_timeout, gpu_buffers, "
        "gpu_swap, gpu_swap_reserve_mib, max_rank_connections, max_region_mib, shared_memory, time_slicing, "
        "turn_lapse_s"
    )


@pytest.mark.parametrize("backend", ["nccl", "HOST", "CUDA", ""])
def test_unavailable_proxy_backend_is_refused_with_the_valid_ones(backend: str) -> None:
    assert config_error({"proxy": {"backend": backend}}) == (
        f"proxy.backend = {backend!r} is not available; valid backends: auto, cuda, host"
    )


@pytest.mark.parametrize("backend", ["auto", "cuda", "host"])
def test_every_proxy_backend_is_taken(backend: str) -> None:
    assert parse({"proxy": {"backend": backend}}).proxy.backend == backend


@pytest.mark.parametrize("cpu_slots", [0, -1, 257])
def test_cpu_slots_out_of_range_is_refused(cpu_slots: int) -> None:
    assert config_error({"proxy": {"cpu_slots": cpu_slots}}) == (
        f"proxy.cpu_slots must be 1..256, got {cpu_slots}"
    )


@pytest.mark.parametrize("cut_timeout", [0, -5, 3601])
def test_cut_timeout_out_of_range_is_refused(cut_timeout: int) -> None:
    assert config_error({"proxy": {"cut_timeout": cut_timeout}}) == (
        f"proxy.cut_timeout must be 1..3600 seconds, got {cut_timeout}"
    )


def test_proxy_resource_bounds_default_to_4_gib_regions_and_4_connections_per_rank() -> None:
    proxy = parse({}).proxy

    assert (proxy.max_region_mib, proxy.max_region_bytes, proxy.max_rank_connections) == (4096, 4 << 30, 4)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("max_region_mib", 0, "proxy.max_region_mib must be 1..1048576 MiB, got 0"),
    ("max_region_mib", (1 << 20) + 1, "proxy.max_region_mib must be 1..1048576 MiB, got 1048577"),
    ("max_rank_connections", 0, "proxy.max_rank_connections must be 1..64, got 0"),
    ("max_rank_connections", 65, "proxy.max_rank_connections must be 1..64, got 65"),
])
def test_proxy_resource_bounds_out_of_range_are_refused(key: str, value: int, message: str) -> None:
    assert config_error({"proxy": {key: value}}) == message


@pytest.mark.parametrize("mode", ["auto", "turns", "concurrent"])
def test_time_slicing_takes_each_mode(mode: str) -> None:
    assert parse({"proxy": {"time_slicing": mode}}).proxy.time_slicing == mode


def test_time_slicing_defaults_to_auto_turns_on_a_gpu_only_lapsing_after_10_s() -> None:
    assert (parse({}).proxy.time_slicing, parse({}).proxy.turn_lapse_s) == ("auto", 10)


@pytest.mark.parametrize("lapse", [0, 3601])
def test_turn_lapse_out_of_range_is_refused(lapse: int) -> None:
    assert config_error({"proxy": {"turn_lapse_s": lapse}}) == (
        f"proxy.turn_lapse_s must be 1..3600 seconds, got {lapse}"
    )


@pytest.mark.parametrize("mode", ["Turns", "", "serial"])
def test_unknown_time_slicing_is_refused_with_the_valid_modes(mode: str) -> None:
    assert config_error({"proxy": {"time_slicing": mode}}) == (
        f"proxy.time_slicing = {mode!r} is not one of auto, turns, concurrent"
    )


def test_proxy_resource_bounds_are_taken_at_their_limits() -> None:
    proxy = parse({"proxy": {"max_region_mib": 1 << 20, "max_rank_connections": 1}}).proxy

    assert (proxy.max_region_mib, proxy.max_rank_connections) == (1 << 20, 1)


@pytest.mark.parametrize(("data", "message"), [
    ({"proxy": {"cut_timeout": "60"}}, "proxy.cut_timeout must be int, got '60' (str)"),
    ({"proxy": {"cut_timeout": 60.0}}, "proxy.cut_timeout must be int, got 60.0 (float)"),
    ({"proxy": {"cpu_slots": True}}, "proxy.cpu_slots must be int, got True (bool)"),
    ({"proxy": {"backend": 1}}, "proxy.backend must be str, got 1 (int)"),
])
def test_proxy_value_of_the_wrong_type_is_refused(data: dict, message: str) -> None:
    assert config_error(data) == message


def test_proxy_section_that_is_not_a_table_is_refused() -> None:
    assert config_error({"proxy": "host"}) == "[proxy] must be a table"


# --- the [admin] section --------------------------------------------------------------------------


def test_by_default_only_root_is_an_admin() -> None:
    admin = parse({}).admin

    assert admin == AdminConfig(operators=())
    assert KEYS["admin.operators"][0] == []
    assert admin.is_admin(0, "root") is True
    assert admin.is_admin(1001, "alice") is False


def test_operators_are_admins_by_user_name() -> None:
    admin = parse({"admin": {"operators": ["ops", "bob.smith", "svc_1"]}}).admin

    assert admin.operators == ("ops", "bob.smith", "svc_1")
    assert admin.is_admin(1002, "ops") is True
    assert admin.is_admin(1001, "alice") is False
    assert admin.is_admin(1003, None) is False


def test_the_documented_example_names_no_operator() -> None:
    example = Path(__file__).parents[2] / "contrib" / "config" / "config.toml"

    assert load(example).admin == AdminConfig(operators=())


def test_unknown_admin_key_lists_valid_keys() -> None:
    assert config_error({"admin": {"operator": ["ops"]}}) == (
        "unknown key(s) in [admin]: operator; valid keys: operators"
    )


@pytest.mark.parametrize(("data", "message"), [
    ({"admin": {"operators": "ops"}}, "admin.operators must be list, got 'ops' (str)"),
    ({"admin": {"operators": [1001]}}, "admin.operators must list user names, got 1001"),
    ({"admin": {"operators": ["ops,bob"]}}, "admin.operators must list user names, got 'ops,bob'"),
    ({"admin": {"operators": [""]}}, "admin.operators must list user names, got ''"),
    ({"admin": "ops"}, "[admin] must be a table"),
])
def test_operators_that_are_not_user_names_are_refused(data: dict, message: str) -> None:
    assert config_error(data) == message


def test_local_file_limits_default_and_override() -> None:
    from singularity_slurm.config import LocalFilesConfig

    assert parse({}).local_files == LocalFilesConfig(max_files=1000, max_bytes=1 << 30,
                                                     max_log_bytes=16 << 20)
    assert parse({"local_files": {"max_files": 3, "max_bytes": 10, "max_log_bytes": 0}}).local_files == (
        LocalFilesConfig(max_files=3, max_bytes=10, max_log_bytes=0))
    example = Path(__file__).parents[2] / "contrib" / "config" / "config.toml"
    assert load(example).local_files == LocalFilesConfig()


def test_local_file_limits_refuse_unknown_keys_and_bad_values() -> None:
    assert config_error({"local_files": {"max_file": 3}}) == (
        "unknown key(s) in [local_files]: max_file; valid keys: max_bytes, max_files, max_log_bytes")
    assert config_error({"local_files": {"max_bytes": -1}}) == (
        "local_files.max_bytes must be 0..2**50, got -1")
    assert config_error({"local_files": {"max_files": "9"}}) == (
        "local_files.max_files must be int, got '9' (str)")


def test_file_logs_default_to_a_disk_folder_off_run_and_may_be_moved() -> None:
    assert parse({}).paths.filelog_dir == Path("/var/lib/singularity-slurm/filelog")
    assert parse({"paths": {"filelog_dir": "/srv/filelog"}}).paths.filelog_dir == Path("/srv/filelog")
    assert "paths.filelog_dir must be an absolute path" in config_error({"paths": {"filelog_dir": "rel"}})


def test_the_store_keeps_an_ended_jobs_checkpoints_a_day_and_orphans_a_week() -> None:
    store = parse({}).store
    assert (store.retention_min, store.orphan_age_min) == (1440, 10080)
    assert (store.retention_s, store.orphan_age_s) == (86400.0, 604800.0)
    assert load(Path(__file__).parents[2] / "contrib" / "config" / "config.toml").store == store


def test_store_ages_are_taken_with_their_bounds() -> None:
    store = parse({"store": {"retention_min": 0, "orphan_age_min": 60}}).store
    assert (store.retention_min, store.orphan_age_min) == (0, 60)


@pytest.mark.parametrize(("raw", "message"), [
    ({"retention_min": -1}, "store.retention_min must be 0..5256000 minutes, got -1"),
    ({"retention_min": 1.5}, "store.retention_min must be int, got 1.5 (float)"),
    ({"orphan_age_min": 59}, "store.orphan_age_min must be at least 60 minutes, got 59"),
    ({"keep": 3}, "unknown key(s) in [store]: keep; valid keys: orphan_age_min, retention_min"),
])
def test_bad_store_ages_are_refused_naming_the_key(raw: dict, message: str) -> None:
    assert config_error({"store": raw}).startswith(message)


def test_fault_points_are_off_unless_the_configuration_turns_them_on() -> None:
    assert parse({}).testing.faults is False
    assert load(Path(__file__).parents[2] / "contrib" / "config" / "config.toml").testing.faults is False
    assert parse({"testing": {"faults": True}}).testing.faults is True
    assert config_error({"testing": {"faults": "yes"}}).startswith("testing.faults must be bool, got 'yes'")


def test_the_drain_watch_interval_defaults_to_30_s_and_0_turns_it_off() -> None:
    assert parse({}).elastic.drain_poll_s == 30
    assert parse({"elastic": {"drain_poll_s": 0}}).elastic.drain_poll_s == 0
    assert config_error({"elastic": {"drain_poll_s": -1}}) == (
        "elastic.drain_poll_s must be 0..86400 seconds, got -1")
    assert config_error({"elastic": {"drain_poll": 5}}) == (
        "unknown key(s) in [elastic]: drain_poll; valid keys: drain_poll_s, max_ranks_per_device, "
        "replica_mmap_threshold")


def test_ranks_per_device_default_to_at_most_4_and_are_bounded() -> None:
    assert parse({}).elastic.max_ranks_per_device == 4
    assert parse({"elastic": {"max_ranks_per_device": 1}}).elastic.max_ranks_per_device == 1
    assert config_error({"elastic": {"max_ranks_per_device": 0}}) == (
        "elastic.max_ranks_per_device must be 1..1024, got 0")


@pytest.mark.parametrize("value, expected", [(None, 131072), (0, 0), (4096, 4096), (32 << 20, 32 << 20)])
def test_the_replicas_mmap_threshold_defaults_to_128_kib_and_0_turns_it_off(value, expected) -> None:
    raw = {} if value is None else {"elastic": {"replica_mmap_threshold": value}}
    assert parse(raw).elastic.replica_mmap_threshold == expected


@pytest.mark.parametrize("value", [1, 4095, (32 << 20) + 1, -1])
def test_a_replicas_mmap_threshold_glibc_would_not_take_is_refused(value) -> None:
    assert config_error({"elastic": {"replica_mmap_threshold": value}}) == (
        f"elastic.replica_mmap_threshold must be 0 or 4096..33554432 bytes (glibc's bound), got {value}")


# --- the [sla] section ----------------------------------------------------------------------------


def test_sla_defaults_to_hour_windows_and_protected_jobs_nodes_reserved() -> None:
    assert (parse({}).sla.window_s, parse({}).sla.protect_nodes) == (3600, True)
    assert KEYS["sla.protect_nodes"][0] is True
    example = Path(__file__).parents[2] / "contrib" / "config" / "config.toml"
    assert load(example).sla.protect_nodes is True


def test_protect_nodes_can_be_turned_off_and_takes_only_a_bool() -> None:
    assert parse({"sla": {"protect_nodes": False}}).sla.protect_nodes is False
    assert "sla.protect_nodes" in config_error({"sla": {"protect_nodes": "no"}})


@pytest.mark.parametrize(("setting", "stop", "streams"), [
    ("stopping", True, True), ("stopping", False, False), ("always", True, True), ("always", False, True),
    ("never", True, False), ("never", False, False)])
def test_stream_pages_says_which_dumps_stream(setting: str, stop: bool, streams: bool) -> None:
    config = parse({"preemption": {"stream_pages": setting}})
    assert config.preemption.streams(stop) is streams


def test_a_stream_pages_setting_that_is_none_of_the_three_is_refused() -> None:
    assert config_error({"preemption": {"stream_pages": "sometimes"}}) == (
        "preemption.stream_pages must be one of stopping, always, never, got 'sometimes'")
