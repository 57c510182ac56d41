"""Realtime + HTTP gateway (starlette). See docs/design.md."""
