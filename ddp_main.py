"""An MNIST ConvNet trained with DDP, one process per GPU, launched with `mp.spawn`.

Scenario: the seed's `ConvNet` (two conv blocks with BatchNorm, then a linear layer)
learns MNIST with mixed precision (`torch.amp`; by default bf16 on GPUs that have it
natively, fp16 with a GradScaler on older GPUs, fp32 on CPUs), SyncBatchNorm on GPUs, a
`DistributedSampler` for training and an exact distributed evaluation: every test
sample is counted once, whatever the world size. Global rank 0 downloads the data
(the others wait) and writes a checkpoint each epoch that `--resume -e 6` continues to
epoch 6, `--evaluate` only evaluates (per class too), and `--predict IMAGE...` uses to classify
new images in one process: it carries the classes, the normalisation and the input shape
(docs/own_images.md has the same in plain Python). `--data DIR` also takes your own images in
ImageFolder's layout (DIR/train/<class>/*, DIR/test/<class>/*): the classes, channels and
image size come from the data (docs/own_images.md). Without MNIST in the default ./data
and no network an offline stand-in with MNIST's shapes is used, and the script says so; a
`--data` you typed that holds no data is an error; `--dataset synthetic` never touches
the network. `--gpu 0,1` counts the GPUs this process sees: under
CUDA_VISIBLE_DEVICES=4,5,6,7 (SLURM, containers) it means 4 and 5.

One script, two launches. ddp_main.py starts one process per GPU itself: mp.spawn passes each its
rank, and the script sets the environment torchrun would set. ddp_main_torchrun.py is started by
torchrun, which sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (env://), so it also
runs across nodes (then `--data` and `--checkpoint` must be on a file system every node sees), by hand,
or as one plain `python` process; restarted by torchrun (`--max-restarts`) it resumes from
`--checkpoint`. Their lessons differ in the launch, nothing else. ddp_gpus.py and ddp_gpus_torchrun.py
are the same two launches for a linear model without data, AMP or evaluation.

Launch:
    python ddp_main.py --gpu 0,1 -e 3 -b 32          # GPUs 0 and 1, one process each, NCCL
    python ddp_main.py                               # every visible GPU; on CPU 2 processes
    CUDA_VISIBLE_DEVICES= python ddp_main.py --device cpu --nprocs 2   # CPU only, gloo

Over the seed this fixes: defaults that learn at any world size (Adam at 1e-3, the seed's SGD at 1e-4
barely moves; at least 60 steps per process), `torch.amp` instead of the deprecated `torch.cuda.amp`,
RANK equal to the global rank, a test accuracy over exactly the test set (DistributedSampler pads
duplicates in), no deadlocking rank-0-only evaluation, one download instead of one per process, a
checkpoint without the `module.` prefix that loads with `weights_only=True`, a free port instead of a
hard-coded one, and a CPU path. Three parts: the lesson (every DDP call), then beyond it what a learner
may skip (the stand-in data, the data files, own-image checks, --predict, --gpu), then the harness: the
robustness every script shares (errors, ports, timeouts, Ctrl-C, the replica check, checkpoint files).
"""

# ---------------------------------------------------------------- imports
import argparse
import inspect
import math
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

DEFAULT_EPOCHS, MIN_STEPS = 3, 60  # 3 epochs, or more where an epoch is short (a large world)
DEFAULT_DATA = "./data"


# ---------------------------------------------------------------- arguments
def parse_args(argv=None):
    p = Arguments(description=__doc__.split("\n\n")[0])
    add_training_args(p)
    add_data_args(p)
    add_job_args(p)
    add_own_image_args(p)  # --max_pixels, --predict: beyond the lesson
    add_gpu_args(p)  # --gpu: beyond the lesson
    p.add_argument("--nprocs", type=int, default=None, metavar="N",
                   help="processes to start (default: the visible GPUs on CUDA, 2 on CPU)")
    return p.parse_args(argv)


def add_training_args(p):
    p.add_argument("--epochs", "--max_epochs", "-e", type=int, default=None, metavar="N",
                   help=f"epochs to train, with --resume the epoch to end at (default: {DEFAULT_EPOCHS}, or "
                        f"more where that gives fewer than {MIN_STEPS} steps per process (a large world)")
    p.add_argument("--batch_size", "--batch-size", "-b", type=int, default=32, metavar="N",
                   help="samples per step, per process (the global batch is N x world size)")
    p.add_argument("--lr", type=float, default=1e-3, metavar="LR", help="Adam learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed for the data order and the initial weights")
    p.add_argument("--amp", choices=["auto", "bf16", "fp16", "off"], default="auto",
                   help="mixed precision; auto (the same rule in every script of the collection): bf16 on a GPU "
                        "that computes it natively (CUDA from Ampere on), else fp16 with a GradScaler; off "
                        "(fp32) on CPUs, where what bf16 gains depends on the model: pass --amp bf16 to try it")


def add_data_args(p):
    p.add_argument("--data", default=None, metavar="DIR",
                   help=f"your data, one of two layouts: MNIST's IDX files in DIR/MNIST/raw, or an image folder "
                        "(torchvision's ImageFolder): DIR/train/<class>/* and DIR/test/<class>/* (or DIR/val), one "
                        "subfolder per class, every image of one size and mode (L, RGB or RGBA). Classes, channels "
                        "and size come from the data, the normalisation from the training split. A DIR that holds "
                        f"neither is an error. Not given: {DEFAULT_DATA}, where MNIST is downloaded if missing")
    p.add_argument("--dataset", choices=["auto", "mnist", "synthetic"], default="auto",
                   help=f"auto: what --data holds; without --data, MNIST in {DEFAULT_DATA} (downloaded if "
                        "missing), else the offline synthetic stand-in; mnist: download MNIST into --data if missing")
    p.add_argument("--train_samples", type=int, default=None, metavar="N",
                   help="use the first N training samples, of an image folder N spread evenly over "
                        "its classes (default: all of them; 6000 synthetic)")
    p.add_argument("--test_samples", type=int, default=None, metavar="N",
                   help="use the first N test samples, of an image folder N spread evenly (default: "
                        "all of them; 1000 synthetic)")
    p.add_argument("--workers", type=int, default=0, metavar="N",
                   help="DataLoader worker processes, per process (0: load in the training process)")


def add_job_args(p):
    p.add_argument("--device", default="auto", metavar="auto|cpu|TYPE",
                   help="auto: the accelerator torch finds (cuda, xpu, hpu, npu, ...), else cpu")
    p.add_argument("--backend", default="auto", metavar="auto|NAME",
                   help="auto: the device's default (nccl on cuda, xccl on xpu, hccl on hpu/npu, gloo on cpu)")
    p.add_argument("--checkpoint", default="ddp_checkpoint.pt", metavar="PATH",
                   help="checkpoint written by rank 0 after every epoch")
    p.add_argument("--resume", action="store_true", help="continue training from --checkpoint")
    p.add_argument("--evaluate", action="store_true", help="only evaluate --checkpoint on the test set")
    p.add_argument("--timeout", type=float, default=300, metavar="SECONDS",
                   help="how long a collective waits for the other ranks before failing")
    p.add_argument("--metrics", default=None, metavar="PATH",
                   help="write a JSON summary of the run here (rank 0)")


def check_args(args):
    """Bad input is one error line and exit code 2, found before any process group is joined."""
    if args.predict:  # one process and no process group: nothing below applies
        sys.exit(predict(args.checkpoint, args.predict))
    check_positive(args, "epochs", "batch_size", "lr", "timeout", "train_samples", "test_samples", "max_pixels")
    if args.workers < 0:
        fail(f"{spelled('workers')} must be 0 or more, got {args.workers}", f"pass {spelled('workers')} 0")
    check_data(args)  # first: a mistyped --data is named before anything about a checkpoint
    if (args.resume or args.evaluate) and not os.path.isfile(args.checkpoint):
        fail(f"no checkpoint at {args.checkpoint} to {'evaluate' if args.evaluate else 'resume'}",
             "train first, or point --checkpoint at one", every_node=True)  # this machine's files
    check_folders(args.checkpoint, args.metrics)
    if not args.evaluate:  # another run's checkpoint is continued only with --resume; overwritten never unasked
        args.resume = continue_checkpoint(args.checkpoint, args.resume)
    select_gpus_and_device(args)  # --gpu (beyond the lesson), then --device and --backend made concrete
    check_launch(args)
    if args.device == "cpu" and args.amp == "fp16":
        print0("note: --amp fp16 on CPU runs far slower than fp32 or bf16 (few CPU kernels are fast in fp16)")
    if args.device == "cpu" and not args.evaluate:
        # torch refuses SyncBatchNorm on CPU ("SyncBatchNorm layers only work with GPU modules")
        print0("note: SyncBatchNorm needs CUDA (or xpu, hpu, npu); on CPU each rank keeps its own BatchNorm statistics")
    return args


def check_launch(args):
    """mp.spawn starts --nprocs processes on this machine: by default one per visible GPU, 2 on CPU."""
    gpus = torch.accelerator.device_count() if args.device != "cpu" else 0  # GPUs, or another accelerator's devices
    args.nprocs = (gpus if args.device != "cpu" else 2) if args.nprocs is None else args.nprocs
    check_positive(args, "nprocs")
    if args.device != "cpu" and args.nprocs > gpus:
        fail(f"{spelled('nprocs')} {args.nprocs} but only {gpus} {args.device} device(s) are visible",
             f"pass {spelled('nprocs')} {gpus} or fewer, or --device cpu")


# ---------------------------------------------------------------- process group
def setup(args):
    """Join the process group that the environment describes (env://); returns this process's device."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # a hand-made launch may set only RANK and WORLD_SIZE
    # the cores split between this machine's processes, on GPUs too (their loaders, their CPU work);
    # without LOCAL_WORLD_SIZE (a hand-made launch) every rank is taken to be on this machine
    use_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    if args.device != "cpu":  # cuda, or another accelerator torch reports (xpu, hpu, npu, ...)
        device = torch.device(args.device, local_rank)
        torch.accelerator.set_device_index(device)  # before any work on it: one GPU per process
    else:
        device = torch.device("cpu")
    # device_id: NCCL builds its communicator now, so a bad GPU or network fails here, not at step 1
    dist.init_process_group(args.backend, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=args.timeout),
                            device_id=device if args.backend == "nccl" else None)
    return device


def cleanup():
    free_error_frames()  # DDP's reducer goes before the group it talks through
    dist.destroy_process_group()


# ---------------------------------------------------------------- data
def choose_dataset(args, device):
    """'images', 'mnist' or 'synthetic'. Global rank 0 looks for (and downloads) MNIST while the rest wait;
    then the first process of every other machine looks in its own --data: MNIST only if every machine has
    it (rank 0's answer alone would send a machine without the files into torchvision's "Dataset not found")."""
    if args.image_folder:
        return "images"  # found and checked by check_data, on every node
    found = torch.zeros(1, dtype=torch.long, device=device)
    if dist.get_rank() == 0 and args.dataset != "synthetic":
        found[0] = int(mnist_available(args.data or DEFAULT_DATA))
    dist.broadcast(found, src=0)  # the barrier: nobody reads the folder before rank 0 has filled it
    if found.item() and dist.get_rank() != 0 and int(os.environ.get("LOCAL_RANK", 0)) == 0:
        found[0] = int(mnist_available(args.data or DEFAULT_DATA))  # a shared file system: there already, no download
    dist.all_reduce(found, op=dist.ReduceOp.MIN)
    if found.item():
        return "mnist"
    if args.dataset == "mnist":
        fail(f"MNIST is not in {args.data or DEFAULT_DATA}/MNIST/raw and could not be downloaded",
             "use --dataset synthetic for the offline stand-in, or copy MNIST there")
    return "synthetic"


def load_datasets(args):
    """The (train, test) sets of args.dataset, cut to --train_samples / --test_samples, and what they are."""
    if args.dataset == "synthetic":
        sets = [SyntheticDigits(n, seed=args.seed, train=train)
                for n, train in ((args.train_samples or 6000, True), (args.test_samples or 1000, False))]
        info = {"kind": "synthetic", "classes": [str(c) for c in range(10)], "shape": [1, 28, 28],
                "mean": [0.0], "std": [1.0], "name": "SYNTHETIC stand-in, not MNIST",
                "normalization": "none (the stand-in is centred)"}
    else:
        *sets, info = folder_sets(args)
        args.dataset = info["kind"]
    # an image folder lists its files class by class: its first N would be the first classes only
    spread = args.dataset == "images"
    sets = [Subset(s, torch.linspace(0, len(s) - 1, n).long().tolist() if spread else range(n))
            if n and n < len(s) else s for s, n in zip(sets, (args.train_samples, args.test_samples))]
    where = "" if args.dataset == "synthetic" else f" from {args.data or DEFAULT_DATA}"
    print0(f"data: {info['name']}{where} | {len(sets[0])} train, {len(sets[1])} test samples | "
           f"classes: {listed(info['classes'])} | normalised: {info['normalization']}")
    return sets, info


def make_loaders(train_set, test_set, device, args):
    """Training: a reshuffled 1/world of the data per rank. Test: every sample once over all ranks."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # worker seeds derive from this generator: one per rank, or rank r's worker k would
    # draw the same random numbers (augmentations) as worker k of every other rank
    generator = torch.Generator().manual_seed(args.seed + rank)
    common = {"batch_size": args.batch_size, "num_workers": args.workers,
              "pin_memory": device.type != "cpu", "persistent_workers": args.workers > 0}
    train_loader = DataLoader(train_set, sampler=DistributedSampler(train_set, shuffle=True, seed=args.seed),
                              generator=generator, **common)
    # rank r of W tests the samples r, r + W, r + 2W, ...: every one exactly once. A range is a sampler
    # (any iterable with a length is). DistributedSampler would pad the set with duplicates to a
    # multiple of W (10 samples over 3 ranks gives 12): right for training, wrong for an accuracy.
    test_loader = DataLoader(test_set, sampler=range(rank, len(test_set), world_size), **common)
    return train_loader, test_loader
# ---------------------------------------------------------------- model
class ConvNet(nn.Module):
    """The seed's model: two conv blocks (conv, BatchNorm, ReLU, max-pool), then a linear layer.

    For images of any size (4 x 4 and up) and channels: an adaptive pooling brings the feature map to the
    7 x 7 of a 28 x 28 image, so the linear layer keeps the seed's shape. On 28 x 28 images it changes
    nothing, and a checkpoint of the fixed-size model loads as it was."""

    def __init__(self, num_classes=10, channels=1):
        super().__init__()
        self.layer1 = nn.Sequential(nn.Conv2d(channels, 16, kernel_size=5, stride=1, padding=2),
                                    nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(kernel_size=2, stride=2))
        self.layer2 = nn.Sequential(nn.Conv2d(16, 32, kernel_size=5, stride=1, padding=2),
                                    nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(kernel_size=2, stride=2))
        self.pool = nn.AdaptiveAvgPool2d(7)
        self.fc = nn.Linear(7 * 7 * 32, num_classes)

    def forward(self, x):
        out = self.pool(self.layer2(self.layer1(x)))
        return self.fc(out.reshape(out.size(0), -1))


def amp_choice(choice, device):
    """Resolve --amp auto to bf16, fp16 or off, for this process's device (after set_device).

    On a GPU bf16 only where it computes in it (Ampere and later on CUDA): torch also reports emulated
    bf16 on older GPUs, which is slow, so there fp16 with a GradScaler. On CPU fp32, as in every script of
    the collection (ddp_transformer.py too): what bf16 gains there depends on the model. Measured on the
    collection's 2-core test machine (AMD EPYC, avx512_bf16; one ConvNet training step, batch 32, one thread,
    median of interleaved runs): bf16 autocast 3110 samples/s against fp32 1947 (1.6x), so `--amp bf16` pays
    for this ConvNet there; the Transformer ran no faster in bf16 on the same CPU. With oneDNN held to the
    instructions without bf16 (ONEDNN_MAX_CPU_ISA=AVX512_CORE) bf16 fell to 0.8x of fp32, and to 0.2x with
    AVX2: there autocast only costs precision.
    """
    if choice != "auto":
        return choice
    if device.type == "cpu":
        return "off"
    # the device's own check (torch.cuda.is_bf16_supported(including_emulation=False) on CUDA): bf16 if so, else
    # fp16 with a GradScaler. Agreed by every rank (a job over two kinds of GPU): a rank in fp16 would hand DDP
    # gradients scaled by its GradScaler, to be averaged with another rank's unscaled bf16 ones
    native = torch.tensor([int(bf16_supported(device))], device=device)
    dist.all_reduce(native, op=dist.ReduceOp.MIN)
    return "bf16" if native.item() else "fp16"  # fp16 with a GradScaler


def autocast(device, amp):
    """Mixed precision for the forward pass (and the loss); a no-op with --amp off."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp)
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


# ---------------------------------------------------------------- train / evaluate
def on_device(loader, device):
    """The loader's batches on `device`; from pinned memory the copy does not block the host."""
    for images, labels in loader:
        yield (images.to(device, non_blocking=device.type != "cpu"),
               labels.to(device, non_blocking=device.type != "cpu"))


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

    DDP's forward may run collectives (buffer broadcast), and the shards differ in length by one, so a
    rank with one batch more would wait forever: evaluate the plain module and reduce [loss sum, correct,
    count] once, after the loop."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    per_class = torch.zeros(2, model.fc.out_features, dtype=torch.float64, device=device)  # [correct, count]
    for images, labels in on_device(loader, device):
        with autocast(device, amp):
            outputs = model(images)
        correct = outputs.argmax(dim=1) == labels
        totals[0] += F.cross_entropy(outputs.float(), labels, reduction="sum").double()
        totals[1] += correct.sum()
        totals[2] += len(labels)
        per_class[0].index_add_(0, labels, correct.double())
        per_class[1].index_add_(0, labels, torch.ones_like(labels, dtype=torch.float64))
    dist.all_reduce(totals)
    dist.all_reduce(per_class)
    count = int(totals[2].item())
    return {"test_samples": count, "test_loss": (totals[0] / count).item(),
            "test_accuracy": (totals[1] / count).item(), "per_class": per_class.long().tolist()}


def sync_buffers(model):
    """Give every rank rank 0's BatchNorm statistics, the ones saved. Without SyncBatchNorm (the CPU) each
    rank's statistics follow its own batches, and DDP was told not to broadcast them every step."""
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)


def no_buffer_broadcast():
    """DDP's option for no buffer broadcast before every forward: forward_sync_buffers=False from torch
    2.13, which deprecates broadcast_buffers=False (a FutureWarning from every rank); older torch knows
    only broadcast_buffers. (The new flag still broadcasts the buffers once, when DDP is built: the
    same values here, every rank's model being built from one seed or one checkpoint.)"""
    if "forward_sync_buffers" in inspect.signature(DDP).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def write_checkpoint(model, optimizer, scaler, epoch, args, data):
    """Rank 0 writes (atomically); every rank waits until the file is complete. Its "data" is what using the model
    needs, so the file alone classifies new images (--predict, docs/own_images.md): the classes in index order,
    the training split's per-channel mean and std, the input shape [channels, height, width] and the data's kind
    ("images", "mnist", "idx", "synthetic")."""
    if dist.get_rank() == 0:
        card = {key: data[key] for key in ("kind", "classes", "mean", "std", "shape")}
        save_checkpoint({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                         "scaler": scaler.state_dict(), "epoch": epoch, "data": card,
                         # plain values only, so weights_only loading works: not an image folder's datasets
                         "args": {**vars(args), "image_folder": None}},
                        args.checkpoint)
    dist.barrier()


def restore_checkpoint(model, optimizer, scaler, train_loader, args, classes):
    """Restore model, optimizer and grad scaler from --checkpoint; returns the epochs already trained."""
    # read once, onto the CPU: load_state_dict moves each tensor where its parameter lives
    checkpoint = load_checkpoint(args.checkpoint, ("model", "optimizer", "scaler", "epoch", "args"), model)
    if not isinstance(checkpoint["args"], dict) or not isinstance(checkpoint["scaler"], dict) or \
            type(checkpoint["epoch"]) is not int or not 0 <= checkpoint["epoch"] < 2 ** 31:
        fail(f"{args.checkpoint} is not a checkpoint of this script (its args, scaler or epoch is not one)",
             "delete it to start afresh", every_node=True)
    card = checkpoint.get("data")  # None in a checkpoint written before it carried its data card
    theirs = card.get("classes", classes) if isinstance(card, dict) else classes
    if theirs != classes:  # as many classes, other names or order: every output would mean another class
        theirs = [str(name)[:40] for name in theirs] if isinstance(theirs, list) else [repr(theirs)[:40]]
        fail(f"{args.checkpoint} was trained on the classes {listed(theirs)}, this data has {listed(classes)}",
             "use the data it was trained on, or another --checkpoint to start afresh")
    check_optimizer_state(args.checkpoint, checkpoint["optimizer"], optimizer)  # before the optimizer sees it
    try:  # the weights are in the model already: load_checkpoint loaded them
        optimizer.load_state_dict(checkpoint["optimizer"])
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        fail(f"{args.checkpoint} holds another optimizer's state ({type(e).__name__}: {str(e)[:100]})",
             "delete it to start afresh", every_node=True)
    if checkpoint["scaler"] and scaler.is_enabled():  # a disabled scaler saves {}: a switch to fp16 starts afresh
        scaler.load_state_dict(checkpoint["scaler"])
    if not args.evaluate:  # one line, if the world size changed
        note_world_change(checkpoint, len(train_loader), args.batch_size)
    trained_on = checkpoint["args"].get("dataset")
    print0(f"loaded {args.checkpoint} (epoch {checkpoint['epoch']}, trained on {shown(trained_on)})"
           + ("" if trained_on == args.dataset else f" -- NOTE: this run uses {args.dataset}"))
    return checkpoint["epoch"]


# ---------------------------------------------------------------- main
def starting_epoch(model, optimizer, scaler, train_loader, args, classes):
    """The epoch this run starts at: the checkpoint's when resuming or evaluating, else 0."""
    start = restore_checkpoint(model, optimizer, scaler, train_loader, args, classes) \
        if args.resume or args.evaluate else 0
    # on every rank, resumed or not: a rank that found no checkpoint (a node-local path after a torchrun
    # restart) or another one would train other epochs, and would skip a collective only resumers reached
    check_same_on_every_rank(start, "checkpoint epochs (0: none found)",
                             f"put {args.checkpoint} on a file system every node sees")
    if not args.evaluate:
        say_if_nothing_left(args.checkpoint, "epoch", start, "--epochs", args.epochs)
    return start


def build_model(data, device):
    """The ConvNet for this data on this process's device, its BatchNorm synchronised where torch can."""
    model = ConvNet(len(data["classes"]), channels=data["shape"][0]).to(device)
    if device.type != "cpu":  # torch's SyncBatchNorm takes cuda, xpu, hpu and npu tensors, not CPU ones
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # BatchNorm statistics over the global batch
    return model


def train(device, args):
    """Build data, model and optimizer, train epoch by epoch (or only evaluate), test and report; True when the
    replicas agree."""
    torch.manual_seed(args.seed)
    args.dataset = choose_dataset(args, device)
    args.amp = amp_choice(args.amp, device)
    sets, data = load_datasets(args)
    train_loader, test_loader = make_loaders(*sets, device, args)
    # the world size sets the steps per epoch: a large world gets more epochs, not fewer steps
    args.epochs = args.epochs or max(DEFAULT_EPOCHS, math.ceil(MIN_STEPS / len(train_loader)))
    model = build_model(data, device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")  # bf16 has fp32's range
    start_epoch = starting_epoch(model, optimizer, scaler, train_loader, args, data["classes"])
    print0(f"world {plural(dist.get_world_size(), 'process')} on {device.type} ({dist.get_backend()}) | amp {args.amp} "
           f"| batch {args.batch_size} per process | {len(train_loader)} steps per epoch | "
           + (f"evaluating epoch {start_epoch}" if args.evaluate else plural(args.epochs, 'epoch')))
    # built before the clock starts: DDP's constructor waits for the slowest rank to arrive. no_buffer_broadcast:
    # by default DDP broadcasts rank 0's BatchNorm statistics before every forward, one more collective per step;
    # SyncBatchNorm keeps them equal on GPUs, and on CPU sync_buffers() hands rank 0's (the saved ones) to all.
    # ddp_group: None; under TORCH_DISTRIBUTED_DEBUG=DETAIL a group DDP can take (torch 2.14, 2.15 segfault on gloo's checked one)
    ddp = None if args.evaluate else DDP(model, device_ids=[device.index] if device.type != "cpu" else None,
                                         **no_buffer_broadcast(), process_group=ddp_group(args.timeout))
    history, start = [], time.perf_counter()
    for epoch in range(start_epoch, start_epoch if args.evaluate else args.epochs):
        train_loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        epoch_start = time.perf_counter()
        loss_sum, samples = train_one_epoch(ddp, train_loader, optimizer, scaler, args.amp, device).tolist()
        seconds = time.perf_counter() - epoch_start
        sync_buffers(model)  # rank 0's BatchNorm statistics on every rank: saved, evaluated, compared alike
        write_checkpoint(ddp.module, optimizer, scaler, epoch + 1, args, data)
        history.append({"loss": loss_sum / samples, "samples": samples, "seconds": seconds})
        print0(f"epoch {epoch + 1}/{args.epochs} | loss {loss_sum / samples:.4f} | "
               f"{samples / seconds:.0f} samples/s | {seconds:.1f} s | checkpoint {args.checkpoint}")
    elapsed = time.perf_counter() - start
    in_sync = replicas_in_sync(model, device)
    result = evaluate(model, test_loader, args.amp, device)
    report(history, elapsed, start_epoch, train_loader, in_sync, result, data, device, args)
    return in_sync


def report(history, elapsed, start_epoch, train_loader, in_sync, result, data, device, args):
    """Rank 0 prints the test result, writes the metrics (--metrics) and prints the `done:` line."""
    print0(f"test: {result['test_samples']} samples | loss {result['test_loss']:.4f} | "
           f"accuracy {100 * result['test_accuracy']:.2f}%")
    print0(per_class_line(result["per_class"], data["classes"]))
    result = {**result, "data": data["name"], "classes": len(data["classes"]), "image_shape": data["shape"]}
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
        "amp": args.amp, "sync_bn": device.type != "cpu", **result,
    }
    if dist.get_rank() == 0 and args.metrics:
        write_json(args.metrics, summary)
    trained = (f"loss {losses[0]:.4f} -> {losses[-1]:.4f} | {summary['samples_per_s']:.0f} samples/s"
               if losses else "not trained")
    print0(f"done: {summary['script']} | {plural(summary['world_size'], 'process')} on {device.type} "
           f"({summary['backend']}) | torch {torch.__version__} | {args.dataset} | epoch {summary['epochs']} | "
           f"{trained} | test accuracy {100 * result['test_accuracy']:.2f}% | "
           f"replicas {'in sync' if in_sync else 'DIFFER'}")


def main():
    """Check the arguments before any process starts, then start --nprocs processes and wait for them all."""
    args = check_args(parse_args())
    prepare_rendezvous(args, spawning=True)  # MASTER_ADDR, and a free MASTER_PORT unless one is set
    context = mp.spawn(run_rank, args=(args,), nprocs=args.nprocs, join=False)  # run_rank(rank, args) in each
    join_processes(context)  # the harness: a rank's exit as one line (its traceback once, a signal named)


def run_rank(rank, args):
    """One process of the job. mp.spawn passes its rank; the rest of the job is told as torchrun tells it."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.nprocs),
                      LOCAL_WORLD_SIZE=str(args.nprocs))  # every process is on this machine
    device = setup(args)
    try:
        with explained_failures(args.timeout, lambda: describe_checkpoint(args.checkpoint)):
            in_sync = train(device, args)
    except ImageRefused as e:  # as training reads it, in this process or a DataLoader worker
        fail(*e.args, every_rank=True)
    finally:
        cleanup()
    if not in_sync:
        sys.exit(1)  # the replicas differ: DDP did not keep them identical


# ---- beyond the lesson: the stand-in data, the data files, own-image checks, --predict, --gpu ----
import ast
import contextlib
import errno
import functools
import re
import socket
import stat

from torch.utils.data import Dataset

IMAGE_MODES = {"L": 1, "RGB": 3, "RGBA": 4}  # PIL mode -> channels; a palette (P) holds indices, not colours
DECODED = 20000  # images decoded whole before training (about 1 s of 48 x 48 PNGs); beyond, as training reads them
MAX_PIXELS = 50_000_000  # per image, on its header: 45-megapixel photos pass, 200 MB decoded (RGBA) at most
IMAGE_FORMATS = ("PNG", "JPEG", "PPM", "BMP", "TIFF", "WEBP")  # ImageFolder's suffixes: a .png holding EPS runs gs


def add_own_image_args(p):
    p.add_argument("--max_pixels", type=int, default=MAX_PIXELS, metavar="N",
                   help="an image folder's images may have at most N pixels each (width x height), read from "
                        "the header before the image is decoded")
    p.add_argument("--predict", nargs="+", default=None, metavar="IMAGE",
                   help="only classify these image files with --checkpoint: one process, no process group, "
                        "the training's preprocessing; prints `file -> class (probability)` per image")


def add_gpu_args(p):
    p.add_argument("--gpu", default=None, metavar="IDS",
                   help="GPUs to use, e.g. 0,1: indices into CUDA_VISIBLE_DEVICES when it is set, "
                        "else GPU numbers (default: every visible GPU)")


def select_gpus_and_device(args):
    """--gpu, then --device and --backend made concrete (resolve_device). --gpu sets CUDA_VISIBLE_DEVICES before
    the first CUDA call (CUDA reads it once), checked against the GPUs this process sees; on any device but
    CUDA it is ignored, with a note."""
    if args.gpu is not None and not re.fullmatch(r"\d+(,\d+)*", args.gpu):
        fail(f"{spelled('gpu')} {args.gpu!r} is not a list of GPU numbers", f"pass e.g. {spelled('gpu')} 0,1")
    if args.gpu is not None and args.device != "cpu":
        preset = os.environ.get("CUDA_VISIBLE_DEVICES")
        chosen = visible_gpus(args.gpu, preset)
        if chosen is None:
            fail(f"{spelled('gpu')} {args.gpu} but CUDA_VISIBLE_DEVICES={preset} shows {len(preset.split(','))} GPU(s)",
                 f"{spelled('gpu')} counts the visible GPUs from 0: pass smaller indices")
        os.environ["CUDA_VISIBLE_DEVICES"] = chosen
        # counted after the list is set (CUDA reads it once); CUDA stops at an index the machine lacks:
        # 0,5 on a 2-GPU machine shows 1 GPU, and training on it alone would go unsaid
        found, asked = torch.cuda.device_count(), len(chosen.split(",")) if chosen else 0
        if 0 < found < asked:
            fail(f"{spelled('gpu')} {args.gpu} but this machine has {found} of those GPUs", "pass the numbers of GPUs it has")
    resolve_device(args)
    if args.device != "cuda" and args.gpu is not None:  # it sets CUDA_VISIBLE_DEVICES, which only CUDA reads
        print0(f"note: --gpu {args.gpu} ignored on {'CPU' if args.device == 'cpu' else args.device}; "
               "the number of processes sets the world size")


def visible_gpus(ids, preset):
    """CUDA_VISIBLE_DEVICES for `--gpu ids`; None when an index is beyond the visible GPUs. A list already
    set (by SLURM, a container, the user) is indexed, not replaced: under 4,5,6,7, `--gpu 0,1` means 4,5.
    An empty one (no GPU visible) stays empty."""
    if not preset:
        return ids if preset is None else preset
    visible = [name.strip() for name in preset.split(",")]
    picked = [int(i) for i in ids.split(",")]
    return ",".join(visible[i] for i in picked) if max(picked) < len(visible) else None


class SyntheticDigits(Dataset):
    """An offline stand-in for MNIST: 1x28x28 images in 10 classes that a ConvNet can learn.

    Each class has a fixed random pattern of 4x4-pixel blocks; a sample is its class's pattern shifted
    by up to 3 pixels, with a random contrast, plus strong noise. The patterns come from `seed` alone,
    so the training and test splits share them, and every rank builds the same data set (the sampler
    shards indices, and indices only mean the same thing on every rank if the data does)."""

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


def mnist_files(root):
    """True when MNIST's four IDX files are in root/MNIST/raw, where torchvision reads them."""
    # imported here, not at the top: torchvision adds about 1.7 s of CPU to the start of every
    # process (measured on 2 cores), and the synthetic data needs none of it
    import torchvision
    raw = os.path.join(root, "MNIST", "raw")
    return all(os.path.isfile(os.path.join(raw, name.removesuffix(".gz")))
               for name, _ in torchvision.datasets.MNIST.resources)


def mnist_available(root):
    """True when MNIST's files are in root/MNIST/raw, or could be downloaded there."""
    if mnist_files(root):
        return True
    import torchvision
    # no network often fails at once; a network that drops packets must not hang the job
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(20)
    try:
        torchvision.datasets.MNIST(root, train=True, download=True)
        torchvision.datasets.MNIST(root, train=False, download=True)
        return True
    except Exception as e:  # any failure to download means "not available", never a crash
        print0(f"MNIST download failed: {str(e).strip().splitlines()[-1]}", every_rank=True)
        return False
    finally:
        socket.setdefaulttimeout(previous)


def check_data(args):
    """What --data holds, found before any process starts (so a typo is not trained on a stand-in):
    an image folder, checked image by image, sets args.image_folder; a path the user typed that
    holds neither layout is an error. MNIST is looked for (and downloaded) later, by rank 0."""
    args.image_folder = None
    root = args.data or DEFAULT_DATA
    if args.dataset == "auto" and os.path.isdir(os.path.join(root, "train")):
        args.image_folder = check_image_folder(root, args.max_pixels)
    elif args.dataset == "auto" and args.data is not None and not mnist_files(root):
        fail(f"{spelled('data')} {args.data} holds no data: neither an image folder ({os.path.join(args.data, 'train')}"
             f"/<class>/*) nor MNIST's IDX files ({os.path.join(args.data, 'MNIST', 'raw')})",
             "check the path; --dataset mnist downloads MNIST there, --dataset synthetic trains on "
             "the offline stand-in", every_node=True)


def check_image_folder(root, max_pixels):
    """An image folder's layout, checked: the classes (from train/), the test split (test/ or val/), and
    one size and mode for every image. Returns what the model and the data line need, with the two splits
    as ImageFolder datasets (the folder's one walk: training reads the files checked here), else one error line."""
    from torchvision.datasets.folder import IMG_EXTENSIONS, ImageFolder  # see mnist_files
    splits = [os.path.join(root, name) for name in ("train", "test", "val") if os.path.isdir(os.path.join(root, name))]
    if len(splits) < 2:
        fail(f"the image folder {root} has train/ but no test/ or val/", f"put held-out images of the same "
             f"classes in {os.path.join(root, 'test')}/<class>/*", every_node=True)
    check_no_linked_folder(splits[:2])
    bare = [folder for folder in splits[:2] if not any(entry.is_dir() for entry in os.scandir(folder))]
    if bare:  # ImageFolder's own error would be a traceback
        fail(f"{bare[0]} has no class folders", f"put the images of each class in {bare[0]}/<class>/", every_node=True)
    # ImageFolder's walk (one subfolder per class, searched to any depth), empty class folders kept to be named
    train, test = (ImageFolder(folder, loader=None, allow_empty=True) for folder in splits[:2])  # loader: below
    classes, tested = set(train.classes), set(test.classes)
    empty = [os.path.join(folder, c) for folder, split in zip(splits, (train, test))
             for c in sorted(set(split.classes) - {split.classes[t] for t in split.targets})]
    if empty:
        fail(f"empty class folder(s): {', '.join(empty[:3])}", f"put images ({', '.join(IMG_EXTENSIONS)}) in each "
             "class folder, or remove the empty ones", every_node=True)
    if tested - classes:
        fail(f"{splits[1]} has classes the training split lacks: {', '.join(sorted(tested - classes)[:5])}",
             "add training images of them, or remove them from the test split", every_node=True)
    if classes - tested:  # allowed (a small test split), but the accuracy then leaves them out
        missing = sorted(classes - tested)
        print0(f"note: {splits[1]} has no images of {listed(missing)} ({plural(len(missing), 'class')} of "
               f"{len(classes)}): the test accuracy leaves them out")
    inside = os.path.realpath(root)
    mode, (width, height) = image_format([path for split in (train, test) for path, _ in split.samples], inside,
                                         max_pixels)
    if mode not in IMAGE_MODES or min(width, height) < 4:
        fail(f"the images in {root} are {mode}, {width} x {height}", "convert them to L, RGB or RGBA, "
             "at least 4 x 4 pixels", every_node=True)
    # training reads each file again: one swapped in since is refused on opening or on its header
    train.loader = test.loader = functools.partial(read_image, expected=(mode, (width, height)), root=inside)
    shape = [IMAGE_MODES[mode], height, width]
    return {"kind": "images", "train": splits[0], "test": splits[1], "classes": train.classes, "shape": shape,
            "name": f"image folder of {len(classes)} classes, {' x '.join(map(str, shape))}",
            "sets": (train, test)}


def check_no_linked_folder(splits):
    """ImageFolder's walk follows links to folders, out of --data or round a loop (two links to a parent folder
    and it never ends): refused before it walks, the split folders and every folder below them."""
    for top in splits:
        below = (os.path.join(path, name) for path, names, _ in os.walk(top) for name in names)  # links not entered
        for folder in [top] if os.path.islink(top) else below:
            if os.path.islink(folder):
                fail(f"{folder} is a symbolic link to a folder", "put the folder itself there", every_node=True)


def image_format(files, root, max_pixels, most=DECODED):
    """The one (mode, size) of every image file in `root`, else one error line. Every header is read and
    checked (at most max_pixels pixels, the others' mode and size) before up to `most` files (evenly spread)
    are decoded whole, so a truncated or corrupt file is named now, not after an epoch; in a larger folder the
    others are decoded as training reads them (read_image names a bad one then)."""
    every = math.ceil(len(files) / most)
    if every > 1:
        print0(f"note: {len(files)} images: {len(range(0, len(files), every))} of them (evenly spread) decoded "
               "before training, the others as training reads them")
    found = {}
    try:
        for i, path in enumerate(files):
            with image_header(path, root) as image:
                if image.width * image.height > max_pixels:
                    fail(f"the image {path} is {image.width} x {image.height}, more than --max_pixels {max_pixels} "
                         "pixels", "shrink it, or pass a larger --max_pixels", every_node=True)
                found.setdefault((image.mode, image.size), path)
                if len(found) > 1:
                    (mode, size), first = next(iter(found.items()))
                    fail(f"the images differ in size or mode: {first} is {mode} {size[0]} x {size[1]}, {path} is "
                         f"{image.mode} {image.size[0]} x {image.size[1]}", "give them all one size and mode, "
                         "e.g. with PIL's Image.convert('RGB').resize((32, 32))", every_node=True)
                if i % every == 0:
                    image.load()
    except ImageRefused as e:
        fail(*e.args, every_node=True)
    return next(iter(found))


class ImageRefused(Exception):
    """An image file refused as it is read: the (what, fix) of its error line. From a DataLoader worker it
    reaches the training process rebuilt from the worker's traceback, whose last line ends with the repr of
    (what, fix), control characters escaped: read back from there."""
    def __init__(self, what, fix="remove or replace it"):
        if what.startswith("Caught ImageRefused"):
            what, fix = ast.literal_eval(what.rstrip("\n").rpartition("\n")[2].partition("ImageRefused: ")[2])
        super().__init__(what, fix)


@contextlib.contextmanager
def image_header(path, root=None):
    """PIL's image of the file at `path`, its header read; load() decodes it from the same descriptor, so what
    was checked is what is decoded, whatever is swapped in meanwhile. Opened once, without blocking (a FIFO
    would hang the run), a regular file only (not a FIFO, device or socket); in an image folder (`root`,
    resolved) never through a link: its target may change between a check and a read, or lie outside --data
    (a path typed for --predict may be one). Any problem, in the with block too, is an ImageRefused."""
    from PIL import Image
    Image.MAX_IMAGE_PIXELS = None  # the callers bound the pixels on the header; PIL's bound would warn first
    try:
        if root and os.path.commonpath([root, os.path.realpath(path)]) != root:
            raise ImageRefused(f"the image {path} is a symbolic link out of --data", "put the file itself there")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | (os.O_NOFOLLOW if root else 0))
        except OSError as e:  # O_NOFOLLOW's ELOOP: the file is a link
            raise ImageRefused(f"the image {path} is a symbolic link", "put the file itself there") \
                if e.errno == errno.ELOOP else e
        with os.fdopen(fd, "rb") as file:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ImageRefused(f"the image {path} is not a regular file (a FIFO, device or socket)")
            with Image.open(file, formats=IMAGE_FORMATS) as image:
                yield image
    except ImageRefused:
        raise
    except Exception as e:  # OSError (truncated, unreadable), SyntaxError (a broken PNG chunk), zlib.error, ...
        reason = f"not {'/'.join(IMAGE_FORMATS)}" if type(e).__name__ == "UnidentifiedImageError" else e  # not the fd
        raise ImageRefused(f"cannot read the image {path} ({type(e).__name__}: {reason})") from None


def read_image(path, expected, root=None):
    """ImageFolder's loader (and --predict's), keeping the image's mode (its own converts every image to RGB).
    The header must show `expected`, the (mode, size) the model takes, before the file is decoded: a file
    swapped in after the check costs no more than the images checked. A refused file is an ImageRefused."""
    with image_header(path, root) as image:
        if (image.mode, image.size) != expected:
            mode, (width, height) = expected
            raise ImageRefused(f"{path} is {image.mode} {image.size[0]} x {image.size[1]}, the model takes {mode} "
                               f"{width} x {height}", f"convert it, e.g. with PIL's Image.convert('{mode}')"
                               f".resize(({width}, {height}))")
        image.load()
        return image


def listed(names, most=10):
    """`a, b, c`; past `most` names, the first ones, `...` and the last, with the count."""
    if len(names) <= most:
        return ", ".join(names)
    return f"{', '.join(names[:most - 2])}, ..., {names[-1]} ({len(names)} in all)"


def normalization(dataset):
    """Per-channel mean and std of up to 2000 evenly spaced images of `dataset` (which yields tensors)."""
    picks = torch.linspace(0, len(dataset) - 1, min(len(dataset), 2000)).long().unique().tolist()
    images = torch.stack([dataset[i][0] for i in picks]).double()
    return images.mean(dim=(0, 2, 3)).tolist(), images.std(dim=(0, 2, 3)).clamp_min(1e-3).tolist()


def folder_sets(args):
    """(train, test, what they are) of an image folder or IDX files, normalised by the training split."""
    import torchvision
    transforms = torchvision.transforms
    info, root = args.image_folder, args.data or DEFAULT_DATA
    if info:
        train, test = info["sets"]  # as check_image_folder found them: the folder is not walked again
        train.transform = transforms.ToTensor()  # what normalization() reads
        # the test split's classes are numbered as the training split's, which may have more
        test.target_transform = {i: train.class_to_idx[c] for i, c in enumerate(test.classes)}.__getitem__
    else:
        train, test = (torchvision.datasets.MNIST(root, train=split, transform=transforms.ToTensor())
                       for split in (True, False))
        info = idx_info(train, test, root)
    mean, std = normalization(train)
    train.transform = test.transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])
    info = {**info, "mean": mean, "std": std,
            "normalization": f"mean {fmt(mean)}, std {fmt(std)} per channel (the training split's)"}
    return train, test, info


def fmt(values):
    return "/".join(f"{v:.4f}" for v in values)


def idx_info(train, test, root):
    """Classes and shape of IDX files; MNIST itself is named so only when it has MNIST's sizes."""
    classes, shape = int(train.targets.max()) + 1, [1, *train.data.shape[1:]]
    if int(test.targets.max()) >= classes:
        fail(f"the test labels in {root}/MNIST/raw go up to {int(test.targets.max())}, the training labels to "
             f"{classes - 1}", "number the classes alike in both splits, from 0")
    is_mnist = (len(train), len(test), classes, shape) == (60000, 10000, 10, [1, 28, 28])
    kind = "mnist" if is_mnist else "idx"
    name = "MNIST" if is_mnist else f"IDX files of {classes} classes, {' x '.join(map(str, shape))}"
    return {"kind": kind, "classes": [str(c) for c in range(classes)], "shape": shape, "name": name}


def per_class_line(per_class, classes, most=10):
    """`per class: blue 96.8% (30/31), ...`, the classes without test images left out; past `most`, the lowest."""
    scores = sorted(((correct / count, name, correct, count) for name, correct, count in zip(classes, *per_class)
                     if count), key=lambda s: s[0] if len(classes) > most else 0)
    shown = f"the {most} lowest of {len(scores)}" if len(scores) > most else ""
    return (f"per class{' (' + shown + ')' if shown else ''}: "
            + ", ".join(f"{name} {100 * acc:.1f}% ({correct}/{count})" for acc, name, correct, count in scores[:most]))


# ---------------------------------------------------------------- predict
def predict(checkpoint, paths):
    """--predict: classify image files with the checkpoint's model, in this one process (no process
    group), each image prepared as the training images were. Prints `file -> class (probability)`."""
    model, card = read_model(checkpoint)
    images = [prepare(path, card) for path in paths]  # every file checked before the first answer
    with torch.no_grad():
        for start in range(0, len(images), 256):  # a bounded batch, however many files
            probabilities = model(torch.stack(images[start:start + 256])).softmax(dim=1)
            for path, p in zip(paths[start:], probabilities):
                print0(f"{path} -> {shown(card['classes'][p.argmax()])} ({p.max():.3f})")  # a file's name: shown
    return 0


def read_model(path):
    """The model in checkpoint `path`, ready to classify, and its data card (write_checkpoint's); one error line
    for a checkpoint without a card (written before checkpoints carried one) or with a malformed one."""
    if not os.path.isfile(path):
        fail(f"no checkpoint at {path} to predict with", "train first, or point --checkpoint at one")
    state = load_checkpoint(path, ("model",))
    card = state.get("data") if isinstance(state.get("data"), dict) else {}
    missing = [key for key in ("classes", "mean", "std", "shape") if not isinstance(card.get(key), list)]
    if missing:
        fail(f"{path} does not hold its {', '.join(missing)} (a checkpoint written before they were saved)",
             "train it one more epoch (--resume -e N+1 with its --data), which saves them, or train afresh")
    shape, classes = card["shape"], card["classes"]
    if len(shape) != 3 or not all(isinstance(n, int) and n > 0 for n in shape) or not classes \
            or not len(card["mean"]) == len(card["std"]) == shape[0]:
        fail(f"{path} holds a malformed data card (shape {shape[:4]}, {len(classes)} classes, "
             f"{len(card['mean'])} means, {len(card['std'])} stds)", "use a checkpoint this script wrote")
    if card.get("kind") == "synthetic":
        fail(f"{path} was trained on the synthetic stand-in, not on images", "train on your images (--data DIR)")
    model = ConvNet(len(card["classes"]), channels=card["shape"][0])
    try:
        model.load_state_dict(state["model"])
    except (RuntimeError, TypeError, ValueError) as e:
        fail(f"{path} holds weights that do not fit its data card ({str(e).splitlines()[0][:100]})",
             "use a checkpoint this script wrote")
    return model.eval(), card


def prepare(path, card):
    """One image file as the model saw its training images: checked against the model's input, made a
    tensor in [0, 1] (ToTensor), normalised by the training split's mean and std."""
    from torchvision.transforms.functional import normalize, to_tensor  # see mnist_files
    channels, height, width = card["shape"]
    mode = next((name for name, count in IMAGE_MODES.items() if count == channels), "?")
    try:
        image = read_image(path, (mode, (width, height)))
    except ImageRefused as e:
        fail(*e.args)
    return normalize(to_tensor(image), card["mean"], card["std"])


# =============================================================================
# ---- harness: recipes, each the same wherever it appears; not part of the lesson ----
# What makes the lesson above robust: the recipes of recipes/harness.py that this file uses, every definition byte for byte as there (a test compares them). A recipe can be
# lifted alone with the recipes its banner names; docs/recipes.md has the ones users lift most.
# =============================================================================
import atexit
import gc
import json
import logging
import multiprocessing
import pickle
import signal
import threading
import traceback
import warnings
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


def bf16_supported(device, emulated=False):
    """Whether the current device computes bfloat16 natively (emulated: slower than fp16, counted only if asked)."""
    if device.type == "cpu" and not hasattr(torch.cpu, "get_capabilities") and not emulated:
        print0(f"note: torch {torch.__version__} cannot tell whether this CPU computes bfloat16 "
               "natively (no torch.cpu.get_capabilities): taken as not")
    if device.type == "cpu":
        caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}  # torch 2.7: none
        return bool(caps.get("avx512_bf16") or caps.get("amx_bf16")) or emulated
    check = getattr(torch.get_device_module(device.type), "is_bf16_supported", None)
    if check is None:  # a module without the check: torch's own autocast default for the type
        return torch.get_autocast_dtype(device.type) == torch.bfloat16
    if "including_emulation" in inspect.signature(check).parameters:  # torch.cuda; torch.xpu from 2.8
        return bool(check(including_emulation=emulated))
    return bool(check())


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


# ---- recipe: agreement (needs errors): the ranks must hold the same integer
def check_same_on_every_rank(value, what, fix):
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, int(value))  # on the device the backend carries (nccl: the current GPU)
    if len(set(every)) > 1:
        fail(f"the ranks' {what} differ: {every}", fix)


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


def save_checkpoint(state, path):
    """Atomically, stamped with its torchrun job (continue_checkpoint) and world size. On rank 0, then a barrier."""
    stamp = {"job": os.environ.get("TORCHELASTIC_RUN_ID"), "world_size": dist.get_world_size() if dist.is_initialized() else 1}
    write_or_fail(path, lambda f: torch.save({**state, **stamp}, f))


# ---- recipe: safe load (needs errors): a checkpoint read as data, never as code
def load_checkpoint(path, keys, model=None, optimizers=None):
    """The checkpoint at `path` as a dict, checked (one line per machine, exit 2, when it is not one of ours):
    it holds `keys` (and the entries named below). `model`: a module loaded from "model", or {entry: module},
    each entry a dict of finite tensors loaded strictly into its module. `optimizers`: {entry: optimizer}, each
    entry checked against its optimizer (check_optimizer_state) and loaded into it. Tensors only in those
    entries and "optimizer"; every other entry plain data (numbers, strings, lists, dicts of them: a scheduler's
    or a GradScaler's state_dict), returned as it is. Counts (epoch, step, ...) in `keys`: ints from 0."""
    state, optimizers = checkpoint_data(path), optimizers or {}
    models = model if isinstance(model, dict) else {"model": model} if model is not None or "model" in keys else {}
    if not isinstance(state, dict) or not set(keys) | set(models) | set(optimizers) <= set(state):
        fail(f"{path} is not a checkpoint of this script", "delete it, or point the script at one it wrote", every_node=True)
    valued = next((str(k) for k, v in state.items() if k not in {"model", "optimizer", *models, *optimizers}
                   and holds_tensor(v)), None)
    if valued:  # where a value belongs, a tensor compares elementwise (10^9 from a 4-byte view), then is no bool
        fail(f"{path} is not a checkpoint of this script: its {valued[:40]} holds a tensor",
             "delete it, or point the script at one it wrote", every_node=True)
    counts = [k for k in keys if k in ("epoch", "epochs_run", "step", "windows_in_epoch", "global_batch", "batch_size",
                                       "world_size") and not (type(state[k]) is int and 0 <= state[k] < 2 ** 48)]
    if counts:
        fail(f"{path} is not a checkpoint of this script: {', '.join(counts)} is not a count",
             "delete it, or point the script at one it wrote", every_node=True)
    for entry, module in models.items():
        check_and_load_weights(path, state, module, entry)
    for entry, optimizer in optimizers.items():
        check_optimizer_state(path, state[entry], optimizer, which=entry)
        optimizer.load_state_dict(state[entry])
    return state


def checkpoint_data(path):
    """torch.load with weights_only, so a pickled object is refused before it runs, from a plain file
    (open_plain); onto the CPU (load_state_dict moves each tensor to its parameter). Unreadable: one line per
    machine. torch's reader bounds no work or memory by the file's size (docs/faults.md)."""
    try:
        with open(open_plain(path), "rb") as f, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes on a file that it may be about to refuse
            return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        reason = next((line.strip() for line in str(e).splitlines() if "unsupported" in line.lower()), "not plain data")
        fail(f"{path} holds pickled Python objects and was refused unread ({reason})",
             "load only checkpoints this script wrote; delete it to start afresh", every_node=True)
    except Exception as e:  # OSError (ELOOP: a link), not a plain file, a bad zip, MemoryError, ...
        fail(f"cannot read checkpoint {path} ({type(e).__name__}: {str(e).strip().split('. ')[0][:160]})",
             f"pass the file it links to, {os.path.realpath(path)}" if getattr(e, "errno", 0) == errno.ELOOP
             else "it is unreadable or truncated; delete it to start afresh", every_node=True)


def open_plain(path, flags=os.O_RDONLY):
    """A descriptor of `path`, opened without following a link (OSError ELOOP, "Too many levels of symbolic
    links") or waiting on a FIFO, once it is a regular file of one link (fstat; a hard link is a file of some
    other folder too), else ValueError."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:  # 0: removed since it was opened
        os.close(fd)
        raise ValueError(f"{path} is refused: it is not a plain file of one link (a FIFO, a device, a folder "
                         f"or a file of {info.st_nlink} links)")
    return fd


def holds_tensor(value):
    """Whether a tensor lies anywhere in `value`: each object looked at once, without recursion (torch's
    reader bounds neither nesting nor a list that holds itself)."""
    todo, seen = [value], set()
    while todo:
        value = todo.pop()
        if isinstance(value, torch.Tensor):
            return True
        if isinstance(value, (dict, list, tuple)) and id(value) not in seen:
            seen.add(id(value))
            todo.extend(value.values() if isinstance(value, dict) else value)
    return False


def check_and_load_weights(path, state, model, entry="model"):
    """state[entry] ("model") a dict of finite tensors by name (NaN weights would train on and end in a fingerprint
    of nan), loaded into `model` if given (load_state_dict's strict check says what differs); "optimizer", if there,
    an optimizer's state_dict (check_optimizer_state checks it against the optimizer that will load it)."""
    theirs, optimizer, named = state[entry], state.get("optimizer", {}), "" if entry == "model" else f"{entry}: "
    groups = optimizer.get("param_groups") if isinstance(optimizer, dict) else None
    if not isinstance(theirs, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in theirs.items()):
        fail(f"{path} is not a checkpoint of this script: its {entry} entry is not a dict of tensors",
             "delete it, or point the script at one it wrote", every_node=True)
    if not isinstance(optimizer, dict) or optimizer and not (
            isinstance(optimizer.get("state"), dict) and all(isinstance(v, dict) for v in optimizer["state"].values())
            and isinstance(groups, list) and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)):
        fail(f"{path} is not a checkpoint of this script: its optimizer entry is not an optimizer's state",
             "delete it, or point the script at one it wrote", every_node=True)
    bad = next((k for k, v in theirs.items() if not finite_values(v)), None)
    if bad is not None:
        fail(f"{path} holds weights that are not finite values: {named}{bad[:80]} (NaN, Inf, or a view past its "
             "storage)", "resume from an earlier checkpoint of the run, or delete it to start afresh", every_node=True)
    if model is not None:
        meta = any(p.is_meta for p in model.parameters())  # shapes only: it takes the tensors, nothing to copy into
        try:  # a copy to assign from: load_state_dict leaves assign=True in the dict's _metadata for the next load
            model.load_state_dict(dict(theirs) if meta else theirs, assign=meta)
        except RuntimeError as e:  # its text from the 7th word: "size mismatch for w: copying a param with shape ..."
            why = re.sub(r"torch\.Size\(\[(.*?)\]\)", r"(\1)", " ".join(str(e).split()[6:]))
            fail(f"{path} is for another model or configuration ({named}{why[:200]})",
                 "delete it, or use the configuration that wrote it", every_node=True)


def finite_values(tensor):
    """A plain tensor's values, all finite (NaN weights train on and end in a fingerprint of nan), checked in
    a pass bounded by the file: no view claiming more than its storage (stride 0: 10^12 elements from 4 bytes)."""
    plain = tensor.layout == torch.strided and not tensor.is_meta and not tensor.is_quantized
    return plain and tensor.numel() * tensor.element_size() <= tensor.untyped_storage().nbytes() and \
        bool(torch.isfinite(tensor).all())


def check_optimizer_state(path, saved, optimizer, which="this optimizer", fix=None):
    """Before optimizer.load_state_dict(saved): `saved` is the state this very optimizer writes, or one error
    line. load_state_dict compares none of it, and the fused CPU AdamW wrote past an `exp_avg` of shape [1]
    (a segfault). Its groups name exactly our parameters (the ids torch gives them, in order) and hold our
    settings (those __setstate__ does not fill in) of their types; each parameter's state is empty (never
    stepped) or holds the keys a step leaves (scratch_step), each a plain, contiguous, finite CPU tensor of its
    parameter's shape and a floating dtype, `step` a 0-dim one (as torch and Muon write it) in [0, 2^48).
    ZeroRedundancyOptimizer's consolidated state alike. `which` names the optimizer in the line, `fix` ends it."""
    ours, params, keys = [], {}, {}
    for group in optimizer.param_groups:  # ZeRO's too hold every parameter, not this rank's shard
        ids = range(len(params), len(params) + len(group["params"]))
        expected, required = scratch_step(optimizer, group) if group["params"] else (set(), set(group) - {"params"})
        params.update(zip(ids, group["params"]))
        keys.update(dict.fromkeys(ids, expected))
        ours.append(({**group, "params": list(ids)}, required))
    groups, state = (saved.get("param_groups"), saved.get("state")) if type(saved) is dict else (None, None)
    if type(groups) is not list or type(state) is not dict or len(groups) != len(ours):
        why = f"{len(groups) if type(groups) is list else 'no'} parameter groups, this optimizer has {len(ours)}"
    elif any(type(g) is not dict or g.get("params") != mine["params"] or not same_settings(g, mine, required)
             for g, (mine, required) in zip(groups, ours)):
        why = "parameter groups that name other parameters, or lack settings, or hold them of another type"
    else:
        why = next((f"a state for parameter {str(i)[:20]} {wrong}" for i, entry in state.items()
                    if (wrong := wrong_state(entry, params.get(i) if type(i) is int else None, keys.get(i)))), None)
    if why:
        fail(f"{path} holds another optimizer's state than {which}'s ({why})", fix or "resume with the optimizer "
             "and model that wrote it, or delete it to start afresh", every_node=True)


def scratch_step(optimizer, group):
    """(The keys a step leaves in a parameter's state in `group`, the settings a saved group must hold): the
    optimizer's class (ZeRO: the one it wraps) stepped once with the group's settings on zeros shaped as the
    group's smallest parameter, then given a group of no settings (those its __setstate__ fills in are optional:
    a checkpoint of an older torch lacks them)."""
    probe = torch.zeros_like(min(group["params"], key=torch.numel), requires_grad=True)
    probe.grad = torch.zeros_like(probe)
    scratch = type(getattr(optimizer, "optim", optimizer))([{**group, "params": [probe]}], lr=group["lr"])
    scratch.step()
    keys = set(scratch.state[probe])
    scratch.__setstate__({"state": {}, "param_groups": [{"params": [probe]}]})
    return keys, set(group) - set(scratch.param_groups[0])


def same_settings(saved, ours, required):
    """The saved group holds the `required` settings, and each that ours has too is of our setting's type (a
    number for a number, a tuple of as many numbers for a tuple): a string lr or a 1-tuple of betas fails the step."""
    def kind(value):
        if type(value) in (int, float):
            return "number" if math.isfinite(value) else "not finite"
        return [kind(v) for v in value] if type(value) is tuple else type(value).__name__
    return required <= set(saved) and all(kind(saved[k]) == kind(v) for k, v in ours.items()
                                          if k != "params" and k in saved)


def wrong_state(entry, param, keys):
    """Why a parameter's saved state cannot be loaded into its optimizer for `param`, or None."""
    if param is None or type(entry) is not dict:
        return "for no parameter of this optimizer"
    if entry and set(entry) != keys:
        return f"holds {sorted(map(str, entry))[:4]}, a step of this optimizer {sorted(keys)}"
    for key, value in entry.items():
        plain = type(value) is torch.Tensor and value.device.type == "cpu" and value.layout == torch.strided \
            and value.is_contiguous() and value.is_floating_point()
        if key == "step" and not (plain and value.dim() == 0 and 0 <= value.item() < 2 ** 48):
            return "has a step that is not a count in a 0-dim float tensor"
        if key != "step" and not (plain and value.shape == param.shape):
            return (f"has {str(key)[:20]} of shape {tuple(value.shape)}, its parameter {tuple(param.shape)}"
                    if isinstance(value, torch.Tensor) else f"has {str(key)[:20]} that is not a tensor")
        if not torch.isfinite(value).all():
            return f"has {str(key)[:20]} that is not finite"
    return None


# ---- recipe: resume (needs safe load, errors, printing): continue a checkpoint only when it is ours
def continue_checkpoint(path, resume):
    """Asked (--resume): yes (none there: one line). Unasked: only this job's own, after torchrun restarted it
    (a failure, a node joined or left): its --rdzv-id (TORCHELASTIC_RUN_ID) is stamped in (without one, "none",
    only a restart count can tell). Another file is neither continued nor overwritten: one line says whose."""
    if not path or not os.path.exists(path):
        if resume:
            fail(f"--resume but there is no checkpoint at {path}",
                 "pass the --checkpoint PATH an earlier run wrote, or drop --resume", every_node=True)
        return False
    job, state = os.environ.get("TORCHELASTIC_RUN_ID", "none"), None
    with contextlib.suppress(Exception):  # unreadable, or not a dict: not ours, and not ours to overwrite unasked
        state = peek_checkpoint(path)
    theirs = state.get("job") if isinstance(state, dict) else None
    if resume or (int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 if job == "none" else theirs == job):
        return True
    found = "a file that is not a checkpoint this script can read" if not isinstance(state, dict) else (
        f"a checkpoint at {where_checkpoint_is(state) or 'an unknown point'} written by "
        + ("a run outside torchrun" if not theirs else "a torchrun job without --rdzv-id" if theirs == "none"
           else f"torchrun job {theirs}") + f" at world size {state.get('world_size', '?')}")
    fail(f"{path} holds {found}, not this job's",
         "pass --resume to continue it; to start afresh delete it or pass another --checkpoint", every_node=True)


def describe_checkpoint(path):
    """`checkpoint at epoch 2 kept in PATH` or `no checkpoint kept` (peek_checkpoint: the counter alone is read)."""
    with contextlib.suppress(Exception):  # none, unreadable, cut short by the interrupt
        state = peek_checkpoint(path)
        where = where_checkpoint_is(state)
        return f"checkpoint at {where} kept in {path}" if where else f"checkpoint kept in {path}"
    return "no checkpoint kept"


def peek_checkpoint(path):
    """The checkpoint's counters and stamps, its tensors mapped (mmap=True) and never read: the memory of its
    small entries, however large the file (map_location="meta" read every tensor before pytorch/pytorch#170619,
    December 2025). Checked as load_checkpoint's file is (open_plain) first: mmap takes a path, not a file."""
    os.close(open_plain(path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's notes on a file it may refuse: the caller's line says it
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)


def where_checkpoint_is(state):
    """`step 50` or `epoch 3`: how far the run that wrote `state` got ('' if it does not say)."""
    return next((f"{unit} {state[key]}" for key, unit in (("step", "step"), ("epoch", "epoch"), ("epochs_run", "epoch"))
                 if isinstance(state.get(key), int)), "")


def say_if_nothing_left(path, unit, reached, flag, target):
    """True, with one line, when the checkpoint at `unit` `reached` leaves nothing: `flag` ends the run at `target`."""
    if reached >= target:
        print0(f"nothing to train: {path} is at {unit} {reached} and {flag} {target} ends the run there "
               f"(pass a larger {flag} to train on, or another --checkpoint to start afresh)")
    return reached >= target


def note_world_change(state, steps_per_epoch, batch_size):
    """One line when a checkpoint of another world size is resumed: what changes and what does not."""
    then, now = state.get("world_size"), dist.get_world_size()
    if then is not None and then != now:
        print0(f"note: resuming at world size {now} a checkpoint written at {then}: an epoch is now {steps_per_epoch} "
               f"steps of {batch_size} samples x {plural(now, 'process')} (the batch per process stays, so the global "
               f"batch and the steps per epoch change with the world); kept: the weights, the optimizer state and the epoch")


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

