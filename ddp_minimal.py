"""The DDP design note's example: one step, and every rank ends with identical parameters.

Scenario: each process builds `nn.Linear(10, 10)`, wraps it in DDP and runs one
forward/backward/step on a batch of its own with MSE loss and SGD. The losses differ
from rank to rank (different data), but DDP averages the gradients during
`backward()`, so after `optimizer.step()` every rank holds the same parameters.
The script shows both: each rank prints its own loss, then rank 0 prints how much the
parameters moved and whether they are identical everywhere (exit 1 if not).

Launch (the script starts its own processes):
    python ddp_minimal.py                          # one process per visible GPU, NCCL
    python ddp_minimal.py --device cpu --nprocs 2  # CPU only, gloo

This is the smallest file of the collection. Next step: ddp_gpus.py trains for real
(a data set, a DistributedSampler, epochs, a global loss).
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
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


# ---------------------------------------------------------------- arguments
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--batch_size", "--batch-size", "-b", type=int, default=20, metavar="N",
                   help="samples in the one batch, per process")
    p.add_argument("--lr", type=float, default=0.001, metavar="LR", help="SGD learning rate")
    p.add_argument("--seed", type=int, default=0,
                   help="seed for the initial weights; rank r draws its batch from seed + r")
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
    if args.batch_size <= 0:
        fail(f"--batch_size must be a positive integer, got {args.batch_size}", "pass --batch_size 1 or more")
    if not args.lr > 0:
        fail(f"--lr must be positive, got {args.lr}", "pass e.g. --lr 0.001")
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


# ---------------------------------------------------------------- one step
def step(device, args):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    start = time.perf_counter()
    torch.manual_seed(args.seed)  # the same start everywhere (DDP would broadcast rank 0's anyway)
    model = nn.Linear(10, 10).to(device)
    before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=args.lr)

    # each rank its own batch: in real training a DistributedSampler does this
    g = torch.Generator().manual_seed(args.seed + rank)
    inputs = torch.randn(args.batch_size, 10, generator=g).to(device)
    labels = torch.randn(args.batch_size, 10, generator=g).to(device)
    loss = nn.functional.mse_loss(ddp_model(inputs), labels)
    loss.backward()  # DDP all-reduces (averages) the gradients here, overlapped with backward
    optimizer.step()  # local, yet the same update everywhere: the gradients already agree

    own_loss = loss.item()
    say(f"[rank {rank}] loss={own_loss:.6f}")
    moved = (torch.cat([p.detach().reshape(-1) for p in model.parameters()]) - before).abs().max()
    totals = torch.tensor([own_loss], dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    print0(f"mean loss over {world_size} ranks {totals[0].item() / world_size:.6f} | "
           f"largest parameter change {moved.item():.3e}")
    elapsed = time.perf_counter() - start
    in_sync = replicas_in_sync(model, device)
    changed = bool((moved > 0).item())
    summary = {
        "script": os.path.basename(__file__), "world_size": world_size, "backend": dist.get_backend(),
        "device": device.type, "torch": torch.__version__, "epochs": 1, "steps": 1, "steps_per_epoch": 1,
        "elapsed_s": elapsed, "samples_per_s": world_size * args.batch_size / elapsed, "first_loss": totals[0].item() / world_size,
        "final_loss": totals[0].item() / world_size, "rank0_loss": None, "replicas_in_sync": in_sync,
        "parameters_changed": changed, "resumed_from_epoch": 0,
    }
    if rank == 0:
        summary["rank0_loss"] = own_loss
        if args.metrics:
            write_json(args.metrics, summary)
    print0(f"done: {summary['script']} | {world_size} x {device.type} ({summary['backend']}) | "
           f"torch {torch.__version__} | one step | parameters {'changed' if changed else 'DID NOT CHANGE'} "
           f"| replicas {'in sync' if in_sync else 'DIFFER'}")
    return in_sync and changed


def main(rank, args):
    """One process of the job; `mp.spawn` passes the rank first."""
    device, health = setup(rank, args.nprocs, rank, args)
    try:
        ok = step(device, args)
    except RuntimeError as error:
        if "timed out" not in str(error).lower():
            raise
        raise explain_timeout(error, health, args.timeout) from error
    finally:
        cleanup()
    if not ok:
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
