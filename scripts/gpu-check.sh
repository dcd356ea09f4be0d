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
OUT=$(realpath "$OUT")
export PYTHONUNBUFFERED=1
py=python3
repo=$PWD
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
timeout 60 $py -m accelstats devices --json > "$OUT/devices.json" 2> "$OUT/devices.err" || fail=1
nvidia-smi --query-gpu=$query --format=csv,noheader,nounits > "$OUT/nvidia-smi.csv" || fail=1
timeout 60 $py -m accelstats dump > "$OUT/dump.prom" 2> "$OUT/dump.err" || fail=1
nvidia-smi --query-gpu=$query --format=csv,noheader,nounits > "$OUT/nvidia-smi-after.csv" || fail=1

step "compare"
$py "$repo/scripts/gpu_compare.py" "$OUT" > "$OUT/gpu-check.md" || fail=1
cat "$OUT/gpu-check.md"

step "what the real pynvml answers for each call accelstats makes, live and over the replay of a capture of the same moment"
nvidia-smi -q -x > "$OUT/nvidia-smi-q.xml" 2>> "$OUT/steps.log" || fail=1
timeout 120 $py "$repo/scripts/nvml_record.py" > "$OUT/nvml-calls-live.json" 2> "$OUT/nvml-calls.err" || fail=1
timeout 120 $py "$repo/scripts/nvml_record.py" --nvml-replay "$OUT/nvidia-smi-q.xml" > "$OUT/nvml-calls-replay.json" \
  2>> "$OUT/nvml-calls.err" || fail=1
$py "$repo/scripts/nvml_record.py" --compare "$OUT/nvml-calls-live.json" "$OUT/nvml-calls-replay.json" \
  >> "$OUT/gpu-check.md" || fail=1

step "a real CUDA process in a docker-named cgroup (v2 host) is attributed by process"
cid=$($py -c 'import secrets; print(secrets.token_hex(32))')
cg=/sys/fs/cgroup/system.slice/docker-$cid.scope
cuda_pid=""
cleanup() {  # also on a timeout or abort: never leave the process or the cgroup behind
  [ -n "$cuda_pid" ] && kill "$cuda_pid" 2>/dev/null && wait "$cuda_pid" 2>/dev/null
  for _ in $(seq 20); do [ -d "$cg" ] || break; rmdir "$cg" 2>/dev/null && break; sleep 0.5; done
}
trap cleanup EXIT INT TERM
export ACCELSTATS_READY="$OUT/cuda.ready"
if [ -f /sys/fs/cgroup/cgroup.controllers ] && mkdir "$cg" 2>> "$OUT/steps.log"; then
  # Move the CUDA process itself (spec/cgroups.md §4): sh writes its own PID, then execs python;
  # if the move fails, nothing runs. One visible GPU, so CUDA opens only that GPU's node.
  CUDA_VISIBLE_DEVICES=0 sh -c "echo \$\$ > $cg/cgroup.procs && exec $py -c 'import os, torch, time, pathlib; x = torch.empty(1 << 30, dtype=torch.uint8, device=\"cuda\"); x.fill_(1); torch.cuda.synchronize(); pathlib.Path(os.environ[\"ACCELSTATS_READY\"]).write_text(\"ready\"); time.sleep(120)'" \
    > "$OUT/cuda.log" 2>&1 &
  cuda_pid=$!
  for _ in $(seq 90); do [ -f "$OUT/cuda.ready" ] && break; sleep 1; done
  if [ -f "$OUT/cuda.ready" ]; then
    timeout 60 $py -m accelstats containers --json > "$OUT/containers.json" 2> "$OUT/containers.err" || fail=1
    timeout 60 $py "$repo/scripts/gpu_container_check.py" "$OUT/containers.json" "$cg" "$cuda_pid" "$cid" \
      >> "$OUT/gpu-check.md" || fail=1
  else
    echo "CUDA process did not become ready (see cuda.log)" | tee -a "$OUT/gpu-check.md"; fail=1
  fi
  cleanup; cuda_pid=""
  [ -d "$cg" ] && { echo "could not remove $cg" | tee -a "$OUT/gpu-check.md"; fail=1; }
else
  echo "not a cgroup v2 host or cannot create $cg: container check skipped" | tee -a "$OUT/gpu-check.md"; fail=1
fi
tail -n 20 "$OUT/gpu-check.md"

step "a container granted GPU 0 that runs nothing (cgroup v2 device program) is attributed devices_cgroup, memory 0"
if [ -f /sys/fs/cgroup/cgroup.controllers ]; then
  timeout 120 $py "$repo/scripts/gpu_idle_check.py" "$OUT" >> "$OUT/gpu-check.md" 2> "$OUT/idle-check.err" || fail=1
else
  echo "not a cgroup v2 host: idle-allocation check skipped" | tee -a "$OUT/gpu-check.md"; fail=1
fi
tail -n 8 "$OUT/gpu-check.md"

step "a real MPS daemon (2 replicas, temp dirs, compute mode untouched) and a CUDA client in a docker cgroup"
mroot=$(mktemp -d /tmp/accelstats-mps.XXXXXX)
cid2=$($py -c 'import secrets; print(secrets.token_hex(32))')
cg2=/sys/fs/cgroup/system.slice/docker-$cid2.scope
mps_pid=""
cleanup_mps() {
  [ -n "$mps_pid" ] && kill "$mps_pid" 2>/dev/null && wait "$mps_pid" 2>/dev/null
  [ -f "$OUT/mps.toml" ] && timeout 30 $py -m accelstats mps stop --config "$OUT/mps.toml" >> "$OUT/mps-stop.txt" 2>&1
  for _ in $(seq 20); do [ -d "$cg2" ] || break; rmdir "$cg2" 2>/dev/null && break; sleep 0.5; done
}
trap 'cleanup; cleanup_mps' EXIT INT TERM
uuid0=$($py -c 'import json, sys; print(next(d["uuid"] for d in json.load(open(sys.argv[1])) if d["kind"] == "gpu"))' \
  "$OUT/devices.json" 2>/dev/null)
if command -v nvidia-cuda-mps-control >/dev/null && [ -n "$uuid0" ] && mkdir "$cg2" 2>> "$OUT/steps.log"; then
  printf '[mps]\nroot = "%s"\n[[mps.resources]]\nname = "check"\nreplicas = 2\ndevices = ["%s"]\n' "$mroot" "$uuid0" \
    > "$OUT/mps.toml"
  timeout 60 $py -m accelstats mps start --config "$OUT/mps.toml" > "$OUT/mps-start.txt" 2>&1 || fail=1
  export ACCELSTATS_READY2="$OUT/mps-client.ready"
  CUDA_MPS_PIPE_DIRECTORY="$mroot/check/pipe" sh -c "echo \$\$ > $cg2/cgroup.procs && exec $py -c 'import os, torch, time, pathlib; x = torch.ones(1 << 28, device=\"cuda\"); torch.cuda.synchronize(); pathlib.Path(os.environ[\"ACCELSTATS_READY2\"]).write_text(\"ready\"); time.sleep(120)'" \
    > "$OUT/mps-client.log" 2>&1 &
  mps_pid=$!
  for _ in $(seq 90); do [ -f "$OUT/mps-client.ready" ] && break; sleep 1; done
  timeout 60 $py -m accelstats mps status --json --config "$OUT/mps.toml" > "$OUT/mps-status.json" 2>&1 || fail=1
  timeout 60 $py -m accelstats dump --config "$OUT/mps.toml" > "$OUT/mps-dump.prom" 2>&1 || fail=1
  $py - "$OUT/mps-status.json" "$OUT/mps-dump.prom" "$mps_pid" "/system.slice/docker-$cid2.scope" >> "$OUT/gpu-check.md" <<'PYEOF' || fail=1
import json, sys
from prometheus_client.parser import text_string_to_metric_families
status, dump, pid, cgroup = json.load(open(sys.argv[1])), open(sys.argv[2]).read(), int(sys.argv[3]), sys.argv[4]
row = status[0]
client = [c for c in row["clients"] if c["pid"] == pid]
fams = {f.name: f for f in text_string_to_metric_families(dump)}
def samples(name):
    return [(s.labels, s.value) for s in fams[name].samples] if name in fams else []
mps_clients = [v for l, v in samples("accelstats_mps_clients") if l.get("resource") == "check"]
mps_up = [v for l, v in samples("accelstats_mps_daemon_up") if l.get("resource") == "check"]
mem = [(l.get("attribution"), v) for l, v in samples("accelstats_container_gpu_memory_used_bytes") if l.get("id") == cgroup]
procs = [v for l, v in samples("accelstats_container_gpu_processes") if l.get("id") == cgroup]
checks = {
    "daemon healthy (mps status)": bool(row["healthy"]),
    "client pid listed with its container (mps status)": bool(client) and client[0]["container"] == cgroup,
    "accelstats_mps_daemon_up == 1": mps_up == [1.0],
    "accelstats_mps_clients == 1": mps_clients == [1.0],
    "container memory attributed by process, > 0": any(a == "process" and v > 0 for a, v in mem),
    "container has 1 GPU process": procs == [1.0],
}
print("\n### MPS daemon and client\n")
for what, good in checks.items():
    print(f"- {'PASS' if good else 'FAIL'}: {what}")
print(f"- status: {json.dumps(row)[:1200]}\n- container memory series: {mem}")
sys.exit(0 if all(checks.values()) else 1)
PYEOF
  cleanup_mps; mps_pid=""
  [ -e "$mroot/check/pipe" ] && { echo "MPS pipe dir left behind" | tee -a "$OUT/gpu-check.md"; fail=1; }
  [ -d "$cg2" ] && { echo "could not remove $cg2" | tee -a "$OUT/gpu-check.md"; fail=1; }
else
  echo "MPS step not run: nvidia-cuda-mps-control missing, no GPU, or no cgroup v2" | tee -a "$OUT/gpu-check.md"; fail=1
fi
rm -rf "$mroot"

step "the Nomad plugin on live NVML, driven as a Nomad client (processes A/B/C, Reserve)"
plugin_bin="$OUT/nomad-device-accelstats"
printf '#!/bin/sh\nexec %s -c "from accelstats.nomad.server import main; main()"\n' "$(command -v $py)" > "$plugin_bin"
chmod +x "$plugin_bin"
echo '{"fingerprint_period": "1m"}' > "$OUT/plugin-config.json"
PYTHONPATH="$repo/tests:$PYTHONPATH" timeout 120 $py -m support.nomadclient.launcher "$plugin_bin" "$OUT/plugin-config.json" --stats 1 --reserve fingerprinted \
  --quiet-logs > "$OUT/nomad-lifecycle.json" 2> "$OUT/nomad-lifecycle.err" || fail=1
$py - "$OUT/nomad-lifecycle.json" >> "$OUT/gpu-check.md" <<'PYEOF' || fail=1
import json, sys
r = json.load(open(sys.argv[1]))
c = next(p for p in r["processes"] if p["name"] == "C")
msgs = {m["call"].split("#")[0]: m["message"] for m in c["messages"]}
print("\n### Nomad plugin on live NVML (support.nomadclient.launcher)\n")
print(f"- ok: {r['ok']}; problems: {r['problems']}")
print(f"- exec to handshake (A, B, C): {[round(p['exec_to_handshake_s'], 3) for p in r['processes']]} s")
print("- fingerprint:", json.dumps(msgs.get("Fingerprint"))[:1500])
print("- one Stats message:", json.dumps(msgs.get("Stats"))[:1500])
print("- Reserve:", json.dumps(msgs.get("Reserve"))[:800])
sys.exit(0 if r["ok"] and msgs.get("Fingerprint", {}).get("device_group") else 1)
PYEOF

step "an MPS client set up from the Nomad plugin's reservation: own mount namespace (as a container) with and without the daemon's /dev/shm, and as raw_exec"
# Settles whether MPS clients need the server's /dev/shm (docs/nomad.md, "Shared memory"). The
# pinned-memory device number of a narrowed daemon needs a second GPU: with one, ordinal = index = 0.
if command -v nvidia-cuda-mps-control >/dev/null && command -v unshare >/dev/null; then
  mroot2=$(mktemp -d /tmp/accelstats-mps2.XXXXXX)
  PYTHONPATH="$repo/tests:$PYTHONPATH" timeout 300 $py "$repo/scripts/mps_reservation_check.py" "$plugin_bin" "$mroot2" "$OUT" \
    >> "$OUT/gpu-check.md" 2> "$OUT/mps-reservation.err" || fail=1
  rm -rf "$mroot2"
else
  echo "MPS reservation step not run: nvidia-cuda-mps-control or unshare missing" | tee -a "$OUT/gpu-check.md"; fail=1
fi

step "what nvmlDeviceGetProcessUtilization returns while a process keeps GPU 0 busy (per-container GPU-seconds need it)"
timeout 120 $py "$repo/scripts/process_samples_probe.py" --seconds 4 >> "$OUT/gpu-check.md" 2> "$OUT/process-samples.err" || fail=1

step "GPU accounting on live NVML: a busy process's SM-seconds, memory byte-seconds, energy conserved"
timeout 120 $py "$repo/scripts/accounting_check.py" --seconds 12 >> "$OUT/gpu-check.md" 2> "$OUT/accounting-check.err" || fail=1
tail -n 8 "$OUT/gpu-check.md"

step "GPM profiling and NVLink under load: tensor activity rises with a matmul, DRAM activity with a copy (torch)"
# three phases of 12 s on GPU 0 (idle, bf16 matmul, 2 GiB copies), read by accelstats' own sampler every second
timeout 180 $py "$repo/scripts/profiling_check.py" --seconds 12 >> "$OUT/gpu-check.md" 2> "$OUT/profiling-check.err" || fail=1
tail -n 25 "$OUT/gpu-check.md"

step "scrape cost on live NVML: accelstats vs the NVML floor vs nvidia-smi (target: accelstats / floor <= 2)"
# 1 GPU x 10 synthetic containers; 100 interleaved rounds, 0.25 s apart (about a minute); exit 1 = target missed
timeout 300 $py "$repo/benchmarks/cost.py" --live --rounds 100 > "$OUT/cost.txt" 2>&1 || fail=1
{ printf '\n### Scrape cost on live NVML (benchmarks/cost.py --live --rounds 100)\n\n```\n'; cat "$OUT/cost.txt"; printf '```\n'; } \
  >> "$OUT/gpu-check.md"
tail -n 20 "$OUT/cost.txt"

if command -v promtool >/dev/null; then
  step "promtool check metrics"; promtool check metrics < "$OUT/dump.prom" || fail=1
fi
echo "gpu-check: $([ $fail = 0 ] && echo PASS || echo FAIL) (outputs in $OUT)"
exit $fail
