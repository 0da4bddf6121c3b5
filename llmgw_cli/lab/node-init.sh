#!/bin/sh
# First process of a lab node (started by `llmgw lab up`), already inside the node's
# network namespace and in fresh pid/mount/uts/ipc/cgroup namespaces.
# Builds an overlay root (lower = host /, upper = the node's dir on the lab tmpfs),
# private kernel filesystems, pivots into it and execs systemd as the node's PID 1.
# Nothing here writes to the host's root filesystem: never run systemd on the host root
# (its tmpfiles setup empties the host /tmp, systemd-sysctl changes host sysctls).
#   node-init.sh NAME NODE_STATE_DIR
set -eu
N=$1; S=$2
R=$S/root
export LIBMOUNT_UTAB=$S/utab   # keep util-linux from creating /run/mount on the host
mount --make-rprivate /
mount -t overlay "lgw-$N" -o "lowerdir=/,upperdir=$S/upper,workdir=$S/work" "$R"
# kernel API filesystems; /proc/sys read-only so no host sysctl can change
mount -t proc proc "$R/proc"
mount --bind "$R/proc/sys" "$R/proc/sys"; mount -o remount,bind,ro "$R/proc/sys"
[ ! -e "$R/proc/sysrq-trigger" ] || mount --bind /dev/null "$R/proc/sysrq-trigger"
# simulated CPU and memory (what lxcfs does, with plain files)
mount --bind "$S/cpuinfo" "$R/proc/cpuinfo"
mount --bind "$S/meminfo" "$R/proc/meminfo"
mount -t sysfs -o ro,nosuid,nodev,noexec sysfs "$R/sys"
mount -t cgroup2 -o nosuid,nodev,noexec cgroup2 "$R/sys/fs/cgroup"   # this cgroup namespace's subtree
mount -t overlay "lgw-$N-sysclass" -o "lowerdir=/sys/class,upperdir=$S/sysclass/u,workdir=$S/sysclass/w" "$R/sys/class"
# private /dev: systemd's messages must not reach the host console
mount -t tmpfs -o mode=755,nosuid,size=1m devtmp "$R/dev"
for d in "null 1 3" "zero 1 5" "full 1 7" "random 1 8" "urandom 1 9" "tty 5 0"; do
  set -- $d; mknod -m 666 "$R/dev/$1" c "$2" "$3"; done
mknod -m 600 "$R/dev/console" c 1 3
mkdir "$R/dev/pts" "$R/dev/shm" "$R/dev/mqueue"
mount -t devpts -o newinstance,ptmxmode=0666,mode=620,gid=5 devpts "$R/dev/pts"; ln -s pts/ptmx "$R/dev/ptmx"
mount -t tmpfs -o mode=1777,nosuid,nodev shm "$R/dev/shm"
ln -s /proc/self/fd "$R/dev/fd"; ln -s /proc/self/fd/0 "$R/dev/stdin"
ln -s /proc/self/fd/1 "$R/dev/stdout"; ln -s /proc/self/fd/2 "$R/dev/stderr"
mount -t tmpfs -o mode=755,nosuid,nodev,size=64m run "$R/run"
mount -t tmpfs -o mode=1777,nosuid,nodev,size=256m tmp "$R/tmp"
# extra read-only files (model weights shared by every node): "SOURCE<TAB>TARGET" lines
if [ -f "$S/binds" ]; then
  while IFS="$(printf '\t')" read -r src dst; do
    # targets on the node's fresh /tmp do not exist yet
    if [ ! -e "$R$dst" ]; then
      if [ -d "$src" ]; then mkdir -p "$R$dst"; else mkdir -p "$(dirname "$R$dst")"; : > "$R$dst"; fi
    fi
    mount --bind "$src" "$R$dst"; mount -o remount,bind,ro "$R$dst"
  done < "$S/binds"
fi
hostname "$N"
cd "$R"; pivot_root . .; umount -l .; cd /
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
exec env -i container=llmgw-lab PATH="$PATH" /lib/systemd/systemd --system --unit=lab.target
