{{/* Names, labels and the names every component must agree on. */}}

{{- define "fairway.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>, or <release>-<chart> when the release name does not contain the chart name. Room
is left for the longest suffix (-picker-config). */}}
{{- define "fairway.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 48 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 48 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 48 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "fairway.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels of a component: include "fairway.selectorLabels" (list . "picker") */}}
{{- define "fairway.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "fairway.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* All labels of a component: include "fairway.labels" (list . "picker") */}}
{{- define "fairway.labels" -}}
{{- $root := index . 0 -}}
helm.sh/chart: {{ include "fairway.chart" $root }}
{{ include "fairway.selectorLabels" . }}
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
app.kubernetes.io/part-of: fairway
{{- end }}

{{- define "fairway.picker.fullname" -}}
{{- printf "%s-picker" (include "fairway.fullname" .) }}
{{- end }}

{{- define "fairway.operator.fullname" -}}
{{- printf "%s-operator" (include "fairway.fullname" .) }}
{{- end }}

{{/* The ConfigMap the picker reads (key picker.yaml): written by the operator, or by the chart
when the operator is disabled. */}}
{{- define "fairway.pickerConfigName" -}}
{{- printf "%s-picker-config" (include "fairway.fullname" .) }}
{{- end }}

{{/* The base config (key base.yaml) the operator adds the TenantPolicies to. */}}
{{- define "fairway.baseConfigName" -}}
{{- printf "%s-base" (include "fairway.fullname" .) }}
{{- end }}

{{/* The Lease of the picker's leader election (replicas > 1 on the memory backend). */}}
{{- define "fairway.leaseName" -}}
{{- include "fairway.picker.fullname" . }}
{{- end }}

{{- define "fairway.picker.serviceAccountName" -}}
{{- if .Values.picker.serviceAccount.create }}
{{- default (include "fairway.picker.fullname" .) .Values.picker.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.picker.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "fairway.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- default (include "fairway.operator.fullname" .) .Values.operator.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.operator.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "fairway.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The container security context of every container: not configurable on purpose. */}}
{{- define "fairway.containerSecurityContext" -}}
runAsNonRoot: true
readOnlyRootFilesystem: true
allowPrivilegeEscalation: false
privileged: false
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* The picker's ports (fixed: the gateway, the operator and the dashboard expect them; the
same as upstream's picker: ext_proc 9002, gRPC health 9003, metrics 9090; the admin API 9004). */}}
{{- define "fairway.port.extProc" -}}9002{{- end }}
{{- define "fairway.port.metrics" -}}9090{{- end }}
{{- define "fairway.port.health" -}}9003{{- end }}
{{- define "fairway.port.admin" -}}9004{{- end }}
{{- define "fairway.port.operatorHealth" -}}8080{{- end }}

{{/* What values.schema.json cannot say, and a second line of defence when it is skipped. */}}
{{- define "fairway.validate" -}}
{{- if and (not .Values.inferencePool.name) .Values.operator.enabled }}
{{- fail "inferencePool.name is required with operator.enabled (the operator renders the TenantPolicies of one pool)" }}
{{- end }}
{{- if and .Values.inferencePool.create (not .Values.inferencePool.matchLabels) }}
{{- fail "inferencePool.matchLabels is required with inferencePool.create (which pods are the model servers)" }}
{{- end }}
{{- if ge (float64 .Values.picker.grace) (float64 .Values.picker.terminationGracePeriodSeconds) }}
{{- fail "picker.terminationGracePeriodSeconds must exceed picker.grace (the kubelet kills the pod after it)" }}
{{- end }}
{{- if and .Values.networkPolicy.enabled (not .Values.networkPolicy.gateway.namespaceSelector) (not .Values.networkPolicy.gateway.podSelector) (not .Values.networkPolicy.gateway.gatewayName) }}
{{- fail "networkPolicy.gateway needs a gatewayName, a namespaceSelector or a podSelector (who may reach ext_proc)" }}
{{- end }}
{{- if and (not .Values.picker.tls.enabled) (eq .Values.picker.tls.clientAuth.mode "mtls") }}
{{- fail "picker.tls.clientAuth.mode mtls needs picker.tls.enabled (a client certificate is a TLS thing): set mode none or trust-network for plaintext ext_proc" }}
{{- end }}
{{- if and (gt (int .Values.picker.workers) 1) (ne .Values.state.backend "redis") }}
{{- fail "picker.workers > 1 needs state.backend redis (the workers share their counters and the endpoints through it)" }}
{{- end }}
{{- if hasKey .Values.config "state" }}
{{- fail "config.state is not read: set the top-level `state` values instead (the chart renders the picker's state section from them, and mounts the Secrets it names)" }}
{{- end }}
{{- if eq .Values.state.backend "redis" }}
{{- $url := .Values.state.redis.url }}
{{- if not $url }}
{{- fail "state.redis.url is required with state.backend redis (redis://host:6379/0, or rediss:// for TLS)" }}
{{- end }}
{{- if not (or (hasPrefix "redis://" $url) (hasPrefix "rediss://" $url)) }}
{{- fail "state.redis.url must start with redis:// or rediss://" }}
{{- end }}
{{- if contains "@" $url }}
{{- fail "state.redis.url must not carry credentials (it is written to a ConfigMap): put the password in a Secret named by state.redis.passwordSecret" }}
{{- end }}
{{- if and .Values.state.redis.caSecret.name (not (hasPrefix "rediss://" $url)) }}
{{- fail "state.redis.caSecret is used only with TLS: state.redis.url must start with rediss://" }}
{{- end }}
{{- end }}
{{- end }}

{{/* True (non-empty) when the pickers share their state through Redis: then every replica
serves, and none elects a leader. */}}
{{- define "fairway.sharedState" -}}
{{- if eq .Values.state.backend "redis" }}true{{ end }}
{{- end }}

{{/* Whether the pickers elect a leader on a Lease (--lease): several replicas without shared
state (with redis every replica serves). Non-empty when they do. */}}
{{- define "fairway.leaderElection" -}}
{{- if and (gt (int .Values.picker.replicas) 1) (not (include "fairway.sharedState" .)) }}true{{ end }}
{{- end }}

{{/* Where the picker finds the Redis password (file password) and CA bundle (file ca.crt). */}}
{{- define "fairway.redisMountPath" -}}/etc/fairway/redis{{- end }}

{{/* The picker's `state` section from .Values.state (redis only: memory is the picker's
default, so its config stays as it was). The key prefix defaults to the release namespace and
the picker's name, so two pools sharing a Redis stay apart. */}}
{{- define "fairway.stateConfig" -}}
{{- $state := .Values.state }}
{{- $redis := dict "url" $state.redis.url "keyPrefix" (default (printf "%s/%s" .Release.Namespace (include "fairway.picker.fullname" .)) $state.redis.keyPrefix) }}
{{- if $state.redis.passwordSecret.name }}
{{- $_ := set $redis "passwordFile" (printf "%s/password" (include "fairway.redisMountPath" .)) }}
{{- end }}
{{- if $state.redis.caSecret.name }}
{{- $_ := set $redis "caFile" (printf "%s/ca.crt" (include "fairway.redisMountPath" .)) }}
{{- end }}
{{- toYaml (dict "backend" "redis" "redis" $redis "syncInterval" $state.syncInterval "maxStaleness" $state.maxStaleness "onUnavailable" $state.onUnavailable) }}
{{- end }}

{{/* The picker's config as the chart renders it: .Values.config, plus `state` with redis. */}}
{{- define "fairway.pickerConfig" -}}
{{- $config := deepCopy .Values.config }}
{{- if include "fairway.sharedState" . }}
{{- $_ := set $config "state" (include "fairway.stateConfig" . | fromYaml) }}
{{- end }}
{{- toYaml $config }}
{{- end }}

{{/* Where the picker finds tls.secretName's tls.crt and tls.key (--cert-path). */}}
{{- define "fairway.tlsMountPath" -}}/etc/fairway/tls{{- end }}
{{- define "fairway.clientCaMountPath" -}}/etc/fairway/client-ca{{- end }}
{{- define "fairway.adminTokenMountPath" -}}/etc/fairway/admin{{- end }}

{{/* mTLS on ext_proc: "true" when the picker requires the gateway's client certificate. */}}
{{- define "fairway.mtls" -}}
{{- if and .Values.picker.tls.enabled (eq .Values.picker.tls.clientAuth.mode "mtls") }}true{{ end }}
{{- end }}

{{/* The Secret with the gateway CA the picker verifies client certificates against. */}}
{{- define "fairway.clientCaSecret" -}}
{{- .Values.picker.tls.clientAuth.caSecretName | default (printf "%s-client-ca" (include "fairway.picker.fullname" .)) }}
{{- end }}

{{- define "fairway.gatewayTlsSecret" -}}
{{- printf "%s-gateway-tls" (include "fairway.picker.fullname" .) }}
{{- end }}

{{/* The Secret (key `token`) with the metrics page's bearer token. */}}
{{- define "fairway.metricsTokenSecret" -}}
{{- .Values.picker.metricsAuth.tokenSecretName | default (printf "%s-metrics-token" (include "fairway.picker.fullname" .)) }}
{{- end }}
{{- define "fairway.metricsTokenMountPath" -}}/etc/fairway/metrics{{- end }}

{{/* The Secret (key `token`) with the admin API's bearer token. */}}
{{- define "fairway.adminTokenSecret" -}}
{{- .Values.picker.admin.tokenSecretName | default (printf "%s-admin-token" (include "fairway.picker.fullname" .)) }}
{{- end }}

{{/* One NetworkPolicy peer (a list of one) from {namespaceSelector, podSelector}; with neither,
every namespace. */}}
{{/* The gateway's peer: its selectors, else the pods of the Gateway gatewayName. */}}
{{- define "fairway.gatewayPeer" -}}
{{- if or .namespaceSelector .podSelector }}
{{- include "fairway.networkPeer" . }}
{{- else }}
{{- include "fairway.networkPeer" (dict "podSelector" (dict "matchLabels" (dict "gateway.networking.k8s.io/gateway-name" .gatewayName))) }}
{{- end }}
{{- end }}

{{- define "fairway.networkPeer" -}}
{{- $peer := dict }}
{{- with .namespaceSelector }}{{ $_ := set $peer "namespaceSelector" . }}{{ end }}
{{- with .podSelector }}{{ $_ := set $peer "podSelector" . }}{{ end }}
{{- if not $peer }}{{ $_ := set $peer "namespaceSelector" (dict) }}{{ end }}
{{- toYaml (list $peer) }}
{{- end }}
