package app

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/pdproxy/pdproxy/router/routerconfig"
	"go.uber.org/zap/zaptest"
)

// poolConfig is a config of one prefiller and one decoder of each engine kind given, at
// addresses where nothing listens, with health checks off.
func poolConfig(kinds ...string) Config {
	c := Config{Listen: "127.0.0.1:0"}
	c.Router.Health.Interval = -1
	for i, k := range kinds {
		p := routerconfig.BackendConfig{Name: fmt.Sprintf("p%d", i), URL: fmt.Sprintf("http://127.0.0.1:%d", 2*i+1), Role: routerconfig.RolePrefill, Engine: k}
		d := routerconfig.BackendConfig{Name: fmt.Sprintf("d%d", i), URL: fmt.Sprintf("http://127.0.0.1:%d", 2*i+2), Role: routerconfig.RoleDecode, Engine: k}
		if k == "sglang" || k == "mooncake" {
			p.BootstrapPort = 8998 // nothing to ask at start
		}
		c.Router.Backends = append(c.Router.Backends, p, d)
	}
	return c
}

// The keys of the sequential flow, each set to its value other than the default: what only
// an engine that runs a prefill, then a decode (vLLM's NixlConnector) reads.
var sequentialKeySettings = []struct {
	key, value string
	set        func(c *Config)
}{
	{"decoder_reservation", "after_prefill", func(c *Config) { c.Proxy.DecoderReservation = "after_prefill" }},
	{"abort_during_prefill", "finish_then_release", func(c *Config) { c.Proxy.AbortDuringPrefill = "finish_then_release" }},
	{"kv_release", "abort", func(c *Config) { c.Proxy.KVRelease = "abort" }},
	{"kv_release", "wait", func(c *Config) { c.Proxy.KVRelease = "wait" }},
	{"abort_during_kv_pull", "after_first_token", func(c *Config) { c.Proxy.AbortDuringKVPull = "after_first_token" }},
}

// A pool whose every engine sends both legs at once (SGLang, Mooncake) never reads the keys
// of the sequential flow: one set to a value of its own is refused at startup, naming the key
// and why, rather than accepted and ignored.
func TestStartRefusesASequentialFlowKeyWhenEveryEngineIsPaired(t *testing.T) {
	pools := map[string][]string{
		"an SGLang pool":            {"sglang"},
		"a Mooncake pool":           {"mooncake"},
		"SGLang and Mooncake pools": {"sglang", "mooncake"},
	}
	for pool, kinds := range pools {
		for _, k := range sequentialKeySettings {
			t.Run(pool+", "+k.key+" "+k.value, func(t *testing.T) {
				c := poolConfig(kinds...)
				k.set(&c)
				m, err := New(c, zaptest.NewLogger(t))
				if err != nil {
					t.Fatal(err)
				}
				err = m.Start(context.Background())
				if err == nil {
					m.Shutdown(context.Background())
					t.Fatal("Start accepted the config")
				}
				for _, w := range append([]string{k.key + ": " + k.value, "cannot take effect", "paired engine", "prefill, then a decode"}, kinds...) {
					if !strings.Contains(err.Error(), w) {
						t.Errorf("Start: %v\nwant it to name %q", err, w)
					}
				}
			})
		}
	}
}

// The same keys are accepted where a backend of a sequential engine reads them, paired pools
// beside it or not; and on a paired pool, the keys set to their defaults change nothing.
func TestStartAcceptsASequentialFlowKeyThatABackendReads(t *testing.T) {
	start := func(t *testing.T, c Config) {
		m, err := New(c, zaptest.NewLogger(t))
		if err != nil {
			t.Fatal(err)
		}
		if err := m.Start(context.Background()); err != nil {
			t.Fatalf("Start: %v", err)
		}
		if err := m.Shutdown(context.Background()); err != nil {
			t.Errorf("Shutdown: %v", err)
		}
	}
	pools := map[string][]string{
		"a vLLM NIXL pool":                       {"vllm"},
		"a vLLM NIXL pool beside an SGLang one":  {"vllm", "sglang"},
		"a vLLM NIXL pool beside a Mooncake one": {"mooncake", "vllm"},
		"a simulated pool beside an SGLang one":  {"sglang", "sim"},
	}
	for pool, kinds := range pools {
		for _, k := range sequentialKeySettings {
			t.Run(pool+", "+k.key+" "+k.value, func(t *testing.T) {
				c := poolConfig(kinds...)
				k.set(&c)
				start(t, c)
			})
		}
	}
	t.Run("an SGLang pool, every key set to its default", func(t *testing.T) {
		c := poolConfig("sglang")
		c.Proxy.DecoderReservation, c.Proxy.AbortDuringPrefill = "before_prefill", "cancel"
		c.Proxy.KVRelease, c.Proxy.AbortDuringKVPull = "drain", "immediate"
		start(t, c)
	})
}

// Every example config passes the checks Start makes of the proxy's keys against its
// engines, its simulated engines among them.
func TestEveryExampleConfigPassesTheStartupChecksOfItsEngines(t *testing.T) {
	files, err := filepath.Glob("../../../configs/*.yaml")
	if err != nil || len(files) < 3 {
		t.Fatalf("configs/*.yaml: %v %v", files, err)
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			data, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			c, err := ParseConfig(data)
			if err != nil {
				t.Fatal(err)
			}
			rc := c.Router
			for i, sc := range c.Sims {
				rc.Backends = append(rc.Backends, routerconfig.BackendConfig{Name: fmt.Sprintf("sim-%d", i), Role: routerconfig.Role(sc.Role), Engine: engineKind(sc)})
			}
			if err := checkConditional(c.Proxy, rc); err != nil {
				t.Error(err)
			}
		})
	}
}

// A reload that leaves only paired engines behind a sequential flow key the running config
// sets is refused the same way, and the running backends stay.
func TestReloadRefusesToLeaveASequentialFlowKeyToPairedEnginesAlone(t *testing.T) {
	c := poolConfig("vllm", "mooncake")
	c.Proxy.KVRelease = "abort"
	m, err := New(c, zaptest.NewLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Start(context.Background()); err != nil {
		t.Fatalf("Start: %v", err)
	}
	defer m.Shutdown(context.Background())
	path := filepath.Join(t.TempDir(), "paired.yaml")
	file := `backends:
  - {name: p1, url: "http://127.0.0.1:3", role: prefill, engine: mooncake, bootstrap_port: 8998}
  - {name: d1, url: "http://127.0.0.1:4", role: decode, engine: mooncake}
`
	if err := os.WriteFile(path, []byte(file), 0o600); err != nil {
		t.Fatal(err)
	}
	err = m.Reload(path)
	if err == nil || !strings.Contains(err.Error(), "kv_release: abort cannot take effect") {
		t.Fatalf("Reload = %v; want a refusal naming kv_release", err)
	}
	if n := len(m.Router.Backends()); n != 4 {
		t.Errorf("%d backends after the refused reload, want the 4 running ones", n)
	}
}
