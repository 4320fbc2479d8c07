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
FlatMember = namedtuple("FlatMember", "name shape uses local span")  # uses: every (module, attribute) holding it


class FlatParameter:
    """One unit's parameters of one kind end to end, padded to a multiple of N. This rank keeps 1/N, `shard` (float32
    master weights), and registers each parameter as its piece of it. `full` is the whole, in the compute dtype: one
    buffer whose storage is allocated for each all-gather and freed after use, as FSDP does. Autograd keeps the views
    it saved for backward; they point into the storage again once the next gather has refilled it."""
    def __init__(self, entries, wrapper, initial_value):
        self.wrapper = wrapper
        self.world = dist.get_world_size(wrapper.group)
        total = sum(param.numel() for _, param, _ in entries)
        self.shard_size = -(-total // self.world)  # rounded up
        self.padding = self.shard_size * self.world - total
        self.decay = entries[0][1].dim() >= 2  # one kind a buffer: the first parameter speaks for all
        self.shard = nn.Parameter(torch.zeros(self.shard_size, **wrapper.shard_memory), entries[0][1].requires_grad)
        self.full = None  # allocated by the first all-gather; its storage freed after each use, refilled for the next
        self.gathering = None  # the all-gather in flight, and the tensor it reads
        self.params = []  # one record a parameter: its name, shape, uses, registered piece and that piece's span
        self.parts = []  # checkpoint.Part's fields: (name, full shape, box, [begin, end) of the box, shard, start)
        first = dist.get_rank(wrapper.group) * self.shard_size  # this rank's first element of the flat parameter
        offset = 0  # the next parameter's first element
        for name, param, uses in entries:
            start = min(max(offset - first, 0), self.shard_size)  # [start, stop): where it falls in this shard
            stop = min(max(offset + param.numel() - first, 0), self.shard_size)
            local = nn.Parameter(self.shard.detach()[start:stop], param.requires_grad)  # empty if on other ranks
            for module, attribute in uses:
                module._parameters[attribute] = local  # the module's names reach this rank's piece
            self.params.append(FlatMember(name, param.shape, uses, local, slice(start, stop)))
            if start < stop:  # deferred init: one piece of one parameter at a time, never a whole buffer
                piece = (first + start - offset, first + stop - offset)
                shape, box = wrapper.tp_boxes.get(name, (param.shape, [(0, n) for n in param.shape]))
                self.shard.detach()[start:stop] = initial_value(name, shape, box, piece)  # the padding stays zero
                self.parts.append((name, shape, box, piece, self.shard, start))
            offset += param.numel()

    def views(self, full):
        """Each parameter's view of a whole flat buffer, in its shape; the padding at the end left out."""
        pieces = full.split([param.shape.numel() for param in self.params] + [self.padding])
        return [piece.view(param.shape) for piece, param in zip(pieces, self.params)]

    def is_gathered(self):  # or on its way
        return self.full is not None and self.full.untyped_storage().nbytes() > 0

    def start_gather(self):
        if not self.is_gathered():
            if self.full is None:
                self.full = torch.empty(self.shard_size * self.world, dtype=self.wrapper.compute_dtype,
                                        device=self.wrapper.device)
            self.full.untyped_storage().resize_(self.full.nbytes)
            # --cpu_offload: the shard crosses to the device first, not waited for: issued with the prefetch
            sent = self.shard.detach().to(self.full.device, non_blocking=True)
            sent = sent.to(self.full.dtype)  # cast before sending: bf16 moves half the bytes
            self.gathering = (all_gather_single(self.full, sent, group=self.wrapper.group, async_op=True), sent)

    def wait_gather(self):
        self.start_gather()
        if self.gathering is not None:
            self.gathering[0].wait()
            self.gathering = None  # and with it `sent`, held until the collective had read it

    def use_views(self):
        """Each parameter's uses read its view of `full`, through which its gradient reaches the reduce-scatter. The
        view goes in the module's __dict__: normal attribute lookup finds it there first, and nn.Module.__getattr__,
        which gives the registered piece, runs only when that lookup fails. named_parameters() lists the pieces."""
        # .data: the same storage under a version counter of its own, which the all-gathers' writes into `full` leave
        # alone: refilling it with the same weights changes nothing autograd saved. Without a gradient: no graph.
        full = ReduceScatterGrad.apply(self.shard, self.full.data, self)
        for param, view in zip(self.params, self.views(full)):
            for module, attribute in param.uses:
                module.__dict__[attribute] = view

    def free(self):
        if self.is_gathered():
            self.wait_gather()  # a prefetch nobody used lands before its storage goes
            self.full.untyped_storage().resize_(0)
        for param in self.params:
            for module, attribute in param.uses:
                module.__dict__.pop(attribute, None)  # the registered piece shows again


class ReduceScatterGrad(torch.autograd.Function):
    """Identity from the shard to `full`, so the weights' views hang from the shard in the graph: its backward gets
    the whole buffer's gradient, once, reduce-scatters it into the shard's gradient and frees `full`."""
    @staticmethod
    def forward(ctx, shard, full, flat):
        ctx.flat = flat
        return full

    @staticmethod
    def backward(ctx, grad):
        ctx.flat.wrapper.reduce_scatter(ctx.flat, grad)
        ctx.flat.free()
        return None, None, None


def unit_modules(module, units=None):
    return [module] + list(getattr(module, "blocks", []) if units is None else units)


def flat_parameter_groups(module, units=None):
    """Each unit's FlatParameters, {kind: [(name, parameter, its (module, attribute) uses)]}; plan.py reads it too."""
    holders = unit_modules(module, units)
    owner = {sub: index for index, unit in enumerate(holders) for sub in unit.modules()}  # innermost wins
    uses = {}  # parameter -> every (module, attribute) holding it: a tied weight has two
    for name, param in module.named_parameters(remove_duplicate=False):
        module_name, _, attribute = name.rpartition(".")
        uses.setdefault(param, []).append((module.get_submodule(module_name), attribute))
    groups = [{} for _ in holders]
    for name, param in module.named_parameters():  # a tied parameter once, under its first name
        users = {owner[sub] for sub, _ in uses[param]}
        unit = users.pop() if len(users) == 1 else 0  # the innermost unit holding every use; else the root
        kind = (param.requires_grad, param.dim() >= 2)
        groups[unit].setdefault(kind, []).append((name, param, uses[param]))
    return groups


def current_value(params, name, shape, box, flat):  # a module not on meta: the values its parameter has
    if params[name].is_meta:
        raise ValueError(f"parameter {name} is on meta: pass initial_value to say what it starts as")
    return params[name].detach().reshape(-1)[flat[0]:flat[1]]


class FullyShardedDataParallel(nn.Module):
    """ZeRO-3 on any nn.Module. The root and each of `units` (default: its `blocks`, listed in the order their forwards
    run: each prefetches the next) are gathered one at a time to compute in `compute_dtype`; shards, AdamW and gradient
    reduction stay float32 (cpu_offload: shards, their gradients and AdamW on the host). initial_value(name, shape, box,
    flat), as training.initial_values, gives elements [flat[0], flat[1]) of full[box] (needed on meta). tp_boxes {name:
    (full shape, box)}: train_2d.py's tensor-parallel slices. replicate_group (HSDP): the ranks holding this rank's
    shards in the other copies of process_group, over which each gradient shard is averaged too. Its parameters are
    this rank's pieces of the module's, by their names: views into the shards, which parameter_groups() gives AdamW."""
    def __init__(self, module, units=None, process_group=None, device="cpu", compute_dtype=torch.float32,
                 reshard_after_forward=True, initial_value=None, tp_boxes=None, replicate_group=None,
                 cpu_offload=False):
        super().__init__()
        self.module = module
        self.device = torch.device(device)
        self.cpu_offload = cpu_offload
        pinned = dict(device="cpu", pin_memory=torch.cuda.is_available())  # pinned: a copy to the device need not wait
        self.shard_memory = pinned if cpu_offload else dict(device=device)  # shards and their gradients
        self.group = process_group or dist.group.WORLD
        self.replicate_group = replicate_group
        self.compute_dtype = compute_dtype
        self.reshard_after_forward = reshard_after_forward
        self.tp_boxes = tp_boxes or {}
        initial_value = initial_value or partial(current_value, dict(module.named_parameters()))
        self.units = [[FlatParameter(entries, self, initial_value) for entries in unit.values()]
                      for unit in flat_parameter_groups(module, units)]
        self.flats = [flat for unit in self.units for flat in unit]
        self.shards = [flat.shard for flat in self.flats]  # not registered: the module's names list this rank's pieces
        for index, unit in enumerate(unit_modules(module, units)):
            unit.register_forward_pre_hook(partial(self._before_forward, index))
            unit.register_forward_hook(partial(self._after_forward, index))
        self.in_flight = None  # the latest reduce-scatter, finished when the next one starts

    def forward(self, *args, **kwargs):
        for flat in self.flats:  # an optimizer dropped one view of a gradient, the shard's or its pieces': drop both
            if flat.shard.grad is None or any(param.local.grad is None for param in flat.params):
                flat.shard.grad = None
                for param in flat.params:
                    param.local.grad = None
        return self.module(*args, **kwargs)

    def gather(self, index, direction):
        """Gather unit `index` for its modules; the next one's gather (forward +1, backward -1) starts first."""
        following = self.units[(index + direction) % len(self.units)]  # the units run in the order they are listed
        for flat in self.units[index] + following:
            flat.start_gather()
        with torch.enable_grad() if direction < 0 else nullcontext():  # for --activation_checkpointing's recompute
            for flat in self.units[index]:
                flat.wait_gather()
                flat.use_views()

    @torch.compiler.disable  # --compile: the model compiles between the units' hooks, which run as written
    def _before_forward(self, index, module, args):
        self.gather(index, +1)

    @torch.compiler.disable
    def _after_forward(self, index, module, args, output):
        if not torch.is_grad_enabled() or (self.reshard_after_forward and index != 0):  # the root stays for backward
            for flat in self.units[index]:
                flat.free()
        # The unit's backward begins once the first of its outputs' gradients is in: hooked on those tensors, as FSDP2
        # does (a module's full backward pre-hook would warn on the root, whose input, token ids, needs no gradient).
        outputs = [out for out in (output if isinstance(output, (tuple, list)) else [output])
                   if isinstance(out, torch.Tensor) and out.requires_grad]
        if outputs:
            torch.autograd.graph.register_multi_grad_hook(outputs, partial(self._before_backward, index), mode="any")

    def _before_backward(self, index, grad):
        if index == 0:  # the root's outputs' gradients come first: backward has begun
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
        self.gather(index, -1)

    def _after_backward(self):
        self.finish_reduce_scatter()
        for flat in self.flats:  # the root's, frozen ones, a prefetch nobody used: none may outlive the update
            flat.free()

    def reduce_scatter(self, flat, grad):
        """Start averaging the unit's gradient into this rank's piece once the previous one has landed."""
        self.finish_reduce_scatter()
        grad = grad.float()  # averaged in float32: a sum of N bf16 gradients would lose their low bits
        piece = grad.new_empty(flat.shard_size)
        work = reduce_scatter_single(piece, grad, op=dist.ReduceOp.AVG, group=self.group, async_op=True)
        self.in_flight = (flat, piece, grad, work)

    def finish_reduce_scatter(self):
        if self.in_flight is not None:
            flat, piece, _, work = self.in_flight
            work.wait()
            if self.replicate_group is not None:  # HSDP: averaged over the shard group, now over its copies too
                dist.all_reduce(piece, op=dist.ReduceOp.AVG, group=self.replicate_group)
            if self.cpu_offload:  # back to the host, where AdamW steps; the host waits: it reads them next
                piece = torch.empty(flat.shard_size, **self.shard_memory).copy_(piece)
            flat.shard.grad = piece if flat.shard.grad is None else flat.shard.grad.add_(piece)  # micro-steps add up
            for param in flat.params:
                param.local.grad = flat.shard.grad[param.span]
            self.in_flight = None

    def parameter_groups(self):
        """(with weight decay, without): the trainable shards, for training.make_optimizer."""
        trained = [flat for flat in self.flats if flat.shard.requires_grad]
        return [f.shard for f in trained if f.decay], [f.shard for f in trained if not f.decay]

    def clip_grad_norm_(self, max_norm):
        """The whole model's gradient norm: the shards are disjoint parts of it (padding's gradient is zero; HSDP's
        copies of the shard group hold the same)."""
        total = sum(shard.grad.pow(2).sum() for shard in self.shards if shard.grad is not None).to(self.device)
        dist.all_reduce(total, group=self.group)  # one number: the squared norm of the whole model, on the device
        norm = total.sqrt()
        nn.utils.clip_grads_with_norm_(self.shards, max_norm, norm)
        return norm

    def parts(self):
        return [part for flat in self.flats for part in flat.parts]


def hybrid_groups(replicate):
    """HSDP's groups of this rank: (its shard group, world / replicate consecutive ranks, a node; its replicate group,
    the ranks at its place in every shard group). dist.new_group is collective: every rank creates every group."""
    rank, world = dist.get_rank(), dist.get_world_size()
    shards = world // replicate
    shard_groups = [dist.new_group(list(range(r * shards, (r + 1) * shards))) for r in range(replicate)]
    replicate_groups = [dist.new_group(list(range(s, world, shards))) for s in range(shards)]
    return shard_groups[rank // shards], replicate_groups[rank % shards]


def main(argv=None):
    import checkpoint  # main() is where a script meets the shared files; everything above needs torch and gpt.py
    import training

    parser = training.get_parser(__doc__, "fsdp")
    parser.add_argument("--impl", default="ours", choices=["ours", "torch"], help="torch: FSDP2's fully_shard")
    parser.add_argument("--no_reshard", action="store_true", help="keep each unit gathered from forward to backward")
    parser.add_argument("--no_deferred_init", action="store_true",
                        help="build the whole model first (default: on meta; each rank initialises only its shards)")
    parser.add_argument("--cpu_offload", action="store_true",
                        help="keep the float32 shards, their gradients and AdamW on the host; AdamW steps there")
    parser.add_argument("--replicate", type=training.positive_int, default=1,
                        help="HSDP: shard over world / R consecutive ranks (a node), replicate over the R groups")
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
        groups = model.parameter_groups()
        clip_grad_norm = model.clip_grad_norm_
        parts = [checkpoint.Part(*where) for where in model.parts()]
    optimizer = training.make_optimizer(groups, args, device)
    forward = training.wrap_blocks(model, args.compile, args.activation_checkpointing)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bfloat16" else nullcontext()

    start_step = checkpoint.resume(checkpoint_path, parts, optimizer, config, rank, device)
    logger = training.Logger(args, config, device, rank, world_size)
    layout = f"HSDP {args.replicate} x {shards} | " if args.replicate > 1 else "FSDP | "
    logger.start(train_data, dp_size, start_step, layout=layout)

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
        diverged, stopping = stop_request.agreed(grad_norm)  # the step's one read of the device, alike on all ranks
        checkpoint.check_finite(diverged, step, loss_sum, grad_norm, args)  # a diverged step changes nothing
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if logger.due(step, val_loss):
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)  # each rank summed only its own rows
            logger.log_step(step, loss_sum, lr, grad_norm, t0, val_loss)

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
