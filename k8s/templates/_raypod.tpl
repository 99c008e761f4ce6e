{{/* Pieces of the RayCluster's pod templates (raycluster.yaml). */}}

{{/*
Ray's own health endpoints, as KubeRay's default probes check them; the token header is sent
when KubeRay has injected RAY_AUTH_TOKEN (Ray token auth), and is empty (ignored) otherwise.
include "pdcluster.rayProbeCommand" "head"|"worker"
*/}}
{{- define "pdcluster.rayProbeCommand" -}}
{{- $raylet := "wget -T 2 -q -O- --header=\"$h\" http://localhost:52365/api/local_raylet_healthz | grep success" -}}
{{- $gcs := "wget -T 10 -q -O- --header=\"$h\" http://localhost:8265/api/gcs_healthz | grep success" -}}
{{- $auth := "h=; if [ -n \"${RAY_AUTH_TOKEN:-}\" ]; then h=\"Authorization: Bearer $RAY_AUTH_TOKEN\"; fi" -}}
- bash
- -c
- {{ printf "%s; %s" $auth (ternary (printf "%s && %s" $raylet $gcs) $raylet (eq . "head")) | quote }}
{{- end -}}

{{- define "pdcluster.rayProbes" -}}
livenessProbe:
  exec:
    command:
      {{- include "pdcluster.rayProbeCommand" . | nindent 6 }}
  initialDelaySeconds: 30
  periodSeconds: 5
  timeoutSeconds: {{ ternary 15 5 (eq . "head") }}
  failureThreshold: 120
readinessProbe:
  exec:
    command:
      {{- include "pdcluster.rayProbeCommand" . | nindent 6 }}
  initialDelaySeconds: 10
  periodSeconds: 5
  timeoutSeconds: {{ ternary 15 5 (eq . "head") }}
  failureThreshold: 10
{{- end -}}

{{/* rayStartParams: the chart's defaults, overridden key by key by the user's; all strings. */}}
{{- define "pdcluster.rayStartParams" -}}
{{- $params := merge (deepCopy (index . 0)) (index . 1) -}}
{{- range $i, $key := keys $params | sortAlpha }}
{{- if $i }}{{ "\n" }}{{ end }}
{{- $key }}: {{ index $params $key | toString | quote }}
{{- end }}
{{- end -}}

{{/*
The Ray pods' volumes: include "pdcluster.rayVolumes" (list $ shmSize "head"|"worker"). Only the
head, where the launcher's driver derives each node actor's own bootstrap token, mounts the
cluster secret; a worker holds none (its node actors get their tokens from the launcher).
With metadata.podIdentity no Ray pod mounts it: each carries its projected service-account
token, which its node actors trade for their tokens at the metadata service.
*/}}
{{- define "pdcluster.rayVolumes" -}}
{{- $root := index . 0 -}}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ index . 1 }}
- name: ray-logs
  emptyDir: {}
- name: config
  configMap:
    name: {{ include "pdcluster.fullname" $root }}-config
{{- if $root.Values.metadata.podIdentity.enabled }}
{{ include "pdcluster.nodeIdentityVolume" $root }}
{{- else if eq (index . 2) "head" }}
{{ include "pdcluster.clusterSecretVolume" $root }}
{{- end }}
{{ include "pdcluster.modelVolume" $root }}
{{- with include "pdcluster.metadataTlsClientVolumes" (list $root "node") }}
{{ . }}
{{- end }}
{{- end -}}

{{/* include "pdcluster.rayVolumeMounts" (list $ "head"|"worker") */}}
{{- define "pdcluster.rayVolumeMounts" -}}
{{- $root := index . 0 -}}
- name: shm
  mountPath: /dev/shm
- name: ray-logs
  mountPath: /tmp/ray
- name: config
  mountPath: /etc/pdcluster
  readOnly: true
{{- if $root.Values.metadata.podIdentity.enabled }}
{{ include "pdcluster.nodeIdentityMount" $root }}
{{- else if eq (index . 1) "head" }}
{{ include "pdcluster.clusterSecretMount" $root }}
{{- end }}
{{ include "pdcluster.modelMount" $root }}
{{- with include "pdcluster.metadataTlsClientMounts" $root }}
{{ . }}
{{- end }}
{{- end -}}

{{/*
A Ray container's securityContext: include "pdcluster.rayContainerSecurity" (list $ "head"|"worker").
ray.securityContext, the RDMA capabilities added on workers, and ray.runAsUser's non-root uid.
*/}}
{{- define "pdcluster.rayContainerSecurity" -}}
{{- $root := index . 0 -}}
{{- $ctx := deepCopy (default dict $root.Values.ray.securityContext) -}}
{{- if and (eq (index . 1) "worker") $root.Values.rdma.enabled -}}
{{- $caps := deepCopy (default dict $ctx.capabilities) -}}
{{- $_ := set $caps "add" $root.Values.rdma.capabilities -}}
{{- $_ := set $ctx "capabilities" $caps -}}
{{- end -}}
{{- with $root.Values.ray.runAsUser -}}
{{- $_ := set $ctx "runAsNonRoot" true -}}
{{- $_ := set $ctx "runAsUser" (int .) -}}
{{- $_ := set $ctx "runAsGroup" (int .) -}}
{{- end -}}
{{- with $ctx }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* A Ray pod's securityContext: with ray.runAsUser, the fsGroup that lets it read Secrets. */}}
{{- define "pdcluster.rayPodSecurity" -}}
{{- with .Values.ray.runAsUser }}
securityContext:
  fsGroup: {{ int . }}
  fsGroupChangePolicy: OnRootMismatch
{{- end }}
{{- end -}}

{{- define "pdcluster.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/*
A GPU worker group: include "pdcluster.workerGroup" (list $ "prefill"|"decode").
Each pod advertises the Ray custom resource <groupResourcePrefix><role>, one unit per GPU.
*/}}
{{- define "pdcluster.groupBound" -}}
{{- $group := index . 0 -}}
{{- $value := index $group (index . 1) -}}
{{- if kindIs "invalid" $value }}{{ int $group.replicas }}{{ else }}{{ int $value }}{{ end -}}
{{- end -}}

{{- define "pdcluster.workerGroup" -}}
{{- $root := index . 0 -}}
{{- $role := index . 1 -}}
{{- $group := index $root.Values.ray $role -}}
{{- $rdma := $root.Values.rdma -}}
{{- $gpus := int $group.gpusPerPod -}}
{{- $requests := deepCopy (default dict $group.resources.requests) -}}
{{- $limits := deepCopy (default dict $group.resources.limits) -}}
{{- $_ := set $requests $root.Values.ray.gpuResourceName $gpus -}}
{{- $_ := set $limits $root.Values.ray.gpuResourceName $gpus -}}
{{- if $rdma.enabled -}}
{{- $_ := set $requests $rdma.resourceName (int $rdma.resourceCount) -}}
{{- $_ := set $limits $rdma.resourceName (int $rdma.resourceCount) -}}
{{- end -}}
{{- $customResource := printf "%s%s" $root.Values.ray.groupResourcePrefix $role -}}
{{- $defaults := dict "num-gpus" $gpus "metrics-export-port" 8080 "resources" (printf `"{\"%s\": %d}"` $customResource $gpus) -}}
- groupName: {{ $role }}
  replicas: {{ $group.replicas }}
  {{- if $root.Values.planner.enabled }}
  minReplicas: {{ include "pdcluster.groupBound" (list $group "minReplicas") }}
  maxReplicas: {{ include "pdcluster.groupBound" (list $group "maxReplicas") }}
  {{- else }}
  minReplicas: {{ $group.replicas }}
  maxReplicas: {{ $group.replicas }}
  {{- end }}
  rayStartParams:
    {{- include "pdcluster.rayStartParams" (list $group.rayStartParams $defaults) | nindent 4 }}
  template:
    metadata:
      labels:
        {{- include "pdcluster.componentLabels" (list $root (printf "ray-%s" $role)) | nindent 8 }}
      {{- $annotations := merge (deepCopy (default dict $group.podAnnotations)) (ternary $rdma.podAnnotations dict $rdma.enabled) }}
      {{- with $annotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if and $rdma.enabled $rdma.hostNetwork }}
      hostNetwork: true
      dnsPolicy: ClusterFirstWithHostNet
      {{- end }}
      {{- with include "pdcluster.scheduling" $group | trim }}
      {{- . | nindent 6 }}
      {{- end }}
      {{- include "pdcluster.rayPodSecurity" $root | nindent 6 }}
      {{- include "pdcluster.rayServiceAccount" (list $root "worker") | nindent 6 }}
      {{- with include "pdcluster.modelInitContainers" (list $root "full") | trim }}
      initContainers:
        {{- . | nindent 8 }}
      {{- end }}
      containers:
        - name: ray-worker
          image: {{ include "pdcluster.image" (list $root (include "pdcluster.nodeImageKey" $root)) }}
          imagePullPolicy: {{ (index $root.Values.images (include "pdcluster.nodeImageKey" $root)).pullPolicy }}
          ports:
            - name: metrics
              containerPort: 8080
            - name: node-metrics
              containerPort: {{ int $root.Values.cluster.node.metricsPort }}
            # the first node actor's request socket (the next ones take the following ports)
            - name: node-request
              containerPort: {{ int $root.Values.cluster.node.requestPort }}
          env:
            {{- include "pdcluster.baseEnv" $root | nindent 12 }}
            - name: PDCLUSTER_ROLE
              value: {{ $role }}
          resources:
            requests:
              {{- toYaml $requests | nindent 14 }}
            limits:
              {{- toYaml $limits | nindent 14 }}
          {{- include "pdcluster.rayContainerSecurity" (list $root "worker") | nindent 10 }}
          {{- include "pdcluster.rayProbes" "worker" | nindent 10 }}
          lifecycle:
            preStop:
              exec:
                command: [/bin/sh, -c, ray stop]
          volumeMounts:
            {{- include "pdcluster.rayVolumeMounts" (list $root "worker") | nindent 12 }}
      volumes:
        {{- include "pdcluster.rayVolumes" (list $root $group.shmSize "worker") | nindent 8 }}
{{- end -}}
