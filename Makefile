# `make test`: set up (CPU torch pinned) and run the test suite. `make demo`: set up and run the main job.
PYTHON ?= python3
PIP = $(PYTHON) -m pip

.PHONY: setup setup-examples test demo

setup:
	$(PIP) install -q torch==2.13.0 -c constraints-cpu.txt
	$(PIP) install -q -e ".[test]" -c constraints-cpu.txt

test: setup
	$(PYTHON) -m pytest -q tests

demo: setup
	$(PYTHON) examples/reproduce.py --table listops --quick --output_dir outputs/demo
