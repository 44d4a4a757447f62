#!/usr/bin/env bash
# build.sh builds kube-apiserver, kube-controller-manager, kube-scheduler, kubelet (v1.37.2) and etcd (3.7.0)
# from the wrapper module in tools/ (its go.mod's tool block lists them) into a cache directory keyed by what
# decides the binaries: the wrapper's go.mod and go.sum, the link flags and the Go version. A key already built
# is reused at once; a new key costs a build: 6 to 12 minutes on a fresh machine (2 cores, about 3 GB of
# GOCACHE), a minute or two of linking when only the key's directory is new. A key directory that lacks some
# of the binaries gets only those built into it.
#
# It prints the directory holding the binaries. integration/kubelab computes the same key (kubelab.BinDir)
# and finds them there; IMAGEFLEET_KUBE_BIN overrides both.
#
#   deploy/lab/kube/build.sh            # prints /var/cache/imagefleet/kube/<key>
#   IMAGEFLEET_KUBE_CACHE=/some/dir deploy/lab/kube/build.sh
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
tools=$here/tools
cache=${IMAGEFLEET_KUBE_CACHE:-/var/cache/imagefleet/kube}

# The version ldflags only change the link step; without them /version says v0.0.0-master (deploy/lab/README.md).
ldflags=$(<"$tools/ldflags")
goversion=$(go env GOVERSION)
# The key: keep in step with kubelab.Key (integration/kubelab/bin.go).
key=$({ cat "$tools/go.mod" "$tools/go.sum" "$tools/ldflags"; printf '%s\n' "$goversion"; } | sha256sum | cut -c1-16)
dir=$cache/$key
# Keep in step with kubelab.Binaries (integration/kubelab/bin.go).
bins=(kube-apiserver kube-controller-manager kube-scheduler kubelet etcd)

complete() {
	local b
	for b in "${bins[@]}"; do
		[[ -x $1/$b ]] || return 1
	done
}

if complete "$dir"; then
	echo "$dir"
	exit 0
fi

mkdir -p "$cache"
# One build at a time per cache (a second caller waits, then finds the key built).
exec 9>"$cache/.lock"
flock 9
if complete "$dir"; then
	echo "$dir"
	exit 0
fi

missing=()
for b in "${bins[@]}"; do
	[[ -x $dir/$b ]] || missing+=("$b")
done
kube=()
for b in "${missing[@]}"; do
	[[ $b == etcd ]] || kube+=("k8s.io/kubernetes/cmd/$b")
done

tmp=$(mktemp -d "$cache/.build-$key-XXXXXX")
trap 'rm -rf "$tmp"' EXIT
start=$SECONDS
echo "kube build: building ${missing[*]} for key $key (a cold build takes 6 to 12 minutes)" >&2
cd "$tools"
# -mod=readonly: the build must never change the wrapper's go.mod or go.sum (that would change the key).
if ((${#kube[@]} > 0)); then
	go build -mod=readonly -ldflags "$ldflags" -o "$tmp/" "${kube[@]}" >&2
fi
if [[ ! -x $dir/etcd ]]; then
	# etcd's main package is its server module's root; it does not read the Kubernetes version variables.
	go build -mod=readonly -ldflags "-s -w" -o "$tmp/etcd" go.etcd.io/etcd/server/v3 >&2
fi
for b in "${missing[@]}"; do
	case $b in
	etcd) "$tmp/etcd" --version | head -n 1 >&2 ;;
	*) "$tmp/$b" --version >&2 ;;
	esac
done
printf 'key=%s\ngo=%s\nldflags=%s\nbuilt=%s %s\n' "$key" "$goversion" "$ldflags" "$(date -u +%FT%TZ)" "${missing[*]}" >"$tmp/BUILD"
if [[ -d $dir ]]; then
	# An older build of this key (fewer binaries): add the missing ones, each by an atomic rename, so a reader
	# never sees a half-written binary, and record the addition.
	for b in "${missing[@]}"; do
		mv "$tmp/$b" "$dir/$b"
	done
	grep "^built=" "$tmp/BUILD" >>"$dir/BUILD"
	rm -rf "$tmp"
else
	chmod 0755 "$tmp"
	mv -T "$tmp" "$dir"
fi
trap - EXIT
echo "kube build: done in $((SECONDS - start)) s" >&2
echo "$dir"
