"""ddp_unused.py, and the collection's own DDP pitfalls (issue 25).

Each mode is launched as a user launches it (torchrun, 2 processes, CPU, gloo) and judged by
what it printed and wrote. The expected byte counts come from the model's shapes, not from
the script. The default tier launches once (--mode static-graph, which trains the reference,
find-unused and static-graph side by side); every other mode is in the slow tier. The run.sh
check reads the session's one `bash run.sh` (conftest.py's run_sh): no launch of its own.
"""
import re
import subprocess
import sys
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.elastic.utils.distributed import get_free_port
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_main
import ddp_main_torchrun
import ddp_transformer
import ddp_unused
from conftest import ROOT, cpu_env, kill_group, read_metrics, run_bounded, torchrun_cmd

MODEL = ddp_unused.MultiTask(ddp_unused.parse_args(["--device", "cpu"]).width)


def nbytes(module):
    return 4 * sum(p.numel() for p in module.parameters())


ALL_BYTES = nbytes(MODEL)
UNUSED_PER_RANK = nbytes(MODEL.heads["a"]) + nbytes(MODEL.spare)  # the other task's head, and the spare layer
TORCH = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
OUR_SCRIPTS = sorted(p.name for p in ROOT.glob("*.py"))


def launch(work, mode, *extra, check=True, timeout=240):
    result = run_bounded(torchrun_cmd() + ["--standalone", "--nproc-per-node=2", ROOT / "ddp_unused.py",
                                           "--device", "cpu", "--mode", mode, "--metrics", "m.json", *extra],
                         work, timeout=timeout, check=check)
    result.metrics = read_metrics(work / "m.json") if (work / "m.json").exists() else None
    return result


def assert_trained(r):
    m = r.metrics
    assert m["replicas_in_sync"] is True and m["world_size"] == 2 and m["backend"] == "gloo", r
    assert m["steps"] == m["epochs"] * m["steps_per_epoch"] == 32, r
    assert re.search(r"^replicas: in sync \(2 ranks", r.stdout, re.MULTILINE), r
    assert r.stdout.strip().splitlines()[-1].startswith(f"done: ddp_unused.py --mode {m['mode']}"), r
    assert "Traceback" not in r.stderr, r


@pytest.fixture(scope="module")
def static_graph(tmp_path_factory):
    """The default tier's one launch: the reference, find-unused and static-graph, side by side."""
    return launch(tmp_path_factory.mktemp("static_graph"), "static-graph")


def test_static_graph_and_find_unused_train_to_the_same_weights(static_graph):
    r, copies = static_graph, static_graph.metrics["copies"]
    assert_trained(r)
    assert list(copies) == ["all-used", "find-unused", "static-graph"]
    # the same sums of the same gradients in the same bucket: with 2 ranks a + b does not depend on the
    # order of the addition, so bit for bit; more ranks may sum in another order (a few ulp, not asserted)
    assert r.metrics["checks"]["max_difference_static_vs_find_unused"] == 0.0, r
    assert copies["find-unused"]["losses"] == copies["static-graph"]["losses"]
    for name in ("find-unused", "static-graph"):
        t = copies[name]
        assert t["spare_unchanged"] is True and t["final_loss"] < t["first_loss"], (name, t)
        # every trainable parameter is all-reduced, the unused ones as zeros: the bytes do not shrink
        assert t["bytes_per_step"] == ALL_BYTES and t["buckets_per_step"] == 1, (name, t)
        size = t["logging_data"]["unused_parameter_size"]
        # torch 2.14 reports the bytes; torch 2.7 reported ten times as many after 32 steps (summed over samples)
        assert size == UNUSED_PER_RANK or (TORCH < (2, 14) and size % UNUSED_PER_RANK == 0), (name, t)
        assert t["step_time_s"] > 0
    assert copies["static-graph"]["logging_data"]["static_graph"] == 1
    assert copies["find-unused"]["logging_data"]["find_unused_parameters"] == 1
    # can_set_static_graph is written when the graph turns out dynamic, or when the DDP model dies
    assert all(t["logging_data"]["can_set_static_graph"] is None for t in copies.values())
    # the reference uses the spare layer: weight decay and its gradient move it
    assert copies["all-used"]["spare_unchanged"] is False
    assert copies["all-used"]["logging_data"]["unused_parameter_size"] == (0 if TORCH >= (2, 14) else None)
    row = re.search(r"^static-graph +([\d,]+) +([\d.]+) ms +([\d.]+)x", r.stdout, re.MULTILINE)
    assert row and int(row.group(1).replace(",", "")) == ALL_BYTES, r
    print(f"median step: " + ", ".join(f"{n} {t['step_time_s'] * 1e3:.2f} ms" for n, t in copies.items()))


@pytest.mark.slow
def test_bare_names_every_ranks_unused_parameters_in_one_line(tmp_path):
    start = time.monotonic()
    r = launch(tmp_path, "bare", check=False, timeout=120)
    elapsed = time.monotonic() - start
    assert r.returncode == 1, r
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r
    line = errors[0]
    assert "Expected to have finished reduction in the prior iteration" in line, r
    for rank, other in ((0, "b"), (1, "a")):
        said = re.search(rf"rank {rank}: ([^;(]+)", line).group(1)
        assert set(said.strip().split(", ")) == {"spare.weight", "spare.bias", f"heads.{other}.weight",
                                                 f"heads.{other}.bias"}, line
    assert "find_unused_parameters=True" in line and "static_graph=True" in line, line
    assert not re.search(r"^\[rank\d\]:.*Traceback", r.stderr, re.MULTILINE), r
    assert r.metrics["reproductions"]["plain DDP"]["error"].startswith("Expected to have finished reduction"), r
    assert r.stdout == "", r  # the error line is the only thing said
    assert elapsed < 90, elapsed  # under load; about 10 s on a quiet machine (most of it importing torch)


@pytest.mark.slow
def test_find_unused_on_a_model_that_did_not_need_it(tmp_path):
    r = launch(tmp_path, "find-unused")
    assert_trained(r)
    copies = r.metrics["copies"]
    assert copies["all-used+flag"]["logging_data"] == {**copies["all-used+flag"]["logging_data"],
                                                      "find_unused_parameters": 1, "unused_parameter_size": 0}
    assert copies["all-used+flag"]["losses"] == copies["all-used"]["losses"]  # the flag changes nothing but time
    assert "did not find any unused parameters" in r.stderr, r  # DDP's own warning, from its C++ reducer
    assert copies["find-unused"]["spare_unchanged"] is True


@pytest.mark.slow
def test_freeze_before_wrapping_sends_only_trainable_bytes(tmp_path):
    r = launch(tmp_path, "freeze")
    assert_trained(r)
    frozen, plain = r.metrics["copies"]["frozen"], r.metrics["copies"]["find-unused"]
    block = nbytes(MODEL.block)
    assert frozen["bytes_per_step"] == frozen["trainable_bytes"] == ALL_BYTES - block, frozen
    assert plain["bytes_per_step"] == ALL_BYTES
    assert frozen["block_unchanged"] is True and plain["block_unchanged"] is False
    assert r.metrics["checks"]["bytes_saved_per_step"] == block
    after = r.metrics["reproductions"]["frozen after wrapping"]
    assert after["error"].startswith("Expected to have finished reduction"), r
    assert after["per_rank"] == ["block.0.bias, block.0.weight"] * 2, r
    one = r.metrics["reproductions"]["frozen on rank 1 only"]
    assert one["error"].startswith("DDP expects same model across all ranks"), r
    assert len(re.findall(r"^frozen .*: reproduced ", r.stdout, re.MULTILINE)) == 2, r


@pytest.mark.slow
def test_reentrant_checkpoint_fails_and_the_fixes_train_alike(tmp_path):
    r = launch(tmp_path, "checkpoint")
    assert_trained(r)
    found = r.metrics["reproductions"]["reentrant + find_unused"]
    assert found["error"].startswith("Expected to mark a variable ready only once"), r
    assert all("marked ready twice" in said for said in found["per_rank"]), found
    assert r.metrics["checks"]["max_difference_checkpointed_vs_plain"] == 0.0  # recomputed, not changed
    assert all(t["spare_unchanged"] for t in r.metrics["copies"].values())


@pytest.mark.slow
def test_two_forwards_through_batchnorm(tmp_path):
    r = launch(tmp_path, "two-forwards")
    m = r.metrics
    assert m["replicas_in_sync"] is True and m["buffers_agree"] is True, r
    assert m["buffers_differed_before_broadcast"] is True, r  # each rank's statistics follow its own batches
    option = "forward_sync_buffers" if "forward_sync_buffers" in DDP.__init__.__code__.co_varnames else \
        "broadcast_buffers"
    assert m["sync_option"] == {option: False}, r
    if option == "forward_sync_buffers":  # torch 2.14: fixed by pytorch#175851
        assert m["default_sync_error"] is None and "default buffer sync: no error" in r.stdout, r
    else:  # torch 2.7
        assert "modified by an inplace operation" in m["default_sync_error"], r


# ---------------------------------------------------------------- the collection's own pitfalls
def test_run_sh_prints_no_warning_from_our_files(run_sh):
    """A warning raised from one of our scripts (say, a deprecated DDP flag): torch attributes it to the
    caller's file and line. torch's own warnings (the deprecated launcher's) name torch's files."""
    pattern = re.compile(rf"({'|'.join(re.escape(n) for n in OUR_SCRIPTS)}):\d+: \w*Warning")
    found = [line for line in (run_sh.stdout + run_sh.stderr).splitlines() if pattern.search(line)]
    assert not found, "\n".join(found[:10])
    assert "broadcast_buffers` is deprecated" not in run_sh.stderr


@pytest.mark.parametrize("module", [ddp_main, ddp_main_torchrun, ddp_unused])
def test_no_buffer_broadcast_warns_nothing_and_keeps_buffers_local(module, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(get_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # any warning fails the test
            model = DDP(torch.nn.BatchNorm1d(3), **module.no_buffer_broadcast())
        assert model.require_forward_param_sync and not getattr(model, "forward_sync_buffers",
                                                                 getattr(model, "broadcast_buffers", None))
        del model
    finally:
        dist.destroy_process_group()


def masks_and_weights(rank, world, port, queue):
    """One rank: the Transformer built as ddp_transformer.py builds it (seeded, DDP), one step of
    dropout under the script's step seed; reports the dropout mask and the weights after a step."""
    import os
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = ddp_transformer.Transformer(vocab_size=11, d_model=16, num_heads=2, num_layers=1, d_ff=32,
                                        max_len=8, dropout=0.5)
    ddp = DDP(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    torch.manual_seed(ddp_transformer.step_seed(0, rank, 0))
    mask = torch.nn.functional.dropout(torch.ones(64), 0.5) > 0
    x = torch.arange(8).remainder(11).unsqueeze(0)  # the same data on every rank: only the masks differ
    torch.manual_seed(ddp_transformer.step_seed(0, rank, 0))
    ddp(x).float().mean().backward()
    optimizer.step()
    queue.put((rank, mask.tolist(), [p.detach().tolist() for p in model.parameters()]))  # plain data: no shared memory
    del ddp
    dist.destroy_process_group()


@pytest.mark.slow
def test_transformer_dropout_masks_differ_across_ranks_and_replicas_agree():
    assert ddp_transformer.step_seed(0, 0, 5) != ddp_transformer.step_seed(0, 1, 5)
    assert ddp_transformer.step_seed(0, 1, 5) == ddp_transformer.step_seed(0, 1, 5)  # resume: the same draws
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), get_free_port()
    procs = [ctx.Process(target=masks_and_weights, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict((rank, (mask, weights)) for rank, mask, weights in (queue.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(30)
    assert got[0][0] != got[1][0], "every rank drew the same dropout mask"
    assert got[0][1] == got[1][1], "the replicas differ after a step"


@pytest.mark.slow
def test_main_torchrun_ranks_that_disagree_on_resuming_end_with_one_line(tmp_path):
    """After a torchrun restart each rank resumes if it finds the checkpoint. With node-local paths only
    some find it: before the fix only those reached the epoch check's all_gather, and the others' next
    collective (DDP's construction) was paired with it. Now every rank compares: one line, exit 2."""
    small = ["--device", "cpu", "--train_samples", "300", "--test_samples", "100"]
    run_bounded([sys.executable, ROOT / "ddp_main_torchrun.py", "-e", "1", "--checkpoint", "a.pt", *small],
                tmp_path, timeout=180)
    port = get_free_port()
    procs = []
    for rank, path in ((0, "a.pt"), (1, "missing.pt")):  # rank 1's "node" has no checkpoint
        env = cpu_env(RANK=rank, LOCAL_RANK=0, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                      TORCHELASTIC_RUN_ID="none", TORCHELASTIC_RESTART_COUNT=1)
        procs.append(subprocess.Popen([sys.executable, ROOT / "ddp_main_torchrun.py", "-e", "2",
                                       "--checkpoint", path, *small], cwd=tmp_path, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True))
    try:
        outputs = [p.communicate(timeout=150) for p in procs]
    finally:
        for p in procs:
            kill_group(p)
    codes = [p.returncode for p in procs]
    stderr = outputs[0][1] + outputs[1][1]
    assert codes == [2, 2], (codes, stderr[-3000:])
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert errors == [errors[0]] and "checkpoint epochs (0: none found) differ: [1, 0]" in errors[0], stderr[-3000:]
