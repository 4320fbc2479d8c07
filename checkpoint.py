"""
The one checkpoint format every layout shares: a run saved by any script resumes under any other, at any world size.
A checkpoint is a folder `<out_dir>/ckpt-<step>` with one file per rank and a meta.pt; `<out_dir>/latest` names the
newest complete one. A rank file maps tensor names (gpt.py's parameter names, and `exp_avg/<name>`, `exp_avg_sq/<name>`
for AdamW's moments) to the pieces the rank holds (its Parts, below, written from where they are), each
    {"shape": full shape, "box": ((start, stop) per dim), "flat": (start, stop), "data": 1-D tensor}
Loading copies into each part of the loading layout only the stored pieces' overlap with it.

Saving (save): every rank writes its file into `ckpt-<step>.tmp`, the ranks agree that every write succeeded (in a
gloo group of their own), rank 0 writes meta.pt, renames the folder into place and repoints `latest`. Resuming:
to_resume finds the checkpoint and refuses what it cannot continue, before any collective; resume loads this rank's
part of every tensor, AdamW's moments and the generators' state (under another layout, ones that keep its rules).
"""

import errno
import hashlib
import math
import os
import re
import shutil
from dataclasses import asdict
from functools import partial
from typing import NamedTuple

import torch
import torch.distributed as dist

import training

MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's state beside each parameter, saved under "<moment>/<name>"


class Part(NamedTuple):
    """This rank's part of the full tensor `name`: elements [flat[0], flat[1]) of the flattened full[box], in
    tensor.view(-1) from `start` on. A tensor-parallel slice narrows the box, an FSDP shard the flat range."""
    name: str
    shape: tuple
    box: tuple
    flat: tuple
    tensor: torch.Tensor
    start: int = 0

    def local(self, tensor=None):
        """This part's elements in `tensor` (default: the parameter; or its gradient, an AdamW moment)."""
        tensor = self.tensor if tensor is None else tensor
        return tensor.detach().view(-1)[self.start:self.start + self.flat[1] - self.flat[0]]

    @property
    def sliced(self):
        """Split across tensor-parallel ranks, as opposed to replicated on each (whole, or an FSDP shard of it)."""
        return any(box != (0, n) for box, n in zip(self.box, self.shape))


def parameter_parts(model):
    """The Part of every parameter: whole, or a slice where its module says so in a `boxes` dict, parameter name ->
    (full shape, box) (train_tp.py's layers). A tied parameter is listed once, under its first name. Buffers too (a
    mixture of experts' balancing bias), whole: alike on every rank, saved and resumed as the weights are."""
    parts = []
    for name, param in [*model.named_parameters(), *model.named_buffers()]:
        module_name, _, param_name = name.rpartition(".")
        boxes = getattr(model.get_submodule(module_name), "boxes", {})
        shape, box = boxes.get(param_name, (param.shape, [(0, n) for n in param.shape]))
        parts.append(Part(name, tuple(shape), tuple(box), (0, param.numel()), param))
    return parts


def piece(shape, data, box=None, flat=None):
    """What a checkpoint stores of a part: `data` is elements [flat[0], flat[1]) of the flattened full[box]."""
    box = tuple(box or [(0, n) for n in shape])
    flat = tuple(flat or (0, math.prod(stop - start for start, stop in box)))
    # No copy, but a storage of its own: torch.save writes a view's whole storage, a device's to the host one at a time
    data = data.detach().reshape(-1)
    start = data.storage_offset() * data.element_size()
    data = data.new_empty(0).set_(data.untyped_storage()[start:start + data.nbytes], 0, data.shape)
    return {"shape": tuple(shape), "box": box, "flat": flat, "data": data}


def pieces(parts, optimizer):
    """The pieces a rank writes: its parameters' parts, and AdamW's moments over the same parts."""
    tensors = {}
    for part in parts:
        state = optimizer.state.get(part.tensor, {})
        named = [(part.name, part.tensor)] + [(f"{m}/{part.name}", state[m]) for m in MOMENTS if m in state]
        for name, tensor in named:
            tensors.setdefault(name, []).append(piece(part.shape, part.local(tensor), part.box, part.flat))
    return tensors


def check_finite(diverged, step, loss, grad_norm, args):
    """Before the optimizer step: a gradient norm that is not finite on any rank (diverged, from
    training.StopRequest.agreed) stops the run, with weights, AdamW and checkpoints as after the last finite step."""
    if not diverged:
        return
    last = latest(args.out_dir)
    resume = f"--resume continues from {last!r}" if last else "no checkpoint was saved before it"
    message = (f"step {step}: the gradient norm is {grad_norm.item():.4g} (this rank's loss {loss.item():.4g}): the "
               "run diverged, and stopped before this step changed anything; try a lower --lr, --grad_clip 1.0, or "
               f"--dtype float32 for a check; {resume}")
    raise training.Stopped(message, training.DIVERGED_EXIT_CODE)


def due(step, args):
    """Whether a checkpoint follows optimizer step `step`: every --ckpt_interval steps, and after the last."""
    return (args.ckpt_interval and (step + 1) % args.ckpt_interval == 0) or step + 1 == args.max_steps


# ------------------------------------------------------------------------------------------------------------
# Saving: every rank writes its own file, then rank 0 publishes the folder


def save_shard(out_dir, step, rank, tensors, rng_state):
    """Every rank writes its own pieces into the unpublished folder of this step."""
    folder = os.path.join(out_dir, f"ckpt-{step:07d}.tmp")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"rank{rank:05d}.pt")
    torch.save({"tensors": tensors, "rng": rng_state}, path + ".tmp")
    os.replace(path + ".tmp", path)


def publish(out_dir, step, world_size, meta, keep=0):
    """Rank 0, after every rank's save_shard: write meta, rename the folder into place, repoint `latest`, delete all
    but the `keep` newest (0: keep all). A crash at any moment leaves `latest` naming a complete checkpoint."""
    final, pointer = os.path.join(out_dir, f"ckpt-{step:07d}"), os.path.join(out_dir, "latest")
    meta = dict(meta, step=step, files=[f"rank{r:05d}.pt" for r in range(world_size)])
    torch.save(meta, os.path.join(final + ".tmp", "meta.pt"))
    if os.path.exists(final) and final != latest(out_dir):
        shutil.rmtree(final)  # left by a run that crashed between this rename and the next line's
    os.rename(final + ".tmp", final)
    with open(pointer + ".tmp", "w") as f:
        f.write(os.path.basename(final))
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer + ".tmp", pointer)
    # Older than this one by step; a newer one is left by a run resumed from before it, and is overwritten later.
    before = older(final)
    for name in before[:max(0, len(before) - keep + 1)] if keep else []:
        shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)


def save(args, step, tensors, config, device, rank=0, world_size=1, tp=1):
    """Every rank writes its pieces, then rank 0 publishes the checkpoint. The ranks agree after each phase: a write
    that fails anywhere (no space, no permission) publishes nothing, removes the folder and stops every rank. tp: the
    consecutive ranks that hold the same random generators (tensor-parallel peers): meta.pt records r // tp by rank."""
    folder = os.path.join(args.out_dir, f"ckpt-{step:07d}.tmp")
    write_everywhere(lambda: save_shard(args.out_dir, step, rank, tensors, rng_state(device)),
                     folder, tensors, rank, world_size)
    meta = {"config": asdict(config), "args": vars(args), "generators": [r // tp for r in range(world_size)]}
    write_everywhere(lambda: rank == 0 and publish(args.out_dir, step, world_size, meta, args.keep_checkpoints),
                     folder, {}, rank, world_size)  # nobody goes on before `latest` moved


def write_everywhere(write, folder, tensors, rank, world_size):
    """write() on every rank; if it failed on any (one all-gather tells), remove the folder and stop every rank."""
    error = None
    try:
        write()
    except (OSError, RuntimeError) as caught:  # torch.save into a full disk raises a RuntimeError
        error = write_error(caught, folder, tensors, rank)
    except BaseException:  # Ctrl-C, a crash: no half-written folder stays behind
        shutil.rmtree(folder, ignore_errors=True)
        raise
    errors = [error] * world_size
    if world_size > 1:
        dist.all_gather_object(errors, error, group=training.save_group)  # not NCCL's: --save_timeout
    if any(errors):
        shutil.rmtree(folder, ignore_errors=True)
        previous = latest(os.path.dirname(folder)) or "none yet"
        raise training.Stopped(f"{next(e for e in errors if e)}; `latest` still names the previous checkpoint "
                               f"({previous})", 1)


def write_error(error, folder, tensors, rank):
    """One line for a failed write: what failed and where; for a full disk, the bytes needed and free."""
    text = f"{type(error).__name__}: {error}".splitlines()[0]
    if getattr(error, "errno", None) == errno.ENOSPC or "iostream error" in text or "unexpected pos" in text:
        needed = sum(p["data"].numel() * p["data"].element_size() for pieces in tensors.values() for p in pieces)
        free = shutil.disk_usage(os.path.dirname(folder)).free
        text = (f"no space left on the device (this rank's part needs {needed / 1e6:,.1f} MB, {free / 1e6:,.1f} MB "
                "are free): free some space or pass another --out_dir")
    return f"rank {rank} could not write its part of {folder}: {text}"


def latest(out_dir):
    pointer = os.path.join(out_dir, "latest")
    if not os.path.exists(pointer):
        return None
    with open(pointer) as f:
        return os.path.join(out_dir, f.read().strip())


# ------------------------------------------------------------------------------------------------------------
# Loading into any layout


SCHEDULE_FLAGS = ("max_steps", "lr", "warmup_steps", "min_lr")  # training.get_lr(step) depends on these


def to_resume(args):
    """The checkpoint --resume continues, or None; refuses to train over a run it was not told to continue.
    Says when the schedule differs from the checkpoint's, and exits (code 0) when it has reached --max_steps."""
    if args.resume and getattr(args, "impl", "ours") == "torch":
        raise training.UsageError("--resume is implemented for --impl ours only (it resumes checkpoints of any layout)")
    path = latest(args.out_dir)
    if path and not args.resume:
        raise training.UsageError(f"{args.out_dir!r} already holds {path!r}: pass --resume to continue it, "
                                  "or choose another --out_dir")
    if not (path and args.resume):
        return None
    saved = Checkpoint(path).meta
    args.resume = path  # what this rank found (a filesystem's cache may show nodes others): the fingerprint compares it
    say = print if training.launched_rank()[0] == 0 else lambda text: None
    if saved["step"] >= args.max_steps:
        say(f"nothing to do: {path!r} is at step {saved['step']} and --max_steps is {args.max_steps}; pass a larger "
            "--max_steps to train further")
        raise SystemExit(0)
    changed = [f"--{flag} {saved['args'][flag]} -> {getattr(args, flag)}" for flag in SCHEDULE_FLAGS
               if saved["args"].get(flag, getattr(args, flag)) != getattr(args, flag)]
    if changed:
        say(f"the schedule differs from the checkpoint's ({', '.join(changed)}): the learning rate follows the "
            f"new one from step {saved['step']} on")
    return path


def older(path):
    """The names of the checkpoints beside checkpoint `path` with a lower step, oldest first."""
    out_dir, name = os.path.split(path)
    return sorted(n for n in os.listdir(out_dir) if re.fullmatch(r"ckpt-\d{7}", n) and n < name)


def older_advice(path):
    """What to do about a broken checkpoint: point `latest` at the newest one before it, if there is one."""
    before = older(path)
    if not before:
        return f"delete {path!r} to start afresh"
    pointer = os.path.join(os.path.dirname(path), "latest")
    return f"point `latest` at the one before it (echo {before[-1]} > {pointer}) or delete it"


class Checkpoint:
    """A checkpoint folder opened for reading. Files are memory-mapped: region() copies out only what a part needs,
    so a rank reads and holds about its own share of the model (elements_read counts it)."""

    def __init__(self, path):
        try:
            self.meta = torch.load(os.path.join(path, "meta.pt"), weights_only=True)
            self.shards = [torch.load(os.path.join(path, name), map_location="cpu", weights_only=True, mmap=True)
                           for name in self.meta["files"]]
        except Exception as error:
            reason = f"{type(error).__name__}: {error}".splitlines()[0]
            raise training.UsageError(f"checkpoint {path!r} is unreadable ({reason}); {older_advice(path)}") from None
        self.path = path
        self.elements_read = 0  # what load() copied out of the files: about this rank's part
        self.pieces = {}
        for shard in self.shards:
            for name, pieces in shard["tensors"].items():
                self.pieces.setdefault(name, []).extend(pieces)

    def check(self, config, shapes):
        """Refuse, before anything is loaded, a checkpoint of another model or one with missing pieces."""
        if type(config)(**self.meta["config"]) != config:  # a field added since it was saved takes its default
            raise training.UsageError(f"checkpoint {self.path!r} is of another model: {self.meta['config']} vs this "
                                      f"run's {asdict(config)}; use a new --out_dir, or the --model, --block_size "
                                      "and --dropout it was saved with")
        for name, shape in shapes.items():
            # A piece several ranks hold alike (an FSDP run's buffers) may be stored by each: counted once
            spans = {(p["box"], p["flat"]) for p in self.pieces.get(name, []) if tuple(p["shape"]) == tuple(shape)}
            covered = sum(stop - start for _, (start, stop) in spans)
            if covered != math.prod(shape):
                raise ValueError(f"checkpoint {self.path!r}: tensor {name} {tuple(shape)} covers {covered} of its "
                                 f"{math.prod(shape)} elements (another model, or a rank file missing or truncated)")

    def region(self, name, box, flat):
        """Elements [flat[0], flat[1]) of the flattened full[box] of tensor `name` (a Part's), read from the rows of
        box that hold them."""
        return training.flat_range(partial(self.window, name), box, flat)

    def window(self, name, box):
        """full[box] of tensor `name`, copied out of only the stored pieces' overlap with it: the files are mapped, and
        what a rank does not read stays on disk."""
        (top, bottom), (left, right) = as_matrix(box)
        window = torch.empty(bottom - top, right - left, dtype=self.pieces[name][0]["data"].dtype)
        for p in self.pieces[name]:
            for row, column, values in rectangles(p["box"], p["flat"], p["data"]):
                first, last = max(row, top), min(row + len(values), bottom)  # the overlap with the window
                start, stop = max(column, left), min(column + values.shape[1], right)
                if first < last and start < stop:
                    copied = values[first - row:last - row, start - column:stop - column]
                    window[first - top:last - top, start - left:stop - left] = copied
                    self.elements_read += copied.numel()
        return window


def as_matrix(box):  # a vector is a matrix of one column
    return (box[0], box[1]) if len(box) == 2 else (box[0], (0, 1))


def rectangles(box, flat, data):
    """A stored piece (elements [flat[0], flat[1]) of the flattened full[box]) as at most three rectangles of the full
    matrix, a partial first row, whole rows and a partial last row: (first row, first column, values)."""
    (rows, columns), (start, stop) = as_matrix(box), flat
    width = columns[1] - columns[0]
    first_end = min(-(-start // width) * width, stop)  # the end of the first row, or of a piece within one row
    last_start = max(stop // width * width, first_end)  # the start of the last row, unless the first has it all
    for begin, end in [(start, first_end), (first_end, last_start), (last_start, stop)]:
        if begin < end:  # a partial row's elements, or whole rows of the box's width
            values = data[begin - start:end - start].view(-1, min(width, end - begin))
            yield rows[0] + begin // width, columns[0] + begin % width, values


@torch.no_grad()
def load(checkpoint, parts, optimizer, config):
    """Fill this rank's parts (parameters, and AdamW moments unless optimizer is None) from a checkpoint of any
    layout. Everything is checked first: a refused checkpoint leaves the model as it was."""
    shapes = {part.name: part.shape for part in parts}
    with_moments = optimizer is not None and f"exp_avg/{parts[0].name}" in checkpoint.pieces
    if with_moments:  # of every parameter; a buffer has none
        shapes.update({f"{m}/{part.name}": part.shape for part in parts if part.tensor.requires_grad for m in MOMENTS})
    checkpoint.check(config, shapes)
    moments = {}
    for part in parts:
        part.local().copy_(checkpoint.region(part.name, part.box, part.flat))
        if with_moments and part.tensor.requires_grad:
            if part.tensor not in moments:
                moments[part.tensor] = {moment: torch.zeros_like(part.tensor) for moment in MOMENTS}
            for moment, buffer in moments[part.tensor].items():
                part.local(buffer).copy_(checkpoint.region(f"{moment}/{part.name}", part.box, part.flat))
    if moments:
        # Through load_state_dict: AdamW puts the step count where its implementation (fused, foreach) wants it.
        state_dict = optimizer.state_dict()
        index = {p: i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
        for param, state in moments.items():
            state_dict["state"][index[param]] = dict(state, step=torch.tensor(float(checkpoint.meta["step"])))
        optimizer.load_state_dict(state_dict)


def resume(path, parts, optimizer, config, rank, device, tp=1):
    """Load checkpoint `path` (None: start fresh) into this rank's parts; returns the step to continue from. Each rank
    gets its generators back if this layout shares them out as the saving one did (tp: tensor-parallel peers, which
    share theirs); else new ones from (seed, step, rank // tp): TP peers alike, data-parallel ranks apart."""
    if path is None:
        return 0
    checkpoint = Checkpoint(path)
    load(checkpoint, parts, optimizer, config)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if checkpoint.meta.get("generators") == [r // tp for r in range(world_size)]:
        set_rng_state(checkpoint.shards[rank]["rng"], device)
    else:
        digest = hashlib.sha256(f"{checkpoint.meta['args']['seed']}/{checkpoint.meta['step']}/{rank // tp}".encode())
        torch.manual_seed(int.from_bytes(digest.digest()[:8], "little") >> 1)  # every device's generators
    return checkpoint.meta["step"]


def rng_state(device):
    """The generators this rank draws from, CPU's and this GPU's: dropout goes on after a resume as if never stopped."""
    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def set_rng_state(state, device):
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"], device)
