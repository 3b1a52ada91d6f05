"""run_clm's --report_to: where each logging step's record goes besides the log and metrics.json
([Note: one record per log] in loop.py). "tensorboard" writes Hugging Face's layout: event files under --logging_dir
(default OUTPUT_DIR/runs/<date>_<host>), one scalar per figure named train/<figure>; "none" (the default) writes
nothing. Only the process that writes metrics.json reports."""
from __future__ import annotations

import datetime
import os
import socket
from typing import Optional

SUPPORTED = ("none", "tensorboard")


def check(names) -> list:
    """The --report_to names, checked: an unknown one is a ValueError listing the supported."""
    names = list(names or ["none"])
    unknown = [n for n in names if n not in SUPPORTED]
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: not a reporter this job has; give one of {', '.join(SUPPORTED)} "
                         "(none: the log and metrics.json only)")
    if "none" in names and len(names) > 1:
        raise ValueError(f"{' '.join(names)}: 'none' with another reporter; give one or the other")
    return names


def logging_dir(args) -> str:
    """--logging_dir, or Hugging Face's default: OUTPUT_DIR/runs/<date>_<host>."""
    if args.logging_dir:
        return args.logging_dir
    stamp = datetime.datetime.now().strftime("%b%d_%H-%M-%S")
    return os.path.join(args.output_dir, "runs", f"{stamp}_{socket.gethostname()}")


class TensorBoard:
    """One record per logging step as TensorBoard scalars (torch's SummaryWriter)."""

    def __init__(self, folder: str):
        from torch.utils.tensorboard import SummaryWriter

        self.folder = folder
        self.writer = SummaryWriter(log_dir=folder)

    def __call__(self, record: dict) -> None:
        for name, value in record.items():
            if name != "step":
                self.writer.add_scalar(f"train/{name}", value, record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def open_reporter(args, leader: bool, say) -> Optional[TensorBoard]:
    """The reporter --report_to names (on the process that reports), or None."""
    if "tensorboard" not in args.report_to or not leader:
        return None
    reporter = TensorBoard(logging_dir(args))
    say(f"run_clm: TensorBoard events in {reporter.folder} (tensorboard --logdir {os.path.dirname(reporter.folder)})")
    return reporter
