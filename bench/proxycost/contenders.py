"""The contenders (the instant upstream reached directly, this checkout's gateway, the same with a team's
keys and limits, other revisions of the gateway, the minimal proxy, nginx) and the start-up of every
process behind them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from bench.proxycost.bodies import SMALL_BODY, STREAM_BODY
from bench.proxycost.constants import CHAT, CHUNKS, MAX_BODY, ROOT
from bench.proxycost.host import BenchError, Processes, free_port, http_post_status, pin, wait_ready
from bench.proxycost.revisions import Revision, clean_env
from bench.proxycost.routes import TEAM_KEY, TEAM_LIMITS, routes_yaml
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


@dataclass
class Contender:
    name: str
    port: int
    pid: int | None  # the proxy's process, for RSS; None for direct
    hold_path: str | None  # where a held stream goes; None: no memory test
    gateway: bool = False  # a fleet-gateway process (this checkout, with a team, or a revision)
    headers: dict[str, str] = field(default_factory=dict)  # sent with every request (the team's key)
    scripts: dict[str, Path] = field(default_factory=dict)  # wrk's, by body: "small", "stream"

    def url(self, path: str = CHAT) -> str:
        return f"http://127.0.0.1:{self.port}{path}"


@dataclass
class GatewayLaunch:
    """How to start one gateway contender: its command, the variables it reads, its routes."""

    name: str
    command: list[str]  # up to `serve`'s options
    env: dict[str, str]
    cwd: Path
    team: bool = False
    port_flag: bool = True  # `serve --port N`; False: GATEWAY_PORT
    settings: frozenset[str] | None = None  # the GATEWAY_* variables it reads; None: all
    tag: dict[str, Any] | None = None  # recorded with each of its JSON lines


class Lineup:
    """The contenders and every process behind them: all started in `start`, all stopped in `close`."""

    def __init__(
        self,
        use_nginx: bool,
        use_minimal: bool,
        with_team: bool = False,
        revisions: Sequence[Revision] = (),
    ) -> None:
        self.use_nginx = use_nginx
        self.use_minimal = use_minimal
        self.with_team = with_team
        self.revisions = list(revisions)
        self.procs = Processes()
        self.contenders: list[Contender] = []
        self.gateway: Contender | None = None
        self.tags: dict[str, dict[str, Any]] = {}  # contender -> what its JSON lines record about it
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
        self.files: list[IO[bytes]] = []

    def launches(self) -> list[GatewayLaunch]:
        """This checkout's gateway, with a team, then each revision: alternated in that order."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}  # shipped defaults
        python = sys.executable
        exe = Path(python).parent / "fleet-gateway"
        command = [str(exe)] if exe.exists() else [python, "-m", "gateway"]
        current = GatewayLaunch("gateway", command, env, ROOT)
        launches = [current]
        if self.with_team:
            tag = {"team": {"keys": 1, "limits": TEAM_LIMITS, "state": "process"}}
            launches.append(GatewayLaunch("gateway+team", command, env, ROOT, team=True, tag=tag))
        for revision in self.revisions:
            launches.append(
                GatewayLaunch(
                    revision.name,
                    [str(revision.executable)],
                    {k: v for k, v in clean_env().items() if not k.startswith("GATEWAY_")},
                    self.tmp,  # not the repository: a `-m` or a relative import finds no checkout here
                    port_flag="--port" in revision.serve_flags,
                    settings=revision.settings,
                    tag={"revision": revision.tag()},
                )
            )
        return launches

    def start(self) -> None:
        upstream, hold = free_port(), free_port()
        python = sys.executable
        instant = [python, "-m", "bench.instant_upstream"]
        up = self.procs.start("upstream", [*pin(1), *instant, str(upstream), str(CHUNKS)])
        held = self.procs.start("hold upstream", [*pin(1), *instant, str(hold), "--hold"])
        gateways = [(launch, *self._start_gateway(launch, upstream, hold)) for launch in self.launches()]
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
        for launch, port, process in gateways:
            try:
                wait_ready(port, "/ready", process, launch.name, 60)
            except BenchError as exc:
                log = (self.tmp / f"{launch.name}.err").read_text()[-3000:]
                raise BenchError(f"{exc}\n{log}") from None
            headers = {"authorization": f"Bearer {TEAM_KEY}"} if launch.team else {}
            if launch.team and (status := http_post_status(port, CHAT, SMALL_BODY)) != 401:
                # The team is on only if a request without its key is refused.
                raise BenchError(f"{launch.name} answered {status} to a request without the key, not 401")
            contender = Contender(launch.name, port, process.pid, CHAT, gateway=True, headers=headers)
            self.contenders.append(contender)
            if launch.tag:
                self.tags[launch.name] = launch.tag
        self.gateway = self.contenders[1]
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
        for contender in self.contenders:
            for name, body in (("small", SMALL_BODY), ("stream", STREAM_BODY)):
                script = f"{name}-{contender.port}"
                contender.scripts[name] = wrk_script(self.tmp, script, body, contender.headers)

    def _start_gateway(
        self, launch: GatewayLaunch, upstream: int, hold: int
    ) -> tuple[int, subprocess.Popen[bytes]]:
        port = free_port()
        routes = self.tmp / f"routes-{port}.yaml"
        routes.write_text(routes_yaml(upstream, hold, team=launch.team))
        wanted = {
            "GATEWAY_ROUTES": str(routes),
            "GATEWAY_HOST": "127.0.0.1",
            "GATEWAY_LOG_REQUESTS": "true",
            "GATEWAY_DRAIN_SECONDS": "1",  # shutdown only; nothing on the request path
        }
        if not launch.port_flag:
            wanted["GATEWAY_PORT"] = str(port)
        # An older revision is given only the settings it reads (it would ignore the others; this
        # keeps what each one ran with explicit).
        env = launch.env | {
            k: v for k, v in wanted.items() if launch.settings is None or k in launch.settings
        }
        argv = [*pin(0), *launch.command, "serve", *(["--port", str(port)] if launch.port_flag else [])]
        process = self.procs.start(
            launch.name,
            argv,
            env=env,
            cwd=launch.cwd,
            # The access log stays on, as shipped: every line is built and written, to /dev/null
            # (a full run would leave a gigabyte of log in a file).
            stdout=subprocess.DEVNULL,
            stderr=self._file(f"{launch.name}.err"),
        )
        return port, process

    def _file(self, name: str) -> IO[bytes]:
        handle = (self.tmp / name).open("wb")
        self.files.append(handle)
        return handle

    def close(self) -> None:
        self.procs.close()
        for handle in self.files:
            handle.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
