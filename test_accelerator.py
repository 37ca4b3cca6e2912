"""The device choice (issue 17), checked in this process: no launch, no GPU needed.

The harness's resolve_device maps a device type to its backend or, where no job can run, one
error line; told which type the machine's accelerator is, it runs alike for every type, so every
type is checked here on a CPU. What needs the device itself (set_device_index on it, a collective on it, its own bf16
check) is read against torch's source, not run: docs/devices.md's device table says which is which.
Also here: the checks that must see a hand-made launch's filled-in LOCAL_RANK, a MASTER_PORT in
TIME_WAIT against one that something listens on, the replica check on a one-process gloo group,
the signal a spawned process died of, and the checkpoint described from its small entries.
"""
import argparse
import ast
import importlib
import json
import os
import socket
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ddp_comm_hooks
import ddp_gpus
import ddp_gpus_torchrun
import ddp_minimal
import ddp_transformer
import ddp_uneven
from conftest import ROOT


def one_error_line(call, capsys, code=2):
    with pytest.raises(SystemExit) as exited:
        call()
    lines = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == code and len(lines) == 1 and lines[0].startswith("error:"), lines
    assert "(" in lines[0], f"the error names the fix: {lines[0]}"
    return lines[0]


@pytest.fixture
def registered_backend(monkeypatch):
    """Register a backend for a device type the way a plugin does (habana_frameworks registers
    `hccl` for `hpu`, torch_npu for `npu`) with torch's own Backend.register_backend, on copies of
    torch's tables that are put back afterwards."""
    for table in ("default_device_backend_map", "backend_capability", "backend_type_map", "_plugins"):
        monkeypatch.setattr(dist.Backend, table, dict(getattr(dist.Backend, table)))
    monkeypatch.setattr(dist.Backend, "backend_list", list(dist.Backend.backend_list))

    def register(name, device):
        monkeypatch.setattr(dist.Backend, name.upper(), name, raising=False)
        dist.Backend.register_backend(name, lambda *args: None, devices=[device])
    return register


# ---------------------------------------------------------------- the mapping, for each type
def plan(kind, backend="auto"):
    """resolve_device on a machine whose accelerator is `kind`: the backend it chose."""
    return ddp_gpus.resolve_device(argparse.Namespace(device=kind, backend=backend), here=kind).backend


@pytest.mark.parametrize("kind,backend", [("cpu", "gloo"), ("cuda", "nccl"), ("xpu", "xccl")])
def test_each_type_gets_torchs_default_backend(kind, backend):
    assert plan(kind) == backend
    assert backend == dist.get_default_backend_for_device(kind)  # torch's table, not ours


def test_amp_auto_is_off_on_cpu():
    """--amp auto on accelerators (bf16 where native, else fp16) needs the device: read, not run."""
    assert ddp_transformer.resolve_amp("auto", torch.device("cpu")) == "off"


def test_hpu_takes_the_backend_its_plugin_registers(registered_backend, capsys):
    """Without habana_frameworks torch knows no backend for hpu: one line that says so. Once the
    plugin has registered hccl for hpu (as it does on import), hpu's default is hccl, and gloo,
    which takes only cpu and cuda tensors, does not fit it."""
    # torch's own test helpers register a "fake" backend for hpu when something imports them
    # (torch.testing._internal.distributed.fake_pg): start from the tables of a plain torch
    dist.Backend.default_device_backend_map.pop("hpu", None)
    capability = dist.Backend.backend_capability  # the fixture's copy: new lists, torch's stay whole
    for name in list(capability):
        capability[name] = [d for d in capability[name] if d != "hpu"]
    assert "no multi-process backend for hpu" in one_error_line(lambda: plan("hpu"), capsys)
    registered_backend("hccl", "hpu")
    assert plan("hpu") == "hccl"
    line = one_error_line(lambda: plan("hpu", backend="gloo"), capsys)
    assert "--backend gloo does not carry hpu tensors" in line and "(use --backend auto: hccl on hpu)" in line


def test_npu_needs_its_plugin_to_be_named_at_all(capsys):
    """`npu` is torch's privateuse1 device, renamed by torch_npu, which also registers hccl for it
    (Ascend/pytorch torch_npu/__init__.py: register_backend("hccl", ..., devices=["npu"])). Without
    it this torch cannot even parse the type: one line, not a traceback."""
    with pytest.raises(RuntimeError):
        torch.device("npu")
    assert one_error_line(lambda: plan("npu"), capsys) == \
        "error: torch has no multi-process backend for npu (use --device cpu, or install the package that adds npu to torch)"


def test_mps_is_one_line_pointing_to_the_cpu(capsys):
    """torch maps mps to gloo (Backend.default_device_backend_map; torch 2.7 maps nothing to it), but
    gloo's capability is cpu and cuda: no backend carries MPS tensors, and the line says so instead of
    crashing at step 1, naming gloo where torch names it."""
    mapped = dist.Backend.default_device_backend_map.get("mps")
    assert mapped in ("gloo", None), mapped
    line = one_error_line(lambda: plan("mps"), capsys)
    assert line.startswith("error: torch has no multi-process backend for mps") and ("gloo" in line) == bool(mapped)
    assert line.endswith("(use --device cpu)")


def test_mps_in_the_minimal_example_is_one_line(monkeypatch, capsys):
    """ddp_minimal.py has no harness: its own check, before any process starts."""
    monkeypatch.setattr(sys, "argv", ["ddp_minimal.py", "--device", "mps"])
    line = one_error_line(ddp_minimal.main, capsys)
    assert line == "error: MPS has no multi-process backend (use --device cpu)"


def test_no_accelerator_means_the_cpu_and_gloo():
    """--device auto: torch.accelerator.current_accelerator(check_available=True), else the CPU.
    This machine's torch is a CUDA build with no GPU: the compile-time accelerator is cuda, the
    available one none, so auto must be the CPU (without check_available it would be cuda)."""
    found = torch.accelerator.current_accelerator(check_available=True)
    if found is not None and found.type == "mps":
        pytest.skip("auto is mps here, which is one error line (test_mps_is_one_line_pointing_to_the_cpu)")
    args = ddp_gpus.resolve_device(ddp_gpus.parse_args([]))
    assert (args.device, args.backend) == ((found.type, dist.get_default_backend_for_device(found))
                                           if found else ("cpu", "gloo"))


@pytest.mark.parametrize("argv,says", [(["--backend", "nccl"], "--backend nccl does not carry cpu tensors"),
                                       (["--backend", "mpi2"], "unknown backend 'mpi2'")])
def test_a_backend_that_does_not_fit_is_one_line(argv, says, capsys):
    line = one_error_line(lambda: ddp_gpus.check_args(ddp_gpus.parse_args(["--device", "cpu", *argv])), capsys)
    assert says in line and "--backend auto" in line, line


@pytest.mark.skipif(torch.accelerator.current_accelerator(check_available=True) is not None,
                    reason="an accelerator is visible here")
@pytest.mark.parametrize("kind", ["cuda", "xpu", "mps"])
def test_a_device_the_machine_lacks_is_one_line(kind, capsys):
    line = one_error_line(lambda: ddp_gpus.check_args(ddp_gpus.parse_args(["--device", kind])), capsys)
    assert f"--device {kind} but no GPU or other accelerator is visible" in line and "--device cpu" in line


def test_bf16_check_asks_the_device_module_without_emulation(capsys):
    """The CPU: its bf16 instructions; CUDA: torch.cuda.is_bf16_supported(including_emulation=False),
    False without a GPU (torch/cuda/__init__.py returns False when CUDA is not available)."""
    if hasattr(torch.cpu, "get_capabilities"):
        caps = torch.cpu.get_capabilities()
        assert ddp_transformer.bf16_supported(torch.device("cpu")) == bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))
    else:  # torch 2.7 cannot ask the CPU: taken as not native, and the user is told so
        assert ddp_transformer.bf16_supported(torch.device("cpu")) is False
        note = capsys.readouterr().out
        assert note.startswith("note: torch") and "cannot tell whether this CPU computes bfloat16" in note, note
    assert ddp_transformer.bf16_supported(torch.device("cpu"), emulated=True)
    assert capsys.readouterr().out == "", "no note where the answer does not depend on the CPU"
    if not torch.cuda.is_available():
        assert ddp_transformer.bf16_supported(torch.device("cuda")) is False


def test_the_bf16_hook_is_no_longer_judged_before_set_device():
    """ddp_comm_hooks.py asked torch.cuda.is_bf16_supported() in check_args, before set_device (a
    context on GPU 0 in every rank, and emulated bf16 counted). Now check_args only asks NCCL's
    version; each rank asks its own device after set_device (bf16_where_native)."""
    if dist.is_nccl_available() and not torch.cuda.is_available() and torch.cuda.nccl.version() >= (2, 10):
        # before: is_bf16_supported() is False without a GPU, so bf16 was struck off here already
        assert "bf16" not in ddp_comm_hooks.unavailable_hooks(argparse.Namespace(backend="nccl"))
    assert ddp_comm_hooks.bf16_where_native(["allreduce", "bf16"], torch.device("cpu")) == ["allreduce", "bf16"]


# ---------------------------------------------------------------- 3.1: LOCAL_RANK, filled in
@pytest.fixture
def hand_launch(monkeypatch):
    """The environment of a hand-made launch's process: RANK and WORLD_SIZE, no LOCAL_RANK."""
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                 "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "1000")  # beyond any machine's device count
    monkeypatch.setenv("WORLD_SIZE", "1001")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    return monkeypatch


def test_missing_local_rank_filled_from_rank_is_checked(hand_launch, capsys):
    """prepare_rendezvous fills LOCAL_RANK = RANK; the device check runs after that, so the rank
    that cannot be on this machine says to set LOCAL_RANK, instead of a raw invalid-ordinal traceback."""
    args = argparse.Namespace(device="cuda", backend="nccl", local_rank=None)
    line = one_error_line(lambda: ddp_gpus.prepare_rendezvous(args), capsys)
    assert "LOCAL_RANK is not set, and RANK 1000 is beyond this machine's" in line, line
    assert "set LOCAL_RANK for each process" in line and line.endswith("[rank 1000]"), line


def test_local_rank_from_launch_flag_is_checked(hand_launch, capsys):
    """`python -m torch.distributed.launch` passes --local-rank: filled in, then checked."""
    args = argparse.Namespace(device="cuda", backend="nccl", local_rank=1000)
    line = one_error_line(lambda: ddp_gpus.prepare_rendezvous(args), capsys)
    assert line.startswith("error: LOCAL_RANK 1000 but only") and "cuda device(s) are visible" in line, line


def test_local_rank_check_itself(monkeypatch, capsys):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "1")
    ddp_gpus.check_local_rank("cuda", True, count=2)  # device 1 of 2: fine
    ddp_gpus.check_local_rank("cpu", False, count=0)  # the CPU has no device to pick
    line = one_error_line(lambda: ddp_gpus.check_local_rank("xpu", True, count=1), capsys)
    assert "LOCAL_RANK 1 but only 1 xpu device(s) are visible" in line


def test_the_scripts_no_longer_check_local_rank_before_it_is_filled_in():
    for name in ("ddp_gpus_torchrun.py", "ddp_main_torchrun.py", "ddp_transformer.py", "ddp_uneven.py",
                 "ddp_comm_hooks.py"):
        lesson = (ROOT / name).read_text().split("# ---- harness:")[0]
        assert "LOCAL_RANK {" not in lesson, name
        # counting devices is fine (ddp_main* count the GPUs --gpu chose); comparing the count with a local rank
        # that may not be filled in yet is the defect
        compared = [line for line in lesson.splitlines() if "device_count" in line and "local_rank" in line.lower()]
        assert not compared, name


# ---------------------------------------------------------------- 4.1: a port in TIME_WAIT
def port_a_finished_run_left():
    """The port of a rendezvous that just ended: a TCPStore served a client there and closed
    first, so the port's end of that connection sits in TIME_WAIT (about a minute)."""
    store = dist.TCPStore("127.0.0.1", 0, world_size=2, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=10))
    port = store.port
    client = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=False, timeout=timedelta(seconds=10))
    client.set("epoch", "1")
    assert store.get("epoch") == b"1"
    del store  # the run's rank 0 ends first: its side of the connection closes first
    time.sleep(0.2)
    del client
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        with socket.socket() as plain:
            try:
                plain.bind(("127.0.0.1", port))
            except OSError:
                return port  # a plain bind (the old check) fails: the state users meet after a run
        time.sleep(0.05)
    pytest.skip("no TIME_WAIT left on the port here: nothing to test against")


def test_a_port_in_time_wait_is_accepted_and_the_store_binds_it():
    port = port_a_finished_run_left()
    ddp_gpus.check_port_free("127.0.0.1", port)  # no error: it binds with SO_REUSEADDR, as the TCPStore does
    store = dist.TCPStore("127.0.0.1", port, world_size=1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=10))  # and the next run's rendezvous does start there
    store.set("rendezvous", "works")
    assert store.get("rendezvous") == b"works"
    del store


def test_a_port_something_listens_on_is_refused(capsys):
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # even a listener that allows reuse
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = one_error_line(lambda: ddp_gpus.check_port_free("127.0.0.1", port), capsys)
    assert f"MASTER_PORT {port} is already in use" in line


# ---------------------------------------------------------------- 4.2: node-local facts
@pytest.mark.parametrize("local_rank,speaks", [("0", True), ("1", False)])
def test_a_missing_file_is_said_by_the_first_process_of_its_machine(local_rank, speaks, monkeypatch, capsys,
                                                                     tmp_path):
    """Rank 2 of a job is LOCAL_RANK 0 on the second machine: if that machine lacks the folder or the
    checkpoint, it says so itself (rank 0 cannot see it); its other processes stay silent."""
    for name in ("TORCHELASTIC_RUN_ID", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    checks = [lambda: ddp_gpus.check_folders(str(tmp_path / "missing" / "m.json")),
              lambda: ddp_gpus_torchrun.load_checkpoint(str(tmp_path / "nothing.pt"), ("model",)),
              lambda: ddp_uneven.check_args(ddp_uneven.parse_args(["--device", "cpu", "--resume", "--checkpoint",
                                                                   str(tmp_path / "nothing.pt")]))]
    for check in checks:
        with pytest.raises(SystemExit) as exited:
            check()
        lines = capsys.readouterr().err.strip().splitlines()
        assert exited.value.code == 2
        if speaks:
            assert len(lines) == 1 and lines[0].startswith("error:") and lines[0].endswith("[rank 2]"), lines
        else:
            assert lines == [], lines


# ---------------------------------------------------------------- 4.3: the replica check, exact
@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_replica_check_on_a_one_process_group(world_of_one, capsys):
    """A world of one: rank 0's parameters, broadcast, equal its own; nothing is changed on the way
    and the fingerprint printed is rank 0's weighted sum. (Two ranks whose weights differ where a sum
    cannot see it: test_scripts.py's gloo pair, which a default test already launches.)"""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    before = [p.detach().clone() for p in model.parameters()]
    assert ddp_gpus.replicas_in_sync(model, torch.device("cpu")) is True
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    flat = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    fingerprint = (flat * torch.sin(torch.arange(flat.numel(), dtype=torch.float64))).sum().item()
    out = capsys.readouterr().out  # computed a parameter at a time (issue 33): the same sum, to rounding
    assert out.startswith("replicas: in sync (1 rank, fingerprint ") and out.endswith(")\n"), out
    assert float(out.rsplit(" ", 1)[1][:-2]) == pytest.approx(fingerprint, rel=1e-12, abs=1e-12), (out, fingerprint)
    ddp_gpus_torchrun.check_same_on_every_rank(3, "epochs", "")  # gloo: gathered on the CPU


def test_a_checkpoint_folder_is_described_by_its_pointer(tmp_path):
    """Issue 33: Ctrl-C and a frozen rank name a sharded checkpoint (a folder whose latest.json names
    the save that counts) as they name a file; a folder without a pointer has none kept."""
    import fsdp_transformer
    describe = fsdp_transformer.describe_checkpoint_folder
    assert describe(str(tmp_path)) == "no checkpoint kept"
    (tmp_path / "latest.json").write_text(json.dumps({"folder": "step-00000020", "step": 20, "epoch": 0}))
    assert describe(str(tmp_path)) == f"checkpoint at step 20 kept in {tmp_path / 'step-00000020'}"
    (tmp_path / "latest.json").write_text("{not json")
    assert describe(str(tmp_path)) == "no checkpoint kept"


# ---------------------------------------------------------------- 4.4, 4.5
@pytest.mark.parametrize("exited,says,code", [
    (mp.ProcessExitedException("process 1 terminated with signal SIGABRT", error_index=1, error_pid=4242,
                               exit_code=-6, signal_name="SIGABRT"), "was ended by SIGABRT (exit code -6)", 1),
    (mp.ProcessExitedException("process 1 terminated with exit code 3", error_index=1, error_pid=4242,
                               exit_code=3), "exited with code 3", 3)])
def test_a_spawned_process_killed_by_a_signal_is_named(exited, says, code, monkeypatch, capsys):
    """torch's ProcessExitedException carries the signal's name (torch/multiprocessing/spawn.py): what
    join_processes says of it, given the exception mp.spawn's context raises."""
    class Context:
        def join(self, grace_period=None):
            raise exited
    with pytest.raises(SystemExit) as ended:
        ddp_gpus.join_processes(Context())
    assert ended.value.code == code and capsys.readouterr().err.strip() == f"error: process 1 {says}"


def _abort(rank, args):
    os.abort()


@pytest.mark.slow
def test_spawn_names_the_signal_of_a_real_abort(capsys):
    """A real child that aborts (as NCCL's watchdog makes a process do): one line naming SIGABRT."""
    with pytest.raises(SystemExit) as exited:
        ddp_gpus.join_processes(mp.spawn(_abort, args=(None,), nprocs=1, join=False))
    assert exited.value.code == 1
    assert capsys.readouterr().err.strip() == "error: process 0 was ended by SIGABRT (exit code -6)"


def test_the_meta_shape_check_leaves_the_weights_to_be_copied():
    """check_and_load_weights on a model on the meta device (ddp_transformer's read_checkpoint) must not leave
    load_state_dict's assign=True in the checkpoint's dict (its _metadata): the real model's load would
    then take the checkpoint's tensors as its parameters, and the optimizer would step tensors the model
    no longer holds (a resumed run that trains nothing, caught by the slow elastic tests)."""
    state = {"model": torch.nn.Linear(3, 2).state_dict()}
    with torch.device("meta"):
        ddp_transformer.check_and_load_weights("ck.pt", state, torch.nn.Linear(3, 2))
    real = torch.nn.Linear(3, 2)
    params = list(real.parameters())
    real.load_state_dict(state["model"])
    assert all(p is q for p, q in zip(params, real.parameters()))
    assert torch.equal(real.weight, state["model"]["weight"]) and real.weight.data_ptr() != state["model"]["weight"].data_ptr()


def test_checkpoint_is_described_from_its_small_entries(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"model": torch.nn.Linear(64, 64).state_dict(), "epoch": 3}, path)
    assert ddp_gpus_torchrun.describe_checkpoint(str(path)) == f"checkpoint at epoch 3 kept in {path}"
    path.write_bytes(path.read_bytes()[:100])  # cut short by the interrupt
    assert ddp_gpus_torchrun.describe_checkpoint(str(path)) == "no checkpoint kept"
    assert ddp_gpus_torchrun.describe_checkpoint(None) == "no checkpoint kept"


# ---------------------------------------------------------------- torch's API, as far back as requirements.txt claims
def torch_names(source):
    """(module, attribute path) for every attribute a script reads from torch (`torch.a.b`, `dist.x` through its
    import alias), and ("torch.cuda", (name,)) for every call made on `torch.get_device_module(...)`, which is
    torch.cuda on CUDA. Names the file guards with hasattr or getattr (a newer torch's only) are left out."""
    tree = ast.parse(source)
    guarded = {n.args[1].value for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
               and n.func.id in ("hasattr", "getattr") and len(n.args) > 1 and isinstance(n.args[1], ast.Constant)}
    aliases = {a.asname or "torch": a.name if a.asname else "torch" for n in ast.walk(tree) if isinstance(n, ast.Import)
               for a in n.names if a.name.split(".")[0] == "torch"}
    found = set()
    for node in ast.walk(tree):
        path, at = [], node
        while isinstance(at, ast.Attribute):
            path.insert(0, at.attr)
            at = at.value
        if isinstance(at, ast.Name) and at.id in aliases and path:
            found.add((aliases[at.id], tuple(path)))
        if isinstance(at, ast.Call) and ast.unparse(at.func) == "torch.get_device_module" and path:
            found.add(("torch.cuda", tuple(path[:1])))
    return {(module, tuple(path[:next((i for i, p in enumerate(path) if p in guarded), len(path))]))
            for module, path in found}


def test_every_torch_name_the_scripts_use_exists_in_this_torch():
    """The version tier runs this on the floor (requirements.txt's torch>=): on a GPU the Transformers'
    and ddp_uneven's memory accounting once called torch.accelerator.max_memory_allocated, which torch
    has only from 2.9, and stopped every GPU run on 2.7 and 2.8 before training. The CPU tier never
    reached that line; this reads every name, reached or not."""
    missing = []
    for script in sorted(p for p in ROOT.glob("*.py") if not p.name.startswith(("test_", "conftest"))):
        for module, path in sorted(torch_names(script.read_text())):
            obj = importlib.import_module(module)
            for i, name in enumerate(path):
                try:
                    obj = getattr(obj, name) if hasattr(obj, name) else importlib.import_module(f"{obj.__name__}.{name}")
                except (ImportError, AttributeError):
                    missing.append(f"{script.name}: {module}.{'.'.join(path[:i + 1])}")
                    break
    assert not missing, f"torch {torch.__version__} lacks: {missing}"
    old = torch_names("import torch\ntorch.accelerator.max_memory_allocated(d)\ntorch.get_device_module(d).x(d)\n"
                      "if hasattr(torch.cpu, 'get_capabilities'):\n    torch.cpu.get_capabilities()\n")
    assert {("torch", ("accelerator", "max_memory_allocated")), ("torch.cuda", ("x",))} <= old
    assert ("torch", ("cpu", "get_capabilities")) not in old and ("torch", ("cpu",)) in old
