package routerconfig

import (
	"strings"
	"testing"
	"time"

	"gopkg.in/yaml.v3"
)

func TestValidateFillsDefaults(t *testing.T) {
	cfg := Config{Backends: []BackendConfig{{URL: "http://engine:8000", Role: RoleDecode}}, Engines: testEngines}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	b := cfg.Backends[0]
	checks := []struct {
		field     string
		got, want any
	}{
		{"name", b.Name, "engine:8000"},
		{"weight", b.Weight, 1},
		{"max_inflight", b.MaxInflight, 256},
		{"engine", b.Engine, "vllm"},
		{"kv_hold_timeout", b.KVHoldTimeout, 480 * time.Second},
		{"prefill_policy", cfg.PrefillPolicy, "least_inflight"},
		{"decode_policy", cfg.DecodePolicy, "least_inflight"},
		{"prefix_tokens", cfg.PrefixTokens, 256},
		{"health.interval", cfg.Health.Interval, 5 * time.Second},
		{"health.timeout", cfg.Health.Timeout, 2 * time.Second},
		{"health.unhealthy_threshold", cfg.Health.UnhealthyThreshold, 2},
		{"health.healthy_threshold", cfg.Health.HealthyThreshold, 1},
		{"health.path", cfg.Health.Path, "/health"},
		{"ejection.consecutive_failures", cfg.Ejection.ConsecutiveFailures, 3},
		{"ejection.base_backoff", cfg.Ejection.BaseBackoff, 5 * time.Second},
		{"ejection.max_backoff", cfg.Ejection.MaxBackoff, 30 * time.Second},
		{"queue.size", cfg.Queue.Size, 1024},
		{"queue.timeout", cfg.Queue.Timeout, 10 * time.Second},
	}
	for _, c := range checks {
		if c.got != c.want {
			t.Errorf("%s = %v, want %v", c.field, c.got, c.want)
		}
	}
}

func TestEjectionBackoffDefaultsFollowTheHealthInterval(t *testing.T) {
	tests := []struct {
		name      string
		health    HealthConfig
		ejection  EjectionConfig
		base, max time.Duration
	}{
		{"one interval", HealthConfig{Interval: 2 * time.Second}, EjectionConfig{}, 2 * time.Second, 30 * time.Second},
		{"an interval longer than the cap raises it", HealthConfig{Interval: time.Minute}, EjectionConfig{}, time.Minute, time.Minute},
		{"5s with checks off", HealthConfig{Interval: -1}, EjectionConfig{}, 5 * time.Second, 30 * time.Second},
		{"a set base of at least one interval stays", HealthConfig{Interval: time.Second}, EjectionConfig{BaseBackoff: 3 * time.Second}, 3 * time.Second, 30 * time.Second},
		{"any set base with checks off stays", HealthConfig{Interval: -1}, EjectionConfig{BaseBackoff: 100 * time.Millisecond}, 100 * time.Millisecond, 30 * time.Second},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := Config{Backends: []BackendConfig{{URL: "http://d:1", Role: RoleDecode}}, Health: tt.health, Ejection: tt.ejection}
			if err := cfg.Validate(); err != nil {
				t.Fatal(err)
			}
			if e := cfg.Ejection; e.BaseBackoff != tt.base || e.MaxBackoff != tt.max {
				t.Errorf("base_backoff, max_backoff = %v, %v; want %v, %v", e.BaseBackoff, e.MaxBackoff, tt.base, tt.max)
			}
		})
	}
}

func TestNameDerivedFromURL(t *testing.T) {
	tests := []struct{ url, want string }{
		{"http://10.0.0.1:8000", "10.0.0.1:8000"},
		{"http://engine", "engine:80"},
		{"https://engine", "engine:443"},
		{"http://[::1]:9000/", "[::1]:9000"},
	}
	for _, tt := range tests {
		t.Run(tt.url, func(t *testing.T) {
			cfg := Config{Backends: []BackendConfig{{URL: tt.url, Role: RoleDecode}}}
			if err := cfg.Validate(); err != nil {
				t.Fatal(err)
			}
			if got := cfg.Backends[0].Name; got != tt.want {
				t.Errorf("name = %q, want %q", got, tt.want)
			}
		})
	}
}

func TestOneEngineInBothRolesGetsANamePerRole(t *testing.T) {
	tests := []struct {
		name     string
		backends []BackendConfig
		want     []string
	}{
		{"the same url in both roles", []BackendConfig{
			{URL: "http://127.0.0.1:8100", Role: RolePrefill},
			{URL: "http://127.0.0.1:8100", Role: RoleDecode},
		}, []string{"prefill-127.0.0.1:8100", "decode-127.0.0.1:8100"}},
		{"the same address spelled two ways", []BackendConfig{
			{URL: "http://engine", Role: RoleDecode},
			{URL: "http://engine:80/", Role: RolePrefill},
		}, []string{"decode-engine:80", "prefill-engine:80"}},
		{"other addresses keep their plain names", []BackendConfig{
			{URL: "http://10.0.0.1:8000", Role: RolePrefill},
			{URL: "http://10.0.0.1:8000", Role: RoleDecode},
			{URL: "http://10.0.0.2:8000", Role: RoleDecode},
		}, []string{"prefill-10.0.0.1:8000", "decode-10.0.0.1:8000", "10.0.0.2:8000"}},
		{"an explicit name leaves the other its plain name", []BackendConfig{
			{Name: "both-p", URL: "http://10.0.0.1:8000", Role: RolePrefill},
			{URL: "http://10.0.0.1:8000", Role: RoleDecode},
		}, []string{"both-p", "10.0.0.1:8000"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := Config{Backends: tt.backends}
			if err := cfg.Validate(); err != nil {
				t.Fatal(err)
			}
			for i, want := range tt.want {
				if got := cfg.Backends[i].Name; got != want {
					t.Errorf("backends[%d].name = %q, want %q", i, got, want)
				}
			}
			// Validating again (a reload of the same config) keeps the names.
			if err := cfg.Validate(); err != nil {
				t.Fatalf("second Validate: %v", err)
			}
		})
	}
}

func TestValidateNamesTheBadField(t *testing.T) {
	decoder := BackendConfig{URL: "http://d:1", Role: RoleDecode}
	tests := []struct {
		name string
		cfg  Config
		want string
	}{
		{"missing url", Config{Backends: []BackendConfig{decoder, {Role: RolePrefill}}}, "backends[1].url: required"},
		{"url without http scheme", Config{Backends: []BackendConfig{{URL: "ftp://d:1", Role: RoleDecode}}}, "backends[0].url:"},
		{"url without host", Config{Backends: []BackendConfig{{URL: "http://", Role: RoleDecode}}}, "backends[0].url:"},
		{"url with query", Config{Backends: []BackendConfig{{URL: "http://d:1/?a=b", Role: RoleDecode}}}, "backends[0].url:"},
		{"unknown role", Config{Backends: []BackendConfig{decoder, {URL: "http://p:1", Role: "both"}}}, "backends[1].role:"},
		{"missing role", Config{Backends: []BackendConfig{decoder, {URL: "http://p:1"}}}, "backends[1].role:"},
		{"duplicate derived name in one role", Config{Backends: []BackendConfig{decoder, {URL: "http://d:1", Role: RoleDecode}}}, "backends[1].name:"},
		{"duplicate derived name in both roles and twice in one", Config{Backends: []BackendConfig{decoder, {URL: "http://d:1", Role: RolePrefill}, {URL: "http://d:1/", Role: RoleDecode}}}, "backends[2].name: \"decode-d:1\" already names backends[0]"},
		{"duplicate explicit name across roles", Config{Backends: []BackendConfig{{Name: "e", URL: "http://d:1", Role: RoleDecode}, {Name: "e", URL: "http://d:1", Role: RolePrefill}}}, "backends[1].name: \"e\" already names backends[0]"},
		{"no decoder", Config{Backends: []BackendConfig{{URL: "http://p:1", Role: RolePrefill}}}, "backends: at least one backend with role \"decode\""},
		{"no backends", Config{}, "backends: at least one"},
		{"negative weight", Config{Backends: []BackendConfig{{URL: "http://d:1", Role: RoleDecode, Weight: -1}}}, "backends[0].weight:"},
		{"negative max_inflight", Config{Backends: []BackendConfig{{URL: "http://d:1", Role: RoleDecode, MaxInflight: -2}}}, "backends[0].max_inflight:"},
		{"unknown engine", Config{Backends: []BackendConfig{{URL: "http://d:1", Role: RoleDecode, Engine: "trt"}}, Engines: testEngines}, "backends[0].engine:"},
		{"negative kv_hold_timeout", Config{Backends: []BackendConfig{{URL: "http://d:1", Role: RoleDecode, KVHoldTimeout: -time.Second}}}, "backends[0].kv_hold_timeout:"},
		{"unknown prefill policy", Config{Backends: []BackendConfig{decoder}, PrefillPolicy: "random"}, "prefill_policy: unknown policy"},
		{"unknown decode policy", Config{Backends: []BackendConfig{decoder}, DecodePolicy: "fastest"}, "decode_policy: unknown policy"},
		{"negative prefix_tokens", Config{Backends: []BackendConfig{decoder}, PrefixTokens: -1}, "prefix_tokens:"},
		{"health path without slash", Config{Backends: []BackendConfig{decoder}, Health: HealthConfig{Path: "health"}}, "health.path:"},
		{"max_backoff below base", Config{Backends: []BackendConfig{decoder}, Ejection: EjectionConfig{BaseBackoff: time.Minute, MaxBackoff: 30 * time.Second}}, "ejection.max_backoff:"},
		{"base_backoff shorter than the health interval", Config{Backends: []BackendConfig{decoder}, Ejection: EjectionConfig{BaseBackoff: time.Second}}, "ejection.base_backoff: 1s is shorter than health.interval 5s"},
		{"base_backoff shorter than a set health interval", Config{Backends: []BackendConfig{decoder}, Health: HealthConfig{Interval: 10 * time.Second}, Ejection: EjectionConfig{BaseBackoff: 5 * time.Second}}, "set at least 10s"},
		{"negative queue timeout", Config{Backends: []BackendConfig{decoder}, Queue: QueueConfig{Timeout: -1}}, "queue.timeout:"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.cfg.Validate()
			if err == nil {
				t.Fatalf("Validate() = nil, want error containing %q", tt.want)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Errorf("Validate() = %q, want it to contain %q", err, tt.want)
			}
		})
	}
}

func TestValidateReportsEveryBadField(t *testing.T) {
	cfg := Config{Backends: []BackendConfig{{URL: "ftp://x", Role: "x"}}, DecodePolicy: "nope"}
	err := cfg.Validate()
	for _, want := range []string{"backends[0].url", "backends[0].role", "decode_policy", "backends: at least one"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Validate() = %v, want it to mention %s", err, want)
		}
	}
}

func TestYAMLConfig(t *testing.T) {
	const full = `
backends:
  - url: http://prefill-0:8000
    role: prefill
    engine: sim
    kv_hold_timeout: 30s
  - name: big
    url: http://decode-0:8000
    role: decode
    weight: 3
    max_inflight: 64
prefill_policy: prefix_affinity
decode_policy: power_of_two
prefix_tokens: 128
health:
  interval: 2s
  timeout: 500ms
  unhealthy_threshold: 3
  healthy_threshold: 2
  path: /ready
ejection:
  consecutive_failures: 5
  base_backoff: 2s
  max_backoff: 1m
queue:
  size: 10
  timeout: 3s
`
	tests := []struct {
		name  string
		yaml  string
		check func(t *testing.T, c Config)
	}{
		{"every key is read", full, func(t *testing.T, c Config) {
			p, d := c.Backends[0], c.Backends[1]
			if p.Name != "prefill-0:8000" || p.Engine != "sim" || p.KVHoldTimeout != 30*time.Second || p.Role != RolePrefill {
				t.Errorf("prefill backend = %+v", p)
			}
			if d.Name != "big" || d.Weight != 3 || d.MaxInflight != 64 || d.Engine != "vllm" || d.KVHoldTimeout != 480*time.Second {
				t.Errorf("decode backend = %+v", d)
			}
			if c.PrefillPolicy != "prefix_affinity" || c.DecodePolicy != "power_of_two" || c.PrefixTokens != 128 {
				t.Errorf("policies = %q %q %d", c.PrefillPolicy, c.DecodePolicy, c.PrefixTokens)
			}
			want := HealthConfig{Interval: 2 * time.Second, Timeout: 500 * time.Millisecond, UnhealthyThreshold: 3, HealthyThreshold: 2, Path: "/ready"}
			if c.Health != want {
				t.Errorf("health = %+v, want %+v", c.Health, want)
			}
			if c.Ejection != (EjectionConfig{ConsecutiveFailures: 5, BaseBackoff: 2 * time.Second, MaxBackoff: time.Minute}) {
				t.Errorf("ejection = %+v", c.Ejection)
			}
			if c.Queue != (QueueConfig{Size: 10, Timeout: 3 * time.Second}) {
				t.Errorf("queue = %+v", c.Queue)
			}
		}},
		{"missing interval means 5s", "backends: [{url: 'http://d:1', role: decode}]\nhealth: {path: /h}\n", func(t *testing.T, c Config) {
			if c.Health.Interval != 5*time.Second || c.Health.Path != "/h" {
				t.Errorf("health = %+v", c.Health)
			}
		}},
		{"interval 0 disables checks", "backends: [{url: 'http://d:1', role: decode}]\nhealth: {interval: 0}\n", func(t *testing.T, c Config) {
			if c.Health.Interval >= 0 {
				t.Errorf("interval = %v, want negative (disabled)", c.Health.Interval)
			}
		}},
		{"interval 0s disables checks", "backends: [{url: 'http://d:1', role: decode}]\nhealth:\n  interval: 0s\n", func(t *testing.T, c Config) {
			if c.Health.Interval >= 0 {
				t.Errorf("interval = %v, want negative (disabled)", c.Health.Interval)
			}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := Config{Engines: testEngines}
			if err := yaml.Unmarshal([]byte(tt.yaml), &c); err != nil {
				t.Fatalf("unmarshal: %v", err)
			}
			if err := c.Validate(); err != nil {
				t.Fatalf("Validate: %v", err)
			}
			tt.check(t, c)
		})
	}
}

func TestYAMLBadIntervalIsAnError(t *testing.T) {
	var c Config
	err := yaml.Unmarshal([]byte("health: {interval: soon}\n"), &c)
	if err == nil || !strings.Contains(err.Error(), "health.interval") {
		t.Fatalf("unmarshal = %v, want a health.interval error", err)
	}
}
