#!/usr/bin/env bash
# up.sh starts the operator's local lab: Debian's docker-registry on 127.0.0.1:5000 with a pause image in it,
# and a private containerd whose root (the image filesystem) is a small tmpfs, beside any system containerd.
# Run it as root from anywhere in the repository; deploy/lab/down.sh removes every trace. See README.md.
set -euo pipefail

LAB_DIR=${LAB_DIR:-/tmp/ifl-lab}                   # everything of the lab; short, for unix socket paths
LAB_TMPFS_SIZE=${LAB_TMPFS_SIZE:-256m}             # size of the image filesystem (mount's size= syntax)
LAB_REGISTRY=${LAB_REGISTRY:-127.0.0.1:5000}       # the registry's address (loopback: plain HTTP works)
LAB_SANDBOX_REPO=${LAB_SANDBOX_REPO:-lab/pause:1}  # the pause image pushed to the registry
LAB_STATS_PERIOD=${LAB_STATS_PERIOD:-10}           # seconds between ImageFsInfo usage refreshes
LAB_SNAPSHOTTER=${LAB_SNAPSHOTTER:-}               # overlayfs or native; empty: overlayfs if it works on tmpfs

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)

die() { echo "up.sh: $*" >&2; exit 1; }
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

# start_daemon NAME CMD...: starts CMD in its own session with its output in LAB_DIR/NAME.log and its pid in
# LAB_DIR/NAME.pid, then waits until the new process has exec'd CMD. Until then its command line is still
# this script's (the forked subshell before setsid's exec), which alive, looking for LAB_DIR in it, would
# take for a dead or foreign process: the lab's first run failed that way 34 times in 50.
start_daemon() {
	local name=$1 pid i
	shift
	setsid "$@" >>"$LAB_DIR/$name.log" 2>&1 </dev/null &
	pid=$!
	echo "$pid" >"$LAB_DIR/$name.pid"
	for ((i = 0; i < 100; i++)); do
		alive "$LAB_DIR/$name.pid" && return 0
		pid_alive "$pid" || break
		sleep 0.05
	done
	echo "up.sh: $name (pid $pid) exited or did not start within 5s:" >&2
	tail -n 20 "$LAB_DIR/$name.log" >&2
	return 1
}

# http_status HOST:PORT PATH prints the status code of a GET, with bash's /dev/tcp (a fresh machine may
# have no curl). It runs in a subshell: a failed connect ends only that.
http_status() (
	host=${1%:*} port=${1##*:} line=
	exec 3<>"/dev/tcp/$host/$port" || exit 1
	printf 'GET %s HTTP/1.0\r\nHost: %s\r\n\r\n' "$2" "$1" >&3
	read -r -t 5 line <&3 || true
	line=${line%$'\r'}
	line=${line#* }
	echo "${line%% *}"
)

print_env() {
	cat <<EOF
lab up:
  CRI endpoint   unix://$LAB_DIR/containerd.sock   (containerd log: $LAB_DIR/containerd.log)
  image fs       $LAB_DIR/root (tmpfs, $LAB_TMPFS_SIZE)
  registry       $LAB_REGISTRY   (log: $LAB_DIR/registry.log)
  sandbox image  $LAB_REGISTRY/$LAB_SANDBOX_REPO
  push images    $LAB_DIR/labctl push -registry $LAB_REGISTRY -size 20m lab/filler-1:1
  run the agent  imagefleet agent --node lab --cri unix://$LAB_DIR/containerd.sock --pinned-images $LAB_REGISTRY/$LAB_SANDBOX_REPO
  stop           $here/down.sh
EOF
}

[[ $(id -u) == 0 ]] || die "run as root: the lab mounts a tmpfs and runs containerd"
[[ -n $LAB_DIR && $LAB_DIR == /* && ${#LAB_DIR} -lt 80 ]] ||
	die "LAB_DIR must be an absolute path under 80 characters (unix socket paths are limited to 108)"
for bin in containerd containerd-shim-runc-v2 runc docker-registry; do
	command -v "$bin" >/dev/null ||
		die "$bin is not installed: apt-get install -y containerd runc busybox-static docker-registry"
done
command -v go >/dev/null || die "go is not installed: the lab builds its helper (labctl) from this repository"

if alive "$LAB_DIR/containerd.pid" && alive "$LAB_DIR/registry.pid"; then
	echo "up.sh: the lab is already up"
	print_env
	exit 0
fi
if alive "$LAB_DIR/containerd.pid" || alive "$LAB_DIR/registry.pid"; then
	die "the lab in $LAB_DIR is half up: run $here/down.sh first"
fi
if http_status "$LAB_REGISTRY" /v2/ >/dev/null 2>&1; then
	die "something already listens on $LAB_REGISTRY (Debian's docker-registry service? systemctl stop docker-registry), or set LAB_REGISTRY"
fi

# From here on a failure leaves nothing half-built behind.
trap 'echo "up.sh: failed; removing the half-built lab" >&2; LAB_DIR=$LAB_DIR "$here/down.sh" >&2' ERR

mkdir -p "$LAB_DIR"/{root,state,runc,cni,opt,registry}
chmod 700 "$LAB_DIR"
if ! mountpoint -q "$LAB_DIR/root"; then
	mount -t tmpfs -o "size=$LAB_TMPFS_SIZE" ifl-lab "$LAB_DIR/root"
fi

# containerd's overlayfs snapshotter needs overlay mounts with their layers on the tmpfs (copy-up and
# whiteouts included); probe that rather than trust the kernel version.
if [[ -z $LAB_SNAPSHOTTER ]]; then
	probe=$LAB_DIR/root/.overlay-probe
	mkdir -p "$probe"/{l,u,w,m}
	echo lower >"$probe/l/f"
	LAB_SNAPSHOTTER=native
	if mount -t overlay overlay -o "lowerdir=$probe/l,upperdir=$probe/u,workdir=$probe/w" "$probe/m" 2>/dev/null; then
		if echo upper >"$probe/m/f" && rm "$probe/m/f"; then LAB_SNAPSHOTTER=overlayfs; fi
		umount "$probe/m"
	fi
	rm -rf "$probe"
fi

cat >"$LAB_DIR/registry.yml" <<EOF
# docker-registry (distribution 2.8) config of the lab, written by up.sh. No auth: it listens on loopback.
version: 0.1
log:
  level: info
  fields:
    service: imagefleet-lab-registry
storage:
  filesystem:
    rootdirectory: $LAB_DIR/registry
  delete:
    enabled: true
http:
  addr: $LAB_REGISTRY
EOF
: >"$LAB_DIR/registry.log"
start_daemon registry docker-registry serve "$LAB_DIR/registry.yml"
for ((i = 0; i < 100; i++)); do
	[[ $(http_status "$LAB_REGISTRY" /v2/ 2>/dev/null) == 200 ]] && break
	alive "$LAB_DIR/registry.pid" || { tail -n 20 "$LAB_DIR/registry.log" >&2; false; }
	sleep 0.1
done
[[ $(http_status "$LAB_REGISTRY" /v2/ 2>/dev/null) == 200 ]] || { tail -n 20 "$LAB_DIR/registry.log" >&2; false; }

(cd "$repo" && go build -o "$LAB_DIR/labctl" ./integration/lab/labctl)
"$LAB_DIR/labctl" push -registry "$LAB_REGISTRY" -busybox "$LAB_SANDBOX_REPO"

sed -e "s|@LAB_DIR@|$LAB_DIR|g" \
	-e "s|@SANDBOX_IMAGE@|$LAB_REGISTRY/$LAB_SANDBOX_REPO|g" \
	-e "s|@SNAPSHOTTER@|$LAB_SNAPSHOTTER|g" \
	-e "s|@STATS_PERIOD@|$LAB_STATS_PERIOD|g" \
	"$here/containerd.toml.tmpl" >"$LAB_DIR/containerd.toml"
start_daemon containerd containerd --config "$LAB_DIR/containerd.toml"
if ! "$LAB_DIR/labctl" wait -cri "unix://$LAB_DIR/containerd.sock" -timeout 30s; then
	tail -n 30 "$LAB_DIR/containerd.log" >&2
	false
fi
trap - ERR
echo "snapshotter    $LAB_SNAPSHOTTER"
print_env
