"""An MNIST ConvNet trained with DDP, one process per GPU, launched with `mp.spawn`.

Scenario: the seed's `ConvNet` (two conv blocks with BatchNorm, then a linear layer)
learns MNIST with mixed precision (`torch.amp`; by default bf16 on GPUs and CPUs that
have it, fp16 with a GradScaler on older GPUs), SyncBatchNorm on GPUs, a
`DistributedSampler` for training and an exact distributed evaluation: every test
sample is counted once, whatever the world size. Global rank 0 downloads the data
(the others wait) and writes a checkpoint each epoch that `--resume` continues from
and `--evaluate` only evaluates. Without MNIST (no copy in `--data`, no network) an
offline stand-in with MNIST's shapes is used, and the script says so.

Launch (the script starts its own processes; do not use torchrun here):
    python ddp_main.py --gpu 0,1 -e 3 -b 32          # GPUs 0 and 1, one process each, NCCL
    python ddp_main.py                               # every visible GPU; on CPU 2 processes
    python ddp_main.py --resume -e 6                 # continue ddp_checkpoint.pt to epoch 6
    python ddp_main.py --evaluate                    # only evaluate ddp_checkpoint.pt
    python ddp_main.py --device cpu --nprocs 2       # CPU only, gloo
    python ddp_main.py --dataset synthetic           # never touch the network

Over the seed this fixes: defaults that learn (Adam at 1e-3; the seed's SGD at 1e-4
barely moves), `torch.amp` instead of the deprecated `torch.cuda.amp`, RANK equal to the
global rank, a test accuracy over exactly the test set (DistributedSampler pads
duplicates in), no deadlocking rank-0-only evaluation, one download instead of one per
process, a checkpoint without the `module.` prefix that loads with `weights_only=True`,
a free port instead of a hard-coded one, and a CPU path. Nearest sibling:
ddp_main_torchrun.py is the same script launched by torchrun; ddp_gpus.py is the same
launch for a linear model without data, AMP or evaluation.
"""

# ---------------------------------------------------------------- imports
import argparse
import gc
import json
import os
import pickle
import re
import socket
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, Subset


# ---------------------------------------------------------------- arguments
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--gpu", default=None, metavar="IDS",
                   help="GPUs to use, e.g. 0,1 (sets CUDA_VISIBLE_DEVICES; default: all visible)")
    p.add_argument("--epochs", "--max_epochs", "-e", type=int, default=3, metavar="N",
                   help="epochs to train (with --resume: the epoch to end at)")
    p.add_argument("--batch_size", "--batch-size", "-b", type=int, default=32, metavar="N",
                   help="samples per step, per process (the global batch is N x world size)")
    p.add_argument("--lr", type=float, default=1e-3, metavar="LR", help="Adam learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed for the data order and the initial weights")
    p.add_argument("--data", default="./data", metavar="DIR", help="MNIST folder (DIR/MNIST/raw)")
    p.add_argument("--dataset", choices=["auto", "mnist", "synthetic"], default="auto",
                   help="auto: MNIST when present or downloadable, else the offline synthetic stand-in")
    p.add_argument("--train_samples", type=int, default=None, metavar="N",
                   help="use the first N training samples (default: all of MNIST; 6000 synthetic)")
    p.add_argument("--test_samples", type=int, default=None, metavar="N",
                   help="use the first N test samples (default: all of MNIST; 1000 synthetic)")
    p.add_argument("--workers", type=int, default=0, metavar="N",
                   help="DataLoader worker processes, per process (0: load in the training process)")
    p.add_argument("--amp", choices=["auto", "bf16", "fp16", "off"], default="auto",
                   help="mixed precision; auto: bf16 where the GPU or CPU supports it, else fp16 on "
                        "GPUs and off on CPUs")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto: CUDA when available, else CPU")
    p.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                   help="auto: nccl on CUDA, gloo on CPU")
    p.add_argument("--nprocs", type=int, default=None, metavar="N",
                   help="processes to start (default: the visible GPUs on CUDA, 2 on CPU)")
    p.add_argument("--checkpoint", default="ddp_checkpoint.pt", metavar="PATH",
                   help="checkpoint written by rank 0 after every epoch")
    p.add_argument("--resume", action="store_true", help="continue training from --checkpoint")
    p.add_argument("--evaluate", action="store_true", help="only evaluate --checkpoint on the test set")
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


def note(message):
    """A remark about the set-up, printed once (by global rank 0) before training starts."""
    if int(os.environ.get("RANK", "0")) == 0:
        say(f"note: {message}")


def select_gpus(args):
    """Apply --gpu. CUDA reads CUDA_VISIBLE_DEVICES once, at its first use, so this runs before any CUDA call."""
    if args.gpu is None:
        return
    if not re.fullmatch(r"\d+(,\d+)*", args.gpu):
        fail(f"--gpu {args.gpu!r} is not a list of GPU numbers", "pass e.g. --gpu 0,1")
    if args.device != "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = args.gpu


def check_args(args):
    """Validate everything that can be checked before any process starts."""
    for name in ("epochs", "batch_size"):
        if getattr(args, name) <= 0:
            fail(f"--{name} must be a positive integer, got {getattr(args, name)}",
                 f"pass --{name} 1 or more")
    for name in ("train_samples", "test_samples"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            fail(f"--{name} must be a positive integer, got {getattr(args, name)}",
                 f"pass --{name} 1 or more, or leave it out for the whole set")
    if args.workers < 0:
        fail(f"--workers must be 0 or more, got {args.workers}", "pass --workers 0")
    if not args.lr > 0:
        fail(f"--lr must be positive, got {args.lr}", "pass e.g. --lr 1e-3")
    if not args.timeout > 0:
        fail(f"--timeout must be positive, got {args.timeout}", "pass e.g. --timeout 300")
    if (args.resume or args.evaluate) and not os.path.isfile(args.checkpoint):
        fail(f"no checkpoint at {args.checkpoint} to {'evaluate' if args.evaluate else 'resume'}",
             "train first, or point --checkpoint at one")
    if args.resume or args.evaluate:
        read_checkpoint(args.checkpoint)
    for path in (args.checkpoint, args.metrics):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            fail(f"the folder of {path} does not exist", "create it first, or pass another path")
    select_gpus(args)
    gpus = torch.cuda.device_count()
    if args.device == "auto":
        args.device = "cuda" if gpus > 0 else "cpu"
    if args.device == "cuda" and gpus == 0:
        fail("--device cuda but no GPU is visible", "use --device cpu, or check CUDA_VISIBLE_DEVICES")
    if args.backend == "auto":
        args.backend = "nccl" if args.device == "cuda" else "gloo"
    if args.backend == "nccl" and args.device != "cuda":
        fail("the nccl backend needs GPUs", "use --backend gloo on CPU")
    if args.nprocs is None:
        args.nprocs = gpus if args.device == "cuda" else 2
    if args.nprocs <= 0:
        fail(f"--nprocs must be a positive integer, got {args.nprocs}", "pass --nprocs 1 or more")
    if args.device == "cuda" and args.nprocs > gpus:
        fail(f"--nprocs {args.nprocs} but only {gpus} GPU(s) are visible",
             f"pass --nprocs {gpus} or fewer, or --device cpu")
    if args.device == "cpu" and args.gpu is not None:
        note(f"--gpu {args.gpu} ignored on CPU; the number of processes sets the world size")
    if args.device == "cpu" and args.amp == "fp16":
        note("--amp fp16 on CPU runs far slower than fp32 or bf16 (few CPU kernels are fast in fp16)")
    if args.device == "cpu" and not args.evaluate:
        # torch refuses SyncBatchNorm on CPU ("SyncBatchNorm layers only work with GPU modules")
        note("SyncBatchNorm needs CUDA; on CPU each rank keeps its own BatchNorm statistics")
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
class SyntheticDigits(Dataset):
    """An offline stand-in for MNIST: 1x28x28 images in 10 classes that a ConvNet can learn.

    Each class has a fixed random pattern of 4x4-pixel blocks; a sample is its class's
    pattern shifted by up to 3 pixels, with a random contrast, plus strong noise. The
    patterns come from `seed` alone, so the training and test splits share them, and
    every rank builds the same data set (the sampler shards indices, and indices only
    mean the same thing on every rank if the data does).
    """

    def __init__(self, size, seed=0, train=True):
        patterns = torch.rand(10, 1, 7, 7, generator=torch.Generator().manual_seed(3 * seed)) > 0.5
        patterns = patterns.float().repeat_interleave(4, dim=2).repeat_interleave(4, dim=3) * 2 - 1
        g = torch.Generator().manual_seed(3 * seed + 1 + int(train))  # its own stream per split
        self.targets = torch.randint(0, 10, (size,), generator=g)
        shifts = torch.randint(-3, 4, (size, 2), generator=g).tolist()
        images = torch.stack([patterns[t].roll(s, dims=(1, 2)) for t, s in zip(self.targets.tolist(), shifts)])
        contrast = 0.5 + torch.rand(size, 1, 1, 1, generator=g)
        self.images = images * contrast + 1.5 * torch.randn(images.shape, generator=g)

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, index):
        return self.images[index], int(self.targets[index])


class ShardSampler(Sampler):
    """Rank r of W takes the indices r, r + W, r + 2W, ...: every sample exactly once.

    DistributedSampler pads the data set with duplicates to a multiple of W (10 samples
    over 3 ranks gives 12), which is right for training and wrong for a test accuracy.
    """

    def __init__(self, size, rank, world_size):
        self.indices = range(rank, size, world_size)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def mnist_available(root):
    """True when MNIST's four files are in root/MNIST/raw (where torchvision reads them), or download there."""
    # imported here, not at the top: torchvision adds about 1.7 s of CPU to the start of every
    # process (measured on 2 cores), and the synthetic data needs none of it
    import torchvision
    raw = os.path.join(root, "MNIST", "raw")
    if all(os.path.isfile(os.path.join(raw, name.removesuffix(".gz")))
           for name, _ in torchvision.datasets.MNIST.resources):
        return True
    # no network often fails at once; a network that drops packets must not hang the job
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(20)
    try:
        torchvision.datasets.MNIST(root, train=True, download=True)
        torchvision.datasets.MNIST(root, train=False, download=True)
        return True
    except Exception as e:  # any failure to download means "not available", never a crash
        say(f"MNIST download failed: {str(e).strip().splitlines()[-1]}")
        return False
    finally:
        socket.setdefaulttimeout(previous)


def choose_dataset(args, device):
    """'mnist' or 'synthetic'. Only global rank 0 looks for (and downloads) MNIST; the rest wait for its answer."""
    found = torch.zeros(1, dtype=torch.long, device=device)
    if dist.get_rank() == 0 and args.dataset != "synthetic":
        found[0] = int(mnist_available(args.data))
    dist.broadcast(found, src=0)  # the barrier: nobody reads the folder before rank 0 has filled it
    if found.item():
        return "mnist"
    if args.dataset == "mnist":
        if dist.get_rank() == 0:
            fail(f"MNIST is not in {args.data}/MNIST/raw and could not be downloaded",
                 "use --dataset synthetic for the offline stand-in, or copy MNIST there")
        time.sleep(3)  # the launcher stops every rank when one exits: let rank 0 say why first
        sys.exit(2)
    return "synthetic"


def load_datasets(args):
    """The (train, test) sets of args.dataset, cut to --train_samples / --test_samples."""
    if args.dataset == "mnist":
        import torchvision  # see mnist_available

        to_tensor = torchvision.transforms.Compose([
            torchvision.transforms.ToTensor(),
            torchvision.transforms.Normalize((0.1307,), (0.3081,)),  # MNIST's mean and std
        ])
        sets = [torchvision.datasets.MNIST(args.data, train=train, transform=to_tensor) for train in (True, False)]
    else:
        sets = [SyntheticDigits(n, seed=args.seed, train=train)
                for n, train in ((args.train_samples or 6000, True), (args.test_samples or 1000, False))]
    sets = [Subset(s, range(n)) if n and n < len(s) else s
            for s, n in zip(sets, (args.train_samples, args.test_samples))]
    print0(f"data: {'MNIST from ' + args.data if args.dataset == 'mnist' else 'SYNTHETIC stand-in, not MNIST'} "
           f"| {len(sets[0])} train, {len(sets[1])} test samples")
    return sets


def make_loaders(train_set, test_set, device, args):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # worker seeds derive from this generator: one per rank, or rank r's worker k would
    # draw the same random numbers (augmentations) as worker k of every other rank
    generator = torch.Generator().manual_seed(args.seed + rank)
    common = {"batch_size": args.batch_size, "num_workers": args.workers,
              "pin_memory": device.type == "cuda", "persistent_workers": args.workers > 0}
    train_loader = DataLoader(train_set, sampler=DistributedSampler(train_set, shuffle=True, seed=args.seed),
                              generator=generator, **common)
    test_loader = DataLoader(test_set, sampler=ShardSampler(len(test_set), rank, world_size), **common)
    return train_loader, test_loader


# ---------------------------------------------------------------- model
class ConvNet(nn.Module):
    """The seed's model: two conv blocks (conv, BatchNorm, ReLU, max-pool), then a linear layer."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.layer1 = nn.Sequential(nn.Conv2d(1, 16, kernel_size=5, stride=1, padding=2),
                                    nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(kernel_size=2, stride=2))
        self.layer2 = nn.Sequential(nn.Conv2d(16, 32, kernel_size=5, stride=1, padding=2),
                                    nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(kernel_size=2, stride=2))
        self.fc = nn.Linear(7 * 7 * 32, num_classes)

    def forward(self, x):
        out = self.layer2(self.layer1(x))
        return self.fc(out.reshape(out.size(0), -1))


def amp_choice(choice, device):
    """Resolve --amp auto to bf16, fp16 or off.

    On CPU auto means bf16 only where the CPU has bf16 instructions. Measured on the
    collection's 2-core test machine (AMD EPYC, avx512_bf16; one ConvNet training step,
    batch 32, one thread, median of interleaved runs): bf16 autocast 3110 samples/s
    against fp32 1947 (1.6x); the whole 2-process default run went 1.25x faster. With
    oneDNN held to the same CPU's instructions without bf16 (ONEDNN_MAX_CPU_ISA=AVX512_CORE)
    bf16 fell to 0.8x of fp32, and to 0.2x with AVX2: there autocast only costs precision.
    """
    if choice != "auto":
        return choice
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}  # older torch: off
    return "bf16" if caps.get("avx512_bf16") or caps.get("amx_bf16") else "off"


def autocast(device, amp):
    """Mixed precision for the forward pass (and the loss); a no-op with --amp off."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp)
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


# ---------------------------------------------------------------- train / evaluate
def on_device(loader, device):
    """The loader's batches on `device`; from pinned memory the copy does not block the host."""
    for images, labels in loader:
        yield (images.to(device, non_blocking=device.type == "cuda"),
               labels.to(device, non_blocking=device.type == "cuda"))


def train_one_epoch(model, loader, optimizer, scaler, amp, device):
    """One pass over this rank's shard; returns the global [sum of losses, samples]."""
    model.train()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for images, labels in on_device(loader, device):
        with autocast(device, amp):
            loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # DDP all-reduces (averages) the gradients here
        scaler.step(optimizer)  # with fp16, skips the step when the scaled gradients overflowed
        scaler.update()
        totals[0] += loss.detach().double() * len(labels)
        totals[1] += len(labels)
    dist.all_reduce(totals)
    return totals


@torch.no_grad()
def evaluate(model, loader, amp, device):
    """Exact test loss and accuracy over all ranks; `model` is the unwrapped module.

    DDP's forward may run collectives (buffer broadcast), and the shards differ in
    length by one, so a rank with one batch more would wait forever: evaluate the
    plain module and reduce [loss sum, correct, count] once, after the loop.
    """
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for images, labels in on_device(loader, device):
        with autocast(device, amp):
            outputs = model(images)
        totals[0] += F.cross_entropy(outputs.float(), labels, reduction="sum").double()
        totals[1] += (outputs.argmax(dim=1) == labels).sum()
        totals[2] += len(labels)
    dist.all_reduce(totals)
    count = int(totals[2].item())
    return {"test_samples": count, "test_loss": (totals[0] / count).item(),
            "test_accuracy": (totals[1] / count).item()}


def sync_buffers(model):
    """Give every rank rank 0's BatchNorm statistics.

    DDP broadcasts buffers at the start of each forward, so after the last step every
    rank holds statistics updated by its own last batch. Rank 0's are the ones saved.
    """
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)


def save_checkpoint(state, path):
    """Write to a temporary file, then rename: a crash mid-write leaves the previous file intact."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)  # atomic on POSIX
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_checkpoint(path, device):
    """Read a checkpoint as data only: a bad file is one clear error, not a traceback per rank."""
    try:
        # weights_only: tensors and plain values; a pickled object is refused before it can run
        return torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as e:
        reason = next((line.strip() for line in str(e).splitlines() if "unsupported" in line.lower()),
                      "not plain data")
        fail(f"{path} holds pickled Python objects and was refused unread ({reason})",
             "load only checkpoints this script wrote; delete it to start afresh")
    except (OSError, RuntimeError, EOFError, ValueError) as e:
        fail(f"cannot read checkpoint {path} ({type(e).__name__}: {str(e).strip().split('. ')[0][:100]})",
             "it is unreadable or truncated; delete it to start afresh")


def check_compatible(state, model, path):
    """A checkpoint of another model or configuration: say what differs, in one line."""
    mine = model.state_dict()
    if not isinstance(state, dict) or set(state) != set(mine):
        theirs = set(state) if isinstance(state, dict) else set()
        fail(f"{path} is for another model (missing {sorted(set(mine) - theirs)[:3]}, "
             f"unexpected {sorted(theirs - set(mine))[:3]})", "delete it, or use the configuration that wrote it")
    for name, tensor in mine.items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            fail(f"{path} is for another configuration: {name} is {tuple(state[name].shape)} there, "
                 f"{tuple(tensor.shape)} here", "delete it, or use the configuration that wrote it")


def read_checkpoint(path):
    """Read and check a checkpoint before any process starts: a bad one is one error line."""
    checkpoint = load_checkpoint(path, "cpu")
    if not isinstance(checkpoint, dict) or not {"model", "optimizer", "scaler", "epoch", "args"} <= set(checkpoint):
        fail(f"{path} is not a checkpoint of this script", "point --checkpoint at one it wrote")
    check_compatible(checkpoint["model"], ConvNet(), path)
    return checkpoint


def write_checkpoint(model, optimizer, scaler, epoch, args):
    """Rank 0 writes; every rank waits until the file is complete."""
    if dist.get_rank() == 0:
        save_checkpoint({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                         "scaler": scaler.state_dict(), "epoch": epoch,
                         "args": dict(vars(args))},  # plain values only, so weights_only loading works
                        args.checkpoint)
    dist.barrier()


def restore_checkpoint(model, optimizer, scaler, device, args):
    """Restore model, optimizer and grad scaler; returns the epochs already trained."""
    checkpoint = load_checkpoint(args.checkpoint, device)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    if checkpoint["scaler"] and scaler.is_enabled():  # a disabled scaler saves {}: a switch to fp16 starts afresh
        scaler.load_state_dict(checkpoint["scaler"])
    trained_on = checkpoint["args"]["dataset"]
    print0(f"loaded {args.checkpoint} (epoch {checkpoint['epoch']}, trained on {trained_on})"
           + ("" if trained_on == args.dataset else f" -- NOTE: this run uses {args.dataset}"))
    return checkpoint["epoch"]


def fit(ddp, train_loader, optimizer, scaler, start_epoch, device, args):
    """Train epochs start_epoch+1 .. args.epochs, saving a checkpoint after each; one record per epoch."""
    history = []
    for epoch in range(start_epoch, args.epochs):
        train_loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        start = time.perf_counter()
        loss_sum, samples = train_one_epoch(ddp, train_loader, optimizer, scaler, args.amp, device).tolist()
        seconds = time.perf_counter() - start
        write_checkpoint(ddp.module, optimizer, scaler, epoch + 1, args)
        history.append({"loss": loss_sum / samples, "samples": samples, "seconds": seconds})
        print0(f"epoch {epoch + 1}/{args.epochs} | loss {loss_sum / samples:.4f} | "
               f"{samples / seconds:.0f} samples/s | {seconds:.1f} s | checkpoint {args.checkpoint}")
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


def report(history, elapsed, start_epoch, train_loader, in_sync, result, device, args):
    """Rank 0 writes the metrics (--metrics) and prints the `done:` line."""
    samples = sum(h["samples"] for h in history)
    losses = [h["loss"] for h in history]
    steps_per_epoch = len(train_loader)
    summary = {
        "script": os.path.basename(__file__), "world_size": dist.get_world_size(),
        "backend": dist.get_backend(), "device": device.type, "torch": torch.__version__,
        "dataset": args.dataset, "train_samples": len(train_loader.dataset),
        "epochs": start_epoch + len(history), "steps": len(history) * steps_per_epoch,
        "steps_per_epoch": steps_per_epoch, "batch_size": args.batch_size, "elapsed_s": elapsed,
        "samples_per_s": samples / elapsed if samples else None,
        "first_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None,
        "losses": losses, "replicas_in_sync": in_sync, "resumed_from_epoch": start_epoch,
        "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        "amp": args.amp, "sync_bn": device.type == "cuda", **result,
    }
    if dist.get_rank() == 0 and args.metrics:
        write_json(args.metrics, summary)
    trained = (f"loss {losses[0]:.4f} -> {losses[-1]:.4f} | {summary['samples_per_s']:.0f} samples/s"
               if losses else "not trained")
    print0(f"done: {summary['script']} | {summary['world_size']} x {device.type} ({summary['backend']}) "
           f"| torch {torch.__version__} | {args.dataset} | epoch {summary['epochs']} | {trained} | "
           f"test accuracy {100 * result['test_accuracy']:.2f}% | replicas {'in sync' if in_sync else 'DIFFER'}")


# ---------------------------------------------------------------- main
def train(device, args):
    torch.manual_seed(args.seed)
    args.dataset = choose_dataset(args, device)
    args.amp = amp_choice(args.amp, device)
    train_loader, test_loader = make_loaders(*load_datasets(args), device, args)
    model = ConvNet().to(device)
    if device.type == "cuda":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # BatchNorm statistics over the global batch
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")  # bf16 has fp32's range
    start_epoch = restore_checkpoint(model, optimizer, scaler, device, args) if args.resume or args.evaluate else 0
    print0(f"world {dist.get_world_size()} x {device.type} ({dist.get_backend()}) | amp {args.amp} "
           f"| batch {args.batch_size} per process | {len(train_loader)} steps per epoch")

    # built before the clock starts: DDP's constructor waits for the slowest rank to arrive
    ddp = None if args.evaluate else DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    start = time.perf_counter()
    history = [] if args.evaluate else fit(ddp, train_loader, optimizer, scaler, start_epoch, device, args)
    elapsed = time.perf_counter() - start
    in_sync = replicas_in_sync(model, device)
    sync_buffers(model)
    result = evaluate(model, test_loader, args.amp, device)
    print0(f"test: {result['test_samples']} samples | loss {result['test_loss']:.4f} | "
           f"accuracy {100 * result['test_accuracy']:.2f}%")
    report(history, elapsed, start_epoch, train_loader, in_sync, result, device, args)
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
