"""
Megatron tensor parallelism by hand: every rank holds a slice of every matrix and runs attention on its own heads.

    torchrun --standalone --nproc_per_node=2 train_tp.py                        # --tp defaults to the world size
    torchrun --standalone --nproc_per_node=4 train_tp.py --sequence_parallel
    torchrun --standalone --nproc_per_node=2 train_tp.py --impl torch            # DTensor's parallelize_module

Reads top to bottom: arguments -> process groups -> model -> strategy -> loop -> checkpoint.
"""

import math
import os
import time
from contextlib import nullcontext
from dataclasses import asdict
from datetime import timedelta
from types import SimpleNamespace
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               loss_parallel as dtensor_loss_parallel, parallelize_module)

import gpt
from prepare_data import get_tokenizer

# The same collectives under their torch >= 2.13 names, or the older ones (same signatures) on earlier versions.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_reduce(x, group, dim):
    dist.all_reduce(x, group=group)  # in place: x is always a fresh product (a matmul's output or input gradient)
    return x


def _all_gather(x, group, dim):
    out = x.new_empty(dist.get_world_size(group) * x.numel())  # gloo gathers only into a flat buffer
    all_gather_single(out, x.contiguous().view(-1), group=group)
    return torch.cat(out.view(-1, *x.shape).unbind(), dim)


def _reduce_scatter(x, group, dim):
    chunks = torch.stack(x.chunk(dist.get_world_size(group), dim))  # contiguous, rank i's chunk i-th
    out = x.new_empty(chunks.shape[1:])
    reduce_scatter_single(out.view(-1), chunks.view(-1), group=group)
    return out


def _split(x, group, dim):
    return x.chunk(dist.get_world_size(group), dim)[dist.get_rank(group)].contiguous()


class Conjugate(torch.autograd.Function):
    """One collective forward, its conjugate backward, along dim (Megatron-LM, section 3); None is the identity."""

    @staticmethod
    def forward(ctx, x, group, forward, backward, dim):
        ctx.group, ctx.backward, ctx.dim = group, backward, dim
        return forward(x, group, dim) if forward else x

    @staticmethod
    def backward(ctx, grad):
        return (ctx.backward(grad, ctx.group, ctx.dim) if ctx.backward else grad), None, None, None, None


def f(x, group, sequence_parallel):
    """Where a tensor-parallel region starts: identity forward, all-reduce backward, summing the column slices' input
    gradients (Megatron's copy_to_tensor_model_parallel_region); under sequence parallelism all-gather forward,
    reduce-scatter backward (gather_from_sequence_parallel_region)."""
    return Conjugate.apply(x, group, *((_all_gather, _reduce_scatter) if sequence_parallel else (None, _all_reduce)), 1)


def g(x, group, sequence_parallel):
    """Where it ends, f's conjugate: all-reduce forward, summing the row slices' partial products, identity backward;
    under sequence parallelism reduce-scatter forward, all-gather backward."""
    return Conjugate.apply(x, group, *((_reduce_scatter, _all_gather) if sequence_parallel else (_all_reduce, None)), 1)


# ------------------------------------------------------------------------------------------------------------
# Layers. Each replaces a gpt.py module and keeps its parameter names; `layouts` says which part of the full
# tensor each local parameter is, for init, checkpoints and the gradient norm.


class Layout(NamedTuple):
    shape: tuple  # of the full tensor
    box: tuple  # this rank holds full[box]: a (start, stop) per dimension
    sharded: bool  # False: every rank of the group holds the same whole tensor


def _box(shape, dims, group):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    return tuple((rank * n // world, (rank + 1) * n // world) if d in dims else (0, n) for d, n in enumerate(shape))


def _shard(tensor, group, dim):
    """An empty parameter for this rank's slice of tensor along dim (init_weights fills it), and its Layout."""
    layout = Layout(tuple(tensor.shape), _box(tensor.shape, [dim], group), True)
    return nn.Parameter(tensor.new_empty([stop - start for start, stop in layout.box])), layout


class ColumnParallelLinear(nn.Module):
    """Y_i = X A_i, output rows split: for q, k and v rank i's heads (rows [h * head_dim, (h + 1) * head_dim) are
    head h). f is not here: it runs once per tensor-parallel region, in a pre-hook, not once for each of q, k, v."""

    def __init__(self, linear, group):
        super().__init__()
        self.bias, self.layouts = None, {}
        for name, param in linear.named_parameters():  # weight [out, in] and bias [out]
            shard, self.layouts[name] = _shard(param, group, 0)
            setattr(self, name, shard)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Y = sum_i X_i A_i, input columns split; g sums the partial products, then adds the replicated bias once."""

    def __init__(self, linear, group, sequence_parallel):
        super().__init__()
        self.group, self.sequence_parallel, self.bias = group, sequence_parallel, linear.bias
        self.weight, layout = _shard(linear.weight, group, 1)
        self.layouts = {"weight": layout}

    def forward(self, x):
        y = g(F.linear(x, self.weight), self.group, self.sequence_parallel)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, stop) of the padded vocabulary: other ids give zeros, and g sums the ranks' rows (under sequence
    parallelism a reduce-scatter: the residual stream starts sharded)."""

    def __init__(self, embedding, group, sequence_parallel):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight, layout = _shard(embedding.weight, group, 0)
        self.layouts = {"weight": layout}
        self.start, self.stop = layout.box[0]

    def forward(self, idx):
        outside = (idx < self.start) | (idx >= self.stop)
        out = F.embedding((idx - self.start).masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0)
        return g(out, self.group, self.sequence_parallel)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of vocabulary-split logits, never gathered: all-reduces of one number per token (max,
    then sum of exponentials and target logit) replace an all-gather of [tokens, vocab]; backward sends nothing."""

    @staticmethod
    def forward(ctx, logits, targets, group):
        logits, vocab = logits.float(), logits.shape[-1]
        start = dist.get_rank(group) * vocab
        logits_max = logits.max(dim=-1).values
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        logits = logits - logits_max.unsqueeze(-1)  # every exponent <= 0: no overflow at any logit size
        outside = (targets < start) | (targets >= start + vocab)
        local_targets = (targets - start).masked_fill(outside, 0)
        target_logits = logits.gather(-1, local_targets.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        softmax = logits.exp_()
        sums = torch.stack([softmax.sum(dim=-1), target_logits])
        dist.all_reduce(sums, group=group)
        softmax /= sums[0].unsqueeze(-1)
        ctx.save_for_backward(softmax, local_targets, outside)
        return sums[0].log() - sums[1]

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_targets, outside = ctx.saved_tensors
        grad = softmax.scatter_add(-1, local_targets.unsqueeze(-1), -(~outside).to(softmax.dtype).unsqueeze(-1))
        return grad * grad_loss.unsqueeze(-1), None, None  # autograd casts it back to the logits' dtype


class Loss(nn.Module):
    """gpt.GPT.loss_fn is a module slot: this fills it with a function of (logits, targets)."""

    def __init__(self, function):
        super().__init__()
        self.function = function

    def forward(self, logits, targets):
        return self.function(logits, targets)


class TensorParallelRNG:
    """Dropout on this rank's heads must differ across ranks, on the replicated residual stream agree: `swap`, a
    pre-hook on the attention and on its output projection, swaps the default generator's state with the region's."""

    def __init__(self, seed):
        self.seed, self.state = seed, None

    def swap(self, module, args):
        current = gpt.rng_state(args[0].device)
        if self.state is None:
            torch.manual_seed(self.seed)
        else:
            gpt.set_rng_state(self.state, args[0].device)
        self.state = current


def check_layout(config, tp, sequence_parallel):
    """Every rank runs this before any collective, so a bad layout fails everywhere instead of hanging."""
    sizes = [("n_head", config.n_head), ("the padded vocabulary", config.padded_vocab_size),
             ("the MLP width", 4 * config.n_embd)]
    for what, n in sizes + [("--block_size", config.block_size)] * sequence_parallel:
        if n % tp:
            fix = "run without --sequence_parallel" if what == "--block_size" else "another --model"
            raise ValueError(f"{what} ({n}) is not divisible by --tp {tp}: choose a --tp that divides it or {fix}")


def parallelize(model, group, sequence_parallel=False, loss_parallel=True, dropout_seed=0):
    """Swap a gpt.GPT's modules for tensor-parallel ones over `group`, in place, on meta before to_empty and
    init_weights. dropout_seed seeds the tensor-parallel region's dropout: different on every rank."""
    model.wte = VocabParallelEmbedding(model.wte, group, sequence_parallel)
    model.lm_head = ColumnParallelLinear(model.lm_head, group)
    model.lm_head.weight = model.wte.weight  # tied: column-parallel over the same vocabulary slice
    if sequence_parallel:  # the token embeddings come out as this rank's sequence shard: so must the positions
        model.wpe.register_forward_pre_hook(lambda module, args: (_split(args[0], group, 0),))
    gather = lambda logits: Conjugate.apply(logits, group, _all_gather, _split, -1)  # noqa: E731
    if loss_parallel:
        model.loss_fn = Loss(lambda logits, targets: VocabParallelCrossEntropy.apply(logits, targets, group).mean())
    else:  # Megatron's parallel_output=False: every rank gathers the whole [tokens, vocab] logits
        model.lm_head.register_forward_hook(lambda module, args, logits: gather(logits))
    regions, rng = [model.lm_head], TensorParallelRNG(dropout_seed)
    for block in model.blocks:
        attn, mlp = block.attn, block.mlp
        attn.query, attn.key, attn.value = (ColumnParallelLinear(m, group) for m in (attn.query, attn.key, attn.value))
        attn.proj = RowParallelLinear(attn.proj, group, sequence_parallel)
        mlp.fc, mlp.proj = ColumnParallelLinear(mlp.fc, group), RowParallelLinear(mlp.proj, group, sequence_parallel)
        regions += [attn, mlp]
        if model.config.dropout:
            attn.register_forward_pre_hook(rng.swap)
            attn.proj.register_forward_pre_hook(rng.swap)
    for module in regions:  # f once where each tensor-parallel region starts: q, k and v share one
        module.register_forward_pre_hook(lambda module, args: (f(args[0], group, sequence_parallel),))
    tp = dist.get_world_size(group)
    return add_sampling_hooks(model, tp if sequence_parallel else 1, gather if loss_parallel else nn.Identity())


def add_sampling_hooks(model, multiple, gather):
    """generate() calls model(idx) without targets, at any length, and wants whole logits: pad the prompt to a
    multiple of the sequence shards (causal: padding never reaches earlier positions), gather, drop the padding."""
    lengths = []

    def pad(module, args, kwargs):
        if len(args) == 1 and kwargs.get("targets") is None:
            lengths.append(args[0].shape[1])
            return (F.pad(args[0], (0, -args[0].shape[1] % multiple)),), kwargs

    model.register_forward_pre_hook(pad, with_kwargs=True)
    model.register_forward_hook(lambda module, args, out: gather(out)[:, :lengths.pop()] if out.dim() == 3 else None)
    return model


@torch.no_grad()  # a DTensor's to_local() is then its shard itself, not a differentiable view of it
def parameter_layouts(model):
    """(gpt.py name, local tensor, Layout) of every parameter, from our layers' `layouts` or a DTensor's placements;
    the tied LM head is listed once, as wte.weight."""
    out = []
    for name, param in model.named_parameters():
        module_name, _, param_name = name.rpartition(".")
        shape, whole = tuple(param.shape), tuple((0, n) for n in param.shape)
        layout = getattr(model.get_submodule(module_name), "layouts", {}).get(param_name, Layout(shape, whole, False))
        if isinstance(param, DTensor):
            dims = [placement.dim for placement in param.placements if placement.is_shard()]
            layout = Layout(shape, _box(shape, dims, param.device_mesh.get_group()), bool(dims))
            param = param.to_local()
        out.append((name, param, layout))
    return out


@torch.no_grad()
def init_weights(layouts, config, seed):
    """Each local parameter is its slice of gpt.initial_value, so the ranks together hold train_single's weights."""
    for name, param, layout in layouts:
        param.copy_(gpt.initial_value(name, layout.shape, config, seed)[tuple(slice(*b) for b in layout.box)])


def allreduce_sequence_parallel_grads(layouts, group):
    """Under sequence parallelism every replicated parameter (layer norms, wpe, row-parallel biases) saw only this
    rank's sequence shard: sum their gradients over the group, in one flat all-reduce."""
    grads = [param.grad for _, param, layout in layouts if not layout.sharded]
    flat = torch.cat([grad.view(-1) for grad in grads])
    dist.all_reduce(flat, group=group)
    for grad, synced in zip(grads, flat.split([grad.numel() for grad in grads])):
        grad.copy_(synced.view_as(grad))


def clip_grad_norm_(layouts, max_norm, group):
    """The full model's norm in one all-reduce, shards summed over the group and replicated parameters counted once
    (by rank 0 of the group); then clipped as torch.nn.utils.clip_grad_norm_ does."""
    counted = [param.grad for _, param, layout in layouts if layout.sharded or dist.get_rank(group) == 0]
    norm_squared = torch.nn.utils.get_total_norm(counted) ** 2
    dist.all_reduce(norm_squared, group=group)
    total_norm = norm_squared.sqrt()
    torch.nn.utils.clip_grads_with_norm_([param for _, param, _ in layouts], max_norm, total_norm)
    return total_norm


# ------------------------------------------------------------------------------------------------------------
# --impl torch: the same layout with PyTorch's DTensor, as the yardstick


class DTensorLossParallel(torch.autograd.Function):
    """loss_parallel() cross-entropy of vocabulary-sharded DTensor logits. Its backward must run under loss_parallel()
    too, and the loop's loss.backward() does not: build the graph on a detached input, backward inside the context."""

    @staticmethod
    def forward(ctx, logits, targets):
        with torch.enable_grad(), dtensor_loss_parallel():
            ctx.logits = logits.detach().requires_grad_()
            ctx.loss = F.cross_entropy(ctx.logits, targets).to_local()
        return ctx.loss.detach()

    @staticmethod
    def backward(ctx, grad):
        with dtensor_loss_parallel():
            ctx.loss.backward(grad)
        return ctx.logits.grad, None


def parallelize_with_dtensor(model, mesh, sequence_parallel, loss_parallel):
    """The same layout from DTensor's parallel styles, as torchtitan writes it."""
    residual = Shard(1) if sequence_parallel else Replicate()
    plan = {"wte": RowwiseParallel(input_layouts=Replicate()),  # nn.Embedding: vocabulary rows; output summed
            "lm_head": ColwiseParallel(input_layouts=residual, use_local_output=not loss_parallel,
                                       output_layouts=Shard(-1) if loss_parallel else Replicate()),
            "blocks.*.attn.query": ColwiseParallel(), "blocks.*.attn.key": ColwiseParallel(),
            "blocks.*.attn.value": ColwiseParallel(), "blocks.*.attn.proj": RowwiseParallel(output_layouts=residual),
            "blocks.*.mlp.fc": ColwiseParallel(), "blocks.*.mlp.proj": RowwiseParallel(output_layouts=residual)}
    if sequence_parallel:  # wpe is added to the whole sequence, then the residual stream is cut into shards
        gather_sequence = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan.update({"drop": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                                use_local_output=True), "ln_f": SequenceParallel(),
                     "blocks.*.ln_1": SequenceParallel(), "blocks.*.ln_2": SequenceParallel(),
                     "blocks.*.attn": gather_sequence, "blocks.*.mlp": gather_sequence})
    parallelize_module(model, mesh, plan)
    model.lm_head.weight = model.wte.weight  # each style distributed its own copy of the tied weight
    if loss_parallel:
        model.loss_fn = Loss(DTensorLossParallel.apply)
    whole = lambda logits: logits.full_tensor() if isinstance(logits, DTensor) else logits  # noqa: E731
    return add_sampling_hooks(model, mesh.size() if sequence_parallel else 1, whole)


def clip_grad_norm_dtensor_(parameters, max_norm):
    """torch.nn.utils.clip_grad_norm_ refuses parameters on different meshes (DTensors and plain tensors here, 2-D and
    data-parallel-only meshes in train_2d.py): one total norm over the full tensors, then each mesh clipped apart."""
    parameters = list(parameters)
    norms = [torch.linalg.vector_norm(param.grad) for param in parameters]
    total_norm = torch.linalg.vector_norm(torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]))
    for mesh in {getattr(param, "device_mesh", None) for param in parameters}:
        same = [param for param in parameters if getattr(param, "device_mesh", None) == mesh]
        torch.nn.utils.clip_grads_with_norm_(same, max_norm, total_norm)
    return total_norm


@torch.no_grad()
def local_view(optimizer):
    """AdamW's state as gpt.checkpoint_tensors reads it, keyed and valued by local tensors (a DTensor's shard)."""
    local = lambda tensor: tensor.to_local() if isinstance(tensor, DTensor) else tensor  # noqa: E731
    return SimpleNamespace(state={local(p): {k: local(v) for k, v in s.items()} for p, s in optimizer.state.items()})


@record  # under torchrun, the error file names the failing rank with its traceback
def main(argv=None):
    parser = gpt.get_parser(__doc__)
    parser.add_argument("--impl", default="ours", choices=["ours", "torch"], help="torch: DTensor parallelize_module")
    parser.add_argument("--tp", type=int, default=None, help="tensor-parallel size (here it must be the world size)")
    parser.add_argument("--sequence_parallel", action="store_true", help="layer norms and dropout on sequence shards")
    parser.add_argument("--no_loss_parallel", action="store_true", help="gather the whole logits before the loss")
    args = parser.parse_args(argv)

    # ---- process groups: every rank is one tensor-parallel rank; they all read the same rows
    owns_group = not dist.is_initialized()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = gpt.get_device(args.device, local_rank)
    launched_world = int(os.environ.get("WORLD_SIZE", 1))
    tp = args.tp or launched_world
    if tp != launched_world:
        raise ValueError(f"--tp {tp} with {launched_world} ranks: train_tp.py is tensor-parallel only, so --tp must be "
                         "the world size; use train_2d.py to combine it with data parallelism")
    dp_rank, dp_size = 0, 1

    # ---- data: every check of the arguments happens here, before any collective
    meta = gpt.ensure_data(args.data, is_writer=local_rank == 0)
    micro_batch = args.micro_batch or args.global_batch // dp_size
    train_data, val_data = (gpt.BatchSampler(os.path.join(args.data, f"{split}.bin"), args.block_size, args.global_batch,
                                             micro_batch, dp_rank, dp_size, args.seed, device) for split in ("train", "val"))
    config = gpt.make_config(args.model, meta["vocab_size"], args.block_size, args.dropout)
    check_layout(config, tp, args.sequence_parallel)
    if args.resume and args.impl == "torch":
        raise SystemExit("--resume is implemented for --impl ours only (any layout resumes its checkpoints)")
    checkpoint_path = gpt.latest_checkpoint(args.out_dir)
    if checkpoint_path and not args.resume:
        raise SystemExit(f"{args.out_dir!r} already holds {checkpoint_path!r}: pass --resume to continue it, "
                         "or choose another --out_dir")

    if owns_group:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=args.timeout))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    fingerprints = [None] * world_size
    dist.all_gather_object(fingerprints, gpt.fingerprint(args, __file__))
    gpt.check_fingerprints(fingerprints)
    if world_size != tp:  # the layout checks above took the size from the environment
        raise RuntimeError(f"WORLD_SIZE = {tp} but the process group has {world_size} ranks")
    master = rank == 0
    prefix = f"[rank {rank}] " if args.log_all_ranks else ""
    torch.manual_seed(args.seed + dp_rank)  # dropout outside the tensor-parallel region: the same on every tp rank

    # ---- model: built on meta, parallelised there, materialised on the device, each slice initialised by name
    with torch.device("meta"):
        model = gpt.GPT(config)
    if args.impl == "ours":  # the last argument seeds dropout on this rank's heads
        parallelize(model, dist.group.WORLD, args.sequence_parallel, not args.no_loss_parallel,
                    args.seed + world_size + rank)
    else:
        parallelize_with_dtensor(model, init_device_mesh(device.type, (tp,)), args.sequence_parallel,
                                 not args.no_loss_parallel)
    model.to_empty(device=device)
    model.lm_head.weight = model.wte.weight  # to_empty() gives each module its own tensor: tie them again
    layouts = parameter_layouts(model)
    init_weights(layouts, config, args.seed)
    gpt.set_attention(model, args.attn, device, getattr(torch, args.dtype))

    # ---- strategy: sharded matrices, replicated norms and biases; replicated tensors are saved by rank 0 only
    slots = [gpt.Slot(name, layout.shape, layout.box, (0, local.numel()), local) for name, local, layout in layouts]
    own_slots = [slot for slot, (_, _, layout) in zip(slots, layouts) if layout.sharded or master]
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = gpt.make_optimizer(decay, no_decay, args, device)
    forward = torch.compile(model) if args.compile else model
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bfloat16" else nullcontext()

    start_step = 0
    if args.resume and checkpoint_path:
        checkpoint = gpt.Checkpoint(checkpoint_path)
        gpt.load_checkpoint(checkpoint, slots, optimizer, config)
        gpt.set_rng_state(checkpoint.rng_state(rank), device)
        start_step = checkpoint.meta["step"]
    logger = gpt.MetricsLogger(args, enabled=master)
    full_sizes = {name: math.prod(layout.shape) for name, _, layout in layouts}
    flops_per_token = gpt.flops_per_token(config, sum(full_sizes.values()) - full_sizes["wpe.weight"])
    peak_flops = gpt.peak_flops(device)
    if master or args.log_all_ranks:
        modes = [args.impl] + ["sequence parallel"] * args.sequence_parallel
        modes += ["loss parallel"] * (not args.no_loss_parallel)
        print(f"{prefix}{args.model}: {sum(full_sizes.values()) / 1e6:.2f}M parameters | {world_size} ranks on {device} | "
              f"tensor parallel {tp} ({', '.join(modes)}) | "
              f"global batch {args.global_batch} = micro batch {micro_batch} x {train_data.accumulation} accumulation "
              f"x {dp_size} data-parallel | {'resuming at step ' + str(start_step) if start_step else 'from scratch'}")

    # ---- loop
    for step in range(start_step, args.max_steps):
        last_step = step + 1 == args.max_steps
        val_loss = None
        if args.eval_interval and (step % args.eval_interval == 0 or last_step):
            val_loss = gpt.estimate_loss(forward, val_data, args.eval_iters, autocast).item()
        t0 = time.perf_counter()
        lr = gpt.get_lr(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=device)
        for micro_step in range(train_data.accumulation):
            x, y = train_data.get(step, micro_step)
            with autocast:
                loss = forward(x, y) / train_data.accumulation  # gradient of the mean over the global batch
            loss.backward()
            loss_sum += loss.detach()  # the whole batch's loss on every tp rank: no reduction needed
        if args.impl == "ours":
            if args.sequence_parallel:
                allreduce_sequence_parallel_grads(layouts, dist.group.WORLD)
            grad_norm = clip_grad_norm_(layouts, args.grad_clip or float("inf"), dist.group.WORLD)
        else:
            grad_norm = clip_grad_norm_dtensor_(model.parameters(), args.grad_clip or float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if step % args.log_interval == 0 or last_step or val_loss is not None:
            loss_value = loss_sum.item()  # waits for the device: the step time below is real
            step_s = time.perf_counter() - t0
            tokens_per_s = args.global_batch * args.block_size / step_s
            metrics = {"step": step, "loss": loss_value, "lr": lr, "grad_norm": grad_norm.item(),
                      "tokens_per_s": tokens_per_s,
                      "mfu": flops_per_token * tokens_per_s / (world_size * peak_flops) if peak_flops else None,
                      "peak_mem_mb": gpt.peak_memory_mb(device), "step_ms": 1000 * step_s}
            if val_loss is not None:
                metrics["val_loss"] = val_loss
            logger.log(metrics)
            if master or args.log_all_ranks:
                print(prefix + gpt.format_log(metrics) + (f" | val loss {val_loss:.4f}" if val_loss is not None else ""))

        # ---- checkpoint: every rank its slices, rank 0 the replicated tensors
        if (args.ckpt_interval and (step + 1) % args.ckpt_interval == 0) or last_step:
            gpt.save_shard(args.out_dir, step + 1, rank, gpt.checkpoint_tensors(own_slots, local_view(optimizer)),
                           gpt.rng_state(device))
            dist.barrier()
            if master:
                gpt.publish_checkpoint(args.out_dir, step + 1, world_size, {"config": asdict(config), "args": vars(args)})
            dist.barrier()

    if args.sample_tokens:  # every rank takes part in the forward passes; the seeded sampler draws the same tokens
        tokenizer = get_tokenizer(meta["tokenizer"])
        prompt = torch.tensor([tokenizer.encode("\n")], device=device)
        with autocast:
            out = gpt.generate(model, prompt, args.sample_tokens, config.block_size, seed=args.seed)
        if master:
            print("sample:\n" + tokenizer.decode(out[0].tolist()))
    if owns_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
