"""
train_pp.py measured against its formulas: for each stage, the bubble, the activations autograd holds at the peak and
the bytes it sends; and its tokens/s against torch.distributed.pipelining's.

    python bench_pipeline.py --micro_batch 2          # or: python bench.py --pipeline --micro_batch 2
    python bench_pipeline.py --block_size 64 --global_batch 16 --micro_batch 2 --steps 12 --warmup 3

train_pp.py runs on 2 stages, m = --global_batch / --micro_batch micro-batches, under each schedule (GPipe, 1F1B),
ours and --impl torch, each run a fresh torchrun through bench.py's launcher. Inside each rank of ours, a worker
times every send and receive (the time a stage waits is the bubble, plus the transfers) and counts what autograd
saves for backward. Each figure is printed beside its formula: the bubble beside (p - 1) / (m + p - 1), the
activations beside the planner's (plan.stage_plan), the bytes sent beside m activations (or gradients) of
micro_batch x block_size x n_embd elements of the compute dtype. A file of its own, run as its own process by
bench.py --pipeline: it uses bench.py's launcher and flags, so bench.py cannot import it.
"""

import json
import os
import statistics
import sys
import tempfile
import time
import weakref

import torch

import bench
import gpt
import plan
import prepare_data
import train_pp
import training

STAGES = 2


class Saved:
    """What the worker's pack hook gives autograd for a tensor: `release` runs once autograd lets go of it."""

    def __init__(self, tensor, release):
        self.tensor = tensor
        weakref.finalize(self, release)


def worker(argv, out_path):
    """Inside each rank of a train_pp.py run: train_pp.main(argv), recording for every optimizer step its seconds,
    the seconds the stage waited on its sends and receives and when, the bytes it sent, and the most bytes autograd
    held saved for backward at once, parameters left out. Rank r writes them to out_path.r."""
    real_exchange = train_pp.exchange
    real_step = train_pp.PipelineParallel.step
    steps = []

    def exchange(operations):
        record = steps[-1]
        start = time.perf_counter()
        real_exchange(operations)
        end = time.perf_counter()
        record["waited_s"] += end - start
        record["waits"].append((start - record["started"], end - record["started"]))
        record["sent_bytes"] += sum(op.tensor.nbytes for op in operations if op.op == torch.distributed.isend)

    def step(self, *args, **kwargs):
        record = dict(waited_s=0.0, waits=[], sent_bytes=0, saved_bytes=0, started=time.perf_counter())
        steps.append(record)
        parameters = {p.untyped_storage().data_ptr() for p in self.parameters()}
        held = {}  # storage -> [tensors saved that share it, its bytes]: each storage counted once

        def release(key):
            held[key][0] -= 1
            if held[key][0] == 0:
                del held[key]

        def pack(tensor):
            key = tensor.untyped_storage().data_ptr()
            if key in parameters:
                return tensor
            held.setdefault(key, [0, tensor.untyped_storage().nbytes()])[0] += 1
            record["saved_bytes"] = max(record["saved_bytes"], sum(size for _, size in held.values()))
            return Saved(tensor, lambda: release(key))

        def unpack(saved):
            return saved.tensor if isinstance(saved, Saved) else saved

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            loss = real_step(self, *args, **kwargs)
        record["step_s"] = time.perf_counter() - record["started"]
        return loss

    train_pp.exchange = exchange
    train_pp.PipelineParallel.step = step
    train_pp.main(argv)
    with open(f"{out_path}.{os.environ.get('RANK', 0)}", "w") as f:
        json.dump(steps, f)


def stage_row(args, config, layout, stage, timed):
    """One stage of ours over the timed steps: the median bubble, the peak activations and the bytes sent, each
    beside the planner's or the formula's; and the last step's timeline (figures.py draws it)."""
    planned = plan.stage_plan(config, layout, stage, train_pp.stage_layers, train_pp.schedule)
    # A stage of 2 sends each micro-batch's activation forward (the first) or its gradient back (the last): one
    # residual stream of micro_batch x block_size x n_embd, in the compute dtype
    element = 2 if args.dtype == "bfloat16" else 4
    formula = layout.micro_batches * args.micro_batch * args.block_size * config.n_embd * element
    return dict(bubble=statistics.median(s["waited_s"] / s["step_s"] for s in timed),
                saved_bytes=max(s["saved_bytes"] for s in timed),
                planned_bytes=sum(size for item, size in planned if item.startswith(("activations", "bfloat16"))),
                sent_bytes=timed[-1]["sent_bytes"],
                formula_bytes=formula,
                waits=timed[-1]["waits"],
                step_s=timed[-1]["step_s"])


def measure(args, tmp):
    """Each schedule, ours and torch's: tokens/s (the median over the steps after --warmup), and for ours each
    stage's stage_row. Returns the rows."""
    vocab_size = prepare_data.ensure_data(args.data, is_writer=True)["vocab_size"]
    config = gpt.make_config(args.model, vocab_size, args.block_size)
    micro_batches = args.global_batch // args.micro_batch
    flags = bench.our_flags(args, args.global_batch) + ["--micro_batch", str(args.micro_batch), "--pp", str(STAGES)]
    print(f"train_pp.py: {args.model}, {STAGES} stages, m = {micro_batches} micro-batches of {args.micro_batch}; "
          f"bubble formula (p - 1) / (m + p - 1) = {(STAGES - 1) / (micro_batches + STAGES - 1):.3f}")
    rows = []
    for schedule in ("gpipe", "1f1b"):
        layout = plan.Layout("pp", STAGES, 1, 1, args.micro_batch, args.dtype, device=args.device, pp=STAGES,
                             micro_batches=micro_batches, schedule=schedule)
        for impl in ("ours", "torch"):
            out = os.path.join(tmp, f"pp-{schedule}-{impl}")
            run = ["--worker", out + ".stages", "--"] + flags + ["--schedule", schedule, "--impl", impl]
            records, output = bench.launch(os.path.abspath(__file__), run, out, STAGES, args.threads)
            if records is None:
                raise SystemExit(f"train_pp.py --schedule {schedule} --impl {impl} failed:\n{output[-3000:]}")
            tokens_per_s = statistics.median(r["tokens_per_s"] for r in records[args.warmup:])
            row = dict(schedule=schedule, impl=impl, tokens_per_s=tokens_per_s, stages=[])
            for stage in range(STAGES) if impl == "ours" else []:  # torch's runs have no worker inside
                with open(f"{out}.stages.{stage}") as f:
                    timed = json.load(f)[args.warmup:]
                measured = stage_row(args, config, layout, stage, timed)
                row["stages"].append(measured)
                print(f"  {schedule:5} stage {stage}: bubble {measured['bubble']:.3f} | activations at the peak "
                      f"{measured['saved_bytes'] / 2**20:.2f} MiB, planned {measured['planned_bytes'] / 2**20:.2f} MiB"
                      f" | sent {measured['sent_bytes'] / 2**20:.3f} MiB a step, formula "
                      f"{measured['formula_bytes'] / 2**20:.3f} MiB")
            print(f"  {schedule:5} {impl:5}: {tokens_per_s:,.0f} tokens/s")
            rows.append(row)
    return rows


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:  # inside each rank of our runs: --worker OUT_PATH -- train_pp.py's flags
        return worker(argv[3:], argv[1])
    args = bench.arguments(__doc__).parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.vocab_size:
            args.data = bench.synthetic_data(os.path.join(tmp, f"vocab-{args.vocab_size}"), args.vocab_size)
        rows = measure(args, tmp)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    training.run(main)  # its end too: a torchrun worker that exits otherwise can abort (see training.run)
