"""Everything Slurm-facing: the SPANK plugin (`spank/`, C), the job-submit and client-side policy
(`lua/` templates, `policy`), the Slurm client (`slurm`), the admin check and the `singularityctl`
command line (`cli`)."""
