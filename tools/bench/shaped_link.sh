#!/usr/bin/env bash
# Runs a command on a link of a given rate: in a fresh network namespace whose
# loopback, the path every process of the command talks over, is limited by a
# token bucket (tc tbf) to RATE. All the command's processes share it, as the
# ranks of one node share its NIC. The namespace also holds a veth pair with
# an address (UCX's tcp transport wants a network device besides lo; traffic
# to the namespace's own address still goes over the loopback).
#
#   bash tools/bench/shaped_link.sh RATE COMMAND [ARGS...]
#   bash tools/bench/shaped_link.sh 10gbit build/bin/weightsync bench sync --delta \
#       --update random:0.02 --transport 'ucx?tls=tcp' --json
#
# RATE as tc takes it: 10gbit, 25gbit, 1gbit. Needs root, iproute2 and the
# kernel's sch_tbf. The namespace is removed at the end, whatever happens.
# Exit status: the command's; 77 when the link cannot be made here.
set -euo pipefail
if [ $# -lt 2 ]; then
  sed -n '2,14p' "$0" >&2
  exit 2
fi
rate=$1
shift
ns="ws-shaped-$$"
cleanup() { ip netns del "$ns" 2>/dev/null || true; }
trap cleanup EXIT
if ! ip netns add "$ns" 2>/dev/null; then
  echo "shaped_link.sh: cannot create a network namespace (root and iproute2 needed)" >&2
  exit 77
fi
ip -n "$ns" link set lo up
ip -n "$ns" link add ws0 type veth peer name ws1
ip -n "$ns" addr add 10.213.0.1/24 dev ws0
ip -n "$ns" link set ws0 up
ip -n "$ns" link set ws1 up
# Burst above loopback's largest packet (64 KiB, and GSO batches), so that
# no packet is dropped for its size; the rate is the limit.
if ! tc -n "$ns" qdisc add dev lo root tbf rate "$rate" burst 4mb latency 200ms; then
  echo "shaped_link.sh: cannot limit the loopback to $rate (tc tbf)" >&2
  exit 77
fi
echo "shaped_link.sh: $(tc -n "$ns" qdisc show dev lo | head -n 1)" >&2
status=0
ip netns exec "$ns" "$@" || status=$?
exit $status
