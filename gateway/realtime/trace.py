"""The debug timeline of a voice turn (`--log-level debug`: `rtserve.voice` "trace" lines), shared by the audio
modules so one turn's speculation, transcript and spoken pieces read as one sequence."""
from __future__ import annotations

import logging
import time

log = logging.getLogger("rtserve.voice")


def trace(what: str, event: str, detail=None) -> None:
    if log.isEnabledFor(logging.DEBUG):
        log.debug("trace %.3f %s %s %s", time.perf_counter(), what, event, "" if detail is None else repr(detail))
