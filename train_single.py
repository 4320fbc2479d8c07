"""
Training on one device: the baseline that every other train_*.py is a diff against.

    python train_single.py                                    # tiny model, embedded default corpus, CPU or GPU
    python train_single.py --model gpt2 --data data/openwebtext --block_size 1024 --dtype bfloat16 --compile

Reads top to bottom: arguments -> process groups -> model -> strategy -> loop -> checkpoint.
"""

import os
import time
from contextlib import nullcontext
from dataclasses import asdict

import torch
from torch.distributed.elastic.multiprocessing.errors import record

import gpt
from prepare_data import get_tokenizer


@record  # under torchrun, the error file names the failing rank with its traceback
def main(argv=None):
    args = gpt.get_parser(__doc__).parse_args(argv)

    # ---- process groups: one process, one device; the data-parallel coordinates of the only rank
    rank, world_size, dp_rank, dp_size = 0, 1, 0, 1
    master = rank == 0
    prefix = f"[rank {rank}] " if args.log_all_ranks else ""
    device = gpt.get_device(args.device)
    torch.manual_seed(args.seed + rank)  # dropout masks; the data order depends on (seed, step) alone

    # ---- data: every check of the arguments happens here, before any work
    meta = gpt.ensure_data(args.data, is_writer=True)
    micro_batch = args.micro_batch or args.global_batch // dp_size
    train_data, val_data = (gpt.BatchSampler(os.path.join(args.data, f"{split}.bin"), args.block_size, args.global_batch,
                                             micro_batch, dp_rank, dp_size, args.seed, device) for split in ("train", "val"))
    config = gpt.make_config(args.model, meta["vocab_size"], args.block_size, args.dropout)
    checkpoint_path = gpt.latest_checkpoint(args.out_dir)
    if checkpoint_path and not args.resume:
        raise SystemExit(f"{args.out_dir!r} already holds {checkpoint_path!r}: pass --resume to continue it, "
                         "or choose another --out_dir")

    # ---- model: built on meta, materialised on the device, initialised by parameter name
    with torch.device("meta"):
        model = gpt.GPT(config)
    model.to_empty(device=device)
    model.init_weights(args.seed)
    gpt.set_attention(model, args.attn, device, getattr(torch, args.dtype))

    # ---- strategy: none; every parameter lives whole on this device
    slots = [gpt.whole_slot(name, param) for name, param in model.named_parameters()]
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
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
    flops_per_token = gpt.flops_per_token(config, model.num_params(with_position_embedding=False))
    peak_flops = gpt.peak_flops(device)
    if master or args.log_all_ranks:
        print(f"{prefix}{args.model}: {model.num_params() / 1e6:.2f}M parameters | {world_size} rank on {device} | "
              f"global batch {args.global_batch} = micro batch {micro_batch} x {train_data.accumulation} accumulation "
              f"x {dp_size} data-parallel | {'resuming at step ' + str(start_step) if start_step else 'from scratch'}")

    # ---- loop
    for step in range(start_step, args.max_steps):
        last_step = step + 1 == args.max_steps
        val_loss = None
        if args.eval_interval and (step % args.eval_interval == 0 or last_step):
            val_loss = gpt.estimate_loss(forward, val_data, args.eval_iters, autocast).item()
        t0 = time.perf_counter()
        lr = gpt.get_lr(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=device)
        for micro_step in range(train_data.accumulation):
            x, y = train_data.get(step, micro_step)
            with autocast:
                loss = forward(x, y) / train_data.accumulation  # gradient of the mean over the global batch
            loss.backward()
            loss_sum += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip or float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if step % args.log_interval == 0 or last_step or val_loss is not None:
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

        # ---- checkpoint
        if (args.ckpt_interval and (step + 1) % args.ckpt_interval == 0) or last_step:
            gpt.save_shard(args.out_dir, step + 1, rank, gpt.checkpoint_tensors(slots, optimizer), gpt.rng_state(device))
            if master:
                gpt.publish_checkpoint(args.out_dir, step + 1, world_size, {"config": asdict(config), "args": vars(args)})

    if args.sample_tokens and master:
        tokenizer = get_tokenizer(meta["tokenizer"])
        prompt = torch.tensor([tokenizer.encode("\n")], device=device)
        with autocast:
            out = gpt.generate(model, prompt, args.sample_tokens, config.block_size, seed=args.seed)
        print("sample:\n" + tokenizer.decode(out[0].tolist()))


if __name__ == "__main__":
    main()
