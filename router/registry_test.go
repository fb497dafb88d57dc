package router

import (
	"testing"

	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// Every policy config may name is one the router builds, and the router builds no other:
// the table of names and needs and the table of constructors are one list.
func TestEveryPolicyConfigNamesIsBuilt(t *testing.T) {
	for _, name := range routerconfig.PolicyNames() {
		if p, ok := NewPolicy(name, 0); !ok || p == nil {
			t.Errorf("NewPolicy(%q) = %v, %v; config accepts the name", name, p, ok)
		}
	}
	for name := range constructors {
		if _, ok := routerconfig.CapsOf(name); !ok {
			t.Errorf("the router builds %q, which config refuses", name)
		}
	}
}
