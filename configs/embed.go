// Package configs holds pdproxy's embedded default config; the YAML files beside it are
// examples for real deployments.
package configs

import _ "embed"

// Default is the config `go run ./cmd/proxy` uses with no flags: one simulated prefiller and
// one simulated decoder on free loopback ports, the proxy in front on 127.0.0.1:8000.
//
//go:embed default.yaml
var Default []byte
