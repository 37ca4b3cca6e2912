"""docs/porting.md followed as a user follows it: `cp ddp_template.py mine.py`, then each section's code blocks
put into the copy as the guide says (a function of the same name replaced, a new one added above the
`# ---- beyond the lesson` line, an import added to the imports), launched under torchrun at 2 processes on
CPU with gloo. Each port must learn, agree across replicas, and match its world-of-one run where the maths
says it must. The template itself: flags, exact validation, exact resume, DETAIL."""
import ast
import contextlib
import math
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
GUIDE = ROOT / "docs" / "porting.md"
BANNER = "# ---- beyond the lesson"
TEMPLATE = pytest.mark.xdist_group("porting_template")  # one worker each: the module's launches are shared
LSTM_GROUP = pytest.mark.xdist_group("porting_lstm")


def blocks(heading):
    """The ```python blocks of the guide's section under `heading` (to the next heading of its level or above)."""
    text = GUIDE.read_text()
    level = re.match(r"#+", heading).group()
    start = text.index(f"\n{heading}\n")
    end = re.search(rf"\n#{{1,{len(level)}}} ", text[start + len(heading) + 2:])
    section = text[start:start + len(heading) + 2 + end.start()] if end else text[start:]
    found = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    assert found, f"no python block under {heading}"
    return found


def port(source, *code):
    """The guide's rule: each top-level def/class/assignment of a block replaces the template's of the same
    name, or goes above the `# ---- beyond the lesson` line; each import goes after the template's imports."""
    for block in code:
        tree = ast.parse(block)
        lines = block.splitlines(keepends=True)
        for node in tree.body:
            first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            piece = "".join(lines[first - 1:node.end_lineno])
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                if piece not in source:
                    at = source.index("\n\n", source.index("\nfrom torch.utils.data import")) + 1
                    source = source[:at] + piece + source[at:]
                continue
            name = node.targets[0].id if isinstance(node, ast.Assign) else node.name
            template = ast.parse(source)
            old = next((n for n in template.body if (n.targets[0].id if isinstance(n, ast.Assign) and
                        isinstance(n.targets[0], ast.Name) else getattr(n, "name", None)) == name), None)
            src_lines = source.splitlines(keepends=True)
            if old is not None:
                start = min([old.lineno] + [d.lineno for d in getattr(old, "decorator_list", [])]) - 1
                source = "".join(src_lines[:start]) + piece + "".join(src_lines[old.end_lineno:])
            else:
                at = source.index(f"\n{BANNER}") + 1
                source = source[:at] + piece + "\n\n" + source[at:]
    return source


def write_port(tmp_path, *code, name="mine.py"):
    mine = tmp_path / name
    mine.write_text(port((ROOT / "ddp_template.py").read_text(), *code))
    ast.parse(mine.read_text())
    return mine


def read(path):
    return json.loads(Path(path).read_text())


def fingerprint(out):
    return re.search(r"replicas: in sync \(2 ranks, fingerprint (\S+)\)", out).group(1)


def imported(path, name):
    """A script as a module (importing starts nothing)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def world_of_one(tmp_path, monkeypatch):
    """A process group of this test process alone (gloo), as a plain `python mine.py` has."""
    import torch.distributed as dist
    for name in ("RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_ERROR_FILE"):
        monkeypatch.delenv(name, raising=False)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- the template itself
def template(mine, *args):
    from conftest import torchrun_cmd
    return [*torchrun_cmd(), "--standalone", "--nproc-per-node=2", mine, "--device", "cpu", *args]


@pytest.fixture(scope="module")
def template_run(tmp_path_factory):
    """The README's three steps followed literally (test_newcomer's lines at the `# PORT` marks of a copy,
    mine.py) in a folder where the template's own checkpoint lies; launched at 2 processes for 3 epochs
    under TORCH_DISTRIBUTED_DEBUG=DETAIL."""
    import torch
    from conftest import cpu_env, run_bounded
    from test_newcomer import port as readme_port
    work = tmp_path_factory.mktemp("template")
    mine = work / "mine.py"
    mine.write_text(readme_port((ROOT / "ddp_template.py").read_text()))
    original = work / "ddp_template.pt"  # what `torchrun ... ddp_template.py` leaves: another model's
    torch.save({"model": torch.nn.Linear(20, 1).state_dict(), "optimizer": {"state": {}, "param_groups": []},
                "epoch": 5, "job": "an-earlier-job", "world_size": 2}, original)
    before = original.read_bytes()
    first = run_bounded(template(mine, "--epochs", "3", "--metrics", "first.json"), work, timeout=180,
                        env=cpu_env(TORCH_DISTRIBUTED_DEBUG="DETAIL"))
    assert original.read_bytes() == before, "the original's checkpoint was touched"
    return work, first


@TEMPLATE
def test_template_learns_validates_exactly_and_survives_detail(template_run):
    work, first = template_run
    m = read(work / "first.json")
    # 3095 training samples (4096 less the 1001 held out) in steps of 64 x 2
    assert m["script"] == "mine.py" and m["world_size"] == 2 and m["epochs"] == 3, m
    assert m["steps"] == 3 * 25 and m["steps_per_epoch"] == 25 and m["resumed_from_epoch"] == 0, m
    assert m["val_samples"] == 1001 and m["val_accuracy"] > 0.9 and m["val_loss"] < 0.5 * m["val_losses"][0], m
    assert m["final_loss"] < 0.5 * m["first_loss"] and m["final_loss"] < 0.25 and m["replicas_in_sync"], m
    assert m["best_val_loss"] == min(m["val_losses"]), m
    # DETAIL checks every collective; DDP's own group is the unchecked one (a checked one: SIGSEGV)
    assert "replicas: in sync (2 ranks" in first.stdout and "epoch 3, step 75 |" in first.stdout, first
    assert "Traceback" not in first.stderr and "error" not in first.stderr.lower().replace("error_file", ""), first


@TEMPLATE
def test_template_checkpoint_holds_the_whole_run(template_run):
    """...and is named by its epoch, the run's unit, in the line a rerun or Ctrl-C prints (a top-level "step"
    made them say `step 75`)."""
    import torch
    work, _ = template_run
    state = torch.load(work / "mine.pt", weights_only=True)
    assert {"model", "optimizer", "scheduler", "scaler", "epoch", "progress", "job", "world_size"} <= set(state)
    assert (state["epoch"], state["progress"]["step"], state["world_size"]) == (3, 75, 2), state["progress"]
    assert state["scheduler"]["last_epoch"] == 75 and len(state["progress"]["history"]) == 3
    mine = imported(work / "mine.py", "template_port")
    assert mine.describe_checkpoint(str(work / "mine.pt")) == f"checkpoint at epoch 3 kept in {work / 'mine.pt'}"


def test_every_port_place_is_found_by_grep():
    """`grep -n "# PORT"` lists every place, the flags and checks too (they said `\"\"\"PORT (flags)`), and the
    optimizer and its schedule are places: a port that keeps them trains the template's recipe."""
    source = (ROOT / "ddp_template.py").read_text()
    places = re.findall(r"PORT \((\w+)\)", source)
    assert len(places) == source.count("# PORT ("), [line for line in source.splitlines() if "PORT (" in line]
    assert set(places) == {"flags", "checks", "optimizer", "data", "model", "loss", "schedule", "evaluation", "state"}
    train = source[source.index("\ndef train("):source.index("\ndef main(")]
    assert "# PORT (schedule)" in train and "# PORT (schedule)" in source[source.index("\ndef train_one_epoch("):]


def test_flags_are_exact_and_clipping_is_off_unless_asked(capsys):
    """`--batch` was "ambiguous option: could match --batch_size, --batch-size" (argparse's prefixes against one
    flag's two spellings); now unrecognized, as any prefix. Every spelling the contract names still parses."""
    t = imported(ROOT / "ddp_template.py", "ddp_template_flags")
    with pytest.raises(SystemExit) as exit_:
        t.parse_args(["--batch", "8"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "error: unrecognized arguments: --batch 8" in err and "ambiguous" not in err, err
    assert [t.parse_args([flag, "8"]).batch_size for flag in ("--batch_size", "--batch-size", "-b")] == [8, 8, 8]
    assert [t.parse_args([flag, "2"]).epochs for flag in ("--epochs", "--max_epochs", "-e")] == [2, 2, 2]
    assert t.parse_args([]).clip == 0 and t.parse_args(["--clip", "1"]).clip == 1


def test_a_per_epoch_schedule_steps_at_its_mark(tmp_path, monkeypatch):
    """docs/porting.md's per-epoch schedule: StepLR(step_size=1, gamma=0.7) in build(), its step moved from the
    batch loop's `# PORT (schedule)` to the one in train(). Two epochs (8 steps each) train at the rate, then at
    0.7 of it, and the checkpoint holds the schedule after 2 steps (in the batch loop: 0.7^8 after the first epoch)."""
    import torch
    source = (ROOT / "ddp_template.py").read_text()
    source, made = re.subn(r"    warmup, half_life = .*?\n    scheduler = .*?\)\)\n",
                           "    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)\n",
                           source, flags=re.DOTALL)
    source, moved = re.subn(r"\n +scheduler\.step\(\)  # PORT \(schedule\).*", "", source)
    source, put = re.subn(r"\n( +)(# PORT \(schedule\).*)", r"\n\1\2\n\1scheduler.step()", source)
    assert (made, moved, put) == (1, 1, 1), (made, moved, put)
    (tmp_path / "mine.py").write_text(source)
    mine = imported(tmp_path / "mine.py", "template_per_epoch")
    argv = ["--device", "cpu", "-e", "2", "--samples", "256", "--val_samples", "10", "-b", "32",
            "--checkpoint", str(tmp_path / "mine.pt")]
    monkeypatch.setattr(sys, "argv", ["mine.py", *argv])
    with world_of_one(tmp_path, monkeypatch):
        assert mine.train(torch.device("cpu"), mine.check_args(mine.parse_args(argv)))
    state = torch.load(tmp_path / "mine.pt", weights_only=True)
    assert [h["lr"] for h in state["progress"]["history"]] == pytest.approx([3e-3, 3e-3 * 0.7]), state["progress"]
    assert state["scheduler"]["last_epoch"] == 2 and state["progress"]["step"] == 16, state


def test_template_resume_restores_every_entry_and_refuses_a_foreign_one(tmp_path, monkeypatch, capsys):
    """save() then resume() in this process, on a world of one: the weights, the optimizer, the schedule and
    the progress come back; a schedule entry of another kind is one line, exit 2."""
    import torch
    t = imported(ROOT / "ddp_template.py", "ddp_template_in_process")
    args = t.parse_args(["--device", "cpu", "--checkpoint", str(tmp_path / "t.pt"), "--hidden", "8"])
    with world_of_one(tmp_path, monkeypatch):
        model, optimizer, scheduler, scaler = t.build(args, torch.device("cpu"))
        model(torch.randn(4, 32)).sum().backward()
        optimizer.step()
        for _ in range(30):
            scheduler.step()
        progress = {"epoch": 2, "step": 30, "best_val_loss": 0.5, "history": [{"epoch": 1}, {"epoch": 2}]}
        t.save(model, optimizer, scheduler, scaler, progress, args)
        args.resume = True
        fresh = t.build(args, torch.device("cpu"))
        back = t.resume(*fresh, args, steps_per_epoch=15)
        assert back == progress and fresh[2].state_dict() == scheduler.state_dict(), back
        assert all(torch.equal(a, b) for a, b in zip(fresh[0].state_dict().values(), model.state_dict().values()))
        assert fresh[1].state_dict()["state"][0]["step"] == 1
        state = torch.load(args.checkpoint, weights_only=True)
        state["scheduler"] = torch.optim.lr_scheduler.StepLR(fresh[1], 5).state_dict()  # another schedule
        torch.save(state, args.checkpoint)
        with pytest.raises(SystemExit) as exit_:
            t.resume(*t.build(args, torch.device("cpu")), args, steps_per_epoch=15)
        assert exit_.value.code == 2 and capsys.readouterr().err.strip().splitlines() == [
            f"error: {args.checkpoint} is not a checkpoint of this script: its scheduler entry is not this run's "
            "scheduler (delete it to start afresh, or point --checkpoint at one this script wrote)"]


@pytest.mark.slow  # two more launches; the default tier checks what the checkpoint holds, and resume() in process
def test_template_resumes_exactly(template_run, launch, tmp_path):
    """Stopped after epoch 2 and resumed to 3: the weights of the uninterrupted 3 epochs, bit for bit (the
    sampler, the per-rank dropout seeds, the schedule and the optimizer all continue where they were)."""
    work, whole = template_run
    mine = work / "mine.py"
    launch(template(mine, "--epochs", "2", "--checkpoint", "part.pt"), timeout=180)
    resumed = launch(template(mine, "--epochs", "3", "--checkpoint", "part.pt", "--resume", "--metrics", "r.json"),
                     timeout=180)
    r, w = read(tmp_path / "r.json"), read(work / "first.json")
    assert "epochs 2 -> 3" in resumed.stdout and r["resumed_from_epoch"] == 2 and r["steps"] == 25, resumed
    assert fingerprint(resumed.stdout) == fingerprint(whole.stdout), (resumed, whole)
    assert r["losses"] == w["losses"] and r["val_losses"] == w["val_losses"], (r, w)


# ---------------------------------------------------------------- several inputs, a test set of one's own
SIAMESE = "### Several inputs per sample, and a test set of your own: a siamese network"


def test_siamese_port_learns_on_its_own_test_set(tmp_path):
    """The section's blocks: pairs of inputs through the template's loops (to_device moves the list, the model
    takes it whole, its encoder used twice in a forward), validated on a test set of their own, every pair once."""
    from conftest import run_bounded
    mine = write_port(tmp_path, *blocks(SIAMESE))
    r = run_bounded(template(mine, "--metrics", "m.json"), tmp_path, timeout=180)
    m = read(tmp_path / "m.json")
    assert (m["val_samples"], m["steps_per_epoch"], m["epochs"]) == (1001, 32, 5) and m["replicas_in_sync"], m
    # about half the pairs are "the same": always answering "different" scores 0.51 on this test set
    assert m["val_accuracy"] > 0.85 and m["val_loss"] < 0.4 * m["val_losses"][0], m
    assert "Traceback" not in r.stderr, r
    port_module = imported(mine, "siamese_port")
    train_set, test_set = port_module.datasets(port_module.parse_args(["--device", "cpu"]))
    assert (type(train_set).__name__, len(train_set), type(test_set).__name__, len(test_set)) == (
        "SamePairs", 4096, "SamePairs", 1001)  # the test set whole, not a part held out of the training set


# ---------------------------------------------------------------- a model with state: the LSTM section
def write_corpus(folder, seed=0):
    """A small text with a grammar an LSTM can learn: `the (adjective) noun verb the (adjective) noun .`"""
    import random
    rng = random.Random(seed)
    nouns, verbs = "cat dog bird fish horse mouse king queen child farmer".split(), "sees likes chases follows feeds finds".split()
    adjectives = "big small red old young happy".split()

    def phrase():
        return ["the"] + ([rng.choice(adjectives)] if rng.random() < 0.5 else []) + [rng.choice(nouns)]

    folder.mkdir()
    for name, lines in (("train.txt", 400), ("valid.txt", 50)):
        text = "\n".join(" ".join(" ".join(phrase() + [rng.choice(verbs)] + phrase() + ["."]) for _ in range(4))
                         for _ in range(lines))
        (folder / name).write_text(text + "\n")
    return folder


# the test's own instrument, not the guide's: each rank says its first draw after the epoch's reseed
DRAWS = '''
def seed_this_rank(seed, epoch):
    seed = hash((seed, epoch, dist.get_rank())) % 2 ** 63
    torch.manual_seed(seed)
    random.seed(seed)
    print0(f"draw of rank {dist.get_rank()} in epoch {epoch}: {torch.rand(()).item()!r}", every_rank=True)
'''
LSTM = ["--data", "corpus", "--bptt", "20", "--emsize", "32", "--nhid", "64", "--epochs", "2", "--dropout", "0"]


@pytest.fixture(scope="module")
def lstm_run(tmp_path_factory):
    """The section's port at 2 processes of 10 columns each, under torchrun."""
    from conftest import run_bounded, torchrun_cmd
    work = tmp_path_factory.mktemp("lstm")
    write_corpus(work / "corpus")
    mine = write_port(work, *blocks("### A model with state: an LSTM language model (truncated BPTT)"), DRAWS)
    two = run_bounded([*torchrun_cmd(), "--standalone", "--nproc-per-node=2", mine, "--device", "cpu", *LSTM,
                       "--batch-size", "10", "--metrics", "two.json"], work, timeout=180)
    return work, mine, two


@LSTM_GROUP
def test_lstm_port_learns(lstm_run):
    work, _, two = lstm_run
    m2 = read(work / "two.json")
    assert "data: corpus | vocabulary 26 |" in two.stdout, two
    assert m2["world_size"] == 2 and m2["replicas_in_sync"] and m2["val_ppl"] < 0.6 * math.exp(m2["val_losses"][0]), m2
    assert m2["val_ppl"] < 9 and m2["val_tokens"] > 1400, m2  # 26 words: chance is a perplexity of 26


@LSTM_GROUP
@pytest.mark.slow  # a second launch; the default tier checks that the port learns
def test_lstm_port_matches_its_world_of_one(lstm_run, launch):
    """1 process of 20 columns reads the same columns as 2 of 10, and the averaged gradient is the same."""
    from conftest import cpu_env
    work, mine, _ = lstm_run
    launch([sys.executable, mine, "--device", "cpu", *LSTM, "--batch-size", "20", "--checkpoint", "one.pt",
            "--metrics", "one.json"], cwd=work, timeout=180, env=cpu_env(OMP_NUM_THREADS=1))
    m2, m1 = read(work / "two.json"), read(work / "one.json")
    assert m2["val_tokens"] == m1["val_tokens"], (m2, m1)
    # the same model, up to the order of float sums
    assert m2["val_losses"] == pytest.approx(m1["val_losses"], rel=1e-6), (m2, m1)
    assert m2["losses"] == pytest.approx(m1["losses"], rel=1e-6), (m2, m1)


@LSTM_GROUP
def test_ranks_draw_differently(lstm_run):
    """seed_this_rank: every rank its own draws (dropout masks, noise), each epoch new ones."""
    _, _, two = lstm_run
    draws = dict(re.findall(r"draw of rank (\d+ in epoch \d+): (\S+)", two.stdout))
    assert set(draws) == {"0 in epoch 0", "1 in epoch 0", "0 in epoch 1", "1 in epoch 1"}, two
    assert len(set(draws.values())) == 4, draws


@LSTM_GROUP
def test_lstm_port_refuses_a_mistyped_data_folder(lstm_run, monkeypatch, capsys):
    """The section's check, in process: a --data folder without train.txt is one line, exit 2."""
    import importlib.util
    work, mine, _ = lstm_run
    spec = importlib.util.spec_from_file_location("lstm_port", mine)
    port_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(port_module)
    monkeypatch.chdir(work)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(sys, "argv", ["mine.py", "--data", "corpu"])
    with pytest.raises(SystemExit) as exit_:
        port_module.check_args(port_module.parse_args(["--device", "cpu", "--data", "corpu"]))
    assert exit_.value.code == 2 and capsys.readouterr().err.strip().splitlines() == [
        "error: no train.txt in corpu (pass --data a folder holding train.txt and valid.txt)"]
