"""Server configuration: one frozen object passed from the CLI to the app."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_sessions: int = 32
    idle_timeout_s: float = 300.0
    max_frame_bytes: int = 4 << 20
