#!/usr/bin/env python3
"""Generate ``grafana/dashboards/*.json`` from the panel tables below, with grafana-foundation-sdk.

    pip install -e '.[test]'              # the `test` extra pins grafana-foundation-sdk (Python 3.11+)
    python3 grafana/generate.py           # rewrite the JSON files
    python3 grafana/generate.py --check   # exit 1 and name the stale files if they differ

Every dashboard, row, panel, query and variable is an SDK builder (``grafana_foundation_sdk.builders``;
the house defaults are in ``panels.py``) and the JSON is the SDK's encoding of Grafana's typed model.

``tests/operations/test_dashboards.py`` fails when the committed JSON is not what this script writes, and checks
every metric named here against ``accelstats/catalog.py``; ``tests/core/test_e2e_prometheus.py`` sends
every query to a real Prometheus scraping a real exporter. Families and their meaning:
``../shared/spec/metrics.md``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grafana_foundation_sdk.builders.dashboard import QueryVariable
from grafana_foundation_sdk.models.dashboard import Dashboard
from panels import (
    Row,
    bars,
    custom_variable,
    dashboard,
    datasource_variable,
    grid,
    pie,
    query,
    query_variable,
    single,
    thresholds,
    timeline,
    to_json,
    ts,
    value_mappings,
)

HERE = Path(__file__).resolve().parent
OUT = HERE / "dashboards"

INSTANCE = 'instance=~"$instance"'
GPU = f'{INSTANCE}, uuid=~"$gpu"'
GPU_LEGEND = "{{instance}} GPU {{gpu}}"
UP_DOWN = {0: ("down", "red"), 1: ("up", "green")}
YES_NO = {0: ("no", "green"), 1: ("yes", "red")}
ACTIVE = {1: ("active", "orange")}
OK_FAILED = {0: ("failed", "red"), 1: ("ok", "green")}
HEALTHY = {0: ("unhealthy", "red"), 1: ("healthy", "green")}
TAGS = ("accelstats", "gpu", "nvidia")


def instance_variable() -> QueryVariable:
    """The ``instance`` variable: exporters that publish accelstats_build_info."""
    return query_variable("instance", "Instance", "label_values(accelstats_build_info, instance)")


def gpu_variable() -> QueryVariable:
    """The ``gpu`` variable: GPU and MIG UUIDs of the selected exporters."""
    return query_variable("gpu", "GPU (UUID)", 'label_values(accelstats_gpu_info{instance=~"$instance"}, uuid)')


# --- GPU fleet --------------------------------------------------------------------------------------

def fleet() -> Dashboard:
    """Per node and GPU: health, utilisation, memory, power, energy, temperature, clocks, throttling,
    ECC / row remapping / XID, PCIe, and the exporter's own collectors."""
    overview: Row = ("Overview", [
        single("GPUs", "GPUs and MIG instances the selected exporters enumerate (accelstats_gpu_info).", "none",
               [query(f"count(accelstats_gpu_info{{{GPU}}})")], 4, 4),
        single("GPUs down", "Devices that did not answer NVML in the last collection (accelstats_gpu_up = 0: GPU "
               "lost, or an NVML call past the deadline).", "none",
               [query(f"count(accelstats_gpu_up{{{GPU}}} == 0) or vector(0)")], 4, 4).thresholds(thresholds(1)),
        single("Mean GPU utilisation", "Mean of accelstats_gpu_utilization_ratio over the selected GPUs (NVML "
               "utilisation samples since the previous scrape).", "percentunit",
               [query(f"avg(accelstats_gpu_utilization_ratio{{{GPU}}})")], 4, 4).min(0).max(1),
        single("Framebuffer memory in use", "Used over total framebuffer memory of the selected GPUs (NVML memory "
               "info v2).", "percentunit",
               [query(f"sum(accelstats_gpu_memory_used_bytes{{{GPU}}}) / "
                      f"sum(accelstats_gpu_memory_total_bytes{{{GPU}}})")], 4, 4).min(0).max(1),
        single("Power draw", "Sum of the boards' power draw (accelstats_gpu_power_watts).", "watt",
               [query(f"sum(accelstats_gpu_power_watts{{{GPU}}})")], 4, 4),
        single("XID errors", "Critical XID errors counted by the exporters (accelstats_gpu_xid_errors_total), summed "
               "over the GPUs; counters restart with the exporter.", "none",
               [query(f"sum(accelstats_gpu_xid_errors_total{{{GPU}}}) or vector(0)")], 4, 4).thresholds(thresholds(1)),
        grid("Devices down", "GPUs whose last collection failed (accelstats_gpu_up == 0), by node. Empty when every "
             "GPU answers.", "none",
             [query(f"accelstats_gpu_up{{{GPU}}} == 0")], 8, 6).mappings(value_mappings(UP_DOWN)),
        grid("GPU inventory", "Identity of each device: model, driver and CUDA versions, MIG and compute modes, PCI "
             "bus id, and source (nvml, or replay for a recorded capture) (accelstats_gpu_info).", "none",
             [query(f"accelstats_gpu_info{{{GPU}}}")], 16, 6),
    ])
    usage: Row = ("Utilisation and memory", [
        ts("GPU utilisation", "Fraction of time a kernel ran, mean of NVML samples since the previous scrape "
           "(accelstats_gpu_utilization_ratio; absent for MIG instances).", "percentunit",
           [query(f"accelstats_gpu_utilization_ratio{{{GPU}}}", GPU_LEGEND)]).min(0).max(1),
        ts("Memory controller utilisation", "Fraction of the last sample period the memory controller was busy "
           "(accelstats_gpu_memory_utilization_ratio).", "percentunit",
           [query(f"accelstats_gpu_memory_utilization_ratio{{{GPU}}}", GPU_LEGEND)]).min(0).max(1),
        ts("Framebuffer memory used", "Used framebuffer memory per GPU, NVML memory info v2 "
           "(accelstats_gpu_memory_used_bytes), and the total as a dashed ceiling.", "bytes",
           [query(f"accelstats_gpu_memory_used_bytes{{{GPU}}}", GPU_LEGEND),
            query(f"accelstats_gpu_memory_total_bytes{{{GPU}}}", GPU_LEGEND + " total")]),
        ts("Processes per GPU", "Processes NVML lists on each GPU, by type: compute, graphics, mps "
           "(accelstats_gpu_processes).", "short",
           [query(f"accelstats_gpu_processes{{{GPU}}}", GPU_LEGEND + " {{type}}")]),
    ])
    profiling: Row = ("Profiling (GPM) and NVLink", [
        ts("SM activity and occupancy", "Fraction of SMs busy (accelstats_gpu_sm_active_ratio) and resident warps "
           "as a fraction of the maximum (accelstats_gpu_sm_occupancy_ratio), from NVML's GPM over the profiling "
           "interval; Hopper and newer, MIG instances included. A kernel can keep utilisation at 100% with few "
           "SMs busy.", "percentunit",
           [query(f"accelstats_gpu_sm_active_ratio{{{GPU}}}", GPU_LEGEND + " SM active"),
            query(f"accelstats_gpu_sm_occupancy_ratio{{{GPU}}}", GPU_LEGEND + " occupancy")]).min(0).max(1),
        ts("Tensor core activity", "Fraction of time the tensor pipes were busy, by pipe "
           "(accelstats_gpu_tensor_active_ratio; any, hmma, imma, dfma, dmma).", "percentunit",
           [query(f"accelstats_gpu_tensor_active_ratio{{{GPU}}}", GPU_LEGEND + " {{pipe}}")]).min(0).max(1),
        ts("DRAM bandwidth used", "Fraction of the peak device-memory bandwidth used "
           "(accelstats_gpu_dram_active_ratio): high for memory-bound kernels.", "percentunit",
           [query(f"accelstats_gpu_dram_active_ratio{{{GPU}}}", GPU_LEGEND)]).min(0).max(1),
        ts("FP64, FP32, FP16 and integer pipes", "Fraction of time the SMs did non-tensor math, by pipe "
           "(accelstats_gpu_pipe_active_ratio).", "percentunit",
           [query(f"accelstats_gpu_pipe_active_ratio{{{GPU}}}", GPU_LEGEND + " {{pipe}}")]).min(0).max(1),
        ts("NVLink throughput", "NVLink payload per second by link and direction (rate of "
           "accelstats_gpu_nvlink_data_bytes_total; tx sent, rx received).", "Bps",
           [query(f"rate(accelstats_gpu_nvlink_data_bytes_total{{{GPU}}}[$__rate_interval])",
                  GPU_LEGEND + " link {{link}} {{direction}}")]),
        timeline("NVLink links", "Each NVLink link up or down (accelstats_gpu_nvlink_up, "
                 "nvmlDeviceGetNvLinkState).", "none",
                 [query(f"accelstats_gpu_nvlink_up{{{GPU}}}", GPU_LEGEND + " link {{link}}")], 12, 8, UP_DOWN),
        ts("NVLink errors per second", "NVLink data-link errors by link and type (rate of "
           "accelstats_gpu_nvlink_errors_total; crc_flit, replay, recovery).", "short",
           [query(f"rate(accelstats_gpu_nvlink_errors_total{{{GPU}}}[$__rate_interval])",
                  GPU_LEGEND + " link {{link}} {{type}}")], 24, 8),
    ])
    power: Row = ("Power, energy and temperature", [
        ts("Power draw and limit", "Board power draw (accelstats_gpu_power_watts) and the enforced power limit "
           "(accelstats_gpu_power_limit_watts).", "watt",
           [query(f"accelstats_gpu_power_watts{{{GPU}}}", GPU_LEGEND),
            query(f"accelstats_gpu_power_limit_watts{{{GPU}}}", GPU_LEGEND + " limit")]),
        ts("Energy rate", "Average power over the rate window from the energy counter (rate of "
           "accelstats_gpu_energy_joules_total): includes every moment, not only the sampled ones.", "watt",
           [query(f"rate(accelstats_gpu_energy_joules_total{{{GPU}}}[$__rate_interval])", GPU_LEGEND)]),
        bars("Energy used in the time range", "Energy each GPU used over the dashboard's time range (increase of "
             "accelstats_gpu_energy_joules_total).", "joule",
             [query(f"increase(accelstats_gpu_energy_joules_total{{{GPU}}}[$__range])", GPU_LEGEND)]),
        ts("Temperature", "GPU die and HBM temperatures by sensor (accelstats_gpu_temperature_celsius).", "celsius",
           [query(f"accelstats_gpu_temperature_celsius{{{GPU}}}", GPU_LEGEND + " {{sensor}}")]),
    ])
    clocks: Row = ("Clocks and throttling", [
        ts("Clocks", "Current SM and memory clocks (accelstats_gpu_clock_hertz).", "hertz",
           [query(f'accelstats_gpu_clock_hertz{{{GPU}, clock=~"sm|memory"}}', GPU_LEGEND + " {{clock}}")]),
        ts("SM clock against its maximum", "Current SM clock over the maximum SM clock (accelstats_gpu_clock_hertz / "
           "accelstats_gpu_clock_max_hertz); low while throttled or idle.", "percentunit",
           [query(f'accelstats_gpu_clock_hertz{{{GPU}, clock="sm"}} / accelstats_gpu_clock_max_hertz{{{GPU}, '
                  'clock="sm"}', GPU_LEGEND)]).min(0).max(1),
        timeline("Active clock event (throttle) reasons", "Clock event reasons NVML reports active, one line per "
                 "reason (accelstats_gpu_clock_event_active = 1): power caps, thermal slowdown, sync boost, ...",
                 "bool_yes_no", [query(f"accelstats_gpu_clock_event_active{{{GPU}}} == 1", GPU_LEGEND + " {{reason}}")],
                 12, 8, ACTIVE),
        ts("Performance state", "NVML performance state, 0 = highest performance "
           "(accelstats_gpu_performance_state).", "none",
           [query(f"accelstats_gpu_performance_state{{{GPU}}}", GPU_LEGEND)]),
    ])
    errors: Row = ("Errors: ECC, row remapping, XID", [
        ts("ECC errors in the rate window", "Increase of the volatile ECC error counters (since the driver loaded), "
           "by type (accelstats_gpu_ecc_errors_total{scope=\"volatile\"}).", "short",
           [query(f'increase(accelstats_gpu_ecc_errors_total{{{GPU}, scope="volatile"}}[$__rate_interval])',
                  GPU_LEGEND + " {{type}}")]),
        grid("ECC errors (lifetime)", "Aggregate ECC error counters, kept by the GPU across driver reloads "
             "(accelstats_gpu_ecc_errors_total{scope=\"aggregate\"}).", "short",
             [query(f'accelstats_gpu_ecc_errors_total{{{GPU}, scope="aggregate"}}')], 12, 8).thresholds(thresholds(1)),
        grid("Remapped rows", "HBM rows remapped, by the error type that caused it "
             "(accelstats_gpu_remapped_rows_total).", "short",
             [query(f"accelstats_gpu_remapped_rows_total{{{GPU}}}")], 8, 8).thresholds(thresholds(1)),
        timeline("Row remapping pending or failed", "A pending remap needs a GPU reset "
                 "(accelstats_gpu_row_remap_pending); a failed one means the GPU needs service "
                 "(accelstats_gpu_row_remap_failure).", "bool_yes_no",
                 [query(f"accelstats_gpu_row_remap_pending{{{GPU}}}", GPU_LEGEND + " pending"),
                  query(f"accelstats_gpu_row_remap_failure{{{GPU}}}", GPU_LEGEND + " failed")], 8, 8, YES_NO),
        grid("XID errors", "Critical XID errors per GPU and XID since the exporter started "
             "(accelstats_gpu_xid_errors_total, from NVML's event set).", "short",
             [query(f"accelstats_gpu_xid_errors_total{{{GPU}}}")], 8, 8).thresholds(thresholds(1)),
    ])
    pcie: Row = ("PCIe", [
        ts("PCIe throughput", "PCIe traffic by direction (tx = GPU to host, rx = host to GPU), sampled in the "
           "background (accelstats_gpu_pcie_throughput_bytes_per_second).", "Bps",
           [query(f"accelstats_gpu_pcie_throughput_bytes_per_second{{{GPU}}}", GPU_LEGEND + " {{direction}}")]),
        ts("PCIe replays per second", "Rate of PCIe link replays (retransmissions after link errors) "
           "(accelstats_gpu_pcie_replays_total).", "short",
           [query(f"rate(accelstats_gpu_pcie_replays_total{{{GPU}}}[$__rate_interval])", GPU_LEGEND)]),
        grid("PCIe link", "Current PCIe link generation (accelstats_gpu_pcie_link_generation) and width in lanes "
             "(accelstats_gpu_pcie_link_width); idle GPUs train down to save power.", "none",
             [query(f"accelstats_gpu_pcie_link_generation{{{GPU}}}"),
              query(f"accelstats_gpu_pcie_link_width{{{GPU}}}")],
             24, 6, columns={"Value #A": "generation", "Value #B": "lanes"}),
    ])
    exporter: Row = ("Exporter", [
        timeline("Collector success", "1 when the collector succeeded in the last scrape "
                 "(accelstats_scrape_collector_success).", "none",
                 [query(f"accelstats_scrape_collector_success{{{INSTANCE}}}", "{{instance}} {{collector}}")],
                 8, 6, OK_FAILED),
        ts("Collector duration", "Time each collector took in a scrape "
           "(accelstats_scrape_collector_duration_seconds).", "s",
           [query(f"accelstats_scrape_collector_duration_seconds{{{INSTANCE}}}", "{{instance}} {{collector}}")], 8, 6),
        ts("NVML errors", "Failed NVML calls per second by call and error, NOT_SUPPORTED excluded "
           "(accelstats_nvml_errors_total).", "short",
           [query(f"sum by (instance, call, error) (rate(accelstats_nvml_errors_total{{{INSTANCE}}}"
                  "[$__rate_interval]))", "{{instance}} {{call}} {{error}}")], 8, 6),
        ts("Age of each GPU's readings", "Seconds since NVML last read the GPU "
           "(time() - accelstats_gpu_last_success_timestamp_seconds). Close to the scrape interval when all is "
           "well; growing while an NVML call hangs on this or another GPU of the node, or NVML is down: the "
           "values shown for it are as old as this.", "s",
           [query(f"time() - accelstats_gpu_last_success_timestamp_seconds{{{GPU}}}", GPU_LEGEND)], 12, 6).min(0),
        ts("Age of each collector's results", "Seconds since each collector (and the attribution) last "
           "succeeded (time() - accelstats_scrape_collector_last_success_timestamp_seconds): a collector past "
           "the collection deadline, or failing, serves results this old.", "s",
           [query(f"time() - accelstats_scrape_collector_last_success_timestamp_seconds{{{INSTANCE}}}",
                  "{{instance}} {{collector}}")], 12, 6).min(0),
    ])
    return dashboard(uid="accelstats-gpu-fleet", title="accelstats / GPU fleet",
                     description="NVIDIA GPUs per node: utilisation, memory, profiling (GPM) and NVLink, power, "
                     "temperature, clocks, errors, PCIe (accelstats exporter).", tags=TAGS,
                     variables=[datasource_variable(), instance_variable(), gpu_variable()],
                     rows=[overview, usage, profiling, power, clocks, errors, pcie, exporter])


# --- Containers ---------------------------------------------------------------------------------------

def _in_containers(metric: str, gpu_label: str = "uuid", info: str = "", extra: str = "") -> str:
    """``metric`` of the selected containers (``extra``: more label matchers, ``, name="value"``), with
    the runtime and the Nomad allocation and task of ``accelstats_container_info`` joined on
    (instance, job, id)."""
    sel = f'{INSTANCE}, {gpu_label}=~"$gpu", namespace=~"$namespace", pod=~"$pod"{extra}'
    return (f"({metric}{{{sel}}} * on (instance, job, id) group_left (runtime, alloc_id, task) "
            f'accelstats_container_info{{{INSTANCE}, alloc_id=~"$alloc"{info}}})')


WORKLOAD = "instance, runtime, namespace, pod, container, name, alloc_id, task"
CTR_LEGEND = "{{instance}} {{runtime}} {{namespace}}/{{pod}} {{container}} {{name}}"


def containers() -> Dashboard:
    """Per container, pod or Nomad allocation: which GPUs, memory, SM utilisation, processes,
    attribution, top consumers."""
    mem = _in_containers("accelstats_container_gpu_memory_used_bytes")
    sm = _in_containers("accelstats_container_gpu_sm_utilization_ratio")
    procs = _in_containers("accelstats_container_gpu_processes")
    duty = _in_containers("container_accelerator_duty_cycle", "acc_id")
    pod_mem = _in_containers("accelstats_container_gpu_memory_used_bytes", info=', pod!=""')
    alloc_mem = _in_containers("accelstats_container_gpu_memory_used_bytes", info=', alloc_id!=""')
    who: Row = ("Who uses which GPU", [
        single("Containers holding a GPU", "Containers with at least one attributed device "
               "(accelstats_container_info).", "none",
               [query(f'count(accelstats_container_info{{{INSTANCE}, namespace=~"$namespace", pod=~"$pod", '
                      'alloc_id=~"$alloc"})')], 4, 8),
        pie("Attribution sources", "How each (container, GPU) pair was found: devices_cgroup (the devices cgroup "
            "grants the GPU: cgroup v1 devices.list, cgroup v2 device programs), process (NVML lists a "
            "process of the container on it) or open_fd (a process holds "
            "/dev/nvidia<minor> open).", "short",
            [query(f"count by (attribution) ({procs})", "{{attribution}}")], 6, 8),
        grid("Containers and their GPUs", "One line per (container, GPU): runtime, Kubernetes pod or Nomad "
             "allocation, GPU, attribution source, the container's processes on it, the device memory they use (sum "
             "of NVML usedGpuMemory) and their SM utilisation (accelstats_container_gpu_*).", "short",
             [query(procs), query(mem), query(sm)], 14, 8,
             columns={"Value #A": "processes", "Value #B": "memory used", "Value #C": "SM utilisation"},
             column_units={"Value #B": "bytes", "Value #C": "percentunit"}),
    ])
    usage: Row = ("Usage over time", [
        ts("GPU memory used by container", "Device memory used by each container's processes, per GPU "
           "(accelstats_container_gpu_memory_used_bytes).", "bytes",
           [query(f"sum by ({WORKLOAD}, gpu) ({mem})", CTR_LEGEND + " GPU {{gpu}}")]),
        ts("SM utilisation by container", "SM utilisation of each container's processes since the previous scrape, "
           "per GPU (accelstats_container_gpu_sm_utilization_ratio); 1 = the whole GPU.", "percentunit",
           [query(f"sum by ({WORKLOAD}, gpu) ({sm})", CTR_LEGEND + " GPU {{gpu}}")]).min(0),
        ts("Processes by container", "Each container's processes on each GPU "
           "(accelstats_container_gpu_processes).", "short",
           [query(f"sum by ({WORKLOAD}, gpu) ({procs})", CTR_LEGEND + " GPU {{gpu}}")]),
        ts("Device duty cycle (cAdvisor view)", "Utilisation of the whole device each container holds, in percent, as "
           "cAdvisor published it (container_accelerator_duty_cycle): device-wide, so containers sharing a GPU show "
           "the same value.", "percent",
           [query(f"max by ({WORKLOAD}, acc_id) ({duty})", CTR_LEGEND + " {{acc_id}}")]).min(0).max(100),
    ])
    top: Row = ("Top consumers", [
        bars("Top $topn containers by GPU memory", "Containers using the most device memory, summed over their GPUs "
             "(accelstats_container_gpu_memory_used_bytes).", "bytes",
             [query(f"topk($topn, sum by ({WORKLOAD}) ({mem}))", CTR_LEGEND)]),
        bars("Top $topn containers by SM utilisation", "Containers using the most SM time, summed over their GPUs "
             "(accelstats_container_gpu_sm_utilization_ratio); 1 = one whole GPU.", "percentunit",
             [query(f"topk($topn, sum by ({WORKLOAD}) ({sm}))", CTR_LEGEND)]),
        bars("Top $topn pods by GPU memory", "Kubernetes pods using the most device memory, all their containers and "
             "GPUs together (accelstats_container_gpu_memory_used_bytes).", "bytes",
             [query(f"topk($topn, sum by (namespace, pod) ({pod_mem}))", "{{namespace}}/{{pod}}")]),
        bars("Top $topn Nomad allocations by GPU memory", "Nomad allocations using the most device memory, all their "
             "tasks and GPUs together (accelstats_container_gpu_memory_used_bytes).", "bytes",
             [query(f"topk($topn, sum by (alloc_id) ({alloc_mem}))", "{{alloc_id}}")]),
    ])
    # GPUs allocated and idle: the one-line query of docs/containers.md and of the alert
    # AccelstatsGpuAllocatedIdle (prometheus/accelstats.rules.yml)
    idle = (_in_containers("accelstats_container_gpu_processes", extra=', attribution="devices_cgroup"') + " == 0 "
            "unless on (instance, job, id, uuid) accelstats_container_gpu_device_open == 1")
    allocated: Row = ("Allocated and idle", [
        single("GPU allocations idle", "GPUs granted to a container by its devices cgroup (cgroup v1 devices.list, "
               "v2 device programs) on which none of its processes runs and which none of them holds open: paid "
               'for and unused (accelstats_container_gpu_processes{attribution="devices_cgroup"} == 0, unless '
               "accelstats_container_gpu_device_open == 1: monitoring agents hold the GPUs they watch open).",
               "none",
               [query(f"count({idle}) or vector(0)")], 4, 8),
        grid("Idle GPU allocations", "One line per (container, GPU) allocated and idle: the container, its pod or "
             "Nomad allocation, and the GPU (accelstats_container_gpu_processes == 0 with attribution "
             "devices_cgroup, and no process of it holding the device open).", "short", [query(idle)], 20, 8,
             columns={"Value": "processes"}),
    ])
    pods = f'{INSTANCE}, namespace=~"$namespace", pod=~"$pod"'
    unallocated = f'accelstats_container_gpu_unallocated{{{pods}}}'
    kubelet: Row = ("Kubernetes allocations (kubelet pod-resources)", [
        single("GPUs allocated by the kubelet", "Devices the kubelet's pod-resources List reports allocated to "
               "containers by device plugins (accelstats_kubernetes_gpu_allocation) and through DRA claims "
               "(accelstats_kubernetes_gpu_claim_allocation). Empty on hosts without a pod-resources socket.",
               "none", [query(f"count(accelstats_kubernetes_gpu_allocation{{{pods}}}) + "
                              f"(count(accelstats_kubernetes_gpu_claim_allocation{{{pods}}}) or vector(0))")], 4, 8),
        single("GPU use without allocation", "(container, GPU) pairs in use (devices cgroup, process or open "
               "file) that the kubelet allocated to no container of that name: NVIDIA_VISIBLE_DEVICES=all, "
               "privileged pods, a hostPath /dev, containers outside Kubernetes (accelstats_container_gpu_unallocated; "
               "alert AccelstatsContainerGpuNotAllocated).", "none",
               [query(f"count({unallocated}) or vector(0)")], 4, 8),
        grid("Allocations", "One line per device a device plugin allocated: pod, container, resource "
             "(nvidia.com/gpu, nvidia.com/mig-…, a shared resource), the GPU or MIG instance and the sharing "
             "replica (accelstats_kubernetes_gpu_allocation).", "none",
             [query(f"accelstats_kubernetes_gpu_allocation{{{pods}}}")], 16, 8),
        grid("DRA claims", "One line per device of a DRA resource claim a container uses: claim, driver, pool, "
             "device and the GPU its CDI spec names, uuid empty where no CDI spec on the host names one "
             "(accelstats_kubernetes_gpu_claim_allocation).", "none",
             [query(f"accelstats_kubernetes_gpu_claim_allocation{{{pods}}}")], 12, 8),
        grid("GPU use the kubelet did not allocate", "One line per (container, GPU) in use without the kubelet's "
             "allocation to that container, with how the use was found (attribution) "
             "(accelstats_container_gpu_unallocated).", "none", [query(unallocated)], 12, 8),
    ])
    identity: Row = ("Identity", [
        grid("Container identity", "Every container holding a GPU: runtime, container id, image, pod uid, Nomad "
             "allocation and task (accelstats_container_info).", "none",
             [query(f'accelstats_container_info{{{INSTANCE}, namespace=~"$namespace", pod=~"$pod", '
                    'alloc_id=~"$alloc"}')], 24, 8),
    ])
    return dashboard(uid="accelstats-containers", title="accelstats / Containers",
                     description="GPU use per container, Kubernetes pod and Nomad allocation (accelstats exporter).",
                     tags=TAGS, rows=[who, allocated, kubelet, usage, top, identity], variables=[
                         datasource_variable(), instance_variable(), gpu_variable(),
                         query_variable("namespace", "Namespace",
                                        'label_values(accelstats_container_info{instance=~"$instance"}, namespace)'),
                         query_variable("pod", "Pod", 'label_values(accelstats_container_info{instance=~"$instance", '
                                        'namespace=~"$namespace"}, pod)'),
                         query_variable("alloc", "Nomad allocation",
                                        'label_values(accelstats_container_info{instance=~"$instance"}, alloc_id)'),
                         custom_variable("topn", "Top N", ["5", "10", "20"]),
                     ])


# --- GPU accounting ------------------------------------------------------------------------------

ACCOUNTED = f'{INSTANCE}, uuid=~"$gpu", namespace=~"$namespace", pod=~"$pod"'
HOURS, KWH = 3600, 3.6e6  # seconds per hour, joules per kWh
IN_PODS = ', pod!=""'


def _over_range(metric: str, scale: float = 1, fn: str = "increase", window: str = "$__range",
                extra: str = "") -> str:
    """``fn(metric[window])`` of the selected containers (``extra``: more matchers, ``, pod!=""``),
    divided by ``scale`` (hours, kWh)."""
    expr = f"{fn}({metric}{{{ACCOUNTED}{extra}}}[{window}])"
    return f"{expr} / {scale:g}" if scale != 1 else expr


def _per_alloc(expr: str) -> str:
    """``expr`` (per container series) with the Nomad allocation and task of the containers joined on
    from ``accelstats_container_info`` over the range (a container that ended keeps its allocation)."""
    return (f"({expr}) * on (instance, job, id) group_left (alloc_id, task) group by (instance, job, id, alloc_id, "
            f'task) (max_over_time(accelstats_container_info{{{INSTANCE}, alloc_id=~"$alloc", alloc_id!=""}}'
            "[$__range]))")


def accounting() -> Dashboard:
    """Chargeback: GPU-hours and kWh per namespace, pod, Nomad allocation and container over the range,
    allocated against used, idle allocations (accelstats_container_gpu_*_total counters)."""
    sm = "accelstats_container_gpu_sm_seconds_total"
    allocated = "accelstats_container_gpu_allocated_seconds_total"
    idle = "accelstats_container_gpu_idle_seconds_total"
    energy = "accelstats_container_gpu_energy_joules_total"
    memory = "accelstats_container_gpu_memory_byte_seconds_total"
    gpu_energy = f'{INSTANCE}, uuid=~"$gpu"'
    totals: Row = ("Totals over the dashboard's range", [
        single("GPU-hours used", "SM-busy GPU-hours of the selected containers: every NVML per-process "
               "utilisation sample integrated once (increase of accelstats_container_gpu_sm_seconds_total / 3600).",
               "h", [query(f"sum({_over_range(sm, HOURS)})")], 4, 6),
        single("GPU-hours allocated", "GPU-hours the selected containers' devices cgroups granted them "
               "(accelstats_container_gpu_allocated_seconds_total / 3600).", "h",
               [query(f"sum({_over_range(allocated, HOURS)})")], 4, 6),
        single("GPU-hours allocated and idle", "Allocated GPU-hours in which none of the container's processes was "
               "SM-busy (accelstats_container_gpu_idle_seconds_total / 3600).", "h",
               [query(f"sum({_over_range(idle, HOURS)})")], 4, 6),
        single("Energy of containers", "kWh of the selected containers: each GPU energy delta split by SM-busy "
               "seconds (accelstats_container_gpu_energy_joules_total / 3.6e6).", "kwatth",
               [query(f"sum({_over_range(energy, KWH)})")], 4, 6),
        single("Idle GPU energy", "kWh the selected GPUs used while no process was SM-busy on them "
               "(accelstats_gpu_idle_energy_joules_total / 3.6e6).", "kwatth",
               [query(f"sum(increase(accelstats_gpu_idle_energy_joules_total{{{gpu_energy}}}[$__range])) / "
                      f"{KWH:g}")], 4, 6),
        single("Unattributed GPU energy", "kWh of busy processes outside containers, and of GPUs that report no "
               "per-process utilisation (MIG mode) (accelstats_gpu_unattributed_energy_joules_total / 3.6e6).",
               "kwatth", [query(f"sum(increase(accelstats_gpu_unattributed_energy_joules_total{{{gpu_energy}}}"
                                f"[$__range])) / {KWH:g}")], 4, 6),
    ])
    by: Row = ("By namespace, pod, Nomad allocation and container", [
        bars("GPU-hours used by namespace", "SM-busy GPU-hours per Kubernetes namespace over the range "
             '(containers outside Kubernetes: namespace "").', "h",
             [query(f"sort_desc(sum by (namespace) ({_over_range(sm, HOURS)}))", "{{namespace}}")], 8),
        bars("Energy by namespace", "kWh per Kubernetes namespace over the range.", "kwatth",
             [query(f"sort_desc(sum by (namespace) ({_over_range(energy, KWH)}))", "{{namespace}}")], 8),
        bars("GPU-hours allocated by namespace", "Allocated GPU-hours per Kubernetes namespace over the range.", "h",
             [query(f"sort_desc(sum by (namespace) ({_over_range(allocated, HOURS)}))", "{{namespace}}")], 8),
        bars("Top $topn pods by GPU-hours used", "SM-busy GPU-hours per pod, all its containers and GPUs together.",
             "h", [query(f"topk($topn, sum by (namespace, pod) ({_over_range(sm, HOURS, extra=IN_PODS)}))",
                         "{{namespace}}/{{pod}}")], 8),
        bars("Top $topn Nomad allocations by GPU-hours used", "SM-busy GPU-hours per Nomad allocation and task "
             "(allocation from accelstats_container_info).", "h",
             [query(f"topk($topn, sum by (alloc_id, task) ({_per_alloc(_over_range(sm, HOURS))}))",
                    "{{alloc_id}} {{task}}")], 8),
        bars("Top $topn containers by energy", "kWh per container (its name, or its cgroup when it has none).",
             "kwatth", [query(f"topk($topn, sum by (instance, namespace, pod, container, name, id) "
                              f"({_over_range(energy, KWH)}))", "{{instance}} {{namespace}}/{{pod}} {{container}} "
                              "{{name}}")], 8),
    ])
    use: Row = ("Allocated against used", [
        ts("GPUs allocated and used", "GPUs granted to the selected containers (rate of allocated seconds) against "
           "GPUs kept SM-busy by them (rate of SM-busy seconds); the gap is paid for and unused.", "short",
           [query(f"sum({_over_range(allocated, fn='rate', window='$__rate_interval')})", "allocated"),
            query(f"sum({_over_range(sm, fn='rate', window='$__rate_interval')})", "used (SM-busy)")]).min(0),
        ts("Power by namespace", "Watts of GPU energy each namespace's containers took (rate of their energy "
           "shares), with the GPUs' idle and unattributed power.", "watt",
           [query(f"sum by (namespace) ({_over_range(energy, fn='rate', window='$__rate_interval')})",
                  "{{namespace}}"),
            query(f"sum(rate(accelstats_gpu_idle_energy_joules_total{{{gpu_energy}}}[$__rate_interval]))", "idle"),
            query(f"sum(rate(accelstats_gpu_unattributed_energy_joules_total{{{gpu_energy}}}[$__rate_interval]))",
                  "unattributed")]).min(0),
        grid("Top $topn idle allocations", "Containers with the most allocated GPU-hours in which they did nothing "
             "(increase of accelstats_container_gpu_idle_seconds_total / 3600), with their allocated GPU-hours and "
             "the device memory they held (GiB-hours).", "h",
             [query(f"topk($topn, {_over_range(idle, HOURS)})"), query(_over_range(allocated, HOURS)),
              query(_over_range(memory, HOURS * (1 << 30)))], 24, 8,
             columns={"Value #A": "idle GPU-hours", "Value #B": "allocated GPU-hours", "Value #C": "GiB-hours"}),
    ])
    return dashboard(uid="accelstats-accounting", title="accelstats / GPU accounting",
                     description="GPU-hours and energy per namespace, pod, Nomad allocation and container, for "
                                 "chargeback (accelstats exporter's accounting counters).",
                     tags=TAGS, rows=[totals, by, use], variables=[
                         datasource_variable(), instance_variable(), gpu_variable(),
                         # every accounted container has memory byte-seconds (granted or not)
                         query_variable("namespace", "Namespace", 'label_values(accelstats_container_gpu_memory_'
                                        'byte_seconds_total{instance=~"$instance"}, namespace)'),
                         query_variable("pod", "Pod", 'label_values(accelstats_container_gpu_memory_byte_seconds_'
                                        'total{instance=~"$instance", namespace=~"$namespace"}, pod)'),
                         query_variable("alloc", "Nomad allocation",
                                        'label_values(accelstats_container_info{instance=~"$instance"}, alloc_id)'),
                         custom_variable("topn", "Top N", ["5", "10", "20"]),
                     ])


# --- MPS and file devices --------------------------------------------------------------------------

def mps_files() -> Dashboard:
    """MPS control daemons (health, servers, clients, shares) and file devices (health, size, age)."""
    res = f'{INSTANCE}, resource=~"$resource"'
    mps: Row = ("MPS control daemons", [
        single("MPS daemons down", "MPS resources whose control daemon did not answer a health command within its "
               "timeout (accelstats_mps_daemon_up = 0).", "none",
               [query(f"count(accelstats_mps_daemon_up{{{res}}} == 0) or vector(0)")], 4, 8).thresholds(thresholds(1)),
        timeline("MPS daemon health", "1 while the resource's control daemon answers "
                 "(accelstats_mps_daemon_up).", "none",
                 [query(f"accelstats_mps_daemon_up{{{res}}}", "{{instance}} {{resource}}")], 10, 8, UP_DOWN),
        ts("MPS servers and clients", "MPS servers the control daemon runs (accelstats_mps_servers) and the client "
           "processes connected to them (accelstats_mps_clients).", "short",
           [query(f"accelstats_mps_servers{{{res}}}", "{{instance}} {{resource}} servers"),
            query(f"accelstats_mps_clients{{{res}}}", "{{instance}} {{resource}} clients")], 10, 8),
        single("Active thread share per client", "Default active thread percentage of the daemon, as a ratio: the "
               "share of SMs one client may use (accelstats_mps_active_thread_ratio; 1/replicas).", "percentunit",
               [query(f"accelstats_mps_active_thread_ratio{{{res}}}", "{{instance}} {{resource}}")],
               8, 6).min(0).max(1),
        single("Pinned memory limit per client", "Default pinned device memory limit of each client, per GPU "
               "(accelstats_mps_pinned_memory_limit_bytes).", "bytes",
               [query(f'accelstats_mps_pinned_memory_limit_bytes{{{res}, uuid=~"$gpu"}}',
                      "{{instance}} {{resource}} {{uuid}}")], 8, 6),
        ts("MPS processes on GPUs", "Processes NVML lists as MPS clients on each GPU "
           "(accelstats_gpu_processes{type=\"mps\"}).", "short",
           [query(f'accelstats_gpu_processes{{{GPU}, type="mps"}}', GPU_LEGEND)], 8, 6),
    ])
    files: Row = ("File devices", [
        single("File devices", "File devices the exporters list (accelstats_file_device_info).", "none",
               [query(f"count(accelstats_file_device_info{{{INSTANCE}}})")], 4, 8),
        single("Unhealthy file devices", "File devices whose permissions equal the configured unhealthy permissions "
               "(accelstats_file_device_healthy = 0).", "none",
               [query(f"count(accelstats_file_device_healthy{{{INSTANCE}}} == 0) or vector(0)")],
               4, 8).thresholds(thresholds(1)),
        timeline("File device health", "1 unless the file's permissions equal the configured unhealthy permissions "
                 "(accelstats_file_device_healthy).", "none",
                 [query(f"accelstats_file_device_healthy{{{INSTANCE}}}", "{{instance}} {{device}}")],
                 16, 8, HEALTHY),
        ts("File device size", "Size of each file device (accelstats_file_device_size_bytes).", "bytes",
           [query(f"accelstats_file_device_size_bytes{{{INSTANCE}}}", "{{instance}} {{device}}")]),
        ts("Time since last modification", "Age of each file device's modification time (time() - "
           "accelstats_file_device_modified_timestamp_seconds).", "s",
           [query(f"time() - accelstats_file_device_modified_timestamp_seconds{{{INSTANCE}}}",
                  "{{instance}} {{device}}")]),
        grid("File device list", "Each file device with its vendor, type, name and path, and whether it is healthy "
             "(accelstats_file_device_healthy).", "none",
             [query(f"accelstats_file_device_healthy{{{INSTANCE}}}")],
             24, 8).mappings(value_mappings(HEALTHY)),
    ])
    return dashboard(uid="accelstats-mps-files", title="accelstats / MPS and file devices",
                     description="NVIDIA MPS control daemons and Nomad-style file devices (accelstats exporter).",
                     tags=TAGS, rows=[mps, files], variables=[
                         datasource_variable(), instance_variable(), gpu_variable(),
                         query_variable("resource", "MPS resource",
                                        'label_values(accelstats_mps_daemon_up{instance=~"$instance"}, resource)'),
                     ])


DASHBOARDS = {"gpu-fleet.json": fleet, "containers.json": containers, "mps-and-file-devices.json": mps_files,
              "gpu-accounting.json": accounting}


def render() -> dict[str, str]:
    """{file name: JSON text} of every dashboard, as written to ``grafana/dashboards``."""
    return {name: to_json(build()) for name, build in DASHBOARDS.items()}


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
