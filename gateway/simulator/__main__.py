"""``python -m gateway.simulator --engine vllm --port 8001 --model qwen3`` runs one replica on 127.0.0.1."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import signal
from collections.abc import Sequence

from gateway.simulator.app import serve_sim
from gateway.simulator.engine import SimConfig


def build_parser() -> argparse.ArgumentParser:
    """The simulator's command line: engine, port and model, plus one flag per other `SimConfig`
    field (with its type and default), so the flags never drift from the dataclass."""
    parser = argparse.ArgumentParser(prog="python -m gateway.simulator", description=__doc__)
    parser.add_argument("--engine", choices=("vllm", "llamacpp"), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True, help="served model name (llama-server: its alias)")
    parser.add_argument("--log-level", default="warning")
    # Every other SimConfig field becomes a flag, so the CLI never drifts from the dataclass.
    for field in dataclasses.fields(SimConfig):
        if field.name in ("engine", "model"):
            continue
        flag = "--" + field.name.replace("_", "-")
        default = field.default
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif default is None:
            parser.add_argument(flag, default=None)
        else:
            parser.add_argument(flag, type=type(default), default=default)
    return parser


async def _serve(config: SimConfig, port: int, log_level: str) -> None:
    sim = await serve_sim(config, port, log_level=log_level)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait((waiter, sim.task), return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    await sim.stop()


def main(argv: Sequence[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    port, log_level = args.pop("port"), args.pop("log_level")
    try:
        config = SimConfig(**args)
    except ValueError as exc:
        build_parser().error(str(exc))
    asyncio.run(_serve(config, port, log_level))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
