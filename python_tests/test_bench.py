"""`python -m xccl_rs.bench` in nccl-tests' shape (issue 36): the header with its units, the
out-of-place and in-place columns with #wrong, the closing lines (wrong elements; average bus
bandwidth with the per-iteration min, median and max), --json with every iteration's time, and
--plot. The check behind #wrong is tested twice: its reference on hand-made wrong results (no
processes), and a whole run whose results rank 0 corrupts (the hidden `--inject wrong`), which
must count them and exit 1. Last, the soak's progress (a tqdm bar on a terminal, lines in a log).

Benchmarks are not tests (DESIGN.md): nothing here judges a speed, only what is printed and
checked. Runs are 2 ranks, one or two small sizes, 40 iterations (--scale 0.01)."""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import re
import statistics
import subprocess
import sys

import pytest
import torch

from harness import IS_XCCL

from xccl_rs import bench

AVG_LINE = re.compile(
    r"^# Avg bus bandwidth\s*: (\S+)\s+([\d.]+) GB/s  \(per iteration: min ([\d.]+), median ([\d.]+), max ([\d.]+); "
    r"mean over (\d+) results\)$", re.M)


def run_bench(tmp_path, *args: str) -> tuple[int, str, dict]:
    out = tmp_path / "bench.json"
    env = dict(os.environ, XCCL_RS_LOG="off", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "xccl_rs.bench", "--ranks", "2", "--scale", "0.01", "--json", str(out), *args],
                       capture_output=True, text=True, timeout=180, env=env, cwd=str(tmp_path))
    data = json.loads(out.read_text()) if out.exists() else {}
    return p.returncode, p.stdout + p.stderr[-3000:], data


def data_lines(text: str) -> list[list[str]]:
    """The table's result lines, split into cells (lines not starting with '#')."""
    return [line.split() for line in text.splitlines() if line.strip() and not line.startswith("#")]


@pytest.mark.skipif(not IS_XCCL, reason="times the xccl_rs backend")
def test_table_closing_lines_and_json(tmp_path):
    rc, out, data = run_bench(tmp_path, "--ops", "all_reduce", "all_gather", "reduce_scatter", "--dtypes", "float32",
                              "--sizes", "8", "64K", "--backends", "gloo", "xccl_rs")
    assert rc == 0, out
    lines = out.splitlines()
    # The header: the two modes over the columns, the columns, their units.
    i = next(n for n, line in enumerate(lines) if "out-of-place" in line)
    modes, names, units = lines[i:i + 3]
    assert modes.index("out-of-place") < modes.index("in-place"), modes
    assert names.split()[1:] == ["size", "count", "type", "redop", "root", "backend",
                                 "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong", "vs", "gloo"], names
    assert units.split()[1:] == ["(B)", "(elements)", "(us)", "(GB/s)", "(GB/s)", "(us)", "(GB/s)", "(GB/s)", "(x)"], units
    # torch's all_reduce is in place, and the table says so.
    assert "# all_reduce, ReduceOp.SUM: torch's all_reduce is in place (in-place columns only)" in lines, out

    rows = data_lines(out)
    assert len(rows) == 3 * 2 * 2, out  # ops x sizes x backends
    for cells in rows:
        size, count, dtype, redop, root, backend = cells[:6]
        oop, inp = cells[6:10], cells[10:14]
        assert dtype == "float32" and backend in ("gloo", "xccl_rs") and int(size) == 4 * int(count), cells
        assert inp[3] == "0", cells  # #wrong
        if redop == "sum" and root == "-1" and oop == ["-"] * 4:  # all_reduce: in place only
            continue
        assert oop[3] == "0", cells
        if backend == "xccl_rs":
            assert float(cells[14]) > 0, cells  # vs gloo

    # The closing lines: nothing wrong; per backend the average busbw and its spread.
    assert "# Wrong elements       : 0 OK" in lines, out
    avgs = {m.group(1): m.groups()[1:] for m in AVG_LINE.finditer(out)}
    assert set(avgs) == {"gloo", "xccl_rs"}, out
    for b, (avg, lo, med, hi, n) in avgs.items():
        assert float(lo) <= float(med) <= float(hi) and float(avg) > 0, (b, avgs[b])
        assert int(n) == 2 * (1 + 2 + 2), (b, n)  # sizes x (all_reduce in place; the others both modes)

    # --json: every field, every iteration's time.
    assert data["ranks"] == 2 and data["check"] is True
    results = 0
    for row in data["rows"]:
        n = row["ranks"]
        factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n}[row["op"]]
        for key in ("op", "dtype", "bytes", "size", "count", "redop", "root", "iters"):
            assert key in row, (key, row)
        for b in ("gloo", "xccl_rs"):
            e = row[b]
            assert e["wrong"] == 0, (b, row)
            assert (e["out_of_place"] is None) == (row["op"] == "all_reduce"), (b, row["op"])
            for mode in bench.MODES:
                r = e[mode]
                if r is None:
                    continue
                results += 1
                assert len(r["times_us"]) == row["iters"] and 0 <= r["slowest_rank"] < n, r
                assert math.isclose(r["time_us"], statistics.fmean(r["times_us"]))
                assert math.isclose(r["algbw_GBps"], row["size"] / r["time_us"] / 1e3)
                assert math.isclose(r["busbw_GBps"], r["algbw_GBps"] * factor)  # nccl-tests' formulas
                busbws = [row["size"] / t / 1e3 * factor for t in r["times_us"]]
                assert math.isclose(r["busbw_GBps_min"], min(busbws)) and math.isclose(r["busbw_GBps_max"], max(busbws))
                assert math.isclose(r["busbw_GBps_median"], statistics.median(busbws))
                assert r["wrong"] == 0
            main = e["in_place"] if row["op"] == "all_reduce" else e["out_of_place"]
            assert e["time_us"] == main["time_us"], (b, row["op"])  # the main mode's, as before
        assert math.isclose(row["speedup"], row["gloo"]["time_us"] / row["xccl_rs"]["time_us"])
    assert results == 2 * 10
    s = data["summary"]
    assert s["wrong"] == 0 and s["checked"] and set(s["backends"]) == {"gloo", "xccl_rs"}
    for b, v in s["backends"].items():
        assert f"{v['avg_busbw_GBps']:.3f}" == avgs[b][0], (b, v, avgs[b])


@pytest.mark.skipif(not IS_XCCL, reason="times the xccl_rs backend")
def test_wrong_results_are_counted_and_fail_the_run(tmp_path):
    """rank 0 adds 100 to the first element of every result after the checked call (the hidden
    --inject wrong): every #wrong is 1, the closing line says FAILED, the exit status is 1."""
    rc, out, data = run_bench(tmp_path, "--ops", "broadcast", "reduce_scatter", "--dtypes", "bfloat16",
                              "--sizes", "64K", "--backends", "xccl_rs", "--inject", "wrong")
    assert rc == 1, out
    rows = data_lines(out)
    assert len(rows) == 2, out
    assert rows[0][6:10] == ["-"] * 4 and rows[0][13] == "1", rows[0]  # broadcast: in place only
    assert rows[1][9] == "1" and rows[1][13] == "1", rows[1]  # reduce_scatter: both modes
    assert re.search(r"^# Wrong elements       : 3 FAILED in 3 results: ", out, re.M), out
    assert data["summary"]["wrong"] == 3 and [r["xccl_rs"]["wrong"] for r in data["rows"]] == [1, 2]


# ---------------------------------------------------------------- the reference, without processes


def cases(op: str, mode: str, world: int, nbytes: int = 1000, dtype=torch.float32) -> list[bench.Case]:
    """Every rank's Case of one op (CPU tensors, no group), inputs filled from their seeds."""
    out = [bench.Case(op, mode, nbytes, dtype, r, world, torch.device("cpu")) for r in range(world)]
    for c in out:
        c.fill()
    return out


def correct(cs: list[bench.Case]) -> None:
    """Writes into each rank's output what the op must give, computed here from the ranks' real
    inputs (not from Case.expected)."""
    op, world = cs[0].op, len(cs)
    inputs = [c.inp.double().clone() for c in cs]
    for c in cs:
        if op in ("all_reduce", "all_reduce_avg"):
            ref = torch.stack(inputs).sum(0) / (world if op == "all_reduce_avg" else 1)
        elif op == "broadcast":
            ref = inputs[0]
        elif op == "all_gather":
            ref = torch.cat(inputs)
        else:
            ref = torch.stack(inputs).sum(0)[c.rank * c.per:(c.rank + 1) * c.per]
        c.out.copy_(ref.to(c.dtype))


@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("op", bench.OPS)
def test_the_reference_accepts_right_results(op, world):
    for mode in bench.modes(op):
        for dtype in bench.DTYPES.values():
            cs = cases(op, mode, world, dtype=dtype)
            correct(cs)
            assert [c.wrong() for c in cs] == [0] * world, (op, mode, dtype)


def test_the_reference_catches_wrong_results():
    # Nothing written: the output is NaN (or, in place, the rank's own input).
    for op in bench.OPS:
        for mode in bench.modes(op):
            cs = cases(op, mode, 3)
            assert sum(c.wrong() for c in cs) > 0, (op, mode)
    # all_gather with two ranks' slots swapped.
    cs = cases("all_gather", "out_of_place", 3)
    correct(cs)
    per = cs[0].per
    a = cs[1].out[:per].clone()
    cs[1].out[:per] = cs[1].out[per:2 * per]
    cs[1].out[per:2 * per] = a
    assert cs[1].wrong() > per // 2 and cs[0].wrong() == 0
    # reduce_scatter giving a rank another rank's share.
    cs = cases("reduce_scatter", "out_of_place", 3)
    correct(cs)
    cs[2].out.copy_(cs[1].out)
    assert cs[2].wrong() > cs[2].per // 2
    # AVG given as SUM; and one element off by one.
    cs = cases("all_reduce", "in_place", 3)
    correct(cs)
    sums = cs[0].out.clone()
    avg = cases("all_reduce_avg", "in_place", 3)
    avg[0].out.copy_(sums)
    assert avg[0].wrong() > avg[0].count // 2
    cs[0].out[7] += 1
    assert cs[0].wrong() == 1
    # broadcast from the wrong root.
    cs = cases("broadcast", "in_place", 2)
    correct(cs)
    cs[1].out.copy_(bench.pattern(cs[1].keys[1], 0, cs[1].count, cs[1].amplitude))
    assert cs[1].wrong() > cs[1].count // 2


def test_avg_allows_one_rounding_only():
    """AVG in bfloat16 at 3 ranks, an element whose exact value is 4/3: the nearest bfloat16
    (1.3359375) passes, and so does the other one around 4/3 (1.328125: an fp32 accumulator
    rounded again may give it); the next one (1.3203125) does not."""
    cs = cases("all_reduce_avg", "in_place", 3, nbytes=4096, dtype=torch.bfloat16)
    correct(cs)
    c = cs[0]
    assert c.wrong() == 0
    exact = torch.stack([bench.pattern(k, 0, c.count, c.amplitude) for k in c.keys]).sum(0)
    i = int(torch.nonzero(exact == 4).flatten()[0])
    assert c.out[i].item() == 1.3359375
    c.out[i] = 1.328125
    assert c.wrong() == 0
    c.out[i] = 1.3203125
    assert c.wrong() == 1


def test_inputs_depend_on_rank_and_size():
    a = bench.Case("all_reduce", "in_place", 4096, torch.float32, 0, 2, torch.device("cpu"))
    b = bench.Case("all_reduce", "in_place", 4096, torch.float32, 1, 2, torch.device("cpu"))
    c = bench.Case("all_reduce", "in_place", 8192, torch.float32, 0, 2, torch.device("cpu"))
    for x in (a, b, c):
        x.fill()
    assert not torch.equal(a.inp, b.inp) and not torch.equal(a.inp, c.inp[:a.count])
    values = set(a.inp.tolist())
    assert values <= set(range(-4, 5)) and len(values) == 9, values


# ---------------------------------------------------------------- --plot and --help


def test_plot_without_matplotlib_says_so(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(SystemExit) as e:
        bench.main(["--plot", "out.png"])
    assert e.value.code == 2
    assert "--plot needs matplotlib, which is not installed here (pip install matplotlib)" in capsys.readouterr().err


def test_plot_draws_every_backend(tmp_path):
    pytest.importorskip("matplotlib")
    rows = []
    for op in ("all_reduce", "all_gather"):
        for size in (8, 65536, 1 << 20):
            row = {"op": op, "dtype": "float32", "size": size}
            for b, bw in (("gloo", 1.0), ("xccl_rs", 4.0)):
                r = {"busbw_GBps": bw * size / (1 << 20)}
                row[b] = {"out_of_place": None if op == "all_reduce" else r, "in_place": r}
            rows.append(row)
    path = tmp_path / "busbw.png"
    bench.plot(str(path), rows, ["gloo", "xccl_rs"])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_help_names_the_columns_and_options():
    p = subprocess.run([sys.executable, "-m", "xccl_rs.bench", "--help"], capture_output=True, text=True, timeout=120,
                       cwd="/tmp")
    assert p.returncode == 0, p.stderr
    out = " ".join(p.stdout.split())
    for text in ("#wrong", "time the slowest rank's mean time per iteration", "busbw algbw * the op's bus factor",
                 "all_reduce 2(n-1)/n, broadcast 1, all_gather and reduce_scatter (n-1)/n", "--no-check",
                 "--plot PNG", "--json PATH", "per-iteration min, median and max busbw"):
        assert text in out, (text, p.stdout)
    assert "--inject" not in out  # hidden: it tests the benchmark itself


# ---------------------------------------------------------------- progress of long work (the soak)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_soak_progress_is_a_bar_on_a_terminal_and_lines_otherwise(monkeypatch):
    from xccl_rs import soak

    args = argparse.Namespace(seconds=None, ops_per_group=100, interval=0.5, progress=5.0)
    report = {"ops": 150, "seconds": 3.0, "rss": 700 << 20}
    log = io.StringIO()  # not a terminal: a line per report, every --progress seconds
    monkeypatch.setattr(sys, "stdout", log)
    p = soak.Progress(args)
    p.update(report)
    p.close(300)
    assert p.every == 5.0 and log.getvalue() == "      150 ops      3.0 s     50.0 ops/s  rank 0 RSS 700 MiB\n"

    pytest.importorskip("tqdm")
    term = _Terminal()  # a terminal: a bar of rank 0's ops, updated at every sample
    monkeypatch.setattr(sys, "stdout", term)
    p = soak.Progress(args)
    p.update(report)
    p.update({**report, "ops": 240})
    p.close(300)
    shown = term.getvalue().split("\r")
    assert p.every == 0.5
    assert any("soak:" in s and "240/300" in s and "rank 0 RSS 700 MiB" in s for s in shown), shown
    assert any("300/300" in s for s in shown), shown
