"""
What every training script needs that is not the model: flags, device and threads, the process group and the
ranks' fingerprint check, the batch sampler over token files, the LR schedule and optimizer groups, compiled and
checkpointed blocks, the initial values (drawn by name, or read from a Hugging Face checkpoint), the checkpoint
format, the memory planner (--plan), metrics and logging, and the tokenizer that prints a sample. No strategy code
lives here: a script copied into another project needs gpt.py and this file, nothing else.
"""

import argparse
import hashlib
import importlib.util
import json
import math
import os
import re
import resource
import shutil
import signal
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict
from datetime import timedelta
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from safetensors import safe_open
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.tensor import DTensor

import gpt

DEFAULT_DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "default")
IMPORTED = time.perf_counter()  # Logger.start reports the time from here to the first step: data, model, init, resume


# ------------------------------------------------------------------------------------------------------------
# Flags, device, process group


class UsageError(ValueError):
    """A flag, a launch or a layout the script cannot run with. Raised on every rank before any collective;
    run() prints its message as one line, without a traceback."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are UsageErrors: one line from one rank, instead of the usage on every rank."""

    def error(self, message):
        raise UsageError(f"{message} (see --help)")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help keeps the docstring's examples as written and adds each flag's default once, where it has one."""

    def _get_help_string(self, action):
        has_default = action.default not in (None, argparse.SUPPRESS) and action.default is not False  # store_true
        return action.help + " (default: %(default)s)" if has_default and "default" not in action.help else action.help


def checked(kind, test, requirement):
    """An argparse type: kind(text), refused with a message naming the requirement unless test(value)."""

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not test(value):
            raise argparse.ArgumentTypeError(f"must be {requirement}, not {text!r}")
        return value

    return parse


positive_int = checked(int, lambda n: n > 0, "a whole number > 0")
count = checked(int, lambda n: n >= 0, "a whole number >= 0")
positive = checked(float, lambda x: 0 < x < math.inf, "a number > 0")
non_negative = checked(float, lambda x: 0 <= x < math.inf, "a number >= 0")  # NaN fails every comparison
probability = checked(float, lambda x: 0 <= x < 1, "a probability in [0, 1)")


def get_parser(description, strategy="single"):
    """The flags every script shares. strategy: the script's (single, ddp, fsdp, tp, 2d), for --plan, and its
    default --out_dir, out/<strategy>, so runs of different scripts never meet in one folder."""
    p = ArgumentParser(description=description, formatter_class=HelpFormatter)
    p.set_defaults(strategy=strategy)
    out_dir = f"out/{strategy}"
    p.add_argument("--model", default=None, choices=list(gpt.PRESETS),
                   help="model size, from gpt.py's presets (default: tiny, or --init_from's)")
    p.add_argument("--init_from", default=None,
                   help="start from GPT-2's weights: gpt2, gpt2-medium, gpt2-large, gpt2-xl (Hugging Face hub) or a "
                        "folder with config.json and model.safetensors; --resume of a checkpoint wins")
    p.add_argument("--data", default=DEFAULT_DATA_DIR, help="folder with train.bin, val.bin, meta.json "
                   "(default: the embedded corpus, built on first use)")
    p.add_argument("--global_batch", type=positive_int, default=16, help="sequences per optimizer step")
    p.add_argument("--micro_batch", type=positive_int, default=None,
                   help="sequences per rank per micro-step (default: global batch / data-parallel size, "
                        "no accumulation)")
    p.add_argument("--block_size", type=positive_int, default=128, help="context length, in tokens")
    p.add_argument("--dropout", type=probability, default=0.0, help="dropout probability")
    p.add_argument("--max_steps", type=positive_int, default=1000, help="optimizer steps of the whole run")
    p.add_argument("--lr", type=non_negative, default=3e-3, help="peak learning rate, reached after the warmup")
    p.add_argument("--min_lr", type=non_negative, default=3e-4, help="learning rate at --max_steps (cosine decay)")
    p.add_argument("--warmup_steps", type=count, default=50, help="steps of linear warmup to --lr")
    p.add_argument("--weight_decay", type=non_negative, default=0.1, help="AdamW weight decay of the matrices")
    p.add_argument("--grad_clip", type=non_negative, default=1.0, help="max global grad norm; 0 disables clipping")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="bfloat16: autocast, float32 master weights")
    p.add_argument("--compile", action="store_true", help="torch.compile each transformer block")
    p.add_argument("--activation_checkpointing", action="store_true",
                   help="keep only each block's input for backward and recompute the rest: less memory, ~1/3 more "
                        "compute")
    p.add_argument("--tf32", action="store_true", help="TF32 matmuls on CUDA (faster; float32 results differ ~1e-3)")
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "flash"],
                   help="attention kernel: torch's scaled_dot_product_attention, or flash-attn (CUDA, bfloat16)")
    p.add_argument("--seed", type=int, default=1337, help="seeds the initial weights, the batches and sampling")
    p.add_argument("--eval_interval", type=count, default=100, help="steps between validation losses; 0: never")
    p.add_argument("--eval_iters", type=positive_int, default=4, help="validation batches per evaluation")
    p.add_argument("--log_interval", type=positive_int, default=10, help="steps between progress lines")
    p.add_argument("--out_dir", default=out_dir, help="checkpoints and metrics.jsonl")
    p.add_argument("--ckpt_interval", type=count, default=100,
                   help="steps between checkpoints (and one at the end); 0: only at the end")
    p.add_argument("--keep_checkpoints", type=count, default=2,
                   help="checkpoints kept in --out_dir, the newest ones; 0 keeps every one")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out_dir, if any")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda when available")
    add_sampling_flags(p)
    p.add_argument("--plan", action="store_true",
                   help="print the memory one rank needs in this layout, item by item, and exit without training")
    p.add_argument("--world_size", type=positive_int,
                   help="--plan: the ranks to plan for (default: torchrun's WORLD_SIZE, or 1)")
    p.add_argument("--gpu_memory", type=positive, default=80, help="--plan: one GPU's memory, in GB (10^9 bytes)")
    p.add_argument("--timeout", type=positive, default=600, help="seconds a collective may wait before the run fails")
    p.add_argument("--log_all_ranks", action="store_true", help="every rank prints its progress, not only rank 0")
    p.add_argument("--tensorboard", action="store_true",
                   help="also log to TensorBoard in --out_dir (pip install tensorboard)")
    p.add_argument("--wandb", action="store_true", help="also log to Weights & Biases (pip install wandb)")
    return p


def add_sampling_flags(p):
    """The flags of a sample: after training (train_*.py) or from a checkpoint (sample.py)."""
    p.add_argument("--sample_tokens", type=count, default=500, help="tokens generated; 0 skips the sample")
    p.add_argument("--prompt", default="\n", help="the text the sample continues")
    p.add_argument("--temperature", type=positive, default=0.8, help="softmax temperature of the sample")
    p.add_argument("--top_k", type=count, default=40, help="sample from the k likeliest tokens; 0: from all")


def check_sampling_flags(args):
    if args.sample_tokens and not args.prompt:
        raise UsageError("--prompt is empty: a sample continues at least one character (the default is a newline)")


def check_arguments(args, device):
    """What the flags' types cannot check alone; before anything is created."""
    if args.min_lr > args.lr:
        raise UsageError(f"--min_lr {args.min_lr} is above --lr {args.lr}: the schedule decays from --lr to --min_lr")
    if args.attn == "flash" and (gpt.flash_attn_func is None or device.type != "cuda" or args.dtype != "bfloat16"):
        raise UsageError("--attn flash needs the flash-attn package (pip install flash-attn), CUDA and --dtype "
                         "bfloat16; use --attn sdpa otherwise")
    for package in ("tensorboard", "wandb"):
        if getattr(args, package) and importlib.util.find_spec(package) is None:
            raise UsageError(f"--{package} needs the {package} package: pip install {package}")


USAGE_EXIT_CODE = 2  # argparse's, for every mistake in how a script is called
OTHER_RANKS_WAIT_S = 10  # after a UsageError, how long a rank other than 0 waits for torchrun to end it


def run(main):
    """Every script's command-line entry point. A crash keeps its traceback, which @record also hands to
    torchrun's summary. A UsageError prints one line, `error: <message>`, and exits with code 2. Every rank
    raises the same one, so rank 0 speaks for all, in torchrun's summary too; the other ranks wait for torchrun
    to end them, then exit quietly with the same code. A rank still running after the wait failed alone: it
    says why itself."""

    @record
    def entry_point():
        try:
            main()
        except UsageError as error:
            if launched_rank()[0] != 0:
                signal.signal(signal.SIGTERM, lambda *_: os._exit(USAGE_EXIT_CODE))
                time.sleep(OTHER_RANKS_WAIT_S)
            line = f"error: {error}"
            print(line, file=sys.stderr)
            if os.environ.get("TORCHELASTIC_ERROR_FILE"):  # torchrun's summary shows it as this rank's failure
                with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
                    json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                          "timestamp": str(int(time.time()))}}}, f)
            sys.exit(USAGE_EXIT_CODE)

    entry_point()


def get_device(args, local_rank=0):
    """--device (auto: CUDA when there is one) and --tf32. TF32 rounds float32 matmul inputs to 10 mantissa bits
    (~1e-3 relative): faster on Ampere and later GPUs, but two float32 layouts then differ by far more than their
    reduction order, so it is on only when asked for."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = getattr(args, "tf32", False)
    choice = args.device
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device cuda but no CUDA device is visible; use --device cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    # Ranks sharing a machine share its cores; oversubscribing them makes every rank several times slower.
    if "OMP_NUM_THREADS" not in os.environ:  # an explicit setting wins (torchrun sets 1 for several ranks)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    return torch.device("cpu")


# The same collectives under their torch >= 2.13 names, or the older ones (same signatures) on earlier versions.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def check_tensor_parallel(config, tp, sequence_parallel):
    """Every rank runs this before any collective, so a bad layout fails everywhere instead of hanging."""
    sizes = [("n_head", config.n_head), ("the padded vocabulary", config.padded_vocab_size),
             ("the MLP width", 4 * config.n_embd)]
    for what, n in sizes + [("--block_size", config.block_size)] * sequence_parallel:
        if n % tp:
            fix = "run without --sequence_parallel" if what == "--block_size" else "another --model"
            raise UsageError(f"{what} ({n}) is not divisible by --tp {tp}: choose a --tp that divides it or {fix}")


def launched_rank(args=None):
    """(RANK, LOCAL_RANK, WORLD_SIZE) as torchrun sets them; a plain `python` start is rank 0 of 1. --plan plans
    for --world_size ranks where given."""
    rank, local_rank, world_size = (int(os.environ.get(key, default)) for key, default in
                                    (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1)))
    if args is not None and args.plan and args.world_size:
        return rank, local_rank, args.world_size
    return rank, local_rank, world_size


def init_distributed(args, script, device):
    """Join the process group (unless the caller already did: a test, a notebook) and check that every rank runs
    the same code and flags. Returns (rank, world size, whether this call created the group)."""
    owns_group = not dist.is_initialized()
    if owns_group:
        backend, timeout = "nccl" if device.type == "cuda" else "gloo", timedelta(seconds=args.timeout)
        if "RANK" in os.environ:  # torchrun's (or another launcher's) rendezvous
            dist.init_process_group(backend, timeout=timeout)
        else:  # a plain `python train_X.py`: a world of one process, which needs no rendezvous
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    fingerprints = [None] * world_size
    dist.all_gather_object(fingerprints, fingerprint(args, script))
    check_fingerprints(fingerprints)
    env_rank, _, env_world = launched_rank()
    if (rank, world_size) != (env_rank, env_world):  # the samplers took their rows from the environment
        raise RuntimeError(f"RANK, WORLD_SIZE = {env_rank}, {env_world} but the process group has {rank}, {world_size}")
    return rank, world_size, owns_group


def fingerprint(args, script):
    """What must be equal on every rank: the arguments and the code of the script, this file and gpt.py. A rank
    running stale code or other flags would otherwise desynchronise collectives and hang much later."""
    code = hashlib.sha256()
    for path in (script, __file__, gpt.__file__):
        with open(path, "rb") as f:
            code.update(f.read())
    arguments = {k: v for k, v in sorted(vars(args).items()) if k != "log_all_ranks"}
    return {"code": code.hexdigest()[:16], "args": json.dumps(arguments, sort_keys=True, default=str)}


def check_fingerprints(fingerprints):
    """fingerprints: every rank's fingerprint(), all-gathered. Raises on every rank alike, naming the ranks
    that differ from rank 0 and, for arguments, the flags that differ."""
    differ = [rank for rank, f in enumerate(fingerprints) if f["code"] != fingerprints[0]["code"]]
    if differ:
        raise UsageError(f"ranks {differ} run other code (script, training.py or gpt.py) than rank 0; launch every "
                           "rank with the same files and flags")
    differ = [rank for rank, f in enumerate(fingerprints) if f["args"] != fingerprints[0]["args"]]
    if differ:
        ours, theirs = json.loads(fingerprints[0]["args"]), json.loads(fingerprints[differ[0]]["args"])
        flags = ", ".join(f"--{key} {ours.get(key)} vs {theirs.get(key)}" for key in sorted(ours.keys() | theirs.keys())
                          if ours.get(key) != theirs.get(key))
        raise UsageError(f"ranks {differ} run other arguments than rank 0 (rank 0 vs rank {differ[0]}: {flags}); "
                           "launch every rank with the same files and flags")


# ------------------------------------------------------------------------------------------------------------
# Data: token files, the batch sampler, the tokenizer for samples


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, needs no files, never fails on any text."""
    name, vocab_size, eot = "byte", 256, None

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class GPT2Tokenizer:
    """GPT-2's BPE through tiktoken; vocabulary 50257, documents separated by <|endoftext|>."""
    name, vocab_size = "gpt2", 50257

    def __init__(self):
        import tiktoken

        try:
            self.encoding = tiktoken.get_encoding("gpt2")
        except Exception as error:
            raise SystemExit(f"could not load tiktoken's gpt2 BPE files ({type(error).__name__}): they are downloaded "
                             "on first use. Use --tokenizer byte, or set TIKTOKEN_CACHE_DIR to a folder that holds "
                             "them; offline, `python prepare_data.py` (the embedded default corpus) and "
                             "`python prepare_data.py --input PATH --tokenizer byte` need no download")
        self.eot = self.encoding.eot_token

    def encode(self, text):
        return self.encoding.encode_ordinary(text)

    def decode(self, ids):
        return self.encoding.decode([i for i in ids if i < self.vocab_size])


def get_tokenizer(name):
    if name == "byte":
        return ByteTokenizer()
    if name == "gpt2":
        return GPT2Tokenizer()
    raise ValueError(f"unknown tokenizer {name!r}: use gpt2 or byte")


def load_meta(data_dir):
    path = os.path.join(data_dir, "meta.json")
    if not os.path.exists(path):
        raise UsageError(f"no prepared data in {data_dir!r} (meta.json missing): run "
                                f"`python prepare_data.py --out_dir {data_dir}` or pass --data with a prepared folder")
    with open(path) as f:
        return json.load(f)


def ensure_data(data_dir, is_writer, wait_s=600):
    """Make sure data_dir holds prepared tokens. The default corpus is built on first use by one process per
    machine (is_writer); the others wait for its meta.json, which is written last, so no collective is needed."""
    if os.path.exists(os.path.join(data_dir, "meta.json")) or data_dir != DEFAULT_DATA_DIR:
        return load_meta(data_dir)  # raises with a message naming the fix
    if is_writer:
        import prepare_data

        prepare_data.prepare_default(data_dir)
    deadline = time.time() + wait_s
    while not os.path.exists(os.path.join(data_dir, "meta.json")):
        if time.time() > deadline:
            raise TimeoutError(f"waited {wait_s}s for another process to prepare {data_dir!r}")
        time.sleep(0.5)
    return load_meta(data_dir)


class BatchSampler:
    """Draws the batch of optimizer step `step` from (seed, step) alone, whatever the layout.

    The global batch is `global_batch` random windows of the token file. Data-parallel rank r owns the
    contiguous rows [r * accumulation * micro_batch, (r + 1) * accumulation * micro_batch) and takes
    micro_batch of them per micro-step; tensor-parallel peers pass the same dp_rank and get the same rows.
    """

    def __init__(self, path, block_size, global_batch, micro_batch, dp_rank, dp_size, seed, device):
        if global_batch % (micro_batch * dp_size):
            raise UsageError(f"--global_batch {global_batch} is not a multiple of --micro_batch {micro_batch} x "
                             f"data-parallel size {dp_size}: change one of them")
        self.path, self.block_size, self.seed, self.device = path, block_size, seed, device
        self.global_batch, self.micro_batch, self.dp_rank = global_batch, micro_batch, dp_rank
        self.accumulation = global_batch // (micro_batch * dp_size)
        self.num_tokens = len(np.memmap(path, dtype=np.uint16, mode="r"))
        if self.num_tokens <= block_size + 1:
            raise UsageError(f"{path} holds {self.num_tokens} tokens, fewer than --block_size {block_size} + 2")
        self.split = 0 if os.path.basename(path).startswith("train") else 1

    def rows(self, micro_step):
        first = (self.dp_rank * self.accumulation + micro_step) * self.micro_batch
        return range(first, first + self.micro_batch)

    def offsets(self, step):
        rng = np.random.default_rng([self.seed, self.split, step])
        return rng.integers(0, self.num_tokens - self.block_size - 1, size=self.global_batch)

    def get(self, step, micro_step):
        # A fresh memmap per batch: a long-lived one keeps every page it touched resident.
        data = np.memmap(self.path, dtype=np.uint16, mode="r")
        starts = self.offsets(step)[list(self.rows(micro_step))]
        windows = np.stack([data[s:s + self.block_size + 1] for s in starts]).astype(np.int64)
        batch = torch.from_numpy(windows)
        if self.device.type == "cuda":
            batch = batch.pin_memory().to(self.device, non_blocking=True)
        return batch[:, :-1], batch[:, 1:]


def load_data(args, dp_rank, dp_size, device, is_writer):
    """Every check of the data and batch flags, before any collective: (meta, model config, train and val
    samplers) for this data-parallel rank."""
    check_arguments(args, device)
    meta = ensure_data(args.data, is_writer)
    if args.micro_batch is None and args.global_batch % dp_size:
        raise UsageError(f"--global_batch {args.global_batch} does not split over {dp_size} data-parallel ranks: "
                         f"choose a multiple of {dp_size}")
    micro_batch = args.micro_batch or args.global_batch // dp_size
    train_data, val_data = (BatchSampler(os.path.join(args.data, f"{split}.bin"), args.block_size, args.global_batch,
                                         micro_batch, dp_rank, dp_size, args.seed, device)
                            for split in ("train", "val"))
    check_sampling_flags(args)
    if args.init_from:
        return meta, pretrained_config(args, meta), train_data, val_data
    config = gpt.make_config(args.model or "tiny", meta["vocab_size"], args.block_size, args.dropout)
    return meta, config, train_data, val_data


def evaluate(step, args, model, sampler, autocast, dp_group=None):
    """The validation loss every --eval_interval steps and at the last step; None at the other steps."""
    if args.eval_interval and (step % args.eval_interval == 0 or step + 1 == args.max_steps):
        return estimate_loss(model, sampler, args.eval_iters, autocast, dp_group)
    return None


@torch.no_grad()
def estimate_loss(model, sampler, iters, autocast, dp_group=None):
    """Mean validation loss over `iters` global batches of `sampler`: this rank's rows, then averaged over
    dp_group (None: this process holds every row)."""
    model.eval()
    total = torch.zeros((), device=sampler.device)
    for step in range(iters):
        for micro_step in range(sampler.accumulation):
            x, y = sampler.get(step, micro_step)
            with autocast:
                total += model(x, y).float()
    model.train()
    total /= iters * sampler.accumulation
    if dp_group is not None:
        dist.all_reduce(total, op=dist.ReduceOp.AVG, group=dp_group)
    return total.item()


def sampling_hooks(model, multiple, gather):
    """For a model split along the sequence or the vocabulary (train_tp.py, torch_reference.py): generate() calls
    model(idx) without targets, at any length, and wants whole logits. Pad the prompt to a `multiple` of the
    sequence shards (causal: padding never reaches earlier positions), gather the logits, drop the padding."""
    lengths = []

    def pad(module, args, kwargs):
        if len(args) == 1 and kwargs.get("targets") is None:
            lengths.append(args[0].shape[1])
            return (F.pad(args[0], (0, -args[0].shape[1] % multiple)),), kwargs

    model.register_forward_pre_hook(pad, with_kwargs=True)
    model.register_forward_hook(lambda module, args, out: gather(out)[:, :lengths.pop()] if out.dim() == 3 else None)
    return model


def sample(model, meta, args, device, autocast, show):
    """Print --sample_tokens generated after --prompt. Every rank of a sharded model calls it (each forward
    needs them all); the seeded sampler makes them draw the same tokens; `show` picks the one that prints."""
    if not args.sample_tokens:
        return
    tokenizer = get_tokenizer(meta["tokenizer"])
    prompt = torch.tensor([tokenizer.encode(args.prompt)], device=device)
    with autocast:
        out = gpt.generate(model, prompt, args.sample_tokens, args.block_size, meta["vocab_size"], args.temperature,
                           args.top_k, seed=args.seed)
    if show:
        print("sample:\n" + tokenizer.decode(out[0].tolist()))


# ------------------------------------------------------------------------------------------------------------
# Optimization: schedule and optimizer


def get_lr(step, args):
    """Linear warmup to --lr, then cosine decay to --min_lr at --max_steps."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps))
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (args.lr - args.min_lr)


def decay_groups(parameters):
    """(with weight decay, without): matrices (2-D and up) decay; biases, norms' gains never do."""
    parameters = list(parameters)
    return [p for p in parameters if p.dim() >= 2], [p for p in parameters if p.dim() < 2]


def make_optimizer(groups, args, device):
    """AdamW over groups = (with weight decay, without), e.g. from decay_groups(). Fused on every device: the CPU
    runs the kernel CUDA runs, so the tests see what a GPU sees. A fused step refuses a group that mixes DTensors
    with plain tensors (torch_reference's tensor parallelism leaves norms and wpe plain): one group per kind."""
    decay, no_decay = groups
    groups = [{"params": [p for p in params if isinstance(p, DTensor) == distributed], "weight_decay": weight_decay}
              for params, weight_decay in ((list(decay), args.weight_decay), (list(no_decay), 0.0))
              for distributed in (False, True)]
    groups = [group for group in groups if group["params"]]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


def clip_grad_norm_(counted, grads, max_norm, group=None):
    """torch.nn.utils.clip_grad_norm_ of a model spread over the ranks of `group`, in one all-reduce of one number:
    `counted` is this rank's share of the gradient (each element of the model in exactly one rank's share), `grads`
    every gradient this rank holds, scaled in place by PyTorch's clipping coefficient."""
    total = torch.zeros((), device=grads[0].device)
    for grad in counted:
        total += grad.float().pow(2).sum()
    dist.all_reduce(total, group=group)
    norm = total.sqrt()
    torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


def wrap_blocks(model, compile=False, activation_checkpointing=False):
    """Each transformer block's forward compiled (--compile) and recomputed in backward (--activation_checkpointing);
    returns the model. Compiled block by block, as torchtitan does: a model compiled whole runs its backward as one
    autograd node, so every gradient hook (DDP's bucket all-reduces) fires only after all of backward, and module
    hooks (FSDP's gathers) break the graph; here the strategies' hooks run between compiled pieces, where they
    overlap communication with compute. Checkpointed blocks keep only their input for backward and run forward
    again when backward reaches them: the strategy's hooks have made the block's weights available by then."""
    for module in model.modules():
        if isinstance(module, gpt.Block):
            forward = torch.compile(module.forward) if compile else module.forward
            module.forward = recomputed(forward) if activation_checkpointing else forward
    return model


def recomputed(forward):
    """forward, run under torch's non-reentrant checkpoint when autograd records: nothing it computes is saved for
    backward but its inputs, and backward calls forward again, with the random state restored: torch restores the
    default generators (CPU, and the inputs' GPU), recompute_streams restores our RNGStreams, so every dropout
    mask is drawn again as it was."""
    def run(*args):
        if not torch.is_grad_enabled():  # evaluation and sampling: nothing to save, nothing to recompute
            return forward(*args)
        streams = {name: stream.state for name, stream in rng_streams.items()}  # as this forward finds them
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False,
                                                 context_fn=lambda: (nullcontext(), recompute_streams(streams)))
    return run


@contextmanager
def recompute_streams(states):
    """Each RNGStream as the original forward found it, for the recompute; then as the recompute found it."""
    current = {name: stream.state for name, stream in rng_streams.items()}
    for name, state in states.items():
        rng_streams[name].state = state
    try:
        yield
    finally:
        for name, state in current.items():
            rng_streams[name].state = state


def set_lr(optimizer, step, args):
    lr = get_lr(step, args)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


# ------------------------------------------------------------------------------------------------------------
# Initial values: drawn by parameter name, or read from GPT-2's weights in the Hugging Face format (--init_from)


def initial_values(config, seed, init_from=None):
    """The one source of every layout's initial parameters: value(name, shape, box=None, flat=None) gives full[box]
    (flattened, only elements [flat[0], flat[1]) when flat is given), where full, of `shape`, is parameter `name`'s
    initial value: gpt.initial_value's, drawn from (seed, name), or with init_from (--init_from) the pretrained
    checkpoint's. Each rank asks for its own part only, a whole parameter, a tensor-parallel slice (a box), an FSDP
    shard (a flat range), and from a checkpoint only the rows holding that part are read."""
    checkpoint = HuggingFaceCheckpoint(init_from) if init_from else None

    def read(name, shape, box):
        if checkpoint is None:
            return gpt.initial_value(name, shape, config, seed)[tuple(slice(*b) for b in box)]
        return gpt.read_hugging_face(name, box, config, checkpoint.read)

    def value(name, shape, box=None, flat=None):
        box = tuple((0, n) for n in shape) if box is None else tuple(box)
        if flat is None:
            return read(name, shape, box)
        width = math.prod(stop - start for start, stop in box[1:])  # elements in a row of the box
        first, last = flat[0] // width, -(-flat[1] // width)  # the rows that hold the flat range
        (start, _), *columns = box
        rows = read(name, shape, ((start + first, start + last), *columns)).reshape(-1)
        return rows[flat[0] - first * width:flat[1] - first * width]

    return value


def pretrained_folder(name_or_path):
    """A folder in the Hugging Face format: a local one, or a hub model's (gpt2 ... gpt2-xl, any GPT-2 repository)
    downloaded into huggingface_hub's cache (under $HF_HOME; with HF_HUB_OFFLINE=1 only the cache is read)."""
    if os.path.isdir(name_or_path):
        return name_or_path
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name_or_path, allow_patterns=["config.json", "model.safetensors"])
    except Exception as error:
        raise UsageError(f"--init_from {name_or_path!r} is no local folder, and the Hugging Face hub did not give it "
                         f"({type(error).__name__}): pass a folder with config.json and model.safetensors, or download "
                         f"it where the network allows (hf download {name_or_path} config.json model.safetensors) "
                         "into the cache $HF_HOME names") from error


class HuggingFaceCheckpoint:
    """A GPT-2 in the Hugging Face format (config.json, model.safetensors), opened by its names and shapes alone.
    read() maps the file, copies one box out of it and unmaps it: a rank holds only the parts it asks for."""

    def __init__(self, name_or_path):
        folder = pretrained_folder(name_or_path)
        self.path = os.path.join(folder, "model.safetensors")
        if not (os.path.exists(self.path) and os.path.exists(os.path.join(folder, "config.json"))):
            raise UsageError(f"--init_from {name_or_path!r}: {folder!r} holds no config.json and model.safetensors "
                             "(the Hugging Face format)")
        with open(os.path.join(folder, "config.json")) as f:
            self.config = json.load(f)
        with safe_open(self.path, framework="pt") as file:
            self.shapes = {name: tuple(file.get_slice(name).get_shape()) for name in file.keys()}
        # GPT2LMHeadModel.save_pretrained() names the body transformer.*; the hub's GPT-2 files do not.
        self.prefix = "transformer." if "transformer.wte.weight" in self.shapes else ""

    def read(self, name, box):
        with safe_open(self.path, framework="pt") as file:  # a slice may be a view into the mapping: copy it out
            return file.get_slice(self.prefix + name)[tuple(slice(start, stop) for start, stop in box)].clone()


def pretrained_config(args, meta):
    """The model of --init_from, from its config.json; refused, before any work, where a flag or the data contradict
    it or its weights do not fit it."""
    source = f"--init_from {args.init_from!r}"
    checkpoint = HuggingFaceCheckpoint(args.init_from)
    try:
        config = gpt.config_from_hugging_face(checkpoint.config, args.block_size, args.dropout)
    except ValueError as error:
        raise UsageError(f"{source}: {error}") from None
    if args.model and gpt.make_config(args.model, config.vocab_size, config.block_size, config.dropout) != config:
        raise UsageError(f"--model {args.model} contradicts {source} ({config.n_layer} layers, {config.n_head} heads, "
                         f"{config.n_embd} wide): drop --model, the checkpoint's config.json defines the model")
    if config.vocab_size != meta["vocab_size"]:
        raise UsageError(f"{source} has a vocabulary of {config.vocab_size}, but --data {args.data!r} is tokenized "
                         f"with {meta['tokenizer']} ({meta['vocab_size']}): prepare the data with the checkpoint's "
                         "tokenizer (prepare_data.py --tokenizer gpt2 for GPT-2)")
    with torch.device("meta"):
        shapes = {name: param.shape for name, param in gpt.GPT(config).named_parameters()}
    for name, shape in shapes.items():
        stored, box, _ = gpt.hugging_face_box(name, [(0, n) for n in shape], config)
        stored, found = checkpoint.prefix + stored, checkpoint.shapes.get(checkpoint.prefix + stored)
        if found is None:
            raise UsageError(f"{source}: model.safetensors has no {stored}: the weights do not match config.json")
        if len(found) != len(box) or any(stop > n for (_, stop), n in zip(box, found)):
            raise UsageError(f"{source}: model.safetensors' {stored} {found} cannot hold {name} {tuple(shape)}: the "
                             "weights do not match config.json")
    return config


# ------------------------------------------------------------------------------------------------------------
# Checkpoints
#
# One format for every layout. A checkpoint is a folder `<out_dir>/ckpt-<step>` with one file per rank and a
# meta.pt; `<out_dir>/latest` names the newest complete one. Each rank file maps tensor names (the gpt.py
# parameter name, or `exp_avg/<name>`, `exp_avg_sq/<name>` for AdamW's moments) to a list of pieces:
#   {"shape": full shape, "box": ((start, stop) per dim), "flat": (start, stop), "data": 1-D tensor}
# A piece is what a rank holds of a tensor (its Part, below), copied out. Loading assembles a full tensor
# from every piece and lets the loading layout take its own part, so any layout resumes any other.


class Part(NamedTuple):
    """Which part of the full tensor `name` (of full `shape`) this rank holds, and where: elements [flat[0],
    flat[1]) of the flattened full[box] sit in tensor.view(-1) from `start` on. A whole tensor has the full box and
    flat range; a tensor-parallel slice narrows the box; an FSDP shard narrows the flat range; 2-D does both."""
    name: str
    shape: tuple
    box: tuple
    flat: tuple
    tensor: torch.Tensor
    start: int = 0

    def local(self, tensor=None):
        """This part's elements in `tensor` (default: the parameter; or its gradient, an AdamW moment)."""
        tensor = self.tensor if tensor is None else tensor
        return tensor.detach().view(-1)[self.start:self.start + self.flat[1] - self.flat[0]]

    def initial_value(self, value):
        """This part's elements of the parameter's initial value, 1-D, from value = initial_values(...): only they
        are read."""
        return value(self.name, self.shape, self.box, self.flat)

    @property
    def sliced(self):
        """Split across tensor-parallel ranks, as opposed to replicated on each (whole, or an FSDP shard of it)."""
        return any(box != (0, n) for box, n in zip(self.box, self.shape))


def whole_part(name, tensor, shape=None, box=None):
    """The Part of a tensor this rank holds entirely: a whole parameter, or a tensor-parallel slice full[box]."""
    shape = tuple(tensor.shape if shape is None else shape)
    box = tuple((0, n) for n in shape) if box is None else tuple(box)
    return Part(name, shape, box, (0, tensor.numel()), tensor)


def parameter_parts(model):
    """The Part of every parameter of a model whose modules may hold slices: a module lists its slices in a `boxes`
    dict, parameter name -> (full shape, box) (train_tp.py's layers); any other parameter is whole. A tied parameter
    is listed once, under its first name (wte.weight for the LM head)."""
    parts = []
    for name, param in model.named_parameters():
        module_name, _, param_name = name.rpartition(".")
        shape, box = getattr(model.get_submodule(module_name), "boxes", {}).get(param_name, (None, None))
        parts.append(whole_part(name, param, shape, box))
    return parts


def piece(shape, data, box=None, flat=None):
    box = tuple((0, n) for n in shape) if box is None else tuple(box)
    flat = (0, math.prod(b - a for a, b in box)) if flat is None else tuple(flat)
    if data.numel() != flat[1] - flat[0]:
        raise ValueError(f"piece of {data.numel()} elements for flat range {flat}")
    # A copy, not a view: torch.save writes a view's whole storage, e.g. an entire FSDP flat buffer.
    return {"shape": tuple(shape), "box": box, "flat": flat, "data": data.detach().reshape(-1).to("cpu", copy=True)}


def checkpoint_tensors(parts, optimizer):
    """The pieces a rank writes: its parameters' parts, and AdamW's moments over the same parts."""
    tensors = {}
    for part in parts:
        tensors.setdefault(part.name, []).append(piece(part.shape, part.local(), part.box, part.flat))
        state = optimizer.state.get(part.tensor, {})
        for moment in ("exp_avg", "exp_avg_sq"):
            if moment in state:
                tensors.setdefault(f"{moment}/{part.name}", []).append(
                    piece(part.shape, part.local(state[moment]), part.box, part.flat))
    return tensors


def save_shard(out_dir, step, rank, tensors, rng_state):
    """Every rank writes its own pieces into the unpublished folder of this step."""
    folder = os.path.join(out_dir, f"ckpt-{step:07d}.tmp")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"rank{rank:05d}.pt")
    torch.save({"tensors": tensors, "rng": rng_state}, path + ".tmp")
    os.replace(path + ".tmp", path)


def publish_checkpoint(out_dir, step, world_size, meta, keep=0):
    """Rank 0, after every rank's save_shard has returned (a barrier in distributed scripts): write meta,
    rename the folder into place, repoint `latest`, then delete all but the `keep` newest checkpoints (0: keep
    every one). A crash at any moment leaves `latest` naming a complete checkpoint, the previous one until the
    os.replace."""
    tmp = os.path.join(out_dir, f"ckpt-{step:07d}.tmp")
    final = os.path.join(out_dir, f"ckpt-{step:07d}")
    meta = dict(meta, step=step, files=[f"rank{r:05d}.pt" for r in range(world_size)])
    torch.save(meta, os.path.join(tmp, "meta.pt"))
    previous = latest_checkpoint(out_dir)
    if os.path.exists(final) and final != previous:
        shutil.rmtree(final)  # left by a run that crashed between this rename and the next line's
    os.rename(tmp, final)
    with open(os.path.join(out_dir, "latest.tmp"), "w") as f:
        f.write(os.path.basename(final))
        f.flush()
        os.fsync(f.fileno())
    os.replace(os.path.join(out_dir, "latest.tmp"), os.path.join(out_dir, "latest"))
    # Older than this one by step; a newer one is left by a run resumed from before it, and is overwritten later.
    older = sorted(name for name in os.listdir(out_dir)
                   if re.fullmatch(r"ckpt-\d{7}", name) and name < os.path.basename(final))
    for name in older[:max(0, len(older) - (keep - 1))] if keep else []:
        shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)


def save_checkpoint(args, step, tensors, config, device, rank=0, world_size=1):
    """Every rank writes its pieces; once all have (a barrier), rank 0 publishes the checkpoint."""
    save_shard(args.out_dir, step, rank, tensors, rng_state(device))
    if world_size > 1:
        dist.barrier()
    if rank == 0:
        publish_checkpoint(args.out_dir, step, world_size, {"config": asdict(config), "args": vars(args)},
                           args.keep_checkpoints)
    if world_size > 1:
        dist.barrier()  # nobody goes on (or exits) while `latest` may still name the previous checkpoint


def latest_checkpoint(out_dir):
    pointer = os.path.join(out_dir, "latest")
    if not os.path.exists(pointer):
        return None
    with open(pointer) as f:
        return os.path.join(out_dir, f.read().strip())


SCHEDULE_FLAGS = ("max_steps", "lr", "warmup_steps", "min_lr")  # get_lr(step) depends on these


def checkpoint_to_resume(args):
    """The checkpoint --resume continues, or None; refuses to train over a run it was not told to continue.
    Says when the schedule differs from the one the checkpoint was trained with, and exits (code 0) when the
    checkpoint has reached --max_steps already."""
    if args.resume and getattr(args, "impl", "ours") == "torch":
        raise UsageError("--resume is implemented for --impl ours only (it resumes checkpoints of any layout)")
    path = latest_checkpoint(args.out_dir)
    if path and not args.resume:
        raise UsageError(f"{args.out_dir!r} already holds {path!r}: pass --resume to continue it, "
                         "or choose another --out_dir")
    if not (path and args.resume):
        return None
    saved = Checkpoint(path).meta
    say = print if launched_rank()[0] == 0 else lambda text: None
    if saved["step"] >= args.max_steps:
        say(f"nothing to do: {path!r} is at step {saved['step']} and --max_steps is {args.max_steps}; pass a larger "
            "--max_steps to train further")
        raise SystemExit(0)
    changed = [f"--{flag} {saved['args'][flag]} -> {getattr(args, flag)}" for flag in SCHEDULE_FLAGS
               if saved["args"].get(flag, getattr(args, flag)) != getattr(args, flag)]
    if changed:
        say(f"the schedule differs from the checkpoint's ({', '.join(changed)}): the learning rate follows the "
            f"new one from step {saved['step']} on")
    return path


class Checkpoint:
    """A checkpoint folder opened for reading. Files are memory-mapped: a full tensor is assembled only
    when asked for, one at a time, so loading never holds the whole model at once."""

    def __init__(self, path):
        try:
            self.meta = torch.load(os.path.join(path, "meta.pt"), weights_only=True)
            self.shards = [torch.load(os.path.join(path, name), map_location="cpu", weights_only=True, mmap=True)
                           for name in self.meta["files"]]
        except Exception as error:
            raise RuntimeError(f"checkpoint {path!r} is unreadable ({type(error).__name__}: {error}); "
                               "delete it or point `latest` at an older one") from error
        self.path = path
        self.pieces = {}
        for shard in self.shards:
            for name, pieces in shard["tensors"].items():
                self.pieces.setdefault(name, []).extend(pieces)

    def check(self, config, shapes):
        """Refuse, before anything is loaded, a checkpoint of another model or one with missing pieces."""
        if self.meta["config"] != asdict(config):
            raise UsageError(f"checkpoint {self.path!r} is of another model: {self.meta['config']} "
                             f"vs this run's {asdict(config)}; use a new --out_dir, or the --model, --block_size "
                             "and --dropout it was saved with")
        for name, shape in shapes.items():
            pieces = self.pieces.get(name)
            if not pieces or tuple(pieces[0]["shape"]) != tuple(shape):
                found = tuple(pieces[0]["shape"]) if pieces else None
                raise ValueError(f"checkpoint {self.path!r}: tensor {name} has shape {found}, expected {tuple(shape)}")
            covered = sum(p["flat"][1] - p["flat"][0] for p in pieces)
            if covered != math.prod(shape):
                raise ValueError(f"checkpoint {self.path!r}: tensor {name} covers {covered} of "
                                 f"{math.prod(shape)} elements (a rank file is missing or truncated)")

    def full(self, name):
        pieces = self.pieces[name]
        out = torch.empty(pieces[0]["shape"], dtype=pieces[0]["data"].dtype)
        for p in pieces:
            region = out[tuple(slice(a, b) for a, b in p["box"])]
            flat = region.flatten()  # a copy when the box is not contiguous: written back below
            flat[p["flat"][0]:p["flat"][1]] = p["data"]
            region.copy_(flat.view(region.shape))
        return out

    def rng_state(self, rank):
        return self.shards[rank]["rng"] if rank < len(self.shards) else None


@torch.no_grad()
def load_checkpoint(checkpoint, parts, optimizer, config):
    """Fill this rank's parts (parameters, and AdamW moments unless optimizer is None) from a checkpoint of any
    layout. Everything is checked before the first tensor is touched, so a refused checkpoint leaves the model as it
    was."""
    shapes = {part.name: part.shape for part in parts}
    with_moments = optimizer is not None and f"exp_avg/{parts[0].name}" in checkpoint.pieces
    if with_moments:
        shapes.update({f"{m}/{name}": shape for name, shape in list(shapes.items()) for m in ("exp_avg", "exp_avg_sq")})
    checkpoint.check(config, shapes)

    def region(name, part):
        return checkpoint.full(name)[tuple(slice(a, b) for a, b in part.box)].flatten()[part.flat[0]:part.flat[1]]

    moments = {}
    for part in parts:
        part.local().copy_(region(part.name, part))
        if with_moments:
            if part.tensor not in moments:
                moments[part.tensor] = (torch.zeros_like(part.tensor), torch.zeros_like(part.tensor))
            for buffer, moment in zip(moments[part.tensor], ("exp_avg", "exp_avg_sq")):
                part.local(buffer).copy_(region(f"{moment}/{part.name}", part))
    if moments:
        # Through load_state_dict, so AdamW puts its step counter where its implementation (fused, foreach)
        # wants it; every parameter has taken one update per optimizer step.
        state_dict = optimizer.state_dict()
        index = {p: i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
        for param, (exp_avg, exp_avg_sq) in moments.items():
            state_dict["state"][index[param]] = {"step": torch.tensor(float(checkpoint.meta["step"])),
                                                 "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        optimizer.load_state_dict(state_dict)


def resume(path, parts, optimizer, config, rank, device):
    """Load checkpoint `path` (None: start fresh) into this rank's parts; returns the step to continue from."""
    if path is None:
        return 0
    checkpoint = Checkpoint(path)
    load_checkpoint(checkpoint, parts, optimizer, config)
    set_rng_state(checkpoint.rng_state(rank), device)
    return checkpoint.meta["step"]


def generator_state(device):
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_generator_state(state, device):
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


rng_streams = {}  # name -> RNGStream: the streams this process's model draws from, saved in its checkpoints


class RNGStream:
    """A second stream of random numbers, for a region whose draws must differ from the rest's: dropout on a
    tensor-parallel rank's own heads must differ across ranks, dropout on activations every rank holds alike must
    agree. `swap`, a forward hook where the region starts and again where it ends, exchanges the default
    generator's state with the stream's (as Megatron-LM's RNG tracker forks it); seeded on first use."""

    def __init__(self, name, seed):
        self.seed, self.state = seed, None
        rng_streams[name] = self

    def swap(self, module, args, *output):
        device = args[0].device
        current = generator_state(device)
        if self.state is None:
            torch.manual_seed(self.seed)
        else:
            set_generator_state(self.state, device)
        self.state = current


def rng_state(device):
    """Every generator this rank draws from: the default ones (CPU, and this GPU's) and the streams."""
    return dict(generator_state(device), streams={name: stream.state for name, stream in rng_streams.items()})


def set_rng_state(state, device):
    if state is None:
        return
    set_generator_state(state, device)
    for name, stream_state in state.get("streams", {}).items():
        if name in rng_streams:
            rng_streams[name].state = stream_state


# ------------------------------------------------------------------------------------------------------------
# Memory planning (--plan): the bytes one rank holds, item by item, from the config and the layout alone. The
# model is built on meta (no memory, seconds for 175B); each strategy's rules are re-stated here, and
# test_parallel.py holds them to what real runs hold: parameters, gradients and AdamW state to the byte, the
# tensors autograd saves for backward within 10%.


class Layout(NamedTuple):
    strategy: str  # single, ddp, fsdp, tp, 2d
    world_size: int
    dp: int  # data-parallel degree: FSDP's shard count in fsdp and 2d
    tp: int  # tensor-parallel degree
    micro_batch: int  # sequences per rank per micro-step
    dtype: str = "float32"  # compute dtype: bfloat16 is autocast (single, ddp, tp) or FSDP's gathered dtype
    sequence_parallel: bool = False
    loss_parallel: bool = True
    activation_checkpointing: bool = False
    reshard: bool = True  # FSDP frees each block's gathered weights after its forward (--no_reshard: keeps them)
    device: str = "cuda"  # where it runs: autocast's rules differ a little between CUDA and CPU


def layout_of(args, world_size, dp_size, micro_batch, device):
    """The Layout a script's flags describe on world_size ranks, dp_size of them data-parallel, on device (a type)."""
    return Layout(args.strategy, world_size, dp_size, world_size // dp_size, micro_batch, args.dtype,
                  getattr(args, "sequence_parallel", False), not getattr(args, "no_loss_parallel", False),
                  args.activation_checkpointing, not getattr(args, "no_reshard", False), device)


# Tensor parallelism slices these (train_tp.py): q, k, v and fc by output rows (weight and bias), both projections'
# weights by input columns, the embedding by vocabulary rows; layer norms, wpe and the projections' biases are whole.
TENSOR_PARALLEL_SLICED = re.compile(r"^wte\.weight$|\.(query|key|value|fc)\.(weight|bias)$|\.proj\.weight$")


_parameters_on_meta = {}


def parameters_on_meta(config):
    """gpt.GPT(config)'s named parameters, built on meta once per config: a plan reads only their shapes."""
    key = tuple(asdict(config).items())
    if key not in _parameters_on_meta:
        with torch.device("meta"):
            _parameters_on_meta[key] = list(gpt.GPT(config).named_parameters())
    return _parameters_on_meta[key]


def parameter_plan(config, layout):
    """(elements of parameters this rank keeps, tensors its optimizer steps, elements of the largest gathered block
    unit and of the gathered root unit (FSDP), elements autocast copies to bfloat16 (the matmuls' weights and
    biases)): what the strategies build, counted on meta."""
    units, tensors, cast = {}, 0, 0  # units: FSDP's unit ("" the root, or a block) -> {is a matrix: elements}
    for name, param in parameters_on_meta(config):
        local = param.numel() // (layout.tp if TENSOR_PARALLEL_SLICED.search(name) else 1)
        kinds = units.setdefault(".".join(name.split(".")[:2]) if name.startswith("blocks.") else "", {})
        kinds[param.dim() >= 2] = kinds.get(param.dim() >= 2, 0) + local
        tensors += 1
        cast += local if not (".ln_" in name or name.startswith(("ln_f", "wpe"))) else 0
    if layout.strategy not in ("fsdp", "2d"):
        return sum(n for kinds in units.values() for n in kinds.values()), tensors, 0, 0, cast
    shards = {unit: [-(-n // layout.dp) for n in kinds.values()] for unit, kinds in units.items()}  # padded to dp
    gathered = {unit: sum(sizes) * layout.dp for unit, sizes in shards.items()}
    return (sum(map(sum, shards.values())), sum(map(len, shards.values())),
            max(size for unit, size in gathered.items() if unit), gathered[""], 0)


def activation_plan(config, layout):
    """Bytes autograd saves for backward during one micro-batch's forward, as {item: bytes}; and the bytes one
    block's recompute and backward hold for a moment under --activation_checkpointing. Float32 is exact (measured on
    CPU, test_parallel.py). bfloat16 follows autocast's rules: each matmul saves its own bfloat16 copy of its
    input; the residual stream stays float32 (the weights are) except under FSDP, whose weights are gathered in
    bfloat16; a layer norm runs in float32 on CUDA (saving a float32 copy of its input), in its input's dtype on
    CPU. Dropout masks count as CUDA keeps them, one byte an element."""
    b, s, h, L = layout.micro_batch, config.block_size, config.n_embd, config.n_layer
    t, e = layout.tp, (2 if layout.dtype == "bfloat16" else 4)
    shard = t if layout.sequence_parallel else 1  # the residual stream is split over the sequence under SP
    low_precision_norms = e == 2 and layout.strategy in ("fsdp", "2d") and layout.device == "cpu"
    residual = b * (s // shard) * h * (2 if e == 2 and layout.strategy in ("fsdp", "2d") else 4)  # a block's input
    norm = (b * (s // shard) * h + 2 * b * (s // shard)) * (2 if low_precision_norms else 4)  # input, mean, 1/std
    block = (2 * norm  # the two layer norms
             + (4 if low_precision_norms else 8) * b * s * h  # the column-parallel linears' inputs, whole sequence
             # (SP gathers it): in float32 q, k and v share one (2 x 4 bytes), in bfloat16 q, k, v and fc cast their
             # own (4 x 2 bytes), unless the layer norms' outputs are bfloat16 already (2 x 2 bytes)
             + 4 * b * s * h // t * e  # q, k, v and the attention output, this rank's heads
             + b * (config.n_head // t) * s * 4  # attention's log-sum-exp per head and token
             + 2 * b * s * 4 * h // t * e  # the MLP's fc output (GELU's input) and GELU's output
             + (2 * b * (s // shard) * h if config.dropout else 0))  # the two residual dropouts' masks
    vocab_parallel = layout.tp > 1 and layout.loss_parallel  # a softmax over this rank's padded slice, and a mask
    vocab = config.padded_vocab_size // t if vocab_parallel else config.vocab_size
    items = {
        "activations of the blocks": L * (residual if layout.activation_checkpointing else block),
        "embeddings and final layer norm": (b * s * 8 + s * 8 + (b * s if t > 1 else 0)  # ids, positions, TP's mask
                                            + norm + b * s * h * e  # the final norm, the LM head's whole input
                                            + (b * (s // shard) * h if config.dropout else 0)),
        "loss (softmax of the logits)": b * s * vocab * 4 + b * s * (9 if vocab_parallel else 8),
    }
    return items, (block if layout.activation_checkpointing else 0)


def plan_memory(config, layout):
    """[(item, bytes)] one rank holds at its peak in this layout: what lives all run, one micro-batch's saved
    activations, and what exists at once during a step (gathered units, logits and their gradient)."""
    params, tensors, unit, root, cast = parameter_plan(config, layout)
    activations, recompute = activation_plan(config, layout)
    e = 2 if layout.dtype == "bfloat16" else 4
    fsdp = layout.strategy in ("fsdp", "2d")
    logits = layout.micro_batch * config.block_size * config.padded_vocab_size // (
        layout.tp if layout.tp > 1 and layout.loss_parallel else 1)
    rows = [("parameters (float32)", 4 * params),
            ("gradients (float32)", 4 * params),
            ("AdamW state (exp_avg, exp_avg_sq, step; float32)", 8 * params + 4 * tensors)]
    if e == 2 and not fsdp:  # autocast's copies, saved by the matmuls; checkpointed blocks recast theirs
        head = config.padded_vocab_size * config.n_embd // layout.tp
        one_block = (cast - head) // config.n_layer
        rows.append(("bfloat16 copies of the weights, saved for backward (autocast)",
                     2 * (head if layout.activation_checkpointing else cast)))
        recompute += 2 * one_block if layout.activation_checkpointing else 0
    rows += list(activations.items())
    if recompute:
        rows.append(("one block recomputed in backward (--activation_checkpointing)", recompute))
    if fsdp:
        units = config.n_layer if not layout.reshard else 2  # the one computing and the one prefetched
        rows.append((f"gathered weights: the root and {units} block units ({layout.dtype})", e * (root + units * unit)))
        rows.append(("a block unit's gradient being reduce-scattered (and its float32 copy)",
                     4 * unit + (2 * unit if e == 2 else 0)))
    rows.append(("logits and their gradient", logits * (e + 4)))
    return rows


def format_bytes(size):
    return f"{size / 1e9:,.2f} GB" if size >= 1e9 else f"{size / 1e6:,.1f} MB"


def plan_verdict(total, gpu_memory_gb, layout, rows):
    """One line: whether `total` bytes fit in gpu_memory_gb (10^9 bytes), and if not what to change."""
    budget = gpu_memory_gb * 1e9
    if total <= budget:
        return f"fits on {gpu_memory_gb:g} GB with {(budget - total) / 1e9:.1f} GB free"
    largest = max(rows, key=lambda row: row[1])[0]
    advice = []
    if not layout.activation_checkpointing:
        advice.append("--activation_checkpointing")
    if layout.micro_batch > 1:
        advice.append("a smaller --micro_batch")
    if "activations" not in largest or not advice:
        advice.append("train_fsdp.py or a larger --dp" if layout.strategy in ("single", "ddp", "tp")
                      else "a larger --tp (train_2d.py) or more GPUs")
    return f"does not fit: needs {total / 1e9:.1f} GB; try {' or '.join(advice)}"


def plan_config(args):
    """The model --plan describes: --model's preset with the data's vocabulary (meta.json; the default corpus's
    bytes before it is built; GPT-2's 50,257 tokens for a folder not prepared yet)."""
    if os.path.exists(os.path.join(args.data, "meta.json")):
        vocab_size = load_meta(args.data)["vocab_size"]
    else:
        vocab_size = 256 if args.data == DEFAULT_DATA_DIR else 50257
    preset = args.model or (args.init_from if args.init_from in gpt.PRESETS else "tiny")
    return gpt.make_config(preset, vocab_size, args.block_size, args.dropout), preset


def print_plan(args, world_size, dp_size):
    """--plan: print what one rank of this layout needs, item by item, and whether it fits in --gpu_memory."""
    config, preset = plan_config(args)
    if args.micro_batch is None and args.global_batch % dp_size:
        raise UsageError(f"--global_batch {args.global_batch} does not split over {dp_size} data-parallel ranks: "
                         f"choose a multiple of {dp_size}")
    layout = layout_of(args, world_size, dp_size, args.micro_batch or args.global_batch // dp_size,
                       "cpu" if args.device == "cpu" else "cuda")
    if layout.tp > 1:
        check_tensor_parallel(config, layout.tp, layout.sequence_parallel)
    rows = plan_memory(config, layout)
    total = sum(size for _, size in rows)
    num_params = sum(param.numel() for _, param in parameters_on_meta(config))
    size = f"{num_params / 1e9:,.1f}B" if num_params >= 1e9 else f"{num_params / 1e6:,.1f}M"
    say = print if launched_rank()[0] == 0 else lambda text: None  # under torchrun, once
    say(f"plan: {preset} ({size} parameters, vocabulary {config.vocab_size:,}) | {layout.strategy}"
        f" on {world_size} rank{'s' * (world_size > 1)} (dp {layout.dp} x tp {layout.tp}) | micro batch "
        f"{layout.micro_batch} x {config.block_size} tokens | {layout.dtype}"
        + " | activation checkpointing" * layout.activation_checkpointing
        + " | sequence parallel" * layout.sequence_parallel)
    for item, size in rows + [("total, one rank", total)]:
        say(f"  {item:66} {format_bytes(size):>11}")
    say(plan_verdict(total, args.gpu_memory, layout, rows))
    return rows


# ------------------------------------------------------------------------------------------------------------
# Metrics and logging

# Peak dense bf16 tensor-core FLOP/s (no sparsity), by a substring of torch.cuda.get_device_name().
PEAK_BF16_FLOPS = {"A100": 312e12, "H100": 989e12, "H200": 989e12}


def peak_flops(device):
    """Peak bf16 FLOP/s of one device, or None where we do not know it (CPU, unlisted GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


def peak_memory_mb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # peak RSS of this process (Linux: KiB)


def format_log(record):
    mfu = "n/a" if record.get("mfu") is None else f"{100 * record['mfu']:.1f}%"
    line = (f"step {record['step']:5d} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
            f"grad norm {record['grad_norm']:.3f} | {record['tokens_per_s']:,.0f} tok/s | mfu {mfu} | "
            f"mem {record['peak_mem_mb']:,.0f} MB | {record['step_ms']:.0f} ms")
    return line + (f" | val loss {record['val_loss']:.4f}" if "val_loss" in record else "")


class Logger:
    """Progress of a run: the console (rank 0, or every rank with --log_all_ranks) and, from rank 0,
    <out_dir>/metrics.jsonl with TensorBoard and Weights & Biases when asked for (optional packages)."""

    def __init__(self, args, config, device, rank=0, world_size=1):
        self.args, self.config, self.device, self.world_size = args, config, device, world_size
        self.writes, self.prints = rank == 0, rank == 0 or args.log_all_ranks
        self.prefix = f"[rank {rank}] " if args.log_all_ranks else ""
        with torch.device("meta"):  # the whole model's counts, whatever part of it this rank holds
            model = gpt.GPT(config)
        self.num_params = model.num_params()
        self.flops_per_token = gpt.flops_per_token(config, model.num_params(with_position_embedding=False))
        self.peak_flops = peak_flops(device)
        self.tensorboard = self.wandb = None
        if not self.writes:
            return
        os.makedirs(args.out_dir, exist_ok=True)
        self.path = os.path.join(args.out_dir, "metrics.jsonl")
        if args.tensorboard:  # check_arguments() made sure the optional packages are there
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(args.out_dir)
        if args.wandb:
            import wandb

            self.wandb = wandb.init(project="gpt-parallel", config=vars(args), dir=args.out_dir)

    def print(self, text):
        if self.prints:
            print(self.prefix + text)

    def start(self, sampler, dp_size, start_step, layout=""):
        model = self.args.init_from or self.args.model or "tiny"
        plan = plan_memory(self.config, layout_of(self.args, self.world_size, dp_size, sampler.micro_batch,
                                                  self.device.type))
        planned = sum(size for _, size in plan)
        origin = (f"resuming at step {start_step}" if start_step else
                  f"from {self.args.init_from}'s weights" if self.args.init_from else "from scratch")
        self.print(f"{model}: {self.num_params / 1e6:.2f}M parameters | {self.world_size} rank"
                   f"{'s' * (self.world_size > 1)} on {self.device} | {layout}global batch {self.args.global_batch} = "
                   f"micro batch {sampler.micro_batch} x {sampler.accumulation} accumulation x {dp_size} data-parallel"
                   f" | {origin} | ready in {time.perf_counter() - IMPORTED:.1f} s, peak "
                   f"{peak_memory_mb(self.device):,.0f} MB | planned peak {format_bytes(planned)} a rank (--plan)")

    def due(self, step, val_loss):
        return step % self.args.log_interval == 0 or step + 1 == self.args.max_steps or val_loss is not None

    def log_step(self, step, loss, lr, grad_norm, t0, val_loss=None):
        """loss: the global batch's mean loss (a 0-d tensor); t0: perf_counter() when the step began."""
        loss = loss.item()  # waits for the device: the step time below is real
        step_s = time.perf_counter() - t0
        tokens_per_s = self.args.global_batch * self.args.block_size / step_s
        record = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm.item(), "tokens_per_s": tokens_per_s,
                  "mfu": (self.flops_per_token * tokens_per_s / (self.world_size * self.peak_flops)
                          if self.peak_flops else None),
                  "peak_mem_mb": peak_memory_mb(self.device), "step_ms": 1000 * step_s}
        if val_loss is not None:
            record["val_loss"] = val_loss
        self.print(format_log(record))
        if not self.writes:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        for key, value in record.items():
            if self.tensorboard and key != "step" and value is not None:
                self.tensorboard.add_scalar(key, value, record["step"])
        if self.wandb:
            self.wandb.log(record, step=record["step"])
