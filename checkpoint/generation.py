"""Checkpoint generations of multi-node jobs: one id that every node's part of a checkpoint carries.

A generation is written as ``"<restart>.<ns>"``: the job's Slurm restart count when it was taken and
the launcher's clock in nanoseconds. Generations order by those two numbers, never by their text (as
strings ``"9.x"`` sorts above ``"10.x"``, and a job at its tenth restart would restore an older
checkpoint).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import NamedTuple

from singularity_slurm.errors import InvalidCheckpointRequest

_TEXT = re.compile(r"(0|[1-9][0-9]{0,8})\.(0|[1-9][0-9]{0,19})")


class Generation(NamedTuple):
    """(restart, ns): compares as the pair of numbers."""

    restart: int
    ns: int

    @classmethod
    def parse(cls, text: object) -> Generation:
        """The generation `text` names; InvalidCheckpointRequest if it names none."""
        match = _TEXT.fullmatch(text) if isinstance(text, str) else None
        if match is None:
            raise InvalidCheckpointRequest(
                f"checkpoint generation {text!r} is not '<restart>.<nanoseconds>' (two decimal numbers "
                "without leading zeros, such as '10.1764612345000000000')"
            )
        return cls(int(match.group(1)), int(match.group(2)))

    def __str__(self) -> str:
        return f"{self.restart}.{self.ns}"


def newest_first(texts: Iterable[str]) -> list[str]:
    """The generations among `texts`, newest first; texts that name no generation are left out."""
    parsed = []
    for text in set(texts):
        try:
            parsed.append(Generation.parse(text))
        except InvalidCheckpointRequest:
            continue
    return [str(g) for g in sorted(parsed, reverse=True)]
