"""dp_baseline.py learns and compares, bench.py writes well-formed results: run as users run them.

Everything runs on CPU (the `launch` fixture hides the GPUs) in a temporary directory,
bounded by a timeout. No test asserts a speed: only that the figures exist and are positive
(and that two jobs of one launch start together).
"""
import argparse
import datetime
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from conftest import alive, cpu_env, descendants

ROOT = Path(__file__).resolve().parent
CONTRACT_KEYS = {"script", "world_size", "backend", "device", "epochs", "steps", "steps_per_epoch",
                 "elapsed_s", "samples_per_s", "first_loss", "final_loss", "replicas_in_sync",
                 "resumed_from_epoch", "mode", "dp_devices"}


def assert_learned(record, epochs):
    """Loss fell and the held-out accuracy is far above always answering the most common class."""
    assert CONTRACT_KEYS <= record.keys(), CONTRACT_KEYS - record.keys()
    assert record["epochs"] == epochs and len(record["losses"]) == epochs
    assert record["final_loss"] < 0.5 * record["first_loss"], record["losses"]
    assert 0.05 < record["chance_accuracy"] < 0.3
    assert record["test_accuracy"] > record["chance_accuracy"] + 0.3, record
    assert record["replicas_in_sync"] is True
    assert record["samples_per_s"] > 0 and record["steady_samples_per_s"] > 0
    assert record["peak_memory_mb"] > 0


@pytest.mark.slow  # the default suite: --compare below trains the same plain run (and DDP) and checks both learn
def test_dp_baseline_learns_on_cpu(launch, script, metrics, tmp_path):
    out = launch([sys.executable, script("dp_baseline.py"), "--device", "cpu", "--metrics", "m.json"],
                 timeout=300)
    m = metrics(tmp_path / "m.json")
    assert_learned(m, epochs=5)
    assert (m["mode"], m["dp_devices"], m["world_size"], m["backend"]) == ("plain", 0, 1, None)
    assert m["steps"] == 5 * m["steps_per_epoch"] == 5 * 8192 // 256
    assert "DataParallel needs two or more GPUs" in out.stdout
    assert sum(line.startswith("epoch ") for line in out.stdout.splitlines()) == 5
    assert out.stdout.strip().splitlines()[-1].startswith("done: dp_baseline.py")


def test_compare_trains_both_modes_to_the_same_model(launch, script, metrics, tmp_path):
    out = launch([sys.executable, script("dp_baseline.py"), "--device", "cpu", "--compare",
                  "--metrics", "m.json"], timeout=400)
    m = metrics(tmp_path / "m.json")
    single, ddp = m["compare"]
    assert (single["mode"], ddp["mode"], m["mode"]) == ("plain", "ddp", "ddp")
    assert (single["world_size"], ddp["world_size"], ddp["backend"]) == (1, 2, "gloo")
    assert (single["batch_size_per_process"], ddp["batch_size_per_process"]) == (256, 128)
    # the single run in a process of its own, as the DDP ranks are: the parent never held a device
    assert single["parent_pid"] == ddp["parent_pid"] and single["pid"] != ddp["pid"], (single, ddp)
    for record in (single, ddp):
        assert_learned(record, epochs=5)
    # the same global batches in the same order: the same optimizer steps, the same losses
    assert single["steps"] == ddp["steps"]
    assert ddp["losses"] == pytest.approx(single["losses"], abs=1e-3)
    assert "peak memory per process" in out.stdout and "replicas: in sync" in out.stdout
    assert "DataParallel needs two or more GPUs" in out.stdout  # the single run on CPU: the plain module
    assert out.stdout.strip().splitlines()[-1].startswith("done: dp_baseline.py")


def import_bench():
    sys.path.insert(0, str(ROOT))
    import bench
    return bench


def test_bad_input_is_one_line_and_exit_2(launch, script):
    """The whole path once: a bad --only ends `python bench.py` before any launch, one line, exit 2."""
    out = launch([sys.executable, script("bench.py"), "--only", "mlp,nonesuch"], timeout=120, check=False)
    assert out.returncode == 2, out
    assert out.stderr.startswith("error: ") and len(out.stderr.strip().splitlines()) == 1, out
    assert "unknown benchmark(s) nonesuch" in out.stderr and "Traceback" not in out.stderr
    assert out.stdout == "", "nothing ran"


def one_error_line(check, capsys):
    """check() in this process: exit code 2 and one `error:` line on stderr, nothing else."""
    with pytest.raises(SystemExit) as stop:
        check()
    err = capsys.readouterr().err
    assert stop.value.code == 2
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("argv,says", [(["--compare", "--batch_size", "255"], "does not split evenly"),
                                       (["--ddp", "--compare"], "exclude each other")])
def test_dp_baseline_bad_input_is_one_line_and_exit_2(argv, says, capsys, monkeypatch):
    sys.path.insert(0, str(ROOT))
    import dp_baseline
    monkeypatch.delenv("RANK", raising=False)  # rank 0 says it
    assert says in one_error_line(lambda: dp_baseline.check_args(dp_baseline.parse_args(argv)), capsys)


@pytest.mark.parametrize("argv,says", [(["--repeats", "0"], "--repeats must be a positive integer"),
                                       (["--timeout", "0"], "--timeout must be positive"),
                                       (["--max_nprocs", "999"], "--max_nprocs 999 does not fit"),
                                       (["--all", "--only", "mlp,zer0"], "unknown benchmark(s) zer0")])
def test_bench_bad_input_is_one_line_and_exit_2(argv, says, capsys):
    bench = import_bench()
    assert says in one_error_line(lambda: bench.check_args(bench.parse_args(argv)), capsys)


@pytest.mark.parametrize("gpus", [1, 2, 3, 4, 8])
def test_bench_memory_runs_only_the_process_counts_it_has_gpus_for(gpus, capsys):
    """A torchrun of more processes than GPUs fails its LOCAL_RANK check: on 2 or 3 GPUs the N=4 runs
    went missing and bench exited 1. Told how many GPUs there are, it plans the Ns that fit, one line
    for each left out; on the CPU every N runs (the memory counts need no core of their own)."""
    bench = import_bench()
    every = [(name, n) for name, *_, ns in bench.MEMORY_RUNS for n in ns]
    plan = bench.memory_plan(argparse.Namespace(device="cuda", gpus=gpus))
    assert [(name, n) for name, *_, n in plan] == [(name, n) for name, n in every if n <= gpus]
    assert all(len(run) == 5 and run[1].endswith(".py") for run in plan)
    skipped = capsys.readouterr().out.splitlines()
    assert skipped == [f"[memory] {name} N={n}: skipped: {gpus} GPU(s) here, and each process needs its own"
                       for name, n in every if n > gpus]
    assert len(bench.memory_plan(argparse.Namespace(device="cpu", gpus=0))) == len(every)


def bench_command():
    """`bash run.sh bench --quick`, the MLP only: its scaling rows and its limit (3 launches, mostly
    start-up, about 30 s); every other section in the slow tier, and their arithmetic below on
    made-up figures."""
    return ["bash", str(ROOT / "run.sh"), "bench", "--quick", "--only", "mlp"]


def assert_well_formed(rows, units=("samples/s", "tokens/s"), modes=("ddp", "plain", "dp")):
    assert isinstance(rows, list) and rows
    for row in rows:
        assert {"benchmark", "mode", "world_size", "threads_per_process", "throughput", "unit",
                "efficiency", "limit_efficiency", "of_limit"} <= row.keys(), row
        assert row["mode"] in modes and row["unit"] in units
        assert isinstance(row["world_size"], int) and row["world_size"] >= 1
        assert isinstance(row["threads_per_process"], int) and row["threads_per_process"] >= 1  # CPU
        assert math.isfinite(row["throughput"]) and row["throughput"] > 0, row
        assert row["throughput"] == sorted(row["runs"])[len(row["runs"]) // 2]  # one run: its figure
        assert row["efficiency"] is None or row["efficiency"] > 0


def assert_limit(row, one):
    """An N-process scaling row's limit: N one-process runs summed, against N x the 1-process row."""
    n = row["world_size"]
    assert len(row["limit_per_process"]) == len(row["limit_runs"]) == len(row["runs"])
    assert all(len(runs) == n and min(runs) > 0 for runs in row["limit_per_process"])
    assert row["limit_runs"] == pytest.approx([sum(runs) for runs in row["limit_per_process"]])
    assert row["limit_throughput"] == sorted(row["limit_runs"])[len(row["limit_runs"]) // 2]
    assert row["limit_efficiency"] > 0
    assert row["limit_efficiency"] == pytest.approx(row["limit_throughput"] / (n * one["throughput"]))
    assert row["of_limit"] == pytest.approx(row["efficiency"] / row["limit_efficiency"])


@pytest.mark.timeout(700)  # its launches' own bounds first
def test_bench_quick_writes_well_formed_results(launch, tmp_path):
    (tmp_path / "bench_results.json").write_text("a full run's results")
    out = launch(bench_command(), timeout=600)
    assert (tmp_path / "bench_results.json").read_text() == "a full run's results", "--quick overwrote a full result"
    result = json.loads((tmp_path / "bench_quick.json").read_text())
    rows = result["rows"]
    assert_well_formed(rows)
    assert_run_recorded(result["run"], "--quick --only mlp")
    # a quick run's rows are plumbing checks, in the JSON, the table and the answer
    assert all(r["plumbing_check"] is True for r in rows) and result["run"]["plumbing_check"] is True
    assert "QUICK: tiny workloads, one run each: every row is a plumbing check, not a measurement" in out.stdout
    by = {(r["section"], r["benchmark"], r["mode"], r["world_size"], r["thread_policy"]): r for r in rows}
    assert by.keys() == {("scaling", "mlp", "ddp", 1, "OMP_NUM_THREADS=1"),
                         ("scaling", "mlp", "ddp", 2, "OMP_NUM_THREADS=1")}
    assert {r["benchmark"] for r in rows} == {"mlp"}, "--only picks the benchmarks"
    # the plan first, then a progress line before each launch, in order, with the time since the start
    lines = [line for line in out.stdout.splitlines() if not line.startswith("note: load average")]
    assert lines[0].startswith("plan: 3 launches (3 settings x 1 repeat), 9 processes; about "), lines[0]
    progress = [line for line in lines if line.startswith("[")]
    assert [p.split(" (elapsed ")[0] for p in progress] == [
        "[1/3] scaling mlp N=1 OMP_NUM_THREADS=1", "[2/3] limit mlp N=2 OMP_NUM_THREADS=1",
        "[3/3] scaling mlp N=2 OMP_NUM_THREADS=1"]
    elapsed = [float(p.split(" (elapsed ")[1].rstrip(" s)")) for p in progress]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0
    # E(N) is per worker: N 1-thread processes against the 1 process x 1 thread row
    one, two = by["scaling", "mlp", "ddp", 1, "OMP_NUM_THREADS=1"], by["scaling", "mlp", "ddp", 2, "OMP_NUM_THREADS=1"]
    assert (one["threads_per_process"], two["threads_per_process"], one["efficiency"]) == (1, 1, 1.0)
    assert two["efficiency"] == pytest.approx(two["throughput"] / (2 * one["throughput"]))
    assert (one["limit_efficiency"], one["of_limit"], one["limit_runs"]) == (None, None, [])
    assert_limit(two, one)
    assert f"mlp: E(2) = {two['efficiency']:.2f}, limit {two['limit_efficiency']:.2f}, {two['of_limit']:.2f} " \
           f"of the limit (2 processes, 1 thread each" in out.stdout
    # each row printed as soon as its last run is in (before the next launch), and again in the table
    bench = import_bench()
    for r, before in ((one, progress[1]), (two, "bench: ")):
        line = bench.row_line(r)
        assert out.stdout.count(line + "\n") == 2 and out.stdout.index(line) < out.stdout.index(before), line
    assert f"{two['efficiency']:.2f}   {two['limit_efficiency']:.2f}    {two['of_limit']:.2f}  " in bench.row_line(two)
    assert "different steps per process" not in out.stdout, "the limit runs took the steps of one rank"
    assert all(bench.row_line(r).endswith(" | plumbing check") for r in rows)
    # the summary ends with the answer in words: 2 DDP processes against the best one-process run measured
    ratio = two["throughput"] / one["throughput"]
    said = (f"mlp: 2 DDP processes train {ratio:.2f} times as fast as" if ratio >= 1 else
            "mlp: 2 DDP processes train SLOWER than")
    answer = f"answer (plumbing check, not a measurement): {said} the best one-process configuration measured " \
             f"here (1 process x 1 thread: {bench.number(one['throughput'])} samples/s) (one process on every " \
             f"core was not measured: --threads adds it)"
    summary = out.stdout.strip().splitlines()
    assert summary[-2].startswith(answer) and summary[-1].startswith("wrote 2 rows to "), summary[-3:]
    assert result["answer"] == [summary[-2]]
    assert ratio >= 1 or f"at {ratio:.2f} times its speed. Why: 2 processes that never communicate reach " \
                         f"{two['limit_efficiency']:.2f}" in summary[-2], summary[-2]


def assert_run_recorded(run, flags):
    """A result file says when and how it was made, on what, and under which load."""
    assert run["command"].endswith(f"bench.py {flags}") and run["torch"] == torch.__version__, run
    assert (run["device"], run["cores"]) == ("cpu", len(os.sched_getaffinity(0))) and run["device_name"], run
    assert len(run["load_before"]) == len(run["load_after"]) == 3 and min(run["load_after"]) >= 0, run
    started = datetime.datetime.fromisoformat(run["date"])
    assert abs((datetime.datetime.now(datetime.timezone.utc) - started).total_seconds()) < 3600, run


def test_bench_answer_in_words_on_made_up_figures():
    """The answer weighs N DDP processes against the best one-process run measured (here one process on
    every core), and says why when DDP is slower: no launch, no timing."""
    bench = import_bench()
    spec = bench.BENCHMARKS["convnet"]
    settings = [bench.Setting("scaling", "convnet", spec, 1, 1), bench.Setting("scaling", "convnet", spec, 2, 1),
                bench.Setting("machine", "convnet", spec, 1, None)]
    for s, figure, threads in zip(settings, (100, 180, 150), (1, 1, 2)):
        bench.file_run(s, {"samples_per_s": figure, "world_size": s.n, "threads_per_process": threads}, "", "cpu")
    [faster] = bench.answer_lines(bench.rows_from(settings, "cpu"), "cpu", quick=False)
    assert faster == ("answer: convnet: 2 DDP processes train 1.20 times as fast as the best one-process "
                      "configuration measured here (1 process x 2 threads: 150 samples/s)")
    bench.file_run(settings[2], {"samples_per_s": 300, "world_size": 1, "threads_per_process": 2}, "", "cpu")
    bench.file_run(settings[2], {"samples_per_s": 300, "world_size": 1, "threads_per_process": 2}, "", "cpu")
    [slower] = bench.answer_lines(bench.rows_from(settings, "cpu"), "cpu", quick=False)  # median 300 now
    assert slower.startswith("answer: convnet: 2 DDP processes train SLOWER than the best one-process "
                             "configuration measured here (1 process x 2 threads: 300 samples/s), at 0.60 times "
                             "its speed. Why: one process already puts all 2 cores to work"), slower


@pytest.mark.slow
@pytest.mark.timeout(1900)  # its launches' own bounds first
def test_bench_quick_all_sections(launch, tmp_path):
    """Every section once, on tiny workloads: every benchmark's scaling rows and limit, the whole
    machine, the thread policies, DP against DDP, the comm hooks and ZeRO."""
    out = launch(["bash", str(ROOT / "run.sh"), "bench", "--quick", "--all"], timeout=1800)
    result = json.loads((tmp_path / "bench_quick.json").read_text())
    rows = result["rows"]
    assert_run_recorded(result["run"], "--quick --all")
    assert [line.split(": ")[1] for line in result["answer"]] == ["mlp", "convnet", "transformer"]
    assert "(one process on every core was not measured" not in out.stdout  # --all measures it
    assert "FAILED" not in out.stdout and "skipped" not in out.stdout, out
    assert_well_formed([r for r in rows if r["section"] not in ("comm_hooks", "zero")])
    by = {(r["section"], r["benchmark"], r["mode"], r["world_size"], r["thread_policy"]): r for r in rows}
    for name in ("mlp", "convnet", "transformer"):
        one, two = (by["scaling", name, "ddp", n, "OMP_NUM_THREADS=1"] for n in (1, 2))
        assert_limit(two, one)
        assert f"{name}: E(2) = {two['efficiency']:.2f}, limit {two['limit_efficiency']:.2f}" in out.stdout
        machine = by["machine", name, "ddp", 1, "auto"]
        assert machine["threads_per_process"] == len(os.sched_getaffinity(0))  # one process, every core
        assert f"{name}: 2 processes x 1 thread = {two['throughput'] / machine['throughput']:.2f}x one process " \
               f"using the whole machine" in out.stdout
        assert ("threads", name, "ddp", 2, "OMP_NUM_THREADS=2") in by
    assert {("dp_vs_ddp", "mlp", "plain", 1, "auto"), ("dp_vs_ddp", "mlp", "ddp", 2, "auto")} <= by.keys()
    assert any(r["section"] == "comm_hooks" and r["figures"] for r in rows)
    assert {r["mode"] for r in rows if r["section"] == "zero"} == {"ddp", "zero"}
    assert "different steps per process" not in out.stdout, "every run of a benchmark took the same steps"


def test_bench_efficiency_is_per_worker_against_one_process_with_one_thread():
    """The table's arithmetic on made-up figures: no launch, no timing."""
    bench = import_bench()
    spec = bench.BENCHMARKS["transformer"]
    settings = [bench.Setting("scaling", "transformer", spec, 1, 1),
                bench.Setting("scaling", "transformer", spec, 2, 1),
                bench.Setting("machine", "transformer", spec, 1, None)]
    for s, runs, threads in zip(settings, ([100, 90, 300], [180, 170, 190], [150, 150, 150]), (1, 1, 2)):
        for figure in runs:
            bench.file_run(s, {"tokens_per_s": figure, "world_size": s.n, "threads_per_process": threads}, "", "cpu")
    rows = bench.rows_from(settings, "cpu")
    assert [r["throughput"] for r in rows] == [100, 180, 150]  # medians of 3
    assert [r["efficiency"] for r in rows] == pytest.approx([1.0, 0.9, 0.75])  # 150 / (2 cores x 100)
    lines = bench.summary_lines(rows, "cpu")
    assert "transformer: E(2) = 0.90 (2 processes, 1 thread each against 1 process with 1 thread)" in lines
    assert any(line.startswith("transformer: 2 processes x 1 thread = 1.20x one process using the whole machine")
               for line in lines)


def test_bench_limit_is_n_one_process_runs_summed_against_n_times_one_process():
    """The limit's arithmetic on made-up figures: no launch, no timing."""
    bench = import_bench()
    spec = bench.BENCHMARKS["convnet"]
    one, limit, two = (bench.Setting(section, "convnet", spec, n, 1)
                       for section, n in (("scaling", 1), ("limit", 2), ("scaling", 2)))

    def record(figure, steps=128):
        return {"samples_per_s": figure, "steady_samples_per_s": figure, "threads_per_process": 1, "steps": steps}

    for a, (b, c), d in ((100, (95, 97), 180), (90, (90, 100), 170), (110, (99, 99), 150)):
        bench.file_run(one, dict(record(a), world_size=1), "", "cpu")
        bench.file_launch(limit, [(dict(record(b), world_size=1), ""), (dict(record(c), world_size=1), "")], "cpu")
        bench.file_run(two, dict(record(d), world_size=2), "", "cpu")
    bench.file_launch(limit, [(dict(record(0), world_size=1), ""), (dict(record(99), world_size=1), "")], "cpu")
    assert limit.failures == ["ddp_main.py wrote no positive samples_per_s in a one-process run"]  # no sum
    rows = bench.rows_from([one, limit, two], "cpu")
    assert [(r["section"], r["world_size"]) for r in rows] == [("scaling", 1), ("scaling", 2)]  # on the N row
    assert bench.rows_of(limit, [one, limit, two], "cpu") == []
    assert bench.rows_of(two, [one, limit, two], "cpu") == rows[1:]
    first, second = rows
    assert (first["limit_efficiency"], first["of_limit"], first["limit_runs"]) == (None, None, [])
    assert second["limit_runs"] == [192, 190, 198] and second["limit_throughput"] == 192  # sums, their median
    assert second["limit_per_process"] == [[95, 97], [90, 100], [99, 99]]
    assert second["efficiency"] == pytest.approx(0.85)  # 170 / (2 x 100)
    assert second["limit_efficiency"] == pytest.approx(0.96)  # 192 / (2 x 100)
    assert second["of_limit"] == pytest.approx(0.85 / 0.96)  # = 170 / 192
    lines = bench.summary_lines(rows, "cpu")
    assert "convnet: E(2) = 0.85, limit 0.96, 0.89 of the limit (2 processes, 1 thread each against 1 process " \
           "with 1 thread)" in lines, lines
    line = bench.row_line(second)
    assert "  0.85   0.96    0.89  180 170 150 | limit 192 190 198" in line, line
    assert bench.workload_notes([one, limit, two]) == []
    bench.file_run(two, dict(record(160, steps=64), world_size=2), "", "cpu")
    assert bench.workload_notes([one, limit, two]) == [
        "note: convnet: the runs took different steps per process (scaling N=1: 128, limit N=2: 128, "
        "scaling N=2: 128/64): E and the limit compare unequal work"]


# the workload flags that are global, N x one rank's share; every other one is per process, like the batch of
# ddp_main.py (32) and ddp_transformer.py (8), left at their per-process defaults
PER_RANK_SCALED = {"mlp": {"--batch_size", "--samples"}, "convnet": {"--train_samples"}, "transformer": set()}


def test_bench_limit_runs_do_the_work_of_one_rank(tmp_path):
    """Each concurrent one-process run has the flags of the 1-process row (own folder, own port, 1
    thread), and those are one rank's share of the N-process run: what scales with N is global."""
    bench = import_bench()
    args = types.SimpleNamespace(device="cpu", quick=False)
    for name, spec in bench.BENCHMARKS.items():
        flags = {"--device", "--metrics", "--nprocs", "--data", *spec["required"], *spec["sizes"](1, False)}
        jobs = {}
        for section, n in (("scaling", 1), ("limit", 2), ("scaling", 2)):
            (tmp_path / name / f"{section}{n}").mkdir(parents=True)
            jobs[section, n] = bench.launch_jobs(bench.Setting(section, name, spec, n, 1), args, flags,
                                                 str(tmp_path / name / f"{section}{n}"))
        script = str(ROOT / spec["script"])
        alone, [*limit], together = jobs["scaling", 1], jobs["limit", 2], jobs["scaling", 2]
        assert len(alone) == len(together) == 1 and len(limit) == 2
        assert len({env["MASTER_PORT"] for _, _, env, _ in limit}) == 2 and len({cwd for _, cwd, _, _ in limit}) == 2
        assert all(env["OMP_NUM_THREADS"] == "1" and env["CUDA_VISIBLE_DEVICES"] == "" for _, _, env, _ in limit)
        for cmd, cwd, _, metrics in limit:
            assert cmd[0] == sys.executable and metrics.startswith(cwd)
            same = [a.replace(cwd, "CWD") for a in cmd[cmd.index(script):]]
            assert same == [a.replace(alone[0][1], "CWD") for a in alone[0][0][alone[0][0].index(script):]]
        one, two = ({flag: cmd[cmd.index(flag) + 1] for flag in (*spec["sizes"](1, False), "--data") if flag in cmd}
                    for cmd in (alone[0][0], together[0][0]))
        for flag in spec["sizes"](1, False):
            assert int(two[flag]) == int(one[flag]) * (2 if flag in PER_RANK_SCALED[name] else 1), (name, flag)
        if spec.get("corpus"):  # the Transformer: N copies of the text, the same steps within one epoch
            text = bench.default_text(spec)
            assert Path(one["--data"]).read_text() == text and Path(two["--data"]).read_text() == text * 2
            assert (one["--epochs"], one["--max_steps"]) == ("1", "40") and len(text) * 0.9 // 128 // 8 >= 40


def test_bench_default_plan_fits_and_the_rest_is_one_flag_away(capsys):
    """By default: the scaling rows with their limit, 3 repeats, within 10 minutes by the plan's own
    estimate; --threads, --extras and --all add the rest, and --help names them."""
    bench = import_bench()
    if bench.cores() < 2:
        pytest.skip("needs 2 cores")

    def sections(*argv):
        args = bench.check_args(bench.parse_args(["--max_nprocs", "2", *argv]))
        return args, [(s.section, s.name, s.n, s.policy) for s in bench.plan(args)]

    args, default = sections()
    one_core = "OMP_NUM_THREADS=1"
    # per model: 1 process on 1 core, the limit of 2 independent processes, 2 DDP processes, and one
    # process on every core (with the first, the best one-process run the answer compares against)
    assert default == [row for name in ("mlp", "convnet", "transformer")
                       for row in (("scaling", name, 1, one_core), ("limit", name, 2, one_core),
                                   ("scaling", name, 2, one_core), ("machine", name, 1, "auto"))]
    assert args.repeats == 3 and args.repeats * sum(bench.launch_estimate(s, args) for s in bench.plan(args)) < 480
    bench.print_plan(bench.plan(args), args)
    out = capsys.readouterr().out
    assert out.startswith("plan: 36 launches (12 settings x 3 repeats), 87 processes; about "), out
    assert "not in this run: --threads (the threads section); --extras (dp_vs_ddp, comm_hooks, " \
           "zero); --all adds every section" in out
    cores = f"OMP_NUM_THREADS={bench.cores()}"
    threads = [("threads", name, 2, cores) for name in ("mlp", "convnet", "transformer")]
    extras = [("dp_vs_ddp", "mlp", 2, "auto"), ("comm_hooks", "comm_hooks", 2, "auto"), ("zero", "zero", 2, "auto"),
              ("zero", "zero", 2, "auto")]
    assert sorted(sections("--threads")[1]) == sorted(default + threads)
    assert sections("--extras")[1] == default + extras
    assert sorted(sections("--all")[1]) == sorted(default + threads + extras)
    assert sorted(sections("--all", "--no-threads")[1]) == sorted(default + extras)
    assert sections("--only", "mlp,dp_vs_ddp")[1] == default[:4] + extras[:1]
    machine = next(s for s in bench.plan(args) if s.section == "machine")
    assert "OMP_NUM_THREADS" not in bench.launch_env("cpu", machine.omp, 1)  # the script splits the cores itself
    assert bench.expected_threads(machine, "cpu") == bench.cores()
    with pytest.raises(SystemExit):
        bench.parse_args(["--help"])
    usage = capsys.readouterr().out
    assert all(flag in usage for flag in ("--threads", "--extras", "--all", "--quick")), usage


def test_bench_reads_dp_vs_ddp_pair():
    bench = import_bench()
    pair = bench.Setting("dp_vs_ddp", "mlp", bench.COMPARE, 2, None)
    bench.file_run(pair, {"world_size": 2, "compare": [
        {"mode": "plain", "world_size": 1, "dp_devices": 0, "samples_per_s": 90, "steady_samples_per_s": 100,
         "threads_per_process": 2},
        {"mode": "ddp", "world_size": 2, "dp_devices": 0, "samples_per_s": 140, "steady_samples_per_s": 150,
         "threads_per_process": 1}]}, "", "cpu")
    rows = bench.rows_from([pair], "cpu")
    assert [(r["mode"], r["world_size"], r["threads_per_process"], r["throughput"]) for r in rows] == [
        ("plain", 1, 2, 100), ("ddp", 2, 1, 150)]
    assert "dp_vs_ddp: ddp (2) / plain (1) = 1.50x at the same global batch" in bench.summary_lines(rows, "cpu")


def test_bench_run_all_starts_together_and_kills_every_session(tmp_path):
    """The jobs of a launch start at once; at the timeout every session goes, grandchildren too."""
    bench = import_bench()
    start = time.monotonic()
    results = bench.run_all([(["sleep", "1"], tmp_path, cpu_env())] * 2, timeout=60)
    assert [code for code, _, _ in results] == [0, 0] and time.monotonic() - start < 1.9
    job = (["bash", "-c", "sleep 60 & echo $!; echo $$; wait"], tmp_path, cpu_env())
    results = bench.run_all([job, job], timeout=1)
    assert [code for code, _, _ in results] == [None, None]
    pids = [int(pid) for _, out, _ in results for pid in out.split()]
    assert len(pids) == 4
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)]


def test_bench_reads_comm_hook_and_zero_figures_and_skips_missing_scripts(monkeypatch):
    bench = import_bench()
    hooks = bench.Setting("comm_hooks", "comm_hooks", bench.HOOKS, 2, None)
    bench.file_run(hooks, {"world_size": 2, "hooks": {
        "allreduce": {"bytes_per_step": 4000, "step_time_s": 0.02, "final_loss": 1.0, "loss_gap": 0.0,
                      "losses": [2, 1]},
        "fp16": {"bytes_per_step": 2000, "step_time_s": 0.01, "final_loss": 1.01, "loss_gap": 0.01}}}, "", "cpu")
    zero = bench.Setting("zero", "zero", bench.ZERO, 2, None, "zero")
    plain, zero = (bench.Setting("zero", "zero", spec, 2, None, mode)
                   for spec, mode in ((bench.ZERO_OFF, "ddp"), (bench.ZERO, "zero")))
    for setting, speed, state in ((plain, 40.0, [800, 800]), (zero, 50.0, [512, 288])):
        bench.file_run(setting, {"world_size": 2, "samples_per_s": speed, "optimizer_state_bytes_per_rank": state},
                       "", "cpu")
    rows = bench.rows_from([hooks, plain, zero], "cpu")
    assert [(r["mode"], r["throughput"]) for r in rows] == [("allreduce", 50.0), ("fp16", 100.0), ("ddp", 40.0),
                                                            ("zero", 50.0)]
    assert rows[1]["figures"] == {"bytes_per_step": 2000, "step_time_s": 0.01, "final_loss": 1.01, "loss_gap": 0.01}
    lines = bench.summary_lines(rows, "cpu")
    assert "comm_hooks fp16 (N=2): bytes_per_step 2,000 (0.50x allreduce), step_time_s 0.01 (0.50x allreduce), " \
           "final_loss 1.01, loss_gap 0.01" in lines, lines
    assert "zero zero (N=2): optimizer_state_bytes_per_rank 512 (0.64x ddp)" in lines, lines  # the largest rank's
    notes = []
    missing = bench.Setting("zero", "zero", dict(bench.ZERO, script="ddp_nonesuch.py"), 2, None)
    assert bench.runnable_settings([missing], bench.check_args(bench.parse_args([])), notes)[0] == []
    assert notes == ["skipped ddp_nonesuch.py: ddp_nonesuch.py not found"]


def test_bench_dp_vs_ddp_keeps_to_max_nprocs(monkeypatch):
    """The comparison starts --max_nprocs DDP processes and, on GPUs, lets DataParallel see only that many."""
    bench = import_bench()
    cmd = bench.command(bench.COMPARE, {"--device", "--metrics", "--compare", "--nprocs"}, "cuda", 3, True)[0]
    assert cmd[-2:] == ["--nprocs", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert bench.launch_env("cuda", None, 3)["CUDA_VISIBLE_DEVICES"] == "4,5,6"
    assert bench.launch_env("cpu", 1, 3)["CUDA_VISIBLE_DEVICES"] == ""


def test_dp_baseline_indexes_with_one_tensor_per_epoch():
    """The step indexes the data with slices of one index tensor made per epoch, in the sampler's order."""
    sys.path.insert(0, str(ROOT))
    import dp_baseline
    import torch
    sampler = torch.utils.data.DistributedSampler(range(10), num_replicas=2, rank=1, shuffle=True, seed=3)
    batches = dp_baseline.epoch_batches(sampler, 4, 2, torch.device("cpu"))
    assert all(b.dtype == torch.long and b.device.type == "cpu" for b in batches)
    sampler.set_epoch(4)
    assert torch.cat(batches).tolist() == list(sampler) and [len(b) for b in batches] == [2, 2, 1]


def spawned(pids):
    """The mp.spawn workers among `pids`."""
    found = []
    for pid in pids:
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            pass
    return found


@pytest.mark.slow  # the default suite: test_bench_run_all_starts_together_and_kills_every_session, in process
def test_bench_stopped_mid_launch_leaves_no_process_behind(tmp_path):
    """SIGTERM to bench while its limit launch runs (two one-process worlds at once, each an
    mp.spawn parent and its worker): every process of every job goes, and the table keeps the
    runs finished before."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench.py"), "--quick", "--only", "mlp"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=cpu_env(), start_new_session=True)
    workers = set()
    try:
        assert any(line.startswith("[2/3] limit mlp N=2") for line in proc.stdout)
        deadline = time.monotonic() + 120
        while len(spawned(workers)) < 2 and time.monotonic() < deadline:  # both jobs' workers are up
            workers.update(descendants(proc.pid))
            time.sleep(0.2)
        assert len(spawned(workers)) >= 2, f"the limit launch never started both workers: {workers}"
        assert len(workers) >= 4  # two launchers, two workers
        proc.terminate()
        assert proc.wait(timeout=60) == 143
        rest = proc.stdout.read()
        assert "INTERRUPTED: the table holds the runs finished so far" in rest, rest
        assert re.search(r"^scaling +mlp +ddp +1 ", rest, re.MULTILINE), rest  # the 1-process row, measured
        deadline = time.monotonic() + 10
        while any(alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in workers if alive(p)]
    finally:
        for pid in [proc.pid, *workers]:  # whatever the outcome, this test leaves nothing behind either
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.communicate()
