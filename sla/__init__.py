"""SLA tiers as measured guarantees: GPU-fraction accounting, the controller's decisions, and the
fleet simulator that runs the same decisions on a job trace.

`accounting` turns a job's timeline (what it held, and when) into per-window GPU fractions and
violations; `policy` decides, from a snapshot of the cluster, what the controller does (protect a
job heading below its floor, grow a shrunk one, shrink elastic jobs instead of requeueing them);
`trace` reads job traces; `sim` replays a trace under Slurm's native preemption, under Singularity's
work-conserving checkpoints, and under the full controller. Everything here is plain functions of
plain data: the daemons and the simulator are thin shells around it.
"""
