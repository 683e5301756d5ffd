#!/usr/bin/env python3
"""Runs torch's own distributed test files with gloo and with xccl_rs as the CPU backend, side by
side, and prints passed/failed/skipped per file for each backend.

    $PY scripts/torch_suites.py                                    # the default files, both backends
    $PY scripts/torch_suites.py --backend xccl_rs FILE[::Class[::test]] ... [-k EXPR]
    $PY scripts/torch_suites.py --json out.json ...                # every test's outcome as well

torch's test files are not in its wheel, and this repository does not copy them: ``--tests-dir``
(default ``$XCCL_RS_CACHE/torch-tests/<torch major.minor>``, ``XCCL_RS_CACHE`` defaulting to
``~/.cache/xccl_rs``) is a directory holding torch's ``test/`` tree, such as a pytorch checkout at
the installed torch's commit; docs/testing.md says which files and versions were measured. FILE is
relative to it (``test/distributed/...``). torch's harness code (``torch.testing._internal``)
comes from the installed wheel.

With ``--backend xccl_rs`` every process of the run loads ``scripts/torch_suites_site/sitecustomize.py``
(first on PYTHONPATH), which turns the groups the tests make with gloo into xccl_rs groups and
counts the xccl_rs backends torch creates (the ``xccl_rs backends`` column: 0 means xccl_rs did
not run). Each file runs in one pytest process (``python -m pytest``, junit XML read back) with a
deadline (``--timeout``); torch's harnesses start the ranks.

Exit status: 0 when, on every file run with both backends, xccl_rs passed at least as many tests
as gloo; 1 otherwise; 2 when the files are missing or a file collected nothing. A file whose tests
made no xccl_rs backend is named (its passes say nothing of xccl_rs).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
SITE_DIR = os.path.join(HERE, "torch_suites_site")
BACKENDS = ("gloo", "xccl_rs")
DEFAULT_FILES = (
    "test/distributed/checkpoint/test_file_system_checkpoint_cpu.py",
    "test/distributed/test_c10d_object_collectives.py",
    "test/distributed/tensor/test_dtensor.py",
    "test/distributed/test_functional_api.py",
)


def default_tests_dir() -> str:
    import torch

    cache = os.environ.get("XCCL_RS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "xccl_rs")
    version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    return os.path.join(cache, "torch-tests", version)


def _outcomes(xml_path: str) -> dict[str, str]:
    """Test id ("Class::test") -> passed / failed / error / skipped, from pytest's junit XML."""
    out: dict[str, str] = {}
    try:
        root = ET.parse(xml_path).getroot()
    except (OSError, ET.ParseError):
        return out
    for case in root.iter("testcase"):
        cls = case.get("classname", "").rsplit(".", 1)[-1]
        name = f"{cls}::{case.get('name', '')}"
        if case.find("failure") is not None:
            out[name] = "failed"
        elif case.find("error") is not None:
            out[name] = "error"
        elif case.find("skipped") is not None:
            out[name] = "skipped"
        else:
            out[name] = "passed"
    return out


def run_one(node_ids: list[str], backend: str, tests_dir: str, keyword: str | None, timeout_s: float) -> dict:
    """Runs node ids of one file with one backend, in one pytest process; returns the counts and
    every test's outcome."""
    with tempfile.TemporaryDirectory(prefix="xccl_rs_torch_suites_") as tmp:
        xml_path = os.path.join(tmp, "junit.xml")
        log_path = os.path.join(tmp, "backends.log")
        env = dict(os.environ)
        env["XCCL_RS_TORCH_SUITES_BACKEND"] = backend
        env["XCCL_RS_TORCH_SUITES_LOG"] = log_path
        env["PYTHONPATH"] = os.pathsep.join(p for p in [SITE_DIR, env.get("PYTHONPATH", "")] if p)
        env.setdefault("OMP_NUM_THREADS", "1")
        cmd = [
            sys.executable, "-m", "pytest", *node_ids, "-q", "-p", "no:cacheprovider",
            "-c", os.devnull, "--rootdir", tests_dir, f"--junitxml={xml_path}", "-o", "junit_family=xunit1",
        ]
        if keyword:
            cmd += ["-k", keyword]
        t0 = time.monotonic()
        proc = subprocess.Popen(
            cmd, cwd=tests_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,
        )
        try:
            output, _ = proc.communicate(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            timed_out = True
        seconds = time.monotonic() - t0
        outcomes = _outcomes(xml_path)
        try:
            with open(log_path) as f:
                created = sum(1 for _ in f)
        except OSError:
            created = 0
    counts = {k: sum(1 for v in outcomes.values() if v == k) for k in ("passed", "failed", "error", "skipped")}
    return {
        **counts,
        "collected": len(outcomes),
        "seconds": round(seconds, 1),
        "xccl_rs_backends": created,
        "exit_code": proc.returncode,
        "timed_out": timed_out,
        "outcomes": outcomes,
        "output_tail": output[-4000:],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("specs", nargs="*", help="test files or node ids, relative to --tests-dir; node ids of one file run together")
    ap.add_argument("--backend", action="append", choices=BACKENDS, help="repeatable; default both")
    ap.add_argument("--tests-dir", default=None, help="directory holding torch's test/ tree")
    ap.add_argument("-k", dest="keyword", default=None, help="pytest -k expression for every file")
    ap.add_argument("--timeout", type=float, default=1500.0, help="seconds per file and backend")
    ap.add_argument("--json", default=None, help="write every result (with each test's outcome) here")
    ap.add_argument("--verbose", action="store_true", help="print each run's output tail")
    args = ap.parse_args(argv)

    tests_dir = os.path.abspath(args.tests_dir or default_tests_dir())
    by_file: dict[str, list[str]] = {}
    for spec in args.specs or DEFAULT_FILES:
        by_file.setdefault(spec.split("::")[0], []).append(spec)
    specs = list(by_file)
    backends = args.backend or list(BACKENDS)
    missing = [s for s in specs if not os.path.exists(os.path.join(tests_dir, s))]
    if missing:
        print(f"torch_suites: not found under {tests_dir}: {', '.join(missing)} "
              "(torch's test files are not in its wheel: see docs/testing.md)", file=sys.stderr)
        return 2

    results: dict[str, dict[str, dict]] = {b: {} for b in backends}
    for spec in specs:
        for backend in backends:
            r = run_one(by_file[spec], backend, tests_dir, args.keyword, args.timeout)
            results[backend][spec] = r
            note = " TIMED OUT" if r["timed_out"] else ""
            print(f"  {backend:8} {spec}: {r['passed']} passed, {r['failed'] + r['error']} failed, "
                  f"{r['skipped']} skipped in {r['seconds']:.0f} s{note}", flush=True)
            if args.verbose or r["collected"] == 0:
                print("    " + r["output_tail"].replace("\n", "\n    "), flush=True)

    print()
    head = f"{'file':70}" + "".join(f" | {b + ' p/f/s':>16}" for b in backends)
    if "xccl_rs" in backends:
        head += " | xccl_rs backends"
    print(head)
    print("-" * len(head))
    status = 0
    for spec in specs:
        row = f"{spec:70}"
        for b in backends:
            r = results[b][spec]
            row += f" | {r['passed']:>4}/{r['failed'] + r['error']:>4}/{r['skipped']:>4}   "
            if r["collected"] == 0:
                status = 2
        if "xccl_rs" in backends:
            x = results["xccl_rs"][spec]
            row += f" | {x['xccl_rs_backends']:>16}"
            if "gloo" in backends and x["passed"] < results["gloo"][spec]["passed"] and status == 0:
                status = 1
        print(row)
    if "xccl_rs" in backends:
        for spec in specs:
            if results["xccl_rs"][spec]["collected"] and not results["xccl_rs"][spec]["xccl_rs_backends"]:
                print(f"  no xccl_rs backend was made by {spec}: none of its tests that ran here used a CPU group")
    if "gloo" in backends and "xccl_rs" in backends:
        for spec in specs:
            g, x = results["gloo"][spec]["outcomes"], results["xccl_rs"][spec]["outcomes"]
            worse = sorted(t for t, o in g.items() if o == "passed" and x.get(t) != "passed")
            better = sorted(t for t, o in x.items() if o == "passed" and g.get(t) != "passed")
            for t in worse:
                print(f"  passes with gloo only: {spec}::{t} (xccl_rs: {x.get(t, 'not run')})")
            for t in better:
                print(f"  passes with xccl_rs only: {spec}::{t} (gloo: {g.get(t, 'not run')})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tests_dir": tests_dir, "results": results}, f, indent=1)
    return status


if __name__ == "__main__":
    sys.exit(main())
