"""Giving freed memory back to the OS after big transient work.

glibc's malloc keeps what the process frees in its arenas for reuse: only the top of the main heap shrinks on its own,
the other arenas (one per thread that allocated, e.g. the tokenizer's worker threads) and every hole below the top stay
resident. A refused body of megabytes, a conversation of large items, the queued frames of a client that stopped
reading, or a tokenized huge prompt would each leave the server that much larger for good. `malloc_trim(0)` returns
every whole free page of every arena to the OS (madvise) without moving what is in use, so the server's resident size
comes back to its baseline.

`malloc_trim` cannot cut the free top of a thread's arena, though: only a `free()` in that arena does, and only when the
top exceeds the trim threshold. glibc raises that threshold on its own to twice the largest mmapped block freed so far
(up to 64 MiB), so after one big tokenization a worker thread's arena could keep tens of MiB for good. The server fixes
both thresholds at start (`fix_thresholds`): blocks up to `MMAP_THRESHOLD_BYTES` come from the arenas, as glibc's own
adjustment would settle on for the engine's per-step tensors, and no arena keeps more than `TRIM_THRESHOLD_BYTES` of
free top.

A trim walks the arenas, so it runs in a worker thread (ctypes lets go of the GIL) and only after work that was big
(`BIG_BYTES`), never on the event loop. It runs `TRIM_DELAY_S` after it is asked for: the buffers freed just after the
work (the connection's, the ASGI server's, the last references of a closed session) are free by then, and the requests
of that window share one trim. Without glibc (musl, macOS) this is a no-op.
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os
import threading
import weakref

# Work that held at least this much (a body, a rendered prompt, a session's items or queued frames) is followed by a
# trim; below it the arenas' own reuse is enough.
BIG_BYTES = 1024 * 1024
# A tokenization this long (a prompt refused by its token count, or one near the context) used working memory many
# times the size of its text: it is followed by a trim as well.
BIG_PROMPT_TOKENS = 32 * 1024
TRIM_DELAY_S = 1.0
# Fixed malloc thresholds (see above); the MALLOC_TRIM_THRESHOLD_ / MALLOC_MMAP_THRESHOLD_ environment variables, when
# set, win.
TRIM_THRESHOLD_BYTES = 16 * 1024 * 1024
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3   # mallopt's parameter numbers (malloc.h)


def _load_glibc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim, mallopt = libc.malloc_trim, libc.mallopt
    except (OSError, AttributeError):
        return None, None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return trim, mallopt


_malloc_trim, _mallopt = _load_glibc()
_running = threading.Lock()
_scheduled: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()   # the loops with a trim due
_tasks: set[asyncio.Future] = set()   # the trims running in worker threads (held until done)


def fix_thresholds() -> bool:
    """Fix glibc's trim and mmap thresholds for this process (the server calls it once, at start); False where they
    are left as they were (no glibc, or the environment sets them)."""
    if _mallopt is None or {"MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_"} & os.environ.keys():
        return False
    return bool(_mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and _mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


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
