package proxy

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"maps"
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

// CheckFlowControl checks cfg's flow_control, filling its defaults, against the router's
// queue (nil: checked as far as it goes without it). It refuses what could not take effect:
// a queue that lets nothing wait, a per-tenant bound above the queue's size, a tenant header
// another setting reads, a key digest that no configured key has.
func CheckFlowControl(cfg *Config, queue *router.QueueConfig) error {
	c := &cfg.FlowControl
	if !c.on() {
		return nil
	}
	switch {
	case c.DefaultWeight < 0:
		return fmt.Errorf("flow_control.default_weight: %d is negative", c.DefaultWeight)
	case c.DefaultWeight == 0:
		c.DefaultWeight = 1
	}
	if c.QueueTimeout < 0 {
		return fmt.Errorf("flow_control.queue_timeout: %v is negative", c.QueueTimeout)
	}
	if c.ReservedSlots == 0 {
		c.ReservedSlots = DefaultReservedSlots
	}
	if c.SaturationTTFT < 0 {
		return fmt.Errorf("flow_control.saturation_ttft: %v is negative", c.SaturationTTFT)
	}
	if c.MaxQueuePerTenant < 0 {
		return fmt.Errorf("flow_control.max_queue_per_tenant: %d is negative", c.MaxQueuePerTenant)
	}
	if h := http.CanonicalHeaderKey(c.TenantHeader); h != "" {
		for _, other := range []struct{ key, header string }{
			{"priority.header", cfg.Priority.Header}, {"prefiller_header", cfg.PrefillerHeader},
		} {
			if h == http.CanonicalHeaderKey(other.header) {
				return fmt.Errorf("flow_control.tenant_header: %s is %s too; one header cannot name both", c.TenantHeader, other.key)
			}
		}
		for _, s := range cfg.SessionAffinity.Headers {
			if h == http.CanonicalHeaderKey(s) {
				return fmt.Errorf("flow_control.tenant_header: %s is a session_affinity header too; one header cannot name both", c.TenantHeader)
			}
		}
	}
	digests := map[string]string{}
	c.Tenants = maps.Clone(c.Tenants) // the defaults go into a map of this config's own
	for _, name := range slices.Sorted(maps.Keys(c.Tenants)) {
		t := c.Tenants[name]
		f := "flow_control.tenants." + name
		switch {
		case !className.MatchString(name) || slices.Contains(reservedTenants, name):
			return fmt.Errorf("%s: %q is not 1 to 32 of a-z, 0-9, _ and -, or is a reserved name (%s)", f, name, strings.Join(reservedTenants, ", "))
		case t.Weight < 0:
			return fmt.Errorf("%s.weight: %d is negative", f, t.Weight)
		case t.Weight == 0:
			t.Weight = c.DefaultWeight
		}
		if len(t.APIKeySHA256) == 0 && c.TenantHeader == "" {
			return fmt.Errorf("%s: names no api_key_sha256 and there is no tenant_header: no request could be of it", f)
		}
		t.APIKeySHA256 = slices.Clone(t.APIKeySHA256)
		for i, d := range t.APIKeySHA256 {
			d = strings.ToLower(strings.TrimSpace(d))
			if b, err := hex.DecodeString(d); err != nil || len(b) != sha256.Size {
				return fmt.Errorf("%s.api_key_sha256[%d]: not a SHA-256 digest in hex (64 digits)", f, i)
			}
			if other, dup := digests[d]; dup {
				return fmt.Errorf("%s.api_key_sha256[%d]: the key is %s's too", f, i, other)
			}
			digests[d] = name
			t.APIKeySHA256[i] = d
		}
		c.Tenants[name] = t
	}
	if queue == nil {
		return nil
	}
	size := queue.Size
	if size == 0 {
		size = router.DefaultQueueSize
	}
	switch {
	case size < 0:
		return fmt.Errorf("flow_control: set, but queue.size is %d: no request waits, so there is no queue to share; set queue.size", queue.Size)
	case c.MaxQueuePerTenant > size:
		return fmt.Errorf("flow_control.max_queue_per_tenant: %d is above queue.size (%d), which bounds every tenant first; lower it or raise queue.size", c.MaxQueuePerTenant, size)
	}
	return nil
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
