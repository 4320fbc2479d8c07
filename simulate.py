"""
One rank of a big run, checked on a CPU before a cluster sees it:

    python simulate.py 63/64 train_2d.py --tp 8 --dp 8 --model llama3.1-8b --data data/llama --block_size 16 \
        --global_batch 8 --max_steps 1

runs the script as rank 63 of a world of 64 through torch's fake process group: every collective returns at once and
leaves its buffers as they were, so the numbers mean nothing while the shards, buffers and activations are the real
run's sizes. The divergence guard is off (a gathered unit holds whatever its buffer held), nothing is evaluated or
sampled, and the last step's checkpoint goes to a temporary folder, removed once measured. Then it prints what the
rank measured beside what --plan plans for it.
"""

import importlib
import os
import shutil
import sys
import tempfile

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import bench
import checkpoint


def simulate(script, argv, rank, world_size, node=8):
    """script's main(argv) as rank `rank` of `world_size` (`node` ranks a node): {what: bytes} this rank measured.
    bench.memory_held's measures (model states after the first step, the first micro-batch's activations and gathered
    weights); under --cpu_offload the host arenas FSDP pins (on CUDA) and the optimizer's pageable state; the
    checkpoint file."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank % node), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(min(node, world_size)))
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    measured, arenas = {}, []
    module = importlib.import_module(os.path.basename(script).removesuffix(".py"))
    fsdp = sys.modules.get("train_fsdp")  # imported by the scripts that shard with it
    real = dist.new_group, checkpoint.check_finite, fsdp and fsdp.host_memory

    def new_group(*args, backend=None, **kwargs):  # the saves' gloo group: the fake world has no gloo
        return real[0](*args, **kwargs)

    def host_memory(sizes):  # what CUDA would pin: each arena's whole storage
        pieces = real[2](sizes)
        arenas.extend(pieces[:1])
        return pieces

    def after_step(optimizer):  # the optimizer's state outside the arenas: pageable host memory under --cpu_offload
        pinned = {arena.untyped_storage().data_ptr() for arena in arenas}
        measured.setdefault("host, pageable (optimizer state)", sum(
            t.nbytes for state in optimizer.state.values() for t in state.values()
            if t.device.type == "cpu" and t.untyped_storage().data_ptr() not in pinned))

    out_dir = tempfile.mkdtemp(prefix="simulate-")
    flags = ["--sample_tokens", "0", "--eval_interval", "0", "--ckpt_interval", "0", "--out_dir", out_dir]
    dist.new_group, checkpoint.check_finite = new_group, lambda *args: None
    if fsdp:
        fsdp.host_memory = host_memory
    handles = bench.after_each_step(after_step) if "--cpu_offload" in argv else []
    try:
        with bench.memory_held(measured):
            module.main(argv + flags)
        files = [os.path.join(folder, name) for folder, _, names in os.walk(out_dir) for name in names
                 if "rank" in name]
        measured["checkpoint file"] = sum(os.path.getsize(path) for path in files)
    finally:
        dist.new_group, checkpoint.check_finite = real[:2]
        if fsdp:
            fsdp.host_memory = real[2]
        for handle in handles:
            handle.remove()
        dist.destroy_process_group()
        shutil.rmtree(out_dir, ignore_errors=True)
    if arenas:
        measured["host, pinned (arenas)"] = sum(arena.untyped_storage().nbytes() for arena in arenas)
    return measured


def main():
    if len(sys.argv) < 3 or "/" not in sys.argv[1]:
        raise SystemExit("usage: python simulate.py RANK/WORLD train_X.py [its flags]")
    rank, world_size = map(int, sys.argv[1].split("/"))
    script, argv = sys.argv[2], sys.argv[3:]
    measured = simulate(script, argv, rank, world_size)
    print(f"rank {rank} of {world_size}, measured:")
    for what, size in measured.items():
        print(f"  {what:<34} {size:>18,} bytes")
    print("--plan:")
    importlib.import_module(os.path.basename(script).removesuffix(".py")).main(
        argv + ["--plan", "--world_size", str(world_size)])


if __name__ == "__main__":
    main()
