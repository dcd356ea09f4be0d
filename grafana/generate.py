#!/usr/bin/env python3
"""Generate ``grafana/dashboards/*.json`` from the panel tables below.

    python3 grafana/generate.py           # rewrite the JSON files
    python3 grafana/generate.py --check   # exit 1 and name the stale files if they differ

``tests/test_dashboards.py`` fails when the committed JSON is not what this script writes, and checks
every metric named here against ``accelstats/catalog.py``; ``tests/test_e2e_prometheus.py`` sends
every query to a real Prometheus scraping a real exporter. Families and their meaning:
``../shared/spec/metrics.md``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from builder import Panel, Query, Row, custom_variable, dashboard, datasource_variable, query_variable

HERE = Path(__file__).resolve().parent
OUT = HERE / "dashboards"

INSTANCE = 'instance=~"$instance"'
GPU = f'{INSTANCE}, uuid=~"$gpu"'
GPU_LEGEND = "{{instance}} GPU {{gpu}}"
UP_DOWN = {0: ("down", "red"), 1: ("up", "green")}
YES_NO = {0: ("no", "green"), 1: ("yes", "red")}
ACTIVE = {1: ("active", "orange")}
OK_FAILED = {0: ("failed", "red"), 1: ("ok", "green")}
TAGS = ("accelstats", "gpu", "nvidia")

INSTANCE_VAR = query_variable("instance", "Instance", "label_values(accelstats_build_info, instance)")
GPU_VAR = query_variable("gpu", "GPU (UUID)", 'label_values(accelstats_gpu_info{instance=~"$instance"}, uuid)')


def _json(model: dict[str, object]) -> str:
    return json.dumps(model, indent=2, ensure_ascii=False) + "\n"


# --- GPU fleet --------------------------------------------------------------------------------------

def fleet() -> dict[str, object]:
    """Per node and GPU: health, utilisation, memory, power, energy, temperature, clocks, throttling,
    ECC / row remapping / XID, PCIe, and the exporter's own collectors."""
    overview = Row("Overview", [
        Panel("GPUs", "GPUs and MIG instances the selected exporters enumerate (accelstats_gpu_info).", "none",
              [Query(f"count(accelstats_gpu_info{{{GPU}}})")], "stat", 4, 4),
        Panel("GPUs down", "Devices that did not answer NVML in the last collection (accelstats_gpu_up = 0: GPU "
              "lost, or an NVML call past the deadline).", "none",
              [Query(f"count(accelstats_gpu_up{{{GPU}}} == 0) or vector(0)")], "stat", 4, 4, red_from=1),
        Panel("Mean GPU utilisation", "Mean of accelstats_gpu_utilization_ratio over the selected GPUs (NVML "
              "utilisation samples since the previous scrape).", "percentunit",
              [Query(f"avg(accelstats_gpu_utilization_ratio{{{GPU}}})")], "stat", 4, 4, min=0, max=1),
        Panel("Framebuffer memory in use", "Used over total framebuffer memory of the selected GPUs (NVML memory "
              "info v2).", "percentunit",
              [Query(f"sum(accelstats_gpu_memory_used_bytes{{{GPU}}}) / "
                     f"sum(accelstats_gpu_memory_total_bytes{{{GPU}}})")],
              "stat", 4, 4, min=0, max=1),
        Panel("Power draw", "Sum of the boards' power draw (accelstats_gpu_power_watts).", "watt",
              [Query(f"sum(accelstats_gpu_power_watts{{{GPU}}})")], "stat", 4, 4),
        Panel("XID errors", "Critical XID errors counted by the exporters (accelstats_gpu_xid_errors_total), "
              "summed over the GPUs; counters restart with the exporter.", "none",
              [Query(f"sum(accelstats_gpu_xid_errors_total{{{GPU}}}) or vector(0)")], "stat", 4, 4, red_from=1),
        Panel("Devices down", "GPUs whose last collection failed (accelstats_gpu_up == 0), by node. Empty when every "
              "GPU answers.", "none",
              [Query(f"accelstats_gpu_up{{{GPU}}} == 0")], "table", 8, 6, mappings=UP_DOWN),
        Panel("GPU inventory", "Identity of each device: model, driver and CUDA versions, MIG and compute "
              "modes, PCI bus id, and source (nvml, or replay for a recorded capture) (accelstats_gpu_info).",
              "none", [Query(f"accelstats_gpu_info{{{GPU}}}")], "table", 16, 6),
    ])
    usage = Row("Utilisation and memory", [
        Panel("GPU utilisation", "Fraction of time a kernel ran, mean of NVML samples since the previous scrape "
              "(accelstats_gpu_utilization_ratio; absent for MIG instances).", "percentunit",
              [Query(f"accelstats_gpu_utilization_ratio{{{GPU}}}", GPU_LEGEND)], min=0, max=1),
        Panel("Memory controller utilisation", "Fraction of the last sample period the memory controller was "
              "busy (accelstats_gpu_memory_utilization_ratio).", "percentunit",
              [Query(f"accelstats_gpu_memory_utilization_ratio{{{GPU}}}", GPU_LEGEND)], min=0, max=1),
        Panel("Framebuffer memory used", "Used framebuffer memory per GPU, NVML memory info v2 "
              "(accelstats_gpu_memory_used_bytes), and the total as a dashed ceiling.", "bytes",
              [Query(f"accelstats_gpu_memory_used_bytes{{{GPU}}}", GPU_LEGEND),
               Query(f"accelstats_gpu_memory_total_bytes{{{GPU}}}", GPU_LEGEND + " total")]),
        Panel("Processes per GPU", "Processes NVML lists on each GPU, by type: compute, graphics, mps "
              "(accelstats_gpu_processes).", "short",
              [Query(f"accelstats_gpu_processes{{{GPU}}}", GPU_LEGEND + " {{type}}")]),
    ])
    power = Row("Power, energy and temperature", [
        Panel("Power draw and limit", "Board power draw (accelstats_gpu_power_watts) and the enforced power "
              "limit (accelstats_gpu_power_limit_watts).", "watt",
              [Query(f"accelstats_gpu_power_watts{{{GPU}}}", GPU_LEGEND),
               Query(f"accelstats_gpu_power_limit_watts{{{GPU}}}", GPU_LEGEND + " limit")]),
        Panel("Energy rate", "Average power over the rate window from the energy counter "
              "(rate of accelstats_gpu_energy_joules_total): includes every moment, not only the sampled ones.",
              "watt", [Query(f"rate(accelstats_gpu_energy_joules_total{{{GPU}}}[$__rate_interval])", GPU_LEGEND)]),
        Panel("Energy used in the time range", "Energy each GPU used over the dashboard's time range "
              "(increase of accelstats_gpu_energy_joules_total).", "joule",
              [Query(f"increase(accelstats_gpu_energy_joules_total{{{GPU}}}[$__range])", GPU_LEGEND)],
              "bargauge", 12, 8),
        Panel("Temperature", "GPU die and HBM temperatures by sensor (accelstats_gpu_temperature_celsius).",
              "celsius", [Query(f"accelstats_gpu_temperature_celsius{{{GPU}}}", GPU_LEGEND + " {{sensor}}")]),
    ])
    clocks = Row("Clocks and throttling", [
        Panel("Clocks", "Current SM and memory clocks (accelstats_gpu_clock_hertz).", "hertz",
              [Query(f'accelstats_gpu_clock_hertz{{{GPU}, clock=~"sm|memory"}}', GPU_LEGEND + " {{clock}}")]),
        Panel("SM clock against its maximum", "Current SM clock over the maximum SM clock "
              "(accelstats_gpu_clock_hertz / accelstats_gpu_clock_max_hertz); low while throttled or idle.",
              "percentunit",
              [Query(f'accelstats_gpu_clock_hertz{{{GPU}, clock="sm"}} / accelstats_gpu_clock_max_hertz{{{GPU}, '
                     'clock="sm"}', GPU_LEGEND)], min=0, max=1),
        Panel("Active clock event (throttle) reasons", "Clock event reasons NVML reports active, one line per "
              "reason (accelstats_gpu_clock_event_active = 1): power caps, thermal slowdown, sync boost, ...",
              "bool_yes_no",
              [Query(f"accelstats_gpu_clock_event_active{{{GPU}}} == 1", GPU_LEGEND + " {{reason}}")],
              "state-timeline", 12, 8, mappings=ACTIVE),
        Panel("Performance state", "NVML performance state, 0 = highest performance "
              "(accelstats_gpu_performance_state).", "none",
              [Query(f"accelstats_gpu_performance_state{{{GPU}}}", GPU_LEGEND)]),
    ])
    errors = Row("Errors: ECC, row remapping, XID", [
        Panel("ECC errors in the rate window", "Increase of the volatile ECC error counters (since the driver "
              "loaded), by type (accelstats_gpu_ecc_errors_total{scope=\"volatile\"}).", "short",
              [Query(f'increase(accelstats_gpu_ecc_errors_total{{{GPU}, scope="volatile"}}[$__rate_interval])',
                     GPU_LEGEND + " {{type}}")]),
        Panel("ECC errors (lifetime)", "Aggregate ECC error counters, kept by the GPU across driver reloads "
              "(accelstats_gpu_ecc_errors_total{scope=\"aggregate\"}).", "short",
              [Query(f'accelstats_gpu_ecc_errors_total{{{GPU}, scope="aggregate"}}')], "table", 12, 8, red_from=1),
        Panel("Remapped rows", "HBM rows remapped, by the error type that caused it "
              "(accelstats_gpu_remapped_rows_total).", "short",
              [Query(f"accelstats_gpu_remapped_rows_total{{{GPU}}}")], "table", 8, 8, red_from=1),
        Panel("Row remapping pending or failed", "A pending remap needs a GPU reset "
              "(accelstats_gpu_row_remap_pending); a failed one means the GPU needs service "
              "(accelstats_gpu_row_remap_failure).", "bool_yes_no",
              [Query(f"accelstats_gpu_row_remap_pending{{{GPU}}}", GPU_LEGEND + " pending"),
               Query(f"accelstats_gpu_row_remap_failure{{{GPU}}}", GPU_LEGEND + " failed")],
              "state-timeline", 8, 8, mappings=YES_NO),
        Panel("XID errors", "Critical XID errors per GPU and XID since the exporter started "
              "(accelstats_gpu_xid_errors_total, from NVML's event set).", "short",
              [Query(f"accelstats_gpu_xid_errors_total{{{GPU}}}")], "table", 8, 8, red_from=1),
    ])
    pcie = Row("PCIe", [
        Panel("PCIe throughput", "PCIe traffic by direction (tx = GPU to host, rx = host to GPU), sampled in the "
              "background (accelstats_gpu_pcie_throughput_bytes_per_second).", "Bps",
              [Query(f"accelstats_gpu_pcie_throughput_bytes_per_second{{{GPU}}}", GPU_LEGEND + " {{direction}}")]),
        Panel("PCIe replays per second", "Rate of PCIe link replays (retransmissions after link errors) "
              "(accelstats_gpu_pcie_replays_total).", "short",
              [Query(f"rate(accelstats_gpu_pcie_replays_total{{{GPU}}}[$__rate_interval])", GPU_LEGEND)]),
        Panel("PCIe link", "Current PCIe link generation (accelstats_gpu_pcie_link_generation) and width in lanes "
              "(accelstats_gpu_pcie_link_width); idle GPUs train down to save power.", "none",
              [Query(f"accelstats_gpu_pcie_link_generation{{{GPU}}}"),
               Query(f"accelstats_gpu_pcie_link_width{{{GPU}}}")],
              "table", 24, 6, columns={"Value #A": "generation", "Value #B": "lanes"}),
    ])
    exporter = Row("Exporter", [
        Panel("Collector success", "1 when the collector succeeded in the last scrape "
              "(accelstats_scrape_collector_success).", "none",
              [Query(f"accelstats_scrape_collector_success{{{INSTANCE}}}", "{{instance}} {{collector}}")],
              "state-timeline", 8, 6, mappings=OK_FAILED),
        Panel("Collector duration", "Time each collector took in a scrape "
              "(accelstats_scrape_collector_duration_seconds).", "s",
              [Query(f"accelstats_scrape_collector_duration_seconds{{{INSTANCE}}}", "{{instance}} {{collector}}")],
              width=8, height=6),
        Panel("NVML errors", "Failed NVML calls per second by call and error, NOT_SUPPORTED excluded "
              "(accelstats_nvml_errors_total).", "short",
              [Query(f"sum by (instance, call, error) (rate(accelstats_nvml_errors_total{{{INSTANCE}}}"
                     "[$__rate_interval]))", "{{instance}} {{call}} {{error}}")], width=8, height=6),
    ])
    return dashboard(uid="accelstats-gpu-fleet", title="accelstats / GPU fleet",
                     description="NVIDIA GPUs per node: utilisation, memory, power, temperature, clocks, errors, "
                     "PCIe (accelstats exporter).", tags=TAGS,
                     variables=[datasource_variable(), INSTANCE_VAR, GPU_VAR],
                     rows=[overview, usage, power, clocks, errors, pcie, exporter])


# --- Containers ---------------------------------------------------------------------------------------

def _in_containers(metric: str, gpu_label: str = "uuid", info: str = "") -> str:
    """``metric`` of the selected containers, with the runtime and the Nomad allocation and task of
    ``accelstats_container_info`` joined on (instance, job, id)."""
    sel = f'{INSTANCE}, {gpu_label}=~"$gpu", namespace=~"$namespace", pod=~"$pod"'
    return (f"({metric}{{{sel}}} * on (instance, job, id) group_left (runtime, alloc_id, task) "
            f'accelstats_container_info{{{INSTANCE}, alloc_id=~"$alloc"{info}}})')


WORKLOAD = "instance, runtime, namespace, pod, container, name, alloc_id, task"
CTR_LEGEND = "{{instance}} {{runtime}} {{namespace}}/{{pod}} {{container}} {{name}}"


def containers() -> dict[str, object]:
    """Per container, pod or Nomad allocation: which GPUs, memory, SM utilisation, processes,
    attribution, top consumers."""
    mem = _in_containers("accelstats_container_gpu_memory_used_bytes")
    sm = _in_containers("accelstats_container_gpu_sm_utilization_ratio")
    procs = _in_containers("accelstats_container_gpu_processes")
    duty = _in_containers("container_accelerator_duty_cycle", "acc_id")
    pod_mem = _in_containers("accelstats_container_gpu_memory_used_bytes", info=', pod!=""')
    alloc_mem = _in_containers("accelstats_container_gpu_memory_used_bytes", info=', alloc_id!=""')
    who = Row("Who uses which GPU", [
        Panel("Containers holding a GPU", "Containers with at least one attributed device "
              "(accelstats_container_info).", "none",
              [Query(f'count(accelstats_container_info{{{INSTANCE}, namespace=~"$namespace", pod=~"$pod", '
                     'alloc_id=~"$alloc"})')], "stat", 4, 8),
        Panel("Attribution sources", "How each (container, GPU) pair was found: devices_cgroup (cgroup v1 "
              "devices.list grants the GPU), process (NVML lists a process of the container on it) or open_fd "
              "(a process holds /dev/nvidia<minor> open).", "short",
              [Query(f"count by (attribution) ({procs})", "{{attribution}}")], "piechart", 6, 8),
        Panel("Containers and their GPUs", "One line per (container, GPU): runtime, Kubernetes pod or Nomad "
              "allocation, GPU, attribution source, the container's processes on it, the device memory they "
              "use (sum of NVML usedGpuMemory) and their SM utilisation (accelstats_container_gpu_*).", "short",
              [Query(procs), Query(mem), Query(sm)], "table", 14, 8,
              columns={"Value #A": "processes", "Value #B": "memory used", "Value #C": "SM utilisation"},
              column_units={"Value #B": "bytes", "Value #C": "percentunit"}),
    ])
    usage = Row("Usage over time", [
        Panel("GPU memory used by container", "Device memory used by each container's processes, per GPU "
              "(accelstats_container_gpu_memory_used_bytes).", "bytes",
              [Query(f"sum by ({WORKLOAD}, gpu) ({mem})", CTR_LEGEND + " GPU {{gpu}}")]),
        Panel("SM utilisation by container", "SM utilisation of each container's processes since the previous "
              "scrape, per GPU (accelstats_container_gpu_sm_utilization_ratio); 1 = the whole GPU.", "percentunit",
              [Query(f"sum by ({WORKLOAD}, gpu) ({sm})", CTR_LEGEND + " GPU {{gpu}}")], min=0),
        Panel("Processes by container", "Each container's processes on each GPU "
              "(accelstats_container_gpu_processes).", "short",
              [Query(f"sum by ({WORKLOAD}, gpu) ({procs})", CTR_LEGEND + " GPU {{gpu}}")]),
        Panel("Device duty cycle (cAdvisor view)", "Utilisation of the whole device each container holds, in "
              "percent, as cAdvisor published it (container_accelerator_duty_cycle): device-wide, so containers "
              "sharing a GPU show the same value.", "percent",
              [Query(f"max by ({WORKLOAD}, acc_id) ({duty})",
                     CTR_LEGEND + " {{acc_id}}")], min=0, max=100),
    ])
    top = Row("Top consumers", [
        Panel("Top $topn containers by GPU memory", "Containers using the most device memory, summed over their "
              "GPUs (accelstats_container_gpu_memory_used_bytes).", "bytes",
              [Query(f"topk($topn, sum by ({WORKLOAD}) ({mem}))", CTR_LEGEND)], "bargauge", 12, 8),
        Panel("Top $topn containers by SM utilisation", "Containers using the most SM time, summed over their GPUs "
              "(accelstats_container_gpu_sm_utilization_ratio); 1 = one whole GPU.", "percentunit",
              [Query(f"topk($topn, sum by ({WORKLOAD}) ({sm}))", CTR_LEGEND)], "bargauge", 12, 8),
        Panel("Top $topn pods by GPU memory", "Kubernetes pods using the most device memory, all their containers "
              "and GPUs together (accelstats_container_gpu_memory_used_bytes).", "bytes",
              [Query(f"topk($topn, sum by (namespace, pod) ({pod_mem}))", "{{namespace}}/{{pod}}")],
              "bargauge", 12, 8),
        Panel("Top $topn Nomad allocations by GPU memory", "Nomad allocations using the most device memory, all "
              "their tasks and GPUs together (accelstats_container_gpu_memory_used_bytes).", "bytes",
              [Query(f"topk($topn, sum by (alloc_id) ({alloc_mem}))", "{{alloc_id}}")],
              "bargauge", 12, 8),
    ])
    identity = Row("Identity", [
        Panel("Container identity", "Every container holding a GPU: runtime, container id, image, pod uid, Nomad "
              "allocation and task (accelstats_container_info).", "none",
              [Query(f'accelstats_container_info{{{INSTANCE}, namespace=~"$namespace", pod=~"$pod", '
                     'alloc_id=~"$alloc"}')], "table", 24, 8),
    ])
    return dashboard(uid="accelstats-containers", title="accelstats / Containers",
                     description="GPU use per container, Kubernetes pod and Nomad allocation (accelstats exporter).",
                     tags=TAGS, rows=[who, usage, top, identity], variables=[
                         datasource_variable(), INSTANCE_VAR, GPU_VAR,
                         query_variable("namespace", "Namespace",
                                        'label_values(accelstats_container_info{instance=~"$instance"}, namespace)'),
                         query_variable("pod", "Pod", 'label_values(accelstats_container_info{instance=~"$instance", '
                                        'namespace=~"$namespace"}, pod)'),
                         query_variable("alloc", "Nomad allocation",
                                        'label_values(accelstats_container_info{instance=~"$instance"}, alloc_id)'),
                         custom_variable("topn", "Top N", ["5", "10", "20"]),
                     ])


# --- MPS and file devices --------------------------------------------------------------------------

def mps_files() -> dict[str, object]:
    """MPS control daemons (health, servers, clients, shares) and file devices (health, size, age)."""
    res = f'{INSTANCE}, resource=~"$resource"'
    mps = Row("MPS control daemons", [
        Panel("MPS daemons down", "MPS resources whose control daemon did not answer a health command within its "
              "timeout (accelstats_mps_daemon_up = 0).", "none",
              [Query(f"count(accelstats_mps_daemon_up{{{res}}} == 0) or vector(0)")], "stat", 4, 8, red_from=1),
        Panel("MPS daemon health", "1 while the resource's control daemon answers (accelstats_mps_daemon_up).",
              "none", [Query(f"accelstats_mps_daemon_up{{{res}}}", "{{instance}} {{resource}}")],
              "state-timeline", 10, 8, mappings=UP_DOWN),
        Panel("MPS servers and clients", "MPS servers the control daemon runs (accelstats_mps_servers) and the "
              "client processes connected to them (accelstats_mps_clients).", "short",
              [Query(f"accelstats_mps_servers{{{res}}}", "{{instance}} {{resource}} servers"),
               Query(f"accelstats_mps_clients{{{res}}}", "{{instance}} {{resource}} clients")], width=10),
        Panel("Active thread share per client", "Default active thread percentage of the daemon, as a ratio: the "
              "share of SMs one client may use (accelstats_mps_active_thread_ratio; 1/replicas).", "percentunit",
              [Query(f"accelstats_mps_active_thread_ratio{{{res}}}", "{{instance}} {{resource}}")],
              "stat", 8, 6, min=0, max=1),
        Panel("Pinned memory limit per client", "Default pinned device memory limit of each client, per GPU "
              "(accelstats_mps_pinned_memory_limit_bytes).", "bytes",
              [Query(f'accelstats_mps_pinned_memory_limit_bytes{{{res}, uuid=~"$gpu"}}',
                     "{{instance}} {{resource}} {{uuid}}")], "stat", 8, 6),
        Panel("MPS processes on GPUs", "Processes NVML lists as MPS clients on each GPU "
              "(accelstats_gpu_processes{type=\"mps\"}).", "short",
              [Query(f'accelstats_gpu_processes{{{GPU}, type="mps"}}', GPU_LEGEND)], width=8, height=6),
    ])
    files = Row("File devices", [
        Panel("File devices", "File devices the exporters list (accelstats_file_device_info).", "none",
              [Query(f"count(accelstats_file_device_info{{{INSTANCE}}})")], "stat", 4, 8),
        Panel("Unhealthy file devices", "File devices whose permissions equal the configured unhealthy "
              "permissions (accelstats_file_device_healthy = 0).", "none",
              [Query(f"count(accelstats_file_device_healthy{{{INSTANCE}}} == 0) or vector(0)")], "stat", 4, 8,
              red_from=1),
        Panel("File device health", "1 unless the file's permissions equal the configured unhealthy permissions "
              "(accelstats_file_device_healthy).", "none",
              [Query(f"accelstats_file_device_healthy{{{INSTANCE}}}", "{{instance}} {{device}}")],
              "state-timeline", 16, 8, mappings={0: ("unhealthy", "red"), 1: ("healthy", "green")}),
        Panel("File device size", "Size of each file device (accelstats_file_device_size_bytes).", "bytes",
              [Query(f"accelstats_file_device_size_bytes{{{INSTANCE}}}", "{{instance}} {{device}}")]),
        Panel("Time since last modification", "Age of each file device's modification time "
              "(time() - accelstats_file_device_modified_timestamp_seconds).", "s",
              [Query(f"time() - accelstats_file_device_modified_timestamp_seconds{{{INSTANCE}}}",
                     "{{instance}} {{device}}")]),
        Panel("File device list", "Each file device with its vendor, type, name and path, and whether it is "
              "healthy (accelstats_file_device_healthy).", "none",
              [Query(f"accelstats_file_device_healthy{{{INSTANCE}}}")], "table", 24, 8,
              mappings={0: ("unhealthy", "red"), 1: ("healthy", "green")}),
    ])
    return dashboard(uid="accelstats-mps-files", title="accelstats / MPS and file devices",
                     description="NVIDIA MPS control daemons and Nomad-style file devices (accelstats exporter).",
                     tags=TAGS, rows=[mps, files], variables=[
                         datasource_variable(), INSTANCE_VAR, GPU_VAR,
                         query_variable("resource", "MPS resource",
                                        'label_values(accelstats_mps_daemon_up{instance=~"$instance"}, resource)'),
                     ])


DASHBOARDS = {"gpu-fleet.json": fleet, "containers.json": containers, "mps-and-file-devices.json": mps_files}


def render() -> dict[str, str]:
    """{file name: JSON text} of every dashboard, as written to ``grafana/dashboards``."""
    return {name: _json(build()) for name, build in DASHBOARDS.items()}


def main(argv: list[str]) -> int:
    """Write the dashboards, or with ``--check`` report stale ones (exit 1)."""
    check = argv[1:] == ["--check"]
    if argv[1:] and not check:
        print(f"usage: {argv[0]} [--check]", file=sys.stderr)
        return 2
    stale = []
    for name, text in render().items():
        path = OUT / name
        if check:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path))
        else:
            OUT.mkdir(exist_ok=True)
            path.write_text(text)
    if stale:
        print("stale (run python3 grafana/generate.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
