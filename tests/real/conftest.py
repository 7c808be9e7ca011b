"""Fixtures that start real engines (see backends.py); every test here is marked ``real``.

Missing engines are a failure, not a skip: a green run must mean the real backends were tested.
Set ``FLEET_REAL_BACKENDS=skip`` to skip instead (e.g. on a laptop without the 3 GB install).

Fixtures are session-scoped because vLLM takes ~20-30 s to start. A test that kills or restarts
a shared replica must leave it running again (``server.restart()``); a test that needs a replica
of its own starts one with ``LlamaServer(tiny_gguf)`` (well under a second).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import NoReturn, TypeVar

import pytest

from .backends import (
    BackendsMissing,
    LlamaServer,
    VllmServer,
    ensure_gguf,
    ensure_hf_model,
)

HERE = Path(__file__).resolve().parent
SERVED_NAME = "tiny"

T = TypeVar("T")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Hooks in a conftest see every collected item, not only those below it.
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.real)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    # Tests that start a server of their own get the same fail-or-skip policy as the fixtures.
    try:
        return (yield)
    except BackendsMissing as exc:
        missing = exc
    _missing(missing)


def _missing(exc: BackendsMissing) -> NoReturn:
    if os.environ.get("FLEET_REAL_BACKENDS") == "skip":
        pytest.skip(f"FLEET_REAL_BACKENDS=skip: {exc}")
    pytest.fail(f"{exc}\nSet FLEET_REAL_BACKENDS=skip to skip the real-backend tests instead.", pytrace=False)


def _require(factory: Callable[[], T]) -> T:
    try:
        return factory()
    except BackendsMissing as exc:
        # Reported outside the handler, so the message is not buried under a chained traceback.
        missing = exc
    _missing(missing)


@pytest.fixture(scope="session")
def tiny_gguf() -> Path:
    """The tiny random-weight GGUF model (built on first use)."""
    return _require(ensure_gguf)


@pytest.fixture(scope="session")
def tiny_hf() -> Path:
    """The tiny random-weight Hugging Face checkpoint directory for vLLM (built on first use)."""
    return _require(ensure_hf_model)


@pytest.fixture(scope="session")
def llama_pair(tiny_gguf: Path) -> Iterator[tuple[LlamaServer, LlamaServer]]:
    """Two llama-server replicas of the tiny model, 2 slots of 8192 tokens each."""
    with ExitStack() as stack:
        first, second = (
            stack.enter_context(_require(partial(LlamaServer, tiny_gguf, name=name))) for name in ("a", "b")
        )
        yield first, second


@pytest.fixture(scope="session")
def vllm_replica(tiny_hf: Path) -> Iterator[VllmServer]:
    """One vLLM replica of the tiny model, served as ``tiny``, max_model_len 1024, on core 0."""
    with _require(partial(VllmServer, tiny_hf, SERVED_NAME, cpu=0)) as server:
        yield server
