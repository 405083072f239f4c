{{/* Names, labels and the values derived in one place: worker URLs, Redis URL, model path. */}}

{{- define "radixgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/*
Full name, at most 40 characters: the worker pods' DNS labels are "<fullname>-worker-<ordinal>"
and must stay within 63.
*/}}
{{- define "radixgate.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "radixgate.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "radixgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of one component: call with (dict "ctx" $ "component" "router"). */}}
{{- define "radixgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "radixgate.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* checksum/secret: the chart's own Secret (adminToken.value) as a pod annotation, so that a new value
     rolls the pods (the processes read it from their environment at start); empty without one. */}}
{{- define "radixgate.secretChecksum" -}}
{{- with include (print .Template.BasePath "/secret.yaml") . | trim -}}
checksum/secret: {{ sha256sum . | quote }}
{{- end -}}
{{- end -}}

{{- define "radixgate.image" -}}
{{- printf "%s:%s" .Values.image.repository (include "radixgate.tag" (default .Chart.AppVersion .Values.image.tag)) -}}
{{- end -}}

{{/* An image tag as text. YAML reads an unquoted 2 or 20240101 as a number, which Helm holds as a float
     (printed %!s(float64=2) by printf, 2.0240101e+07 by toString): a whole number is its digits. */}}
{{- define "radixgate.tag" -}}
{{- if and (kindIs "float64" .) (eq . (floor .)) -}}
{{- printf "%.0f" . -}}
{{- else -}}
{{- toString . -}}
{{- end -}}
{{- end -}}

{{/* The StatefulSet and its headless Service share this name. */}}
{{- define "radixgate.workerName" -}}
{{- printf "%s-worker" (include "radixgate.fullname" .) -}}
{{- end -}}

{{/* "<service>.<namespace>.svc.<cluster domain>": the headless Service's DNS zone. */}}
{{- define "radixgate.workerDomain" -}}
{{- printf "%s.%s.svc.%s" (include "radixgate.workerName" .) .Release.Namespace .Values.clusterDomain -}}
{{- end -}}

{{/*
Every worker's stable URL, comma-separated, one per StatefulSet ordinal. NOTE: each must equal
the --advertise-url that worker puts in its KV events (worker-statefulset.yaml), or the router
cannot match events to workers.
*/}}
{{- define "radixgate.workerURLs" -}}
{{- $sts := include "radixgate.workerName" . -}}
{{- $domain := include "radixgate.workerDomain" . -}}
{{- $urls := list -}}
{{- range $i := until (int .Values.worker.replicas) -}}
{{- $urls = append $urls (printf "http://%s-%d.%s:%d" $sts $i $domain (int $.Values.worker.port)) -}}
{{- end -}}
{{- join "," $urls -}}
{{- end -}}

{{/* The Redis URL passed as a flag; empty when none (or when it comes from redis.urlSecret). */}}
{{- define "radixgate.redisURL" -}}
{{- if and .Values.redis.enabled (or .Values.redis.externalUrl .Values.redis.urlSecret.name) -}}
{{- fail "redis.externalUrl / redis.urlSecret need redis.enabled=false (the bundled Redis is on)" -}}
{{- end -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s-redis:%d/0" (include "radixgate.fullname" .) (int .Values.redis.port) -}}
{{- else if not .Values.redis.urlSecret.name -}}
{{- .Values.redis.externalUrl -}}
{{- end -}}
{{- end -}}

{{/* Env var reading the Redis URL from redis.urlSecret: call with (dict "ctx" $ "var" NAME). */}}
{{- define "radixgate.redisURLEnv" -}}
{{- if .ctx.Values.redis.urlSecret.name -}}
- name: {{ .var }}
  valueFrom:
    secretKeyRef:
      name: {{ .ctx.Values.redis.urlSecret.name }}
      key: {{ .ctx.Values.redis.urlSecret.key }}
{{- end }}
{{- end -}}

{{- define "radixgate.adminSecretName" -}}
{{- if .Values.adminToken.existingSecret -}}
{{- .Values.adminToken.existingSecret -}}
{{- else if .Values.adminToken.value -}}
{{- printf "%s-admin" (include "radixgate.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* Env var with the admin token: call with (dict "ctx" $ "var" NAME); nothing when unset. */}}
{{- define "radixgate.adminTokenEnv" -}}
{{- $secret := include "radixgate.adminSecretName" .ctx -}}
{{- if $secret -}}
- name: {{ .var }}
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ .ctx.Values.adminToken.secretKey }}
{{- end }}
{{- end -}}

{{/* The worker's --model: "tiny", or the model directory inside the mounted volume. */}}
{{- define "radixgate.modelArg" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "tiny" -}}
tiny
{{- else if has $m.source (list "pvc" "hostPath") -}}
{{- if and (eq $m.source "pvc") (not $m.pvc.claimName) -}}
{{- fail "model.source=pvc needs model.pvc.claimName" -}}
{{- end -}}
{{- if and (eq $m.source "hostPath") (not $m.hostPath.path) -}}
{{- fail "model.source=hostPath needs model.hostPath.path" -}}
{{- end -}}
{{- if $m.dir -}}
{{- printf "%s/%s" (trimSuffix "/" $m.mountPath) (trimPrefix "/" $m.dir) -}}
{{- else -}}
{{- $m.mountPath -}}
{{- end -}}
{{- else -}}
{{- fail (printf "model.source must be tiny, pvc or hostPath, not %q" $m.source) -}}
{{- end -}}
{{- end -}}

{{/* The model volume (pvc or hostPath); nothing for tiny. */}}
{{- define "radixgate.modelVolume" -}}
{{- if eq .Values.model.source "pvc" -}}
- name: model
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" -}}
- name: model
  hostPath:
    path: {{ .Values.model.hostPath.path }}
    type: {{ .Values.model.hostPath.type }}
{{- end }}
{{- end -}}

{{/*
A flag value as the CLI expects it. NOTE: Helm reads every YAML number as float64, so 100000
would print as 1e+05; whole numbers are printed as integers. And a values file's unquoted on / off
are YAML 1.1 booleans: printed as on / off, the words the programs' flags take (never true / false).
*/}}
{{- define "radixgate.flagValue" -}}
{{- if kindIs "bool" . -}}
{{- ternary "on" "off" . -}}
{{- else if and (kindIs "float64" .) (eq . (floor .)) -}}
{{- int64 . -}}
{{- else -}}
{{- . -}}
{{- end -}}
{{- end -}}

{{- define "radixgate.metricsAnnotations" -}}
{{- if .ctx.Values.metrics.podAnnotations -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | int | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end -}}
