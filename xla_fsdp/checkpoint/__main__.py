"""`python -m xla_fsdp.checkpoint consolidate CHECKPOINT_DIR OUT_DIR`."""
import sys

from .consolidate import main

sys.exit(main())
