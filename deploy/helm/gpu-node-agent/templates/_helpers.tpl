{{/*
Labels of every object: the two the kustomize tree puts on each (app.kubernetes.io/name and
part-of) and Helm's own. Selectors and pod templates carry only app.kubernetes.io/name, as in
the kustomize base, so an upgrade from either never changes an immutable selector.
*/}}
{{- define "gpu-node-agent.labels" -}}
app.kubernetes.io/name: gpu-node-agent
app.kubernetes.io/part-of: gpu-node-agent
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end -}}

{{/*
The image of every container: <registry>/<repository>@<digest> when image.digest is set,
else :<tag>, the tag defaulting to the chart's appVersion (the package's version).
*/}}
{{- define "gpu-node-agent.image" -}}
{{- $name := printf "%s/%s" .Values.image.registry .Values.image.repository | trimPrefix "/" -}}
{{- with .Values.image.digest -}}
{{- if not (regexMatch "^sha256:[0-9a-f]{64}$" .) -}}
{{- fail (printf "image.digest %q: expected sha256: and 64 lowercase hex digits" .) -}}
{{- end -}}
{{- printf "%s@%s" $name . -}}
{{- else -}}
{{- printf "%s:%s" $name (.Values.image.tag | default .Chart.AppVersion | toString) -}}
{{- end -}}
{{- end -}}

{{/*
The pods' ServiceAccount as the API server names it in request.userInfo.username: the
admission policies and the SCC match it.
*/}}
{{- define "gpu-node-agent.username" -}}
system:serviceaccount:{{ .Release.Namespace }}:gpu-node-agent
{{- end -}}

{{/* The Secrets the pods mount: yours (existingSecret) or the generated ones. */}}
{{- define "gpu-node-agent.tokensSecret" -}}
{{- .Values.tokens.existingSecret | default "gpu-node-agent-tokens" -}}
{{- end -}}
{{- define "gpu-node-agent.tlsSecret" -}}
{{- .Values.tls.existingSecret | default "gpu-node-agent-tls" -}}
{{- end -}}

{{/* The driver root's library directories, for NVML (LD_LIBRARY_PATH). */}}
{{- define "gpu-node-agent.ldLibraryPath" -}}
{{- $root := .Values.driverRoot | trimSuffix "/" -}}
{{- printf "%s/usr/lib64:%s/usr/lib/x86_64-linux-gnu:%s/usr/lib/aarch64-linux-gnu" $root $root $root -}}
{{- end -}}

{{/* migManager.configMap split into namespace and name (checked). */}}
{{- define "gpu-node-agent.migConfigMap" -}}
{{- $parts := splitList "/" .Values.migManager.configMap -}}
{{- if or (ne (len $parts) 2) (not (first $parts)) (not (last $parts)) -}}
{{- fail (printf "migManager.configMap %q: expected NAMESPACE/NAME" .Values.migManager.configMap) -}}
{{- end -}}
{{- toJson $parts -}}
{{- end -}}

{{/* Values that cannot go together, refused at render time rather than by a crashing pod. */}}
{{- define "gpu-node-agent.validate" -}}
{{- if and .Values.features.dynamicMig .Values.features.gpuShares -}}
{{- fail "features.gpuShares and features.dynamicMig cannot both be on (the agent refuses --gpu-shares with --dynamic-mig)" -}}
{{- end -}}
{{- if not (hasPrefix "/" .Values.driverRoot) -}}
{{- fail (printf "driverRoot %q: expected an absolute host path" .Values.driverRoot) -}}
{{- end -}}
{{- end -}}

{{/* Where both DaemonSets' pods run, and what they pull with. */}}
{{- define "gpu-node-agent.placement" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
