{{/* The name of everything the chart creates. */}}
{{- define "cosmosq.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "cosmosq.selectorLabels" -}}
app.kubernetes.io/name: cosmosq-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "cosmosq.labels" -}}
{{ include "cosmosq.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "cosmosq.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "cosmosq.sidecarImage" -}}
{{- printf "%s:%s" .Values.sidecarImage.repository (default .Chart.AppVersion .Values.sidecarImage.tag) -}}
{{- end -}}

{{- define "cosmosq.externalMetricsSecret" -}}
{{- default (printf "%s-external-metrics-tls" (include "cosmosq.fullname" .)) .Values.externalMetrics.existingSecret -}}
{{- end -}}

{{/* Non-empty when the operator serves TLS: always, since /metrics is served only there (and
the external metrics API and the KEDA endpoint, when on). */}}
{{- define "cosmosq.secure" -}}
true
{{- end }}
