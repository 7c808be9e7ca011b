"""The real engines the tests start: the launchers live in bench/support/engines.py, shared with the
benchmarks (which must not import the tests)."""

from bench.support.engines import (
    BACKENDS,
    LOG_DIR,
    REPO,
    BackendsMissing,
    LlamaServer,
    VllmServer,
    ensure_gguf,
    ensure_hf_model,
    llama_server_binary,
    vllm_python,
)

__all__ = [
    "BACKENDS",
    "LOG_DIR",
    "REPO",
    "BackendsMissing",
    "LlamaServer",
    "VllmServer",
    "ensure_gguf",
    "ensure_hf_model",
    "llama_server_binary",
    "vllm_python",
]
