#!/usr/bin/env bash
# up.sh starts the operator's kube lab: etcd 3.7 and kube-apiserver v1.37.2 on free loopback ports, and (unless
# KUBE_KUBELET=0) deploy/lab's containerd with a kubelet v1.37.2 registered as node-1, to try imagefleet beside
# a kubelet. It builds the binaries first when needed (build.sh: 6 to 12 minutes the first time). Run as root
# from anywhere in the repository; down.sh removes every trace. See deploy/lab/README.md.
set -euo pipefail

KUBE_DIR=${KUBE_DIR:-/tmp/ifl-kube}   # everything of the kube lab; short (the Pods API socket path is under it)
KUBE_KUBELET=${KUBE_KUBELET:-1}       # 0: control plane only
KUBE_NODES=${KUBE_NODES:-node-1}      # node identities with a token; the kubelet registers the first
KUBE_CONTROLLERS=${KUBE_CONTROLLERS:-1} # 0: no kube-controller-manager and kube-scheduler

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../../.." && pwd)
die() { echo "up.sh: $*" >&2; exit 1; }

[[ $(id -u) == 0 ]] || die "run as root: the kubelet mounts volumes and makes cgroups"
[[ -n $KUBE_DIR && $KUBE_DIR == /* && ${#KUBE_DIR} -lt 60 ]] || die "KUBE_DIR must be an absolute path under 60 characters"
[[ -e $KUBE_DIR/run/state.json ]] && die "a kube lab already lives in $KUBE_DIR: run $here/down.sh first"

bin=$("$here/build.sh")
mkdir -p "$KUBE_DIR"
(cd "$repo" && go build -o "$KUBE_DIR/labctl" ./integration/lab/labctl)
args=(-dir "$KUBE_DIR/run" -bin "$bin" -nodes "$KUBE_NODES")
if [[ $KUBE_KUBELET != 0 ]]; then
	LAB_DIR=$KUBE_DIR/ctrd "$repo/deploy/lab/up.sh" >/dev/null
	args+=(-cri "unix://$KUBE_DIR/ctrd/containerd.sock" -cni-dir "$KUBE_DIR/ctrd/cni")
	[[ $KUBE_CONTROLLERS != 0 ]] && args+=(-controllers)
fi
if ! "$KUBE_DIR/labctl" kube-up "${args[@]}"; then
	"$here/down.sh" || true
	die "the kube lab did not come up (logs were in $KUBE_DIR/run)"
fi
cat <<EOT
  images      $KUBE_DIR/ctrd/labctl push -registry 127.0.0.1:5000 -busybox lab/app:1
  agent       imagefleet agent --node node-1 --cri unix://$KUBE_DIR/ctrd/containerd.sock \\
                --pod-source kubelet --kubelet-pods-socket $KUBE_DIR/run/kubelet/pods-api/pods-api.sock
              (or --pod-source apiserver --kubeconfig $KUBE_DIR/run/node-1.kubeconfig)
  stop        $here/down.sh
EOT
