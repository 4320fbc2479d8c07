"""
The model, and only the model: GPT-2 and Llama 3 as one family, config presets, the modules, weight init by
parameter name, the FLOPs count, and sampling. Reads like nanoGPT's model.py. No torch.distributed code here: the
strategies (train_*.py) are applied from outside and it runs unchanged under them; what every training script needs
that is not the model lives in training.py, pretrained weights in the Hugging Face format in hugging_face.py.

Llama 3 is GPT-2 with these changes, each a config field: RMSNorm for LayerNorm, rotary position angles (RoPE) in
attention for the learned position table, a SwiGLU MLP (a third matrix, the gate), grouped-query attention (fewer
key/value heads than query heads), no biases, an LM head that may be its own matrix; GPT-2's module names stay.

Top to bottom: the config and presets; norms, rotary angles, attention, MLP, block, GPT; the loss over the real
vocabulary; each parameter's initial value by name; the attention kernel; generate; the FLOPs per token behind MFU.
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
    # Llama 3's changes; the defaults are GPT-2's
    n_kv_head: int = None  # key/value heads, each shared by n_head / n_kv_head query heads (None: n_head, GPT-2)
    mlp_hidden: int = None  # the MLP's hidden width (None: GPT-2's 4 x n_embd)
    swiglu: bool = False  # SiLU(gate(x)) * fc(x) (Llama) instead of GELU(fc(x)) (GPT-2)
    rms_norm: bool = False  # RMSNorm (no mean subtracted, no bias) instead of LayerNorm
    norm_eps: float = 1e-5
    rope_theta: float = None  # rotary position angles' base (Llama 3: 500,000); None: GPT-2's learned table wpe
    rope_scaling: tuple = None  # Llama 3.1's: (factor, low_freq_factor, high_freq_factor, original context)
    tie_embeddings: bool = True  # the LM head is wte (GPT-2, Llama 3.2 1B, 3B), else a [vocab, n_embd] of its own
    # Mixture of experts (Mixtral): each token runs n_expert_per_token of n_expert MLPs, each of width mlp_hidden
    n_expert: int = 0  # 0: one dense MLP a block
    n_expert_per_token: int = 2
    balance_rate: float = 1e-3  # DeepSeek-V3's bias update speed (its gamma): see MoE

    def __post_init__(self):
        self.n_kv_head = self.n_kv_head or self.n_head
        self.mlp_hidden = self.mlp_hidden or 4 * self.n_embd

    @property
    def padded_vocab_size(self):
        # A multiple of 128 keeps the LM head's matmul on fast kernels and divisible by any sensible --tp.
        return -(-self.vocab_size // 128) * 128

    @property
    def head_dim(self):
        return self.n_embd // self.n_head


# Llama 3 (Grattafiori et al. 2024, table 3; Hugging Face's config.json of each; vocabulary 128,256). RoPE scaling
# (factor, low frequency factor, high, original context): 3.1's stretches 8 times, 3.2's 32; 3.2 1B and 3B are tied.
LLAMA3 = dict(bias=False, swiglu=True, rms_norm=True, rope_theta=500000.0, n_kv_head=8)
LLAMA31 = dict(LLAMA3, rope_scaling=(8.0, 1.0, 4.0, 8192), tie_embeddings=False)
LLAMA32 = dict(LLAMA3, rope_scaling=(32.0, 1.0, 4.0, 8192))
# Mixtral (Jiang et al. 2024; Hugging Face's config.json): Llama's blocks, each MLP 8 experts of which a token runs 2
MIXTRAL = dict(LLAMA3, rope_theta=1e6, tie_embeddings=False, n_expert=8, n_expert_per_token=2)

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
    "llama-tiny": dict(LLAMA31, n_layer=4, n_head=4, n_kv_head=2, n_embd=128, mlp_hidden=384),  # 0.85M, bytes
    "llama3.2-1b": dict(LLAMA32, n_layer=16, n_head=32, n_embd=2048, mlp_hidden=8192),  # 1.24B
    "llama3.2-3b": dict(LLAMA32, n_layer=28, n_head=24, n_embd=3072, mlp_hidden=8192),  # 3.21B
    "llama3.1-8b": dict(LLAMA31, n_layer=32, n_head=32, n_embd=4096, mlp_hidden=14336),  # 8.03B
    "llama3.1-70b": dict(LLAMA31, n_layer=80, n_head=64, n_embd=8192, mlp_hidden=28672),  # 70.6B
    "llama3.1-405b": dict(LLAMA31, n_layer=126, n_head=128, n_embd=16384, mlp_hidden=53248),  # 405.9B
    "moe-tiny": dict(MIXTRAL, n_layer=4, n_head=4, n_kv_head=2, n_embd=128, mlp_hidden=128),  # 1.84M, 0.63M active
    "mixtral-8x7b": dict(MIXTRAL, n_layer=32, n_head=32, n_embd=4096, mlp_hidden=14336),  # 46.7B, 12.9B active
    "mixtral-8x22b": dict(MIXTRAL, n_layer=56, n_head=48, n_embd=6144, mlp_hidden=16384),  # 140.6B, 39.2B active
}


def make_config(preset, vocab_size, block_size, dropout=0.0):
    if preset not in PRESETS:
        raise ValueError(f"unknown --model {preset!r}: choose one of {', '.join(PRESETS)}")
    config = GPTConfig(vocab_size=vocab_size, block_size=block_size, dropout=dropout, **PRESETS[preset])
    check_config(config)
    return config


def check_config(config):
    if config.n_embd % config.n_head:
        raise ValueError(f"n_embd {config.n_embd} is not divisible by n_head {config.n_head}")
    if config.n_head % config.n_kv_head:
        raise ValueError(f"n_head {config.n_head} is not divisible by n_kv_head {config.n_kv_head}")
    if config.n_expert and not 0 < config.n_expert_per_token <= config.n_expert:
        raise ValueError(f"n_expert_per_token {config.n_expert_per_token} is not in 1 .. n_expert {config.n_expert}")


def norm(config):
    """GPT-2's LayerNorm or Llama's RMSNorm, which scales each token to unit root mean square without subtracting
    the mean: a gain per channel either way, named weight."""
    if config.rms_norm:
        return nn.RMSNorm(config.n_embd, eps=config.norm_eps)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)


def rotary_angles(config, pos):
    """(cos, sin) of the rotary angles of the tokens at positions pos, [T, 1, head_dim] each (both halves of a head
    alike), or None for GPT-2's learned positions. Channel pair i turns by pos * theta^(-2i / head_dim) (RoFormer).
    Llama 3.1 slows the pairs of wavelength beyond original / low_freq_factor by `factor`, keeps those under
    original / high_freq_factor, and blends in between. Computed from pos on every call: a model built on meta has no
    buffer to forget, and a rank holding other positions (a pipeline stage, a sequence chunk) passes its own."""
    if config.rope_theta is None:
        return None
    frequency = 1.0 / config.rope_theta ** (torch.arange(0, config.head_dim, 2, device=pos.device) / config.head_dim)
    if config.rope_scaling:
        factor, low, high, original = config.rope_scaling
        wavelength = 2 * math.pi / frequency
        kept = ((original / wavelength - low) / (high - low)).clamp(0, 1)  # 0: slowed by factor, 1: kept
        frequency = (1 - kept) * frequency / factor + kept * frequency
    angles = pos.float()[:, None, None] * torch.cat([frequency, frequency])
    return angles.cos(), angles.sin()


def rotate(x, rope):
    """Hugging Face's RoPE layout: channel i of each head pairs with channel i + head_dim / 2 (its rotate_half). x * cos
    comes first, so the result keeps x's memory layout."""
    cos, sin = rope
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat([-x2, x1], dim=-1) * sin).type_as(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        # Separate q, k and v projections: tensor parallelism splits each by output rows, and rows
        # [h * head_dim, (h + 1) * head_dim) are exactly head h, so a rank's slice is its own heads. A fused
        # qkv weight would interleave q, k and v in one row range and need a reshuffle before sharding.
        # Grouped-query attention: key and value have n_kv_head heads, each read by n_head / n_kv_head query heads.
        kv_width = config.n_kv_head * config.head_dim
        self.query = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.key = nn.Linear(config.n_embd, kv_width, bias=config.bias)
        self.value = nn.Linear(config.n_embd, kv_width, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.head_dim = config.head_dim
        self.attn_dropout = nn.Dropout(config.dropout)  # a module, so tensor parallelism can swap in its own
        self.resid_dropout = nn.Dropout(config.dropout)
        self.use_flash = False  # set by set_attention()

    def forward(self, x, rope=None):
        # Heads are inferred (-1) from the projections' outputs, not x: under tensor parallelism they hold only this
        # rank's heads, and under sequence parallelism x holds only a slice of the sequence.
        q, k, v = (linear(x).unflatten(-1, (-1, self.head_dim)) for linear in (self.query, self.key, self.value))
        if rope is not None:  # Llama: positions enter as rotations of q and k, so scores depend on distance only
            q, k = rotate(q, rope), rotate(k, rope)
        return self.resid_dropout(self.proj(self.attend(q, k, v).flatten(2)))

    def attend(self, q, k, v):
        """Causal attention of q [B, T, n_head, head_dim] to k and v [B, T, n_kv_head, head_dim] -> [B, T, n_head,
        head_dim]. A method of its own so that a strategy can replace it (train_cp.py's attention over other ranks'
        keys and values)."""
        dropout = self.training and self.attn_dropout.p > 0
        if self.use_flash and not dropout:  # flash-attn shares each key/value head among its query heads itself
            return flash_attn_func(q, k, v, causal=True)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if dropout:
            # nanoGPT's explicit attention: attn_dropout, a module a strategy can replace, sees the [B, heads, T, T]
            # probabilities, which backward keeps (the fused kernels below would draw their masks inside)
            T = q.shape[2]
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))  # each KV head's queries
            causal = torch.full((T, T), -math.inf, device=q.device).triu(1)  # no position sees a later one
            att = F.softmax(q @ k.transpose(-2, -1) * self.head_dim**-0.5 + causal, dim=-1)
            y = self.attn_dropout(att) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        return y.transpose(1, 2)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        # SwiGLU (Llama): a third matrix, gate, whose SiLU scales fc's output ("up") element by element
        self.gate = nn.Linear(config.n_embd, config.mlp_hidden, bias=config.bias) if config.swiglu else None
        self.fc = nn.Linear(config.n_embd, config.mlp_hidden, bias=config.bias)
        self.proj = nn.Linear(config.mlp_hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        hidden = F.gelu(self.fc(x), approximate="tanh") if self.gate is None else F.silu(self.gate(x)) * self.fc(x)
        return self.dropout(self.proj(hidden))


class MoE(nn.Module):
    """Mixtral's sparse MLP: a router scores the n_expert MLPs for each token, the token runs its top
    n_expert_per_token, and their outputs add up weighted by the router's softmax renormalised over those chosen.
    Dropless: an expert takes every token routed to it (no capacity), so no layout changes what a token computes.
    Balanced as DeepSeek-V3 (Liu et al. 2024, 2.1.2) balances, without an auxiliary loss: a bias per expert, added to
    the scores only to choose, moves after each step toward the mean load over the global batch (training.py sums
    tokens_per_expert over the ranks). A loss term would need the global loads inside the forward pass; the bias
    needs them between steps, where every layout already agrees on the step."""

    def __init__(self, config, layer):
        super().__init__()
        self.router = nn.Linear(config.n_embd, config.n_expert, bias=False)
        self.experts = nn.ModuleList(MLP(config) for _ in range(config.n_expert))
        self.top_k, self.balance_rate = config.n_expert_per_token, config.balance_rate
        self.layer, self.n_layer = layer, config.n_layer  # where this layer's loads go in training.py's sum
        self.register_buffer("expert_bias", torch.zeros(config.n_expert))
        self.register_buffer("tokens_per_expert", torch.zeros(config.n_expert))  # zero at every step's end

    def forward(self, x):
        tokens = x.flatten(0, 1)
        scores = F.softmax(self.router(tokens), dim=-1, dtype=torch.float32)
        chosen = torch.topk(scores + self.expert_bias, self.top_k).indices  # [tokens, top_k] expert indices
        weights = scores.gather(1, chosen)
        weights = weights / weights.sum(dim=1, keepdim=True)
        if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:  # training; not a recompute in backward
            self.tokens_per_expert += torch.bincount(chosen.flatten(), minlength=len(self.expert_bias))
        return self.run_experts(tokens, chosen, weights.type_as(x)).view_as(x)

    def run_experts(self, tokens, chosen, weights):
        """Each token's chosen experts' outputs, weighted and summed: one expert at a time over the tokens routed to
        it (an expert that got none still runs, on none, so every expert has a gradient). A method of its own so that
        expert parallelism (train_ep.py) can replace it with one that sends tokens to the experts' ranks."""
        y = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            y = y.index_add(0, token, expert(tokens[token]) * weights[token, slot, None])
        return y

    @torch.no_grad()
    def balance(self, load):
        """After a step, load: its tokens per expert over the global batch. An expert above the mean load is made
        less likely to be chosen, one below it more (only the sign counts, so a load counted twice moves it alike)."""
        self.expert_bias += self.balance_rate * torch.sign(load.mean() - load)
        self.tokens_per_expert.zero_()


class Block(nn.Module):
    def __init__(self, config, layer):
        super().__init__()
        self.ln_1 = norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = norm(config)
        self.mlp = MoE(config, layer) if config.n_expert else MLP(config)

    def forward(self, x, rope=None):
        x = x + self.attn(self.ln_1(x), rope)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.padded_vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd) if config.rope_theta is None else None
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, layer) for layer in range(config.n_layer))
        self.ln_f = norm(config)
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        self.tie_weights()
        # An attribute, not a call inside forward, so tensor parallelism can swap in its vocab-parallel loss.
        self.loss_fn = partial(cross_entropy, vocab_size=config.vocab_size)

    def forward(self, idx, targets=None, pos=None):
        """pos: the tokens' positions (default 0 .. T - 1); a rank that holds chunks of a longer sequence passes
        theirs, and the learned table or the rotary angles follow them."""
        pos = torch.arange(idx.shape[1], device=idx.device) if pos is None else pos
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(pos)
        x = self.drop(x)
        rope = rotary_angles(self.config, pos)  # once for every block
        for block in self.blocks:
            x = block(x, rope)
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
        self.tie_weights()  # to_empty() gives each module its own tensor
        value = value or partial(initial_value, config=self.config, seed=seed)
        for name, param in self.named_parameters():
            param.copy_(value(name, param.shape))
        for buffer in self.buffers():  # the experts' balancing biases and loads
            buffer.zero_()

    def tie_weights(self):
        """A tied LM head is wte itself: named_parameters() lists it once, as wte.weight."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    def num_params(self, with_embeddings=True):
        """Every parameter, or only those a token is multiplied by: no wpe, no wte where the LM head is a matrix of
        its own (a token only looks wte up), and of a mixture's experts only the n_expert_per_token it runs."""
        n = sum(p.numel() for p in self.parameters())
        if with_embeddings:
            return n
        looked_up = [self.wpe] + [self.wte] * (not self.config.tie_embeddings)
        idle = sum(p.numel() for name, p in self.named_parameters() if ".experts." in name)
        idle *= 1 - self.config.n_expert_per_token / max(self.config.n_expert, 1)
        return n - sum(module.weight.numel() for module in looked_up if module is not None) - int(idle)


def cross_entropy(logits, targets, vocab_size):
    """GPT-2's loss: a softmax over the tokenizer's vocabulary only. The classes that pad the embedding up to
    padded_vocab_size are no tokens: they take neither probability nor gradient."""
    return F.cross_entropy(logits[:, :vocab_size], targets)


INIT_TILE = (32, 512)  # rows x columns drawn from one generator, seeded by (seed, name, tile): see initial_value


def initial_value(name, shape, config, seed, box=None):
    """The float32 CPU tensor parameter `name` starts with, or its box (default: the whole tensor): a function of
    (seed, name) alone, drawn tile by tile, so a rank that builds one block, one shard or one slice draws only the
    tiles it touches and takes exactly what one device would have there."""
    box = tuple((0, n) for n in shape) if box is None else tuple(box)
    if name.endswith("bias") or ".ln_" in name or name.startswith("ln_"):
        return torch.full([stop - start for start, stop in box], float(not name.endswith("bias")))
    # GPT-2: residual projections scaled by 1/sqrt(2 n_layer)
    std = 0.02 / math.sqrt(2 * config.n_layer) if name.endswith("proj.weight") else 0.02
    (top, bottom), (left, right) = box  # every drawn parameter is a matrix
    first_row, first_column = top - top % INIT_TILE[0], left - left % INIT_TILE[1]
    rows = []
    for row in range(first_row, bottom, INIT_TILE[0]):
        tiles = []
        for column in range(first_column, right, INIT_TILE[1]):
            digest = hashlib.sha256(f"{seed}/{name}/{row}/{column}".encode()).digest()
            generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
            size = (min(INIT_TILE[0], shape[0] - row), min(INIT_TILE[1], shape[1] - column))
            tiles.append(torch.randn(size, generator=generator))
        rows.append(torch.cat(tiles, dim=1))
    return torch.cat(rows)[top - first_row:bottom - first_row, left - first_column:right - first_column] * std


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
    """6N + 12·L·H·Q·T (PaLM, appendix B): 6N for the matmuls of forward and backward, N = num_params(
    with_embeddings=False): the weights a token is multiplied by, SwiGLU's three matrices and grouped-query
    attention's smaller key and value among them, the LM head once (tied, it is wte), no position table; and
    12·L·H·Q·T for attention scores and values over the H query heads of size Q (each computes its own, whatever
    key/value head it shares) and a context of T tokens."""
    return 6 * num_params + 12 * config.n_layer * config.n_head * config.head_dim * config.block_size
