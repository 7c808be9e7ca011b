"""What the gateway costs, measured by `python -m bench.gateway` (its entry point): the host it runs on
(pinned cores, processes, /proc), the request bodies, wrk and the Python load clients that drive the
contenders (the upstream reached directly, the gateway, nginx, the minimal proxy), the measurement
phases, and the report (targets, JSON lines, the table)."""
