r"""
ZeRO-1 and ZeRO-2 by hand, on train_ddp.py's gradient buckets: every rank holds the whole model and trains on its own
rows, but keeps AdamW's moments (stage 1), and the averaged gradient too (stage 2), only for its own contiguous 1/N
of each bucket. It steps that slice alone, then all-gathers every rank's updated slices into its weights.

    torchrun --standalone --nproc_per_node=2 train_zero.py --stage 1
    torchrun --standalone --nproc_per_node=2 train_zero.py --stage 2
    torchrun --nproc_per_node=8 train_zero.py --stage 2 --model gpt2 --data data/openwebtext --block_size 1024 \
        --dtype bfloat16 --compile
    torchrun --standalone --nproc_per_node=2 train_zero.py --impl torch    # DDP with PyTorch's ZeroRedundancyOptimizer

Reads top to bottom: arguments -> process groups -> model -> strategy -> loop -> checkpoint.
"""

import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn

import gpt
import train_ddp

all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)  # the name before torch 2.13
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class ZeroStage1(train_ddp.DataParallel):
    """ZeRO-1: DataParallel's buckets, each padded to N·n elements; rank r owns elements [r·n, (r+1)·n) of each, its
    slice. Gradients accumulate whole, as DDP's do, but each bucket is reduce-scattered into the slices, which alone
    the optimizer steps. The weights live in flat buffers laid out as the gradient buckets (every parameter a view
    into one); each parameter's part of this rank's slice is a piece, a parameter of its own with its own decay and
    AdamW state, whose gradient is a view into the gradient's slice. After the step, gather_parameters() all-gathers
    the slices into every rank's weights. Zero the gradients in place (zero_grad(set_to_none=False)): they are views
    into the buckets."""

    def __init__(self, module, bucket_mb=25, process_group=None):
        group = process_group or dist.group.WORLD
        super().__init__(module, bucket_mb, group, padded_to=dist.get_world_size(group))
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        self.parts = []  # checkpoint.Part's fields of every piece: (name, full shape, box, [begin, end), piece)
        self.decays = []  # whether each piece's parameter is a matrix (training.decay_groups' rule)
        pieces = []
        for bucket in self.buckets:
            size = bucket.buffer.numel() // world
            bucket.slice = slice(rank * size, (rank + 1) * size)
            bucket.weights = torch.zeros_like(bucket.buffer)  # the padding stays zero
            bucket.gradient_slice = self.slice_of_gradient(bucket)
            offset = 0
            for name, param in zip(bucket.names, bucket.params):
                weights = bucket.weights[offset:offset + param.numel()]
                weights.copy_(param.detach().view(-1))
                param.data = weights.view_as(param)  # the module computes with the flat buffer's values
                start, stop = max(offset, bucket.slice.start), min(offset + param.numel(), bucket.slice.stop)
                if start < stop:  # a slice may span several parameters, or a part of one
                    pieces.append(nn.Parameter(bucket.weights[start:stop]))
                    pieces[-1].grad = bucket.gradient_slice[start - bucket.slice.start:stop - bucket.slice.start]
                    self.parts.append((name, param.shape, [(0, n) for n in param.shape],
                                       (start - offset, stop - offset), pieces[-1]))
                    self.decays.append(param.dim() >= 2)
                offset += param.numel()
        self.pieces = nn.ParameterList(pieces)  # registered: zero_grad() reaches their gradients too

    def slice_of_gradient(self, bucket):
        """Where this rank's slice of the bucket's averaged gradient lives: under ZeRO-1, in the whole bucket."""
        return bucket.buffer[bucket.slice]

    def reduce(self, bucket):
        """Reduce-scatter the bucket into this rank's slice of it, in place (NCCL's in-place case: the output is the
        input's own rank-th slice). The optimizer reads nothing else: an all-reduce would send (N-1)/N · 4Ψ more
        bytes for slices no one steps. The rest of the bucket keeps this rank's own sum, read by no one."""
        bucket.work = reduce_scatter_single(bucket.gradient_slice, bucket.buffer, op=dist.ReduceOp.AVG,
                                            group=self.process_group, async_op=True)

    def parameter_groups(self):
        """(with weight decay, without): this rank's pieces, for training.make_optimizer."""
        return ([piece for piece, decay in zip(self.pieces, self.decays) if decay],
                [piece for piece, decay in zip(self.pieces, self.decays) if not decay])

    def clip_grad_norm_(self, max_norm):
        """The whole model's gradient norm from the ranks' slices, disjoint parts of it (the padding's gradient is
        zero): one all-reduce of a number. Only this rank's pieces are clipped: they are all it steps."""
        total = sum(bucket.gradient_slice.pow(2).sum() for bucket in self.buckets)
        dist.all_reduce(total, group=self.process_group)
        norm = total.sqrt()
        nn.utils.clip_grads_with_norm_(self.pieces, max_norm, norm)
        return norm

    @torch.no_grad()
    def gather_parameters(self):
        """Every rank's slices into every rank's weights, in place: this rank's slice lies where the gather puts it."""
        works = [all_gather_single(bucket.weights, bucket.weights[bucket.slice], group=self.process_group,
                                   async_op=True) for bucket in self.buckets]
        for work in works:
            work.wait()


class ZeroStage2(ZeroStage1):
    """ZeRO-2: also the averaged gradient only for this rank's slice, in storage of its own, where micro-steps
    accumulate (ZeRO-1 accumulates in the whole buckets and reduces once). Each bucket is reduce-scattered as soon as
    backward has filled it, and the bucket's whole gradient exists only from its first gradient to the end of its
    reduce-scatter, which is waited for when the next bucket's starts: one in flight while the next one fills. Each
    backward reduce-scatters and the slices add up; inside no_sync() the whole buckets accumulate instead."""

    def __init__(self, module, bucket_mb=25, process_group=None):
        super().__init__(module, bucket_mb, process_group)
        for bucket in self.buckets:
            self.release(bucket)

    def slice_of_gradient(self, bucket):
        return torch.zeros_like(bucket.buffer[bucket.slice])  # its own storage: the bucket's comes and goes

    def _grad_ready(self, bucket, grad, param):
        if bucket.buffer.untyped_storage().size() == 0:  # the bucket's first gradient: its buffer comes back, zeroed
            bucket.buffer.untyped_storage().resize_(bucket.buffer.numel() * bucket.buffer.element_size())
            bucket.buffer.zero_()
        super()._grad_ready(bucket, grad, param)  # which copies param.grad into the bucket, and reduces it once full

    def reduce(self, bucket):
        if self.next_bucket:  # the previous bucket's reduce-scatter lands and frees its buffer first
            self.finish(self.buckets[self.next_bucket - 1])
        received = torch.empty_like(bucket.gradient_slice)
        work = reduce_scatter_single(received, bucket.buffer, op=dist.ReduceOp.AVG, group=self.process_group,
                                     async_op=True)
        bucket.work = (work, received)

    def finish(self, bucket):
        if bucket.work is None:  # landed already, when the next bucket's reduce-scatter started
            return
        work, received = bucket.work
        work.wait()
        bucket.gradient_slice += received  # micro-steps add up
        bucket.work = None
        self.release(bucket)

    def release(self, bucket):
        """Free the bucket's whole gradient: its storage shrinks to nothing, and the parameters drop their views."""
        for param in bucket.params:
            param.grad = None
        bucket.buffer.untyped_storage().resize_(0)


def main(argv=None):
    import checkpoint  # main() is where a script meets the shared files; everything above needs torch and gpt.py
    import training

    parser = training.get_parser(__doc__, "zero")
    parser.add_argument("--stage", type=int, default=1, choices=[1, 2],
                        help="1: AdamW's moments sharded over the ranks; 2: the gradients too")
    parser.add_argument("--impl", default="ours", choices=["ours", "torch"],
                        help="torch: DistributedDataParallel with ZeroRedundancyOptimizer (stage 1; PyTorch has no "
                        "ZeRO-2)")
    parser.add_argument("--bucket_mb", type=training.positive, default=25, help="largest gradient bucket, in MiB")
    args = training.parse(parser, argv)

    # ---- process groups: every rank is one data-parallel rank holding the whole model and 1/world of its AdamW state
    rank, local_rank, world_size = training.launched_rank(args)
    dp_rank, dp_size = rank, world_size
    if args.impl == "torch" and args.stage == 2:
        raise training.UsageError("--impl torch has no --stage 2: PyTorch has no ZeRO-2 (FSDP's SHARD_GRAD_OP also "
                                  "shards the weights); use --stage 1 or --impl ours")
    if args.plan:  # the memory one rank needs in this layout, and nothing else: no device, data or model
        import plan
        return plan.print_plan(args, world_size, dp_size, buckets=train_ddp.assign_buckets)
    device = training.get_device(args, local_rank)

    # ---- data: every check of the arguments happens here, on every rank alike, before the first collective
    meta, config, train_data, val_data = training.load_data(args, dp_rank, dp_size, device, is_writer=local_rank == 0)
    checkpoint_path = checkpoint.to_resume(args)
    rank, world_size, owns_group = training.init_distributed(args, device)
    torch.manual_seed(args.seed + rank)  # dropout masks; the data order depends on (seed, step) alone

    # ---- model: built on meta, materialised on the device, initialised by parameter name (or from --init_from)
    with torch.device("meta"):
        model = gpt.GPT(config)
    model.to_empty(device=device)
    model.init_weights(args.seed, training.initial_values(config, args.seed, args.init_from))
    gpt.set_attention(model, args.attn)

    # ---- strategy: a whole replica on every rank; AdamW (and, stage 2, the averaged gradient) on its slices only
    if args.impl == "torch":
        import torch_reference
        ddp_model, optimizer, parts = torch_reference.zero_redundancy(model, device, args)
    else:
        ddp_model = (ZeroStage1 if args.stage == 1 else ZeroStage2)(model, args.bucket_mb)
        optimizer = training.make_optimizer(ddp_model.parameter_groups(), args, device)
        parts = [checkpoint.Part(*where) for where in ddp_model.parts]
    forward = training.wrap_blocks(ddp_model, args.compile, args.activation_checkpointing)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bfloat16" else nullcontext()

    start_step = checkpoint.resume(checkpoint_path, parts, optimizer, config, rank, device)
    ddp_model.gather_parameters()  # a resumed rank has loaded only its own slices
    logger = training.Logger(args, config, device, rank, world_size)
    logger.start(train_data, dp_size, start_step, layout=f"ZeRO-{args.stage} | ")

    # ---- loop
    stop_request = training.StopRequest()  # SIGTERM or SIGUSR1: stop after the step, saved
    for step in range(start_step, args.max_steps):
        val_loss = training.evaluate(step, args, forward, val_data, autocast, dist.group.WORLD)
        t0 = time.perf_counter()
        lr = training.set_lr(optimizer, step, args)
        loss_sum = torch.zeros((), device=device)
        for micro_step in range(train_data.accumulation):
            x, y = train_data.get(step, micro_step)
            # Both stages reduce-scatter; they differ in where the micro-steps accumulate. Stage 1 in the whole
            # buckets, reduced in the last micro-step only, as DDP; stage 2 in the slices, reduced every micro-step,
            # k times the bytes, so that no rank ever holds the whole gradient (no_sync would keep it whole).
            with nullcontext() if micro_step + 1 == train_data.accumulation or args.stage == 2 else ddp_model.no_sync():
                with autocast:
                    loss = forward(x, y) / train_data.accumulation  # gradient of the mean over the global batch
                loss.backward()
            loss_sum += loss.detach()
        grad_norm = ddp_model.clip_grad_norm_(args.grad_clip or float("inf"))  # over the ranks' slices
        diverged, stopping = stop_request.agreed(grad_norm, model)  # one read of the device, alike on every rank
        checkpoint.check_finite(diverged, step, loss_sum, grad_norm, args)  # a diverged step changes nothing
        optimizer.step()  # this rank's slices only
        ddp_model.gather_parameters()  # every rank's updated slices, into every rank's weights
        ddp_model.zero_grad(set_to_none=False)  # in place, every bucket: the optimizer holds only this rank's slices

        if logger.due(step, val_loss):
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)  # each rank summed only its own rows
            logger.log_step(step, loss_sum, lr, grad_norm, t0, val_loss, stop_request.expert_load)

        # ---- checkpoint: every rank writes its own slices, the only copy of their AdamW moments
        if checkpoint.due(step, args) or stopping:
            tensors = checkpoint.pieces(parts, optimizer)
            checkpoint.save(args, step + 1, tensors, config, device, rank, world_size)
        if stopping:
            stop_request.stop(step + 1, args.out_dir)

    training.sample(model, meta, args, device, autocast, show=rank == 0)
    if owns_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    import training
    training.run(main)
