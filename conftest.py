"""Shared pytest fixtures: launch the scripts the way users do, on CPU with gloo, always bounded.

Every launch runs in its own process session so that a timeout (or a failing test)
ends the launcher *and* every worker it started: no test leaves processes behind.
"""
import contextlib
import faulthandler
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent


def torchrun_cmd():
    """The `torchrun` that belongs to this interpreter (fallback: the same module via -m)."""
    exe = Path(sys.executable).parent / "torchrun"
    if exe.exists():
        return [str(exe)]
    found = shutil.which("torchrun")
    return [found] if found else [sys.executable, "-m", "torch.distributed.run"]


def cpu_env(**extra):
    """The environment of a CPU-only user: no GPU visible, no leftover rendezvous variables."""
    env = dict(os.environ)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "OMP_NUM_THREADS", "TORCHELASTIC_RESTART_COUNT"):
        env.pop(name, None)
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


class Result:
    def __init__(self, cmd, returncode, stdout, stderr):
        self.cmd, self.returncode, self.stdout, self.stderr = cmd, returncode, stdout, stderr

    def __str__(self):
        return (f"$ {' '.join(map(str, self.cmd))}\nexit {self.returncode}\n"
                f"--- stdout\n{self.stdout[-4000:]}\n--- stderr\n{self.stderr[-4000:]}")


def descendants(pid):
    """Every process started by `pid`, its children's children included (from /proc)."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # the name, in (), may hold spaces
        except (OSError, IndexError, ValueError):
            continue  # ended while read
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        started = children.get(todo.pop(), [])
        found += started
        todo += started
    return found


def alive(pid):
    """Whether `pid` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def kill_group(proc):
    """SIGKILL the launch's session and, first, every process it started: torchrun starts each worker in
    a session of its own (its SubprocessHandler), which killpg misses. A worker left alive holds the
    launch's pipes open, and reading them would wait for it for ever (a hung rank on torch 2.7.0 did)."""
    for pid in descendants(proc.pid) if proc.poll() is None else []:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def run_bounded(cmd, cwd, timeout=120, env=None, check=True):
    """Run `cmd` in a new session; kill the whole session at `timeout`; fail loudly with its output."""
    proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env or cpu_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout} s\n{Result(cmd, None, out, err)}")
    finally:
        kill_group(proc)  # workers a launcher left behind go with it
    result = Result(cmd, proc.returncode, out, err)
    if check and proc.returncode != 0:
        pytest.fail(f"expected exit 0\n{result}")
    return result


@pytest.fixture
def launch(tmp_path):
    """launch(args, timeout=..., env=..., check=True): run in a temporary directory, return a Result."""
    def _launch(cmd, timeout=120, env=None, check=True, cwd=None):
        return run_bounded(cmd, cwd or tmp_path, timeout=timeout, env=env, check=check)
    return _launch


@pytest.fixture
def script():
    """script("ddp_gpus.py") -> absolute path of a script in the repository."""
    return lambda name: str(ROOT / name)


@pytest.fixture
def torchrun():
    return torchrun_cmd()


def read_metrics(path):
    with open(path) as f:
        return json.load(f)


@pytest.fixture
def metrics():
    """metrics(path) -> the JSON object a script wrote with --metrics."""
    return read_metrics


# ---------------------------------------------------------------- `bash run.sh`, once per test session
def shared_dir(tmp_path_factory):
    """A folder every test process of this session sees: under xdist each worker's basetemp lies
    in one folder of the session's own; without xdist the basetemp is that folder."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if "PYTEST_XDIST_WORKER" in os.environ else base


@pytest.fixture(scope="session")
def run_sh(tmp_path_factory):
    """`bash run.sh`: every default mode, once per session however xdist spreads the tests that
    read it. The first test process to ask runs it under a file lock and stores the result; the
    others wait on the lock and read it. The work files (one folder per mode) are kept in the
    session's temporary folder, which pytest removes with its old ones."""
    root = shared_dir(tmp_path_factory)
    stored = root / "run_sh.json"
    with open(root / "run_sh.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not stored.exists():
            work = root / "run_sh"
            work.mkdir(exist_ok=True)
            r = run_bounded(["bash", ROOT / "run.sh"], work, timeout=900, check=False,
                            env=cpu_env(KEEP_WORK=1, TMPDIR=work))
            stored.write_text(json.dumps({"cmd": [str(c) for c in r.cmd], "returncode": r.returncode,
                                          "stdout": r.stdout, "stderr": r.stderr}))
    record = json.loads(stored.read_text())
    result = Result(record["cmd"], record["returncode"], record["stdout"], record["stderr"])
    found = re.search(r"work files in (\S+)", result.stdout)
    result.work = Path(found.group(1)) if found else None  # one folder per mode
    return result


# ---------------------------------------------------------------- a time bound for every test
# pytest.ini bounds each test, its fixtures included, with pytest-timeout's thread method: a
# collective stuck in C++ never returns to Python, so a signal's handler would never run. A test
# that runs out fails with every thread's stack, its test process ends (os._exit) and xdist starts
# another: the run goes on. That timer is a Python thread, which needs the GIL: should a C++ call
# hold it, faulthandler's own watchdog thread (plain C) ends the process 60 s later instead.
def pytest_configure(config):
    if not config.pluginmanager.hasplugin("timeout"):
        raise pytest.UsageError("pytest-timeout is not installed (pip install -r requirements.txt); "
                                "without it a stuck collective hangs the suite")
    if not hasattr(config, "workerinput"):  # not a test process xdist started: the folder of the `alone` locks
        config.test_locks = tempfile.mkdtemp(prefix="ddp-test-locks-")
        os.environ["DDP_TEST_LOCKS"] = config.test_locks  # the test processes xdist starts inherit it


def pytest_unconfigure(config):
    if hasattr(config, "test_locks"):
        shutil.rmtree(config.test_locks, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_timeout_set_timer(item, settings):
    if settings.timeout:
        faulthandler.dump_traceback_later(settings.timeout + 60, exit=True)


@pytest.hookimpl(optionalhook=True)
def pytest_timeout_cancel_timer(item):
    faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    """xdist reports a test whose process ended as failed, then queues it again with the rest of its
    group (--dist loadgroup), where a stuck test would end one test process after another: the rest
    of the group runs again, that test does not."""
    queued = getattr(sched, "workqueue", {})
    for group, unit in list(queued.items()):
        unit.pop(crashitem, None)
        if not unit:
            del queued[group]


# ---------------------------------------------------------------- two test processes (pytest-xdist)
# pytest.ini runs the suite in 2 processes (`-n 2 --dist loadgroup`): most time is spent
# waiting for launches, rendezvous and timeouts. Tests that share a module fixture stay
# together in one process: the run.sh run, and the network namespaces and SLURM daemons
# of test_multihost.py (two sets of them would collide). The long run.sh group goes first.
# tryfirst: xdist reads the groups in its own hook of the same name.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if "run_sh" in item.fixturenames:
            item.add_marker(pytest.mark.xdist_group("run_sh"))
            item.add_marker(pytest.mark.timeout(960))  # run.sh's own bound (900 s) first
        elif item.path.name == "test_multihost.py":
            item.add_marker(pytest.mark.xdist_group("multihost"))
    items.sort(key=lambda item: "run_sh" not in item.fixturenames)  # stable: the rest keep their order


# ---------------------------------------------------------------- timed tests run alone
# A test marked `alone` times one launch against another (a cause against its fix, a link against its rate).
# Beside it the other test process's launches share the 2 cores and make one of its ranks the slow one: the
# step clock then names a straggler that is really there (CI's slow tier, 2 of 8 causes). So it runs alone: it
# waits for the other process's test to end, and none starts until it has ended. A readers-writer lock on a
# file both test processes see, taken around each test's whole protocol (fixtures included, before
# pytest-timeout's timer starts): every test holds it shared, an `alone` test exclusive; the gate before it
# keeps a waiting `alone` test from being passed by the other process's next test.
@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    if "PYTEST_XDIST_WORKER" not in os.environ:  # one test process: every test runs alone
        yield
        return
    locks = Path(os.environ["DDP_TEST_LOCKS"])  # made by pytest_configure in the process that starts the others
    alone = item.get_closest_marker("alone") is not None
    with open(locks / "gate", "a") as gate, open(locks / "lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        yield  # both released when the files close


# ---------------------------------------------------------------- the docs' code, run as written
def run_doc_snippet(doc, first_line, argv, cwd, capsys, monkeypatch):
    """Run the ```python block of docs/`doc` that starts with `first_line` exactly as written, in this
    process (its imports are this suite's: no new interpreter to pay for), as `python snippet.py *argv`
    in `cwd`; returns what it printed."""
    text = (ROOT / "docs" / doc).read_text()
    start = text.index(f"```python\n{first_line}") + len("```python\n")
    code = text[start:text.index("\n```", start)]
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["snippet.py", *map(str, argv)])
    monkeypatch.syspath_prepend(str(ROOT))
    capsys.readouterr()
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two threads on two busy cores spin: 7x the CPU of one for the same work
    try:
        exec(compile(code, f"docs/{doc}", "exec"), {"__name__": "__main__"})
    finally:
        torch.set_num_threads(threads)
    return capsys.readouterr().out
