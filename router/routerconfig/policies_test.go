package routerconfig

import (
	"strings"
	"testing"
)

func TestAnUnknownPolicyIsRefusedWithTheValidNames(t *testing.T) {
	c := Config{Backends: []BackendConfig{{Name: "d0", URL: "http://127.0.0.1:10100", Role: RoleDecode}}, DecodePolicy: "fastest"}
	err := c.Validate()
	want := `decode_policy: unknown policy "fastest" (want least_inflight, round_robin, power_of_two, prefix_affinity, least_loaded, cache_aware, precise_cache_aware)`
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("Validate = %v, want it to say %q", err, want)
	}
}

// Only a policy that scores by tokens and KV events asks a config for them; any other is
// valid without either, in either role.
func TestOnlyTheKVEventPolicyNeedsKVEventsAndATokenizer(t *testing.T) {
	for _, name := range PolicyNames() {
		for _, role := range []Role{RolePrefill, RoleDecode} {
			t.Run(name+"/"+string(role), func(t *testing.T) {
				c := Config{Backends: []BackendConfig{{Name: "d0", URL: "http://127.0.0.1:10100", Role: RoleDecode}, {Name: "p0", URL: "http://127.0.0.1:10100", Role: RolePrefill}}}
				if role == RolePrefill {
					c.PrefillPolicy = name
				} else {
					c.DecodePolicy = name
				}
				err := c.Validate()
				if name != PolicyPreciseCacheAware {
					if err != nil || c.Tokenizer != "" {
						t.Errorf("Validate = %v, tokenizer %q; want nil and none", err, c.Tokenizer)
					}
					return
				}
				want := "kv_events: precise_cache_aware reads the engines' KV events, and none are configured"
				if err == nil || !strings.Contains(err.Error(), want) || c.Tokenizer != TokenizerEngine {
					t.Errorf("Validate = %v, tokenizer %q; want %q and %q", err, c.Tokenizer, want, TokenizerEngine)
				}
				c.Tokenizer = "none"
				if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "tokenizer: precise_cache_aware needs the request's tokens") {
					t.Errorf("Validate with no tokenizer = %v, want it refused", err)
				}
			})
		}
	}
}
