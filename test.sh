#!/usr/bin/env bash
# Every test of the repository on a machine with Go and nothing else: it installs what the
# tests need where it is missing (Debian's curl, redis-server and chromium, by apt-get, as
# root or through sudo), then vets the code and runs every test, the live view's browser
# test included. Arguments go to each go test (.ci/run passes -race); --missing alone prints
# the packages it would install, one a line, and stops.
set -euo pipefail
cd "$(dirname "$0")"
missing=()
for cmd in curl redis-server chromium; do
	command -v "$cmd" >/dev/null || missing+=("$cmd")
done
if [[ ${1:-} == --missing ]]; then
	printf '%s\n' "${missing[@]}"
	exit 0
fi
if ((${#missing[@]})); then
	echo "test.sh: installing ${missing[*]} (Debian packages the tests need)"
	sudo=()
	if [[ $(id -u) != 0 ]]; then
		sudo=(sudo)
	fi
	"${sudo[@]}" apt-get update
	"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y "${missing[@]}"
fi
go version
go vet ./...
go vet -tags browser ./e2e/
go test -count=1 -timeout 20m "$@" ./...
# The live view in a real browser (the browser build tag keeps it out of the run above).
go test -count=1 -timeout 5m -tags browser -run TestLiveView "$@" ./e2e/
