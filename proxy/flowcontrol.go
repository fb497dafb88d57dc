package proxy

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/pdproxy/pdproxy/router"
)

// FlowControlConfig shares the engines among tenants when every engine is at max_inflight:
// the requests that wait, wait in one queue per tenant, served by weight (the router's fair
// queue), so that a tenant that floods delays its own requests and no one else's; the
// priority classes order each tenant's own. A request's tenant is the tenant TenantHeader
// names, else the one its API key belongs to (APIKeySHA256), else its API key alone (or,
// without one, its connection's address) as a tenant of DefaultWeight. All zero, the default,
// means no flow control: one queue, first come, first served within the classes.
type FlowControlConfig struct {
	// TenantHeader names a request header (e.g. X-Tenant) whose value is the request's
	// tenant: a tenant of Tenants by its name, else a tenant of default_weight of its own.
	// Only a gateway that sets it for its clients should be trusted with it. Empty means the
	// tenant comes from the API key.
	TenantHeader string `yaml:"tenant_header"`
	// Tenants are the tenants with a name (the tenant label of the flow metrics), a weight,
	// and the keys that are theirs. Empty means every tenant is of DefaultWeight.
	Tenants map[string]TenantConfig `yaml:"tenants"`
	// DefaultWeight is the weight of a tenant Tenants does not name. [1]
	DefaultWeight int `yaml:"default_weight"`
	// QueueTimeout is the longest a request waits in the queue before a 503. [queue.timeout]
	QueueTimeout time.Duration `yaml:"queue_timeout"`
	// MaxQueuePerTenant bounds a tenant's requests waiting in one role's queue: one more is a
	// 429. [0: the tenant's weighted share of queue.size, once the queue is full]
	MaxQueuePerTenant int `yaml:"max_queue_per_tenant"`
	// SaturationTTFT, when set, saturates a pool placed by cost (cache_aware,
	// precise_cache_aware) while even its best engine's predicted time to first token is
	// over it with work already there: requests then wait in their tenants' queues, so that
	// the admitted ones start within it. [0: a pool saturates only when every engine is at
	// max_inflight]
	SaturationTTFT time.Duration `yaml:"saturation_ttft"`
	// ReservedSlots are the free slots of each pool that a tenant with a request in flight
	// may not take while another tenant, active within the last second, has nothing in
	// flight and nothing waiting: a flood then leaves room for a quiet tenant's next request
	// to start at once, at the cost of those slots idling while the quiet tenant is idle.
	// [DefaultReservedSlots; negative: none, every slot to whoever waits]
	ReservedSlots int `yaml:"reserved_slots"`
}

// Slots is the reserved slots cfg gives each pool: none without flow control.
func (c FlowControlConfig) Slots() int {
	switch {
	case !c.on() || c.ReservedSlots < 0:
		return 0
	case c.ReservedSlots == 0:
		return DefaultReservedSlots
	}
	return c.ReservedSlots
}

// DefaultReservedSlots is flow_control.reserved_slots when it is not set.
const DefaultReservedSlots = 1

// TenantConfig is one named tenant.
type TenantConfig struct {
	// Weight is the tenant's share of the engines while its requests wait, against the
	// other tenants with requests waiting. [default_weight]
	Weight int `yaml:"weight"`
	// APIKeySHA256 are the SHA-256 digests, in hex, of the client API keys that are this
	// tenant's (printf %s "$KEY" | sha256sum): the keys themselves stay out of the config.
	// Empty means the tenant is known by TenantHeader alone.
	APIKeySHA256 []string `yaml:"api_key_sha256"`
}

// reservedTenants are tenant label values the proxy uses itself.
var reservedTenants = []string{"default", "other", "none"}

// on reports whether flow control is configured.
func (c FlowControlConfig) on() bool {
	return c.TenantHeader != "" || len(c.Tenants) > 0 || c.DefaultWeight != 0 || c.QueueTimeout != 0 || c.MaxQueuePerTenant != 0 ||
		c.SaturationTTFT != 0 || c.ReservedSlots != 0
}

// tenants finds each request's tenant, as a flow of the router's fair queue.
type tenants struct {
	header string
	byName map[string]router.Flow
	byKey  map[[sha256.Size]byte]router.Flow
	// def is a tenant of no name's flow, less its Key.
	def  router.Flow
	wait time.Duration
}

// newTenants builds the lookup of cfg (checked); nil when flow control is off. A digest that
// none of keys has is refused: with client keys configured, no request could match it.
func newTenants(cfg FlowControlConfig, keys *keyring) (*tenants, error) {
	if !cfg.on() {
		return nil, nil
	}
	t := &tenants{byName: map[string]router.Flow{}, byKey: map[[sha256.Size]byte]router.Flow{}, wait: cfg.QueueTimeout,
		def: router.Flow{Label: "default", Weight: float64(cfg.DefaultWeight), MaxQueue: cfg.MaxQueuePerTenant}}
	if cfg.TenantHeader != "" {
		t.header = http.CanonicalHeaderKey(cfg.TenantHeader)
	}
	for name, tc := range cfg.Tenants {
		f := router.Flow{Key: "tenant\x00" + name, Label: name, Weight: float64(tc.Weight), MaxQueue: cfg.MaxQueuePerTenant}
		t.byName[name] = f
		for _, d := range tc.APIKeySHA256 {
			var digest [sha256.Size]byte
			hex.Decode(digest[:], []byte(d)) // checked by CheckFlowControl
			if keys != nil && !slices.Contains(keys.digests, digest) {
				return nil, fmt.Errorf("flow_control.tenants.%s.api_key_sha256: %s… is the digest of none of the client keys (api_keys_file, api_keys_env): no request could be of it", name, d[:8])
			}
			t.byKey[digest] = f
		}
	}
	return t, nil
}

// flowOf is r's tenant: the one its tenant header names, else its key's, else its key (or
// address) alone as a tenant of the default weight. The key and header value reach the
// router only hashed.
func (t *tenants) flowOf(r *http.Request) router.Flow {
	if t == nil {
		return router.Flow{}
	}
	if t.header != "" {
		if v := strings.TrimSpace(r.Header.Get(t.header)); v != "" {
			if f, ok := t.byName[v]; ok {
				return f
			}
			return t.anonymous("header", v)
		}
	}
	if tok, ok := clientKey(r); ok {
		if f, ok := t.byKey[sha256.Sum256([]byte(tok))]; ok {
			return f
		}
		return t.anonymous("key", tok)
	}
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		host = r.RemoteAddr
	}
	return t.anonymous("ip", host)
}

func (t *tenants) anonymous(kind, id string) router.Flow {
	d := sha256.Sum256([]byte(kind + "\x00" + id))
	f := t.def
	f.Key = hex.EncodeToString(d[:16])
	return f
}
