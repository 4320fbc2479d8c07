"""
Side-by-side throughput, memory and communication of every strategy, ours against PyTorch's own.

    python bench.py                                  # every strategy whose script exists, tiny model, CPU
    python bench.py --strategies ddp,fsdp --steps 30 --rounds 3
    python bench.py --strategies ddp,zero1,zero2,fsdp,hsdp   # the ZeRO ladder: each rank's model states and bytes
    python bench.py --model gpt2 --block_size 1024 --global_batch 32 --device cuda --dtype bfloat16 --compile
    python bench.py --strategies tp --model gpt2-medium --vocab_size 50257 --sequence_parallel   # GPT-2's vocabulary
    python bench.py --strategies fsdp,tp,2d --model llama-tiny       # Llama 3: --vocab_size 128256 for its vocabulary
    python bench.py --gpu_check --device cuda --json gpu.json   # a GPU machine's first check: runs gpu_check.py
    python bench.py --checkpointing                  # what --activation_checkpointing costs and saves, per strategy
    python bench.py --context_parallel              # train_cp.py: activations, bytes, attention work per rank
    python bench.py --strategies ep --model moe-tiny --dtype bfloat16   # train_ep.py's all-to-alls (ours alone)
    python bench.py --startup --model gpt2-xl        # FSDP rank 0's init and resume at 1, 2, 4, 8 ranks: bench_startup.py
    python bench.py --what_fits                      # the smallest layout for GPT-2 124M ... GPT-3 175B (plan.py's)
    python bench.py --pipeline --micro_batch 2       # train_pp.py against its formulas: runs bench_pipeline.py
    python bench.py --strategies tp --baseline ../old   # ours beside an earlier commit: git worktree add ../old REV

Each run is a fresh `torchrun --standalone` of the training script for --steps optimizer steps. Runs are
interleaved (round 1: ours, torch, ...; round 2: ours, torch, ...) so that drift of the machine hits both sides
alike; a row reports the best round. Step time is the median over the steps after --warmup, excluding the one
step that is profiled: that step's collectives are read from torch.profiler (the same record for our code, for
DistributedDataParallel's C++ reducer and for DTensor's functional collectives) and turned into bytes sent per
rank with the ring-algorithm factors, next to the formula each strategy should meet: plan.comm_formula() lists every
collective of a step (what it moves, how many, the bytes), with the backend's own factors (gloo's reduce-scatter is an
all-reduce); so are each rank's model states (parameters, gradients, AdamW state), measured after an optimizer step
beside plan.plan_memory's. zero1 and zero2 are train_zero.py's stages, hsdp train_fsdp.py --replicate 2 on 4 ranks,
fsdp_cpu_offload train_fsdp.py --cpu_offload;
tp_sequence_parallel and tp_no_loss_parallel are train_tp.py's other two modes.
On CPU, ranks get one thread each; so does the single-device baseline the scaling efficiency is measured against.
"""

import argparse
import collections
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
from contextlib import contextmanager

import torch

import gpt
import plan
import prepare_data
import train_cp
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


def after_each_step(callback):
    """callback(optimizer) after each outermost optimizer step (ZeroRedundancyOptimizer's step runs its own AdamW's
    inside it): the hooks' handles."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    depth = [0]

    def enter(optimizer, args, kwargs):
        depth[0] += 1

    def leave(optimizer, args, kwargs):
        depth[0] -= 1
        if depth[0] == 0:
            callback(optimizer)

    return register_optimizer_step_pre_hook(enter), register_optimizer_step_post_hook(leave)


# ------------------------------------------------------------------------------------------------------------
# What one rank holds, measured: the memory planner's test (test_parallel.py) and the checkpointing table use it


@contextmanager
def memory_held(measured):
    """While inside, a training script's main() run in this process records in `measured` what its rank holds:
    bytes of parameters, gradients and optimizer state after the first optimizer step, and of the tensors autograd
    saves for backward during the first micro-batch's forward ("activations"), each storage once. Our FSDP's
    gathered `full` buffers are weights, freed after use, and the rank's parameters are never activations; a
    checkpointed block's inputs are (torch's checkpoint saves them). With our FSDP, "gathered weights": the most
    bytes of gathered units at once over the first step, forward and backward, sampled at every gather."""
    from torch.distributed.tensor import DTensor

    saved, parameters, flats = {}, set(), []  # flats: our FSDP's, whose gathered `full` buffers are weights
    # --impl torch's tensor parallelism: a DTensor has no storage of its own; its local tensor does.
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731

    def keep(tensor):
        storage = local(tensor).untyped_storage()
        gathered = {flat.full.data_ptr(): flat.full.untyped_storage().nbytes() for flat in flats if flat.is_gathered()}
        if storage.data_ptr() not in parameters | gathered.keys():
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    def sampled(flat):  # a gather is the one place the gathered bytes grow: sample there, forward and backward
        start_gather = flat.start_gather

        def sampling():
            start_gather()
            if "parameters" not in measured:  # the first step
                held = sum(other.full.untyped_storage().nbytes() for other in flats if other.is_gathered())
                measured["gathered weights"] = max(measured.get("gathered weights", 0), held)
        flat.start_gather = sampling

    real_wrap_blocks = training.wrap_blocks

    def wrap_blocks(model, *args):  # every script calls it once, on the model its loop runs
        model = real_wrap_blocks(model, *args)
        parameters.update(local(p).untyped_storage().data_ptr() for p in model.parameters())
        flats.extend(getattr(model, "flats", []))
        for flat in flats:
            sampled(flat)
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

    def after_step(optimizer):
        if "parameters" not in measured:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            measured.update(parameters=storage_bytes(params), gradients=storage_bytes([p.grad for p in params]),
                            optimizer=sum(local(t).nbytes for state in optimizer.state.values()
                                          for t in state.values()))

    training.wrap_blocks = wrap_blocks
    handles = after_each_step(after_step)
    try:
        yield measured
    finally:
        for handle in handles:
            handle.remove()
        training.wrap_blocks = real_wrap_blocks


# ------------------------------------------------------------------------------------------------------------
# The worker: runs inside each torchrun rank, wraps the script's main() with a profiler over one step


def profiled(main, argv, profile_step):
    """main(argv) on this rank, its optimizer step `profile_step` under torch.profiler: (the collectives rank 0 ran in
    that step, each {kind, bytes}, or None on another rank: reading a step's trace takes seconds; what this rank held,
    memory_held's)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    profiler = profile(activities=activities, record_shapes=True)
    steps = {"done": 0}

    def after_optimizer_step(optimizer):
        # The collectives of step s run during its backward, before optimizer.step: profile from the end of
        # step s-1 to the end of step s.
        steps["done"] += 1
        if steps["done"] == profile_step:
            profiler.start()
        elif steps["done"] == profile_step + 1:
            profiler.stop()

    handles = after_each_step(after_optimizer_step)
    try:
        with memory_held({}) as held:
            main(argv)
    finally:
        for handle in handles:
            handle.remove()
    if int(os.environ.get("RANK", 0)) != 0:
        return None, held
    with tempfile.TemporaryDirectory() as folder:
        profiler.export_chrome_trace(os.path.join(folder, "trace.json"))
        with open(os.path.join(folder, "trace.json")) as f:
            events = json.load(f)["traceEvents"]
    collectives = [{"kind": collective_kind(e["name"]), "bytes": payload_bytes(e)} for e in events
                   if e.get("name", "").startswith(("gloo:", "nccl:"))]
    return collectives, held


def worker(script, argv, profile_step, out_path):
    module = importlib.import_module(os.path.splitext(script)[0])  # by name: train_2d.py shares train_fsdp with it
    collectives, held = profiled(module.main, argv, profile_step)
    if collectives is not None:
        with open(out_path, "w") as f:
            json.dump({"collectives": collectives, "held": held}, f)


# ------------------------------------------------------------------------------------------------------------
# The driver


# A benchmarked strategy: its script on `ranks` ranks with `flags`, run as each of `impls` (ours, --impl torch); the
# ranks in each group its collectives run over; formula(): plan.comm_formula's [Term] of one step; states(): the bytes
# of parameters, gradients and AdamW state the planner gives one rank
Strategy = collections.namedtuple("Strategy", "script ranks flags impls group_size formula states")


def model_states(config, layout):
    """Bytes of parameters, gradients and AdamW state one rank of `layout` holds, by the planner."""
    rows = plan.plan_memory(config, layout, buckets=train_ddp.assign_buckets, **STRATEGY_CODE)
    return sum(size for item, size in rows if item.startswith(("parameters", "gradients", "AdamW")))


def strategies(args):
    """name -> Strategy, at this benchmark's model, batch, dtype and backend."""
    meta = prepare_data.ensure_data(args.data, is_writer=True)
    config = gpt.make_config(args.model, meta["vocab_size"], args.block_size)
    backend = "nccl" if args.device == "cuda" else "gloo"
    formula = lambda strategy, **layout: lambda: plan.comm_formula(  # noqa: E731
        strategy, config, args.global_batch, dtype=args.dtype, backend=backend, bucket_mb=args.bucket_mb,
        buckets=train_ddp.assign_buckets, **STRATEGY_CODE, **layout)
    states = lambda strategy, world_size, dp, tp=1, **options: lambda: model_states(config, plan.Layout(  # noqa: E731
        strategy, world_size, dp, tp, 1, bucket_mb=args.bucket_mb, **options))
    sequence_parallel = ["--sequence_parallel"] * args.sequence_parallel  # --sequence_parallel: tp, 2d and 4d with it
    ours_and_torch = ["ours", "torch"]
    cp_impls = ours_and_torch if args.device == "cuda" else [None]  # torch's context_parallel: CUDA kernels alone
    buckets = ["--bucket_mb", str(args.bucket_mb)]
    micro_batch = train_pp.pipelined_micro_batch(args.global_batch, 2)  # train_4d.py's default at --pp 2, --dp 1
    four_d = plan.Layout("4d", 8, 1, 2, micro_batch, args.dtype, args.sequence_parallel, pp=2, cp=2,
                         micro_batches=args.global_batch // micro_batch)
    stage_0 = dict(stage=0, layers=train_pp.stage_layers, schedule=train_pp.schedule, sliced=train_tp.is_sliced)
    # train_ep.py needs a mixture of experts: moe-tiny where --model is dense
    moe = config if config.n_expert else gpt.make_config("moe-tiny", meta["vocab_size"], args.block_size)
    moe_model = [] if config.n_expert else ["--model", "moe-tiny"]
    return {
        "single": Strategy("train_single.py", 1, [], [None], 1, lambda: [], states("single", 1, 1)),
        "ddp": Strategy("train_ddp.py", 2, buckets, ours_and_torch, 2, formula("ddp", dp=2), states("ddp", 2, 2)),
        "zero1": Strategy("train_zero.py", 2, ["--stage", "1"] + buckets, ours_and_torch, 2,
                          formula("zero", dp=2, stage=1), states("zero", 2, 2, stage=1)),
        "zero2": Strategy("train_zero.py", 2, ["--stage", "2"] + buckets, ["ours"], 2,  # PyTorch has no ZeRO-2
                          formula("zero", dp=2, stage=2), states("zero", 2, 2, stage=2)),
        "fsdp": Strategy("train_fsdp.py", 2, [], ours_and_torch, 2, formula("fsdp", dp=2), states("fsdp", 2, 2)),
        "fsdp_cpu_offload": Strategy("train_fsdp.py", 2, ["--cpu_offload"], ours_and_torch, 2, formula("fsdp", dp=2),
                                     states("fsdp", 2, 2)),  # on CPU both sides are the host: the bookkeeping's cost
        "hsdp": Strategy("train_fsdp.py", 4, ["--replicate", "2"], ours_and_torch, 2,  # groups of 2, the loss over 4
                         formula("fsdp", dp=4, replicate=2), states("fsdp", 4, 4, replicate=2)),
        "tp": Strategy("train_tp.py", 2, ["--tp", "2"] + sequence_parallel, ours_and_torch, 2,
                       formula("tp", tp=2, sequence_parallel=args.sequence_parallel), states("tp", 2, 1, 2)),
        "tp_sequence_parallel": Strategy("train_tp.py", 2, ["--tp", "2", "--sequence_parallel"], ours_and_torch, 2,
                                         formula("tp", tp=2, sequence_parallel=True), states("tp", 2, 1, 2)),
        "tp_no_loss_parallel": Strategy("train_tp.py", 2, ["--tp", "2", "--no_loss_parallel"], ours_and_torch, 2,
                                        formula("tp", tp=2, loss_parallel=False), states("tp", 2, 1, 2)),
        "2d": Strategy("train_2d.py", 4, ["--tp", "2", "--dp", "2"] + sequence_parallel, ours_and_torch, 2,
                       formula("2d", tp=2, dp=2, sequence_parallel=args.sequence_parallel), states("2d", 4, 2, 2)),
        "cp": Strategy("train_cp.py", 2, ["--cp", "2"], cp_impls, 2, formula("cp", dp=1, cp=2), states("ddp", 2, 2)),
        "cp_ring": Strategy("train_cp.py", 2, ["--cp", "2", "--cp_impl", "ring"], cp_impls, 2,
                            formula("cp", dp=1, cp=2, cp_impl="ring"), states("ddp", 2, 2)),
        "cp4": Strategy("train_cp.py", 4, ["--cp", "4"], cp_impls, 4, formula("cp", dp=1, cp=4), states("ddp", 4, 4)),
        "cp4_ring": Strategy("train_cp.py", 4, ["--cp", "4", "--cp_impl", "ring"], cp_impls, 4,
                             formula("cp", dp=1, cp=4, cp_impl="ring"), states("ddp", 4, 4)),
        "4d": Strategy("train_4d.py", 8, ["--pp", "2", "--cp", "2", "--tp", "2"] + sequence_parallel, [None],
                       2, lambda: plan.four_d_terms(config, four_d, backend=backend, **stage_0),  # every group of 2
                       lambda: sum(size for _, size in plan.four_d_stage_plan(config, four_d, **stage_0)[:3])),
        "ep": Strategy("train_ep.py", 2, ["--ep", "2"] + moe_model, [None], 2,  # PyTorch core has no expert parallel
                       lambda: plan.comm_formula("ep", moe, args.global_batch, dtype=args.dtype, backend=backend, ep=2),
                       lambda: model_states(moe, plan.Layout("ep", 2, 1, 1, 1, ep=2))),
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


def launch(script, flags, out_dir, ranks=1, threads=1, env=None, timeout=None, cwd=HERE):
    """torchrun of one script: (its metrics.jsonl records, its output), or (None, its output) if it failed (an
    out-of-memory, say) or ran past `timeout` seconds."""
    shutil.rmtree(out_dir, ignore_errors=True)  # a previous round's: a fresh run refuses a used --out_dir
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
               script] + flags + ["--out_dir", out_dir]
    process = subprocess.Popen(command, env=dict(os.environ, OMP_NUM_THREADS=str(threads), **(env or {})), cwd=cwd,
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


def run_once(args, name, script, ranks, extra, impl, group_size, global_batch, tmp):
    """One run of `script` through the worker: its tokens/s, step time, peak memory and MFU, and the bytes one rank
    sent through collectives during the profiled step (the last but one)."""
    out_dir = os.path.join(tmp, f"{name}-{impl}-{ranks}-{global_batch}")
    comms_path = out_dir + ".comms.json"
    flags = our_flags(args, global_batch) + extra + (["--impl", impl] if impl in ("ours", "torch") else [])
    worker_flags = ["--worker", script, "--profile_step", str(args.steps - 1), "--comms_out", comms_path, "--"]
    print(f"{name} {impl or ''} on {ranks} rank(s), global batch {global_batch}", flush=True)
    folder = args.baseline if impl == "baseline" else HERE  # the baseline: the other checkout's script and worker
    records, output = launch(os.path.join(folder, "bench.py"), worker_flags + flags, out_dir, ranks, args.threads,
                             cwd=folder)
    if records is None:
        # torchrun's banners out
        print("\n".join(line for line in output.splitlines() if not re.match(r"[WI]\d{4} ", line))[-8000:])
        raise SystemExit(f"{name} ({impl}) failed: {script} {' '.join(flags)}")
    timed = [r for r in records if args.warmup <= r["step"] < args.steps - 2]
    step_ms = statistics.median(r["step_ms"] for r in timed)
    with open(comms_path) as f:
        recorded = json.load(f)
    collectives = recorded["collectives"]
    held = recorded["held"]
    return {"activation_bytes": held.get("activations"),
            "state_bytes": held["parameters"] + held["gradients"] + held["optimizer"],
            "tokens_per_s": global_batch * args.block_size / (step_ms / 1000),
            "step_ms": step_ms,
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
    dtype = prepare_data.token_dtype(vocab_size)  # uint32 for Llama 3's 128,256
    for split, count in (("train", num_tokens), ("val", num_tokens // 10)):
        rng.integers(0, vocab_size, size=count, dtype=dtype).tofile(os.path.join(folder, f"{split}.bin"))
    with open(os.path.join(folder, "meta.json"), "w") as f:
        json.dump({"tokenizer": "gpt2", "vocab_size": vocab_size, "dtype": dtype, "source": "synthetic"}, f)
    return folder


def compare(args, table, chosen, tmp):
    """The default mode: each chosen strategy, ours and torch's, interleaved by round, and train_single.py at DDP's
    per-rank batch (the scaling baseline); the best round of each, printed beside its formula. Returns the rows."""
    runs = {}
    for _ in range(args.rounds):
        for name in chosen:
            strategy = table[name]
            impls = [impl for impl in strategy.impls if impl in (None, *args.impls)] + ["baseline"] * bool(args.baseline)
            for impl in impls:
                row = run_once(args, name, strategy.script, strategy.ranks, strategy.flags, impl, strategy.group_size,
                               args.global_batch, tmp)
                runs.setdefault((name, impl, strategy.ranks), []).append(row)
            if name == "ddp":  # the scaling baseline: one rank at the same per-rank batch
                per_rank = args.global_batch // strategy.ranks
                row = run_once(args, "single", "train_single.py", 1, [], None, 1, per_rank, tmp)
                runs.setdefault(("single/rank", None, 1), []).append(row)
    best = {key: max(rows, key=lambda r: r["tokens_per_s"]) for key, rows in runs.items()}
    rows = []
    for (name, impl, ranks), row in best.items():
        formula = sum(term.bytes for term in table[name].formula()) if name in table else 0
        states = table[name if name in table else "single"].states()
        rows.append(dict(strategy=name, impl=impl, ranks=ranks, formula_bytes=formula, planned_state_bytes=states,
                         **row))

    vocabulary = f"synthetic vocabulary {args.vocab_size}" if args.vocab_size else args.data
    print(f"\n{args.model}, {vocabulary}, block {args.block_size}, global batch {args.global_batch}, "
          f"{args.device} {args.dtype}{', sequence parallel' * args.sequence_parallel}, "
          f"{args.threads} thread(s) a rank, best of {args.rounds} rounds, "
          f"median of steps {args.warmup}..{args.steps - 3}")
    header = (f"{'strategy':20} {'impl':8} {'ranks':>5} {'tok/s':>9} {'step ms':>8} {'peak MB':>8} {'mfu':>6} "
              f"{'comm MB/step':>12} {'formula MB':>10} {'colls':>6} {'states MB':>9} {'planned MB':>10}")
    print(header + "\n" + "-" * len(header))
    for row in rows:
        mfu = "n/a" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
        print(f"{row['strategy']:20} {row['impl'] or '-':8} {row['ranks']:5d} {row['tokens_per_s']:9,.0f} "
              f"{row['step_ms']:8.1f} {row['peak_mem_mb']:8,.0f} {mfu:>6} {row['comm_bytes'] / 2**20:12.2f} "
              f"{row['formula_bytes'] / 2**20:10.2f} {row['collectives']:6d} {row['state_bytes'] / 1e6:9.3f} "
              f"{row['planned_state_bytes'] / 1e6:10.3f}")
    print()
    for name in chosen:
        ours = best.get((name, "ours", table[name].ranks))
        for other in ("torch", "baseline"):
            theirs = best.get((name, other, table[name].ranks))
            if ours and theirs:
                print(f"{name}: ours/{other} tokens/s {ours['tokens_per_s'] / theirs['tokens_per_s']:.3f}, "
                      f"peak memory {ours['peak_mem_mb'] / theirs['peak_mem_mb']:.3f}")
    if ("single/rank", None, 1) in best and ("ddp", "ours", 2) in best:
        single = best[("single/rank", None, 1)]["tokens_per_s"]
        for impl in ("ours", "torch"):
            scaling = best[("ddp", impl, 2)]["tokens_per_s"] / (2 * single)
            print(f"ddp {impl}: scaling efficiency on 2 ranks vs 1 rank at the same per-rank batch {scaling:.3f}")
    backend = "nccl" if args.device == "cuda" else "gloo"
    print(f"\nthe formulas on {backend}, per rank per optimizer step (collectives, MB):")
    for name in chosen:
        for term in table[name].formula():
            print(f"{name:20} {term.kind:14} {term.group:5} {term.count:4d} {term.bytes / 2**20:9.3f}  {term.what}")
    if "ep" in chosen:
        print("note: ep's combine carries what its experts received, which the router decides: the formula assumes "
              "balance (plan.comm_formula's expert_load scales it; test_parallel.py's test gives the step's)")
    if backend == "gloo":
        print("note: gloo runs reduce_scatter_tensor as an all-reduce of the whole input (its profiler trace shows "
              "gloo:all_reduce), sending twice what NCCL's ring reduce-scatter sends; the formulas count it so.")
    return rows


def checkpointing_cost(args, table, chosen, tmp):
    """--checkpointing: each strategy (ours) without and with --activation_checkpointing, interleaved by round:
    tokens/s, the bytes the first micro-batch saved for backward (measured: memory_held), and peak memory."""
    runs = {}
    for _ in range(args.rounds):
        for name in chosen:
            strategy = table[name]
            for checkpointing in (False, True):
                flags = strategy.flags + ["--activation_checkpointing"] * checkpointing
                row = run_once(args, name + "-ac" * checkpointing, strategy.script, strategy.ranks, flags,
                               strategy.impls[0], strategy.group_size, args.global_batch, tmp)
                runs.setdefault((name, strategy.ranks, checkpointing), []).append(row)
    best = {key: max(rows, key=lambda r: r["tokens_per_s"]) for key, rows in runs.items()}
    print(f"\n{args.model}, block {args.block_size}, global batch {args.global_batch}, {args.device} {args.dtype}: "
          "ours without and with --activation_checkpointing, best of each")
    header = (f"{'strategy':10} {'ranks':>5} {'tok/s':>9} {'tok/s AC':>9} {'AC/not':>7} {'saved MB':>9} "
              f"{'saved MB AC':>11} {'AC/not':>7} {'peak MB':>8} {'peak MB AC':>10}")
    print(header + "\n" + "-" * len(header))
    rows = []
    for name in chosen:
        ranks = table[name].ranks
        plain, recomputed = best[(name, ranks, False)], best[(name, ranks, True)]
        print(f"{name:10} {ranks:5d} {plain['tokens_per_s']:9,.0f} {recomputed['tokens_per_s']:9,.0f} "
              f"{recomputed['tokens_per_s'] / plain['tokens_per_s']:7.2f} {plain['activation_bytes'] / 2**20:9.2f} "
              f"{recomputed['activation_bytes'] / 2**20:11.2f} "
              f"{recomputed['activation_bytes'] / plain['activation_bytes']:7.3f} {plain['peak_mem_mb']:8,.0f} "
              f"{recomputed['peak_mem_mb']:10,.0f}")
        rows.append(dict(strategy=name, ranks=ranks, without=plain, activation_checkpointing=recomputed))
    return rows


def attention_work(cp, block_size, head_tail):
    """Each rank's share of the query-key pairs the causal mask lets through, for one sequence: its tokens at
    position p each see p + 1 keys. Head-tail chunks (train_cp.py's) or contiguous slices of s / cp tokens."""
    if head_tail:
        positions = [train_cp.chunk_positions(rank, cp, block_size // (2 * cp)) for rank in range(cp)]
    else:
        positions = torch.arange(block_size).chunk(cp)
    return [((p + 1).sum() / (block_size * (block_size + 1) / 2)).item() for p in positions]


def context_parallel(args, table, chosen, tmp):
    """--context_parallel: train_cp.py's methods on 2 and 4 ranks against train_single.py: the activations the first
    micro-batch saves (measured, and the planner's), the bytes a step sends (measured, and the formula), and each
    rank's share of the attention work under head-tail chunks and under contiguous ones (--strategies aside)."""
    config = gpt.make_config(args.model, prepare_data.ensure_data(args.data, is_writer=True)["vocab_size"],
                             args.block_size)
    micro_batch = args.micro_batch or args.global_batch
    names = ["cp", "cp_ring", "cp4", "cp4_ring"]
    runs = {name: run_once(args, name, table[name].script, table[name].ranks, table[name].flags + [
        "--micro_batch", str(micro_batch)], None, table[name].group_size, args.global_batch, tmp) for name in names}
    single = run_once(args, "single", "train_single.py", 1, ["--micro_batch", str(micro_batch)], None, 1,
                      args.global_batch, tmp)
    print(f"\n{args.model}, block {args.block_size}, micro batch {micro_batch}, {args.device} {args.dtype}: "
          f"one device saves {single['activation_bytes'] / 2**20:.2f} MiB for backward")
    header = (f"{'run':9} {'cp':>3} {'saved MiB':>9} {'planned':>8} {'/single':>7} {'comm MiB/step':>13} "
              f"{'formula':>8}")
    print(header + "\n" + "-" * len(header))
    rows = []
    for name in names:
        cp, row = table[name].ranks, runs[name]
        layout = plan.Layout("cp", cp, 1, 1, micro_batch, args.dtype, device=args.device, cp=cp,
                             cp_impl="ring" if "ring" in name else "allgather")
        planned = sum(size for item, size in plan.plan_memory(config, layout)
                      if item.startswith(("activations", "embeddings", "loss", "bfloat16 copies")))
        formula = sum(term.bytes for term in table[name].formula())
        print(f"{name:9} {cp:3d} {row['activation_bytes'] / 2**20:9.2f} {planned / 2**20:8.2f} "
              f"{row['activation_bytes'] / single['activation_bytes']:7.3f} {row['comm_bytes'] / 2**20:13.2f} "
              f"{formula / 2**20:8.2f}")
        rows.append(dict(strategy=name, cp=cp, planned_activation_bytes=planned, formula_bytes=formula, **row))
    print("\nattention work, each rank's share of one device's (query, key) pairs under the causal mask:")
    for cp in (2, 4):
        for head_tail in (True, False):
            shares = attention_work(cp, args.block_size, head_tail)
            print(f"  cp {cp}, {'head-tail chunks' if head_tail else 'contiguous     '}: "
                  + " ".join(f"{share:.3f}" for share in shares) + f"  (slowest / mean {max(shares) * cp:.2f})")
    return rows


def arguments(description):
    """The flags of every benchmarked run, bench.py's and bench_pipeline.py's: a group after the file's own."""
    p = argparse.ArgumentParser(description=description, formatter_class=training.HelpFormatter)
    add = p.add_argument_group("every run").add_argument
    add("--model", default="tiny", choices=list(gpt.PRESETS), help="model size, from gpt.py's presets")
    add("--data", default=training.DEFAULT_DATA_DIR,
        help="prepared data folder (default: the embedded corpus, built on first use)")
    add("--vocab_size", type=int,
        help="train on synthetic tokens of this vocabulary (GPT-2's: 50257), made offline, not on --data")
    add("--block_size", type=int, default=128, help="context length, in tokens")
    add("--global_batch", type=int, default=16, help="sequences per optimizer step")
    add("--micro_batch", type=int, default=1, help="--pipeline, --what_fits: sequences per micro-step")
    add("--steps", type=int, default=30, help="optimizer steps of each run")
    add("--warmup", type=int, default=5, help="steps left out of the timing")
    add("--device", default="cpu", choices=["cpu", "cuda"], help="where the ranks compute")
    add("--dtype", default="float32", choices=["float32", "bfloat16"],
        help="bfloat16: autocast, float32 master weights")
    add("--compile", action="store_true", help="torch.compile the model")
    add("--threads", type=int, default=1, help="CPU threads per rank (and for the single baseline)")
    add("--json", help="also write the rows to this file")
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    # Modes in files of their own, run as their own processes: gpu_check.py and bench_pipeline.py import this one
    for flag, script in (("--gpu_check", "gpu_check.py"), ("--pipeline", "bench_pipeline.py"),
                         ("--startup", "bench_startup.py")):
        if flag in argv:
            command = [sys.executable, os.path.join(HERE, script)] + [a for a in argv if a != flag]
            raise SystemExit(subprocess.run(command).returncode)
    p = arguments(__doc__)
    p.add_argument("--strategies", default="single,ddp,zero1,zero2,fsdp,hsdp,tp,2d",
                   help="comma-separated strategies to run")
    p.add_argument("--sequence_parallel", action="store_true", help="tp, 2d and 4d with --sequence_parallel")
    p.add_argument("--rounds", type=int, default=2, help="runs of each strategy and implementation; the best counts")
    p.add_argument("--impls", type=lambda text: text.split(","), default=["ours", "torch"],
                   help="comma-separated: ours, torch (default: both)")
    p.add_argument("--baseline", type=os.path.abspath,
                   help="another checkout of this project (an earlier commit): its ours runs too, interleaved")
    p.add_argument("--bucket_mb", type=float, default=25, help="DDP's largest gradient bucket, in MiB")
    p.add_argument("--gpu_check", action="store_true",
                   help="python gpu_check.py with the other flags: a GPU machine's first check (gpu_check.py --help)")
    p.add_argument("--checkpointing", action="store_true",
                   help="what --activation_checkpointing costs and saves: each strategy (ours) without and with it")
    p.add_argument("--pipeline", action="store_true",
                   help="python bench_pipeline.py with the other flags: train_pp.py's bubble, activations and sends "
                   "against their formulas, its tokens/s against torch's (m = --global_batch / --micro_batch)")
    p.add_argument("--context_parallel", action="store_true",
                   help="train_cp.py on 2 and 4 ranks: activations, bytes and attention work per rank against one "
                   "device's and the formulas")
    p.add_argument("--what_fits", action="store_true",
                   help="print plan.what_fits's table: the smallest layout for each preset on 8 and 64 GPUs (no runs)")
    p.add_argument("--gpu_memory", type=float, default=80, help="--what_fits: one GPU's memory, in GB (10^9 bytes)")
    p.add_argument("--startup", action="store_true",
                   help="python bench_startup.py with the other flags: FSDP rank 0's start-up (init, resume) at 1, 2, "
                   "4, 8 ranks, numbers drawn, seconds, peak host memory")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--profile_step", type=int, help=argparse.SUPPRESS)
    p.add_argument("--comms_out", help=argparse.SUPPRESS)
    args, rest = p.parse_known_args(argv)
    if args.worker:
        return worker(args.worker, rest[1:] if rest[:1] == ["--"] else rest, args.profile_step, args.comms_out)

    if args.what_fits:
        return plan.what_fits(args.gpu_memory, args.micro_batch, **STRATEGY_CODE)
    with tempfile.TemporaryDirectory() as tmp:
        if args.vocab_size:
            args.data = synthetic_data(os.path.join(tmp, f"vocab-{args.vocab_size}"), args.vocab_size)
        table = strategies(args)
        chosen = [name for name in args.strategies.split(",") if os.path.exists(os.path.join(HERE, table[name].script))]
        mode = checkpointing_cost if args.checkpointing else context_parallel if args.context_parallel else compare
        rows = mode(args, table, chosen, tmp)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    training.run(main)  # its end too: a torchrun worker that exits otherwise can abort (see training.run)
