{{/*
Return the name of the ConfigMap that keeps the last passing gate report (the next rollout's baseline).
*/}}
{{- define "sglang-pd.gate.baselineName" -}}
{{- printf "%s-gate-baseline" (include "sglang-pd.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Return the gate's ServiceAccount name (it may read and patch the baseline ConfigMap, nothing else).
*/}}
{{- define "sglang-pd.gate.serviceAccountName" -}}
{{- printf "%s-gate" (include "sglang-pd.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Return the Secret holding the gate's own client key, or nothing when the router takes requests without
keys. The gate reads that one key, never the router's list of every client's keys: a gate pod (and
whoever can read its env) holds one key, which is also the only one a comma-separated list would not
break as a bearer token.
*/}}
{{- define "sglang-pd.gate.apiKeySecretName" -}}
{{- $router := .Values.router.apiKeySecret -}}
{{- $gate := .Values.gate.apiKeySecret -}}
{{- if $router.name -}}
{{- $name := $gate.name | default $router.name -}}
{{- if and (eq $name $router.name) (eq $gate.key $router.key) -}}
{{- fail (printf "gate.apiKeySecret would give the gate Secret %s key %s, the router's whole list of client keys (router.apiKeySecret). Put the gate's own key, one of that list, under a key of its own, e.g. kubectl create secret generic %s --from-literal=%s=k1,k2,KG --from-literal=gate-api-key=KG, and leave gate.apiKeySecret.key at gate-api-key (docs/ports-and-auth.md)" $name $gate.key $router.name $router.key) -}}
{{- end -}}
{{- $name -}}
{{- end -}}
{{- end -}}

{{/*
Return true when some gate runs at all (the baseline objects are only needed then).
*/}}
{{- define "sglang-pd.gate.anyEnabled" -}}
{{- $g := .Values.gate -}}
{{- if or $g.helmTest.enabled $g.hook.enabled $g.analysisTemplate.enabled $g.canary.enabled -}}true{{- end -}}
{{- end -}}

{{/*
Return true when a gate that judges a rollout runs (the hook, the helm test, the AnalysisTemplate; not the
canary): those wait for the LeaderWorkerSets to roll out, and read them with the gate's ServiceAccount.
*/}}
{{- define "sglang-pd.gate.rolloutEnabled" -}}
{{- $g := .Values.gate -}}
{{- if or $g.helmTest.enabled $g.hook.enabled $g.analysisTemplate.enabled -}}true{{- end -}}
{{- end -}}

{{/*
Return the longest startup budget of one group, in seconds: the GPU roles' startup probes
(failureThreshold x periodSeconds, "sglang-pd.startupBudget"), or referenceEngine.startupSeconds.
*/}}
{{- define "sglang-pd.gate.startupSeconds" -}}
{{- $longest := 0 -}}
{{- range $role := list "prefill" "decode" -}}
{{- $budget := 0 -}}
{{- if eq (include "sglang-pd.engine" $) "reference" -}}
{{- $budget = int $.Values.referenceEngine.startupSeconds -}}
{{- else -}}
{{- $budget = include "sglang-pd.startupBudget" (dict "role" $role "context" $) | int -}}
{{- end -}}
{{- $longest = max $longest $budget -}}
{{- end -}}
{{- $longest -}}
{{- end -}}

{{/*
Return how long a rollout gate waits for the LeaderWorkerSets to roll out, in seconds: the chart's rolling
update takes one group at a time (maxUnavailable 1, maxSurge 0) and the two roles roll side by side, so the
slower role's groups times its startup budget, plus 5 minutes for scheduling, image pulls and the LWS
controller's steps. docs/upgrades.md works it through.
*/}}
{{- define "sglang-pd.gate.rolloutSeconds" -}}
{{- $t := include "sglang-pd.topologyView" . | fromYaml -}}
{{- $longest := 0 -}}
{{- range $role := list "prefill" "decode" -}}
{{- $budget := 0 -}}
{{- if eq (include "sglang-pd.engine" $) "reference" -}}
{{- $budget = int $.Values.referenceEngine.startupSeconds -}}
{{- else -}}
{{- $budget = include "sglang-pd.startupBudget" (dict "role" $role "context" $) | int -}}
{{- end -}}
{{- $groups := ternary $t.prefill.instances $t.decode.groups (eq $role "prefill") | int -}}
{{- $longest = max $longest (mul $groups $budget) -}}
{{- end -}}
{{- add $longest 300 -}}
{{- end -}}

{{/*
Return a rollout gate pod's activeDeadlineSeconds: the run's gate.gsm8k.timeoutSeconds after its waits (the
rollout, then the router listing a model), which --timeout does not count.
*/}}
{{- define "sglang-pd.gate.deadlineSeconds" -}}
{{- add (int .Values.gate.gsm8k.timeoutSeconds) (include "sglang-pd.gate.rolloutSeconds" . | int) (include "sglang-pd.gate.startupSeconds" . | int) -}}
{{- end -}}

{{/*
Return the gsm8k gate's container: call with (dict "context" $ "name" "gsm8k-gate" "mode" "rollout"|"canary").
A rollout gate asks gate.gsm8k.numQuestions, compares with the stored baseline when there is one, and
stores its report as the next baseline on a clean pass. The canary asks a fixed sample of the baseline's
questions, never stores, and writes its verdict for node-exporter's textfile collector.
*/}}
{{- define "sglang-pd.gate.container" -}}
{{- $ := .context -}}
{{- $g := $.Values.gate.gsm8k -}}
{{- $canary := eq .mode "canary" -}}
{{- $c := $.Values.gate.canary -}}
{{- $timeout := ternary $c.timeoutSeconds $g.timeoutSeconds $canary -}}
- name: {{ .name }}
  image: {{ include "sglang-pd.cpuImage" $ }}
  imagePullPolicy: {{ include "sglang-pd.cpuImagePullPolicy" $ }}
  command:
    - sglang-pd
    - eval
    - gsm8k
    - --base-url
    - {{ printf "http://%s-router:%v/v1" (include "sglang-pd.fullname" $) $.Values.router.service.port | quote }}
    - --parallel
    - {{ $g.parallel | quote }}
    - --api
    - {{ $g.api | quote }}
    - --min-accuracy
    - {{ $g.minAccuracy | quote }}
    - --output
    - /tmp/gsm8k-report.json
    - --quiet
    {{- if $canary }}
    # Wait for the router to list a model; end with a report (exit 4) before Kubernetes kills the pod.
    - --wait-ready
    - "60"
    {{- else }}
    # Score the release only once both LeaderWorkerSets have rolled out (every group updated and ready,
    # evals/rollout.py): a partial rollout is not scored. The budgets derive from the startup budget.
    - --wait-rollout
    - {{ printf "%s-prefill" (include "sglang-pd.fullname" $) | quote }}
    - --wait-rollout
    - {{ printf "%s-decode" (include "sglang-pd.fullname" $) | quote }}
    - --rollout-timeout
    - {{ include "sglang-pd.gate.rolloutSeconds" $ | quote }}
    - --wait-ready
    - {{ include "sglang-pd.gate.startupSeconds" $ | quote }}
    {{- end }}
    - --timeout
    - {{ sub (int $timeout) 30 | quote }}
    {{- if $canary }}
    # A fixed sample of the baseline's questions, so that every canary run is paired with it.
    - --num-questions
    - {{ $c.numQuestions | quote }}
    - --sample
    - --max-drop
    - {{ $c.maxDrop | quote }}
    - --metrics-textfile
    - {{ printf "/textfile/sglang_pd_gsm8k_%s.prom" $.Release.Name | quote }}
    - --metrics-label
    - {{ printf "release=%s" $.Release.Name | quote }}
    - --metrics-label
    - {{ printf "release_namespace=%s" $.Release.Namespace | quote }}
    {{- else }}
    - --num-questions
    - {{ $g.numQuestions | quote }}
    - --max-drop
    - {{ $g.maxDrop | quote }}
    {{- end }}
    {{- if $.Values.gate.baseline.enabled }}
    # The report of the last passing release; none yet on a first install (then only the floor applies).
    - --baseline
    - /baseline/report.json
    - --baseline-optional
    {{- if not $canary }}
    - --publish-baseline
    - {{ include "sglang-pd.gate.baselineName" $ }}
    {{- end }}
    {{- end }}
    {{- if $g.dataConfigMap }}
    - --data
    - /data/gsm8k/test.jsonl
    {{- end }}
  {{- with include "sglang-pd.gate.apiKeySecretName" $ }}
  env:
    - name: OPENAI_API_KEY
      valueFrom:
        secretKeyRef:
          name: {{ . }}
          key: {{ $.Values.gate.apiKeySecret.key }}
  {{- end }}
  resources:
    requests: {cpu: "1", memory: 1Gi}
    limits: {memory: 2Gi}
  securityContext:
    allowPrivilegeEscalation: false
    capabilities: {drop: [ALL]}
    {{- if $canary }}
    # node-exporter's textfile directory belongs to root on the host: the canary writes there as UID 0,
    # with no capability at all.
    runAsUser: 0
    {{- else }}
    runAsNonRoot: true
    runAsUser: 65534
    {{- end }}
  {{- if or $g.dataConfigMap $.Values.gate.baseline.enabled $canary }}
  volumeMounts:
    {{- if $g.dataConfigMap }}
    - name: gsm8k-data
      mountPath: /data/gsm8k
      readOnly: true
    {{- end }}
    {{- if $.Values.gate.baseline.enabled }}
    - name: gsm8k-baseline
      mountPath: /baseline
      readOnly: true
    {{- end }}
    {{- if $canary }}
    - name: textfile
      mountPath: /textfile
    {{- end }}
  {{- end }}
{{- end -}}

{{/*
Return the gate pod's pull secrets, service account and volumes: call with (dict "context" $ "mode" "rollout"|"canary").
*/}}
{{- define "sglang-pd.gate.podSpec" -}}
{{- $ := .context -}}
{{- $g := $.Values.gate.gsm8k -}}
{{- with $.Values.imagePullSecrets }}
# The gate runs the chart's CPU image, from the same registry as the engines'.
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if ne .mode "canary" }}
# Reads the LeaderWorkerSets' rollout and stores a passing report in the baseline ConfigMap through the
# API (the canary does neither).
serviceAccountName: {{ include "sglang-pd.gate.serviceAccountName" $ }}
{{- else }}
automountServiceAccountToken: false
{{- end }}
{{- if or $g.dataConfigMap $.Values.gate.baseline.enabled (eq .mode "canary") }}
volumes:
  {{- if $g.dataConfigMap }}
  - name: gsm8k-data
    configMap:
      name: {{ $g.dataConfigMap }}
  {{- end }}
  {{- if $.Values.gate.baseline.enabled }}
  # optional: before the first passing gate the ConfigMap holds no report.json.
  - name: gsm8k-baseline
    configMap:
      name: {{ include "sglang-pd.gate.baselineName" $ }}
      optional: true
  {{- end }}
  {{- if eq .mode "canary" }}
  - name: textfile
    hostPath:
      path: {{ $.Values.gate.canary.textfileDirectory }}
      type: DirectoryOrCreate
  {{- end }}
{{- end }}
{{- end -}}
