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
{{- with .Values.jobs.rollouts.endpoint }}
{{- if not (hasKey (include "ratchet.servingEndpoints" $ | fromYaml) .) }}
{{- fail (printf "jobs.rollouts.endpoint %q is neither `vllm` (with serving.vllm.enabled) nor a name of serving.endpoints" .) }}
{{- end }}
{{- if and (eq . "vllm") (not $.Values.serving.vllm.lora.enabled) }}
{{- fail "jobs.rollouts.endpoint is vllm: rollouts load adapters, so serving.vllm.lora.enabled must be true" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The base model jobs roll out on: jobs.rollouts.model, else the chart's vLLM's. */}}
{{- define "ratchet.rolloutModel" -}}
{{- $rollouts := .Values.jobs.rollouts }}
{{- $model := $rollouts.model | default (ternary .Values.serving.vllm.servedModelName "" (eq $rollouts.endpoint "vllm")) }}
{{- if not $model }}
{{- fail (printf "jobs.rollouts.model is required: the base model the endpoint %q serves" $rollouts.endpoint) }}
{{- end }}
{{- $model }}
{{- end }}

{{/*
"true" when the chart's vLLM takes runtime adapter loads (its key then loads adapters too):
asked for, or needed by the jobs' rollouts.
*/}}
{{- define "ratchet.vllmRuntimeLoading" -}}
{{- $vllm := .Values.serving.vllm }}
{{- if and $vllm.lora.enabled (or $vllm.lora.runtimeLoading (eq .Values.jobs.rollouts.endpoint "vllm")) }}true{{ end }}
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

{{/* The Secret holding vLLM's --api-key, and its key: the user's, or the chart's own. */}}
{{- define "ratchet.vllmApiKeySecretName" -}}
{{- .Values.serving.vllm.apiKey.existingSecret | default (include "ratchet.componentName" (list . "vllm-api-key")) }}
{{- end }}

{{/*
vLLM's generated API key: the one already in the release's Secret (so upgrades keep it),
else a new one, made only when a cluster answers the lookup (the release namespace's
`default` ServiceAccount is there): rendered without one (helm template, Argo CD, a client
dry run) a generated key would change on every render, so rendering fails and says to name a
Secret made once. Worked out once per render.
*/}}
{{- define "ratchet.vllmApiKey" -}}
{{- if not (hasKey .Values.serving.vllm "_resolvedApiKey") }}
{{- $name := include "ratchet.vllmApiKeySecretName" . }}
{{- $key := .Values.serving.vllm.apiKey.key }}
{{- $existing := lookup "v1" "Secret" .Release.Namespace $name }}
{{- $value := "" }}
{{- if and $existing $existing.data (hasKey $existing.data $key) }}
{{- $value = index $existing.data $key | b64dec }}
{{- else if lookup "v1" "ServiceAccount" .Release.Namespace "default" }}
{{- $value = randAlphaNum 48 }}
{{- else }}
{{- fail (printf "serving.vllm.apiKey.existingSecret is empty and no cluster answered (helm template, Argo CD, a client dry run, or namespace %s does not exist yet): a key generated here would change on every render. Create the Secret once, e.g. `kubectl -n %s create secret generic vllm-api-key --from-literal=%s=\"$(openssl rand -hex 32)\"`, and set serving.vllm.apiKey.existingSecret: vllm-api-key" .Release.Namespace .Release.Namespace $key) }}
{{- end }}
{{- $_ := set .Values.serving.vllm "_resolvedApiKey" $value }}
{{- end }}
{{- .Values.serving.vllm._resolvedApiKey }}
{{- end }}

{{/*
The serving endpoints loops may name, as YAML: serving.endpoints plus the chart's vLLM as
`vllm`. Each entry keeps the values' spelling plus its Secret reference; ratchet.servingEnv
turns them into RATCHET_SERVING_ENDPOINTS.
*/}}
{{- define "ratchet.servingEndpoints" -}}
{{- $endpoints := dict }}
{{- range $name, $endpoint := .Values.serving.endpoints }}
{{- $_ := set $endpoints $name $endpoint }}
{{- end }}
{{- if .Values.serving.vllm.enabled }}
{{- $vllm := dict "kind" "kubernetes" "url" (printf "http://%s:%v" (include "ratchet.componentName" (list . "vllm")) .Values.serving.vllm.port) "deployment" (include "ratchet.componentName" (list . "vllm")) "container" "vllm" "apiKeySecret" (dict "name" (include "ratchet.vllmApiKeySecretName" .) "key" .Values.serving.vllm.apiKey.key) }}
{{- $_ := set $endpoints "vllm" $vllm }}
{{- end }}
{{- toYaml $endpoints }}
{{- end }}

{{/*
RATCHET_SERVING_ENDPOINTS for the api (withKeys false: names, kinds, URLs; it checks what a
loop names) or the worker (withKeys true: each api_key comes from its Secret through an
env var the kubelet expands into the JSON, so no key is written in the pod spec).
*/}}
{{- define "ratchet.servingEnv" -}}
{{- $ctx := index . 0 }}
{{- $withKeys := index . 1 }}
{{- $endpoints := include "ratchet.servingEndpoints" $ctx | fromYaml }}
{{- $json := dict }}
{{- $index := 0 }}
{{- range $name, $e := $endpoints }}
{{- $entry := dict "kind" $e.kind "url" $e.url }}
{{- range $from, $to := dict "deployment" "deployment" "container" "container" "envVar" "env_var" "artifactsDir" "artifacts_dir" "rolloutTimeoutS" "rollout_timeout_s" "timeoutS" "timeout_s" }}
{{- if hasKey $e $from }}
{{- $_ := set $entry $to (index $e $from) }}
{{- end }}
{{- end }}
{{- if and $withKeys $e.apiKeySecret }}
{{- $var := printf "SERVING_ENDPOINT_KEY_%d" $index }}
{{- $_ := set $entry "api_key" (printf "$(%s)" $var) }}
- name: {{ $var }}
  valueFrom:
    secretKeyRef:
      name: {{ $e.apiKeySecret.name }}
      key: {{ $e.apiKeySecret.key }}
{{- end }}
{{- $_ := set $json $name $entry }}
{{- $index = add1 $index }}
{{- end }}
{{- if $endpoints }}
- name: RATCHET_SERVING_ENDPOINTS
  value: {{ toJson $json | quote }}
{{- end }}
{{- end }}

{{/*
The Deployments the worker may patch, by name: every kubernetes serving endpoint's, plus
rbac.servingTarget.deploymentNames. Never Ratchet's own api or worker.
*/}}
{{- define "ratchet.servingDeploymentNames" -}}
{{- $names := list }}
{{- range $name, $e := include "ratchet.servingEndpoints" . | fromYaml }}
{{- if eq $e.kind "kubernetes" }}
{{- $names = append $names $e.deployment }}
{{- end }}
{{- end }}
{{- $names = concat $names .Values.rbac.servingTarget.deploymentNames | uniq | sortAlpha }}
{{- range $own := list "api" "worker" }}
{{- $ownName := include "ratchet.componentName" (list $ $own) }}
{{- if has $ownName $names }}
{{- fail (printf "the worker may never patch Ratchet's own %s Deployment %s: remove it from serving.endpoints and rbac.servingTarget.deploymentNames" $own $ownName) }}
{{- end }}
{{- end }}
{{- toYaml $names }}
{{- end }}

{{/* The Kubernetes API server's addresses for the worker's egress: configured, else looked up. */}}
{{- define "ratchet.kubernetesApiCidrs" -}}
{{- $cidrs := .Values.networkPolicy.kubernetesApiCidrs }}
{{- if not $cidrs }}
{{- $endpoints := lookup "v1" "Endpoints" "default" "kubernetes" }}
{{- range $subset := (default dict $endpoints).subsets }}
{{- range $address := $subset.addresses }}
{{- $cidrs = append $cidrs (printf "%s/%s" $address.ip (ternary "128" "32" (contains ":" $address.ip))) }}
{{- end }}
{{- end }}
{{- end }}
{{- if not $cidrs }}
{{- fail "networkPolicy.kubernetesApiCidrs is empty and the API server's addresses could not be looked up (helm template, Argo CD): set it, e.g. from `kubectl get endpoints kubernetes -n default`" }}
{{- end }}
{{- toYaml $cidrs }}
{{- end }}
