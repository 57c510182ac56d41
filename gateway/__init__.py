"""Realtime + HTTP gateway (starlette): app, HTTP API, metrics, CLI, WebSocket handshake; the Realtime API itself is
`gateway.realtime`. See docs/architecture.md for how a turn flows through it and docs/gateway.md for the details."""
