"""Process-level faults. `perfmodel sweep --out` killed with SIGKILL or SIGTERM at random points,
50 times: the output is each time the old file, the whole new file, or absent (when there was no
old one), with no temporary file beside it (a SIGKILL at the final rename leaves the whole new
content under a hidden name of the killed process, which the next write of the path removes) and
no worker process left behind; SIGTERM and SIGINT end with one line and exit status 143 / 130 (a
SIGTERM before Python has started the CLI kills outright, status -15, nothing printed). Ctrl-C
lands anywhere in a long sweep 20 times out of 20, compiled loops included, and ends it with one
line, status 130 and no file (or, once the output is committed, the command ends as it would
have). A stdout that cannot be written is an input error naming it; a Ray address nobody
answers at is refused at once.

Runs go five at a time in their own folders: the 50 kills take about 50 s on 2 cores at a load
average of 12 (`slow` tier, make test-all); the fast tier kills 10 times (about 15 s)."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

RUNS = 50
SWEEP = [sys.executable, "-m", "perfmodel.cli", "sweep", "--model", "kimi-k3-mini", "--devices", "1",
         "--vary", "batch=" + ",".join(map(str, range(1, 11))), "--vary", "context=0,64,512,4096",
         "--no-progress", "--json"]
POINTS = 40
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def group_alive(pgid: int) -> list[int]:
    """Processes still in process group `pgid` (the sweep and any worker it started)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(d.name))
    return out


def whole(path: Path) -> bool:
    """The file holds every row of the sweep, complete."""
    if path.suffix == ".csv":
        lines = path.read_text().splitlines()
        return len(lines) == POINTS + 1 and lines[0].startswith("point,") and lines[-1].count(",") == lines[0].count(",")
    import pyarrow.parquet as pq
    return pq.read_table(path).num_rows == POINTS


def one_run(i: int, root: Path, duration_s: float) -> dict:
    rng = random.Random(i)
    d = root / f"run{i}"
    d.mkdir()
    out = d / ("rows.csv" if i % 2 else "rows.parquet")
    old = b"old content\n" if i % 3 else None  # a third of the runs start with no file
    if old is not None:
        out.write_bytes(old)
    sig = signal.SIGKILL if i % 2 == 0 else signal.SIGTERM
    jobs = ["--jobs", "2"] if i % 5 == 0 else ["--jobs", "1"]
    err_file = root / f"run{i}.stderr"  # not a pipe: a worker left behind would hold it open
    with open(err_file, "wb") as err:
        p = subprocess.Popen(SWEEP + jobs + ["--out", str(out)], stdout=subprocess.DEVNULL, stderr=err,
                             env=ENV, start_new_session=True)
    time.sleep(rng.uniform(0, duration_s * 1.1))
    p.send_signal(sig)
    p.wait(timeout=120)
    err = err_file.read_bytes()
    deadline = time.time() + (5 if sig == signal.SIGKILL else 0.5)  # a killed pool's workers notice within 0.5 s
    while group_alive(p.pid) and time.time() < deadline:
        time.sleep(0.2)
    state = ("absent" if not out.exists() else "old" if out.read_bytes() == old else
             "new" if whole(out) else "PARTIAL")
    others = sorted(f.name for f in d.iterdir() if f != out)
    stale = []
    if others and sig == signal.SIGKILL:  # killed at the final rename: the next write removes it
        from perfmodel.util.files import remove_stale_temporaries
        if all(n.startswith(f".{out.name}.{p.pid}.") and n.endswith(".tmp") for n in others):
            stale = others
            remove_stale_temporaries(out)
            others = sorted(f.name for f in d.iterdir() if f != out)
    return {"run": i, "signal": sig.name, "rc": p.returncode, "stderr": err.decode(), "state": state,
            "had_old": old is not None, "others": others, "stale": stale, "left": group_alive(p.pid)}


@pytest.fixture(scope="module")
def duration_s(tmp_path_factory) -> float:
    """How long one whole sweep takes here (the kill points are drawn over it)."""
    out = tmp_path_factory.mktemp("ref") / "rows.csv"
    t = time.perf_counter()
    subprocess.run(SWEEP + ["--jobs", "1", "--out", str(out)], check=True, capture_output=True, env=ENV)
    assert whole(out)
    return time.perf_counter() - t


@pytest.mark.parametrize("n", [pytest.param(RUNS, marks=pytest.mark.slow), 10])
def test_kill_sweep_out(tmp_path, duration_s, n):
    with ThreadPoolExecutor(5) as pool:
        runs = list(pool.map(lambda i: one_run(i, tmp_path, duration_s), range(n)))
    states = {}
    for r in runs:
        states[r["state"]] = states.get(r["state"], 0) + 1
        assert r["state"] in (("old", "new") if r["had_old"] else ("absent", "new")), r
        assert r["others"] == [], r  # no temporary file (a killed process's: removed by the next write)
        assert not r["stale"] or (r["signal"] == "SIGKILL" and r["state"] in ("old", "new")), r
        assert r["left"] == [], r    # no worker left behind
        if r["signal"] == "SIGTERM" and r["state"] != "new":  # (killed outright before Python ran the CLI)
            assert (r["rc"], r["stderr"].strip()) in ((128 + signal.SIGTERM, "perfmodel sweep: terminated"),
                                                      (-signal.SIGTERM, "")), r
        if r["signal"] == "SIGKILL" and r["state"] != "new":
            assert r["rc"] == -signal.SIGKILL, r
    print(f"\n{n} kills over a {duration_s:.1f} s sweep: {states}")
    assert states.get("old", 0) + states.get("absent", 0) > 0  # some kills landed mid-run


# a sweep of 10,000 points (multi-kernel points one by one, megakernel ones batched in compiled
# loops): about 6 s on one core of the 2-core VM, longer under load, so a Ctrl-C lands mid-run
LONG_SWEEP = [sys.executable, "-m", "perfmodel.cli", "sweep", "--model", "kimi-k3-mini", "--devices", "1",
              "--vary", "batch=" + ",".join(map(str, range(1, 101))),
              "--vary", "context=" + ",".join(str(64 * k) for k in range(50)),
              "--vary", "engine=megakernel,multikernel", "--no-progress", "--json"]


def handlers_installed(pid: int, timeout_s: float = 60) -> bool:
    """Wait until process `pid` catches SIGHUP (perfmodel.util.interrupts.install: the CLI runs);
    False if it ended first."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return False
        caught = int(next(l.split()[1] for l in status.splitlines() if l.startswith("SigCgt:")), 16)
        if caught & (1 << (signal.SIGHUP - 1)):
            return True
        time.sleep(0.02)
    return False


def one_sigint(i: int, root: Path) -> dict:
    rng = random.Random(1000 + i)
    d = root / f"int{i}"
    d.mkdir()
    out = d / ("rows.csv" if i % 2 else "rows.parquet")
    err_file = root / f"int{i}.stderr"
    with open(err_file, "wb") as err:
        p = subprocess.Popen(LONG_SWEEP + ["--jobs", "2" if i % 3 == 0 else "1", "--out", str(out)],
                             stdout=subprocess.DEVNULL, stderr=err, env=ENV, start_new_session=True)
    if handlers_installed(p.pid):
        time.sleep(rng.uniform(0.0, 2.0))
    os.killpg(p.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole process group
    p.wait(timeout=300)
    deadline = time.time() + 3  # multiprocessing's resource tracker exits when its pipe closes
    while group_alive(p.pid) and time.time() < deadline:
        time.sleep(0.2)
    return {"run": i, "rc": p.returncode, "stderr": err_file.read_bytes().decode().strip(),
            "files": sorted(f.name for f in d.iterdir()), "whole": out.exists() and whole_long(out),
            "left": group_alive(p.pid)}


def whole_long(path: Path) -> bool:
    if path.suffix == ".csv":
        return len(path.read_text().splitlines()) == 10_001
    import pyarrow.parquet as pq
    return pq.read_table(path).num_rows == 10_000


def test_sigint_ends_with_one_line_and_130(tmp_path):
    """20 of 20: Ctrl-C at a random moment of a long sweep (five at a time, so under load), with
    one worker or two, CSV or Parquet."""
    with ThreadPoolExecutor(5) as pool:
        runs = list(pool.map(lambda i: one_sigint(i, tmp_path), range(20)))
    interrupted = 0
    for r in runs:
        assert r["left"] == [], r
        if r["rc"] == 0:  # the signal came after the output was committed: whole, and nothing else
            assert r["whole"] and len(r["files"]) == 1 and r["stderr"] == "", r
            continue
        assert r["rc"] == 130 and r["stderr"] == "perfmodel sweep: interrupted" and r["files"] == [], r
        interrupted += 1
    assert interrupted >= 15, runs  # the signals landed mid-run


def test_after_a_signal_a_finalizers_error_stays_off_stderr(capsys):
    """A finalizer's error is reported as Python would until a signal arrives; after it (a numba
    compile cut short leaves llvmlite handles that fail in __del__) it is not: the command's one
    line stands."""
    from perfmodel.util import interrupts

    class HalfBuilt:
        def __del__(self):
            raise AttributeError("_as_parameter_")
    old = interrupts.install()
    try:
        HalfBuilt()   # collected at once: its __del__'s error goes to sys.unraisablehook
        assert "_as_parameter_" in capsys.readouterr().err
        interrupts._state["pending"] = signal.SIGINT
        HalfBuilt()
        assert capsys.readouterr().err == ""
    finally:
        interrupts.restore(old)


def test_an_error_raised_after_a_signal_is_that_signal(monkeypatch, capsys):
    """Ctrl-C inside an extension's import comes out as an ImportError (numpy: "PyCapsule_Import
    could not import module"): once a signal has arrived, the command ends as that signal; an
    error with no signal before it stays an internal error."""
    import perfmodel.cli.predict
    from perfmodel.cli.main import main
    from perfmodel.util import interrupts

    def interrupted_import(_args):
        with interrupts.deferred(check=False):
            os.kill(os.getpid(), signal.SIGINT)
        raise ImportError('PyCapsule_Import could not import module "datetime"')

    def broken(_args):
        raise ImportError("broken")
    for func, code, line in ((interrupted_import, 130, "perfmodel list: interrupted"),
                             (broken, 1, "perfmodel list: internal error: ImportError: broken (please report it; "
                                         "--debug shows the traceback)")):
        monkeypatch.setattr(perfmodel.cli.predict, "configure_list", lambda p, f=func: p.set_defaults(func=f))
        assert main(["list"]) == code
        assert capsys.readouterr().err.strip() == line


COMPILED_LOOP = """
from perfmodel.search.batch import evaluate
from perfmodel.spec.hardware import load_hardware
from perfmodel.spec.loaders import load_model
from perfmodel.util import interrupts
m, hw = load_model("kimi-k3"), load_hardware("tpu-v7")
points = [{"devices": 32, "tp": 32, "ep": 8, "engine": "megakernel", "batch": b, "context": 4096, "draft_rows": 0,
           "draft_cost": 0.05, "prefetch_mib": p, "expert_slots": s}
          for b in (1, 8) for p in range(1, 49) for s in (1, 2, 3, 4)]
evaluate(m, hw, points)  # the op graphs built, the loops compiled: from here on most time is in them
interrupts.install()
print("ready", flush=True)
try:
    while True:
        evaluate(m, hw, points)
except KeyboardInterrupt:
    print("interrupted")
"""


def test_ctrl_c_inside_compiled_loops_is_raised_when_they_return():
    """A Ctrl-C that lands inside a numba-compiled call (its dispatcher between calls into Python)
    is raised when the call returns: KeyboardInterrupt, never a SystemError or a lost signal."""
    def once(i: int) -> str:
        p = subprocess.Popen([sys.executable, "-c", COMPILED_LOOP], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, env=ENV)
        assert p.stdout.readline().strip() == "ready"
        time.sleep(random.Random(i).uniform(0.05, 0.5))
        p.send_signal(signal.SIGINT)
        try:
            out, _ = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            return "hung"
        return out.strip()
    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(once, range(10))) == ["interrupted"] * 10


# ----- outputs that cannot be written, executors that cannot start -------------------------------

def test_stdout_errors_are_input_errors_naming_it():
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "perfmodel.cli", "list", "--json"], stdout=full,
                           stderr=subprocess.PIPE, text=True, env=ENV, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == ("perfmodel list: error: stdout='/dev/full': cannot write: "
                                                      "No space left on device"), r.stderr
    r = subprocess.run(f"{sys.executable} -m perfmodel.cli list >&-", shell=True, capture_output=True, text=True,
                       env=ENV, timeout=120)
    assert r.returncode == 2 and "standard output is closed" in r.stderr and len(r.stderr.splitlines()) == 1
    r = subprocess.run(f"{sys.executable} -m perfmodel.cli list --json | head -c 1", shell=True,
                       capture_output=True, text=True, env=ENV, timeout=120)  # a closed pipe: not an error
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_unreachable_ray_address_is_refused_at_once():
    import socket
    from perfmodel.search.executors import _reachable
    from perfmodel.util.errors import SpecError
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nobody listens there now
    t = time.perf_counter()
    with pytest.raises(SpecError, match="no Ray cluster answers"):
        _reachable(f"127.0.0.1:{port}")
    with pytest.raises(SpecError, match="no Ray cluster answers"):
        _reachable(f"ray://127.0.0.1:{port}")
    assert time.perf_counter() - t < 10
    _reachable("auto")  # Ray finds its own


def test_a_killed_writers_temporary_is_removed_by_the_next_write(tmp_path):
    """A SIGKILL between linking the new content under its hidden name and the rename leaves
    `.NAME.<pid>.tmp` (whole, hidden); the next write of NAME removes it, and only those of
    processes that are gone."""
    from perfmodel.util.files import write_atomic
    dead = subprocess.Popen(["true"])
    dead.wait()
    out = tmp_path / "rows.csv"
    out.write_text("old\n")
    names = {f".rows.csv.{dead.pid}.tmp": False, f".rows.csv.{dead.pid}.k3_x9.tmp": False,
             f".rows.csv.{os.getppid()}.tmp": True, ".rows.csv.notapid.tmp": True, ".other.csv.1.tmp": True}
    for n in names:
        (tmp_path / n).write_text("whole new\n")
    write_atomic(out, "new\n")
    assert out.read_text() == "new\n"
    assert {n: (tmp_path / n).exists() for n in names} == names
