"""
Sample from the latest checkpoint of a run of any layout (train_single, ddp, fsdp, tp, 2d or pp: they share one
checkpoint format), on one device, without training.

    python sample.py                                  # the newest checkpoint under out/, of whichever script wrote it
    python sample.py --out_dir out/gpt2-finetuned --prompt "ROMEO:" --sample_tokens 200 --temperature 0.8 --top_k 40
"""

import argparse
import os
from contextlib import nullcontext

import torch

import checkpoint
import gpt
import prepare_data
import training


RUNS = "out"  # where the training scripts' --out_dir defaults put their runs


def newest_run(runs=RUNS):
    """The run folder under `runs` whose latest checkpoint was published last (its `latest` was written then)."""
    folders = [os.path.join(runs, name) for name in os.listdir(runs)] if os.path.isdir(runs) else []
    published = [(os.path.getmtime(os.path.join(folder, "latest")), folder) for folder in folders
                 if os.path.isfile(os.path.join(folder, "latest"))]
    return max(published)[1] if published else None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=training.HelpFormatter)
    p.add_argument("--out_dir", help=f"a training run's --out_dir: its latest checkpoint is read (default: the run "
                                     f"under {RUNS}/ that saved last)")
    p.add_argument("--data", default=None, help="prepared folder whose meta.json names the tokenizer (default: "
                                                "the run's --data)")
    training.add_sampling_flags(p)
    p.add_argument("--seed", type=int, default=1337, help="seeds the sampling: the same seed, the same text")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda when available")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="bfloat16: autocast, float32 weights")
    args = p.parse_args(argv)
    training.check_sampling_flags(args)

    out_dir = args.out_dir or newest_run()
    path = out_dir and checkpoint.latest(out_dir)
    if not path:
        where = f"in {args.out_dir!r}" if args.out_dir else f"under {RUNS + '/'!r}"
        raise SystemExit(f"no checkpoint {where}: pass the --out_dir of a training run")
    saved = checkpoint.Checkpoint(path)
    newest = "" if args.out_dir else f", the newest under {RUNS}/ (--out_dir chooses another run)"
    print(f"checkpoint {path} (step {saved.meta['step']}){newest}")
    config = gpt.GPTConfig(**saved.meta["config"])
    meta = prepare_data.load_meta(args.data or saved.meta["args"]["data"])
    if meta["vocab_size"] != config.vocab_size:
        raise training.UsageError(f"the checkpoint's vocabulary is {config.vocab_size} tokens, --data's tokenizer "
                         f"{meta['tokenizer']} has {meta['vocab_size']}: pass the --data it was trained on")
    args.block_size = config.block_size  # the context it was trained with: training.sample keeps that many tokens
    device = training.get_device(args)

    # ---- model: built on meta, materialised on the device, every tensor whole from the pieces of any layout
    with torch.device("meta"):
        model = gpt.GPT(config)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty() gives each module its own tensor: tie them again
    checkpoint.load(saved, checkpoint.parameter_parts(model), None, config)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bfloat16" else nullcontext()
    training.sample(model, meta, args, device, autocast, show=True)


if __name__ == "__main__":
    training.run(main)
