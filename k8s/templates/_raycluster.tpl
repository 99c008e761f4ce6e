{{/*
The Ray cluster: a CPU head (Ray's control plane and the launcher's driver) and two GPU worker
groups, prefill and decode, each a fixed size, or, with planner.enabled, between its
minReplicas and maxReplicas (Ray's in-tree autoscaler fits them to the planner's actors).
*/}}
{{- define "pdcluster.rayCluster" -}}
{{- $head := .Values.ray.head -}}
{{- $headDefaults := dict "dashboard-host" "0.0.0.0" "num-gpus" 0 "metrics-export-port" 8080 -}}
apiVersion: ray.io/v1
kind: RayCluster
metadata:
  name: {{ include "pdcluster.rayClusterName" . }}
  labels:
    {{- include "pdcluster.componentLabels" (list . "ray") | nindent 4 }}
spec:
  rayVersion: {{ .Values.ray.version | quote }}
  {{- if .Values.planner.enabled }}
  # the planner starts and retires node actors; Ray's autoscaler fits the worker pods to them
  enableInTreeAutoscaling: true
  autoscalerOptions:
    idleTimeoutSeconds: {{ int .Values.planner.idleTimeoutSeconds }}
  {{- else }}
  enableInTreeAutoscaling: false
  {{- end }}
  {{- if ne .Values.ray.upgradeStrategy "None" }}
  # Ray has no rolling upgrade: a changed pod template recreates every Ray pod (and the new
  # launch, named by pdcluster.launchHash, starts the node actors again).
  upgradeStrategy:
    type: {{ .Values.ray.upgradeStrategy }}
  {{- end }}
  {{- if .Values.ray.auth.enabled }}
  authOptions:
    mode: token
    secretName: {{ include "pdcluster.secretName" . }}
  {{- end }}
  headGroupSpec:
    serviceType: {{ $head.serviceType }}
    rayStartParams:
      {{- include "pdcluster.rayStartParams" (list $head.rayStartParams $headDefaults) | nindent 6 }}
    template:
      metadata:
        labels:
          {{- include "pdcluster.componentLabels" (list . "ray-head") | nindent 10 }}
        {{- with $head.podAnnotations }}
        annotations:
          {{- toYaml . | nindent 10 }}
        {{- end }}
      spec:
        {{- with .Values.imagePullSecrets }}
        imagePullSecrets:
          {{- toYaml . | nindent 10 }}
        {{- end }}
        {{- with include "pdcluster.scheduling" $head | trim }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- include "pdcluster.rayPodSecurity" . | nindent 8 }}
        {{- include "pdcluster.rayServiceAccount" (list . "head") | nindent 8 }}
        {{- with include "pdcluster.modelInitContainers" (list . "metadata") | trim }}
        initContainers:
          {{- . | nindent 10 }}
        {{- end }}
        containers:
          - name: ray-head
            image: {{ include "pdcluster.image" (list . (include "pdcluster.nodeImageKey" .)) }}
            imagePullPolicy: {{ (index .Values.images (include "pdcluster.nodeImageKey" .)).pullPolicy }}
            ports:
              - name: gcs-server
                containerPort: 6379
              - name: dashboard
                containerPort: 8265
              - name: client
                containerPort: 10001
              - name: metrics
                containerPort: 8080
            env:
              {{- /* with pod identity the head holds no secret: the launcher needs none */}}
              {{- include (ternary "pdcluster.baseEnv" "pdcluster.commonEnv" .Values.metadata.podIdentity.enabled) . | nindent 14 }}
            resources:
              {{- toYaml $head.resources | nindent 14 }}
            {{- include "pdcluster.rayContainerSecurity" (list . "head") | nindent 12 }}
            {{- include "pdcluster.rayProbes" "head" | nindent 12 }}
            lifecycle:
              preStop:
                exec:
                  command: [/bin/sh, -c, ray stop]
            volumeMounts:
              {{- include "pdcluster.rayVolumeMounts" (list . "head") | nindent 14 }}
        volumes:
          {{- include "pdcluster.rayVolumes" (list . $head.shmSize "head") | nindent 10 }}
  workerGroupSpecs:
    {{- include "pdcluster.workerGroup" (list . "prefill") | nindent 4 }}
    {{- include "pdcluster.workerGroup" (list . "decode") | nindent 4 }}
{{- end -}}
