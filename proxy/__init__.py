"""Device proxies: one daemon per allocated device, serving the job's workers over shared memory.

The proxy owns the device (or, on CPU-only nodes, a CPU device slot), runs the workers' device work
and collectives through a hardware abstraction layer, and holds no state that must survive a
checkpoint, which is what makes a consistent distributed cut possible. Prolog starts the proxies and
Epilog stops them, through `singularity_slurm.node.services`.
"""
