"""Singularity for Slurm: transparent preemption, migration and elasticity for deep-learning jobs.

This root package holds what every component shares: the admin configuration (`config`) and the
error hierarchy (`errors`). The components live in their own sub-packages: `slurm_plugin` (SPANK
plugin, job-submit policy, Slurm client, CLI), `prolog` and `epilog` (Slurm's node hooks), `node`
(per-job node services), `coordinator` (the Redis-backed registry), `proxy` (device proxies),
`interpose` (what is injected into workers) and `devcluster` (a two-node Slurm cluster on one machine).
"""

__version__ = "0.1.0"
