#!/usr/bin/env bash
# netns_two_hosts.sh -- two "hosts" with their own network addresses on one machine (root).
#
#   scripts/netns_two_hosts.sh up   [NAME]   # NAME defaults to dpt
#   ip netns exec NAME-h0 <command>          # runs on "host 0" (10.231.0.1, interface eth0)
#   ip netns exec NAME-h1 <command>          # runs on "host 1" (10.231.0.2, interface eth0)
#   scripts/netns_two_hosts.sh unplug NAME I  # pull host I's cable (at the bridge): silence
#   scripts/netns_two_hosts.sh down [NAME]
#
# `up` makes three network namespaces: NAME-br holds a bridge, NAME-h0 and NAME-h1 each get a
# veth interface `eth0` plugged into it, with the addresses above, and their own loopback. Every
# interface is created directly inside its namespace, so the main namespace is never touched and
# never reaches the hosts' addresses. `down` deletes the namespaces (their veth pairs go with
# them); it is safe to run twice. Set DPT_NETNS_SUBNET (default 10.231.0) for another /24.
#
# As on real hosts, the hostname resolves to the host's own address inside each namespace
# (/etc/netns/NS/hosts, which `ip netns exec` mounts over /etc/hosts), so software that binds
# "the hostname's address" (Gloo, NCCL, rank 0's store) is reachable from the other host.
# Both hosts share the hostname, though: give torchrun --local-addr=<the host's address> so that
# rank 0 advertises the address of its own host, and set GLOO_SOCKET_IFNAME=eth0.
set -euo pipefail

ACTION="${1:-}"
NAME="${2:-dpt}"
SUBNET="${DPT_NETNS_SUBNET:-10.231.0}"
BR="$NAME-br"
HOSTS=("$NAME-h0" "$NAME-h1")

usage() {
    echo "usage: $0 up|down [NAME] | $0 unplug NAME 0|1" >&2
    exit 2
}

down() {
    local ns
    for ns in "${HOSTS[@]}" "$BR"; do
        if ip netns list | awk '{print $1}' | grep -qxF -- "$ns"; then
            ip netns delete "$ns"
        fi
        rm -rf "/etc/netns/$ns"
    done
}

up() {
    down
    trap 'down' ERR # never leave half a network behind
    ip netns add "$BR"
    ip -n "$BR" link add br0 type bridge
    ip -n "$BR" link set br0 up
    local i ns port
    for i in 0 1; do
        ns="${HOSTS[$i]}"
        port="h$i"
        ip netns add "$ns"
        ip link add eth0 netns "$ns" type veth peer name "$port" netns "$BR"
        ip -n "$BR" link set "$port" master br0
        ip -n "$BR" link set "$port" up
        ip -n "$ns" addr add "$SUBNET.$((i + 1))/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
        mkdir -p "/etc/netns/$ns"
        printf '127.0.0.1 localhost\n%s %s\n' "$SUBNET.$((i + 1))" "$(hostname)" >"/etc/netns/$ns/hosts"
        echo "$ns $SUBNET.$((i + 1)) eth0"
    done
    trap - ERR
}

unplug() {
    local i="${1:-}"
    [[ "$i" == 0 || "$i" == 1 ]] || usage
    ip -n "$BR" link set "h$i" down
}

case "$ACTION" in
up) up ;;
down) down ;;
unplug) unplug "${3:-}" ;;
*) usage ;;
esac
