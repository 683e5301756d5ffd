"""Two builds of xccl_rs side by side, in one run: `python -m xccl_rs.bench` alternately with
each (before, after, before, after, ...), then the median time of each op and size per build
and their ratio. For a change that must not change speed (a refactor), or one that should.

    python scripts/bench_before_after.py --before DIR --after DIR [--rounds 3] -- BENCH ARGS...

DIR: a folder holding the `xccl_rs` package of one build (with its compiled `_C`), put first on
PYTHONPATH; `installed` means the one installed in this Python. BENCH ARGS go to the benchmark
(`--backends` is set to xccl_rs alone). Alternating the builds spreads the machine's drift over
both; the spread of each build's runs is printed so that noise can be told from a change.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def run_bench(package_dir: str, bench_args: list[str], json_path: str) -> list[dict]:
    env = dict(os.environ)
    if package_dir != "installed":
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.abspath(package_dir), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "xccl_rs.bench", *bench_args, "--backends", "xccl_rs", "--json", json_path]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(json_path) as f:
        return [r for r in json.load(f)["rows"] if "op" in r]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, bench_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True)
    p.add_argument("--after", required=True)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(ours)
    times: dict[str, dict[tuple, list[float]]] = {"before": {}, "after": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for name in ("before", "after"):
                print(f"round {round_ + 1}/{args.rounds}: {name}", flush=True)
                for row in run_bench(getattr(args, name), bench_args, os.path.join(tmp, f"{name}.json")):
                    key = (row["op"], row["dtype"], row["bytes"])
                    times[name].setdefault(key, []).append(row["xccl_rs"]["time_us"])
    print(f"{'op':<15} {'dtype':<9} {'size':>10} {'before(us)':>12} {'after(us)':>12} {'after/before':>12}  spread before / after")
    for key in sorted(times["after"], key=lambda k: (k[0], k[1], k[2])):
        before, after = times["before"].get(key, []), times["after"][key]
        if not before:
            continue
        b, a = statistics.median(before), statistics.median(after)
        spread = lambda v: f"{min(v):.1f}-{max(v):.1f}"  # noqa: E731
        print(f"{key[0]:<15} {key[1]:<9} {key[2]:>10} {b:>12.1f} {a:>12.1f} {a / b:>12.3f}  {spread(before)} / {spread(after)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
