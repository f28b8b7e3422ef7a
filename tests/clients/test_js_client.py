"""The JS client's own unit tests (node --test, a fake WebSocket), its type declarations, and
the client in Node against the real server (tests/clients/conftest.py's client_server)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.clients.conftest import CLIENT_KEY, JS_DIR, need, need_tool
from tests.realtime.conftest import RunningServer

SUBPROTOCOL = "vllm-realtime"


def test_js_unit_tests_pass_under_node_test_runner() -> None:
    node = need_tool("node", "install Node.js 20+")
    proc = subprocess.run(
        [node, "--test", "--test-reporter=spec", "test/"],
        cwd=JS_DIR,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "# fail 0" in proc.stdout or "fail 0" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.slow  # tsc takes a few seconds
def test_typescript_declarations_compile() -> None:
    node = need_tool("node", "install Node.js 20+")
    tsc = JS_DIR / "node_modules" / "typescript" / "bin" / "tsc"
    need(tsc.is_file(), "typescript is not installed: npm ci --prefix clients/js")
    proc = subprocess.run(
        [node, str(tsc), "-p", "test/tsconfig.json"],
        cwd=JS_DIR,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


CONSUMER_TS = """\
import { RealtimeClient, ResponseStream, type ResponseDoneEvent } from "vllm-realtime-client";
export async function use(url: string, jpeg: Blob): Promise<ResponseDoneEvent | null> {
  const client = await RealtimeClient.connect(url, { apiKey: "k" });
  const stream: ResponseStream = client.streamFrame(jpeg);
  for await (const delta of stream) console.log(delta.delta);
  return stream.done;
}
"""


@pytest.mark.slow  # npm pack + install + tsc: ~10-20 s
def test_the_packed_package_installs_and_resolves_with_its_types(tmp_path: Path) -> None:
    """Publishable: `npm pack` gives a tarball that installs into an empty project, where
    `import ... from "vllm-realtime-client"` works in Node and type-checks through `exports`."""
    node = need_tool("node", "install Node.js 20+")
    npm = need_tool("npm", "install Node.js 20+ (with npm)")
    tsc = JS_DIR / "node_modules" / "typescript" / "bin" / "tsc"
    need(tsc.is_file(), "typescript is not installed: npm ci --prefix clients/js")
    meta = json.loads((JS_DIR / "package.json").read_text())
    assert "private" not in meta and meta["name"] == "vllm-realtime-client"
    assert meta["exports"]["."] == {
        "types": "./realtime-client.d.ts",
        "default": "./realtime-client.js",
    }

    def run(*cmd: str, cwd: Path) -> str:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, f"{cmd}: {proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        return proc.stdout

    packed = json.loads(run(npm, "pack", "--json", "--pack-destination", str(tmp_path), cwd=JS_DIR))
    files = {f["path"] for f in packed[0]["files"]}
    assert files == {
        "package.json",
        "README.md",
        "realtime-client.js",
        "realtime-client.d.ts",
        "protocol.d.ts",
        "protocol.schema.json",
        "protocol.tables.json",
    }
    app = tmp_path / "app"
    app.mkdir()
    (app / "package.json").write_text('{"name": "app", "version": "1.0.0", "type": "module"}')
    tarball = tmp_path / packed[0]["filename"]
    run(npm, "install", "--offline", "--no-audit", "--no-fund", str(tarball), cwd=app)
    script = (
        "import { RealtimeClient, ResponseStream, ClientMachine, PROTOCOL_VERSION }"
        " from 'vllm-realtime-client';"
        "console.log(typeof RealtimeClient, typeof ResponseStream, PROTOCOL_VERSION,"
        " new ClientMachine().state);"
    )
    out = run(node, "--input-type=module", "-e", script, cwd=app)
    assert out.split() == ["function", "function", "2026-12-01", "connected"]
    (app / "use.ts").write_text(CONSUMER_TS)
    tsconfig = {
        "compilerOptions": {
            "target": "ES2022",
            "module": "NodeNext",
            "moduleResolution": "NodeNext",
            "lib": ["ES2022", "DOM"],
            "strict": True,
            "noEmit": True,
            "types": [],
        },
        "files": ["use.ts"],
    }
    (app / "tsconfig.json").write_text(json.dumps(tsconfig))
    run(node, str(tsc), "-p", "tsconfig.json", cwd=app)


def _node_has_websocket(node: str) -> bool:
    proc = subprocess.run(
        [node, "-e", "process.exit(typeof WebSocket === 'function' ? 0 : 1)"], timeout=60
    )
    return proc.returncode == 0


@pytest.mark.slow  # the real server on the tiny VLM
@pytest.mark.parametrize("impl", ["ws", "node"])
async def test_node_streams_deltas_with_the_key_in_a_header(
    client_server: RunningServer, tmp_path: Path, impl: str
) -> None:
    """The JS client in Node against the real server: the key in `Authorization` (nowhere in
    the subprotocols), `for await` over a reply's deltas, client.events() until the end."""
    from PIL import Image

    node = need_tool("node", "install Node.js 20+")
    need(
        (JS_DIR / "node_modules" / "ws").is_dir(), "ws is not installed: npm ci --prefix clients/js"
    )
    jpeg = tmp_path / "frame.jpg"
    Image.new("RGB", (64, 48), (30, 170, 40)).save(jpeg, format="JPEG")
    flags = []
    if impl == "node" and not _node_has_websocket(node):
        flags = ["--experimental-websocket"]  # Node 20; global from Node 22
    env = {"RT_URL": client_server.url, "RT_KEY": CLIENT_KEY, "RT_JPEG": str(jpeg), "RT_IMPL": impl}
    proc = await asyncio.create_subprocess_exec(
        node,
        *flags,
        str(JS_DIR / "e2e" / "stream.e2e.mjs"),
        env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 300)
    assert proc.returncode == 0, out.decode()[-3000:] + err.decode()[-3000:]
    s = json.loads(out.decode().strip().splitlines()[-1])

    # The key went as a header; no subprotocol carries it, and a wrong one is refused.
    assert s["apiKeyIn"] == "header" and s["protocol"] == SUBPROTOCOL
    assert s["wrongKey"] == "connection_failed"
    good = s["handshakes"][-1]
    assert CLIENT_KEY not in json.dumps(good[:2] if impl == "ws" else good[1]["protocols"])
    headers = good[2]["headers"] if impl == "ws" else good[1]["headers"]
    assert headers == {"Authorization": f"Bearer {CLIENT_KEY}"}
    assert "vllm-realtime.auth." not in json.dumps(s["handshakes"])

    # for await yielded exactly the reply's deltas; done and text agree with them.
    done = s["done"]
    assert done["type"] == "response.done" and done["frame_id"] == "f0"
    assert done["status"] in ("completed", "incomplete") and done["usage"]["completion_tokens"] >= 1
    assert s["deltas"] and all(d["frame_index"] == done["frame_index"] for d in s["deltas"])
    assert "".join(d["delta"] for d in s["deltas"]) == s["streamText"] == done["text"]
    # One chunk in flight: refused locally while the first streamed, which then finished.
    assert s["inFlight"] == {"code": "chunk_in_flight", "local": True} and "second" not in s
    assert s["firstDone"] in ("completed", "incomplete")
    assert s["answer"]["type"] == "response.done"

    # events(): every server event after the subscription, in order, until the session ended.
    types = [e["type"] for e in s["events"]]
    assert (
        types[0] == "session.opened"
        and types[-1] == "session.closed"
        and s["closed"] == "client_closed"
    )
    first_reply = [e for e in s["events"] if e["frame_index"] == done["frame_index"]]
    assert [e["delta"] for e in first_reply if e["type"] == "response.text.delta"] == [
        d["delta"] for d in s["deltas"]
    ]
    assert types.count("response.done") == 3 and types.count("input.ack") == 3
