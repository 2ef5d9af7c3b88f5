"""The cluster token: where it comes from, what it accepts, how it rotates, that it hides."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tandem.engine.cluster_token import (
    CLUSTER_TOKEN_ENV,
    MAC_BYTES,
    ClusterToken,
    TokenError,
    generate_token,
    parse_tokens,
)

A = "a-token-of-at-least-16-chars"
B = "b-token-of-at-least-16-chars"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_sources_file_then_env_never_argv(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text(f"{A}\n")
    assert ClusterToken.load(str(f), env={CLUSTER_TOKEN_ENV: B}).current == A
    assert ClusterToken.load(None, env={CLUSTER_TOKEN_ENV: B}).current == B
    assert ClusterToken.load(None, env={}) is None
    with pytest.raises(TokenError, match="--cluster-token-file"):
        ClusterToken.require(None, env={CLUSTER_TOKEN_ENV: "  "})
    with pytest.raises(TokenError, match="cannot read"):
        ClusterToken.from_file(tmp_path / "missing")


@pytest.mark.parametrize(
    ("text", "why"),
    [("", "no cluster token"), ("short", "characters"), ("x" * 513, "characters"),
     (f"{A}\n{B}\n{A}\n{B}\n{A}", "at most"), ("tøken-with-non-ascii-chars", "ASCII"),
     ("has spaces inside the token", "ASCII")],
)  # fmt: skip
def test_malformed_tokens_are_refused_without_echoing_them(text: str, why: str) -> None:
    with pytest.raises(TokenError, match=why) as e:
        parse_tokens(text, "the file")
    if len(text) > 5:
        assert text not in str(e.value)


def test_matching_is_exact_and_every_listed_token_is_accepted() -> None:
    tok = ClusterToken([A, B])
    assert tok.current == A  # the first one is presented
    assert tok.matches(A) and tok.matches(B) and tok.matches(B.encode())
    assert not tok.matches(A[:-1]) and not tok.matches(A + "x") and not tok.matches(None)
    assert tok.authorizes(f"Bearer {B}") and tok.authorizes(f"bearer  {A} ")
    assert not tok.authorizes(f"Basic {A}") and not tok.authorizes("") and not tok.authorizes(None)
    assert tok.headers() == {"Authorization": f"Bearer {A}"}


def test_signatures_verify_under_any_accepted_token() -> None:
    old, both, new = ClusterToken([A]), ClusterToken([B, A]), ClusterToken([B])
    mac = old.sign(b"frame")
    assert len(mac) == MAC_BYTES
    assert both.verify(b"frame", mac) and not new.verify(b"frame", mac)
    assert not both.verify(b"frame!", mac) and not both.verify(b"frame", mac[:-1])
    assert new.verify(b"frame", both.sign(b"frame"))


def test_file_rotation_is_picked_up_and_a_broken_rewrite_is_ignored(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text(A)
    clock = Clock()
    tok = ClusterToken.from_file(f, clock=clock)
    f.write_text(f"{B}\n{A}\n")  # phase 1 of a rotation: present B, still accept A
    os.utime(f, ns=(1, 1_000_000_000))
    assert tok.current == A  # looked at no more than once a second
    clock.now += 1.5
    assert tok.current == B and tok.matches(A)
    f.write_text("")  # mid-update: keep what worked
    os.utime(f, ns=(2, 2_000_000_000))
    clock.now += 1.5
    assert tok.current == B and tok.matches(A)
    f.write_text(B)
    os.utime(f, ns=(3, 3_000_000_000))
    clock.now += 1.5
    assert tok.current == B and not tok.matches(A)


def test_repr_never_shows_the_token(tmp_path: Path) -> None:
    tok = ClusterToken([A, B])
    assert A not in repr(tok) and B not in str(tok) and "2 token(s)" in repr(tok)
    assert len(generate_token()) >= 40 and generate_token() != generate_token()
