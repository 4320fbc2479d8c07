"""
4-D parallel by hand: data parallel (FSDP) x pipeline x context x tensor parallel on one grid of ranks, the layout
Llama 3 405B was pretrained on. Each pipeline stage (train_pp.py) holds the tensor-parallel slices (train_tp.py) of its
blocks, sequence parallel if asked; attention on a rank's own heads reaches the other context-parallel ranks' keys and
values (train_cp.py); each stage's slices are fully sharded (train_fsdp.py), or with --dp_impl ddp replicated
(train_ddp.py), over the ranks that hold the same ones. The pieces are imported from those scripts; this file only
builds the grid and composes them. Any degree may be 1.

    torchrun --standalone --nproc_per_node=16 train_4d.py --dp 2 --pp 2 --cp 2 --tp 2
    torchrun --standalone --nproc_per_node=8 train_4d.py --dp 2 --pp 2 --tp 2 --schedule gpipe --sequence_parallel
    torchrun --standalone --nproc_per_node=8 train_4d.py --dp 2 --pp 2 --tp 2 --dp_impl ddp

Rank ((d * pp + p) * cp + c) * tp + t is tensor-parallel rank t, context-parallel rank c, stage p, data-parallel rank
d. Innermost the axis whose collectives carry the most bytes most often, on the fastest links: TP sums activations
twice a layer, so its peers are neighbours in a node; CP gathers keys and values once a layer, inside the node too
where tp x cp fits; PP sends one activation a micro-batch across a stage boundary, which links between nodes carry;
DP outermost: its gathers and reduce-scatters come once a unit a micro-batch, overlapped with compute.
Reads top to bottom: arguments -> process groups -> model -> strategy -> loop -> checkpoint.
"""

import math
import time
from contextlib import nullcontext
from functools import partial

import torch
import torch.distributed as dist

import gpt
import train_cp
import train_ddp
import train_fsdp
import train_pp
import train_tp


def grid(dp, pp, cp, tp):
    """The global ranks of every group of each axis. FSDP shards over "data", the dp x cp ranks that hold the same
    slices of the same stage: context-parallel ranks hold the same weights and average their gradients too. "model":
    the pp x tp ranks of one replica (Megatron's model-parallel group), over which DDP's gradient norm sums."""
    ranks = torch.arange(dp * pp * cp * tp).view(dp, pp, cp, tp)

    def along(*axes):  # every group that varies `axes`, the other coordinates fixed
        others = [axis for axis in range(4) if axis not in axes]
        return ranks.permute(*others, *axes).reshape(-1, math.prod(ranks.shape[axis] for axis in axes)).tolist()
    return {"tp": along(3), "cp": along(2), "pp": along(1), "data": along(0, 2), "model": along(1, 3)}


def new_groups(dp, pp, cp, tp):
    """This rank's group of each axis, by grid()'s names, and "ends": its pipeline's first and last stage, which hold
    a tied weight twice (None if pp is 1). dist.new_group is collective: every rank creates every group, in order."""
    layout = grid(dp, pp, cp, tp)
    layout["ends"] = [[ranks[0], ranks[-1]] for ranks in layout["pp"]] if pp > 1 else []
    mine = {}
    for name, groups in layout.items():
        created = [dist.new_group(ranks) for ranks in groups]
        mine[name] = next((group for group, ranks in zip(created, groups) if dist.get_rank() in ranks), None)
    return mine


def chunks_of(batch, positions):
    """This context-parallel rank's tokens of (ids, targets): its two chunks of every sequence; all, if positions is
    None. Every stage of a pipeline takes the same, so each knows the shape of what it receives."""
    return batch if positions is None else tuple(tokens[:, positions] for tokens in batch)


def sum_tied_gradients(fsdp, group):
    """train_pp.py's sum of the tied weight's two gradients, on the first stage's FSDP shard of wte and the last
    stage's: each the only matrix of its flat parameter (wte's own unit; the LM head's root), so the two shards
    cover the same elements."""
    if group is not None:
        dist.all_reduce(dict(fsdp.gradients())["model.wte.weight"], group=group)


def main(argv=None):
    import checkpoint  # main() is where a script meets the shared files; everything above needs torch and gpt.py
    import training

    parser = training.get_parser(__doc__, "4d")
    parser.add_argument("--dp", type=training.positive_int, help="data-parallel size (default: the ranks left)")
    parser.add_argument("--dp_impl", default="fsdp", choices=["fsdp", "ddp"],
                        help="the data axis': fsdp shards a stage's slices, ddp replicates them")
    parser.add_argument("--pp", type=training.positive_int, default=1, help="pipeline stages, at most the layers")
    parser.add_argument("--cp", type=training.positive_int, default=1, help="context-parallel size")
    parser.add_argument("--tp", type=training.positive_int, default=1, help="tensor-parallel size (inside a node)")
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"], help="the pipeline's")
    parser.add_argument("--cp_impl", default="allgather", choices=["allgather", "ring"], help="the context's")
    parser.add_argument("--no_reshard", action="store_true", help="keep each unit gathered from forward to backward")
    parser.add_argument("--sequence_parallel", action="store_true", help="layer norms and dropout on sequence shards")
    parser.add_argument("--impl", default="ours", choices=["ours", "torch"], help="torch: refused, no 4-D yardstick")
    args = training.parse(parser, argv)
    if args.impl == "torch":
        raise training.UsageError("train_4d.py has no --impl torch (torch_reference.py composes no 4-D layout): drop "
                                  "it, or compare an axis with train_2d.py, train_pp.py or train_cp.py --impl torch")
    if args.no_reshard and args.dp_impl == "ddp":
        raise training.UsageError("--no_reshard is FSDP's (DDP gathers nothing): drop it, or use --dp_impl fsdp")

    # ---- process groups: a dp x pp x cp x tp grid, tensor parallel innermost; its checks before any collective
    rank, local_rank, world_size = training.launched_rank(args)
    pp, cp, tp = args.pp, args.cp, args.tp
    dp = args.dp or max(1, world_size // (pp * cp * tp))
    if dp * pp * cp * tp != world_size:
        launch = f"launch it with torchrun --nproc_per_node={dp * pp * cp * tp}" if world_size == 1 else \
            f"choose degrees whose product is {world_size}"
        raise training.UsageError(f"--dp {dp} x --pp {pp} x --cp {cp} x --tp {tp} = {dp * pp * cp * tp} ranks, but "
                                  f"the world has {world_size}: {launch}")
    multiple = math.lcm(2 * cp, cp * tp if args.sequence_parallel else 1)  # each rank's tokens split over --tp
    if cp > 1 and (args.block_size % multiple or args.dropout or args.attn == "flash"):
        raise training.UsageError(f"--cp {cp} needs --block_size a multiple of {multiple}, --dropout 0 and --attn sdpa "
                                  "(train_cp.py's chunks, split over --tp under --sequence_parallel, and attention "
                                  "over the ranks)")
    dp_rank, stage_index, cp_rank = rank // (pp * cp * tp), rank // (cp * tp) % pp, rank // tp % cp
    if args.micro_batch is None and args.global_batch % dp == 0:  # else training.load_data says what to change
        args.micro_batch = train_pp.pipelined_micro_batch(args.global_batch // dp, pp)
    if args.plan:  # the memory the fullest stage needs in this layout, and nothing else: no device, data or model
        import plan
        return plan.print_plan(args, world_size, dp, train_tp.is_sliced, layers=train_pp.stage_layers,
                               schedule=train_pp.schedule)
    device = training.get_device(args, local_rank)

    # ---- data: every check of the arguments happens here, on every rank alike, before the first collective
    meta, config, train_data, val_data = training.load_data(args, dp_rank, dp, device, is_writer=local_rank == 0)
    training.check_tensor_parallel(config, tp, args.sequence_parallel)
    if pp > config.n_layer:
        raise training.UsageError(f"--pp {pp} stages, but the model has {config.n_layer} layers and a stage holds "
                                  f"one at least: choose --pp {config.n_layer} or fewer")
    checkpoint_path = checkpoint.to_resume(args)
    rank, world_size, owns_group = training.init_distributed(args, device)
    groups = new_groups(dp, pp, cp, tp)
    torch.manual_seed(args.seed + rank // tp)  # dropout: the same generators on every TP peer, its own elsewhere

    # ---- model: built on meta, split into TP slices, cut to this rank's stage, given CP's attention
    with torch.device("meta"):
        model = gpt.GPT(config)
    gpt.set_attention(model, args.attn)
    gather = train_tp.parallelize(model, groups["tp"], args.sequence_parallel)
    stage = train_pp.Stage(model, stage_index, pp)
    if stage.is_last:  # the sample reads whole logits, not a vocabulary slice (the pipeline pads a prompt for SP)
        stage.register_forward_hook(lambda module, inputs, out: gather(out) if out.dim() == 3 else out)
    if cp > 1:
        attention = train_cp.allgather_attention if args.cp_impl == "allgather" else train_cp.ring_attention
        core = torch.compiler.disable(lambda q, k, v: attention(q, k, v, groups["cp"]))  # collectives: no graph
        for layer in stage.layers:
            model.blocks[layer].attn.attend = core
        stage.positions = train_cp.chunk_positions(cp_rank, cp, args.block_size // (2 * cp), device)

    # ---- strategy: the stage's slices sharded (FSDP) or replicated (DDP) over its data group; the stages run a
    # pipeline schedule
    tp_boxes = {part.name: (part.shape, part.box) for part in checkpoint.parameter_parts(stage)}
    value = training.initial_values(config, args.seed, args.init_from)  # drawn by gpt.py's name, or --init_from
    tp_first, replica_first = dist.get_rank(groups["tp"]) == 0, dist.get_rank(groups["data"]) == 0
    sharded = args.dp_impl == "fsdp"

    def counted(name):  # each element once: a slice on its TP rank, a replicated tensor on TP rank 0, tied on stage 0
        return (train_tp.is_sliced(name) or tp_first) and (stage.is_first or not name.endswith("wte.weight"))

    if sharded:
        units = ([model.wte] if stage.is_first else []) + [model.blocks[layer] for layer in stage.layers]
        fsdp = train_fsdp.FullyShardedDataParallel(
            stage, units, process_group=groups["data"], device=device, compute_dtype=getattr(torch, args.dtype),
            reshard_after_forward=not args.no_reshard, tp_boxes=tp_boxes,
            initial_value=lambda name, *where: value(name.removeprefix("model."), *where))
        parts = [checkpoint.Part(name.removeprefix("model."), *where) for name, *where in fsdp.parts()]
        parameter_groups, gradients, no_sync, module = fsdp.parameter_groups(), fsdp.gradients, nullcontext, fsdp
        sum_tied = partial(sum_tied_gradients, fsdp, groups["ends"])
        clip_grad_norm = partial(fsdp.clip_grad_norm_, counted=counted, group=dist.group.WORLD)  # shards: disjoint
    else:  # each rank its whole TP slices, their gradients averaged over the data group in the last backward
        stage.init_weights(device, lambda name, shape: value(name, *tp_boxes["model." + name]))
        replica, module = train_ddp.DataParallel(stage, process_group=groups["data"]), stage
        parts = checkpoint.parameter_parts(model)  # gpt.py's names, as a checkpoint stores them
        parameter_groups, no_sync = training.decay_groups(model.parameters()), replica.no_sync
        gradients = lambda: [(name, param.grad) for name, param in stage.named_parameters()]  # noqa: E731
        sum_tied = partial(train_pp.sum_tied_gradients, stage, groups["ends"])
        clip_grad_norm = partial(train_pp.clip_grad_norm_, stage, group=groups["model"], counted=counted)  # a replica
    pipeline = train_pp.PipelineParallel(module, groups["pp"], config, getattr(torch, args.dtype),
                                         tp if args.sequence_parallel else 1)
    if cp > 1:  # evaluation through the pipeline: this rank's chunks too
        chunked = pipeline.register_forward_pre_hook(lambda module, batch: chunks_of(batch, stage.positions))
    optimizer = training.make_optimizer(parameter_groups, args, device)
    forward = training.wrap_blocks(pipeline, args.compile, args.activation_checkpointing)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bfloat16" else nullcontext()

    start_step = checkpoint.resume(checkpoint_path, parts, optimizer, config, rank, device, tp)
    logger = training.Logger(args, config, device, rank, world_size)
    layout = grid(dp, pp, cp, tp)
    logger.print(f"grid: {dp} data ({args.dp_impl}) x {pp} pipeline ({args.schedule}) x {cp} context ({args.cp_impl}) "
                 f"x {tp} tensor{' (sequence parallel)' * args.sequence_parallel} | "
                 + " | ".join(f"{name} groups {layout[name]}" for name in ("tp", "cp", "pp", "data")))
    logger.start(train_data, dp, start_step)

    # ---- loop
    stop_request = training.StopRequest()  # SIGTERM or SIGUSR1: stop after the step, saved
    for step in range(start_step, args.max_steps):
        val_loss = training.evaluate(step, args, forward, val_data, autocast, groups["data"])
        t0 = time.perf_counter()
        lr = training.set_lr(optimizer, step, args)
        batches = [chunks_of(train_data.get(step, micro_step), stage.positions)
                   for micro_step in range(train_data.accumulation)]
        loss_sum = pipeline.step(args.schedule, batches, autocast, no_sync)  # FSDP: each unit as its backward ends
        if args.sequence_parallel:  # a replicated parameter saw this rank's sequence shard only: sum over TP
            train_tp.allreduce_replicated_grads(gradients(), groups["tp"], device)
        if config.tie_embeddings:
            sum_tied()
        grad_norm = clip_grad_norm(args.grad_clip or float("inf"))
        diverged, stopping = stop_request.agreed(grad_norm, model)  # one read of the device, alike on every rank
        checkpoint.check_finite(diverged, step, loss_sum, grad_norm, args)  # a diverged step changes nothing
        optimizer.step()
        optimizer.zero_grad(set_to_none=sharded)  # DDP's gradients are views into its buckets

        if logger.due(step, val_loss):
            dist.all_reduce(loss_sum)  # each last stage's TP peers hold their rows' and chunks' mean; the rest zero
            logger.log_step(step, loss_sum / (dp * cp * tp), lr, grad_norm, t0, val_loss, stop_request.expert_load)

        # ---- checkpoint: every rank its FSDP pieces (DDP: the first replica) of TP-sliced tensors; replicated ones
        # from TP rank 0
        if checkpoint.due(step, args) or stopping:
            owned = [part for part in parts if counted("model." + part.name) and (sharded or replica_first)]
            checkpoint.save(args, step + 1, checkpoint.pieces(owned, optimizer), config, device, rank, world_size, tp)
        if stopping:
            stop_request.stop(step + 1, args.out_dir)

    if cp > 1:  # the sample runs whole sequences on every rank alike, with gpt.py's attention
        chunked.remove()
        stage.positions = None
        for layer in stage.layers:
            del model.blocks[layer].attn.attend
    training.sample(forward, meta, args, device, autocast, show=rank == 0)  # every rank: each forward needs them all
    if owns_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    import training
    training.run(main)
