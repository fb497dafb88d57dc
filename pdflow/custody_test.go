package pdflow

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"strings"
	"testing"
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
