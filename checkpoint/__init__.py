"""The checkpoint engine: the deduplicated checkpoint store and the CRIU dump/restore of job processes.

`store` keeps checkpoints on a shared filesystem as content-addressed chunks (xxh3-128) in packs,
one per writer, and one manifest per checkpoint, committed atomically; it is the source of truth
(Redis only indexes it). `manifest` and `packs` are its two on-disk formats: binary chunk tables and
pack indexes, held in memory as arrays (about 20 and 60 bytes a chunk).
`criu` dumps and restores a process tree through pycriu; `images` moves CRIU image folders into the
store and back, cutting chunks where memory regions start. The node agent drives them
(`singularity_slurm.node.engine`).
"""
