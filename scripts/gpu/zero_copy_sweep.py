"""The zero-copy all-reduce sweep of python_tests/test_zero_copy.py at larger groups (issue 13:
scale to the host), against the same torch references:

    CUDA_VISIBLE_DEVICES= PYTHONPATH=python:python_tests python3 scripts/gpu/zero_copy_sweep.py 8 16

Runs each group size with the default settings and with the test's small blocks
(SMALL_BLOCKS: 64 KiB blocks, streaming stores, two threads), and exits 1 on any failure.
"""

import sys
import time

from harness import run_ranks
from test_zero_copy import SMALL_BLOCKS, zero_copy_sweep

def main() -> int:
    failed = 0
    for w in [int(a) for a in sys.argv[1:]] or [8, 16]:
        for env in (None, SMALL_BLOCKS):
            t0 = time.time()
            res = run_ranks(w, zero_copy_sweep, timeout_s=600, env=env)
            report = res.report()
            cases = [res.value(r)["cases"] for r in range(w)] if not report else []
            print(f"{w} ranks, env {env}: cases per rank {sorted(set(cases))}, {'FAILED' if report else 'passed'}, {time.time() - t0:.0f} s")
            if report:
                print(report)
                failed += 1
    return 1 if failed else 0


if __name__ == "__main__":  # the ranks are started by importing this file
    sys.exit(main())
