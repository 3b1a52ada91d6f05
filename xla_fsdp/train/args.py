"""Flags of run_clm: the names Hugging Face's run_clm.py users already type.

Plain argparse, no HF Trainer. Boolean-valued flags accept the HF spellings (`--do_train`, `--do_train true`,
`--adafactor false`). Unknown flags are an error naming the flag, so a typo never silently trains with a default."""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import re

from xla_fsdp.runtime import environment

FSDP_TOKENS = {"full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "auto_wrap"}
STRATEGY_OF_TOKEN = {"full_shard": "FULL_SHARD", "shard_grad_op": "SHARD_GRAD_OP", "no_shard": "NO_SHARD",
                     "hybrid_shard": "HYBRID_SHARD"}
OPTIMIZERS = ("adamw", "adamw_torch", "adafactor")
# Above this many parameters the model is built deferred, so no host holds the full unsharded fp32 model at once (the
# 2023 recipe ran hosts out of memory).
DEFERRED_INIT_PARAMS = 1_000_000_000
# transformers' two without extra kernels, and torch_xla's Pallas flash-attention kernel on a TPU (xla_fsdp/attention;
# docs/attention.md)
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "pallas")


def str2bool(text: str) -> bool:
    low = str(text).strip().lower()
    if low in ("true", "1", "yes", "y"):
        return True
    if low in ("false", "0", "no", "n"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _bool_flag(parser, name: str, help: str, default: bool = False) -> None:
    # nargs="?" lets both `--do_train` and `--do_train true` work, as in HF.
    parser.add_argument(name, type=str2bool, nargs="?", const=True, default=default, help=help)


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        """One line, `run_clm.py: error: ...`, exit 2: argparse's own message without the usage block, which for
        run_clm's flags fills a screen above the line that matters."""
        # argparse says "unrecognized arguments: --foo"; keep that, add the fix.
        if "unrecognized arguments" in message:
            message += " (not a run_clm flag; see --help for the accepted flags)"
        self.exit(2, f"{self.prog}: error: {message}\n")


# [Note: run_clm's ranges] Each numeric flag's valid range, checked once in parse_args before any file is read or the
# XLA runtime starts: flag -> (test, what the flag needs). None (not given) always passes. A value outside it would end
# the job late (a ZeroDivisionError in the batching, torch's optimizer complaining about "lr") or never (a negative
# weight decay trains).
RANGES = {
    "per_device_train_batch_size": (lambda v: v >= 1, "at least 1 (sequences per device per step)"),
    "per_device_eval_batch_size": (lambda v: v >= 1, "at least 1 (sequences per device per eval step)"),
    "gradient_accumulation_steps": (lambda v: v >= 1, "at least 1"),
    "block_size": (lambda v: v >= 1, "at least 1 (tokens per sequence)"),
    "max_train_samples": (lambda v: v >= 1, "at least 1 (training blocks)"),
    "num_train_epochs": (lambda v: math.isfinite(v) and v > 0, "a positive number of epochs"),
    "max_steps": (lambda v: v == -1 or v >= 1, "a positive step count, or -1 to train --num_train_epochs"),
    "learning_rate": (lambda v: math.isfinite(v) and v >= 0, "a finite number, 0 or more (e.g. 5e-5)"),
    "weight_decay": (lambda v: math.isfinite(v) and v >= 0, "a finite number, 0 or more"),
    "warmup_steps": (lambda v: v >= 0, "0 or more"),
    "max_grad_norm": (lambda v: math.isfinite(v) and v >= 0, "a finite number, 0 or more (0 disables clipping)"),
    "logging_steps": (lambda v: v >= 1, "positive"),
    "save_steps": (lambda v: v >= 1, "positive"),
    "save_total_limit": (lambda v: v >= 1, "at least 1"),
    "peak_tflops": (lambda v: math.isfinite(v) and v > 0, "a positive number of TFLOPS per chip"),
    "preemption_grace_s": (lambda v: math.isfinite(v) and v > 0, "a positive number of seconds"),
}


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="run_clm.py", allow_abbrev=False,
                description="Train a GPT-2 or Llama causal LM with xla_fsdp (HF run_clm.py flag names).")
    for add_group in (_model_flags, _data_flags, _training_flags, _reporting_flags):
        add_group(p)
    return p


def _model_flags(p: argparse.ArgumentParser) -> None:
    model = p.add_argument_group("model")
    model.add_argument("--config_name", required=True,
                       help="transformers config JSON: GPT-2 or Llama (model_type gpt2 / llama)")
    model.add_argument("--tokenizer_name", default=None,
                       help="HF tokenizer name or local dir; default: byte-level tokenizer (257 ids)")
    model.add_argument("--cache_dir", default=None, help="cache for HF datasets/tokenizers")
    _bool_flag(model, "--deferred_init",
               f"build the model deferred (automatic above {DEFERRED_INIT_PARAMS:.0e} parameters)")
    _bool_flag(model, "--gradient_checkpointing", "recompute activations in backward")
    _bool_flag(model, "--bf16", "bfloat16 autocast for forward/backward")
    _bool_flag(model, "--fused_loss", "the training loss fused with the output projection, a chunk of tokens "
               "at a time: the [tokens, vocab] logits are never built ([Note: fused output loss] in "
               "xla_fsdp/loss/fused_cross_entropy.py). On the TPU programs compiled so far it was no better "
               "(2B GPT-2 v4-8) or worse (Llama 3 8B v6e-256: out of HBM): docs/performance.md. "
               "Default: transformers' own head and loss")
    model.add_argument("--attn_implementation", default=None, choices=ATTN_IMPLEMENTATIONS,
                       help="the model's attention (transformers' name); default: transformers' own choice (sdpa). "
                            "On a TPU prefer eager ([Note: eager attention on XLA] in xla_fsdp/train/model.py) "
                            "or pallas: torch_xla's Pallas flash-attention kernel, TPU only, no attention "
                            "dropout (docs/attention.md)")


def _data_flags(p: argparse.ArgumentParser) -> None:
    data = p.add_argument_group("data")
    data.add_argument("--dataset_name", default=None, help="HF dataset (needs `datasets`)")
    data.add_argument("--dataset_config_name", default=None)
    data.add_argument("--train_file", default=None, help="local plain-text file")
    data.add_argument("--block_size", type=int, default=None,
                      help="tokens per sequence; default min(n_positions / max_position_embeddings, 1024)")
    data.add_argument("--max_train_samples", type=int, default=None, help="cap on training blocks")

    fsdp = p.add_argument_group("fsdp")
    fsdp.add_argument("--fsdp", default="",
                      help='space-separated: full_shard|shard_grad_op|no_shard|hybrid_shard [auto_wrap]')
    fsdp.add_argument("--fsdp_config", default=None, help="HF fsdp_config JSON file")


def _training_flags(p: argparse.ArgumentParser) -> None:
    train = p.add_argument_group("training")
    train.add_argument("--output_dir", required=True)
    _bool_flag(train, "--overwrite_output_dir", "allow a non-empty --output_dir")
    _bool_flag(train, "--do_train", "train (default when neither --do_train nor --do_eval is given)")
    _bool_flag(train, "--do_eval", "evaluate on the held-out split (same default)")
    train.add_argument("--per_device_train_batch_size", type=int, default=8)
    train.add_argument("--per_device_eval_batch_size", type=int, default=8)
    train.add_argument("--num_train_epochs", type=float, default=None,
                       help="default 3 (HF) with --dataset_name/--train_file; 1 on the embedded corpus")
    train.add_argument("--max_steps", type=int, default=-1, help="overrides --num_train_epochs when > 0")
    train.add_argument("--gradient_accumulation_steps", type=int, default=1,
                       help="micro-batches per optimizer step (each of --per_device_train_batch_size per device)")
    train.add_argument("--optim", choices=OPTIMIZERS, default="adamw_torch")
    train.add_argument("--adafactor", type=str2bool, nargs="?", const=True, default=False,
                       help="legacy HF switch: same as --optim adafactor")
    train.add_argument("--learning_rate", type=float, default=None,
                       help="default 5e-5 (HF) with --dataset_name/--train_file; "
                            "1e-3 on the embedded corpus, where the demo must learn within minutes")
    train.add_argument("--weight_decay", type=float, default=0.0)
    train.add_argument("--warmup_steps", type=int, default=0)
    train.add_argument("--max_grad_norm", type=float, default=1.0, help="0 disables clipping")
    train.add_argument("--seed", type=int, default=42)


def _reporting_flags(p: argparse.ArgumentParser) -> None:
    report = p.add_argument_group("reporting")
    report.add_argument("--logging_strategy", choices=("no", "steps", "epoch"), default="steps")
    report.add_argument("--logging_steps", type=int, default=10,
                        help="log loss, tokens/s, step time and MFU every N steps (HF default 500 "
                             "is too sparse for the short CPU runs this job is mostly used for)")
    report.add_argument("--save_strategy", choices=("no", "steps", "epoch"), default="no",
                        help="sharded checkpoints (model, optimizer, scheduler, RNG, data position) "
                             "into OUTPUT_DIR/checkpoint-<step>")
    report.add_argument("--save_steps", type=int, default=500)
    report.add_argument("--save_total_limit", type=int, default=None, help="keep only the newest N checkpoints")
    report.add_argument("--preemption_grace_s", type=float, default=25.0, metavar="S",
                        help="after SIGTERM the job saves a checkpoint at the end of the step and exits 75; a "
                             "second signal within S seconds does not cut the save short (Cloud TPU spot VMs "
                             "give about 30 s: xla_fsdp/checkpoint/preemption.py)")
    _bool_flag(report, "--save_async", "write each checkpoint's files beside the next steps: the step that saves "
               "only waits for the copy to host memory; the next save and the job's end wait for the files "
               "(false: every save waits for its files)", default=True)
    report.add_argument("--report_to", nargs="+", default=["none"], metavar="NAME",
                        help="where each logging step's figures go besides the log and metrics.json: "
                             "tensorboard (events under --logging_dir) or none")
    report.add_argument("--logging_dir", default=None,
                        help="TensorBoard's folder (default OUTPUT_DIR/runs/<date>_<host>, as Hugging Face's)")
    report.add_argument("--profile_steps", default=None, metavar="A-B",
                        help="torch_xla's profiler trace of steps A to B into OUTPUT_DIR/profile (TensorBoard's "
                             "Profile tab, xprof); host 0 only unless --profile_all_hosts")
    _bool_flag(report, "--profile_all_hosts", "with --profile_steps: every host writes OUTPUT_DIR/profile/host-<i>")
    report.add_argument("--resume_from_checkpoint", default=None,
                        help="a checkpoint-<step> directory, or 'auto' for the newest complete one in "
                             "--output_dir (none: start fresh)")
    _bool_flag(report, "--mfu_include_attention", "add 12·L·d·S FLOPs/token for attention to MFU")
    report.add_argument("--compile_cache", default=None, metavar="DIR",
                        help="keep compiled programs in DIR so a restarted or resumed job compiles nothing; "
                             f"default: compile_cache/ under a local --output_dir (${environment.COMPILE_CACHE} when "
                             "set); 'off' disables it (xla_fsdp/runtime/compile_cache.py)")
    report.add_argument("--peak_tflops", type=float, default=None,
                        help="override the per-chip peak (dense bf16 TFLOPS) used for MFU")


def parse_fsdp(text: str) -> tuple[str | None, bool]:
    """`--fsdp "full_shard auto_wrap"` -> ("FULL_SHARD", True); "" -> (None, False)."""
    tokens = text.split()
    unknown = [t for t in tokens if t not in FSDP_TOKENS]
    if unknown:
        raise SystemExit(f"--fsdp {text!r}: unknown option(s) {unknown}; "
                         f"use one of {sorted(STRATEGY_OF_TOKEN)} optionally with auto_wrap")
    strategies = [STRATEGY_OF_TOKEN[t] for t in tokens if t in STRATEGY_OF_TOKEN]
    if len(strategies) > 1:
        raise SystemExit(f"--fsdp {text!r} names {len(strategies)} sharding strategies; give one")
    if not strategies and tokens:
        strategies = ["FULL_SHARD"]  # bare "auto_wrap" means full sharding, as in HF
    return (strategies[0] if strategies else None), "auto_wrap" in tokens


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and resolve run_clm flags; errors exit with a message naming the flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.adafactor:
        args.optim = "adafactor"
    if args.dataset_name and args.train_file:
        parser.error("give --dataset_name or --train_file, not both")
    if not (args.do_train or args.do_eval):
        args.do_train = args.do_eval = True
    # The embedded corpus is the no-argument demo (`make train`): it must show the loss falling within minutes on a
    # 2-core CPU, so it gets a higher learning rate and one epoch (~110 steps at 4 devices x 8 x 128 tokens). Real
    # datasets keep Hugging Face's defaults.
    embedded = not (args.dataset_name or args.train_file)
    if args.learning_rate is None:
        args.learning_rate = 1e-3 if embedded else 5e-5
    if args.num_train_epochs is None:
        args.num_train_epochs = 1.0 if embedded else 3.0
    for flag in ("config_name", "fsdp_config", "cache_dir"):  # read by transformers/json/datasets: local only
        value = getattr(args, flag)
        if value and _URL.match(value):
            parser.error(f"--{flag} {value}: a URL; this flag takes a local path (copy the file down first, "
                         f"e.g. gcloud storage cp {value} .)")
    if not os.path.isfile(args.config_name):
        parser.error(f"--config_name {args.config_name}: no such file; give a GPT-2 or Llama config JSON "
                     f"(e.g. configs/models/gpt2-tiny.json, configs/models/llama-tiny.json)")
    if args.fsdp_config and not os.path.isfile(args.fsdp_config):
        parser.error(f"--fsdp_config {args.fsdp_config}: no such file")
    from xla_fsdp.train import report_to

    try:
        args.report_to = report_to.check(args.report_to)
    except ValueError as e:
        parser.error(f"--report_to {e}")
    if args.profile_steps is not None:
        from xla_fsdp.profiling import parse_range

        try:
            args.profile_steps = parse_range(args.profile_steps)
        except ValueError as e:
            parser.error(f"--profile_steps {e}")
    for flag, (ok, needs) in RANGES.items():  # the first flag outside its range ([Note: run_clm's ranges])
        value = getattr(args, flag)
        if value is not None and not ok(value):
            parser.error(f"--{flag} {value:g}: must be {needs}")
    if args.dataset_name and not _installed("datasets"):
        parser.error(f"--dataset_name {args.dataset_name} needs the `datasets` package, not installed here: "
                     "pip install datasets (requirements.txt pins it; tpu_scripts/install.sh installs it); or omit "
                     "it to train on the embedded corpus (or use --train_file)")
    if args.train_file and not _URL.match(args.train_file) and not os.path.isfile(args.train_file):
        parser.error(f"--train_file {args.train_file}: no such file; give a local plain-text file (or a "
                     "gs:// URL), or omit it to train on the embedded corpus")
    if args.resume_from_checkpoint not in (None, "auto"):
        problem = _resume_problem(args.resume_from_checkpoint)
        if problem:
            parser.error(f"--resume_from_checkpoint {args.resume_from_checkpoint}: {problem}")
    args.sharding_strategy, args.auto_wrap = parse_fsdp(args.fsdp)
    return args


def _installed(package: str) -> bool:
    """Whether `package` can be imported, found without importing it (datasets loads pyarrow)."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules (blocked)
        return False


_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")  # as xla_fsdp/checkpoint/filesystems.py spells a URL


def _resume_problem(path: str):
    """Why `path` cannot be resumed from (None: it can), read through its storage, so a URL
    (gs://bucket/run/checkpoint-8) is checked in its bucket, not on the local disk."""
    from xla_fsdp.checkpoint import format as fmt
    from xla_fsdp.checkpoint import storage

    try:
        st = storage.storage_for(path)
        storage.check_bucket(path)
    except (ImportError, ValueError, FileNotFoundError) as e:
        return str(e)
    if not st.isdir(path):
        return "no such directory (give a checkpoint-<step> folder, or 'auto')"
    if not fmt.is_complete(path):
        return (f"not a complete checkpoint (no {fmt.COMPLETE} marker: its save did not finish); "
                "give an earlier checkpoint-<step>, or 'auto' for the newest complete one")
    return None
