"""The DDP design note's example, runnable and checked: one step, identical parameters everywhere.

Each process builds `torch.nn.Linear(10, 10)`, wraps it in DistributedDataParallel and runs
one forward/backward/step on a batch of its own. The losses differ from rank to rank
(different data), but DDP averages the gradients during `backward()`, so after
`optimizer.step()` every rank holds the same parameters. The script checks exactly
that and exits 1 if the replicas differ.

Launch (the script starts its own processes with mp.spawn):
    python ddp_minimal.py                          # one process per visible GPU, NCCL
    python ddp_minimal.py --device cpu --nprocs 2  # CPU only, gloo

Read this first. Next: ddp_gpus.py trains for real (a data set, a DistributedSampler,
epochs, a global loss), and after its lesson carries a harness: the recipes it shares with the others.
"""
import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.elastic.utils.distributed import get_free_port
from torch.nn.parallel import DistributedDataParallel as DDP


def example(rank, world_size, args):
    device = torch.device(args.device, rank) if args.device != "cpu" else torch.device("cpu")
    if device.type != "cpu":  # cuda, xpu, hpu, npu, ...: whichever accelerator torch found
        torch.accelerator.set_device_index(device)  # one GPU per process, before any work on it
    torch.set_num_threads(max(1, torch.get_num_threads() // world_size))  # share the cores we may use (taskset)
    # the device's own backend: nccl on cuda, xccl on xpu, hccl on hpu and npu, gloo on cpu
    dist.init_process_group(dist.get_default_backend_for_device(device), rank=rank, world_size=world_size)

    torch.manual_seed(0)  # the same start everywhere (DDP would broadcast rank 0's weights anyway)
    model = torch.nn.Linear(10, 10).to(device)
    before = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ddp_model = DDP(model, device_ids=[rank] if device.type != "cpu" else None)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.001)

    g = torch.Generator().manual_seed(rank)  # each rank its own batch, as a DistributedSampler gives
    inputs, labels = torch.randn(20, 10, generator=g).to(device), torch.randn(20, 10, generator=g).to(device)
    loss = torch.nn.functional.mse_loss(ddp_model(inputs), labels)
    loss.backward()  # DDP all-reduces (averages) the gradients here, overlapped with backward
    optimizer.step()  # a local step, yet the same everywhere: the gradients already agree
    sys.stdout.write(f"[rank {rank}] loss={loss.item():.6f}\n")  # one write: ranks' lines never mix

    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(after) for _ in range(world_size)]
    dist.all_gather(every, after)  # every rank's parameters, to compare
    in_sync, changed = all(torch.equal(p, every[0]) for p in every), not torch.equal(after, before)
    if rank == 0:
        sys.stdout.write(f"replicas: {['DIFFER', 'in sync'][in_sync]}\ndone: ddp_minimal.py | {world_size} "
                         f"process{'es' * (world_size > 1)} on {device.type} ({dist.get_backend()}) | parameters "
                         f"{'changed' if changed else 'DID NOT CHANGE'} | replicas {['DIFFER', 'in sync'][in_sync]}\n")
    del ddp_model, loss  # DDP must be gone before its process group: destroying it first can abort
    gc.collect()
    dist.destroy_process_group()
    sys.exit(0 if in_sync and changed else 1)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", help="cpu, cuda, xpu, ... (auto: the accelerator torch finds, else cpu)")
    p.add_argument("--nprocs", type=int, default=None, help="processes (default: the GPUs, 2 on CPU)")
    args = p.parse_args()
    found = torch.accelerator.current_accelerator(check_available=True)  # None: no accelerator visible
    args.device = (found.type if found else "cpu") if args.device == "auto" else args.device
    gpus = torch.accelerator.device_count() if found and found.type == args.device else 0  # or xpu, ... devices
    most = gpus if args.device != "cpu" else 64  # at most one process per GPU
    nprocs = args.nprocs or (gpus if args.device != "cpu" else 2)
    if args.device == "mps" or not 0 < nprocs <= most:  # mps: no backend
        p.exit(2, "error: MPS has no multi-process backend (use --device cpu)\n" if args.device == "mps" else
               f"error: no {args.device} device is visible (use --device cpu)\n" if not most else
               f"error: --nprocs {nprocs} does not fit {args.device} here (pass 1 to {most})\n")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # rank 0 hosts the rendezvous here,
    os.environ.setdefault("MASTER_PORT", str(get_free_port()))  # on a port the OS says is free (never a hard-coded one)
    try:
        mp.spawn(example, args=(nprocs, args), nprocs=nprocs)  # example(rank, nprocs, args) in each process
    except mp.ProcessExitedException as e:  # exit 1: the replicas differ or did not change; rank 0 said which
        sys.exit(1 if e.exit_code == 1 else f"error: {e}")  # else a rank was killed, or exited with another code


if __name__ == "__main__":
    main()
