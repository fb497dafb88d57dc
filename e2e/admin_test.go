package e2e

import (
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
)

func TestAdminListenerServesPprofOnlyWhenSet(t *testing.T) {
	t.Run("with admin_listen the profiler answers there and not on the proxy's listener", func(t *testing.T) {
		s := startStack(t, fastSims, func(c *app.Config) { c.AdminListen = "127.0.0.1:0" })
		admin := s.m.AdminAddr()
		if admin == "" {
			t.Fatal("AdminAddr is empty with admin_listen set")
		}
		status, body := adminGet(t, "http://"+admin+"/debug/pprof/")
		if status != http.StatusOK || !strings.Contains(body, "goroutine") {
			t.Fatalf("GET /debug/pprof/ on the admin listener: %d %.200s", status, body)
		}
		if status, _ := adminGet(t, "http://"+admin+"/debug/pprof/heap?debug=1"); status != http.StatusOK {
			t.Errorf("GET /debug/pprof/heap on the admin listener: %d", status)
		}
		if status, _ := adminGet(t, s.url+"/debug/pprof/"); status != http.StatusNotFound {
			t.Errorf("GET /debug/pprof/ on the proxy's listener: %d, want 404", status)
		}
	})
	t.Run("without it there is no admin listener", func(t *testing.T) {
		s := startStack(t, fastSims)
		if admin := s.m.AdminAddr(); admin != "" {
			t.Fatalf("AdminAddr = %q with admin_listen unset", admin)
		}
	})
	t.Run("--admin-listen sets it, and its absence means none", func(t *testing.T) {
		c, err := app.LoadConfig([]string{"--admin-listen", "127.0.0.1:6060"}, io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		if c.AdminListen != "127.0.0.1:6060" {
			t.Fatalf("AdminListen = %q", c.AdminListen)
		}
		if c, err := app.LoadConfig(nil, io.Discard); err != nil || c.AdminListen != "" {
			t.Fatalf("default AdminListen = %q (%v), want none", c.AdminListen, err)
		}
	})
}

func adminGet(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("read %s: %v", url, err)
	}
	return resp.StatusCode, string(b)
}
