"""
The corpora a training run does not need: tiny-shakespeare (a download), OpenWebText and FineWeb-Edu (the
Hugging Face hub) and local text (--input), tokenized through the `datasets` library.

prepare_data.py imports this file only when it prepares one of them. It imports no project module: each
function takes the tokenizer and a function that writes a split, and a bad input is a ValueError that
prepare_data.py reports as a one-line usage error.
"""

import itertools
import multiprocessing
import os
import socket
import tempfile
import urllib.request

import numpy as np

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
HF_DATASETS = {
    "openwebtext": dict(path="Skylion007/openwebtext"),
    "fineweb-edu": dict(path="HuggingFaceFW/fineweb-edu", name="sample-10BT"),
}
ROW_LINES = 64  # lines of --input text a row: one a row makes millions of rows, and datasets is slow per row
WRITE_BATCH_ROWS = 10_000  # rows of tokens per write
SKIPPED_SHOWN = 5  # skipped files named in the message
OFFLINE_OPTIONS = ("offline you can run `python prepare_data.py` (the embedded default corpus) "
                   "or `python prepare_data.py --input PATH --tokenizer byte` on local text files (gpt2's BPE "
                   "files are a download too)")


def check_network(host):
    """Fail at once, naming the offline options, instead of letting a download library retry for minutes."""
    try:
        socket.create_connection((host, 443), timeout=5).close()
    except OSError as error:
        raise ValueError(f"cannot reach {host} ({error}); {OFFLINE_OPTIONS}")


def prepare(name, path, tokenizer, num_proc, val_fraction, out_dir, write_split):
    """shakespeare, openwebtext, fineweb-edu, or "input" (the text at path), tokenized and handed to
    write_split(split, chunks). Returns the source meta.json names and {"train": tokens, "val": tokens}."""
    if name == "shakespeare":
        return "tiny-shakespeare", shakespeare(tokenizer, write_split)
    if name == "input":
        return os.path.abspath(path), local(path, tokenizer, num_proc, val_fraction, out_dir, write_split)
    return name, hub(name, tokenizer, num_proc, val_fraction, write_split)


def shakespeare(tokenizer, write_split):
    """tiny-shakespeare (1 MB, downloaded): the first 90% of its text trains, the rest validates."""
    with urllib.request.urlopen(SHAKESPEARE_URL, timeout=30) as response:
        text = response.read().decode("utf-8")
    cut = int(0.9 * len(text))
    counts = {}
    for split, part in (("train", text[:cut]), ("val", text[cut:])):
        counts[split] = write_split(split, [np.array(tokenizer.encode(part), dtype=tokenizer.dtype)])
    return counts


def tokenize_dataset(dataset, tokenizer, num_proc, val_fraction, source, write_split):
    """A datasets.Dataset with a "text" column, tokenized in num_proc processes and handed to
    write_split(name, chunks) in batches, so corpora larger than memory (OpenWebText: ~9B gpt2 tokens)
    stream through. Returns {"train": tokens, "val": tokens}."""
    import datasets
    import pyarrow.compute as pc
    from tqdm import tqdm

    if len(dataset) < 2:
        raise ValueError(f"{source}: {len(dataset)} row of text, too little to hold out a validation split")
    # The last rows are the validation split: rows stay in order (no shuffle, which makes every later read a
    # random access), so a row's neighbours in train.bin are its neighbours in the text.
    split = dataset.train_test_split(test_size=val_fraction, shuffle=False)
    end = [] if tokenizer.eot is None else [tokenizer.eot]

    def encode(batch):
        if tokenizer.name == "byte":  # an array straight from the bytes: 9x faster than a list of ints
            return {"ids": [np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.uint16) for text in batch["text"]]}
        return {"ids": [tokenizer.encode(text) + end for text in batch["text"]]}

    # The token files' type in the Arrow files already: each written batch is then one flat buffer of ids, no loop.
    features = datasets.Features({"ids": datasets.Sequence(datasets.Value(tokenizer.dtype))})
    counts = {}
    for name, part in (("train", split["train"]), ("val", split["test"])):
        part = part.map(encode, batched=True, features=features, remove_columns=part.column_names,
                        num_proc=min(num_proc, len(part)), desc=f"tokenizing {name}")
        batches = part.with_format("arrow").iter(batch_size=WRITE_BATCH_ROWS)
        batches = tqdm(batches, total=-(-len(part) // WRITE_BATCH_ROWS), desc=f"writing {name}.bin")
        chunks = (pc.list_flatten(batch["ids"]).to_numpy() for batch in batches)
        counts[name] = write_split(name, chunks)
    return counts


def hub(name, tokenizer, num_proc, val_fraction, write_split):
    """openwebtext or fineweb-edu from the Hugging Face hub (downloaded once into its cache), tokenized."""
    import datasets

    dataset = datasets.load_dataset(**HF_DATASETS[name], split="train", num_proc=num_proc)
    return tokenize_dataset(dataset, tokenizer, num_proc, val_fraction, name, write_split)


def not_text(path):
    """Why --input skips this file (a broken link, binary, not UTF-8, unreadable), or None for a text file."""
    if not os.path.isfile(path):
        return "broken link" if os.path.islink(path) else "not a regular file"
    try:
        with open(path, encoding="utf-8") as f:
            while block := f.read(1 << 20):
                if "\0" in block:
                    return "binary"
    except UnicodeDecodeError:
        return "not UTF-8 text"
    except OSError as error:
        return f"unreadable: {error.strerror}"
    return None


def read_rows(files):
    """The files' text, in order, in rows of up to ROW_LINES whole lines: the token stream is the files' text."""
    for path in files:
        with open(path, encoding="utf-8") as f:
            while row := "".join(itertools.islice(f, ROW_LINES)):
                yield {"text": row}


def text_files(path, num_proc):
    """The text files of --input: the file itself, or every file below the folder; the others are named."""
    if os.path.isdir(path):
        files = sorted(os.path.join(d, f) for d, _, names in os.walk(path) for f in names)
    elif os.path.isfile(path):
        files = [path]
    else:
        raise ValueError(f"--input {path!r}: no such file or folder")
    with multiprocessing.Pool(num_proc) as pool:
        reasons = dict(zip(files, pool.map(not_text, files, chunksize=16)))
    skipped = [f"{name} ({why})" for name, why in reasons.items() if why]
    if skipped:
        shown = ", ".join(skipped[:SKIPPED_SHOWN]) + (", ..." if len(skipped) > SKIPPED_SHOWN else "")
        print(f"--input: skipping {len(skipped)} of {len(files)} files, not readable as text: {shown}")
    texts = [name for name, why in reasons.items() if not why]
    if not texts:
        raise ValueError(f"--input {path!r}: no file readable as UTF-8 text in it" + (" (it is empty)" * (not files)))
    return texts


def local(path, tokenizer, num_proc, val_fraction, out_dir, write_split):
    """A text file, or a folder of them, tokenized. The rows are cached in a temporary folder inside out_dir,
    deleted at the end."""
    import datasets

    texts = text_files(path, num_proc)
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".cache-", dir=out_dir) as cache:
        dataset = datasets.Dataset.from_generator(read_rows, gen_kwargs={"files": texts}, cache_dir=cache,
                                                  num_proc=min(num_proc, len(texts)))
        return tokenize_dataset(dataset, tokenizer, num_proc, val_fraction, os.path.abspath(path), write_split)
