{{/* Names, labels, addresses and the pieces shared by several templates. */}}

{{- define "pdcluster.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The prefix of every object's name. 45 characters at most, so that <fullname>-<component> (the
longest: -etcd-headless) fits Kubernetes' 63, and a StatefulSet's revision label fits too.
*/}}
{{- define "pdcluster.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 45 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 45 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 45 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Short enough for KubeRay's derived names (<cluster>-head-svc, <cluster>-<group>-worker-xxxxx). */}}
{{- define "pdcluster.rayClusterName" -}}
{{- include "pdcluster.fullname" . | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdcluster.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "pdcluster.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pdcluster
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component: include "pdcluster.selectorLabels" (list $ "router") */}}
{{- define "pdcluster.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "pdcluster.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* All labels of one component's objects and pods. */}}
{{- define "pdcluster.componentLabels" -}}
{{ include "pdcluster.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* The engine section of cluster.yaml: vLLM's own options only when the nodes run vLLM. */}}
{{- define "pdcluster.engineConfig" -}}
{{- $e := .Values.cluster.engine -}}
{{- $engine := dict
  "backend" $e.backend
  "dtype" $e.dtype
  "block_size" (int $e.blockSize)
  "max_num_seqs" (int $e.maxNumSeqs)
  "max_num_batched_tokens" (int $e.maxNumBatchedTokens)
  "max_model_len" (ternary (int $e.maxModelLen) nil (not (kindIs "invalid" $e.maxModelLen))) -}}
{{- if and (ne $e.backend "vllm") (gt (float64 (default 0 $e.hostCacheGiB)) 0.0) -}}
{{- $_ := set $engine "host_cache_gib" (float64 $e.hostCacheGiB) -}}
{{- end -}}
{{- if and (ne $e.backend "vllm") (gt (float64 (default 0 $e.diskCacheGiB)) 0.0) -}}
{{- $_ := set $engine "disk_cache_gib" (float64 $e.diskCacheGiB) -}}
{{- end -}}
{{- if eq $e.backend "vllm" -}}
{{- if not (kindIs "invalid" $e.gpuMemoryUtilization) -}}
{{- $_ := set $engine "gpu_memory_utilization" $e.gpuMemoryUtilization -}}
{{- end -}}
{{- end -}}
{{- toYaml $engine -}}
{{- end -}}

{{/* The image of the Ray pods and the launcher: vLLM's when the nodes run vLLM. */}}
{{- define "pdcluster.nodeImageKey" -}}
{{- ternary "vllmNode" "node" (eq .Values.cluster.engine.backend "vllm") -}}
{{- end -}}

{{/* repository:tag of images.<key>: include "pdcluster.image" (list $ "node") */}}
{{- define "pdcluster.image" -}}
{{- $root := index . 0 -}}
{{- $image := index $root.Values.images (index . 1) -}}
{{- printf "%s:%s" $image.repository (default $root.Chart.AppVersion $image.tag) -}}
{{- end -}}

{{- define "pdcluster.secretName" -}}
{{- default (printf "%s-secrets" (include "pdcluster.fullname" .)) .Values.secrets.existingSecret -}}
{{- end -}}

{{- define "pdcluster.svcDomain" -}}
{{- printf "%s.svc.%s" .Release.Namespace .Values.clusterDomain -}}
{{- end -}}

{{- define "pdcluster.metadataAddress" -}}
{{- printf "%s-metadata.%s:%d" (include "pdcluster.fullname" .) (include "pdcluster.svcDomain" .) (int .Values.metadata.port) -}}
{{- end -}}

{{- define "pdcluster.etcdEndpoints" -}}
{{- if .Values.etcd.enabled -}}
{{- printf "%s-etcd.%s:2379" (include "pdcluster.fullname" .) (include "pdcluster.svcDomain" .) -}}
{{- else -}}
{{- join "," .Values.etcd.externalEndpoints -}}
{{- end -}}
{{- end -}}

{{- define "pdcluster.rayDashboardAddress" -}}
{{- printf "http://%s-head-svc.%s:8265" (include "pdcluster.rayClusterName" .) (include "pdcluster.svcDomain" .) -}}
{{- end -}}

{{- define "pdcluster.modelPath" -}}
{{- printf "/models/%s" .Values.model.name -}}
{{- end -}}

{{/* GPUs of one node actor of a role: cluster.node.gpus per tensor-parallel rank. */}}
{{- define "pdcluster.gpusPerNode" -}}
{{- $root := index . 0 -}}
{{- mul (int $root.Values.cluster.node.gpus) (int (index $root.Values.cluster.node.tensorParallelSize (index . 1))) -}}
{{- end -}}

{{/* Node actors in a worker group: pods * GPUs per pod / GPUs per actor (must divide; a
tensor-parallel group never spans pods: GPUs per pod must be a multiple of an actor's). */}}
{{- define "pdcluster.numNodes" -}}
{{- $root := index . 0 -}}
{{- $group := index $root.Values.ray (index . 1) -}}
{{- $gpus := mul (int $group.replicas) (int $group.gpusPerPod) -}}
{{- $perNode := int (include "pdcluster.gpusPerNode" .) -}}
{{- if ne (mod $gpus $perNode) 0 -}}
{{- fail (printf "ray.%s: replicas * gpusPerPod (%d) must be a multiple of cluster.node.gpus (%d) x cluster.node.tensorParallelSize.%s" (index . 1) $gpus (int $root.Values.cluster.node.gpus) (index . 1)) -}}
{{- end -}}
{{- if ne (mod (int $group.gpusPerPod) $perNode) 0 -}}
{{- fail (printf "ray.%s.gpusPerPod (%d) must be a multiple of a node's GPUs (%d = cluster.node.gpus x tensorParallelSize.%s): a tensor-parallel group never spans pods" (index . 1) (int $group.gpusPerPod) $perNode (index . 1)) -}}
{{- end -}}
{{- div $gpus $perNode -}}
{{- end -}}

{{/* Node actors on one pod of the busiest group: how many request ports a pod needs. */}}
{{- define "pdcluster.nodesPerPod" -}}
{{- $prefill := div (int .Values.ray.prefill.gpusPerPod) (int (include "pdcluster.gpusPerNode" (list . "prefill"))) -}}
{{- $decode := div (int .Values.ray.decode.gpusPerPod) (int (include "pdcluster.gpusPerNode" (list . "decode"))) -}}
{{- max 1 $prefill $decode -}}
{{- end -}}

{{/*
The node ids the launcher starts in a role (ray_cluster.py names them p0, p1, ... and d0, d1,
...): the metadata service lets only these register. include "pdcluster.nodeIds" (list $ "prefill")
*/}}
{{- define "pdcluster.nodeIds" -}}
{{- $role := index . 1 -}}
{{- $ids := list -}}
{{- range $i := until (int (include "pdcluster.numNodes" .)) -}}
{{- $ids = append $ids (printf "%s%d" (ternary "p" "d" (eq $role "prefill")) $i) -}}
{{- end -}}
{{- join "," $ids -}}
{{- end -}}

{{/* The planner's node actors of a role: its group's min/max pods x GPUs per pod / per node. */}}
{{- define "pdcluster.plannerBounds" -}}
{{- $root := index . 0 -}}
{{- $group := index $root.Values.ray (index . 1) -}}
{{- $perPod := div (int $group.gpusPerPod) (int (include "pdcluster.gpusPerNode" .)) -}}
min: {{ mul (int (include "pdcluster.groupBound" (list $group "minReplicas"))) $perPod }}
max: {{ mul (int (include "pdcluster.groupBound" (list $group "maxReplicas"))) $perPod }}
{{- end -}}

{{/*
The body of cluster.yaml, the launcher's config (python -m pdcluster.cluster.launch --config). Nodes bind
and publish $POD_IP (host: auto). The launcher starts no router (router.enabled false: it is
its own Deployment), so router.host here is never bound.
*/}}
{{- define "pdcluster.clusterConfig" -}}
{{- $c := .Values.cluster -}}
{{- $config := dict
  "model" (include "pdcluster.modelPath" .)
  "num_prefill" (int (include "pdcluster.numNodes" (list . "prefill")))
  "num_decode" (int (include "pdcluster.numNodes" (list . "decode")))
  "engine" (include "pdcluster.engineConfig" . | fromYaml)
  "transfer" (dict
    "protocol" (ternary "rdma" "tcp" .Values.rdma.enabled)
    "device_name" (ternary .Values.rdma.deviceName "" .Values.rdma.enabled)
    "timeout_s" $c.transfer.timeoutS)
  "metadata" (include "pdcluster.nodeMetadataConfig" . | fromYaml)
  "host" "auto"
  "router" (dict "host" "127.0.0.1" "port" (int .Values.router.port) "enabled" false)
  "node" (dict
    "gpus" (int $c.node.gpus)
    "tensor_parallel_size" (dict "prefill" (int $c.node.tensorParallelSize.prefill) "decode" (int $c.node.tensorParallelSize.decode))
    "max_restarts" (int $c.node.maxRestarts)
    "local_prefill_threshold_tokens" (int $c.node.localPrefillThresholdTokens)
    "global_reuse_min_tokens" (int $c.node.globalReuseMinTokens)
    "metrics_port" (int $c.node.metricsPort)
    "request_port" (int $c.node.requestPort)
    "request_ports" (int (include "pdcluster.nodesPerPod" .))
    "role_resource_prefix" .Values.ray.groupResourcePrefix)
-}}
{{- if .Values.planner.enabled -}}
{{- $p := .Values.planner -}}
{{- $_ := set $config "planner" (dict
  "enabled" true "slo_ttft_s" $p.sloTtftS "slo_itl_ms" $p.sloItlMs "interval_s" $p.intervalS
  "startup_s" $p.startupS
  "prefill" (include "pdcluster.plannerBounds" (list . "prefill") | fromYaml)
  "decode" (include "pdcluster.plannerBounds" (list . "decode") | fromYaml)
  "router_url" (printf "http://%s-router:%d" (include "pdcluster.fullname" .) (int .Values.router.adminPort))) -}}
{{- end -}}
{{- toYaml $config -}}
{{- end -}}

{{/*
Identifies one launch of the node actors: the hash of cluster.yaml, of the RayCluster (a
changed pod template makes KubeRay recreate the pods, whose actors then need launching again)
and of launcher.generation (bumped by hand to relaunch). The launcher objects are named by it,
so any of these changes makes a new RayJob or Job.
*/}}
{{- define "pdcluster.launchHash" -}}
{{- list (include "pdcluster.clusterConfig" .) (include "pdcluster.rayCluster" .) (int .Values.launcher.generation) | toJson | sha256sum | trunc 16 -}}
{{- end -}}

{{- define "pdcluster.launchName" -}}
{{- printf "%s-nodes-%s" (include "pdcluster.fullname" . | trunc 40 | trimSuffix "-") (include "pdcluster.launchHash" . | trunc 10) -}}
{{- end -}}

{{/* Every launch name of this release starts so: the launcher Job stops the older ones. */}}
{{- define "pdcluster.launchPrefix" -}}
{{- printf "%s-nodes-" (include "pdcluster.fullname" . | trunc 40 | trimSuffix "-") -}}
{{- end -}}

{{/* First line of the mounted cluster.yaml; lets the launch tell a stale mount from the current one. */}}
{{- define "pdcluster.launchStamp" -}}
{{- printf "# pdcluster-launch: %s" (include "pdcluster.launchHash" .) -}}
{{- end -}}

{{/*
The Ray job's entrypoint, one shell command line: `sh -c '<script>'`. One word group on purpose:
KubeRay's submitter pastes the entrypoint into its own shell line (`ray job submit ... --
<entrypoint> ; fi`) and `ray job submit` re-quotes its arguments, so the script must reach the
head intact inside single quotes (it holds none itself).
A ConfigMap change reaches a running head's mount up to a minute or two later, so the script
first waits until cluster.yaml carries this launch's stamp, and fails rather than launching
with a stale config.
*/}}
{{- define "pdcluster.launchScript" -}}
{{- $file := "/etc/pdcluster/cluster.yaml" -}}
{{- $tries := div (int .Values.launcher.configWaitSeconds) 2 | int -}}
i=0; until grep -qx "{{ include "pdcluster.launchStamp" . }}" {{ $file }}; do i=$((i+1)); if [ "$i" -gt {{ $tries }} ]; then echo "pdcluster: {{ $file }} on the head is not this launch config yet; retry" >&2; exit 1; fi; sleep 2; done; exec python -m pdcluster.cluster.launch --config {{ $file }}
{{- end -}}

{{- define "pdcluster.launchEntrypoint" -}}
{{- $script := include "pdcluster.launchScript" . -}}
{{- if contains "'" $script -}}
{{- fail "internal: the launch script may not contain a single quote" -}}
{{- end -}}
sh -c '{{ $script }}'
{{- end -}}

{{/*
Environment shared by every pdcluster container: never download; where the cluster secret is
(pdcluster.clusterSecretVolume and pdcluster.clusterSecretMount put it there); the pod's own IP,
which the router and metadata service bind (no wildcard address) and node actors bind and
publish to their peers (cluster.yaml's `host: auto`).
*/}}
{{- define "pdcluster.commonEnv" -}}
{{ include "pdcluster.baseEnv" . }}
- name: PDCLUSTER_CLUSTER_SECRET_FILE
  value: {{ include "pdcluster.clusterSecretPath" . }}
{{- end -}}

{{/* commonEnv without the cluster secret: the router's (a client credential only) and the Ray workers' (their node actors' tokens come from the launcher). */}}
{{- define "pdcluster.baseEnv" -}}
- name: HF_HUB_OFFLINE
  value: "1"
- name: TRANSFORMERS_OFFLINE
  value: "1"
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- end -}}

{{/*
The router's client credential (the Secret's router-token: principal "service" at the metadata
service) as a file, in the router and in the metadata service that accepts it.
*/}}
{{- define "pdcluster.routerTokenDir" -}}
/var/run/secrets/pdcluster-router
{{- end -}}

{{- define "pdcluster.routerTokenEnv" -}}
- name: PDCLUSTER_ROUTER_TOKEN_FILE
  value: {{ printf "%s/router-token" (include "pdcluster.routerTokenDir" .) }}
{{- end -}}

{{- define "pdcluster.routerTokenVolume" -}}
- name: router-token
  secret:
    secretName: {{ include "pdcluster.secretName" . }}
    defaultMode: 0400
    items:
      - key: router-token
        path: router-token
{{- end -}}

{{- define "pdcluster.routerTokenMount" -}}
- name: router-token
  mountPath: {{ include "pdcluster.routerTokenDir" . }}
  readOnly: true
{{- end -}}

{{- define "pdcluster.clusterSecretDir" -}}
/var/run/secrets/pdcluster
{{- end -}}

{{- define "pdcluster.clusterSecretPath" -}}
{{- printf "%s/cluster-secret" (include "pdcluster.clusterSecretDir" .) -}}
{{- end -}}

{{/*
The cluster secret as a file: only the key cluster-secret of the release's Secret, read-only,
mode 0400. In the non-root service pods the kubelet also lets the pod's fsGroup read it
(pdcluster.serviceFsGroup); no other user can.
*/}}
{{- define "pdcluster.clusterSecretVolume" -}}
- name: cluster-secret
  secret:
    secretName: {{ include "pdcluster.secretName" . }}
    defaultMode: 0400
    items:
      - key: cluster-secret
        path: cluster-secret
{{- end -}}

{{- define "pdcluster.clusterSecretMount" -}}
- name: cluster-secret
  mountPath: {{ include "pdcluster.clusterSecretDir" . }}
  readOnly: true
{{- end -}}

{{/*
Pod security context of the CPU services, which run as uid 10001: a Secret's files belong to
root, so the pod's fsGroup is what lets the service read the cluster secret.
*/}}
{{- define "pdcluster.serviceFsGroup" -}}
securityContext:
  fsGroup: 10001
  fsGroupChangePolicy: OnRootMismatch
{{- end -}}

{{/* The /models volume: the model PVC (read-only), or the emptyDir the init container fills. */}}
{{- define "pdcluster.modelVolume" -}}
- name: models
{{- if eq .Values.model.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
    readOnly: true
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.model.hub.sizeLimit }}
{{- end }}
{{- end -}}

{{- define "pdcluster.modelMount" -}}
- name: models
  mountPath: /models
  readOnly: {{ eq .Values.model.source "pvc" }}
{{- if and (eq .Values.model.source "pvc") .Values.model.pvc.subPath }}
  subPath: {{ .Values.model.pvc.subPath }}
{{- end }}
{{- end -}}

{{/*
The hub download init container (only with model.source=hub): the only place that downloads.
include "pdcluster.modelInitContainers" (list $ "full"|"metadata")
*/}}
{{- define "pdcluster.modelInitContainers" -}}
{{- $root := index . 0 -}}
{{- $hub := $root.Values.model.hub -}}
{{- if eq $root.Values.model.source "hub" }}
- name: download-model
  image: {{ include "pdcluster.image" (list $root "service") }}
  imagePullPolicy: {{ $root.Values.images.service.pullPolicy }}
  command: [python, /etc/pdcluster/download_model.py]
  env:
    - name: PDCLUSTER_MODEL_REPO
      value: {{ $hub.repo | quote }}
    - name: PDCLUSTER_MODEL_REVISION
      value: {{ $hub.revision | quote }}
{{- if $hub.acknowledgeUnpinnedRevision }}
    - name: PDCLUSTER_MODEL_ALLOW_UNPINNED
      value: "1"
{{- end }}
    - name: PDCLUSTER_MODEL_DIR
      value: {{ include "pdcluster.modelPath" $root | quote }}
    - name: PDCLUSTER_MODEL_PATTERNS
      value: {{ ternary (join "," $hub.metadataPatterns) "" (eq (index . 1) "metadata") | quote }}
    - name: HF_HOME
      value: /models/.hf-home
    # The image defaults to offline; this container alone may reach the hub.
    - name: HF_HUB_OFFLINE
      value: "0"
{{- with $hub.endpoint }}
    - name: HF_ENDPOINT
      value: {{ . | quote }}
{{- end }}
{{- if $hub.tokenSecret.name }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ $hub.tokenSecret.name }}
          key: {{ $hub.tokenSecret.key }}
{{- end }}
  resources:
    {{- toYaml $hub.resources | nindent 4 }}
  securityContext:
    allowPrivilegeEscalation: false
    runAsNonRoot: true
    runAsUser: 10001
    capabilities:
      drop: [ALL]
  volumeMounts:
    - name: models
      mountPath: /models
    - name: config
      mountPath: /etc/pdcluster
      readOnly: true
{{- end }}
{{- end -}}

{{/* Hardened container defaults for the CPU services (router, metadata). */}}
{{- define "pdcluster.restrictedSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
runAsUser: 10001
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/*
Pod identity (metadata.podIdentity): the Ray pods run as their own service account and carry a
projected token for the metadata service's audience, which they trade for their nodes' tokens;
no Ray pod mounts the cluster secret. The metadata service's own account may create
TokenReviews (pod-identity.yaml).
*/}}
{{- define "pdcluster.podIdentityAudience" -}}
{{- default (printf "pdcluster.%s.%s" .Release.Namespace (include "pdcluster.fullname" .)) .Values.metadata.podIdentity.audience -}}
{{- end -}}

{{- define "pdcluster.rayServiceAccountName" -}}
{{- printf "%s-ray" (include "pdcluster.fullname" .) -}}
{{- end -}}

{{- define "pdcluster.metadataServiceAccountName" -}}
{{- printf "%s-metadata" (include "pdcluster.fullname" .) -}}
{{- end -}}

{{- define "pdcluster.nodeIdentityDir" -}}
/var/run/secrets/pdcluster-node-identity
{{- end -}}

{{/*
A Ray pod's service account: only with pod identity (else the namespace's default).
include "pdcluster.rayServiceAccount" (list $ "head"|"worker"). Node actors never call the
Kubernetes API: only their projected token is mounted, except on the head with the planner,
where KubeRay's autoscaler sidecar needs the account's API token (KubeRay binds its Role to
this account then).
*/}}
{{- define "pdcluster.rayServiceAccount" -}}
{{- $root := index . 0 -}}
{{- if $root.Values.metadata.podIdentity.enabled }}
serviceAccountName: {{ include "pdcluster.rayServiceAccountName" $root }}
automountServiceAccountToken: {{ and (eq (index . 1) "head") $root.Values.planner.enabled }}
{{- end }}
{{- end -}}

{{- define "pdcluster.nodeIdentityVolume" -}}
- name: node-identity
  projected:
    defaultMode: 0400
    sources:
      - serviceAccountToken:
          audience: {{ include "pdcluster.podIdentityAudience" . | quote }}
          expirationSeconds: {{ int .Values.metadata.podIdentity.tokenExpirationSeconds }}
          path: token
{{- end -}}

{{- define "pdcluster.nodeIdentityMount" -}}
- name: node-identity
  mountPath: {{ include "pdcluster.nodeIdentityDir" . }}
  readOnly: true
{{- end -}}

{{/* cluster.yaml's metadata section: the nodes' client settings, and with pod identity where
their pod's projected token is (they trade it for their own; the launcher derives none). */}}
{{- define "pdcluster.nodeMetadataConfig" -}}
{{- $config := include "pdcluster.metadataClientConfig" . | fromYaml -}}
{{- if .Values.metadata.podIdentity.enabled -}}
{{- $_ := set $config "node_identity_token_file" (printf "%s/token" (include "pdcluster.nodeIdentityDir" .)) -}}
{{- end -}}
{{- toYaml $config -}}
{{- end -}}
