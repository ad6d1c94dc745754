# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv as needed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow test-all lint format docs docs-serve samples bench scorecard clean

# The test stack (ruff, mypy, pytest, duckdb, dask, ray[client]…); `make demo` needs only rlscope.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP) $(CORE)

CORE := $(VENV)/.installed-core
$(CORE): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e .
	touch $(CORE)

demo: $(CORE)
	$(BIN)/rlscope analyze sample_logs/healthy --fail-on never
	$(BIN)/rlscope analyze sample_logs/entropy-collapse --fail-on never

# Tests in a process per core (pytest-xdist), at most 4: each holds up to ~0.7 GiB; -rs prints
# why each skipped test skipped.
PYTEST := $(BIN)/python -m pytest -n auto --maxprocesses 4 -rs

test: $(STAMP)
	$(BIN)/ruff check rlscope tests examples benchmarks
	$(BIN)/ruff format --check rlscope tests examples benchmarks
	$(BIN)/mypy
	$(PYTEST) -m "not slow"

# Real trainers for the slow tests that run one (tests/trainers/): torch's CPU build, transformers
# and TRL in a venv of their own (with rlscope, for its callback), so that rlscope's own stays light.
TRL_VENV := .venv-trl
TRL_STAMP := $(TRL_VENV)/.installed
TRL_SINKS := $(TRL_VENV)/.installed-sinks
$(TRL_STAMP): Makefile pyproject.toml
	test -x $(TRL_VENV)/bin/python || $(PYTHON) -m venv $(TRL_VENV)
	# transformers[serving] (FastAPI, uvicorn, openai's types: ~35 MB) for `transformers serve`, the
	# real OpenAI-compatible server of the probe tests (tests/probe_server.py)
	$(TRL_VENV)/bin/python -m pip install --quiet --disable-pip-version-check \
		torch==2.13.0 "transformers[serving]==5.25.0" trl==1.16.0 datasets accelerate tokenizers
	# rlscope itself, for the trainers that run its callback (tests/test_live.py), and
	# TensorBoard, which the callback sends rlscope's metrics to
	$(TRL_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -e . \
		"tensorboard>=2.14"
	touch $(TRL_STAMP)

# W&B and MLflow for tests/trainers/trl_lr_collapse.py's REPORT_TO (one run through every sink
# transformers' Trainer reports to), apart from $(TRL_STAMP) so that `make test-slow` does not
# install them. mlflow-skinny is enough: MLflowCallback uses only `mlflow`'s tracking API. Pinned
# to the versions checked offline (W&B offline run files, an MLflow 3 file store).
$(TRL_SINKS): $(TRL_STAMP)
	$(TRL_VENV)/bin/python -m pip install --quiet --disable-pip-version-check \
		wandb==0.31.0 mlflow-skinny==3.18.0
	touch $(TRL_SINKS)

# verl 0.9.1 for the slow tests of its hook (tests/test_verl_hook.py runs RlscopeVerlHook on verl's
# own DataProto, RayPPOTrainer methods and core_algos on CPU: tests/trainers/verl_hook_steps.py),
# in the TRL venv. verl itself with --no-deps: its requirements would replace TRL's torch 2.13 and
# transformers 5.25 (torch 2.11 extras, transformers < 5.11) and bring vLLM-era packages that
# nothing on CPU imports. Then only what `from verl import DataProto`, verl.trainer.ppo.ray_trainer
# and core_algos import, each pinned to the version tested, *with* their own requirements (a
# hand-listed closure missed ray's `requests`, which only the W&B sink had brought), torch and
# transformers held at the TRL pins: tensordict 0.10.0 (DataProto's batch; the newest verl
# accepts); ray 2.60.0 (verl/protocol.py imports it); omegaconf (the trainer's config);
# codetiming (verl.utils.debug's marked_timer); cachetools (verl.workers.rollout.router's
# LRUCache); torchdata (ray_trainer.py's StatefulDataLoader); peft (verl.utils.fsdp_utils, which
# ray_trainer.py's verl.workers imports). Not hydra-core: only verl's entry points use it. The
# last line imports what tests/trainers/verl_hook_steps.py imports, so a missing package fails
# here, by name.
VERL_STAMP := $(TRL_VENV)/.installed-verl
$(VERL_STAMP): $(TRL_STAMP)
	$(TRL_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps verl==0.9.1
	$(TRL_VENV)/bin/python -m pip install --quiet --disable-pip-version-check \
		torch==2.13.0 transformers==5.25.0 tensordict==0.10.0 ray==2.60.0 omegaconf==2.3.1 \
		codetiming==1.4.0 cachetools==7.3.3 torchdata==0.11.0 peft==0.21.2
	$(TRL_VENV)/bin/python -W ignore -c "import verl.trainer.ppo.ray_trainer, \
		verl.trainer.ppo.core_algos, verl.trainer.ppo.metric_utils, verl.utils.debug.metrics, \
		verl.trainer.ppo.rollout_corr_helper, verl.workers.utils.padding"
	touch $(VERL_STAMP)

# The slow matrices (larger healthy-shape runs, real TRL runs, the verl hook on verl's own
# classes); CI runs them after `make test`.
test-slow: $(STAMP) $(TRL_STAMP) $(VERL_STAMP)
	RLSCOPE_TRL_PYTHON=$(CURDIR)/$(TRL_VENV)/bin/python $(PYTEST) -m slow

test-all: test test-slow

format: $(STAMP)
	$(BIN)/ruff format rlscope tests examples benchmarks
	$(BIN)/ruff check --fix rlscope tests examples benchmarks

# The documentation site (docs/, mkdocs.yml): its generated reference pages, the README's layers
# table and rlscope/reference.json regenerated from the source (a test in `make test` keeps them
# current), then the site built into site/, strictly: a broken link or a page missing from the nav
# fails. MkDocs comes with the `docs` extra, installed here only, so `make test` does not pay for it.
DOCS_STAMP := $(VENV)/.installed-docs
$(DOCS_STAMP): $(CORE)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[docs]"
	touch $(DOCS_STAMP)

MKDOCS := NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs

docs: $(DOCS_STAMP)
	$(BIN)/python -m rlscope.docs
	$(MKDOCS) build --strict

# The site at http://127.0.0.1:8000, rebuilt on every change.
docs-serve: $(DOCS_STAMP)
	$(BIN)/python -m rlscope.docs
	$(MKDOCS) serve

# Regenerate the committed sample runs (deterministic).
samples: $(STAMP)
	rm -rf sample_logs/healthy sample_logs/entropy-collapse
	$(BIN)/rlscope synth sample_logs/healthy --scenario healthy --steps 60 --prompts 8 --seed 1
	$(BIN)/rlscope synth sample_logs/entropy-collapse --scenario entropy-collapse --steps 100 \
		--prompts 16 --seed 2 --no-tokens

# Generates 10M / 100M / 1B-token runs, a 200M-token run in four file layouts, text runs of
# 100k-5M responses and two 200-step runs into .bench/ on first use (~30 GB, ~30 min), then
# times analyze against a bare scan and DuckDB, the layouts, the text metrics, incremental
# re-analysis and the report, a run on disk against the same run in a local S3 server, and
# imports a 100k-step x 200-key W&B history (written once by wandb, ~3 min, 1.6 GB): expect
# ~1 h in all on 2 cores.
bench: $(STAMP) $(TRL_STAMP)
	$(BIN)/python benchmarks/bench_analyze.py
	$(BIN)/python benchmarks/bench_text.py
	$(BIN)/python benchmarks/bench_report.py
	$(BIN)/python benchmarks/bench_live.py
	$(BIN)/python benchmarks/bench_wandb.py
	$(BIN)/python benchmarks/bench_store.py --tokens 20000000
	RLSCOPE_TRL_PYTHON=$(CURDIR)/$(TRL_VENV)/bin/python $(BIN)/python benchmarks/bench_probe.py

# The scorecard: a corpus of genuine runs (real trainers on CPU, each fault by its mechanism,
# healthy twins, every sink at once) made into .scorecard/ on first use, every finding and reader
# measured on it at every prefix; the table goes to benchmarks/SCORECARD.md (~10 min on 2 cores).
scorecard: $(STAMP) $(TRL_SINKS)
	$(BIN)/python benchmarks/scorecard/score.py --python $(CURDIR)/$(TRL_VENV)/bin/python \
		--out benchmarks/SCORECARD.md
	$(BIN)/python -m rlscope.docs  # the site's page of the scorecard's tables

clean:
	rm -rf $(VENV) $(TRL_VENV) .pytest_cache .ruff_cache .scorecard site
