"""The dev cluster: a real two-node Slurm cluster on one Debian 12/13 machine, for demos and tests.

`singularityctl devcluster up` installs and starts munge, Slurm (slurmctld and two slurmd, `-N n1`
and `-N n2`, with 4 fake GPUs each), Redis with a password, CRIU 4.1.1 built from
Debian's source with our patches (`checkpoint/criu_patches/`) and pycriu, and a non-root
job user; it configures one partition per SLA tier with `PreemptMode=REQUEUE`, our Prolog/Epilog,
SPANK plugin and job-submit policy. `render` builds the config files (pure), `install` brings the
packages, `daemons` starts and stops processes by pid file, `cluster` puts it together.
"""
