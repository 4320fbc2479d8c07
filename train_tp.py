"""
Megatron tensor parallelism by hand: every rank holds a slice of every matrix and runs attention on its own heads.

    torchrun --standalone --nproc_per_node=2 train_tp.py                        # --tp defaults to the world size
    torchrun --standalone --nproc_per_node=4 train_tp.py --sequence_parallel
    torchrun --standalone --nproc_per_node=2 train_tp.py --impl torch            # DTensor's parallelize_module

Reads top to bottom: arguments -> process groups -> model -> strategy -> loop -> checkpoint.
"""

import time
from contextlib import nullcontext
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import gpt

all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)  # the name before torch 2.13
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


# Megatron-LM's mappings: a collective in forward, its conjugate in backward. Activations are gpt.py's [batch,
# sequence, hidden]; sequence parallelism splits dim 1, so its collectives copy to or from rank-after-rank order.
def _all_gather(x, dim, group):  # every rank's x, concatenated along dim
    gathered = x.new_empty(dist.get_world_size(group) * x.shape[0], *x.shape[1:])  # rank after rank
    all_gather_single(gathered, x.contiguous(), group=group)
    return torch.cat(gathered.chunk(dist.get_world_size(group)), dim)


def _reduce_scatter(x, dim, group):  # this rank's chunk, along dim, of the sum of every rank's x
    world = dist.get_world_size(group)
    chunks = torch.cat(x.chunk(world, dim))  # chunk i where the collective looks for rank i's
    out = chunks.new_empty(len(chunks) // world, *chunks.shape[1:])
    reduce_scatter_single(out, chunks, group=group)
    return out


class CopyToTensorParallelRegion(torch.autograd.Function):
    """f: every rank reads the whole input, and each slice adds a part of its gradient: backward sums them."""
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        dist.all_reduce(grad, group=ctx.group)  # in place: the gradient is a fresh matmul product
        return grad, None


class ReduceFromTensorParallelRegion(torch.autograd.Function):
    """g: forward sums the ranks' partial products; every rank passes the same gradient back."""
    @staticmethod
    def forward(ctx, x, group):
        dist.all_reduce(x, group=group)  # in place: x is a fresh product (a matmul's, the embedding's lookup)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromSequenceParallelRegion(torch.autograd.Function):
    """f under sequence parallelism: gather the sequence shards; backward sums the gradients into them."""
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, 1, ctx.group), None


class ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """g under sequence parallelism: sum the partial products, keep this rank's sequence shard; backward gathers."""
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, 1, ctx.group), None


class GatherFromTensorParallelRegion(torch.autograd.Function):
    """The whole logits from the ranks' vocabulary slices (sampling, --no_loss_parallel); backward keeps the slice."""
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(dist.get_world_size(ctx.group), -1)[dist.get_rank(ctx.group)].contiguous(), None


def compute_dtype(x):
    """What the next matmul reads x in, autocast's or x's: f sends x in it, its conjugate x's gradient."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


# Eager under --compile: traced, sequence parallelism's collectives gave wrong losses on an H200 (10.5% by step 4).
@torch.compiler.disable
def f(x, group, sequence_parallel):
    """Megatron's f, where a tensor-parallel region starts: copy the input in, or gather its sequence shards."""
    region = GatherFromSequenceParallelRegion if sequence_parallel else CopyToTensorParallelRegion
    return region.apply(x.to(compute_dtype(x)), group)


@torch.compiler.disable
def g(x, group, sequence_parallel):
    """Megatron's g, f's conjugate, where the region ends: sum the partial products, or reduce-scatter them, in x's
    dtype: a matmul's output is autocast's already, and the embedding's stays float32, the residual stream's dtype
    in train_single.py (its sum is exact: one rank holds each row)."""
    region = ReduceScatterToSequenceParallelRegion if sequence_parallel else ReduceFromTensorParallelRegion
    return region.apply(x, group)


# Layers. Each replaces a gpt.py module and keeps its parameter names; `boxes` says where each sliced parameter
# lies in the full tensor, as (full shape, box), for init, checkpoints and the gradient norm.
def _shard(layer, name, tensor, group, dim):
    """Give layer an empty parameter `name` for this rank's slice of tensor along dim; return [start, stop) on dim."""
    size = tensor.shape[dim] // dist.get_world_size(group)  # main() has checked that it divides
    start = dist.get_rank(group) * size
    box = [(0, n) for n in tensor.shape]
    box[dim] = (start, start + size)
    setattr(layer, name, nn.Parameter(torch.empty_like(tensor.narrow(dim, start, size))))
    layer.boxes[name] = (tensor.shape, box)
    return box[dim]


class ColumnParallelLinear(nn.Module):
    """Y_i = f(X) A_i: output features split, rank i holding rows i of A (for q, k and v: its own heads). Layers that
    read one input (q, k and v; gate and fc) share their region's one f instead: starts_region=False."""
    def __init__(self, linear, group, sequence_parallel, starts_region=True):
        super().__init__()
        self.group, self.sequence_parallel, self.starts_region = group, sequence_parallel, starts_region
        self.bias, self.boxes = None, {}
        for name, param in linear.named_parameters():  # weight [out, in] and bias [out]
            _shard(self, name, param, group, 0)

    def forward(self, x):
        if self.starts_region:
            x = f(x, self.group, self.sequence_parallel)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Y = g(sum_i X_i A_i) + b: input features split; g ends the region, then the replicated bias is added once."""
    def __init__(self, linear, group, sequence_parallel):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.bias, self.boxes = linear.bias, {}
        _shard(self, "weight", linear.weight, group, 1)

    def forward(self, x):
        y = g(F.linear(x, self.weight), self.group, self.sequence_parallel)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, stop) of the padded vocabulary: other ids look up zeros, and g sums the ranks' rows (under
    sequence parallelism it reduce-scatters them: the residual stream starts sharded)."""
    def __init__(self, embedding, group, sequence_parallel):
        super().__init__()
        self.group, self.sequence_parallel, self.boxes = group, sequence_parallel, {}
        self.start, self.stop = _shard(self, "weight", embedding.weight, group, 0)

    def forward(self, idx):
        outside = (idx < self.start) | (idx >= self.stop)
        out = F.embedding((idx - self.start).masked_fill(outside, 0), self.weight)
        return g(out.masked_fill(outside.unsqueeze(-1), 0), self.group, self.sequence_parallel)


class SequenceParallelPositions(nn.Module):
    """GPT-2's position table, whole, looked up at this rank's sequence shard of the positions (its token shard's)."""
    def __init__(self, embedding, group):
        super().__init__()
        self.weight, self.rank, self.world = embedding.weight, dist.get_rank(group), dist.get_world_size(group)

    def forward(self, pos):
        return F.embedding(pos.chunk(self.world)[self.rank], self.weight)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of vocabulary-split logits: 3 numbers a token all-reduced, not [tokens, vocab]."""
    @staticmethod
    def forward(ctx, logits, targets, group, vocab_size):
        vocab = logits.shape[-1]
        start = dist.get_rank(group) * vocab
        padding = torch.arange(start, start + vocab, device=logits.device) >= vocab_size  # classes that are no tokens
        logits = logits.float().masked_fill(padding, -float("inf"))  # a copy: no probability, no gradient
        logits_max = logits.amax(-1, keepdim=True)
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        logits -= logits_max  # every exponent <= 0: no overflow at any logit size
        outside = (targets < start) | (targets >= start + vocab)
        local_targets = (targets - start).masked_fill(outside, 0).unsqueeze(-1)
        target_logits = logits.gather(-1, local_targets).squeeze(-1).masked_fill(outside, 0.0)
        softmax = logits.exp_()
        sums = torch.stack([softmax.sum(-1), target_logits])  # one all-reduce for both
        dist.all_reduce(sums, group=group)
        softmax /= sums[0].unsqueeze(-1)
        ctx.save_for_backward(softmax, local_targets, outside)
        return sums[0].log() - sums[1]

    @staticmethod
    def backward(ctx, grad_loss):
        # Megatron-LM's: in place in the saved softmax, no new [tokens, vocab / tp] (a second backward would raise)
        grad, local_targets, outside = ctx.saved_tensors
        grad.scatter_add_(-1, local_targets, -(~outside).to(grad.dtype).unsqueeze(-1))
        return grad.mul_(grad_loss.unsqueeze(-1)), None, None, None  # autograd casts it back to the logits' dtype


class SlicedDropout(nn.Dropout):
    """Dropout on this rank's slice (along `dim`: its heads, its sequence shard) of a tensor split over the group:
    it draws the whole mask as one device would (TP peers hold the same generators) and keeps its slice."""
    def __init__(self, p, group, dim):
        super().__init__(p)
        self.dim, self.rank, self.world = dim, dist.get_rank(group), dist.get_world_size(group)

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        size = x.shape[self.dim]
        whole = [n * self.world if d == self.dim else n for d, n in enumerate(x.shape)]
        mask = F.dropout(torch.ones(whole, dtype=x.dtype, device=x.device), self.p)  # 0 or 1 / (1 - p)
        keep = mask.narrow(self.dim, self.rank * size, size) != 0  # a bool copy: the whole mask is freed here
        return x * keep / (1 - self.p)


# What parallelize() splits in each block, by gpt.py's names: column-parallel linears by output rows, weight and bias
# (a rank's query heads, and its key/value heads alike), row-parallel ones by input columns. wte, lm_head: vocab rows.
COLUMN_PARALLEL = ("attn.query", "attn.key", "attn.value", "mlp.gate", "mlp.fc")
ROW_PARALLEL = ("attn.proj", "mlp.proj")


def is_sliced(name):
    """Whether tensor parallelism splits parameter `name` (gpt.py's, any prefix) over the ranks, or replicates it."""
    module, _, kind = name.rpartition(".")  # blocks.3.attn.query.bias -> blocks.3.attn.query, bias
    vocabulary = name.endswith(("wte.weight", "lm_head.weight"))
    return vocabulary or module.endswith(COLUMN_PARALLEL) or (module.endswith(ROW_PARALLEL) and kind == "weight")


def parallelize(model, group, sequence_parallel=False, loss_parallel=True):
    """Swap a gpt.GPT's modules for tensor-parallel ones over `group`, in place (on meta, before to_empty); return
    the function that gathers whole logits from the vocabulary slices (for sampling: training.sampling_hooks)."""
    model.wte = VocabParallelEmbedding(model.wte, group, sequence_parallel)
    model.lm_head = ColumnParallelLinear(model.lm_head, group, sequence_parallel)  # the same vocabulary rows as wte's
    model.tie_weights()  # tied: the LM head's weight is wte's slice
    if sequence_parallel and model.wpe is not None:
        model.wpe = SequenceParallelPositions(model.wpe, group)
    for block in model.blocks:
        for name, module in list(block.named_modules()):  # GPT-2's MLP has no gate
            if name in COLUMN_PARALLEL:
                block.set_submodule(name, ColumnParallelLinear(module, group, sequence_parallel, starts_region=False))
            if name in ROW_PARALLEL:
                block.set_submodule(name, RowParallelLinear(module, group, sequence_parallel))
        for region in (block.attn, block.mlp):  # hooked: gpt.py's attention and MLP call q, k, v (gate, fc) themselves
            region.register_forward_pre_hook(lambda module, args: (f(args[0], group, sequence_parallel), *args[1:]))
        block.attn.attn_dropout = SlicedDropout(model.config.dropout, group, dim=1)  # of this rank's heads
    for name, module in list(model.named_modules()):  # the residual stream's dropouts: on this rank's shard
        if sequence_parallel and type(module) is nn.Dropout:
            model.set_submodule(name, SlicedDropout(model.config.dropout, group, dim=1))
    gather = lambda logits: GatherFromTensorParallelRegion.apply(logits, group)  # noqa: E731 (the whole logits)
    if loss_parallel:
        model.loss_fn = lambda logits, targets: VocabParallelCrossEntropy.apply(
            logits, targets, group, model.config.vocab_size).mean()
    else:  # Megatron's parallel_output=False: every rank gathers the whole [tokens, vocab] logits
        model.loss_fn = lambda logits, targets: gpt.cross_entropy(gather(logits), targets, model.config.vocab_size)
    return gather


def allreduce_replicated_grads(gradients, group, device):
    """Under sequence parallelism a replicated parameter (norms, wpe, row-parallel biases) saw only this rank's sequence
    shard: sum their (name, gradient)s in one flat all-reduce (train_2d/4d.py: FSDP shards, alike on TP peers)."""
    grads = [grad.view(-1) for name, grad in gradients if not is_sliced(name)]
    if grads:
        flat = torch.cat(grads).to(device)  # NCCL reduces device memory only
        dist.all_reduce(flat, group=group)
        torch._foreach_copy_(grads, flat.to(grads[0].device).split([len(grad) for grad in grads]))


def clip_grad_norm_(named_parameters, tp_group, device, max_norm):
    """The full model's gradient norm, each element counted once: slices on their own rank, replicated parameters
    on TP rank 0 only (in train_2d.py each is also an FSDP piece, disjoint across data-parallel ranks)."""
    first = dist.get_rank(tp_group) == 0
    grads = [param.grad for name, param in named_parameters if is_sliced(name) or first]
    total = torch.nn.utils.get_total_norm(grads, foreach=True).to(device) ** 2  # one kernel a device and dtype
    dist.all_reduce(total)  # over every rank: in train_2d.py the data-parallel pieces are disjoint too
    norm = total.sqrt()
    torch.nn.utils.clip_grads_with_norm_([param for _, param in named_parameters], max_norm, norm)
    return norm


def main(argv=None):
    import checkpoint  # main() is where a script meets the shared files; everything above needs torch and gpt.py
    import training

    parser = training.get_parser(__doc__, "tp")
    parser.add_argument("--impl", default="ours", choices=["ours", "torch"], help="torch: DTensor parallelize_module")
    parser.add_argument("--tp", type=training.positive_int, help="tensor-parallel size: the world size (default)")
    parser.add_argument("--sequence_parallel", action="store_true", help="layer norms and dropout on sequence shards")
    parser.add_argument("--no_loss_parallel", action="store_true", help="gather the whole logits before the loss")
    args = training.parse(parser, argv)

    # ---- process groups: every rank is one tensor-parallel rank; they all read the same rows
    rank, local_rank, world_size = training.launched_rank(args)
    dp_rank, dp_size = 0, 1
    if args.tp not in (None, world_size):
        raise training.UsageError(f"--tp {args.tp} with {world_size} ranks: train_tp.py is tensor-parallel only, so "
                                  "--tp must be the world size; use train_2d.py to combine it with data parallelism")
    if args.plan:  # the memory one rank needs in this layout, and nothing else: no device, data or model
        import plan
        return plan.print_plan(args, world_size, dp_size, sliced=is_sliced)
    device = training.get_device(args, local_rank)

    # ---- data: every check of the arguments happens here, on every rank alike, before the first collective
    meta, config, train_data, val_data = training.load_data(args, dp_rank, dp_size, device, is_writer=local_rank == 0)
    training.check_tensor_parallel(config, world_size, args.sequence_parallel)
    checkpoint_path = checkpoint.to_resume(args)
    rank, world_size, owns_group = training.init_distributed(args, device)
    torch.manual_seed(args.seed + dp_rank)  # dropout: the same generators on every tp rank, so the same masks

    # ---- model: built on meta, parallelised there, materialised on the device, each slice initialised by name
    with torch.device("meta"):
        model = gpt.GPT(config)
    if args.impl == "torch":
        import torch_reference
        model, groups, clip_grad_norm = torch_reference.tensor_parallel(model, config, args, device)
        parts = None  # its checkpoints gather each tensor whole
    else:
        gather = parallelize(model, dist.group.WORLD, args.sequence_parallel, not args.no_loss_parallel)
        training.sampling_hooks(model, world_size if args.sequence_parallel else 1, gather)
        model.to_empty(device=device)
        model.tie_weights()  # to_empty() gives each module its own tensor: tie them again
        parts = checkpoint.parameter_parts(model)
        value = training.initial_values(config, args.seed, args.init_from)  # drawn by name, or read from --init_from
        for part in parts:  # each rank reads its own slices only: together the ranks hold train_single's weights
            part.local().copy_(value(part.name, part.shape, part.box, part.flat))
        groups = training.decay_groups(model.parameters())
        clip_grad_norm = partial(clip_grad_norm_, list(model.named_parameters()), dist.group.WORLD, device)
    gpt.set_attention(model, args.attn)

    # ---- strategy: sharded matrices, replicated norms and biases; replicated tensors are saved by rank 0 only
    optimizer = training.make_optimizer(groups, args, device)
    forward = training.wrap_blocks(model, args.compile, args.activation_checkpointing)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bfloat16" else nullcontext()

    start_step = checkpoint.resume(checkpoint_path, parts, optimizer, config, rank, device, tp=world_size)
    logger = training.Logger(args, config, device, rank, world_size)
    modes = f"--impl {args.impl}, sequence_parallel={args.sequence_parallel}, loss_parallel={not args.no_loss_parallel}"
    logger.start(train_data, dp_size, start_step, layout=f"tensor parallel {world_size} ({modes}) | ")

    # ---- loop
    stop_request = training.StopRequest()  # SIGTERM or SIGUSR1: stop after the step, saved
    for step in range(start_step, args.max_steps):
        val_loss = training.evaluate(step, args, forward, val_data, autocast)
        t0 = time.perf_counter()
        lr = training.set_lr(optimizer, step, args)
        loss_sum = torch.zeros((), device=device)
        for micro_step in range(train_data.accumulation):
            x, y = train_data.get(step, micro_step)
            with autocast:
                loss = forward(x, y) / train_data.accumulation  # gradient of the mean over the global batch
            loss.backward()
            loss_sum += loss.detach()  # the whole batch's loss on every tp rank: no reduction needed
        if args.sequence_parallel and parts is not None:
            allreduce_replicated_grads([(n, p.grad) for n, p in model.named_parameters()], dist.group.WORLD, device)
        grad_norm = clip_grad_norm(args.grad_clip or float("inf"))
        diverged, stopping = stop_request.agreed(grad_norm, model)  # one read of the device, alike on every rank
        checkpoint.check_finite(diverged, step, loss_sum, grad_norm, args)  # a diverged step changes nothing
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if logger.due(step, val_loss):
            logger.log_step(step, loss_sum, lr, grad_norm, t0, val_loss, stop_request.expert_load)

        # ---- checkpoint: every rank its slices, rank 0 the replicated tensors
        if checkpoint.due(step, args) or stopping:
            tensors = (torch_reference.full_tensors(model, optimizer, rank == 0) if parts is None else
                       checkpoint.pieces([part for part in parts if part.sliced or rank == 0], optimizer))
            checkpoint.save(args, step + 1, tensors, config, device, rank, world_size, tp=world_size)
        if stopping:
            stop_request.stop(step + 1, args.out_dir)

    training.sample(model, meta, args, device, autocast, show=rank == 0)  # every rank: each forward needs them all
    if owns_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    import training
    training.run(main)
