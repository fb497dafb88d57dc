package router

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// keyedStored is vLLM's BlockStored of a prompt's first blocks computed for a request of
// adapter lora (its lora_id 1) and cache_salt salt, with the extra keys vLLM hashed them
// with: the adapter's name in every block, the salt in the first.
func keyedStored(hashes []uint64, tokens []uint32, lora, salt string) []any {
	extra := make([]any, len(hashes))
	for i := range extra {
		var keys []any
		if lora != "" {
			keys = append(keys, lora)
		}
		if i == 0 && salt != "" {
			keys = append(keys, salt)
		}
		if keys != nil {
			extra[i] = keys
		}
	}
	var loraName, loraID any
	if lora != "" {
		loraName, loraID = lora, 1
	}
	return []any{"BlockStored", hashes, nil, tokens, kvBlock, loraID, "GPU", loraName, extra, 0, "full_attention", nil}
}

func TestPreciseCacheAwareMatchesOnlyTheLoRAAndSaltTheBlocksWereComputedUnder(t *testing.T) {
	prompt := promptTokens(0, 64*kvBlock)
	next := append(append([]uint32(nil), prompt...), promptTokens(9000, kvBlock)...)
	busy := map[string]int{"d1": 8} // d1 busier than the others by more than a tie, but within balance
	tests := []struct {
		name        string
		lora, salt  string // what d1's blocks were computed under
		hint        Hint
		wantOnD1    bool
		wantCached  int
		wantDropped float64
	}{
		{"the adapter's request goes where its adapter's blocks are", "ad", "", Hint{Tokens: next, LoRA: "ad"}, true, 64 * kvBlock, 0},
		{"the base model's request is not drawn by an adapter's blocks", "ad", "", Hint{Tokens: next}, false, 0, 0},
		{"an adapter's request is not drawn by the base model's blocks", "", "", Hint{Tokens: next, LoRA: "ad"}, false, 0, 0},
		{"a tenant's request goes where its salted blocks are", "", "a", Hint{Tokens: next, CacheSalt: "a"}, true, 64 * kvBlock, 0},
		{"another tenant's request is not drawn by them", "", "a", Hint{Tokens: next, CacheSalt: "b"}, false, 0, 0},
		{"nor an unsalted one", "", "a", Hint{Tokens: next}, false, 0, 0},
		{"an adapter's salted blocks need both", "ad", "a", Hint{Tokens: next, LoRA: "ad"}, false, 0, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := startPrecise(t, listenCfg())
			listen := r.listenAddr(t)
			for i, name := range []string{"d0", "d1", "d2"} {
				p := newKVPublisher(t, listen, fmt.Sprintf("kv@10.0.0.%d:8000@model", i+1))
				r.connect(t, p, name)
				if name == "d1" {
					p.publish(keyedStored(hashesOf(7, 64), prompt, tt.lora, tt.salt))
				}
			}
			r.waitBlocks(t, "d1", 64)
			if got := r.pick(t, tt.hint, busy); (got == "d1") != tt.wantOnD1 {
				t.Errorf("picked %s; want d1: %v", got, tt.wantOnD1)
			}
			if n, ok := r.CachedTokens("d1", tt.hint); !ok || n != tt.wantCached {
				t.Errorf("CachedTokens(d1) = %d, %v; want %d, true", n, ok, tt.wantCached)
			}
			for _, reason := range []string{"extra_keys", "malformed", "unknown_parent"} {
				if n := testutil.Value(t, r.reg, "pdproxy_kv_events_dropped_total", map[string]string{"backend": "d1", "reason": reason}); n != 0 {
					t.Errorf("%v events of d1 dropped for %s, want none", n, reason)
				}
			}
		})
	}
}

func TestAModelsBlocksNeverDrawAnotherModelsRequest(t *testing.T) {
	cfg := listenCfg()
	cfg.Backends[0].Models, cfg.Backends[1].Models, cfg.Backends[2].Models = []string{"m2"}, []string{"m1"}, []string{"m2"}
	r := startPrecise(t, cfg)
	listen := r.listenAddr(t)
	prompt := promptTokens(0, 64*kvBlock)
	for i, name := range []string{"d0", "d1", "d2"} {
		p := newKVPublisher(t, listen, fmt.Sprintf("kv@10.0.0.%d:8000@model", i+1))
		r.connect(t, p, name)
		if name == "d1" {
			p.publish(blockStored(hashesOf(7, 64), nil, prompt))
		}
	}
	r.waitBlocks(t, "d1", 64)
	for range 4 {
		if got := r.pick(t, Hint{Tokens: prompt, Model: "m2"}, nil); got == "d1" {
			t.Fatal("a request for m2 went to d1, which serves m1 and holds the same tokens of its own model")
		}
	}
}

func TestAnAdapterIsKnownByItsParentInTheModelList(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.URL.Path != "/v1/models" {
			return // the health check passes
		}
		parent := "llama"
		type model struct {
			ID     string  `json:"id"`
			Parent *string `json:"parent"`
		}
		json.NewEncoder(w).Encode(map[string]any{"data": []model{{ID: "llama"}, {ID: "llama-alias"}, {ID: "sql", Parent: &parent}}})
	}))
	t.Cleanup(srv.Close)
	r, _, _ := newTestRouter(t, routerconfig.Config{Backends: []routerconfig.BackendConfig{{Name: "d0", URL: srv.URL, Role: routerconfig.RoleDecode}},
		Health: routerconfig.HealthConfig{Interval: 5 * time.Millisecond}})
	runRouter(t, r)
	testutil.Eventually(t, testutil.Timeout, func() bool { return r.Adapter("sql") }, "sql known as an adapter")
	for _, m := range []string{"llama", "llama-alias", "mistral", ""} {
		if r.Adapter(m) {
			t.Errorf("%q taken for an adapter", m)
		}
	}
}
