"""The serving calibration's pure parts and its per-process CPU reading (a real child)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tandem.calibrate import children_cpu, process_cpu, quantiles, steady_quantiles


def test_quantiles_are_evenly_spaced_order_statistics() -> None:
    assert quantiles(range(100)) == (5, 15, 25, 35, 45, 55, 65, 75, 85, 95)
    assert quantiles([3.0, 1.0, 2.0], n=3) == (1.0, 2.0, 3.0)
    assert quantiles([7.0]) == (7.0,) * 10


def test_steady_quantiles_ignore_one_noisy_stretch_of_the_phase() -> None:
    # 40 requests in order: 1 ms each, but ten in a row at 20-29 ms (another tenant's burst).
    steady = [1.0] * 10 + [float(v) for v in range(20, 30)] + [1.0] * 20
    # Pooled, the burst sets the top three deciles; the median over the four parts of ten
    # (one of them the burst) is the steady 1 ms throughout.
    assert quantiles(steady)[-3:] == (20.0, 24.0, 28.0)
    assert steady_quantiles(steady) == (1.0,) * 10
    # Even parts: quantile by quantile, the median of the parts' (the two middle ones' mean).
    parts = [1.0, 2.0] * 2 + [3.0, 4.0] * 2 + [5.0, 6.0] * 2 + [7.0, 8.0] * 2
    assert steady_quantiles(parts, n=2) == (4.0, 5.0)
    # Too few values to split: plain quantiles.
    assert steady_quantiles([3.0, 1.0, 2.0], n=3) == quantiles([3.0, 1.0, 2.0], n=3)


def test_process_cpu_counts_threads_that_have_ended() -> None:
    # A child that burns 0.3 s of CPU on a second thread, then waits to be read.
    code = ("import threading, time\n"
            "def burn():\n"
            "    t = time.thread_time()\n"
            "    while time.thread_time() - t < 0.3: pass\n"
            "th = threading.Thread(target=burn); th.start(); th.join()\n"
            "print('done', flush=True); time.sleep(30)\n")  # fmt: skip
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "done\n"
        # The burning thread has ended; its CPU still counts (a worker's short-lived threads).
        assert 0.3 <= process_cpu(Path(f"/proc/{child.pid}")) < 2.0
        assert children_cpu(child.pid) == {}  # it has no children
    finally:
        child.kill()
        child.wait()
