# The two set-up commands of the README, plus conveniences. Each target bootstraps what it needs.
.PHONY: demo test test-fast lint format env system-deps ui repro clean

env:
	@scripts/bootstrap.sh

# The main job on the embedded defaults: demo corpus -> curation -> captions -> training -> evaluation.
demo: env
	.venv/bin/kiln run

# The unit lane, for every change: no service, no long run, two processes (under 3 minutes on 2 cores).
FAST = not slow and not integration and not slurm and not postgres and not s3 and not distributed and not gpu and not browser
test-fast: env
	.venv/bin/pytest -m "$(FAST)" -n 2

# The whole test suite, services included (Slurm and Postgres are started by the tests' fixtures): the unit lane
# on two processes, then every marked test in one (they share the local Slurm, Postgres and the CPU cores).
test: env system-deps
	@rc=0; .venv/bin/pytest -m "$(FAST)" -n 2 || rc=$$?; .venv/bin/pytest -m "not ($(FAST))" || rc=$$?; exit $$rc

# The linters CI runs before the tests: ruff's rules and format ([tool.ruff]) and the import layers
# ([tool.importlinter]) in pyproject.toml.
lint: env
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/lint-imports

format: env
	.venv/bin/ruff check --fix .
	.venv/bin/ruff format .

system-deps:
	@scripts/system-deps.sh

ui: env
	DAGSTER_HOME=$(CURDIR)/.dagster .venv/bin/dagster dev -m dagster_project.definitions

repro: env
	.venv/bin/kiln dvc write
	PATH=$(CURDIR)/.venv/bin:$$PATH .venv/bin/dvc repro

clean:
	rm -rf data .dagster
