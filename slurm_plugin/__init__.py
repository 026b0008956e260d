"""Everything Slurm-facing above the daemons: the SPANK plugin (`spank/`, C), the job-submit and
client-side policy (`lua/` templates, `policy`), the admin check and the `singularityctl` command line
(`cli`). Root daemons never import from here; the Slurm client they share is `singularity_slurm.slurmcli`."""
