"""How fast the ranks' collectives go, measured as nccl-tests measures them: time, algbw and busbw per message size.

Scenario: before blaming DDP for a slow step, measure what its all-reduce runs over. Every rank times
`all_reduce` (what DDP does to the gradients), `all_gather_into_tensor` and `reduce_scatter_tensor` (what
FSDP2 does to the weights and the gradients) on tensors of 4 KiB, 8 KiB, ... doubling up to --max_bytes
(default 256 MiB, lowered until three buffers of it fit in half the memory free to each process). Each
timing follows warm-up calls and a barrier, repeats the call for about --seconds, and keeps the slowest
rank's time. Per size one line: the time of one call, the algorithm bandwidth algbw = bytes / time, and the
bus bandwidth busbw = algbw x 2(n-1)/n for all_reduce, algbw x (n-1)/n for the other two (n ranks; bytes:
the whole tensor, gathered or reduced), which is what each rank's link carries, so it compares with the
link's speed whatever n is. GB/s are 10^9 bytes a second. It names the interface each rank's backend sends
through (GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME where set, else the one found from the addresses; loopback
when the peers share the machine) and the speed the system reports for it (/sys/class/net/IF/speed), then
one verdict: all_reduce's busbw at DDP's bucket size (25 MiB) against that speed. `--params N` (or `--bytes
B`) adds how long one step's gradient all-reduce takes at that busbw.

Launch:
    torchrun --standalone --nproc-per-node=gpu ddp_bandwidth.py            # the GPUs of one machine (NCCL)
    torchrun --nnodes=2 --node-rank=0 --master-addr=HOST0 --master-port=29500 --nproc-per-node=1 ddp_bandwidth.py
    CUDA_VISIBLE_DEVICES= torchrun --standalone --nproc-per-node=2 ddp_bandwidth.py --device cpu --max_bytes 16M
    python ddp_bandwidth.py --device cpu --max_bytes 1M      # a world of one: it says that nothing crosses a link

Nearest sibling: ddp_slow.py, which finds where a step's time goes (waiting for the all-reduce among the
causes); this measures the link under that all-reduce. Beyond the lesson: the sizes that fit in memory, the
interface and its speed, the numbers' formats.
"""

# ---------------------------------------------------------------- imports
import argparse
import contextlib
import fcntl
import math
import os
import re
import socket
import struct
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

MIN_BYTES = 4096  # the first size; each next one doubles
BUCKET = 25 * 2 ** 20  # DDP's gradient bucket (bucket_cap_mb=25): the size the verdict reads
MAX_REPEATS = 1000
OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
# busbw / algbw (nccl-tests' definitions): what one rank's link carries of the whole tensor's bytes
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather_into_tensor": lambda n: (n - 1) / n,
              "reduce_scatter_tensor": lambda n: (n - 1) / n}
# torch 2.14 renamed the two calls all_gather_single and reduce_scatter_single (the old names warn); same calls
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ---------------------------------------------------------------- arguments
def parse_args(argv=None):
    p = Arguments(description=__doc__.split("\n\n")[0])
    p.add_argument("--max_bytes", type=size_in_bytes, default=256 * 2 ** 20, metavar="BYTES",
                   help="the largest message (4096, 256K, 16M, 1G: K, M, G are 1024, 1024^2, 1024^3), lowered "
                        "where three buffers of it do not fit in half the memory free to a process (default: 256M)")
    p.add_argument("--seconds", type=float, default=0.25, metavar="S",
                   help="each timing repeats the collective for about this long (at most 1000 calls)")
    p.add_argument("--warmup", type=int, default=1, metavar="N", help="untimed calls before each size's timing")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="the elements sent (the sizes are in bytes whatever the type)")
    grads = p.add_mutually_exclusive_group()
    grads.add_argument("--params", type=int, metavar="N", help="a model of N parameters: how long its gradients' "
                       "all-reduce takes, N x bytes of --dtype / algbw at DDP's bucket size")
    grads.add_argument("--bytes", type=size_in_bytes, metavar="BYTES", help="the same for BYTES of gradients")
    p.add_argument("--local-rank", "--local_rank", type=int, dest="local_rank", help=argparse.SUPPRESS)  # old launcher
    p.add_argument("--device", default="auto", metavar="auto|cpu|TYPE",
                   help="auto: the accelerator torch finds (cuda, xpu, hpu, npu, ...), else cpu")
    p.add_argument("--backend", default="auto", metavar="auto|NAME",
                   help="auto: the device's default (nccl on cuda, xccl on xpu, hccl on hpu/npu, gloo on cpu)")
    p.add_argument("--timeout", type=float, default=300, metavar="SECONDS",
                   help="how long a collective waits for the other ranks before failing")
    p.add_argument("--metrics", default=None, metavar="PATH", help="write a JSON summary of the run here (rank 0)")
    refuse_launcher_flags(argv)  # --nprocs: a line on how torchrun launches this script
    return p.parse_args(argv)


def check_args(args):
    """Bad input is one error line, before any process group."""
    check_positive(args, "max_bytes", "seconds", "timeout", "params", "bytes")
    if args.max_bytes < MIN_BYTES:
        fail(f"{spelled('max_bytes')} must be at least {MIN_BYTES} (4 KiB, the first size), got {args.max_bytes}",
             f"pass {spelled('max_bytes')} 4K or more")
    if args.warmup < 0:
        fail(f"--warmup must be 0 or more, got {args.warmup}", "pass --warmup 0 to time the first calls too")
    check_folders(args.metrics)
    args.dtype = getattr(torch, args.dtype)
    resolve_device(args)
    return args


# ---------------------------------------------------------------- process group
def setup(args):
    """Join the process group; returns this process's device."""
    local_rank = int(os.environ["LOCAL_RANK"])
    use_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])))
    if args.device != "cpu":  # cuda, or another accelerator torch reports (xpu, hpu, npu, ...)
        device = torch.device(args.device, local_rank)
        torch.accelerator.set_device_index(device)  # before any work on it: one GPU per process
    else:
        device = torch.device("cpu")
    # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment; device_id: NCCL connects now
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout),
                            device_id=device if args.backend == "nccl" else None)
    return device


def cleanup():
    dist.destroy_process_group()


# ---------------------------------------------------------------- one collective, one size
def collective(op, nbytes, dtype, device):
    """(a call of `op` on tensors of about `nbytes`, its input, its output); the bytes are the whole tensor's: for
    all_gather and reduce_scatter the gathered one (the other side is each rank's 1/n of it)."""
    n, itemsize = dist.get_world_size(), torch.empty((), dtype=dtype).element_size()
    if op == "all_reduce":
        tensor = torch.zeros(nbytes // itemsize, dtype=dtype, device=device)
        return lambda: dist.all_reduce(tensor), tensor, tensor  # in place, as DDP reduces a bucket
    whole = torch.zeros(nbytes // itemsize // n * n, dtype=dtype, device=device)
    part = torch.zeros(len(whole) // n, dtype=dtype, device=device)
    if op == "all_gather_into_tensor":
        return lambda: ALL_GATHER(whole, part), part, whole
    return lambda: REDUCE_SCATTER(part, whole), whole, part


def synchronize(device):
    if device.type != "cpu":  # an accelerator's collective returns once queued; the clock wants it done
        torch.accelerator.synchronize(device)


def time_calls(call, repeats, device):
    """Seconds one call takes on the slowest rank: `repeats` calls between two clock reads, after a barrier."""
    dist.barrier()  # every rank starts together: none times its wait for a late peer
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    synchronize(device)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a collective ends when its slowest rank's part does
    return elapsed.item() / repeats


def measure(op, nbytes, args, device):
    """(bytes of the whole tensor, seconds a call, calls timed) of `op` at `nbytes`: warm-up calls, one timed call
    that sets the repeats (the same on every rank: it is the slowest rank's time), then the timing."""
    call, sent, received = collective(op, nbytes, args.dtype, device)
    for _ in range(args.warmup):  # the first calls pay for connections and allocations
        call()
    once = time_calls(call, 1, device)
    repeats = min(MAX_REPEATS, math.ceil(args.seconds / once)) if once > 0 else MAX_REPEATS
    seconds = once if repeats == 1 else time_calls(call, repeats, device)  # a call that lasts --seconds: timed once
    return max(sent.nbytes, received.nbytes), seconds, repeats


def correct(op, nbytes, device):
    """Whether `op` delivered, on this rank, what it must: rank r sends r + 1 (float32, exact to 2^24)."""
    call, sent, received = collective(op, nbytes, torch.float32, device)
    rank, n = dist.get_rank(), dist.get_world_size()
    sent.fill_(rank + 1)
    call()
    if op == "all_gather_into_tensor":  # the parts in rank order
        expected = torch.arange(1, n + 1, dtype=torch.float32, device=device).repeat_interleave(len(received) // n)
        return torch.equal(received, expected)
    return torch.equal(received, torch.full_like(received, n * (n + 1) / 2))  # the sum over the ranks


# ---------------------------------------------------------------- every op at every size
def probe(sizes, args, device):
    """One line per op and size as it is measured; returns the results and the count of wrong results."""
    n, results, wrong = dist.get_world_size(), [], 0
    print0(f"{'op':<24}{'bytes':>12}{'time':>12}{'algbw GB/s':>13}{'busbw GB/s':>13}{'calls':>7}")
    for op in OPS:
        for size in sizes:
            nbytes, seconds, repeats = measure(op, size, args, device)
            algbw = nbytes / seconds / 1e9
            busbw = algbw * BUS_FACTOR[op](n)
            results.append({"op": op, "bytes": nbytes, "seconds": seconds, "algbw_GBps": algbw,
                            "busbw_GBps": busbw, "repeats": repeats})
            wrong += not correct(op, size, device)
            print0(f"{op:<24}{nbytes:>12}{duration(seconds):>12}{algbw:>13.4g}{busbw:>13.4g}{repeats:>7}")
    return results, wrong


def busbw_at(results, nbytes):
    """(all_reduce's busbw at `nbytes`, the size it was read at): between the two sizes measured around it
    (linear in log2 of the size), else at the largest measured."""
    points = [(r["bytes"], r["busbw_GBps"]) for r in results if r["op"] == "all_reduce"]
    for (low, b_low), (high, b_high) in zip(points, points[1:]):
        if low <= nbytes <= high:
            return b_low + (b_high - b_low) * math.log2(nbytes / low) / math.log2(high / low), nbytes
    return points[-1][1], points[-1][0]


def verdict(busbw, at, link, n, device):
    """One line: all_reduce's busbw at DDP's bucket size against the speed the system reports for the link."""
    if n == 1:
        return ("a world of one: nothing crosses a link (busbw is 0 by definition: the one rank already holds the "
                "result); launch 2 or more processes, one per machine to measure the network between them")
    size = "25 MiB, DDP's bucket" if at == BUCKET else f"{human(at)}, the largest measured (DDP's bucket is 25 MiB)"
    said = f"all_reduce busbw {busbw:.4g} GB/s = {busbw * 8000:.4g} Mbit/s at {size}"
    if link["how"].startswith("loopback"):  # the data never reaches a network interface
        way = "memory copies through the kernel, not a network" if device.type == "cpu" else \
            "the devices' own links (NVLink, PCIe)"
        return f"{said}; the peers share this machine: {way}"
    if link["speed"] is None:
        return f"{said}; {link['interface']} reports no speed to compare with"
    share = busbw * 8000 / link["speed"]
    if share > 1.15:  # beyond what the interface can carry: the data went another way
        return (f"{said}: {share:.0%} of the {link['speed']} Mbit/s {link['interface']} reports, more than it can "
                "carry: the backend sends another way (NCCL over InfiniBand or NVLink: NCCL_DEBUG=INFO says which)")
    if share >= 0.7:
        return (f"{said}: {share:.0%} of the {link['speed']} Mbit/s {link['interface']} reports; the link is the limit "
                f"(fewer bytes go faster: ddp_comm_hooks.py)")
    return (f"{said}: {share:.1%} of the {link['speed']} Mbit/s {link['interface']} reports; either the link carries "
            "less than it reports (a shaped, shared or virtual link: a veth reports 10000 whatever it carries) or "
            "something else limits (the backend, the CPU's copies); a link test alone (iperf3) tells which")


def prediction(busbw, args, n):
    """One line: one step's gradients all-reduced at `busbw`: bytes x 2(n-1)/n / busbw (= bytes / algbw)."""
    nbytes = args.bytes if args.bytes else args.params * torch.empty((), dtype=args.dtype).element_size()
    seconds = nbytes * BUS_FACTOR["all_reduce"](n) / (busbw * 1e9) if n > 1 else 0.0
    what = f"{args.params:,} parameters x {nbytes // args.params} bytes = {human(nbytes)}" if args.params else \
        human(nbytes)
    return seconds, (f"one step's gradients, {what}, all-reduced at busbw {busbw:.4g} GB/s: bytes x 2(n-1)/n / busbw "
                     f"= {duration(seconds)} a step, where the backward hides none of it")


# ---------------------------------------------------------------- main
def probe_and_report(device, args):
    """The sizes, the link, the table, the verdict and the report; returns whether every result was right."""
    start, n = time.perf_counter(), dist.get_world_size()
    sizes = sizes_that_fit(args.max_bytes, device)
    print0(f"bandwidth: {plural(n, 'process')} on {device.type} ({dist.get_backend()}), {str(args.dtype)[6:]}, "
           f"torch {torch.__version__} | {human(sizes[0])} to {human(sizes[-1])}, doubling | each timing about "
           f"{args.seconds:g} s after {plural(args.warmup, 'warm-up call')}, the slowest rank's; GB/s = 10^9 bytes/s")
    links = every_ranks_link(dist.get_backend())
    results, wrong = probe(sizes, args, device)
    busbw, at = busbw_at(results, BUCKET)
    print0(f"verdict: {verdict(busbw, at, links[0], n, device)}")
    seconds, said = prediction(busbw, args, n) if args.params or args.bytes else (None, None)
    if said:
        print0(f"prediction: {said}")
    wrong = int(sum(every_rank(wrong, device)))
    print0(f"results: {'correct on every rank' if not wrong else f'{wrong} WRONG'} "
           f"({plural(len(results) * n, 'collective result')} checked)")
    report(results, links, busbw, at, seconds, not wrong, time.perf_counter() - start, device, args)
    if wrong:
        fail(f"{plural(wrong, 'collective')} returned a wrong result", "check the backend and the devices: "
             "NCCL_DEBUG=INFO, a memory test of the GPU")
    return not wrong


def report(results, links, busbw, at, predicted, ok, elapsed, device, args):
    """Rank 0 writes the metrics (--metrics) and prints the `done:` line."""
    speeds = [link["speed"] for link in links if link["speed"]]
    summary = {
        "script": os.path.basename(__file__), "world_size": dist.get_world_size(), "backend": dist.get_backend(),
        "device": device.type, "torch": torch.__version__, "dtype": str(args.dtype)[6:],
        "epochs": 0, "steps": 0, "steps_per_epoch": 0, "elapsed_s": elapsed, "samples_per_s": None,
        "first_loss": None, "final_loss": None, "replicas_in_sync": ok, "resumed_from_epoch": 0,
        "results_correct": ok, "results": results, "interface": links[0]["interface"],
        "link_Mbps": min(speeds) if speeds else None, "interfaces": links,
        "bucket_bytes": at, "bucket_busbw_GBps": busbw, "predicted_allreduce_s": predicted,
    }
    if dist.get_rank() == 0 and args.metrics:
        write_json(args.metrics, summary)
    print0(f"done: {summary['script']} | {plural(summary['world_size'], 'process')} on {device.type} "
           f"({summary['backend']}) | {links[0]['interface'] or 'no link'} | all_reduce busbw {busbw:.4g} GB/s at "
           f"{human(at)} | results {'correct' if ok else 'WRONG'}")


@record  # under torchrun, an uncaught exception's traceback is its report's root cause
def main():
    args = check_args(parse_args())
    prepare_rendezvous(args)  # one process of the job: torchrun set its RANK (plain `python`: a world of one)
    device = setup(args)
    try:
        with explained_failures(args.timeout, lambda: "the sizes measured so far are printed above"):
            ok = probe_and_report(device, args)
            dist.barrier()  # torch 2.7: gloo's threads let go of the tensors, or destroy may deadlock (pytorch#154976)
    finally:
        cleanup()
    if not ok:
        sys.exit(1)


# ---------------------------------------------------------------- beyond the lesson: sizes, the link, formats ----
def size_in_bytes(text):
    """`4096`, `256K`, `16M`, `1G` (also `16MiB`, `16MB`: powers of 1024) as bytes."""
    found = re.fullmatch(r"\s*(-?\d+)\s*([kmg]?)(i?b)?\s*", text, flags=re.I)
    if not found:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of bytes such as 4096, 256K, 16M or 1G")
    return int(found[1]) * 1024 ** " kmg".index(found[2].lower() or " ")


def sizes_that_fit(max_bytes, device):
    """4 KiB, 8 KiB, ... up to max_bytes, where three buffers of a size (a collective's input and output, and
    the backend's scratch) fit in half the memory free to this process; the same on every rank (the smallest)."""
    free = free_memory(device)
    largest = max_bytes if free is None else min(max_bytes, free // 2 // 3)
    largest = int(every_rank(largest, device, dist.ReduceOp.MIN)[0])
    if largest < MIN_BYTES:
        fail(f"three buffers of 4 KiB do not fit in the memory free to a process ({human(free or 0)})",
             "free memory on the device, or start fewer processes per machine")
    if largest < max_bytes:
        print0(f"note: --max_bytes {human(max_bytes)} lowered to {human(largest)}: three buffers of it fit in half "
               "the memory free to the most crowded process")
    return [MIN_BYTES * 2 ** k for k in range(int(math.log2(largest // MIN_BYTES)) + 1)]


def free_memory(device):
    """Bytes free to this process: the device's free memory, or on the CPU the machine's available memory
    shared by the processes on this machine; None where the system does not say."""
    if device.type != "cpu":
        info = getattr(torch.accelerator, "get_memory_info", None) or \
            getattr(torch.get_device_module(device.type), "mem_get_info", None)
        return info(device)[0] if info else None
    with contextlib.suppress(OSError, StopIteration, ValueError):
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return kib * 1024 // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return None


def every_rank(value, device, op=dist.ReduceOp.SUM):
    """`value` reduced over the ranks (a list of one float)."""
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def every_ranks_link(backend):
    """Each rank's link, {"rank", "interface", "how", "speed"} (Mbit/s, None where the system does not say),
    gathered by rank and printed by rank 0 (ranks alike on one line)."""
    variable = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}.get(backend, "")
    addresses = [None] * dist.get_world_size()
    dist.all_gather_object(addresses, bound_address(backend, os.environ.get(variable)))
    mine = interface(addresses, variable)
    links = [None] * dist.get_world_size()
    dist.all_gather_object(links, {"rank": dist.get_rank(), **mine, "speed": link_speed(mine["interface"])})
    alike = {}
    for link in links:
        alike.setdefault((link["interface"], link["how"], link["speed"]), []).append(str(link["rank"]))
    for (name, how, speed), ranks in alike.items():
        print0(f"interface: rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)}: {name or 'none'} ({how}), "
               + (f"{speed} Mbit/s as the system reports it" if speed else "no speed reported"))
    if backend == "nccl":
        print0("note: NCCL may carry the data over NVLink, PCIe or InfiniBand rather than this socket interface "
               "(NCCL_DEBUG=INFO names what it chose)")
    return links


def interface(addresses, variable):
    """This rank's interface and how it was found: the one the variable names, else loopback where every peer's
    address is this machine's, else the one the system routes to a peer on another machine through."""
    if len(addresses) == 1:
        return {"interface": None, "how": "a world of one: no peer"}
    if os.environ.get(variable):
        return {"interface": os.environ[variable], "how": f"set by {variable}"}
    local = local_addresses()
    remote = [a for a in addresses if a not in local and not a.startswith("127.")]
    if not remote:
        return {"interface": local.get("127.0.0.1", "lo"), "how": "loopback: its peers share this machine"}
    with contextlib.suppress(OSError):
        return {"interface": local.get(source_address(remote[0]), "unknown"),
                "how": "the route to the peers on other machines"}
    return {"interface": "unknown", "how": f"no route found to {remote[0]}"}


def bound_address(backend, named):
    """The IPv4 address this rank's peers reach it at: the named interface's; for gloo the one its host name
    resolves to if it is this machine's, else loopback (gloo's own rule); otherwise the one the system picks
    toward MASTER_ADDR."""
    with contextlib.suppress(OSError):
        if named:
            return next((a for a, name in local_addresses().items() if name == named), "unknown")
        if backend == "gloo":
            address = socket.gethostbyname(socket.gethostname())
            return address if address in local_addresses() or address.startswith("127.") else "127.0.0.1"
        return source_address(os.environ["MASTER_ADDR"])
    return "unknown"


def source_address(host):
    """The local address the system sends from toward `host` (UDP's connect sends nothing: it picks the route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def local_addresses():
    """{IPv4 address: interface} for this machine's interfaces (its network namespace's; Linux's SIOCGIFADDR)."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):  # an interface without an IPv4 address
                answer = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
                found[socket.inet_ntoa(answer[20:24])] = name
    return found


def link_speed(name):
    """Mbit/s that /sys/class/net/NAME/speed reports; None for loopback, a link down, or a name not found."""
    with contextlib.suppress(OSError, ValueError, TypeError):
        with open(os.path.join("/sys/class/net", os.path.basename(name), "speed")) as f:
            speed = int(f.read())
        return speed if speed > 0 else None
    return None


def human(nbytes):
    """`4 KiB`, `25 MiB`, `1.5 GiB`."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.4g} {unit}"
        nbytes /= 1024


def duration(seconds):
    """`41.2 us`, `3.51 ms`, `1.42 s`."""
    return f"{seconds * 1e6:.1f} us" if seconds < 1e-3 else f"{seconds * 1e3:.3g} ms" if seconds < 1 else \
        f"{seconds:.3g} s"


# =============================================================================
# ---- harness: recipes, each the same wherever it appears; not part of the lesson ----
# What makes the lesson above robust: the recipes of recipes/harness.py that this file uses, every definition byte for byte as there (a test compares them). A recipe can be
# lifted alone with the recipes its banner names; docs/recipes.md has the ones users lift most.
# =============================================================================
import json
import multiprocessing
import signal
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
