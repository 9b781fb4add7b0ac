# The two commands of the README: `make chat` and `make test`. Each sets everything up first.
.PHONY: setup chat test bench-cpu

setup:
	bash scripts/setup.sh

chat: setup
	.venv/bin/turnkv chat

# The tests also cover the Ray Serve wrapper (turnkv.serve.ray), so they install the ray extra.
test:
	EXTRAS=test,ray bash scripts/setup.sh
	.venv/bin/python -m pytest -q

bench-cpu: setup
	.venv/bin/python benchmarks/cpu/cpu_vs_transformers.py
