package routerconfig

// Policy names accepted by Config.PrefillPolicy and Config.DecodePolicy.
const (
	PolicyLeastInflight  = "least_inflight"
	PolicyRoundRobin     = "round_robin"
	PolicyPowerOfTwo     = "power_of_two"
	PolicyPrefixAffinity = "prefix_affinity"
	PolicyLeastLoaded    = "least_loaded"
	// PolicyCacheAware routes by the text routed to each engine before.
	PolicyCacheAware = "cache_aware"
	// PolicyPreciseCacheAware routes by the blocks each engine's KV events say it holds,
	// falling back to cache_aware's view.
	PolicyPreciseCacheAware = "precise_cache_aware"
)

// PolicyCaps are what a policy needs beyond a pool of candidates. Code outside the table of
// policies asks them, never a policy's name.
type PolicyCaps struct {
	// WantsTokens: it scores a request by its tokens, which the proxy asks a tokenizer for
	// before the pick, and so needs one.
	WantsTokens bool
	// NeedsKVEvents: it reads the engines' KV events, so some must be configured.
	NeedsKVEvents bool
	// ScrapesLoad: it weighs engines' load by their /metrics, which the router scrapes for
	// its pool every scrape_interval.
	ScrapesLoad bool
	// ByCost: it places by the predicted cost of the prefill, so its pool has a predicted
	// time to first token.
	ByCost bool
	// SharesPlacements: it weighs the text each replica routed (cache_aware alone, and
	// precise_cache_aware until the engines' KV events tell), so that replicas sharing state
	// tell each other where the heads of prompts went.
	SharesPlacements bool
}

// Policies is every policy config may name and what it needs, in the order an error lists
// them (hence a slice, not a map). It is never written: the router builds each by its name,
// and a test holds its constructors to this table.
var Policies = []struct {
	Name string
	Caps PolicyCaps
}{
	{Name: PolicyLeastInflight},
	{Name: PolicyRoundRobin},
	{Name: PolicyPowerOfTwo},
	{Name: PolicyPrefixAffinity},
	{Name: PolicyLeastLoaded, Caps: PolicyCaps{ScrapesLoad: true}},
	{Name: PolicyCacheAware, Caps: PolicyCaps{ScrapesLoad: true, ByCost: true, SharesPlacements: true}},
	{Name: PolicyPreciseCacheAware, Caps: PolicyCaps{WantsTokens: true, NeedsKVEvents: true, ScrapesLoad: true, ByCost: true, SharesPlacements: true}},
}

// CapsOf is what the policy called name needs; ok is false for a name config may not use.
func CapsOf(name string) (caps PolicyCaps, ok bool) {
	for _, p := range Policies {
		if p.Name == name {
			return p.Caps, true
		}
	}
	return PolicyCaps{}, false
}

// PolicyNames lists the policies config may name, in Policies' order.
func PolicyNames() []string {
	names := make([]string, len(Policies))
	for i, p := range Policies {
		names[i] = p.Name
	}
	return names
}

// policyWith is the first of the config's policies that has the capability has, by name;
// ok is false when neither has it.
func (c *Config) policyWith(has func(PolicyCaps) bool) (name string, ok bool) {
	for _, n := range []string{c.PrefillPolicy, c.DecodePolicy} {
		if caps, known := CapsOf(n); known && has(caps) {
			return n, true
		}
	}
	return "", false
}

// Capabilities, for Config.policyWith.
func wantsTokens(c PolicyCaps) bool   { return c.WantsTokens }
func needsKVEvents(c PolicyCaps) bool { return c.NeedsKVEvents }
func byCost(c PolicyCaps) bool        { return c.ByCost }

// UsesTokens reports whether a pool's policy scores requests by their tokens
// (precise_cache_aware), for which the request is tokenized before it is routed.
func (c *Config) UsesTokens() bool {
	_, ok := c.policyWith(wantsTokens)
	return ok
}
