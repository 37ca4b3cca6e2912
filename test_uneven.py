"""ddp_uneven.py: ranks with different numbers of batches, on 2 CPU processes with gloo.

Launched through torchrun as users launch it, every run bounded by a timeout. What is
asserted: with Join every sample is trained on once per epoch (counted) and the training is
the one the script claims (the same losses as a one-process computation of that rule);
without Join the job ends in one error line soon after --timeout; Join without the gradient
hand-over drifts; ZeRO keeps about half of Adam's state per rank, trains bit for bit the
same, and its checkpoint loads with weights_only and resumes exactly.
"""
import gc
import re
import shutil
import subprocess
import sys
import threading
import time
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.elastic.utils.distributed import get_free_port
from torch.utils.data import SubsetRandomSampler

import ddp_uneven
from conftest import ROOT, cpu_env, kill_group, read_metrics, run_bounded, torchrun_cmd

SCRIPT = ROOT / "ddp_uneven.py"
TORCHRUN_2 = [*torchrun_cmd(), "--standalone", "--nproc-per-node=2"]
# the defaults at 2 ranks: 2048 samples cut 2 : 1 (imbalance 0.5), 32 per batch
SHARDS, BATCHES, DATASET = [1365, 683], [43, 22], 2048
with warnings.catch_warnings():  # an unknown mark when run with -p no:xdist, and then not needed
    warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)
    shared = pytest.mark.xdist_group("uneven")  # the tests that read the same runs stay in one process


def uneven(work, name, *args):
    """ddp_uneven.py on 2 CPU processes; its output and its metrics."""
    result = run_bounded([*TORCHRUN_2, SCRIPT, "--device", "cpu", "--metrics", work / f"{name}.json", *args],
                         work, timeout=240)
    return result, read_metrics(work / f"{name}.json")


def fingerprint(result):
    return re.search(r"fingerprint (\S+)\)", result.stdout).group(1)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("uneven")


@pytest.fixture(scope="module")
def plain(work):
    """The default run (Join with the hand-over, plain Adam), 2 epochs."""
    return uneven(work, "plain", "-e", "2")


@pytest.fixture(scope="module")
def zero(work):
    """--zero for 1 epoch with a checkpoint (kept as zero1.pt), then resumed to 2 epochs."""
    first = uneven(work, "zero1", "--zero", "-e", "1", "--checkpoint", work / "zero.pt")
    shutil.copy(work / "zero.pt", work / "zero1.pt")
    resumed = uneven(work, "zero2", "--zero", "-e", "2", "--checkpoint", work / "zero.pt", "--resume")
    return first, resumed


def reference_losses(epochs, world=2, batch=32, samples=DATASET, imbalance=0.5, lr=1e-3, seed=0):
    """The training the script claims, in one process: step i takes every rank's i-th batch of
    its shard (none from a rank that ran out), the loss sum / (world size x batch size), one
    Adam step. Returns the mean loss per epoch. `world`: a size, or one per epoch (a resume at
    another world size)."""
    torch.manual_seed(seed)
    model = ddp_uneven.make_model(256)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    x, y = ddp_uneven.make_dataset(samples, seed).tensors
    worlds = [world] * epochs if isinstance(world, int) else world
    losses = []
    for epoch, world in enumerate(worlds):
        bounds = ddp_uneven.shard_bounds(samples, world, imbalance)
        # each rank's shard in the epoch's order, as the script draws it (not its code: torch's sampler)
        orders = [torch.Generator().manual_seed(seed + epoch) for _ in range(world)]
        shards = [SubsetRandomSampler(range(bounds[r], bounds[r + 1]), generator=orders[r]) for r in range(world)]
        batches = [[order[i:i + batch] for i in range(0, len(order), batch)] for order in map(list, shards)]
        total = count = 0
        for step in range(max(map(len, batches))):
            optimizer.zero_grad()
            sums = [F.cross_entropy(model(x[b[step]]), y[b[step]], reduction="sum") for b in batches if step < len(b)]
            (sum(sums) / (world * batch)).backward()
            optimizer.step()
            total += sum(s.item() for s in sums)
            count += sum(len(b[step]) for b in batches if step < len(b))
        losses.append(total / count)
    return losses


# ---------------------------------------------------------------- Join
@shared
def test_join_trains_every_sample_once_and_replicas_agree(plain):
    result, m = plain
    assert m["batches_per_rank"] == BATCHES and m["samples_per_rank"] == SHARDS, m
    assert m["samples_trained"] == [DATASET] * 2 and m["dataset_size"] == DATASET and m["every_sample_once"]
    assert m["replicas_in_sync"] is True and m["join"] == "handover" and m["steps_per_epoch"] == max(BATCHES)
    assert m["final_loss"] < m["first_loss"] - 0.5, m["losses"]  # it learns
    assert "rank 0 1365 samples in 43 batches, rank 1 683 samples in 22 batches" in result.stdout
    assert len(re.findall(r"samples 1365 \+ 683 = 2048 of 2048", result.stdout)) == 2, result.stdout
    assert result.stdout.strip().splitlines()[-1].startswith("done:")


@shared
def test_join_trains_as_the_one_process_rule(plain):
    """Every sample once, each with the same weight, on ranks that have joined too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the launches of other tests may run beside this one
    try:
        expected = reference_losses(epochs=2)
    finally:
        torch.set_num_threads(threads)
    assert plain[1]["losses"] == pytest.approx(expected, rel=1e-5), (plain[1]["losses"], expected)


@pytest.mark.slow  # one more launch; the default suite keeps the Join, ZeRO and --no-join cases
@shared
def test_join_without_the_hand_over_drifts(plain, work):
    """The tutorial's Join([model, ZeRO]): a joined rank steps its shard with its own stale gradient."""
    result, m = uneven(work, "bare", "--bare-join", "--zero", "-e", "1")
    assert m["replicas_in_sync"] is True and m["samples_trained"] == [DATASET]  # Join still ends the epoch
    assert abs(m["losses"][0] - plain[1]["losses"][0]) > 0.01, (m["losses"], plain[1]["losses"])


def test_no_join_ends_with_one_error_line_soon_after_timeout(tmp_path):
    timeout = 5
    cmd = [*TORCHRUN_2, SCRIPT, "--device", "cpu", "--no-join", "--timeout", str(timeout)]
    with open(tmp_path / "stderr", "w+") as err:
        proc = subprocess.Popen([str(c) for c in cmd], cwd=tmp_path, env=cpu_env(), text=True, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=err, start_new_session=True)
        bound = threading.Timer(240, kill_group, (proc,))  # the readline below must not wait forever
        bound.start()
        try:
            started, stdout = None, ""
            for line in proc.stdout:  # the shards line comes less than an epoch before the wait
                started = started or (time.monotonic() if line.startswith("uneven shards") else None)
                stdout += line
            code, ended = proc.wait(), time.monotonic()
        finally:
            bound.cancel()
            kill_group(proc)
        err.seek(0)
        stderr = err.read()
    report = f"exit {code}\n--- stdout\n{stdout}\n--- stderr\n{stderr[-3000:]}"
    assert code != 0 and started is not None, report
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, report
    assert all(words in errors[0] for words in (f"--timeout {timeout} s", "batch 23", "rank 1", "--no-join")), report
    assert not re.search(r"^\[rank\d\]:.*Traceback", stderr, flags=re.MULTILINE), "no traceback per rank\n" + report
    print(f"--no-join --timeout {timeout}: the job ended {ended - started:.1f} s after the shards line")
    assert timeout <= ended - started <= timeout + 30, report


def test_hand_over_leaves_the_model_collectable(monkeypatch):
    """DDP's reducer holds the comm hook's state: if that held the model, the model would outlive
    destroy_process_group, which can abort the process at exit (CONTRACT.md)."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(get_free_port()))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    try:
        args = ddp_uneven.resolve_device(ddp_uneven.parse_args(["--device", "cpu", "--width", "8"]))
        model, optimizer, _ = ddp_uneven.build(torch.device("cpu"), None, args)  # no --resume: no loader needed
        ddp_uneven.HandOver(model, optimizer)
        model = weakref.ref(model)
        del optimizer
        gc.collect()
        assert model() is None, gc.get_referrers(model())
    finally:
        torch.distributed.destroy_process_group()


# ---------------------------------------------------------------- ZeRO
@shared
def test_zero_holds_about_half_the_state_per_rank_and_trains_identically(plain, zero):
    (first, zm), (_, plain_m) = zero[0], plain
    full, shards = plain_m["optimizer_state_bytes_per_rank"], zm["optimizer_state_bytes_per_rank"]
    assert full[0] == full[1] > 2_000_000 and sum(shards) == full[0], (full, shards)  # each state on one rank
    assert all(0.4 < s / full[0] < 0.6 for s in shards), (full, shards)
    assert zm["zero"] is True and zm["losses"] == plain_m["losses"][:1], (zm["losses"], plain_m["losses"])
    assert zm["samples_trained"] == [DATASET] and zm["replicas_in_sync"] is True


@shared
def test_zero_checkpoint_loads_weights_only_and_resumes_exactly(plain, zero, work):
    state = torch.load(work / "zero1.pt", map_location="cpu", weights_only=True)
    assert state["epoch"] == 1 and not any(k.startswith("module.") for k in state["model"])
    # consolidated: the state of every parameter, whichever rank kept it
    assert sorted(state["optimizer"]["state"]) == list(range(len(state["model"]))), sorted(state["optimizer"]["state"])
    resumed, m = zero[1]
    assert m["resumed_from_epoch"] == 1 and m["epochs"] == 2 and m["samples_trained"] == [DATASET]
    # bit for bit the uninterrupted run without ZeRO: the same training, and an exact resume
    assert m["losses"] == plain[1]["losses"][1:] and fingerprint(resumed) == fingerprint(plain[0]), (m, resumed)


@shared
def test_zero_checkpoint_resumes_at_another_world_size(zero, work):
    """The consolidated state of 2 ranks, resumed by plain python (a world of one): ZeRO takes all of
    it, the data is cut into one shard, and the epoch trains as the one-process rule at world 1 says."""
    shutil.copy(work / "zero1.pt", work / "zero_w1.pt")
    result = run_bounded([sys.executable, SCRIPT, "--device", "cpu", "--zero", "-e", "2", "--resume", "--checkpoint",
                          work / "zero_w1.pt", "--metrics", work / "zero_w1.json"], work, timeout=120)
    m = read_metrics(work / "zero_w1.json")
    assert (m["world_size"], m["resumed_from_epoch"], m["epochs"]) == (1, 1, 2), m
    assert m["samples_trained"] == [DATASET] and m["samples_per_rank"] == [DATASET], m
    assert ("note: resuming at world size 1 a checkpoint written at 2: an epoch is now 64 steps of 32 samples x "
            "1 process" in result.stdout), result.stdout
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = reference_losses(epochs=2, world=[2, 1])
    finally:
        torch.set_num_threads(threads)
    assert m["losses"] == pytest.approx(expected[1:], rel=1e-5), (m["losses"], expected)
    assert m["losses"][0] < zero[0][1]["losses"][0], m  # it went on from epoch 1, not from scratch
    assert torch.load(work / "zero_w1.pt", weights_only=True)["world_size"] == 1


# ---------------------------------------------------------------- bad input
def test_bad_input_one_line_exit_2(launch):
    r = launch([sys.executable, SCRIPT, "--imbalance", "1"], timeout=60, check=False)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: --imbalance") and "(" in lines[0], str(r)
