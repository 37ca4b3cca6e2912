"""docs/porting.md's section "Two models, two optimizers: a GAN", followed as a user follows it: the template
copied, the section's blocks put into the copy by the guide's rule (test_porting.port), launched by torchrun at
2 processes on CPU with gloo. The port must learn (its generator's points come near the target's mean and
covariance), keep both models' replicas equal (buffers too: the evaluation's figures are those of rank 0's
statistics), draw other latent noise on every rank, and hold both models and both optimizers in one checkpoint
that load_checkpoint checks and loads. The default tier launches once; the slow tier resumes exactly (2 epochs +
resumed to 5 against the default tier's uninterrupted 5), launches the shared-seed pitfall, and shows that a forward
through a DDP wrapper on rank 0 alone is a collective (the section's claim)."""
import importlib.util
import re

import pytest
import torch

from conftest import ROOT, cpu_env, run_bounded, torchrun_cmd
from test_porting import blocks, port, read

HEADING = "### Two models, two optimizers: a GAN"
EPOCHS, STEPS_PER_EPOCH = 5, 64  # the section's defaults: 8,192 samples in steps of 64 x 2
SIZES = ("--epochs", str(EPOCHS))
TARGET_MEAN, TARGET_COVARIANCE = torch.tensor([2.0, -1.0]), torch.tensor([[1.0, 0.6], [0.6, 0.5]])
pytestmark = pytest.mark.xdist_group("port_gan")  # one test process: the shared launch runs once


def write_gan(folder, *extra):
    mine = folder / "mine.py"
    mine.write_text(port((ROOT / "ddp_template.py").read_text(), *blocks(HEADING), *extra))
    return mine


def launch(mine, *args, timeout=240):
    return run_bounded([*torchrun_cmd(), "--standalone", "--nproc-per-node=2", mine, "--device", "cpu", *SIZES, *args],
                       mine.parent, timeout=timeout)


def fingerprint(out):
    return re.search(r"^replicas: in sync \(2 ranks, fingerprint (\S+)\)", out, re.MULTILINE).group(1)


@pytest.fixture(scope="module")
def gan(tmp_path_factory):
    """The default tier's one launch: the port at its defaults, 5 epochs at 2 processes."""
    work = tmp_path_factory.mktemp("gan")
    mine = write_gan(work)
    return mine, launch(mine, "--metrics", "whole.json")


def imported(mine):
    """The port as a module (importing starts nothing), for its build() and the harness's load_checkpoint."""
    spec = importlib.util.spec_from_file_location(f"port_{abs(hash(str(mine)))}", mine)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gan_port_learns_and_both_replicas_agree(gan):
    mine, r = gan
    m = read(mine.parent / "whole.json")
    assert m["script"] == "mine.py" and m["world_size"] == 2 and m["backend"] == "gloo", m
    assert (m["epochs"], m["steps"], m["steps_per_epoch"]) == (EPOCHS, EPOCHS * STEPS_PER_EPOCH, STEPS_PER_EPOCH), m
    assert m["val_samples"] == 4000 and len(m["val_losses"]) == EPOCHS and m["best_val_loss"] == min(m["val_losses"])
    # an untrained generator is about 5 away (its points near 0, the target's mean at (2, -1)); learned: near 0
    first, last = m["val_losses"][0], m["val_losses"][-1]
    assert last < 0.1 and first > 5 * last, m["val_losses"]
    assert m["replicas_in_sync"] is True and fingerprint(r.stdout), r
    assert r.stdout.strip().splitlines()[-1].startswith("done: mine.py | 2 processes on cpu (gloo)"), r
    assert re.search(rf"^epoch {EPOCHS}/{EPOCHS} \| d_loss \S+ \| g_loss \S+ \| val_loss ", r.stdout, re.MULTILINE), r
    assert "Traceback" not in r.stderr, r


def test_gan_evaluation_used_rank_0s_statistics_on_both_ranks(gan):
    """Each rank evaluated its half of the fixed draws with its own BatchNorm statistics; the checkpoint holds
    rank 0's. The saved generator, evaluated here on every draw, gives the run's figures only if rank 1's
    statistics were rank 0's too (same_buffers). The discriminator's buffers: replicas_in_sync compares them."""
    mine, _ = gan
    m, state = read(mine.parent / "whole.json"), torch.load(mine.parent / "mine.pt", weights_only=True)
    port = imported(mine)
    args = port.parse_args(["--device", "cpu", *SIZES])
    models, *_ = port.build(args, torch.device("cpu"))
    generator = models["generator"]
    generator.load_state_dict(state["generator"])
    draws = torch.randn(args.val_samples, args.latent, generator=torch.Generator().manual_seed(args.seed + 1))
    with torch.no_grad():
        points = generator.eval()(draws).double()
    mean, covariance = points.mean(0), torch.cov(points.T, correction=0)
    mean_error = (mean - TARGET_MEAN.double()).square().sum().item()
    cov_error = (covariance - TARGET_COVARIANCE.double()).square().sum().item()
    # the same statistics, other batches and sums: under 1e-9 apart; rank 1's own (no same_buffers): 1.6e-3 apart
    assert mean_error == pytest.approx(m["val_mean_error"], rel=1e-5, abs=1e-6), m
    assert cov_error == pytest.approx(m["val_cov_error"], rel=1e-5, abs=1e-6), m


def test_gan_noise_differs_across_ranks(gan):
    _, r = gan
    assert "latent noise: 128 of 128 vectors of a global batch distinct" in r.stdout, r


def test_gan_checkpoint_holds_both_models_and_optimizers(gan, capsys):
    mine, _ = gan
    state = torch.load(mine.parent / "mine.pt", weights_only=True)
    steps = EPOCHS * STEPS_PER_EPOCH
    assert {"generator", "discriminator", "opt_g", "opt_d", "sched_g", "sched_d", "scaler", "epoch",
            "progress", "job", "world_size"} <= set(state), sorted(state)
    assert (state["epoch"], state["progress"]["step"], state["world_size"]) == (EPOCHS, steps, 2)
    for name in ("generator", "discriminator"):  # the modules' own names: no DDP "module." prefix
        assert {"1.running_mean", "1.running_var", "1.num_batches_tracked"} <= set(state[name]), sorted(state[name])
        assert not any(key.startswith("module.") for key in state[name])
        # every forward in train mode counts a batch: G once a step, D twice (its step, and G's through it)
        assert state[name]["1.num_batches_tracked"].item() == steps * (1 if name == "generator" else 2)
    for name in ("opt_g", "opt_d"):
        assert all(s["step"].item() == steps for s in state[name]["state"].values()), name
    assert state["sched_g"]["last_epoch"] == state["sched_d"]["last_epoch"] == steps
    # load_checkpoint, as resume() calls it, into freshly built models and optimizers: each entry checked, all loaded
    port = imported(mine)
    args = port.parse_args(["--device", "cpu", *SIZES])
    models, optimizers, schedulers, _ = port.build(args, torch.device("cpu"))
    keys = (*models, *optimizers, *schedulers, "scaler", "epoch", "progress")
    try:
        port.load_checkpoint(str(mine.parent / "mine.pt"), keys, models, optimizers)
    except SystemExit:
        raise AssertionError(capsys.readouterr().err)
    for name, module in models.items():
        assert all(torch.equal(v, state[name][k]) for k, v in module.state_dict().items()), name
    for name, optimizer in optimizers.items():
        assert optimizer.state_dict()["state"].keys() == state[name]["state"].keys(), name
        assert all(torch.equal(s["exp_avg"], state[name]["state"][i]["exp_avg"])
                   for i, s in optimizer.state_dict()["state"].items()), name


@pytest.mark.slow  # two more launches
def test_gan_resumes_exactly(gan, tmp_path):
    """Stopped after epoch 2 and resumed to 5: the uninterrupted run's losses, figures and weights, bit for bit
    (the sampler, the per-rank noise, both schedules and both optimizers continue where they were)."""
    whole_mine, whole = gan
    mine = write_gan(tmp_path)
    launch(mine, "--epochs", "2", "--metrics", "first.json")
    resumed = run_bounded([*torchrun_cmd(), "--standalone", "--nproc-per-node=2", mine, "--device", "cpu", *SIZES,
                           "--resume", "--metrics", "resumed.json"], tmp_path, timeout=240)
    r, w = read(tmp_path / "resumed.json"), read(whole_mine.parent / "whole.json")
    assert r["resumed_from_epoch"] == 2 and r["steps"] == (EPOCHS - 2) * STEPS_PER_EPOCH, r
    assert f"epochs 2 -> {EPOCHS}" in resumed.stdout, resumed
    assert r["losses"] == w["losses"] and r["val_losses"] == w["val_losses"], (r, w)
    assert fingerprint(resumed.stdout) == fingerprint(whole.stdout), (resumed, whole)


@pytest.mark.slow  # one more launch
def test_a_seed_shared_by_the_ranks_repeats_the_noise(tmp_path):
    """The pitfall the section warns of: seeded alike (as a one-process script seeds), both ranks draw the same
    latent vectors: half the global batch is a copy."""
    shared = '''def seed_this_rank(seed, epoch):
    torch.manual_seed(hash((seed, epoch)) % 2 ** 63)
    random.seed(seed)
'''
    mine = write_gan(tmp_path, shared)
    r = launch(mine, "--epochs", "1")
    assert "latent noise: 64 of 128 vectors of a global batch distinct" in r.stdout, r


RANK_0_ALONE = '''"""A BatchNorm model under DDP, one training step, then a forward on rank 0 alone (saving
samples), then a collective every rank calls."""
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo", timeout=timedelta(seconds=10))
torch.manual_seed(0)
ddp = DDP(nn.Sequential(nn.Linear(2, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)))
x = torch.randn(16, 2)
if sys.argv[1] == "after-no-sync":  # the last training forward ran under no_sync: no broadcast armed
    with ddp.no_sync():
        ddp(x).sum().backward()
else:
    ddp(x).sum().backward()
if dist.get_rank() == 0:
    with torch.no_grad():
        (ddp.module if sys.argv[1] == "module" else ddp).eval()(x[:4])
dist.all_reduce(torch.ones(3))
dist.barrier()
print(f"rank {dist.get_rank()} finished", flush=True)
del ddp
dist.destroy_process_group()
'''


@pytest.mark.slow  # three launches
@pytest.mark.parametrize("through", ["wrapper", "module", "after-no-sync"])
def test_a_forward_through_the_wrapper_on_rank_0_alone_is_a_collective(tmp_path, through):
    """The section's claim: after a training step, a forward through the wrapper broadcasts the buffers (under
    no_grad, in eval mode too), so on rank 0 alone it meets the other ranks' next collective and the job dies
    (or waits out the timeout); through .module it runs alone; after a no_sync forward there is no broadcast."""
    script = tmp_path / "alone.py"
    script.write_text(RANK_0_ALONE)
    r = run_bounded([*torchrun_cmd(), "--standalone", "--nproc-per-node=2", script, through], tmp_path, timeout=120,
                    env=cpu_env(), check=False)
    if through == "wrapper":
        assert r.returncode != 0 and "rank 0 finished" not in r.stdout, r
    else:
        assert r.returncode == 0 and "rank 0 finished" in r.stdout and "rank 1 finished" in r.stdout, r
