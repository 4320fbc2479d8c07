"""
PyTorch's own versions of every strategy, behind each script's `--impl torch`: the yardstick our hand-written
code is tested and benchmarked against. DistributedDataParallel (train_ddp.py), FSDP2's fully_shard
(train_fsdp.py, on a 2-D mesh for HSDP), DistributedDataParallel with ZeroRedundancyOptimizer (train_zero.py),
DTensor's parallelize_module with loss parallelism (train_tp.py), and both on a 2-D DeviceMesh
(train_2d.py), torch.distributed.pipelining (train_pp.py), and the experimental context_parallel (train_cp.py, CUDA
only). Each function takes the gpt.GPT a script built on meta (DDP: materialised) and returns it ready to
train with the same initial weights, so the scripts' loops run unchanged.
"""

import inspect
from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import context_parallel as sharded_sequences
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               loss_parallel, parallelize_module)
from torch.nn.parallel import DistributedDataParallel

import checkpoint
import train_tp
import training


# No buffer broadcast before each forward: the only buffers, a mixture of experts' balancing bias and loads, are alike
# on every rank or each rank's own (torch 2.13 calls the flag forward_sync_buffers, and warns at the old name)
NO_BUFFER_SYNC = ({"forward_sync_buffers": False} if "forward_sync_buffers" in
                  inspect.signature(DistributedDataParallel).parameters else {"broadcast_buffers": False})


def data_parallel(model, device, bucket_mb):
    # Buckets as ours: DistributedDataParallel makes its first bucket 1 MiB only when bucket_cap_mb is left at its
    # default (25); a cap passed explicitly would be its first bucket's too, one all-reduce fewer than ours
    cap = None if bucket_mb == 25 else bucket_mb
    return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                   bucket_cap_mb=cap, gradient_as_bucket_view=True, **NO_BUFFER_SYNC)


class ZeroRedundancyDataParallel(DistributedDataParallel):
    """DistributedDataParallel with the two methods train_zero.py's loop calls on ours."""

    def clip_grad_norm_(self, max_norm):
        return torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm)  # every rank holds the whole gradient

    def gather_parameters(self):
        """Nothing: ZeroRedundancyOptimizer.step() broadcast each rank's updated parameters already."""


def zero_redundancy(model, device, args):
    """train_zero.py --impl torch (stage 1): (DistributedDataParallel, ZeroRedundancyOptimizer over AdamW, the
    checkpoint parts this rank writes). PyTorch assigns whole parameters to ranks (greedily, largest first) and
    broadcasts them after its step; each rank writes the parameters it steps, with their moments."""
    ddp_model = ZeroRedundancyDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                           bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=True,
                                           **NO_BUFFER_SYNC)
    decay, no_decay = training.decay_groups(model.parameters())
    optimizer = ZeroRedundancyOptimizer([{"params": decay, "weight_decay": args.weight_decay},
                                         {"params": no_decay, "weight_decay": 0.0}], torch.optim.AdamW,
                                        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)  # make_optimizer's
    optimizer.state = optimizer.optim.state  # this rank's moments, where checkpoint.pieces looks for them
    stepped = {param for group in optimizer.optim.param_groups for param in group["params"]}
    parts = checkpoint.parameter_parts(model)  # the parameters it steps, and the buffers, alike on every rank
    return ddp_model, optimizer, [part for part in parts if part.tensor in stepped or not part.tensor.requires_grad]


@torch.no_grad()
def materialise(model, config, args, device):
    """to_empty, then every (distributed) parameter's slice of its initial value, drawn by name or read from
    --init_from (each rank reads every parameter whole, then keeps its slice): the weights of train_single.py."""
    model.to_empty(device=device)
    model.tie_weights()  # to_empty() gives each module its own tensor: tie them again
    initial_value = training.initial_values(config, args.seed, args.init_from)
    for name, param in model.named_parameters():
        value = initial_value(name, param.shape).to(device)
        param.copy_(distribute_tensor(value, param.device_mesh, param.placements) if isinstance(param, DTensor)
                    else value)
    for buffer in model.buffers():  # a mixture of experts' balancing state starts at zero
        buffer.zero_()


def shard_units(model, mesh, args):
    """FSDP2 on each block, then on the root, which holds the embeddings, ln_f and the LM head (ours cuts those into
    two units, as torchtitan does for an untied head; a tied weight cannot span two of FSDP2's units)."""
    policy = MixedPrecisionPolicy(param_dtype=getattr(torch, args.dtype), reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if args.cpu_offload else OffloadPolicy()
    for module in [*model.blocks, model]:
        fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=not args.no_reshard,
                    offload_policy=offload)


def fully_shard_model(model, config, args, device):
    """train_fsdp.py --impl torch: (model, optimizer groups, clip function). --replicate: HSDP on a 2-D mesh."""
    mesh = None if args.replicate == 1 else init_device_mesh(
        device.type, (args.replicate, dist.get_world_size() // args.replicate), mesh_dim_names=("replicate", "shard"))
    shard_units(model, mesh, args)
    if not args.no_deferred_init:
        materialise(model, config, args, torch.device("cpu") if args.cpu_offload else device)  # offloaded: the host
    return model, training.decay_groups(model.parameters()), partial(clip_grad_norm_, list(model.parameters()))


def tensor_parallel(model, config, args, device):
    """train_tp.py --impl torch: (model, optimizer groups, clip function)."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    parallelize_with_dtensor(model, mesh, args.sequence_parallel, not args.no_loss_parallel)
    materialise(model, config, args, device)
    return model, training.decay_groups(model.parameters()), partial(clip_grad_norm_, list(model.parameters()))


def fully_shard_tensor_parallel(model, config, args, device, tp, dp):
    """train_2d.py --impl torch: DTensor tensor parallelism on the "tp" mesh dimension, then FSDP2 on "dp"."""
    mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    parallelize_with_dtensor(model, mesh["tp"], args.sequence_parallel, not args.no_loss_parallel)
    shard_units(model, mesh["dp"], args)
    materialise(model, config, args, torch.device("cpu") if args.cpu_offload else device)  # offloaded: the host
    return model, training.decay_groups(model.parameters()), partial(clip_grad_norm_, list(model.parameters()))


class DTensorLossParallel(torch.autograd.Function):
    """loss_parallel() cross-entropy of vocabulary-sharded DTensor logits. Its backward must run under loss_parallel()
    too, and the loop's loss.backward() does not: build the graph on a detached input, backward inside the context."""

    @staticmethod
    def forward(ctx, logits, targets):
        with torch.enable_grad(), loss_parallel():
            ctx.logits = logits.detach().requires_grad_()
            ctx.loss = F.cross_entropy(ctx.logits, targets).to_local()
        return ctx.loss.detach()

    @staticmethod
    def backward(ctx, grad):
        with loss_parallel():
            ctx.loss.backward(grad)
        return ctx.logits.grad, None


def parallelize_with_dtensor(model, mesh, sequence_parallel, loss_parallel):
    """The layout of train_tp.parallelize from DTensor's parallel styles, as torchtitan writes it."""
    residual = Shard(1) if sequence_parallel else Replicate()
    plan = {"wte": RowwiseParallel(input_layouts=Replicate()),  # nn.Embedding: vocabulary rows; output summed
            "lm_head": ColwiseParallel(input_layouts=residual, use_local_output=not loss_parallel,
                                       output_layouts=Shard(-1) if loss_parallel else Replicate()),
            "blocks.*.attn.query": ColwiseParallel(), "blocks.*.attn.key": ColwiseParallel(),
            "blocks.*.attn.value": ColwiseParallel(), "blocks.*.attn.proj": RowwiseParallel(output_layouts=residual),
            "blocks.*.mlp.fc": ColwiseParallel(), "blocks.*.mlp.proj": RowwiseParallel(output_layouts=residual)}
    if model.config.swiglu:  # Llama's gate; a key no module matches would warn on every GPT-2 run
        plan["blocks.*.mlp.gate"] = ColwiseParallel()
    if sequence_parallel:  # wpe (GPT-2) is added to the whole sequence, then the residual stream is cut into shards
        gather_sequence = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        gather_attention_input = PrepareModuleInput(input_layouts=(Shard(1), None),  # and the rotary angles, as given
                                                    desired_input_layouts=(Replicate(), None))
        plan.update({"drop": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                                use_local_output=True), "ln_f": SequenceParallel(),
                     "blocks.*.ln_1": SequenceParallel(), "blocks.*.ln_2": SequenceParallel(),
                     "blocks.*.attn": gather_attention_input, "blocks.*.mlp": gather_sequence})
    parallelize_module(model, mesh, plan)
    model.tie_weights()  # each style distributed its own copy of the tied weight
    if loss_parallel:
        model.loss_fn = DTensorLossParallel.apply
    whole = lambda logits: logits.full_tensor() if isinstance(logits, DTensor) else logits  # noqa: E731
    return training.sampling_hooks(model, mesh.size() if sequence_parallel else 1, whole)


def clip_grad_norm_(parameters, max_norm):
    """torch.nn.utils.clip_grad_norm_ refuses parameters on different meshes (DTensors beside plain tensors under
    TP, 2-D and data-parallel-only meshes in 2-D): one total norm over the full tensors, then each mesh clipped."""
    parameters = [param for param in parameters if param.grad is not None]
    norms = [torch.linalg.vector_norm(param.grad) for param in parameters]
    norms = [norm.full_tensor() if isinstance(norm, DTensor) else norm for norm in norms]
    total_norm = torch.linalg.vector_norm(torch.stack(norms))
    for mesh in {getattr(param, "device_mesh", None) for param in parameters}:
        same = [param for param in parameters if getattr(param, "device_mesh", None) == mesh]
        torch.nn.utils.clip_grads_with_norm_(same, max_norm, total_norm)
    return total_norm


def full_tensors(model, optimizer, master):
    """Checkpoint pieces of a model of DTensors (and plain tensors beside them): each parameter and AdamW moment
    gathered whole (a collective every rank joins), written by rank 0."""
    tensors = {}
    for name, param in [*model.named_parameters(), *model.named_buffers()]:  # buffers: a mixture's balancing state
        state = optimizer.state.get(param, {})
        moments = [(f"{moment}/{name}", state[moment]) for moment in ("exp_avg", "exp_avg_sq") if moment in state]
        for key, tensor in [(name, param)] + moments:
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            if master:
                tensors[key] = [checkpoint.piece(full.shape, full)]
    return tensors


def pipeline_parallel(stage, index, num_stages, device, pipeline_group, dp_group, schedule, num_micro_batches):
    """train_pp.py --impl torch: the train_pp.Stage replicated over dp_group by DistributedDataParallel, run by
    torch.distributed.pipelining's PipelineStage under ScheduleGPipe or Schedule1F1B. Returns run_schedule(batches,
    autocast), as train_pp.PipelineParallel.step: the micro-batches' mean loss on the last stage, zero elsewhere.
    Evaluation and sampling go through train_pp.PipelineParallel.forward on the same stage."""
    # find_unused_parameters: DDP then never rebuilds its buckets. By default it does after the first step, and under
    # ScheduleGPipe the first stage's reducer has recorded every parameter twice and fails (torch 2.13);
    # static_graph=True runs but averages other gradients than train_single's (measured: grad norm off by 2%).
    replica = DistributedDataParallel(stage, device_ids=[device] if device.type == "cuda" else None,
                                      process_group=dp_group, gradient_as_bucket_view=True, find_unused_parameters=True,
                                      **NO_BUFFER_SYNC)
    runner = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](
        PipelineStage(replica, index, num_stages, device, group=pipeline_group), num_micro_batches,
        loss_fn=lambda logits, targets: stage.model.loss_fn(logits.flatten(0, 1), targets.flatten()))

    def run_schedule(batches, autocast):
        x, y = (torch.cat(tensors) for tensors in zip(*batches))  # the schedule cuts them into the same micro-batches
        losses = []
        with autocast:
            runner.step(*[x] * stage.is_first, target=y if stage.is_last else None, losses=losses,
                        return_outputs=False)
        return torch.stack(losses).sum() / len(batches) if losses else torch.zeros((), device=device)

    return run_schedule


def causal_attention(q, k, v):
    """gpt.py's SDPA attention, with each query head's key and value head repeated: torch's context_parallel shards
    only the flash, memory-efficient and cuDNN kernels, and float32 with grouped-query heads would take the math one.
    F.scaled_dot_product_attention is looked up at each call, where context_parallel patches it."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


class TorchContextParallel(nn.Module):
    """train_cp.py --impl torch: torch.distributed.tensor.experimental.context_parallel over the "cp" dimension of a
    (dp, cp) DeviceMesh of consecutive ranks, as train_cp.py's groups. Within sharded(idx, targets) the token ids, the
    targets and the positions are cut on the sequence dimension into the same head-tail chunks as ours, and SDPA runs
    as torch's ring attention over the group (--cp_impl allgather: its all-gather rotater; ring: its all-to-all one).
    Its backward dispatches through the same context, so the loss's backward runs inside it too."""

    def __init__(self, module, device, cp, dp, cp_impl):
        super().__init__()
        # Private in torch 2.11 and 2.13 alike (torch.distributed.tensor.experimental._attention re-exports the
        # _context_parallel package's names where they moved): the rotate method and the load balancing
        from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method
        set_rotate_method({"allgather": "allgather", "ring": "alltoall"}[cp_impl])
        _cp_options.enable_load_balance = True  # head-tail (the default): rank i holds chunks i and 2·cp-1-i, as ours
        self.module = module
        self.mesh = init_device_mesh(device.type, (dp, cp), mesh_dim_names=("dp", "cp"))["cp"]
        self.pos = None  # this rank's tokens' global positions, inside sharded()
        core = torch.compiler.disable(causal_attention)  # DTensor dispatch, collectives: no graph inside
        for block in module.blocks:
            block.attn.attend = core

    @contextmanager
    def sharded(self, idx, targets):
        """Yields this rank's chunks of idx and targets (copies: context_parallel shards its buffers in place)."""
        pos = torch.arange(idx.shape[1], device=idx.device).unsqueeze(0)  # [1, T]: a row, cut as idx's rows are
        buffers = [idx.clone(), targets.clone(), pos]
        with sharded_sequences(self.mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)):
            idx, targets, self.pos = buffers[0], buffers[1], buffers[2][0]
            try:
                yield idx, targets
            finally:
                self.pos = None

    def forward(self, idx, targets):
        """The loss over this rank's tokens: the loop's chunks within sharded(), or, outside it (evaluation), whole
        sequences, sharded here for this forward alone."""
        if self.pos is not None:
            return self.module(idx, targets, self.pos)
        with self.sharded(idx, targets) as (idx, targets):
            return self.module(idx, targets, self.pos)

    def restore(self):
        for block in self.module.blocks:
            del block.attn.attend
