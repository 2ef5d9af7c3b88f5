"""The serving calibration's pure parts and its per-process CPU reading (a real child)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tandem.calibrate import children_cpu, process_cpu, quantiles


def test_quantiles_are_evenly_spaced_order_statistics() -> None:
    assert quantiles(range(100)) == (5, 15, 25, 35, 45, 55, 65, 75, 85, 95)
    assert quantiles([3.0, 1.0, 2.0], n=3) == (1.0, 2.0, 3.0)
    assert quantiles([7.0]) == (7.0,) * 10


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
