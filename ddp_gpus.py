"""A `Trainer` for a linear model, one process per GPU, launched with `mp.spawn`.

Scenario: `nn.Linear(20, 1)` learns a fixed linear map from 2048 noisy samples.
`DistributedSampler` gives each process its own shard of the data, DDP averages
the gradients, and every process ends with the same parameters (checked at the end).

Launch (the script starts its own processes; do not use torchrun here):
    python ddp_gpus.py --max_epochs 5 --batch_size 32             # one process per visible GPU, NCCL
    CUDA_VISIBLE_DEVICES=0,1 python ddp_gpus.py --max_epochs 5    # pick the GPUs
    python ddp_gpus.py --device cpu --nprocs 2                    # CPU only, gloo

Each process prints the seed's per-epoch line (`[GPU: 0] Epoch: 0 | Batchsize: 32 |
Steps: 32`, `CPU` on CPU); rank 0 adds the loss of the epoch over all processes.
Steps per epoch = ceil(2048 / (batch_size x world_size)).

Over the seed this fixes: a loss that can learn (MSE on targets that depend on the
inputs; the seed's cross-entropy over one output is always zero), `torch.optim.SGD`,
the same data set on every rank, a free port instead of a hard-coded one, a CPU path,
and a final check that the replicas agree. Nearest sibling: ddp_gpus_torchrun.py is
the same trainer launched by torchrun, with an elastic snapshot.
"""

# ---------------------------------------------------------------- imports
import argparse
import gc
import json
import os
import socket
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


# ---------------------------------------------------------------- arguments
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--epochs", "--max_epochs", "-e", type=int, default=5, metavar="N",
                   help="epochs to train")
    p.add_argument("--batch_size", "--batch-size", "-b", type=int, default=32, metavar="N",
                   help="samples per step, per process (the global batch is N x world size)")
    p.add_argument("--lr", type=float, default=0.1, metavar="LR", help="SGD learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed for the data and the initial weights")
    p.add_argument("--samples", type=int, default=2048, metavar="N", help="size of the data set")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto: CUDA when available, else CPU")
    p.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                   help="auto: nccl on CUDA, gloo on CPU")
    p.add_argument("--nprocs", type=int, default=None, metavar="N",
                   help="processes to start (default: the visible GPUs on CUDA, 2 on CPU)")
    p.add_argument("--timeout", type=float, default=300, metavar="SECONDS",
                   help="how long a collective waits for the other ranks before failing")
    p.add_argument("--metrics", default=None, metavar="PATH",
                   help="write a JSON summary of the run here (rank 0)")
    return p.parse_args(argv)


def say(line, file=None):
    """Print one line in one write: lines from concurrent ranks never run into each other.
    (print() writes the text and the newline separately, and with PYTHONUNBUFFERED=1, common
    in containers and batch jobs, each is its own write to the shared stdout.)"""
    file = file or sys.stdout
    file.write(f"{line}\n")
    file.flush()


def fail(what, fix):
    """Bad input: one line on stderr and exit code 2, never a traceback."""
    say(f"error: {what} ({fix})", sys.stderr)
    sys.exit(2)


def check_args(args):
    """Validate everything that can be checked before any process starts."""
    for name in ("epochs", "batch_size", "samples"):
        if getattr(args, name) <= 0:
            fail(f"--{name} must be a positive integer, got {getattr(args, name)}",
                 f"pass --{name} 1 or more")
    if not args.lr > 0:
        fail(f"--lr must be positive, got {args.lr}", "pass e.g. --lr 0.1")
    if not args.timeout > 0:
        fail(f"--timeout must be positive, got {args.timeout}", "pass e.g. --timeout 300")
    gpus = torch.cuda.device_count()
    if args.device == "auto":
        args.device = "cuda" if gpus > 0 else "cpu"
    if args.device == "cuda" and gpus == 0:
        fail("--device cuda but no GPU is visible", "use --device cpu, or check CUDA_VISIBLE_DEVICES")
    if args.backend == "auto":
        args.backend = "nccl" if args.device == "cuda" else "gloo"
    if args.backend == "nccl" and args.device != "cuda":
        fail("the nccl backend needs GPUs", "use --backend gloo on CPU")
    if args.metrics and not os.path.isdir(os.path.dirname(os.path.abspath(args.metrics))):
        fail(f"the folder of {args.metrics} does not exist", "create it first, or pass another path")
    if args.nprocs is None:
        args.nprocs = gpus if args.device == "cuda" else 2
    if args.nprocs <= 0:
        fail(f"--nprocs must be a positive integer, got {args.nprocs}", "pass --nprocs 1 or more")
    if args.device == "cuda" and args.nprocs > gpus:
        fail(f"--nprocs {args.nprocs} but only {gpus} GPU(s) are visible",
             f"pass --nprocs {gpus} or fewer, or --device cpu")
    return args


# ---------------------------------------------------------------- setup / cleanup
def free_port():
    """A port the OS says is free now; nothing is hard-coded, so two jobs can share a host."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_port_free(addr, port):
    """Rank 0 hosts the rendezvous at MASTER_ADDR:MASTER_PORT; a port in use would fail late and obscurely."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr, int(port)))
        except OSError:
            fail(f"MASTER_PORT {port} is already in use on {addr}",
                 "unset MASTER_PORT to let the script pick a free port, or choose another")


def cpu_threads(procs_on_this_machine):
    """Split the cores between the processes: oversubscribed cores halve throughput."""
    if "OMP_NUM_THREADS" in os.environ:
        return int(os.environ["OMP_NUM_THREADS"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // procs_on_this_machine)


def setup(rank, world_size, local_rank, args):
    """Join the process group; returns this process's device."""
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        torch.set_num_threads(cpu_threads(args.nprocs))
        device = torch.device("cpu")
    dist.init_process_group(args.backend, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=args.timeout))
    # a second group, always gloo, only to find a rank that stopped responding: after a
    # timeout the main group's connections are closed, this one can still ask who is missing
    health = dist.new_group(backend="gloo", timeout=timedelta(seconds=args.timeout))
    return device, health


def cleanup():
    """Release DDP, then the process group.

    Destroying the group while a DDP model is still alive can abort the process at
    exit ("terminate called without an active exception"), so the frames of a failed
    run are cleared and the garbage collector frees DDP's reducer first.
    """
    error = sys.exc_info()[1]
    while error is not None:  # the whole chain: a re-raised error keeps the first one's frames
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def explain_timeout(error, health, timeout):
    """A collective timed out: name the rank(s) that did not arrive, via gloo's monitored_barrier."""
    try:
        dist.monitored_barrier(group=health, timeout=timedelta(seconds=min(timeout, 5)), wait_all_ranks=True)
        who = "every rank answered afterwards"
    except RuntimeError as e:
        who = str(e).strip().splitlines()[0]
    return TimeoutError(f"a collective waited longer than --timeout {timeout:g} s ({who})")


def print0(line):
    """Print on global rank 0 only."""
    if dist.get_rank() == 0:
        say(line)


# ---------------------------------------------------------------- data
class MyTrainDataset(Dataset):
    """`size` samples of 20 features whose target is a fixed linear map plus a little noise.

    Built from a seeded generator so every rank holds the same data set: the
    sampler shards indices, and indices only mean the same thing on every rank if
    the data does.
    """

    def __init__(self, size, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.rand(size, 20, generator=g)
        true_w = torch.randn(20, 1, generator=g)
        self.y = self.x @ true_w + 0.5 + 0.01 * torch.randn(size, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return self.x[index], self.y[index]


# ---------------------------------------------------------------- model / trainer
class Trainer:
    def __init__(self, model, train_dataloader, optimizer, device):
        self.device = device
        self.tag = f"{device.type.upper().replace('CUDA', 'GPU')}: {dist.get_rank()}"
        self.train_dataloader = train_dataloader
        self.optimizer = optimizer
        self.model = DDP(model.to(device), device_ids=[device.index] if device.type == "cuda" else None)
        self.steps = 0

    def _run_batch(self, xs, ys):
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(self.model(xs), ys)
        loss.backward()  # DDP all-reduces (averages) the gradients here
        self.optimizer.step()
        self.steps += 1
        return loss.detach()

    def _run_epoch(self, epoch):
        loader = self.train_dataloader
        say(f"[{self.tag}] Epoch: {epoch} | Batchsize: {loader.batch_size} | Steps: {len(loader)}")
        loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        # [sum of per-sample losses, samples] on the device: no host sync per step
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        for xs, ys in loader:
            xs = xs.to(self.device, non_blocking=True)
            ys = ys.to(self.device, non_blocking=True)
            loss = self._run_batch(xs, ys)
            totals[0] += loss.double() * len(xs)
            totals[1] += len(xs)
        dist.all_reduce(totals)
        return (totals[0] / totals[1]).item(), int(totals[1].item())

    def train(self, max_epochs):
        history = []
        for epoch in range(max_epochs):
            start = time.perf_counter()
            loss, samples = self._run_epoch(epoch)
            seconds = time.perf_counter() - start
            history.append({"loss": loss, "samples": samples, "seconds": seconds})
            print0(f"epoch {epoch + 1}/{max_epochs} | loss {loss:.6f} | "
                   f"{samples / seconds:.0f} samples/s | {seconds:.2f} s")
        return history


# ---------------------------------------------------------------- replica check / metrics
def replicas_in_sync(model, device):
    """Gather a fingerprint of the parameters from every rank; True when all are identical."""
    flat = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    weights = torch.sin(torch.arange(flat.numel(), device=flat.device, dtype=torch.float64))
    mine = torch.stack([flat.sum(), flat.abs().sum(), (flat * weights).sum()]).to(device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    differ = [r for r, f in enumerate(every) if not torch.equal(f, every[0])]
    print0(f"replicas: {'in sync' if not differ else 'DIFFER on ranks ' + str(differ)} "
           f"({len(every)} ranks, fingerprint {every[0][2].item():.10e})")
    return not differ


def write_json(path, record):
    """Write atomically: a reader never sees half a file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=2)
    os.replace(tmp, path)


# ---------------------------------------------------------------- main
def train(device, args):
    torch.manual_seed(args.seed)
    dataset = MyTrainDataset(args.samples, seed=args.seed)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                        pin_memory=device.type == "cuda")
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    trainer = Trainer(model, loader, optimizer, device)

    start = time.perf_counter()
    history = trainer.train(args.epochs)
    elapsed = time.perf_counter() - start
    in_sync = replicas_in_sync(trainer.model.module, device)
    samples = sum(h["samples"] for h in history)
    summary = {
        "script": os.path.basename(__file__), "world_size": dist.get_world_size(),
        "backend": dist.get_backend(), "device": device.type, "torch": torch.__version__,
        "epochs": args.epochs, "steps": trainer.steps, "steps_per_epoch": len(loader),
        "batch_size": args.batch_size, "elapsed_s": elapsed, "samples_per_s": samples / elapsed,
        "first_loss": history[0]["loss"], "final_loss": history[-1]["loss"],
        "losses": [h["loss"] for h in history], "replicas_in_sync": in_sync,
        "resumed_from_epoch": 0,
    }
    if dist.get_rank() == 0 and args.metrics:
        write_json(args.metrics, summary)
    print0(f"done: {summary['script']} | {summary['world_size']} x {device.type} ({summary['backend']}) "
           f"| torch {torch.__version__} | {args.epochs} epochs | loss {summary['first_loss']:.4f} -> "
           f"{summary['final_loss']:.4f} | {summary['samples_per_s']:.0f} samples/s | "
           f"replicas {'in sync' if in_sync else 'DIFFER'}")
    return in_sync


def main(rank, args):
    """One process of the job; `mp.spawn` passes the rank first."""
    device, health = setup(rank, args.nprocs, rank, args)
    try:
        in_sync = train(device, args)
    except RuntimeError as error:
        if "timed out" not in str(error).lower():
            raise
        raise explain_timeout(error, health, args.timeout) from error
    finally:
        cleanup()
    if not in_sync:
        sys.exit(1)


def run():
    args = check_args(parse_args())
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" in os.environ:
        check_port_free(os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
    else:
        os.environ["MASTER_PORT"] = str(free_port())
    try:
        context = mp.spawn(main, args=(args,), nprocs=args.nprocs, join=False)
        while not context.join(grace_period=3):  # after a failure, a frozen rank is killed in seconds
            pass
    except mp.ProcessRaisedException as e:
        # the failing rank's traceback, printed once; spawn has already ended the others
        say(f"error: a process failed\n{e}", sys.stderr)
        sys.exit(1)
    except mp.ProcessExitedException as e:
        if e.exit_code == 2:
            sys.exit(2)  # bad input: that process printed its one error line
        say(f"error: process {e.error_index} exited with code {e.exit_code}", sys.stderr)
        sys.exit(e.exit_code if e.exit_code and e.exit_code > 0 else 1)


if __name__ == "__main__":
    run()
