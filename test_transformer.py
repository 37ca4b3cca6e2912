"""Tests for ddp_transformer.py: causality, no_sync accumulation, learning, toy run, checkpoints, errors.

The scripts run as users run them (torchrun or plain python, on CPU with gloo), each
launch bounded by the `launch` fixture; the accumulation test starts two real gloo
ranks in-process with torch.multiprocessing.
"""
import contextlib
import gc
import math
import os
import sys
import time
from collections import Counter
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_transformer
from ddp_transformer import Transformer

SCRIPT = "ddp_transformer.py"
# a small model for the runs that test behaviour, not learning
SMALL = ["--d_model", "32", "--num_layers", "1", "--block_size", "32", "--batch_size", "16", "--sample", "0"]


def torchrun2(torchrun, script, *args):
    return [*torchrun, "--standalone", "--nproc-per-node=2", script(SCRIPT), "--device", "cpu", *args]


def error_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("error:")]


# ---------------------------------------------------------------- causality
@pytest.mark.parametrize("device,amp", [("cpu", None), ("cpu", torch.bfloat16), *[
    pytest.param("cuda", dtype, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))
    for dtype in (None, torch.bfloat16)]])
def test_changing_token_t_changes_no_logit_before_t(device, amp):
    torch.manual_seed(0)
    model = Transformer(50, 32, 4, 64, 3, 64).to(device).eval()
    x = torch.randint(0, 50, (3, 40), device=device)
    for t in (0, 17, 39):
        changed = x.clone()
        changed[:, t] = (x[:, t] + 1) % 50
        with torch.no_grad(), torch.autocast(device, dtype=amp, enabled=amp is not None):
            before, after = model(x).float(), model(changed).float()
        assert before.shape == (3, 40, 50)
        assert torch.allclose(before[:, :t], after[:, :t], atol=1e-6, rtol=0), f"logits before {t} moved"
        assert (before[:, t:] - after[:, t:]).abs().max() > 1e-3, f"token {t} changed nothing at or after {t}"


# ---------------------------------------------------------------- gradient accumulation
def counting_allreduce(calls, bucket):
    """DDP's own all-reduce hook, counting the buckets it sends."""
    calls.append(bucket.index())
    return default_hooks.allreduce_hook(None, bucket)


def one_step(micro_batches, vocab, wrap):
    """Fresh seeded model, one SGD step of train_step over micro_batches; returns (parameters, all-reduces)."""
    torch.manual_seed(0)
    model = Transformer(vocab, 16, 2, 32, 2, 16)
    calls = []
    trained = model
    if wrap:
        trained = DDP(model, gradient_as_bucket_view=True)  # as the script wraps it
        trained.register_comm_hook(calls, counting_allreduce)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    ddp_transformer.train_step(trained, optimizer, scaler, micro_batches, contextlib.nullcontext(), clip=0)
    params = [p.detach().clone() for p in model.parameters()]
    del trained, model
    return params, len(calls)


def accumulation_worker(rank, world, port, k):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        vocab = 20
        data = torch.randint(0, vocab, (world, k, 4, 17), generator=torch.Generator().manual_seed(1))
        mine = [(d[:, :-1], d[:, 1:]) for d in data[rank]]
        accumulated, accumulated_calls = one_step(mine, vocab, wrap=True)
        concatenated, concatenated_calls = one_step([(data[rank].flatten(0, 1)[:, :-1],
                                                      data[rank].flatten(0, 1)[:, 1:])], vocab, wrap=True)
        everything = data.flatten(0, 2)  # every rank's micro-batches, one process, no DDP
        reference, _ = one_step([(everything[:, :-1], everything[:, 1:])], vocab, wrap=False)
        # no_sync really skipped the all-reduce of the first k-1 micro-batches
        assert accumulated_calls == concatenated_calls > 0, (accumulated_calls, concatenated_calls)
        torch.manual_seed(0)
        initial = list(Transformer(vocab, 16, 2, 32, 2, 16).parameters())
        assert any(not torch.allclose(a, i) for a, i in zip(accumulated, initial)), "the step moved nothing"
        for a, c, r in zip(accumulated, concatenated, reference):
            assert torch.allclose(a, c, atol=1e-6, rtol=1e-5), (a - c).abs().max()
            assert torch.allclose(a, r, atol=1e-6, rtol=1e-5), (a - r).abs().max()
    finally:
        gc.collect()
        dist.destroy_process_group()


def test_no_sync_accumulation_equals_one_step_on_the_concatenated_batch():
    """2 gloo ranks: K micro-batches (K-1 under no_sync) == one step on their concatenation."""
    ctx = mp.start_processes(accumulation_worker, args=(2, ddp_transformer.free_port(), 3), nprocs=2,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail("the accumulation ranks did not finish in 120 s")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()


# ---------------------------------------------------------------- learning
def entropy_nats(text):
    counts = Counter(text)
    return -sum(n / len(text) * math.log(n / len(text)) for n in counts.values())


def test_default_run_beats_the_unigram_entropy(launch, script, torchrun, metrics, tmp_path):
    out = launch(torchrun2(torchrun, script, "--metrics", "m.json"), timeout=300)
    m = metrics(tmp_path / "m.json")
    entropy = entropy_nats(ddp_transformer.default_corpus())
    assert m["world_size"] == 2 and m["replicas_in_sync"] is True
    assert m["unigram_entropy"] == pytest.approx(entropy, rel=1e-6)
    assert m["val_loss"] < m["first_val_loss"] - 1.0, m
    assert m["val_loss"] < entropy, (m["val_loss"], entropy)
    assert m["tokens_per_s"] > 0 and m["flops_per_s"] == pytest.approx(m["tokens_per_s"] * m["flops_per_token"])
    vocab = len(set(ddp_transformer.default_corpus()))
    assert m["params"] == sum(p.numel() for p in Transformer(vocab, 128, 4, 512, 4, 128).parameters())
    lines = out.stdout.strip().splitlines()
    assert lines[-1].startswith("done:") and out.stdout.count("sample (") == 1


def test_toy_loss_falls(launch, script, torchrun, metrics, tmp_path):
    launch(torchrun2(torchrun, script, "--dataset", "toy", "--epochs", "30", "--metrics", "m.json"), timeout=300)
    m = metrics(tmp_path / "m.json")
    assert m["steps_per_epoch"] == 3 and m["steps"] == 90  # 12 rows / (2 ranks x 2 rows), as in the seed
    assert m["final_loss"] < m["first_loss"] - 0.2, m["losses"]
    assert m["val_loss"] < m["first_val_loss"]


# ---------------------------------------------------------------- checkpoints
def small_corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(ddp_transformer.default_corpus()[:20000], encoding="utf-8")
    return str(path)


def test_checkpoint_round_trip_and_resume(launch, script, torchrun, metrics, tmp_path):
    data = small_corpus(tmp_path)
    common = ["--data", data, *SMALL, "--checkpoint", "ck.pt"]
    launch(torchrun2(torchrun, script, *common, "--epochs", "2", "--metrics", "m1.json"), timeout=300)
    m1 = metrics(tmp_path / "m1.json")
    state = torch.load(tmp_path / "ck.pt", map_location="cpu", weights_only=True)
    assert state["epoch"] == 2 and state["step"] == 2 * m1["steps_per_epoch"] and state["batch_in_epoch"] == 0
    assert not any(k.startswith("module.") for k in state["model"])
    model = Transformer(**state["config"])
    model.load_state_dict(state["model"])  # strict: every weight, nothing else
    # the loaded weights give exactly the validation loss the run reported
    text = open(data, encoding="utf-8").read()
    vocab = "".join(sorted(set(text)))
    assert state["vocab"] == vocab
    args = ddp_transformer.parse_args([*SMALL])
    args = ddp_transformer.check_args(args)
    _, val_set = ddp_transformer.build_data(args, text, vocab, torch.device("cpu"))
    totals = ddp_transformer.evaluate(model, val_set, range(len(val_set)), 64, contextlib.nullcontext())
    assert (totals[0] / totals[1]).item() == pytest.approx(m1["val_loss"], rel=1e-5)

    out = launch(torchrun2(torchrun, script, *common, "--epochs", "3", "--resume", "--metrics", "m2.json"),
                 timeout=300)
    m2 = metrics(tmp_path / "m2.json")
    assert "resuming from ck.pt at epoch 2" in out.stdout
    assert m2["resumed_from_epoch"] == 2 and m2["epochs"] == 3 and m2["steps"] == m1["steps_per_epoch"]
    assert m2["first_loss"] < m1["first_loss"] - 0.3, (m1["losses"], m2["losses"])  # continued, not restarted
    assert torch.load(tmp_path / "ck.pt", weights_only=True)["epoch"] == 3

    # a checkpoint of another model is refused before any process starts
    bad = launch([sys.executable, script(SCRIPT), "--device", "cpu", "--data", data, *SMALL, "--d_model", "64",
                  "--checkpoint", "ck.pt", "--resume"], timeout=120, check=False)
    assert bad.returncode == 2 and len(error_lines(bad.stderr)) == 1 and "d_model" in bad.stderr, bad


# ---------------------------------------------------------------- errors
def test_help_lists_the_flags(launch, script):
    out = launch([sys.executable, script(SCRIPT), "--help"], timeout=120)
    for flag in ("--grad_accum", "--amp", "--data", "--resume", "--eval_every", "--sample", "per process"):
        assert flag in out.stdout, flag


def test_too_short_corpus_is_one_clear_error(launch, script, torchrun, tmp_path):
    (tmp_path / "short.txt").write_text("print('hello')\n" * 3)
    plain = launch([sys.executable, script(SCRIPT), "--device", "cpu", "--data", "short.txt"], timeout=120, check=False)
    assert plain.returncode == 2, plain
    assert plain.stderr.strip().splitlines() == error_lines(plain.stderr) and len(error_lines(plain.stderr)) == 1
    assert "--block_size" in plain.stderr and "Traceback" not in plain.stderr, plain
    ranks = launch(torchrun2(torchrun, script, "--data", "short.txt"), timeout=120, check=False)
    assert ranks.returncode != 0 and len(error_lines(ranks.stderr)) == 1, ranks
