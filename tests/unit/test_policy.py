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
    read_slurm_user_uid,
    render_cli_filter,
    render_job_submit,
    render_plugstack_line,
    slurm_user_name,
    slurm_user_uid_of_shown,
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


def test_job_submit_lets_root_alone_update_any_job_by_default() -> None:
    assert "local ADMIN_UIDS = { [0] = true }" in render_job_submit(parse({})).splitlines()


def test_job_submit_lets_root_and_the_slurm_user_update_any_job() -> None:
    text = render_job_submit(parse({}), slurm_user_uid=64030)

    assert "local ADMIN_UIDS = { [0] = true, [64030] = true }" in text.splitlines()


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


# --- SlurmUser, read from slurm.conf ---------------------------------------------------------------


@pytest.mark.parametrize(("text", "name"), [
    ("SlurmUser=slurm\n", "slurm"),
    ("ClusterName=x\n  slurmuser = slurmadm  # the daemon's user\n", "slurmadm"),
    ("SlurmctldHost=h SlurmUser=sl\n", "sl"),
    ("SlurmUser=a\nSlurmUser=b\n", "b"),
    ("SlurmdUser=root\n", "root"),
    ("#SlurmUser=slurm\n", "root"),
    ("", "root"),
], ids=["plain", "case-and-comment", "mid-line", "last-wins", "slurmd-user", "commented", "unset"])
def test_slurm_user_name_is_read_from_slurm_conf(text: str, name: str) -> None:
    assert slurm_user_name(text) == name


@pytest.mark.parametrize(("shown", "uid"), [
    ("slurm(64030)", 64030), ("root(0)", 0), ("slurm", None), ("(x)", None),
])
def test_slurm_user_uid_of_scontrol_show_config(shown: str, uid: int | None) -> None:
    assert slurm_user_uid_of_shown(shown) == uid


def test_slurm_user_uid_is_looked_up_by_name(tmp_path: Path) -> None:
    (tmp_path / "slurm.conf").write_text("SlurmUser=root\n")

    assert read_slurm_user_uid(tmp_path) == 0


def test_numeric_slurm_user_is_its_uid(tmp_path: Path) -> None:
    (tmp_path / "slurm.conf").write_text("SlurmUser=64030\n")

    assert read_slurm_user_uid(tmp_path) == 64030


def test_missing_slurm_conf_is_refused_naming_the_option(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        read_slurm_user_uid(tmp_path)

    assert str(info.value) == (
        f"{tmp_path}/slurm.conf not found: the job-submit policy lets SlurmUser update any job and "
        "reads its name there; pass --slurm-etc with the folder of slurm.conf"
    )


def test_unknown_slurm_user_is_refused(tmp_path: Path) -> None:
    (tmp_path / "slurm.conf").write_text("SlurmUser=no-such-user-x9\n")

    with pytest.raises(ConfigError) as info:
        read_slurm_user_uid(tmp_path)

    assert str(info.value) == (
        f"SlurmUser=no-such-user-x9 in {tmp_path}/slurm.conf is not a user of this host: "
        "create the user or fix SlurmUser"
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
slurm = { SUCCESS = 0, ERROR = -1, ESLURM_ACCESS_DENIED = 2002, NO_VAL16 = 65534 }
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

HARNESS_MODIFY = """
local job_desc = %s
local job_rec = %s
local rc = slurm_job_modify(job_desc, job_rec, {}, %d)
print("rc\\t" .. tostring(rc))
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


SUCCESS, ERROR, ACCESS_DENIED = 0, -1, 2002
NO_VAL16 = 65534
JOB_USER, OTHER_USER, SLURM_USER = 1001, 1002, 64030


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


@needs_lua
def test_partition_list_naming_a_tier_partition_is_refused(tmp_path: Path) -> None:
    # Without this, `-p debug,premium --no-requeue` would run in a tier partition unmanaged.
    run = submit(tmp_path, parse({}), {"partition": "debug,premium", "requeue": 0})

    assert run.rc == ERROR
    assert run.user == [
        "singularity: the partition list 'debug,premium' names the tier partition 'premium' beside "
        "others; a Singularity job runs in one tier partition: use --singularity-sla=premium "
        "without --partition"
    ]


@needs_lua
def test_partition_list_of_tier_partitions_is_refused(tmp_path: Path) -> None:
    run = submit(tmp_path, parse({}), {"partition": "basic,premium"})

    assert run.rc == ERROR
    assert "names the tier partition 'basic'" in run.user[0]


@needs_lua
def test_partition_list_without_tier_partitions_is_left_alone(tmp_path: Path) -> None:
    run = submit(tmp_path, parse({}), {"partition": "debug,cpu", "requeue": 0})

    assert run.rc == SUCCESS
    assert run.fields == {"partition": "debug,cpu", "requeue": "0"}
    assert run.user == []


# --- job_submit.lua's slurm_job_modify, executed ------------------------------------------------


def modify(tmp_path: Path, job_desc: dict, job_rec: dict, uid: int = JOB_USER,
           config: Config | None = None, slurm_user_uid: int = SLURM_USER) -> LuaRun:
    """`scontrol update` as Slurm 22.05 hands it over: unchanged fields nil or NO_VAL16."""
    desc = {"requeue": NO_VAL16, **job_desc}
    script = render_job_submit(config or parse({}), slurm_user_uid)
    return run_lua(tmp_path, script,
                   HARNESS_MODIFY % (lua_literal(desc), lua_literal({"job_id": 42, **job_rec}), uid))


BASIC_JOB = {"partition": "basic", "spank_job_env": sla("basic")}
DEFAULT_TIER_JOB = {"partition": "basic"}  # no --singularity-sla: the default tier
UNMANAGED_JOB = {"partition": "debug"}


@needs_lua
def test_user_moving_a_tier_job_to_another_tier_is_refused_and_told_why(tmp_path: Path) -> None:
    run = modify(tmp_path, {"partition": "premium"}, BASIC_JOB)

    reason = ("job 42 runs in partition 'basic' (SLA tier basic) and cannot move to 'premium': "
              "the partition is the job's SLA tier; ask an admin to move it, or submit it again "
              "with --singularity-sla")
    assert run.rc == ACCESS_DENIED
    assert run.user == [f"singularity: {reason}"]
    assert run.info[1:] == [f"singularity: update of job 42 by uid 1001 refused: {reason}"]


@needs_lua
@pytest.mark.parametrize("partition", ["premium", "standard", "debug", "basic,premium", ""])
def test_user_cannot_move_a_default_tier_job_anywhere_else(tmp_path: Path, partition: str) -> None:
    run = modify(tmp_path, {"partition": partition}, DEFAULT_TIER_JOB)

    assert run.rc == ACCESS_DENIED
    assert "job 42 runs in partition 'basic' (SLA tier basic)" in run.user[0]


@needs_lua
def test_job_with_a_tier_option_in_an_admin_chosen_partition_stays_there(tmp_path: Path) -> None:
    # An admin moved a basic job to a partition of no tier: its tier still comes from the option.
    run = modify(tmp_path, {"partition": "basic"}, {"partition": "debug", "spank_job_env": sla("basic")})

    assert run.rc == ACCESS_DENIED
    assert "job 42 runs in partition 'debug' (SLA tier basic) and cannot move to 'basic'" in run.user[0]


@needs_lua
def test_user_naming_the_jobs_own_partition_is_accepted(tmp_path: Path) -> None:
    run = modify(tmp_path, {"partition": "basic"}, BASIC_JOB)

    assert (run.rc, run.user, run.info[1:]) == (SUCCESS, [], [])


@needs_lua
def test_user_making_a_tier_job_non_requeueable_is_refused(tmp_path: Path) -> None:
    run = modify(tmp_path, {"requeue": 0}, DEFAULT_TIER_JOB)

    assert run.rc == ACCESS_DENIED
    assert run.user == [
        "singularity: job 42 has SLA tier basic and must stay requeueable (Requeue=0 refused): it "
        "resumes from its checkpoint after a preemption; end it with scancel instead"
    ]


@needs_lua
def test_partition_is_checked_before_requeue(tmp_path: Path) -> None:
    run = modify(tmp_path, {"partition": "premium", "requeue": 0}, BASIC_JOB)

    assert run.rc == ACCESS_DENIED
    assert "cannot move to 'premium'" in run.user[0]


@needs_lua
@pytest.mark.parametrize("job_desc", [
    {}, {"requeue": 1}, {"time_limit": 10}, {"comment": "note"}, {"name": "renamed"},
    {"dependency": "afterok:41"}, {"priority": 0}, {"nice": 100},
], ids=["nothing", "requeue-1", "time-limit", "comment", "name", "dependency", "hold", "nice"])
def test_harmless_updates_of_a_tier_job_are_accepted_silently(tmp_path: Path, job_desc: dict) -> None:
    run = modify(tmp_path, job_desc, BASIC_JOB)

    assert (run.rc, run.user, run.info[1:]) == (SUCCESS, [], [])


@needs_lua
@pytest.mark.parametrize("uid", [0, SLURM_USER])
@pytest.mark.parametrize("job_desc", [{"partition": "premium"}, {"requeue": 0},
                                      {"partition": "debug", "requeue": 0}])
def test_admins_may_move_a_job_and_change_its_requeue_flag(tmp_path: Path, uid: int,
                                                           job_desc: dict) -> None:
    run = modify(tmp_path, job_desc, BASIC_JOB, uid=uid)

    assert (run.rc, run.user, run.info[1:]) == (SUCCESS, [], [])


@needs_lua
def test_slurm_user_of_another_cluster_is_no_admin(tmp_path: Path) -> None:
    run = modify(tmp_path, {"partition": "premium"}, BASIC_JOB, uid=SLURM_USER, slurm_user_uid=0)

    assert run.rc == ACCESS_DENIED


@needs_lua
def test_another_users_harmless_update_is_left_to_slurm(tmp_path: Path) -> None:
    # Slurm refuses it after the plugin (the caller does not own the job); the policy only judges
    # what the update changes.
    run = modify(tmp_path, {"comment": "x"}, BASIC_JOB, uid=OTHER_USER)

    assert run.rc == SUCCESS


@needs_lua
@pytest.mark.parametrize("partition", ["premium", "debug,basic"])
def test_user_moving_an_unmanaged_job_into_a_tier_partition_is_refused(
        tmp_path: Path, partition: str) -> None:
    run = modify(tmp_path, {"partition": partition}, UNMANAGED_JOB)

    tier = "premium" if partition == "premium" else "basic"
    assert run.rc == ACCESS_DENIED
    assert run.user == [
        f"singularity: job 42 was not submitted with an SLA tier and cannot move to the tier "
        f"partition '{tier}': submit it again with --singularity-sla={tier}"
    ]


@needs_lua
@pytest.mark.parametrize("job_desc", [{"partition": "cpu"}, {"requeue": 0}])
def test_unmanaged_jobs_are_left_to_slurm(tmp_path: Path, job_desc: dict) -> None:
    run = modify(tmp_path, job_desc, UNMANAGED_JOB)

    assert (run.rc, run.user) == (SUCCESS, [])


@needs_lua
def test_modify_follows_the_configured_partitions(tmp_path: Path) -> None:
    config = parse(CUSTOM)

    moved = modify(tmp_path, {"partition": "gpu-hi"}, {"partition": "gpu-scavenge"}, config=config)
    old_name = modify(tmp_path, {"partition": "premium"}, {"partition": "debug"}, config=config)

    assert moved.rc == ACCESS_DENIED
    assert "(SLA tier basic) and cannot move to 'gpu-hi'" in moved.user[0]
    assert old_name.rc == SUCCESS


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
    assert run.fields["signal"] == "URG@60"


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
