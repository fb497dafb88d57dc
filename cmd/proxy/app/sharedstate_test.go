package app

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/pdproxy/pdproxy/internal/redistest"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

func TestParseConfigReadsTheSharedStateKeys(t *testing.T) {
	const doc = `
limits:
  per_key: {requests_per_second: 5, burst: 5}
shared_state:
  redis: {addr: "redis:6379", username: proxy, password_file: /run/secrets/redis, db: 2, tls: true, timeout: 3ms, key_prefix: "prod:"}
  slot_ttl: 20s
`
	c, err := ParseConfig([]byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	r := c.SharedState.Redis
	if r.Addr != "redis:6379" || r.Username != "proxy" || r.PasswordFile != "/run/secrets/redis" || r.DB != 2 || !r.TLS ||
		r.Timeout == nil || *r.Timeout != 3*time.Millisecond || r.KeyPrefix != "prod:" || c.SharedState.SlotTTL != 20*time.Second {
		t.Errorf("shared_state = %+v (timeout %v)", c.SharedState, r.Timeout)
	}
	if err := checkSharedState(c); err != nil {
		t.Errorf("checkSharedState: %v", err)
	}
	if _, err := ParseConfig([]byte("shared_state:\n  redis:\n    adress: redis:6379\n")); err == nil || !strings.Contains(err.Error(), "adress") {
		t.Errorf("a misspelt shared_state key: %v", err)
	}
}

// A pool on either cache-aware policy uses a shared_state on its own: the replicas tell each
// other where the heads of prompts went (under precise_cache_aware, until the engines' events
// tell). A pool on any other policy does not.
func TestASharedStateIsUsedByACacheAwarePool(t *testing.T) {
	for _, tt := range []struct {
		prefill, decode string
		used            bool
	}{
		{routerconfig.PolicyCacheAware, routerconfig.PolicyLeastInflight, true},
		{routerconfig.PolicyLeastInflight, routerconfig.PolicyCacheAware, true},
		{routerconfig.PolicyPreciseCacheAware, routerconfig.PolicyPreciseCacheAware, true},
		{routerconfig.PolicyLeastLoaded, routerconfig.PolicyPrefixAffinity, false},
		{"", "", false},
	} {
		var c Config
		c.SharedState.Redis.Addr = "127.0.0.1:6379"
		c.Router.PrefillPolicy, c.Router.DecodePolicy = tt.prefill, tt.decode
		err := checkSharedState(c)
		if used := err == nil; used != tt.used {
			t.Errorf("prefill %q, decode %q: checkSharedState = %v, want it used: %v", tt.prefill, tt.decode, err, tt.used)
		}
	}
}

// A shared_state that could not take effect is refused at startup, saying why.
func TestStartRefusesASharedStateThatCannotTakeEffect(t *testing.T) {
	zero := time.Duration(0)
	limited := func(c *Config) { c.Proxy.Limits.PerKey.RequestsPerSecond = 5 }
	for _, tt := range []struct {
		name string
		edit func(c *Config)
		want string
	}{
		{"no per_key limit to share", func(c *Config) { c.SharedState.Redis.Addr = "127.0.0.1:6379" },
			"shared_state: nothing would use it"},
		{"a tenant header alone", func(c *Config) {
			c.SharedState.Redis.Addr = "127.0.0.1:6379"
			c.Proxy.Limits.TenantHeader = "X-Tenant"
		}, "shared_state: nothing would use it"},
		{"a budget of 0", func(c *Config) {
			limited(c)
			c.SharedState.Redis.Addr = "127.0.0.1:6379"
			c.SharedState.Redis.Timeout = &zero
		}, "shared_state.redis.timeout: 0s is not positive"},
		{"keys without an address", func(c *Config) {
			limited(c)
			c.SharedState.SlotTTL = time.Minute
		}, "shared_state.redis.addr: required"},
		{"a password file that is not there", func(c *Config) {
			limited(c)
			c.SharedState.Redis.Addr = "127.0.0.1:6379"
			c.SharedState.Redis.PasswordFile = filepath.Join(t.TempDir(), "missing")
		}, "shared_state.redis.password_file"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			m, err := New(conditionalConfig("", func(c *Config) {
				c.Proxy.PDUncachedTokenThreshold = 0
				tt.edit(c)
			}), zaptest.NewLogger(t))
			if err != nil {
				t.Fatal(err)
			}
			err = m.Start(context.Background())
			if err == nil {
				m.Shutdown(context.Background())
				t.Fatal("Start accepted the config")
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Errorf("Start: %v; want it to say %q", err, tt.want)
			}
		})
	}
}

// A reload that changes shared_state is refused, and the running one stays; a reload that
// keeps it applies the rest.
func TestAReloadThatChangesSharedStateIsRefused(t *testing.T) {
	srv := redistest.Start(t)
	dir := t.TempDir()
	file := filepath.Join(dir, "proxy.yaml")
	doc := func(addr, decoder string) string {
		return fmt.Sprintf(`
listen: 127.0.0.1:0
health: {interval: -1s}
limits:
  per_key: {requests_per_second: 5}
shared_state:
  redis: {addr: %q}
backends:
  - {name: p0, url: "http://127.0.0.1:1", role: prefill}
  - {name: %s, url: "http://127.0.0.1:2", role: decode}
`, addr, decoder)
	}
	write := func(text string) {
		if err := os.WriteFile(file, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write(doc(srv.Addr(), "d0"))
	cfg, err := LoadConfig([]string{"--config", file}, os.Stderr)
	if err != nil {
		t.Fatal(err)
	}
	m, err := New(cfg, zaptest.NewLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := m.Shutdown(context.Background()); err != nil {
			t.Errorf("shutdown: %v", err)
		}
	}()
	testutil.WaitFor(t, testutil.Timeout, func() (bool, string) {
		v := testutil.Value(t, m.Registry, "pdproxy_shared_state_up", nil)
		return v == 1, fmt.Sprintf("pdproxy_shared_state_up = %v", v)
	})

	write(doc("127.0.0.1:1", "d1"))
	if err := m.Reload(file); err == nil || !strings.Contains(err.Error(), "shared_state: changed, and only a restart applies it") {
		t.Fatalf("a reload naming another Redis: %v, want it refused", err)
	}
	if names := decoderNames(m); names != "d0" {
		t.Errorf("decoders after the refused reload: %s, want d0", names)
	}
	write(doc(srv.Addr(), "d1"))
	if err := m.Reload(file); err != nil {
		t.Fatalf("a reload keeping shared_state: %v", err)
	}
	if names := decoderNames(m); names != "d1" {
		t.Errorf("decoders after the reload: %s, want d1", names)
	}
}

func decoderNames(m *Main) string {
	var names []string
	for _, b := range m.Router.Backends() {
		if b.Role == routerconfig.RoleDecode {
			names = append(names, b.Name)
		}
	}
	return strings.Join(names, ",")
}
