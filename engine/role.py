"""The one ``Role`` of a worker: colocated, prefill or decode (DESIGN.md section 2).

Imported by the engine core, the worker shell, the roles, the KV connector and the router (which
must not import torch: this module imports nothing).
"""

from __future__ import annotations

from enum import IntEnum


class Role(IntEnum):
    COLOCATED = 0
    PREFILL = 1
    DECODE = 2

    @classmethod
    def parse(cls, value: object) -> Role:
        """``"prefill"`` (any case) or a Role; ValueError naming the choices otherwise."""
        if isinstance(value, Role):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        raise ValueError(f"role must be one of colocated, prefill, decode; got {value!r}")

    @property
    def label(self) -> str:
        """The wire and metric label: ``prefill``, ``decode`` or ``colocated``."""
        return self.name.lower()
