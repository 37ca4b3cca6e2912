"""The collection's tests: every script launched as users launch it, on CPU with gloo.

Everything runs with CUDA_VISIBLE_DEVICES= and --device cpu, every launch in its own
temporary directory and bounded by a timeout (see conftest.py). The assertions are about
behaviour: the loss falls, replicas agree, step counts are as computed, a snapshot resumes
exactly, test samples are counted exactly once, the Transformer is causal, bad input gets
one line and exit code 2, exits are clean. Three parts: the foundation (linear-model
scripts and run.sh), the MNIST ConvNet, the Transformer. Faults: test_faults.py;
DataParallel and the benchmark: test_dp_bench.py; several hosts and SLURM: test_multihost.py.
"""
import ast
import contextlib
import copy
import gc
import itertools
import json
import math
import os
import re
import shlex
import shutil
import socket
import struct
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

import ddp_transformer
from conftest import ROOT, cpu_env, kill_group, read_metrics, run_bounded, run_doc_snippet
from test_layout import SCRIPTS
from ddp_main import ConvNet, SyntheticDigits
from ddp_transformer import Transformer


# ================================================================ foundation: ddp_minimal.py, ddp_gpus*.py, run.sh
RUN_SH_MODES = ["minimal", "spawn", "torchrun", "launch", "manual", "nodes", "restart",
                "main", "main-torchrun", "transformer"]
# run only when named: bench in test_dp_bench.py, the others in slow tests below
RUN_SH_EXTRA = ["bench", "torchrun-single", "template", "main-manual", "main-resume", "transformer-accum", "transformer-toy", "uneven", "uneven-zero", "comm-hooks",
                "desync", "unused", "slow", "fsdp", "bandwidth", "netns", "netns-elastic"]


# ---------------------------------------------------------------- run.sh, once per session (conftest.py's run_sh)
def mode_output(run_sh, mode):
    """The part of run.sh's output that belongs to one mode."""
    start = run_sh.stdout.index(f"================ {mode}: ")
    return run_sh.stdout[start:run_sh.stdout.index("\n---------------- ", start)]


def mode_metrics(run_sh, mode):
    """The metrics JSON that one run.sh mode wrote."""
    return read_metrics(run_sh.work / mode / "m.json")


@pytest.mark.parametrize("mode", RUN_SH_MODES)
def test_run_sh_mode_passes(run_sh, mode):
    assert re.search(rf"^PASS  {re.escape(mode)} \(", run_sh.stdout, flags=re.MULTILINE), (
        f"{mode_output(run_sh, mode)}\n--- stderr\n{run_sh.stderr[-3000:]}")


def test_run_sh_exit_code_and_summary(run_sh):
    assert run_sh.returncode == 0 and f"{len(RUN_SH_MODES)} passed, 0 failed" in run_sh.stdout, str(run_sh)


# ---------------------------------------------------------------- ddp_minimal.py
def test_minimal_one_step_identical_parameters(run_sh):
    out = mode_output(run_sh, "minimal")
    losses = dict(re.findall(r"\[rank (\d)\] loss=([\d.]+)", out))
    assert set(losses) == {"0", "1"}, out
    assert losses["0"] != losses["1"], "each rank trains on its own batch, so the losses must differ"
    assert "replicas: in sync\n" in out and "done: ddp_minimal.py | 2 processes on " in out
    assert "| parameters changed | replicas in sync" in out
    assert out.strip().splitlines()[-2].startswith("done:"), "done: is the script's last line"


# ---------------------------------------------------------------- ddp_gpus.py
def epoch_losses(out):
    return [float(x) for x in re.findall(r"^epoch \d+/\d+ \| loss ([\d.]+)", out, flags=re.MULTILINE)]


def test_spawn_learns_and_replicas_agree(run_sh):
    out = mode_output(run_sh, "spawn")  # python ddp_gpus.py --max_epochs 5 --batch_size 32
    # each line is written whole (the tests run with PYTHONUNBUFFERED=1, where print() is two writes)
    assert not re.search(r"\S\[CPU: \d\]", out), f"lines of two ranks ran into each other:\n{out}"
    losses = epoch_losses(out)
    assert len(losses) == 5 and all(b < a for a, b in itertools.pairwise(losses)), losses
    assert losses[-1] < 0.1 * losses[0], "the model must actually learn the linear map"
    # the seed's per-rank line from both ranks; the global epoch line once (rank 0)
    for rank in (0, 1):
        assert f"[CPU: {rank}] Epoch: 4 | Batchsize: 32 | Steps: 32" in out
    assert out.count("epoch 5/5 | loss") == 1
    assert "replicas: in sync (2 ranks" in out


def test_restart_mode_ends_with_the_weights_of_the_uninterrupted_run(run_sh):
    """run.sh's restart mode (torchrun --max-restarts=3, a worker SIGKILLed once the first snapshot
    exists) resumes from its snapshot and ends with the weights that an uninterrupted 2-rank run
    computes, here in one process (test_faults.py kills by hand in the slow tier, for every script)."""
    from test_faults import one_process_reference
    out, m = mode_output(run_sh, "restart"), mode_metrics(run_sh, "restart")
    assert ">>> snapshot written; killing worker" in out
    assert m["restarts"] >= 1 and m["resumed_from_epoch"] >= 1 and m["epochs"] == 4, m
    resumed = torch.load(run_sh.work / "restart" / "ddp_gpus_torchrun.pt", map_location="cpu", weights_only=True)
    assert resumed["epochs_run"] == 4, resumed["epochs_run"]
    reference = one_process_reference(["--max_epochs", "4", "--samples", "8192", "--batch_size", "16"])
    for name, value in reference.items():
        assert torch.allclose(resumed["model"][name], value, rtol=1e-5, atol=1e-6), name


@pytest.mark.slow  # the default suite's budget; CI runs the slow tier too
def test_two_spawn_jobs_at_once_and_steps_per_epoch(script, tmp_path):
    """Two mp.spawn jobs started at the same moment (each picks its own free port) both finish, and
    steps per epoch = ceil(2048 / (32 x processes)) on every rank: 64 for the job of 1 process, 22 for
    the one of 3 (2 processes: run.sh's spawn mode, 32)."""
    jobs = []
    for nprocs in (3, 1):
        work = tmp_path / f"n{nprocs}"
        work.mkdir()
        cmd = [sys.executable, script("ddp_gpus.py"), "-e", "2", "-b", "32", "--device", "cpu", "--nprocs", nprocs,
               "--metrics", work / "m.json"]
        jobs.append((subprocess.Popen([str(c) for c in cmd], cwd=work, env=cpu_env(), text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True), work))
    try:
        results = [(proc.communicate(timeout=180), proc.returncode) for proc, _ in jobs]
    finally:
        for proc, _ in jobs:
            kill_group(proc)
    for ((out, err), code), (_, work) in zip(results, jobs):
        assert code == 0, f"exit {code}\n{out[-2000:]}\n{err[-2000:]}"
        assert read_metrics(work / "m.json")["replicas_in_sync"] is True
    expected = math.ceil(2048 / (32 * 3))
    m = read_metrics(tmp_path / "n3" / "m.json")
    assert m["steps_per_epoch"] == expected and m["steps"] == 2 * expected
    assert m["world_size"] == 3 and m["replicas_in_sync"] is True
    assert set(re.findall(r"\[CPU: (\d)\] Epoch: 1 \| Batchsize: 32 \| Steps: (\d+)", results[0][0][0])) == {
        (str(rank), str(expected)) for rank in range(3)}
    one = read_metrics(tmp_path / "n1" / "m.json")
    assert (one["world_size"], one["steps_per_epoch"], one["steps"]) == (1, 64, 128), one
    assert one["final_loss"] < one["first_loss"], one


# ---------------------------------------------------------------- ddp_gpus_torchrun.py
@pytest.mark.slow  # the default suite resumes from a snapshot in test_faults.py (killed worker) and run.sh's restart
def test_snapshot_resume_is_exact(launch, script, torchrun, tmp_path):
    cmd = [*torchrun, "--standalone", "--nproc-per-node=2", script("ddp_gpus_torchrun.py"), "--device", "cpu",
           "--batch_size", "32", "--snapshot_path", tmp_path / "snap.pt", "--metrics", tmp_path / "m.json"]
    reference = epoch_losses(launch(cmd[:-4] + ["--max_epochs", "5", "--snapshot_path", tmp_path / "ref.pt"],
                                    timeout=90).stdout)
    launch(cmd + ["--max_epochs", "2"], timeout=90)
    first = read_metrics(tmp_path / "m.json")
    assert first["epochs"] == 2 and first["resumed_from_epoch"] == 0

    r = launch(cmd + ["--max_epochs", "5", "--resume"], timeout=90)  # another launch's snapshot: asked for
    second = read_metrics(tmp_path / "m.json")
    assert second["resumed_from_epoch"] == 2 and second["epochs"] == 5
    assert second["steps"] == 3 * 32, "a resumed run trains only the missing epochs"
    assert "resuming from snapshot" in r.stdout
    # same seed, same data order: the resumed epochs match the uninterrupted run
    assert first["losses"] + second["losses"] == pytest.approx(reference, abs=1e-6)  # printed to 6 places

    snap = torch.load(tmp_path / "snap.pt", map_location="cpu", weights_only=True)
    assert snap["epochs_run"] == 5
    model = torch.nn.Linear(20, 1)
    model.load_state_dict(snap["model"])  # no `module.` prefix


@pytest.mark.slow  # the default suite: test_mnist_train_checkpoint_resume resumes with plain python, a world of one
def test_torchrun_script_as_plain_python(launch, script, tmp_path):
    launch([sys.executable, script("ddp_gpus_torchrun.py"), "--device", "cpu", "-e", "3",
            "--snapshot_path", tmp_path / "s.pt", "--metrics", tmp_path / "m.json"], timeout=60)
    m = read_metrics(tmp_path / "m.json")
    assert m["world_size"] == 1 and m["steps_per_epoch"] == 64 and m["final_loss"] < m["first_loss"]


@pytest.mark.slow  # the default suite: run.sh's manual mode is this launch, among its 12 launches in a row
def test_clean_exit_two_launches_in_a_row(script, tmp_path):
    """The exit-time abort of the contract: consecutive 2-rank launches must all exit 0, silently
    (the default suite: the 10 default launch modes of run.sh, one after the other, each checked for
    exit 0; test_faults.py's slow soak launches every script 10 times)."""
    for i in range(2):
        port = free_port()
        procs = [subprocess.Popen([sys.executable, script("ddp_gpus_torchrun.py"), "--device", "cpu", "-e", "1",
                                   "--snapshot_path", tmp_path / f"s{i}.pt"], cwd=tmp_path, text=True,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                                  env=cpu_env(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=2,
                                              MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
                 for rank in (0, 1)]
        try:
            results = [(p.wait(timeout=60), p.stderr.read()) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        for rank, (code, err) in enumerate(results):
            assert code == 0 and "terminate called" not in err, f"launch {i}, rank {rank}: exit {code}\n{err}"


# ---------------------------------------------------------------- bad input
def error_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("args,says", [(["--batch_size", "0"], "--batch_size"), (["--epochs", "-1"], "--epochs"),
                                       (["--lr", "0"], "--lr"), (["--nprocs", "0"], "--nprocs")])
def test_bad_arguments_one_line_exit_2_in_process(args, says, capsys):
    """The argument checks themselves, in this process (no launch: each costs seconds of start-up);
    the launches below show the same line and exit code reach the user from a real process."""
    import ddp_gpus
    with pytest.raises(SystemExit) as exited:
        ddp_gpus.check_args(ddp_gpus.parse_args(["--device", "cpu", *args]))
    lines = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(lines) == 1 and lines[0].startswith("error:") and says in lines[0], lines
    assert "(" in lines[0], "the error names the fix"


@pytest.mark.parametrize("given,says", [(["--batch-size", "0"], "--batch-size"), (["--batch_size", "0"], "--batch_size"),
                                        (["--batch-size=0"], "--batch-size"), (["--batch_size=0"], "--batch_size"),
                                        (["-b", "0"], "--batch_size"), (["--max_epochs=0"], "--epochs")])
def test_a_check_names_the_flag_as_the_user_spelled_it(given, says, monkeypatch, capsys):
    """Issue 44: `--batch-size 0` said `--batch_size`, a spelling the user never typed. The flag as given
    (`=` forms too); a short option or another name of the flag (`--max_epochs` for `--epochs`): its first
    option string. spelled() reads the command line, so sys.argv is the one the parser read."""
    import ddp_gpus_torchrun
    monkeypatch.setattr(sys, "argv", ["ddp_gpus_torchrun.py", "--device", "cpu", *given])
    with pytest.raises(SystemExit) as exited:
        ddp_gpus_torchrun.check_args(ddp_gpus_torchrun.parse_args())
    lines = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and lines == [f"error: {says} must be positive, got 0 (pass a {says} above 0)"], lines
    assert ddp_gpus_torchrun.spelled("lr") == "--lr"


# one launch per kind of script (mp.spawn, torchrun) by default: each costs seconds of start-up, and
# the checks themselves run in process above and below
@pytest.mark.parametrize("name,args,says", [
    ("ddp_gpus.py", ["--device", "cuda"], "no GPU"),
    pytest.param("ddp_gpus.py", ["--backend", "nccl"], "nccl", marks=pytest.mark.slow),
    pytest.param("ddp_minimal.py", ["--nprocs", "-2"], "--nprocs", marks=pytest.mark.slow),
    ("ddp_gpus_torchrun.py", ["--batch-size", "0"], "error: --batch-size must be positive, got 0 (pass a --batch-size"),
])
def test_bad_input_one_line_exit_2(launch, script, name, args, says):
    r = launch([sys.executable, script(name), *args], timeout=60, check=False)
    assert r.returncode == 2, str(r)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and says in lines[0], str(r)
    assert "(" in lines[0], "the error names the fix"


def test_minimal_bad_nprocs_is_one_line_in_process(monkeypatch, capsys):
    """ddp_minimal.py's own check (it has no harness), in this process."""
    import ddp_minimal
    monkeypatch.setattr(sys, "argv", ["ddp_minimal.py", "--device", "cpu", "--nprocs", "-2"])
    with pytest.raises(SystemExit) as exited:
        ddp_minimal.main()
    lines = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: --nprocs -2"), lines


# ---------------------------------------------------------------- in-process DDP with gloo
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fixed_problem(seed=0, samples=64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 20, generator=g)
    y = x @ torch.randn(20, 1, generator=g)
    return x, y


def _train(model, batches, lr=0.1):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _sums_agree(module):
    """The replica check before issue 17: three float64 sums of the weights, gathered and compared."""
    flat = torch.cat([p.detach().reshape(-1).double() for p in module.parameters()])
    weights = torch.sin(torch.arange(flat.numel(), dtype=torch.float64))
    mine = torch.stack([flat.sum(), flat.abs().sum(), (flat * weights).sum()])
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return all(torch.equal(f, every[0]) for f in every)


def _gloo_pair_worker(rank, world, port, batch, steps, out):
    """Two real gloo ranks, once for three tests: DDP training on halves of each global batch, the
    scripts' replica check on the trained replicas, before and after one weight of rank 1 moves by 1e-6
    (also next to a weight of 1e30, where sums of the weights cannot see it), and the Transformer's no_sync gradient accumulation (accumulation_check)."""
    sys.path.insert(0, str(ROOT))
    from ddp_gpus import replicas_in_sync
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        x, y = _fixed_problem()
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(20, 1))
        # step s: rank r takes the r-th half of the global batch of 2B samples
        start = lambda s: s * world * batch + rank * batch
        _train(model, [(x[start(s):start(s) + batch], y[start(s):start(s) + batch]) for s in range(steps)])
        if rank == 0:
            torch.save(model.module.state_dict(), out)
        checks = [replicas_in_sync(model.module, torch.device("cpu"))]
        if rank == 1:
            with torch.no_grad():
                model.module.weight[0, 7] += 1e-6
        checks.append(replicas_in_sync(model.module, torch.device("cpu")))
        with torch.no_grad():  # the same huge weight on both ranks: next to it a sum cannot see the 1e-6
            model.module.weight[0, 1] = 1e30
        checks += [replicas_in_sync(model.module, torch.device("cpu")), _sums_agree(model.module)]
        with open(f"{out}.{rank}", "w") as f:
            f.write(" ".join(map(str, checks)))
        del model
        with open(f"{out}.fsdp.{rank}", "w") as f:
            f.write(" ".join(map(str, fsdp_replica_checks(rank, replicas_in_sync))))
        with open(f"{out}.buffers.{rank}", "w") as f:
            f.write("\n".join(buffer_replica_checks(rank, replicas_in_sync, f"{out}.error.json")))
        try:
            accumulation_check(rank, world, k=3)
            verdict = "ok"
        except AssertionError as e:
            verdict = f"failed: {e!r}"
        with open(f"{out}.accumulation.{rank}", "w") as f:
            f.write(verdict)
    finally:
        gc.collect()  # free DDP's reducer before the group (see cleanup() in the scripts)
        dist.destroy_process_group()


def buffer_replica_checks(rank, replicas_in_sync, error_file):
    """The replica check compares buffers too (issue 44): a BatchNorm's running_mean moved by 1e-6 on rank 1,
    then its int counter num_batches_tracked, then a weight and running_var together; per check the verdict,
    what rank 0 printed and its error line, also written where torchrun reads a worker's error (its root cause)."""
    import contextlib
    import io
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    initial = copy.deepcopy(model.state_dict())
    lines = []

    def checked(change):
        model.load_state_dict(initial)
        with torch.no_grad():
            if rank == 1:
                change()
        printed, said = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(said):
            verdict = replicas_in_sync(model, torch.device("cpu"))
        lines.extend([str(verdict), printed.getvalue().strip(), said.getvalue().strip()])

    os.environ["TORCHELASTIC_ERROR_FILE"] = error_file
    checked(lambda: None)
    checked(lambda: model[1].running_mean.__setitem__(2, model[1].running_mean[2] + 1e-6))
    checked(lambda: model[1].num_batches_tracked.add_(1))
    checked(lambda: (model[0].weight.__setitem__((0, 0), 5.0), model[1].running_var.__setitem__(0, 2.0)))
    del os.environ["TORCHELASTIC_ERROR_FILE"]
    return lines


def fsdp_replica_checks(rank, replicas_in_sync):
    """The replica check on FSDP2 models (issue 33), nothing gathered: on a 1-D mesh (every rank its own
    shards) the fingerprint equals the unsharded model's and moves when one rank's shard does; on HSDP's
    2-D mesh (replicated over 2, sharded over 1) a value moved on rank 1 is found."""
    import contextlib
    import io
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def checked(model):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            verdict = replicas_in_sync(model, torch.device("cpu"))
        return verdict, printed.getvalue().strip()

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 7))  # 3 rows: split 2 + 1
    whole = checked(build())  # every rank all of it: the same values everywhere
    sharded = fully_shard(build(), mesh=init_device_mesh("cpu", (2,)))
    results = [whole[0], checked(sharded)]
    with torch.no_grad():
        if rank == 1:
            sharded[0].weight.to_local()[0, 0] += 1e-6
    results.append(checked(sharded))
    hsdp = fully_shard(build(), mesh=init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard")))
    results.append(checked(hsdp)[0])
    with torch.no_grad():
        if rank == 1:
            hsdp[1].weight.to_local()[2, 1] += 1e-6
    results.append(checked(hsdp)[0])
    if rank:  # rank 0 prints
        return [results[0], results[1][0], results[2][0], results[3], results[4]]
    fingerprint = lambda line: float(line.rsplit("fingerprint ", 1)[1].rstrip(")"))
    # the unsharded fingerprint, to rounding; moved by one shard's 1e-6 (weighted by a sine of order 1)
    same = abs(fingerprint(results[1][1]) - fingerprint(whole[1])) < 1e-12
    moved = abs(fingerprint(results[2][1]) - fingerprint(whole[1])) > 1e-8
    return [results[0], results[1][0], same, results[2][0], moved, results[3], results[4]]


@pytest.fixture(scope="module")
def gloo_pair(tmp_path_factory):
    out = tmp_path_factory.mktemp("gloo_pair") / "ddp.pt"
    batch, steps = 4, 6
    mp.spawn(_gloo_pair_worker, args=(2, free_port(), batch, steps, str(out)), nprocs=2, join=True)
    return out, batch, steps


@pytest.mark.xdist_group("gloo_pair")
def test_ddp_equals_one_process_with_double_batch(gloo_pair):
    out, batch, steps = gloo_pair
    ddp = torch.load(out, weights_only=True)

    x, y = _fixed_problem()
    torch.manual_seed(0)
    single = torch.nn.Linear(20, 1)
    initial = {k: v.clone() for k, v in single.state_dict().items()}
    _train(single, [(x[s * 2 * batch:(s + 1) * 2 * batch], y[s * 2 * batch:(s + 1) * 2 * batch])
                    for s in range(steps)])
    for k in ddp:
        assert torch.allclose(ddp[k], single.state_dict()[k], atol=1e-6), k
        assert not torch.allclose(ddp[k], initial[k]), f"{k} did not move: the test would prove nothing"


@pytest.mark.xdist_group("gloo_pair")
def test_replica_check_detects_one_differing_weight(gloo_pair):
    out = gloo_pair[0]
    verdicts = {open(f"{out}.{r}").read() for r in (0, 1)}
    # in sync after DDP's steps; DIFFER once one weight moved by 1e-6, on every rank; still DIFFER
    # next to a weight of 1e30, where sums of the weights (the check before issue 17) agree
    assert verdicts == {"True False False True"}, verdicts
    # FSDP2 (issue 33): the fingerprint of the shards equals the whole model's, and moves with one shard's
    # value (rank 0 prints it); HSDP's replicas are compared, a value moved on one of them is found
    fsdp = [open(f"{out}.fsdp.{r}").read() for r in (0, 1)]
    # verdicts: whole, sharded, (rank 0: fingerprint the whole's), sharded after one shard moved (a 1-D mesh
    # has no copy to compare), (rank 0: fingerprint moved), HSDP, HSDP after one replica moved
    assert fsdp == ["True True True True True True False", "True True True True False"], fsdp


@pytest.mark.xdist_group("gloo_pair")
def test_replica_check_compares_buffers_and_names_what_differs(gloo_pair):
    """A BatchNorm statistic (a float, then the int counter) changed on one rank fails the check, and rank 0's
    line and error line name it; the fingerprint is the parameters' alone (a buffer moves no digit of it)."""
    out = gloo_pair[0]
    rank0 = open(f"{out}.buffers.0").read().split("\n")
    verdicts = [rank0[i] for i in range(0, 12, 3)]
    printed, said = rank0[1::3], rank0[2::3]
    assert verdicts == ["True", "False", "False", "False"], rank0
    assert open(f"{out}.buffers.1").read().split("\n")[0::3] == verdicts
    assert printed[0].startswith("replicas: in sync (2 ranks, fingerprint ") and said[0] == "", rank0
    for line, what in zip(printed[1:], ["in buffer 1.running_mean (2", "in buffer 1.num_batches_tracked (2",
                                         "in parameter 0.weight (and 1 more) (2"]):
        assert line.startswith(f"replicas: DIFFER on ranks [1] {what} ranks, fingerprint "), line
    assert printed[0].rsplit(" ", 1)[1] == printed[1].rsplit(" ", 1)[1] == printed[2].rsplit(" ", 1)[1], printed
    assert said[1].startswith("error: the replicas differ after training: ranks [1] in buffer 1.running_mean (find "), said
    assert "1.num_batches_tracked" in said[2] and all(len(s.splitlines()) == 1 for s in said[1:]), said
    written = json.loads(Path(f"{out}.error.json").read_text())["message"]  # rank 0's, the last check's
    assert written["message"] == said[3] and int(written["extraInfo"]["timestamp"]) > 0, written


# ---------------------------------------------------------------- DistributedSampler
def test_distributed_sampler_shards_disjoint_cover_and_reshuffle():
    data = list(range(103))
    world = 4
    shards = [list(DistributedSampler(data, num_replicas=world, rank=r, shuffle=True, seed=0)) for r in range(world)]
    assert len({len(s) for s in shards}) == 1, "every rank gets the same number of samples"
    flat = [i for s in shards for i in s]
    assert set(flat) == set(data), "together the shards cover the data set"
    padding = len(flat) - len(data)
    assert padding == 1, "103 samples over 4 ranks: the sampler pads 1 duplicate in (why evaluation must not use it)"
    overlap = sum(len(set(a) & set(b)) for i, a in enumerate(shards) for b in shards[i + 1:])
    assert overlap <= padding, "shards overlap only by the padded duplicates"

    sampler = DistributedSampler(data, num_replicas=world, rank=0, shuffle=True, seed=0)
    sampler.set_epoch(0)
    epoch0 = list(sampler)
    sampler.set_epoch(1)
    epoch1 = list(sampler)
    assert epoch0 != epoch1, "set_epoch changes the order"
    sampler.set_epoch(0)
    assert list(sampler) == epoch0, "the same epoch gives the same order on every rank and every run"


# ---------------------------------------------------------------- run.sh
def test_run_sh_help_lists_every_tested_mode(launch):
    r = launch(["bash", ROOT / "run.sh", "--help"], timeout=60)
    default, _, extra = r.stdout.partition("run only when named:")
    assert re.findall(r"^  (\S+)\s", default, flags=re.MULTILINE) == RUN_SH_MODES, "a run.sh mode without a test"
    assert re.findall(r"^  (\S+)\s", extra, flags=re.MULTILINE) == RUN_SH_EXTRA, "a run.sh mode without a test"


@pytest.mark.slow
@pytest.mark.timeout(700)  # its launches' own bounds first
def test_run_sh_feature_modes_pass(launch):
    """the MNIST hand-made launch (the default suite: run.sh's manual mode, the same launch of the linear
    model), resume and --evaluate, gradient accumulation, the seed's toy run, Join, ZeRO, comm hooks: each
    also has its own test (here, test_uneven.py, test_comm_hooks.py)."""
    modes = ["torchrun-single", "template", "main-manual", "main-resume", "transformer-accum", "transformer-toy", "uneven", "uneven-zero", "comm-hooks"]
    r = launch(["bash", ROOT / "run.sh", *modes], timeout=600)
    assert f"{len(modes)} passed, 0 failed" in r.stdout, str(r)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_run_sh_two_host_modes_pass(launch):
    """The same commands as test_multihost.py's, through run.sh (which removes its namespaces itself)."""
    r = launch(["bash", ROOT / "run.sh", "netns", "netns-elastic"], timeout=300)
    assert "2 passed, 0 failed" in r.stdout and "skip:" not in r.stdout, str(r)


def test_run_sh_unknown_mode_is_an_error(launch):
    r = launch(["bash", ROOT / "run.sh", "no-such-mode"], timeout=60, check=False)
    assert r.returncode == 2 and r.stderr.startswith("error: unknown mode")


# ================================================================ MNIST ConvNet: ddp_main.py, ddp_main_torchrun.py
# The network is made unreachable (a proxy on a closed port) so that `--dataset auto` and
# `--dataset mnist` behave the same on every machine: nothing is downloaded, ever.
MNIST_TEST_SAMPLES = 1001  # 7 x 11 x 13: neither 2 nor 3 divides it, so a padding sampler would show
MNIST_TIMEOUT = 240  # generous: the machine may be shared with other test runs
DEAD_PROXY = "http://127.0.0.1:9"  # the discard port: any download fails at once


def offline_env(**extra):
    return cpu_env(http_proxy=DEAD_PROXY, https_proxy=DEAD_PROXY, HTTP_PROXY=DEAD_PROXY,
                   HTTPS_PROXY=DEAD_PROXY, no_proxy="", NO_PROXY="", **extra)


def load_checkpoint(path):
    """The checkpoint as a user loads it: weights_only, into a fresh, unwrapped ConvNet."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    assert not any(k.startswith("module.") for k in checkpoint["model"]), "DDP's module. prefix was saved"
    model = ConvNet()
    model.load_state_dict(checkpoint["model"])  # strict: every key matches
    return checkpoint, model.eval()


@torch.no_grad()
def evaluate_here(model, images, labels):
    """One process, one batch, plain fp32: (correct, mean loss)."""
    outputs = model(images)
    return int((outputs.argmax(1) == labels).sum()), F.cross_entropy(outputs, labels).item()


def assert_matches_checkpoint(m, checkpoint_path, images, labels):
    """The script's distributed test result equals the checkpoint evaluated in this process."""
    _, model = load_checkpoint(checkpoint_path)
    correct, loss = evaluate_here(model, images, labels)
    assert m["test_samples"] == len(labels)
    assert round(m["test_accuracy"] * len(labels)) == correct, (m["test_accuracy"], correct)
    assert m["test_loss"] == pytest.approx(loss, rel=1e-4, abs=1e-6)


def synthetic_test_set(n, seed=0):
    data = SyntheticDigits(n, seed=seed, train=False)
    return data.images, data.targets


# ---------------------------------------------------------------- train, checkpoint, resume
def test_mnist_train_checkpoint_resume(run_sh, launch, script, metrics, tmp_path):
    """run.sh's main mode (mp.spawn, 2 ranks, default dataset `auto` without MNIST or network): a loud
    synthetic fallback that learns, and a checkpoint that loads with weights_only and reproduces the test
    result. Then --resume of that checkpoint by the torchrun sibling as a one-process world continues."""
    first, m1 = mode_output(run_sh, "main"), mode_metrics(run_sh, "main")
    assert "SYNTHETIC" in first and m1["dataset"] == "synthetic"
    assert first.count("note: --gpu 0,1 ignored on CPU") == 1
    assert first.count("SyncBatchNorm needs CUDA") == 1
    assert f"test: {m1['test_samples']} samples" in first
    assert first.strip().splitlines()[-2].startswith("done: ddp_main.py")  # then run.sh's "ok:"
    assert (m1["world_size"], m1["epochs"], m1["resumed_from_epoch"]) == (2, 3, 0)
    assert m1["steps_per_epoch"] == math.ceil(m1["train_samples"] / 2 / 32) and m1["steps"] == 3 * m1["steps_per_epoch"]
    assert (m1["sync_bn"], m1["replicas_in_sync"]) == (False, True)

    shutil.copy(run_sh.work / "main" / "ddp_checkpoint.pt", tmp_path / "ddp_checkpoint.pt")
    checkpoint, _ = load_checkpoint(tmp_path / "ddp_checkpoint.pt")
    assert checkpoint["epoch"] == 3 and checkpoint["args"]["batch_size"] == 32
    assert set(checkpoint) >= {"model", "optimizer", "scaler", "epoch", "args"}
    if m1["amp"] == "off":  # a CPU with bf16 instructions evaluates in bf16: not comparable to fp32 exactly
        assert_matches_checkpoint(m1, tmp_path / "ddp_checkpoint.pt", *synthetic_test_set(m1["test_samples"]))

    # resumed by the torchrun sibling as a one-process world: the checkpoint is launcher-independent
    second = launch([sys.executable, script("ddp_main_torchrun.py"), "--device", "cpu", "--amp", "off",
                     "--train_samples", m1["train_samples"], "--test_samples", MNIST_TEST_SAMPLES,
                     "--dataset", "synthetic", "--timeout", "60", "-e", "4", "--resume", "--metrics", "m2.json"],
                    timeout=MNIST_TIMEOUT, env=offline_env())
    m2 = metrics(tmp_path / "m2.json")
    assert "loaded ddp_checkpoint.pt (epoch 3" in second.stdout
    steps = math.ceil(m1["train_samples"] / 32)
    assert (f"note: resuming at world size 1 a checkpoint written at 2: an epoch is now {steps} steps of 32 samples x "
            "1 process") in second.stdout, second.stdout
    assert "epoch 3/4" not in second.stdout and "epoch 4/4" in second.stdout
    assert (m2["world_size"], m2["epochs"], m2["resumed_from_epoch"]) == (1, 4, 3)
    assert m2["steps"] == math.ceil(m1["train_samples"] / 32) == m2["steps_per_epoch"]
    # a run that ignored the checkpoint would start again near the first epoch's loss (about 1)
    assert m2["first_loss"] < 0.5 * m1["first_loss"], (m1["losses"], m2["losses"])
    assert m2["test_accuracy"] > 0.95, m2  # the synthetic set is learnable
    assert load_checkpoint(tmp_path / "ddp_checkpoint.pt")[0]["epoch"] == 4
    assert_matches_checkpoint(m2, tmp_path / "ddp_checkpoint.pt", *synthetic_test_set(MNIST_TEST_SAMPLES))


# ---------------------------------------------------------------- exact evaluation
# the seed's hand-made launch: each process is told its place in the job by environment variables
MANUAL_LAUNCH = r"""
port=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
pids=()
for r in 0 1; do
    RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port "$PYTHON" "$@" &
    pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
exit $rc
"""


# all three in the slow tier; the default suite's exact counts: test_mnist_train_checkpoint_resume evaluates 1001
# samples on 2 spawned ranks and on one process, each against its checkpoint, and run.sh's main modes 501 at 2 ranks
# (a padding sampler would count one twice); run.sh's manual mode is the hand-made launch
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_mnist_exact_evaluation(world_size, launch, script, metrics, torchrun, tmp_path):
    """Every test sample is counted once, whatever the world size, and the result equals
    the saved checkpoint evaluated in one process. Also: all three ways to launch the torchrun script."""
    args = [script("ddp_main_torchrun.py"), "--device", "cpu", "--dataset", "synthetic", "--train_samples", "192",
            "--amp", "off", "--test_samples", str(MNIST_TEST_SAMPLES), "--metrics", "m.json", "--timeout", "60"]
    if world_size == 1:  # plain python: a one-process world
        result = launch([sys.executable, *args, "-e", "1"], timeout=MNIST_TIMEOUT)
    elif world_size == 2:
        result = launch(["bash", "-c", MANUAL_LAUNCH, "manual", *args, "-e", "1"], timeout=MNIST_TIMEOUT,
                        env=cpu_env(PYTHON=sys.executable))
    else:  # torchrun decides the world size; --gpu is ignored on CPU; the default number of epochs
        result = launch([*torchrun, "--standalone", f"--nproc_per_node={world_size}", *args, "--gpu", "0,1"],
                        timeout=MNIST_TIMEOUT)
    m = metrics(tmp_path / "m.json")
    assert m["world_size"] == world_size and m["replicas_in_sync"] is True
    if world_size == 3:
        # 192 samples over 3 ranks: 2 steps an epoch (as 6000 over 16 GPUs gives 12). The default
        # then trains 60 steps (30 epochs), not 3 epochs of 2 steps, and learns (94.6% measured).
        assert (m["steps_per_epoch"], m["epochs"], m["steps"]) == (2, 30, 60), m
        assert m["test_accuracy"] > 0.9, m
    assert result.stdout.count(f"test: {MNIST_TEST_SAMPLES} samples") == 1
    assert result.stdout.count("note: --gpu") == (1 if world_size == 3 else 0)
    assert_matches_checkpoint(m, tmp_path / "ddp_checkpoint.pt", *synthetic_test_set(MNIST_TEST_SAMPLES))


def test_mnist_gpu_indexes_a_preset_cuda_visible_devices():
    """--gpu 0,1 under SLURM's or a container's CUDA_VISIBLE_DEVICES=4,5,6,7 means GPUs 4 and 5."""
    from ddp_main import visible_gpus
    assert visible_gpus("0,1", "4,5,6,7") == "4,5"
    assert visible_gpus("1,3", "GPU-a,GPU-b,GPU-c,GPU-d") == "GPU-b,GPU-d"  # UUIDs are indexed alike
    assert visible_gpus("0,1", None) == "0,1"  # nothing set: GPU numbers
    assert visible_gpus("0,1", "") == ""  # no GPU visible stays so (the script runs on CPU with a note)
    assert visible_gpus("2", "4,5") is None  # beyond the visible GPUs: an error in the script


# ---------------------------------------------------------------- MNIST files, AMP
def write_idx(raw, prefix, images, labels):
    """torchvision's raw MNIST format (IDX): big-endian magic and sizes, then uint8 data."""
    raw.mkdir(parents=True, exist_ok=True)
    (raw / f"{prefix}-images-idx3-ubyte").write_bytes(
        struct.pack(">4i", 0x803, len(images), 28, 28) + images.numpy().tobytes())
    (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">2i", 0x801, len(labels)) + labels.numpy().tobytes())


def striped_digits(n, seed):
    """uint8 images whose class is the row of a bright band, plus noise: learnable, unlike MNIST-sized noise."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g, dtype=torch.uint8)
    images = torch.randint(0, 60, (n, 28, 28), generator=g, dtype=torch.uint8)
    for i, c in enumerate(labels.tolist()):
        images[i, 2 + 2 * c:6 + 2 * c, 4:24] = 255
    return images, labels


def test_mnist_files_and_bf16(launch, script, metrics, tmp_path):
    """--dataset mnist reads IDX files written here through torchvision's MNIST, with no network;
    --amp bf16 trains on CPU and really runs in bf16 (its test loss differs from fp32's). One
    process (the torchrun sibling as plain python, whose data code is ddp_main.py's): the data
    path is the point here, and run.sh trains both siblings on 2 ranks."""
    raw = tmp_path / "data" / "MNIST" / "raw"
    train_images, train_labels = striped_digits(320, seed=1)
    test_images, test_labels = striped_digits(101, seed=2)
    write_idx(raw, "train", train_images, train_labels)
    write_idx(raw, "t10k", test_images, test_labels)
    result = launch([sys.executable, script("ddp_main_torchrun.py"), "--device", "cpu", "--dataset", "mnist",
                     "--data", str(tmp_path / "data"), "-e", "2", "--amp", "bf16", "--metrics", "m.json"],
                    timeout=MNIST_TIMEOUT, env=offline_env())
    m = metrics(tmp_path / "m.json")
    # the user's own IDX files: not named MNIST (which has 60000 + 10000 samples)
    assert "MNIST download failed" not in result.stdout, result.stdout
    assert f"data: IDX files of 10 classes, 1 x 28 x 28 from {tmp_path / 'data'}" in result.stdout, result.stdout
    assert (m["dataset"], m["train_samples"], m["test_samples"], m["amp"]) == ("idx", 320, 101, "bf16")
    assert m["test_accuracy"] > 0.9, m  # images and labels were read in step
    checkpoint, model = load_checkpoint(tmp_path / "ddp_checkpoint.pt")
    assert checkpoint["args"]["amp"] == "bf16" and checkpoint["args"]["dataset"] == "idx"
    train_pixels = train_images.double() / 255  # normalised by the training split's mean and std
    mean, std = train_pixels.mean().item(), train_pixels.std().item()
    assert f"mean {mean:.4f}, std {std:.4f} per channel" in result.stdout, result.stdout
    normalized = ((test_images.float() / 255 - mean) / std).unsqueeze(1)  # the script's transform
    correct, fp32_loss = evaluate_here(model, normalized, test_labels.long())
    assert abs(round(m["test_accuracy"] * 101) - correct) <= 2
    assert m["test_loss"] != fp32_loss and m["test_loss"] == pytest.approx(fp32_loss, rel=0.1, abs=0.01)


def test_mnist_on_two_nodes_without_data(launch, script, metrics, torchrun, tmp_path):
    """Two torchrun agents as two nodes on this machine (--nnodes=2 --node-rank=0/1, as run.sh's nodes mode), MNIST's
    files in the default ./data, no --data: the second node's first process (rank 1, LOCAL_RANK 0) looks for them
    there too. Before issue 52 it looked in None (a TypeError) and the job ended "lost rank 1"."""
    raw = tmp_path / "data" / "MNIST" / "raw"
    for prefix, n, seed in (("train", 128, 1), ("t10k", 64, 2)):
        write_idx(raw, prefix, *striped_digits(n, seed))
    port = free_port()
    nodes = [shlex.join([*torchrun, "--nnodes=2", f"--node-rank={node}", "--nproc-per-node=1",
                         "--master-addr=127.0.0.1", f"--master-port={port}", script("ddp_main_torchrun.py"),
                         "--device", "cpu", "-e", "1", "--timeout", "60", "--metrics", "m.json"]) for node in (0, 1)]
    result = launch(["bash", "-c", f"{nodes[0]} & node0=$!; {nodes[1]}; node1=$?; wait $node0; exit $(($? | node1))"],
                    timeout=MNIST_TIMEOUT, env=offline_env(OMP_NUM_THREADS=1), check=False)
    assert result.returncode == 0 and "Traceback" not in result.stderr, str(result)
    m = metrics(tmp_path / "m.json")
    assert m["world_size"] == 2 and m["dataset"] == "idx" and m["train_samples"] == 128, m
    assert m["replicas_in_sync"] is True and "MNIST download failed" not in result.stdout, str(result)
    assert "data: IDX files of 10 classes, 1 x 28 x 28 from ./data" in result.stdout, str(result)


def test_mnist_missing_is_a_clear_error(launch, script, tmp_path):
    """No MNIST and no network: --dataset mnist fails fast with one error line naming the fix."""
    result = launch([sys.executable, script("ddp_main_torchrun.py"), "--device", "cpu", "--dataset", "mnist",
                     "--data", str(tmp_path / "nothing")], timeout=MNIST_TIMEOUT, env=offline_env(), check=False)
    assert result.returncode == 2, result
    errors = error_lines(result.stderr)
    assert len(errors) == 1 and "--dataset synthetic" in errors[0], result
    assert "Traceback" not in result.stderr, result


# ================================================================ Transformer: ddp_transformer.py
# Causality, no_sync accumulation, learning (the default step budget on the default corpus and on
# a generated text, at 1 and 2 processes), the seed's toy run, checkpoints (mid-epoch, fp16 after
# fp32), torch.compile (slow), errors. The accumulation test starts two real gloo ranks in-process.
TRANSFORMER = "ddp_transformer.py"
# a small model for the runs that test behaviour, not learning
TRANSFORMER_SMALL = ["--d_model", "32", "--num_layers", "1", "--block_size", "32", "--batch_size", "16",
                     "--sample", "0"]


def torchrun2(torchrun, script, *args):
    return [*torchrun, "--standalone", "--nproc-per-node=2", script(TRANSFORMER), "--device", "cpu", *args]


# ---------------------------------------------------------------- causality
@pytest.mark.parametrize("device,amp", [("cpu", None), ("cpu", torch.bfloat16), *[
    pytest.param("cuda", dtype, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))
    for dtype in (None, torch.bfloat16)]])
def test_transformer_changing_token_t_changes_no_logit_before_t(device, amp):
    torch.manual_seed(0)
    model = Transformer(50, 32, 4, 64, 3, 64).to(device).eval()
    x = torch.randint(0, 50, (3, 40), device=device)
    for t in (0, 17, 39):
        changed = x.clone()
        changed[:, t] = (x[:, t] + 1) % 50
        with torch.no_grad(), torch.autocast(device, dtype=amp, enabled=amp is not None):
            before, after = model(x).float(), model(changed).float()
        assert before.shape == (3, 40, 50)
        assert torch.allclose(before[:, :t], after[:, :t], atol=1e-6, rtol=0), f"logits before {t} moved"
        assert (before[:, t:] - after[:, t:]).abs().max() > 1e-3, f"token {t} changed nothing at or after {t}"


def test_rotary_positions_make_a_score_depend_on_the_distance_alone():
    """rotate turns q_t and k_s so that q_t . k_s depends on t - s: the same pair of vectors scores
    alike at (t, s) and (t + 7, s + 7), and differently at another distance; it keeps lengths."""
    torch.manual_seed(0)
    q, k = torch.randn(64), torch.randn(64)
    x = torch.stack([q, k]).view(2, 1, 1, 64).expand(2, 1, 40, 64)  # the same vectors at every position
    rq, rk = ddp_transformer.rotate(x[:1])[0, 0], ddp_transformer.rotate(x[1:])[0, 0]
    assert torch.allclose(rq.norm(dim=-1), q.norm().expand(40), rtol=1e-5)
    assert torch.allclose(rq[10] @ rk[3], rq[17] @ rk[10], rtol=1e-4)
    assert not torch.allclose(rq[10] @ rk[3], rq[10] @ rk[4], rtol=1e-2)
    odd = torch.randn(1, 1, 5, 3)  # the seed's toy heads are 3 wide: the last channel stays as it is
    assert torch.equal(ddp_transformer.rotate(odd)[..., 2], odd[..., 2])


def test_muon_steps_as_torch_muon_and_adamw_do():
    """--optimizer muon's one optimizer: Muon's step on the marked matrices (torch.optim.Muon's, with
    match_rms_adamw), AdamW's on the rest, and a state_dict that loads back; the orthogonalized step
    has every singular value near 1."""
    torch.manual_seed(0)
    made = [torch.randn(48, 24, requires_grad=True), torch.randn(24, requires_grad=True)]
    copies = [t.detach().clone().requires_grad_() for t in made]
    mine = ddp_transformer.Muon([{"params": made[:1], "muon": True, "weight_decay": 0.1},
                                 {"params": made[1:], "weight_decay": 0.1}], lr=2e-3)
    theirs = [torch.optim.AdamW(copies[1:], lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1)]
    if hasattr(torch.optim, "Muon"):  # torch 2.9 and later
        theirs.append(torch.optim.Muon(copies[:1], lr=2e-3, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"))
    for _ in range(4):
        grads = [torch.randn_like(t) for t in made]
        for t, c, g in zip(made, copies, grads):
            t.grad, c.grad = g.clone(), g.clone()
        mine.step()
        for optimizer in theirs:
            optimizer.step()
    assert torch.allclose(made[1], copies[1], atol=1e-6)
    if len(theirs) == 2:
        assert torch.allclose(made[0], copies[0], atol=5e-4)  # both orthogonalize in bf16, in their own order
    singular = torch.linalg.svdvals(ddp_transformer.orthogonalize(torch.randn(48, 24)).float())
    assert singular.min() > 0.5 and singular.max() < 1.5, singular
    again = ddp_transformer.Muon(mine.param_groups, lr=2e-3)
    again.load_state_dict(mine.state_dict())
    loaded, saved = again.state_dict(), mine.state_dict()
    assert loaded["param_groups"] == saved["param_groups"] and list(loaded["state"]) == [0, 1]
    assert torch.equal(loaded["state"][0]["momentum"], saved["state"][0]["momentum"])
    assert torch.equal(loaded["state"][1]["exp_avg_sq"], saved["state"][1]["exp_avg_sq"])


# ---------------------------------------------------------------- gradient accumulation
def counting_allreduce(calls, bucket):
    """DDP's own all-reduce hook, counting the buckets it sends."""
    calls.append(bucket.index())
    return default_hooks.allreduce_hook(None, bucket)


def one_step(micro_batches, vocab, wrap):
    """Fresh seeded model, one SGD step of train_step over micro_batches; returns (parameters, all-reduces)."""
    torch.manual_seed(0)
    model = Transformer(vocab, 16, 2, 32, 2, 16)
    calls = []
    trained = model
    if wrap:
        trained = DDP(model, gradient_as_bucket_view=True)  # as the script wraps it
        trained.register_comm_hook(calls, counting_allreduce)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    ddp_transformer.train_step(trained, optimizer, scaler, micro_batches, contextlib.nullcontext(), clip=0)
    params = [p.detach().clone() for p in model.parameters()]
    del trained, model
    return params, len(calls)


def accumulation_check(rank, world, k):
    """On a live gloo group: K micro-batches (K-1 under no_sync) == one step on their concatenation
    == one process stepping on every rank's micro-batches. Runs in _gloo_pair_worker."""
    vocab = 20
    data = torch.randint(0, vocab, (world, k, 4, 17), generator=torch.Generator().manual_seed(1))
    mine = [(d[:, :-1], d[:, 1:]) for d in data[rank]]
    accumulated, accumulated_calls = one_step(mine, vocab, wrap=True)
    concatenated, concatenated_calls = one_step([(data[rank].flatten(0, 1)[:, :-1],
                                                  data[rank].flatten(0, 1)[:, 1:])], vocab, wrap=True)
    everything = data.flatten(0, 2)  # every rank's micro-batches, one process, no DDP
    reference, _ = one_step([(everything[:, :-1], everything[:, 1:])], vocab, wrap=False)
    # no_sync really skipped the all-reduce of the first k-1 micro-batches
    assert accumulated_calls == concatenated_calls > 0, (accumulated_calls, concatenated_calls)
    torch.manual_seed(0)
    initial = list(Transformer(vocab, 16, 2, 32, 2, 16).parameters())
    assert any(not torch.allclose(a, i) for a, i in zip(accumulated, initial)), "the step moved nothing"
    for a, c, r in zip(accumulated, concatenated, reference):
        assert torch.allclose(a, c, atol=1e-6, rtol=1e-5), (a - c).abs().max()
        assert torch.allclose(a, r, atol=1e-6, rtol=1e-5), (a - r).abs().max()


@pytest.mark.xdist_group("gloo_pair")
def test_transformer_no_sync_accumulation_equals_one_step_on_the_concatenated_batch(gloo_pair):
    """2 gloo ranks (the gloo_pair launch): K micro-batches (K-1 under no_sync) == one step on their concatenation."""
    out = gloo_pair[0]
    assert [open(f"{out}.accumulation.{r}").read() for r in (0, 1)] == ["ok", "ok"]


# ---------------------------------------------------------------- learning
def entropy_nats(text):
    counts = Counter(text)
    return -sum(n / len(text) * math.log(n / len(text)) for n in counts.values())


def test_transformer_default_run_beats_the_unigram_entropy(run_sh):
    # run.sh's transformer mode: torchrun --standalone --nproc-per-node=2 ddp_transformer.py --sample 100
    m = mode_metrics(run_sh, "transformer")
    entropy = entropy_nats(ddp_transformer.default_corpus())
    assert m["world_size"] == 2 and m["replicas_in_sync"] is True
    assert m["steps"] == m["max_steps"] == ddp_transformer.MAX_STEPS, m  # a step budget, not an epoch
    assert m["unigram_entropy"] == pytest.approx(entropy, rel=1e-6)
    assert m["val_loss"] < m["first_val_loss"] - 1.0, m
    assert m["val_loss"] < entropy, (m["val_loss"], entropy)
    assert m["tokens_per_s"] > 0 and m["flops_per_s"] == pytest.approx(m["tokens_per_s"] * m["flops_per_token"])
    vocab = len(set(ddp_transformer.default_corpus()))
    assert m["params"] == sum(p.numel() for p in Transformer(vocab, 128, 4, 512, 4, 128).parameters())
    out = mode_output(run_sh, "transformer")
    assert out.strip().splitlines()[-2].startswith("done:") and out.count("sample (") == 1  # then run.sh's "ok:"
    assert m["mfu"] is None and out.count("note: no MFU: no peak is known for the CPU") == 1  # no --peak_tflops
    spe = m["steps_per_epoch"]
    assert f"| {m['max_steps']} steps = {m['max_steps'] / spe:.2f} epochs of {spe} steps of 1 micro-batch x 8 windows x 2 processes" in out


# common English words, Zipf-weighted: a text unlike the default corpus, made without any file
ENGLISH_WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from at which but "
                 "have an they you were her she there been one all we their has would when if so no will can more "
                 "other into its than some could them time these two may first then do any like my now over such "
                 "our man me even most made after also did many before must through back years where much your way "
                 "well down should because each just those people how too little state good very make world still "
                 "own see men work long get here between both life being under never day same another know while "
                 "last might us great old year off come since against go came right used take three").split()


def english_like(chars, seed=0):
    """Sentences of 4-14 words from a seeded generator, `chars` characters in all."""
    g = torch.Generator().manual_seed(seed)
    zipf = 1 / torch.arange(1, len(ENGLISH_WORDS) + 1, dtype=torch.float64)
    sentences, length = [], 0
    while length < chars:
        words = torch.multinomial(zipf, int(torch.randint(4, 15, (), generator=g)), replacement=True, generator=g)
        end = ".....?!"[int(torch.randint(0, 7, (), generator=g))] + ("\n" if torch.rand((), generator=g) < 0.2 else " ")
        sentences.append(" ".join(ENGLISH_WORDS[w] for w in words).capitalize() + end)
        length += len(sentences[-1])
    return "".join(sentences)[:chars]


def test_transformer_default_run_length_is_a_step_budget_at_any_world_size():
    """In this process: the default run is MAX_STEPS optimizer steps, whatever the steps per epoch (and so
    the world size and the text). That the default run learns: run.sh's transformer mode (2 processes,
    the default corpus) in the default suite; a generated English text at 1 and 2 processes, below."""
    args = ddp_transformer.check_args(ddp_transformer.parse_args([]))
    for steps_per_epoch in (1, 7, 53, 106, 1000):
        assert ddp_transformer.run_length(steps_per_epoch, args) == (
            ddp_transformer.MAX_STEPS, math.ceil(ddp_transformer.MAX_STEPS / steps_per_epoch))


# 60 steps of the default model: about 40 s of CPU at 1 process, 30 at 2
@pytest.mark.slow
@pytest.mark.parametrize("nprocs", [1, 2])
def test_transformer_default_run_learns_a_new_text_at_any_world_size(launch, script, torchrun, metrics, tmp_path,
                                                                       nprocs):
    """The default run length is a step budget: on a 12,000-character text it has the same steps at
    1 and 2 processes (1.2 and 2.4 epochs of it) and ends below the text's unigram entropy."""
    text = english_like(12_000)
    (tmp_path / "english.txt").write_text(text, encoding="utf-8")
    args = ["--device", "cpu", "--data", "english.txt", "--sample", "0", "--metrics", "m.json"]
    if nprocs == 1:  # plain python: a one-process world. One thread, as each of torchrun's 2 below: the
        # suite runs 2 tests at once on 2 cores, where a 2-thread process waits at OpenMP barriers (seen: 140 s)
        out = launch([sys.executable, script(TRANSFORMER), *args], timeout=300, env=cpu_env(OMP_NUM_THREADS=1)).stdout
    else:
        out = launch([*torchrun, "--standalone", f"--nproc-per-node={nprocs}", script(TRANSFORMER), *args],
                     timeout=300).stdout
    m = metrics(tmp_path / "m.json")
    windows = int(len(text) * (1 - ddp_transformer.VAL_FRACTION)) // 128
    spe = math.ceil(math.ceil(windows / nprocs) / 8)
    assert m["world_size"] == nprocs and m["steps_per_epoch"] == spe and m["replicas_in_sync"] is True, m
    assert m["steps"] == ddp_transformer.MAX_STEPS and m["epochs"] == math.ceil(m["steps"] / spe), m
    assert f"| {m['steps']} steps = {m['steps'] / spe:.2f} epochs of {spe} steps of 1 micro-batch x 8 windows x {'1 process' if nprocs == 1 else f'{nprocs} processes'}" in out
    assert m["unigram_entropy"] == pytest.approx(entropy_nats(text), rel=1e-9)
    assert m["val_loss"] < entropy_nats(text), (m["val_loss"], entropy_nats(text))


@pytest.mark.slow  # the default suite's budget: the toy run is run.sh's transformer-toy mode too
def test_transformer_toy_loss_falls(launch, script, torchrun, metrics, tmp_path):
    # --peak_tflops: the MFU against 2 devices of 0.5 TFLOP/s each (issue 17), in each log line and the metrics
    out = launch(torchrun2(torchrun, script, "--dataset", "toy", "--epochs", "30", "--metrics", "m.json",
                           "--peak_tflops", "0.5"), timeout=300).stdout
    m = metrics(tmp_path / "m.json")
    assert m["steps_per_epoch"] == 3 and m["steps"] == 90  # 12 rows / (2 ranks x 2 rows), as in the seed
    assert m["final_loss"] < m["first_loss"] - 0.2, m["losses"]
    assert m["val_loss"] < m["first_val_loss"]
    assert m["peak_flops"] == 1e12 and m["mfu"] == m["flops_per_s"] / 1e12 and m["windows"] == [12] * 30, m
    assert "MFU against 2 x 0.5 TFLOP/s (--peak_tflops 0.5)" in out and re.search(r"^step 20/90 \| .* \| MFU [\d.]+%$", out,
                                                                                 flags=re.MULTILINE), out


# ---------------------------------------------------------------- checkpoints
def small_corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(ddp_transformer.default_corpus()[:20000], encoding="utf-8")
    return str(path)


def test_transformer_checkpoint_round_trip_and_resume(run_sh, launch, script, torchrun, metrics, tmp_path,
                                                     capsys):
    """run.sh's transformer mode (2 ranks, 60 steps = 1 epoch and 7 steps) ends with a mid-epoch checkpoint
    that loads with weights_only into a fresh model giving exactly the reported validation loss; resumed
    under --amp fp16 by one process it keeps the global batch, trains 1 more step (a fresh GradScaler,
    said once) and saves its place again."""
    m1 = mode_metrics(run_sh, "transformer")
    shutil.copy(run_sh.work / "transformer" / "ddp_transformer.pt", tmp_path / "ck.pt")
    state = torch.load(tmp_path / "ck.pt", map_location="cpu", weights_only=True)
    spe = m1["steps_per_epoch"]
    epoch, steps_in = divmod(m1["steps"], spe)  # the position in global units: windows of the epoch's order
    assert state["step"] == m1["steps"] and state["global_batch"] == 16, state["global_batch"]
    assert (state["epoch"], state["windows_in_epoch"]) == (epoch, steps_in * 16)
    assert not any(k.startswith("module.") for k in state["model"])
    model = Transformer(**state["config"])
    model.load_state_dict(state["model"])  # strict: every weight, nothing else
    # the loaded weights give exactly the validation loss the run reported
    text = ddp_transformer.default_corpus()
    vocab = "".join(sorted(set(text)))
    assert state["vocab"] == vocab
    args = ddp_transformer.check_args(ddp_transformer.parse_args([]))
    _, val_set = ddp_transformer.build_data(args, text, vocab, torch.device("cpu"))
    totals = ddp_transformer.evaluate(model.eval(), val_set, range(len(val_set)), 64, contextlib.nullcontext())
    assert (totals[0] / totals[1]).item() == pytest.approx(m1["val_loss"], rel=1e-5)

    steps = m1["steps"] + 1  # fp16 on a CPU is slow: one step shows the resume
    # resumed by plain python, a world of one: the global batch of 2 x 8 windows is kept (2 micro-batches)
    out = launch([sys.executable, script(TRANSFORMER), "--device", "cpu", "--checkpoint", "ck.pt", "--resume",
                  "--max_steps", steps, "--sample", "0", "--amp", "fp16", "--metrics", "m2.json",
                  "--weight_decay", "0.25"], timeout=300)
    m2 = metrics(tmp_path / "m2.json")
    assert f"resuming from ck.pt at epoch {state['epoch']}, step {m1['steps']}" in out.stdout, out
    assert out.stdout.count("global batch kept: 16 windows a step") == 1, out
    assert "here 1 process x --batch_size 8 x --grad_accum 2" in out.stdout, out
    assert out.stdout.count("holds no fp16 loss scale: the GradScaler starts afresh") == 1, out
    assert m2["resumed_from_epoch"] == state["epoch"] and m2["steps"] == 1, m2
    # continued, not restarted: an untrained model starts near the first validation loss (4.8 on this corpus)
    assert m2["first_loss"] < m1["first_val_loss"] - 1, (m1, m2["losses"])
    assert m2["amp"] == "fp16" and m2["replicas_in_sync"] is True, m2
    after = torch.load(tmp_path / "ck.pt", weights_only=True)
    epoch, steps_in = divmod(steps, spe)
    assert after["step"] == steps and (after["epoch"], after["windows_in_epoch"]) == (epoch, steps_in * 16)  # mid-epoch
    assert after["scaler"]["scale"] > 0, after["scaler"]
    # the resumed run's own --weight_decay, not the checkpoint's (its groups' numbers come back with its state)
    assert [g["weight_decay"] for g in state["optimizer"]["param_groups"]] == [0.1, 0.0]
    assert [g["weight_decay"] for g in after["optimizer"]["param_groups"]] == [0.25, 0.0]

    # a checkpoint of another model is refused before any process group exists (in this process)
    capsys.readouterr()
    args = ddp_transformer.check_args(ddp_transformer.parse_args(
        ["--device", "cpu", "--d_model", "64", "--checkpoint", str(tmp_path / "ck.pt"), "--resume"]))
    with pytest.raises(SystemExit) as exited:
        ddp_transformer.read_checkpoint(args, (text, "the text", vocab))
    lines = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(lines) == 1 and lines[0].startswith("error:") and "d_model" in lines[0], lines


def test_transformer_generation_snippet_runs_on_the_checkpoint(run_sh, tmp_path, capsys, monkeypatch):
    """docs/generate.md's generate.py, run as written on run.sh's ddp_transformer.py checkpoint: the
    prompt and 200 more characters of the corpus's vocabulary (issue 32)."""
    ck = run_sh.work / "transformer" / "ddp_transformer.pt"
    vocab = torch.load(ck, weights_only=True)["vocab"]
    out = run_doc_snippet("generate.md", "# generate.py", [ck, "The "], tmp_path, capsys, monkeypatch)
    text = out.removesuffix("\n")
    assert text.startswith("The ") and len(text) == 4 + 200 and set(text) <= set(vocab), repr(out)


# ---------------------------------------------------------------- torch.compile
@pytest.mark.slow  # compiling on CPU (C++ kernels) takes 1-4 minutes on 2 busy cores, once per cold cache
@pytest.mark.timeout(1260)  # its launches' own bounds first
def test_transformer_compiled_ddp_trains_like_eager(launch, script, torchrun, metrics, tmp_path):
    """--compile (torch.compile around DDP) on 2 gloo ranks: the same training as eager, replicas agree."""
    data = small_corpus(tmp_path)
    common = ["--data", data, *TRANSFORMER_SMALL, "--max_steps", "12", "--log_every", "4"]
    # two runs, two checkpoints: a run never continues another run's checkpoint unasked (it stops instead)
    out = launch(torchrun2(torchrun, script, *common, "--compile", "--metrics", "c.json", "--checkpoint", "c.pt"),
                 timeout=900).stdout
    launch(torchrun2(torchrun, script, *common, "--metrics", "e.json", "--checkpoint", "e.pt"), timeout=300)
    compiled, eager = metrics(tmp_path / "c.json"), metrics(tmp_path / "e.json")
    assert compiled["compile"] is True and "| compiled |" in out and "(compiling)" in out, out
    assert compiled["steps"] == 12 and compiled["replicas_in_sync"] is True, compiled
    assert compiled["val_loss"] < compiled["first_val_loss"] - 0.5, compiled
    # the same steps on the same batches: compiled kernels round differently, nothing more
    assert compiled["val_loss"] == pytest.approx(eager["val_loss"], abs=0.02), (compiled, eager)


def _compile_order_worker(rank, port, out):
    """Graphs a counting backend is given for the default model (vocabulary 65), each order, each bucket cap: one
    per DDPOptimizer split, each split at a bucket boundary."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    counts = {}
    for order, cap in itertools.product(("wrap first", "compile first"), (25, 1)):
        graphs = []
        torch._dynamo.reset()
        torch.manual_seed(0)
        module = Transformer(65, 128, 4, 512, 4, 128)
        count = torch.compile(backend=lambda gm, inputs: graphs.append(gm) or gm.forward, dynamic=True)
        model = (count(DDP(module, gradient_as_bucket_view=True, bucket_cap_mb=cap)) if order == "wrap first" else
                 DDP(count(module), gradient_as_bucket_view=True, bucket_cap_mb=cap))
        model(torch.randint(0, 65, (8, 128))).sum().backward()
        counts[f"{order}, {cap} MB"] = len(graphs)
        del model
    if rank == 0:
        Path(out).write_text(json.dumps(counts))
    dist.destroy_process_group()


@pytest.mark.slow  # dynamo traces the model 4 times (no kernels compiled): about 20 s of CPU
def test_transformer_compile_splits_at_ddp_buckets_in_either_order(tmp_path):
    """The docstring's claim, measured: DDPOptimizer splits the compiled graph into the same buckets whether DDP
    wraps the compiled model or torch.compile wraps DDP, with the counts it states (before issue 52 it said that
    compiling first left nothing to overlap)."""
    mp.spawn(_compile_order_worker, args=(free_port(), str(tmp_path / "counts.json")), nprocs=2, join=True)
    counts = json.loads((tmp_path / "counts.json").read_text())
    said = re.search(r"(\d+) at the\s+default --bucket_cap_mb 25, (\d+) at 1", ddp_transformer.__doc__)
    assert said and "nothing overlaps" not in ddp_transformer.__doc__, ddp_transformer.__doc__
    for cap, graphs in ((25, int(said[1])), (1, int(said[2]))):
        assert counts[f"wrap first, {cap} MB"] == counts[f"compile first, {cap} MB"] == graphs, counts


# ---------------------------------------------------------------- errors
def test_transformer_help_lists_the_flags(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps the help to the terminal's width
    with pytest.raises(SystemExit) as exited:
        ddp_transformer.parse_args(["--help"])
    out = capsys.readouterr().out
    assert exited.value.code == 0
    for flag in ("--grad_accum", "--amp", "--data", "--resume", "--eval_every", "--sample", "per process",
                 "--compile", "--epochs"):
        assert flag in out, flag
    # the default run length is stated in steps, and what that is in epochs
    assert re.search(rf"--max_steps N.*default: {ddp_transformer.MAX_STEPS}\s+on text", out, re.DOTALL)
    assert "epochs of the default corpus" in " ".join(out.split())


def test_transformer_too_short_corpus_is_one_clear_error(launch, script, torchrun, tmp_path, capsys):
    (tmp_path / "short.txt").write_text("print('hello')\n" * 3)
    # the check, in this process: one line, exit 2
    args = ddp_transformer.check_args(ddp_transformer.parse_args(["--device", "cpu", "--data",
                                                                  str(tmp_path / "short.txt")]))
    with pytest.raises(SystemExit) as exited:
        ddp_transformer.read_corpus(args)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and lines == error_lines("\n".join(lines)) and len(lines) == 1, lines
    assert "--block_size" in lines[0]
    # through torchrun, 2 ranks that both read the file: still one line, from rank 0
    ranks = launch(torchrun2(torchrun, script, "--data", "short.txt"), timeout=120, check=False)
    assert ranks.returncode != 0 and len(error_lines(ranks.stderr)) == 1, ranks
    assert "--block_size" in error_lines(ranks.stderr)[0], ranks


# ================================================================ what the docstrings and the README say (issue 52)
README = (ROOT / "README.md").read_text()


def docstring(name):
    return ast.get_docstring(ast.parse((ROOT / name).read_text()))


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_docstring_never_names_its_own_file_its_nearest_sibling(name):
    for clause in re.findall(r"nearest siblings?\W+(.*?)(?:\.\s|;|$)", docstring(name), flags=re.I | re.S):
        assert name not in re.findall(r"[\w/]+\.py", clause), f"{name} names itself as its sibling: {clause!r}"


def test_fsdp_transformer_claims_no_ddp_call():
    """It shards with fully_shard; its docstring said its lesson held 'every DDP call'."""
    assert "DistributedDataParallel" not in (ROOT / "fsdp_transformer.py").read_text()
    assert "DDP call" not in docstring("fsdp_transformer.py")


def timeout_default(name):
    for node in ast.walk(ast.parse((ROOT / name).read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and \
                node.args and getattr(node.args[0], "value", None) == "--timeout":
            return next(k.value.value for k in node.keywords if k.arg == "default")


def test_every_timeout_default_is_the_readmes():
    """The flags table: `--timeout` 300 everywhere but the one script it names (ddp_slow.py had 60)."""
    said = re.search(r"^\| `--timeout SECONDS` \|.*\(default (\d+); (\d+) in `(\w+\.py)`\)", README, re.M)
    assert said, "the README's flags table lost its --timeout row"
    defaults = {name: timeout_default(name) for name in SCRIPTS}
    assert defaults == {name: int(said[2] if name == said[3] else said[1]) for name in SCRIPTS}, defaults


def test_the_readme_says_what_torchrun_does_to_threads():
    """It said every CPU process takes cores // processes threads unless OMP_NUM_THREADS is set."""
    cpu = " ".join(README.split("**The CPU path.**", 1)[1].split("\n\n", 1)[0].split())
    assert "torchrun sets it to 1 when it starts several processes a machine" in cpu, cpu
    assert "otherwise (mp.spawn, plain `python`) `cores // processes`" in cpu, cpu


@pytest.mark.slow  # two torchrun launches of a script that imports nothing; the default tier reads the README
def test_torchrun_sets_one_thread_for_several_processes_a_machine(launch, torchrun, tmp_path):
    """What the README says of torchrun, on the torch installed: OMP_NUM_THREADS=1 for 2 processes a machine
    (so the scripts take 1 thread each, not cores // processes), unset for 1."""
    (tmp_path / "omp.py").write_text("import os\nprint('OMP_NUM_THREADS', os.environ.get('OMP_NUM_THREADS'))\n")
    for per_node, says in ((2, "1"), (1, "None")):
        out = launch([*torchrun, "--standalone", f"--nproc-per-node={per_node}", "omp.py"], timeout=120).stdout
        assert out.split().count(says) == per_node, out
