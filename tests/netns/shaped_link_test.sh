#!/usr/bin/env bash
# tools/bench/shaped_link.sh: the command runs behind a loopback limited to
# the rate asked for, its exit status comes back, and the namespace is gone
# afterwards. Exit 77 (skipped) where no network namespace can be made.
set -uo pipefail
script="$(dirname "$0")/../../tools/bench/shaped_link.sh"
fail() { echo "shaped_link_test: $*" >&2; exit 1; }

before=$(ip netns list 2>/dev/null | grep -c '^ws-shaped-' || true)
out=$(bash "$script" 1gbit tc qdisc show dev lo 2>&1)
status=$?
[ $status -eq 77 ] && { echo "skipped: $out"; exit 77; }
[ $status -eq 0 ] || fail "exit $status: $out"
echo "$out" | grep -q "qdisc tbf .* rate 1Gbit" || fail "no 1 Gbit/s token bucket on lo: $out"
out=$(bash "$script" 1gbit ip -o addr show ws0 2>&1) || fail "no ws0 in the namespace: $out"
echo "$out" | grep -q "10.213.0.1/24" || fail "ws0 has no address: $out"
bash "$script" 1gbit sh -c 'exit 3' 2>/dev/null
status=$?
[ $status -eq 3 ] || fail "the command's exit status 3 came back as $status"
bash "$script" 1gbit 2>/dev/null
status=$?
[ $status -eq 2 ] || fail "no command: exit $status, expected 2 (usage)"
after=$(ip netns list 2>/dev/null | grep -c '^ws-shaped-' || true)
[ "$after" -eq "$before" ] || fail "namespaces left behind: $(ip netns list | grep '^ws-shaped-')"
echo "shaped_link_test: ok"
