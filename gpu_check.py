"""
A GPU machine's first check, in one command that fits a 15-minute lease, the row that matters most first.

    python gpu_check.py --device cuda --json gpu.json          # or: python bench.py --gpu_check --device cuda ...
    python gpu_check.py --device cpu --steps 2 --block_size 32 --global_batch 4 --gpu_memory 0.3   # the dry run

1. headline: GPT-2 124M, block 1024, bf16 + --compile (+ --attn flash where flash-attn is installed), on synthetic
   tokens of GPT-2's vocabulary, at the micro-batch the planner fits in this GPU's memory: tokens/s, MFU, step time,
   peak memory.
2. equivalence: every script at world size 1 (NCCL) in that fast path against train_single.py in float32 without
   TF32, on --model and --data: the largest relative difference between their losses, step by step. train_cp.py
   runs ours (both attention methods) and torch's context_parallel, on CUDA alone, at --cp 1 (one GPU). Then the
   same for moe-tiny, a mixture of experts: train_single.py, train_ep.py --ep 1 and train_fsdp.py.
3. time permitting: the headline with --activation_checkpointing, then gpt2-medium.
4. summary: the processes started, how many compiled, the wall time, the rows not run.

Each row is printed and appended to --json (one JSON object a line) as soon as it is known, so a check stopped short
keeps what it measured. Once --budget_s has passed no run starts (the headline always does) and the rows left say so;
a run still going 120 s after the budget is stopped. Every run shares one inductor cache folder: what one compiled,
the next finds. On CPU (the test suite's dry run) the same rows run eager in float32, the headline and the larger
preset at --model and --block_size, planned for --gpu_memory.
"""

import argparse
import importlib.util
import json
import os
import re
import statistics
import tempfile
import time

import torch

import bench
import gpt
import plan
import prepare_data
import training

TOLERANCE = 1e-2  # bf16 autocast against float32 at STABLE_LR: 1e-4 relative on the tiny model's losses (CPU, 20 steps)
# The default peak (3e-3 after 5 warmup steps) spikes the tiny model's loss near step 11, where rounding alone moves a
# run by percents (one device in bf16 against float32, 20 steps: 3.7% on CPU, 1.3% on an H200, and 1.3% to 16.7% for
# the other scripts there): the equivalence rows train at a third of it, smoothly, so a difference is a fault.
STABLE_LR = ["--lr", "1e-3", "--min_lr", "1e-4"]
EQUIVALENCE = [["train_single.py"], ["train_ddp.py"], ["train_fsdp.py"], ["train_tp.py", "--tp", "1"],
               ["train_tp.py", "--tp", "1", "--sequence_parallel"], ["train_2d.py", "--tp", "1", "--dp", "1"],
               ["train_pp.py", "--pp", "1"], ["train_cp.py", "--cp", "1"],
               ["train_cp.py", "--cp", "1", "--cp_impl", "ring"], ["train_cp.py", "--cp", "1", "--impl", "torch"],
               ["train_4d.py"]]
# A mixture of experts (gpt.MoE: routing, the balancing agreement, its graph breaks under --compile) on the same path,
# and expert parallelism's all-to-alls through NCCL (at --ep 1, each rank's tokens to itself)
MOE_EQUIVALENCE = [["train_single.py"], ["train_ep.py", "--ep", "1"], ["train_fsdp.py"]]
CUDA_ONLY = {"train_cp.py --cp 1 --impl torch": "torch's context_parallel has no sharding rule for the CPU attention"}
GRACE_S = 120  # how long a run may go on past --budget_s before it is stopped
MAX_MICRO_BATCH = 64  # 65k tokens a step at block 1024
GPT2_VOCABULARY = 50257
INDUCTOR_CACHE = os.path.join(tempfile.gettempdir(), "gpu-check-inductor")  # kept: a rerun finds it warm


def planned_bytes(config, layout):
    return sum(size for _, size in plan.plan_memory(config, layout))


def planned_micro_batch(config, layout, memory):
    """The largest power of two up to MAX_MICRO_BATCH whose plan fits in 90% of `memory` bytes (the planner leaves
    out the CUDA context and the allocator's fragmentation): one run, not a search by running out of memory."""
    micro_batch = MAX_MICRO_BATCH
    while micro_batch > 1 and planned_bytes(config, layout._replace(micro_batch=micro_batch)) > 0.9 * memory:
        micro_batch //= 2
    return micro_batch


def error_of(output):
    """The line of a failed run's output that says what went wrong: its last exception (Python's, or the message of
    a C++ one that aborted the process), or its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"(^|\s)([\w.]*(Error|Exception)|error|what\(\)):", line)
              and "ChildFailed" not in line]
    return (errors or lines or ["no output"])[-1]


class Check:
    """The rows of one check, each printed and appended to --json the moment it is known, and the runs it started."""

    def __init__(self, args, tmp, started):
        self.args = args
        self.tmp = tmp
        self.started = started  # when main() began: the budget counts the data preparation too
        self.rows = []
        self.runs = []  # each run's command line: how many processes started, how many compiled

    def report(self, row):
        self.rows.append(row)
        measured = [f"{key} {value:,.4g}" if isinstance(value, float) else f"{key} {value}"
                    for key, value in row.items() if key not in ("row", "status")]
        print(f"{row['row']:42} {row['status']:8} " + " | ".join(measured), flush=True)
        if self.args.json:
            with open(self.args.json, "a") as f:  # closed at once, so on disk before the next run starts
                f.write(json.dumps(row) + "\n")
        return row

    def run(self, row, command, always=False):
        """One torchrun of command (a script and its flags) for `row`: its metrics records, or None with
        row["status"] saying why. A run starts only within the budget, unless `always`, and a CUDA_ONLY row on CUDA."""
        elapsed = time.perf_counter() - self.started
        if elapsed > self.args.budget_s and not always:
            row["status"] = f"not run: the {self.args.budget_s:g} s budget was spent"
            return None
        if row["row"] in CUDA_ONLY and self.args.device != "cuda":
            row["status"] = f"not run: {CUDA_ONLY[row['row']]}"
            return None
        self.runs.append(command)
        out_dir = os.path.join(self.tmp, f"run-{len(self.runs)}")
        records, output = bench.launch(command[0], command[1:], out_dir, threads=self.args.threads,
                                       env={"TORCHINDUCTOR_CACHE_DIR": INDUCTOR_CACHE},
                                       timeout=max(GRACE_S, self.args.budget_s + GRACE_S - elapsed))
        row["wall_s"] = row.get("wall_s", 0) + round(time.perf_counter() - self.started - elapsed, 1)
        row["status"] = "ok" if records else "FAILED"
        if records is None:
            row["error"] = error_of(output)
        return records

    def throughput(self, name, model, data, layout, flags, micro_batch=None, always=False):
        """train_single.py on `data` at `micro_batch` sequences (by default the planner's), halved once if it runs
        out of memory anyway: the median tokens/s, MFU and step time of the second half of the steps (after the
        compile), the peak memory and the planned one."""
        config = gpt.make_config(model, GPT2_VOCABULARY, self.args.headline_block_size)
        micro_batch = micro_batch or planned_micro_batch(config, layout, self.args.memory)
        row = {"row": name, "status": "", "model": model, "block_size": config.block_size, "micro_batch": micro_batch}

        def command():
            shared = bench.run_flags(model, data, config.block_size, row["micro_batch"], self.args.steps,
                                     self.args.device)
            return ["train_single.py"] + shared + flags

        records = self.run(row, command(), always)
        if records is None and "out of memory" in row.get("error", "") and row["micro_batch"] > 1:
            row["out_of_memory_at_micro_batch"] = row["micro_batch"]  # the plan erred low: once more, at half
            row["micro_batch"] //= 2
            del row["error"]
            records = self.run(row, command(), always)
        if records:
            timed = records[len(records) // 2:]
            row["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in timed)
            row["mfu"] = statistics.median(r["mfu"] for r in timed) if timed[0]["mfu"] is not None else None
            row["step_ms"] = statistics.median(r["step_ms"] for r in timed)
            row["peak_mem_mb"] = max(r["peak_mem_mb"] for r in records)
            row["planned_mb"] = planned_bytes(config, layout._replace(micro_batch=row["micro_batch"])) / 2**20
        return self.report(row)

    def equivalence(self, flags, scripts=EQUIVALENCE, model=None):
        """Every script of `scripts` in `flags` (the fast path) against train_single.py in float32 on --data and
        `model` (default: --model; another names its rows)."""
        args = self.args
        common = bench.run_flags(model or args.model, args.data, args.block_size, args.global_batch, args.steps,
                                 args.device) + STABLE_LR
        named = f"{model}: " if model else ""
        first = {"row": f"{named}reference: train_single.py float32", "status": ""}
        reference = self.run(first, ["train_single.py"] + common + ["--dtype", "float32"])
        self.report(dict(first, loss=reference[-1]["loss"]) if reference else first)
        for script in scripts:
            row = {"row": named + " ".join(script), "status": "not run: the reference failed"}
            records = self.run(row, script + common + flags) if first["status"] != "FAILED" else None
            if records:
                differences = [abs(r["loss"] - e["loss"]) / e["loss"] for r, e in zip(records, reference)]
                row["max_relative_loss_difference"] = max(differences)
                row["at_step"] = differences.index(max(differences))
                row["status"] = "ok" if row["max_relative_loss_difference"] < TOLERANCE else "FAILED"
            self.report(row)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=training.HelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"], help="where the runs compute")
    p.add_argument("--model", default="tiny", choices=list(gpt.PRESETS), help="the equivalence rows' model")
    p.add_argument("--data", default=training.DEFAULT_DATA_DIR,
                   help="the equivalence rows' prepared data folder (default: the embedded corpus, built on first use)")
    p.add_argument("--block_size", type=int, default=128, help="the equivalence rows' context length (CPU: all rows')")
    p.add_argument("--global_batch", type=int, default=16, help="the equivalence rows' sequences per optimizer step")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps of each run")
    p.add_argument("--threads", type=int, default=1, help="CPU threads of each run")
    p.add_argument("--budget_s", type=float, default=420, help="seconds after which no new run starts")
    p.add_argument("--gpu_memory", type=float, default=80,
                   help="on CPU, the memory the planner fits the micro-batch in, in GB (on CUDA: the GPU's own)")
    p.add_argument("--json", help="append each row to this file as it is known, one JSON object a line")
    args = p.parse_args(argv)
    started = time.perf_counter()
    cuda = args.device == "cuda"
    # The parent's CUDA context is a few hundred MB: inside the 10% that planned_micro_batch leaves free
    args.memory = torch.cuda.get_device_properties(0).total_memory if cuda else args.gpu_memory * 1e9
    args.headline_block_size = 1024 if cuda else args.block_size
    flash = cuda and importlib.util.find_spec("flash_attn") is not None  # looked up, not imported
    dtype = "bfloat16" if cuda else "float32"  # bf16 matmuls are 50-140x slower than float32 on CPU
    fast = ["--dtype", dtype] + ["--compile"] * cuda + ["--attn", "flash"] * flash
    headline, larger = ("gpt2", "gpt2-medium") if cuda else (args.model, args.model)
    layout = plan.Layout("single", 1, 1, 1, 0, dtype, device=args.device)
    prepare_data.ensure_data(args.data, is_writer=True)
    with tempfile.TemporaryDirectory() as tmp:
        check = Check(args, tmp, started)
        check.report({"row": "machine", "status": "ok", "device": torch.cuda.get_device_name() if cuda else "cpu",
                      "torch": torch.__version__, "cuda": torch.version.cuda, "memory_gb": args.memory / 1e9,
                      "flash_attn": flash})
        tokens = bench.synthetic_data(os.path.join(tmp, "gpt2-vocabulary"), GPT2_VOCABULARY)
        first = check.throughput("headline", headline, tokens, layout, fast, always=True)
        check.equivalence(fast)
        check.equivalence(fast, MOE_EQUIVALENCE, "moe-tiny")
        check.throughput("activation checkpointing", headline, tokens, layout._replace(activation_checkpointing=True),
                         fast + ["--activation_checkpointing"], micro_batch=first["micro_batch"])
        check.throughput(f"larger: {larger}", larger, tokens, layout, fast)
    failed = [row["row"] for row in check.rows if row["status"] == "FAILED"]
    check.report({"row": "summary", "status": "FAILED" if failed else "ok", "processes": len(check.runs),
                  "compiled": sum("--compile" in command for command in check.runs),
                  "wall_s": round(time.perf_counter() - check.started, 1),
                  "not_run": [row["row"] for row in check.rows if row["status"].startswith("not run")]})
    if failed:
        raise SystemExit(f"gpu check failed: {', '.join(failed)} (see above)")


if __name__ == "__main__":
    training.run(main)  # its end too: a process that exits otherwise can abort (see training.run)
