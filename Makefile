# The two README commands: `make demo` and `make test`. Both build the environments first.
SHELL := /bin/bash
.DEFAULT_GOAL := help
PYTEST_ARGS ?=

.PHONY: help setup demo test test-fast test-main test-cai docs bench bench-scale fuzz mutants clean

help:
	@echo "make demo   - train a tiny Llama under DeepSpeed ZeRO-3, export, verify, reload"
	@echo "make test   - the whole test suite (both environments)"
	@echo "make test-fast - every test that needs no engine run (a few minutes; an engine launch fails it)"
	@echo "make mutants - break each guard in turn (tests/mutants.toml) in a scratch copy; a test must fail"
	@echo "make setup  - build .venv and .venv-cai (idempotent)"
	@echo "make docs   - build the documentation site (mkdocs --strict) into site/"
	@echo "make bench  - benchmark hf-ckpt export against zero_to_fp32.py, and save-time hooks against"
	@echo "              save_pretrained under ZeRO-2/3, and plan cost against the rank count on"
	@echo "              synthetic 8..1,024-rank saves, and FSDP2/DCP export against dcp_to_torch_save,"
	@echo "              accelerate merge-weights and consolidate_safetensors_files (not part of make test)"
	@echo "make bench-scale - export 1, 5 and 20 GB synthetic saves (ZeRO-3, DCP, per-rank files, universal)"
	@echo "              against cp of the same bytes, cold and warm, and the 1,024-rank MoE plan simulation;"
	@echo "              needs root (drops the page cache), ~45 GB free under BENCH_SCRATCH and about an hour"
	@echo "make fuzz   - the hostile-input fuzz tests with many more cases than make test runs"

setup:
	@scripts/setup-venv.sh .venv requirements/main.txt
	@scripts/setup-venv.sh .venv-cai requirements/cai.txt requirements/cai-nodeps.txt

demo: setup
	.venv/bin/python demo/run_demo.py

test: setup test-main test-cai docs

# No engine run: tests that get one through the engine_ckpt fixture are marked `engine` by
# tests/conftest.py, and HFCKPT_NO_ENGINE makes any launch that slips through fail loudly.
test-fast: setup
	HFCKPT_NO_ENGINE=1 .venv/bin/python -m pytest tests -m "not engine" -q -ra --durations=10 $(PYTEST_ARGS)

test-main:
	.venv/bin/python -m pytest tests -ra --durations=15 $(PYTEST_ARGS)

# .venv-cai (transformers 4.51.3): the ColossalAI tests, and the save-time hooks again on that line.
CAI_TESTS := tests/cai tests/test_trainer_callback.py tests/test_accelerate_hooks.py tests/test_peft.py
test-cai:
	.venv-cai/bin/python -m pytest $(CAI_TESTS) -ra --durations=10 $(PYTEST_ARGS)

docs: setup
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet -d site

bench: setup
	.venv/bin/python benchmarks/export_bench.py
	.venv/bin/python benchmarks/save_bench.py
	.venv/bin/python benchmarks/scale_bench.py
	.venv/bin/python benchmarks/dcp_bench.py

# Not part of make test or make bench: it writes ~45 GB at its peak. BENCH_SCRATCH must be on the
# disk to measure (not tmpfs); what it generates there is removed after each size.
BENCH_SCRATCH ?= .bench-cache/disk-scratch
bench-scale: setup
	.venv/bin/python benchmarks/disk_bench.py --scratch $(BENCH_SCRATCH) --sizes 1,5,20 --rounds 3 --parallel 2
	.venv/bin/python benchmarks/disk_bench.py --scratch $(BENCH_SCRATCH) --sizes 5 --layouts dcp --rounds 3 \
		--parallel 2 --shard 1GB --tag=-par --peer-max-gb 0 --doc
	.venv/bin/python benchmarks/scale_bench.py --moe --rounds 1

fuzz: setup
	HFCKPT_FUZZ_EXAMPLES=$${HFCKPT_FUZZ_EXAMPLES:-5000} .venv/bin/python -m pytest tests/test_fuzz.py $(wildcard tests/test_fuzz_*.py) -q

mutants: setup
	.venv/bin/python scripts/mutants.py $(MUTANTS_ARGS)

clean:
	rm -rf .venv .venv-cai .test-cache site
