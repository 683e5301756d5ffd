"""The memory a block of code costs a process: its RSS high-water mark over the block, above
the RSS at its start (Linux).

The high-water mark (``VmHWM`` in /proc/self/status) is reset to the current RSS right before
the block (``echo 5 > /proc/self/clear_refs``) and read right after. Freed memory still resident
in malloc's heap would serve the block's allocations without raising the RSS, hiding them:
``malloc_trim(0)`` gives it back to the kernel first. The meter counts every page the process
touches (torch's allocations, Python's, pages of shared memory it reads), so it is an upper
bound on what the block costs, not a count of its own allocations.
"""

from __future__ import annotations

import re


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


class PeakRss:
    """``with PeakRss() as mem: ...``, then ``mem.extra``: the bytes of RSS the block added at
    its peak (module docstring)."""

    def __enter__(self):
        import ctypes
        import gc

        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        self.start = _status("VmRSS")
        return self

    def __exit__(self, *exc):
        self.extra = _status("VmHWM") - self.start
