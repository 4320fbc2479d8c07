"""
Fully sharded data parallel (ZeRO-3) by hand: every rank keeps 1/N of each unit's parameters, gradients and AdamW
state. A unit is all-gathered before its forward and its backward; its gradient is reduce-scattered into the shards.
Reads top to bottom: arguments -> process groups -> model -> strategy -> loop -> checkpoint.

    torchrun --standalone --nproc_per_node=2 train_fsdp.py
    torchrun --nproc_per_node=8 train_fsdp.py --model gpt2-xl --data data/openwebtext --block_size 1024 --dtype bfloat16
    torchrun --standalone --nproc_per_node=2 train_fsdp.py --impl torch     # PyTorch's FSDP2 fully_shard, the yardstick
    torchrun --standalone --nproc_per_node=4 train_fsdp.py --replicate 2    # HSDP: 2 copies of 2 shards
"""

import time
from collections import namedtuple
from contextlib import nullcontext
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn

import gpt

all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)  # the name before torch 2.13
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
# uses: every (module, attribute) holding it; span: where it lies in the shard; piece: which of its elements those are
FlatMember = namedtuple("FlatMember", "name shape uses span piece")


def shard_layout(sizes, world, rank):
    """(shard size, padding, [(span in `rank`'s shard, [begin, end) of the parameter's elements there)]) of `sizes`."""
    shard_size = -(-sum(sizes) // world)  # rounded up
    first, offset, spans = rank * shard_size, 0, []  # this rank's first element; the next parameter's
    for size in sizes:
        start = min(max(offset - first, 0), shard_size)  # empty if the parameter lies on other ranks
        stop = min(max(offset + size - first, 0), shard_size)
        spans.append((slice(start, stop), (first + start - offset, first + stop - offset)))
        offset += size
    return shard_size, shard_size * world - sum(sizes), spans


def host_memory(sizes):
    """One host arena cut into tensors of `sizes` elements, pinned where CUDA is by registering it with the driver:
    torch's caching host allocator would round it up to a power of two and keep it. On CPU plain memory, same code."""
    memory = torch.empty(sum(sizes))
    if torch.cuda.is_available() and memory.numel():  # raises if it fails: pageable memory would make copies block
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(memory.data_ptr(), memory.nbytes, 0))
    return memory.split(sizes)


class FlatParameter:
    """One unit's parameters of one kind end to end, padded to a multiple of N: this rank keeps 1/N, `shard` (float32).
    `full`, the whole in `dtype`, has storage from each all-gather to its use's end (autograd's saved views see it
    again once refilled). Built in three steps: the layout (shard_layout), materialise, take_over."""
    def __init__(self, entries, wrapper, compute_dtype):
        self.wrapper, self.full, self.gathering = wrapper, None, None
        self.world, sizes = dist.get_world_size(wrapper.group), [param.numel() for _, param, _ in entries]
        self.shard_size, self.padding, spans = shard_layout(sizes, self.world, dist.get_rank(wrapper.group))
        self.params = [FlatMember(name, p.shape, uses, *where) for (name, p, uses), where in zip(entries, spans)]
        self.decay, self.requires_grad = entries[0][1].dim() >= 2, entries[0][1].requires_grad  # one kind a buffer
        tables = any(name.endswith(("wte.weight", "wpe.weight")) for name, _, _ in entries)  # rows looked up, float32
        self.dtype = compute_dtype if self.decay and not tables else torch.float32  # what autocast casts: a matmul's

    def materialise(self, shard, initial_value, tp_boxes):
        """Deferred init into `shard`, a piece at a time; checkpoint.Part's fields of each piece this rank holds."""
        self.shard, parts = nn.Parameter(shard.zero_(), self.requires_grad), []  # the padding stays zero
        for param in self.params:
            if param.piece[0] < param.piece[1]:
                shape, box = tp_boxes.get(param.name, (param.shape, [(0, n) for n in param.shape]))
                self.shard.detach()[param.span] = initial_value(param.name, shape, box, param.piece)
                parts.append((param.name, shape, box, param.piece, self.shard, param.span.start))
        return parts

    def take_over(self):  # the modules give up their parameters: between gathers, each is its span of `shard` alone
        for param in self.params:
            for module, attribute in param.uses:
                del module._parameters[attribute]

    def views(self, full):  # each parameter's view of a whole flat buffer, in its shape; the padding left out
        pieces = full.split([param.shape.numel() for param in self.params] + [self.padding])
        return [piece.view(param.shape) for piece, param in zip(pieces, self.params)]

    def is_gathered(self):  # or on its way
        return self.full is not None and self.full.untyped_storage().nbytes() > 0

    def start_gather(self):
        """Copy (--cpu_offload), cast, all-gather on the gather stream, after the compute stream's work so far."""
        if not self.is_gathered():
            wrapper, stream = self.wrapper, self.wrapper.gather_stream
            self.full = self.full if self.full is not None else torch.empty(
                self.shard_size * self.world, dtype=self.dtype, device=wrapper.device)
            self.full.untyped_storage().resize_(self.full.nbytes)
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # None (CPU): no stream. The compute stream waits for it in wait_gather
                sent = self.shard.detach().to(self.full.device, non_blocking=True).to(self.full.dtype)  # bf16: half
                self.gathering = (all_gather_single(self.full, sent, group=wrapper.group, async_op=True), sent)

    def wait_gather(self):
        self.start_gather()
        if self.gathering is not None:
            self.gathering[0].wait()  # NCCL: the compute stream waits for it, not the host
            self.gathering = None  # and with it `sent`, held until the collective had read it

    def use_views(self):
        """Each parameter's uses (the module's __dict__, which attribute lookup reads) get its view of `full`. .data: a
        version counter the gathers' writes leave alone: refilling the same weights changes nothing autograd saved."""
        for param, view in zip(self.params, Unsharded.apply(self.shard, self.full.data, self)):
            for module, attribute in param.uses:
                module.__dict__[attribute] = view

    def free(self):
        if self.is_gathered():
            self.wait_gather()  # a prefetch nobody used lands before its storage goes
            self.full.untyped_storage().resize_(0)
        for param in self.params:
            for module, attribute in param.uses:
                module.__dict__.pop(attribute, None)


class Unsharded(torch.autograd.Function):
    """The parameters' views of `full`, one output each, hanging from the shard: autograd sums each one's gradient and
    calls backward once with all, which reduce_scatter copies into one flat buffer (FSDP2's copy-in), no cat."""
    @staticmethod
    def forward(ctx, shard, full, flat):
        ctx.flat = flat
        ctx.set_materialize_grads(False)  # a parameter this pass did not use: None, not a tensor of zeros
        return tuple(flat.views(full))

    @staticmethod
    def backward(ctx, *grads):
        ctx.flat.wrapper.reduce_scatter(ctx.flat, grads)
        ctx.flat.free()
        return None, None, None


def unit_modules(module, units=None):
    """Each unit's modules in the order their forwards run: gpt.GPT's as FSDP2 and torchtitan lay them out (the
    embeddings, each block, the final norm with the LM head); another module's, itself (what no unit holds), `units`."""
    if units is None and isinstance(module, gpt.GPT):
        embeddings = [module.wte] + ([module.wpe] if module.wpe is not None else [])
        return [embeddings] + [[block] for block in module.blocks] + [[module.ln_f, module.lm_head]]
    return [[module]] + [[unit] for unit in units or []]


def flat_parameter_groups(module, units=None):
    """Each unit's FlatParameters, {kind: [(name, parameter, its (module, attribute) uses)]}; plan.py reads it too. A
    tied parameter lives in the first unit using it (wte's, in the embeddings'), kept gathered for the later one."""
    holders = unit_modules(module, units)
    owner = {sub: index for index, unit in enumerate(holders) for top in unit for sub in top.modules()}  # innermost
    uses = {}  # parameter -> every (module, attribute) holding it: a tied weight has two
    for name, param in module.named_parameters(remove_duplicate=False):
        module_name, _, attribute = name.rpartition(".")
        uses.setdefault(param, []).append((module.get_submodule(module_name), attribute))
    groups = [{} for _ in holders]
    for name, param in module.named_parameters():  # a tied parameter once, under its first name
        kind = (param.requires_grad, param.dim() >= 2)
        groups[min(owner[sub] for sub, _ in uses[param])].setdefault(kind, []).append((name, param, uses[param]))
    return groups


class FullyShardedDataParallel(nn.Module):
    """ZeRO-3 on any nn.Module: each unit (unit_modules) gathered to compute, prefetching the next; its matrices in
    `compute_dtype`, the rest, shards, AdamW, gradient reduction float32 (cpu_offload: on the host). initial_value as
    training.initial_values'; tp_boxes: train_2d.py's; replicate_group: HSDP's. parts(), gradients(): spans."""
    def __init__(self, module, units=None, process_group=None, device="cpu", compute_dtype=torch.float32,
                 reshard_after_forward=True, initial_value=None, tp_boxes=None, replicate_group=None,
                 cpu_offload=False):
        super().__init__()
        self.module, self.device, self.reshard_after_forward = module, torch.device(device), reshard_after_forward
        self.group, self.replicate_group = process_group or dist.group.WORLD, replicate_group
        self.gather_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        params = dict(module.named_parameters())  # without initial_value: the values they have, if not on meta
        if initial_value is None and any(param.is_meta for param in params.values()):
            raise ValueError("the module is on meta: pass initial_value to say what its parameters start as")
        initial_value = initial_value or (lambda name, _, __, flat: params[name].detach().reshape(-1)[slice(*flat)])
        holders = unit_modules(module, units)
        self.units = [[FlatParameter(entries, self, compute_dtype) for entries in kinds.values()]
                      for kinds in flat_parameter_groups(module, units)]
        self.flats = [flat for unit in self.units for flat in unit]
        sizes = [flat.shard_size for flat in self.flats]  # --cpu_offload: one host arena of shards, one of gradients
        shards = host_memory(sizes) if cpu_offload else [torch.empty(n, device=device) for n in sizes]
        host_grads = host_memory(sizes) if cpu_offload else [None] * len(sizes)  # where reduced gradients land
        self._parts = []
        for flat, shard, flat.host_grad in zip(self.flats, shards, host_grads):
            self._parts += flat.materialise(shard, initial_value, tp_boxes or {})
            flat.take_over()
        self.shards = nn.ParameterList(flat.shard for flat in self.flats)  # the module's parameters, sharded
        for name, b in module.to_empty(device=device).named_buffers():  # all it holds now: a mixture's balancing state
            self._parts.append((name, b.shape, [(0, n) for n in b.shape], (0, b.numel()), b.zero_(), 0))  # whole
        # Kept gathered from forward to backward (so plan.py counts): the last unit, and one holding a tied weight (wte)
        self.keep = [index == len(holders) - 1 or any(len(param.uses) > 1 for flat in unit for param in flat.params)
                     for index, unit in enumerate(self.units)]
        for index, modules in enumerate(holders):  # a unit of several modules starts with its first, ends with its last
            modules[0].register_forward_pre_hook(partial(self.gather, index, +1))
            modules[-1].register_forward_hook(partial(self._after_forward, index))
        self.in_flight, self.averaging, self.backward_begun = None, None, False  # each finished as the next starts

    def forward(self, *args, **kwargs):
        output = self.module(*args, **kwargs)
        for flat in self.flats if not torch.is_grad_enabled() else []:  # evaluation: the units kept for backward too
            flat.free()
        return output

    @torch.compiler.disable  # --compile: the model compiles between the units' hooks, which run as written
    def gather(self, index, direction, *hook):  # unit `index`, once the next one's (forward +1, backward -1) started
        following = index + direction  # the units run in the order they are listed; the first and last prefetch none
        for flat in self.units[index] + (self.units[following] if 0 <= following < len(self.units) else []):
            flat.start_gather()
        with torch.enable_grad() if direction < 0 else nullcontext():  # for --activation_checkpointing's recompute
            for flat in self.units[index]:
                flat.wait_gather()
                flat.use_views()

    @torch.compiler.disable
    def _after_forward(self, index, module, args, output):
        if not self.keep[index] and (self.reshard_after_forward or not torch.is_grad_enabled()):
            for flat in self.units[index]:
                flat.free()
        outputs = [out for out in torch.utils._pytree.tree_leaves(output) if getattr(out, "requires_grad", False)]
        if outputs:  # its backward begins with the first output's gradient, hooked as FSDP2 does (wpe's with wte's)
            torch.autograd.graph.register_multi_grad_hook(outputs, partial(self._before_backward, index), mode="any")

    def _before_backward(self, index, grad):
        if not self.backward_begun:  # the first unit of this backward
            self.backward_begun = True
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
        self.gather(index, -1)

    def _after_backward(self):
        self.finish_reduce_scatter()
        self.finish_average()  # HSDP: before the optimizer step reads the gradients
        self.backward_begun = False
        for flat in self.flats:  # kept ones, frozen ones, a prefetch nobody used: none may outlive the update
            flat.free()

    def reduce_scatter(self, flat, grads):
        """Copy (cast) the gradients into one float32 buffer laid out as `full`; average it into this rank's piece."""
        self.finish_reduce_scatter()  # the previous unit's first
        buffer = torch.empty(flat.shard_size * flat.world, device=self.device)  # float32: bf16 sums lose low bits
        views = flat.views(buffer)
        torch._foreach_copy_(*zip(*[(view, grad) for view, grad in zip(views, grads) if grad is not None]))
        for view in [view for view, grad in zip(views, grads) if grad is None] + [buffer[len(buffer) - flat.padding:]]:
            view.zero_()  # a parameter this pass left unused, and the padding
        piece = buffer.new_empty(flat.shard_size)
        work = reduce_scatter_single(piece, buffer, op=dist.ReduceOp.AVG, group=self.group, async_op=True)
        self.in_flight = (flat, piece, buffer, work)

    def finish_reduce_scatter(self):
        if self.in_flight is not None:
            flat, piece, _, work = self.in_flight
            work.wait()
            self.in_flight = None
            self.finish_average()
            if self.replicate_group is None:
                return self.accumulate(flat, piece)
            # HSDP: averaged over the shard group, now over its copies too, while the next unit's backward runs
            self.averaging = (flat, piece, dist.all_reduce(piece, op=dist.ReduceOp.AVG, group=self.replicate_group,
                                                           async_op=True))

    def finish_average(self):
        if self.averaging is not None:
            flat, piece, work = self.averaging
            work.wait()
            self.averaging = None
            self.accumulate(flat, piece)

    def accumulate(self, flat, piece):  # over micro-steps; --cpu_offload: into the host arena (AdamW reads it next)
        if flat.shard.grad is not None:
            return flat.shard.grad.add_(piece.to(flat.shard.grad.device))
        flat.shard.grad = piece if flat.host_grad is None else flat.host_grad.copy_(piece)

    def parameter_groups(self):  # (with weight decay, without): the trainable shards, for training.make_optimizer
        trained = [flat for flat in self.flats if flat.shard.requires_grad]
        return [f.shard for f in trained if f.decay], [f.shard for f in trained if not f.decay]

    def gradients(self):  # (name, this rank's span of its gradient) of each parameter whose shard has one
        return [(p.name, f.shard.grad[p.span]) for f in self.flats if f.shard.grad is not None for p in f.params]

    def clip_grad_norm_(self, max_norm, counted=None, group=None):
        """The model's gradient norm, summed over `group`, of the parameters this rank counts (default: all)."""
        grads = [grad for name, grad in self.gradients() if counted is None or counted(name)]
        total = nn.utils.get_total_norm(grads, foreach=True).to(self.device) ** 2  # one kernel a device and dtype
        dist.all_reduce(total, group=group or self.group)  # the squared norm of the whole model, on the device
        norm = total.sqrt()
        nn.utils.clip_grads_with_norm_(list(self.shards), max_norm, norm)
        return norm

    def parts(self):  # checkpoint.Part's fields of every piece this rank holds
        return self._parts


def hybrid_groups(replicate):
    """This rank's (shard group: world / replicate consecutive ranks, a node; replicate group: the ranks at its place
    in every shard group). dist.new_group is collective: every rank creates every group."""
    rank, shards = dist.get_rank(), dist.get_world_size() // replicate
    shard_groups = [dist.new_group(list(range(r * shards, (r + 1) * shards))) for r in range(replicate)]
    replicate_groups = [dist.new_group(list(range(s, shards * replicate, shards))) for s in range(shards)]
    return shard_groups[rank // shards], replicate_groups[rank % shards]


def main(argv=None):
    import checkpoint  # main() is where a script meets the shared files; everything above needs torch and gpt.py
    import training

    parser = training.get_parser(__doc__, "fsdp")
    parser.add_argument("--impl", default="ours", choices=["ours", "torch"], help="torch: FSDP2's fully_shard")
    parser.add_argument("--no_reshard", action="store_true", help="keep each unit gathered from forward to backward")
    parser.add_argument("--no_deferred_init", action="store_true", help="build the whole model first, not on meta")
    parser.add_argument("--cpu_offload", action="store_true", help="float32 shards, gradients, AdamW on the host")
    parser.add_argument("--replicate", type=training.positive_int, default=1, help="HSDP: R copies of the shards")
    args = training.parse(parser, argv)

    # ---- process groups: every rank is one data-parallel rank holding 1/world of the model (HSDP: 1/shards)
    rank, local_rank, world_size = training.launched_rank(args)
    dp_rank, dp_size = rank, world_size
    if world_size % args.replicate:
        raise training.UsageError(f"--replicate {args.replicate} does not divide world size {world_size} into shard "
                                  f"groups of equal size: choose a divisor of {world_size}")
    shards = world_size // args.replicate
    if args.plan:  # the memory one rank needs in this layout, and nothing else: no device, data or model
        import plan
        return plan.print_plan(args, world_size, dp_size, units=flat_parameter_groups)
    device = training.get_device(args, local_rank)

    # ---- data: every check of the arguments happens here, on every rank alike, before the first collective
    meta, config, train_data, val_data = training.load_data(args, dp_rank, dp_size, device, is_writer=local_rank == 0)
    checkpoint_path = checkpoint.to_resume(args)
    rank, world_size, owns_group = training.init_distributed(args, device)
    shard_group, replicate_group = hybrid_groups(args.replicate) if args.replicate > 1 else (None, None)
    torch.manual_seed(args.seed + rank)  # dropout masks; the data order depends on (seed, step) alone

    # ---- model: built on meta, left there for the strategy to materialise shard by shard (--no_deferred_init: whole)
    value = training.initial_values(config, args.seed, args.init_from)  # drawn by name, or read from --init_from
    with torch.device("meta"):
        model = gpt.GPT(config)
    if args.no_deferred_init:  # the whole model on every rank first, as train_single.py builds it
        model.to_empty(device=device)
        model.init_weights(args.seed, value)
    gpt.set_attention(model, args.attn)

    # ---- strategy: each unit's parameters, gradients and AdamW state sharded over the ranks; gathered to compute
    if args.impl == "torch":
        import torch_reference
        model, groups, clip_grad_norm = torch_reference.fully_shard_model(model, config, args, device)
        parts = None  # its checkpoints gather each tensor whole
    else:
        model = FullyShardedDataParallel(
            model, process_group=shard_group, device=device, compute_dtype=getattr(torch, args.dtype),
            reshard_after_forward=not args.no_reshard, initial_value=value, replicate_group=replicate_group,
            cpu_offload=args.cpu_offload)
        groups, clip_grad_norm = model.parameter_groups(), model.clip_grad_norm_
        parts = [checkpoint.Part(*where) for where in model.parts()]
    optimizer = training.make_optimizer(groups, args, device)
    forward = training.wrap_blocks(model, args.compile, args.activation_checkpointing)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bfloat16" else nullcontext()

    start_step = checkpoint.resume(checkpoint_path, parts, optimizer, config, rank, device)
    logger = training.Logger(args, config, device, rank, world_size)
    hybrid = f"HSDP {args.replicate} x {shards} | "
    logger.start(train_data, dp_size, start_step, layout=hybrid if args.replicate > 1 else "FSDP | ")

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
                loss = forward(x, y) / train_data.accumulation  # gradient of the mean over the global batch
            loss.backward()  # each unit's gradient is reduce-scattered (averaged over ranks) as its backward ends
            loss_sum += loss.detach()
        grad_norm = clip_grad_norm(args.grad_clip or float("inf"))
        diverged, stopping = stop_request.agreed(grad_norm, model)  # one read of the device, alike on every rank
        checkpoint.check_finite(diverged, step, loss_sum, grad_norm, args)  # a diverged step changes nothing
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if logger.due(step, val_loss):
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)  # each rank summed only its own rows
            logger.log_step(step, loss_sum, lr, grad_norm, t0, val_loss, stop_request.expert_load)

        # ---- checkpoint: every rank writes the pieces its shards hold (HSDP: the first shard group; the others copy)
        if checkpoint.due(step, args) or stopping:
            tensors = (torch_reference.full_tensors(model, optimizer, rank == 0) if parts is None
                       else checkpoint.pieces(parts if rank < shards else [], optimizer))
            checkpoint.save(args, step + 1, tensors, config, device, rank, world_size)
        if stopping:
            stop_request.stop(step + 1, args.out_dir)

    training.sample(model, meta, args, device, autocast, show=rank == 0)  # every rank: each forward gathers from all
    if owns_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    import training
    training.run(main)
