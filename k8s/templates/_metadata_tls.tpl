{{/*
TLS (and optionally mTLS) on the metadata service's gRPC, from metadata.tls (off by default).
The service mounts its certificate and key from metadata.tls.secretName; the router and the
Ray pods (whose node actors register with it) mount only that Secret's ca.crt, to verify it.
With metadata.tls.clientAuth each workload kind presents its own client certificate: the
router routerSecretName's (common name pdcluster-router), the Ray pods nodeSecretName's
(pdcluster-node); the service trusts routerSecretName's ca.crt and, with bindRoles, refuses a
token its certificate's role may not present. With certManager.enabled, empty secret names
are the chart's own Certificates' (certificates.yaml). Tokens are checked on top in every
case. Every file is mounted read-only, mode 0400 (the service pods' fsGroup lets them read it).
*/}}

{{- define "pdcluster.metadataServerSecret" -}}
{{- .Values.metadata.tls.secretName | default (printf "%s-metadata-tls" (include "pdcluster.fullname" .)) -}}
{{- end -}}

{{/* (list $ "router"|"node"): that workload kind's metadata client certificate Secret. */}}
{{- define "pdcluster.metadataClientSecret" -}}
{{- $root := index . 0 -}}
{{- $kind := index . 1 -}}
{{- $given := index $root.Values.metadata.tls.clientAuth (printf "%sSecretName" $kind) -}}
{{- $given | default (printf "%s-metadata-%s" (include "pdcluster.fullname" $root) $kind) -}}
{{- end -}}

{{/* The Secret whose ca.crt the service trusts for client certificates. */}}
{{- define "pdcluster.metadataClientCaSecret" -}}
{{- if .Values.certManager.csiDriver -}}
{{- include "pdcluster.fullname" . }}-ca
{{- else -}}
{{- include "pdcluster.metadataClientSecret" (list . "router") -}}
{{- end -}}
{{- end -}}

{{/* (list $ kind): a per-pod client certificate from cert-manager's csi-driver. */}}
{{- define "pdcluster.metadataClientCsiVolume" -}}
{{- $root := index . 0 -}}
{{- $kind := index . 1 -}}
- name: metadata-client
  csi:
    driver: csi.cert-manager.io
    readOnly: true
    volumeAttributes:
      csi.cert-manager.io/issuer-name: {{ include "pdcluster.fullname" $root }}-ca
      csi.cert-manager.io/issuer-kind: Issuer
      csi.cert-manager.io/common-name: pdcluster-{{ $kind }}.${POD_NAME}
      csi.cert-manager.io/key-usages: client auth,digital signature,key encipherment
      csi.cert-manager.io/duration: {{ $root.Values.certManager.duration }}
      {{- if eq $kind "router" }}
      csi.cert-manager.io/fs-group: "10001"
      {{- end }}
{{- end -}}

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
{{ include "pdcluster.secretFilesVolume" (list "metadata-tls" (include "pdcluster.metadataServerSecret" .) (list "tls.crt" "tls.key")) }}
{{- if $tls.clientAuth.enabled }}
{{ include "pdcluster.secretFilesVolume" (list "metadata-client-ca" (include "pdcluster.metadataClientCaSecret" .) (list "ca.crt")) }}
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
{{- if $tls.clientAuth.bindRoles }}
- --tls-bind-client-roles
{{- end }}
{{- end }}
{{- end -}}
{{- end -}}

{{/* Its clients' (router, Ray pods): volumes ((list $ kind): each kind its own client
certificate), mounts, and the files as ClientTLS fields. */}}
{{- define "pdcluster.metadataTlsClientVolumes" -}}
{{- $root := index . 0 -}}
{{- $tls := $root.Values.metadata.tls -}}
{{- if $tls.enabled -}}
{{ include "pdcluster.secretFilesVolume" (list "metadata-ca" (include "pdcluster.metadataServerSecret" $root) (list "ca.crt")) }}
{{- if and $tls.clientAuth.enabled $root.Values.certManager.csiDriver }}
{{ include "pdcluster.metadataClientCsiVolume" . }}
{{- else if $tls.clientAuth.enabled }}
{{ include "pdcluster.secretFilesVolume" (list "metadata-client" (include "pdcluster.metadataClientSecret" .) (list "tls.crt" "tls.key")) }}
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
