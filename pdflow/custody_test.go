package pdflow

import (
	"context"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/lifecycle"
	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// A step that may end the request's custody returns it, and its caller must take what comes
// back: a call whose custody is dropped (its result unused, or assigned to _) keeps using, or
// loses, a custody the step may have ended. This holds the flow's code to that, as a vet
// check would.
func TestNoCallDropsTheCustodyAStepReturns(t *testing.T) {
	fset := token.NewFileSet()
	names, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	var files []*ast.File
	for _, n := range names {
		if strings.HasSuffix(n, "_test.go") {
			continue
		}
		src, err := os.ReadFile(n)
		if err != nil {
			t.Fatal(err)
		}
		f, err := parser.ParseFile(fset, n, src, 0)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, f)
	}
	// The functions and methods whose first result is a custody.
	returns := map[string]bool{}
	for _, f := range files {
		for _, d := range f.Decls {
			fd, ok := d.(*ast.FuncDecl)
			if !ok || fd.Type.Results == nil || len(fd.Type.Results.List) == 0 {
				continue
			}
			if id, ok := fd.Type.Results.List[0].Type.(*ast.Ident); ok && id.Name == "custody" {
				returns[fd.Name.Name] = true
			}
		}
	}
	if len(returns) < 10 {
		t.Fatalf("found %d steps returning a custody (%v): the check reads the flow wrongly", len(returns), returns)
	}
	called := func(e ast.Expr) (string, bool) {
		c, ok := ast.Unparen(e).(*ast.CallExpr)
		if !ok {
			return "", false
		}
		var name string
		switch fn := c.Fun.(type) {
		case *ast.SelectorExpr:
			name = fn.Sel.Name
		case *ast.Ident:
			name = fn.Name
		}
		return name, returns[name]
	}
	for _, f := range files {
		ast.Inspect(f, func(n ast.Node) bool {
			var dropped string
			switch s := n.(type) {
			case *ast.ExprStmt:
				if name, ok := called(s.X); ok {
					dropped = name
				}
			case *ast.GoStmt:
				if name, ok := called(s.Call); ok {
					dropped = name
				}
			case *ast.DeferStmt:
				if name, ok := called(s.Call); ok {
					dropped = name
				}
			case *ast.AssignStmt:
				if len(s.Rhs) == 1 && len(s.Lhs) > 0 {
					if name, ok := called(s.Rhs[0]); ok {
						if id, ok := s.Lhs[0].(*ast.Ident); ok && id.Name == "_" {
							dropped = name
						}
					}
				}
			}
			if dropped != "" {
				t.Errorf("%s: the custody %s returns is dropped", fset.Position(n.Pos()), dropped)
			}
			return true
		})
	}
}

// A panic's safety net ends the holds the request handed to decodes that no decoder
// acknowledged, unless a release took one on: that one its release ends, as it would have.
func TestAPanicLeavesAHoldAReleaseTookOnToIt(t *testing.T) {
	table := lifecycle.New(lifecycle.Config{}, zap.NewNop(), prometheus.NewRegistry())
	held := func(id string) *handoff {
		if err := table.Begin(id, "/v1/completions", nil); err != nil {
			t.Fatal(err)
		}
		table.StartPrefill(id, "p0")
		table.Prefilled(id, []byte(`{"remote_block_ids":[1]}`))
		_, hold, _ := table.StartDecode(id, "d0")
		return &handoff{held: unsentHold{heldKV: heldKV{hold: hold}}}
	}
	open, withdrawn, claimed, acked := held("open"), held("withdrawn"), held("claimed"), held("acked")
	withdrawn.withdraw(nil, nil)
	claimed.withdraw(nil, nil)
	claimed.held.hold.Claim() // a release took it on
	acked.ack()
	for _, ho := range []*handoff{open, withdrawn, claimed, acked} {
		ho.abandon()
	}
	if !open.held.hold.Released() || !withdrawn.held.hold.Released() {
		t.Error("a hold no decoder acknowledged and no release took on was left held")
	}
	if claimed.held.hold.Released() {
		t.Error("the net ended a hold its release had taken on")
	}
	if !claimed.held.hold.Release(lifecycle.ReleaseDrained) {
		t.Error("the release could not end the hold it took on")
	}
	if n := table.OutstandingHolds(); n != 0 {
		t.Errorf("%d holds outstanding", n)
	}
}

// panicsOnAcquire is a router with a bug: every lease it is asked for panics.
type panicsOnAcquire struct{ noBackends }

func (panicsOnAcquire) Acquire(context.Context, routerconfig.Role, router.Hint) (*router.Lease, error) {
	panic("a bug picking a decoder for a drain")
}

type engines struct{}

func (engines) Engine(kind string) (routerconfig.Engine, bool) { return engine.Lookup(kind) }
func (engines) Kinds() []string                                { return engine.Kinds() }

// A panic in a release, which runs after its handler returned, does not take the proxy down:
// it is counted, and the hold it was releasing ends as expired, with the request's entry.
func TestAPanicInABackgroundReleaseEndsItsHoldAndEntry(t *testing.T) {
	reg := prometheus.NewRegistry()
	rt, err := router.New(routerconfig.Config{Backends: []routerconfig.BackendConfig{{Name: "p0", URL: "http://127.0.0.1:1", Role: routerconfig.RolePrefill, Engine: "vllm"},
		{Name: "d0", URL: "http://127.0.0.1:2", Role: routerconfig.RoleDecode, Engine: "vllm"}},
		Engines: engines{}, Health: routerconfig.HealthConfig{Interval: -1}}, zap.NewNop(), reg)
	if err != nil {
		t.Fatal(err)
	}
	p := rt.Available(routerconfig.RolePrefill)[0]
	table := lifecycle.New(lifecycle.Config{}, zap.NewNop(), reg)
	m := NewMetrics(reg)
	f := New(Config{KVRelease: ReleaseDrain}, panicsOnAcquire{}, table, zap.NewNop(), m, false)
	if err := table.Begin("r", "/v1/completions", nil); err != nil {
		t.Fatal(err)
	}
	table.StartPrefill("r", "p0")
	table.Prefilled("r", []byte(`{"remote_block_ids":[1]}`))
	_, hold, _ := table.ClientGone("r")
	req := &api.Request{Route: "/v1/completions", API: engine.APICompletions, Fields: mustFields(t, `{"model":"m","prompt":"hi"}`)}
	f.startRelease(ReleaseDrain, custody{id: "r", engineID: "e-r"}, heldKV{hold: hold, req: req, prefill: p})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := f.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if !hold.Released() || table.OutstandingHolds() != 0 || table.Len() != 0 {
		t.Errorf("released %v, %d holds outstanding, %d entries; want the hold ended and the entry gone", hold.Released(), table.OutstandingHolds(), table.Len())
	}
	if n := testutil.Value(t, reg, "pdproxy_panics_total", nil); n != 1 {
		t.Errorf("pdproxy_panics_total = %v, want 1", n)
	}
	if n := testutil.Value(t, reg, "pdproxy_kv_releases_total", map[string]string{"reason": "expired"}); n != 1 {
		t.Errorf("kv_releases_total{expired} = %v, want 1", n)
	}
}

func mustFields(t *testing.T, body string) *engine.Fields {
	t.Helper()
	f, err := engine.ParseFields([]byte(body))
	if err != nil {
		t.Fatal(err)
	}
	return f
}
