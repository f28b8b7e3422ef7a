"""`pip install clients/python` ships the SDK plus the repository's own `protocol`, nothing heavy."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

from tests.clients.conftest import ROOT, SDK_DIR

pytestmark = pytest.mark.slow  # builds a wheel (a few seconds)


def test_wheel_carries_protocol_and_needs_only_pydantic_and_websockets(tmp_path: Path) -> None:
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    build = ["wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)]
    proc = subprocess.run([*pip, *build, str(SDK_DIR)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("vllm_realtime_client-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        metadata_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(zf.read(metadata_name).decode())
        # The exact protocol the server runs: same files, same bytes (through the symlink).
        for source in sorted((ROOT / "vllm_realtime_protocol").glob("*.py")):
            assert zf.read(f"vllm_realtime_protocol/{source.name}") == source.read_bytes(), (
                source.name
            )
        assert "vllm_realtime_client/py.typed" in names
        zf.extractall(tmp_path / "unpacked")
    requires = sorted(
        r.split(">")[0].split("=")[0].strip()
        for r in metadata.get_all("Requires-Dist")
        if "extra ==" not in r  # optional: `[video]` (PyAV) for stream_video
    )
    assert requires == ["pydantic", "websockets"]
    assert "video" in metadata.get_all("Provides-Extra")
    # Importing it loads neither vLLM, torch nor the server.
    check = (
        "import sys; sys.path.insert(0, sys.argv[1]); import vllm_realtime_client, vllm_realtime_protocol; "
        "assert vllm_realtime_protocol.__file__.startswith(sys.argv[1]), vllm_realtime_protocol.__file__; "
        "heavy = {'vllm', 'torch', 'fastapi', 'uvicorn', 'realtime', 'retention', 'numpy'}; "
        "print(sorted(heavy & set(sys.modules)))"
    )
    run = subprocess.run(
        [sys.executable, "-I", "-c", check, str(tmp_path / "unpacked")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
