{{/*
TLS (and optionally mTLS) on the metadata service's gRPC, from metadata.tls (off by default).
The service mounts its certificate and key from metadata.tls.secretName; the router and the
Ray pods (whose node actors register with it) mount only that Secret's ca.crt, to verify it.
With metadata.tls.clientAuth the service also mounts the client CA (clientAuth.secretName's
ca.crt) and requires a certificate it signed; the router and the Ray pods present the client
certificate from that Secret (tls.crt, tls.key). Tokens are checked on top in every case.
Every file is mounted read-only, mode 0400 (the service pods' fsGroup lets them read it).
*/}}

{{- define "pdcluster.metadataTlsDir" -}}/var/run/secrets/pdcluster-metadata-tls{{- end -}}
{{- define "pdcluster.metadataCaDir" -}}/var/run/secrets/pdcluster-metadata-ca{{- end -}}
{{- define "pdcluster.metadataClientCaDir" -}}/var/run/secrets/pdcluster-metadata-client-ca{{- end -}}
{{- define "pdcluster.metadataClientDir" -}}/var/run/secrets/pdcluster-metadata-client{{- end -}}

{{- define "pdcluster.secretFilesVolume" -}}
{{- $name := index . 0 -}}
{{- $secret := index . 1 -}}
- name: {{ $name }}
  secret:
    secretName: {{ $secret }}
    defaultMode: 0400
    items:
      {{- range index . 2 }}
      - key: {{ . }}
        path: {{ . }}
      {{- end }}
{{- end -}}

{{- define "pdcluster.readOnlyMount" -}}
- name: {{ index . 0 }}
  mountPath: {{ index . 1 }}
  readOnly: true
{{- end -}}

{{/* The metadata service's own: volumes, mounts, and its serve flags. */}}
{{- define "pdcluster.metadataTlsServerVolumes" -}}
{{- $tls := .Values.metadata.tls -}}
{{- if $tls.enabled -}}
{{ include "pdcluster.secretFilesVolume" (list "metadata-tls" $tls.secretName (list "tls.crt" "tls.key")) }}
{{- if $tls.clientAuth.enabled }}
{{ include "pdcluster.secretFilesVolume" (list "metadata-client-ca" $tls.clientAuth.secretName (list "ca.crt")) }}
{{- end }}
{{- end -}}
{{- end -}}

{{- define "pdcluster.metadataTlsServerMounts" -}}
{{- $tls := .Values.metadata.tls -}}
{{- if $tls.enabled -}}
{{ include "pdcluster.readOnlyMount" (list "metadata-tls" (include "pdcluster.metadataTlsDir" .)) }}
{{- if $tls.clientAuth.enabled }}
{{ include "pdcluster.readOnlyMount" (list "metadata-client-ca" (include "pdcluster.metadataClientCaDir" .)) }}
{{- end }}
{{- end -}}
{{- end -}}

{{- define "pdcluster.metadataTlsServerArgs" -}}
{{- $tls := .Values.metadata.tls -}}
{{- if $tls.enabled -}}
- --tls-cert={{ include "pdcluster.metadataTlsDir" . }}/tls.crt
- --tls-key={{ include "pdcluster.metadataTlsDir" . }}/tls.key
{{- if $tls.clientAuth.enabled }}
- --tls-client-ca={{ include "pdcluster.metadataClientCaDir" . }}/ca.crt
{{- end }}
{{- end -}}
{{- end -}}

{{/* Its clients' (router, Ray pods): volumes, mounts, and the files as ClientTLS fields. */}}
{{- define "pdcluster.metadataTlsClientVolumes" -}}
{{- $tls := .Values.metadata.tls -}}
{{- if $tls.enabled -}}
{{ include "pdcluster.secretFilesVolume" (list "metadata-ca" $tls.secretName (list "ca.crt")) }}
{{- if $tls.clientAuth.enabled }}
{{ include "pdcluster.secretFilesVolume" (list "metadata-client" $tls.clientAuth.secretName (list "tls.crt" "tls.key")) }}
{{- end }}
{{- end -}}
{{- end -}}

{{- define "pdcluster.metadataTlsClientMounts" -}}
{{- $tls := .Values.metadata.tls -}}
{{- if $tls.enabled -}}
{{ include "pdcluster.readOnlyMount" (list "metadata-ca" (include "pdcluster.metadataCaDir" .)) }}
{{- if $tls.clientAuth.enabled }}
{{ include "pdcluster.readOnlyMount" (list "metadata-client" (include "pdcluster.metadataClientDir" .)) }}
{{- end }}
{{- end -}}
{{- end -}}

{{/* cluster.yaml's metadata section: {address, tls_ca, tls_cert, tls_key, tls_server_name}. */}}
{{- define "pdcluster.metadataClientConfig" -}}
{{- $tls := .Values.metadata.tls -}}
{{- $config := dict "address" (include "pdcluster.metadataAddress" .) -}}
{{- if $tls.enabled -}}
{{- $_ := set $config "tls_ca" (printf "%s/ca.crt" (include "pdcluster.metadataCaDir" .)) -}}
{{- if $tls.clientAuth.enabled -}}
{{- $_ := set $config "tls_cert" (printf "%s/tls.crt" (include "pdcluster.metadataClientDir" .)) -}}
{{- $_ := set $config "tls_key" (printf "%s/tls.key" (include "pdcluster.metadataClientDir" .)) -}}
{{- end -}}
{{- with $tls.serverName -}}
{{- $_ := set $config "tls_server_name" . -}}
{{- end -}}
{{- end -}}
{{- toYaml $config -}}
{{- end -}}

{{/* The router's flags for the same settings. */}}
{{- define "pdcluster.metadataTlsRouterArgs" -}}
{{- $config := include "pdcluster.metadataClientConfig" . | fromYaml -}}
{{- range $key := list "tls_ca" "tls_cert" "tls_key" "tls_server_name" }}
{{- if hasKey $config $key }}
- --metadata-{{ $key | replace "_" "-" }}={{ index $config $key }}
{{- end }}
{{- end }}
{{- end -}}
