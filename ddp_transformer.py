"""A character-level Transformer language model trained with DDP, launched by torchrun.

Scenario: the seed's small Transformer (embedding, multi-head self-attention with rotary
positions, feed-forward, LayerNorm) learns to predict the next character of a text.
The default text is a fixed list of Python standard library modules, so the script runs
offline on any machine with Python; `--data PATH` trains on your own text file. Every
rank reads the same text and builds the same vocabulary; `DistributedSampler` shards the
training windows, DDP averages the gradients, and the validation loss is reduced over
all ranks with every window counted once. `--dataset toy` reruns the seed's own
experiment (12 rows of one repeated token, its sizes and SGD).

Launch:
    torchrun --standalone --nproc-per-node=2 ddp_transformer.py       # 2 GPUs (or 2 CPU processes)
    torchrun --standalone --nproc-per-node=gpu ddp_transformer.py     # every GPU
    torchrun --nnodes=2 --node-rank=0 --master-addr=HOST0 --master-port=29500 \\
        --nproc-per-node=8 ddp_transformer.py            # on each node, --node-rank=0/1
    CUDA_VISIBLE_DEVICES= torchrun --standalone --nproc-per-node=2 ddp_transformer.py --device cpu
    python ddp_transformer.py                            # a one-process world
    torchrun --standalone --nproc-per-node=2 ddp_transformer.py --data input.txt --max_steps 2000 \\
        --grad_accum 4 --amp bf16 --sample 500           # your own text, bigger effective batch
    torchrun --standalone --nproc-per-node=2 ddp_transformer.py --epochs 2     # whole epochs instead
    torchrun --standalone --nproc-per-node=2 ddp_transformer.py --max_steps 200 --resume  # continue
    torchrun --standalone --nproc-per-node=4 ddp_transformer.py --max_steps 200 --resume  # ... at world 4
    torchrun --standalone --nproc-per-node=gpu ddp_transformer.py --peak_tflops 989       # MFU against your peak
    torchrun --standalone --nproc-per-node=2 ddp_transformer.py --compile      # torch.compile + DDP
    torchrun --standalone --nproc-per-node=2 ddp_transformer.py --dataset toy  # the seed's run
    CUDA_VISIBLE_DEVICES= torchrun --standalone --nproc-per-node=2 ddp_transformer.py --device cpu \\
        --data input.txt --preset cpu10      # the best model 10 minutes buy on a 2-core CPU

How long it trains: `--max_steps` optimizer steps (as nanoGPT's max_iters), the same
number whatever the text's length and the world size; `--epochs N` trains whole epochs
instead (given both, whichever ends first). One step sees batch x grad_accum x world
windows, so more ranks see more text in the same steps; the `model:` line says how many
epochs of this text the steps make. The learning-rate warmup and decay are in steps too.
Each epoch cuts its training windows from another offset (window_offset), so that over the
epochs every character starts a window, the same windows at any world size and on resume.

torch.compile with DDP (`--compile`): `torch.compile(DDP(model))`. TorchDynamo's DDPOptimizer
splits the compiled graph at DDP's bucket boundaries, so a bucket's all-reduce can start while
the backward of earlier layers still runs. It does so in either order: on torch 2.14.1 this
model split into the same buckets wrapped first and compiled first, `DDP(torch.compile(model))`
(nanoGPT's order, and the one PyTorch's "Where to apply torch.compile?" page shows): 2 at the
default --bucket_cap_mb 25, 4 at 1. On 2 CPU processes neither order was faster (the figures:
COMPILE_TIME). On CPU it shows how, not speed.

Over the seed this fixes the attention mask (the seed's hides the past and shows the
future; here `scaled_dot_product_attention(is_causal=True)` never looks ahead), trains on
real text instead of constant rows, and adds gradient accumulation with `no_sync()`, clipping,
AdamW, a warmup + cosine schedule, AMP, torch.compile, exact distributed validation, and
checkpoints that resume mid-epoch at any world size (the place counted in windows of the
epoch's order: epoch_steps). Nearest sibling: ddp_gpus_torchrun.py (same launch and setup).
Three parts: this lesson (every data-parallel call in it); then, beyond it, what the scenario offers but
does not teach (--time_budget and --preset, Muon, the seed's toy run, tokens/s, MFU and memory,
resuming at another world size, the printed summary); then the harness (each recipe as in every file).
"""

# ---------------------------------------------------------------- imports
import argparse
import contextlib
import hashlib
import math
import os
import sys
import sysconfig
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, DistributedSampler

# The default corpus: modules every CPython ships, read in this order, cut at a size
# whose default run takes seconds on a 2-core CPU.
STDLIB_MODULES = ("textwrap.py", "string.py", "heapq.py", "bisect.py", "queue.py",
                  "random.py", "functools.py", "contextlib.py", "fractions.py", "abc.py",
                  "glob.py", "fnmatch.py", "copy.py", "csv.py", "json/__init__.py",
                  "json/decoder.py", "json/encoder.py", "statistics.py", "dataclasses.py")
DEFAULT_CORPUS_CHARS = 120_000
VAL_FRACTION = 0.1
# The default run: 10 s of training at 2 CPU processes (23 s with start-up and validation),
# and below the unigram entropy at 1-4 processes on every text of 10,000+ characters tried.
MAX_STEPS = 60


# ---------------------------------------------------------------- arguments
def parse_args(argv=None):
    p = Arguments(description=__doc__.split("\n\n")[0])
    add_length_args(p)
    add_optimizer_args(p)
    add_data_args(p)
    add_model_args(p)
    add_run_args(p)
    add_time_budget_args(p)  # beyond the lesson: --time_budget and --preset
    add_meter_args(p)  # and --peak_tflops, for the MFU
    refuse_launcher_flags(argv)  # --nprocs: a line on how torchrun launches this script
    use_preset(p, argv)  # a preset is a set of defaults: the flags passed beside it still win
    return p.parse_args(argv)


def add_length_args(p):
    p.add_argument("--max_steps", "--steps", type=int, default=None, metavar="N",
                   help=f"optimizer steps to train, counted from the first run (default: {MAX_STEPS} "
                        "on text unless --epochs is given, whatever the text's length and the world "
                        f"size: at 2 processes {MAX_STEPS} steps x 8 windows x 2 processes, about 1.1 epochs of the "
                        "default corpus)")
    p.add_argument("--epochs", "--max_epochs", "-e", type=int, default=None, metavar="N",
                   help="train whole epochs instead (with --max_steps: whichever ends first; "
                        "default on toy: the seed's 200)")
    p.add_argument("--batch_size", "--batch-size", "-b", type=int, default=None, metavar="N",
                   help="windows per micro-batch, per process (default: 8 on text, 2 on toy); "
                        "one optimizer step sees N x grad_accum x world size windows (the global batch)")
    p.add_argument("--grad_accum", type=int, default=None, metavar="K",
                   help="micro-batches per optimizer step; the first K-1 skip the all-reduce (default: 1; "
                        "with --resume at another world size, what keeps the checkpoint's global batch)")


def add_optimizer_args(p):
    p.add_argument("--lr", type=float, default=None, metavar="LR",
                   help="peak learning rate (default: 3e-3 for AdamW, 8e-3 for Muon, the seed's 0.01 for SGD)")
    p.add_argument("--optimizer", choices=["auto", "adamw", "muon", "sgd"], default="auto",
                   help="auto: AdamW on text, the seed's SGD on toy; muon: Muon for the blocks' matrices, "
                        "AdamW for the rest (see class Muon)")
    p.add_argument("--warmup", type=float, default=0.1, metavar="FRACTION",
                   help="fraction of the run's steps spent warming the learning rate up, "
                        "then it decays along a cosine to --lr_floor")
    p.add_argument("--lr_floor", type=float, default=0.1, metavar="FRACTION",
                   help="where the cosine ends, as a fraction of --lr: nanoGPT's lr / 10 by default; 0 ends the "
                        "run at a rate of zero (the cpu10 recipe, docs/ten_minutes.md)")
    p.add_argument("--lr_decay_steps", type=int, default=None, metavar="N",
                   help="length of that schedule in optimizer steps (as nanoGPT's lr_decay_iters; default: "
                        "the run's length): a run stopped early follows the schedule of the longer one")
    p.add_argument("--clip", type=float, default=1.0, metavar="NORM",
                   help="clip the global gradient norm to NORM (0: off)")
    p.add_argument("--weight_decay", type=float, default=0.1, metavar="WD",
                   help="decoupled weight decay of the weight matrices (not of biases, LayerNorm gains or the "
                        "embedding): each step shrinks them by lr x WD")
    p.add_argument("--seed", type=int, default=0, help="seed for the weights, the shuffle and the sample")


def add_data_args(p):
    p.add_argument("--dataset", choices=["text", "toy"], default="text",
                   help="text: a character model of --data; toy: the seed's 12 constant rows")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="UTF-8 text file to model (default: the first "
                        f"{DEFAULT_CORPUS_CHARS} characters of {len(STDLIB_MODULES)} fixed "
                        "Python standard library modules); the last "
                        f"{VAL_FRACTION * 100:.0f}%% is the validation split")
    p.add_argument("--block_size", type=int, default=None, metavar="T",
                   help="characters per training window (context length; default 128, 9 on toy)")


def add_model_args(p):
    p.add_argument("--d_model", type=int, default=None, metavar="D", help="width (default 128; 12 on toy)")
    p.add_argument("--num_heads", type=int, default=4, metavar="H", help="attention heads")
    p.add_argument("--d_ff", type=int, default=None, metavar="F",
                   help="feed-forward width (default 4 x d_model; 24 on toy)")
    p.add_argument("--num_layers", type=int, default=None, metavar="L",
                   help="Transformer blocks (default 4; 2 on toy)")
    p.add_argument("--dropout", type=float, default=0.0, metavar="P", help="dropout probability")
    p.add_argument("--amp", choices=["auto", "bf16", "fp16", "off"], default="auto",
                   help="autocast dtype; auto (the same rule in every script of the collection): bf16 on a GPU "
                        "that computes it natively (CUDA from Ampere on), else fp16 with a GradScaler; off "
                        "(fp32) on CPUs, where what bf16 gains depends on the model: pass --amp bf16 to try it")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the DDP model (needs a C++ compiler on CPU; the first step compiles)")
    p.add_argument("--bucket_cap_mb", type=float, default=25, metavar="MB",
                   help="DDP gradient bucket size: smaller buckets start all-reducing sooner")


def add_run_args(p):
    p.add_argument("--eval_every", type=int, default=0, metavar="N",
                   help="also evaluate every N optimizer steps (0: only before and after training)")
    p.add_argument("--log_every", type=int, default=20, metavar="N",
                   help="print the training loss every N optimizer steps (0: once per epoch)")
    p.add_argument("--sample", type=int, default=200, metavar="N",
                   help="generate N characters on rank 0 at the end (0: none)")
    p.add_argument("--device", default="auto", metavar="auto|cpu|TYPE",
                   help="auto: the accelerator torch finds (cuda, xpu, hpu, npu, ...), else cpu")
    p.add_argument("--backend", default="auto", metavar="auto|NAME",
                   help="auto: the device's default (nccl on cuda, xccl on xpu, hccl on hpu/npu, gloo on cpu)")
    p.add_argument("--checkpoint", default="ddp_transformer.pt", metavar="PATH",
                   help="checkpoint written by rank 0 at the end of every epoch and of the run")
    p.add_argument("--save_every_steps", type=int, default=0, metavar="N",
                   help="also checkpoint every N optimizer steps, so a lost node costs at most N steps (0: off)")
    p.add_argument("--resume", action="store_true",
                   help="continue from --checkpoint, at any world size: its global batch and its place in the "
                        "epoch are kept")
    p.add_argument("--timeout", type=float, default=300, metavar="SECONDS",
                   help="how long a collective waits for the other ranks before failing")
    p.add_argument("--metrics", default=None, metavar="PATH",
                   help="write a JSON summary of the run here (rank 0)")
    p.add_argument("--local-rank", "--local_rank", type=int, default=None, dest="local_rank",
                   help=argparse.SUPPRESS)  # passed by the deprecated torch.distributed.launch


def fill_defaults(args):
    """The defaults that depend on --dataset: a character model on text, the seed's run on toy."""
    toy = args.dataset == "toy"
    # what the user chose of the step's split; on --resume the rest is chosen to keep the global batch
    args.passed = {n: getattr(args, n) for n in ("batch_size", "grad_accum") if getattr(args, n) is not None}
    args.grad_accum = 1 if args.grad_accum is None else args.grad_accum
    for name, text_default, toy_default in (("batch_size", 8, 2), ("block_size", 128, 9),
                                            ("d_model", 128, 12), ("num_layers", 4, 2)):
        if getattr(args, name) is None:
            setattr(args, name, toy_default if toy else text_default)
    if args.d_ff is None:
        args.d_ff = 24 if toy else 4 * args.d_model
    if args.optimizer == "auto":
        args.optimizer = "sgd" if toy else "adamw"
    if args.lr is None:
        args.lr = {"sgd": 0.01, "muon": 8e-3}.get(args.optimizer, 3e-3)
    if args.epochs is None and args.max_steps is None and not args.time_budget:
        args.epochs, args.max_steps = (200, None) if toy else (None, MAX_STEPS)
    return args


def check_args(args):
    """Validate the arguments in every process, before it joins the group."""
    fill_defaults(args)
    check_values(args)  # in range: one error line that names the fix
    check_folders(args.checkpoint, args.metrics)
    resolve_device(args)  # LOCAL_RANK is checked by prepare_rendezvous, once a hand-made launch's is filled in
    # unasked, only this job's own checkpoint is continued (torchrun restarted it, a node joined or left)
    args.resume = continue_checkpoint(args.checkpoint, args.resume)
    return args


# ---------------------------------------------------------------- process group
def setup(args):
    """Join the process group that torchrun describes in the environment; returns this process's device."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    # the cores split between this machine's processes, on GPUs too (their loaders, their CPU work)
    use_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    if args.device != "cpu":  # cuda, or another accelerator torch reports (xpu, hpu, npu, ...)
        device = torch.device(args.device, local_rank)
        torch.accelerator.set_device_index(device)  # before any work on it: one GPU per process
    else:
        device = torch.device("cpu")
    # device_id: NCCL builds its communicator now, so a bad GPU or network fails here, not at step 1
    dist.init_process_group(args.backend, rank=rank, world_size=world_size,
                            store=attempt_store(rank, world_size, args.timeout),  # torchrun >= 2.5 restarts: pytorch#135712
                            timeout=timedelta(seconds=args.timeout),
                            device_id=device if args.backend == "nccl" else None)
    args.amp = resolve_amp(args.amp, device)  # after set_device: it asks this process's GPU, not GPU 0
    return device


def cleanup():
    free_error_frames()  # DDP's reducer goes before the group it talks through
    dist.destroy_process_group()


# ---------------------------------------------------------------- data
def default_corpus():
    """The first DEFAULT_CORPUS_CHARS characters of STDLIB_MODULES: offline, the same on every run."""
    stdlib = sysconfig.get_paths()["stdlib"]
    parts = []
    for name in STDLIB_MODULES:
        path = os.path.join(stdlib, name)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                parts.append(f.read())
    return "".join(parts)[:DEFAULT_CORPUS_CHARS]


def read_corpus(args):
    """(text, its name, vocabulary), checked to fill a window in both splits, before any process starts. The
    vocabulary is the sorted string of the text's characters, so every rank builds the same one (toy: None)."""
    if args.dataset == "toy":
        return "", "the seed's toy rows (12 x 10, one token each)", None
    if args.data is None:
        text, name = default_corpus(), "Python standard library"
    else:
        try:
            with open(args.data, encoding="utf-8") as f:
                text, name = f.read(), args.data
        except (OSError, UnicodeDecodeError) as e:
            fail(f"cannot read --data {args.data}: {e}", "pass a readable UTF-8 text file")
    need = math.ceil((args.block_size + 1) / VAL_FRACTION)
    if len(text) < need:
        fail(f"the corpus ({name}) has {len(text)} characters, too few for a window of "
             f"--block_size {args.block_size} in the validation split (it needs {need})",
             "pass a longer --data file or a smaller --block_size")
    return text, name, "".join(sorted(set(text)))


class Windows(Dataset):
    """Windows of `block` + 1 tokens cut from one long tensor, every `block` tokens from `offset`:
    window i is tokens[s : s + block + 1] with s = offset + i*block (the grid moves every epoch: see
    window_offset; a window the shift pushes past the end is the text's last). `Tensor.unfold` makes
    every start a view (no copy), and a tensor of window indices gathers a whole batch `(inputs,
    targets)` at once: no DataLoader (and no per-sample Python) sits in the step.
    """

    def __init__(self, tokens, block):
        self.starts = tokens.unfold(0, block + 1, 1)  # row s: tokens[s : s + block + 1]
        self.block, self.count, self.offset = block, (len(tokens) - 1) // block, 0

    def shift(self, offset):
        """Start the grid at `offset` (0 to block - 1): the same window i on every rank that shifts alike."""
        self.offset = offset

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        index = torch.as_tensor(index, device=self.starts.device)
        rows = self.starts[(index * self.block + self.offset).clamp(max=len(self.starts) - 1)]
        return rows[..., :-1], rows[..., 1:]


def build_data(args, text, vocab, device):
    """(training set, validation set), both on the device: a batch is one gather, no copy per step."""
    if vocab is None:
        rows = NLPDataset(12, args.block_size + 1, device)  # the seed has no held-out data: validate on its rows
        return rows, rows
    lookup = {c: i for i, c in enumerate(vocab)}
    tokens = torch.tensor([lookup[c] for c in text], dtype=torch.long, device=device)
    split = int(len(tokens) * (1 - VAL_FRACTION))
    return Windows(tokens[:split], args.block_size), Windows(tokens[split:], args.block_size)


def epoch_steps(sampler, global_batch, first=0, device="cpu"):
    """(step s, this rank's windows, the step's windows on all ranks) for the epoch's steps from `first`.

    Step s trains positions [s x G, (s+1) x G) of the epoch's shuffled order (G: the global batch),
    rank r the positions r, r+W, r+2W, ... among them: the same batches at any world size W, so the
    place in the epoch is kept in windows and a checkpoint continues at any W that keeps G.
    """
    n, world, rank = len(sampler.dataset), sampler.num_replicas, sampler.rank
    # DistributedSampler pads the order to a multiple of W by repeating its first windows, as many as W
    # makes: cut them off (rank r's own positions are r, r+W, ... below n), so each is trained once
    mine = torch.tensor(list(sampler), dtype=torch.long, device=device)[:len(range(rank, n, world))]
    per_rank = global_batch // world
    for s in range(first, math.ceil(n / global_batch)):
        # the epoch's last step holds what is left: fewer windows, on some ranks maybe none
        yield s, mine[s * per_rank:(s + 1) * per_rank], min(global_batch, n - s * global_batch)


def text_fingerprint(text):
    """An integer that differs between texts: every rank must model the same text, or the indices
    and the vocabulary mean different things on different ranks."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


# ---------------------------------------------------------------- model
def rotate(x):
    """Rotary positions (RoFormer, Su et al. 2021), in place of the seed's sinusoidal ones: channel pair i
    of the query or key at position t is turned by the angle t / 10000^(2i/d), so the score of q_t and k_s
    depends on t - s alone. No weights, nothing in the checkpoint; on the CPU recipe (docs/ten_minutes.md)
    a lower validation loss at equal time. A head of odd width (the toy's 3) keeps its last channel."""
    length, half = x.size(-2), x.size(-1) // 2
    rate = 10000 ** -(torch.arange(half, device=x.device, dtype=torch.float) / half)
    angle = torch.outer(torch.arange(length, device=x.device, dtype=torch.float), rate)
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


def causal_attention(q, k, v):
    """Attention in which position t sees positions <= t only. Our own block, not torch's
    nn.MultiheadAttention: there `is_causal` is only a hint that still needs the T x T mask (torch 2.14
    raises without it), its weights have other names, and it could not stay fp32 under CPU bf16 autocast."""
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        # torch's CPU flash-attention backward is several times slower in bf16 than in
        # fp32 (40% of a bf16 step): attention runs in fp32 there, the matmuls stay bf16
        with torch.autocast("cpu", enabled=False):
            return causal_attention(q.float(), k.float(), v.float()).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class MultiHeadSelfAttention(nn.Module):
    def __init__(self, d_model, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.qkv_linear = nn.Linear(d_model, 3 * d_model)  # one matmul for q, k and v
        self.out_linear = nn.Linear(d_model, d_model)

    def forward(self, x):
        batch, length, width = x.shape
        # every size spelled out: a rank may hold no window of an epoch's last step (an empty batch)
        heads = (batch, length, 3, self.num_heads, width // self.num_heads)
        qkv = self.qkv_linear(x).view(heads).permute(2, 0, 3, 1, 4)
        (q, k), v = rotate(qkv[:2]), qkv[2]  # queries and keys learn where each token is: see rotate
        # is_causal instead of a mask: the seed's mask was inverted and built on the CPU
        out = causal_attention(q, k, v)
        return self.out_linear(out.transpose(1, 2).reshape(batch, length, width))


class FeedForward(nn.Module):
    def __init__(self, d_model, d_ff):
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class TransformerBlock(nn.Module):
    def __init__(self, d_model, num_heads, d_ff, dropout=0.0):
        super().__init__()
        self.attention = MultiHeadSelfAttention(d_model, num_heads)
        self.norm1 = nn.LayerNorm(d_model)
        self.ffn = FeedForward(d_model, d_ff)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        # pre-norm (GPT-2 style) rather than the seed's post-norm: it trains stably at
        # AdamW's higher learning rates without a long warmup. Dropout on the two branches only, not on
        # the attention weights: there it sends SDPA to its math kernel on the CPU (1.8x the time of a
        # layer), and the cpu10 recipe ended lower without it (docs/ten_minutes.md)
        x = x + self.dropout(self.attention(self.norm1(x)))
        return x + self.dropout(self.ffn(self.norm2(x)))


class Transformer(nn.Module):
    """Token ids (B, T) -> next-token logits (B, T, vocab_size); position t sees tokens <= t only."""

    def __init__(self, vocab_size, d_model=512, num_heads=8, d_ff=2048, num_layers=6, max_len=5000,
                 dropout=0.0, positions="rotary"):
        super().__init__()
        if positions != "rotary":  # in the config, so that a checkpoint of the seed's sinusoidal ones is refused
            raise ValueError(f"positions must be 'rotary' (see rotate), got {positions!r}")
        self.max_len = max_len  # the longest sequence it was built (and checkpointed) for
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList([TransformerBlock(d_model, num_heads, d_ff, dropout)
                                     for _ in range(num_layers)])
        self.norm = nn.LayerNorm(d_model)
        self.out_linear = nn.Linear(d_model, vocab_size)

    def forward(self, x):
        if x.size(1) > self.max_len:
            raise ValueError(f"sequence of {x.size(1)} tokens is longer than max_len {self.max_len}")
        x = self.embedding(x)
        for layer in self.layers:
            x = layer(x)
        return self.out_linear(self.norm(x))


def model_config(args, vocab):
    """The Transformer's constructor arguments: stored in the checkpoint, compared on resume."""
    return {"vocab_size": len(vocab) if vocab else 100,  # the seed's vocabulary size on toy
            "d_model": args.d_model, "num_heads": args.num_heads,
            "d_ff": args.d_ff, "num_layers": args.num_layers, "max_len": args.block_size,
            "dropout": args.dropout, "positions": "rotary"}


# ---------------------------------------------------------------- train / evaluate
def make_optimizer(model, args):
    if args.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=args.lr)
    # weight decay on the matrices only, not on biases, LayerNorm gains or the embedding
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embedding" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embedding" not in n)]
    if args.optimizer == "muon":  # the blocks' matrices by Muon, the embedding and the output layer by AdamW
        return make_muon(model, decay, rest, args)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    try:  # fused: one kernel for the whole update (CUDA, and CPU in recent torch)
        return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=True)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), foreach=True)


def lr_at(step, total, args):
    """Linear warmup over the first `warmup` of the run, then a cosine down to lr x --lr_floor.

    A function of the step, not a torch.optim.lr_scheduler: those fix the schedule's length when
    they are built and keep a step count of their own in the checkpoint, while a run resumed
    with a larger --max_steps must stretch its schedule, and the step alone says where it is.
    """
    warm = int(args.warmup * total)
    if step < warm:
        return args.lr * (step + 1) / warm
    return cosine_decay(min(1.0, (step - warm) / max(1, total - warm)), args)


def cosine_decay(progress, args):
    """The rate at `progress` (0 to 1) of the decay: from --lr down to lr x --lr_floor along a cosine."""
    return args.lr * (args.lr_floor + (1 - args.lr_floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def autocast(device, amp):
    """Mixed precision for the forward pass (and the loss); a no-op with --amp off."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp)
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def step_seed(seed, rank, step):
    """The seed of one rank's random draws (dropout's masks) in one step: different on every rank (the same
    masks on different data would be noise correlated across replicas), and a function of (seed, rank, step)
    alone, so a resumed run draws what an uninterrupted one would have. The initial weights come from --seed
    alone, and DDP broadcasts rank 0's anyway: the replicas start identical."""
    return ((seed * 1_000_003 + rank) * 1_000_000_007 + step) % 2**63


def train_step(model, optimizer, scaler, micro_batches, amp_context, clip, step_tokens=None):
    """One optimizer step over K micro-batches; returns (sum of token losses, tokens) on the device.

    The official way to accumulate under DDP is `model.no_sync()`: the first K-1 backward passes only
    add into .grad locally, the K-th all-reduces the sum once. step_tokens: the step's tokens on all ranks
    (default: this rank's x the world size). Each micro-batch's summed loss is divided by them and
    multiplied by the world size, which DDP's average divides by again: one step on the mean over every
    token of the global batch, also where the ranks hold unequal shares (an epoch's last step).
    """
    tokens = sum(y.numel() for _, y in micro_batches)
    world = dist.get_world_size() if dist.is_initialized() else 1
    scale = world / (step_tokens or tokens * world)
    loss_sum = torch.zeros((), device=micro_batches[0][1].device)
    for i, (x, y) in enumerate(micro_batches):
        sync = i == len(micro_batches) - 1
        with contextlib.nullcontext() if sync else model.no_sync():
            with amp_context:
                logits = model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
            scaler.scale(loss * scale).backward()
        loss_sum += loss.detach()
    if clip:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, tokens


@torch.no_grad()
def evaluate(model, dataset, indices, batch_size, amp_context):
    """[sum of token losses, tokens] over `indices` of `dataset`, this rank only (no collective). Call it with
    the unwrapped module: DDP's forward may talk to the other ranks, which may hold fewer batches."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=next(model.parameters()).device)
    for batch in torch.as_tensor(indices, dtype=torch.long).split(batch_size):
        x, y = dataset[batch]
        with amp_context:
            logits = model(x)
        totals[0] += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").double()
        totals[1] += y.numel()
    model.train(was_training)
    return totals


# ---------------------------------------------------------------- checkpoint
def read_checkpoint(args, corpus):
    """The --resume checkpoint, read as data (never as code), for this model and this text; anything else is
    one clear error before any process group exists (check_checkpoint: every value before it is used)."""
    state = load_checkpoint(args.checkpoint, ("model", "optimizer", "scaler", "config", "vocab", "epoch", "step",
                                              "windows_in_epoch", "global_batch", "batch_size", "world_size"))
    check_checkpoint(args, state, corpus)
    return state


# ---------------------------------------------------------------- the run
def global_mean(loss_sum, count, device):
    """(mean, tokens) of a loss summed over `count` tokens on each rank, both reduced over all ranks."""
    totals = torch.stack([loss_sum.double(), torch.tensor(float(count), dtype=torch.float64, device=device)])
    dist.all_reduce(totals)
    return ((totals[0] / totals[1]).item() if totals[1] else float("nan")), int(totals[1].item())


def run_length(steps_per_epoch, args):
    """(optimizer steps, epochs) of the whole run: --max_steps or --epochs, whichever ends first
    (neither, under --time_budget alone: no limit but the clock's)."""
    total = min(steps_per_epoch * args.epochs if args.epochs else math.inf, args.max_steps or math.inf)
    if total == math.inf:
        return sys.maxsize, sys.maxsize
    return total, math.ceil(total / steps_per_epoch)


def wrap(model, device, args):
    """DDP around the model; with --compile, torch.compile around DDP (either order: see the docstring)."""
    # gradient_as_bucket_view: the gradients live in DDP's buckets, no copy in and out
    # ddp_group: None; under TORCH_DISTRIBUTED_DEBUG=DETAIL a group DDP can take (torch 2.14, 2.15 segfault on gloo's checked one)
    ddp = DDP(model, device_ids=[device.index] if device.type != "cpu" else None,
              gradient_as_bucket_view=True, bucket_cap_mb=args.bucket_cap_mb, process_group=ddp_group(args.timeout))
    # dynamic: an epoch's last batch is shorter, and static shapes would compile everything again for it
    return torch.compile(ddp, dynamic=True) if args.compile else ddp


class Run:
    """One run: the data, the model and its DDP wrap, the optimizer, and where the run is (train() steps it)."""

    def __init__(self, device, args, corpus, checkpoint=None):
        text, self.name, self.vocab = corpus
        self.entropy = unigram_entropy(text) if self.vocab else None  # of a model that ignores context: a baseline
        check_same_on_every_rank(text_fingerprint(text), "texts (fingerprints)",
                                 "another Python version or file on another node? pass --data PATH on a "
                                 "file system every node sees")
        self.device, self.args, self.config = device, args, model_config(args, self.vocab)
        torch.manual_seed(args.seed)
        self.meter = Meter(device, args)  # tokens/s, MFU and memory: the memory's peak counts from here
        self.model = Transformer(**self.config).to(device)  # the unwrapped module: evaluate, sample and save this one
        self.optimizer = make_optimizer(self.model, args)
        self.scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")  # fp16 needs loss scaling
        self.amp_context = autocast(device, args.amp)
        self.train_set, self.val_set = build_data(args, text, self.vocab, device)
        # where the run is: the epochs done, the windows of this epoch's shuffled order trained, optimizer steps
        self.epoch, self.windows_in_epoch, self.step = 0, 0, 0
        self.budget = TimeBudget(args, device, checkpoint)
        if checkpoint is not None:
            self.restore(checkpoint)
        self.ddp = wrap(self.model, device, args)
        self.sampler = DistributedSampler(self.train_set, shuffle=True, seed=args.seed)
        # a step trains G windows of the epoch's order whatever the world size, the last step the rest
        self.global_batch = args.batch_size * args.grad_accum * dist.get_world_size()
        self.steps_per_epoch = math.ceil(len(self.train_set) / self.global_batch)
        self.total, self.epochs = run_length(self.steps_per_epoch, args)
        self.schedule = args.lr_decay_steps or self.total  # the learning rate's warmup + decay, in steps
        # this invocation's: the epoch it ended in, each epoch's loss and windows, the logged losses by step; and
        # this rank's (loss summed over tokens, tokens) since the epoch's start and since the last log line
        self.ended, self.losses, self.windows, self.logged = self.epoch, [], [], {}
        self.epoch_total, self.log_total = (torch.zeros((), device=device), 0), (torch.zeros((), device=device), 0)
        # after a torchrun restart each rank resumes if it finds the checkpoint: with node-local paths they
        # could start at different steps and fall out of lockstep (gloo errors, NCCL hangs to the watchdog)
        check_same_on_every_rank(self.step, "resume steps (0: not resumed)",
                                 "every rank must read the same checkpoint: put --checkpoint on a file system every "
                                 "node sees, or copy the newest one to every node")

    def restore(self, state):
        """Continue a checkpoint that read_checkpoint checked: weights, optimizer, loss scale, the place in the run."""
        self.model.load_state_dict(state["model"])
        ours = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        check_optimizer_state(self.args.checkpoint, state["optimizer"], self.optimizer,  # before the optimizer sees it
                              f"--optimizer {self.args.optimizer}", "pass the --optimizer that wrote it, or delete it "
                              "to start afresh")
        self.optimizer.load_state_dict(state["optimizer"])
        for group, settings in zip(self.optimizer.param_groups, ours):
            group.update(settings)  # this run's --weight_decay (and lr: the schedule's), not the checkpoint's
        if self.scaler.is_enabled() and not state["scaler"]:
            # written by a bf16 or fp32 run, whose disabled scaler saved nothing to load
            print0(f"note: {self.args.checkpoint} holds no fp16 loss scale: the GradScaler starts afresh")
        else:
            self.scaler.load_state_dict(state["scaler"])  # a no-op when --amp is not fp16
        self.epoch, self.windows_in_epoch, self.step = state["epoch"], state["windows_in_epoch"], state["step"]

    def save(self, epoch):
        """Rank 0 writes where the run is in global units (windows of the epoch's order, the global batch)."""
        finished = self.windows_in_epoch == len(self.train_set)
        with self.meter.left_out("checkpoint"):
            if dist.get_rank() == 0:
                save_checkpoint({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                                 "scaler": self.scaler.state_dict(), "config": self.config, "vocab": self.vocab,
                                 "text": self.args.fingerprint, "epoch": epoch + 1 if finished else epoch,
                                 "step": self.step, "windows_in_epoch": 0 if finished else self.windows_in_epoch,
                                 "global_batch": self.global_batch, "batch_size": self.args.batch_size,
                                 "schedule": self.schedule if self.schedule < sys.maxsize else None, **self.budget.saved()},
                                self.args.checkpoint)  # save_checkpoint adds the world size and the job
            dist.barrier()  # nobody reads the checkpoint before it is complete

    def validate(self):
        """Mean loss over the whole validation split: rank r takes windows r, r+W, ...; no padding."""
        indices = range(dist.get_rank(), len(self.val_set), dist.get_world_size())
        totals = evaluate(self.model, self.val_set, indices, self.args.batch_size, self.amp_context)
        dist.all_reduce(totals)
        return (totals[0] / totals[1]).item()

    def stepped(self, epoch, s, loss_sum, tokens, step_tokens):
        """After step s of the epoch: the place and the losses, the log line, evaluation, a checkpoint every N steps."""
        args, n = self.args, len(self.train_set)
        self.step, self.windows_in_epoch = self.step + 1, min(n, (s + 1) * self.global_batch)
        self.epoch_total = (self.epoch_total[0] + loss_sum, self.epoch_total[1] + tokens)
        self.log_total = (self.log_total[0] + loss_sum, self.log_total[1] + tokens)
        self.meter.stepped(step_tokens, self.model, self.optimizer)
        where = f"{self.step}/{self.total}" if self.total < sys.maxsize else self.budget.where(self.step)
        if args.log_every and self.step % args.log_every == 0:
            loss, _ = global_mean(*self.log_total, self.device)  # .item(): the device has caught up
            self.log_total, self.logged[self.step] = (torch.zeros((), device=self.device), 0), loss
            print0(f"step {where} | loss {loss:.4f} | lr {self.optimizer.param_groups[0]['lr']:.2e}"
                   + self.meter.mfu_since_mark())
        if args.eval_every and self.step % args.eval_every == 0 and self.step < self.total:
            with self.meter.left_out("evaluation"):
                print0(f"step {where} | validation loss {self.validate():.4f}")
        if args.save_every_steps and self.step % args.save_every_steps == 0 \
                and self.windows_in_epoch < n and self.step < self.total:  # else the epoch's end saves
            self.save(epoch)

    def end_epoch(self, epoch, start, since):
        """The epoch's mean loss, its line and its checkpoint; returns whether --time_budget is spent."""
        loss, tokens = global_mean(*self.epoch_total, self.device)
        seconds, windows = time.perf_counter() - start, tokens // self.args.block_size
        self.losses.append(loss)
        self.windows.append(windows)  # counted by the ranks (their tokens, all-reduced), not assumed
        spent = self.budget.out_of_time()  # before the save: a run ended by the clock saves the seconds that ended it
        self.save(epoch)
        of = f"/{self.epochs}" if self.epochs < sys.maxsize else ""  # none under --time_budget alone
        print0(f"epoch {epoch + 1}{of} | loss {loss:.4f} | {math.ceil(self.windows_in_epoch / self.global_batch)}/"
               f"{self.steps_per_epoch} steps | {windows} windows | {self.meter.rate_since(since)} | {seconds:.2f} s | "
               f"checkpoint {self.args.checkpoint}")
        # the next epoch starts at its beginning
        self.ended, self.windows_in_epoch, self.epoch_total = epoch + 1, 0, (torch.zeros((), device=self.device), 0)
        return spent


def train(device, args, corpus, checkpoint):
    """Train to --max_steps (or --epochs, or the --time_budget's end), validating before and after, then sample;
    returns whether the replicas agree."""
    run = Run(device, args, corpus, checkpoint)  # the data, the model in DDP, the optimizer: at the checkpoint's place
    describe(run, checkpoint)  # the data:, model: and start lines
    with run.budget.reserve_for_the_end():  # twice this validation's seconds: the last one and the sample fit
        first_val = run.validate()
    print0(f"validation loss {first_val:.4f} before training")
    run.meter.start(run.model)
    out_of_time = run.budget.out_of_time()  # the clock before the first step
    for epoch in range(run.epoch, run.epochs):
        if run.step >= run.total or out_of_time:  # no epoch of no step
            break
        run.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        run.train_set.shift(window_offset(args.seed, epoch, args.block_size))  # and a new grid of windows
        first, start, since = run.windows_in_epoch // run.global_batch, time.perf_counter(), run.meter.reading()
        for s, windows, step_windows in epoch_steps(run.sampler, run.global_batch, first, device):
            if s > first and (run.step >= run.total or run.budget.out_of_time()):  # the clock before every other step
                break
            torch.manual_seed(step_seed(args.seed, dist.get_rank(), run.step))  # dropout: see step_seed
            for group in run.optimizer.param_groups:  # the schedule's rate by the step (--time_budget: by the clock)
                group["lr"] = lr_at(run.step, run.schedule, args) if not args.time_budget else run.budget.lr()
            micro_batches = [run.train_set[w] for w in windows.tensor_split(args.grad_accum)]
            step_tokens = step_windows * args.block_size  # on all ranks, known without asking them
            loss_sum, tokens = train_step(run.ddp, run.optimizer, run.scaler, micro_batches, run.amp_context,
                                          args.clip, step_tokens)
            run.stepped(epoch, s, loss_sum, tokens, step_tokens)  # the log line, evaluation, checkpoints
        out_of_time = run.end_epoch(epoch, start, since)  # its loss, its line and its checkpoint
    run.meter.stop()
    val = run.validate()
    if args.sample and run.vocab and dist.get_rank() == 0:
        text = generate(run.model, run.vocab, "\n" if "\n" in run.vocab else run.vocab[0], args.sample, args.seed)
        print0(f"sample ({args.sample} characters):\n{text}", every_rank=True)
    in_sync = replicas_in_sync(run.model, device)
    report(run, (first_val, val), in_sync)
    return in_sync


# ---------------------------------------------------------------- main
@record  # under torchrun, an uncaught exception's traceback is its report's root cause
def main():
    """One process of the job; torchrun (or the user) describes the job in the environment."""
    args = check_args(parse_args())
    corpus = read_corpus(args)
    args.fingerprint = text_fingerprint(corpus[0])  # stored in every save: other text is not continued
    # a bad checkpoint is refused (one line) before any process group exists
    checkpoint = read_checkpoint(args, corpus) if args.resume else None
    if checkpoint is not None:  # its global batch at this world size (WORLD_SIZE: torchrun's, or plain python's 1)
        resume_at_another_world_size(args, checkpoint, int(os.environ.get("WORLD_SIZE", "1")))
    prepare_rendezvous(args)  # plain `python`: a world of one; a hand-made launch: check the port
    device = setup(args)
    try:
        with explained_failures(args.timeout, lambda: describe_checkpoint(args.checkpoint)):
            in_sync = train(device, args, corpus, checkpoint)
    finally:
        cleanup()
    if not in_sync:
        sys.exit(1)  # the replicas differ: DDP did not keep them identical


# ---- beyond the lesson: time budgets and presets, Muon, the toy run, MFU and memory, resuming elsewhere, reports ----
import atexit
import re

STARTED = time.perf_counter()  # the script's start (torch imported): --time_budget's clock counts from here
# --preset cpu10: the best validation loss found for 10 minutes of wall clock on a 2-core CPU at 2 processes
# (how it was chosen, and what it reached: docs/ten_minutes.md). A wall-clock budget ends it in time on a
# slower or busier machine too, with fewer steps: the budget leaves a minute for start-up and validation.
PRESETS = {"cpu10": {"time_budget": 540, "d_model": 192, "num_layers": 4, "num_heads": 4, "block_size": 128,
                     "batch_size": 16, "optimizer": "muon", "lr": 8e-3, "weight_decay": 0.3, "warmup": 0.05,
                     "lr_floor": 0.0, "dropout": 0.1, "amp": "bf16", "log_every": 200, "sample": 300}}


def add_time_budget_args(p):
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="a recipe chosen by measurement, as defaults that the flags passed beside it override; "
                        "cpu10: the best validation loss in 10 minutes of wall clock on a 2-core CPU at 2 "
                        "processes (" + ", ".join(f"--{k} {v}" for k, v in PRESETS["cpu10"].items()) + ")")
    p.add_argument("--time_budget", type=float, default=0, metavar="SECONDS",
                   help="end the run SECONDS of wall clock after the script started: training stops early "
                        "enough to leave the final validation and sample twice the first validation's time (the "
                        "ranks agree on the slowest clock), with the learning rate's warmup and decay spread over "
                        "the seconds from the first step to the end; --max_steps or --epochs end it first if given. "
                        "The steps a budget buys depend on the machine's speed and load, so such a run, or its "
                        "resume (which carries the seconds spent on), is not repeatable step for step; 0: no "
                        "budget (--preset cpu10 --time_budget 0 --max_steps N: the recipe, repeatable)")


def use_preset(p, argv):
    """A preset is a set of defaults: the flags passed beside it still win."""
    p.set_defaults(**PRESETS.get(p.parse_known_args(argv)[0].preset, {}))


def lr_at_fraction(fraction, args):
    """--time_budget's schedule: lr_at's warmup and cosine, along the fraction of the budget spent."""
    if fraction < args.warmup:
        return args.lr * max(fraction, 1e-4) / args.warmup
    return cosine_decay(min(1.0, (fraction - args.warmup) / (1 - args.warmup)), args)


class TimeBudget:
    """--time_budget: the run ends by the clock, its warmup and decay spread over the seconds (--preset cpu10
    does: the recipe, and why a budget of time, in docs/ten_minutes.md). The seconds kept for the last
    validation and the sample count as spent, so the whole run ends in time. The ranks agree on the slowest
    clock (an all-reduce of one number a step), or they would use different rates and stop at different
    steps. The schedule spans the seconds from the first step on: start-up and the first validation take
    nothing from its warmup. A checkpoint carries the seconds spent on. No budget: never spent, no collective."""

    def __init__(self, args, device, checkpoint=None):
        self.args, self.device, checkpoint = args, device, checkpoint or {}
        self.spent_before = checkpoint.get("budget_spent_s", 0.0)  # by the runs before this one
        self.budget_from = checkpoint.get("budget_from_s")  # the clock at the first step of the first run
        self.spent, self.fraction, self.reserve = 0.0, 0.0, 0.0  # reserve: kept for what follows training

    @contextlib.contextmanager
    def reserve_for_the_end(self):
        """Keep twice the seconds this block takes (the first validation) for the last validation and the sample."""
        start = time.perf_counter()
        yield
        self.reserve = 2 * (time.perf_counter() - start)

    def out_of_time(self):
        """Read the clock (agreed by the ranks): whether the budget is spent."""
        if not self.args.time_budget:
            return False
        spent = torch.tensor([self.seconds_spent()], dtype=torch.float64, device=self.device)
        dist.all_reduce(spent, op=dist.ReduceOp.MAX)
        self.spent = spent.item()
        if self.budget_from is None:
            self.budget_from = self.spent
        self.fraction = (self.spent - self.budget_from) / max(self.args.time_budget - self.budget_from, 1e-9)
        return self.spent >= self.args.time_budget

    def lr(self):
        """The rate by the fraction of the budget spent: lr_at's shape along the seconds instead of the steps."""
        return lr_at_fraction(self.fraction, self.args)

    def where(self, step):
        """`120 (at 231/540 s)`: a run under --time_budget alone has no last step to count to."""
        return f"{step} (at {self.spent:.0f}/{self.args.time_budget:g} s)"

    def saved(self):
        """What a checkpoint carries on: the seconds spent, with those kept for the end (a resumed run keeps its own),
        and at least the ranks' agreed clock (rank 0's may be behind the slowest one's)."""
        return {"budget_spent_s": max(self.spent, self.seconds_spent()), "budget_from_s": self.budget_from}

    def seconds_spent(self):  # by this rank's clock: the runs before, this one, and the seconds kept for the end
        return self.spent_before + time.perf_counter() - STARTED + self.reserve

    def say_if_spent(self):
        if self.args.time_budget:
            budget = self.args.time_budget if self.args.time_budget % 1 else int(self.args.time_budget)  # `540`
            say_if_nothing_left(self.args.checkpoint, "second", round(self.spent_before), "--time_budget", budget)


def make_muon(model, decay, rest, args):
    """--optimizer muon: the blocks' matrices by Muon, the rest by AdamW (with the same weight decay)."""
    blocks = [p for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("layers.")]
    taken = {id(p) for p in blocks}
    return Muon([{"params": blocks, "muon": True, "weight_decay": args.weight_decay},
                 {"params": [p for p in decay if id(p) not in taken], "weight_decay": args.weight_decay},
                 {"params": rest, "weight_decay": 0.0}], lr=args.lr)


class Muon(torch.optim.Optimizer):
    """Muon (Keller Jordan, 2024) for the param groups marked `muon`, AdamW for the others, in one optimizer:
    one state_dict in the checkpoint and one learning rate for the schedule to set. A matrix's step is its
    Nesterov momentum made orthogonal (orthogonalize): every singular value near 1, so the step moves every
    direction of the matrix alike instead of the few that dominate its gradient. Scaled by 0.2 x sqrt(the
    larger side) it has about AdamW's RMS per element, so one --lr serves both (torch.optim.Muon's
    "match_rms_adamw"). Embedding, output layer and vectors stay with AdamW, as Muon's authors advise. Every
    rank computes the same step from the same all-reduced gradient: no collective of its own, the replicas
    stay identical. torch.optim.Muon (torch 2.9+) takes matrices only and would need an AdamW beside it."""

    def __init__(self, groups, lr, betas=(0.9, 0.95), momentum=0.95, eps=1e-8):
        super().__init__(groups, {"lr": lr, "betas": betas, "momentum": momentum, "eps": eps,
                                  "weight_decay": 0.0, "muon": False})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, decay, (beta1, beta2) = group["lr"], group["weight_decay"], group["betas"]
            for p in (p for p in group["params"] if p.grad is not None):
                grad, state = p.grad, self.state[p]
                if decay:
                    p.mul_(1 - lr * decay)  # decoupled weight decay, as AdamW's
                if group["muon"]:
                    momentum = state.setdefault("momentum", torch.zeros_like(p))
                    momentum.lerp_(grad, 1 - group["momentum"])
                    step = orthogonalize(grad.lerp(momentum, group["momentum"]))  # Nesterov
                    p.add_(step.to(p.dtype), alpha=-lr * 0.2 * max(p.shape) ** 0.5)
                    continue
                if not state:
                    state.update(step=torch.zeros(()), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
                t = state["step"].item()
                state["exp_avg"].lerp_(grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                scale = (state["exp_avg_sq"] / (1 - beta2 ** t)).sqrt_().add_(group["eps"])
                p.addcdiv_(state["exp_avg"], scale, value=-lr / (1 - beta1 ** t))


def orthogonalize(g, steps=5):
    """About U V^T of g = U S V^T: Muon's quintic Newton-Schulz iteration, in bf16 (its coefficients
    push every singular value into about [0.7, 1.2] in 5 steps; exactness does not help, per its authors)."""
    x = g.bfloat16()
    x = x.T if g.size(0) > g.size(1) else x  # the smaller Gram matrix
    x = x / (x.norm() + 1e-7)  # singular values at most 1
    for _ in range(steps):
        a = x @ x.T
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
    return x.T if g.size(0) > g.size(1) else x


class NLPDataset(Dataset):
    """The seed's toy data: `size` rows of `length` tokens, row i all equal to i."""

    def __init__(self, size, length, device="cpu"):
        self.data = torch.arange(size, device=device).unsqueeze(1).repeat(1, length)

    def shift(self, offset):
        """The training set's per-epoch grid (Windows.shift): one row per sample here, nothing to move."""

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        rows = self.data[torch.as_tensor(index, device=self.data.device)]
        return rows[..., :-1], rows[..., 1:]


def window_offset(seed, epoch, block):
    """Where epoch `epoch`'s grid of training windows starts (Windows.shift): moving the grid every epoch,
    every position starts a window over the epochs, and the model sees each stretch of text under other
    contexts, instead of the same blocks at the same places epoch after epoch. A function of (seed, epoch)
    alone, so every rank, any world size and a resumed run cut the same windows. The offsets of epochs
    c*block to c*block + block - 1 are a permutation of 0 .. block - 1 (generator seeded by seed and c):
    within `block` epochs every position of the text starts a window once. Epoch 0 starts at 0."""
    def order(cycle):
        return torch.randperm(block, generator=torch.Generator().manual_seed(seed * 1_000_003 + cycle))
    cycle, place = divmod(epoch, block)
    return int(order(cycle)[place] - order(0)[0]) % block  # all of one cycle's moved alike: still a permutation


def check_values(args):
    """The flags' values in range, or one error line that names the fix."""
    check_positive(args, "max_steps", "epochs", "batch_size", "grad_accum", "lr", "lr_decay_steps", "block_size",
                   "d_model", "num_heads", "d_ff", "num_layers", "bucket_cap_mb", "timeout", "peak_tflops")
    for name in ("eval_every", "log_every", "sample", "save_every_steps", "time_budget"):
        if getattr(args, name) < 0:
            fail(f"--{name} must be 0 or more, got {getattr(args, name)}", f"pass --{name} 0 to turn it off")
    if args.d_model % args.num_heads:
        fail(f"{spelled('d_model')} {args.d_model} must be divisible by --num_heads {args.num_heads}",
             f"pass e.g. {spelled('d_model')} 128 --num_heads 4")
    if not 0 <= args.warmup < 1 or not 0 <= args.dropout < 1 or not args.clip >= 0 or not args.weight_decay >= 0 \
            or not 0 <= args.lr_floor <= 1:
        fail("--warmup and --dropout must be in [0, 1), --lr_floor in [0, 1], --clip and --weight_decay 0 or more",
             "e.g. --warmup 0.1 --dropout 0.1 --lr_floor 0.1 --clip 1 --weight_decay 0.1")


def check_checkpoint(args, state, corpus):
    """Every value of a checkpoint checked before it is used: the counts are integers in range, the weights this
    model's tensors, the text the one it was trained on (its fingerprint)."""
    text, _, vocab = corpus
    if not isinstance(state["vocab"], (str, type(None))) or not isinstance(state["config"], dict):
        fail(f"{args.checkpoint} is not a checkpoint of this script (its vocab or config is not one)",
             "delete it to start afresh", every_node=True)
    if state["vocab"] != vocab:  # first: other text also changes vocab_size, a size the user did not pass
        fail(f"checkpoint {args.checkpoint} was trained on other text ({plural(len(state['vocab'] or ''), 'symbol')}; "
             f"this text has {len(vocab or '')})", "pass the same --data/--dataset as the run that wrote it")
    if state.get("text", text_fingerprint(text)) != text_fingerprint(text):  # the same symbols, another text
        fail(f"checkpoint {args.checkpoint} was trained on other text of the same {plural(len(vocab or ''), 'symbol')}"
             " (its fingerprint differs)", "pass the same --data as the run that wrote it, or another --checkpoint "
             "to start afresh")
    windows = len(build_data(args, text, vocab, "cpu")[0])  # what an epoch holds: the position must lie in it
    # a step trains at most the epoch: beyond it, micro-batches of nothing (65,536 on 178 windows: 120 s a step)
    ranges = {"epoch": (0, 2 ** 48), "step": (0, 2 ** 48), "windows_in_epoch": (0, windows - 1),
              "global_batch": (1, windows), "world_size": (1, 2 ** 24)}
    bad = [k for k, (low, high) in ranges.items() if type(state[k]) is not int or not low <= state[k] <= high]
    if not bad and (type(state["batch_size"]) is not int or not 1 <= state["batch_size"] <= state["global_batch"]):
        bad = ["batch_size"]
    if state.get("schedule") is not None and (type(state["schedule"]) is not int or not 0 < state["schedule"] < 2 ** 48):
        bad.append("schedule")
    bad += [k for k in ("budget_spent_s", "budget_from_s") if state.get(k) is not None and
            (type(state[k]) not in (int, float) or not 0 <= state[k] < 2 ** 48)]  # nan fails the range too
    if bad:
        fail(f"{args.checkpoint} is not a checkpoint of this script ({', '.join(bad)} out of range for this text)",
             "delete it to start afresh, or pass the --data it was trained on", every_node=True)
    config = model_config(args, vocab)
    differ = sorted(k for k in config if state["config"].get(k) != config[k])
    if differ:
        fail(f"checkpoint {args.checkpoint} has " + ", ".join(f"{k}={str(state['config'].get(k))[:20]}" for k in differ)
             + " but this run has " + ", ".join(f"{k}={config[k]}" for k in differ),
             "pass the same model sizes as the run that wrote it")
    with torch.device("meta"):  # the shapes only: no memory for weights
        check_and_load_weights(args.checkpoint, state, Transformer(**config))


@torch.no_grad()
def generate(model, vocab, prompt, count, seed):
    """Sample `count` characters after `prompt` (rank 0 only: no collective may run in here)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    lookup = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([[lookup[c] for c in prompt]], device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    for _ in range(count):
        logits = model(ids[:, -model.max_len:])[0, -1].float()
        nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    model.train(was_training)
    return "".join(vocab[i] for i in ids[0].tolist())


def resolve_amp(amp, device):
    """--amp for this device: `auto` is bf16 where the GPU computes it natively, else fp16 (+ GradScaler)."""
    if device.type == "cpu":
        # Measured on a 2-core AVX-512 CPU (d_model 128, 4 layers, 1 thread per process): bf16 autocast ran no
        # faster than fp32, its casts and element-wise work costing what the faster matmuls save, and it is far
        # slower on CPUs without native bf16. So CPU trains in fp32 unless asked.
        return "off" if amp == "auto" else amp
    if amp == "auto":
        # the device's own check without emulation (torch.cuda.is_bf16_supported(including_emulation=False)
        # on CUDA): before Ampere bf16 is emulated, slower than fp16 with a scaler
        # agreed by every rank (a job over two kinds of GPU): a rank in fp16 would hand DDP gradients
        # scaled by its GradScaler, to be averaged with another rank's unscaled bf16 ones
        native = torch.tensor([int(bf16_supported(device))], device=device)
        dist.all_reduce(native, op=dist.ReduceOp.MIN)
        return "bf16" if native.item() else "fp16"  # fp16 with a GradScaler
    if amp == "bf16" and not bf16_supported(device, emulated=True):
        fail(f"this {device.type} device does not support bf16", "use --amp fp16", every_node=True)
    return amp


# What --compile's first step took. On 2 CPU processes (gloo, the default model, eager and compiled steps interleaved
# in one launch) compiled steps ran at 0.8x eager's tokens/s in either order (wrap first 0.78-0.81x, compile first
# 0.84-0.85x), the first compiling 54 s against 59 s from a cold cache, 22 s against 19 s warm: no order wins here.
COMPILE_TIME = "about 55 s on 2 CPU processes from a cold compile cache, 20 s warm"


def add_meter_args(p):
    p.add_argument("--peak_tflops", type=float, default=None, metavar="TF",
                   help="one device's peak dense TFLOP/s at this precision, for the MFU (default: a table of "
                        "common GPUs, looked up by name; none on CPU)")


class Meter:
    """tokens/s and MFU (model FLOP/s over the peak of every device in use) of all ranks, timed from the end
    of the first optimizer step (it allocates, and with --compile compiles) to stop(), less the seconds
    left_out() (evaluation, checkpoints): every rate printed, and the metrics', counts this way. And this
    rank's memory (class Memory), from construction (before the model is built) on."""

    def __init__(self, device, args):
        peak, self.peak_source = device_peak(args, device)
        self.peak = peak * dist.get_world_size() if peak else None  # of every device in use, for the MFU
        self.device, self.block, self.compiling = device, args.block_size, COMPILE_TIME if args.compile else None
        self.memory, self.steps, self.left_out_s = Memory(device), 0, {"checkpoint": [], "evaluation": []}
        self.started, self.timed_from, self.stopped, self.first_step_s = None, None, None, 0.0
        self.tokens, self.mark = 0, (0.0, 0)
        self.excludes = f"first step{' (compiling)' if self.compiling else ''} left out"

    def start(self, model):
        """Before the first step: what a token costs, and the time its first step takes from here."""
        self.flops_per_token, self.started = flops_per_token(model, self.block), time.perf_counter()
        if self.compiling:  # otherwise the first step is a minute of silence
            print0(f"compiling: the first step compiles the model before it trains ({self.compiling}); "
                   "tokens/s and MFU leave it out")

    def stepped(self, tokens, model, optimizer):
        """After each optimizer step: the first one starts the clock (the device caught up)."""
        self.steps += 1
        self.memory.after_step(self.steps, model, optimizer)
        if self.timed_from is not None:
            self.tokens += tokens
            return
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)
        self.timed_from = time.perf_counter()
        self.first_step_s = self.timed_from - self.started
        if self.compiling:
            print0(f"compiling: done, the first step took {self.first_step_s:.1f} s")

    @contextlib.contextmanager
    def left_out(self, what):
        """Time `what` (a checkpoint, an evaluation) and leave it out: the clock starts that much later."""
        start = time.perf_counter()
        yield
        self.left_out_s[what].append(time.perf_counter() - start)
        if self.timed_from is not None:
            self.timed_from += self.left_out_s[what][-1]

    def stop(self):
        self.stopped = time.perf_counter()

    def reading(self):  # (seconds, tokens) timed so far
        if self.timed_from is None:
            return 0.0, 0
        return (self.stopped or time.perf_counter()) - self.timed_from, self.tokens

    def rate(self, since, now):  # (tokens/s, ` | MFU 41.20%`) between two readings
        seconds, tokens = now[0] - since[0], now[1] - since[1]
        rate = tokens / seconds if seconds > 0 else 0.0
        return rate, f" | MFU {100 * rate * self.flops_per_token / self.peak:.2f}%" if self.peak and seconds > 0 else ""

    def rate_since(self, since):
        """`8991 tokens/s (first step left out) | MFU 1.20%`: only a stretch from the start holds the first step."""
        rate, mfu = self.rate(since, self.reading())
        note = f" ({self.excludes})" if since == (0.0, 0) else " (no compiling in it)" if self.compiling else ""
        return f"{rate:.0f} tokens/s{note}{mfu}"

    def mfu_since_mark(self):  # for a log line: the MFU of the steps since the previous one
        since, self.mark = self.mark, self.reading()
        return self.rate(since, self.mark)[1] if self.mark[1] else ""


def flops_per_token(model, block):
    """Training FLOPs per token, the usual GPT estimate: 6 x (weights used in matmuls) + attention. The
    embedding is a lookup, not a matmul: its table is left out. The attention term 12 x layers x width x
    block counts the full T x T score matrix, as the estimate does; a causal kernel skips about half of it."""
    matmul_params = sum(p.numel() for p in model.parameters()) - model.embedding.weight.numel()
    width = model.embedding.embedding_dim
    return 6 * matmul_params + 12 * len(model.layers) * width * block


# One device's dense peak TFLOP/s, from the vendors' datasheets, whose headline tensor-core figures
# assume 2:4 sparsity (the dense figure is half; the sparse one is quoted below). fp32 is the CUDA cores'
# figure: torch multiplies fp32 matrices without TF32 unless set_float32_matmul_precision is changed.
# Matched against the device's name in this order (torch.cuda.get_device_name, also on ROCm).
PEAK_TFLOPS = (
    (r"\bH100\b.*(PCIe|HBM2e)", {"fp32": 51, "bf16": 756, "fp16": 756}),  # NVIDIA H100 datasheet, PCIe (1,513 sparse)
    (r"\bH100\b.*NVL", {"fp32": 60, "bf16": 835, "fp16": 835}),  # NVIDIA H100 datasheet, H100 NVL (1,671 sparse)
    (r"\bH100\b.*(HBM3|SXM)", {"fp32": 67, "bf16": 989, "fp16": 989}),  # NVIDIA H100 datasheet, SXM (1,979 sparse)
    (r"\bH200\b.*NVL", {"fp32": 60, "bf16": 835, "fp16": 835}),  # NVIDIA H200 datasheet, H200 NVL (1,671 sparse)
    (r"\bH200\b", {"fp32": 67, "bf16": 989, "fp16": 989}),  # NVIDIA H200 datasheet, H200 SXM (1,979 sparse)
    (r"\bA100\b", {"fp32": 19.5, "bf16": 312, "fp16": 312}),  # NVIDIA A100 datasheet, SXM and PCIe alike (624 sparse)
    (r"\bL40S\b", {"fp32": 91.6, "bf16": 362, "fp16": 362}),  # NVIDIA L40S datasheet (733 sparse)
    (r"\bL4\b", {"fp32": 30.3, "bf16": 121, "fp16": 121}),  # NVIDIA L4 datasheet (242 sparse)
    (r"\bA10\b", {"fp32": 31.2, "bf16": 125, "fp16": 125}),  # NVIDIA A10 datasheet (250 sparse)
    # the A10G (AWS G5) has no NVIDIA datasheet: the A10's (the same GA102 chip), which comparisons of
    # the two find the A10G's tensor cores below, so its MFU may read low
    (r"\bA10G\b", {"fp32": 31.2, "bf16": 125, "fp16": 125}),
    (r"\bT4\b", {"fp32": 8.1, "fp16": 65}),  # NVIDIA T4 datasheet, FP16/FP32 mixed (Turing: no bf16, no sparsity)
    # GeForce: the whitepapers' tensor figures with FP32 accumulate (torch's; FP16 accumulate doubles
    # them), not the 4090 D, the laptop parts or the 3090 Ti, whose figures differ
    (r"\bRTX 4090\b(?! D\b| Laptop)", {"fp32": 82.6, "bf16": 165.2, "fp16": 165.2}),  # NVIDIA Ada whitepaper (330 sparse)
    (r"\bRTX 3090\b(?! Ti| Laptop)", {"fp32": 35.6, "bf16": 71, "fp16": 71}),  # NVIDIA GA102 whitepaper (142 sparse)
    (r"\bV100S\b", {"fp32": 16.4, "fp16": 130}),  # NVIDIA V100 datasheet, V100S PCIe (Volta: no bf16, no sparsity)
    (r"\bV100\b.*SXM", {"fp32": 15.7, "fp16": 125}),  # NVIDIA V100 datasheet, SXM2
    (r"\bV100\b.*PCIE", {"fp32": 14, "fp16": 112}),  # NVIDIA V100 datasheet, PCIe
    (r"\bMI300X\b", {"fp32": 163.4, "bf16": 1307.4, "fp16": 1307.4}),  # AMD's MI300X peak table (2,614.9 sparse)
)


def device_peak(args, device):
    """(One device's peak FLOP/s for the MFU, or None; where it comes from, or why there is none.)"""
    if args.peak_tflops:
        return args.peak_tflops * 1e12, f"--peak_tflops {args.peak_tflops:g}"
    if device.type == "cpu":
        return None, "no peak is known for the CPU"
    get_name = getattr(torch.get_device_module(device), "get_device_name", None)
    return peak_of(get_name(device) if get_name else device.type, {"off": "fp32"}.get(args.amp, args.amp))


def peak_of(name, precision):
    """PEAK_TFLOPS's figure for a device name at fp32, bf16 or fp16, in FLOP/s; (None, why) if it has none."""
    for pattern, peaks in PEAK_TFLOPS:
        if re.search(pattern, name, re.IGNORECASE):
            if precision not in peaks:
                return None, f"{name} has no {precision} figure in the table (it emulates {precision})"
            return peaks[precision] * 1e12, f"{name}, dense {precision}, from its datasheet"
    return None, f"no peak is known for {name}"


class Memory:
    """This rank's bytes of parameters, gradients and optimizer state, counted from its tensors (a gradient
    is the size and dtype of its parameter), and the peak measured from construction on over the first two
    steps (the second's backward holds the optimizer's state too): on an accelerator by torch's allocator;
    on the CPU, where torch keeps no such count (and the resident size holds the libraries and what malloc
    keeps), by the profiler's record of every tensor allocation and free: the most bytes alive at once."""

    def __init__(self, device):
        self.device, self.counted, self.profiler, self.cpu_peak = device, {}, None, None
        if device.type != "cpu":
            torch.get_device_module(device).reset_peak_memory_stats(device)  # torch.accelerator.*: from 2.9
        else:
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's own start/stop lines, unasked for
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                   profile_memory=True)
            self.profiler.start()
            atexit.register(self.stop)  # a profiler still running at exit (a run that failed early) crashes it

    def after_step(self, steps, model, optimizer):
        """After this invocation's step `steps`: the bytes after the first, the peak's window ends after the second."""
        if steps == 1:
            self.count(model, optimizer)
        if steps == 2:
            self.stop()

    def stop(self):
        """End the CPU peak's window: the running total of the profiler's allocations (+) and frees (-)."""
        if self.profiler is None:
            return
        self.profiler.stop()
        alive = peak = 0
        events = [e for e in self.profiler.profiler.kineto_results.events() if e.name() == "[memory]"]
        for event in sorted(events, key=lambda e: e.start_ns()):
            alive += event.nbytes()
            peak = max(peak, alive)
        self.profiler, self.cpu_peak = None, peak

    def count(self, model, optimizer):
        """After the first step (AdamW makes its state then): this rank's bytes, gathered from every rank."""
        def size(t):
            return t.numel() * t.element_size()
        params = sum(size(p) for p in model.parameters())
        mine = torch.tensor([params, params, sum(size(t) for st in optimizer.state.values()
                                                 for t in st.values() if torch.is_tensor(t))], device=self.device)
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        names = ("param_bytes", "grad_bytes", "optimizer_bytes")
        self.counted = {**dict(zip(names, mine.tolist())),
                        "memory_per_rank": {n: [int(e[i]) for e in every] for i, n in enumerate(names)}}
        print0(f"memory per rank: parameters {params / 2**20:.2f} MiB | gradients {params / 2**20:.2f} MiB | "
               f"optimizer state {mine[2].item() / 2**20:.2f} MiB (rank 0's; all ranks: "
               f"{' + '.join(f'{int(e.sum()) / 2**20:.2f}' for e in every)} MiB)")

    def peak(self):
        """Bytes at the peak since construction, as the class says."""
        if self.device.type != "cpu":
            return torch.get_device_module(self.device).max_memory_allocated(self.device)
        self.stop()
        return self.cpu_peak


def choose_split(global_batch, world, passed, usual):
    """(per-process batch, grad_accum) whose product with `world` is `global_batch`, or None. What the user
    passed (`passed`: batch_size and/or grad_accum) is kept; without either, the largest batch up to `usual`
    (the checkpoint's, known to fit in memory) that divides a process's part of the step, and as many
    micro-batches as that takes."""
    if global_batch % world:
        return None
    per_rank = global_batch // world  # windows per process per step
    if "batch_size" in passed:
        batches = [passed["batch_size"]]
    elif "grad_accum" in passed:
        batches = [per_rank // passed["grad_accum"]]
    else:
        batches = range(min(usual, per_rank), 0, -1)
    for batch in batches:
        if batch and per_rank % batch == 0 and passed.get("grad_accum", per_rank // batch) * batch == per_rank:
            return batch, per_rank // batch
    return None


def resume_at_another_world_size(args, state, world):
    """On --resume: keep the checkpoint's global batch at this world size, with --batch_size and --grad_accum
    chosen from what the user did not pass (one line says so), or one error line. Why: step s of an epoch
    trains positions [s x G, (s+1) x G) of its shuffled order at any world size, so with the same G a resumed
    run trains the very batches of an uninterrupted one, and the optimization does not change under it."""
    wanted, usual, path, then = state["global_batch"], state["batch_size"], args.checkpoint, state["world_size"]
    split = choose_split(wanted, world, args.passed, usual)
    if split is None:
        flags = " ".join(f"--{k} {v}" for k, v in args.passed.items())
        fits = ", ".join(str(w) for w in range(1, wanted + 1) if choose_split(wanted, w, {}, usual))
        fix = f"resume at {fits} processes"
        if flags:
            fix = f"drop {flags} and a split is chosen" if choose_split(wanted, world, {}, usual) \
                else f"drop {flags} and {fix}"
        fail(f"{path} was trained with a global batch of {wanted} windows a step ({plural(then, 'process')}), "
             f"which cannot be kept at {plural(world, 'process')}" + (f" with {flags}" if flags else ""),
             f"{fix}; or start afresh with another --checkpoint")
    if split != (args.batch_size, args.grad_accum):
        print0(f"global batch kept: {wanted} windows a step, as {path} was trained ({plural(then, 'process')}), so "
               f"each step trains the batch an uninterrupted run would: here {plural(world, 'process')} x --batch_size "
               f"{split[0]} x --grad_accum {split[1]}")
    args.batch_size, args.grad_accum = split


def note_schedule(saved, schedule, step, args):
    """On a resume: one line when the schedule's length is not the one the checkpoint followed (a larger
    --max_steps stretches it, and the rate climbs back up), naming --lr_decay_steps, which keeps it."""
    if saved is None or saved == schedule:  # a checkpoint from before the length was saved says nothing
        return
    print0(f"note: the learning-rate schedule is now {schedule} steps long, the checkpoint's was {saved}: at "
           f"step {step} the rate is {lr_at(step, schedule, args):.2e} instead of {lr_at(step, saved, args):.2e} "
           f"(pass --lr_decay_steps {saved} to keep the checkpoint's schedule)")


def unigram_entropy(text):
    """Entropy (nats per character) of the character frequencies: a model that ignores context."""
    counts = torch.tensor([text.count(c) for c in sorted(set(text))], dtype=torch.float64)
    p = counts / counts.sum()
    return float(-(p * p.log()).sum())


def describe(run, checkpoint):
    """The `data:`, `model:` and start lines: what this run trains on, with what, for how long; what is left."""
    args, model, world = run.args, run.model, dist.get_world_size()
    if checkpoint is not None:
        note_schedule(checkpoint.get("schedule"), run.schedule, run.step, args)
    print0(f"data: {run.name} | {run.config['vocab_size']} symbols | {len(run.train_set)} training and "
           f"{len(run.val_set)} validation windows"
           + (f" | unigram entropy {run.entropy:.3f} nats" if run.entropy is not None else ""))
    print0(f"model: {sum(p.numel() for p in model.parameters())} parameters | "
           f"{flops_per_token(model, args.block_size) / 1e6:.2f} MFLOP per token | "
           f"{plural(world, 'process')} on {run.device.type} ({args.backend}) | amp {args.amp} | {args.optimizer}"
           f"{' | compiled' if args.compile else ''} | "
           + (f"{run.total} steps = {run.total / run.steps_per_epoch:.2f} epochs"
              + (f" (or {args.time_budget:g} s of training)" if args.time_budget else "")
              if run.total < sys.maxsize else f"{args.time_budget:g} s of training in epochs")
           + f" of {run.steps_per_epoch} steps "
           f"of {plural(args.grad_accum, 'micro-batch')} x {plural(args.batch_size, 'window')} x "
           f"{plural(world, 'process')}")
    peak = run.meter.peak
    print0(f"MFU against {world} x {peak / world / 1e12:g} TFLOP/s ({run.meter.peak_source})" if peak
           else f"note: no MFU: {run.meter.peak_source} (pass --peak_tflops: one device's peak dense TFLOP/s "
                f"at this precision)")
    print0(f"resuming from {args.checkpoint} at epoch {run.epoch}, step {run.step}, window "
           f"{run.windows_in_epoch} of {len(run.train_set)} in the epoch's order"
           if args.resume else "starting from scratch")
    by_steps = run.total < (args.epochs or math.inf) * run.steps_per_epoch  # which flag ends the run
    say_if_nothing_left(args.checkpoint, *(("step", run.step, "--max_steps", run.total) if by_steps
                                           else ("epoch", run.epoch, "--epochs", args.epochs)))
    run.budget.say_if_spent()


def report(run, vals, in_sync):
    """Rank 0 prints the validation loss and throughput, writes the metrics (--metrics), prints `done:`."""
    (first_val, val), args, meter, history, steps = vals, run.args, run.meter, run.losses, run.meter.steps
    saves = meter.left_out_s["checkpoint"]
    tokens_per_s, fpt = meter.rate((0.0, 0), meter.reading())[0], meter.flops_per_token
    summary = {
        "script": os.path.basename(__file__), "world_size": dist.get_world_size(), "backend": dist.get_backend(),
        "device": run.device.type, "torch": torch.__version__, "amp": args.amp, "compile": args.compile,
        "epochs": run.ended, "steps": steps, "steps_per_epoch": run.steps_per_epoch,
        "max_steps": run.total, "batch_size": args.batch_size, "grad_accum": args.grad_accum,
        "block_size": args.block_size, "elapsed_s": meter.reading()[0], "first_step_s": meter.first_step_s,
        "samples_per_s": tokens_per_s / args.block_size, "tokens_per_s": tokens_per_s,
        "flops_per_token": fpt, "flops_per_s": tokens_per_s * fpt, "peak_flops": meter.peak,
        "mfu": tokens_per_s * fpt / meter.peak if meter.peak else None, "peak_source": meter.peak_source,
        "global_batch": run.global_batch, "windows": run.windows, "lr_decay_steps": run.schedule,
        "checkpoints": len(saves),  # and the median seconds of one (rank 0 writes, all wait):
        "checkpoint_s": sorted(saves)[len(saves) // 2] if saves else None,
        "first_loss": history[0] if history else None, "final_loss": history[-1] if history else None,
        "losses": history, "step_losses": run.logged, "first_val_loss": first_val, "val_loss": val,
        "unigram_entropy": run.entropy,
        "params": sum(p.numel() for p in run.model.parameters()), "replicas_in_sync": in_sync,
        "resumed_from_epoch": run.epoch if args.resume else 0,
        "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        "throughput_excludes": meter.excludes + ", evaluation and checkpoints left out",
        **meter.memory.counted, "peak_memory_bytes": meter.memory.peak(),
    }
    print0(f"validation loss {first_val:.4f} -> {val:.4f}")
    if steps:  # a resumed run with nothing left to train has no speed to report
        print0(f"throughput: {meter.rate_since((0.0, 0))} on {plural(summary['world_size'], 'process')} | "
               f"{tokens_per_s * fpt / 1e9:.2f} GFLOP/s (6 x parameters + attention) | first step "
               f"{meter.first_step_s:.1f} s" + (" (compiling)" if meter.compiling else ""))
    print0(f"peak memory (rank 0): {summary['peak_memory_bytes'] / 2**20:.1f} MiB of tensors "
           + ("(the allocator's peak)" if run.device.type != "cpu" else "(the profiler's, first two steps)"))
    if dist.get_rank() == 0 and args.metrics:
        write_json(args.metrics, summary)
    print0(f"done: {summary['script']} | {plural(summary['world_size'], 'process')} on {summary['device']} "
           f"({summary['backend']}) | torch {torch.__version__} | {plural(run.ended, 'epoch')}, "
           f"{plural(steps, 'step')} | val loss {first_val:.4f} -> {val:.4f} | "
           f"{f'{tokens_per_s:.0f} tokens/s' if steps else 'nothing trained'} | "
           f"replicas {'in sync' if in_sync else 'DIFFER'}")


# =============================================================================
# ---- harness: recipes, each the same wherever it appears; not part of the lesson ----
# What makes the lesson above robust: the recipes of recipes/harness.py that this file uses, every definition byte for byte as there (a test compares them). A recipe can be
# lifted alone with the recipes its banner names; docs/recipes.md has the ones users lift most.
# =============================================================================
import errno
import gc
import inspect
import json
import multiprocessing
import pickle
import signal
import socket
import stat
import threading
import traceback
import warnings
from torch.distributed.elastic.utils.distributed import get_free_port


# ---- recipe: printing: one line in one write, on rank 0 only unless every_rank
def print0(line, file=None, every_rank=False):
    """In one write: under PYTHONUNBUFFERED=1 print() writes the newline apart, and ranks' lines interleave."""
    if every_rank or (dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))) == 0:
        print(f"{line}\n", end="", file=file or sys.stdout, flush=True)


def plural(count, noun):
    return f"{count} {noun}" + ("" if count == 1 else "es" if noun.endswith(("s", "x", "sh", "tch")) else "s")


# ---- recipe: errors (needs printing): bad input is one line `error: what (fix)` and exit code 2
def fail(what, fix, every_rank=False, every_node=False):
    """Said once: by rank 0 (the others wait to be stopped: one that left first would get rank 0 killed
    before it said why); every_rank: by each (its device); every_node: by each machine's LOCAL_RANK 0 (its files)."""
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0 or every_rank or (every_node and int(os.environ.get("LOCAL_RANK", rank)) == 0):
        report_error(f"error: {what} ({fix})" + (f" [rank {rank}]" if rank else ""))
    else:
        wait_to_be_stopped()
    sys.exit(2)


def wait_to_be_stopped():
    """Under a launcher, a rank that did not say why waits (at most 30 s) to be stopped once the one that said it
    has exited: torchrun names the first rank to fail as the root cause, and a silent rank that left at once was
    named instead (`To enable traceback see ...`) in 1 launch of 8. The only wait that steers torchrun's choice."""
    if "TORCHELASTIC_RUN_ID" in os.environ or multiprocessing.parent_process() is not None:
        time.sleep(30)


def report_error(line):
    """On stderr, and to torchrun as this worker's error (TORCHELASTIC_ERROR_FILE, in the format torch's @record
    writes; @record records an exception, never a SystemExit, so a line that exits 2 is written here). Shown (shown()): a file's newline or terminal escape in it cannot forge a second line."""
    line = shown(line)
    print0(line, sys.stderr, every_rank=True)
    if path := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        with contextlib.suppress(OSError), open(path, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                  "timestamp": str(int(time.time()))}}}, f)


def shown(text):
    """`text` with every character that is not printable (newlines, ESC and the other C0/C1 controls, DEL,
    Unicode line separators, bidi overrides) written as repr writes it (`\\n`, `\\x1b`): shown, never obeyed."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


# ---- recipe: arguments (needs errors): help that states defaults, and checks before any process starts
class HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """`(default: X)` after each option's help, unless the help states it or there is none (None, False)."""

    def _get_help_string(self, action):
        said = "default" in (action.help or "").replace("'s default", "")
        quiet = action.default is None or action.default is False  # `is`: 0 == False, and a default 0 is said
        return action.help if said or quiet else super()._get_help_string(action)


class Arguments(argparse.ArgumentParser):
    """argparse's parser with each default in the help, no abbreviations (`--batch` was ambiguous between
    --batch_size and --batch-size), and a mistake as one line by rank 0 (fail()): under torchrun every process
    parses, so argparse's usage came once per rank, and torchrun's root cause had no reason."""

    def __init__(self, **kwargs):
        super().__init__(formatter_class=HelpWithDefaults, allow_abbrev=False, **kwargs)

    def error(self, message):
        fail(message, f"see {os.path.basename(sys.argv[0])} --help")


def refuse_launcher_flags(argv=None):
    """mp.spawn's --nprocs, or torchrun's flags after the script's name: one line on how to launch it."""
    script = os.path.basename(__file__)
    for arg in map(str, sys.argv[1:] if argv is None else argv):
        flag = arg.split("=")[0]
        if flag == "--nprocs":
            fail(f"{script} is launched by torchrun, which starts the processes; --nprocs is for the mp.spawn "
                 "scripts", f"torchrun --standalone --nproc-per-node=N {script} ...")
        if flag.replace("_", "-") in ("--nproc-per-node", "--nnodes", "--standalone", "--max-restarts"):
            fail(f"{flag} is torchrun's flag, given to {script}",
                 f"put it before the script's name: torchrun {arg} {script} ...")


def check_positive(args, *names):
    for name in (n for n in names if getattr(args, n) is not None and not getattr(args, n) > 0):
        fail(f"{spelled(name)} must be positive, got {getattr(args, name)}", f"pass a {spelled(name)} above 0")


def spelled(name):
    """The option `name` (its dest, `batch_size`) as the command line gave it, `--batch-size` or `--batch_size`
    (`--x=...` too), so an error names a flag the user typed; not given: `--name`."""
    given = (arg.split("=")[0] for arg in sys.argv[1:] if arg.startswith("--"))
    return next((flag for flag in given if flag[2:].replace("-", "_") == name), f"--{name}")


def check_folders(*paths):
    """Output paths must lie in existing folders: found now, not after an hour of training."""
    for path in (p for p in paths if p and not os.path.isdir(os.path.dirname(os.path.abspath(p)))):
        fail(f"the folder of {path} does not exist", "create it first, or pass another path", every_node=True)


# ---- recipe: device (needs errors, printing): the device, its backend, bf16, CPU threads
def resolve_device(args, here=None):
    """--device and --backend `auto` made concrete: torch.accelerator's device (`here`: take it to be of
    that type), else the CPU, and torch's default backend there; a backend fits the types torch lists."""
    here = here or getattr(torch.accelerator.current_accelerator(check_available=True), "type", "cpu")
    args.device = kind = here if args.device == "auto" else args.device
    if kind not in ("cpu", here):
        fail(f"--device {kind} but " + (f"this machine's accelerator is {here}" if here != "cpu" else
                                        "no GPU or other accelerator is visible"),
             "use --device cpu" + (", or check CUDA_VISIBLE_DEVICES" if kind == "cuda" else " or auto"))
    carries = dist.Backend.backend_capability  # backend -> the device types whose tensors it takes
    try:
        default = dist.get_default_backend_for_device(kind)
    except (ValueError, RuntimeError):  # none registered for the type, or a type this torch cannot name
        default = None
    args.backend = default if args.backend == "auto" else args.backend
    if args.backend is not None and args.backend not in carries:
        fail(f"unknown backend {args.backend!r}", f"use --backend auto, or one of {', '.join(sorted(carries))}")
    if args.backend is not None and kind in carries[args.backend]:
        return args
    if default is not None and kind in carries[default]:
        fail(f"--backend {args.backend} does not carry {kind} tensors", f"use --backend auto: {default} on {kind}")
    carried = f": {default}, its default there, carries only {' and '.join(carries[default])} tensors" if default else ""
    fail(f"torch has no multi-process backend for {kind}{carried}",  # mps: torch names gloo, which takes no MPS tensors
         "use --device cpu" + ("" if default or kind == "mps" else f", or install the package that adds {kind} to torch"))


def bf16_supported(device, emulated=False):
    """Whether the current device computes bfloat16 natively (emulated: slower than fp16, counted only if asked)."""
    if device.type == "cpu" and not hasattr(torch.cpu, "get_capabilities") and not emulated:
        print0(f"note: torch {torch.__version__} cannot tell whether this CPU computes bfloat16 "
               "natively (no torch.cpu.get_capabilities): taken as not")
    if device.type == "cpu":
        caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}  # torch 2.7: none
        return bool(caps.get("avx512_bf16") or caps.get("amx_bf16")) or emulated
    check = getattr(torch.get_device_module(device.type), "is_bf16_supported", None)
    if check is None:  # a module without the check: torch's own autocast default for the type
        return torch.get_autocast_dtype(device.type) == torch.bfloat16
    if "including_emulation" in inspect.signature(check).parameters:  # torch.cuda; torch.xpu from 2.8
        return bool(check(including_emulation=emulated))
    return bool(check())


def use_cpu_threads(procs_on_this_machine):
    """The cores split between the processes (oversubscribed, they halve throughput), unless OMP_NUM_THREADS says."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", max(1, cores // procs_on_this_machine))))
    return torch.get_num_threads()


# ---- recipe: rendezvous (needs errors): what init_process_group("env://") reads, for every launcher
def prepare_rendezvous(args, spawning=False):
    """spawning: mp.spawn's parent; else started by torchrun (it sets everything), `python -m
    torch.distributed.launch` (--local-rank), by hand (RANK, WORLD_SIZE, MASTER_*), or plain `python`
    (a world of one). A free port is picked only by the process that hosts the rendezvous."""
    if getattr(args, "local_rank", None) is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    named = "LOCAL_RANK" in os.environ or "RANK" not in os.environ  # no RANK: plain `python`, a world of one
    if not spawning:  # a hand-made launch that names no LOCAL_RANK: all its ranks on this machine
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
        check_local_rank(args.device, named)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" in os.environ:
        if spawning or ("TORCHELASTIC_RUN_ID" not in os.environ and os.environ["RANK"] == "0"):  # it hosts the store
            check_port_free(os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
    elif spawning or os.environ.get("WORLD_SIZE") == "1":
        os.environ["MASTER_PORT"] = str(get_free_port())
    else:
        fail("MASTER_PORT is not set", "set MASTER_ADDR and MASTER_PORT for every process, or use torchrun")
    if args.backend == "nccl":  # NCCL's watchdog aborts a stuck rank; its flight recorder first dumps the last
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")  # collectives: torchfrtrace /tmp -p nccl_trace_rank_
        os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "/tmp/nccl_trace_rank_")


def check_local_rank(device, named, count=None):
    """LOCAL_RANK picks one of this machine's `count` devices (named: the launcher set it; else it is RANK).
    The module's own count: torch 2.7's torch.accelerator.device_count() raises without a driver."""
    local_rank = int(os.environ["LOCAL_RANK"])
    count = torch.get_device_module(device).device_count() if count is None else count
    if device != "cpu" and local_rank >= count:
        fail(f"LOCAL_RANK {local_rank} but only {count} {device} device(s) are visible" if named else
             f"LOCAL_RANK is not set, and RANK {local_rank} is beyond this machine's {count} {device} device(s)",
             f"start at most {count} processes per node, or use --device cpu" if named else
             "set LOCAL_RANK for each process: its index among the processes on its machine", every_rank=True)


def check_port_free(addr, port):
    """Bound with SO_REUSEADDR, as the TCPStore binds: a port a finished run left in TIME_WAIT is free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, int(port)))
        except OSError:
            fail(f"MASTER_PORT {port} is already in use on {addr}",
                 "unset MASTER_PORT to let the script pick a free port, or choose another")


# ---- recipe: restart-safe store (needs errors): init_process_group(store=...) across torchrun's restarts
def attempt_store(rank, world_size, timeout):
    """Under torchrun, a namespace of its store for this attempt alone, else None. torchrun (2.5 on) keeps
    one store across restarts: a restarted rank would read a dead attempt's keys (pytorch#135712). No
    variable tells attempts apart on every node: the store numbers them. Not all joined in `timeout`: one line."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    deadline = time.monotonic() + timeout
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=timeout))
        attempt = open_attempt(store, world_size, deadline) if rank == 0 else join_attempt(store, rank, deadline)
    except (TimeoutError, RuntimeError) as e:  # TimeoutError: who did not come; DistStoreError: no store
        if rank <= 1:  # rank 1 speaks for the ranks that waited on rank 0
            report_error("error: " + (f"{e} did not join this attempt's process group within --timeout {timeout:g} s "
                                      "(frozen, or not started on its node; raise --timeout if starting takes longer)"
                                      if isinstance(e, TimeoutError) else
                                      f"torchrun's store did not answer ({str(e).strip().splitlines()[0][:100]})")
                         + (f" [rank {rank}]" if rank else ""))
        else:
            wait_to_be_stopped()
        raise SystemExit(1) from None
    return dist.PrefixStore(f"harness/attempt/{attempt}", store)


def open_attempt(store, world_size, deadline):
    """Rank 0: open attempt n (an atomic add), answer every request with it until all joined n, else TimeoutError."""
    attempt, answered, missing = store.add("harness/attempts", 1), {}, set(range(1, world_size))
    while missing:
        for r in sorted(missing):
            asked = store.get(f"harness/ask/{r}") if store.check([f"harness/ask/{r}"]) else None
            if asked is not None and answered.get(r) != asked:
                store.set(f"harness/answer/{asked.decode()}", str(attempt))
                answered[r] = asked
            if store.check([f"harness/joined/{attempt}/{r}"]):
                missing.discard(r)
        if missing and time.monotonic() > deadline:
            raise TimeoutError(f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, sorted(missing)))}")
        time.sleep(0.05 if missing else 0)
    return attempt


def join_attempt(store, rank, deadline):
    """Another rank: ask under a nonce of its own, so it never reads an answer meant for a dead attempt."""
    nonce = os.urandom(8).hex()
    store.set(f"harness/ask/{rank}", nonce)
    while not store.check([f"harness/answer/{nonce}"]):  # polled: a timed-out wait logs C++ warnings
        if time.monotonic() > deadline:
            raise TimeoutError("rank 0")
        time.sleep(0.05)
    attempt = int(store.get(f"harness/answer/{nonce}"))
    store.set(f"harness/joined/{attempt}/{rank}", "1")
    return attempt


# ---- recipe: failures (needs errors, printing): Ctrl-C and a failed collective as one line each
@contextlib.contextmanager
def explained_failures(timeout, kept=None):
    """A failed gloo collective: explain_collective_failure's line (NCCL's watchdog aborts first), ending with
    kept(): what a rerun resumes from. Ctrl-C: rank 0 says `interrupted (...)`, all leave at once with 130
    (no clean shutdown: with the peers gone, releasing DDP's reducer can wait on them for seconds)."""
    health = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout)) if dist.get_backend() == "gloo" else None
    kept = kept or (lambda: "no checkpoint kept")
    interrupted = stop_on_interrupt(kept)
    try:
        yield
    except (KeyboardInterrupt, RuntimeError) as error:
        # Ctrl-C reaches the processes one by one: a peer that stopped first can fail our collective before
        # our own SIGINT is seen, so wait a moment for it before explaining the failure
        time.sleep(0 if interrupted["sigint"] or isinstance(error, KeyboardInterrupt) else 0.5)
        if interrupted["sigint"] or isinstance(error, KeyboardInterrupt):
            if not interrupted["said"]:
                print0(f"interrupted (Ctrl-C): {kept()}")
            sys.stderr.flush()
            os._exit(130)
        line = explain_collective_failure(error, health, timeout) if health is not None else None
        if line is None:
            raise
        if line:
            report_error(f"error: {line}; {kept()} [rank {dist.get_rank()}]")
        else:
            wait_to_be_stopped()
        raise SystemExit(1) from None


def stop_on_interrupt(kept):
    """{"sigint": True once Ctrl-C came, "said": True once rank 0 said kept()}: said at once, before a peer or
    the launcher ends this process, then KeyboardInterrupt; where an error is already on its way, the
    signal comes again 0.2 s later instead, in case that error is caught. Later SIGINTs are ignored."""
    interrupted = {"sigint": False, "said": False}

    def on_sigint(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # none inside this one (mp.spawn's parent signals again)
        if not interrupted["sigint"] and (not dist.is_initialized() or dist.get_rank() == 0):
            with contextlib.suppress(RuntimeError):  # it cut into a write to stdout: explained_failures says it
                print0(f"interrupted (Ctrl-C): {kept()}")
                interrupted["said"] = True
        interrupted["sigint"] = True
        if sys.exc_info()[1] is None:
            raise KeyboardInterrupt
        signal.signal(signal.SIGINT, on_sigint)
        again = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
        again.daemon = True
        again.start()

    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # a background job keeps ignoring it
        signal.signal(signal.SIGINT, on_sigint)
    return interrupted


def explain_collective_failure(error, health, timeout):
    """One line ("" where another rank says it, None: not a collective's failure). A timeout: a monitored
    barrier over `health` names who did not arrive; all did: they called different collectives. A connection
    closed: a peer was lost; the roll call through the store (it outlives gloo) says which."""
    text, rank, wait = str(error), dist.get_rank(), min(timeout, 5)
    roll_call()
    if "Detected mismatch between collectives" in text:  # TORCH_DISTRIBUTED_DEBUG=DETAIL's check, on every rank
        where = call_sites(error, health)  # a collective: every rank takes part
        return f"the ranks called different collectives ({mismatch_of(text)}): {where}" if rank == 0 else ""
    if "connection reset" in text.lower() or "connection closed" in text.lower():
        answered = roll_call(wait)
        lost = [r for r in range(dist.get_world_size()) if r not in (answered or [])]
        if answered and (rank != min(answered) or not lost):  # none lost: the peer left after its own error
            return ""
        return (f"lost rank {', '.join(map(str, lost)) if answered else '0 (the host of the rendezvous store)'}: "
                f"its connection closed mid-collective and it did not answer within {wait:g} s "
                f"(it crashed, was killed, or its machine went away); at the time {call_sites(error)}")
    if "timed out" not in text.lower():
        return None
    try:
        dist.monitored_barrier(group=health, timeout=timedelta(seconds=wait), wait_all_ranks=True)
    except RuntimeError as e:
        return f"a collective waited longer than --timeout {timeout:g} s ({str(e).strip().splitlines()[0]})"
    where = call_sites(error, health)
    return (f"a collective waited longer than --timeout {timeout:g} s and every rank answered afterwards, so none "
            f"was lost or frozen: the ranks called different collectives ({where}); to see where they parted: "
            "TORCH_DISTRIBUTED_DEBUG=DETAIL, or a flight record (TORCH_FR_BUFFER_SIZE)") if rank == 0 else ""


def mismatch_of(text):
    """`rank 0 ALLREDUCE [4] Float vs rank 1 ALLREDUCE [3] Float, call 12 of the group, differing in ...`"""
    sides = re.findall(r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+), "
                       r"OpType=(\w+)(?:, TensorShape=(\[[^\]]*\]))?(?:, TensorDtypes=([\w, ]+?)(?:,|\)))?", text)
    described = " vs ".join(f"rank {r} {op}" + (f" {shape}" if shape else "") + (f" {dtype}" if dtype else "")
                            for r, _, op, shape, dtype in sides)
    differ = re.search(r"differ in the following aspects:\s*(.*)", text, flags=re.DOTALL)
    aspects = " ".join(differ.group(1).replace("vs", " vs ").replace("Tensor Tensor", "tensor").split()) if differ else "?"
    return f"{described}, call {sides[0][1] if sides else '?'} of the group, differing in {aspects}"


def call_sites(error, health=None):
    """"rank 0 in `dist.barrier()` (train.py:80 in save)": this file's innermost frame; with `health`, every rank's."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if os.path.abspath(f.filename) == os.path.abspath(__file__)]
    every = [f"`{frames[-1].line.split('  #')[0]}` ({os.path.basename(__file__)}:{frames[-1].lineno} in {frames[-1].name})"
             if frames else "an unknown call"]
    if health is not None:
        every = every * dist.get_world_size()
        dist.all_gather_object(every, every[0], group=health)
    ranks = {}
    for r, site in enumerate(every):
        ranks.setdefault(site, []).append(str(r if health is not None else dist.get_rank()))
    return ", ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(rs)} in {site}" for site, rs in ranks.items())


def roll_call(seconds=0.0):
    """Answer through the rendezvous store; the ranks that answered within `seconds` (None: the store is gone)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        keys = [f"harness/answered/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{r}"
                for r in range(dist.get_world_size())]
        store.set(keys[dist.get_rank()], "1")
        if seconds:
            with contextlib.suppress(RuntimeError):  # DistStoreError: a rank that never answers, the one we look for
                store.wait(keys, timedelta(seconds=seconds))
        return [r for r, key in enumerate(keys) if store.check([key])]
    except RuntimeError:  # its host (torchrun's agent on the first node, or rank 0 under mp.spawn) is gone
        return None


# ---- recipe: DETAIL-safe DDP group: DDP(..., process_group=ddp_group(timeout)) survives TORCH_DISTRIBUTED_DEBUG=DETAIL
def ddp_group(timeout):
    """DDP's process group: None (the default group), or under DETAIL a group of every rank created with the
    debug level briefly OFF (a collective: every rank calls it), with the collective timeout in seconds (None:
    torch's default for a new group, 30 minutes on gloo: it does not inherit init_process_group's). torch 2.14 and
    2.15 end the process with SIGSEGV in DDP's constructor when its group is a checked one; DDP's gradient
    all-reduces then go unchecked, every other collective is still checked. DETAIL is the level now or the one
    the job was launched with (the default group was created checked even if the level was lowered since)."""
    previous = dist.get_debug_level()
    if dist.DebugLevel.DETAIL not in (previous, dist.DebugLevel.__members__.get(
            os.environ.get("TORCH_DISTRIBUTED_DEBUG", "OFF").upper())):
        return None
    dist.set_debug_level(dist.DebugLevel.OFF)  # the groups created now are not wrapped in the checks
    try:
        return dist.new_group(timeout=None if timeout is None else timedelta(seconds=timeout))
    finally:
        dist.set_debug_level(previous)


# ---- recipe: agreement (needs errors): the ranks must hold the same integer
def check_same_on_every_rank(value, what, fix):
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, int(value))  # on the device the backend carries (nccl: the current GPU)
    if len(set(every)) > 1:
        fail(f"the ranks' {what} differ: {every}", fix)


# ---- recipe: release: a failed run's frames (and the DDP reducer they hold) freed before the group is destroyed
def free_error_frames(error=None):
    """Else the process can abort at exit ("terminate called without an active exception"): the frames of
    a failed run's whole error chain may hold the model. `error`: a caught one; by default the one in hand."""
    error = error or sys.exc_info()[1]
    while error is not None:
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__
    gc.collect()


# ---- recipe: replica check (needs printing, errors): every rank's parameters and buffers equal, bit for bit
def replicas_in_sync(model, device):
    """Every parameter and buffer (BatchNorm's running statistics, its int counter too) broadcast by its first
    holder and compared by torch.equal (sums can differ in the last bit between GPUs, or coincide); a DTensor
    (FSDP2) across the ranks its mesh replicates it over, and its shards must tile it. The fingerprint, sum(x *
    sin(i)) over the parameters, is the same sharded or not. They differ: rank 0 says which, also as this
    worker's error (torchrun's root cause), and the caller exits 1."""
    differ_in, base, whole = [], 0, 0
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # the fingerprint, the values counted
    tensors = [("parameter", n, p.detach()) for n, p in model.named_parameters()]
    for kind, name, p in tensors + [("buffer", n, b) for n, b in model.named_buffers()]:
        local, offsets, first, groups = p, (0,) * p.dim(), dist.get_rank() == 0, [None]  # all of p, on every rank
        if hasattr(p, "device_mesh"):  # a DTensor: its mesh says who holds which part (its first chunk here)
            replicated = [i for i, placement in enumerate(p.placements) if placement.is_replicate()]
            local, offsets = p.to_local(), tuple(p.__create_chunk_list__()[0].offsets)
            first = all(p.device_mesh.get_coordinate()[i] == 0 for i in replicated)
            groups = [p.device_mesh.get_group(i) for i in replicated]
        for group in groups:  # the ranks that hold this very part: the first one's copy against each rank's own
            theirs = local.clone()
            dist.broadcast(theirs, src=dist.get_global_rank(group, 0) if group else 0, group=group)
            differ_in += [] if torch.equal(theirs, local) or f"{kind} {name}" in differ_in else [f"{kind} {name}"]
        if first and kind == "parameter":
            sums[0] += fingerprint_terms(local, offsets, p.shape, base)
            sums[1] += local.numel()
        base, whole = base + p.numel() * (kind == "parameter"), whole + p.numel() * (kind == "parameter")
    dist.all_reduce(sums)
    every = [None] * dist.get_world_size()  # each rank's differing tensors; "" where its shards do not tile
    dist.all_gather_object(every, differ_in + ([] if int(sums[1].item()) == whole else ["shards that do not tile it"]))
    return replicas_verdict(every, sums[0].item())


def replicas_verdict(every, fingerprint):
    """Rank 0's line on every rank's differing tensors (`every`, by rank), and its error line where any differ."""
    differ = [rank for rank, names in enumerate(every) if names]
    named = sorted({n for names in every for n in names}, key=lambda n: min(ns.index(n) for ns in every if n in ns))
    where = f" in {named[0]}" + (f" (and {len(named) - 1} more)" if len(named) > 1 else "") if differ else ""
    summary = f"({plural(len(every), 'rank')}, fingerprint {fingerprint:.10e})"
    print0(f"replicas: {'in sync' if not differ else 'DIFFER on ranks ' + str(differ) + where} {summary}")
    if differ and dist.get_rank() == 0:
        report_error(f"error: the replicas differ after training: ranks {differ}{where} (find the update made on "
                     "one rank alone, or the buffer no collective syncs: docs/when_things_go_wrong.md)")
    elif differ and "TORCHELASTIC_RUN_ID" in os.environ:  # at exit: rank 0, with its exit code 1, is the root cause
        atexit.register(wait_to_be_stopped)
    return not differ


def fingerprint_terms(local, offsets, shape, base, rows=4096):
    """sum(x * sin(base + i)) over the block `local` at `offsets` of a tensor of `shape`, a few rows at a time."""
    if local.dim() == 0:  # a scalar parameter: one row of one value
        local, offsets, shape = local.reshape(1), (0,), (1,)
    strides = torch.empty(shape, device="meta").stride()
    inner = torch.zeros((), dtype=torch.float64, device=local.device)  # the index within a row, by broadcasting
    for d in range(1, local.dim()):
        inner = inner.unsqueeze(-1) + ((offsets[d] + torch.arange(local.shape[d], device=local.device)) * strides[d]).double()
    total = torch.zeros((), dtype=torch.float64, device=local.device)
    for start in range(0, local.shape[0], rows):
        at = torch.arange(start, min(start + rows, local.shape[0]), device=local.device) + offsets[0]
        index = (at.double() * strides[0] + base).view(-1, *(1,) * (local.dim() - 1)) + inner
        total += (local[start:start + rows].double() * torch.sin(index)).sum()
    return total


# ---- recipe: atomic save (needs errors): a crash mid-write leaves the previous file whole
def atomic_write(path, write):
    """write(file) into a new file (O_EXCL: no planted link followed), flushed, renamed over `path`, folder flushed."""
    tmp = f"{path}.tmp{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        os.remove(tmp)  # a killed write's leftover, or a planted link (removed, not followed)
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        folder = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(folder)  # the rename itself
        finally:
            os.close(folder)
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)


def write_or_fail(path, write):
    """atomic_write, where a full disk or a read-only folder is one line by the rank that wrote (the previous
    file stays whole): the run cannot save, and a traceback would hide which file and why."""
    try:
        atomic_write(path, write)
    except (OSError, RuntimeError) as e:  # torch.save's writer turns a failed write into a RuntimeError
        cause = e if isinstance(e, OSError) else e.__context__
        if not isinstance(cause, OSError):
            raise
        fail(f"cannot write {path} ({cause.strerror or cause})", "free space on its disk or make its folder "
             "writable, then rerun; the previous file there is kept", every_rank=True)


def write_json(path, record):
    write_or_fail(path, lambda f: f.write(json.dumps(record, indent=2).encode()))


def save_checkpoint(state, path):
    """Atomically, stamped with its torchrun job (continue_checkpoint) and world size. On rank 0, then a barrier."""
    stamp = {"job": os.environ.get("TORCHELASTIC_RUN_ID"), "world_size": dist.get_world_size() if dist.is_initialized() else 1}
    write_or_fail(path, lambda f: torch.save({**state, **stamp}, f))


# ---- recipe: safe load (needs errors): a checkpoint read as data, never as code
def load_checkpoint(path, keys, model=None, optimizers=None):
    """The checkpoint at `path` as a dict, checked (one line per machine, exit 2, when it is not one of ours):
    it holds `keys` (and the entries named below). `model`: a module loaded from "model", or {entry: module},
    each entry a dict of finite tensors loaded strictly into its module. `optimizers`: {entry: optimizer}, each
    entry checked against its optimizer (check_optimizer_state) and loaded into it. Tensors only in those
    entries and "optimizer"; every other entry plain data (numbers, strings, lists, dicts of them: a scheduler's
    or a GradScaler's state_dict), returned as it is. Counts (epoch, step, ...) in `keys`: ints from 0."""
    state, optimizers = checkpoint_data(path), optimizers or {}
    models = model if isinstance(model, dict) else {"model": model} if model is not None or "model" in keys else {}
    if not isinstance(state, dict) or not set(keys) | set(models) | set(optimizers) <= set(state):
        fail(f"{path} is not a checkpoint of this script", "delete it, or point the script at one it wrote", every_node=True)
    valued = next((str(k) for k, v in state.items() if k not in {"model", "optimizer", *models, *optimizers}
                   and holds_tensor(v)), None)
    if valued:  # where a value belongs, a tensor compares elementwise (10^9 from a 4-byte view), then is no bool
        fail(f"{path} is not a checkpoint of this script: its {valued[:40]} holds a tensor",
             "delete it, or point the script at one it wrote", every_node=True)
    counts = [k for k in keys if k in ("epoch", "epochs_run", "step", "windows_in_epoch", "global_batch", "batch_size",
                                       "world_size") and not (type(state[k]) is int and 0 <= state[k] < 2 ** 48)]
    if counts:
        fail(f"{path} is not a checkpoint of this script: {', '.join(counts)} is not a count",
             "delete it, or point the script at one it wrote", every_node=True)
    for entry, module in models.items():
        check_and_load_weights(path, state, module, entry)
    for entry, optimizer in optimizers.items():
        check_optimizer_state(path, state[entry], optimizer, which=entry)
        optimizer.load_state_dict(state[entry])
    return state


def checkpoint_data(path):
    """torch.load with weights_only, so a pickled object is refused before it runs, from a plain file
    (open_plain); onto the CPU (load_state_dict moves each tensor to its parameter). Unreadable: one line per
    machine. torch's reader bounds no work or memory by the file's size (docs/faults.md)."""
    try:
        with open(open_plain(path), "rb") as f, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes on a file that it may be about to refuse
            return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        reason = next((line.strip() for line in str(e).splitlines() if "unsupported" in line.lower()), "not plain data")
        fail(f"{path} holds pickled Python objects and was refused unread ({reason})",
             "load only checkpoints this script wrote; delete it to start afresh", every_node=True)
    except Exception as e:  # OSError (ELOOP: a link), not a plain file, a bad zip, MemoryError, ...
        fail(f"cannot read checkpoint {path} ({type(e).__name__}: {str(e).strip().split('. ')[0][:160]})",
             f"pass the file it links to, {os.path.realpath(path)}" if getattr(e, "errno", 0) == errno.ELOOP
             else "it is unreadable or truncated; delete it to start afresh", every_node=True)


def open_plain(path, flags=os.O_RDONLY):
    """A descriptor of `path`, opened without following a link (OSError ELOOP, "Too many levels of symbolic
    links") or waiting on a FIFO, once it is a regular file of one link (fstat; a hard link is a file of some
    other folder too), else ValueError."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:  # 0: removed since it was opened
        os.close(fd)
        raise ValueError(f"{path} is refused: it is not a plain file of one link (a FIFO, a device, a folder "
                         f"or a file of {info.st_nlink} links)")
    return fd


def holds_tensor(value):
    """Whether a tensor lies anywhere in `value`: each object looked at once, without recursion (torch's
    reader bounds neither nesting nor a list that holds itself)."""
    todo, seen = [value], set()
    while todo:
        value = todo.pop()
        if isinstance(value, torch.Tensor):
            return True
        if isinstance(value, (dict, list, tuple)) and id(value) not in seen:
            seen.add(id(value))
            todo.extend(value.values() if isinstance(value, dict) else value)
    return False


def check_and_load_weights(path, state, model, entry="model"):
    """state[entry] ("model") a dict of finite tensors by name (NaN weights would train on and end in a fingerprint
    of nan), loaded into `model` if given (load_state_dict's strict check says what differs); "optimizer", if there,
    an optimizer's state_dict (check_optimizer_state checks it against the optimizer that will load it)."""
    theirs, optimizer, named = state[entry], state.get("optimizer", {}), "" if entry == "model" else f"{entry}: "
    groups = optimizer.get("param_groups") if isinstance(optimizer, dict) else None
    if not isinstance(theirs, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in theirs.items()):
        fail(f"{path} is not a checkpoint of this script: its {entry} entry is not a dict of tensors",
             "delete it, or point the script at one it wrote", every_node=True)
    if not isinstance(optimizer, dict) or optimizer and not (
            isinstance(optimizer.get("state"), dict) and all(isinstance(v, dict) for v in optimizer["state"].values())
            and isinstance(groups, list) and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)):
        fail(f"{path} is not a checkpoint of this script: its optimizer entry is not an optimizer's state",
             "delete it, or point the script at one it wrote", every_node=True)
    bad = next((k for k, v in theirs.items() if not finite_values(v)), None)
    if bad is not None:
        fail(f"{path} holds weights that are not finite values: {named}{bad[:80]} (NaN, Inf, or a view past its "
             "storage)", "resume from an earlier checkpoint of the run, or delete it to start afresh", every_node=True)
    if model is not None:
        meta = any(p.is_meta for p in model.parameters())  # shapes only: it takes the tensors, nothing to copy into
        try:  # a copy to assign from: load_state_dict leaves assign=True in the dict's _metadata for the next load
            model.load_state_dict(dict(theirs) if meta else theirs, assign=meta)
        except RuntimeError as e:  # its text from the 7th word: "size mismatch for w: copying a param with shape ..."
            why = re.sub(r"torch\.Size\(\[(.*?)\]\)", r"(\1)", " ".join(str(e).split()[6:]))
            fail(f"{path} is for another model or configuration ({named}{why[:200]})",
                 "delete it, or use the configuration that wrote it", every_node=True)


def finite_values(tensor):
    """A plain tensor's values, all finite (NaN weights train on and end in a fingerprint of nan), checked in
    a pass bounded by the file: no view claiming more than its storage (stride 0: 10^12 elements from 4 bytes)."""
    plain = tensor.layout == torch.strided and not tensor.is_meta and not tensor.is_quantized
    return plain and tensor.numel() * tensor.element_size() <= tensor.untyped_storage().nbytes() and \
        bool(torch.isfinite(tensor).all())


def check_optimizer_state(path, saved, optimizer, which="this optimizer", fix=None):
    """Before optimizer.load_state_dict(saved): `saved` is the state this very optimizer writes, or one error
    line. load_state_dict compares none of it, and the fused CPU AdamW wrote past an `exp_avg` of shape [1]
    (a segfault). Its groups name exactly our parameters (the ids torch gives them, in order) and hold our
    settings (those __setstate__ does not fill in) of their types; each parameter's state is empty (never
    stepped) or holds the keys a step leaves (scratch_step), each a plain, contiguous, finite CPU tensor of its
    parameter's shape and a floating dtype, `step` a 0-dim one (as torch and Muon write it) in [0, 2^48).
    ZeroRedundancyOptimizer's consolidated state alike. `which` names the optimizer in the line, `fix` ends it."""
    ours, params, keys = [], {}, {}
    for group in optimizer.param_groups:  # ZeRO's too hold every parameter, not this rank's shard
        ids = range(len(params), len(params) + len(group["params"]))
        expected, required = scratch_step(optimizer, group) if group["params"] else (set(), set(group) - {"params"})
        params.update(zip(ids, group["params"]))
        keys.update(dict.fromkeys(ids, expected))
        ours.append(({**group, "params": list(ids)}, required))
    groups, state = (saved.get("param_groups"), saved.get("state")) if type(saved) is dict else (None, None)
    if type(groups) is not list or type(state) is not dict or len(groups) != len(ours):
        why = f"{len(groups) if type(groups) is list else 'no'} parameter groups, this optimizer has {len(ours)}"
    elif any(type(g) is not dict or g.get("params") != mine["params"] or not same_settings(g, mine, required)
             for g, (mine, required) in zip(groups, ours)):
        why = "parameter groups that name other parameters, or lack settings, or hold them of another type"
    else:
        why = next((f"a state for parameter {str(i)[:20]} {wrong}" for i, entry in state.items()
                    if (wrong := wrong_state(entry, params.get(i) if type(i) is int else None, keys.get(i)))), None)
    if why:
        fail(f"{path} holds another optimizer's state than {which}'s ({why})", fix or "resume with the optimizer "
             "and model that wrote it, or delete it to start afresh", every_node=True)


def scratch_step(optimizer, group):
    """(The keys a step leaves in a parameter's state in `group`, the settings a saved group must hold): the
    optimizer's class (ZeRO: the one it wraps) stepped once with the group's settings on zeros shaped as the
    group's smallest parameter, then given a group of no settings (those its __setstate__ fills in are optional:
    a checkpoint of an older torch lacks them)."""
    probe = torch.zeros_like(min(group["params"], key=torch.numel), requires_grad=True)
    probe.grad = torch.zeros_like(probe)
    scratch = type(getattr(optimizer, "optim", optimizer))([{**group, "params": [probe]}], lr=group["lr"])
    scratch.step()
    keys = set(scratch.state[probe])
    scratch.__setstate__({"state": {}, "param_groups": [{"params": [probe]}]})
    return keys, set(group) - set(scratch.param_groups[0])


def same_settings(saved, ours, required):
    """The saved group holds the `required` settings, and each that ours has too is of our setting's type (a
    number for a number, a tuple of as many numbers for a tuple): a string lr or a 1-tuple of betas fails the step."""
    def kind(value):
        if type(value) in (int, float):
            return "number" if math.isfinite(value) else "not finite"
        return [kind(v) for v in value] if type(value) is tuple else type(value).__name__
    return required <= set(saved) and all(kind(saved[k]) == kind(v) for k, v in ours.items()
                                          if k != "params" and k in saved)


def wrong_state(entry, param, keys):
    """Why a parameter's saved state cannot be loaded into its optimizer for `param`, or None."""
    if param is None or type(entry) is not dict:
        return "for no parameter of this optimizer"
    if entry and set(entry) != keys:
        return f"holds {sorted(map(str, entry))[:4]}, a step of this optimizer {sorted(keys)}"
    for key, value in entry.items():
        plain = type(value) is torch.Tensor and value.device.type == "cpu" and value.layout == torch.strided \
            and value.is_contiguous() and value.is_floating_point()
        if key == "step" and not (plain and value.dim() == 0 and 0 <= value.item() < 2 ** 48):
            return "has a step that is not a count in a 0-dim float tensor"
        if key != "step" and not (plain and value.shape == param.shape):
            return (f"has {str(key)[:20]} of shape {tuple(value.shape)}, its parameter {tuple(param.shape)}"
                    if isinstance(value, torch.Tensor) else f"has {str(key)[:20]} that is not a tensor")
        if not torch.isfinite(value).all():
            return f"has {str(key)[:20]} that is not finite"
    return None


# ---- recipe: resume (needs safe load, errors, printing): continue a checkpoint only when it is ours
def continue_checkpoint(path, resume):
    """Asked (--resume): yes (none there: one line). Unasked: only this job's own, after torchrun restarted it
    (a failure, a node joined or left): its --rdzv-id (TORCHELASTIC_RUN_ID) is stamped in (without one, "none",
    only a restart count can tell). Another file is neither continued nor overwritten: one line says whose."""
    if not path or not os.path.exists(path):
        if resume:
            fail(f"--resume but there is no checkpoint at {path}",
                 "pass the --checkpoint PATH an earlier run wrote, or drop --resume", every_node=True)
        return False
    job, state = os.environ.get("TORCHELASTIC_RUN_ID", "none"), None
    with contextlib.suppress(Exception):  # unreadable, or not a dict: not ours, and not ours to overwrite unasked
        state = peek_checkpoint(path)
    theirs = state.get("job") if isinstance(state, dict) else None
    if resume or (int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 if job == "none" else theirs == job):
        return True
    found = "a file that is not a checkpoint this script can read" if not isinstance(state, dict) else (
        f"a checkpoint at {where_checkpoint_is(state) or 'an unknown point'} written by "
        + ("a run outside torchrun" if not theirs else "a torchrun job without --rdzv-id" if theirs == "none"
           else f"torchrun job {theirs}") + f" at world size {state.get('world_size', '?')}")
    fail(f"{path} holds {found}, not this job's",
         "pass --resume to continue it; to start afresh delete it or pass another --checkpoint", every_node=True)


def describe_checkpoint(path):
    """`checkpoint at epoch 2 kept in PATH` or `no checkpoint kept` (peek_checkpoint: the counter alone is read)."""
    with contextlib.suppress(Exception):  # none, unreadable, cut short by the interrupt
        state = peek_checkpoint(path)
        where = where_checkpoint_is(state)
        return f"checkpoint at {where} kept in {path}" if where else f"checkpoint kept in {path}"
    return "no checkpoint kept"


def peek_checkpoint(path):
    """The checkpoint's counters and stamps, its tensors mapped (mmap=True) and never read: the memory of its
    small entries, however large the file (map_location="meta" read every tensor before pytorch/pytorch#170619,
    December 2025). Checked as load_checkpoint's file is (open_plain) first: mmap takes a path, not a file."""
    os.close(open_plain(path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's notes on a file it may refuse: the caller's line says it
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)


def where_checkpoint_is(state):
    """`step 50` or `epoch 3`: how far the run that wrote `state` got ('' if it does not say)."""
    return next((f"{unit} {state[key]}" for key, unit in (("step", "step"), ("epoch", "epoch"), ("epochs_run", "epoch"))
                 if isinstance(state.get(key), int)), "")


def say_if_nothing_left(path, unit, reached, flag, target):
    """True, with one line, when the checkpoint at `unit` `reached` leaves nothing: `flag` ends the run at `target`."""
    if reached >= target:
        print0(f"nothing to train: {path} is at {unit} {reached} and {flag} {target} ends the run there "
               f"(pass a larger {flag} to train on, or another --checkpoint to start afresh)")
    return reached >= target
# ---- end of harness ----


if __name__ == "__main__":
    main()

