#!/usr/bin/env bash
# scripts/testdeps.sh sets up what the integration tier needs, as the first step of `go tool task test`:
# on Debian as root it installs the runtime tier (containerd, runc, busybox-static, docker-registry; gcc for
# -race) when missing, clears what an earlier, killed test run left (kube lab and containerd lab directories,
# their processes and mounts), and builds the kube lab's binaries into their cache (deploy/lab/README.md).
# Without root it stops at once, naming what is missing: the integration tests need root and fail, never
# skip, without their real parts.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export DEBIAN_FRONTEND=noninteractive

# gcc and libc6-dev: the unit tests also run under -race, which needs cgo.
packages=(containerd runc busybox-static docker-registry ca-certificates gcc libc6-dev)

missing=()
for pkg in "${packages[@]}"; do
	if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed'; then
		missing+=("$pkg")
	fi
done
if ((EUID != 0)); then
	echo "testdeps: the integration tests run containerd, runc, a registry and a kubelet, and need root" >&2
	if ((${#missing[@]} > 0)); then
		echo "testdeps: missing packages: ${missing[*]} (as root this installs them)" >&2
	fi
	exit 1
fi
if ((${#missing[@]} > 0)); then
	if ! command -v apt-get >/dev/null; then
		echo "testdeps: missing ${missing[*]}, and no apt-get to install them: install them by hand (deploy/lab/README.md)" >&2
		exit 1
	fi
	echo "testdeps: installing ${missing[*]}"
	# Debian starts a package's service on install; the tests run their own containerd and registry, and a
	# system docker-registry would hold 127.0.0.1:5000, which deploy/lab wants. A policy-rc.d answering 101
	# keeps services down during the install (only when the machine has none of its own).
	policy=/usr/sbin/policy-rc.d
	own_policy=
	if [[ ! -e $policy ]]; then
		printf '#!/bin/sh\nexit 101\n' >"$policy"
		chmod +x "$policy"
		own_policy=1
	fi
	log=$(mktemp)
	if ! { apt-get update -qq && apt-get install -y -qq "${packages[@]}"; } >"$log" 2>&1 </dev/null; then
		[[ -n $own_policy ]] && rm -f "$policy"
		echo "testdeps: apt-get failed:" >&2
		tail -n 40 "$log" >&2
		exit 1
	fi
	[[ -n $own_policy ]] && rm -f "$policy"
	rm -f "$log"
fi

# A killed kube lab (integration/kubelab, /tmp/ifl-k-*: kubelab.DirPrefix) leaves etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler and a kubelet, the kubelet's mounts (local volumes' included),
# kubepods cgroups, /var/log/containers links and device-plugin socket. Clean it first, in the order of
# deploy/lab/README.md: the kubelet before its runtime (the ifl-t-* block below), processes by pid (found
# by a command line pointing into such a directory), then mounts deepest first.
shopt -s nullglob
kube_leftovers=(/tmp/ifl-k-*)
if ((${#kube_leftovers[@]} > 0)); then
	echo "testdeps: removing ${#kube_leftovers[@]} leftover kube lab dir(s) of an earlier run"
	for name in kube-scheduler kube-controller-manager kubelet kube-apiserver etcd; do
		for proc in /proc/[0-9]*; do
			cmdline=$(tr '\0' ' ' 2>/dev/null <"$proc/cmdline") || continue
			case $cmdline in
			*/$name" "*/tmp/ifl-k-*) kill -KILL "${proc#/proc/}" 2>/dev/null || true ;;
			esac
		done
	done
	sleep 0.5
	awk '$5 ~ "^/tmp/ifl-k-" { print $5 }' /proc/self/mountinfo | sort -r | while read -r mp; do
		umount "$mp" 2>/dev/null || umount -l "$mp" 2>/dev/null || true
	done
	for dir in "${kube_leftovers[@]}"; do
		find /var/log/containers -maxdepth 1 -lname "$dir/*" -delete 2>/dev/null || true
	done
	rm -f /var/lib/kubelet/device-plugins/kubelet.sock
	rmdir /var/lib/kubelet/device-plugins /var/lib/kubelet /var/log/containers 2>/dev/null || true
fi
shopt -u nullglob

# An earlier test binary killed before its cleanup ran (a CI timeout, say) leaves containerd processes, runc
# containers, shims and tmpfs mounts under /tmp/ifl-t-* (integration/lab.TestDirPrefix). Remove exactly
# those: processes are found by a command line pointing into such a directory and ended by pid.
shopt -s nullglob
leftovers=(/tmp/ifl-t-*)
if ((${#leftovers[@]} > 0)); then
	echo "testdeps: removing ${#leftovers[@]} leftover lab dir(s) of an earlier run"
	for dir in "${leftovers[@]}"; do
		for ns in "$dir"/runc/*/; do
			for id in $(runc --root "$ns" list -q 2>/dev/null); do
				runc --root "$ns" delete --force "$id" >/dev/null 2>&1 || true
			done
		done
		# A killed shim leaves its socket in /run/containerd/s; its bundle's address file names it.
		for f in "$dir"/state/io.containerd.runtime.v2.task/*/*/address; do
			addr=$(<"$f")
			addr=${addr#unix://}
			[[ $addr == /run/containerd/s/* ]] && rm -f "$addr"
		done
		for proc in /proc/[0-9]*; do
			cmdline=$(tr '\0' ' ' 2>/dev/null <"$proc/cmdline") || continue
			case $cmdline in
			"containerd --config $dir/"* | *containerd-shim*" -address $dir/"*) kill -KILL "${proc#/proc/}" 2>/dev/null || true ;;
			esac
		done
	done
	# Give the killed processes a moment to release their mounts before unmounting (lazily if still busy).
	for ((i = 0; i < 50; i++)); do
		busy=0
		for proc in /proc/[0-9]*; do
			cmdline=$(tr '\0' ' ' 2>/dev/null <"$proc/cmdline") || continue
			[[ $cmdline == *" /tmp/ifl-t-"* ]] && busy=1 && break
		done
		((busy)) || break
		sleep 0.1
	done
	awk '$5 ~ "^/tmp/ifl-t-" { print $5 }' /proc/self/mountinfo | sort -r | while read -r mp; do
		umount "$mp" 2>/dev/null || umount -l "$mp" 2>/dev/null || true
	done
	for dir in "${leftovers[@]}"; do
		if awk -v d="$dir" '$5 == d || index($5, d "/") == 1 { found = 1 } END { exit !found }' /proc/self/mountinfo; then
			echo "testdeps: $dir is still mounted; leaving it" >&2
		else
			rm -rf "$dir"
		fi
	done
fi
shopt -u nullglob
# The kube lab's directories, once the pods of their kubelet are gone with the containerds above; then the
# kubelet's empty kubepods cgroups (rmdir only: one still holding a process stays).
shopt -s nullglob
for dir in /tmp/ifl-k-*; do
	if awk -v d="$dir" '$5 == d || index($5, d "/") == 1 { found = 1 } END { exit !found }' /proc/self/mountinfo; then
		echo "testdeps: $dir is still mounted; leaving it" >&2
	else
		rm -rf "$dir"
	fi
done
shopt -u nullglob
for top in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/kubepods; do
	[[ -d $top ]] && find "$top" -depth -type d -exec rmdir {} + 2>/dev/null || true
done

# kube-apiserver, kube-controller-manager, kube-scheduler, kubelet and etcd for the kube tests
# (integration/kubelab), built from the module proxy into a cache keyed by deploy/lab/kube/tools' go.mod,
# go.sum and link flags: 6 to 12 minutes on a fresh machine, seconds when the key is already built.
kube_start=$SECONDS
IMAGEFLEET_KUBE_BIN=$(deploy/lab/kube/build.sh)
export IMAGEFLEET_KUBE_BIN
echo "testdeps: kube lab binaries in $IMAGEFLEET_KUBE_BIN ($((SECONDS - kube_start)) s): $("$IMAGEFLEET_KUBE_BIN/kube-apiserver" --version), $("$IMAGEFLEET_KUBE_BIN/etcd" --version | head -n 1)"

echo "testdeps: $(go version)"
echo "testdeps: $(containerd --version)"
echo "testdeps: $(runc --version | head -n 1)"
echo "testdeps: $(busybox 2>&1 | head -n 1)"
echo "testdeps: $(docker-registry --version 2>&1 | head -n 1)"
