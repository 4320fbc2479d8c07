"""
Side-by-side throughput, memory and communication of every strategy, ours against PyTorch's own.

    python bench.py                                  # every strategy whose script exists, tiny model, CPU
    python bench.py --strategies ddp,fsdp --steps 30 --rounds 3
    python bench.py --model gpt2 --block_size 1024 --global_batch 32 --device cuda --dtype bfloat16 --compile
    python bench.py --strategies tp --model gpt2-medium --vocab_size 50257 --sequence_parallel   # GPT-2's vocabulary
    python bench.py --gpu_check --device cuda --json gpu.json   # a GPU machine's first check: runs gpu_check.py
    python bench.py --checkpointing                  # what --activation_checkpointing costs and saves, per strategy
    python bench.py --what_fits                      # the smallest layout for GPT-2 124M ... GPT-3 175B (plan.py's)
    python bench.py --pipeline --micro_batch 2       # train_pp.py: bubble, activations and sends against formulas

Each run is a fresh `torchrun --standalone` of the training script for --steps optimizer steps. Runs are
interleaved (round 1: ours, torch, ...; round 2: ours, torch, ...) so that drift of the machine hits both sides
alike; a row reports the best round. Step time is the median over the steps after --warmup, excluding the one
step that is profiled: that step's collectives are read from torch.profiler (the same record for our code, for
DistributedDataParallel's C++ reducer and for DTensor's functional collectives) and turned into bytes sent per
rank with the ring-algorithm factors, next to the formula each strategy should meet: plan.comm_formula() lists every
collective of a step (what it moves, how many, the bytes), with the backend's own factors (gloo's reduce-scatter is an
all-reduce). tp_sequence_parallel and tp_no_loss_parallel are train_tp.py's other two modes.
On CPU, ranks get one thread each; so does the single-device baseline the scaling efficiency is measured against.
"""

import argparse
import importlib.util
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import weakref
from contextlib import contextmanager

import torch

import gpt
import plan
import prepare_data
import train_ddp
import train_fsdp
import train_pp
import train_tp
import training

HERE = os.path.dirname(os.path.abspath(__file__))
# The strategies' own functions, which plan.py reads what they build from (it cannot import the scripts)
STRATEGY_CODE = dict(sliced=train_tp.is_sliced, units=train_fsdp.flat_parameter_groups)
BYTES = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "long int": 8, "int": 4}


def payload_bytes(event):
    dims, types = event["args"].get("Input Dims", []), event["args"].get("Input type", [])
    return sum(math.prod(shape) * BYTES.get(dtype, 4) for shape, dtype in zip(dims, types))


def collective_kind(name):
    """The kind of collective a profiler record names, whatever the backend calls it: gloo's `gloo:all_reduce`,
    NCCL's `nccl:_allgather_base` or `nccl:reduce_scatter_tensor_coalesced`, a barrier run as an all-reduce. A name
    it cannot classify is an error: counted blindly, its bytes would be wrong without a word."""
    op = name.split(":", 1)[-1].lower().strip("_").replace("allreduce", "all_reduce").replace("allgather", "all_gather")
    op = re.sub(r"(_base|_coalesced|_into_tensor|_tensor|_single)+$", "", op)
    if op.endswith("barrier"):
        return "barrier"
    if op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send", "recv", "reduce",
              "gather", "scatter"):
        return op
    raise ValueError(f"profiler record {name!r} is a collective bench.py cannot classify: add it to collective_kind")


# ------------------------------------------------------------------------------------------------------------
# What one rank holds, measured: the memory planner's test (test_parallel.py) and the checkpointing table use it


@contextmanager
def memory_held(measured):
    """While inside, a training script's main() run in this process records in `measured` what its rank holds:
    bytes of parameters, gradients and optimizer state after the first optimizer step, and of the tensors autograd
    saves for backward during the first micro-batch's forward ("activations"), each storage once. Under our FSDP
    its own pack hook decides what is kept (gathered weights by reference, so they are not counted); the rank's
    parameters are never activations; a checkpointed block's inputs are (torch's checkpoint saves them)."""
    from torch.distributed.tensor import DTensor
    from torch.optim.optimizer import register_optimizer_step_post_hook

    saved, parameters = {}, set()
    # --impl torch's tensor parallelism: a DTensor has no storage of its own; its local tensor does.
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731

    def keep(tensor):
        storage = local(tensor).untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    real_pack, real_wrap_blocks = train_fsdp.FullyShardedDataParallel._pack, training.wrap_blocks

    def fsdp_pack(self, tensor):
        packed = real_pack(self, tensor)
        return keep(packed) if packed is tensor else packed

    def wrap_blocks(model, *args):  # every script calls it once, on the model its loop runs
        model = real_wrap_blocks(model, *args)
        parameters.update(local(p).untyped_storage().data_ptr() for p in model.parameters())
        forward = model.forward

        def counted(*inputs):
            if not torch.is_grad_enabled() or "activations" in measured:  # evaluation; later micro-batches
                return forward(*inputs)
            with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
                output = forward(*inputs)
            measured["activations"] = sum(saved.values())
            return output
        model.forward = counted
        return model

    def storage_bytes(tensors):
        return sum({local(t).untyped_storage().data_ptr(): local(t).untyped_storage().nbytes()
                    for t in tensors}.values())

    def after_step(optimizer, args, kwargs):
        if "parameters" not in measured:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            measured.update(parameters=storage_bytes(params), gradients=storage_bytes([p.grad for p in params]),
                            optimizer=sum(local(t).nbytes for state in optimizer.state.values()
                                          for t in state.values()))

    train_fsdp.FullyShardedDataParallel._pack, training.wrap_blocks = fsdp_pack, wrap_blocks
    handle = register_optimizer_step_post_hook(after_step)
    try:
        yield measured
    finally:
        handle.remove()
        train_fsdp.FullyShardedDataParallel._pack, training.wrap_blocks = real_pack, real_wrap_blocks


# ------------------------------------------------------------------------------------------------------------
# The worker: runs inside each torchrun rank, wraps the script's main() with a profiler over one step


def worker(script, argv, profile_step, out_path):
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    profiler = profile(activities=activities, record_shapes=True)
    steps = {"done": 0}

    def after_optimizer_step(optimizer, args, kwargs):
        # The collectives of step s run during its backward, before optimizer.step: profile from the end of
        # step s-1 to the end of step s.
        steps["done"] += 1
        if steps["done"] == profile_step:
            profiler.start()
        elif steps["done"] == profile_step + 1:
            profiler.stop()

    register_optimizer_step_post_hook(after_optimizer_step)
    module = importlib.import_module(os.path.splitext(script)[0])  # by name: train_2d.py shares train_fsdp with it
    with memory_held({}) as held:
        module.main(argv)
    if int(os.environ.get("RANK", 0)) == 0:
        trace = out_path + ".trace.json"
        profiler.export_chrome_trace(trace)
        with open(trace) as f:
            events = json.load(f)["traceEvents"]
        os.remove(trace)
        collectives = [{"kind": collective_kind(e["name"]), "bytes": payload_bytes(e)} for e in events
                       if e.get("name", "").startswith(("gloo:", "nccl:"))]
        with open(out_path, "w") as f:
            json.dump({"collectives": collectives, "held": held}, f)


# ------------------------------------------------------------------------------------------------------------
# The driver


def strategies(args):
    """name -> (script, ranks, extra flags, impls, group size of its collectives, formula: [Term] of one step)."""
    meta = prepare_data.ensure_data(args.data, is_writer=True)
    config = gpt.make_config(args.model, meta["vocab_size"], args.block_size)
    backend = "nccl" if args.device == "cuda" else "gloo"
    formula = lambda strategy, **layout: lambda: plan.comm_formula(  # noqa: E731
        strategy, config, args.global_batch, dtype=args.dtype, backend=backend, bucket_mb=args.bucket_mb,
        buckets=train_ddp.assign_buckets, **STRATEGY_CODE, **layout)
    sequence_parallel = ["--sequence_parallel"] * args.sequence_parallel  # --sequence_parallel: tp and 2d with it
    return {
        "single": ("train_single.py", 1, [], [None], 1, lambda: []),
        "ddp": ("train_ddp.py", 2, ["--bucket_mb", str(args.bucket_mb)], ["ours", "torch"], 2, formula("ddp", dp=2)),
        "fsdp": ("train_fsdp.py", 2, [], ["ours", "torch"], 2, formula("fsdp", dp=2)),
        "tp": ("train_tp.py", 2, ["--tp", "2"] + sequence_parallel, ["ours", "torch"], 2,
               formula("tp", tp=2, sequence_parallel=args.sequence_parallel)),
        "tp_sequence_parallel": ("train_tp.py", 2, ["--tp", "2", "--sequence_parallel"], ["ours", "torch"], 2,
                                 formula("tp", tp=2, sequence_parallel=True)),
        "tp_no_loss_parallel": ("train_tp.py", 2, ["--tp", "2", "--no_loss_parallel"], ["ours", "torch"], 2,
                                formula("tp", tp=2, loss_parallel=False)),
        "2d": ("train_2d.py", 4, ["--tp", "2", "--dp", "2"] + sequence_parallel, ["ours", "torch"], 2,
               formula("2d", tp=2, dp=2, sequence_parallel=args.sequence_parallel)),
    }


def run_flags(model, data, block_size, global_batch, steps, device):
    """The flags every benchmarked run shares (gpu_check.py's too): no evaluation, checkpoint or sample; every step
    logged."""
    return ["--model", model, "--data", data, "--block_size", str(block_size), "--global_batch", str(global_batch),
            "--max_steps", str(steps), "--warmup_steps", "5", "--eval_interval", "0", "--log_interval", "1",
            "--ckpt_interval", "0", "--sample_tokens", "0", "--device", device]


def our_flags(args, global_batch):
    """run_flags with this benchmark's --dtype and --compile."""
    return run_flags(args.model, args.data, args.block_size, global_batch, args.steps, args.device) + [
        "--dtype", args.dtype] + ["--compile"] * args.compile


def run_once(args, name, script, ranks, extra, impl, group_size, global_batch, tmp):
    out_dir = os.path.join(tmp, f"{name}-{impl}-{ranks}-{global_batch}")
    shutil.rmtree(out_dir, ignore_errors=True)  # the previous round's run: a fresh run refuses a used --out_dir
    comms_path = out_dir + ".comms.json"
    flags = our_flags(args, global_batch) + ["--out_dir", out_dir] + extra
    flags += ["--impl", impl] if impl else []
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
               os.path.abspath(__file__), "--worker", script, "--profile_step", str(args.steps - 1),
               "--comms_out", comms_path, "--"] + flags
    print(f"{name} {impl or ''} on {ranks} rank(s), global batch {global_batch}", flush=True)
    result = subprocess.run(command, env=env, cwd=HERE, capture_output=True, text=True)
    if result.returncode:
        # torchrun's banners out
        stderr = [line for line in result.stderr.splitlines() if not re.match(r"[WI]\d{4} ", line)]
        print(result.stdout[-2000:] + "\n".join(stderr)[-6000:])
        raise SystemExit(f"{name} ({impl}) failed: {' '.join(command)}")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    timed = [r for r in records if args.warmup <= r["step"] < args.steps - 2]
    step_ms = statistics.median(r["step_ms"] for r in timed)
    with open(comms_path) as f:
        recorded = json.load(f)
    collectives = recorded["collectives"]
    return {"activation_bytes": recorded["held"].get("activations"),
            "tokens_per_s": global_batch * args.block_size / (step_ms / 1000), "step_ms": step_ms,
            # before the last step: the profiler's records and the final checkpoint's gathers are not the strategy's
            "peak_mem_mb": max(r["peak_mem_mb"] for r in records if r["step"] < args.steps - 1),
            "mfu": timed[-1]["mfu"],
            "comm_bytes": sum(plan.wire_bytes(c["kind"], c["bytes"], group_size) for c in collectives),
            "collectives": len(collectives)}


def synthetic_data(folder, vocab_size, num_tokens=2_000_000, seed=0):
    """Uniform random token ids of any vocabulary (GPT-2's 50257, say) as a prepared data folder, made offline in a
    second: throughput and memory depend on the vocabulary's size, not on what the tokens say."""
    import numpy as np

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    for split, count in (("train", num_tokens), ("val", num_tokens // 10)):
        rng.integers(0, vocab_size, size=count, dtype=np.uint16).tofile(os.path.join(folder, f"{split}.bin"))
    with open(os.path.join(folder, "meta.json"), "w") as f:
        json.dump({"tokenizer": "gpt2", "vocab_size": vocab_size, "source": "synthetic"}, f)
    return folder


def launch(script, flags, out_dir, ranks=1, threads=1, env=None, timeout=None):
    """torchrun of one script: (its metrics.jsonl records, its output), or (None, its output) if it failed (an
    out-of-memory, say) or ran past `timeout` seconds."""
    shutil.rmtree(out_dir, ignore_errors=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
               script] + flags + ["--out_dir", out_dir]
    process = subprocess.Popen(command, env=dict(os.environ, OMP_NUM_THREADS=str(threads), **(env or {})), cwd=HERE,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output = process.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        process.terminate()  # torchrun ends its ranks on SIGTERM: none is left holding the GPU
        output = process.communicate()[0] + f"\nstopped: still running after {timeout:.0f} s"
    if process.returncode:
        print("\n".join(output.splitlines()[-5:]), file=sys.stderr)
        return None, output
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f], output


# ------------------------------------------------------------------------------------------------------------
# --pipeline: train_pp.py's bubble, saved activations and sends, each beside its formula


class Saved:
    """What pipeline_worker's pack hook gives autograd for a tensor: `release` runs once autograd lets go of it."""

    def __init__(self, tensor, release):
        self.tensor = tensor
        weakref.finalize(self, release)


def pipeline_worker(argv, out_path):
    """Inside each rank of a train_pp.py run: for every optimizer step, its seconds, the seconds the stage waited on
    its sends and receives (the bubble, and the transfers) and when, the bytes it sent, and the most bytes autograd
    held saved for backward at once, parameters left out. Rank r writes them to out_path.r."""
    import train_pp

    real_exchange = train_pp.exchange
    real_step = train_pp.PipelineParallel.step
    steps = []

    def exchange(operations):
        start = time.perf_counter()
        real_exchange(operations)
        end = time.perf_counter()
        steps[-1]["waited_s"] += end - start
        steps[-1]["waits"].append((start - steps[-1]["started"], end - steps[-1]["started"]))
        steps[-1]["sent_bytes"] += sum(op.tensor.nbytes for op in operations if op.op == torch.distributed.isend)

    def step(self, *args, **kwargs):
        record = dict(waited_s=0.0, waits=[], sent_bytes=0, saved_bytes=0, started=time.perf_counter())
        held = {}  # storage -> (saved tensors, bytes)
        parameters = {p.untyped_storage().data_ptr() for p in self.parameters()}
        steps.append(record)

        def release(key):
            count, size = held.pop(key)
            if count > 1:
                held[key] = (count - 1, size)

        def pack(tensor):
            key = tensor.untyped_storage().data_ptr()
            if key in parameters:
                return tensor
            count, size = held.get(key, (0, tensor.untyped_storage().nbytes()))
            held[key] = (count + 1, size)
            record["saved_bytes"] = max(record["saved_bytes"], sum(size for _, size in held.values()))
            return Saved(tensor, lambda: release(key))

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda saved: getattr(saved, "tensor", saved)):
            loss = real_step(self, *args, **kwargs)
        record["step_s"] = time.perf_counter() - record["started"]
        return loss

    train_pp.exchange = exchange
    train_pp.PipelineParallel.step = step
    train_pp.main(argv)
    with open(f"{out_path}.{os.environ.get('RANK', 0)}", "w") as f:
        json.dump(steps, f)


def pipeline(args, tmp):
    """--pipeline: train_pp.py on 2 stages, each schedule, ours and torch's: tokens/s; and for each stage of ours,
    the median over the steps after --warmup of the bubble, the activations saved at the peak and the bytes sent,
    beside (p - 1) / (m + p - 1), the planner's activations and the sends' formula."""
    config = gpt.make_config(args.model, prepare_data.ensure_data(args.data, is_writer=True)["vocab_size"],
                             args.block_size)
    layout = plan.Layout("pp", 2, 1, 1, args.micro_batch, args.dtype, device=args.device, pp=2,
                         micro_batches=args.global_batch // args.micro_batch)
    sends = layout.micro_batches  # a stage of 2 sends each micro-batch's activation forward, or its gradient back
    flags = our_flags(args, args.global_batch) + ["--micro_batch", str(args.micro_batch), "--pp", "2"]
    rows = []
    print(f"train_pp.py: {args.model}, 2 stages, m = {layout.micro_batches} micro-batches of {args.micro_batch}; "
          f"bubble formula (p - 1) / (m + p - 1) = {1 / (layout.micro_batches + 1):.3f}")
    for schedule in ("gpipe", "1f1b"):
        for impl in ("ours", "torch"):
            out = os.path.join(tmp, f"pp-{schedule}-{impl}")
            worker = ["--pipeline_worker", out + ".stages", "--"] + flags + ["--schedule", schedule, "--impl", impl]
            records, output = launch(os.path.abspath(__file__), worker, out, 2, args.threads)
            if records is None:
                raise SystemExit(f"train_pp.py --schedule {schedule} --impl {impl} failed:\n{output[-3000:]}")
            tokens_per_s = statistics.median(r["tokens_per_s"] for r in records[args.warmup:])
            row = dict(schedule=schedule, impl=impl, tokens_per_s=tokens_per_s, stages=[])
            for stage in range(2) if impl == "ours" else []:
                with open(f"{out}.stages.{stage}") as f:
                    timed = json.load(f)[args.warmup:]
                plan_rows = plan.stage_plan(config, layout._replace(schedule=schedule), stage, train_pp.stage_layers,
                                            train_pp.schedule)
                measured = dict(bubble=statistics.median(s["waited_s"] / s["step_s"] for s in timed),
                                saved_bytes=max(s["saved_bytes"] for s in timed), planned_bytes=sum(
                                    size for item, size in plan_rows if item.startswith(("activations", "bfloat16"))),
                                sent_bytes=timed[-1]["sent_bytes"], formula_bytes=sends * args.micro_batch
                                * args.block_size * config.n_embd * 4,  # float32: the residual stream
                                waits=timed[-1]["waits"], step_s=timed[-1]["step_s"])  # the last step's timeline
                row["stages"].append(measured)
                print(f"  {schedule:5} stage {stage}: bubble {measured['bubble']:.3f} | activations at the peak "
                      f"{measured['saved_bytes'] / 2**20:.2f} MiB, planned {measured['planned_bytes'] / 2**20:.2f} MiB"
                      f" | sent {measured['sent_bytes'] / 2**20:.3f} MiB a step, formula "
                      f"{measured['formula_bytes'] / 2**20:.3f} MiB")
            print(f"  {schedule:5} {impl:5}: {tokens_per_s:,.0f} tokens/s")
            rows.append(row)
    return rows


def checkpointing_cost(args, table, chosen, tmp):
    """--checkpointing: each strategy (ours) without and with --activation_checkpointing, interleaved by round:
    tokens/s, the bytes the first micro-batch saved for backward (measured: memory_held), and peak memory."""
    runs = {}
    for _ in range(args.rounds):
        for name in chosen:
            script, ranks, extra, impls, group_size, _formula = table[name]
            for checkpointing in (False, True):
                flags = extra + ["--activation_checkpointing"] * checkpointing
                row = run_once(args, name + "-ac" * checkpointing, script, ranks, flags, impls[0], group_size,
                               args.global_batch, tmp)
                runs.setdefault((name, ranks, checkpointing), []).append(row)
    best = {key: max(rows, key=lambda r: r["tokens_per_s"]) for key, rows in runs.items()}
    print(f"\n{args.model}, block {args.block_size}, global batch {args.global_batch}, {args.device} {args.dtype}: "
          "ours without and with --activation_checkpointing, best of each")
    header = (f"{'strategy':10} {'ranks':>5} {'tok/s':>9} {'tok/s AC':>9} {'AC/not':>7} {'saved MB':>9} "
              f"{'saved MB AC':>11} {'AC/not':>7} {'peak MB':>8} {'peak MB AC':>10}")
    print(header + "\n" + "-" * len(header))
    rows = []
    for name in chosen:
        ranks = table[name][1]
        plain, recomputed = best[(name, ranks, False)], best[(name, ranks, True)]
        print(f"{name:10} {ranks:5d} {plain['tokens_per_s']:9,.0f} {recomputed['tokens_per_s']:9,.0f} "
              f"{recomputed['tokens_per_s'] / plain['tokens_per_s']:7.2f} {plain['activation_bytes'] / 2**20:9.2f} "
              f"{recomputed['activation_bytes'] / 2**20:11.2f} "
              f"{recomputed['activation_bytes'] / plain['activation_bytes']:7.3f} {plain['peak_mem_mb']:8,.0f} "
              f"{recomputed['peak_mem_mb']:10,.0f}")
        rows.append(dict(strategy=name, ranks=ranks, without=plain, activation_checkpointing=recomputed))
    return rows


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--gpu_check" in argv:  # a file of its own, run as its own process: gpu_check.py imports this one
        command = [sys.executable, os.path.join(HERE, "gpu_check.py")] + [a for a in argv if a != "--gpu_check"]
        raise SystemExit(subprocess.run(command).returncode)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=training.HelpFormatter)
    p.add_argument("--strategies", default="single,ddp,fsdp,tp,2d", help="comma-separated strategies to run")
    p.add_argument("--model", default="tiny", choices=list(gpt.PRESETS), help="model size, from gpt.py's presets")
    p.add_argument("--data", default=training.DEFAULT_DATA_DIR,
                   help="prepared data folder (default: the embedded corpus, built on first use)")
    p.add_argument("--vocab_size", type=int,
                   help="train on synthetic tokens of this vocabulary (GPT-2's: 50257), made offline, not on --data")
    p.add_argument("--sequence_parallel", action="store_true", help="tp and 2d with --sequence_parallel")
    p.add_argument("--block_size", type=int, default=128, help="context length, in tokens")
    p.add_argument("--global_batch", type=int, default=16, help="sequences per optimizer step")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps of each run")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the timing")
    p.add_argument("--rounds", type=int, default=2, help="runs of each strategy and implementation; the best counts")
    p.add_argument("--bucket_mb", type=float, default=25, help="DDP's largest gradient bucket, in MiB")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the ranks compute")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="bfloat16: autocast, float32 master weights")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per rank (and for the single baseline)")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--gpu_check", action="store_true",
                   help="python gpu_check.py with the other flags: a GPU machine's first check (gpu_check.py --help)")
    p.add_argument("--checkpointing", action="store_true",
                   help="what --activation_checkpointing costs and saves: each strategy (ours) without and with it")
    p.add_argument("--pipeline", action="store_true", help="train_pp.py's bubble, activations and sends against "
                   "their formulas, and its tokens/s against torch's (m = --global_batch / --micro_batch)")
    p.add_argument("--what_fits", action="store_true",
                   help="print plan.what_fits's table: the smallest layout for each preset on 8 and 64 GPUs (no runs)")
    p.add_argument("--gpu_memory", type=float, default=80, help="--what_fits: one GPU's memory, in GB (10^9 bytes)")
    p.add_argument("--micro_batch", type=int, default=1, help="--what_fits, --pipeline: sequences per micro-step")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--profile_step", type=int, help=argparse.SUPPRESS)
    p.add_argument("--comms_out", help=argparse.SUPPRESS)
    p.add_argument("--pipeline_worker", help=argparse.SUPPRESS)
    args, rest = p.parse_known_args(argv)
    if args.worker:
        return worker(args.worker, rest[1:] if rest[:1] == ["--"] else rest, args.profile_step, args.comms_out)
    if args.pipeline_worker:
        return pipeline_worker(rest[1:] if rest[:1] == ["--"] else rest, args.pipeline_worker)

    if args.what_fits:
        return plan.what_fits(args.gpu_memory, args.micro_batch, **STRATEGY_CODE)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.vocab_size:
            args.data = synthetic_data(os.path.join(tmp, f"vocab-{args.vocab_size}"), args.vocab_size)
        table = strategies(args)
        chosen = [s for s in args.strategies.split(",") if os.path.exists(os.path.join(HERE, table[s][0]))]
        if args.checkpointing or args.pipeline:
            rows = (checkpointing_cost(args, table, chosen, tmp) if args.checkpointing else pipeline(args, tmp))
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=2)
            return
        for _ in range(args.rounds):
            for name in chosen:
                script, ranks, extra, impls, group_size, _formula = table[name]
                for impl in impls:
                    row = run_once(args, name, script, ranks, extra, impl, group_size, args.global_batch, tmp)
                    runs.setdefault((name, impl, ranks), []).append(row)
                if name == "ddp":  # the scaling baseline: one rank at the same per-rank batch
                    row = run_once(args, "single", "train_single.py", 1, [], None, 1, args.global_batch // ranks, tmp)
                    runs.setdefault(("single/rank", None, 1), []).append(row)
    best = {key: max(rows, key=lambda r: r["tokens_per_s"]) for key, rows in runs.items()}

    vocabulary = f"synthetic vocabulary {args.vocab_size}" if args.vocab_size else args.data
    print(f"\n{args.model}, {vocabulary}, block {args.block_size}, global batch {args.global_batch}, "
          f"{args.device} {args.dtype}{', sequence parallel' * args.sequence_parallel}, "
          f"{args.threads} thread(s) a rank, best of {args.rounds} rounds, "
          f"median of steps {args.warmup}..{args.steps - 3}")
    header = f"{'strategy':20} {'impl':6} {'ranks':>5} {'tok/s':>9} {'step ms':>8} {'peak MB':>8} {'mfu':>6} " \
             f"{'comm MB/step':>12} {'formula MB':>10} {'colls':>6}"
    print(header + "\n" + "-" * len(header))
    for (name, impl, ranks), row in best.items():
        formula = sum(term.bytes for term in table[name][5]()) if name in table else 0
        mfu = "n/a" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
        print(f"{name:20} {impl or '-':6} {ranks:5d} {row['tokens_per_s']:9,.0f} {row['step_ms']:8.1f} "
              f"{row['peak_mem_mb']:8,.0f} {mfu:>6} {row['comm_bytes'] / 2**20:12.2f} {formula / 2**20:10.2f} "
              f"{row['collectives']:6d}")
    print()
    for name in chosen:
        ours, torch_row = best.get((name, "ours", table[name][1])), best.get((name, "torch", table[name][1]))
        if ours and torch_row:
            print(f"{name}: ours/torch tokens/s {ours['tokens_per_s'] / torch_row['tokens_per_s']:.3f}, "
                  f"peak memory {ours['peak_mem_mb'] / torch_row['peak_mem_mb']:.3f}")
    if ("single/rank", None, 1) in best and ("ddp", "ours", 2) in best:
        for impl in ("ours", "torch"):
            scaling = best[("ddp", impl, 2)]["tokens_per_s"] / (2 * best[("single/rank", None, 1)]["tokens_per_s"])
            print(f"ddp {impl}: scaling efficiency on 2 ranks vs 1 rank at the same per-rank batch {scaling:.3f}")
    backend = "nccl" if args.device == "cuda" else "gloo"
    print(f"\nthe formulas on {backend}, per rank per optimizer step (collectives, MB):")
    for name in chosen:
        for term in table[name][5]():
            print(f"{name:20} {term.kind:14} {term.group:5} {term.count:4d} {term.bytes / 2**20:9.3f}  {term.what}")
    if backend == "gloo":
        print("note: gloo runs reduce_scatter_tensor as an all-reduce of the whole input (its profiler trace shows "
              "gloo:all_reduce), sending twice what NCCL's ring reduce-scatter sends; the formulas count it so.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(strategy=k[0], impl=k[1], ranks=k[2], formula_bytes=sum(t.bytes for t in table[k[0]][5]())
                            if k[0] in table else 0, **v) for k, v in best.items()], f, indent=2)


if __name__ == "__main__":
    training.run(main)  # its end too: a torchrun worker that exits otherwise can abort (see training.run)
