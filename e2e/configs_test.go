package e2e

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
)

// TestExampleConfigsParseAndValidate: every file in configs/ is one a user can start from.
func TestExampleConfigsParseAndValidate(t *testing.T) {
	files, err := filepath.Glob("../configs/*.yaml")
	if err != nil || len(files) < 3 {
		t.Fatalf("configs/*.yaml: %v %v", files, err)
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			data, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			c, err := app.ParseConfig(data)
			if err != nil {
				t.Fatalf("does not parse: %v", err)
			}
			if err := c.Proxy.Validate(); err != nil {
				t.Fatalf("does not validate: %v", err)
			}
			rc := c.Router
			rc.Engines = app.EngineCatalog{}
			if len(rc.Backends) > 0 {
				if err := rc.Validate(); err != nil {
					t.Fatalf("does not validate: %v", err)
				}
			}
		})
	}
}
