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

import os
import time
from contextlib import nullcontext
from dataclasses import asdict
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

import gpt
import train_fsdp
import train_tp
from prepare_data import get_tokenizer


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


def allreduce_replicated_grads(slots, layouts, tp_group):
    """Sequence parallelism: a parameter replicated across the TP group (layer norms, wpe, row-parallel biases) saw
    only this rank's sequence shard, so its gradient is summed over the TP group. Here it lives in FSDP's gradient
    shards; TP peers hold identical shard layouts, so the same shard elements are the same parameter's, and
    summing over TP commutes with FSDP's average over DP."""
    pieces = [slot.param.grad.view(-1)[slot.start:slot.start + slot.flat[1] - slot.flat[0]]
              for slot in slots if not layouts[slot.name].sharded]
    if pieces:
        flat = torch.cat(pieces)
        dist.all_reduce(flat, group=tp_group)
        torch._foreach_copy_(pieces, list(flat.split([piece.numel() for piece in pieces])))


def clip_grad_norm_(slots, layouts, shards, max_norm, tp_group):
    """The global norm over both dimensions, in one all-reduce over every rank: each FSDP shard is a disjoint part
    of a TP slice; a TP-sharded slice counts on every TP rank, a replicated parameter on TP rank 0 only."""
    first = dist.get_rank(tp_group) == 0
    total = torch.zeros((), device=shards[0].device)
    for slot in slots:
        if layouts[slot.name].sharded or first:
            total += slot.param.grad.view(-1)[slot.start:slot.start + slot.flat[1] - slot.flat[0]].float().pow(2).sum()
    dist.all_reduce(total)
    norm = total.sqrt()
    torch._foreach_mul_([shard.grad for shard in shards], torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


def apply_torch_2d(model, mesh, config, args, device):
    """--impl torch: DTensor tensor parallelism on the "tp" mesh dimension, then FSDP2 on the "dp" one."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import distribute_tensor

    train_tp.parallelize_with_dtensor(model, mesh["tp"], args.sequence_parallel, not args.no_loss_parallel)
    policy = MixedPrecisionPolicy(param_dtype=getattr(torch, args.dtype), reduce_dtype=torch.float32)
    for module in [*model.blocks, model]:
        fully_shard(module, mesh=mesh["dp"], mp_policy=policy, reshard_after_forward=not args.no_reshard)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            value = gpt.initial_value(name, param.shape, config, args.seed).to(device)
            param.copy_(distribute_tensor(value, param.device_mesh, param.placements))
    model.lm_head.weight = model.wte.weight
    return model


@record  # under torchrun, the error file names the failing rank with its traceback
def main(argv=None):
    parser = gpt.get_parser(__doc__)
    parser.add_argument("--impl", default="ours", choices=["ours", "torch"], help="torch: DTensor + FSDP2 on a DeviceMesh")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (ranks inside a node)")
    parser.add_argument("--dp", type=int, default=None, help="data-parallel size (default: world size / --tp)")
    parser.add_argument("--sequence_parallel", action="store_true")
    parser.add_argument("--no_loss_parallel", action="store_true", help="gather the logits instead")
    parser.add_argument("--no_reshard", action="store_true", help="keep each unit gathered from forward to backward")
    args = parser.parse_args(argv)

    # ---- process groups: a dp x tp grid; tensor-parallel peers share a data-parallel rank and its rows
    owns_group = not dist.is_initialized()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = gpt.get_device(args.device, local_rank)
    env_rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    tp, dp = args.tp, args.dp or max(1, world_size // args.tp)
    if tp * dp != world_size:
        raise ValueError(f"--tp {tp} x --dp {dp} = {tp * dp} ranks, but the world has {world_size}: "
                         f"choose --tp and --dp whose product is {world_size}")
    dp_rank, dp_size = env_rank // tp, dp

    # ---- data: every check of the arguments happens here, on every rank alike, before the first collective
    meta = gpt.ensure_data(args.data, is_writer=local_rank == 0)
    micro_batch = args.micro_batch or args.global_batch // dp_size
    train_data, val_data = (gpt.BatchSampler(os.path.join(args.data, f"{split}.bin"), args.block_size, args.global_batch,
                                             micro_batch, dp_rank, dp_size, args.seed, device) for split in ("train", "val"))
    config = gpt.make_config(args.model, meta["vocab_size"], args.block_size, args.dropout)
    train_tp.check_layout(config, tp, args.sequence_parallel)
    if args.resume and args.impl == "torch":
        raise SystemExit("--resume is implemented for --impl ours only (it resumes checkpoints of any layout)")
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
    if rank != env_rank:
        raise RuntimeError(f"RANK says {env_rank} but the process group says {rank}")
    tp_group, dp_group = new_groups(tp, dp)
    master = rank == 0
    prefix = f"[rank {rank}] " if args.log_all_ranks else ""
    torch.manual_seed(args.seed + dp_rank)  # dropout outside the TP region: TP peers draw the same masks

    # ---- model: built on meta; each rank materialises only its FSDP shards of its TP slices
    with torch.device("meta"):
        model = gpt.GPT(config)
    gpt.set_attention(model, args.attn, device, getattr(torch, args.dtype))
    num_params, num_params_without_position = model.num_params(), model.num_params(with_position_embedding=False)

    # ---- strategy: tensor parallel inside each TP group, then fully sharded over each DP group
    if args.impl == "torch":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
        model = apply_torch_2d(model, mesh, config, args, device)
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        clip_grad_norm = lambda limit: train_tp.clip_grad_norm_dtensor_(decay + no_decay, limit)  # noqa: E731
    else:
        train_tp.parallelize(model, tp_group, args.sequence_parallel, not args.no_loss_parallel,
                             dropout_seed=args.seed + 1000 * (1 + rank))
        layouts = {name: layout for name, _, layout in train_tp.parameter_layouts(model)}
        model = train_fsdp.FullyShardedDataParallel(
            model, process_group=dp_group, device=device, compute_dtype=getattr(torch, args.dtype),
            reshard_after_forward=not args.no_reshard,
            initial_value=lambda name, param: gpt.initial_value(name, layouts[name].shape, config, args.seed)[
                tuple(slice(*b) for b in layouts[name].box)],
            layout=lambda name, shape: (layouts[name].shape, layouts[name].box))
        decay, no_decay = model.parameter_groups()
        slots = model.slots()
        clip_grad_norm = lambda limit: clip_grad_norm_(slots, layouts, decay + no_decay, limit, tp_group)  # noqa: E731
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
    flops_per_token = gpt.flops_per_token(config, num_params_without_position)
    peak_flops = gpt.peak_flops(device)
    if master or args.log_all_ranks:
        tp_groups, dp_groups = grid(tp, dp)
        print(f"{prefix}grid: {dp} data-parallel x {tp} tensor-parallel | TP groups {tp_groups} | DP groups {dp_groups}")
        print(f"{prefix}{args.model}: {num_params / 1e6:.2f}M parameters | {world_size} ranks on {device} | "
              f"global batch {args.global_batch} = micro batch {micro_batch} x {train_data.accumulation} accumulation "
              f"x {dp_size} data-parallel | {'resuming at step ' + str(start_step) if start_step else 'from scratch'}")

    # ---- loop
    for step in range(start_step, args.max_steps):
        last_step = step + 1 == args.max_steps
        val_loss = None
        if args.eval_interval and (step % args.eval_interval == 0 or last_step):
            val_loss = gpt.estimate_loss(forward, val_data, args.eval_iters, autocast)
            dist.all_reduce(val_loss, op=dist.ReduceOp.AVG, group=dp_group)
            val_loss = val_loss.item()
        t0 = time.perf_counter()
        lr = gpt.get_lr(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=device)
        for micro_step in range(train_data.accumulation):
            x, y = train_data.get(step, micro_step)
            with autocast:
                loss = forward(x, y) / train_data.accumulation  # gradient of the mean over the global batch
            loss.backward()  # each unit's gradient is reduce-scattered (averaged over DP) as its backward ends
            loss_sum += loss.detach()
        if args.sequence_parallel and args.impl == "ours":
            allreduce_replicated_grads(slots, layouts, tp_group)
        grad_norm = clip_grad_norm(args.grad_clip or float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if step % args.log_interval == 0 or last_step or val_loss is not None:
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG, group=dp_group)  # TP peers hold the same loss
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

        # ---- checkpoint: every rank writes its shards of TP-sharded tensors; replicated ones come from TP rank 0
        if (args.ckpt_interval and (step + 1) % args.ckpt_interval == 0) or last_step:
            if args.impl == "torch":
                tensors = train_fsdp.full_tensors(model, optimizer, master)
            else:
                first = dist.get_rank(tp_group) == 0
                tensors = gpt.checkpoint_tensors([s for s in slots if layouts[s.name].sharded or first], optimizer)
            gpt.save_shard(args.out_dir, step + 1, rank, tensors, gpt.rng_state(device))
            dist.barrier()
            if master:
                gpt.publish_checkpoint(args.out_dir, step + 1, world_size, {"config": asdict(config), "args": vars(args)})
            dist.barrier()

    if args.sample_tokens:  # on every rank: each forward needs every rank's shards and slices
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
