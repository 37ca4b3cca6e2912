"""Issue 22, a new user's first hour: the flags each script takes, checkpoints that never surprise,
a failure under torchrun that torchrun reports as the root cause, help text that says each default
once, and the README's "Port your own training loop" (README.md) followed literally.

Two launches in the default tier (the port and the root cause); everything else is in-process.
"""
import contextlib
import importlib.util
import io
import re
import sys

import pytest
import torch

from conftest import ROOT, cpu_env

# The contract's flags, script by script: what the README's table promises and --help must show.
FLAGS = ("--epochs", "--batch_size", "--lr", "--seed", "--device", "--backend", "--nprocs", "--metrics",
         "--checkpoint", "--resume", "--timeout")
COMMON = {"--epochs", "--batch_size", "--lr", "--seed", "--device", "--backend", "--metrics", "--timeout"}
TAKES = {
    "ddp_minimal.py": {"--device", "--nprocs"},
    "ddp_gpus.py": COMMON | {"--nprocs"},
    "ddp_gpus_torchrun.py": COMMON | {"--checkpoint", "--resume"},
    "ddp_template.py": COMMON | {"--checkpoint", "--resume"},
    "ddp_main.py": COMMON | {"--nprocs", "--checkpoint", "--resume"},
    "ddp_main_torchrun.py": COMMON | {"--checkpoint", "--resume"},
    "ddp_transformer.py": COMMON | {"--checkpoint", "--resume"},
    "fsdp_transformer.py": COMMON | {"--checkpoint", "--resume"},
    "ddp_uneven.py": COMMON | {"--checkpoint", "--resume"},
    "ddp_comm_hooks.py": COMMON,
    "ddp_unused.py": COMMON,
    "ddp_desync.py": COMMON | {"--checkpoint", "--resume"},
    "ddp_slow.py": COMMON - {"--epochs"},  # it trains --max_steps
    "ddp_bandwidth.py": {"--device", "--backend", "--metrics", "--timeout"},  # a probe: it trains nothing
    "dp_baseline.py": COMMON | {"--nprocs"},
}
TORCHRUN_SCRIPTS = ("ddp_gpus_torchrun.py", "ddp_template.py", "ddp_main_torchrun.py", "ddp_transformer.py", "ddp_uneven.py",
                    "ddp_comm_hooks.py", "ddp_unused.py", "ddp_desync.py", "fsdp_transformer.py", "ddp_bandwidth.py")


def load(name):
    spec = importlib.util.spec_from_file_location(name[:-3], ROOT / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def help_text(name, monkeypatch):
    module, out = load(name), io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        if hasattr(module, "parse_args"):
            module.parse_args(["--help"])
        else:  # ddp_minimal.py parses in main()
            monkeypatch.setattr(sys, "argv", [name, "--help"])
            module.main()
    return out.getvalue()


def test_the_table_names_every_script():
    from test_layout import SCRIPTS
    assert set(TAKES) == {*SCRIPTS, "ddp_minimal.py"}, "a script missing from TAKES (and the README's flags table)"


@pytest.mark.parametrize("name", sorted(TAKES))
def test_each_script_takes_the_flags_the_table_says(name, monkeypatch):
    """The flags table (the README's flags table) is what --help shows, and
    --help says each default once: never its own `(default: ...)` and argparse's appended one too."""
    text = help_text(name, monkeypatch)
    shown = {flag for flag in FLAGS if re.search(re.escape(flag) + r"\b", text)}
    assert shown == TAKES[name], f"{name}: --help shows {sorted(shown)}"
    entries = re.split(r"\n\s+(?=-)", text)
    doubled = [" ".join(e.split()) for e in entries if len(re.findall(r"\(default", e)) > 1 or "(default: None)" in e]
    assert not doubled, doubled


@pytest.mark.parametrize("name", TORCHRUN_SCRIPTS)
def test_a_torchrun_script_given_nprocs_says_how_to_launch_it(name, capsys):
    module = load(name)
    with pytest.raises(SystemExit) as exit_:
        module.parse_args(["--nprocs", "2"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: ") and f"torchrun --standalone --nproc-per-node=N {name}" in lines[0]


@pytest.mark.parametrize("name", sorted(set(TAKES) - {"ddp_minimal.py"}))
def test_a_mistyped_flag_is_one_line_and_no_abbreviation_is_guessed(name, capsys, monkeypatch):
    """Issue 52: `--batch` was argparse's "ambiguous option: could match --batch_size, --batch-size" with the usage;
    abbreviations are off, and any mistake argparse finds is one `error:` line naming --help, exit 2."""
    monkeypatch.delenv("RANK", raising=False)
    module = load(name)
    typed = "--warmup" if name == "ddp_bandwidth.py" else "--seed"  # a probe draws nothing: no --seed
    for argv, said in ((["--batch", "8"], "unrecognized arguments: --batch 8"),
                       ([typed, "x"], "invalid int value: 'x'")):
        with pytest.raises(SystemExit) as exit_:
            module.parse_args(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1 and "usage:" not in err, err
        assert err.startswith("error: ") and said in err and "--help)" in err, err


def test_a_mistyped_flag_under_torchrun_is_said_once_and_is_the_root_cause(launch, torchrun, script):
    """Issue 52: every process parses, so argparse's usage and error came once per rank, and torchrun's root
    cause said only `To enable traceback see ...`; now rank 0 says it once, and that line is the root cause."""
    r = launch([*torchrun, "--standalone", "--nproc-per-node=2", script("ddp_gpus_torchrun.py"), "--device", "cpu",
                "--batch", "8"], timeout=120, check=False)
    ours = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert r.returncode != 0 and ours == ["error: unrecognized arguments: --batch 8 (see ddp_gpus_torchrun.py --help)"], r
    assert "usage:" not in r.stderr, r
    root = r.stderr.split("Root Cause (first observed failure):", 1)
    assert len(root) == 2 and re.search(r"traceback\s*:\s*" + re.escape(ours[0]), root[1]), r
    assert "exitcode  : 2" in root[1], root[1]


def test_another_runs_checkpoint_needs_resume_and_nothing_left_says_so(tmp_path, monkeypatch, capsys):
    """continue_checkpoint (the harness): this job's checkpoint is continued unasked, another run's only
    with --resume, and without it one line names the file, its epoch, the run that wrote it and the ways on."""
    for name in ("RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_ERROR_FILE"):
        monkeypatch.delenv(name, raising=False)
    harness, path = load("ddp_gpus_torchrun.py"), str(tmp_path / "ck.pt")
    assert harness.continue_checkpoint(path, False) is False  # nothing there: a fresh start
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    harness.save_checkpoint({"epochs_run": 3}, path)
    assert harness.continue_checkpoint(path, False) is True  # this job's own: a torchrun restart continues it
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    assert harness.continue_checkpoint(path, True) is True  # asked
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        harness.continue_checkpoint(path, False)
    line = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and "\n" not in line, line
    for part in (path, "epoch 3", "torchrun job job-a", "world size 1", "--resume", "delete it",
                 "another --checkpoint"):
        assert part in line, (part, line)
    with pytest.raises(SystemExit):
        harness.continue_checkpoint(str(tmp_path / "none.pt"), True)
    assert "--resume but there is no checkpoint at" in capsys.readouterr().err
    assert harness.say_if_nothing_left(path, "epoch", 3, "--epochs", 3) is True
    said = capsys.readouterr().out
    assert said.startswith(f"nothing to train: {path} is at epoch 3 and --epochs 3") and "nan" not in said
    assert harness.say_if_nothing_left(path, "epoch", 3, "--epochs", 4) is False
    assert [harness.plural(1, "process"), harness.plural(2, "process"), harness.plural(1, "rank"),
            harness.plural(8, "window"), harness.plural(2, "micro-batch"), harness.plural(4, "epoch")] == [
        "1 process", "2 processes", "1 rank", "8 windows", "2 micro-batches", "4 epochs"]


# missing: found before the process group is joined (seconds); unreadable: found after, by the Trainer
@pytest.mark.parametrize("checkpoint,said", [("missing", "no checkpoint at missing.pt"),
                                             pytest.param("unreadable", "unreadable.pt", marks=pytest.mark.slow)])
def test_torchrun_reports_our_error_line_as_the_root_cause(checkpoint, said, launch, torchrun, script, tmp_path):
    """A problem only a worker can find (its checkpoint under --resume: not on this machine, or not
    readable) is one `error:` line, and torchrun's report names that line as the root cause, through
    TORCHELASTIC_ERROR_FILE, ahead of the rank torchrun then stopped with SIGTERM."""
    if checkpoint == "unreadable":
        (tmp_path / "unreadable.pt").write_bytes(b"not a checkpoint")
    r = launch([*torchrun, "--standalone", "--nproc-per-node=2", script("ddp_gpus_torchrun.py"), "--device", "cpu",
                "--checkpoint", f"{checkpoint}.pt", "--resume"], timeout=120, check=False)
    ours = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert r.returncode != 0 and len(ours) == 1 and said in ours[0], r
    root = r.stderr.split("Root Cause (first observed failure):", 1)
    assert len(root) == 2, r
    assert re.search(r"traceback\s*:\s*" + re.escape(ours[0]), root[1]), root[1]
    assert "exitcode  : 2" in root[1], root[1]


# A rank-local update: in every process of the launch (sitecustomize.py, found on PYTHONPATH, runs at start-up),
# rank 1 alone moves one weight by 1e-6 after each SGD step; nothing else of the script changes.
NUDGE = """import torch
import torch.distributed as dist

_step = torch.optim.SGD.step


def _nudged(self, *args, **kwargs):
    result = _step(self, *args, **kwargs)
    if dist.is_initialized() and dist.get_rank() == 1:
        with torch.no_grad():
            self.param_groups[0]["params"][0].view(-1)[0] += 1e-6
    return result


torch.optim.SGD.step = _nudged
"""


@pytest.mark.slow
def test_torchrun_reports_a_replica_mismatch_as_the_root_cause(launch, torchrun, script, tmp_path):
    """Issue 44: replicas that differ after training were `error_file: <N/A>` in torchrun's report. Now rank 0
    says which tensor differs, on stdout and as its error (TORCHELASTIC_ERROR_FILE): torchrun's Root Cause
    shows that line with rank 0's exit code 1 (the other ranks wait at exit to be stopped); the job exits 1
    (torchrun's code), no traceback of ours."""
    (tmp_path / "nudge").mkdir()
    (tmp_path / "nudge" / "sitecustomize.py").write_text(NUDGE)
    r = launch([*torchrun, "--standalone", "--nproc-per-node=2", script("ddp_gpus_torchrun.py"), "--device", "cpu",
                "-e", "1"], timeout=120, check=False, env=cpu_env(PYTHONPATH=tmp_path / "nudge"))
    assert r.returncode == 1 and "replicas: DIFFER on ranks [1] in parameter weight (2 ranks" in r.stdout, r
    ours = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and ours[0].startswith("error: the replicas differ after training: ranks [1] in parameter "
                                                 "weight ("), r
    root = r.stderr.split("Root Cause (first observed failure):", 1)
    assert len(root) == 2 and re.search(r"traceback\s*:\s*" + re.escape(ours[0]), root[1]), r
    assert "exitcode  : 1 " in root[1], root[1]  # rank 0's own code: the other rank waited to be stopped
    assert not re.search(r"^\[rank\d\]: Traceback", r.stderr, re.M), r  # torchrun's own report has one; ours none


# ---------------------------------------------------------------- "Port your own training loop", literally
# What a user puts at the three `# PORT` places of their copy: a 2-class MLP on a separable 2-D set
# (test_porting.py launches the copy: it learns, validates exactly, resumes exactly, survives DETAIL).
PORTED = {
    "data": ["g = torch.Generator().manual_seed(args.seed)",
             "points = torch.randn(args.samples, 2, generator=g)",
             "dataset = torch.utils.data.TensorDataset(points, (points[:, 0] + 0.5 * points[:, 1] > 0).long())"],
    "model": ["model = torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))"],
    "loss": ["loss = F.cross_entropy(model(inputs), targets)"],
}


def port(source):
    """The section's step 2: replace the line below each `# PORT (place):` comment."""
    lines = source.splitlines(keepends=True)
    for place, new in PORTED.items():
        at = [i for i, line in enumerate(lines) if line.strip().startswith(f"# PORT ({place}):")]
        assert len(at) == 1, f"one `# PORT ({place}):` mark in the starting script, found {len(at)}"
        indent = re.match(r"\s*", lines[at[0]]).group()
        lines[at[0] + 1] = "".join(f"{indent}{line}\n" for line in new)
    return "".join(lines)


@pytest.mark.slow  # the default suite checks continue_checkpoint and say_if_nothing_left in this process
def test_rerun_is_refused_and_a_finished_resume_trains_nothing(launch, script, metrics, tmp_path):
    """The issue's first hour, through real launches: a rerun finds the first run's snapshot and stops
    with one line; --resume with nothing left says so, and prints no nan and no 0 samples/s."""
    cmd = [sys.executable, script("ddp_gpus_torchrun.py"), "--device", "cpu", "-e", "2", "--samples", "256"]
    launch(cmd, timeout=120)
    rerun = launch(cmd, timeout=120, check=False)
    assert rerun.returncode == 2 and rerun.stderr.strip().splitlines() == [
        "error: ddp_gpus_torchrun.pt holds a checkpoint at epoch 2 written by a run outside torchrun at world size 1, "
        "not this job's (pass --resume to continue it; to start afresh delete it or pass another --checkpoint)"], rerun
    done = launch(cmd + ["--resume", "--metrics", "m.json"], timeout=120)
    assert "nothing to train: ddp_gpus_torchrun.pt is at epoch 2 and --epochs 2 ends the run there" in done.stdout
    assert done.stdout.strip().splitlines()[-1].endswith("| 2 epochs | nothing trained (resumed at epoch 2) | "
                                                         "replicas in sync"), done
    assert "nan" not in done.stdout and " 0 samples/s" not in done.stdout, done
    m = metrics(tmp_path / "m.json")
    assert (m["steps"], m["first_loss"], m["samples_per_s"], m["resumed_from_epoch"]) == (0, None, None, 2), m


def test_resume_on_other_text_names_the_data_not_the_sizes(tmp_path, monkeypatch, capsys):
    """ddp_transformer.py --resume with another --data: the vocabulary differs, and with it vocab_size, a
    size the user never passed; the line names the data (the cause), not the sizes."""
    for name in ("RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"):
        monkeypatch.delenv(name, raising=False)
    transformer, path = load("ddp_transformer.py"), tmp_path / "ck.pt"
    args = transformer.check_args(transformer.parse_args(["--device", "cpu", "--checkpoint", str(path)]))
    first_vocab = "abcdefghij"
    torch.save({"model": {}, "optimizer": {}, "scaler": {}, "config": transformer.model_config(args, first_vocab),
                "vocab": first_vocab, "epoch": 0, "step": 5, "windows_in_epoch": 40, "global_batch": 8,
                "batch_size": 8, "world_size": 1}, path)
    with pytest.raises(SystemExit) as exit_:
        transformer.read_checkpoint(args, ("", "a text", "abcdefghijklm"))
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(lines) == 1, lines
    assert "trained on other text (10 symbols; this text has 13)" in lines[0] and "--data" in lines[0], lines
    assert "vocab_size" not in lines[0] and "model sizes" not in lines[0], lines
