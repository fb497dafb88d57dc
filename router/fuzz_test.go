package router

import (
	"testing"

	"github.com/pdproxy/pdproxy/router/routerconfig"
	"gopkg.in/yaml.v3"
)

// FuzzConfigYAML checks that no config text makes the parser or Validate panic, and that
// a config Validate accepts builds a router.
func FuzzConfigYAML(f *testing.F) {
	f.Add("backends: [{url: 'http://d:1', role: decode}]\n")
	f.Add("backends: [{url: 'http://d:1', role: decode}]\nhealth: {interval: 0}\n")
	f.Add("health: {interval: 5s, timeout: 1s, path: /h}\nqueue: {size: -1}\n")
	f.Add("health: [1, 2]\n")
	f.Add("health: {interval: [x]}\n")
	f.Add("backends: [{url: 'http://pool:1', role: decode, discover: dns, refresh: 1s}]\n")
	f.Fuzz(func(t *testing.T, text string) {
		var c routerconfig.Config
		if err := yaml.Unmarshal([]byte(text), &c); err != nil {
			return
		}
		if err := c.Validate(); err != nil {
			return
		}
		c.Resolver = newFakeResolver() // every name unknown: a fuzz run never asks the network
		if _, err := New(c, nil, nil); err != nil {
			t.Fatalf("Validate accepted a config New refuses: %v", err)
		}
	})
}
