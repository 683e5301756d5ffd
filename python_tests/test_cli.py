"""The package's commands as a user meets them (issue 32): `--help` names the command as it is
typed (python -m xccl_rs.<name>), shows each option's default and prints no markup; the demo's
progress bar and its summary speak the same units (decimal GB and GB/s)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

COMMANDS = {  # command -> (an option, its default as --help must show it)
    "bench": ("--ranks", "2"),
    "demo": ("--rounds", "4"),
    "soak": ("--ops", "20000"),
}
# A size or speed unit: B, kB, MB, GB, KiB, MiB, GiB, ... with or without /s.
UNIT = re.compile(r"(?<![A-Za-z])([kKMGT]i?)?B(/s)?(?![A-Za-z])")


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help(name):
    p = subprocess.run([sys.executable, "-m", f"xccl_rs.{name}", "--help"], capture_output=True, text=True,
                       timeout=120, cwd="/tmp")
    assert p.returncode == 0, p.stderr[-3000:]
    out = " ".join(p.stdout.split())  # argparse wraps lines
    assert out.startswith(f"usage: python -m xccl_rs.{name} "), p.stdout[:300]
    option, default = COMMANDS[name]
    assert re.search(rf"{option} \S+ .*?\(default: {default}\)", out), f"{option}'s default is not shown:\n{p.stdout}"
    for markup in ("``", "`", ":class:", ":func:", "**"):
        assert markup not in p.stdout, f"{markup!r} in --help:\n{p.stdout}"


def test_demo_bar_and_summary_share_units():
    """The bar of a sync of 0.29 GB, halfway, and the demo's line for that sync: the same
    figure for the size, and GB, GB/s only."""
    pytest.importorskip("tqdm")
    from xccl_rs.demo import sync_line
    from xccl_rs.weight_sync._common import progress_bar

    nbytes = 288_000_000
    bar = progress_bar(True, nbytes, "weight sync (send)")
    try:
        bar.update(nbytes // 2)
        shown = str(bar)
    finally:
        bar.close()
    line = sync_line(0, "xccl_rs", nbytes, 0.125)
    assert "0.14/0.29 GB" in shown, shown
    assert "sync 0.29 GB in 0.125 s  (2.30 GB/s)" in line, line
    for text in (shown, line):
        units = {m.group(0) for m in UNIT.finditer(text)}
        assert units and units <= {"GB", "GB/s"}, f"units {units} in {text!r}"
    assert "GB/s" in shown, shown

    # Unknown total (a receiver before the first bucket): still GB.
    bar = progress_bar(True, None, "weight sync (receive)")
    try:
        bar.update(nbytes)
        shown = str(bar)
    finally:
        bar.close()
    assert "0.29 GB" in shown and {m.group(0) for m in UNIT.finditer(shown)} <= {"GB", "GB/s"}, shown
