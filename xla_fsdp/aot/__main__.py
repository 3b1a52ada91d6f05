"""`python -m xla_fsdp.aot --tpu TYPE -- SCRIPT ...` (see xla_fsdp/aot/cli.py)."""
import sys

from xla_fsdp.runtime import allocator

try:  # [Note: libtpu's compile and the host's malloc]: start again with a faster allocator
    allocator.restart_with([sys.executable, "-m", "xla_fsdp.aot", *sys.argv[1:]])
except allocator.AllocatorError as e:
    print(f"xla_fsdp.aot: {e}", file=sys.stderr)
    sys.exit(2)

from xla_fsdp.aot.cli import main  # noqa: E402

sys.exit(main())
