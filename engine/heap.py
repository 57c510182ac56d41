"""The startup heap, kept out of Python's garbage collector.

Loading a model leaves hundreds of thousands of long-lived Python objects (modules, torch and tokenizer objects, the
audio stage's models). A full collection walks every tracked object with the GIL held, so while they are in the
oldest generation each one stalls every thread of the process at once: the event loop, the engine's steps, Whisper and
piper; under load it lands on some turn's critical path at random. Once loading is over they are frozen (moved to the
permanent generation, which collections skip); what is created later is still collected. vLLM does the same at the
end of its warm-up.
"""
from __future__ import annotations

import gc
import logging

log = logging.getLogger("rtserve")


def freeze_startup_heap(what: str) -> int:
    """Collect once, then freeze everything alive; call when `what` has finished loading. Returns how many objects
    are frozen."""
    gc.collect()
    gc.freeze()
    count = gc.get_freeze_count()
    log.info("%s: %d objects of the startup heap frozen (left out of garbage collection)", what, count)
    return count
