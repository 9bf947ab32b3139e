{{/*
Shared helpers. Names follow the usual chart conventions: <release>-<chart>, cut to 63
characters (the DNS label limit Kubernetes enforces on most names).
*/}}

{{- define "ratchet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "ratchet.fullname" -}}
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

{{/* A component's object name: <fullname>-<component>, within 63 characters. */}}
{{- define "ratchet.componentName" -}}
{{- $root := index . 0 }}
{{- $component := index . 1 }}
{{- printf "%s-%s" (include "ratchet.fullname" $root | trunc (int (sub 62 (len $component))) | trimSuffix "-") $component }}
{{- end }}

{{- define "ratchet.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "ratchet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ratchet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "ratchet.labels" -}}
helm.sh/chart: {{ include "ratchet.chart" . }}
{{ include "ratchet.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: ratchet
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Labels of one component: call with (list $ "api"). */}}
{{- define "ratchet.componentLabels" -}}
{{ include "ratchet.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "ratchet.componentSelectorLabels" -}}
{{ include "ratchet.selectorLabels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* An image reference from {repository, tag, digest}; the tag defaults to appVersion. */}}
{{- define "ratchet.image" -}}
{{- $root := index . 0 }}
{{- $image := index . 1 }}
{{- if $image.digest }}
{{- printf "%s@%s" $image.repository $image.digest }}
{{- else }}
{{- printf "%s:%s" $image.repository (default $root.Chart.AppVersion $image.tag | toString) }}
{{- end }}
{{- end }}

{{- define "ratchet.configMapName" -}}
{{- include "ratchet.componentName" (list . "config") }}
{{- end }}

{{- define "ratchet.jobTemplateConfigMapName" -}}
{{- include "ratchet.componentName" (list . "job-template") }}
{{- end }}

{{/* Where the worker finds the job template file. */}}
{{- define "ratchet.jobTemplateDir" -}}
/etc/ratchet/job-template
{{- end }}

{{- define "ratchet.jobTemplatePath" -}}
{{- printf "%s/job-template.yaml" (include "ratchet.jobTemplateDir" .) }}
{{- end }}

{{/* The Secret the pods read the database URL, admin token and API key from. */}}
{{- define "ratchet.secretName" -}}
{{- if .Values.secrets.existingSecret }}
{{- .Values.secrets.existingSecret }}
{{- else }}
{{- include "ratchet.componentName" (list . "secrets") }}
{{- end }}
{{- end }}

{{- define "ratchet.artifactClaimName" -}}
{{- if .Values.artifacts.persistence.existingClaim }}
{{- .Values.artifacts.persistence.existingClaim }}
{{- else }}
{{- include "ratchet.componentName" (list . "artifacts") }}
{{- end }}
{{- end }}

{{- define "ratchet.workerServiceAccountName" -}}
{{- default (include "ratchet.componentName" (list . "worker")) .Values.serviceAccount.workerName }}
{{- end }}

{{- define "ratchet.apiServiceAccountName" -}}
{{- default (include "ratchet.componentName" (list . "api")) .Values.serviceAccount.apiName }}
{{- end }}

{{- define "ratchet.jobServiceAccountName" -}}
{{- default (include "ratchet.componentName" (list . "job")) .Values.jobs.serviceAccount.name }}
{{- end }}

{{/* RATCHET_PUBLIC_URL: the configured one, else the first ingress host. */}}
{{- define "ratchet.publicUrl" -}}
{{- if .Values.config.publicUrl }}
{{- .Values.config.publicUrl }}
{{- else if and .Values.api.ingress.enabled .Values.api.ingress.hosts }}
{{- $host := (first .Values.api.ingress.hosts).host }}
{{- $scheme := "http" }}
{{- range .Values.api.ingress.tls }}
{{- if has $host .hosts }}
{{- $scheme = "https" }}
{{- end }}
{{- end }}
{{- printf "%s://%s" $scheme $host }}
{{- end }}
{{- end }}

{{/*
Fail early, at render time, on settings the processes would refuse at start: no
database, no Temporal, or secrets given twice.
*/}}
{{- define "ratchet.validate" -}}
{{- if not .Values.temporal.address }}
{{- fail "temporal.address is required: host:port of your Temporal frontend, e.g. temporal-frontend.temporal:7233" }}
{{- end }}
{{- if .Values.secrets.existingSecret }}
{{- if or .Values.database.url .Values.secrets.adminToken .Values.temporal.apiKey }}
{{- fail "secrets.existingSecret is set: leave database.url, secrets.adminToken and temporal.apiKey empty and put them in that Secret" }}
{{- end }}
{{- else if not .Values.database.url }}
{{- fail "database.url is required (postgresql://user:password@host:5432/db), or name a Secret holding it in secrets.existingSecret" }}
{{- end }}
{{- if and .Values.temporal.apiKey (not .Values.temporal.tls.enabled) }}
{{- fail "temporal.apiKey needs temporal.tls.enabled: true (API keys are only sent over TLS)" }}
{{- end }}
{{- range $section := list "requests" "limits" }}
{{- $gpus := index (default dict (index $.Values.jobs.resources $section)) "nvidia.com/gpu" }}
{{- if and (not (kindIs "invalid" $gpus)) (ne (toString $gpus) (toString $.Values.jobs.gpusPerNode)) }}
{{- fail (printf "jobs.resources.%s has nvidia.com/gpu %v but jobs.gpusPerNode is %v: set jobs.gpusPerNode alone" $section $gpus $.Values.jobs.gpusPerNode) }}
{{- end }}
{{- end }}
{{- if and (include "ratchet.temporalTlsFiles" .) (ne (empty .Values.temporal.tls.certKey) (empty .Values.temporal.tls.keyKey)) }}
{{- fail "temporal.tls.certKey and temporal.tls.keyKey go together: set both for mTLS, or neither" }}
{{- end }}
{{- end }}

{{/* Environment from Secret keys; optional ones may be absent from an existing Secret. */}}
{{- define "ratchet.secretEnv" -}}
{{- $secret := include "ratchet.secretName" . }}
{{- $keys := .Values.secrets.existingSecretKeys }}
{{- $external := .Values.secrets.existingSecret -}}
- name: RATCHET_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ ternary $keys.databaseUrl "RATCHET_DATABASE_URL" (not (empty $external)) }}
- name: RATCHET_SECRET_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ ternary $keys.secretKey "RATCHET_SECRET_KEY" (not (empty $external)) }}
{{- if or $external .Values.secrets.adminToken }}
- name: RATCHET_ADMIN_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ ternary $keys.adminToken "RATCHET_ADMIN_TOKEN" (not (empty $external)) }}
      optional: true
{{- end }}
{{- if or $external .Values.temporal.apiKey }}
- name: RATCHET_TEMPORAL_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ ternary $keys.temporalApiKey "RATCHET_TEMPORAL_API_KEY" (not (empty $external)) }}
      optional: true
{{- end }}
{{- end }}

{{/* Pod-level settings every Ratchet pod shares. */}}
{{- define "ratchet.podSecurity" -}}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Volumes the read-only root filesystem needs: scratch state and /tmp. */}}
{{- define "ratchet.scratchVolumes" -}}
- name: state
  emptyDir: {}
- name: tmp
  emptyDir: {}
{{- end }}

{{- define "ratchet.scratchMounts" -}}
- name: state
  mountPath: {{ .Values.config.stateDir }}
- name: tmp
  mountPath: /tmp
{{- end }}

{{/*
"true" when TLS files come from a Secret. TLS without temporal.tls.secretName means server
TLS with the system roots and no client certificate (Temporal Cloud with an API key).
*/}}
{{- define "ratchet.temporalTlsFiles" -}}
{{- if and .Values.temporal.tls.enabled .Values.temporal.tls.secretName }}true{{ end }}
{{- end }}

{{/* The Temporal TLS Secret as a volume; callers include it when ratchet.temporalTlsFiles. */}}
{{- define "ratchet.temporalTlsVolume" -}}
- name: temporal-tls
  secret:
    secretName: {{ .Values.temporal.tls.secretName }}
    defaultMode: 0440
{{- end }}

{{- define "ratchet.temporalTlsMount" -}}
- name: temporal-tls
  mountPath: {{ .Values.temporal.tls.mountPath }}
  readOnly: true
{{- end }}

{{/* Checksums that roll the pods when their configuration changes. */}}
{{- define "ratchet.configChecksums" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
checksum/secret: {{ include (print .Template.BasePath "/secret.yaml") . | sha256sum }}
{{- end }}

{{/*
The key that encrypts stored signing secrets (RATCHET_SECRET_KEY): secrets.secretKey, else
the one already in the release's Secret (so upgrades keep it), else a new Fernet key. Worked
out once per render and remembered in .Values, so the Secret and the migration hook's copy
hold the same key.
*/}}
{{- define "ratchet.secretKey" -}}
{{- if not (hasKey .Values.secrets "_resolvedSecretKey") }}
{{- $key := .Values.secrets.secretKey }}
{{- if not $key }}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "ratchet.secretName" .) }}
{{- if and $existing $existing.data (hasKey $existing.data "RATCHET_SECRET_KEY") }}
{{- $key = index $existing.data "RATCHET_SECRET_KEY" | b64dec }}
{{- else }}
{{- $key = randBytes 32 | replace "+" "-" | replace "/" "_" }}
{{- end }}
{{- end }}
{{- $_ := set .Values.secrets "_resolvedSecretKey" $key }}
{{- end }}
{{- .Values.secrets._resolvedSecretKey }}
{{- end }}
