"""
Training on one device: the baseline that every other train_*.py is a diff against.

    python train_single.py                                    # tiny model, embedded default corpus, CPU or GPU
    python train_single.py --model gpt2 --data data/openwebtext --block_size 1024 --dtype bfloat16 --compile

Reads top to bottom: arguments -> process groups -> model -> strategy -> loop -> checkpoint.
"""

import time
from contextlib import nullcontext

import torch

import gpt


def main(argv=None):
    import checkpoint  # main() is where a script meets the shared files; everything above needs torch and gpt.py
    import training

    args = training.get_parser(__doc__, "single").parse_args(argv)

    # ---- process groups: one process, one device; the data-parallel coordinates of the only rank
    rank, world_size, dp_rank, dp_size = 0, 1, 0, 1
    if args.plan:  # the memory one rank needs in this layout, and nothing else: no device, data or model
        import plan
        return plan.print_plan(args, world_size, dp_size)
    device = training.get_device(args)

    # ---- data: every check of the arguments happens here, before any work
    meta, config, train_data, val_data = training.load_data(args, dp_rank, dp_size, device, is_writer=True)
    checkpoint_path = checkpoint.to_resume(args)
    torch.manual_seed(args.seed + rank)  # dropout masks; the data order depends on (seed, step) alone

    # ---- model: built on meta, materialised on the device, initialised by parameter name (or from --init_from)
    with torch.device("meta"):
        model = gpt.GPT(config)
    model.to_empty(device=device)
    model.init_weights(args.seed, training.initial_values(config, args.seed, args.init_from))
    gpt.set_attention(model, args.attn)

    # ---- strategy: none; every parameter lives whole on this device
    parts = checkpoint.parameter_parts(model)
    optimizer = training.make_optimizer(training.decay_groups(model.parameters()), args, device)
    forward = training.wrap_blocks(model, args.compile, args.activation_checkpointing)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bfloat16" else nullcontext()

    start_step = checkpoint.resume(checkpoint_path, parts, optimizer, config, rank, device)
    logger = training.Logger(args, config, device, rank, world_size)
    logger.start(train_data, dp_size, start_step)

    # ---- loop
    stop_request = training.StopRequest()  # SIGTERM or SIGUSR1: stop after the step, saved
    for step in range(start_step, args.max_steps):
        val_loss = training.evaluate(step, args, forward, val_data, autocast)
        t0 = time.perf_counter()
        lr = training.set_lr(optimizer, step, args)
        loss_sum = torch.zeros((), device=device)
        for micro_step in range(train_data.accumulation):
            x, y = train_data.get(step, micro_step)
            with autocast:
                loss = forward(x, y) / train_data.accumulation  # gradient of the mean over the global batch
            loss.backward()
            loss_sum += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip or float("inf"))
        diverged, stopping = stop_request.agreed(grad_norm, model)  # one read of the device, alike on every rank
        checkpoint.check_finite(diverged, step, loss_sum, grad_norm, args)  # a diverged step changes nothing
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if logger.due(step, val_loss):
            logger.log_step(step, loss_sum, lr, grad_norm, t0, val_loss, stop_request.expert_load)

        # ---- checkpoint
        if checkpoint.due(step, args) or stopping:
            checkpoint.save(args, step + 1, checkpoint.pieces(parts, optimizer), config, device)
        if stopping:
            stop_request.stop(step + 1, args.out_dir)

    training.sample(model, meta, args, device, autocast, show=True)


if __name__ == "__main__":
    import training
    training.run(main)
