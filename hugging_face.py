"""
Pretrained weights in the Hugging Face format, for --init_from: GPT-2 (GPT2LMHeadModel), Llama 3 (LlamaForCausalLM)
and Mixtral (MixtralForCausalLM), from a local folder or a hub model. config.json, and model.safetensors or its
shards (model-0000k-of-0000N.safetensors, named tensor by tensor in model.safetensors.index.json), opened by their
names and shapes alone: each rank maps only the files that hold its parts and reads only its rows, and of a mixture of
experts only its experts. Hugging Face's names and layouts are mapped to gpt.py's. Imported only under --init_from
(training.load_data, initial_values).

Run as a script, it writes a GPT-2 of random weights in that format, a stand-in for `gpt2` where there is no network:

    python hugging_face.py --out_dir gpt2-random                 # GPT-2 124M's shapes and vocabulary
    python hugging_face.py --out_dir gpt2-tiny --n_layer 4 --n_head 4 --n_embd 128 --n_positions 256 --vocab_size 256
"""

import argparse
import json
import os
from collections import Counter
from functools import cached_property

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

import gpt
from prepare_data import HelpFormatter, UsageError, positive_int

# Hugging Face computes GPT-2's linear layers with Conv1D, which stores a weight as [in, out], the transpose of
# nn.Linear's [out, in] (OpenAI's original TensorFlow layout), and packs q, k and v side by side along c_attn's output
# dimension. gpt.py keeps q, k and v apart so that tensor parallelism splits each by rows (see CausalSelfAttention).
# Our module -> (its Conv1D, which third of the packed output dimension is ours).
HUGGING_FACE_LINEARS = {"attn.query": ("attn.c_attn", 0), "attn.key": ("attn.c_attn", 1),
                        "attn.value": ("attn.c_attn", 2), "attn.proj": ("attn.c_proj", 0),
                        "mlp.fc": ("mlp.c_fc", 0), "mlp.proj": ("mlp.c_proj", 0)}

# Llama's modules under our names: blocks.i.<ours> is model.layers.i.<theirs>. Its linear weights are nn.Linear's
# [out, in], as ours. Hugging Face's conversion of Meta's weights permuted the rows of q and k for its rotary
# convention (rotate_half: channel i of a head pairs with channel i + head_dim / 2), which gpt.rotate follows: no row
# is moved here.
LLAMA_MODULES = {"ln_1": "input_layernorm", "attn.query": "self_attn.q_proj", "attn.key": "self_attn.k_proj",
                 "attn.value": "self_attn.v_proj", "attn.proj": "self_attn.o_proj", "ln_2": "post_attention_layernorm",
                 "mlp.gate": "mlp.gate_proj", "mlp.fc": "mlp.up_proj", "mlp.proj": "mlp.down_proj",
                 "mlp.router": "block_sparse_moe.gate"}
# Mixtral's blocks are Llama's with the MLP a mixture of experts: blocks.i.mlp.experts.e.<ours> is
# model.layers.i.block_sparse_moe.experts.e.<theirs>, each expert an MLP of its own file entries, so a rank that holds
# some experts reads theirs alone. Its expert computes w2(silu(w1(x)) * w3(x)), ours proj(silu(gate(x)) * fc(x)).
MIXTRAL_EXPERT = {"gate": "w1", "fc": "w3", "proj": "w2"}


def config_from_hugging_face(hf, block_size, dropout):
    """The GPTConfig of a Hugging Face config.json (a dict), GPT-2's or Llama's, with a context of block_size <= its
    n_positions (a shorter one keeps the first positions' embeddings). Refuses a config this model would not compute
    as GPT-2 does."""
    if hf.get("model_type") in ("llama", "mixtral"):
        return llama_config(hf, block_size, dropout)
    missing = [key for key in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size") if key not in hf]
    if missing:
        raise ValueError(f"config.json has no {', '.join(missing)}: it is not a GPT-2 config")
    allowed = {"model_type": ("gpt2",), "activation_function": ("gelu_new", "gelu_pytorch_tanh"),
               "layer_norm_epsilon": (1e-5,), "n_inner": (None, 4 * hf["n_embd"]), "scale_attn_weights": (True,),
               "scale_attn_by_inverse_layer_idx": (False,), "tie_word_embeddings": (True,)}
    unlike = [f"{key} {hf[key]!r}" for key, values in allowed.items() if key in hf and hf[key] not in values]
    if unlike:
        raise ValueError(f"config.json has {', '.join(unlike)}: gpt.py computes GPT-2, Llama 3 and Mixtral only; use a "
                         "GPT-2, Llama 3 or Mixtral checkpoint")
    if block_size > hf["n_positions"]:
        raise ValueError(f"--block_size {block_size} is longer than its n_positions {hf['n_positions']}: "
                         f"pass --block_size {hf['n_positions']} or less")
    config = gpt.GPTConfig(block_size=block_size, vocab_size=hf["vocab_size"], n_layer=hf["n_layer"], n_head=hf["n_head"],
                       n_embd=hf["n_embd"], dropout=dropout)
    gpt.check_config(config)
    return config


def llama_config(hf, block_size, dropout):
    """The GPTConfig of a LlamaForCausalLM's or MixtralForCausalLM's config.json, its absent keys taking LlamaConfig's
    or MixtralConfig's defaults. The rotary settings are rope_theta and rope_scaling at the top level, as the hub's
    Llama 3.1 and 3.2 repositories write them, or one rope_parameters entry, as newer transformers writes it. Mixtral
    is Llama with num_local_experts experts a block, num_experts_per_tok of them run by each token, each
    intermediate_size wide."""
    mixtral = hf["model_type"] == "mixtral"
    keys = ("num_hidden_layers", "num_attention_heads", "hidden_size", "intermediate_size", "max_position_embeddings",
            "vocab_size") + ("num_local_experts", "num_experts_per_tok") * mixtral
    missing = [key for key in keys if key not in hf]
    if missing:
        raise ValueError(f"config.json has no {', '.join(missing)}: it is not a {hf['model_type'].title()} config")
    theta = 1e6 if mixtral else 10000.0  # MixtralConfig's default, LlamaConfig's
    rope = hf.get("rope_parameters") or dict(hf.get("rope_scaling") or {}, rope_theta=hf.get("rope_theta", theta))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    allowed = {"hidden_act": ("silu",), "attention_bias": (False,), "mlp_bias": (False,), "pretraining_tp": (1,),
               "head_dim": (hf["hidden_size"] // hf["num_attention_heads"], None)}  # None: that one (Mixtral's)
    unlike = [f"{key} {hf[key]!r}" for key, values in allowed.items() if key in hf and hf[key] not in values]
    unlike += [f"rope_type {rope_type!r}"] * (rope_type not in ("default", "llama3"))
    if unlike:
        raise ValueError(f"config.json has {', '.join(unlike)}: gpt.py computes Llama 3 (SiLU, no biases, head_dim = "
                         "hidden_size / num_attention_heads, rope_type default or llama3); use a Llama 3 or Mixtral "
                         "checkpoint")
    if mixtral and (hf.get("sliding_window") or block_size) < block_size:  # null: the whole context, as Mixtral's
        raise ValueError(f"--block_size {block_size} is longer than its sliding_window {hf['sliding_window']}, and "
                         f"gpt.py attends to the whole context: pass --block_size {hf['sliding_window']} or less")
    if block_size > hf["max_position_embeddings"]:
        raise ValueError(f"--block_size {block_size} is longer than its max_position_embeddings "
                         f"{hf['max_position_embeddings']}: pass --block_size {hf['max_position_embeddings']} or less")
    scaling = (float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
               int(rope["original_max_position_embeddings"])) if rope_type == "llama3" else None
    config = gpt.GPTConfig(block_size=block_size, vocab_size=hf["vocab_size"], n_layer=hf["num_hidden_layers"],
                           n_head=hf["num_attention_heads"], n_embd=hf["hidden_size"], dropout=dropout, bias=False,
                           n_kv_head=hf.get("num_key_value_heads", 8 if mixtral else None), swiglu=True, rms_norm=True,
                           norm_eps=hf.get("rms_norm_eps", 1e-5 if mixtral else 1e-6), rope_scaling=scaling,
                           mlp_hidden=hf["intermediate_size"], rope_theta=float(rope["rope_theta"]),
                           tie_embeddings=hf.get("tie_word_embeddings", False), n_expert=hf.get("num_local_experts", 0),
                           n_expert_per_token=hf.get("num_experts_per_tok", 2))
    gpt.check_config(config)
    return config


def hugging_face_box(name, box, config):
    """Where the box of parameter `name` lies in a Hugging Face checkpoint: (the stored tensor's name, the box of it
    that holds ours, whether ours is that box transposed). wte and an untied LM head store the tokenizer's vocabulary
    only, so the box stops at vocab_size (our padding rows are not stored); a tied LM head is wte and never read.
    A model with rotary positions is a Llama or a Mixtral (llama_name). GPT-2's blocks.i is h.i; query, key and value
    are thirds of c_attn's columns."""
    if name in ("wte.weight", "lm_head.weight"):
        (start, stop), columns = box
        box = ((min(start, config.vocab_size), min(stop, config.vocab_size)), columns)
    if config.rope_theta is not None:
        return llama_name(name), box, False
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


def llama_name(name):
    """A LlamaForCausalLM's or MixtralForCausalLM's name for our parameter `name`."""
    if not name.startswith("blocks."):
        return {"wte.weight": "model.embed_tokens.weight", "ln_f.weight": "model.norm.weight"}.get(name, name)
    _, layer, rest = name.split(".", 2)
    module, _, kind = rest.rpartition(".")
    if module.startswith("mlp.experts."):  # blocks.i.mlp.experts.e.gate
        _, _, expert, linear = module.split(".")
        return f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{MIXTRAL_EXPERT[linear]}.{kind}"
    return f"model.layers.{layer}.{LLAMA_MODULES[module]}.{kind}"


def read_hugging_face(name, box, config, read):
    """The box of parameter `name` from a Hugging Face checkpoint, reading nothing else: read(stored name, box) gives
    stored[box] (HuggingFaceCheckpoint copies just that region out of its file). Padding rows of wte and of an untied
    LM head are zeros: no token ever looks them up, and the loss and sampling leave their classes out."""
    stored, stored_box, transposed = hugging_face_box(name, box, config)
    value = read(stored, stored_box).float()
    value = value.t() if transposed else value
    missing = box[0][1] - box[0][0] - value.shape[0]
    return F.pad(value, (0, 0, 0, missing)) if missing else value


def pretrained_folder(name_or_path):
    """A folder in the Hugging Face format: a local one, or a hub model's (gpt2 ... gpt2-xl, meta-llama/Llama-3.2-1B,
    ...) downloaded into huggingface_hub's cache (under $HF_HOME; with HF_HUB_OFFLINE=1 only the cache is read)."""
    if os.path.isdir(name_or_path):
        return name_or_path
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1 or os.path.exists(name_or_path):
        raise UsageError(f"--init_from {name_or_path!r}: no such folder (a hub model is named name or owner/name)")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name_or_path, allow_patterns=["config.json", "model*.safetensors",
                                                               "model.safetensors.index.json"])
    except Exception as error:
        raise UsageError(f"--init_from {name_or_path!r} is no local folder, and the Hugging Face hub did not give it "
                         f"({type(error).__name__}): pass a folder with config.json and model.safetensors, or download "
                         f"it where the network allows (hf download {name_or_path} --include config.json "
                         "'model*.safetensors*') into the cache $HF_HOME names") from error


def safetensors_shapes(path):
    """{tensor name: shape} from a safetensors file's header (8 bytes giving its length, then JSON), read without
    mapping the file's tensors."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return {name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}


class HuggingFaceCheckpoint:
    """A model in the Hugging Face format (config.json, and model.safetensors or the shards model.safetensors.index.json
    names), opened by its names and shapes alone. read() maps the one file holding a tensor, copies one box out of it
    and unmaps it: a rank opens only the files holding its parts, and holds only the parts it asks for."""

    def __init__(self, name_or_path):
        folder = pretrained_folder(name_or_path)
        self.listing = next((name for name in ("model.safetensors.index.json", "model.safetensors")
                             if os.path.exists(os.path.join(folder, name))), None)
        if not (self.listing and os.path.exists(os.path.join(folder, "config.json"))):
            raise UsageError(f"--init_from {name_or_path!r}: {folder!r} holds no config.json and model.safetensors "
                             "(the Hugging Face format)")
        with open(os.path.join(folder, "config.json")) as f:
            self.config = json.load(f)
        if self.listing == "model.safetensors":
            self.files = dict.fromkeys(safetensors_shapes(os.path.join(folder, self.listing)), self.listing)
        else:  # sharded: which of model-0000k-of-0000N.safetensors holds each tensor
            with open(os.path.join(folder, self.listing)) as f:
                self.files = json.load(f)["weight_map"]
        self.files = {name: os.path.join(folder, file) for name, file in self.files.items()}
        # GPT2LMHeadModel.save_pretrained() names the body transformer.*; the hub's GPT-2 files do not.
        self.prefix = "transformer." if "transformer.wte.weight" in self.files else ""

    @cached_property
    def shapes(self):
        """Every tensor's shape, from every file's header (a few kB each): every rank checks every shape alike."""
        shapes = {}
        for path in sorted(set(self.files.values())):
            shapes.update(safetensors_shapes(path))
        return shapes

    def read(self, name, box):
        name = self.prefix + name
        with safe_open(self.files[name], framework="pt") as file:  # a slice may view the mapping: copy it out
            value = file.get_slice(name)[tuple(slice(start, stop) for start, stop in box)].clone()
        bytes_read[self.files[name]] += value.numel() * value.element_size()
        return value


bytes_read = Counter()  # file -> the bytes this process copied out of it (HuggingFaceCheckpoint.read)


def read_summary():
    """What this rank read of --init_from, for the start-up line: its parts' bytes, from the files holding them."""
    return f"read {sum(bytes_read.values()) / 1e6:,.1f} MB from {len(bytes_read)} file{'s' * (len(bytes_read) != 1)}"


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
                         "tokenizer (prepare_data.py --tokenizer gpt2 for GPT-2, --tokenizer FOLDER/original/"
                         "tokenizer.model for Llama 3" + "; none yet for Mixtral's" * bool(config.n_expert) + ")")
    with torch.device("meta"):
        shapes = {name: param.shape for name, param in gpt.GPT(config).named_parameters()}
    for name, shape in shapes.items():
        stored, box, _ = hugging_face_box(name, [(0, n) for n in shape], config)
        stored, found = checkpoint.prefix + stored, checkpoint.shapes.get(checkpoint.prefix + stored)
        if found is None:
            raise UsageError(f"{source}: {checkpoint.listing} has no {stored}: the weights do not match config.json")
        if len(found) != len(box) or any(stop > n for (_, stop), n in zip(box, found)):
            raise UsageError(f"{source}: {checkpoint.listing}'s {stored} {found} cannot hold {name} {tuple(shape)}: "
                             "the weights do not match config.json")
    return config


def reader(name_or_path, config):
    """read(name, shape, box): parameter `name`'s initial value in box, from the checkpoint (training.initial_values)."""
    checkpoint = HuggingFaceCheckpoint(name_or_path)
    return lambda name, shape, box: read_hugging_face(name, box, config, checkpoint.read)


def write_random_gpt2(folder, n_layer=12, n_head=12, n_embd=768, n_positions=1024, vocab_size=50257, seed=0,
                      files=1):
    """config.json and model.safetensors (or `files` shards of it) of a GPT-2 with random weights, stored as Hugging
    Face's GPT2LMHeadModel stores GPT-2: Conv1D weights [in, out], q|k|v side by side in c_attn, no LM head (tied to
    wte). Drawn as GPT-2 initialises them: weights N(0, 0.02), biases zero, layer norms' gains one."""
    shapes = {"wte.weight": (vocab_size, n_embd), "wpe.weight": (n_positions, n_embd)}
    for i in range(n_layer):  # a block's tensors side by side, as the hub's shards hold them
        for module, shape in (("ln_1", (n_embd,)), ("attn.c_attn", (n_embd, 3 * n_embd)),
                              ("attn.c_proj", (n_embd, n_embd)), ("ln_2", (n_embd,)),
                              ("mlp.c_fc", (n_embd, 4 * n_embd)), ("mlp.c_proj", (4 * n_embd, n_embd))):
            shapes.update({f"h.{i}.{module}.weight": shape, f"h.{i}.{module}.bias": shape[-1:]})
    shapes.update({"ln_f.weight": (n_embd,), "ln_f.bias": (n_embd,)})
    generator = torch.Generator().manual_seed(seed)

    def initial(name, shape):
        if name.endswith("bias"):
            return torch.zeros(shape)
        if len(shape) == 1:  # a layer norm's gain
            return torch.ones(shape)
        return 0.02 * torch.randn(shape, generator=generator)

    tensors = {name: initial(name, shape) for name, shape in shapes.items()}
    os.makedirs(folder, exist_ok=True)
    if files == 1:
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    else:  # as the hub shards a large model: consecutive tensors a file, and an index naming each tensor's file
        names = list(tensors)
        weight_map = {}
        for k in range(files):
            file = f"model-{k + 1:05d}-of-{files:05d}.safetensors"
            share = names[k * len(names) // files:(k + 1) * len(names) // files]
            save_file({name: tensors[name] for name in share}, os.path.join(folder, file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(share, file))
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
    config = dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], activation_function="gelu_new",
                  layer_norm_epsilon=1e-5, n_ctx=n_positions, n_positions=n_positions, n_embd=n_embd, n_head=n_head,
                  n_layer=n_layer, vocab_size=vocab_size)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--out_dir", required=True, help="the folder to write config.json and model.safetensors into")
    p.add_argument("--n_layer", type=positive_int, default=12, help="transformer blocks")
    p.add_argument("--n_head", type=positive_int, default=12, help="attention heads; they divide --n_embd")
    p.add_argument("--n_embd", type=positive_int, default=768, help="the residual stream's width")
    p.add_argument("--n_positions", type=positive_int, default=1024, help="the longest context (--block_size)")
    p.add_argument("--vocab_size", type=positive_int, default=50257, help="GPT-2's tokenizer (256: the byte one)")
    p.add_argument("--seed", type=int, default=0, help="seeds the random weights")
    p.add_argument("--files", type=positive_int, default=1, help="shards, named in model.safetensors.index.json")
    args = p.parse_args(argv)
    if args.n_embd % args.n_head:
        raise UsageError(f"--n_embd {args.n_embd} is not divisible by --n_head {args.n_head}: choose a --n_head that "
                         "divides it")
    tensors = 4 + 12 * args.n_layer  # wte, wpe, ln_f's two, and 12 a block
    if args.files > tensors:
        raise UsageError(f"--files {args.files} is more than the {tensors} tensors to put in them: choose at most "
                         f"{tensors}")
    write_random_gpt2(args.out_dir, args.n_layer, args.n_head, args.n_embd, args.n_positions, args.vocab_size,
                      args.seed, args.files)
    config = config_from_hugging_face(HuggingFaceCheckpoint(args.out_dir).config, args.n_positions, 0.0)
    with torch.device("meta"):
        parameters = gpt.GPT(config).num_params()
    print(f"{args.out_dir}: a random GPT-2 of {parameters / 1e6:.2f}M parameters in the Hugging Face format "
          f"(config.json, model.safetensors): pass --init_from {args.out_dir}")


if __name__ == "__main__":
    from prepare_data import run

    run(main)  # a UsageError: one line, exit code 2
