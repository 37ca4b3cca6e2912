"""ddp_bandwidth.py (issue 53): the collectives' time, algbw and busbw per size, the link, the verdict.

Default tier (about 8 s): one torchrun launch on loopback (2 ranks, gloo, 4 KiB to 256 KiB) read by many
tests, the bad input and a world of one in process. Slow tier: two network namespaces (root) joined by a
veth shaped by a token bucket to 200 and to 100 Mbit/s: the busbw it finds is the shaped rate, over the
interface it names; the bad input from the command line; plain `python` as a world of one; `bash run.sh
bandwidth`.
"""
import importlib.util
import math
import re
import sys

import pytest
import torch
from torch.distributed.elastic.utils.distributed import get_free_port

from conftest import ROOT, cpu_env, read_metrics, run_bounded, torchrun_cmd
from test_multihost import ADDRS, IFACE, host_env, hosts, run_on_hosts  # noqa: F401 (hosts: the fixture)

SCRIPT = ROOT / "ddp_bandwidth.py"
OPS = ["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"]
ROW = re.compile(r"^(all_reduce|all_gather_into_tensor|reduce_scatter_tensor) +(\d+) +([\d.]+ [mu]?s) +(\S+) +(\S+) "
                 r"+(\d+)$", re.M)


def load():
    spec = importlib.util.spec_from_file_location("ddp_bandwidth", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bandwidth = load()


def assert_one_entry_per_op_and_size(m, largest):
    sizes = [4096 * 2 ** k for k in range(int(math.log2(largest // 4096)) + 1)]
    assert [(r["op"], r["bytes"]) for r in m["results"]] == [(op, s) for op in OPS for s in sizes], m["results"]
    for r in m["results"]:
        assert r["seconds"] > 0 and r["algbw_GBps"] == pytest.approx(r["bytes"] / r["seconds"] / 1e9, rel=1e-12), r


# ---------------------------------------------------------------- loopback: one launch, many checks
@pytest.fixture(scope="module")
def loopback(tmp_path_factory):
    work = tmp_path_factory.mktemp("bandwidth")
    r = run_bounded(torchrun_cmd() + ["--standalone", "--nproc-per-node=2", SCRIPT, "--device", "cpu",
                                      "--max_bytes", "256K", "--seconds", "0.01", "--params", "1000000",
                                      "--metrics", "m.json"], work, timeout=120)
    r.metrics = read_metrics(work / "m.json")
    return r


def test_the_table_has_one_line_per_op_and_size_as_the_metrics_say(loopback):
    rows = ROW.findall(loopback.stdout)
    sizes = [4096 * 2 ** k for k in range(7)]  # 4 KiB to 256 KiB
    assert [(op, int(b)) for op, b, *_ in rows] == [(op, s) for op in OPS for s in sizes], loopback
    m = loopback.metrics
    assert_one_entry_per_op_and_size(m, 256 * 1024)
    for (op, _, _, algbw, busbw, calls), r in zip(rows, m["results"]):  # the table prints what the metrics hold
        assert float(algbw) == pytest.approx(r["algbw_GBps"], rel=1e-3) and int(calls) == r["repeats"] >= 1, (op, r)
        assert float(busbw) == pytest.approx(r["busbw_GBps"], rel=1e-3), (op, r)


def test_busbw_is_algbw_times_the_factor_of_its_op(loopback):
    """nccl-tests' factors: all_reduce 2(n-1)/n, the other two (n-1)/n; at 2 ranks 1 and 1/2."""
    for r in loopback.metrics["results"]:
        factor = 1.0 if r["op"] == "all_reduce" else 0.5
        assert r["busbw_GBps"] / r["algbw_GBps"] == pytest.approx(factor, rel=1e-12), r
    assert [bandwidth.BUS_FACTOR[op](4) for op in OPS] == [1.5, 0.75, 0.75]  # at 4 ranks
    assert [bandwidth.BUS_FACTOR[op](1) for op in OPS] == [0, 0, 0]  # a world of one sends nothing


def test_the_run_keeps_the_contract_and_its_results_are_right(loopback):
    m, out = loopback.metrics, loopback.stdout
    for key in ("script", "world_size", "backend", "device", "epochs", "steps", "steps_per_epoch", "elapsed_s",
                "samples_per_s", "first_loss", "final_loss", "replicas_in_sync", "resumed_from_epoch"):
        assert key in m, key
    assert (m["script"], m["world_size"], m["backend"], m["device"]) == ("ddp_bandwidth.py", 2, "gloo", "cpu"), m
    assert m["replicas_in_sync"] is True and m["results_correct"] is True and m["elapsed_s"] > 0, m
    assert "results: correct on every rank (42 collective results checked)" in out, loopback
    assert out.strip().splitlines()[-1].startswith("done: ddp_bandwidth.py | 2 processes on cpu (gloo) | lo |")
    assert "Traceback" not in loopback.stderr and "Warning" not in loopback.stderr, loopback


def test_the_interface_is_loopback_on_both_ranks(loopback):
    m = loopback.metrics
    assert m["interface"] == "lo" and m["link_Mbps"] is None, m
    assert [(i["rank"], i["interface"]) for i in m["interfaces"]] == [(0, "lo"), (1, "lo")], m["interfaces"]
    assert "interface: ranks 0, 1: lo (loopback: its peers share this machine), no speed reported" in loopback.stdout


def test_the_verdict_reads_the_largest_size_below_the_bucket_and_the_prediction_its_busbw(loopback):
    m, out = loopback.metrics, loopback.stdout
    largest = [r for r in m["results"] if r["op"] == "all_reduce"][-1]
    assert m["bucket_bytes"] == 256 * 1024 and m["bucket_busbw_GBps"] == largest["busbw_GBps"], m
    verdict = re.findall(r"^verdict: all_reduce busbw (\S+) GB/s = .* at 256 KiB, the largest measured .*$", out, re.M)
    assert len(verdict) == 1 and float(verdict[0]) == pytest.approx(largest["busbw_GBps"], rel=1e-3), loopback
    assert "; the peers share this machine: memory copies through the kernel, not a network" in out, loopback
    # 10^6 float32 gradients, 2(n-1)/n = 1 at 2 ranks: 4 MB / busbw
    assert m["predicted_allreduce_s"] == pytest.approx(4e6 / (largest["busbw_GBps"] * 1e9), rel=1e-12), m
    assert re.search(r"^prediction: one step's gradients, 1,000,000 parameters x 4 bytes = 3.815 MiB, all-reduced at "
                     r"busbw \S+ GB/s: bytes x 2\(n-1\)/n / busbw = \S+ [mu]?s a step", out, re.M), loopback


@pytest.mark.parametrize("busbw,link,device,said", [
    (0.1, {"interface": "lo", "how": "loopback: its peers share this machine", "speed": None}, "cpu",
     "; the peers share this machine: memory copies through the kernel, not a network"),
    (90, {"interface": "lo", "how": "loopback: its peers share this machine", "speed": None}, "cuda",
     "; the peers share this machine: the devices' own links (NVLink, PCIe)"),
    (1.0, {"interface": "eth0", "how": "set by NCCL_SOCKET_IFNAME", "speed": 10000}, "cuda",
     ": 80% of the 10000 Mbit/s eth0 reports; the link is the limit"),
    (0.1, {"interface": "eth0", "how": "set by GLOO_SOCKET_IFNAME", "speed": 10000}, "cpu",
     ": 8.0% of the 10000 Mbit/s eth0 reports; either the link carries less than it reports"),
    (25.0, {"interface": "eth0", "how": "the route to the peers on other machines", "speed": 100000}, "cuda",
     ": 200% of the 100000 Mbit/s eth0 reports, more than it can carry: the backend sends another way"),
    (0.1, {"interface": "ib0", "how": "set by NCCL_SOCKET_IFNAME", "speed": None}, "cuda",
     "; ib0 reports no speed to compare with"),
])
def test_the_verdict_compares_busbw_with_what_the_link_reports(busbw, link, device, said):
    line = bandwidth.verdict(busbw, bandwidth.BUCKET, link, 2, torch.device(device))
    assert line.startswith(f"all_reduce busbw {busbw:.4g} GB/s = {busbw * 8000:.4g} Mbit/s at 25 MiB, DDP's bucket{said}"), line


def test_interpolation_at_the_bucket_between_two_sizes():
    results = [{"op": "all_reduce", "bytes": 16 * 2 ** 20, "busbw_GBps": 1.0},
               {"op": "all_reduce", "bytes": 32 * 2 ** 20, "busbw_GBps": 2.0}]
    busbw, at = bandwidth.busbw_at(results, bandwidth.BUCKET)
    assert at == 25 * 2 ** 20 and busbw == pytest.approx(1 + math.log2(25 / 16)), busbw


# ---------------------------------------------------------------- bad input: one line, exit 2
@pytest.mark.parametrize("argv,said", [
    (["--max_bytes", "1K"], "error: --max_bytes must be at least 4096 (4 KiB, the first size), got 1024 "
                            "(pass --max_bytes 4K or more)"),
    (["--max_bytes", "0"], "error: --max_bytes must be positive, got 0 (pass a --max_bytes above 0)"),
    (["--max_bytes=-4M"], "error: --max_bytes must be positive, got -4194304"),
    (["--max_bytes", "lots"], "error: argument --max_bytes: 'lots' is not a number of bytes such as 4096, 256K, 16M"),
    (["--seconds", "0"], "error: --seconds must be positive, got 0.0"),
    (["--params", "-5"], "error: --params must be positive, got -5"),
    (["--bytes", "0"], "error: --bytes must be positive, got 0"),
    (["--params", "5", "--bytes", "4M"], "error: argument --bytes: not allowed with argument --params"),
    (["--warmup", "-1"], "error: --warmup must be 0 or more, got -1"),
    (["--dtype", "int8"], "error: argument --dtype: invalid choice: 'int8'"),
    (["--metrics", "no/such/folder/m.json"], "error: the folder of no/such/folder/m.json does not exist"),
])
def test_bad_input_is_one_line_and_exit_2(argv, said, monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(sys, "argv", ["ddp_bandwidth.py", *argv])
    with pytest.raises(SystemExit) as exit_:
        bandwidth.check_args(bandwidth.parse_args(argv + ["--device", "cpu"]))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith(said), err


@pytest.mark.slow  # 3 s of torch's import; the default tier refuses each bad input in process, through the same calls
def test_bad_input_from_the_command_line(tmp_path):
    r = run_bounded([sys.executable, SCRIPT, "--max_bytes", "2K"], tmp_path, timeout=60, check=False)
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr == "error: --max_bytes must be at least 4096 (4 KiB, the first size), got 2048 " \
                       "(pass --max_bytes 4K or more)\n", r


def test_a_world_of_one_measures_and_says_nothing_crosses_a_link(monkeypatch, capsys, tmp_path):
    """What plain `python ddp_bandwidth.py` does (the launch itself: the slow tier), here in this process."""
    place = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(get_free_port())}
    for name, value in place.items():
        monkeypatch.setenv(name, value)
    argv = ["--device", "cpu", "--max_bytes", "8K", "--seconds", "0.001", "--metrics", str(tmp_path / "m.json")]
    monkeypatch.setattr(sys, "argv", ["ddp_bandwidth.py", *argv])
    threads, args = torch.get_num_threads(), bandwidth.check_args(bandwidth.parse_args(argv))
    device = bandwidth.setup(args)
    try:
        assert bandwidth.probe_and_report(device, args) is True
    finally:
        bandwidth.cleanup()
        torch.set_num_threads(threads)
    out, m = capsys.readouterr().out, read_metrics(tmp_path / "m.json")
    assert "interface: rank 0: none (a world of one: no peer), no speed reported" in out, out
    assert "verdict: a world of one: nothing crosses a link (busbw is 0 by definition" in out, out
    assert_one_entry_per_op_and_size(m, 8192)
    assert all(r["busbw_GBps"] == 0 and r["algbw_GBps"] > 0 for r in m["results"]), m["results"]
    assert m["world_size"] == 1 and m["interface"] is None and m["replicas_in_sync"] is True, m


# ---------------------------------------------------------------- slow tier: a link of known speed
def probe_on_veth(hosts, tmp_path, rate, env):
    """One torchrun agent per host, one process each, over the veth shaped to `rate` on both ends."""
    hosts.shape(rate)
    metrics = tmp_path / "m.json"
    argvs = [torchrun_cmd() + ["--nnodes=2", f"--node-rank={i}", "--nproc-per-node=1", f"--master-addr={ADDRS[0]}",
                               "--master-port=29500", SCRIPT, "--device", "cpu", "--max_bytes", "2M",
                               "--seconds", "0.3", "--metrics", metrics] for i in range(2)]
    try:
        results = run_on_hosts(hosts, tmp_path, argvs, env, timeout=150)
    finally:
        hosts.shape(None)
    said = "\n".join(f"--- host{i} exit {code}\n{out[-3000:]}\n--- stderr\n{err[-2000:]}"
                     for i, (code, out, err) in results.items())
    assert all(code == 0 for code, _, _ in results.values()), said
    return results[0][1], read_metrics(metrics), said


def assert_found_the_link(out, m, said, mbit, how):
    """busbw at the largest size within 15% of the shaped rate (and so not within 15% of the other rate)."""
    assert_one_entry_per_op_and_size(m, 2 * 2 ** 20)
    busbw = [r["busbw_GBps"] * 8000 for r in m["results"] if r["op"] == "all_reduce"][-1]
    assert abs(busbw - mbit) <= 0.15 * mbit, f"all_reduce busbw {busbw:.1f} Mbit/s on a {mbit} Mbit/s link\n{said}"
    assert [(i["rank"], i["interface"], i["how"]) for i in m["interfaces"]] == [(0, IFACE, how), (1, IFACE, how)], m
    assert m["interface"] == IFACE and m["link_Mbps"] == 10000, m  # what a veth reports, whatever tc makes of it
    assert f"interface: ranks 0, 1: {IFACE} ({how}), 10000 Mbit/s as the system reports it" in out, said
    share = re.search(r"^verdict: all_reduce busbw \S+ GB/s = (\S+) Mbit/s at 2 MiB, the largest measured .*: "
                      r"([\d.]+)% of the 10000 Mbit/s ddp0 reports; either the link carries less than it reports",
                      out, re.M)
    assert share and float(share[1]) == pytest.approx(busbw, rel=1e-3) and float(share[2]) < 70, said


@pytest.mark.slow
@pytest.mark.xdist_group("bandwidth_veth")
def test_a_veth_shaped_to_200_mbit_named_by_gloo_socket_ifname(hosts, tmp_path):
    out, m, said = probe_on_veth(hosts, tmp_path, "200mbit", host_env())
    assert_found_the_link(out, m, said, 200, "set by GLOO_SOCKET_IFNAME")


@pytest.mark.slow
@pytest.mark.xdist_group("bandwidth_veth")
def test_a_veth_shaped_to_100_mbit_found_from_the_addresses(hosts, tmp_path):
    """No GLOO_SOCKET_IFNAME: gloo binds the address each host's name resolves to; the script finds the veth
    from the peers' addresses and the route to them."""
    env = host_env()
    del env["GLOO_SOCKET_IFNAME"]
    out, m, said = probe_on_veth(hosts, tmp_path, "100mbit", env)
    assert_found_the_link(out, m, said, 100, "the route to the peers on other machines")


@pytest.mark.slow
def test_plain_python_is_a_world_of_one(tmp_path):
    r = run_bounded([sys.executable, SCRIPT, "--max_bytes", "8K", "--seconds", "0.01", "--metrics", "m.json"],
                    tmp_path, timeout=60)
    assert "verdict: a world of one: nothing crosses a link" in r.stdout and "Traceback" not in r.stderr, r
    assert_one_entry_per_op_and_size(read_metrics(tmp_path / "m.json"), 8192)


@pytest.mark.slow
def test_run_sh_bandwidth_mode(tmp_path):
    r = run_bounded(["bash", ROOT / "run.sh", "bandwidth"], tmp_path, timeout=300, env=cpu_env())
    assert "1 passed, 0 failed" in r.stdout and "verdict: all_reduce busbw" in r.stdout, r
