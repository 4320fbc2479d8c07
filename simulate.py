"""
One rank of a big run, checked on a CPU before a cluster sees it:

    python simulate.py 0/64 train_fsdp.py --model llama3.1-8b --data data/llama --block_size 64 --max_steps 2

runs the script as rank 0 of a world of 64 through torch's fake process group: every collective returns at once and
leaves its buffers as they were, so the numbers mean nothing while the shards, buffers and activations are the real
run's sizes. The divergence guard is off (a gathered unit holds whatever its buffer held), nothing is evaluated or
sampled, and the last step's checkpoint goes to a temporary folder. Then it prints what the rank measured beside what
--plan plans for it.
"""

import importlib
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import checkpoint
import training


def simulate(script, argv, rank, world_size, node=8):
    """script's main(argv) as rank `rank` of `world_size` (`node` ranks a node): {what: bytes} this rank measured."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank % node), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(min(node, world_size)))
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    measured, saved = {}, {}
    real = dist.new_group, checkpoint.check_finite, training.make_optimizer, torch.Tensor.backward

    def new_group(*args, backend=None, **kwargs):  # the saves' gloo group: the fake world has no gloo
        return real[0](*args, **kwargs)

    def make_optimizer(*args):  # the model states, measured as the first step begins (gradients) and ends (AdamW's)
        optimizer = real[2](*args)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        step = optimizer.step

        def measured_step(*step_args, **step_kwargs):
            measured.setdefault("parameters", sum(p.nbytes for p in params))
            measured.setdefault("gradients", sum(p.grad.nbytes for p in params if p.grad is not None))
            step(*step_args, **step_kwargs)
            measured.setdefault("AdamW state", sum(t.nbytes for state in optimizer.state.values()
                                                   for t in state.values()))

        optimizer.step = measured_step
        return optimizer

    def pack(tensor):  # what autograd saves for backward, each storage once, until the backward that frees it
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        measured["peak saved for backward"] = max(measured.get("peak saved for backward", 0), sum(saved.values()))
        return tensor

    def backward(*args, **kwargs):
        real[3](*args, **kwargs)
        saved.clear()

    module = importlib.import_module(os.path.basename(script).removesuffix(".py"))
    out_dir = tempfile.mkdtemp(prefix="simulate-")
    flags = ["--sample_tokens", "0", "--eval_interval", "0", "--ckpt_interval", "0", "--out_dir", out_dir]
    dist.new_group, training.make_optimizer, torch.Tensor.backward = new_group, make_optimizer, backward
    checkpoint.check_finite = lambda *args: None
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            module.main(argv + flags)
    finally:
        dist.new_group, checkpoint.check_finite, training.make_optimizer, torch.Tensor.backward = real
        dist.destroy_process_group()
    files = [os.path.join(folder, name) for folder, _, names in os.walk(out_dir) for name in names if "rank" in name]
    measured["checkpoint file"] = sum(os.path.getsize(path) for path in files)
    return measured


def main():
    if len(sys.argv) < 3 or "/" not in sys.argv[1]:
        raise SystemExit("usage: python simulate.py RANK/WORLD train_X.py [its flags]")
    rank, world_size = map(int, sys.argv[1].split("/"))
    script, argv = sys.argv[2], sys.argv[3:]
    measured = simulate(script, argv, rank, world_size)
    print(f"rank {rank} of {world_size}, measured:")
    for what, size in measured.items():
        print(f"  {what:<28} {size:>18,} bytes")
    print("--plan:")
    importlib.import_module(os.path.basename(script).removesuffix(".py")).main(
        argv + ["--plan", "--world_size", str(world_size)])


if __name__ == "__main__":
    main()
