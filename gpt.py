"""
The GPT-2 model and everything the training scripts share: config presets, the model, per-name weight
init, the FLOPs count, the batch sampler over token files, the LR schedule, the checkpoint format and the
shared command-line flags. There is no torch.distributed code here: strategies are applied to the model
from outside (train_ddp.py, train_fsdp.py, train_tp.py, train_2d.py), and the model runs unchanged under them.
"""

import argparse
import hashlib
import json
import math
import os
import resource
import shutil
import time
from dataclasses import asdict, dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    from flash_attn import flash_attn_func
except ImportError:
    flash_attn_func = None


# ------------------------------------------------------------------------------------------------------------
# Model


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50257  # the tokenizer's; the embedding is padded up to padded_vocab_size
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True

    @property
    def padded_vocab_size(self):
        # A multiple of 128 keeps the LM head's matmul on fast kernels and divisible by any sensible --tp.
        return -(-self.vocab_size // 128) * 128

    @property
    def head_dim(self):
        return self.n_embd // self.n_head


PRESETS = {
    "tiny": dict(n_layer=4, n_head=4, n_embd=128),  # ~0.9M parameters with the byte vocabulary: trains on a laptop CPU
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),  # 1558M
}


def make_config(preset, vocab_size, block_size, dropout=0.0):
    if preset not in PRESETS:
        raise ValueError(f"unknown --model {preset!r}: choose one of {', '.join(PRESETS)}")
    config = GPTConfig(vocab_size=vocab_size, block_size=block_size, dropout=dropout, **PRESETS[preset])
    if config.n_embd % config.n_head:
        raise ValueError(f"n_embd {config.n_embd} is not divisible by n_head {config.n_head}")
    return config


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        # Separate q, k and v projections: tensor parallelism splits each by output rows, and rows
        # [h * head_dim, (h + 1) * head_dim) are exactly head h, so a rank's slice is its own heads. A fused
        # qkv weight would interleave q, k and v in one row range and need a reshuffle before sharding.
        self.query = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.key = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.value = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)
        self.use_flash = False  # set by set_attention()

    def forward(self, x):
        q, k, v = self.query(x), self.key(x), self.value(x)
        # Sizes come from q, not x, and heads are inferred (-1): under tensor parallelism q holds only this
        # rank's heads, and under sequence parallelism x holds only a slice of the sequence.
        B, T, _ = q.shape
        q, k, v = (t.view(B, T, -1, self.head_dim) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        if self.use_flash:
            y = flash_attn_func(q, k, v, dropout_p=dropout, causal=True)
        else:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True).transpose(1, 2)
        return self.resid_dropout(self.proj(y.reshape(B, T, -1)))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.padded_vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: named_parameters() lists it once, as wte.weight
        # A module, not a call inside forward, so tensor parallelism can swap in its vocab-parallel loss.
        self.loss_fn = nn.CrossEntropyLoss()

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return self.loss_fn(logits.flatten(0, 1), targets.flatten())

    @torch.no_grad()
    def init_weights(self, seed):
        """Give every parameter its initial value by name. Works on a model built on `meta` and
        materialised with to_empty(), and gives the same numbers as on a model built directly."""
        self.lm_head.weight = self.wte.weight  # to_empty() gives each module its own tensor: tie them again
        for name, param in self.named_parameters():
            param.copy_(initial_value(name, param.shape, self.config, seed))

    def num_params(self, with_position_embedding=True):
        n = sum(p.numel() for p in self.parameters())
        return n if with_position_embedding else n - self.wpe.weight.numel()


def initial_value(name, shape, config, seed):
    """The float32 CPU tensor parameter `name` starts with: a function of (seed, name) alone, so a rank that
    builds one block, one shard or one slice takes exactly what one device would have there."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    if name.endswith("bias"):
        return torch.zeros(shape)
    if ".ln_" in name or name.startswith("ln_"):
        return torch.ones(shape)
    std = 0.02
    if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
        std /= math.sqrt(2 * config.n_layer)  # GPT-2: residual projections scaled by 1/sqrt(2 n_layer)
    return torch.randn(shape, generator=generator) * std


def set_attention(model, attn, device, dtype):
    """--attn sdpa|flash. flash-attn's kernels exist only for CUDA in half precision."""
    if attn == "flash":
        if flash_attn_func is None:
            raise RuntimeError("--attn flash needs the flash-attn package (pip install flash-attn); or use --attn sdpa")
        if device.type != "cuda" or dtype != torch.bfloat16:
            raise RuntimeError("--attn flash runs only on CUDA with --dtype bfloat16; use --attn sdpa otherwise")
    for module in model.modules():
        if isinstance(module, CausalSelfAttention):
            module.use_flash = attn == "flash"


@torch.no_grad()
def generate(model, idx, max_new_tokens, block_size, temperature=0.8, top_k=40, seed=0):
    """Sample max_new_tokens after idx. The sampling generator is seeded, so every rank of a sharded model
    draws the same tokens and runs the same forward passes."""
    generator = torch.Generator(device=idx.device).manual_seed(seed)
    for _ in range(max_new_tokens):
        logits = model(idx[:, -block_size:])[:, -1, :].float() / temperature
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, [-1]]
            logits = logits.masked_fill(logits < kth, -float("inf"))
        next_token = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
        idx = torch.cat([idx, next_token], dim=1)
    return idx


# ------------------------------------------------------------------------------------------------------------
# FLOPs and MFU

# Peak dense bf16 tensor-core FLOP/s (no sparsity), by a substring of torch.cuda.get_device_name().
PEAK_BF16_FLOPS = {"A100": 312e12, "H100": 989e12, "H200": 989e12}


def flops_per_token(config, num_params):
    """6N + 12·L·H·Q·T (PaLM, appendix B): 6N for the matmuls of forward and backward with N the parameters
    without position embeddings (the tied embedding counts once, as the LM head's matmul), and 12·L·H·Q·T
    for attention scores and values, with H heads of size Q over a context of T tokens."""
    c = config
    return 6 * num_params + 12 * c.n_layer * c.n_head * c.head_dim * c.block_size


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


# ------------------------------------------------------------------------------------------------------------
# Data: token files and the batch sampler


def load_meta(data_dir):
    path = os.path.join(data_dir, "meta.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no prepared data in {data_dir!r} (meta.json missing): run "
                                f"`python prepare_data.py --out_dir {data_dir}` or pass --data with a prepared folder")
    with open(path) as f:
        return json.load(f)


def ensure_data(data_dir, is_writer, wait_s=600):
    """Make sure data_dir holds prepared tokens. The default corpus is built on first use by one process per
    machine (is_writer); the others wait for its meta.json, which is written last, so no collective is needed."""
    if os.path.exists(os.path.join(data_dir, "meta.json")):
        return load_meta(data_dir)
    if data_dir != DEFAULT_DATA_DIR:
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


DEFAULT_DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "default")


class BatchSampler:
    """Draws the batch of optimizer step `step` from (seed, step) alone, whatever the layout.

    The global batch is `global_batch` random windows of the token file. Data-parallel rank r owns the
    contiguous rows [r * accumulation * micro_batch, (r + 1) * accumulation * micro_batch) and takes
    micro_batch of them per micro-step; tensor-parallel peers pass the same dp_rank and get the same rows.
    """

    def __init__(self, path, block_size, global_batch, micro_batch, dp_rank, dp_size, seed, device):
        if global_batch % (micro_batch * dp_size):
            raise ValueError(f"--global_batch {global_batch} is not a multiple of --micro_batch {micro_batch} x "
                             f"data-parallel size {dp_size}: change one of them")
        self.path, self.block_size, self.seed, self.device = path, block_size, seed, device
        self.global_batch, self.micro_batch, self.dp_rank = global_batch, micro_batch, dp_rank
        self.accumulation = global_batch // (micro_batch * dp_size)
        self.num_tokens = len(np.memmap(path, dtype=np.uint16, mode="r"))
        if self.num_tokens <= block_size + 1:
            raise ValueError(f"{path} holds {self.num_tokens} tokens, fewer than --block_size {block_size} + 2")
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


@torch.no_grad()
def estimate_loss(model, sampler, iters, autocast):
    """Mean loss of this rank's rows over `iters` global batches of `sampler`, as a 0-d tensor; a
    data-parallel script averages it over its data-parallel group."""
    model.eval()
    total = torch.zeros((), device=sampler.device)
    for step in range(iters):
        for micro_step in range(sampler.accumulation):
            x, y = sampler.get(step, micro_step)
            with autocast:
                total += model(x, y).float()
    model.train()
    return total / (iters * sampler.accumulation)


def get_lr(step, args):
    """Linear warmup to --lr, then cosine decay to --min_lr at --max_steps."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps))
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (args.lr - args.min_lr)


def make_optimizer(decay_params, no_decay_params, args, device):
    """AdamW; weight decay only on matrices (2-D and up), never on biases, norms' gains or flat shards of them."""
    groups = [{"params": list(decay_params), "weight_decay": args.weight_decay},
              {"params": list(no_decay_params), "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


# ------------------------------------------------------------------------------------------------------------
# Checkpoints
#
# One format for every layout. A checkpoint is a folder `<out_dir>/ckpt-<step>` with one file per rank and a
# meta.pt; `<out_dir>/latest` names the newest complete one. Each rank file maps tensor names (the gpt.py
# parameter name, or `exp_avg/<name>`, `exp_avg_sq/<name>` for AdamW's moments) to a list of pieces:
#   {"shape": full shape, "box": ((start, stop) per dim), "flat": (start, stop), "data": 1-D tensor}
# A piece holds elements [flat[0], flat[1]) of the flattened sub-tensor full[box]. A whole tensor is one piece
# with the full box; a tensor-parallel slice narrows the box; an FSDP shard narrows the flat range; 2-D does
# both. A replicated tensor is written once, by the lowest rank holding it. Loading assembles a full tensor
# from every piece and lets the loading layout take its own part, so any layout resumes any other.


def piece(shape, data, box=None, flat=None):
    box = tuple((0, n) for n in shape) if box is None else tuple(box)
    flat = (0, math.prod(b - a for a, b in box)) if flat is None else tuple(flat)
    if data.numel() != flat[1] - flat[0]:
        raise ValueError(f"piece of {data.numel()} elements for flat range {flat}")
    # A copy, not a view: torch.save writes a view's whole storage, e.g. an entire FSDP flat buffer.
    return {"shape": tuple(shape), "box": box, "flat": flat, "data": data.detach().reshape(-1).to("cpu", copy=True)}


def save_shard(out_dir, step, rank, tensors, rng_state):
    """Every rank writes its own pieces into the unpublished folder of this step."""
    folder = os.path.join(out_dir, f"ckpt-{step:07d}.tmp")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"rank{rank:05d}.pt")
    torch.save({"tensors": tensors, "rng": rng_state}, path + ".tmp")
    os.replace(path + ".tmp", path)


def publish_checkpoint(out_dir, step, world_size, meta):
    """Rank 0, after every rank's save_shard has returned (a barrier in distributed scripts): write meta,
    rename the folder into place, then repoint `latest`. A crash at any moment leaves `latest` naming a
    complete checkpoint, the previous one until the final os.replace."""
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
    if previous and previous != final:
        shutil.rmtree(previous, ignore_errors=True)


def latest_checkpoint(out_dir):
    pointer = os.path.join(out_dir, "latest")
    if not os.path.exists(pointer):
        return None
    with open(pointer) as f:
        return os.path.join(out_dir, f.read().strip())


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
            raise ValueError(f"checkpoint {self.path!r} is of another model: {self.meta['config']} "
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


def rng_state(device):
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state, device):
    if state is None:
        return
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


class Slot(NamedTuple):
    """Where a rank keeps (part of) a named tensor: param.view(-1)[start : start + flat length] holds the
    elements [flat[0], flat[1]) of the flattened full[box] of the tensor `name` of full shape `shape`."""
    name: str
    shape: tuple
    box: tuple
    flat: tuple
    param: torch.Tensor
    start: int = 0


def whole_slot(name, param):
    """The slot of a parameter this rank holds entirely."""
    return Slot(name, tuple(param.shape), tuple((0, n) for n in param.shape), (0, param.numel()), param)


def _local(slot, tensor):
    return tensor.detach().view(-1)[slot.start:slot.start + slot.flat[1] - slot.flat[0]]


def checkpoint_tensors(slots, optimizer):
    """The pieces a rank writes: its parameters' slots, and AdamW's moments over the same slots."""
    tensors = {}
    for slot in slots:
        tensors.setdefault(slot.name, []).append(piece(slot.shape, _local(slot, slot.param), slot.box, slot.flat))
        state = optimizer.state.get(slot.param, {})
        for moment in ("exp_avg", "exp_avg_sq"):
            if moment in state:
                data = _local(slot, state[moment])
                tensors.setdefault(f"{moment}/{slot.name}", []).append(piece(slot.shape, data, slot.box, slot.flat))
    return tensors


@torch.no_grad()
def load_checkpoint(checkpoint, slots, optimizer, config):
    """Fill this rank's slots (parameters and AdamW moments) from a checkpoint of any layout. Everything is
    checked before the first tensor is touched, so a refused checkpoint leaves the model as it was."""
    shapes = {slot.name: slot.shape for slot in slots}
    with_moments = f"exp_avg/{slots[0].name}" in checkpoint.pieces
    if with_moments:
        shapes.update({f"{m}/{name}": shape for name, shape in list(shapes.items()) for m in ("exp_avg", "exp_avg_sq")})
    checkpoint.check(config, shapes)

    def part(name, slot):
        region = checkpoint.full(name)[tuple(slice(a, b) for a, b in slot.box)]
        return region.flatten()[slot.flat[0]:slot.flat[1]]

    moments = {}
    for slot in slots:
        _local(slot, slot.param).copy_(part(slot.name, slot))
        if with_moments:
            if slot.param not in moments:
                moments[slot.param] = (torch.zeros_like(slot.param), torch.zeros_like(slot.param))
            for buffer, moment in zip(moments[slot.param], ("exp_avg", "exp_avg_sq")):
                _local(slot, buffer).copy_(part(f"{moment}/{slot.name}", slot))
    if moments:
        # Through load_state_dict, so AdamW puts its step counter where its implementation (fused, foreach)
        # wants it; every parameter has taken one update per optimizer step.
        state_dict = optimizer.state_dict()
        index = {p: i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
        for param, (exp_avg, exp_avg_sq) in moments.items():
            state_dict["state"][index[param]] = {"step": torch.tensor(float(checkpoint.meta["step"])),
                                                 "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        optimizer.load_state_dict(state_dict)


# ------------------------------------------------------------------------------------------------------------
# What every training script shares: flags, device, threads, metrics


def get_parser(description):
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="tiny", help=f"preset: {', '.join(PRESETS)}")
    p.add_argument("--data", default=DEFAULT_DATA_DIR, help="folder with train.bin, val.bin, meta.json")
    p.add_argument("--global_batch", type=int, default=16, help="sequences per optimizer step")
    p.add_argument("--micro_batch", type=int, default=None, help="sequences per rank per micro-step (default: no accumulation)")
    p.add_argument("--block_size", type=int, default=128, help="context length")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--max_steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min_lr", type=float, default=1e-4)
    p.add_argument("--warmup_steps", type=int, default=30)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--grad_clip", type=float, default=1.0, help="max global grad norm; 0 disables clipping")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="bfloat16: autocast, float32 master weights")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "flash"])
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--eval_interval", type=int, default=100)
    p.add_argument("--eval_iters", type=int, default=4, help="global batches of validation data per evaluation")
    p.add_argument("--log_interval", type=int, default=10)
    p.add_argument("--out_dir", default="out")
    p.add_argument("--ckpt_interval", type=int, default=100, help="steps between checkpoints (and one at the end)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out_dir, if any")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--sample_tokens", type=int, default=200, help="tokens generated at the end; 0 skips it")
    p.add_argument("--timeout", type=float, default=600, help="seconds a collective may wait before the run fails")
    p.add_argument("--log_all_ranks", action="store_true", help="every rank prints its progress, not only rank 0")
    p.add_argument("--tensorboard", action="store_true")
    p.add_argument("--wandb", action="store_true")
    return p


def get_device(choice, local_rank=0):
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda but no CUDA device is visible; use --device cpu")
        torch.cuda.set_device(local_rank)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        return torch.device("cuda", local_rank)
    # Ranks sharing a machine share its cores; oversubscribing them makes every rank several times slower.
    if "OMP_NUM_THREADS" not in os.environ:  # an explicit setting wins (torchrun sets 1 for several ranks)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    return torch.device("cpu")


def fingerprint(args, script):
    """What must be equal on every rank: the arguments and the code of the script and of this file. A rank
    running stale code or other flags would otherwise desynchronise collectives and hang much later."""
    code = hashlib.sha256()
    for path in (script, __file__):
        with open(path, "rb") as f:
            code.update(f.read())
    arguments = {k: v for k, v in sorted(vars(args).items()) if k != "log_all_ranks"}
    return {"code": code.hexdigest()[:16], "args": json.dumps(arguments, sort_keys=True, default=str)}


def check_fingerprints(fingerprints):
    """fingerprints: every rank's fingerprint(), all-gathered. Raises on every rank alike, naming the ranks
    that differ from rank 0 and, for arguments, the flags that differ."""
    differ = [rank for rank, f in enumerate(fingerprints) if f["code"] != fingerprints[0]["code"]]
    if differ:
        raise RuntimeError(f"ranks {differ} run other code (script or gpt.py) than rank 0; launch every rank with "
                           "the same files and flags")
    differ = [rank for rank, f in enumerate(fingerprints) if f["args"] != fingerprints[0]["args"]]
    if differ:
        ours, theirs = json.loads(fingerprints[0]["args"]), json.loads(fingerprints[differ[0]]["args"])
        flags = ", ".join(f"--{key} {ours.get(key)} vs {theirs.get(key)}" for key in sorted(ours.keys() | theirs.keys())
                          if ours.get(key) != theirs.get(key))
        raise RuntimeError(f"ranks {differ} run other arguments than rank 0 (rank 0 vs rank {differ[0]}: {flags}); "
                           "launch every rank with the same files and flags")


class MetricsLogger:
    """metrics.jsonl (always), TensorBoard and Weights & Biases (optional packages, on request)."""

    def __init__(self, args, enabled):
        self.enabled = enabled
        self.tensorboard = self.wandb = None
        if not enabled:
            return
        os.makedirs(args.out_dir, exist_ok=True)
        self.path = os.path.join(args.out_dir, "metrics.jsonl")
        if args.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                raise RuntimeError("--tensorboard needs the tensorboard package: pip install tensorboard") from error
            self.tensorboard = SummaryWriter(args.out_dir)
        if args.wandb:
            try:
                import wandb
            except ImportError as error:
                raise RuntimeError("--wandb needs the wandb package: pip install wandb") from error
            self.wandb = wandb.init(project="gpt-parallel", config=vars(args), dir=args.out_dir)

    def log(self, record):
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        for key, value in record.items():
            if self.tensorboard and key != "step" and value is not None:
                self.tensorboard.add_scalar(key, value, record["step"])
        if self.wandb:
            self.wandb.log(record, step=record["step"])


def format_log(record):
    mfu = "n/a" if record.get("mfu") is None else f"{100 * record['mfu']:.1f}%"
    return (f"step {record['step']:5d} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
            f"grad norm {record['grad_norm']:.3f} | {record['tokens_per_s']:,.0f} tok/s | mfu {mfu} | "
            f"mem {record['peak_mem_mb']:,.0f} MB | {record['step_ms']:.0f} ms")
