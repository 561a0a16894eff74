#!/usr/bin/env bash
# System packages the tests need: Slurm + munge, PostgreSQL, tesseract, a TTF font, the GL/GLib libraries opencv loads, Chromium. Installs only what
# is missing; needs root (CI runs as root). Idempotent.
set -euo pipefail
need=()
command -v slurmctld >/dev/null || need+=(slurm-wlm)
command -v munged >/dev/null || need+=(munge)
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need+=(postgresql)
command -v tesseract >/dev/null || need+=(tesseract-ocr)
ldconfig -p | grep -q "libGL.so.1 " || need+=(libgl1)          # opencv (rapidocr) needs it to import
ldconfig -p | grep -q "libglib-2.0.so.0 " || need+=(libglib2.0-0)
[ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || need+=(fonts-dejavu-core)  # the OCR tests render signs in it
command -v chromium >/dev/null || need+=(chromium)  # the annotation page's test drives it headless (tests/chromium.py)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "system-deps: missing ${need[*]}; install them (apt-get install ${need[*]}) or run as root" >&2
  exit 1
fi
echo "system-deps: installing ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
