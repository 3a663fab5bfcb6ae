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
{{- $external := or .Values.redis.external.url .Values.redis.external.urlSecret }}
{{- if and .Values.redis.bundled.enabled $external }}
{{- fail "redis: set either redis.bundled.enabled=true or redis.external.url (or urlSecret), not both (set redis.bundled.enabled=false to use an external Redis)" }}
{{- end }}
{{- if not (or .Values.redis.bundled.enabled $external) }}
{{- fail "redis: the gateway needs Redis: keep redis.bundled.enabled=true or set redis.external.url or redis.external.urlSecret" }}
{{- end }}
{{- if and .Values.redis.external.url .Values.redis.external.urlSecret }}
{{- fail "redis: set redis.external.url or redis.external.urlSecret, not both" }}
{{- end }}
{{- end }}

{{/* The Secret holding the bundled Redis's password ("" when auth is off). */}}
{{- define "slotserve.redisPasswordSecret" -}}
{{- if and .Values.redis.bundled.enabled .Values.redis.bundled.auth.enabled }}
{{- .Values.redis.bundled.auth.existingSecret | default (include "slotserve.componentName" (dict "root" . "component" "redis")) }}
{{- end }}
{{- end }}

{{/* The key of the password in that Secret (the chart's own Secret uses redis-password). */}}
{{- define "slotserve.redisPasswordKey" -}}
{{- if .Values.redis.bundled.auth.existingSecret }}
{{- .Values.redis.bundled.auth.existingSecretPasswordKey }}
{{- else }}
{{- "redis-password" }}
{{- end }}
{{- end }}

{{/*
The env var SLOTSERVE_REDIS_PASSWORD (from a Secret), if the gateway's Redis URL needs one.
Defined before the URL so that Kubernetes expands $(SLOTSERVE_REDIS_PASSWORD) in it.
*/}}
{{- define "slotserve.redisPasswordEnv" -}}
{{- $secret := include "slotserve.redisPasswordSecret" . }}
{{- $key := include "slotserve.redisPasswordKey" . }}
{{- if and (not $secret) .Values.redis.external.url .Values.redis.external.existingSecret }}
{{- $secret = .Values.redis.external.existingSecret }}
{{- $key = .Values.redis.external.existingSecretPasswordKey }}
{{- end }}
{{- if $secret }}
- name: SLOTSERVE_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ $key }}
{{- end }}
{{- end }}

{{/* The gateway's Redis URL (without urlSecret). With a password it refers to $(SLOTSERVE_REDIS_PASSWORD), which Kubernetes expands from the env var defined before it. */}}
{{- define "slotserve.redisUrl" -}}
{{- if .Values.redis.bundled.enabled }}
{{- $host := include "slotserve.componentName" (dict "root" . "component" "redis") }}
{{- if .Values.redis.bundled.auth.enabled }}
{{- printf "redis://:$(SLOTSERVE_REDIS_PASSWORD)@%s:6379/0" $host }}
{{- else }}
{{- printf "redis://%s:6379/0" $host }}
{{- end }}
{{- else if .Values.redis.external.existingSecret }}
{{- regexReplaceAll "^(rediss?://)" .Values.redis.external.url "${1}:$(SLOTSERVE_REDIS_PASSWORD)@" }}
{{- else }}
{{- .Values.redis.external.url }}
{{- end }}
{{- end }}
