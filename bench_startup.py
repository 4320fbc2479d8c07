"""
FSDP rank 0's start-up at 1, 2, 4 and 8 ranks, each measured in a fresh process of one thread: the random numbers it
draws to initialise its part (training.initial_values), then the elements it reads to resume it (checkpoint.load),
with the seconds and the peak host memory of each. Run as `python bench.py --startup` (or this file directly):

    python bench.py --startup --model gpt2-xl --rounds 1
"""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

import torch

import checkpoint
import gpt
import train_fsdp
import training


def fsdp_rank0_parts(config, ranks):
    """FSDP rank 0's part of every parameter at `ranks` ranks, laid out as train_fsdp.FlatParameter lays it out (the
    first 1/ranks of each unit's flat buffer), over fresh zero shards: Parts to initialise or resume."""
    with torch.device("meta"):
        model = gpt.GPT(config)
    parts = []
    for unit in train_fsdp.flat_parameter_groups(model):
        for entries in unit.values():
            sizes = [param.numel() for _, param, _ in entries]
            shard = torch.zeros(-(-sum(sizes) // ranks))
            offset = 0
            for (name, param, _), size in zip(entries, sizes):
                stop = min(offset + size, len(shard))
                if offset < stop:
                    box = tuple((0, n) for n in param.shape)
                    parts.append(checkpoint.Part(name, tuple(param.shape), box, (0, stop - offset), shard, offset))
                offset += size
    return parts


def status_kb(field):
    """A field of /proc/self/status, in kB (Linux)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def startup_worker(phase, config, ranks, path):
    """One measurement in a fresh process: FSDP rank 0 at `ranks` ranks initialises its part (training.initial_values)
    or resumes it from checkpoint `path` (checkpoint.load). Random numbers drawn are counted at torch.randn; the peak
    is the resident memory's high-water mark, reset first; read, the elements copied out of the checkpoint's files."""
    drawn = [0]
    randn = torch.randn

    def counted(*args, **kwargs):
        value = randn(*args, **kwargs)
        drawn[0] += value.numel()
        return value

    torch.randn = counted
    torch.set_num_threads(1)  # seconds of one core: CPU time, which other processes on the machine do not change
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the resident memory now
    resident, read = status_kb("VmRSS"), None
    t0, cpu0 = time.perf_counter(), time.process_time()
    parts = fsdp_rank0_parts(config, ranks)
    if phase == "init":
        value = training.initial_values(config, seed=0)
        for part in parts:
            part.local().copy_(value(part.name, part.shape, part.box, part.flat))
    else:
        saved = checkpoint.Checkpoint(path)
        checkpoint.load(saved, parts, None, config)
        read = getattr(saved, "elements_read", None)  # counted since start-up began to scale with a rank's part
    print(json.dumps(dict(phase=phase, ranks=ranks, part=sum(p.flat[1] - p.flat[0] for p in parts), drawn=drawn[0],
                          seconds=time.perf_counter() - t0, cpu_s=time.process_time() - cpu0,
                          peak_mb=(status_kb("VmHWM") - resident) / 2**10,
                          read=read)))


def startup(args):
    """--startup: FSDP rank 0's start-up at 1, 2, 4, 8 ranks, each a fresh process: initialise, then resume from a
    one-file checkpoint of the whole model (written first into --startup_checkpoint if it holds none)."""
    config = gpt.make_config(args.model, 50257, 1024)
    path = os.path.join(args.startup_checkpoint, "ckpt-0000000")
    if not os.path.exists(path):
        value = training.initial_values(config, seed=0)
        with torch.device("meta"):
            shapes = {name: param.shape for name, param in gpt.GPT(config).named_parameters()}
        tensors = {name: [checkpoint.piece(shape, value(name, shape))] for name, shape in shapes.items()}
        checkpoint.save_shard(args.startup_checkpoint, 0, 0, tensors, None)
        checkpoint.publish(args.startup_checkpoint, 0, 1, {"config": dataclasses.asdict(config), "args": {}})
        del tensors
    rows = []
    for phase in ("init", "resume"):
        for ranks in (1, 2, 4, 8):
            command = [sys.executable, os.path.abspath(__file__), "--startup_worker", phase, "--model", args.model, "--ranks",
                       str(ranks), "--startup_checkpoint", args.startup_checkpoint]
            runs = [json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
                    for _ in range(args.rounds)]
            rows.append(min(runs, key=lambda run: run["cpu_s"]))  # the best round: the machine's drift left out
            row = rows[-1]
            read = "   n/a " if row["read"] is None else f"{row['read'] / 1e6:7.1f}M"
            work = f"drawn {row['drawn'] / 1e6:7.1f}M" if phase == "init" else f"read  {read}"
            print(f"{phase:6s} | {ranks} rank{'s' * (ranks > 1):1s} | part {row['part'] / 1e6:7.1f}M | {work} | "
                  f"{row['cpu_s']:6.1f} s CPU ({row['seconds']:6.1f} s wall) | peak +{row['peak_mb']:6,.0f} MB",
                  flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=training.HelpFormatter)
    p.add_argument("--model", default="gpt2-xl", choices=list(gpt.PRESETS), help="model size, from gpt.py's presets")
    p.add_argument("--rounds", type=int, default=1, help="runs of each measurement; the least CPU time counts")
    p.add_argument("--startup_checkpoint", default="startup-checkpoint",
                   help="the folder of the checkpoint to resume (written there if absent)")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--startup_worker", choices=["init", "resume"], help=argparse.SUPPRESS)
    p.add_argument("--ranks", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.startup_worker:
        config = gpt.make_config(args.model, 50257, 1024)
        return startup_worker(args.startup_worker, config, args.ranks, checkpoint.latest(args.startup_checkpoint))
    rows = startup(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
