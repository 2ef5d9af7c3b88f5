"""The `tandem` command. Subcommands import lazily: the operator needs no torch."""

from __future__ import annotations

import sys

USAGE = """usage: tandem <command> [options]

commands:
  up         run router + prefill + decode workers locally (the demo model by default)
  router     the OpenAI-compatible router
  prefill    a prefill worker
  decode     a decode worker
  colocated  a worker that prefills and decodes (no disaggregation)
  drain      ask the worker on this host to drain (the pods' preStop hook)
  operator   the Kubernetes operator
  bench      guidellm against a running endpoint (model and tokenizer filled in)
  profile    measure step and KV transfer times on this machine (for plan and --simulate)
  plan       pick the prefill:decode split for a workload and latency targets

`tandem <command> --help` for its options."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "prefill":
        from tandem.prefill.cli import main as prefill_main

        return prefill_main(rest)
    if cmd == "decode":
        from tandem.decode.cli import main as decode_main

        return decode_main(rest)
    if cmd == "colocated":
        from tandem.decode.colocated import main as colocated_main

        return colocated_main(rest)
    if cmd == "drain":
        from tandem.engine.worker.drain import main as drain_main

        return drain_main(rest)
    if cmd == "router":
        from tandem.router.cli import main as router_main

        return router_main(rest)
    if cmd == "up":
        from tandem.up import main as up_main

        return up_main(rest)
    if cmd == "bench":
        from tandem.bench import main as bench_main

        return bench_main(rest)
    if cmd == "profile":
        from tandem.profile import main as profile_main

        return profile_main(rest)
    if cmd == "plan":
        from tandem.planner.cli import main as plan_main

        return plan_main(rest)
    if cmd == "operator":
        from tandem.operator.cli import main as operator_main

        return operator_main(rest)
    print(f"tandem: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
