"""Job traces: the simulator's CSV and the published formats it imports (sla.trace, sla.importers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from singularity_slurm.sla import importers, trace
from singularity_slurm.sla.trace import TraceError, TraceJob

DATA = Path(__file__).resolve().parents[1] / "data"

GOOD = """job_id,submit_s,duration_s,gpus,tier,min_gpus,comment
b,60,3600,8,basic,2,elastic
a,0,600,1,premium,,
c,60,100,4,standard,4,
"""


def test_a_trace_is_read_in_submission_order_with_elasticity_optional() -> None:
    jobs = trace.parse(GOOD, "t.csv")
    assert [j.job_id for j in jobs] == ["a", "b", "c"]
    assert jobs[0] == TraceJob("a", 0.0, 600.0, 1, "premium", 1)
    assert jobs[1].elastic and not jobs[2].elastic
    assert trace.parse(trace.write(jobs)) == jobs


def test_a_job_may_carry_its_own_measured_checkpoint_and_restore_costs() -> None:
    jobs = trace.parse("job_id,submit_s,duration_s,gpus,tier,checkpoint_s,restore_s\n"
                       "a,0,600,2,standard,5.5,2.25\nb,1,60,4,basic,,21\nc,2,60,1,basic,,\n", "t.csv")
    assert [(j.checkpoint_s, j.restore_s) for j in jobs] == [(5.5, 2.25), (None, 21.0), (None, None)]
    assert trace.parse(trace.write(jobs)) == jobs
    assert "checkpoint_s" not in trace.write([TraceJob("a", 0.0, 600.0, 1, "premium", 1)])


H = "job_id,submit_s,duration_s,gpus,tier\n"


@pytest.mark.parametrize("text, message", [
    ("job_id,submit_s,gpus,tier\na,0,1,basic\n", "t.csv:1: the header lacks column(s) duration_s"),
    (H + "a,0,10,1,basic\nb,-5,10,1,basic\n", "t.csv:3: submit_s is negative"),
    (H + "a,0,10,1,gold\n", "t.csv:2: unknown tier 'gold'; valid tiers: premium"),
    (H + "a,soon,10,1,basic\n", "t.csv:2: submit_s is not a number: 'soon'"),
    (H + "a,0,0,1,basic\n", "t.csv:2: duration_s must be positive"),
    (H + "a,0,10,0,basic\n", "t.csv:2: gpus must be a whole number"),
    (H + "a,0,10,1.5,basic\n", "t.csv:2: gpus must be a whole number"),
    (H + "a,0,nan,1,basic\n", "t.csv:2: duration_s is not finite"),
    (H + "a,0,10,1,basic\na,1,10,1,basic\n", "t.csv:3: job_id 'a' is on line 2"),
    ("job_id,submit_s,duration_s,gpus,tier,min_gpus\na,0,10,2,basic,4\n",
     "t.csv:2: min_gpus (4) is more than"),
    (H + ",0,10,1,basic\n", "t.csv:2: job_id is empty"),
    ("job_id,submit_s,duration_s,gpus,tier,checkpoint_s\na,0,10,2,basic,-1\n",
     "t.csv:2: checkpoint_s is negative (-1)"),
    ("job_id,submit_s,duration_s,gpus,tier,restore_s\na,0,10,2,basic,later\n",
     "t.csv:2: restore_s is not a number: 'later'"),
])
def test_a_bad_trace_is_refused_naming_its_line(text: str, message: str) -> None:
    with pytest.raises(TraceError) as caught:
        trace.parse(text, "t.csv")
    assert str(caught.value).startswith(message), caught.value


def test_a_philly_job_log_becomes_jobs_with_their_run_time_and_last_size() -> None:
    jobs = importers.philly((DATA / "philly_job_log_sample.json").read_text(), "philly")
    by_id = {j.job_id: j for j in jobs}
    assert set(by_id) == {"application_1", "application_2", "application_4"}  # 3 never ran
    first = by_id["application_1"]
    assert (first.submit, first.duration, first.gpus) == (0.0, 74 + 3600.0, 8)  # two attempts
    assert by_id["application_2"].gpus == 16 and by_id["application_2"].submit == 600.0  # two nodes
    assert by_id["application_4"].submit == 86400.0 + 3600.0
    assert all(j.tier in ("premium", "standard", "basic") for j in jobs)
    assert importers.philly((DATA / "philly_job_log_sample.json").read_text()) == jobs  # the same draw


PHILLY_SUMMARY = """timestamp,duration,num_gpus,gpu_time,cluster
2017-10-09 07:01:55,66.0,1,66.0,11cb48
2017-10-09 06:13:03,2951.0,8,23608.0,6214e9
2017-10-09 06:13:36,0.0,1,0.0,6214e9
2017-10-09 06:16:03,2766.0,0,0.0,6214e9
2017-10-09 06:14:53,2775.0,2,5550.0,6214e9
"""


def test_a_philly_job_summary_becomes_jobs_named_by_what_their_lines_say() -> None:
    jobs = importers.load(PHILLY_SUMMARY, "philly-summary", "p.csv")
    assert [(j.job_id, j.submit, j.duration, j.gpus) for j in jobs] == [
        ("6214e9-1507529583-2951-8", 0.0, 2951.0, 8), ("6214e9-1507529693-2775-2", 110.0, 2775.0, 2),
        ("11cb48-1507532515-66-1", 2932.0, 66.0, 1)]
    one = importers.load(PHILLY_SUMMARY, "philly-summary", "p.csv", cluster="11cb48")
    assert [(j.job_id, j.submit) for j in one] == [("11cb48-1507532515-66-1", 0.0)]
    # a file of some of the lines names and draws each job as the whole file does
    lines = PHILLY_SUMMARY.splitlines(keepends=True)
    some = importers.load(lines[0] + lines[5] + lines[5], "philly-summary", "p.csv")
    assert [j.job_id for j in some] == ["6214e9-1507529693-2775-2", "6214e9-1507529693-2775-2-1"]
    assert (some[0].tier, some[0].min_gpus) == (jobs[1].tier, jobs[1].min_gpus)
    with pytest.raises(TraceError, match="p.csv: no job of virtual cluster 'x' ran"):
        importers.load(PHILLY_SUMMARY, "philly-summary", "p.csv", cluster="x")
    with pytest.raises(TraceError, match="in philly-summary traces only"):
        importers.load(GOOD, "csv", "t.csv", cluster="x")


def test_the_published_philly_month_in_the_repository_imports() -> None:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "philly-6c71a0-2017-10.csv"
    jobs = importers.load(path.read_text(), "philly-summary", str(path))
    assert len(jobs) == 7846 and {j.job_id.split("-")[0] for j in jobs} == {"6c71a0"}
    assert max(j.gpus for j in jobs) == 8


def test_a_helios_cluster_log_becomes_jobs_and_cpu_only_jobs_are_left_out() -> None:
    jobs = importers.helios((DATA / "helios_cluster_log_sample.csv").read_text(), "helios")
    assert [(j.job_id, j.submit, j.duration, j.gpus) for j in jobs] == [
        ("h1", 0.0, 3600.0, 8), ("h3", 30.0, 120.0, 1), ("h4", 90.0, 600.0, 2)]


@pytest.mark.parametrize("fmt, text, message", [
    ("philly", "{not json", "not a Philly cluster_job_log"),
    ("philly", json.dumps({"jobid": "x"}), "the top level is not a list"),
    ("philly", json.dumps([{"jobid": "x", "submitted_time": "2017-10-07 01:00:00", "attempts": [
        {"start_time": "2017-10-07 02:00:00", "end_time": "2017-10-07 01:00:00", "detail": []}]}]),
     "job x: an attempt ends"),
    ("philly", json.dumps([{"jobid": "x", "submitted_time": "yesterday", "attempts": [
        {"start_time": "2017-10-07 01:00:00", "end_time": "2017-10-07 02:00:00",
         "detail": [{"ip": "m1", "gpus": ["gpu0"]}]}]}]), "job x: not a time: 'yesterday'"),
    ("helios", "job_id,gpu_num\nh1,1\n", "not a Helios cluster_log"),
    ("helios", "job_id,gpu_num,submit_time,duration\nh1,two,2020-04-01 00:00:00,60\n", "t:2: gpu_num is not"),
    ("philly-summary", "timestamp,num_gpus\n", "t:1: not a Philly job summary"),
    ("philly-summary", "timestamp,duration,num_gpus\n2017-10-09 07:01:55,long,1\n",
     "t:2: num_gpus and duration must be numbers"),
    ("philly-summary", "timestamp,duration,num_gpus\nmonday,60,1\n", "t:2: not a time: 'monday'"),
    ("philly-summary", "timestamp,duration,num_gpus\n2017-10-09 07:01:55,60,inf\n",
     "t:2: num_gpus and duration must be numbers"),
    ("xml", "", "unknown trace format 'xml'"),
])
def test_a_bad_published_trace_is_refused_saying_where(fmt: str, text: str, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        importers.load(text, fmt, "t")


def test_tiers_and_elasticity_are_drawn_from_the_job_id_with_the_shares_given() -> None:
    assert importers.assign("job-7", 8) == importers.assign("job-7", 8)
    assert importers.assign("job-7", 8, shares=(("standard", 1.0),), elastic_share=1.0) == ("standard", 2)
    assert importers.assign("job-7", 1, shares=(("basic", 1.0),), elastic_share=1.0) == ("basic", 1)
    tiers = [importers.assign(f"j{i}", 1)[0] for i in range(2000)]
    assert 0.15 < tiers.count("premium") / 2000 < 0.25 and 0.45 < tiers.count("basic") / 2000 < 0.55
