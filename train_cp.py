r"""
Context parallel, by hand: the sequence is split over --cp ranks for the whole model. Each rank holds the whole model
and 2 of the 2·cp chunks of every sequence (head and tail: rank i holds chunks i and 2·cp-1-i, so that under the
causal mask every rank does the same attention work), each token at its global position. Only attention mixes
positions: it reaches the other ranks' keys and values by an all-gather (--cp_impl allgather, as Llama 3 was trained)
or by passing them around a ring (--cp_impl ring, ring attention). Composed with data parallel over --dp.

    torchrun --standalone --nproc_per_node=2 train_cp.py --cp 2                      # tiny model, default corpus
    torchrun --standalone --nproc_per_node=4 train_cp.py --cp 2 --dp 2 --cp_impl ring
    torchrun --standalone --nproc_per_node=2 train_cp.py --cp 2 --impl torch        # torch's context_parallel (CUDA)
    torchrun --nproc_per_node=8 train_cp.py --cp 8 --model llama3.2-1b --data data/openwebtext --block_size 16384 \
        --dtype bfloat16 --activation_checkpointing

Ranks [k·cp, (k+1)·cp) form a context-parallel group: its collectives run in every layer, so they stay inside a node.
Reads top to bottom: arguments -> process groups -> model -> strategy -> loop -> checkpoint.
"""

import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

import gpt
import train_ddp

all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)  # the name before torch 2.13
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def chunks(rank, cp):
    """The two chunks of every sequence that rank holds, of 2·cp: one from the head, one from the tail."""
    return rank, 2 * cp - 1 - rank


def chunk_positions(rank, cp, chunk_len, device=None):
    """The global positions of the tokens rank holds, its two chunks one after the other."""
    return torch.cat([torch.arange(c * chunk_len, (c + 1) * chunk_len, device=device) for c in chunks(rank, cp)])


class GatherSequence(torch.autograd.Function):
    """All-gather every rank's keys and values along the group; backward reduce-scatters (sums) their gradients, since
    every rank's queries read every rank's keys."""

    @staticmethod
    def forward(ctx, kv, group):
        ctx.group = group
        gathered = kv.new_empty(dist.get_world_size(group) * kv.numel())
        all_gather_single(gathered, kv.contiguous().view(-1), group=group)
        return gathered.view(-1, *kv.shape)

    @staticmethod
    def backward(ctx, grad):
        summed = grad.new_empty(grad.shape[1:])
        reduce_scatter_single(summed.view(-1), grad.contiguous().view(-1), group=ctx.group)
        return summed, None


def allgather_attention(q, k, v, group):
    """Llama 3's: the local queries over every rank's keys and values (only the KV heads travel), put back in position
    order. Each of this rank's two query chunks then attends to the keys up to its own end, causal from the bottom
    right (torch's causal_lower_right: no mask tensor, so CUDA's flash and memory-efficient kernels take it; on CPU
    torch builds the [chunk, keys] mask itself). Head chunk i reads (i+1) chunks of keys, tail chunk 2·cp-1-i reads
    2·cp-i: 2·cp+1 on every rank."""
    rank, cp, chunk_len = dist.get_rank(group), dist.get_world_size(group), q.shape[1] // 2
    kv = GatherSequence.apply(torch.stack([k, v]), group)  # [cp, 2, B, 2 x chunk_len, n_kv_head, head_dim]
    kv = kv.unflatten(3, (2, chunk_len))  # rank r's two chunks: r and 2·cp-1-r
    kv = torch.cat([kv[:, :, :, 0], kv[:, :, :, 1].flip(0)])  # [2·cp chunks in position order, 2, B, chunk_len, ...]
    k, v = kv.permute(1, 2, 4, 0, 3, 5).flatten(3, 4)  # [B, n_kv_head, 2·cp·chunk_len, head_dim]
    q = q.transpose(1, 2)
    outputs = []
    for half, chunk in zip((slice(0, chunk_len), slice(chunk_len, 2 * chunk_len)), chunks(rank, cp)):
        keys = (chunk + 1) * chunk_len
        outputs.append(F.scaled_dot_product_attention(q[:, :, half], k[:, :, :keys], v[:, :, :keys],
                                                      attn_mask=causal_lower_right(chunk_len, keys),
                                                      enable_gqa=k.shape[1] != q.shape[1]))
    return torch.cat(outputs, 2).transpose(1, 2)


def ring_exchange(tensor, group):
    """Start sending tensor to the next rank of the ring and receiving the previous rank's: (received, works)."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    received = torch.empty_like(tensor)
    works = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, tensor, dist.get_global_rank(group, (rank + 1) % cp), group),
        dist.P2POp(dist.irecv, received, dist.get_global_rank(group, (rank - 1) % cp), group)])
    return received, works


def wait(works):
    for work in works:
        work.wait()


def chunk_pairs(rank, source, cp, chunk_len):
    """(query slice, key slice, on the diagonal) of every pair of rank's chunks and source's that the causal mask does
    not wholly hide: a key chunk after the query chunk is skipped, one before it is seen whole."""
    halves = [slice(0, chunk_len), slice(chunk_len, 2 * chunk_len)]
    return [(halves[i], halves[j], a == b) for i, a in enumerate(chunks(rank, cp))
            for j, b in enumerate(chunks(source, cp)) if b <= a]


def block_attention(q, k, v, diagonal):
    """Softmax attention of one query chunk over one key chunk: (output, log-sum-exp of each query's scores), both
    float32. q [B, n_kv_head, group, L, head_dim], k and v [B, n_kv_head, 1, L, head_dim]. On CUDA a fused kernel;
    elsewhere explicit matmuls, the reference the tests hold the ring to."""
    if q.is_cuda:
        return fused_block_attention(q, k, v, diagonal)
    scores = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
    if diagonal:
        scores = scores + torch.full(scores.shape[-2:], -torch.inf, device=q.device).triu(1)
    lse = scores.logsumexp(-1)
    return ((scores - lse[..., None]).exp().to(v.dtype) @ v).float(), lse


def block_attention_backward(q, k, v, grad_out, out, lse, delta, diagonal):
    """The gradients (float32) of one block for the whole softmax: its probabilities from the final log-sum-exp, and
    delta, each query's sum of dO·O over the final output out."""
    if q.is_cuda:
        return fused_block_attention_backward(q, k, v, grad_out, out, lse, diagonal)
    scale = q.shape[-1] ** -0.5
    scores = (q @ k.transpose(-1, -2)).float() * scale
    if diagonal:
        scores = scores + torch.full(scores.shape[-2:], -torch.inf, device=q.device).triu(1)
    probs = (scores - lse[..., None]).exp()
    grad_v = (probs.to(grad_out.dtype).transpose(-1, -2) @ grad_out).sum(2, keepdim=True)  # over a KV head's queries
    grad_scores = probs * ((grad_out @ v.transpose(-1, -2)).float() - delta[..., None]) * scale
    grad_q = grad_scores.to(k.dtype) @ k
    grad_k = (grad_scores.to(q.dtype).transpose(-1, -2) @ q).sum(2, keepdim=True)
    return grad_q.float(), grad_k.float(), grad_v.float()


# CUDA's memory-efficient attention kernel (any float dtype; it returns the log-sum-exp, padded to 32 queries) on one
# block, as torch's context_parallel calls it. k and v are expanded to every query head: the kernel shares none.
# Backward runs it in float32: given the ring's final output in bfloat16, its dQ and dK were wrong on an H200 (2.05
# relative to float32 SDPA's, dV right: its own delta = rowsum(dO·O) seemingly reads O in the forward's memory
# layout), in float32 all three within 2.1e-7 (torch 2.11).
LSE_ALIGNMENT = 32


def fused_block_attention(q, k, v, diagonal):
    group, length = q.shape[2], q.shape[-2]
    q, k, v = (t.expand(-1, -1, group, -1, -1).flatten(1, 2).contiguous() for t in (q, k, v))  # [B, n_head, L, hd]
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, diagonal)
    return out.unflatten(1, (-1, group)).float(), lse[..., :length].unflatten(1, (-1, group))


def fused_block_attention_backward(q, k, v, grad_out, out, lse, diagonal):
    group, length = q.shape[2], q.shape[-2]
    q, k, v = (t.expand(-1, -1, group, -1, -1).flatten(1, 2).float().contiguous() for t in (q, k, v))
    grad_out, out = (t.flatten(1, 2).float().contiguous() for t in (grad_out, out))  # out: the ring's, float32
    lse = F.pad(lse.flatten(1, 2), (0, -(-length // LSE_ALIGNMENT) * LSE_ALIGNMENT - length))  # the kernel's layout
    unused = torch.zeros((), dtype=torch.int64)  # the dropout generator's seed and offset: no dropout here
    grad_q, grad_k, grad_v, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad_out, q, k, v, None, out, lse, unused, unused, 0.0, [True, True, True, False], diagonal)
    grad_k, grad_v = (t.unflatten(1, (-1, group)).sum(2, keepdim=True) for t in (grad_k, grad_v))
    return grad_q.unflatten(1, (-1, group)).float(), grad_k.float(), grad_v.float()


class RingAttention(torch.autograd.Function):
    """Ring attention: at step s each rank attends to the keys and values of rank - s while sending them on to rank +
    1 (batch_isend_irecv, overlapping the block's compute); the partial outputs merge by their log-sum-exp. Backward
    passes the keys and values around again, and each block's dK/dV partial sums travel with it back to its owner, in
    float32. q, k and v are [B, n_kv_head, group, 2 x chunk_len, head_dim] (k and v with a group of 1)."""

    @staticmethod
    def forward(ctx, q, k, v, group):
        rank, cp, chunk_len = dist.get_rank(group), dist.get_world_size(group), q.shape[-2] // 2
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], -torch.inf, device=q.device)
        kv = torch.stack([k, v])
        for step in range(cp):
            if step + 1 < cp:
                next_kv, works = ring_exchange(kv, group)
            for query, key, diagonal in chunk_pairs(rank, (rank - step) % cp, cp, chunk_len):
                k_block, v_block = kv[0][..., key, :], kv[1][..., key, :]
                block_out, block_lse = block_attention(q[..., query, :], k_block, v_block, diagonal)
                merged = torch.logaddexp(lse[..., query], block_lse)
                out[..., query, :] = (out[..., query, :] * (lse[..., query] - merged).exp()[..., None]
                                      + block_out * (block_lse - merged).exp()[..., None])
                lse[..., query] = merged
            if step + 1 < cp:
                wait(works)
                kv = next_kv
        ctx.group = group
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        rank, cp, chunk_len = dist.get_rank(group), dist.get_world_size(group), q.shape[-2] // 2
        delta = (grad_out.float() * out).sum(-1)  # each query's sum of dO·O, the softmax's backward needs it
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        for step in range(cp):
            if step + 1 < cp:
                next_kv, works = ring_exchange(kv, group)
            grad_kv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
            for query, key, diagonal in chunk_pairs(rank, (rank - step) % cp, cp, chunk_len):
                dq, dk, dv = block_attention_backward(q[..., query, :], kv[0][..., key, :], kv[1][..., key, :],
                                                      grad_out[..., query, :], out[..., query, :], lse[..., query],
                                                      delta[..., query], diagonal)
                grad_q[..., query, :] += dq
                grad_kv[0][..., key, :] += dk
                grad_kv[1][..., key, :] += dv
            if step == 0:
                own = grad_kv  # this rank's keys' gradient from its own queries
            else:  # add to the sum the previous rank started for the same block, and pass it on towards its owner
                if step > 1:
                    wait(sum_works)
                    grad_kv += received_sum
                received_sum, sum_works = ring_exchange(grad_kv, group)  # float32: rounded once, at home, not a hop
            if step + 1 < cp:
                wait(works)
                kv = next_kv
        if cp > 1:  # the sum of every other rank's queries' gradients for this rank's keys, back home
            wait(sum_works)
            own += received_sum
        return grad_q.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None


def ring_attention(q, k, v, group):
    """RingAttention on gpt.py's [B, T, heads, head_dim] layout: the query heads grouped by the KV head they read."""
    B, T, n_head, head_dim = q.shape
    n_kv_head = k.shape[2]
    q = q.view(B, T, n_kv_head, n_head // n_kv_head, head_dim).permute(0, 2, 3, 1, 4)
    k, v = (t.permute(0, 2, 1, 3).unsqueeze(2) for t in (k, v))
    y = RingAttention.apply(q, k, v, group)
    return y.permute(0, 3, 1, 2, 4).reshape(B, T, n_head, head_dim)


class ContextParallel(nn.Module):
    """Wraps gpt.GPT: forward(idx, targets) takes whole sequences, keeps this rank's two chunks of them at their
    global positions, and returns the loss (the mean over this rank's tokens) or the logits of those tokens. Every
    attention layer's core is replaced by `attention` over the group; restore() gives gpt.py's back."""

    def __init__(self, module, group, attention):
        super().__init__()
        self.module, self.group = module, group
        core = torch.compiler.disable(lambda q, k, v: attention(q, k, v, group))  # collectives: no graph inside
        for block in module.blocks:
            block.attn.attend = core

    def forward(self, idx, targets=None):
        cp = dist.get_world_size(self.group)
        pos = chunk_positions(dist.get_rank(self.group), cp, idx.shape[1] // (2 * cp), idx.device)
        return self.module(idx[:, pos], None if targets is None else targets[:, pos], pos)

    def restore(self):
        for block in self.module.blocks:
            del block.attn.attend


def new_context_parallel_group(cp, dp):
    """This rank's context-parallel group of consecutive ranks. dist.new_group is collective: every rank creates every
    group, in the same order, and keeps its own."""
    groups = [dist.new_group(list(range(k * cp, (k + 1) * cp))) for k in range(dp)]
    return groups[dist.get_rank() // cp]


def main(argv=None):
    import checkpoint  # main() is where a script meets the shared files; everything above needs torch and gpt.py
    import training

    parser = training.get_parser(__doc__, "cp")
    parser.add_argument("--cp", type=training.positive_int, help="context-parallel size (default: world size / --dp)")
    parser.add_argument("--dp", type=training.positive_int, help="data-parallel size (default: world size / --cp)")
    parser.add_argument("--cp_impl", default="allgather", choices=["allgather", "ring"],
                        help="allgather: every rank's keys and values at once (Llama 3); ring: block by block")
    parser.add_argument("--impl", default="ours", choices=["ours", "torch"],
                        help="torch: the experimental context_parallel (CUDA only)")
    parser.add_argument("--bucket_mb", type=training.positive, default=25, help="largest gradient bucket, in MiB")
    args = training.parse(parser, argv)

    # ---- process groups: dp groups of cp consecutive ranks; each group shares a data-parallel rank's rows
    rank, local_rank, world_size = training.launched_rank(args)
    cp = args.cp or world_size // (args.dp or 1)
    dp = args.dp or max(1, world_size // cp)
    if cp * dp != world_size:
        launch = f"launch it with torchrun --nproc_per_node={cp * dp}" if world_size == 1 else \
            f"choose --cp and --dp whose product is {world_size}"
        raise training.UsageError(f"--cp {cp} x --dp {dp} = {cp * dp} ranks, but the world has {world_size}: {launch}")
    if args.block_size % (2 * cp):
        raise training.UsageError(f"--block_size {args.block_size} does not split into 2 x --cp {cp} = {2 * cp} equal "
                                  f"chunks: choose a multiple of {2 * cp}")
    if args.dropout and cp > 1:
        raise training.UsageError(f"--dropout {args.dropout} with --cp {cp}: one device's attention-dropout masks "
                                  "cannot be drawn block by block; use --dropout 0")
    if args.attn == "flash" and cp > 1:
        raise training.UsageError(f"--attn flash with --cp {cp}: attention over the ranks is train_cp.py's own "
                                  "(--cp_impl allgather or ring); use --attn sdpa")
    dp_rank, dp_size = rank // cp, dp
    if args.plan:  # the memory one rank needs in this layout, and nothing else: no device, data or model
        import plan
        return plan.print_plan(args, world_size, dp_size)
    device = training.get_device(args, local_rank)
    if args.impl == "torch" and device.type != "cuda":
        raise training.UsageError("--impl torch needs CUDA: torch's context_parallel has sharding rules for the CUDA "
                                  "attention kernels alone (flash, memory-efficient, cuDNN); use --impl ours, or GPUs")

    # ---- data: every check of the arguments happens here, on every rank alike, before the first collective
    meta, config, train_data, val_data = training.load_data(args, dp_rank, dp_size, device, is_writer=local_rank == 0)
    checkpoint_path = checkpoint.to_resume(args)
    rank, world_size, owns_group = training.init_distributed(args, device)
    cp_group = new_context_parallel_group(cp, dp)
    torch.manual_seed(args.seed + rank)  # dropout masks (with --cp 1); the data order depends on (seed, step) alone

    # ---- model: built on meta, materialised on the device, initialised by parameter name (or from --init_from)
    with torch.device("meta"):
        model = gpt.GPT(config)
    model.to_empty(device=device)
    model.init_weights(args.seed, training.initial_values(config, args.seed, args.init_from))
    gpt.set_attention(model, args.attn)

    # ---- strategy: this rank's chunks of its rows; gradients averaged over all cp x dp ranks, each saw other tokens
    if args.impl == "torch":  # its forward and backward run inside torch's context_parallel, a batch at a time
        import torch_reference
        cp_model = torch_reference.TorchContextParallel(model, device, cp, dp, args.cp_impl)
        ddp_model = torch_reference.data_parallel(cp_model, device, args.bucket_mb)
        batch = cp_model.sharded
    else:  # ours takes whole sequences and keeps its chunks itself
        attention = allgather_attention if args.cp_impl == "allgather" else ring_attention
        cp_model = ContextParallel(model, cp_group, attention)
        ddp_model = train_ddp.DataParallel(cp_model, args.bucket_mb)
        batch = lambda x, y: nullcontext((x, y))  # noqa: E731
    parts = checkpoint.parameter_parts(model)
    optimizer = training.make_optimizer(training.decay_groups(model.parameters()), args, device)
    forward = training.wrap_blocks(ddp_model, args.compile, args.activation_checkpointing)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bfloat16" else nullcontext()

    start_step = checkpoint.resume(checkpoint_path, parts, optimizer, config, rank, device)
    logger = training.Logger(args, config, device, rank, world_size)
    logger.start(train_data, dp_size, start_step, layout=f"{cp} context-parallel ({args.cp_impl}) | ")

    # ---- loop
    stop_request = training.StopRequest()  # SIGTERM or SIGUSR1: stop after the step, saved
    for step in range(start_step, args.max_steps):
        val_loss = training.evaluate(step, args, forward, val_data, autocast, dist.group.WORLD)
        t0 = time.perf_counter()
        lr = training.set_lr(optimizer, step, args)
        loss_sum = torch.zeros((), device=device)
        for micro_step in range(train_data.accumulation):
            x, y = train_data.get(step, micro_step)
            # Only the last micro-step's backward all-reduces; the ones before accumulate locally. --impl torch: x and y
            # become this rank's chunks, and forward and backward both run inside torch's context_parallel.
            sync = nullcontext() if micro_step + 1 == train_data.accumulation else ddp_model.no_sync()
            with sync, batch(x, y) as (x, y):
                with autocast:
                    loss = forward(x, y) / train_data.accumulation  # this rank's tokens' mean; averaged over ranks
                loss.backward()
            loss_sum += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip or float("inf"))
        diverged, stopping = stop_request.agreed(grad_norm, model)  # one read of the device, alike on every rank
        checkpoint.check_finite(diverged, step, loss_sum, grad_norm, args)  # a diverged step changes nothing
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # in place: the gradients are views into the all-reduce buckets

        if logger.due(step, val_loss):
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)  # each rank's mean over as many tokens of its own
            logger.log_step(step, loss_sum, lr, grad_norm, t0, val_loss, stop_request.expert_load)

        # ---- checkpoint: every replica holds everything, so rank 0 alone writes the tensors
        if checkpoint.due(step, args) or stopping:
            tensors = checkpoint.pieces(parts if rank == 0 else [], optimizer)
            checkpoint.save(args, step + 1, tensors, config, device, rank, world_size)
        if stopping:
            stop_request.stop(step + 1, args.out_dir)

    cp_model.restore()  # the sample runs whole sequences on every rank alike, with gpt.py's attention
    training.sample(model, meta, args, device, autocast, show=rank == 0)
    if owns_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    import training
    training.run(main)
