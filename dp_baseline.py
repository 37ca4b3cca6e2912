"""DataParallel, the single-process baseline, next to the DDP that replaces it.

Scenario: the seed's `SimpleModel` (an MLP 128 -> 256 -> 256 -> 10) learns, with
cross-entropy and Adam, a 10-class data set whose labels come from a fixed random
"teacher" network, so there is something to learn and the same data on every process.
By default one process trains it with `nn.DataParallel` over every visible GPU (with
one GPU or none it trains the plain module: DataParallel needs two or more GPUs).
`--compare` trains the same model on the same data with the same global batch twice,
first in one process (DataParallel, or plain; started apart, so that it has handed every
GPU back when the DDP run starts), then with DDP (one process per GPU, or 2 gloo processes
on CPU, each taking global batch / processes), and prints the two side
by side: samples/s, final loss, accuracy, peak memory per process. Both runs see the
same global batches in the same order (the single process uses the DistributedSampler
shuffle of a one-process world), so their losses agree up to float rounding: the
migration changes how fast, not what is learned.

Launch (the script starts its own DDP processes with mp.spawn; do not use torchrun here):
    python dp_baseline.py                          # DataParallel over all visible GPUs
    python dp_baseline.py --compare                # DataParallel, then DDP, side by side
    python dp_baseline.py --ddp --nprocs 2         # the DDP half alone (one process per GPU)
    python dp_baseline.py --device cpu             # CPU: the plain module, one process
    python dp_baseline.py --device cpu --compare   # CPU: plain module, then 2 gloo processes

Why DDP wins on GPUs: DataParallel runs one Python process that, every step, copies
the weights to each GPU, scatters the batch, gathers the outputs on GPU 0 and reduces
the gradients there (the GIL, and memory piled on GPU 0); DDP runs one process per GPU
and overlaps a ring all-reduce of the gradients with the backward pass.
Nearest sibling: ddp_gpus.py (mp.spawn, DDP only, a linear model); this file adds the
DataParallel baseline and the comparison, whose machinery follows the lesson. The robustness
every script shares (errors, ports, timeouts, Ctrl-C, the replica check) is the harness block
at the end of the file, each recipe the same wherever it appears.
"""

# ---------------------------------------------------------------- imports
import argparse
import json
import os
import resource
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler, TensorDataset


# ---------------------------------------------------------------- arguments
def parse_args(argv=None):
    p = Arguments(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", "--max_epochs", "-e", type=int, default=5, metavar="N",
                   help="epochs to train")
    p.add_argument("--batch_size", "--batch-size", "-b", type=int, default=256, metavar="N",
                   help="GLOBAL batch: samples per optimizer step over all devices. DataParallel "
                        "splits it over the GPUs; DDP gives each process N / processes")
    p.add_argument("--lr", type=float, default=1e-3, metavar="LR", help="Adam learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed for the data, the teacher and the initial weights")
    p.add_argument("--samples", type=int, default=8192, metavar="N",
                   help="training samples (and a quarter as many held out for the test accuracy)")
    p.add_argument("--compare", action="store_true",
                   help="train in one process (DataParallel or plain), then with DDP, and compare")
    p.add_argument("--ddp", action="store_true", help="train with DDP only (the migration target alone)")
    p.add_argument("--device", default="auto", metavar="auto|cpu|TYPE",
                   help="auto: the accelerator torch finds (cuda, xpu, hpu, npu, ...), else cpu "
                        "(DataParallel runs on CUDA only)")
    p.add_argument("--backend", default="auto", metavar="auto|NAME",
                   help="auto: torch's default for the device (nccl on cuda, xccl on xpu, hccl on hpu and npu, "
                        "gloo on cpu) (DDP only)")
    p.add_argument("--nprocs", type=int, default=None, metavar="N",
                   help="DDP processes to start with --ddp/--compare (default: the visible GPUs on CUDA, 2 on CPU)")
    p.add_argument("--timeout", type=float, default=300, metavar="SECONDS",
                   help="how long a collective waits for the other ranks before failing")
    p.add_argument("--metrics", default=None, metavar="PATH",
                   help="write a JSON summary here (with --compare: the DDP run's, both runs under 'compare')")
    return p.parse_args(argv)


def check_args(args):
    """Validate everything before the first run starts: no error after minutes of training."""
    check_positive(args, "epochs", "batch_size", "lr", "samples", "timeout", "nprocs")
    check_folders(args.metrics)
    if args.compare and args.ddp:
        fail(f"{spelled('compare')} and --ddp exclude each other", f"{spelled('compare')} already includes the DDP run")
    resolve_device(args)
    if args.compare or args.ddp:
        check_ddp_args(args)
    elif args.nprocs is not None:
        fail(f"{spelled('nprocs')} only applies to the DDP run", f"add --ddp or --compare, or drop {spelled('nprocs')}")
    return args


def check_ddp_args(args):
    """The DDP run: at most one process per GPU, and a global batch that splits evenly."""
    gpus = torch.accelerator.device_count() if args.device != "cpu" else 0  # GPUs, or another accelerator's devices
    if args.nprocs is None:
        args.nprocs = gpus if args.device != "cpu" else 2
    if args.device != "cpu" and args.nprocs > gpus:
        fail(f"{spelled('nprocs')} {args.nprocs} but only {gpus} {args.device} device(s) are visible",
             f"pass {spelled('nprocs')} {gpus} or fewer, or --device cpu")
    if args.batch_size % args.nprocs:
        fail(f"the global --batch_size {args.batch_size} does not split evenly over {args.nprocs} processes",
             f"pass a multiple of {args.nprocs}")


# ---------------------------------------------------------------- process group
def setup(rank, args):
    """Join the process group as `rank` of args.nprocs; returns this process's device."""
    # the cores split between this machine's processes, on GPUs too (their loaders, their CPU work)
    use_cpu_threads(args.nprocs)
    if args.device != "cpu":  # cuda, or another accelerator torch reports (xpu, hpu, npu, ...)
        device = torch.device(args.device, rank)
        torch.accelerator.set_device_index(device)  # before any work on it: one GPU per process
    else:
        device = torch.device("cpu")
    # device_id: NCCL builds its communicator now, so a bad GPU or network fails here, not at step 1
    dist.init_process_group(args.backend, rank=rank, world_size=args.nprocs,
                            timeout=timedelta(seconds=args.timeout),
                            device_id=device if args.backend == "nccl" else None)
    return device


def cleanup():
    free_error_frames()  # DDP's reducer goes before the group it talks through
    dist.destroy_process_group()


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


def epoch_batches(sampler, epoch, batch_size, device):
    """This epoch's batches of indices: one tensor on the data's device, split into views.

    Indexing a CUDA tensor with a Python list copies the list to the GPU first, a host
    sync per step for the inputs and another for the labels: the step would time host
    latency, not training. One copy per epoch keeps the steps free of them.
    """
    sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
    return torch.tensor(list(sampler), dtype=torch.long, device=device).split(batch_size)


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
def rank_and_world():
    """(rank, world size) in the DDP run; the single-process run is rank 0 of a world of one."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def all_reduce_if_distributed(totals):
    """Sum `[sum, count]` totals over the ranks; a single process already holds them all."""
    if dist.is_initialized():
        dist.all_reduce(totals)
    return totals


def fit(model, wrapped, devices, per_process_batch, args):
    """The loop, the same for `wrapped` plain, DataParallel or DDP; returns the run's record. A DistributedSampler
    orders the data in both modes: with one replica it is a plain shuffle; with N ranks rank r takes every N-th
    index of the same shuffle, so the N per-process batches of step k together are the single process's batch k."""
    train_set, test_set = make_data(args.samples, args.seed, devices[0])
    (x, y), (rank, world) = train_set.tensors, rank_and_world()
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    optimizer = torch.optim.Adam(wrapped.parameters(), lr=args.lr)
    reset_peak_memory(devices)
    print0(f"data: {len(train_set)} train / {len(test_set)} test samples, 10 classes from a fixed "
           f"random teacher; chance (most common class) {chance_accuracy(train_set):.3f}")
    history = []
    for epoch in range(args.epochs):
        batches = epoch_batches(sampler, epoch, per_process_batch, devices[0])
        start = time.perf_counter()
        wrapped.train()
        # [sum of per-sample losses, correct, samples]; the first two stay on the device: no host sync per step
        totals = torch.zeros(3, dtype=torch.float64, device=x.device)
        for idx in batches:
            xs, ys = x.index_select(0, idx), y.index_select(0, idx)
            optimizer.zero_grad(set_to_none=True)
            out = wrapped(xs)
            loss = F.cross_entropy(out, ys)
            loss.backward()  # DataParallel reduces the gradients onto GPU 0; DDP all-reduces (averages) them
            optimizer.step()
            totals[0] += loss.detach().double() * len(ys)
            totals[1] += (out.argmax(dim=1) == ys).sum()
            totals[2] += len(ys)
        loss_sum, correct, samples = all_reduce_if_distributed(totals).tolist()  # over all ranks
        seconds = time.perf_counter() - start
        history.append({"loss": loss_sum / samples, "accuracy": correct / samples, "samples": int(samples),
                        "seconds": seconds})
        print0(f"epoch {epoch + 1}/{args.epochs} | loss {loss_sum / samples:.4f} | acc {correct / samples:.3f} | "
               f"{samples / seconds:.0f} samples/s | {seconds:.2f} s")
    return {"history": history, "test_accuracy": evaluate(model, test_set),
            "chance_accuracy": chance_accuracy(train_set), "steps": args.epochs * len(batches),
            "steps_per_epoch": len(batches)}


@torch.no_grad()
def evaluate(model, test_set):
    """Exact accuracy on the held-out set: each rank scores every world_size-th sample, no padding."""
    model.eval()
    rank, world = rank_and_world()
    x, y = (t[rank::world] for t in test_set.tensors)
    correct = (model(x).argmax(dim=1) == y).sum().double()
    totals = torch.stack([correct, torch.tensor(float(len(y)), dtype=torch.float64, device=x.device)])
    correct, count = all_reduce_if_distributed(totals).tolist()
    return correct / count


# ---------------------------------------------------------------- the single-process run
def run_single(args):
    """DataParallel over every visible GPU when there are two or more, else the plain module.

    DataParallel is CUDA's: it copies the weights and scatters the batch with
    torch.nn.parallel.comm, whose broadcast, scatter and gather are CUDA's own (torch._C's
    _broadcast_coalesced, _scatter, _gather). On xpu, hpu, npu it trains the plain module on
    device 0; DDP runs there (--ddp, --compare).
    """
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    device = torch.device(args.device, 0) if args.device != "cpu" else torch.device("cpu")
    threads = use_cpu_threads(1) if device.type == "cpu" else None
    torch.manual_seed(args.seed)  # the same initial weights as the DDP run
    model = SimpleModel().to(device)
    if gpus >= 2:
        wrapped, mode, devices = nn.DataParallel(model), "dp", [torch.device("cuda", i) for i in range(gpus)]
        print0(f"run: dp | nn.DataParallel over {gpus} GPUs in one process | global batch {args.batch_size}")
    else:
        wrapped, mode, devices = model, "plain", [device]
        where = "one GPU" if gpus == 1 else f"CPU, {threads} thread(s)" if device.type == "cpu" else str(device)
        needs = "two or more GPUs" if device.type in ("cpu", "cuda") else f"CUDA GPUs, not {device.type}"
        print0(f"run: plain | {where} | global batch {args.batch_size} | "
               f"note: nn.DataParallel needs {needs}, so this trains the plain module")
    run = fit(model, wrapped, devices, args.batch_size, args)
    print0("replicas: one process, one copy of the weights (DataParallel copies it to every GPU each step)")
    return summarize(run, mode, gpus if mode == "dp" else 0, device, threads, peak_memory_mb(devices), True, args)


# ---------------------------------------------------------------- the DDP run
def train_ddp(device, args):
    """One DDP process: the same model and data, a 1/world share of every global batch."""
    torch.manual_seed(args.seed)  # the single-process run's initial weights (DDP broadcasts rank 0's)
    model = SimpleModel().to(device)
    # ddp_group: None; under TORCH_DISTRIBUTED_DEBUG=DETAIL a group DDP can take (torch 2.14, 2.15 segfault on gloo's checked one)
    ddp_model = DDP(model, device_ids=[device.index] if device.type != "cpu" else None, process_group=ddp_group(args.timeout))
    world = dist.get_world_size()
    threads = torch.get_num_threads() if device.type == "cpu" else None
    print0(f"run: ddp | {plural(world, 'process')} on {device.type} ({dist.get_backend()})"
           f"{f', {threads} thread(s) each' if threads else ''} | "
           f"{args.batch_size // world} per process (global batch {args.batch_size})")
    run = fit(model, ddp_model, [device], args.batch_size // world, args)
    del ddp_model  # release DDP's reducer before the group goes (see cleanup)
    in_sync = replicas_in_sync(model, device)
    memory, kind = peak_memory_mb([device])
    peak = torch.tensor([memory], dtype=torch.float64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # the largest process's peak
    return summarize(run, "ddp", 0, device, threads, (peak.item(), kind), in_sync, args)


def run_ddp_worker(rank, args):
    """One DDP process; mp.spawn passes the rank first. Rank 0 hands its record to the parent."""
    device = setup(rank, args)
    try:
        with explained_failures(args.timeout):
            record = train_ddp(device, args)
        if rank == 0:
            write_json(args.record, record)
    finally:
        cleanup()
    if not record["replicas_in_sync"]:
        sys.exit(1)  # the replicas differ: DDP did not keep them identical


def run_processes(fn, args, nprocs):
    """mp.spawn runs fn(rank, args) in `nprocs` processes; returns the record their rank 0 wrote for this parent."""
    with tempfile.TemporaryDirectory() as tmp:
        args.record = os.path.join(tmp, "record.json")  # a spawned process returns nothing: it leaves a file
        context = mp.spawn(fn, args=(args,), nprocs=nprocs, join=False)  # fn(rank, args) in each
        join_processes(context)  # the harness: a rank's exit as one line
        with open(args.record) as f:
            return json.load(f)


# ---------------------------------------------------------------- main
def report(records, args):
    """The metrics (--metrics) and the `done:` line; exit 1 when a run's replicas differ."""
    summary = dict(records[-1])
    if args.compare:
        summary["compare"] = records
    if args.metrics:
        write_json(args.metrics, summary)
    runs = " vs ".join(f"{describe(r)} {r['steady_samples_per_s']:.0f} samples/s, loss {r['first_loss']:.4f} -> "
                       f"{r['final_loss']:.4f}, test acc {r['test_accuracy']:.3f}" for r in records)
    in_sync = all(r["replicas_in_sync"] for r in records)
    print0(f"done: {summary['script']} | torch {torch.__version__} | {plural(args.epochs, 'epoch')} | {runs} | "
           f"replicas {'in sync' if in_sync else 'DIFFER'}")
    if not in_sync:
        sys.exit(1)


def main():
    """The single-process run (DataParallel or plain), the DDP run (--ddp), or one then the other (--compare)."""
    args = check_args(parse_args())
    if args.ddp or args.compare:
        prepare_rendezvous(args, spawning=True)  # a busy MASTER_PORT fails now, not after the first run
    records = []
    if args.compare:  # the parent holds no device memory, nor a CUDA context, when the DDP ranks start
        records.append(run_processes(run_single_apart, args, 1))
    elif not args.ddp:
        records.append(run_single(args))
    if args.ddp or args.compare:
        records.append(run_processes(run_ddp_worker, args, args.nprocs))
    if args.compare:
        print_comparison(*records)
    report(records, args)


# ---- beyond the lesson: --compare's first run in a process apart, the metrics record, peak memory, the table ----
def run_single_apart(index, args):
    """--compare's first run, in a process of its own (mp.spawn passes the index first). DataParallel
    makes a CUDA context on every GPU it uses, a few hundred MB each that only the process's end gives
    back (empty_cache() does not): held by the parent, it would crowd the DDP ranks, and on GPUs in
    EXCLUSIVE_PROCESS mode, as clusters often run them, keep them from making theirs at all."""
    write_json(args.record, run_single(args))


def summarize(run, mode, dp_devices, device, threads, memory, in_sync, args):
    """The contract's metrics record for one run (plus this script's keys)."""
    history = run["history"]
    elapsed = sum(h["seconds"] for h in history)
    steady = history[1:] or history  # the first epoch pays for warm-up (allocator, threads, buckets)
    world = rank_and_world()[1]
    return {
        "script": os.path.basename(__file__), "mode": mode, "dp_devices": dp_devices,
        "world_size": world, "backend": dist.get_backend() if dist.is_initialized() else None,
        "device": device.type, "torch": torch.__version__, "threads_per_process": threads,
        "pid": os.getpid(), "parent_pid": os.getppid(),
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


def reset_peak_memory(devices):
    """The device allocators count their peak from here (the CPU's peak RSS cannot be reset)."""
    for d in devices if devices[0].type != "cpu" else []:
        torch.get_device_module(d.type).reset_peak_memory_stats(d)


def peak_memory_mb(devices):
    """Peak memory of this process: the device allocator's peak on GPUs, peak RSS on CPU."""
    if devices[0].type != "cpu":  # torch.cuda, torch.xpu, ...: each device module counts its allocator's peak
        module = torch.get_device_module(devices[0].type)
        return (max(module.max_memory_allocated(d) for d in devices) / 2 ** 20,
                f"{devices[0].type} max_memory_allocated")
    # Linux carries ru_maxrss across exec, so a spawned rank would report its parent's
    # peak; VmHWM is the peak of this process's own address space
    try:
        with open("/proc/self/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        return kib / 2 ** 10, "peak RSS"
    except (OSError, StopIteration):
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        return maxrss / (2 ** 20 if sys.platform == "darwin" else 2 ** 10), "peak RSS (getrusage)"



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
    print0(f"\n{'':28} {describe(single):>28} {describe(ddp):>28}")
    for name, cell in rows:
        print0(f"{name:28} {cell(single):>28} {cell(ddp):>28}")
    print0(f"ddp / {single['mode']} throughput: {ddp['steady_samples_per_s'] / single['steady_samples_per_s']:.2f}x; "
           f"final losses differ by {abs(ddp['final_loss'] - single['final_loss']):.2e} "
           f"(same global batches; only the float summation order differs)\n")



# =============================================================================
# ---- harness: recipes, each the same wherever it appears; not part of the lesson ----
# What makes the lesson above robust: the recipes of recipes/harness.py that this file uses, every definition byte for byte as there (a test compares them). A recipe can be
# lifted alone with the recipes its banner names; docs/recipes.md has the ones users lift most.
# =============================================================================
import atexit
import contextlib
import gc
import logging
import multiprocessing
import re
import signal
import socket
import threading
import traceback
from torch.distributed.elastic.utils.distributed import get_free_port


# ---- recipe: printing: one line in one write, on rank 0 only unless every_rank
def print0(line, file=None, every_rank=False):
    """In one write: under PYTHONUNBUFFERED=1 print() writes the newline apart, and ranks' lines interleave."""
    if every_rank or (dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))) == 0:
        print(f"{line}\n", end="", file=file or sys.stdout, flush=True)


def plural(count, noun):
    return f"{count} {noun}" + ("" if count == 1 else "es" if noun.endswith(("s", "x", "sh", "tch")) else "s")


# ---- recipe: errors (needs printing): bad input is one line `error: what (fix)` and exit code 2
def fail(what, fix, every_rank=False, every_node=False):
    """Said once: by rank 0 (the others wait to be stopped: one that left first would get rank 0 killed
    before it said why); every_rank: by each (its device); every_node: by each machine's LOCAL_RANK 0 (its files)."""
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0 or every_rank or (every_node and int(os.environ.get("LOCAL_RANK", rank)) == 0):
        report_error(f"error: {what} ({fix})" + (f" [rank {rank}]" if rank else ""))
    else:
        wait_to_be_stopped()
    sys.exit(2)


def wait_to_be_stopped():
    """Under a launcher, a rank that did not say why waits (at most 30 s) to be stopped once the one that said it
    has exited: torchrun names the first rank to fail as the root cause, and a silent rank that left at once was
    named instead (`To enable traceback see ...`) in 1 launch of 8. The only wait that steers torchrun's choice."""
    if "TORCHELASTIC_RUN_ID" in os.environ or multiprocessing.parent_process() is not None:
        time.sleep(30)


def report_error(line):
    """On stderr, and to torchrun as this worker's error (TORCHELASTIC_ERROR_FILE, in the format torch's @record
    writes; @record records an exception, never a SystemExit, so a line that exits 2 is written here). Shown (shown()): a file's newline or terminal escape in it cannot forge a second line."""
    line = shown(line)
    print0(line, sys.stderr, every_rank=True)
    if path := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        with contextlib.suppress(OSError), open(path, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                  "timestamp": str(int(time.time()))}}}, f)


def shown(text):
    """`text` with every character that is not printable (newlines, ESC and the other C0/C1 controls, DEL,
    Unicode line separators, bidi overrides) written as repr writes it (`\\n`, `\\x1b`): shown, never obeyed."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


# ---- recipe: arguments (needs errors): help that states defaults, and checks before any process starts
class HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """`(default: X)` after each option's help, unless the help states it or there is none (None, False)."""

    def _get_help_string(self, action):
        said = "default" in (action.help or "").replace("'s default", "")
        quiet = action.default is None or action.default is False  # `is`: 0 == False, and a default 0 is said
        return action.help if said or quiet else super()._get_help_string(action)


class Arguments(argparse.ArgumentParser):
    """argparse's parser with each default in the help, no abbreviations (`--batch` was ambiguous between
    --batch_size and --batch-size), and a mistake as one line by rank 0 (fail()): under torchrun every process
    parses, so argparse's usage came once per rank, and torchrun's root cause had no reason."""

    def __init__(self, **kwargs):
        super().__init__(formatter_class=HelpWithDefaults, allow_abbrev=False, **kwargs)

    def error(self, message):
        fail(message, f"see {os.path.basename(sys.argv[0])} --help")


def check_positive(args, *names):
    for name in (n for n in names if getattr(args, n) is not None and not getattr(args, n) > 0):
        fail(f"{spelled(name)} must be positive, got {getattr(args, name)}", f"pass a {spelled(name)} above 0")


def spelled(name):
    """The option `name` (its dest, `batch_size`) as the command line gave it, `--batch-size` or `--batch_size`
    (`--x=...` too), so an error names a flag the user typed; not given: `--name`."""
    given = (arg.split("=")[0] for arg in sys.argv[1:] if arg.startswith("--"))
    return next((flag for flag in given if flag[2:].replace("-", "_") == name), f"--{name}")


def check_folders(*paths):
    """Output paths must lie in existing folders: found now, not after an hour of training."""
    for path in (p for p in paths if p and not os.path.isdir(os.path.dirname(os.path.abspath(p)))):
        fail(f"the folder of {path} does not exist", "create it first, or pass another path", every_node=True)


# ---- recipe: device (needs errors, printing): the device, its backend, bf16, CPU threads
def resolve_device(args, here=None):
    """--device and --backend `auto` made concrete: torch.accelerator's device (`here`: take it to be of
    that type), else the CPU, and torch's default backend there; a backend fits the types torch lists."""
    here = here or getattr(torch.accelerator.current_accelerator(check_available=True), "type", "cpu")
    args.device = kind = here if args.device == "auto" else args.device
    if kind not in ("cpu", here):
        fail(f"--device {kind} but " + (f"this machine's accelerator is {here}" if here != "cpu" else
                                        "no GPU or other accelerator is visible"),
             "use --device cpu" + (", or check CUDA_VISIBLE_DEVICES" if kind == "cuda" else " or auto"))
    carries = dist.Backend.backend_capability  # backend -> the device types whose tensors it takes
    try:
        default = dist.get_default_backend_for_device(kind)
    except (ValueError, RuntimeError):  # none registered for the type, or a type this torch cannot name
        default = None
    args.backend = default if args.backend == "auto" else args.backend
    if args.backend is not None and args.backend not in carries:
        fail(f"unknown backend {args.backend!r}", f"use --backend auto, or one of {', '.join(sorted(carries))}")
    if args.backend is not None and kind in carries[args.backend]:
        return args
    if default is not None and kind in carries[default]:
        fail(f"--backend {args.backend} does not carry {kind} tensors", f"use --backend auto: {default} on {kind}")
    carried = f": {default}, its default there, carries only {' and '.join(carries[default])} tensors" if default else ""
    fail(f"torch has no multi-process backend for {kind}{carried}",  # mps: torch names gloo, which takes no MPS tensors
         "use --device cpu" + ("" if default or kind == "mps" else f", or install the package that adds {kind} to torch"))


def use_cpu_threads(procs_on_this_machine):
    """The cores split between the processes (oversubscribed, they halve throughput), unless OMP_NUM_THREADS says."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", max(1, cores // procs_on_this_machine))))
    return torch.get_num_threads()


# ---- recipe: rendezvous (needs errors): what init_process_group("env://") reads, for every launcher
def prepare_rendezvous(args, spawning=False):
    """spawning: mp.spawn's parent; else started by torchrun (it sets everything), `python -m
    torch.distributed.launch` (--local-rank), by hand (RANK, WORLD_SIZE, MASTER_*), or plain `python`
    (a world of one). A free port is picked only by the process that hosts the rendezvous."""
    if getattr(args, "local_rank", None) is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    named = "LOCAL_RANK" in os.environ or "RANK" not in os.environ  # no RANK: plain `python`, a world of one
    if not spawning:  # a hand-made launch that names no LOCAL_RANK: all its ranks on this machine
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
        check_local_rank(args.device, named)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" in os.environ:
        if spawning or ("TORCHELASTIC_RUN_ID" not in os.environ and os.environ["RANK"] == "0"):  # it hosts the store
            check_port_free(os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
    elif spawning or os.environ.get("WORLD_SIZE") == "1":
        os.environ["MASTER_PORT"] = str(get_free_port())
    else:
        fail("MASTER_PORT is not set", "set MASTER_ADDR and MASTER_PORT for every process, or use torchrun")
    if args.backend == "nccl":  # NCCL's watchdog aborts a stuck rank; its flight recorder first dumps the last
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")  # collectives: torchfrtrace /tmp -p nccl_trace_rank_
        os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "/tmp/nccl_trace_rank_")


def check_local_rank(device, named, count=None):
    """LOCAL_RANK picks one of this machine's `count` devices (named: the launcher set it; else it is RANK).
    The module's own count: torch 2.7's torch.accelerator.device_count() raises without a driver."""
    local_rank = int(os.environ["LOCAL_RANK"])
    count = torch.get_device_module(device).device_count() if count is None else count
    if device != "cpu" and local_rank >= count:
        fail(f"LOCAL_RANK {local_rank} but only {count} {device} device(s) are visible" if named else
             f"LOCAL_RANK is not set, and RANK {local_rank} is beyond this machine's {count} {device} device(s)",
             f"start at most {count} processes per node, or use --device cpu" if named else
             "set LOCAL_RANK for each process: its index among the processes on its machine", every_rank=True)


def check_port_free(addr, port):
    """Bound with SO_REUSEADDR, as the TCPStore binds: a port a finished run left in TIME_WAIT is free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, int(port)))
        except OSError:
            fail(f"MASTER_PORT {port} is already in use on {addr}",
                 "unset MASTER_PORT to let the script pick a free port, or choose another")


# ---- recipe: failures (needs errors, printing): Ctrl-C and a failed collective as one line each
@contextlib.contextmanager
def explained_failures(timeout, kept=None):
    """A failed gloo collective: explain_collective_failure's line (NCCL's watchdog aborts first), ending with
    kept(): what a rerun resumes from. Ctrl-C: rank 0 says `interrupted (...)`, all leave at once with 130
    (no clean shutdown: with the peers gone, releasing DDP's reducer can wait on them for seconds)."""
    health = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout)) if dist.get_backend() == "gloo" else None
    kept = kept or (lambda: "no checkpoint kept")
    interrupted = stop_on_interrupt(kept)
    try:
        yield
    except (KeyboardInterrupt, RuntimeError) as error:
        # Ctrl-C reaches the processes one by one: a peer that stopped first can fail our collective before
        # our own SIGINT is seen, so wait a moment for it before explaining the failure
        time.sleep(0 if interrupted["sigint"] or isinstance(error, KeyboardInterrupt) else 0.5)
        if interrupted["sigint"] or isinstance(error, KeyboardInterrupt):
            if not interrupted["said"]:
                print0(f"interrupted (Ctrl-C): {kept()}")
            sys.stderr.flush()
            os._exit(130)
        line = explain_collective_failure(error, health, timeout) if health is not None else None
        if line is None:
            raise
        if line:
            report_error(f"error: {line}; {kept()} [rank {dist.get_rank()}]")
        else:
            wait_to_be_stopped()
        raise SystemExit(1) from None


def stop_on_interrupt(kept):
    """{"sigint": True once Ctrl-C came, "said": True once rank 0 said kept()}: said at once, before a peer or
    the launcher ends this process, then KeyboardInterrupt; where an error is already on its way, the
    signal comes again 0.2 s later instead, in case that error is caught. Later SIGINTs are ignored."""
    interrupted = {"sigint": False, "said": False}

    def on_sigint(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # none inside this one (mp.spawn's parent signals again)
        if not interrupted["sigint"] and (not dist.is_initialized() or dist.get_rank() == 0):
            with contextlib.suppress(RuntimeError):  # it cut into a write to stdout: explained_failures says it
                print0(f"interrupted (Ctrl-C): {kept()}")
                interrupted["said"] = True
        interrupted["sigint"] = True
        if sys.exc_info()[1] is None:
            raise KeyboardInterrupt
        signal.signal(signal.SIGINT, on_sigint)
        again = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
        again.daemon = True
        again.start()

    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # a background job keeps ignoring it
        signal.signal(signal.SIGINT, on_sigint)
    return interrupted


def explain_collective_failure(error, health, timeout):
    """One line ("" where another rank says it, None: not a collective's failure). A timeout: a monitored
    barrier over `health` names who did not arrive; all did: they called different collectives. A connection
    closed: a peer was lost; the roll call through the store (it outlives gloo) says which."""
    text, rank, wait = str(error), dist.get_rank(), min(timeout, 5)
    roll_call()
    if "Detected mismatch between collectives" in text:  # TORCH_DISTRIBUTED_DEBUG=DETAIL's check, on every rank
        where = call_sites(error, health)  # a collective: every rank takes part
        return f"the ranks called different collectives ({mismatch_of(text)}): {where}" if rank == 0 else ""
    if "connection reset" in text.lower() or "connection closed" in text.lower():
        answered = roll_call(wait)
        lost = [r for r in range(dist.get_world_size()) if r not in (answered or [])]
        if answered and (rank != min(answered) or not lost):  # none lost: the peer left after its own error
            return ""
        return (f"lost rank {', '.join(map(str, lost)) if answered else '0 (the host of the rendezvous store)'}: "
                f"its connection closed mid-collective and it did not answer within {wait:g} s "
                f"(it crashed, was killed, or its machine went away); at the time {call_sites(error)}")
    if "timed out" not in text.lower():
        return None
    try:
        dist.monitored_barrier(group=health, timeout=timedelta(seconds=wait), wait_all_ranks=True)
    except RuntimeError as e:
        return f"a collective waited longer than --timeout {timeout:g} s ({str(e).strip().splitlines()[0]})"
    where = call_sites(error, health)
    return (f"a collective waited longer than --timeout {timeout:g} s and every rank answered afterwards, so none "
            f"was lost or frozen: the ranks called different collectives ({where}); to see where they parted: "
            "TORCH_DISTRIBUTED_DEBUG=DETAIL, or a flight record (TORCH_FR_BUFFER_SIZE)") if rank == 0 else ""


def mismatch_of(text):
    """`rank 0 ALLREDUCE [4] Float vs rank 1 ALLREDUCE [3] Float, call 12 of the group, differing in ...`"""
    sides = re.findall(r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+), "
                       r"OpType=(\w+)(?:, TensorShape=(\[[^\]]*\]))?(?:, TensorDtypes=([\w, ]+?)(?:,|\)))?", text)
    described = " vs ".join(f"rank {r} {op}" + (f" {shape}" if shape else "") + (f" {dtype}" if dtype else "")
                            for r, _, op, shape, dtype in sides)
    differ = re.search(r"differ in the following aspects:\s*(.*)", text, flags=re.DOTALL)
    aspects = " ".join(differ.group(1).replace("vs", " vs ").replace("Tensor Tensor", "tensor").split()) if differ else "?"
    return f"{described}, call {sides[0][1] if sides else '?'} of the group, differing in {aspects}"


def call_sites(error, health=None):
    """"rank 0 in `dist.barrier()` (train.py:80 in save)": this file's innermost frame; with `health`, every rank's."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if os.path.abspath(f.filename) == os.path.abspath(__file__)]
    every = [f"`{frames[-1].line.split('  #')[0]}` ({os.path.basename(__file__)}:{frames[-1].lineno} in {frames[-1].name})"
             if frames else "an unknown call"]
    if health is not None:
        every = every * dist.get_world_size()
        dist.all_gather_object(every, every[0], group=health)
    ranks = {}
    for r, site in enumerate(every):
        ranks.setdefault(site, []).append(str(r if health is not None else dist.get_rank()))
    return ", ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(rs)} in {site}" for site, rs in ranks.items())


def roll_call(seconds=0.0):
    """Answer through the rendezvous store; the ranks that answered within `seconds` (None: the store is gone)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        keys = [f"harness/answered/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{r}"
                for r in range(dist.get_world_size())]
        store.set(keys[dist.get_rank()], "1")
        if seconds:
            with contextlib.suppress(RuntimeError):  # DistStoreError: a rank that never answers, the one we look for
                store.wait(keys, timedelta(seconds=seconds))
        return [r for r, key in enumerate(keys) if store.check([key])]
    except RuntimeError:  # its host (torchrun's agent on the first node, or rank 0 under mp.spawn) is gone
        return None


# ---- recipe: DETAIL-safe DDP group: DDP(..., process_group=ddp_group(timeout)) survives TORCH_DISTRIBUTED_DEBUG=DETAIL
def ddp_group(timeout):
    """DDP's process group: None (the default group), or under DETAIL a group of every rank created with the
    debug level briefly OFF (a collective: every rank calls it), with the collective timeout in seconds (None:
    torch's default for a new group, 30 minutes on gloo: it does not inherit init_process_group's). torch 2.14 and
    2.15 end the process with SIGSEGV in DDP's constructor when its group is a checked one; DDP's gradient
    all-reduces then go unchecked, every other collective is still checked. DETAIL is the level now or the one
    the job was launched with (the default group was created checked even if the level was lowered since)."""
    previous = dist.get_debug_level()
    if dist.DebugLevel.DETAIL not in (previous, dist.DebugLevel.__members__.get(
            os.environ.get("TORCH_DISTRIBUTED_DEBUG", "OFF").upper())):
        return None
    dist.set_debug_level(dist.DebugLevel.OFF)  # the groups created now are not wrapped in the checks
    try:
        return dist.new_group(timeout=None if timeout is None else timedelta(seconds=timeout))
    finally:
        dist.set_debug_level(previous)


# ---- recipe: release: a failed run's frames (and the DDP reducer they hold) freed before the group is destroyed
def free_error_frames(error=None):
    """Else the process can abort at exit ("terminate called without an active exception"): the frames of
    a failed run's whole error chain may hold the model. `error`: a caught one; by default the one in hand."""
    error = error or sys.exc_info()[1]
    while error is not None:
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__
    gc.collect()


# ---- recipe: replica check (needs printing, errors): every rank's parameters and buffers equal, bit for bit
def replicas_in_sync(model, device):
    """Every parameter and buffer (BatchNorm's running statistics, its int counter too) broadcast by its first
    holder and compared by torch.equal (sums can differ in the last bit between GPUs, or coincide); a DTensor
    (FSDP2) across the ranks its mesh replicates it over, and its shards must tile it. The fingerprint, sum(x *
    sin(i)) over the parameters, is the same sharded or not. They differ: rank 0 says which, also as this
    worker's error (torchrun's root cause), and the caller exits 1."""
    differ_in, base, whole = [], 0, 0
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # the fingerprint, the values counted
    tensors = [("parameter", n, p.detach()) for n, p in model.named_parameters()]
    for kind, name, p in tensors + [("buffer", n, b) for n, b in model.named_buffers()]:
        local, offsets, first, groups = p, (0,) * p.dim(), dist.get_rank() == 0, [None]  # all of p, on every rank
        if hasattr(p, "device_mesh"):  # a DTensor: its mesh says who holds which part (its first chunk here)
            replicated = [i for i, placement in enumerate(p.placements) if placement.is_replicate()]
            local, offsets = p.to_local(), tuple(p.__create_chunk_list__()[0].offsets)
            first = all(p.device_mesh.get_coordinate()[i] == 0 for i in replicated)
            groups = [p.device_mesh.get_group(i) for i in replicated]
        for group in groups:  # the ranks that hold this very part: the first one's copy against each rank's own
            theirs = local.clone()
            dist.broadcast(theirs, src=dist.get_global_rank(group, 0) if group else 0, group=group)
            differ_in += [] if torch.equal(theirs, local) or f"{kind} {name}" in differ_in else [f"{kind} {name}"]
        if first and kind == "parameter":
            sums[0] += fingerprint_terms(local, offsets, p.shape, base)
            sums[1] += local.numel()
        base, whole = base + p.numel() * (kind == "parameter"), whole + p.numel() * (kind == "parameter")
    dist.all_reduce(sums)
    every = [None] * dist.get_world_size()  # each rank's differing tensors; "" where its shards do not tile
    dist.all_gather_object(every, differ_in + ([] if int(sums[1].item()) == whole else ["shards that do not tile it"]))
    return replicas_verdict(every, sums[0].item())


def replicas_verdict(every, fingerprint):
    """Rank 0's line on every rank's differing tensors (`every`, by rank), and its error line where any differ."""
    differ = [rank for rank, names in enumerate(every) if names]
    named = sorted({n for names in every for n in names}, key=lambda n: min(ns.index(n) for ns in every if n in ns))
    where = f" in {named[0]}" + (f" (and {len(named) - 1} more)" if len(named) > 1 else "") if differ else ""
    summary = f"({plural(len(every), 'rank')}, fingerprint {fingerprint:.10e})"
    print0(f"replicas: {'in sync' if not differ else 'DIFFER on ranks ' + str(differ) + where} {summary}")
    if differ and dist.get_rank() == 0:
        report_error(f"error: the replicas differ after training: ranks {differ}{where} (find the update made on "
                     "one rank alone, or the buffer no collective syncs: docs/when_things_go_wrong.md)")
    elif differ and "TORCHELASTIC_RUN_ID" in os.environ:  # at exit: rank 0, with its exit code 1, is the root cause
        atexit.register(wait_to_be_stopped)
    return not differ


def fingerprint_terms(local, offsets, shape, base, rows=4096):
    """sum(x * sin(base + i)) over the block `local` at `offsets` of a tensor of `shape`, a few rows at a time."""
    if local.dim() == 0:  # a scalar parameter: one row of one value
        local, offsets, shape = local.reshape(1), (0,), (1,)
    strides = torch.empty(shape, device="meta").stride()
    inner = torch.zeros((), dtype=torch.float64, device=local.device)  # the index within a row, by broadcasting
    for d in range(1, local.dim()):
        inner = inner.unsqueeze(-1) + ((offsets[d] + torch.arange(local.shape[d], device=local.device)) * strides[d]).double()
    total = torch.zeros((), dtype=torch.float64, device=local.device)
    for start in range(0, local.shape[0], rows):
        at = torch.arange(start, min(start + rows, local.shape[0]), device=local.device) + offsets[0]
        index = (at.double() * strides[0] + base).view(-1, *(1,) * (local.dim() - 1)) + inner
        total += (local[start:start + rows].double() * torch.sin(index)).sum()
    return total


# ---- recipe: atomic save (needs errors): a crash mid-write leaves the previous file whole
def atomic_write(path, write):
    """write(file) into a new file (O_EXCL: no planted link followed), flushed, renamed over `path`, folder flushed."""
    tmp = f"{path}.tmp{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        os.remove(tmp)  # a killed write's leftover, or a planted link (removed, not followed)
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        folder = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(folder)  # the rename itself
        finally:
            os.close(folder)
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)


def write_or_fail(path, write):
    """atomic_write, where a full disk or a read-only folder is one line by the rank that wrote (the previous
    file stays whole): the run cannot save, and a traceback would hide which file and why."""
    try:
        atomic_write(path, write)
    except (OSError, RuntimeError) as e:  # torch.save's writer turns a failed write into a RuntimeError
        cause = e if isinstance(e, OSError) else e.__context__
        if not isinstance(cause, OSError):
            raise
        fail(f"cannot write {path} ({cause.strerror or cause})", "free space on its disk or make its folder "
             "writable, then rerun; the previous file there is kept", every_rank=True)


def write_json(path, record):
    write_or_fail(path, lambda f: f.write(json.dumps(record, indent=2).encode()))


# ---- recipe: spawn (needs printing): the exits of mp.spawn's processes a user should see
def join_processes(context):
    """Wait for mp.spawn(..., join=False)'s processes; a rank's bad input (2), Ctrl-C (130), a replica mismatch
    (1) pass quietly (it said why), a traceback is shown once, a signal is named."""
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # its "Terminating process" notes
    try:
        while not context.join(grace_period=3):
            pass
    except KeyboardInterrupt:  # Ctrl-C reached the whole process group; the ranks end themselves
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        deadline = time.monotonic() + 5
        for process in context.processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGINT)  # in case only this parent was signalled
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
        sys.exit(130)
    except mp.ProcessRaisedException as e:
        print0(f"error: a process failed\n{e}", sys.stderr, every_rank=True)  # its traceback, once
        sys.exit(1)
    except mp.ProcessExitedException as e:
        if e.exit_code not in (1, 2, 130):
            print0(f"error: process {e.error_index} " + (f"was ended by {e.signal_name} (exit code {e.exit_code})"
                   if e.signal_name else f"exited with code {e.exit_code}"), sys.stderr, every_rank=True)
        sys.exit(e.exit_code if e.exit_code and e.exit_code > 0 else 1)
# ---- end of harness ----


if __name__ == "__main__":
    main()
