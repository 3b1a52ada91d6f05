"""`python -m xla_fsdp.aot --tpu TYPE -- SCRIPT ...` (see xla_fsdp/aot/cli.py)."""
import sys

from xla_fsdp.aot.cli import main

sys.exit(main())
