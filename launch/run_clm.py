"""Train a GPT-2 causal language model with xla_fsdp.

Flag names are those of Hugging Face's run_clm.py, so the 2023 PyTorch/XLA
FSDP recipe's command line works unchanged:

    python launch/xla_spawn.py --num_cores 4 launch/run_clm.py \\
        --config_name configs/models/gpt2-tiny.json --fsdp full_shard \\
        --fsdp_config configs/fsdp/tiny_cpu.json --output_dir out/tiny-cpu

With no --dataset_name/--train_file it trains on Python's bundled reference
documentation with a byte-level tokenizer (no downloads). The pieces live in
xla_fsdp/train/ (args, data, model, loop, job).
"""
import sys

from xla_fsdp.train.job import run

# On a TPU, xla_spawn runs this job as one process driving every local chip (unpinned
# collectives that libtpu overlaps with compute); `xla_spawn --per_chip` runs one per chip.
XLA_FSDP_TPU_RUNTIME = "single_controller"


def main(argv=None):
    """Run the job with `argv` (default: sys.argv[1:]); returns the metrics dict."""
    return run(argv)


def _mp_fn(index):
    # xla_spawn.py calls this once per replica, with sys.argv set to our flags.
    main(sys.argv[1:])


if __name__ == "__main__":
    main()
