"""`tandem colocated`: a worker that prefills and decodes every request itself."""

from __future__ import annotations

from tandem.engine.role import Role
from tandem.engine.worker.cli import parser, serve
from tandem.engine.worker.role import ColocatedRole


def main(argv: list[str]) -> int:
    return serve(parser(Role.COLOCATED).parse_args(argv), ColocatedRole())
