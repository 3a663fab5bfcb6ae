{{/*
Names, labels and small computed values shared by every template. All helpers are namespaced
"slotserve." so they cannot clash with a parent chart's.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "slotserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The prefix of every object name: <release>-slotserve, or fullnameOverride. */}}
{{- define "slotserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Name of one component's objects: <fullname>-<component>. Call with (dict "root" . "component" "gateway"). */}}
{{- define "slotserve.componentName" -}}
{{- printf "%s-%s" (include "slotserve.fullname" .root | trunc 52 | trimSuffix "-") .component }}
{{- end }}

{{- define "slotserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. Call with (dict "root" . "component" "gateway"). */}}
{{- define "slotserve.labels" -}}
helm.sh/chart: {{ include "slotserve.chart" .root }}
{{ include "slotserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: slotserve
{{- end }}

{{/* Labels a Deployment/Service/NetworkPolicy selects one component's pods by. */}}
{{- define "slotserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "slotserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* image reference; call with (dict "image" .Values.x.image "root" .). An empty tag means appVersion. */}}
{{- define "slotserve.image" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) }}
{{- end }}

{{/* The namespaces the operator and gateway watch, as a comma list ("" = all). */}}
{{- define "slotserve.watchNamespaces" -}}
{{- join "," .Values.watchNamespaces }}
{{- end }}

{{/* Namespaces whose engine pods the engine NetworkPolicy protects, as a list. */}}
{{- define "slotserve.engineNamespaces" -}}
{{- $namespaces := .Values.networkPolicy.engineNamespaces | default .Values.watchNamespaces | default (list .Release.Namespace) }}
{{- toJson $namespaces }}
{{- end }}

{{/* Pod-level security context shared by the chart's own pods. */}}
{{- define "slotserve.podSecurityContext" -}}
{{- toYaml .Values.podSecurityContext }}
{{- end }}

{{/* Container-level security context shared by every container. */}}
{{- define "slotserve.containerSecurityContext" -}}
{{- toYaml .Values.containerSecurityContext }}
{{- end }}

{{/* Name of the Secret holding the gateway's API keys ("" when authentication is off). */}}
{{- define "slotserve.apiKeysSecret" -}}
{{- if .Values.gateway.apiKeys.existingSecret }}
{{- .Values.gateway.apiKeys.existingSecret }}
{{- else if .Values.gateway.apiKeys.keys }}
{{- include "slotserve.componentName" (dict "root" . "component" "api-keys") }}
{{- end }}
{{- end }}

{{/*
Validates the Redis choice; values.schema.json says the same, this also holds when a user
passes --skip-schema-validation.
*/}}
{{- define "slotserve.validateRedis" -}}
{{- if and .Values.redis.bundled.enabled .Values.redis.external.url }}
{{- fail "redis: set either redis.bundled.enabled=true or redis.external.url, not both (set redis.bundled.enabled=false to use an external Redis)" }}
{{- end }}
{{- if not (or .Values.redis.bundled.enabled .Values.redis.external.url) }}
{{- fail "redis: the gateway needs Redis: keep redis.bundled.enabled=true or set redis.external.url" }}
{{- end }}
{{- end }}

{{/* The gateway's Redis URL. With an external password it refers to $(SLOTSERVE_REDIS_PASSWORD), which Kubernetes expands from the env var defined before it. */}}
{{- define "slotserve.redisUrl" -}}
{{- if .Values.redis.bundled.enabled }}
{{- printf "redis://%s:6379/0" (include "slotserve.componentName" (dict "root" . "component" "redis")) }}
{{- else if .Values.redis.external.existingSecret }}
{{- regexReplaceAll "^(rediss?://)" .Values.redis.external.url "${1}:$(SLOTSERVE_REDIS_PASSWORD)@" }}
{{- else }}
{{- .Values.redis.external.url }}
{{- end }}
{{- end }}
