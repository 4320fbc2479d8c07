"""
What every run needs but the model and its strategy (train_*.py): flags, launch and the ranks' fingerprint check, the
batch sampler, initial values, optimizer and schedule, evaluation, the sample, the compile / recompute wrapper, logs.

A script's main() calls it in this order: get_parser, parse; launched_rank, get_device; load_data, which checks every
flag first; init_distributed; initial_values; make_optimizer, wrap_blocks; Logger.start; each step evaluate, set_lr,
StopRequest.agreed, Logger.log_step; sample at the end. `run(main)` is every script's entry point: a mistake or a
planned stop ends the run with one line and an exit code, not a traceback from every rank. Nothing here knows a
strategy: a script passes in its own data-parallel rank and group.
"""

import atexit
import hashlib
import json
import math
import os
import resource
import signal
import sys
import time
import traceback
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.tensor import DTensor

import gpt
from prepare_data import (DEFAULT_DATA_DIR, ArgumentParser, HelpFormatter, UsageError, count, ensure_data,
                          get_tokenizer, non_negative, positive, positive_int, probability)

IMPORTED = time.perf_counter()  # the first log line reports the time from here: data, model, init, resume


# ------------------------------------------------------------------------------------------------------------
# Flags


def get_parser(description, strategy="single"):
    """The flags every script shares, in groups after its own; strategy (single, ddp, ...): for --plan and --out_dir."""
    p = ArgumentParser(description=description, formatter_class=HelpFormatter)
    p.set_defaults(strategy=strategy)
    add = p.add_argument_group("model and data").add_argument
    add("--model", choices=list(gpt.PRESETS), help="gpt.py's preset (default: tiny, or --init_from's)")
    add("--init_from", help="pretrained weights: gpt2 ... gpt2-xl, a Llama 3 hub id, or a Hugging Face folder")
    add("--data", default=DEFAULT_DATA_DIR, help="prepare_data.py's folder (default: the embedded corpus, made once)")
    add("--block_size", type=positive_int, default=128, help="context length, in tokens")
    add("--dropout", type=probability, default=0.0, help="dropout probability")
    add("--seed", type=int, default=1337, help="seeds the initial weights, the batches and sampling")
    add = p.add_argument_group("batch and schedule").add_argument
    add("--global_batch", type=positive_int, default=16, help="sequences per optimizer step")
    add("--micro_batch", type=positive_int, help="sequences per rank per micro-step (default: 1 micro-step, PP 2 x pp)")
    add("--max_steps", type=positive_int, default=1000, help="optimizer steps of the whole run")
    add("--lr", type=non_negative, default=3e-3, help="peak learning rate, reached after the warmup")
    add("--min_lr", type=non_negative, default=3e-4, help="learning rate at --max_steps (cosine)")
    add("--warmup_steps", type=count, default=50, help="steps of linear warmup to --lr")
    add("--weight_decay", type=non_negative, default=0.1, help="AdamW weight decay of the matrices")
    add("--grad_clip", type=non_negative, default=1.0, help="max global grad norm; 0 disables it")
    add = p.add_argument_group("precision and speed").add_argument
    add("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda when available")
    add("--dtype", default="float32", choices=["float32", "bfloat16"], help="bfloat16: autocast, float32 weights")
    add("--compile", action="store_true", help="torch.compile each transformer block")
    add("--activation_checkpointing", action="store_true", help="recompute blocks in backward: less memory")
    add("--tf32", action="store_true", help="TF32 matmuls on CUDA (faster; float32 differs ~1e-3)")
    add("--attn", default="sdpa", choices=["sdpa", "flash"],
        help="torch's scaled_dot_product_attention or flash-attn (training with --dropout: gpt.py's explicit one)")
    add("--timeout", type=positive, default=600, help="seconds a collective may wait before failing")
    group = p.add_argument_group("evaluation and sample")
    add = group.add_argument
    add("--eval_interval", type=count, default=100, help="steps between validation losses; 0: never")
    add("--eval_iters", type=positive_int, default=4, help="validation batches per evaluation")
    add_sampling_flags(group)
    add = p.add_argument_group("checkpoints").add_argument
    add("--out_dir", default=f"out/{strategy}", help="checkpoints, metrics.jsonl (default: out/<strategy>[-variant])")
    add("--ckpt_interval", type=count, default=100, help="steps between checkpoints, and one at the end; 0: the end")
    add("--keep_checkpoints", type=count, default=2, help="the newest checkpoints kept; 0: every one")
    add("--save_timeout", type=positive, default=1800, help="seconds the ranks wait for a save's slowest write")
    add("--resume", action="store_true", help="continue from the latest checkpoint in --out_dir")
    add = p.add_argument_group("logging").add_argument
    add("--log_interval", type=positive_int, default=10, help="steps between progress lines")
    add("--log_all_ranks", action="store_true", help="every rank prints its progress, not only rank 0")
    add("--tensorboard", action="store_true", help="also log to TensorBoard (pip install tensorboard)")
    add("--wandb", action="store_true", help="also log to Weights & Biases (pip install wandb)")
    add = p.add_argument_group("memory planner").add_argument
    add("--plan", action="store_true", help="print the memory one rank needs, item by item, and exit: no training")
    add("--world_size", type=positive_int, help="--plan: the ranks to plan for (default: torchrun's WORLD_SIZE, or 1)")
    add("--gpu_memory", type=positive, default=80, help="--plan: one GPU's memory, in GB (10^9 bytes)")
    return p


def parse(parser, argv):
    """A script's flags; --out_dir by default out/<strategy>, then each own flag set away from its default (README)."""
    parser.set_defaults(out_dir=None)  # one given wins
    args = parser.parse_args(argv)
    shared = {action.dest for action in get_parser(None)._actions}  # the flags every script has
    own = [(a.dest, vars(args)[a.dest]) for a in parser._actions if a.dest not in shared and a.default is not None]
    names = [value if isinstance(value, str) else name if value is True else f"{name}{value}"
             for name, value in own if value != parser.get_default(name)]
    args.out_dir = args.out_dir or "-".join([f"out/{args.strategy}", *names])
    return args


def add_sampling_flags(p):
    """The flags of a sample: after training (train_*.py) or from a checkpoint (sample.py)."""
    p.add_argument("--sample_tokens", type=count, default=500, help="tokens generated; 0 skips the sample")
    p.add_argument("--prompt", default="\n", help="the text the sample continues (default: a newline)")
    p.add_argument("--temperature", type=positive, default=0.8, help="softmax temperature of the sample")
    p.add_argument("--top_k", type=count, default=40, help="sample from the k likeliest tokens; 0: from all")


def check_sampling_flags(args):
    if args.sample_tokens and not args.prompt:
        raise UsageError("--prompt is empty: a sample continues at least one character (the default is a newline)")


def check_arguments(args, device):
    """What the flags' types cannot check alone, before anything is created."""
    if args.min_lr > args.lr:
        raise UsageError(f"--min_lr {args.min_lr} is above --lr {args.lr}: the schedule decays from --lr to --min_lr")
    if args.attn == "flash" and (gpt.flash_attn_func is None or device.type != "cuda" or args.dtype != "bfloat16"):
        raise UsageError("--attn flash needs the flash-attn package (pip install flash-attn), CUDA and --dtype "
                         "bfloat16; use --attn sdpa otherwise")
    if args.tensorboard or args.wandb:
        import trackers  # only here: the optional trackers need their packages
        trackers.check(args)
    check_sampling_flags(args)


def check_tensor_parallel(config, tp, sequence_parallel):
    """Every rank runs this before any collective, so a bad layout fails everywhere instead of hanging. The query heads
    split n_embd; under grouped-query attention the key/value heads are split too, so t must divide them as well."""
    sizes = [("n_head", config.n_head), ("n_kv_head", config.n_kv_head), ("the MLP's width", config.mlp_hidden),
             ("the padded vocabulary", config.padded_vocab_size)]
    sizes += [("--block_size", config.block_size)] * sequence_parallel
    if config.n_expert and tp > 1:
        raise UsageError("--tp splits a dense MLP, not yet a mixture of experts: split its experts with train_ep.py "
                         "--ep, or train it with DDP, ZeRO, FSDP, PP or CP")
    for what, n in sizes:
        if n % tp:
            works = [str(t) for t in range(1, config.n_kv_head + 1) if all(size % t == 0 for _, size in sizes)]
            fix = "run without --sequence_parallel" if what == "--block_size" else "another --model"
            raise UsageError(f"{what} ({n}) is not divisible by --tp {tp}: choose --tp in {{{', '.join(works)}}} or {fix}")


# ------------------------------------------------------------------------------------------------------------
# Launch: the command line, the device, the process group


USAGE_EXIT_CODE = 2  # argparse's, for every mistake in how a script is called
OTHER_RANKS_WAIT_S = 10  # after a UsageError, how long a rank other than 0 waits for torchrun to end it
save_group = None  # init_distributed's gloo group for checkpoint.save's agreements, with its own --save_timeout


class Stopped(Exception):
    """The run stops on purpose at the same step on every rank (diverged, preempted, a failed write): one line."""

    def __init__(self, message, code):
        super().__init__(message)
        self.code = code


DIVERGED_EXIT_CODE = 3
PREEMPTED_EXIT_CODE = 75  # sysexits.h's EX_TEMPFAIL: stopped on request, saved; the same command with --resume goes on
INTERRUPTED_EXIT_CODE = 130  # the shell's for Ctrl-C (128 + SIGINT)
SIGTERM_GRACE_S = 20  # to finish the step and save after a SIGTERM: torchrun and Slurm send SIGKILL 30 s after it


def run(main):
    """Every script's entry point: exit_code(main), the atexit functions, then os._exit. Not a plain exit: gloo's
    threads outlive destroy_process_group() while hooks held in C++ keep the group, and one that frees a collective's
    tensors as Python tears down aborts the process (6 runs in 30 of train_tp.py on 2 ranks; none with os._exit)."""
    code = exit_code(main)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exit_code(main):
    """main()'s exit code. A crash keeps its traceback (@record hands it to torchrun's summary). A UsageError or a
    Stopped, which every rank raises alike, is one line, `error: <message>`, from rank 0 for all; so is Ctrl-C."""
    interrupted = []

    def interrupt(number, frame):
        interrupted.append(number)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # torchrun sends another: let this one unwind undisturbed
        raise KeyboardInterrupt

    @record
    def entry_point():
        signal.signal(signal.SIGINT, interrupt)
        try:
            main()
        except (UsageError, Stopped) as error:
            code = getattr(error, "code", USAGE_EXIT_CODE)
            # A stop on request need not wait: torchrun, if it passed a SIGTERM on, waits for every rank to end.
            say_once(f"error: {error}", code, wait=code != PREEMPTED_EXIT_CODE)
        except BaseException:
            if not interrupted:
                raise
            # A rank Ctrl-C stopped, or one whose collective lost a peer it stopped: one line, from rank 0 alone.
            say_once("interrupted (Ctrl-C): --resume continues from the latest checkpoint", INTERRUPTED_EXIT_CODE,
                     wait=False)

    try:
        entry_point()
    except SystemExit as exit:  # say_once's, argparse's, or a sys.exit("message")
        if isinstance(exit.code, str):
            print(exit.code, file=sys.stderr)
        return exit.code if isinstance(exit.code, int) else 0 if exit.code is None else 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def say_once(line, code, wait=True):
    """Print `line` from rank 0 and exit with `code`; another rank waits for torchrun to end it (if `wait`: a rank
    still running after OTHER_RANKS_WAIT_S failed alone and says so itself)."""
    if launched_rank()[0] != 0:
        if not wait:
            sys.exit(code)
        signal.signal(signal.SIGTERM, lambda *_: os._exit(code))
        time.sleep(OTHER_RANKS_WAIT_S)
    print(line, file=sys.stderr)
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):  # torchrun's summary shows it as this rank's failure
        info = {"py_callstack": line, "timestamp": str(int(time.time()))}
        with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
            json.dump({"message": {"message": line, "extraInfo": info}}, f)
    sys.exit(code)


def launched_rank(args=None):
    """(RANK, LOCAL_RANK, WORLD_SIZE) as torchrun sets them (a plain `python` start: 0, 0, 1); --plan's --world_size."""
    world_size = args.world_size if args and args.plan and args.world_size else int(os.environ.get("WORLD_SIZE", 1))
    return int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)), world_size


def get_device(args, local_rank=0):
    """--device (auto: CUDA if there is one) and --tf32, off by default: it moves float32 far past reduction noise."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = getattr(args, "tf32", False)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but no CUDA device is visible; use --device cpu")
    device = torch.device("cpu")
    if args.device != "cpu" and torch.cuda.is_available():
        # LOCAL_RANK indexes the node's GPUs, unless the launcher shows each process only its own
        device = torch.device("cuda", local_rank if torch.cuda.device_count() > 1 else 0)
        torch.cuda.set_device(device)
    # A node's ranks share its cores: a rank takes its share (or HOST_THREADS), or all are several times slower. On CPU
    # unless OMP_NUM_THREADS is set (torchrun's 1 for several ranks); on CUDA under --cpu_offload: AdamW's, the host's.
    if vars(args).get("cpu_offload") if device.type == "cuda" else "OMP_NUM_THREADS" not in os.environ:
        share = len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(int(os.environ.get("HOST_THREADS", max(1, share))))
    return device


def init_distributed(args, device):
    """Join the process group (unless a test already did), check every rank: (rank, world size, whether it joined)."""
    owns_group = not dist.is_initialized()
    if owns_group:
        backend = "nccl" if device.type == "cuda" else "gloo"
        # On CUDA, bound to this rank's GPU: NCCL's communicators are made at once, and new_group splits them
        options = dict(timeout=timedelta(seconds=args.timeout), device_id=device if device.type == "cuda" else None)
        if "RANK" in os.environ:  # torchrun's (or another launcher's) rendezvous
            dist.init_process_group(backend, **options)
        else:  # a plain `python train_X.py`: a world of one process, which needs no rendezvous
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **options)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    check_same_on_every_rank(args, world_size)
    global save_group  # a save's ranks wait here for the slowest write: NCCL's watchdog ends them after --timeout
    save_group = world_size > 1 and dist.new_group(backend="gloo", timeout=timedelta(seconds=args.save_timeout))
    env_rank, _, env_world = launched_rank()
    if (rank, world_size) != (env_rank, env_world):  # the samplers took their rows from the environment
        raise RuntimeError(f"RANK, WORLD_SIZE = {env_rank}, {env_world} but the process group has {rank}, {world_size}")
    return rank, world_size, owns_group


def project_code():
    """{file: SHA-256} of every module this process has loaded from the project's folder (the script, the scripts it
    composes, the shared files, whatever else it imported from there), and torch's version."""
    folder, code = os.path.dirname(os.path.abspath(__file__)), {"torch": torch.__version__}
    paths = {os.path.abspath(getattr(module, "__file__", None) or "") for module in list(sys.modules.values())}
    paths.add(os.path.join(folder, "torch_reference.py"))  # --impl torch imports it in main(), after this check
    for path in sorted(p for p in paths if os.path.dirname(p) == folder and p.endswith(".py") and os.path.isfile(p)):
        with open(path, "rb") as f:
            code[os.path.basename(path)] = hashlib.sha256(f.read()).hexdigest()
    return code


def check_same_on_every_rank(args, world_size):
    """Every rank must run the same code (project_code) with the same flags: a stale copy or other flags would
    desynchronise the collectives and hang much later. Refused on every rank alike."""
    flags = {key: str(value) for key, value in vars(args).items() if key != "log_all_ranks"}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, (project_code(), flags))
    for what, index in ("code", 0), ("arguments", 1):
        ours = everyone[0][index]
        differ = [rank for rank, other in enumerate(everyone) if other[index] != ours]
        if differ:  # code first: the same code, so the same flags, whose values alone may differ
            theirs = everyone[differ[0]][index]
            changed = [f"--{key} {ours[key]} vs {theirs[key]}" if what == "arguments" else key
                       for key in sorted(ours.keys() | theirs.keys()) if ours.get(key) != theirs.get(key)]
            raise UsageError(f"ranks {differ} run other {what} than rank 0 (rank 0 vs rank {differ[0]}: "
                             f"{', '.join(changed)}); launch every rank with the same files, flags and `latest`")


class StopRequest:
    """SIGTERM (a preemption, or torchrun passing one on) or SIGUSR1 (Slurm's --signal=B:USR1@120) stops the run after
    the step it is in: the ranks agree on that step, save it, and exit PREEMPTED_EXIT_CODE. A rank still running
    SIGTERM_GRACE_S after a SIGTERM (stuck: a peer is gone) is ended then. The agreement travels with the step's other
    question, whether its gradient norm is finite: one small all-reduce and the step's one read of the device."""

    def __init__(self):
        self.received = set()
        signal.signal(signal.SIGTERM, self.request)
        signal.signal(signal.SIGUSR1, self.request)

    def request(self, number, frame):
        if number == signal.SIGTERM and "SIGTERM" not in self.received:  # torchrun passes on one sent to it
            signal.alarm(SIGTERM_GRACE_S)  # SIGALRM's default action ends the process
        self.received.add(signal.Signals(number).name)

    def agreed(self, grad_norm, model):
        """(whether the gradient norm is not finite, whether any rank has received a signal): the same answers on
        every rank. Built on the device (set in place, not torch.tensor, which would wait for it to copy the values).
        A mixture of experts' loads travel with them: summed over the ranks, they balance every gpt.MoE alike."""
        moe = [module for module in model.modules() if isinstance(module, gpt.MoE)]
        shape = (moe[0].n_layer, len(moe[0].expert_bias)) if moe else (0, 0)
        flags = torch.zeros(2 + math.prod(shape), device=grad_norm.device)
        flags[0], flags[1] = ~torch.isfinite(grad_norm), bool(self.received)
        self.expert_load = flags[2:].view(shape)  # a view: the all-reduce below sums the loads in place
        for module in moe:  # a pipeline stage holds some layers: the others' rows stay zero
            self.expert_load[module.layer] = module.tokens_per_expert
        if dist.is_initialized():
            dist.all_reduce(flags)  # a sum: the flags are 0 or more, the loads add up
        for module in moe:
            module.balance(self.expert_load[module.layer])
        diverged, stopping = flags[:2].tolist()  # the host waits here for the step's backward, once
        return diverged > 0, stopping > 0

    def stop(self, saved_step, out_dir):
        signal.alarm(0)  # saved: nothing left for the deadline to guard
        received = " and ".join(sorted(self.received)) or "a signal to another rank"
        raise Stopped(f"stopped on request ({received}) after step {saved_step - 1}, saved in {out_dir!r}: the same "
                      f"command with --resume goes on at step {saved_step}", PREEMPTED_EXIT_CODE)


# ------------------------------------------------------------------------------------------------------------
# Data: the batch sampler over the token files prepare_data.py writes


class BatchSampler:
    """The batch of step `step` from (seed, step) alone: `global_batch` random windows of the token file. Data-parallel
    rank r owns rows [r, r + 1) x accumulation x micro_batch, micro_batch a micro-step; TP peers share them."""

    def __init__(self, path, block_size, global_batch, micro_batch, dp_rank, dp_size, seed, device, dtype="uint16"):
        if global_batch % (micro_batch * dp_size):
            raise UsageError(f"--global_batch {global_batch} is not a multiple of --micro_batch {micro_batch} x "
                             f"data-parallel size {dp_size}: change one of them")
        self.path, self.block_size, self.seed, self.device, self.dtype = path, block_size, seed, device, dtype
        self.global_batch, self.micro_batch, self.dp_rank = global_batch, micro_batch, dp_rank
        self.accumulation = global_batch // (micro_batch * dp_size)
        self.num_tokens = len(np.memmap(path, dtype=dtype, mode="r"))
        if self.num_tokens <= block_size + 1:
            raise UsageError(f"{path} holds {self.num_tokens} tokens, fewer than --block_size {block_size} + 2")
        self.split = 0 if os.path.basename(path).startswith("train") else 1

    def rows(self, micro_step):
        first = (self.dp_rank * self.accumulation + micro_step) * self.micro_batch
        return range(first, first + self.micro_batch)

    def offsets(self, step):
        rng = np.random.default_rng([self.seed, self.split, step])
        return rng.integers(0, self.num_tokens - self.block_size - 1, size=self.global_batch)

    def get(self, step, micro_step):
        # A fresh memmap per batch: a long-lived one keeps every page it touched resident.
        data = np.memmap(self.path, dtype=self.dtype, mode="r")
        starts = self.offsets(step)[self.rows(micro_step)]
        batch = torch.from_numpy(np.stack([data[s:s + self.block_size + 1] for s in starts]).astype(np.int64))
        if self.device.type == "cuda":
            batch = batch.pin_memory().to(self.device, non_blocking=True)
        return batch[:, :-1], batch[:, 1:]


def load_data(args, dp_rank, dp_size, device, is_writer):
    """Every check of the data and batch flags, before any collective: (meta, config, this rank's two samplers)."""
    check_arguments(args, device)
    meta = ensure_data(args.data, is_writer)
    if args.micro_batch is None and args.global_batch % dp_size:
        raise UsageError(f"--global_batch {args.global_batch} does not split over {dp_size} data-parallel ranks: "
                         f"choose a multiple of {dp_size}")
    micro_batch = args.micro_batch or args.global_batch // dp_size
    samplers = [BatchSampler(os.path.join(args.data, f"{split}.bin"), args.block_size, args.global_batch, micro_batch,
                             dp_rank, dp_size, args.seed, device, meta.get("dtype", "uint16"))  # uint32: Llama 3's ids
                for split in ("train", "val")]
    if args.init_from:
        import hugging_face  # only here: reading pretrained weights needs safetensors and the Hugging Face hub
        return meta, hugging_face.pretrained_config(args, meta), *samplers
    config = gpt.make_config(args.model or "tiny", meta["vocab_size"], args.block_size, args.dropout)
    return meta, config, *samplers


def initial_values(config, seed, init_from=None):
    """Every layout's one source of initial values: value(name, shape, box=None, flat=None) is full[box], flattened
    to elements [flat[0], flat[1]) if flat is given, where full is drawn from (seed, name) or read from --init_from.
    A rank asks for its own part only: a tensor-parallel slice (a box), an FSDP shard (a flat range)."""
    if init_from:
        import hugging_face
        read = hugging_face.reader(init_from, config)  # reads only the rows that hold the part asked for
    else:
        read = lambda name, shape, box: gpt.initial_value(name, shape, config, seed, box)  # only the tiles it touches

    def value(name, shape, box=None, flat=None):
        box = tuple((0, n) for n in shape) if box is None else tuple(box)
        if flat is None:
            return read(name, shape, box)
        return flat_range(lambda rows: read(name, shape, rows), box, flat)

    return value


def flat_range(read, box, flat):
    """Elements [flat[0], flat[1]) of the flattened full[box], where read(rows) gives full[rows], rows a box: read only
    for the rows of box that hold them (initial values, checkpoint.Checkpoint.region: an FSDP shard's part)."""
    width = math.prod(stop - start for start, stop in box[1:])  # elements in a row of the box
    first, last = flat[0] // width, -(-flat[1] // width)  # the rows that hold the flat range
    (start, _), *columns = box
    rows = read(((start + first, start + last), *columns)).reshape(-1)
    return rows[flat[0] - first * width:flat[1] - first * width]


# ------------------------------------------------------------------------------------------------------------
# Optimization: schedule, optimizer, and blocks compiled or recomputed


def get_lr(step, args):
    """Linear warmup to --lr, then cosine decay to --min_lr at --max_steps."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps))
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (args.lr - args.min_lr)


def set_lr(optimizer, step, args):
    lr = get_lr(step, args)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def decay_groups(parameters):
    """(with weight decay, without): matrices (2-D and up) decay; biases, norms' gains never do."""
    parameters = list(parameters)
    return [p for p in parameters if p.dim() >= 2], [p for p in parameters if p.dim() < 2]


def make_optimizer(groups, args, device):
    """AdamW over groups = (with weight decay, without). Fused on every device, so the tests run the kernel CUDA runs;
    one group per kind, since a fused step refuses DTensors mixed with plain tensors (--impl torch's TP leaves some)."""
    kinds = [{"params": [p for p in params if isinstance(p, DTensor) == distributed], "weight_decay": decay}
             for params, decay in zip(map(list, groups), (args.weight_decay, 0.0)) for distributed in (False, True)]
    return torch.optim.AdamW([g for g in kinds if g["params"]], lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


def wrap_blocks(model, compile=False, activation_checkpointing=False):
    """Each block's forward compiled (--compile) and recomputed in backward (--activation_checkpointing), block by block
    as torchtitan does: compiled whole, backward is one autograd node (DDP's gradient hooks would fire after all of it,
    FSDP's module hooks break the graph). A recomputed block keeps its input; hooks have its weights back by then."""
    for module in model.modules():
        if isinstance(module, gpt.Block):
            forward = torch.compile(module.forward) if compile else module.forward
            module.forward = recomputed(forward) if activation_checkpointing else forward
    return model


def recomputed(forward):
    """forward under torch's non-reentrant checkpoint while autograd records; the recompute replays its dropout."""
    def checkpointed(*args):
        if not torch.is_grad_enabled():  # evaluation and sampling: nothing to save, nothing to recompute
            return forward(*args)
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False)
    return checkpointed


# ------------------------------------------------------------------------------------------------------------
# Evaluation and the sample


@torch.no_grad()
def evaluate(step, args, model, sampler, autocast, dp_group=None):
    """Every --eval_interval steps and at the last step, the mean loss over --eval_iters global batches of `sampler`:
    this rank's rows, averaged over dp_group (None: no peers); None at the other steps."""
    if not (args.eval_interval and (step % args.eval_interval == 0 or step + 1 == args.max_steps)):
        return None
    model.eval()
    total = torch.zeros((), device=sampler.device)
    for batch in range(args.eval_iters):
        for micro_step in range(sampler.accumulation):
            x, y = sampler.get(batch, micro_step)
            with autocast:
                total += model(x, y).float()
    model.train()
    total /= args.eval_iters * sampler.accumulation
    if dp_group is not None:
        dist.all_reduce(total, op=dist.ReduceOp.AVG, group=dp_group)
    return total.item()


def sampling_hooks(model, multiple, gather):
    """generate() from a tensor-parallel model (train_tp.py's, train_2d.py's, torch_reference.py's), at any length: pad
    idx to a `multiple` of the sequence shards (causal: no real position sees it), `gather` the logits, drop the pad."""
    def pad(module, args):
        module.sequence_length = args[0].shape[1]
        if module.sequence_length % multiple:  # a prompt, not a training batch: no copy of idx every step
            return (F.pad(args[0], (0, -module.sequence_length % multiple)), *args[1:])

    def unpad(module, args, out):
        return gather(out)[:, :module.sequence_length] if out.dim() == 3 else out  # logits, not a loss

    model.register_forward_pre_hook(pad)
    model.register_forward_hook(unpad)
    return model


def sample(model, meta, args, device, autocast, show):
    """Print --sample_tokens after --prompt. Every rank of a sharded model calls it (each forward needs them all)."""
    if not args.sample_tokens:
        return
    tokenizer = get_tokenizer(meta["tokenizer"])
    prompt = torch.tensor([tokenizer.encode(args.prompt)], device=device)
    with autocast:
        out = gpt.generate(model, prompt, args.sample_tokens, args.block_size, meta["vocab_size"], args.temperature,
                           args.top_k, seed=args.seed)
    if show:
        print("sample:\n" + tokenizer.decode(out[0].tolist()))


# ------------------------------------------------------------------------------------------------------------
# Metrics and logging

# Peak dense bf16 tensor-core FLOP/s (no sparsity), by a substring of torch.cuda.get_device_name().
PEAK_BF16_FLOPS = {"A100": 312e12, "H100": 989e12, "H200": 989e12}


def peak_flops(device):
    """Peak bf16 FLOP/s of one device, or None where we do not know it (CPU, unlisted GPUs)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


def peak_memory_mb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # peak RSS of this process (Linux: KiB)


class Logger:
    """Progress: the console (rank 0, or every rank with --log_all_ranks); from rank 0, metrics.jsonl and trackers."""

    def __init__(self, args, config, device, rank=0, world_size=1):
        self.args, self.device, self.world_size = args, device, world_size
        self.writes, self.prints = rank == 0, rank == 0 or args.log_all_ranks
        self.prefix = f"[rank {rank}] " if args.log_all_ranks else ""
        with torch.device("meta"):  # the whole model's counts, whatever part of it this rank holds
            model = gpt.GPT(config)
        self.num_params = model.num_params()
        self.flops_per_token = gpt.flops_per_token(config, model.num_params(with_embeddings=False))
        self.peak_flops = peak_flops(device)
        self.trackers = None
        if self.writes:
            os.makedirs(args.out_dir, exist_ok=True)
        if self.writes and (args.tensorboard or args.wandb):
            import trackers  # only here: the optional trackers need their packages
            self.trackers = trackers.Trackers(args)

    def print(self, text):
        if self.prints:
            print(self.prefix + text)

    def start(self, sampler, dp_size, start_step, layout=""):
        args = self.args
        origin = "from scratch" if not args.init_from else f"from {args.init_from}'s weights"
        if args.init_from and not start_step:
            import hugging_face  # imported already: --init_from read this rank's parts through it
            origin += f" ({hugging_face.read_summary()} on this rank)"
        origin += f" (--resume: no checkpoint in {args.out_dir!r} yet)" if args.resume else ""  # nothing to resume
        self.print(f"{args.init_from or args.model or 'tiny'}: {self.num_params / 1e6:.2f}M parameters | "
                   f"{self.world_size} rank{'s' * (self.world_size > 1)} on {self.device} | {layout}global batch "
                   f"{args.global_batch} = micro batch {sampler.micro_batch} x {sampler.accumulation} accumulation x "
                   f"{dp_size} data-parallel | {f'resuming at step {start_step}' if start_step else origin} | "
                   f"ready in {time.perf_counter() - IMPORTED:.1f} s, peak {peak_memory_mb(self.device):,.0f} MB")

    def due(self, step, val_loss):
        return step % self.args.log_interval == 0 or step + 1 == self.args.max_steps or val_loss is not None

    def log_step(self, step, loss, lr, grad_norm, t0, val_loss=None, expert_load=()):
        """loss: the global batch's mean loss (a 0-d tensor); t0: perf_counter() when the step began; expert_load: a
        mixture of experts' tokens per expert, [n_layer, n_expert] over the global batch (StopRequest.agreed's)."""
        loss = loss.item()  # waits for the device: the step time below is real
        step_s = time.perf_counter() - t0
        tokens_per_s = self.args.global_batch * self.args.block_size / step_s
        mfu = self.flops_per_token * tokens_per_s / (self.world_size * self.peak_flops) if self.peak_flops else None
        memory = peak_memory_mb(self.device)
        record = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm.item(), "tokens_per_s": tokens_per_s,
                  "mfu": mfu, "peak_mem_mb": memory, "step_ms": 1000 * step_s}
        if val_loss is not None:
            record["val_loss"] = val_loss
        if len(expert_load):  # the busiest expert's tokens over the mean: 1 is balance, n_expert / top_k the worst
            record["tokens_per_expert"] = expert_load.int().tolist()
            record["expert_imbalance"] = (expert_load.max(1).values / expert_load.mean(1)).max().item()
        mfu = "n/a" if mfu is None else f"{100 * mfu:.1f}%"
        self.print(f"step {step:5d} | loss {loss:.4f} | lr {lr:.2e} | grad norm {record['grad_norm']:.3f} | "
                   f"{tokens_per_s:,.0f} tok/s | mfu {mfu} | mem {memory:,.0f} MB | {1000 * step_s:.0f} ms"
                   + (f" | val loss {val_loss:.4f}" if val_loss is not None else "")
                   + (f" | busiest expert {record['expert_imbalance']:.2f}x the mean" if len(expert_load) else ""))
        if not self.writes:
            return
        # Strict JSON: a value that is not finite is null (json.dumps would write NaN, which jq and JSON.parse refuse)
        record = {key: None if isinstance(value, float) and not math.isfinite(value) else value
                  for key, value in record.items()}
        with open(os.path.join(self.args.out_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(record, allow_nan=False) + "\n")
        if self.trackers:
            self.trackers.log(record)
