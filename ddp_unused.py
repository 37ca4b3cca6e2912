"""Parameters that get no gradient: DDP's most reported error, reproduced, read and fixed.

Scenario: a multi-task model, as in jobs that give each rank one task's data: a shared
trunk, a `block` that can be frozen or run under activation checkpointing, one head per
task (`heads.a`, `heads.b`; rank r trains task a when r is even, b when odd) and a `spare`
layer that is defined but that no step calls (a head kept for later). On every step each
rank leaves its other head and the spare layer without a gradient. Plain DDP waits for
every parameter's gradient before it all-reduces a bucket, so the first step never
finishes its reduction and the second forward raises:

    RuntimeError: Expected to have finished reduction in the prior iteration before starting
    a new one. This error indicates that your module has parameters that were not used in
    producing loss. ... Parameter indices which did not receive grad for rank 0: 0 7 8

Indices only. With TORCH_DISTRIBUTED_DEBUG=INFO (or DETAIL) in the environment, or
`torch.distributed.set_debug_level(DebugLevel.INFO)` before the model is wrapped (as here),
DDP names them: `Parameters which did not receive grad for rank 0: heads.b.bias, ...`.

--mode (each trains copies of the model side by side, from the same weights on the same
batches, unless it reproduces an error):
    bare          plain DDP: the error, gathered from every rank into one line naming the
                  parameters and the ranks, then the fixes; exit 1
    find-unused   find_unused_parameters=True: DDP walks the autograd graph after every forward
                  and all-reduces zeros for what it did not reach; timed against a model whose
                  every parameter takes part, with and without the flag; DDP's logging data
    static-graph  static_graph=True: DDP learns the unused set in step 1 and trusts it after;
                  trained beside find-unused, which it must match (see --mode static-graph below)
    freeze        block.requires_grad_(False) before wrapping: DDP leaves it out of its buckets
                  (bytes counted by a comm hook); then freezing after wrapping and freezing on
                  one rank only, each with its real error in one line
    checkpoint    the block under torch.utils.checkpoint: use_reentrant=True with
                  find_unused_parameters raises "Expected to mark a variable ready only once";
                  use_reentrant=False, or reentrant with static_graph, trains
    two-forwards  a GAN step: a discriminator with BatchNorm run on real and on fake data, one
                  backward. Under DDP's default buffer sync torch 2.7 raises "one of the variables
                  needed for gradient computation has been modified by an inplace operation"
                  (pytorch#175024, from 2.6 on); torch 2.14 does not (pytorch#175851), but each
                  rank's BatchNorm statistics still end different. The fix (no buffer sync before
                  every forward, one broadcast at the end) trains on both

Measured (2 CPU processes, gloo, defaults, torch 2.14.1, a loaded 2-core machine, 3 runs of
--mode static-graph --epochs 6): a step took all-used 10.0 ms, find-unused 11.6 ms, static-graph
9.5 ms (each the median of the 3 runs' median steps); the table's `vs all-used` column, a ratio
within one run, was 0.96x to 1.21x for find-unused (median 1.08x), 0.91x to 1.02x for static-graph
(median 0.95x): noisy. find-unused and static-graph end bit for bit equal. Every copy all-reduces
590,968 bytes a step (the unused parameters as zeros); the frozen block takes 327,800, the
trainable parameters' bytes. More in docs/ddp_breaks_unused.md.

Launch:
    torchrun --standalone --nproc-per-node=gpu ddp_unused.py --mode find-unused
    torchrun --standalone --nproc-per-node=2 ddp_unused.py --mode bare          # the error, named
    CUDA_VISIBLE_DEVICES= torchrun --standalone --nproc-per-node=2 ddp_unused.py --device cpu --mode static-graph
    python ddp_unused.py --mode freeze                                          # a one-process world

Nearest sibling: ddp_comm_hooks.py (copies trained side by side, a byte-counting comm hook);
this file adds models DDP cannot train as they stand, and the fixes. Beyond the lesson: reading
DDP's error text and the measurements; the robustness every script shares is in the harness block
at the end of the file, each recipe as in every file.
"""

# ---------------------------------------------------------------- imports
import argparse
import copy
import itertools
import inspect
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

MODES = ("bare", "find-unused", "static-graph", "freeze", "checkpoint", "two-forwards")
FEATURES, CLASSES = 32, 10
FIXES = ("find_unused_parameters=True when the set changes from step to step, static_graph=True when it "
         "does not, or freeze (requires_grad_(False)) or delete before wrapping what no step uses; "
         "see --mode find-unused, static-graph, freeze")


# ---------------------------------------------------------------- arguments
def parse_args(argv=None):
    p = Arguments(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", default="find-unused", choices=MODES, help="what to reproduce or train (docstring)")
    p.add_argument("--epochs", "--max_epochs", "-e", type=int, default=2, metavar="N", help="epochs to train")
    p.add_argument("--batch_size", "--batch-size", "-b", type=int, default=32, metavar="N",
                   help="samples per step, per process (the global batch is N x world size)")
    p.add_argument("--lr", type=float, default=0.05, metavar="LR", help="SGD learning rate (momentum 0.9)")
    p.add_argument("--seed", type=int, default=0, help="seed for the data and the initial weights")
    p.add_argument("--samples", type=int, default=None, metavar="N",
                   help="size of the data set (default: 512 per process: 16 steps an epoch at any world size)")
    p.add_argument("--width", type=int, default=256, metavar="N", help="units of the trunk, the block and the heads")
    p.add_argument("--device", default="auto", metavar="auto|cpu|TYPE",
                   help="auto: the accelerator torch finds (cuda, xpu, hpu, npu, ...), else cpu")
    p.add_argument("--backend", default="auto", metavar="auto|NAME",
                   help="auto: the device's default (nccl on cuda, xccl on xpu, hccl on hpu/npu, gloo on cpu)")
    p.add_argument("--timeout", type=float, default=300, metavar="SECONDS",
                   help="how long a collective waits for the other ranks before failing")
    p.add_argument("--metrics", default=None, metavar="PATH", help="write a JSON summary of the run here (rank 0)")
    p.add_argument("--local-rank", "--local_rank", type=int, default=None, dest="local_rank",
                   help=argparse.SUPPRESS)  # passed by the deprecated torch.distributed.launch
    refuse_launcher_flags(argv)  # --nprocs: a line on how torchrun launches this script
    return p.parse_args(argv)


def check_args(args):
    """Validate the arguments in every process, before it joins the group."""
    args.samples = args.samples or 512 * int(os.environ.get("WORLD_SIZE", 1))  # the same steps at any world size
    check_positive(args, "epochs", "batch_size", "lr", "samples", "width", "timeout")
    check_folders(args.metrics)
    resolve_device(args)
    return args


# ---------------------------------------------------------------- process group
def setup(args):
    """Join the process group that torchrun describes in the environment; returns this process's device."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # the cores split between this machine's processes, on GPUs too (their loaders, their CPU work)
    use_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    if args.device != "cpu":  # cuda, or another accelerator torch reports (xpu, hpu, npu, ...)
        device = torch.device(args.device, int(os.environ["LOCAL_RANK"]))
        torch.accelerator.set_device_index(device)  # before any work on it: one GPU per process
    else:
        device = torch.device("cpu")
    # device_id: NCCL builds its communicator now, so a bad GPU or network fails here, not at step 1
    dist.init_process_group(args.backend, rank=rank, world_size=world_size,
                            store=attempt_store(rank, world_size, args.timeout),  # torchrun >= 2.5 restarts: pytorch#135712
                            timeout=timedelta(seconds=args.timeout),
                            device_id=device if args.backend == "nccl" else None)
    return device


def cleanup():
    free_error_frames()  # DDP's reducer goes before the group it talks through
    dist.destroy_process_group()


# ---------------------------------------------------------------- data: one task per rank
def make_dataset(samples, seed):
    """Gaussian inputs with two labels each, from two fixed random linear teachers (task a and b).
    The same on every rank (seeded): the sampler's indices mean the same thing everywhere."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, FEATURES, generator=g)
    teachers = torch.randn(2, FEATURES, CLASSES, generator=g)
    return TensorDataset(x, (x @ teachers[0]).argmax(dim=1), (x @ teachers[1]).argmax(dim=1))


def task_of(rank):
    return "ab"[rank % 2]


# ---------------------------------------------------------------- model
class MultiTask(nn.Module):
    """A shared trunk, a block, one head per task and a spare layer that forward never calls.

    checkpointing: None, or use_reentrant's value for the block under torch.utils.checkpoint.
    every_parameter: the forward sums every head and the spare layer, so that every parameter
    takes part: the reference a model with unused parameters is timed against.
    """

    def __init__(self, width):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(FEATURES, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU())
        self.block = nn.Sequential(nn.Linear(width, width), nn.ReLU())
        self.heads = nn.ModuleDict({"a": nn.Linear(width, CLASSES), "b": nn.Linear(width, CLASSES)})
        self.spare = nn.Linear(width, CLASSES)
        self.checkpointing, self.every_parameter = None, False

    def forward(self, x, task):
        h = self.trunk(x)
        if self.checkpointing is None:
            h = self.block(h)
        else:  # activations recomputed in backward instead of stored
            h = checkpoint(self.block, h, use_reentrant=self.checkpointing)
        if self.every_parameter:
            return self.heads["a"](h) + self.heads["b"](h) + self.spare(h)
        return self.heads[task](h)


# ---------------------------------------------------------------- copies trained side by side
def wrap(module, device, **options):
    # ddp_group: None; under TORCH_DISTRIBUTED_DEBUG=DETAIL a group DDP can take (torch 2.14, 2.15 segfault on gloo's checked one)
    return DDP(module, device_ids=[device.index] if device.type != "cpu" else None, process_group=ddp_group(None), **options)


def counting_allreduce(sent):
    """DDP's default all-reduce as a comm hook, plus a tally: appends to sent[-1] the bytes of each
    bucket it all-reduces (torch documents allreduce_hook as the same as no hook)."""
    def hook(state, bucket):
        sent[-1].append(bucket.buffer().numel() * bucket.buffer().element_size())
        return default_hooks.allreduce_hook(state, bucket)
    return hook


class Copy:
    """One copy of the model under one DDP configuration, and what it measured."""

    def __init__(self, name, initial, device, args, configure=None, **ddp_options):
        self.name = name
        self.module = copy.deepcopy(initial).to(device)  # every copy starts from the same weights
        if configure:
            configure(self.module)  # freezing, checkpointing, ...: before DDP is built, as it must be
        self.weights_before = {k: v.detach().clone() for k, v in self.module.named_parameters()}
        self.model = wrap(self.module, device, **ddp_options)
        self.sent, self.seconds = [], []  # per step: bytes of each bucket, and seconds
        self.model.register_comm_hook(None, counting_allreduce(self.sent))
        self.optimizer = torch.optim.SGD([p for p in self.module.parameters() if p.requires_grad],
                                         lr=args.lr, momentum=0.9, weight_decay=1e-4)
        self.totals = torch.zeros(2, dtype=torch.float64, device=device)  # [sum of losses, samples]


def train(copies, loader, device, args):
    """Every copy takes every step, in turns; returns each copy's global mean loss per epoch."""
    task, curves = task_of(dist.get_rank()), [[] for _ in copies]
    for epoch in range(args.epochs):
        start = time.perf_counter()
        loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        for i, (x, ya, yb) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), (ya if task == "a" else yb).to(device, non_blocking=True)
            for k in range(len(copies)):  # a different copy goes first each step: none always meets a cold cache
                c = copies[(i + k) % len(copies)]
                c.sent.append([])
                began = time.perf_counter()
                c.optimizer.zero_grad(set_to_none=True)
                loss = F.cross_entropy(c.model(x, task), y)
                loss.backward()  # DDP all-reduces each bucket once every gradient it waits for is ready
                c.optimizer.step()  # weight decay moves any parameter with a gradient, zero or not
                if device.type != "cpu":
                    torch.accelerator.synchronize(device)  # the clock waits for the GPU's work
                c.seconds.append(time.perf_counter() - began)
                c.totals += torch.stack([loss.detach().double() * len(x), c.totals.new_tensor(len(x))])
        totals = torch.stack([c.totals for c in copies])
        dist.all_reduce(totals)  # global mean losses, every copy's in one collective
        for c, curve, (loss_sum, samples) in zip(copies, curves, totals.tolist()):
            curve.append(loss_sum / samples)
            c.totals.zero_()
        print0(f"epoch {epoch + 1}/{args.epochs} | loss " + " | ".join(f"{c.name} {curve[-1]:.4f}"
                                                                      for c, curve in zip(copies, curves))
               + f" | {time.perf_counter() - start:.2f} s")
    return curves


# ---------------------------------------------------------------- the errors, reproduced
def one_bucket(module):
    """DDP options for the reproductions: the whole model in one bucket. A bucket is all-reduced
    only once every gradient in it is ready, so with one bucket no rank has all-reduced a bucket
    that another rank left pending when the error comes: the ranks can still gather their errors."""
    return {"bucket_cap_mb": sum(p.numel() * p.element_size() for p in module.parameters()) / 2**20 + 1}


def two_steps(module, device, batches, after_wrapping=None, **options):
    """Wrap `module` and take two forward/backward passes; the RuntimeError DDP raised, or None.
    Debug level INFO, set before wrapping (DDP keeps the parameters' names only when asked then):
    the error names the parameters; without it, it gives their indices."""
    previous = dist.get_debug_level()  # TORCH_DISTRIBUTED_DEBUG's, if set
    dist.set_debug_level(dist.DebugLevel.INFO)
    model = wrap(module, device, **one_bucket(module), **options)
    dist.set_debug_level(previous)
    if after_wrapping:
        after_wrapping(module)
    try:
        for x, y in batches:
            F.cross_entropy(model(x, task_of(dist.get_rank())), y).backward()
    except RuntimeError as error:
        return error
    return None


def reproduce_bare(initial, batches, device):
    """Plain DDP on the model as it stands."""
    return two_steps(copy.deepcopy(initial).to(device), device, batches), "at step 2"


def reproduce_freeze_after(initial, batches, device):
    """Every parameter in use, then the block frozen after DDP was built: DDP still waits for it."""
    module = copy.deepcopy(initial).to(device)
    module.every_parameter = True
    return two_steps(module, device, batches, lambda m: m.block.requires_grad_(False)), "at step 2"


def reproduce_freeze_one_rank(initial, batches, device):
    """The block frozen before wrapping, but on rank 1 only: DDP compares the ranks' parameters first."""
    module = copy.deepcopy(initial).to(device)
    if dist.get_rank() == 1:
        module.block.requires_grad_(False)
    try:
        wrap(module, device)
    except RuntimeError as error:
        return error, "when DDP was built"
    return None, "when DDP was built" + (" (a world of one has no rank 1)" if dist.get_world_size() == 1 else "")


def reproduce_checkpoint_reentrant(initial, batches, device):
    """The block under reentrant checkpointing with find_unused_parameters: the graph walk after the
    forward cannot see inside the checkpoint (it ran under no_grad), so DDP counts the block unused
    and marks it ready, and the recomputation's backward marks it again."""
    module = copy.deepcopy(initial).to(device)
    module.checkpointing = True
    error = two_steps(module, device, batches, find_unused_parameters=True)
    return error, "in the first backward"


# ---------------------------------------------------------------- the fixes, trained
def use_every_parameter(module):
    module.every_parameter = True


def freeze_block(module):
    module.block.requires_grad_(False)


def checkpointed(reentrant):
    def configure(module):
        module.checkpointing = reentrant
    return configure


FIND_UNUSED, STATIC = {"find_unused_parameters": True}, {"static_graph": True}
# per mode: the copies trained side by side (name, what is done to the model before wrapping, DDP
# options); "all-used" is the reference: a forward in which every parameter takes part, plain DDP
PLANS = {
    "find-unused": [("all-used", use_every_parameter, {}), ("all-used+flag", use_every_parameter, FIND_UNUSED),
                    ("find-unused", None, FIND_UNUSED)],
    "static-graph": [("all-used", use_every_parameter, {}), ("find-unused", None, FIND_UNUSED),
                     ("static-graph", None, STATIC)],
    "freeze": [("find-unused", None, FIND_UNUSED), ("frozen", freeze_block, FIND_UNUSED)],
    "checkpoint": [("find-unused", None, FIND_UNUSED), ("non-reentrant", checkpointed(False), FIND_UNUSED),
                   ("reentrant+static", checkpointed(True), STATIC)],
}
REPRODUCTIONS = {
    "freeze": [("frozen after wrapping", reproduce_freeze_after,
                "DDP chose what to wait for when it was built: freeze before wrapping"),
               ("frozen on rank 1 only", reproduce_freeze_one_rank,
                "DDP checks at construction that every rank has the same trainable parameters: freeze on every rank")],
    "checkpoint": [("reentrant + find_unused", reproduce_checkpoint_reentrant,
                    "use_reentrant=False, or static_graph=True (which learns the graph in step 1)")],
}


def reproduce_and_fix(loader, device, args):
    """The multi-task modes: the mode's errors reproduced, then its fixes trained side by side."""
    initial = MultiTask(args.width)
    batches = first_batches(loader, device)
    if args.mode == "bare":
        return fail_bare(initial, batches, loader, device, args)
    start = time.perf_counter()
    extra = {"reproductions": {name: report_reproduction(name, reproduce, initial, batches, device, why)
                               for name, reproduce, why in REPRODUCTIONS.get(args.mode, [])}}
    copies = [Copy(name, initial, device, args, configure, **options) for name, configure, options in PLANS[args.mode]]
    tasks = ", ".join(f"rank {r} {task_of(r)}" for r in range(dist.get_world_size()))
    print0(f"{len(copies)} copies of a model with {sum(p.numel() for p in initial.parameters()):,} parameters, "
           f"{len(loader)} steps per epoch, task per rank: {tasks} | {', '.join(c.name for c in copies)}")
    curves = train(copies, loader, device, args)
    extra.update(measure_and_check(copies, curves, args))  # the table, and what the mode promises
    return check_and_report(nn.ModuleList(c.module for c in copies), curves[-1], start, extra, loader, device, args)


def first_batches(loader, device, count=2):
    task = task_of(dist.get_rank())
    return [(x.to(device), (ya if task == "a" else yb).to(device)) for x, ya, yb in itertools.islice(loader, count)]


# ---------------------------------------------------------------- two forwards through BatchNorm (a GAN step)
NOISE = 16
def no_buffer_broadcast():
    """DDP's option for no buffer broadcast before every forward: forward_sync_buffers=False from torch
    2.13, which deprecates broadcast_buffers=False; older torch knows only broadcast_buffers."""
    if "forward_sync_buffers" in inspect.signature(DDP).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def gan(width):
    """A generator and a discriminator with BatchNorm, whose running statistics are buffers."""
    generator = nn.Sequential(nn.Linear(NOISE, width), nn.ReLU(), nn.Linear(width, FEATURES))
    discriminator = nn.Sequential(nn.Linear(FEATURES, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, 1))
    return generator, discriminator


def train_gan(initial, loader, device, args, **options):
    """Train a copy of the GAN pair, the usual GAN step; the pair and its global mean discriminator loss per epoch."""
    g, d = (copy.deepcopy(m).to(device) for m in initial)
    ddp_g, ddp_d = wrap(g, device), wrap(d, device, **options)
    g_optimizer, d_optimizer = (torch.optim.Adam(m.parameters(), lr=args.lr / 25, betas=(0.5, 0.999)) for m in (g, d))
    curve = []
    for epoch in range(args.epochs):
        loader.sampler.set_epoch(epoch)
        totals = torch.zeros(2, dtype=torch.float64, device=device)  # [discriminator loss sum, batches]
        for x, _, _ in loader:
            real = x.to(device) + 2  # "real" data: the inputs, shifted
            fake = ddp_g(torch.randn(len(x), NOISE, device=device))
            # two forwards through the discriminator, then one backward: with the default buffer sync
            # DDP broadcasts rank 0's BatchNorm statistics in place before the second one
            d_loss = F.softplus(-ddp_d(real)).mean() + F.softplus(ddp_d(fake.detach())).mean()
            d_optimizer.zero_grad(set_to_none=True)
            d_loss.backward()
            d_optimizer.step()
            g_loss = F.softplus(-ddp_d(fake)).mean()
            g_optimizer.zero_grad(set_to_none=True)
            g_loss.backward()
            g_optimizer.step()
            totals += torch.stack([d_loss.detach().double(), totals.new_tensor(1)])
        dist.all_reduce(totals)  # [sum, count] over every rank: the global mean
        curve.append((totals[0] / totals[1]).item())
    return nn.ModuleList([g, d]), curve


def fix_two_forwards(loader, device, args):
    """The default buffer sync (its error where torch raises one), then the fix, trained."""
    initial = gan(args.width)
    torch.manual_seed(args.seed + dist.get_rank())  # the generator's noise: its own on every rank
    start = time.perf_counter()
    default, error = None, None
    try:
        default, _ = train_gan(initial, loader, device, args)
    except RuntimeError as e:
        error = e
    found = report_default_sync(error, default)
    fixed, curve = train_gan(initial, loader, device, args, **no_buffer_broadcast())
    diverged = not buffers_agree(fixed)
    for buffer in fixed.buffers():  # rank 0's statistics for everyone, once, before they are used or saved
        dist.broadcast(buffer, src=0)
    agree = buffers_agree(fixed)
    print0(f"{next(iter(no_buffer_broadcast()))}=False: trained; discriminator loss "
           + " -> ".join(f"{v:.4f}" for v in curve) + f" | BatchNorm statistics differed across ranks before the "
           f"final broadcast: {'yes' if diverged else 'no'}, after it agree: {'yes' if agree else 'NO'}")
    extra = {**found, "buffers_differed_before_broadcast": diverged, "buffers_agree": agree,
             "sync_option": no_buffer_broadcast(), "checks": {"buffers_agree": agree}}
    return check_and_report(fixed, curve, start, extra, loader, device, args)


# ---------------------------------------------------------------- main
def check_and_report(modules, curve, start, extra, loader, device, args):
    """The replicas compared and the run reported; True when they agree and the mode's checks hold."""
    elapsed = time.perf_counter() - start
    in_sync = replicas_in_sync(modules, device)
    report(curve, elapsed, loader, in_sync, extra, device, args)
    return in_sync and all(v is not False for v in extra.get("checks", {}).values())


def report(curve, elapsed, loader, in_sync, extra, device, args):
    """Rank 0 writes the metrics (--metrics) and prints the `done:` line (not for --mode bare)."""
    steps = args.epochs * len(loader) if args.mode != "bare" else 0
    summary = {
        "script": os.path.basename(__file__), "world_size": dist.get_world_size(), "backend": dist.get_backend(),
        "device": device.type, "torch": torch.__version__, "mode": args.mode, "epochs": args.epochs if steps else 0,
        "steps": steps, "steps_per_epoch": len(loader), "batch_size": args.batch_size, "elapsed_s": elapsed,
        "samples_per_s": steps * args.batch_size * dist.get_world_size() / elapsed if elapsed else 0.0,
        "first_loss": curve[0], "final_loss": curve[-1], "losses": curve, "replicas_in_sync": in_sync,
        "resumed_from_epoch": 0, **extra,
    }
    if dist.get_rank() == 0 and args.metrics:
        write_json(args.metrics, summary)
    if args.mode != "bare":
        print0(f"done: {summary['script']} --mode {args.mode} | {plural(summary['world_size'], 'process')} on "
               f"{device.type} ({summary['backend']}) | torch {torch.__version__} | {plural(args.epochs, 'epoch')} | "
               f"loss {curve[0]:.4f} -> {curve[-1]:.4f} | replicas {'in sync' if in_sync else 'DIFFER'}")


@record  # under torchrun, an uncaught exception's traceback is its report's root cause
def main():
    """One process of the job; torchrun (or the user) describes the job in the environment."""
    args = check_args(parse_args())
    prepare_rendezvous(args)  # plain `python`: a world of one; a hand-made launch: check the port
    device = setup(args)
    try:
        with explained_failures(args.timeout):
            torch.manual_seed(args.seed)  # the initial weights: the same on every rank
            dataset = make_dataset(args.samples, args.seed)
            sampler = DistributedSampler(dataset, seed=args.seed)  # each rank its own 1/N of the samples
            loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
            run = fix_two_forwards if args.mode == "two-forwards" else reproduce_and_fix
            ok = run(loader, device, args)
    finally:
        cleanup()
    if not ok:
        sys.exit(1)  # the replicas differ, or a check of the mode failed


# ---- beyond the lesson: DDP's error text read, the copies measured, each mode's promises checked ----
import re
import statistics


def named_in(error):
    """What a DDP error says about this rank: the parameters it names, else its first sentence."""
    text = str(error)
    names = re.search(r"Parameters which did not receive grad for rank \d+: (.+)", text)
    if names:
        return names.group(1).strip()
    twice = re.search(r"Parameter at index \d+ with name (\S+) has been marked as ready twice", text)
    if twice:
        return f"{twice.group(1)} marked ready twice"
    return re.split(r"(?<=[.!])\s", text.strip())[0].strip()


def first_words(error):
    """The error's first sentence, as torch wrote it (the part a search engine finds)."""
    return re.split(r"(?<=\.)\s", str(error).strip(), maxsplit=1)[0]


def gathered(error):
    """`rank 0: ...; rank 1: ...`: what each rank's error says, or `no error`; every rank calls it."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, named_in(error) if error else None)
    if len(set(every)) == 1 and every[0]:
        return f"every rank: {every[0]}", every
    return "; ".join(f"rank {r}: {said or 'no error'}" for r, said in enumerate(every)), every


def stop(what, fix):
    """A failure of the model, not of the input: one line from rank 0, then every rank exits 1.
    The barrier: no rank leaves (and has torchrun end the others) before the line is out."""
    print0(f"error: {what} ({fix})", sys.stderr)
    dist.barrier()
    raise SystemExit(1)


def fail_bare(initial, batches, loader, device, args):
    """--mode bare: the error, as one line naming every rank's parameters; exit 1."""
    error, when = reproduce_bare(initial, batches, device)
    said, every = gathered(error)
    free_error_frames(error)
    if error is None:  # not with this model; a model whose every parameter takes part gets here
        print0("no error: every rank used every parameter")
        return True
    extra = {"reproductions": {"plain DDP": {"error": first_words(error), "per_rank": every}}}
    report([None], 0.0, loader, None, extra, device, args)
    stop(f'DDP raised "{first_words(error)}" {when}: parameters that received no gradient: {said}', FIXES)


def report_reproduction(name, reproduce, initial, batches, device, explanation):
    """One line per reproduction (rank 0), with what each rank's DDP said; the metrics' record of it."""
    error, when = reproduce(initial, batches, device)
    said, every = gathered(error)
    free_error_frames(error)
    if error is None:
        print0(f"{name}: no error {when} in torch {torch.__version__} ({said})")
    else:
        named = "" if set(every) == {first_words(error)} else f" | {said}"  # not the same sentence twice
        print0(f'{name}: reproduced {when}: "{first_words(error)}"{named} | {explanation}')
    return {"error": first_words(error) if error else None, "per_rank": every}


def report_default_sync(error, default):
    """One line: the default buffer sync's error where torch raises one, else what it leaves."""
    said, every = gathered(error)
    free_error_frames(error)
    flag = next(iter(no_buffer_broadcast()))
    if error:
        print0(f'default buffer sync: reproduced in the first backward: "{first_words(error)}" '
               f"({said.split(':')[0]}) | torch {torch.__version__} (pytorch#175024, fixed by "
               f"pytorch#175851): pass {flag}=False")
    else:
        agree = "yes" if buffers_agree(default) else "no (each forward updates them after the broadcast)"
        print0(f"default buffer sync: no error in torch {torch.__version__} (DDP keeps the buffers' version "
               f"counters across its broadcast since pytorch#175851); BatchNorm statistics agree across ranks "
               f"after training: {agree}")
    return {"default_sync_error": first_words(error) if error else None, "per_rank": every}


def buffers_agree(module):
    """Whether every rank's buffers (BatchNorm's running statistics) equal rank 0's, bit for bit."""
    same = torch.ones(1, device=next(module.parameters()).device)
    for buffer in module.buffers():
        theirs = buffer.clone()
        dist.broadcast(theirs, src=0)
        same *= float(torch.equal(theirs, buffer))
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item())


def measure_and_check(copies, curves, args):
    """The copies' table printed, and what the mode promises checked: the metrics' copies and checks."""
    table = measure(copies, curves)
    print_table(table)
    return {"copies": table, "checks": mode_checks(copies, table, args)}


def measure(copies, curves):
    """Per copy: bytes per step, median step time, losses, DDP's logging data, untouched parameters."""
    base = statistics.median(copies[0].seconds[1:])
    table = {}
    for c, curve in zip(copies, curves):
        step = statistics.median(c.seconds[1:])  # step 1 builds buckets and, under static_graph, learns the graph
        table[c.name] = {"bytes_per_step": sum(c.sent[-1]), "buckets_per_step": len(c.sent[-1]),
                         "trainable_bytes": trainable_bytes(c), "step_time_s": step, "vs_first": step / base,
                         "first_loss": curve[0], "final_loss": curve[-1], "losses": curve,
                         "spare_unchanged": unchanged(c, "spare."), "block_unchanged": unchanged(c, "block."),
                         "logging_data": logging_data(c)}
    return table


def unchanged(c, prefix):
    """Whether every parameter under `prefix` is bit for bit what it was before training."""
    return all(torch.equal(p, c.weights_before[k]) for k, p in c.module.named_parameters() if k.startswith(prefix))


def trainable_bytes(c):
    return sum(p.numel() * p.element_size() for p in c.module.parameters() if p.requires_grad)


def logging_data(c):
    """DDP's own view of a copy (model._get_ddp_logging_data(): private, and documented in DDP's help)."""
    data = c.model._get_ddp_logging_data()
    keys = ("find_unused_parameters", "static_graph", "unused_parameter_size", "can_set_static_graph", "iteration")
    return {k: data.get(k) for k in keys}


def largest_difference(a, b):
    """The largest |difference| between two copies' parameters (0.0: bit for bit the same)."""
    return max((x - y).abs().max().item() for x, y in zip(a.module.parameters(), b.module.parameters()))


def print_table(table):
    """`vs <first copy>`: a copy's median step over the first copy's, both of this run."""
    print0(f"{'copy':<18}{'bytes/step':>12}{'step (median)':>15}{'vs ' + next(iter(table)):>16}{'final loss':>12}"
           f"  spare unchanged | DDP's logging data")
    for name, t in table.items():
        print0(f"{name:<18}{t['bytes_per_step']:>12,}{t['step_time_s'] * 1e3:>12.2f} ms{t['vs_first']:>15.2f}x"
               f"{t['final_loss']:>12.4f}  {'yes' if t['spare_unchanged'] else 'NO':<15} | "
               + ", ".join(f"{k}={v}" for k, v in t["logging_data"].items() if k != "iteration"))


def mode_checks(copies, table, args):
    """What each mode promises, checked and printed: {check: value} for the metrics; a False fails the run."""
    by_name = {c.name: c for c in copies}
    # the spare layer takes part only in the all-used reference; everywhere else no step reaches it
    checks = {"spare_unchanged": all(t["spare_unchanged"] for name, t in table.items() if "all-used" not in name)}
    if args.mode == "static-graph":
        checks["max_difference_static_vs_find_unused"] = largest_difference(by_name["find-unused"],
                                                                            by_name["static-graph"])
    if args.mode == "checkpoint":
        checks["max_difference_checkpointed_vs_plain"] = max(
            largest_difference(by_name["find-unused"], by_name[n]) for n in ("non-reentrant", "reentrant+static"))
    if args.mode == "freeze":
        frozen = table["frozen"]
        checks["frozen_block_unchanged"] = frozen["block_unchanged"]
        checks["frozen_bytes_are_trainable_bytes"] = frozen["bytes_per_step"] == frozen["trainable_bytes"]
        checks["bytes_saved_per_step"] = table["find-unused"]["bytes_per_step"] - frozen["bytes_per_step"]
    for name, value in checks.items():
        print0(f"check: {name} = {value}")
    return checks


# =============================================================================
# ---- harness: recipes, each the same wherever it appears; not part of the lesson ----
# What makes the lesson above robust: the recipes of recipes/harness.py that this file uses, every definition byte for byte as there (a test compares them). A recipe can be
# lifted alone with the recipes its banner names; docs/recipes.md has the ones users lift most.
# =============================================================================
import atexit
import contextlib
import gc
import json
import multiprocessing
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


def refuse_launcher_flags(argv=None):
    """mp.spawn's --nprocs, or torchrun's flags after the script's name: one line on how to launch it."""
    script = os.path.basename(__file__)
    for arg in map(str, sys.argv[1:] if argv is None else argv):
        flag = arg.split("=")[0]
        if flag == "--nprocs":
            fail(f"{script} is launched by torchrun, which starts the processes; --nprocs is for the mp.spawn "
                 "scripts", f"torchrun --standalone --nproc-per-node=N {script} ...")
        if flag.replace("_", "-") in ("--nproc-per-node", "--nnodes", "--standalone", "--max-restarts"):
            fail(f"{flag} is torchrun's flag, given to {script}",
                 f"put it before the script's name: torchrun {arg} {script} ...")


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


# ---- recipe: restart-safe store (needs errors): init_process_group(store=...) across torchrun's restarts
def attempt_store(rank, world_size, timeout):
    """Under torchrun, a namespace of its store for this attempt alone, else None. torchrun (2.5 on) keeps
    one store across restarts: a restarted rank would read a dead attempt's keys (pytorch#135712). No
    variable tells attempts apart on every node: the store numbers them. Not all joined in `timeout`: one line."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    deadline = time.monotonic() + timeout
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=timeout))
        attempt = open_attempt(store, world_size, deadline) if rank == 0 else join_attempt(store, rank, deadline)
    except (TimeoutError, RuntimeError) as e:  # TimeoutError: who did not come; DistStoreError: no store
        if rank <= 1:  # rank 1 speaks for the ranks that waited on rank 0
            report_error("error: " + (f"{e} did not join this attempt's process group within --timeout {timeout:g} s "
                                      "(frozen, or not started on its node; raise --timeout if starting takes longer)"
                                      if isinstance(e, TimeoutError) else
                                      f"torchrun's store did not answer ({str(e).strip().splitlines()[0][:100]})")
                         + (f" [rank {rank}]" if rank else ""))
        else:
            wait_to_be_stopped()
        raise SystemExit(1) from None
    return dist.PrefixStore(f"harness/attempt/{attempt}", store)


def open_attempt(store, world_size, deadline):
    """Rank 0: open attempt n (an atomic add), answer every request with it until all joined n, else TimeoutError."""
    attempt, answered, missing = store.add("harness/attempts", 1), {}, set(range(1, world_size))
    while missing:
        for r in sorted(missing):
            asked = store.get(f"harness/ask/{r}") if store.check([f"harness/ask/{r}"]) else None
            if asked is not None and answered.get(r) != asked:
                store.set(f"harness/answer/{asked.decode()}", str(attempt))
                answered[r] = asked
            if store.check([f"harness/joined/{attempt}/{r}"]):
                missing.discard(r)
        if missing and time.monotonic() > deadline:
            raise TimeoutError(f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, sorted(missing)))}")
        time.sleep(0.05 if missing else 0)
    return attempt


def join_attempt(store, rank, deadline):
    """Another rank: ask under a nonce of its own, so it never reads an answer meant for a dead attempt."""
    nonce = os.urandom(8).hex()
    store.set(f"harness/ask/{rank}", nonce)
    while not store.check([f"harness/answer/{nonce}"]):  # polled: a timed-out wait logs C++ warnings
        if time.monotonic() > deadline:
            raise TimeoutError("rank 0")
        time.sleep(0.05)
    attempt = int(store.get(f"harness/answer/{nonce}"))
    store.set(f"harness/joined/{attempt}/{rank}", "1")
    return attempt


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
# ---- end of harness ----


if __name__ == "__main__":
    main()
