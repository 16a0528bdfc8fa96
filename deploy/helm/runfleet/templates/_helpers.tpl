{{/* The release's full name, at most 63 characters. */}}
{{- define "runfleet.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "runfleet.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "runfleet.selector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "runfleet.serviceAccount" -}}
{{- default (include "runfleet.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{/* The runner pods' namespace: runners.namespace, or the release's. */}}
{{- define "runfleet.runnerNamespace" -}}
{{- default .Release.Namespace .Values.runners.namespace -}}
{{- end -}}

{{/* What the manager may do in its runners' namespace. */}}
{{- define "runfleet.runnerRules" -}}
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, create, delete]
- apiGroups: [""]
  resources: [pods/log]
  verbs: [get]
- apiGroups: [""]
  resources: [secrets]
  verbs: [list, create, delete]
{{- if ne (include "runfleet.runnerNamespace" .) .Release.Namespace }}
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create, patch]
{{- end }}
{{- end -}}

{{/* The config as the pods read it: values.config, with what running in
the cluster needs filled in where the values leave it out. */}}
{{- define "runfleet.config" -}}
{{- $c := deepCopy .Values.config -}}
{{- $_ := set $c "state_dir" (default "/var/lib/runfleet" $c.state_dir) -}}
{{- if and (gt (int .Values.replicaCount) 1) (not (hasKey $c "leader_election")) -}}
{{- $le := dict "in_cluster" true "identity" "${POD_NAME}" -}}
{{- if .Values.service.webhookPort -}}
{{- $_ := set $le "advertise" (printf "http://${POD_IP}:%v" .Values.service.webhookPort) -}}
{{- end -}}
{{- $_ := set $c "leader_election" $le -}}
{{- end -}}
{{- $pools := list -}}
{{- range $p := ($c.pools | default list) -}}
{{- if and (hasKey $p "kubernetes") (not (hasKey $p.kubernetes "namespace")) -}}
{{- $_ := set $p.kubernetes "namespace" (include "runfleet.runnerNamespace" $) -}}
{{- end -}}
{{- $pools = append $pools $p -}}
{{- end -}}
{{- if $c.pools -}}
{{- $_ := set $c "pools" $pools -}}
{{- end -}}
{{- if and .Values.history.persistence.enabled (not (hasKey $c "history")) -}}
{{- $_ := set $c "history" (dict "path" "/var/lib/runfleet-history/history.db") -}}
{{- end -}}
{{- toYaml $c -}}
{{- end -}}
