{{/*
Return "reference" when the topology runs the CPU reference engine (`sglang-pd engine`), else "sglang".
As `sglang-pd up` decides: a topology whose hardware.gpu is cpu (the presets local-cpu and local-cpu-mla).
*/}}
{{- define "sglang-pd.engine" -}}
{{- $t := include "sglang-pd.topologyView" . | fromYaml -}}
{{- ternary "reference" "sglang" (eq (lower (toString $t.hardware.gpu)) "cpu") -}}
{{- end -}}

{{/*
Return the image of the reference-engine pods: referenceEngine.image, its repository cpuImage's when unset.
*/}}
{{- define "sglang-pd.referenceImage" -}}
{{- $repo := default .Values.cpuImage.repository .Values.referenceEngine.image.repository -}}
{{- if not $repo -}}
{{- fail "\nVALUES VALIDATION:\nreferenceEngine.image.repository: a CPU topology runs the reference engine, which needs the CPU image with the reference engine (make image-reference); set referenceEngine.image.repository or cpuImage.repository to where you pushed it." -}}
{{- end -}}
{{- printf "%s:%s" $repo .Values.referenceEngine.image.tag -}}
{{- end -}}

{{/*
Return the `sglang-pd engine` flags of a reference-engine role, as `sglang-pd up` renders them from the topology:
call with (dict "role" "prefill" "context" $).
*/}}
{{- define "sglang-pd.referenceArgs" -}}
{{- $ := .context -}}
{{- $t := include "sglang-pd.topologyView" $ | fromYaml -}}
{{- $spec := index $t .role -}}
{{- $model := ternary $t.model.path (include "sglang-pd.modelPath" $) (eq $.Values.model.source "hub") -}}
{{- $args := list "sglang-pd" "engine" "--role" .role "--host" "0.0.0.0" "--port" (toString $spec.port) -}}
{{- if eq .role "prefill" -}}
{{- $args = concat $args (list "--bootstrap-port" (toString $spec.bootstrap_port)) -}}
{{- end -}}
{{- $args = concat $args (list "--model" (toString $model) "--served-model-name" (toString (default $t.model.path $t.model.served_name))) -}}
{{- $args = concat $args (list "--page-size" (toString (int $t.model.page_size))) -}}
{{- with $t.model.context_length -}}
{{- $args = concat $args (list "--context-length" (toString (int .))) -}}
{{- end -}}
{{- $args = concat $args (list "--max-running-requests" (toString (int (default 64 $spec.max_running_requests)))) -}}
{{- $args = concat $args (list "--kv-protocol" "tcp") -}}
{{- toJson $args -}}
{{- end -}}

{{/*
Return the health probe of a reference-engine pod: an httpGet of /health, or, with a worker key (which the
reference engine requires on /health too, unlike sglang), the same request sent with it from inside the pod.
Call with (dict "port" 30000 "period" 10 "failures" 3 "context" $).
*/}}
{{- define "sglang-pd.referenceProbe" -}}
{{- if include "sglang-pd.workerKeySecretName" .context -}}
exec:
  command:
    - python
    - -c
    - {{ printf "import os, sys, httpx; key = os.environ['SGLANG_PD_WORKER_API_KEY']; sys.exit(httpx.get('http://127.0.0.1:%d/health', headers={'Authorization': 'Bearer ' + key}, timeout=20).status_code != 200)" (int .port) | quote }}
{{- else -}}
httpGet: {path: /health, port: http}
{{- end }}
periodSeconds: {{ .period }}
failureThreshold: {{ .failures }}
timeoutSeconds: 10
{{- end -}}

{{/*
Return the pod template of a reference-engine role: call with (dict "role" "prefill" "leader" true "context" $).
No GPU, no RDMA, no host network, no hostPath, unprivileged: KV goes over Mooncake TCP between the pods'
addresses, so the chart runs on a laptop cluster (kind, minikube).
*/}}
{{- define "sglang-pd.referencePodTemplate" -}}
{{- $ := .context -}}
{{- $cfg := index $.Values .role -}}
{{- $t := include "sglang-pd.topologyView" $ | fromYaml -}}
{{- $spec := index $t .role -}}
{{- $hub := eq $.Values.model.source "hub" -}}
metadata:
  labels:
    {{- include "sglang-pd.podLabels" (dict "component" .role "context" $) | nindent 4 }}
    sglang-pd/revision: {{ include "sglang-pd.revision" $ | quote }}
  annotations:
    sglang-pd/port: {{ $spec.port | quote }}
    {{- if eq .role "prefill" }}
    sglang-pd/bootstrap-port: {{ $spec.bootstrap_port | quote }}
    {{- end }}
    {{- with $cfg.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  {{- with $.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
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
    - name: engine
      image: {{ include "sglang-pd.referenceImage" $ }}
      imagePullPolicy: {{ $.Values.referenceEngine.image.pullPolicy }}
      command: {{ include "sglang-pd.referenceArgs" (dict "role" .role "context" $) }}
      env:
        # The address Mooncake advertises to the peer engine: the pod's IP.
        - name: SGLANG_PD_KV_HOSTNAME
          valueFrom:
            fieldRef:
              fieldPath: status.podIP
        {{- if include "sglang-pd.workerKeySecretName" $ }}
        # The worker key: the engine requires it on every route, the router and the peer engine send it.
        {{- include "sglang-pd.workerKeyEnv" (dict "name" "SGLANG_PD_WORKER_API_KEY" "context" $) | nindent 8 }}
        {{- end }}
        {{- range $k, $v := merge (dict) $cfg.env $.Values.env }}
        - name: {{ $k }}
          value: {{ $v | quote }}
        {{- end }}
      ports:
        - name: http
          containerPort: {{ $spec.port }}
        {{- if eq .role "prefill" }}
        - name: bootstrap
          containerPort: {{ $spec.bootstrap_port }}
        {{- end }}
      resources:
        {{- toYaml $.Values.referenceEngine.resources | nindent 8 }}
      securityContext:
        privileged: false
        allowPrivilegeEscalation: false
        capabilities:
          drop: [ALL]
      startupProbe:
        {{- include "sglang-pd.referenceProbe" (dict "port" $spec.port "period" 5 "failures" (div (add (int $.Values.referenceEngine.startupSeconds) 4) 5) "context" $) | nindent 8 }}
      readinessProbe:
        {{- include "sglang-pd.referenceProbe" (dict "port" $spec.port "period" $cfg.readinessProbe.periodSeconds "failures" $cfg.readinessProbe.failureThreshold "context" $) | nindent 8 }}
      {{- if not $hub }}
      volumeMounts:
        - name: model
          mountPath: {{ $.Values.model.mountPath }}
          {{- if eq $.Values.model.source "pvc" }}
          readOnly: {{ $.Values.model.pvc.readOnly }}
          {{- end }}
      {{- end }}
  {{- if not $hub }}
  volumes:
    {{- if eq $.Values.model.source "pvc" }}
    - name: model
      persistentVolumeClaim:
        claimName: {{ $.Values.model.pvc.claimName }}
        readOnly: {{ $.Values.model.pvc.readOnly }}
    {{- else if eq $.Values.model.source "hostPath" }}
    - name: model
      hostPath:
        path: {{ $.Values.model.hostPath.path }}
        type: Directory
    {{- end }}
  {{- end }}
{{- end -}}
