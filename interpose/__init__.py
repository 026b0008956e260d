"""Everything injected into a job's worker processes without changing the user's script.

The torch.distributed backend that routes collectives through the device proxy, the libc shim that
records files written outside the shared filesystems, and the CUDA driver shim.
"""
