{{/* Chart name. */}}
{{- define "gcache.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Base name of every object: the release name if it contains the chart name. */}}
{{- define "gcache.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "gcache.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "gcache.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels of every object; pass (dict "ctx" $ "component" "master"), component optional. */}}
{{- define "gcache.labels" -}}
{{ include "gcache.selectorLabels" . }}
app.kubernetes.io/part-of: gcache
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
helm.sh/chart: {{ include "gcache.chart" .ctx }}
{{- end -}}

{{/* Pod template labels (no version: an upgrade that changes nothing else rolls nothing). */}}
{{- define "gcache.podLabels" -}}
{{ include "gcache.selectorLabels" . }}
app.kubernetes.io/part-of: gcache
{{- end -}}

{{- define "gcache.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gcache.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
{{- with .component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
{{- end -}}

{{- define "gcache.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "gcache.configName" -}}
{{- printf "%s-config" (include "gcache.fullname" .) -}}
{{- end -}}

{{- define "gcache.tokenSecret" -}}
{{- default (printf "%s-token" (include "gcache.fullname" .)) .Values.token.existingSecret -}}
{{- end -}}

{{/* The masters' own Raft secret: mounted by the masters only. */}}
{{- define "gcache.raftSecret" -}}
{{- default (printf "%s-raft-secret" (include "gcache.fullname" .)) .Values.raftSecret.existingSecret -}}
{{- end -}}

{{- define "gcache.masterName" -}}
{{- printf "%s-master" (include "gcache.fullname" .) -}}
{{- end -}}

{{/* The masters' stable DNS names with the API port, comma-separated. */}}
{{- define "gcache.masters" -}}
{{- $master := include "gcache.masterName" . -}}
{{- $addrs := list -}}
{{- range $i := until 3 -}}
{{- $addrs = append $addrs (printf "%s-%d.%s.%s.svc.%s:%d" $master $i $master $.Release.Namespace $.Values.clusterDomain (int $.Values.master.apiPort)) -}}
{{- end -}}
{{- join "," $addrs -}}
{{- end -}}

{{/* One TOML table from a map: key = JSON value (JSON scalars are valid TOML). */}}
{{- define "gcache.tomlTable" -}}
[{{ .name }}]
{{- range $k, $v := .values }}
{{ $k }} = {{ toJson $v }}
{{- end }}
{{- end -}}

{{- define "gcache.tokenEnv" -}}
- name: GCACHE_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "gcache.tokenSecret" . }}
      key: {{ .Values.token.existingSecretKey }}
{{- end -}}
