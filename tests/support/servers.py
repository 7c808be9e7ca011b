"""Servers on 127.0.0.1 for the tests: the helpers live in bench/support/servers.py, shared with the
benchmarks (which must not import the tests)."""

from bench.support.servers import ThreadServer, free_port, serve, sim_replica

__all__ = ["ThreadServer", "free_port", "serve", "sim_replica"]
