"""
The GPT-2 model, and only the model: config presets, the modules, weight init by parameter name, the FLOPs
count, and sampling. Reads like nanoGPT's model.py. There is no torch.distributed code here: strategies are
applied to the model from outside (train_ddp.py, train_fsdp.py, train_tp.py, train_2d.py) and it runs unchanged
under them; what every training script needs that is not the model lives in training.py, and GPT-2's pretrained
weights are read by hugging_face.py.

Top to bottom: the config and its presets; attention, MLP, block and GPT; the loss over the real vocabulary; every
parameter's initial value by name; the attention kernel's choice; generate; and the FLOPs per token behind MFU.
"""

import hashlib
import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    from flash_attn import flash_attn_func
except ImportError:
    flash_attn_func = None


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
    # GPT-3's shapes (Brown et al. 2020, table 2.1; trained with a context of 2048), with head counts divisible by 8
    # so that --tp 1, 2, 4 and 8 all hold whole heads: 125M has 16 heads of 48 (the paper's 12 of 64), 1.3B 16 of
    # 128 (the table's 24 x 128 is not its d_model of 2048), 13B d_model 5120 = 40 x 128 (the table prints 5140).
    "gpt3-125m": dict(n_layer=12, n_head=16, n_embd=768),
    "gpt3-350m": dict(n_layer=24, n_head=16, n_embd=1024),
    "gpt3-760m": dict(n_layer=24, n_head=16, n_embd=1536),
    "gpt3-1.3b": dict(n_layer=24, n_head=16, n_embd=2048),
    "gpt3-2.7b": dict(n_layer=32, n_head=32, n_embd=2560),
    "gpt3-6.7b": dict(n_layer=32, n_head=32, n_embd=4096),
    "gpt3-13b": dict(n_layer=40, n_head=40, n_embd=5120),
    "gpt3-175b": dict(n_layer=96, n_head=96, n_embd=12288),
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
        self.attn_dropout = nn.Dropout(config.dropout)  # a module, so tensor parallelism can swap in its own
        self.resid_dropout = nn.Dropout(config.dropout)
        self.use_flash = False  # set by set_attention()

    def forward(self, x):
        q, k, v = self.query(x), self.key(x), self.value(x)
        # Sizes come from q, not x, and heads are inferred (-1): under tensor parallelism q holds only this
        # rank's heads, and under sequence parallelism x holds only a slice of the sequence.
        B, T, _ = q.shape
        q, k, v = (t.view(B, T, -1, self.head_dim) for t in (q, k, v))
        if self.training and self.attn_dropout.p > 0:
            # nanoGPT's explicit attention: attn_dropout, a module a strategy can replace, sees the [B, heads, T, T]
            # probabilities, which backward keeps (the fused kernels below would draw their masks inside)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            causal = torch.full((T, T), -math.inf, device=x.device).triu(1)  # no position sees a later one
            att = F.softmax(q @ k.transpose(-2, -1) * self.head_dim**-0.5 + causal, dim=-1)
            y = (self.attn_dropout(att) @ v).transpose(1, 2)
        elif self.use_flash:
            y = flash_attn_func(q, k, v, causal=True)
        else:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
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
        # An attribute, not a call inside forward, so tensor parallelism can swap in its vocab-parallel loss.
        self.loss_fn = partial(cross_entropy, vocab_size=config.vocab_size)

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
    def init_weights(self, seed, value=None):
        """Give every parameter its initial value by name: initial_value's, drawn from (seed, name), or value(name,
        shape) where given (training.initial_values: the one source every layout reads, pretrained weights too).
        Works on a model built on `meta` and materialised with to_empty(), and gives the same numbers as on a model
        built directly."""
        self.lm_head.weight = self.wte.weight  # to_empty() gives each module its own tensor: tie them again
        value = value or partial(initial_value, config=self.config, seed=seed)
        for name, param in self.named_parameters():
            param.copy_(value(name, param.shape))

    def num_params(self, with_position_embedding=True):
        n = sum(p.numel() for p in self.parameters())
        return n if with_position_embedding else n - self.wpe.weight.numel()


def cross_entropy(logits, targets, vocab_size):
    """GPT-2's loss: a softmax over the tokenizer's vocabulary only. The classes that pad the embedding up to
    padded_vocab_size are no tokens: they take neither probability nor gradient."""
    return F.cross_entropy(logits[:, :vocab_size], targets)


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


def set_attention(model, attn):
    """--attn sdpa|flash (training.check_arguments has made sure flash-attn can run: CUDA, bfloat16)."""
    for module in model.modules():
        if isinstance(module, CausalSelfAttention):
            module.use_flash = attn == "flash"


@torch.no_grad()
def generate(model, idx, max_new_tokens, block_size, vocab_size, temperature=0.8, top_k=40, seed=0):
    """Sample max_new_tokens after idx from the tokenizer's vocab_size classes (never a padding class), in eval
    mode (no dropout). The sampling generator is seeded, so every rank of a sharded model draws the same tokens
    and runs the same forward passes."""
    generator = torch.Generator(device=idx.device).manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            logits = model(idx[:, -block_size:])[:, -1, :vocab_size].float() / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, -float("inf"))
            next_token = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, next_token], dim=1)
    finally:
        model.train(was_training)
    return idx


def flops_per_token(config, num_params):
    """6N + 12·L·H·Q·T (PaLM, appendix B): 6N for the matmuls of forward and backward with N the parameters
    without position embeddings (the tied embedding counts once, as the LM head's matmul), and 12·L·H·Q·T
    for attention scores and values, with H heads of size Q over a context of T tokens."""
    c = config
    return 6 * num_params + 12 * c.n_layer * c.n_head * c.head_dim * c.block_size
