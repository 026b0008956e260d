"""The Slurm Prolog (root, on every node of a job at allocation, `PrologFlags=Alloc`).

It records the job and node in the Redis registry and starts the job's node services (the node agent
now, the device proxies later), each tracked by a pid file in the job's node-local folder. Exit status
is non-zero only when the node cannot run the job (a service will not start, the state folder cannot
be written): Slurm then drains the node and requeues the job. A Redis outage is logged, not fatal.
"""
