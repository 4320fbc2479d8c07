"""
GPT-2's weights in the Hugging Face format (config.json and model.safetensors), for --init_from: a local folder or
a hub model, opened by its names and shapes alone, each rank reading only the parts it holds, and Hugging Face's
names and layouts mapped to gpt.py's. Imported only under --init_from (training.load_data, initial_values).
"""

import json
import os

import torch
import torch.nn.functional as F
from safetensors import safe_open

import gpt
from prepare_data import UsageError

# Hugging Face computes GPT-2's linear layers with Conv1D, which stores a weight as [in, out], the transpose of
# nn.Linear's [out, in] (OpenAI's original TensorFlow layout), and packs q, k and v side by side along c_attn's output
# dimension. gpt.py keeps q, k and v apart so that tensor parallelism splits each by rows (see CausalSelfAttention).
# Our module -> (its Conv1D, which third of the packed output dimension is ours).
HUGGING_FACE_LINEARS = {"attn.query": ("attn.c_attn", 0), "attn.key": ("attn.c_attn", 1),
                        "attn.value": ("attn.c_attn", 2), "attn.proj": ("attn.c_proj", 0),
                        "mlp.fc": ("mlp.c_fc", 0), "mlp.proj": ("mlp.c_proj", 0)}


def config_from_hugging_face(hf, block_size, dropout):
    """The GPTConfig of a Hugging Face GPT-2 config.json (a dict), with a context of block_size <= its n_positions (a
    shorter one keeps the first positions' embeddings). Refuses a config this model would not compute as GPT-2 does."""
    missing = [key for key in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size") if key not in hf]
    if missing:
        raise ValueError(f"config.json has no {', '.join(missing)}: it is not a GPT-2 config")
    allowed = {"model_type": ("gpt2",), "activation_function": ("gelu_new", "gelu_pytorch_tanh"),
               "layer_norm_epsilon": (1e-5,), "n_inner": (None, 4 * hf["n_embd"]), "scale_attn_weights": (True,),
               "scale_attn_by_inverse_layer_idx": (False,), "tie_word_embeddings": (True,)}
    unlike = [f"{key} {hf[key]!r}" for key, values in allowed.items() if key in hf and hf[key] not in values]
    if unlike:
        raise ValueError(f"config.json has {', '.join(unlike)}: gpt.py computes GPT-2 only; use a GPT-2 checkpoint")
    if block_size > hf["n_positions"]:
        raise ValueError(f"--block_size {block_size} is longer than its n_positions {hf['n_positions']}: "
                         f"pass --block_size {hf['n_positions']} or less")
    config = gpt.GPTConfig(block_size=block_size, vocab_size=hf["vocab_size"], n_layer=hf["n_layer"], n_head=hf["n_head"],
                       n_embd=hf["n_embd"], dropout=dropout)
    if config.n_embd % config.n_head:
        raise ValueError(f"config.json: n_embd {config.n_embd} is not divisible by n_head {config.n_head}")
    return config


def hugging_face_box(name, box, config):
    """Where the box of parameter `name` lies in a Hugging Face GPT-2 checkpoint: (the stored tensor's name, the box
    of it that holds ours, whether ours is that box transposed). blocks.i is h.i; query, key and value are thirds of
    c_attn's columns; wte stores the tokenizer's vocabulary only, so the box stops at vocab_size (our padding rows are
    not stored); the LM head is tied to wte, as in GPT-2, and never read."""
    if name == "wte.weight":
        (start, stop), columns = box
        return name, ((min(start, config.vocab_size), min(stop, config.vocab_size)), columns), False
    if not name.startswith("blocks."):
        return name, box, False  # wpe (its first block_size rows), ln_f
    _, layer, rest = name.split(".", 2)
    module, _, kind = rest.rpartition(".")
    if module not in HUGGING_FACE_LINEARS:
        return f"h.{layer}.{rest}", box, False  # ln_1, ln_2
    stored, third = HUGGING_FACE_LINEARS[module]
    (start, stop), *columns = box  # rows of ours are output features: columns of Conv1D's weight, entries of its bias
    outputs = (start + third * config.n_embd, stop + third * config.n_embd)
    return f"h.{layer}.{stored}.{kind}", (*columns, outputs), kind == "weight"


def read_hugging_face(name, box, config, read):
    """The box of parameter `name` from a Hugging Face GPT-2 checkpoint, reading nothing else: read(stored name, box)
    gives stored[box] (training.HuggingFaceCheckpoint copies just that region out of the file). Padding rows of wte
    are zeros: no token ever looks them up, and the loss and sampling leave their classes out."""
    stored, stored_box, transposed = hugging_face_box(name, box, config)
    value = read(stored, stored_box).float()
    value = value.t() if transposed else value
    missing = box[0][1] - box[0][0] - value.shape[0]
    return F.pad(value, (0, 0, 0, missing)) if missing else value


def pretrained_folder(name_or_path):
    """A folder in the Hugging Face format: a local one, or a hub model's (gpt2 ... gpt2-xl, any GPT-2 repository)
    downloaded into huggingface_hub's cache (under $HF_HOME; with HF_HUB_OFFLINE=1 only the cache is read)."""
    if os.path.isdir(name_or_path):
        return name_or_path
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name_or_path, allow_patterns=["config.json", "model.safetensors"])
    except Exception as error:
        raise UsageError(f"--init_from {name_or_path!r} is no local folder, and the Hugging Face hub did not give it "
                         f"({type(error).__name__}): pass a folder with config.json and model.safetensors, or download "
                         f"it where the network allows (hf download {name_or_path} config.json model.safetensors) "
                         "into the cache $HF_HOME names") from error


class HuggingFaceCheckpoint:
    """A GPT-2 in the Hugging Face format (config.json, model.safetensors), opened by its names and shapes alone.
    read() maps the file, copies one box out of it and unmaps it: a rank holds only the parts it asks for."""

    def __init__(self, name_or_path):
        folder = pretrained_folder(name_or_path)
        self.path = os.path.join(folder, "model.safetensors")
        if not (os.path.exists(self.path) and os.path.exists(os.path.join(folder, "config.json"))):
            raise UsageError(f"--init_from {name_or_path!r}: {folder!r} holds no config.json and model.safetensors "
                             "(the Hugging Face format)")
        with open(os.path.join(folder, "config.json")) as f:
            self.config = json.load(f)
        with safe_open(self.path, framework="pt") as file:
            self.shapes = {name: tuple(file.get_slice(name).get_shape()) for name in file.keys()}
        # GPT2LMHeadModel.save_pretrained() names the body transformer.*; the hub's GPT-2 files do not.
        self.prefix = "transformer." if "transformer.wte.weight" in self.shapes else ""

    def read(self, name, box):
        with safe_open(self.path, framework="pt") as file:  # a slice may be a view into the mapping: copy it out
            return file.get_slice(self.prefix + name)[tuple(slice(start, stop) for start, stop in box)].clone()


def pretrained_config(args, meta):
    """The model of --init_from, from its config.json; refused, before any work, where a flag or the data contradict
    it or its weights do not fit it."""
    source = f"--init_from {args.init_from!r}"
    checkpoint = HuggingFaceCheckpoint(args.init_from)
    try:
        config = config_from_hugging_face(checkpoint.config, args.block_size, args.dropout)
    except ValueError as error:
        raise UsageError(f"{source}: {error}") from None
    if args.model and gpt.make_config(args.model, config.vocab_size, config.block_size, config.dropout) != config:
        raise UsageError(f"--model {args.model} contradicts {source} ({config.n_layer} layers, {config.n_head} heads, "
                         f"{config.n_embd} wide): drop --model, the checkpoint's config.json defines the model")
    if config.vocab_size != meta["vocab_size"]:
        raise UsageError(f"{source} has a vocabulary of {config.vocab_size}, but --data {args.data!r} is tokenized "
                         f"with {meta['tokenizer']} ({meta['vocab_size']}): prepare the data with the checkpoint's "
                         "tokenizer (prepare_data.py --tokenizer gpt2 for GPT-2)")
    with torch.device("meta"):
        shapes = {name: param.shape for name, param in gpt.GPT(config).named_parameters()}
    for name, shape in shapes.items():
        stored, box, _ = hugging_face_box(name, [(0, n) for n in shape], config)
        stored, found = checkpoint.prefix + stored, checkpoint.shapes.get(checkpoint.prefix + stored)
        if found is None:
            raise UsageError(f"{source}: model.safetensors has no {stored}: the weights do not match config.json")
        if len(found) != len(box) or any(stop > n for (_, stop), n in zip(box, found)):
            raise UsageError(f"{source}: model.safetensors' {stored} {found} cannot hold {name} {tuple(shape)}: the "
                             "weights do not match config.json")
    return config


def reader(name_or_path, config):
    """read(name, shape, box): parameter `name`'s initial value in box, from the checkpoint (training.initial_values)."""
    checkpoint = HuggingFaceCheckpoint(name_or_path)
    return lambda name, shape, box: read_hugging_face(name, box, config, checkpoint.read)
