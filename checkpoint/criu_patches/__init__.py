"""The patches that the dev-cluster installer applies to Debian's criu source before it builds criu.

`singularity_slurm.devcluster.install.ensure_criu` downloads the upstream tarball of Debian 13's criu
source package, applies every `*.patch` file of this folder in name order with `patch -p1` (no fuzz),
builds criu and installs it as PREFIX/criu/bin/criu; PREFIX/criu/BUILD records the upstream version
and a digest of these files, so that a changed, added or removed patch rebuilds criu at the next
`singularityctl devcluster up`. Each patch opens with what it changes and why, and names the
integration test that exercises it.
"""
