package pdflow

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/pdproxy/pdproxy/lifecycle"
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
