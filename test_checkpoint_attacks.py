"""Checkpoints are data and stay in their folder (issue 30): the readers attacked as an attacker would.

Each case: the payload (bytes or a planted file), the line expected (one `error:` line, exit code 2,
or a correct resume where the input is harmless), and a marker file that exists only if the payload
ran, or a file outside the checkpoint folder that must stay untouched. Everything runs in this
process on a real save (torch.distributed.checkpoint writes it here, no process group needed) and
calls the functions a resume calls: fsdp_transformer's read_pointer (through check_args),
read_checkpoint, read_metadata and Run.restore; the harness's load_checkpoint,
atomic_write and continue_checkpoint. The fuzz test mutates the three files a resume reads, seeded;
(slow) a sample of the mutations and the save-side attacks through real launches, and a save killed
at several points.

Issue 52 retired what bounded torch's own reader (docs/faults.md, "What torch's reader does not
bound"): pickle bombs that are slow (memo-nested keys, colliding int keys) in a `.pt` or a
`.metadata`, deflated and two-reader zip files, a `.distcp` record of a class torch's weights_only
allowlist admits, a file swapped between its check and its read, a save folder on another mount.
"""
import contextlib
import errno
import io
import json
import os
import pickle
import random
import shutil
import signal
import struct
import subprocess
import sys
import time
import tracemalloc
import warnings
import zipfile

import pytest
import torch

from conftest import ROOT, cpu_env, kill_group, run_bounded, torchrun_cmd

sys.path.insert(0, str(ROOT))
import ddp_gpus  # noqa: E402
import ddp_gpus_torchrun  # noqa: E402
import ddp_main  # noqa: E402
import ddp_transformer  # noqa: E402
import fsdp_transformer as fsdp  # noqa: E402

import torch.distributed.checkpoint as dcp  # noqa: E402  (after the scripts: the floor's import order)
from torch.distributed.checkpoint.filesystem import FileSystemWriter  # noqa: E402

TINY = ["--device", "cpu", "--d_model", "16", "--num_heads", "2", "--num_layers", "1", "--block_size", "16",
        "--sample", "0"]
TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(60))  # 3,000 characters
MD = "torch.distributed.checkpoint.metadata"


# ---------------------------------------------------------------- a real save, made in this process
def write_save(root, data, step=4):
    """A checkpoint folder as fsdp_transformer.py writes it: `step-N` (the model's and AdamW's tensors,
    by DCP, no process group) and the pointer, of the tiny model on `data`."""
    args = fsdp.fill_defaults(fsdp.parse_args([*TINY, "--data", str(data), "--checkpoint", str(root)]))
    text, _, vocab = fsdp.read_corpus(args)
    config = fsdp.model_config(args, vocab)
    torch.manual_seed(0)
    trainer = fsdp.Run.__new__(fsdp.Run)  # the Run's own save and load code, without FSDP
    trainer.model = fsdp.Transformer(**config)
    trainer.optimizer = fsdp.make_optimizer(trainer.model, args)
    folder = f"step-{step:08d}"
    dcp.save(trainer.tensors()[0], storage_writer=FileSystemWriter(str(root / folder)))
    pointer = {"config": config, "vocab": vocab, "text": fsdp.text_fingerprint(text), "epoch": 0, "step": step,
               "windows_in_epoch": 32, "global_batch": 8, "batch_size": 8, "folder": folder, "job": None,
               "world_size": 1}
    (root / "latest.json").write_text(json.dumps(pointer))
    return pointer


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    where = tmp_path_factory.mktemp("pristine")
    (where / "text.txt").write_text(TEXT)
    write_save(where / "ck", where / "text.txt")
    return where


@pytest.fixture
def ck(pristine, tmp_path, monkeypatch):
    """A fresh copy of the save in tmp_path/ck, the text in tmp_path/text.txt, and a marker path."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"):
        monkeypatch.delenv(name, raising=False)
    shutil.copytree(pristine / "ck", tmp_path / "ck")
    shutil.copy(pristine / "text.txt", tmp_path / "text.txt")
    monkeypatch.chdir(tmp_path)
    return tmp_path / "ck"


def resume(ck, *extra):
    """What `fsdp_transformer.py --resume` does with the checkpoint before training: check_args (which
    reads the pointer), read_checkpoint (the pointer's values, .metadata, the files it names) and the
    Run's restore (DCP reads the tensors through SafeReader). Returns the state it resumed."""
    args = fsdp.check_args(fsdp.parse_args([*TINY, "--data", str(ck.parent / "text.txt"), "--checkpoint", str(ck),
                                            "--resume", *extra]))
    corpus = fsdp.read_corpus(args)
    state = fsdp.read_checkpoint(args, corpus)
    trainer = fsdp.Run.__new__(fsdp.Run)
    trainer.args = args
    trainer.model = fsdp.Transformer(**fsdp.model_config(args, corpus[2]))
    trainer.optimizer = fsdp.make_optimizer(trainer.model, args)
    trainer.restore(state)
    return state


def refused(call, capsys, *words):
    """`call` ends with exactly one `error:` line on stderr and exit code 2, containing `words`."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        call()
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert all(w in err[0] for w in words), err
    return err[0]


def su(text):
    """SHORT_BINUNICODE: a string of up to 255 bytes."""
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) + data


def stack_global(module, name):
    return su(module) + su(name) + b"\x93"


def metadata_path(ck):
    return ck / json.loads((ck / "latest.json").read_text())["folder"] / ".metadata"


def rewritten(ck, change):
    """The save's metadata loaded (as trusted here), changed by `change(metadata)`, pickled back."""
    path = metadata_path(ck)
    metadata = pickle.loads(path.read_bytes())
    change(metadata)
    path.write_bytes(pickle.dumps(metadata))


def first(mapping):
    return next(iter(mapping))


# ---------------------------------------------------------------- the harmless input resumes
def test_the_save_resumes_and_a_resumed_save_keeps_the_committed_folder(ck, capsys):
    state = resume(ck)
    assert state["step"] == 4 and state["folder"] == "step-00000004"
    # a resumed run saving at its first step writes beside the save the pointer names, never over it
    assert fsdp.save_folder(str(ck), 4, "step-00000004") == "step-00000004-1"
    assert fsdp.save_folder(str(ck), 5, "step-00000004") == "step-00000005"
    assert (ck / "step-00000004" / ".metadata").exists()


# ---------------------------------------------------------------- .metadata: code
CODE_PAYLOADS = {
    # the critical case: a dotted name resolved through the admitted module's own `import os`
    "dotted name through an admitted module": lambda m: b"\x80\x04" + stack_global(MD, "os.system")
    + su(f"touch {m}") + b"\x85R.",
    "posix.system by its own name": lambda m: b"\x80\x04" + stack_global("posix", "system") + su(f"touch {m}") + b"\x85R.",
    "builtins.open": lambda m: b"\x80\x04" + stack_global("builtins", "open") + su(str(m)) + su("w") + b"\x86R.",
    "torch.load (a torch name that is not a dtype)": lambda m: b"\x80\x04" + stack_global("torch", "load")
    + su(str(m)) + b"\x85R.",
    "dotted name through torch": lambda m: b"\x80\x04" + stack_global("torch", "os.system") + su(f"touch {m}") + b"\x85R.",
    "protocol 0 GLOBAL": lambda m: b"cos\nsystem\n" + b"(V" + f"touch {m}".encode() + b"\ntR.",
    "copyreg extension code": lambda m: b"\x80\x02\x82\x01.",
    "persistent id": lambda m: b"\x80\x02P1\n.",
    "INST of an admitted module's dotted name": lambda m: b"(i" + MD.encode() + b"\nos.system\n.",
}


@pytest.mark.parametrize("case", sorted(CODE_PAYLOADS))
def test_a_metadata_payload_never_runs(ck, capsys, case):
    marker = ck.parent / "payload-ran"
    metadata_path(ck).write_bytes(CODE_PAYLOADS[case](marker))
    refused(lambda: resume(ck), capsys, "refused unread")
    assert not marker.exists()


def test_a_payload_in_front_of_a_real_metadata_never_runs(ck, capsys):
    """The call, then POP, then the real metadata: it used to unpickle to the real metadata, run the
    command and resume with exit 0."""
    marker, path = ck.parent / "payload-ran", metadata_path(ck)
    real = path.read_bytes()
    path.write_bytes(b"\x80\x04" + stack_global(MD, "os.system") + su(f"touch {marker}") + b"\x85R0" + real[2:])
    refused(lambda: resume(ck), capsys, "refused unread")
    assert not marker.exists()


def test_attributes_set_by_build_are_refused_before_they_are_set(ck, capsys):
    """BUILD sets attributes on any object the pickle holds: an enum member (process-wide), or an
    admitted class through the slot-state form (setattr). Refused before it sets them: nothing changed."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING
    getstate = _StorageInfo.__getstate__
    member = stack_global(MD, "_MEM_FORMAT_ENCODING") + b"K\x00\x85R"
    for blob in (b"\x80\x04" + member + b"}" + su("_value_") + b"K\x07sb.",
                 b"\x80\x04" + stack_global("torch.distributed.checkpoint.filesystem", "_StorageInfo") + b"N}"
                 + su("__getstate__") + stack_global("torch", "Size") + b"s\x86b."):
        metadata_path(ck).write_bytes(blob)
        refused(lambda: resume(ck), capsys, "sets attributes of")
    assert _MEM_FORMAT_ENCODING(0)._value_ == 0 and _StorageInfo.__getstate__ is getstate


# ---------------------------------------------------------------- .metadata: memory and malformed values
def test_memo_and_length_opcodes_allocate_nothing(ck, capsys):
    """12 bytes that made the unpickler grow its memo to 2^24 entries (256 MiB) or 2^32 (MemoryError),
    and lengths that claim 8 GiB: refused before anything is allocated."""
    blobs = [b"\x80\x04}r" + struct.pack("<I", 2 ** 24) + b".", b"\x80\x04}r" + struct.pack("<I", 2 ** 32 - 1) + b".",
             b"\x80\x04}h\xff.", b"\x80\x04\x8e" + struct.pack("<Q", 8 << 30) + b".",
             b"\x80\x04\x8d" + struct.pack("<Q", 8 << 30) + b".", b"\x80\x04X" + struct.pack("<I", 2 ** 31) + b".",
             b"\x80\x04\x95" + struct.pack("<Q", 1 << 40) + b"}."]
    tracemalloc.start()
    try:
        for blob in blobs:
            metadata_path(ck).write_bytes(blob)
            refused(lambda: fsdp.read_metadata(str(ck / "step-00000004")), capsys, "refused unread")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak


def test_deep_nesting_is_one_line(ck, capsys):
    path = metadata_path(ck)
    path.write_bytes(b"\x80\x04" + b"]" * 100_000 + b"a" * 99_999 + b".")  # lists 10^5 deep
    refused(lambda: resume(ck), capsys, "refused unread")
    path.write_bytes(b"\x80\x04" + b"(" * 100_000 + b".")
    refused(lambda: resume(ck), capsys, "refused unread")


def set_first_size(metadata, value):
    first_entry = metadata.state_dict_metadata[first(metadata.state_dict_metadata)]
    first_entry.size = value


MALFORMED = {
    "_get_layout('nope')": None,  # bytes patched in the test
    "a size that is an int": lambda m: set_first_size(m, 5),
    "a size that is a list": lambda m: set_first_size(m, [98, 16]),
    "mixed key types": lambda m: m.state_dict_metadata.update({5: m.state_dict_metadata[first(m.state_dict_metadata)]}),
    "a chunk outside its tensor": lambda m: setattr(
        m.state_dict_metadata[first(m.state_dict_metadata)].chunks[0], "offsets", torch.Size([90, 0])),
    "a non-tensor entry": lambda m: m.state_dict_metadata.update(
        {"model.extra": __import__("torch.distributed.checkpoint.metadata").distributed.checkpoint.metadata
         .BytesStorageMetadata()}),
    "a transform (a decompressor) on a byte range": lambda m: setattr(
        m.storage_data[first(m.storage_data)], "transform_descriptors", ["zstd"]),
    "a byte range past the end of its file": lambda m: setattr(m.storage_data[first(m.storage_data)], "length", 10 ** 9),
    "storage_data that is a list": lambda m: setattr(m, "storage_data", []),
    "not Metadata at all": None,
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_metadata_is_one_line(ck, capsys, case):
    path = metadata_path(ck)
    if case == "_get_layout('nope')":
        path.write_bytes(path.read_bytes().replace(su("torch.strided"), su("torch.nope___")))
    elif case == "not Metadata at all":
        path.write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    else:
        rewritten(ck, MALFORMED[case])
    # a byte range past the end of its file: not checked ahead, DCP's read of it fails (still one line)
    refused(lambda: resume(ck), capsys, "cannot read checkpoint" if "past the end" in case else "refused unread")


# ---------------------------------------------------------------- paths: every read stays in the folder
@pytest.mark.parametrize("where", ["absolute", "dotdot", "link out", "fifo", "folder", "nul", "device"])
def test_relative_path_stays_in_the_save(ck, capsys, where):
    """A `.distcp` named outside the folder (absolute, `../..`, a link), or a FIFO (which hung the read):
    refused when DCP opens it (SaveFiles), the file outside unread."""
    outside = ck.parent / "outside.distcp"
    shutil.copy(ck / "step-00000004" / "__0_0.distcp", outside)
    name = {"absolute": str(outside), "dotdot": "../../outside.distcp", "link out": "__9_0.distcp",
            "fifo": "__8_0.distcp", "folder": "__7_0.distcp", "nul": "__0_0.distcp\0/../../x",
            "device": "__6_0.distcp"}[where]
    if where == "device":  # /dev/zero under another name: a link, refused as one (a device node needs root)
        os.symlink("/dev/zero", ck / "step-00000004" / name)
    if where == "link out":
        os.symlink(outside, ck / "step-00000004" / name)
    elif where == "fifo":
        os.mkfifo(ck / "step-00000004" / name)
    elif where == "folder":
        os.mkdir(ck / "step-00000004" / name)

    def point_at(metadata):
        for info in metadata.storage_data.values():
            info.relative_path = name
    rewritten(ck, point_at)
    before = outside.read_bytes()
    start = time.monotonic()
    refused(lambda: resume(ck), capsys, "symbolic links" if where in ("link out", "device") else "refused")
    assert time.monotonic() - start < 30 and outside.read_bytes() == before


def record_rewritten(ck, change):
    """The first tensor's record (a torch.save archive inside __0_0.distcp) rebuilt with its data.pkl
    changed by `change(bytes)`, written as a file of its own that the metadata then names."""
    metadata = pickle.loads(metadata_path(ck).read_bytes())
    index = first(metadata.storage_data)
    info = metadata.storage_data[index]
    blob = (ck / "step-00000004" / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(blob)) as src, zipfile.ZipFile(out, "w") as dst:
        for item in src.infolist():
            data = src.read(item.filename)
            dst.writestr(item.filename, change(data) if item.filename.endswith("/data.pkl") else data)
    (ck / "step-00000004" / "__5_0.distcp").write_bytes(out.getvalue())
    info.relative_path, info.offset, info.length = "__5_0.distcp", 0, len(out.getvalue())
    metadata_path(ck).write_bytes(pickle.dumps(metadata))


def test_a_tensor_record_naming_a_callable_is_one_line_and_runs_nothing(ck, capsys):
    """A `.distcp` record naming posix.system: DCP reads records with torch.load(weights_only=True), which
    refuses it unrun. One naming DeviceMesh, which torch's allowlist admits (once torch.distributed.tensor
    is imported) and calls: whatever it does is torch's reader's; here it is one line."""
    marker = ck.parent / "payload-ran"
    pristine = metadata_path(ck).read_bytes()
    for name in ("posix\nsystem", "torch.distributed.device_mesh\nDeviceMesh"):
        record_rewritten(ck, lambda pkl: pkl.replace(b"collections\nOrderedDict", name.encode()))
        refused(lambda: resume(ck), capsys, "cannot read checkpoint")
        metadata_path(ck).write_bytes(pristine)
    record_rewritten(ck, lambda pkl: pkl)  # the same record, rewritten: it resumes
    assert resume(ck)["step"] == 4 and not marker.exists()


@pytest.mark.parametrize("folder", ["..", ".", "/", "/tmp", "step-00000004/..", "../ck/step-00000004", None,
                                    ["step-00000004"], 5, "step-4"])
def test_the_pointers_folder_is_a_save_of_this_folder(ck, capsys, folder):
    """`"folder": ".."` loaded a save from the folder above; null or a list gave a traceback."""
    shutil.copytree(ck / "step-00000004", ck.parent / "step-00000004")  # a save above, which must not be read
    pointer = json.loads((ck / "latest.json").read_text())
    (ck / "latest.json").write_text(json.dumps({**pointer, "folder": folder}))
    refused(lambda: resume(ck), capsys, "latest.json")


@pytest.mark.parametrize("what", ["step-N links out", "latest.json is a FIFO", "latest.json links out",
                                  ".metadata is a FIFO", ".metadata links out", "step-N is a file"])
def test_links_fifos_and_files_in_place_of_the_save(ck, capsys, what):
    elsewhere = ck.parent / "elsewhere"
    shutil.copytree(ck, elsewhere)
    target = {"step-N links out": ck / "step-00000004", "latest.json is a FIFO": ck / "latest.json",
              "latest.json links out": ck / "latest.json", ".metadata is a FIFO": metadata_path(ck),
              ".metadata links out": metadata_path(ck), "step-N is a file": ck / "step-00000004"}[what]
    (shutil.rmtree if target.is_dir() else os.remove)(target)
    if "FIFO" in what:
        os.mkfifo(target)
    elif "file" in what:
        target.write_text("")
    else:
        os.symlink(elsewhere / target.relative_to(ck), target)
    start = time.monotonic()
    refused(lambda: resume(ck), capsys)
    assert time.monotonic() - start < 30


# ---------------------------------------------------------------- the pointer's values
BAD_VALUES = {"global_batch": ["2", 1e18, 10 ** 18, 0, -8, None, True, 2.0], "step": ["2", -1, 1.5, None, [4]],
              "epoch": [-1, "0"], "windows_in_epoch": [10 ** 12, -32, 9999], "batch_size": [0, 9, "8"],
              "world_size": [0, "1"], "vocab": [5, ["a"]], "config": [[], "x", None], "job": [5, ["x"]],
              "text": ["x", 1.5]}


def test_every_pointer_value_is_checked(ck, capsys):
    pointer = json.loads((ck / "latest.json").read_text())
    for key, values in BAD_VALUES.items():
        for value in values:
            (ck / "latest.json").write_text(json.dumps({**pointer, key: value}))
            refused(lambda: resume(ck), capsys)
    for text in ('{"step": NaN}', '{"step": Infinity}', "[" * 100_000 + "]" * 100_000, "{" * 100_000, "[]", "",
                 "\xff\xfe", json.dumps({**pointer, "global_batch": float("nan")})):
        (ck / "latest.json").write_text(text)
        refused(lambda: resume(ck), capsys, "latest.json")


def test_other_text_of_the_same_vocabulary_is_refused(ck, capsys):
    """The same characters in another order: the same vocabulary, another text (its fingerprint)."""
    (ck.parent / "text.txt").write_text(TEXT[::-1])
    refused(lambda: resume(ck), capsys, "other text of the same", "fingerprint")


def test_ddp_transformer_checks_its_values_and_its_text(tmp_path, capsys, monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "text.txt").write_text(TEXT)
    path = tmp_path / "ck.pt"
    args = ddp_transformer.check_args(ddp_transformer.parse_args([*TINY, "--data", str(tmp_path / "text.txt"),
                                                                  "--checkpoint", str(path)]))
    corpus = ddp_transformer.read_corpus(args)
    config = ddp_transformer.model_config(args, corpus[2])
    good = {"model": ddp_transformer.Transformer(**config).state_dict(), "optimizer": {}, "scaler": {},
            "config": config, "vocab": corpus[2], "text": ddp_transformer.text_fingerprint(corpus[0]), "epoch": 0,
            "step": 4, "windows_in_epoch": 32, "global_batch": 8, "batch_size": 8, "world_size": 1}
    torch.save(good, path)
    assert ddp_transformer.read_checkpoint(args, corpus)["step"] == 4
    for change in ({"model": 5}, {"model": {"embedding.weight": "x"}}, {"model": {}}, {"global_batch": 10 ** 18},
                   {"windows_in_epoch": 10 ** 12}, {"step": "2"}, {"global_batch": 2.0}, {"vocab": 5},
                   {"text": 123}, {"optimizer": 5}, {"optimizer": {"state": 1, "param_groups": 2}}):
        torch.save({**good, **change}, path)
        refused(lambda: ddp_transformer.read_checkpoint(args, corpus), capsys)


# ---------------------------------------------------------------- the harness's single-file reader
def test_a_fifo_is_refused_unread(tmp_path, capsys, monkeypatch):
    """A FIFO in a checkpoint's place hung the read (and the line said on Ctrl-C)."""
    monkeypatch.delenv("RANK", raising=False)
    fifo = tmp_path / "fifo.pt"
    os.mkfifo(fifo)
    refused(lambda: ddp_gpus_torchrun.load_checkpoint(str(fifo), ("model",)), capsys, "not a plain file")
    refused(lambda: ddp_gpus_torchrun.continue_checkpoint(str(fifo), False), capsys, "not a checkpoint")


def test_every_scripts_model_entry_is_checked(tmp_path, capsys, monkeypatch):
    """`model` an int or a dict of strings gave a traceback in every script's load_checkpoint."""
    monkeypatch.delenv("RANK", raising=False)
    path, model = tmp_path / "snap.pt", torch.nn.Linear(3, 2)
    for entry in (5, {"weight": "x", "bias": "y"}, {"weight": torch.zeros(2, 3)}, [1], {"weight": torch.zeros(3, 3),
                                                                                        "bias": torch.zeros(2)}):
        torch.save({"model": entry, "optimizer": {}, "epochs_run": 1}, path)
        refused(lambda: ddp_gpus_torchrun.load_checkpoint(str(path), ("model", "optimizer", "epochs_run"), model), capsys,
                "snap.pt")
    for change in ({"epochs_run": "1"}, {"epochs_run": -1}, {"epochs_run": 1.5}, {"epochs_run": True},
                   {"optimizer": 5}, {"optimizer": {"state": [], "param_groups": {}}},
                   {"optimizer": {"state": {0: 5}, "param_groups": []}}, {"optimizer": {"state": {}, "param_groups": [{}]}}):
        torch.save({"model": model.state_dict(), "optimizer": {}, "epochs_run": 1, **change}, path)
        refused(lambda: ddp_gpus_torchrun.load_checkpoint(str(path), ("model", "optimizer", "epochs_run"), model), capsys,
                "snap.pt")


def gan_pair(seed, width=4):
    """Two models (BatchNorm in the second) and two optimizers, each stepped once: state in every entry."""
    torch.manual_seed(seed)
    g = torch.nn.Linear(3, width)
    d = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.BatchNorm1d(width), torch.nn.Linear(width, 1))
    g_opt, d_opt = torch.optim.Adam(g.parameters(), lr=1e-3), torch.optim.SGD(d.parameters(), lr=0.1, momentum=0.9)
    d(g(torch.randn(8, 3))).square().mean().backward()
    g_opt.step()
    d_opt.step()
    return g, d, g_opt, d_opt


def test_several_models_and_optimizers_round_trip_and_each_entry_is_checked(tmp_path, capsys, monkeypatch):
    """Issue 44: load_checkpoint(path, keys, model={entry: module}, optimizers={entry: optimizer}) checks and loads
    each model entry as "model" is (a dict of finite tensors, strict) and each optimizer entry against its
    optimizer; a scheduler's, a GradScaler's and the user's own plain entries come back as saved; a tensor
    anywhere else is refused. Each refusal names the entry."""
    monkeypatch.delenv("RANK", raising=False)
    g, d, g_opt, d_opt = gan_pair(0)
    scheduler = torch.optim.lr_scheduler.StepLR(g_opt, step_size=2)
    g_opt.step()  # the order torch asks for: the optimizer's step, then the scheduler's
    scheduler.step()
    mine = {"best_loss": 1.25, "names": ["a", "b"], "nested": {"k": [1, 2]}}
    state = {"generator": g.state_dict(), "discriminator": d.state_dict(), "g_optimizer": g_opt.state_dict(),
             "d_optimizer": d_opt.state_dict(), "scheduler": scheduler.state_dict(),
             "scaler": torch.amp.GradScaler("cpu").state_dict(), "mine": mine, "step": 7}
    path = tmp_path / "gan.pt"
    ddp_gpus_torchrun.save_checkpoint(state, str(path))
    g2, d2, g_opt2, d_opt2 = gan_pair(1)
    entries = {"model": {"generator": g2, "discriminator": d2}, "optimizers": {"g_optimizer": g_opt2, "d_optimizer": d_opt2}}
    got = ddp_gpus_torchrun.load_checkpoint(str(path), ("step", "scheduler", "scaler", "mine"), **entries)
    assert got["mine"] == mine and got["step"] == 7 and got["world_size"] == 1 and got["scheduler"]["last_epoch"] == 1
    for ours, theirs in ((g, g2), (d, d2)):  # buffers too: BatchNorm's running statistics and its counter
        assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), theirs.state_dict().values()))
    for g_, d_, go, do in ((g, d, g_opt, d_opt), (g2, d2, g_opt2, d_opt2)):  # one more step each: the same weights
        torch.manual_seed(2)
        go.zero_grad()
        do.zero_grad()
        d_(g_(torch.randn(8, 3))).square().mean().backward()
        go.step()
        do.step()
    assert all(torch.equal(a, b) for a, b in zip([*g.parameters(), *d.parameters()], [*g2.parameters(), *d2.parameters()]))

    def save_and_refuse(change, *words):
        ddp_gpus_torchrun.save_checkpoint({**state, **change}, str(path))
        fresh = gan_pair(1)
        return refused(lambda: ddp_gpus_torchrun.load_checkpoint(
            str(path), ("step", "mine"), model={"generator": fresh[0], "discriminator": fresh[1]},
            optimizers={"g_optimizer": fresh[2], "d_optimizer": fresh[3]}), capsys, "gan.pt", *words)
    other = gan_pair(0, width=5)  # the same parameters, other shapes
    save_and_refuse({"d_optimizer": other[3].state_dict()}, "another optimizer's state than d_optimizer's", "shape")
    save_and_refuse({"g_optimizer": [1, 2]}, "than g_optimizer's")
    save_and_refuse({"mine": {**mine, "best": torch.ones(1)}}, "its mine holds a tensor")
    save_and_refuse({"discriminator": other[1].state_dict()}, "is for another model or configuration (discriminator: ")
    save_and_refuse({"generator": {"weight": "w"}}, "its generator entry is not a dict of tensors")
    save_and_refuse({"generator": {**g.state_dict(), "weight": torch.full((4, 3), float("nan"))}},
                    "not finite values: generator: weight")
    ddp_gpus_torchrun.save_checkpoint({k: v for k, v in state.items() if k != "d_optimizer"}, str(path))
    refused(lambda: ddp_gpus_torchrun.load_checkpoint(str(path), ("step",), optimizers={"d_optimizer": d_opt2}),
            capsys, "is not a checkpoint of this script")


def test_ddp_main_checks_its_args_entry(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    args = ddp_main.parse_args(["--device", "cpu", "--checkpoint", str(tmp_path / "ck.pt"), "--resume"])
    model = ddp_main.ConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    good = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": {}, "epoch": 1,
            "args": {"dataset": "synthetic"}}
    for change in ({"args": 5}, {"epoch": "1"}, {"epoch": -1}, {"scaler": 5},
                   {"optimizer": {"state": {}, "param_groups": [{"params": [0]}]}}):
        torch.save({**good, **change}, tmp_path / "ck.pt")
        refused(lambda: ddp_main.restore_checkpoint(model, optimizer, scaler, [], args, None), capsys, "ck.pt")


# ---------------------------------------------------------------- saving: what is written, where
def test_atomic_write_flushes_and_follows_no_planted_link(tmp_path, monkeypatch):
    """fsync of the file before the rename and of its folder after it; a link planted under the
    temporary name is replaced, not written through."""
    victim, path = tmp_path / "victim", tmp_path / "latest.json"
    victim.write_text("keep")
    os.symlink(victim, f"{path}.tmp{os.getpid()}")
    synced, real_fsync, real_replace = [], os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (synced.append("replace"), real_replace(a, b)))
    ddp_gpus.write_json(str(path), {"a": 1})
    assert victim.read_text() == "keep" and json.loads(path.read_text()) == {"a": 1}
    assert synced == [f"{path}.tmp{os.getpid()}", "replace", str(tmp_path)], synced


def test_a_second_run_on_the_folder_is_refused_and_a_planted_link_is_not_written(ck, capsys):
    """The lock: a second holder is refused in one line (flock: a second open file of this process
    conflicts as another process's would). A `step-N` link planted before a save: refused."""
    fsdp.LOCKED.clear()
    fsdp.lock_checkpoint_folder(str(ck))
    held = fsdp.LOCKED.pop(os.path.realpath(ck))
    try:
        refused(lambda: fsdp.lock_checkpoint_folder(str(ck)), capsys, "in use by another run", str(os.getpid()))
    finally:
        os.close(held)
        fsdp.LOCKED.pop(os.path.realpath(ck), None)
    other = ck.parent / "other"
    other.mkdir()
    os.symlink(other, ck / "step-00000005")
    refused(lambda: fsdp.save_folder(str(ck), 5, "step-00000004"), capsys, "is a link or a file")
    os.remove(ck / ".lock")
    os.symlink(other / "lock", ck / ".lock")  # a planted .lock is not followed (nor created out there)
    refused(lambda: fsdp.lock_checkpoint_folder(str(ck)), capsys, "cannot lock")
    assert os.listdir(other) == []
    assert os.listdir(other) == [] and os.path.islink(ck / "step-00000005")


@pytest.mark.parametrize("target", ["ck", "ck/latest.json", "ck/step-00000004/.metadata", "./ck/../ck/x.pt",
                                    "link/x.pt", "."])
def test_export_refuses_the_checkpoint_folder_and_anything_in_it(ck, capsys, target):
    os.symlink("ck", ck.parent / "link")
    argv = [*TINY, "--data", str(ck.parent / "text.txt"), "--checkpoint", "ck", "--resume", "--export", target]
    refused(lambda: fsdp.check_args(fsdp.parse_args(argv)), capsys, "--export")


# ---------------------------------------------------------------- .pt files, round 2 (issue 42)
def pt_with_pickle(path, pickled, like=None):
    """A real torch.save zip at `path` (of `like`, a state) with its data.pkl replaced by `pickled`: stored,
    so every zip check passes and the pickle is what the readers meet."""
    real = io.BytesIO()
    torch.save(like if like is not None else {"model": {}, "epochs_run": 1}, real)
    out = io.BytesIO()
    with zipfile.ZipFile(real) as src, zipfile.ZipFile(out, "w") as dst:
        for item in src.infolist():
            dst.writestr(item.filename, pickled if item.filename.endswith("/data.pkl") else src.read(item.filename))
    path.write_bytes(out.getvalue())


def test_a_value_nested_deep_or_holding_itself_loads(tmp_path, capsys, monkeypatch):
    """torch's reader bounds no nesting: a list 10^5 deep, or a list that holds itself, where a plain value
    belongs. The check for a tensor among the values walks them without recursion, each object once (a
    recursive walk raised RecursionError on the first and never ended on a memo-doubled one)."""
    monkeypatch.delenv("RANK", raising=False)
    path = tmp_path / "ck.pt"
    head = b"\x80\x02}(X\x05\x00\x00\x00model}X\x0a\x00\x00\x00epochs_runK\x01X\x05\x00\x00\x00notes"
    for value in (b"]" * 100_000 + b"a" * 99_999, b"]q\x00h\x00a"):
        pt_with_pickle(path, head + value + b"u.")
        start = time.monotonic()
        assert loads_or_one_line(lambda: ddp_gpus_torchrun.load_checkpoint(str(path), ("model", "epochs_run")),
                                 capsys) == "loaded"
        assert time.monotonic() - start < 10


def test_a_refused_pt_file_is_one_line_without_torchs_warnings(tmp_path, capsys, monkeypatch):
    """torch's reader warns on its way to a refusal (found by the fuzz: a REDUCE that calls a storage, which
    torch compares with its allowlist, warning that TypedStorage is deprecated): the one `error:` line is
    all the user sees."""
    monkeypatch.delenv("RANK", raising=False)
    path = tmp_path / "ck.pt"
    storage = b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x01tQ"
    pt_with_pickle(path, b"\x80\x02" + storage + b"K\x00R.", like={"model": {"w": torch.ones(1)}})
    torch.storage._set_always_warn_typed_storage_removal(True)  # torch warns once a process otherwise
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            refused(lambda: ddp_gpus_torchrun.load_checkpoint(str(path), ("model",)), capsys, "refused unread")
    finally:
        torch.storage._set_always_warn_typed_storage_removal(False)
    assert not seen, [str(w.message) for w in seen]


def test_a_linked_checkpoint_is_refused_with_the_file_it_names(tmp_path, capsys, monkeypatch):
    """A link is not followed, and the fix names the file it links to (not "delete it": it is the user's
    file); a hard link (a file of another folder too) is refused; on Ctrl-C neither is read."""
    monkeypatch.delenv("RANK", raising=False)
    path = tmp_path / "ck.pt"
    torch.save({"model": {"w": torch.ones(3)}, "epochs_run": 1}, path)
    assert ddp_gpus_torchrun.load_checkpoint(str(path), ("model", "epochs_run"))["epochs_run"] == 1
    os.symlink(path, tmp_path / "link.pt")
    refused(lambda: ddp_gpus_torchrun.load_checkpoint(str(tmp_path / "link.pt"), ("model",)), capsys, "symbolic link",
            f"(pass the file it links to, {os.path.realpath(path)})")
    assert ddp_gpus_torchrun.describe_checkpoint(str(tmp_path / "link.pt")) == "no checkpoint kept"
    os.link(path, tmp_path / "hard.pt")
    refused(lambda: ddp_gpus_torchrun.load_checkpoint(str(path), ("model",)), capsys, "one link")
    assert ddp_gpus_torchrun.describe_checkpoint(str(path)) == "no checkpoint kept"


def transformer_checkpoint(tmp_path, optimizer_name="auto"):
    """A ddp_transformer checkpoint after one fused-AdamW step: (args, corpus, its state, a fresh Run)."""
    (tmp_path / "text.txt").write_text(TEXT)
    path = tmp_path / "ck.pt"
    args = ddp_transformer.check_args(ddp_transformer.parse_args([*TINY, "--data", str(tmp_path / "text.txt"),
                                                                  "--checkpoint", str(path), "--resume"]
                                                                 if path.exists() else
                                                                 [*TINY, "--data", str(tmp_path / "text.txt"),
                                                                  "--checkpoint", str(path)]))
    corpus = ddp_transformer.read_corpus(args)
    config = ddp_transformer.model_config(args, corpus[2])
    model = ddp_transformer.Transformer(**config)
    optimizer = ddp_transformer.make_optimizer(model, args)
    model(torch.zeros(2, 16, dtype=torch.long)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": {}, "config": config,
             "vocab": corpus[2], "text": ddp_transformer.text_fingerprint(corpus[0]), "epoch": 0, "step": 4,
             "windows_in_epoch": 32, "global_batch": 8, "batch_size": 8, "world_size": 1}
    trainer = ddp_transformer.Run.__new__(ddp_transformer.Run)
    trainer.args, trainer.model = args, ddp_transformer.Transformer(**config)
    trainer.optimizer = ddp_transformer.make_optimizer(trainer.model, args)
    trainer.scaler = torch.amp.GradScaler("cpu", enabled=False)
    return args, corpus, state, trainer


def with_exp_avg(state, index, key, value):
    optimizer = {**state["optimizer"], "state": {**state["optimizer"]["state"]}}
    optimizer["state"][index] = {**optimizer["state"][index], key: value}
    return {**state, "optimizer": optimizer}


def test_an_optimizer_state_is_checked_against_its_optimizer_before_it_sees_it(tmp_path, capsys, monkeypatch):
    """An `exp_avg` of shape [1] made `ddp_transformer.py --resume` segfault (the fused CPU AdamW wrote past
    it); a stride-0 view, a step of another shape or a string, other groups or settings: tracebacks. Each is
    one line before load_state_dict; the real state still resumes and steps. NaN weights: one line too."""
    for name in ("RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    args, corpus, good, trainer = transformer_checkpoint(tmp_path)
    first, shape = 0, good["optimizer"]["state"][0]["exp_avg"].shape
    groups = good["optimizer"]["param_groups"]
    bad = [with_exp_avg(good, first, "exp_avg", torch.zeros(1)),
           with_exp_avg(good, first, "exp_avg", torch.zeros(1).expand(shape)),  # in bounds, stride 0
           with_exp_avg(good, first, "exp_avg", torch.zeros(shape, dtype=torch.int64)),
           with_exp_avg(good, first, "exp_avg", torch.nn.Parameter(torch.zeros(shape))),
           with_exp_avg(good, first, "exp_avg", "x"),
           with_exp_avg(good, first, "step", torch.zeros(2)), with_exp_avg(good, first, "step", "2"),
           with_exp_avg(good, first, "step", torch.tensor(float("nan"))),
           {**good, "optimizer": {**good["optimizer"], "state": {10 ** 6: {}}}},
           {**good, "optimizer": {**good["optimizer"], "param_groups": groups[:1]}},
           {**good, "optimizer": {**good["optimizer"], "param_groups": [{**groups[0], "params": [0, 0]}, groups[1]]}},
           {**good, "optimizer": {**good["optimizer"], "param_groups": [{**groups[0], "lr": "0.1"}, groups[1]]}},
           {**good, "optimizer": {**good["optimizer"], "param_groups": [{**groups[0], "betas": (0.9,)}, groups[1]]}},
           {**good, "optimizer": {**good["optimizer"], "param_groups": [  # found by the fuzz: a KeyError at the step
               {k: v for k, v in groups[0].items() if k != "lr"}, groups[1]]}},
           {**good, "optimizer": {**good["optimizer"], "state": {**good["optimizer"]["state"], first: {  # the same
               k: v for k, v in good["optimizer"]["state"][first].items() if k != "exp_avg_sq"}}}}]
    for state in bad:
        torch.save(state, args.checkpoint)
        loaded = ddp_transformer.read_checkpoint(args, corpus)
        refused(lambda: trainer.restore(loaded), capsys, "another optimizer's state", "ck.pt")
    torch.save(good, args.checkpoint)
    trainer.restore(ddp_transformer.read_checkpoint(args, corpus))
    trainer.model(torch.zeros(2, 16, dtype=torch.long)).sum().backward()
    trainer.optimizer.step()
    name, weight = list(good["model"].items())[1]
    torch.save({**good, "model": {**good["model"], name: weight.clone().fill_(float("nan"))}}, args.checkpoint)
    refused(lambda: ddp_transformer.read_checkpoint(args, corpus), capsys, "not finite", name)
    start = time.monotonic()  # 10^12 elements claimed by a view of 4 bytes (stride 0): refused before a pass over it
    torch.save({**good, "model": {**good["model"], name: torch.zeros(1).expand(10 ** 12)}}, args.checkpoint)
    refused(lambda: ddp_transformer.read_checkpoint(args, corpus), capsys, "not finite", name)
    assert time.monotonic() - start < 2


def test_sgd_and_adam_states_of_other_shapes_are_one_line(tmp_path, capsys, monkeypatch):
    """ddp_main's SGD, ddp_uneven's Adam, ddp_gpus_torchrun's SGD: the same check, the same one line."""
    monkeypatch.delenv("RANK", raising=False)
    model = torch.nn.Linear(3, 2)
    for optimizer in (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), torch.optim.Adam(model.parameters())):
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
        good = optimizer.state_dict()
        key = next(k for k in good["state"][0] if k != "step")
        wrong = {**good, "state": {**good["state"], 0: {**good["state"][0], key: torch.zeros(1)}}}
        for script in (ddp_main, ddp_gpus_torchrun):
            refused(lambda: script.check_optimizer_state("ck.pt", wrong, optimizer), capsys, key, "(2, 3)")
        ddp_main.check_optimizer_state("ck.pt", good, optimizer)


def test_control_characters_from_a_checkpoint_are_shown_not_obeyed(tmp_path, capsys, monkeypatch):
    """Newlines and terminal escapes in a checkpoint's strings reached the error line as they were: a second,
    forged `error:` line. Shown escaped (`\\n`, `\\x1b`), in one line, whatever the message."""
    monkeypatch.delenv("RANK", raising=False)
    forged = "x\nerror: forged (run rm -rf ~)\x1b[2J\r\u2028\x85\x7f"
    args = ddp_main.parse_args(["--device", "cpu", "--checkpoint", str(tmp_path / "ck.pt"), "--resume"])
    model = ddp_main.ConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": {}, "epoch": 1,
                "args": {}, "data": {"classes": [forged, "b"]}}, tmp_path / "ck.pt")
    line = refused(lambda: ddp_main.restore_checkpoint(model, optimizer, None, [], args, ["a", "b"]), capsys,
                   "x\\nerror: forged", "\\x1b[2J\\r\\u2028\\x85\\x7f")
    assert not any(c in line for c in "\n\r\x1b\x85\x7f\u2028")
    refused(lambda: ddp_gpus.fail(forged, forged), capsys, "\\x1b")


def test_a_global_batch_beyond_the_text_is_refused(tmp_path, capsys, monkeypatch):
    """A global_batch of 65,536 on a 178-window text ran the first step past 120 s (65,536 micro-batches,
    nearly all empty): a step trains at most the windows of the text."""
    for name in ("RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    args, corpus, good, _ = transformer_checkpoint(tmp_path)
    windows = len(ddp_transformer.build_data(args, corpus[0], corpus[2], "cpu")[0])
    torch.save({**good, "global_batch": windows, "batch_size": 1}, args.checkpoint)
    assert ddp_transformer.read_checkpoint(args, corpus)["global_batch"] == windows
    for global_batch in (windows + 1, 65_536):
        torch.save({**good, "global_batch": global_batch, "batch_size": 1}, args.checkpoint)
        refused(lambda: ddp_transformer.read_checkpoint(args, corpus), capsys, "global_batch")


class FilledUp(io.RawIOBase):
    """A file on a disk with `room` bytes left: then ENOSPC, as write(2) says it."""

    def __init__(self, fd, room=100):
        super().__init__()
        self.fd, self.room = fd, room

    def writable(self):
        return True

    def write(self, data):
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return os.write(self.fd, data)

    def fileno(self):
        return self.fd

    def close(self):
        if not self.closed:
            os.close(self.fd)
        super().close()


def test_a_tensor_where_a_value_belongs_is_one_line(tmp_path, capsys, monkeypatch):
    """`text` or a config value as a tensor (10^9 elements viewed from 4 bytes): compared with ours it took
    gigabytes, then a traceback (a tensor is neither true nor false). Tensors belong in model and optimizer."""
    for name in ("RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    args, corpus, good, _ = transformer_checkpoint(tmp_path)
    huge = torch.zeros(1).expand(10 ** 9)
    for change in ({"text": huge}, {"config": {**good["config"], "d_model": huge}}, {"epoch_notes": [[huge]]}):
        torch.save({**good, **change}, args.checkpoint)
        refused(lambda: ddp_transformer.read_checkpoint(args, corpus), capsys, "holds a tensor")


@pytest.mark.parametrize("where", ["open", "write", "fsync"])
def test_a_full_disk_or_read_only_folder_at_save_is_one_line_and_the_previous_kept(tmp_path, capsys, monkeypatch,
                                                                                  where):
    """EROFS at the open, ENOSPC inside torch.save (its writer then raises a RuntimeError "unexpected pos"
    over it, as on a real full tmpfs) or at the fsync: a traceback before; now one line naming the file and
    the fix, and the previous file whole. chmod cannot stop root: the errors are raised here as the kernel
    raises them."""
    monkeypatch.delenv("RANK", raising=False)
    path = tmp_path / "ck.pt"
    ddp_gpus_torchrun.save_checkpoint({"model": {"w": torch.ones(3)}, "epochs_run": 1}, str(path))
    before = path.read_bytes()
    code = errno.EROFS if where == "open" else errno.ENOSPC

    def broken(*args, **kwargs):
        if where == "fsync" or where == "open" and args[1] & os.O_CREAT:
            raise OSError(code, os.strerror(code))
        return real(*args, **kwargs)
    real = getattr(os, "open" if where == "open" else "fsync")
    if where == "write":
        monkeypatch.setattr(ddp_gpus_torchrun, "open", lambda fd, mode="r", **kwargs: FilledUp(fd), raising=False)
    else:
        monkeypatch.setattr(os, "open" if where == "open" else "fsync", broken)
    refused(lambda: ddp_gpus_torchrun.save_checkpoint({"model": {"w": torch.zeros(1000)}, "epochs_run": 2}, str(path)),
            capsys, str(path), os.strerror(code), "previous file there is kept")
    refused(lambda: ddp_gpus_torchrun.write_json(str(tmp_path / "m.json"), {"a": 1} if where != "write" else {"a": "x" * 200}),
            capsys, "m.json")
    monkeypatch.undo()
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["ck.pt"]


def shrunk_exp_avg(path):
    """The checkpoint at `path` with every parameter's `exp_avg` cut to shape [1], as torch.save writes it."""
    state = torch.load(path, weights_only=True)
    for entry in state["optimizer"]["state"].values():
        entry["exp_avg"] = torch.zeros(1)
    torch.save(state, path)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_optimizer_state_of_another_shape_through_real_launches(tmp_path):
    """`exp_avg` of shape [1]: ddp_transformer --resume exited 139 with nothing said (the fused CPU AdamW
    wrote past it), ddp_main --resume and ddp_uneven --zero --resume (ZeRO's consolidated state) gave
    tracebacks. Each is one error line now, and no traceback."""
    (tmp_path / "text.txt").write_text(TEXT)
    torchrun_2 = [*torchrun_cmd(), "--standalone", "--nproc-per-node=2"]
    runs = [([sys.executable, ROOT / "ddp_transformer.py", *TINY, "--data", "text.txt", "--checkpoint", "t.pt"],
             ["--max_steps", "2"], ["--max_steps", "4", "--resume"]),
            ([sys.executable, ROOT / "ddp_main.py", "--device", "cpu", "--nprocs", "2", "--dataset", "synthetic",
              "--checkpoint", "m.pt"], ["-e", "1"], ["-e", "2", "--resume"]),
            ([*torchrun_2, ROOT / "ddp_uneven.py", "--device", "cpu", "--zero", "--checkpoint", "u.pt"], ["-e", "1"],
             ["-e", "2", "--resume"])]
    for command, first, then in runs:
        run_bounded([*command, *first], tmp_path, timeout=240)
        shrunk_exp_avg(tmp_path / command[command.index("--checkpoint") + 1])
        result = run_bounded([*command, *then], tmp_path, timeout=240, check=False)
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert result.returncode in (1, 2) and len(errors) == 1 and "another optimizer's state" in errors[0], str(result)
        launcher = 1 if "ChildFailedError" in result.stderr else 0  # torchrun's own, for the worker that exited 2
        assert result.stderr.count("Traceback (most recent call last)") == launcher, str(result)


# ---------------------------------------------------------------- fuzz: seeded mutations of the three files
SEED, COUNT = 30, 300


def mutate(data, rng):
    """One random byte-level mutation: flip, overwrite, insert, delete, duplicate or truncate."""
    data = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(max(1, len(data)))
        kind = rng.randrange(6)
        if kind == 0 and data:
            data[at] ^= 1 << rng.randrange(8)
        elif kind == 1 and data:
            data[at] = rng.randrange(256)
        elif kind == 2:
            data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif kind == 3:
            del data[at:at + rng.randint(1, 16)]
        elif kind == 4:
            data[at:at] = data[at:at + rng.randint(1, 64)]
        else:
            del data[at:]
    return bytes(data)


def loads_or_one_line(call, capsys):
    """`call` returns, or ends with one `error:` line and exit code 2; never another exception."""
    capsys.readouterr()
    try:
        call()
        return "loaded"
    except SystemExit as exited:
        err = capsys.readouterr().err.strip().splitlines()
        assert exited.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
        return "refused"


def outside_files(root):
    """Every file under `root` but the checkpoint folder and the fuzzed single file: size and mtime."""
    return sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")
                  if p.relative_to(root).parts[0] not in ("ck", "single.pt"))


@pytest.mark.timeout(600)
def test_fuzz_the_readers_in_process(ck, capsys):
    """COUNT mutations each of .metadata, latest.json, a harness checkpoint file and (re-zipped, so the
    mutations reach the pickle bound and the state checks) that file's data.pkl, seeded (SEED): each loads
    (and the optimizer steps on what it loaded) or is one error line within 10 s, and nothing outside the
    checkpoint folder changes."""
    rng, outcomes = random.Random(SEED), {}
    single = ck.parent / "single.pt"
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epochs_run": 1}
    torch.save(saved, single)
    with zipfile.ZipFile(single) as archive:
        pickled = archive.read(next(n for n in archive.namelist() if n.endswith("/data.pkl")))
    originals = {name: path.read_bytes() for name, path in
                 (("metadata", metadata_path(ck)), ("pointer", ck / "latest.json"), ("single", single))}
    originals["pickle"] = pickled
    calls = {"metadata": lambda: fsdp.read_metadata(str(ck / "step-00000004")),
             "pointer": lambda: fsdp.read_pointer(str(ck)), "single": lambda: resume_single(single, model),
             "pickle": lambda: resume_single(single, model)}
    writers = {"metadata": metadata_path(ck).write_bytes, "pointer": (ck / "latest.json").write_bytes,
               "single": single.write_bytes, "pickle": lambda data: pt_with_pickle(single, data, saved)}
    before = outside_files(ck.parent)
    for name in originals:
        for i in range(COUNT):
            writers[name](mutate(originals[name], rng))
            start = time.monotonic()
            outcome = loads_or_one_line(calls[name], capsys)
            assert time.monotonic() - start < 10, (name, i)
            outcomes[(name, outcome)] = outcomes.get((name, outcome), 0) + 1
        writers[name](originals[name])
    assert outside_files(ck.parent) == before
    assert all(outcomes.get((name, "refused")) for name in originals), outcomes


def resume_single(path, model):
    """What ddp_gpus_torchrun's --resume does with its snapshot (and its Ctrl-C line), then one step."""
    optimizer = torch.optim.AdamW(model.parameters())
    ddp_gpus_torchrun.describe_checkpoint(str(path))
    state = ddp_gpus_torchrun.load_checkpoint(str(path), ("model", "optimizer", "epochs_run"), model)
    ddp_gpus_torchrun.check_optimizer_state(str(path), state["optimizer"], optimizer)
    optimizer.load_state_dict(state["optimizer"])
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()


# ---------------------------------------------------------------- slow: through real launches
def fsdp_launch(cwd, *args, n=1, timeout=240):
    """One process: plain `python` (a world of one, its exit code the script's own); more: torchrun."""
    launcher = [sys.executable] if n == 1 else [*torchrun_cmd(), "--standalone", f"--nproc-per-node={n}"]
    return run_bounded([*launcher, ROOT / "fsdp_transformer.py", *TINY, "--data", "text.txt", *map(str, args)], cwd,
                       timeout=timeout, check=False)


def one_error_line(result, *words):
    """Exactly one `error:` line, exit code 2 (one process) and no traceback."""
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1 and all(w in errors[0] for w in words), str(result)
    assert "Traceback (most recent call last)" not in result.stderr, str(result)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_fuzz_sample_and_attacks_through_real_launches(ck):
    """20 of the fuzz's mutations and the issue's attacks, each through a real launch: one error line
    from the worker (torchrun then exits 1), or a resume that finishes; no payload runs."""
    rng, work = random.Random(SEED), ck.parent
    marker = work / "payload-ran"
    shutil.copytree(ck, work / "pristine-copy")
    originals = {p: p.read_bytes() for p in (metadata_path(ck), ck / "latest.json")}
    cases = [(p, mutate(data, rng)) for p, data in originals.items() for _ in range(10)]
    cases += [(metadata_path(ck), b"\x80\x04" + stack_global(MD, "os.system") + su(f"touch {marker}") + b"\x85R0"
               + originals[metadata_path(ck)][2:]),
              (ck / "latest.json", json.dumps({**json.loads(originals[ck / "latest.json"]), "folder": ".."}).encode())]
    for path, data in cases:
        path.write_bytes(data)
        result = fsdp_launch(work, "--checkpoint", "ck", "--resume", "--max_steps", 5)
        if result.returncode == 0:
            assert "resuming from ck" in result.stdout, str(result)
        else:
            one_error_line(result)
        shutil.rmtree(ck)
        shutil.copytree(work / "pristine-copy", ck)
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_save_killed_at_any_point_leaves_a_save_that_resumes(ck):
    """A resumed run on another text's checkpoint used to delete the committed folder before its own
    save was complete. Here a resumed run saves every step from its first; its saving rank is
    SIGKILLed at points spread over the saves (the launch and its first save included); each time the
    pointer names a complete save that resumes, and a second run on the folder is refused while one holds it."""
    work = ck.parent
    for attempt, delay in enumerate((0.0, 0.15, 0.3, 0.6, 1.0, 2.0)):
        proc = subprocess.Popen([*map(str, torchrun_cmd()), "--standalone", "--nproc-per-node=2",
                                 str(ROOT / "fsdp_transformer.py"), *TINY, "--data", "text.txt", "--checkpoint", "ck",
                                 "--resume", "--max_steps", "400", "--save_every_steps", "1"], cwd=work,
                                env=cpu_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            line = ""
            while "resuming from" not in line and time.monotonic() < deadline:
                line = proc.stdout.readline()
                if not line and proc.poll() is not None:
                    break
            if attempt == 0:
                second = fsdp_launch(work, "--checkpoint", "ck", "--resume", "--max_steps", 500)
                one_error_line(second, "in use by another run")
            time.sleep(delay)
            workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
            for pid in workers[:1]:  # one worker (either rank): the job dies mid-save or between saves
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            proc.wait(timeout=120)
        finally:
            kill_group(proc)
            proc.communicate()
        pointer = json.loads((ck / "latest.json").read_text())
        assert (ck / pointer["folder"] / ".metadata").exists(), pointer
    result = fsdp_launch(work, "--checkpoint", "ck", "--resume", "--max_steps", pointer["step"] + 1, n=2)
    assert result.returncode == 0 and f"step {pointer['step']}," in result.stdout, str(result)


# ---------------------------------------------------------------- issue 42: links, widths, values
import errno  # noqa: E402  (here: the tests above this section are another change's)


def tensors_of(model):
    """What the Run saves of `model` and an AdamW over it."""
    trainer = fsdp.Run.__new__(fsdp.Run)
    trainer.model, trainer.optimizer = model, torch.optim.AdamW(model.parameters())
    return trainer.tensors()[0]


def a_model(ck):
    return fsdp.Transformer(**json.loads((ck / "latest.json").read_text())["config"])


def another_runs_save(ck, where, scale=2.0):
    """The save of another run beside ours: the same shapes, other weights (ours x `scale`)."""
    torch.manual_seed(0)
    model = a_model(ck)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    dcp.save(tensors_of(model), storage_writer=FileSystemWriter(str(where)))


def test_a_hard_link_or_a_fifo_planted_in_the_save_is_refused_unread(ck, capsys):
    """Class 4: a hard link has no link of its own to see (O_NOFOLLOW passes it): one link is checked on
    the descriptor, as are a FIFO's type and (open without O_NONBLOCK would wait) the time it takes."""
    other = ck.parent / "other"
    another_runs_save(ck, other)
    distcp = ck / "step-00000004" / "__0_0.distcp"
    os.remove(distcp)
    os.link(other / "__0_0.distcp", distcp)
    before = (other / "__0_0.distcp").stat().st_atime_ns
    refused(lambda: resume(ck), capsys, "__0_0.distcp", "2 links")
    os.remove(distcp)
    os.mkfifo(distcp)
    start = time.monotonic()
    refused(lambda: resume(ck), capsys, "__0_0.distcp", "not a plain file")
    assert time.monotonic() - start < 30 and (other / "__0_0.distcp").stat().st_atime_ns == before


def test_a_save_at_step_10_to_the_8_resumes_and_replaces_the_8_digit_one(ck, capsys):
    """Class 7: a pointer at step 99,999,999; the next save is `step-100000000` (9 digits), committed, and
    the 8-digit folder deleted: the next --resume used to refuse the 9-digit name, the checkpoint lost."""
    shutil.rmtree(ck)
    pointer = write_save(ck, ck.parent / "text.txt", step=99_999_999)
    assert resume(ck)["folder"] == "step-99999999"
    folder = fsdp.save_folder(str(ck), 100_000_000, "step-99999999")
    fsdp.save_tensors(tensors_of(a_model(ck)), str(ck), folder)
    fsdp.commit_checkpoint(str(ck), folder, {**pointer, "step": 100_000_000})
    assert sorted(os.listdir(ck)) == [".lock", "latest.json", "step-100000000"]
    assert resume(ck)["step"] == 100_000_000
    for name in ("step-099999999", "step-0000000004"):  # one name a step: no second spelling of it
        os.rename(ck / "step-100000000", ck / name)
        (ck / "latest.json").write_text(json.dumps({**pointer, "folder": name}))
        refused(lambda: resume(ck), capsys, "latest.json", "folder")
        os.rename(ck / name, ck / "step-100000000")


def test_a_lock_hard_linked_to_an_outside_file_is_refused_and_not_written(ck, capsys):
    """Class 8: `.lock` a hard link to a file outside: it was truncated and given the pid."""
    victim = ck.parent / "victim.txt"
    victim.write_text("keep")
    os.link(victim, ck / ".lock")
    fsdp.LOCKED.clear()
    refused(lambda: fsdp.lock_checkpoint_folder(str(ck)), capsys, "cannot lock", "2 links")
    assert victim.read_text() == "keep" and not fsdp.LOCKED


def test_chunks_that_leave_part_of_a_tensor_unsaved_are_refused(ck, capsys):
    """Class 9: a chunk one row short (or two chunks over the same rows): the resume left that row at its
    fresh initialization, exit 0."""
    def short(metadata):
        entry = metadata.state_dict_metadata["model.embedding.weight"]
        entry.chunks[0].sizes = torch.Size([entry.size[0] - 1, *entry.size[1:]])

    def twice(metadata):
        entry = metadata.state_dict_metadata["model.embedding.weight"]
        entry.chunks.append(entry.chunks[0])
    original = metadata_path(ck).read_bytes()
    for change in (short, twice):
        metadata_path(ck).write_bytes(original)
        rewritten(ck, change)
        refused(lambda: resume(ck), capsys, "refused unread", "model.embedding.weight", "unsaved or save them twice")


def test_a_global_batch_beyond_the_texts_epoch_is_refused_at_once(ck, capsys):
    """Class 9: 65,536 windows a step on a text of fewer: the first step ran past 120 s (a forward per
    micro-batch, nearly all of them empty)."""
    pointer = json.loads((ck / "latest.json").read_text())
    for batch in (2 ** 16, 10 ** 4):
        (ck / "latest.json").write_text(json.dumps({**pointer, "global_batch": batch}))
        start = time.monotonic()
        refused(lambda: resume(ck), capsys, f"global batch of {batch}")
        assert time.monotonic() - start < 10


def test_a_refused_metadata_changes_no_function_class_or_member(ck, capsys):
    """Class 9: BUILD's (state, slots) form calls setattr, which reaches what vars() does not show: a
    function's __defaults__, a class's __name__, an enum member's __class__ (it became another class,
    process-wide). Each is refused before it is set."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, Metadata
    member = stack_global(MD, "_MEM_FORMAT_ENCODING") + b"K\x00\x85R"
    for target, name, value in ((stack_global("torch.serialization", "_get_layout"), "__defaults__",
                                 su("torch.strided") + b"\x85"),
                                (stack_global(MD, "Metadata"), "__name__", su("Storage")),
                                (member, "__class__", stack_global(MD, "StorageMeta"))):
        metadata_path(ck).write_bytes(b"\x80\x04" + target + b"N}" + su(name) + value + b"s\x86b.")
        refused(lambda: resume(ck), capsys, "refused unread", "sets attributes of")
    assert torch.serialization._get_layout.__defaults__ is None and Metadata.__name__ == "Metadata"
    assert type(_MEM_FORMAT_ENCODING(0)) is _MEM_FORMAT_ENCODING


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_naming_the_tensor(ck, capsys, value):
    """Class 9: a save whose weights hold a NaN resumed and ended in `replicas: DIFFER ... fingerprint nan`."""
    model = a_model(ck)
    with torch.no_grad():
        model.layers[0].ffn.fc1.weight[3, 5] = value
    shutil.rmtree(ck / "step-00000004")
    dcp.save(tensors_of(model), storage_writer=FileSystemWriter(str(ck / "step-00000004")))
    refused(lambda: resume(ck), capsys, "NaN or an infinity", "model.layers.0.ffn.fc1.weight")


def failing_fsync(monkeypatch, code, part):
    """os.fsync fails with `code` (where a full disk or a read-only file system says so) for the files
    whose name holds `part`."""
    real = os.fsync

    def fsync(fd):
        if part in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(code, os.strerror(code))
        return real(fd)
    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_full_disk_or_a_read_only_folder_at_save_time_is_one_line_and_keeps_the_save(ck, capsys, monkeypatch,
                                                                                      code):
    """Class 9: the shards' write (DCP) or the pointer's failing: a traceback. Now one line, the folder of
    the failed save removed, the pointer and its save as they were, and they resume."""
    pointer, kept = (ck / "latest.json").read_bytes(), sorted(os.listdir(ck / "step-00000004"))
    tensors = tensors_of(a_model(ck))
    with monkeypatch.context() as patched:
        failing_fsync(patched, code, ".distcp")
        folder = fsdp.save_folder(str(ck), 5, "step-00000004")
        refused(lambda: fsdp.save_tensors(tensors, str(ck), folder), capsys, os.strerror(code), "previous save")
    folder = fsdp.save_folder(str(ck), 5, "step-00000004")
    fsdp.save_tensors(tensors, str(ck), folder)
    with monkeypatch.context() as patched:
        failing_fsync(patched, code, "latest.json.tmp")
        refused(lambda: fsdp.commit_checkpoint(str(ck), folder, {**json.loads(pointer), "step": 5}), capsys,
                os.strerror(code), "latest.json")
    assert sorted(os.listdir(ck)) == ["latest.json", "step-00000004"]
    assert (ck / "latest.json").read_bytes() == pointer and sorted(os.listdir(ck / "step-00000004")) == kept
    assert resume(ck)["step"] == 4


@pytest.mark.parametrize("plant", ["hard link", "symbolic link"])
def test_a_name_planted_in_a_new_save_folder_is_not_written_through(ck, capsys, plant):
    """Class 8, writing: a `__0_0.distcp` planted in the fresh save folder before DCP writes it, a hard
    link or a link to a file outside: DCP opened it by path and truncated that file. Each file of a save
    is now created new in the folder's descriptor: the save fails in one line, the file outside is
    untouched, and the pointer's save is kept."""
    victim = ck.parent / "victim.bin"
    victim.write_bytes(b"keep" * 1000)
    folder = fsdp.save_folder(str(ck), 5, "step-00000004")
    (os.link if plant == "hard link" else os.symlink)(victim, ck / folder / "__0_0.distcp")
    refused(lambda: fsdp.save_tensors(tensors_of(a_model(ck)), str(ck), folder), capsys, "File exists",
            "previous save")
    assert victim.read_bytes() == b"keep" * 1000 and not (ck / folder).exists() and resume(ck)["step"] == 4
