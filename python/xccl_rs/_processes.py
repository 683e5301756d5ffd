"""The processes of the demo and the benchmarks, all on this host: a free port for their store,
the messages they report through a shared queue, the calls they answer over a pipe, and their
end."""

from __future__ import annotations

import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def messages(procs, queue) -> Iterator[tuple]:
    """The processes' messages (tuples) from ``queue`` as they come, until each process has
    sent its ``("done", ...)``, or one of them exited with an error (:func:`join_all` then says
    which)."""
    done = 0
    while done < len(procs):
        if queue.empty():
            if any(proc.exitcode not in (None, 0) for proc in procs):
                return
            time.sleep(0.05)
            continue
        msg = queue.get()
        if msg[0] == "done":
            done += 1
        else:
            yield msg


def join_all(procs, what: str) -> bool:
    """Joins the processes; when one failed, kills those left and says which failed (stderr).
    True when all exited with 0."""
    for proc in procs:
        proc.join(timeout=30)
    failed = [i for i, proc in enumerate(procs) if proc.exitcode != 0]
    if failed:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        print(f"{what} FAILED: processes {failed} exited with codes {[procs[i].exitcode for i in failed]}", file=sys.stderr)
    return not failed


def answer_calls(conn, calls: Callable[[str], Callable], on_exit: Callable[[], object] = lambda: None) -> None:
    """Answers each ``(method, args)`` that comes through the pipe ``conn`` with ``("ok",
    calls(method)(*args))``, or ``("error", text)`` when that raised, until ``("exit", ...)``
    (answered once ``on_exit()`` returned) or the other end closed."""
    while True:
        try:
            method, args = conn.recv()
        except EOFError:
            return
        if method == "exit":
            on_exit()
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", calls(method)(*args)))
        except BaseException as e:  # noqa: BLE001 (the caller is told, whatever it was)
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
