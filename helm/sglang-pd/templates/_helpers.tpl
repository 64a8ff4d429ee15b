{{/*
Return the chart name, truncated to 63 characters (a DNS label).
*/}}
{{- define "sglang-pd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Return the fully qualified name: release + chart, unless the release already contains it.
Kept to 40 characters so that LeaderWorkerSet's derived pod names (name-group-index) stay valid.
*/}}
{{- define "sglang-pd.fullname" -}}
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

{{/*
Return the standard labels of every object.
*/}}
{{- define "sglang-pd.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "sglang-pd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: sglang-pd
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
Return the selector labels of one component (prefill, decode, router): call with (dict "component" "prefill" "context" $).
*/}}
{{- define "sglang-pd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sglang-pd.name" .context }}
app.kubernetes.io/instance: {{ .context.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/*
Return the labels of a component's pods: its selector labels plus the chart's identity (no duplicates).
*/}}
{{- define "sglang-pd.podLabels" -}}
{{ include "sglang-pd.selectorLabels" . }}
app.kubernetes.io/part-of: sglang-pd
app.kubernetes.io/version: {{ .context.Chart.AppVersion | quote }}
{{- with .context.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
Return the label selector string the router watches for one role's leader pods (only node rank 0 serves HTTP).
*/}}
{{- define "sglang-pd.workerSelector" -}}
{{- printf "app.kubernetes.io/instance=%s,app.kubernetes.io/component=%s,leaderworkerset.sigs.k8s.io/worker-index=0" .context.Release.Name .component -}}
{{- end -}}

{{/*
Return the image reference.
*/}}
{{- define "sglang-pd.image" -}}
{{- printf "%s:%s" .Values.image.repository .Values.image.tag -}}
{{- end -}}

{{/*
Return the router's ServiceAccount name.
*/}}
{{- define "sglang-pd.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (printf "%s-router" (include "sglang-pd.fullname" .)) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/*
Return the path where every pod finds the topology.
*/}}
{{- define "sglang-pd.topologyPath" -}}/etc/sglang-pd/topology.yaml{{- end -}}

{{/*
Return the effective topology as YAML: `topology` when set (used whole, never merged), else the shipped preset.
Templates read it through "sglang-pd.topologyView"; the ConfigMap holds it verbatim.
*/}}
{{- define "sglang-pd.topology" -}}
{{- if kindIs "string" .Values.topology -}}
{{- /* --set-file topology=FILE passes the file as a string */ -}}
{{- $parsed := fromYaml .Values.topology -}}
{{- if or (not $parsed) (hasKey $parsed "Error") -}}
{{- fail (printf "\nVALUES VALIDATION:\ntopology: the string given (--set-file topology=FILE?) is not a YAML mapping: %v. Check it with `sglang-pd plan FILE`." (get (default dict $parsed) "Error")) -}}
{{- end -}}
{{- toYaml $parsed -}}
{{- else if .Values.topology -}}
{{- toYaml .Values.topology -}}
{{- else -}}
{{- $file := printf "files/presets/%s.yaml" .Values.preset -}}
{{- $text := .Files.Get $file -}}
{{- if not $text -}}
{{- fail (printf "\nVALUES VALIDATION:\npreset: %q is not a shipped preset (files/presets/*.yaml). Choose deepseek-r1-h200-1p1d, deepseek-v3-h20-3p2d or local-cpu, or set topology." .Values.preset) -}}
{{- end -}}
{{- $text | fromYaml | toYaml -}}
{{- end -}}
{{- end -}}

{{/*
Return the topology as templates read it: the models' defaults (files/topology-defaults.yaml) under what the user set.
*/}}
{{- define "sglang-pd.topologyView" -}}
{{- $defaults := .Files.Get "files/topology-defaults.yaml" | fromYaml -}}
{{- mergeOverwrite $defaults (include "sglang-pd.topology" . | fromYaml) | toYaml -}}
{{- end -}}

{{/*
Collect every values problem the schema cannot express, then fail once with each fix spelled out.
*/}}
{{- define "sglang-pd.validateValues" -}}
{{- $messages := list -}}
{{- $t := include "sglang-pd.topologyView" . | fromYaml -}}
{{- if and (eq .Values.model.source "pvc") (not .Values.model.pvc.claimName) -}}
{{- $messages = append $messages "model.pvc.claimName: model.source is pvc but no claim is named. Set --set model.pvc.claimName=<pvc> or choose model.source=hub|hostPath." -}}
{{- end -}}
{{- if and (eq .Values.model.source "hostPath") (not .Values.model.hostPath.path) -}}
{{- $messages = append $messages "model.hostPath.path: model.source is hostPath but no path is set. Set --set model.hostPath.path=/data/models." -}}
{{- end -}}
{{- if and (eq $t.transfer.protocol "rdma") (eq .Values.rdma.mode "none") -}}
{{- $messages = append $messages "rdma.mode: none gives pods no RDMA NIC, but topology.transfer.protocol is rdma. Set rdma.mode=hostNetwork|devicePlugin or topology.transfer.protocol=tcp." -}}
{{- end -}}
{{- if and .Values.router.ingress.enabled (not .Values.router.ingress.host) -}}
{{- $messages = append $messages "router.ingress.host: the Ingress needs a host name. Set --set router.ingress.host=llm.example.com." -}}
{{- end -}}
{{- if $messages -}}
{{- printf "\nVALUES VALIDATION:\n%s" (join "\n" $messages) | fail -}}
{{- end -}}
{{- end -}}

{{/*
Return the pod template of a GPU role: call with (dict "role" "prefill" "leader" true "context" $).
Leaders serve HTTP and carry the probes and the router's discovery annotations; other ranks only join NCCL.
*/}}
{{- define "sglang-pd.gpuPodTemplate" -}}
{{- $ := .context -}}
{{- $cfg := index $.Values .role -}}
{{- $t := include "sglang-pd.topologyView" $ | fromYaml -}}
{{- $spec := index $t .role -}}
{{- $gpus := int $t.hardware.gpus_per_node -}}
{{- $hostNetwork := eq $.Values.rdma.mode "hostNetwork" -}}
metadata:
  labels:
    {{- include "sglang-pd.podLabels" (dict "component" .role "context" $) | nindent 4 }}
  annotations:
    checksum/topology: {{ include "sglang-pd.topology" $ | sha256sum }}
    {{- if .leader }}
    sglang-pd/port: {{ $spec.port | quote }}
    {{- if eq .role "prefill" }}
    sglang-pd/bootstrap-port: {{ $spec.bootstrap_port | quote }}
    {{- end }}
    {{- end }}
    {{- with $cfg.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  {{- with $.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if $hostNetwork }}
  hostNetwork: true
  dnsPolicy: ClusterFirstWithHostNet
  {{- end }}
  terminationGracePeriodSeconds: {{ $cfg.terminationGracePeriodSeconds }}
  {{- with $cfg.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $cfg.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $cfg.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $cfg.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: sglang
      image: {{ include "sglang-pd.image" $ }}
      imagePullPolicy: {{ $.Values.image.pullPolicy }}
      command: ["sglang-pd", "launch", "--role", {{ .role | quote }}, "--topology", {{ include "sglang-pd.topologyPath" $ | quote }}]
      env:
        {{- if eq $.Values.model.source "hub" }}
        - name: HF_HOME
          value: /root/.cache/huggingface
        {{- with $.Values.model.hub.tokenSecret.name }}
        - name: HF_TOKEN
          valueFrom:
            secretKeyRef:
              name: {{ . }}
              key: {{ $.Values.model.hub.tokenSecret.key }}
        {{- end }}
        {{- end }}
        {{- range $k, $v := merge (dict) $cfg.env $.Values.env }}
        - name: {{ $k }}
          value: {{ $v | quote }}
        {{- end }}
      ports:
        - name: http
          containerPort: {{ $spec.port }}
        {{- if and .leader (eq .role "prefill") }}
        - name: bootstrap
          containerPort: {{ $spec.bootstrap_port }}
        {{- end }}
      resources:
        requests:
          {{- with $cfg.resources.requests }}
          {{- toYaml . | nindent 10 }}
          {{- end }}
          {{ $.Values.gpu.resourceName }}: {{ $gpus }}
          {{- if eq $.Values.rdma.mode "devicePlugin" }}
          {{ $.Values.rdma.devicePlugin.resourceName }}: {{ $.Values.rdma.devicePlugin.count }}
          {{- end }}
        limits:
          {{- with $cfg.resources.limits }}
          {{- toYaml . | nindent 10 }}
          {{- end }}
          {{ $.Values.gpu.resourceName }}: {{ $gpus }}
          {{- if eq $.Values.rdma.mode "devicePlugin" }}
          {{ $.Values.rdma.devicePlugin.resourceName }}: {{ $.Values.rdma.devicePlugin.count }}
          {{- end }}
      securityContext:
        {{- if $.Values.securityContext.privileged }}
        privileged: true
        {{- else }}
        privileged: false
        capabilities:
          add:
            - IPC_LOCK
            {{- if $.Values.securityContext.sysRawio }}
            - SYS_RAWIO
            {{- end }}
        {{- end }}
      {{- if .leader }}
      startupProbe:
        httpGet: {path: /health, port: http}
        periodSeconds: {{ $cfg.startupProbe.periodSeconds }}
        failureThreshold: {{ $cfg.startupProbe.failureThreshold }}
        timeoutSeconds: 5
      readinessProbe:
        httpGet: {path: /health, port: http}
        periodSeconds: {{ $cfg.readinessProbe.periodSeconds }}
        failureThreshold: {{ $cfg.readinessProbe.failureThreshold }}
        timeoutSeconds: 5
      {{- if $cfg.livenessProbe.enabled }}
      livenessProbe:
        httpGet: {path: /health, port: http}
        periodSeconds: {{ $cfg.livenessProbe.periodSeconds }}
        failureThreshold: {{ $cfg.livenessProbe.failureThreshold }}
        timeoutSeconds: 10
      {{- end }}
      {{- end }}
      volumeMounts:
        - name: topology
          mountPath: /etc/sglang-pd
          readOnly: true
        - name: shm
          mountPath: /dev/shm
        - name: model
          mountPath: {{ if eq $.Values.model.source "hub" }}/root/.cache/huggingface{{ else }}{{ $.Values.model.mountPath }}{{ end }}
          {{- if eq $.Values.model.source "pvc" }}
          readOnly: {{ $.Values.model.pvc.readOnly }}
          {{- end }}
        {{- if $hostNetwork }}
        - name: infiniband
          mountPath: /dev/infiniband
        {{- end }}
  volumes:
    - name: topology
      configMap:
        name: {{ include "sglang-pd.fullname" $ }}-topology
    - name: shm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $.Values.shmSizeLimit }}
    - name: model
      {{- if eq $.Values.model.source "pvc" }}
      persistentVolumeClaim:
        claimName: {{ $.Values.model.pvc.claimName }}
        readOnly: {{ $.Values.model.pvc.readOnly }}
      {{- else if eq $.Values.model.source "hostPath" }}
      hostPath:
        path: {{ $.Values.model.hostPath.path }}
        type: Directory
      {{- else }}
      emptyDir:
        sizeLimit: {{ $.Values.model.hub.cacheSizeLimit }}
      {{- end }}
    {{- if $hostNetwork }}
    - name: infiniband
      hostPath:
        path: /dev/infiniband
        type: Directory
    {{- end }}
{{- end -}}

{{/*
Return a LeaderWorkerSet for a GPU role: call with (dict "role" "prefill" "context" $).
Replicas are the topology's instances (prefill) or groups (decode); size is its nodes.
*/}}
{{- define "sglang-pd.leaderWorkerSet" -}}
{{- $ := .context -}}
{{- $spec := index (include "sglang-pd.topologyView" $ | fromYaml) .role -}}
{{- $nodes := int $spec.nodes -}}
apiVersion: leaderworkerset.x-k8s.io/v1
kind: LeaderWorkerSet
metadata:
  name: {{ include "sglang-pd.fullname" $ }}-{{ .role }}
  labels:
    {{- include "sglang-pd.labels" $ | nindent 4 }}
    app.kubernetes.io/component: {{ .role }}
spec:
  replicas: {{ if eq .role "prefill" }}{{ $spec.instances }}{{ else }}{{ $spec.groups }}{{ end }}
  startupPolicy: LeaderCreated
  rolloutStrategy:
    type: RollingUpdate
    rollingUpdateConfiguration:
      maxUnavailable: 1
      maxSurge: 0
  leaderWorkerTemplate:
    size: {{ $nodes }}
    restartPolicy: RecreateGroupOnPodRestart
    {{- if gt $nodes 1 }}
    leaderTemplate:
      {{- include "sglang-pd.gpuPodTemplate" (dict "role" .role "leader" true "context" $) | nindent 6 }}
    workerTemplate:
      {{- include "sglang-pd.gpuPodTemplate" (dict "role" .role "leader" false "context" $) | nindent 6 }}
    {{- else }}
    workerTemplate:
      {{- include "sglang-pd.gpuPodTemplate" (dict "role" .role "leader" true "context" $) | nindent 6 }}
    {{- end }}
{{- end -}}

{{/*
Return a PodDisruptionBudget for a role's pods: call with (dict "component" "prefill" "cfg" .Values.prefill "context" $).
*/}}
{{- define "sglang-pd.pdb" -}}
{{- $ := .context -}}
{{- if .cfg.pdb.enabled }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "sglang-pd.fullname" $ }}-{{ .component }}
  labels:
    {{- include "sglang-pd.labels" $ | nindent 4 }}
    app.kubernetes.io/component: {{ .component }}
spec:
  {{- if hasKey .cfg.pdb "minAvailable" }}
  minAvailable: {{ .cfg.pdb.minAvailable }}
  {{- else }}
  maxUnavailable: {{ .cfg.pdb.maxUnavailable }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "sglang-pd.selectorLabels" (dict "component" .component "context" $) | nindent 6 }}
{{- end }}
{{- end -}}

{{/*
Return the gsm8k gate's container: call with (dict "context" $ "name" "gsm8k-gate").
*/}}
{{- define "sglang-pd.gateContainer" -}}
{{- $ := .context -}}
{{- $g := $.Values.gate.gsm8k -}}
- name: {{ .name }}
  image: {{ include "sglang-pd.image" $ }}
  imagePullPolicy: {{ $.Values.image.pullPolicy }}
  command:
    - sglang-pd
    - eval
    - gsm8k
    - --base-url
    - {{ printf "http://%s-router:%v/v1" (include "sglang-pd.fullname" $) $.Values.router.service.port | quote }}
    - --num-questions
    - {{ $g.numQuestions | quote }}
    - --parallel
    - {{ $g.parallel | quote }}
    - --api
    - {{ $g.api | quote }}
    - --min-accuracy
    - {{ $g.minAccuracy | quote }}
    - --output
    - /tmp/gsm8k-report.json
    # Wait for the router to list a model; end with a report (exit 4) before Kubernetes kills the pod.
    - --wait-ready
    - "300"
    - --timeout
    - {{ sub (int $g.timeoutSeconds) 30 | quote }}
    {{- if $g.dataConfigMap }}
    - --data
    - /data/gsm8k/test.jsonl
    {{- end }}
  {{- if $.Values.router.apiKeySecret.name }}
  env:
    - name: OPENAI_API_KEY
      valueFrom:
        secretKeyRef:
          name: {{ $.Values.router.apiKeySecret.name }}
          key: {{ $.Values.router.apiKeySecret.key }}
  {{- end }}
  resources:
    requests: {cpu: "1", memory: 1Gi}
    limits: {memory: 2Gi}
  securityContext:
    allowPrivilegeEscalation: false
    runAsNonRoot: true
    runAsUser: 65534
  {{- if $g.dataConfigMap }}
  volumeMounts:
    - name: gsm8k-data
      mountPath: /data/gsm8k
      readOnly: true
  {{- end }}
{{- end -}}

{{/*
Return the gate's volumes (the gsm8k data ConfigMap, when one is named).
*/}}
{{- define "sglang-pd.gateVolumes" -}}
{{- if .Values.gate.gsm8k.dataConfigMap }}
volumes:
  - name: gsm8k-data
    configMap:
      name: {{ .Values.gate.gsm8k.dataConfigMap }}
{{- end }}
{{- end -}}
