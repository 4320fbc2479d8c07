r"""
Pipeline parallel, by hand: the blocks are cut into --pp stages of consecutive layers, one rank a stage. Each
micro-batch's activations travel forward from stage to stage and their gradients back, point to point, in the
order of a schedule: GPipe or 1F1B. --dp replicas of the whole pipeline train on their own rows of the global batch;
each stage's gradients are averaged over its replicas by train_ddp.py's DataParallel.

    torchrun --standalone --nproc_per_node=2 train_pp.py                          # 2 stages, 1F1B, 4 micro-batches of 4
    torchrun --standalone --nproc_per_node=4 train_pp.py --pp 2 --dp 2 --schedule gpipe
    torchrun --standalone --nproc_per_node=2 train_pp.py --impl torch             # torch.distributed.pipelining

Stage s is ranks [s * dp, (s + 1) * dp): a stage's replicas are neighbours, since their all-reduce carries the most
bytes; a pipeline's ranks are strided and exchange only activations.
Reads top to bottom: arguments -> process groups -> model -> strategy -> loop -> checkpoint.
"""

import time
from contextlib import nullcontext
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import gpt
import train_ddp


def stage_layers(n_layer, num_stages, stage):
    """The blocks of stage `stage`: consecutive, as even as n_layer allows. The first n_layer % num_stages stages
    take one more, since the last stage also computes the LM head and the loss."""
    per_stage, extra = divmod(n_layer, num_stages)
    first = stage * per_stage + min(stage, extra)
    return range(first, first + per_stage + (stage < extra))


class Stage(nn.Module):
    """One stage of a gpt.GPT: its blocks, plus the embeddings on the first stage, plus the final layer norm, the LM
    head and the loss on the last. What the stage does not hold is set to None, as torchtitan splits a model, so every
    parameter keeps its gpt.py name (blocks.3 stays blocks.3) and a checkpoint names it as one device does. Where the
    LM head is tied (GPT-2), the last stage keeps wte as the holder of its weight."""

    def __init__(self, model, stage, num_stages):
        super().__init__()
        self.model = model
        self.layers = stage_layers(model.config.n_layer, num_stages, stage)
        self.is_first = stage == 0
        self.is_last = stage == num_stages - 1
        self.positions = None  # the tokens' global positions, where train_4d.py's context parallel splits sequences
        for layer in range(model.config.n_layer):
            if layer not in self.layers:
                model.blocks[layer] = None
        if not self.is_first:
            model.wpe = None
        if not (self.is_first or (self.is_last and model.config.tie_embeddings)):
            model.wte = None
        if not self.is_last:
            model.ln_f = model.lm_head = None

    @torch.no_grad()
    def init_weights(self, device, value):
        """Materialise the stage on `device` with the values one device starts with: value(name, shape)."""
        self.model.to_empty(device=device)
        if self.is_last:
            self.model.tie_weights()  # to_empty() gives each module its own tensor
        for name, param in self.model.named_parameters():
            param.copy_(value(name, param.shape))
        for buffer in self.model.buffers():  # a mixture of experts' balancing state starts at zero
            buffer.zero_()

    def forward(self, x, targets=None):
        """This stage's part of gpt.GPT.forward: token ids in on the first stage, the residual stream elsewhere;
        out goes the residual stream, or on the last stage the logits (the loss, given targets)."""
        model = self.model
        pos = torch.arange(x.shape[1], device=x.device) if self.positions is None else self.positions
        if self.is_first:
            x = model.wte(x)
            x = model.drop(x if model.wpe is None else x + model.wpe(pos))
        rope = gpt.rotary_angles(model.config, pos)  # Llama: each stage computes the angles its blocks need
        for layer in self.layers:
            x = model.blocks[layer](x, rope)
        if not self.is_last:
            return x
        logits = model.lm_head(model.ln_f(x))
        if targets is None:
            return logits
        return model.loss_fn(logits.flatten(0, 1), targets.flatten())


def schedule(name, stage, num_stages, num_micro_batches):
    """The order in which a stage runs ("forward", i) and ("backward", i) of micro-batches i. GPipe (Huang et al.
    2019): every forward, then every backward, so a stage holds the activations of all of them at once. 1F1B
    (PipeDream-Flush, Narayanan et al. 2021): num_stages - 1 - stage forwards fill the pipeline, then one forward
    and one backward in turn, then the backwards left; a stage holds at most num_stages - stage micro-batches.
    Both idle the same (p - 1) / (m + p - 1) of a step, and compute the same gradients."""
    forwards = [("forward", i) for i in range(num_micro_batches)]
    backwards = [("backward", i) for i in range(num_micro_batches)]
    if name == "gpipe":
        return forwards + backwards
    warmup = min(num_stages - 1 - stage, num_micro_batches)
    steady = [action for pair in zip(forwards[warmup:], backwards) for action in pair]
    return forwards[:warmup] + steady + backwards[num_micro_batches - warmup:]


def exchange(operations):
    """Post point-to-point sends and receives together, then wait for all of them."""
    for work in dist.batch_isend_irecv(operations) if operations else []:
        work.wait()


class PipelineParallel(nn.Module):
    """The pipeline of one rank, seen from its Stage. forward() runs one batch through every stage without autograd
    (evaluation, sampling); step() runs the forward and backward of every micro-batch of an optimizer step in a
    schedule's order. Every rank of a pipeline is given the same token ids, so it knows the shape of what it
    receives, [batch, tokens / sequence_shards, n_embd], without asking; and every rank is given the same `dtype`
    (the compute dtype), in which it sends and receives activations and gradients alike: sender and receiver agree
    by construction. The residual stream stays float32 inside a stage (the blocks add autocast's bf16 outputs to it).
    sequence_shards: train_4d.py's sequence parallelism, under which a stage sends 1/sequence_shards of the tokens."""

    def __init__(self, stage, group, config, dtype=torch.float32, sequence_shards=1):
        super().__init__()
        self.stage, self.group, self.config, self.dtype = stage, group, config, dtype
        self.sequence_shards = sequence_shards
        ranks = dist.get_process_group_ranks(group)  # ascending: stage by stage
        self.index = ranks.index(dist.get_rank())
        self.num_stages = len(ranks)
        self.previous = ranks[self.index - 1] if self.index > 0 else None
        self.next = ranks[self.index + 1] if self.index + 1 < len(ranks) else None
        self.last_rank = ranks[-1]

    def buffer(self, ids):
        tokens = ids.shape[1] // self.sequence_shards
        return torch.empty(ids.shape[0], tokens, self.config.n_embd, dtype=self.dtype, device=ids.device)

    def run_stage(self, x, targets=None):
        """The stage on the token ids, or on a received activation (in float32 again); what it sends is in `dtype`."""
        out = self.stage(x if self.previous is None else x.float(), targets)
        return out if self.next is None else out.to(self.dtype)

    @torch.no_grad()
    def forward(self, ids, targets=None):
        """The loss of one batch (given targets), or the logits at its last position (all gpt.generate reads, as in
        nanoGPT's inference forward), on every rank of the pipeline: the last stage broadcasts them. A prompt is
        padded to a multiple of the sequence shards (causal: no real position sees the padding)."""
        length = ids.shape[1]
        if targets is None and length % self.sequence_shards:
            ids = F.pad(ids, (0, -length % self.sequence_shards))
        x = ids
        if self.previous is not None:
            x = self.buffer(ids)
            dist.recv(x, self.previous)
        out = self.run_stage(x, targets)
        if self.next is not None:
            dist.send(out, self.next)
            out = torch.empty(() if targets is not None else (ids.shape[0], 1, self.config.padded_vocab_size),
                              device=ids.device)
        elif targets is None:
            out = out[:, length - 1:length].float().contiguous()
        dist.broadcast(out, self.last_rank, group=self.group)
        return out.float()

    def step(self, name, batches, autocast=nullcontext(), no_sync=nullcontext):
        """Forward and backward of every micro-batch (x, y) in `batches`, in schedule `name`'s order: the gradient of
        their mean loss, as train_single.py's accumulation loop computes it. Returns the mean loss on the last stage,
        zero elsewhere. Each action's sends are posted together with the next action's receive, in one
        batch_isend_irecv: NCCL runs a pair of ranks' sends and receives in order, and 1F1B's steady state sends
        an activation to the next stage while that stage sends a gradient back. no_sync: a data-parallel replica's,
        so that its gradients are all-reduced in the last backward only."""
        inputs, outputs, sends = {}, {}, []
        loss_sum = torch.zeros((), device=batches[0][0].device)
        for kind, i in schedule(name, self.index, self.num_stages, len(batches)):
            x, y = batches[i]
            # A forward receives its input from the previous stage, a backward its output's gradient from the next.
            peer = self.previous if kind == "forward" else self.next
            received = None if peer is None else self.buffer(x)
            exchange(sends + ([] if peer is None else [dist.P2POp(dist.irecv, received, peer)]))
            sends = []
            if kind == "forward":
                inputs[i] = x if received is None else received.requires_grad_()
                with autocast:
                    outputs[i] = self.run_stage(inputs[i], y if self.next is None else None)
                if self.next is None:
                    outputs[i] = outputs[i] / len(batches)  # gradient of the mean over the global batch
                    loss_sum += outputs[i].detach()
                else:
                    sends = [dist.P2POp(dist.isend, outputs[i].detach(), self.next)]
            else:
                with nullcontext() if i + 1 == len(batches) else no_sync():
                    torch.autograd.backward(outputs.pop(i), received)  # the last stage's output is the loss
                input_gradient = inputs.pop(i).grad
                if self.previous is not None:
                    sends = [dist.P2POp(dist.isend, input_gradient, self.previous)]
        exchange(sends)
        return loss_sum


def sum_tied_gradients(stage, group):
    """The first stage's wte and the last stage's LM head are one tied weight held twice; each copy's gradient is
    that of its own use, and the weight's is their sum (Megatron-LM's embedding group). Summed on both, the two
    copies take the same AdamW step and never drift apart. group: the two end stages of this pipeline, or None.
    An untied LM head (Llama 3.1) is a weight of its own: nothing to sum."""
    if group is not None and stage.model.config.tie_embeddings:
        dist.all_reduce(stage.model.wte.weight.grad, group=group)


def clip_grad_norm_(stage, max_norm, group, counted=lambda name: True):
    """torch.nn.utils.clip_grad_norm_ of the whole model: each stage's squared norm, summed over the pipeline's
    group. The tied weight counts once, on the first stage; the last stage holds the same gradient. counted(name):
    what else this rank leaves to another (train_4d.py: a replicated tensor to TP rank 0)."""
    grads = [param.grad for name, param in stage.model.named_parameters()
             if (stage.is_first or name != "wte.weight") and counted(name)]
    squared = torch.nn.utils.get_total_norm(grads) ** 2
    dist.all_reduce(squared, group=group)
    norm = squared.sqrt()
    torch.nn.utils.clip_grads_with_norm_(stage.model.parameters(), max_norm, norm)
    return norm


def pipelined_micro_batch(rows, num_stages):
    """--micro_batch by default: the largest that splits a replica's `rows` into 2 x num_stages micro-batches or more,
    so that the schedule has work to overlap (idle (p - 1) / (m + p - 1) of a step: a third at most, where one
    micro-batch would idle (p - 1) / p). 1 if the rows are fewer; all of them on one stage, which idles never."""
    if num_stages == 1:
        return rows
    return max((size for size in range(1, rows + 1) if rows % size == 0 and rows // size >= 2 * num_stages), default=1)


def new_groups(pp, dp):
    """This rank's (pipeline group, data-parallel group, embedding group or None). dist.new_group is collective:
    every rank creates every group, in the same order, and keeps the ones it belongs to."""
    pipelines = [list(range(j, pp * dp, dp)) for j in range(dp)]
    replicas = [list(range(s * dp, (s + 1) * dp)) for s in range(pp)]
    ends = [[ranks[0], ranks[-1]] for ranks in pipelines] if pp > 1 else []  # one stage holds the weight once
    mine = []
    for groups in (pipelines, replicas, ends):
        created = [dist.new_group(ranks) for ranks in groups]
        mine.append(next((group for group, ranks in zip(created, groups) if dist.get_rank() in ranks), None))
    return tuple(mine)


def main(argv=None):
    import checkpoint  # main() is where a script meets the shared files; everything above needs torch and gpt.py
    import training

    parser = training.get_parser(__doc__, "pp")
    parser.add_argument("--impl", default="ours", choices=["ours", "torch"],
                        help="torch: torch.distributed.pipelining's PipelineStage and schedules, with DDP")
    parser.add_argument("--pp", type=training.positive_int, default=2, help="pipeline stages, at most the layers; "
                        "without --micro_batch, the global batch runs as 2 x --pp micro-batches or more")
    parser.add_argument("--dp", type=training.positive_int, help="replicas of the pipeline (default: world / --pp)")
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"],
                        help="gpipe: every forward, then every backward; 1f1b: one forward, one backward in turn")
    args = training.parse(parser, argv)

    # ---- process groups: --dp replicas of a --pp stage pipeline; stage s is ranks [s * dp, (s + 1) * dp)
    rank, local_rank, world_size = training.launched_rank(args)
    pp, dp = args.pp, args.dp or max(1, world_size // args.pp)
    if pp * dp != world_size:
        launch = f"launch it with torchrun --nproc_per_node={pp * dp}" if world_size == 1 else \
            f"choose --pp and --dp whose product is {world_size}"
        raise training.UsageError(f"--pp {pp} x --dp {dp} = {pp * dp} ranks, but the world has {world_size}: {launch}")
    stage_index, dp_rank, dp_size = rank // dp, rank % dp, dp
    if args.micro_batch is None and args.global_batch % dp == 0:  # else training.load_data says what to change
        args.micro_batch = pipelined_micro_batch(args.global_batch // dp, pp)
    if args.plan:  # the memory the fullest stage needs in this layout, and nothing else: no device, data or model
        import plan
        return plan.print_plan(args, world_size, dp_size, layers=stage_layers, schedule=schedule)
    device = training.get_device(args, local_rank)

    # ---- data: every check of the arguments happens here, on every rank alike, before the first collective
    meta, config, train_data, val_data = training.load_data(args, dp_rank, dp_size, device, is_writer=local_rank == 0)
    if pp > config.n_layer:
        raise training.UsageError(f"--pp {pp} stages, but the model has {config.n_layer} layers and a stage holds "
                                  f"one at least: choose --pp {config.n_layer} or fewer")
    if config.n_expert and args.impl == "torch":  # its extra pass would count in the experts' loads, not one device's
        raise training.UsageError("--impl torch: torch's schedules run a first micro-batch twice (shape inference) "
                                  "and a mixture of experts would count its tokens twice: use --impl ours")
    checkpoint_path = checkpoint.to_resume(args)
    rank, world_size, owns_group = training.init_distributed(args, device)
    pipeline_group, dp_group, embedding_group = new_groups(pp, dp)
    torch.manual_seed(args.seed + rank)  # dropout masks; the data order depends on (seed, step) alone

    # ---- model: built on meta; each rank materialises its own stage, initialised by parameter name
    with torch.device("meta"):
        model = gpt.GPT(config)
    stage = Stage(model, stage_index, pp)
    stage.init_weights(device, training.initial_values(config, args.seed, args.init_from))
    gpt.set_attention(model, args.attn)

    # ---- strategy: one stage a rank, its gradients averaged over the stage's replicas in the last backward
    pipeline = PipelineParallel(stage, pipeline_group, config, getattr(torch, args.dtype))
    if args.impl == "torch":
        import torch_reference
        run_schedule = torch_reference.pipeline_parallel(stage, stage_index, pp, device, pipeline_group, dp_group,
                                                         args.schedule, train_data.accumulation)
    else:
        replica = train_ddp.DataParallel(stage, process_group=dp_group)
        run_schedule = partial(pipeline.step, args.schedule, no_sync=replica.no_sync)
    parts = checkpoint.parameter_parts(model)
    optimizer = training.make_optimizer(training.decay_groups(model.parameters()), args, device)
    forward = training.wrap_blocks(pipeline, args.compile, args.activation_checkpointing)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bfloat16" else nullcontext()

    start_step = checkpoint.resume(checkpoint_path, parts, optimizer, config, rank, device)
    logger = training.Logger(args, config, device, rank, world_size)
    blocks = [len(stage_layers(config.n_layer, pp, s)) for s in range(pp)]
    m = train_data.accumulation  # the micro-batches of a step, which the schedule overlaps
    bubble = f"{m} micro-batches a step: bubble (p - 1) / (m + p - 1) = {(pp - 1) / (m + pp - 1):.2f}"
    if 1 < pp and m < 2 * pp:
        bubble += f" (under 2 x {pp} micro-batches: a smaller --micro_batch or a larger --global_batch shrinks it)"
    logger.print(f"pipeline: {pp} stages x {dp} data-parallel | {args.schedule} ({args.impl}) | blocks by stage "
                 f"{blocks} | {bubble}")
    logger.start(train_data, dp_size, start_step)

    # ---- loop
    stop_request = training.StopRequest()  # SIGTERM or SIGUSR1: stop after the step, saved
    for step in range(start_step, args.max_steps):
        val_loss = training.evaluate(step, args, forward, val_data, autocast, dp_group)
        t0 = time.perf_counter()
        lr = training.set_lr(optimizer, step, args)
        batches = [train_data.get(step, micro_step) for micro_step in range(train_data.accumulation)]
        loss_sum = run_schedule(batches, autocast)  # every micro-step's forward and backward, in the schedule's order
        sum_tied_gradients(stage, embedding_group)
        grad_norm = clip_grad_norm_(stage, args.grad_clip or float("inf"), pipeline_group)
        diverged, stopping = stop_request.agreed(grad_norm, model)  # one read of the device, alike on every rank
        checkpoint.check_finite(diverged, step, loss_sum, grad_norm, args)  # a diverged step changes nothing
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # in place: the gradients are views into the all-reduce buckets

        if logger.due(step, val_loss):
            dist.all_reduce(loss_sum)  # each replica's last stage summed its own rows; the other stages hold zero
            logger.log_step(step, loss_sum / dp_size, lr, grad_norm, t0, val_loss, stop_request.expert_load)

        # ---- checkpoint: each stage's first replica writes its tensors; the tied weight comes from the first stage
        if checkpoint.due(step, args) or stopping:
            owned = [part for part in parts if dp_rank == 0 and (stage.is_first or part.name != "wte.weight")]
            tensors = checkpoint.pieces(owned, optimizer)
            checkpoint.save(args, step + 1, tensors, config, device, rank, world_size)
        if stopping:
            stop_request.stop(step + 1, args.out_dir)

    training.sample(forward, meta, args, device, autocast, show=rank == 0)  # every rank: each forward needs them all
    if owns_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    import training
    training.run(main)
