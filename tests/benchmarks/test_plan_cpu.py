"""plan_cpu: schedstat parsing, the per-process comparison and its table, and the simulator's
CPU by process on a real simulation."""

import os

import pytest
from plan_cpu import (
    CpuRow,
    SchedStat,
    compare,
    parse_schedstat,
    render,
    role_schedstats,
    simulated_cpu,
)
from plan_validation import DEPLOYMENTS, simulation
from sim_profiles import write_profile

from tandem.calibrate import CLIENT
from tandem.engine.sim.profile import ServingCost
from tandem.planner.workload import Lengths, Workload


def test_parse_schedstat_reads_seconds_and_slices() -> None:
    assert parse_schedstat("1500000000 250000000 42\n") == SchedStat(1.5, 0.25, 42)


def test_parse_schedstat_refuses_a_short_line() -> None:
    with pytest.raises(ValueError):
        parse_schedstat("1500000000 42")


def test_schedstats_add_and_subtract_fieldwise() -> None:
    a, b = SchedStat(2.0, 0.5, 10), SchedStat(0.5, 0.25, 4)
    assert a + b == SchedStat(2.5, 0.75, 14)
    assert a - b == SchedStat(1.5, 0.25, 6)


def test_this_process_has_a_readable_schedstat() -> None:
    s = parse_schedstat(open(f"/proc/{os.getpid()}/schedstat").read())
    assert s.run > 0.0 and s.slices > 0


def test_role_schedstats_sums_this_process_threads_as_the_client() -> None:
    stats = role_schedstats(os.getpid())  # no `tandem` children: the client alone
    assert set(stats) == {CLIENT}
    assert stats[CLIENT].run > 0.0 and stats[CLIENT].slices > 0


def test_compare_gives_every_process_per_request_figures() -> None:
    rows = compare({"router": 2.0, CLIENT: 1.0}, {"router": SchedStat(2.0, 0.4, 200)},
                   {"router": 1.0, "decode": 3.0}, requests=100)  # fmt: skip
    assert rows == [
        CpuRow(CLIENT, 0.01, 0.0, 0.0, 0.0),
        CpuRow("decode", 0.0, 0.03, 0.0, 0.0),
        CpuRow("router", 0.02, 0.01, 0.004, 0.002),
    ]


def test_render_gives_milliseconds_and_the_measured_over_simulated_ratio() -> None:
    out = render([CpuRow("router", 0.0209, 0.0136, 0.0146, 0.000139),
                  CpuRow(CLIENT, 0.0132, 0.0, 0.0053, 0.000078)]).splitlines()  # fmt: skip

    def cells(line: str) -> list[str]:
        return [c.strip() for c in line.split("|")]

    assert cells(out[1]) == ["router", "20.9", "13.6", "1.54", "14.6", "0.139"]
    assert cells(out[2]) == [CLIENT, "13.2", "0.0", "-", "5.3", "0.078"]  # no ratio
    assert cells(out[3]) == ["all", "34.1", "13.6", "2.51", ""]


def test_simulated_cpu_splits_the_charges_by_process(tmp_path) -> None:
    serving = ServingCost(0.004, 0.0005, 0.002, router_request_cpu=0.002,
                          router_token_cpu=0.0002, client_request_cpu=0.002,
                          client_token_cpu=0.0001)  # fmt: skip
    path = write_profile(tmp_path / "p.json", serving=serving)
    w = Workload(rate=5.0, isl=Lengths(16), osl=Lengths(8), num_requests=20)
    p, d = DEPLOYMENTS["1P1D"]
    sim = simulation(path, w, p, d, cores=2, simulated=False)
    cpu = simulated_cpu(sim)
    assert set(cpu) == {"router", CLIENT, "prefill", "decode"}
    assert cpu["router"] == pytest.approx(sum(loop.busy_seconds for loop in sim.router.loops))
    assert cpu[CLIENT] == pytest.approx(sim.router.client.busy_seconds)
    assert cpu["decode"] == pytest.approx(sum(w.busy_seconds for w in sim.workers
                                              if w.role.label == "decode"))  # fmt: skip
    assert all(v > 0.0 for v in cpu.values())
