"""Tests for ddp_main.py and ddp_main_torchrun.py: run as users run them, on CPU with gloo.

Every launch goes through conftest's bounded `launch` fixture. The network is made
unreachable (a proxy on a closed port) so that `--dataset auto` and `--dataset mnist`
behave the same on every machine: nothing is downloaded, ever.
"""
import math
import struct
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import cpu_env
from ddp_main import ConvNet, SyntheticDigits

TEST_SAMPLES = 1001  # 7 x 11 x 13: neither 2 nor 3 divides it, so a padding sampler would show
TIMEOUT = 240  # generous: the machine may be shared with other test runs
DEAD_PROXY = "http://127.0.0.1:9"  # the discard port: any download fails at once


def offline_env():
    return cpu_env(http_proxy=DEAD_PROXY, https_proxy=DEAD_PROXY, HTTP_PROXY=DEAD_PROXY,
                   HTTPS_PROXY=DEAD_PROXY, no_proxy="", NO_PROXY="")


def load_checkpoint(path):
    """The checkpoint as a user loads it: weights_only, into a fresh, unwrapped ConvNet."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    assert not any(k.startswith("module.") for k in checkpoint["model"]), "DDP's module. prefix was saved"
    model = ConvNet()
    model.load_state_dict(checkpoint["model"])  # strict: every key matches
    return checkpoint, model.eval()


@torch.no_grad()
def evaluate_here(model, images, labels):
    """One process, one batch, plain fp32: (correct, mean loss)."""
    outputs = model(images)
    return int((outputs.argmax(1) == labels).sum()), F.cross_entropy(outputs, labels).item()


def assert_matches_checkpoint(m, checkpoint_path, images, labels):
    """The script's distributed test result equals the checkpoint evaluated in this process."""
    _, model = load_checkpoint(checkpoint_path)
    correct, loss = evaluate_here(model, images, labels)
    assert m["test_samples"] == len(labels)
    assert round(m["test_accuracy"] * len(labels)) == correct, (m["test_accuracy"], correct)
    assert m["test_loss"] == pytest.approx(loss, rel=1e-4, abs=1e-6)


def synthetic_test_set(n, seed=0):
    data = SyntheticDigits(n, seed=seed, train=False)
    return data.images, data.targets


# ---------------------------------------------------------------- train, checkpoint, resume
def test_train_checkpoint_resume(launch, script, metrics, tmp_path):
    """Default dataset (auto) without MNIST or network: loud synthetic fallback that learns;
    a checkpoint that loads with weights_only and reproduces the test accuracy; --resume continues."""
    common = ["--device", "cpu", "--amp", "off", "--train_samples", "2000", "--test_samples", str(TEST_SAMPLES),
              "--data", str(tmp_path / "data"), "--timeout", "60"]
    first = launch([sys.executable, script("ddp_main.py"), *common, "--nprocs", "2", "-e", "1", "--gpu", "0,1",
                    "--metrics", "m1.json"], timeout=TIMEOUT, env=offline_env())
    m1 = metrics(tmp_path / "m1.json")
    assert "SYNTHETIC" in first.stdout and m1["dataset"] == "synthetic"
    assert first.stdout.count("note: --gpu 0,1 ignored on CPU") == 1
    assert first.stdout.count("SyncBatchNorm needs CUDA") == 1
    assert f"test: {TEST_SAMPLES} samples" in first.stdout
    assert first.stdout.strip().splitlines()[-1].startswith("done: ddp_main.py")
    assert (m1["world_size"], m1["epochs"], m1["resumed_from_epoch"]) == (2, 1, 0)
    assert m1["steps_per_epoch"] == math.ceil(2000 / 2 / 32) and m1["steps"] == m1["steps_per_epoch"]
    assert (m1["amp"], m1["sync_bn"], m1["replicas_in_sync"]) == ("off", False, True)

    checkpoint, _ = load_checkpoint(tmp_path / "ddp_checkpoint.pt")
    assert checkpoint["epoch"] == 1 and checkpoint["args"]["batch_size"] == 32
    assert set(checkpoint) >= {"model", "optimizer", "scaler", "epoch", "args"}
    assert_matches_checkpoint(m1, tmp_path / "ddp_checkpoint.pt", *synthetic_test_set(TEST_SAMPLES))

    # resumed by the torchrun sibling as a one-process world: the checkpoint is launcher-independent
    second = launch([sys.executable, script("ddp_main_torchrun.py"), *common, "-e", "2", "--resume",
                     "--metrics", "m2.json"], timeout=TIMEOUT, env=offline_env())
    m2 = metrics(tmp_path / "m2.json")
    assert "loaded ddp_checkpoint.pt (epoch 1" in second.stdout
    assert "epoch 1/2" not in second.stdout and "epoch 2/2" in second.stdout
    assert (m2["world_size"], m2["epochs"], m2["resumed_from_epoch"]) == (1, 2, 1)
    assert m2["steps"] == math.ceil(2000 / 32) == m2["steps_per_epoch"]
    # a run that ignored the checkpoint would start again near the first epoch's loss (about 1)
    assert m2["first_loss"] < 0.5 * m1["first_loss"], (m1["losses"], m2["losses"])
    assert m2["test_accuracy"] > 0.95, m2  # the synthetic set is learnable
    assert load_checkpoint(tmp_path / "ddp_checkpoint.pt")[0]["epoch"] == 2
    assert_matches_checkpoint(m2, tmp_path / "ddp_checkpoint.pt", *synthetic_test_set(TEST_SAMPLES))


# ---------------------------------------------------------------- exact evaluation
# the seed's hand-made launch: each process is told its place in the job by environment variables
MANUAL_LAUNCH = r"""
port=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
pids=()
for r in 0 1; do
    RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port "$PYTHON" "$@" &
    pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
exit $rc
"""


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_exact_evaluation(world_size, launch, script, metrics, torchrun, tmp_path):
    """Every test sample is counted once, whatever the world size, and the result equals
    the saved checkpoint evaluated in one process. Also: all three ways to launch the torchrun script."""
    args = [script("ddp_main_torchrun.py"), "--device", "cpu", "--dataset", "synthetic", "--train_samples", "128",
            "--amp", "off", "-e", "1", "--test_samples", str(TEST_SAMPLES), "--metrics", "m.json", "--timeout", "60"]
    if world_size == 1:  # plain python: a one-process world
        result = launch([sys.executable, *args], timeout=TIMEOUT)
    elif world_size == 2:
        result = launch(["bash", "-c", MANUAL_LAUNCH, "manual", *args], timeout=TIMEOUT,
                        env=cpu_env(PYTHON=sys.executable))
    else:  # torchrun decides the world size; --gpu is ignored on CPU
        result = launch([*torchrun, "--standalone", f"--nproc_per_node={world_size}", *args, "--gpu", "0,1"],
                        timeout=TIMEOUT)
    m = metrics(tmp_path / "m.json")
    assert m["world_size"] == world_size and m["replicas_in_sync"] is True
    assert result.stdout.count(f"test: {TEST_SAMPLES} samples") == 1
    assert result.stdout.count("note: --gpu") == (1 if world_size == 3 else 0)
    assert_matches_checkpoint(m, tmp_path / "ddp_checkpoint.pt", *synthetic_test_set(TEST_SAMPLES))


# ---------------------------------------------------------------- MNIST files, AMP
def write_idx(raw, prefix, images, labels):
    """torchvision's raw MNIST format (IDX): big-endian magic and sizes, then uint8 data."""
    raw.mkdir(parents=True, exist_ok=True)
    (raw / f"{prefix}-images-idx3-ubyte").write_bytes(
        struct.pack(">4i", 0x803, len(images), 28, 28) + images.numpy().tobytes())
    (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">2i", 0x801, len(labels)) + labels.numpy().tobytes())


def striped_digits(n, seed):
    """uint8 images whose class is the row of a bright band, plus noise: learnable, unlike MNIST-sized noise."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g, dtype=torch.uint8)
    images = torch.randint(0, 60, (n, 28, 28), generator=g, dtype=torch.uint8)
    for i, c in enumerate(labels.tolist()):
        images[i, 2 + 2 * c:6 + 2 * c, 4:24] = 255
    return images, labels


def test_mnist_files_and_bf16(launch, script, metrics, tmp_path):
    """--dataset mnist reads IDX files written here through torchvision's MNIST, with no network;
    --amp bf16 trains on CPU and really runs in bf16 (its test loss differs from fp32's)."""
    raw = tmp_path / "data" / "MNIST" / "raw"
    train_images, train_labels = striped_digits(640, seed=1)
    test_images, test_labels = striped_digits(101, seed=2)
    write_idx(raw, "train", train_images, train_labels)
    write_idx(raw, "t10k", test_images, test_labels)
    result = launch([sys.executable, script("ddp_main.py"), "--device", "cpu", "--nprocs", "2", "--dataset", "mnist",
                     "--data", str(tmp_path / "data"), "-e", "2", "--amp", "bf16", "--metrics", "m.json"],
                    timeout=TIMEOUT, env=offline_env())
    m = metrics(tmp_path / "m.json")
    assert "MNIST download failed" not in result.stdout and f"MNIST from {tmp_path / 'data'}" in result.stdout
    assert (m["dataset"], m["train_samples"], m["test_samples"], m["amp"]) == ("mnist", 640, 101, "bf16")
    assert m["test_accuracy"] > 0.9, m  # images and labels were read in step
    checkpoint, model = load_checkpoint(tmp_path / "ddp_checkpoint.pt")
    assert checkpoint["args"]["amp"] == "bf16" and checkpoint["args"]["dataset"] == "mnist"
    normalized = ((test_images.float() / 255 - 0.1307) / 0.3081).unsqueeze(1)  # the script's transform
    correct, fp32_loss = evaluate_here(model, normalized, test_labels.long())
    assert abs(round(m["test_accuracy"] * 101) - correct) <= 2
    assert m["test_loss"] != fp32_loss and m["test_loss"] == pytest.approx(fp32_loss, rel=0.1, abs=0.01)


def test_mnist_missing_is_a_clear_error(launch, script, tmp_path):
    """No MNIST and no network: --dataset mnist fails fast with one error line naming the fix."""
    result = launch([sys.executable, script("ddp_main_torchrun.py"), "--device", "cpu", "--dataset", "mnist",
                     "--data", str(tmp_path / "nothing")], timeout=TIMEOUT, env=offline_env(), check=False)
    assert result.returncode == 2, result
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--dataset synthetic" in errors[0], result
    assert "Traceback" not in result.stderr, result
