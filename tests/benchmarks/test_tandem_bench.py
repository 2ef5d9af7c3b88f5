"""`tandem bench`: the guidellm command it builds from /v1/models, and one real run against a
colocated demo deployment."""

import json
import os
import subprocess
from pathlib import Path

import pytest
from benchlib.launch import Deployment

from tandem.bench import build, split_args, tokenizer_for
from tandem.child_command import tandem_argv
from tandem.engine.model_path import resolve_model_path
from tandem.up import UpConfig

DEMO = str(resolve_model_path("demo"))


def test_split_args_keeps_guidellm_options_in_order() -> None:
    assert split_args(["--url", "http://h:1", "--profile", "kind=synchronous", "--print-command"]
                      ) == ("http://h:1", True, ["--profile", "kind=synchronous"])  # fmt: skip
    assert split_args(["--url=http://h:2", "-c", "x"]) == ("http://h:2", False, ["-c", "x"])


def test_tokenizer_from_root_demo_or_local_id(tmp_path: Path) -> None:
    assert tokenizer_for({"id": "served", "root": DEMO}) == DEMO
    assert tokenizer_for({"id": "demo", "root": "demo"}) == DEMO
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert tokenizer_for({"id": str(tmp_path)}) == str(tmp_path)
    assert tokenizer_for({"id": "org/remote-model", "root": "/nonexistent"}) is None


def test_build_fills_backend_and_tokenizer_unless_given() -> None:
    card = {"id": "demo", "root": DEMO}
    cmd = build("http://h:1/v1/", card, ["--profile", "kind=synchronous"], "guidellm", None)
    assert cmd.argv == [
        "guidellm",
        "run",
        "--backend",
        "kind=openai_http,target=http://h:1/v1,model=demo",
        "--tokenizer",
        f"kind=huggingface_auto,model={DEMO}",
        "--profile",
        "kind=synchronous",
    ]
    assert cmd.scenario is None  # fmt: skip
    own = build("http://h:1", card, ["--backend", "kind=openai_http,target=x", "--tokenizer=t"],
                "guidellm", None)  # fmt: skip
    assert own.argv == ["guidellm", "run", "--backend", "kind=openai_http,target=x",
                        "--tokenizer=t"]  # fmt: skip
    with pytest.raises(ValueError, match="no local tokenizer"):
        build("http://h:1", {"id": "org/remote"}, [], "guidellm", None)


def test_api_key_goes_in_the_scenario_never_the_command_line() -> None:
    cmd = build("http://h:1", {"id": "demo"}, [], "guidellm", "sk-secret")
    assert not any("sk-secret" in a for a in cmd.argv)
    assert cmd.scenario == {"backend": {"kind": "openai_http", "target": "http://h:1/v1",
                                        "model": "demo", "api_key": "sk-secret"}}  # fmt: skip


def test_tandem_bench_runs_guidellm_against_a_deployment(tmp_path: Path) -> None:
    config = UpConfig(model="demo", port=0, prefill=0, decode=1, kv_transport="tcp")
    out = tmp_path / "bench.json"
    with Deployment(config, log_dir=tmp_path / "logs") as dep:
        argv = [*tandem_argv("bench"), "--url", dep.url,
                "--profile", "kind=synchronous", "--constraint", "kind=max_requests,count=2",
                "--data", "kind=synthetic_text,prompt_tokens=16,output_tokens=4",
                "--output", f"kind=json,path={out}", "--disable-console-interactive"]  # fmt: skip
        env = {**os.environ, "GUIDELLM__MAX_WORKER_PROCESSES": "1"}
        proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (bench,) = json.loads(out.read_text())["benchmarks"]
    done = bench["requests"]["successful"]
    assert len(done) == 2 and all(r["output_tokens"] == 4 for r in done)
    assert bench["config"]["backend"]["model"] == "demo"
