"""The memory a block of code costs a process: its RSS high-water mark over the block, above
the RSS at its start (Linux).

The high-water mark (``VmHWM`` in /proc/self/status) is reset to the current RSS right before
the block (``echo 5 > /proc/self/clear_refs``) and read right after. Freed memory still resident
in malloc's heap would serve the block's allocations without raising the RSS, hiding them:
``malloc_trim(0)`` gives it back to the kernel first. Memory freed *within* the block would hide
nothing but could still raise the mark: glibc's mmap threshold grows when a large block is freed,
after which large tensors come from the heap, where fragmentation keeps freed ones resident, so a
block that frees one tensor and allocates another can be charged for both. The meter therefore
fixes the threshold (``mallopt(M_MMAP_THRESHOLD, 64 KiB)``, once per process): every large
allocation is mapped on its own and unmapped when freed, and the mark follows live memory. The
meter counts every page the process
touches (torch's allocations, Python's, pages of shared memory it reads), so it is an upper
bound on what the block costs, not a count of its own allocations.
"""

from __future__ import annotations

import re


_M_MMAP_THRESHOLD = -3  # glibc's malloc.h
_MMAP_THRESHOLD = 64 << 10


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


class PeakRss:
    """``with PeakRss() as mem: ...``, then ``mem.extra``: the bytes of RSS the block added at
    its peak (module docstring)."""

    def __enter__(self):
        import ctypes
        import gc

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
        gc.collect()
        libc.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        self.start = _status("VmRSS")
        return self

    def __exit__(self, *exc):
        self.extra = _status("VmHWM") - self.start
