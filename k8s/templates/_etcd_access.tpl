{{/*
How the metadata service reaches etcd (etcd.tls, etcd.auth): TLS with a client certificate
(the metadata service mounts etcd.tls.secretName's ca.crt, tls.crt, tls.key), and etcd's auth
as etcd.auth.user, whose role may read and write only metadata.etcdPrefix (the password from
etcd.auth.passwordSecret, as a file). The bundled etcd serves https with --client-cert-auth
from etcd.tls.serverSecretName. Empty secret names are the chart's own: cert-manager's
Certificates (certificates.yaml) with certManager.enabled, else what generated-secrets.yaml
makes. Files are mounted read-only, mode 0400.
*/}}

{{- define "pdcluster.etcdName" -}}{{ include "pdcluster.fullname" . }}-etcd{{- end -}}
{{- define "pdcluster.etcdClientDir" -}}/var/run/secrets/pdcluster-etcd-client{{- end -}}
{{- define "pdcluster.etcdAuthDir" -}}/var/run/secrets/pdcluster-etcd-auth{{- end -}}
{{- define "pdcluster.etcdServerDir" -}}/var/run/secrets/pdcluster-etcd-server{{- end -}}

{{- define "pdcluster.etcdScheme" -}}{{ ternary "https" "http" .Values.etcd.tls.enabled }}{{- end -}}

{{- define "pdcluster.etcdClientSecret" -}}
{{- .Values.etcd.tls.secretName | default (printf "%s-client" (include "pdcluster.etcdName" .)) -}}
{{- end -}}

{{- define "pdcluster.etcdServerSecret" -}}
{{- .Values.etcd.tls.serverSecretName | default (printf "%s-server" (include "pdcluster.etcdName" .)) -}}
{{- end -}}

{{/* The name the metadata service checks in etcd's certificate. */}}
{{- define "pdcluster.etcdServerName" -}}
{{- if .Values.etcd.tls.serverName -}}
{{- .Values.etcd.tls.serverName -}}
{{- else if .Values.etcd.enabled -}}
{{- printf "%s.%s" (include "pdcluster.etcdName" .) (include "pdcluster.svcDomain" .) -}}
{{- end -}}
{{- end -}}

{{/* `pdcluster metadata serve|etcd-setup` flags: endpoints, prefix, TLS, user. */}}
{{- define "pdcluster.etcdAccessArgs" -}}
- --etcd={{ include "pdcluster.etcdEndpoints" . }}
- --etcd-prefix={{ .Values.metadata.etcdPrefix }}
{{- if .Values.etcd.tls.enabled }}
- --etcd-tls-ca={{ include "pdcluster.etcdClientDir" . }}/ca.crt
- --etcd-tls-cert={{ include "pdcluster.etcdClientDir" . }}/tls.crt
- --etcd-tls-key={{ include "pdcluster.etcdClientDir" . }}/tls.key
{{- with include "pdcluster.etcdServerName" . }}
- --etcd-tls-server-name={{ . }}
{{- end }}
{{- end }}
{{- if .Values.etcd.auth.enabled }}
- --etcd-user={{ .Values.etcd.auth.user }}
- --etcd-password-file={{ include "pdcluster.etcdAuthDir" . }}/password
{{- end }}
{{- end -}}

{{- define "pdcluster.etcdAccessVolumes" -}}
{{- if .Values.etcd.tls.enabled }}
{{ include "pdcluster.secretFilesVolume" (list "etcd-client" (include "pdcluster.etcdClientSecret" .) (list "ca.crt" "tls.crt" "tls.key")) }}
{{- end }}
{{- if .Values.etcd.auth.enabled }}
{{- $password := include "pdcluster.etcdPasswordSecret" . | fromYaml }}
- name: etcd-auth
  secret:
    secretName: {{ $password.name }}
    defaultMode: 0400
    items:
      - key: {{ $password.key }}
        path: password
{{- end }}
{{- end -}}

{{- define "pdcluster.etcdAccessMounts" -}}
{{- if .Values.etcd.tls.enabled }}
{{ include "pdcluster.readOnlyMount" (list "etcd-client" (include "pdcluster.etcdClientDir" .)) }}
{{- end }}
{{- if .Values.etcd.auth.enabled }}
{{ include "pdcluster.readOnlyMount" (list "etcd-auth" (include "pdcluster.etcdAuthDir" .)) }}
{{- end }}
{{- end -}}

{{/* The bundled etcd's own TLS flags (clients: https with a certificate etcd's CA signed). */}}
{{- define "pdcluster.etcdServerTlsArgs" -}}
{{- if .Values.etcd.tls.enabled }}
- --cert-file={{ include "pdcluster.etcdServerDir" . }}/tls.crt
- --key-file={{ include "pdcluster.etcdServerDir" . }}/tls.key
- --client-cert-auth
- --trusted-ca-file={{ include "pdcluster.etcdServerDir" . }}/ca.crt
{{- end }}
{{- end -}}
