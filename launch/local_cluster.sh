#!/usr/bin/env bash
# A two-host cluster inside this machine, to run the multi-node launchers for real.
#
#   launch/local_cluster.sh up        build it (needs root; installs openssh-server and pdsh with apt if missing)
#   launch/local_cluster.sh down      remove everything `up` made; safe to run any time, also after a failure
#   launch/local_cluster.sh status    what exists now
#   launch/local_cluster.sh exec HOST COMMAND...   run COMMAND on HOST (dsq8-h1 or dsq8-h2)
#
# Each host is a network namespace with one address on a private veth link between the two
# (dsq8-h1 10.218.18.11, dsq8-h2 10.218.18.12, interface "dsq8" in both), its own hostname and
# an sshd that accepts one key generated here. The checkout is shared through the common file
# system, as a cluster shares NFS. Nothing outside the two namespaces is reachable from them, and
# the machine's own network and files are left alone: per-host /etc/hosts and /etc/ssh come from
# /etc/netns/HOST/, which `ip netns exec` lays over /etc for commands run on that host only.
#
# `up` writes into $DSQ8_CLUSTER_DIR (default /tmp/ds_q8_cluster):
#   hostfile         "dsq8-h1 slots=1" / "dsq8-h2 slots=1" for the deepspeed launcher
#   deepspeed_env    variables every rank needs (PATH, OMP_NUM_THREADS, GLOO_SOCKET_IFNAME, ...), for
#                    the launcher's DS_ENV_FILE; taken from the environment `up` runs in
#   id_ed25519*, authorized_keys, host keys, sshd configs, pid files and logs
# e.g.  DS_ENV_FILE=/tmp/ds_q8_cluster/deepspeed_env launch/local_cluster.sh exec dsq8-h1 \
#         env HOSTFILE=/tmp/ds_q8_cluster/hostfile MASTER_ADDR=10.218.18.11 launch/run_multi_node.sh ...
set -euo pipefail

STATE=${DSQ8_CLUSTER_DIR:-/tmp/ds_q8_cluster}
HOSTS=(dsq8-h1 dsq8-h2)
ADDRS=(10.218.18.11 10.218.18.12)
IFACE=dsq8
REPO=$(cd "$(dirname "$0")/.." && pwd)

die() { echo "local_cluster.sh: $*" >&2; exit 2; }

need_root() {
  [[ $(id -u) == 0 ]] || die "needs root (network namespaces, sshd on port 22 of the namespaces)"
  command -v ip >/dev/null || die "needs the ip command (Debian: iproute2)"
}

install_tools() {
  if [[ -x /usr/sbin/sshd ]] && command -v ssh >/dev/null && command -v pdsh >/dev/null \
      && command -v ssh-keygen >/dev/null; then
    return
  fi
  command -v apt-get >/dev/null || die "sshd/pdsh missing and no apt-get to install openssh-server and pdsh"
  echo "installing openssh-server and pdsh with apt-get"
  apt-get update -q >/dev/null || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends openssh-server openssh-client pdsh \
    >/dev/null || die "apt-get install openssh-server openssh-client pdsh failed"
}

# pids of every process in host $1's network namespace (all of them were started through it)
host_pids() { ip netns pids "$1" 2>/dev/null || true; }

down() {
  local host pids i
  for host in "${HOSTS[@]}"; do
    if ip netns list 2>/dev/null | grep -qw "^$host"; then
      pids=$(host_pids "$host")
      if [[ -n $pids ]]; then
        kill -TERM $pids 2>/dev/null || true
        for i in $(seq 30); do
          pids=$(host_pids "$host")
          [[ -z $pids ]] && break
          sleep 0.1
        done
        [[ -n $pids ]] && kill -KILL $pids 2>/dev/null || true
      fi
      ip netns del "$host"
    fi
    rm -rf "/etc/netns/$host"
  done
  rmdir /etc/netns 2>/dev/null || true
  # the veth ends stay in this namespace only if `up` failed before moving them
  ip link del dsq8-v1 2>/dev/null || true
  ip link del dsq8-v2 2>/dev/null || true
  if [[ -f $STATE/made_run_sshd ]]; then rmdir /run/sshd 2>/dev/null || true; fi
  rm -rf "$STATE"
}

write_host_files() {  # $1 host, $2 address
  local host=$1 addr=$2 etc=/etc/netns/$1
  mkdir -p "$etc/ssh"
  {
    echo "127.0.0.1 localhost"
    for i in "${!HOSTS[@]}"; do echo "${ADDRS[$i]} ${HOSTS[$i]}"; done
  } >"$etc/hosts"
  cat >"$etc/ssh/ssh_config" <<EOF
# ssh client on $host: only the cluster's hosts exist here
Host *
  IdentityFile $STATE/id_ed25519
  IdentitiesOnly yes
  BatchMode yes
  StrictHostKeyChecking no
  UserKnownHostsFile /dev/null
  LogLevel ERROR
  ConnectTimeout 10
  # a host that vanishes ends its ssh session (and so pdsh's wait on it) after 15 s
  ServerAliveInterval 5
  ServerAliveCountMax 3
EOF
  cat >"$etc/ssh/sshd_config" <<EOF
ListenAddress $addr
Port 22
HostKey $STATE/$host.host_key
PidFile $STATE/sshd-$host.pid
AuthorizedKeysFile $STATE/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
# the keys live under /tmp, which is world-writable
StrictModes no
X11Forwarding no
PrintMotd no
PrintLastLog no
MaxStartups 64
EOF
}

# run "$@" in host $1's namespace under its hostname
on_host() {
  local host=$1; shift
  ip netns exec "$host" unshare --uts sh -c 'hostname "$0" && exec "$@"' "$host" "$@"
}

write_env_file() {
  local f=$STATE/deepspeed_env
  : >"$f"
  echo "PATH=$PATH" >>"$f"
  echo "OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}" >>"$f"
  echo "GLOO_SOCKET_IFNAME=$IFACE" >>"$f"
  local pp="$REPO:$REPO/launch${PYTHONPATH:+:$PYTHONPATH}"
  echo "PYTHONPATH=$pp" >>"$f"
  local v
  for v in TORCH_EXTENSIONS_DIR CUDA_HOME PYTHONHASHSEED; do
    if [[ -n ${!v:-} ]]; then echo "$v=${!v}" >>"$f"; fi
  done
}

up() {
  need_root
  ip netns list >/dev/null 2>&1 || die "ip netns is not permitted here"
  install_tools
  down  # start from nothing, whatever an earlier run left
  trap 'echo "local_cluster.sh: up failed, removing what it made" >&2; down' ERR
  trap 'echo "local_cluster.sh: up interrupted, removing what it made" >&2; down; exit 130' INT TERM
  mkdir -p -m 700 "$STATE"
  if [[ ! -d /run/sshd ]]; then mkdir -p -m 755 /run/sshd; touch "$STATE/made_run_sshd"; fi
  ssh-keygen -q -t ed25519 -N '' -C ds_q8-local-cluster -f "$STATE/id_ed25519"
  cp "$STATE/id_ed25519.pub" "$STATE/authorized_keys"
  ip link add dsq8-v1 type veth peer name dsq8-v2
  local i host addr
  for i in "${!HOSTS[@]}"; do
    host=${HOSTS[$i]} addr=${ADDRS[$i]}
    ip netns add "$host"
    ip link set "dsq8-v$((i + 1))" netns "$host"
    ip netns exec "$host" ip link set "dsq8-v$((i + 1))" name "$IFACE"
    ip netns exec "$host" ip addr add "$addr/24" dev "$IFACE"
    ip netns exec "$host" ip link set "$IFACE" up
    ip netns exec "$host" ip link set lo up
    ssh-keygen -q -t ed25519 -N '' -C "$host" -f "$STATE/$host.host_key"
    write_host_files "$host" "$addr"
    on_host "$host" /usr/sbin/sshd -f /etc/ssh/sshd_config -E "$STATE/sshd-$host.log"
  done
  # every host reaches every host by name with the generated key
  local from to ok
  for from in "${HOSTS[@]}"; do
    for to in "${HOSTS[@]}"; do
      ok=0
      for i in $(seq 40); do
        if on_host "$from" ssh "$to" true 2>/dev/null; then ok=1; break; fi
        sleep 0.25
      done
      [[ $ok == 1 ]] || { echo "local_cluster.sh: ssh from $from to $to fails; see $STATE/sshd-$to.log" >&2; false; }
    done
  done
  for host in "${HOSTS[@]}"; do echo "$host slots=1"; done >"$STATE/hostfile"
  write_env_file
  trap - ERR INT TERM
  echo "cluster up: ${HOSTS[0]} ${ADDRS[0]}, ${HOSTS[1]} ${ADDRS[1]}; hostfile $STATE/hostfile, env file $STATE/deepspeed_env"
}

status() {
  local host
  for host in "${HOSTS[@]}"; do
    if ip netns list 2>/dev/null | grep -qw "^$host"; then
      echo "$host: namespace up, processes: $(host_pids "$host" | tr '\n' ' ')"
    else
      echo "$host: absent"
    fi
  done
  [[ -d $STATE ]] && echo "state: $STATE" || echo "state: none"
}

case "${1:-}" in
  up) up ;;
  down) need_root; down; echo "cluster down" ;;
  status) status ;;
  exec)
    [[ $# -ge 3 ]] || die "usage: exec HOST COMMAND... (HOST one of ${HOSTS[*]})"
    [[ " ${HOSTS[*]} " == *" $2 "* ]] || die "exec: HOST must be one of ${HOSTS[*]}; got '$2'"
    host=$2; shift 2
    on_host "$host" "$@" ;;
  *) die "usage: $0 up|down|status|exec HOST COMMAND... ; got '${1:-}'" ;;
esac
