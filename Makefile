# The two set-up commands of the README, plus conveniences. Each target bootstraps what it needs.
.PHONY: demo test lint env system-deps ui repro clean

env:
	@scripts/bootstrap.sh

# The main job on the embedded defaults: demo corpus -> curation -> captions -> training -> evaluation.
demo: env
	.venv/bin/kiln run

# The whole test suite, services included (Slurm and Postgres are started by the tests' fixtures).
test: env system-deps
	.venv/bin/pytest

# The linter CI runs before the tests: its rules are [tool.ruff] in pyproject.toml.
lint: env
	.venv/bin/ruff check .

system-deps:
	@scripts/system-deps.sh

ui: env
	DAGSTER_HOME=$(CURDIR)/.dagster .venv/bin/dagster dev -m dagster_project.definitions

repro: env
	.venv/bin/kiln dvc write
	PATH=$(CURDIR)/.venv/bin:$$PATH .venv/bin/dvc repro

clean:
	rm -rf data .dagster
