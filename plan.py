"""
The memory planner (--plan), the collective formulas and what fits where: what one rank of a layout holds, item by
item, and what it sends through collectives each step, from the config and the layout alone. The model is built
on meta (no memory, seconds for 175B). test_parallel.py holds both to real runs: parameters, gradients and AdamW
state to the byte, the tensors autograd saves for backward within 10%, the bytes each step sends within 1%.
Imported only where it is used: a script's --plan, bench.py and figures.py.

What a strategy builds is read from the strategy's own code, which the caller passes in (this file stands below the
training scripts and imports none of them): sliced=train_tp.is_sliced (what tensor parallelism splits),
units=train_fsdp.flat_parameter_groups (FSDP's units and FlatParameters), buckets=train_ddp.assign_buckets (DDP's
gradient buckets, which ZeRO cuts into slices).

A mixture of experts (gpt.MoE) is planned under every strategy: its experts are the model's parameters, whole where
the strategy does not split them; expert parallelism ("ep") keeps n_expert / ep of each layer's experts on a rank.
"""

import os
import itertools
from dataclasses import asdict, replace
from functools import partial
from typing import NamedTuple

import torch

import gpt
import prepare_data
import training


class Layout(NamedTuple):
    strategy: str  # single, ddp, zero, fsdp, tp, 2d, pp, cp, 4d, ep
    world_size: int
    dp: int  # data-parallel degree: FSDP's shard count in 2d, and in fsdp times `replicate`
    tp: int  # tensor-parallel degree
    micro_batch: int  # sequences per rank per micro-step
    dtype: str = "float32"  # compute dtype: bfloat16 is autocast (single, ddp, tp) or FSDP's gathered dtype
    sequence_parallel: bool = False
    loss_parallel: bool = True
    activation_checkpointing: bool = False
    reshard: bool = True  # FSDP frees each block's gathered weights after its forward (--no_reshard: keeps them)
    device: str = "cuda"  # where it runs: autocast's rules differ a little between CUDA and CPU
    pp: int = 1  # pipeline stages (pp: the ranks are pp x dp)
    schedule: str = "1f1b"  # pp: the order of the micro-batches' forwards and backwards
    micro_batches: int = 1  # pp: micro-batches an optimizer step (the accumulation), all in the pipeline at once
    stage: int = 1  # zero: 1 shards AdamW's moments, 2 the averaged gradient too
    replicate: int = 1  # fsdp: HSDP's copies of the shard groups (each of dp / replicate ranks)
    bucket_mb: float = 25  # ddp and zero: the largest gradient bucket, in MiB
    cp: int = 1  # cp: context-parallel ranks, each holding s / cp tokens of every sequence (the ranks are cp x dp)
    cp_impl: str = "allgather"  # cp: how attention reaches the other ranks' keys and values (allgather, ring)
    cpu_offload: bool = False  # fsdp and 2d: shards, their gradients and AdamW in host memory, stepped there
    dp_impl: str = "fsdp"  # 4d: the data axis' strategy, fsdp (sharded over dp x cp) or ddp (replicated)
    ep: int = 1  # ep: expert-parallel ranks, n_expert / ep experts of each layer a rank (dp: every rank's own rows)
    expert_load: float = 1  # ep: the rows this rank's experts receive over their mean (1: a balanced router)

    @property
    def bytes(self):  # an element of the compute dtype
        return 2 if self.dtype == "bfloat16" else 4


def layout_of(args, world_size, dp_size, micro_batch, device):
    """The Layout a script's flags describe on world_size ranks, dp_size of them data-parallel, on device (a type)."""
    pp = getattr(args, "pp", 1)
    cp = world_size // dp_size if args.strategy == "cp" else getattr(args, "cp", 1)
    ep = (getattr(args, "ep", None) or world_size // (getattr(args, "dp", None) or 1)) if args.strategy == "ep" else 1
    return Layout(args.strategy, world_size, dp_size, world_size // (dp_size * pp * cp), micro_batch, args.dtype,
                  getattr(args, "sequence_parallel", False), not getattr(args, "no_loss_parallel", False),
                  args.activation_checkpointing, not getattr(args, "no_reshard", False), device, pp,
                  getattr(args, "schedule", "1f1b"), args.global_batch // (micro_batch * dp_size),
                  getattr(args, "stage", 1), getattr(args, "replicate", 1), getattr(args, "bucket_mb", 25), cp,
                  getattr(args, "cp_impl", "allgather"), getattr(args, "cpu_offload", False),
                  getattr(args, "dp_impl", "fsdp"), ep)


# ------------------------------------------------------------------------------------------------------------
# What the strategies build, counted on meta with their own functions

_models_on_meta = {}


def model_on_meta(config):
    """gpt.GPT(config), built on meta once per config: a plan reads only the shapes of its parameters."""
    key = tuple(asdict(config).items())
    if key not in _models_on_meta:
        with torch.device("meta"):
            _models_on_meta[key] = gpt.GPT(config)
    return _models_on_meta[key]


def local_sizes(config, tp=1, sliced=None, ep=1):
    """{name: elements one rank holds}: 1/tp of each parameter that sliced(name) says TP splits; of the experts, under
    expert parallelism, the first n_expert / ep of each layer (expert-parallel rank 0's: every rank holds as many)."""
    if tp > 1 and sliced is None:
        raise ValueError("a tensor-parallel layout needs the strategy's own rule: pass sliced=train_tp.is_sliced")
    sizes = {}
    for name, param in model_on_meta(config).named_parameters():
        if is_expert(name) and int(name.split(".")[4]) >= config.n_expert // ep:  # blocks.L.mlp.experts.E.fc.weight
            continue
        sizes[name] = param.numel() // tp if tp > 1 and sliced(name) else param.numel()
    return sizes


def is_expert(name):
    return ".experts." in name


def flat_sizes(config, tp=1, sliced=None, units=None):
    """[([(elements, whether it is gathered in the compute dtype) of each FlatParameter], whether it stays gathered
    from forward to backward) for each FSDP unit, in the order their forwards run]: units(model) groups the parameters
    as FSDP does; each FlatParameter holds this tensor-parallel rank's part of its group, before padding. As
    train_fsdp.FullyShardedDataParallel does: the matrices of every unit but the first (the embeddings') are gathered
    in the compute dtype, the rest in float32; kept, the last unit, whose backward comes next, and one holding a tied
    weight (a parameter with two uses)."""
    if units is None:
        raise ValueError("an FSDP layout needs the strategy's own units: pass units=train_fsdp.flat_parameter_groups")
    sizes, groups = local_sizes(config, tp, sliced), units(model_on_meta(config))
    return [([(sum(sizes[name] for name, _, _ in group), index > 0 and decay) for (_, decay), group in kinds.items()],
             index == len(groups) - 1 or any(len(uses) > 1 for group in kinds.values() for _, _, uses in group))
            for index, kinds in enumerate(groups)]


# ------------------------------------------------------------------------------------------------------------
# Memory: what one rank holds at its peak


def parameter_plan(config, layout, sliced=None, units=None):
    """(elements of parameters this rank keeps, tensors its optimizer steps, [(elements of each gathered unit, its
    bytes, whether it stays gathered from forward to backward)] (FSDP), elements autocast copies to bfloat16 (the
    matmuls' weights and biases))."""
    sizes = local_sizes(config, layout.tp, sliced, layout.ep)
    cast = sum(n for name, n in sizes.items() if is_matmul_weight(name, config))
    if layout.strategy not in ("fsdp", "2d"):
        return sum(sizes.values()), len(sizes), [], cast
    ranks = layout.dp // layout.replicate  # the ranks one flat parameter is sharded over
    e = layout.bytes
    shards = [([(-(-n // ranks), cast) for n, cast in unit], kept)
              for unit, kept in flat_sizes(config, layout.tp, sliced, units)]
    gathered = [(sum(n for n, _ in unit) * ranks, sum(n * (e if cast else 4) for n, cast in unit) * ranks, kept)
                for unit, kept in shards]  # each shard padded to the same length
    return sum(n for unit, _ in shards for n, _ in unit), sum(len(unit) for unit, _ in shards), gathered, 0


def zero_buckets(config, layout, buckets):
    """ZeRO's buckets (buckets=train_ddp.assign_buckets), each padded to a multiple of N elements and cut into N
    slices: ([padded elements of each bucket], [(elements of parameters, pieces) in each rank's slices])."""
    if buckets is None:
        raise ValueError("a ZeRO layout needs the strategy's own buckets: pass buckets=train_ddp.assign_buckets")
    n, padded, ranks = layout.dp, [], [[0, 0] for _ in range(layout.dp)]
    for bucket in buckets(list(model_on_meta(config).named_parameters()), layout.bucket_mb):
        sizes = [param.numel() for _, param in bucket]
        padded.append(-(-sum(sizes) // n) * n)
        starts = list(itertools.accumulate([0] + sizes))
        for rank, held in enumerate(ranks):
            low, high = rank * padded[-1] // n, (rank + 1) * padded[-1] // n
            overlaps = [min(start + size, high) - max(start, low) for start, size in zip(starts, sizes)]
            held[0] += sum(overlap for overlap in overlaps if overlap > 0)
            held[1] += sum(overlap > 0 for overlap in overlaps)
    return padded, ranks


def zero_states(config, layout, buckets):
    """[(item, bytes)] of ZeRO's model states on the rank that holds the most: the weights in flat padded buckets;
    the gradient buckets whole (stage 1) or this rank's slices of them (stage 2); AdamW on this rank's slices."""
    padded, ranks = zero_buckets(config, layout, buckets)
    rows = [("parameters (float32, in padded buckets)", 4 * sum(padded)),
            ("gradients (float32" + (", whole padded buckets)" if layout.stage == 1 else ", this rank's slices)"),
             4 * sum(padded) // (1 if layout.stage == 1 else layout.dp)),
            ("AdamW state (exp_avg, exp_avg_sq, step; float32) of its slices",
             max(8 * elements + 4 * pieces for elements, pieces in ranks))]
    if layout.stage == 2:  # a bucket lives from its first gradient to its reduce-scatter's end; the next one fills
        rows.append(("two whole gradient buckets: one reduce-scattering, one filling", 4 * sum(sorted(padded)[-2:])))
    return rows


def is_matmul_weight(name, config):
    """Whether autocast copies parameter `name` to bfloat16 for a matmul: not a norm's gain, not a table a token only
    looks up (wpe; wte unless it is also the tied LM head)."""
    looked_up = name.startswith("wpe") or (name.startswith("wte") and not config.tie_embeddings)
    return not (".ln_" in name or name.startswith("ln_f") or looked_up)


def activation_plan(config, layout):
    """Bytes autograd saves for backward during one micro-batch's forward, as {item: bytes}; and the bytes one
    block's recompute and backward hold for a moment under --activation_checkpointing. Float32 is exact (measured on
    CPU, test_parallel.py). bfloat16 follows autocast's rules: each matmul saves its own bfloat16 copy of its
    input; the residual stream and the layer norms stay float32 in every layout (the embeddings and norm gains are;
    FSDP gathers them in float32). Dropout masks count as CUDA keeps them, one byte an element. Llama: RMSNorm saves
    its input and 1/rms, and on CPU, where it runs as elementwise ops, its normalised output too; q and k are saved
    rotated; grouped-query attention saves narrower k and v; SwiGLU saves 4 tensors of the MLP's width where GELU
    saves 2; a mixture of experts, moe_activations."""
    b, s, h, L = layout.micro_batch, config.block_size, config.n_embd, config.n_layer
    t, e = layout.tp, layout.bytes
    kv, ffn = config.n_kv_head * config.head_dim, config.mlp_hidden  # key/value width, the MLP's width
    shard = t if layout.sequence_parallel else 1  # the residual stream is split over the sequence under SP
    residual = b * (s // shard) * h * 4  # a block's input
    if config.rms_norm:  # input (and on CPU the normalised output), 1/rms
        norm = ((1 + (layout.device == "cpu")) * b * (s // shard) * h + b * (s // shard))
    else:  # input, mean, 1/std
        norm = b * (s // shard) * h + 2 * b * (s // shard)
    norm *= 4
    linears = 5 if config.swiglu and not config.n_expert else 4  # the column-parallel linears: q, k, v, (gate,)
    # fc; or a mixture's router
    cast_before = e == 2 and layout.strategy in ("tp", "2d")  # TP's f casts the norms' outputs once for its linears
    saved_kv = h if config.dropout else kv  # gpt.py's explicit attention keeps k and v repeated for every query head
    block = (2 * norm  # the two layer norms
             + (4 if cast_before else 8 if e == 4 else 2 * linears) * b * s * h  # the column-parallel linears'
             # inputs, whole sequence (SP gathers it): in float32 q, k and v share one, (gate and) fc another
             # (2 x 4 bytes), in bfloat16 each linear casts its own (2 bytes each), unless TP's f cast them
             # (2 x 2 bytes)
             + (2 * h + 2 * saved_kv) * b * s // t * e  # q, k, v and the attention output, this rank's heads
             + (b * (config.n_head // t) * s * s * (5 + e) if config.dropout  # gpt.py's explicit attention: the
                # float32 probabilities, their dropout mask, and the dropped ones as the next matmul reads them
                else b * (config.n_head // t) * s * 4)  # else attention's log-sum-exp per query head and token
             + (moe_activations(config, layout) if config.n_expert  # or GELU's input and output; or gate's
                else (4 if config.swiglu else 2) * b * s * ffn // t * e)  # output, its SiLU, fc's and their product
             + (2 * b * (s // shard) * h if config.dropout else 0))  # the two residual dropouts' masks
    vocab_parallel = layout.tp > 1 and layout.loss_parallel  # a softmax over this rank's padded slice, and a mask
    vocab = config.padded_vocab_size // t if vocab_parallel else config.vocab_size
    positions = s * 8 if config.rope_theta is None else 2 * s * config.head_dim * 4  # wpe's ids; cos and sin
    embeddings = (b * s * 8 + positions + (b * s if t > 1 else 0)  # the ids, the positions, TP's mask
                  + (b * (s // shard) * h if config.dropout else 0))  # the embedding dropout's mask
    final = norm + b * s * h * e  # the final norm, the LM head's whole input
    items = {"activations of the blocks": L * (residual if layout.activation_checkpointing else block)}
    if layout.pp > 1:  # on the first and on the last stage
        items.update({"embeddings": embeddings, "final layer norm": final})
    else:
        items["embeddings and final layer norm"] = embeddings + final
    items["loss (softmax of the logits)"] = b * s * vocab * 4 + b * s * (9 if vocab_parallel else 8)
    return items, (block if layout.activation_checkpointing else 0)


def moe_activations(config, layout):
    """Bytes one mixture-of-experts layer saves for backward (measured on CPU, gpt.MoE's and train_ep.py's, float32
    and bfloat16, to the byte): for its b·s tokens the router's float32 probabilities and their sum; for each of the
    b·s·k (token, chosen expert) rows, its weight and indices, the expert's output, and that output weighted (float32);
    for each row the experts run, its input (in bfloat16 gate and fc cast their own, but expert parallelism's rows
    arrive cast), the MLP's hidden tensors (as MLP), under expert parallelism its indices to the experts' order and
    back. Dropless, the rows are always b·s·k; a rank's experts run as many on average (layout.expert_load: over
    that), whatever the router chose."""
    tokens, h, e, ep = layout.micro_batch * config.block_size, config.n_embd, layout.bytes, layout.strategy == "ep"
    rows = tokens * config.n_expert_per_token
    copies = 2 if e == 2 and config.swiglu and not ep else 1
    expert = e * (copies * h + (4 if config.swiglu else 2) * config.mlp_hidden) + 16 * ep
    return 4 * tokens * (config.n_expert + 1) + rows * (4 * h + e * h + 32) + int(rows * layout.expert_load) * expert


def model_states(params, tensors, whose=""):
    """[(item, bytes)] of `params` float32 elements in `tensors` tensors, their gradients and AdamW's state."""
    return [(whose + "parameters (float32)", 4 * params),
            ("gradients (float32)", 4 * params),
            ("AdamW state (exp_avg, exp_avg_sq, step; float32)", 8 * params + 4 * tensors)]


def host_plan(config, layout, units=None, sliced=None):
    """[(item, bytes)] one rank keeps in host memory under --cpu_offload: its FSDP shards and their gradients, pinned
    (one arena each, registered with the driver: the copies to and from the device need not wait, and nothing is
    rounded up), and AdamW's state, which steps there, pageable (AdamW allocates it)."""
    params, tensors, _, _ = parameter_plan(config, layout, sliced, units)
    return model_states(params, tensors)


def save_staging(config, layout, sliced=None, units=None, layers=None):
    """Host bytes one rank stages while it saves a checkpoint, at most: torch.save copies a device storage to the host
    one at a time, and each piece a rank writes (a parameter's part, each moment's over it) is a storage of its own
    (checkpoint.piece), so the largest one on the device; host tensors (--cpu_offload's shards and moments) are
    written where they lie, without a copy. 4d: a stage's TP slices, each rank its spans of the flats' shards over
    the dp x cp ranks (--dp_impl ddp: whole; layers: train_pp.stage_layers)."""
    fsdp = layout.strategy in ("fsdp", "2d")
    if fsdp and layout.cpu_offload:
        return 0
    sizes = local_sizes(config, layout.tp, sliced, layout.ep)
    if layout.strategy == "4d":
        return 4 * max(n for stage in range(layout.pp) for rank in range(layout.dp * layout.cp)
                       for n in four_d_spans(config, layout, stage, layers, sliced, rank).values())
    if not fsdp:  # whole parameters (TP: this rank's slices), written by the lowest rank holding each
        return 4 * max(sizes.values())
    ranks = layout.dp // layout.replicate  # a parameter's part is what of it lies in this rank's shard of its unit
    if units is None:
        raise ValueError("an FSDP layout needs the strategy's own units: pass units=train_fsdp.flat_parameter_groups")
    groups = [group for kinds in units(model_on_meta(config)) for group in kinds.values()]
    return 4 * max(min(sizes[name], -(-sum(sizes[other] for other, _, _ in group) // ranks))
                   for group in groups for name, _, _ in group)


def plan_memory(config, layout, sliced=None, units=None, buckets=None):
    """[(item, bytes)] one rank holds at its peak in this layout: what lives all run, one micro-batch's saved
    activations, and what exists at once during a step (gathered units, logits and their gradient). sliced, units and
    buckets: the strategies' own functions, for layouts with tensor parallelism, FSDP and ZeRO. Context parallelism
    holds the activations of s / cp tokens (context_parallel_plan)."""
    if layout.cp > 1:
        return context_parallel_plan(config, layout)
    params, tensors, gathered, cast = parameter_plan(config, layout, sliced, units)
    largest = max((n for n, _, _ in gathered), default=0)  # FSDP: the largest unit's elements
    tied = [kept and index < len(gathered) - 1 for index, (*_, kept) in enumerate(gathered)]  # gathered all step
    # The rest: a unit is gathered beside one neighbour in run order (forward prefetches the next, backward the one
    # before). The last unit (the LM head's), kept from its forward to its backward, is freed as its backward ends,
    # before the last block's backward prefetches the block before: it never meets two others
    others = [size for (_, size, _), all_step in zip(gathered, tied) if not all_step]
    moving = max([a + b for a, b in zip(others, others[1:])] or others or [0])
    activations, recompute = activation_plan(config, layout)
    e = layout.bytes
    fsdp = layout.strategy in ("fsdp", "2d")
    logits = layout.micro_batch * config.block_size * config.padded_vocab_size // (
        layout.tp if layout.tp > 1 and layout.loss_parallel else 1)
    rows = model_states(params, tensors)
    if fsdp and layout.cpu_offload:  # the model states are in host memory (host_plan); shards visit the device
        shard = largest // (layout.dp // layout.replicate)
        rows = [("float32 shards copied in to be all-gathered: a unit's, the next one's", 2 * 4 * shard),
                ("a float32 gradient shard, reduce-scattered, before its copy out", 4 * shard)]
    if layout.strategy == "zero":
        rows = zero_states(config, layout, buckets)
    head = config.padded_vocab_size * config.n_embd // layout.tp
    if e == 2 and not fsdp:  # autocast's copies, saved by the matmuls; checkpointed blocks recast theirs
        one_block = (cast - head) // config.n_layer
        rows.append(("bfloat16 copies of the weights, saved for backward (autocast)",
                     2 * (head if layout.activation_checkpointing else cast)))
        recompute += 2 * one_block if layout.activation_checkpointing else 0
    if e == 2 and fsdp and config.tie_embeddings:  # the LM head's weight is wte, gathered in float32 for its lookup
        rows.append(("bfloat16 copies of the weights: the tied LM head's (autocast)", 2 * head))
    rows += list(activations.items())
    if recompute:
        rows.append(("one block recomputed in backward (--activation_checkpointing)", recompute))
    if fsdp:
        gathered_weights = f"gathered weights ({'bfloat16 matrices' if e == 2 else 'float32'}): "
        rows.append((gathered_weights + ("tied unit, 2 neighbours" if any(tied) else "2 neighbouring units")
                     if layout.reshard else gathered_weights + "every unit",
                     sum(size for (_, size, _), all_step in zip(gathered, tied) if all_step) + moving
                     if layout.reshard else sum(size for _, size, _ in gathered)))
        rows.append(("a unit's gradients, copied into its float32 reduce-scatter buffer",
                     max((size + 4 * n for n, size, _ in gathered), default=0)))
    if layout.strategy == "ep":  # train_ep.py: the all-to-alls' buffers, the gradients' flat all-reduces
        sizes = local_sizes(config, ep=layout.ep)
        experts = sum(n for name, n in sizes.items() if is_expert(name))
        rows += [("dispatch: one layer's rows sent and received (compute dtype)", e * config.n_embd * int(
                     layout.micro_batch * config.block_size * config.n_expert_per_token * (1 + layout.expert_load))),
                 ("the larger flat gradient all-reduced: shared or experts'", 4 * max(sum(sizes.values()) - experts,
                                                                                       experts))]
    rows.append(("logits and their gradient", logits * (e + 4)))
    return rows


def context_parallel_plan(config, layout):
    """[(item, bytes)] of one rank of train_cp.py: the whole model as under DDP, and the activations and logits of its
    s / cp tokens of every sequence, as one device holds them for a sequence that short. What attention adds: the
    all-gather saves every rank's keys and values, 2·b·s·kv a layer in the compute dtype (its own among them), and
    on CPU the mask torch builds for each query chunk's lower-right causal attention (on CUDA the fused kernels need
    none); the ring saves only its own, and its output in float32 to merge into."""
    s, L = config.block_size, config.n_layer
    whole = layout._replace(strategy="ddp", cp=1)
    weights = ("parameters", "gradients", "AdamW", "bfloat16 copies")  # wpe's s rows among them
    rows = [row for row in plan_memory(config, whole) if row[0].startswith(weights)]
    rows += [row for row in plan_memory(replace(config, block_size=s // layout.cp), whole)
             if not row[0].startswith(weights)]
    item, size = context_parallel_attention(config, layout)
    if layout.activation_checkpointing:  # saved only while a block is recomputed
        return rows + [("one block recomputed in backward: " + item, size)]
    return rows + [("activations: " + item, L * size)]


def context_parallel_attention(config, layout):
    """(item, bytes) context-parallel attention saves a layer beyond one device's on s / cp tokens: the all-gather
    every other rank's keys and values (of this rank's KV heads under tp) and, on CPU, two boolean masks, chunk i's
    queries x (i+1) chunks of keys; the ring its float32 output, where the compute dtype is not float32 already."""
    s, b, e = config.block_size, layout.micro_batch, layout.bytes
    if layout.cp_impl == "allgather":
        chunk, kv = s // (2 * layout.cp), config.n_kv_head * config.head_dim // layout.tp
        return ("every rank's keys and values, gathered", 2 * b * (s - s // layout.cp) * kv * e
                + (2 * layout.cp + 1) * chunk * chunk * (layout.device == "cpu"))
    return "ring attention's float32 output", b * s // layout.cp * config.n_embd * 4 // layout.tp if e == 2 else 0


def context_parallel_terms(config, tokens, steps, compute, cp, cp_impl, backend):
    """[Term] of attention over cp ranks, `tokens` of this rank's a micro-step (b·s/cp), `steps` micro-steps: each
    layer's keys and values (2·tokens·kv elements, the KV heads only) travel forward and their gradients backward.
    allgather: one all-gather forward and one reduce-scatter backward a layer, (cp-1) blocks each way; ring: cp-1
    point-to-point sends of the block forward, and backward the block again and its dK/dV partial sums (float32, so
    that bfloat16 rounds them once, not at every hop), cp-1 each."""
    L, elements = config.n_layer, 2 * tokens * config.n_kv_head * config.head_dim
    block = elements * compute
    if cp_impl == "allgather":
        return [Term("keys and values, forward (all-gather)", "all_gather", "cp", steps * L,
                     steps * L * wire_bytes("all_gather", block, cp)),
                Term("their gradients, backward (reduce-scatter: each rank's sum)", "reduce_scatter", "cp", steps * L,
                     steps * L * sent("reduce_scatter", cp * block, cp, backend))]
    return [Term("keys and values around the ring, forward", "send", "cp", steps * L * (cp - 1),
                 steps * L * (cp - 1) * block),
            Term("keys and values around the ring again, backward", "send", "cp", steps * L * (cp - 1),
                 steps * L * (cp - 1) * block),
            Term("their dK/dV partial sums, back to the owner", "send", "cp", steps * L * (cp - 1),
                 steps * L * (cp - 1) * elements * 4),
            Term("each of the three, received from the previous rank", "recv", "cp", 3 * steps * L * (cp - 1), 0)]


def stage_plan(config, layout, stage, layers, schedule):
    """[(item, bytes)] pipeline stage `stage` holds at its peak: its blocks (layers: train_pp.stage_layers), the
    embeddings on the first stage, the final norm and the LM head (tied: wte) on the last; and the activations of as
    many micro-batches as its schedule (train_pp.schedule) holds at once: every one under GPipe, at most pp - stage
    under 1F1B. Each micro-batch in flight keeps autocast's bfloat16 copies of the stage's weights too."""
    first, last = stage == 0, stage == layout.pp - 1
    held = list(layers(config.n_layer, layout.pp, stage))
    sizes = local_sizes(config)
    names = [name for name in sizes if (name.startswith("blocks.") and int(name.split(".")[1]) in held)
             or (first and name.startswith("wpe")) or (last and name.startswith(("ln_f", "lm_head")))
             or ((first or (last and config.tie_embeddings)) and name.startswith("wte"))]
    params = sum(sizes[name] for name in names)
    # autocast copies the matmuls' weights: wte only where it is the tied LM head's, not where it is an embedding
    cast = sum(sizes[name] for name in names
               if is_matmul_weight(name, config) and not (name.startswith("wte") and not last))
    order = schedule(layout.schedule, stage, layout.pp, layout.micro_batches)
    in_flight = max(itertools.accumulate(1 if kind == "forward" else -1 for kind, _ in order))
    activations, recompute = activation_plan(replace(config, n_layer=len(held)), layout)
    ends = {"embeddings": first, "final layer norm": last, "loss (softmax of the logits)": last}
    per_micro_batch = activations["activations of the blocks"]
    per_micro_batch += sum(activations.get(item, 0) for item, held_here in ends.items() if held_here)
    per_micro_batch += activations.get("embeddings and final layer norm", 0)  # one stage of one
    e = layout.bytes
    rows = model_states(params, len(names), f"stage {stage} of {layout.pp} ({len(held)} blocks): ")
    rows += [(f"activations of {in_flight} micro-batch{'es' * (in_flight > 1)} in flight ({layout.schedule})",
              in_flight * per_micro_batch)]
    if e == 2:
        rows.append(("bfloat16 weight copies, one a micro-batch in flight (autocast)", in_flight * 2 * cast))
    if recompute:
        rows.append(("one block recomputed in backward (--activation_checkpointing)", recompute))
    if not first:  # the residual stream between stages, and its gradient, in the compute dtype
        rows.append(("received activation and gradient (point to point)", 2 * e * layout.micro_batch
                     * config.block_size * config.n_embd))
    if last:
        rows.append(("logits and their gradient", layout.micro_batch * config.block_size * config.padded_vocab_size
                     * (e + 4)))
    return rows


def fullest_stage(config, layout, layers, schedule, sliced=None):
    """The plan of the pipeline stage that needs the most memory, train_pp.py's or (layout "4d") train_4d.py's (layers,
    schedule: train_pp.py's functions; sliced: train_tp.py's)."""
    if layers is None or schedule is None or (layout.tp > 1 and sliced is None):
        raise ValueError("a pipeline layout needs the strategies' own rules: pass layers=train_pp.stage_layers, "
                         "schedule=train_pp.schedule (and with --tp, sliced=train_tp.is_sliced)")
    plan = partial(four_d_stage_plan, sliced=sliced) if layout.strategy == "4d" else stage_plan
    return max((plan(config, layout, stage, layers, schedule) for stage in range(layout.pp)),
               key=lambda rows: sum(size for _, size in rows))


def four_d_flats(config, layout, stage, layers):
    """[[(the names of each FlatParameter, whether it holds matrices)] of each of train_4d.py's FSDP units] on stage
    `stage`, in their order: the root (wpe on the first stage; ln_f, the LM head, a tied wte on the last), wte's own
    unit on the first stage, each block; a unit's matrices, then its 1-D parameters, as train_fsdp.py flattens them."""
    first, last, shapes = stage == 0, stage == layout.pp - 1, dict(model_on_meta(config).named_parameters())
    ends = [name for name in shapes if (first and name.startswith("wpe")) or (last and config.tie_embeddings and
            name.startswith("wte")) or (last and name.startswith(("ln_f", "lm_head")))]
    units = [ends, [name for name in shapes if first and name.startswith("wte") and name not in ends]]
    units += [[name for name in shapes if name.startswith(f"blocks.{layer}.")] for layer in layers(config.n_layer,
                                                                                                   layout.pp, stage)]
    return [[(names, matrix) for matrix in (True, False)
             if (names := [name for name in unit if (shapes[name].dim() >= 2) == matrix])] for unit in units]


def shard_spans(sizes, ranks, rank):
    """Elements of each of `sizes`, laid end to end and padded to `ranks` equal shards, in shard `rank` (train_fsdp's
    shard_layout): the padding is the last shard's, so the first holds more of a flat than its mean share."""
    shard, ends = -(-sum(sizes) // ranks), list(itertools.accumulate(sizes))
    return [max(0, min(end, (rank + 1) * shard) - max(end - size, rank * shard)) for size, end in zip(sizes, ends)]


def four_d_spans(config, layout, stage, layers, sliced, data_rank):
    """{name: elements of it that rank `data_rank` of its data group holds} on train_4d.py's stage `stage`: its span
    of its FlatParameter's shard over the dp x cp ranks (--dp_impl ddp: its whole TP slice)."""
    sizes, ranks = local_sizes(config, layout.tp, sliced), layout.dp * layout.cp if layout.dp_impl == "fsdp" else 1
    return {name: n for unit in four_d_flats(config, layout, stage, layers) for names, _ in unit
            for name, n in zip(names, shard_spans([sizes[name] for name in names], ranks, data_rank % ranks))}


def four_d_units(config, layout, stage, layers, sliced):
    """([(elements of each FlatParameter's shard, whether it is gathered in the compute dtype)] of each FSDP unit,
    whether the unit stays gathered from forward to backward) of train_4d.py's stage `stage`, in four_d_flats' order;
    TP-sliced, sharded over the dp x cp ranks, padded (--dp_impl ddp: whole). As train_fsdp.py gathers them: the
    matrices in the compute dtype, but for an embedding table (wte, wpe); the 1-D flats in float32."""
    last, ranks = stage == layout.pp - 1, layout.dp * layout.cp if layout.dp_impl == "fsdp" else 1
    sizes, flats = local_sizes(config, layout.tp, sliced), four_d_flats(config, layout, stage, layers)
    kept = [index == len(flats) - 1 or (index == 0 and last and config.tie_embeddings) for index in range(len(flats))]
    return [[(-(-sum(sizes[name] for name in names) // ranks), matrix and not any(name.startswith(("wte", "wpe"))
                                                                                  for name in names))
             for names, matrix in unit] for unit in flats], kept


def four_d_terms(config, layout, stage, layers, schedule, sliced, backend, buckets=None, data_rank=0):
    """[Term] one rank of train_4d.py's stage `stage` (rank `data_rank` of its data group) sends in an optimizer step:
    the sum of the axes' own. TP's f and g over the stage's blocks (the embedding's g on the first stage, the LM head's
    f and the loss on the last), for b·s/cp tokens a micro-batch; CP's attention over the stage's blocks, on this
    rank's KV heads; PP's activation forward and gradient back a micro-batch (sends; the receives carry nothing of
    their own); FSDP's gathers and reduce-scatters over the dp x cp ranks, a micro-batch each (a kept unit, every unit
    under --no_reshard, once between two backwards, as the schedule orders them), or --dp_impl ddp's gradient buckets
    (buckets: train_ddp.assign_buckets) all-reduced in the last micro-batch's backward; the tied weight's gradient
    (FSDP: this rank's span of it) summed between the end stages; the gradient norm (DDP: over one replica's pp x tp
    ranks), the step's agreement and the logged loss over every rank. Sequence parallel: TP's reduce-scatters and
    all-gathers, a stage's 1/tp of the tokens point to point, and this rank's spans of the replicated parameters'
    gradients (each flat's padding on its last shard) summed over TP."""
    first, last, m, fsdp = stage == 0, stage == layout.pp - 1, layout.micro_batches, layout.dp_impl == "fsdp"
    held = len(layers(config.n_layer, layout.pp, stage))
    tokens, e = layout.micro_batch * config.block_size // layout.cp, layout.bytes
    ranks, world = layout.dp * layout.cp, layout.world_size
    terms = tensor_parallel_terms(replace(config, n_layer=held), tokens, m, e, layout.tp, backend,
                                  layout.sequence_parallel, True, embedding=first, head=last)
    if layout.cp > 1:
        heads = replace(config, n_layer=held, n_kv_head=config.n_kv_head // layout.tp)
        terms += context_parallel_terms(heads, tokens, m, e, layout.cp, layout.cp_impl, backend)
    if layout.pp > 1:
        sends = m * ((not first) + (not last))
        terms += [Term("activations forward, their gradients back (point to point)", "send", "pp", sends,
                       sends * e * tokens // (layout.tp if layout.sequence_parallel else 1) * config.n_embd),
                  Term("what the neighbouring stages send", "recv", "pp", sends, 0)]
    spans = four_d_spans(config, layout, stage, layers, sliced, data_rank)  # {name: elements of its gradient here}
    if fsdp:
        shards, kept = four_d_units(config, layout, stage, layers, sliced)
        held_between = 0  # a kept unit: gathered by a forward or a backward that finds it freed, freed as one ends
        gathered = False
        for kind, _ in schedule(layout.schedule, stage, layout.pp, m):
            held_between += not gathered
            gathered = kind == "forward"
        times = [held_between if keep or not layout.reshard else 2 * m for keep in kept]  # --no_reshard: all kept
        terms += [Term("each unit's weights, before its forward and again before its backward", "all_gather", "data",
                       sum(len(unit) * n for unit, n in zip(shards, times)),
                       sum(shard * n * sent("all_gather", e if cast else 4, ranks, backend)
                           for unit, n in zip(shards, times) for shard, cast in unit)),
                  Term("each unit's float32 gradient, as its backward ends", "reduce_scatter", "data",
                       m * sum(map(len, shards)), sum(m * sent("reduce_scatter", 4 * shard * ranks, ranks, backend)
                                                      for unit in shards for shard, _ in unit))]
    else:
        if buckets is None:
            raise ValueError("a DDP layout needs the strategy's own buckets: pass buckets=train_ddp.assign_buckets")
        named = [(name, torch.empty(spans[name], device="meta"))  # in the model's order, as the buckets fill
                 for name in local_sizes(config) if name in spans]
        terms.append(Term("gradient buckets, during the last micro-batch's backward", "all_reduce", "data",
                          len(buckets(named, layout.bucket_mb)), sent("all_reduce", 4 * sum(spans.values()), ranks,
                                                                      backend)))
    if layout.sequence_parallel:
        terms.append(Term("replicated parameters' gradients (norms, biases, wpe)", "all_reduce", "tp", 1, sent(
            "all_reduce", 4 * sum(n for name, n in spans.items() if not sliced(name)), layout.tp, backend)))
    if config.tie_embeddings and layout.pp > 1 and (first or last):
        terms.append(Term("the tied weight's gradient, summed between the end stages", "all_reduce", "ends", 1,
                          sent("all_reduce", 4 * spans["wte.weight"], 2, backend)))
    norm = world if fsdp else layout.pp * layout.tp  # FSDP's shards are disjoint over every rank; DDP's replicas not
    return terms + [Term("gradient norm", "all_reduce", "world" if fsdp else "model", 1,
                         sent("all_reduce", 4, norm, backend)),
                    Term("whether the gradient norm is finite and a rank was asked to stop", "all_reduce", "world", 1,
                         sent("all_reduce", 4 * (2 + config.n_layer * config.n_expert), world, backend)),
                    Term("the logged loss", "all_reduce", "world", 1, sent("all_reduce", 4, world, backend))]


def four_d_stage_plan(config, layout, stage, layers, schedule, sliced):
    """[(item, bytes)] one rank of train_4d.py's pipeline stage `stage` holds at its peak, each axis's own share: its
    blocks (and ends) as stage_plan counts them, sliced over tp (sliced: train_tp.is_sliced) and fully sharded over the
    dp x cp ranks of its data group, in train_4d's FSDP units (the root: wpe, ln_f, the LM head; wte on the first
    stage; each block), each FlatParameter padded (--dp_impl ddp: whole, and autocast's bfloat16 copies of the
    matrices, one a micro-batch in flight, as stage_plan counts them); the activations of s / cp tokens a sequence
    (with context-parallel attention's own; 1/tp of the residual stream under sequence parallelism), one micro-batch's
    per micro-batch in flight (stage_plan's); FSDP's gathered weights and its float32 reduce-scatter buffer; the
    point-to-point activation and gradient received; the logits' vocabulary slice. Gathered at once: the root, whose
    module is the whole stage (from the stage's forward to its end; a tied one all step; wpe through backward), a unit
    and the neighbour it prefetches, and the last block, kept from its forward to its backward, where the schedule
    runs a second forward before that backward (GPipe; 1F1B's warm-up)."""
    first, last, fsdp = stage == 0, stage == layout.pp - 1, layout.dp_impl == "fsdp"
    ranks = layout.dp * layout.cp if fsdp else 1
    held = list(layers(config.n_layer, layout.pp, stage))
    shards, _ = four_d_units(config, layout, stage, layers, sliced)
    names = [name for unit in four_d_flats(config, layout, stage, layers) for flat, _ in unit for name in flat]
    params = sum(n for unit in shards for n, _ in unit)
    tensors = sum(map(len, shards)) if fsdp else len(names)  # AdamW's step: one a FlatParameter, or a parameter
    e = layout.bytes
    gathered = [sum(n * (e if cast else 4) for n, cast in unit) * ranks for unit in shards]  # bytes, as train_fsdp
    root, rest = gathered[0], [size for size in gathered[1:] if size]  # the blocks (and wte's unit) in run order
    order = schedule(layout.schedule, stage, layout.pp, layout.micro_batches)
    in_flight = max(itertools.accumulate(1 if kind == "forward" else -1 for kind, _ in order))
    forwards_in_a_row = any(a[0] == b[0] == "forward" for a, b in zip(order, order[1:]))
    pairs = [a + b + rest[-1] * (forwards_in_a_row and index + 2 < len(rest))
             for index, (a, b) in enumerate(zip(rest, rest[1:]))]
    local = replace(config, n_layer=len(held), block_size=config.block_size // layout.cp)
    activations, recompute = activation_plan(local, layout._replace(strategy="2d"))  # FSDP's weights, TP's slices
    attention = context_parallel_attention(config, layout)[1] if layout.cp > 1 else 0
    if layout.activation_checkpointing:
        recompute += attention
    ends = {"embeddings": first, "final layer norm": last, "embeddings and final layer norm": True,
            "loss (softmax of the logits)": last}
    per_micro_batch = activations["activations of the blocks"] + attention * len(held) * \
        (not layout.activation_checkpointing)
    per_micro_batch += sum(size for item, size in activations.items() if ends.get(item))
    tokens = layout.micro_batch * config.block_size // layout.cp
    vocab = config.padded_vocab_size // layout.tp
    rows = model_states(params, tensors, f"stage {stage} of {layout.pp} ({len(held)} blocks), "
                        + (f"shards of 1/{ranks}: " if fsdp else "DDP: "))
    rows += [(f"activations, {in_flight} micro-batch{'es' * (in_flight > 1)} in flight ({layout.schedule}) of "
              f"{tokens // layout.micro_batch} tokens", in_flight * per_micro_batch)]
    sizes = local_sizes(config, layout.tp, sliced)
    head = sizes["wte.weight"] if last and config.tie_embeddings else 0  # the tied LM head: wte, gathered float32
    cast = head if fsdp else sum(sizes[name] for name in names if is_matmul_weight(name, config)
                                 and not (name.startswith("wte") and not last))
    if e == 2 and cast:
        rows.append(("bfloat16 copies of the tied LM head, one a micro-batch (autocast)" if fsdp else
                     "bfloat16 weight copies, one a micro-batch in flight (autocast)", in_flight * 2 * cast))
    if fsdp:
        kept_too = forwards_in_a_row and len(rest) > 2  # the last block beside a pair of others
        gathered_weights = f"gathered weights ({'bfloat16 matrices' if e == 2 else 'float32'}): "
        rows += [(gathered_weights + ("root, a pair" + ", last block" * kept_too
                                      if layout.reshard else "every unit"),
                  root + max(pairs or rest or [0]) if layout.reshard else sum(gathered)),
                 ("a unit's gradients, copied into its float32 reduce-scatter buffer",
                  max(size + 4 * sum(n for n, _ in unit) * ranks for size, unit in zip(gathered, shards)))]
    if recompute:
        rows.append(("one block recomputed in backward (--activation_checkpointing)", recompute))
    if layout.pp > 1:  # the residual stream from the previous stage, the gradient from the next, in the compute dtype
        rows.append(("received activation and gradient (point to point)", ((not first) + (not last)) * e * tokens
                     // (layout.tp if layout.sequence_parallel else 1) * config.n_embd))
    if last:
        rows.append(("logits' vocabulary slice and their gradient", tokens * vocab * (e + 4)))
    return rows


# ------------------------------------------------------------------------------------------------------------
# Communication: every collective one optimizer step of each strategy runs, as the code runs it


def wire_bytes(kind, payload, n):
    """Bytes one rank sends in a ring implementation: all-reduce 2(N-1)/N of the tensor, all-gather (N-1)x its
    input shard, reduce-scatter and all-to-all (N-1)/N of their input, broadcast, reduce and a send the tensor, a
    receive and a barrier nothing."""
    if n == 1 or kind in ("barrier", "recv"):
        return 0
    factors = {"all_reduce": 2 * (n - 1) / n, "all_gather": n - 1, "reduce_scatter": (n - 1) / n,
               "all_to_all": (n - 1) / n}
    return factors.get(kind, 1) * payload


def sent(kind, payload, n, backend):
    """wire_bytes of a collective as `backend` runs it: gloo implements reduce-scatter as an all-reduce of the whole
    input (the profiler records gloo:all_reduce), which sends twice what NCCL's ring reduce-scatter does."""
    return wire_bytes("all_reduce" if backend == "gloo" and kind == "reduce_scatter" else kind, payload, n)


class Term(NamedTuple):
    """One kind of collective in a step: what it moves, its kind and group, how many run a step, and the bytes one
    rank sends through them a step."""
    what: str
    kind: str
    group: str
    count: int
    bytes: float


def tensor_parallel_terms(config, tokens, steps, compute, tp, backend, sequence_parallel, loss_parallel,
                          embedding=True, head=True):
    """[Term] of Megatron's f and g and the vocab-parallel loss over `tokens` a micro-step, `steps` micro-steps. f
    and the row-parallel g carry the compute dtype (under bf16 autocast f casts the norms' float32 outputs first), and
    so do their conjugates; the embedding's g, and its conjugate, the float32 residual stream; the loss's per-token
    sums float32. A pipeline stage without the embedding or the LM head (embedding, head) runs theirs not."""
    L, activation = config.n_layer, tokens * config.n_embd  # elements of one [micro batch, sequence, hidden]
    if sequence_parallel:
        collectives = [
            ("embedding output, forward (g)", "reduce_scatter", embedding, 4),
            ("attention and MLP partial products, forward (g)", "reduce_scatter", 2 * L, compute),
            ("layer norm outputs' gradients, backward (f, f of the LM head)", "reduce_scatter", 2 * L + head, compute),
            ("layer norm outputs' shards, forward (f, f of the LM head)", "all_gather", 2 * L + head, compute),
            ("partial products' gradients, backward (g)", "all_gather", 2 * L, compute),
            ("embedding output's gradient, backward (g)", "all_gather", embedding, 4)]
    else:
        collectives = [
            ("embedding output, forward (g)", "all_reduce", embedding, 4),
            ("attention and MLP partial products, forward (g)", "all_reduce", 2 * L, compute),
            ("layer norm outputs' gradients, backward (f, f of the LM head)", "all_reduce", 2 * L + head, compute)]
    terms = []
    for what, kind, count, width in collectives:
        payload = width * activation // (tp if kind == "all_gather" else 1)  # an all-gather sends its shard
        terms.append(Term(what, kind, "tp", steps * count, steps * count * sent(kind, payload, tp, backend)))
    if not head:
        return terms
    if loss_parallel:  # each token's max logit, then its sum of exponentials and target logit, in float32
        terms.append(Term("vocab-parallel loss, per token", "all_reduce", "tp", 2 * steps,
                          steps * sent("all_reduce", 3 * 4 * tokens, tp, backend)))
    else:
        logits = tokens * config.padded_vocab_size // tp
        terms.append(Term("logits' vocabulary slices, forward", "all_gather", "tp", steps,
                          steps * sent("all_gather", compute * logits, tp, backend)))
    return terms


def fsdp_terms(config, steps, compute, tp, dp, backend, reshard, sliced, units, replicate=1):
    """[Term] of FSDP's all-gathers and reduce-scatters, one of each per FlatParameter a micro-step, and a second
    all-gather of a unit before its backward (the last unit and a tied one stay gathered from forward to backward).
    HSDP (replicate > 1) shards over dp / replicate ranks, then all-reduces each gradient shard over its `replicate`
    copies."""
    ranks = dp // replicate
    gathers, gathered, scatters, scattered, averaged = 0, 0, 0, 0, 0
    for unit, kept in flat_sizes(config, tp, sliced, units):
        times = 1 if kept or not reshard else 2
        for size, cast in unit:  # as train_fsdp.py gathers it: the blocks' and the head's matrices in `compute`
            shard = -(-size // ranks)
            gathers += times
            gathered += times * sent("all_gather", (compute if cast else 4) * shard, ranks, backend)
            scatters += 1
            scattered += sent("reduce_scatter", 4 * shard * ranks, ranks, backend)
            averaged += sent("all_reduce", 4 * shard, replicate, backend)
    group = "dp" if replicate == 1 else "shard"
    terms = [Term("each unit's weights, before its forward and again before its backward", "all_gather", group,
                  steps * gathers, steps * gathered),
             Term("each unit's float32 gradient, as its backward ends", "reduce_scatter", group, steps * scatters,
                  steps * scattered)]
    if replicate > 1:
        terms.append(Term("each gradient shard, averaged over its copies", "all_reduce", "replicate",
                          steps * scatters, steps * averaged))
    return terms


def zero_terms(config, steps, dp, backend, stage, bucket_mb, buckets):
    """[Term] of ZeRO's buckets, each reduce-scattered into the ranks' slices: stage 1 in the last micro-step, as DDP
    all-reduces, stage 2 in every micro-step; then each rank's updated slices of the weights are all-gathered. At
    k = 1 micro-step both send (N-1)/N · 4Ψ twice: DDP's 2(N-1)/N · 4Ψ."""
    padded, _ = zero_buckets(config, Layout("zero", dp, dp, 1, 1, stage=stage, bucket_mb=bucket_mb), buckets)
    reduced = 1 if stage == 1 else steps  # reduce-scatters of each bucket a step
    micro_steps = "the last micro-step's" if stage == 1 else "every micro-step's"
    return [Term(f"gradient buckets, during {micro_steps} backward", "reduce_scatter", "dp", reduced * len(padded),
                 reduced * sum(sent("reduce_scatter", 4 * size, dp, backend) for size in padded)),
            Term("each rank's updated slices of the weights, after the step", "all_gather", "dp", len(padded),
                 sum(sent("all_gather", 4 * size // dp, dp, backend) for size in padded))]


def comm_formula(strategy, config, global_batch, micro_batch=None, dtype="float32", backend="gloo", tp=1, dp=1,
                 sequence_parallel=False, loss_parallel=True, reshard=True, bucket_mb=25, sliced=None, units=None,
                 buckets=None, stage=1, replicate=1, cp=1, cp_impl="allgather", ep=1, expert_load=1,
                 activation_checkpointing=False):
    """[Term]: every collective one optimizer step of `strategy` (ddp, zero, fsdp, tp, 2d, cp, ep) runs on one rank,
    with the bytes that rank sends (ring algorithms, on `backend`), over `dp` data-parallel and `tp` tensor-parallel
    ranks (zero: ZeRO's `stage`; fsdp: HSDP's `replicate` copies of dp / replicate shards). The broadcast that makes
    DDP's replicas equal and the fingerprint check run once at start, not per step. sliced, units and buckets: the
    strategies' own functions (train_tp.is_sliced, train_fsdp.flat_parameter_groups, train_ddp.assign_buckets). cp:
    `cp` context-parallel ranks a data-parallel rank (cp_impl: allgather or ring), gradients averaged over all. ep:
    `dp` replicas of `ep` expert-parallel ranks, each on its own rows (expert_load: the rows its experts receive over
    the mean; activation_checkpointing: the recomputed forward exchanges again)."""
    micro_batch = micro_batch or global_batch // (dp * ep)
    steps = global_batch // (micro_batch * dp * ep)  # micro-steps an optimizer step
    compute = 2 if dtype == "bfloat16" else 4
    terms = []
    if strategy == "ep":  # per layer and micro-step: the counts, then the rows there and back, each way backward too
        sizes, forwards = local_sizes(config), steps * config.n_layer * (1 + activation_checkpointing)
        both = forwards + steps * config.n_layer
        experts = sum(n for name, n in sizes.items() if is_expert(name))
        rows = micro_batch * config.block_size * config.n_expert_per_token * config.n_embd * compute  # bytes
        terms += [Term("tokens per expert, before each dispatch (int64)", "all_to_all", "ep", forwards,
                       forwards * sent("all_to_all", 8 * config.n_expert, ep, backend)),
                  Term("rows to their experts' ranks (dispatch), and back the combine's gradient", "all_to_all", "ep",
                       both, both * sent("all_to_all", rows, ep, backend)),
                  Term("the experts' outputs back (combine), and the dispatch's gradient", "all_to_all", "ep", both,
                       round(both * sent("all_to_all", rows * expert_load, ep, backend))),
                  Term("shared parameters' gradients, one flat all-reduce", "all_reduce", "world", 1,
                       sent("all_reduce", 4 * (sum(sizes.values()) - experts), ep * dp, backend))]
        terms += [Term("this rank's experts' gradients, one flat all-reduce over their replicas", "all_reduce", "dp",
                       1, sent("all_reduce", 4 * experts // ep, dp, backend))] * (dp > 1)  # whole at --dp 1
        terms += [Term("gradient norm: the experts' squares", "all_reduce", "ep", 1, sent("all_reduce", 4, ep, backend))]
    if strategy in ("ddp", "cp"):
        if buckets is None:
            raise ValueError("a DDP layout needs the strategy's own buckets: pass buckets=train_ddp.assign_buckets")
        named = list(model_on_meta(config).named_parameters())
        gradient_bytes = 4 * sum(local_sizes(config).values())
        terms.append(Term("gradient buckets, during the last micro-step's backward", "all_reduce", "dp",
                          len(buckets(named, bucket_mb)), sent("all_reduce", gradient_bytes, dp * cp, backend)))
    if strategy == "cp":
        terms += context_parallel_terms(config, micro_batch * config.block_size // cp, steps, compute, cp, cp_impl,
                                        backend)
    if strategy in ("tp", "2d"):
        terms += tensor_parallel_terms(config, micro_batch * config.block_size, steps, compute, tp, backend,
                                       sequence_parallel, loss_parallel)
        if sequence_parallel:  # one flat all-reduce of the replicated parameters' gradients (an FSDP shard of them)
            sizes = local_sizes(config, tp, sliced)
            replicated = sum(n for name, n in sizes.items() if not sliced(name))
            terms.append(Term("replicated parameters' gradients (norms, biases, wpe)", "all_reduce", "tp", 1,
                              sent("all_reduce", 4 * replicated / dp, tp, backend)))
    if strategy == "zero":
        terms += zero_terms(config, steps, dp, backend, stage, bucket_mb, buckets)
    if strategy in ("fsdp", "2d"):
        terms += fsdp_terms(config, steps, compute, tp, dp, backend, reshard, sliced, units, replicate)
    if strategy in ("zero", "fsdp", "tp", "2d"):  # the gradient norm's sum of squares: over every rank's own part
        terms.append(Term("gradient norm", "all_reduce", "world", 1,
                          sent("all_reduce", 4, tp * dp // replicate, backend)))  # HSDP: one shard group has all
    if strategy != "tp":  # TP peers hold the whole batch's loss already
        terms.append(Term("the logged loss", "all_reduce", "dp", 1, sent("all_reduce", 4, dp * cp * ep, backend)))
    flags = 4 * (2 + config.n_layer * config.n_expert)  # training.StopRequest.agreed's; a mixture's loads too
    terms.append(Term("whether the gradient norm is finite and a rank was asked to stop", "all_reduce", "world", 1,
                      sent("all_reduce", flags, tp * dp * cp * ep, backend)))
    return terms


# ------------------------------------------------------------------------------------------------------------
# --plan's printout, and what fits where


def format_bytes(size):
    return f"{size / 1e9:,.2f} GB" if size >= 1e9 else f"{size / 1e6:,.1f} MB"


def plan_verdict(total, gpu_memory_gb, layout, rows, n_expert=0):
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
        advice.append("train_fsdp.py or a larger --dp" if layout.strategy in ("single", "ddp", "zero", "tp")
                      else "a larger --pp" if layout.strategy == "pp" else "a larger --tp (train_2d.py) or more GPUs"
                      if layout.strategy != "ep" else "a larger --ep" if layout.ep < n_expert else
                      "sharding the weights further than one expert a rank (train_ep.py does not)")
    return f"does not fit: needs {total / 1e9:.1f} GB; try {' or '.join(advice)}"


LLAMA3_VOCAB_SIZE = 128256  # Llama 3's tokenizer: 128,000 BPE tokens and 256 special ones
OWN_VOCAB_SIZE = {"mixtral-8x7b": 32000, "mixtral-8x22b": 32768}  # Mistral's tokenizers (v1, v3)


def plan_config(args):
    """The model --plan describes: --model's preset with the data's vocabulary (meta.json), or the preset's own
    tokenizer's (Llama 3's 128,256 tokens for a Llama preset, GPT-2's 50,257 for another) for a folder not prepared
    yet and for the default corpus, whose bytes are the CPU presets' alone: nobody trains GPT-3 on bytes."""
    preset = args.model or (args.init_from if args.init_from in gpt.PRESETS else "tiny")
    own = OWN_VOCAB_SIZE.get(preset, LLAMA3_VOCAB_SIZE if gpt.PRESETS[preset].get("rope_theta") else 50257)
    if args.data == prepare_data.DEFAULT_DATA_DIR:
        vocab_size = 256 if preset.endswith("tiny") else own
    elif os.path.exists(os.path.join(args.data, "meta.json")):
        vocab_size = prepare_data.load_meta(args.data)["vocab_size"]
    else:
        vocab_size = own
    return gpt.make_config(preset, vocab_size, args.block_size, args.dropout), preset


def print_plan(args, world_size, dp_size, sliced=None, units=None, layers=None, schedule=None, buckets=None):
    """--plan: print what one rank of this layout needs, item by item, and whether it fits in --gpu_memory. sliced,
    units, layers, schedule and buckets: train_tp.is_sliced, train_fsdp.flat_parameter_groups, train_pp.stage_layers,
    train_pp.schedule and train_ddp.assign_buckets, from the scripts that use them."""
    config, preset = plan_config(args)
    if args.micro_batch is None and args.global_batch % dp_size:
        raise prepare_data.UsageError(f"--global_batch {args.global_batch} does not split over {dp_size} "
                                      f"data-parallel ranks: choose a multiple of {dp_size}")
    layout = layout_of(args, world_size, dp_size, args.micro_batch or args.global_batch // dp_size,
                       "cpu" if args.device == "cpu" else "cuda")
    if layout.tp > 1:
        training.check_tensor_parallel(config, layout.tp, layout.sequence_parallel)
    if layout.strategy in ("pp", "4d"):
        rows = fullest_stage(config, layout, layers, schedule, sliced)
    else:
        rows = plan_memory(config, layout, sliced, units, buckets)
    total = sum(size for _, size in rows)
    sizes = local_sizes(config)
    idle = sum(n for name, n in sizes.items() if is_expert(name)) * (1 - config.n_expert_per_token / max(
        config.n_expert, 1))  # the experts a token does not run
    size = lambda n: f"{n / 1e9:,.1f}B" if n >= 1e9 else f"{n / 1e6:,.1f}M"  # noqa: E731
    say = print if training.launched_rank()[0] == 0 else lambda text: None  # under torchrun, once
    grid = f"ep {layout.ep} x dp {world_size // layout.ep}" if layout.strategy == "ep" else \
        f"dp {layout.dp} x tp {layout.tp}"
    say(f"plan: {preset} ({size(sum(sizes.values()))} parameters"
        + f", {size(sum(sizes.values()) - idle)} active a token, top {config.n_expert_per_token} of "
          f"{config.n_expert} experts" * bool(config.n_expert) + f", vocabulary {config.vocab_size:,}) | "
        f"{layout.strategy} on {world_size} rank{'s' * (world_size > 1)} ({grid}"
        + f" x cp {layout.cp}, {layout.cp_impl}" * (layout.cp > 1)
        + f" x pp {layout.pp}, {layout.schedule}" * (layout.pp > 1) + ") | micro batch "
        f"{layout.micro_batch} x {config.block_size} tokens | {layout.dtype}"
        + f" | ZeRO-{layout.stage}" * (layout.strategy == "zero")
        + f" | HSDP: {layout.replicate} copies of {layout.dp // layout.replicate} shards" * (layout.replicate > 1)
        + " | activation checkpointing" * layout.activation_checkpointing
        + " | sequence parallel" * layout.sequence_parallel + " | DDP" * (layout.dp_impl == "ddp"))
    for item, size in rows + [("total, one rank", total)]:
        say(f"  {item:66} {format_bytes(size):>11}")
    say(plan_verdict(total, args.gpu_memory, layout, rows, config.n_expert))
    if layout.strategy == "ep":  # the worst router: every token to k experts of one rank (or to all it holds)
        worst = layout.ep * min(config.n_expert_per_token, config.n_expert // layout.ep) / config.n_expert_per_token
        more = sum(size for _, size in plan_memory(config, layout._replace(expert_load=worst))) - total
        say(f"if the router sends every token to one rank's experts ({worst:g}x the rows), that rank holds "
            f"{format_bytes(more)} more: it " + plan_verdict(total + more, args.gpu_memory, layout, rows, config.n_expert))
    node = min(GPUS_PER_NODE, world_size)  # ranks sharing a host
    if layout.cpu_offload and layout.strategy in ("fsdp", "2d"):
        host = host_plan(config, layout, units, sliced)
        pinned = sum(size for item, size in host if not item.startswith("AdamW"))  # the two arenas
        say("host memory (--cpu_offload): shards and gradients pinned, AdamW's state pageable:")
        for item, size in host + [("total, one rank", sum(size for _, size in host)),
                                  (f"total, a node of {node} ranks", node * sum(size for _, size in host)),
                                  (f"of which pinned, a node of {node} ranks", node * pinned)]:
            say(f"  {item:66} {format_bytes(size):>11}")
    staged = save_staging(config, layout, sliced, units, layers)
    say(f"saving a checkpoint, host memory staged: {format_bytes(staged)} a rank, {format_bytes(node * staged)} a node "
        f"of {node} (at most its largest piece on the device; host tensors are written where they lie)")
    return rows


GPUS_PER_NODE = 8  # ranks a node shares host memory between: --cpu_offload's states, a save's staging


FITS_PRESETS = ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "gpt3-125m", "gpt3-350m", "gpt3-760m", "gpt3-1.3b",
                "gpt3-2.7b", "gpt3-6.7b", "gpt3-13b", "gpt3-175b"]
FITS_LAYOUTS = [("ddp", 1), ("fsdp", 1), ("2d", 2), ("2d", 4), ("2d", 8)]  # (strategy, tp), in the order tried


def first_fit(config, gpus, micro_batch, checkpointing, gpu_memory, sliced, units):
    """The first of FITS_LAYOUTS on `gpus` GPUs that fits one rank in gpu_memory GB, as a table cell."""
    for strategy, tp in FITS_LAYOUTS:
        if config.n_kv_head % tp:  # the key/value heads, as many as the query heads or fewer
            continue
        layout = Layout(strategy, gpus, gpus // tp, tp, micro_batch, "bfloat16", sequence_parallel=tp > 1,
                        activation_checkpointing=checkpointing)
        total = sum(size for _, size in plan_memory(config, layout, sliced, units))
        if total <= gpu_memory * 1e9:
            name = strategy if tp == 1 else f"fsdp {gpus // tp} x tp {tp}"
            return f"{name} ({total / 1e9:.1f} GB)"
    return "none"


def what_fits(gpu_memory, micro_batch, sliced, units):
    """For each preset, the first layout on 8 and on 64 GPUs of gpu_memory GB that the planner says fits one rank,
    without and with activation checkpointing, in the order DDP, FSDP, then FSDP x tensor parallelism (with
    sequence parallelism) of degree 2, 4, 8: a markdown table. GPT-2's vocabulary, its context (1024) for GPT-2,
    GPT-3's (2048) for GPT-3, micro_batch sequences a rank, bfloat16 on CUDA. bench.py --what_fits prints it."""
    print(f"| model | parameters | context | {' | '.join(f'{n} GPUs{ac}' for n in (8, 64) for ac in ('', ', AC'))} |")
    print("| --- | --- | --- |" + " --- |" * 4)
    for preset in FITS_PRESETS:
        config = gpt.make_config(preset, 50257, 2048 if preset.startswith("gpt3") else 1024)
        cells = [first_fit(config, gpus, micro_batch, checkpointing, gpu_memory, sliced, units)
                 for gpus in (8, 64) for checkpointing in (False, True)]
        parameters = model_on_meta(config).num_params()
        size = f"{parameters / 1e9:.1f}B" if parameters >= 1e9 else f"{parameters / 1e6:.0f}M"
        print(f"| {preset} | {size} | {config.block_size} | {' | '.join(cells)} |")
