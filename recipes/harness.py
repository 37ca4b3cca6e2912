"""The harness's reference copy: recipes that make a DDP script robust, each lifted alone with the recipes
its banner names. Edit here, then `python3 tools/sync_harness.py` copies into each script what it reaches."""
import argparse
import atexit
import contextlib
import enum
import errno
import gc
import inspect
import io
import json
import logging
import math
import multiprocessing
import os
import pathlib
import pickle
import pickletools
import re
import signal
import socket
import stat
import struct
import sys
import threading
import time
import traceback
import warnings
import zipfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.filesystem as _filesystem
import torch.distributed.checkpoint.metadata as _metadata
import torch.multiprocessing as mp
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType
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
    elif differ:  # at exit, so that rank 0, with its exit code 1, is torchrun's root cause
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
    """torch.load with weights_only: plain data, so a pickled object is refused before it runs; onto the CPU
    (load_state_dict moves each tensor to its parameter); torch.load reads the zip that read_checked wrote from
    what it checked. Unreadable: one line per machine."""
    try:
        return torch.load(io.BytesIO(read_checked(path)), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        reason = next((line.strip() for line in str(e).splitlines() if "unsupported" in line.lower()), "not plain data")
        fail(f"{path} holds pickled Python objects and was refused unread ({reason})",
             "load only checkpoints this script wrote; delete it to start afresh", every_node=True)
    except Exception as e:  # OSError (ELOOP: a link), a bad zip, struct.error, MemoryError, RecursionError, ...
        fail(f"cannot read checkpoint {path} ({type(e).__name__}: {str(e).strip().split('. ')[0][:160]})",
             f"pass the file it links to, {os.path.realpath(path)}" if getattr(e, "errno", 0) == errno.ELOOP
             else "it is unreadable or truncated; delete it to start afresh", every_node=True)


def holds_tensor(value):
    """Whether a tensor lies anywhere in `value` (check_pickle bounded its nesting and its size)."""
    if isinstance(value, torch.Tensor):
        return True
    return any(map(holds_tensor, value.values() if isinstance(value, dict) else value
                   if isinstance(value, (list, tuple)) else ()))


def read_checked(path, tensors=True):
    """torch.save's zip at `path` for torch.load, written anew by repacked from the entries it checked, so torch
    reads what was checked: read from one descriptor opened without following a link or waiting on a FIFO, of
    a regular file with one link (fstat), so a file swapped in after the check is never read. tensors=False:
    its tensors' records left empty and unread, for torch.load(map_location="meta") to read the counters in
    bounded memory."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:  # ELOOP: a symbolic link (load_checkpoint says to pass the file it names)
        raise OSError(errno.ELOOP, "a symbolic link, not followed") if e.errno == errno.ELOOP else e
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:  # 0: replaced since it was opened, and still read
            raise ValueError("not a plain file of one link (a FIFO, a device, a folder or a hard link)")
        with open(fd, "rb", closefd=False) as f:
            return repacked(f, tensors)[0]
    finally:
        os.close(fd)


def check_archive(data):
    """The data.pkl of torch.save's zip `data`, for a reader of `data` itself: repacked's checks, else ValueError."""
    return repacked(io.BytesIO(data), tensors=False)[1]


def repacked(f, tensors=True):
    """(the zip in file `f` written anew from what zipfile read of it, its data.pkl) once it is torch.save's and
    torch's reader of `f` would read the same: one central directory (central_directory), named as zipfile
    found it; entries stored (none inflates), not encrypted, adding up to no more than the file, named once
    (torch looks names up whatever their case) under one folder with a data.pkl, whose pickle is bounded
    (check_pickle); else ValueError. tensors=False: the tensors' records (`data/N`) left empty, unread."""
    count, directory_at = central_directory(f)
    archive = zipfile.ZipFile(f)
    entries, names = archive.infolist(), archive.namelist()
    folder = names[0].split("/")[0] + "/" if names else "/"  # torch reads the records under the first entry's folder
    if any(e.flag_bits & 1 or e.compress_type or e.compress_size != e.file_size for e in entries):
        raise ValueError("its zip entries are compressed or encrypted; torch.save stores each")
    if archive.start_dir != directory_at or len(entries) != count or sum(e.file_size for e in entries) > directory_at:
        raise ValueError("its zip central directory is not the one its end record names, or its entries overlap")
    if f"{folder}data.pkl" not in names or len({n.lower() for n in names}) < len(names) or \
            not all(n.startswith(folder) for n in names):
        raise ValueError("its zip is not torch.save's (no data.pkl, entries outside its folder or named twice)")
    pickled = archive.read(f"{folder}data.pkl")  # read once: the bytes checked are the bytes written
    check_pickle(pickled)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as fresh:
        for name in names:
            unread = not tensors and "/data/" in name.lower()
            fresh.writestr(name, pickled if name == f"{folder}data.pkl" else b"" if unread else archive.read(name))
    return out.getvalue(), pickled


def central_directory(f):
    """(entries, offset) of the central directory of the zip in file `f` as torch's reader takes them (the end
    record's, or its zip64 twin's where saturated), once zipfile must take the same (it finds the end record by
    its place): the end record last (no comment), its zip64 twin agreeing, the directory right before them."""
    size = f.seek(0, 2)
    f.seek(max(size - 98, 0))
    tail = f.read()
    end, locator = tail[-22:], tail[-42:-22] if size >= 98 else b""
    if len(end) != 22 or end[:4] != b"PK\x05\x06":
        raise ValueError("no zip end record at its end (not torch.save's zip, or bytes after it)")
    disk, cd_disk, here, count, cd_size, cd_at, comment = struct.unpack("<HHHHIIH", end[4:])
    edge = size - 22
    if locator[:4] == b"PK\x06\x07":  # zip64: its record right before the locator, its values the ones read
        record_disk, record_at, disks = struct.unpack("<IQI", locator[4:])
        sig, length, _, _, disk64, cd_disk64, *wide = struct.unpack("<4sQHHIIQQQQ", tail[:56])
        ours = (sig, length, record_at, record_disk + disk64 + cd_disk64, disks)
        if ours != (b"PK\x06\x06", 44, size - 98, 0, 1) or any(
                short not in (full, value) for short, full, value in
                zip((here, count, cd_size, cd_at), (0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF), wide)):
            raise ValueError("its zip64 end record disagrees with its end record")
        (here, count, cd_size, cd_at), edge = wide, size - 98
    if disk or cd_disk or comment or here != count or cd_at + cd_size != edge:
        raise ValueError("its zip end record does not end its central directory (a second archive in one file)")
    return count, cd_at


def check_pickle(data, object_keys=False):
    """ValueError unless unpickling `data` (by any unpickler) is work about linear in its size. A dry run of
    its stack, where each object weighs the nodes it stands for with memo references expanded (a BINGET
    pushes the weight of what it names: a tuple of two references to the one below, 64 deep, is 2^64 nodes
    in 335 bytes), against a few nodes a byte; nesting bounded; no object changed once referenced (its weight
    would be stale); dict keys and set items small and of a kind whose hash no one can collide at scale: str
    (hashed with a per-process secret), an int of 31 bits (150,000 ints k x (2^61 - 1) share one hash), and
    with object_keys an object."""
    limit, stack, marks, memo = 4 * len(data) + 4096, [], [], []
    for op, arg, at in pickletools.genops(data):  # a length past the end raises ValueError here, unread
        floor = marks[-1] if marks else 0
        if op.name == "MARK":
            marks.append(len(stack))
        elif op.name in ("GET", "BINGET", "LONG_BINGET", "DUP"):
            if len(stack) <= floor if op.name == "DUP" else arg >= len(memo):
                raise ValueError(f"its pickle's {op.name} at byte {at} names nothing")
            stack.append(stack[-1] if op.name == "DUP" else memo[arg])
            stack[-1][3] = True  # referenced: its weight is final
        elif not op.stack_before and op.stack_after:  # a number, a string, an empty container, a global's name
            text = arg if isinstance(arg, str) else None
            kind = "str" if text is not None and op.name not in ("GLOBAL", "PERSID") else "int" if type(arg) is int \
                and -2 ** 31 < arg < 2 ** 31 and not op.name.startswith("EXT") else "other"
            stack.append([1 + (len(arg) >> 6 if isinstance(arg, (str, bytes)) else 0), 0, kind, False, text])
        elif op.name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
            index = len(memo) if op.name == "MEMOIZE" else arg
            if len(stack) <= floor or index > len(memo):
                raise ValueError(f"its pickle's {op.name} at byte {at} memoizes nothing, or past its memo")
            memo[index:index + 1] = [stack[-1]]
        elif op.name == "FRAME" and arg > len(data) - at:
            raise ValueError(f"its pickle's frame at byte {at} is longer than the pickle")
        elif op.name == "POP" and len(stack) == floor and marks:
            marks.pop()
        elif (made := folded(op, at, taken_off(op, at, stack, marks), object_keys)) is not None:
            if made[0] > limit or made[1] > 100:
                raise ValueError(f"its pickle builds at byte {at} an object of over {limit} nodes (memo references "
                                 f"expanded) or nested over 100 deep, from {len(data)} bytes")
            stack.append(made)


def taken_off(op, at, stack, marks):
    """The objects `op` takes off the stack, bottom first: down to its mark, with what it needs below that."""
    names = [s.name for s in op.stack_before]
    below = names.index("mark") if "mark" in names else len(names)
    if "mark" in names and not marks:
        raise ValueError(f"its pickle's {op.name} at byte {at} has no mark")
    start = (marks.pop() if "mark" in names else len(stack)) - below
    if start < (marks[-1] if marks else 0):
        raise ValueError(f"its pickle's {op.name} at byte {at} finds too few objects")
    taken = stack[start:]
    del stack[start:]
    return taken


def folded(op, at, taken, object_keys):
    """What `op` leaves on the stack, [weight, depth, kind, referenced, text] (None: nothing): the objects it
    took folded into a new one, or into the container it fills (APPEND(S), SETITEM(S), ADDITEMS, BUILD)."""
    fills = op.name in ("APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD")
    parts = taken[1:] if fills else taken
    pairs = op.name in ("SETITEM", "SETITEMS", "DICT")
    keys = parts[0::2] if pairs else parts if op.name in ("ADDITEMS", "FROZENSET") else ()
    if pairs and len(parts) % 2 or any(k[0] > 64 or k[2] not in ("str", "int", "object" if object_keys else "str")
                                       for k in keys):
        raise ValueError(f"its pickle's {op.name} at byte {at} makes a key of a kind or size torch never writes")
    if fills and taken[0][3]:
        raise ValueError(f"its pickle's {op.name} at byte {at} changes an object after it was referenced")
    if op.name == "REDUCE" and taken[1][0] > 1 and taken[0][4] in (
            "collections OrderedDict", "collections Counter", "collections defaultdict", "builtins dict",
            "builtins set", "builtins frozenset"):
        raise ValueError(f"its pickle's REDUCE at byte {at} fills a {taken[0][4]} with keys not checked")
    weight, depth = 0, 0
    for cell in parts:
        cell[3], weight, depth = True, weight + cell[0], max(depth, cell[1] + 1)
    if fills:
        taken[0][0], taken[0][1] = taken[0][0] + weight, max(taken[0][1], depth)
        return taken[0]
    if not op.stack_after:
        return None
    kind = "object" if op.name in ("REDUCE", "NEWOBJ", "NEWOBJ_EX", "OBJ", "INST") else "other"
    return [1 + weight, depth, kind, False, f"{taken[0][4]} {taken[1][4]}" if op.name == "STACK_GLOBAL" else None]


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
    """The checkpoint's counters and stamps, its tensors left unread (shapes on the meta device): the memory of
    its small entries, however large the file; read and checked as load_checkpoint's (read_checked)."""
    return torch.load(io.BytesIO(read_checked(path, tensors=False)), map_location="meta", weights_only=True)


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


# ---- recipe: safe DCP (needs safe load, errors): a torch.distributed.checkpoint save read and written as data, by descriptor
def open_folder(path):
    """A descriptor of the folder `path` (the user's to name, through a link or not): what is in it is
    opened by name in it (open_checked), never by a path walked again."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY)


def mount_of(fd):
    """(device, mount) of an open file or folder: a bind mount of another run's folder on the same file
    system has that file system's device but a mount of its own (Linux's /proc/self/fdinfo; elsewhere the
    device alone tells a mount)."""
    try:
        with open(f"/proc/self/fdinfo/{fd}", encoding="ascii") as f:
            mount = next((line.split()[1] for line in f if line.startswith("mnt_id:")), None)
    except OSError:
        mount = None
    return os.fstat(fd).st_dev, mount


def open_checked(name, kind, folder_fd, flags=os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY):
    """(descriptor, "") of `name` in the open folder `folder_fd`, or (None, why it is refused). Opened once,
    without following a link or waiting on a FIFO, and checked on the descriptor, so what is read from it
    is what was checked whatever takes the name later: a plain file or folder (`kind`: stat.S_ISREG or
    stat.S_ISDIR) on the folder's own mount (never into a bind mount), a file of one link (a hard link is
    also a file of some other folder). A name with a separator or a NUL is refused unopened."""
    if type(name) is not str or os.sep in name or "\0" in name or name in ("", ".", ".."):
        return None, "it lies outside the checkpoint folder"
    try:
        fd = os.open(name, flags | (os.O_DIRECTORY if kind is stat.S_ISDIR else 0), 0o644, dir_fd=folder_fd)
    except OSError as e:
        return None, {errno.ELOOP: "it is a symbolic link", errno.ENOTDIR: "it is a symbolic link or not a folder"
                      }.get(e.errno, f"it cannot be opened ({e.strerror})")
    found = os.fstat(fd)
    why = "" if kind(found.st_mode) else "it is not a plain " + ("file" if kind is stat.S_ISREG else "folder")
    if not why and mount_of(fd) != mount_of(folder_fd):
        why = "it is another file system mounted there"
    if not why and kind is stat.S_ISREG and found.st_nlink != 1:
        why = f"it has {found.st_nlink} links (a hard link is a file of another folder too)"
    if why:
        os.close(fd)
        return None, why
    return fd, ""


def opened_file(name, folder_fd):
    """open_checked's descriptor of the plain file `name` in `folder_fd`, or a ValueError saying why not."""
    fd, why = open_checked(name, stat.S_ISREG, folder_fd)
    if why:
        raise ValueError(f"{str(name)[:80]!r} is refused: {why}")
    return fd


def read_bounded(name, folder_fd, limit):
    """The bytes of the plain file `name` in `folder_fd` (opened_file), at most `limit` of them: its size
    on the descriptor first, then as many bytes from it."""
    fd = opened_file(name, folder_fd)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise ValueError(f"not a plain file of at most {limit >> 20} MiB")
        data = os.pread(fd, size, 0)  # allocates the file's size, not the limit
    finally:
        os.close(fd)
    if len(data) != size:
        raise ValueError("it shrank while it was read")
    return data


def read_file_in(root, name, limit):
    """read_bounded of root/name; OSError, or ValueError saying why it is refused."""
    top = open_folder(root)
    try:
        return read_bounded(name, top, limit)
    finally:
        os.close(top)


class SaveFolder:
    """One save's folder, opened once through the checkpoint folder (open_checked; one error line if
    refused): its files are opened by name in this descriptor (opened_file), each checked on its own
    descriptor and read from it, so a link, a hard link, a FIFO or a mount put in a file's place after an
    earlier check is refused by the open that reads. A context manager: leaving it closes the folder."""

    def __init__(self, root, name):
        self.path = os.path.join(root, name)
        try:
            top = open_folder(root)
        except OSError as e:
            fail(f"cannot open checkpoint folder {root} ({e.strerror})", "pass the --checkpoint folder a run wrote",
                 every_node=True)
        try:
            self.fd, why = open_checked(name, stat.S_ISDIR, top)
        finally:
            os.close(top)
        if why:
            fail(f"checkpoint {root} names {str(name)[:80]!r}, which is refused: {why}",
                 "load only checkpoints this script wrote; delete the folder to start afresh", every_node=True)

    def size(self, name):
        fd = opened_file(name, self.fd)
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def close(self):
        os.close(self.fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def remove_save(root, name):
    """Delete the save root/name through descriptors: the files directly in it, then the folder; whether it
    is gone. Never through a link, never a folder on another mount (a bind mount of another run's save,
    whose files would go) nor a folder inside it: those stay, and so does the save (open_checked)."""
    try:
        top = open_folder(root)
        try:
            fd, _ = open_checked(name, stat.S_ISDIR, top)
            if fd is None:
                return False
            try:
                for entry in os.listdir(fd):
                    with contextlib.suppress(OSError):  # a folder in it (EISDIR) stays
                        os.unlink(entry, dir_fd=fd)  # a link is removed, not followed
            finally:
                os.close(fd)
            os.rmdir(name, dir_fd=top)  # not if anything stayed, nor a mount put there since
            return True
        finally:
            os.close(top)
    except OSError:
        return False


def layout_named(name):
    """torch.serialization._get_layout, for the two layouts a saved tensor has: any other name is refused."""
    if name not in ("torch.strided", "torch.sparse_coo"):
        raise pickle.UnpicklingError(f"layout {str(name)[:40]!r} is not a tensor layout")
    return getattr(torch, name.split(".")[1])


class MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` is a pickle: admit only the (module, name) pairs of ADMITTED, exactly, so a payload
    (a __reduce__ naming any other callable, or a dotted name that walks from an admitted module to
    `os.system`) is refused before it runs. Nothing dotted, no module admitted whole (a name like
    `os.system` resolves through a module's imports); paths become pure paths (no I/O), and the layout
    lookup is ours (layout_named)."""
    ADMITTED = {("torch", "Size"): torch.Size, ("torch.serialization", "_get_layout"): layout_named,
                ("pathlib", "PosixPath"): pathlib.PurePosixPath, ("pathlib._local", "PosixPath"):
                pathlib.PurePosixPath, ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
                ("pathlib._local", "WindowsPath"): pathlib.PureWindowsPath,
                (_filesystem.__name__, "_StorageInfo"): _filesystem._StorageInfo}
    ADMITTED.update({("torch", str(t).split(".")[1]): t for t in vars(torch).values() if isinstance(t, torch.dtype)})
    ADMITTED.update({(_metadata.__name__, n): getattr(_metadata, n) for n in (
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "MetadataIndex",
        "StorageMeta", "_MEM_FORMAT_ENCODING") if hasattr(_metadata, n)})  # each in torch 2.7 and 2.14
    # the opcodes DCP's pickle.dump writes (protocols 2-5); no extension codes, persistent ids or stack games
    OPCODES = {"PROTO", "FRAME", "STOP", "MARK", "MEMOIZE", "BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET",
               "STACK_GLOBAL", "NEWOBJ", "REDUCE", "BUILD", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3",
               "EMPTY_LIST", "APPEND", "APPENDS", "EMPTY_DICT", "SETITEM", "SETITEMS", "NONE", "NEWTRUE",
               "NEWFALSE", "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT", "SHORT_BINUNICODE",
               "BINUNICODE", "SHORT_BINBYTES", "BINBYTES"}
    LIMIT = 256 << 20  # bytes of a `.metadata`: DCP writes about 300 a tensor, so a million tensors fit

    def find_class(self, module, name):
        if (module, name) in self.ADMITTED:
            return self.ADMITTED[(module, name)]
        raise pickle.UnpicklingError(f"{str(module)[:60]}.{str(name)[:60]} is not part of a checkpoint's metadata")


def scan_pickle(data):
    """Refuse, before unpickling, what the unpickler would act on before find_class sees anything: an
    opcode DCP never writes, a memo index (the unpickler grows its memo to it: 2^32 entries from 12
    bytes) beyond the entries made so far, or a frame longer than the file; and (the harness's
    check_pickle) work beyond linear in its size: 267 bytes of memo references to a tuple nested 64 deep
    as a dict key hung the resume. MetadataIndex objects are its keys."""
    check_pickle(data, object_keys=True)
    memo = 0
    for op, arg, _ in pickletools.genops(data):  # a length past the end of the file raises ValueError here
        if op.name not in MetadataUnpickler.OPCODES:
            raise pickle.UnpicklingError(f"opcode {op.name} is not used in a checkpoint's metadata")
        if op.name in ("BINPUT", "LONG_BINPUT") and arg > memo or op.name in ("BINGET", "LONG_BINGET") and \
                arg >= memo or op.name == "FRAME" and arg > len(data):
            raise pickle.UnpicklingError(f"{op.name} {arg} claims more than the file holds")
        memo = max(memo, arg + 1) if op.name.endswith("PUT") else memo + (op.name == "MEMOIZE")


def settable(obj, names):
    """What a setattr can change on `obj`: (its __dict__, what the data descriptors of its type hold, by
    name: `names`, from described_names)."""
    described = {}
    for name in names:
        with contextlib.suppress(Exception):  # one that cannot be read (a dtype's is_signed, quantized) is kept
            described[name] = getattr(obj, name)
    return (dict(vars(obj)) if hasattr(obj, "__dict__") else {}), described


def described_names(kind):
    """The names of the data descriptors of the type `kind` that a setattr on its instances reaches and
    vars() does not show: a function's __defaults__ and __code__, a class's __name__ and __bases__, anyone's
    __class__ (an enum member's can be made another class, process-wide). A property without a setter
    cannot be set; a class's __dict__ is a new view at each look (its content is settable's first part),
    and its __flags__ (read-only) change with its caches."""
    return {n for klass in kind.__mro__ for n, d in vars(klass).items() if hasattr(d, "__set__")
            and getattr(d, "fset", True)} - {"__dict__", "__flags__"}


def changed(before, now):
    """The names whose value is not the one held before (an int or a str by value: some are made at each look)."""
    return {k for k in before.keys() | now.keys() if k not in before or k not in now or before[k] is not now[k]
            and not (type(before[k]) is type(now[k]) and type(now[k]) in (int, str) and before[k] == now[k])}


def put_back(obj, names, before):
    """Undo what changed on `obj` since settable(obj, names) gave `before`; whether anything had."""
    attributes, described = before
    now = settable(obj, names)
    moved = changed(described, now[1])
    for name in sorted(moved, key=lambda n: n != "__class__"):  # its class first: the rest is looked up there
        setattr(obj, name, described[name])
    if isinstance(vars(obj) if hasattr(obj, "__dict__") else None, dict):  # an instance's or a function's own
        vars(obj).clear()
        vars(obj).update(attributes)
    else:  # a class's, changed through setattr alone
        for k in changed(attributes, now[0]):
            setattr(obj, k, attributes[k]) if k in attributes else delattr(obj, k)
    return bool(moved or changed(attributes, now[0]))


def unpickle_metadata(data):
    """MetadataUnpickler on `data`, scanned first; what a setattr can change on the admitted objects and
    enum members (settable) is checked afterwards, since a pickle's BUILD can set attributes on any object
    it holds: a change is put back, then refused."""
    scan_pickle(data)
    held = list(MetadataUnpickler.ADMITTED.values())
    held += [m for v in held if isinstance(v, type) and issubclass(v, enum.Enum) for m in v]
    kinds = {kind: described_names(kind) for kind in {type(v) for v in held}}
    names = [kinds[type(v)] for v in held]  # taken now: BUILD can change an object's type
    before = [settable(v, n) for v, n in zip(held, names)]
    try:
        return MetadataUnpickler(io.BytesIO(data)).load()
    finally:
        for obj, n, state in zip(held, names, before):
            if put_back(obj, n, state):
                raise pickle.UnpicklingError(f"it sets attributes of {getattr(obj, '__name__', type(obj).__name__)}")


def metadata_of(save):
    """The `.metadata` of `save` (a SaveFolder), unpickled by unpickle_metadata and checked by check_metadata;
    raises what refuses it."""
    metadata = unpickle_metadata(read_bounded(".metadata", save.fd, MetadataUnpickler.LIMIT))
    check_metadata(metadata, save)
    return metadata


def check_metadata(metadata, folder):
    """Every field DCP reads, of the type DCP gives it: tensors only (a non-tensor entry would be read
    with a code-running torch.load), chunks that tile their tensor (check_tiled), and every byte range
    inside a plain file of this save (`folder`, a SaveFolder; relative_path: a name, never absolute or `..`)."""
    md = _metadata
    entries = getattr(metadata, "state_dict_metadata", None)
    if type(metadata) is not md.Metadata or type(entries) is not dict or not entries or \
            type(getattr(metadata, "storage_meta", None)) not in (md.StorageMeta, type(None)) or \
            type(getattr(metadata, "planner_data", None)) not in (dict, type(None)):
        raise ValueError("not a checkpoint's metadata")
    for key, entry in entries.items():
        if type(key) is not str or type(entry) is not md.TensorStorageMetadata or \
                type(getattr(entry, "properties", None)) is not md.TensorProperties or \
                not isinstance(getattr(entry.properties, "dtype", None), torch.dtype) or \
                type(getattr(entry, "size", None)) is not torch.Size or type(getattr(entry, "chunks", None)) is not list:
            raise ValueError(f"entry {str(key)[:60]!r} is not a tensor's")
        for chunk in entry.chunks:
            offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
            if type(chunk) is not md.ChunkStorageMetadata or type(offsets) is not torch.Size or \
                    type(sizes) is not torch.Size or not len(offsets) == len(sizes) == len(entry.size) or \
                    not all(0 <= o and 0 <= s and o + s <= n for o, s, n in zip(offsets, sizes, entry.size)):
                raise ValueError(f"a chunk of {key[:60]!r} lies outside its tensor")
        check_tiled(key, entry)
    files = {}
    storage = getattr(metadata, "storage_data", None)
    for index, info in (storage.items() if type(storage) is dict else [(None, None)]):
        name, start, length = (getattr(info, k, None) for k in ("relative_path", "offset", "length"))
        if type(index) is not md.MetadataIndex or index.fqn not in entries or type(info) is not _filesystem._StorageInfo \
                or type(name) is not str or type(start) is not int or type(length) is not int or \
                getattr(info, "transform_descriptors", None) or start < 0 or length < 0:
            raise ValueError("its storage records are not a tensor file's byte ranges")
        if name not in files:
            files[name] = folder.size(name)
        if start + length > files[name]:
            raise ValueError(f"{name[:60]!r} is shorter than the bytes recorded in it")


def check_tiled(key, entry):
    """The chunks of a saved tensor tile it, so that a resume sets every element: each chunk spans whole
    rows (FSDP shards the first dimension, and every save this script writes is FSDP's), and the rows of the
    chunks follow one another from the first to the last without a gap or an overlap. A gap resumed with
    those rows left at their fresh initialization; sorting keeps the check at n log n for n chunks."""
    if not entry.size:  # a 0-d tensor (AdamW's step): one chunk, the whole of it
        if len(entry.chunks) != 1:
            raise ValueError(f"{key[:60]!r} has {len(entry.chunks)} chunks; a 0-d tensor has one")
        return
    rows = []
    for chunk in entry.chunks:
        if 0 not in chunk.sizes and (tuple(chunk.offsets[1:]) != (0,) * (len(entry.size) - 1)
                                     or chunk.sizes[1:] != entry.size[1:]):
            raise ValueError(f"a chunk of {key[:60]!r} is not whole rows, as FSDP saves them")
        rows += [(chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0])] * (0 not in chunk.sizes)  # empty: no rows
    rows.sort()
    ends = [0] + [end for _, end in rows]
    if [start for start, _ in rows] != ends[:-1] or ends[-1] != entry.size[0] and 0 not in entry.size:
        raise ValueError(f"the chunks of {key[:60]!r} leave rows of it unsaved or save them twice")


def check_tensor_record(data):
    """One tensor as DCP stores it (a torch.save archive), checked before torch.load reads it: every zip
    entry stored, adding up to no more than the record (torch.load would inflate a deflated entry), and
    its pickle naming only what rebuilds a plain tensor. torch's weights_only allowlist admits more
    (DTensor and DeviceMesh among it): what a tensor record may name is decided here, not there. The
    harness's check_archive: the zip torch.load reads is the one checked (its end record agrees with
    the entries: no second archive behind it), and its pickle is bounded."""
    for op, arg, _ in pickletools.genops(check_archive(data)):
        if op.name in ("STACK_GLOBAL", "INST", "OBJ", "EXT1", "EXT2", "EXT4") or op.name == "GLOBAL" and \
                arg not in ("torch._utils _rebuild_tensor_v2", "collections OrderedDict") and \
                not re.fullmatch(r"torch [A-Za-z0-9]+Storage", arg):
            raise ValueError(f"a tensor record names {str(arg or op.name)[:80]}, which is not a tensor's")


class SaveFiles(FileSystem):
    """DCP's file system over one save (a SaveFolder): every path DCP asks for names a file directly in the
    folder's descriptor, and no path is walked again. Read: the file opened and checked (opened_file),
    and read from that descriptor. Written: a new file (O_EXCL, O_NOFOLLOW: a name planted since the folder was made,
    a link or a hard link to a file elsewhere, fails the save instead of being written through), renamed
    and removed in the folder alone."""

    def __init__(self, save):
        super().__init__()
        self.save = save

    def name_of(self, path):
        path = pathlib.Path(path)
        if path.parent != pathlib.Path(self.save.path):
            raise ValueError(f"{str(path)[:80]!r} is not a file of the save {self.save.path}")
        return path.name

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        name = self.name_of(path)
        if mode not in ("rb", "wb"):
            raise ValueError(f"DCP asked to open {name[:80]!r} as {mode!r}")
        fd = opened_file(name, self.save.fd) if mode == "rb" else \
            os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=self.save.fd)
        with os.fdopen(fd, mode) as stream:
            yield stream

    def mkdir(self, path):  # save_folder made it, and the save writes into the folder it opened
        if pathlib.Path(path) != pathlib.Path(self.save.path):
            raise ValueError(f"{str(path)[:80]!r} is not the save's folder {self.save.path}")

    def exists(self, path):
        try:
            return bool(os.stat(self.name_of(path), dir_fd=self.save.fd, follow_symlinks=False))
        except FileNotFoundError:
            return False

    def rm_file(self, path):
        os.unlink(self.name_of(path), dir_fd=self.save.fd)

    def rename(self, path, new_path):
        os.rename(self.name_of(path), self.name_of(new_path), src_dir_fd=self.save.fd, dst_dir_fd=self.save.fd)


class SafeReader(FileSystemReader):
    """DCP's FileSystemReader over one save (a SaveFolder): read_metadata's unpickler and checks, every file
    read from the descriptor that was checked (SaveFiles), and no entry read that is not a tensor (DCP
    reads those with a full, code-running torch.load). Tensors it reads with weights_only=True."""

    def __init__(self, save):
        super().__init__(save.path)
        self.fs, self.save = SaveFiles(save), save

    def read_metadata(self, *args, **kwargs):
        metadata = metadata_of(self.save)  # refused before, refused again: a swap since
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _slice_file(self, file, sinfo):
        """Each tensor's bytes, checked by check_tensor_record before DCP's torch.load reads them."""
        data = super()._slice_file(file, sinfo).read()
        check_tensor_record(data)
        return io.BytesIO(data)

    def read_data(self, plan, planner):
        if any(item.type == LoadItemType.BYTE_IO for item in plan.items):
            raise ValueError("a checkpoint entry is not a tensor")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes on a file that it may be about to refuse
            return super().read_data(plan, planner)


class SafeWriter(FileSystemWriter):
    """DCP's FileSystemWriter over one save (a SaveFolder), each file created in the folder's descriptor (SaveFiles)."""

    def __init__(self, save):
        super().__init__(save.path)
        self.fs = SaveFiles(save)


def failure_of(error):
    """The line of an exception (DCP's gathers every rank's tracebacks) that says what failed."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return next((line for key in ("Unsupported", "Error:") for line in lines if key in line), lines[-1]).strip()[-150:]


def first_non_finite(tensors):
    """The name of the first tensor of a loaded save (in the state dict's order) holding a NaN or an
    infinity, on any rank (each looks at its own shards; they agree on the first), or None."""
    named = list(leaves(tensors))
    mine = next((i for i, (_, t) in enumerate(named)
                 if not torch.isfinite(t.to_local() if hasattr(t, "to_local") else t).all()), len(named))
    first = torch.tensor(mine, device=named[0][1].device if named else "cpu")
    if dist.is_initialized():
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
    return named[first.item()][0] if first.item() < len(named) else None


def leaves(tree, prefix=""):
    """(dotted name, tensor) of each tensor in nested dicts, in order."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from leaves(value, f"{prefix}{key}.")
        elif isinstance(value, torch.Tensor):
            yield f"{prefix}{key}", value


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
