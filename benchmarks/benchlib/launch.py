"""The one launcher of the serving benchmarks: a router and its workers as local processes.

It builds exactly the processes ``tandem up`` would (``tandem.up.build_specs``) and runs them under
``tandem up``'s ``Supervisor``, adding what ``tandem up`` has no business doing: each process can be
pinned to CPUs with ``taskset`` and given its own ``OMP_NUM_THREADS``, so deployments compared in
one run get the same hardware budget. A ``Deployment`` is a context manager; leaving it stops every
process group (SIGTERM, then SIGKILL after a grace period), and every child also gets SIGTERM if
the benchmark itself dies.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import httpx

from tandem.engine.cluster_token import generate_token
from tandem.up import (
    ProcessSpec,
    Supervisor,
    UpConfig,
    build_specs,
    registered_roles,
    worker_port,
)


@dataclass(slots=True, frozen=True)
class Placement:
    """Where each process runs: ``cpus`` is a taskset list ("0", "0,1") or None (unpinned);
    ``threads`` its OMP_NUM_THREADS (None: inherited). ``workers`` follow ``build_specs``'s order:
    prefill workers first, then decode (or colocated) workers."""

    router_cpus: str | None = None
    router_threads: int | None = 1
    worker_cpus: tuple[str | None, ...] = ()
    worker_threads: tuple[int | None, ...] = ()


def cpu_count(cpus: str) -> int:
    """Number of CPUs in a taskset list such as "0", "0,1" or "0-3,6"."""
    n = 0
    for part in cpus.split(","):
        lo, _, hi = part.partition("-")
        n += int(hi or lo) - int(lo) + 1
    return n


def pinned(spec: ProcessSpec, cpus: str | None, threads: int | None) -> ProcessSpec:
    """``spec`` run under ``taskset -c cpus`` with ``OMP_NUM_THREADS=threads`` (each when set)."""
    argv = spec.argv if cpus is None else ("taskset", "-c", cpus, *spec.argv)
    env = dict(spec.env)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return dataclasses.replace(spec, argv=argv, env=tuple(sorted(env.items())))


def place(specs: Sequence[ProcessSpec], placement: Placement) -> list[ProcessSpec]:
    """Apply ``placement`` to ``build_specs``'s output (router first, then the workers)."""
    workers = specs[1:]
    for name, given in (("worker_cpus", placement.worker_cpus),
                        ("worker_threads", placement.worker_threads)):  # fmt: skip
        if given and len(given) != len(workers):
            raise ValueError(f"{name} names {len(given)} workers, the deployment has "
                             f"{len(workers)}")  # fmt: skip
    out = [pinned(specs[0], placement.router_cpus, placement.router_threads)]
    for i, spec in enumerate(workers):
        cpus = placement.worker_cpus[i] if placement.worker_cpus else None
        threads = placement.worker_threads[i] if placement.worker_threads else None
        out.append(pinned(spec, cpus, threads))
    return out


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


class Deployment:
    """A router plus workers of ``config`` (its ``port`` 0: a free one), placed by ``placement``.
    ``start()`` returns once every worker has registered with the router."""

    def __init__(self, config: UpConfig, placement: Placement | None = None,
                 log_dir: Path | None = None, ready_timeout_s: float = 600.0) -> None:  # fmt: skip
        if config.port == 0:
            # Below the ephemeral range, as `tandem up` picks its workers' ports: a port probed
            # there can be taken by any socket's own ephemeral bind before the router binds it
            # (a CI run's router exited on start-up with exit code 3).
            config = dataclasses.replace(config, port=worker_port(config.host))
        self.config = config
        self.placement = placement or Placement(router_threads=None)
        self._own_log_dir = log_dir is None
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="tandem-bench-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.ready_timeout_s = ready_timeout_s
        # As `tandem up` does: a fresh cluster token, handed to the children by environment.
        self.token = generate_token()
        specs = build_specs(config, iter(worker_port, None), token=self.token)
        self.specs = place(specs, self.placement)
        self.supervisor = Supervisor(self.log_dir, out=lambda s: print(s, file=sys.stderr))

    @property
    def url(self) -> str:
        return self.specs[0].url

    @property
    def internal_url(self) -> str:
        """The router's worker-facing listener (registry), behind the cluster token."""
        internal = self.specs[0].internal_url
        assert internal is not None
        return internal

    @property
    def cluster_headers(self) -> dict[str, str]:
        """Credentials for worker-facing routes (the registry, workers' /info and internal API)."""
        return {"Authorization": f"Bearer {self.token}"}

    def start(self) -> Deployment:
        if shutil.which("taskset") is None and any(s.argv[0] == "taskset" for s in self.specs):
            raise RuntimeError("pinning needs taskset (util-linux)")
        want: dict[str, int] = {}
        for s in self.specs[1:]:
            want[s.role] = want.get(s.role, 0) + 1
        try:
            for spec in self.specs:
                self.supervisor.spawn(spec)
            self.supervisor.wait_until(lambda: _healthy(self.url),
                                       self.ready_timeout_s, "the router")  # fmt: skip
            self.supervisor.wait_until(
                lambda: registered_roles(self.internal_url, self.token) == want,
                self.ready_timeout_s,
                "every worker to register",
            )  # fmt: skip
        except BaseException:
            self.stop()
            raise
        return self

    def dead(self) -> str | None:
        """The name of a child that exited, with its log tail, or None while all run."""
        child = self.supervisor.dead()
        if child is None:
            return None
        return f"{child.spec.name} exited with {child.proc.returncode}:\n{child.tail()}"

    def stop(self) -> None:
        self.supervisor.stop_all()
        if self._own_log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:  # fmt: skip
        self.stop()
