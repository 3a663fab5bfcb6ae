"""The Pod Security Standards' ``baseline`` and ``restricted`` rules, applied to a pod spec.

Written from the Kubernetes documentation of the profiles (policy version 1.3x), so that a test
can say which rule a built pod breaks. Checks what the built specs can contain: the security
contexts, host namespaces and ports, volumes, capabilities, seccomp, AppArmor and the legacy
annotations that carry them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

RESTRICTED_VOLUME_TYPES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
BASELINE_CAPABILITIES = {
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
    "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
}  # fmt: skip
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def _containers(pod: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        yield from pod.get(kind) or []


def baseline_violations(pod: Mapping[str, Any], annotations: Mapping[str, str]) -> list[str]:
    """Rules of the ``baseline`` profile that ``pod`` breaks (empty: it passes)."""
    found = []
    pod_context = pod.get("securityContext") or {}
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            found.append(f"host namespaces: {field}")
    if (pod_context.get("windowsOptions") or {}).get("hostProcess"):
        found.append("HostProcess pod")
    for volume in pod.get("volumes") or []:
        if "hostPath" in volume:
            found.append(f"hostPath volume {volume['name']!r}")
    if (pod_context.get("seccompProfile") or {}).get("type") == "Unconfined":
        found.append("seccomp Unconfined (pod)")
    if pod_context.get("seLinuxOptions", {}).get("type", "") not in SELINUX_TYPES:
        found.append("SELinux type (pod)")
    for sysctl in pod_context.get("sysctls") or []:
        if sysctl["name"] not in SAFE_SYSCTLS:
            found.append(f"unsafe sysctl {sysctl['name']}")
    for key, value in annotations.items():
        if (
            key.startswith("container.apparmor.security.beta.kubernetes.io/")
            and value
            not in {
                "runtime/default",
            }
            and not value.startswith("localhost/")
        ):
            found.append(f"AppArmor annotation {key}={value}")
    for container in _containers(pod):
        name = container["name"]
        context = container.get("securityContext") or {}
        if context.get("privileged"):
            found.append(f"{name}: privileged")
        if (context.get("windowsOptions") or {}).get("hostProcess"):
            found.append(f"{name}: HostProcess")
        added = set((context.get("capabilities") or {}).get("add") or [])
        if added - BASELINE_CAPABILITIES:
            found.append(f"{name}: adds capabilities {sorted(added - BASELINE_CAPABILITIES)}")
        for port in container.get("ports") or []:
            if port.get("hostPort"):
                found.append(f"{name}: hostPort {port['hostPort']}")
        if (context.get("seccompProfile") or {}).get("type") == "Unconfined":
            found.append(f"{name}: seccomp Unconfined")
        if (context.get("appArmorProfile") or {}).get("type") == "Unconfined":
            found.append(f"{name}: AppArmor Unconfined")
        if context.get("procMount", "Default") != "Default":
            found.append(f"{name}: procMount {context['procMount']}")
        if context.get("seLinuxOptions", {}).get("type", "") not in SELINUX_TYPES:
            found.append(f"{name}: SELinux type")
    return found


def restricted_violations(
    pod: Mapping[str, Any], annotations: Mapping[str, str] | None = None
) -> list[str]:
    """Rules of the ``restricted`` profile (which includes ``baseline``) that ``pod`` breaks."""
    found = baseline_violations(pod, annotations or {})
    pod_context = pod.get("securityContext") or {}
    for volume in pod.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUME_TYPES:
            found.append(f"volume {volume['name']!r} of type {sorted(kinds)}")
    pod_seccomp = (pod_context.get("seccompProfile") or {}).get("type")
    if pod_context.get("runAsUser") == 0:
        found.append("runAsUser 0 (pod)")
    for container in _containers(pod):
        name = container["name"]
        context = container.get("securityContext") or {}
        if context.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation is not false")
        if not context.get("runAsNonRoot", pod_context.get("runAsNonRoot")):
            found.append(f"{name}: runAsNonRoot is not true")
        if context.get("runAsUser") == 0:
            found.append(f"{name}: runAsUser 0")
        seccomp = (context.get("seccompProfile") or {}).get("type", pod_seccomp)
        if seccomp not in {"RuntimeDefault", "Localhost"}:
            found.append(f"{name}: seccompProfile {seccomp!r}")
        capabilities = context.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            found.append(f"{name}: capabilities do not drop ALL")
        if set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: adds capabilities beyond NET_BIND_SERVICE")
    return found
