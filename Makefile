# The two commands of the README: `make chat` and `make test`. Each sets everything up first.
.PHONY: setup chat test test-gpu bench-cpu docs plots figures

setup:
	bash scripts/setup.sh

chat: setup
	.venv/bin/turnkv chat

# The tests also cover the Ray Serve wrapper (turnkv.serve.ray) and build the docs
# (tests/docs/), so they install the ray and docs extras.
# --dist worksteal: a worker that runs out of tests takes some of the other's (the long ones run first: tests/conftest.py).
test:
	EXTRAS=test,ray,docs bash scripts/setup.sh
	.venv/bin/python -m pytest -q -n 2 --dist worksteal

# The GPU lane: run on a CUDA machine (see docs/contributing.md, the GPU lane). It uses the machine's own torch.
test-gpu:
	bash scripts/test_gpu.sh

bench-cpu: setup
	.venv/bin/python benchmarks/cpu/cpu_vs_transformers.py

# The documentation site in site/; the benchmark plots it shows, redrawn from the committed JSON; and the
# figures the README and the docs quote, rewritten from the same JSON (tests/docs/test_figures.py checks them).
docs:
	EXTRAS=test,docs bash scripts/setup.sh
	.venv/bin/mkdocs build --strict

plots: setup
	.venv/bin/python benchmarks/plots.py

figures: setup
	.venv/bin/python benchmarks/figures.py
