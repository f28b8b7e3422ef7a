"""The HTTP adapter's OpenAPI schema (docs/http.md): every route of /v1/streaming/sessions is
listed with the models of its request and response bodies, and /docs serves the page.

No engine: the app is built without running its lifespan (the hub factory is never called),
and /openapi.json and /docs are answered from the routes alone.
"""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from realtime.config import ServerConfig
from realtime.server import create_app


async def _no_hub() -> Any:
    raise AssertionError("the schema must not need the engine")


def _schema() -> dict[str, Any]:
    client = TestClient(create_app(_no_hub, ServerConfig(api_keys=("k",))))
    answer = client.get("/openapi.json")  # open, though the server has a key
    assert answer.status_code == 200
    doc: dict[str, Any] = answer.json()
    return doc


def _ref(content: dict[str, Any], media: str = "application/json") -> str:
    schema = content["content"][media]["schema"]
    return str(schema["$ref"]).rsplit("/", 1)[-1]


def test_the_adapter_routes_name_their_bodies() -> None:
    doc = _schema()
    paths = doc["paths"]
    components = doc["components"]["schemas"]

    open_ = paths["/v1/streaming/sessions"]["post"]
    assert _ref(open_["requestBody"]) == "SessionConfig"
    assert _ref(open_["responses"]["200"]) == "SessionOpenedEvent"
    assert _ref(open_["responses"]["429"]) == "ErrorEvent"

    frame = paths["/v1/streaming/sessions/{session_id}/frame"]["post"]
    assert set(frame["requestBody"]["content"]) == {
        "text/plain",
        "image/jpeg",
        "application/octet-stream",
    }
    assert _ref(frame["responses"]["200"]) == "ResponseDoneEvent"
    assert _ref(frame["responses"]["409"]) == "ErrorEvent"  # chunk_in_flight
    assert _ref(frame["responses"]["503"]) == "HttpFrameError"
    assert "429" not in frame["responses"]  # admission is at open; HTTP has no frame-rate limit
    assert {p["name"] for p in frame["parameters"]} == {"session_id", "prompt"}

    close = paths["/v1/streaming/sessions/{session_id}"]["delete"]
    refs = {
        s["$ref"].rsplit("/", 1)[-1]
        for s in close["responses"]["200"]["content"]["application/json"]["schema"]["anyOf"]
    }
    assert refs == {"SessionClosedEvent", "HttpSessionClosed"}

    # Every model referred to is in the components, with the protocol's own fields.
    for name in ("SessionConfig", "SessionOpenedEvent", "ResponseDoneEvent", "HttpFrameError"):
        assert name in components, name
    assert {"retention", "sampling", "limits"} <= set(components["SessionConfig"]["properties"])
    assert "response" in components["HttpFrameError"]["properties"]
    assert "ClientSecretRequest" in components  # the client secrets route's body


def test_docs_page_is_served() -> None:
    client = TestClient(create_app(_no_hub, ServerConfig(api_keys=("k",))))
    page = client.get("/docs")
    assert page.status_code == 200
    assert "/openapi.json" in page.text
    assert client.get("/redoc").status_code == 404
