"""`fleet-gateway`: serve, check a routing table, run the demo fleet, benchmark the presets."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from gateway import __version__
from gateway.routing.table import Table, TableError, load_table
from gateway.settings import Settings


def main(argv: Sequence[str] | None = None) -> int:
    """The `fleet-gateway` entry point: parses `argv` (the process's arguments when None), runs the
    chosen command and returns its exit status; `bench`, `mcp` and `ps` run before the logging
    set-up."""
    parser = argparse.ArgumentParser(prog="fleet-gateway", description=__doc__)
    parser.add_argument("--version", action="version", version=f"fleet-gateway {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the gateway")
    serve.add_argument(
        "--routes", type=Path, help="routing table (default: $GATEWAY_ROUTES or ./routes.yaml)"
    )
    serve.add_argument("--host", help="listen address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="listen port (default 18000)")
    serve.add_argument(
        "--wait",
        type=float,
        nargs="?",
        const=300.0,
        metavar="SECONDS",
        help="hold start-up until every preset has a ready replica (default 300 s), then serve anyway",
    )

    check = commands.add_parser("check", help="validate a routing table and print what it resolves to")
    check.add_argument("path", nargs="?", type=Path, help="routing table (default: as for serve)")
    check.add_argument("--probe", action="store_true", help="also ask every replica: healthy? serving what?")

    demo = commands.add_parser("demo", help="run the gateway in front of simulated replicas (no GPU needed)")
    demo.add_argument("--port", type=int, default=18000, help="gateway port (default 18000)")
    demo.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")

    connect = commands.add_parser("connect", help="print the configuration that points an agent here")
    connect.add_argument("agent", choices=("claude", "codex", "opencode", "aider", "continue"))
    connect.add_argument("--url", default="http://127.0.0.1:18000", help="the gateway (default local)")
    connect.add_argument("--key", help="a gateway key, to read its model catalogue")
    connect.add_argument("--routes", type=Path, help="routing table (default: as for serve)")

    bridge = commands.add_parser("mcp", help="serve the gateway's /mcp tools over stdio (an MCP bridge)")
    bridge.add_argument(
        "--url", help="the gateway (default: http://$GATEWAY_HOST:$GATEWAY_PORT, else the local one)"
    )
    bridge.add_argument("--key", help="a gateway key (default: $GATEWAY_KEY)")

    ps = commands.add_parser("ps", help="list the replicas the gateway launches: state, devices, loads")
    ps.add_argument("--url", help="the gateway (default: http://$GATEWAY_HOST:$GATEWAY_PORT)")
    ps.add_argument("--key", help="a gateway key (default: $GATEWAY_KEY)")

    bench = commands.add_parser(
        "bench", help="measure each preset: decode rate, TTFT cold and cached, parallel, tools, images"
    )
    bench.add_argument(
        "--url",
        default="http://127.0.0.1:18000",
        help="the gateway or any OpenAI endpoint (default: local gateway)",
    )
    bench.add_argument("--api-key", help="sent as a bearer token")
    bench.add_argument(
        "--routes", type=Path, help="routing table: presets, settings, replicas to ask /v1/models"
    )
    bench.add_argument(
        "--preset", action="extend", nargs="+", metavar="NAME", help="only these (default: all)"
    )
    bench.add_argument(
        "--out", type=Path, default=Path("bench-results.jsonl"), help="JSON lines appended here"
    )
    bench.add_argument("--parallel", type=_positive, help="concurrent streams (default 4; --quick 2)")
    bench.add_argument(
        "--decode-tokens", type=_positive, help="tokens per timed request (default 256; --quick 32)"
    )
    bench.add_argument("--prompt-tokens", type=_positive, help="long prompt (default 16000; --quick 1000)")
    bench.add_argument("--quick", action="store_true", help="tiny numbers, for CI")
    bench.add_argument(
        "--compare", nargs=2, type=Path, metavar=("A", "B"), help="print two result files side by side"
    )

    args = parser.parse_args(argv)
    if args.command == "bench":
        # Before the logging set-up: the HTTP client logs every request at INFO, over the progress line.
        from gateway.tools.benchmark import bench_command

        return bench_command(args)
    if args.command == "mcp":
        # stdout is the protocol: no log line may reach it.
        from gateway.mcp.bridge import bridge_command

        return bridge_command(args.url or _local_url(), args.key or os.environ.get("GATEWAY_KEY"))
    if args.command == "ps":
        from gateway.tools.ps import ps_command

        return ps_command(args.url or _local_url(), args.key or os.environ.get("GATEWAY_KEY"))
    settings = Settings()
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.command == "serve":
        pairs = (("routes", args.routes), ("host", args.host), ("port", args.port), ("wait_ready", args.wait))
        overrides = {k: v for k, v in pairs if v}
        return serve_command(settings.model_copy(update=overrides))
    if args.command == "connect":
        return connect_command(args.agent, args.url, args.key, args.routes or settings.routes)
    if args.command == "check":
        return check_command(args.path or settings.routes, probe=args.probe)
    from gateway.tools.demo import run_demo

    return run_demo(settings.model_copy(update={"host": args.host, "port": args.port}))


def _local_url() -> str:
    host = os.environ.get("GATEWAY_HOST", "127.0.0.1")
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://{host}:{os.environ.get('GATEWAY_PORT', '18000')}"


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, not {text}")
    return value


def serve_command(settings: Settings) -> int:
    from gateway.app import build_gateway, create_app
    from gateway.server import run, run_loop

    try:
        gateway = build_gateway(settings)
    except TableError as exc:
        print(f"fleet-gateway: {exc}", file=sys.stderr)
        return 2
    run_loop(run(gateway, create_app(gateway)))
    return 0


def connect_command(agent: str, url: str, key: str | None, routes: Path) -> int:
    """Prints the configuration that points `agent` at the gateway at `url`, its presets from the
    routing table and, where the running gateway's `/v1/models` answers (with `key`), from that
    catalogue instead; returns 0 whether or not either could be read."""
    import orjson

    from gateway.tools import connect

    try:
        table: Table | None = load_table(routes)
    except TableError:
        table = None
    presets = connect.from_table(table) if table is not None else []
    # A running gateway knows the replicas' context lengths; its catalogue wins where it answers.
    try:
        import urllib.request

        request = urllib.request.Request(url.rstrip("/") + "/v1/models")  # noqa: S310 - the user's own URL
        if key:
            request.add_header("authorization", f"Bearer {key}")
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(request, timeout=3) as answer:
            cards = orjson.loads(answer.read()).get("data", [])
        presets = connect.from_catalogue(cards) or presets
    except (OSError, ValueError):
        pass
    print(connect.render(agent, url, presets, table))
    return 0


def check_command(path: Path, probe: bool = False) -> int:
    """Validates the routing table at `path` and prints what it resolves to; with `probe`, also asks
    each replica whether it is healthy and what it serves. Returns 2 for an invalid table, 1 when a
    replica has a problem, 0 otherwise."""
    try:
        table = load_table(path)
    except TableError as exc:
        print(f"fleet-gateway: {exc}", file=sys.stderr)
        return 2
    print(describe(table))
    if not probe:
        return 0
    from gateway.tools import preflight

    findings = asyncio.run(preflight.probe_table(table, timeout=table.health.timeout + 3))
    print()
    print(preflight.render(findings))
    problems = [f for f in findings if f.problem is not None]
    if problems:
        print(f"\n{len(problems)} of {len(findings)} replicas have a problem", file=sys.stderr)
        return 1
    return 0


def describe(table: Table) -> str:
    """A routing table as `check` prints it: each preset with its names, settings and replicas (or
    discovery), the tasks, default and images presets, and warnings for overlapping alias
    patterns."""
    lines = [f"{table.source}: OK, {len(table.presets)} presets"]
    for preset in table.presets.values():
        names = ", ".join((preset.name, *preset.aliases))
        lines.append(f"  {preset.name}  ->  {preset.served_model}   (names: {names})")
        lines.append(
            f"      policy {preset.policy}, thinking {'on' if preset.thinking else 'off'}, "
            f"max_tokens {preset.max_tokens} (floor {preset.min_max_tokens}), vision {preset.vision}, "
            f"deadline {preset.timeouts.read:g}s, prefix volatile={preset.prefix.volatile}"
        )
        if preset.params:
            lines.append(f"      params {dict(preset.params)}")
        for replica in preset.replicas:
            lines.append(f"      - {replica.name}  {replica.engine}  {replica.url}")
        if preset.discover is not None:
            found = preset.discover
            lines.append(
                f"      - discovered from {found.dns}:{found.port} ({found.engine}) every {found.every:g}s"
            )
    lines.append("  tasks: " + (", ".join(f"{t} -> {p}" for t, p in table.tasks.items()) or "none"))
    lines.append(f"  default -> {table.default}; images -> {table.images or 'rejected (no vision preset)'}")
    lines.extend(f"  warning: alias pattern {overlap}" for overlap in table.pattern_overlaps())
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
