"""Job status: Slurm's view joined with the Redis registry (pure merge, thin gathering)."""

from __future__ import annotations

import time
from typing import Any

from singularity_slurm.config import Config
from singularity_slurm.coordinator.placement import describe
from singularity_slurm.sla import report
from singularity_slurm.slurmcli import expand_hostlist, parse_gpu_count, parse_user


def merge_job(slurm: dict[str, str] | None, record: dict | None, config: Config,
              now: float | None = None) -> dict[str, Any]:
    """One job as `status` shows it; either side may be missing (Slurm forgot it, or Redis did)."""
    out: dict[str, Any] = {}
    if slurm is not None:
        user, uid = parse_user(slurm.get("UserId", ""))
        nodes = expand_hostlist(slurm.get("NodeList", ""))
        per_node = parse_gpu_count(slurm)
        per_job = parse_gpu_count({"TresPerNode": slurm.get("TresPerJob", "")})
        node_count = int(slurm.get("NumNodes", "1").split("-")[0] or 1)
        partition = slurm.get("Partition", "")
        out.update({
            "job_id": int(slurm["JobId"]),
            "name": slurm.get("JobName"),
            "user": user,
            "uid": uid,
            "partition": partition,
            "state": slurm.get("JobState"),
            "reason": slurm.get("Reason") if slurm.get("Reason") not in {None, "None"} else None,
            "restart_count": int(slurm.get("Restarts", "0") or 0),
            "requeue": slurm.get("Requeue") == "1",
            "gpus_per_node": per_node,
            "gpus": per_job or per_node * (len(nodes) or node_count),
            "nodes": nodes,
            "tier": config.tier_of_partition(partition),
        })
    if record is not None:
        out.setdefault("job_id", record["job_id"])
        out.setdefault("user", record.get("user"))
        out.setdefault("uid", record.get("uid"))
        out.setdefault("partition", record.get("partition"))
        out.setdefault("state", "ENDED" if record.get("state") == "ended" else "UNKNOWN")
        out.setdefault("restart_count", record.get("restart_count", 0))
        out.setdefault("nodes", sorted(record.get("nodes", {})))
        out["tier"] = record.get("tier") or out.get("tier")
        out["registry"] = {
            "state": record.get("state"),
            "restart_count": record.get("restart_count"),
            "first_started_at": record.get("first_started_at"),
            "started_at": record.get("started_at"),
            "ended_at": record.get("ended_at"),
            "node_gpus": {n: v["gpus"] for n, v in record.get("nodes", {}).items()},
            "gpu_inventory": {n: v["gpu_inventory"] for n, v in record.get("nodes", {}).items()
                              if v.get("gpu_inventory")},
            "events": record.get("events", []),
        }
        out["checkpoints"] = record.get("checkpoints", [])
        out["restores"] = [e for e in record.get("events", []) if e.get("event") == "restore"]
        out["failures"] = [e for e in record.get("events", []) if e.get("event") == "checkpoint_failed"]
        out["sizes"] = [e for e in record.get("events", []) if e.get("event") == "size"]
        accounted = report.job_sla(record, now=now, window=float(config.sla.window_s))
        if accounted is not None:
            out["sla"] = {"floor": accounted.floor, "window_s": config.sla.window_s,
                          "fraction": report.to_json(accounted)["fraction"],
                          "windows": len(accounted.windows), "violations": accounted.violations,
                          "current": accounted.windows[-1].fraction if accounted.windows else None}
    else:
        out["registry"] = None
    out.setdefault("checkpoints", [])
    out.setdefault("restores", [])
    out.setdefault("failures", [])
    out.setdefault("sizes", [])
    out["managed"] = out.get("tier") is not None
    return out


def format_table(jobs: list[dict[str, Any]]) -> str:
    headers = ["JOBID", "USER", "TIER", "STATE", "RESTARTS", "GPUS", "NODES", "CKPTS", "REASON"]
    rows = [[
        str(j.get("job_id")), str(j.get("user") or "-"), str(j.get("tier") or "-"),
        str(j.get("state") or "-"), str(j.get("restart_count", 0)), str(j.get("gpus") or 0),
        ",".join(j.get("nodes") or []) or "-", str(len(j.get("checkpoints") or [])),
        str(j.get("reason") or ""),
    ] for j in jobs]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def _when(seconds: float | None) -> str:
    if not seconds:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def _mib(n: int | None) -> str:
    return f"{(n or 0) / (1 << 20):.1f} MiB"


def _size_line(event: dict[str, Any]) -> str:
    def text(size: Any) -> str:
        try:
            return describe(int(size["ranks"]), int(size["devices"]), int(size["nodes"]))
        except (KeyError, TypeError, ValueError):
            return "size unknown"

    how = "started" if event.get("how") == "start" else "restored"
    cause = f" after {event['cause']}" if event.get("cause") and how == "restored" else ""
    was = f", was {text(event['was'])}" if event.get("was") else ""
    return f"{how}{cause}: {text(event.get('size'))}{was}"


def format_details(job: dict[str, Any]) -> str:
    """The checkpoints and restores of one job, below its table row."""
    lines = [format_table([job]), ""]
    checkpoints = job.get("checkpoints") or []
    if checkpoints:
        lines.append("checkpoints (newest last):")
        lines.append("  SEQ  TIME                 REASON    NODE  LOGICAL      STORED       DEDUP  SECONDS")
        for c in checkpoints:
            ratio = f"{c['dedup_ratio']:.1f}x" if c.get("dedup_ratio") else "-"
            lines.append(f"  {c.get('seq', '-'):<4} {_when(c.get('created_at')):<20} "
                         f"{c.get('reason', '-'):<9} {c.get('node') or '-':<5} "
                         f"{_mib(c.get('logical_bytes')):<12} {_mib(c.get('new_bytes')):<12} "
                         f"{ratio:<6} {c.get('seconds') if c.get('seconds') is not None else '-'}")
    else:
        lines.append("checkpoints: none recorded")
    restores = job.get("restores") or []
    if restores:
        lines.append("restores:")
        for r in restores:
            refused = "".join(f"; checkpoint {x['seq']} refused: {x['reason']}" for x in r.get("refused", []))
            lines.append(f"  {_when(r.get('time'))}  checkpoint {r.get('seq')} on {r.get('node')} "
                         f"in {r.get('seconds')}s{refused}")
    inventory = (job.get("registry") or {}).get("gpu_inventory") or {}
    if inventory:
        lines.append("GPUs (NVML, at the job's start on each node):")
        for node, found in sorted(inventory.items()):
            for gpu in found:
                health = "; ".join(gpu.get("problems") or []) or "healthy"
                lines.append(f"  {node:<5} GPU {gpu.get('index')}  {gpu.get('name')}  {gpu.get('uuid')}  "
                             f"{gpu.get('memory_mib')} MiB  {health}")
    sla = job.get("sla")
    if sla:
        floor = "best effort" if not sla["floor"] else f"floor {sla['floor']:.2f}"
        current = "-" if sla["current"] is None else f"{sla['current']:.3f}"
        life = "-" if sla["fraction"] is None else f"{sla['fraction']:.3f}"
        lines.append(f"SLA ({floor}, {sla['window_s']}s windows): GPU fraction {life} over its life, "
                     f"{current} in its latest window, {sla['violations']} of {sla['windows']} window(s) "
                     f"violated (singularityctl sla {job.get('job_id')})")
    sizes = job.get("sizes") or []
    if sizes:
        lines.append("sizes (a distributed job's starts and restores):")
        for s in sizes:
            lines.append(f"  {_when(s.get('time'))}  {_size_line(s)}")
    for failure in job.get("failures") or []:
        lines.append(f"checkpoint failed {_when(failure.get('time'))} on {failure.get('node')} "
                     f"({failure.get('reason')}): {failure.get('error')}")
    return "\n".join(lines)
