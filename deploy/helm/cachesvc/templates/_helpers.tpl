{{/* Names, labels and the pieces several manifests share. */}}

{{- define "cachesvc.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release-scoped base name; every object is "<fullname>" or "<fullname>-<part>". */}}
{{- define "cachesvc.fullname" -}}
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

{{- define "cachesvc.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "cachesvc.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of one component: call with (dict "root" $ "component" "router"). */}}
{{- define "cachesvc.selectorLabels" -}}
app.kubernetes.io/name: {{ include "cachesvc.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Image of the Dockerfile's `cpu` or `cuda` target: (dict "root" $ "target" "cpu"). */}}
{{- define "cachesvc.image" -}}
{{- $img := .root.Values.image -}}
{{- $tag := ternary $img.cudaTag $img.cpuTag (eq .target "cuda") -}}
{{- printf "%s:%s" $img.repository ($tag | default (printf "%s-%s" .root.Chart.AppVersion .target)) -}}
{{- end -}}

{{- define "cachesvc.rayClusterName" -}}
{{- printf "%s-ray" (include "cachesvc.fullname" .) -}}
{{- end -}}

{{/* KubeRay names the head's Service "<RayCluster name>-head-svc". */}}
{{- define "cachesvc.rayHeadHost" -}}
{{- printf "%s-head-svc.%s.svc" (include "cachesvc.rayClusterName" .) .Release.Namespace -}}
{{- end -}}

{{- define "cachesvc.authSecretName" -}}
{{- .Values.auth.existingSecret | default (printf "%s-auth" (include "cachesvc.fullname" .)) -}}
{{- end -}}

{{- define "cachesvc.redisSecretName" -}}
{{- if .Values.redis.enabled -}}
{{- .Values.redis.auth.existingSecret | default (printf "%s-redis" (include "cachesvc.fullname" .)) -}}
{{- else -}}
{{- .Values.redis.external.existingSecret -}}
{{- end -}}
{{- end -}}

{{/* Where the Redis CA certificate is mounted when redis.external.tls has one. */}}
{{- define "cachesvc.redisCaFile" -}}
{{- $tls := .Values.redis.external.tls -}}
{{- if and (not .Values.redis.enabled) .Values.redis.external.host $tls.enabled $tls.caSecret -}}
{{- printf "/etc/cachesvc/redis-ca/%s" $tls.caKey -}}
{{- end -}}
{{- end -}}

{{/* Where the tier key is mounted in the worker pods when tierKey.secretName is set. */}}
{{- define "cachesvc.tierKeyFile" -}}
{{- if .Values.tierKey.secretName -}}
/var/run/secrets/cachesvc-tier-key/key
{{- end -}}
{{- end -}}

{{/* Volume and mount of the tier key Secret: (dict "root" $ "part" "volume"|"mount"). */}}
{{- define "cachesvc.tierKey" -}}
{{- $key := .root.Values.tierKey -}}
{{- if $key.secretName -}}
{{- if eq .part "volume" -}}
- name: tier-key
  secret:
    secretName: {{ $key.secretName }}
    items:
      - key: {{ $key.secretKey }}
        path: key
{{- else -}}
- name: tier-key
  mountPath: /var/run/secrets/cachesvc-tier-key
  readOnly: true
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The Redis URL (no password in it) of the chart's Redis or redis.external; "" for none. */}}
{{- define "cachesvc.redisUrl" -}}
{{- $r := .Values.redis -}}
{{- if $r.enabled -}}
{{- printf "redis://%s-redis.%s.svc:6379/%d" (include "cachesvc.fullname" .) .Release.Namespace (int $r.db) -}}
{{- else if $r.external.host -}}
{{- printf "%s://%s:%d/%d" (ternary "rediss" "redis" $r.external.tls.enabled) $r.external.host (int $r.external.port) (int $r.db) -}}
{{- end -}}
{{- end -}}

{{/*
The `cachesvc serve --config` file: .Values.config, key for key (ServeConfig and its nested
EngineConfig / TierConfig / RouterConfig), with what only the chart knows filled in where it is
null. cachesvc rejects a key that is not a dataclass field, naming it.
*/}}
{{- define "cachesvc.serveConfig" -}}
{{- $cfg := deepCopy .Values.config -}}
{{- $router := $cfg.router | default dict -}}
{{- $engine := $cfg.engine | default dict -}}
{{- $tiers := $engine.tiers | default dict -}}
{{- range $secret := list (list $router "auth_token" "auth.token") (list $tiers "redis_password" "redis.auth.password") -}}
{{- if hasKey (index $secret 0) (index $secret 1) -}}
{{- fail (printf "config: %s would land in a ConfigMap: set %s (a Secret) instead" (index $secret 1) (index $secret 2)) -}}
{{- end -}}
{{- end -}}
{{- if kindIs "invalid" $cfg.ray_address -}}
{{- if not .Values.rayCluster.enabled -}}
{{- fail "rayCluster.enabled is false: set config.ray_address to your Ray cluster (ray://HOST:10001)" -}}
{{- end -}}
{{- $_ := set $cfg "ray_address" (printf "ray://%s:%d" (include "cachesvc.rayHeadHost" .) (int .Values.rayCluster.head.clientPort)) -}}
{{- end -}}
{{- /* Workers each take one GPU: by default one per GPU of each group (_workers.tpl). */ -}}
{{- $counts := include "cachesvc.workerCounts" . | fromYaml -}}
{{- if kindIs "invalid" $cfg.num_workers -}}
{{- $_ := set $cfg "num_workers" (int $counts.mixed) -}}
{{- end -}}
{{- range $role := list "prefill" "decode" -}}
{{- $key := printf "num_%s_workers" $role -}}
{{- if kindIs "invalid" (index $cfg $key) -}}
{{- if include "cachesvc.usesRoles" $ -}}
{{- $_ := set $cfg $key (int (index $counts $role)) -}}
{{- else -}}
{{- /* null is no count to cachesvc: without roles the key is left out, as it always was. */ -}}
{{- $_ := unset $cfg $key -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $mixed := int ($cfg.num_workers | default 0) -}}
{{- $prefill := int ($cfg.num_prefill_workers | default 0) -}}
{{- $decode := int ($cfg.num_decode_workers | default 0) -}}
{{- if and $prefill (not $decode) (not $mixed) -}}
{{- fail "rayCluster.roles.prefill has no workers to decode on: set rayCluster.roles.decode.replicas (or rayCluster.worker.replicas for mixed workers)" -}}
{{- end -}}
{{- if and $decode (not $prefill) (not $mixed) -}}
{{- fail "rayCluster.roles.decode has no workers to compute prompts: set rayCluster.roles.prefill.replicas (or rayCluster.worker.replicas for mixed workers)" -}}
{{- end -}}
{{- $redisUrl := include "cachesvc.redisUrl" . -}}
{{- if and $redisUrl (kindIs "invalid" $tiers.redis_url) -}}
{{- $_ := set $tiers "redis_url" $redisUrl -}}
{{- end -}}
{{- with include "cachesvc.redisCaFile" . -}}
{{- $_ := set $tiers "redis_tls_ca_file" . -}}
{{- end -}}
{{- with include "cachesvc.tierKeyFile" . -}}
{{- if $tiers.tier_key_file -}}
{{- fail "config.engine.tiers.tier_key_file is set by tierKey.secretName: set only tierKey.secretName" -}}
{{- end -}}
{{- $_ := set $tiers "tier_key_file" . -}}
{{- end -}}
{{- if $tiers -}}
{{- $_ := set $engine "tiers" $tiers -}}
{{- end -}}
{{- if $engine -}}
{{- $_ := set $cfg "engine" $engine -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* The gRPC port the router listens on: config.router.port, the one source of truth. */}}
{{- define "cachesvc.grpcPort" -}}
{{- (.Values.config.router | default dict).port | default 50051 | int -}}
{{- end -}}

{{/* The router's metrics port (config.router.metrics_port); "" when metrics are off. */}}
{{- define "cachesvc.metricsPort" -}}
{{- with (.Values.config.router | default dict).metrics_port -}}
{{- int . -}}
{{- end -}}
{{- end -}}

{{/* The router's OpenAI-compatible HTTP port (config.router.http_port); "" when it is off. */}}
{{- define "cachesvc.httpPort" -}}
{{- with (.Values.config.router | default dict).http_port -}}
{{- int . -}}
{{- end -}}
{{- end -}}

{{/* The router's env entry for the Redis password (it passes it on to its workers). */}}
{{- define "cachesvc.redisEnv" -}}
{{- $r := .Values.redis -}}
{{- $secret := include "cachesvc.redisSecretName" . -}}
{{- if and (include "cachesvc.redisUrl" .) $secret -}}
- name: CACHESVC_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ ternary $r.auth.existingSecretPasswordKey $r.external.existingSecretPasswordKey $r.enabled }}
{{- end -}}
{{- end -}}

{{/* Volume and mount of the Redis CA certificate: (dict "root" $ "part" "volume"|"mount"). */}}
{{- define "cachesvc.redisCa" -}}
{{- if include "cachesvc.redisCaFile" .root -}}
{{- if eq .part "volume" -}}
- name: redis-ca
  secret:
    secretName: {{ .root.Values.redis.external.tls.caSecret }}
{{- else -}}
- name: redis-ca
  mountPath: /etc/cachesvc/redis-ca
  readOnly: true
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Pod-level hardening shared by every cachesvc container (the image runs as uid 10001). */}}
{{- define "cachesvc.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "cachesvc.containerSecurityContext" -}}
allowPrivilegeEscalation: false
capabilities:
  drop: [ALL]
{{- end -}}

{{/* A router probe of one health service ("" = overall): the kubelet's gRPC probe, or over TLS
(which the kubelet cannot speak) the image's health check on the plaintext loopback port. */}}
{{- define "cachesvc.routerProbe" -}}
{{- $r := .root.Values.router -}}
{{- if $r.tls.enabled -}}
exec:
  command:
    - python
    - /opt/cachesvc/healthcheck.py
    - {{ printf "127.0.0.1:%v" $r.tls.healthPort | quote }}
    {{- if .service }}
    - {{ .service }}
    {{- end }}
{{- else -}}
grpc:
  port: {{ include "cachesvc.grpcPort" .root }}
  {{- if .service }}
  service: {{ .service }}
  {{- end }}
{{- end -}}
{{- end -}}
