"""When DDP is slower than it should be: causes planted, a diagnosis that names each, the fixes.

Scenario: an MLP (SGD) learns a 10-class problem on 65536 samples split by a DistributedSampler, for
--max_steps optimizer steps. `--cause NAME` plants one well-known cause of slow DDP, `--cause A,B` several
at once; `--fix` trains the same with every planted cause's fix:

  loader        each sample is read in the training process (num_workers=0; a per-sample wait, as a
                file read gives): the step waits for its data. Fix: 4 worker processes that prefetch,
                persistent workers, pinned memory on GPUs (more workers than 2 cores: they wait, not
                compute; torch warns all the same, and the script says so).
  straggler     the last rank's device runs at a quarter of the others' speed (a GPU shared with other
                jobs, throttled, or older); every rank waits for it in the all-reduce. Fix: balance
                the work by speed (that rank gets 2/5 of a batch, the other 8/5), each rank's loss
                weighted by its share of the global batch (every sample weighs the same).
  accumulation  4 micro-batches a step, each backward all-reduces: 4 all-reduces instead of one.
                Fix: no_sync() on the first 3.
  host-sync     loss.item() every step: on a GPU the host waits for the queue to drain, each step.
                Fix: keep the sums on the device, read them every --log_every steps.
  threads       every process uses every core (torch.set_num_threads(cores)): the processes fight
                for the cores. Fix: as every script here does, OMP_NUM_THREADS where it is set
                (torchrun sets 1 for several processes a machine), else cores // processes threads each.
  small-batch   a per-process batch of 16: the all-reduce of 334k gradients outweighs the compute it
                should hide behind. Fix: a per-process batch of 1024 (or accumulation with no_sync).
  find-unused   find_unused_parameters=True where every parameter gets a gradient: a graph traversal
                each forward for nothing. Fix: leave it off (or static_graph=True).
  side-job      rank 0 sends dashboard statistics (.item() reads, a 50 ms request) after every micro-batch,
                on the training thread, wrapped in clock.reading(): every other rank waits for it; the
                verdict names it a straggler (rank 0). Fix: a row a step, read and sent by a thread of its own.

The diagnosis (StepClock, beyond the lesson; docs/recipes.md has it as one block for any DDP script)
times each step on every rank: waiting for data, compute (forward and backward), waiting for the other
ranks (the all-reduce not hidden behind the backward), the optimizer, and reads of the device on the
host. Every --log_every steps rank 0 prints one table and one verdict line that names every cause over
its threshold by its --cause name (a straggler by its rank), the largest share of the step first, or
`none`; `network` where the ranks span machines and wait what the gradients' all-reduce needs at the bus
bandwidth a short probe measured at start (or --busbw gave). On GPUs it times with events and
synchronizes only when it reports. `--profile DIR` writes a torch.profiler trace per rank for Perfetto.

Launch:
    torchrun --standalone --nproc-per-node=gpu ddp_slow.py --cause accumulation          # every GPU
    torchrun --standalone --nproc-per-node=gpu ddp_slow.py --cause accumulation --fix
    CUDA_VISIBLE_DEVICES= torchrun --standalone --nproc-per-node=2 ddp_slow.py --device cpu --cause straggler
    CUDA_VISIBLE_DEVICES= torchrun --standalone --nproc-per-node=2 ddp_slow.py --device cpu --cause loader --fix
    CUDA_VISIBLE_DEVICES= torchrun --standalone --nproc-per-node=2 ddp_slow.py --device cpu --cause loader,side-job,accumulation
    torchrun --nnodes=2 --node-rank=R --nproc-per-node=1 --master-addr=HOST0 ddp_slow.py --device cpu   # network?
    torchrun --standalone --nproc-per-node=2 ddp_slow.py --device cpu --profile traces   # then ui.perfetto.dev
    python ddp_slow.py --device cpu                     # a one-process world (nothing to wait for)

Nearest siblings: ddp_unused.py and ddp_desync.py (a cause reproduced on purpose, a diagnosis that
names it, the fix side by side); docs/ddp_slow.md is the guide by symptom, with each cause's cost
measured. Beyond the lesson: the step clock and the profiler.
"""

# ---------------------------------------------------------------- imports
import argparse
import contextlib
import difflib
import os
import queue
import socket
import statistics
import sys
import threading
import time
import types
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, default_convert
from torch.utils.data.distributed import DistributedSampler

FEATURES, CLASSES = 128, 10
CAUSES = ("none", "loader", "straggler", "accumulation", "host-sync", "threads", "small-batch", "find-unused",
          "side-job")
WARMUP = 5  # steps left out of step_ms and of the diagnosis: the first steps build caches and workers


# ---------------------------------------------------------------- arguments
def parse_args(argv=None):
    p = Arguments(description=__doc__.split("\n\n")[0])
    p.add_argument("--cause", default="none", metavar="NAME[,NAME]",
                   help=f"the causes of slowness to plant, one or several (loader,straggler): {', '.join(CAUSES)}")
    p.add_argument("--fix", action="store_true", help="train the same with every planted cause's fix")
    p.add_argument("--max_steps", type=int, default=60, metavar="N", help="optimizer steps to train")
    p.add_argument("--batch_size", "--batch-size", "-b", type=int, default=1024, metavar="N",
                   help="samples per micro-batch, per process (--cause small-batch: 16 unless fixed)")
    p.add_argument("--lr", type=float, default=0.05, metavar="LR", help="SGD learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed for the data, the shuffles and the initial weights")
    p.add_argument("--samples", type=int, default=65536, metavar="N",
                   help="size of the data set (an epoch of many steps: a new epoch's first batch waits for its read)")
    p.add_argument("--width", type=int, default=512, metavar="N", help="units per hidden layer")
    p.add_argument("--log_every", type=int, default=20, metavar="N",
                   help="print the loss, the step-time table and the verdict every N steps")
    p.add_argument("--diagnosis", choices=("on", "off"), default="on",
                   help="off: no step clock (to measure what the clock costs)")
    p.add_argument("--busbw", type=float, default=None, metavar="GBPS",
                   help="the all-reduce's bus bandwidth in GB/s (10^9 bytes a second; ddp_bandwidth.py's busbw_GBps) "
                        "for the network verdict (default: a short all-reduce probe at start)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="write a torch.profiler trace per rank here (DIR/rank<R>.json; an existing folder)")
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
    args.causes = planted_causes(args.cause)
    check_positive(args, "max_steps", "batch_size", "lr", "samples", "width", "log_every", "timeout", "busbw")
    check_folders(args.metrics)
    check_profile_folder(args)
    resolve_device(args)
    if "small-batch" in args.causes and not args.fix:
        args.batch_size = 16  # the planted cause: a batch too small to hide the all-reduce behind
    args.micro = 4 if "accumulation" in args.causes else 1  # micro-batches per optimizer step
    return args


def planted_causes(text):
    """--cause A,B: the names to plant, each a cause this script knows, each once (none: nothing planted)."""
    names = text.split(",")
    for name in names:
        if name not in CAUSES:
            near = difflib.get_close_matches(name, CAUSES, n=1)
            fail(f"--cause {name!r} is not a cause this script plants",
                 (f"did you mean {near[0]}? " if near else "") + f"one of: {', '.join(CAUSES)}")
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        fail(f"--cause {text!r} names {', '.join(twice)} twice", "name each cause once")
    if "none" in names and len(names) > 1:
        fail(f"--cause {text!r} plants none and other causes", "drop none, or plant none alone")
    return tuple(name for name in names if name != "none")


# ---------------------------------------------------------------- process group
def setup(args):
    """Join the process group that torchrun describes in the environment; returns this process's device."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    procs_here = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    use_cpu_threads(procs_here)  # the cores split between this machine's processes
    if "threads" in args.causes and not args.fix:
        torch.set_num_threads(os.cpu_count())  # the planted cause: every process takes every core
    if args.device != "cpu":  # cuda, or another accelerator torch reports (xpu, hpu, npu, ...)
        device = torch.device(args.device, int(os.environ["LOCAL_RANK"]))
        torch.accelerator.set_device_index(device)  # before any work on it: one GPU per process
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend, rank=rank, world_size=world_size,
                            store=attempt_store(rank, world_size, args.timeout),  # torchrun >= 2.5 restarts: pytorch#135712
                            timeout=timedelta(seconds=args.timeout),
                            device_id=device if args.backend == "nccl" else None)
    return device


def cleanup():
    free_error_frames()  # DDP's reducer goes before the group it talks through
    dist.destroy_process_group()


# ---------------------------------------------------------------- data and model
class Samples(Dataset):
    """Points whose class is the largest of 10 fixed random projections. `read_s`: the seconds each
    sample takes to read (a file opened and decoded; waited, not computed: see docs/ddp_slow.md)."""

    def __init__(self, samples, seed, read_s=0.0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(samples, FEATURES, generator=g)
        self.y = (self.x @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(dim=1)
        self.read_s = read_s

    def __len__(self):
        return len(self.x)

    def __getitems__(self, indices):
        """A batch at once (the DataLoader asks for its indices together): one read per sample with read_s."""
        if self.read_s:
            time.sleep(self.read_s * len(indices))  # the batch's samples read one after another
        return self.x[indices], self.y[indices]


def batch_size_of(rank, args):
    """A rank's batch: --batch_size, except under a fixed straggler, where the work is split by speed: the last
    rank, 4 times slower, gets a quarter of what each other rank gets (the same total)."""
    world = dist.get_world_size()
    if "straggler" not in args.causes or not args.fix or world == 1:
        return args.batch_size
    slow = world * args.batch_size // (4 * world - 3)
    return slow if rank == world - 1 else (world * args.batch_size - slow) // (world - 1)


def global_batch(args):
    """The samples of a micro-batch over all ranks."""
    return sum(batch_size_of(rank, args) for rank in range(dist.get_world_size()))


def slower_device(forward_s, args):
    """straggler: the last rank's device runs at a quarter of the others' speed. Before its backward it waits
    3 times what its forward and backward take (3 x the forward: the backward takes about twice the forward);
    a wait, as for a slower GPU, so it takes no core from the others."""
    if "straggler" in args.causes and dist.get_rank() == dist.get_world_size() - 1:
        time.sleep(3 * 3 * forward_s)


def make_loader(device, args):
    """This rank's shard of the samples. loader: read in this process (planted), or by 4 workers that read
    ahead while the step computes (fixed)."""
    dataset = Samples(args.samples, args.seed, read_s=60e-6 if "loader" in args.causes else 0.0)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed, drop_last=True)
    workers = 4 if "loader" in args.causes and args.fix else 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if workers > cores:  # torch warns (twice a process): here the workers wait for reads, they need no core each
        print0(f"loader: {workers} workers a process on {plural(cores, 'core')}: they wait for reads, not for the "
               "cores (torch's UserWarning below says 'excessive worker creation')")
    return DataLoader(dataset, batch_size=batch_size_of(dist.get_rank(), args), sampler=sampler, drop_last=True,
                      collate_fn=default_convert,  # __getitems__ gives whole batches
                      num_workers=workers, persistent_workers=workers > 0, prefetch_factor=4 if workers else None,
                      pin_memory=device.type != "cpu")


def batches(loader):
    """Batches without end, a new shuffle each epoch: the ranks' epochs may differ in length (a fixed
    straggler), their steps may not."""
    epoch = 0
    while True:
        loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def make_model(width):
    return nn.Sequential(nn.Linear(FEATURES, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, CLASSES))


def build(device, args):
    """The DDP model and its optimizer. find-unused: DDP told to look for unused parameters (planted)."""
    torch.manual_seed(args.seed)
    module = make_model(args.width).to(device)
    optimizer = torch.optim.SGD(module.parameters(), lr=args.lr, momentum=0.9)
    model = DDP(module, device_ids=[device.index] if device.type != "cpu" else None,
                find_unused_parameters="find-unused" in args.causes and not args.fix,
                # torch 2.14, 2.15: SIGSEGV in DDP's constructor when its group is a DETAIL-checked gloo group
                process_group=ddp_group(args.timeout))
    return model, optimizer


class Dashboard:
    """side-job: rank 0 sends statistics to a dashboard (a request to a metrics server: 50 ms a row, waited). Planted:
    a row after every micro-batch, its values read (.item()) and sent on the training thread. Fixed: a row a step, the
    step's sums handed to a thread of its own, which reads and sends them while the training goes on."""
    SEND_S = 0.050

    def __init__(self, background):
        self.rows, self.queue = 0, queue.SimpleQueue()
        self.thread = threading.Thread(target=self._drain, daemon=True) if background else None
        if self.thread:
            self.thread.start()

    def write(self, *values):
        """One row, on the thread that calls it: read on the host (a GPU's host waits for the device), then sent."""
        row = [v.tolist() for v in values]
        time.sleep(self.SEND_S)
        self.rows += 1
        return row

    def _drain(self):
        while (values := self.queue.get()) is not None:
            self.write(*values)

    def close(self):
        """Every queued row sent; the rows sent."""
        if self.thread:
            self.queue.put(None)
            self.thread.join()
        return self.rows


# ---------------------------------------------------------------- train
def train_step(model, optimizer, data, clock, dashboard, device, args):
    """One optimizer step over args.micro micro-batches; returns [loss sum, samples], on the device."""
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for k in range(args.micro):
        x, y = next(data)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        clock.data_ready()
        # accumulation: every backward all-reduces (planted); fixed, only the last micro-batch's does
        sync = k == args.micro - 1 or not args.fix
        with model.no_sync() if not sync else contextlib.nullcontext():
            start = time.perf_counter()
            loss = F.cross_entropy(model(x), y)
            slower_device(time.perf_counter() - start, args)  # straggler: the others wait in the all-reduce
            # every sample weighs the same, whatever its rank's share (uneven under a fixed straggler): DDP averages
            # the ranks' gradients, so a rank's mean loss counts len(y) / (global batch / world) times
            (loss * len(y) * dist.get_world_size() / global_batch(args) / args.micro).backward()
        clock.backward_done()
        if dashboard and not args.fix:  # side-job, planted: rank 0 sends a row after every micro-batch, here
            with clock.reading():  # wrapped as the recipe asks: the others' waits still name rank 0
                dashboard.write(loss.detach(), model.module[0].weight.grad.norm())
        sums += torch.stack([loss.detach().double() * len(y), sums.new_tensor(len(y))])
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    clock.step_done()
    return sums


def log(step, window, clock, args):
    """Every --log_every steps: the global mean loss of the window, then the clock's table and verdict."""
    with clock.reading():  # one read of the device every --log_every steps
        dist.all_reduce(window)
        loss = (window[0] / window[1]).item()
    print0(f"step {step}/{args.max_steps} | loss {loss:.4f}")
    clock.report(step)
    return loss


def train(model, optimizer, data, clock, dashboard, device, args):
    """The steps; returns (global loss of each --log_every window, seconds of each step)."""
    losses, seconds, running = [], [], 0.0
    window = torch.zeros(2, dtype=torch.float64, device=device)
    with profiled(args) as profiler:
        for step in range(1, args.max_steps + 1):
            start = time.perf_counter()
            sums = train_step(model, optimizer, data, clock, dashboard, device, args)
            if dashboard and args.fix:  # side-job, fixed: a row a step, read and sent by the dashboard's thread
                dashboard.queue.put((sums,))
            if "host-sync" in args.causes and not args.fix:
                with clock.reading():  # planted: the host waits for the device's queue every step
                    running += sums[0].item()
            window += sums
            if step % args.log_every == 0 or step == args.max_steps:
                losses.append(log(step, window, clock, args))
                window.zero_()
            seconds.append(time.perf_counter() - start)
            profiler.step()
    return losses, seconds


# ---------------------------------------------------------------- report
def report(losses, seconds, in_sync, verdict, batches_per_epoch, args):
    """Rank 0 writes the metrics and prints the `done:` line."""
    steady = seconds[WARMUP:] or seconds
    step_ms = 1000 * statistics.median(steady)
    # samples a step, every rank's (the same total planted and fixed: samples_per_s compares the two)
    samples = args.micro * global_batch(args)
    summary = {
        "script": os.path.basename(__file__), "world_size": dist.get_world_size(), "backend": dist.get_backend(),
        "device": args.device, "torch": torch.__version__, "steps": len(seconds),
        "epochs": -(-len(seconds) * args.micro // batches_per_epoch),  # passes begun over this rank's shard
        "steps_per_epoch": batches_per_epoch // args.micro, "batch_size": args.batch_size, "micro_batches": args.micro,
        "elapsed_s": sum(seconds), "samples_per_s": 1000 * samples / step_ms, "first_loss": losses[0],
        "final_loss": losses[-1], "losses": losses, "replicas_in_sync": in_sync, "resumed_from_epoch": 0,
        "cause": args.cause, "fixed": args.fix, "step_ms": step_ms, "samples_per_step": samples,
        "threads": torch.get_num_threads(), "diagnosis": args.diagnosis == "on", **verdict,
    }
    if dist.get_rank() == 0 and args.metrics:
        write_json(args.metrics, summary)
    print0(f"done: {summary['script']} | {plural(summary['world_size'], 'process')} on {args.device} "
           f"({summary['backend']}) | torch {torch.__version__} | --cause {args.cause}{' --fix' if args.fix else ''}"
           f" | {step_ms:.1f} ms a step (median after {WARMUP}) | verdict "
           f"{', then '.join(verdict.get('causes') or [str(verdict.get('verdict'))])} | "
           f"loss {losses[0]:.4f} -> {losses[-1]:.4f} | replicas {'in sync' if in_sync else 'DIFFER'}")


# ---------------------------------------------------------------- main
@record  # under torchrun, an uncaught exception's traceback is its report's root cause
def main():
    """One process of the job; torchrun (or the user) describes the job in the environment."""
    args = check_args(parse_args())
    prepare_rendezvous(args)  # plain `python`: a world of one; a hand-made launch: check the port
    device = setup(args)
    try:
        with explained_failures(args.timeout):
            loader = make_loader(device, args)
            model, optimizer = build(device, args)
            clock = StepClock(model, device, skip=WARMUP, busbw=args.busbw) if args.diagnosis == "on" else NoClock()
            print0(f"--cause {args.cause}{' --fix' if args.fix else ''} | {args.max_steps} steps of "
                   f"{args.micro} x {batch_size_of(dist.get_rank(), args)} samples per rank | "
                   f"{plural(torch.get_num_threads(), 'thread')}")
            dashboard = Dashboard(background=args.fix) if "side-job" in args.causes and dist.get_rank() == 0 else None
            losses, seconds = train(model, optimizer, batches(loader), clock, dashboard, device, args)
            verdict = clock.report(args.max_steps, final=True)
            in_sync = replicas_in_sync(model.module, device)
            verdict["dashboard_rows"] = dashboard.close() if dashboard else 0
            report(losses, seconds, in_sync, verdict, len(loader), args)
            del model, optimizer, clock
    finally:
        cleanup()
    if not in_sync:
        sys.exit(1)


# ---- beyond the lesson: the step clock (docs/recipes.md, "Where a step's time goes") and the profiler ----
# (StepClock to table: the recipe's block, as pasted there; test_slow.py compares them)
class StepClock:
    """Where each rank's step goes: waiting for data, compute (forward and backward), waiting for the other
    ranks (the all-reduce not hidden behind the backward: from the last gradient to backward()'s return),
    the optimizer, and host reads of device values. Call data_ready() when a batch is on the device,
    backward_done() after each backward, step_done() after optimizer.step(), wrap each .item() in
    `with clock.reading():`, and report(step) on every rank every N steps (it gathers: a collective).
    On GPUs the marks are events, read only in report(); on the CPU, the host's clock. Construct it on every rank
    together, after DDP(): it times a few matrix products and, unless `busbw` (GB/s) is given, an all-reduce."""
    PARTS = ("data", "compute", "comm wait", "optimizer", "host reads")

    def __init__(self, model, device, skip=5, busbw=None):
        self.device, self.skip, self.events = device, skip, device.type != "cpu"
        self.params = [p for p in model.parameters() if p.requires_grad]
        for p in self.params:  # fires as each gradient is ready: the last one ends the backward's compute
            p.register_post_accumulate_grad_hook(self._grad_ready)
        self.find_unused = getattr(model, "find_unused_parameters", False) and not getattr(model, "static_graph", 0)
        self.threads_fight = not self.events and threads_fight()
        self.link = link_probe(sum(p.numel() * p.element_size() for p in self.params), device, busbw)
        if dist.get_rank() == 0 and self.link["wire_ms"] is not None:
            print(f"step clock: {dist.get_world_size()} ranks on {self.link['machines']} machine(s) | all-reduce busbw "
                  f"{self.link['busbw_GBps']:.4g} GB/s ({self.link['probe']}) | the gradients' "
                  f"{self.link['gradient_bytes'] / 1e6:.2f} MB at that rate: {self.link['wire_ms']:.1f} ms", flush=True)
        # per window: 5 parts (ms), steps, micro-batches, reads, backwards that reached every parameter, own ms,
        # and the comm wait of a step's backwards but its longest (several all-reduces a step: accumulation)
        self.window, self.total = [0.0] * 11, [0.0] * 11
        self.pending, self.steps, self.grads, self.waits = [], 0, 0, []
        self.mark = self.ready = self._now()

    def _now(self):
        if not self.events:
            return time.perf_counter()
        event = torch.Event(device=self.device, enable_timing=True)
        event.record()
        return event

    def _grad_ready(self, _):
        self.grads += 1
        if self.events:
            self.ready.record()  # the same event, recorded again: the last gradient's moment is kept
        else:
            self.ready = time.perf_counter()

    def _add(self, part, start, end):
        if self.events:  # read in report(), once the device has passed them
            self.pending.append((part, start, end, self.steps))
        else:
            self.window[part] += 1000 * (end - start)
            self.waits += [1000 * (end - start)] if part == 2 else []

    def data_ready(self):
        t0 = time.perf_counter()
        now = self._now()
        self._add(0, self.mark, now)
        self.mark, self.grads = now, 0
        self.ready = torch.Event(device=self.device, enable_timing=True) if self.events else now
        self.window[9] += 1000 * (time.perf_counter() - t0)

    def backward_done(self):
        t0 = time.perf_counter()
        now = self._now()
        ready = self.ready if self.grads else self.mark
        self._add(1, self.mark, ready)
        self._add(2, ready, now)
        self.window[6] += 1
        self.window[8] += self.grads >= len(self.params)
        self.mark = now
        self.window[9] += 1000 * (time.perf_counter() - t0)

    def step_done(self):
        t0 = time.perf_counter()
        now = self._now()
        self._add(3, self.mark, now)
        self.mark, self.steps = now, self.steps + 1
        self.window[5] += 1
        self.window[10] += sum(self.waits) - max(self.waits, default=0.0)
        self.waits = []
        if self.steps <= self.skip:  # warm-up: forgotten
            self.window, self.pending = [0.0] * 11, []
        self.window[9] += 1000 * (time.perf_counter() - t0)

    @contextlib.contextmanager
    def reading(self):
        """Around a read of a device value on the host (.item(), .tolist(), print(tensor)): its time and count."""
        t0 = time.perf_counter()
        yield
        self.window[4] += 1000 * (time.perf_counter() - t0)
        self.window[7] += 1
        self.mark = self._now()  # the read is not data wait

    def report(self, step, final=False):
        """Every rank: the window (or, final, the whole run after warm-up) gathered; rank 0 prints the table
        and the verdict. Returns the verdict, on every rank."""
        t0 = time.perf_counter()
        if self.events:
            torch.accelerator.synchronize(self.device)  # the only wait for the device: once a report
            waits = {}
            for part, start, end, step in self.pending:
                self.window[part] += start.elapsed_time(end)
                waits.setdefault(step, []).extend([start.elapsed_time(end)] if part == 2 else [])
            self.window[10] += sum(sum(w) - max(w, default=0.0) for w in waits.values())
            self.pending = []
        self.window[9] += 1000 * (time.perf_counter() - t0)
        if self.steps > self.skip:  # a report within the warm-up (N under skip) is left out of the whole run's
            self.total = [a + b for a, b in zip(self.total, self.window)]
        rows = self._gather(self.total if final else self.window)
        self.window = [0.0] * 11
        found = diagnose(rows, self.find_unused, self.link)
        if dist.get_rank() == 0:
            print(table(step, rows, found, final), flush=True)
        self.mark = self._now()  # the report is not data wait
        return found

    def _gather(self, numbers):
        mine = torch.tensor(numbers + [float(self.threads_fight)], dtype=torch.float64, device=self.device)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        return torch.stack(every).tolist()


def threads_fight(size=256, repeats=5):
    """True when this process's CPU threads fight: more threads than the machine's cores over its processes
    (LOCAL_WORLD_SIZE), or they buy no speed: the same matrix products, with its threads and with one, timed
    at once on every process of the machine (call it on all of them together, e.g. after DDP())."""
    threads = torch.get_num_threads()
    if threads == 1:
        return False
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if threads * int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > cores:
        return True  # more threads than this machine's cores: they fight whenever the ranks compute at once
    a = torch.randn(size, size)
    seconds = []
    for n in (threads, 1, threads, 1):
        torch.set_num_threads(n)
        start = time.perf_counter()
        for _ in range(repeats):
            a @ a
        seconds.append(time.perf_counter() - start)
    torch.set_num_threads(threads)
    return min(seconds[0], seconds[2]) > 0.7 * min(seconds[1], seconds[3])  # a healthy N threads: near 1/N


def link_probe(gradient_bytes, device, busbw=None, repeats=3):
    """What the network verdict compares with: the machines the ranks run on (told by their host names) and the
    all-reduce's bus bandwidth in GB/s, given (ddp_bandwidth.py's busbw_GBps) or timed: an all-reduce of the
    gradients' size (at most 4 MiB) once to warm up, then `repeats` times, the slowest rank's time (nccl-tests'
    busbw: bytes x 2(n-1)/n over the seconds). wire_ms: the gradients' all-reduce at that rate. Every rank calls it."""
    world, hosts = dist.get_world_size(), [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    link = {"machines": len(set(hosts)), "gradient_bytes": gradient_bytes, "busbw_GBps": busbw, "probe": "given",
            "wire_ms": None}
    if world == 1:
        return {**link, "busbw_GBps": None, "probe": "one rank: no all-reduce"}
    if busbw is None:
        x = torch.zeros(max(1, min(gradient_bytes, 4 << 20) // 4), device=device)
        seconds = torch.zeros(1, dtype=torch.float64, device=device)
        for n in (1, repeats):  # the first: the ranks meet, and the buffers are made
            start = time.perf_counter()
            for _ in range(n):
                dist.all_reduce(x)
            if device.type != "cpu":
                torch.accelerator.synchronize(device)
            seconds[0] = (time.perf_counter() - start) / n
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        link["busbw_GBps"] = 4 * x.numel() * 2 * (world - 1) / world / seconds.item() / 1e9
        link["probe"] = f"probed: {repeats} all-reduces of {4 * x.numel() / 1e6:.2f} MB, {1000 * seconds.item():.1f} ms each"
    link["wire_ms"] = 1000 * gradient_bytes * 2 * (world - 1) / world / (link["busbw_GBps"] * 1e9)
    return link


FIXES = {"loader": "DataLoader workers that read ahead (num_workers, persistent_workers, prefetch_factor, pin_memory)",
         "straggler": "give that rank the same work as the others (its data share, its device, a side job on it: "
                      "once a step, off the training thread, or on every rank)",
         "threads": "cores // processes threads each (torch.set_num_threads, OMP_NUM_THREADS)",
         "accumulation": "no_sync() on every micro-batch but the last",
         "network": "fewer bytes or fewer all-reduces over the link: a larger bucket_cap_mb, compressed gradients "
                    "(ddp_comm_hooks.py: bf16, PowerSGD), accumulation under no_sync()",
         "small-batch": "a larger batch per process, or accumulation under no_sync()",
         "host-sync": "keep running sums on the device, read them every N steps",
         "find-unused": "find_unused_parameters=False, or static_graph=True",
         "none": "nothing dominates: the step is compute"}


def diagnose(rows, find_unused, link):
    """Every cause over its threshold, the largest share of the step first, from every rank's row (5 parts in ms,
    steps, micro-batches, reads, full backwards, own ms, the waits of a step's backwards but its longest, threads
    fight) and the link (link_probe). A late rank makes the others wait, whatever made it late and wherever its
    own time went: a straggler is told by the others' waits, the other signals where no straggler swells them."""
    steps = [max(r[5], 1) for r in rows]
    per_step = [[r[i] / s for i in range(5)] for r, s in zip(rows, steps)]
    step_ms = [sum(p) for p in per_step]
    step = max(sum(step_ms) / len(step_ms), 1e-9)
    share = [[x / max(t, 1e-9) for x in p] for p, t in zip(per_step, step_ms)]
    mean = [sum(s[i] for s in share) / len(share) for i in range(5)]
    busy, waits = [p[0] + p[1] for p in per_step], [p[2] for p in per_step]  # busy: the work before the wait
    least = waits.index(min(waits))  # the rank the others wait for waits least
    late = min([w for rank, w in enumerate(waits) if rank != least], default=waits[least]) - waits[least]
    longest = min((r[2] - r[10]) / s for r, s in zip(rows, steps))  # a step's longest wait: its last all-reduce
    extra = [r[10] / max(sum(r[:5]), 1e-9) for r in rows]  # the waits of a step's backwards but its longest
    micro, reads = rows[0][6] / steps[0], min(r[7] / s for r, s in zip(rows, steps))
    found, wire = {}, link["wire_ms"]
    if any(r[11] for r in rows):
        found["threads"] = mean[1] / 2  # threads that fight take about twice the compute: half of it is the fight
    if late > 0.25 * step:
        found["straggler"] = late / step  # the others wait for it in the all-reduce
    if min(s[0] for s in share) > 0.15:
        found["loader"] = min(s[0] for s in share)
    if micro > 1 and max(extra) > 0.04:  # several backwards a step wait for an all-reduce, not only the last
        found["accumulation"] = min(extra)  # its cost: those all-reduces on the rank that waits least
    if link["machines"] > 1 and wire and "straggler" not in found and wire > 0.25 * step and longest > 0.5 * wire:
        found["network"] = longest / step  # the ranks even, the wait what the link needs for the gradients
    elif min(s[2] for s in share) > 0.4:  # one all-reduce a step, and most of the step waits for it
        found["small-batch"] = min(s[2] for s in share)
    if reads >= 0.5:  # on every rank: one rank's reads make it a straggler
        found["host-sync"] = mean[4]
    if find_unused and all(r[8] >= r[6] for r in rows):
        found["find-unused"] = 0.0  # its cost: too small to time on a small model, named from its cause
    causes = sorted(found, key=found.get, reverse=True)  # a tie keeps the order above
    own = sum(r[9] for r in rows) / max(sum(sum(r[:5]) for r in rows), 1e-9)
    return {"verdict": causes[0] if causes else "none", "causes": causes, "cause_shares": found,
            "slowest_rank": least if "straggler" in found else None, "busiest_rank": busy.index(max(busy)),
            "step_ms_per_rank": step_ms, "shares": dict(zip(StepClock.PARTS, mean)), "reads_per_step": reads,
            "micro_batches_per_step": micro, "diagnosis_overhead": own, "comm_wait_ms": longest, **link}


def table(step, rows, found, final):
    """One row per rank (ms a step, each part's share), then the verdict line: each cause, its fix, its share."""
    head = "rank | ms/step | " + " | ".join(f"{p:>10}" for p in StepClock.PARTS) + " | reads/step"
    lines = [f"{'whole run' if final else f'steps to {step}'}: where a step's time goes", head]
    for rank, (r, ms) in enumerate(zip(rows, found["step_ms_per_rank"])):
        steps = max(r[5], 1)
        parts = " | ".join(f"{100 * r[i] / steps / max(ms, 1e-9):9.0f}%" for i in range(5))
        lines.append(f"{rank:>4} | {ms:7.1f} | {parts} | {r[7] / steps:10.2f}")
    named = []
    for cause in found["causes"]:
        rank = f" (rank {found['slowest_rank']})" if cause == "straggler" else ""
        named.append(f"{cause}{rank}: {FIXES[cause]} [{100 * found['cause_shares'][cause]:.0f}% of the step]")
    return "\n".join(lines + [f"verdict: {'; then '.join(named) or 'none: ' + FIXES['none']} | the clock's own cost "
                              f"{100 * found['diagnosis_overhead']:.2f}%"])


class NoClock:
    """--diagnosis off: the same calls, nothing measured (what the clock costs is the difference)."""

    def data_ready(self):
        pass

    backward_done = step_done = data_ready

    def reading(self):
        return contextlib.nullcontext()

    def report(self, step, final=False):
        return {"verdict": None, "causes": [], "slowest_rank": None}


def check_profile_folder(args):
    """--profile DIR: an existing folder (a trace per rank is written into it), at least 10 steps to trace."""
    if args.profile is None:
        return
    if not os.path.isdir(args.profile):
        fail(f"--profile {args.profile}: " + ("a file, not a folder" if os.path.exists(args.profile)
                                               else "no such folder"), "create the folder first, or name another")
    if args.max_steps < 10:
        fail(f"--profile traces steps 6 to 10, and --max_steps is {args.max_steps}", "pass --max_steps 10 or more")


@contextlib.contextmanager
def profiled(args):
    """--profile DIR: torch.profiler over steps 6-10 (5 waited, 2 of warm-up, 3 recorded), DIR/rank<R>.json."""
    if not args.profile:
        yield types.SimpleNamespace(step=lambda: None)
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    path = os.path.join(args.profile, f"rank{dist.get_rank()}.json")
    with torch.profiler.profile(activities=activities,
                                schedule=torch.profiler.schedule(wait=5, warmup=2, active=3, repeat=1),
                                on_trace_ready=lambda prof: prof.export_chrome_trace(path)) as prof:
        yield prof


# =============================================================================
# ---- harness: recipes, each the same wherever it appears; not part of the lesson ----
# What makes the lesson above robust: the recipes of recipes/harness.py that this file uses, every definition byte for byte as there (a test compares them). A recipe can be
# lifted alone with the recipes its banner names; docs/recipes.md has the ones users lift most.
# =============================================================================
import atexit
import gc
import json
import multiprocessing
import re
import signal
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
