"""Multi-process harness for the xccl_rs pytest suite.

``run_ranks(world_size, fn, *args, ...)`` starts ``world_size`` processes (from a multiprocessing
fork server that has imported torch: see ``_rank_processes``), initialises torch.distributed in
each of them and runs
``fn(rank, world_size, *args)``.  Every rank's return value, exception, check failure
and progress is streamed back to the parent through a Queue.  The parent enforces a
hard deadline: ranks that are still alive at the deadline get their Python stacks
dumped (faulthandler on SIGUSR1) and are then killed, so a run can never hang.

Inside a worker, ``ctx()`` gives the rank context and ``Checker`` collects the failures
of a sweep of cases (each failure is sent to the parent as soon as it happens, so the
report survives a later hang/kill).

This module must not import torch at module level: workers apply ``env`` before
torch is imported.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import importlib
import os
import pickle
import queue as queue_mod
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import zlib

BACKEND = os.environ.get("XCCL_RS_TEST_BACKEND", "xccl_rs").strip() or "xccl_rs"
IS_GLOO = BACKEND == "gloo"
IS_XCCL = BACKEND == "xccl_rs"


def torch_attaches_flight_recorder() -> bool:
    """Whether torch attaches its FlightRecorderHook to every group (torch >= 2.15), which
    records backends without a recorder of their own and writes a trace on abort. torch 2.14
    already has the reconfigure API (``dist._reconfigure``) but not this hook."""
    import torch.distributed as dist

    return hasattr(dist.distributed_c10d._World, "pg_flight_recorder_hooks")


# Default collective timeout (init_process_group(timeout=...)) for sweeps.
DEFAULT_PG_TIMEOUT_S = float(os.environ.get("XCCL_RS_TEST_PG_TIMEOUT", "60"))
# Multiplies every hard deadline (slow machines / debugging).
DEADLINE_SCALE = float(os.environ.get("XCCL_RS_TEST_DEADLINE_SCALE", "1"))


def seed_of(*parts) -> int:
    """Deterministic 31-bit seed from (case id, rank, ...)."""
    return zlib.crc32("|".join(str(p) for p in parts).encode()) & 0x7FFFFFFF


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collect_outputs(procs, timeout_s: float = 120.0) -> list[tuple[int, str]]:
    """(return code, output) of every subprocess.Popen in ``procs`` (stdout piped, text); one
    still running after ``timeout_s`` is killed, and its output says so."""
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout_s * DEADLINE_SCALE)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            out += "\n<killed at the deadline>"
        outs.append((p.returncode, out))
    return outs


def backend_for(spec: str) -> str:
    """Map a backend string written for xccl_rs onto the backend under test.

    "cpu:xccl_rs" -> "cpu:gloo" when validating with gloo.
    """
    return spec.replace("xccl_rs", BACKEND) if not IS_XCCL else spec


# --------------------------------------------------------------------------------------
# worker side
# --------------------------------------------------------------------------------------


class RankContext:
    def __init__(self, rank, world_size, q, cfg):
        self.rank = rank
        self.world_size = world_size
        self._q = q
        self.cfg = cfg
        self.backend = cfg["backend"]
        self.is_gloo = cfg["is_gloo"]
        self.pg_timeout_s = cfg["pg_timeout_s"]
        self.store_port = cfg["store_port"]
        self.master_port = cfg["master_port"]
        self.tmpdir = cfg["tmpdir"]

    def progress(self, case: str) -> None:
        self._q.put(("progress", self.rank, case))

    def fail(self, case: str, msg: str) -> None:
        self._q.put(("fail", self.rank, (case, msg)))

    def put_result(self, key: str, value) -> None:
        """Stream a partial result to the parent now (survives a later crash/hang);
        the parent finds it in RunResult.partials[rank][key]."""
        self._q.put(("partial", self.rank, (key, pickle.dumps(value))))

    def note(self, text: str) -> None:
        """Informational line shown in the parent's report (e.g. skipped cases)."""
        self._q.put(("note", self.rank, text))

    def timeout(self, seconds: float | None = None) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.pg_timeout_s if seconds is None else seconds)

    def connect_store(self):
        """A client of the parent's TCPStore (for init='none' workers)."""
        import torch.distributed as dist

        return dist.TCPStore(
            "127.0.0.1",
            self.store_port,
            self.world_size,
            False,
            timeout=self.timeout(max(self.pg_timeout_s, 30)),
        )


_CTX: RankContext | None = None


def ctx() -> RankContext:
    assert _CTX is not None, "harness.ctx() is only available inside run_ranks workers"
    return _CTX


class SweepAborted(Exception):
    pass


class Checker:
    """Collects the failures of a sweep; never raises on a failed check.

    with ck.case("all_reduce/float32/SUM/n1001/sync"):
        ...                # any exception is recorded as a failure of this case
        ck.equal(out, ref) # records a failure with details, returns bool
    return ck.summary()
    """

    def __init__(self, max_consecutive_errors: int = 40):
        self.c = ctx()
        self.cases = 0
        self.failed_cases = 0
        self.skipped: dict[str, int] = {}
        self.current: str | None = None
        self._consecutive_errors = 0
        self._max_consecutive_errors = max_consecutive_errors
        self._current_failed = False

    @contextlib.contextmanager
    def case(self, name: str):
        self.current = name
        self._current_failed = False
        self.cases += 1
        self.c.progress(name)
        try:
            yield self
        except SweepAborted:
            raise
        except Exception as e:  # noqa: BLE001 - everything is a recorded failure
            tb = traceback.format_exc(limit=6)
            self.fail(f"raised {type(e).__name__}: {e}\n{tb}")
            self._consecutive_errors += 1
            if self._consecutive_errors >= self._max_consecutive_errors:
                raise SweepAborted(
                    f"{self._consecutive_errors} consecutive cases raised; sweep aborted "
                    f"(last case {name})"
                ) from e
        else:
            self._consecutive_errors = 0
        finally:
            if self._current_failed:
                self.failed_cases += 1
            self.current = None

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def fail(self, msg: str) -> None:
        self._current_failed = True
        self.c.fail(self.current or "<no case>", msg)

    def check(self, cond: bool, msg: str) -> bool:
        if not cond:
            self.fail(msg)
        return bool(cond)

    def equal(self, actual, expected, what: str = "output") -> bool:
        from refs import compare_exact

        err = compare_exact(actual, expected)
        if err:
            self.fail(f"{what}: {err}")
            return False
        return True

    def close(self, actual, expected, tol, what: str = "output") -> bool:
        """tol: per-element tolerance tensor (or float) such that |a - e| <= tol."""
        from refs import compare_close

        err = compare_close(actual, expected, tol)
        if err:
            self.fail(f"{what}: {err}")
            return False
        return True

    def summary(self) -> dict:
        for reason, n in sorted(self.skipped.items()):
            if self.c.rank == 0:
                self.c.note(f"skipped {n} cases: {reason}")
        return {"cases": self.cases, "failed": self.failed_cases, "skipped": dict(self.skipped)}


def _resolve(ref):
    mod_name, qualname = ref
    obj = importlib.import_module(mod_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


_RANK_PROCESSES = None


def _rank_processes():
    """The multiprocessing context ranks start from: a fork server that imported torch once.
    Importing torch costs seconds of CPU per process, most of a short test's time on 2 cores;
    a rank forked from the server starts with torch loaded (no thread started and no device
    initialised by the import, so forking is safe). What torch reads from the environment at
    import, the rank re-reads after taking its own environment (``_rank_main``)."""
    import multiprocessing as mp

    global _RANK_PROCESSES
    if _RANK_PROCESSES is None:
        # The server's own environment: what every rank gets before its own (OpenMP reads
        # OMP_NUM_THREADS when torch loads it).
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        _RANK_PROCESSES = mp.get_context("forkserver")
        _RANK_PROCESSES.set_forkserver_preload(["torch"])
    return _RANK_PROCESSES


def _rank_main(rank: int, world_size: int, q, payload: bytes) -> None:
    global _CTX
    cfg = pickle.loads(payload)
    os.environ.update(cfg["env"])
    os.environ.setdefault("TORCH_SHOW_CPP_STACKTRACES", "0")
    if "torch.distributed" in sys.modules:  # preloaded by the fork server: read at its import
        sys.modules["torch.distributed"].set_debug_level_from_env()
    stack_file = open(os.path.join(cfg["tmpdir"], f"stacks.rank{rank}.txt"), "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    _CTX = RankContext(rank, world_size, q, cfg)
    dist = None
    try:
        q.put(("progress", rank, "<import torch>"))
        import torch  # noqa: F401
        import torch.distributed as dist

        if cfg["setup"] is not None:
            q.put(("progress", rank, f"<setup {cfg['setup'][1]}>"))
            _resolve(cfg["setup"])()
        backend = cfg["backend"]
        if cfg["import_backend"] and "xccl_rs" in backend:
            import xccl_rs  # noqa: F401  (registers the backend)
        fn = _resolve(cfg["fn"])
        args, kwargs = pickle.loads(cfg["args"])
        timeout = datetime.timedelta(seconds=cfg["pg_timeout_s"])
        q.put(("progress", rank, f"<init_process_group {cfg['init']}>"))
        if cfg["init"] == "store":
            store = dist.TCPStore(
                "127.0.0.1",
                cfg["store_port"],
                world_size,
                False,
                timeout=datetime.timedelta(seconds=max(cfg["pg_timeout_s"], 30)),
            )
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=world_size, timeout=timeout
            )
        elif cfg["init"] == "env":
            dist.init_process_group(backend, timeout=timeout)
        elif cfg["init"] != "none":
            raise ValueError(f"bad init mode {cfg['init']!r}")
        q.put(("progress", rank, f"<{cfg['fn'][1]}>"))
        result = fn(rank, world_size, *args, **kwargs)
        try:
            msg = ("result", rank, pickle.dumps(result))
        except Exception:  # noqa: BLE001
            msg = ("error", rank, "could not pickle the result:\n" + traceback.format_exc())
    except BaseException:  # noqa: BLE001
        msg = ("error", rank, traceback.format_exc())
    q.put(msg)
    if cfg["destroy"] and dist is not None:
        try:
            if dist.is_initialized():
                q.put(("progress", rank, "<destroy_process_group>"))
                dist.destroy_process_group()
        except BaseException:  # noqa: BLE001
            q.put(("shutdown_error", rank, traceback.format_exc()))
    q.put(("progress", rank, "<interpreter exit>"))
    q.put(("exited", rank, None))
    q.close()
    q.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()


# --------------------------------------------------------------------------------------
# parent side
# --------------------------------------------------------------------------------------


class RunResult:
    def __init__(self, world_size, fn_name, backend, timeout_s, expect_fail_ranks):
        self.world_size = world_size
        self.fn_name = fn_name
        self.backend = backend
        self.timeout_s = timeout_s
        self.expect_fail_ranks = set(expect_fail_ranks)
        self.results: dict[int, object] = {}
        self.errors: dict[int, str] = {}
        self.failures: list[tuple[int, str, str]] = []  # (rank, case, msg)
        self.notes: list[str] = []
        self.partials: dict[int, dict] = {}
        self.last_case: dict[int, str] = {}
        self.exited: set[int] = set()
        self.exitcodes: dict[int, int | None] = {}
        self.missing: dict[int, str] = {}  # rank -> why it did not report
        self.shutdown_problems: dict[int, str] = {}
        self.stacks: dict[int, str] = {}
        self.elapsed = 0.0

    # --- queries -------------------------------------------------------------------
    def reported(self, rank) -> bool:
        return rank in self.results or rank in self.errors

    def rank_problems(self, include_expected=False) -> list[str]:
        out = []
        for r in range(self.world_size):
            if r in self.expect_fail_ranks and not include_expected:
                continue
            if r in self.errors:
                out.append(f"rank {r} raised:\n{_indent(self.errors[r])}")
            elif r in self.missing:
                s = f"rank {r}: {self.missing[r]}"
                if r in self.stacks:
                    s += f"\n  python stacks at kill time:\n{_indent(self.stacks[r], 4)}"
                out.append(s)
            if r in self.shutdown_problems:
                s = f"rank {r}: {self.shutdown_problems[r]}"
                if r in self.stacks and r not in self.missing:
                    s += f"\n  python stacks at kill time:\n{_indent(self.stacks[r], 4)}"
                out.append(s)
        return out

    def case_failures(self, prefix: str | tuple[str, ...] | None = None) -> list[str]:
        """Failures grouped by identical message: '[ranks 0,2] case: msg', or for a
        message shared by several cases '[ranks ...] N cases: c1, c2, ...' + the message."""
        by_msg: dict[str, dict[str, set]] = {}
        for rank, case, msg in self.failures:
            if prefix is not None and not case.startswith(prefix):
                continue
            by_msg.setdefault(msg, {}).setdefault(case, set()).add(rank)
        lines = []
        for msg, cases in by_msg.items():
            ranks = sorted(set().union(*cases.values()))
            rs = ",".join(map(str, ranks))
            if len(cases) == 1:
                (case,) = cases
                lines.append(f"[ranks {rs}] {case}: {msg}")
            else:
                names = list(cases)
                shown = ", ".join(names[:25]) + (f", ... (+{len(names) - 25})" if len(names) > 25 else "")
                lines.append(f"[ranks {rs}] {len(names)} cases: {shown}\n  -> {msg}")
        return lines

    def n_failing_cases(self, prefix=None) -> int:
        return len({c for _, c, _ in self.failures if prefix is None or c.startswith(prefix)})

    def report(self, prefix=None, max_lines: int = 400) -> str | None:
        probs = self.rank_problems()
        fails = self.case_failures(prefix)
        if not probs and not fails:
            return None
        head = (
            f"run failed: fn={self.fn_name} world_size={self.world_size} "
            f"backend={self.backend} elapsed={self.elapsed:.1f}s (deadline {self.timeout_s:.0f}s)"
        )
        parts = [head]
        if fails:
            shown = fails[:max_lines]
            parts.append(f"{self.n_failing_cases(prefix)} failing case(s):")
            parts.extend("  " + _indent(f, 4).lstrip() for f in shown)
            if len(fails) > len(shown):
                parts.append(f"  ... and {len(fails) - len(shown)} more")
        parts.extend(probs)
        if self.notes:
            parts.append("notes: " + "; ".join(sorted(set(self.notes))))
        return "\n".join(parts)

    def check(self, prefix=None) -> "RunResult":
        rep = self.report(prefix)
        if rep:
            raise AssertionError(rep)
        return self

    def value(self, rank):
        return self.results.get(rank)

    def assert_no_problems(self, who: str = "") -> None:
        """Fails unless every rank's value, the list of problems it found, is empty (``who``
        leads each rank's lines)."""
        problems = [f"{who}rank {r}: {p}" for r in range(self.world_size) for p in self.value(r)]
        assert not problems, "\n".join(problems)


def _indent(text: str, n: int = 2) -> str:
    pad = " " * n
    return "\n".join(pad + line for line in str(text).rstrip().splitlines())


def run_ranks(
    world_size: int,
    fn,
    *args,
    backend: str | None = None,
    timeout_s: float = 120.0,
    pg_timeout_s: float | None = None,
    env: dict | None = None,
    rank_env=None,
    init: str = "store",
    expect_fail_ranks=(),
    import_backend: bool = True,
    destroy: bool = True,
    check: bool = True,
    fail_grace_s: float | None = None,
    shutdown_grace_s: float = 15.0,
    setup=None,
    **kwargs,
) -> RunResult:
    """Run fn(rank, world_size, *args, **kwargs) on world_size spawned ranks.

    backend: backend string passed to init_process_group (default: the backend under
      test, $XCCL_RS_TEST_BACKEND). Workers ``import xccl_rs`` first when the string
      mentions xccl_rs, unless import_backend=False (autoload test).
    timeout_s: hard deadline of the whole run (spawn + init + fn + shutdown).
    pg_timeout_s: init_process_group(timeout=...).
    init: "store" (TCPStore served by the parent), "env" (env://, MASTER_ADDR/PORT,
      RANK, WORLD_SIZE set) or "none" (fn initialises; ctx().connect_store() helps).
    rank_env: a function of the rank returning more environment for that rank only (applied
      after ``env``), e.g. a per-rank XCCL_RS_HOST_ID.
    expect_fail_ranks: ranks allowed to raise / die without reporting (e.g. os._exit).
    setup: a function, or its (module, qualname), each rank calls with no arguments after
      importing torch and before importing xccl_rs and initialising (e.g. the emulated XPU,
      xpu_emu.ACTIVATE).
    check: raise AssertionError listing every problem (default); otherwise return the
      RunResult for the caller to inspect (result.report(prefix)).
    """
    import multiprocessing as mp

    backend = BACKEND if backend is None else backend
    pg_timeout_s = DEFAULT_PG_TIMEOUT_S if pg_timeout_s is None else pg_timeout_s
    timeout_s = timeout_s * DEADLINE_SCALE
    if fail_grace_s is None:
        fail_grace_s = min(pg_timeout_s + 10.0, 40.0)
    fn_ref = (fn.__module__, fn.__qualname__)
    setup_ref = setup if setup is None or isinstance(setup, tuple) else (setup.__module__, setup.__qualname__)
    if fn_ref[0] == "__main__":
        raise ValueError("run_ranks needs a function importable by module name")
    tmpdir = tempfile.mkdtemp(prefix="xccl_rs_test_")

    store = None
    store_port = None
    master_port = free_port()
    if init in ("store", "none"):
        import torch.distributed as dist

        store = dist.TCPStore(
            "127.0.0.1",
            0,
            None,
            True,
            timeout=datetime.timedelta(seconds=max(timeout_s, 60)),
            wait_for_workers=False,
        )
        store_port = store.port

    ctx_mp = _rank_processes()
    q = ctx_mp.Queue()
    procs = []
    res = RunResult(world_size, f"{fn_ref[0]}.{fn_ref[1]}", backend, timeout_s, expect_fail_ranks)
    t0 = time.monotonic()
    try:
        for rank in range(world_size):
            child_env = {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(master_port),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_WORLD_SIZE": str(world_size),
                "OMP_NUM_THREADS": "1",
                "XCCL_RS_TEST_BACKEND": BACKEND,
            }
            child_env.update(env or {})
            child_env.update(rank_env(rank) if rank_env else {})
            cfg = {
                "fn": fn_ref,
                "args": pickle.dumps((args, kwargs)),
                "backend": backend,
                "is_gloo": IS_GLOO,
                "env": child_env,
                "init": init,
                "pg_timeout_s": pg_timeout_s,
                "store_port": store_port,
                "master_port": master_port,
                "import_backend": import_backend,
                "destroy": destroy,
                "tmpdir": tmpdir,
                "setup": setup_ref,
            }
            p = ctx_mp.Process(
                target=_rank_main,
                args=(rank, world_size, q, pickle.dumps(cfg)),
                name=f"xccl_rs_test_rank{rank}",
                daemon=True,
            )
            p.start()
            procs.append(p)
        _supervise(res, procs, q, t0, timeout_s, fail_grace_s, shutdown_grace_s, tmpdir)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)
        q.close()
        q.cancel_join_thread()
        del store
    res.elapsed = time.monotonic() - t0
    if check:
        res.check()
    return res


def _supervise(res, procs, q, t0, timeout_s, fail_grace_s, shutdown_grace_s, tmpdir):
    ws = len(procs)
    deadline = t0 + timeout_s
    all_reported_at = None
    dead_unreported_seen: dict[int, float] = {}

    def handle(msg):
        kind, rank, data = msg
        if kind == "progress":
            res.last_case[rank] = data
        elif kind == "fail":
            res.failures.append((rank, data[0], data[1]))
        elif kind == "partial":
            res.partials.setdefault(rank, {})[data[0]] = pickle.loads(data[1])
        elif kind == "note":
            res.notes.append(data)
        elif kind == "result":
            try:
                res.results[rank] = pickle.loads(data)
            except Exception:  # noqa: BLE001
                res.errors[rank] = "could not unpickle result:\n" + traceback.format_exc()
        elif kind == "error":
            res.errors[rank] = data
        elif kind == "shutdown_error":
            res.shutdown_problems[rank] = f"destroy_process_group raised:\n{_indent(data)}"
        elif kind == "exited":
            res.exited.add(rank)

    def unexpected_problem() -> bool:
        for r in range(ws):
            if r in res.expect_fail_ranks:
                continue
            if r in res.errors or r in res.missing:
                return True
        return False

    while True:
        now = time.monotonic()
        try:
            handle(q.get(timeout=0.05))
            while True:
                handle(q.get_nowait())
        except queue_mod.Empty:
            pass
        except (EOFError, OSError):
            pass
        now = time.monotonic()
        # processes that died
        for r, p in enumerate(procs):
            if p.exitcode is None or r in res.exited:
                continue
            if r not in dead_unreported_seen:
                dead_unreported_seen[r] = now  # give the queue a moment to deliver
                continue
            if now - dead_unreported_seen[r] > 0.5 and r not in res.missing:
                if res.reported(r):
                    res.shutdown_problems[r] = (
                        f"process died during shutdown (exit code {p.exitcode}) "
                        f"in {res.last_case.get(r)!r}"
                    )
                    res.exited.add(r)
                else:
                    res.missing[r] = (
                        f"process exited with code {p.exitcode} without reporting "
                        f"(last progress: {res.last_case.get(r)!r})"
                    )
        if unexpected_problem():
            deadline = min(deadline, now + fail_grace_s)
        everyone_reported = all(res.reported(r) or r in res.missing for r in range(ws))
        if everyone_reported and all_reported_at is None:
            all_reported_at = now
            # ranks that reported get a bounded time to shut down (may pass the deadline)
            deadline = now + shutdown_grace_s
        everyone_gone = all(p.exitcode is not None for p in procs)
        if everyone_reported and everyone_gone:
            break
        if now >= deadline:
            break
    # dump the stacks of the survivors, then kill them
    alive = [(r, p) for r, p in enumerate(procs) if p.exitcode is None]
    for r, p in alive:
        with contextlib.suppress(Exception):
            os.kill(p.pid, signal.SIGUSR1)
    if alive:
        time.sleep(0.7)
    for r, p in alive:
        with contextlib.suppress(Exception):
            p.kill()
    for r, p in alive:
        p.join(5)
    # last drain
    with contextlib.suppress(queue_mod.Empty, EOFError, OSError):
        while True:
            handle(q.get(timeout=0.2))
    for r, p in alive:
        path = os.path.join(tmpdir, f"stacks.rank{r}.txt")
        with contextlib.suppress(OSError):
            with open(path) as f:
                text = f.read().strip()
            if text:
                res.stacks[r] = _trim_stack(text)
        if not res.reported(r) and r not in res.missing:
            res.missing[r] = (
                f"killed at the deadline ({time.monotonic() - t0:.1f}s after start) "
                f"while in {res.last_case.get(r)!r}"
            )
        elif res.reported(r) and r not in res.exited and r not in res.shutdown_problems:
            res.shutdown_problems[r] = (
                f"reported its result but did not exit within {shutdown_grace_s:.0f}s "
                f"(stuck in {res.last_case.get(r)!r})"
            )
    for r, p in enumerate(procs):
        res.exitcodes[r] = p.exitcode


def _trim_stack(text: str, max_lines: int = 80) -> str:
    lines = text.splitlines()
    if len(lines) > max_lines:
        lines = lines[:max_lines] + [f"... ({len(lines) - max_lines} more lines)"]
    return "\n".join(lines)
