"""The contenders (the instant upstream reached directly, the gateway, the minimal proxy, nginx) and
the start-up of every process behind them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from bench.proxycost.bodies import SMALL_BODY, STREAM_BODY
from bench.proxycost.constants import CHAT, CHUNKS, MAX_BODY, ROOT
from bench.proxycost.host import BenchError, Processes, free_port, pin, wait_ready
from bench.proxycost.wrk import wrk_script


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )


def nginx_config(tmp: Path, port: int, upstream: int, hold: int, binary: str) -> Path:
    built = subprocess.run([binary, "-V"], capture_output=True, text=True, timeout=10).stderr
    temp_paths = ["client_body_temp_path", "proxy_temp_path"] + [
        f"{module}_temp_path"
        for module in ("fastcgi", "uwsgi", "scgi")
        if f"without-http_{module}" not in built
    ]
    temps = "\n".join(f"    {directive} {tmp / directive};" for directive in temp_paths)
    conf = tmp / "nginx.conf"
    conf.write_text(
        f"""daemon off;
master_process off;
worker_processes 1;
pid {tmp / "nginx.pid"};
error_log {tmp / "nginx-error.log"} warn;
worker_rlimit_nofile 16384;
events {{ worker_connections 8192; }}
http {{
    access_log /dev/null;  # on, like the gateway's: every line is written, to nowhere
{temps}
    client_max_body_size {MAX_BODY};
    client_body_buffer_size {MAX_BODY};
    proxy_http_version 1.1;
    proxy_set_header Connection "";
    proxy_buffering off;
    proxy_read_timeout 300s;
    keepalive_requests 10000000;
    upstream instant {{ server 127.0.0.1:{upstream}; keepalive 64; keepalive_requests 10000000; }}
    upstream held {{ server 127.0.0.1:{hold}; keepalive 64; }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{ proxy_pass http://instant; }}
        location /hold/ {{ proxy_pass http://held/; }}
    }}
}}
"""
    )
    return conf


def routes_yaml(upstream: int, hold: int) -> str:
    # One preset in front of the instant upstream, shipped defaults but for volatile-content
    # detection (`warn`, as the issue asks) and the admission limit: 1,000 open streams need more
    # than the default 64 in flight per replica. `vision: true` lets the image bodies through.
    # `hold` is the same preset in front of the holding upstream, for the open-streams memory test.
    return f"""defaults:
  prefix: {{volatile: warn}}
  limits: {{max_in_flight: 1100}}
presets:
  bench:
    served_model: m
    vision: true
    replicas: [{{name: instant, url: "http://127.0.0.1:{upstream}", engine: vllm}}]
  hold:
    served_model: m
    replicas: [{{name: held, url: "http://127.0.0.1:{hold}", engine: vllm}}]
routing: {{default: bench}}
"""


@dataclass
class Contender:
    name: str
    port: int
    pid: int | None  # the proxy's process, for RSS; None for direct
    hold_path: str | None  # where a held stream goes; None: no memory test

    def url(self, path: str = CHAT) -> str:
        return f"http://127.0.0.1:{self.port}{path}"


class Lineup:
    """The contenders and every process behind them: all started in `start`, all stopped in `close`."""

    def __init__(self, use_nginx: bool, use_minimal: bool) -> None:
        self.use_nginx = use_nginx
        self.use_minimal = use_minimal
        self.procs = Processes()
        self.contenders: list[Contender] = []
        self.gateway: Contender | None = None
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
        self.scripts: dict[str, Path] = {}
        self.files: list[IO[bytes]] = []

    def start(self) -> None:
        upstream, hold, gateway_port = free_port(), free_port(), free_port()
        python = sys.executable
        instant = [python, "-m", "bench.instant_upstream"]
        up = self.procs.start("upstream", [*pin(1), *instant, str(upstream), str(CHUNKS)])
        held = self.procs.start("hold upstream", [*pin(1), *instant, str(hold), "--hold"])
        routes = self.tmp / "routes.yaml"
        routes.write_text(routes_yaml(upstream, hold))
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}  # shipped defaults
        env |= {
            "GATEWAY_ROUTES": str(routes),
            "GATEWAY_HOST": "127.0.0.1",
            "GATEWAY_LOG_REQUESTS": "true",
            "GATEWAY_DRAIN_SECONDS": "1",  # shutdown only; nothing on the request path
        }
        exe = Path(python).parent / "fleet-gateway"
        command = [str(exe)] if exe.exists() else [python, "-m", "gateway"]
        gateway = self.procs.start(
            "gateway",
            [*pin(0), *command, "serve", "--port", str(gateway_port)],
            env=env,
            cwd=ROOT,
            # The access log stays on, as shipped: every line is built and written, to /dev/null
            # (a full run would leave a gigabyte of log in a file).
            stdout=subprocess.DEVNULL,
            stderr=self._file("gateway.err"),
        )
        minimal = None
        if self.use_minimal:
            minimal_port = free_port()
            minimal_argv = [python, "-m", "bench.minimal_proxy", str(minimal_port), str(upstream), str(hold)]
            minimal = self.procs.start(
                "minimal",
                [*pin(0), *minimal_argv],
                stdout=subprocess.DEVNULL,
                stderr=self._file("minimal.err"),
            )
        nginx = None
        binary = nginx_binary() if self.use_nginx else None
        if binary:
            nginx_port = free_port()
            conf = nginx_config(self.tmp, nginx_port, upstream, hold, binary)
            nginx = self.procs.start(
                "nginx",
                [
                    *pin(0),
                    binary,
                    "-p",
                    str(self.tmp),
                    "-e",
                    str(self.tmp / "nginx-error.log"),
                    "-c",
                    str(conf),
                ],
                stderr=self._file("nginx.err"),
            )
        elif self.use_nginx:
            print("nginx not found: running without the nginx reference", file=sys.stderr)
        wait_ready(upstream, "/health", up, "the instant upstream", 15)
        wait_ready(hold, "/health", held, "the holding upstream", 15)
        self.contenders.append(Contender("direct", upstream, None, None))
        try:
            wait_ready(gateway_port, "/ready", gateway, "the gateway", 60)
        except BenchError as exc:
            raise BenchError(f"{exc}\n{(self.tmp / 'gateway.err').read_text()[-3000:]}") from None
        self.gateway = Contender("gateway", gateway_port, gateway.pid, CHAT)
        self.contenders.append(self.gateway)
        if minimal is not None:
            try:
                wait_ready(minimal_port, "/health", minimal, "the minimal proxy", 30)
            except BenchError as exc:
                raise BenchError(f"{exc}\n{(self.tmp / 'minimal.err').read_text()[-3000:]}") from None
            self.contenders.append(Contender("minimal", minimal_port, minimal.pid, "/hold" + CHAT))
        if nginx is not None:
            try:
                wait_ready(nginx_port, "/health", nginx, "nginx", 15)
            except BenchError as exc:
                raise BenchError(f"{exc}\n{(self.tmp / 'nginx-error.log').read_text()[-3000:]}") from None
            self.contenders.append(Contender("nginx", nginx_port, nginx.pid, "/hold" + CHAT))
        self.scripts = {
            "small": wrk_script(self.tmp, "small", SMALL_BODY),
            "stream": wrk_script(self.tmp, "stream", STREAM_BODY),
        }

    def _file(self, name: str) -> IO[bytes]:
        handle = (self.tmp / name).open("wb")
        self.files.append(handle)
        return handle

    def close(self) -> None:
        self.procs.close()
        for handle in self.files:
            handle.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
