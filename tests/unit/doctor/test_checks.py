"""Each doctor check with its bad and its good case, from parsed fixture-like output."""

from __future__ import annotations

import base64
import dataclasses

from llmgw_cli.core.doctor import Finding, Severity, diagnose
from llmgw_cli.core.doctor.checks import (
    check_cpu,
    check_engines,
    check_fabric,
    check_fabric_manager,
    check_gpus,
    check_memlock,
    check_node,
    check_ports,
    check_replicas,
    check_weights,
    failing_units,
)
from llmgw_cli.core.doctor.cluster import check_clocks, check_gateway_timeouts
from llmgw_cli.core.observe.facts import NodeFacts
from tests.unit.doctor.conftest import FIXTURES, collected, fixture, spec, sysfs_lines


def checks(findings: list[Finding]) -> list[tuple[str, Severity]]:
    return [(f.check, f.severity) for f in findings]


# --- engines ------------------------------------------------------------------------


def test_engine_with_a_missing_library_is_an_error_naming_the_package() -> None:
    s = spec()
    c = collected(s, engines="@engine /opt/vllm/bin/vllm found\n@engine /usr/local/bin/llama-server found\n"
                  "@lib libgomp.so.1")  # fmt: skip
    [f] = check_engines(s, s.node("gpu1"), c)
    assert (f.check, f.severity) == ("engine.libraries", Severity.error)
    assert "libgomp.so.1" in f.message and "profile llama" in f.message
    assert "apt-get install libgomp1" in f.fix


def test_engine_not_installed_is_an_error() -> None:
    s = spec()
    c = collected(s, engines="@engine /opt/vllm/bin/vllm missing\n@engine /usr/local/bin/llama-server found")
    assert checks(check_engines(s, s.node("gpu1"), c)) == [("engine.missing", Severity.error)]


def test_engine_of_a_profile_no_model_uses_is_only_a_warning() -> None:
    s = spec(models="[{name: a, source: /data/models/a, profile: vllm}]")  # a model that is off
    c = collected(s, engines="@engine /opt/vllm/bin/vllm missing\n@engine /usr/local/bin/llama-server found")
    assert checks(check_engines(s, s.node("gpu1"), c)) == [("engine.missing", Severity.warning)]


def test_loadable_engines_give_no_finding() -> None:
    s = spec()
    assert check_engines(s, s.node("gpu1"), collected(s)) == []


# --- CPU ----------------------------------------------------------------------------


def test_kvm64_cpu_is_an_error_without_gpus_and_a_warning_with_them() -> None:
    s = spec()
    kvm = fixture("proc_cpuinfo_kvm64_guest_amd-host.txt")
    [cpu_only] = check_cpu(s, s.node("cpu1"), collected(s, "cpu1", cpu=kvm, gpus="@missing"))
    assert (cpu_only.check, cpu_only.severity) == ("cpu.flags", Severity.error)
    assert "avx2, fma" in cpu_only.message and "Common KVM processor" in cpu_only.message
    assert "`host`" in cpu_only.fix
    [with_gpu] = check_cpu(s, s.node("gpu1"), collected(s, cpu=kvm))
    assert with_gpu.severity is Severity.warning


def test_cpu_with_avx2_and_fma_gives_no_finding() -> None:
    s = spec()
    lscpu = fixture("lscpu_flags_baremetal_xeon-gold-6342.txt").splitlines()
    model = lscpu[0].split(":", 1)[1].strip()
    flags = next(line for line in lscpu if line.startswith("Flags:")).split(":", 1)[1]
    cpu = f"model name\t: {model}\nflags\t\t: {flags}\n"
    assert check_cpu(s, s.node("cpu1"), collected(s, "cpu1", cpu=cpu, gpus="@missing")) == []


# --- memlock ------------------------------------------------------------------------


def test_low_memlock_on_a_fabric_node() -> None:
    s = spec()
    text = "soft 8192\nhard 8192\nId=llmgw-llama-0.service\nLimitMEMLOCK=8388608\n\nId=llmgw-ok.service\nLimitMEMLOCK=infinity"
    found = check_memlock(s, s.node("gpu1"), collected(s, doctor_memlock=text))
    assert checks(found) == [("memlock.unit", Severity.error), ("memlock.login", Severity.warning)]
    assert "llmgw-llama-0.service" in found[0].message and "8192 KiB" in found[0].message
    assert "8192 KiB" in found[1].message


def test_unlimited_memlock_or_no_fabric_gives_no_finding() -> None:
    s = spec()
    good = "soft unlimited\nhard unlimited\nId=llmgw-a.service\nLimitMEMLOCK=18446744073709551615"
    assert check_memlock(s, s.node("gpu1"), collected(s, doctor_memlock=good)) == []
    assert check_memlock(s, s.node("cpu1"), collected(s, "cpu1", doctor_memlock="soft 64\nhard 64")) == []


# --- InfiniBand ---------------------------------------------------------------------

SYNTHETIC = FIXTURES / "sysfs_class_infiniband_SYNTHETIC_states"  # mlx5_0 INIT, _1 DOWN, _2 ACTIVE, _3 RoCE


def test_ib_port_in_init_points_at_the_subnet_manager_and_down_at_the_cable() -> None:
    s = spec(hcas="mlx5_0, mlx5_1, mlx5_2")
    found = check_fabric(s, s.node("gpu1"), collected(s, ib=sysfs_lines(SYNTHETIC)))
    assert checks(found) == [("ib.port-not-active", Severity.error)] * 2
    init, down = found
    assert "mlx5_0 port 1 is INIT" in init.message and "opensm" in init.fix
    assert "mlx5_1 port 1 is DOWN" in down.message and "cable" in down.fix


def test_declared_adapter_absent_is_an_error() -> None:
    s = spec(hcas="mlx5_2, mlx5_7")
    [f] = check_fabric(s, s.node("gpu1"), collected(s, ib=sysfs_lines(SYNTHETIC)))
    assert (f.check, f.severity) == ("ib.adapter-absent", Severity.error)
    assert "mlx5_7" in f.message and "mlx5_0, mlx5_1, mlx5_2, mlx5_3" in f.message


def test_fabric_node_without_declared_adapters_needs_one_active_port() -> None:
    s = spec()
    none_active = "\n".join(
        line for line in sysfs_lines(SYNTHETIC).splitlines() if "mlx5_0" in line or "mlx5_1" in line
    )
    [f] = check_fabric(s, s.node("gpu2"), collected(s, "gpu2", ib=none_active))
    assert f.check == "ib.no-active-port" and "INIT" in f.message
    assert check_fabric(s, s.node("gpu2"), collected(s, "gpu2", ib=sysfs_lines(SYNTHETIC))) == []


def test_active_declared_ports_give_no_finding() -> None:
    s = spec(hcas="mlx5_2, mlx5_3:1")
    assert check_fabric(s, s.node("gpu1"), collected(s, ib=sysfs_lines(SYNTHETIC))) == []


# --- NVSwitch fabric manager (parse_fabric is fed by the script's awk: see test_script.py) ---


def test_fabric_not_completed_is_an_error() -> None:
    s = spec()
    text = "@gpu 00000000:18:00.0\n        State : In Progress\n        Status : N/A"
    c = collected(s, doctor_fabric=text, doctor_fabricmanager="LoadState=loaded\nActiveState=activating")
    [f] = check_fabric_manager(s, s.node("gpu1"), c)
    assert (f.check, f.severity) == ("gpu.fabric-manager", Severity.error)
    assert "In Progress" in f.message and "activating" in f.message
    assert "nvidia-fabricmanager" in f.fix


def test_failed_fabric_manager_unit_is_an_error() -> None:
    s = spec()
    c = collected(s, doctor_fabricmanager="LoadState=loaded\nActiveState=failed")
    assert checks(check_fabric_manager(s, s.node("gpu1"), c)) == [("gpu.fabric-manager", Severity.error)]


def test_completed_fabric_or_no_nvswitch_gives_no_finding() -> None:
    s = spec()
    done = "@gpu 00000000:18:00.0\n        State : Completed\n        Status : Success"
    c = collected(s, doctor_fabric=done, doctor_fabricmanager="LoadState=loaded\nActiveState=active")
    assert check_fabric_manager(s, s.node("gpu1"), c) == []
    pcie = "@gpu 00000000:18:00.0\n        State : N/A\n        Status : N/A"
    c = collected(s, doctor_fabric=pcie, doctor_fabricmanager="LoadState=not-found\nActiveState=inactive")
    assert check_fabric_manager(s, s.node("gpu1"), c) == []


# --- weights ------------------------------------------------------------------------


def test_missing_weights_folder_is_an_error_and_a_nearly_full_one_a_warning() -> None:
    s = spec()
    c = collected(s, weights="@dir /data/models\n@absent", doctor_disks="")
    assert checks(check_weights(s, s.node("gpu1"), c)) == [("weights.missing", Severity.error)]
    c = collected(s, doctor_disks="/data/models\t1000000000 20000000")  # 2 % free
    [f] = check_weights(s, s.node("gpu1"), c)
    assert (f.check, f.severity) == ("weights.nearly-full", Severity.warning)
    assert "19.1 GiB free (2.0 %)" in f.message


def test_present_weights_folder_with_room_gives_no_finding() -> None:
    s = spec()
    assert (
        check_weights(s, s.node("gpu1"), collected(s, doctor_disks="/data/models\t1000000000 60000000")) == []
    )


# --- ports --------------------------------------------------------------------------

SS_LINES = """\
LISTEN 0      4096         0.0.0.0:22        0.0.0.0:*    users:(("sshd",pid=700,fd=3))
LISTEN 0      511          0.0.0.0:8150      0.0.0.0:*    users:(("nginx",pid=812,fd=6))
LISTEN 0      511             [::]:8150         [::]:*    users:(("nginx",pid=812,fd=7))
LISTEN 0      128          0.0.0.0:8200      0.0.0.0:*    users:(("llama-server",pid=900,fd=3))
LISTEN 0      128                *:8210            *:*
LISTEN 0      128                *:8220            *:*
"""
UNITS = "@unit 700 ssh.service\n@unit 812 nginx.service\n@unit 900 llmgw-llama-0.service"


def listen_section(ss_lines: str) -> str:
    """The doctor-listen section as the script prints it: ss's output base64-encoded on one line."""
    return f"@ss {base64.b64encode(ss_lines.encode()).decode()}\n{UNITS}"


SS = listen_section(SS_LINES)


def test_port_in_a_profile_range_taken_by_another_program_is_an_error() -> None:
    s = spec()
    # a replica runs on 8220 (by its unit's label), so the unattributed listener there is ours
    c = collected(
        s,
        doctor_listen=SS,
        units="Id=llmgw-llama-1.service\nLoadState=loaded\nActiveState=active\nSubState=running",
        labels="\n".join(
            f"/etc/systemd/system/llmgw-llama-1.service:X-Llmgw-{label}"
            for label in ("Model=llama", "Replica=1", "Port=8220")
        ),
    )
    found = check_ports(s, s.node("gpu1"), c)
    assert checks(found) == [("ports.taken", Severity.error)] * 2
    assert "port 8150 (profile vllm 8100-8199) is taken by nginx (pid 812)" in found[0].message
    assert "port 8210" in found[1].message and "another program" in found[1].message


def test_ports_outside_the_ranges_or_held_by_our_replicas_give_no_finding() -> None:
    s = spec()
    ours = listen_section(
        "\n".join(
            line
            for line in SS_LINES.splitlines()
            if "8150" not in line and "8210" not in line and "8220" not in line
        )
    )
    assert check_ports(s, s.node("gpu1"), collected(s, doctor_listen=ours)) == []


def test_proc_net_tcp_fallback_finds_listeners() -> None:
    s = spec()
    proc = (
        "@proc\n  sl  local_address rem_address   st tx_queue rx_queue\n"
        "   0: 0100007F:1FA4 00000000:0000 0A 00000000:00000000 00:00000000 00000000 0 0 1 1\n"
        "   1: 0100007F:1FA5 0100007F:D431 01 00000000:00000000 00:00000000 00000000 0 0 1 1"
    )
    [f] = check_ports(s, s.node("gpu1"), collected(s, doctor_listen=proc))
    assert "port 8100" in f.message  # 0x1FA4; 0x1FA5 is an established connection, not a listener


# --- GPUs and reachability ------------------------------------------------------------


def test_driver_missing_on_a_node_with_declared_gpus_is_an_error() -> None:
    s = spec()
    assert checks(check_gpus(s, s.node("gpu1"), collected(s, gpus="@missing"))) == [
        ("gpu.driver", Severity.error)
    ]
    assert check_gpus(s, s.node("gpu1"), collected(s)) == []
    assert check_gpus(s, s.node("cpu1"), collected(s, "cpu1", gpus="@missing")) == []


def test_unreachable_node_gets_one_finding_with_the_ssh_fix() -> None:
    s = spec()
    c = collected(s)
    c = type(c)(NodeFacts(node="gpu1", error="authentication refused", error_kind="auth"), c.doctor, 0, 0)
    [f] = check_node(s, s.node("gpu1"), c)
    assert (f.check, f.severity) == ("node.unreachable", Severity.error)
    assert "authorized_keys" in f.fix


# --- clock skew ---------------------------------------------------------------------


def test_clock_skew_beyond_the_measurement_window() -> None:
    s = spec()
    # sent 1000.0, received 1000.5: a node in sync reads between those
    behind = collected(s, "gpu1", doctor_clock="990.0")
    far_ahead = collected(s, "cpu1", doctor_clock="1400.5")
    in_sync = collected(s, "gpu2", doctor_clock="1000.2")
    found = check_clocks(s, [behind, far_ahead, in_sync])
    assert [(f.node, f.severity) for f in found] == [("gpu1", Severity.warning), ("cpu1", Severity.error)]
    assert "at least 10.0 s behind this host" in found[0].message
    assert "at least 400.0 s ahead of this host" in found[1].message
    [ahead] = check_clocks(s, [collected(s, "gpu2", doctor_clock="1003.5")])
    assert "at least 3.0 s ahead" in ahead.message and ahead.severity is Severity.warning


def test_clock_skew_is_measured_against_the_gateway_node_when_it_is_one() -> None:
    s = spec(gateway_host="gpu2")
    gateway = collected(s, "gpu2", doctor_clock="1100.2")  # 100 s ahead of this host
    same_as_gateway = collected(s, "gpu1", doctor_clock="1100.3")
    [f] = check_clocks(s, [gateway, same_as_gateway, collected(s, "cpu1", doctor_clock="1000.2")])
    assert f.node == "cpu1" and "behind gateway node gpu2" in f.message
    assert check_clocks(s, [gateway, same_as_gateway]) == []


# --- gateway timeouts (the 60-second trap) ---------------------------------------------


def test_short_first_byte_timeout_is_the_60_second_trap() -> None:
    [f] = check_gateway_timeouts(spec(first_byte="60s"))
    assert (f.node, f.check, f.severity) == (None, "gateway.first-byte-timeout", Severity.error)
    assert "60 s" in f.message and "proxy_read_timeout" in f.fix
    assert checks(check_gateway_timeouts(spec(first_byte="200s"))) == [
        ("gateway.first-byte-timeout", Severity.warning)
    ]
    assert checks(check_gateway_timeouts(spec(idle="10s"))) == [("gateway.idle-timeout", Severity.warning)]


def test_default_gateway_timeouts_give_no_finding() -> None:
    assert check_gateway_timeouts(spec()) == []


# --- all together -------------------------------------------------------------------


def test_diagnose_orders_gateway_first_then_nodes_in_file_order_errors_first() -> None:
    s = spec(first_byte="60s")
    found = diagnose(
        s,
        [
            collected(s, "cpu1", doctor_disks="/data/models\t1000 1"),
            collected(
                s,
                "gpu1",
                engines="@engine /opt/vllm/bin/vllm missing\n@engine /usr/local/bin/llama-server found",
            ),
        ],
    )
    assert [(f.node, f.check) for f in found] == [
        (None, "gateway.first-byte-timeout"),
        ("gpu1", "engine.missing"),
        ("cpu1", "weights.nearly-full"),
    ]


def test_a_healthy_cluster_has_no_findings() -> None:
    s = spec()
    assert diagnose(s, [collected(s, "gpu1"), collected(s, "cpu1"), collected(s, "gpu2")]) == []


# --- replicas ------------------------------------------------------------------------

LOOPING_UNIT = (
    "@uptime 1000.0\nId=llmgw-a-0.service\nLoadState=loaded\nActiveState=activating\n"
    "SubState=auto-restart\nResult=exit-code\nMainPID=0\nNRestarts=7\nExecMainCode=1\n"
    "ExecMainStatus=2\nExecMainStartTimestampMonotonic=990000000\n"
    "ExecMainExitTimestampMonotonic=990300000"
)
LABELS = "/etc/systemd/system/llmgw-a-0.service:X-Llmgw-Model=a\n/etc/systemd/system/llmgw-a-0.service:X-Llmgw-Replica=0"


def test_a_crash_looping_replica_is_an_error_pointing_at_its_journal() -> None:
    s = spec()
    c = collected(s, units=LOOPING_UNIT, labels=LABELS)
    [f] = check_replicas(s, s.node("gpu1"), c)
    assert (f.check, f.severity) == ("replica.crash-looping", Severity.error)
    assert f.message == "llmgw-a-0.service (a#0) is crash-looping (7 restarts, exit status 2)"
    assert "llmgw logs a#0" in f.fix


def test_a_failing_replica_s_finding_shows_its_journal_lines() -> None:
    s = spec()
    c = collected(s, units=LOOPING_UNIT, labels=LABELS)
    assert [u.name for u in failing_units(c)] == ["llmgw-a-0.service"]
    lines = ("usage: vllm serve [-h]", "vllm serve: error: unrecognized arguments: --no-such-flag")
    [f] = check_replicas(s, s.node("gpu1"), dataclasses.replace(c, journals={"llmgw-a-0.service": lines}))
    assert f.message == (
        "llmgw-a-0.service (a#0) is crash-looping (7 restarts, exit status 2); its journal ends:\n"
        "  usage: vllm serve [-h]\n"
        "  vllm serve: error: unrecognized arguments: --no-such-flag"
    )
    failed = LOOPING_UNIT.replace("ActiveState=activating", "ActiveState=failed").replace(
        "auto-restart", "failed"
    )
    c = collected(s, units=failed, labels=LABELS)
    [f] = check_replicas(s, s.node("gpu1"), dataclasses.replace(c, journals={"llmgw-a-0.service": lines}))
    assert f.check == "replica.failed" and f.message.endswith("--no-such-flag")


def test_a_running_replica_gives_no_finding() -> None:
    s = spec()
    running = LOOPING_UNIT.replace("activating", "active").replace("auto-restart", "running")
    running = running.replace("NRestarts=7", "NRestarts=0").replace("Result=exit-code", "Result=success")
    assert check_replicas(s, s.node("gpu1"), collected(s, units=running, labels=LABELS)) == []


# --- GPU faults: what each means and what to do -------------------------------------------

TWO_GPUS = (
    "0, GPU-aaaa, NVIDIA H100 80GB HBM3, 81559, 0, 00000000:18:00.0\n"
    "1, GPU-bbbb, NVIDIA H100 80GB HBM3, 81559, 0, 00000000:2A:00.0\n@rc 0"
)


def test_a_fatal_xid_makes_its_card_faulty_with_nvidia_s_action_and_a_program_fault_is_info() -> None:
    s = spec()
    xids = (
        "@source dmesg\n"
        "@xid [ 812.1] NVRM: Xid (PCI:0000:18:00): 48, pid=4242, name=python3, An uncorrectable double bit error\n"
        "@xid [ 900.2] NVRM: Xid (PCI:0000:2a:00): 13, pid=4243, name=python3, Graphics SM Warp Exception\n"
        "@xid [ 901.0] NVRM: Xid (PCI:0000:2a:00): 13, pid=4243, name=python3, Graphics SM Warp Exception"
    )
    findings = check_gpus(s, s.node("gpu1"), collected(s, gpus=TWO_GPUS, xids=xids))
    faulty, note = findings
    assert (faulty.check, faulty.severity) == ("gpu.faulty", Severity.warning)
    assert faulty.message.startswith("GPU 0 is faulty (XID 48: double-bit ECC error")
    assert "reset the GPU" in faulty.fix and "RMA" in faulty.fix
    assert (note.check, note.severity) == ("gpu.xid", Severity.info)
    assert note.message.startswith("GPU 1: XID 13 x2: graphics engine exception")
    assert "the program that used it must restart" in note.message


def test_a_card_off_the_bus_is_named_by_its_bus_with_its_xid_and_the_reboot_to_do() -> None:
    s = spec()
    lost = "Unable to determine the device handle for GPU 0000:18:00.0: Unknown Error\n@rc 15"
    xids = "@source journal\n@xid [ 5.0] n kernel: NVRM: Xid (PCI:0000:18:00): 79, pid=1, GPU has fallen off the bus."
    findings = check_gpus(s, s.node("gpu1"), collected(s, gpus=lost, xids=xids))
    assert checks(findings) == [("gpu.count", Severity.warning), ("gpu.faulty", Severity.warning)]
    count, card = findings
    assert "(lost: 0000:18:00.0)" in count.message and "fallen off the bus" in count.message
    assert "reboot" in count.fix
    assert card.message.startswith(
        "GPU 0000:18:00.0 is faulty (nvidia-smi cannot open it: fallen off the bus; XID 79"
    )
    assert "reboot" in card.fix


def test_a_kernel_log_the_probe_cannot_read_is_said_with_how_to_let_it() -> None:
    s = spec()
    [f] = check_gpus(s, s.node("gpu1"), collected(s, xids="@source unreadable"))
    assert (f.check, f.severity) == ("gpu.kernel-log", Severity.warning)
    assert "llmgw apply" in f.fix
    assert check_gpus(s, s.node("gpu1"), collected(s, xids="@source dmesg")) == []
