"""The coordinator: Singularity's shared state in Redis.

Redis holds the job registry written by Prolog and Epilog (job, user, tier, GPUs, restart count,
nodes, timestamps), and later the rendezvous generations, commands and heartbeats. Redis is an index
and a coordination medium, never the only copy of something that matters: checkpoints live in the
store. Key names come from `keys`; nothing else spells a key.
"""
