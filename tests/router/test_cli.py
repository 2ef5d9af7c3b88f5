"""``tandem router`` argument handling: API keys from flag, file (a mounted Secret) or env."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.router.cli import api_keys_from, build_parser, main


def keys(argv: list[str]) -> tuple[str, ...]:
    return api_keys_from(build_parser().parse_args(argv))


def test_api_key_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    assert keys([]) == ()
    assert keys(["--api-key", "k1"]) == ("k1",)
    f = tmp_path / "keys"
    f.write_text("k1\n\n  k2  \n")
    assert keys(["--api-key-file", str(f)]) == ("k1", "k2")
    monkeypatch.setenv("TANDEM_API_KEY", "from-env")
    assert keys([]) == ("from-env",)
    assert keys(["--api-key", "flag"]) == ("flag",)


def test_bad_arguments_exit_2(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    assert main(["--api-key-file", str(empty)]) == 2
    assert main(["--api-key-file", str(tmp_path / "missing")]) == 2
    assert main(["--local-prefill-threshold", "-1"]) == 2
    with pytest.raises(SystemExit):
        main(["--policy", "random"])


def test_missing_model_directory_exits_2(tmp_path: Path) -> None:
    assert main(["--model", str(tmp_path / "nope")]) == 2
