"""``tandem bench --url URL [guidellm options]``: guidellm against a Tandem (or any OpenAI) endpoint
with the model and tokenizer filled in from the endpoint.

A thin wrapper, no logic of its own beyond that: it reads ``URL/v1/models``, passes guidellm
``--backend kind=openai_http,target=URL/v1,model=ID`` and ``--tokenizer`` (the card's ``root``, the
tokenizer directory the router uses; else the bundled demo for ``demo``; else the id itself when it
is a local directory), and runs ``guidellm run`` with every other option as given. A ``--backend``
or ``--tokenizer`` of your own wins. An API key comes from ``TANDEM_API_KEY`` (or
``OPENAI_API_KEY``), never the command line: it reaches guidellm in a scenario file only this user
can read, deleted afterwards.

    tandem bench --url http://127.0.0.1:8000 --profile kind=poisson,rate=2 \\
        --data kind=synthetic_text,prompt_tokens=256,output_tokens=128 \\
        --constraint kind=max_duration,seconds=30 --output kind=json,path=bench.json

guidellm's synthetic prompts depend only on its ``--seed`` (default 42): a second run with the same
seed against the same server is served from its prefix cache. Vary ``--seed kind=static,value=N``
between runs on one deployment.

``main(argv) -> int`` is called by ``tandem.cli``; it returns guidellm's exit code.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

USAGE = """usage: tandem bench --url URL [--print-command] [guidellm run options]

Runs `guidellm run` against URL with --backend (target and model from URL/v1/models) and
--tokenizer filled in; every other option goes to guidellm as given (`guidellm run --help`).
The API key, if any, comes from TANDEM_API_KEY or OPENAI_API_KEY."""


@dataclass(slots=True, frozen=True)
class Command:
    argv: list[str]
    scenario: dict[str, Any] | None  # written to a private file and passed with -c when set


def split_args(argv: Sequence[str]) -> tuple[str | None, bool, list[str]]:
    """(--url, --print-command, the rest) from our command line."""
    url, show, rest = None, False, []
    it = iter(argv)
    for a in it:
        if a == "--url":
            url = next(it, None)
        elif a.startswith("--url="):
            url = a.split("=", 1)[1]
        elif a == "--print-command":
            show = True
        else:
            rest.append(a)
    return url, show, rest


def _has(rest: Sequence[str], *flags: str) -> bool:
    return any(a in flags or a.split("=", 1)[0] in flags for a in rest)


def tokenizer_for(card: Mapping[str, Any]) -> str | None:
    """The local tokenizer directory of a /v1/models card, or None when there is none here."""
    root = card.get("root")
    if isinstance(root, str) and Path(root, "tokenizer_config.json").is_file():
        return root
    if card.get("id") == "demo":
        from tandem.engine.model_path import resolve_model_path

        return str(resolve_model_path("demo"))
    ident = str(card.get("id", ""))
    if ident and Path(ident, "tokenizer_config.json").is_file():
        return ident
    return None


def build(url: str, card: Mapping[str, Any], rest: Sequence[str], guidellm: str,
          api_key: str | None) -> Command:  # fmt: skip
    """The guidellm command for ``url`` serving the model of ``card``. Raises ValueError when the
    tokenizer cannot be found and the user gave none."""
    base = url.rstrip("/").removesuffix("/v1")
    argv = [guidellm, "run"]
    scenario = None
    if not _has(rest, "--backend"):
        backend = {"kind": "openai_http", "target": f"{base}/v1", "model": card["id"]}
        if api_key:
            scenario = {"backend": {**backend, "api_key": api_key}}
        else:
            argv += ["--backend", ",".join(f"{k}={v}" for k, v in backend.items())]
    if not _has(rest, "--tokenizer"):
        tok = tokenizer_for(card)
        if tok is None:
            raise ValueError(
                f"no local tokenizer for model {card.get('id')!r}: pass "
                "--tokenizer kind=huggingface_auto,model=DIR"
            )
        argv += ["--tokenizer", f"kind=huggingface_auto,model={tok}"]
    return Command(argv + list(rest), scenario)


def guidellm_bin() -> str | None:
    here = Path(sys.executable).with_name("guidellm")
    return str(here) if here.exists() else shutil.which("guidellm")


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    url, show, rest = split_args(argv)
    if not url:
        print(f"tandem bench: --url is required\n\n{USAGE}", file=sys.stderr)
        return 2
    guidellm = guidellm_bin()
    if guidellm is None:
        print("tandem bench: guidellm is not installed (pip install 'tandem[bench]')",
              file=sys.stderr)  # fmt: skip
        return 2
    key = os.environ.get("TANDEM_API_KEY") or os.environ.get("OPENAI_API_KEY") or None
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    base = url.rstrip("/").removesuffix("/v1")
    try:
        r = httpx.get(f"{base}/v1/models", headers=headers, timeout=10)
        r.raise_for_status()
        card = r.json()["data"][0]
        cmd = build(base, card, rest, guidellm, key)
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        print(f"tandem bench: {base}/v1/models: {exc}", file=sys.stderr)
        return 2
    # guidellm's multiprocessing helpers put the working directory on sys.path; run from this
    # repository's root, its operator/ would shadow the standard library.
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
        args = cmd.argv
        if cmd.scenario is not None:
            path = Path(tmp, "scenario.json")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(cmd.scenario, f)
            args = [*args[:2], "-c", str(path), *args[2:]]
        if show:
            print(" ".join(args))
            return 0
        return subprocess.run(args, env=env, check=False).returncode
