package router

import (
	"testing"

	"github.com/pdproxy/pdproxy/router/routerconfig"
)

func TestKVEventsPortDialsEachEngineOnItsOwnAddress(t *testing.T) {
	for _, tc := range []struct {
		name           string
		cfg            routerconfig.BackendConfig
		events, replay string
	}{
		{"a port, on the engine's address", routerconfig.BackendConfig{URL: "http://10.1.2.3:8000", KVEventsPort: 5557, KVEventsReplayPort: 5558},
			"tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558"},
		{"an IPv6 engine", routerconfig.BackendConfig{URL: "http://[fd00::7]:8000", KVEventsPort: 5557}, "tcp://[fd00::7]:5557", ""},
		{"an endpoint given wins", routerconfig.BackendConfig{URL: "http://10.1.2.3:8000", KVEventsPort: 5557, KVEventsEndpoint: "tcp://10.9.9.9:6000"},
			"tcp://10.9.9.9:6000", ""},
		{"neither", routerconfig.BackendConfig{URL: "http://10.1.2.3:8000"}, "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := newBackend(tc.cfg, bareEngine("vllm"), nil, nil)
			if b.kvEvents != tc.events || b.kvReplay != tc.replay {
				t.Errorf("dials %q, replays from %q; want %q, %q", b.kvEvents, b.kvReplay, tc.events, tc.replay)
			}
		})
	}
}

func TestADiscoverEntryTakesKVEventsByPortForPreciseRouting(t *testing.T) {
	cfg := routerconfig.Config{DecodePolicy: routerconfig.PolicyPreciseCacheAware, Backends: []routerconfig.BackendConfig{
		{Name: "p", URL: "http://10.0.0.1:8000", Role: routerconfig.RolePrefill},
		{Discover: "dns", URL: "http://decoders.ns.svc:8000", Role: routerconfig.RoleDecode, KVEventsPort: 5557},
	}}
	if err := cfg.Validate(); err != nil {
		t.Errorf("refused: %v", err)
	}
	cfg.Backends[1].KVEventsPort = 70000
	if err := cfg.Validate(); err == nil {
		t.Error("a port of 70000 was taken")
	}
}
