"""
Text -> train.bin / val.bin (uint16 token ids, one flat stream each) + meta.json.

    python prepare_data.py                       # offline default: the Python standard library's sources, bytes
    python prepare_data.py --dataset shakespeare             # tiny-shakespeare (download), gpt2 BPE
    python prepare_data.py --dataset openwebtext --num_proc 16
    python prepare_data.py --dataset fineweb-edu
    python prepare_data.py --input my_texts/ --tokenizer byte

The training scripts read the files through np.memmap, so a corpus larger than memory trains fine.
meta.json is written last: its presence means the folder is complete.
"""

import json
import os
import socket
import sys
import sysconfig
import urllib.request

import numpy as np

from training import ArgumentParser, ByteTokenizer, HelpFormatter, UsageError, checked, get_tokenizer, positive_int, run

HERE = os.path.dirname(os.path.abspath(__file__))
SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
HF_DATASETS = {
    "openwebtext": dict(path="Skylion007/openwebtext"),
    "fineweb-edu": dict(path="HuggingFaceFW/fineweb-edu", name="sample-10BT"),
}
fraction = checked(float, lambda x: 0 < x < 1, "a number between 0 and 1")
OFFLINE_OPTIONS = ("offline you can run `python prepare_data.py` (the embedded default corpus) "
                   "or `python prepare_data.py --input PATH` on local text files")


def write_split(path, chunks, total):
    """Stream token arrays into a uint16 file of `total` tokens, under a temporary name until complete."""
    out = np.memmap(path + ".tmp", dtype=np.uint16, mode="w+", shape=(total,))
    position = 0
    for chunk in chunks:
        out[position:position + len(chunk)] = chunk
        position += len(chunk)
    out.flush()
    del out
    os.replace(path + ".tmp", path)


def write_meta(out_dir, tokenizer, counts, source):
    meta = {"tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size, "source": source,
            "train_tokens": counts["train"], "val_tokens": counts["val"]}
    with open(os.path.join(out_dir, "meta.json.tmp"), "w") as f:
        json.dump(meta, f, indent=2)
    os.replace(os.path.join(out_dir, "meta.json.tmp"), os.path.join(out_dir, "meta.json"))
    return meta


def write_arrays(out_dir, tokenizer, splits, source):
    """splits: {"train": [uint16 arrays], "val": [...]}, small enough to hold in memory."""
    os.makedirs(out_dir, exist_ok=True)
    counts = {}
    for split, arrays in splits.items():
        counts[split] = sum(len(a) for a in arrays)
        write_split(os.path.join(out_dir, f"{split}.bin"), arrays, counts[split])
    return write_meta(out_dir, tokenizer, counts, source)


def prepare_default(out_dir):
    """The embedded default: every .py file of the standard library of the Python running this (~30 MB),
    bytes as tokens. Every 50th file (in sorted order) is held out for validation."""
    root = sysconfig.get_paths()["stdlib"]
    paths = sorted(os.path.join(d, f) for d, dirs, files in os.walk(root) if "site-packages" not in d
                   for f in files if f.endswith(".py"))
    splits = {"train": [], "val": []}
    for i, path in enumerate(paths):
        with open(path, "rb") as f:
            data = f.read() + b"\n\n"
        splits["val" if i % 50 == 0 else "train"].append(np.frombuffer(data, dtype=np.uint8).astype(np.uint16))
    meta = write_arrays(out_dir, ByteTokenizer(), splits, f"python {sys.version.split()[0]} standard library sources")
    print(f"default corpus: {len(paths)} files from {root} -> {out_dir} "
          f"({meta['train_tokens']:,} train / {meta['val_tokens']:,} val tokens)")
    return meta


def check_network(host):
    """Fail at once, naming the offline options, instead of letting a download library retry for minutes."""
    try:
        socket.create_connection((host, 443), timeout=5).close()
    except OSError as error:
        raise UsageError(f"cannot reach {host} ({error}); {OFFLINE_OPTIONS}")


def prepare_shakespeare(out_dir, tokenizer):
    with urllib.request.urlopen(SHAKESPEARE_URL, timeout=30) as response:
        text = response.read().decode("utf-8")
    cut = int(0.9 * len(text))
    splits = {split: [np.array(tokenizer.encode(part), dtype=np.uint16)]
              for split, part in (("train", text[:cut]), ("val", text[cut:]))}
    return write_arrays(out_dir, tokenizer, splits, "tiny-shakespeare")


def tokenize_dataset(dataset, tokenizer, num_proc, out_dir, source, val_fraction):
    """A datasets.Dataset with a "text" column -> token files, tokenized in num_proc processes and written
    in batches, so corpora larger than memory (OpenWebText: ~9B gpt2 tokens) stream through."""
    from tqdm import tqdm

    split = dataset.train_test_split(test_size=val_fraction, seed=2357, shuffle=True)

    def encode(example):
        ids = tokenizer.encode(example["text"])
        if tokenizer.eot is not None:
            ids.append(tokenizer.eot)
        return {"ids": ids, "len": len(ids)}

    os.makedirs(out_dir, exist_ok=True)
    counts = {}
    for name, part in (("train", split["train"]), ("val", split["test"])):
        part = part.map(encode, remove_columns=part.column_names, num_proc=num_proc, desc=f"tokenizing {name}")
        counts[name] = int(np.sum(part["len"], dtype=np.uint64))
        shards = max(1, min(1024, len(part) // 1024))
        chunks = (np.concatenate(part.shard(shards, i, contiguous=True).with_format("numpy")["ids"]).astype(np.uint16)
                  for i in tqdm(range(shards), desc=f"writing {name}.bin"))
        write_split(os.path.join(out_dir, f"{name}.bin"), chunks, counts[name])
    return write_meta(out_dir, tokenizer, counts, source)


def prepare_hub(name, out_dir, tokenizer, num_proc, val_fraction):
    import datasets

    dataset = datasets.load_dataset(**HF_DATASETS[name], split="train", num_proc=num_proc)
    return tokenize_dataset(dataset, tokenizer, num_proc, out_dir, name, val_fraction)


def prepare_local(path, out_dir, tokenizer, num_proc, val_fraction):
    """A text file, or a folder of them (every file below it), through datasets' `text` loader: one line a
    row, and the newline put back, so the token stream is the files' text."""
    import datasets

    if os.path.isdir(path):
        files = sorted(os.path.join(d, f) for d, _, names in os.walk(path) for f in names)
    elif os.path.isfile(path):
        files = [path]
    else:
        raise UsageError(f"--input {path!r}: no such file or folder")
    if not files:
        raise UsageError(f"--input {path!r}: the folder holds no files")
    dataset = datasets.load_dataset("text", data_files=files, split="train", keep_linebreaks=True)
    return tokenize_dataset(dataset, tokenizer, num_proc, out_dir, os.path.abspath(path), val_fraction)


def main(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--dataset", choices=["default", "shakespeare", "openwebtext", "fineweb-edu"], default="default",
                   help="the corpus to prepare (default: the embedded one, this Python's standard library)")
    p.add_argument("--input", help="a local text file or folder of them, instead of --dataset")
    p.add_argument("--tokenizer", choices=["gpt2", "byte"], default=None,
                   help="default: byte for the embedded corpus, gpt2 otherwise")
    p.add_argument("--out_dir", default=None, help="default: data/<dataset>, or data/input, next to this file")
    p.add_argument("--num_proc", type=positive_int, default=max(1, (os.cpu_count() or 1) // 2),
                   help="processes that tokenize")
    p.add_argument("--val_fraction", type=fraction, default=0.005, help="share of the rows held out for validation")
    args = p.parse_args(argv)

    name = "input" if args.input else args.dataset
    out_dir = args.out_dir or os.path.join(HERE, "data", name)
    if name == "default":
        if args.tokenizer not in (None, "byte"):
            raise UsageError("the embedded default corpus uses the byte tokenizer; pass --input for gpt2 on local text")
        return prepare_default(out_dir)
    if not args.input:
        check_network("raw.githubusercontent.com" if name == "shakespeare" else "huggingface.co")
    tokenizer = get_tokenizer(args.tokenizer or "gpt2")
    if args.input:
        meta = prepare_local(args.input, out_dir, tokenizer, args.num_proc, args.val_fraction)
    elif name == "shakespeare":
        meta = prepare_shakespeare(out_dir, tokenizer)
    else:
        meta = prepare_hub(name, out_dir, tokenizer, args.num_proc, args.val_fraction)
    print(f"{name}: {meta['train_tokens']:,} train / {meta['val_tokens']:,} val tokens ({tokenizer.name}) -> {out_dir}")
    return meta


if __name__ == "__main__":
    run(main)
