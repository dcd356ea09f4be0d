#!/usr/bin/env bash
# Live-NVML check on a real GPU host (the project's H200 device machine). Run from the repo root:
#   OUT=/some/dir bash scripts/gpu-check.sh
# It installs the project from this checkout without the network (pip --no-deps --no-build-isolation,
# using the host's nvidia-ml-py, prometheus-client, psutil and click; falls back to PYTHONPATH when
# pip cannot build there) and runs the installed command. Every output lands in $OUT; the summary
# ($OUT/gpu-check.md) is what docs/gpu-check.md records. Exit status: 0 only when every check passed.
# It never changes clocks, power limits, compute mode, MIG layout or persistence mode.
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
py=python3
fail=0
step() { echo "== $*" | tee -a "$OUT/steps.log"; }

step "install"
if $py -m pip install -q --no-deps --no-build-isolation --target /tmp/accelstats-site . > "$OUT/install.log" 2>&1; then
  export PYTHONPATH="/tmp/accelstats-site${PYTHONPATH:+:$PYTHONPATH}"
  echo "installed into /tmp/accelstats-site"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  echo "pip could not build here (see install.log): running from the checkout"
fi
cd /tmp || exit 1   # run the installed package, not the checkout's sources

step "host"
{ date -u +%FT%TZ; uname -a; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader;
  $py -c 'import pynvml, prometheus_client, sys; print(sys.version.split()[0], "nvidia-ml-py", getattr(pynvml, "__version__", "?"))'
} > "$OUT/host.txt" 2>&1
cat "$OUT/host.txt"

step "accelstats devices --json (live NVML) and nvidia-smi --query-gpu, back to back"
query=uuid,memory.total,power.draw,temperature.gpu,utilization.gpu,pci.bus_id,name,driver_version
$py -m accelstats devices --json > "$OUT/devices.json" 2> "$OUT/devices.err" || fail=1
nvidia-smi --query-gpu=$query --format=csv,noheader,nounits > "$OUT/nvidia-smi.csv" || fail=1
$py -m accelstats dump > "$OUT/dump.prom" 2> "$OUT/dump.err" || fail=1
nvidia-smi --query-gpu=$query --format=csv,noheader,nounits > "$OUT/nvidia-smi-after.csv" || fail=1

step "compare"
$py "$OLDPWD/scripts/gpu_compare.py" "$OUT" > "$OUT/gpu-check.md" || fail=1
cat "$OUT/gpu-check.md"

if command -v promtool >/dev/null; then
  step "promtool check metrics"; promtool check metrics < "$OUT/dump.prom" || fail=1
fi
echo "gpu-check: $([ $fail = 0 ] && echo PASS || echo FAIL) (outputs in $OUT)"
exit $fail
