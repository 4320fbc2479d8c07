"""
Text -> train.bin / val.bin (token ids, one flat stream each: uint16, or uint32 for a vocabulary beyond 65,536, such
as Llama 3's) + meta.json.

    python prepare_data.py                       # offline default: the Python standard library's sources, bytes
    python prepare_data.py --dataset shakespeare             # tiny-shakespeare (download), gpt2 BPE
    python prepare_data.py --dataset openwebtext --num_proc 16
    python prepare_data.py --dataset fineweb-edu
    python prepare_data.py --input my_texts/ --tokenizer byte
    python prepare_data.py --input my_texts/ --tokenizer Llama-3.2-1B/original/tokenizer.model   # Llama 3's BPE

The training scripts memory-map the files (any size trains); meta.json, written last, marks a complete folder.
"""

import argparse
import functools
import json
import math
import os
import sys
import sysconfig
import time

import numpy as np


HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_DATA_DIR = os.path.join(HERE, "data", "default")  # the embedded corpus, built on first use


# ------------------------------------------------------------------------------------------------------------
# What every command line of the project shares (training.py imports it from here: this file needs no torch)


class UsageError(ValueError):
    """A flag, an input or a layout a script cannot run with: printed as one line, without a traceback."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are UsageErrors: one line from one rank, instead of the usage on every rank."""

    def error(self, message):
        raise UsageError(f"{message} (see --help)")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help keeps the docstring's examples as written and adds each flag's default once, where it has one."""

    def _get_help_string(self, action):
        shown = action.default not in (None, argparse.SUPPRESS, False, "\n")  # False: a store_true flag
        if shown and "default" not in action.help:
            return action.help + " (default: %(default)s)"
        return action.help


def checked(kind, test, requirement):
    """An argparse type: kind(text), refused with a message naming the requirement unless test(value)."""

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not test(value):
            raise argparse.ArgumentTypeError(f"must be {requirement}, not {text!r}")
        return value

    return parse


positive_int = checked(int, lambda n: n > 0, "a whole number > 0")
count = checked(int, lambda n: n >= 0, "a whole number >= 0")
positive = checked(float, lambda x: 0 < x < math.inf, "a number > 0")
non_negative = checked(float, lambda x: 0 <= x < math.inf, "a number >= 0")  # NaN fails every comparison
probability = checked(float, lambda x: 0 <= x < 1, "a probability in [0, 1)")
fraction = checked(float, lambda x: 0 < x < 1, "a number between 0 and 1")


# ------------------------------------------------------------------------------------------------------------
# Tokenizers: the one a corpus is prepared with is named in its meta.json, and a sample is decoded with it


def token_dtype(vocab_size):
    """The token files' integer type: uint16 while every id fits (GPT-2's 50,257), uint32 beyond (Llama 3's 128,256)."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, needs no files, never fails on any text."""
    name = "byte"
    vocab_size = 256
    dtype = token_dtype(vocab_size)
    eot = None

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class GPT2Tokenizer:
    """GPT-2's BPE through tiktoken; vocabulary 50257, documents separated by <|endoftext|>."""
    name = "gpt2"
    vocab_size = 50257
    dtype = token_dtype(vocab_size)

    def __init__(self):
        import tiktoken

        try:
            self.encoding = tiktoken.get_encoding("gpt2")
        except Exception as error:
            raise SystemExit(f"could not load tiktoken's gpt2 BPE files ({type(error).__name__}): they are downloaded "
                             "on first use. Set TIKTOKEN_CACHE_DIR to a folder that holds them, or use --tokenizer "
                             "byte: `python prepare_data.py` and `--input PATH --tokenizer byte` need no download")
        self.eot = self.encoding.eot_token

    def encode(self, text):
        return self.encoding.encode_ordinary(text)

    def decode(self, ids):
        return self.encoding.decode([i for i in ids if i < self.vocab_size])


class Llama3Tokenizer:
    """Llama 3's BPE from a checkpoint's original/tokenizer.model, a tiktoken file (a base64 token and its rank a
    line) read with tiktoken's loader, split with Llama 3's pattern, its 256 special tokens numbered after the file's
    ranks (128,000 + 256 = 128,256 in Meta's file), as Meta's llama3 tokenizer.py builds them. A text begins with
    <|begin_of_text|>, as Hugging Face's tokenizer encodes it; documents end with <|end_of_text|>."""
    PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
    SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
               "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
               "<|eot_id|>", "<|python_tag|>"]

    def __init__(self, path):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        ranks = load_tiktoken_bpe(path)
        reserved = [f"<|reserved_special_token_{i}|>" for i in range(2, 2 + 256 - len(self.SPECIAL))]
        special = {token: len(ranks) + i for i, token in enumerate(self.SPECIAL + reserved)}
        self.encoding = tiktoken.Encoding(os.path.basename(path), pat_str=self.PATTERN, mergeable_ranks=ranks,
                                          special_tokens=special)
        self.name = os.path.abspath(path)  # meta.json names the file: the sample after training decodes with it
        self.vocab_size = self.encoding.n_vocab
        self.dtype = token_dtype(self.vocab_size)
        self.bos, self.eot = special["<|begin_of_text|>"], special["<|end_of_text|>"]

    def __reduce__(self):  # pickled as its file's path: datasets hashes the tokenizer and sends it to its processes
        return Llama3Tokenizer, (self.name,)

    def encode(self, text):
        return [self.bos] + self.encoding.encode_ordinary(text)

    def decode(self, ids):
        return self.encoding.decode([i for i in ids if i < self.vocab_size])


def get_tokenizer(name):
    """byte, gpt2, or the path of a Llama 3 tokenizer.model."""
    if name == "byte":
        return ByteTokenizer()
    if name == "gpt2":
        return GPT2Tokenizer()
    if os.path.isfile(name):
        return Llama3Tokenizer(name)
    raise ValueError(f"unknown tokenizer {name!r}: use gpt2, byte or the path of a Llama 3 checkpoint's "
                     "original/tokenizer.model (no such file)")


# ------------------------------------------------------------------------------------------------------------
# Token files


def write_split(out_dir, split, chunks, dtype="uint16"):
    """Stream token arrays into out_dir/<split>.bin as dtype, under a temporary name until complete: the token count."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{split}.bin")
    count = 0
    with open(path + ".tmp", "wb") as f:
        for chunk in chunks:
            f.write(np.ascontiguousarray(chunk, dtype=dtype))
            count += len(chunk)
    os.replace(path + ".tmp", path)
    return count


def write_meta(out_dir, tokenizer, counts, source):
    meta = {"tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size, "dtype": tokenizer.dtype, "source": source,
            "train_tokens": counts["train"], "val_tokens": counts["val"]}
    with open(os.path.join(out_dir, "meta.json.tmp"), "w") as f:
        json.dump(meta, f, indent=2)
    os.replace(os.path.join(out_dir, "meta.json.tmp"), os.path.join(out_dir, "meta.json"))
    return meta


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
    counts = {split: write_split(out_dir, split, arrays) for split, arrays in splits.items()}
    meta = write_meta(out_dir, ByteTokenizer(), counts, f"python {sys.version.split()[0]} standard library sources")
    print(f"default corpus: {len(paths)} files from {root} -> {out_dir} "
          f"({meta['train_tokens']:,} train / {meta['val_tokens']:,} val tokens)")
    return meta


def load_meta(data_dir):
    path = os.path.join(data_dir, "meta.json")
    if not os.path.exists(path):
        raise UsageError(f"no prepared data in {data_dir!r} (meta.json missing): run "
                         f"`python prepare_data.py --out_dir {data_dir}` or pass --data with a prepared folder")
    with open(path) as f:
        return json.load(f)


def ensure_data(data_dir, is_writer, wait_s=600):
    """data_dir's meta. The default corpus is built on first use by one process a machine (is_writer); others wait."""
    if os.path.exists(os.path.join(data_dir, "meta.json")) or data_dir != DEFAULT_DATA_DIR:
        return load_meta(data_dir)  # raises with a message naming the fix
    if is_writer:
        prepare_default(data_dir)
    deadline = time.time() + wait_s
    while not os.path.exists(os.path.join(data_dir, "meta.json")):
        if time.time() > deadline:
            raise TimeoutError(f"waited {wait_s}s for another process to prepare {data_dir!r}")
        time.sleep(0.5)
    return load_meta(data_dir)


def main(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--dataset", choices=["default", "shakespeare", "openwebtext", "fineweb-edu"], default="default",
                   help="the corpus to prepare (default: the embedded one, this Python's standard library)")
    p.add_argument("--input", help="a local text file or folder of them, instead of --dataset; files that are not "
                   "UTF-8 text are skipped")
    p.add_argument("--tokenizer", default=None, help="gpt2, byte, or a Llama 3 checkpoint's original/tokenizer.model "
                   "(default: byte for the embedded corpus, gpt2 otherwise)")
    p.add_argument("--out_dir", default=None, help="default: data/<dataset>, or data/input, next to this file")
    p.add_argument("--num_proc", type=positive_int, default=os.cpu_count() or 1, help="processes that tokenize")
    p.add_argument("--val_fraction", type=fraction, default=0.005, help="share of the rows held out for validation")
    args = p.parse_args(argv)

    name = "input" if args.input else args.dataset
    out_dir = args.out_dir or os.path.join(HERE, "data", name)
    if name == "default":
        if args.tokenizer not in (None, "byte"):
            raise UsageError("the embedded default corpus uses the byte tokenizer; pass --input for another one on "
                             "local text")
        return prepare_default(out_dir)
    import corpora  # only for these corpora: they need the network, or `datasets`

    try:
        if not args.input:
            corpora.check_network("raw.githubusercontent.com" if name == "shakespeare" else "huggingface.co")
        tokenizer = get_tokenizer(args.tokenizer or "gpt2")
        write = functools.partial(write_split, out_dir, dtype=tokenizer.dtype)  # corpora.py streams each split here
        source, counts = corpora.prepare(name, args.input, tokenizer, args.num_proc, args.val_fraction, out_dir, write)
    except ValueError as error:  # a bad input: one line, as every usage error
        raise UsageError(str(error)) from None
    meta = write_meta(out_dir, tokenizer, counts, source)
    print(f"{name}: {meta['train_tokens']:,} train / {meta['val_tokens']:,} val tokens ({tokenizer.name}) -> {out_dir}")
    return meta


def run(main):
    """The command line: a UsageError is one line, `error: <message>`, and exit code 2 (argparse's)."""
    try:
        main()
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    run(main)
