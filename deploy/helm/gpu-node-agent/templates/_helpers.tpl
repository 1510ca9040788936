{{/* The namespace of every namespaced object (values namespace). */}}
{{- define "gpu-node-agent.namespace" -}}
{{- required "namespace must not be empty" .Values.namespace -}}
{{- end -}}

{{/*
Labels of every object: the two the kustomize base puts on each (app.kubernetes.io/name and
part-of) and Helm's standard ones. Selectors use only app.kubernetes.io/name, as in the base,
so an upgrade never changes an immutable selector.
*/}}
{{- define "gpu-node-agent.labels" -}}
app.kubernetes.io/name: gpu-node-agent
app.kubernetes.io/part-of: gpu-node-agent
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end -}}

{{/* The image: registry/repository@digest when image.digest is set, else :tag (default the
chart's appVersion). */}}
{{- define "gpu-node-agent.image" -}}
{{- $name := printf "%s/%s" .Values.image.registry .Values.image.repository | trimPrefix "/" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" $name .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" $name (.Values.image.tag | default .Chart.AppVersion | toString) -}}
{{- end -}}
{{- end -}}
