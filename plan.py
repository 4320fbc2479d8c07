"""
The memory planner (--plan): the bytes one rank holds, item by item, from the config and the layout alone. The model
is built on meta (no memory, seconds for 175B); test_parallel.py holds the plan to what real runs hold: parameters,
gradients and AdamW state to the byte, the tensors autograd saves for backward within 10%. Imported only where it is
used: a script's --plan, bench.py and figures.py.
"""

import os
import re
from dataclasses import asdict
from typing import NamedTuple

import torch

import gpt
import prepare_data
import training


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
        vocab_size = prepare_data.load_meta(args.data)["vocab_size"]
    else:
        vocab_size = 256 if args.data == training.DEFAULT_DATA_DIR else 50257
    preset = args.model or (args.init_from if args.init_from in gpt.PRESETS else "tiny")
    return gpt.make_config(preset, vocab_size, args.block_size, args.dropout), preset


def print_plan(args, world_size, dp_size):
    """--plan: print what one rank of this layout needs, item by item, and whether it fits in --gpu_memory."""
    config, preset = plan_config(args)
    if args.micro_batch is None and args.global_batch % dp_size:
        raise training.UsageError(f"--global_batch {args.global_batch} does not split over {dp_size} data-parallel ranks: "
                         f"choose a multiple of {dp_size}")
    layout = layout_of(args, world_size, dp_size, args.micro_batch or args.global_batch // dp_size,
                       "cpu" if args.device == "cpu" else "cuda")
    if layout.tp > 1:
        training.check_tensor_parallel(config, layout.tp, layout.sequence_parallel)
    rows = plan_memory(config, layout)
    total = sum(size for _, size in rows)
    num_params = sum(param.numel() for _, param in parameters_on_meta(config))
    size = f"{num_params / 1e9:,.1f}B" if num_params >= 1e9 else f"{num_params / 1e6:,.1f}M"
    say = print if training.launched_rank()[0] == 0 else lambda text: None  # under torchrun, once
    say(f"plan: {preset} ({size} parameters, vocabulary {config.vocab_size:,}) | {layout.strategy}"
        f" on {world_size} rank{'s' * (world_size > 1)} (dp {layout.dp} x tp {layout.tp}) | micro batch "
        f"{layout.micro_batch} x {config.block_size} tokens | {layout.dtype}"
        + " | activation checkpointing" * layout.activation_checkpointing
        + " | sequence parallel" * layout.sequence_parallel)
    for item, size in rows + [("total, one rank", total)]:
        say(f"  {item:66} {format_bytes(size):>11}")
    say(plan_verdict(total, args.gpu_memory, layout, rows))
    return rows
