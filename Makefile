# tensorferry: `make demo` runs the main job on sample data, `make test` runs every test.
# `make help` lists the targets.

CARGO ?= cargo
PYTHON ?= python3
MATURIN ?= maturin
BIN := target/release/tensorferry

.PHONY: help demo test test-rust test-python py-deps build lint fmt bench fuzz clean

help: ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

build: ## build the CLI (release)
	$(CARGO) build --release -p tensorferry-cli

demo: build ## make a sample sharded checkpoint and load it with tensorferry and a baseline
	$(BIN) doctor .
	$(BIN) demo --size 1G --dir demo-data

test: test-rust test-python ## run every test (Rust, then Python)

test-rust: ## Rust unit, property and integration tests
	$(CARGO) test --workspace --all-targets
	$(CARGO) test --workspace --doc

py-deps: ## install what the Python tests need (torch, numpy, safetensors, pytest, maturin)
	$(PYTHON) -m pip install -q --disable-pip-version-check -r python/requirements-test.txt

test-python: py-deps ## build and install the wheel, then run the Python tests
	$(MATURIN) build --release -o target/wheels
	$(PYTHON) -m pip install -q --force-reinstall --no-deps "$$(ls -t target/wheels/tensorferry-*.whl | head -n 1)"
	$(PYTHON) -m pytest -q python/tests

lint: ## rustfmt and clippy, warnings as errors
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

fmt: ## format the code
	$(CARGO) fmt --all

bench: build ## host-memory benchmark against safetensors and dd (2 GiB, warm and cold)
	$(PYTHON) bench/host_bench.py --size 2G

FUZZ_SECONDS ?= 600
fuzz: ## run each fuzz target (header, index, plan) for FUZZ_SECONDS (needs nightly and cargo-fuzz)
	cd crates/tensorferry/fuzz && for t in header index plan; do \
	  mkdir -p corpus/$$t && cargo +nightly fuzz run $$t corpus/$$t seeds/$$t -- -max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=2048 || exit 1; \
	done

clean: ## remove build outputs and sample data
	$(CARGO) clean
	rm -rf demo-data
