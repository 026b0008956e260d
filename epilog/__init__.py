"""The Slurm Epilog (root, on every node of a job when it ends, including before a requeue).

It stops the job's node services (whole process groups, pid files checked against process start
times), removes the job's node-local state and drops the node from the job's registry record; the
last node marks the job ended. Exit status is non-zero only when a service could not be stopped,
which would leave stray processes on the node: Slurm then drains it.
"""
