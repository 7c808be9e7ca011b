"""Another revision of the gateway as a contender (`--against REV`): that commit's `gateway` package
pip-installed into a scratch virtual environment, kept by commit so that a second run starts at once.

The scratch environment holds the revision's package alone and reaches every dependency through
the site-packages of the environment running the benchmark (a `.pth` line), so the current checkout
and the revision run on the very same starlette, uvicorn, pydantic...: the comparison is of the
gateway's code, and building one takes seconds and no download of a dependency. A revision whose
requirements that environment does not meet (a package it lacks, a version outside a bound) gets
an environment of its own instead, with its dependencies installed by pip, and the run says so.

`--compiled REV` builds the revision with its request path compiled by mypyc, as the Docker image
ships it (`GATEWAY_COMPILE=1`, setup.py; a contender `gateway@<commit>+mypyc`): always on this
environment's dependencies, whose mypy compiles it (several minutes, once per commit).

The source comes from `git archive` into a temporary folder outside the repository (the
repository's own state is never touched, so nothing is left to prune if the run is killed); the
folder is deleted once pip has installed from it. Only the commit's files are used: uncommitted
changes belong to the current checkout's contender, never to a revision's.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import site
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
import venv
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.proxycost.constants import ROOT
from bench.proxycost.host import BenchError

MARKER = "bench-revision.json"  # written last: an environment without it is a build that did not finish
PY = f"python{sys.version_info.major}.{sys.version_info.minor}"

# Run by a scratch environment's interpreter: which of the given requirements (PEP 508, argv[1] as
# JSON; None: the revision's own, as installed) its packages do not meet, where `gateway` is
# imported from, and the process settings its `Settings` reads (GATEWAY_* names). `packaging` from
# the environment, or pip's copy of it.
_INSPECT = """
import json, sys
from importlib import metadata
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
wanted = json.loads(sys.argv[1])
if wanted is None:
    import gateway
    wanted = []
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name == "fleet-gateway" and str(dist.locate_file("")).startswith(sys.prefix):
            wanted = dist.requires or []
            break
unmet = []
for text in wanted:
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        have = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        unmet.append(text + " (missing)")
        continue
    if not req.specifier.contains(have, prereleases=True):
        unmet.append(f"{text} (have {have})")
found = {"unmet": unmet}
if "gateway" in sys.modules:
    found["gateway"] = sys.modules["gateway"].__file__
    try:
        from gateway.settings import Settings
        prefix = Settings.model_config.get("env_prefix", "")
        found["settings"] = sorted((prefix + name).upper() for name in Settings.model_fields)
    except Exception:
        found["settings"] = None
print(json.dumps(found))
"""


@dataclass(frozen=True)
class Revision:
    """A built revision: where its environment is, and what its `fleet-gateway serve` accepts."""

    rev: str  # as given on the command line
    commit: str  # the full hash it resolved to
    env: Path
    layered: bool  # True: on the benchmark's own dependencies; False: an environment of its own
    serve_flags: frozenset[str]  # e.g. {"--port", "--routes"}
    settings: frozenset[str] | None  # the GATEWAY_* variables it reads; None: not known, pass all
    compiled: bool = False  # its request path compiled with mypyc

    @property
    def name(self) -> str:
        """The contender's name in the tables and the JSON lines."""
        return f"gateway@{self.commit[:7]}" + ("+mypyc" if self.compiled else "")

    @property
    def executable(self) -> Path:
        return self.env / "bin" / "fleet-gateway"

    def tag(self) -> dict[str, Any]:
        """What each of its JSON lines records about it."""
        tag = {"rev": self.rev, "commit": self.commit, "deps": "shared" if self.layered else "own"}
        return {**tag, "compiled": True} if self.compiled else tag


def default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fleet-gateway" / "bench-revisions"


def resolve(rev: str) -> str:
    if rev.startswith("-"):
        raise BenchError(f"--against {rev!r}: not a revision")
    out = subprocess.run(
        ["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    commit = out.stdout.strip()
    if out.returncode != 0 or not re.fullmatch(r"[0-9a-f]{40}", commit):
        raise BenchError(f"--against {rev}: no such commit in this repository")
    return commit


def build_all(revs: list[str], cache: Path, *, compiled: bool = False) -> list[Revision]:
    """Each distinct commit once, in the order given."""
    built: list[Revision] = []
    for rev in revs:
        commit = resolve(rev)
        if any(r.commit == commit for r in built):
            continue
        built.append(prepare(rev, commit, cache, compiled=compiled))
    return built


def prepare(rev: str, commit: str, cache: Path, *, compiled: bool = False) -> Revision:
    """The revision's environment, from the cache or built now; checked on every use, since the
    environment it borrows dependencies from may have changed since it was built."""
    cache.mkdir(parents=True, exist_ok=True)
    layered_env = cache / (f"{commit}-{_layer_key()}" + ("-mypyc" if compiled else ""))
    with _locked(layered_env):
        marker = _ensure(commit, layered_env, layered=True, compiled=compiled)
        info = _inspect(layered_env)
    if not info["unmet"]:
        return _revision(rev, commit, layered_env, True, info, marker)
    if compiled:
        unmet = "; ".join(info["unmet"])
        raise BenchError(f"--compiled {rev}: this environment does not meet its requirements: {unmet}")
    print(
        f"{rev}: this environment does not meet its requirements ({'; '.join(info['unmet'])}):"
        " building it an environment of its own (pip installs its dependencies)",
        file=sys.stderr,
        flush=True,
    )
    own_env = cache / f"{commit}-own-{PY}"
    with _locked(own_env):
        marker = _ensure(commit, own_env, layered=False)
        info = _inspect(own_env)
    if info["unmet"]:
        unmet = "; ".join(info["unmet"])
        raise BenchError(f"{rev}: its own environment does not meet its requirements: {unmet}")
    return _revision(rev, commit, own_env, False, info, marker)


def _revision(
    rev: str, commit: str, env: Path, layered: bool, info: dict[str, Any], marker: dict[str, Any]
) -> Revision:
    if not str(Path(info["gateway"]).resolve()).startswith(str(env.resolve())):
        # A `gateway` found outside the scratch environment would be another checkout's code.
        raise BenchError(f"{rev}: its environment imports gateway from {info['gateway']}")
    settings = frozenset(info["settings"]) if info["settings"] is not None else None
    compiled = bool(marker.get("compiled"))
    return Revision(rev, commit, env, layered, frozenset(marker["serve_flags"]), settings, compiled)


def _layer_key() -> str:
    """A layered environment is only valid with the interpreter and site-packages it was made
    against: they name its cache entry."""
    digest = hashlib.sha256(json.dumps([sys.version, _site_dirs()]).encode()).hexdigest()[:10]
    return f"shared-{PY}-{digest}"


def _site_dirs() -> list[str]:
    dirs = list(site.getsitepackages())
    user = site.getusersitepackages()
    if site.ENABLE_USER_SITE and os.path.isdir(user):
        dirs.append(user)
    return dirs


@contextlib.contextmanager
def _locked(env: Path) -> Iterator[None]:
    """One build of an environment at a time, across processes (two runs started together)."""
    with Path(f"{env}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _ensure(commit: str, env: Path, layered: bool, compiled: bool = False) -> dict[str, Any]:
    """The environment built, and its marker: what was built, and the options its `serve` takes."""
    with contextlib.suppress(OSError, ValueError):
        built: dict[str, Any] = json.loads((env / MARKER).read_text())
        if built.get("commit") == commit and isinstance(built.get("serve_flags"), list):
            return built
    shutil.rmtree(env, ignore_errors=True)  # a build that did not finish
    began = time.monotonic()
    kind = "on this environment's dependencies" if layered else "with its own dependencies"
    kind += ", compiled (minutes)" if compiled else ""
    print(f"building {commit[:7]} {kind} in {env}", file=sys.stderr, flush=True)
    source = Path(tempfile.mkdtemp(prefix=f"bench-rev-{commit[:7]}-"))
    try:
        _export(commit, source)
        _make_env(env, layered)
        _pip_install(env, source, layered, compiled)
        flags = sorted(_serve_flags(env))
        if compiled and not _compiled_modules(env):
            raise BenchError(f"{commit[:7]} built no compiled module: its setup.py has no GATEWAY_COMPILE")
    except BaseException:
        shutil.rmtree(env, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(source, ignore_errors=True)
    marker = {
        "commit": commit,
        "layered": layered,
        "serve_flags": flags,
        "compiled": len(_compiled_modules(env)) if compiled else 0,
        "built_s": round(time.monotonic() - began, 1),
    }
    (env / MARKER).write_text(json.dumps(marker) + "\n")
    return marker


def _export(commit: str, dest: Path) -> None:
    archive = subprocess.Popen(
        ["git", "archive", "--format=tar", commit], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert archive.stdout is not None
    try:
        with tarfile.open(fileobj=archive.stdout, mode="r|") as tar:
            tar.extractall(dest, filter="data")
    finally:
        archive.stdout.close()
        _, error = archive.communicate(timeout=120)
    if archive.returncode != 0:
        raise BenchError(f"git archive {commit} failed: {error.decode(errors='replace').strip()}")


def _make_env(env: Path, layered: bool) -> None:
    venv.EnvBuilder(symlinks=True, with_pip=not layered, clear=True).create(env)
    if layered:
        # Appended to sys.path after the environment's own site-packages, so the revision's
        # `gateway` (installed there) comes first. A plain path line: the borrowed folder's own
        # .pth files (the current checkout's editable install among them) are not run.
        pth = env / "lib" / PY / "site-packages" / "_bench_shared_deps.pth"
        pth.write_text("".join(f"{path}\n" for path in _site_dirs()))


def _python(env: Path) -> str:
    return str(env / "bin" / "python")


def _pip_install(env: Path, source: Path, layered: bool, compiled: bool = False) -> None:
    argv = [_python(env), "-m", "pip", "install", "--disable-pip-version-check", "--no-warn-script-location"]
    argv.append("--quiet")
    build_env = {k: v for k, v in os.environ.items() if k != "GATEWAY_COMPILE"}
    if layered:
        # --ignore-installed: never touch the borrowed environment's fleet-gateway (it is outside
        # this prefix anyway; pip would only say so).
        argv += ["--no-deps", "--ignore-installed"]
        build_requires = _build_requires(source)
        if compiled or not _inspect(env, build_requires)["unmet"]:
            # The build backend is here: no download. Compiling needs it so (mypyc is not among the
            # build requirements: it is this environment's, as the Docker image's build stage has it).
            argv += ["--no-build-isolation", "--no-index"]
    if compiled:
        build_env["GATEWAY_COMPILE"] = "1"
    out = subprocess.run(
        [*argv, str(source)],
        capture_output=True,
        text=True,
        timeout=1800,  # a compiled build takes several minutes on two cores
        check=False,
        cwd=source,
        env=build_env,
    )
    if out.returncode != 0:
        raise BenchError(f"pip could not install {source.name}:\n{(out.stderr or out.stdout)[-3000:]}")


def _compiled_modules(env: Path) -> list[Path]:
    return list((env / "lib" / PY / "site-packages" / "gateway").rglob("*.so"))


def _build_requires(source: Path) -> list[str]:
    pyproject = source / "pyproject.toml"
    if not pyproject.exists():
        return ["setuptools"]
    requires: list[str] = tomllib.loads(pyproject.read_text()).get("build-system", {}).get("requires", [])
    return requires


def _run_python(env: Path, script: str, *args: str) -> Any:
    out = subprocess.run(
        [_python(env), "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=env,  # not the repository: its `gateway/` would shadow the revision's
        env=clean_env(),
    )
    if out.returncode != 0:
        raise BenchError(f"the environment in {env} failed to start:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _inspect(env: Path, requirements: list[str] | None = None) -> dict[str, Any]:
    """`unmet`: the requirements (default: the installed revision's own) the environment does not
    meet; with the revision's own, also where `gateway` comes from and its `settings`."""
    info: dict[str, Any] = _run_python(env, _INSPECT, json.dumps(requirements))
    return info


def _serve_flags(env: Path) -> frozenset[str]:
    out = subprocess.run(
        [str(env / "bin" / "fleet-gateway"), "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=env,
        env=clean_env(),
    )
    if out.returncode != 0:
        raise BenchError(f"fleet-gateway serve --help failed in {env}:\n{out.stderr[-3000:]}")
    return frozenset(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", out.stdout))


def clean_env() -> dict[str, str]:
    """The environment for a revision's processes: nothing that would put another checkout's
    code on its import path."""
    drop = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "PYTHONSAFEPATH")
    return {k: v for k, v in os.environ.items() if k not in drop}
