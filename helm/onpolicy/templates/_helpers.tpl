{{/* Names: cut to 40 characters so that <fullname>-head-svc and friends stay within 63. */}}
{{- define "onpolicy.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "onpolicy.fullname" -}}
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

{{- define "onpolicy.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "onpolicy.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: onpolicy
{{- end -}}

{{- define "onpolicy.selectorLabels" -}}
app.kubernetes.io/name: {{ include "onpolicy.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "onpolicy.rayClusterName" -}}{{ include "onpolicy.fullname" . }}{{- end -}}

{{- define "onpolicy.rayAddress" -}}
{{- if .Values.controller.rayAddress -}}
{{- .Values.controller.rayAddress -}}
{{- else -}}
{{- printf "ray://%s-head-svc.%s.svc:%d" (include "onpolicy.rayClusterName" .) .Release.Namespace (int .Values.ray.clientPort) -}}
{{- end -}}
{{- end -}}

{{- define "onpolicy.authSecretName" -}}
{{- default (printf "%s-auth" (include "onpolicy.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{- define "onpolicy.rayAuthSecretName" -}}
{{- default (printf "%s-ray-auth" (include "onpolicy.fullname" .)) .Values.ray.auth.existingSecret -}}
{{- end -}}

{{- define "onpolicy.claimName" -}}
{{- default (printf "%s-data" (include "onpolicy.fullname" .)) .Values.storage.existingClaim -}}
{{- end -}}

{{- define "onpolicy.stateDir" -}}
{{- printf "%s/%s" (.Values.storage.mountPath | trimSuffix "/") .Values.controller.stateSubdir -}}
{{- end -}}

{{/* image reference: (dict "image" .Values.image "root" $) */}}
{{- define "onpolicy.imageRef" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) -}}
{{- end -}}

{{/* A token Secret that keeps its value across upgrades:
     (dict "root" $ "name" NAME "key" KEY "keep" BOOL) */}}
{{- define "onpolicy.tokenSecret" -}}
{{- $existing := lookup "v1" "Secret" .root.Release.Namespace .name -}}
{{- $value := "" -}}
{{- if and $existing $existing.data (hasKey $existing.data .key) -}}
{{- $value = index $existing.data .key -}}
{{- else -}}
{{- $value = randAlphaNum 48 | b64enc -}}
{{- end -}}
apiVersion: v1
kind: Secret
metadata:
  name: {{ .name }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "onpolicy.labels" .root | nindent 4 }}
  {{- if .keep }}
  annotations:
    helm.sh/resource-policy: keep
  {{- end }}
type: Opaque
data:
  {{ .key }}: {{ $value }}
{{- end -}}

{{/* Environment shared by every onpolicy container (head, workers, controller). */}}
{{- define "onpolicy.commonEnv" -}}
- name: ONPOLICY_HOME
  value: {{ .Values.onpolicyHome | quote }}
- name: HOME
  value: /tmp
{{- /* CANN's compiled-kernel caches, otherwise written under the (read-only) working directory */}}
- name: ASCEND_CACHE_PATH
  value: {{ printf "%s/ascend-cache" .Values.onpolicyHome | quote }}
- name: ASCEND_WORK_PATH
  value: {{ printf "%s/ascend-work" .Values.onpolicyHome | quote }}
- name: RAY_USAGE_STATS_ENABLED
  value: "0"
{{- if .Values.ray.auth.enabled }}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "onpolicy.rayAuthSecretName" . }}
      key: {{ .Values.ray.auth.secretKey }}
{{- else }}
- name: RAY_AUTH_MODE
  value: disabled
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The role TLS Secret (values roleTls), mounted at one path on the controller and on every Ray pod:
     the controller names the files to its roles, which read them on whatever node they run. */}}
{{- define "onpolicy.roleTlsMount" -}}
{{- if .Values.roleTls.secretName }}
- name: role-tls
  mountPath: /etc/onpolicy/role-tls
  readOnly: true
{{- end }}
{{- end -}}

{{- define "onpolicy.roleTlsVolume" -}}
{{- if .Values.roleTls.secretName }}
- name: role-tls
  secret:
    secretName: {{ .Values.roleTls.secretName }}
    items:
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
      - {key: ca.crt, path: ca.crt}
{{- end }}
{{- end -}}

{{/* Ray pod template: (dict "root" $ "group" GROUP "role" ROLE "container" NAME "ports" LIST) */}}
{{- define "onpolicy.rayPodTemplate" -}}
{{- $root := .root -}}
{{- $g := .group -}}
{{- $npus := int (default 0 $g.npus) -}}
{{- $image := ternary $root.Values.npuImage $root.Values.image (and (gt $npus 0) (ne $root.Values.npuImage.repository "")) -}}
{{- if and (gt $npus 0) $root.Values.vllmAscend.enabled -}}
{{- $image = $root.Values.vllmAscend.image -}}
{{- end -}}
metadata:
  labels:
    {{- include "onpolicy.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ .role }}
    {{- with $root.Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $root.Values.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- $podSecurity := deepCopy (default (dict) $root.Values.podSecurityContext) -}}
  {{- if and (gt $npus 0) $root.Values.npu.deviceGroups }}
  {{- $_ := set $podSecurity "supplementalGroups" $root.Values.npu.deviceGroups }}
  {{- end }}
  {{- with $podSecurity }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ .container }}
      image: {{ include "onpolicy.imageRef" (dict "image" $image "root" $root) | quote }}
      imagePullPolicy: {{ $image.pullPolicy }}
      {{- with $root.Values.securityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with .ports }}
      ports:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      env:
        {{- include "onpolicy.commonEnv" $root | nindent 8 }}
      resources:
        {{- include "onpolicy.resources" (dict "root" $root "group" $g) | trim | nindent 8 }}
      volumeMounts:
        - name: data
          mountPath: {{ $root.Values.storage.mountPath }}
        - name: onpolicy-home
          mountPath: {{ $root.Values.onpolicyHome }}
        - name: dshm
          mountPath: /dev/shm
        - name: tmp
          mountPath: /tmp
        {{- include "onpolicy.roleTlsMount" $root | nindent 8 }}
        {{- if gt $npus 0 }}
        {{- range $i, $p := $root.Values.npu.driverHostPaths }}
        - name: npu-driver-{{ $i }}
          mountPath: {{ $p }}
          readOnly: true
        {{- end }}
        {{- end }}
  volumes:
    - name: data
      persistentVolumeClaim:
        claimName: {{ include "onpolicy.claimName" $root }}
    - name: onpolicy-home
      emptyDir: {}
    - name: dshm
      emptyDir:
        medium: Memory
        {{- with $g.shmSize }}
        sizeLimit: {{ . }}
        {{- end }}
    - name: tmp
      emptyDir: {}
    {{- include "onpolicy.roleTlsVolume" $root | nindent 4 }}
    {{- if gt $npus 0 }}
    {{- range $i, $p := $root.Values.npu.driverHostPaths }}
    - name: npu-driver-{{ $i }}
      hostPath:
        path: {{ $p }}
    {{- end }}
    {{- end }}
  {{- with $g.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $g.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $g.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}

{{/* Container resources of a Ray group: its cpu/memory plus equal NPU requests and limits (the
     device plugin needs them equal; services/cluster/placement.py k8s_resources). */}}
{{- define "onpolicy.resources" -}}
{{- $g := .group -}}
{{- $npus := int (default 0 $g.npus) -}}
{{- $requests := deepCopy (default (dict) ($g.resources).requests) -}}
{{- $limits := deepCopy (default (dict) ($g.resources).limits) -}}
{{- if gt $npus 0 -}}
{{- $_ := set $requests .root.Values.npu.resourceName (toString $npus) -}}
{{- $_ := set $limits .root.Values.npu.resourceName (toString $npus) -}}
{{- end -}}
{{- if $requests }}
requests:
  {{- toYaml $requests | nindent 2 }}
{{- end }}
{{- if $limits }}
limits:
  {{- toYaml $limits | nindent 2 }}
{{- end }}
{{- if not (or $requests $limits) }}{}{{ end }}
{{- end -}}

{{/* rayStartParams of a group: the user's, plus resources '"{\"NPU\": n}"' (a JSON string quoted
     once more, as KubeRay pastes it into `ray start --resources=...`). */}}
{{- define "onpolicy.rayStartParams" -}}
{{- $g := .group -}}
{{- $npus := int (default 0 $g.npus) -}}
{{- $params := dict -}}
{{- range $k, $v := (default (dict) $g.rayStartParams) -}}
{{- $_ := set $params $k (toString $v) -}}
{{- end -}}
{{- $res := deepCopy (default (dict) $g.extraRayResources) -}}
{{- if gt $npus 0 -}}
{{- $_ := set $res .root.Values.npu.rayResource $npus -}}
{{- end -}}
{{- if $res -}}
{{- if hasKey $params "resources" -}}
{{- fail (printf "%s: set NPUs with `npus` and other Ray resources with `extraRayResources`, not rayStartParams.resources" .name) -}}
{{- end -}}
{{- $_ := set $params "resources" ($res | toJson | toJson) -}}
{{- end -}}
{{- if $params -}}
{{- range $k, $v := $params }}
{{ $k }}: {{ $v | toJson }}
{{- end }}
{{- else -}}
{}
{{- end -}}
{{- end -}}

{{/* The parallel layout (values `parallel`) the worker groups are sized for: every degree a power of
     two, a trainer that is data parallel or tensor/expert parallel (not both), and an NPU group big
     enough for it — max(tp, ep) NPUs per role, or dp for the trainer (docs/services.md); its ranks may
     span that group's pods (they meet at rank 0's node IP), except with placement strict_pack, where
     one pod holds them all. */}}
{{- define "onpolicy.checkParallel" -}}
{{- $p := .Values.parallel -}}
{{- range $role, $names := dict "rollout" (list "tp" "ep") "trainer" (list "tp" "ep" "dp") -}}
{{- $degrees := index $p $role -}}
{{- range $name := $names -}}
{{- $v := index $degrees $name -}}
{{- if not (has (int $v) (list 1 2 4 8 16 32 64 128 256 512 1024)) -}}
{{- fail (printf "parallel.%s.%s must be a power of two between 1 and 1024, got %v" $role $name $v) -}}
{{- end -}}
{{- end -}}
{{- if and (gt (int (default 1 $degrees.dp)) 1) (gt (max (int $degrees.tp) (int $degrees.ep)) 1) -}}
{{- fail (printf "parallel.%s.dp=%v cannot be combined with tp=%v, ep=%v: the trainer runs data parallel or tensor/expert parallel, not both" $role $degrees.dp $degrees.tp $degrees.ep) -}}
{{- end -}}
{{- $need := max (int $degrees.tp) (int $degrees.ep) | mul (int (default 1 $degrees.dp)) -}}
{{- $g := index $.Values.ray.workers $role -}}
{{- $has := mul (int (default 0 $g.npus)) (int $g.maxReplicas) -}}
{{- if and $g.enabled (gt (int (default 0 $g.npus)) 0) (lt $has $need) -}}
{{- fail (printf "parallel.%s needs %d NPUs (max(tp, ep) or dp) but ray.workers.%s offers %d (npus × maxReplicas)" $role $need $role $has) -}}
{{- end -}}
{{- end -}}
{{- /* strict_pack reserves all of a job's ranks on one node: one pod must hold both roles' NPUs */ -}}
{{- if eq (default "pack" $p.placement) "strict_pack" -}}
{{- $r := $p.rollout -}}
{{- $t := $p.trainer -}}
{{- $need := add (max (int $r.tp) (int $r.ep)) (max (int $t.tp) (int $t.ep) | mul (int (default 1 $t.dp))) -}}
{{- $pod := 0 -}}
{{- range $name, $g := .Values.ray.workers -}}
{{- if and $g.enabled (gt (int (default 0 $g.npus)) $pod) -}}
{{- $pod = int $g.npus -}}
{{- end -}}
{{- end -}}
{{- if and (gt $pod 0) (lt $pod $need) -}}
{{- fail (printf "parallel.placement=strict_pack puts a job's ranks on one node, but the rollout and trainer need %d NPUs and the largest worker pod offers %d" $need $pod) -}}
{{- end -}}
{{- end -}}
{{- end -}}
