{{/*
The chart name, overridable.
*/}}
{{- define "llm-gateway.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The fully qualified app name, truncated to 63 characters (a DNS name limit). It leaves room
for the "-redis" and "-dashboard" suffixes only when short names are used; see fullnameOverride.
*/}}
{{- define "llm-gateway.fullname" -}}
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

{{/*
Chart name and version, for the helm.sh/chart label.
*/}}
{{- define "llm-gateway.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels shared by every object of the release.
*/}}
{{- define "llm-gateway.commonLabels" -}}
helm.sh/chart: {{ include "llm-gateway.chart" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: {{ include "llm-gateway.name" . }}
{{- end }}

{{/*
Labels of the gateway's objects.
*/}}
{{- define "llm-gateway.labels" -}}
{{ include "llm-gateway.commonLabels" . }}
{{ include "llm-gateway.selectorLabels" . }}
{{- end }}

{{/*
Selector labels of the gateway pods (the component keeps the in-chart Redis out of them).
*/}}
{{- define "llm-gateway.selectorLabels" -}}
app.kubernetes.io/name: {{ include "llm-gateway.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: gateway
{{- end }}

{{/*
The in-chart Redis: its name, labels and selector labels.
*/}}
{{- define "llm-gateway.redis.fullname" -}}
{{- printf "%s-redis" (include "llm-gateway.fullname" . | trunc 57 | trimSuffix "-") }}
{{- end }}

{{- define "llm-gateway.redis.labels" -}}
{{ include "llm-gateway.commonLabels" . }}
{{ include "llm-gateway.redis.selectorLabels" . }}
{{- end }}

{{- define "llm-gateway.redis.selectorLabels" -}}
app.kubernetes.io/name: {{ include "llm-gateway.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: redis
{{- end }}

{{/*
The service account the gateway pods run as.
*/}}
{{- define "llm-gateway.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "llm-gateway.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The gateway image, its tag defaulting to the chart's appVersion.
*/}}
{{- define "llm-gateway.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
Whether the chart makes the Secret holding the Redis URL (it does unless an existing one is
named and the in-chart Redis is off).
*/}}
{{- define "llm-gateway.redisSecretCreate" -}}
{{- if or .Values.redis.enabled (not .Values.redis.existingSecret) }}true{{ end }}
{{- end }}

{{/*
The Secret holding the Redis URL, and the key under which it holds it.
*/}}
{{- define "llm-gateway.redisSecretName" -}}
{{- if include "llm-gateway.redisSecretCreate" . }}
{{- printf "%s-redis-url" (include "llm-gateway.fullname" . | trunc 53 | trimSuffix "-") }}
{{- else }}
{{- .Values.redis.existingSecret }}
{{- end }}
{{- end }}

{{- define "llm-gateway.redisSecretKey" -}}
{{- if include "llm-gateway.redisSecretCreate" . }}redis-url{{ else }}{{ .Values.redis.existingSecretKey }}{{ end }}
{{- end }}

{{/*
The Redis URL the chart-made Secret holds: the in-chart Redis, or redis.url.
*/}}
{{- define "llm-gateway.redisUrl" -}}
{{- if .Values.redis.enabled }}
{{- printf "redis://%s.%s.svc:6379/0" (include "llm-gateway.redis.fullname" .) .Release.Namespace }}
{{- else if .Values.redis.url }}
{{- .Values.redis.url }}
{{- else }}
{{- fail "llm-gateway: Redis is not configured: set redis.url, redis.existingSecret, or redis.enabled=true (trials)" }}
{{- end }}
{{- end }}

{{/*
The name of the model the chart ships as an example in values.yaml.
*/}}
{{- define "llm-gateway.exampleModel" -}}example/llama-3-8b{{- end }}

{{/*
The gateway's config file (gateway.yaml), rendered from .Values.gateway (and keys). `listen`
is fixed to the container port; the Redis URL comes from the pod's env (a Secret). Sections
left empty are omitted, so the gateway's own defaults apply.
*/}}
{{- define "llm-gateway.config" -}}
{{- $g := .Values.gateway }}
{{- $models := $g.models | default dict }}
{{- if not $models }}
{{- fail "llm-gateway: gateway.models is empty: configure at least one model" }}
{{- end }}
{{- $example := include "llm-gateway.exampleModel" . }}
{{- if and (hasKey $models $example) (gt (len $models) 1) }}
{{- fail (printf "llm-gateway: gateway.models still holds the chart's example model %s next to yours (Helm merges maps): remove it with `%s: null` under gateway.models in your values" $example $example) }}
{{- end }}
{{- $config := dict "listen" (dict "host" "0.0.0.0" "port" 8000) }}
{{- $redis := merge (dict "url" "${GATEWAY_REDIS_URL}") ($g.redis | default dict) }}
{{- $_ := set $config "redis" $redis }}
{{- range $section := list "limits" "upstream" "health" "usage" "tiers" }}
{{- with (get $g $section) }}
{{- $_ := set $config $section . }}
{{- end }}
{{- end }}
{{- if hasKey $g "shutdown_grace_s" }}
{{- $_ := set $config "shutdown_grace_s" $g.shutdown_grace_s }}
{{- end }}
{{- $_ := set $config "models" $models }}
{{- if .Values.keys.inConfig }}
{{- with .Values.keys.digests }}
{{- $_ := set $config "keys" . }}
{{- end }}
{{- else if .Values.keys.digests }}
{{- fail "llm-gateway: keys.digests is set but keys.inConfig is false: set keys.inConfig=true to put these digests in the config ConfigMap" }}
{{- end -}}
# The gateway's config, rendered by the llm-gateway chart from its values (gateway.*, keys).
# ${GATEWAY_REDIS_URL} is expanded by the gateway from the pod's environment (a Secret).
{{ toYaml $config }}
{{- end }}

{{/*
terminationGracePeriodSeconds: the gateway's drain time, plus the preStop pause (5 s) and
room to exit: after the drain, the requests cut short get 5 s and 1 s more, the lifespan
shutdown up to 5 s for calls on their way to Redis before records go to the spool.
*/}}
{{- define "llm-gateway.terminationGracePeriodSeconds" -}}
{{- $grace := 30 }}
{{- if hasKey .Values.gateway "shutdown_grace_s" }}
{{- $grace = .Values.gateway.shutdown_grace_s }}
{{- end }}
{{- add (ceil $grace) 25 }}
{{- end }}
