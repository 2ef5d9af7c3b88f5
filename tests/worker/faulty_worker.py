"""A real ``tandem`` worker process with a fault planted in its engine (the failure tests' only
double: everything else is the shipped code path).

``TANDEM_TEST_FAULT=<mode>:<token>``: a model run whose batch holds a request whose prompt starts
with token id ``<token>`` raises. ``once`` raises for that batch (the engine contains it);
``fatal`` also makes the engine's accounting check fail, so the state cannot be restored and
the engine thread dies. ``TANDEM_TEST_STEP_DELAY=<seconds>`` adds that wait to every model run,
so a request stays in flight long enough for the next one to meet it however fast the CPU path
is (the tests' requests must overlap).
"""

from __future__ import annotations

import os
import sys
import time

from tandem.cli import main
from tandem.engine import recovery
from tandem.engine.model_runner import ModelRunner


def plant() -> None:
    mode, _, token = os.environ["TANDEM_TEST_FAULT"].partition(":")
    poison = int(token)
    delay = float(os.environ.get("TANDEM_TEST_STEP_DELAY", "0"))
    real = ModelRunner.execute

    def execute(self, out, inputs=None):  # noqa: ANN001, ANN202
        if any(s.request.prompt_token_ids[0] == poison for s in out.scheduled):
            if mode == "fatal":

                def broken(engine):  # noqa: ANN001, ANN202
                    raise AssertionError("injected: the accounting does not hold")

                recovery.check_engine_integrity = broken
            raise RuntimeError(f"injected fault ({mode})")
        if delay:
            time.sleep(delay)
        return real(self, out, inputs)

    ModelRunner.execute = execute


if __name__ == "__main__":
    plant()
    raise SystemExit(main(sys.argv[1:]))
