"""Router test fixtures: a byte-level tokenizer and a loopback cluster of worker doubles."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from router_testlib import Cluster, router_config
from transformers import AutoTokenizer
from worker_double import build_tokenizer, serve

from tandem.router.app import create_app
from tandem.router.internal_app import create_internal_app


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture
async def make_cluster(tokenizer_dir: Path, tokenizer: Any) -> AsyncIterator[Callable[..., Any]]:
    clusters: list[Cluster] = []

    async def make(roles: tuple[str, ...] = ("prefill", "decode"), **config: Any) -> Cluster:
        app = create_app(router_config(tokenizer_dir, **config))
        public = await serve(app)
        cluster = Cluster(public, await serve(create_internal_app(app), lifespan="off"), app,
                          tokenizer)  # fmt: skip
        clusters.append(cluster)
        for role in roles:
            await cluster.add(role)
        return cluster

    yield make
    for c in clusters:
        await c.stop()


@pytest.fixture
async def oai() -> AsyncIterator[Callable[..., openai.AsyncOpenAI]]:
    """Factory of official OpenAI clients (no retries), closed at teardown."""
    made: list[openai.AsyncOpenAI] = []

    def make(url: str, key: str = "unused") -> openai.AsyncOpenAI:
        c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=10)
        made.append(c)
        return c

    yield make
    for c in made:
        await c.close()
