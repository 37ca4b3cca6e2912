"""Multi-host DDP for real, on one machine: two network namespaces as hosts, and a one-node SLURM.

Two "hosts" are two Linux network namespaces joined by a veth pair (10.77.0.1 and
10.77.0.2 on an interface called ddp0 in each, with hostnames ddp-host0/ddp-host1 from
a UTS namespace and an /etc/hosts of their own). Nothing else lives in them: no
loopback shortcut, no route out, so the training traffic can only cross the veth, and
the veth's byte counters prove that it did. One torchrun agent runs in each host, with
GLOO_SOCKET_IFNAME=ddp0 so gloo binds the veth.

The SLURM test starts a private one-node cluster (its own munged, slurmctld and slurmd,
configuration, ports and state in a temporary directory), submits slurm/train.sbatch with
sbatch and checks the job's output. Every daemon it starts is stopped at the end.

Both need root; they skip with the reason when it, iproute2 or slurm-wlm/munge is
missing (.ci/setup_multihost.sh installs them). Every subprocess is bounded.
"""
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from conftest import ROOT, cpu_env, kill_group, torchrun_cmd

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="network namespaces and SLURM need Linux")

IFACE = "ddp0"
ADDRS = ("10.77.0.1", "10.77.0.2")  # only ever configured inside our own namespaces
HOSTNAMES = ("ddp-host0", "ddp-host1")
NS_PREFIX = "ddpmh"
SLURM_BINARIES = ("munged", "munge", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "scancel")


def sh(cmd, timeout=30, check=True, env=None, cwd=None):
    """A short helper command, bounded; returns the CompletedProcess."""
    try:
        proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
                              env=env, cwd=cwd, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{' '.join(map(str, cmd))}: timed out after {timeout} s") from e
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))}: exit {proc.returncode}: {proc.stderr.strip()}")
    return proc


def tail(path, n=4000):
    try:
        return Path(path).read_text(errors="replace")[-n:]
    except OSError as e:
        return f"<{e}>"


def die_with_parent():
    """preexec_fn: the kernel kills this child if pytest dies, even by SIGKILL (no finalizer runs then)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def tagged_pids(marker):
    """Live processes whose environment holds DDP_MULTIHOST_TAG=marker (inherited by all they start)."""
    needle = f"DDP_MULTIHOST_TAG={marker}\0".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
            with open(f"/proc/{entry}/stat", "rb") as f:
                zombie = f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
        except OSError:
            continue
        if needle in environ and not zombie:
            found.append(int(entry))
    return found


def kill_pids(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def reap(marker=None, namespaces=()):
    """Kill every process tagged with `marker` and every process in `namespaces`; delete those."""
    for _ in range(5):
        pids = tagged_pids(marker) if marker else []
        for ns in namespaces:
            pids += [int(p) for p in sh(["ip", "netns", "pids", ns], check=False).stdout.split()]
        if not pids:
            break
        kill_pids(pids)
        time.sleep(0.3)
    for ns in namespaces:
        sh(["ip", "netns", "del", ns], check=False)
        shutil.rmtree(Path("/etc/netns", ns), ignore_errors=True)


class Watchdog:
    """A separate process that reaps when its stdin closes: at the end of the test, or when pytest dies.

    Finalizers do not run when pytest is killed; the kernel closes the pipe all the same.
    Runs this file as a script: `python test_multihost.py reap MARKER [NAMESPACE...]`.
    """

    def __init__(self, marker="", namespaces=()):
        self.proc = subprocess.Popen([sys.executable, __file__, "reap", marker, *namespaces],
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     start_new_session=True, env=cpu_env())

    def stop(self):
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


# ---------------------------------------------------------------- two hosts in network namespaces
class TwoHosts:
    """Two network namespaces joined by a veth pair; `command(i, argv)` runs argv on host i."""

    def __init__(self, tag):
        self.ns = [f"{NS_PREFIX}{tag}h{i}" for i in range(2)]
        self.created = []

    def setup(self):
        for ns in self.ns:
            sh(["ip", "netns", "add", ns])
            self.created.append(ns)
        # both ends are created straight inside the namespaces: the root namespace never sees them
        sh(["ip", "link", "add", IFACE, "netns", self.ns[0], "type", "veth",
            "peer", "name", IFACE, "netns", self.ns[1]])
        hosts = "127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for a, h in zip(ADDRS, HOSTNAMES))
        for ns, addr in zip(self.ns, ADDRS):
            sh(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", IFACE])
            sh(["ip", "-n", ns, "link", "set", "lo", "up"])
            sh(["ip", "-n", ns, "link", "set", IFACE, "up"])
            # `ip netns exec NS` bind-mounts /etc/netns/NS/hosts over /etc/hosts
            etc = Path("/etc/netns", ns)
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)

    def command(self, i, argv):
        """argv run on host i: its network namespace, and its own hostname (a UTS namespace)."""
        return ["ip", "netns", "exec", self.ns[i], "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', HOSTNAMES[i], *map(str, argv)]

    def pids(self, i):
        out = sh(["ip", "netns", "pids", self.ns[i]], check=False).stdout
        return [int(p) for p in out.split()]

    def veth_bytes(self, i):
        """(received, sent) bytes on host i's veth."""
        link = json.loads(sh(["ip", "-n", self.ns[i], "-s", "-j", "link", "show", IFACE]).stdout)[0]
        stats = link.get("stats64", link.get("stats"))
        return stats["rx"]["bytes"], stats["tx"]["bytes"]

    def shape(self, rate):
        """Both ends of the veth limited to `rate` ("100mbit") by a token bucket; None: unlimited again."""
        for ns in self.ns:
            sh(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", IFACE, "root"], check=False)
            if rate:
                sh(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", IFACE, "root", "tbf", "rate", rate,
                    "burst", "64kb", "latency", "50ms"])

    def teardown(self):
        """Kill whatever still runs in the namespaces, then delete them (the veth goes with them)."""
        reap(namespaces=self.created)
        self.created = []


def remove_stale_namespaces():
    """Namespaces of an earlier run that was killed before its finalizer ran."""
    out = sh(["ip", "netns", "list"], check=False).stdout
    for m in re.finditer(rf"^({NS_PREFIX}(\d+)x\w*h[01])\b", out, re.M):
        if not pid_alive(int(m.group(2))):
            sh(["ip", "netns", "del", m.group(1)], check=False)
            shutil.rmtree(Path("/etc/netns", m.group(1)), ignore_errors=True)


@pytest.fixture(scope="module")
def hosts(request):
    if os.geteuid() != 0:
        pytest.skip("needs root: creating network namespaces (ip netns add) is root-only")
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        pytest.skip("needs iproute2 (ip) and util-linux (unshare): run .ci/setup_multihost.sh")
    remove_stale_namespaces()
    two = TwoHosts(f"{os.getpid()}x{uuid.uuid4().hex[:3]}")
    watchdog = Watchdog("", two.ns)
    request.addfinalizer(watchdog.stop)
    request.addfinalizer(two.teardown)  # registered before setup: runs even when it fails half-way
    try:
        two.setup()
        sh(two.command(0, ["true"]))
    except RuntimeError as e:
        pytest.skip(f"network namespaces are not available here: {e}")
    return two


def run_on_hosts(hosts, tmp_path, argvs, env, timeout, stagger=0.0):
    """Start argvs[i] on host i (None: that host stays down), wait for all, bounded.

    Returns {i: (exit code, stdout, stderr)}. On timeout every process is killed and the
    test fails with all outputs. Each host gets its own working directory, as real hosts
    have their own disks.
    """
    procs, files = {}, {}
    try:
        for i, argv in enumerate(argvs):
            if argv is None:
                continue
            if procs and stagger:
                time.sleep(stagger)
            workdir = tmp_path / f"host{i}"
            workdir.mkdir(exist_ok=True)
            out, err = open(workdir / "stdout", "w+"), open(workdir / "stderr", "w+")
            files[i] = (out, err)
            procs[i] = subprocess.Popen(hosts.command(i, argv), cwd=workdir, env=env, stdout=out,
                                        stderr=err, stdin=subprocess.DEVNULL, start_new_session=True,
                                        preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout
        for i, proc in procs.items():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for p in procs.values():
                    kill_group(p)
                pytest.fail(f"timed out after {timeout} s\n" + outputs(files, procs))
        return {i: (p.returncode, *read_back(files[i])) for i, p in procs.items()}
    finally:
        for p in procs.values():
            kill_group(p)
            p.wait(timeout=30)
        for out, err in files.values():
            out.close()
            err.close()


def read_back(pair):
    texts = []
    for f in pair:
        f.flush()
        f.seek(0)
        texts.append(f.read())
    return texts


def outputs(files, procs):
    parts = []
    for i, pair in files.items():
        out, err = read_back(pair)
        parts.append(f"--- host{i} exit {procs[i].returncode}\n--- stdout\n{out[-3000:]}\n"
                     f"--- stderr\n{err[-3000:]}")
    return "\n".join(parts)


def host_env():
    """A CPU user's environment on each host; gloo must bind the veth, not what the hostname says."""
    return cpu_env(GLOO_SOCKET_IFNAME=IFACE, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")


def assert_trained_across(hosts, results, metrics_path, world_size, nproc_per_node, before,
                          rank_lines=True):
    describe = "\n".join(f"--- host{i} exit {code}\n{out[-2500:]}\n--- stderr\n{err[-2500:]}"
                         for i, (code, out, err) in results.items())
    assert all(code == 0 for code, _, _ in results.values()), describe
    assert "replicas: in sync" in results[0][1] and "done:" in results[0][1], describe
    # host 1 ran the ranks after host 0's (ddp_gpus_torchrun.py: each rank prints its epoch lines)
    for rank in range(nproc_per_node, world_size if rank_lines else 0):
        assert re.search(rf"\b{rank}\]", results[1][1]), f"rank {rank} did not run on host 1\n{describe}"
    m = json.loads(Path(metrics_path).read_text())
    assert m["world_size"] == world_size and m["replicas_in_sync"] is True, m
    if "val_loss" in m:  # ddp_transformer.py: validation before and after training
        assert m["val_loss"] < m["first_val_loss"], m
    else:
        assert m["final_loss"] < m["first_loss"], m
    # the training traffic crossed the veth, both ways (measured: 160-240 kB per host and direction)
    after = [hosts.veth_bytes(i) for i in range(2)]
    for i in range(2):
        received, sent = (a - b for a, b in zip(after[i], before[i]))
        assert received > 50_000 and sent > 50_000, f"host{i} veth: {received} B in, {sent} B out"
    # torchrun ended its workers: nothing of the job runs on either host
    assert hosts.pids(0) == [] and hosts.pids(1) == []


# script: (arguments, processes per host); small runs on CPU with gloo
SCRIPTS = {
    "ddp_gpus_torchrun.py": (["--device", "cpu", "--epochs", "3", "--snapshot_path", "snapshot.pt"], 2),
    "ddp_transformer.py": (["--device", "cpu", "--epochs", "1", "--max_steps", "30", "--d_model", "32",
                            "--num_layers", "1", "--block_size", "32", "--sample", "0",
                            "--checkpoint", "ckpt.pt"], 1),
}


def script_args(name):
    if not (ROOT / name).exists():
        pytest.skip(f"{name} is not in the repository yet")
    return SCRIPTS[name]


# the slow tier, for both scripts (2 processes per host: host 1's local ranks 0, 1 are global 2, 3): the
# default suite runs the same two-agent launch in run.sh's nodes mode (one machine, 1 process per
# agent on CPU), and two hosts in test_c10d_elastic_two_hosts below
@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCRIPTS))
def test_static_rendezvous_two_hosts(hosts, tmp_path, name):
    """`--nnodes=2 --node-rank=0/1 --master-addr=<host0's address>`: the classic two-node launch."""
    args, nproc = script_args(name)
    metrics = tmp_path / "metrics.json"
    before = [hosts.veth_bytes(i) for i in range(2)]
    # the port is free for sure: nothing else runs in these namespaces
    argvs = [torchrun_cmd() + ["--nnodes=2", f"--node-rank={i}", f"--nproc-per-node={nproc}",
                               f"--master-addr={ADDRS[0]}", "--master-port=29500",
                               str(ROOT / name), *args, "--metrics", metrics]
             for i in range(2)]
    results = run_on_hosts(hosts, tmp_path, argvs, host_env(), timeout=240)
    assert_trained_across(hosts, results, metrics, 2 * nproc, nproc, before,
                          rank_lines=name == "ddp_gpus_torchrun.py")


def test_c10d_elastic_two_hosts(hosts, tmp_path):
    """`--rdzv-backend=c10d --nnodes=1:2`: host 1 arrives late but within the last call, both train."""
    args, nproc = SCRIPTS["ddp_gpus_torchrun.py"][0], 1  # one process per host: a world of 2
    metrics = tmp_path / "metrics.json"
    before = [hosts.veth_bytes(i) for i in range(2)]
    # host 0 hosts the c10d store: its hostname resolves to 10.77.0.1, the endpoint's address.
    # c10d numbers the nodes by hostname, so ddp-host0 gets rank 0 and ddp-host1 rank 1.
    argv = torchrun_cmd() + ["--nnodes=1:2", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
                             f"--rdzv-endpoint={ADDRS[0]}:29400", "--rdzv-id=elastic-job",
                             "--rdzv-conf=join_timeout=120,last_call_timeout=30",
                             str(ROOT / "ddp_gpus_torchrun.py"), *args, "--metrics", metrics]
    results = run_on_hosts(hosts, tmp_path, [argv, argv], host_env(), timeout=240, stagger=2)
    assert_trained_across(hosts, results, metrics, 2 * nproc, nproc, before)


def test_c10d_second_host_never_arrives(hosts, tmp_path):
    """`--nnodes=2` but host 1 stays down: the rendezvous times out, exit non-zero, nothing left."""
    join_timeout = 5
    argv = torchrun_cmd() + ["--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d",
                             f"--rdzv-endpoint={ADDRS[0]}:29401", "--rdzv-id=lonely-job",
                             f"--rdzv-conf=join_timeout={join_timeout}",
                             str(ROOT / "ddp_gpus_torchrun.py"), "--device", "cpu"]
    start = time.monotonic()
    results = run_on_hosts(hosts, tmp_path, [argv, None], host_env(), timeout=120)
    seconds = time.monotonic() - start
    code, out, err = results[0]
    assert code != 0, f"expected a failed rendezvous\n{out}\n{err}"
    assert "RendezvousTimeoutError" in err, err[-3000:]
    assert "Epoch" not in out, out  # no worker started training
    assert seconds < join_timeout + 60, f"took {seconds:.0f} s"
    assert hosts.pids(0) == [], "processes left running on host 0"


# ---------------------------------------------------------------- a one-node SLURM cluster
def test_sbatch_script_refuses_bad_use(tmp_path):
    """Without a training script, or outside a job: one line `error: ...` and exit 2."""
    sbatch = ROOT / "slurm" / "train.sbatch"
    env = cpu_env()
    for name in [n for n in env if n.startswith("SLURM_")]:
        env.pop(name)
    empty = sh(["bash", sbatch], env=env, check=False, cwd=tmp_path)
    assert empty.returncode == 2 and empty.stderr.startswith("error: no training script"), empty
    outside = sh(["bash", sbatch, "ddp_gpus_torchrun.py"], env=env, check=False, cwd=tmp_path)
    assert outside.returncode == 2 and outside.stderr.startswith("error: not inside a SLURM job"), outside



def test_sbatch_warns_when_a_node_has_fewer_cpus_than_processes(tmp_path):
    """A job that asked for 4 GPUs and no CPUs may hold one CPU (no DefCpuPerGPU on the cluster): the job
    says so in one warning line and still gives the step every CPU it holds. `srun` and `scontrol` here
    are stand-ins that print what they were given: no cluster, no training."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/sh\necho "srun $*"\n')
    (bin_dir / "scontrol").write_text('#!/bin/sh\necho node1\n')
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    env = cpu_env(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID=7, SLURM_JOB_NODELIST="node1",
                  SLURM_JOB_NUM_NODES=1, SLURM_GPUS_ON_NODE=4, SLURM_CPUS_ON_NODE=1, TORCHRUN="torchrun")
    r = sh(["bash", ROOT / "slurm" / "train.sbatch", "ddp_gpus_torchrun.py"], env=env, cwd=tmp_path)
    assert r.stderr.strip().splitlines() == [
        "warning: 1 CPU(s) per node for 4 training processes: they share them; ask for more "
        "(sbatch --cpus-per-gpu=K, or --cpus-per-task=K)"], r.stderr
    assert "--cpus-per-task=1" in r.stdout and "--nproc-per-node=4" in r.stdout, r.stdout
    env.update(SLURM_CPUS_ON_NODE="32")
    assert sh(["bash", ROOT / "slurm" / "train.sbatch", "ddp_gpus_torchrun.py"], env=env, cwd=tmp_path).stderr == ""

@pytest.mark.parametrize("job", [
    {"SLURM_GPUS_PER_NODE": "8"},  # --gpus-per-node=8
    {"SLURM_JOB_GPUS": "0,1,2,3,4,5,6,7"},  # --gres=gpu:8
    {"SLURM_NTASKS_PER_NODE": "8", "SLURM_GPUS_PER_TASK": "1", "SLURM_TRES_PER_TASK": "cpu=4,gres/gpu=1",
     "SLURM_CPUS_PER_TASK": "4"},  # --ntasks-per-node=8 --gpus-per-task=1 --cpus-per-task=4
    {"SLURM_GPUS": "8"},  # --nodes=1 --gpus=8
    {"SLURM_GPUS_PER_NODE": "8", "SLURM_CPUS_PER_GPU": "4"},  # --gpus-per-node=8 --cpus-per-gpu=4
])
def test_sbatch_step_asks_for_every_gpu_of_its_node(tmp_path, job):
    """srun reads the job's requests from the environment: a job of --gpus-per-task=1 gave the step's one
    task one GPU while torchrun started 8 processes (local ranks 1-7 failed), and --cpus-per-gpu refuses
    the step's --cpus-per-task. Whichever way the job asked, the step asks for the node's 8 GPUs and all
    its CPUs itself, and srun inherits none of the job's per-task or per-GPU requests. `srun` is a stand-in
    that prints what it was given (the cluster of these tests has no GPUs)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/sh\necho "srun $*"\nenv | grep -E "^SLURM_(GPUS|CPUS_PER|TRES)" | '
                                  'grep -v ^SLURM_GPUS_ON_NODE= | sed "s/^/inherited: /"\n')
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho node1\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    env = cpu_env(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID=7, SLURM_JOB_NODELIST="node1",
                  SLURM_JOB_NUM_NODES=1, SLURM_GPUS_ON_NODE=8, SLURM_CPUS_ON_NODE=32, TORCHRUN="torchrun", **job)
    step = sh(["bash", ROOT / "slurm" / "train.sbatch", "ddp_gpus_torchrun.py"], env=env, cwd=tmp_path).stdout
    assert " --gpus-per-node=8 " in step and " --cpus-per-task=32 " in step and "--nproc-per-node=8 " in step, step
    assert "--gpus-per-task" not in step and "--cpus-per-gpu" not in step and "inherited: " not in step, step
    del env["SLURM_GPUS_ON_NODE"]  # a job without GPUs: none asked for
    step = sh(["bash", ROOT / "slurm" / "train.sbatch", "ddp_gpus_torchrun.py"], env=env, cwd=tmp_path).stdout
    assert "--gpus-per-node" not in step, step


def test_sbatch_passes_max_restarts_and_a_node_says_how_it_ended(tmp_path):
    """MAX_RESTARTS (default 3) reaches torchrun as --max-restarts, a bad value is one error line, and a
    node other than the first prints one line at the end: which node, how its torchrun exited, where the
    checkpoint is. Stand-ins: `srun` runs its command as node 1, `torchrun` prints what it was given and
    exits 3 (no cluster, no training)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nSLURM_NODEID=1 exec "$@"\n')
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho node0\necho node1\n")
    (bin_dir / "fake-torchrun").write_text('#!/bin/sh\necho "torchrun $*"\nexit 3\n')
    for tool in ("srun", "scontrol", "fake-torchrun"):
        (bin_dir / tool).chmod(0o755)
    env = cpu_env(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID=7, SLURM_JOB_NODELIST="node[0-1]",
                  SLURM_JOB_NUM_NODES=2, SLURM_NTASKS_PER_NODE=2, TORCHRUN="fake-torchrun")
    sbatch = ROOT / "slurm" / "train.sbatch"
    r = sh(["bash", sbatch, "ddp_gpus_torchrun.py", "--snapshot_path", "ck.pt"], env=env, cwd=tmp_path, check=False)
    assert r.returncode == 3 and "--max-restarts=3 " in r.stdout, r
    assert r.stdout.strip().splitlines()[-1] == (f"node 1 of 2 ({socket.gethostname()}): torchrun exited 3; "
                                                 f"checkpoint: {tmp_path}/ck.pt (written by global rank 0)"), r.stdout
    r = sh(["bash", sbatch, "ddp_transformer.py"], env={**env, "MAX_RESTARTS": "0"}, cwd=tmp_path, check=False)
    assert "--max-restarts=0 " in r.stdout and f"checkpoint: the script's default file, in {tmp_path}" in r.stdout, r
    r = sh(["bash", sbatch, "ddp_transformer.py"], env={**env, "MAX_RESTARTS": "three"}, cwd=tmp_path, check=False)
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "error: MAX_RESTARTS must be a whole number, got 'three' (export MAX_RESTARTS=3, or 0)"], r


SLURM_CONF = """\
# A private one-node cluster for the tests: its own ports, state and munge socket.
ClusterName=ddptest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/log/slurmctld.log
SlurmdLogFile={dir}/log/slurmd.log
# no cgroups, no accounting: what runs in a container
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
# report the CPUs below even on a machine with fewer: the test asks for 2 tasks
SlurmdParameters=config_overrides
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=30 State=UP
"""


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class SlurmCluster:
    """munged + slurmctld + slurmd in the foreground, all tagged so that teardown finds every process."""

    def __init__(self, directory):
        self.dir = directory
        self.marker = uuid.uuid4().hex  # in the environment of everything the cluster starts
        self.watchdog = Watchdog(self.marker)
        self.daemons = {}
        resolvable = True
        try:
            socket.gethostbyname(socket.gethostname())
        except OSError:
            resolvable = False
        # the job's rendezvous host is the node name, so it must resolve like a real node's
        self.node = socket.gethostname() if resolvable else "localhost"
        self.conf = directory / "slurm.conf"
        self.env = cpu_env(SLURM_CONF=self.conf,
                           PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
                           DDP_MULTIHOST_TAG=self.marker)
        for name in ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
            self.env.pop(name, None)

    def start(self):
        for sub in ("munge", "state", "spool", "log", "job"):
            (self.dir / sub).mkdir(mode=0o700, exist_ok=True)
        munge = self.dir / "munge"
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.munge_socket = munge / "socket"
        self.spawn("munged", ["munged", "--foreground", "--force", f"--socket={self.munge_socket}",
                              f"--key-file={key}", f"--pid-file={munge}/munged.pid",
                              f"--log-file={munge}/munged.log", f"--seed-file={munge}/munged.seed"])
        self.wait_for("munged", lambda: sh(["munge", "-n", "-S", self.munge_socket], check=False).returncode == 0)
        ctld_port, slurmd_port = free_ports(2)
        self.conf.write_text(SLURM_CONF.format(node=self.node, dir=self.dir, ctld_port=ctld_port,
                                               slurmd_port=slurmd_port, munge_socket=self.munge_socket,
                                               cpus=max(2, os.cpu_count() or 1)))
        self.spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", self.conf])
        self.spawn("slurmd", ["slurmd", "-D", "-f", self.conf, "-N", self.node])
        self.wait_for("an idle node", lambda: sh(["sinfo", "-h", "-o", "%T"], env=self.env,
                                                 check=False).stdout.strip() == "idle")

    def spawn(self, name, argv):
        log = open(self.dir / "log" / f"{name}.out", "w")
        self.daemons[name] = subprocess.Popen([str(a) for a in argv], env=self.env, stdout=log,
                                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              start_new_session=True, preexec_fn=die_with_parent)
        log.close()

    def wait_for(self, what, ready, timeout=30):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [n for n, p in self.daemons.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited while waiting for {what}\n{self.logs()}")
            if ready():
                return
            time.sleep(0.3)
        raise RuntimeError(f"no {what} after {timeout} s\n{self.logs()}")

    def logs(self):
        return "\n".join(f"--- {p.name}\n{tail(p, 1500)}" for p in sorted((self.dir / "log").glob("*")))

    def slurm(self, *argv, timeout=30, check=True):
        return sh(argv, env=self.env, timeout=timeout, check=check, cwd=self.dir / "job")

    def stop(self):
        """Cancel the jobs, stop the daemons (TERM, then KILL), kill anything tagged that is left."""
        if "slurmctld" in self.daemons and self.daemons["slurmctld"].poll() is None:
            self.slurm("scancel", "--quiet", "--partition=debug", timeout=15, check=False)
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.daemons.get(name)
            if proc is None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                kill_group(proc)
                proc.wait(timeout=15)
            kill_group(proc)
        reap(self.marker)  # slurmstepd and the job's processes, which slurmd does not own
        self.daemons = {}
        self.watchdog.stop()


@pytest.fixture
def slurm_cluster(tmp_path, request):
    if os.geteuid() != 0:
        pytest.skip("needs root: the test cluster runs slurmctld/slurmd as SlurmUser=root")
    missing = [b for b in SLURM_BINARIES if shutil.which(b) is None]
    if missing:
        pytest.skip(f"SLURM is not installed (no {', '.join(missing)}): run .ci/setup_multihost.sh")
    cluster = SlurmCluster(tmp_path / "c")  # short: munge's socket path must fit 108 bytes
    cluster.dir.mkdir(mode=0o700)
    request.addfinalizer(cluster.stop)
    try:
        cluster.start()
    except RuntimeError as e:
        pytest.skip(f"could not start a one-node SLURM cluster: {e}")
    return cluster


@pytest.mark.slow  # 20 s of the default tier's 315 (2026-12-07), where it ran only as root with SLURM set up
def test_slurm_sbatch_one_node(slurm_cluster):
    """sbatch slurm/train.sbatch on one node with 2 tasks: torchrun starts 2 CPU processes. One of them is
    SIGKILLed once the first snapshot exists; torchrun (MAX_RESTARTS: 3 by default) restarts them, the job
    completes and ends with the weights of an uninterrupted 2-rank run."""
    from test_faults import one_process_reference
    cluster = slurm_cluster
    jobdir = cluster.dir / "job"
    args = ["--epochs", "3", "--samples", "8192", "-b", "8"]
    submit = cluster.slurm("sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--time=5",
                           "--output=ddp-%j.out", ROOT / "slurm" / "train.sbatch",
                           ROOT / "ddp_gpus_torchrun.py", "--device", "cpu", *args, "--snapshot_path", "snap.pt",
                           "--metrics", "metrics.json")
    job = submit.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 180
    while not (jobdir / "snap.pt").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    workers = [pid for pid in tagged_pids(cluster.marker) if is_worker(pid)]
    assert len(workers) == 2, ([cmdline(pid) for pid in tagged_pids(cluster.marker)], tail(jobdir / f"ddp-{job}.out"))
    os.kill(max(workers), signal.SIGKILL)
    # poll instead of `sbatch --wait`, whose polling interval grows to tens of seconds
    deadline, state = time.monotonic() + 240, ""
    while time.monotonic() < deadline:
        info = cluster.slurm("scontrol", "-o", "show", "job", job, check=False).stdout
        state = (re.search(r"JobState=(\S+)", info) or [None, "UNKNOWN"])[1]
        if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "UNKNOWN"):
            break
        time.sleep(0.5)
    output = tail(jobdir / f"ddp-{job}.out", 6000)
    context = f"job {job}: {state}\n{info}\n--- job output\n{output}\n{cluster.logs()}"
    assert state == "COMPLETED" and "ExitCode=0:0" in info, context
    assert "1 node(s) x 2 process(es)" in output and "up to 3 restart(s)" in output, context
    assert "replicas: in sync" in output and "done:" in output, context
    m = json.loads((jobdir / "metrics.json").read_text())
    assert m["world_size"] == 2 and m["replicas_in_sync"] is True and m["restarts"] == 1, m
    assert m["resumed_from_epoch"] >= 1 and m["final_loss"] < m["first_loss"], m
    resumed = torch.load(jobdir / "snap.pt", map_location="cpu", weights_only=True)["model"]
    for name, value in one_process_reference(args).items():
        assert torch.allclose(resumed[name], value, rtol=1e-5, atol=1e-6), name
    cluster.stop()
    assert tagged_pids(cluster.marker) == [], "processes of the test cluster outlived it"


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read()
    except OSError:
        return ""


def is_worker(pid):
    """A training process: torchrun gives its workers, not itself, RANK and TORCHELASTIC_RUN_ID."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read().split(b"\0")
    except OSError:
        return False
    return any(v.startswith(b"TORCHELASTIC_RUN_ID=") for v in environ) and any(v.startswith(b"RANK=") for v in environ)


if __name__ == "__main__" and sys.argv[1:2] == ["reap"]:
    sys.stdin.read()  # returns at end of file: the test is over, or pytest died
    reap(sys.argv[2], sys.argv[3:])
