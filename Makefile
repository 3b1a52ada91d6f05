# Two entry points: `make train` (the main job on the embedded default) and
# `make test` (the suite). Both create and fill .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
NUM_CORES ?= 4

.PHONY: install bytecode train test lint bench clean

$(VENV)/.installed: requirements.txt requirements-test.txt setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -r requirements-test.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

install: $(VENV)/.installed

# Bytecode for the repository's own modules: pip compiles installed packages', but this
# checkout's are imported in place, and where PYTHONDONTWRITEBYTECODE is set every process
# (each test's subprocesses, the check's traced child) would compile them again.
bytecode: install
	$(PY) -m compileall -q xla_fsdp launch bench tests > /dev/null

# Both start with the host's faster malloc where it has one (jemalloc or tcmalloc; XLA_FSDP_MALLOC=system
# keeps glibc's): [Note: libtpu's compile and the host's malloc] in xla_fsdp/runtime/allocator.py.
MALLOC = malloc=$$($(PY) xla_fsdp/runtime/allocator.py) && env $$malloc

train: bytecode
	$(MALLOC) PJRT_DEVICE=CPU $(PY) launch/xla_spawn.py --num_cores $(NUM_CORES) launch/run_clm.py \
	  --config_name configs/models/gpt2-tiny.json --fsdp full_shard \
	  --fsdp_config configs/fsdp/tiny_cpu.json --output_dir out/tiny-cpu --overwrite_output_dir

test: bytecode
	$(MALLOC) PJRT_DEVICE=CPU $(PY) -m pytest -q -n 2 --dist loadfile --durations=25 tests

# The linter on the whole tree (ruff.toml); the suite runs it too (tests/test_lint.py).
lint: install
	$(VENV)/bin/ruff check xla_fsdp launch tests bench examples

clean:
	rm -rf $(VENV) out
