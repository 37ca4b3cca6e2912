"""dp_baseline.py learns and compares, bench.py writes well-formed results: run as users run them.

Everything runs on CPU (the `launch` fixture hides the GPUs) in a temporary directory,
bounded by a timeout. No test asserts a speed: only that the figures exist and are positive.
"""
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import cpu_env

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
    for record in (single, ddp):
        assert_learned(record, epochs=5)
    # the same global batches in the same order: the same optimizer steps, the same losses
    assert single["steps"] == ddp["steps"]
    assert ddp["losses"] == pytest.approx(single["losses"], abs=1e-3)
    assert "peak memory per process" in out.stdout and "replicas: in sync" in out.stdout
    assert out.stdout.strip().splitlines()[-1].startswith("done: dp_baseline.py")


@pytest.mark.parametrize("cmd", [["dp_baseline.py", "--compare", "--batch_size", "255"],
                                 ["dp_baseline.py", "--ddp", "--compare"],
                                 ["bench.py", "--only", "mlp,nonesuch"]])
def test_bad_input_is_one_line_and_exit_2(launch, script, cmd):
    out = launch([sys.executable, script(cmd[0]), *cmd[1:]], timeout=120, check=False)
    assert out.returncode == 2, out
    assert out.stderr.startswith("error: ") and len(out.stderr.strip().splitlines()) == 1, out
    assert "Traceback" not in out.stderr


def bench_command():
    """`bash run.sh bench --quick`, the MLP only: its rows cover every section and the table's
    plumbing (the ConvNet and Transformer rows take two more launches each, mostly start-up)."""
    return ["bash", str(ROOT / "run.sh"), "bench", "--quick", "--only", "mlp,dp_vs_ddp"]


def test_bench_quick_writes_well_formed_results(launch, tmp_path):
    out = launch(bench_command(), timeout=1200)
    rows = json.loads((tmp_path / "bench_results.json").read_text())
    assert isinstance(rows, list) and rows
    for row in rows:
        assert {"benchmark", "mode", "world_size", "threads_per_process", "throughput", "unit",
                "efficiency"} <= row.keys(), row
        assert row["mode"] in {"ddp", "plain", "dp"} and row["unit"] in {"samples/s", "tokens/s"}
        assert isinstance(row["world_size"], int) and row["world_size"] >= 1
        assert isinstance(row["threads_per_process"], int) and row["threads_per_process"] >= 1  # CPU
        assert math.isfinite(row["throughput"]) and row["throughput"] > 0, row
        assert row["throughput"] == sorted(row["runs"])[len(row["runs"]) // 2]  # one run: its figure
        assert row["efficiency"] is None or row["efficiency"] > 0
    by = {(r["section"], r["benchmark"], r["mode"], r["world_size"], r["thread_policy"]): r for r in rows}
    assert {("scaling", "mlp", "ddp", 1, "OMP_NUM_THREADS=1"), ("scaling", "mlp", "ddp", 2, "OMP_NUM_THREADS=1"),
            ("machine", "mlp", "ddp", 1, "auto"), ("threads", "mlp", "ddp", 2, "OMP_NUM_THREADS=2"),
            ("dp_vs_ddp", "mlp", "plain", 1, "auto"), ("dp_vs_ddp", "mlp", "ddp", 2, "auto")} <= by.keys()
    assert {r["benchmark"] for r in rows} == {"mlp"}, "--only picks the benchmarks"
    # E(N) is per worker: N 1-thread processes against the 1 process x 1 thread row
    one, two = by["scaling", "mlp", "ddp", 1, "OMP_NUM_THREADS=1"], by["scaling", "mlp", "ddp", 2, "OMP_NUM_THREADS=1"]
    assert (one["threads_per_process"], two["threads_per_process"], one["efficiency"]) == (1, 1, 1.0)
    assert two["efficiency"] == pytest.approx(two["throughput"] / (2 * one["throughput"]))
    assert f"mlp: E(2) = {two['efficiency']:.2f} (2 processes, 1 thread each" in out.stdout
    machine = by["machine", "mlp", "ddp", 1, "auto"]
    assert machine["threads_per_process"] == len(os.sched_getaffinity(0))  # one process, every core
    assert f"mlp: 2 processes x 1 thread = {two['throughput'] / machine['throughput']:.2f}x one process " \
           f"using the whole machine" in out.stdout


def import_bench():
    sys.path.insert(0, str(ROOT))
    import bench
    return bench


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


def descendants(pid):
    """Every process below `pid`, from /proc."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def alive(pid):
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def test_bench_stopped_mid_launch_leaves_no_process_behind(tmp_path):
    """SIGTERM to bench while a DDP launch runs: the launch and its workers go with it."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench.py"), "--quick", "--only", "mlp"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=cpu_env(), start_new_session=True)
    workers = []
    try:
        assert any(line.startswith("[1/1] scaling mlp N=1") for line in proc.stdout)
        deadline = time.monotonic() + 120
        while len(descendants(proc.pid)) < 2 and time.monotonic() < deadline:  # the launcher and its worker
            time.sleep(0.2)
        workers = descendants(proc.pid)
        assert len(workers) >= 2, "the launch never started its worker"
        proc.terminate()
        assert proc.wait(timeout=60) != 0
        deadline = time.monotonic() + 10
        while any(alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in workers if alive(p)]
    finally:
        for pid in [proc.pid, *workers]:  # whatever the outcome, this test leaves nothing behind either
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.communicate()
