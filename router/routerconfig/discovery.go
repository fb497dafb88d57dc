package routerconfig

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"time"
)

// DiscoverDNS is the one value of BackendConfig.Discover: the entry is a pool, one backend per
// A or AAAA record of its URL's host (a Kubernetes headless Service names every ready pod so).
const DiscoverDNS = "dns"

// DefaultRefresh is how often a discover entry's name is resolved again when refresh is unset.
const DefaultRefresh = 5 * time.Second

// Resolver looks up the addresses of a name. *net.Resolver is one; tests give one whose Dial
// reaches their own DNS server, or a fake.
type Resolver interface {
	// LookupNetIP is net.Resolver's: network "ip" asks for A and AAAA records.
	LookupNetIP(ctx context.Context, network, host string) ([]netip.Addr, error)
}

var _ Resolver = (*net.Resolver)(nil)

// setDiscoveryDefaults fills the refresh of discover entries.
func (c *Config) setDiscoveryDefaults() {
	for i := range c.Backends {
		if b := &c.Backends[i]; b.Discover != "" && b.Refresh == 0 {
			b.Refresh = DefaultRefresh
		}
	}
}

// checkDiscovery names what is wrong with the discover entries, as Validate does.
func (c *Config) checkDiscovery() []error {
	var errs []error
	for i, b := range c.Backends {
		f := fmt.Sprintf("backends[%d]", i)
		switch b.Discover {
		case "":
			if b.Refresh != 0 {
				// Silently ignored, it would make the reader believe the url is re-resolved.
				errs = append(errs, fmt.Errorf("%s.refresh: set, but discover is not: a plain url is never resolved again; set discover: %s, or remove refresh", f, DiscoverDNS))
			}
			continue
		case DiscoverDNS:
		default:
			errs = append(errs, fmt.Errorf("%s.discover: %q is not %q (or empty for one url)", f, b.Discover, DiscoverDNS))
			continue
		}
		if b.Refresh < 0 {
			errs = append(errs, fmt.Errorf("%s.refresh: %v is negative", f, b.Refresh))
		}
		if b.Name == "" {
			continue // Validate says so
		}
		for j, o := range c.Backends {
			if j != i && strings.HasPrefix(o.Name, b.Name+"/") {
				errs = append(errs, fmt.Errorf("backends[%d].name: %q is among the names of the backends that backends[%d] discovers (%s/<address>:<port>); choose another", j, o.Name, i, b.Name))
			}
		}
	}
	return errs
}
