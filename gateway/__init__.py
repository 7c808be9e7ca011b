"""Fleet Gateway: one OpenAI-compatible endpoint in front of a small fleet of vLLM and llama.cpp replicas."""

__version__ = "0.1.0"
