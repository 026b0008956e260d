"""The folder `singularityctl run --world-size N` puts first on the workers' PYTHONPATH.

It is imported as a package only by the root side (the proxy imports the wire protocol from
`_singularity_worker`); a worker sees its two entries as top-level names: `sitecustomize` and
`_singularity_worker`. Everything in it runs in the job's own Python, so it needs nothing but the
standard library and the job's torch.
"""
