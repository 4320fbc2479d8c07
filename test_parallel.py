"""
Every test, one file. Run either way:

    pytest test_parallel.py                                   # tests start their own gloo workers
    torchrun --nproc_per_node=4 -m pytest test_parallel.py    # tests of 4 ranks use the launched world

Every strategy is held to train_single.py: same data, same initial weights, same losses and weights after
several optimizer steps, in float32 on CPU, within reduction-order noise (TOLERANCE below).
"""

import argparse
import ast
import collections
import contextlib
import copy
import dataclasses
import errno
import functools
import gzip
import hashlib
import importlib.util
import io
import itertools
import json
import math
import multiprocessing
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import tokenize
import traceback
import weakref
from datetime import timedelta
from functools import partial
from typing import NamedTuple

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.utils._python_dispatch import TorchDispatchMode

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench  # noqa: E402
import bench_pipeline  # noqa: E402
import checkpoint  # noqa: E402
import export  # noqa: E402
import gpt  # noqa: E402
import gpu_check  # noqa: E402
import hugging_face  # noqa: E402
import plan  # noqa: E402
import train_2d  # noqa: E402
import train_4d  # noqa: E402
import prepare_data  # noqa: E402
import sample  # noqa: E402
import train_cp  # noqa: E402
import train_ddp  # noqa: E402
import train_ep  # noqa: E402
import train_fsdp  # noqa: E402
import train_pp  # noqa: E402
import train_single  # noqa: E402
import train_tp  # noqa: E402
import train_zero  # noqa: E402
import training  # noqa: E402

# @record (torch.distributed.elastic) wants a real stderr for its fault handler; pytest's capture has none.
pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")

# ------------------------------------------------------------------------------------------------------------
# Harness: run a function on N gloo ranks, as forked workers or on the world torchrun launched

LAUNCHED_WORLD = int(os.environ.get("WORLD_SIZE", "1"))  # > 1: under torchrun with several ranks
WORKER_TIMEOUT_S = 300  # a whole multi-rank test; a hang fails the test instead of the suite
COLLECTIVE_TIMEOUT_S = 60  # a rank stuck in a collective raises after this
COMPILE_TIMEOUT_S = 600  # a run that compiles: a rank's first torch.compile (~45 s on an idle 2-core machine, minutes
# on a loaded one: over 60 s at a load average of 10) keeps its peers waiting in a collective, as a pipeline's next
# stage waits for its first activation


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue, timeout_s):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)  # two cores: one thread a rank, or every rank slows ~2.5x
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
        result = fn(*args)
        dist.barrier()  # rank 0 hosts the group's store: nobody leaves while another rank may still need it
        queue.put((rank, True, result))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        queue.close()
        queue.join_thread()  # flush the result before the hard exit below
        os._exit(0)  # skip pytest's atexit machinery inherited through fork


def _ensure_launched_group():
    if not dist.is_initialized():  # one group for every test, a test that compiles among them
        dist.init_process_group("gloo", timeout=timedelta(seconds=COMPILE_TIMEOUT_S))


def run_distributed(world_size, fn, *args, timeout_s=COLLECTIVE_TIMEOUT_S):
    """fn(*args) on `world_size` ranks of a gloo group whose collectives wait at most timeout_s (COMPILE_TIMEOUT_S
    for a run that compiles); returns the list of the ranks' results (plain values or numpy arrays: tensors do not
    survive the trip from a worker that exits). Under plain pytest or a one-process torchrun, forks the workers;
    under torchrun with N > 1 ranks, runs on the launched world and skips a test that needs another size."""
    if LAUNCHED_WORLD > 1:
        if world_size != LAUNCHED_WORLD:
            pytest.skip(f"needs {world_size} ranks; launched with {LAUNCHED_WORLD}")
        _ensure_launched_group()
        try:
            outcome = (True, fn(*args))
        except Exception:
            outcome = (False, traceback.format_exc())
        outcomes = [None] * world_size
        dist.all_gather_object(outcomes, outcome)  # every rank fails if any rank failed
        errors = [f"rank {r}:\n{text}" for r, (ok, text) in enumerate(outcomes) if not ok]
        if errors:
            pytest.fail("\n".join(errors))
        return [result for _, result in outcomes]

    context = multiprocessing.get_context("fork")  # 0.1 s a worker; spawn and forkserver take seconds
    queue = context.Queue()
    port = _free_port()
    workers = [context.Process(target=_worker, args=(r, world_size, port, fn, args, queue, timeout_s), daemon=True)
               for r in range(world_size)]
    for w in workers:
        w.start()
    results, errors = {}, []
    worker_timeout_s = max(WORKER_TIMEOUT_S, 2 * timeout_s)
    deadline = time.time() + worker_timeout_s
    try:
        while len(results) + len(errors) < world_size:
            try:
                rank, ok, value = queue.get(timeout=max(0.1, deadline - time.time()))
            except Exception:
                missing = sorted(set(range(world_size)) - set(results))
                pytest.fail(f"ranks {missing} gave no result within {worker_timeout_s}s")
            if ok:
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
                break  # the first error is the cause; the other ranks may be stuck waiting for it
    finally:
        for w in workers:
            w.join(timeout=5 if not errors else 0.5)
            if w.is_alive():
                w.kill()
                w.join()
    if errors:
        pytest.fail("\n".join(errors))
    return [results[r] for r in range(world_size)]


launches_its_own_ranks = pytest.mark.skipif(LAUNCHED_WORLD > 1, reason="launches torchrun or forks ranks itself")


def pytest_generate_tests(metafunc):
    """Under torchrun, rank 0 alone reports: every rank runs the same tests, and a test of several ranks fails on
    all of them (run_distributed gathers their outcomes), so the other ranks would repeat the report, interleaved;
    their exit codes still fail the launch. pytest calls this hook of a test module while collecting it: the
    earliest moment this file can reach the terminal (each rank has printed the session's header by then)."""
    plugins = metafunc.config.pluginmanager
    if LAUNCHED_WORLD > 1 and int(os.environ["RANK"]) != 0 and plugins.has_plugin("terminalreporter"):
        plugins.unregister(name="terminalreporter")


def _same_on_every_rank(path):
    """Rank 0's path on every rank when torchrun launched the ranks: each process has its own pytest tmp folders,
    and the ranks of one run must write into one folder."""
    if LAUNCHED_WORLD == 1:
        return path
    _ensure_launched_group()
    path = [str(path)]
    dist.broadcast_object_list(path, src=0)
    return path[0]


@pytest.fixture
def shared_tmp(tmp_path):
    return _same_on_every_rank(tmp_path)


def shared_folder(tmp_path_factory, name):
    return _same_on_every_rank(tmp_path_factory.mktemp(name))


# ------------------------------------------------------------------------------------------------------------
# Runs of the training scripts and their comparison

TOLERANCE = 5e-6
"""Largest relative difference allowed between two layouts' losses and gradient norms at every step. Summing over
2, 4 or 8 ranks instead of one process, or splitting a matmul's inner dimension over tensor-parallel ranks,
reorders float32 additions: measured up to 8e-7 (2-D, grad norm). A dropped all-reduce, a skipped shard or a
gradient summed instead of averaged moves them by 1e-3 or more."""

WEIGHT_TOLERANCE = 5e-5
"""Largest absolute difference allowed between two layouts' final weights, element by element. AdamW divides
each gradient by its own running magnitude, so an element whose gradient is near zero turns reduction-order
noise into a visible step: after 6 steps a handful of elements out of 65536 differ by up to 3.3e-5 (tensor
parallel, resumed from single; ~1e-6 for data parallel), 1% of one update at lr 3e-3, while everything else agrees
to ~1e-7. The
attention key bias is such a parameter throughout: softmax ignores the q.b_k it adds to a whole row, so its
gradient is zero in exact arithmetic and it holds only rounding noise (~1e-6). A real bug moves thousands of
elements by ~1e-3."""


DROPOUT = 0.1
"""Dropout of the runs that resume: a generator a checkpoint does not restore draws other masks after the resume,
and the resumed run no longer equals the uninterrupted one (measured: up to 6e-3 in the weights). Layouts draw
other masks than train_single, so a run with dropout is compared with its own layout only."""


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """The embedded default corpus, prepared once per session (~1 s); under torchrun by rank 0, for every rank."""
    folder = _same_on_every_rank(tmp_path_factory.mktemp("corpus"))
    if LAUNCHED_WORLD == 1 or dist.get_rank() == 0:
        prepare_data.prepare_default(str(folder))
    if LAUNCHED_WORLD > 1:
        dist.barrier()
    return str(folder)


def flags(corpus, out_dir, **overrides):
    """Command-line flags of a short float32 run: tiny model, 16 sequences of 32 tokens, accumulation
    16 / (micro batch 2 x data-parallel size), clipping active (the first steps' grad norm is ~10), 6 steps.
    Validation on one global batch at the first and the last step: every layout's validation all-reduce runs."""
    settings = dict(model="tiny", data=corpus, out_dir=str(out_dir), block_size=32, global_batch=16, micro_batch=2,
                    max_steps=6, warmup_steps=2, lr=3e-3, min_lr=3e-4, grad_clip=1.0, eval_interval=100,
                    eval_iters=1, log_interval=1, ckpt_interval=0, sample_tokens=0, seed=1234)
    settings.update(overrides)
    argv = []
    for key, value in settings.items():
        if value is True:
            argv.append(f"--{key}")
        elif value is not False and value is not None:
            argv += [f"--{key}", str(value)]
    return argv


class Run(NamedTuple):
    losses: list  # by step
    weights: dict  # name -> final full tensor (numpy)
    grad_norms: list  # by step: the one figure where a gradient summed instead of averaged shows, since
    #                   clipping and AdamW's m / sqrt(v) hide a constant factor from losses and weights
    lrs: list  # by step
    val_losses: dict  # step -> validation loss, at the steps that evaluated


def read_run(out_dir):
    """A finished run's metrics and final weights, read through the shared checkpoint format."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        records = {r["step"]: r for r in map(json.loads, f) if "loss" in r}  # a resumed step overwrites its first try
    found = checkpoint.Checkpoint(checkpoint.latest(out_dir))
    weights = {name: full_tensor(found, name).numpy() for name in found.pieces if "/" not in name}
    steps = sorted(records)
    val_losses = {s: records[s]["val_loss"] for s in steps if "val_loss" in records[s]}
    return Run([records[s]["loss"] for s in steps], weights, [records[s]["grad_norm"] for s in steps],
               [records[s]["lr"] for s in steps], val_losses)


_single_runs = {}


@contextlib.contextmanager
def one_thread():
    """Training in this process on one thread, like every worker: a loaded machine slows a two-thread run several
    times."""
    threads, variable = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # training.get_device then leaves the thread count alone
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        os.environ.pop("OMP_NUM_THREADS") if variable is None else os.environ.update(OMP_NUM_THREADS=variable)


def single_run(corpus, tmp_path_factory, **overrides):
    """train_single.py in this process, once per distinct set of flags per session: the reference."""
    key = tuple(sorted(overrides.items()))
    if key not in _single_runs:
        out_dir = tmp_path_factory.mktemp("single")
        with one_thread():
            train_single.main(flags(corpus, out_dir, **overrides))
        _single_runs[key] = read_run(out_dir)
    return _single_runs[key]


def assert_runs_match(run, reference, tolerance=TOLERANCE, weight_tolerance=WEIGHT_TOLERANCE, grad_norm_tolerance=None):
    assert len(run.losses) == len(reference.losses)
    np.testing.assert_allclose(run.losses, reference.losses, rtol=tolerance, atol=0, err_msg="losses")
    np.testing.assert_allclose(run.grad_norms, reference.grad_norms, rtol=grad_norm_tolerance or tolerance, atol=0,
                               err_msg="grad norms")
    np.testing.assert_allclose(run.lrs, reference.lrs, rtol=1e-12, atol=0, err_msg="learning rates")  # one formula
    assert run.val_losses.keys() == reference.val_losses.keys()
    np.testing.assert_allclose(list(run.val_losses.values()), list(reference.val_losses.values()), rtol=tolerance,
                               atol=0, err_msg="validation losses")
    assert run.weights.keys() == reference.weights.keys()
    differences = {name: np.abs(run.weights[name] - expected).max() for name, expected in reference.weights.items()}
    worst = sorted(differences, key=differences.get, reverse=True)[:3]
    assert differences[worst[0]] <= weight_tolerance, \
        "weights differ: " + ", ".join(f"{name} by {differences[name]:.1e}" for name in worst)


class Crash(Exception):
    pass


def _train_until(main, crash_step, argv):
    """main(argv), crashing at crash_step as a killed rank would (after its last checkpoint, before the next)."""
    real_get_lr = training.get_lr

    def get_lr(step, args):
        if step == crash_step:
            raise Crash
        return real_get_lr(step, args)

    training.get_lr = get_lr
    try:
        main(argv)
    except Crash:
        return "crashed"
    finally:
        training.get_lr = real_get_lr


class RecordOutputs(TorchDispatchMode):
    """Every tensor an aten operation returns while active, forward and backward, as (operation, tensor)."""

    def __init__(self):
        super().__init__()
        self.outputs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.outputs += [(func, t.detach()) for t in (out if isinstance(out, (tuple, list)) else [out])
                         if isinstance(t, torch.Tensor)]
        return out


# ------------------------------------------------------------------------------------------------------------
# The harness itself


def _sum_of_ranks():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def test_harness_runs_ranks():
    assert run_distributed(2, _sum_of_ranks) == [1.0, 1.0]


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("deliberate failure on rank 1")
    dist.barrier()  # rank 0 waits here for a rank that will never come


@pytest.mark.skipif(LAUNCHED_WORLD > 1, reason="forks its own workers")
def test_harness_reports_failure_and_leaves_no_worker():
    start = time.time()
    with pytest.raises(pytest.fail.Exception, match="deliberate failure on rank 1"):
        run_distributed(2, _fail_on_rank_one)
    assert time.time() - start < 30
    assert not multiprocessing.active_children()


# ------------------------------------------------------------------------------------------------------------
# gpt.py


def test_model_shapes_and_tied_weights():
    config = gpt.make_config("tiny", vocab_size=256, block_size=32)
    model = gpt.GPT(config)
    model.init_weights(seed=0)
    idx, targets = torch.randint(0, 256, (2, 2, 32), generator=torch.Generator().manual_seed(0))
    assert model(idx).shape == (2, 32, 256)
    loss = model(idx, targets)  # targets drawn apart: with targets = idx the tied wte favours them (4.49 seen)
    assert loss.shape == () and 5.0 < loss.item() < 6.0  # ~ln(256) = 5.55 at init
    assert model.lm_head.weight is model.wte.weight
    names = [name for name, _ in model.named_parameters()]
    assert "wte.weight" in names and not any(name.startswith("lm_head") for name in names)
    assert gpt.GPTConfig(vocab_size=50257).padded_vocab_size == 50304
    with torch.device("meta"):
        gpt2 = gpt.GPT(gpt.make_config("gpt2", vocab_size=50257, block_size=1024))
    assert 124e6 < gpt2.num_params() < 125e6  # GPT-2 small: 124M (with the vocabulary padded to 50304)
    with pytest.raises(ValueError, match="unknown --model 'gpt5'"):
        gpt.make_config("gpt5", 256, 32)


def test_meta_init_equals_direct_init():
    config = gpt.make_config("tiny", vocab_size=256, block_size=32)
    direct = gpt.GPT(config)
    direct.init_weights(seed=7)
    with torch.device("meta"):
        deferred = gpt.GPT(config)
    deferred.to_empty(device="cpu")
    deferred.init_weights(seed=7)
    assert deferred.lm_head.weight is deferred.wte.weight  # the tie survives materialisation
    for (name, a), (_, b) in zip(direct.named_parameters(), deferred.named_parameters()):
        assert torch.equal(a, b), name
    # A slice is the slice of the whole: what a tensor-parallel rank or an FSDP shard initialises by itself.
    full = gpt.initial_value("blocks.1.mlp.fc.weight", (512, 128), config, seed=7)
    assert torch.equal(full, direct.blocks[1].mlp.fc.weight.detach())
    assert direct.blocks[0].mlp.proj.weight.std() < 0.6 * direct.blocks[0].mlp.fc.weight.std()  # 1/sqrt(2 n_layer)
    other_seed = gpt.GPT(config)
    other_seed.init_weights(seed=8)
    assert not torch.equal(other_seed.wte.weight, direct.wte.weight)


def test_tf32_only_when_asked():
    """TF32 changes float32 matmuls by ~1e-3: get_device leaves it off unless --tf32, whatever was set before."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        training.get_device(training.get_parser("").parse_args(["--device", "cpu"]))
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        training.get_device(training.get_parser("").parse_args(["--device", "cpu", "--tf32"]))
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False


@pytest.mark.skipif(dist.is_initialized() or LAUNCHED_WORLD > 1, reason="joins a process group of its own")
def test_cuda_rank_takes_its_gpu_and_binds_the_process_group_to_it(monkeypatch):
    """On CUDA (mocked here: no GPU), LOCAL_RANK picks the GPU only where the rank sees several (a launcher that shows
    each process its own GPU leaves index 0), and init_process_group is given that device, so NCCL makes its
    communicators at once and new_group can split them."""
    chosen, joined = [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    args = training.get_parser("").parse_args(["--device", "cuda", "--out_dir", "unused"])
    for visible, index in [(8, 3), (1, 0)]:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
        assert training.get_device(args, local_rank=3) == torch.device("cuda", index) == chosen[-1]
    real_init = dist.init_process_group

    def init_process_group(backend, **options):  # records the call, then joins a gloo group of one instead
        joined.append((backend, options.pop("device_id")))
        real_init("gloo", **options)

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.delenv("RANK", raising=False)
    try:
        assert training.init_distributed(args, torch.device("cuda", 0))[2]
    finally:
        dist.destroy_process_group()
    assert joined == [("nccl", torch.device("cuda", 0))]



@pytest.mark.skipif(dist.is_initialized() or LAUNCHED_WORLD > 1, reason="sets this process's thread count")
def test_a_rank_takes_its_share_of_the_cores_for_host_work(monkeypatch):
    """The rule itself (CUDA mocked: no GPU here): a rank's threads are the cores it may run on over the node's ranks
    (64 cores, 8 ranks: 8; never 0), or HOST_THREADS. On CUDA under --cpu_offload, where torchrun's OMP_NUM_THREADS=1
    would leave AdamW one core, and not without it; on CPU unless OMP_NUM_THREADS is set."""
    threads = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.delenv("HOST_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # torchrun's, for several ranks
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    args = training.get_parser("").parse_args(["--device", "cuda"])
    training.get_device(args, local_rank=3)
    assert threads == []  # the host computes nothing worth threads: torchrun's setting stands
    args.cpu_offload = True
    for local_ranks, expected in [("8", 8), ("1", 64), ("128", 1)]:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_ranks)
        training.get_device(args, local_rank=3)
        assert threads[-1] == expected
    monkeypatch.setenv("HOST_THREADS", "3")
    training.get_device(args, local_rank=3)
    assert threads[-1] == 3
    monkeypatch.delenv("HOST_THREADS")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    cpu = training.get_parser("").parse_args(["--device", "cpu"])
    training.get_device(cpu)
    assert len(threads) == 4  # OMP_NUM_THREADS set: it stands on CPU
    monkeypatch.delenv("OMP_NUM_THREADS")
    training.get_device(cpu)
    assert threads[-1] == 8

def _advertised_commands():
    """Every command line of the README, of docs/*.md and of the scripts' docstrings that launches a training
    script."""
    texts = [*documentation().values(), *(open(os.path.join(HERE, name)).read() for name in
                                          ("train_single.py", "train_ddp.py", "train_zero.py", "train_fsdp.py",
                                           "train_tp.py", "train_2d.py", "train_cp.py", "train_4d.py",
                                           "train_ep.py"))]
    lines = "\n".join(texts).replace("\\\n", " ").splitlines()
    return [line.split("#")[0] for line in lines if re.search(r"(torchrun|python) .*train_\w+\.py", line)]


def test_every_advertised_configuration_passes_the_layout_checks():
    """A README, docs/ or --help example that names a preset and a layout must pass the checks it would meet at launch
    (heads and padded vocabulary divisible by --tp, --tp x --dp = ranks)."""
    commands = _advertised_commands()
    assert len(commands) >= 10
    for command in commands:
        option = lambda flag, default: (re.findall(rf"{flag}[= ]([^\s`]+)", command) or [default])[-1]  # noqa: E731
        script = re.search(r"train_(\w+)\.py", command).group(1)
        nodes = option("--nnodes", "1")  # a number, or a scheduler's variable ($SLURM_JOB_NUM_NODES)
        ranks = int(option("--nproc_per_node", 1)) * (int(nodes) if nodes.isdigit() else 1)
        ranks = int(option("--world_size", ranks)) if "--plan" in command else ranks  # planned, not launched
        ranks = int((re.findall(r"simulate\.py \d+/(\d+)", command) or [ranks])[0])  # one rank of a simulated world
        pretrained = os.path.basename(option("--init_from", "tiny")).replace("llama-3", "llama3")  # the hub's
        # Llama-3.1-8B, or a local copy of it in /local/llama-3.1-8b: llama3.1-8b
        model = option("--model", pretrained if pretrained in gpt.PRESETS else "tiny")
        vocab_size = 256 if model in ("tiny", "llama-tiny") else 128256 if model.startswith("llama") else 50257
        config = gpt.make_config(model, vocab_size, int(option("--block_size", 128)))
        tp = {"tp": int(option("--tp", ranks)), "2d": int(option("--tp", 2)), "4d": int(option("--tp", 1))}
        tp = tp.get(script, 1)
        training.check_tensor_parallel(config, tp, "--sequence_parallel" in command)
        if script == "2d" and (nodes.isdigit() or "--plan" in command):  # a scheduler's node count: ranks unknown
            assert tp * int(option("--dp", ranks // tp)) == ranks, command
        if script == "4d":  # --dp defaults to the ranks the other axes leave
            assert ranks % math.prod(int(option(f"--{axis}", 1)) for axis in ("pp", "cp", "tp")) == 0, command
    readme = "\n".join(documentation().values()).replace("\n", " ")
    for preset, script, options in re.findall(r"`(tiny|gpt[23][\w.-]*|llama[\w.-]*)`[^`]*?`train_(\w+)\.py([^`]*)`",
                                              readme):
        tp = int((re.findall(r"--tp[= ](\d+)", options) or [2 if script == "2d" else 1])[-1])  # prose: "X with `...`"
        training.check_tensor_parallel(gpt.make_config(preset, 50257, 1024), tp, False)


def _presets_on_meta():
    """Every preset's tensor-parallel model built on meta over 2, 4 and 8 ranks, where its heads allow it."""
    built = []
    for tp in (2, 4, 8):
        group = dist.new_group(list(range(tp)))  # collective: every rank creates every group
        if dist.get_rank() >= tp:
            continue
        for preset in gpt.PRESETS:
            config = gpt.make_config(preset, 50257, 1024)
            try:
                training.check_tensor_parallel(config, tp, True)
            except ValueError:
                continue
            with torch.device("meta"):  # two blocks: every block is built alike
                model = gpt.GPT(gpt.GPTConfig(**dict(vars(config), n_layer=2)))
            train_tp.parallelize(model, group, sequence_parallel=True)
            parts = checkpoint.parameter_parts(model)
            local = sum(part.tensor.numel() for part in parts if part.sliced)
            whole = sum(math.prod(part.shape) for part in parts if part.sliced)
            assert local * tp == whole, (preset, tp)
            built.append((preset, tp))
    return built


def test_every_preset_builds_at_every_tensor_parallel_degree():
    """On meta, in seconds: every preset at --tp 2, 4 and 8 where n_head allows it. GPT-2's head counts (4, 12, 16,
    20, 25) leave --tp 8 to gpt2-medium alone among them and no degree of 2, 4, 8 to gpt2-xl (the README says so); the
    layout check names the flag to change. The GPT-3 presets' head counts allow every degree, and so do Llama 3's 8
    key/value heads; llama-tiny's 2 allow --tp 2 only. A mixture of experts is refused at every degree."""
    built = run_distributed(8, _presets_on_meta)[0]
    gpt3 = {preset for preset in gpt.PRESETS if preset.startswith("gpt3")}  # head counts chosen for --tp 8
    llama3 = {preset for preset in gpt.PRESETS if preset.startswith("llama3")}  # 8 key/value heads each
    dense = {preset for preset, fields in gpt.PRESETS.items() if not fields.get("n_expert")}  # --tp refuses experts
    assert {tp: {preset for preset, degree in built if degree == tp} for tp in (2, 4, 8)} == {
        2: dense - {"gpt2-xl"}, 4: dense - {"gpt2-xl", "llama-tiny"}, 8: {"gpt2-medium"} | gpt3 | llama3}
    with pytest.raises(ValueError, match="^--tp splits a dense MLP, not yet a mixture of experts"):
        training.check_tensor_parallel(gpt.make_config("mixtral-8x7b", 32000, 1024), 8, False)
    with pytest.raises(ValueError, match="n_head \\(25\\) is not divisible by --tp 2"):
        training.check_tensor_parallel(gpt.make_config("gpt2-xl", 50257, 1024), 2, False)
    # llama-tiny: 4 query heads share 2 key/value heads, which tensor parallelism splits too
    with pytest.raises(ValueError, match="^n_kv_head \\(2\\) is not divisible by --tp 4: choose --tp in \\{1, 2\\} or "):
        training.check_tensor_parallel(gpt.make_config("llama-tiny", 256, 32), 4, False)


def test_flops_and_mfu_need_a_known_device():
    config = gpt.make_config("gpt2", vocab_size=50257, block_size=1024)
    n = 124_475_904 - 1024 * 768  # GPT-2 small with padded vocab, without position embeddings
    assert gpt.flops_per_token(config, n) == 6 * n + 12 * 12 * 12 * 64 * 1024
    assert training.peak_flops(torch.device("cpu")) is None


# ------------------------------------------------------------------------------------------------------------
# training.py: what every layout shares. Holding a layout to train_single.py cannot see a mistake here, since
# train_single.py makes it too: each piece is held to its own statement of what it must do, written in the test.


def expected_lr(step, lr, min_lr, warmup_steps, max_steps):
    """What --lr, --min_lr, --warmup_steps and --max_steps promise: a linear warmup from lr / warmup_steps at step 0
    to lr at step warmup_steps - 1, then half a cosine from lr at step warmup_steps down to min_lr at max_steps."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    return min_lr + (lr - min_lr) * (1 + math.cos(math.pi * (step - warmup_steps) / (max_steps - warmup_steps))) / 2


def decays(name):
    """Weight decay by parameter name, as in nanoGPT and Megatron-LM: every weight matrix and both embeddings
    decay; biases and the layer norms' gains never do."""
    return not (name.endswith("bias") or ".ln_" in name or name.startswith("ln_"))


def independent_batch(corpus, split, step, seed=1234, block_size=32, batch=16):
    """The global batch of `step` as BatchSampler documents it, drawn without it: `batch` windows of block_size + 1
    tokens of <split>.bin at offsets drawn from (seed, split, step) alone; the targets are the inputs shifted by
    one. flags()'s seed, block size and global batch by default."""
    tokens = np.memmap(os.path.join(corpus, f"{split}.bin"), dtype=np.uint16, mode="r")
    rng = np.random.default_rng([seed, ["train", "val"].index(split), step])
    starts = rng.integers(0, len(tokens) - block_size - 1, size=batch)
    windows = torch.from_numpy(np.stack([tokens[s:s + block_size + 1] for s in starts]).astype(np.int64))
    return windows[:, :-1], windows[:, 1:]


@pytest.mark.parametrize("micro_batch", [1, 2, 4])
def test_sampler_rows_partition_the_global_batch(corpus, micro_batch):
    path = os.path.join(corpus, "train.bin")
    sample = lambda dp_rank, dp_size: training.BatchSampler(path, 16, 16, micro_batch, dp_rank, dp_size, seed=3,
                                                       device=torch.device("cpu"))
    one = sample(0, 1)
    reference = {}  # global row -> tokens, from the single-device layout
    for micro_step in range(one.accumulation):
        x, _ = one.get(step=5, micro_step=micro_step)
        reference.update(zip(one.rows(micro_step), x))
    assert sorted(reference) == list(range(16))
    for dp_size in (2, 4):
        seen = []
        for dp_rank in range(dp_size):
            sampler = sample(dp_rank, dp_size)
            for micro_step in range(sampler.accumulation):
                x, y = sampler.get(step=5, micro_step=micro_step)
                for row, tokens, targets in zip(sampler.rows(micro_step), x, y):
                    assert torch.equal(tokens, reference[row])
                    assert torch.equal(targets[:-1], tokens[1:])
                    seen.append(row)
        assert sorted(seen) == list(range(16)), "data-parallel ranks overlap or miss rows"
    assert not torch.equal(one.get(5, 0)[0], one.get(6, 0)[0])
    with pytest.raises(ValueError, match="not a multiple of --micro_batch"):
        training.BatchSampler(path, 16, 16, 3, 0, 2, 0, torch.device("cpu"))


@pytest.mark.parametrize("warmup_steps", [0, 1, 10])
def test_lr_schedule_at_every_boundary(warmup_steps):
    """Every step of a 110-step schedule (and past its end) against expected_lr: lr / warmup at step 0, the peak
    at the last warmup step and again at step warmup_steps (never above it), the midpoint halfway through the
    cosine, --min_lr from --max_steps on. set_lr gives every parameter group the step's rate."""
    lr, min_lr, max_steps = 1.0, 0.1, 110
    args = training.get_parser("").parse_args(["--lr", str(lr), "--min_lr", str(min_lr), "--warmup_steps",
                                                str(warmup_steps), "--max_steps", str(max_steps)])
    lrs = [training.get_lr(step, args) for step in range(max_steps + 5)]
    assert max(lrs) <= lr
    if warmup_steps:
        assert lrs[0] == pytest.approx(lr / warmup_steps) and lrs[warmup_steps - 1] == pytest.approx(lr)
    assert lrs[warmup_steps] == pytest.approx(lr)
    if (max_steps - warmup_steps) % 2 == 0:
        assert lrs[(warmup_steps + max_steps) // 2] == pytest.approx((lr + min_lr) / 2)
    assert lrs[max_steps:] == pytest.approx([min_lr] * 5)
    assert lrs == pytest.approx([expected_lr(step, lr, min_lr, warmup_steps, max_steps) for step in range(len(lrs))])
    assert all(a >= b for a, b in zip(lrs[warmup_steps:], lrs[warmup_steps + 1:])), "the cosine only decreases"
    optimizer = torch.optim.AdamW([{"params": [torch.zeros(2, requires_grad=True)]},
                                   {"params": [torch.zeros(2, requires_grad=True)]}])
    assert training.set_lr(optimizer, 60, args) == lrs[60]
    assert [group["lr"] for group in optimizer.param_groups] == [lrs[60]] * 2


def test_optimizer_groups_by_parameter_name():
    """make_optimizer(decay_groups(...)), as train_single, DDP and TP build it: every parameter in exactly one
    group, with --weight_decay exactly where decays(name) says; AdamW's betas and eps as nanoGPT sets them."""
    model = gpt.GPT(gpt.make_config("tiny", vocab_size=256, block_size=32))
    args = training.get_parser("").parse_args(["--weight_decay", "0.25"])
    optimizer = training.make_optimizer(training.decay_groups(model.parameters()), args, torch.device("cpu"))
    weight_decay = {param: group["weight_decay"] for group in optimizer.param_groups for param in group["params"]}
    assert sum(len(group["params"]) for group in optimizer.param_groups) == len(weight_decay)
    named = dict(model.named_parameters())
    assert weight_decay.keys() == set(named.values())
    assert {name for name in named if not decays(name)} >= {"blocks.0.ln_1.weight", "blocks.0.attn.query.bias"}
    for name, param in named.items():
        assert weight_decay[param] == (0.25 if decays(name) else 0.0), name
    for group in optimizer.param_groups:
        assert (group["lr"], group["betas"], group["eps"]) == (args.lr, (0.9, 0.95), 1e-8)


def _fsdp_optimizer_groups():
    _, fsdp, _ = _build(gpt.make_config("tiny", vocab_size=256, block_size=32))
    args = training.get_parser("").parse_args(["--weight_decay", "0.25"])
    optimizer = training.make_optimizer(fsdp.parameter_groups(), args, torch.device("cpu"))
    names = {flat.shard: [param.name for param in flat.params] for flat in fsdp.flats}
    return [(group["weight_decay"], [names[shard] for shard in group["params"]]) for group in optimizer.param_groups]


def test_fsdp_optimizer_groups_by_parameter_name():
    """FSDP (and 2-D) group flat shards: each shard's original parameters all decay or all do not, as their names
    say, and every parameter of the model is in one shard of one group."""
    for groups in run_distributed(2, _fsdp_optimizer_groups):
        seen = []
        for weight_decay, shards in groups:
            for names in shards:
                assert {weight_decay} == {0.25 if decays(name) else 0.0 for name in names}, names
                seen += names
        assert sorted(seen) == sorted(name for name, _ in gpt.GPT(gpt.make_config("tiny", 256, 32)).named_parameters())


@one_thread()
def test_validation_loss_is_the_mean_over_the_validation_batches(corpus):
    """evaluate is the cross-entropy of every token of --eval_iters global validation batches, computed here on
    each whole batch at once: the same at accumulation 16, 4 and 1, with dropout off (0.5 here: any mask would show),
    and it leaves the model training."""
    model = gpt.GPT(gpt.make_config("tiny", vocab_size=256, block_size=32, dropout=0.5))
    model.init_weights(1234)
    with torch.no_grad():
        model.eval()
        expected = np.mean([F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
                            for x, y in (independent_batch(corpus, "val", step) for step in range(2))])
        model.train()
    for micro_batch in (1, 4, 16):
        sampler = training.BatchSampler(os.path.join(corpus, "val.bin"), block_size=32, global_batch=16,
                                        micro_batch=micro_batch, dp_rank=0, dp_size=1, seed=1234,
                                        device=torch.device("cpu"))
        args = argparse.Namespace(eval_interval=1, max_steps=1, eval_iters=2)
        assert training.evaluate(0, args, model, sampler, contextlib.nullcontext()) == pytest.approx(expected, rel=1e-6)
        assert model.training


def full_tensor(found, name):
    """Tensor `name` of checkpoint `found` (a checkpoint.Checkpoint), whole, from the pieces of any layout."""
    shape = tuple(found.pieces[name][0]["shape"])
    return found.region(name, tuple((0, n) for n in shape), (0, math.prod(shape))).view(shape)


def test_checkpoint_pieces_assemble_any_layout(tmp_path):
    """Pieces cut as a tensor-parallel box, an FSDP flat range, or both, assemble into the full tensor."""
    full = torch.arange(6 * 8, dtype=torch.float32).view(6, 8)
    column_halves = [((0, 6), (0, 4)), ((0, 6), (4, 8))]
    pieces = [checkpoint.piece(full.shape, full[:, 0:4].flatten()[:10], column_halves[0], (0, 10)),
              checkpoint.piece(full.shape, full[:, 0:4].flatten()[10:], column_halves[0], (10, 24)),
              checkpoint.piece(full.shape, full[:, 4:8], column_halves[1])]
    for rank, mine in enumerate([pieces[:1], pieces[1:]]):
        checkpoint.save_shard(str(tmp_path), 3, rank, {"w": mine}, rng_state=None)
    checkpoint.publish(str(tmp_path), 3, 2, {"config": {}})
    found = checkpoint.Checkpoint(checkpoint.latest(str(tmp_path)))
    assert torch.equal(full_tensor(found, "w"), full)



class CountAllocations(TorchDispatchMode):
    """The bytes of every tensor an aten call returns in memory none of its inputs held: what it allocated."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        held = {x.untyped_storage().data_ptr() if isinstance(x, torch.Tensor) else x.data_ptr()
                for x in torch.utils._pytree.tree_leaves((args, kwargs))
                if isinstance(x, (torch.Tensor, torch.UntypedStorage))}
        self.bytes += sum(t.untyped_storage().nbytes() for t in torch.utils._pytree.tree_leaves(out)
                          if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in held)
        return out


def test_a_checkpoint_writes_host_tensors_without_copying_them(tmp_path):
    """An offloaded FSDP shard (one flat host buffer holding two parameters' parts) and AdamW's moments over it: cutting
    the pieces and writing the rank's file allocate no byte (every aten call counted), and each piece is stored alone
    (its own elements, not the whole buffer) and reads back."""
    flat = torch.randn(100)
    parts = [checkpoint.Part("w", (6, 8), ((0, 6), (0, 8)), (0, 48), flat),
             checkpoint.Part("b", (60,), ((0, 60),), (8, 60), flat, 48)]
    moments = {"exp_avg": torch.randn(100), "exp_avg_sq": torch.rand(100)}
    optimizer = argparse.Namespace(state={flat: moments})
    with CountAllocations() as counted:
        tensors = checkpoint.pieces(parts, optimizer)
        checkpoint.save_shard(str(tmp_path), 1, 0, tensors, rng_state=None)
    assert counted.bytes == 0
    saved = torch.load(tmp_path / "ckpt-0000001.tmp" / "rank00000.pt", weights_only=True)["tensors"]
    for name, source in [("w", flat[:48]), ("b", flat[48:100]), ("exp_avg/b", moments["exp_avg"][48:100]),
                         ("exp_avg_sq/w", moments["exp_avg_sq"][:48])]:
        data = saved[name][0]["data"]
        assert torch.equal(data, source) and data.untyped_storage().nbytes() == source.nbytes, name


# What writes, moves or removes a file while a checkpoint is saved and published (open: the `latest` pointer).
FILE_OPERATIONS = [(os, "makedirs"), (os, "replace"), (os, "rename"), (os, "fsync"), (shutil, "rmtree"),
                   (torch, "save"), (checkpoint, "open")]


def test_checkpoint_publishing_survives_a_crash_between_any_two_file_operations(tmp_path, monkeypatch):
    """After step 2's checkpoint, step 4's is saved with a crash injected before its first file operation, then
    before its second, and so on until one save completes. After every crash `latest` names a complete, readable
    checkpoint (step 2's until the pointer moves, step 4's after), and the run resumed from it saves its next
    checkpoints and ends with `latest` at step 6."""
    config = gpt.make_config("tiny", vocab_size=256, block_size=32)

    def save(out_dir, step):  # a checkpoint whose one tensor holds its step number; the one before it deleted
        args = training.get_parser("").parse_args(["--out_dir", str(out_dir), "--keep_checkpoints", "1"])
        checkpoint.save(args, step, {"w": [checkpoint.piece((3,), torch.full((3,), float(step)))]}, config,
                                 torch.device("cpu"))

    def saved_step(out_dir):
        found = checkpoint.Checkpoint(checkpoint.latest(str(out_dir)))  # raises if unreadable
        found.check(config, {"w": (3,)})  # raises if a piece is missing
        step = found.meta["step"]
        assert torch.equal(full_tensor(found, "w"), torch.full((3,), float(step)))
        assert found.path.endswith(f"ckpt-{step:07d}")
        return step

    steps = []  # latest's step after each crash
    for crash_at in range(1, 100):
        out_dir = tmp_path / f"crash_before_operation_{crash_at}"
        save(out_dir, 2)
        operations = []
        with monkeypatch.context() as patches:
            for module, name in FILE_OPERATIONS:  # checkpoint.open is the builtin, shadowed for checkpoint.py alone
                def operation(*args, real=getattr(module, name, None) or open, name=name, **kwargs):
                    operations.append(name)
                    if len(operations) == crash_at:
                        raise Crash
                    return real(*args, **kwargs)
                patches.setattr(module, name, operation, raising=False)
            try:
                save(out_dir, 4)
            except Crash:
                pass
        steps.append(saved_step(out_dir))
        for next_step in range(steps[-1] + 2, 7, 2):
            save(out_dir, next_step)
        assert saved_step(out_dir) == 6
        if len(operations) < crash_at:  # the save went through: every operation has had a crash before it
            break
    print(f"crashed before each of {len(operations)} file operations {operations}: latest at steps {steps[:-1]}")
    assert {"rename", "replace", "fsync", "rmtree"} <= set(operations)
    assert steps == sorted(steps) and steps[0] == 2 and steps[-1] == 4  # the pointer moves once, never back


# ------------------------------------------------------------------------------------------------------------
# prepare_data.py


def test_prepare_data_local_text(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    lines = [f"line {i}: caf\u00e9 {'x' * (i % 7)}" for i in range(200)]
    (folder / "a.txt").write_text("\n".join(lines[:120]) + "\n")
    (folder / "b.txt").write_text("\n".join(lines[120:]) + "\n")
    out = tmp_path / "prepared"
    meta = prepare_data.main(["--input", str(folder), "--tokenizer", "byte", "--out_dir", str(out),
                              "--val_fraction", "0.1", "--num_proc", "1"])
    assert meta["tokenizer"] == "byte" and meta["vocab_size"] == 256
    train = np.fromfile(out / "train.bin", dtype=np.uint16)
    val = np.fromfile(out / "val.bin", dtype=np.uint16)
    assert (len(train), len(val)) == (meta["train_tokens"], meta["val_tokens"])
    assert len(train) + len(val) == sum(len((line + "\n").encode()) for line in lines)
    text = prepare_data.ByteTokenizer().decode(np.concatenate([train, val]).tolist())
    assert sorted(text.splitlines()) == sorted(lines)  # every line once, whole, in one split or the other
    assert 0 < len(val) < len(train)
    assert json.loads((out / "meta.json").read_text()) == meta


def test_prepare_data_skips_what_is_not_text(tmp_path, capsys):
    """An ordinary folder: a compressed file, a binary one, a broken link and a FIFO next to the text. They are
    skipped and named; a folder with nothing readable is a one-line error."""
    folder = tmp_path / "texts"
    folder.mkdir()
    text = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(100))
    (folder / "code.py").write_text(text)
    (folder / "notes.txt.gz").write_bytes(gzip.compress(text.encode()))
    (folder / "zeros.bin").write_bytes(bytes(1000))  # valid UTF-8, but NUL bytes: binary
    (folder / "dangling.txt").symlink_to(tmp_path / "nowhere")
    os.mkfifo(folder / "pipe")  # opening it would block forever
    meta = prepare_data.main(["--input", str(folder), "--tokenizer", "byte", "--out_dir", str(tmp_path / "out"),
                              "--val_fraction", "0.1"])
    assert meta["train_tokens"] + meta["val_tokens"] == len(text.encode())
    printed = capsys.readouterr().out
    assert "skipping 4 of 5 files" in printed
    for name, why in [("notes.txt.gz", "not UTF-8 text"), ("zeros.bin", "binary"), ("dangling.txt", "broken link"),
                      ("pipe", "not a regular file")]:
        assert f"{name} ({why})" in printed
    (folder / "code.py").unlink()
    with pytest.raises(training.UsageError, match="no file readable as UTF-8 text"):
        prepare_data.main(["--input", str(folder), "--tokenizer", "byte", "--out_dir", str(tmp_path / "none")])
    assert not os.path.exists(tmp_path / "none")


def test_prepare_data_missing_input_is_a_clear_error(tmp_path):
    with pytest.raises(training.UsageError, match="no such file or folder"):
        prepare_data.main(["--input", str(tmp_path / "nope"), "--tokenizer", "byte", "--out_dir", str(tmp_path)])


def test_download_without_network_fails_at_once_naming_offline_options(tmp_path, monkeypatch):
    def unreachable(*args, **kwargs):
        raise OSError("Name or service not known")

    monkeypatch.setattr(socket, "create_connection", unreachable)
    for dataset in ("shakespeare", "openwebtext", "fineweb-edu"):
        start = time.time()
        with pytest.raises(training.UsageError, match="--input PATH --tokenizer byte"):
            prepare_data.main(["--dataset", dataset, "--out_dir", str(tmp_path)])
        assert time.time() - start < 5
    assert not os.path.exists(tmp_path / "meta.json")


def test_default_corpus(corpus):
    meta = prepare_data.load_meta(corpus)
    assert meta["tokenizer"] == "byte" and meta["train_tokens"] > 10_000_000 and meta["val_tokens"] > 100_000
    head = np.memmap(os.path.join(corpus, "train.bin"), dtype=np.uint16, mode="r")[:10_000]
    assert head.max() < 256 and "import" in bytes(head.astype(np.uint8)).decode("utf-8", "replace")


# ------------------------------------------------------------------------------------------------------------
# train_single.py


@one_thread()
def test_loss_falls_on_the_default_corpus(corpus, tmp_path):
    train_single.main(flags(corpus, tmp_path, block_size=64, micro_batch=16, max_steps=60, warmup_steps=10,
                            lr=3e-3, eval_interval=59, log_interval=10))
    with open(tmp_path / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    first, last = records[0], records[-1]
    assert first["loss"] > 5.0 and last["loss"] < 3.6, (first["loss"], last["loss"])
    assert first["val_loss"] > 5.0 and last["val_loss"] < 3.6
    assert set(last) >= {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_mb", "step_ms"}
    assert last["mfu"] is None and last["tokens_per_s"] > 0 and last["peak_mem_mb"] > 0


@one_thread()
def test_train_single_equals_a_plain_training_loop(corpus, tmp_path_factory):
    """The reference for what every layout shares, with no code of training.py: a plain loop written here from the
    flags' definitions (batches from independent_batch, whole at once instead of train_single's 8 micro-batches;
    expected_lr; AdamW groups by decays(name); F.cross_entropy; clipping to norm 1 by hand; validation at the first
    and last step) trains flags()'s 6 steps: the same losses, grad norms, rates, validation losses and weights."""
    model = gpt.GPT(gpt.make_config("tiny", vocab_size=256, block_size=32))
    model.init_weights(1234)
    named = dict(model.named_parameters())
    optimizer = torch.optim.AdamW([{"params": [p for name, p in named.items() if decays(name)], "weight_decay": 0.1},
                                   {"params": [p for name, p in named.items() if not decays(name)],
                                    "weight_decay": 0.0}], betas=(0.9, 0.95), eps=1e-8)
    losses, grad_norms, lrs, val_losses = [], [], [], {}

    def cross_entropy(x, y):
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

    for step in range(6):
        if step in (0, 5):  # --eval_interval 100 --eval_iters 1: one validation batch, at the first and last step
            with torch.no_grad():
                val_losses[step] = cross_entropy(*independent_batch(corpus, "val", 0)).item()
        lrs.append(expected_lr(step, lr=3e-3, min_lr=3e-4, warmup_steps=2, max_steps=6))
        for group in optimizer.param_groups:
            group["lr"] = lrs[-1]
        loss = cross_entropy(*independent_batch(corpus, "train", step))
        loss.backward()
        grad_norm = torch.stack([param.grad.norm() for param in named.values()]).norm().item()
        for param in named.values():
            param.grad *= min(1.0, 1.0 / (grad_norm + 1e-6))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        grad_norms.append(grad_norm)
    weights = {name: param.detach().numpy() for name, param in named.items()}
    assert_runs_match(single_run(corpus, tmp_path_factory), Run(losses, weights, grad_norms, lrs, val_losses))


@one_thread()
def test_bfloat16_autocast_and_sampling(corpus, tmp_path, capsys):
    train_single.main(flags(corpus, tmp_path, dtype="bfloat16", max_steps=2, micro_batch=8, sample_tokens=16))
    run = read_run(str(tmp_path))
    assert all(math.isfinite(loss) for loss in run.losses)
    assert all(w.dtype == np.float32 for w in run.weights.values())  # master weights stay float32
    assert "sample:" in capsys.readouterr().out


@pytest.mark.parametrize("extra, package, message", [
    (dict(tensorboard=True), "tensorboard", "pip install tensorboard"),
    (dict(wandb=True), "wandb", "pip install wandb"),
    (dict(attn="flash"), None, "--attn flash"),  # flash-attn missing, or present but no CUDA: an error either way
])
def test_missing_optional_package_is_a_clear_error(corpus, tmp_path, extra, package, message):
    if package and importlib.util.find_spec(package):
        pytest.skip(f"{package} is installed")
    with pytest.raises(training.UsageError, match=message):
        train_single.main(flags(corpus, tmp_path / "out", max_steps=1, **extra))
    assert not os.path.exists(tmp_path / "out")  # refused before anything was created


@one_thread()
def test_resume_is_bit_identical(corpus, tmp_path, monkeypatch):
    straight = tmp_path / "straight"
    train_single.main(flags(corpus, straight, max_steps=8, dropout=DROPOUT))
    interrupted = tmp_path / "interrupted"
    real_get_lr = training.get_lr

    def crash_at_step_5(step, args):
        if step == 5:
            raise Crash
        return real_get_lr(step, args)

    monkeypatch.setattr(training, "get_lr", crash_at_step_5)
    with pytest.raises(Crash):
        train_single.main(flags(corpus, interrupted, max_steps=8, ckpt_interval=3, dropout=DROPOUT))
    monkeypatch.setattr(training, "get_lr", real_get_lr)
    assert checkpoint.latest(str(interrupted)).endswith("ckpt-0000003")
    train_single.main(flags(corpus, interrupted, max_steps=8, ckpt_interval=3, dropout=DROPOUT, resume=True))
    assert_identical(read_run(str(interrupted)), read_run(str(straight)))  # bit-identical, not merely close


@one_thread()
def test_checkpoint_killed_mid_write_leaves_the_previous_one(corpus, tmp_path, monkeypatch):
    real_save = torch.save
    saves = []

    def dies_halfway_through_the_second_checkpoint(obj, path, *args, **kwargs):
        saves.append(path)
        if len(saves) == 3:  # after step 2's rank file and meta, step 4's rank file: write half, then "die"
            real_save(obj, path, *args, **kwargs)
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
            raise Crash
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", dies_halfway_through_the_second_checkpoint)
    with pytest.raises(Crash):
        train_single.main(flags(corpus, tmp_path, max_steps=6, ckpt_interval=2))
    monkeypatch.setattr(torch, "save", real_save)
    latest = checkpoint.latest(str(tmp_path))
    assert latest.endswith("ckpt-0000002")
    checkpoint.Checkpoint(latest)  # loads whole
    with pytest.raises(training.UsageError, match="pass --resume"):  # a new run never overwrites what is saved
        train_single.main(flags(corpus, tmp_path, max_steps=6, ckpt_interval=2))
    train_single.main(flags(corpus, tmp_path, max_steps=6, ckpt_interval=2, resume=True))
    assert checkpoint.latest(str(tmp_path)).endswith("ckpt-0000006")


def checkpoint_steps(out_dir):
    return sorted(int(name[5:]) for name in os.listdir(out_dir) if name.startswith("ckpt-"))


@one_thread()
def test_keep_checkpoints_keeps_the_newest(corpus, tmp_path):
    train_single.main(flags(corpus, tmp_path / "default", max_steps=5, ckpt_interval=1))
    assert checkpoint_steps(tmp_path / "default") == [4, 5]  # --keep_checkpoints 2: the newest and one before it
    train_single.main(flags(corpus, tmp_path / "all", max_steps=5, ckpt_interval=1, keep_checkpoints=0))
    assert checkpoint_steps(tmp_path / "all") == [1, 2, 3, 4, 5]
    train_single.main(flags(corpus, tmp_path / "all", max_steps=7, ckpt_interval=1, keep_checkpoints=3, resume=True))
    assert checkpoint_steps(tmp_path / "all") == [5, 6, 7]


@one_thread()
def test_resume_says_what_changed_and_when_nothing_is_left(corpus, tmp_path, capsys):
    train_single.main(flags(corpus, tmp_path, max_steps=3, resume=True))  # nothing to resume yet: its first line says so
    metrics, printed = (tmp_path / "metrics.jsonl").read_text(), capsys.readouterr().out
    assert f"| from scratch (--resume: no checkpoint in '{tmp_path}' yet) |" in printed.splitlines()[0], printed
    code, printed = command_line(train_single.main, flags(corpus, tmp_path, max_steps=3, resume=True), capsys)
    assert code == 0 and printed == (f"nothing to do: '{tmp_path}/ckpt-0000003' is at step 3 and --max_steps is 3; "
                                     "pass a larger --max_steps to train further\n")
    assert (tmp_path / "metrics.jsonl").read_text() == metrics  # no step taken, no sample
    code, printed = command_line(train_single.main, flags(corpus, tmp_path, max_steps=4, lr=1e-3, resume=True), capsys)
    assert code == 0 and printed.splitlines()[0] == ("the schedule differs from the checkpoint's (--max_steps 3 -> 4, "
                                                     "--lr 0.003 -> 0.001): the learning rate follows the new one "
                                                     "from step 3 on")
    assert "resuming at step 3" in printed.splitlines()[1]


@one_thread()
def test_checkpoint_of_another_model_is_refused(corpus, tmp_path):
    train_single.main(flags(corpus, tmp_path, max_steps=2))
    before = open(os.path.join(checkpoint.latest(str(tmp_path)), "meta.pt"), "rb").read()
    with pytest.raises(ValueError, match="another model"):
        train_single.main(flags(corpus, tmp_path, max_steps=4, block_size=64, resume=True))
    assert open(os.path.join(checkpoint.latest(str(tmp_path)), "meta.pt"), "rb").read() == before


@one_thread()
def test_truncated_checkpoint_is_refused(corpus, tmp_path):
    train_single.main(flags(corpus, tmp_path, max_steps=2))
    rank_file = os.path.join(checkpoint.latest(str(tmp_path)), "rank00000.pt")
    with open(rank_file, "r+b") as f:
        f.truncate(os.path.getsize(rank_file) // 2)
    with pytest.raises(training.UsageError, match="unreadable"):
        train_single.main(flags(corpus, tmp_path, max_steps=4, resume=True))


@pytest.mark.parametrize("bad, message", [
    (dict(data="/nonexistent/data"), "prepare_data.py"),
    (dict(model="gpt5"), "invalid choice: 'gpt5'"),
    (dict(global_batch=10, micro_batch=4), "not a multiple of --micro_batch"),
    (dict(prompt="", sample_tokens=8), "--prompt is empty"),
    (dict(temperature=0), "--temperature: must be a number > 0"),
])
def test_bad_input_is_a_clear_error(corpus, tmp_path, bad, message):
    with pytest.raises(training.UsageError, match=message):
        train_single.main(flags(corpus, tmp_path, **bad))


SCRIPTS = [train_single, train_ddp, train_zero, train_fsdp, train_tp, train_2d, train_pp, train_cp, train_4d, train_ep,
           prepare_data, bench, gpu_check, bench_pipeline, sample]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda script: script.__name__)
def test_help_keeps_the_examples_and_explains_every_flag(script, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    monkeypatch.setattr(sys, "argv", [script.__name__ + ".py", "--help"])  # bench.py reads sys.argv
    with pytest.raises(SystemExit) as exit:
        script.main(["--help"]) if script is not bench else script.main()
    text = capsys.readouterr().out
    assert exit.value.code == 0
    with open(script.__file__) as f:
        docstring = f.read().split('"""')[1]  # as written in the file: a backslash at a line end is kept
    examples = [line for line in docstring.splitlines() if line.startswith("    ")]
    assert examples and all(line in text.splitlines() for line in examples), "examples reflowed"
    for flag in re.split(r"\n(?=  -)", text.split("options:\n", 1)[1].strip("\n")):
        signature, _, explanation = flag.strip().partition("  ")  # argparse sets them apart by 2 spaces or more
        assert explanation.strip(), f"{signature} has no help"
        assert explanation.count("default:") <= 1 and "(default: None)" not in explanation, flag


def command_line(main, argv, capsys):
    """main(argv) as the command line runs it, through training.exit_code: (exit code, what it printed)."""
    code = training.exit_code(lambda: main(argv))
    printed = capsys.readouterr()
    return code, printed.out + printed.err


@pytest.mark.parametrize("main, bad, message", [
    (train_single.main, dict(block_size=0), "argument --block_size: must be a whole number > 0, not '0'"),
    (train_single.main, dict(block_size=-5), "argument --block_size: must be a whole number > 0, not '-5'"),
    (train_single.main, dict(global_batch=0), "argument --global_batch: must be a whole number > 0"),
    (train_single.main, dict(micro_batch=0), "argument --micro_batch: must be a whole number > 0"),
    (train_single.main, dict(max_steps=0), "argument --max_steps: must be a whole number > 0"),
    (train_single.main, dict(warmup_steps=-1), "argument --warmup_steps: must be a whole number >= 0"),
    (train_single.main, dict(eval_interval=-1), "argument --eval_interval: must be a whole number >= 0"),
    (train_single.main, dict(eval_iters=0), "argument --eval_iters: must be a whole number > 0"),
    (train_single.main, dict(log_interval=0), "argument --log_interval: must be a whole number > 0"),
    (train_single.main, dict(ckpt_interval=-1), "argument --ckpt_interval: must be a whole number >= 0"),
    (train_single.main, dict(keep_checkpoints=-1), "argument --keep_checkpoints: must be a whole number >= 0"),
    (train_single.main, dict(sample_tokens=-1), "argument --sample_tokens: must be a whole number >= 0"),
    (train_single.main, dict(dropout=1), "argument --dropout: must be a probability in [0, 1), not '1'"),
    (train_single.main, dict(dropout=-0.1), "argument --dropout: must be a probability in [0, 1)"),
    (train_single.main, dict(lr=-1), "argument --lr: must be a number >= 0, not '-1'"),  # 0: a run that only evaluates
    (train_single.main, dict(lr="nan"), "argument --lr: must be a number >= 0, not 'nan'"),
    (train_single.main, dict(min_lr=-1), "argument --min_lr: must be a number >= 0"),
    (train_single.main, dict(weight_decay=-1), "argument --weight_decay: must be a number >= 0"),
    (train_single.main, dict(grad_clip="inf"), "argument --grad_clip: must be a number >= 0, not 'inf'"),
    (train_single.main, dict(timeout=0), "argument --timeout: must be a number > 0"),
    (train_single.main, dict(seed="x"), "argument --seed: invalid int value: 'x'"),
    (train_single.main, dict(min_lr=0.01, lr=0.001), "--min_lr 0.01 is above --lr 0.001"),
    (train_single.main, dict(model="gpt5"), "argument --model: invalid choice: 'gpt5'"),
    (train_single.main, dict(lrr=1), "unrecognized arguments: --lrr 1"),
    (train_single.main, dict(data="/nonexistent"), "no prepared data in '/nonexistent'"),
    (train_single.main, dict(global_batch=10, micro_batch=4), "--global_batch 10 is not a multiple of --micro_batch 4"),
    (train_single.main, dict(block_size=10**8), "fewer than --block_size 100000000 + 2"),
    (train_single.main, dict(attn="flash"), "--attn flash needs the flash-attn package"),
    (train_ddp.main, dict(bucket_mb=0), "argument --bucket_mb: must be a number > 0"),
    (train_ddp.main, dict(impl="torch", resume=True), "--resume is implemented for --impl ours only"),
    (train_zero.main, dict(stage=3), "argument --stage: invalid choice: 3 (choose from 1, 2)"),
    (train_fsdp.main, dict(replicate=0), "argument --replicate: must be a whole number > 0"),
    (train_tp.main, dict(tp=0), "argument --tp: must be a whole number > 0"),
    (train_2d.main, dict(dp=-1), "argument --dp: must be a whole number > 0"),
    (train_2d.main, {}, "--tp 2 x --dp 1 = 2 ranks, but the world has 1: launch it with torchrun --nproc_per_node=2"),
])
def test_bad_flags_are_one_line_errors(corpus, tmp_path, capsys, main, bad, message):
    """Every bad flag, as the command line reports it: one line, no traceback, exit code 2, nothing created."""
    code, printed = command_line(main, flags(corpus, tmp_path / "out", **bad), capsys)
    assert code == 2 and printed.startswith("error: ") and printed.count("\n") == 1 and message in printed, printed
    assert "Traceback" not in printed and not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("main, world_size, bad, message", [
    (train_ddp.main, 2, dict(micro_batch=None, global_batch=3), "--global_batch 3 does not split over 2 data-parallel"),
    (train_fsdp.main, 4, dict(global_batch=16, micro_batch=3), "not a multiple of --micro_batch 3 x data-parallel "),
    (train_fsdp.main, 4, dict(replicate=3), "--replicate 3 does not divide world size 4 into shard groups of equal size"),
    (train_zero.main, 2, dict(stage=2, impl="torch"), "--impl torch has no --stage 2: PyTorch has no ZeRO-2"),
    (train_tp.main, 2, dict(tp=4), "--tp 4 with 2 ranks: train_tp.py is tensor-parallel only"),
    (train_2d.main, 4, dict(tp=2, dp=3), "--tp 2 x --dp 3 = 6 ranks, but the world has 4: choose --tp and --dp"),
    (train_tp.main, 2, dict(model="moe-tiny"), "--tp splits a dense MLP, not yet a mixture of experts: split its"),
    (train_pp.main, 2, dict(model="moe-tiny", pp=2, impl="torch"), "mixture of experts would count its tokens twice"),
])
def test_layout_errors_come_before_any_collective(corpus, tmp_path, capsys, monkeypatch, main, world_size, bad,
                                                  message):
    """A rank of a launched world refuses a layout alone, before joining the process group: nothing to hang on."""
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world_size))
    monkeypatch.setattr(dist, "init_process_group", lambda *args, **kwargs: pytest.fail("joined the group"))
    code, printed = command_line(main, flags(corpus, tmp_path / "out", **bad), capsys)
    assert code == 2 and printed.startswith("error: ") and message in printed and printed.count("\n") == 1, printed


@pytest.mark.parametrize("package", ["tensorboard", "wandb"])
def test_missing_logger_package_is_one_line_before_anything_is_created(corpus, tmp_path, capsys, monkeypatch,
                                                                        package):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == package
                        else real_find_spec(name, *args))
    code, printed = command_line(train_single.main, flags(corpus, tmp_path / "out", **{package: True}), capsys)
    assert (code, printed) == (2, f"error: --{package} needs the {package} package: pip install {package}\n")
    assert not os.path.exists(tmp_path / "out")


def test_readme_shows_how_to_log_to_tensorboard_and_wandb():
    commands = readme_commands("TensorBoard and Weights & Biases", ("pip", "python", "WANDB_MODE"))
    assert "pip install tensorboard" in commands and "pip install wandb" in commands, commands
    assert any("python train_single.py --tensorboard" in command for command in commands), commands
    assert any("python train_single.py --wandb" in command for command in commands), commands  # after WANDB_MODE


@launches_its_own_ranks
def test_data_parallel_scripts_run_without_torchrun(corpus, tmp_path):
    """`python train_ddp.py` (no RANK in the environment) is a world of one process; train_2d.py's grid needs
    torchrun, and says so (test_bad_flags_are_one_line_errors). Run as the user runs them, in their own processes:
    a process group created and destroyed in the pytest process could leave gloo's threads behind for the
    workers the next tests fork."""
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    for script in ("train_ddp.py", "train_fsdp.py", "train_tp.py"):
        argv = flags(corpus, tmp_path / script, max_steps=1)
        result = subprocess.run([sys.executable, script, *argv], cwd=HERE, env=dict(environment, OMP_NUM_THREADS="1"),
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0 and "| 1 rank on cpu |" in result.stdout, result.stdout + result.stderr


# ------------------------------------------------------------------------------------------------------------
# train_ddp.py


def _train_recording_rows(argv):
    """train_ddp.main on this rank; returns {(split, step): [token rows this rank read]}: the rows it trained on at
    each step, and the rows each evaluation read from validation batch `step` (every evaluation reads batch 0 on)."""
    rows = {}
    real_get = training.BatchSampler.get

    def get(sampler, step, micro_step):
        x, y = real_get(sampler, step, micro_step)
        rows.setdefault((("train", "val")[sampler.split], step), []).extend(row.tobytes() for row in x.numpy())
        return x, y

    training.BatchSampler.get = get
    try:
        train_ddp.main(argv)
    finally:
        training.BatchSampler.get = real_get  # a launched world runs in the test process itself
    return rows


_ddp_runs = {}


def ddp_run(corpus, tmp_path_factory, world_size, **overrides):
    """train_ddp.py on world_size ranks, once per distinct flags per session: (read_run's result, each rank's
    token rows by step)."""
    key = (world_size, tuple(sorted(overrides.items())))
    if key not in _ddp_runs:
        out_dir = shared_folder(tmp_path_factory, "ddp")
        rows = run_distributed(world_size, _train_recording_rows, flags(corpus, out_dir, **overrides))
        _ddp_runs[key] = read_run(str(out_dir)), rows
    return _ddp_runs[key]


@pytest.mark.parametrize("world_size", [2, 4])
def test_ddp_matches_single_device(corpus, tmp_path_factory, world_size):
    """Losses and weights after 6 steps (accumulation 8 / (2 x world_size), clipping on) equal train_single's,
    and the ranks split every global batch between them without overlap: the training batch of every step, and the
    validation batch every evaluation reads (the validation set is single's whatever the layout, each rank reading
    its own rows of it once an evaluation)."""
    run, rows = ddp_run(corpus, tmp_path_factory, world_size)
    assert_runs_match(run, single_run(corpus, tmp_path_factory))
    batches = [("train", step) for step in range(6)] + [("val", 0)]  # eval_iters 1: validation batch 0 alone
    assert {key for rank_rows in rows for key in rank_rows} == set(batches)
    for split, step in batches:
        everyone = [row.numpy().tobytes() for row in independent_batch(corpus, split, step)[0]]  # as flags() sets it
        reads = 1 if split == "train" else 2  # the validation batch at the first and the last step
        for rank_rows in rows:
            assert len(rank_rows[split, step]) == reads * 16 // world_size, "every rank reads its share of the rows"
        ranks = [set(rank_rows[split, step]) for rank_rows in rows]
        assert all(len(r) == 16 // world_size for r in ranks), f"{split} {step}: ranks overlap or read a row twice"
        assert set.union(*ranks) == set(everyone), f"{split} {step}: the ranks together see exactly the batch"


@pytest.mark.parametrize("dropout", [0, DROPOUT])
def test_ddp_ours_matches_torch(corpus, tmp_path_factory, dropout):
    """--impl ours against --impl torch (DistributedDataParallel, same buckets): same losses, weights, grad norms;
    with dropout too, since both draw each rank's masks from its own generator in the same order."""
    extra = dict(dropout=dropout) if dropout else {}  # the runs other tests share
    ours, _ = ddp_run(corpus, tmp_path_factory, 2, **extra)
    theirs, _ = ddp_run(corpus, tmp_path_factory, 2, impl="torch", **extra)
    assert ours.losses == theirs.losses and ours.grad_norms == theirs.grad_norms  # measured: bit-identical
    assert_runs_match(ours, theirs)
    if not dropout:  # other masks than train_single's
        assert_runs_match(theirs, single_run(corpus, tmp_path_factory))


def test_ddp_resumes_at_another_world_size(corpus, tmp_path_factory, shared_tmp):
    """Saved by 2 ranks (rank 0 writes the replicated tensors), killed at step 3, resumed by 4 ranks: the run
    equals train_single's 6 straight steps."""
    argv = flags(corpus, shared_tmp, ckpt_interval=3)
    assert run_distributed(2, _train_until, train_ddp.main, 3, argv) == ["crashed"] * 2
    run_distributed(4, train_ddp.main, argv + ["--resume"])
    assert checkpoint.latest(str(shared_tmp)).endswith("ckpt-0000006")
    assert_runs_match(read_run(str(shared_tmp)), single_run(corpus, tmp_path_factory))


def _train_recording_communication(argv):
    """train_ddp.main on this rank; returns the events of the run in order: micro-steps, gradients accumulated
    ("grad", name), all-reduces ("all_reduce", bucket index or None, async) and waits for them ("wait", bucket
    index), plus the buckets' names."""
    events, buckets = [], []
    real_all_reduce, real_get, real_wrapper = dist.all_reduce, training.BatchSampler.get, train_ddp.DataParallel

    class RecordingWork:
        def __init__(self, work, bucket):
            self.work, self.bucket = work, bucket

        def wait(self):
            events.append(("wait", self.bucket))
            return self.work.wait()

    def all_reduce(tensor, *args, **kwargs):
        bucket = next((i for i, b in enumerate(buckets) if b.buffer.data_ptr() == tensor.data_ptr()), None)
        events.append(("all_reduce", bucket, kwargs.get("async_op", False)))
        work = real_all_reduce(tensor, *args, **kwargs)
        return RecordingWork(work, bucket) if work is not None else None

    def get(sampler, step, micro_step):
        if sampler.split == 0:
            events.append(("micro_step", step, micro_step))
        return real_get(sampler, step, micro_step)

    class RecordingDataParallel(real_wrapper):
        def __init__(self, module, *args, **kwargs):
            super().__init__(module, *args, **kwargs)
            buckets.extend(self.buckets)
            for name, param in module.named_parameters():  # after the wrapper's own hooks: they run first
                param.register_post_accumulate_grad_hook(lambda _, name=name: events.append(("grad", name)))

    dist.all_reduce, training.BatchSampler.get, train_ddp.DataParallel = all_reduce, get, RecordingDataParallel
    try:
        train_ddp.main(argv)
    finally:
        dist.all_reduce, training.BatchSampler.get, train_ddp.DataParallel = real_all_reduce, real_get, real_wrapper
    return events, [bucket.names for bucket in buckets]


_communication = {}


def recorded_communication(corpus, tmp_path_factory, compile=False):
    """Rank 0's events of a 2-rank run with 0.25 MiB buckets (several buckets for the tiny model's 3.4 MB)."""
    if compile not in _communication:
        argv = flags(corpus, shared_folder(tmp_path_factory, "ddp_events"), bucket_mb=0.25, compile=compile)
        timeout_s = COMPILE_TIMEOUT_S if compile else COLLECTIVE_TIMEOUT_S
        _communication[compile] = run_distributed(2, _train_recording_communication, argv, timeout_s=timeout_s)[0]
    return _communication[compile]


def split_into_micro_steps(events):
    """[(step, micro_step, events from its batch until the next batch)]."""
    micro_steps = []
    for event in events:
        if event[0] == "micro_step":
            micro_steps.append((event[1], event[2], []))
        elif micro_steps:
            micro_steps[-1][2].append(event)
    return micro_steps


@pytest.mark.parametrize("compile", [False, True])
def test_ddp_all_reduce_overlaps_backward(corpus, tmp_path_factory, compile):
    """In every step's last micro-step, the first bucket's all-reduce is launched asynchronously before
    backward has accumulated the gradients of the other buckets, and nothing waits for one before backward ends;
    under --compile too (each block compiled apart: a model compiled whole fires every gradient hook at the end)."""
    events, bucket_names = recorded_communication(corpus, tmp_path_factory, compile)
    assert len(bucket_names) >= 4
    accumulation = 16 // (2 * 2)
    # Compiled, a block's backward is one autograd node: the first bucket (ln_f and the last block's first
    # parameters) waits for the whole last block's backward; every earlier block's gradients still come after.
    others = {name for names in bucket_names[1:] for name in names}
    expected = {name for name in others if not (compile and name.startswith("blocks.3."))}
    for step, micro_step, happened in split_into_micro_steps(events):
        if micro_step + 1 < accumulation:
            continue
        first_launch = happened.index(("all_reduce", 0, True))
        later_grads = [e[1] for e in happened[first_launch:] if e[0] == "grad" and e[1] not in bucket_names[0]]
        assert later_grads, f"step {step}: every gradient was ready before the first all-reduce started"
        assert expected <= set(later_grads) <= others
        last_grad = max(i for i, e in enumerate(happened) if e[0] == "grad")
        first_wait = min(i for i, e in enumerate(happened) if e[0] == "wait")
        assert first_wait > last_grad, f"step {step}: waited for an all-reduce during backward"


def test_ddp_one_all_reduce_per_bucket_per_step(corpus, tmp_path_factory):
    """No all-reduce during the no-sync micro-steps; each bucket exactly once, in order, in the last one."""
    events, bucket_names = recorded_communication(corpus, tmp_path_factory)
    accumulation = 16 // (2 * 2)
    micro_steps = split_into_micro_steps(events)
    assert len(micro_steps) == 6 * accumulation
    for step, micro_step, happened in micro_steps:
        launched = [e[1] for e in happened if e[0] == "all_reduce" and e[1] is not None]
        expected = list(range(len(bucket_names))) if micro_step + 1 == accumulation else []
        assert launched == expected, f"step {step}, micro-step {micro_step}: buckets {launched} all-reduced"
    names = [name for names in bucket_names for name in names]
    assert len(names) == len(set(names)) and "wte.weight" in names  # the tied embedding / LM head: one bucket, once


def test_ddp_buckets_of_gpt2_at_the_default_bucket_mb(monkeypatch):
    """GPT-2 124M's gradients at train_ddp.py's default --bucket_mb: the first bucket (the first gradients backward
    produces: ln_f's and the last block's last ones) holds at most 1 MiB, as DistributedDataParallel's first bucket,
    so its all-reduce starts after a few gradients and overlaps the rest of backward (the tests above run under that
    cap, where it changes nothing). Each bucket closes only when the next gradient would take it past its cap, every
    parameter once, in backward's order; a parameter larger than the cap (the tied embedding) fills a bucket alone."""
    parsers, real_get_parser = [], training.get_parser
    monkeypatch.setattr(training, "get_parser", lambda *args: parsers.append(real_get_parser(*args)) or parsers[-1])
    with pytest.raises(SystemExit):
        train_ddp.main(["--help"])
    bucket_mb = parsers[0].get_default("bucket_mb")
    with torch.device("meta"):
        named = list(gpt.GPT(gpt.make_config("gpt2", 50257, 1024)).named_parameters())
    buckets = train_ddp.assign_buckets(named, bucket_mb)
    mib = [sum(param.numel() * param.element_size() for _, param in bucket) / 2**20 for bucket in buckets]
    print(f"--bucket_mb {bucket_mb}: {len(buckets)} buckets, the first {mib[0]:.3f} MiB, the largest {max(mib):.1f}")
    assert [name for bucket in buckets for name, _ in bucket] == [name for name, _ in reversed(named)]
    caps = [1] + [bucket_mb] * (len(buckets) - 1)
    for bucket, size, cap, following in zip(buckets, mib, caps, buckets[1:] + [None]):
        assert size <= cap or len(bucket) == 1, f"a bucket of {size:.2f} MiB under a cap of {cap} MiB"
        if following:  # closed only when the next gradient would not fit
            assert size + following[0][1].numel() * following[0][1].element_size() / 2**20 > cap
    assert mib[0] <= 1 and bucket_mb == 25


# ------------------------------------------------------------------------------------------------------------
# DataParallel on a module that is not a GPT


class Net(nn.Module):
    """Not a GPT: tied weights (decoder.weight is encoder.weight), a frozen layer, a buffer, and optionally a
    layer that forward never uses."""

    def __init__(self, with_unused=False):
        super().__init__()
        self.encoder = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8).requires_grad_(False)
        self.decoder = nn.Linear(8, 8)
        self.decoder.weight = self.encoder.weight
        self.register_buffer("scale", torch.rand(8))
        self.unused = nn.Linear(8, 8) if with_unused else None

    def forward(self, x):
        h = torch.tanh(self.frozen(torch.tanh(self.encoder(x)) * self.scale))
        return (self.decoder(h) - x).square().mean()


def _wrapper_on_any_module(world_size):
    rank = dist.get_rank()
    torch.manual_seed(rank)  # every rank starts from other weights: the wrapper must broadcast rank 0's
    net = Net()
    torch.manual_seed(0)
    reference = Net()
    frozen_before = reference.frozen.weight.detach().clone()
    model = train_ddp.DataParallel(net, bucket_mb=0.0002)  # 209 bytes: the biases, then encoder.weight
    for (name, mine), theirs in zip(net.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(mine, theirs), f"{name} not broadcast from rank 0"
    bucketed = [name for bucket in model.buckets for name in bucket.names]
    assert sorted(bucketed) == ["decoder.bias", "encoder.bias", "encoder.weight"]
    assert len(model.buckets) == 2
    tied_hook_runs = []  # post-accumulate-grad hooks run once per backward, after both uses have accumulated
    net.encoder.weight.register_post_accumulate_grad_hook(lambda param: tied_hook_runs.append(param.grad.clone()))

    batch = torch.randn(8 * world_size, 8, generator=torch.Generator().manual_seed(5))
    optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], foreach=True)
    reference_optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], foreach=True)
    for step in range(2):
        rows = batch[rank * 8:(rank + 1) * 8]
        with model.no_sync():
            (model(rows[:4]) / 2).backward()
        (model(rows[4:]) / 2).backward()
        reference(batch).backward()  # the whole global batch on one process
        for name, param in net.named_parameters():
            if not param.requires_grad:
                assert param.grad is None, name
                continue
            expected = dict(reference.named_parameters())[name].grad
            torch.testing.assert_close(param.grad, expected, rtol=1e-5, atol=1e-7, msg=name)
            bucket = next(b for b in model.buckets if name in b.names)
            offset = param.grad.data_ptr() - bucket.buffer.data_ptr()
            assert 0 <= offset < bucket.buffer.numel() * bucket.buffer.element_size(), f"{name}.grad not in its bucket"
        optimizer.step()
        optimizer.zero_grad()  # set_to_none=True drops the views: the wrapper must put them back
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    assert torch.equal(net.frozen.weight, frozen_before)
    assert len(tied_hook_runs) == 4  # 2 steps x 2 micro-steps
    return True


def test_ddp_wrapper_on_any_module():
    """Broadcast of parameters and buffers, tied weights in one bucket once, frozen parameters left alone,
    no_sync accumulation, gradients that are views into the buckets, AdamW (foreach) and zero_grad(set_to_none)."""
    assert run_distributed(2, _wrapper_on_any_module, 2) == [True, True]


def _backward_with_unused_parameter():
    model = train_ddp.DataParallel(Net(with_unused=True))
    model(torch.randn(4, 8)).backward()


def test_ddp_unused_parameter_is_named():
    with pytest.raises(pytest.fail.Exception, match=r"\['unused.bias', 'unused.weight'\] received no gradient"):
        run_distributed(2, _backward_with_unused_parameter)


def _wrapper_on_subgroups():
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group, in the same order
    torch.manual_seed(rank)
    net = Net()
    model = train_ddp.DataParallel(net, process_group=pairs[rank // 2])
    torch.manual_seed(rank // 2 * 2)
    reference = Net()  # the pair's first rank's weights: ranks 0 and 2 are the sources
    for mine, theirs in zip(net.state_dict().values(), reference.state_dict().values()):
        assert torch.equal(mine, theirs)
    batch = torch.randn(16, 8, generator=torch.Generator().manual_seed(rank // 2))  # a batch per pair
    model(batch[rank % 2 * 8:][:8]).backward()
    reference(batch).backward()
    for param, expected in zip(net.parameters(), reference.parameters()):
        if param.requires_grad:
            torch.testing.assert_close(param.grad, expected.grad, rtol=1e-5, atol=1e-7)
    return True


def test_ddp_wrapper_on_subgroups():
    """process_group: two pairs of ranks, each broadcast from its own first rank and averaged only within itself,
    as train_2d.py's data-parallel groups would use it."""
    assert run_distributed(4, _wrapper_on_subgroups) == [True] * 4


@launches_its_own_ranks
def test_bench_measures_what_ddp_sends(corpus, tmp_path):
    """bench.py end to end (no timing asserted): the all-reduce bytes it reads from the profiler for one step of
    either DDP equal the ring formula, 2 (N-1)/N x the gradient bytes, give or take the logged loss's 4 bytes."""
    result_path = tmp_path / "bench.json"
    subprocess.run([sys.executable, "bench.py", "--strategies", "ddp", "--steps", "8", "--warmup", "2", "--rounds", "1",
                    "--data", corpus, "--block_size", "32", "--json", str(result_path)],
                   cwd=HERE, check=True, capture_output=True, timeout=300)
    rows = {(row["strategy"], row["impl"]): row for row in json.loads(result_path.read_text())}
    with torch.device("meta"):
        gradient_bytes = 4 * gpt.GPT(gpt.make_config("tiny", 256, 32)).num_params()
    for impl in ("ours", "torch"):
        assert rows["ddp", impl]["comm_bytes"] == pytest.approx(2 * (2 - 1) / 2 * gradient_bytes, abs=64)
        assert rows["ddp", impl]["tokens_per_s"] > 0


@launches_its_own_ranks
def test_bench_measures_what_checkpointing_saves(corpus, tmp_path):
    """bench.py --checkpointing end to end (no timing asserted): for each strategy, the bytes the first micro-batch
    saved for backward, measured in the run, without and with --activation_checkpointing, equal the plan's."""
    result_path = tmp_path / "bench.json"
    subprocess.run([sys.executable, "bench.py", "--checkpointing", "--strategies", "single,fsdp", "--steps", "4",
                    "--warmup", "1", "--rounds", "1", "--data", corpus, "--block_size", "32", "--json",
                    str(result_path)], cwd=HERE, check=True, capture_output=True, timeout=300)
    config = gpt.make_config("tiny", 256, 32)
    for row, (dp, micro_batch) in zip(json.loads(result_path.read_text()), [(1, 16), (2, 8)]):
        for checkpointing, run in ((False, row["without"]), (True, row["activation_checkpointing"])):
            layout = plan.Layout(row["strategy"], dp, dp, 1, micro_batch, activation_checkpointing=checkpointing)
            planned = sum(size for item, size in plan.plan_memory(config, layout, **bench.STRATEGY_CODE)
                          if item.startswith(("activations", "embeddings", "loss")))
            assert run["activation_bytes"] == pytest.approx(planned, rel=1e-3) and run["tokens_per_s"] > 0


def test_bench_what_fits_prints_the_planners_table(capsys):
    """python bench.py --what_fits: plan.what_fits's table, with the strategies' own units and slices."""
    bench.main(["--what_fits", "--micro_batch", "8"])
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| model | parameters | context | 8 GPUs | 8 GPUs, AC | 64 GPUs | 64 GPUs, AC |")
    rows = {line.split(" | ")[0].strip("| "): line for line in table[2:]}
    assert set(rows) == set(plan.FITS_PRESETS)
    assert "| gpt2 | 124M | 1024 | ddp (" in rows["gpt2"] and rows["gpt3-175b"].count("none") == 3


# bench.py's name -> (script, ranks, flags, dtype, plan.comm_formula's layout); accumulation 2 where it can be
COMM_LAYOUTS = {
    "ddp": ("train_ddp.py", 2, ["--micro_batch", "2"], "float32", dict(dp=2, micro_batch=2)),
    "fsdp": ("train_fsdp.py", 2, ["--micro_batch", "2"], "float32", dict(dp=2, micro_batch=2)),
    "tp": ("train_tp.py", 2, ["--micro_batch", "4"], "float32", dict(tp=2, micro_batch=4)),
    "tp_sequence_parallel": ("train_tp.py", 2, ["--micro_batch", "4", "--sequence_parallel"], "bfloat16",
                             dict(tp=2, micro_batch=4, sequence_parallel=True)),
    "tp_no_loss_parallel": ("train_tp.py", 2, ["--no_loss_parallel"], "float32", dict(tp=2, loss_parallel=False)),
    "2d": ("train_2d.py", 4, ["--tp", "2", "--dp", "2", "--micro_batch", "2", "--sequence_parallel"], "bfloat16",
           dict(tp=2, dp=2, micro_batch=2, sequence_parallel=True)),
    "cp_ring": ("train_cp.py", 2, ["--micro_batch", "2", "--cp", "2", "--cp_impl", "ring"], "float32",
                dict(cp=2, micro_batch=2, cp_impl="ring")),
}


@launches_its_own_ranks
@pytest.mark.parametrize("strategy, model, dtype",
                         [pytest.param(name, "tiny", None, id=name) for name in COMM_LAYOUTS]
                         + [pytest.param(name, "tiny", "bfloat16", id=f"{name}-bfloat16") for name in ("ddp", "fsdp")]
                         + [pytest.param("2d", "llama-tiny", "float32", id="2d-llama-tiny")])
def test_bench_formula_counts_every_collective(strategy, model, dtype, corpus, tmp_path):
    """What one step of our strategy sends, read from the profiler by bench.py, is its formula: the same number of
    collectives, and the bytes within 1% (measured: equal to the byte, but for 6 bytes in train_2d.py's gradient
    norm and step agreement, which bench counts in groups of 2 but run over all 4 ranks). The count catches a
    collective the formula leaves out, however small (the logged loss's 4 bytes). In bfloat16 (TP and 2-D, with
    sequence parallelism) the formula counts 2 bytes an element for every activation collective, forward and
    backward, but the embedding's g and its conjugate, which carry the float32 residual stream: f sending a layer
    norm's float32 output as it is, or the embedding's g casting, would miss it. Under --dtype bfloat16 DDP's buckets
    and FSDP's reduce-scatters still carry float32 gradients while FSDP gathers the blocks' matrices in bfloat16 and
    the embeddings and norm gains in float32: a gradient reduced in bf16, or every unit gathered in bf16, would send
    other bytes than the formula counts. On Llama's 2-D layout too: FSDP gathers the narrower key/value projections, the gate and the
    untied head; tensor parallelism's collectives carry the residual stream, as wide as GPT-2's. The context-parallel
    ring: three sends (and three receives) a layer and micro-step, then the gradients' all-reduce over every rank."""
    script, ranks, extra, default_dtype, layout = COMM_LAYOUTS[strategy]
    dtype = dtype or default_dtype
    args = argparse.Namespace(model=model, data=corpus, block_size=32, steps=3, warmup=0, device="cpu",
                              dtype=dtype, compile=False, threads=1)
    row = bench.run_once(args, strategy, script, ranks, extra, "ours", 2, 8, str(tmp_path))
    terms = plan.comm_formula(strategy.split("_")[0], gpt.make_config(model, 256, 32), 8, dtype=dtype,
                              backend="gloo", buckets=train_ddp.assign_buckets, **bench.STRATEGY_CODE, **layout)
    assert row["collectives"] == sum(term.count for term in terms), terms
    assert row["comm_bytes"] == pytest.approx(sum(term.bytes for term in terms), rel=0.01), terms


@launches_its_own_ranks
@pytest.mark.parametrize("model", ["tiny", "llama-tiny"])
def test_figures_are_drawn_from_real_runs(corpus, tmp_path, monkeypatch, model):
    """figures.py, small (2 layouts, 3 steps, block 32, DDP's bytes alone): every PNG is written, with the numbers
    behind them, and those numbers are the runs' (DDP's loss is single's, its bytes its formula). With --model
    llama-tiny the runs train Llama 3's shape and the memory figure plans Llama 3.1 8B."""
    pytest.importorskip("matplotlib")
    import figures

    monkeypatch.setattr(figures, "LOSS_RUNS", figures.LOSS_RUNS[:2])  # single and DDP: all six take minutes
    monkeypatch.setattr(figures, "COMM_STRATEGIES", ["ddp"])
    monkeypatch.setattr(figures, "COMM_IMPLS", ["ours"])
    monkeypatch.setattr(figures, "QUICK_START", figures.QUICK_START[:2])  # the drift figure's runs, made here
    runs = tmp_path / "quick_start"
    train_single.main(flags(corpus, runs / "single", max_steps=3))
    run_distributed(2, train_ddp.main, flags(corpus, runs / "ddp", max_steps=3))
    figures.main(["--model", model, "--steps", "3", "--block_size", "32", "--data", corpus, "--out_dir", str(tmp_path / "figures"),
                  "--quick_start", str(runs)])
    pictures = {"losses.png", "comm_bytes.png", "pipeline.png", "drift.png"}
    pictures |= {f"layout_{strategy}.png" for strategy in figures.LAYOUTS}
    assert pictures | {"figures.json"} <= set(os.listdir(tmp_path / "figures"))
    assert all((tmp_path / "figures" / name).read_bytes()[:4] == b"\x89PNG" for name in pictures)
    numbers = json.loads((tmp_path / "figures" / "figures.json").read_text())
    assert len(numbers["losses"]["DDP"]) == 3 and numbers["max_loss_difference"]["DDP"] < 1e-5
    drift = numbers["quick_start_summary"]["DDP"]
    assert drift["final_step"] == 2 and drift["largest_difference"] < 1e-5 and drift["val_loss"] > 0
    ddp = numbers["comm_bytes"]["ddp"]
    assert ddp["ours"] == pytest.approx(sum(size for _, _, size in ddp["terms"]), rel=0.01)
    assert any(label.startswith("2-D + SP\ntp 8") for label in numbers["memory"]) == (model == "llama-tiny")


def test_bench_classifies_collectives_of_both_backends():
    """Profiler record names differ by backend (and by torch version); each maps to its kind, and a name the bench
    does not know fails loudly instead of being counted as some other collective's bytes."""
    import bench

    names = {"gloo:all_reduce": "all_reduce", "gloo:all_gather": "all_gather", "gloo:_allgather_base": "all_gather",
             "gloo:reduce_scatter": "reduce_scatter", "gloo:_reduce_scatter_base": "reduce_scatter",
             "gloo:broadcast": "broadcast", "gloo:barrier": "barrier", "nccl:all_reduce": "all_reduce",
             "nccl:_allgather_base": "all_gather", "nccl:all_gather_into_tensor_coalesced": "all_gather",
             "nccl:_reduce_scatter_base": "reduce_scatter", "nccl:reduce_scatter_tensor_coalesced": "reduce_scatter",
             "nccl:allreduce_coalesced": "all_reduce", "nccl:all_reduce_barrier": "barrier",
             "nccl:broadcast": "broadcast", "nccl:all_to_all": "all_to_all", "nccl:send": "send"}
    assert {name: bench.collective_kind(name) for name in names} == names
    with pytest.raises(ValueError, match="cannot classify"):
        bench.collective_kind("nccl:all_permute")
    assert plan.wire_bytes("all_reduce", 100, 4) == 150 and plan.wire_bytes("all_gather", 100, 4) == 300
    assert plan.wire_bytes("reduce_scatter", 100, 4) == 75 and plan.wire_bytes("barrier", 4, 4) == 0


# ------------------------------------------------------------------------------------------------------------
# gpu_check.py: a GPU machine's first check, dry on CPU

GPU_CHECK_ROWS = ["machine", "headline", "reference: train_single.py float32", "train_single.py", "train_ddp.py",
                  "train_fsdp.py", "train_tp.py --tp 1", "train_tp.py --tp 1 --sequence_parallel",
                  "train_2d.py --tp 1 --dp 1", "train_pp.py --pp 1", "train_cp.py --cp 1",
                  "train_cp.py --cp 1 --cp_impl ring", "train_cp.py --cp 1 --impl torch", "train_4d.py",
                  "moe-tiny: reference: train_single.py float32", "moe-tiny: train_single.py",
                  "moe-tiny: train_ep.py --ep 1", "moe-tiny: train_fsdp.py", "activation checkpointing"]
H200 = dict(name="NVIDIA H200", total_memory=150_000_000_000)  # about 139 GiB


@pytest.fixture
def gpu_machine_lacks(tmp_path):
    """A PYTHONPATH folder on which datasets, flash_attn and tiktoken fail to import, as on the GPU machine
    (tiktoken is there but cannot reach the network for its files)."""
    folder = tmp_path / "lacks"
    for name in ("datasets", "flash_attn", "tiktoken"):
        (folder / name).mkdir(parents=True)
        (folder / name / "__init__.py").write_text(f"raise ImportError('the GPU machine has no {name}')\n")
    return str(folder)


def _gpu_check(argv, path, monkeypatch, launch):
    """gpu_check.main(argv + --json path) with bench.launch replaced by launch(real_launch, *its arguments); returns
    the rows read back from --json and, for each row, whether the file's last line was that row the moment it was
    reported."""
    real_launch, real_report, on_disk = bench.launch, gpu_check.Check.report, []

    def report(self, row):
        real_report(self, row)
        on_disk.append(json.loads(path.read_text().splitlines()[-1]) == json.loads(json.dumps(row)))
        return row

    monkeypatch.setattr(bench, "launch", lambda *args, **kwargs: launch(real_launch, *args, **kwargs))
    monkeypatch.setattr(gpu_check.Check, "report", report)
    try:
        gpu_check.main(argv + ["--json", str(path)])
    finally:
        rows = [json.loads(line) for line in path.read_text().splitlines()]
    return rows, on_disk


def test_gpu_check_reports_each_row_before_the_next_run(corpus, tmp_path, monkeypatch):
    """--device cuda's command lines, run by a launcher that starts nothing (each run "trains" 4 steps of a falling
    loss): the headline first, GPT-2 124M at block 1024 in bf16 + --compile at the planner's micro-batch for an
    H200; then the float32 reference and every script in bf16 + --compile; then activation checkpointing and
    gpt2-medium. Each row is in --json when it is reported, before the next run starts; every run shares one
    inductor cache; the summary counts what a GPU run would start: 19 processes, 17 of them compiling."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: argparse.Namespace(**H200))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: H200["name"])
    path, runs = tmp_path / "gpu.json", []

    def launch(real_launch, script, flags, out_dir, ranks=1, threads=1, env=None, timeout=None):
        runs.append(dict(command=[script, *flags], env=env, rows=len(path.read_text().splitlines())))
        records = [dict(step=step, loss=5.0 - 0.1 * step, tokens_per_s=1e5, mfu=0.4, step_ms=100.0, peak_mem_mb=1e4)
                   for step in range(4)]
        return records, ""

    rows, on_disk = _gpu_check(["--device", "cuda", "--data", corpus, "--steps", "4"], path, monkeypatch, launch)
    assert [row["row"] for row in rows] == GPU_CHECK_ROWS + ["larger: gpt2-medium", "summary"], rows
    assert all(row["status"] == "ok" for row in rows) and all(on_disk), rows
    assert [run["rows"] for run in runs] == list(range(1, 20))  # every row known was on disk before the next run
    assert len({run["env"]["TORCHINDUCTOR_CACHE_DIR"] for run in runs}) == 1
    layout = plan.Layout("single", 1, 1, 1, 0, "bfloat16", device="cuda")
    for row, preset in ((rows[1], "gpt2"), (rows[-2], "gpt2-medium")):
        config = gpt.make_config(preset, 50257, 1024)
        assert row["micro_batch"] == gpu_check.planned_micro_batch(config, layout, H200["total_memory"]) == 64
        assert row["model"] == preset and row["block_size"] == 1024 and row["mfu"] == 0.4
    headline, reference = runs[0]["command"], runs[1]["command"]
    assert headline[0] == "train_single.py" and "--compile" in headline and "bfloat16" in headline
    assert "--compile" not in reference and reference[reference.index("--dtype") + 1] == "float32"
    assert all(" ".join(gpu_check.STABLE_LR) in " ".join(run["command"]) for run in runs[1:-2])
    assert "--lr" not in headline and all(row["at_step"] == 0 for row in rows[3:-3] if "reference" not in row["row"])
    assert "--activation_checkpointing" in runs[-2]["command"] and rows[-3]["micro_batch"] == 64
    assert rows[-1]["processes"] == 19 and rows[-1]["compiled"] == 17 and rows[-1]["not_run"] == []


def test_gpu_check_names_the_error_that_ended_a_run():
    """A failed run's row names its last exception: Python's, under torchrun's rank prefix, or the message of a C++
    one that aborted the process (not the first frame of its stack, nor torchrun's ChildFailedError)."""
    aborted = ("terminate called after throwing an instance of 'c10::Error'\n  what():  CUDA error: an illegal memory "
               "access was encountered\nException raised from c10_cuda_check_implementation (most recent call first)"
               ":\nframe #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d\n"
               "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n  traceback : Signal 6 (SIGABRT)")
    assert gpu_check.error_of(aborted) == "what():  CUDA error: an illegal memory access was encountered"
    assert gpu_check.error_of("RuntimeError: first\n[rank0]: ValueError: last\nexit") == "[rank0]: ValueError: last"
    assert gpu_check.error_of("usage: x\nerror: unrecognized arguments: --foo") == "error: unrecognized arguments: --foo"


@launches_its_own_ranks
def test_gpu_check_stops_at_its_budget(corpus, tmp_path, monkeypatch, gpu_machine_lacks):
    """--budget_s 0 on CPU: the headline runs, for real and without datasets, flash_attn or tiktoken (halved once
    after its first run fails as a CUDA run out of memory would), and no run starts after it; every row left is
    reported, in order, saying it was not run, and the summary lists them."""
    monkeypatch.setenv("PYTHONPATH", gpu_machine_lacks)
    path, runs = tmp_path / "gpu.json", []

    def launch(real_launch, *args, **kwargs):
        runs.append(len(path.read_text().splitlines()))
        if len(runs) == 1:
            return None, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
        return real_launch(*args, **kwargs)

    argv = ["--device", "cpu", "--data", corpus, "--steps", "2", "--block_size", "32", "--global_batch", "4",
            "--gpu_memory", "0.3", "--budget_s", "0"]
    rows, on_disk = _gpu_check(argv, path, monkeypatch, launch)
    assert [row["row"] for row in rows] == GPU_CHECK_ROWS + ["larger: tiny", "summary"] and all(on_disk), rows
    assert runs == [1, 1]
    headline = rows[1]
    assert headline["status"] == "ok" and headline["tokens_per_s"] > 0 and headline["mfu"] is None, headline
    assert headline["out_of_memory_at_micro_batch"] == 4 and headline["micro_batch"] == 2
    assert all(row["status"] == "not run: the 0 s budget was spent" for row in rows[2:-1]), rows
    assert rows[-1]["not_run"] == GPU_CHECK_ROWS[2:] + ["larger: tiny"] and rows[-1]["processes"] == 2


@launches_its_own_ranks
def test_bench_forwards_gpu_check_which_imports_nothing_the_gpu_machine_lacks(gpu_machine_lacks):
    """python bench.py --gpu_check runs gpu_check.py with the other flags; neither it nor a script it runs needs
    datasets, flash_attn or tiktoken at import."""
    code = "import sys, bench, train_single, train_2d, train_pp; bench.main(['--gpu_check', '--help'])"
    result = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, PYTHONPATH=gpu_machine_lacks, COLUMNS="120"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "usage: gpu_check.py" in result.stdout and "A GPU machine's first check" in result.stdout


def test_bench_forwards_pipeline_to_bench_pipeline():
    """python bench.py --pipeline runs bench_pipeline.py with the other flags: a file of its own, which imports
    bench.py's launcher and flags, so bench.py starts it as a process rather than importing it back."""
    result = subprocess.run([sys.executable, "bench.py", "--pipeline", "--help"], cwd=HERE, capture_output=True,
                            text=True, timeout=120, env=dict(os.environ, COLUMNS="120"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "usage: bench_pipeline.py" in result.stdout and "--micro_batch MICRO_BATCH" in result.stdout


# ------------------------------------------------------------------------------------------------------------
# train_zero.py: ZeRO-1 and ZeRO-2 on train_ddp.py's buckets


_zero_runs = {}


PROFILED_STEP = 4  # of flags()' 6: no validation, no checkpoint; the loss and stop all-reduces of the step before


def _profiled(main, argv):
    """main(argv) on this rank under bench.profiled: (the collectives of step PROFILED_STEP, what the rank held)."""
    with one_thread():
        return bench.profiled(main, argv, PROFILED_STEP)




def zero_run(corpus, tmp_path_factory, world_size, **overrides):
    """train_zero.py on world_size ranks, once per distinct flags per session: (read_run's result, each rank's
    collectives of one step and what it held after its first step, as bench.py counts them)."""
    key = (world_size, tuple(sorted(overrides.items())))
    if key not in _zero_runs:
        out_dir = shared_folder(tmp_path_factory, "zero")
        ranks = run_distributed(world_size, _profiled, train_zero.main, flags(corpus, out_dir, **overrides))
        _zero_runs[key] = read_run(str(out_dir)), ranks
    return _zero_runs[key]


def assert_sends_its_formula(collectives, terms, group_size):
    """One step's collectives, as bench.py counts them, against plan.comm_formula's: the same number, the same
    bytes (each counted over group_size ranks)."""
    sent = sum(plan.wire_bytes(c["kind"], c["bytes"], group_size) for c in collectives)
    print(f"{len(collectives)} collectives, {sent:,.0f} bytes; formula {sum(t.count for t in terms)}, "
          f"{sum(t.bytes for t in terms):,.0f}")
    assert len(collectives) == sum(term.count for term in terms), terms
    return sent


ZERO_LAYOUTS = pytest.mark.parametrize("stage, impl", [(1, "ours"), (2, "ours"), (1, "torch")])  # torch: no ZeRO-2


@ZERO_LAYOUTS
def test_zero_matches_single(corpus, tmp_path_factory, stage, impl):
    """4 ranks, accumulation 2, clipping active: ZeRO-1 and ZeRO-2, and DDP with PyTorch's ZeroRedundancyOptimizer,
    compute what one device computes; stage 2 reduce-scatters in both micro-steps, its slices adding up."""
    run, _ = zero_run(corpus, tmp_path_factory, 4, stage=stage, impl=impl)
    assert_runs_match(run, single_run(corpus, tmp_path_factory))


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_holds_one_nth_of_the_moments_and_stage_2_of_the_gradients(corpus, tmp_path_factory, stage):
    """After a step of the 4-rank runs above, each rank holds the whole weights (4 bytes an element of the padded
    buckets), AdamW's moments only for its slices (8 bytes an element of its pieces, and a 4-byte step a piece: the
    ranks' moments together are the model's once), and the averaged gradient whole (stage 1) or only its slices
    (stage 2: 4 bytes an element of 1/N of the padded buckets). The plan gives each (AdamW: the rank that holds most)."""
    _, ranks = zero_run(corpus, tmp_path_factory, 4, stage=stage, impl="ours")
    held = [held for _, held in ranks]
    config = gpt.make_config("tiny", 256, 32)
    layout = plan.Layout("zero", 4, 4, 1, 2, stage=stage)
    padded, slices = plan.zero_buckets(config, layout, train_ddp.assign_buckets)
    num_params = plan.model_on_meta(config).num_params()
    moments = [rank["optimizer"] - 4 * pieces for rank, (_, pieces) in zip(held, slices)]
    print(f"ZeRO-{stage}: moments per rank {moments} bytes, of {8 * num_params}; buckets {padded} elements")
    assert sum(moments) == 8 * num_params and moments == [8 * elements for elements, _ in slices]
    assert max(moments) == 8 * sum(padded) // 4 and sum(padded) - num_params < 4 * len(padded)
    gradients = 4 * sum(padded) // (1 if stage == 1 else 4)
    assert all((rank["parameters"], rank["gradients"]) == (4 * sum(padded), gradients) for rank in held), held
    rows = dict(plan.plan_memory(config, layout, buckets=train_ddp.assign_buckets))
    planned = lambda prefix: sum(size for item, size in rows.items() if item.startswith(prefix))  # noqa: E731
    assert (planned("parameters"), planned("gradients"), planned("AdamW")) == (
        4 * sum(padded), gradients, max(rank["optimizer"] for rank in held))


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_sends_its_formula(corpus, tmp_path_factory, stage):
    """One step of the 4-rank runs above (accumulation 2), read from torch.profiler as bench.py reads it: stage 1
    all-reduces each bucket once, stage 2 reduce-scatters each in both micro-steps (gloo: an all-reduce of the whole
    bucket); both all-gather the slices once, and all-reduce the gradient norm, the logged loss and whether to stop.
    The same collectives as plan.comm_formula, and the same bytes, to the byte."""
    _, ranks = zero_run(corpus, tmp_path_factory, 4, stage=stage, impl="ours")
    formula = functools.partial(plan.comm_formula, config=gpt.make_config("tiny", 256, 32), global_batch=16,
                                micro_batch=2, dp=4, stage=stage, buckets=train_ddp.assign_buckets)
    terms = formula("zero")
    assert assert_sends_its_formula(ranks[0][0], terms, 4) == sum(term.bytes for term in terms)
    # On NCCL (gloo's reduce-scatter is an all-reduce): the buckets' reduce-scatters and all-gather send DDP's
    # 2(N-1)/N · 4Ψ at stage 1, the paper's, and (k + 1)(N-1)/N · 4Ψ at stage 2, k = 2; padding aside (< 4 elements).
    buckets = sum(t.bytes for t in formula("zero", backend="nccl") if t.kind in ("reduce_scatter", "all_gather"))
    ddp = next(t.bytes for t in formula("ddp", backend="nccl") if t.what.startswith("gradient buckets"))
    assert buckets == pytest.approx(ddp * (1 if stage == 1 else 1.5), rel=1e-4)


def _zero_on_any_module(stage):
    """Net (tied weights, a frozen layer, a buffer) under ZeRO on this rank, 2 steps of 2 micro-steps, against the
    whole module on the whole batch with AdamW: its weights, moments and what it holds."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)  # every rank starts from other weights: the wrapper must broadcast rank 0's
    net = Net()
    torch.manual_seed(0)
    reference = Net()
    model = (train_zero.ZeroStage1 if stage == 1 else train_zero.ZeroStage2)(net)  # one bucket of 80 elements
    decayed, not_decayed = model.parameter_groups()
    optimizer = torch.optim.AdamW([{"params": decayed, "weight_decay": 0.5}, {"params": not_decayed, "weight_decay": 0}],
                                  lr=0.01)
    trained = [p for p in reference.parameters() if p.requires_grad]
    reference_optimizer = torch.optim.AdamW([{"params": [p for p in trained if p.dim() >= 2], "weight_decay": 0.5},
                                             {"params": [p for p in trained if p.dim() < 2], "weight_decay": 0}],
                                            lr=0.01)
    batch = torch.randn(4 * world_size, 8, generator=torch.Generator().manual_seed(5))
    whole_buckets_left, norms = [], []
    with RecordCollectives() as collectives:
        for step in range(2):
            rows = batch[4 * rank:4 * rank + 4]
            with model.no_sync():  # stage 1: accumulates; stage 2: keeps its whole bucket across the micro-steps
                (model(rows[:2]) / 2).backward()
            (model(rows[2:]) / 2).backward()
            whole_buckets_left.append(sum(bucket.buffer.untyped_storage().nbytes() for bucket in model.buckets))
            reference(batch).backward()  # the whole global batch on one process
            norms.append((model.clip_grad_norm_(CLIPPED).item(),
                          torch.nn.utils.clip_grad_norm_(trained, CLIPPED).item()))
            optimizer.step()
            model.gather_parameters()
            model.zero_grad(set_to_none=False)
            reference_optimizer.step()
            reference_optimizer.zero_grad()
    weights = {name: param.detach().numpy().copy() for name, param in net.named_parameters()}
    expected = {name: param.detach().numpy().copy() for name, param in reference.named_parameters()}
    moments = sum(t.numel() for state in optimizer.state.values() for key, t in state.items() if key != "step")
    gradients = sum(bucket.gradient_slice.numel() for bucket in model.buckets)
    return (weights, expected, moments, gradients, whole_buckets_left, [b.buffer.numel() for b in model.buckets], norms,
            collectives.names)


class RecordCollectives(TorchDispatchMode):
    """The name of every c10d operation run while active, in order: the function called, where gloo's profiler
    records a reduce-scatter as an all-reduce."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


CLIPPED = 0.05  # below Net's gradient norms (0.2-0.3): clipping acts on every step


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_on_an_uneven_bucket_that_mixes_decayed_and_undecayed_parameters(stage):
    """Net's 80 trainable elements in one bucket over 3 ranks: padded to 81, slices of 27; rank 0's holds both
    biases (no decay) and 11 elements of the tied matrix (decay 0.5). Two steps of two micro-steps (the first inside
    no_sync), clipped, equal AdamW on the whole module and batch; the moments cover each element once; stage 2 holds
    its slice of the gradient alone, and no whole bucket outlives backward. A step reduce-scatters the bucket once,
    in the last micro-step, all-reduces the norm's square and all-gathers the weights: stage 1 all-reduces no bucket."""
    results = run_distributed(3, _zero_on_any_module, stage)
    for weights, expected, moments, gradients, whole, sizes, norms, collectives in results:
        assert collectives == 2 * ["_reduce_scatter_base_", "allreduce_", "_allgather_base_"]
        assert sizes == [81] and gradients == 27
        assert whole == ([0, 0] if stage == 2 else [4 * 81] * 2)
        np.testing.assert_allclose(*zip(*norms), rtol=1e-5)
        assert min(norm for _, norm in norms) > CLIPPED
        for name in expected:
            np.testing.assert_allclose(weights[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert [moments for _, _, moments, *_ in results] == [2 * 27, 2 * 27, 2 * 26]  # exp_avg and exp_avg_sq


@launches_its_own_ranks  # 2, 4 and 2 ranks in turn
def test_zero_and_hsdp_resume_from_and_into_other_layouts(corpus, shared_tmp, tmp_path_factory):
    """One run of 6 steps, checkpointed every 2: ZeRO-2 on 2 ranks (each rank writes its slices, their moments
    with them) crashes at step 3; HSDP, 2 copies of 2 shards (the first copy writes), resumes from step 2 and
    crashes at step 5; ZeRO-1 on 2 ranks resumes from step 4 and finishes: train_single's 6 steps."""
    argv = lambda **layout: flags(corpus, shared_tmp, ckpt_interval=2, **layout)  # noqa: E731
    assert run_distributed(2, _train_until, train_zero.main, 3, argv(stage=2)) == ["crashed"] * 2
    assert run_distributed(4, _train_until, train_fsdp.main, 5, argv(replicate=2, resume=True)) == ["crashed"] * 4
    run_distributed(2, train_zero.main, argv(stage=1, resume=True))
    assert checkpoint.latest(str(shared_tmp)).endswith("ckpt-0000006")
    assert_runs_match(read_run(str(shared_tmp)), single_run(corpus, tmp_path_factory))


# ------------------------------------------------------------------------------------------------------------
# train_fsdp.py


def _train_counting_gathers(main, argv):
    """main(argv) on this rank; returns, for each batch it draws, (split, the all-gathers it issued from that batch
    until the next): the forward and backward of a training micro-step, or a validation forward; and main's result."""
    batches = []
    real_gather, real_get = train_fsdp.all_gather_single, training.BatchSampler.get

    def gather(*args, **kwargs):
        batches[-1][1] += 1
        return real_gather(*args, **kwargs)

    def get(sampler, step, micro_step):
        batches.append([("train", "val")[sampler.split], 0])
        return real_get(sampler, step, micro_step)

    train_fsdp.all_gather_single, training.BatchSampler.get = gather, get
    try:
        result = main(argv)
    finally:
        train_fsdp.all_gather_single, training.BatchSampler.get = real_gather, real_get
    return [tuple(batch) for batch in batches], result


_fsdp_runs = {}


def fsdp_run(corpus, tmp_path_factory, world_size, **overrides):
    """train_fsdp.py on world_size ranks, once per distinct flags per session: (read_run's result, rank 0's
    all-gathers per batch); _fsdp_runs keeps HSDP's collectives of step PROFILED_STEP too."""
    key = (world_size, tuple(sorted(overrides.items())))
    if key not in _fsdp_runs:
        out_dir = shared_folder(tmp_path_factory, "fsdp")
        argv = flags(corpus, out_dir, **overrides)
        # HSDP's bytes are held to its formula here (test_hsdp_sends_its_formula), FSDP's through bench.py
        main = partial(_profiled, train_fsdp.main) if overrides.get("replicate", 1) > 1 else train_fsdp.main
        gathers, profiled = run_distributed(world_size, _train_counting_gathers, main, argv)[0]
        _fsdp_runs[key] = read_run(str(out_dir)), gathers, profiled[0] if profiled else None
    return _fsdp_runs[key][:2]


FSDP_LAYOUTS = pytest.mark.parametrize("world_size, strategy", [
    (2, {}),
    (3, dict(global_batch=12)),  # 16 rows do not split over 3 ranks; the flat parameters of biases and norms pad
    (4, dict(no_reshard=True, no_deferred_init=True)),
    (4, dict(replicate=2)),  # HSDP: 2 copies of 2 shards
])


@FSDP_LAYOUTS
def test_fsdp_matches_single(corpus, tmp_path_factory, world_size, strategy):
    """2, 3 and 4 ranks, accumulation 4, 2 and 2, clipping active: ZeRO-3 computes what one device computes, with
    uneven shards too, and so does HSDP (4 ranks: 2 copies of 2 shards; the shards' gradients averaged over both)."""
    run, _ = fsdp_run(corpus, tmp_path_factory, world_size, **strategy)
    batch = {key: value for key, value in strategy.items() if key == "global_batch"}
    assert_runs_match(run, single_run(corpus, tmp_path_factory, **batch))


FLAT_PARAMETERS, OF_THE_ROOT = 2 * (1 + 4), 2  # the tiny model: decayed and not decayed, in the root and 4 blocks


@FSDP_LAYOUTS
def test_fsdp_gathers_each_flat_parameter_once_or_twice(corpus, tmp_path_factory, world_size, strategy):
    """All-gathers in each training micro-step: every flat parameter once for forward, and, resharded after
    forward (the default), every block's again for backward, the root staying gathered from its forward to its
    backward: 2 x 10 - 2 = 18; --no_reshard keeps every unit gathered through backward: 10. Validation: 10."""
    _, gathers = fsdp_run(corpus, tmp_path_factory, world_size, **strategy)
    expected = FLAT_PARAMETERS if strategy.get("no_reshard") else 2 * FLAT_PARAMETERS - OF_THE_ROOT
    assert {count for split, count in gathers if split == "train"} == {expected}, gathers
    assert {count for split, count in gathers if split == "val"} == {FLAT_PARAMETERS}, gathers


@pytest.mark.parametrize("dropout", [0, DROPOUT])
def test_fsdp_ours_matches_fully_shard(corpus, tmp_path_factory, dropout):
    """Ours against PyTorch's FSDP2 on the same flags: both equal to each other, not only to train_single; with
    dropout too, since both draw each rank's masks from its own generator in the same order."""
    extra = dict(dropout=dropout) if dropout else {}  # the runs other tests share
    ours, _ = fsdp_run(corpus, tmp_path_factory, 2, **extra)
    theirs, _ = fsdp_run(corpus, tmp_path_factory, 2, impl="torch", **extra)
    assert_runs_match(ours, theirs)


def test_hsdp_ours_matches_fully_shard_on_a_2d_mesh(corpus, tmp_path_factory):
    """PyTorch's HSDP, fully_shard on a (replicate, shard) DeviceMesh of 2 x 2, on the same flags as ours (4 ranks,
    accumulation 2): both equal train_single, and each other."""
    ours, _ = fsdp_run(corpus, tmp_path_factory, 4, replicate=2)
    theirs, _ = fsdp_run(corpus, tmp_path_factory, 4, replicate=2, impl="torch")
    assert_runs_match(theirs, single_run(corpus, tmp_path_factory))
    assert_runs_match(ours, theirs)


def test_hsdp_sends_its_formula(corpus, tmp_path_factory):
    """One step of HSDP's 4-rank run (2 copies of 2 shards, accumulation 2), read from torch.profiler as bench.py
    reads it: FSDP's all-gathers and reduce-scatters inside each shard group, then each gradient shard all-reduced
    over its copies, as plan.comm_formula counts them. The bytes within 8 of the formula's: the logged loss and the
    stop agreement run over all 4 ranks, counted here in groups of 2."""
    fsdp_run(corpus, tmp_path_factory, 4, replicate=2)
    collectives = _fsdp_runs[4, (("replicate", 2),)][2]
    terms = plan.comm_formula("fsdp", gpt.make_config("tiny", 256, 32), 16, micro_batch=2, dp=4, replicate=2,
                              **bench.STRATEGY_CODE)
    assert abs(assert_sends_its_formula(collectives, terms, 2) - sum(term.bytes for term in terms)) <= 8


def test_fsdp_cpu_offload_matches_single(corpus, tmp_path_factory):
    """--cpu_offload, ours and FSDP2's CPUOffloadPolicy, 2 ranks: shards, gradients and AdamW on the host, AdamW
    stepping there, the units gathered on the device. Here both sides are the CPU, so the copies are CPU to CPU: this
    proves the bookkeeping (every shard to the gather, every gradient back, clipping, micro-steps adding up)."""
    ours, _ = fsdp_run(corpus, tmp_path_factory, 2, cpu_offload=True)
    theirs, _ = fsdp_run(corpus, tmp_path_factory, 2, cpu_offload=True, impl="torch")
    assert_runs_match(ours, single_run(corpus, tmp_path_factory))
    assert_runs_match(theirs, ours)


def test_2d_cpu_offload_matches_single(corpus, tmp_path_factory):
    """train_2d.py --cpu_offload: each rank's FSDP shards of its TP slices on the host, as train_fsdp.py's."""
    run = run_2d(corpus, tmp_path_factory, 4, tp=2, dp=2, sequence_parallel=True, cpu_offload=True)
    assert_runs_match(run, single_run(corpus, tmp_path_factory))


@launches_its_own_ranks  # 2 ranks, then train_single.py in this process
@one_thread()
def test_fsdp_cpu_offload_resumes_in_another_layout(corpus, tmp_path, tmp_path_factory):
    """A checkpoint saved under train_fsdp.py --cpu_offload (shards and AdamW moments on the host) resumes under
    train_single.py and goes on as the unbroken run: the offloaded tensors are saved whole and by name."""
    saved = tmp_path / "offloaded"
    argv = flags(corpus, saved, ckpt_interval=3, cpu_offload=True)
    assert run_distributed(2, _train_until, train_fsdp.main, 4, argv) == ["crashed"] * 2
    train_single.main(flags(corpus, saved, ckpt_interval=3, resume=True))
    assert_runs_match(read_run(str(saved)), single_run(corpus, tmp_path_factory))


@torch.no_grad()
def named_full_parameters(fsdp):
    """(name, full float32 tensor) of every parameter of a FullyShardedDataParallel, gathered one flat buffer at a
    time; every rank must iterate."""
    for flat in fsdp.flats:
        full = torch.empty(flat.shard_size * flat.world, device=flat.shard.device)
        train_fsdp.all_gather_single(full, flat.shard.detach(), group=fsdp.group)
        for param, view in zip(flat.params, flat.views(full)):
            yield param.name, view


def _build(config, seed=5, init_from=None, **groups):
    with torch.device("meta"):
        model = gpt.GPT(config)
    value = training.initial_values(config, seed, init_from)
    with RecordOutputs() as allocations:
        fsdp = train_fsdp.FullyShardedDataParallel(
            model, initial_value=value, **groups)
    return model, fsdp, max(t.numel() for _, t in allocations.outputs if t.device.type != "meta")


def _deferred_init():
    config = gpt.make_config("tiny", vocab_size=256, block_size=32)
    model, fsdp, largest = _build(config)
    full = {name: tensor.numpy() for name, tensor in named_full_parameters(fsdp)}
    return largest, max(flat.shard_size for flat in fsdp.flats), [flat.shard_size * flat.world - flat.padding for flat in fsdp.flats], full


def test_fsdp_deferred_init_holds_one_parameter_at_a_time(corpus):
    """Built on meta, each rank materialises one parameter at a time and keeps its slice: the largest tensor it
    ever creates is one parameter or one of its own shards, never a whole flat parameter, unit or model; the
    shards equal the slices of single-device init."""
    results = run_distributed(2, _deferred_init)
    config = gpt.make_config("tiny", vocab_size=256, block_size=32)
    reference = gpt.GPT(config)
    reference.init_weights(seed=5)
    largest_parameter = max(param.numel() for param in reference.parameters())
    for largest, largest_shard, flat_sizes, full in results:
        print(f"largest tensor created {largest} elements: largest parameter {largest_parameter}, largest shard "
              f"{largest_shard}, largest flat parameter {max(flat_sizes)}, model {reference.num_params()}")
        assert largest <= max(largest_parameter, largest_shard) < max(flat_sizes)
        assert full.keys() == dict(reference.named_parameters()).keys()
        for name, param in reference.named_parameters():
            assert np.array_equal(full[name], param.detach().numpy()), name


def _memory_after_a_step(replicate):
    config = gpt.make_config("tiny", vocab_size=256, block_size=32)
    shard_group, replicate_group = train_fsdp.hybrid_groups(replicate) if replicate > 1 else (None, None)
    model, fsdp, _ = _build(config, process_group=shard_group, replicate_group=replicate_group)
    args = training.get_parser("").parse_args([])
    optimizer = training.make_optimizer(fsdp.parameter_groups(), args, torch.device("cpu"))
    x = torch.randint(0, 256, (2, 32))
    fsdp(x, x).backward()
    fsdp.clip_grad_norm_(1.0)
    optimizer.step()
    tensors = [p for p in fsdp.shards] + [p.grad for p in fsdp.shards]
    tensors += [t for state in optimizer.state.values() for t in state.values() if t.dim() > 0]
    flats = fsdp.flats
    views = list(fsdp.parameters()) == list(fsdp.shards) and not list(model.parameters())
    return (sum(t.numel() * t.element_size() for t in tensors), gpt.GPT(config).num_params(),
            sum(flat.padding for flat in flats), len(flats), sum(flat.is_gathered() for flat in flats), views)


@pytest.mark.parametrize("world_size, replicate", [(2, 1), (3, 1), (4, 2)])
def test_fsdp_memory_is_one_nth(world_size, replicate):
    """After a step, each rank's parameters + gradients + AdamW moments (float32: 4 tensors of 4 bytes an
    element) are exactly 1/N of the unsharded model's, padding aside (3 ranks pad the flat parameters of biases
    and norms); under HSDP 1/S, S = N / replicate the ranks of a shard group; nothing is left gathered."""
    shards = world_size // replicate
    for held, total, padding, flats, gathered, original in run_distributed(world_size, _memory_after_a_step,
                                                                           replicate):
        print(f"{world_size} ranks: {held} bytes held per rank; unsharded model {16 * total}; padding {padding}")
        assert held * shards == 16 * (total + padding)
        assert padding <= (shards - 1) * flats  # each flat parameter pads to a multiple of the shard group's size
        assert padding > 0 or world_size != 3
        assert gathered == 0 and original  # no full copy kept; the shards are the only parameters


def _host_memory_and_clip_temporaries():
    config = gpt.make_config("tiny", vocab_size=256, block_size=32)
    model, fsdp, _ = _build(config, cpu_offload=True)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    fsdp(x, x).backward()
    grads = [shard.grad for shard in fsdp.shards]
    with RecordOutputs() as recorded:
        fsdp.clip_grad_norm_(0.1)  # clips: every gradient scaled in place
    in_place = {grad.untyped_storage().data_ptr() for grad in grads}  # the gradients, their spans (views)
    norms = len(fsdp.gradients())  # one a parameter's span, stacked
    temporaries = [(str(op), t.numel()) for op, t in recorded.outputs
                   if t.numel() > norms and t.untyped_storage().data_ptr() not in in_place]
    storages = [{t.untyped_storage().data_ptr() for t in tensors} for tensors in (fsdp.shards, grads)]
    sizes = [sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
             for tensors in (fsdp.shards, grads)]
    return storages, sizes, 4 * sum(flat.shard_size for flat in fsdp.flats), temporaries


def test_fsdp_cpu_offload_holds_one_arena_of_shards_and_one_of_gradients_and_clips_without_copies():
    """--cpu_offload: every shard is a slice of one host allocation a rank and every gradient of another, each
    exactly the shards' bytes (pinned by registration where CUDA is: torch's caching host allocator, which rounds each
    block up to a power of two and keeps it, never sees them). The gradient norm and the clip (get_total_norm,
    clip_grads_with_norm_) make no tensor larger than their one norm a parameter besides the gradients they scale in
    place: no squared copy of a gradient."""
    for storages, sizes, shard_bytes, temporaries in run_distributed(2, _host_memory_and_clip_temporaries):
        assert [len(storage) for storage in storages] == [1, 1] and sizes == [shard_bytes, shard_bytes]
        assert temporaries == [], temporaries


class FailingRuntime:
    """torch.cuda.cudart()'s stand-in on CPU: its error enum and strings, and a cudaHostRegister that fails."""
    class cudaError(int):
        success = 0

    cudaGetErrorString = staticmethod(lambda error: "out of memory")
    cudaHostRegister = staticmethod(lambda pointer, size, flags: FailingRuntime.cudaError(2))


def test_fsdp_cpu_offload_raises_when_the_driver_does_not_pin_its_arena(monkeypatch):
    """--cpu_offload registers each host arena with the driver (cudaHostRegister): a registration that fails raises,
    where ignoring its return code would leave the arena pageable and every copy to the device synchronous. Here the
    runtime is a stand-in (CPU has none); not yet run on a GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FailingRuntime)
    monkeypatch.setattr(torch.cuda, "_cudart", FailingRuntime, raising=False)
    with pytest.raises(torch.cuda.CudaError, match=r"out of memory \(2\)"):
        train_fsdp.host_memory([3, 5])


def _local_parameters_by_name():
    config = gpt.make_config("tiny", vocab_size=256, block_size=32)
    model, fsdp, _ = _build(config)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))  # the same rows on every rank
    fsdp(x, x).backward()
    # One view: the wrapped modules keep no parameter of their own; the wrapper's are the shards, each parameter a span
    assert not list(model.parameters()) and list(fsdp.parameters()) == list(fsdp.shards)
    ranges = {part.name: part.flat for part in map(checkpoint.Part._make, fsdp.parts())}  # its elements held here
    gradients = dict(fsdp.gradients())
    return {param.name: (ranges.get(param.name, (0, 0)), flat.shard.detach()[param.span].numpy().copy(),
                         gradients[param.name].numpy().copy()) for flat in fsdp.flats for param in flat.params}


def test_fsdp_parameters_stay_reachable_by_name():
    """After backward, each parameter's span of this rank's shard and of its gradient (parts() and gradients(), as
    checkpoints and train_2d.py's clip read them; some empty) is its piece: together the ranks' pieces are
    train_single's weights and gradients. The wrapped modules register nothing of their own: one view of each."""
    config = gpt.make_config("tiny", vocab_size=256, block_size=32)
    reference = gpt.GPT(config)
    reference.init_weights(seed=5)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    reference(x, x).backward()
    ranks = run_distributed(3, _local_parameters_by_name)  # 3 ranks: uneven shards, padding
    for name, param in reference.named_parameters():
        weight, grad = torch.zeros(param.numel()), torch.zeros(param.numel())
        for pieces in ranks:
            (begin, end), local_weight, local_grad = pieces[name]
            assert local_weight.shape == local_grad.shape == (end - begin,)
            weight[begin:end], grad[begin:end] = torch.from_numpy(local_weight), torch.from_numpy(local_grad)
        assert sum(pieces[name][1].size for pieces in ranks) == param.numel(), name
        torch.testing.assert_close(weight, param.detach().flatten(), rtol=0, atol=0)
        torch.testing.assert_close(grad, param.grad.flatten(), rtol=1e-5, atol=1e-7)


def _samples_on_every_rank(script):
    config = gpt.make_config("tiny", vocab_size=256, block_size=16, dropout=0.5)
    torch.manual_seed(dist.get_rank())  # as the scripts: data-parallel ranks draw different dropout masks
    value = training.initial_values(config, 3)
    with torch.device("meta"):
        model = gpt.GPT(config)
    if script == "2d":
        tp_group, dp_group = train_2d.new_groups(2, 2)
        training.sampling_hooks(model, 1, train_tp.parallelize(model, tp_group))
        tp_parts = {part.name: part for part in checkpoint.parameter_parts(model)}
    else:
        dp_group, tp_parts = None, None
    wrapped = train_fsdp.FullyShardedDataParallel(model, process_group=dp_group, initial_value=value,
                                                 tp_boxes=tp_parts and {name: (part.shape, part.box) for name, part in tp_parts.items()})
    tokens = gpt.generate(wrapped, torch.tensor([[10, 20, 30]]), 12, 16, 256, seed=1)
    return tokens.numpy(), wrapped.training


@pytest.mark.parametrize("script, world_size", [("fsdp", 2), ("2d", 4)])
def test_sampling_is_in_eval_mode_and_the_same_on_every_rank(script, world_size):
    """generate() turns dropout off and restores training mode: with --dropout 0.5 every data-parallel rank (whose
    dropout masks differ) samples the same tokens, and the model is back in training mode."""
    ranks = run_distributed(world_size, _samples_on_every_rank, script)
    for tokens, training_mode in ranks:
        np.testing.assert_array_equal(tokens, ranks[0][0])
        assert training_mode


def _any_module():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 5))
    model[0].bias.requires_grad_(False)  # frozen: gathered for forward, never reduced nor stepped
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 6), torch.randn(8, 5)  # the same on every rank (seeded): each takes its own rows
    fsdp = train_fsdp.FullyShardedDataParallel(model, units=[model[0], model[2]])
    rows = slice(4 * dist.get_rank(), 4 * dist.get_rank() + 4)
    for module, inputs, targets in [(fsdp, x[rows], y[rows]), (reference, x, y)]:
        optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.1)
        for _ in range(2):  # the second step reads the shards the first one updated
            torch.nn.functional.mse_loss(module(inputs), targets).backward()
            optimizer.step()
            optimizer.zero_grad()
    full = {name: tensor.numpy() for name, tensor in named_full_parameters(fsdp)}
    return full, {name: param.detach().numpy() for name, param in reference.named_parameters()}


def test_fsdp_wraps_any_module_with_frozen_parameters():
    """Not only GPT: a Sequential with its two Linears as units and a frozen bias, sharded over 2 ranks with
    padding, takes the same two SGD steps as the whole model on the whole batch."""
    for full, reference in run_distributed(2, _any_module):
        assert full.keys() == reference.keys()
        for name, expected in reference.items():
            np.testing.assert_allclose(full[name], expected, rtol=1e-5, atol=1e-7, err_msg=name)


def _fully_sharded_over_a_subgroup():
    """_any_module's model and two clipped SGD steps, sharded over a strided group of 4 of 8 ranks (as train_2d.py's
    data-parallel groups), each group on its own batch: (the weights, the clip's norms and the reference's, whether a
    rank of the group holds nothing but padding)."""
    rank = dist.get_rank()
    groups = [dist.new_group([0, 2, 4, 6]), dist.new_group([1, 3, 5, 7])]  # every rank creates every group
    group = groups[rank % 2]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 5))  # a bias of 5
    model[0].bias.requires_grad_(False)
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(rank % 2)  # the group's batch
    x, y = torch.randn(8, 6, generator=generator), torch.randn(8, 5, generator=generator)
    fsdp = train_fsdp.FullyShardedDataParallel(model, units=[model[0], model[2]], process_group=group)
    rows = slice(2 * dist.get_rank(group), 2 * dist.get_rank(group) + 2)
    norms = []
    for module, inputs, targets in [(fsdp, x[rows], y[rows]), (reference, x, y)]:
        optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.1)
        for _ in range(2):
            torch.nn.functional.mse_loss(module(inputs), targets).backward()
            if module is fsdp:
                norms.append(fsdp.clip_grad_norm_(0.5).item())  # below every norm here: the clip scales each step
            else:
                norms.append(nn.utils.clip_grad_norm_(module.parameters(), 0.5).item())
            optimizer.step()
            optimizer.zero_grad()
    full = {name: tensor.numpy() for name, tensor in named_full_parameters(fsdp)}
    padding_alone = any(flat.padding >= flat.shard_size for flat in fsdp.flats)
    return full, {name: param.detach().numpy() for name, param in reference.named_parameters()}, norms, padding_alone


def test_fsdp_over_strided_subgroups_with_a_rank_of_padding_alone():
    """8 ranks as two strided groups of 4, each sharding its own copy over its own group alone, as train_2d.py's
    data-parallel groups do (there, the only place the group is not the world): each group's gathers,
    reduce-scatters and gradient norm stay within it, and two clipped SGD steps give what the whole model takes on
    the group's whole batch. Over 4 ranks the last bias (5 elements, shards of 2) pads 3: one rank holds padding
    alone."""
    for rank, (full, reference, norms, padding_alone) in enumerate(run_distributed(8, _fully_sharded_over_a_subgroup)):
        assert full.keys() == reference.keys()
        for name, expected in reference.items():
            np.testing.assert_allclose(full[name], expected, rtol=1e-5, atol=1e-7, err_msg=f"rank {rank}: {name}")
        np.testing.assert_allclose(norms[:2], norms[2:], rtol=1e-5, err_msg=f"rank {rank}: gradient norms")
        assert min(norms) > 0.5 and padding_alone


def _prefetch_order(compile):
    config = gpt.make_config("tiny", vocab_size=256, block_size=32)
    model, fsdp, _ = _build(config)
    if compile:
        training.wrap_blocks(model, compile=True)
    events = []
    unit_of = {flat.shard.data_ptr(): index for index, unit in enumerate(fsdp.units) for flat in unit}
    real_gather, real_reduce_scatter = train_fsdp.all_gather_single, fsdp.reduce_scatter

    def gather(output, input, **kwargs):
        events.append(("gather", unit_of[input.data_ptr()]))
        return real_gather(output, input, **kwargs)

    def reduce_scatter(flat, grad):
        events.append(("reduce_scatter", unit_of[flat.shard.data_ptr()]))
        return real_reduce_scatter(flat, grad)

    train_fsdp.all_gather_single, fsdp.reduce_scatter = gather, reduce_scatter
    for index, block in enumerate(model.blocks, start=1):  # unit 0 is the root
        block.register_forward_pre_hook(lambda *_, i=index: events.append(("start", i)), prepend=True)
        block.register_forward_hook(lambda *_, i=index: events.append(("end", i)), prepend=True)
    x = torch.randint(0, 256, (2, 32))
    try:
        fsdp(x, x).backward()  # the first forward learns the order of the units
        events.clear()
        fsdp(x, x).backward()
    finally:
        train_fsdp.all_gather_single = real_gather  # a launched world runs the next tests in this process
    return events, len(fsdp.units)


@pytest.mark.parametrize("compile", [False, True])
def test_fsdp_prefetches_one_unit_ahead(compile):
    """Forward: block i+1's all-gather is issued after block i starts and before it ends, block i+2's only
    after it ends. Backward: block i-1's all-gather is issued before block i's reduce-scatter (the end of
    its backward), and after block i+1's. Under --compile too: the units' hooks run between compiled blocks."""
    timeout_s = COMPILE_TIMEOUT_S if compile else COLLECTIVE_TIMEOUT_S
    events, units = run_distributed(2, _prefetch_order, compile, timeout_s=timeout_s)[0]
    position = {event: events.index(event) for event in reversed(events)}  # first occurrence
    last = {event: len(events) - 1 - events[::-1].index(event) for event in events}
    for block in range(1, units - 1):
        assert position["start", block] < position["gather", block + 1] < position["end", block], events
        if block + 2 < units:
            assert position["end", block] < position["gather", block + 2], events
    for block in range(units - 1, 1, -1):
        assert last["gather", block - 1] < position["reduce_scatter", block], events
        if block + 1 < units:
            assert position["reduce_scatter", block + 1] < last["gather", block - 1], events


def _hsdp_averages_in_order():
    config = gpt.make_config("tiny", vocab_size=256, block_size=32)
    shard_group, replicate_group = train_fsdp.hybrid_groups(2)
    model, fsdp, _ = _build(config, process_group=shard_group, replicate_group=replicate_group)
    events, real_all_reduce, real_reduce_scatter = [], dist.all_reduce, fsdp.reduce_scatter

    def all_reduce(tensor, *args, group=None, async_op=False, **kwargs):
        if group is replicate_group:
            events.append(("average", async_op))
        return real_all_reduce(tensor, *args, group=group, async_op=async_op, **kwargs)

    def reduce_scatter(flat, grads):
        events.append(("reduce_scatter", None))
        return real_reduce_scatter(flat, grads)

    x = torch.randint(0, 256, (2, 32))
    dist.all_reduce, fsdp.reduce_scatter = all_reduce, reduce_scatter
    try:
        fsdp(x, x).backward()
    finally:
        dist.all_reduce = real_all_reduce  # a launched world runs the next tests in this process
    return events, all(shard.grad is not None for shard in fsdp.shards)


def test_hsdp_averages_each_gradient_shard_while_backward_goes_on():
    """HSDP (2 copies of 2 shards): each unit's gradient shard is averaged over its copies by an asynchronous
    all-reduce, started once its reduce-scatter has landed (when the next unit's gradients are in) and waited for
    when the one after that's are, so it runs beside a unit's backward; every one has landed when backward returns."""
    for events, landed in run_distributed(4, _hsdp_averages_in_order):
        kinds = [kind for kind, _ in events]
        assert {async_op for kind, async_op in events if kind == "average"} == {True}, events
        assert kinds.count("average") == kinds.count("reduce_scatter") == len(kinds) // 2 and landed
        assert kinds[:4] == ["reduce_scatter", "reduce_scatter", "average", "reduce_scatter"], kinds


def _concatenations_in_backward(compute_dtype):
    """The aten.cat outputs of one backward, as (elements, dtype): of train_single's model, then of the same model
    under our FSDP in compute_dtype (bfloat16: both under autocast, as the scripts run); and the elements of each of
    FSDP's gathered flat parameters."""
    config = gpt.make_config("tiny", vocab_size=256, block_size=32)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    reference = gpt.GPT(config)
    reference.init_weights(seed=5)
    _, fsdp, _ = _build(config, compute_dtype=compute_dtype)
    concatenated = []
    for model in (reference, fsdp):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=compute_dtype == torch.bfloat16):
            loss = model(x, x)
        with RecordOutputs() as recorded:
            loss.backward()
        concatenated.append([(t.numel(), str(t.dtype)) for op, t in recorded.outputs if op == torch.ops.aten.cat.default])
    return concatenated, [flat.shard_size * flat.world for flat in fsdp.flats]


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_fsdp_backward_concatenates_no_gradients(compute_dtype):
    """Each unit's gradients reach the reduce-scatter through one output of an autograd function apiece and are
    copied (and cast) into one float32 buffer (FSDP2's copy-in): FSDP's backward runs no concatenation beyond what
    the model's own backward runs, where autograd's cat of the views' gradients into a whole flat parameter's (and
    in bfloat16 its float32 copy) made the peak 8 bytes an element where the plan counts 6."""
    for (single, ours), flat_sizes in run_distributed(2, _concatenations_in_backward, compute_dtype):
        print(f"aten.cat in backward: train_single {single}, FSDP {ours}; flat parameters {flat_sizes}")
        assert ours == single and not {elements for elements, _ in ours} & set(flat_sizes)


def test_fsdp_bfloat16_close_to_float32(corpus, shared_tmp, tmp_path_factory):
    """The matrices gathered and multiplied in bf16, the rest float32 as under autocast in train_single.py; master
    weights, AdamW and gradient reduction in float32: 3 steps stay within 2e-3 of the float32 losses (measured 2e-4;
    bf16 keeps 8 bits of mantissa, ~4e-3 a rounding)."""
    run_distributed(2, train_fsdp.main, flags(corpus, shared_tmp, dtype="bfloat16", max_steps=3))
    losses = read_run(shared_tmp).losses
    reference = single_run(corpus, tmp_path_factory).losses  # warmup covers steps 0-2: the same schedule there
    error = max(abs(a - b) / b for a, b in zip(losses, reference))
    print(f"bf16 vs float32 losses: {losses} vs {reference[:3]}: max relative error {error:.1e}")
    assert error < 2e-3


@launches_its_own_ranks  # 1, 2 and 4 ranks in turn
@one_thread()
def test_fsdp_checkpoint_resumes_at_another_world_size(corpus, tmp_path, tmp_path_factory, saved):
    """A checkpoint written by FSDP at 2 ranks (test_every_layout_resumes_every_other's, step 3) resumes under FSDP at
    4 ranks, every flat shard cut elsewhere: the same losses and weights as an unbroken run. FSDP to and from
    train_single.py is one of that test's pairs."""
    out_dir = tmp_path / "run"
    shutil.copytree(saved["fsdp"], out_dir)
    run_distributed(4, train_fsdp.main, flags(corpus, out_dir, ckpt_interval=SAVED_AT, resume=True))
    assert_runs_match(read_run(str(out_dir)), single_run(corpus, tmp_path_factory))


# ------------------------------------------------------------------------------------------------------------
# train_tp.py


def _tp_run(corpus, out_dir, tmp_path_factory, world_size=2, **overrides):
    run_distributed(world_size, train_tp.main, flags(corpus, out_dir, **overrides))
    run = read_run(out_dir)
    assert_runs_match(run, single_run(corpus, tmp_path_factory))
    return run


_ours = {}


# Each of TP=2 and TP=4 with and without sequence parallelism, loss parallelism on and off across them.
@pytest.mark.parametrize("tp, sequence_parallel, loss_parallel", [(2, False, True), (2, True, False),
                                                                  (4, True, True), (4, False, False)])
def test_tp_matches_single(corpus, shared_tmp, tmp_path_factory, tp, sequence_parallel, loss_parallel):
    """Losses, logged grad norms and final weights (through the shared checkpoint format) equal train_single's."""
    _ours[tp, sequence_parallel, loss_parallel] = _tp_run(corpus, shared_tmp, tmp_path_factory, tp, sequence_parallel=
                                                          sequence_parallel, no_loss_parallel=not loss_parallel)


@pytest.mark.parametrize("sequence_parallel, loss_parallel", [(False, True), (True, False)])
def test_tp_torch_matches_single_and_ours(corpus, shared_tmp, tmp_path_factory, sequence_parallel, loss_parallel):
    """DTensor's parallelize_module, the yardstick, trains the same model as train_single and as ours."""
    torch_run = _tp_run(corpus, os.path.join(shared_tmp, "torch"), tmp_path_factory, impl="torch",
                        sequence_parallel=sequence_parallel, no_loss_parallel=not loss_parallel)
    if (2, sequence_parallel, loss_parallel) not in _ours:  # this test alone
        _ours[2, sequence_parallel, loss_parallel] = _tp_run(corpus, os.path.join(shared_tmp, "ours"), tmp_path_factory,
                                                             sequence_parallel=sequence_parallel,
                                                             no_loss_parallel=not loss_parallel)
    assert_runs_match(torch_run, _ours[2, sequence_parallel, loss_parallel])


def _tensor_parallel_model(config, seed, sequence_parallel=False, loss_parallel=True, init_from=None):
    """A gpt.GPT built on meta, parallelised over the world and initialised as train_tp.main does."""
    with torch.device("meta"):
        model = gpt.GPT(config)
    gather = train_tp.parallelize(model, dist.group.WORLD, sequence_parallel, loss_parallel)
    training.sampling_hooks(model, dist.get_world_size() if sequence_parallel else 1, gather)
    model.to_empty(device="cpu")
    model.tie_weights()
    value = training.initial_values(config, seed, init_from)
    for part in checkpoint.parameter_parts(model):
        part.local().copy_(value(part.name, part.shape, part.box, part.flat))
    return model


def _gradient_errors(sequence_parallel, loss_parallel, dropout):
    """Max error of each local gradient after one forward/backward against the same slice of one device's, both
    starting from the same default generators (each tensor-parallel rank drops out its part of one device's masks)."""
    config = gpt.make_config("tiny", vocab_size=256, block_size=32, dropout=dropout)
    generator = torch.Generator().manual_seed(0)
    idx, targets = torch.randint(0, 256, (2, 2, 32), generator=generator)
    reference = gpt.GPT(config)
    reference.init_weights(seed=5)
    torch.manual_seed(1234)
    expected_loss = reference(idx, targets)
    expected_loss.backward()
    full = dict(reference.named_parameters())
    model = _tensor_parallel_model(config, 5, sequence_parallel, loss_parallel)
    torch.manual_seed(1234)
    loss = model(idx, targets)
    loss.backward()
    parts = checkpoint.parameter_parts(model)
    if sequence_parallel:
        train_tp.allreduce_replicated_grads([(name, p.grad) for name, p in model.named_parameters()],
                                            dist.group.WORLD, "cpu")
    errors = {"loss": abs(loss.item() - expected_loss.item()) / loss.item()}
    for name, param, part in ((part.name, part.tensor, part) for part in parts):
        expected = full[name].grad[tuple(slice(*box) for box in part.box)]
        # attn.key.bias: zero gradient in exact arithmetic (see WEIGHT_TOLERANCE): measured at the query bias scale
        scale = full[name.replace("key.bias", "query.bias")].grad.abs().max()
        errors[name] = ((param.grad - expected).abs().max() / scale).item()
    return errors


@pytest.mark.parametrize("tp, sequence_parallel, loss_parallel, dropout", [
    (2, False, True, 0.0), (2, True, False, 0.0), (4, True, True, 0.0), (2, False, True, 0.5), (4, True, True, 0.5)])
def test_tp_gradients_are_the_slices_of_single(tp, sequence_parallel, loss_parallel, dropout):
    """Before any optimizer step (AdamW amplifies rounding in near-zero gradients): each rank's gradients are the
    slices of one device's, within float32 reduction-order noise (measured ~1e-6); with dropout too, every rank
    dropping out its part (its heads, or its sequence shard) of the masks one device draws."""
    for errors in run_distributed(tp, _gradient_errors, sequence_parallel, loss_parallel, dropout):
        worst = max(errors, key=errors.get)
        assert errors[worst] < 1e-5, f"{worst}: {errors[worst]:.2e}"


def _vocab_parallel_loss(scale, vocab_size):
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 384, generator=generator) * scale
    logits[:, vocab_size:] += 10 * scale  # padding classes that would dominate if they took part
    targets = torch.randint(0, vocab_size, (64,), generator=generator)
    full = logits.clone().requires_grad_()
    expected = F.cross_entropy(full[:, :vocab_size], targets)  # over the tokenizer's vocabulary only
    expected.backward()
    local = logits.chunk(world, -1)[rank].clone().requires_grad_()
    loss = train_tp.VocabParallelCrossEntropy.apply(local, targets, group, vocab_size).mean()
    loss.backward()
    grad_error = (local.grad - full.grad.chunk(world, -1)[rank]).abs().max() / full.grad.abs().max()
    return abs(loss.item() - expected.item()) / expected.item(), grad_error.item(), bool(torch.isfinite(loss))


@pytest.mark.parametrize("scale", [1.0, 1e4])
@pytest.mark.parametrize("vocab_size", [384, 300, 150])  # 150 of 384 on 4 ranks: one rank holds only padding
def test_vocab_parallel_cross_entropy_equals_cross_entropy(scale, vocab_size):
    """Loss and gradient equal F.cross_entropy over the real vocabulary, also at logits ~1e4 (exp would overflow);
    padding classes get no gradient."""
    for loss_error, grad_error, finite in run_distributed(2 if vocab_size > 150 else 4, _vocab_parallel_loss, scale,
                                                          vocab_size):
        assert finite and loss_error < 1e-6 and grad_error < 1e-6, (loss_error, grad_error)


def test_loss_is_over_the_real_vocabulary_only():
    """GPT-2's loss at a vocabulary that is not a multiple of 128 (200, padded to 256): F.cross_entropy over the
    first 200 logits, whatever the padding rows of the tied embedding hold; sampling never draws a padding id."""
    config = gpt.make_config("tiny", vocab_size=200, block_size=16)
    model = gpt.GPT(config)
    model.init_weights(seed=0)
    with torch.no_grad():
        model.wte.weight[200:] = 1.0  # padding classes with large logits: they would take most of the probability
    idx = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = model(idx)
    assert logits.shape[-1] == 256
    expected = F.cross_entropy(logits[..., :200].flatten(0, 1), idx.flatten())
    torch.testing.assert_close(model(idx, idx), expected, rtol=0, atol=0)
    model(idx, idx).backward()
    assert model.wte.weight.grad[200:].abs().max() == 0  # no gradient reaches a padding class's row
    tokens = gpt.generate(model, idx[:1, :3], 40, config.block_size, config.vocab_size, temperature=2.0, top_k=0)
    assert tokens.max() < 200


def _padded_vocabulary_errors(sequence_parallel, loss_parallel):
    """Loss and gradients of tensor parallelism at vocabulary 200 (padded to 256), against F.cross_entropy over the
    real vocabulary of one device's logits."""
    config = gpt.make_config("tiny", vocab_size=200, block_size=16)
    idx = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(1))
    reference = gpt.GPT(config)
    reference.init_weights(seed=5)
    expected = F.cross_entropy(reference(idx)[..., :200].flatten(0, 1), idx.flatten())
    expected.backward()
    model = _tensor_parallel_model(config, 5, sequence_parallel, loss_parallel)
    loss = model(idx, idx)
    loss.backward()
    wte = next(part for part in checkpoint.parameter_parts(model) if part.name == "wte.weight")
    expected_grad = reference.wte.weight.grad[tuple(slice(*box) for box in wte.box)]
    return abs(loss.item() - expected.item()) / expected.item(), ((wte.tensor.grad - expected_grad).abs().max()
                                                                  / reference.wte.weight.grad.abs().max()).item()


@pytest.mark.parametrize("sequence_parallel, loss_parallel", [(False, True), (True, False), (True, True)])
def test_tp_loss_is_over_the_real_vocabulary_only(sequence_parallel, loss_parallel):
    for loss_error, grad_error in run_distributed(2, _padded_vocabulary_errors, sequence_parallel, loss_parallel):
        assert loss_error < 1e-6 and grad_error < 1e-5, (loss_error, grad_error)


def _holds_whole_logits(loss_parallel):
    config = gpt.make_config("tiny", vocab_size=300, block_size=16)  # padded to 384: no other size is 384
    model = _tensor_parallel_model(config, 0, loss_parallel=loss_parallel)
    idx = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with RecordOutputs() as mode:
        model(idx, idx).backward()
    whole = 2 * 16 * 384  # tokens x padded vocabulary, in any shape (the all-gather's flat buffer included)
    return any(384 in tensor.shape or tensor.numel() == whole for _, tensor in mode.outputs)


def test_loss_parallel_never_holds_whole_logits():
    """No operator, forward or backward, produces a tensor with the whole padded vocabulary (384) as a dimension or
    [tokens, vocab] elements; the same detector sees the gathered logits of --no_loss_parallel."""
    assert run_distributed(2, _holds_whole_logits, True) == [False, False]
    assert run_distributed(2, _holds_whole_logits, False) == [True, True]


def _layers_alone(sequence_parallel):
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same full layers and data on every rank
    column_full, row_full = nn.Linear(16, 24), nn.Linear(24, 16)
    x, grad_out = torch.randn(2, 8, 16, requires_grad=True), torch.randn(2, 8, 16)
    hidden = column_full(x)
    out = row_full(hidden)
    out.backward(grad_out)
    column = train_tp.ColumnParallelLinear(column_full, group, sequence_parallel)  # starts its region: f
    row = train_tp.RowParallelLinear(row_full, group, sequence_parallel)  # ends it: g
    for layer, full in ((column, column_full), (row, row_full)):
        with torch.no_grad():
            for name, param in layer.named_parameters():
                box = layer.boxes[name][1] if name in layer.boxes else None
                param.copy_(getattr(full, name)[tuple(slice(*b) for b in box)] if box else getattr(full, name))
    shard = lambda t, dim: t.chunk(world, dim)[rank]
    local_x = (shard(x, 1) if sequence_parallel else x).detach().requires_grad_()
    local_hidden = column(local_x)
    local_out = row(local_hidden)
    local_out.backward(shard(grad_out, 1) if sequence_parallel else grad_out)
    if sequence_parallel:  # the replicated bias saw this rank's sequence shard only
        dist.all_reduce(row.bias.grad)
    pairs = [(local_hidden, shard(hidden, -1)), (local_out, shard(out, 1) if sequence_parallel else out),
             (local_x.grad, shard(x.grad, 1) if sequence_parallel else x.grad),
             (column.weight.grad, shard(column_full.weight.grad, 0)),
             (column.bias.grad, shard(column_full.bias.grad, 0)),
             (row.weight.grad, shard(row_full.weight.grad, 1)), (row.bias.grad, row_full.bias.grad)]
    return [((a - b).abs().max() / b.abs().max()).item() for a, b in pairs]


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_column_and_row_parallel_linear_alone(sequence_parallel):
    """ColumnParallelLinear (f, then its slice) -> RowParallelLinear (its slice, then g): outputs, the input's and the
    weights' gradients are the unsharded nn.Linear's slices (under sequence parallelism: sequence shards)."""
    for errors in run_distributed(2, _layers_alone, sequence_parallel):
        assert max(errors) < 1e-6, errors


class RecordDropoutMasks(TorchDispatchMode):
    """A copy of every dropout mask drawn while active (aten.bernoulli_ draws nn.Dropout's and attention's on
    CPU), in order."""

    def __init__(self):
        super().__init__()
        self.masks = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if "bernoulli" in func.__name__:
            self.masks.append(out.detach().numpy().copy())  # a copy: dropout scales the mask in place next
        return out


def _dropout_masks_of_main(main, argv):
    with RecordDropoutMasks() as mode:
        main(argv)
    return mode.masks


@pytest.mark.parametrize("world_size, overrides", [(2, {}), (4, dict(tp=2, dp=2))])
def test_tp_dropout_draws_the_masks_one_device_draws(corpus, shared_tmp, world_size, overrides):
    """The masks a real main() run draws in one micro-step (dropout 0.5, no accumulation): every rank draws whole
    masks, attention's over all heads ([batch, heads, seq, seq]) as well as the residual stream's, the same on every
    tensor-parallel peer (each keeps its own part: test_tp_keeps_its_part_of_one_devices_dropout) and other
    ones on each data-parallel rank (train_2d.py), which holds other rows. With no data parallelism they are
    exactly the masks train_single.py draws, in the same order."""
    main, tp = (train_2d.main, overrides["tp"]) if overrides else (train_tp.main, world_size)
    argv = flags(corpus, shared_tmp, dropout=0.5, max_steps=1, global_batch=2 * world_size // tp, eval_interval=0,
                 **overrides)
    ranks = run_distributed(world_size, _dropout_masks_of_main, main, argv)
    attention = [mask for mask in ranks[0] if mask.ndim == 4]
    assert len(attention) == 4 and len(ranks[0]) == 1 + 3 * 4  # embedding, then per block: attention, 2 residual
    assert all(mask.shape == (2, 4, 32, 32) for mask in attention)
    for rank in range(world_size):
        peer = rank // tp * tp  # its tensor-parallel group's first rank
        assert all(np.array_equal(a, b) for a, b in zip(ranks[rank], ranks[peer], strict=True)), (rank, peer)
    for rank in range(tp, world_size, tp):
        assert not any(np.array_equal(a, b) for a, b in zip(ranks[0], ranks[rank])), f"ranks 0 and {rank}"
    if not overrides:
        with one_thread():
            single = _dropout_masks_of_main(train_single.main, flags(corpus, os.path.join(shared_tmp, "single"),
                                                                     dropout=0.5, max_steps=1, global_batch=2,
                                                                     eval_interval=0))
        assert all(np.array_equal(a, b) for a, b in zip(ranks[0], single, strict=True))


def _sliced_dropout(shape):
    """This rank's SlicedDropout of its part (along dim 1) of x, and its part of one device's F.dropout of the whole
    x, both drawn from the same generators; whether each left them alike; whether evaluation left them untouched.
    The 3-D part is stored sequence-first, not as gpt.py's batch-first: the output keeps the part's layout."""
    x = torch.rand(shape, generator=torch.Generator().manual_seed(0)) + 0.5  # no zeros
    rank, world = dist.get_rank(), dist.get_world_size()
    part = x.chunk(world, 1)[rank]
    part = part.transpose(0, 1).contiguous().transpose(0, 1) if x.dim() == 3 else part.contiguous()
    dropout = train_tp.SlicedDropout(0.5, dist.group.WORLD, dim=1)
    torch.manual_seed(1234)
    whole = F.dropout(x, 0.5).chunk(world, 1)[rank]
    after_whole = torch.get_rng_state()
    torch.manual_seed(1234)
    out = dropout(part)
    drew_alike = torch.equal(torch.get_rng_state(), after_whole)
    dropout.eval()
    assert torch.equal(dropout(part), part)
    return out.numpy(), whole.numpy(), out.stride() == part.stride(), drew_alike, torch.equal(torch.get_rng_state(),
                                                                                            after_whole)


@pytest.mark.parametrize("shape", [(2, 4, 16, 16), (2, 16, 8)], ids=["attention heads", "sequence shard"])
def test_tp_keeps_its_part_of_one_devices_dropout(shape):
    """train_tp.SlicedDropout on a rank's heads of the attention probabilities, or on its sequence shard of the
    residual stream: the rank's part of what F.dropout of the whole tensor gives on one device from the same
    generators, which it leaves as one device does; in the part's own memory layout; nothing drawn in eval mode."""
    for out, expected, same_layout, drew_alike, eval_drew_nothing in run_distributed(2, _sliced_dropout, shape):
        assert np.array_equal(out == 0, expected == 0)
        np.testing.assert_allclose(out, expected, rtol=1e-6)  # x / (1 - p) against x * (1 / (1 - p)): the last bit
        assert same_layout and drew_alike and eval_drew_nothing


def _replicated_after_training(argv):
    models = []
    parallelize = train_tp.parallelize
    train_tp.parallelize = lambda model, *args: models.append(model) or parallelize(model, *args)
    try:
        train_tp.main(argv)
    finally:
        train_tp.parallelize = parallelize  # a launched world runs the next tests in this process
    return {part.name: part.tensor.detach().numpy() for part in checkpoint.parameter_parts(models[0]) if not part.sliced}


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp_replicated_parameters_stay_identical(corpus, shared_tmp, sequence_parallel):
    """Layer norms, wpe and row-parallel biases are bit-identical on every rank after training with dropout."""
    ranks = run_distributed(2, _replicated_after_training,
                            flags(corpus, shared_tmp, dropout=0.1, sequence_parallel=sequence_parallel, max_steps=5))
    assert len(ranks[0]) == 2 * 4 * 2 + 2 * 4 + 3  # layer norms, attn / mlp proj biases, ln_f and wpe
    for name, value in ranks[0].items():
        assert np.array_equal(value, ranks[1][name]), name


def _main_error(argv):
    try:
        train_tp.main(argv)
    except ValueError as error:
        return str(error)


@pytest.mark.parametrize("world_size, bad, message", [
    (3, {}, "n_head (4) is not divisible by --tp 3"),
    (2, dict(sequence_parallel=True, block_size=33), r"--block_size (33) is not divisible by --tp 2"),
    (2, dict(tp=4), "--tp must be the world size"),
    (4, dict(model="llama-tiny"), "n_kv_head (2) is not divisible by --tp 4: choose --tp in {1, 2} or another --model"),
])
def test_tp_bad_layout_is_a_clear_error(corpus, tmp_path, world_size, bad, message):
    """Every rank refuses, before any collective (a collective would hang on the ranks that passed), in one line.
    llama-tiny's 4 query heads divide by 4, its 2 key/value heads do not: the line names the --tp that work."""
    errors = run_distributed(world_size, _main_error, flags(corpus, tmp_path, **bad))
    assert all(error and message in error and "\n" not in error for error in errors), errors


GENERATED_PROMPTS = [torch.arange(10, 10 + length)[None] for length in range(1, 5)]  # every length mod 2 and 4


def _generate(sequence_parallel):
    config = gpt.make_config("tiny", vocab_size=256, block_size=16)
    model = _tensor_parallel_model(config, 3, sequence_parallel).eval()
    with torch.no_grad():
        logits = [model(prompt).numpy() for prompt in GENERATED_PROMPTS]
    prompt = torch.tensor([[10, 20, 30]])  # 3 tokens: not a multiple of tp, as every other length on the way
    return gpt.generate(model, prompt, 12, config.block_size, config.vocab_size, seed=1).numpy(), logits


@pytest.mark.parametrize("tp, sequence_parallel", [(2, False), (2, True), (4, True)])
def test_tp_generate_matches_single(tp, sequence_parallel):
    """Sampling (no targets) gets the whole logits back at any prompt length, under sequence parallelism too, where
    a prompt is padded to a multiple of tp and the padding dropped: prompts of 1 to 4 tokens (every length mod tp)
    give one device's logits, and the 12 tokens sampled after 3 (lengths 3 to 14) are one device's. At tp 2 a
    prompt padded by its remainder instead of what completes the multiple still comes out right; at tp 4 not."""
    config = gpt.make_config("tiny", vocab_size=256, block_size=16)
    model = gpt.GPT(config).eval()
    model.init_weights(seed=3)
    expected = gpt.generate(model, torch.tensor([[10, 20, 30]]), 12, config.block_size, 256, seed=1).numpy()
    with torch.no_grad():
        expected_logits = [model(prompt).numpy() for prompt in GENERATED_PROMPTS]
    for tokens, logits in run_distributed(tp, _generate, sequence_parallel):
        np.testing.assert_array_equal(tokens, expected)
        for prompt, found, reference in zip(GENERATED_PROMPTS, logits, expected_logits):
            assert found.shape == reference.shape, (prompt.shape, found.shape)
            np.testing.assert_allclose(found, reference, rtol=0, atol=1e-5, err_msg=f"{prompt.shape[1]} tokens")


# ------------------------------------------------------------------------------------------------------------
# train_2d.py


def _groups(tp, dp):
    tp_group, dp_group = train_2d.new_groups(tp, dp)
    return dist.get_process_group_ranks(tp_group), dist.get_process_group_ranks(dp_group)


@pytest.mark.parametrize("tp, dp", [(2, 2), (2, 4), (4, 2)])
def test_2d_groups_follow_the_grid(tp, dp):
    """Tensor-parallel groups are consecutive ranks (inside a node), data-parallel groups strided."""
    groups = run_distributed(tp * dp, _groups, tp, dp)
    for rank, (tp_ranks, dp_ranks) in enumerate(groups):
        assert tp_ranks == list(range(rank // tp * tp, rank // tp * tp + tp))
        assert dp_ranks == list(range(rank % tp, tp * dp, tp))


_2d_runs = {}


def run_2d(corpus, tmp_path_factory, world_size, **overrides):
    """train_2d.py, once per distinct flags per session: read_run's result (rank 0's all-gathers per batch in
    _2d_gathers)."""
    key = (world_size, tuple(sorted(overrides.items())))
    if key not in _2d_runs:
        out_dir = shared_folder(tmp_path_factory, "2d")
        argv = flags(corpus, out_dir, **overrides)
        _2d_gathers[key] = run_distributed(world_size, _train_counting_gathers, train_2d.main, argv)[0][0]
        _2d_runs[key] = read_run(str(out_dir))
    return _2d_runs[key]


_2d_gathers = {}


@pytest.mark.parametrize("world_size, overrides", [
    (4, dict(tp=2, dp=2)),
    (4, dict(tp=2, dp=2, sequence_parallel=True, no_loss_parallel=True)),
    (8, dict(tp=2, dp=4, no_reshard=True)),
])
def test_2d_matches_single_device(corpus, tmp_path_factory, world_size, overrides):
    """6 steps with accumulation (16 / (2 x dp)) and clipping: losses, grad norms and weights equal train_single's."""
    assert_runs_match(run_2d(corpus, tmp_path_factory, world_size, **overrides), single_run(corpus, tmp_path_factory))


@pytest.mark.parametrize("world_size, overrides", [(4, dict(tp=2, dp=2)), (8, dict(tp=2, dp=4, no_reshard=True))])
def test_2d_gathers_each_flat_parameter_once_or_twice(corpus, tmp_path_factory, world_size, overrides):
    """As FSDP alone (test_fsdp_gathers_each_flat_parameter_once_or_twice): tensor parallelism slices the flat
    parameters without changing their number, and without sequence parallelism or gathered logits it issues no
    all-gather of its own while training."""
    run_2d(corpus, tmp_path_factory, world_size, **overrides)
    gathers = _2d_gathers[world_size, tuple(sorted(overrides.items()))]
    expected = FLAT_PARAMETERS if overrides.get("no_reshard") else 2 * FLAT_PARAMETERS - OF_THE_ROOT
    assert {count for split, count in gathers if split == "train"} == {expected}, gathers
    assert {count for split, count in gathers if split == "val"} == {FLAT_PARAMETERS}, gathers


def test_2d_ours_matches_torch(corpus, tmp_path_factory):
    """--impl torch: DTensor parallelize_module on the tp mesh dimension, fully_shard on the dp one."""
    ours = run_2d(corpus, tmp_path_factory, 4, tp=2, dp=2)
    theirs = run_2d(corpus, tmp_path_factory, 4, tp=2, dp=2, impl="torch")
    assert_runs_match(theirs, ours)
    assert_runs_match(theirs, single_run(corpus, tmp_path_factory))


def _refused(argv):
    try:
        train_2d.main(argv)
    except (ValueError, RuntimeError) as error:
        return str(error)
    return None


@pytest.mark.parametrize("world_size, overrides, message", [
    (4, dict(tp=2, dp=3), "--tp 2 x --dp 3 = 6 ranks, but the world has 4"),
    (4, dict(tp=4, dp=1, model="tiny", block_size=30, sequence_parallel=True),
     "--block_size (30) is not divisible by --tp 4"),
    (3, dict(tp=3, dp=1), "n_head (4) is not divisible by --tp 3"),
    (2, dict(tp=2, dp=1, global_batch=3, micro_batch=2), "not a multiple of --micro_batch"),
])
def test_2d_bad_layout_fails_fast_on_every_rank(corpus, tmp_path, world_size, overrides, message):
    errors = run_distributed(world_size, _refused, flags(corpus, tmp_path, **overrides))
    assert all(error and message in error for error in errors), errors


# ------------------------------------------------------------------------------------------------------------
# One checkpoint format: every layout resumes every other


LAYOUTS = {  # script, ranks, extra flags
    "single": (train_single.main, 1, {}),
    "ddp": (train_ddp.main, 2, {}),
    "fsdp": (train_fsdp.main, 2, {}),
    "tp": (train_tp.main, 2, dict(sequence_parallel=True)),
    "2d": (train_2d.main, 4, dict(tp=2, dp=2)),
}
SAVED_AT = 3

# --compile: inductor fuses elementwise kernels and may reorder a float32 reduction; measured against eager
# train_single over 6 steps: losses within ~1e-6 relative, weights within ~1e-5 absolute.
COMPILE_TOLERANCE, COMPILE_WEIGHT_TOLERANCE = 2e-5, 1e-4


# bf16 autocast: every layout against train_single.py in bf16. Both round every matmul's inputs to 8 bits of
# mantissa, but sum in other orders; measured over 3 steps: losses within 3e-6 (DDP), 3.5e-4 (TP), 3.6e-4 (2-D, as
# TP since FSDP gathers the norms in float32; 1.4e-4 while they were bf16).
BF16_TOLERANCE = 2e-3


@pytest.mark.parametrize("layout, sequence_parallel", [("ddp", False), ("tp", False), ("tp", True), ("2d", False),
                                                       ("2d", True)])
def test_bfloat16_every_layout_close_to_single(corpus, shared_tmp, tmp_path_factory, layout, sequence_parallel):
    main, ranks, extra = LAYOUTS[layout]
    extra = dict(extra, sequence_parallel=sequence_parallel)
    run_distributed(ranks, main, flags(corpus, shared_tmp, dtype="bfloat16", max_steps=3, **extra))
    losses = read_run(str(shared_tmp)).losses
    reference = single_run(corpus, tmp_path_factory, dtype="bfloat16", max_steps=3).losses
    error = max(abs(a - b) / b for a, b in zip(losses, reference))
    print(f"{layout} bf16 vs single bf16: max relative loss difference {error:.1e}")
    assert len(losses) == 3 and error < BF16_TOLERANCE


DTYPE_LAYOUTS = dict(LAYOUTS, zero=(train_zero.main, 2, {}), tp_no_sequence_parallel=(train_tp.main, 2, {}),
                     pp=(train_pp.main, 2, {}), cp=(train_cp.main, 2, {}), cp_ring=(train_cp.main, 2, dict(cp_impl="ring")),
                     four_d=(train_4d.main, 4, dict(pp=2, tp=2)))


def _norm_and_block_inputs_of_main(main, argv):
    """main(argv) on this rank: the dtypes every gpt.Block's input, every norm's input and every norm's weight had, as
    a sorted list of (module class, what, dtype)."""
    seen = set()

    def record(module, args, output):  # after the forward: FSDP's unit of ln_f gathers in ln_f's own pre-hook
        if isinstance(module, (gpt.Block, nn.LayerNorm, nn.RMSNorm)):
            seen.add((type(module).__name__, "input", str(args[0].dtype)))
        if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):  # the fused kernel wants input and weight alike
            seen.add((type(module).__name__, "weight", str(module.weight.dtype)))

    handle = nn.modules.module.register_module_forward_hook(record)
    try:
        main(argv)
    finally:
        handle.remove()
    return sorted(seen)


@pytest.mark.parametrize("layout", list(DTYPE_LAYOUTS))
@pytest.mark.parametrize("model", ["tiny", "llama-tiny"])
def test_bfloat16_residual_stream_and_norms_are_float32_in_every_layout(corpus, tmp_path, layout, model):
    """Under --dtype bfloat16 autocast casts a matmul's inputs, nothing else: the residual stream (every block's
    input), every norm's input and its weight stay float32 in every layout, as in train_single.py, so that norms run
    on their fused kernels and the layout never changes the math. One step of 4 sequences (bf16 is slow here)."""
    main, ranks, extra = DTYPE_LAYOUTS[layout]
    argv = flags(corpus, tmp_path, model=model, dtype="bfloat16", max_steps=1, global_batch=4, micro_batch=1, **extra)
    seen = run_distributed(ranks, _norm_and_block_inputs_of_main, main, argv)
    norm = "RMSNorm" if model == "llama-tiny" else "LayerNorm"
    expected = [("Block", "input", "torch.float32"), (norm, "input", "torch.float32"), (norm, "weight", "torch.float32")]
    assert all(rank == expected for rank in seen), seen


# bfloat16 at depth: 16 layers at llama-tiny's width, where a residual stream rounded to bf16 in every block would
# compound. Every layout rounds the same matmul inputs to bf16 as single does, but may sum a product's parts in
# another order (TP's partial products, ring attention's blocks): its losses are single's computation rounded
# differently, so they may differ from single's by the rounding's own effect, measured on single itself as
# |bf16 loss - float32 loss|, once for each run, twice in all (DEEP_BF16_FACTOR). 3 steps of 4 sequences of 32
# tokens. Measured (max relative difference over the 3 steps): bf16 against float32 4.3e-4, so a tolerance of 8.6e-4;
# from single's bf16 losses DDP 9e-8, ZeRO 4.3e-5, TP 3.0e-4 (3.5e-4 with Llama's embedding reduced in bf16, its
# residual stream and norms bf16: 3 steps at this depth do not tell them apart, test_bfloat16_residual_stream_...
# does), PP 2.1e-4, CP 4.5e-4 (ring 7.1e-4: its CPU blocks round the scores to bf16), FSDP 9.0e-8 and 2-D 3.1e-4
# (7.1e-4 and 9.3e-5 while they gathered the embeddings and norm gains in bf16).
DEEP_BF16 = dict(gpt.PRESETS["llama-tiny"], n_layer=16)
DEEP_BF16_FACTOR = 2


@pytest.mark.parametrize("layout", [name for name in DTYPE_LAYOUTS if name != "single"])
def test_bfloat16_at_depth_every_layout_within_single_rounding(corpus, tmp_path, tmp_path_factory, monkeypatch,
                                                                layout):
    monkeypatch.setitem(gpt.PRESETS, "llama-deep", DEEP_BF16)  # forked ranks inherit it
    deep = dict(model="llama-deep", max_steps=3, global_batch=4, micro_batch=1)
    reference = single_run(corpus, tmp_path_factory, dtype="bfloat16", **deep).losses
    float32 = single_run(corpus, tmp_path_factory, **deep).losses
    tolerance = DEEP_BF16_FACTOR * max(abs(a - b) / b for a, b in zip(reference, float32))
    main, ranks, extra = DTYPE_LAYOUTS[layout]
    run_distributed(ranks, main, flags(corpus, tmp_path, dtype="bfloat16", **deep, **extra))
    losses = read_run(str(tmp_path)).losses
    error = max(abs(a - b) / b for a, b in zip(losses, reference))
    print(f"{layout}: {error:.1e} from single's bf16 losses; tolerance {tolerance:.1e}")
    assert len(losses) == 3 and error < tolerance


@pytest.mark.parametrize("layout, impl", [("single", None), ("ddp", "ours"), ("ddp", "torch"), ("fsdp", "ours"),
                                          ("fsdp", "torch"), ("tp", "ours"), ("tp", "torch"), ("2d", "ours"),
                                          ("2d", "torch")])
def test_compile_matches_eager_single(corpus, shared_tmp, tmp_path_factory, layout, impl):
    """--compile (each transformer block compiled by inductor, the strategy's hooks between them) in every script,
    ours and PyTorch's: the same losses, grad norms and weights as eager train_single.py. Inductor caches compiled
    kernels on disk, so the runs after the first compile little."""
    main, ranks, extra = LAYOUTS[layout]
    argv = flags(corpus, shared_tmp, compile=True, impl=impl, **extra)
    run_distributed(ranks, main, argv, timeout_s=COMPILE_TIMEOUT_S)
    assert_runs_match(read_run(str(shared_tmp)), single_run(corpus, tmp_path_factory), COMPILE_TOLERANCE,
                      COMPILE_WEIGHT_TOLERANCE)


@pytest.fixture(scope="module")
def saved(corpus, tmp_path_factory):
    """Each layout trains 3 of the 6 steps, checkpoints, and crashes: {layout: its out_dir}."""
    folders = {}
    for name, (main, ranks, extra) in LAYOUTS.items():
        folders[name] = tmp_path_factory.mktemp(f"saved_by_{name}")
        argv = flags(corpus, folders[name], ckpt_interval=SAVED_AT, **extra)
        assert run_distributed(ranks, _train_until, main, SAVED_AT, argv) == ["crashed"] * ranks
    return folders


# DDP writes and reads train_single's whole tensors (its parts are single's; rank 0 writes them, rank 1 nothing), so it
# is here once, as FSDP's loader, whose 2 ranks get the saving ranks' generators back (checkpoint.resume). Its
# saves are resumed by DDP at 4 ranks, by TP (test_resume_under_another_layout_keeps_tensor_parallel_peers_alike), by CP
RESUMES = [(saver, loader) for saver in LAYOUTS for loader in LAYOUTS
           if saver != loader and "ddp" not in (saver, loader)] + [("fsdp", "ddp")]


@launches_its_own_ranks
@pytest.mark.parametrize("saver, loader", RESUMES)
def test_every_layout_resumes_every_other(corpus, tmp_path, tmp_path_factory, saved, saver, loader):
    """A checkpoint saved at step 3 by `saver` resumes under `loader` (resuming one's own checkpoint is each strategy's
    tests'): the whole run's losses, grad norms and final weights equal train_single's uninterrupted 6 steps."""
    out_dir = tmp_path / "run"
    shutil.copytree(saved[saver], out_dir)
    main, ranks, extra = LAYOUTS[loader]
    run_distributed(ranks, main, flags(corpus, out_dir, ckpt_interval=SAVED_AT, resume=True, **extra))
    assert_runs_match(read_run(str(out_dir)), single_run(corpus, tmp_path_factory))


@launches_its_own_ranks
def test_sample_continues_a_prompt_from_any_layout_checkpoint(saved, capsys, tmp_path, monkeypatch):
    """sample.py loads any layout's checkpoint whole onto one device and continues --prompt: the checkpoints each
    layout saved at step 3 (equal weights within float32 noise) all give the text gpt.generate gives from single's,
    after a line naming the checkpoint and its step. Without --out_dir: the run under out/ that saved last."""
    texts, argv = {}, ["--prompt", "def ", "--sample_tokens", "40", "--device", "cpu"]
    for layout, out_dir in saved.items():
        sample.main(["--out_dir", str(out_dir), *argv])
        texts[layout] = capsys.readouterr().out
    found = checkpoint.Checkpoint(checkpoint.latest(str(saved["single"])))
    model = gpt.GPT(gpt.GPTConfig(**found.meta["config"]))
    model.init_weights(0, lambda name, shape: full_tensor(found, name))
    tokens = gpt.generate(model, torch.tensor([list(b"def ")]), 40, 32, 256, temperature=0.8, top_k=40, seed=1337)
    expected = "sample:\n" + prepare_data.ByteTokenizer().decode(tokens[0].tolist()) + "\n"
    assert texts == {layout: f"checkpoint {checkpoint.latest(str(saved[layout]))} (step 3)\n{expected}"
                     for layout in saved}
    with pytest.raises(SystemExit, match="no checkpoint in"):
        sample.main(["--out_dir", str(saved["single"]) + "-missing"])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="no checkpoint under 'out/'"):
        sample.main(argv)
    for published, layout in enumerate(["tp", "2d", "single"]):  # published in this order: single's is the newest
        shutil.copytree(saved[layout], tmp_path / "out" / layout)
        os.utime(tmp_path / "out" / layout / "latest", (1e9 + published, 1e9 + published))
    sample.main(argv)
    assert capsys.readouterr().out == f"checkpoint out/single/ckpt-0000003 (step 3), the newest under out/ " \
                                      f"(--out_dir chooses another run)\n{expected}"


# ------------------------------------------------------------------------------------------------------------
# --init_from: GPT-2's weights in the Hugging Face format, in every layout, each rank reading its own part; sample.py
# from any layout's checkpoint. The pretrained models are small random GPT-2s written here the way Hugging Face
# writes them, so the tests need neither the network nor the transformers package.


def hugging_face_gpt2(n_layer=2, n_head=4, n_embd=64, n_positions=64, vocab_size=256, seed=0):
    """The tensors of a random GPT-2 as GPT2LMHeadModel stores them, by stored name: Conv1D weights [in, out], q|k|v
    side by side in c_attn, no lm_head (tied to wte). Biases and norms are random too, so a misplaced one shows."""
    shapes = {"wte.weight": (vocab_size, n_embd), "wpe.weight": (n_positions, n_embd), "ln_f.weight": (n_embd,)}
    for i in range(n_layer):
        for module, in_features, out_features in [("attn.c_attn", n_embd, 3 * n_embd), ("attn.c_proj", n_embd, n_embd),
                                                  ("mlp.c_fc", n_embd, 4 * n_embd), ("mlp.c_proj", 4 * n_embd, n_embd)]:
            shapes[f"h.{i}.{module}.weight"] = (in_features, out_features)
        shapes.update({f"h.{i}.{norm}.weight": (n_embd,) for norm in ("ln_1", "ln_2")})
    shapes.update({name.replace("weight", "bias"): shape[-1:] for name, shape in list(shapes.items())
                   if not name.startswith(("wte", "wpe"))})
    generator = torch.Generator().manual_seed(seed)
    return {name: float("ln_" in name and name.endswith("weight")) + 0.1 * torch.randn(shape, generator=generator)
            for name, shape in shapes.items()}


def write_hugging_face_gpt2(folder, tensors, n_head=4, prefix="", **config):
    """config.json and model.safetensors of `tensors` in `folder`, with the causal-mask buffers (h.i.attn.bias)
    older GPT-2 files carry; prefix "transformer." as GPT2LMHeadModel.save_pretrained() names them."""
    n_positions, n_embd = tensors["wpe.weight"].shape
    n_layer = sum(name.endswith("ln_1.weight") for name in tensors)
    stored = {prefix + name: tensor for name, tensor in tensors.items()}
    stored.update({f"{prefix}h.{i}.attn.bias": torch.ones(1, 1, n_positions, n_positions).tril()
                   for i in range(n_layer)})
    os.makedirs(folder, exist_ok=True)
    save_file(stored, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    config = dict(dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], activation_function="gelu_new",
                       layer_norm_epsilon=1e-5, n_ctx=n_positions, n_positions=n_positions, n_embd=n_embd,
                       n_head=n_head, n_layer=n_layer, vocab_size=len(tensors["wte.weight"])), **config)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return str(folder)


def hugging_face_gpt2_logits(tensors, n_head, idx):
    """GPT2LMHeadModel's forward written from its definition on its own tensors, in float64: Conv1D is x @ W + b,
    q, k and v are the thirds of c_attn's output, GELU is its tanh form (gelu_new), the head is wte. The reference
    every layout that loads these tensors is held to."""
    t = {name: tensor.double() for name, tensor in tensors.items()}
    (B, T), C = idx.shape, t["wte.weight"].shape[1]
    norm = lambda x, name: F.layer_norm(x, (C,), t[f"{name}.weight"], t[f"{name}.bias"], eps=1e-5)
    conv1d = lambda x, name: x @ t[f"{name}.weight"] + t[f"{name}.bias"]
    gelu = lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    x = t["wte.weight"][idx] + t["wpe.weight"][:T]
    for i in range(sum(name.endswith("ln_1.weight") for name in t)):
        q, k, v = (z.view(B, T, n_head, -1).transpose(1, 2)
                   for z in conv1d(norm(x, f"h.{i}.ln_1"), f"h.{i}.attn.c_attn").split(C, dim=-1))
        scores = (q @ k.transpose(-2, -1) / math.sqrt(C // n_head)).masked_fill(future, -math.inf)
        x = x + conv1d((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C), f"h.{i}.attn.c_proj")
        x = x + conv1d(gelu(conv1d(norm(x, f"h.{i}.ln_2"), f"h.{i}.mlp.c_fc")), f"h.{i}.mlp.c_proj")
    return norm(x, "ln_f") @ t["wte.weight"].t()


def gpt_weights_from_hugging_face(tensors, config):
    """Our parameters, by gpt.py name, from GPT-2's stored tensors, by the definitions of the two layouts and apart
    from gpt.py's mapping: Conv1D weights transposed, c_attn's output cut into q, k and v, wte padded with zero rows
    up to padded_vocab_size, wpe cut to the context."""
    t, C = tensors, config.n_embd
    ours = {"wte.weight": F.pad(t["wte.weight"], (0, 0, 0, config.padded_vocab_size - config.vocab_size)),
            "wpe.weight": t["wpe.weight"][:config.block_size], "ln_f.weight": t["ln_f.weight"],
            "ln_f.bias": t["ln_f.bias"]}
    for i in range(config.n_layer):
        theirs, mine = f"h.{i}.", f"blocks.{i}."
        for projection, weight, bias in zip(("query", "key", "value"), t[theirs + "attn.c_attn.weight"].split(C, dim=1),
                                            t[theirs + "attn.c_attn.bias"].split(C)):
            ours.update({f"{mine}attn.{projection}.weight": weight.t(), f"{mine}attn.{projection}.bias": bias})
        for module, conv1d in [("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")]:
            ours.update({f"{mine}{module}.weight": t[f"{theirs}{conv1d}.weight"].t(),
                         f"{mine}{module}.bias": t[f"{theirs}{conv1d}.bias"]})
        for norm in ("ln_1", "ln_2"):
            ours.update({f"{mine}{norm}.{kind}": t[f"{theirs}{norm}.{kind}"] for kind in ("weight", "bias")})
    return ours


@pytest.fixture(scope="module")
def gpt2_like(tmp_path_factory):
    """(folder, tensors): a random GPT-2 with the default corpus' vocabulary (256 byte tokens), 2 layers of width 64
    and 64 positions; under torchrun rank 0 writes it into a folder every rank names alike."""
    tensors = hugging_face_gpt2()
    folder = _same_on_every_rank(tmp_path_factory.mktemp("gpt2_like"))
    if LAUNCHED_WORLD == 1 or dist.get_rank() == 0:
        write_hugging_face_gpt2(folder, tensors)
    if LAUNCHED_WORLD > 1:
        dist.barrier()
    return str(folder), tensors


LOGITS_TOLERANCE = 2e-5
"""Largest absolute difference allowed between a layout's float32 logits (up to ~3.5 in size) or loss and the float64
reference: float32 rounding through 2 layers, measured up to 2.2e-6 on logits and 5.4e-7 on the loss in every layout
(reduction order, the only difference between layouts, moves them by ~1e-6). Key and value swapped in c_attn, or q, k
and v biases all read from its first third, move the logits by 3.4 and 1.7."""


def _fully_sharded_tensor_parallel_model(config, value):
    """train_2d.py's model: tensor parallel over pairs of ranks, each rank's slices fully sharded over the others."""
    tp_group, dp_group = train_2d.new_groups(2, dist.get_world_size() // 2)
    with torch.device("meta"):
        model = gpt.GPT(config)
    training.sampling_hooks(model, 1, train_tp.parallelize(model, tp_group))
    tp_parts = {part.name: part for part in checkpoint.parameter_parts(model)}
    return train_fsdp.FullyShardedDataParallel(
        model, process_group=dp_group, tp_boxes={name: (part.shape, part.box) for name, part in tp_parts.items()},
        initial_value=value)


class CountingSafetensorsFile:
    """A file safetensors' safe_open opened, counting into loaded[name] the elements of every tensor that leaves it,
    whole (get_tensor) or a box of one (get_slice(...)[box]): what a rank took from the file, whatever it kept."""

    def __init__(self, file, loaded, name):
        self.file, self.loaded, self.name = file, loaded, name
        loaded[name] += 0  # opened, if nothing is read

    def __enter__(self):
        self.file.__enter__()
        return self

    def __exit__(self, *exception):
        return self.file.__exit__(*exception)

    def counted(self, tensor):
        self.loaded[self.name] += tensor.numel()
        return tensor

    def get_tensor(self, name):
        return self.counted(self.file.get_tensor(name))

    def get_slice(self, name):
        return CountingSlice(self.file.get_slice(name), self.counted)


class CountingSlice:
    def __init__(self, stored, counted):
        self.stored, self.counted = stored, counted

    def __getitem__(self, box):
        return self.counted(self.stored[box])


def _load_and_run(layout, folder, idx):
    """Build `layout` as its script does, from the checkpoint in `folder`: (whole logits of idx[:, :-1], the pipeline:
    at its last position, the loss on idx[:, 1:], the size of every tensor HuggingFaceCheckpoint.read gave, the names,
    sizes and row widths of the parts this rank holds, their names, {file this rank opened: the elements that left it},
    counted at safetensors' safe_open)."""
    with open(os.path.join(folder, "config.json")) as f:
        config = hugging_face.config_from_hugging_face(json.load(f), block_size=idx.shape[1] - 1, dropout=0.0)
    reads, loaded = [], collections.Counter()
    real_read, real_open = hugging_face.HuggingFaceCheckpoint.read, hugging_face.safe_open

    def read(checkpoint, name, box):
        tensor = real_read(checkpoint, name, box)
        reads.append(tensor.numel())
        return tensor

    def safe_open(path, *args, **kwargs):
        return CountingSafetensorsFile(real_open(path, *args, **kwargs), loaded, os.path.basename(path))

    hugging_face.HuggingFaceCheckpoint.read, hugging_face.safe_open = read, safe_open
    try:
        value = training.initial_values(config, 0, folder)
        if layout == "single":
            model = gpt.GPT(config)
            model.init_weights(0, value)
        elif layout.startswith("fsdp"):
            _, model, _ = _build(config, init_from=folder)
        elif layout == "tp":
            model = _tensor_parallel_model(config, 0, sequence_parallel=True, init_from=folder)
        elif layout == "pp":  # each stage reads its own blocks (and embeddings or head)
            with torch.device("meta"):
                stage = train_pp.Stage(gpt.GPT(config), dist.get_rank(), dist.get_world_size())
            stage.init_weights(torch.device("cpu"), value)
            model = train_pp.PipelineParallel(stage, dist.group.WORLD, config)
        else:
            model = _fully_sharded_tensor_parallel_model(config, value)
    finally:
        hugging_face.HuggingFaceCheckpoint.read, hugging_face.safe_open = real_read, real_open
    parts = ([checkpoint.Part(*where) for where in model.parts()] if hasattr(model, "parts")
             else checkpoint.parameter_parts(model.stage.model if layout == "pp" else model))
    parts = [part for part in parts if part.tensor.requires_grad]  # the weights read, not a mixture's buffers
    with torch.no_grad():
        logits, loss = model(idx[:, :-1])[..., :config.vocab_size], model(idx[:, :-1], idx[:, 1:])
    part_sizes = [(part.name, part.flat[1] - part.flat[0], math.prod(b - a for a, b in part.box[1:])) for part in parts]
    return logits.numpy(), loss.item(), reads, part_sizes, sorted({part.name for part in parts}), dict(loaded)


@pytest.mark.parametrize("layout, world_size", [("single", 1), ("fsdp", 2), ("fsdp", 3), ("tp", 2), ("2d", 4)])
def test_hugging_face_gpt2_loads_in_every_layout(tmp_path_factory, layout, world_size):
    """A GPT-2 in the Hugging Face format (vocabulary 300, padded to 384; 64 positions, 32 used) loaded by each layout
    computes GPT-2's logits and loss within float32 noise, and each rank reads only its own part, one tensor a part:
    never more than the part's elements and the partial rows around an FSDP shard, counted as they leave the file
    (a read of the whole tensor, sliced afterwards, counts the whole); when the model is split, no read as large as
    the largest parameter, and well under the model in all."""
    folder = shared_folder(tmp_path_factory, "gpt2_300")
    tensors = hugging_face_gpt2(vocab_size=300)
    if LAUNCHED_WORLD == 1 or dist.get_rank() == 0:
        write_hugging_face_gpt2(folder, tensors, prefix="transformer.")  # the save_pretrained() naming
    if LAUNCHED_WORLD > 1:
        dist.barrier()
    config = hugging_face.config_from_hugging_face(hugging_face.HuggingFaceCheckpoint(str(folder)).config, 32, 0.0)
    value = training.initial_values(config, 0, str(folder))
    for name, expected in gpt_weights_from_hugging_face(tensors, config).items():  # wte's padding rows too: zeros
        assert torch.equal(value(name, expected.shape), expected), name
    idx = torch.randint(0, 300, (2, 33), generator=torch.Generator().manual_seed(0))
    reference = hugging_face_gpt2_logits(tensors, 4, idx[:, :-1])
    reference_loss = F.cross_entropy(reference.flatten(0, 1), idx[:, 1:].flatten()).item()
    model_bytes = 4 * sum(tensor.numel() for tensor in tensors.values())
    largest_parameter = max(tensor.numel() for tensor in tensors.values())
    for rank, (logits, loss, reads, parts, _, loaded) in enumerate(run_distributed(world_size, _load_and_run, layout,
                                                                                   str(folder), idx)):
        print(f"{layout} x{world_size} rank {rank}: logits differ by {np.abs(logits - reference.numpy()).max():.1e}, "
              f"loss by {abs(loss - reference_loss):.1e}; read {4 * loaded['model.safetensors']:,} bytes, the largest "
              f"read {4 * max(reads):,} bytes, of a model of {model_bytes:,} bytes")
        np.testing.assert_allclose(logits, reference.numpy(), rtol=0, atol=LOGITS_TOLERANCE)
        assert loss == pytest.approx(reference_loss, rel=0, abs=LOGITS_TOLERANCE)
        assert len(reads) == len(parts)  # one read a part: a tensor at a time
        part_bound = sum(size + 2 * width for _, size, width in parts)  # its part, and partial rows at most
        assert sum(reads) <= part_bound and loaded == {"model.safetensors": sum(reads)}, (loaded, part_bound)
        if world_size > 1:
            assert max(reads) < largest_parameter and sum(reads) < 0.8 * model_bytes / 4


INIT_FROM_LAYOUTS = dict(LAYOUTS, **{"fsdp torch": (train_fsdp.main, 2, dict(impl="torch")),
                                      "pp": (train_pp.main, 2, dict(pp=2))})


@pytest.mark.parametrize("layout", list(INIT_FROM_LAYOUTS))
def test_every_script_starts_from_the_hugging_face_weights(corpus, shared_tmp, gpt2_like, layout):
    """--init_from FOLDER in each script: one step at learning rate 0 saves exactly the weights GPT-2's tensors give
    under the definitions of the two layouts, and the loss logged at step 0 is the reference forward's on its batch."""
    folder, tensors = gpt2_like
    main, ranks, extra = INIT_FROM_LAYOUTS[layout]
    run_distributed(ranks, main, flags(corpus, shared_tmp, model=None, init_from=folder, max_steps=1, lr=0, min_lr=0,
                                       **extra))
    run = read_run(shared_tmp)
    config = hugging_face.config_from_hugging_face(hugging_face.HuggingFaceCheckpoint(folder).config, 32, 0.0)
    expected = gpt_weights_from_hugging_face(tensors, config)
    assert run.weights.keys() == expected.keys()
    for name, weight in expected.items():
        np.testing.assert_array_equal(run.weights[name], weight.numpy(), err_msg=name)
    sampler = training.BatchSampler(os.path.join(corpus, "train.bin"), 32, 16, 16, 0, 1, 1234, torch.device("cpu"))
    x, y = sampler.get(0, 0)
    reference = F.cross_entropy(hugging_face_gpt2_logits(tensors, 4, x).flatten(0, 1), y.flatten()).item()
    assert run.losses[0] == pytest.approx(reference, rel=0, abs=LOGITS_TOLERANCE)


def _refusal(main, argv):
    try:
        main(argv)
    except ValueError as error:
        return str(error)


@pytest.mark.parametrize("case, message", [
    ("--model", "--model gpt2 contradicts --init_from"),
    ("vocabulary", "has a vocabulary of 300, but --data"),
    ("--block_size", "--block_size 128 is longer than its n_positions 64: pass --block_size 64 or less"),
    ("not GPT-2", "config.json has activation_function 'relu': gpt.py computes GPT-2, Llama 3 and Mixtral only"),
    ("weights", "model.safetensors has no h.2.ln_1.weight: the weights do not match config.json"),
    ("no folder", "/nowhere': no such folder (a hub model is named name or owner/name)"),
    ("./no_such_folder", "--init_from './no_such_folder': no such folder"),
])
def test_init_from_that_contradicts_the_flags_or_data_is_refused(corpus, tmp_path, gpt2_like, case, message):
    """Refused with one line that says what to change, on every rank, before the first collective."""
    folder, tensors = gpt2_like
    overrides = dict(model=None, init_from=folder)
    if case == "--model":
        overrides["model"] = "gpt2"
    elif case == "vocabulary":
        overrides["init_from"] = write_hugging_face_gpt2(tmp_path / "gpt2", hugging_face_gpt2(vocab_size=300))
    elif case == "--block_size":
        overrides["block_size"] = 128
    elif case == "not GPT-2":
        overrides["init_from"] = write_hugging_face_gpt2(tmp_path / "gpt2", tensors, activation_function="relu")
    elif case == "weights":  # a config.json of 3 layers beside weights of 2
        overrides["init_from"] = write_hugging_face_gpt2(tmp_path / "gpt2", tensors)
        with open(tmp_path / "gpt2" / "config.json") as f:
            config = json.load(f)
        with open(tmp_path / "gpt2" / "config.json", "w") as f:
            json.dump(dict(config, n_layer=3), f)
    else:  # a path, which no hub download could give
        overrides["init_from"] = case if case.startswith("./") else str(tmp_path / "nowhere")
    errors = run_distributed(2, _refusal, train_ddp.main, flags(corpus, tmp_path / "run", **overrides))
    assert all(error and message in error and "\n" not in error and "hub did not" not in error for error in errors)


@one_thread()
def test_resume_wins_over_init_from(corpus, tmp_path, gpt2_like):
    """--init_from applies when a run starts fresh: with --resume and a checkpoint, the run continues the checkpoint,
    bit for bit as if it had never stopped."""
    folder, _ = gpt2_like
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    train_single.main(flags(corpus, straight, model=None, init_from=folder, max_steps=4))
    argv = flags(corpus, interrupted, model=None, init_from=folder, max_steps=4, ckpt_interval=2)
    assert _train_until(train_single.main, 2, argv) == "crashed"
    train_single.main(argv + ["--resume"])
    run, reference = read_run(str(interrupted)), read_run(str(straight))
    assert run.losses == reference.losses and run.grad_norms == reference.grad_norms
    for name in reference.weights:
        assert np.array_equal(run.weights[name], reference.weights[name]), name


def test_init_from_a_hub_name_reads_the_huggingface_hub_cache(tmp_path, gpt2_like, monkeypatch):
    """A hub name goes through huggingface_hub's cache, laid out as `hf download` leaves it: offline
    (HF_HUB_OFFLINE=1) a cached model opens from there, and one not cached fails at once, in one line naming the fix."""
    import huggingface_hub.constants

    folder, _ = gpt2_like
    snapshot = tmp_path / "models--gpt2" / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(folder, snapshot)
    (tmp_path / "models--gpt2" / "refs").mkdir()
    (tmp_path / "models--gpt2" / "refs" / "main").write_text(snapshot.name)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert os.path.samefile(hugging_face.pretrained_folder("gpt2"), snapshot)
    assert hugging_face.HuggingFaceCheckpoint("gpt2").config["n_layer"] == 2
    start = time.time()
    with pytest.raises(ValueError, match="'gpt2-xl' is no local folder, and the Hugging Face hub did not give it "
                                         r"\(LocalEntryNotFoundError\): pass a folder") as error:
        hugging_face.pretrained_folder("gpt2-xl")
    assert time.time() - start < 5 and "\n" not in str(error.value)
    with pytest.raises(ValueError, match="'meta-llama/Llama-9-1B' is no local folder, and the Hugging Face hub"):
        hugging_face.pretrained_folder("meta-llama/Llama-9-1B")  # owner/name: a hub id, not a path


# ------------------------------------------------------------------------------------------------------------
# export.py: a checkpoint of any layout out to the Hugging Face format, read back by --init_from and by transformers

EXPORT_LAYOUTS = {"single": (train_single.main, 1, {}), "fsdp": (train_fsdp.main, 2, {}),
                  "tp": (train_tp.main, 2, dict(sequence_parallel=True))}


@pytest.fixture(scope="module")
def corpus_300(corpus, tmp_path_factory):
    """The default corpus under a vocabulary of 300 (its byte ids are the first 256): padded to 384, so wte and the LM
    head carry 84 padding rows for the export to leave behind."""
    folder = shared_folder(tmp_path_factory, "corpus_300")
    if LAUNCHED_WORLD == 1 or dist.get_rank() == 0:
        for split in ("train.bin", "val.bin"):
            os.symlink(os.path.join(corpus, split), os.path.join(folder, split))
        with open(os.path.join(corpus, "meta.json")) as f:
            meta = json.load(f)
        with open(os.path.join(folder, "meta.json"), "w") as f:
            json.dump(dict(meta, vocab_size=300), f)
    if LAUNCHED_WORLD > 1:
        dist.barrier()
    return str(folder)


def exported_tensors(folder):
    """Every tensor of an exported folder by stored name, from model.safetensors or from each of its shards."""
    from safetensors.torch import load_file

    files = sorted(name for name in os.listdir(folder) if name.endswith(".safetensors"))
    return {name: tensor for file in files for name, tensor in load_file(os.path.join(folder, file)).items()}


def _model_from(config, fill):
    """Our model on CPU, its parameters filled by fill(model), in eval mode."""
    with torch.device("meta"):
        model = gpt.GPT(config)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty() gives each module its own tensor
    fill(model)
    return model.eval()


def _checkpoint_model(found):
    config = gpt.GPTConfig(**found.meta["config"])
    return _model_from(config, lambda model: checkpoint.load(found, checkpoint.parameter_parts(model), None, config))


@pytest.mark.parametrize("layout, model", [(layout, model) for layout in EXPORT_LAYOUTS
                                           for model in ("tiny", "llama-tiny")] + [("single", "llama tied")])
def test_export_then_init_from_gives_the_same_logits(corpus, corpus_300, llama_like, shared_tmp, tmp_path, layout,
                                                     model):
    """A checkpoint written by each layout, exported in float32, holds what GPT2LMHeadModel or LlamaForCausalLM
    stores, by the definitions of the two layouts written in this file (not hugging_face.py's mapping): their tensors'
    names and shapes, the vocabulary cut to its 300 real rows, Conv1D's transposes, q and k rows as they are, no LM
    head where it is tied (as Llama 3.2's: a run from the tied llama_like, 2 layers of width 64, vocabulary 256). Its
    config.json reads back as the run's model, and --init_from the folder builds a model whose logits equal the
    checkpoint's bit for bit."""
    main, ranks, extra = EXPORT_LAYOUTS[layout]
    if model == "llama tied":
        extra = dict(extra, model=None, init_from=llama_like[True][0], data=corpus)
    run_distributed(ranks, main, flags(corpus_300, shared_tmp, **dict(dict(model=model, max_steps=2), **extra)))
    found = checkpoint.Checkpoint(checkpoint.latest(shared_tmp))
    config = gpt.GPTConfig(**found.meta["config"])
    folder = str(tmp_path / "exported")
    export.export(found, folder)
    stored = exported_tensors(folder)
    if model == "tiny":  # GPT2LMHeadModel.save_pretrained() names them transformer.*
        expected = {"transformer." + name: tensor for name, tensor in hugging_face_gpt2(
            n_layer=4, n_head=4, n_embd=128, n_positions=32, vocab_size=300).items()}
        ours = gpt_weights_from_hugging_face({n.removeprefix("transformer."): t for n, t in stored.items()}, config)
    else:
        expected = llama_like[True][1] if model == "llama tied" else hugging_face_llama(
            n_layer=4, n_head=4, n_kv_head=2, n_embd=128, intermediate_size=384, vocab_size=300)
        ours = gpt_weights_from_hugging_face_llama(stored, config)
    assert {name: tuple(t.shape) for name, t in stored.items()} == {n: tuple(t.shape) for n, t in expected.items()}
    for name, value in ours.items():  # the padding rows were left behind: the real ones are the checkpoint's
        rows = config.vocab_size if name in ("wte.weight", "lm_head.weight") else len(value)
        assert torch.equal(value[:rows], full_tensor(found, name)[:rows]), name
    with open(os.path.join(folder, "config.json")) as f:
        assert hugging_face.config_from_hugging_face(json.load(f), config.block_size, config.dropout) == config
    idx = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    exported = _model_from(config, lambda m: m.init_weights(0, training.initial_values(config, 0, folder)))
    with torch.no_grad():
        logits = exported(idx)[..., :config.vocab_size]
        reference = _checkpoint_model(found)(idx)[..., :config.vocab_size]
    assert torch.equal(logits, reference), (logits - reference).abs().max()


def test_export_streams_one_shard_at_a_time(corpus, tmp_path, monkeypatch):
    """python export.py --max_shard_size 100KB: tiny's 3.3 MB in files of at most 100 KB (a larger tensor alone in
    one) and model.safetensors.index.json naming each tensor's file; when a file is written, the tensors export.py
    holds are that file's alone (every tensor read_stored returns is followed by a weak reference). The shards hold
    what one file does; --dtype bfloat16 holds those values rounded. A folder that holds a model already, a step with
    no checkpoint and data that is not there are refused in one line, before anything is written."""
    run_distributed(1, train_single.main, flags(corpus, tmp_path / "run", max_steps=1))
    real_read, real_save = export.read_stored, export.save_file
    held, written = weakref.WeakSet(), []

    def read_stored(*args):
        tensor = real_read(*args)
        held.add(tensor)
        return tensor

    def save_file(tensors, path, metadata):
        written.append((os.path.basename(path), sum(t.numel() * t.element_size() for t in held),
                        sum(t.numel() * t.element_size() for t in tensors.values()), len(tensors)))
        real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(export, "read_stored", read_stored)
    monkeypatch.setattr(export, "save_file", save_file)
    export.main(["--out_dir", str(tmp_path / "run"), "--to", str(tmp_path / "sharded"), "--max_shard_size", "100KB"])
    for file, in_memory, size, tensors in written:
        assert in_memory == size and (size <= 100_000 or tensors == 1), (file, in_memory, size, tensors)
    assert len(written) > 10 and max(size for _, _, size, _ in written) > 100_000  # wte is alone in its own
    with open(tmp_path / "sharded" / "model.safetensors.index.json") as f:
        index = json.load(f)
    sharded = exported_tensors(tmp_path / "sharded")
    assert index["metadata"]["total_size"] == sum(size for _, _, size, _ in written)
    assert sorted(set(index["weight_map"].values())) == [file for file, _, _, _ in written]
    assert all(file.startswith("model-") and file.endswith(f"-of-{len(written):05d}.safetensors")
               for file, _, _, _ in written)
    assert index["weight_map"].keys() == sharded.keys()
    export.main(["--out_dir", str(tmp_path / "run"), "--to", str(tmp_path / "whole")])
    export.main(["--out_dir", str(tmp_path / "run"), "--to", str(tmp_path / "bf16"), "--dtype", "bfloat16"])
    whole, bf16 = exported_tensors(tmp_path / "whole"), exported_tensors(tmp_path / "bf16")
    assert sorted(os.listdir(tmp_path / "whole")) == ["config.json", "model.safetensors", "tokenizer.json",
                                                      "tokenizer_config.json"]
    assert whole.keys() == sharded.keys() == bf16.keys()
    for name, tensor in whole.items():
        assert tensor.dtype == torch.float32 and torch.equal(sharded[name], tensor), name
        assert bf16[name].dtype == torch.bfloat16 and torch.equal(bf16[name], tensor.bfloat16()), name
    run = ["--out_dir", str(tmp_path / "run")]
    for argv, message in [(["--to", str(tmp_path / "whole")], "'.*whole' already holds a model .config.json.: choose "
                                                              "another --to"),
                          (["--to", str(tmp_path / "new"), "--step", "7"], "no checkpoint ckpt-0000007 in '.*run' "
                                                                           r"\(it holds ckpt-0000001\): pass"),
                          (["--to", str(tmp_path / "new"), "--data", str(tmp_path / "none")], "no prepared data")]:
        with pytest.raises(ValueError, match=message):
            export.main(run + argv)
    assert not os.path.exists(tmp_path / "new")


NO_TRANSFORMERS = ("transformers is not installed (CI leaves it out): `pip install transformers` to hold export.py's "
                   "folders to AutoModelForCausalLM and AutoTokenizer")


@pytest.mark.parametrize("model", ["tiny", "llama-tiny"])
def test_transformers_continues_an_exported_run_as_we_do(corpus, tmp_path, model):
    """AutoModelForCausalLM and AutoTokenizer load what `python export.py` wrote of an FSDP run at its initial weights
    (learning rate 0: random weights, so that every token chosen depends on the whole model): transformers' logits are
    ours within float32 noise (measured up to 6e-7), its greedy continuation of a prompt is gpt.generate's at top_k 1,
    and its tokenizer gives the prompt our ids and decodes the continuation as ours does."""
    transformers = pytest.importorskip("transformers", reason=NO_TRANSFORMERS)
    run_distributed(2, train_fsdp.main, flags(corpus, tmp_path / "run", model=model, max_steps=1, lr=0, min_lr=0))
    export.main(["--out_dir", str(tmp_path / "run"), "--to", str(tmp_path / "exported")])
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported")).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "exported"))
    ours = _checkpoint_model(checkpoint.Checkpoint(checkpoint.latest(tmp_path / "run")))
    prompt = "def run("
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    assert ids[0].tolist() == prepare_data.ByteTokenizer().encode(prompt)
    continued = gpt.generate(ours, ids, 24, 32, 256, temperature=1.0, top_k=1)
    with torch.no_grad():
        generated = theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
        difference = (theirs(continued).logits - ours(continued)[..., :256]).abs().max().item()
    print(f"{model}: logits differ by {difference:.1e}; continued {tokenizer.decode(generated[0])!r}")
    assert difference < 1e-5
    assert generated.tolist() == continued.tolist()
    assert tokenizer.decode(generated[0]) == prepare_data.ByteTokenizer().decode(continued[0].tolist())


def test_transformers_tokenizes_as_the_run_did(tmp_path):
    """tokenizer.json written for a Llama 3 tokenizer.model (a small one in its format: write_tiktoken_bpe), and for
    GPT-2's tokenizer (its pattern over the same ranks), reads in AutoTokenizer, which gives every text the ids
    prepare_data.py gave it (Llama's: <|begin_of_text|> first, digits in threes; GPT-2's: digits in runs) and decodes
    them back."""
    transformers = pytest.importorskip("transformers", reason=NO_TRANSFORMERS)
    write_tiktoken_bpe(tmp_path / "tokenizer.model")
    ours = prepare_data.get_tokenizer(str(tmp_path / "tokenizer.model"))
    assert export.write_tokenizer(str(tmp_path), ours, 64) == [
        "tokenizer.json", "tokenizer_config.json"]
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    texts = ["12345 it's", "def main():\n    return 42\n\n", "caf\u00e9 na\u00efve  \t spaces", "Hello, World!!"]
    for text in texts:
        assert theirs(text).input_ids == ours.encode(text), text
        assert theirs.decode(ours.encode(text), skip_special_tokens=True) == text
    assert (theirs.bos_token, theirs.eos_token) == ("<|begin_of_text|>", "<|end_of_text|>")
    # GPT-2's own files need the network: the same ranks under GPT-2's pattern and <|endoftext|> stand in for them
    import tiktoken
    from tiktoken_ext.openai_public import r50k_pat_str

    ranks = ours.encoding._mergeable_ranks
    gpt2_like = prepare_data.GPT2Tokenizer.__new__(prepare_data.GPT2Tokenizer)
    gpt2_like.encoding = tiktoken.Encoding("gpt2-like", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                           special_tokens={"<|endoftext|>": len(ranks)})
    gpt2_like.eot = len(ranks)
    (tmp_path / "gpt2").mkdir()
    export.write_tokenizer(str(tmp_path / "gpt2"), gpt2_like, 64)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "gpt2"))
    for text in texts:
        assert theirs(text).input_ids == gpt2_like.encode(text), text
        assert theirs.decode(gpt2_like.encode(text)) == text
    assert theirs.eos_token == "<|endoftext|>" and theirs("a").input_ids == gpt2_like.encode("a")


# ------------------------------------------------------------------------------------------------------------
# Resuming with dropout: every generator a rank draws from is saved and restored. Masks depend on the layout, so
# a run is held to the uninterrupted run of its own layout, bit for bit.

WITH_DROPOUT = {  # script, ranks, extra flags
    "ddp": (train_ddp.main, 2, {}),
    "fsdp": (train_fsdp.main, 2, {}),
    "fsdp-3-ranks": (train_fsdp.main, 3, dict(global_batch=12)),
    "tp": (train_tp.main, 2, {}),
    "tp-sequence-parallel": (train_tp.main, 2, dict(sequence_parallel=True)),
    "2d": (train_2d.main, 4, dict(tp=2, dp=2)),
    "2d-sequence-parallel": (train_2d.main, 4, dict(tp=2, dp=2, sequence_parallel=True)),
    "llama-2d-sequence-parallel": (train_2d.main, 4, dict(tp=2, dp=2, sequence_parallel=True, model="llama-tiny")),
}


def uninterrupted(corpus, tmp_path_factory, layout):
    """The layout's 6 steps with dropout, never interrupted; a run cached for other tests where there is one."""
    main, ranks, extra = WITH_DROPOUT[layout]
    if main is train_ddp.main:  # also the killed and restarted workers' reference (uninterrupted_ddp)
        return ddp_run(corpus, tmp_path_factory, ranks, dropout=DROPOUT, **extra)[0]
    if main is train_fsdp.main:
        return fsdp_run(corpus, tmp_path_factory, ranks, dropout=DROPOUT, **extra)[0]
    if main is train_2d.main:  # also the two-node 2-D test's reference
        return run_2d(corpus, tmp_path_factory, ranks, dropout=DROPOUT, **extra)
    out_dir = shared_folder(tmp_path_factory, layout)
    run_distributed(ranks, main, flags(corpus, out_dir, dropout=DROPOUT, **extra))
    return read_run(str(out_dir))


@pytest.mark.parametrize("layout", list(WITH_DROPOUT))
def test_resume_with_dropout_is_bit_identical(corpus, tmp_path_factory, shared_tmp, layout):
    """Dropout 0.1 on every rank (under TP also on each rank's heads and sequence shard): killed at step 3, resumed from
    step 2's checkpoint, the run redoes steps 2 and 3 with the same masks and ends bit-identical to the same layout
    run without interruption."""
    main, ranks, extra = WITH_DROPOUT[layout]
    argv = flags(corpus, shared_tmp, dropout=DROPOUT, ckpt_interval=2, **extra)
    assert run_distributed(ranks, _train_until, main, 3, argv) == ["crashed"] * ranks
    assert checkpoint.latest(str(shared_tmp)).endswith("ckpt-0000002")
    run_distributed(ranks, main, argv + ["--resume"])
    assert_identical(read_run(str(shared_tmp)), uninterrupted(corpus, tmp_path_factory, layout))


# ------------------------------------------------------------------------------------------------------------
# --activation_checkpointing: each block keeps only its input and recomputes the rest in backward, where the
# strategy has made the block's weights available again (FSDP gathers the unit for backward) and the random state
# is restored (torch restores the default generators, from which every mask is drawn). The math is
# unchanged: the same layouts against train_single.py within the same tolerances, and with dropout each layout
# bit-identical to itself without checkpointing (the recompute draws the masks the forward drew).


@pytest.mark.parametrize("layout, impl", [("single", None), ("ddp", "ours"), ("ddp", "torch"), ("fsdp", "ours"),
                                          ("fsdp", "torch"), ("tp", "ours"), ("tp", "torch"), ("2d", "ours"),
                                          ("2d", "torch")])
def test_activation_checkpointing_matches_single(corpus, shared_tmp, tmp_path_factory, layout, impl):
    main, ranks, extra = LAYOUTS[layout]
    run_distributed(ranks, main, flags(corpus, shared_tmp, activation_checkpointing=True, impl=impl, **extra))
    assert_runs_match(read_run(str(shared_tmp)), single_run(corpus, tmp_path_factory))


@pytest.mark.parametrize("layout", ["fsdp", "tp", "tp-sequence-parallel", "2d-sequence-parallel"])
def test_activation_checkpointing_with_dropout_is_bit_identical(corpus, tmp_path_factory, shared_tmp, layout):
    """Dropout 0.1 everywhere (under TP also each rank's own heads' stream, and with sequence parallelism the
    residual stream's): the recompute draws every mask again as the forward drew it."""
    main, ranks, extra = WITH_DROPOUT[layout]
    run_distributed(ranks, main, flags(corpus, shared_tmp, dropout=DROPOUT, activation_checkpointing=True, **extra))
    assert_identical(read_run(str(shared_tmp)), uninterrupted(corpus, tmp_path_factory, layout))


@pytest.mark.parametrize("layout, options", [("fsdp", dict(compile=True)), ("tp", dict(compile=True)),
                                             ("2d", dict(dtype="bfloat16", max_steps=3, sequence_parallel=True))])
def test_activation_checkpointing_composes(corpus, shared_tmp, tmp_path_factory, layout, options):
    """With --compile (the compiled block is what is recomputed) and with bf16 autocast (the recompute runs under
    the forward's autocast state): the same results as without checkpointing."""
    main, ranks, extra = LAYOUTS[layout]
    argv = flags(corpus, shared_tmp, activation_checkpointing=True, **dict(extra, **options))
    run_distributed(ranks, main, argv, timeout_s=COMPILE_TIMEOUT_S if "compile" in options else COLLECTIVE_TIMEOUT_S)
    if "compile" in options:
        assert_runs_match(read_run(str(shared_tmp)), single_run(corpus, tmp_path_factory), COMPILE_TOLERANCE,
                          COMPILE_WEIGHT_TOLERANCE)
    else:
        reference = single_run(corpus, tmp_path_factory, dtype="bfloat16", max_steps=3).losses
        losses = read_run(str(shared_tmp)).losses
        assert len(losses) == 3 and max(abs(a - b) / b for a, b in zip(losses, reference)) < BF16_TOLERANCE


def test_activation_checkpointing_with_dropout_single(corpus, tmp_path_factory, shared_tmp):
    out_dir = shared_folder(tmp_path_factory, "single_dropout")
    with one_thread():
        train_single.main(flags(corpus, out_dir, dropout=DROPOUT))
        train_single.main(flags(corpus, shared_tmp, dropout=DROPOUT, activation_checkpointing=True))
    assert_identical(read_run(str(shared_tmp)), read_run(str(out_dir)))


# ------------------------------------------------------------------------------------------------------------
# --plan, the memory planner (plan.plan_memory): measured, not trusted. A real run of each layout reports what
# one rank holds: its parameters, gradients and AdamW state after the first optimizer step (every storage once),
# and the tensors autograd saves for backward during the first micro-batch's forward (saved-tensor hooks; our
# FSDP's gathered `full` buffers are weights, freed after use, and the rank's parameters are not activations). The plan must give the first three to the byte and the activations within 10%.

PLANNED = {  # script, ranks, extra flags, the Layout's (strategy, dp, tp) and options
    "single": (train_single.main, 1, {}, ("single", 1, 1), {}),
    "ddp": (train_ddp.main, 2, {}, ("ddp", 2, 1), {}),
    "fsdp": (train_fsdp.main, 2, {}, ("fsdp", 2, 1), {}),
    "fsdp-3-ranks": (train_fsdp.main, 3, dict(global_batch=12), ("fsdp", 3, 1), {}),  # shards padded
    "tp": (train_tp.main, 2, {}, ("tp", 1, 2), {}),
    "tp-sequence-parallel": (train_tp.main, 2, dict(sequence_parallel=True), ("tp", 1, 2),
                             dict(sequence_parallel=True)),
    "tp-no-loss-parallel": (train_tp.main, 2, dict(no_loss_parallel=True), ("tp", 1, 2), dict(loss_parallel=False)),
    "2d": (train_2d.main, 4, dict(tp=2, dp=2), ("2d", 2, 2), {}),
    "2d-sequence-parallel": (train_2d.main, 4, dict(tp=2, dp=2, sequence_parallel=True), ("2d", 2, 2),
                             dict(sequence_parallel=True)),
    # Llama: RMSNorm, rotated q and k, narrower k and v, SwiGLU's 4 saved tensors, the untied head
    "llama-single": (train_single.main, 1, dict(model="llama-tiny"), ("single", 1, 1), {}),
    "llama-fsdp": (train_fsdp.main, 2, dict(model="llama-tiny"), ("fsdp", 2, 1), {}),
    "llama-tp-sequence-parallel": (train_tp.main, 2, dict(model="llama-tiny", sequence_parallel=True), ("tp", 1, 2),
                                   dict(sequence_parallel=True)),
    # context parallel: s / cp tokens a rank; the all-gather saves every rank's keys and values, the ring its own
    "cp": (train_cp.main, 2, dict(cp=2), ("cp", 1, 1), dict(cp=2)),
    "llama-cp-ring": (train_cp.main, 2, dict(model="llama-tiny", cp=2, cp_impl="ring"), ("cp", 1, 1),
                      dict(cp=2, cp_impl="ring")),
    # a mixture of experts: the router's probabilities, each (token, expert) row's input, hidden tensors and output
    "moe-single": (train_single.main, 1, dict(model="moe-tiny"), ("single", 1, 1), {}),
}
ACTIVATION_TOLERANCE = 0.10  # the issue's bound; measured: float32 within 0.01% (a storage a few bytes larger),
# bfloat16 within 0.5% (autocast's copies of biases, which the plan counts and addmm does not save)


def _memory_held(main, argv):
    """main(argv) on this rank; returns what it held: {parameters, gradients, optimizer, activations} in bytes."""
    with bench.memory_held({}) as held, one_thread():
        main(argv)
    return held



# Llama 3.1 8B where tensor parallelism divides a rank's compute by 8: 22 s of CPU a case (11 s of it the kernel's,
# zeroing the pages of each unit's fresh gathered, gradient and reduce-scatter buffers), against 6.4 s for Llama 3.2
# 1B. Where a rank computes the whole model (tp 1), Llama 3.2 1B: 8B's FSDP rank took 163 s of CPU to its first
# step's end at 16 tokens (127 s of it the kernel's, those pages), and HSDP's rank of 8B holds 1/8 of it, 16 GB of
# model states. The same shapes' rules either way.
SIMULATED = {  # script, the model, the rank simulated of 64, its flags, the Layout's (strategy, dp, tp, replicate)
    "fsdp-rank-0-cpu-offload": ("train_fsdp.py", "llama3.2-1b", 0, ["--cpu_offload"], ("fsdp", 64, 1, 1)),
    "2d-rank-0": ("train_2d.py", "llama3.1-8b", 0, ["--tp", "8", "--dp", "8"], ("2d", 8, 8, 1)),
    "2d-rank-63": ("train_2d.py", "llama3.1-8b", 63, ["--tp", "8", "--dp", "8"], ("2d", 8, 8, 1)),
    "hsdp-rank-0": ("train_fsdp.py", "llama3.2-1b", 0, ["--replicate", "8"], ("fsdp", 64, 1, 8)),
}


@pytest.mark.parametrize("case", list(SIMULATED))
def test_a_simulated_rank_of_64_holds_the_planned_model_states(corpus, case):
    """simulate.py runs the script as one rank of 64 through the fake process group (in its own process: the group
    and RANK are its own), with the corpus' 256 tokens for a vocabulary (the plan reads it from meta.json as the run
    does) and 16 tokens a sequence, one step. Its parameters, gradients and AdamW state are plan.py's model states to
    the byte, from plan.parameter_plan with the scripts' own units and TP rule; the first micro-batch's activations
    (what autograd saved, gathered weights left out) and the gathered weights are the plan's within 10%; under
    --cpu_offload the host arenas (pinned on CUDA) and AdamW's pageable state are plan.host_plan's to the byte."""
    script, model, rank, extra, (strategy, dp, tp, replicate) = SIMULATED[case]
    argv = ["--model", model, "--data", corpus, "--block_size", "16", "--global_batch", str(dp), "--max_steps", "1",
            *extra]
    code = f"import json, simulate; print('MEASURED', json.dumps(simulate.simulate({script!r}, {argv!r}, {rank}, 64)))"
    memory = {"TMPDIR": "/dev/shm"} if os.path.isdir("/dev/shm") else {}  # 8B's 1.3 GB checkpoint in memory: 17 s
    # to a loaded disk
    done = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=dict(os.environ, OMP_NUM_THREADS="1", **memory),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.split("MEASURED ")[-1])
    config = gpt.make_config(model, 256, 16, 0.0)
    layout = plan.Layout(strategy, 64, dp, tp, micro_batch=1, replicate=replicate, device="cpu",
                         cpu_offload="--cpu_offload" in extra)
    own = dict(sliced=train_tp.is_sliced, units=train_fsdp.flat_parameter_groups)  # the strategies' code
    params, tensors, *_ = plan.parameter_plan(config, layout, **own)
    print(case, measured)
    planned = [size for _, size in plan.model_states(params, tensors)]
    assert planned == [measured["parameters"], measured["gradients"], measured["optimizer"]]
    rows = plan.plan_memory(config, layout, **own)
    for kinds, what in [(("activations", "embeddings", "loss"), "activations"), (("gathered",), "gathered weights")]:
        size = sum(size for item, size in rows if item.startswith(kinds))
        print(f"{case}: {what} planned {size:,} bytes, measured {measured[what]:,}")
        assert abs(size - measured[what]) <= ACTIVATION_TOLERANCE * measured[what]
    if layout.cpu_offload:
        host = plan.host_plan(config, layout, own["units"], own["sliced"])
        assert [measured["host, pinned (arenas)"], measured["host, pageable (optimizer state)"]] == [
            sum(size for item, size in host if not item.startswith("AdamW")),
            sum(size for item, size in host if item.startswith("AdamW"))]



GATHERED = {  # script, the model, its flags, the Layout's (world, dp, tp)
    "fsdp-untied-head": ("train_fsdp.py", "llama-tiny", [], (2, 2, 1)),
    "fsdp-untied-head-activation-checkpointing": ("train_fsdp.py", "llama-tiny", ["--activation_checkpointing"],
                                                  (2, 2, 1)),
    "fsdp-tied-embeddings": ("train_fsdp.py", "tiny", [], (2, 2, 1)),
    "2d": ("train_2d.py", "llama-tiny", ["--tp", "2", "--dp", "2"], (4, 2, 2)),
}


@pytest.mark.parametrize("case", list(GATHERED))
def test_fsdp_plans_the_most_weights_a_step_gathers(corpus, tmp_path, case):
    """The most bytes of gathered units at once over a whole step, forward and backward (bench.memory_held samples
    at every gather), are the plan's within the plan tests' tolerance: two neighbouring units in run order, and a
    tied weight's unit all step. A 4,096-token vocabulary makes the LM head's unit the largest, so a plan that adds it
    to two blocks is off by 73% (llama-tiny: measured 2,885,120 bytes, the head's unit and the last block's)."""
    script, model, extra, (world, dp, tp) = GATHERED[case]
    data = tmp_path / "data"  # the corpus' ids, read as ids of a larger vocabulary
    shutil.copytree(corpus, data)
    meta = dict(prepare_data.load_meta(corpus), vocab_size=4096)
    (data / "meta.json").write_text(json.dumps(meta))
    argv = ["--model", model, "--data", str(data), "--block_size", "16", "--global_batch", str(dp), "--max_steps",
            "1", *extra]
    code = f"import json, simulate; print('MEASURED', json.dumps(simulate.simulate({script!r}, {argv!r}, 0, {world})))"
    done = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.split("MEASURED ")[-1])["gathered weights"]
    layout = plan.Layout("2d" if tp > 1 else "fsdp", world, dp, tp, micro_batch=1, device="cpu",
                         activation_checkpointing="--activation_checkpointing" in extra)
    rows = plan.plan_memory(gpt.make_config(model, 4096, 16, 0.0), layout, sliced=train_tp.is_sliced,
                            units=train_fsdp.flat_parameter_groups)
    planned = sum(size for item, size in rows if item.startswith("gathered"))
    print(f"{case}: gathered weights planned {planned:,} bytes, measured {measured:,}")
    assert abs(planned - measured) <= ACTIVATION_TOLERANCE * measured

BF16_PLANNED = ["single", "fsdp", "2d-sequence-parallel"]  # bf16 is slow on CPU: the three kinds of autocast rules


@pytest.mark.parametrize("checkpointing", [False, True], ids=["", "activation-checkpointing"])
@pytest.mark.parametrize("layout, dtype", [(layout, "float32") for layout in PLANNED]
                         + [(layout, "bfloat16") for layout in BF16_PLANNED])
def test_plan_matches_what_a_run_holds(corpus, shared_tmp, layout, dtype, checkpointing):
    """In bfloat16 the activations include autocast's copies of the weights that the matmuls save (the plan's
    "bfloat16 copies" row), and the plan follows CPU's autocast (Layout.device)."""
    main, ranks, extra, (strategy, dp, tp), options = PLANNED[layout]
    argv = flags(corpus, shared_tmp, max_steps=1, activation_checkpointing=checkpointing, dtype=dtype, **extra)
    held = run_distributed(ranks, _memory_held, main, argv)
    # every rank of these layouts holds alike, but for the causal masks CPU's attention builds for the all-gather's
    # query chunks, of their own sizes (rank 0's first chunk needs none): a few hundred bytes
    allgather = strategy == "cp" and options.get("cp_impl") != "ring"
    alike = [dict(rank, activations=0) for rank in held] if allgather else held
    assert all(rank == alike[0] for rank in alike)
    micro_batch = 2
    rows = dict(plan.plan_memory(gpt.make_config(extra.get("model", "tiny"), 256, 32), plan.Layout(
        strategy, ranks, dp, tp, micro_batch, dtype, activation_checkpointing=checkpointing, device="cpu", **options),
        sliced=train_tp.is_sliced, units=train_fsdp.flat_parameter_groups))
    planned = lambda prefix: sum(size for item, size in rows.items() if item.startswith(prefix))  # noqa: E731
    assert (planned("parameters"), planned("gradients"), planned("AdamW")) == (
        held[0]["parameters"], held[0]["gradients"], held[0]["optimizer"])
    activations = planned("activations") + planned("embeddings") + planned("loss") + planned("bfloat16 copies")
    print(f"{layout}: activations planned {activations:,} bytes, measured {held[0]['activations']:,}")
    assert abs(activations - held[0]["activations"]) <= ACTIVATION_TOLERANCE * held[0]["activations"]


def test_plan_prints_without_building_the_model(capsys, tmp_path):
    """GPT-3 175B on 64 GPUs of 80 GB, in seconds and on meta: every item, the total and the verdict; nothing is
    written. The same model on one GPU does not fit, and the verdict says what to try."""
    argv = ["--plan", "--world_size", "64", "--tp", "8", "--model", "gpt3-175b", "--block_size", "2048",
            "--micro_batch", "1", "--global_batch", "64", "--dtype", "bfloat16", "--activation_checkpointing",
            "--data", str(tmp_path / "not_prepared"), "--out_dir", str(tmp_path / "out")]
    start = time.perf_counter()
    code, printed = command_line(train_2d.main, argv, capsys)
    assert code == 0 and time.perf_counter() - start < 30
    assert "gpt3-175b (174.6B parameters, vocabulary 50,257) | 2d on 64 ranks (dp 8 x tp 8)" in printed
    for item in ("parameters", "gradients", "AdamW state", "activations of the blocks", "gathered weights",
                 "total, one rank"):
        assert item in printed
    assert re.search(r"fits on 80 GB with [\d.]+ GB free", printed)
    assert not (tmp_path / "out").exists()
    sizes = [line for line in printed.splitlines() if line.startswith("  ")]
    assert len({len(line) for line in sizes}) == 1, sizes  # every size in one column, the longest item's too
    code, printed = command_line(train_single.main, ["--plan", "--model", "gpt3-175b", "--data", str(tmp_path)],
                                 capsys)
    assert code == 0 and re.search(r"does not fit: needs [\d,.]+ GB; try .*train_fsdp.py", printed)


def test_the_plans_the_docs_print_are_what_plan_prints(capsys, monkeypatch, tmp_path):
    """Every `$ python train_X.py --plan ...` the docs show, run as written (on meta; the data folder it names is
    never read): it prints the docs' lines, to the digit. A change to the planner (a row, its dtype, a pipeline
    stage's point-to-point buffers) fails here until the docs print what the planner now says."""
    monkeypatch.chdir(tmp_path)  # the command's relative paths: nothing is read or written there
    shown = [block for text in documentation().values() for block in re.findall(r"```\n(\$ python .*?)```", text, re.S)]
    assert len(shown) >= 2
    for block in shown:
        command, *expected = block.replace("\\\n", " ").splitlines()
        script, *argv = shlex.split(command)[2:]
        code, printed = command_line(importlib.import_module(script.removesuffix(".py")).main, argv, capsys)
        assert code == 0 and printed.splitlines() == expected, f"{command}\nprints\n{printed}"


def test_plan_reads_the_strategies_own_code():
    """The planner and the formulas count what the strategies build with the strategies' own functions, passed in
    by the caller (plan.py imports no training script): a layout that needs one and lacks it is refused."""
    config = gpt.make_config("tiny", 256, 32)
    with pytest.raises(ValueError, match="sliced=train_tp.is_sliced"):
        plan.plan_memory(config, plan.Layout("tp", 2, 1, 2, 2))
    with pytest.raises(ValueError, match="units=train_fsdp.flat_parameter_groups"):
        plan.plan_memory(config, plan.Layout("fsdp", 2, 2, 1, 2))
    with pytest.raises(ValueError, match="buckets=train_ddp.assign_buckets"):
        plan.comm_formula("ddp", config, 8, dp=2)
    with pytest.raises(ValueError, match="buckets=train_ddp.assign_buckets"):
        plan.plan_memory(config, plan.Layout("zero", 2, 2, 1, 2))
    with open(os.path.join(HERE, "plan.py")) as f:
        tree = ast.parse(f.read())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in node.names} | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not [name for name in imported if name and name.startswith("train_")], imported


def test_activation_checkpointing_keeps_only_block_inputs():
    """Planned: with checkpointing each block keeps its input alone (float32 [b, s, h]); the GPT-3 presets at
    every tensor-parallel degree plan on meta."""
    config = gpt.make_config("tiny", 256, 32)
    layout = plan.Layout("single", 1, 1, 1, 2)
    without = dict(plan.plan_memory(config, layout))["activations of the blocks"]
    with_it = dict(plan.plan_memory(config, layout._replace(activation_checkpointing=True)))
    assert with_it["activations of the blocks"] == config.n_layer * 2 * 32 * 128 * 4 < without / 10
    for preset in (p for p in gpt.PRESETS if p.startswith("gpt3")):
        for tp in (1, 2, 4, 8):
            config = gpt.make_config(preset, 50257, 2048)
            training.check_tensor_parallel(config, tp, True)
            assert plan.plan_memory(config, plan.Layout("2d", 8 * tp, 8, tp, 1, "bfloat16"), **bench.STRATEGY_CODE)


# ------------------------------------------------------------------------------------------------------------
# Running for real: launches through torchrun as a user would, on one machine, CPU and gloo. Two launches
# rendezvous as two nodes; a worker killed mid-run ends the job and `--resume` finishes it; torchrun's
# `--max-restarts` restarts a killed worker from its checkpoint; mismatched flags or code and a stuck rank end
# the job with a message instead of a hang; a broken checkpoint is refused on every rank.
#
# Faults are injected by a small wrapper script (written to the test's tmp_path) that patches training.get_lr,
# which every script calls once at the start of every optimizer step, and then runs the real script with runpy:
# the script's own file is what runs and what its code fingerprint hashes.

LAUNCH_TIMEOUT_S = 120  # a whole launch; a hang fails the test instead of the suite
LAUNCHED_TIMEOUT_S = 20  # --timeout of the launched runs: a failure must end the job well before it
KILL_STEP = 3  # with --ckpt_interval 2 the latest checkpoint is then step 2's: steps 2 and 3 are redone


def _descendants(pid):
    """Every process below pid. torchrun starts each worker in its own session, so killing the launcher's
    process group would leave them running."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # exited meanwhile
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@contextlib.contextmanager
def launcher(tmp_path):
    """Yields start(*torchrun_args) -> Launch. On leaving, whatever is still running is killed, workers
    included, so a failed test never leaves a process behind."""
    launches = []

    def start(*torchrun_args, via_torchrun=True, cwd=HERE, **env_overrides):
        log = open(tmp_path / f"launch{len(launches)}.log", "w+")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env_overrides)  # one thread a rank
        launch = ["-m", "torch.distributed.run"] if via_torchrun else []  # else torchrun_args: a plain `python ...`
        process = subprocess.Popen([sys.executable, *launch, *torchrun_args], cwd=cwd,
                                   stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        launches.append(Launch(process, log))
        return launches[-1]

    try:
        yield start
    finally:
        for launch in launches:
            if launch.process.poll() is None:
                for pid in _descendants(launch.process.pid) + [launch.process.pid]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                launch.process.wait()
            launch.log.close()


class Launch:
    def __init__(self, process, log):
        self.process, self.log = process, log

    def wait(self, timeout=LAUNCH_TIMEOUT_S):
        """(exit code, everything torchrun and its workers printed, time of exit)."""
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"launch still running after {timeout}s:\n{self.output()[-5000:]}")
        return code, self.output(), time.time()

    def output(self):
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()


def standalone(nproc, script, argv, *options):
    return ("--standalone", f"--nproc-per-node={nproc}", *options, script, *argv)


FAULT_WRAPPER = '''
import os, runpy, signal, sys, time
rank = int(os.environ["RANK"])
repo = {stale_folder!r} if rank == {rank} and {stale_folder!r} else {repo!r}
sys.path.insert(0, repo)
import training

real_get_lr = training.get_lr


def get_lr(step, args):
    if rank == {rank} and step == {step} and not os.path.exists({marker!r}):
        with open({marker!r}, "w") as f:  # once: a restarted worker runs clean; the time tells when it struck
            f.write(str(time.time()))
        {fault}
    return real_get_lr(step, args)


training.get_lr = get_lr
script = os.path.join(repo, {script!r})
if rank == {rank}:
    sys.argv += {extra_argv!r}
sys.argv[0] = script
runpy.run_path(script, run_name="__main__")
'''

STUCK_GRACE_S = 2  # a stuck rank's SIGTERM grace: training.SIGTERM_GRACE_S's 20 s would only be waited out
FAULTS = {"kill": "os.kill(os.getpid(), signal.SIGKILL)", "none": "pass",
          "hang": f"training.SIGTERM_GRACE_S = {STUCK_GRACE_S}; time.sleep(3600)",
          "sigterm_torchrun": "os.kill(os.getppid(), signal.SIGTERM)"}  # a worker's parent is torchrun's agent


def fault_wrapper(tmp_path, script="train_ddp.py", rank=1, step=KILL_STEP, fault="none", extra_argv=(),
                  stale_folder=""):
    """A script that runs `script` on every rank and, on `rank`, injects `fault` at the start of `step` (once
    per marker file), adds `extra_argv` to its flags, or runs the project from `stale_folder` instead."""
    path = tmp_path / f"fault_{fault}.py"
    marker = str(tmp_path / f"fault_{fault}.marker")
    path.write_text(FAULT_WRAPPER.format(repo=HERE, rank=rank, step=step, marker=marker, fault=FAULTS[fault],
                                         extra_argv=list(extra_argv), script=script,
                                         stale_folder=stale_folder))
    return str(path), marker


def launch_with_fault(tmp_path, fault, argv):
    """torchrun of train_ddp.py on 2 ranks, `fault` striking rank 1 at KILL_STEP: (torchrun's exit code, its output,
    the seconds from the fault to torchrun's end)."""
    wrapper, marker = fault_wrapper(tmp_path, fault=fault)
    with launcher(tmp_path) as start:
        code, output, ended = start(*standalone(2, wrapper, argv)).wait()
    return code, output, ended - fault_time(marker)


def fault_time(marker):
    with open(marker) as f:
        return float(f.read())


def resumed_records(out_dir):
    """metrics.jsonl records written after the last restart: a resumed run starts over at its checkpoint's step."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    starts = [i for i in range(1, len(records)) if records[i]["step"] <= records[i - 1]["step"]]
    return records[starts[-1]:] if starts else records


def uninterrupted_ddp(corpus, tmp_path_factory, **overrides):
    """train_ddp.py on 2 forked gloo ranks, never interrupted (test_parallel's cached run): what a run that
    crashed and resumed must equal, bit for bit, having the same ranks, threads and reduction order. Its
    checkpoint interval differs from the crashed runs', which changes nothing but what is saved on the way."""
    return ddp_run(corpus, tmp_path_factory, 2, **overrides)[0]


def assert_identical(run, reference):
    assert run.losses == reference.losses and run.grad_norms == reference.grad_norms
    assert run.lrs == reference.lrs and run.val_losses == reference.val_losses
    assert run.weights.keys() == reference.weights.keys()
    for name in reference.weights:
        assert np.array_equal(run.weights[name], reference.weights[name]), name


# ------------------------------------------------------------------------------------------------------------
# Several nodes


def launch_two_nodes(tmp_path, ranks_per_node, script, argv):
    """Two torchrun launches meeting through the c10d rendezvous as two nodes would; returns what both printed."""
    node = ("--nnodes=2", f"--nproc-per-node={ranks_per_node}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{_free_port()}", f"--rdzv-id=two-nodes-{script}", script, *argv)
    with launcher(tmp_path) as start:
        nodes = [start(*node), start(*node)]
        outcomes = [launch.wait() for launch in nodes]
    for code, output, _ in outcomes:
        assert code == 0, output[-5000:]
    return "".join(output for _, output, _ in outcomes)


@launches_its_own_ranks
def test_two_nodes_rendezvous_and_match_single_node(corpus, tmp_path, tmp_path_factory):
    """Two torchrun launches, one rank each, meet through the c10d rendezvous as two nodes would, and compute
    bit for bit what two ranks on one node compute, and what train_single computes within TOLERANCE."""
    output = launch_two_nodes(tmp_path, 1, "train_ddp.py", flags(corpus, tmp_path / "out"))
    assert "2 rank" in output
    run = read_run(str(tmp_path / "out"))
    assert_identical(run, uninterrupted_ddp(corpus, tmp_path_factory))
    assert_runs_match(run, single_run(corpus, tmp_path_factory))


@launches_its_own_ranks
def test_two_nodes_of_two_ranks_train_2d(corpus, tmp_path, tmp_path_factory):
    """train_2d.py --tp 2 --dp 2 on two 2-rank "nodes": torchrun numbers a node's ranks consecutively, so each
    tensor-parallel group is one node and FSDP's data-parallel groups cross them; the run equals, bit for bit,
    the same grid forked on one machine, dropout masks included (each rank seeds its generators from its
    global rank, however it was started)."""
    argv = flags(corpus, tmp_path / "out", tp=2, dp=2, dropout=DROPOUT)
    output = launch_two_nodes(tmp_path, 2, "train_2d.py", argv)
    assert "TP groups [[0, 1], [2, 3]] | DP groups [[0, 2], [1, 3]]" in output
    assert_identical(read_run(str(tmp_path / "out")), run_2d(corpus, tmp_path_factory, 4, tp=2, dp=2, dropout=DROPOUT))


# ------------------------------------------------------------------------------------------------------------
# A worker dies


@launches_its_own_ranks
def test_killed_worker_ends_the_job_then_resume_finishes_it(corpus, tmp_path, tmp_path_factory):
    """The resumed run goes through forked gloo workers rather than a second torchrun: the same ranks and
    threads, seconds faster to start. With dropout: the masks after the resume are the ones the killed run would
    have drawn."""
    out_dir = tmp_path / "out"
    argv = flags(corpus, out_dir, ckpt_interval=2, timeout=LAUNCHED_TIMEOUT_S, dropout=DROPOUT)
    code, output, seconds = launch_with_fault(tmp_path, "kill", argv)
    print(f"\nkilled rank 1 at step {KILL_STEP}: torchrun exited {code} {seconds:.1f}s later")
    assert code != 0
    assert seconds < LAUNCHED_TIMEOUT_S, output[-5000:]
    # torchrun names rank 1 and its SIGKILL: as the root cause, or under Failures when rank 0's "Connection closed
    # by peer" is stamped first (its error file holds the time of the exception; rank 1's death, the time seen)
    assert re.search(r"rank      : 1 \(local_rank: 1\)\n\s*exitcode  : -9 .*SIGKILL", output), output[-5000:]
    assert checkpoint.latest(str(out_dir)).endswith("ckpt-0000002")

    run_distributed(2, train_ddp.main, argv + ["--resume"])
    assert [r["step"] for r in resumed_records(out_dir)] == [2, 3, 4, 5]
    assert_identical(read_run(str(out_dir)), uninterrupted_ddp(corpus, tmp_path_factory, dropout=DROPOUT))


@launches_its_own_ranks
def test_sigterm_to_torchrun_saves_the_step_and_resume_is_bit_identical(corpus, tmp_path, tmp_path_factory):
    """A scheduler's preemption: SIGTERM to torchrun during step 3. torchrun passes it on to every rank, they finish
    the step, save step 4's checkpoint and exit with PREEMPTED_EXIT_CODE, saying so in one line; the resumed run
    ends bit-identical to the one never stopped, dropout masks included."""
    out_dir = tmp_path / "out"
    argv = flags(corpus, out_dir, ckpt_interval=100, timeout=LAUNCHED_TIMEOUT_S, dropout=DROPOUT)
    code, output, seconds = launch_with_fault(tmp_path, "sigterm_torchrun", argv)
    print(f"\nSIGTERM to torchrun at step {KILL_STEP}: torchrun exited {code} {seconds:.1f}s later")
    assert code != 0 and seconds < training.SIGTERM_GRACE_S, output[-5000:]
    stopped = f"error: stopped on request (SIGTERM) after step {KILL_STEP}, "  # the last step logged
    assert output.count(stopped) == 1, output[-5000:]
    assert output.count("Traceback") == 1 and output.count("SignalException") == 2, output[-5000:]  # torchrun's own
    assert checkpoint.latest(str(out_dir)).endswith(f"ckpt-{KILL_STEP + 1:07d}")

    run_distributed(2, train_ddp.main, argv + ["--resume"])
    assert_identical(read_run(str(out_dir)), uninterrupted_ddp(corpus, tmp_path_factory, dropout=DROPOUT))


@launches_its_own_ranks
def test_elastic_restart_resumes_from_the_checkpoint(corpus, tmp_path, tmp_path_factory):
    """--resume from the first launch: the first attempt starts fresh, the restarted one resumes (with dropout:
    drawing the masks the killed attempt would have drawn).

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: since torch 2.5 the workers share the rendezvous' TCPStore, and a
    restarted worker group can read the previous attempt's addresses from it (pytorch/pytorch#135712): on
    torch 2.13 + gloo the restarted ranks fail in init_process_group with "Gloo connectFullMesh failed ...
    Connection refused" without it."""
    out_dir = tmp_path / "out"
    argv = flags(corpus, out_dir, ckpt_interval=2, timeout=LAUNCHED_TIMEOUT_S, resume=True, dropout=DROPOUT)
    wrapper, marker = fault_wrapper(tmp_path, fault="kill")
    with launcher(tmp_path) as start:
        code, output, _ = start(*standalone(2, wrapper, argv, "--max-restarts=1"),
                                TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1").wait()
    assert code == 0, output[-5000:]
    assert os.path.exists(marker), "the fault never struck"
    assert "from scratch" in output and "resuming at step 2" in output
    assert [r["step"] for r in resumed_records(out_dir)] == [2, 3, 4, 5]
    assert_identical(read_run(str(out_dir)), uninterrupted_ddp(corpus, tmp_path_factory, dropout=DROPOUT))


@launches_its_own_ranks
def test_stuck_rank_makes_the_others_time_out(corpus, tmp_path):
    """A rank that stops taking part (a deadlock, a stalled link) ends the job after --timeout, not never."""
    timeout = 5
    argv = flags(corpus, tmp_path / "out", timeout=timeout)
    code, output, seconds = launch_with_fault(tmp_path, "hang", argv)
    print(f"\nrank 1 stuck at step {KILL_STEP}: torchrun exited {code} {seconds:.1f}s later")
    assert code != 0
    # torchrun ends rank 1 with SIGTERM, which gives it a grace (STUCK_GRACE_S) to save a step it will never finish:
    # its alarm ends it then, well before torchrun's SIGKILL 30 s after the SIGTERM
    assert timeout <= seconds < timeout + STUCK_GRACE_S + 15, output[-5000:]
    root_cause = output.split("Root Cause")[-1]
    # gloo words rank 0's timeout either way: "Timed out ..." or "Application timeout caused pair closure"
    assert "rank      : 0 (local_rank: 0)" in root_cause and re.search("Timed out|Application timeout", root_cause), \
        output[-5000:]


# ------------------------------------------------------------------------------------------------------------
# Ranks that disagree, checkpoints that are broken


@launches_its_own_ranks
@pytest.mark.parametrize("disagreement", ["arguments", "code"])
def test_ranks_that_disagree_stop_at_start(corpus, tmp_path, disagreement):
    """Other flags on one rank of train_ddp.py, or on one rank of train_2d.py a stale copy of train_tp.py, a module
    it imports (rank 1 runs the project from a folder where that file alone differs): every rank stops before
    training, naming what differs."""
    argv = flags(corpus, tmp_path / "out", timeout=LAUNCHED_TIMEOUT_S)
    if disagreement == "arguments":
        wrapper, _ = fault_wrapper(tmp_path, extra_argv=["--lr", "0.002"])
    else:
        stale = tmp_path / "stale"
        stale.mkdir()
        for name in os.listdir(HERE):
            if name.endswith(".py"):
                shutil.copy(os.path.join(HERE, name), stale)
        with open(stale / "train_tp.py", "a") as f:
            f.write("# one line more than on rank 0\n")
        wrapper, _ = fault_wrapper(tmp_path, script="train_2d.py", stale_folder=str(stale))
        argv += ["--tp", "2", "--dp", "1"]
    with launcher(tmp_path) as start:
        began = time.time()
        code, output, ended = start(*standalone(2, wrapper, argv)).wait()
    print(f"\n{disagreement} differ on rank 1: torchrun exited {code} {ended - began:.1f}s after launch")
    assert code != 0
    assert f"ranks [1] run other {disagreement}" in output, output[-5000:]
    assert disagreement == "arguments" or "(rank 0 vs rank 1: train_tp.py)" in output, output[-5000:]
    assert "step     0" not in output
    assert not os.path.exists(tmp_path / "out" / "metrics.jsonl")


def test_the_code_fingerprint_covers_torch_reference_before_it_is_imported(monkeypatch):
    """--impl torch imports torch_reference.py inside main(), after the ranks compared their code: the fingerprint
    hashes it all the same, so a stale copy of it on one rank is refused at start too."""
    monkeypatch.delitem(sys.modules, "torch_reference", raising=False)
    assert "torch_reference.py" in training.project_code()


def documentation():
    """What a user reads: README.md and docs/*.md, by path, README first."""
    docs = sorted(os.path.join("docs", name) for name in os.listdir(os.path.join(HERE, "docs")) if name.endswith(".md"))
    texts = {}
    for name in ["README.md", *docs]:
        with open(os.path.join(HERE, name)) as f:
            texts[name] = f.read()
    return texts


def readme_section(section):
    """The text under the heading `section` (of any level) in README.md or docs/*.md, up to the next heading of the
    same or a higher level. A `#` line inside a code block is no heading. The heading must be there exactly once, so
    a section that moves between files is still found, and two sections of one name fail instead of hiding one."""
    found = []
    for text in documentation().values():
        level, lines, fenced = None, [], False
        for line in text.splitlines():
            if line.lstrip().startswith("```"):
                fenced = not fenced
            heading = None if fenced else re.match(r"(#+) (.+)", line)
            if heading and level is not None and len(heading.group(1)) <= level:
                found.append("\n".join(lines))
                level = None
            if heading and heading.group(2) == section:
                level, lines = len(heading.group(1)), []
            elif level is not None:
                lines.append(line)
        if level is not None:
            found.append("\n".join(lines))
    assert len(found) == 1, f"{len(found)} sections named {section!r} in README.md and docs/*.md"
    return found[0]


def readme_commands(section, start):
    """The commands of a README or docs/ section's bash blocks that begin with `start`, in order, as a user types
    them (either side of an `&&`, without the comment)."""
    text = readme_section(section)
    lines = "".join(re.findall(r"```bash\n(.*?)```", text, re.S)).splitlines()
    commands = [command.strip() for line in lines for command in line.split("#")[0].split("&&")]
    return [command for command in commands if command.startswith(start)]


SHORTER_RUN = ["--max_steps", "2", "--block_size", "32", "--global_batch", "8", "--eval_iters", "1",
               "--sample_tokens", "8"]


CHAPTERS = ["train_ddp.py", "train_zero.py", "train_fsdp.py", "train_tp.py", "train_2d.py", "train_pp.py", "train_cp.py"]


def chapter_examples():
    """Each chapter's examples in the README's order: its script's docstring (--help) commands that run on a CPU, on the
    tiny model (torchrun --standalone, but not --impl torch of train_cp.py: torch's context_parallel needs CUDA)."""
    commands = []
    for script in CHAPTERS:
        text = open(os.path.join(HERE, script)).read().split('"""')[1].replace("\\\n", " ")
        commands += [line.split("#")[0].strip() for line in text.splitlines()
                     if "--standalone" in line and not ("train_cp.py" in line and "--impl torch" in line)]
    return commands


def same_run(command):
    """A command's script and flags, less torchrun's and the layout's sizes: two commands alike here train the same run
    on two layouts (the one principle), which the second one would --resume, not start again."""
    return re.sub(r" --[tdc]p \d+", "", command.split("train_", 1)[1])


RUNS_IN_ONE_LAUNCH = '''
import os, runpy, sys, warnings
from datetime import timedelta

import torch.distributed as dist
import training

exit_codes, run_and_exit = [], training.run
training.run = lambda main: exit_codes.append(training.exit_code(main))  # a script's own end, less the exit


def runs():
    if "RANK" in os.environ:  # one group for every run, as under `torchrun -m pytest` (made anew, it broke a run)
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    os.makedirs("runs", exist_ok=True)
    for index, command in enumerate(sys.argv[1:]):  # each a script and its flags, as `python` would be given them
        sys.argv = command.split()
        with open(f"runs/{index}-rank{os.environ.get('RANK', 0)}.log", "w") as log, warnings.catch_warnings():
            terminal = os.dup(1), os.dup(2)
            os.dup2(log.fileno(), 1), os.dup2(log.fileno(), 2)  # torch's C++ warnings too
            try:
                runpy.run_path(sys.argv[0], run_name="__main__")
            finally:
                sys.stdout.flush(), sys.stderr.flush()
                os.dup2(terminal[0], 1), os.dup2(terminal[1], 2)
        if exit_codes[-1]:
            sys.exit(exit_codes[-1])


run_and_exit(runs)
'''


@launches_its_own_ranks
def test_quick_start_and_each_chapters_examples_run_in_the_readme_order(corpus, tmp_path):
    """The README's Quick start, then each chapter's examples, command after command as written, in one fresh copy of
    the scripts (its data folder is the session's corpus), with flags that only make the runs shorter: no run refuses
    a folder a run before it filled, since every script and every variant of one has its own default --out_dir. A
    command that trains the same run as one before it on another layout (the same flags, more ranks) is left out.
    The commands launched alike (`python`, or torchrun with the same flags) run in one launch, in the README's order,
    each as its script's __main__ in turn, so torch and a launch start 3 times instead of 21: the runs share one
    process group (each script's own, made by torchrun's rendezvous, is test_a_copied_script_runs_...'s), and each
    run's screen, every rank's, is read apart (a warning printed once a process fails the first run that causes it)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in os.listdir(HERE):
        if name.endswith(".py"):
            shutil.copy(os.path.join(HERE, name), repo)
    (repo / "data").mkdir()
    (repo / "data" / "default").symlink_to(corpus)
    (repo / "runs_in_one_launch.py").write_text(RUNS_IN_ONE_LAUNCH)
    commands = readme_commands("Quick start", ("python train_", "torchrun"))
    assert commands[0] == "python train_single.py" and len(commands) >= 5, commands
    examples = chapter_examples()
    assert any("--stage 2" in c for c in examples) and any("--cp_impl ring" in c for c in examples), examples
    runs, launches = [], {}  # how commands are launched (torchrun's flags; none: `python`) -> the commands, in order
    for command in commands + examples:
        if "pytest" in command or same_run(command) in runs:
            continue
        runs.append(same_run(command))
        words = command.split()
        script = next(i for i, word in enumerate(words) if word.endswith(".py"))
        launches.setdefault(tuple(words[1:script]), []).append((command, " ".join(words[script:] + SHORTER_RUN)))
    with launcher(tmp_path) as start:
        for torchrun, started in launches.items():
            shutil.rmtree(repo / "runs", ignore_errors=True)
            launch = start(*torchrun, "runs_in_one_launch.py", *[run for _, run in started], cwd=repo,
                           via_torchrun=bool(torchrun))
            code, screen, _ = launch.wait(LAUNCH_TIMEOUT_S * len(started))
            for index, (command, _) in enumerate(started):
                output = "".join(log.read_text() for log in sorted((repo / "runs").glob(f"{index}-rank*.log")))
                assert "from scratch" in output and "sample:" in output, f"{command}\n{output[-3000:]}{screen[-3000:]}"
                # A healthy run's screen holds no warning, of Python's or torch's (e.g. a module hook that misfires),
                # but for the pipeline's yardstick: its DistributedDataParallel needs find_unused_parameters, and says
                # so in C++
                if "train_pp.py --impl torch" not in command:
                    assert not re.search(r"Warning\b|\[W\d{4}", output), f"{command}\n{output[-3000:]}"
                if command.endswith("train_pp.py"):  # the global batch of 8 pipelines as 4 micro-batches of 2: 2 x pp
                    assert "micro batch 2 x 4 accumulation" in output, output
                    assert "bubble (p - 1) / (m + p - 1) = 0.20" in output, output
            assert code == 0 and not re.search(r"Warning\b|\[W\d{4}", screen), f"{started}\n{screen[-3000:]}"
    assert sorted(os.listdir(repo / "out")) == [
        "2d", "2d-sequence_parallel", "2d-torch", "cp", "cp-ring", "ddp", "ddp-torch", "fsdp", "fsdp-replicate2",
        "fsdp-torch", "llama-tiny", "pp", "pp-gpipe", "pp-torch", "single", "tp", "tp-sequence_parallel", "tp-torch",
        "zero", "zero-stage2", "zero-torch"]


WALKTHROUGH_SHORTER = {  # how a walkthrough's command starts -> flags appended that only make it smaller
    "python prepare_data.py": ["--num_proc", "1"],
    "python hugging_face.py": ["--n_layer", "2", "--n_head", "2", "--n_embd", "64"],
    "torchrun": ["--max_steps", "1", "--eval_iters", "1"],
    "python sample.py": ["--sample_tokens", "8"],
}


def walkthrough(section):
    """The bash blocks of a README or docs/ section as one script, a command a line, with WALKTHROUGH_SHORTER's flags
    appended to the commands that write a model, train or sample (after any comment is cut)."""
    script = "".join(re.findall(r"```bash\n(.*?)```", readme_section(section), re.S)).replace("\\\n", " ")
    lines = []
    for line in script.splitlines():
        shorter = next((flags for start, flags in WALKTHROUGH_SHORTER.items() if line.startswith(start)), None)
        lines.append(line if shorter is None else " ".join([line.split(" #")[0].rstrip(), *shorter]))
    return "\n".join(lines)


@launches_its_own_ranks
def test_fine_tuning_walkthroughs_run_as_written(corpus, tmp_path):
    """The README's CPU fine-tuning walkthrough and its export, then docs/fine-tuning.md's loading measurement, each as
    one bash script of its text's commands, in a fresh copy of the project's files: the walkthrough makes its own
    text folder and its GPT-2 with the project's own script (hugging_face.py), at a few steps and a smaller model."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in os.listdir(HERE):
        if name.endswith(".py") and name != "test_parallel.py":  # a user's copy need not hold the tests
            shutil.copy(os.path.join(HERE, name), repo)
    (repo / "data").mkdir()
    (repo / "data" / "default").symlink_to(corpus)  # the loading measurement trains on the default corpus
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    outputs = {}
    for section in ["On CPU, offline: fine-tune on a local text folder, then sample",
                    "Out to Hugging Face: export, then load in transformers", "What loading costs"]:
        script = walkthrough(section)
        done = subprocess.run(["bash", "-e", "-c", script], cwd=repo, env=env, capture_output=True, text=True,
                              timeout=LAUNCH_TIMEOUT_S)
        outputs[section] = done.stdout + done.stderr
        assert done.returncode == 0, f"{script}\n{outputs[section][-5000:]}"
    walked = outputs["On CPU, offline: fine-tune on a local text folder, then sample"]
    assert len(list((repo / "texts").glob("*.py"))) > 10 and (repo / "gpt2-tiny" / "model.safetensors").exists()
    assert "from gpt2-tiny's weights" in walked and "step     0 |" in walked, walked[-3000:]
    assert "checkpoint out/finetune/ckpt-0000001 (step 1)\nsample:\ndef " in walked, walked[-3000:]
    exported = outputs["Out to Hugging Face: export, then load in transformers"]
    assert "(step 1) -> finetuned: config.json, model.safetensors, tokenizer.json" in exported, exported[-3000:]
    measured = outputs["What loading costs"]
    assert "pieces of 1/8 of a parameter" in measured and "from gpt2-bytes's weights" in measured, measured[-3000:]


def test_the_quick_start_figures_are_of_the_default_run():
    """The Quick start reports the time, losses and sample of `python train_single.py` and names the flags they
    come from: each must be the parser's default, or the figures describe another run than the one a reader
    starts (the run itself takes two minutes: too long for the suite)."""
    text = readme_section("Quick start").replace("\n", " ")
    named = re.search(r"`python train_single.py` alone is `python train_single.py ([^`]*)`", text)
    assert named, "the Quick start no longer names the flags of its figures"
    argv = named.group(1).split()
    parser = training.get_parser("")
    stated, default = vars(parser.parse_args(argv)), vars(parser.parse_args([]))
    flags_named = {word[2:] for word in argv if word.startswith("--")}
    assert flags_named >= {"max_steps", "global_batch", "block_size", "lr", "min_lr", "warmup_steps"}, flags_named
    assert {flag: stated[flag] for flag in flags_named} == {flag: default[flag] for flag in flags_named}


@launches_its_own_ranks
def test_pytest_under_torchrun_reports_once(tmp_path):
    """The README's `torchrun --nproc_per_node=N -m pytest test_parallel.py`: rank 0 alone shows progress and the
    summary (a failure of any rank still fails the launch)."""
    command = readme_commands("Tests", "torchrun")[0].split()
    assert command[1:3] == ["--nproc_per_node=4", "-m"], command
    selection = ["-p", "no:cacheprovider", "-k", "test_harness_runs_ranks or test_tf32_only_when_asked"]  # no tmp
    with launcher(tmp_path) as start:
        code, output, _ = start("--standalone", "--nproc_per_node=2", *command[2:], *selection).wait()
    assert code == 0, output[-5000:]
    assert output.count("2 passed") == 1 and output.count("collected ") == 1, output
    assert output.count("test_parallel.py ..") == 1, output


def running_with(text):
    """Processes whose command line holds text (a test's own folder): what a launch may have left running."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            if text in f.read().decode(errors="replace") and int(pid) != os.getpid():
                found.append(int(pid))
    return found


@launches_its_own_ranks
@pytest.mark.parametrize("ranks, script, bad, message", [
    (1, "train_single.py", dict(block_size=-5), "argument --block_size: must be a whole number > 0, not '-5'"),
    (2, "train_tp.py", dict(tp=4), "--tp 4 with 2 ranks: train_tp.py is tensor-parallel only"),
    (2, "train_ddp.py", dict(global_batch=3, micro_batch=None), "--global_batch 3 does not split over 2 data-parallel"),
])
def test_bad_launch_is_one_line_from_one_rank(corpus, tmp_path, ranks, script, bad, message):
    """Under torchrun, the ranks' whole output is one line; torchrun's own summary (printed for any failed job)
    names rank 0 with that line, and no rank prints a traceback. Nothing is created, nothing keeps running."""
    out_dir = tmp_path / "out"
    argv = flags(corpus, out_dir, **bad)
    with launcher(tmp_path) as start:
        launch = start(script, *argv, via_torchrun=False) if ranks == 1 else start(*standalone(ranks, script, argv))
        code, output, _ = launch.wait()
    ours = [line for line in output.splitlines() if line.startswith("error: ")]
    assert code != 0 and len(ours) == 1 and message in ours[0], output
    assert "UsageError" not in output and f'File "{os.path.join(HERE, script)}"' not in output, output
    if ranks == 1:
        assert (code, output) == (2, ours[0] + "\n")
    else:
        root_cause = output.split("Root Cause")[-1]  # torchrun's summary, after its traceback; torchrun exits 1
        assert code == 1 and "rank      : 0 (local_rank: 0)" in root_cause and "exitcode  : 2" in root_cause, output
        assert f"traceback : {ours[0]}" in root_cause, output
    assert not os.path.exists(out_dir) and not running_with(str(out_dir))


def _printed(main, argv):
    """What main(argv) prints on this rank (rank 0 alone prints its progress)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(argv)
    return printed.getvalue()


@pytest.mark.parametrize("main, ranks, extra, strategy", [
    (train_ddp.main, 2, {}, "| DDP |"), (train_zero.main, 2, dict(stage=2), "| ZeRO-2 |"),
    (train_fsdp.main, 2, {}, "| FSDP |"), (train_fsdp.main, 4, dict(replicate=2), "| HSDP 2 x 2 |"),
    (train_tp.main, 2, {}, "| tensor parallel 2 "), (train_2d.main, 4, {}, "grid: 2 data-parallel x 2 tensor-parallel"),
    (train_pp.main, 2, {}, "pipeline: 2 stages"), (train_cp.main, 2, {}, "| 2 context-parallel (allgather) |"),
    (train_4d.main, 2, {}, "grid: 2 data (fsdp) x 1 pipeline"),
])
def test_every_scripts_first_line_names_its_strategy(corpus, shared_tmp, main, ranks, extra, strategy):
    """What a user sees first says which strategy runs: no two first lines alike but for the numbers."""
    printed = run_distributed(ranks, _printed, main, flags(corpus, shared_tmp, max_steps=1, eval_interval=0, **extra))
    assert strategy in printed[0].splitlines()[0], printed[0]


def _resume_refused(argv):
    """train_ddp.main(argv) on this rank; returns the message of the error it stops with."""
    try:
        train_ddp.main(argv)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


@launches_its_own_ranks
@pytest.mark.parametrize("damage, message", [
    ("truncate", "unreadable"),
    ("other_model", "another model"),
])
def test_broken_checkpoint_is_refused_on_every_rank(corpus, tmp_path, damage, message):
    run_distributed(2, train_ddp.main, flags(corpus, tmp_path, max_steps=2))
    found = checkpoint.latest(str(tmp_path))
    overrides = dict(max_steps=4, resume=True)
    if damage == "truncate":
        rank_file = os.path.join(found, "rank00000.pt")
        with open(rank_file, "r+b") as f:
            f.truncate(os.path.getsize(rank_file) // 2)
    else:
        overrides["block_size"] = 64
    files = {name: open(os.path.join(found, name), "rb").read() for name in os.listdir(found)}
    metrics = open(tmp_path / "metrics.jsonl").read()
    errors = run_distributed(2, _resume_refused, flags(corpus, tmp_path, **overrides))
    for rank, error in enumerate(errors):
        assert error and message in error, f"rank {rank}: {error}"
    assert checkpoint.latest(str(tmp_path)) == found
    assert {name: open(os.path.join(found, name), "rb").read() for name in os.listdir(found)} == files
    assert open(tmp_path / "metrics.jsonl").read() == metrics  # not a single step was taken


# ------------------------------------------------------------------------------------------------------------
# ---- #18 tensor-parallel memory


def _vocab_parallel_gradient_in_place():
    """One backward of VocabParallelCrossEntropy at vocabulary 300 padded to 384 (rank 1 holds 108 padding classes),
    with a different upstream gradient for every token: (gradient error against F.cross_entropy on the gathered
    logits, the largest gradient of a padding class, the shapes of [tokens, vocab / tp] tensors that backward
    allocated, whether the gradient it returns is the saved softmax's memory)."""
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(3)
    logits, weights = torch.randn(48, 384, generator=generator), torch.rand(48, generator=generator)
    logits[:, 300:] += 10  # padding classes that would dominate if they took part
    targets = torch.randint(0, 300, (48,), generator=generator)
    full = logits.clone().requires_grad_()
    (F.cross_entropy(full[:, :300], targets, reduction="none") * weights).sum().backward()
    local = logits.chunk(world, -1)[rank].clone().requires_grad_()
    saved, returned = [], []
    local.register_hook(lambda grad: returned.append(grad.data_ptr()))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.data_ptr()) or t, lambda t: t):
        loss = (train_tp.VocabParallelCrossEntropy.apply(local, targets, group, 300) * weights).sum()
    with RecordOutputs() as mode:
        loss.backward()
    allocated = [tuple(t.shape) for _, t in mode.outputs if t.shape == local.shape and t.data_ptr() not in saved]
    error = ((local.grad - full.grad.chunk(world, -1)[rank]).abs().max() / full.grad.abs().max()).item()
    padding = local.grad[:, max(0, 300 - rank * 192):].abs().max().item() if rank else 0.0
    return error, padding, allocated, returned[0] in saved


def test_vocab_parallel_cross_entropy_gradient_is_computed_in_the_saved_softmax():
    """The gradient equals F.cross_entropy's on the gathered logits over the real vocabulary (padding classes get
    exactly 0), and backward computes it in place, in the softmax forward saved (as Megatron-LM does): no new
    [tokens, vocab / tp] tensor, which at GPT-2's vocabulary is the largest activation of the step."""
    for error, padding, allocated, in_place in run_distributed(2, _vocab_parallel_gradient_in_place):
        assert error < 1e-6 and padding == 0, (error, padding)
        assert allocated == [] and in_place, allocated


@launches_its_own_ranks
def test_bench_runs_tensor_parallel_on_gpt2_vocabulary_offline(tmp_path):
    """bench.py --vocab_size 50257 --sequence_parallel end to end (no timing asserted): synthetic tokens of GPT-2's
    vocabulary made offline instead of --data, both implementations of tp run with sequence parallelism on them."""
    result_path = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, "bench.py", "--strategies", "tp", "--steps", "4", "--warmup", "1",
                             "--rounds", "1", "--block_size", "32", "--global_batch", "2", "--vocab_size", "50257",
                             "--sequence_parallel", "--data", str(tmp_path / "absent"), "--json", str(result_path)],
                            cwd=HERE, check=True, capture_output=True, text=True, timeout=300)
    assert "tiny, synthetic vocabulary 50257, block 32" in result.stdout and "sequence parallel" in result.stdout
    rows = {(row["strategy"], row["impl"]): row for row in json.loads(result_path.read_text())}
    assert rows.keys() == {("tp", "ours"), ("tp", "torch")} and all(row["tokens_per_s"] > 0 for row in rows.values())
    folder = bench.synthetic_data(str(tmp_path / "tokens"), 50257, num_tokens=100_000)
    tokens = np.fromfile(os.path.join(folder, "train.bin"), dtype=np.uint16)
    assert prepare_data.load_meta(folder)["vocab_size"] == 50257 and tokens.max() > 50000 and tokens.max() < 50257


def _residual_stream_copies(sequence_parallel, model="tiny"):
    config = gpt.make_config(model, vocab_size=256, block_size=16)
    model = _tensor_parallel_model(config, 0, sequence_parallel)
    idx = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    with RecordOutputs() as mode:
        model(idx, idx).backward()
    copies = ("clone", "copy", "cat", "stack", "contiguous")
    return [op.__name__ for op, t in mode.outputs if t.dim() == 3 and t.numel() == 4 * 16 * 128
            and op.__name__.startswith(copies)]


@pytest.mark.parametrize("model", ["tiny", "llama-tiny"])
def test_sequence_parallel_copies_once_a_collective(model):
    """Under sequence parallelism each all-gather and reduce-scatter of the batch-first residual stream copies one
    whole [B, T, C] (to or from the rank-after-rank order the collective works in) and nothing else does: 4 per block
    and 2 more (the embedding's g, the LM head's f), each way (what they cost: README, tensor parallel). Without
    sequence parallelism: no copy at all."""
    for copies in run_distributed(2, _residual_stream_copies, True, model):
        assert copies == ["cat.default"] * 2 * (4 * 4 + 2), copies
    assert run_distributed(2, _residual_stream_copies, False, model) == [[], []]


# ------------------------------------------------------------------------------------------------------------
# ---- #22 an afternoon: a copied script runs with the files the README names; what a reader must read is measured

COPIED_WITH = {  # script -> the files beside it that its default run needs (README, "The files")
    "train_single.py": ["gpt.py", "training.py", "checkpoint.py", "prepare_data.py"],
    "train_ddp.py": ["gpt.py", "training.py", "checkpoint.py", "prepare_data.py"],
    "train_fsdp.py": ["gpt.py", "training.py", "checkpoint.py", "prepare_data.py"],
    "train_tp.py": ["gpt.py", "training.py", "checkpoint.py", "prepare_data.py"],
    "train_2d.py": ["gpt.py", "training.py", "checkpoint.py", "prepare_data.py", "train_tp.py", "train_fsdp.py"],
    "train_pp.py": ["gpt.py", "training.py", "checkpoint.py", "prepare_data.py", "train_ddp.py"],
    "train_zero.py": ["gpt.py", "training.py", "checkpoint.py", "prepare_data.py", "train_ddp.py"],
    "train_cp.py": ["gpt.py", "training.py", "checkpoint.py", "prepare_data.py", "train_ddp.py"],
    "train_4d.py": ["gpt.py", "training.py", "checkpoint.py", "prepare_data.py", "train_tp.py", "train_fsdp.py",
                    "train_pp.py", "train_cp.py", "train_ddp.py"],
    "train_ep.py": ["gpt.py", "training.py", "checkpoint.py", "prepare_data.py"],
}


@launches_its_own_ranks
@pytest.mark.parametrize("script", list(COPIED_WITH))
def test_a_copied_script_runs_with_the_files_the_readme_names(tmp_path, script):
    """The script and exactly the files the README names, alone in an empty folder, run its default run there (the
    embedded corpus built on first use, a few steps, the sample): no import of anything else in this repository."""
    folder = tmp_path / "project"
    folder.mkdir()
    for name in [script] + COPIED_WITH[script]:
        shutil.copy(os.path.join(HERE, name), folder)
    argv = ["--max_steps", "2", "--sample_tokens", "8", "--eval_iters", "1"]
    ranks = 1 if script == "train_single.py" else 2  # train_2d.py, train_pp.py, train_cp.py: --tp, --pp, --cp 2
    with launcher(tmp_path) as start:
        launch = (start(script, *argv, via_torchrun=False, cwd=folder, PYTHONPATH="") if ranks == 1 else
                  start(*standalone(ranks, script, argv), cwd=folder, PYTHONPATH=""))
        code, output, _ = launch.wait()
    assert code == 0 and "from scratch" in output and "sample:" in output, output[-3000:]
    assert os.path.exists(folder / "data" / "default" / "meta.json") and os.path.exists(folder / "out")
    assert sorted(name for name in os.listdir(folder) if name.endswith(".py")) == sorted([script] + COPIED_WITH[script])


def test_the_readme_names_the_files_a_copied_script_needs():
    """The README's sentence on copying a script names exactly COPIED_WITH's files, which the test above runs with."""
    with open(os.path.join(HERE, "README.md")) as f:
        text = " ".join(f.read().split())
    sentence = re.search(r"A script copied into another project needs ([^;]*);", text)
    assert sentence, "the README no longer says what a copied script needs"
    named = set(re.findall(r"`(\w+\.py)`", sentence.group(1)))
    assert named == {"train_2d.py", "train_pp.py", "train_zero.py", "train_cp.py", "train_4d.py"} | {
        name for files in COPIED_WITH.values() for name in files}, named


READER_TOKEN_SKIP = (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.COMMENT,
                     tokenize.ENDMARKER)


def _top_level_definitions(module):
    """{name: (first line, last line, node)} of a project module's top-level definitions, and its imports of project
    modules {alias: (module, name or None)}: at module level, and for a training script those its main() runs first
    (main() imports the shared files, so that the strategy above it needs torch and gpt.py alone)."""
    source = open(os.path.join(HERE, f"{module}.py")).read()
    definitions, imports = {}, {}
    body = ast.parse(source).body
    main = [node.body for node in body if isinstance(node, ast.FunctionDef) and node.name == "main"]
    if main and module.startswith("train_"):
        body += [node for node in main[0] if isinstance(node, (ast.Import, ast.ImportFrom))]
    for node in body:
        if isinstance(node, ast.Import):
            imports.update({a.asname or a.name: (a.name, None) for a in node.names if _is_project(a.name)})
        elif isinstance(node, ast.ImportFrom) and _is_project(node.module):
            imports.update({a.asname or a.name: (node.module, a.name) for a in node.names})
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign)):
            first = min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno])
            targets = [node.name] if hasattr(node, "name") else [
                n.id for t in getattr(node, "targets", [getattr(node, "target", None)]) for n in ast.walk(t)
                if isinstance(n, ast.Name)]
            definitions.update({name: (first, node.end_lineno, node) for name in targets})
    return definitions, imports, source.splitlines()


def _is_project(module):
    return module is not None and os.path.exists(os.path.join(HERE, f"{module}.py"))


def reader_reach(script):
    """What a reader of `script` must read: every top-level definition its main() reaches, transitively, through
    module-level imports (torch_reference.py and prepare_data.py left out, as the issue measures it): {module:
    (lines, tokens)}. A definition counts from its first decorator to its last line."""
    left_out = {"torch_reference", "prepare_data"}
    seen, todo, modules = set(), [(script, "main")], {}
    while todo:
        module, name = todo.pop()
        if (module, name) in seen:
            continue
        seen.add((module, name))
        modules.setdefault(module, _top_level_definitions(module))
        definitions, imports, _ = modules[module]
        for node in ast.walk(definitions[name][2]):
            target = None
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in imports:
                if imports[node.value.id][1] is None:
                    target = (imports[node.value.id][0], node.attr)
            elif isinstance(node, ast.Name):
                if node.id in definitions:
                    target = (module, node.id)
                elif node.id in imports and imports[node.id][1] is not None:
                    target = imports[node.id]
            if target and target[0] not in left_out:
                modules.setdefault(target[0], _top_level_definitions(target[0]))
                if target[1] in modules[target[0]][0]:
                    todo.append(target)
    reach = {}
    for module, name in seen:
        first, last, _ = modules[module][0][name]
        text = "\n".join(modules[module][2][first - 1:last]) + "\n"
        tokens = sum(t.type not in READER_TOKEN_SKIP for t in tokenize.generate_tokens(io.StringIO(text).readline))
        lines, total = reach.get(module, (0, 0))
        reach[module] = (lines + last - first + 1, total + tokens)
    return reach


def imported_at_module_level(module, found=None):
    """The project modules `module` imports at module level (a training script: or in main()'s body), transitively
    (itself included)."""
    found = set() if found is None else found
    if module not in found:
        found.add(module)
        for imported, _ in _top_level_definitions(module)[1].values():
            imported_at_module_level(imported, found)
    return found


def test_what_a_reader_must_read_is_small():
    """The design card's afternoon, measured as issue #22 does: train_single.py reaches at most 10,250 Python tokens
    (twice nanoGPT's model.py and train.py, 8,200, plus what Llama's and the mixture of experts' modules add); every
    other script at most 1,050 lines outside the train_*.py files; copying a script drags along at most 1,675 lines;
    each strategy core names no project module but gpt."""
    for script in ["train_single", "train_ddp", "train_zero", "train_fsdp", "train_tp", "train_2d", "train_cp",
                   "train_4d", "train_ep"]:
        reach = reader_reach(script)
        outside = sum(lines for module, (lines, _) in reach.items() if not module.startswith("train_"))
        dragged = sorted(m for m in imported_at_module_level(script) if not m.startswith("train_"))
        dragged_lines = sum(len(open(os.path.join(HERE, f"{m}.py")).read().splitlines()) for m in dragged)
        print(f"{script}: reaches {sum(l for l, _ in reach.values())} lines, {sum(t for _, t in reach.values())} "
              f"tokens; {outside} lines outside train_*.py; copying drags {dragged_lines} lines ({dragged})")
        # Issue #22's targets were 8,200 tokens, 800 lines, 1,350 lines for GPT-2 alone (measured then: 7,974
        # tokens; 807 lines, train_tp.py; 1,350 lines). Llama 3 added 751 tokens and 89 lines to what a reader
        # reaches (gpt.py: 84 lines), and 155 lines to what a copy drags (gpt.py, and prepare_data.py's tokenizer);
        # issue #30 ~30 lines every script reaches (gpt.py's explicit attention under dropout, the fingerprint of every
        # loaded module and the step's one agreement, generators rebuilt under another layout). Issue #33 ~40 lines
        # and ~570 tokens that start-up needs to scale with a rank's part (gpt.py's tile-wise init, checkpoint.py's
        # copy of only the overlap, the start line's bytes read), 9,582 tokens and 1,574 lines after it. The context-
        # parallel seam in gpt.py (attend) and the host-offload plan, then training.sampling_hooks (shared by ours and
        # torch's TP, out of train_tp.py's 400 lines): 9,617 tokens, 979 lines (train_tp.py), 1,600 dragged. Issue #44's
        # mixture of experts (gpt.MoE, its presets, the loads in the step's one agreement and in the log, the balancing
        # bias in every checkpoint) added ~830 tokens and ~75 lines that every script reaches and a copy drags, a
        # family of models as Llama was; simplifications beside it (attention's one transpose, the checkpoint's window,
        # evaluate) paid back 220 tokens: 10,249 tokens, 1,049 lines (train_tp.py), 1,675 dragged.
        if script == "train_single":
            assert sum(tokens for _, tokens in reach.values()) <= 10250, reach
        else:
            assert outside <= 1050, reach
        assert dragged_lines <= 1675, dragged
    for script in ["train_ddp", "train_zero", "train_fsdp", "train_tp", "train_2d", "train_pp", "train_cp", "train_4d",
                   "train_ep"]:
        definitions, imports, _ = _top_level_definitions(script)
        core = [node for first, last, node in definitions.values() if node.lineno < definitions["main"][0]]
        named = {n.id for node in core for n in ast.walk(node) if isinstance(n, ast.Name)}
        assert named & set(imports) <= {"gpt", "train_ddp", "train_fsdp", "train_tp", "train_pp", "train_cp"}, script


def test_every_training_script_is_at_most_400_lines():
    """The design card's flat scripts: each under ~300 lines, 400 at most, and no line over 120 characters."""
    for script in sorted((os.path.join(HERE, name) for name in os.listdir(HERE) if re.fullmatch(r"train_\w+\.py", name))):
        lines = open(script).read().splitlines()
        assert len(lines) <= 400 and max(map(len, lines)) <= 120, (script, len(lines))


CORES = {"train_single.py": [], "train_ddp.py": [], "train_fsdp.py": [], "train_tp.py": [],  # script -> it composes
         "train_2d.py": ["train_tp.py", "train_fsdp.py"], "train_pp.py": ["train_ddp.py"],
         "train_zero.py": ["train_ddp.py"], "train_cp.py": ["train_ddp.py"],
         "train_4d.py": ["train_tp.py", "train_fsdp.py", "train_pp.py", "train_cp.py", "train_ddp.py"],
         "train_ep.py": []}


def test_a_strategy_core_needs_torch_and_gpt_alone(tmp_path):
    """Each script, beside gpt.py and the scripts it composes and nothing else, imports in a fresh Python (one for all
    of them: each folder's modules are dropped before the next): everything above main(), the strategy a reader
    lifts into their own project, needs torch and gpt.py alone."""
    for script, composed in CORES.items():
        folder = tmp_path / script.removesuffix(".py")
        folder.mkdir()
        for name in [script, "gpt.py", *composed]:
            shutil.copy(os.path.join(HERE, name), folder)
    code = ("import importlib, os, sys\n"
            f"for script in {list(CORES)!r}:\n"
            "    folder = os.path.abspath(script.removesuffix('.py'))\n"
            "    sys.path.insert(0, folder)\n"
            "    importlib.import_module(script.removesuffix('.py'))\n"
            "    for name, module in list(sys.modules.items()):\n"
            "        if os.path.dirname(getattr(module, '__file__', None) or '') == folder:\n"
            "            del sys.modules[name]\n"
            "    sys.path.remove(folder)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=""),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]



# ------------------------------------------------------------------------------------------------------------
# ---- #44 a mixture of experts: gpt.MoE, its balancing, and every layout that trains one


def test_moe_computes_each_tokens_chosen_experts_and_balances_toward_the_mean():
    """gpt.MoE against the definition written token by token: the router's softmax, the top n_expert_per_token by
    score + bias, their weights renormalised, their outputs summed; an expert no token chose still gets a (zero)
    gradient; balance() moves the bias by balance_rate against each expert's excess load, and resets the count."""
    torch.manual_seed(0)
    config = gpt.make_config("moe-tiny", 256, 16)
    moe = gpt.MoE(config, layer=0)
    nn.init.normal_(moe.router.weight, std=0.5)
    moe.expert_bias.copy_(torch.linspace(-0.02, 0.02, config.n_expert))
    x = torch.randn(2, 16, config.n_embd)
    y = moe(x)
    tokens = x.flatten(0, 1)
    scores = F.softmax(tokens @ moe.router.weight.T, dim=-1)
    expected, counts = torch.zeros_like(tokens), torch.zeros(config.n_expert)
    for t in range(len(tokens)):
        chosen = torch.topk(scores[t] + moe.expert_bias, config.n_expert_per_token).indices
        weights = scores[t, chosen] / scores[t, chosen].sum()
        expected[t] = sum(w * moe.experts[e](tokens[t]) for w, e in zip(weights, chosen.tolist()))
        counts[chosen] += 1
    torch.testing.assert_close(y.flatten(0, 1), expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(moe.tokens_per_expert, counts) and counts.sum() == 32 * config.n_expert_per_token
    with torch.no_grad():  # an evaluation counts nothing
        moe(x)
    assert torch.equal(moe.tokens_per_expert, counts)
    idle = int(counts.argmin())
    moe.expert_bias[idle] = -1  # no token chooses it now: scores are at most 1
    moe.tokens_per_expert.zero_()
    moe(x).sum().backward()
    assert moe.tokens_per_expert[idle] == 0
    assert all(p.grad is not None and not p.grad.any() for p in moe.experts[idle].parameters())
    load = torch.tensor([10.0, 0, 0, 0, 0, 0, 0, 6])  # mean 2: expert 0 and 7 above it, the others below
    bias = moe.expert_bias.clone()
    moe.balance(load)
    expected_bias = bias + config.balance_rate * torch.tensor([-1.0, 1, 1, 1, 1, 1, 1, -1])
    torch.testing.assert_close(moe.expert_bias, expected_bias)
    assert not moe.tokens_per_expert.any()


def tokens_per_expert(out_dir):
    """The log's tokens per expert, layer by layer, of every step of a run: which experts its tokens went to."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [record["tokens_per_expert"] for record in map(json.loads, f) if "loss" in record]


MOE_LAYOUTS = {  # script, ranks, flags: every layout that trains a mixture of experts whole (train_ep.py splits it)
    "ddp": (train_ddp.main, 2, {}),
    "fsdp-pp": (train_4d.main, 4, dict(pp=2)),  # 2 FSDP ranks x 2 pipeline stages: one run, both strategies
    "cp": (train_cp.main, 2, dict(cp=2, cp_impl="ring")),
}


@pytest.mark.parametrize("layout", MOE_LAYOUTS)
def test_a_mixture_of_experts_trains_alike_in_every_layout(corpus, tmp_path_factory, layout):
    """moe-tiny (8 experts, 2 a token) over 6 steps, with the balancing bias moving after each: the same losses,
    gradient norms and weights as train_single.py, and every step's tokens sent to the same experts (the loads summed
    over the ranks: one rank's alone would move the biases apart and the routing with them)."""
    main, world_size, extra = MOE_LAYOUTS[layout]
    reference_dir = tmp_path_factory.mktemp("moe-single")
    with one_thread():
        if not _single_runs.get("moe"):
            train_single.main(flags(corpus, reference_dir, model="moe-tiny"))
            _single_runs["moe"] = read_run(reference_dir), tokens_per_expert(reference_dir)
    reference, reference_tokens = _single_runs["moe"]
    out_dir = shared_folder(tmp_path_factory, layout)
    run_distributed(world_size, main, flags(corpus, out_dir, model="moe-tiny", **extra))
    assert tokens_per_expert(out_dir) == reference_tokens
    assert_runs_match(read_run(str(out_dir)), reference)


# ------------------------------------------------------------------------------------------------------------
# ---- #23 nothing lost when a run goes wrong: divergence, preemption, a failed write, Ctrl-C, a broken checkpoint

EVERY_LAYOUT = {  # script, ranks, extra flags: ours and PyTorch's
    "single": (train_single.main, 1, {}),
    "ddp": (train_ddp.main, 2, {}),
    "ddp-torch": (train_ddp.main, 2, dict(impl="torch")),
    "zero": (train_zero.main, 2, dict(stage=2)),
    "zero-torch": (train_zero.main, 2, dict(impl="torch")),
    "fsdp": (train_fsdp.main, 2, {}),
    "fsdp-torch": (train_fsdp.main, 2, dict(impl="torch")),
    "tp": (train_tp.main, 2, {}),
    "tp-torch": (train_tp.main, 2, dict(impl="torch")),
    "2d": (train_2d.main, 4, dict(tp=2, dp=2)),
    "2d-torch": (train_2d.main, 4, dict(tp=2, dp=2, impl="torch")),
    "pp": (train_pp.main, 2, dict(pp=2)),
    "pp-torch": (train_pp.main, 2, dict(pp=2, impl="torch")),
    "cp": (train_cp.main, 2, dict(cp=2, cp_impl="ring")),
}
DIVERGES_AT = 3


def _diverging(main, argv, step=DIVERGES_AT):
    """main(argv) with every loss multiplied by NaN from optimizer step `step` on (as a bf16 overflow or a bad
    shard would make it): (the exit code and message it stops with, or None)."""
    real_set_lr, real_forward, current = training.set_lr, gpt.GPT.forward, []

    def set_lr(optimizer, step, args):
        current.append(step)
        return real_set_lr(optimizer, step, args)

    def forward(self, idx, targets=None, pos=None):  # pos: train_cp.py passes its tokens' positions
        out = real_forward(self, idx, targets, pos)
        return out * float("nan") if targets is not None and self.training and current[-1] >= step else out

    real_cross_entropy = gpt.cross_entropy

    def cross_entropy(logits, targets, vocab_size):  # train_pp.py's last stage computes the loss without GPT.forward
        loss = real_cross_entropy(logits, targets, vocab_size)
        return loss * float("nan") if torch.is_grad_enabled() and current[-1] >= step else loss

    training.set_lr, gpt.GPT.forward, gpt.cross_entropy = set_lr, forward, cross_entropy
    try:
        main(argv)
    except training.Stopped as stopped:
        return stopped.code, str(stopped)
    finally:
        training.set_lr, gpt.GPT.forward, gpt.cross_entropy = real_set_lr, real_forward, real_cross_entropy
    return None


def strict_json_lines(path):
    """metrics.jsonl read as strict JSON: NaN, Infinity and -Infinity refused, as jq and JSON.parse refuse them."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    with open(path) as f:
        return [json.loads(line, parse_constant=refuse) for line in f]


@pytest.mark.parametrize("layout", list(EVERY_LAYOUT))
def test_a_diverged_run_stops_before_it_replaces_a_good_checkpoint(corpus, tmp_path, layout):
    """From step 3 on every loss is NaN. Every rank stops at step 3, before its update, with one message naming the
    step, what to try and the checkpoint to resume; `latest` names step 3's checkpoint, of finite values, and the two
    kept checkpoints are steps 2 and 3 (rotation, which took step 1's, never deleted a good one); metrics.jsonl is
    strict JSON."""
    main, ranks, extra = EVERY_LAYOUT[layout]
    argv = flags(corpus, tmp_path, max_steps=10, ckpt_interval=1, keep_checkpoints=2, **extra)
    outcomes = run_distributed(ranks, _diverging, main, argv)
    for code, message in outcomes:
        assert code == training.DIVERGED_EXIT_CODE and message.startswith(f"step {DIVERGES_AT}: the gradient norm is nan"), message
        assert "--lr" in message and "--grad_clip" in message and "float32" in message and "ckpt-0000003" in message
    assert checkpoint.latest(str(tmp_path)).endswith("ckpt-0000003")
    assert checkpoint_steps(tmp_path) == [2, 3]
    saved = checkpoint.Checkpoint(checkpoint.latest(str(tmp_path)))
    assert all(torch.isfinite(full_tensor(saved, name)).all() for name in saved.pieces)
    assert [record["step"] for record in strict_json_lines(tmp_path / "metrics.jsonl")] == list(range(DIVERGES_AT))


class NonFiniteGradient(torch.autograd.Function):
    """The identity forward; in backward the gradient's first element turns NaN, as where a backward pass overflowed
    on one rank: that rank's loss stays finite, its gradients do not."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        grad[(0,) * grad.dim()] = float("nan")
        return grad


def _diverging_on_one_rank(main, argv, rank, step):
    """main(argv) where from optimizer step `step` on every block's output gradient holds a NaN on rank `rank` alone,
    every loss finite. Returns (the exit code and message it stops with, the last step it began, whether every tensor
    its optimizer holds, weights and AdamW state, is bit for bit what it was when step `step` began), or None."""
    real_set_lr, real_make_optimizer, real_forward = training.set_lr, training.make_optimizer, gpt.Block.forward
    began, optimizers, before = [], [], []

    def held():
        optimizer = optimizers[0]
        tensors = [param for group in optimizer.param_groups for param in group["params"]]
        tensors += [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)]
        return [tensor.detach().clone() for tensor in tensors]

    def set_lr(optimizer, current, args):
        began.append(current)
        if current == step:
            before.extend(held())
        return real_set_lr(optimizer, current, args)

    def make_optimizer(*args, **kwargs):
        optimizers.append(real_make_optimizer(*args, **kwargs))
        return optimizers[-1]

    def forward(self, x, *args):
        out = real_forward(self, x, *args)
        diverged = torch.is_grad_enabled() and began and began[-1] >= step and dist.get_rank() == rank
        return NonFiniteGradient.apply(out) if diverged else out

    training.set_lr, training.make_optimizer, gpt.Block.forward = set_lr, make_optimizer, forward
    try:
        main(argv)
    except training.Stopped as stopped:
        after = held()
        unchanged = len(after) == len(before) and all(map(torch.equal, after, before))
        return stopped.code, str(stopped), began[-1], unchanged
    finally:
        training.set_lr, training.make_optimizer, gpt.Block.forward = real_set_lr, real_make_optimizer, real_forward
    return None


ONE_RANK_DIVERGES_AT = 2  # with --ckpt_interval 2, step 2's checkpoint holds what every rank held when it began


@pytest.mark.parametrize("layout", ["single", "ddp", "fsdp", "tp", "2d", "pp", "cp"])
def test_a_non_finite_gradient_on_one_rank_stops_every_rank_before_the_step(corpus, tmp_path, layout):
    """From step 2 on one rank's gradients hold a NaN, every rank's loss finite: the last rank's (under the pipeline
    the first stage's, whose gradients no send carries to another rank). A guard that read only its own loss would
    train on. Every rank stops at the same step, none hangs, each with the exit code of a divergence and one line
    naming the step and the checkpoint to resume; every tensor each rank's optimizer holds (weights, AdamW moments,
    its step count) is bit for bit what it was when the step began; `latest` names step 2's checkpoint."""
    main, ranks, extra = EVERY_LAYOUT[layout]
    rank = 0 if main is train_pp.main else ranks - 1
    argv = flags(corpus, tmp_path, max_steps=6, ckpt_interval=2, **extra)
    outcomes = run_distributed(ranks, _diverging_on_one_rank, main, argv, rank, ONE_RANK_DIVERGES_AT)
    assert None not in outcomes, f"ranks {[r for r, outcome in enumerate(outcomes) if outcome is None]} trained on"
    for code, message, last_step, unchanged in outcomes:
        assert code == training.DIVERGED_EXIT_CODE and re.search(rf"\bstep {ONE_RANK_DIVERGES_AT}\b", message), message
        assert "ckpt-0000002" in message and "\n" not in message, message
        assert unchanged, "the diverged step changed what the optimizer holds"
    assert len({last_step for _, _, last_step, _ in outcomes}) == 1, "the ranks stopped at different steps"
    assert checkpoint.latest(str(tmp_path)).endswith("ckpt-0000002") and checkpoint_steps(tmp_path) == [2]
    saved = checkpoint.Checkpoint(checkpoint.latest(str(tmp_path)))
    assert all(torch.isfinite(full_tensor(saved, name)).all() for name in saved.pieces)
    steps = [record["step"] for record in strict_json_lines(tmp_path / "metrics.jsonl")]
    assert steps == list(range(ONE_RANK_DIVERGES_AT))


def test_metrics_are_strict_json(tmp_path):
    """A value that is not finite (a validation loss that overflowed) is written as null, which every parser reads."""
    args = training.get_parser("").parse_args(["--out_dir", str(tmp_path)])
    logger = training.Logger(args, gpt.make_config("tiny", 256, 32), torch.device("cpu"))
    logger.log_step(3, torch.tensor(float("inf")), 1e-3, torch.tensor(2.0), time.perf_counter(), float("nan"))
    (record,) = strict_json_lines(tmp_path / "metrics.jsonl")
    assert record["loss"] is None and record["val_loss"] is None and record["grad_norm"] == 2.0


def _stopped_by_signal(main, argv, number, rank=1, step=3):
    """main(argv), rank `rank` receiving signal `number` during optimizer step `step`: the exit code and message it
    stops with, and the seconds left of an alarm. The signal handlers are restored after: the process runs on."""
    handlers = {n: signal.getsignal(n) for n in (signal.SIGTERM, signal.SIGUSR1, signal.SIGALRM)}
    real_set_lr = training.set_lr

    def set_lr(optimizer, current, args):
        if current == step and dist.get_rank() == min(rank, dist.get_world_size() - 1):
            os.kill(os.getpid(), number)
        return real_set_lr(optimizer, current, args)

    training.set_lr = set_lr
    try:
        main(argv)
    except training.Stopped as stopped:
        return stopped.code, str(stopped), signal.alarm(0)
    finally:
        training.set_lr = real_set_lr
        signal.alarm(0)
        for n, handler in handlers.items():
            signal.signal(n, handler)
    return None


STOPPED_BY_SIGNAL = dict(WITH_DROPOUT, pp=(train_pp.main, 2, dict(pp=2, schedule="1f1b")))


@pytest.mark.parametrize("layout, name", [("ddp", "SIGUSR1"), ("ddp", "SIGTERM"), ("fsdp", "SIGTERM"),
                                          ("tp", "SIGTERM"), ("2d", "SIGTERM"), ("pp", "SIGTERM")])
def test_a_stop_signal_saves_the_step_and_resume_is_bit_identical(corpus, tmp_path_factory, shared_tmp, layout, name):
    """SIGTERM (or SIGUSR1) to rank 1 alone at step 3: every rank finishes the step, they agree on it (one rank's
    request is enough), save step 4's checkpoint (the interval is 100) and stop with the exit code that says
    "resumable", each naming step 3 (the last it ran) and the signalled rank its signal, SIGTERM's deadline
    cancelled; --resume then ends bit-identical to the run that was never stopped, dropout masks included."""
    main, ranks, extra = STOPPED_BY_SIGNAL[layout]
    argv = flags(corpus, shared_tmp, dropout=DROPOUT, ckpt_interval=100, **extra)
    stopped = run_distributed(ranks, _stopped_by_signal, main, argv, signal.Signals[name])
    assert None not in stopped, f"ranks {[rank for rank, outcome in enumerate(stopped) if outcome is None]} ran on"
    for rank, (code, message, deadline_left) in enumerate(stopped):
        assert code == training.PREEMPTED_EXIT_CODE and "after step 3," in message, message  # the last step it ran
        assert message.endswith("--resume goes on at step 4"), message
        assert (f"({name})" in message) == (rank == 1), message
        assert deadline_left == 0, "the stop left SIGTERM's deadline armed"
    assert checkpoint.latest(str(shared_tmp)).endswith("ckpt-0000004")
    run_distributed(ranks, main, argv + ["--resume"])
    reference = (pp_run(corpus, tmp_path_factory, ranks, dropout=DROPOUT, **extra)[0] if main is train_pp.main
                 else uninterrupted(corpus, tmp_path_factory, layout))
    assert_identical(read_run(str(shared_tmp)), reference)


def _no_space_on_rank_one(argv):
    """train_ddp.main(argv) where rank 1's second checkpoint write fails as a full disk fails: its message."""
    real_save, saves = torch.save, []

    def save(obj, path, *args, **kwargs):
        if dist.get_rank() == 1 and str(path).endswith("rank00001.pt.tmp"):
            saves.append(path)
            if len(saves) == 2:
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_save(obj, path, *args, **kwargs)

    torch.save = save
    try:
        train_ddp.main(argv)
    except training.Stopped as stopped:
        return str(stopped)
    finally:
        torch.save = real_save
    return None


def test_a_failed_write_on_one_rank_publishes_nothing(corpus, tmp_path):
    """Rank 1's write of step 4's checkpoint fails (no space): both ranks know before anything is published, stop
    with one line naming the file, the bytes needed and free, and what to change; `latest` still names step 2's
    checkpoint, which loads, and no .tmp folder is left."""
    argv = flags(corpus, tmp_path, max_steps=6, ckpt_interval=2)
    for message in run_distributed(2, _no_space_on_rank_one, argv):
        assert message and "rank 1 could not write its part of" in message and "ckpt-0000004.tmp" in message, message
        assert "no space left" in message and "MB are free" in message and "--out_dir" in message, message
        assert "`latest` still names" in message and "ckpt-0000002" in message and "\n" not in message
    assert checkpoint.latest(str(tmp_path)).endswith("ckpt-0000002")
    assert checkpoint.Checkpoint(checkpoint.latest(str(tmp_path))).meta["step"] == 2
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".tmp")]



def _slow_write_on_rank_one(argv, delay_s):
    """train_ddp.main(argv) where rank 1's write of its checkpoint file takes delay_s seconds longer."""
    real_save = torch.save

    def save(obj, path, *args, **kwargs):
        if dist.get_rank() == 1 and str(path).endswith("rank00001.pt.tmp"):
            time.sleep(delay_s)
        return real_save(obj, path, *args, **kwargs)

    torch.save = save
    try:
        train_ddp.main(argv)
    finally:
        torch.save = real_save


def test_a_write_slower_than_the_timeout_still_publishes(corpus, tmp_path):
    """The world's collectives time out after 10 s (--timeout's part; the harness made the group), and rank 1's write
    of the checkpoint takes 14 s more: rank 0 waits for it in the saves' own gloo group (--save_timeout, 30 min), not
    in a collective of the world (NCCL's watchdog on a GPU), so the run ends and `latest` names a checkpoint that
    loads."""
    run_distributed(2, _slow_write_on_rank_one, flags(corpus, tmp_path, max_steps=2), 14, timeout_s=10)
    assert checkpoint.latest(str(tmp_path)).endswith("ckpt-0000002")
    assert checkpoint.Checkpoint(checkpoint.latest(str(tmp_path))).meta["step"] == 2


def _resume_with_an_older_latest_on_rank_one(argv, older):
    """_resume_refused(argv) where rank 1 reads `latest` as naming `older` (a shared filesystem's stale cache)."""
    if dist.get_rank() == 1:
        checkpoint.latest = lambda out_dir: older  # a forked worker's module: the test's own is untouched
    return _resume_refused(argv)


def test_ranks_that_resolved_different_checkpoints_are_refused(corpus, tmp_path):
    """Rank 0 finds step 4's checkpoint, rank 1 step 2's: every rank stops with one line naming both, before any
    work (the fingerprint check, before the model is built), and not a step is taken."""
    run_distributed(2, train_ddp.main, flags(corpus, tmp_path, max_steps=4, ckpt_interval=2, keep_checkpoints=0))
    older = os.path.join(str(tmp_path), "ckpt-0000002")
    metrics = open(tmp_path / "metrics.jsonl").read()
    argv = flags(corpus, tmp_path, max_steps=6, resume=True)
    for error in run_distributed(2, _resume_with_an_older_latest_on_rank_one, argv, older):
        assert error and error.startswith("UsageError: ranks [1] run other arguments than rank 0"), error
        assert "ckpt-0000004 vs " in error and "ckpt-0000002" in error and "`latest`" in error and "\n" not in error
    assert open(tmp_path / "metrics.jsonl").read() == metrics


@launches_its_own_ranks
def test_a_full_disk_is_one_line_and_loses_nothing(corpus, tmp_path):
    """Issue #23's run on a real small filesystem (a 16 MB tmpfs, mounted as root): step 2's checkpoint (9.7 MB)
    fits, step 4's does not. torchrun's output holds one line of ours, naming the folder, the bytes needed and free
    and what to change; `latest` still names step 2's checkpoint, which loads, and no .tmp is left to fill the disk."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)],
                                                   capture_output=True).returncode == 0
    if not mounted:
        pytest.skip("mounting a size-limited tmpfs needs root")
    try:
        argv = flags(corpus, disk / "out", max_steps=4, ckpt_interval=2)
        with launcher(tmp_path) as start:
            code, output, _ = start(*standalone(2, "train_fsdp.py", argv)).wait()
        ours = [line for line in output.splitlines() if line.startswith("error:")]
        assert code != 0 and len(ours) == 1, output[-5000:]
        assert output.count("Traceback") == 1 and "ChildFailedError" in output, output[-5000:]  # torchrun's own
        assert "could not write its part of" in ours[0] and "ckpt-0000004.tmp" in ours[0], ours[0]
        assert "no space left" in ours[0] and "MB are free" in ours[0] and "--out_dir" in ours[0], ours[0]
        assert checkpoint.latest(str(disk / "out")).endswith("ckpt-0000002")
        assert checkpoint.Checkpoint(checkpoint.latest(str(disk / "out"))).meta["step"] == 2
        assert not [name for name in os.listdir(disk / "out") if name.endswith(".tmp")]
    finally:
        subprocess.run(["umount", str(disk)], check=True)


@launches_its_own_ranks
def test_a_broken_checkpoint_is_one_line_under_torchrun(corpus, tmp_path):
    """--resume of a truncated rank file on 2 ranks: one line of ours in torchrun's output (rank 0's, also its
    summary's root cause), naming the checkpoint and the older one to point `latest` at; no rank's traceback."""
    out_dir = tmp_path / "out"
    argv = flags(corpus, out_dir, max_steps=4, ckpt_interval=2)
    run_distributed(2, train_ddp.main, argv)
    rank_file = os.path.join(checkpoint.latest(str(out_dir)), "rank00001.pt")
    with open(rank_file, "r+b") as f:
        f.truncate(os.path.getsize(rank_file) // 2)
    with launcher(tmp_path) as start:
        code, output, _ = start(*standalone(2, "train_ddp.py", flags(corpus, out_dir, max_steps=6, resume=True))).wait()
    ours = [line for line in output.splitlines() if line.startswith("error:")]
    assert code != 0, output[-5000:]
    assert len(ours) == 1 and "ckpt-0000004' is unreadable" in ours[0], output[-5000:]
    assert "echo ckpt-0000002 >" in ours[0], ours[0]
    assert output.count("Traceback") == 1 and "ChildFailedError" in output, output[-5000:]  # torchrun's own
    root_cause = output.split("Root Cause")[-1]
    assert "rank      : 0 (local_rank: 0)" in root_cause and "is unreadable" in root_cause, output[-5000:]


@launches_its_own_ranks
def test_ctrl_c_ends_every_rank_in_seconds_with_one_line(corpus, tmp_path):
    """SIGINT to the whole launch, as a terminal's Ctrl-C sends it: every rank ends within seconds, our output is
    one line and no rank prints a traceback, and no .tmp folder is left."""
    out_dir = tmp_path / "out"
    argv = flags(corpus, out_dir, max_steps=100000, ckpt_interval=5, timeout=LAUNCHED_TIMEOUT_S)
    with launcher(tmp_path) as start:
        launch = start(*standalone(2, "train_ddp.py", argv))
        deadline = time.time() + 60
        while "step    10" not in launch.output() and time.time() < deadline:
            time.sleep(0.2)
        os.killpg(launch.process.pid, signal.SIGINT)
        interrupted = time.time()
        code, output, ended = launch.wait()
    ours = [line for line in output.splitlines() if line.startswith("interrupted (Ctrl-C)")]
    print(f"\nCtrl-C: torchrun exited {code} {ended - interrupted:.1f}s after it; {len(output.splitlines())} lines")
    assert len(ours) == 1 and ended - interrupted < 15, output[-3000:]
    assert "KeyboardInterrupt" not in output and 'File "' + os.path.join(HERE, "train_ddp.py") not in output
    assert not [name for name in os.listdir(out_dir) if name.endswith(".tmp")]



def _train_pipeline(argv):
    """train_pp.main on this rank; returns (the final wte.weight of this rank's stage, None where it holds none; the
    tokens of the sample)."""
    kept = {}
    real_sample, real_generate = training.sample, gpt.generate

    def sample(model, *args, **kwargs):
        kept.update(model.named_parameters())  # the pipeline's: stage.[module.]model.<gpt.py name>
        real_sample(model, *args, **kwargs)

    def generate(*args, **kwargs):
        kept["tokens"] = real_generate(*args, **kwargs)
        return kept["tokens"]

    training.sample, gpt.generate = sample, generate
    try:
        train_pp.main(argv)
    finally:
        training.sample, gpt.generate = real_sample, real_generate  # a launched world runs in the test process
    wte = next((param for name, param in kept.items() if name.endswith("model.wte.weight")), None)
    return (None if wte is None else wte.detach().numpy().copy(),
            kept["tokens"].numpy() if "tokens" in kept else None)


_pp_runs = {}
PP_SAMPLE_TOKENS = 20


def pp_run(corpus, tmp_path_factory, world_size, **overrides):
    """train_pp.py on world_size ranks, once per distinct flags per session, with a short sample at the end:
    (read_run's result, each rank's (wte.weight or None, sample tokens))."""
    key = (world_size, tuple(sorted(overrides.items())))
    if key not in _pp_runs:
        out_dir = shared_folder(tmp_path_factory, "pp")
        argv = flags(corpus, out_dir, **dict(dict(sample_tokens=PP_SAMPLE_TOKENS), **overrides))
        ranks = run_distributed(world_size, _train_pipeline, argv)
        _pp_runs[key] = read_run(str(out_dir)), ranks
    return _pp_runs[key]


def single_sample(run):
    """The tokens gpt.generate samples on one device from a run's final weights, as flags() and pp_run set it up."""
    model = gpt.GPT(gpt.make_config("tiny", vocab_size=256, block_size=32))
    model.init_weights(0, lambda name, shape: torch.from_numpy(run.weights[name]))
    prompt = torch.tensor([prepare_data.ByteTokenizer().encode("\n")])
    return gpt.generate(model, prompt, PP_SAMPLE_TOKENS, 32, 256, temperature=0.8, top_k=40, seed=1234).numpy()


PP_LAYOUTS = [  # ranks, flags: accumulation 16 / (micro batch 2 x dp) = 8 or 4 micro-batches a step
    (2, dict(pp=2, schedule="gpipe")),
    (2, dict(pp=2, schedule="1f1b")),
    (4, dict(pp=4, schedule="1f1b")),  # the tiny model's 4 layers: one block a stage
    (4, dict(pp=2, dp=2, schedule="1f1b")),
    (3, dict(pp=3, schedule="1f1b")),  # 4 layers do not split evenly: blocks [2, 1, 1]
    (2, dict(pp=2, schedule="gpipe", impl="torch")),
    (4, dict(pp=2, dp=2, schedule="1f1b", impl="torch")),
    (4, dict(pp=4, schedule="gpipe", impl="torch")),
]


@pytest.mark.parametrize("world_size, overrides", PP_LAYOUTS, ids=lambda value: "-".join(
    f"{key} {flag}" for key, flag in value.items()) if isinstance(value, dict) else f"{value} ranks")
def test_pipeline_matches_single(corpus, tmp_path_factory, world_size, overrides):
    """Ours and torch.distributed.pipelining's, both schedules, 2 to 4 stages, replicated or not: losses, grad norms
    (clipping on: each stage's squared norm summed, the tied weight counted once), validation losses through the
    pipeline and the weights after 6 steps equal train_single's. The tied weight's two copies, on the first and the
    last stage, end bit-identical; the sample after training, run through the pipeline on every rank, is the one
    a single device draws from single's final weights (after 6 steps it barely depends on context: the last-position
    logits are held to one device's in test_pipeline_forward_gives_every_rank_the_last_stages_loss_and_logits)."""
    run, ranks = pp_run(corpus, tmp_path_factory, world_size, **overrides)
    reference = single_run(corpus, tmp_path_factory)
    assert_runs_match(run, reference)
    pp, dp = overrides["pp"], overrides.get("dp", 1)
    for replica in range(dp):
        first, last = ranks[replica][0], ranks[(pp - 1) * dp + replica][0]
        assert np.array_equal(first, last), "the tied weight's copies drifted apart"
    assert [wte is None for wte, _ in ranks] == [not (rank < dp or rank >= (pp - 1) * dp) for rank in range(pp * dp)]
    expected = single_sample(reference)
    for _, tokens in ranks:
        np.testing.assert_array_equal(tokens, expected)


def _pipeline_gradients(schedule, num_micro_batches):
    """One step of train_pp's core alone (torch and gpt.py, no training.py) on a 2-stage pipeline: this rank's
    gradients by name, after the tied-gradient sum, and the mean loss on the last stage."""
    config = gpt.make_config("tiny", vocab_size=256, block_size=16)
    with torch.device("meta"):
        model = gpt.GPT(config)
    stage = train_pp.Stage(model, dist.get_rank(), dist.get_world_size())
    stage.init_weights(torch.device("cpu"), lambda name, shape: gpt.initial_value(name, shape, config, seed=7))
    pipeline = train_pp.PipelineParallel(stage, dist.group.WORLD, config)
    tokens = torch.randint(0, 256, (num_micro_batches, 2, 17), generator=torch.Generator().manual_seed(3))
    loss = pipeline.step(schedule, [(batch[:, :-1], batch[:, 1:]) for batch in tokens])
    gradients = {name: param.grad.numpy().copy() for name, param in model.named_parameters()}
    train_pp.sum_tied_gradients(stage, dist.new_group([0, 1]))
    summed = {name: param.grad.numpy().copy() for name, param in model.named_parameters()}
    return gradients, summed, loss.item()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_gradients_are_single_devices_and_the_tied_ones_summed(schedule):
    """Both ends of the pipeline hold wte.weight; before the sum each holds the gradient of its own use only
    (the embedding's, the LM head's), which differs from one device's, and after it the whole gradient. Every other
    gradient is one device's as the schedule leaves it, and so is the loss: the core computes the math."""
    ranks = run_distributed(2, _pipeline_gradients, schedule, 4)
    config = gpt.make_config("tiny", vocab_size=256, block_size=16)
    model = gpt.GPT(config)
    model.init_weights(7)
    tokens = torch.randint(0, 256, (4, 2, 17), generator=torch.Generator().manual_seed(3))
    loss = sum(model(batch[:, :-1], batch[:, 1:]) / 4 for batch in tokens)
    loss.backward()
    np.testing.assert_allclose(ranks[1][2], loss.item(), rtol=TOLERANCE)
    assert ranks[0][2] == 0
    for name, param in model.named_parameters():
        holders = [rank for rank in range(2) if name in ranks[rank][1]]
        assert holders == ([0, 1] if name == "wte.weight" else [int(name.startswith(("ln_f", "blocks.2", "blocks.3")))])
        for rank in holders:
            np.testing.assert_allclose(ranks[rank][1][name], param.grad.numpy(), rtol=1e-4, atol=1e-7, err_msg=name)
    unsummed = [ranks[rank][0]["wte.weight"] for rank in range(2)]
    for part in unsummed:
        assert np.abs(part - model.wte.weight.grad.numpy()).max() > 1e-3  # the sum is needed
    np.testing.assert_allclose(unsummed[0] + unsummed[1], model.wte.weight.grad.numpy(), rtol=1e-4, atol=1e-7)


def _pipeline_forward(num_stages):
    """train_pp's forward without autograd on every rank of a pipeline: (the loss, the logits) of one batch."""
    config = gpt.make_config("tiny", vocab_size=256, block_size=16)
    with torch.device("meta"):
        model = gpt.GPT(config)
    stage = train_pp.Stage(model, dist.get_rank(), num_stages)
    stage.init_weights(torch.device("cpu"), lambda name, shape: gpt.initial_value(name, shape, config, seed=7))
    pipeline = train_pp.PipelineParallel(stage, dist.group.WORLD, config)
    tokens = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(5))  # shorter than block_size
    return pipeline(tokens[:, :-1], tokens[:, 1:]).item(), pipeline(tokens[:, :-1]).numpy()


def test_pipeline_forward_gives_every_rank_the_last_stages_loss_and_logits():
    """Evaluation and sampling run one batch through the 4 stages without autograd: every rank gets one device's
    loss and the logits at the last position, the only ones gpt.generate reads."""
    config = gpt.make_config("tiny", vocab_size=256, block_size=16)
    model = gpt.GPT(config)
    model.init_weights(7)
    tokens = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        loss, logits = model(tokens[:, :-1], tokens[:, 1:]).item(), model(tokens[:, :-1])
    for rank_loss, rank_logits in run_distributed(4, _pipeline_forward, 4):
        np.testing.assert_allclose(rank_loss, loss, rtol=TOLERANCE)
        assert rank_logits.shape == (2, 1, config.padded_vocab_size)
        np.testing.assert_allclose(rank_logits, logits[:, -1:].numpy(), rtol=1e-5, atol=1e-6)


@launches_its_own_ranks
def test_pipeline_resumes_from_and_into_other_layouts(corpus, tmp_path, tmp_path_factory):
    """Saved at step 3 by 2 stages x 2 replicas (each stage's first replica writes its blocks, the first stage the
    tied weight), resumed by train_single.py; saved by train_fsdp.py's flat shards, resumed by 4 stages: both whole
    runs equal train_single's uninterrupted 6 steps."""
    reference = single_run(corpus, tmp_path_factory)
    pipelined, sharded = tmp_path / "pipelined", tmp_path / "sharded"
    argv = flags(corpus, pipelined, ckpt_interval=3, pp=2, dp=2)
    assert run_distributed(4, _train_until, train_pp.main, 3, argv) == ["crashed"] * 4
    with one_thread():
        train_single.main(flags(corpus, pipelined, ckpt_interval=3, resume=True))
    assert_runs_match(read_run(str(pipelined)), reference)
    argv = flags(corpus, sharded, ckpt_interval=3)
    assert run_distributed(2, _train_until, train_fsdp.main, 3, argv) == ["crashed"] * 2
    run_distributed(4, train_pp.main, flags(corpus, sharded, ckpt_interval=3, resume=True, pp=4))
    assert_runs_match(read_run(str(sharded)), reference)


def test_pipeline_resume_and_activation_checkpointing_with_dropout_are_bit_identical(corpus, tmp_path_factory,
                                                                                   shared_tmp):
    """Dropout 0.1, each stage's masks drawn from its own rank's generator: killed at step 3 and resumed from step
    2's checkpoint, and with --activation_checkpointing (the recompute draws the forward's masks again, though 1F1B
    runs other micro-batches' forwards in between), the run is bit-identical to the same layout's uninterrupted one."""
    layout = dict(pp=2, schedule="1f1b", dropout=DROPOUT)
    reference, _ = pp_run(corpus, tmp_path_factory, 2, **layout)
    argv = flags(corpus, shared_tmp, ckpt_interval=2, **layout)
    assert run_distributed(2, _train_until, train_pp.main, 3, argv) == ["crashed"] * 2
    assert checkpoint.latest(str(shared_tmp)).endswith("ckpt-0000002")
    run_distributed(2, train_pp.main, argv + ["--resume"])
    assert_identical(read_run(str(shared_tmp)), reference)
    recomputed, _ = pp_run(corpus, tmp_path_factory, 2, activation_checkpointing=True, **layout)
    assert_identical(recomputed, reference)


def test_pipeline_bfloat16_and_compile(corpus, shared_tmp, tmp_path_factory):
    """bf16 autocast (the residual stream sent between stages stays float32) within BF16_TOLERANCE of single's bf16
    losses; --compile (each block compiled, the schedule between them) equal to eager single's."""
    run_distributed(2, train_pp.main, flags(corpus, shared_tmp, dtype="bfloat16", max_steps=3))
    losses = read_run(str(shared_tmp)).losses
    reference = single_run(corpus, tmp_path_factory, dtype="bfloat16", max_steps=3).losses
    assert len(losses) == 3 and max(abs(a - b) / b for a, b in zip(losses, reference)) < BF16_TOLERANCE
    compiled = shared_folder(tmp_path_factory, "pp_compiled")
    run_distributed(2, train_pp.main, flags(corpus, compiled, compile=True), timeout_s=COMPILE_TIMEOUT_S)
    assert_runs_match(read_run(str(compiled)), single_run(corpus, tmp_path_factory), COMPILE_TOLERANCE,
                      COMPILE_WEIGHT_TOLERANCE)


def _pp_refused(argv):
    """train_pp.main's refusal on this rank, which must come before its first collective."""
    real = dist.all_gather_object  # init_distributed's fingerprint check: the first collective of a run
    dist.all_gather_object = lambda *args, **kwargs: pytest.fail("a collective before the refusal")
    try:
        train_pp.main(argv)
    except training.UsageError as error:
        return str(error)
    finally:
        dist.all_gather_object = real


@pytest.mark.parametrize("world_size, overrides, message", [
    (5, dict(pp=5), "--pp 5 stages, but the model has 4 layers and a stage holds one at least: choose --pp 4"),
    (2, dict(pp=2, dp=2), "--pp 2 x --dp 2 = 4 ranks, but the world has 2: choose --pp and --dp"),
])
def test_pipeline_bad_layout_is_refused_on_every_rank_before_any_collective(corpus, tmp_path, world_size,
                                                                             overrides, message):
    errors = run_distributed(world_size, _pp_refused, flags(corpus, tmp_path, **overrides))
    assert all(error and message in error for error in errors), errors


def test_pipeline_splits_the_global_batch_into_enough_micro_batches_by_default():
    """With no --micro_batch, train_pp.py gives each replica's rows to 2 x --pp micro-batches or more, as few as that
    allows (the largest micro-batch); a replica with fewer rows runs one a micro-batch; one stage splits nothing."""
    chosen = {(rows, stages): train_pp.pipelined_micro_batch(rows, stages)
              for rows, stages in [(16, 2), (8, 2), (16, 4), (12, 2), (15, 2), (3, 2), (16, 1)]}
    assert chosen == {(16, 2): 4, (8, 2): 2, (16, 4): 2, (12, 2): 3, (15, 2): 3, (3, 2): 1, (16, 1): 16}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_plan_counts_each_stage_as_train_pp_builds_it(schedule, capsys):
    """--plan knows train_pp.py: each stage's parameters are those train_pp.Stage keeps on meta (the tied weight on
    both end stages, so pp stages hold wte twice), the micro-batches in flight are the schedule's (all 8 under
    GPipe, at most pp - stage under 1F1B), and one stage of one plans what train_single.py's plan does."""
    config = gpt.make_config("tiny", 256, 32)
    for pp in (1, 2, 3, 4):
        layout = plan.Layout("pp", pp, 1, 1, 2, pp=pp, schedule=schedule, micro_batches=8)
        for stage in range(pp):
            with torch.device("meta"):
                kept = train_pp.Stage(gpt.GPT(config), stage, pp)
            rows = plan.stage_plan(config, layout, stage, train_pp.stage_layers, train_pp.schedule)
            assert rows[0][1] == 4 * sum(p.numel() for p in kept.parameters()), (pp, stage)
            in_flight = 8 if schedule == "gpipe" else min(8, pp - stage)
            assert f"activations of {in_flight} micro-batch{'es' * (in_flight > 1)} in flight" in rows[3][0], rows[3]
    single = dict(plan.plan_memory(config, plan.Layout("single", 1, 1, 1, 2)))
    one_stage = dict(plan.stage_plan(config, plan.Layout("pp", 1, 1, 1, 2, schedule=schedule, micro_batches=8), 0,
                                     train_pp.stage_layers, train_pp.schedule))
    activations = [item for item in single if item.startswith(("activations", "embeddings", "loss"))]
    in_flight = "8 micro-batches" if schedule == "gpipe" else "1 micro-batch"
    assert one_stage[f"activations of {in_flight} in flight ({schedule})"] == \
        sum(single[item] for item in activations) * (8 if schedule == "gpipe" else 1)
    rows = train_pp.main(["--plan", "--pp", "2", "--world_size", "4", "--model", "tiny", "--schedule", schedule])
    assert "x pp 2" in capsys.readouterr().out and rows[0][0].startswith("stage ")


@launches_its_own_ranks
def test_bench_pipeline_measures_what_the_formulas_say(corpus, tmp_path):
    """bench_pipeline.py (bench.py --pipeline), 2 stages, m = 4 micro-batches of 2, float32: each stage sends m activations forward or
    m gradients back a step, to the byte; the activations autograd holds at a stage's peak are the planner's (GPipe:
    all 4 micro-batches; 1F1B: 2 on the first stage, 1 on the last; measured: within 64 bytes); the bubble is
    measured beside (p - 1) / (m + p - 1), ours and torch's tokens/s beside each other."""
    args = argparse.Namespace(model="tiny", data=corpus, block_size=32, global_batch=8, micro_batch=2, steps=5,
                              warmup=1, device="cpu", dtype="float32", compile=False, threads=1)
    rows = bench_pipeline.measure(args, str(tmp_path))
    expected = [(schedule, impl) for schedule in ("gpipe", "1f1b") for impl in ("ours", "torch")]
    assert [(row["schedule"], row["impl"]) for row in rows] == expected
    for row in rows:
        assert row["tokens_per_s"] > 0 and len(row["stages"]) == (2 if row["impl"] == "ours" else 0)
        for stage in row["stages"]:
            assert stage["sent_bytes"] == stage["formula_bytes"] == 4 * 2 * 32 * 128 * 4, stage
            # measured: 4 to 64 bytes above the plan, the few scalars autograd saves that the planner leaves out
            assert 0 <= stage["saved_bytes"] - stage["planned_bytes"] <= 64, stage
            assert 0 < stage["bubble"] < 1, stage
    gpipe, one_f_one_b = rows[0]["stages"], rows[2]["stages"]
    assert gpipe[1]["saved_bytes"] == 4 * one_f_one_b[1]["saved_bytes"]  # the last stage: 4 micro-batches, or 1


def _measured_pipeline(argv, out_path):
    """train_pp.main(argv) inside bench_pipeline.py's worker, which writes this rank's steps to out_path.<rank>."""
    real_exchange, real_step = train_pp.exchange, train_pp.PipelineParallel.step
    try:
        bench_pipeline.worker(argv, out_path)
    finally:  # the worker wraps both for the rest of its process: a launched world runs other tests after this one
        train_pp.exchange, train_pp.PipelineParallel.step = real_exchange, real_step


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pipeline_plan_of_point_to_point_is_what_the_stages_send(corpus, shared_tmp, dtype):
    """The planner's point-to-point row of the last stage, the activation it receives and the gradient it sends back
    for one micro-batch, is what bench.py --pipeline measures the two stages send each micro-batch (the first its
    activations, the last their gradients): 2 stages, 4 micro-batches of 2, in float32 and under --dtype bfloat16,
    the dtype of the row docs/memory.md prints. The first stage receives no activation: no row."""
    out_path = os.path.join(shared_tmp, "sends")
    argv = flags(corpus, os.path.join(shared_tmp, "out"), pp=2, global_batch=8, micro_batch=2, max_steps=2,
                 eval_interval=0, dtype=dtype)
    run_distributed(2, _measured_pipeline, argv, out_path)
    sent = []
    for stage in range(2):
        with open(f"{out_path}.{stage}") as f:
            sent.append({record["sent_bytes"] / 4 for record in json.load(f)})  # per micro-batch, every step alike
    assert all(len(bytes_a_step) == 1 for bytes_a_step in sent), sent
    layout = plan.Layout("pp", 2, 1, 1, 2, dtype, device="cpu", pp=2, micro_batches=4, schedule="1f1b")
    config = gpt.make_config("tiny", 256, 32)
    rows = [dict(plan.stage_plan(config, layout, stage, train_pp.stage_layers, train_pp.schedule)) for stage in (0, 1)]
    point_to_point = [[size for item, size in stage.items() if "point to point" in item] for stage in rows]
    assert point_to_point == [[], [sent[0].pop() + sent[1].pop()]], (point_to_point, sent)


def test_pipeline_schedules_hold_what_their_papers_say():
    """GPipe: every forward, then every backward. 1F1B: stage s of p runs p - 1 - s forwards first, then alternates;
    no stage ever holds more than p - s micro-batches' activations. Both run every micro-batch forward and backward,
    once, in order; the last backward is the last micro-batch's (the replicas' all-reduce waits for it)."""
    for name in ("gpipe", "1f1b"):
        for stages, micro_batches in [(2, 4), (4, 8), (4, 2)]:
            for stage in range(stages):
                order = train_pp.schedule(name, stage, stages, micro_batches)
                for kind in ("forward", "backward"):
                    assert [i for k, i in order if k == kind] == list(range(micro_batches))
                assert order[-1] == ("backward", micro_batches - 1)
                held = np.cumsum([1 if kind == "forward" else -1 for kind, _ in order])
                assert held.max() == (micro_batches if name == "gpipe" else min(stages - stage, micro_batches))
    assert train_pp.schedule("1f1b", 0, 2, 3) == [("forward", 0), ("forward", 1), ("backward", 0), ("forward", 2),
                                                  ("backward", 1), ("backward", 2)]
    assert [list(train_pp.stage_layers(4, 3, s)) for s in range(3)] == [[0, 1], [2], [3]]
    assert [list(train_pp.stage_layers(12, 5, s)) for s in range(5)] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9], [10, 11]]


# ------------------------------------------------------------------------------------------------------------
# ---- #24 tests of what a user reads: throughput and MFU, sampling, dropout over time

READ_LAYOUTS = {  # script, ranks, extra flags: every script, on the ranks that make it a distributed layout
    "single": (train_single.main, 1, {}),
    "ddp": (train_ddp.main, 2, {}),
    "fsdp": (train_fsdp.main, 2, {}),
    "tp": (train_tp.main, 2, {}),
    "2d": (train_2d.main, 4, dict(tp=2, dp=2)),
    "pp": (train_pp.main, 2, dict(pp=2)),
}
STATED_PEAK_FLOPS = 1e12  # a device whose peak the test states: training.peak_flops knows none on CPU
LOG_LINE = re.compile(r"step +(\d+) \|.*\| ([\d,]+) tok/s \| mfu ([\d.]+)% \|.*\| (\d+) ms")


def _throughput_of_main(main, argv):
    """main(argv) on a device of STATED_PEAK_FLOPS, counting the training rows this rank drew at each step:
    (what it printed, [(step, row indices in the global batch, tokens a row)])."""
    drawn, real_get, real_peak = [], training.BatchSampler.get, training.peak_flops

    def get(sampler, step, micro_step):
        x, y = real_get(sampler, step, micro_step)
        if sampler.split == 0:  # the training file's sampler; validation's rows are no step's work
            assert x.shape[0] == len(sampler.rows(micro_step))
            drawn.append((step, list(sampler.rows(micro_step)), x.shape[1]))
        return x, y

    training.BatchSampler.get, training.peak_flops = get, lambda device: STATED_PEAK_FLOPS
    try:
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            main(argv)
    finally:
        training.BatchSampler.get, training.peak_flops = real_get, real_peak
    return printed.getvalue(), drawn


def independent_flops_per_token(vocab_size, n_layer, n_embd, block_size):
    """6N + 12·L·d·T (PaLM appendix B; H heads of Q = d / H), N counted by hand: per block q, k, v, proj (4d² + 4d),
    fc and proj (8d² + 5d), two norms (4d); the tied embedding once (V padded to a multiple of 128, times d), ln_f
    (2d); no position embeddings."""
    padded = -(-vocab_size // 128) * 128
    n = n_layer * (12 * n_embd ** 2 + 13 * n_embd) + padded * n_embd + 2 * n_embd
    return 6 * n + 12 * n_layer * n_embd * block_size


@pytest.mark.parametrize("layout", list(READ_LAYOUTS))
def test_logged_throughput_and_mfu_count_the_whole_global_batch(corpus, shared_tmp, layout):
    """Every record of metrics.jsonl: tokens_per_s x step_ms / 1000 is the tokens the whole step processed, counted
    from the rows every rank drew (the union over ranks: tensor- and pipeline-parallel peers draw the same rows),
    which is global batch x block size; mfu is that throughput x 6N + 12·L·d·T (counted by hand) over world size x
    the stated peak; the console line says the same, rounded as it prints. Relative 1e-6: both sides come from one
    step time in float64, so only rounding separates them; a wrong count (micro batch, one rank's share, x tp) or a
    peak not multiplied by the world is off by 2x or more. Global batch 8 of micro batch 2: every layout accumulates
    (4 or 2 micro-steps), so a per-micro-step or per-rank count differs from the global one."""
    main, ranks, extra = READ_LAYOUTS[layout]
    argv = flags(corpus, shared_tmp, max_steps=3, global_batch=8, eval_interval=0, **extra)
    started = time.perf_counter()
    results = run_distributed(ranks, _throughput_of_main, main, argv)
    wall_ms = 1000 * (time.perf_counter() - started)
    with open(os.path.join(shared_tmp, "metrics.jsonl")) as f:
        records = [r for r in map(json.loads, f) if "loss" in r]
    assert [r["step"] for r in records] == [0, 1, 2]
    with open(os.path.join(corpus, "meta.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    flops = independent_flops_per_token(vocab_size, n_layer=4, n_embd=128, block_size=32)  # flags()' tiny model
    printed = {int(m[1]): m for m in LOG_LINE.finditer(results[0][0])}
    for record in records:
        step = record["step"]
        rows = {row: length for _, drawn in results for s, rows, length in drawn if s == step for row in rows}
        assert sorted(rows) == list(range(8)) and set(rows.values()) == {32}  # the whole global batch, once
        tokens = sum(rows.values())
        assert 0 < record["step_ms"] < wall_ms
        assert record["tokens_per_s"] * record["step_ms"] / 1000 == pytest.approx(tokens, rel=1e-6)
        expected_mfu = record["tokens_per_s"] * flops / (ranks * STATED_PEAK_FLOPS)
        assert record["mfu"] == pytest.approx(expected_mfu, rel=1e-6)
        line = printed[step]
        assert int(line[2].replace(",", "")) == pytest.approx(record["tokens_per_s"], abs=0.5)
        assert float(line[3]) == pytest.approx(100 * record["mfu"], abs=0.05 + 1e-9)
        assert int(line[4]) == pytest.approx(record["step_ms"], abs=0.5)


class FixedLogits(nn.Module):
    """A stand-in for the model in gpt.generate: the same logits at every position, whatever the context."""

    def __init__(self, logits):
        super().__init__()
        self.register_buffer("logits", torch.tensor(logits, dtype=torch.float32))

    def forward(self, idx):
        return self.logits.expand(idx.shape[0], idx.shape[1], -1)


SAMPLED_VOCAB = 10
SAMPLED_LOGITS = [0.3, 1.2, -0.4, 0.9, 0.0, 1.5, -1.0, 0.6, -0.2, 1.0] + [8.0] * 6
"""Ten classes in no sorted order (the likeliest are not the first indices) and six padding classes (a model's
logits are padded_vocab_size wide) far likelier than any real one: a padding class let through takes most draws."""


def reference_probabilities(temperature, top_k):
    """softmax(logits / T) over the k likeliest real classes (all of them for top_k 0), zero elsewhere, in float64."""
    z = np.array(SAMPLED_LOGITS[:SAMPLED_VOCAB], dtype=np.float64) / temperature
    kept = np.argsort(-z)[:top_k] if top_k else np.arange(SAMPLED_VOCAB)
    p = np.zeros(len(SAMPLED_LOGITS))
    p[kept] = np.exp(z[kept] - z[kept].max())
    return p / p.sum()


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.5, 0), (2.0, 0), (1.0, 1), (1.0, 3), (0.7, 5), (2.0, 9),
                                                (1.0, SAMPLED_VOCAB), (1.0, 12), (1.0, 50)])
def test_sampling_draws_softmax_over_temperature_of_the_top_k_real_classes(temperature, top_k):
    """20,000 draws of gpt.generate (4,000 rows x 5 tokens) from fixed logits, against an independent statement of
    what they must be: the classes drawn are exactly the top_k likeliest real ones (every real class for top_k 0 or
    top_k >= the vocabulary, 12 and 50 among them; a padding class never); each class's count is within 5 standard
    errors, sqrt(n p (1 - p)), of n x softmax(logits / T) renormalised over those classes. The seed is fixed, so the
    test is deterministic; 5 standard errors put a correct sampler's chance of failing under 1e-5 over all classes
    and cases, while in every case with T != 1 a temperature applied twice or not at all moves some class's share by
    3 points or more (12 to 73 standard errors), and a top-k off by one draws a class that must never appear (or
    misses one). And the generator advances: the 5 tokens of a row are not the same draws repeated."""
    rows, new_tokens = 4000, 5
    prompt = torch.zeros(rows, 1, dtype=torch.long)
    tokens = gpt.generate(FixedLogits(SAMPLED_LOGITS), prompt, new_tokens, block_size=8, vocab_size=SAMPLED_VOCAB,
                          temperature=temperature, top_k=top_k, seed=1234)[:, 1:].numpy()
    assert tokens.shape == (rows, new_tokens)
    p = reference_probabilities(temperature, top_k)
    counts = np.bincount(tokens.reshape(-1), minlength=len(SAMPLED_LOGITS))
    assert set(np.flatnonzero(counts)) == set(np.flatnonzero(p)), f"drawn {np.flatnonzero(counts)}"
    assert len(np.flatnonzero(p)) == (min(top_k, SAMPLED_VOCAB) or SAMPLED_VOCAB)
    n = tokens.size
    standard_errors = np.abs(counts - n * p) / np.maximum(np.sqrt(n * p * (1 - p)), 1e-12)
    assert standard_errors.max() < 5, f"counts {counts.tolist()} vs expected {np.round(n * p).tolist()}"
    if np.count_nonzero(p) > 1:  # top_k 1 draws the likeliest class every time
        assert not any(np.array_equal(tokens[:, 0], tokens[:, j]) for j in range(1, new_tokens))


DROPOUT_LAYOUTS = {  # every layout that draws dropout masks, in every random stream it keeps
    "single": (train_single.main, 1, {}),
    "ddp": (train_ddp.main, 2, {}),
    "fsdp": (train_fsdp.main, 2, {}),
    "tp": (train_tp.main, 2, {}),  # attention's drawn whole on every rank, each keeping its heads' part
    "tp-sequence-parallel": (train_tp.main, 2, dict(sequence_parallel=True)),  # and the residual stream's too
    "2d": (train_2d.main, 4, dict(tp=2, dp=2)),
    "pp": (train_pp.main, 2, dict(pp=2)),
    # recomputed blocks restore the generators for the recompute, then must leave them where the recompute found them
    "single-recompute": (train_single.main, 1, dict(activation_checkpointing=True)),
    "tp-recompute": (train_tp.main, 2, dict(activation_checkpointing=True)),
    "tp-sequence-parallel-recompute": (train_tp.main, 2, dict(sequence_parallel=True, activation_checkpointing=True)),
}


def _dropout_masks_by_step(main, argv):
    """The dropout masks main(argv) draws on this rank, as a list per optimizer step (cut where set_lr starts one)."""
    mode, starts, real_get_lr = RecordDropoutMasks(), [], training.get_lr

    def get_lr(step, args):
        starts.append(len(mode.masks))
        return real_get_lr(step, args)

    training.get_lr = get_lr
    try:
        with mode:
            main(argv)
    finally:
        training.get_lr = real_get_lr
    ends = starts[1:] + [len(mode.masks)]
    return [mode.masks[start:end] for start, end in zip(starts, ends)]


@pytest.mark.parametrize("layout", list(DROPOUT_LAYOUTS))
def test_dropout_masks_differ_from_step_to_step_and_micro_step_to_micro_step(corpus, shared_tmp, layout):
    """Dropout 0.1, 2 optimizer steps of 2 micro-steps each on every rank. Each micro-step draws the same masks in
    the same order (embedding, then per block attention and two residual ones; a pipeline stage its own blocks'; with
    --activation_checkpointing each block's again in backward), so a step's masks cut into 2 equal runs. On every
    rank no mask of one micro-step equals any mask of another, of this step or the other: a random stream that did
    not advance, or one a recompute rewound, repeats a mask there (at its own index or another layer's). Within a
    micro-step no two masks agree either, except that a recomputed block draws its masks again bit for bit: every
    mask then has exactly one twin, save the embedding's (not in a block). Two masks of 8,192 draws at p = 0.1 agree
    by chance with probability ~1e-1500, so "differ" is exact. Both kinds are there: attention masks ([batch, heads,
    T, T]; under TP drawn whole, all heads) and residual ones ([batch, T, d]). That resume and
    recompute reproduce the run bit for bit is test_resume_with_dropout_is_bit_identical's and
    test_activation_checkpointing_with_dropout_is_bit_identical's."""
    main, ranks, extra = DROPOUT_LAYOUTS[layout]
    dp = ranks // (extra.get("tp", ranks) if main in (train_tp.main, train_2d.main) else extra.get("pp", 1))
    accumulation, recomputed = 2, extra.get("activation_checkpointing", False)
    argv = flags(corpus, shared_tmp, dropout=DROPOUT, max_steps=2, global_batch=2 * accumulation * dp, micro_batch=2,
                 eval_interval=0, **extra)
    for rank, steps in enumerate(run_distributed(ranks, _dropout_masks_by_step, main, argv)):
        assert len(steps) == 2
        micro_steps = []
        for masks in steps:
            per_micro_step, left = divmod(len(masks), accumulation)
            assert per_micro_step > 0 and left == 0, f"rank {rank}: {len(masks)} masks in a step"
            micro_steps += [masks[i * per_micro_step:(i + 1) * per_micro_step] for i in range(accumulation)]
        shapes = [[mask.shape for mask in masks] for masks in micro_steps]
        assert all(s == shapes[0] for s in shapes), f"rank {rank}: micro-steps draw other masks"
        assert {mask.ndim for mask in micro_steps[0]} == {3, 4}, f"rank {rank}: {shapes[0]}"
        drawn_in = {}  # a mask's bytes -> the (step, micro-step) of each draw of it
        for index, masks in enumerate(micro_steps):
            for mask in masks:
                drawn_in.setdefault(mask.tobytes(), []).append(divmod(index, accumulation))
        for where in drawn_in.values():
            assert len(set(where)) == 1, f"rank {rank}: (step, micro-step) {where[1]} repeats a mask of {where[0]}"
        for index, masks in enumerate(micro_steps):
            twins = sorted(len(drawn_in[mask.tobytes()]) for mask in masks)
            # recomputed: each block's masks twice, the embedding's (on a rank that holds it: an odd count) once
            expected = [1] * len(masks) if not recomputed else [1] * (len(masks) % 2) + [2] * (len(masks) // 2 * 2)
            assert twins == expected, f"rank {rank}, (step, micro-step) {divmod(index, accumulation)}: {twins}"


# ------------------------------------------------------------------------------------------------------------
# Llama 3: RMSNorm, rotary position angles, SwiGLU, grouped-query attention, no biases, an untied LM head. GPT-2's
# tests above prove each strategy in depth; these prove the other family where it changes what a strategy splits or
# computes: llama-tiny (4 query heads sharing 2 key/value heads, so t = 2 splits both) in every layout against
# train_single.py, ours and PyTorch's; and Hugging Face's Llama folders, sharded, tied and untied, in every layout.

LLAMA = dict(model="llama-tiny", lr=1e-3, min_lr=1e-4, max_steps=4)
"""The Llama runs' flags: 4 steps, evaluated at the first and the last. At flags()' --lr 3e-3, llama-tiny's loss
rises at step 4 (4.050 -> 4.069) and float32 reduction noise, ~1e-7 at steps 0 to 4, grows at step 5 to 6e-6 (DDP)
and 9e-5 (TP) in the grad norm; at 1e-3 training is smooth and every layout stays within 1e-6 of train_single."""

LLAMA_LAYOUTS = {  # script, ranks, extra flags
    "ddp": (train_ddp.main, 2, {}),
    "ddp-torch": (train_ddp.main, 2, dict(impl="torch")),
    "fsdp": (train_fsdp.main, 2, {}),
    "fsdp-torch": (train_fsdp.main, 2, dict(impl="torch")),
    "tp": (train_tp.main, 2, {}),
    "tp-sequence-parallel": (train_tp.main, 2, dict(sequence_parallel=True)),
    "tp-torch": (train_tp.main, 2, dict(impl="torch")),
    "tp-sequence-parallel-torch": (train_tp.main, 2, dict(sequence_parallel=True, impl="torch")),
    "2d": (train_2d.main, 4, dict(tp=2, dp=2, sequence_parallel=True)),
    "2d-torch": (train_2d.main, 4, dict(tp=2, dp=2, impl="torch")),
    "pp-gpipe": (train_pp.main, 2, dict(pp=2, schedule="gpipe")),
    "pp-1f1b": (train_pp.main, 4, dict(pp=2, dp=2, schedule="1f1b")),
    "pp-gpipe-torch": (train_pp.main, 2, dict(pp=2, schedule="gpipe", impl="torch")),
    "pp-1f1b-torch": (train_pp.main, 2, dict(pp=2, schedule="1f1b", impl="torch")),
}


@pytest.mark.parametrize("layout", list(LLAMA_LAYOUTS))
def test_llama_every_layout_matches_single(corpus, shared_tmp, tmp_path_factory, layout):
    """llama-tiny, 4 steps with accumulation and clipping: losses, grad norms, validation losses and weights equal
    train_single's in every layout, ours and PyTorch's, within TOLERANCE."""
    main, ranks, extra = LLAMA_LAYOUTS[layout]
    run_distributed(ranks, main, flags(corpus, shared_tmp, **LLAMA, **extra))
    assert_runs_match(read_run(str(shared_tmp)), single_run(corpus, tmp_path_factory, **LLAMA))


def test_llama_presets_have_the_published_shapes():
    """On meta: the presets' parameter counts are Llama 3's (Hugging Face's model cards: 1.24B, 3.21B, 8.03B, 70.6B,
    405.9B, with the 128,256-token vocabulary); 3.2 1B and 3B tie the LM head to the embedding, 3.1 does not; no
    biases, no position table, a gate in every MLP; the key/value projections are n_kv_head heads wide."""
    expected = {"llama3.2-1b": 1_235_814_400, "llama3.2-3b": 3_212_749_824, "llama3.1-8b": 8_030_261_248,
                "llama3.1-70b": 70_553_706_496, "llama3.1-405b": 405_853_388_800}
    for preset, count in expected.items():
        config = gpt.make_config(preset, 128256, 8192)
        with torch.device("meta"):
            model = gpt.GPT(config)
        names = dict(model.named_parameters())
        assert model.num_params() == count, preset
        assert ("lm_head.weight" in names) == (not preset.startswith("llama3.2")), preset
        assert model.wpe is None and not any(name.endswith("bias") for name in names), preset
        assert names["blocks.0.attn.key.weight"].shape == (8 * config.head_dim, config.n_embd)
        assert names["blocks.0.mlp.gate.weight"].shape == (config.mlp_hidden, config.n_embd)
    config = gpt.make_config("llama-tiny", 256, 32)
    direct = gpt.GPT(config)
    direct.init_weights(seed=7)
    with torch.device("meta"):
        deferred = gpt.GPT(config)
    deferred.to_empty(device="cpu")
    deferred.init_weights(seed=7)
    assert deferred.lm_head.weight is not deferred.wte.weight
    for (name, a), (_, b) in zip(direct.named_parameters(), deferred.named_parameters()):
        assert torch.equal(a, b), name
    assert torch.equal(direct.blocks[0].ln_1.weight, torch.ones(128))


def test_llama_flops_per_token_count_what_a_token_is_multiplied_by():
    """6N + 12·L·H·Q·T with N counted by hand for Llama 3.1 8B: per block q and o (2d²), k and v (2·d·kv, kv = 8 x
    128), gate, up and down (3·d·f), two norms (2d); the untied LM head (V·d) and the final norm; the embedding a
    token only looks up, left out. The attention term is over the 32 query heads."""
    config = gpt.make_config("llama3.1-8b", 128256, 8192)
    d, f, kv, L, V = 4096, 14336, 1024, 32, 128256
    n = L * (2 * d * d + 2 * d * kv + 3 * d * f + 2 * d) + V * d + d
    with torch.device("meta"):
        model = gpt.GPT(config)
    assert model.num_params(with_embeddings=False) == n == model.num_params() - V * d
    assert gpt.flops_per_token(config, n) == 6 * n + 12 * L * 32 * 128 * 8192


def hugging_face_rope_frequencies(rope_theta, head_dim, factor=None, low=1.0, high=4.0, original=8192):
    """transformers' _compute_default_rope_parameters and _compute_llama3_parameters, written from their definitions:
    three bands of wavelength, by torch.where."""
    inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if factor is None:
        return inv_freq
    low_freq_wavelen, high_freq_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def test_rotary_angles_are_llama3s():
    """gpt.rotary_angles for Llama 3.1 8B (factor 8) and 3.2 1B (factor 32) at positions up to 128K equal the angles
    of transformers' llama3 RoPE, written apart, which slows the low frequencies (29 of 8B's 64 channel pairs, 14 of
    1B's 32), blends the middle band (6, 3) and keeps the high ones (29, 15); and gpt.rotate is its rotate_half form."""
    pos = torch.tensor([0, 1, 7, 100, 8191, 8192, 65535, 131071])
    for preset, factor, slowed, kept in (("llama3.1-8b", 8.0, 29, 29), ("llama3.2-1b", 32.0, 14, 15)):
        config = gpt.make_config(preset, 128256, 131072)
        frequencies = hugging_face_rope_frequencies(500000.0, config.head_dim, factor)
        plain = hugging_face_rope_frequencies(500000.0, config.head_dim)
        assert ((frequencies == plain / factor).sum(), (frequencies == plain).sum()) == (slowed, kept)
        cos, sin = gpt.rotary_angles(config, pos)
        angles = pos.float()[:, None] * torch.cat([frequencies, frequencies])  # both halves of a head alike
        torch.testing.assert_close(cos[:, 0], angles.cos(), rtol=0, atol=1e-6)
        torch.testing.assert_close(sin[:, 0], angles.sin(), rtol=0, atol=1e-6)
    x = torch.randn(2, 8, 4, config.head_dim)
    cos, sin = gpt.rotary_angles(config, pos)
    rotate_half = torch.cat([-x[..., config.head_dim // 2:], x[..., :config.head_dim // 2]], dim=-1)
    torch.testing.assert_close(gpt.rotate(x, (cos, sin)), x * cos + rotate_half * sin)
    assert gpt.rotary_angles(gpt.make_config("tiny", 256, 32), pos) is None


def test_grouped_query_attention_under_dropout_is_llamas():
    """Training with dropout takes gpt.py's explicit attention (attn_dropout sees the probabilities; the fused kernels
    would draw their masks inside). There, with 4 query heads sharing 2 key/value heads, in training mode, the output
    and the gradients of q, k and v equal LlamaForCausalLM's eager attention, written apart in float64 under the very
    mask attn_dropout drew: each key/value head repeated for its query heads as repeat_kv does (query head h reads
    key/value head h // 2), causal softmax, dropout, times v. Float32 against float64 within 1e-5 (measured: 1.2e-6 on
    values up to 6.4); key/value heads repeated in the other order (repeat, not repeat_interleave) move them by 6.5."""
    config = gpt.make_config("llama-tiny", 256, 16, dropout=0.5)
    attention = gpt.CausalSelfAttention(config).train()
    B, T, H, K, D = 2, 16, config.n_head, config.n_kv_head, config.head_dim
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, heads, D, generator=generator, requires_grad=True) for heads in (H, K, K))
    grad_out = torch.randn(B, T, H, D, generator=generator)
    masks = []
    attention.attn_dropout.register_forward_hook(lambda module, inputs, output: masks.append(output != 0))
    with torch.random.fork_rng():  # a mask of its own, the same on every run
        torch.manual_seed(0)
        y = attention.attend(q, k, v)
    grads = torch.autograd.grad(y, (q, k, v), grad_out)
    (kept,) = masks  # the explicit path ran, and drew this mask over [B, query heads, T, T]
    assert 0.4 < kept.sum() / (B * H * T * (T + 1) / 2) < 0.6  # about half the causal probabilities dropped

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    repeat_kv = lambda z: z[:, :, None].expand(B, K, H // K, T, D).reshape(B, H, T, D)  # noqa: E731
    queries, keys, values = q64.transpose(1, 2), repeat_kv(k64.transpose(1, 2)), repeat_kv(v64.transpose(1, 2))
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    scores = (queries @ keys.transpose(-2, -1) / math.sqrt(D)).masked_fill(future, -math.inf)
    expected = (scores.softmax(-1) * kept / (1 - config.dropout) @ values).transpose(1, 2)
    expected_grads = torch.autograd.grad(expected, (q64, k64, v64), grad_out.double())
    torch.testing.assert_close(y.double(), expected, rtol=0, atol=1e-5)
    for name, grad, reference in zip("qkv", grads, expected_grads):
        torch.testing.assert_close(grad.double(), reference, rtol=0, atol=1e-5, msg=f"gradient of {name}")


def _llama_gradient_errors(sequence_parallel, loss_parallel):
    """_gradient_errors for llama-tiny: each local gradient after one forward/backward against one device's slice."""
    config = gpt.make_config("llama-tiny", vocab_size=256, block_size=32)
    generator = torch.Generator().manual_seed(0)
    idx, targets = torch.randint(0, 256, (2, 2, 32), generator=generator)
    reference = gpt.GPT(config)
    reference.init_weights(seed=5)
    reference(idx, targets).backward()
    full = dict(reference.named_parameters())
    model = _tensor_parallel_model(config, 5, sequence_parallel, loss_parallel)
    model(idx, targets).backward()
    parts = checkpoint.parameter_parts(model)
    if sequence_parallel:
        train_tp.allreduce_replicated_grads([(name, p.grad) for name, p in model.named_parameters()],
                                            dist.group.WORLD, "cpu")
    errors = {}
    for part in parts:
        expected = full[part.name].grad[tuple(slice(*box) for box in part.box)]
        errors[part.name] = ((part.tensor.grad - expected).abs().max() / expected.abs().max()).item()
    return errors, sorted(part.name for part in parts if part.sliced)


@pytest.mark.parametrize("sequence_parallel, loss_parallel", [(False, True), (True, False)])
def test_llama_tp_gradients_are_the_slices_of_single(sequence_parallel, loss_parallel):
    """t = 2 = the key/value heads: q, k, v, gate and fc split by output rows, the projections by input columns, wte
    and the untied LM head by vocabulary rows, RMSNorm replicated (under sequence parallelism on sequence shards, its
    gradient summed): every rank's gradients are one device's slices (measured ~1e-7)."""
    for errors, sliced in run_distributed(2, _llama_gradient_errors, sequence_parallel, loss_parallel):
        worst = max(errors, key=errors.get)
        assert errors[worst] < 1e-5, f"{worst}: {errors[worst]:.2e}"
        assert "lm_head.weight" in sliced and "blocks.0.mlp.gate.weight" in sliced and not any(
            ".ln_" in name or name.startswith("ln_f") for name in sliced)


def hugging_face_llama(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=96, vocab_size=256, tied=False,
                       seed=0, n_expert=0):
    """The tensors of a random Llama as LlamaForCausalLM stores them, by stored name, in bfloat16 as the hub's files
    hold them: no biases, the norms' gains random around 1 so that a misplaced one shows, no lm_head where tied. With
    n_expert, a Mixtral's as MixtralForCausalLM stores them: each MLP block_sparse_moe.gate the router [n_expert,
    hidden] and each expert's w1 (gate), w3 (up) and w2 (down), the router's weights 10 times the others', so that a
    token's experts are chosen by clear margins (float32 and float64 pick the same)."""
    kv = n_kv_head * n_embd // n_head
    shapes = {"model.embed_tokens.weight": (vocab_size, n_embd)}
    for i in range(n_layer):
        layer = f"model.layers.{i}."
        shapes.update({layer + "input_layernorm.weight": (n_embd,), layer + "self_attn.q_proj.weight": (n_embd, n_embd),
                       layer + "self_attn.k_proj.weight": (kv, n_embd), layer + "self_attn.v_proj.weight": (kv, n_embd),
                       layer + "self_attn.o_proj.weight": (n_embd, n_embd),
                       layer + "post_attention_layernorm.weight": (n_embd,)})
        mlps = [f"{layer}block_sparse_moe.experts.{e}." for e in range(n_expert)] or [layer + "mlp."]
        shapes.update({layer + "block_sparse_moe.gate.weight": (n_expert, n_embd)} if n_expert else {})
        names = ["w1", "w2", "w3"] if n_expert else ["gate_proj", "up_proj", "down_proj"]  # in the order each stores
        for mlp, name in itertools.product(mlps, names):
            down = name in ("w2", "down_proj")
            shapes[f"{mlp}{name}.weight"] = (n_embd, intermediate_size) if down else (intermediate_size, n_embd)
    shapes.update({"model.norm.weight": (n_embd,)}, **({} if tied else {"lm_head.weight": (vocab_size, n_embd)}))
    generator = torch.Generator().manual_seed(seed)
    scale = lambda name: 1.0 if name.endswith("moe.gate.weight") else 0.1  # noqa: E731
    return {name: (float(name.endswith("norm.weight")) + scale(name) * torch.randn(shape, generator=generator))
            .bfloat16() for name, shape in shapes.items()}


def write_hugging_face_llama(folder, tensors, n_head=4, n_kv_head=2, files=2, rope_parameters=False, **config):
    """config.json, and the tensors in `files` safetensors shards with model.safetensors.index.json as save_pretrained()
    writes them (the embedding and the first layers in the first file, the last layers, the final norm and the LM head
    in the last; files=1: model.safetensors alone). The rotary settings as the hub's Llama 3.1 and 3.2 repositories
    write them, rope_theta and rope_scaling at the top level, or (rope_parameters) as transformers 5 does. The RoPE
    scaling's original context is 16, so that all three of its bands turn within 64 positions."""
    n_layer = sum(name.endswith("input_layernorm.weight") for name in tensors)
    vocab_size, n_embd = tensors["model.embed_tokens.weight"].shape
    rope = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16,
                rope_type="llama3")
    hf = dict(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False, attention_dropout=0.0,
              bos_token_id=0, eos_token_id=1, head_dim=n_embd // n_head, hidden_act="silu", hidden_size=n_embd,
              initializer_range=0.02, intermediate_size=len(tensors["model.layers.0.mlp.up_proj.weight"]),
              max_position_embeddings=64, mlp_bias=False, num_attention_heads=n_head, num_hidden_layers=n_layer,
              num_key_value_heads=n_kv_head, pretraining_tp=1, rms_norm_eps=1e-5, torch_dtype="bfloat16",
              tie_word_embeddings="lm_head.weight" not in tensors, use_cache=True, vocab_size=vocab_size)
    hf.update(dict(rope_parameters=dict(rope, rope_theta=500000.0)) if rope_parameters else
              dict(rope_theta=500000.0, rope_scaling=rope))
    hf.update(config)
    shard_of = lambda name: (0 if name.startswith("model.embed") else files - 1 if not name.startswith("model.layers")
                             else int(name.split(".")[2]) * files // n_layer)  # noqa: E731
    weight_map = {name: f"model-{shard_of(name) + 1:05d}-of-{files:05d}.safetensors" for name in tensors}
    return write_hugging_face_folder(folder, hf, tensors, weight_map if files > 1 else None)


def write_hugging_face_folder(folder, hf, tensors, weight_map=None):
    """config.json `hf`, and the bfloat16 `tensors` in model.safetensors, or in the files weight_map names with
    model.safetensors.index.json, as save_pretrained() writes them."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    if weight_map is None:
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        return str(folder)
    for file in sorted(set(weight_map.values())):
        save_file({name: tensors[name] for name in tensors if weight_map[name] == file}, os.path.join(folder, file),
                  metadata={"format": "pt"})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(2 * t.numel() for t in tensors.values())}, "weight_map": weight_map},
                  f, indent=2)
    return str(folder)


def hugging_face_llama_logits(tensors, hf, idx):
    """LlamaForCausalLM's forward written from transformers' modeling_llama.py on its own tensors and config.json, in
    float64 (the rotary frequencies in float32, as it computes them): RMSNorm, x · rsqrt(mean(x²) + eps) · w; q, k
    and v; RoPE over the two halves of each head (rotate_half) with the llama3 frequencies; each key/value head
    repeated for its query heads (repeat_kv); causal softmax(q·kᵀ / sqrt(head_dim)) · v; o_proj; down_proj(silu(
    gate_proj(x)) · up_proj(x)); the final norm; lm_head, or embed_tokens where tied. The reference every layout
    that loads a Llama folder is held to. A Mixtral's (modeling_mixtral.py) differs in rope_theta's default
    frequencies and its MLP: mixtral_mlp's."""
    t = {name: tensor.double() for name, tensor in tensors.items()}
    (B, T), H, K, C = idx.shape, hf["num_attention_heads"], hf["num_key_value_heads"], hf["hidden_size"]
    D = C // H
    rope = hf.get("rope_parameters") or dict(hf.get("rope_scaling") or {}, rope_theta=hf["rope_theta"])
    scaling = ["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"] * ("factor" in rope)
    inv_freq = hugging_face_rope_frequencies(rope["rope_theta"], D, *[rope[key] for key in scaling])
    freqs = torch.arange(T).float()[:, None] * inv_freq[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().double(), emb.sin().double()
    rotate_half = lambda x: torch.cat([-x[..., D // 2:], x[..., :D // 2]], dim=-1)  # noqa: E731
    rms_norm = lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + hf["rms_norm_eps"]) * w  # noqa: E731
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    x = t["model.embed_tokens.weight"][idx]
    for i in range(hf["num_hidden_layers"]):
        w = {name[len(f"model.layers.{i}."):]: tensor for name, tensor in t.items()
             if name.startswith(f"model.layers.{i}.")}
        h = rms_norm(x, w["input_layernorm.weight"])
        q, k, v = ((h @ w[f"self_attn.{p}_proj.weight"].t()).view(B, T, -1, D).transpose(1, 2) for p in "qkv")
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = (z[:, :, None].expand(B, K, H // K, T, D).reshape(B, H, T, D) for z in (k, v))  # repeat_kv
        scores = (q @ k.transpose(-2, -1) / math.sqrt(D)).masked_fill(future, -math.inf)
        x = x + (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C) @ w["self_attn.o_proj.weight"].t()
        h = rms_norm(x, w["post_attention_layernorm.weight"])
        if "num_local_experts" in hf:
            x = x + mixtral_mlp(h, w, hf)
        else:
            x = x + (F.silu(h @ w["mlp.gate_proj.weight"].t()) * (h @ w["mlp.up_proj.weight"].t())) @ w[
                "mlp.down_proj.weight"].t()
    head = t["model.embed_tokens.weight"] if hf["tie_word_embeddings"] else t["lm_head.weight"]
    return rms_norm(x, t["model.norm.weight"]) @ head.t()


LLAMA_STORED = {"ln_1": "input_layernorm", "attn.query": "self_attn.q_proj", "attn.key": "self_attn.k_proj",
                "attn.value": "self_attn.v_proj", "attn.proj": "self_attn.o_proj", "ln_2": "post_attention_layernorm",
                "mlp.gate": "mlp.gate_proj", "mlp.fc": "mlp.up_proj", "mlp.proj": "mlp.down_proj",
                "wte": "model.embed_tokens", "ln_f": "model.norm", "lm_head": "lm_head"}


def llama_stored_name(name):
    """LlamaForCausalLM's name of our parameter `name`, by the definitions of the two models."""
    module = name.rpartition(".")[0]
    if module.startswith("blocks."):
        _, layer, module = module.split(".", 2)
        return f"model.layers.{layer}.{LLAMA_STORED[module]}.weight"
    return f"{LLAMA_STORED[module]}.weight"


def gpt_weights_from_hugging_face_llama(tensors, config):
    """Our parameters, by gpt.py name, from Llama's (or Mixtral's) stored tensors, apart from hugging_face.py's
    mapping: the same [out, in] matrices under other names, q and k rows as stored (gpt.rotate follows rotate_half),
    embed_tokens and lm_head padded with zero rows up to padded_vocab_size, in float32."""
    with torch.device("meta"):
        names = [name for name, _ in gpt.GPT(config).named_parameters()]
    pad = lambda t: F.pad(t, (0, 0, 0, config.padded_vocab_size - config.vocab_size)) if t.dim() == 2 and len(
        t) == config.vocab_size else t  # noqa: E731
    stored_name = mixtral_stored_name if config.n_expert else llama_stored_name
    return {name: pad(tensors[stored_name(name)].float()) for name in names}


@pytest.fixture(scope="module")
def llama_like(tmp_path_factory):
    """{tied: (folder, tensors, config.json)}: two random Llamas with the default corpus' vocabulary (256 byte
    tokens), 2 layers of width 64, 4 query heads sharing 2 key/value heads, in 2 safetensors shards and an index;
    the untied one's config.json as the hub writes Llama 3.1's, the tied one's (no lm_head tensor) as transformers 5
    does. Under torchrun rank 0 writes them into folders every rank names alike."""
    folders = {}
    for tied in (False, True):
        tensors = hugging_face_llama(tied=tied, seed=int(tied))
        folder = _same_on_every_rank(tmp_path_factory.mktemp(f"llama_{'tied' if tied else 'untied'}"))
        if LAUNCHED_WORLD == 1 or dist.get_rank() == 0:
            write_hugging_face_llama(folder, tensors, rope_parameters=tied)
        folders[tied] = str(folder), tensors
    if LAUNCHED_WORLD > 1:
        dist.barrier()
    return {tied: (folder, tensors, json.load(open(os.path.join(folder, "config.json"))))
            for tied, (folder, tensors) in folders.items()}


@pytest.mark.parametrize("layout, world_size, tied", [("single", 1, False), ("single", 1, True), ("fsdp", 2, False),
                                                      ("tp", 2, False), ("tp", 2, True), ("2d", 4, True),
                                                      ("pp", 2, False), ("pp", 2, True)])
def test_hugging_face_llama_loads_in_every_layout(llama_like, layout, world_size, tied):
    """A Llama in two safetensors shards loaded by each layout gives our parameters the stored tensors (by the two
    models' definitions) and computes LlamaForCausalLM's logits and loss (its forward written above) within float32
    noise (measured: up to 2.3e-6 on logits of up to 3.7); each rank maps only the shards that hold its parts (a
    pipeline stage one of the two, but the last stage of a tied model, which holds wte too) and reads its parts alone,
    one read a part: from each file, never more elements than its parts stored there and the partial rows around an
    FSDP shard, counted as they leave the file (a whole tensor read and sliced afterwards counts whole)."""
    folder, tensors, hf = llama_like[tied]
    config = hugging_face.config_from_hugging_face(hf, 32, 0.0)
    value = training.initial_values(config, 0, folder)
    for name, expected in gpt_weights_from_hugging_face_llama(tensors, config).items():
        assert torch.equal(value(name, expected.shape), expected), name
    idx = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    reference = hugging_face_llama_logits(tensors, hf, idx[:, :-1])
    reference_loss = F.cross_entropy(reference.flatten(0, 1), idx[:, 1:].flatten()).item()
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    for rank, (logits, loss, reads, parts, names, loaded) in enumerate(run_distributed(world_size, _load_and_run,
                                                                                       layout, folder, idx)):
        print(f"{layout} x{world_size} rank {rank}: logits differ by "
              f"{np.abs(logits - reference[:, -logits.shape[1]:].numpy()).max():.1e}; read {loaded} elements")
        np.testing.assert_allclose(logits, reference[:, -logits.shape[1]:].numpy(), rtol=0, atol=LOGITS_TOLERANCE)
        assert loss == pytest.approx(reference_loss, rel=0, abs=LOGITS_TOLERANCE)
        assert len(reads) == len(parts)
        assert loaded.keys() == {weight_map[llama_stored_name(name)] for name in names}
        assert len(loaded) == (1 if layout == "pp" and (rank == 0 or not tied) else 2)
        part_bounds = collections.Counter()  # each file: its parts' elements stored there, and partial rows at most
        for name, size, width in parts:
            part_bounds[weight_map[llama_stored_name(name)]] += size + 2 * width
        assert all(loaded[file] <= part_bounds[file] for file in loaded), (loaded, part_bounds)


INIT_FROM_LLAMA = [(layout, layout in ("tp", "2d", "pp")) for layout in INIT_FROM_LAYOUTS]  # (layout, tied)


@pytest.mark.parametrize("layout, tied", INIT_FROM_LLAMA)
def test_every_script_starts_from_the_hugging_face_llama_weights(corpus, shared_tmp, llama_like, layout, tied):
    """--init_from a sharded Llama folder, tied or untied, in each script: one step at learning rate 0 saves exactly
    the stored tensors, and the loss logged at step 0 is LlamaForCausalLM's on its batch."""
    folder, tensors, hf = llama_like[tied]
    main, ranks, extra = INIT_FROM_LAYOUTS[layout]
    run_distributed(ranks, main, flags(corpus, shared_tmp, model=None, init_from=folder, max_steps=1, lr=0, min_lr=0,
                                       **extra))
    run = read_run(shared_tmp)
    expected = gpt_weights_from_hugging_face_llama(tensors, hugging_face.config_from_hugging_face(hf, 32, 0.0))
    assert run.weights.keys() == expected.keys()
    for name, weight in expected.items():
        np.testing.assert_array_equal(run.weights[name], weight.numpy(), err_msg=name)
    x, y = training.BatchSampler(os.path.join(corpus, "train.bin"), 32, 16, 16, 0, 1, 1234, torch.device("cpu")).get(0, 0)
    reference = F.cross_entropy(hugging_face_llama_logits(tensors, hf, x).flatten(0, 1), y.flatten()).item()
    assert run.losses[0] == pytest.approx(reference, rel=0, abs=LOGITS_TOLERANCE)


@pytest.mark.parametrize("case, message", [
    ("--model", "--model llama-tiny contradicts --init_from"),
    ("rope type", "config.json has rope_type 'yarn': gpt.py computes Llama 3"),
    ("head_dim", "config.json has head_dim 32: gpt.py computes Llama 3"),
    ("no lm_head", "model.safetensors.index.json has no lm_head.weight: the weights do not match config.json"),
])
def test_init_from_a_llama_that_contradicts_the_flags_is_refused(corpus, tmp_path, llama_like, case, message):
    """Refused with one line that says what to change, on every rank, before the first collective."""
    folder, tensors, hf = llama_like[False]
    overrides = dict(model=None, init_from=folder)
    if case == "--model":
        overrides["model"] = "llama-tiny"
    elif case == "rope type":
        overrides["init_from"] = write_hugging_face_llama(tmp_path / "llama", tensors, rope_scaling=dict(
            hf["rope_scaling"], rope_type="yarn"))
    elif case == "head_dim":
        overrides["init_from"] = write_hugging_face_llama(tmp_path / "llama", tensors, head_dim=32)
    else:  # a config.json of an untied LM head beside the tensors of a tied one
        overrides["init_from"] = write_hugging_face_llama(tmp_path / "llama", llama_like[True][1],
                                                          tie_word_embeddings=False)
    errors = run_distributed(2, _refusal, train_ddp.main, flags(corpus, tmp_path / "run", **overrides))
    assert all(error and message in error and "\n" not in error for error in errors), errors


def test_llama_config_json_of_the_hub_and_of_transformers_5_give_the_presets():
    """config.json as the hub's Llama 3.1 8B and 3.2 1B repositories write it (rope_theta and rope_scaling at the top
    level; written here from them) and as transformers 5 writes it (one rope_parameters entry) is the preset's
    config; Llama 3's own (no rope_scaling) keeps every frequency. export.py writes each preset's config.json back as
    the hub's repository does, its context aside (the run's --block_size), every key the hub's holds but its
    initializer_range and the transformers version."""
    llama31_8b = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                  "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
                  "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
                  "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
                  "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
                  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                  "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                  "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256}
    llama32_1b = dict(llama31_8b, head_dim=64, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      rope_scaling=dict(llama31_8b["rope_scaling"], factor=32.0), tie_word_embeddings=True)
    version_5 = {key: value for key, value in llama31_8b.items() if not key.startswith("rope_")}
    version_5["rope_parameters"] = dict(llama31_8b["rope_scaling"], rope_theta=500000.0)
    for hf, preset in ((llama31_8b, "llama3.1-8b"), (llama32_1b, "llama3.2-1b"), (version_5, "llama3.1-8b")):
        assert hugging_face.config_from_hugging_face(hf, 8192, 0.1) == gpt.make_config(preset, 128256, 8192, 0.1)
    llama3 = {key: value for key, value in llama31_8b.items() if key != "rope_scaling"}
    assert hugging_face.config_from_hugging_face(llama3, 8192, 0.0).rope_scaling is None
    for hub, preset in ((llama31_8b, "llama3.1-8b"), (llama32_1b, "llama3.2-1b")):  # export.py writes them back
        written = export.hugging_face_config(gpt.make_config(preset, 128256, 131072), "bfloat16",
                                             dict(bos=128000, eos=128001))
        assert hub.keys() - written.keys() == {"initializer_range", "transformers_version"}, preset
        assert {key: written[key] for key in hub if key in written} == {key: hub[key] for key in hub if key in written}


def write_tiktoken_bpe(path):
    """A small BPE file in tiktoken's format (a base64 token and its rank a line), as Llama 3's original/tokenizer.model
    is: the 256 bytes, then 65,536 three-byte tokens no UTF-8 text holds (so that the vocabulary needs uint32 ids),
    then every pair of printable ASCII characters, then every triple of digits. Returns the number of ranks."""
    import base64

    printable = [bytes([c]) for c in range(32, 127)]
    tokens = [bytes([b]) for b in range(256)] + [bytes([255, a, b]) for a in range(256) for b in range(256)]
    tokens += [a + b for a in printable for b in printable]
    digits = printable[16:26]
    tokens += [a + b + c for a in digits for b in digits for c in digits]
    with open(path, "w") as f:
        f.writelines(f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in enumerate(tokens))
    return len(tokens)


def test_llama3_tokenizer_from_a_bpe_file_writes_uint32_tokens(tmp_path, corpus, llama_like):
    """prepare_data.py --tokenizer FILE reads a tiktoken BPE file with tiktoken's loader and splits text with Llama
    3's pattern (digits in runs of at most 3: "12345" is 123|45, where GPT-2's pattern would merge 12|345); its 256
    special tokens follow the file's ranks, <|begin_of_text|> opens every text, <|end_of_text|> ends every document.
    A vocabulary beyond 65,536 is stored as uint32 (meta.json says so) and the batch sampler reads back every id;
    --init_from a checkpoint of another vocabulary is refused."""
    ranks = write_tiktoken_bpe(tmp_path / "tokenizer.model")
    tokenizer = prepare_data.get_tokenizer(str(tmp_path / "tokenizer.model"))
    assert tokenizer.vocab_size == ranks + 256 > 2 ** 16 and tokenizer.dtype == "uint32"
    assert (tokenizer.bos, tokenizer.eot) == (ranks, ranks + 1)
    assert tokenizer.decode([ranks + 6, ranks + 9, ranks + 255]) == ("<|start_header_id|><|eot_id|>"
                                                                    "<|reserved_special_token_246|>")
    ids = tokenizer.encode("12345 it's")
    assert ids[0] == ranks and [tokenizer.decode([i]) for i in ids[1:3]] == ["123", "45"]
    assert tokenizer.decode(ids[1:]) == "12345 it's"
    folder = tmp_path / "texts"
    folder.mkdir()
    lines = [f"line {i}: {i * 7919} caf\u00e9" for i in range(300)]
    (folder / "a.txt").write_text("\n".join(lines) + "\n")
    out = tmp_path / "prepared"
    meta = prepare_data.main(["--input", str(folder), "--tokenizer", str(tmp_path / "tokenizer.model"), "--out_dir",
                              str(out), "--val_fraction", "0.2", "--num_proc", "1"])
    assert (meta["tokenizer"], meta["vocab_size"], meta["dtype"]) == (str(tmp_path / "tokenizer.model"), ranks + 256,
                                                                      "uint32")
    train = np.fromfile(out / "train.bin", dtype=np.uint32)
    assert len(train) == meta["train_tokens"] and train.max() > 2 ** 16 and train[0] == tokenizer.bos
    documents = np.split(train, np.flatnonzero(train == tokenizer.eot) + 1)[:-1]  # each a row of 64 lines
    assert [document[0] for document in documents] == [tokenizer.bos] * len(documents) == [tokenizer.bos] * 4
    assert "".join(tokenizer.decode(document[1:-1].tolist()) for document in documents) == "".join(
        line + "\n" for line in lines[:len(documents) * 64])
    args = training.get_parser("").parse_args(flags(corpus, tmp_path / "run", data=str(out), block_size=16,
                                                    global_batch=4, micro_batch=4, model="llama-tiny"))
    _, config, sampler, _ = training.load_data(args, 0, 1, torch.device("cpu"), is_writer=False)
    assert config.vocab_size == ranks + 256
    x, y = sampler.get(0, 0)
    starts = sampler.offsets(0)
    assert np.array_equal(x.numpy(), np.stack([train[s:s + 16] for s in starts]))
    folder, _, _ = llama_like[False]
    with pytest.raises(training.UsageError, match=f"has a vocabulary of 256, but --data '{out}' is tokenized with "
                       f".*tokenizer.model \\({ranks + 256}\\): prepare the data"):
        train_single.main(flags(corpus, tmp_path / "run", model=None, init_from=folder, data=str(out)))


# ---- #30 the GPU path without waste: one read of the device a step, --compile with dropout compiles once

EVERY_SCRIPT = {  # script, ranks, extra flags: each strategy's loop and hooks once
    "single": (train_single.main, 1, {}),
    "ddp": (train_ddp.main, 2, {}),
    "fsdp": (train_fsdp.main, 2, {}),
    "tp-sequence-parallel": (train_tp.main, 2, dict(sequence_parallel=True)),
    "2d-sequence-parallel": (train_2d.main, 2, dict(tp=2, dp=1, sequence_parallel=True)),  # FSDP's hooks around TP's
    "pp": (train_pp.main, 2, dict(pp=2)),
    "zero": (train_zero.main, 2, dict(stage=2)),
    "cp": (train_cp.main, 2, dict(cp=2, cp_impl="ring")),
}


class CountHostReads(TorchDispatchMode):
    """Every read of a tensor's value by the host while active: aten._local_scalar_dense (.item(), bool(), float(),
    int() of a tensor) and Tensor.tolist, which on CPU reads memory without an aten call. On a GPU each waits for the
    device to finish everything queued before it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def _host_reads_by_step(main, argv):
    """The host's reads of tensor values while main(argv) runs on this rank, counted per optimizer step (cut where
    set_lr starts one)."""
    mode, starts, real_get_lr, real_tolist = CountHostReads(), [], training.get_lr, torch.Tensor.tolist

    def get_lr(step, args):
        starts.append(mode.count)
        return real_get_lr(step, args)

    def tolist(tensor):
        mode.count += 1
        return real_tolist(tensor)

    training.get_lr, torch.Tensor.tolist = get_lr, tolist
    try:
        with mode:
            main(argv)
    finally:
        training.get_lr, torch.Tensor.tolist = real_get_lr, real_tolist
    return [end - start for start, end in zip(starts, starts[1:] + [mode.count])]


@pytest.mark.parametrize("layout", list(EVERY_SCRIPT))
def test_a_step_reads_the_device_once(corpus, shared_tmp, layout):
    """A step that neither logs, evaluates nor saves reads a value from the device once: the agreement on whether its
    gradient norm is finite and whether a rank was asked to stop (one all-reduce of both). Any other read would make
    the host wait for the device in the middle of every step, on CUDA where launching is slow to begin with. Steps
    1 and 2 of 4 (step 0 and the last log, and the last saves)."""
    main, ranks, extra = EVERY_SCRIPT[layout]
    argv = flags(corpus, shared_tmp, max_steps=4, global_batch=8, eval_interval=0, log_interval=100, **extra)
    for rank, reads in enumerate(run_distributed(ranks, _host_reads_by_step, main, argv)):
        assert len(reads) == 4 and reads[1:3] == [1, 1], f"rank {rank}: reads per step {reads}"


def _graphs_by_step(main, argv):
    """main(argv) with --compile on Dynamo's eager backend (Dynamo traces, guards and breaks graphs as for inductor,
    and builds no kernels) and a model of 9 blocks, one more than Dynamo recompiles a function before it gives up on
    it and runs it eagerly: (graphs Dynamo has made, graph breaks) at the start of each step and at the end."""
    from torch._dynamo.utils import counters
    real_compile, real_get_lr, tiny = torch.compile, training.get_lr, gpt.PRESETS["tiny"]
    made = []

    def get_lr(step, args):
        made.append((counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())))
        return real_get_lr(step, args)

    torch.compile, training.get_lr = functools.partial(real_compile, backend="eager"), get_lr
    gpt.PRESETS["tiny"] = dict(n_layer=9, n_head=4, n_embd=32)
    torch._dynamo.reset()
    counters.clear()
    try:
        main(argv)
    finally:
        torch.compile, training.get_lr, gpt.PRESETS["tiny"] = real_compile, real_get_lr, tiny
    return made + [(counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))]


@pytest.mark.parametrize("layout", [layout for layout in EVERY_SCRIPT if layout != "cp"])  # no dropout, see below
def test_compile_with_dropout_compiles_once(corpus, shared_tmp, layout):
    """--compile --dropout 0.1 in every script (tensor parallelism with sequence parallelism, 2-D too): Dynamo traces
    each block's forward into one graph for training and one for evaluation, shared by all 9 blocks, before the
    first step ends, and never again: no graph break inside a block, no recompile. A random draw read into Python
    inside a block (a seed for a generator fork) would break the graph there, and a guard on its value would
    recompile every forward. train_cp.py refuses dropout, and leaves its attention core (collectives) out of the
    graph: test_cp_activation_checkpointing_compile_and_bfloat16 compiles it. Tensor parallelism leaves its f and g
    out too (traced, sequence parallelism's were wrong on an H200): a block is the pieces between them, graphs made in
    the first step, fewer than one a block, and never again."""
    main, ranks, extra = EVERY_SCRIPT[layout]
    dp = 2 if main in (train_ddp.main, train_fsdp.main, train_zero.main) else 1
    argv = flags(corpus, shared_tmp, compile=True, dropout=DROPOUT, max_steps=3, global_batch=2 * dp, **extra)
    for rank, made in enumerate(run_distributed(ranks, _graphs_by_step, main, argv, timeout_s=COMPILE_TIMEOUT_S)):
        if main in (train_tp.main, train_2d.main):
            assert made[1] == made[-1] and made[1][0] < 9 * 2, f"rank {rank}: (graphs, breaks) at each step {made}"
        else:
            assert made[1] == made[-1] == (2, 0), f"rank {rank}: (graphs, graph breaks) at each step's start {made}"


# ------------------------------------------------------------------------------------------------------------
# ---- #33 start-up that scales with a rank's part: init, resume and --init_from read only what a rank holds


STARTUP_CONFIG = dict(preset="llama-tiny", vocab_size=256, block_size=64)  # matrices of 64 to 384 rows
# Wide enough that a tensor-parallel slice of columns spans whole tiles of gpt.INIT_TILE, as in every real preset
WIDE_CONFIG = dict(n_layer=1, n_embd=1024, n_head=8, n_kv_head=4, mlp_hidden=2048, vocab_size=512)


def startup_parts(config, strategy, rank, tp=2, dp=3):
    """[(name, full shape, box, flat)] that rank `rank` of a layout holds, as its script lays them out: fsdp over dp
    ranks (each unit's flat buffer cut in ceil(size / dp) shards, the last one short), tp over tp ranks (column- and
    vocabulary-parallel weights by rows, row-parallel ones by columns), 2d: fsdp over dp of each tp slice."""
    with torch.device("meta"):
        model = gpt.GPT(config)
    tp_rank, dp_rank = (rank % tp, rank // tp) if strategy == "2d" else (rank, rank) if strategy == "tp" else (0, rank)
    tp, dp = (1, dp) if strategy == "fsdp" else (tp, 1) if strategy == "tp" else (tp, dp)
    boxes = {}
    for name, param in model.named_parameters():
        box = [(0, n) for n in param.shape]
        if tp > 1 and train_tp.is_sliced(name):
            dim = 1 if name.rpartition(".")[0].endswith(train_tp.ROW_PARALLEL) else 0
            size = param.shape[dim] // tp
            box[dim] = (tp_rank * size, (tp_rank + 1) * size)
        boxes[name] = (tuple(param.shape), tuple(box))
    parts = []
    for unit in train_fsdp.flat_parameter_groups(model):
        for entries in unit.values():
            sizes = [math.prod(b - a for a, b in boxes[name][1]) for name, _, _ in entries]
            shard = -(-sum(sizes) // dp)
            offset = -dp_rank * shard
            for (name, _, _), size in zip(entries, sizes):
                start, stop = max(offset, 0), min(offset + size, shard)
                if start < stop:
                    parts.append((name, *boxes[name], (start - offset, stop - offset)))
                offset += size
    return parts


@contextlib.contextmanager
def counting_random_numbers():
    """The elements torch.randn gives back while inside (gpt.initial_value draws through it)."""
    drawn = [0]
    randn = torch.randn

    def counted(*args, **kwargs):
        value = randn(*args, **kwargs)
        drawn[0] += value.numel()
        return value

    torch.randn = counted
    try:
        yield drawn
    finally:
        torch.randn = randn


@pytest.mark.parametrize("strategy,ranks", [("fsdp", 3), ("tp", 2), ("2d", 6)])
def test_initial_part_is_single_slice_and_draws_only_it(strategy, ranks):
    """Every rank's initial part equals the same slice of single-device init's full tensors, and drawing it takes
    about as many random numbers as it holds: FSDP over 3 ranks (uneven shards), TP over 2, 2-D 3 x 2."""
    config = dataclasses.replace(gpt.make_config(**STARTUP_CONFIG), **WIDE_CONFIG)
    value = training.initial_values(config, 5)
    with torch.device("meta"):
        shapes = {name: param.shape for name, param in gpt.GPT(config).named_parameters()}
    with counting_random_numbers() as drawn:
        full = {name: value(name, shape) for name, shape in shapes.items()}
    whole = drawn[0]
    for rank in range(ranks):
        parts = startup_parts(config, strategy, rank)
        with counting_random_numbers() as drawn:
            for name, shape, box, flat in parts:
                expected = full[name][tuple(slice(*b) for b in box)].flatten()[flat[0]:flat[1]]
                assert torch.equal(value(name, shape, box, flat), expected), (strategy, rank, name)
        held = sum(flat[1] - flat[0] for name, _, _, flat in parts if not name.endswith("bias")
                   and ".ln_" not in name and not name.startswith("ln_"))  # drawn at random: the matrices
        assert held <= drawn[0] <= 1.25 * held, f"rank {rank} of {strategy} drew {drawn[0]} for {held} elements"
        assert drawn[0] <= 1.25 * whole / ranks + 0.1 * whole, f"rank {rank} of {strategy}: {drawn[0]} of {whole}"


@pytest.mark.parametrize("strategy,ranks", [("fsdp", 3), ("tp", 2), ("2d", 6)])
def test_resumed_part_reads_only_its_pieces(tmp_path, strategy, ranks):
    """A checkpoint saved by 2-D 2 x 2 (pieces both sliced and sharded) resumes any rank's part of FSDP 3 (uneven),
    TP 2 and 2-D 3 x 2: equal to the same slice of the full tensors, with about as many elements read as it holds."""
    config = gpt.make_config(**STARTUP_CONFIG)
    full = {name: torch.randn(shape) for name, shape, _, _ in startup_parts(config, "fsdp", 0, dp=1)}
    for rank in range(4):  # what each rank of the saving layout writes: its part of every tensor
        tensors = {}
        for name, shape, box, flat in startup_parts(config, "2d", rank, tp=2, dp=2):
            if rank % 2 and box == tuple((0, n) for n in shape):
                continue  # replicated over tensor-parallel peers: written by the first
            data = full[name][tuple(slice(*b) for b in box)].flatten()[flat[0]:flat[1]]
            tensors.setdefault(name, []).append(checkpoint.piece(shape, data, box, flat))
        checkpoint.save_shard(str(tmp_path), 0, rank, tensors, None)
    checkpoint.publish(str(tmp_path), 0, 4, {"config": dataclasses.asdict(config), "args": {}})
    for rank in range(ranks):
        saved = checkpoint.Checkpoint(checkpoint.latest(str(tmp_path)))
        parts = [checkpoint.Part(name, shape, box, flat, torch.zeros(flat[1] - flat[0]))
                 for name, shape, box, flat in startup_parts(config, strategy, rank)]
        checkpoint.load(saved, parts, None, config)
        held = 0
        for part in parts:
            expected = full[part.name][tuple(slice(*b) for b in part.box)].flatten()[part.flat[0]:part.flat[1]]
            assert torch.equal(part.tensor, expected), (strategy, rank, part.name)
            held += part.flat[1] - part.flat[0]
        assert held <= saved.elements_read <= 1.2 * held, f"rank {rank} of {strategy}: read {saved.elements_read}"


def test_init_from_sharded_checkpoint_opens_only_its_files(tmp_path, monkeypatch):
    """--init_from a checkpoint sharded over many files (one tensor a file, named in model.safetensors.index.json):
    each FSDP rank of 3 maps only the files holding its parts and reads their rows alone, as its start-up line says,
    and the bytes that line counts are those that left each file (counted at safetensors' safe_open)."""
    folder = str(tmp_path / "gpt2-sharded")
    tensors = 2 + 12 * 2 + 2  # wte, wpe, 12 tensors a block, ln_f's two
    hugging_face.write_random_gpt2(folder, n_layer=2, n_head=4, n_embd=64, n_positions=64, vocab_size=256,
                                   files=tensors)
    args = argparse.Namespace(init_from=folder, block_size=64, dropout=0.0, model=None, data=None)
    config = hugging_face.pretrained_config(args, {"vocab_size": 256})
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        index = json.load(f)["weight_map"]
    every_file = set(index.values())
    assert len(every_file) == tensors
    loaded, real_open = collections.Counter(), hugging_face.safe_open
    monkeypatch.setattr(hugging_face, "safe_open", lambda path, *args, **kwargs: CountingSafetensorsFile(
        real_open(path, *args, **kwargs), loaded, os.path.basename(path)))
    for rank in range(3):
        hugging_face.bytes_read.clear()
        loaded.clear()
        value = training.initial_values(config, 0, folder)
        parts = startup_parts(config, "fsdp", rank)
        expected_files, held = set(), 0
        for name, shape, box, flat in parts:
            value(name, shape, box, flat)
            stored = hugging_face.hugging_face_box(name, box, config)[0]
            expected_files.add(index[stored])
            held += 4 * (flat[1] - flat[0])
        opened = {os.path.basename(path) for path in hugging_face.bytes_read}
        assert opened == expected_files and opened < every_file, f"rank {rank} opened {sorted(opened)}"
        read = sum(hugging_face.bytes_read.values())
        assert held <= read <= 1.2 * held, f"rank {rank} read {read} bytes for {held} bytes of parts"
        assert {os.path.basename(path): n for path, n in hugging_face.bytes_read.items()} == {
            file: 4 * elements for file, elements in loaded.items()}, f"rank {rank}: counted, and what left the files"
        assert f"read {read / 1e6:,.1f} MB from {len(opened)} files" == hugging_face.read_summary()


def test_plan_of_a_real_preset_on_the_default_corpus_takes_its_own_tokenizer(capsys):
    """The issue's 405B command names no --data: the byte corpus is the CPU presets' alone, so a real preset is
    planned with its own tokenizer's vocabulary (the guide's run has Llama 3's 128,256 tokens), tiny with 256."""
    argv = ["--plan", "--world_size", "64", "--block_size", "4096", "--micro_batch", "1", "--global_batch", "64"]
    _, llama = command_line(train_fsdp.main, argv + ["--model", "llama3.1-405b"], capsys)
    _, gpt3 = command_line(train_fsdp.main, argv + ["--model", "gpt3-175b"], capsys)
    _, tiny = command_line(train_fsdp.main, ["--plan", "--world_size", "2"], capsys)
    assert "vocabulary 128,256" in llama and "vocabulary 50,257" in gpt3 and "vocabulary 256)" in tiny


def test_plan_cpu_offload_moves_the_model_states_to_the_host(capsys, tmp_path):
    """--cpu_offload: the planner takes FSDP's shards, their gradients and AdamW off the GPU, puts the same bytes in
    host memory (per rank, and per node of 8), and adds the float32 shards that visit the device; nothing else moves."""
    argv = ["--plan", "--world_size", "16", "--model", "llama3.1-8b", "--block_size", "4096", "--micro_batch", "1",
            "--global_batch", "16", "--dtype", "bfloat16", "--activation_checkpointing", "--data",
            str(tmp_path / "llama")]
    _, resident = command_line(train_fsdp.main, argv, capsys)
    _, offloaded = command_line(train_fsdp.main, argv + ["--cpu_offload"], capsys)

    def rows(printed):
        return dict(re.match(r"  (.*?)\s+([\d,.]+ [MG]B)$", line).groups() for line in printed.splitlines()
                    if line.startswith("  "))

    on_gpu, off = rows(resident), rows(offloaded.split("host memory")[0])
    states = ("parameters (float32)", "gradients (float32)", "AdamW state (exp_avg, exp_avg_sq, step; float32)")
    assert not set(states) & set(off)  # none of them on the GPU any more
    staging = [item for item in off if item not in on_gpu]
    assert staging == ["float32 shards copied in to be all-gathered: a unit's, the next one's",
                       "a float32 gradient shard, reduce-scattered, before its copy out"]
    unchanged = [item for item in on_gpu if item not in states and item != "total, one rank"]
    assert [on_gpu[item] for item in unchanged] == [off[item] for item in unchanged] and len(unchanged) >= 6
    host = rows("host memory" + offloaded.split("host memory")[1])
    assert [host[item] for item in states] == [on_gpu[item] for item in states]
    per_rank, node = (float(host[item].split()[0]) for item in ("total, one rank", "total, a node of 8 ranks"))
    assert abs(node - 8 * per_rank) < 0.05


# ------------------------------------------------------------------------------------------------------------
# ---- #30 dropout that nothing else moves: evaluation, and resume under another layout


@pytest.mark.parametrize("layout", ["tp-sequence-parallel", "2d-sequence-parallel"])
def test_evaluation_never_changes_a_training_step(corpus, tmp_path_factory, shared_tmp, layout):
    """Dropout 0.1 under tensor parallelism: a run that evaluates at every step, killed at step 3 (its last step
    evaluated, then checkpointed) and resumed, trains bit-identically to the same layout evaluating at steps 0 and 5
    only and never stopped: evaluation draws nothing from the generators training draws its masks from."""
    main, ranks, extra = WITH_DROPOUT[layout]
    argv = flags(corpus, shared_tmp, dropout=DROPOUT, eval_interval=1, ckpt_interval=3, **extra)
    assert run_distributed(ranks, _train_until, main, 3, argv) == ["crashed"] * ranks
    run_distributed(ranks, main, argv + ["--resume"])
    run, reference = read_run(str(shared_tmp)), uninterrupted(corpus, tmp_path_factory, layout)
    assert len(run.val_losses) == 6 and run.val_losses.keys() != reference.val_losses.keys()
    assert_identical(run._replace(val_losses=reference.val_losses), reference)


def _replicated_by_step(main, argv):
    """main(argv) on this rank: a digest of every block's output in each training forward (the residual stream,
    which tensor-parallel peers hold alike without sequence parallelism), and at the end the tensors the layout
    replicates on them, whole or as this rank's FSDP piece ({name: array})."""
    outputs, models, real_wrap_blocks = [], [], training.wrap_blocks

    def digest(module, args, output):
        if module.training:
            outputs.append(hashlib.sha256(output.detach().numpy().tobytes()).hexdigest())

    def wrap_blocks(model, *args):  # every script calls it once, on the model its loop runs
        models.append(model)
        for module in model.modules():
            if isinstance(module, gpt.Block):
                module.register_forward_hook(digest)
        return real_wrap_blocks(model, *args)

    training.wrap_blocks = wrap_blocks
    try:
        main(argv)
    finally:
        training.wrap_blocks = real_wrap_blocks
    named = (models[0].named_parameters() if not hasattr(models[0], "parts") else  # our FSDP: its spans of the shards
             [(part.name, part.local()) for part in map(checkpoint.Part._make, models[0].parts())])
    replicated = {name: param.detach().numpy().copy() for name, param in named if not train_tp.is_sliced(name)}
    return outputs, replicated


RESUMED_ELSEWHERE = {  # saved by (script, ranks, flags), resumed by (script, ranks, flags, tp)
    "ddp-to-tp": ((train_ddp.main, 2, {}), (train_tp.main, 2, {}, 2)),
    "fsdp-to-2d": ((train_fsdp.main, 2, {}), (train_2d.main, 4, dict(tp=2, dp=2), 2)),
    "tp-2-to-tp-4": ((train_tp.main, 2, {}), (train_tp.main, 4, {}, 4)),
}


@pytest.mark.parametrize("change", list(RESUMED_ELSEWHERE))
def test_resume_under_another_layout_keeps_tensor_parallel_peers_alike(corpus, shared_tmp, change):
    """Dropout 0.1, a checkpoint of step 2 resumed under a layout with other tensor-parallel groups: the ranks of a
    TP group hold the same generators again (the saving layout's ranks held their own, or other groups), so for
    the 3 steps left their residual streams (every block's output, in every micro-step) and replicated weights
    (layer norms, wpe, row-parallel biases, whole or as FSDP pieces) stay bit-identical; data-parallel ranks draw
    apart. Restoring each rank's saved generators instead makes the peers' streams part at the first dropout."""
    (saver, saving_ranks, saving), (loader, ranks, extra, tp) = RESUMED_ELSEWHERE[change]
    run = dict(dropout=DROPOUT, global_batch=8, max_steps=5, ckpt_interval=2, eval_interval=0)
    saved = run_distributed(saving_ranks, _train_until, saver, 2, flags(corpus, shared_tmp, **run, **saving))
    assert saved == ["crashed"] * saving_ranks
    argv = flags(corpus, shared_tmp, resume=True, **run, **extra)
    ranks_seen = run_distributed(ranks, _replicated_by_step, loader, argv)
    micro_steps = 8 // (2 * (ranks // tp))  # of 2 sequences each
    for rank, (outputs, replicated) in enumerate(ranks_seen):
        peer_outputs, peer_replicated = ranks_seen[rank // tp * tp]  # its tensor-parallel group's first rank
        assert len(outputs) == 3 * micro_steps * 4 and outputs == peer_outputs, f"rank {rank}: other streams"
        assert all(np.array_equal(value, peer_replicated[name]) for name, value in replicated.items()), rank
    if ranks > tp:
        assert not set(ranks_seen[0][0]) & set(ranks_seen[tp][0])  # data-parallel ranks: other rows, other masks


# ------------------------------------------------------------------------------------------------------------
# ---- train_cp.py: context parallel, head-tail chunks, all-gather or ring attention, composed with data parallel

CP_BLOCK_SIZE = 64  # 8 tokens a chunk at --cp 4: every chunk pair, on and off the diagonal, holds several tokens
_cp_runs = {}


def cp_run(corpus, tmp_path_factory, ranks, **overrides):
    """train_cp.py on `ranks` ranks at CP_BLOCK_SIZE, once per distinct flags per session: read_run's result."""
    key = (ranks, tuple(sorted(overrides.items())))
    if key not in _cp_runs:
        out_dir = shared_folder(tmp_path_factory, "cp")
        argv = flags(corpus, out_dir, **{"block_size": CP_BLOCK_SIZE, **overrides})
        run_distributed(ranks, train_cp.main, argv)
        _cp_runs[key] = read_run(str(out_dir))
    return _cp_runs[key]


def reduction_order_noise(corpus, tmp_path_factory, **overrides):
    """How far train_single.py's run moves from itself when only the order of its float32 sums changes: the same run
    at micro batch 1 and 4 instead of 2 (16 and 4 accumulation steps, every gradient summed over the tokens in another
    order; the same math). The largest difference over both, of each figure: losses (training and validation) and
    gradient norms relative, final weights absolute."""
    reference = single_run(corpus, tmp_path_factory, **overrides)
    expected_losses = np.array(reference.losses + list(reference.val_losses.values()))
    noise = np.zeros(3)
    for micro_batch in (1, 4):
        run = single_run(corpus, tmp_path_factory, micro_batch=micro_batch, **overrides)
        losses = np.array(run.losses + list(run.val_losses.values()))
        noise = np.maximum(noise, [np.abs(losses / expected_losses - 1).max(),
                                   np.abs(np.array(run.grad_norms) / reference.grad_norms - 1).max(),
                                   max(np.abs(run.weights[name] - weight).max()
                                       for name, weight in reference.weights.items())])
    return noise


NOISE_FACTOR = 10  # how many times single's own reduction-order noise a layout may differ by: see test_cp_matches_single


@pytest.mark.parametrize("cp_impl, model, cp, dp", [("allgather", "tiny", 2, 1), ("ring", "tiny", 4, 1),
                                                    ("ring", "llama-tiny", 2, 2), ("allgather", "llama-tiny", 4, 1)])
def test_cp_matches_single(corpus, tmp_path_factory, cp_impl, model, cp, dp):
    """6 steps of 16 sequences of 64 tokens, accumulation 8 (4 with --dp 2), clipping active: each method on GPT-2's
    learned positions and Llama's rotary angles (grouped-query attention: 2 KV heads of 4), on 2 and 4
    context-parallel ranks and composed with 2 data-parallel ones, computes what one device computes: losses and
    final weights, and the gradient norms (the one figure where a gradient scaled by a constant shows).

    Each figure within NOISE_FACTOR times float32 reduction-order noise at this depth, measured here on one device:
    how far single's run moves from itself at micro batch 1 and 4 (reduction_order_noise). Measured: GPT-2's losses
    1e-7 relative, weights 3.3e-6 absolute, gradient norms 3e-7; Llama's 5.6e-7, 4.7e-6 and 2.9e-4, the last from
    step 4 on (at lr 3e-3 its loss rises there, and the norm is ill-conditioned: every step before within 2e-7).
    Context parallel sums attention over chunks in other orders: at most 4.3 times that noise, with the head-tail
    chunks and with two other load-balanced orders (rank i holding chunk 2cp-1-i first, or chunks cp-1-i and cp+i).
    The ring merging its blocks without rescaling the output so far, or by the larger log-sum-exp instead of their
    sum, moves the losses by 4e-3 to 4e-2 and the weights by 2e-2: thousands of times the noise."""
    reference = single_run(corpus, tmp_path_factory, model=model, block_size=CP_BLOCK_SIZE)
    loss_noise, grad_norm_noise, weight_noise = reduction_order_noise(corpus, tmp_path_factory, model=model,
                                                                      block_size=CP_BLOCK_SIZE)
    run = cp_run(corpus, tmp_path_factory, cp * dp, model=model, cp=cp, dp=dp, cp_impl=cp_impl)
    assert_runs_match(run, reference, tolerance=NOISE_FACTOR * loss_noise,
                      weight_tolerance=NOISE_FACTOR * weight_noise, grad_norm_tolerance=NOISE_FACTOR * grad_norm_noise)


def _cp_attention_against_one_device(cp_impl):
    """Random q, k, v of 2 sequences of 32 tokens (4 query heads, 2 KV heads), alike on every rank: this rank's
    chunks through train_cp's attention, against gpt.py's causal attention over the whole sequences. Returns (max
    difference of the outputs, of the gradients of q, k and v on this rank's tokens; the query-key pairs whose scores
    this rank computed)."""
    rank, cp = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 32, heads, 8, generator=generator, requires_grad=True) for heads in (4, 2, 2))
    grad_out = torch.randn(2, 32, 4, 8, generator=generator)
    reference = gpt.CausalSelfAttention(gpt.make_config("llama-tiny", 256, 32)).attend(q, k, v)
    expected = torch.autograd.grad(reference, (q, k, v), grad_out)
    pos = train_cp.chunk_positions(rank, cp, 32 // (2 * cp))
    local = [t.detach()[:, pos].requires_grad_() for t in (q, k, v)]
    pairs, real_block_attention = [], train_cp.block_attention

    def block_attention(q, k, v, diagonal):
        pairs.append(q.shape[-2] * (k.shape[-2] + 1) // 2 if diagonal else q.shape[-2] * k.shape[-2])
        return real_block_attention(q, k, v, diagonal)

    train_cp.block_attention = block_attention
    try:
        with RecordAttentionMasks() as masks:
            attention = train_cp.allgather_attention if cp_impl == "allgather" else train_cp.ring_attention
            y = attention(*local, dist.group.WORLD)
        grads = torch.autograd.grad(y, local, grad_out[:, pos])
    finally:
        train_cp.block_attention = real_block_attention
    differences = [(y - reference[:, pos]).abs().max().item()]
    differences += [(grad - full[:, pos]).abs().max().item() for grad, full in zip(grads, expected)]
    return differences, sum(pairs), masks.kinds


class RecordAttentionMasks(torch.overrides.TorchFunctionMode):
    """The type of the attn_mask of every scaled_dot_product_attention called while active (not the calls a
    CausalBias makes inside it: a mode is off while it handles a call)."""

    def __init__(self):
        super().__init__()
        self.kinds = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            self.kinds.append(type((kwargs or {}).get("attn_mask", args[3] if len(args) > 3 else None)).__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("cp_impl", ["allgather", "ring"])
def test_cp_attention_equals_one_device_and_balances_the_work(cp_impl):
    """On 4 ranks, each method's output and the gradients of q, k and v (dK and dV summed over every rank's queries,
    back on the rank that holds them) equal one device's on this rank's tokens. The ring computes only the chunk pairs
    the causal mask does not wholly hide, and under head-tail chunks every rank computes the same number of visible
    query-key pairs: 1/4 of one device's 32·33/2, a sequence and a head. The all-gather calls attention once a query
    chunk with no mask tensor (a CausalBias: the variant and two lengths, which CUDA's fused kernels take as is)."""
    ranks = run_distributed(4, _cp_attention_against_one_device, cp_impl)
    for rank, (differences, _, masks) in enumerate(ranks):
        assert max(differences) < 1e-5, f"rank {rank}: output, dq, dk, dv differ by {differences}"
        assert masks == (["CausalBias"] * 2 if cp_impl == "allgather" else []), masks
    if cp_impl == "ring":
        work = [pairs for _, pairs, _ in ranks]
        assert work == [32 * 33 // 2 // 4] * 4, work


def test_ring_fused_block_kernel_fits_the_ring_on_meta():
    """CUDA's block kernel (not yet run on a GPU) on meta tensors, which run its shape functions: what the ring's
    explicit matmuls return, in shape and dtype: a grouped-query block of 40 queries (3 query heads a KV head, the
    log-sum-exp padded to 64 by the kernel) on key and value views of a longer sequence, in bfloat16."""
    q, grad_out = (torch.empty(2, 2, 3, 40, 16, device="meta", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.empty(2, 2, 1, 80, 16, device="meta", dtype=torch.bfloat16)[..., :40, :] for _ in range(2))
    out, lse = train_cp.fused_block_attention(q, k, v, True)
    grads = train_cp.fused_block_attention_backward(q, k, v, grad_out, out, lse, True)
    explicit = [torch.zeros(t.shape, dtype=t.dtype) for t in (q, k, v, grad_out)]
    expected_out, expected_lse = train_cp.block_attention(*explicit[:3], True)
    expected = train_cp.block_attention_backward(*explicit, expected_out, expected_lse, expected_lse, True)
    for got, wanted in zip((out, lse, *grads), (expected_out, expected_lse, *expected)):
        assert (got.shape, got.dtype) == (wanted.shape, wanted.dtype)


def _ring_message_dtypes():
    """bfloat16 q, k and v of 2 sequences of 32 tokens through ring_attention, forward and backward, on this rank:
    the dtype of every message it sent around the ring, in order."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 8, heads, 8, generator=generator).bfloat16().requires_grad_() for heads in (4, 2, 2))
    sent, real_ring_exchange = [], train_cp.ring_exchange

    def ring_exchange(tensor, group):
        sent.append(str(tensor.dtype))
        return real_ring_exchange(tensor, group)

    train_cp.ring_exchange = ring_exchange
    try:
        train_cp.ring_attention(q, k, v, dist.group.WORLD).float().sum().backward()
    finally:
        train_cp.ring_exchange = real_ring_exchange
    return sent


def test_ring_attention_sends_its_dk_dv_partial_sums_in_float32():
    """Under bfloat16 the ring's keys and values travel in bf16, but the dK/dV partial sums that pass from rank to rank
    on their way home stay float32: rounded to bf16 at each of the cp - 1 hops, their error would grow with cp."""
    for sent in run_distributed(4, _ring_message_dtypes):
        keys, sums = "torch.bfloat16", "torch.float32"  # backward: a hop's block, then the sum for the one before
        assert sent == [keys] * 3 + [keys, keys, sums, keys, sums, sums], sent


def _cp_refused(argv):
    """train_cp.main's refusal on this rank, which must come before its first collective."""
    real = dist.all_gather_object  # init_distributed's fingerprint check: the first collective of a run
    dist.all_gather_object = lambda *args, **kwargs: pytest.fail("a collective before the refusal")
    try:
        train_cp.main(argv)
    except training.UsageError as error:
        return str(error)
    finally:
        dist.all_gather_object = real


@pytest.mark.parametrize("world_size, overrides, message", [
    (2, dict(cp=2, block_size=30), "--block_size 30 does not split into 2 x --cp 2 = 4 equal chunks: choose a "
                                   "multiple of 4"),
    (2, dict(cp=2, dp=2), "--cp 2 x --dp 2 = 4 ranks, but the world has 2: choose --cp and --dp"),
    (2, dict(cp=2, dropout=0.1), "--dropout 0.1 with --cp 2: one device's attention-dropout masks cannot be drawn"),
    (2, dict(cp=2, attn="flash"), "--attn flash with --cp 2: attention over the ranks is train_cp.py's own"),
    (2, dict(cp=2, impl="torch", device="cpu"), "--impl torch needs CUDA: torch's context_parallel has sharding rules "
                                                "for the CUDA attention kernels alone"),
])
def test_cp_bad_layout_is_refused_on_every_rank_before_any_collective(corpus, tmp_path, world_size, overrides,
                                                                      message):
    errors = run_distributed(world_size, _cp_refused, flags(corpus, tmp_path, **overrides))
    assert all(error and message in error for error in errors), errors


def _torch_sharded_chunks():
    """Per (cp, dp) layout of this world: whether torch's context_parallel, inside TorchContextParallel.sharded, gave
    this rank ours' chunks of the token ids and targets, and their global positions."""
    import torch_reference
    rank, matches = dist.get_rank(), []
    for cp, dp in [(4, 1), (2, 2)]:
        model = gpt.GPT(gpt.make_config("tiny", 256, 32))
        cp_model = torch_reference.TorchContextParallel(model, torch.device("cpu"), cp, dp, "ring")
        generator = torch.Generator().manual_seed(rank // cp)  # a data-parallel rank's rows, alike in its cp group
        idx, targets = (torch.randint(0, 256, (3, 32), generator=generator) for _ in range(2))
        pos = train_cp.chunk_positions(rank % cp, cp, 32 // (2 * cp))
        with cp_model.sharded(idx, targets) as (x, y):
            matches.append(torch.equal(x, idx[:, pos]) and torch.equal(y, targets[:, pos])
                           and torch.equal(cp_model.pos, pos))
        cp_model.restore()
    return matches


def test_cp_torch_context_parallel_shards_the_batch_as_ours():
    """The part of the --impl torch yardstick that runs on CPU: torch's context_parallel, with its head-tail load
    balancing, cuts each batch into ours' chunks (and their positions), alone on 4 ranks and within a (dp, cp) mesh."""
    assert run_distributed(4, _torch_sharded_chunks) == [[True, True]] * 4


@launches_its_own_ranks
@pytest.mark.parametrize("cp_impl", ["allgather", "ring"])
def test_cp_torch_context_parallel_matches_single(corpus, tmp_path, tmp_path_factory, cp_impl):
    """--impl torch, the yardstick: torch's context_parallel on 2 GPUs (NCCL), its all-gather and its all-to-all
    rotation, head-tail chunks, equals train_single.py in float32 over 6 steps with accumulation."""
    if torch.cuda.device_count() < 2:
        pytest.skip("torch's context_parallel runs on CUDA alone (no sharding rule for the CPU attention kernel): "
                    "needs 2 GPUs")
    argv = flags(corpus, tmp_path / "cp", block_size=CP_BLOCK_SIZE, cp=2, cp_impl=cp_impl, impl="torch")
    with launcher(tmp_path) as start:
        code, output, _ = start(*standalone(2, "train_cp.py", argv)).wait()
    assert code == 0, output[-5000:]
    reference = single_run(corpus, tmp_path_factory, model="tiny", block_size=CP_BLOCK_SIZE)
    assert_runs_match(read_run(str(tmp_path / "cp")), reference)


def _cp_compiled(argv):
    """train_cp.main(argv) with torch.compile on Dynamo's eager backend (it traces and guards as for inductor)."""
    real_compile = torch.compile
    torch.compile = functools.partial(real_compile, backend="eager")
    torch._dynamo.reset()
    try:
        train_cp.main(argv)
    finally:
        torch.compile = real_compile


def test_cp_activation_checkpointing_compile_and_bfloat16(corpus, shared_tmp, tmp_path_factory):
    """The ring under --activation_checkpointing (its forward, collectives and all, runs again in backward) and
    --compile (the attention core left out of each block's graph) equals one device in float32; the all-gather in
    bf16 autocast (chunks of 8 tokens) is within BF16_TOLERANCE of single's bf16 losses."""
    argv = flags(corpus, shared_tmp, block_size=CP_BLOCK_SIZE, cp_impl="ring", activation_checkpointing=True,
                 compile=True)
    run_distributed(2, _cp_compiled, argv, timeout_s=COMPILE_TIMEOUT_S)
    reference = single_run(corpus, tmp_path_factory, model="tiny", block_size=CP_BLOCK_SIZE)
    assert_runs_match(read_run(str(shared_tmp)), reference)
    bf16 = cp_run(corpus, tmp_path_factory, 2, block_size=32, dtype="bfloat16", max_steps=3).losses
    expected = single_run(corpus, tmp_path_factory, dtype="bfloat16", max_steps=3).losses  # the pipeline's too
    assert len(bf16) == 3 and max(abs(a - b) / b for a, b in zip(bf16, expected)) < BF16_TOLERANCE


@launches_its_own_ranks  # 2, 4 and 1 ranks in turn
def test_cp_resumes_from_and_into_other_layouts(corpus, shared_tmp, tmp_path_factory):
    """One run of 6 steps, checkpointed every 2: DDP on 2 ranks crashes at step 3; the ring on 4 context-parallel
    ranks resumes from step 2 and crashes at step 5; one device resumes from step 4 and finishes: train_single's 6
    steps. Every layout writes and reads the one format."""
    argv = lambda **layout: flags(corpus, shared_tmp, ckpt_interval=2, block_size=CP_BLOCK_SIZE, **layout)  # noqa
    assert run_distributed(2, _train_until, train_ddp.main, 3, argv()) == ["crashed"] * 2
    assert run_distributed(4, _train_until, train_cp.main, 5, argv(cp=4, cp_impl="ring", resume=True)) == \
        ["crashed"] * 4
    with one_thread():
        train_single.main(argv(resume=True))
    assert checkpoint.latest(str(shared_tmp)).endswith("ckpt-0000006")
    reference = single_run(corpus, tmp_path_factory, model="tiny", block_size=CP_BLOCK_SIZE)
    assert_runs_match(read_run(str(shared_tmp)), reference)


# ------------------------------------------------------------------------------------------------------------
# ---- #43 4-D: data parallel (FSDP) x pipeline x context x tensor parallel, train_4d.py

_4d_runs = {}


def _train_4d(argv):
    """train_4d.main on this rank; returns the tokens of its sample after training."""
    real_generate, tokens = gpt.generate, []
    gpt.generate = lambda *args, **kwargs: tokens.append(real_generate(*args, **kwargs)) or tokens[-1]
    try:
        train_4d.main(argv)
    finally:
        gpt.generate = real_generate  # a launched world runs in the test process
    return tokens[0].numpy()


def run_4d(corpus, tmp_path_factory, ranks, **overrides):
    """train_4d.py on `ranks` ranks, once per distinct flags per session, with a short sample at the end: (read_run's
    result, each rank's sample tokens)."""
    key = (ranks, tuple(sorted(overrides.items())))
    if key not in _4d_runs:
        out_dir = shared_folder(tmp_path_factory, "4d")
        samples = run_distributed(ranks, _train_4d, flags(corpus, out_dir, sample_tokens=PP_SAMPLE_TOKENS, **overrides))
        _4d_runs[key] = read_run(str(out_dir)), samples
    return _4d_runs[key]


FOUR_D_LAYOUTS = [  # (dp, pp, cp, tp), model, schedule, other flags: each axis at 1 once, both of each
    ((2, 2, 1, 2), "tiny", "gpipe", dict(dp_impl="ddp", sequence_parallel=True)),
    ((1, 2, 2, 2), "llama-tiny", "1f1b", dict(cp_impl="ring")),
    ((2, 1, 2, 2), "tiny", "1f1b", dict(sequence_parallel=True)),
    ((2, 2, 2, 1), "llama-tiny", "gpipe", {}),
    ((2, 2, 2, 2), "tiny", "1f1b", dict(no_reshard=True)),
    ((2, 2, 1, 2), "llama-tiny", "1f1b", {}),
]


@pytest.mark.parametrize("degrees, model, schedule, options", FOUR_D_LAYOUTS, ids=lambda value: "x".join(
    f"{axis}{n}" for axis, n in zip(("dp", "pp", "cp", "tp"), value)) if isinstance(value, tuple) else
    "-".join(f"{key} {flag}" for key, flag in value.items()) or "defaults" if isinstance(value, dict) else value)
def test_4d_matches_single(corpus, tmp_path_factory, degrees, model, schedule, options):
    """6 steps, accumulation 16 / (2 x dp), clipping active, at the tests' usual tolerances: losses, validation losses
    (through the pipeline, on each rank's chunks), grad norms (each element counted once: TP slices, replicated tensors
    on TP rank 0, FSDP shards, the tied weight on the first stage) and the weights equal train_single's. The sample
    after training, run through the pipeline with whole logits on every rank, is the one a single device draws from
    single's final weights."""
    dp, pp, cp, tp = degrees
    run, samples = run_4d(corpus, tmp_path_factory, dp * pp * cp * tp, model=model, dp=dp, pp=pp, cp=cp, tp=tp,
                          schedule=schedule, **options)
    reference = single_run(corpus, tmp_path_factory, model=model)
    assert_runs_match(run, reference)
    single = gpt.GPT(gpt.make_config(model, vocab_size=256, block_size=32))
    single.init_weights(0, lambda name, shape: torch.from_numpy(reference.weights[name]))
    prompt = torch.tensor([prepare_data.ByteTokenizer().encode("\n")])
    expected = gpt.generate(single, prompt, PP_SAMPLE_TOKENS, 32, 256, temperature=0.8, top_k=40, seed=1234).numpy()
    for tokens in samples:
        np.testing.assert_array_equal(tokens, expected)


def _refused_by_4d(argv):
    """train_4d.main's refusal on this rank, which must come before its first collective."""
    try:
        train_4d.main(argv)
    except (ValueError, RuntimeError) as error:
        return str(error)
    return None


@pytest.mark.parametrize("ranks, overrides, message", [
    (4, dict(pp=2, cp=2, tp=2), "--dp 1 x --pp 2 x --cp 2 x --tp 2 = 8 ranks, but the world has 4"),
    (2, dict(cp=2, block_size=30), "--cp 2 needs --block_size a multiple of 4, --dropout 0 and --attn sdpa"),
    (2, dict(cp=2, dropout=0.1), "--cp 2 needs --block_size a multiple of 4, --dropout 0 and --attn sdpa"),
    (3, dict(tp=3), "n_head (4) is not divisible by --tp 3"),
    (5, dict(pp=5, global_batch=10), "--pp 5 stages, but the model has 4 layers"),
    (8, dict(cp=2, tp=4, sequence_parallel=True, block_size=36), "--cp 2 needs --block_size a multiple of 8"),
    (2, dict(impl="torch"), "train_4d.py has no --impl torch"),
    (2, dict(dp_impl="ddp", no_reshard=True), "--no_reshard is FSDP's (DDP gathers nothing)"),
])
def test_4d_bad_layout_is_refused_on_every_rank_before_any_collective(corpus, tmp_path, ranks, overrides, message):
    errors = run_distributed(ranks, _refused_by_4d, flags(corpus, tmp_path, **overrides))
    assert all(error and message in error for error in errors), errors


def test_4d_resumes_from_and_into_one_device(corpus, shared_tmp, tmp_path_factory):
    """One run of 6 steps, checkpointed every step: one device crashes at step 2; 2 stages x 2 context-parallel x 2
    tensor-parallel ranks resume from step 2 (each reading its FSDP shard of its TP slices, both ends of a pipeline the
    tied weight) and crash at step 4; 2 replicas (--dp_impl ddp) x 2 stages x 2 TP ranks resume from step 4 (whole TP
    slices) and crash at step 5, the first replica having saved; one device resumes from step 5 (each rank's pieces,
    the tied weight the first stage's) and finishes: train_single's 6 steps."""
    argv = lambda **layout: flags(corpus, shared_tmp, ckpt_interval=1, **layout)  # noqa: E731
    with one_thread():
        assert _train_until(train_single.main, 2, argv()) == "crashed"
    assert run_distributed(8, _train_until, train_4d.main, 4, argv(pp=2, cp=2, tp=2, resume=True)) == ["crashed"] * 8
    ddp = argv(dp=2, pp=2, tp=2, dp_impl="ddp", resume=True)
    assert run_distributed(8, _train_until, train_4d.main, 5, ddp) == ["crashed"] * 8
    assert checkpoint.latest(str(shared_tmp)).endswith("ckpt-0000005")
    with one_thread():
        train_single.main(argv(resume=True))
    assert checkpoint.latest(str(shared_tmp)).endswith("ckpt-0000006")
    assert_runs_match(read_run(str(shared_tmp)), single_run(corpus, tmp_path_factory))


def _states_held_by_4d(argv):
    """train_4d.main(argv) on this rank: (the bytes of parameters, gradients and AdamW state it held, the most bytes
    FSDP's gathered FlatParameters held at once, the bytes of the largest piece its last checkpoint wrote)."""
    start_gather, free, gathered = train_fsdp.FlatParameter.start_gather, train_fsdp.FlatParameter.free, [0, 0]
    real_pieces, largest = checkpoint.pieces, [0]

    def pieces(*args):
        tensors = real_pieces(*args)
        largest[0] = max(piece["data"].nbytes for written in tensors.values() for piece in written)
        return tensors

    def counted(method, sign):
        def wrapper(flat):
            was = flat.is_gathered()
            method(flat)
            if was != flat.is_gathered():
                gathered[0] += sign * flat.full.nbytes
                gathered[1] = max(gathered)
        return wrapper

    train_fsdp.FlatParameter.start_gather, train_fsdp.FlatParameter.free = counted(start_gather, 1), counted(free, -1)
    checkpoint.pieces = pieces
    try:
        with bench.memory_held({}) as held, one_thread():
            train_4d.main(argv)
    finally:
        train_fsdp.FlatParameter.start_gather, train_fsdp.FlatParameter.free = start_gather, free
        checkpoint.pieces = real_pieces
    return held["parameters"] + held["gradients"] + held["optimizer"], gathered[1], largest[0]


def test_4d_plan_counts_each_stages_shards_to_the_byte(corpus, shared_tmp, capsys):
    """--plan knows train_4d.py: on 2 stages x 2 context-parallel x 2 tensor-parallel ranks, each rank's parameters,
    gradients and AdamW state are its stage's TP slices in train_4d's FSDP units, each flat shard padded over the data
    group (the 2 context-parallel ranks), as the planner counts them, to the byte, and so are the gathered weights
    at their peak (the root, the pair a block's forward prefetches, the last block a forward left kept), and the
    largest piece a rank's checkpoint writes is the plan's host staging (a parameter's span of a shard); under
    --dp_impl ddp (2 stages x 2 replicas) its whole stage, and rank 0 sends plan.four_d_terms' collectives, to the
    byte (its gradient bucket in the last micro-batch, the tied weight's whole slice, the norm over one replica);
    --plan prints the fullest stage."""
    held = run_distributed(8, _states_held_by_4d, flags(corpus, shared_tmp, pp=2, cp=2, tp=2, max_steps=1))
    config = gpt.make_config("tiny", 256, 32)
    layout = plan.Layout("4d", 8, 1, 2, 2, pp=2, micro_batches=8, cp=2)
    for rank, (states, gathered, piece) in enumerate(held):
        rows = plan.four_d_stage_plan(config, layout, rank // 4, train_pp.stage_layers, train_pp.schedule,
                                      train_tp.is_sliced)
        assert states == sum(size for _, size in rows[:3]), (rank, rows[:3])
        assert [gathered] == [size for item, size in rows if item.startswith("gathered weights")], (rank, rows)
        spans = plan.four_d_spans(config, layout, rank // 4, train_pp.stage_layers, train_tp.is_sliced, rank // 2 % 2)
        assert piece == 4 * max(spans.values()), (rank, spans)  # its largest span of a shard, on stage rank // 4
    staged = plan.save_staging(config, layout, train_tp.is_sliced, layers=train_pp.stage_layers)
    assert max(piece for *_, piece in held) == staged  # the largest piece any rank's save copies to the host
    held = run_distributed(4, _profiled, train_4d.main, flags(corpus, os.path.join(shared_tmp, "ddp"), pp=2, dp=2,
                                                                 dp_impl="ddp"))
    layout = plan.Layout("4d", 4, 2, 1, 2, pp=2, micro_batches=4, dp_impl="ddp")  # --dp_impl ddp: whole stages
    for rank, (_, states) in enumerate(held):
        rows = plan.four_d_stage_plan(config, layout, rank % 2, train_pp.stage_layers, train_pp.schedule, None)
        assert states["parameters"] + states["gradients"] + states["optimizer"] == sum(size for _, size in rows[:3])
    terms = plan.four_d_terms(config, layout, 0, train_pp.stage_layers, train_pp.schedule, None, "gloo",
                              train_ddp.assign_buckets)
    sent = assert_sends_its_formula(held[0][0], terms, 2)  # rank 0: stage 0 of data rank 0
    # bench counts TP's all-reduces over its one rank, which send nothing, as pairs: each a float32 residual stream
    one_rank = sum(term.count for term in terms if term.group == "tp") * 4 * 2 * 32 * config.n_embd
    assert sent - one_rank == pytest.approx(as_bench_counts(terms, {"world": 4}), abs=0.5), terms
    rows = train_4d.main(["--plan", "--world_size", "16", "--dp", "2", "--pp", "2", "--cp", "2", "--tp", "2",
                          "--block_size", "32"])
    assert "4d on 16 ranks (dp 2 x tp 2 x cp 2, allgather x pp 2, 1f1b)" in capsys.readouterr().out
    assert rows[0][0].startswith("stage ")


def as_bench_counts(terms, sizes, group_size=2):
    """The bytes of `terms` as bench.py counts them, every collective over group_size ranks: a term over a group of
    another size ({group: ranks}) rescaled by the ring factors."""
    return sum(term.bytes * plan.wire_bytes(term.kind, 1, group_size) / plan.wire_bytes(term.kind, 1, sizes[term.group])
               if term.group in sizes else term.bytes for term in terms)


@launches_its_own_ranks
def test_4d_bench_measures_what_the_formula_says(corpus, tmp_path):
    """What rank 0 (stage 0 of 2, of 2 context-parallel x 2 tensor-parallel ranks, sequence parallel) sends in one
    step, read from the profiler by bench.py, is plan.four_d_terms, the sum of the axes' own terms: the same number of
    collectives and the same bytes (the gradient norm's, the agreement's and the logged loss's run over all 8 ranks,
    which bench counts in groups of 2), among them rank 0's spans of the replicated parameters' gradients, more than
    their mean share (each flat's padding lies on its last shard). GPT-2 (the tied weight's sum), 1F1B, 4
    micro-batches of 2, float32; bench.py --strategies 4d --sequence_parallel runs the same layout beside the same
    formula and the planned model states. Without sequence parallelism the same FSDP, CP and PP terms are counted;
    TP's own: test_bench_formula_counts_every_collective[tp]; --dp_impl ddp's: test_4d_plan_counts_each_stages_shards_to_the_byte."""
    args = argparse.Namespace(model="tiny", data=corpus, block_size=32, steps=3, warmup=0, device="cpu",
                              dtype="float32", compile=False, threads=1)
    extra = ["--pp", "2", "--cp", "2", "--tp", "2", "--micro_batch", "2", "--sequence_parallel"]
    row = bench.run_once(args, "4d", "train_4d.py", 8, extra, None, 2, 8, str(tmp_path))
    layout = plan.Layout("4d", 8, 1, 2, 2, sequence_parallel=True, pp=2, micro_batches=4, cp=2)
    terms = plan.four_d_terms(gpt.make_config("tiny", 256, 32), layout, 0, train_pp.stage_layers, train_pp.schedule,
                              train_tp.is_sliced, "gloo")
    assert row["collectives"] == sum(term.count for term in terms), terms
    assert row["comm_bytes"] == pytest.approx(as_bench_counts(terms, {"world": 8}), abs=0.5), terms
    table = bench.strategies(argparse.Namespace(global_batch=8, bucket_mb=25, sequence_parallel=True, **vars(args)))
    assert table["4d"].formula() == terms and row["state_bytes"] == table["4d"].states()


# ------------------------------------------------------------------------------------------------------------
# --init_from a Mixtral (MixtralForCausalLM): Llama's blocks, each MLP a mixture of experts whose every expert is a
# tensor of its own name in the files, so a rank reads the experts it holds and no other; export.py writes it back.


def write_hugging_face_mixtral(folder, tensors, n_head=4, n_kv_head=2, files=3, **config):
    """config.json as the hub's Mixtral-8x7B-v0.1 writes it (its shapes aside), and the tensors in `files` safetensors
    shards with model.safetensors.index.json, consecutive tensors a file as save_pretrained() cuts them (so a layer's
    experts may lie in two files)."""
    n_layer = sum(name.endswith("input_layernorm.weight") for name in tensors)
    vocab_size, n_embd = tensors["model.embed_tokens.weight"].shape
    n_expert, intermediate_size = (sum(name.startswith("model.layers.0.") and name.endswith("w1.weight")
                                       for name in tensors), len(tensors["model.layers.0.block_sparse_moe.experts.0.w1.weight"]))
    hf = dict(architectures=["MixtralForCausalLM"], attention_dropout=0.0, bos_token_id=1, eos_token_id=2,
              hidden_act="silu", hidden_size=n_embd, initializer_range=0.02, intermediate_size=intermediate_size,
              max_position_embeddings=64, model_type="mixtral", num_attention_heads=n_head, num_experts_per_tok=2,
              num_hidden_layers=n_layer, num_key_value_heads=n_kv_head, num_local_experts=n_expert,
              output_router_logits=False, rms_norm_eps=1e-5, rope_theta=1000000.0, router_aux_loss_coef=0.02,
              sliding_window=None, tie_word_embeddings=False, torch_dtype="bfloat16", use_cache=True,
              vocab_size=vocab_size)
    hf.update(config)
    weight_map = {name: f"model-{k * files // len(tensors) + 1:05d}-of-{files:05d}.safetensors"
                  for k, name in enumerate(tensors)}
    return write_hugging_face_folder(folder, hf, tensors, weight_map)


def mixtral_mlp(h, w, hf):
    """MixtralForCausalLM's sparse MLP (modeling_mixtral.py) on one layer's tensors w, in float64: the router's softmax
    over the experts, the top num_experts_per_tok of it renormalised to sum to 1, and each expert's
    w2(silu(w1(x)) · w3(x)) weighted by it (here every expert runs on every token, weighted 0 where not chosen)."""
    routing = (h @ w["block_sparse_moe.gate.weight"].t()).softmax(-1)
    top, chosen = routing.topk(hf["num_experts_per_tok"], dim=-1)
    weights = torch.zeros_like(routing).scatter(-1, chosen, top / top.sum(-1, keepdim=True))
    y = torch.zeros_like(h)
    for e in range(hf["num_local_experts"]):
        expert = lambda name: w[f"block_sparse_moe.experts.{e}.{name}.weight"].t()  # noqa: E731
        y = y + weights[..., e:e + 1] * ((F.silu(h @ expert("w1")) * (h @ expert("w3"))) @ expert("w2"))
    return y


MIXTRAL_STORED = {"mlp.router": "block_sparse_moe.gate", "gate": "w1", "fc": "w3", "proj": "w2"}


def mixtral_stored_name(name):
    """MixtralForCausalLM's name of our parameter `name`, by the definitions of the two models: Llama's, but the MLP,
    blocks.i.mlp.router (block_sparse_moe.gate) and blocks.i.mlp.experts.e.{gate, fc, proj} (w1, w3, w2)."""
    if ".mlp.experts." in name:
        block, expert = name.split(".mlp.experts.")
        e, linear, _ = expert.split(".")
        return f"model.layers.{block.split('.')[1]}.block_sparse_moe.experts.{e}.{MIXTRAL_STORED[linear]}.weight"
    if ".mlp.router." in name:
        return f"model.layers.{name.split('.')[1]}.block_sparse_moe.gate.weight"
    return llama_stored_name(name)


@pytest.fixture(scope="module")
def mixtral_like(tmp_path_factory):
    """(folder, tensors, config.json): a random Mixtral with the default corpus' vocabulary (256 byte tokens), 2 layers
    of width 64, 4 query heads sharing 2 key/value heads, 8 experts of width 32, 2 a token, in 3 safetensors shards
    and an index; under torchrun rank 0 writes it into a folder every rank names alike."""
    tensors = hugging_face_llama(intermediate_size=32, n_expert=8)
    folder = _same_on_every_rank(tmp_path_factory.mktemp("mixtral_like"))
    if LAUNCHED_WORLD == 1 or dist.get_rank() == 0:
        write_hugging_face_mixtral(folder, tensors)
    if LAUNCHED_WORLD > 1:
        dist.barrier()
    return str(folder), tensors, json.load(open(os.path.join(folder, "config.json")))


def test_hugging_face_mixtral_loads_and_computes_mixtrals_logits(mixtral_like):
    """A Mixtral in three safetensors shards gives our parameters the stored tensors (by the two models' definitions)
    and computes MixtralForCausalLM's logits and loss (its forward written above, in float64) within float32 noise
    (measured: 9.7e-6 on logits); one read a parameter, each counted as it leaves its file, exactly the parameters'
    elements stored there. (Layouts that split a Mixtral read their experts alone: the test after this one.)"""
    folder, tensors, hf = mixtral_like
    config = hugging_face.config_from_hugging_face(hf, 32, 0.0)
    assert (config.n_expert, config.n_expert_per_token, config.mlp_hidden, config.rope_theta) == (8, 2, 32, 1e6)
    value = training.initial_values(config, 0, folder)
    for name, expected in gpt_weights_from_hugging_face_llama(tensors, config).items():
        assert torch.equal(value(name, expected.shape), expected), name
    idx = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    reference = hugging_face_llama_logits(tensors, hf, idx[:, :-1])
    reference_loss = F.cross_entropy(reference.flatten(0, 1), idx[:, 1:].flatten()).item()
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    (logits, loss, reads, parts, _, loaded), = run_distributed(1, _load_and_run, "single", folder, idx)
    print(f"mixtral: logits differ by {np.abs(logits - reference.numpy()).max():.1e}; read {loaded} elements")
    np.testing.assert_allclose(logits, reference.numpy(), rtol=0, atol=LOGITS_TOLERANCE)
    assert loss == pytest.approx(reference_loss, rel=0, abs=LOGITS_TOLERANCE)
    assert len(reads) == len(parts)
    stored = collections.Counter()
    for name, tensor in tensors.items():
        stored[weight_map[name]] += tensor.numel()
    assert loaded == stored


def test_a_rank_holding_experts_2_and_3_reads_only_theirs(mixtral_like, monkeypatch):
    """A rank that holds experts 2 and 3 of every layer (as expert parallelism over 4 ranks places them) asks for
    their parameters alone and reads exactly their elements, counted as they leave the files: from each shard those
    of experts 2 and 3 stored there, and it opens no shard that holds none (the middle one). A box of one (rows 8 to
    24 of expert 3's gate, as a tensor-parallel expert would ask) reads those rows alone."""
    folder, tensors, hf = mixtral_like
    config = hugging_face.config_from_hugging_face(hf, 32, 0.0)
    loaded, real_open = collections.Counter(), hugging_face.safe_open
    monkeypatch.setattr(hugging_face, "safe_open", lambda path, *args, **kwargs: CountingSafetensorsFile(
        real_open(path, *args, **kwargs), loaded, os.path.basename(path)))
    value = training.initial_values(config, 0, folder)
    expected = gpt_weights_from_hugging_face_llama(tensors, config)
    mine = [name for name in expected if re.search(r"\.experts\.[23]\.", name)]
    for name in mine:
        assert torch.equal(value(name, expected[name].shape), expected[name]), name
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    theirs = collections.Counter()
    for name in mine:
        theirs[weight_map[mixtral_stored_name(name)]] += tensors[mixtral_stored_name(name)].numel()
    print(f"experts 2 and 3 of {config.n_layer} layers: read {dict(loaded)} elements of "
          f"{sum(t.numel() for t in tensors.values())}")
    assert len(mine) == 2 * 3 * config.n_layer and loaded.keys() == theirs.keys() and loaded == theirs
    assert len(theirs) == 2  # the first and last shards: the middle one holds neither layer's experts 2 and 3
    loaded.clear()
    gate = "blocks.1.mlp.experts.3.gate.weight"
    assert torch.equal(value(gate, expected[gate].shape, ((8, 24), (0, config.n_embd))), expected[gate][8:24])
    assert sum(loaded.values()) == 16 * config.n_embd


NO_TRANSFORMERS_MIXTRAL = ("transformers is not installed (CI leaves it out): `pip install transformers` to hold "
                           "--init_from a Mixtral to MixtralForCausalLM's logits")


def test_transformers_computes_our_mixtral_logits(mixtral_like):
    """MixtralForCausalLM.from_pretrained on the sharded Mixtral folder, in float32, and our model loaded from it by
    --init_from's reader give the same logits within float32 noise."""
    transformers = pytest.importorskip("transformers", reason=NO_TRANSFORMERS_MIXTRAL)
    folder, tensors, hf = mixtral_like
    theirs = transformers.MixtralForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    config = hugging_face.config_from_hugging_face(hf, 32, 0.0)
    ours = _model_from(config, lambda model: model.init_weights(0, training.initial_values(config, 0, folder)))
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        difference = (theirs(idx).logits - ours(idx)[..., :256]).abs().max().item()
    print(f"mixtral: transformers' logits and ours differ by {difference:.1e}")
    assert difference < LOGITS_TOLERANCE


def test_train_single_starts_from_a_mixtral_and_export_writes_it_back(corpus, tmp_path, mixtral_like):
    """train_single.py --init_from the sharded Mixtral folder: one step at learning rate 0 saves exactly the stored
    tensors (and, beside them, the experts' balancing biases and loads), and the loss logged at step 0 is
    MixtralForCausalLM's on its batch. export.py writes that checkpoint back as the folder held it: the same names,
    shapes and values (float32 here, bfloat16 there; no balancing bias, which Mixtral's router has not), and a
    config.json of MixtralForCausalLM that reads back as the run's model."""
    folder, tensors, hf = mixtral_like
    train_single.main(flags(corpus, tmp_path / "run", model=None, init_from=folder, max_steps=1, lr=0, min_lr=0,
                            global_batch=4, micro_batch=4))
    run = read_run(tmp_path / "run")
    config = hugging_face.config_from_hugging_face(hf, 32, 0.0)
    expected = gpt_weights_from_hugging_face_llama(tensors, config)
    balancing = {name for name in run.weights if name.endswith(("mlp.expert_bias", "mlp.tokens_per_expert"))}
    assert run.weights.keys() - balancing == expected.keys() and len(balancing) == 2 * config.n_layer
    for name, weight in expected.items():
        np.testing.assert_array_equal(run.weights[name], weight.numpy(), err_msg=name)
    x, y = training.BatchSampler(os.path.join(corpus, "train.bin"), 32, 4, 4, 0, 1, 1234, torch.device("cpu")).get(0, 0)
    reference = F.cross_entropy(hugging_face_llama_logits(tensors, hf, x).flatten(0, 1), y.flatten()).item()
    assert run.losses[0] == pytest.approx(reference, rel=0, abs=LOGITS_TOLERANCE)
    export.export(checkpoint.Checkpoint(checkpoint.latest(tmp_path / "run")), str(tmp_path / "exported"))
    exported = exported_tensors(tmp_path / "exported")
    assert exported.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(exported[name], tensor.float()), name
    with open(tmp_path / "exported" / "config.json") as f:
        written = json.load(f)
    assert written["architectures"] == ["MixtralForCausalLM"]
    assert hugging_face.config_from_hugging_face(written, 32, 0.0) == config


def test_mixtral_config_json_gives_the_preset():
    """config.json of Mixtral 8x7B (the hub's mistralai/Mixtral-8x7B-v0.1: 32 layers of 4096, 8 experts of 14336, 2
    a token, rope_theta 1e6, no sliding window) is the mixtral-8x7b preset's config, and export.py writes the
    preset's back with the same values under the keys both hold, but the context (the run's --block_size). A
    sliding_window shorter than --block_size, and a Mixtral config.json without its experts, are refused saying what
    to change."""
    hub = {"architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
           "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
           "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32,
           "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
           "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
           "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False,
           "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32000}
    preset = gpt.make_config("mixtral-8x7b", 32000, 4096)
    assert hugging_face.config_from_hugging_face(hub, 4096, 0.0) == preset
    written = export.hugging_face_config(preset, "bfloat16", dict(bos=1, eos=2))
    assert {key: value for key, value in written.items() if key in hub} == {
        key: value for key, value in hub.items() if key in written and key != "max_position_embeddings"} | {
        "max_position_embeddings": 4096}
    with pytest.raises(ValueError, match="longer than its sliding_window 1024, and gpt.py attends to the whole "
                                         "context: pass --block_size 1024 or less"):
        hugging_face.config_from_hugging_face(dict(hub, sliding_window=1024), 4096, 0.0)
    with pytest.raises(ValueError, match="config.json has no num_local_experts: it is not a Mixtral config"):
        hugging_face.config_from_hugging_face({k: v for k, v in hub.items() if k != "num_local_experts"}, 4096, 0.0)


# ------------------------------------------------------------------------------------------------------------
# ---- #44 train_ep.py: expert parallel, tokens dispatched to their experts' ranks and combined back by all-to-all

_ep_runs = {}


def _moe_trained(main, argv, hot_experts=(), balance_rate=None):
    """main(argv) on this rank, every MoE's balancing bias of `hot_experts` set to 100 after init (their scores then
    always win: the router sends every token to them), and its balance_rate set if given; returns what the rank
    printed."""
    real_init_weights = gpt.GPT.init_weights

    def init_weights(self, *args):
        real_init_weights(self, *args)
        for module in self.modules():
            if isinstance(module, gpt.MoE):
                module.expert_bias[list(hot_experts)] = 100.0
                module.balance_rate = module.balance_rate if balance_rate is None else balance_rate

    gpt.GPT.init_weights = init_weights
    try:
        return _printed(main, argv)
    finally:
        gpt.GPT.init_weights = real_init_weights


def moe_run(corpus, tmp_path_factory, ranks, hot_experts=(), balance_rate=None, **overrides):
    """train_ep.py on `ranks` ranks (train_single.py where ranks is 0) on moe-tiny, once per distinct flags per
    session: (read_run's result, every logged step's tokens_per_expert and expert_imbalance, what rank 0 printed)."""
    key = (ranks, hot_experts, balance_rate, tuple(sorted(overrides.items())))
    if key not in _ep_runs:
        out_dir = shared_folder(tmp_path_factory, "ep")
        argv = flags(corpus, out_dir, **{"model": "moe-tiny", **overrides})
        if ranks:
            printed = run_distributed(ranks, _moe_trained, train_ep.main, argv, hot_experts, balance_rate)[0]
        else:
            with one_thread():
                printed = _moe_trained(train_single.main, argv, hot_experts, balance_rate)
        with open(os.path.join(out_dir, "metrics.jsonl")) as f:
            records = {r["step"]: r for r in map(json.loads, f) if "loss" in r}  # a resumed step: its last try
        loads = [records[s]["tokens_per_expert"] for s in sorted(records)]
        imbalance = [records[s]["expert_imbalance"] for s in sorted(records)]
        _ep_runs[key] = read_run(str(out_dir)), loads, imbalance, printed
    return _ep_runs[key]


@pytest.mark.parametrize("ep, dp, dtype", [(2, 1, "float32"), (4, 1, "float32"), (2, 2, "float32"),
                                           (2, 1, "bfloat16")])
def test_ep_matches_single_and_routes_every_token_alike(corpus, tmp_path_factory, ep, dp, dtype):
    """moe-tiny (8 experts, 2 a token), 6 steps of 16 sequences of 32 tokens, accumulation 16 / (2 x ranks),
    clipping active: expert parallel over 2 and 4 ranks, and 2 x 2 data-parallel replicas, computes what one device
    computes, at the tests' usual tolerances, and every logged step's tokens per expert, summed over the global batch,
    are one device's exactly: every token went to the same experts, and the balancing biases moved alike. bfloat16, 3
    steps of 8 sequences: the losses within BF16_TOLERANCE, step 0's loads exactly one device's; after it the weights
    differ by bf16's rounding (~1e-4), which moves a token whose two best scores nearly tie: at most 4 of 2048 choices
    here, and train_single.py at micro batch 1 and 4 moves 8 and 6 from its own at micro batch 2 (a bound of 1%).
    The log names who holds which experts."""
    short = dict(max_steps=3, global_batch=8) if dtype == "bfloat16" else {}  # bf16 matmuls are slow here
    run, loads, _, printed = moe_run(corpus, tmp_path_factory, ep * dp, ep=ep, dp=dp, dtype=dtype, **short)
    reference, expected_loads, _, _ = moe_run(corpus, tmp_path_factory, 0, dtype=dtype, **short)
    if dtype == "bfloat16":  # step 0 alike; then the weights differ by bf16's rounding, which flips near-ties
        assert loads[0] == expected_loads[0]
        moved = np.abs(np.array(loads) - np.array(expected_loads)).sum(axis=(1, 2)) / 2  # tokens on another expert
        assert moved.max() < 0.01 * np.array(loads[0]).sum(), moved  # one device against itself: up to 0.4%
        assert max(abs(a - b) / b for a, b in zip(run.losses, reference.losses)) < BF16_TOLERANCE
    else:
        assert loads == expected_loads
        assert_runs_match(run, reference)
    local = 8 // ep
    assert f"expert parallel: {ep} expert-parallel x {dp} data-parallel" in printed.splitlines()[0], printed
    assert f"(rank % {ep}) 0: 0-{local - 1} 1: {local}-{2 * local - 1}" in printed, printed


@launches_its_own_ranks  # 2, 4 and 1 ranks in turn
def test_ep_resumes_from_and_into_other_layouts(corpus, shared_tmp, tmp_path_factory):
    """One run of 6 steps of 8 sequences of moe-tiny, checkpointed every 2: expert parallel on 2 ranks crashes at step
    3; 2 x 2 data-parallel replicas resume from step 2 (each reading its 4 experts) and crash at step 5; one device
    resumes from step 4 and finishes: train_single's 6 steps, and its tokens per expert at every step. The balancing
    biases move every step, and a checkpoint holds them (gpt.MoE's expert_bias buffer, a whole part written once): a
    resumed run restarting them at zero would route other tokens to other experts after its first step."""
    argv = lambda **layout: flags(corpus, shared_tmp, model="moe-tiny", global_batch=8, ckpt_interval=2,  # noqa: E731
                                  **layout)
    assert run_distributed(2, _train_until, train_ep.main, 3, argv(ep=2)) == ["crashed"] * 2
    assert run_distributed(4, _train_until, train_ep.main, 5, argv(ep=2, dp=2, resume=True)) == ["crashed"] * 4
    with one_thread():
        train_single.main(argv(resume=True))
    reference, expected_loads, _, _ = moe_run(corpus, tmp_path_factory, 0, global_batch=8)
    with open(os.path.join(shared_tmp, "metrics.jsonl")) as f:
        records = {r["step"]: r["tokens_per_expert"] for r in map(json.loads, f) if "loss" in r}
    assert [records[step] for step in sorted(records)] == expected_loads
    assert_runs_match(read_run(str(shared_tmp)), reference)


def test_ep_trains_when_the_router_sends_every_token_to_one_rank(corpus, tmp_path_factory):
    """Experts 0 and 1 of every layer made the router's sure choice (their balancing biases at 100): every token runs
    on them, both on expert-parallel rank 0, and rank 1's experts run on no token at all. 2 steps of 8 sequences on 2
    ranks train without a hang and equal one device's under the same routing; the log shows the imbalance: each of
    the two holds every token, n_expert / n_expert_per_token = 4 times the mean."""
    short = dict(max_steps=2, global_batch=8)
    run, loads, imbalance, _ = moe_run(corpus, tmp_path_factory, 2, hot_experts=(0, 1), ep=2, **short)
    reference, expected_loads, _, _ = moe_run(corpus, tmp_path_factory, 0, hot_experts=(0, 1), **short)
    tokens = 8 * 32
    assert loads == expected_loads == [[[tokens, tokens] + [0] * 6] * 4] * 2
    assert imbalance == [4.0] * 2
    assert_runs_match(run, reference)
    assert run.losses[-1] < run.losses[0]


def _ep_refusals(argvs):
    """train_ep.main's refusal of each argv on this rank, each of which must come before the run's first collective."""
    real = dist.all_gather_object  # init_distributed's fingerprint check: the first collective of a run
    dist.all_gather_object = lambda *args, **kwargs: pytest.fail("a collective before the refusal")
    messages = []
    try:
        for argv in argvs:
            try:
                train_ep.main(argv)
            except training.UsageError as error:
                messages.append(str(error))
    finally:
        dist.all_gather_object = real
    return messages


def test_ep_bad_layout_is_refused_on_every_rank_before_any_collective(corpus, tmp_path):
    """On 3 ranks: a dense model, experts that do not split over --ep, a layout of another size, --impl torch; each
    refused in one line on every rank, saying what to change."""
    cases = [(dict(model="tiny"), "train_ep.py needs a mixture of experts, e.g. --model moe-tiny: tiny has one MLP"),
             (dict(ep=3), "--ep 3 does not divide the model's 8 experts: choose --ep among [1, 2, 4, 8]"),
             (dict(ep=2, dp=2), "--ep 2 x --dp 2 = 4 ranks, but the world has 3: choose --ep and --dp whose product"),
             (dict(impl="torch"), "--impl torch: PyTorch core has no expert parallelism")]
    argvs = [flags(corpus, tmp_path, **{"model": "moe-tiny", "global_batch": 6, **overrides}) for overrides, _ in cases]
    for messages in run_distributed(3, _ep_refusals, argvs):
        assert len(messages) == len(cases), messages
        assert all(message.startswith(expected) for message, (_, expected) in zip(messages, cases)), messages


@launches_its_own_ranks
def test_ep_bench_measures_what_the_formula_says(corpus, tmp_path):
    """What rank 0 of train_ep.py --ep 2 (moe-tiny, bfloat16, 2 micro-batches of 2) sends in one step, read from the
    profiler by bench.py, is plan.comm_formula's to the byte, given the pairs its experts received in that step
    (the log's tokens per expert of experts 0-3): the counts, the dispatch and the combine, forward and backward, each
    carrying 2 bytes an element (a combine or a gradient sent in float32 would not match), and the step's all-reduces;
    and its parameters, gradients and AdamW state are the formula's: the shared parameters and 4 of 8 experts."""
    args = argparse.Namespace(model="tiny", data=corpus, block_size=32, steps=3, warmup=0, device="cpu",
                              dtype="bfloat16", compile=False, threads=1, global_batch=8, bucket_mb=25,
                              sequence_parallel=False)
    table = bench.strategies(args)
    row = bench.run_once(args, "ep", "train_ep.py", 2, table["ep"].flags + ["--micro_batch", "2"], None, 2, 8,
                         str(tmp_path))
    with open(tmp_path / "ep-None-2-8" / "metrics.jsonl") as f:
        loads = next(r["tokens_per_expert"] for r in map(json.loads, f) if r.get("step") == 2)  # the profiled step
    sent = 2 * 32 * 2 * 4 * 2  # (token, expert) pairs a step: micro-batch 2 x 32 tokens x top 2, 4 layers, 2 steps
    terms = plan.comm_formula("ep", gpt.make_config("moe-tiny", 256, 32), 8, 2, dtype="bfloat16", ep=2,
                              expert_load=sum(sum(layer[:4]) for layer in loads) / sent)
    assert row["collectives"] == sum(term.count for term in terms), terms
    assert row["comm_bytes"] == sum(term.bytes for term in terms), terms
    assert row["state_bytes"] == table["ep"].states()


# ------------------------------------------------------------------------------------------------------------
# A mixture of experts in the planner, and expert parallelism's plan and formula (train_ep.py): the presets' shapes,
# one rank's plan against what a run holds, the all-to-alls a step, and the plan the docs print.

def plan_of_train_ep(argv):
    """train_ep.py --plan: every rank draws its own rows, so the rows split over the whole world. Without the script
    (a checkout that lacks it), the same path through its flags."""
    if os.path.exists(os.path.join(HERE, "train_ep.py")):
        return importlib.import_module("train_ep").main(argv)
    parser = training.get_parser("", "ep")
    parser.add_argument("--ep", type=training.positive_int)
    parser.add_argument("--dp", type=training.positive_int)
    args = training.parse(parser, argv)
    return plan.print_plan(args, args.world_size or 1, args.world_size or 1)


@pytest.mark.parametrize("preset, vocab_size, every, active, header", [
    ("mixtral-8x7b", 32000, 46_702_792_704, 12_748_853_248, "46.7B parameters, 12.9B active a token"),
    ("mixtral-8x22b", 32768, 140_630_071_296, 38_960_142_336, "140.6B parameters, 39.2B active a token")])
def test_mixtral_presets_have_the_published_shapes(capsys, tmp_path, preset, vocab_size, every, active, header):
    """Mixtral's parameters (Hugging Face's config.json, Mistral's vocabularies), and those a token multiplies (2 of
    the 8 experts, no embedding lookup: num_params(with_embeddings=False)); the plan's first line counts the
    embeddings in, as the model cards' 12.9B and 39B do. On meta: a second."""
    model = plan.model_on_meta(gpt.make_config(preset, vocab_size, 4096))
    assert (model.num_params(), model.num_params(with_embeddings=False)) == (every, active)
    code, printed = command_line(plan_of_train_ep, ["--plan", "--model", preset, "--world_size", "8", "--data",
                                                    str(tmp_path / "not_prepared")], capsys)
    assert code == 0 and f"({header}, top 2 of 8 experts, vocabulary {vocab_size:,}) | ep on 8 ranks (ep 8 x dp 1)" \
        in printed, printed


def test_expert_parallel_plan_and_formula():
    """One rank of train_ep.py holds the shared parameters whole and n_expert / ep of each layer's experts, their
    gradients and AdamW's moments; its experts run, on average, the b·s·k rows its tokens send; a router that sends
    every token to one rank's experts costs that rank the rows of ep ranks. A step's all-to-alls, per layer and
    micro-step: the counts and the rows there and back forward, the rows' gradients back and there backward (the
    recompute's forward once more under activation checkpointing); the gradients' two flat all-reduces, each over the
    ranks that hold that kind."""
    config = gpt.make_config("moe-tiny", 256, 32)
    L, E, k, h, f = config.n_layer, config.n_expert, config.n_expert_per_token, config.n_embd, config.mlp_hidden
    expert = 3 * h * f  # gate, fc, proj
    whole = dict(plan.plan_memory(config, plan.Layout("single", 1, 1, 1, 2)))
    for ep in (1, 2, 4, 8):
        rows = dict(plan.plan_memory(config, plan.Layout("ep", 8, 8, 1, 2, ep=ep)))
        assert rows["parameters (float32)"] == whole["parameters (float32)"] - 4 * L * expert * (E - E // ep)
        assert rows["dispatch: one layer's rows sent and received (compute dtype)"] == 2 * (2 * 32 * k) * h * 4
    balanced = sum(dict(plan.plan_memory(config, plan.Layout("ep", 2, 2, 1, 2, ep=2))).values())
    skewed = sum(dict(plan.plan_memory(config, plan.Layout("ep", 2, 2, 1, 2, ep=2, expert_load=2))).values())
    per_row = 4 * (h + 4 * f) + 16  # the rows' inputs, SwiGLU's four, their order there and back (float32)
    assert skewed - balanced == 2 * 32 * k * (L * per_row + h * 4)  # and one layer's received rows
    terms = plan.comm_formula("ep", config, 16, micro_batch=2, ep=2, dp=2)  # 2 micro-steps, 4 ranks
    tokens = 2 * 2 * 32 * k * h * 4 * 1 / 2  # 2 micro-steps' rows, (ep - 1) / ep of them to the other rank
    assert [(term.kind, term.group, term.count) for term in terms][:3] == [
        ("all_to_all", "ep", 2 * L), ("all_to_all", "ep", 4 * L), ("all_to_all", "ep", 4 * L)]
    assert [term.bytes for term in terms][1:3] == [2 * L * tokens, 2 * L * tokens]
    shared = sum(plan.local_sizes(config).values()) - L * E * expert
    assert [term.bytes for term in terms][3:5] == [4 * shared * 2 * 3 / 4, 4 * L * E // 2 * expert * 2 * 1 / 2]
    checkpointed = plan.comm_formula("ep", config, 16, micro_batch=2, ep=2, dp=2, activation_checkpointing=True)
    assert [term.count for term in checkpointed][:3] == [4 * L, 6 * L, 6 * L]
    assert terms[-1].bytes == 2 * 3 / 4 * 4 * (2 + L * E)  # the step's agreement carries the experts' loads


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moe_layer_saves_what_the_plan_counts(dtype):
    """What one gpt.MoE layer saves for backward (saved-tensor hooks, each storage once), under CPU's autocast in
    bfloat16: plan.moe_activations, with the router's own cast of its input and autocast's copies of the experts' and
    the router's weights. A width unlike n_embd tells the rows' inputs from the MLP's hidden tensors. 0.1 s."""
    config = dataclasses.replace(gpt.make_config("moe-tiny", 256, 32), mlp_hidden=96)
    moe = gpt.MoE(config, 0)
    x = torch.randn(2, 32, config.n_embd, requires_grad=True)
    ours = {p.untyped_storage().data_ptr() for p in moe.parameters()} | {x.untyped_storage().data_ptr()}
    saved = {}

    def keep(tensor):
        if tensor.untyped_storage().data_ptr() not in ours:
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), \
            torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bfloat16"):
        moe(x)
    planned = plan.moe_activations(config, plan.Layout("single", 1, 1, 1, 2, dtype, device="cpu"))
    if dtype == "bfloat16":
        planned += 2 * 2 * 32 * config.n_embd + 2 * sum(p.numel() for p in moe.parameters())
    assert sum(saved.values()) == planned


@pytest.mark.parametrize("checkpointing", [False, True], ids=["", "activation-checkpointing"])
def test_expert_parallel_plan_matches_what_a_run_holds(corpus, shared_tmp, checkpointing):
    """train_ep.py at ep 2 (moe-tiny, float32, one step): each rank's parameters, gradients and AdamW state are the
    plan's to the byte. A rank's experts run the rows this step's router sent them, the plan the mean: the two ranks'
    first micro-batch's activations add up to twice the plan's (measured: within 40 bytes, each rank 9% off it;
    checkpointed, within the plan tests' tolerance), and
    neither exceeds the plan of a router that sends every token to one rank. Skipped where train_ep.py is not in the
    checkout. About 15 s."""
    train_ep = pytest.importorskip("train_ep")
    argv = flags(corpus, shared_tmp, model="moe-tiny", max_steps=1, activation_checkpointing=checkpointing, ep=2)
    held = run_distributed(2, _memory_held, train_ep.main, argv)
    layout = plan.Layout("ep", 2, 2, 1, 2, activation_checkpointing=checkpointing, device="cpu", ep=2)
    config = gpt.make_config("moe-tiny", 256, 32)
    kinds = ("activations", "embeddings", "loss")
    planned, worst = [{item: size for item, size in plan.plan_memory(config, layout._replace(expert_load=load))}
                      for load in (1, 2)]
    for rank in held:
        assert (planned["parameters (float32)"], planned["gradients (float32)"]) == (rank["parameters"],
                                                                                     rank["gradients"])
        assert planned["AdamW state (exp_avg, exp_avg_sq, step; float32)"] == rank["optimizer"]
        assert rank["activations"] <= sum(size for item, size in worst.items() if item.startswith(kinds))
    activations = sum(size for item, size in planned.items() if item.startswith(kinds))
    print(f"ep 2: activations planned {activations:,} bytes a rank, measured {[r['activations'] for r in held]}")
    measured = sum(rank["activations"] for rank in held)  # checkpointed: the blocks' inputs, as the other layouts'
    assert abs(2 * activations - measured) <= (ACTIVATION_TOLERANCE * measured if checkpointing else 64)
