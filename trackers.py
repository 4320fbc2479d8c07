"""
The optional experiment trackers, TensorBoard and Weights & Biases (--tensorboard, --wandb): each logged step's
record goes to them too. Imported only by a run that asks for one (training.Logger).
"""

import atexit
import importlib.util

from prepare_data import UsageError


def check(args):
    """Before anything is created: a tracker asked for whose package is missing is a one-line error."""
    for package in ("tensorboard", "wandb"):
        if getattr(args, package) and importlib.util.find_spec(package) is None:
            raise UsageError(f"--{package} needs the {package} package: pip install {package}")


class Trackers:
    """The trackers --tensorboard and --wandb ask for, writing into --out_dir."""

    def __init__(self, args):
        self.tensorboard = None
        self.wandb = None
        if args.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(args.out_dir)
        if args.wandb:
            import wandb

            self.wandb = wandb.init(project="gpt-parallel", config=vars(args), dir=args.out_dir)
        atexit.register(self.close)  # training.run runs the atexit functions before it ends the process

    def close(self):
        """TensorBoard's last events written, the W&B run finished."""
        if self.tensorboard:
            self.tensorboard.close()
        if self.wandb:
            self.wandb.finish()

    def log(self, record):
        """record: one logged step, as metrics.jsonl holds it (a value may be None: the MFU on CPU)."""
        if self.tensorboard:
            for key, value in record.items():
                if key != "step" and value is not None:
                    self.tensorboard.add_scalar(key, value, record["step"])
        if self.wandb:
            self.wandb.log(record, step=record["step"])
