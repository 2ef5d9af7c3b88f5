"""The deployments compared, each with the same two worker cores. Pure.

- ``colo-bN``: one colocated worker on both cores (2 threads), token budget
  ``max_num_batched_tokens=N`` (swept: the best is the baseline, not the default);
- ``colo2``: two colocated workers, one per core (1 thread each), the router balancing them;
- ``pd-TRANSPORT-tT``: one prefill worker (first core) and one decode worker (second core), KV over
  ``tcp`` or ``ucx``, the router's ``--local-prefill-threshold T``.

The router and the load generator share ``aux`` (a third core when the machine has one, else the
first worker core, stated in the report).
"""

from __future__ import annotations

from dataclasses import dataclass

from benchlib.launch import Placement


@dataclass(slots=True, frozen=True)
class DeploymentSpec:
    name: str
    kind: str  # "colocated", "colocated-x2" or "pd"
    prefill: int
    decode: int
    kv_transport: str
    local_prefill_threshold: int
    engine_options: tuple[str, ...]
    placement: Placement


def cores(cpus: str) -> tuple[str, str]:
    """The two worker cores of a ``--cpus`` value such as "0,1"."""
    parts = [p.strip() for p in cpus.split(",") if p.strip()]
    if len(parts) != 2 or not all(p.isdigit() for p in parts) or parts[0] == parts[1]:
        raise ValueError(f"--cpus takes two distinct CPU numbers such as 0,1, got {cpus!r}")
    return parts[0], parts[1]


def build(
    names: list[str] | None,
    cpus: str,
    aux: str,
    budgets: tuple[int, ...],
    colo2_budget: int,
    thresholds: tuple[int, ...],
    transports: tuple[str, ...],
) -> list[DeploymentSpec]:
    """Every deployment of the comparison, or those in ``names`` (in the given order)."""
    a, b = cores(cpus)
    both = f"{a},{b}"
    out: list[DeploymentSpec] = []
    for n in budgets:
        out.append(DeploymentSpec(
            f"colo-b{n}", "colocated", 0, 1, "tcp", 0, (f"max_num_batched_tokens={n}",),
            Placement(router_cpus=aux, worker_cpus=(both,), worker_threads=(2,)),
        ))  # fmt: skip
    out.append(DeploymentSpec(
        "colo2", "colocated-x2", 0, 2, "tcp", 0, (f"max_num_batched_tokens={colo2_budget}",),
        Placement(router_cpus=aux, worker_cpus=(a, b), worker_threads=(1, 1)),
    ))  # fmt: skip
    for transport in transports:
        for t in thresholds:
            out.append(DeploymentSpec(
                f"pd-{transport}-t{t}", "pd", 1, 1, transport, t, (),
                Placement(router_cpus=aux, worker_cpus=(a, b), worker_threads=(1, 1)),
            ))  # fmt: skip
    if names is None:
        return out
    by_name = {d.name: d for d in out}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"unknown deployment(s) {unknown}; known: {sorted(by_name)}")
    return [by_name[n] for n in names]
