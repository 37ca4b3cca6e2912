"""docs/recipes.md, pasted: every ```python block of the page goes into a plain DDP script written
here (no import of our scripts, no harness), launched as users launch theirs, and is checked
against what its section says, on 2 CPU processes with gloo.

One launch by hand (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT per process, with
TORCH_DISTRIBUTED_DEBUG=DETAIL and the flight recorder on) feeds most checks: DDP built on
ddp_group() trains and a mismatched collective is still caught; the namer names the unused
layers; a NaN on rank 1 is skipped by both ranks; the atomic save survives a writer that raises
and a planted link; then one rank skips backward() alone, both give up after the timeout and
dump their flight record, torchfrtrace reads it, and the cleanup frees the DDP models before the
group goes; the step clock, timing the steps, names rank 1 (30 ms late each step) the straggler. A torchrun launch with --max-restarts=1 checks the store: rank 1 of the first
attempt exits, the second attempt trains to the end. Every check was seen to fail once with its
block broken by hand.
"""
import ast
import os
import re
import socket
import subprocess
import symtable
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, cpu_env, kill_group, run_bounded, torchrun_cmd

RECIPES = ROOT / "docs" / "recipes.md"
# the page's headings: the marker of each block
DETAIL_GROUP = "DDP under TORCH_DISTRIBUTED_DEBUG=DETAIL"
FLIGHT = "The flight record, dumped on gloo"
UNUSED = "Naming the parameters that got no gradient"
TOGETHER = "Deciding together: a NaN step skipped on every rank"
RELEASE = "Release DDP before destroying the group"
ATOMIC = "The atomic save"
STORE = "A process group that survives torchrun's restarts"
CLOCK = "Where a step's time goes"
EVERY = (DETAIL_GROUP, FLIGHT, UNUSED, TOGETHER, RELEASE, ATOMIC, STORE, CLOCK)
# torch's flight-recorder analyzer, as a user runs it: the `torchfrtrace` installed beside torchrun
ANALYZER = next(([str(p)] for p in [Path(sys.executable).parent / "torchfrtrace"] if p.exists()),
                [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace"])
TIMEOUT = 5  # seconds DDP's group and the skipped step's group wait: the ranks give up after it


def block(heading):
    """The one ```python block under `## heading` in docs/recipes.md, as written."""
    text = RECIPES.read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    found = re.findall(r"```python\n(.*?)```", text[start:end if end > 0 else None], re.S)
    assert len(found) == 1, f"docs/recipes.md, {heading}: {len(found)} python blocks (one is promised)"
    return found[0]


def script(headings, body):
    """A plain DDP script: the blocks under `headings` pasted one after another, then `body`."""
    return "\n\n".join(block(h) for h in headings) + "\n\n" + body


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def by_hand(path, args, cwd, env, timeout=90):
    """`python path args` twice, as rank 0 and rank 1 of a hand-made launch: [(exit code, stdout, stderr)]."""
    port, procs = free_port(), []
    try:
        for rank in range(2):
            procs.append(subprocess.Popen(
                [sys.executable, str(path), *map(str, args)], cwd=cwd, text=True, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}))
        deadline, results = time.monotonic() + timeout, []
        for rank, proc in enumerate(procs):
            try:
                out, err = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                kill_group(proc)
                out, err = proc.communicate()
                pytest.fail(f"rank {rank} timed out after {timeout} s\n--- stdout\n{out}\n--- stderr\n{err[-3000:]}")
            results.append((proc.returncode, out, err))
        return results
    finally:
        for proc in procs:
            kill_group(proc)


def shown(ranks):
    return "\n".join(f"--- rank {r}: exit {rc}\n{out}\n--- stderr\n{err[-2000:]}" for r, (rc, out, err) in enumerate(ranks))


# ---------------------------------------------------------------- every block pasted alone stands alone
STDLIB = set(sys.stdlib_module_names)


def undefined_names(code):
    """Global names the code reads that it neither defines, imports nor finds among the builtins."""
    top = symtable.symtable(code, "block", "exec")
    defined = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    read, tables = set(), [top]
    while tables:
        table = tables.pop()
        tables.extend(table.get_children())
        read |= {s.get_name() for s in table.get_symbols()
                 if s.is_referenced() and (table is top or s.is_global())}
    return read - defined - set(dir(__import__("builtins")))


@pytest.mark.parametrize("heading", EVERY)
def test_block_stands_alone(heading):
    """Pasted alone, a block needs nothing but torch and the standard library: its imports are its own."""
    code = block(heading)
    assert not undefined_names(code), f"{heading}: names the block does not define or import"
    modules = {alias.name.split(".")[0] for node in ast.walk(ast.parse(code))
               if isinstance(node, (ast.Import, ast.ImportFrom))
               for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module)])}
    assert modules <= STDLIB | {"torch"}, f"{heading}: imports {sorted(modules - STDLIB - {'torch'})}"


# ---------------------------------------------------------------- the hand-made launch: every block but the store's restarts
TRAIN = '''
import os
import sys
import time
import weakref
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


class Net(nn.Module):
    """A body, one head per rank, and a spare layer no step calls."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.heads = nn.ModuleDict({"a": nn.Linear(16, 1), "b": nn.Linear(16, 1)})
        self.spare = nn.Linear(16, 1)

    def forward(self, x):
        return self.heads["ab"[dist.get_rank()]](torch.relu(self.body(x)))


def say(*words):
    print(f"rank {os.environ['RANK']}:", *words, flush=True)


def batch(step):
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def check_unused(kept, timeout):
    """Plain DDP, one backward: what this rank never reached (its bucket stays unreduced, and is dropped)."""
    torch.manual_seed(0)
    plain = DDP(Net(), process_group=ddp_group(timeout))
    kept.append(weakref.ref(plain))
    F.mse_loss(plain(batch(0)[0]), batch(0)[1]).backward()
    say("plain DDP, no grad:", sorted(params_without_grad(plain)))


def check_atomic(model, steps, work):
    path, victim = f"{work}/ck.pt", f"{work}/victim.txt"
    save_checkpoint({"steps": steps, "model": model.module.state_dict()}, path)
    if dist.get_rank() == 0:
        def half_then_fail(f):
            f.write(b"half a checkpoint")
            raise OSError("disk full")
        try:
            atomic_write(path, half_then_fail)
        except OSError as e:
            say("the write raised:", e)
        say("after the failed write, the checkpoint holds steps", torch.load(path)["steps"])
        with open(victim, "w") as f:
            f.write("precious")
        os.symlink(victim, f"{path}.tmp{os.getpid()}")  # planted under the temporary file's name
    save_checkpoint({"steps": 99}, path)
    if dist.get_rank() == 0:
        with open(victim, errors="replace") as f:  # a followed link would have filled it with the checkpoint
            say("after the planted link, the checkpoint holds steps", torch.load(path)["steps"],
                "and the link's target holds", f.read())


def wait_for_peer(work):
    """Neither rank leaves before the other gave up by itself (a leaving peer would end its wait early)."""
    open(f"{work}/gave_up_{dist.get_rank()}", "w").close()
    deadline = time.monotonic() + 20
    while not os.path.exists(f"{work}/gave_up_{1 - dist.get_rank()}") and time.monotonic() < deadline:
        time.sleep(0.05)


def skip_alone(model, skipper, work, timeout):
    """The bug the recipes fix: one rank skips backward() alone, and both wait until the timeout."""
    short = dist.new_group(timeout=timeout)  # checked, and it gives up sooner than the default group
    loss = F.mse_loss(model(batch(7)[0]), batch(7)[1])
    try:
        if dist.get_rank() == skipper:
            say("skips backward() alone")
        else:
            loss.backward()  # the backward the skipping rank never joins
        dist.all_reduce(loss.detach(), group=short)
    except RuntimeError as e:
        say("gave up:", str(e).splitlines()[0])
        dump_trace(f"{work}/fr")
        wait_for_peer(work)
        raise


def train(work, timeout, skipper, kept):
    check_unused(kept, timeout)
    torch.manual_seed(0)
    model = DDP(Net(), process_group=ddp_group(timeout), find_unused_parameters=True)
    kept.append(weakref.ref(model))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    clock = StepClock(model, torch.device("cpu"), skip=1)
    steps = 0
    for step in range(1, 7):
        x, y = batch(step)
        clock.data_ready()
        if step == 3 and dist.get_rank() == 1:
            x[0, 0] = float("nan")
        loss = F.mse_loss(model(x), y)
        if skip_this_step(loss):
            say("skipped step", step)
            continue
        if dist.get_rank() == 1:
            time.sleep(0.03)  # rank 1 is a straggler: its backward starts 30 ms after rank 0's
        optimizer.zero_grad()
        loss.backward()
        clock.backward_done()
        if step == 1:
            say("find_unused_parameters, no grad:", sorted(params_without_grad(model)))
        optimizer.step()
        clock.step_done()
        steps += 1
    found = clock.report(6, final=True)
    say("clock:", found["verdict"], found["slowest_rank"], f"{found['diagnosis_overhead']:.4f}")
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    every = [torch.empty_like(weights) for _ in range(2)]
    dist.all_gather(every, weights)
    say("steps taken", steps, "| replicas agree:", torch.equal(every[0], every[1]))
    check_atomic(model, steps, work)
    try:
        dist.all_reduce(torch.zeros(2 + dist.get_rank()))  # 2 numbers on rank 0, 3 on rank 1
    except RuntimeError as e:
        say("mismatch caught:", str(e).splitlines()[0][:200])
    skip_alone(model, skipper, work, timeout)


def main(work, skipper):
    join_process_group("gloo", timedelta(seconds=60))  # the start of two busy processes may lag by seconds
    timeout = timedelta(seconds=float(os.environ["RECIPE_TIMEOUT"]))  # DDP's group and the skipped step's
    kept = []
    try:
        train(work, timeout, skipper, kept)
    finally:
        cleanup()
        say("DDP models alive after cleanup():", [ref() is not None for ref in kept])


try:
    main(sys.argv[1], int(sys.argv[2]))
except RuntimeError as e:
    say("caught:", str(e).splitlines()[0])
'''


def launch_by_hand(work, skipper):
    path = work / "train.py"
    path.write_text(script(EVERY, TRAIN))
    env = cpu_env(OMP_NUM_THREADS=1, TORCH_DISTRIBUTED_DEBUG="DETAIL", TORCH_FR_BUFFER_SIZE=2000,
                  RECIPE_TIMEOUT=TIMEOUT)
    return path, by_hand(path, [work, skipper], work, env)


@pytest.fixture(scope="module")
def hand_run(tmp_path_factory):
    """The hand-made launch in which rank 1 skips backward() alone at the end: (folder, script, ranks)."""
    work = tmp_path_factory.mktemp("recipes")
    path, ranks = launch_by_hand(work, skipper=1)
    return work, path, ranks


def lines(ranks, rank):
    return ranks[rank][1].splitlines()


def said(ranks, rank, start):
    """What `rank` printed after `start` (its first such line), or None."""
    prefix = f"rank {rank}: {start}"
    return next((line[len(prefix):].strip() for line in lines(ranks, rank) if line.startswith(prefix)), None)


BY_HAND = pytest.mark.xdist_group("recipes_by_hand")  # one test process: the launch feeds every test below
# rank 0's own timeout in DDP's gradient all-reduce, in either of gloo's words: the wait that timed out says
# "Timed out", the other waits on the same group are told "Application timeout" (the peer leaving would be
# "Connection closed by peer")
OWN_TIMEOUT = r"Timed out waiting 5000ms|Application timeout caused pair closure"


@BY_HAND
def test_detail_safe_group_trains_and_mismatches_are_still_caught(hand_run):
    _, _, ranks = hand_run
    for rank, shape in ((0, "[2]"), (1, "[3]")):
        assert said(ranks, rank, "steps taken") == "5 | replicas agree: True", shown(ranks)  # DDP built and trained
        caught = said(ranks, rank, "mismatch caught:") or ""
        assert caught.startswith("Detected mismatch between collectives on ranks"), shown(ranks)
        assert f"OpType=ALLREDUCE, TensorShape={shape}" in caught, shown(ranks)


@BY_HAND
def test_flight_record_is_read_by_torchfrtrace(hand_run):
    work, path, ranks = hand_run
    assert sorted(os.listdir(work / "fr")) == ["rank_0", "rank_1"], shown(ranks)
    import torch  # the version only: this file's tests run torch in the launched scripts
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 8):  # the version tier's floor
        pytest.skip("torch 2.7's torchfrtrace cannot start (ModuleNotFoundError: tools; docs/versions.md)")
    out = run_bounded([*ANALYZER, work / "fr", "-p", "rank_"], work, timeout=60).stderr
    backward = next(i for i, line in enumerate(path.read_text().splitlines(), 1)
                    if "# the backward the skipping rank never joins" in line)
    # the collective rank 1 skipped: DDP's gradient all-reduce, rank 0's stack down to that backward
    assert re.search(r"Not all ranks joining collective, sequence number: \d+\n(.*\n){3}missing ranks: \{1\}", out), out
    assert f"skip_alone at {path}:{backward}" in out, out


@BY_HAND
def test_unused_parameters_are_named(hand_run):
    _, _, ranks = hand_run
    spare = "'spare.bias', 'spare.weight'"
    assert said(ranks, 0, "plain DDP, no grad:") == f"['heads.b.bias', 'heads.b.weight', {spare}]", shown(ranks)
    assert said(ranks, 1, "plain DDP, no grad:") == f"['heads.a.bias', 'heads.a.weight', {spare}]", shown(ranks)
    for rank in (0, 1):  # find_unused_parameters fills in the other rank's head
        assert said(ranks, rank, "find_unused_parameters, no grad:") == f"[{spare}]", shown(ranks)


@BY_HAND
def test_a_nan_on_one_rank_is_skipped_by_every_rank(hand_run):
    _, _, ranks = hand_run
    for rank in (0, 1):
        assert [line for line in lines(ranks, rank) if "skipped step" in line] == [f"rank {rank}: skipped step 3"], \
            shown(ranks)
        assert said(ranks, rank, "steps taken") == "5 | replicas agree: True", shown(ranks)


@BY_HAND
def test_step_clock_names_the_straggler(hand_run):
    """The clock pasted: rank 1 starts each backward 30 ms late, rank 0 waits for it in the all-reduce;
    every rank gets the verdict, rank 0 prints the table (5 steps, the first left out)."""
    _, _, ranks = hand_run
    for rank in (0, 1):
        verdict, slowest, overhead = (said(ranks, rank, "clock:") or "- - -").split()
        assert (verdict, slowest) == ("straggler", "1") and float(overhead) < 0.05, shown(ranks)
    table = re.search(r"^whole run: where a step's time goes\nrank \| .*\n   0 \| .*\n   1 \| .*\n"
                      r"verdict: straggler \(rank 1\): ", ranks[0][1], re.M)
    assert table and "where a step's time goes" not in ranks[1][1], shown(ranks)


@BY_HAND
def test_release_frees_ddp_before_destroy(hand_run):
    _, _, ranks = hand_run
    for rank, (code, _, err) in enumerate(ranks):
        assert code == 0 and "terminate called" not in err, shown(ranks)
        assert said(ranks, rank, "caught:"), shown(ranks)  # the failure went through cleanup()'s finally
        assert said(ranks, rank, "DDP models alive after cleanup():") == "[False, False]", shown(ranks)


@BY_HAND
def test_atomic_save_keeps_the_previous_file_and_follows_no_link(hand_run):
    _, _, ranks = hand_run
    assert said(ranks, 0, "the write raised:") == "disk full", shown(ranks)
    assert said(ranks, 0, "after the failed write, the checkpoint holds steps") == "5", shown(ranks)
    assert said(ranks, 0, "after the planted link, the checkpoint holds steps") == \
        "99 and the link's target holds precious", shown(ranks)


@BY_HAND
def test_ddp_group_passes_on_the_timeout(hand_run):
    """Rank 0 waits in DDP's gradient all-reduce, on ddp_group(timeout)'s group: it gives up by itself."""
    _, _, ranks = hand_run
    assert re.search(OWN_TIMEOUT, said(ranks, 0, "gave up:") or ""), shown(ranks)


@BY_HAND
def test_monitored_barrier_under_detail_names_the_rank_that_waited(hand_run):
    """docs/ddp_breaks_hangs.md: the rank that skipped (1) reaches the check's monitored barrier and names rank 0,
    which is innocent: it waits in the gradient all-reduce that rank 1 skipped."""
    _, _, ranks = hand_run
    assert said(ranks, 1, "gave up:") == ("Rank 1 successfully reached monitoredBarrier, but received errors while "
                                          "waiting for send/recv from rank 0. Please check rank 0 logs for faulty rank."), \
        shown(ranks)


@pytest.mark.slow
def test_monitored_barrier_under_detail_names_the_rank_that_waited_rank0_skips(tmp_path):
    """The same with rank 0 skipping: rank 0, the barrier's coordinator, names rank 1, the innocent one."""
    _, ranks = launch_by_hand(tmp_path, skipper=0)
    assert said(ranks, 0, "gave up:") == "[Rank 0]: Ranks 1 failed to pass monitoredBarrier in 5000 ms", shown(ranks)
    assert re.search(OWN_TIMEOUT, said(ranks, 1, "gave up:") or ""), shown(ranks)


# ---------------------------------------------------------------- torchrun --max-restarts=1: the store's namespaces
RESTART = '''
import os
import sys
from datetime import timedelta

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def train(marker):
    """Five steps; rank 1 of the first attempt exits at step 2 (once: the marker file)."""
    rank, attempt = dist.get_rank(), os.environ["TORCHELASTIC_RESTART_COUNT"]
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, 6):
        if step == 2 and rank == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            print(f"rank 1 of attempt {attempt}: exits at step 2", flush=True)
            sys.exit(1)
        loss = model(torch.randn(8, 4)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"rank {rank} of attempt {attempt}: trained 5 steps", flush=True)


join_process_group("gloo", timedelta(seconds=30))
try:
    train(sys.argv[1])
finally:
    cleanup()
'''


@pytest.mark.slow  # a torchrun launch of two attempts (12-14 s): the default suite's budget
def test_store_lets_a_restarted_attempt_join(tmp_path):
    path = tmp_path / "restart.py"
    path.write_text(script((STORE, RELEASE), RESTART))
    env = cpu_env(OMP_NUM_THREADS=1)
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # torchrun's shared store, as the tutorial's command has it
    r = run_bounded([*torchrun_cmd(), "--standalone", "--nproc-per-node=2", "--max-restarts=1",
                     path, tmp_path / "failed_once"], tmp_path, timeout=120, env=env, check=False)
    assert "rank 1 of attempt 0: exits at step 2" in r.stdout, r
    assert "rank 0 of attempt 1: trained 5 steps" in r.stdout and "rank 1 of attempt 1: trained 5 steps" in r.stdout, r
    assert r.returncode == 0, r
