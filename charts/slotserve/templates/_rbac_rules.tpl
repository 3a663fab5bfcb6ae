{{/*
The operator's permissions: exactly slotserve.operator.rbac.REQUIRED_RULES (a chart test
compares them and fails on any difference; update both together).
*/}}
{{- define "slotserve.operator.rules" -}}
# The custom resource: watched, annotated with kopf's progress, status written.
- apiGroups: ["slotserve.dev"]
  resources: ["inferencepools"]
  verbs: ["get", "list", "watch", "patch", "update"]
- apiGroups: ["slotserve.dev"]
  resources: ["inferencepools/status"]
  verbs: ["get", "patch", "update"]
# The built-in autoscaler sets replicas through the scale subresource, as an HPA does.
- apiGroups: ["slotserve.dev"]
  resources: ["inferencepools/scale"]
  verbs: ["get", "patch"]
# autoscaling.provider keda: the pool's ScaledObject (deleted when switched off).
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["get", "create", "patch", "delete"]
# gatewayAPI.inferencePool: the Gateway API InferencePool over the engines (deleted when off).
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "create", "patch", "delete"]
# The built-in autoscaler refuses to run beside another HPA of the same pool.
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["list"]
# Children: created, patched, watched; deletion is the garbage collector's job.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "patch"]
# The NetworkPolicy in front of each pool's engines: created, patched, watched (drift),
# deleted when the operator runs without network policies.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Engine pods: read-only, for readiness and endpoints.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
# Events about pools, posted by the operator and by kopf.
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create"]
# kopf: CRD discovery and namespace watching; the operator reads KEDA's CRD.
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
# kopf peering between operator replicas.
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings", "kopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}

{{/* Resources that are cluster-scoped: a namespaced Role cannot grant them. */}}
{{- define "slotserve.clusterScopedResources" -}}
["customresourcedefinitions", "namespaces", "clusterkopfpeerings", "nodes", "clusterroles", "clusterrolebindings", "persistentvolumes", "storageclasses"]
{{- end }}

{{/*
The operator's rules split by scope: (dict "root" . "scope" "cluster"|"namespaced") renders the
rules (as a YAML list) whose resources have that scope; a rule mixing both is split in two.
*/}}
{{- define "slotserve.operator.scopedRules" -}}
{{- $clusterScoped := include "slotserve.clusterScopedResources" .root | fromJsonArray }}
{{- $rules := list }}
{{- range $rule := include "slotserve.operator.rules" .root | fromYamlArray }}
{{- $picked := list }}
{{- range $resource := $rule.resources }}
{{- $isCluster := has $resource $clusterScoped }}
{{- if or (and $isCluster (eq $.scope "cluster")) (and (not $isCluster) (eq $.scope "namespaced")) }}
{{- $picked = append $picked $resource }}
{{- end }}
{{- end }}
{{- if $picked }}
{{- $rules = append $rules (dict "apiGroups" $rule.apiGroups "resources" $picked "verbs" $rule.verbs) }}
{{- end }}
{{- end }}
{{- toYaml $rules }}
{{- end }}

{{/*
The gateway only reads: InferencePools (model name, batching, admission) and the EndpointSlices
of the pools' Services (which engine pods are ready). Exactly
slotserve.gateway.pools.discovery.REQUIRED_RULES (a chart test compares them).
*/}}
{{- define "slotserve.gateway.rules" -}}
- apiGroups: ["slotserve.dev"]
  resources: ["inferencepools"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["discovery.k8s.io"]
  resources: ["endpointslices"]
  verbs: ["list", "watch"]
{{- end }}
