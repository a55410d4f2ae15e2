{{/*
The Ray worker groups and how many workers each holds. Without roles there is one group,
rayCluster.worker, of mixed workers. With prefill/decode roles (rayCluster.roles.<role>.replicas
above 0) each role gets a group of its own: rayCluster.worker's values with the role's on top,
key by key. The mixed group then has no pods unless rayCluster.worker.replicas says so.
*/}}

{{/* Whether any role group has pods: "true" or "". */}}
{{- define "cachesvc.usesRoles" -}}
{{- $roles := .Values.rayCluster.roles | default dict -}}
{{- $pods := 0 -}}
{{- range $role := list "prefill" "decode" -}}
{{- $pods = add $pods (int ((index $roles $role | default dict).replicas | default 0)) -}}
{{- end -}}
{{- if gt (int $pods) 0 -}}true{{- end -}}
{{- end -}}

{{/*
The worker groups as YAML {groups: [...]}: each group's values resolved (replicas and the
autoscaler's bounds included), its `role`, and `rayResource`, the custom Ray resource its pods
offer (one unit per worker) so that a worker of that role lands there; "" without roles, where
nothing changes.
*/}}
{{- define "cachesvc.workerGroups" -}}
{{- $w := .Values.rayCluster.worker -}}
{{- $roles := .Values.rayCluster.roles | default dict -}}
{{- $usesRoles := include "cachesvc.usesRoles" . -}}
{{- $groups := list -}}
{{- $mixed := deepCopy $w -}}
{{- if kindIs "invalid" $mixed.replicas -}}
{{- $_ := set $mixed "replicas" (ternary 0 1 (eq $usesRoles "true")) -}}
{{- end -}}
{{- if gt (int $mixed.replicas) 0 -}}
{{- $_ := set $mixed "role" "mixed" -}}
{{- $groups = append $groups $mixed -}}
{{- end -}}
{{- range $role := list "prefill" "decode" -}}
{{- $r := index $roles $role | default dict -}}
{{- $replicas := int ($r.replicas | default 0) -}}
{{- if gt $replicas 0 -}}
{{- $g := omit (deepCopy $w) "replicas" "minReplicas" "maxReplicas" "groupName" -}}
{{- range $key, $value := $r -}}
{{- $_ := set $g $key $value -}}
{{- end -}}
{{- $_ := set $g "groupName" ($r.groupName | default $role) -}}
{{- $_ := set $g "minReplicas" (int (hasKey $r "minReplicas" | ternary $r.minReplicas $replicas)) -}}
{{- $_ := set $g "maxReplicas" (int (hasKey $r "maxReplicas" | ternary $r.maxReplicas (max $replicas $g.minReplicas))) -}}
{{- $_ := set $g "role" $role -}}
{{- $groups = append $groups $g -}}
{{- end -}}
{{- end -}}
{{- range $g := $groups -}}
{{- $_ := set $g "rayResource" (ternary (printf "cachesvc_role_%s" $g.role) "" (eq $usesRoles "true")) -}}
{{- end -}}
{{- toYaml (dict "groups" $groups) -}}
{{- end -}}

{{/* Workers of one group: one per GPU of each pod (or one per pod on CPU). */}}
{{- define "cachesvc.groupWorkers" -}}
{{- mul (int .replicas) (max 1 (int .gpus)) -}}
{{- end -}}

{{/*
How many workers of each role the router starts, as YAML {mixed: N, prefill: N, decode: N}:
the workers its groups' pods hold (config.num_workers and its siblings, when set, win).
*/}}
{{- define "cachesvc.workerCounts" -}}
{{- $counts := dict "mixed" 0 "prefill" 0 "decode" 0 -}}
{{- range $g := (include "cachesvc.workerGroups" . | fromYaml).groups -}}
{{- $_ := set $counts $g.role (int (include "cachesvc.groupWorkers" $g)) -}}
{{- end -}}
{{- toYaml $counts -}}
{{- end -}}
