"""A stand-in for vLLM and llama-server replicas that speaks both dialects.

docs/engines.md records what each engine does.

Used by the gateway's demo, tests and benchmarks instead of GPU replicas.
"""

from gateway.simulator.app import SimServer, create_app, serve_sim
from gateway.simulator.engine import SimConfig

__all__ = ["SimConfig", "SimServer", "create_app", "serve_sim"]
