#!/usr/bin/env bash
# A throwaway local PostgreSQL for the kiln warehouse: tests, benchmarks, a laptop run.
#
#   scripts/postgres-local.sh start    initdb on first use, then start (a no-op when already running)
#   scripts/postgres-local.sh stop     pg_ctl stop (fast mode)
#   scripts/postgres-local.sh status   exit 0 when running
#   scripts/postgres-local.sh env      print `export KILN_PG_DSN=...`
#
# State (data dir, socket dir, log, chosen port) lives under $KILN_PG_DIR (default /tmp/kiln-pg).
# The port is $KILN_PG_PORT (default 55432); when that port is taken by something else, the next free
# one is used and remembered. Listens on 127.0.0.1 only, trust auth: a development server, not a
# production one (fsync is off so that tests start and write fast).
# initdb refuses to run as root, so as root every server command runs as user `postgres`.
set -euo pipefail

STATE="${KILN_PG_DIR:-/tmp/kiln-pg}"
DATA="$STATE/data"
SOCK="$STATE/sock"
LOG="$STATE/postgres.log"
DB="${KILN_PG_DB:-kiln}"
if [[ $(id -u) -eq 0 ]]; then USER_NAME=postgres; else USER_NAME=$(id -un); fi  # the superuser initdb creates

pg_bin() {  # the server binaries: PATH first, then Debian's versioned folder
  if command -v "$1" >/dev/null 2>&1; then command -v "$1"; return; fi
  local found
  found=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
  if [[ -n "$found" && -x "$found/$1" ]]; then echo "$found/$1"; return; fi
  echo "postgres-local: $1 not found; install PostgreSQL (apt-get update && apt-get install -y postgresql)" >&2
  exit 1
}

as_owner() {  # run a server command as the data-dir owner
  if [[ $(id -u) -eq 0 ]]; then runuser -u postgres -- "$@"; else "$@"; fi
}

port_free() {
  ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

running() {
  [[ -f "$DATA/PG_VERSION" ]] && as_owner "$(pg_bin pg_ctl)" -D "$DATA" status >/dev/null 2>&1
}

chosen_port() {
  if [[ -f "$STATE/port" ]]; then cat "$STATE/port"; else echo "${KILN_PG_PORT:-55432}"; fi
}

dsn() { echo "postgresql://$USER_NAME@127.0.0.1:$(chosen_port)/$DB"; }

start() {
  if running; then return 0; fi
  mkdir -p "$STATE" "$SOCK"
  if [[ $(id -u) -eq 0 ]]; then chown postgres: "$STATE" "$SOCK"; fi
  if [[ ! -f "$DATA/PG_VERSION" ]]; then
    as_owner "$(pg_bin initdb)" -D "$DATA" -U "$USER_NAME" --auth=trust -E UTF8 --no-locale >"$STATE/initdb.log" 2>&1 \
      || { cat "$STATE/initdb.log" >&2; exit 1; }
  fi
  local port="${KILN_PG_PORT:-55432}"
  while ! port_free "$port"; do port=$((port + 1)); done
  echo "$port" >"$STATE/port"
  as_owner "$(pg_bin pg_ctl)" -D "$DATA" -l "$LOG" -w -t 30 start -o \
    "-c listen_addresses=127.0.0.1 -c port=$port -c unix_socket_directories=$SOCK -c max_connections=200 \
     -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c shared_buffers=128MB" >/dev/null \
    || { tail -n 20 "$LOG" >&2; exit 1; }
  if ! as_owner "$(pg_bin psql)" -h 127.0.0.1 -p "$port" -U "$USER_NAME" -d postgres -tAc \
      "SELECT 1 FROM pg_database WHERE datname = '$DB'" | grep -q 1; then
    as_owner "$(pg_bin createdb)" -h 127.0.0.1 -p "$port" -U "$USER_NAME" "$DB"
  fi
}

stop() {
  if running; then as_owner "$(pg_bin pg_ctl)" -D "$DATA" -m fast -w stop >/dev/null; fi
}

case "${1:-}" in
  start) start; dsn ;;
  stop) stop ;;
  status) if running; then echo "running: $(dsn)"; else echo "stopped"; exit 3; fi ;;
  env) echo "export KILN_PG_DSN=$(dsn)" ;;
  *) echo "usage: $0 {start|stop|status|env}" >&2; exit 2 ;;
esac
