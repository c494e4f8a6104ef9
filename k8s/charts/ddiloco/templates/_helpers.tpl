{{/*
Names. The fullname is "<release>-ddiloco", or the release name alone when it already contains
the chart name; fullnameOverride replaces it.
*/}}
{{- define "ddiloco.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "ddiloco.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "ddiloco.synchronizerName" -}}
{{- printf "%s-synchronizer" (include "ddiloco.fullname" .) -}}
{{- end -}}

{{/* The identity a credential shared by every learner group proves (prefix binding). */}}
{{- define "ddiloco.learnerIdentity" -}}
{{- printf "%s-learner" (include "ddiloco.fullname" .) -}}
{{- end -}}

{{/* The StatefulSet's governing (headless) Service: per-pod DNS names <pod>.<this>.<namespace>.svc. */}}
{{- define "ddiloco.synchronizerHeadlessName" -}}
{{- printf "%s-headless" (include "ddiloco.synchronizerName" .) -}}
{{- end -}}

{{/* The number of synchronizer shards S (synchronizer.shards). */}}
{{- define "ddiloco.shards" -}}
{{- int (default 1 .Values.synchronizer.shards) -}}
{{- end -}}

{{/*
The address learners dial. One shard: the synchronizer Service's name and gRPC port. S > 1: a
pattern naming each shard's pod through the headless Service, which the learners expand for
{shard} in 0..S-1 (--synchronizer-shards S); a ClusterIP Service would spread a learner's streams
over shards that own different fragments.
*/}}
{{- define "ddiloco.synchronizerAddress" -}}
{{- if gt (int (include "ddiloco.shards" .)) 1 -}}
{{- printf "%s-{shard}.%s.%s.svc:%d" (include "ddiloco.synchronizerName" .) (include "ddiloco.synchronizerHeadlessName" .) .Release.Namespace (int .Values.synchronizer.port) -}}
{{- else -}}
{{- printf "%s:%d" (include "ddiloco.synchronizerName" .) (int .Values.synchronizer.port) -}}
{{- end -}}
{{- end -}}

{{/*
The shard count the running synchronizer StatefulSet of this release was deployed with (its pods'
`--shard ordinal/S`; 1 without that flag), or "" when there is none to look up: a first install,
or `helm template` and client-side dry runs, where lookup returns nothing.
*/}}
{{- define "ddiloco.deployedShards" -}}
{{- $sts := lookup "apps/v1" "StatefulSet" .Release.Namespace (include "ddiloco.synchronizerName" .) -}}
{{- if $sts -}}
{{- $shards := 1 -}}
{{- range $c := $sts.spec.template.spec.containers -}}
{{- if eq $c.name "synchronizer" -}}
{{- $next := false -}}
{{- range $arg := (default list $c.args) -}}
{{- if $next -}}
{{- $shards = int (last (splitList "/" (toString $arg))) -}}
{{- end -}}
{{- $next = eq (toString $arg) "--shard" -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $shards -}}
{{- end -}}
{{- end -}}

{{- define "ddiloco.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels of every resource. */}}
{{- define "ddiloco.labels" -}}
helm.sh/chart: {{ include "ddiloco.chart" . }}
{{ include "ddiloco.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: ddiloco
{{- end -}}

{{/* Labels selectors use: k8s/chaos relies on these names exactly. */}}
{{- define "ddiloco.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ddiloco.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "ddiloco.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "ddiloco.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* An image reference: (list $ repository tag). */}}
{{- define "ddiloco.image" -}}
{{- $root := index . 0 -}}
{{- $repository := index . 1 -}}
{{- $tag := default (default $root.Chart.AppVersion $root.Values.image.tag) (index . 2) -}}
{{- if $root.Values.image.registry -}}
{{- printf "%s/%s:%s" (trimSuffix "/" $root.Values.image.registry) $repository $tag -}}
{{- else -}}
{{- printf "%s:%s" $repository $tag -}}
{{- end -}}
{{- end -}}

{{/* Whether the synchronizer authenticates learners by token. */}}
{{- define "ddiloco.tokensOn" -}}
{{- if .Values.auth.tokens.existingSecret -}}true{{- end -}}
{{- end -}}

{{/* Whether learners present client certificates (mutual TLS). */}}
{{- define "ddiloco.mutualOn" -}}
{{- if and .Values.tls.enabled .Values.tls.mutual -}}true{{- end -}}
{{- end -}}

{{/* The identity_binding the synchronizer gets ("" when none is written). */}}
{{- define "ddiloco.identityBinding" -}}
{{- if .Values.auth.identityBinding -}}
{{- .Values.auth.identityBinding -}}
{{- else if or (include "ddiloco.tokensOn" .) (include "ddiloco.mutualOn" .) -}}
prefix
{{- end -}}
{{- end -}}

{{/* A learner group's token Secret ("" for none): (list $ group). */}}
{{- define "ddiloco.groupTokenSecret" -}}
{{- $root := index . 0 -}}
{{- $group := index . 1 -}}
{{- default $root.Values.auth.learners.existingSecret $group.tokenSecret -}}
{{- end -}}

{{/* A learner group's client-certificate Secret ("" for none): (list $ group). */}}
{{- define "ddiloco.groupTlsSecret" -}}
{{- $root := index . 0 -}}
{{- $group := index . 1 -}}
{{- default $root.Values.tls.learnerSecret $group.tlsSecret -}}
{{- end -}}

{{/* Mount points inside the pods. */}}
{{- define "ddiloco.configDir" -}}/etc/ddiloco{{- end -}}
{{- define "ddiloco.tokensDir" -}}/etc/ddiloco/tokens{{- end -}}
{{- define "ddiloco.tokenDir" -}}/etc/ddiloco/token{{- end -}}
{{- define "ddiloco.tlsDir" -}}/etc/ddiloco/tls{{- end -}}

{{/*
The config file: the free-form `config` value, with what the chart owns added: metrics ports and
hosts, the identity binding, and the paths of the token and TLS files mounted from Secrets.
*/}}
{{- define "ddiloco.configDocument" -}}
{{- $doc := deepCopy (default dict .Values.config) -}}
{{- $sync := deepCopy (default dict (get $doc "synchronizer")) -}}
{{- $learner := deepCopy (default dict (get $doc "learner")) -}}
{{- $_ := set $sync "metrics_port" (int .Values.synchronizer.metricsPort) -}}
{{- $_ := set $sync "metrics_host" "0.0.0.0" -}}
{{- $_ := set $learner "metrics_port" (int .Values.learners.metricsPort) -}}
{{- $_ := set $learner "metrics_host" "0.0.0.0" -}}
{{- $binding := include "ddiloco.identityBinding" . -}}
{{- if $binding -}}
{{- $_ := set $sync "identity_binding" $binding -}}
{{- end -}}
{{- if include "ddiloco.tokensOn" . -}}
{{- $_ := set $sync "auth_tokens_file" (printf "%s/tokens.yaml" (include "ddiloco.tokensDir" .)) -}}
{{- $_ := set $learner "token_file" (printf "%s/token" (include "ddiloco.tokenDir" .)) -}}
{{- end -}}
{{- if .Values.tls.enabled -}}
{{- $tls := include "ddiloco.tlsDir" . -}}
{{- $_ := set $sync "tls_cert" (printf "%s/tls.crt" $tls) -}}
{{- $_ := set $sync "tls_key" (printf "%s/tls.key" $tls) -}}
{{- $_ := set $learner "tls_ca" (printf "%s/ca.crt" $tls) -}}
{{- if .Values.tls.mutual -}}
{{- $_ := set $sync "tls_client_ca" (printf "%s/ca.crt" $tls) -}}
{{- $_ := set $learner "tls_cert" (printf "%s/tls.crt" $tls) -}}
{{- $_ := set $learner "tls_key" (printf "%s/tls.key" $tls) -}}
{{- end -}}
{{- end -}}
{{- $_ := set $doc "synchronizer" $sync -}}
{{- $_ := set $doc "learner" $learner -}}
{{- toYaml $doc -}}
{{- end -}}

{{/*
Refuses contradictory values with a message that says what to change. configmap.yaml (always
rendered) includes it, so `helm template`, `helm install`, `helm upgrade` and `helm lint` all check.
*/}}
{{- define "ddiloco.validate" -}}
{{- $v := .Values -}}
{{- $fullname := include "ddiloco.fullname" . -}}
{{- if ne (int $v.synchronizer.replicas) 1 -}}
{{- fail (printf "synchronizer.replicas must be 1, got %v: the synchronizer holds the only durable copy of the model, and two replicas would each own it (learners ride out its restarts)" $v.synchronizer.replicas) -}}
{{- end -}}
{{- /* shards: fixed for a fleet's life, and each one owning at least one fragment */ -}}
{{- $shards := int (include "ddiloco.shards" .) -}}
{{- $deployed := include "ddiloco.deployedShards" . -}}
{{- if and $deployed (ne (int $deployed) $shards) -}}
{{- fail (printf "synchronizer.shards is %d, but the running StatefulSet %s-synchronizer was deployed with %s shard(s): the shard count is fixed for a fleet's life (each shard's state holds only the fragments p %% S it owned, and nothing moves fragments between shards). Keep synchronizer.shards: %s; a new shard count is a new run: a new release, or uninstall and delete every state-%s-synchronizer-N claim first" $shards $fullname $deployed $deployed $fullname) -}}
{{- end -}}
{{- $protocolValues := default dict (get (default dict $v.config) "protocol") -}}
{{- if gt $shards 1 -}}
{{- $fragments := 0 -}}
{{- $source := "" -}}
{{- if eq (toString (default "decoupled" (get $protocolValues "mode"))) "diloco" -}}
{{- $fragments = 1 -}}
{{- $source = "config.protocol.mode diloco: one fragment" -}}
{{- else if hasKey $protocolValues "num_fragments" -}}
{{- $fragments = int (get $protocolValues "num_fragments") -}}
{{- $source = "config.protocol.num_fragments" -}}
{{- end -}}
{{- if and (gt $fragments 0) (lt $fragments $shards) -}}
{{- fail (printf "synchronizer.shards is %d but the model has only %d fragment(s) (%s): shard s owns the fragments p with p %% S == s, so %d shard(s) would own nothing. Use at most %d shard(s), or more fragments" $shards $fragments $source (sub $shards $fragments) $fragments) -}}
{{- end -}}
{{- end -}}
{{- if gt (len (printf "%s-synchronizer" $fullname)) 52 -}}
{{- fail (printf "the name prefix %q is too long: \"<fullname>-synchronizer\" must fit the 52 characters of a StatefulSet name; shorten the release name or set fullnameOverride" $fullname) -}}
{{- end -}}
{{- if eq (int $v.synchronizer.metricsPort) (int $v.synchronizer.port) -}}
{{- fail (printf "synchronizer.metricsPort %d collides with the gRPC port synchronizer.port; use another port (default 9100)" (int $v.synchronizer.metricsPort)) -}}
{{- end -}}
{{- if eq (int $v.learners.metricsPort) (int $v.synchronizer.port) -}}
{{- fail (printf "learners.metricsPort %d collides with the synchronizer's gRPC port synchronizer.port; use another port (default 9101)" (int $v.learners.metricsPort)) -}}
{{- end -}}
{{- if and $v.tls.enabled (not $v.tls.existingSecret) -}}
{{- fail "tls.enabled needs tls.existingSecret: a Secret with ca.crt, tls.crt and tls.key (see k8s/README.md, \"TLS\")" -}}
{{- end -}}
{{- if and $v.tls.mutual (not $v.tls.enabled) -}}
{{- fail "tls.mutual needs tls.enabled (mutual TLS is TLS with client certificates)" -}}
{{- end -}}
{{- $credentials := or (include "ddiloco.tokensOn" .) (include "ddiloco.mutualOn" .) -}}
{{- if and (eq $v.auth.identityBinding "prefix") (not $credentials) -}}
{{- fail "auth.identityBinding prefix needs credentials to bind: set auth.tokens.existingSecret (a Secret with tokens.yaml) or tls.mutual" -}}
{{- end -}}
{{- if and (eq $v.auth.identityBinding "exact") $credentials -}}
{{- fail "auth.identityBinding exact cannot work with learner Deployments: their pod names (the learner ids) end in a generated suffix, so no credential can name them exactly; use prefix (or leave it empty)" -}}
{{- end -}}
{{- if and $v.auth.learners.existingSecret (not (include "ddiloco.tokensOn" .)) -}}
{{- fail "auth.learners.existingSecret is set but auth.tokens.existingSecret is not: the synchronizer would not check the learners' tokens; set both (or neither)" -}}
{{- end -}}
{{- if and $v.tls.learnerSecret (not (include "ddiloco.mutualOn" .)) -}}
{{- fail "tls.learnerSecret (a client certificate) needs tls.enabled and tls.mutual" -}}
{{- end -}}
{{- /* the config value: sections the services read, no keys the chart owns, no inline tokens */ -}}
{{- $config := default dict $v.config -}}
{{- $owned := dict "synchronizer" (list "listen" "state_dir" "shard_index" "shard_count" "metrics_port" "metrics_host" "identity_binding" "auth_tokens_file" "tls_cert" "tls_key" "tls_client_ca") "learner" (list "synchronizer" "synchronizer_shards" "learner_id" "metrics_port" "metrics_host" "token_file" "tls_ca" "tls_cert" "tls_key") -}}
{{- $where := dict "listen" "synchronizer.port" "state_dir" "synchronizer.persistence" "metrics_port" "synchronizer.metricsPort / learners.metricsPort" "metrics_host" "nothing (the chart binds 0.0.0.0)" "identity_binding" "auth.identityBinding" "auth_tokens_file" "auth.tokens.existingSecret" "tls_cert" "tls.existingSecret / tls.learnerSecret" "tls_key" "tls.existingSecret / tls.learnerSecret" "tls_client_ca" "tls.mutual" "tls_ca" "tls.enabled" "shard_index" "synchronizer.shards (each pod takes its shard from its ordinal)" "shard_count" "synchronizer.shards" "synchronizer_shards" "synchronizer.shards" "synchronizer" "nothing (learners dial the synchronizer Service, or its shards)" "learner_id" "nothing (each learner's id is its pod name)" "token_file" "auth.learners.existingSecret / learners.groups[].tokenSecret" -}}
{{- range $section, $keys := $owned -}}
{{- $s := get $config $section -}}
{{- if kindIs "map" $s -}}
{{- range $key := $keys -}}
{{- if hasKey $s $key -}}
{{- fail (printf "config.%s.%s is set by the chart; set it through %s instead" $section $key (get $where $key)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and (kindIs "map" (get $config "synchronizer")) (hasKey (get $config "synchronizer") "auth_tokens") -}}
{{- fail "config.synchronizer.auth_tokens would put tokens in a ConfigMap; put them in a Secret and set auth.tokens.existingSecret" -}}
{{- end -}}
{{- if and (kindIs "map" (get $config "learner")) (hasKey (get $config "learner") "token") -}}
{{- fail "config.learner.token would put a token in a ConfigMap; put it in a Secret and set auth.learners.existingSecret or learners.groups[].tokenSecret" -}}
{{- end -}}
{{- /* learner groups */ -}}
{{- $names := dict -}}
{{- $total := 0 -}}
{{- range $i, $g := $v.learners.groups -}}
{{- if hasKey $names $g.name -}}
{{- fail (printf "learners.groups: the name %q is used twice; each group is its own Deployment \"<fullname>-learner-<name>\", so names must be unique" $g.name) -}}
{{- end -}}
{{- $_ := set $names $g.name true -}}
{{- if lt (int $g.replicas) 0 -}}
{{- fail (printf "learners.groups[%d] (%s): replicas must be >= 0, got %v" $i $g.name $g.replicas) -}}
{{- end -}}
{{- $total = add $total (int $g.replicas) -}}
{{- $deployment := printf "%s-learner-%s" $fullname $g.name -}}
{{- if gt (len $deployment) 46 -}}
{{- fail (printf "learners.groups[%d]: the Deployment name %q has %d characters; at most 46 keep its pod names (the learner ids) starting with it, which identities rely on. Shorten the group name or the release name" $i $deployment (len $deployment)) -}}
{{- end -}}
{{- if and (include "ddiloco.tokensOn" $) (not (include "ddiloco.groupTokenSecret" (list $ $g))) -}}
{{- fail (printf "learners.groups[%d] (%s) has no token: with auth.tokens.existingSecret set, every learner needs one; set its tokenSecret or auth.learners.existingSecret" $i $g.name) -}}
{{- end -}}
{{- if and $g.tokenSecret (not (include "ddiloco.tokensOn" $)) -}}
{{- fail (printf "learners.groups[%d] (%s) has a tokenSecret but auth.tokens.existingSecret is not set: the synchronizer would not check it" $i $g.name) -}}
{{- end -}}
{{- if and (include "ddiloco.mutualOn" $) (not (include "ddiloco.groupTlsSecret" (list $ $g))) -}}
{{- fail (printf "learners.groups[%d] (%s) has no client certificate: with tls.mutual every learner needs one; set its tlsSecret or tls.learnerSecret" $i $g.name) -}}
{{- end -}}
{{- if and $g.tlsSecret (not (include "ddiloco.mutualOn" $)) -}}
{{- fail (printf "learners.groups[%d] (%s) has a tlsSecret (a client certificate), which needs tls.enabled and tls.mutual" $i $g.name) -}}
{{- end -}}
{{- if lt (int (default 0 $g.gpu)) 0 -}}
{{- fail (printf "learners.groups[%d] (%s): gpu must be >= 0, got %v" $i $g.name $g.gpu) -}}
{{- end -}}
{{- end -}}
{{- /* a fixed quorum the learners given here can never reach */ -}}
{{- $protocol := default dict (get $config "protocol") -}}
{{- $mode := default "decoupled" (get $protocol "mode") -}}
{{- $policy := default dict (get (default dict (get $config "synchronizer")) "policy") -}}
{{- if and (eq $mode "decoupled") (hasKey $policy "quorum") (gt $total 0) -}}
{{- if gt (int (get $policy "quorum")) $total -}}
{{- fail (printf "config.synchronizer.policy.quorum is %v but learners.groups have %d replicas in all: no merge could ever happen. Lower the quorum or add learners" (get $policy "quorum") $total) -}}
{{- end -}}
{{- end -}}
{{- end -}}
