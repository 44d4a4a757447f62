{{/*
Names. Every object is named after the release: with the release "imagefleet" the ServiceAccounts are
imagefleet-agent, imagefleet-central and imagefleet-operator, the names docs/install.md uses.
*/}}
{{- define "imagefleet.name" -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end }}

{{- define "imagefleet.agentSA" -}}{{ include "imagefleet.name" . }}-agent{{- end }}
{{- define "imagefleet.centralSA" -}}{{ include "imagefleet.name" . }}-central{{- end }}
{{- define "imagefleet.operatorSA" -}}{{ include "imagefleet.name" . }}-operator{{- end }}
{{- define "imagefleet.calloutSA" -}}{{ include "imagefleet.name" . }}-auth-callout{{- end }}
{{- define "imagefleet.keysSA" -}}{{ include "imagefleet.name" . }}-nats-keys{{- end }}
{{- define "imagefleet.nats" -}}{{ include "imagefleet.name" . }}-nats{{- end }}
{{- define "imagefleet.natsHeadless" -}}{{ include "imagefleet.name" . }}-nats-headless{{- end }}
{{/* The callout's Secret: made by the pre-install hook (`imagefleet bus keys`), not by Helm. */}}
{{- define "imagefleet.keysSecret" -}}{{ .Release.Name }}-nats-keys{{- end }}
{{- define "imagefleet.tlsSecret" -}}
{{- .Values.tls.existingSecret | default (printf "%s-nats-tls" (include "imagefleet.name" .)) -}}
{{- end }}

{{- define "imagefleet.labels" -}}
app.kubernetes.io/name: imagefleet
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end }}

{{/* Selector labels of one component: (list $ "agent"). */}}
{{- define "imagefleet.selector" -}}
{{- $ := index . 0 -}}
app.kubernetes.io/name: imagefleet
app.kubernetes.io/instance: {{ $.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "imagefleet.componentLabels" -}}
{{ include "imagefleet.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "imagefleet.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end }}

{{/* The URL clients connect to. */}}
{{- define "imagefleet.natsURL" -}}
{{- if .Values.nats.url -}}
{{ .Values.nats.url }}
{{- else -}}
{{ ternary "tls" "nats" .Values.tls.enabled }}://{{ include "imagefleet.nats" . }}.{{ .Release.Namespace }}.svc:{{ .Values.nats.ports.client }}
{{- end -}}
{{- end }}

{{/* Whether clients get a CA file: the chart's NATS with TLS, or an existing Secret's ca.crt. */}}
{{- define "imagefleet.clientCA" -}}
{{- if and .Values.tls.enabled (or .Values.nats.enabled .Values.tls.existingSecret) }}true{{ end -}}
{{- end }}

{{- define "imagefleet.tokenPath" -}}/var/run/secrets/imagefleet/nats/token{{- end }}

{{/*
The NATS client flags of a pod: the URL, its identity ((list $ "agent"|"central"|"operator")) and TLS.
*/}}
{{- define "imagefleet.natsArgs" -}}
{{- $ := index . 0 -}}
{{- $who := index . 1 -}}
- --nats={{ include "imagefleet.natsURL" $ }}
{{- if eq $.Values.auth.mode "callout" }}
- --token-file={{ include "imagefleet.tokenPath" $ }}
{{- else if eq $who "agent" }}
- --nkey=/etc/imagefleet/nkey/seed
{{- else if eq $who "central" }}
- --nkey=/etc/imagefleet/nkey/inventory.nk
{{- else }}
- --nkey=/etc/imagefleet/nkey/admin.nk
{{- end }}
{{- include "imagefleet.tlsArgs" $ }}
{{- end }}

{{- define "imagefleet.tlsArgs" -}}
{{- if include "imagefleet.clientCA" . }}
- --tls-ca=/etc/imagefleet/nats-ca/ca.crt
{{- end }}
{{- if and .Values.tls.enabled .Values.tls.clientSecret }}
- --tls-cert=/etc/imagefleet/nats-client/tls.crt
- --tls-key=/etc/imagefleet/nats-client/tls.key
{{- end }}
{{- end }}

{{/* The volume mounts of natsArgs (same arguments). */}}
{{- define "imagefleet.natsMounts" -}}
{{- $ := index . 0 -}}
{{- $who := index . 1 -}}
{{- if eq $.Values.auth.mode "callout" }}
- {name: nats-token, mountPath: {{ dir (include "imagefleet.tokenPath" $) }}, readOnly: true}
{{- else }}
- {name: nkey, mountPath: /etc/imagefleet/nkey, readOnly: true}
{{- end }}
{{- include "imagefleet.tlsMounts" $ }}
{{- end }}

{{- define "imagefleet.tlsMounts" -}}
{{- if include "imagefleet.clientCA" . }}
- {name: nats-ca, mountPath: /etc/imagefleet/nats-ca, readOnly: true}
{{- end }}
{{- if and .Values.tls.enabled .Values.tls.clientSecret }}
- {name: nats-client, mountPath: /etc/imagefleet/nats-client, readOnly: true}
{{- end }}
{{- end }}

{{/* The volumes of natsArgs (same arguments). */}}
{{- define "imagefleet.natsVolumes" -}}
{{- $ := index . 0 -}}
{{- $who := index . 1 -}}
{{- if eq $.Values.auth.mode "callout" }}
# The pod's NATS identity: a token of its ServiceAccount for the callout's audience, bound to the pod (and so
# to its node), renewed by the kubelet in place.
- name: nats-token
  projected:
    sources:
      - serviceAccountToken:
          audience: {{ $.Values.auth.audience }}
          expirationSeconds: {{ $.Values.auth.tokenExpirationSeconds }}
          path: {{ base (include "imagefleet.tokenPath" $) }}
{{- else if eq $who "agent" }}
- name: nkey
  hostPath: {path: {{ $.Values.auth.nkey.hostPath }}, type: Directory}
{{- else if eq $who "central" }}
- name: nkey
  secret: {secretName: {{ $.Values.auth.nkey.centralSecret }}, defaultMode: 0o440, items: [{key: inventory.nk, path: inventory.nk}]}
{{- else }}
- name: nkey
  secret: {secretName: {{ $.Values.auth.nkey.adminSecret }}, defaultMode: 0o440, items: [{key: admin.nk, path: admin.nk}]}
{{- end }}
{{- include "imagefleet.tlsVolumes" $ }}
{{- end }}

{{- define "imagefleet.tlsVolumes" -}}
{{- if include "imagefleet.clientCA" . }}
# The CA alone: the server's key stays out of client pods.
- name: nats-ca
  secret: {secretName: {{ include "imagefleet.tlsSecret" . }}, defaultMode: 0o444, items: [{key: ca.crt, path: ca.crt}]}
{{- end }}
{{- if and .Values.tls.enabled .Values.tls.clientSecret }}
- name: nats-client
  secret: {secretName: {{ .Values.tls.clientSecret }}, defaultMode: 0o440, items: [{key: tls.crt, path: tls.crt}, {key: tls.key, path: tls.key}]}
{{- end }}
{{- end }}

{{/* Pod-level settings every pod of the chart shares. */}}
{{- define "imagefleet.podCommon" -}}
{{- if .Values.hostNetwork }}
hostNetwork: true
{{- end }}
{{- $dns := .Values.dnsPolicy | default (ternary "ClusterFirstWithHostNet" "ClusterFirst" .Values.hostNetwork) }}
dnsPolicy: {{ $dns }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end }}
{{- end }}

{{/* The security context of every container: read-only root, no capabilities, no privilege escalation. */}}
{{- define "imagefleet.containerSecurity" -}}
readOnlyRootFilesystem: true
allowPrivilegeEscalation: false
capabilities: {drop: [ALL]}
{{- end }}

{{/* The pod security context of the non-root pods (the image's user, docs/image.md). */}}
{{- define "imagefleet.nonRootPod" -}}
securityContext:
  runAsNonRoot: true
  runAsUser: 65532
  runAsGroup: 65532
  fsGroup: 65532
  seccompProfile: {type: RuntimeDefault}
{{- end }}

{{/* KUBERNETES_SERVICE_HOST and _PORT for pods that talk to the API server, when kubernetesAPI is set. */}}
{{- define "imagefleet.apiEnv" -}}
{{- if .Values.kubernetesAPI.host }}
- {name: KUBERNETES_SERVICE_HOST, value: {{ .Values.kubernetesAPI.host | quote }}}
- {name: KUBERNETES_SERVICE_PORT, value: {{ .Values.kubernetesAPI.port | toString | quote }}}
{{- end }}
{{- end }}

{{/* The names the NATS server certificate carries. */}}
{{- define "imagefleet.natsDNSNames" -}}
{{- $svc := include "imagefleet.nats" . -}}
{{- $hl := include "imagefleet.natsHeadless" . -}}
{{- $ns := .Release.Namespace -}}
{{- $cd := .Values.clusterDomain -}}
{{- $names := list $svc (printf "%s.%s" $svc $ns) (printf "%s.%s.svc" $svc $ns) (printf "%s.%s.svc.%s" $svc $ns $cd) -}}
{{- $names = concat $names (list (printf "*.%s" $hl) (printf "*.%s.%s" $hl $ns) (printf "*.%s.%s.svc" $hl $ns) (printf "*.%s.%s.svc.%s" $hl $ns $cd) "localhost") -}}
{{- concat $names .Values.tls.generate.dnsNames | uniq | toJson -}}
{{- end }}

{{- define "imagefleet.natsIPs" -}}
{{- concat (list "127.0.0.1") .Values.tls.generate.ipAddresses | uniq | toJson -}}
{{- end }}

{{/* A fingerprint of the certificate's names: the certificate is made again when it changes. */}}
{{- define "imagefleet.natsSANsHash" -}}
{{- printf "%s %s %d" (include "imagefleet.natsDNSNames" .) (include "imagefleet.natsIPs" .) (int .Values.tls.generate.days) | sha256sum | trunc 16 -}}
{{- end }}

{{/*
Checks across values that the schema does not express, with messages saying what to change. Included by
every template, so no combination renders half.
*/}}
{{- define "imagefleet.validate" -}}
{{- if and (not .Values.nats.enabled) (not .Values.nats.url) -}}
{{- fail "nats.enabled is false: set nats.url to the NATS server or cluster the clients connect to" -}}
{{- end -}}
{{- if and (eq .Values.auth.mode "nkey") .Values.nats.enabled -}}
{{- fail "auth.mode nkey needs an existing NATS configured by `imagefleet bus gen-creds` (nats.enabled false, nats.url): the chart's NATS runs in auth callout mode" -}}
{{- end -}}
{{- if and .Values.kubernetesAPI.host (not .Values.kubernetesAPI.port) -}}
{{- fail "kubernetesAPI.host is set: set kubernetesAPI.port too" -}}
{{- end -}}
{{- if and .Values.hostNetwork .Values.central.enabled (eq (int .Values.central.metricsPort) (int .Values.agent.metricsPort)) -}}
{{- fail "hostNetwork: agent.metricsPort and central.metricsPort bind on the node: give them different ports" -}}
{{- end -}}
{{- if and .Values.tls.clientSecret (not .Values.tls.enabled) -}}
{{- fail "tls.clientSecret is set but tls.enabled is false" -}}
{{- end -}}
{{- end }}
