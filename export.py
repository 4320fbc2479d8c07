"""
A run's checkpoint, of any layout and world size, written as a model folder in the Hugging Face format, which
transformers' AutoModelForCausalLM and AutoTokenizer load: config.json (GPT2LMHeadModel, LlamaForCausalLM or
MixtralForCausalLM), model.safetensors or its shards with model.safetensors.index.json, and the run's tokenizer as
tokenizer.json. The inverse of --init_from: hugging_face.hugging_face_box maps every parameter both ways.

    python export.py --out_dir out/finetune --to finetuned                   # the latest checkpoint, float32
    python export.py --out_dir out/finetune --step 100 --to finetuned --dtype bfloat16 --max_shard_size 2GB

It streams: one output shard's tensors are in memory at a time (and the float32 parameter being converted), each
read from the rank files' memory maps, so a model larger than the host's memory exports.
"""

import argparse
import json
import math
import os
import re

import torch
from safetensors.torch import save_file

import checkpoint
import gpt
import hugging_face
import prepare_data
import training

SIZE_UNITS = {"": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9}  # as save_pretrained's max_shard_size counts them


def byte_count(text):
    """'5GB', '500MB', '20KB' or a number of bytes."""
    found = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(KB|MB|GB)?", text.strip(), re.I)
    if not found or float(found.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is no size: write e.g. 5GB, 500MB or a number of bytes")
    return int(float(found.group(1)) * SIZE_UNITS[(found.group(2) or "").upper()])


def hugging_face_config(config, dtype, special):
    """config.json of our model as Hugging Face's GPT2LMHeadModel, LlamaForCausalLM or (with experts)
    MixtralForCausalLM: the vocabulary is the tokenizer's (the padding rows are not written), the context the run
    trained with (--block_size); special: the tokenizer's {"bos": id, "eos": id} (token_ids)."""
    ids = dict(bos_token_id=special["bos"], eos_token_id=special["eos"])
    if config.rope_theta is None:
        return dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", activation_function="gelu_new",
                    layer_norm_epsilon=config.norm_eps, n_ctx=config.block_size, n_positions=config.block_size,
                    n_embd=config.n_embd, n_head=config.n_head, n_layer=config.n_layer, vocab_size=config.vocab_size,
                    attn_pdrop=config.dropout, embd_pdrop=config.dropout, resid_pdrop=config.dropout,
                    tie_word_embeddings=config.tie_embeddings, torch_dtype=dtype, **ids)
    hf = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=config.n_embd,
              intermediate_size=config.mlp_hidden, num_hidden_layers=config.n_layer,
              num_attention_heads=config.n_head, num_key_value_heads=config.n_kv_head, head_dim=config.head_dim,
              hidden_act="silu", attention_bias=False, mlp_bias=False, attention_dropout=config.dropout,
              max_position_embeddings=config.block_size, rms_norm_eps=config.norm_eps, rope_theta=config.rope_theta,
              tie_word_embeddings=config.tie_embeddings, vocab_size=config.vocab_size, pretraining_tp=1,
              use_cache=True, torch_dtype=dtype, **ids)
    if config.rope_scaling:  # at the top level, as the hub's Llama 3.1 and 3.2 repositories write it
        factor, low, high, original = config.rope_scaling
        hf["rope_scaling"] = dict(factor=factor, low_freq_factor=low, high_freq_factor=high,
                                  original_max_position_embeddings=original, rope_type="llama3")
    if config.n_expert:  # Mixtral: Llama's blocks, each MLP n_expert experts; MixtralConfig has no bias or tp keys
        hf = {key: value for key, value in hf.items() if key not in ("attention_bias", "mlp_bias", "pretraining_tp")}
        hf.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=config.n_expert,
                  num_experts_per_tok=config.n_expert_per_token, sliding_window=None, output_router_logits=False)
    return hf


def stored_tensors(config, shapes):
    """{stored name: [(our parameter, the box of the stored tensor it fills, transposed)]}, in our parameters' order:
    hugging_face_box, which --init_from reads through, run for each whole parameter. GPT-2's c_attn is filled by
    query, key and value; wte's box stops at vocab_size, so the padding rows are left behind. Llama's q and k rows
    are written as they are: gpt.rotate pairs channel i with i + head_dim / 2, Hugging Face's rotate_half, so the
    import moved no row and the export moves none."""
    stored = {}
    for name, shape in shapes.items():
        name_there, box, transposed = hugging_face.hugging_face_box(name, [(0, n) for n in shape], config)
        stored.setdefault(name_there, []).append((name, box, transposed))
    return stored


def stored_shape(pieces):
    """The shape of a stored tensor: its parameters' boxes cover it."""
    return [max(box[d][1] for _, box, _ in pieces) for d in range(len(pieces[0][1]))]


def read_stored(found, pieces, dtype):
    """One stored tensor, whole, in dtype, from the checkpoint's pieces: each parameter's region that fills its box
    (the real rows of wte), read from the memory-mapped rank files."""
    tensor = torch.empty(stored_shape(pieces), dtype=dtype)
    for name, box, transposed in pieces:
        sizes = [stop - start for start, stop in box]
        ours = sizes[::-1] if transposed else sizes  # a Conv1D weight is our [out, in] transposed
        value = found.region(name, tuple((0, n) for n in ours), (0, math.prod(sizes))).view(ours)
        tensor[tuple(slice(start, stop) for start, stop in box)] = value.t() if transposed else value
    return tensor


def shard_plan(sizes, max_bytes):
    """Consecutive stored tensors grouped into files of at most max_bytes (a larger tensor alone in its own), as
    save_pretrained shards: [[name, ...], ...]."""
    files, used = [[]], 0
    for name, size in sizes.items():
        if files[-1] and used + size > max_bytes:
            files.append([])
            used = 0
        files[-1].append(name)
        used += size
    return files


def write_file(path, stored, found, dtype):
    """One output file of the stored tensors {name: pieces}: read, written, and dropped when this returns."""
    save_file({name: read_stored(found, pieces, dtype) for name, pieces in stored.items()}, path,
              metadata={"format": "pt"})


def export(found, to, dtype=torch.float32, max_shard_bytes=5 * 10**9, tokenizer=None):
    """Checkpoint `found` (checkpoint.Checkpoint) written into folder `to` in the Hugging Face format, with the run's
    tokenizer (prepare_data.get_tokenizer's; None: none). Returns the files written."""
    config = gpt.GPTConfig(**found.meta["config"])
    with torch.device("meta"):
        shapes = {name: tuple(param.shape) for name, param in gpt.GPT(config).named_parameters()}
    found.check(config, shapes)
    hf = hugging_face_config(config, str(dtype).removeprefix("torch."), token_ids(tokenizer))
    try:  # what --init_from reads back must be this model: a config Hugging Face cannot express is refused
        same = hugging_face.config_from_hugging_face(hf, config.block_size, config.dropout) == config
    except ValueError:
        same = False
    if not same:
        raise training.UsageError(f"{found.path!r} holds a model that none of GPT2LMHeadModel, LlamaForCausalLM "
                                  f"and MixtralForCausalLM computes ({found.meta['config']}): it cannot be exported")
    stored = stored_tensors(config, shapes)
    sizes = {name: math.prod(stored_shape(pieces)) * dtype.itemsize for name, pieces in stored.items()}
    prefix = "transformer." if config.rope_theta is None else ""  # GPT2LMHeadModel.save_pretrained()'s names
    files = shard_plan(sizes, max_shard_bytes)
    names = ["model.safetensors"] if len(files) == 1 else [f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
                                                           for k in range(len(files))]
    os.makedirs(to, exist_ok=True)
    for file, share in zip(names, files):
        write_file(os.path.join(to, file), {prefix + name: stored[name] for name in share}, found, dtype)
    if len(files) > 1:
        weight_map = {prefix + name: file for file, share in zip(names, files) for name in share}
        with open(os.path.join(to, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}, f, indent=2)
        names.append("model.safetensors.index.json")
    with open(os.path.join(to, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    return ["config.json", *names, *write_tokenizer(to, tokenizer, config.block_size)]


# ------------------------------------------------------------------------------------------------------------
# The tokenizer as tokenizer.json, which Hugging Face's tokenizers library (AutoTokenizer) reads: byte-level BPE,
# the tokens spelled in GPT-2's printable stand-ins for bytes, and the merges, which a tiktoken file leaves implicit.


def bpe_tokenizer(tokenizer):
    """(tiktoken's ranks {token bytes: id}, special tokens {text: id}, the splitting pattern) of a prepare_data.py
    tokenizer: GPT-2's and Llama 3's are tiktoken Encodings; bytes are 256 tokens never merged."""
    encoding = getattr(tokenizer, "encoding", None)
    if encoding is None:
        return {bytes([b]): b for b in range(256)}, {}, None
    return encoding._mergeable_ranks, encoding._special_tokens, encoding._pat_str  # private, but what built it


def token_ids(tokenizer):
    """config.json's bos_token_id and eos_token_id: <|begin_of_text|> and <|end_of_text|> (Llama 3), <|endoftext|>
    both (GPT-2, as the hub's gpt2 says), none (bytes, or no tokenizer)."""
    eos = getattr(tokenizer, "eot", None)
    return dict(bos=getattr(tokenizer, "bos", eos), eos=eos)


def byte_spelling():
    """GPT-2's printable stand-in for each byte (its bytes_to_unicode): byte-level BPE files spell tokens with them."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def merges(ranks):
    """(rank, left, right): the merge that makes each token of two bytes or more. BPE on its bytes with the tokens
    ranked before it ends in exactly two parts; a token it cannot reach (no two-token split ranks lower) gets none,
    and tiktoken never produces it either."""
    for token, rank in ranks.items():
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:
            best, i = min((ranks.get(a + b, math.inf), i) for i, (a, b) in enumerate(zip(parts, parts[1:])))
            if best >= rank:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) == 2:
            yield rank, parts[0], parts[1]


def write_tokenizer(folder, tokenizer, block_size):
    """tokenizer.json and tokenizer_config.json of the run's tokenizer: tiktoken's pattern splits the text, each piece
    becomes bytes, and a piece that is a token whole stays whole (ignore_merges), as tiktoken encodes; Llama 3's
    texts begin with <|begin_of_text|>. Returns the files written."""
    if tokenizer is None:
        return []
    ranks, special, pattern = bpe_tokenizer(tokenizer)
    bos = getattr(tokenizer, "bos", None)  # Llama 3's, which every text begins with
    spell = byte_spelling()
    text = lambda token: "".join(spell[b] for b in token)  # noqa: E731
    split = [{"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}] * bool(pattern)
    begin = [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}]
    first, second = [{"Sequence": {"id": "A", "type_id": 0}}], [{"Sequence": {"id": "B", "type_id": 1}}]
    named, ids = {value: key for key, value in special.items()}, token_ids(tokenizer)
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": block_size,
                "clean_up_tokenization_spaces": False, "bos_token": named.get(ids["bos"]),
                "eos_token": named.get(ids["eos"])}
    bpe = {
        "version": "1.0", "truncation": None, "padding": None, "normalizer": None,
        "added_tokens": [{"id": i, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for token, i in special.items()],
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": split + [
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": None if bos is None else {
            "type": "TemplateProcessing", "single": begin + first, "pair": begin + first + begin + second,
            "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [bos],
                                                     "tokens": ["<|begin_of_text|>"]}}},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": {text(token): rank for token, rank in ranks.items()},
                  "merges": [f"{text(left)} {text(right)}" for _, left, right in sorted(merges(ranks))]}}
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        json.dump(bpe, f, ensure_ascii=False)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(settings, f, indent=2)
    return ["tokenizer.json", "tokenizer_config.json"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=training.HelpFormatter)
    p.add_argument("--out_dir", required=True, help="a training run's --out_dir")
    p.add_argument("--step", type=int, default=None, help="export the checkpoint of this step (default: the latest)")
    p.add_argument("--to", required=True, help="the folder to write the model into")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the weights' type in the files (training keeps float32: that exports them exactly)")
    p.add_argument("--max_shard_size", type=byte_count, default="5GB",
                   help="the largest model file (5GB, 500MB, 20KB, bytes); a larger model is written in shards")
    p.add_argument("--data", default=None, help="prepared folder whose meta.json names the tokenizer (default: "
                                                "the run's --data)")
    args = p.parse_args(argv)
    path = (checkpoint.latest(args.out_dir) if args.step is None
            else os.path.join(args.out_dir, f"ckpt-{args.step:07d}"))
    if not (path and os.path.isdir(path)):
        saved = sorted(name for name in os.listdir(args.out_dir) if re.fullmatch(r"ckpt-\d{7}", name)) if (
            os.path.isdir(args.out_dir)) else []
        raise training.UsageError(f"no checkpoint{' ' + os.path.basename(path) if path else ''} in {args.out_dir!r} "
                                  f"(it holds {', '.join(saved) or 'none'}): pass a training run's --out_dir and "
                                  "one of its steps")
    if os.path.exists(os.path.join(args.to, "config.json")):
        raise training.UsageError(f"{args.to!r} already holds a model (config.json): choose another --to")
    found = checkpoint.Checkpoint(path)
    meta = prepare_data.load_meta(args.data or found.meta["args"]["data"])
    if meta["vocab_size"] != found.meta["config"]["vocab_size"]:
        raise training.UsageError(f"the checkpoint's vocabulary is {found.meta['config']['vocab_size']} tokens, "
                                  f"--data's tokenizer {meta['tokenizer']} has {meta['vocab_size']}: pass the --data "
                                  "it was trained on")
    try:  # tiktoken downloads GPT-2's files on first use; a Llama 3 tokenizer.model may have moved
        tokenizer = prepare_data.get_tokenizer(meta["tokenizer"])
    except (SystemExit, ValueError) as error:
        tokenizer = None
        print(f"no tokenizer files: {meta['tokenizer']} is unreadable here ({error}); the model is exported without "
              "them (GPT-2's are the hub's gpt2 repository's tokenizer.json and tokenizer_config.json)")
    files = export(found, args.to, getattr(torch, args.dtype), args.max_shard_size, tokenizer)
    shards = [file for file in files if file.startswith("model-")]
    if shards:  # one name for them all
        files = [f"{len(shards)} shards ({shards[0]} ...)" if file == shards[0] else file for file in files
                 if file not in shards[1:]]
    print(f"{path} (step {found.meta['step']}) -> {args.to}: {', '.join(files)} ({args.dtype}); load it with "
          f"transformers' AutoModelForCausalLM.from_pretrained({args.to!r}), or train on with --init_from {args.to}")


if __name__ == "__main__":
    training.run(main)
