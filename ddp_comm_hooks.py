"""Gradient compression with DDP communication hooks: what each hook sends, costs and loses.

Scenario: one MLP (596,490 parameters, all but 1,546 of them in four weight matrices)
is trained several times over, side by side in one job: every copy starts from
the same weights and sees the same batches, and each one runs under its own DDP
communication hook (`model.register_comm_hook(state, hook)`), which DDP calls with each
bucket of gradients once the bucket is full:

    allreduce         DDP's default: the fp32 bucket all-reduced (`allreduce_hook`, registered so
                      its bytes are counted; torch documents it as the same as no hook, and on
                      gloo it gave bitwise the same weights as no hook after 30 steps)
    fp16              `fp16_compress_hook`: the bucket cast to float16, all-reduced, cast back
    bf16              `bf16_compress_hook`: the same in bfloat16 (fp32's range, fewer digits)
    powersgd          `powerSGD_hook`: each weight matrix M (n x m) travels as two rank-R factors,
                      P = M Q (n x R) and then Q = M^T P (m x R), biases uncompressed; error
                      feedback carries what the approximation dropped into the next step; the
                      first --powersgd_warmup steps are plain all-reduces
    batched_powersgd  `batched_powerSGD_hook`: the whole bucket as one square matrix (see below)

Each hook is wrapped so that it counts the bytes it hands to all-reduce, bucket by
bucket. The copies take turns step by step, so a busy machine slows them all alike.
At the end one table: bytes per step per rank (the warm-up counted apart), median step
time, final training loss and its gap to the allreduce run. A ring all-reduce moves
about 2(N-1)/N times these bytes over each rank's link.

Measured (2 CPU processes, gloo, defaults, torch 2.14.1): bytes per step per rank 2,385,960
(allreduce), 1,192,980 (fp16, bf16), 57,544 (powersgd rank 4: 41x fewer, after 8 plain steps);
final loss 1.1805, gap -0.0019 for fp16 and -0.0001 for bf16 (within 0.0022 for seeds 0 to 2),
+0.18 for PowerSGD (rank 16: 12x fewer bytes, +0.05). Steps took about as long with fp16/bf16
and ~1.5x as long with PowerSGD: over loopback the bytes saved are worth less than the extra
matrix products. The bytes are what carries over to a real network.

Launch:
    torchrun --standalone --nproc-per-node=gpu ddp_comm_hooks.py
    torchrun --standalone --nproc-per-node=2 ddp_comm_hooks.py --hooks fp16,powersgd --powersgd_rank 1
    torchrun --nnodes=2 --node-rank=0 --master-addr=HOST0 --master-port=29500 \\
        --nproc-per-node=8 ddp_comm_hooks.py                  # on each node, --node-rank=0/1
    CUDA_VISIBLE_DEVICES= torchrun --standalone --nproc-per-node=2 ddp_comm_hooks.py --device cpu
    python ddp_comm_hooks.py                                # a one-process world

What runs where (torch 2.14.1):
- allreduce, fp16, powersgd: gloo and NCCL. bf16: gloo all-reduces bfloat16 on CPU; NCCL
  needs version 2.10, and on a GPU the hook runs only where every rank's GPU computes
  bfloat16 natively (Ampere and later on CUDA; emulated bf16 is slow). (DDP refuses a hook *named*
  bf16_compress_hook on a torch built without CUDA and NCCL, gloo or not; the counting
  wrapper below has another name.)
- PowerSGD on gloo needs the whole model in one DDP bucket, so the script asks DDP for one
  (--bucket_cap_mb). The hook issues its P and Q all-reduces from future callbacks, which
  gloo runs on its own threads when the previous all-reduce completes, while the backward
  pass is already calling the hook for the next bucket: with two buckets the two ranks
  issued their collectives in different orders: of 8 launches with DDP's default buckets
  (1 MB, then the rest) 6 aborted ("Received data size doesn't match expected size",
  SIGABRT) and 2 hung; with one bucket none failed. ProcessGroupNCCL marks a future
  complete as soon as its work is queued on the stream, so there the callbacks run at
  once, in order, and DDP keeps its own buckets (read in the source, not run here).
- batched_powerSGD_hook runs nowhere: it views the bucket as one square matrix and passes
  its 2-D factors to `_orthogonalize`, which since the batched rewrite of PowerSGD
  (pytorch#75157) accepts only a batch of matrices (3-D) and raises a bare AssertionError
  at the first step after the warm-up. No bucket size, tensor shape or rank avoids it (the
  factors are always 2-D); a warm-up longer than the run does, by never compressing. The
  script tries `_orthogonalize` on a 2-D matrix and leaves the hook out where that fails,
  so a torch that fixes it runs it. powerSGD_hook works: it stacks its factors into 3-D
  batches itself.

Nearest sibling: ddp_gpus_torchrun.py (the same torchrun launch and loop shape); this file adds
the hooks and their measurement; what runs where and the table are beyond the lesson, and the
robustness every script shares is in the harness block at the end of the file.
"""

# ---------------------------------------------------------------- imports
import argparse
import importlib.util
import math
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

HOOK_NAMES = ("allreduce", "fp16", "bf16", "powersgd", "batched_powersgd")
CLASSES = 10


# ---------------------------------------------------------------- arguments
def parse_args(argv=None):
    p = Arguments(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", "--max_epochs", "-e", type=int, default=2, metavar="N", help="epochs to train")
    p.add_argument("--batch_size", "--batch-size", "-b", type=int, default=32, metavar="N",
                   help="samples per step, per process (the global batch is N x world size)")
    p.add_argument("--lr", type=float, default=0.02, metavar="LR", help="SGD learning rate (momentum 0.9)")
    p.add_argument("--seed", type=int, default=0, help="seed for the data and the initial weights")
    p.add_argument("--samples", type=int, default=None, metavar="N",
                   help="size of the data set (default: 768 per process: 48 steps at any world size)")
    p.add_argument("--features", type=int, default=128, metavar="N", help="inputs of the MLP")
    p.add_argument("--hidden", type=int, default=512, metavar="N", help="width of the MLP's three hidden layers")
    p.add_argument("--device", default="auto", metavar="auto|cpu|TYPE",
                   help="auto: the accelerator torch finds (cuda, xpu, hpu, npu, ...), else cpu")
    p.add_argument("--backend", default="auto", metavar="auto|NAME",
                   help="auto: the device's default (nccl on cuda, xccl on xpu, hccl on hpu/npu, gloo on cpu)")
    p.add_argument("--timeout", type=float, default=300, metavar="SECONDS",
                   help="how long a collective waits for the other ranks before failing")
    p.add_argument("--metrics", default=None, metavar="PATH", help="write a JSON summary of the run here (rank 0)")
    p.add_argument("--local-rank", "--local_rank", type=int, default=None, dest="local_rank",
                   help=argparse.SUPPRESS)  # passed by the deprecated torch.distributed.launch
    add_hook_arguments(p.add_argument_group("communication hooks"))
    refuse_launcher_flags(argv)  # --nprocs: a line on how torchrun launches this script
    return p.parse_args(argv)


def add_hook_arguments(p):
    """What is compared, and how: the hooks, DDP's buckets, PowerSGD's rank and warm-up."""
    p.add_argument("--hooks", default=None, metavar="A,B",
                   help=f"comm hooks to compare, from {','.join(HOOK_NAMES)}; allreduce (the baseline) "
                        "always runs; not given: every hook that works here")
    p.add_argument("--bucket_cap_mb", type=float, default=None, metavar="MB",
                   help="DDP's bucket size; not given: the whole model in one bucket on gloo (see the "
                        "docstring), DDP's own 25 MB (the first 1 MB) on NCCL")
    p.add_argument("--powersgd_rank", type=int, default=4, metavar="R", help="rank R of PowerSGD's factors")
    p.add_argument("--powersgd_warmup", type=int, default=8, metavar="STEPS",
                   help="steps of plain all-reduce before PowerSGD compresses (at least 2)")


def check_args(args):
    """Validate the arguments in every process, before it joins the group."""
    args.samples = args.samples or 768 * int(os.environ.get("WORLD_SIZE", 1))  # the same steps at any world size
    check_positive(args, "epochs", "batch_size", "lr", "samples", "features", "hidden", "bucket_cap_mb",
                   "powersgd_rank", "timeout")
    check_folders(args.metrics)
    resolve_device(args)
    args.hooks = choose_hooks(args.hooks, unavailable_hooks(args))
    steps = args.epochs * steps_per_epoch(args.samples, int(os.environ.get("WORLD_SIZE", 1)), args.batch_size)
    if any("powersgd" in name for name in args.hooks) and not 2 <= args.powersgd_warmup < steps:
        fail(f"{spelled('powersgd_warmup')} {args.powersgd_warmup} must be at least 2 and below the run's "
             f"{steps} steps", "DDP rebuilds its buckets after step 1, which PowerSGD's memory cannot follow; "
             "a warm-up as long as the run compresses nothing")
    choose_buckets(args)
    return args


def choose_hooks(asked, unavailable):
    """--hooks as a list with the allreduce baseline first; every name known and able to run here."""
    names = asked.split(",") if asked else [name for name in HOOK_NAMES if name not in unavailable]
    for name in names:
        if name not in HOOK_NAMES:
            fail(f"unknown hook {name!r} in --hooks", f"choose from {','.join(HOOK_NAMES)}")
        if name in unavailable:
            fail(f"the {name} hook cannot run here: {unavailable[name]}", f"leave {name} out of --hooks")
    return ["allreduce"] + [name for name in dict.fromkeys(names) if name != "allreduce"]


def choose_buckets(args):
    """On gloo, the whole model in one bucket: PowerSGD issues its P and Q all-reduces from callbacks
    that run on gloo's threads when the previous all-reduce completes, while the autograd thread may
    already be calling the hook for the next bucket. With two buckets the ranks can issue their
    collectives in different orders: a size-mismatch abort (SIGABRT) or a hang. NCCL completes its
    futures as soon as the work is queued, so the callbacks run in order: DDP's buckets stay."""
    model_mb = 4 * sum(p.numel() for p in MLP(args.features, args.hidden).parameters()) / 2**20
    if args.bucket_cap_mb is None and args.backend == "gloo":
        args.bucket_cap_mb = math.ceil(model_mb)
    elif args.backend == "gloo" and args.bucket_cap_mb < model_mb and any("powersgd" in h for h in args.hooks):
        fail(f"{spelled('bucket_cap_mb')} {args.bucket_cap_mb:g} splits the {model_mb:.1f} MB of gradients into several "
             "buckets, and PowerSGD on gloo then issues collectives in a different order on each rank",
             f"leave {spelled('bucket_cap_mb')} out, or give at least {math.ceil(model_mb)}")


def steps_per_epoch(samples, world_size, batch_size):
    """Optimizer steps per epoch: DistributedSampler pads to ceil(samples / world) per rank."""
    return math.ceil(math.ceil(samples / world_size) / batch_size)


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


# ---------------------------------------------------------------- data
def make_dataset(samples, features, seed):
    """Gaussian inputs labelled by a fixed random linear teacher: learnable, and the same on every
    rank (seeded), so the indices the sampler hands out mean the same thing everywhere."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=g)
    return TensorDataset(x, (x @ torch.randn(features, CLASSES, generator=g)).argmax(dim=1))


# ---------------------------------------------------------------- model
class MLP(nn.Sequential):
    """features -> hidden x3 -> classes, with ReLUs. Nearly all parameters sit in weight
    matrices, which PowerSGD compresses; the biases it sends as they are."""

    def __init__(self, features=128, hidden=512, classes=CLASSES):
        widths = [features, hidden, hidden, hidden]
        layers = []
        for inputs, outputs in zip(widths, widths[1:]):
            layers += [nn.Linear(inputs, outputs), nn.ReLU()]
        super().__init__(*layers, nn.Linear(hidden, classes))
        for layer in self:
            if isinstance(layer, nn.Linear):  # He init: activations keep their scale, so a small lr learns fast
                nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
                nn.init.zeros_(layer.bias)


# ---------------------------------------------------------------- communication hooks
def make_hook(name, args):
    """(state, hook, dtype it all-reduces in: None for the gradients' own) for the hook `name`."""
    if "powersgd" in name:
        # one state per model: its step count, P and Q reused across steps, the error feedback
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                            start_powerSGD_iter=args.powersgd_warmup)
        hook = powerSGD_hook.powerSGD_hook if name == "powersgd" else powerSGD_hook.batched_powerSGD_hook
        return state, hook, None
    if name == "fp16":
        return None, default_hooks.fp16_compress_hook, torch.float16
    if name == "bf16":
        return None, default_hooks.bf16_compress_hook, torch.bfloat16
    return None, default_hooks.allreduce_hook, None  # state None: the whole world


def counting(hook, wire_dtype, sent):
    """`hook`, plus a tally: appends to sent[-1] the bytes the hook hands to all-reduce for each bucket.

    The plain and cast hooks send the whole bucket, in their dtype. PowerSGD after its warm-up
    sends the uncompressed tensors, then P, then Q; its state adds exactly those element counts
    to total_numel_after_compression, so the growth across the call is what it sent.
    """
    def counting_hook(state, bucket):
        buffer = bucket.buffer()
        elements, itemsize = buffer.numel(), (wire_dtype or buffer.dtype).itemsize
        compressing = isinstance(state, powerSGD_hook.PowerSGDState) and state.iter >= state.start_powerSGD_iter
        before = state.total_numel_after_compression if compressing else 0
        future = hook(state, bucket)
        if compressing:
            elements = state.total_numel_after_compression - before
        sent[-1].append(elements * itemsize)
        return future
    return counting_hook


# ---------------------------------------------------------------- training
class Run:
    """One copy of the model under one comm hook, and what it measured: bytes and seconds per step."""

    def __init__(self, name, initial, device, args):
        self.name = name
        model = MLP(args.features, args.hidden).to(device)
        model.load_state_dict(initial)  # every copy starts from the same weights
        # ddp_group: None; under TORCH_DISTRIBUTED_DEBUG=DETAIL a group DDP can take (torch 2.14, 2.15 segfault on gloo's checked one)
        self.model = DDP(model, device_ids=[device.index] if device.type != "cpu" else None,
                         bucket_cap_mb=args.bucket_cap_mb, process_group=ddp_group(args.timeout))
        state, hook, wire_dtype = make_hook(name, args)
        self.sent, self.seconds = [], []  # per step: bytes of each bucket, and seconds
        self.model.register_comm_hook(state, counting(hook, wire_dtype, self.sent))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=0.9)
        self.totals = torch.zeros(2, dtype=torch.float64, device=device)  # [sum of losses, samples]


def train(runs, loader, device, epochs):
    """Every copy takes every step, in turns; returns each copy's global mean loss per epoch."""
    curves = [[] for _ in runs]
    for epoch in range(epochs):
        start = time.perf_counter()
        loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        for i, (xs, ys) in enumerate(loader):
            xs, ys = xs.to(device, non_blocking=True), ys.to(device, non_blocking=True)
            for k in range(len(runs)):  # a different copy goes first each step: none always meets a cold cache
                run = runs[(i + k) % len(runs)]
                run.sent.append([])
                began = time.perf_counter()
                run.optimizer.zero_grad(set_to_none=True)
                loss = F.cross_entropy(run.model(xs), ys)
                loss.backward()  # DDP hands each full bucket of gradients to the hook, which all-reduces it
                run.optimizer.step()
                if device.type != "cpu":
                    torch.accelerator.synchronize(device)  # the clock waits for the GPU's work
                run.seconds.append(time.perf_counter() - began)
                run.totals[0] += loss.detach().double() * len(xs)  # on the device: no host sync per step
                run.totals[1] += len(xs)
        totals = torch.stack([run.totals for run in runs])
        dist.all_reduce(totals)  # global mean losses, every copy's in one collective
        for run, curve, (loss_sum, samples) in zip(runs, curves, totals.tolist()):
            curve.append(loss_sum / samples)
            run.totals.zero_()
        print0(f"epoch {epoch + 1}/{epochs} | loss " + " ".join(f"{r.name} {c[-1]:.4f}" for r, c in zip(runs, curves))
               + f" | {time.perf_counter() - start:.2f} s")
    return curves


# ---------------------------------------------------------------- main
def compare_hooks(device, args):
    """Train one copy of the model per hook on the same data, then check, tabulate and record them."""
    torch.manual_seed(args.seed)
    dataset = make_dataset(args.samples, args.features, args.seed)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)  # each rank its own 1/N
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    initial = MLP(args.features, args.hidden).state_dict()
    args.hooks = bf16_where_native(args.hooks, device)
    # the hooks that can run were chosen from this machine's packages (numpy, torch): the same copies everywhere
    check_same_on_every_rank(sum(1 << HOOK_NAMES.index(h) for h in args.hooks), "hooks (a bit mask of HOOK_NAMES)",
                             "install the same torch and numpy on every node, or name them with --hooks")
    runs = [Run(name, initial, device, args) for name in args.hooks]
    print0(f"{len(runs)} copies of an MLP with {sum(t.numel() for t in initial.values()):,} parameters, "
           f"{len(loader)} steps per epoch, hooks: {', '.join(args.hooks)}")
    start = time.perf_counter()
    curves = train(runs, loader, device, args.epochs)
    elapsed = time.perf_counter() - start
    in_sync = replicas_in_sync(nn.ModuleList(run.model.module for run in runs), device)
    per_hook = summarize(runs, curves, args)  # and prints the table
    report(per_hook, elapsed, loader, in_sync, device, args)
    return in_sync


def report(per_hook, elapsed, loader, in_sync, device, args):
    """Rank 0 writes the metrics (--metrics) and prints the `done:` line."""
    base, samples = per_hook["allreduce"], len(loader.sampler) * dist.get_world_size()  # padded: as trained
    summary = {
        "script": os.path.basename(__file__), "world_size": dist.get_world_size(), "backend": dist.get_backend(),
        "device": device.type, "torch": torch.__version__, "epochs": args.epochs,
        "steps": args.epochs * len(loader), "steps_per_epoch": len(loader), "batch_size": args.batch_size,
        "elapsed_s": elapsed, "samples_per_s": len(per_hook) * args.epochs * samples / elapsed,
        "first_loss": base["first_loss"], "final_loss": base["final_loss"], "losses": base["losses"],
        "replicas_in_sync": in_sync, "resumed_from_epoch": 0, "bucket_cap_mb": args.bucket_cap_mb,
        "powersgd_rank": args.powersgd_rank, "powersgd_warmup": args.powersgd_warmup, "hooks": per_hook,
    }
    if dist.get_rank() == 0 and args.metrics:
        write_json(args.metrics, summary)
    smallest = min(per_hook, key=lambda name: per_hook[name]["bytes_per_step"])
    print0(f"done: {summary['script']} | {plural(summary['world_size'], 'process')} on {device.type} "
           f"({summary['backend']}) | torch {torch.__version__} | {plural(args.epochs, 'epoch')} x "
           f"{plural(len(per_hook), 'hook')} | allreduce loss {base['first_loss']:.4f} "
           f"-> {base['final_loss']:.4f} | {smallest} {per_hook[smallest]['compression']:.1f}x fewer bytes, gap "
           f"{per_hook[smallest]['loss_gap']:+.4f} | replicas {'in sync' if in_sync else 'DIFFER'}")


@record  # under torchrun, an uncaught exception's traceback is its report's root cause
def main():
    """One process of the job; torchrun (or the user) describes the job in the environment."""
    args = check_args(parse_args())
    prepare_rendezvous(args)  # plain `python`: a world of one; a hand-made launch: check the port
    device = setup(args)
    try:
        with explained_failures(args.timeout):
            in_sync = compare_hooks(device, args)
    finally:
        cleanup()
    if not in_sync:
        sys.exit(1)  # the replicas differ: DDP did not keep them identical


# ---- beyond the lesson: what runs where (this torch, numpy, the GPU's bf16), the bytes and times tabulated ----
def unavailable_hooks(args):
    """{hook: why it cannot run on this machine, with this torch}."""
    why = {}
    # whether the GPU computes bf16 is asked after set_device, by each process (bf16_where_native)
    if args.backend == "nccl" and torch.cuda.nccl.version() < (2, 10):
        why["bf16"] = "NCCL all-reduces bfloat16 from version 2.10 on"
    if importlib.util.find_spec("numpy") is None:
        why["powersgd"] = "torch's PowerSGDState draws its random projections with numpy, which is not installed"
        why["batched_powersgd"] = why["powersgd"]
    elif orthogonalize_takes_only_batches():
        why["batched_powersgd"] = (f"in torch {torch.__version__} it passes 2-D matrices to _orthogonalize, which "
                                   "takes only 3-D batches (AssertionError at the first compressed step); "
                                   "powersgd works")
    return why


def orthogonalize_takes_only_batches():
    """True where batched_powerSGD_hook fails: the helper it calls on its 2-D P and Q
    accepts only batches of matrices since pytorch#75157, and raises a bare AssertionError."""
    try:
        powerSGD_hook._orthogonalize(torch.ones(2, 1))
    except AssertionError:
        return True
    return False


def bf16_where_native(hooks, device):
    """The hooks, without bf16 where a rank's device computes bfloat16 only by emulation (CUDA
    before Ampere: slow). Asked after set_device_index, so each process asks its own GPU, and
    agreed by every rank, which must train the same copies. On the CPU bf16 stays: gloo casts
    and all-reduces it on any CPU."""
    if "bf16" not in hooks or device.type == "cpu":
        return hooks
    native = torch.tensor([int(bf16_supported(device))], device=device)
    dist.all_reduce(native, op=dist.ReduceOp.MIN)  # 0 when any rank's device only emulates bf16
    if native.item():
        return hooks
    print0("note: the bf16 hook is left out: a rank's device computes bfloat16 only by emulation")
    return [name for name in hooks if name != "bf16"]


def summarize(runs, curves, args):
    """Per hook: bytes per step per rank (warm-up apart), median step time, loss and gap to allreduce; a table."""
    compressed = any("powersgd" in run.name for run in runs)
    steady = args.powersgd_warmup if compressed else 1  # timed from the same step for all: after any warm-up
    base_bytes, base_loss = sum(runs[0].sent[-1]), curves[0][-1]
    per_hook = {}
    for run, curve in zip(runs, curves):
        per_step = [sum(buckets) for buckets in run.sent]
        per_hook[run.name] = {
            "bytes_per_step": per_step[-1], "compression": base_bytes / per_step[-1],
            "buckets_per_step": len(run.sent[-1]), "bucket_bytes": run.sent[-1],
            "warmup_steps": args.powersgd_warmup if "powersgd" in run.name else 0,
            "warmup_bytes_per_step": per_step[0], "total_bytes": sum(per_step),
            "step_time_s": statistics.median(run.seconds[steady:]), "timed_steps": len(run.seconds[steady:]),
            "first_loss": curve[0], "final_loss": curve[-1], "loss_gap": curve[-1] - base_loss, "losses": curve,
        }
    print0(f"{'hook':<17}{'bytes/step/rank':>16}{'vs allreduce':>14}{'step (median)':>15}{'final loss':>12}{'gap':>9}")
    for name, h in per_hook.items():
        print0(f"{name:<17}{h['bytes_per_step']:>16,}{h['compression']:>13.1f}x{h['step_time_s'] * 1e3:>12.1f} ms"
               f"{h['final_loss']:>12.4f}{h['loss_gap']:>+9.4f}")
        if h["warmup_steps"]:
            print0(f"{'':<17}(first {h['warmup_steps']} steps: {h['warmup_bytes_per_step']:,} bytes, plain all-reduce)")
    return per_hook


# =============================================================================
# ---- harness: recipes, each the same wherever it appears; not part of the lesson ----
# What makes the lesson above robust: the recipes of recipes/harness.py that this file uses, every definition byte for byte as there (a test compares them). A recipe can be
# lifted alone with the recipes its banner names; docs/recipes.md has the ones users lift most.
# =============================================================================
import atexit
import contextlib
import gc
import inspect
import json
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
# ---- end of harness ----


if __name__ == "__main__":
    main()
