"""What DDP buys you on this machine: scaling efficiency, DP against DDP, and the thread policy.

Runs the collection's scripts the way users do (mp.spawn scripts with `python`, the
Transformer with `torchrun`), reads the throughput from their `--metrics` files, and
reports the median of several runs:

- scaling: E(N) = throughput(N processes) / (N x throughput(1 process)) for the MLP
  (dp_baseline.py --ddp), the MNIST ConvNet (ddp_main.py, synthetic data) and the
  Transformer (ddp_transformer.py), for N = 1, 2, 4, ... up to the GPU count, or 1 and 2
  on a CPU machine, where the scripts split the cores evenly between the processes.
  Every process keeps the same work per step (weak scaling), as with one GPU each.
- dp_vs_ddp: dp_baseline.py --compare, the same model, data and global batch trained
  by one process (DataParallel, or the plain module) and by DDP.
- threads (CPU only): the automatic split against OMP_NUM_THREADS set by hand, e.g. 2
  threads in each of 2 processes on 2 cores (oversubscribed) or 1 thread in 1 process.

Every row's efficiency is its throughput / (N x the same benchmark's 1-process figure
with the automatic thread split), so 1.0 is perfect scaling and, at equal N, a higher
figure is a faster setting. Warm-up is excluded: the figure is the script's
steady-state throughput (after the first epoch, or the first step for the
Transformer). Missing scripts or flags skip their rows with a note; a failed run is
reported and makes the exit code 1.

Usage:
    bash run.sh bench                   # or: python bench.py
    python bench.py --quick             # one run each of tiny workloads: checks the plumbing, not speed
    python bench.py --repeats 5 --only mlp,convnet
Writes bench_results.json (a list of rows: benchmark, mode, world_size,
threads_per_process, throughput, unit, efficiency, plus section, thread_policy, runs)
in the working directory. Measure on a quiet machine: the load average is printed.
"""

# ---------------------------------------------------------------- imports
import argparse
import datetime
import json
import os
import platform
import re
import signal
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


# ---------------------------------------------------------------- the benchmarks
def mlp_sizes(n, quick):
    # dp_baseline.py's --batch_size is global: 256 per process, as many steps per process at any N
    per_process = 2048 if quick else 16384
    return {"--epochs": 2 if quick else 6, "--batch_size": 256 * n, "--samples": per_process * n}


def convnet_sizes(n, quick):
    per_process = 512 if quick else 4096
    return {"--epochs": 2 if quick else 4, "--train_samples": per_process * n,
            "--test_samples": 128 if quick else 1000}


def transformer_sizes(n, quick):
    # --max_steps ends the run (at any N: steps are per process), epochs only bound it
    return {"--max_steps": 5 if quick else 60, "--epochs": 100, "--sample": 0, "--log_every": 0}


# name: script, launcher, required flags, metrics key, unit, workload per process count
BENCHMARKS = {
    "mlp": dict(script="dp_baseline.py", launcher="spawn", required=["--ddp"],
                key="samples_per_s", unit="samples/s", sizes=mlp_sizes),
    "convnet": dict(script="ddp_main.py", launcher="spawn", required=["--dataset", "synthetic"],
                    key="samples_per_s", unit="samples/s", sizes=convnet_sizes),
    "transformer": dict(script="ddp_transformer.py", launcher="torchrun", required=[],
                        key="tokens_per_s", unit="tokens/s", sizes=transformer_sizes),
}
COMPARE = dict(script="dp_baseline.py", launcher="python", required=["--compare"],
               key="samples_per_s", unit="samples/s", sizes=mlp_sizes)
EPOCH_LINE = re.compile(r"^epoch (\d+)/\d+ \|.*?\| ([\d.]+) samples/s \|", re.MULTILINE)


# ---------------------------------------------------------------- arguments
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])  # each help states its default
    p.add_argument("--quick", action="store_true",
                   help="one run of each setting on tiny workloads; only the MLP gets every setting, "
                        "the other scripts run once at the largest N: checks that everything runs "
                        "(tests), measures nothing")
    p.add_argument("--repeats", type=int, default=None, metavar="N",
                   help="runs per setting; the figure is their median (default: 3, 1 with --quick)")
    p.add_argument("--only", default=",".join([*BENCHMARKS, "dp_vs_ddp"]), metavar="NAMES",
                   help="comma-separated subset of: %(default)s (default: all)")
    p.add_argument("--no-threads", dest="threads", action="store_false",
                   help="skip the thread-policy rows (CPU)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto (default): the GPUs when there are any, else CPU")
    p.add_argument("--max_nprocs", type=int, default=None, metavar="N",
                   help="largest process count (default: the GPU count, 2 on CPU)")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="limit for each launch; it is killed with all its processes after that "
                        "(default: 600, 300 with --quick)")
    p.add_argument("--out", default="bench_results.json", metavar="PATH", help="where to write the rows (default: %(default)s)")
    return p.parse_args(argv)


def fail(what, fix):
    """Bad input: one line on stderr and exit code 2, never a traceback."""
    print(f"error: {what} ({fix})", file=sys.stderr, flush=True)
    sys.exit(2)


def check_args(args):
    args.repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    args.timeout = args.timeout if args.timeout is not None else (300 if args.quick else 600)
    if args.repeats <= 0:
        fail(f"--repeats must be a positive integer, got {args.repeats}", "pass --repeats 1 or more")
    if not args.timeout > 0:
        fail(f"--timeout must be positive, got {args.timeout}", "pass e.g. --timeout 600")
    args.only = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(args.only) - {*BENCHMARKS, "dp_vs_ddp"})
    if unknown:
        fail(f"unknown benchmark(s) {', '.join(unknown)}", f"pick from {', '.join([*BENCHMARKS, 'dp_vs_ddp'])}")
    gpus = torch.cuda.device_count()
    if args.device == "auto":
        args.device = "cuda" if gpus > 0 else "cpu"
    if args.device == "cuda" and gpus == 0:
        fail("--device cuda but no GPU is visible", "use --device cpu, or check CUDA_VISIBLE_DEVICES")
    limit = gpus if args.device == "cuda" else 2
    args.max_nprocs = args.max_nprocs or limit
    if not 1 <= args.max_nprocs <= (gpus if args.device == "cuda" else os.cpu_count() or 1):
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


def launch_env(device, omp_threads):
    """A clean environment: no rendezvous left over from a caller, the thread policy under test."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "OMP_NUM_THREADS", "TORCHELASTIC_RESTART_COUNT"):
        env.pop(name, None)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    if omp_threads is not None:
        env["OMP_NUM_THREADS"] = str(omp_threads)
    return env


def kill_session(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_bounded(cmd, cwd, env, timeout):
    """Run `cmd` in its own session; returns (exit code or None on timeout, stdout, stderr).

    The whole session is killed at the end, whatever happened (a timeout, Ctrl-C, SIGTERM),
    so no launcher or worker outlives it.
    """
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, text=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        kill_session(proc)
        out, err = proc.communicate()
        return None, out, err
    finally:
        kill_session(proc)


def script_flags(script, timeout):
    """The options a script's --help lists, or (None, why) when it cannot say."""
    path = HERE / script
    if not path.exists():
        return None, f"{script} not found"
    with tempfile.TemporaryDirectory() as tmp:
        code, out, err = run_bounded([sys.executable, str(path), "--help"], tmp, launch_env("cpu", None), timeout)
    if code != 0:
        last = (err.strip().splitlines() or ["no output"])[-1]
        return None, f"{script} --help failed (exit {code}: {last})"
    return set(re.findall(r"(?<![\w-])(--[A-Za-z][\w-]*)", out)), None


def command(spec, flags, device, n, quick):
    """The launch command, with the workload flags the script understands; (None, why) if it lacks one it needs."""
    needed = ["--device", "--metrics", *(a for a in spec["required"] if a.startswith("--")),
              *(["--nprocs"] if spec["launcher"] == "spawn" else [])]
    missing = [f for f in needed if f not in flags]
    if missing:
        return None, f"{spec['script']} has no {', '.join(missing)}"
    extra = []
    for flag, value in spec["sizes"](n, quick).items():
        if flag in flags:
            extra += [flag, str(value)]
    base = [str(HERE / spec["script"]), *spec["required"], "--device", device, *extra]
    if spec["launcher"] == "torchrun":
        return [*torchrun_cmd(), "--standalone", f"--nproc-per-node={n}", *base], None
    return [sys.executable, *base, *(["--nprocs", str(n)] if spec["launcher"] == "spawn" else [])], None


def steady_throughput(record, stdout, key):
    """Throughput without warm-up: the script's steady figure, else its epoch lines after the first."""
    if isinstance(record.get(f"steady_{key}"), (int, float)):
        return record[f"steady_{key}"], "steady"
    epochs = [(int(e), float(rate)) for e, rate in EPOCH_LINE.findall(stdout)]
    rates = [rate for e, rate in epochs if e > 1]
    if key == "samples_per_s" and rates and min(rates) > 0:
        return len(rates) / sum(1 / r for r in rates), "epoch lines"  # equal epochs: the harmonic mean
    return record.get(key), "whole run"


# ---------------------------------------------------------------- the plan
class Setting:
    """One row to measure: a benchmark at N processes under a thread policy."""

    def __init__(self, section, name, spec, n, omp_threads, mode="ddp"):
        self.section, self.name, self.spec, self.n, self.omp = section, name, spec, n, omp_threads
        self.mode = mode
        self.parts, self.failures, self.how = {}, [], set()  # parts: mode -> world, threads, runs

    @property
    def policy(self):
        return "auto" if self.omp is None else f"OMP_NUM_THREADS={self.omp}"


def process_counts(max_n):
    counts = [1]
    while counts[-1] * 2 < max_n:
        counts.append(counts[-1] * 2)
    return counts + [max_n] if max_n > 1 else counts


def plan(args):
    """The settings to measure, in the order of the table."""
    settings = []
    for name in (b for b in BENCHMARKS if b in args.only):
        spec, full = BENCHMARKS[name], name == "mlp" or not args.quick  # --quick: the MLP covers the rest
        counts = process_counts(args.max_nprocs) if full else [args.max_nprocs]
        settings += [Setting("scaling", name, spec, n, None) for n in counts]
        if args.threads and args.device == "cpu" and full:
            for n in sorted({1, args.max_nprocs}):
                auto = max(1, cores() // n)
                settings += [Setting("threads", name, spec, n, t) for t in sorted({1, cores()} - {auto})]
    if "dp_vs_ddp" in args.only:
        settings.append(Setting("dp_vs_ddp", "mlp", COMPARE, args.max_nprocs, None, mode="compare"))
    return settings


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
    """One launch of a setting; appends its figure (or the reason it has none)."""
    spec = setting.spec
    with tempfile.TemporaryDirectory() as tmp:  # the launch's cwd: its checkpoints go with it
        metrics = os.path.join(tmp, "metrics.json")
        cmd = command(spec, flags, args.device, setting.n, args.quick)[0] + ["--metrics", metrics]
        code, out, err = run_bounded(cmd, tmp, launch_env(args.device, setting.omp), args.timeout)
        if code != 0:
            last = (err.strip().splitlines() or ["no output"])[-1]
            setting.failures.append(f"{spec['script']}: " + (f"timed out after {args.timeout:.0f} s"
                                                            if code is None else f"exit {code}: {last}"))
            return None
        try:
            with open(metrics) as f:
                record = json.load(f)
        except (OSError, ValueError) as e:
            setting.failures.append(f"no metrics from {spec['script']} ({e})")
            return None
    return record, out


def file_run(setting, record, out, device):
    """File one launch's figures; a --compare launch holds two runs (one process, then DDP)."""
    parts = record["compare"] if setting.mode == "compare" else [record]
    for part in parts:
        mode = part.get("mode", "ddp")
        figure, how = steady_throughput(part, out if len(parts) == 1 else "", setting.spec["key"])
        if not isinstance(figure, (int, float)) or figure <= 0:
            setting.failures.append(f"{setting.spec['script']} wrote no positive {setting.spec['key']}")
            return
        entry = setting.parts.setdefault(mode, {
            "world": part["dp_devices"] if mode == "dp" else part["world_size"],
            "threads": part.get("threads_per_process", expected_threads(setting, device)), "runs": []})
        entry["runs"].append(figure)
        setting.how.add(how)


# ---------------------------------------------------------------- results
def rows_from(settings):
    """Median figures, then every row's efficiency against its benchmark's 1-process row."""
    rows = [row(s, mode, p["world"], p["threads"], p["runs"]) for s in settings for mode, p in s.parts.items()]
    reference = {r["benchmark"]: r["throughput"] for r in rows
                 if r["section"] == "scaling" and r["world_size"] == 1}
    for r in rows:
        ref = reference.get(r["benchmark"])
        r["efficiency"] = r["throughput"] / (r["world_size"] * ref) if ref else None
    return rows


def row(setting, mode, world, threads, figures):
    return {"benchmark": setting.name, "mode": mode, "world_size": world, "threads_per_process": threads,
            "throughput": statistics.median(figures), "unit": setting.spec["unit"], "efficiency": None,
            "section": setting.section, "thread_policy": setting.policy, "runs": figures}


def print_table(rows, notes, args, load_before):
    print(f"\nbench: {datetime.datetime.now().isoformat(timespec='minutes')} | {platform.node()} | "
          f"{cores()} cores | torch {torch.__version__} | {args.device} | median of {args.repeats} "
          f"| load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after")
    head = f"{'section':10} {'benchmark':12} {'mode':6} {'N':>3} {'threads':>8} {'policy':18} " \
           f"{'throughput':>12} {'unit':10} {'E(N)':>6}  runs"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        eff = f"{r['efficiency']:.2f}" if r["efficiency"] is not None else "-"
        threads = r["threads_per_process"] if r["threads_per_process"] is not None else "-"
        print(f"{r['section']:10} {r['benchmark']:12} {r['mode']:6} {r['world_size']:>3} {threads:>8} "
              f"{r['thread_policy']:18} {r['throughput']:>12.0f} {r['unit']:10} {eff:>6}  "
              f"{' '.join(f'{x:.0f}' for x in r['runs'])}")
    for line in dict.fromkeys(summary_lines(rows) + notes):  # each note once
        print(line)


def summary_lines(rows):
    """The answers the table holds: E(N), auto against the best manual split, DDP against DP."""
    lines = []
    by = {(r["section"], r["benchmark"], r["world_size"], r["thread_policy"]): r for r in rows}
    for r in rows:
        if r["section"] == "scaling" and r["world_size"] > 1 and r["efficiency"] is not None:
            one_thread = by.get(("threads", r["benchmark"], 1, f"OMP_NUM_THREADS={r['threads_per_process']}"))
            per_core = (f"; against 1 process with the same {r['threads_per_process']} thread(s): "
                        f"{r['throughput'] / (r['world_size'] * one_thread['throughput']):.2f}" if one_thread else "")
            lines.append(f"{r['benchmark']}: E({r['world_size']}) = {r['efficiency']:.2f} against 1 process "
                         f"with the automatic thread count{per_core}")
    for r in rows:
        if r["section"] == "scaling" and r["thread_policy"] == "auto":
            manual = [m for (sec, b, n, pol), m in by.items() if sec == "threads" and b == r["benchmark"]
                      and n == r["world_size"]]
            if manual:
                best = max(manual, key=lambda m: m["throughput"])
                lines.append(f"{r['benchmark']}, {r['world_size']} process(es): automatic split "
                             f"({r['threads_per_process']} thread(s)) at {r['throughput'] / best['throughput']:.0%} "
                             f"of the best manual setting ({best['thread_policy']})")
    pair = [r for r in rows if r["section"] == "dp_vs_ddp"]
    if len(pair) == 2:
        lines.append(f"dp_vs_ddp: {pair[1]['mode']} ({pair[1]['world_size']}) / {pair[0]['mode']} "
                     f"({pair[0]['world_size']}) = {pair[1]['throughput'] / pair[0]['throughput']:.2f}x "
                     f"at the same global batch")
    return lines


def write_json(path, record):
    """Write atomically: a reader never sees half a file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=2)
    os.replace(tmp, path)


# ---------------------------------------------------------------- main
def runnable_settings(settings, args, notes):
    """The settings whose script exists and has the flags it needs; a note for every other one."""
    flags, runnable = {}, []
    for s in settings:
        script = s.spec["script"]
        if script not in flags:
            flags[script], why = script_flags(script, args.timeout)
            if why:
                notes.append(f"skipped {script}: {why}")
        why = flags[script] is not None and command(s.spec, flags[script], args.device, s.n, args.quick)[1]
        if why:
            notes.append(f"skipped {s.name} ({s.section}): {why}")
        elif flags[script] is not None:
            runnable.append(s)
    return runnable, flags


def main():
    args = check_args(parse_args())
    # a SIGTERM unwinds like Ctrl-C, so the launch in flight is killed with its workers
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    load_before = os.getloadavg()
    if load_before[0] > cores() / 2:
        print(f"note: load average {load_before[0]:.2f} on {cores()} cores: other work is running, "
              f"the figures will not be representative", flush=True)
    notes = []
    runnable, flags = runnable_settings(plan(args), args, notes)
    stopped = None
    try:
        # repeats go round the settings, so a change in the machine's load spreads over all of them
        for repeat in range(args.repeats):
            for s in runnable:
                print(f"[{repeat + 1}/{args.repeats}] {s.section} {s.name} N={s.n} {s.policy}", flush=True)
                got = measure(s, args, flags[s.spec["script"]])
                if got is not None:
                    file_run(s, *got, args.device)
    except (KeyboardInterrupt, SystemExit) as e:  # Ctrl-C or SIGTERM: keep what was measured
        stopped = e.code if isinstance(e, SystemExit) else 130
        notes.append("INTERRUPTED: the table holds the runs finished so far")
    failures = [f"FAILED {s.section} {s.name} N={s.n} {s.policy}: {f}" for s in runnable for f in s.failures]
    notes += [f"note: {s.name} N={s.n}: {s.spec['key']} as {s.spec['script']} reports it (it writes no "
              f"steady_{s.spec['key']} and prints no epoch lines): warm-up may be included"
              for s in runnable if "whole run" in s.how]
    rows = rows_from(runnable)
    print_table(rows, notes + failures, args, load_before)
    write_json(args.out, rows)
    print(f"wrote {len(rows)} rows to {os.path.abspath(args.out)}", flush=True)
    if stopped is not None or failures:
        sys.exit(stopped or 1)


if __name__ == "__main__":
    main()
