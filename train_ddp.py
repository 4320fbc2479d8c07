r"""
Data parallel, by hand: every rank holds the whole model and trains on its own rows of the global batch; gradients
are averaged over the ranks by bucketed all-reduces that overlap the backward pass.

    torchrun --standalone --nproc_per_node=2 train_ddp.py                   # tiny model, embedded default corpus
    torchrun --nproc_per_node=8 train_ddp.py --model gpt2 --data data/openwebtext --block_size 1024 \
        --dtype bfloat16 --compile
    torchrun --standalone --nproc_per_node=2 train_ddp.py --impl torch      # the same loop with PyTorch's DDP

Reads top to bottom: arguments -> process groups -> model -> strategy -> loop -> checkpoint.
"""

import functools
import itertools
import time
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn

import gpt


class Bucket:
    """Parameters whose gradients live in one flat buffer and travel in one all-reduce."""

    def __init__(self, named_params, padded_to=1):
        self.names, self.params = [name for name, _ in named_params], [p for _, p in named_params]
        sizes = [p.numel() for p in self.params]
        padded = -(-sum(sizes) // padded_to) * padded_to  # train_zero.py cuts a bucket into padded_to equal slices
        self.buffer = torch.zeros(padded, dtype=self.params[0].dtype, device=self.params[0].device)
        pieces = self.buffer.split(sizes + [padded - sum(sizes)])
        self.grads = [piece.view_as(p) for piece, p in zip(pieces, self.params)]
        self.ready = set()  # parameters whose gradient this backward has finished accumulating
        self.work = None  # the all-reduce in flight

    def is_full(self):
        return len(self.ready) == len(self.params)


FIRST_BUCKET_MB = 1


def assign_buckets(named_params, bucket_mb):
    """[[(name, parameter)] per bucket]: in the order backward produces gradients (the reverse of registration),
    at most bucket_mb MiB and one dtype a bucket. Needs no process group: bench.py counts the all-reduces from it."""
    buckets, group, size = [], [], 0
    for name, param in reversed(named_params):
        nbytes = param.numel() * param.element_size()
        # The first bucket is small, as in DistributedDataParallel: its all-reduce starts after the first few
        # gradients instead of a whole bucket_mb of them, so communication overlaps most of backward.
        cap = min(bucket_mb, FIRST_BUCKET_MB) if not buckets else bucket_mb
        if group and (size + nbytes > cap * 2**20 or param.dtype != group[0][1].dtype):
            buckets.append(group)
            group, size = [], 0
        group.append((name, param))
        size += nbytes
    return buckets + [group] if group else buckets


class DataParallel(nn.Module):
    """Wraps any module so that, after backward, every parameter's .grad is the mean of the ranks' gradients.

    Gradients live in flat buckets of at most bucket_mb MiB, filled in the order backward produces them (the
    reverse of registration order), and every param.grad is a view into its bucket: a bucket is all-reduced in
    place, with no copy in or out. As soon as backward has accumulated a bucket's last gradient, its all-reduce
    starts asynchronously and overlaps the rest of backward; one callback at the end of backward waits for them
    all. Inside no_sync() gradients only accumulate. Zero gradients in place (zero_grad(set_to_none=False)):
    set_to_none drops the views, and each gradient then costs a copy back into its bucket.
    """

    def __init__(self, module, bucket_mb=25, process_group=None, padded_to=1):
        super().__init__()
        self.module = module
        self.process_group = process_group or dist.group.WORLD
        with torch.no_grad():  # replicas that start apart would never meet again
            for tensor in itertools.chain(module.parameters(), module.buffers()):
                dist.broadcast(tensor, dist.get_global_rank(self.process_group, 0), group=self.process_group)
        # named_parameters() lists a shared (tied) parameter once, so it is reduced once; frozen ones are left alone.
        trainable = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self.buckets = [Bucket(named_params, padded_to) for named_params in assign_buckets(trainable, bucket_mb)]
        for bucket in self.buckets:
            for param, grad in zip(bucket.params, bucket.grads):
                param.grad = grad
                param.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, bucket, grad))
        self.require_sync = True
        self.next_bucket = 0  # launched in order: every rank issues the same all-reduces in the same order
        self.callback_queued = False

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate gradients; the first backward outside all-reduces the sum."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous

    def _grad_ready(self, bucket, grad, param):
        """Post-accumulate-grad hook: runs once a backward, after param.grad holds the whole of this pass's gradient."""
        if param.grad is not grad:  # zero_grad(set_to_none=True) dropped the view: back into the bucket
            grad.copy_(param.grad)
            param.grad = grad
        if not self.require_sync:
            return
        if not self.callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self.callback_queued = True
        bucket.ready.add(param)
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].is_full():
            self.reduce(self.buckets[self.next_bucket])
            self.next_bucket += 1

    def reduce(self, bucket):
        """Start averaging the bucket's gradient over the ranks (train_zero.py's ZeRO-2 reduce-scatters it instead)."""
        bucket.work = dist.all_reduce(bucket.buffer, op=dist.ReduceOp.AVG, group=self.process_group, async_op=True)

    def _finish_backward(self):
        """Runs once backward has finished: waiting here, not in a hook, leaves backward free to run ahead."""
        launched, self.next_bucket, self.callback_queued = self.next_bucket, 0, False
        unused = [name for bucket in self.buckets[launched:]
                  for name, param in zip(bucket.names, bucket.params) if param not in bucket.ready]
        for bucket in self.buckets:
            bucket.ready.clear()
        if unused:
            raise RuntimeError(f"parameters {unused} received no gradient in this backward pass, so their bucket's "
                               "all-reduce cannot start and every rank would wait for it; use them in forward, or "
                               "set requires_grad=False on them before wrapping the module")
        for bucket in self.buckets:
            self.finish(bucket)

    def finish(self, bucket):
        bucket.work.wait()
        bucket.work = None


def main(argv=None):
    import checkpoint  # main() is where a script meets the shared files; everything above needs torch and gpt.py
    import training

    parser = training.get_parser(__doc__, "ddp")
    parser.add_argument("--impl", default="ours", choices=["ours", "torch"],
                        help="ours: DataParallel above; torch: torch.nn.parallel.DistributedDataParallel")
    parser.add_argument("--bucket_mb", type=training.positive, default=25, help="largest gradient bucket, in MiB")
    args = training.parse(parser, argv)

    # ---- process groups: every rank is one data-parallel rank holding the whole model
    rank, local_rank, world_size = training.launched_rank(args)
    dp_rank, dp_size = rank, world_size
    if args.plan:  # the memory one rank needs in this layout, and nothing else: no device, data or model
        import plan
        return plan.print_plan(args, world_size, dp_size)
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

    # ---- strategy: a whole replica on every rank, gradients averaged over the ranks during backward
    if args.impl == "torch":
        import torch_reference
        ddp_model = torch_reference.data_parallel(model, device, args.bucket_mb)
    else:
        ddp_model = DataParallel(model, args.bucket_mb)
    parts = checkpoint.parameter_parts(model)
    optimizer = training.make_optimizer(training.decay_groups(model.parameters()), args, device)
    forward = training.wrap_blocks(ddp_model, args.compile, args.activation_checkpointing)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bfloat16" else nullcontext()

    start_step = checkpoint.resume(checkpoint_path, parts, optimizer, config, rank, device)
    logger = training.Logger(args, config, device, rank, world_size)
    logger.start(train_data, dp_size, start_step, layout="DDP | ")

    # ---- loop
    stop_request = training.StopRequest()  # SIGTERM or SIGUSR1: stop after the step, saved
    for step in range(start_step, args.max_steps):
        val_loss = training.evaluate(step, args, forward, val_data, autocast, dist.group.WORLD)
        t0 = time.perf_counter()
        lr = training.set_lr(optimizer, step, args)
        loss_sum = torch.zeros((), device=device)
        for micro_step in range(train_data.accumulation):
            x, y = train_data.get(step, micro_step)
            # Only the last micro-step's backward all-reduces; the ones before accumulate locally.
            with nullcontext() if micro_step + 1 == train_data.accumulation else ddp_model.no_sync():
                with autocast:
                    loss = forward(x, y) / train_data.accumulation  # gradient of the mean over the global batch
                loss.backward()
            loss_sum += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip or float("inf"))
        diverged, stopping = stop_request.agreed(grad_norm, model)  # one read of the device, alike on every rank
        checkpoint.check_finite(diverged, step, loss_sum, grad_norm, args)  # a diverged step changes nothing
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # in place: the gradients are views into the all-reduce buckets

        if logger.due(step, val_loss):
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)  # each rank summed only its own rows
            logger.log_step(step, loss_sum, lr, grad_norm, t0, val_loss, stop_request.expert_load)

        # ---- checkpoint: every replica holds everything, so rank 0 alone writes the tensors
        if checkpoint.due(step, args) or stopping:
            tensors = checkpoint.pieces(parts if rank == 0 else [], optimizer)
            checkpoint.save(args, step + 1, tensors, config, device, rank, world_size)
        if stopping:
            stop_request.stop(step + 1, args.out_dir)

    training.sample(model, meta, args, device, autocast, show=rank == 0)
    if owns_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    import training
    training.run(main)
