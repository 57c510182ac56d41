"""The OpenAI Realtime API over WebSocket, one module per concern (docs/gateway.md, docs/architecture.md).

A voice turn flows one way: `audio_in` (buffer, VAD, commits) reports turn events to `session`, which hands a pause
to `speculation` and the finished turn to `response`, whose output goes out as text or through `audio_out`.
`protocol`, `session_config` and `conversation` are the shapes they share. `session` imports the others; they never
import `session`.
"""
