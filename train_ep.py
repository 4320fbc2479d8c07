r"""
Expert parallel, by hand: each mixture-of-experts layer's experts are split over --ep ranks, and every token travels
to the ranks that hold the experts its router chose, and back, by all-to-alls. --dp replicas of that split train on
their own rows of the global batch; everything but the experts (attention, norms, embeddings, routers) is whole on
every rank, its gradients averaged over all of them, an expert's over its replicas.

    torchrun --standalone --nproc_per_node=2 train_ep.py --model moe-tiny              # 4 of the 8 experts a rank
    torchrun --standalone --nproc_per_node=4 train_ep.py --model moe-tiny --ep 2 --dp 2

Rank r is expert-parallel rank r % ep of replica r // ep: an expert-parallel group is consecutive ranks, inside a node,
since its all-to-alls carry every token of every layer, forward and backward. Expert e lives on expert-parallel rank
e // (n_expert / ep). PyTorch core has no expert parallelism to compare with (torchtitan builds its own).
Reads top to bottom: arguments -> process groups -> model -> strategy -> loop -> checkpoint.
"""

import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

import gpt


def is_expert(name):
    return ".experts." in name


def exchange(x, send_sizes, receive_sizes, group):
    """all_to_all_single: x's first send_sizes[0] rows go to rank 0 of the group, the next send_sizes[1] to rank 1, ...;
    what each rank sent this one arrives in the order of the ranks, receive_sizes[r] rows from rank r."""
    out = x.new_empty(sum(receive_sizes), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), receive_sizes, send_sizes, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """exchange() under autograd. The gradient of each row received goes back to the rank that sent it: the same
    exchange with the sizes swapped, so the dispatch's backward is a combine and the combine's a dispatch."""

    @staticmethod
    def forward(ctx, x, send_sizes, receive_sizes, group):
        ctx.send_sizes, ctx.receive_sizes, ctx.group = send_sizes, receive_sizes, group
        return exchange(x, send_sizes, receive_sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return exchange(grad, ctx.receive_sizes, ctx.send_sizes, ctx.group), None, None, None


def hold_experts(model, ep_rank, ep):
    """Keep this rank's experts of every gpt.MoE, those e with e // (n_expert / ep) == ep_rank; the others are set to
    None, as train_pp.py drops another stage's blocks, so every parameter keeps its gpt.py name
    (blocks.1.mlp.experts.5 stays experts.5) and a checkpoint names it as one device does."""
    for moe in [module for module in model.modules() if isinstance(module, gpt.MoE)]:
        local = len(moe.experts) // ep
        for expert in range(len(moe.experts)):
            if expert // local != ep_rank:
                moe.experts[expert] = None


def run_experts(moe, group, tokens, chosen, weights):
    """gpt.MoE.run_experts over the expert-parallel group: each chosen (token, expert) pair of this rank's tokens goes
    to the rank that holds the expert (dispatch), each expert runs on the tokens it received, one expert at a time,
    and the outputs go back (combine) to be weighted and summed per token, in expert order as on one device."""
    ep, n_expert, top_k = dist.get_world_size(group), len(moe.experts), chosen.shape[1]
    local = n_expert // ep  # experts a rank; this rank's are [first, first + local)
    first = dist.get_rank(group) * local
    # Sorted by expert, the pairs are sorted by the rank that holds it: each rank's share is one slice.
    order = chosen.flatten().argsort(stable=True)
    token_of_pair = order // top_k
    counts = torch.bincount(chosen.flatten(), minlength=n_expert)  # this rank's pairs, by expert
    # The counts go first: each rank learns how many rows each other rank sends it, for each of its experts.
    received = exchange(counts, [local] * ep, [local] * ep, group).view(ep, local)  # [from rank, local expert]
    sizes = torch.cat([counts.view(ep, local).sum(1), received.sum(1), received.sum(0)]).tolist()  # the host waits
    send_sizes, receive_sizes, expert_sizes = sizes[:ep], sizes[ep:2 * ep], sizes[2 * ep:]
    # Under autocast the tokens travel in the compute dtype: the experts' matmuls would cast them to it anyway.
    device = tokens.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else tokens.dtype
    arrived = AllToAll.apply(tokens[token_of_pair].to(dtype), send_sizes, receive_sizes, group)
    # They arrive rank by rank, each rank's sorted by expert; one expert at a time wants them expert by expert.
    expert_of_row = torch.arange(local, device=tokens.device).repeat(ep).repeat_interleave(received.flatten())
    by_expert = expert_of_row.argsort(stable=True)
    pieces = arrived[by_expert].split(expert_sizes)
    # An expert that received no token still runs, on none, so every expert has a gradient every step.
    outputs = torch.cat([moe.experts[first + j](piece) for j, piece in enumerate(pieces)])
    outputs = outputs[by_expert.argsort()]  # back in the order they arrived, to go back where they came from
    returned = AllToAll.apply(outputs, receive_sizes, send_sizes, group)  # in this rank's sorted order again
    pair_weights = weights.flatten()[order, None]
    return torch.zeros_like(tokens).index_add(0, token_of_pair, returned * pair_weights)


def expert_parallel(model, group):
    """Every gpt.MoE of `model` runs its experts over `group`: run_experts above replaces gpt.py's, as train_cp.py
    replaces the attention core."""
    for moe in [module for module in model.modules() if isinstance(module, gpt.MoE)]:
        # collectives and host reads: no graph inside, under --compile
        moe.run_experts = torch.compiler.disable(lambda *args, moe=moe: run_experts(moe, group, *args))


def all_reduce_gradients(model, dp_group, world_size):
    """After backward, every gradient becomes the sum of the world's over world_size: the gradient of the mean loss
    over the global batch. A shared parameter's gradient is this rank's rows' alone; an expert's already sums its
    expert-parallel group's rows (the combine's backward brought their outputs' gradients to it), so the rest of its
    sum is over its replicas. One flat all-reduce of each kind, after the last micro-step: simple, not overlapped with
    backward as train_ddp.py's buckets are."""
    for expert, group in ((False, None), (True, dp_group)):
        grads = [p.grad for name, p in model.named_parameters() if is_expert(name) == expert]
        flat = torch.cat([grad.flatten() for grad in grads])
        if dist.get_world_size(group) > 1:  # at --dp 1 an expert's gradient is whole already
            dist.all_reduce(flat, group=group)
        flat /= world_size
        for grad, reduced in zip(grads, flat.split([grad.numel() for grad in grads])):
            grad.copy_(reduced.view_as(grad))


def clip_grad_norm_(model, max_norm, ep_group):
    """torch.nn.utils.clip_grad_norm_ of the whole model: the shared gradients, alike on every rank, counted once;
    each expert's once, summed over the expert-parallel group, which holds one copy of every expert."""
    named = list(model.named_parameters())
    squared = torch.nn.utils.get_total_norm([p.grad for name, p in named if is_expert(name)]) ** 2
    dist.all_reduce(squared, group=ep_group)
    shared = torch.nn.utils.get_total_norm([p.grad for name, p in named if not is_expert(name)])
    norm = (shared ** 2 + squared).sqrt()
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm)
    return norm


def new_groups(ep, dp):
    """This rank's (expert-parallel group, data-parallel group): ep consecutive ranks, and the dp ranks that hold the
    same experts. dist.new_group is collective: every rank creates every group, in the same order, and keeps its own."""
    experts = [list(range(d * ep, (d + 1) * ep)) for d in range(dp)]
    replicas = [list(range(e, ep * dp, ep)) for e in range(ep)]
    mine = []
    for groups in (experts, replicas):
        created = [dist.new_group(ranks) for ranks in groups]
        mine.append(next(group for group, ranks in zip(created, groups) if dist.get_rank() in ranks))
    return tuple(mine)


def main(argv=None):
    import checkpoint  # main() is where a script meets the shared files; everything above needs torch and gpt.py
    import training

    parser = training.get_parser(__doc__, "ep")
    parser.add_argument("--impl", default="ours", choices=["ours", "torch"],
                        help="ours alone: PyTorch core has no expert parallelism to compare with")
    parser.add_argument("--ep", type=training.positive_int, help="expert-parallel size (default: world size / --dp)")
    parser.add_argument("--dp", type=training.positive_int, help="replicas of the experts (default: world / --ep)")
    args = training.parse(parser, argv)
    args.model = args.model or (None if args.init_from else "moe-tiny")  # a mixture of experts by default

    # ---- process groups: dp replicas of ep consecutive ranks; every rank trains on its own rows of the batch
    rank, local_rank, world_size = training.launched_rank(args)
    ep = args.ep or world_size // (args.dp or 1)
    dp = args.dp or max(1, world_size // ep)
    if ep * dp != world_size:
        launch = f"launch it with torchrun --nproc_per_node={ep * dp}" if world_size == 1 else \
            f"choose --ep and --dp whose product is {world_size}"
        raise training.UsageError(f"--ep {ep} x --dp {dp} = {ep * dp} ranks, but the world has {world_size}: {launch}")
    if args.impl == "torch":
        raise training.UsageError("--impl torch: PyTorch core has no expert parallelism (torchtitan builds its own on "
                                  "DTensor); use --impl ours")
    ep_rank, dp_rank, dp_size = rank % ep, rank, world_size
    if args.plan:  # the memory one rank needs in this layout, and nothing else: no device, data or model
        import plan
        return plan.print_plan(args, world_size, dp_size)
    device = training.get_device(args, local_rank)

    # ---- data: every check of the arguments happens here, on every rank alike, before the first collective
    meta, config, train_data, val_data = training.load_data(args, dp_rank, dp_size, device, is_writer=local_rank == 0)
    if not config.n_expert:
        raise training.UsageError(f"train_ep.py needs a mixture of experts, e.g. --model moe-tiny: "
                                  f"{args.init_from or args.model or 'tiny'} has one MLP a block")
    if config.n_expert % ep:
        divisors = [n for n in range(1, config.n_expert + 1) if config.n_expert % n == 0]
        raise training.UsageError(f"--ep {ep} does not divide the model's {config.n_expert} experts: choose --ep "
                                  f"among {divisors}")
    checkpoint_path = checkpoint.to_resume(args)
    rank, world_size, owns_group = training.init_distributed(args, device)
    ep_group, dp_group = new_groups(ep, dp)
    torch.manual_seed(args.seed + rank)  # dropout masks; the data order depends on (seed, step) alone

    # ---- model: built on meta; each rank materialises its own experts and the rest whole, initialised by name
    with torch.device("meta"):
        model = gpt.GPT(config)
    hold_experts(model, ep_rank, ep)
    model.to_empty(device=device)
    model.init_weights(args.seed, training.initial_values(config, args.seed, args.init_from))
    gpt.set_attention(model, args.attn)

    # ---- strategy: tokens to their experts' ranks and back; gradients summed over the world after backward
    expert_parallel(model, ep_group)
    parts = checkpoint.parameter_parts(model)
    optimizer = training.make_optimizer(training.decay_groups(model.parameters()), args, device)
    forward = training.wrap_blocks(model, args.compile, args.activation_checkpointing)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bfloat16" else nullcontext()

    start_step = checkpoint.resume(checkpoint_path, parts, optimizer, config, rank, device)
    logger = training.Logger(args, config, device, rank, world_size)
    local = config.n_expert // ep
    held = " ".join(f"{e}: {e * local}-{(e + 1) * local - 1}" for e in range(ep))
    logger.print(f"expert parallel: {ep} expert-parallel x {dp} data-parallel | experts of each layer by "
                 f"expert-parallel rank (rank % {ep}) {held} | {config.n_expert_per_token} of "
                 f"{config.n_expert} experts a token")
    logger.start(train_data, dp_size, start_step)

    # ---- loop
    stop_request = training.StopRequest()  # SIGTERM or SIGUSR1: stop after the step, saved
    for step in range(start_step, args.max_steps):
        val_loss = training.evaluate(step, args, forward, val_data, autocast, dist.group.WORLD)
        t0 = time.perf_counter()
        lr = training.set_lr(optimizer, step, args)
        loss_sum = torch.zeros((), device=device)
        for micro_step in range(train_data.accumulation):
            x, y = train_data.get(step, micro_step)
            with autocast:
                loss = forward(x, y) / train_data.accumulation  # this rank's rows' mean; averaged over ranks below
            loss.backward()
            loss_sum += loss.detach()
        all_reduce_gradients(model, dp_group, world_size)
        grad_norm = clip_grad_norm_(model, args.grad_clip or float("inf"), ep_group)
        diverged, stopping = stop_request.agreed(grad_norm, model)  # one read of the device, alike on every rank
        checkpoint.check_finite(diverged, step, loss_sum, grad_norm, args)  # a diverged step changes nothing
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if logger.due(step, val_loss):
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)  # each rank summed only its own rows
            logger.log_step(step, loss_sum, lr, grad_norm, t0, val_loss, stop_request.expert_load)

        # ---- checkpoint: rank 0 writes the shared tensors, the first replica's ranks their experts
        if checkpoint.due(step, args) or stopping:
            owned = [part for part in parts if rank == 0 or (rank < ep and is_expert(part.name))]
            tensors = checkpoint.pieces(owned, optimizer)
            checkpoint.save(args, step + 1, tensors, config, device, rank, world_size)
        if stopping:
            stop_request.stop(step + 1, args.out_dir)

    training.sample(model, meta, args, device, autocast, show=rank == 0)  # every rank: each forward needs them all
    if owns_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    import training
    training.run(main)
