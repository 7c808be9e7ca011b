"""The stream classifier and kill routes: in bench/support/streams.py, shared with bench.killcut."""

from bench.support.streams import CHAT, kill_routes, stream_once

__all__ = ["CHAT", "kill_routes", "stream_once"]
