{{/*
Names of what generated-secrets.yaml makes, and the Secrets the etcd credentials come from:
the ones the values name, else the generated ones.
*/}}

{{/* (list $ name data): a generated Secret (data: base64 values), kept on uninstall. */}}
{{- define "pdcluster.generatedSecret" -}}
{{- $root := index . 0 -}}
apiVersion: v1
kind: Secret
metadata:
  name: {{ index . 1 }}
  labels:
    {{- include "pdcluster.componentLabels" (list $root "secrets") | nindent 4 }}
  annotations:
    # generated once and read back on upgrade: an uninstall must not take what pods hold
    helm.sh/resource-policy: keep
type: Opaque
data:
  {{- range $key, $value := index . 2 }}
  {{ $key }}: {{ $value | quote }}
  {{- end }}
{{- end -}}

{{- define "pdcluster.generatedEtcdAuthSecret" -}}{{ include "pdcluster.fullname" . }}-etcd-auth{{- end -}}

{{/* The etcd user's password: (dict name key) of etcd.auth.passwordSecret, else generated. */}}
{{- define "pdcluster.etcdPasswordSecret" -}}
{{- $given := .Values.etcd.auth.passwordSecret -}}
{{- if $given.name -}}
{{- toYaml (dict "name" $given.name "key" $given.key) -}}
{{- else -}}
{{- toYaml (dict "name" (include "pdcluster.generatedEtcdAuthSecret" .) "key" "password") -}}
{{- end -}}
{{- end -}}

{{/* etcd's root password (the setup Job only): etcd.auth.rootPasswordSecret, else generated. */}}
{{- define "pdcluster.etcdRootPasswordSecret" -}}
{{- $given := .Values.etcd.auth.rootPasswordSecret -}}
{{- if $given.name -}}
{{- toYaml (dict "name" $given.name "key" $given.key) -}}
{{- else -}}
{{- toYaml (dict "name" (include "pdcluster.generatedEtcdAuthSecret" .) "key" "root-password") -}}
{{- end -}}
{{- end -}}

{{- define "pdcluster.generatedRouterSaltSecret" -}}{{ include "pdcluster.fullname" . }}-router-salt{{- end -}}

{{/* The router's cache-salt key: (dict name key) of router.cacheSaltKeySecret, else generated. */}}
{{- define "pdcluster.routerSaltSecret" -}}
{{- $given := .Values.router.cacheSaltKeySecret -}}
{{- if $given.name -}}
{{- toYaml (dict "name" $given.name "key" $given.key) -}}
{{- else -}}
{{- toYaml (dict "name" (include "pdcluster.generatedRouterSaltSecret" .) "key" "cache-salt-key") -}}
{{- end -}}
{{- end -}}
