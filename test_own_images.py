"""The ConvNet (ddp_main.py, ddp_main_torchrun.py) on the user's own images (issue 23).

An image folder the tests write themselves with PIL: DIR/train/<class>/*.png and DIR/test/<class>/*.png.
Default tier: one launch of 2 spawned processes (exact test count, accuracy above chance, replicas in
sync, the checkpoint reloads and reproduces the result here), and in-process checks of the layout
validation (each bad layout is one error line, exit 2), of a typed --data that holds nothing, of the
model's shapes, of a cut folder keeping every class, and of --amp auto's one rule; hostile folders (issue 42:
FIFOs, links, pixel bombs, files swapped after the check) refused in one line each. Slow tier: a typed
--data that holds nothing ends a real launch with exit 2, 32 x 32 IDX files train, and the attacks in real runs.
"""
import argparse
import contextlib
import io
import math
import random
import re
import os
import shutil
import struct
import subprocess
import sys
import time
import zlib

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import ddp_main
from conftest import cpu_env, kill_group, run_doc_snippet
from ddp_main import ConvNet

COLOURS = {"blue": (50, 60, 210), "green": (40, 180, 60), "red": (200, 40, 40)}  # sorted: ImageFolder's order
TRAIN, TEST = [80, 80, 80], [31, 33, 35]  # 99 test images: 2 ranks do not divide them, a padding sampler shows
TIMEOUT = 240  # generous: the machine may be shared


def patch_image(rng, colour, size=32):
    """Noise with a square patch of about `colour` somewhere in it: its class is the patch's colour."""
    noise = torch.randint(0, 160, (size, size, 3), generator=torch.Generator().manual_seed(rng.randrange(2**31)))
    image = Image.fromarray(noise.to(torch.uint8).numpy(), "RGB")
    side = rng.randrange(8, 16)
    x, y = rng.randrange(0, size - side), rng.randrange(0, size - side)
    image.paste(tuple(min(255, max(0, c + rng.randrange(-30, 30))) for c in colour), (x, y, x + side, y + side))
    return image


def write_folder(root, counts, seed=0, make=None):
    """root/<split>/<class>/<i>.png for {split: [images per class]}; returns {split: [(path, label)]}."""
    rng, written = random.Random(seed), {}
    for split, per_class in counts.items():
        written[split] = []
        for label, ((name, colour), n) in enumerate(zip(COLOURS.items(), per_class)):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                path = folder / f"{i}.png"
                (make(rng, label) if make else patch_image(rng, colour)).save(path)
                written[split].append((path, label))
    return written


def as_tensors(files):
    """Images (N, C, H, W) in [0, 1] and their labels, read here with PIL, independently of the script."""
    images = torch.stack([torch.from_numpy(np.array(Image.open(p))) for p, _ in files]).double() / 255
    return images.permute(0, 3, 1, 2), torch.tensor([label for _, label in files])


def test_image_folder_at_two_processes(launch, script, metrics, tmp_path, capsys, monkeypatch):
    """ddp_main.py --data FOLDER at 2 processes: what was found is named, every test image is counted
    once, the colours are learnt, the replicas agree, and the checkpoint reproduces the test result here."""
    files = write_folder(tmp_path / "shapes", {"train": TRAIN, "test": TEST})
    r = launch([sys.executable, script("ddp_main.py"), "--device", "cpu", "--nprocs", "2", "--data", "shapes",
                "--amp", "off", "-e", "5", "-b", "16", "--metrics", "m.json", "--timeout", "60"],
               timeout=TIMEOUT, env=cpu_env())
    m = metrics(tmp_path / "m.json")
    assert "data: image folder of 3 classes, 3 x 32 x 32 from shapes | 240 train, 99 test samples" in r.stdout, r
    assert "MNIST" not in r.stdout and "SYNTHETIC" not in r.stdout, r.stdout
    assert (m["dataset"], m["data"], m["classes"], m["image_shape"]) == (
        "images", "image folder of 3 classes, 3 x 32 x 32", 3, [3, 32, 32]), m
    assert (m["world_size"], m["train_samples"], m["test_samples"]) == (2, 240, 99), m
    assert m["steps_per_epoch"] == math.ceil(240 / 2 / 16) and m["replicas_in_sync"] is True, m
    assert r.stdout.count("test: 99 samples") == 1 and m["final_loss"] < m["first_loss"], r.stdout
    assert m["test_accuracy"] > 0.8, m  # chance is 1/3

    # the checkpoint, evaluated here on images read here, normalised by the training split's statistics
    train_images, _ = as_tensors(files["train"])
    mean, std = train_images.mean(dim=(0, 2, 3)), train_images.std(dim=(0, 2, 3))
    assert f"mean {'/'.join(f'{v:.4f}' for v in mean)}, std {'/'.join(f'{v:.4f}' for v in std)}" in r.stdout
    checkpoint = torch.load(tmp_path / "ddp_checkpoint.pt", map_location="cpu", weights_only=True)
    model = ConvNet(3, channels=3).double().eval()
    model.load_state_dict(checkpoint["model"])
    images, labels = as_tensors(files["test"])
    with torch.no_grad():
        outputs = model((images - mean[:, None, None]) / std[:, None, None])
    assert round(m["test_accuracy"] * 99) == int((outputs.argmax(1) == labels).sum())
    assert m["test_loss"] == pytest.approx(F.cross_entropy(outputs, labels).item(), rel=1e-3, abs=1e-5)

    # issue 32: the classes named, a per-class result, and a checkpoint that describes itself
    assert "| 240 train, 99 test samples | classes: blue, green, red | normalised: " in r.stdout, r.stdout
    per_class = re.search(r"^per class: blue [\d.]+% \((\d+)/31\), green [\d.]+% \((\d+)/33\), "
                          r"red [\d.]+% \((\d+)/35\)$", r.stdout, flags=re.MULTILINE)
    assert per_class and sum(map(int, per_class.groups())) == round(m["test_accuracy"] * 99), r.stdout
    card = checkpoint["data"]
    assert (card["kind"], card["classes"], card["shape"]) == ("images", ["blue", "green", "red"], [3, 32, 32])
    assert card["mean"] == pytest.approx(mean.tolist(), abs=1e-6) and card["std"] == pytest.approx(std.tolist(), abs=1e-6)

    # --predict on 5 new images: their class names, as the model computed here says; the docs' snippet agrees
    new = write_folder(tmp_path / "new", {"x": [2, 2, 1]}, seed=7)["x"]
    paths = [str(path.relative_to(tmp_path)) for path, _ in new]
    p = launch([sys.executable, script("ddp_main.py"), "--predict", *paths], timeout=TIMEOUT, env=cpu_env())
    predicted = re.findall(r"^(\S+) -> (\w+) \(([\d.]+)\)$", p.stdout, flags=re.MULTILINE)
    names = [list(COLOURS)[label] for _, label in new]
    images, _ = as_tensors(new)
    with torch.no_grad():
        expected = model((images - mean[:, None, None]) / std[:, None, None]).softmax(dim=1)
    assert [(path, name) for path, name, _ in predicted] == list(zip(paths, names)), p
    assert [float(prob) for *_, prob in predicted] == pytest.approx(expected.max(dim=1).values.tolist(), abs=2e-3)
    assert p.stderr == "" and "world" not in p.stdout, p  # one process: no process group, nothing else said
    pasted = run_doc_snippet("own_images.md", "# predict.py", paths, tmp_path, capsys, monkeypatch)
    assert pasted == p.stdout, (pasted, p.stdout)


# ---------------------------------------------------------------- the layout, checked before training
def check(root, capsys, max_pixels=ddp_main.MAX_PIXELS):
    """ddp_main.check_data on --data root: (the image folder found, None) or (None, its one error line)."""
    args = argparse.Namespace(dataset="auto", data=str(root), max_pixels=max_pixels)
    try:
        ddp_main.check_data(args)
    except SystemExit as e:
        assert e.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and lines[0].endswith(")"), lines
        return None, lines[0]
    return args.image_folder, None


def test_layout_checks(tmp_path, capsys):
    """Each bad layout is one error line naming what is wrong; val/ stands for test/; grey images are 1 channel."""
    tiny = {"train": [2, 2, 2], "test": [1, 1, 1]}
    write_folder(tmp_path / "ok", tiny, make=lambda rng, label: Image.new("L", (9, 7), 40 * label))
    found, _ = check(tmp_path / "ok", capsys)
    assert (found["classes"], found["shape"], found["name"]) == (
        ["blue", "green", "red"], [1, 7, 9], "image folder of 3 classes, 1 x 7 x 9")

    write_folder(tmp_path / "val", {"train": [2, 2, 2], "val": [1, 1, 0]}, make=lambda rng, label: Image.new("RGB", (8, 8)))
    (tmp_path / "val" / "val" / "red").rmdir()
    found, _ = check(tmp_path / "val", capsys)
    assert found["test"].endswith("val") and found["shape"] == [3, 8, 8]  # a class without test images is fine

    bad = {  # the folder's name: (what is written into it, what the error line must say)
        "sizes": (lambda rng, label: Image.new("RGB", (8, 8 + (label == 2))), "differ in size or mode"),
        "modes": (lambda rng, label: Image.new("RGB" if label else "L", (8, 8)), "differ in size or mode"),
        "palette": (lambda rng, label: Image.new("P", (8, 8)), "convert them to L, RGB or RGBA"),
    }
    for name, (make, says) in bad.items():
        write_folder(tmp_path / name, tiny, make=make)
        assert says in check(tmp_path / name, capsys)[1]

    write_folder(tmp_path / "empty", {"train": [2, 0, 2], "test": [1, 0, 1]}, make=lambda rng, label: Image.new("L", (8, 8)))
    assert "empty class folder(s): " + str(tmp_path / "empty" / "train" / "green") in check(tmp_path / "empty", capsys)[1]
    write_folder(tmp_path / "extra", tiny, make=lambda rng, label: Image.new("L", (8, 8)))
    (tmp_path / "extra" / "train" / "red").rename(tmp_path / "red")
    assert "has classes the training split lacks: red" in check(tmp_path / "extra", capsys)[1]
    (tmp_path / "notest" / "train" / "a").mkdir(parents=True)
    assert "has train/ but no test/ or val/" in check(tmp_path / "notest", capsys)[1]
    (tmp_path / "ok" / "train" / "red" / "0.png").write_bytes(b"not a png")
    assert "cannot read the image" in check(tmp_path / "ok", capsys)[1]


def test_a_bad_image_is_named_before_training_and_a_missing_test_class_said(tmp_path, capsys):
    """Every image is decoded before training (issue 32): a truncated PNG in train or test is one error line
    naming it, where only the headers were read before (and training crashed on it in epoch 1, or, in the
    test split, after the last epoch). A class without test images is one note. Past the bound, the files
    not decoded are decoded as training reads them, and a bad one is one line naming it then."""
    write_folder(tmp_path / "f", {"train": [3, 3, 3], "test": [2, 2, 2]})
    for bad in (tmp_path / "f" / "train" / "green" / "1.png", tmp_path / "f" / "test" / "red" / "0.png"):
        whole = bad.read_bytes()
        bad.write_bytes(whole[:len(whole) // 2])  # the header and half the pixels
        error = check(tmp_path / "f", capsys)[1]
        assert f"cannot read the image {bad} (OSError: image file is truncated" in error, error
        bad.write_bytes(whole)
    for image in (tmp_path / "f" / "test" / "red").iterdir():
        image.unlink()
    (tmp_path / "f" / "test" / "red").rmdir()
    found, _ = check(tmp_path / "f", capsys)
    assert found["classes"] == ["blue", "green", "red"]
    assert capsys.readouterr().out == (f"note: {tmp_path / 'f' / 'test'} has no images of red (1 class of 3): "
                                       "the test accuracy leaves them out\n")

    files = sorted(str(path) for path in (tmp_path / "f" / "train").rglob("*.png"))
    Path(files[1]).write_bytes(Path(files[1]).read_bytes()[:300])
    root = os.path.realpath(tmp_path)
    assert ddp_main.image_format(files, root, ddp_main.MAX_PIXELS, most=5) == ("RGB", (32, 32))  # 0, 2, 4, 6, 8 decoded
    assert capsys.readouterr().out == ("note: 9 images: 5 of them (evenly spread) decoded before training, "
                                       "the others as training reads them\n")
    with pytest.raises(ddp_main.ImageRefused) as refused:  # main() makes it the error line
        ddp_main.read_image(files[1], ("RGB", (32, 32)))
    assert refused.value.args == (f"cannot read the image {files[1]} (OSError: image file is truncated)",
                                  "remove or replace it"), refused.value.args


def test_predict_and_the_data_path_say_what_is_wrong_in_one_line(tmp_path, capsys, monkeypatch):
    """--predict with a checkpoint written before checkpoints carried their data card, an image of another
    size, a checkpoint of the synthetic stand-in: one line each. A mistyped --data beside another run's
    checkpoint is named first (it used to be the checkpoint's line, and the typo only on the second try)."""
    monkeypatch.chdir(tmp_path)
    Image.new("L", (32, 32)).save("grey.png")
    card = {"kind": "images", "classes": ["a", "b", "c"], "mean": [0.5] * 3, "std": [0.25] * 3, "shape": [3, 32, 32]}
    weights = ConvNet(3, channels=3).state_dict()
    cases = {"old.pt": ({"model": weights, "epoch": 5, "args": {}}, "old.pt does not hold its classes, mean, std, shape"),
             "new.pt": ({"model": weights, "data": card}, "grey.png is L 32 x 32, the model takes RGB 32 x 32"),
             "syn.pt": ({"model": weights, "data": {**card, "kind": "synthetic"}}, "trained on the synthetic stand-in"),
             "bad.pt": ({"model": weights, "data": {**card, "std": [0.25]}}, "malformed data card (shape [3, 32, 32], "
                                                                           "3 classes, 3 means, 1 stds)")}
    for name, (state, says) in cases.items():
        torch.save(state, name)
        with pytest.raises(SystemExit) as exited:
            ddp_main.check_args(ddp_main.parse_args(["--predict", "grey.png", "--checkpoint", name]))
        lines = capsys.readouterr().err.splitlines()
        assert exited.value.code == 2 and len(lines) == 1 and says in lines[0], lines

    torch.save({"model": weights, "epoch": 5, "args": {}}, "ddp_checkpoint.pt")
    with pytest.raises(SystemExit):
        ddp_main.check_args(ddp_main.parse_args(["--device", "cpu", "--data", "colour"]))
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --data colour holds no data"), lines


def test_a_checkpoints_class_names_are_shown_not_obeyed(tmp_path, capsys, monkeypatch):
    """--predict prints class names from the checkpoint: a newline or a terminal escape in one (issue 42: a
    forged line, a recoloured screen) is printed escaped, on the one line of its file."""
    monkeypatch.chdir(tmp_path)
    Image.new("RGB", (32, 32)).save("rgb.png")
    classes = ["cat\nerror: forged", "\x1b[2Jdog", "\u202eeert"]
    card = {"kind": "images", "classes": classes, "mean": [0.5] * 3, "std": [0.25] * 3, "shape": [3, 32, 32]}
    torch.save({"model": ConvNet(3, channels=3).state_dict(), "data": card}, "ck.pt")
    with pytest.raises(SystemExit) as exited:
        ddp_main.check_args(ddp_main.parse_args(["--predict", "rgb.png", "--checkpoint", "ck.pt"]))
    out = capsys.readouterr().out
    assert exited.value.code == 0 and len(out.splitlines()) == 1 and "\x1b" not in out and "\u202e" not in out, out
    assert out.startswith("rgb.png -> ") and any(ascii(c)[1:-1] in out for c in classes), out


def test_a_typed_path_is_never_replaced_by_the_stand_in(tmp_path, capsys, monkeypatch):
    """--data that holds nothing (a typo, an empty folder) is an error; only the default folder may be absent."""
    (tmp_path / "empty").mkdir()
    for typed in (tmp_path / "idxx", tmp_path / "empty"):
        found, error = check(typed, capsys)
        assert f"--data {typed} holds no data" in error and "--dataset synthetic" in error, error
        assert not (tmp_path / "idxx").exists()  # nothing created, nothing downloaded
    monkeypatch.chdir(tmp_path)  # no ./data here: the default folder is absent, the fallback stays
    args = argparse.Namespace(dataset="auto", data=None)
    ddp_main.check_data(args)
    assert args.image_folder is None and capsys.readouterr().err == ""


def test_convnet_shapes_and_old_checkpoints():
    """28 x 28: the adaptive pooling is the identity and the parameters are the seed's (an old
    checkpoint loads); other sizes and channels run through the same linear layer."""
    torch.manual_seed(0)
    model = ConvNet().eval()
    assert {name for name in model.state_dict()} == {
        f"{layer}.{i}.{p}" for layer in ("layer1", "layer2") for i, p in
        [(0, "weight"), (0, "bias"), (1, "weight"), (1, "bias"), (1, "running_mean"), (1, "running_var"),
         (1, "num_batches_tracked")]} | {"fc.weight", "fc.bias"}
    assert model.fc.weight.shape == (10, 7 * 7 * 32)
    x = torch.randn(4, 1, 28, 28)
    with torch.no_grad():
        seed_forward = model.fc(model.layer2(model.layer1(x)).reshape(4, -1))  # the fixed-size model
        assert torch.equal(model(x), seed_forward)
        assert ConvNet(3, channels=3)(torch.randn(2, 3, 32, 32)).shape == (2, 3)
        assert ConvNet(5, channels=4)(torch.randn(2, 4, 4, 5)).shape == (2, 5)


# ---------------------------------------------------------------- slow: real launches
@pytest.mark.slow
def test_typed_path_that_holds_nothing_is_exit_2(launch, script, tmp_path):
    """ddp_main.py --data mydata/idxx (a typo): one error line, exit 2, nothing created or trained."""
    (tmp_path / "mydata" / "idx").mkdir(parents=True)
    r = launch([sys.executable, script("ddp_main.py"), "--device", "cpu", "--data", "mydata/idxx"],
               timeout=TIMEOUT, env=cpu_env(), check=False)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "--data mydata/idxx holds no data" in errors[0], r
    assert "Traceback" not in r.stderr and "SYNTHETIC" not in r.stdout and not (tmp_path / "mydata" / "idxx").exists()


@pytest.mark.slow
def test_idx_files_of_32_by_32(launch, script, metrics, tmp_path):
    """IDX files in MNIST's layout with 32 x 32 images and 4 classes train (a traceback before issue 23),
    and are named for what they are, not MNIST."""
    def write(prefix, n, seed):
        g = torch.Generator().manual_seed(seed)
        labels = torch.randint(0, 4, (n,), generator=g, dtype=torch.uint8)
        images = torch.randint(0, 60, (n, 32, 32), generator=g, dtype=torch.uint8)
        for i, c in enumerate(labels.tolist()):
            images[i, 4 + 6 * c:8 + 6 * c, 4:28] = 255  # the class is the row of a bright band
        raw = tmp_path / "idx" / "MNIST" / "raw"
        raw.mkdir(parents=True, exist_ok=True)
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">4i", 0x803, n, 32, 32) + images.numpy().tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">2i", 0x801, n) + labels.numpy().tobytes())
    write("train", 256, 1)
    write("t10k", 101, 2)
    r = launch([sys.executable, script("ddp_main_torchrun.py"), "--device", "cpu", "--data", "idx", "-e", "3",
                "--metrics", "m.json"], timeout=TIMEOUT, env=cpu_env())
    m = metrics(tmp_path / "m.json")
    assert "data: IDX files of 4 classes, 1 x 32 x 32 from idx | 256 train, 101 test samples" in r.stdout, r
    assert (m["dataset"], m["classes"], m["image_shape"], m["test_samples"]) == ("idx", 4, [1, 32, 32], 101), m
    assert m["test_accuracy"] > 0.7, m  # chance is 1/4


def test_amp_auto_is_one_rule_in_every_script():
    """--amp auto: fp32 on CPUs in the ConvNet and the Transformer alike (each once chose differently on a
    CPU with native bf16), and both --help texts state the same rule."""
    import ddp_main_torchrun
    import ddp_transformer
    cpu = torch.device("cpu")
    assert ddp_main.amp_choice("auto", cpu) == ddp_main_torchrun.amp_choice("auto", cpu) == "off"
    assert ddp_transformer.resolve_amp("auto", cpu) == "off"
    assert ddp_main.amp_choice("bf16", cpu) == ddp_transformer.resolve_amp("bf16", cpu) == "bf16"  # asked: done
    rule = "auto (the same rule in every script of the collection): bf16 on a GPU that computes it natively"
    for module in (ddp_main, ddp_main_torchrun, ddp_transformer):
        assert rule in help_of(module), module.__name__


def help_of(module):
    """The script's --help, as one line (argparse wraps it)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        module.parse_args(["--help"])
    return " ".join(out.getvalue().split())


def test_a_cut_image_folder_keeps_every_class(tmp_path, capsys):
    """--train_samples / --test_samples on an image folder (listed class by class) spread over the classes."""
    write_folder(tmp_path / "f", {"train": [4, 4, 4], "test": [2, 2, 2]}, make=lambda rng, label: Image.new("L", (8, 8)))
    found, _ = check(tmp_path / "f", capsys)
    args = argparse.Namespace(dataset="auto", data=str(tmp_path / "f"), image_folder=found, seed=0,
                              train_samples=3, test_samples=3)
    (train, test), info = ddp_main.load_datasets(args)
    assert sorted(label for _, label in train) == sorted(label for _, label in test) == [0, 1, 2]
    assert train[0][0].shape == (1, 8, 8) and info["name"] == "image folder of 3 classes, 1 x 8 x 8"
    assert "| 3 train, 3 test samples |" in capsys.readouterr().out


# ---------------------------------------------------------------- slow: after training (issue 32)
@pytest.mark.slow
def test_a_truncated_image_ends_a_real_launch_before_the_first_epoch(launch, script, tmp_path):
    """A truncated PNG in train, then in test: exit 2, one error line naming it, no epoch trained. (It
    used to be a traceback per rank in epoch 1, or, in the test split, after every epoch had trained.)"""
    write_folder(tmp_path / "f", {"train": [8, 8, 8], "test": [2, 2, 2]})
    for bad in (tmp_path / "f" / "train" / "red" / "3.png", tmp_path / "f" / "test" / "blue" / "1.png"):
        whole = bad.read_bytes()
        bad.write_bytes(whole[:len(whole) // 2])
        r = launch([sys.executable, script("ddp_main.py"), "--device", "cpu", "--nprocs", "2", "--data", "f"],
                   timeout=TIMEOUT, env=cpu_env(), check=False)
        errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert r.returncode == 2 and errors == [f"error: cannot read the image {bad.relative_to(tmp_path)} "
                                                "(OSError: image file is truncated) (remove or replace it)"], r
        assert "epoch" not in r.stdout and "Traceback" not in r.stderr, r
        bad.write_bytes(whole)


@pytest.mark.slow
def test_evaluate_names_the_epoch_and_each_class_and_old_checkpoints_load(launch, script, tmp_path):
    """--evaluate says the checkpoint's own epoch (not --epochs') and a per-class accuracy; a checkpoint
    without a data card (written before issue 32) still evaluates, --predict says in one line what it
    lacks, and a --resume writes the card; a checkpoint of other class names is refused in one line."""
    write_folder(tmp_path / "f", {"train": [24, 24, 24], "test": [6, 6, 6]})
    command = [sys.executable, script("ddp_main.py"), "--device", "cpu", "--nprocs", "1", "--data", "f", "-b", "8"]
    launch([*command, "-e", "2"], timeout=TIMEOUT, env=cpu_env())
    state = torch.load(tmp_path / "ddp_checkpoint.pt", weights_only=True)
    del state["data"]
    torch.save(state, tmp_path / "ddp_checkpoint.pt")  # as the checkpoints before issue 32
    r = launch([*command, "--evaluate"], timeout=TIMEOUT, env=cpu_env())
    assert "| evaluating epoch 2\n" in r.stdout and "| images | epoch 2 | not trained |" in r.stdout, r
    assert re.search(r"^per class: blue [\d.]+% \(\d/6\), green [\d.]+% \(\d/6\), red [\d.]+% \(\d/6\)$",
                     r.stdout, flags=re.MULTILINE), r.stdout
    image = str((tmp_path / "f" / "test" / "red" / "0.png").relative_to(tmp_path))
    p = launch([sys.executable, script("ddp_main.py"), "--predict", image], timeout=TIMEOUT, env=cpu_env(), check=False)
    assert p.returncode == 2 and "does not hold its classes, mean, std, shape" in p.stderr, p
    launch([*command, "--resume", "-e", "3"], timeout=TIMEOUT, env=cpu_env())
    p = launch([sys.executable, script("ddp_main.py"), "--predict", image], timeout=TIMEOUT, env=cpu_env())
    assert re.fullmatch(rf"{re.escape(image)} -> (blue|green|red) \([\d.]+\)\n", p.stdout), p
    (tmp_path / "f" / "train" / "red").rename(tmp_path / "f" / "train" / "rose")
    (tmp_path / "f" / "test" / "red").rename(tmp_path / "f" / "test" / "rose")
    r = launch([*command, "--evaluate"], timeout=TIMEOUT, env=cpu_env(), check=False)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "trained on the classes blue, green, red, this data has " \
        "blue, green, rose" in errors[0], r


# ---------------------------------------------------------------- hostile image folders (issue 42, class 5)
def pixel_bomb(side=13000, depth=1):
    """A grey PNG of side x side zeros, `depth` bits each, in a few KB, as an attacker writes it (PIL would decode
    it into side**2 bytes): compressed row by row, never held whole here."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    deflate, row = zlib.compressobj(9), bytes(1 + (side * depth + 7) // 8)  # each row: filter 0, then the bits
    pixels = b"".join(deflate.compress(row) for _ in range(side)) + deflate.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">2I5B", side, side, depth, 0, 0, 0, 0))
            + chunk(b"IDAT", pixels) + chunk(b"IEND", b""))


def grey_folder(root):
    """A small folder of 8 x 8 grey images, and an 8 x 8 grey image outside it (what a link out would read)."""
    write_folder(root, {"train": [2, 2, 2], "test": [1, 1, 1]},
                 make=lambda rng, label: Image.new("L", (8, 8), 40 * label))
    Image.new("L", (8, 8), 255).save(root.parent / "outside.png")
    return root


def test_fifos_links_and_pixel_bombs_are_refused_before_any_process_starts(tmp_path, capsys, monkeypatch):
    """The attacks of issue 42 (a FIFO hung the run; 13,000 x 13,000 PNGs of a few KB took gigabytes; a link out
    of --data was read), each planted in a fresh folder, and an EPS named .png (PIL would run Ghostscript on it):
    one error line at the folder's check, in well under a second, and no image larger than the folder's 8 x 8
    decoded (the bound is read from the header)."""
    from PIL import ImageFile
    decoded, load = [], ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda image: decoded.append(image.size) or load(image))
    opened, os_open = [], os.open  # what the check opens, resolved: nothing outside the folder checked
    monkeypatch.setattr(os, "open", lambda path, *rest: opened.append(os.path.realpath(path)) or os_open(path, *rest))
    (tmp_path / "elsewhere").mkdir()
    plants = {  # what the attacker puts at train/red/0.png (or beside it), and what the line says
        "fifo": (lambda path: os.mkfifo(path), "is not a regular file (a FIFO"),
        "bomb": (lambda path: path.write_bytes(pixel_bomb()), "is 13000 x 13000, more than --max_pixels 50000000 "
                 "pixels (shrink it, or pass a larger --max_pixels)"),
        "eps": (lambda path: path.write_bytes(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n"),  # Ghostscript's
                "(UnidentifiedImageError: not PNG/JPEG/PPM/BMP/TIFF/WEBP)"),
        "link out": (lambda path: path.symlink_to(tmp_path / "outside.png"), "is a symbolic link out of --data"),
        "link in": (lambda path: path.symlink_to(path.parent / "1.png"), "is a symbolic link (put the file"),
        "folder link": (lambda path: (path.parent / "loop").symlink_to(".."),
                        "red/loop is a symbolic link to a folder"),
        "class link": (lambda path: (path.parent.parent / "grey").symlink_to(tmp_path / "elsewhere"),
                       "train/grey is a symbolic link to a folder"),
    }
    grey_folder(tmp_path / "ok")
    for name, (plant, says) in plants.items():
        folder = tmp_path / name.replace(" ", "_")
        shutil.copytree(tmp_path / "ok", folder, symlinks=True)
        (folder / "train" / "red" / "0.png").unlink()
        plant(folder / "train" / "red" / "0.png")
        start = time.perf_counter()
        found, error = check(folder, capsys)
        assert error and says in error and time.perf_counter() - start < 5, (name, error)
        assert all(path.startswith(str(folder.resolve()) + os.sep) for path in opened), (name, opened)
        opened.clear()
    assert decoded and set(decoded) == {(8, 8)}, decoded
    (tmp_path / "split").mkdir()  # the split folder itself a link (to the images of another folder)
    (tmp_path / "split" / "train").symlink_to(tmp_path / "ok" / "train")
    shutil.copytree(tmp_path / "ok" / "test", tmp_path / "split" / "test")
    assert "split/train is a symbolic link to a folder" in check(tmp_path / "split", capsys)[1]
    assert "is 8 x 8, more than --max_pixels 63 pixels" in check(tmp_path / "ok", capsys, max_pixels=63)[1]
    assert check(tmp_path / "ok", capsys, max_pixels=64)[0]["shape"] == [1, 8, 8]
    with pytest.raises(SystemExit):
        ddp_main.check_args(ddp_main.parse_args(["--max_pixels", "0"]))
    assert capsys.readouterr().err == "error: --max_pixels must be positive, got 0 (pass a --max_pixels above 0)\n"


def test_an_image_swapped_after_the_check_is_refused_as_training_reads_it(tmp_path, capsys):
    """Training reads the files the check listed, each opened again: one swapped since for a FIFO, a link out of
    --data or a pixel bomb, or reached through a class folder swapped for a link out, is refused on opening or on
    its header (no larger than the checked 8 x 8), in this process and through a DataLoader worker alike, where
    the worker's exception reaches the training process with its (what, fix) intact, a newline in the name too."""
    folder = grey_folder(tmp_path / "f")
    red, forged = folder / "train" / "red", folder / "train" / "red" / "x\nerror: forged.png"
    Image.new("L", (8, 8)).save(forged, format="PNG")
    train = check(folder, capsys)[0]["sets"][0]
    index = [path for path, _ in train.samples].index(str(forged))

    def class_folder_swapped(path):  # train/red renamed away, a link to a folder outside in its place
        shutil.copytree(red, tmp_path / "red")
        red.rename(tmp_path / "moved")
        red.symlink_to(tmp_path / "red")
        shutil.copy(tmp_path / "outside.png", path)

    swaps = [(os.mkfifo, "is not a regular file (a FIFO, device or socket)"),
             (lambda path: path.symlink_to(tmp_path / "outside.png"), "is a symbolic link out of --data"),
             (lambda path: path.write_bytes(pixel_bomb()), "is 1 13000 x 13000, the model takes L 8 x 8"),
             (class_folder_swapped, "is a symbolic link out of --data")]
    for swap, says in swaps:
        forged.unlink()
        swap(forged)
        with pytest.raises(ddp_main.ImageRefused) as refused:
            train[index]
        assert refused.value.args[0] in (f"the image {forged} {says}", f"{forged} {says}"), refused.value.args
    red.unlink()
    (tmp_path / "moved").rename(red)
    os.mkfifo(forged)
    with pytest.raises(ddp_main.ImageRefused) as refused:
        next(iter(torch.utils.data.DataLoader(train, batch_size=len(train), num_workers=1)))
    assert refused.value.args == (f"the image {forged} is not a regular file (a FIFO, device or socket)",
                                  "remove or replace it"), refused.value.args


@pytest.mark.slow
def test_the_attackers_pixel_bombs_end_a_real_launch_at_the_check(launch, script, tmp_path):
    """Three 13,000 x 13,000 PNGs among the images (8-bit grey, 164 KB each, as in the report of issue 42): a
    run took 6 GB in 37 s, still growing, past PIL's warning; now the check refuses the first one by its
    header, before any process starts: one line, exit 2, the memory of a start-up."""
    folder = grey_folder(tmp_path / "f")
    bomb = pixel_bomb(depth=8)  # as the attacker's: 169 MB decoded
    for path in ("train/red/0.png", "train/blue/0.png", "test/red/0.png"):
        (folder / path).write_bytes(bomb)
    peak = "import resource, subprocess, sys; code = subprocess.call(sys.argv[1:]); " \
           "print('peak', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(code)"
    r = launch([sys.executable, "-c", peak, sys.executable, script("ddp_main.py"), "--device", "cpu", "--data", "f"],
               timeout=60, env=cpu_env(), check=False)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and errors == ["error: the image f/train/blue/0.png is 13000 x 13000, more than --max_"
                                            "pixels 50000000 pixels (shrink it, or pass a larger --max_pixels)"], r
    assert "Traceback" not in r.stderr and "Warning" not in r.stderr and "world" not in r.stdout, r
    assert int(r.stderr.split("peak ")[1]) < 1_500_000, r.stderr  # KiB: torch's start-up, no image decoded


@pytest.mark.slow
def test_an_image_swapped_for_a_fifo_during_a_run_is_one_line(script, tmp_path):
    """A test image swapped for a FIFO once the check has passed (the data line is out; the test split is read
    after training): read by a DataLoader worker, refused on opening, one error line from the training process,
    exit 2, no traceback, no hang."""
    folder = grey_folder(tmp_path / "f")
    proc = subprocess.Popen([sys.executable, script("ddp_main.py"), "--device", "cpu", "--nprocs", "1", "--data", "f",
                             "--workers", "1", "-e", "1"], cwd=tmp_path, env=cpu_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        lines = iter(proc.stdout.readline, "")
        assert any(line.startswith("data: ") for line in lines), proc.stderr.read()
        (folder / "test" / "green" / "0.png").unlink()
        os.mkfifo(folder / "test" / "green" / "0.png")
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        kill_group(proc)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and errors == ["error: the image f/test/green/0.png is not a regular file (a FIFO, "
                                               "device or socket) (remove or replace it)"], (out, err)
    assert "Traceback" not in err and "epoch 1/1" in out and "test:" not in out, (out, err)
