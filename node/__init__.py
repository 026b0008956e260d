"""Per-job node services: what Prolog starts and Epilog stops on every node of a job.

`services` is the plumbing (start as a daemon, pid file with the process's start time so a recycled
pid is never signalled, readiness wait, clean stop of the whole process group). `agent` is the node
agent, one per job per node, running as root and answering only the job's user and root over a unix
socket (SO_PEERCRED); CRIU dump and restore are added to it by the checkpoint work.
"""
