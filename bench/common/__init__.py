"""What the bench/ scripts share, and the helpers tests share with them.

A bench script imports `xla_fsdp` and this package only: run as
`python bench/<script>.py`, bench/ is the script's folder and so first on
the import path. Tests reach it through tests/conftest.py.

- `aot_cases`: the shipped training programs as run_clm commands, and the
  ahead-of-time check run on one (`python -m xla_fsdp.aot --json`);
- `perf_rows`: one row of the TPU tables (bench/tpu_perf_table.py,
  blog_pairs.py, capacity.py): the engines' commands, the check's report as
  a row, the calibration;
- `tpu_slices`: the slices the projections use, from `xla_fsdp.tpu`'s chip table;
- `hlo_graph`, `hlo_trace` (and `hlo_trace_worker`): tracing a step's HLO on
  XLA:CPU device threads and reading its collectives and dependencies;
- `models`: the small GPT-2s and MLPs the parity tests and the traces build;
- `gloo`: a function run on a gloo world of processes;
- `gcs_requests`: the requests a local GCS emulator serves, counted;
- `placeholders`: meta parameters as torch_xla placeholders (the anchors' jobs);
- `examples`: a script of examples/ loaded by its path (its model classes).
"""
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "bench")
