"""Tests of the foundation: the linear-model scripts and run.sh, launched as users launch them.

Everything runs on CPU with gloo (CUDA_VISIBLE_DEVICES= and --device cpu), every launch in
its own temporary directory and bounded by a timeout (see conftest.py). The assertions are
about behaviour: the loss falls, replicas agree, step counts are as computed, a snapshot
resumes exactly, bad input gets one line and exit code 2, exits are clean.
"""
import gc
import itertools
import math
import os
import re
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DistributedSampler

from conftest import ROOT, cpu_env, read_metrics, run_bounded

RUN_SH_MODES = ["minimal", "spawn", "torchrun", "torchrun-single", "launch", "manual", "nodes", "restart",
                "main", "main-torchrun", "main-manual", "main-resume",
                "transformer", "transformer-accum", "transformer-toy"]
RUN_SH_EXTRA = ["bench", "netns", "netns-elastic"]  # bench: test_dp_bench.py


# ---------------------------------------------------------------- run.sh, once for every mode
@pytest.fixture(scope="module")
def run_sh(tmp_path_factory):
    """`bash run.sh`: every default mode, once; the tests below read its output."""
    work = tmp_path_factory.mktemp("run_sh")
    return run_bounded(["bash", ROOT / "run.sh"], work, timeout=900, check=False)


def mode_output(run_sh, mode):
    """The part of run.sh's output that belongs to one mode."""
    start = run_sh.stdout.index(f"================ {mode}: ")
    return run_sh.stdout[start:run_sh.stdout.index("\n---------------- ", start)]


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
    assert "replicas: in sync (2 ranks" in out and "| parameters changed | replicas in sync" in out
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


@pytest.mark.parametrize("nprocs,batch", [(1, 100), (3, 32)])
def test_spawn_steps_per_epoch(launch, script, tmp_path, nprocs, batch):
    r = launch([sys.executable, script("ddp_gpus.py"), "-e", "2", "-b", batch, "--device", "cpu",
                "--nprocs", nprocs, "--metrics", tmp_path / "m.json"], timeout=90)
    expected = math.ceil(2048 / (batch * nprocs))
    m = read_metrics(tmp_path / "m.json")
    assert m["steps_per_epoch"] == expected and m["steps"] == 2 * expected
    assert m["world_size"] == nprocs and m["replicas_in_sync"] is True
    assert set(re.findall(r"\[CPU: (\d)\] Epoch: 1 \| Batchsize: %d \| Steps: (\d+)" % batch, r.stdout)) == {
        (str(rank), str(expected)) for rank in range(nprocs)}


# ---------------------------------------------------------------- ddp_gpus_torchrun.py
def test_snapshot_resume_is_exact(launch, script, torchrun, tmp_path, run_sh):
    cmd = [*torchrun, "--standalone", "--nproc-per-node=2", script("ddp_gpus_torchrun.py"), "--device", "cpu",
           "--batch_size", "32", "--snapshot_path", tmp_path / "snap.pt", "--metrics", tmp_path / "m.json"]
    launch(cmd + ["--max_epochs", "2"], timeout=90)
    first = read_metrics(tmp_path / "m.json")
    assert first["epochs"] == 2 and first["resumed_from_epoch"] == 0

    r = launch(cmd + ["--max_epochs", "5"], timeout=90)
    second = read_metrics(tmp_path / "m.json")
    assert second["resumed_from_epoch"] == 2 and second["epochs"] == 5
    assert second["steps"] == 3 * 32, "a resumed run trains only the missing epochs"
    assert "resuming from snapshot" in r.stdout
    # same seed, same data order: the resumed epochs match run.sh's uninterrupted spawn run
    reference = epoch_losses(mode_output(run_sh, "spawn"))
    assert first["losses"] + second["losses"] == pytest.approx(reference, abs=1e-6)  # printed to 6 places

    snap = torch.load(tmp_path / "snap.pt", map_location="cpu", weights_only=True)
    assert snap["epochs_run"] == 5
    model = torch.nn.Linear(20, 1)
    model.load_state_dict(snap["model"])  # no `module.` prefix


def test_torchrun_script_as_plain_python(launch, script, tmp_path):
    launch([sys.executable, script("ddp_gpus_torchrun.py"), "--device", "cpu", "-e", "3",
            "--snapshot_path", tmp_path / "s.pt", "--metrics", tmp_path / "m.json"], timeout=60)
    m = read_metrics(tmp_path / "m.json")
    assert m["world_size"] == 1 and m["steps_per_epoch"] == 64 and m["final_loss"] < m["first_loss"]


def test_clean_exit_ten_launches_in_a_row(script, tmp_path):
    """The exit-time abort of the contract: 10 consecutive 2-rank launches must all exit 0, silently."""
    for i in range(10):
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
@pytest.mark.parametrize("name,args,says", [
    ("ddp_gpus.py", ["--batch_size", "0"], "--batch_size"),
    ("ddp_gpus.py", ["--epochs", "-1"], "--epochs"),
    ("ddp_gpus.py", ["--lr", "0"], "--lr"),
    ("ddp_gpus.py", ["--nprocs", "0"], "--nprocs"),
    ("ddp_gpus.py", ["--device", "cuda"], "no GPU"),
    ("ddp_gpus.py", ["--backend", "nccl"], "nccl"),
    ("ddp_minimal.py", ["--nprocs", "-2"], "--nprocs"),
    ("ddp_gpus_torchrun.py", ["--max_epochs", "0"], "--epochs"),
])
def test_bad_input_one_line_exit_2(launch, script, name, args, says):
    r = launch([sys.executable, script(name), *args], timeout=60, check=False)
    assert r.returncode == 2, str(r)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and says in lines[0], str(r)
    assert "(" in lines[0], "the error names the fix"


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


def _ddp_equivalence_worker(rank, world, port, batch, steps, out):
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
        del model
    finally:
        gc.collect()  # free DDP's reducer before the group (see cleanup() in the scripts)
        dist.destroy_process_group()


def test_ddp_equals_one_process_with_double_batch(tmp_path):
    batch, steps = 4, 6
    out = tmp_path / "ddp.pt"
    mp.spawn(_ddp_equivalence_worker, args=(2, free_port(), batch, steps, str(out)), nprocs=2, join=True)
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


def _replica_check_worker(rank, world, port, perturb, out):
    sys.path.insert(0, str(ROOT))
    from ddp_gpus import replicas_in_sync
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(20, 1)
        if perturb and rank == 1:
            with torch.no_grad():
                model.weight[0, 7] += 1e-6
        result = replicas_in_sync(model, torch.device("cpu"))
        with open(f"{out}.{rank}", "w") as f:
            f.write(str(result))
    finally:
        gc.collect()  # free DDP's reducer before the group (see cleanup() in the scripts)
        dist.destroy_process_group()


@pytest.mark.parametrize("perturb", [False, True])
def test_replica_check_detects_one_differing_weight(tmp_path, perturb):
    out = tmp_path / "result"
    mp.spawn(_replica_check_worker, args=(2, free_port(), perturb, str(out)), nprocs=2, join=True)
    results = {open(f"{out}.{r}").read() for r in (0, 1)}
    assert results == {str(not perturb)}


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
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_run_sh_two_host_modes_pass(launch):
    """The same commands as test_multihost.py's, through run.sh (which removes its namespaces itself)."""
    r = launch(["bash", ROOT / "run.sh", "netns", "netns-elastic"], timeout=300)
    assert "2 passed, 0 failed" in r.stdout and "skip:" not in r.stdout, str(r)


def test_run_sh_unknown_mode_is_an_error(launch):
    r = launch(["bash", ROOT / "run.sh", "no-such-mode"], timeout=60, check=False)
    assert r.returncode == 2 and r.stderr.startswith("error: unknown mode")
