"""DataParallel, the single-process baseline, next to the DDP that replaces it.

Scenario: the seed's `SimpleModel` (an MLP 128 -> 256 -> 256 -> 10) learns, with
cross-entropy and Adam, a 10-class data set whose labels come from a fixed random
"teacher" network, so there is something to learn and the same data on every process.
By default one process trains it with `nn.DataParallel` over every visible GPU (with
one GPU or none it trains the plain module: DataParallel needs two or more GPUs).
`--compare` trains the same model on the same data with the same global batch twice,
first in one process (DataParallel, or plain), then with DDP (one process per GPU, or
2 gloo processes on CPU, each taking global batch / processes), and prints the two side
by side: samples/s, final loss, accuracy, peak memory per process. Both runs see the
same global batches in the same order (the single process uses the DistributedSampler
shuffle of a one-process world), so their losses agree up to float rounding: the
migration changes how fast, not what is learned.

Launch (the script starts its own DDP processes; do not use torchrun here):
    python dp_baseline.py                          # DataParallel over all visible GPUs
    python dp_baseline.py --compare                # DataParallel, then DDP, side by side
    python dp_baseline.py --ddp --nprocs 2         # the DDP half alone (one process per GPU)
    python dp_baseline.py --device cpu --compare   # CPU only: plain module, then 2 gloo processes

Why DDP wins on GPUs: DataParallel runs one Python process that, every step, copies
the weights to each GPU, scatters the batch, gathers the outputs on GPU 0 and reduces
the gradients there (the GIL, and memory piled on GPU 0); DDP runs one process per GPU
and overlaps a ring all-reduce of the gradients with the backward pass.
Nearest sibling: ddp_gpus.py (mp.spawn, DDP only, a linear model); this file adds the
DataParallel baseline and the comparison.
"""

# ---------------------------------------------------------------- imports
import argparse
import gc
import json
import os
import resource
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DistributedSampler, TensorDataset


# ---------------------------------------------------------------- arguments
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--epochs", "--max_epochs", "-e", type=int, default=5, metavar="N",
                   help="epochs to train")
    p.add_argument("--batch_size", "--batch-size", "-b", type=int, default=256, metavar="N",
                   help="GLOBAL batch: samples per optimizer step over all devices. DataParallel "
                        "splits it over the GPUs; DDP gives each process N / processes")
    p.add_argument("--lr", type=float, default=1e-3, metavar="LR", help="Adam learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed for the data, the teacher and the initial weights")
    p.add_argument("--samples", type=int, default=8192, metavar="N",
                   help="training samples (a quarter as many again are held out for the test accuracy)")
    p.add_argument("--compare", action="store_true",
                   help="train in one process (DataParallel or plain), then with DDP, and compare")
    p.add_argument("--ddp", action="store_true", help="train with DDP only (the migration target alone)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto: CUDA when available, else CPU")
    p.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                   help="auto: nccl on CUDA, gloo on CPU (DDP only)")
    p.add_argument("--nprocs", type=int, default=None, metavar="N",
                   help="DDP processes to start with --ddp/--compare (default: the visible GPUs on CUDA, 2 on CPU)")
    p.add_argument("--timeout", type=float, default=300, metavar="SECONDS",
                   help="how long a collective waits for the other ranks before failing")
    p.add_argument("--metrics", default=None, metavar="PATH",
                   help="write a JSON summary of the run here (with --compare: of the DDP run, "
                        "both runs under 'compare')")
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
        fail(f"--lr must be positive, got {args.lr}", "pass e.g. --lr 0.001")
    if not args.timeout > 0:
        fail(f"--timeout must be positive, got {args.timeout}", "pass e.g. --timeout 300")
    if args.compare and args.ddp:
        fail("--compare and --ddp exclude each other", "--compare already includes the DDP run")
    gpus = torch.cuda.device_count()
    if args.device == "auto":
        args.device = "cuda" if gpus > 0 else "cpu"
    if args.device == "cuda" and gpus == 0:
        fail("--device cuda but no GPU is visible", "use --device cpu, or check CUDA_VISIBLE_DEVICES")
    if args.backend == "auto":
        args.backend = "nccl" if args.device == "cuda" else "gloo"
    if args.backend == "nccl" and args.device != "cuda":
        fail("the nccl backend needs GPUs", "use --backend gloo on CPU")
    if not (args.compare or args.ddp):
        if args.nprocs is not None:
            fail("--nprocs only applies to the DDP run", "add --ddp or --compare, or drop --nprocs")
        return args
    if args.nprocs is None:
        args.nprocs = gpus if args.device == "cuda" else 2
    if args.nprocs <= 0:
        fail(f"--nprocs must be a positive integer, got {args.nprocs}", "pass --nprocs 1 or more")
    if args.device == "cuda" and args.nprocs > gpus:
        fail(f"--nprocs {args.nprocs} but only {gpus} GPU(s) are visible",
             f"pass --nprocs {gpus} or fewer, or --device cpu")
    if args.batch_size % args.nprocs:
        fail(f"the global --batch_size {args.batch_size} does not split evenly over {args.nprocs} processes",
             f"pass a multiple of {args.nprocs}")
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
    """Print on global rank 0 only (the DataParallel run has no process group: it is rank 0)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        say(line)


# ---------------------------------------------------------------- data
def make_data(samples, seed, device):
    """Train and test sets: Gaussian inputs labelled by a fixed random teacher MLP.

    Everything comes from one seeded CPU generator, so every process builds the same
    tensors (the sampler shards indices, which only mean the same thing on every rank
    if the data does), and the labels are a function of the inputs that the student
    can learn, unlike random labels.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples + samples // 4, 128, generator=g)
    w1 = torch.randn(128, 64, generator=g) / 128 ** 0.5
    w2 = torch.randn(64, 10, generator=g) / 64 ** 0.5
    y = (torch.tanh(x @ w1) @ w2).argmax(dim=1)
    x, y = x.to(device), y.to(device)
    return TensorDataset(x[:samples], y[:samples]), TensorDataset(x[samples:], y[samples:])


def chance_accuracy(dataset):
    """Accuracy of always answering the most common class: the bar 'learned something' must clear."""
    labels = dataset.tensors[1]
    return torch.bincount(labels, minlength=10).max().item() / len(labels)


# ---------------------------------------------------------------- model
class SimpleModel(nn.Module):
    """The seed's MLP: 128 features -> 256 -> 256 -> 10 class scores."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(128, 256), nn.ReLU(),
            nn.Linear(256, 256), nn.ReLU(),
            nn.Linear(256, 10),
        )

    def forward(self, x):
        return self.net(x)


# ---------------------------------------------------------------- train / evaluate
def all_reduce_if_distributed(totals):
    """Sum `[sum, count]` totals over the ranks; a single process already holds them all."""
    if dist.is_initialized():
        dist.all_reduce(totals)
    return totals


def train_epoch(model, train_set, batches, optimizer):
    """One pass over this process's batches; returns global (mean loss, accuracy, samples)."""
    model.train()
    x, y = train_set.tensors
    # [sum of per-sample losses, correct, samples]; the first two stay on the device: no host sync per step
    totals = torch.zeros(3, dtype=torch.float64, device=x.device)
    for idx in batches:
        xs, ys = x[idx], y[idx]
        optimizer.zero_grad(set_to_none=True)
        out = model(xs)
        loss = F.cross_entropy(out, ys)
        loss.backward()  # DataParallel reduces the gradients onto GPU 0; DDP all-reduces them
        optimizer.step()
        totals[0] += loss.detach().double() * len(ys)
        totals[1] += (out.argmax(dim=1) == ys).sum()
        totals[2] += len(ys)
    loss_sum, correct, samples = all_reduce_if_distributed(totals).tolist()
    return loss_sum / samples, correct / samples, int(samples)


@torch.no_grad()
def evaluate(model, test_set):
    """Exact accuracy on the held-out set: each rank scores every world_size-th sample, no padding."""
    model.eval()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    x, y = (t[rank::world] for t in test_set.tensors)
    correct = (model(x).argmax(dim=1) == y).sum().double()
    totals = torch.stack([correct, torch.tensor(float(len(y)), dtype=torch.float64, device=x.device)])
    correct, count = all_reduce_if_distributed(totals).tolist()
    return correct / count


def peak_memory_mb(devices):
    """Peak memory of this process: the CUDA allocator's peak on GPUs, peak RSS on CPU."""
    if devices[0].type == "cuda":
        return max(torch.cuda.max_memory_allocated(d) for d in devices) / 2 ** 20, "cuda max_memory_allocated"
    # Linux carries ru_maxrss across exec, so a spawned rank would report its parent's
    # peak; VmHWM is the peak of this process's own address space
    try:
        with open("/proc/self/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        return kib / 2 ** 10, "peak RSS"
    except (OSError, StopIteration):
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        return maxrss / (2 ** 20 if sys.platform == "darwin" else 2 ** 10), "peak RSS (getrusage)"


def fit(model, wrapped, device, per_process_batch, args):
    """Train `wrapped` (plain, DataParallel or DDP) for args.epochs; returns the run's record.

    A DistributedSampler orders the data in both modes: with one replica it is a plain
    shuffle; with N ranks rank r takes every N-th index of the same shuffle, so the N
    per-process batches of step k together are exactly the single process's batch k.
    """
    train_set, test_set = make_data(args.samples, args.seed, device)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    batches = BatchSampler(sampler, per_process_batch, drop_last=False)
    optimizer = torch.optim.Adam(wrapped.parameters(), lr=args.lr)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    print0(f"data: {len(train_set)} train / {len(test_set)} test samples, 10 classes from a fixed "
           f"random teacher; chance (most common class) {chance_accuracy(train_set):.3f}")
    history = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        start = time.perf_counter()
        loss, acc, samples = train_epoch(wrapped, train_set, batches, optimizer)
        seconds = time.perf_counter() - start
        history.append({"loss": loss, "accuracy": acc, "samples": samples, "seconds": seconds})
        print0(f"epoch {epoch + 1}/{args.epochs} | loss {loss:.4f} | acc {acc:.3f} | "
               f"{samples / seconds:.0f} samples/s | {seconds:.2f} s")
    return {"history": history, "test_accuracy": evaluate(model, test_set),
            "chance_accuracy": chance_accuracy(train_set), "steps": args.epochs * len(batches),
            "steps_per_epoch": len(batches)}


def summarize(run, mode, dp_devices, device, threads, memory, in_sync, args):
    """The contract's metrics record for one run (plus this script's keys)."""
    history = run["history"]
    elapsed = sum(h["seconds"] for h in history)
    steady = history[1:] or history  # the first epoch pays for warm-up (allocator, threads, buckets)
    world = dist.get_world_size() if dist.is_initialized() else 1
    return {
        "script": os.path.basename(__file__), "mode": mode, "dp_devices": dp_devices,
        "world_size": world, "backend": dist.get_backend() if dist.is_initialized() else None,
        "device": device.type, "torch": torch.__version__, "threads_per_process": threads,
        "epochs": args.epochs, "steps": run["steps"], "steps_per_epoch": run["steps_per_epoch"],
        "batch_size": args.batch_size, "batch_size_per_process": args.batch_size // world,
        "elapsed_s": elapsed, "samples_per_s": sum(h["samples"] for h in history) / elapsed,
        "steady_samples_per_s": sum(h["samples"] for h in steady) / sum(h["seconds"] for h in steady),
        "epoch_samples_per_s": [h["samples"] / h["seconds"] for h in history],
        "first_loss": history[0]["loss"], "final_loss": history[-1]["loss"],
        "losses": [h["loss"] for h in history], "accuracy": history[-1]["accuracy"],
        "test_accuracy": run["test_accuracy"], "chance_accuracy": run["chance_accuracy"],
        "peak_memory_mb": memory[0], "peak_memory_kind": memory[1],
        "replicas_in_sync": in_sync, "resumed_from_epoch": 0,
    }


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


# ---------------------------------------------------------------- the single-process run
def run_single(args):
    """DataParallel over every visible GPU when there are two or more, else the plain module."""
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    threads = None
    if device.type == "cpu":
        threads = cpu_threads(1)
        torch.set_num_threads(threads)
    torch.manual_seed(args.seed)  # the same initial weights as the DDP run
    model = SimpleModel().to(device)
    if gpus >= 2:
        wrapped, mode, devices = nn.DataParallel(model), "dp", [torch.device("cuda", i) for i in range(gpus)]
        print0(f"run: dp | nn.DataParallel over {gpus} GPUs in one process | global batch {args.batch_size}")
    else:
        wrapped, mode, devices = model, "plain", [device]
        where = "one GPU" if gpus == 1 else f"CPU, {threads} thread(s)"
        print0(f"run: plain | {where} | global batch {args.batch_size} | "
               f"note: nn.DataParallel needs two or more GPUs, so this trains the plain module")
    run = fit(model, wrapped, device, args.batch_size, args)
    print0("replicas: one process, one copy of the weights (DataParallel copies it to every GPU each step)")
    return summarize(run, mode, gpus if mode == "dp" else 0, device, threads,
                     peak_memory_mb(devices), True, args)


# ---------------------------------------------------------------- the DDP run
def train_ddp(device, args):
    """One DDP process: the same model and data, a 1/world share of every global batch."""
    torch.manual_seed(args.seed)  # the single-process run's initial weights (DDP broadcasts rank 0's)
    model = SimpleModel().to(device)
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    world = dist.get_world_size()
    threads = torch.get_num_threads() if device.type == "cpu" else None
    print0(f"run: ddp | {world} process(es) x {device.type} ({dist.get_backend()})"
           f"{f', {threads} thread(s) each' if threads else ''} | "
           f"{args.batch_size // world} per process (global batch {args.batch_size})")
    run = fit(model, ddp_model, device, args.batch_size // world, args)
    del ddp_model  # release DDP's reducer before the group goes (see cleanup)
    in_sync = replicas_in_sync(model, device)
    memory, kind = peak_memory_mb([device])
    peak = torch.tensor([memory], dtype=torch.float64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # the largest process's peak
    return summarize(run, "ddp", 0, device, threads, (peak.item(), kind), in_sync, args)


def main(rank, args, result_path):
    """One process of the job; `mp.spawn` passes the rank first."""
    device, health = setup(rank, args.nprocs, rank, args)
    try:
        record = train_ddp(device, args)
        if rank == 0:
            write_json(result_path, record)  # hands the record to the parent process
    except RuntimeError as error:
        if "timed out" not in str(error).lower():
            raise
        raise explain_timeout(error, health, args.timeout) from error
    finally:
        cleanup()
    if not record["replicas_in_sync"]:
        sys.exit(1)


def run_ddp(args):
    """Start args.nprocs DDP processes; returns rank 0's record."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" in os.environ:
        check_port_free(os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
    else:
        os.environ["MASTER_PORT"] = str(free_port())
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "ddp.json")
        try:
            context = mp.spawn(main, args=(args, result_path), nprocs=args.nprocs, join=False)
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
        with open(result_path) as f:
            return json.load(f)


# ---------------------------------------------------------------- main
def describe(record):
    """`dp (2 GPUs)`, `plain (1 x cpu)` or `ddp (2 x cpu, gloo)`: what a column of the comparison ran."""
    if record["mode"] == "dp":
        return f"dp ({record['dp_devices']} GPUs)"
    backend = f", {record['backend']}" if record["backend"] else ""
    return f"{record['mode']} ({record['world_size']} x {record['device']}{backend})"


def print_comparison(single, ddp):
    rows = [
        ("samples/s (after epoch 1)", lambda r: f"{r['steady_samples_per_s']:.0f}"),
        ("final loss", lambda r: f"{r['final_loss']:.4f}"),
        ("train accuracy (last epoch)", lambda r: f"{r['accuracy']:.3f}"),
        ("test accuracy", lambda r: f"{r['test_accuracy']:.3f}"),
        ("peak memory per process", lambda r: f"{r['peak_memory_mb']:.0f} MB ({r['peak_memory_kind']})"),
        ("batch per process", lambda r: f"{r['batch_size_per_process']} (global {r['batch_size']})"),
    ]
    print(f"\n{'':28} {describe(single):>28} {describe(ddp):>28}")
    for name, cell in rows:
        print(f"{name:28} {cell(single):>28} {cell(ddp):>28}")
    print(f"ddp / {single['mode']} throughput: {ddp['steady_samples_per_s'] / single['steady_samples_per_s']:.2f}x; "
          f"final losses differ by {abs(ddp['final_loss'] - single['final_loss']):.2e} "
          f"(same global batches; only the float summation order differs)\n", flush=True)


def run():
    args = check_args(parse_args())
    records = []
    if not args.ddp:
        records.append(run_single(args))
    if args.ddp or args.compare:
        records.append(run_ddp(args))
    if args.compare:
        print_comparison(*records)
    summary = dict(records[-1])
    if args.compare:
        summary["compare"] = records
    if args.metrics:
        write_json(args.metrics, summary)
    runs = " vs ".join(f"{describe(r)} {r['steady_samples_per_s']:.0f} samples/s, loss {r['first_loss']:.4f} -> "
                       f"{r['final_loss']:.4f}, test acc {r['test_accuracy']:.3f}" for r in records)
    in_sync = all(r["replicas_in_sync"] for r in records)
    print(f"done: {summary['script']} | torch {torch.__version__} | {args.epochs} epochs | {runs} | "
          f"replicas {'in sync' if in_sync else 'DIFFER'}", flush=True)
    if not in_sync:
        sys.exit(1)


if __name__ == "__main__":
    run()
