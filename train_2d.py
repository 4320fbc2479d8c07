"""
FSDP x tensor parallel on a 2-D grid of ranks: every matrix is split over --tp ranks (Megatron, train_tp.py), and
each rank's slices are fully sharded over --dp ranks (ZeRO-3, train_fsdp.py). The pieces are imported from those
two scripts; this file only builds the grid and composes them.

    torchrun --standalone --nproc_per_node=8 train_2d.py --tp 2 --dp 4
    torchrun --standalone --nproc_per_node=4 train_2d.py --tp 2 --dp 2 --sequence_parallel
    torchrun --standalone --nproc_per_node=4 train_2d.py --tp 2 --dp 2 --impl torch      # DTensor + fully_shard

Ranks [k*tp, (k+1)*tp) form a tensor-parallel group: TP's collectives run on every layer, so they stay inside a
node, on the fastest links; the data-parallel groups are strided across nodes and carry FSDP's gathers.
Reads top to bottom: arguments -> process groups -> model -> strategy -> loop -> checkpoint.
"""

import time
from contextlib import nullcontext
from functools import partial

import torch
import torch.distributed as dist

import gpt
import train_fsdp
import train_tp


def grid(tp, dp):
    """The global ranks of every tensor-parallel group (consecutive) and every data-parallel group (strided)."""
    return [list(range(k * tp, (k + 1) * tp)) for k in range(dp)], [list(range(j, tp * dp, tp)) for j in range(tp)]


def new_groups(tp, dp):
    """This rank's (tensor-parallel group, data-parallel group). dist.new_group is collective: every rank creates
    every group, in the same order, and keeps the two it belongs to."""
    rank, mine = dist.get_rank(), []
    for groups in grid(tp, dp):
        created = [dist.new_group(ranks) for ranks in groups]
        mine.append(next(group for group, ranks in zip(created, groups) if rank in ranks))
    return tuple(mine)


def main(argv=None):
    import checkpoint  # main() is where a script meets the shared files; everything above needs torch and gpt.py
    import training

    parser = training.get_parser(__doc__, "2d")
    parser.add_argument("--impl", default="ours", choices=["ours", "torch"],
                        help="torch: DTensor + FSDP2 on a DeviceMesh")
    parser.add_argument("--tp", type=training.positive_int, default=2, help="tensor-parallel size (inside a node)")
    parser.add_argument("--dp", type=training.positive_int, help="data-parallel size (default: world size / --tp)")
    parser.add_argument("--sequence_parallel", action="store_true", help="layer norms and dropout on sequence shards")
    parser.add_argument("--no_loss_parallel", action="store_true", help="gather the logits instead")
    parser.add_argument("--no_reshard", action="store_true", help="keep each unit gathered from forward to backward")
    parser.add_argument("--cpu_offload", action="store_true",
                        help="keep the float32 shards, their gradients and AdamW on the host; AdamW steps there")
    args = training.parse(parser, argv)

    # ---- process groups: a dp x tp grid; tensor-parallel peers share a data-parallel rank and its rows
    rank, local_rank, world_size = training.launched_rank(args)
    tp, dp = args.tp, args.dp or max(1, world_size // args.tp)
    if tp * dp != world_size:
        launch = f"launch it with torchrun --nproc_per_node={tp * dp}" if world_size == 1 else \
            f"choose --tp and --dp whose product is {world_size}"
        raise training.UsageError(f"--tp {tp} x --dp {dp} = {tp * dp} ranks, but the world has {world_size}: {launch}")
    dp_rank, dp_size = rank // tp, dp
    if args.plan:  # the memory one rank needs in this layout, and nothing else: no device, data or model
        import plan
        return plan.print_plan(args, world_size, dp_size, train_tp.is_sliced, train_fsdp.flat_parameter_groups)
    device = training.get_device(args, local_rank)

    # ---- data: every check of the arguments happens here, on every rank alike, before the first collective
    meta, config, train_data, val_data = training.load_data(args, dp_rank, dp_size, device, is_writer=local_rank == 0)
    training.check_tensor_parallel(config, tp, args.sequence_parallel)
    checkpoint_path = checkpoint.to_resume(args)
    rank, world_size, owns_group = training.init_distributed(args, device)
    tp_group, dp_group = new_groups(tp, dp)
    torch.manual_seed(args.seed + dp_rank)  # dropout: the same generators on every TP peer, its own on each DP rank

    # ---- model: built on meta; each rank materialises only its FSDP shards of its TP slices
    with torch.device("meta"):
        model = gpt.GPT(config)
    gpt.set_attention(model, args.attn)

    # ---- strategy: tensor parallel inside each TP group, then fully sharded over each DP group
    if args.impl == "torch":
        import torch_reference
        model, groups, clip_grad_norm = torch_reference.fully_shard_tensor_parallel(model, config, args, device, tp, dp)
        parts = None  # its checkpoints gather each tensor whole
    else:
        gather = train_tp.parallelize(model, tp_group, args.sequence_parallel, not args.no_loss_parallel)
        training.sampling_hooks(model, tp if args.sequence_parallel else 1, gather)
        tp_parts = {part.name: part for part in checkpoint.parameter_parts(model)}
        value = training.initial_values(config, args.seed, args.init_from)  # drawn by name, or read from --init_from
        model = train_fsdp.FullyShardedDataParallel(
            model, process_group=dp_group, device=device, compute_dtype=getattr(torch, args.dtype),
            reshard_after_forward=not args.no_reshard, initial_value=value, cpu_offload=args.cpu_offload,
            tp_boxes={name: (p.shape, p.box) for name, p in tp_parts.items()})
        groups, parts = model.parameter_groups(), [checkpoint.Part(*where) for where in model.parts()]
        first = dist.get_rank(tp_group) == 0  # each element counted once: a replicated parameter on TP rank 0 alone
        clip_grad_norm = partial(model.clip_grad_norm_, counted=lambda name: train_tp.is_sliced(name) or first,
                                 group=dist.group.WORLD)  # the data-parallel shards are disjoint too
    optimizer = training.make_optimizer(groups, args, device)
    forward = training.wrap_blocks(model, args.compile, args.activation_checkpointing)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bfloat16" else nullcontext()

    start_step = checkpoint.resume(checkpoint_path, parts, optimizer, config, rank, device, tp)
    logger = training.Logger(args, config, device, rank, world_size)
    tp_groups, dp_groups = grid(tp, dp)
    logger.print(f"grid: {dp} data-parallel x {tp} tensor-parallel | TP groups {tp_groups} | DP groups {dp_groups}")
    logger.start(train_data, dp_size, start_step)

    # ---- loop
    stop_request = training.StopRequest()  # SIGTERM or SIGUSR1: stop after the step, saved
    for step in range(start_step, args.max_steps):
        val_loss = training.evaluate(step, args, forward, val_data, autocast, dp_group)
        t0 = time.perf_counter()
        lr = training.set_lr(optimizer, step, args)
        loss_sum = torch.zeros((), device=device)
        for micro_step in range(train_data.accumulation):
            x, y = train_data.get(step, micro_step)
            with autocast:
                loss = forward(x, y) / train_data.accumulation  # gradient of the mean over the global batch
            loss.backward()  # each unit's gradient is reduce-scattered (averaged over DP) as its backward ends
            loss_sum += loss.detach()
        if args.sequence_parallel and parts is not None:
            train_tp.allreduce_replicated_grads(model.gradients(), tp_group, device)
        grad_norm = clip_grad_norm(args.grad_clip or float("inf"))
        diverged, stopping = stop_request.agreed(grad_norm, model)  # one read of the device, alike on every rank
        checkpoint.check_finite(diverged, step, loss_sum, grad_norm, args)  # a diverged step changes nothing
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if logger.due(step, val_loss):
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG, group=dp_group)  # TP peers hold the same loss
            logger.log_step(step, loss_sum, lr, grad_norm, t0, val_loss, stop_request.expert_load)

        # ---- checkpoint: every rank writes its shards of TP-sliced tensors; replicated ones come from TP rank 0
        if checkpoint.due(step, args) or stopping:
            first = dist.get_rank(tp_group) == 0
            tensors = (torch_reference.full_tensors(model, optimizer, rank == 0) if parts is None else
                       checkpoint.pieces([part for part in parts if part.sliced or first], optimizer))
            checkpoint.save(args, step + 1, tensors, config, device, rank, world_size, tp)
        if stopping:
            stop_request.stop(step + 1, args.out_dir)

    training.sample(model, meta, args, device, autocast, show=rank == 0)  # every rank: each forward needs them all
    if owns_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    import training
    training.run(main)
