"""The same `Trainer` for a linear model, launched by torchrun, with an elastic snapshot.

Scenario: `nn.Linear(20, 1)` learns a fixed linear map from 2048 noisy samples, one
process per GPU. torchrun starts the processes and sets RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT; the script only reads them. Every `--save_every` epochs
global rank 0 writes a snapshot (model, optimizer, epochs run) atomically; at start every
rank resumes from it when it exists. So with `--max-restarts` a job whose worker dies is
restarted by torchrun and continues from the last snapshot instead of from scratch.

Launch:
    torchrun --nproc-per-node=2 ddp_gpus_torchrun.py --max_epochs 5 --batch_size 32
    torchrun --standalone --nproc-per-node=gpu ddp_gpus_torchrun.py          # every GPU
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 \
        torchrun --nproc-per-node=2 --max-restarts=3 ddp_gpus_torchrun.py    # survive failures (see below)
    torchrun --nnodes=2 --node-rank=0 --master-addr=HOST0 --master-port=29500 \
        --nproc-per-node=8 ddp_gpus_torchrun.py          # on each node, --node-rank=0/1
    CUDA_VISIBLE_DEVICES= torchrun --nproc-per-node=2 ddp_gpus_torchrun.py --device cpu
    python ddp_gpus_torchrun.py                          # a one-process world

A snapshot is resumed whenever `--snapshot_path` exists: delete it to start afresh.
On several nodes the path must be on a file system every node sees.
With torch 2.14, torchrun reuses its rendezvous store across restarts and restarted gloo
workers read the dead workers' addresses ("Gloo connectFullMesh failed ... Connection
refused"); TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives every restart a fresh store.

Nearest sibling: ddp_gpus.py (mp.spawn). `diff ddp_gpus.py ddp_gpus_torchrun.py` shows
the launch (environment instead of spawn arguments) and the snapshot, nothing else.
"""

# ---------------------------------------------------------------- imports
import argparse
import gc
import json
import os
import pickle
import socket
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
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
    p.add_argument("--save_every", type=int, default=1, metavar="N",
                   help="write the snapshot every N epochs")
    p.add_argument("--snapshot_path", "--checkpoint", default="snapshot.pt", metavar="PATH",
                   help="snapshot file, resumed from when it exists")
    p.add_argument("--local-rank", "--local_rank", type=int, default=None, dest="local_rank",
                   help=argparse.SUPPRESS)  # passed by the deprecated torch.distributed.launch
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
    """Bad input: one line on stderr (from global rank 0) and exit code 2, never a traceback."""
    if int(os.environ.get("RANK", "0")) == 0:
        say(f"error: {what} ({fix})", sys.stderr)
    else:
        time.sleep(3)  # torchrun stops every rank when one exits: let rank 0 say why first
    sys.exit(2)


def check_args(args):
    """Validate everything that can be checked before any process starts."""
    for name in ("epochs", "batch_size", "samples", "save_every"):
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
    for path in (args.snapshot_path, args.metrics):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            fail(f"the folder of {path} does not exist", "create it first, or pass another path")
    if args.device == "cuda" and env_int("LOCAL_RANK", 0) >= gpus:
        fail(f"LOCAL_RANK {env_int('LOCAL_RANK', 0)} but only {gpus} GPU(s) are visible",
             f"start at most {gpus} processes per node, or use --device cpu")
    return args


def env_int(name, default):
    return int(os.environ.get(name, default))


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


def setup(args):
    """Join the process group described by the environment (env://); returns this process's device."""
    local_rank = env_int("LOCAL_RANK", 0)
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        # without LOCAL_WORLD_SIZE (a hand-made launch) assume every rank is on this machine
        torch.set_num_threads(cpu_threads(env_int("LOCAL_WORLD_SIZE", env_int("WORLD_SIZE", 1))))
        device = torch.device("cpu")
    if env_int("TORCHELASTIC_RESTART_COUNT", 0) > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun (torch >= 2.5) keeps one rendezvous store across restarts, and the restarted
        # workers can read the previous attempt's addresses and fail to connect (pytorch#135712)
        if env_int("RANK", 0) == 0:
            say("warning: restarted by torchrun with a shared rendezvous store; if joining the group "
                "fails, launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", sys.stderr)
    dist.init_process_group(args.backend, rank=env_int("RANK", 0), world_size=env_int("WORLD_SIZE", 1),
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


# ---------------------------------------------------------------- checkpoints
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


# ---------------------------------------------------------------- model / trainer
class Trainer:
    def __init__(self, model, train_dataloader, optimizer, device, save_every, snapshot_path):
        self.device = device
        self.tag = f"{device.type.upper().replace('CUDA', 'GPU')}: {dist.get_rank()}"
        self.train_dataloader = train_dataloader
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.epochs_run = 0
        model.to(device)
        if os.path.exists(snapshot_path):
            self._load_snapshot(model)
        self._check_same_start()
        self.model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        self.steps = 0

    def _load_snapshot(self, model):
        snapshot = load_checkpoint(self.snapshot_path, self.device)
        if not isinstance(snapshot, dict) or not {"model", "optimizer", "epochs_run"} <= set(snapshot):
            fail(f"{self.snapshot_path} is not a snapshot of this script", "delete it, or pass another --snapshot_path")
        check_compatible(snapshot["model"], model, self.snapshot_path)
        model.load_state_dict(snapshot["model"])
        self.optimizer.load_state_dict(snapshot["optimizer"])
        self.epochs_run = snapshot["epochs_run"]

    def _check_same_start(self):
        # a rank that could not see the snapshot would train other epochs and hang the job
        starts = [torch.zeros(1, dtype=torch.long, device=self.device) for _ in range(dist.get_world_size())]
        dist.all_gather(starts, torch.tensor([self.epochs_run], device=self.device))
        if len({int(s) for s in starts}) > 1:
            raise RuntimeError(f"ranks resume from different epochs {[int(s) for s in starts]}: "
                               f"put {self.snapshot_path} on a file system every node sees")
        print0(f"resuming from snapshot {self.snapshot_path} at epoch {self.epochs_run}"
               if self.epochs_run else "starting from scratch (no snapshot)")

    def _save_snapshot(self, epochs_run):
        if dist.get_rank() == 0:
            snapshot = {"model": self.model.module.state_dict(),
                        "optimizer": self.optimizer.state_dict(), "epochs_run": epochs_run}
            save_checkpoint(snapshot, self.snapshot_path)
        dist.barrier()  # nobody reads the snapshot before it is complete

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
        for epoch in range(self.epochs_run, max_epochs):
            start = time.perf_counter()
            loss, samples = self._run_epoch(epoch)
            seconds = time.perf_counter() - start
            history.append({"loss": loss, "samples": samples, "seconds": seconds})
            saved = (epoch + 1) % self.save_every == 0 or epoch + 1 == max_epochs
            if saved:
                self._save_snapshot(epoch + 1)
            print0(f"epoch {epoch + 1}/{max_epochs} | loss {loss:.6f} | "
                   f"{samples / seconds:.0f} samples/s | {seconds:.2f} s"
                   + (f" | snapshot {self.snapshot_path}" if saved else ""))
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
    trainer = Trainer(model, loader, optimizer, device, args.save_every, args.snapshot_path)
    resumed_from = trainer.epochs_run

    start = time.perf_counter()
    history = trainer.train(args.epochs)
    elapsed = time.perf_counter() - start
    in_sync = replicas_in_sync(trainer.model.module, device)
    samples = sum(h["samples"] for h in history)
    losses = [h["loss"] for h in history] or [float("nan")]
    summary = {
        "script": os.path.basename(__file__), "world_size": dist.get_world_size(),
        "backend": dist.get_backend(), "device": device.type, "torch": torch.__version__,
        "epochs": args.epochs, "steps": trainer.steps, "steps_per_epoch": len(loader),
        "batch_size": args.batch_size, "elapsed_s": elapsed, "samples_per_s": samples / elapsed,
        "first_loss": losses[0], "final_loss": losses[-1],
        "losses": [h["loss"] for h in history], "replicas_in_sync": in_sync,
        "resumed_from_epoch": resumed_from, "restarts": env_int("TORCHELASTIC_RESTART_COUNT", 0),
    }
    if dist.get_rank() == 0 and args.metrics:
        write_json(args.metrics, summary)
    print0(f"done: {summary['script']} | {summary['world_size']} x {device.type} ({summary['backend']}) "
           f"| torch {torch.__version__} | {args.epochs} epochs | loss {summary['first_loss']:.4f} -> "
           f"{summary['final_loss']:.4f} | {summary['samples_per_s']:.0f} samples/s | "
           f"replicas {'in sync' if in_sync else 'DIFFER'}")
    return in_sync


def main():
    """One process of the job; torchrun (or the user) describes the job in the environment."""
    args = parse_args()
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    args = check_args(args)
    if "RANK" not in os.environ:  # plain `python ddp_gpus_torchrun.py`: a one-process world
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    elif env_int("RANK", 0) == 0 and "TORCHELASTIC_RUN_ID" not in os.environ:
        check_port_free(os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])  # a hand-made launch
    device, health = setup(args)
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


if __name__ == "__main__":
    main()
