package router

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// A request for a model goes only to the engines that serve it, whether the config names
// their models or their /v1/models lists them; a model nobody serves has no backend.
func TestRequestsGoOnlyToEnginesServingTheirModel(t *testing.T) {
	listed, quiet, named := newEngine(t), newEngine(t), newEngine(t)
	listed.models.Store([]string{"llama", "llama-lora-sql"})
	named.models.Store([]string{"ignored: the config wins"})
	cfg := healthCfg(routerconfig.HealthConfig{Interval: 5 * time.Millisecond}, listed, quiet, named)
	cfg.Backends[2].Models = []string{"qwen"}
	r, _, _ := newTestRouter(t, cfg)

	// Before the first check nothing is known of d0 and d1: a model absent from every list
	// may still be served.
	if _, complete := r.Models(routerconfig.RoleDecode); complete {
		t.Fatal("models complete before any engine listed its models")
	}
	runRouter(t, r)
	testutil.Eventually(t, testutil.Timeout, func() bool { return len(backendByName(t, r, "d0").Models()) == 2 }, "d0's models listed")
	if m := backendByName(t, r, "d1").Models(); m != nil {
		t.Fatalf("d1 answers /v1/models 404 but has models %v", m)
	}

	pick := func(model string) (string, error) {
		l, err := r.Acquire(context.Background(), routerconfig.RoleDecode, Hint{Model: model})
		if err != nil {
			return "", err
		}
		defer l.Release(Result{Status: 200})
		return l.Backend().Name, nil
	}
	for range 6 {
		if b, err := pick("llama-lora-sql"); err != nil || b == "d2" {
			t.Fatalf("llama-lora-sql went to %s (%v); only d0 lists it, d1's list is unknown", b, err)
		}
		if b, err := pick("qwen"); err != nil || b == "d0" {
			t.Fatalf("qwen went to %s (%v); d0 lists only llama", b, err)
		}
	}

	// Once d1 lists its models too, the set is complete, and a model outside it has nobody.
	quiet.models.Store([]string{"llama"})
	testutil.Eventually(t, testutil.Timeout, func() bool { _, c := r.Models(routerconfig.RoleDecode); return c }, "models complete")
	models, _ := r.Models(routerconfig.RoleDecode)
	if want := []string{"llama", "llama-lora-sql", "qwen"}; !slices.Equal(models, want) {
		t.Fatalf("models %v, want %v", models, want)
	}
	if b, err := pick("mistral"); !errors.Is(err, ErrNoBackend) {
		t.Fatalf("mistral, served nowhere, got %s, %v; want ErrNoBackend", b, err)
	}
	for _, st := range r.Backends() {
		if st.Name == "d2" && !slices.Equal(st.Models, []string{"qwen"}) {
			t.Fatalf("/debug/backends shows d2 serving %v", st.Models)
		}
	}
}

// A waiter for one model does not hold up a waiter behind it for another model whose engine
// has room: each model's requests queue for their own engines.
func TestAQueueForOneModelDoesNotBlockAnother(t *testing.T) {
	cfg := routerconfig.Config{Backends: []routerconfig.BackendConfig{
		{Name: "a", URL: "http://127.0.0.1:1", Role: routerconfig.RoleDecode, MaxInflight: 1, Models: []string{"ma"}},
		{Name: "b", URL: "http://127.0.0.1:2", Role: routerconfig.RoleDecode, MaxInflight: 1, Models: []string{"mb"}},
	}}
	r, _, _ := newTestRouter(t, cfg)
	ctx := context.Background()
	la, err := r.Acquire(ctx, routerconfig.RoleDecode, Hint{Model: "ma"})
	if err != nil {
		t.Fatal(err)
	}
	lb, err := r.Acquire(ctx, routerconfig.RoleDecode, Hint{Model: "mb"})
	if err != nil {
		t.Fatal(err)
	}
	// Both full. One waiter for ma (its engine stays full), then one for mb.
	waitA := make(chan error, 1)
	actx, cancelA := context.WithCancel(ctx)
	defer cancelA()
	go func() {
		l, err := r.Acquire(actx, routerconfig.RoleDecode, Hint{Model: "ma"})
		l.Release(Result{})
		waitA <- err
	}()
	testutil.Eventually(t, testutil.Timeout, func() bool { r.decode.mu.Lock(); defer r.decode.mu.Unlock(); return r.decode.waiters.Len() == 1 }, "ma queued")
	gotB := make(chan string, 1)
	go func() {
		l, err := r.Acquire(ctx, routerconfig.RoleDecode, Hint{Model: "mb"})
		if err != nil {
			gotB <- err.Error()
			return
		}
		gotB <- l.Backend().Name
		l.Release(Result{})
	}()
	testutil.Eventually(t, testutil.Timeout, func() bool { r.decode.mu.Lock(); defer r.decode.mu.Unlock(); return r.decode.waiters.Len() == 2 }, "mb queued")
	lb.Release(Result{Status: 200}) // b frees: mb's waiter, second in line, takes it
	select {
	case name := <-gotB:
		if name != "b" {
			t.Fatalf("mb's waiter got %s", name)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("mb's waiter stayed queued behind ma's while b was free")
	}
	cancelA()
	if err := <-waitA; !errors.Is(err, context.Canceled) {
		t.Fatalf("ma's waiter: %v", err)
	}
	la.Release(Result{})
}

// loraEngine is an engine whose GET /v1/models lists base model llama and, with parent
// llama, the adapters it has loaded (vLLM's --lora-modules, or its /v1/load_lora_adapter at
// runtime); every other path passes the health check.
type loraEngine struct {
	*httptest.Server
	adapters atomic.Pointer[[]string]
}

func newLoRAEngine(t *testing.T, adapters ...string) *loraEngine {
	e := &loraEngine{}
	e.adapters.Store(&adapters)
	e.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.URL.Path != "/v1/models" {
			return
		}
		type model struct {
			ID     string  `json:"id"`
			Parent *string `json:"parent"`
		}
		parent := "llama"
		list := []model{{ID: "llama"}}
		for _, a := range *e.adapters.Load() {
			list = append(list, model{ID: a, Parent: &parent})
		}
		json.NewEncoder(w).Encode(map[string]any{"data": list})
	}))
	t.Cleanup(e.Close)
	return e
}

// An adapter loaded on an engine at runtime draws its requests from the next check on, and
// one unloaded stops drawing them: the cost rule and the other policies pick only among the
// engines that list it now.
func TestAnAdapterLoadedOrUnloadedAtRuntimeJoinsOrLeavesItsCandidatesAtTheNextCheck(t *testing.T) {
	for _, policy := range []string{routerconfig.PolicyLeastInflight, routerconfig.PolicyCacheAware} {
		t.Run(policy, func(t *testing.T) {
			e0, e1 := newLoRAEngine(t, "sql"), newLoRAEngine(t)
			r, _, _ := newTestRouter(t, routerconfig.Config{DecodePolicy: policy, Health: routerconfig.HealthConfig{Interval: 5 * time.Millisecond},
				Backends: []routerconfig.BackendConfig{{Name: "d0", URL: e0.URL, Role: routerconfig.RoleDecode}, {Name: "d1", URL: e1.URL, Role: routerconfig.RoleDecode}}})
			runRouter(t, r)
			// picks are where eight requests for sql went, each a prompt of its own.
			picks := func() map[string]int {
				out := map[string]int{}
				for i := range 8 {
					l, err := r.Acquire(context.Background(), routerconfig.RoleDecode, Hint{Model: "sql", LoRA: "sql", Text: fmt.Sprintf("prompt %d of the sql adapter", i)})
					if err != nil {
						t.Fatalf("acquire: %v", err)
					}
					out[l.Backend().Name]++
					l.Release(Result{Status: 200})
				}
				return out
			}
			listed := func(name string, want bool) func() bool {
				return func() bool {
					return backendByName(t, r, name).Serves("sql") == want && backendByName(t, r, name).Models() != nil
				}
			}
			testutil.Eventually(t, testutil.Timeout, listed("d1", false), "d1's models listed")
			testutil.Eventually(t, testutil.Timeout, func() bool { return r.Adapter("sql") }, "sql known as an adapter")
			if got := picks(); got["d1"] != 0 {
				t.Fatalf("sql went to %v; only d0 serves it", got)
			}

			e1.adapters.Store(&[]string{"sql"}) // d1 loads it
			testutil.Eventually(t, testutil.Timeout, listed("d1", true), "d1 lists sql")
			if got := picks(); got["d1"] == 0 {
				t.Fatalf("sql went to %v; d1 serves it too now", got)
			}

			e0.adapters.Store(&[]string{}) // d0 unloads it
			testutil.Eventually(t, testutil.Timeout, listed("d0", false), "d0 no longer lists sql")
			if got := picks(); got["d0"] != 0 {
				t.Fatalf("sql went to %v; d0 no longer serves it", got)
			}
			if !r.Adapter("sql") {
				t.Fatal("sql no longer known as an adapter while d1 serves it")
			}
		})
	}
}
