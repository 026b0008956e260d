"""The Slurm-side policy files: rendered text, and the rendered Lua run for real under lua5.1.

The Lua tests load the rendered script into a stock interpreter after defining the few members of
Slurm's `slurm` table the script uses (SUCCESS, ERROR, log_info, log_user), then call the hook as
slurmctld or sbatch would, with a plain table for `job_desc` / `options`.
"""

from __future__ import annotations

import re
import shutil
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from singularity_slurm.config import Config, parse
from singularity_slurm.errors import ConfigError
from singularity_slurm.slurm_plugin.policy import (
    ensure_plugstack_include,
    render_cli_filter,
    render_job_submit,
    render_plugstack_line,
    spank_library_path,
    write_atomic,
)

LUA = shutil.which("lua5.1")
needs_lua = pytest.mark.skipif(
    LUA is None,
    reason="lua5.1 not installed (Debian: apt-get install lua5.1): rendered Lua not executed",
)

CUSTOM = {"tiers": {
    "default": "standard",
    "premium": {"partition": "gpu-hi"},
    "standard": {"partition": "gpu"},
    "basic": {"partition": "gpu-scavenge"},
}}


# --- rendered text --------------------------------------------------------------------------------


def test_job_submit_carries_the_tier_partition_map_and_default_tier() -> None:
    text = render_job_submit(parse({}))

    assert ('local TIER_PARTITION = { premium = "premium", standard = "standard", '
            'basic = "basic" }') in text.splitlines()
    assert 'local DEFAULT_TIER = "basic"' in text.splitlines()


def test_job_submit_of_a_custom_config() -> None:
    text = render_job_submit(parse(CUSTOM))

    assert ('local TIER_PARTITION = { premium = "gpu-hi", standard = "gpu", '
            'basic = "gpu-scavenge" }') in text.splitlines()
    assert 'local DEFAULT_TIER = "standard"' in text.splitlines()


@pytest.mark.parametrize("render", [render_job_submit, render_cli_filter])
def test_rendered_files_leave_no_placeholder(render) -> None:
    assert re.findall(r"@[A-Z_]+@", render(parse(CUSTOM))) == []


@pytest.mark.parametrize("render", [render_job_submit, render_cli_filter])
def test_rendered_files_name_their_source(render, tmp_path: Path) -> None:
    path = tmp_path / "config.toml"

    assert "from the built-in defaults." in render(parse({}))
    assert f"from {path}." in render(parse({}, source=path))


def test_cli_filter_carries_the_sbatch_signal() -> None:
    text = render_cli_filter(parse({"preemption": {"signal": "USR1", "warn_time": 120}}))

    assert 'local SIGNAL = "USR1@120"' in text.splitlines()


@pytest.mark.parametrize("partition", ['gp"u', "gp\\u", "gp\nu"])
def test_partition_that_would_break_the_lua_string_is_refused(partition: str) -> None:
    config = parse({"tiers": {"basic": {"partition": partition}}})

    with pytest.raises(ConfigError) as info:
        render_job_submit(config)

    assert str(info.value) == (
        f"partition name {partition!r} holds a quote, backslash or newline"
    )


def test_plugstack_line_loads_the_plugin_with_the_tier_partition_map() -> None:
    assert render_plugstack_line(parse({})) == (
        "required /opt/singularity-slurm/lib/singularity_sla.so "
        "premium=premium standard=standard basic=basic "
        "ensure=/opt/singularity-slurm/venv/bin/singularity-prolog"
    )


def test_plugstack_line_follows_the_prefix_and_partitions() -> None:
    config = parse({**CUSTOM, "paths": {"prefix": "/srv/sing"}})

    assert spank_library_path(config) == Path("/srv/sing/lib/singularity_sla.so")
    assert render_plugstack_line(config) == (
        "required /srv/sing/lib/singularity_sla.so premium=gpu-hi standard=gpu basic=gpu-scavenge "
        "ensure=/srv/sing/venv/bin/singularity-prolog"
    )


# --- plugstack.conf include -----------------------------------------------------------------------


DROPINS = Path("/etc/slurm/plugstack.conf.d")
INCLUDE = "include /etc/slurm/plugstack.conf.d/*.conf\n"


def test_include_is_added_to_an_empty_plugstack() -> None:
    assert ensure_plugstack_include("", DROPINS) == INCLUDE


def test_include_is_appended_after_existing_lines() -> None:
    existing = "optional /usr/lib/other.so\n"

    assert ensure_plugstack_include(existing, DROPINS) == existing + INCLUDE


def test_include_is_appended_on_its_own_line_when_the_file_lacks_a_final_newline() -> None:
    assert ensure_plugstack_include("optional /x.so", DROPINS) == "optional /x.so\n" + INCLUDE


@pytest.mark.parametrize("existing", [
    INCLUDE, "optional /x.so\n" + INCLUDE, "  include\t/etc/slurm/plugstack.conf.d/*.conf  \n",
    "INCLUDE /etc/slurm/plugstack.conf.d/*.conf",
])
def test_existing_include_is_left_as_it_is(existing: str) -> None:
    assert ensure_plugstack_include(existing, DROPINS) == existing


@pytest.mark.parametrize("existing", [
    "#include /etc/slurm/plugstack.conf.d/*.conf\n",
    "include /etc/slurm/plugstack.conf.d/*\n",
    "include /other/plugstack.conf.d/*.conf\n",
])
def test_commented_or_different_include_does_not_count(existing: str) -> None:
    assert ensure_plugstack_include(existing, DROPINS) == existing + INCLUDE


# --- write_atomic ---------------------------------------------------------------------------------


def test_write_atomic_creates_the_file_and_its_folders_with_the_mode(tmp_path: Path) -> None:
    path = tmp_path / "etc" / "slurm" / "job_submit.lua"

    assert write_atomic(path, "hello\n", mode=0o640) is True
    assert path.read_text() == "hello\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


def test_write_atomic_default_mode_is_world_readable(tmp_path: Path) -> None:
    path = tmp_path / "cli_filter.lua"

    write_atomic(path, "x")

    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_write_atomic_of_unchanged_content_is_false_and_leaves_the_file(tmp_path: Path) -> None:
    path = tmp_path / "job_submit.lua"
    write_atomic(path, "same\n")
    inode = path.stat().st_ino

    assert write_atomic(path, "same\n") is False
    assert path.stat().st_ino == inode


def test_write_atomic_replaces_changed_content(tmp_path: Path) -> None:
    path = tmp_path / "job_submit.lua"
    write_atomic(path, "old\n")

    assert write_atomic(path, "new\n") is True
    assert path.read_text() == "new\n"


def test_write_atomic_replaces_a_file_that_is_not_text(tmp_path: Path) -> None:
    path = tmp_path / "job_submit.lua"
    path.write_bytes(b"\xff\xfe")

    assert write_atomic(path, "text\n") is True
    assert path.read_text() == "text\n"


def test_write_atomic_leaves_no_temporary_file(tmp_path: Path) -> None:
    write_atomic(tmp_path / "a.lua", "1")
    write_atomic(tmp_path / "a.lua", "2")

    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.lua"]


# --- job_submit.lua, executed ---------------------------------------------------------------------


def lua_literal(value: object) -> str:
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        return f'"{escaped}"'
    if isinstance(value, dict):
        items = (f"[{lua_literal(k)}] = {lua_literal(v)}"
                 for k, v in value.items() if v is not None)
        return "{" + ", ".join(items) + "}"
    raise TypeError(f"no Lua literal for {value!r}")


HARNESS_PRELUDE = """
local messages = {}
slurm = { SUCCESS = 0, ERROR = -1 }
function slurm.log_info(fmt, ...) table.insert(messages, "info\\t" .. string.format(fmt, ...)) end
function slurm.log_user(fmt, ...) table.insert(messages, "user\\t" .. string.format(fmt, ...)) end
local loaded = dofile(%s)
print("loaded\\t" .. tostring(loaded))
"""

HARNESS_SUBMIT = """
local job_desc = %s
local rc = slurm_job_submit(job_desc, {}, 1001)
print("rc\\t" .. tostring(rc))
print("partition\\t" .. tostring(job_desc.partition))
print("requeue\\t" .. tostring(job_desc.requeue))
for _, m in ipairs(messages) do print(m) end
"""

HARNESS_CLI = """
local options = %s
local rc = slurm_cli_pre_submit(options, 0)
print("rc\\t" .. tostring(rc))
print("signal\\t" .. tostring(options["signal"]))
print("setup\\t" .. tostring(slurm_cli_setup_defaults(options, false)))
print("post\\t" .. tostring(slurm_cli_post_submit(0, 42, 0)))
for _, m in ipairs(messages) do print(m) end
"""


@dataclass
class LuaRun:
    loaded: str
    rc: int
    fields: dict[str, str]
    user: list[str]
    info: list[str]


def run_lua(tmp_path: Path, script: str, body: str) -> LuaRun:
    assert LUA is not None
    script_path = tmp_path / "policy.lua"
    script_path.write_text(script)
    harness = tmp_path / "harness.lua"
    harness.write_text(HARNESS_PRELUDE % lua_literal(str(script_path)) + body)
    proc = subprocess.run([LUA, str(harness)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    fields: dict[str, str] = {}
    user: list[str] = []
    info: list[str] = []
    for line in proc.stdout.splitlines():
        key, _, value = line.partition("\t")
        if key == "user":
            user.append(value)
        elif key == "info":
            info.append(value)
        else:
            fields[key] = value
    return LuaRun(loaded=fields.pop("loaded"), rc=int(fields.pop("rc")), fields=fields, user=user,
                  info=info)


def submit(tmp_path: Path, config: Config, job_desc: dict) -> LuaRun:
    return run_lua(tmp_path, render_job_submit(config), HARNESS_SUBMIT % lua_literal(job_desc))


def sla(tier: str, *other: str) -> dict[int, str]:
    """spank_job_env as Slurm passes it: a table indexed from 0."""
    return dict(enumerate([*other, f"SINGULARITY_SLA={tier}"]))


SUCCESS, ERROR = 0, -1


@needs_lua
def test_job_submit_loads_and_says_so(tmp_path: Path) -> None:
    run = submit(tmp_path, parse({}), {})

    assert run.loaded == "0"
    assert run.info[0] == "singularity: job-submit policy loaded (default tier basic)"


@needs_lua
def test_premium_option_without_partition_goes_to_premium_and_is_requeueable(
        tmp_path: Path) -> None:
    run = submit(tmp_path, parse({}), {"spank_job_env": sla("premium")})

    assert run.rc == SUCCESS
    assert run.fields == {"partition": "premium", "requeue": "1"}
    assert run.user == []
    assert run.info[1:] == [
        "singularity: job of uid 1001 gets SLA tier premium (partition premium)",
    ]


@needs_lua
def test_option_is_found_among_other_spank_variables(tmp_path: Path) -> None:
    env = sla("standard", "OTHER_PLUGIN=1", "SINGULARITY_SLA_X=premium")

    run = submit(tmp_path, parse({}), {"spank_job_env": env})

    assert run.rc == SUCCESS
    assert run.fields["partition"] == "standard"


@needs_lua
def test_option_only_at_index_zero_is_seen(tmp_path: Path) -> None:
    # Slurm fills spank_job_env from index 0, where ipairs() would not look.
    run = submit(tmp_path, parse({}), {"spank_job_env": {0: "SINGULARITY_SLA=premium"}})

    assert run.fields["partition"] == "premium"


@needs_lua
def test_no_option_no_partition_gets_the_default_tier(tmp_path: Path) -> None:
    run = submit(tmp_path, parse({}), {})

    assert run.rc == SUCCESS
    assert run.fields == {"partition": "basic", "requeue": "1"}
    assert run.info[1:] == ["singularity: job of uid 1001 gets SLA tier basic (partition basic)"]


@needs_lua
def test_empty_spank_env_counts_as_no_option(tmp_path: Path) -> None:
    run = submit(tmp_path, parse({}), {"spank_job_env": {0: "OTHER=1"}})

    assert run.fields == {"partition": "basic", "requeue": "1"}


@needs_lua
def test_no_option_in_a_tier_partition_keeps_it_and_becomes_requeueable(tmp_path: Path) -> None:
    run = submit(tmp_path, parse({}), {"partition": "standard", "requeue": 0})

    assert run.rc == SUCCESS
    assert run.fields == {"partition": "standard", "requeue": "1"}


@needs_lua
def test_no_option_in_an_unmanaged_partition_is_left_alone(tmp_path: Path) -> None:
    run = submit(tmp_path, parse({}), {"partition": "debug", "requeue": 0})

    assert run.rc == SUCCESS
    assert run.fields == {"partition": "debug", "requeue": "0"}
    assert run.user == []
    assert run.info[1:] == []


@needs_lua
def test_option_with_its_own_tier_partition_is_accepted(tmp_path: Path) -> None:
    run = submit(tmp_path, parse({}), {"spank_job_env": sla("basic"), "partition": "basic"})

    assert run.rc == SUCCESS
    assert run.fields == {"partition": "basic", "requeue": "1"}


@needs_lua
def test_option_with_another_tiers_partition_is_refused_naming_both(tmp_path: Path) -> None:
    run = submit(tmp_path, parse({}), {"spank_job_env": sla("basic"), "partition": "premium"})

    assert run.rc == ERROR
    assert run.user == [
        "singularity: --singularity-sla=basic runs in partition 'basic' but the job asks for "
        "partition 'premium'; drop --partition or pick the tier of that partition"
    ]
    assert run.fields["partition"] == "premium"
    assert run.fields["requeue"] == "nil"


@needs_lua
def test_option_with_an_unmanaged_partition_is_refused(tmp_path: Path) -> None:
    run = submit(tmp_path, parse({}), {"spank_job_env": sla("premium"), "partition": "debug"})

    assert run.rc == ERROR
    assert "asks for partition 'debug'" in run.user[0]


@needs_lua
@pytest.mark.parametrize("tier", ["gold", "", "PREMIUM"])
def test_unknown_tier_is_refused_with_the_valid_tiers(tmp_path: Path, tier: str) -> None:
    run = submit(tmp_path, parse({}), {"spank_job_env": sla(tier)})

    assert run.rc == ERROR
    assert run.user == [
        f"singularity: unknown SLA tier '{tier}'; valid tiers: premium, standard, basic"
    ]
    assert run.fields == {"partition": "nil", "requeue": "nil"}


@needs_lua
@pytest.mark.parametrize(("job_desc", "rc", "partition", "requeue"), [
    ({}, SUCCESS, "gpu", "1"),
    ({"spank_job_env": sla("premium")}, SUCCESS, "gpu-hi", "1"),
    ({"spank_job_env": sla("basic")}, SUCCESS, "gpu-scavenge", "1"),
    ({"partition": "gpu-scavenge"}, SUCCESS, "gpu-scavenge", "1"),
    # The default names belong to no tier under this configuration: left alone.
    ({"partition": "premium"}, SUCCESS, "premium", "nil"),
    ({"spank_job_env": sla("premium"), "partition": "premium"}, ERROR, "premium", "nil"),
], ids=["default", "premium", "basic", "tier-partition", "old-name", "option-vs-old-name"])
def test_custom_config_maps_tiers_to_its_partitions(
        tmp_path: Path, job_desc: dict, rc: int, partition: str, requeue: str) -> None:
    run = submit(tmp_path, parse(CUSTOM), job_desc)

    assert (run.rc, run.fields["partition"], run.fields["requeue"]) == (rc, partition, requeue)


@needs_lua
def test_custom_config_refusal_names_the_configured_partitions(tmp_path: Path) -> None:
    run = submit(tmp_path, parse(CUSTOM), {"spank_job_env": sla("basic"), "partition": "gpu-hi"})

    assert run.rc == ERROR
    assert run.user == [
        "singularity: --singularity-sla=basic runs in partition 'gpu-scavenge' but the job "
        "asks for partition 'gpu-hi'; drop --partition or pick the tier of that partition"
    ]


@needs_lua
def test_custom_default_tier_is_announced_on_load(tmp_path: Path) -> None:
    run = submit(tmp_path, parse(CUSTOM), {})

    assert run.info[0] == "singularity: job-submit policy loaded (default tier standard)"


# --- cli_filter.lua, executed ---------------------------------------------------------------------


def pre_submit(tmp_path: Path, config: Config, options: dict) -> LuaRun:
    return run_lua(tmp_path, render_cli_filter(config), HARNESS_CLI % lua_literal(options))


@needs_lua
@pytest.mark.parametrize("signal", [None, "", "0@0"])
def test_batch_job_without_its_own_signal_gets_the_warning_signal(
        tmp_path: Path, signal: str | None) -> None:
    # Slurm 22.05 reports an unset --signal as "0@0".
    run = pre_submit(tmp_path, parse({}), {"type": "sbatch", "signal": signal})

    assert run.rc == SUCCESS
    assert run.fields["signal"] == "USR2@60"


@needs_lua
def test_warning_signal_follows_the_configuration(tmp_path: Path) -> None:
    config = parse({"preemption": {"signal": "TERM", "warn_time": 300}})

    run = pre_submit(tmp_path, config, {"type": "sbatch"})

    assert run.fields["signal"] == "TERM@300"


@needs_lua
@pytest.mark.parametrize("signal", ["B:USR1@10", "USR1@120", "10@30"])
def test_batch_job_with_its_own_signal_keeps_it(tmp_path: Path, signal: str) -> None:
    run = pre_submit(tmp_path, parse({}), {"type": "sbatch", "signal": signal})

    assert run.rc == SUCCESS
    assert run.fields["signal"] == signal


@needs_lua
@pytest.mark.parametrize("kind", ["srun", "salloc"])
def test_other_commands_are_left_untouched(tmp_path: Path, kind: str) -> None:
    run = pre_submit(tmp_path, parse({}), {"type": kind})

    assert run.rc == SUCCESS
    assert run.fields["signal"] == "nil"


@needs_lua
def test_other_cli_filter_hooks_succeed_and_log_nothing(tmp_path: Path) -> None:
    run = pre_submit(tmp_path, parse({}), {"type": "sbatch"})

    assert (run.loaded, run.fields["setup"], run.fields["post"]) == ("nil", "0", "0")
    assert run.user == [] and run.info == []
