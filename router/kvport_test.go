package router

import "testing"

func TestKVEventsPortDialsEachEngineOnItsOwnAddress(t *testing.T) {
	for _, tc := range []struct {
		name           string
		cfg            BackendConfig
		events, replay string
	}{
		{"a port, on the engine's address", BackendConfig{URL: "http://10.1.2.3:8000", KVEventsPort: 5557, KVEventsReplayPort: 5558},
			"tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558"},
		{"an IPv6 engine", BackendConfig{URL: "http://[fd00::7]:8000", KVEventsPort: 5557}, "tcp://[fd00::7]:5557", ""},
		{"an endpoint given wins", BackendConfig{URL: "http://10.1.2.3:8000", KVEventsPort: 5557, KVEventsEndpoint: "tcp://10.9.9.9:6000"},
			"tcp://10.9.9.9:6000", ""},
		{"neither", BackendConfig{URL: "http://10.1.2.3:8000"}, "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := newBackend(tc.cfg, opaqueEngine("vllm"), nil, nil)
			if b.kvEvents != tc.events || b.kvReplay != tc.replay {
				t.Errorf("dials %q, replays from %q; want %q, %q", b.kvEvents, b.kvReplay, tc.events, tc.replay)
			}
		})
	}
}

func TestADiscoverEntryTakesKVEventsByPortForPreciseRouting(t *testing.T) {
	cfg := Config{DecodePolicy: PolicyPreciseCacheAware, Backends: []BackendConfig{
		{Name: "p", URL: "http://10.0.0.1:8000", Role: RolePrefill},
		{Discover: "dns", URL: "http://decoders.ns.svc:8000", Role: RoleDecode, KVEventsPort: 5557},
	}}
	if err := cfg.Validate(); err != nil {
		t.Errorf("refused: %v", err)
	}
	cfg.Backends[1].KVEventsPort = 70000
	if err := cfg.Validate(); err == nil {
		t.Error("a port of 70000 was taken")
	}
}
