"""ddp_transformer.py at another world size: the position in global units, the global batch kept, MFU.

Default tier, in this process (no launch): the split chooser and its one-line answers, the position
arithmetic (every window of an epoch once at any world size, the sampler's padding counted), the
unfold windows, the peak table, bench's MFU column.

Slow tier (launches, one uninterrupted run feeding every comparison): a world-2 run to step 40
against the same run stopped at step 20 and resumed at world 1 and at world 4; 2 -> 3 is one error
line; ranks that resumed at different steps are one error line.
"""
import contextlib
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import types
from collections import Counter

import pytest
import torch
from torch.utils.data import DistributedSampler

import ddp_transformer
from conftest import ROOT, cpu_env, read_metrics, run_bounded, torchrun_cmd

SCRIPT = str(ROOT / "ddp_transformer.py")


# ================================================================ default tier: in this process
def test_the_split_keeps_the_global_batch_from_what_the_user_did_not_pass():
    choose = ddp_transformer.choose_split
    # nothing passed: the checkpoint's per-process batch (8) where it divides the share, else the largest below
    assert choose(16, 2, {}, 8) == (8, 1)
    assert choose(16, 1, {}, 8) == (8, 2)  # shrink: the same micro-batch, twice the accumulation
    assert choose(16, 4, {}, 8) == (4, 1)  # grow: a smaller per-process batch
    assert choose(16, 16, {}, 8) == (1, 1)
    assert choose(24, 2, {}, 8) == (6, 2)  # 12 windows per process: 8 does not divide it, 6 does
    assert choose(16, 3, {}, 8) is None and choose(16, 32, {}, 8) is None  # no split of 16 over 3 (or 32)
    # what the user passed is kept, the rest chosen; a passed value that cannot keep G: no split
    assert choose(16, 1, {"grad_accum": 4}, 8) == (4, 4)
    assert choose(16, 2, {"batch_size": 2}, 8) == (2, 4)
    assert choose(16, 4, {"batch_size": 8}, 8) is None
    assert choose(16, 2, {"batch_size": 4, "grad_accum": 2}, 8) == (4, 2)
    assert choose(16, 2, {"batch_size": 4, "grad_accum": 1}, 8) is None
    assert choose(16, 2, {"grad_accum": 3}, 8) is None


STATE = {"global_batch": 16, "batch_size": 8, "world_size": 2}


def keep(world, capsys, monkeypatch, **passed):
    """resume_at_another_world_size as main() calls it, on rank 0 of a job (a checkpoint of 2 x 8 x 1 windows)."""
    monkeypatch.delenv("RANK", raising=False)
    args = types.SimpleNamespace(passed=passed, batch_size=passed.get("batch_size", 8),
                                 grad_accum=passed.get("grad_accum", 1), checkpoint="ck.pt")
    code = None
    try:
        ddp_transformer.resume_at_another_world_size(args, STATE, world)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return args, code, out.out.strip().splitlines(), out.err.strip().splitlines()


def test_keeping_the_global_batch_says_what_it_chose_or_one_error_line(capsys, monkeypatch):
    args, code, out, err = keep(4, capsys, monkeypatch)
    assert code is None and (args.batch_size, args.grad_accum) == (4, 1) and not err
    assert out == ["global batch kept: 16 windows a step, as ck.pt was trained (2 processes), so each step trains "
                   "the batch an uninterrupted run would: here 4 processes x --batch_size 4 x --grad_accum 1"], out
    args, code, out, err = keep(1, capsys, monkeypatch)
    assert code is None and (args.batch_size, args.grad_accum) == (8, 2) and len(out) == 1
    args, code, out, err = keep(2, capsys, monkeypatch)  # the same world: nothing chosen, nothing said
    assert code is None and (args.batch_size, args.grad_accum) == (8, 1) and out == err == []
    # 16 windows over 3 processes: one line naming the world sizes that fit
    _, code, out, err = keep(3, capsys, monkeypatch)
    assert code == 2 and out == [] and err == [
        "error: ck.pt was trained with a global batch of 16 windows a step (2 processes), which cannot be kept "
        "at 3 processes (resume at 1, 2, 4, 8, 16 processes; or start afresh with another --checkpoint)"], err
    # a flag the user passed that cannot keep it: the line names the flag
    _, code, _, err = keep(4, capsys, monkeypatch, batch_size=8)
    assert code == 2 and len(err) == 1 and "at 4 processes with --batch_size 8 (drop --batch_size 8 and a " \
                                           "split is chosen;" in err[0], err
    _, code, _, err = keep(3, capsys, monkeypatch, grad_accum=3)
    assert code == 2 and len(err) == 1 and "(drop --grad_accum 3 and resume at 1, 2, 4, 8, 16 processes;" in err[0]


def steps_at(world, n, global_batch, epoch, first=0, seed=0):
    """{step: [windows of every rank], windows the step counts} of one epoch at `world`, from the script's
    own epoch_steps over each rank's DistributedSampler (which needs no process group when told its place)."""
    steps = {}
    for rank in range(world):
        sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=seed)
        sampler.set_epoch(epoch)
        for s, windows, count in ddp_transformer.epoch_steps(sampler, global_batch, first):
            steps.setdefault(s, [[], count])[0].extend(windows.tolist())
    return steps


@pytest.mark.parametrize("n,global_batch,worlds", [(249, 16, (1, 2, 4, 8, 16)), (250, 12, (1, 2, 3, 4, 6, 12)),
                                                   (7, 4, (1, 2, 4))])
def test_every_window_once_an_epoch_at_any_world_size(n, global_batch, worlds):
    """Step s trains positions [s G, (s+1) G) of the epoch's order at every world size, the last step what is
    left; DistributedSampler's padding (which depends on the world size) is counted and never trained."""
    order = list(DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=True, seed=0))  # epoch 0's order
    steps_per_epoch = math.ceil(n / global_batch)
    for world in worlds:
        shares = [len(DistributedSampler(range(n), num_replicas=world, rank=r, seed=0)) for r in range(world)]
        assert sum(shares) - n == (-n) % world  # what the sampler pads: world-dependent
        steps = steps_at(world, n, global_batch, epoch=0)
        assert sorted(steps) == list(range(steps_per_epoch))
        for s, (windows, count) in steps.items():
            assert sorted(windows) == sorted(order[s * global_batch:(s + 1) * global_batch]), (world, s)
            assert count == len(windows) == min(global_batch, n - s * global_batch)
        trained = Counter(w for windows, _ in steps.values() for w in windows)
        assert trained == Counter(range(n)), f"world {world}: a window trained twice or never"
    # stopped after 3 steps at world 2, resumed from window 3 x G at each other world size: each window once
    before = steps_at(2, n, global_batch, epoch=0)
    for world in worlds:
        after = steps_at(world, n, global_batch, epoch=0, first=1)
        assert sorted(after) == list(range(1, steps_per_epoch))
        trained = Counter(before[0][0] + [w for windows, _ in after.values() for w in windows])
        assert trained == Counter(range(n)), world
    # the next epoch (set_epoch, carried in the checkpoint) is another order, the same at every world size
    one, most = steps_at(1, n, global_batch, epoch=1), steps_at(worlds[-1], n, global_batch, epoch=1)
    assert all(sorted(one[s][0]) == sorted(most[s][0]) for s in one)
    assert [w for s in sorted(one) for w in one[s][0]] != order


def test_windows_are_the_slices_they_were():
    """Tensor.unfold gives the same windows as the explicit slices: window i = tokens[i*T : i*T + T + 1]."""
    for length, block in ((10, 1), (33, 4), (129, 8), (1000, 32), (65, 64)):
        tokens = torch.randint(0, 50, (length,), generator=torch.Generator().manual_seed(length))
        windows = ddp_transformer.Windows(tokens, block)
        assert len(windows) == (length - 1) // block
        for i in range(len(windows)):
            x, y = windows[i]
            start = i * block
            assert torch.equal(x, tokens[start:start + block]) and torch.equal(y, tokens[start + 1:start + block + 1])
        last = len(windows) - 1
        x, y = windows[torch.tensor([last, 0])]  # a batch: one gather
        assert x.shape == (2, block) and torch.equal(x[1], windows[0][0]) and torch.equal(y[0], windows[last][1])


def test_each_epoch_shifts_the_grid_so_every_position_starts_a_window():
    """Epoch e cuts its windows from offset window_offset(seed, e, T): over T epochs the offsets are 0 .. T-1,
    so every position that can start a window does; each epoch still has (len - 1) // T windows of T + 1
    tokens inside the text, consecutive ones sharing a token, a shifted-out last window the text's last."""
    for length, block in ((1000, 32), (129, 8), (65, 64), (10, 1)):
        tokens = torch.arange(length)  # token = its position: a window's first token is where it starts
        windows = ddp_transformer.Windows(tokens, block)
        for seed in (0, 7):
            offsets = [ddp_transformer.window_offset(seed, e, block) for e in range(3 * block)]
            assert all(sorted(offsets[c * block:(c + 1) * block]) == list(range(block)) for c in range(3))
            assert offsets[0] == 0  # the first epoch's windows are those of the unshifted grid
            starts = set()
            for e, offset in enumerate(offsets[:block]):
                windows.shift(offset)
                x, y = windows[torch.arange(len(windows))]
                assert len(windows) == (length - 1) // block and x.shape == y.shape == (len(windows), block)
                assert torch.equal(y[:, :-1], x[:, 1:]) and int(y.max()) <= length - 1  # targets: the next tokens
                expected = [min(offset + i * block, length - block - 1) for i in range(len(windows))]
                assert x[:, 0].tolist() == expected, (length, block, seed, e)
                starts.update(expected)
            assert starts == set(range(length - block)), (length, block, seed)
        assert offsets != [ddp_transformer.window_offset(0, e, block) for e in range(3 * block)] or block == 1
    windows.shift(0)  # the grid at 0 is the one before shifting: window i = tokens[i T : i T + T + 1]
    assert torch.equal(windows[3][0], tokens[3:4])


def test_shifted_windows_are_the_same_batches_at_any_world_size_and_after_a_resume():
    """The offset is a function of (seed, epoch) alone: step s of an epoch trains the same text at world 1, 2
    and 4, and a run resumed mid-epoch (epoch_steps from step `first`) trains what an uninterrupted one would."""
    tokens = torch.arange(8870)  # test_elastic's text: 249 windows of 32, a global batch of 16
    block, global_batch = 32, 16
    n = (len(tokens) - 1) // block

    def text_of_steps(world, epoch, first=0, seed=0):
        windows = ddp_transformer.Windows(tokens, block)
        windows.shift(ddp_transformer.window_offset(seed, epoch, block))  # as train() does, on every rank
        steps = steps_at(world, n, global_batch, epoch, first, seed)
        return {s: sorted(windows[torch.tensor(w)][0][:, 0].tolist()) for s, (w, _) in steps.items()}

    for epoch in (0, 1, 5):
        one = text_of_steps(1, epoch)
        assert len(one) == math.ceil(n / global_batch)
        assert any(start % block for starts in one.values() for start in starts) or epoch == 0 and \
            ddp_transformer.window_offset(0, 0, block) == 0
        for world in (2, 4):
            assert text_of_steps(world, epoch) == one, (world, epoch)
            resumed = text_of_steps(world, epoch, first=5)
            assert resumed == {s: one[s] for s in range(5, len(one))}, (world, epoch)
    assert text_of_steps(2, 1) != text_of_steps(2, 2)  # another epoch: another grid (and order)


def test_preset_cpu10_is_the_documented_recipe():
    """--preset cpu10 fills the settings it lists (a time budget, no step count) and a flag passed beside it
    wins; the README gives the one command; the budget's schedule climbs to --lr and ends at lr x --lr_floor
    (0 in the recipe: at a rate of zero), the default's at a tenth of it."""
    recipe = ddp_transformer.PRESETS["cpu10"]
    args = ddp_transformer.fill_defaults(ddp_transformer.parse_args(["--preset", "cpu10", "--data", "x.txt"]))
    assert {k: getattr(args, k) for k in recipe} == recipe
    assert args.max_steps is None and args.epochs is None and args.time_budget == recipe["time_budget"] <= 540
    assert ddp_transformer.run_length(100, args) == (sys.maxsize, sys.maxsize)  # only the clock ends it
    mine = ddp_transformer.fill_defaults(ddp_transformer.parse_args(["--preset", "cpu10", "--d_model", "64",
                                                                     "--max_steps", "30"]))
    assert (mine.d_model, mine.num_layers, mine.max_steps) == (64, recipe["num_layers"], 30)
    assert ddp_transformer.run_length(100, mine) == (30, 1)
    plain = ddp_transformer.fill_defaults(ddp_transformer.parse_args([]))  # no preset: today's defaults
    assert (plain.d_model, plain.block_size, plain.time_budget, plain.max_steps) == (128, 128, 0, 60)
    readme = (ROOT / "README.md").read_text()
    assert "CUDA_VISIBLE_DEVICES= torchrun --standalone --nproc-per-node=2 ddp_transformer.py --device cpu " \
           "--data input.txt --preset cpu10\n" in readme
    # the warmup and cosine along the budget: up to lr, then down to lr x --lr_floor at the end
    share = [i / 100 for i in range(101)]
    for floor, end in ((None, 0.0), ("0.1", 0.1), ("0.5", 0.5)):  # the recipe's 0, the default's 0.1
        run = args if floor is None else ddp_transformer.fill_defaults(ddp_transformer.parse_args(
            ["--preset", "cpu10", "--lr_floor", floor]))
        lr = [ddp_transformer.lr_at_fraction(x, run) for x in share]
        peak = lr.index(max(lr))
        assert share[peak] == run.warmup and lr[peak] == pytest.approx(run.lr)
        assert lr[:peak] == sorted(lr[:peak]) and lr[peak:] == sorted(lr[peak:], reverse=True)
        assert lr[-1] == pytest.approx(run.lr * end, abs=1e-12) and 0 < lr[0] < run.lr / 10
        assert lr[95] > lr[-1] + run.lr * (1 - end) / 200  # still coming down near the end
    assert plain.lr_floor == 0.1 and ddp_transformer.lr_at(59, 60, plain) == pytest.approx(
        plain.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 53 / 54))))  # the default: as before


@pytest.mark.parametrize("name", ["ddp_transformer", "fsdp_transformer"])
def test_weight_decay_reaches_the_matrices_only_and_a_bad_one_is_one_line(name, capsys):
    """--weight_decay (the cpu10 recipe's 0.3 against the default 0.1: docs/ten_minutes.md) decays the
    weight matrices, Muon's and AdamW's alike, never the biases, the gains or the embedding; a negative or
    NaN one is one error line, exit 2. (A resumed run keeps its own: test_scripts' transformer resume.)"""
    module = __import__(name)
    torch.manual_seed(0)
    model = ddp_transformer.Transformer(vocab_size=11, d_model=16, num_heads=2, d_ff=32, num_layers=2, max_len=8)
    names = {id(p): n for n, p in model.named_parameters()}
    for optimizer in (["adamw"] if name == "fsdp_transformer" else ["adamw", "muon"]):
        args = module.parse_args(["--weight_decay", "0.3", "--optimizer", optimizer, "--lr", "1e-3"])
        groups = module.make_optimizer(model, args).param_groups
        decayed = {names[id(p)] for g in groups if g["weight_decay"] for p in g["params"]}
        assert all(g["weight_decay"] in (0.0, 0.3) for g in groups), groups
        assert decayed == {n for n, p in model.named_parameters() if p.dim() == 2 and "embedding" not in n}, decayed
    bad_ones = [("--weight_decay", "-0.1"), ("--weight_decay", "nan")]
    if name == "ddp_transformer":  # --lr_floor (the cpu10 recipe's 0) is the budgeted script's
        bad_ones += [("--lr_floor", "-0.1"), ("--lr_floor", "1.5"), ("--lr_floor", "nan")]
    for flag, bad in bad_ones:
        with pytest.raises(SystemExit) as exited:
            module.check_args(module.parse_args(["--device", "cpu", flag, bad]))
        lines = capsys.readouterr().err.strip().splitlines()
        assert exited.value.code == 2 and len(lines) == 1 and flag in lines[0], lines


def test_peak_table_by_device_name_and_precision():
    """Dense peaks (TFLOP/s) by the names torch.cuda.get_device_name reports; none for what the table lacks."""
    peak = ddp_transformer.peak_of
    for name, precision, tflops in (("NVIDIA H100 80GB HBM3", "bf16", 989), ("NVIDIA H100 PCIe", "bf16", 756),
                                    ("NVIDIA H100 NVL", "fp16", 835), ("NVIDIA H200", "bf16", 989),
                                    ("NVIDIA H200 NVL", "bf16", 835), ("NVIDIA A100-SXM4-80GB", "fp32", 19.5),
                                    ("NVIDIA A100 80GB PCIe", "bf16", 312), ("NVIDIA L40S", "bf16", 362),
                                    ("NVIDIA L4", "fp16", 121), ("NVIDIA A10G", "bf16", 125),
                                    ("Tesla V100-SXM2-16GB", "fp16", 125), ("Tesla V100-PCIE-32GB", "fp32", 14),
                                    ("AMD Instinct MI300X", "bf16", 1307.4), ("Tesla T4", "fp16", 65),
                                    ("NVIDIA GeForce RTX 4090", "bf16", 165.2), ("NVIDIA GeForce RTX 3090", "fp16", 71),
                                    ("NVIDIA A10", "bf16", 125), ("NVIDIA A10-24Q", "fp32", 31.2)):
        assert peak(name, precision)[0] == pytest.approx(tflops * 1e12), name
    # a name that holds a listed one is another device: the RTX A1000 read the A100's 312 (an MFU 20x too low)
    for name, precision in (("NVIDIA GH200 480GB", "bf16"), ("NVIDIA L40", "bf16"), ("NVIDIA RTX A1000", "bf16"),
                            ("NVIDIA RTX A1000 6GB Laptop GPU", "fp32"), ("NVIDIA A100X", "bf16"),
                            ("NVIDIA GeForce RTX 4090 D", "bf16"), ("NVIDIA GeForce RTX 4090 Laptop GPU", "fp16"),
                            ("NVIDIA GeForce RTX 3090 Ti", "bf16"), ("NVIDIA RTX A4000", "fp16"), ("Tesla T40", "fp16"),
                            ("NVIDIA H1000", "bf16"), ("Tesla V100-SXM2-16GB", "bf16"), ("Tesla T4", "bf16")):
        assert peak(name, precision)[0] is None, name
    args = types.SimpleNamespace(peak_tflops=None, amp="off")
    assert ddp_transformer.device_peak(args, torch.device("cpu")) == (None, "no peak is known for the CPU")
    args.peak_tflops = 0.5
    assert ddp_transformer.device_peak(args, torch.device("cpu"))[0] == 0.5e12


def test_bench_transformer_rows_carry_the_mfu(tmp_path):
    """bench.py files each run's mfu (when the script knows its peak) and the row shows the median."""
    sys.path.insert(0, str(ROOT))
    import bench
    spec = bench.BENCHMARKS["transformer"]
    s = bench.Setting("scaling", "transformer", spec, 2, 1)
    for tokens, mfu in ((100, 0.2), (120, 0.24), (110, 0.22)):
        bench.file_run(s, {"tokens_per_s": tokens, "world_size": 2, "threads_per_process": 1, "mfu": mfu}, "",
                       "cpu")
    [row] = bench.rows_from([s], "cpu")
    assert row["mfu"] == 0.22 and bench.row_line(row).endswith("100 120 110 | MFU 22.00%")
    plain = bench.Setting("scaling", "transformer", spec, 1, 1)  # no peak known: no mfu, no column text
    bench.file_run(plain, {"tokens_per_s": 50, "world_size": 1, "mfu": None}, "", "cpu")
    [row] = bench.rows_from([plain], "cpu")
    assert "mfu" not in row and "MFU" not in bench.row_line(row)
    # bench --peak_tflops reaches the Transformer's launches
    args = types.SimpleNamespace(device="cpu", quick=True, peak_tflops=0.08)
    flags = {"--device", "--metrics", "--data", "--peak_tflops", *spec["sizes"](1, True)}
    [(cmd, *_)] = bench.launch_jobs(bench.Setting("scaling", "transformer", spec, 1, 1), args, flags, str(tmp_path))
    assert cmd[cmd.index("--peak_tflops") + 1] == "0.08"


# ================================================================ slow tier: launches
# A text of 8,870 characters: 249 training windows of 32 characters, so a global batch of 16 makes 16 steps an
# epoch, the last one of 9 windows (unequal shares at world 2 and 4, where DistributedSampler pads 1 and 3).
# 40 steps are 2.5 epochs; step 20 is 4 steps into the second. --lr_decay_steps 40: the run stopped at 20
# follows the 40-step schedule. A small model, one thread per process: each launch takes seconds.
TEXT_CHARS, WINDOWS = 8870, 249
SMALL = ["--device", "cpu", "--data", "text.txt", "--d_model", "32", "--num_layers", "1", "--block_size", "32",
         "--sample", "0", "--log_every", "1", "--lr_decay_steps", "40"]


def torchrun(n, *args):
    return [*torchrun_cmd(), "--standalone", f"--nproc-per-node={n}", SCRIPT, *SMALL, *args]


def hand_launch(cwd, per_rank, timeout=120):
    """Two processes started by hand (RANK, WORLD_SIZE, MASTER_* each), each with its own arguments;
    returns [(exit code, stdout, stderr)] per rank. Bounded: both sessions are killed at the end."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, SCRIPT, *SMALL, *args], cwd=cwd, text=True, start_new_session=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                              env=cpu_env(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=len(per_rank), OMP_NUM_THREADS=1,
                                          MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for rank, args in enumerate(per_rank)]
    try:
        done = []
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            done.append((p.returncode, out, err))
        return done
    except subprocess.TimeoutExpired:
        pytest.fail(f"the hand-made launch did not end within {timeout} s (a hang)")
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def elastic(tmp_path_factory):
    """Every launch once: the uninterrupted world-2 run to step 40, the run stopped at 20 (checkpointing
    every 5 steps), its checkpoint resumed at world 1 (plain python), 4 and 3 (torchrun), and a hand-made
    launch whose two ranks resume from different checkpoints (steps 40 and 20)."""
    work = tmp_path_factory.mktemp("elastic")
    (work / "text.txt").write_text(ddp_transformer.default_corpus()[:TEXT_CHARS], encoding="utf-8")
    env, runs = cpu_env(OMP_NUM_THREADS=1), {}

    def launch(name, cmd, check=True):
        runs[name] = run_bounded(cmd, work, timeout=240, env=env, check=check)

    launch("ref", torchrun(2, "--max_steps", "40", "--checkpoint", "ref.pt", "--metrics", "ref.json"))
    launch("stop", torchrun(2, "--max_steps", "20", "--save_every_steps", "5", "--checkpoint", "stop.pt",
                            "--metrics", "stop.json"))
    for world in (1, 4, 3):
        shutil.copy(work / "stop.pt", work / f"w{world}.pt")
    resume = ["--max_steps", "40", "--resume"]
    launch("w1", [sys.executable, SCRIPT, *SMALL, *resume, "--checkpoint", "w1.pt", "--metrics", "w1.json"])
    launch("w4", torchrun(4, *resume, "--checkpoint", "w4.pt", "--metrics", "w4.json"))
    launch("w3", torchrun(3, *resume, "--checkpoint", "w3.pt"), check=False)
    runs["mixed"] = hand_launch(work, [[*resume, "--checkpoint", "ref.pt"], [*resume, "--checkpoint", "stop.pt"]])
    launch("muon", torchrun(2, "--max_steps", "20", "--optimizer", "muon", "--checkpoint", "muon.pt",
                            "--metrics", "muon.json"))
    shutil.copy(work / "stop.pt", work / "adamw.pt")
    launch("other", [sys.executable, SCRIPT, *SMALL, *resume, "--optimizer", "muon", "--checkpoint", "adamw.pt"],
           check=False)
    return work, runs


def step_lines(out):
    """{step: (loss, learning rate as printed)} from the `step s/N | loss | lr` lines."""
    return {int(s): (float(loss), lr) for s, loss, lr in
            re.findall(r"^step (\d+)/\d+ \| loss ([\d.]+) \| lr (\S+)", out, flags=re.MULTILINE)}


@pytest.mark.slow
@pytest.mark.xdist_group("elastic_transformer")
@pytest.mark.parametrize("world", [1, 4])
def test_resumed_at_another_world_size_follows_the_uninterrupted_run(elastic, world):
    """Stopped at step 20 at world 2, resumed at world 1 (one process, --grad_accum 2 chosen) and at world 4
    (--batch_size 4 chosen): steps 21-40 train the same global batches as the uninterrupted world-2 run.

    Tolerance: the same windows, summed in another order (micro-batches of 8 x 2, 8 or 4 x 1 per process, and
    gloo adding 1, 2 or 4 gradients) round differently in float32's last bits, about 1e-7 of a value. Losses,
    means over thousands of tokens, keep that: equal to 1e-5 relative (measured: equal as printed, about
    1e-7 relative in the last epoch's mean). Weights drift more where AdamW divides a near-zero gradient by its own
    small second moment: 2e-4 absolute (measured 3e-5 at world 1 and 4e-5 at world 4 after 20 steps)."""
    work, runs = elastic
    ref, resumed = runs["ref"].stdout, runs[f"w{world}"].stdout
    split = "--batch_size 8 x --grad_accum 2" if world == 1 else "--batch_size 4 x --grad_accum 1"
    assert f"global batch kept: 16 windows a step, as w{world}.pt was trained (2 processes), so each step trains " \
           f"the batch an uninterrupted run would: here {world} process{'es' if world > 1 else ''} x {split}" in resumed, resumed
    assert f"resuming from w{world}.pt at epoch 1, step 20, window 64 of {WINDOWS} in the epoch's order" in resumed
    before, after = step_lines(ref), step_lines(resumed)
    assert sorted(before) == list(range(1, 41)) and sorted(after) == list(range(21, 41)), resumed
    for s in after:  # the same loss on each step's batch, at the same learning rate (the schedule carried)
        assert after[s][0] == pytest.approx(before[s][0], abs=1e-4), (s, after[s], before[s])
        assert after[s][1] == before[s][1], (s, after[s], before[s])
    m_ref, m = read_metrics(work / "ref.json"), read_metrics(work / f"w{world}.json")
    # the epoch after the stop, from the sampler's epoch 2 (its order carried): the same mean loss
    assert m["losses"][-1] == pytest.approx(m_ref["losses"][-1], rel=1e-5) and m["epochs"] == m_ref["epochs"] == 3
    assert m["val_loss"] == pytest.approx(m_ref["val_loss"], rel=1e-5) and m["replicas_in_sync"] is True
    ours, theirs = (torch.load(work / f, weights_only=True) for f in (f"w{world}.pt", "ref.pt"))
    assert (ours["step"], ours["epoch"], ours["windows_in_epoch"]) == (theirs["step"], theirs["epoch"],
                                                                       theirs["windows_in_epoch"]) == (40, 2, 128)
    for name, weight in theirs["model"].items():
        assert torch.allclose(ours["model"][name], weight, rtol=0, atol=2e-4), name
    print(f"world {world}: largest step-loss difference "
          f"{max(abs(after[s][0] - before[s][0]) for s in after):.1e} (as printed), last epoch's mean "
          f"{abs(m['losses'][-1] - m_ref['losses'][-1]) / m_ref['losses'][-1]:.1e} relative, largest weight "
          f"difference {max((ours['model'][k] - w).abs().max().item() for k, w in theirs['model'].items()):.1e}")


@pytest.mark.slow
@pytest.mark.xdist_group("elastic_transformer")
def test_every_window_of_the_epoch_trained_once_across_the_stop(elastic):
    """Windows counted by the ranks (their tokens, all-reduced): each epoch 249 windows in the uninterrupted
    run; the stopped run's 64 of its second epoch plus the resumed run's 185 make 249 at world 1 and 4.
    The stopped run also checkpointed every 5 steps (mid-epoch), and timed each checkpoint."""
    work, _ = elastic
    ref, stop = read_metrics(work / "ref.json"), read_metrics(work / "stop.json")
    assert ref["windows"] == [WINDOWS, WINDOWS, 128] and stop["windows"] == [WINDOWS, 64]
    for world in (1, 4):
        m = read_metrics(work / f"w{world}.json")
        assert m["windows"] == [WINDOWS - 64, 128] and m["global_batch"] == 16 and m["world_size"] == world, m
    # steps 5, 10, 15 (mid-epoch), 16 (the epoch's end), 20 (the run's end)
    assert stop["checkpoints"] == 5 and stop["checkpoint_s"] > 0, stop
    print(f"one checkpoint of the small model: {stop['checkpoint_s'] * 1000:.1f} ms (median of 5)")


@pytest.mark.slow
@pytest.mark.xdist_group("elastic_transformer")
def test_a_global_batch_that_cannot_be_kept_is_one_error_line(elastic):
    """2 -> 3: 16 windows do not split over 3 processes; one line names the world sizes that fit."""
    _, runs = elastic
    r = runs["w3"]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode != 0 and errors == [
        "error: w3.pt was trained with a global batch of 16 windows a step (2 processes), which cannot be kept at "
        "3 processes (resume at 1, 2, 4, 8, 16 processes; or start afresh with another --checkpoint)"], r
    assert "step 1" not in r.stdout and "Traceback (most recent call last):\n  File \"" + SCRIPT not in r.stderr


@pytest.mark.slow
@pytest.mark.xdist_group("elastic_transformer")
def test_muon_learns_in_sync_and_an_adamw_checkpoint_is_refused_to_it(elastic):
    """--optimizer muon at world 2: the loss falls and the replicas agree (every rank orthogonalizes the
    same all-reduced gradient); its checkpoint resumes, and an AdamW checkpoint resumed with Muon is one line."""
    work, runs = elastic
    m = read_metrics(work / "muon.json")
    assert m["val_loss"] < m["first_val_loss"] - 0.5 and m["replicas_in_sync"] is True, runs["muon"].stdout
    assert "| muon |" in runs["muon"].stdout
    r = runs["other"]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and errors[0].startswith(
        "error: adamw.pt holds another optimizer's state than --optimizer muon's (") and errors[0].endswith(
        "(pass the --optimizer that wrote it, or delete it to start afresh)"), r
    assert "Traceback" not in r.stderr and not re.search(r"^step \d+", r.stdout, flags=re.MULTILINE)


@pytest.mark.slow
@pytest.mark.xdist_group("elastic_transformer")
def test_ranks_that_resumed_at_different_steps_are_one_error_line(elastic):
    """Node-local checkpoints after a restart: rank 0 finds step 40, rank 1 step 20. Before any training step
    the ranks compare their steps (check_same_on_every_rank): one error line, exit 2, no hang."""
    _, runs = elastic
    (code0, out0, err0), (code1, out1, err1) = runs["mixed"]
    errors = [line for line in (err0 + err1).splitlines() if line.startswith("error:")]
    assert code0 == 2 and code1 == 2, runs["mixed"]
    assert errors == ["error: the ranks' resume steps (0: not resumed) differ: [40, 20] (every rank must read the "
                      "same checkpoint: put --checkpoint on a file system every node sees, or copy the newest one "
                      "to every node)"], (err0, err1)
    assert not re.search(r"^step \d+", out0 + out1, flags=re.MULTILINE) and "Traceback" not in err0 + err1


@pytest.mark.slow
def test_a_time_budget_ends_both_ranks_on_the_clock_with_the_learning_rate_decayed(tmp_path):
    """--time_budget 40: the two ranks stop at the same step once the slowest clock passes 40 s from the
    script's start; the warmup and cosine span the seconds from the first step (the learning rate climbs
    to its peak, then ends near a tenth of it); the checkpoint carries the seconds, so resuming it with
    the same budget has nothing left to train (one line)."""
    (tmp_path / "text.txt").write_text(ddp_transformer.default_corpus()[:TEXT_CHARS], encoding="utf-8")
    env, budget = cpu_env(OMP_NUM_THREADS=1), 40  # start-up takes seconds of it (20 s on a busy machine)
    cmd = torchrun(2, "--time_budget", str(budget), "--checkpoint", "t.pt", "--metrics", "t.json", "--warmup", "0.2")
    at = cmd.index("--lr_decay_steps")
    del cmd[at:at + 2]  # the clock alone ends it: no step schedule saved (a resume of it was refused until issue 43)
    out = run_bounded(cmd, tmp_path, timeout=240, env=env).stdout
    m = read_metrics(tmp_path / "t.json")
    assert m["replicas_in_sync"] and m["steps"] >= 10, out
    assert f"| {budget} s of training in epochs of 16 steps of 1 micro-batch x 8 windows x 2 processes" in out
    clock = [float(s) for s in re.findall(rf"^step \d+ \(at (\d+)/{budget} s\) \| loss", out, re.M)]
    lrs = [float(x) for x in re.findall(r"^step \d+ \(at \d+/\d+ s\) \| loss [0-9.]+ \| lr ([0-9.e+-]+)", out, re.M)]
    assert len(lrs) == m["steps"] and clock == sorted(clock) and clock[-1] <= budget, out
    peak = lrs.index(max(lrs))
    assert 0 < peak < len(lrs) - 1 and max(lrs) > 0.8 * 3e-3 and lrs[-1] < 0.2 * 3e-3, lrs
    state = torch.load(tmp_path / "t.pt", weights_only=True)
    assert state["step"] == m["steps"] and budget <= state["budget_spent_s"] < budget + 30
    cmd = torchrun(2, "--time_budget", str(budget), "--checkpoint", "t.pt", "--resume")
    del cmd[at:at + 2]
    again = run_bounded(cmd, tmp_path, timeout=240, env=env).stdout
    assert f"nothing to train: t.pt is at second {round(state['budget_spent_s'])} and --time_budget {budget}" in again
