package pdflow

import (
	"context"
	"time"

	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// noBackends is a router with no backend at all: every lease is refused with ErrNoBackend,
// for the tests of the relay, which never asks for one.
type noBackends struct{}

func (noBackends) Acquire(context.Context, routerconfig.Role, router.Hint) (*router.Lease, error) {
	return nil, router.ErrNoBackend
}
func (noBackends) Available(routerconfig.Role) []*router.Backend { return nil }
func (noBackends) Has(routerconfig.Role) bool                    { return false }
func (noBackends) Usable(*router.Backend) bool                   { return false }
func (noBackends) Ready() bool                                   { return false }
func (noBackends) Backends() []router.BackendStatus              { return nil }
func (noBackends) Models(routerconfig.Role) ([]string, bool)     { return nil, false }
func (noBackends) Heads(routerconfig.Role, router.Hint, []int) ([]router.Head, time.Duration) {
	return nil, 0
}
func (noBackends) SpreadEngines(routerconfig.Role, router.Hint) []string { return nil }
