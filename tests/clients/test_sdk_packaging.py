"""`pip install ./protocol ./clients/python`: the SDK and the protocol distribution
it depends on, nothing heavy, and no generic top-level name (no `protocol`)."""

from __future__ import annotations

import subprocess
import sys
import venv
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

from tests.clients.conftest import ROOT, SDK_DIR

pytestmark = pytest.mark.slow  # builds two wheels and a venv (~10-20 s)

PROTOCOL_DIR = ROOT / "protocol"


def build_wheel(project: Path, out: Path) -> tuple[set[str], list[str]]:
    """`pip wheel` offline (no index, no build isolation): the wheel's files and requirements."""
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    build = ["wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(out)]
    proc = subprocess.run([*pip, *build, str(project)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        meta = Parser().parsestr(
            zf.read(next(n for n in names if n.endswith("/METADATA"))).decode()
        )
    requires = [
        r.split(";")[0].split(">")[0].split("=")[0].strip()
        for r in meta.get_all("Requires-Dist") or []
        if "extra ==" not in r  # optional: `[video]` (PyAV) for stream_video
    ]
    return names, sorted(requires)


def test_the_sdk_and_the_protocol_build_install_and_import_without_the_server(
    tmp_path: Path,
) -> None:
    sdk_names, sdk_requires = build_wheel(SDK_DIR, tmp_path / "sdk")
    # Only the SDK's own package: the protocol comes from its distribution, by name.
    assert {n.split("/")[0] for n in sdk_names if not n.startswith("vllm_realtime_client-")} == {
        "vllm_realtime_client"
    }
    assert "vllm_realtime_client/py.typed" in sdk_names
    assert sdk_requires == ["pydantic", "vllm-realtime-protocol", "websockets"]

    proto_names, proto_requires = build_wheel(PROTOCOL_DIR, tmp_path / "protocol")
    assert proto_requires == ["pydantic"]
    tops = {n.split("/")[0] for n in proto_names if ".dist-info/" not in n}
    assert tops == {"vllm_realtime_protocol"}  # owns its one top-level name, nothing generic
    # The exact files the server runs on (the package is the project's one subfolder).
    assert {n.split("/")[1] for n in proto_names if n.startswith("vllm_realtime_protocol/")} == {
        p.name for p in (PROTOCOL_DIR / "vllm_realtime_protocol").glob("*.py")
    } | {"py.typed"}

    # A throwaway venv, as a user's: both wheels (no index: --no-deps); pydantic and
    # websockets come from this interpreter's site-packages, read-only, appended to sys.path.
    env = tmp_path / "venv"
    venv.create(env, with_pip=True)
    python = env / "bin" / "python"
    wheels = [str(w) for w in (tmp_path / "sdk").glob("*.whl")]
    wheels += [str(w) for w in (tmp_path / "protocol").glob("*.whl")]
    install = [str(python), "-m", "pip", "--disable-pip-version-check", "install", "-q"]
    proc = subprocess.run(
        [*install, "--no-deps", "--no-index", *wheels], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    import pydantic
    import websockets

    deps = sorted({str(Path(m.__file__).parents[1]) for m in (pydantic, websockets)})
    check = (
        "import sys; sys.path += sys.argv[1:]; import vllm_realtime_client, vllm_realtime_protocol; "
        "from vllm_realtime_client import RealtimeError; "
        "from vllm_realtime_protocol.errors import RealtimeError as Same; assert Same is RealtimeError; "
        "import importlib.util; assert importlib.util.find_spec('protocol') is None; "
        "assert '/venv/' in vllm_realtime_protocol.__file__, vllm_realtime_protocol.__file__; "
        "heavy = {'vllm', 'torch', 'fastapi', 'uvicorn', 'realtime', 'retention', 'numpy'}; "
        "print(sorted(heavy & set(sys.modules)))"
    )
    run = subprocess.run(
        [str(python), "-I", "-c", check, *deps],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    # Importing it loads neither vLLM, torch nor the server.
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
