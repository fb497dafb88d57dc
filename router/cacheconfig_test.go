package router

import (
	"strings"
	"testing"

	"github.com/pdproxy/pdproxy/router/routerconfig"
)

func TestReloadRefusesToChangeWhatKVEventsReadAtStart(t *testing.T) {
	cfg := routerconfig.Config{Backends: backendsCfg(routerconfig.RoleDecode, "d", 1, 0), KVEvents: routerconfig.KVEventsConfig{Listen: "tcp://127.0.0.1:0"}}
	r, _, _ := newTestRouter(t, cfg)
	changed := cfg
	changed.Health.Interval = -1
	changed.KVEvents.Listen = "tcp://127.0.0.1:5999"
	if err := r.Reload(changed); err == nil || !strings.Contains(err.Error(), "read at start") {
		t.Errorf("Reload with another kv_events.listen = %v, want it refused", err)
	}
	same := cfg
	same.Health.Interval = -1
	same.CacheAware.DecodeCostTokens = 32
	if err := r.Reload(same); err != nil {
		t.Errorf("Reload changing only cache_aware = %v, want it applied", err)
	}
}
