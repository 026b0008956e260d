"""Logging for the root-side node hooks: one file per node, lines carry job id and node."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from .jobenv import NODE_NAME

LOG_DIR = Path(os.environ.get("SINGULARITY_LOG_DIR", "/var/log/singularity-slurm"))


def node_logger(component: str, node: str, job_id: int | str) -> logging.LoggerAdapter:
    logger = logging.getLogger(f"singularity.{component}")
    if not logger.handlers:
        logger.setLevel(logging.INFO)
        try:
            LOG_DIR.mkdir(parents=True, exist_ok=True)
            name = node if NODE_NAME.fullmatch(node) and ".." not in node else "unknown"
            handler: logging.Handler = logging.FileHandler(LOG_DIR / f"node-{name}.log")
        except OSError:
            handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(
            "%(asctime)s %(name)s job=%(job_id)s node=%(node)s %(levelname)s %(message)s"))
        logger.addHandler(handler)
        stderr = logging.StreamHandler()
        stderr.setLevel(logging.WARNING)
        stderr.setFormatter(logging.Formatter("singularity %(name)s: %(message)s"))
        logger.addHandler(stderr)
    return logging.LoggerAdapter(logger, {"job_id": job_id, "node": node})
