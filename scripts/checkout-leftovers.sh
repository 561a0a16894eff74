#!/usr/bin/env bash
# What the tests leave in the checkout: `snapshot FILE` records the paths git reports as changed, untracked or
# ignored (data/, .dagster/ included); `compare FILE` lists what appeared since and fails if anything did.
# Tests write only to temporary folders; the caches that Python and pytest keep by design are not counted.
set -euo pipefail
cd "$(dirname "$0")/.."
state() {
  git status --porcelain --ignored --untracked-files=normal \
    | grep -v -E '^!! (\.venv/|\.pytest_cache/|\.ruff_cache/|(.*/)?__pycache__/|(.*/)?[^/]*\.egg-info/)$' || true
  find data .dagster -type f 2>/dev/null | sed 's/^/file /' || true  # git names an ignored folder once, not what is added to it
}
case "${1:-}" in
  snapshot) state > "$2" ;;
  compare)
    left=$(comm -13 <(sort "$2") <(state | sort))
    if [ -n "$left" ]; then
      echo "the tests left these in the checkout (write to tmp_path instead):"
      echo "$left"
      exit 1
    fi
    echo "the checkout is as the tests found it" ;;
  *) echo "usage: $0 snapshot FILE | compare FILE" >&2; exit 2 ;;
esac
