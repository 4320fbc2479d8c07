"""
The README's figures, drawn from real runs. Needs matplotlib, an optional extra (pip install matplotlib).

    python figures.py                                    # every figure into figures/ (tiny model, CPU)
    python figures.py --steps 20 --block_size 32 --out_dir /tmp/figures          # a quick, small version
    python figures.py --model llama-tiny --out_dir /tmp/figures-llama     # the runs' figures on Llama 3's shape

losses.png      the training loss of single, DDP, FSDP, TP with sequence parallelism, 2-D, PP, ZeRO-2, HSDP and CP
                over the same run (300 steps at --lr 1e-3), overlaid, and each layout's |difference| from single in
                float32 spacings
drift.png       the same for the Quick start's six 1000-step runs at its --lr 3e-3, read from their metrics.jsonl
                in --quick_start (where the README's commands write them): how far the layouts drift apart
comm_bytes.png  the bytes one rank sends per step through collectives: measured by bench.py (ours and PyTorch's),
                against plan.comm_formula, stacked by the formula's collectives
memory.png      memory per rank of GPT-2 124M on 8 GPUs by strategy, stacked by kind (plan.plan_memory, the
                planner that --plan prints and the tests hold to real runs); with --model llama-tiny, Llama 3.1 8B's
                (block 8192, micro-batch 1) on 8 GPUs, whose 8 key/value heads allow t = 8
layout_*.png    who holds what: every rank's part of each tensor of a 1-layer model, as the scripts build it,
                with the collectives of one step
figures.json    the numbers behind them

A file of its own rather than a mode of bench.py: bench.py times and measures, with no dependency beyond torch;
these figures add matplotlib and the training runs' loss curves, and reuse bench.py's measurement and formulas.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import torch

import bench
import bench_pipeline
import checkpoint
import gpt
import plan
import prepare_data
import train_ddp
import train_pp
import training

HERE = os.path.dirname(os.path.abspath(__file__))
LOSS_RUNS = [("single", "train_single.py", 1, []), ("DDP", "train_ddp.py", 2, []), ("FSDP", "train_fsdp.py", 2, []),
             ("TP + sequence parallel", "train_tp.py", 2, ["--sequence_parallel"]),
             ("2-D (tp 2 x dp 2)", "train_2d.py", 4, ["--tp", "2", "--dp", "2"]),
             ("PP (2 stages, 1F1B)", "train_pp.py", 2, []), ("ZeRO-2", "train_zero.py", 2, ["--stage", "2"]),
             ("HSDP (2 x 2)", "train_fsdp.py", 4, ["--replicate", "2"]),
             ("CP (ring, 2 ranks)", "train_cp.py", 2, ["--cp_impl", "ring"])]
QUICK_START = [("single", "single"), ("DDP", "ddp"), ("FSDP", "fsdp"),  # layout, its default --out_dir in out/
               ("TP + sequence parallel", "tp-sequence_parallel"), ("2-D (tp 2 x dp 2)", "2d"),
               ("PP (2 stages, 1F1B)", "pp")]
COMM_STRATEGIES = ["ddp", "fsdp", "tp", "tp_sequence_parallel", "tp_no_loss_parallel", "2d"]
COMM_IMPLS = ["ours", "torch"]
# GPT-2 124M on 8 GPUs: its 12 heads do not divide by 8, so tensor parallelism runs 2 or 4 wide, times data parallel.
MEMORY_LAYOUTS = [("DDP\n8", dict(strategy="ddp", dp=8, tp=1)), ("FSDP\n8", dict(strategy="fsdp", dp=8, tp=1)),
                  ("2-D + SP\ntp 2 x dp 4", dict(strategy="2d", dp=4, tp=2, sequence_parallel=True)),
                  ("2-D + SP\ntp 4 x dp 2", dict(strategy="2d", dp=2, tp=4, sequence_parallel=True))]
# The memory figure of each family: (model, vocabulary, block, micro-batch, title, layouts). Llama 3.1 8B's 8 key/value
# heads allow tensor parallelism 8 wide.
MEMORY_FIGURES = {
    "gpt2": ("gpt2", 50257, 1024, 8, "GPT-2 124M on 8 GPUs, block 1024, micro-batch 8", MEMORY_LAYOUTS),
    "llama": ("llama3.1-8b", 128256, 8192, 1, "Llama 3.1 8B on 8 GPUs, block 8192, micro-batch 1",
              MEMORY_LAYOUTS[:2] + [("2-D + SP\ntp 8 x dp 1", dict(strategy="2d", dp=1, tp=8,
                                                                       sequence_parallel=True))]),
}
COLORS = ["#4477aa", "#ee6677", "#228833", "#ccbb44", "#66ccee", "#aa3377", "#bbbbbb", "#000000", "#ee7733"]


def loss_curves(args, tmp):
    """{layout: [(step, loss)]} of the same run under every layout."""
    flags = ["--model", args.model, "--data", args.data, "--block_size", str(args.block_size), "--max_steps",
             str(args.steps), "--log_interval", "1", "--sample_tokens", "0", "--ckpt_interval", "0", "--device", "cpu"]
    flags += ["--warmup_steps", str(min(30, args.steps)), "--lr", "1e-3", "--min_lr", "1e-4"]  # the figure's schedule
    curves = {}
    for name, script, ranks, extra in LOSS_RUNS:
        print(f"training: {name} on {ranks} rank(s), {args.steps} steps", flush=True)
        records, _ = bench.launch(script, flags + extra, os.path.join(tmp, script + "".join(extra)), ranks)
        if records is None:
            raise SystemExit(f"{script} {' '.join(extra)} failed: see above")
        curves[name] = [(r["step"], r["loss"]) for r in records]
    return curves


def comm_bytes(args, tmp):
    """{strategy: {"ours", "torch": measured bytes, "terms": [[kind, what, bytes]]}} for one step of each."""
    bench_args = argparse.Namespace(model=args.model, data=args.data, block_size=args.block_size, global_batch=16,
                                    steps=args.comm_steps, warmup=0, device="cpu", dtype="float32", compile=False,
                                    threads=1, bucket_mb=25, sequence_parallel=False)
    table, result = bench.strategies(bench_args), {}
    for name in COMM_STRATEGIES:
        strategy = table[name]
        row = {"terms": [[t.kind, t.what, t.bytes] for t in strategy.formula()]}
        for impl in [impl for impl in strategy.impls if impl in COMM_IMPLS]:
            row[impl] = bench.run_once(bench_args, name, strategy.script, strategy.ranks, strategy.flags, impl,
                                       strategy.group_size, 16, tmp)["comm_bytes"]
        result[name] = row
    return result


def pipeline_timeline(args, tmp):
    """{schedule: [per stage: {"waits": [(start, end)], "step_s"}]}: one step of train_pp.py on 2 stages, 4
    micro-batches, from bench_pipeline.py's measurement (bench.py --pipeline)."""
    bench_args = argparse.Namespace(model=args.model, data=args.data, block_size=args.block_size, global_batch=8,
                                    micro_batch=2, steps=8, warmup=3, device="cpu", dtype="float32", compile=False,
                                    threads=1)
    rows = [row for row in bench_pipeline.measure(bench_args, tmp) if row["impl"] == "ours"]
    return {row["schedule"]: [dict(waits=s["waits"], step_s=s["step_s"]) for s in row["stages"]] for row in rows}


def draw_pipeline(plt, timeline, path):
    """Each stage's step as it ran: a box for each forward (F) and backward (B), in the schedule's order between its
    waits on sends and receives; the white between the boxes is the bubble."""
    figure, axes = plt.subplots(len(timeline), 1, figsize=(10, 1.3 + 1.1 * len(timeline)), sharex=True)
    for axis, (name, stages) in zip(axes, timeline.items()):
        micro_batches = (len(stages[0]["waits"]) - 1) // 2  # a wait before each action, and the last sends
        for stage, measured in enumerate(stages):
            actions = train_pp.schedule(name, stage, len(stages), micro_batches)
            ends = [end for _, end in measured["waits"]]  # an action runs from one wait's end to the next's start
            starts = [start for start, _ in measured["waits"]][1:]
            for (kind, i), begin, finish in zip(actions, ends, starts):
                color = "#4477aa" if kind == "forward" else "#ee6677"
                axis.barh(stage, 1000 * (finish - begin), left=1000 * begin, color=color, edgecolor="white")
                axis.text(1000 * (begin + finish) / 2, stage, f"{kind[0].upper()}{i}", ha="center", va="center",
                          color="white", fontsize=7)
        axis.set_yticks(range(len(stages)), [f"stage {s}" for s in range(len(stages))])
        axis.invert_yaxis()
        p, m = len(stages), micro_batches
        axis.set_title(f"{name}: one step, {p} stages, {m} micro-batches (bubble formula (p-1)/(m+p-1) = "
                       f"{(p - 1) / (m + p - 1):.2f})", fontsize=9)
    axes[-1].set_xlabel("ms from the start of the step (each stage's own clock; CPU, gloo, tiny model)")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def spacings(loss, reference):
    """|loss - reference| in float32's spacings at the reference: both are float32 values, so a whole number."""
    return abs(loss - reference) / float(np.spacing(np.float32(reference)))


def draw_losses(plt, curves, path):
    """The curves overlaid on top, each drawn narrower than the one before so that every one shows; below, a strip a
    layout with its |difference| from single's loss at each step in float32 spacings, bit-equal steps at 0."""
    reference, others = dict(curves["single"]), [name for name in curves if name != "single"]
    figure, axes = plt.subplots(1 + len(others), 1, figsize=(8, 4 + 0.9 * len(others)), sharex=True,
                                gridspec_kw=dict(height_ratios=[4] + [1] * len(others)))
    for index, ((name, curve), color) in enumerate(zip(curves.items(), COLORS)):
        steps, losses = zip(*curve)
        axes[0].plot(steps, losses, label=name, color=color, linewidth=len(curves) - index)
    axes[0].set_ylabel("training loss")
    axes[0].set_title("The same run under every layout (tiny model, float32, CPU)")
    axes[0].legend(title="the curves coincide: each is drawn\nnarrower on top of the one before", fontsize=8,
                   title_fontsize=8)
    for axis, name, color in zip(axes[1:], others, COLORS[1:]):
        steps, differences = zip(*[(step, spacings(loss, reference[step])) for step, loss in curves[name]])
        axis.scatter(steps, differences, color=color, s=5)
        axis.set_ylim(-0.7, max(4, max(differences)) + 0.7)
        axis.set_yticks(range(0, int(max(4, max(differences))) + 1, 2))
        axis.set_ylabel("spacings", fontsize=7)
        equal = sum(difference == 0 for difference in differences)
        axis.set_title(f"{name}: bit-equal to single's loss at {equal} of {len(steps)} steps", loc="left", fontsize=8)
    axes[1].set_title("|loss - single's loss| in float32 spacings (2.4e-7 between 2 and 4)", loc="right", fontsize=8)
    axes[-1].set_xlabel("step")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def quick_start_curves(folder):
    """{layout: [(step, loss, val loss or None)]} of the Quick start's runs in `folder` (out/ by default, where its
    commands write them), or None if a run is missing."""
    curves = {}
    for name, out_dir in QUICK_START:
        path = os.path.join(folder, out_dir, "metrics.jsonl")
        if not os.path.exists(path):
            return None
        with open(path) as f:
            records = {record["step"]: record for record in map(json.loads, f)}  # a resumed run: the last word
        curves[name] = [(step, r["loss"], r.get("val_loss")) for step, r in sorted(records.items())]
    return curves


def draw_drift(plt, curves, path):
    """The Quick start's runs: their losses, then each layout's |loss - single's| at every logged step, on an axis
    logarithmic above float32's spacing and linear below it (a bit-equal step sits at 0)."""
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    reference = {step: loss for step, loss, _ in curves["single"]}
    for index, ((name, curve), color) in enumerate(zip(curves.items(), COLORS)):
        steps, losses, _ = zip(*curve)
        top.plot(steps, losses, label=name, color=color, linewidth=len(curves) - index)
        if name != "single":
            differences = [abs(loss - reference[step]) for step, loss, _ in curve]
            bottom.plot(steps, differences, color=color, label=name, linewidth=0.6, marker=".", markersize=3)
    top.set_ylabel("training loss")
    top.set_title("The Quick start's runs: the same run under every layout, 1000 steps at --lr 3e-3", fontsize=10)
    top.legend(title="each drawn narrower on top of the one before", fontsize=8, title_fontsize=8)
    bottom.set_yscale("symlog", linthresh=2**-22)
    bottom.set_ylim(0, None)
    bottom.set_ylabel("|loss - single's loss|")
    bottom.set_xlabel("step")
    bottom.set_title("float32 rounding, amplified by training: log scale beyond float32's spacing (2.4e-7), linear "
                     "within it", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def drift_summary(curves):
    """The numbers the README quotes: each layout's final train and validation loss, and the largest |difference|
    from single's train loss at a few steps and over the whole run."""
    reference = {step: loss for step, loss, _ in curves["single"]}
    rows = {}
    for name, curve in curves.items():
        differences = {step: abs(loss - reference[step]) for step, loss, _ in curve}
        largest = max(differences, key=differences.get)
        rows[name] = dict(final_step=curve[-1][0], loss=curve[-1][1], val_loss=curve[-1][2],
                          difference_at={step: differences[step] for step in (0, 100, 500) if step in differences},
                          largest_difference=differences[largest], at_step=largest)
    return rows


def draw_comm(plt, comm, block_size, path):
    figure, axis = plt.subplots(figsize=(10, 5))
    kinds = ["all_reduce", "all_gather", "reduce_scatter"]
    for index, (name, row) in enumerate(comm.items()):
        axis.bar(index - 0.27, row["ours"] / 2**20, 0.25, color="#4477aa", label="ours, measured" * (index == 0))
        axis.bar(index, row.get("torch", 0) / 2**20, 0.25, color="#bbbbbb", label="PyTorch's, measured" * (index == 0))
        bottom = 0
        for kind, color in zip(kinds, ["#ee6677", "#228833", "#ccbb44"]):
            height = sum(b for k, _, b in row["terms"] if k == kind) / 2**20
            axis.bar(index + 0.27, height, 0.25, bottom=bottom, color=color,
                     label=f"formula: {kind.replace('_', '-')}" * (index == 0))
            bottom += height
    axis.set_xticks(range(len(comm)), [name.replace("_", "\n") for name in comm], fontsize=8)
    axis.set_ylabel("MiB sent per rank per step")
    axis.set_title("Bytes through collectives: measured (profiler) against the formula (tiny, block "
                   f"{block_size}, batch 16, float32, gloo)", fontsize=10)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def memory_rows(family="gpt2"):
    """{label: [(item, bytes)]}: plan.plan_memory of one rank of MEMORY_FIGURES[family] on 8 GPUs, bf16, each layout
    without and with activation checkpointing (AC)."""
    preset, vocab_size, block_size, micro_batch, _, layouts = MEMORY_FIGURES[family]
    config = gpt.make_config(preset, vocab_size, block_size)
    rows = {}
    for label, strategy in layouts:
        for checkpointing in (False, True):
            layout = plan.Layout(world_size=8, micro_batch=micro_batch, dtype="bfloat16",
                                 activation_checkpointing=checkpointing, **strategy)
            planned = plan.plan_memory(config, layout, **bench.STRATEGY_CODE)
            rows[label + "\n+ AC" * checkpointing] = [(item, int(size)) for item, size in planned]
    return rows


def draw_memory(plt, rows, path, title=MEMORY_FIGURES["gpt2"][4]):
    figure, axis = plt.subplots(figsize=(13, 5))
    items = list(dict.fromkeys(item for layout in rows.values() for item, _ in layout))
    bottoms = [0.0] * len(rows)
    for item, color in zip(items, plt.get_cmap("tab20").colors):
        heights = [dict(layout).get(item, 0) / 1e9 for layout in rows.values()]
        axis.bar(range(len(rows)), heights, 0.6, bottom=bottoms, color=color, label=item)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    axis.set_xticks(range(len(rows)), list(rows))
    axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    axis.set_ylabel("GB per rank (10^9 bytes)")
    axis.set_ylim(0, 1.08 * max(bottoms))
    axis.set_title(f"One rank's plan: {title}, bf16 (plan.plan_memory)", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


# ------------------------------------------------------------------------------------------------------------
# Who holds what: the parts every rank builds, read from the strategies' own code on a 4-rank gloo world


LAYOUT_CONFIG = gpt.GPTConfig(vocab_size=256, block_size=64, n_layer=1, n_head=4, n_embd=64)
LAYOUTS = {"ddp": 2, "fsdp": 2, "tp": 2, "2d": 4}  # strategy -> ranks drawn


def layout_worker(out_path):
    """Under torchrun with 4 ranks: each strategy's Parts (name, full shape, box, flat range) on each rank that
    runs it, built on meta exactly as the scripts build them (ranks 0 and 1 for the 2-rank strategies)."""
    import torch.distributed as dist

    import train_2d
    import train_fsdp
    import train_tp

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pair = dist.new_group([0, 1])
    tp_group, dp_group = train_2d.new_groups(2, 2)
    zeros = lambda name, shape, box, flat: torch.zeros(flat[1] - flat[0])  # noqa: E731  (values do not matter here)
    parts = {}
    for strategy in LAYOUTS:
        if LAYOUTS[strategy] <= rank:
            continue
        with torch.device("meta"):
            model = gpt.GPT(LAYOUT_CONFIG)
        if strategy == "ddp":
            found = checkpoint.parameter_parts(model)
        elif strategy == "fsdp":
            wrapped = train_fsdp.FullyShardedDataParallel(model, process_group=pair, initial_value=zeros)
            found = [checkpoint.Part(*where) for where in wrapped.parts()]
        elif strategy == "tp":
            train_tp.parallelize(model, pair, sequence_parallel=True)
            found = checkpoint.parameter_parts(model)
        else:
            train_tp.parallelize(model, tp_group, sequence_parallel=True)
            tp_parts = {part.name: part for part in checkpoint.parameter_parts(model)}
            boxes = {name: (part.shape, part.box) for name, part in tp_parts.items()}
            wrapped = train_fsdp.FullyShardedDataParallel(model, process_group=dp_group, tp_boxes=boxes,
                                                          initial_value=zeros)
            found = [checkpoint.Part(*where) for where in wrapped.parts()]
        parts[strategy] = [(p.name, p.shape, p.box, p.flat) for p in found]
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(parts, f)
    dist.destroy_process_group()


def layout_parts(tmp):
    """{strategy: [parts of rank 0, of rank 1, ...]} from one torchrun of layout_worker."""
    out = os.path.join(tmp, "layout.json")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
               os.path.abspath(__file__), "--layout_worker", out]
    subprocess.run(command, cwd=HERE, check=True, capture_output=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    ranks = []
    for rank in range(4):
        with open(f"{out}.{rank}") as f:
            ranks.append(json.load(f))
    return {strategy: [r[strategy] for r in ranks if strategy in r] for strategy in LAYOUTS}


# Where each tensor sits in a rank's column, in units of 64 elements: (x, y) of its top left corner. Matrices are
# drawn [out, in] as nn.Linear stores them; a vector as a thin column beside what it belongs to.
TENSOR_PLACES = {"wte.weight": (0, 0), "wpe.weight": (1.5, 0), "ln_f.weight": (3, 0), "ln_f.bias": (3.25, 0),
                 "blocks.0.ln_1.weight": (0, 5), "blocks.0.ln_1.bias": (0.25, 5),
                 "blocks.0.attn.query.weight": (0.7, 5), "blocks.0.attn.query.bias": (1.75, 5),
                 "blocks.0.attn.key.weight": (2.2, 5), "blocks.0.attn.key.bias": (3.25, 5),
                 "blocks.0.attn.value.weight": (3.7, 5), "blocks.0.attn.value.bias": (4.75, 5),
                 "blocks.0.attn.proj.weight": (5.2, 5), "blocks.0.attn.proj.bias": (6.25, 5),
                 "blocks.0.ln_2.weight": (0, 6.6), "blocks.0.ln_2.bias": (0.25, 6.6),
                 "blocks.0.mlp.fc.weight": (0.7, 6.6), "blocks.0.mlp.fc.bias": (1.75, 6.6),
                 "blocks.0.mlp.proj.weight": (2.2, 6.6), "blocks.0.mlp.proj.bias": (6.25, 6.6)}
LABELS = {"wte.weight": "wte", "wpe.weight": "wpe", "ln_f.weight": "ln_f", "blocks.0.ln_1.weight": "ln_1",
          "blocks.0.attn.query.weight": "q", "blocks.0.attn.key.weight": "k", "blocks.0.attn.value.weight": "v",
          "blocks.0.attn.proj.weight": "attn.proj", "blocks.0.ln_2.weight": "ln_2", "blocks.0.mlp.fc.weight": "fc",
          "blocks.0.mlp.proj.weight": "mlp.proj"}
COLUMN_WIDTH, UNIT = 7.3, 1 / 64


def held_rectangles(shape, box, flat):
    """(row, col, rows, cols) rectangles of the full 2-D tensor covered by elements [flat) of full[box], row-major."""
    (r0, r1), (c0, c1) = box if len(box) == 2 else (box[0], (0, 1))
    width, (a, b), rects = c1 - c0, flat, []
    first_full, last_full = -(-a // width), b // width
    if first_full > last_full:  # inside one row
        return [(r0 + a // width, c0 + a % width, 1, b - a)]
    if a % width:
        rects.append((r0 + a // width, c0 + a % width, 1, width - a % width))
    if last_full > first_full:
        rects.append((r0 + first_full, c0, last_full - first_full, width))
    if b % width:
        rects.append((r0 + last_full, c0, 1, b % width))
    return rects


def draw_layout(plt, strategy, ranks, terms, path):
    from matplotlib.patches import Rectangle

    columns = len(ranks)
    with torch.device("meta"):
        shapes = {name: tuple(p.shape) for name, p in gpt.GPT(LAYOUT_CONFIG).named_parameters()}
    figure, axis = plt.subplots(figsize=(max(9.0, 2.3 * columns + 0.6), 6.4))
    for rank, parts in enumerate(ranks):
        x0 = rank * COLUMN_WIDTH
        for name, (x, y) in TENSOR_PLACES.items():
            shape = shapes[name]
            rows, cols = shape if len(shape) == 2 else (shape[0], 16)  # a vector: a thin column
            axis.add_patch(Rectangle((x0 + x, -y), cols * UNIT, -rows * UNIT, fill=False, edgecolor="#999999",
                                     linewidth=0.6))
            if name in LABELS:
                axis.text(x0 + x, -y + 0.08, LABELS[name], fontsize=6, va="bottom")
        for name, shape, box, flat in parts:
            if name not in TENSOR_PLACES:
                continue
            x, y = TENSOR_PLACES[name]
            scale_x = UNIT if len(shape) == 2 else 16 * UNIT
            for row, col, rows, cols in held_rectangles(shape, box, flat):
                axis.add_patch(Rectangle((x0 + x + col * scale_x, -y - row * UNIT), cols * scale_x, -rows * UNIT,
                                         color=COLORS[rank], alpha=0.8, linewidth=0))
        title = f"rank {rank}" + (f"\ntp {rank % 2}, dp {rank // 2}" if strategy == "2d" else "")
        axis.text(x0 + 3.3, 1.0, title, ha="center", fontsize=9, weight="bold")
    # Collectives as arrows between the ranks of each group: tensor-parallel pairs below, data-parallel above.
    groups = {"ddp": {"dp": [[0, 1]]}, "fsdp": {"dp": [[0, 1]]}, "tp": {"tp": [[0, 1]]},
              "2d": {"tp": [[0, 1], [2, 3]], "dp": [[0, 2], [1, 3]]}}[strategy]
    for kind, pairs in groups.items():
        for index, (a, b) in enumerate(pairs):
            y = -11.0 - 0.35 * index if kind == "tp" else 1.9 + 0.45 * index
            axis.annotate("", (b * COLUMN_WIDTH + 3.3, y), (a * COLUMN_WIDTH + 3.3, y),
                          arrowprops=dict(arrowstyle="<->", color="#444444" if kind == "tp" else "#aa3377"))
            axis.text((a + b) / 2 * COLUMN_WIDTH + 3.3, y + 0.08, f"{kind} group", ha="center", fontsize=7,
                      color="#444444" if kind == "tp" else "#aa3377")
    lines = [f"{t.count:3d} x {t.kind.replace('_', '-'):14} ({t.group}) {t.what}" for t in terms]
    axis.text(0, -11.9, "one step, per rank:\n" + "\n".join(lines), fontsize=6.5, va="top", family="monospace")
    axis.set_title(textwrap.fill(LAYOUT_TITLES[strategy][0], 110), fontsize=9)
    axis.set_xlim(-0.3, max(columns * COLUMN_WIDTH, 17))
    axis.set_ylim(-12.4 - 0.3 * len(lines), 3.0)
    axis.set_aspect("equal")
    axis.axis("off")
    figure.tight_layout()
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)


LAYOUT_TITLES = {  # strategy -> (title, comm_formula's layout)
    "ddp": ("DDP: every rank holds every tensor whole", dict(dp=2)),
    "fsdp": ("FSDP: each unit's flat buffer (root; block 0: matrices | vectors) cut in 2 contiguous shards",
             dict(dp=2)),
    "tp": ("TP: q, k, v, fc by output rows, the projections by input columns, wte by vocabulary rows; norms, wpe and "
           "the projections' biases whole", dict(tp=2, sequence_parallel=True)),
    "2d": ("2-D: TP over ranks (0, 1) and (2, 3), then FSDP of each slice over ranks (0, 2) and (1, 3)",
           dict(tp=2, dp=2, sequence_parallel=True))}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=training.HelpFormatter)
    p.add_argument("--out_dir", default=os.path.join(HERE, "figures"), help="where the PNGs and figures.json go")
    p.add_argument("--data", default=training.DEFAULT_DATA_DIR, help="prepared data folder (default: the embedded "
                   "corpus, built on first use)")
    p.add_argument("--model", default="tiny", choices=["tiny", "llama-tiny"],
                   help="the runs' model; llama-tiny: Llama 3's shape, and Llama 3.1 8B's memory figure")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps of the loss curves' runs")
    p.add_argument("--block_size", type=int, default=128, help="context length of every run")
    p.add_argument("--comm_steps", type=int, default=3, help="steps of each run whose last step's bytes are read")
    p.add_argument("--quick_start", default="out", help="where the Quick start's six commands wrote their runs (each "
                   "default --out_dir, out/<strategy>[-variant]): drift.png draws them; without them, figures.json's")
    p.add_argument("--replot", action="store_true", help="redraw from --out_dir's figures.json, running nothing")
    p.add_argument("--layout_worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.layout_worker:
        return layout_worker(args.layout_worker)
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("figures.py needs matplotlib: pip install matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prepare_data.ensure_data(args.data, is_writer=True)
    os.makedirs(args.out_dir, exist_ok=True)
    numbers, previous, saved = {}, {}, os.path.join(args.out_dir, "figures.json")
    if os.path.exists(saved):
        with open(saved) as f:
            previous = json.load(f)
    with tempfile.TemporaryDirectory() as tmp:
        parts = layout_parts(tmp)
        for strategy, ranks in parts.items():
            terms = plan.comm_formula(strategy, LAYOUT_CONFIG, 8, buckets=train_ddp.assign_buckets,
                                      **bench.STRATEGY_CODE, **LAYOUT_TITLES[strategy][1])
            draw_layout(plt, strategy, ranks, terms, os.path.join(args.out_dir, f"layout_{strategy}.png"))
        if args.replot:  # the numbers of the last full run: only the drawing changes
            numbers = previous
        else:
            numbers["comm_bytes"], numbers["losses"] = comm_bytes(args, tmp), loss_curves(args, tmp)
        draw_comm(plt, numbers["comm_bytes"], args.block_size, os.path.join(args.out_dir, "comm_bytes.png"))
        draw_losses(plt, numbers["losses"], os.path.join(args.out_dir, "losses.png"))
        if "pipeline" not in numbers:  # a figures.json from before the pipeline's figure: run it
            numbers["pipeline"] = pipeline_timeline(args, tmp)
        draw_pipeline(plt, numbers["pipeline"], os.path.join(args.out_dir, "pipeline.png"))
    family = "llama" if args.model.startswith("llama") else "gpt2"
    numbers["memory"] = memory_rows(family)
    draw_memory(plt, numbers["memory"], os.path.join(args.out_dir, "memory.png"), MEMORY_FIGURES[family][4])
    numbers["quick_start"] = quick_start_curves(args.quick_start) or previous.get("quick_start")
    if numbers["quick_start"]:
        draw_drift(plt, numbers["quick_start"], os.path.join(args.out_dir, "drift.png"))
        numbers["quick_start_summary"] = drift_summary(numbers["quick_start"])
    else:
        print(f"drift.png not drawn: no Quick start runs in {args.quick_start!r} (run its six commands first)")
    reference = dict(numbers["losses"]["single"])
    numbers["max_loss_difference"] = {name: max(abs(loss - reference[step]) for step, loss in curve)
                                      for name, curve in numbers["losses"].items() if name != "single"}
    with open(saved, "w") as f:
        json.dump(numbers, f, indent=1)
    for name, row in numbers["comm_bytes"].items():
        formula = sum(b for _, _, b in row["terms"])
        print(f"{name:22} ours {row['ours'] / 2**20:7.3f} MiB, torch {row.get('torch', 0) / 2**20:7.3f} MiB, "
              f"formula {formula / 2**20:7.3f} MiB")
    for name, difference in numbers["max_loss_difference"].items():
        print(f"{name:22} largest |loss - single's| over {len(reference)} steps: {difference:.2e}")
    for name, row in (numbers.get("quick_start_summary") or {}).items():
        at = ", ".join(f"{difference:.1e} at step {step}" for step, difference in row["difference_at"].items())
        val_loss = "none" if row["val_loss"] is None else f"{row['val_loss']:.4f}"
        print(f"Quick start, {name:22} step {row['final_step']}: loss {row['loss']:.4f}, val loss {val_loss} | "
              f"|loss - single's| {at}, the largest {row['largest_difference']:.1e} at step {row['at_step']}")
    print(f"wrote {', '.join(sorted(os.listdir(args.out_dir)))} into {args.out_dir}")


if __name__ == "__main__":
    training.run(main)  # its end too: a torchrun worker that exits otherwise can abort (see training.run)
