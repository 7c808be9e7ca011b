"""What the gateway costs, measured by `python -m bench.gateway` (its entry point): the host it runs on
(pinned cores, processes, /proc), the request bodies, wrk and the Python load clients that drive the
contenders (the upstream reached directly, this checkout's gateway, the same with a team's keys and
limits, other revisions built in scratch environments, nginx, the minimal proxy), the routes table
every gateway runs with, the measurement phases, and the report (targets, JSON lines, the tables,
the comparison between gateways, the profile's summary)."""
