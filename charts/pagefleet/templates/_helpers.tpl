{{/* Chart name, at most 63 characters. */}}
{{- define "pagefleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Object name prefix, at most 63 characters (component suffixes are kept within 63 too). */}}
{{- define "pagefleet.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* A component's object name: <fullname>-<component>, at most 63 characters. */}}
{{- define "pagefleet.componentName" -}}
{{- $root := index . 0 -}}
{{- $component := index . 1 -}}
{{- printf "%s-%s" (include "pagefleet.fullname" $root | trunc (int (sub 62 (len $component)))) $component | trimSuffix "-" -}}
{{- end -}}

{{- define "pagefleet.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels of every object; call with (list $ "component"). */}}
{{- define "pagefleet.labels" -}}
{{- $root := index . 0 -}}
helm.sh/chart: {{ include "pagefleet.chart" $root }}
{{ include "pagefleet.selectorLabels" . }}
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
app.kubernetes.io/part-of: pagefleet
{{- end -}}

{{- define "pagefleet.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "pagefleet.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* A pagefleet image; call with (list $ "engine"). */}}
{{- define "pagefleet.image" -}}
{{- $root := index . 0 -}}
{{- $image := $root.Values.image -}}
{{- printf "%s/%s/%s:%s" $image.registry $image.repository (index . 1) (default $root.Chart.AppVersion $image.tag) -}}
{{- end -}}

{{- define "pagefleet.operatorServiceAccount" -}}
{{- if .Values.operator.serviceAccount.create -}}
{{- default (include "pagefleet.componentName" (list . "operator")) .Values.operator.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.operator.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The Secret and key holding the built-in Redis's password. */}}
{{- define "pagefleet.redisPasswordSecret" -}}
{{- default (include "pagefleet.componentName" (list . "redis")) .Values.redis.auth.existingSecret -}}
{{- end -}}

{{/* The Secret and key holding the external Redis's URL. */}}
{{- define "pagefleet.redisUrlSecret" -}}
{{- default (include "pagefleet.componentName" (list . "redis-url")) .Values.redis.external.existingSecret -}}
{{- end -}}

{{/* The built-in Redis's address, valid from any namespace. */}}
{{- define "pagefleet.redisHost" -}}
{{- printf "%s.%s.svc" (include "pagefleet.componentName" (list . "redis")) .Release.Namespace -}}
{{- end -}}

{{/*
Environment giving a container its Redis URL as the variable named by the second argument:
the built-in Redis's URL says $(REDIS_PASSWORD), which the kubelet fills in from the
password Secret; an external Redis's URL comes whole from its Secret.
*/}}
{{- define "pagefleet.redisEnv" -}}
{{- $root := index . 0 -}}
{{- if $root.Values.redis.enabled }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "pagefleet.redisPasswordSecret" $root }}
      key: {{ $root.Values.redis.auth.secretKey }}
- name: {{ index . 1 }}
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s:6379/0" (include "pagefleet.redisHost" $root) | quote }}
{{- else }}
- name: {{ index . 1 }}
  valueFrom:
    secretKeyRef:
      name: {{ include "pagefleet.redisUrlSecret" $root }}
      key: {{ $root.Values.redis.external.secretKey }}
{{- end }}
{{- end -}}

{{/* Pod and container security settings shared by every pagefleet pod. */}}
{{- define "pagefleet.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 1000
runAsGroup: 1000
fsGroup: 1000
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "pagefleet.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end -}}
