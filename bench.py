"""What DDP buys you on this machine: per-worker scaling against the limit of the machine, and
(one flag away) the thread policy, DP against DDP, gradient compression and ZeRO.

Runs the collection's scripts the way users do (mp.spawn scripts with `python`, torchrun
scripts with `torchrun`), reads their `--metrics` files, and reports the median of
several runs, all taken in one invocation. By default (`bash run.sh bench`, about 36
launches and 8 to 9 minutes on a quiet 2-core machine, by the plan's estimate; it is printed first):

- scaling: the per-worker efficiency that DDP is judged by,
      E(N) = throughput(N workers) / (N x throughput(1 worker)),
  with the same resources per worker: one GPU each, or on a CPU machine one core each
  (N processes with OMP_NUM_THREADS=1 against 1 process with 1 thread). For the MLP
  (dp_baseline.py --ddp), the MNIST ConvNet (ddp_main.py, synthetic data) and the
  Transformer (ddp_transformer.py), at N = 1, 2, 4, ... up to --max_nprocs. Every
  process keeps the same work per step and the same steps (weak scaling).
- the limit, measured in the same run for every N > 1: N independent one-process runs
  started at the same moment (each a world of one with the per-process workload of one
  rank of the N-process run, the same thread policy, its own folder and port, and on
  GPUs its own GPU), their throughputs summed: what the machine gives N workers with no
  communication at all. limit_efficiency = that sum / (N x the 1-process figure), and
  of_limit = efficiency / limit_efficiency: the share of the attainable that DDP reaches.
  Part of what E(N) loses on a small CPU box is the machine's, not DDP's (shared memory
  bandwidth and caches, the benchmark's own Python on a core a rank needs): of_limit
  separates the two.
- machine (CPU): one process using the whole machine (the automatic thread split: every
  core), the other way to use the cores without DDP.
- the answer, the summary's last lines, per model: how many times faster the N DDP
  processes train than the best one-process configuration measured (1 worker, or one
  process on every core), or that they are slower, and why (from the limit's figures).

One flag away (see --help):
- --threads (CPU only): threads, other thread policies at the largest N, e.g.
  OMP_NUM_THREADS=cores in every process (oversubscribed); with --quick also machine.
- --extras: dp_vs_ddp, dp_baseline.py --compare at --max_nprocs: the same model, data and
  global batch trained by one process (DataParallel over those GPUs, or the plain module)
  and by DDP; comm_hooks, ddp_comm_hooks.py: bytes per step, step time and loss gap of
  each DDP communication hook the script runs, side by side in one job; zero,
  ddp_uneven.py with and without --zero (ZeroRedundancyOptimizer): optimizer state per
  rank, whatever byte counts its metrics hold.
- --all: both (about 2.5x as long). --only NAMES picks benchmarks (an extra named there
  runs without --extras).

The `efficiency` column is throughput / (workers x the benchmark's 1-worker figure), a
worker being one GPU, or one CPU core (processes x threads, at most the cores): 1.0 is
perfect scaling, and a row that uses its cores worse than one 1-thread process is below
1. Warm-up is excluded where the script makes that possible (its steady figure, its
epoch lines after the first, or its own figure that already leaves warm-up out). The
Transformer trains --max_steps steps within one epoch at every N: it is given N copies
of its default text (--data), so each process's epoch is as long at any N and every run
writes exactly one checkpoint, which the script times with its steps; its final
validation is outside the figure. A note says when a benchmark's runs (scaling and limit)
did not all take the same steps per process, as their metrics report them. A script that
is missing or lacks a flag skips its rows with a one-line note; a failed run is reported
and makes the exit code 1.

Usage:
    bash run.sh bench                   # or: python bench.py; scaling + limit, median of 3
    bash run.sh bench --all             # every section (about 2.5x as long)
    python bench.py --quick             # one run each of tiny workloads: a plumbing check, not a speed
                                        # (its rows say so; written to bench_quick.json)
    python bench.py --repeats 5 --only mlp,convnet
A line `[k/n] section benchmark N=.. policy (elapsed ..)` precedes every launch, and each
table row is printed as soon as its setting's last run is in. Writes bench_results.json
(bench_quick.json with --quick, so a check never replaces a measurement): {"run": the
date, command, torch, device and its name, cores, load average before and after, repeats;
"answer": the answer's lines; "rows": a list of rows: benchmark, mode, world_size,
threads_per_process, throughput, unit, plumbing_check,
efficiency, limit_efficiency, of_limit, plus section, thread_policy, runs, limit_runs
(each the sum over the N one-process runs), limit_per_process and, for comm_hooks and
zero, figures; the Transformer's rows also mfu, its model FLOP utilization, where its devices'
peak is known: a GPU in its table, or --peak_tflops) in the working directory. Measure on a
quiet machine: the load average is printed.
"""

# ---------------------------------------------------------------- imports
import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import platform
import re
import shlex
import signal
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


# ---------------------------------------------------------------- the benchmarks
# Every sizes(n, quick) gives the flags of an n-process run; a limit run is a one-process world
# with sizes(1, quick), so each workload keeps its per-process numbers equal at every n.
def mlp_sizes(n, quick):
    # dp_baseline.py's --batch_size is global: 256 per process, as many steps per process at any N
    per_process = 2048 if quick else 16384
    return {"--epochs": 2 if quick else 6, "--batch_size": 256 * n, "--samples": per_process * n}


def convnet_sizes(n, quick):
    # ddp_main.py's --batch_size (32) is per process: N x 4096 samples are 128 steps per process at any N
    per_process = 512 if quick else 4096
    return {"--epochs": 2 if quick else 3, "--train_samples": per_process * n,
            "--test_samples": 128 if quick else 1000}


def transformer_sizes(n, quick):
    # the same steps per process at any N, within one epoch: with N copies of the text (corpus_args)
    # an epoch is 106 steps per process at any N (8 windows of 128 characters a step), so every run
    # writes one checkpoint, which the script times with its steps
    return {"--max_steps": 5 if quick else 40, "--epochs": 1, "--sample": 0, "--log_every": 0}


def short_sizes(n, quick):
    """The new scenario scripts at their own defaults (seconds on 2 cores); one epoch with --quick."""
    return {"--epochs": 1} if quick else {}


# name: script, launcher, required flags, kind of metrics, the figure's key and unit, workload per N.
# kind: throughput (one run), compare (two runs under "compare"), hooks (one run per hook under
# "hooks"), figures (one run whose byte counts are read too). steady: the key already leaves
# warm-up out. per_step: the key is seconds per step (the figure is steps/s). corpus: the script's
# function that returns its default text (given N times with --data). work_s: seconds of work of
# one process at N = 1 on one quiet core, without start-up (default, --quick): the plan's estimate.
BENCHMARKS = {
    "mlp": dict(script="dp_baseline.py", launcher="spawn", required=["--ddp"], kind="throughput",
                key="samples_per_s", unit="samples/s", sizes=mlp_sizes, work_s=(3, 0.5)),
    "convnet": dict(script="ddp_main.py", launcher="spawn", required=["--dataset", "synthetic"],
                    kind="throughput", key="samples_per_s", unit="samples/s", sizes=convnet_sizes,
                    work_s=(9, 1)),
    "transformer": dict(script="ddp_transformer.py", launcher="torchrun", required=[], kind="throughput",
                        key="tokens_per_s", unit="tokens/s", sizes=transformer_sizes, steady=True,
                        corpus="default_corpus", work_s=(5.6, 2), mfu=True),
}
COMPARE = dict(script="dp_baseline.py", launcher="spawn", required=["--compare"], kind="compare",
               key="samples_per_s", unit="samples/s", sizes=mlp_sizes, work_s=(12, 5))
HOOKS = dict(script="ddp_comm_hooks.py", launcher="torchrun", required=[], kind="hooks",
             key="step_time_s", unit="steps/s", sizes=short_sizes, per_step=True, figures=r"bytes_per_step|time_s|loss",
             work_s=(15, 8))
ZERO = dict(script="ddp_uneven.py", launcher="torchrun", required=["--zero"], kind="figures",
            key="samples_per_s", unit="samples/s", sizes=short_sizes, figures=r"bytes|memory|final_loss",
            work_s=(5, 3))
ZERO_OFF = dict(ZERO, required=[])
EXTRAS = ("dp_vs_ddp", "comm_hooks", "zero")  # --only names besides BENCHMARKS
EPOCH_LINE = re.compile(r"^epoch (\d+)/\d+ \|.*?\| ([\d.]+) samples/s \|", re.MULTILINE)
# the plan's estimate of a launch: a launcher (the mp.spawn parent, torchrun's agent) imports torch,
# a worker imports torch and torch._dynamo (its first optimizer does); DDP's steps take longer than
# one process's (the all-reduce)
LAUNCHER_START_S, WORKER_START_S, DDP_SLOWER = 2.4, 5.0, 1.3


# ---------------------------------------------------------------- arguments
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])  # each help states its default
    p.add_argument("--quick", action="store_true",
                   help="one run of each setting on tiny workloads: checks that everything runs "
                        "(tests), measures nothing")
    p.add_argument("--repeats", type=int, default=None, metavar="N",
                   help="runs per setting; the figure is their median (default: 3, 1 with --quick)")
    p.add_argument("--only", default=None, metavar="NAMES",
                   help=f"comma-separated subset of: {','.join([*BENCHMARKS, *EXTRAS])} (default: "
                        f"{','.join(BENCHMARKS)}, each with its limit; --extras adds the rest)")
    p.add_argument("--threads", action=argparse.BooleanOptionalAction, default=None,
                   help="also the CPU thread-policy sections: machine (one process on every core) and "
                        "threads (OMP_NUM_THREADS=cores in every process) (default: off, on with --all)")
    p.add_argument("--extras", action="store_true",
                   help="also dp_vs_ddp, comm_hooks and zero (default: off)")
    p.add_argument("--all", action="store_true",
                   help="every section: --threads and --extras (about 2.5x as long as the default)")
    p.add_argument("--device", default="auto", metavar="auto|cuda|cpu",
                   help="auto (default): the accelerator torch finds, else CPU. CUDA or CPU only: each "
                        "worker gets its own GPU through CUDA_VISIBLE_DEVICES, which only CUDA reads")
    p.add_argument("--max_nprocs", type=int, default=None, metavar="N",
                   help="largest process count, for every section (default: the GPU count; on CPU 2, "
                        "at most the cores: one core per process)")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="limit for each launch; it is killed with all its processes after that "
                        "(default: 600, 300 with --quick)")
    p.add_argument("--out", default=None, metavar="PATH",
                   help="where to write the results (default: bench_results.json; bench_quick.json with --quick, "
                        "so that a plumbing check never replaces a measurement)")
    p.add_argument("--memory", action="store_true",
                   help="only the memory section: bytes per rank of DDP, ZeRO and FSDP2 at N = 1, 2, 4 (on GPUs those "
                        "there are GPUs for) at one model size, beside their formulas, and FSDP2's two ways to accumulate at N = 2; --repeats runs of "
                        "each, the peak their median; writes --memory_out (about 10 minutes on 2 cores)")
    p.add_argument("--memory_out", default="bench_memory.json", metavar="PATH",
                   help="where the memory section writes its rows (default: %(default)s)")
    p.add_argument("--peak_tflops", type=float, default=None, metavar="TF",
                   help="one device's peak dense TFLOP/s, given to ddp_transformer.py for the MFU of its rows "
                        "(default: its own table of GPUs; on CPU none, and no MFU)")
    return p.parse_args(argv)


def fail(what, fix):
    """Bad input: one line on stderr and exit code 2, never a traceback."""
    print(f"error: {what} ({fix})", file=sys.stderr, flush=True)
    sys.exit(2)


def check_args(args):
    args.repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    args.timeout = args.timeout if args.timeout is not None else (300 if args.quick else 600)
    args.out = args.out or ("bench_quick.json" if args.quick else "bench_results.json")
    if args.repeats <= 0:
        fail(f"--repeats must be a positive integer, got {args.repeats}", "pass --repeats 1 or more")
    if not args.timeout > 0:
        fail(f"--timeout must be positive, got {args.timeout}", "pass e.g. --timeout 600")
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        fail(f"--peak_tflops must be positive, got {args.peak_tflops}",
             "pass one device's peak, e.g. --peak_tflops 312")
    args.threads = args.all if args.threads is None else args.threads
    args.extras = args.extras or args.all
    named = [name.strip() for name in (args.only or ",".join(BENCHMARKS)).split(",") if name.strip()]
    args.only = list(dict.fromkeys(named + list(EXTRAS if args.extras else ())))
    unknown = sorted(set(args.only) - {*BENCHMARKS, *EXTRAS})
    if unknown:
        fail(f"unknown benchmark(s) {', '.join(unknown)}", f"pick from {', '.join([*BENCHMARKS, *EXTRAS])}")
    found = torch.accelerator.current_accelerator(check_available=True)  # None: no accelerator visible
    args.device = (found.type if found else "cpu") if args.device == "auto" else args.device
    if args.device not in ("cuda", "cpu"):
        fail(f"bench.py runs on cuda or cpu, not {args.device}: it gives each worker its own GPU through "
             "CUDA_VISIBLE_DEVICES, which only CUDA reads", "pass --device cpu, or run the scripts themselves there")
    args.gpus = gpus = torch.accelerator.device_count() if found is not None and found.type == "cuda" else 0
    if args.device == "cuda" and gpus == 0:
        fail("--device cuda but no GPU is visible", "use --device cpu, or check CUDA_VISIBLE_DEVICES")
    limit = gpus if args.device == "cuda" else cores()  # one GPU, or one core, per worker
    args.max_nprocs = args.max_nprocs or (gpus if args.device == "cuda" else min(2, limit))
    if not 1 <= args.max_nprocs <= limit:
        fail(f"--max_nprocs {args.max_nprocs} does not fit this machine", f"pass 1 to {limit}")
    return args


# ---------------------------------------------------------------- launching
def torchrun_cmd():
    """The `torchrun` that belongs to this interpreter (fallback: the same module via -m)."""
    exe = Path(sys.executable).parent / "torchrun"
    if exe.exists():
        return [str(exe)]
    found = shutil.which("torchrun")
    return [found] if found else [sys.executable, "-m", "torch.distributed.run"]


def cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def first_gpus(n):
    """CUDA_VISIBLE_DEVICES naming the first n GPUs this process may use (an inherited list indexed, not replaced)."""
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = inherited.split(",") if inherited else [str(i) for i in range(torch.cuda.device_count())]
    return ",".join(ids[:n])


def launch_env(device, omp_threads, n):
    """A clean environment: no rendezvous left over from a caller, the thread policy under test,
    and on GPUs exactly the n GPUs the launch is filed under (DataParallel takes every GPU it sees)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "OMP_NUM_THREADS", "TORCHELASTIC_RESTART_COUNT"):
        env.pop(name, None)
    env["CUDA_VISIBLE_DEVICES"] = first_gpus(n) if device == "cuda" else ""
    if omp_threads is not None:
        env["OMP_NUM_THREADS"] = str(omp_threads)
    return env


def kill_session(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_all(jobs, timeout):
    """Start every (cmd, cwd, env) job at the same moment, each in its own session, and wait for them
    all; returns [(exit code or None on timeout, stdout, stderr)], one per job.

    Their output goes to files, so no job ever waits on a pipe that nobody reads yet. Every
    session is killed at the end, whatever happened (a timeout, Ctrl-C, SIGTERM), so no
    launcher or worker outlives it.
    """
    deadline, procs, files = time.monotonic() + timeout, [], []
    try:
        for cmd, cwd, env in jobs:
            files.append((tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")))
            procs.append(subprocess.Popen(cmd, cwd=cwd, env=env, text=True, stdin=subprocess.DEVNULL,
                                          stdout=files[-1][0], stderr=files[-1][1], start_new_session=True))
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        for proc in procs:
            kill_session(proc)  # before reading: a timed-out job writes no more
        return [(code, *(read_back(f) for f in pair)) for code, pair in zip(codes, files)]
    finally:
        for proc in procs:
            kill_session(proc)
        for f in (f for pair in files for f in pair):
            f.close()


def read_back(f):
    f.seek(0)
    return f.read()


def run_bounded(cmd, cwd, env, timeout):
    """Run one `cmd` in its own session (see run_all); returns (exit code or None, stdout, stderr)."""
    return run_all([(cmd, cwd, env)], timeout)[0]


def free_ports(count):
    """`count` different ports the OS says are free now (held open together: no two are the same)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def script_flags(script, timeout):
    """The options a script's --help lists, or (None, why) when it cannot say."""
    path = HERE / script
    if not path.exists():
        return None, f"{script} not found"
    with tempfile.TemporaryDirectory() as tmp:
        code, out, err = run_bounded([sys.executable, str(path), "--help"], tmp, launch_env("cpu", None, 0), timeout)
    if code != 0:
        last = (err.strip().splitlines() or ["no output"])[-1]
        return None, f"{script} --help failed (exit {code}: {last})"
    return set(re.findall(r"(?<![\w-])(--[A-Za-z][\w-]*)", out)), None


def command(spec, flags, device, n, quick, plain=False):
    """The launch command, with the workload flags the script understands; (None, why) if it lacks one
    it needs. plain: a one-process world started with `python`, even for a torchrun script."""
    needed = ["--device", "--metrics", *(a for a in spec["required"] if a.startswith("--")),
              *(["--nprocs"] if spec["launcher"] == "spawn" else []), *(["--data"] if spec.get("corpus") else [])]
    missing = [f for f in needed if f not in flags]
    if missing:
        return None, f"{spec['script']} has no {', '.join(missing)}"
    extra = []
    for flag, value in spec["sizes"](n, quick).items():
        if flag in flags:
            extra += [flag, str(value)]
    base = [str(HERE / spec["script"]), *spec["required"], "--device", device, *extra]
    if spec["launcher"] == "spawn":
        return [sys.executable, *base, "--nprocs", str(n)], None
    if plain:
        return [sys.executable, *base], None
    return [*torchrun_cmd(), "--standalone", f"--nproc-per-node={n}", *base], None


TEXTS = {}  # script -> its default text (None: it has none)


def default_text(spec):
    """The text the script trains on by default, from its own function spec["corpus"] (the script is
    imported, not run: its main does not start); None when that fails."""
    script = spec["script"]
    if script not in TEXTS:
        try:
            found = importlib.util.spec_from_file_location(f"bench_{Path(script).stem}", HERE / script)
            module = importlib.util.module_from_spec(found)
            found.loader.exec_module(module)
            TEXTS[script] = getattr(module, spec["corpus"])()
        except Exception:  # any failure means the same here: the rows are skipped with a note
            TEXTS[script] = None
    return TEXTS[script]


def corpus_args(spec, n, folder):
    """--data with n copies of the script's default text, written in `folder`: each of n processes gets
    an epoch of the same steps as one process on one copy (the same vocabulary, the same model)."""
    if not spec.get("corpus"):
        return []
    path = os.path.join(folder, "corpus.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write(default_text(spec) * n)
    return ["--data", path]


def launch_jobs(setting, args, flags, tmp):
    """(cmd, cwd, env, metrics path) of each job a launch starts, each in its own folder of `tmp`: one
    job, or for a limit launch N one-process worlds (the per-process workload of one rank of the
    N-process run), each with its own port and, on GPUs, its own GPU."""
    limit = setting.section == "limit"
    copies, world = (setting.n, 1) if limit else (1, setting.n)
    ports = free_ports(copies) if limit else []
    gpus = first_gpus(copies).split(",") if limit and args.device == "cuda" else []
    jobs = []
    for i in range(copies):
        cwd = os.path.join(tmp, f"run{i}")  # the job's cwd: its checkpoints go with it
        os.mkdir(cwd)
        metrics = os.path.join(cwd, "metrics.json")
        # a one-process world runs as plain `python`: the same run as under torchrun, without its agent
        cmd = command(setting.spec, flags, args.device, world, args.quick, plain=limit or world == 1)[0]
        env = launch_env(args.device, setting.omp, world)
        if limit:
            env["MASTER_PORT"] = str(ports[i])  # the script hosts its own rendezvous there
            env["CUDA_VISIBLE_DEVICES"] = gpus[i] if gpus else env["CUDA_VISIBLE_DEVICES"]
        peak = getattr(args, "peak_tflops", None)  # the Transformer's MFU: one device's peak
        if peak and setting.spec.get("mfu") and "--peak_tflops" in flags:
            cmd = cmd + ["--peak_tflops", str(peak)]
        jobs.append((cmd + corpus_args(setting.spec, world, cwd) + ["--metrics", metrics], cwd, env, metrics))
    return jobs


def throughput_of(spec, record, stdout):
    """A run's throughput without warm-up, and how it was found: the script's steady figure,
    else its epoch lines after the first, else its figure for the whole run."""
    key = spec["key"]
    value = record.get(key)
    if not isinstance(value, (int, float)) or value <= 0:
        return None, "none"
    if spec.get("per_step"):
        return 1 / value, f"1 / {key}"
    if isinstance(record.get(f"steady_{key}"), (int, float)):
        return record[f"steady_{key}"], "steady"
    if spec.get("steady"):
        return value, "steady"
    epochs = [(int(e), float(rate)) for e, rate in EPOCH_LINE.findall(stdout)]
    rates = [rate for e, rate in epochs if e > 1]
    if key == "samples_per_s" and rates and min(rates) > 0:
        return len(rates) / sum(1 / r for r in rates), "epoch lines"  # equal epochs: the harmonic mean
    return value, "whole run"


# ---------------------------------------------------------------- the plan
class Setting:
    """One launch to measure: a benchmark at N processes under a thread policy."""

    def __init__(self, section, name, spec, n, omp_threads, mode="ddp"):
        self.section, self.name, self.spec, self.n, self.omp = section, name, spec, n, omp_threads
        self.mode = mode
        self.parts, self.failures, self.how = {}, [], set()  # parts: mode -> world, threads, runs, figures
        self.steps = set()  # optimizer steps per process, as each run's metrics say
        self.quick = False  # a --quick run's setting: its rows are plumbing checks

    @property
    def policy(self):
        return "auto" if self.omp is None else f"OMP_NUM_THREADS={self.omp}"


def process_counts(max_n):
    counts = [1]
    while counts[-1] * 2 < max_n:
        counts.append(counts[-1] * 2)
    return counts + [max_n] if max_n > 1 else counts


def benchmark_settings(name, spec, args):
    """The scaling rows of one benchmark, each N > 1 right after its limit launch (the row shows both),
    and, on CPU with --threads, its whole-machine and thread-policy rows."""
    omp = 1 if args.device == "cpu" else None  # on CPU one core per worker: 1 thread per process
    settings = []
    for n in process_counts(args.max_nprocs):
        if n > 1:
            settings.append(Setting("limit", name, spec, n, omp))  # N one-process worlds at once
        settings.append(Setting("scaling", name, spec, n, omp))
    if args.device != "cpu":
        return settings
    if args.threads or not args.quick:  # the answer weighs DDP against the best one-process run
        settings.append(Setting("machine", name, spec, 1, None))  # 1 process, every core (automatic split)
    if not args.threads:
        return settings
    n, auto = args.max_nprocs, max(1, cores() // args.max_nprocs)
    if auto > 1 and spec["launcher"] != "torchrun":  # torchrun sets 1 thread per worker itself
        settings.append(Setting("threads", name, spec, n, None))
    if n > 1:
        settings.append(Setting("threads", name, spec, n, cores()))  # oversubscribed
    return settings


def plan(args):
    """The launches to measure, in the order of the table."""
    settings = []
    for name in (b for b in BENCHMARKS if b in args.only):
        settings += benchmark_settings(name, BENCHMARKS[name], args)
    n = args.max_nprocs
    if "dp_vs_ddp" in args.only:
        settings.append(Setting("dp_vs_ddp", "mlp", COMPARE, n, None))
    if "comm_hooks" in args.only:
        settings.append(Setting("comm_hooks", "comm_hooks", HOOKS, n, None))
    if "zero" in args.only:
        settings += [Setting("zero", "zero", ZERO_OFF, n, None, "ddp"), Setting("zero", "zero", ZERO, n, None, "zero")]
    for s in settings:
        s.quick = args.quick
    return settings


def processes(setting):
    """(launchers, workers) a launch starts: a limit launch N one-process worlds (mp.spawn: a parent and
    its child each; a torchrun script: one plain process), any other launch one launcher and N workers
    (a torchrun script at N = 1: one plain process)."""
    if setting.section != "limit":
        return (0 if setting.n == 1 and setting.spec["launcher"] != "spawn" else 1), setting.n
    return (setting.n, setting.n) if setting.spec["launcher"] == "spawn" else (0, setting.n)


def launch_estimate(setting, args):
    """Rough seconds of one launch on a quiet machine: start-up (launchers first, then the workers, as
    many at once as there are cores) plus the work, longer where processes talk or share cores."""
    launchers, workers = processes(setting)
    crowd = max(1, workers / cores())
    threads = setting.omp or max(1, cores() // setting.n)
    work = setting.spec["work_s"][bool(args.quick)] * max(1, workers * threads / cores())
    if setting.n > 1 and setting.section != "limit":
        work *= DDP_SLOWER
    return (LAUNCHER_START_S * max(1, launchers / cores()) if launchers else 0) + WORKER_START_S * crowd + work


def print_plan(runnable, args, spent=0.0):
    """How many launches, how many processes, and about how long in all (`spent`: the seconds already
    gone, on checking the scripts): printed before the first launch."""
    launches = args.repeats * len(runnable)
    started = args.repeats * sum(sum(processes(s)) for s in runnable)
    minutes = (spent + args.repeats * sum(launch_estimate(s, args) for s in runnable)) / 60
    repeats = f"{args.repeats} repeat{'s' if args.repeats > 1 else ''}"
    print(f"plan: {launches} launches ({len(runnable)} settings x {repeats}), "
          f"{started} processes; about {minutes:.1f} min in all on a quiet {cores()}-core machine "
          f"({LAUNCHER_START_S:.1f} s of start-up per launcher, {WORKER_START_S:.1f} s per worker: import torch "
          f"and torch._dynamo; plus the work)", flush=True)
    left = [f"{flag} ({what})" for flag, what, on in (
        ("--threads", "the threads section" + (" and the machine section" if args.quick else ""),
         args.threads or args.device != "cpu"),
        ("--extras", "dp_vs_ddp, comm_hooks, zero", set(EXTRAS) <= set(args.only))) if not on]
    if left:
        print(f"not in this run: {'; '.join(left)}; --all adds every section", flush=True)


def expected_threads(setting, device):
    """Threads per process when the script does not report them: the contract's split, or torchrun's 1."""
    if device != "cpu":
        return None
    if setting.omp is not None:
        return setting.omp
    if setting.spec["launcher"] == "torchrun" and setting.n > 1:
        return 1  # torchrun sets OMP_NUM_THREADS=1 for every worker when it is unset
    return max(1, cores() // setting.n)


def measure(setting, args, flags):
    """One launch of a setting; returns [(metrics record, stdout)], one per job (a limit launch has N),
    or None after filing why not."""
    spec = setting.spec
    with tempfile.TemporaryDirectory() as tmp:
        jobs = launch_jobs(setting, args, flags, tmp)
        got = []
        for (code, out, err), (*_, metrics) in zip(run_all([job[:3] for job in jobs], args.timeout), jobs):
            if code != 0:
                last = (err.strip().splitlines() or ["no output"])[-1]
                setting.failures.append(f"{spec['script']}: " + (f"timed out after {args.timeout:.0f} s"
                                                                if code is None else f"exit {code}: {last}"))
                return None
            try:
                with open(metrics) as f:
                    got.append((json.load(f), out))
            except (OSError, ValueError) as e:
                setting.failures.append(f"no metrics from {spec['script']} ({e})")
                return None
    return got


def launch_parts(setting, record):
    """A launch's runs as (mode, record, processes): one, two for --compare (one process, then
    DDP; DataParallel's processes are its GPUs), or one per comm hook."""
    kind, world = setting.spec["kind"], record.get("world_size", setting.n)
    if kind == "compare":
        return [(p["mode"], p, p["dp_devices"] if p["mode"] == "dp" else p["world_size"])
                for p in record.get("compare", [])]
    if kind == "hooks":
        return [(name, values, world) for name, values in (record.get("hooks") or {}).items()
                if isinstance(values, dict)]
    return [(setting.mode, record, world)]


def read_figures(record, pattern):
    """The numbers under the keys that match `pattern`; a `..._per_rank` list counts as its largest
    entry (the rank that needs the most)."""
    figures = {}
    for key, value in record.items():
        if key.endswith("_per_rank") and isinstance(value, list) and value \
                and all(isinstance(v, (int, float)) for v in value):
            value = max(value)
        if pattern.search(key) and isinstance(value, (int, float)) and not isinstance(value, bool):
            figures[key] = value
    return figures


def file_run(setting, record, out, device):
    """File one launch's figures under each of its runs."""
    spec = setting.spec
    parts = launch_parts(setting, record)
    pattern = re.compile(spec["figures"]) if "figures" in spec else None  # the keys read besides the throughput
    for mode, part, world in parts:
        figure, how = throughput_of(spec, part, out if len(parts) == 1 else "")
        figures = read_figures(part, pattern) if pattern else {}
        if figure is None and not figures:
            setting.failures.append(f"{spec['script']} wrote no positive {spec['key']}")
            return
        entry = setting.parts.setdefault(mode, {
            "world": world, "threads": part.get("threads_per_process", expected_threads(setting, device)),
            "runs": [], "figures": {}})
        if figure is not None:
            entry["runs"].append(figure)
            setting.how.add(how)
            setting.steps.add(part.get("steps"))
            if isinstance(part.get("mfu"), (int, float)):  # the Transformer, where it knows its devices' peak
                entry.setdefault("mfu", []).append(part["mfu"])
        for key, value in figures.items():
            entry["figures"].setdefault(key, []).append(value)
    if not parts:
        setting.failures.append(f"{spec['script']} wrote no runs to its metrics")


def file_limit(setting, got, device):
    """File a limit launch: the sum of its N one-process runs' figures, each found as for any run."""
    spec = setting.spec
    found = [throughput_of(spec, record, out) for record, out in got]
    if any(figure is None for figure, _ in found):
        setting.failures.append(f"{spec['script']} wrote no positive {spec['key']} in a one-process run")
        return
    entry = setting.parts.setdefault(setting.mode, {
        "world": setting.n, "threads": got[0][0].get("threads_per_process", expected_threads(setting, device)),
        "runs": [], "figures": {}, "per_process": []})
    entry["runs"].append(sum(figure for figure, _ in found))
    entry["per_process"].append([figure for figure, _ in found])
    setting.how.update(how for _, how in found)
    setting.steps.update(record.get("steps") for record, _ in got)


def workload_notes(settings):
    """A note for each benchmark whose runs did not all take the same steps per process (scaling rows
    and limit runs): weak scaling needs them equal."""
    steps = {}
    for s in (s for s in settings if s.section in ("scaling", "limit")):
        steps.setdefault(s.name, {})[f"{s.section} N={s.n}"] = sorted(s.steps, key=str)
    return [f"note: {name}: the runs took different steps per process ("
            + ", ".join(f"{k}: {'/'.join(map(str, v))}" for k, v in found.items()) + "): E and the limit compare "
            "unequal work" for name, found in steps.items()
            if len({x for v in found.values() for x in v}) > 1]


def file_launch(setting, got, device):
    if setting.section == "limit":
        file_limit(setting, got, device)
    else:
        file_run(setting, *got[0], device)


# ---------------------------------------------------------------- results
def workers(row, device):
    """What the row's run used: GPUs, or on CPU the cores its threads can occupy."""
    if device != "cpu" or row["threads_per_process"] is None:
        return row["world_size"]
    return min(row["world_size"] * row["threads_per_process"], cores())


def owned_rows(settings, device):
    """[(setting, row)]: median figures, every row's per-worker efficiency against its benchmark's
    1-worker row, and on the N-process scaling rows the limit launched beside them."""
    owned = [(s, row(s, mode, p)) for s in settings if s.section != "limit" for mode, p in s.parts.items()]
    rows = [r for _, r in owned]
    reference = {r["benchmark"]: r["throughput"] for r in rows
                 if r["section"] == "scaling" and r["world_size"] == 1}
    for r in rows:
        ref = reference.get(r["benchmark"])
        if ref and r["throughput"]:
            r["efficiency"] = r["throughput"] / (workers(r, device) * ref)
    for s in (s for s in settings if s.section == "limit" and s.mode in s.parts):
        for r in rows:
            if (r["section"], r["benchmark"], r["world_size"], r["thread_policy"]) == \
                    ("scaling", s.name, s.n, s.policy):
                add_limit(r, s.parts[s.mode], reference.get(s.name), device)
    return owned


def add_limit(r, part, ref, device):
    """limit_efficiency = the N one-process runs' summed figure / (N x the 1-process row's), and of_limit =
    efficiency / limit_efficiency (the same N in both: throughput / the summed figure)."""
    r["limit_runs"], r["limit_per_process"] = part["runs"], part["per_process"]
    r["limit_throughput"] = statistics.median(part["runs"]) if part["runs"] else None
    if ref and r["limit_throughput"]:
        r["limit_efficiency"] = r["limit_throughput"] / (workers(r, device) * ref)
        if r["efficiency"] is not None:
            r["of_limit"] = r["efficiency"] / r["limit_efficiency"]


def rows_from(settings, device):
    return [r for _, r in owned_rows(settings, device)]


def rows_of(setting, settings, device):
    """The rows of one setting (none for a limit launch: its figures are on its scaling row)."""
    return [r for s, r in owned_rows(settings, device) if s is setting]


def row(setting, mode, part):
    runs = part["runs"]
    record = {"benchmark": setting.name, "mode": mode, "world_size": part["world"],
              "threads_per_process": part["threads"], "throughput": statistics.median(runs) if runs else None,
              "unit": setting.spec["unit"], "efficiency": None, "limit_efficiency": None, "of_limit": None,
              "section": setting.section, "thread_policy": setting.policy, "runs": runs,
              "limit_throughput": None, "limit_runs": [], "limit_per_process": [],
              "plumbing_check": setting.quick}  # --quick: tiny workloads, one run: a check, not a figure
    if part["figures"]:
        record["figures"] = {k: statistics.median(v) for k, v in part["figures"].items()}
    if part.get("mfu"):
        record["mfu"] = statistics.median(part["mfu"])  # model FLOP utilization, of its runs' median
    return record


def number(x):
    """Throughputs as whole numbers; small ones (steps/s) with three digits."""
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def table_header():
    head = f"{'section':10} {'benchmark':12} {'mode':16} {'N':>3} {'threads':>8} {'policy':18} " \
           f"{'throughput':>12} {'unit':10} {'eff.':>6} {'limit':>6} {'of lim.':>7}  runs"
    return head + "\n" + "-" * len(head)


def row_line(r):
    """One row of the table; its runs, then the limit's (each the sum over its one-process runs)."""
    ratio = {k: f"{r[k]:.2f}" if r.get(k) is not None else "-" for k in ("efficiency", "limit_efficiency", "of_limit")}
    threads = r["threads_per_process"] if r["threads_per_process"] is not None else "-"
    figure = number(r["throughput"]) if r["throughput"] is not None else "-"
    runs = " ".join(number(x) for x in r["runs"])
    if r.get("limit_runs"):
        runs += " | limit " + " ".join(number(x) for x in r["limit_runs"])
    if r.get("mfu") is not None:
        runs += f" | MFU {100 * r['mfu']:.2f}%"
    if r.get("plumbing_check"):
        runs += " | plumbing check"
    return (f"{r['section']:10} {r['benchmark']:12} {r['mode']:16} {r['world_size']:>3} {threads:>8} "
            f"{r['thread_policy']:18} {figure:>12} {r['unit']:10} {ratio['efficiency']:>6} "
            f"{ratio['limit_efficiency']:>6} {ratio['of_limit']:>7}  {runs}")


def print_table(rows, notes, args, load_before):
    print(f"\nbench: {datetime.datetime.now().isoformat(timespec='minutes')} | {platform.node()} | "
          f"{cores()} cores | torch {torch.__version__} | {args.device} | median of {args.repeats} "
          f"| load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after")
    print(table_header())
    for r in rows:
        print(row_line(r))
    for line in dict.fromkeys(summary_lines(rows, args.device) + notes):  # each note once
        print(line, flush=True)


def largest_scaling(rows):
    """{benchmark: its scaling row at the largest N}."""
    top = {}
    for r in rows:
        if r["section"] == "scaling" and r["world_size"] >= top.get(r["benchmark"], r)["world_size"]:
            top[r["benchmark"]] = r
    return top


def efficiency_lines(rows, device):
    """E(N) of each benchmark, with its limit and the share of it that DDP reaches."""
    worker = "one GPU each" if device != "cpu" else "1 thread each against 1 process with 1 thread"
    lines = []
    for r in (r for r in rows if r["section"] == "scaling" and r["world_size"] > 1 and r["efficiency"] is not None):
        limit = "" if r["of_limit"] is None else \
            f", limit {r['limit_efficiency']:.2f}, {r['of_limit']:.2f} of the limit"
        lines.append(f"{r['benchmark']}: E({r['world_size']}) = {r['efficiency']:.2f}{limit} "
                     f"({r['world_size']} processes, {worker})")
    if any(r["of_limit"] is not None for r in rows):
        lines.append("limit: N one-process runs started at once with the per-process work of one rank, their "
                     "summed throughput / (N x the 1-process row): what this machine gives N workers that never "
                     "communicate; of the limit = E / limit, the share of that DDP reaches")
    return lines


def scaling_lines(rows, device):
    """E(N) of each benchmark and, on CPU, its N 1-thread processes against one process on every core."""
    lines = efficiency_lines(rows, device)
    top = largest_scaling(rows)
    for m in (r for r in rows if r["section"] == "machine"):
        r = top.get(m["benchmark"])
        if r and r["world_size"] > 1 and m["throughput"]:
            lines.append(f"{m['benchmark']}: {r['world_size']} processes x 1 thread = "
                         f"{r['throughput'] / m['throughput']:.2f}x one process using the whole machine "
                         f"({m['threads_per_process']} threads, at {m['efficiency'] or 0:.2f} of the 1-thread "
                         f"figure per core)")
    for t in (r for r in rows if r["section"] == "threads"):
        r = top.get(t["benchmark"])
        if r and r["world_size"] == t["world_size"] and t["throughput"]:
            lines.append(f"{t['benchmark']}, {t['world_size']} processes: {t['thread_policy']} "
                         f"({t['threads_per_process']} threads each) at {t['throughput'] / r['throughput']:.0%} "
                         f"of 1 thread each")
    return lines


def figure_text(key, value, base):
    """`bytes_per_step 1,234 (0.50x allreduce)`: a figure, and for bytes and times its ratio to the
    baseline run's."""
    text = f"{key} {value:,}" if isinstance(value, int) else f"{key} {value:.4g}"
    if base is not None and ("bytes" in key or key.endswith("time_s")) and base["figures"].get(key):
        text += f" ({value / base['figures'][key]:.2f}x {base['mode']})"
    return text


def summary_lines(rows, device):
    """The answers the table holds: E(N), the whole machine, thread policies, DDP against DP,
    and each comm hook's and ZeRO's figures against the plain run of the same launch."""
    lines = scaling_lines(rows, device)
    pair = [r for r in rows if r["section"] == "dp_vs_ddp" and r["throughput"]]
    if len(pair) == 2:
        lines.append(f"dp_vs_ddp: {pair[1]['mode']} ({pair[1]['world_size']}) / {pair[0]['mode']} "
                     f"({pair[0]['world_size']}) = {pair[1]['throughput'] / pair[0]['throughput']:.2f}x "
                     f"at the same global batch")
    for section, baselines in (("comm_hooks", ("allreduce", "none")), ("zero", ("ddp",))):
        found = [r for r in rows if r["section"] == section and r.get("figures")]
        base = next((r for r in found if r["mode"] in baselines), None)
        for r in found:
            lines.append(f"{section} {r['mode']} (N={r['world_size']}): " + ", ".join(
                figure_text(k, v, None if r is base else base) for k, v in r["figures"].items()))
    return lines


def one_process_text(r, device):
    """`1 process x 2 threads` on CPU, `1 process on 1 GPU` on GPUs."""
    if device != "cpu":
        return "1 process on 1 GPU"
    threads = r["threads_per_process"]
    return f"1 process x {threads} thread{'s' if threads != 1 else ''}"


def slower_because(r, best):
    """Why N DDP processes lost to one process, from the figures the rows hold."""
    why = []
    if best["section"] == "machine":
        why.append(f"one process already puts all {best['threads_per_process']} cores to work through its threads, "
                   "and never communicates")
    if r.get("limit_efficiency") is not None:
        why.append(f"{r['world_size']} processes that never communicate reach {r['limit_efficiency']:.2f} of "
                   f"{r['world_size']} x one 1-worker run (the rest is what they take from each other on this "
                   f"machine: memory bandwidth, caches, and any other load), and DDP {r['of_limit']:.2f} of that "
                   f"(the rest is the all-reduce of the gradients at every step)")
    else:
        why.append("the all-reduce of the gradients at every step costs more than the extra workers give")
    return "; ".join(why)


def answer_lines(rows, device, quick):
    """The summary's last word, per benchmark: how many times faster N DDP processes train than the best
    one-process configuration measured here (the 1-worker row, on CPU also one process on every core),
    or that they are slower, and why."""
    lines = []
    for name, r in largest_scaling(rows).items():
        ones = [o for o in rows if o["benchmark"] == name and o["world_size"] == 1 and o["throughput"]
                and o["section"] in ("scaling", "machine")]
        if r["world_size"] < 2 or not r["throughput"] or not ones:
            continue
        best = max(ones, key=lambda o: o["throughput"])
        ratio = r["throughput"] / best["throughput"]
        against = (f"the best one-process configuration measured here ({one_process_text(best, device)}: "
                   f"{number(best['throughput'])} {best['unit']})")
        if device == "cpu" and not any(o["section"] == "machine" for o in ones):
            against += " (one process on every core was not measured: --threads adds it)"
        text = (f"{name}: {r['world_size']} DDP processes train {ratio:.2f} times as fast as {against}"
                if ratio >= 1 else f"{name}: {r['world_size']} DDP processes train SLOWER than {against}, at "
                                   f"{ratio:.2f} times its speed. Why: {slower_because(r, best)}")
        lines.append(("answer (plumbing check, not a measurement): " if quick else "answer: ") + text)
    return lines


def cpu_name():
    """The CPU's model name (Linux), else what platform knows."""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def run_record(args, started_at, load_before, elapsed):
    """What a result file needs to be read later: when, how, on what, and under which load."""
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    return {"date": started_at, "command": shlex.join([sys.executable, *sys.argv]), "cwd": os.getcwd(),
            "host": platform.node(), "torch": torch.__version__, "python": platform.python_version(),
            "device": args.device, "device_name": torch.cuda.get_device_name(0) if gpus else cpu_name(),
            "gpus": gpus, "cores": cores(), "load_before": list(load_before), "load_after": list(os.getloadavg()),
            "repeats": args.repeats, "max_nprocs": args.max_nprocs, "elapsed_s": elapsed,
            "plumbing_check": args.quick}


def write_json(path, record):
    """Write atomically: a reader never sees half a file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=2)
    os.replace(tmp, path)


# ---------------------------------------------------------------- main
def runnable_settings(settings, args, notes):
    """The settings whose script exists and has the flags (and default text) it needs; a note for every
    other one."""
    flags, runnable = {}, []
    for s in settings:
        script = s.spec["script"]
        if script not in flags:
            flags[script], why = script_flags(script, args.timeout)
            if why:
                notes.append(f"skipped {script}: {why}")
        why = flags[script] is not None and command(s.spec, flags[script], args.device, s.n, args.quick)[1]
        if not why and flags[script] is not None and s.spec.get("corpus") and default_text(s.spec) is None:
            why = f"{script} has no {s.spec['corpus']}() giving its default text"
        if why:
            notes.append(f"skipped {s.name} ({s.section}): {why}")
        elif flags[script] is not None:
            runnable.append(s)
    return runnable, flags


def run_plan(runnable, flags, args, started):
    """Every launch, the repeats going round the settings (a change in the machine's load spreads over
    all of them): a progress line before each, and a setting's rows as soon as its last run is in."""
    total = args.repeats * len(runnable)
    for repeat in range(args.repeats):
        last = repeat == args.repeats - 1
        for i, s in enumerate(runnable):
            print(f"[{repeat * len(runnable) + i + 1}/{total}] {s.section} {s.name} N={s.n} {s.policy} "
                  f"(elapsed {time.monotonic() - started:.1f} s)", flush=True)
            got = measure(s, args, flags[s.spec["script"]])
            if got is not None:
                file_launch(s, got, args.device)
            done = rows_of(s, runnable, args.device) if last else []
            if done and not args.header_printed:
                print(table_header(), flush=True)
                args.header_printed = True
            for r in done:
                print(row_line(r), flush=True)

# ---------------------------------------------------------------- memory: DDP, ZeRO and FSDP2 at one model size
# One model size for all three: the Transformer of about 10.7 M parameters (d_model 384, 6 blocks), and
# ddp_uneven.py's MLP at width 1636 (10.8 M): what differs is which of the 16 bytes a parameter (fp32
# weights 4, gradients 4, AdamW's two moments 8) each rank keeps. Short runs: the bytes are counted after the
# first step, the peak is measured over the run.
MEMORY_TRANSFORMER = ["--d_model", "384", "--num_layers", "6", "--num_heads", "6", "--block_size", "64",
                      "--batch_size", "2", "--max_steps", "3", "--sample", "0", "--log_every", "0"]
# FSDP2 records every allocation of its whole run (--profile_memory), so its peak includes the end: the
# sample, the export-free replica check, the exit; its gradients are measured (tensors alive after backward).
# Under --grad_accum 2 the two ways FSDP2 can hold the gradients between micro-batches, at N = 2 only.
FSDP_MEMORY = [*MEMORY_TRANSFORMER, "--profile_memory"]
MEMORY_RUNS = (  # name, script, flags, formula per rank of (parameters, gradients, optimizer state), the Ns
    ("DDP", "ddp_transformer.py", MEMORY_TRANSFORMER, ("4P", "4P", "8P"), (1, 2, 4)),
    ("ZeRO", "ddp_uneven.py", ["--zero", "--width", "1636", "-e", "1", "--samples", "256"], ("4P", "4P", "8P/N"),
     (1, 2, 4)),
    ("FSDP2", "fsdp_transformer.py", FSDP_MEMORY, ("4P/N", "4P/N", "8P/N"), (1, 2, 4)),
    ("FSDP2 K=2 unsharded", "fsdp_transformer.py", [*FSDP_MEMORY, "--grad_accum", "2"], ("4P/N", "4P", "8P/N"), (2,)),
    ("FSDP2 K=2 sharded", "fsdp_transformer.py", [*FSDP_MEMORY, "--grad_accum", "2", "--accumulate", "sharded"],
     ("4P/N", "4P/N", "8P/N"), (2,)),
)


def memory_formula(formula, params, n):
    return 4 * params * (2 if formula.startswith("8") else 1) / (n if formula.endswith("/N") else 1)


def memory_run(name, script, flags, n, args, folder, repeat=0):
    """One launch at N processes; its metrics (this rank's bytes: rank 0's), or None with a note."""
    name = f"{name.replace(' ', '_')}-{repeat}"  # each repeat its own checkpoint: none continues another
    metrics = os.path.join(folder, f"{name}-{n}.json")
    if script != "ddp_uneven.py":  # a short text: the validation passes before and after are a few batches
        text = os.path.join(folder, "text.txt")
        with open(text, "w", encoding="utf-8") as f:
            f.write(default_text(BENCHMARKS["transformer"])[:12_000])
        flags = [*flags, "--data", text]
    cmd = [*torchrun_cmd(), "--standalone", f"--nproc-per-node={n}", os.path.join(HERE, script),
           "--device", args.device, *flags, "--checkpoint", os.path.join(folder, f"{name}-{n}.ck"),
           "--metrics", metrics]
    started = time.monotonic()
    code, out, err = run_bounded(cmd, folder, launch_env(args.device, None, n), args.timeout)
    print(f"[memory] {name} N={n}: exit {code} in {time.monotonic() - started:.0f} s", flush=True)
    if code != 0:
        print(f"FAILED {name} N={n}: {(err or out).strip().splitlines()[-1:]}", flush=True)
        return None
    with open(metrics) as f:
        return json.load(f)


def memory_plan(args):
    """MEMORY_RUNS as (name, script, flags, formulas, N), each N that fits: on GPUs one GPU a process (a
    torchrun of more processes than GPUs fails its LOCAL_RANK check); one line for each N left out."""
    fits = [(*run[:4], n) for run in MEMORY_RUNS for n in run[4]]
    kept = [run for run in fits if args.device != "cuda" or run[4] <= args.gpus]
    for name, *_, n in (run for run in fits if run not in kept):
        print(f"[memory] {name} N={n}: skipped: {args.gpus} GPU(s) here, and each process needs its own", flush=True)
    return kept


def memory_section(args):
    """Bytes per rank of DDP / ZeRO / FSDP2 at N = 1, 2, 4 (those that fit), measured beside the formula;
    1 if a run failed."""
    rows, failed = [], False
    with tempfile.TemporaryDirectory() as folder:
        for name, script, flags, formulas, n in memory_plan(args):
            runs = [memory_run(name, script, flags, n, args, folder, i) for i in range(args.repeats)]
            if None in runs:
                failed = True
                continue
            m, peaks = runs[0], sorted(r["peak_memory_bytes"] for r in runs)
            params = m.get("params") or m["param_bytes"] // 4  # the MLP's metrics hold its bytes only
            rows.append({"run": name, "world_size": n, "params": params,
                         "peak_memory_bytes": peaks[len(peaks) // 2], "peak_memory_runs": peaks,
                         "grad_bytes_measured": script == "fsdp_transformer.py",
                         **{k: m[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes")},
                         **{f"{k}_formula": memory_formula(f, params, n) for k, f in
                            zip(("param_bytes", "grad_bytes", "optimizer_bytes"), formulas)},
                         "formulas": formulas, "device": m["device"], "torch": m["torch"]})
    print_memory_table(rows)
    write_json(args.memory_out, rows)
    print(f"wrote {len(rows)} rows to {os.path.abspath(args.memory_out)}", flush=True)
    return 1 if failed else 0


def print_memory_table(rows):
    mib = 2 ** 20
    print("\nmemory per rank (rank 0), MiB: measured (formula; P parameters, N processes)")
    print(f"{'run':<20} {'N':>2} {'P (M)':>6}  {'parameters':>20} {'gradients':>20} {'optimizer':>20} "
          f"{'sum':>8} {'peak: median (min-max)':>24}")
    for r in rows:
        cells = [f"{r[k] / mib:7.1f} ({f} {r[k + '_formula'] / mib:6.1f})" for k, f in
                 zip(("param_bytes", "grad_bytes", "optimizer_bytes"), r["formulas"])]
        total = sum(r[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes"))
        runs = r["peak_memory_runs"]
        peak = f"{r['peak_memory_bytes'] / mib:.1f} ({runs[0] / mib:.1f}-{runs[-1] / mib:.1f})"
        print(f"{r['run']:<20} {r['world_size']:>2} {r['params'] / 1e6:6.2f}  {' '.join(f'{c:>20}' for c in cells)} "
              f"{total / mib:8.1f} {peak:>24}")
    print(f"peak: the most bytes of tensors alive at once on rank 0, the median of {len(rows[0]['peak_memory_runs'])} "
          "runs (CPU: torch.profiler's allocations and frees, over the first two steps for DDP and ZeRO, the whole "
          "run for FSDP2; GPU: max_memory_allocated); FSDP2's gradients are measured (tensors alive after the "
          "backward), the other columns counted from the tensors" if rows else "no rows")


def main():
    args = check_args(parse_args())
    if args.memory:
        sys.exit(memory_section(args))
    # a SIGTERM unwinds like Ctrl-C, so the launch in flight is killed with all its processes
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started, load_before = time.monotonic(), os.getloadavg()
    started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if load_before[0] > cores() / 2:
        print(f"note: load average {load_before[0]:.2f} on {cores()} cores: other work is running, "
              f"the figures will not be representative", flush=True)
    notes = []
    runnable, flags = runnable_settings(plan(args), args, notes)
    print_plan(runnable, args, time.monotonic() - started)
    stopped, args.header_printed = None, False
    try:
        run_plan(runnable, flags, args, started)
    except (KeyboardInterrupt, SystemExit) as e:  # Ctrl-C or SIGTERM: keep what was measured
        stopped = e.code if isinstance(e, SystemExit) else 130
        notes.append("INTERRUPTED: the table holds the runs finished so far")
    failures = [f"FAILED {s.section} {s.name} N={s.n} {s.policy}: {f}" for s in runnable for f in s.failures]
    notes += [f"note: {s.name} N={s.n}: {s.spec['key']} as {s.spec['script']} reports it (it writes no "
              f"steady_{s.spec['key']} and prints no epoch lines): warm-up may be included"
              for s in runnable if "whole run" in s.how] + workload_notes(runnable)
    rows = rows_from(runnable, args.device)
    if args.quick:
        print("\nQUICK: tiny workloads, one run each: every row is a plumbing check, not a measurement", flush=True)
    print_table(rows, notes + failures, args, load_before)
    answer = answer_lines(rows, args.device, args.quick)
    for line in answer:
        print(line, flush=True)
    record = run_record(args, started_at, load_before, time.monotonic() - started)
    write_json(args.out, {"run": record, "rows": rows, "answer": answer})
    print(f"wrote {len(rows)} rows to {os.path.abspath(args.out)} in {time.monotonic() - started:.0f} s", flush=True)
    if stopped is not None or failures:
        sys.exit(stopped or 1)


if __name__ == "__main__":
    main()
