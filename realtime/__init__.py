"""vllm-realtime server: moves events between WebSockets, the protocol core and one vLLM engine."""

__version__ = "0.1.0"
