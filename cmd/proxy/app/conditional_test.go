package app

import (
	"context"
	"strings"
	"testing"

	"github.com/pdproxy/pdproxy/router/routerconfig"
	"go.uber.org/zap/zaptest"
)

// conditionalConfig is a 1P1D config with pd_uncached_token_threshold 64 on the decode
// policy given, changed by edit.
func conditionalConfig(policy string, edit func(c *Config)) Config {
	c := Config{Listen: "127.0.0.1:0"}
	c.Proxy.PDUncachedTokenThreshold = 64
	c.Router.DecodePolicy = policy
	c.Router.Health.Interval = -1
	c.Router.Backends = []routerconfig.BackendConfig{
		{Name: "p0", URL: "http://127.0.0.1:1", Role: routerconfig.RolePrefill, Engine: "vllm"},
		{Name: "d0", URL: "http://127.0.0.1:2", Role: routerconfig.RoleDecode, Engine: "vllm"},
	}
	if edit != nil {
		edit(&c)
	}
	return c
}

// pd_uncached_token_threshold weighs what a decoder holds, which the proxy knows only from
// its KV events: a config that reads none (cache_aware, or events from the prefillers
// alone) is refused at startup, naming what is missing, rather than accepted with a
// threshold that never fires. So is one that reserves the decoder after the prefill.
func TestStartRefusesAnUncachedThresholdThatCouldNeverFire(t *testing.T) {
	tests := []struct {
		name string
		cfg  Config
		want []string // in the error
	}{
		{"cache_aware, no KV events", conditionalConfig(routerconfig.PolicyCacheAware, nil),
			[]string{"pd_uncached_token_threshold", "KV events", "kv_events_endpoint", "kv_events.listen"}},
		{"least_inflight, KV events of the prefiller only", conditionalConfig("", func(c *Config) {
			c.Router.Backends[0].KVEventsEndpoint = "tcp://127.0.0.1:5557"
		}), []string{"pd_uncached_token_threshold", "decoders' KV events"}},
		{"the decoder reserved after the prefill", conditionalConfig(routerconfig.PolicyCacheAware, func(c *Config) {
			c.Router.Backends[1].KVEventsEndpoint = "tcp://127.0.0.1:5557"
			c.Proxy.DecoderReservation = "after_prefill"
		}), []string{"pd_uncached_token_threshold", "decoder_reservation before_prefill"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m, err := New(tt.cfg, zaptest.NewLogger(t))
			if err != nil {
				t.Fatal(err)
			}
			err = m.Start(context.Background())
			if err == nil {
				m.Shutdown(context.Background())
				t.Fatal("Start accepted the config")
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("Start: %v; want it to name %q", err, w)
				}
			}
		})
	}
}

// The configs that read the decoders' KV events pass the check, on any policy; so does any
// config with the threshold off.
func TestAnUncachedThresholdWithTheDecodersEventsIsAccepted(t *testing.T) {
	for name, c := range map[string]Config{
		"a decoder's kv_events_endpoint": conditionalConfig(routerconfig.PolicyCacheAware, func(c *Config) {
			c.Router.Backends[1].KVEventsEndpoint = "tcp://127.0.0.1:5557"
		}),
		"a decoder's kv_events_port": conditionalConfig("", func(c *Config) { c.Router.Backends[1].KVEventsPort = 5557 }),
		"kv_events.listen":           conditionalConfig(routerconfig.PolicyPreciseCacheAware, func(c *Config) { c.Router.KVEvents.Listen = "tcp://*:5557" }),
		"the threshold off":          conditionalConfig(routerconfig.PolicyCacheAware, func(c *Config) { c.Proxy.PDUncachedTokenThreshold = 0 }),
	} {
		if err := checkConditional(c.Proxy, c.Router); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
}

// prefill_unavailable: decode_only is refused where no decoder could ever serve alone (every
// one of a paired engine), and accepted where one can.
func TestPrefillUnavailableDecodeOnlyNeedsADecoderThatServesAlone(t *testing.T) {
	paired := conditionalConfig("", func(c *Config) {
		c.Proxy.PDUncachedTokenThreshold = 0
		c.Proxy.PrefillUnavailable = "decode_only"
		c.Router.Backends[0].Engine, c.Router.Backends[1].Engine = "sglang", "sglang"
		c.Router.Backends = append(c.Router.Backends, routerconfig.BackendConfig{Name: "d1", URL: "http://127.0.0.1:3", Role: routerconfig.RoleDecode, Engine: "mooncake"})
	})
	err := checkConditional(paired.Proxy, paired.Router)
	if err == nil || !strings.Contains(err.Error(), "prefill_unavailable") || !strings.Contains(err.Error(), "mooncake, sglang") {
		t.Fatalf("checkConditional = %v; want a refusal of prefill_unavailable naming the engines", err)
	}
	for name, edit := range map[string]func(c *Config){
		"a vLLM decoder among them": func(c *Config) { c.Router.Backends[2].Engine = "vllm" },
		"fail":                      func(c *Config) { c.Proxy.PrefillUnavailable = "fail" },
	} {
		c := paired
		c.Router.Backends = append([]routerconfig.BackendConfig(nil), paired.Router.Backends...)
		edit(&c)
		if err := checkConditional(c.Proxy, c.Router); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
}
