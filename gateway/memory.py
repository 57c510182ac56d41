"""Giving freed memory back to the OS after big transient work.

glibc's malloc keeps what the process frees in its arenas for reuse: only the top of the main heap shrinks on its own,
the other arenas (one per thread that allocated, e.g. the tokenizer's worker threads) and every hole below the top stay
resident. A refused body of megabytes, a conversation of large items, the queued frames of a client that stopped
reading, or a tokenized huge prompt would each leave the server that much larger for good. `malloc_trim(0)` returns
every whole free page of every arena to the OS (madvise) without moving what is in use, so the server's resident size
comes back to its baseline.

A trim walks the arenas, so it runs in a worker thread (ctypes lets go of the GIL) and only after work that was big
(`BIG_BYTES`), never on the event loop. It runs `TRIM_DELAY_S` after it is asked for: the buffers freed just after the
work (the connection's, the ASGI server's, the last references of a closed session) are free by then, and the requests
of that window share one trim. Without glibc (musl, macOS) this is a no-op.
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import threading
import weakref

# Work that held at least this much (a body, a rendered prompt, a session's items or queued frames) is followed by a
# trim; below it the arenas' own reuse is enough.
BIG_BYTES = 1024 * 1024
# A tokenization this long (a prompt refused by its token count, or one near the context) used working memory many
# times the size of its text: it is followed by a trim as well.
BIG_PROMPT_TOKENS = 32 * 1024
TRIM_DELAY_S = 1.0


def _load_malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_malloc_trim = _load_malloc_trim()
_running = threading.Lock()
_scheduled: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()   # the loops with a trim due
_tasks: set[asyncio.Future] = set()   # the trims running in worker threads (held until done)


def release_free_memory() -> None:
    """Return the arenas' free pages to the OS now (blocking: call it from a worker thread)."""
    if _malloc_trim is not None:
        with _running:
            _malloc_trim(0)


def release_soon() -> None:
    """From the event loop, after big work: trim `TRIM_DELAY_S` later in a worker thread (one trim for every request
    of that window); returns at once."""
    loop = asyncio.get_running_loop()
    if _malloc_trim is None or loop in _scheduled:
        return
    _scheduled.add(loop)
    loop.call_later(TRIM_DELAY_S, _start, loop)


def _start(loop: asyncio.AbstractEventLoop) -> None:
    _scheduled.discard(loop)
    future = loop.run_in_executor(None, release_free_memory)
    _tasks.add(future)
    future.add_done_callback(_tasks.discard)
