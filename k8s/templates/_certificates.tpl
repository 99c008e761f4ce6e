{{/*
One cert-manager Certificate: (list $ suffix spec issuerRef). spec: commonName, secretName and
optionally isCA, usages, dnsNames, ipAddresses; duration and renewal from certManager.
*/}}
{{- define "pdcluster.certificate" -}}
{{- $root := index . 0 -}}
{{- $spec := index . 2 -}}
{{- $issuer := index . 3 -}}
apiVersion: cert-manager.io/v1
kind: Certificate
metadata:
  name: {{ include "pdcluster.fullname" $root }}-{{ index . 1 }}
  labels:
    {{- include "pdcluster.componentLabels" (list $root "certificates") | nindent 4 }}
spec:
  secretName: {{ $spec.secretName }}
  commonName: {{ $spec.commonName | quote }}
  duration: {{ $root.Values.certManager.duration }}
  renewBefore: {{ $root.Values.certManager.renewBefore }}
  privateKey:
    algorithm: ECDSA
    size: 256
    rotationPolicy: Always
  {{- if $spec.isCA }}
  isCA: true
  {{- end }}
  {{- with $spec.usages }}
  usages:
    - digital signature
    - key encipherment
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $spec.dnsNames }}
  dnsNames:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $spec.ipAddresses }}
  ipAddresses:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  issuerRef:
    name: {{ $issuer.name }}
    kind: {{ $issuer.kind | default "Issuer" }}
    group: {{ $issuer.group | default "cert-manager.io" }}
{{- end -}}
