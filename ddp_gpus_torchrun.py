"""The `Trainer` of its nearest sibling, ddp_gpus.py, launched by torchrun, with an elastic snapshot.

Scenario: `nn.Linear(20, 1)` learns a fixed linear map from 2048 noisy samples, one
process per GPU, started by torchrun, which sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR
and MASTER_PORT. Snapshots let a job torchrun restarts continue (another run's: with `--resume`).
`DistributedSampler` gives each process its own shard of the data, DDP averages the
gradients, and every process ends with the same parameters (checked at the end).
Each process prints the seed's line (`[GPU: 0] Epoch: 0 | Batchsize: 32 | Steps: 32`,
`CPU` on CPU); rank 0 adds the epoch's loss over all processes.

Launch:
    torchrun --standalone --nproc-per-node=gpu --max-restarts=3 ddp_gpus_torchrun.py --max_epochs 5  # 3 restarts
    torchrun --nnodes=2 --node-rank=0 --master-addr=HOST0 --master-port=29500 --nproc-per-node=8 ddp_gpus_torchrun.py
    CUDA_VISIBLE_DEVICES= torchrun --nproc-per-node=2 ddp_gpus_torchrun.py --device cpu

Over the seed this fixes: a loss that can learn (MSE on targets that depend on the
inputs; the seed's cross-entropy over one output is always zero), `torch.optim.SGD`,
the same data set on every rank, a free port instead of a hard-coded one, a CPU path,
and a final check that the replicas agree.

The lessons of ddp_gpus.py (mp.spawn) and ddp_gpus_torchrun.py (torchrun), all above the harness, differ in
the launch and the snapshot, nothing else. The robustness every script shares (errors,
ports, timeouts, Ctrl-C, the replica check) is the harness block at the end of each file: what that file uses.
"""

# ---------------------------------------------------------------- imports
import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


# ---------------------------------------------------------------- arguments
def parse_args(argv=None):
    p = Arguments(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", "--max_epochs", "-e", type=int, default=5, metavar="N",
                   help="epochs to train")
    p.add_argument("--batch_size", "--batch-size", "-b", type=int, default=32, metavar="N",
                   help="samples per step, per process (the global batch is N x world size)")
    p.add_argument("--lr", type=float, default=0.1, metavar="LR", help="SGD learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed for the data and the initial weights")
    p.add_argument("--samples", type=int, default=2048, metavar="N", help="size of the data set")
    p.add_argument("--save_every", type=int, default=1, metavar="N", help="snapshot every N epochs")
    p.add_argument("--checkpoint", "--snapshot_path", dest="snapshot_path", metavar="PATH", help="snapshot file",
                   default=os.path.splitext(os.path.basename(__file__))[0] + ".pt")  # a copy, mine.py: mine.pt
    p.add_argument("--resume", action="store_true", help="continue a snapshot that another run wrote")
    p.add_argument("--local-rank", "--local_rank", type=int, dest="local_rank", help=argparse.SUPPRESS)  # old launcher
    p.add_argument("--device", default="auto", metavar="auto|cpu|TYPE",
                   help="auto: the accelerator torch finds (cuda, xpu, hpu, npu, ...), else cpu")
    p.add_argument("--backend", default="auto", metavar="auto|NAME",
                   help="auto: the device's default (nccl on cuda, xccl on xpu, hccl on hpu/npu, gloo on cpu)")
    p.add_argument("--timeout", type=float, default=300, metavar="SECONDS",
                   help="how long a collective waits for the other ranks before failing")
    p.add_argument("--metrics", default=None, metavar="PATH",
                   help="write a JSON summary of the run here (rank 0)")
    refuse_launcher_flags(argv)  # --nprocs: a line on how torchrun launches this script
    return p.parse_args(argv)


def check_args(args):
    """Bad input is one error line, before any training."""
    check_positive(args, "epochs", "batch_size", "lr", "samples", "timeout", "save_every")
    check_folders(args.metrics, args.snapshot_path)
    resolve_device(args)
    args.resume = continue_checkpoint(args.snapshot_path, args.resume)  # unasked: only this job's own (a restart)
    return args


# ---------------------------------------------------------------- process group
def setup(args):
    """Join the process group; returns this process's device."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_world_size = int(os.environ["LOCAL_RANK"]), int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    # the cores split between this machine's processes, on GPUs too (their loaders, their CPU work)
    use_cpu_threads(local_world_size)
    if args.device != "cpu":  # cuda, or another accelerator torch reports (xpu, hpu, npu, ...)
        device = torch.device(args.device, local_rank)
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


# ---------------------------------------------------------------- trainer
class Trainer:
    def __init__(self, model, train_dataloader, optimizer, device, save_every, snapshot_path, resume, timeout):
        self.device = device
        self.tag = f"{device.type.upper().replace('CUDA', 'GPU')}: {dist.get_rank()}"
        self.train_dataloader = train_dataloader
        self.optimizer = optimizer
        model.to(device)
        self.save_every, self.snapshot_path = save_every, snapshot_path
        self.epochs_run = self._load_snapshot(model, resume)
        # ddp_group: None; under TORCH_DISTRIBUTED_DEBUG=DETAIL a group DDP can take (torch 2.14, 2.15 segfault on gloo's checked one)
        self.model = DDP(model, device_ids=[device.index] if device.type != "cpu" else None, process_group=ddp_group(timeout))
        self.steps = 0

    def _load_snapshot(self, model, resume):
        snapshot = load_checkpoint(self.snapshot_path, ("model", "optimizer", "epochs_run"), model,  # each checked,
                                   {"optimizer": self.optimizer}) if resume else None  # then loaded into its own
        if snapshot:
            note_world_change(snapshot, len(self.train_dataloader), self.train_dataloader.batch_size)
        epochs_run = snapshot["epochs_run"] if snapshot else 0  # a rank that cannot see it would hang the job
        check_same_on_every_rank(epochs_run, "snapshot epochs", "put the snapshot where every node sees it")
        print0(f"resuming from snapshot at epoch {epochs_run}" if epochs_run else "starting from scratch")
        return epochs_run

    def _save_snapshot(self, epochs_run):
        if dist.get_rank() == 0:  # one writer; the weights without DDP's "module." prefix
            save_checkpoint({"model": self.model.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                             "epochs_run": epochs_run}, self.snapshot_path)
        dist.barrier()  # nobody reads the snapshot before it is complete

    def train(self, max_epochs):
        """The loop: an epoch is a pass over this rank's shard; returns each epoch's loss over all processes."""
        loader = self.train_dataloader
        if self.epochs_run < max_epochs:
            print0("per-process lines in the seed's format: [device: rank] Epoch: from 0 | Batchsize: per process | "
                   "Steps: per epoch; rank 0's `epoch N/M` lines count from 1 and give the loss over all processes")
        history = []
        for epoch in range(self.epochs_run, max_epochs):
            start = time.perf_counter()
            print0(f"[{self.tag}] Epoch: {epoch} | Batchsize: {loader.batch_size} | Steps: {len(loader)}",
                   every_rank=True)
            loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
            # [sum of per-sample losses, samples] on the device: no host sync per step
            totals = torch.zeros(2, dtype=torch.float64, device=self.device)
            for xs, ys in loader:
                xs, ys = xs.to(self.device, non_blocking=True), ys.to(self.device, non_blocking=True)
                self.optimizer.zero_grad(set_to_none=True)
                # PORT (loss): your loss of (output, target), a mean over this rank's batch
                loss = F.mse_loss(self.model(xs), ys)
                loss.backward()  # DDP all-reduces (averages) the gradients here; each rank keeps its own loss
                self.optimizer.step()
                self.steps += 1
                totals[0] += loss.detach().double() * len(xs)
                totals[1] += len(xs)
            dist.all_reduce(totals)  # the global mean loss, not rank 0's own
            mean_loss, samples = (totals[0] / totals[1]).item(), int(totals[1].item())
            seconds = time.perf_counter() - start
            history.append({"loss": mean_loss, "samples": samples, "seconds": seconds})
            if (epoch + 1) % self.save_every == 0 or epoch + 1 == max_epochs:
                self._save_snapshot(epoch + 1)
            print0(f"epoch {epoch + 1}/{max_epochs} | loss {mean_loss:.6f} | "
                   f"{samples / seconds:.0f} samples/s | {seconds:.2f} s")
        return history


# ---------------------------------------------------------------- main
def train_and_check(device, args):
    """Data, model and Trainer; trains, checks that the replicas agree and reports; returns whether they do."""
    torch.manual_seed(args.seed)
    # PORT (data): your Dataset of (input, target) pairs; every rank builds the same one (the sampler shards it)
    dataset = MyTrainDataset(args.samples, seed=args.seed)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)  # each rank its own 1/N
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, pin_memory=device.type != "cpu")
    # PORT (model): your nn.Module, built on the CPU; the Trainer moves it to the device and wraps it in DDP
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    trainer = Trainer(model, loader, optimizer, device, args.save_every, args.snapshot_path, args.resume, args.timeout)
    resumed_from = trainer.epochs_run
    say_if_nothing_left(args.snapshot_path, "epoch", resumed_from, "--epochs", args.epochs)

    start = time.perf_counter()
    history = trainer.train(args.epochs)
    elapsed = time.perf_counter() - start
    in_sync = replicas_in_sync(trainer.model.module, device)
    report(history, elapsed, trainer.steps, len(loader), resumed_from, in_sync, device, args)
    return in_sync


def report(history, elapsed, steps, steps_per_epoch, resumed_from, in_sync, device, args):
    """Rank 0 writes the metrics (--metrics) and prints the `done:` line."""
    losses = [h["loss"] for h in history]
    summary = {
        "script": os.path.basename(__file__), "world_size": dist.get_world_size(),
        "backend": dist.get_backend(), "device": device.type, "torch": torch.__version__,
        "epochs": args.epochs, "steps": steps, "steps_per_epoch": steps_per_epoch,
        "batch_size": args.batch_size, "elapsed_s": elapsed,
        "samples_per_s": sum(h["samples"] for h in history) / elapsed if history else None,
        "first_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None, "losses": losses,
        "replicas_in_sync": in_sync, "resumed_from_epoch": resumed_from,
        "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
    }
    if dist.get_rank() == 0 and args.metrics:
        write_json(args.metrics, summary)
    result = (f"loss {losses[0]:.4f} -> {losses[-1]:.4f} | {summary['samples_per_s']:.0f} samples/s" if history
              else f"nothing trained (resumed at epoch {resumed_from})")
    print0(f"done: {summary['script']} | {plural(summary['world_size'], 'process')} on {device.type} "
           f"({summary['backend']}) | torch {torch.__version__} | {plural(args.epochs, 'epoch')} | {result} | "
           f"replicas {'in sync' if in_sync else 'DIFFER'}")


@record  # under torchrun, an uncaught exception's traceback is its report's root cause
def main():
    args = check_args(parse_args())
    prepare_rendezvous(args)  # one process of the job: torchrun set its RANK (plain `python`: a world of one)
    device = setup(args)
    try:
        with explained_failures(args.timeout, lambda: describe_checkpoint(args.snapshot_path)):
            in_sync = train_and_check(device, args)
    finally:
        cleanup()
    if not in_sync:
        sys.exit(1)  # the replicas differ: DDP did not keep them identical


# =============================================================================
# ---- harness: recipes, each the same wherever it appears; not part of the lesson ----
# What makes the lesson above robust: the recipes of recipes/harness.py that this file uses, every definition byte for byte as there (a test compares them). A recipe can be
# lifted alone with the recipes its banner names; docs/recipes.md has the ones users lift most.
# =============================================================================
import atexit
import contextlib
import errno
import gc
import json
import math
import multiprocessing
import pickle
import re
import signal
import socket
import stat
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
# ---- end of harness ----


if __name__ == "__main__":
    main()
