"""Restarts as PyTorch's tutorial launches them: `torchrun --standalone --nproc-per-node=2
--max-restarts=3 script.py`, no variable set.

torchrun (torch 2.5 on) keeps one rendezvous store for all the attempts of a job, and a restarted
worker that joins the group through it reads the dead attempt's keys (pytorch#135712). The harness's
attempt_store gives every attempt a namespace of its own, numbered through the store itself.

Default tier, in this process (no launch): a TCPStore stands in for torchrun's agent store, ranks are
threads, and each builds a real gloo group over the store it got: every rank of an attempt agrees,
a restart whose ranks ask before rank 0 has opened the new attempt (the stale answers of the last
one in the store) still forms its group, and a rank that never comes ends the join within the bound
with one error line, handed to torchrun. One launch: a worker whose rank 0 never comes.
Slow tier (test_faults.py, test_multihost.py): workers SIGKILLed under torchrun and under sbatch.
"""
import json
import os
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from conftest import ROOT, cpu_env, run_bounded

sys.path.insert(0, str(ROOT))
import ddp_gpus_torchrun as harness  # noqa: E402  (importing a script starts nothing)


@pytest.fixture
def agent_store(monkeypatch):
    """A TCPStore served here, as torchrun's agent serves one, and the variables torchrun gives its workers."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    return server


def in_threads(world, first=(), timeout=20):
    """One attempt of a `world`-rank job: each rank a thread that takes attempt_store(...) and all-reduces
    its rank + 1 over a gloo group built on it. Ranks in `first` start, and ask, before the others.
    Returns {rank: the sum it got, or the exception it raised}."""
    results = {}

    def rank_main(rank):
        try:
            store = harness.attempt_store(rank, world, timeout)
            group = dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=timeout))
            total = torch.tensor([rank + 1.0])
            group.allreduce([total]).wait()
            results[rank] = total.item()
        except BaseException as e:  # SystemExit too: the harness ends a failed join so
            results[rank] = e

    threads = {rank: threading.Thread(target=rank_main, args=(rank,)) for rank in range(world)}
    for rank in first:
        threads[rank].start()
    time.sleep(0.5 if first else 0)  # they have asked, and found the last attempt's answers in the store
    for rank, thread in threads.items():
        if rank not in first:
            thread.start()
    for thread in threads.values():
        thread.join(timeout + 10)
    return results


def test_every_attempt_forms_its_group_in_a_store_that_outlives_it(agent_store):
    """Three attempts over one store, as torchrun restarts a job: each forms its group (a dead attempt's
    addresses would make gloo's connect fail or wait). In the second and third the other ranks ask before
    rank 0 has opened the attempt, with the last attempt's numbers and answers in the store; the third is
    smaller, as after a node was lost."""
    expected = {3: 6.0, 2: 3.0}
    for world, first in ((3, ()), (3, (1, 2)), (2, (1,))):
        results = in_threads(world, first)
        assert results == {rank: expected[world] for rank in range(world)}, (world, first, results)
    assert int(agent_store.add("harness/attempts", 0)) == 3  # one number per attempt, opened by its rank 0


def test_a_join_that_cannot_complete_ends_within_the_bound_with_one_line(agent_store, capsys, tmp_path,
                                                                        monkeypatch):
    """Rank 1 never comes: rank 0 names it after --timeout seconds, in one line that torchrun's report shows
    as the root cause (TORCHELASTIC_ERROR_FILE), and ends (exit 1) instead of waiting on."""
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    start = time.monotonic()
    with pytest.raises(SystemExit) as ended:
        harness.attempt_store(0, 2, 1.5)
    took = time.monotonic() - start
    assert ended.value.code == 1 and 1.5 <= took < 5, (ended.value.code, took)
    line = ("error: rank 1 did not join this attempt's process group within --timeout 1.5 s (frozen, or not started "
            "on its node; raise --timeout if starting takes longer)")
    assert capsys.readouterr().err.splitlines() == [line]
    assert json.loads((tmp_path / "error.json").read_text())["message"]["message"] == line


def test_a_worker_whose_rank_0_never_comes_ends_with_one_line(agent_store, tmp_path):
    """A launched worker (rank 1 of 2, torchrun's variables set by hand, no rank 0): one `error:` line
    within --timeout and exit 1, no traceback; the process is gone."""
    env = cpu_env(RANK=1, LOCAL_RANK=1, WORLD_SIZE=2, LOCAL_WORLD_SIZE=2, TORCHELASTIC_RUN_ID="restarts-test",
                  TORCHELASTIC_USE_AGENT_STORE="True", MASTER_ADDR="127.0.0.1", MASTER_PORT=agent_store.port)
    start = time.monotonic()
    r = run_bounded([sys.executable, ROOT / "ddp_gpus_torchrun.py", "--device", "cpu", "--timeout", 2,
                     "--checkpoint", tmp_path / "s.pt"], tmp_path, timeout=60, env=env, check=False)
    took = time.monotonic() - start
    assert r.returncode == 1, r
    lines = r.stderr.strip().splitlines()
    assert lines == ["error: rank 0 did not join this attempt's process group within --timeout 2 s (frozen, or not "
                     "started on its node; raise --timeout if starting takes longer) [rank 1]"], r
    assert took < 45, f"{took:.0f} s"  # 2 s of waiting, and a loaded machine's start-up
    assert not os.path.exists(tmp_path / "s.pt")
