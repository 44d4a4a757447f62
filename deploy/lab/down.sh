#!/usr/bin/env bash
# down.sh stops the lab that up.sh started and removes every trace of it: its pods and their shims,
# containerd, the registry (and the images pushed to it), the tmpfs and the lab directory. It touches only
# processes whose pid files or command lines point into LAB_DIR. Safe to run twice.
set -euo pipefail

LAB_DIR=${LAB_DIR:-/tmp/ifl-lab}

die() { echo "down.sh: $*" >&2; exit 1; }
# pid_alive PID: the process runs (a zombie, which init has yet to reap, does not count).
pid_alive() {
	local stat
	stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
	stat=${stat##*) }
	[[ ${stat:0:1} != Z ]]
}
# alive FILE: the pid in FILE runs and is the lab's (its command line names LAB_DIR: a pid file that
# outlived its process may name a reused pid).
alive() {
	[[ -f $1 ]] || return 1
	local pid
	pid=$(cat "$1")
	pid_alive "$pid" && tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" | grep -qF "$LAB_DIR/"
}

# stop_pid FILE: SIGTERM, up to 15 s to exit, then SIGKILL.
stop_pid() {
	alive "$1" || return 0
	local pid i
	pid=$(cat "$1")
	kill -TERM "$pid" 2>/dev/null || return 0
	for ((i = 0; i < 150; i++)); do
		pid_alive "$pid" || return 0
		sleep 0.1
	done
	echo "down.sh: pid $pid ignored SIGTERM for 15s; killing it" >&2
	kill -KILL "$pid" 2>/dev/null || true
}

[[ $(id -u) == 0 ]] || die "run as root"
[[ -n $LAB_DIR && $LAB_DIR == /* && $LAB_DIR != / ]] || die "LAB_DIR must be an absolute path other than /"
if [[ ! -d $LAB_DIR ]]; then
	echo "down.sh: no lab in $LAB_DIR"
	exit 0
fi
sock=$LAB_DIR/containerd.sock

# Pods first, through CRI, so containerd stops their containers and shims in order.
if alive "$LAB_DIR/containerd.pid" && [[ -x $LAB_DIR/labctl ]]; then
	"$LAB_DIR/labctl" rm-pods -cri "unix://$sock" || echo "down.sh: removing pods failed; forcing" >&2
fi
stop_pid "$LAB_DIR/containerd.pid"

# What a crashed containerd leaves: containers in the lab's runc root, and shims of the lab's containerd
# (found by the -address on their command line).
for ns in "$LAB_DIR"/runc/*/; do
	[[ -d $ns ]] || continue
	for id in $(runc --root "$ns" list -q 2>/dev/null); do
		runc --root "$ns" delete --force "$id" || true
	done
done
# A killed shim leaves its socket in /run/containerd/s; its bundle's address file says which.
# (The address files end without a newline, so each is read on its own.)
shim_sockets=()
for f in "$LAB_DIR"/state/io.containerd.runtime.v2.task/*/*/address; do
	if [[ -f $f ]]; then shim_sockets+=("$(<"$f")"); fi
done
for proc in /proc/[0-9]*; do
	cmdline=$(tr '\0' ' ' 2>/dev/null <"$proc/cmdline") || continue
	case $cmdline in
	*containerd-shim*" -address $sock "*) kill -KILL "${proc#/proc/}" 2>/dev/null || true ;;
	esac
done

for addr in "${shim_sockets[@]}"; do
	addr=${addr#unix://}
	[[ $addr == /run/containerd/s/* ]] && rm -f "$addr"
done

stop_pid "$LAB_DIR/registry.pid"

# Unmount everything under LAB_DIR (container rootfs, sandbox shm, the tmpfs), deepest first.
mounts() { awk -v d="$LAB_DIR" '$5 == d || index($5, d "/") == 1 { print $5 }' /proc/self/mountinfo | sort -r; }
for ((i = 0; i < 5; i++)); do
	m=$(mounts)
	[[ -z $m ]] && break
	while read -r mp; do umount "$mp" 2>/dev/null || umount -l "$mp" 2>/dev/null || true; done <<<"$m"
done
[[ -z $(mounts) ]] || die "still mounted under $LAB_DIR: $(mounts | tr '\n' ' '); not removing it"
rm -rf "$LAB_DIR"
echo "down.sh: lab in $LAB_DIR removed"
