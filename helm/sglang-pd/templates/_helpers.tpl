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
{{/* The slim image of the pods that need neither CUDA nor sglang (router, gate, plan hook); `image` when unset. */}}
{{- define "sglang-pd.cpuImage" -}}
{{- if .Values.cpuImage.repository -}}
{{- printf "%s:%s" .Values.cpuImage.repository .Values.cpuImage.tag -}}
{{- else -}}
{{- include "sglang-pd.image" . -}}
{{- end -}}
{{- end -}}

{{- define "sglang-pd.cpuImagePullPolicy" -}}
{{- if .Values.cpuImage.repository -}}{{ .Values.cpuImage.pullPolicy }}{{- else -}}{{ .Values.image.pullPolicy }}{{- end -}}
{{- end -}}

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
Return the name of the Secret holding the worker key: workerKeySecret.name, else the one the chart
generates (workerKeySecret.generate), else nothing (the engines take requests without a key).
*/}}
{{- define "sglang-pd.workerKeySecretName" -}}
{{- if .Values.workerKeySecret.name -}}
{{- .Values.workerKeySecret.name -}}
{{- else if .Values.workerKeySecret.generate -}}
{{- printf "%s-worker-key" (include "sglang-pd.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/*
Return the env entry of the worker key, read from its Secret (sglang-pd.workerKeySecretName, which must
not be empty): call with (dict "name" "SGLANG_PD_WORKER_API_KEY" "context" $). The value never enters the spec.
*/}}
{{- define "sglang-pd.workerKeyEnv" -}}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ include "sglang-pd.workerKeySecretName" .context }}
      key: {{ .context.Values.workerKeySecret.key }}
{{- end -}}

{{/*
Return the `sglang-pd launch` flags for the rules on a GPU pod's Mooncake ports, as flow-list items after a
comma: the peers are this release's prefill and decode LeaderWorkerSets' headless Services (LeaderWorkerSet
makes one per set, named as the set, listing its pods before they are ready), plus kvFirewall.allowFrom;
with kvFirewall.enabled false, the opt-out. Call with (dict "context" $).
*/}}
{{- define "sglang-pd.kvFirewallArgs" -}}
{{- $ := .context -}}
{{- if $.Values.kvFirewall.enabled -}}
{{- $name := include "sglang-pd.fullname" $ -}}
{{- $ns := $.Release.Namespace -}}
, "--kv-peers", {{ printf "%s-prefill.%s,%s-decode.%s" $name $ns $name $ns | quote }}
{{- with $.Values.kvFirewall.allowFrom }}, "--kv-allow-from", {{ join "," . | quote }}{{ end }}
{{- else -}}
, "--no-kv-firewall"
{{- end -}}
{{- end -}}

{{/*
Return the path where every pod finds the topology.
*/}}
{{- define "sglang-pd.topologyPath" -}}/etc/sglang-pd/topology.yaml{{- end -}}

{{/*
Return the effective topology as YAML: `topology` when set (used whole, never merged), else the shipped preset
(`preset`, empty: deepseek-r1-h200-1p1d); both set is refused.
Templates read it through "sglang-pd.topologyView"; the ConfigMap holds it verbatim.
*/}}
{{- define "sglang-pd.topology" -}}
{{- if and .Values.preset .Values.topology -}}
{{- fail (printf "\nVALUES VALIDATION:\npreset and topology: both are set (preset %q, and a topology of your own), and the chart runs one of them. Unset preset (--set preset=) to run your topology, or drop topology to run the preset." .Values.preset) -}}
{{- end -}}
{{- if kindIs "string" .Values.topology -}}
{{- /* --set-file topology=FILE passes the file as a string */ -}}
{{- if not (trim .Values.topology) -}}
{{- fail "\nVALUES VALIDATION:\ntopology: the string given (--set-file topology=FILE?) is empty. Pass the topology file itself (--set-file topology=my-topology.yaml), or leave topology unset to use the preset." -}}
{{- end -}}
{{- $parsed := fromYaml .Values.topology -}}
{{- if or (not $parsed) (hasKey $parsed "Error") -}}
{{- fail (printf "\nVALUES VALIDATION:\ntopology: the string given (--set-file topology=FILE?) is not a YAML mapping: %v. Check it with `sglang-pd plan FILE`." (get (default dict $parsed) "Error")) -}}
{{- end -}}
{{- /* Helm's schema cannot look inside a string: its keys are checked here, before any template reads them. */ -}}
{{- $fields := .Files.Get "files/topology-fields.yaml" | fromYaml -}}
{{- $problems := list -}}
{{- range .Files.Get "files/topology-required.yaml" | fromYamlArray -}}
{{- if not (hasKey $parsed .) -}}
{{- $problems = append $problems (printf "topology.%s: missing; the topology needs it (the shipped presets, deploy/spec/presets/*.yaml, show its fields)" .) -}}
{{- end -}}
{{- end -}}
{{- $lines := list (include "sglang-pd.unknownKeys" (dict "data" $parsed "fields" $fields "path" "topology")) (include "sglang-pd.notMappings" (dict "data" $parsed "fields" $fields "path" "topology")) (include "sglang-pd.wrongTypes" (dict "data" $parsed "fields" $fields "path" "topology")) -}}
{{- range splitList "\n" (join "\n" $lines) -}}
{{- if . -}}
{{- $problems = append $problems . -}}
{{- end -}}
{{- end -}}
{{- if $problems -}}
{{- fail (printf "\nVALUES VALIDATION:\n%s" (join "\n" $problems)) -}}
{{- end -}}
{{- toYaml $parsed -}}
{{- else if .Values.topology -}}
{{- toYaml .Values.topology -}}
{{- else -}}
{{- /* The default preset (scripts/sync_chart.py DEFAULT_PRESET); values.yaml leaves preset empty so that setting topology alone is not refused. */ -}}
{{- $preset := .Values.preset | default "deepseek-r1-h200-1p1d" -}}
{{- $file := printf "files/presets/%s.yaml" $preset -}}
{{- $text := .Files.Get $file -}}
{{- if not $text -}}
{{- $offered := list -}}
{{- range $path, $_ := .Files.Glob "files/presets/*.yaml" -}}
{{- $offered = append $offered (base $path | trimSuffix ".yaml") -}}
{{- end -}}
{{- fail (printf "\nVALUES VALIDATION:\npreset: %q is not a preset the chart runs (files/presets/*.yaml). Choose %s, or set topology." $preset (join ", " (sortAlpha $offered))) -}}
{{- end -}}
{{- $text | fromYaml | toYaml -}}
{{- end -}}
{{- end -}}

{{/*
Return the data of a topology ConfigMap: the topology and, with model.configFile, the model's config.json.
*/}}
{{- define "sglang-pd.topologyData" -}}
# The one source of truth: every pod renders its own command from this file.
topology.yaml: |
  {{- include "sglang-pd.topology" . | nindent 2 }}
{{- with .Values.model.configFile }}
# The model's config.json (model.configFile), mounted where topology.model.config_json names it.
model-config.json: |
  {{- . | nindent 2 }}
{{- end }}
{{- end -}}

{{/*
Return the `items` of a topology ConfigMap volume: with model.configFile, its config.json goes where the
topology's model.config_json names it, beside the topology; without, nothing (every key, as named).
*/}}
{{- define "sglang-pd.topologyItems" -}}
{{- if .Values.model.configFile -}}
{{- $t := include "sglang-pd.topologyView" . | fromYaml -}}
items:
  - {key: topology.yaml, path: topology.yaml}
  - {key: model-config.json, path: {{ $t.model.config_json | quote }}}
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
Return one line per key of .data that .fields (files/topology-fields.yaml, the topology's models) does not
know, each named by its path under .path: in the words `sglang-pd launch` would use for it. Helm's schema
check covers a topology given as values; this covers one given as a string (--set-file topology=FILE).
*/}}
{{- define "sglang-pd.unknownKeys" -}}
{{- $fields := .fields -}}
{{- range $k, $v := .data -}}
{{- $where := printf "%s.%s" $.path $k -}}
{{- if not (hasKey $fields $k) }}
{{ $where }}: unknown key; {{ ternary "the top level" (trimPrefix "topology." $.path) (eq $.path "topology") }} takes {{ keys $fields | sortAlpha | join ", " }}. Every field is described in docs/fields.md.
{{- else if and (kindIs "map" $v) (kindIs "map" (get $fields $k)) }}
{{- include "sglang-pd.unknownKeys" (dict "data" $v "fields" (get $fields $k) "path" $where) }}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
Return one line per key of .data whose model in .fields (files/topology-fields.yaml) has fields of its own
but whose value is not a mapping, each named by its path under .path, with the fields it takes.
*/}}
{{- define "sglang-pd.notMappings" -}}
{{- $fields := .fields -}}
{{- $kinds := dict "string" "a string" "slice" "a list" "bool" "true or false" "float64" "a number" "int64" "a number" "int" "a number" "invalid" "empty (null)" -}}
{{- range $k, $v := .data -}}
{{- $sub := get $fields $k -}}
{{- $where := printf "%s.%s" $.path $k -}}
{{- if kindIs "map" $sub -}}
{{- if not (kindIs "map" $v) }}
{{ $where }}: must be a mapping of its fields ({{ keys $sub | sortAlpha | join ", " }}), not {{ get $kinds (kindOf $v) | default (kindOf $v) }}{{ if kindIs "string" $v }} ({{ $v | quote }}){{ end }}; write each field indented under {{ $k }}:
{{- else }}
{{- include "sglang-pd.notMappings" (dict "data" $v "fields" $sub "path" $where) }}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
Return one line per key of .data whose value has a type its field (files/topology-fields.yaml lists each
leaf's JSON types) does not take, named by its path under .path: what `sglang-pd launch` would refuse when
pydantic validates it, in its lax mode (an integer field takes 16, 16.0 or "16", a boolean true, 1 or "yes").
*/}}
{{- define "sglang-pd.wrongTypes" -}}
{{- $fields := .fields -}}
{{- $names := dict "integer" "an integer" "number" "a number" "boolean" "true or false" "string" "a string" "array" "a list" "object" "a mapping" "null" "null" -}}
{{- $kinds := dict "string" "a string" "slice" "a list" "map" "a mapping" "bool" "true or false" "float64" "a number" "int64" "a number" "int" "a number" "invalid" "null" -}}
{{- range $k, $v := .data -}}
{{- $want := get $fields $k -}}
{{- $where := printf "%s.%s" $.path $k -}}
{{- if and (kindIs "map" $want) (kindIs "map" $v) }}
{{- include "sglang-pd.wrongTypes" (dict "data" $v "fields" $want "path" $where) }}
{{- else if kindIs "slice" $want -}}
{{- $ok := false -}}
{{- $text := toString $v | trim | lower -}}
{{- $number := or (kindIs "float64" $v) (kindIs "int64" $v) (kindIs "int" $v) -}}
{{- range $want -}}
{{- if eq . "null" -}}{{- $ok = or $ok (kindIs "invalid" $v) -}}{{- end -}}
{{- if eq . "string" -}}{{- $ok = or $ok (kindIs "string" $v) -}}{{- end -}}
{{- if eq . "array" -}}{{- $ok = or $ok (kindIs "slice" $v) -}}{{- end -}}
{{- if eq . "object" -}}{{- $ok = or $ok (kindIs "map" $v) -}}{{- end -}}
{{- if eq . "boolean" -}}
{{- $ok = or $ok (kindIs "bool" $v) (and $number (has $text (list "0" "1"))) (and (kindIs "string" $v) (has $text (list "0" "1" "f" "false" "n" "no" "off" "t" "true" "y" "yes" "on"))) -}}
{{- end -}}
{{- if eq . "integer" -}}
{{- $ok = or $ok (kindIs "bool" $v) (and $number (regexMatch "^-?[0-9]+$" $text)) (and (kindIs "string" $v) (regexMatch "^[+-]?[0-9]+(\\.0*)?$" $text)) -}}
{{- end -}}
{{- if eq . "number" -}}
{{- $ok = or $ok (kindIs "bool" $v) $number (and (kindIs "string" $v) (regexMatch "^[+-]?([0-9]+\\.?[0-9]*|\\.[0-9]+)(e[+-]?[0-9]+)?$" $text)) -}}
{{- end -}}
{{- end -}}
{{- if not $ok -}}
{{- $allowed := list -}}
{{- range $want -}}{{- $allowed = append $allowed (get $names .) -}}{{- end }}
{{ $where }}: must be {{ join " or " $allowed }}, not {{ get $kinds (kindOf $v) | default (kindOf $v) }}{{ if not (or (kindIs "map" $v) (kindIs "slice" $v) (kindIs "invalid" $v)) }} ({{ toJson $v }}){{ end }}; fix the value in the topology file (`sglang-pd plan FILE` checks it).
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
Collect every values problem the schema cannot express, then fail once with each fix spelled out.
*/}}
{{- define "sglang-pd.validateValues" -}}
{{- $messages := list -}}
{{- $t := include "sglang-pd.topologyView" . | fromYaml -}}
{{- /* A topology given as a string (--set-file) has its keys checked where it is parsed ("sglang-pd.topology"). */ -}}
{{- if and (eq .Values.model.source "pvc") (not .Values.model.pvc.claimName) -}}
{{- $messages = append $messages "model.pvc.claimName: model.source is pvc but no claim is named. Set --set model.pvc.claimName=<pvc> or choose model.source=hub|hostPath." -}}
{{- end -}}
{{- if and (eq .Values.model.source "hostPath") (not .Values.model.hostPath.path) -}}
{{- $messages = append $messages "model.hostPath.path: model.source is hostPath but no path is set. Set --set model.hostPath.path=/data/models." -}}
{{- end -}}
{{- if and (eq $t.transfer.protocol "rdma") (eq .Values.rdma.mode "none") -}}
{{- $messages = append $messages "rdma.mode: none gives pods no RDMA NIC, but topology.transfer.protocol is rdma. Set rdma.mode=hostNetwork|devicePlugin or topology.transfer.protocol=tcp." -}}
{{- end -}}
{{- if and (eq $t.transfer.protocol "rdma") (eq .Values.rdma.mode "hostNetwork") (not (include "sglang-pd.privileged" . | eq "true")) -}}
{{- /* The same sentence as sglang-pd launch's (UNPRIVILEGED_HOST_RDMA in deploy/spec/topology.py). */ -}}
{{- $messages = append $messages "securityContext.privileged: rdma.mode hostNetwork mounts the host's /dev/infiniband, whose verbs devices a container opens only when privileged, but securityContext.privileged is false; Mooncake and DeepEP would fail to open the NICs. Leave securityContext.privileged unset (automatic) or true, or set rdma.mode=devicePlugin with an RDMA device plugin." -}}
{{- end -}}
{{- if and (eq .Values.cache.type "pvc") (not .Values.cache.pvc.claimName) -}}
{{- $messages = append $messages "cache.pvc.claimName: cache.type is pvc but no claim is named. Set --set cache.pvc.claimName=<pvc> or choose cache.type=hostPath|emptyDir." -}}
{{- end -}}
{{- if and (eq .Values.cache.type "hostPath") (not .Values.cache.hostPath) -}}
{{- $messages = append $messages "cache.hostPath: cache.type is hostPath but no path is set. Set --set cache.hostPath=/var/cache/sglang-pd." -}}
{{- end -}}
{{- $need := include "sglang-pd.startupSeconds" . | int -}}
{{- if and (lt $need 0) (not (and .Values.prefill.startupProbe.failureThreshold .Values.decode.startupProbe.failureThreshold)) -}}
{{- $messages = append $messages "model.sizeBytes: the startup budget is derived from the checkpoint size, which the chart knows only for shipped model configs (topology.model.config_json). Set --set model.sizeBytes=<bytes>, or set prefill.startupProbe.failureThreshold and decode.startupProbe.failureThreshold." -}}
{{- else -}}
{{- range $role := list "prefill" "decode" -}}
{{- $probe := (index $.Values $role).startupProbe -}}
{{- if ge $need 0 -}}
{{- $budget := include "sglang-pd.startupBudget" (dict "role" $role "context" $) | int -}}
{{- if and $probe.failureThreshold (lt $budget $need) -}}
{{- /* The same sentences as sglang-pd launch's (startup_budget_problem in deploy/spec/topology.py), then the threshold that fits. */ -}}
{{- $hub := eq $.Values.model.source "hub" -}}
{{- $advice := ternary " Serving the weights from a volume (model.source=pvc or hostPath) removes the download." "" $hub -}}
{{- $messages = append $messages (printf "%s.startupProbe: a startup budget of %ds (failureThreshold x periodSeconds) cannot cover a cold start of this model (~%ds: %s the weights, warm-up of %ds); the probe would restart the pod forever. Raise %s.startupProbe.failureThreshold so that the budget is >= %ds, or unset it to derive it.%s At periodSeconds %d that is failureThreshold >= %d." $role $budget $need (ternary "download and load" "load" $hub) (int $.Values.startupBudget.warmupSeconds) $role $need $advice (int $probe.periodSeconds) (div (add $need (int $probe.periodSeconds) -1) (int $probe.periodSeconds))) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- /* The topology rule that most often breaks on a cluster, in plan's own words (_role_rules in deploy/spec/topology.py); the hook Job runs the rest. */ -}}
{{- range $role := list "prefill" "decode" -}}
{{- $spec := index $t $role -}}
{{- $gpn := int $t.hardware.gpus_per_node -}}
{{- $fill := mul (int $spec.nodes) $gpn -}}
{{- if ne (int $spec.tp) (int $fill) -}}
{{- $messages = append $messages (printf "%s.tp: %d GPUs per %s do not fill %s.nodes=%d x hardware.gpus_per_node=%d = %d GPUs. Set %s.tp to %d or %s.nodes to match." $role (int $spec.tp) (ternary "instance" "group" (eq $role "prefill")) $role (int $spec.nodes) $gpn $fill $role $fill $role) -}}
{{- end -}}
{{- end -}}
{{- $config := toString (default "" $t.model.config_json) -}}
{{- $shipped := .Files.Get "files/model-sizes.yaml" | fromYaml -}}
{{- if .Values.model.configFile -}}
{{- if not $config -}}
{{- $messages = append $messages "model.configFile: a model config is given, but the topology names none; set topology.model.config_json to its file name, e.g. config.json." -}}
{{- else if or (isAbs $config) (has ".." (splitList "/" $config)) -}}
{{- $messages = append $messages (printf "topology.model.config_json: %q must be a path relative to the topology (the chart writes model.configFile beside it); set it to a file name, e.g. config.json." $config) -}}
{{- end -}}
{{- else if and $config (not (isAbs $config)) (not (hasKey $shipped $config)) -}}
{{- /* Starts with the sentence sglang-pd launch would fail with (Topology.load_model_config). */ -}}
{{- $messages = append $messages (printf "model.config_json: file %s does not exist; give a path to the model's config.json (relative to the topology file) or remove the key. The chart ships only %s: pass your file with --set-file model.configFile=%s." (printf "%s/%s" (dir (include "sglang-pd.topologyPath" .)) $config) (join ", " (keys $shipped | sortAlpha)) $config) -}}
{{- end -}}
{{- if ne .Values.model.source "hub" -}}
{{- $mount := trimSuffix "/" .Values.model.mountPath -}}
{{- $path := include "sglang-pd.modelPath" . -}}
{{- if not (or (eq $path $mount) (hasPrefix (printf "%s/" $mount) $path)) -}}
{{- $messages = append $messages (printf "model.path: %q is not under model.mountPath=%s, where the %s volume holds the weights; set model.path to the weights' directory under it (the one holding config.json)." $path $mount .Values.model.source) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.workerKeySecret.name (not .Values.workerKeySecret.key) -}}
{{- $messages = append $messages (printf "workerKeySecret.key: the Secret %q is named but not the key in it that holds the worker key. Set --set workerKeySecret.key=<key in the Secret>." .Values.workerKeySecret.name) -}}
{{- end -}}
{{- if and (eq .Values.rdma.mode "hostNetwork") (not (include "sglang-pd.workerKeySecretName" .)) -}}
{{- $messages = append $messages "workerKeySecret: rdma.mode hostNetwork puts the engines' HTTP and bootstrap ports on the nodes' own addresses, where no NetworkPolicy applies, and without a worker key anything that reaches a GPU node may call /generate, /abort_request and /flush_cache there. Set --set workerKeySecret.generate=true (the default), or name a Secret with --set workerKeySecret.name=<secret>, or use rdma.mode devicePlugin or none." -}}
{{- end -}}
{{- range $where, $env := dict "env" .Values.env "prefill.env" .Values.prefill.env "decode.env" .Values.decode.env -}}
{{- range $name := list "SGLANG_PD_WORKER_API_KEY" "SGLANG_PD_ROUTER_WORKER_API_KEY" -}}
{{- if hasKey $env $name -}}
{{- $messages = append $messages (printf "%s.%s: a worker key in plain values is written into the pod spec. Put it in a Secret and set --set workerKeySecret.name=<secret>,workerKeySecret.key=<key>." $where $name) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range .Values.router.extraArgs -}}
{{- if hasPrefix "--worker-api-key" (toString .) -}}
{{- $messages = append $messages "router.extraArgs: --worker-api-key writes the worker key into the pod spec. Remove it and set --set workerKeySecret.name=<secret>,workerKeySecret.key=<key>." -}}
{{- end -}}
{{- end -}}
{{- if eq (include "sglang-pd.engine" .) "reference" -}}
{{- range $role := list "prefill" "decode" -}}
{{- if ne (int (index $t $role).nodes) 1 -}}
{{- $messages = append $messages (printf "%s.nodes: a CPU topology (hardware.gpu cpu) runs the reference engine, one pod per %s, but %s.nodes is %d. Set %s.nodes to 1 (more instances: prefill.instances, decode.groups)." $role (ternary "instance" "group" (eq $role "prefill")) $role (int (index $t $role).nodes) $role) -}}
{{- end -}}
{{- end -}}
{{- $models := list "smollm2-135m-instruct" "tiny-deepseek-v3" -}}
{{- if and (eq .Values.model.source "hub") (not (has (toString $t.model.path) $models)) -}}
{{- $messages = append $messages (printf "model.path: the reference engine in a pod loads %s from its image, or a Hugging Face model directory from a volume, not %q. Set topology.model.path to one of them, or serve the directory with model.source=pvc|hostPath." (join " or " $models) (toString $t.model.path)) -}}
{{- end -}}
{{- if ne (toString $t.transfer.protocol) "tcp" -}}
{{- $messages = append $messages (printf "topology.transfer.protocol: the reference engine's pods carry no RDMA NIC, but the protocol is %s. Set topology.transfer.protocol=tcp." (toString $t.transfer.protocol)) -}}
{{- end -}}
{{- end -}}
{{- if and (eq .Values.rdma.mode "hostNetwork") (ne (include "sglang-pd.engine" .) "reference") (not .Values.allowNodePortRange) -}}
{{- range $role := list "prefill" "decode" -}}
{{- range splitList "\n" (include "sglang-pd.nodePortProblems" (dict "role" $role "spec" (index $t $role))) -}}
{{- if . -}}
{{- $messages = append $messages . -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range $role := list "prefill" "decode" -}}
{{- $existing := include "sglang-pd.existingLeaderWorkerSet" (dict "role" $role "context" $) | fromJson -}}
{{- with include "sglang-pd.resizeProblem" (dict "role" $role "existing" $existing "size" (index $t $role).nodes "context" $) -}}
{{- $messages = append $messages . -}}
{{- end -}}
{{- end -}}
{{- if and .Values.router.ingress.enabled (not .Values.router.ingress.host) -}}
{{- $messages = append $messages "router.ingress.host: the Ingress needs a host name. Set --set router.ingress.host=llm.example.com." -}}
{{- end -}}
{{- if $messages -}}
{{- printf "\nVALUES VALIDATION:\n%s" (join "\n" $messages) | fail -}}
{{- end -}}
{{- end -}}

{{/*
Return one line per listening port of a host-network engine role that lies in Kubernetes' default NodePort
range (30000-32767), where kube-proxy hands the port on every node to a NodePort Service allocated it: the
role's HTTP port, the prefill's bootstrap port, and on a one-node instance with attention DP the ports sglang
derives from its HTTP port (sglang 0.5.23 srt/server_args.py PortArgs.init_new, lines 817-848: port+233 and
port+234..port+239; srt/managers/data_parallel_controller.py lines 501-509: port+13). A group of several nodes
rendezvouses on --dist-init-addr's port 5000 and derives from it instead, outside the range.
Call with (dict "role" "prefill" "spec" <the role's topology>).
*/}}
{{- define "sglang-pd.nodePortProblems" -}}
{{- $inRange := dict -}}
{{- $port := int .spec.port -}}
{{- $fix := "or set allowNodePortRange=true if your cluster's --service-node-port-range leaves it out" -}}
{{- $own := dict (printf "%s.port" .role) $port -}}
{{- if eq .role "prefill" -}}
{{- $_ := set $own "prefill.bootstrap_port" (int .spec.bootstrap_port) -}}
{{- end -}}
{{- range $key, $p := $own -}}
{{- if and (ge $p 30000) (le $p 32767) }}
{{ $key }}: {{ $p }} lies in Kubernetes' NodePort range 30000-32767, and with rdma.mode hostNetwork the engine listens on the node itself, where a NodePort Service given that port takes its traffic. Set topology {{ $key }} outside the range (the GPU presets use prefill.port 8100, prefill.bootstrap_port 8998, decode.port 8200), {{ $fix }}.
{{- end -}}
{{- end -}}
{{- if and (gt (int .spec.attn_dp_size) 1) (eq (int .spec.nodes) 1) (or (lt $port 30000) (gt $port 32767)) -}}
{{- $derived := list (add $port 13) -}}
{{- range $i := until 7 -}}
{{- $derived = append $derived (add $port 233 $i) -}}
{{- end -}}
{{- $hit := list -}}
{{- range $derived -}}
{{- if and (ge (int .) 30000) (le (int .) 32767) -}}
{{- $hit = append $hit (toString .) -}}
{{- end -}}
{{- end -}}
{{- if $hit }}
{{ .role }}.port: {{ $port }} makes sglang also listen on {{ add $port 13 }} and {{ add $port 233 }}-{{ add $port 239 }} (attention DP on one node derives them from the HTTP port), and {{ join ", " $hit }} lie in Kubernetes' NodePort range 30000-32767, where a NodePort Service given one takes its traffic on a host-network node. Set topology {{ .role }}.port so that port+239 stays below 30000 or port+13 above 32767, {{ $fix }}.
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
Return a role's LeaderWorkerSet as the cluster holds it now, as JSON: {} when there is none, when the cluster
serves no LeaderWorkerSet API, and in offline rendering (`helm template`, --dry-run=client), where `lookup`
reads nothing. Call with (dict "role" "decode" "context" $).
*/}}
{{- define "sglang-pd.existingLeaderWorkerSet" -}}
{{- $ := .context -}}
{{- if $.Capabilities.APIVersions.Has "leaderworkerset.x-k8s.io/v1/LeaderWorkerSet" -}}
{{- lookup "leaderworkerset.x-k8s.io/v1" "LeaderWorkerSet" $.Release.Namespace (printf "%s-%s" (include "sglang-pd.fullname" $) .role) | toJson -}}
{{- else -}}
{}
{{- end -}}
{{- end -}}

{{/*
Return why an upgrade cannot change the group size of a role's existing LeaderWorkerSet (.existing, as
"sglang-pd.existingLeaderWorkerSet" returns it) to .size, or nothing. LeaderWorkerSet before 0.7.0 keeps
spec.leaderWorkerTemplate.size immutable (lws v0.6.2 pkg/webhooks/leaderworkerset_webhook.go line 106);
0.7.0 lets it change and rolls every group to the new size (lws PRs 576 and 601). An object served by 0.7.0
or later always carries spec.rolloutStrategy.rollingUpdateConfiguration.partition, a field 0.7.0 added with a
default of 0 (lws PR 563), which the API server fills in on every read; before 0.7.0 the CRD has no such field.
Without this check the upgrade would stop half-applied: the topology ConfigMap changed, the LeaderWorkerSet
refused, and the old groups would start on the new topology at their next restart.
Call with (dict "role" "decode" "existing" <object> "size" <nodes> "context" $).
*/}}
{{- define "sglang-pd.resizeProblem" -}}
{{- $spec := get (default dict .existing) "spec" | default dict -}}
{{- $old := dig "leaderWorkerTemplate" "size" 0 $spec | int -}}
{{- $new := int .size -}}
{{- if and (gt $old 0) (ne $old $new) -}}
{{- if not (hasKey (dig "rolloutStrategy" "rollingUpdateConfiguration" dict $spec) "partition") -}}
{{- $name := printf "%s-%s" (include "sglang-pd.fullname" .context) .role -}}
{{ .role }}.nodes: the LeaderWorkerSet {{ $name }} runs groups of {{ $old }} pods and this upgrade makes them {{ $new }}, but the cluster's LeaderWorkerSet is older than 0.7.0, which cannot change a group's size (its objects lack rolloutStrategy.rollingUpdateConfiguration.partition, which 0.7.0 added). Delete the LeaderWorkerSet first (kubectl -n {{ .context.Release.Namespace }} delete leaderworkerset {{ $name }}; its groups stop), then upgrade; or upgrade LeaderWorkerSet to 0.7.0 or later, which rolls the groups to the new size.
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
Return "true" when GPU pods run privileged: securityContext.privileged when set, else automatic:
privileged with rdma.mode hostNetwork, whose hostPath /dev/infiniband opens only with device
access (sglang's LWS PD example runs privileged too), unprivileged otherwise.
*/}}
{{- define "sglang-pd.privileged" -}}
{{- if kindIs "bool" .Values.securityContext.privileged -}}
{{- .Values.securityContext.privileged -}}
{{- else -}}
{{- eq .Values.rdma.mode "hostNetwork" -}}
{{- end -}}
{{- end -}}

{{/*
Return the weights' directory inside GPU pods for model.source pvc or hostPath (sglang's --model-path):
model.path, else topology.model.path when it lies under model.mountPath, else the mount itself.
*/}}
{{- define "sglang-pd.modelPath" -}}
{{- $t := include "sglang-pd.topologyView" . | fromYaml -}}
{{- $mount := trimSuffix "/" .Values.model.mountPath -}}
{{- if .Values.model.path -}}
{{- trimSuffix "/" .Values.model.path -}}
{{- else if hasPrefix (printf "%s/" $mount) (toString $t.model.path) -}}
{{- $t.model.path -}}
{{- else -}}
{{- $mount -}}
{{- end -}}
{{- end -}}

{{/*
Return the checkpoint size in bytes: model.sizeBytes, else the size sglang-pd estimated from the
shipped config.json the topology names (files/model-sizes.yaml), else -1.
*/}}
{{- define "sglang-pd.weightBytes" -}}
{{- $t := include "sglang-pd.topologyView" . | fromYaml -}}
{{- $sizes := .Files.Get "files/model-sizes.yaml" | fromYaml -}}
{{- $name := base (default "" $t.model.config_json | toString) -}}
{{- if .Values.model.sizeBytes -}}
{{- .Values.model.sizeBytes | int64 -}}
{{- else if hasKey $sizes $name -}}
{{- get $sizes $name | int64 -}}
{{- else -}}
-1
{{- end -}}
{{- end -}}

{{/*
Return the seconds a GPU pod needs from start to a healthy sglang on a cold node (-1: size unknown):
download (model.source hub) + load + warm-up (DeepGEMM JIT). The same formula as sglang-pd's
`required_startup_s`, which `sglang-pd launch` checks the budget against.
*/}}
{{- define "sglang-pd.startupSeconds" -}}
{{- $bytes := include "sglang-pd.weightBytes" . | int64 -}}
{{- if lt $bytes 0 -}}
-1
{{- else -}}
{{- /* Each step rounded up to whole seconds, in integers, as required_startup_s does. */ -}}
{{- $loadRate := .Values.startupBudget.loadBytesPerSecond | int64 -}}
{{- $downloadRate := .Values.model.hub.downloadBytesPerSecond | int64 -}}
{{- $load := div (add $bytes $loadRate -1) $loadRate -}}
{{- $download := ternary (div (add $bytes $downloadRate -1) $downloadRate) 0 (eq .Values.model.source "hub") -}}
{{- add $download $load (.Values.startupBudget.warmupSeconds | int64) -}}
{{- end -}}
{{- end -}}

{{/*
Return a role's startup probe failureThreshold: the value set, else derived from the model.
Call with (dict "role" "prefill" "context" $).
*/}}
{{- define "sglang-pd.startupFailureThreshold" -}}
{{- $probe := (index .context.Values .role).startupProbe -}}
{{- if $probe.failureThreshold -}}
{{- $probe.failureThreshold | int -}}
{{- else -}}
{{- $need := include "sglang-pd.startupSeconds" .context | int -}}
{{- $period := $probe.periodSeconds | int -}}
{{- div (add $need $period -1) $period -}}
{{- end -}}
{{- end -}}

{{/*
Return a role's startup budget in seconds (failureThreshold x periodSeconds).
*/}}
{{- define "sglang-pd.startupBudget" -}}
{{- mul (include "sglang-pd.startupFailureThreshold" .) ((index .context.Values .role).startupProbe.periodSeconds | int) -}}
{{- end -}}

{{/*
Return the fabric environment of a role's GPU pods as a dict (YAML): call with (dict "role" "decode" "context" $).
fabric.preset infiniband or roce, the bootstrap interface (fabric.socketInterface, else
topology.hardware.socket_interface), and the HCAs from topology.hardware.rdma_devices (NCCL_IB_HCA,
NVSHMEM_HCA_LIST), as sglang's LWS example and llm-d's wide-EP guide set them. NCCL, Gloo, NVSHMEM
(DeepEP) and Mooncake read these; RoCE needs the GID index as well. No NVSHMEM_HCA_PE_MAPPING: NVSHMEM
gives each GPU its closest NIC (docs/cluster-prerequisites.md says why); a role whose topology env sets
one gets no NVSHMEM_HCA_LIST, which NVSHMEM would let win over it.
*/}}
{{- define "sglang-pd.fabricEnv" -}}
{{- $roleEnv := (index (include "sglang-pd.topologyView" .context | fromYaml) .role).env | default dict -}}
{{- with .context -}}
{{- $t := include "sglang-pd.topologyView" . | fromYaml -}}
{{- $f := .Values.fabric -}}
{{- $env := dict -}}
{{- with default $t.hardware.socket_interface $f.socketInterface -}}
{{- $_ := set $env "NCCL_SOCKET_IFNAME" . -}}
{{- $_ := set $env "GLOO_SOCKET_IFNAME" . -}}
{{- $_ := set $env "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME" . -}}
{{- end -}}
{{- if has $f.preset (list "infiniband" "roce") -}}
{{- with $t.hardware.rdma_devices -}}
{{- $_ := set $env "NCCL_IB_HCA" (printf "=%s" (join "," .)) -}}
{{- /* NVSHMEM (DeepEP's transport) picks HCAs by itself otherwise, bonded or management ones included. */ -}}
{{- if not (hasKey $roleEnv "NVSHMEM_HCA_PE_MAPPING") -}}
{{- $_ := set $env "NVSHMEM_HCA_LIST" (join "," .) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if eq $f.preset "roce" -}}
{{- $gid := toString (int $f.gidIndex) -}}
{{- $_ := set $env "NCCL_IB_GID_INDEX" $gid -}}
{{- $_ := set $env "NVSHMEM_IB_GID_INDEX" $gid -}}
{{- $_ := set $env "MC_GID_INDEX" $gid -}}
{{- if not (kindIs "invalid" $f.trafficClass) -}}
{{- $_ := set $env "NCCL_IB_TC" (toString (int $f.trafficClass)) -}}
{{- $_ := set $env "NVSHMEM_IB_TRAFFIC_CLASS" (toString (int $f.trafficClass)) -}}
{{- end -}}
{{- end -}}
{{- toYaml $env -}}
{{- end -}}
{{- end -}}

{{/*
Return the deployment's revision: the pods' sglang-pd/revision label, on which the router pairs a prefill
only with a decode of the same revision. The definition is deploy/spec/revision.py's `revision_document`
(the engines' image and sglang version, the topology sections the renderer reads less the counts, the env
the chart adds per role, a mounted config.json); tests/helm/test_revision_chart.py holds the two equal.
One revision for both roles: the router, the gate, a scale or a router-only change leave it, and so the
GPU pod templates, unchanged.
*/}}
{{- define "sglang-pd.revision" -}}
{{- $t := include "sglang-pd.topology" . | fromYaml -}}
{{- $reference := eq (include "sglang-pd.engine" .) "reference" -}}
{{- $sections := dict -}}
{{- range $name := list "model" "transfer" "hardware" "prefill" "decode" -}}
{{- $section := index $t $name -}}
{{- if and (kindIs "map" $section) (has $name (list "prefill" "decode")) -}}
{{- $section = omit $section (ternary "instances" "groups" (eq $name "prefill")) -}}
{{- end -}}
{{- $_ := set $sections $name $section -}}
{{- end -}}
{{- $env := dict -}}
{{- range $role := list "prefill" "decode" -}}
{{- $merged := merge (dict) (index $.Values $role).env $.Values.env -}}
{{- if not $reference -}}
{{- $merged = merge $merged (include "sglang-pd.fabricEnv" (dict "role" $role "context" $) | fromYaml) -}}
{{- end -}}
{{- $strings := dict -}}
{{- range $k, $v := $merged -}}
{{- $_ := set $strings $k (toString $v) -}}
{{- end -}}
{{- $_ := set $env $role $strings -}}
{{- end -}}
{{- $image := "" -}}
{{- if $reference -}}
{{- $image = include "sglang-pd.referenceImage" . -}}
{{- else -}}
{{- $image = include "sglang-pd.image" . -}}
{{- end -}}
{{- $doc := dict "image" $image "sglang" .Chart.AppVersion "topology" $sections "env" $env -}}
{{- with .Values.model.configFile -}}
{{- $_ := set $doc "model_config" (sha256sum .) -}}
{{- end -}}
{{- toJson $doc | sha256sum | trunc 16 -}}
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
{{- $privileged := include "sglang-pd.privileged" $ | eq "true" -}}
{{- $hub := eq $.Values.model.source "hub" -}}
metadata:
  labels:
    {{- include "sglang-pd.podLabels" (dict "component" .role "context" $) | nindent 4 }}
    # What the engines run, hashed (no checksum of the whole topology: a router-only change restarts no engine).
    sglang-pd/revision: {{ include "sglang-pd.revision" $ | quote }}
  {{- if or .leader $cfg.podAnnotations }}
  annotations:
    {{- if .leader }}
    sglang-pd/port: {{ $spec.port | quote }}
    {{- if eq .role "prefill" }}
    sglang-pd/bootstrap-port: {{ $spec.bootstrap_port | quote }}
    {{- end }}
    {{- end }}
    {{- with $cfg.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
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
      command: ["sglang-pd", "launch", "--role", {{ .role | quote }}, "--topology", {{ include "sglang-pd.topologyPath" $ | quote }}{{ include "sglang-pd.kvFirewallArgs" (dict "context" $) }}]
      env:
        # The address sglang advertises to its peers (bootstrap, Mooncake): the pod's IP, which is
        # the node's under hostNetwork.
        - name: SGLANG_HOST_IP
          valueFrom:
            fieldRef:
              fieldPath: status.podIP
        # Who this pod is, for the name of its KV ports' netfilter chain (deploy/kv/firewall.py):
        # pods of several releases on one node's network each keep their own.
        - name: SGLANG_PD_POD_NAME
          valueFrom:
            fieldRef:
              fieldPath: metadata.name
        - name: SGLANG_PD_RELEASE
          value: {{ printf "%s/%s" $.Release.Namespace (include "sglang-pd.fullname" $) | quote }}
        # JIT caches (DeepGEMM, Triton, Inductor, FlashInfer) on the cache volume: a restarted or
        # recreated pod skips the 10-20 minute DeepGEMM warm-up compile.
        - name: SGLANG_CACHE_DIR
          value: /cache/sglang
        - name: SGLANG_JIT_CACHE_DIR
          value: /cache/sglang/jit
        - name: FLASHINFER_WORKSPACE_BASE
          value: /cache
        {{- if $hub }}
        - name: HF_HOME
          value: /cache/huggingface
        {{- with $.Values.model.hub.tokenSecret.name }}
        - name: HF_TOKEN
          valueFrom:
            secretKeyRef:
              name: {{ . }}
              key: {{ $.Values.model.hub.tokenSecret.key }}
        {{- end }}
        {{- end }}
        {{- if include "sglang-pd.workerKeySecretName" $ }}
        # The worker key; `sglang-pd launch` passes it to sglang as --api-key when it execs it.
        {{- include "sglang-pd.workerKeyEnv" (dict "name" "SGLANG_PD_WORKER_API_KEY" "context" $) | nindent 8 }}
        {{- end }}
        # How this pod is set up, for `sglang-pd launch`'s check against the topology.
        - name: SGLANG_PD_POD_RDMA_MODE
          value: {{ $.Values.rdma.mode | quote }}
        - name: SGLANG_PD_POD_PRIVILEGED
          value: {{ $privileged | quote }}
        - name: SGLANG_PD_POD_MODEL_SOURCE
          value: {{ $.Values.model.source | quote }}
        - name: SGLANG_PD_POD_STARTUP_BUDGET_S
          value: {{ include "sglang-pd.startupBudget" (dict "role" .role "context" $) | quote }}
        - name: SGLANG_PD_POD_DOWNLOAD_BYTES_PER_S
          value: {{ $.Values.model.hub.downloadBytesPerSecond | int64 | quote }}
        # The rest of what the startup budget was derived from: the pod checks it with these numbers.
        - name: SGLANG_PD_POD_LOAD_BYTES_PER_S
          value: {{ $.Values.startupBudget.loadBytesPerSecond | int64 | quote }}
        - name: SGLANG_PD_POD_WARMUP_S
          value: {{ $.Values.startupBudget.warmupSeconds | int64 | quote }}
        {{- $weights := include "sglang-pd.weightBytes" $ | int64 }}
        {{- if ge $weights 0 }}
        - name: SGLANG_PD_POD_WEIGHT_BYTES
          value: {{ $weights | quote }}
        {{- end }}
        {{- if not $hub }}
        # The weights on the model volume: sglang's --model-path (and no hub download).
        - name: SGLANG_PD_POD_MODEL_PATH
          value: {{ include "sglang-pd.modelPath" $ | quote }}
        {{- end }}
        {{- range $k, $v := merge (dict) $cfg.env $.Values.env (include "sglang-pd.fabricEnv" (dict "role" .role "context" $) | fromYaml) }}
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
          {{- if and $hub (eq $.Values.cache.type "emptyDir") }}
          # The download lands on the node's ephemeral storage: schedule only where it fits.
          ephemeral-storage: {{ $.Values.cache.sizeLimit }}
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
        {{- if $privileged }}
        privileged: true
        {{- else }}
        privileged: false
        capabilities:
          add:
            - IPC_LOCK
            {{- if $.Values.securityContext.sysRawio }}
            - SYS_RAWIO
            {{- end }}
            {{- if $.Values.kvFirewall.enabled }}
            # `sglang-pd launch` writes the Mooncake ports' netfilter rules (kvFirewall).
            - NET_ADMIN
            {{- end }}
        {{- end }}
      {{- if .leader }}
      # kubelet's httpGet cannot send the worker key; sglang's --api-key leaves /health open
      # (sglang/srt/utils/auth.py, decide_request_auth: /health*, /ready* and /metrics* are exempt).
      startupProbe:
        httpGet: {path: /health, port: http}
        periodSeconds: {{ $cfg.startupProbe.periodSeconds }}
        failureThreshold: {{ include "sglang-pd.startupFailureThreshold" (dict "role" .role "context" $) }}
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
        - name: cache
          mountPath: /cache
        {{- if not $hub }}
        - name: model
          mountPath: {{ $.Values.model.mountPath }}
          {{- if eq $.Values.model.source "pvc" }}
          readOnly: {{ $.Values.model.pvc.readOnly }}
          {{- end }}
        {{- end }}
        {{- if $hostNetwork }}
        - name: infiniband
          mountPath: /dev/infiniband
        {{- end }}
  volumes:
    - name: topology
      configMap:
        name: {{ include "sglang-pd.fullname" $ }}-topology
        {{- include "sglang-pd.topologyItems" $ | nindent 8 }}
    - name: shm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $.Values.shmSizeLimit }}
    # Hub downloads and JIT caches. LeaderWorkerSet recreates the whole group when a pod restarts,
    # which wipes an emptyDir: hostPath (the default) or a PVC keeps them.
    - name: cache
      {{- if eq $.Values.cache.type "pvc" }}
      persistentVolumeClaim:
        claimName: {{ $.Values.cache.pvc.claimName }}
      {{- else if eq $.Values.cache.type "hostPath" }}
      hostPath:
        path: {{ $.Values.cache.hostPath }}
        type: DirectoryOrCreate
      {{- else }}
      emptyDir:
        sizeLimit: {{ $.Values.cache.sizeLimit }}
      {{- end }}
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
    {{- /* A CPU topology runs the reference engine (one pod per instance) instead of sglang. */}}
    {{- $pod := ternary "sglang-pd.referencePodTemplate" "sglang-pd.gpuPodTemplate" (eq (include "sglang-pd.engine" $) "reference") }}
    {{- if gt $nodes 1 }}
    leaderTemplate:
      {{- include $pod (dict "role" .role "leader" true "context" $) | nindent 6 }}
    workerTemplate:
      {{- include $pod (dict "role" .role "leader" false "context" $) | nindent 6 }}
    {{- else }}
    workerTemplate:
      {{- include $pod (dict "role" .role "leader" true "context" $) | nindent 6 }}
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
  {{- $t := include "sglang-pd.topologyView" $ | fromYaml }}
  {{- $spec := get $t .component }}
  {{- $groups := ternary (get (default dict $spec) "instances") (get (default dict $spec) "groups") (eq .component "prefill") }}
  {{- if hasKey .cfg.pdb "minAvailable" }}
  minAvailable: {{ .cfg.pdb.minAvailable }}
  {{- else if and (eq (int $groups) 1) (not .cfg.pdb.allowLastGroupDisruption) }}
  # The only {{ .component }} group: LeaderWorkerSet recreates every pod of a group when one goes, so evicting
  # any one pod ends serving. A drain waits here until another group runs (or allowLastGroupDisruption).
  minAvailable: {{ $spec.nodes }}
  {{- else }}
  # Counted in pods, but one eviction takes its whole group down (LWS recreates it), and the group's
  # new pods count as unavailable until ready: so a voluntary disruption takes one group at a time.
  maxUnavailable: {{ .cfg.pdb.maxUnavailable }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "sglang-pd.selectorLabels" (dict "component" .component "context" $) | nindent 6 }}
{{- end }}
{{- end -}}
