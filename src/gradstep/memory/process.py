"""What a process's memory is, and the process settings a memory budget relies on.

The peak of a step (CUDA: the caching allocator's ``max_memory_allocated``; CPU: the
process's resident high-water mark, ``VmHWM``, which Linux resets when ``5`` is written to
``/proc/self/clear_refs``), the bytes in use now, the runtime's fixed cost for the analytic
estimate, and two settings without which a CPU process's resident memory depends on its
history rather than on its live tensors: glibc's mmap threshold
(:func:`pin_mmap_threshold`) and the size of oneDNN's kernel caches
(:func:`bound_kernel_caches`).
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys

import torch

__all__ = [
    "CPU_DYNAMO_IMPORT_BYTES",
    "available_bytes",
    "CPU_KERNEL_RUNTIME_BYTES",
    "KERNEL_CACHE_CAPACITY",
    "bound_kernel_caches",
    "current_bytes",
    "peak_bytes",
    "pin_mmap_threshold",
    "reset_peak",
    "runtime_bytes",
]

_CLEAR_REFS = "/proc/self/clear_refs"
_STATUS = "/proc/self/status"
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number

CPU_KERNEL_RUNTIME_BYTES = 30 * 2**20
"""RSS a CPU process gains from its first training steps beyond the tensors and imports:
code pages of libtorch/oneDNN paged in as kernels first run, thread pools, kernel caches.
Calibrated on CPU, torch 2.13, the demo GPT (x86-64, 1-2 threads): 24 MiB fp32, 35 MiB
bf16, independent of the batch. The probe measures it; this is only for the analytic
estimate."""

KERNEL_CACHE_CAPACITY = 64
"""Entries :func:`bound_kernel_caches` allows oneDNN's primitive cache and ideep's LRU
cache. Calibrated on CPU, torch 2.13, the demo GPT: one step at one input shape creates
about 20 primitives, so 64 keep a run's shapes (micro-batch, short last micro-batch,
evaluation) cached while bounding what a stream of new shapes can pin."""

_KERNEL_CACHES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")

CPU_DYNAMO_IMPORT_BYTES = 69 * 2**20
"""RSS of ``import torch._dynamo`` (with sympy, mpmath, ...: about 800 modules), which the
first ``optimizer.step()`` triggers when nothing imported it before. Calibrated on CPU,
torch 2.13."""


def _device(device: torch.device | str | None) -> torch.device:
    return torch.device(device) if device is not None else torch.device("cpu")


def _is_cuda(dev: torch.device) -> bool:
    return dev.type == "cuda" and torch.cuda.is_available()


def _status_bytes(key: str) -> int | None:
    try:
        with open(_STATUS) as status:
            for line in status:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None


def _ru_maxrss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux


def reset_peak(device: torch.device | str | None = None) -> str:
    """Start a new peak measurement; returns where :func:`peak_bytes` will read it from.

    ``"cuda_max_allocated"``; ``"vmhwm"`` (reset worked); or ``"ru_maxrss (no reset)"``
    where ``/proc/self/clear_refs`` cannot be written (not Linux, or a locked-down
    container): the peak is then the process's peak since it started, so only sizes that
    go up can be told apart.
    """
    dev = _device(device)
    if _is_cuda(dev):
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        return "cuda_max_allocated"
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
    except OSError:
        return "ru_maxrss (no reset)"
    return "vmhwm" if _status_bytes("VmHWM:") is not None else "ru_maxrss (no reset)"


def peak_bytes(device: torch.device | str | None = None) -> int:
    """Peak bytes since the last :func:`reset_peak`: CUDA allocator peak, or CPU VmHWM."""
    dev = _device(device)
    if _is_cuda(dev):
        return int(torch.cuda.max_memory_allocated(dev))
    hwm = _status_bytes("VmHWM:")
    return hwm if hwm is not None else _ru_maxrss_bytes()


def current_bytes(device: torch.device | str | None = None) -> int:
    """Bytes in use now: CUDA ``memory_allocated``, or the process's RSS on CPU."""
    dev = _device(device)
    if _is_cuda(dev):
        return int(torch.cuda.memory_allocated(dev))
    rss = _status_bytes("VmRSS:")
    return rss if rss is not None else _ru_maxrss_bytes()


def runtime_bytes(device: torch.device | str | None = None) -> int:
    """The fixed cost for the analytic estimate, read *before* building the model.

    CPU: the process's RSS now (interpreter, torch, imported modules) plus what the first
    steps add whatever the batch: :data:`CPU_DYNAMO_IMPORT_BYTES` unless ``torch._dynamo``
    is already imported, and :data:`CPU_KERNEL_RUNTIME_BYTES`. CUDA: ``memory_allocated``
    now (the CUDA context and kernel images are outside ``max_memory_allocated``; cuBLAS
    workspaces are inside it; not calibrated on a GPU here).
    """
    dev = _device(device)
    if _is_cuda(dev):
        return current_bytes(dev)
    lazy = CPU_KERNEL_RUNTIME_BYTES
    if "torch._dynamo" not in sys.modules:
        lazy += CPU_DYNAMO_IMPORT_BYTES
    return current_bytes(dev) + lazy


def bound_kernel_caches(capacity: int = KERNEL_CACHE_CAPACITY) -> bool:
    """Bound the CPU kernel caches, so that new input shapes cannot grow a process for ever.

    oneDNN (bf16/fp16 matmuls and attention on CPU) compiles kernels per input shape and
    keeps them in two caches of 1024 entries each, about 0.3-0.6 MiB per entry: with
    variable-length data at micro-batch 1 every new sequence length left ~12 MiB behind
    (bf16 demo GPT, torch 2.13), unbounded in practice. This sets
    ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` and ``LRU_CACHE_CAPACITY`` (ideep's) to
    ``capacity``, unless the environment already sets them (the user's choice stands).
    Both are read when oneDNN first runs: call it before the first CPU matmul, as
    ``gradstep train`` does. Returns True when it set either. ``capacity`` must be >= 1
    (an LRU cache of 0 entries crashes torch 2.13).
    """
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
    changed = False
    for var in _KERNEL_CACHES:
        if var not in os.environ:
            os.environ[var] = str(capacity)
            changed = True
    return changed


def pin_mmap_threshold(threshold_bytes: int = 128 * 1024) -> bool:
    """Fix glibc's mmap threshold so freed tensors go back to the OS (CPU RSS = live bytes).

    Without it, glibc adapts the threshold upward after every large free and serves later
    tensors from arenas it keeps, so a CPU process's peak RSS grows with the allocation
    history, not with what is alive. Affects only allocations made afterwards. Costs page
    faults on every large allocation. Returns False where unavailable (not glibc).
    """
    try:  # the process's own symbols hold libc's (find_library would fork ldconfig)
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, int(threshold_bytes)))


def available_bytes(device: torch.device | str | None = None) -> int:
    """What this device could hold for this process: CUDA's free memory plus what the process
    holds; on CPU (Linux) ``MemAvailable`` plus this process's resident set. Raises OSError,
    KeyError or ValueError where it cannot be read."""
    dev = _device(device)
    if _is_cuda(dev):
        return int(torch.cuda.mem_get_info(dev)[0] + torch.cuda.memory_allocated(dev))
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    rss = _status_bytes("VmRSS:")
    if rss is None:
        raise KeyError("VmRSS")
    return int(fields["MemAvailable"].split()[0]) * 1024 + rss
