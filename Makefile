# The two README commands: `make demo` and `make test`. Both build the environments first.
SHELL := /bin/bash
.DEFAULT_GOAL := help
PYTEST_ARGS ?=

.PHONY: help setup demo test test-fast test-main test-cai docs notebooks bench bench-scale bench-megatron fuzz mutants clean gpu-check

help:
	@echo "make demo   - train a tiny Llama under DeepSpeed ZeRO-3, export, verify, reload"
	@echo "make test   - the whole test suite (both environments)"
	@echo "make test-fast - every test that needs no engine run (a few minutes; an engine launch fails it)"
	@echo "make mutants - break each guard in turn (tests/mutants.toml) in a scratch copy; a test must fail"
	@echo "make setup  - build .venv and .venv-cai (idempotent)"
	@echo "make docs   - build the documentation site (mkdocs --strict) into site/"
	@echo "make notebooks - run the notebooks headless, each in its venv; executed copies with outputs in"
	@echo "              build/notebooks/ (git-ignored; the committed notebooks stay without outputs)"
	@echo "make bench  - benchmark hf-ckpt export against zero_to_fp32.py, and save-time hooks against"
	@echo "              save_pretrained under ZeRO-2/3, and plan cost against the rank count on"
	@echo "              synthetic 8..1,024-rank saves, and FSDP2/DCP export against dcp_to_torch_save,"
	@echo "              accelerate merge-weights and consolidate_safetensors_files (not part of make test)"
	@echo "make bench-scale - export 1, 5 and 20 GB synthetic saves (ZeRO-3 zip and legacy, DCP, per-rank files, universal)"
	@echo "              against cp of the same bytes, cold and warm, and the 1,024-rank MoE plan simulation"
	@echo "              (ZeRO-3, per-rank files at 8 and 64 ranks in one process against worker processes, and"
	@echo "              torch DCP at 8 and 16 ranks);"
	@echo "              needs root (drops the page cache), ~45 GB free under BENCH_SCRATCH and about an hour"
	@echo "make bench-megatron - export a Megatron-Core torch_dist save against slime's converter and mbridge"
	@echo "              (MBRIDGE=DIR holding mbridge's package; without it, slime only; not part of make test)"
	@echo "make fuzz   - the hostile-input fuzz tests with many more cases than make test runs"
	@echo "make gpu-check - every save-time path on real GPUs with NCCL (needs CUDA; not part of make test)"

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
CAI_TESTS := tests/cai tests/integrations/test_trainer_callback.py tests/integrations/test_accelerate_hooks.py tests/peft/test_peft.py
test-cai:
	.venv-cai/bin/python -m pytest $(CAI_TESTS) -ra --durations=10 $(PYTEST_ARGS)

docs: setup
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet -d site

# NB=doctor.ipynb runs one notebook; NB_ARGS=--cell-timeout=900 on a loaded machine.
notebooks: setup
	.venv/bin/python scripts/run_notebooks.py $(NB_ARGS) $(NB)

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
	.venv/bin/python benchmarks/scale_bench.py --rank-files --ranks 8,64 --rounds 3
	.venv/bin/python benchmarks/scale_bench.py --dcp --ranks 8,16 --rounds 3

# hf-ckpt export of a real Megatron-Core 0.16.1 torch_dist save (~0.9 GB) against slime's converter
# (benchmarks/peers/slime) and mbridge (MBRIDGE=DIR: its package, never installed into .venv; GitHub main:
# PyPI 0.15.1 fails on transformers 5). Not part of make test or make bench.
MBRIDGE ?=
bench-megatron: setup
	.venv/bin/python benchmarks/megatron_bench.py --layers 32 $(if $(MBRIDGE),--mbridge $(MBRIDGE)) $(BENCH_ARGS)

fuzz: setup
	HFCKPT_FUZZ_EXAMPLES=$${HFCKPT_FUZZ_EXAMPLES:-5000} .venv/bin/python -m pytest tests/trust/test_fuzz.py $(wildcard tests/trust/test_fuzz_*.py) -q

mutants: setup
	.venv/bin/python scripts/mutants.py $(MUTANTS_ARGS)

clean:
	rm -rf .venv .venv-cai .test-cache site

# Every save-time path on real GPUs with NCCL (scripts/gpu_check.py): one process (world 1), then one
# per GPU when there are two or more. Not part of `make test`; needs CUDA. Summary in gpu-check/.
GPU_PYTHON ?= .venv/bin/python
gpu-check:
	@n=$$($(GPU_PYTHON) -c 'import torch; print(torch.cuda.device_count())'); \
	if [ "$$n" -lt 1 ]; then echo "gpu-check: no CUDA device here" >&2; exit 2; fi; \
	$(GPU_PYTHON) -m torch.distributed.run --standalone --nproc_per_node=1 scripts/gpu_check.py gpu-check || rc=1; \
	if [ "$$n" -ge 2 ]; then \
	  $(GPU_PYTHON) -m torch.distributed.run --standalone --nproc_per_node=$$n scripts/gpu_check.py gpu-check || rc=1; \
	fi; exit $${rc:-0}
