"""What this CPU runs, and how many threads it gets.

`Isa` names the instruction sets of the packed linear kernels (kernels/csrc/packed_linear/, one file each);
`cpu_isa()` is what the CPU and the build have, `packed_isa()` what the packed kernels use (the same, or NONE with
`RTSERVE_PACKED_LINEAR=0`).
"""
from __future__ import annotations

import enum
import os

import torch

from kernels import cpu_ext, settings


class Isa(enum.Enum):
    """The packed kernels' instruction sets; the values are the C++ `rtserve::Isa` codes (packed_linear.h)."""
    NONE = 0           # no packed kernel: torch serves every linear layer
    AVX512_FP32 = 1    # AVX-512 BF16 without AMX: fp32 FMAs on bf16 tiles
    AMX = 2            # AMX bf16 tiles
    AVX512_FP16 = 3    # AVX-512 FP16 without AMX: fp16 FMAs on fp16 tiles
    AVX512_VNNI = 4    # AVX-512 BF16 + VNNI without AMX or FP16: GGUF blocks as int8 dots, bf16 tiles as fp32 FMAs


def cpu_isa() -> Isa:
    """The instruction set the C++ ops found on this CPU (NONE without them), whatever `RTSERVE_PACKED_LINEAR` says."""
    lib = cpu_ext.ops()
    return Isa(int(lib.packed_isa())) if lib is not None else Isa.NONE


def packed_isa() -> Isa:
    """The instruction set that runs the packed kernels (`kernels.linear`, `kernels.linear_gguf`): AMX (bf16 tiles),
    AVX512_FP16 (fp16 FMAs on fp16 tiles, for AVX-512 FP16 CPUs without AMX), AVX512_VNNI (GGUF blocks as int8 dot
    products, bf16 tiles as fp32 FMAs, for AVX-512 BF16 + VNNI CPUs with neither), AVX512_FP32 (fp32 FMAs on bf16
    tiles and dequantized GGUF blocks: such CPUs without VNNI, or with it and `RTSERVE_VNNI=0`), or NONE: no such CPU,
    the C++ ops not built, or switched off (`RTSERVE_PACKED_LINEAR=0`). The switches are for A/B runs."""
    if not settings.enabled("RTSERVE_PACKED_LINEAR"):
        return Isa.NONE
    isa = cpu_isa()
    if isa is Isa.AVX512_VNNI and not settings.enabled("RTSERVE_VNNI"):
        return Isa.AVX512_FP32
    return isa


def without_amx(isa: Isa) -> bool:
    """An AVX-512 instruction set of a CPU without (usable) AMX: there oneDNN's bf16 GEMMs run slower than fp32 ones."""
    return isa in (Isa.AVX512_FP32, Isa.AVX512_VNNI, Isa.AVX512_FP16)


def default_thread_count() -> int:
    """torch's own default intra-op thread count (OMP_NUM_THREADS, else the CPUs this process may use), whatever
    `torch.set_num_threads` calls other threads have made since."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def set_thread_count(n: int) -> None:
    """Give the calling thread `n` intra-op threads for its torch and C++ ops, whatever other threads set.

    Why: torch's count is per thread (OpenMP's), but a thread takes the process-wide value of the last
    `torch.set_num_threads` call, from any thread, on its first parallel op. So each worker thread (the engine, Whisper)
    fixes its own at start: first trigger that lazy initialisation, then set.

    That initialisation is inline code (`at::internal::lazy_init_num_threads`, a thread-local flag), so each library
    holds its own copy: libtorch's (`get_num_threads` runs it) and our C++ ops' (any `at::parallel_for` in them runs
    it). Both must run before the count is set. Otherwise the engine thread, idle while the audio stage starts, took
    Whisper's one thread on its first C++ op, and served text on one core of two whenever the audio stage was on."""
    torch.get_num_threads()
    ops = cpu_ext.ops()
    if ops is not None:
        ops.argmax_rows(torch.zeros(1, 1))  # one row: no work, only the C++ ops' own lazy initialisation
    torch.set_num_threads(max(1, int(n)))
