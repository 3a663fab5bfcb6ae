"""The NetworkPolicy in front of a pool's engines (pure; the handlers adopt and apply it).

Engines have no authentication of their own: whoever reaches port 8000 bypasses the gateway's
admission, API keys and fairness. One policy per pool, in the pool's namespace, owned by the
pool, admits only the gateway pods (by namespace and labels) and the configured scrapers, on the
engine port; every other ingress to the engine pods is dropped (with a CNI that enforces it).

Optionally (setting engine_egress) the same policy restricts what the engines reach: the cluster
DNS and the model hub the platform names, nothing else, so that a pool cannot send what it holds
(a Hub token, prompts) anywhere else.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from slotserve.operator.builders import ENGINE_PORT_NAME, common_labels, selector_labels
from slotserve.operator.models import InferencePool

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set by Kubernetes on every namespace
DNS_PORTS = [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]


def egress_rules(
    dns_peers: Sequence[Mapping[str, Any]], hub_rules: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Egress rules for engine pods: DNS (port 53 of ``dns_peers``), then ``hub_rules``."""
    return [{"to": [dict(peer) for peer in dns_peers], "ports": DNS_PORTS}] + [
        dict(rule) for rule in hub_rules
    ]


def build_network_policy(
    pool: InferencePool,
    *,
    gateway_namespace: str,
    gateway_pod_labels: Mapping[str, str],
    scraper_peers: Sequence[Mapping[str, Any]] = (),
    egress: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """Ingress to ``pool``'s engine pods: gateway pods and ``scraper_peers``, engine port only;
    with ``egress`` (:func:`egress_rules`), their only ways out.

    ``gateway_namespace`` empty means the pool's own namespace.
    """
    namespace = gateway_namespace or pool.metadata.namespace
    ports = [{"port": ENGINE_PORT_NAME, "protocol": "TCP"}]
    gateway = {
        # Both selectors in one peer: gateway-labelled pods in that namespace only, so a pod
        # with copied labels in a namespace its author controls is not let in.
        "namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: namespace}},
        "podSelector": {"matchLabels": dict(gateway_pod_labels)},
    }
    ingress: list[dict[str, Any]] = [{"from": [gateway], "ports": ports}]
    if scraper_peers:
        ingress.append({"from": [dict(peer) for peer in scraper_peers], "ports": ports})
    spec: dict[str, Any] = {
        "podSelector": {"matchLabels": selector_labels(pool.metadata.name)},
        "policyTypes": ["Ingress"],
        "ingress": ingress,
    }
    if egress is not None:
        spec["policyTypes"] = ["Ingress", "Egress"]
        spec["egress"] = [dict(rule) for rule in egress]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": pool.metadata.name,
            "namespace": pool.metadata.namespace,
            "labels": common_labels(pool),
        },
        "spec": spec,
    }
