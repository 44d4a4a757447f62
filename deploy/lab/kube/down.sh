#!/usr/bin/env bash
# down.sh removes the kube lab that up.sh started, in the order that leaves nothing behind
# (deploy/lab/README.md, "Clean-up"): the kubelet, the runtime's pods, the kubelet's mounts, cgroups and
# hard-coded paths, kube-apiserver and etcd (labctl kube-down), then deploy/lab's containerd and registry.
# Safe to run twice.
set -euo pipefail
KUBE_DIR=${KUBE_DIR:-/tmp/ifl-kube}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../../.." && pwd)
[[ $(id -u) == 0 ]] || { echo "down.sh: run as root" >&2; exit 1; }
[[ -d $KUBE_DIR ]] || { echo "kube lab down (nothing in $KUBE_DIR)"; exit 0; }
labctl=$KUBE_DIR/labctl
[[ -x $labctl ]] || (cd "$repo" && go build -o "$KUBE_DIR/labctl" ./integration/lab/labctl)
"$labctl" kube-down -dir "$KUBE_DIR/run"
if [[ -d $KUBE_DIR/ctrd ]]; then
	LAB_DIR=$KUBE_DIR/ctrd "$repo/deploy/lab/down.sh"
fi
rm -rf "$KUBE_DIR"
echo "kube lab down"
